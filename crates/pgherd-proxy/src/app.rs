//! The state every task shares: the current config, the nodes, the pools, the clients, TLS,
//! and the shutdown signal. Passed around as `Arc<App>`; there are no globals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::Mutex;
use pgherd_config::Config;
use tokio::sync::watch;

use crate::clients::ClientRegistry;
use crate::nodes::{NodeState, Nodes};
use crate::pool::{ConnectContext, NodeAddress, Pool};
use crate::routing::Router;
use crate::server::ServerCredentials;
use crate::shared_swap::{SharedSwap, SwapCache};
use crate::tls;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    database: String,
    user: String,
    node: String,
}

/// A session's copy of the config, checked against the shared one before each use
/// ([`App::config_cache`]).
pub type ConfigCache = SwapCache<Config>;

pub struct App {
    config: SharedSwap<Config>,
    pub nodes: Arc<Nodes>,
    /// Routing decisions and function catalogs, per server database.
    routers: Mutex<HashMap<String, Arc<Router>>>,
    pub clients: Arc<ClientRegistry>,
    /// Counts schema changes sessions ran (and rollbacks of transactions that ran one):
    /// server-side statements prepared before the latest are prepared again before use, as
    /// a type or table they name may be another now.
    pub schema_generation: std::sync::atomic::AtomicU64,
    /// Where the schema changes made through this instance end in the WAL: reads under
    /// read-your-writes wait for replicas to pass them.
    pub schema_changes: Arc<crate::schema_changes::SchemaChanges>,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    connect: ArcSwap<ConnectContext>,
    client_tls: ArcSwapOption<tokio_rustls::TlsAcceptor>,
    shutdown_tx: watch::Sender<bool>,
    /// Keys the fake salts of mock SCRAM exchanges for unknown users.
    pub mock_secret: [u8; 32],
    pub started_at: SystemTime,
    /// How pgherd logs in to servers as each user; shared by that user's pools.
    credentials: Mutex<HashMap<String, Arc<Mutex<ServerCredentials>>>>,
    next_server_id: Arc<AtomicU64>,
    pub reloads: AtomicU64,
    /// Connections for auth_query, per node.
    auth_pools: Mutex<HashMap<String, Arc<Pool>>>,
    /// Startup settings shared by the clients that sent the same ones.
    pub settings_interner: crate::relay::params::Interner,
    /// Failover decisions and actions, for `SHOW EVENTS` and the notification command.
    pub events: crate::events::Events,
    /// Errors pgherd itself answered requests with (no server had them), for the metrics.
    pub own_errors: crate::counters::ErrorClasses,
    /// With `[dcs]`: this instance's side of the agreement with the others (fixed at start).
    pub dcs: Option<Arc<crate::dcs::Dcs>>,
    /// With `[sharding]`: the shards behind this endpoint (their number fixed at start).
    pub shards: Option<Arc<crate::shards::Shards>>,
    /// The result cache, per server database.
    pub caches: crate::result_cache::Caches,
    /// The replication sets `[sets]` names, as last read from the primary.
    pub sets: crate::sets_watch::SetsWatch,
    /// Upgrades of the binary: giving this process's duties and clients to a new one, or
    /// taking them from an old one.
    pub handover: crate::handover::HandoverState,
    /// Idle clients parked without a task (`client/parked.rs`): set once its task runs.
    pub parking: std::sync::OnceLock<Arc<crate::client::ParkingLot>>,
}

impl App {
    pub fn new(config: Config) -> Result<Arc<App>, String> {
        let connect = connect_context(&config, Arc::new(AtomicU64::new(1)))?;
        let acceptor = match &config.client_tls {
            Some(settings) => Some(Arc::new(tls::client_acceptor(settings)?)),
            None => None,
        };
        let (shutdown_tx, _) = watch::channel(false);
        let thresholds = crate::nodes::CheckThresholds {
            rejoin_after_checks: config.routing.rejoin_after_checks,
            failures_before_down: config.cluster.health_check_failures_before_down,
        };
        let nodes = Arc::new(Nodes::new(&config.nodes, thresholds));
        nodes.set_local_zone(config.proxy.zone.clone());
        if config.dcs.is_some() {
            // Until it leads or has read the leader's view, it does not know where writes go.
            nodes.change(pgherd_failover::Change::AwaitView(true));
        }
        let listen_port = config.proxy.listen.first().map_or(0, |a| a.port());
        let dcs = config
            .dcs
            .clone()
            .map(|settings| Arc::new(crate::dcs::Dcs::new(settings, listen_port)));
        let shards = config.sharding.as_ref().map(|sharding| {
            Arc::new(crate::shards::Shards::new(
                sharding,
                nodes.clone(),
                thresholds,
            ))
        });
        Ok(Arc::new(App {
            dcs,
            shards,
            nodes,
            routers: Mutex::new(HashMap::new()),
            caches: Default::default(),
            sets: Default::default(),
            handover: Default::default(),
            parking: Default::default(),
            schema_generation: std::sync::atomic::AtomicU64::new(1),
            schema_changes: Default::default(),
            events: Default::default(),
            own_errors: Default::default(),
            clients: Arc::new(ClientRegistry::new()),
            pools: Mutex::new(HashMap::new()),
            next_server_id: connect.next_server_id.clone(),
            connect: ArcSwap::from_pointee(connect),
            client_tls: ArcSwapOption::new(acceptor),
            shutdown_tx,
            mock_secret: rand::random(),
            started_at: SystemTime::now(),
            credentials: Mutex::new(HashMap::new()),
            reloads: AtomicU64::new(0),
            auth_pools: Mutex::new(HashMap::new()),
            settings_interner: Default::default(),
            config: SharedSwap::from_pointee(config),
        }))
    }

    pub fn config(&self) -> Arc<Config> {
        self.config.load_full()
    }

    /// The config for looks on the data path: unlike [`Self::config`] its loads write no
    /// reference count (which every worker would write for every request), and unlike a
    /// plain load they take no slot of the thread's debt list while the config is unchanged.
    pub fn config_cache(&self) -> ConfigCache {
        self.config.cache()
    }

    /// This instance may decide for the cluster: it runs alone, or leads the instances; and
    /// has not given its duties to a new process in an upgrade.
    pub fn may_act(&self) -> bool {
        self.dcs.as_ref().is_none_or(|dcs| dcs.is_leader()) && !self.handover.handed_over()
    }

    /// Whether this instance may route a write now: alone, always; one of several, while its
    /// lease is known valid.
    pub fn may_route_writes(&self) -> bool {
        self.dcs
            .as_ref()
            .is_none_or(|dcs| dcs.write_lease().may_route_writes())
    }

    pub fn connect_context(&self) -> Arc<ConnectContext> {
        self.connect.load_full()
    }

    /// Every cluster this instance keeps: `nodes` (shard 0's), then the other shards'.
    pub fn clusters(&self) -> Vec<Arc<Nodes>> {
        match &self.shards {
            Some(shards) => shards.clusters(),
            None => vec![self.nodes.clone()],
        }
    }

    /// The node named `name` (names are unique over every shard) and its cluster.
    pub fn node_named(&self, name: &str) -> Option<(Arc<Nodes>, Arc<NodeState>)> {
        self.clusters()
            .into_iter()
            .find_map(|cluster| cluster.get(name).map(|node| (cluster, node)))
    }

    pub fn client_tls(&self) -> Option<Arc<tokio_rustls::TlsAcceptor>> {
        self.client_tls.load_full()
    }

    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown_tx.subscribe()
    }

    pub fn is_shutting_down(&self) -> bool {
        *self.shutdown_tx.borrow()
    }

    pub fn begin_shutdown(&self) {
        self.shutdown_tx.send_replace(true);
        self.handover.release_listeners();
        self.clients.signal_all(crate::clients::SIGNAL_SHUTDOWN);
        for pool in self.pools() {
            pool.drop_idle();
        }
    }

    /// The credentials pgherd uses on servers for `user`, shared by all of that user's pools.
    pub fn user_credentials(&self, user: &str) -> Arc<Mutex<ServerCredentials>> {
        let mut map = self.credentials.lock();
        map.entry(user.to_owned())
            .or_insert_with(|| {
                let config = self.config();
                let entry = config.users.get(user);
                Arc::new(Mutex::new(ServerCredentials {
                    password: entry.and_then(|u| u.server_password.clone()),
                    scram_keys: None,
                    md5_hash: entry.and_then(|u| u.md5.clone()),
                }))
            })
            .clone()
    }

    /// What pgherd learnt from clients' logins about logging in to servers as each user
    /// (passthrough SCRAM keys, an md5 hash), for a new process to take over.
    pub fn learnt_credentials(
        &self,
    ) -> Vec<(
        String,
        Option<pgherd_wire::scram::ScramCredential>,
        Option<String>,
    )> {
        self.credentials
            .lock()
            .iter()
            .filter_map(|(user, credentials)| {
                let c = credentials.lock();
                (c.scram_keys.is_some() || c.md5_hash.is_some())
                    .then(|| (user.clone(), c.scram_keys.clone(), c.md5_hash.clone()))
            })
            .collect()
    }

    /// The pool for a client's (database, user) on `node`, created on first use; `None` if the
    /// database is not served.
    pub fn pool(&self, database: &str, user: &str, node: &NodeState) -> Option<Arc<Pool>> {
        let key = PoolKey {
            database: database.to_owned(),
            user: user.to_owned(),
            node: node.config.name.clone(),
        };
        if let Some(pool) = self.pools.lock().get(&key) {
            if !pool.is_closed() {
                return Some(pool.clone());
            }
        }
        let credentials = self.user_credentials(user);
        let mut pools = self.pools.lock();
        // Under the registry's lock, which a reload takes after storing its config to update
        // every pool: a pool made from the config before is in the registry by then and gets
        // the new settings, or it is made from the new config.
        let resolved = self.config().resolve(database, user)?;
        let pool = pools
            .entry(key)
            .and_modify(|existing| {
                if existing.is_closed() {
                    *existing = Arc::new(Pool::new(
                        database.to_owned(),
                        user.to_owned(),
                        resolved.server_dbname.clone(),
                        node_address(node),
                        resolved.pool.clone(),
                        credentials.clone(),
                    ));
                }
            })
            .or_insert_with(|| {
                Arc::new(Pool::new(
                    database.to_owned(),
                    user.to_owned(),
                    resolved.server_dbname.clone(),
                    node_address(node),
                    resolved.pool.clone(),
                    credentials.clone(),
                ))
            });
        Some(pool.clone())
    }

    /// A logged-in session's pool on `node` ([`Self::pool`]), without the registry when
    /// `cache` already holds `node`'s open pool: the common case takes no lock and allocates
    /// nothing, also for a session whose reads go round several nodes.
    pub fn pool_cached(
        &self,
        cache: &mut PoolCache,
        database: &str,
        user: &str,
        node: &Arc<NodeState>,
    ) -> Result<Arc<Pool>, pgherd_wire::PgError> {
        if let Some(pool) = cache.take_open(node) {
            return Ok(pool);
        }
        let pool = self.pool(database, user, node).ok_or_else(|| {
            pgherd_wire::PgError::error(
                pgherd_wire::SqlState::INVALID_CATALOG_NAME,
                format!("database \"{database}\" is no longer served by pgherd"),
            )
        })?;
        cache.put_last(node.clone(), pool.clone());
        Ok(pool)
    }

    /// The pool auth_query runs through on `node`.
    pub fn auth_pool(&self, auth: &pgherd_config::AuthQuery, node: &NodeState) -> Arc<Pool> {
        let mut pools = self.auth_pools.lock();
        let pool = pools.entry(node.config.name.clone()).or_insert_with(|| {
            let mut settings = self.config().pool.clone();
            settings.max_size = 2;
            settings.min_size = 0;
            Arc::new(Pool::new(
                auth.database.clone(),
                auth.user.clone(),
                auth.database.clone(),
                node_address(node),
                settings,
                Arc::new(Mutex::new(ServerCredentials {
                    password: auth.password.clone(),
                    scram_keys: None,
                    md5_hash: None,
                })),
            ))
        });
        pool.clone()
    }

    /// Removes `pool` again if nothing uses it: its first login was refused (a database or
    /// user that does not exist), and a pool kept for every name tried would grow without
    /// bound.
    pub fn forget_pool_if_unused(&self, pool: &Arc<Pool>) {
        let snapshot = pool.snapshot();
        if snapshot.idle + snapshot.lent + snapshot.connecting > 0 || snapshot.waiting > 0 {
            return;
        }
        let mut pools = self.pools.lock();
        pools.retain(|_, p| !Arc::ptr_eq(p, pool));
        pool.close();
    }

    /// The router of a server database, created (and its catalog loading) on first use.
    pub fn router(self: &Arc<Self>, server_dbname: &str) -> Arc<Router> {
        let mut routers = self.routers.lock();
        if let Some(router) = routers.get(server_dbname) {
            return router.clone();
        }
        let router = Router::start(self, server_dbname.to_owned());
        routers.insert(server_dbname.to_owned(), router.clone());
        router
    }

    /// Closes the idle connections to `node` in every pool: after a failure they are likely
    /// dead, and each would cost a client's request a retry.
    pub fn drop_idle_connections(&self, node: &NodeState) {
        for pool in self.pools.lock().values() {
            if pool.node.name == node.config.name {
                pool.drop_idle();
            }
        }
    }

    /// The routers by server database name, for the metrics.
    pub fn routers(&self) -> Vec<(String, Arc<Router>)> {
        let mut routers: Vec<_> = self
            .routers
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        routers.sort_by(|a, b| a.0.cmp(&b.0));
        routers
    }

    pub fn pools(&self) -> Vec<Arc<Pool>> {
        let mut pools: Vec<_> = self.pools.lock().values().cloned().collect();
        pools.sort_by(|a, b| {
            (&a.database, &a.user, &a.node.name).cmp(&(&b.database, &b.user, &b.node.name))
        });
        pools
    }

    /// The new config's `[sharding]` if its layout differs from the running one and may be put
    /// in force now ([`crate::shards::check_layout_change`]): only while a drained `PAUSE` of
    /// every database holds every session, so that none runs a transaction across the change.
    fn grown_layout<'a>(
        &self,
        old: &Config,
        new: &'a Config,
    ) -> Result<Option<&'a pgherd_config::Sharding>, String> {
        let (Some(was), Some(now)) = (&old.sharding, &new.sharding) else {
            return match old.sharding.is_some() == new.sharding.is_some() {
                true => Ok(None),
                false => Err(
                    "[sharding] comes or goes only with a restart; the running config is kept"
                        .to_owned(),
                ),
            };
        };
        if was.map == now.map {
            return Ok(None);
        }
        crate::shards::check_layout_change(&was.map, &now.map).map_err(|e| {
            format!("the shard layout cannot change so: {e}; the running config is kept")
        })?;
        let in_use = crate::control::sum_over_pools(self, None, |p| p.snapshot().lent);
        if !self.nodes.view().paused_all || in_use > 0 {
            return Err(format!(
                "the shard layout changes only while pgherd holds every session: PAUSE (all databases), RELOAD, then RESUME{}; the running config is kept",
                match in_use {
                    0 => String::new(),
                    n => format!(" ({n} server connection(s) are in use)"),
                }
            ));
        }
        Ok(Some(now))
    }

    /// Applies a new config without dropping clients. Settings that need a restart (listen
    /// addresses, worker threads) are reported and keep their old values.
    pub fn apply(&self, new: Config) -> Result<Reloaded, String> {
        let old = self.config();
        let mut notes = Vec::new();
        // A shard's nodes may change (`pgherd shard move` puts a shard on another cluster);
        // the layout only grows, and only while every session is held (`grown_layout`).
        let grown = self.grown_layout(&old, &new)?;
        if new.proxy.listen != old.proxy.listen {
            notes.push("pgherd.listen changes take effect after a restart".to_owned());
        }
        if new.proxy.workers != old.proxy.workers {
            notes.push("pgherd.workers changes take effect after a restart".to_owned());
        }
        if new.api.listen != old.api.listen {
            notes.push("api.listen changes take effect after a restart".to_owned());
        }
        // Build everything fallible first, so a bad certificate leaves the old config in place.
        let connect = connect_context(&new, self.next_server_id.clone())?;
        let acceptor = match &new.client_tls {
            Some(settings) => Some(Arc::new(tls::client_acceptor(settings)?)),
            None => None,
        };
        self.connect.store(Arc::new(connect));
        self.client_tls.store(acceptor);
        let mut new_shards = Vec::new();
        if let (Some(shards), Some(sharding)) = (&self.shards, grown) {
            let thresholds = crate::nodes::CheckThresholds {
                rejoin_after_checks: new.routing.rejoin_after_checks,
                failures_before_down: new.cluster.health_check_failures_before_down,
            };
            let count = shards.count();
            let added: Vec<Arc<Nodes>> = sharding.shard_nodes[count as usize..]
                .iter()
                .map(|nodes| Arc::new(Nodes::new(nodes, thresholds)))
                .collect();
            new_shards = (count..).zip(added.iter().cloned()).collect();
            shards.grow(sharding.map.clone(), added);
            // The new shards' collations are checked with the next catalog reading.
            for router in self.routers.lock().values() {
                router.catalog_changed();
            }
            notes.push(format!(
                "the shard layout changed: {} shard(s) now, sessions plan by it from their next transaction",
                sharding.shard_nodes.len()
            ));
        }
        // Each shard's cluster with its nodes in the new config (shard 0's: `nodes`).
        let node_lists = match &new.sharding {
            Some(sharding) => sharding.shard_nodes.as_slice(),
            None => std::slice::from_ref(&new.nodes),
        };
        let mut started: Vec<(Arc<Nodes>, Arc<NodeState>)> = Vec::new();
        for (cluster, nodes) in self.clusters().into_iter().zip(node_lists) {
            cluster.set_local_zone(new.proxy.zone.clone());
            cluster
                .rejoin_after_checks
                .store(new.routing.rejoin_after_checks, Ordering::Relaxed);
            cluster.failures_before_down.store(
                new.cluster.health_check_failures_before_down,
                Ordering::Relaxed,
            );
            let added = cluster.reconcile(nodes);
            started.extend(added.into_iter().map(|node| (cluster.clone(), node)));
        }
        if !started.is_empty() {
            notes.push(format!(
                "nodes added: {}",
                started
                    .iter()
                    .map(|(_, n)| n.name().to_owned())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        {
            let mut creds = self.credentials.lock();
            for (user, entry) in creds.iter_mut() {
                let fresh = new.users.get(user);
                let mut c = entry.lock();
                c.password = fresh.and_then(|u| u.server_password.clone());
                c.md5_hash = fresh.and_then(|u| u.md5.clone());
                let old_verifier = old.users.get(user).and_then(|u| u.scram.as_ref());
                if fresh.and_then(|u| u.scram.as_ref()) != old_verifier {
                    c.scram_keys = None;
                }
            }
        }
        self.caches.reconfigure(&new.cache);
        self.config.store(Arc::new(new));
        // Auth settings may have changed; the next lookup builds fresh pools.
        for pool in std::mem::take(&mut *self.auth_pools.lock()).into_values() {
            pool.close();
        }
        let config = self.config();
        let mut pools = self.pools.lock();
        pools.retain(|key, pool| {
            let node_exists = config.node_of_any_shard(&key.node).is_some_and(|n| {
                n.host == pool.node.host
                    && n.port == pool.node.port
                    && n.socket_dir == pool.node.socket_dir
            });
            match config.resolve(&key.database, &key.user) {
                Some(resolved) if node_exists && resolved.server_dbname == pool.server_dbname => {
                    pool.update_settings(resolved.pool);
                    true
                }
                _ => {
                    pool.close();
                    false
                }
            }
        });
        self.reloads.fetch_add(1, Ordering::Relaxed);
        Ok(Reloaded {
            new_shards,
            notes,
            new_nodes: started,
        })
    }

    /// Reads the config file again and applies it.
    pub fn reload(&self) -> Result<Reloaded, String> {
        let path = self.config().source.clone();
        let new = Config::load(&path).map_err(|e| e.to_string())?;
        self.apply(new)
    }
}

/// What a reload changed.
#[derive(Default)]
pub struct Reloaded {
    /// Things the operator should know (settings that need a restart, nodes added).
    pub notes: Vec<String>,
    /// Nodes added by the reload, each with its shard's cluster; their monitors must be
    /// started.
    pub new_nodes: Vec<(Arc<Nodes>, Arc<NodeState>)>,
    /// Shards the reload added, by number: their monitors and failover must be started.
    pub new_shards: Vec<(u32, Arc<Nodes>)>,
}

/// What opening server connections needs from `config` (TLS to servers) with server ids from
/// `next_server_id`; for the app, and for commands that connect to nodes themselves.
pub fn connect_context(
    config: &Config,
    next_server_id: Arc<AtomicU64>,
) -> Result<ConnectContext, String> {
    Ok(ConnectContext {
        tls_mode: config.server_tls.mode,
        tls: tls::server_connector(&config.server_tls)?,
        next_server_id,
    })
}

fn node_address(node: &NodeState) -> NodeAddress {
    NodeAddress {
        name: node.config.name.clone(),
        host: node.config.host.clone(),
        port: node.config.port,
        socket_dir: node.config.socket_dir.clone(),
    }
}

/// A session's pools by node, the last used first (one inline: a session on one node
/// allocates nothing). Closed pools and removed nodes fall out as they are met.
#[derive(Default)]
pub struct PoolCache(smallvec::SmallVec<[(Arc<NodeState>, Arc<Pool>); 1]>);

/// More nodes than a cluster has readers is a list that only grows with node churn.
const POOL_CACHE_MAX: usize = 8;

impl PoolCache {
    /// The node the session's last request ran on.
    pub fn last_node(&self) -> Option<&Arc<NodeState>> {
        self.0.first().map(|(node, _)| node)
    }

    /// `node`'s pool if it is held and open, made the last used.
    fn take_open(&mut self, node: &Arc<NodeState>) -> Option<Arc<Pool>> {
        let at = self.0.iter().position(|(n, _)| Arc::ptr_eq(n, node))?;
        if self.0[at].1.is_closed() {
            self.0.remove(at);
            return None;
        }
        self.0[..=at].rotate_right(1);
        Some(self.0[0].1.clone())
    }

    pub fn put_last(&mut self, node: Arc<NodeState>, pool: Arc<Pool>) {
        self.0
            .retain(|(n, p)| !Arc::ptr_eq(n, &node) && !p.is_closed());
        self.0.truncate(POOL_CACHE_MAX - 1);
        self.0.insert(0, (node, pool));
    }

    /// Forgets every pool (the last one closed under the session).
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn config(routing: &str) -> Config {
        let source = format!("[[nodes]]\nname = \"pg1\"\nport = 5432\n\n[routing]\n{routing}\n");
        Config::parse(&source, Path::new("pgherd.toml")).unwrap()
    }

    #[test]
    fn a_sessions_cached_config_sees_a_reload() {
        let app = App::new(config("max_lag_bytes = 1000")).unwrap();
        let mut cache = app.config_cache();
        assert_eq!(cache.load().routing.max_lag_bytes, 1000);
        app.apply(config("max_lag_bytes = 2000")).unwrap();
        assert_eq!(cache.load().routing.max_lag_bytes, 2000);
    }
}
