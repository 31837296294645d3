//! The PostgreSQL nodes pgherd fronts: their roles, discovered with `pg_is_in_recovery()` rather
//! than trusted from the config, and whether they answer. One monitor task per node keeps a
//! management connection open and checks it every `cluster.health_check_period_ms`.

use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pgherd_config::{ClusterSettings, NodeConfig};

use crate::pool::ConnectContext;
use crate::server::{self, ConnectSpec, QueryError, ServerConn, ServerCredentials};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Unknown,
    Primary,
    Replica,
}

impl Role {
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::Unknown => "unknown",
            Role::Primary => "primary",
            Role::Replica => "replica",
        }
    }

    fn to_u8(self) -> u8 {
        self as u8
    }

    fn from_u8(v: u8) -> Role {
        match v {
            1 => Role::Primary,
            2 => Role::Replica,
            _ => Role::Unknown,
        }
    }
}

#[derive(Debug, Default, Clone)]
pub struct NodeHealth {
    pub last_error: Option<String>,
    pub last_check: Option<SystemTime>,
    pub checks_ok: u64,
    pub checks_failed: u64,
}

#[derive(Debug)]
pub struct NodeState {
    pub config: NodeConfig,
    role: AtomicU8,
    up: AtomicBool,
    /// Set when a reload removed the node; its monitor then stops.
    retired: AtomicBool,
    health: Mutex<NodeHealth>,
}

impl NodeState {
    fn new(config: NodeConfig) -> Self {
        NodeState {
            config,
            role: AtomicU8::new(Role::Unknown.to_u8()),
            up: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            health: Mutex::new(NodeHealth::default()),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    pub fn role(&self) -> Role {
        Role::from_u8(self.role.load(Ordering::Acquire))
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Up and in `role`: two atomic loads, cheap enough for every transaction.
    pub fn is_usable_as(&self, role: Role) -> bool {
        self.is_up() && self.role() == role
    }

    pub fn health(&self) -> NodeHealth {
        self.health.lock().clone()
    }

    fn record(&self, outcome: Result<Role, String>) {
        let mut health = self.health.lock();
        health.last_check = Some(SystemTime::now());
        match outcome {
            Ok(role) => {
                let previous = self.role();
                let was_up = self.is_up();
                self.role.store(role.to_u8(), Ordering::Release);
                self.up.store(true, Ordering::Release);
                health.checks_ok += 1;
                health.last_error = None;
                if previous != role || !was_up {
                    tracing::info!(node = %self.config.name, role = role.as_str(), "node is up");
                }
            }
            Err(error) => {
                if self.is_up() || health.checks_failed == 0 {
                    tracing::warn!(node = %self.config.name, %error, "node health check failed");
                }
                self.up.store(false, Ordering::Release);
                health.checks_failed += 1;
                health.last_error = Some(error);
            }
        }
    }

    /// "pg1 (replica)" or "pg1 (down: connection refused)", for error messages.
    pub fn describe(&self) -> String {
        if self.is_up() {
            format!("{} ({})", self.config.name, self.role().as_str())
        } else {
            let error = self
                .health()
                .last_error
                .unwrap_or_else(|| "not checked yet".into());
            format!("{} (down: {error})", self.config.name)
        }
    }
}

pub struct Nodes {
    list: ArcSwap<Vec<Arc<NodeState>>>,
    next_replica: AtomicUsize,
}

impl Nodes {
    pub fn new(configs: &[NodeConfig]) -> Self {
        Nodes {
            list: ArcSwap::from_pointee(
                configs
                    .iter()
                    .cloned()
                    .map(NodeState::new)
                    .map(Arc::new)
                    .collect(),
            ),
            next_replica: AtomicUsize::new(0),
        }
    }

    pub fn all(&self) -> Arc<Vec<Arc<NodeState>>> {
        self.list.load_full()
    }

    pub fn get(&self, name: &str) -> Option<Arc<NodeState>> {
        self.list
            .load()
            .iter()
            .find(|n| n.config.name == name)
            .cloned()
    }

    /// The node that accepts writes. If monitoring ever sees two, the first in config order is
    /// used and both are reported; choosing between them is the failover logic's job.
    pub fn primary(&self) -> Option<Arc<NodeState>> {
        let list = self.list.load();
        let mut primaries = list
            .iter()
            .filter(|n| n.is_up() && n.role() == Role::Primary);
        let first = primaries.next().cloned();
        if let Some(other) = primaries.next() {
            tracing::error!(first = %first.as_ref().map_or("", |n| n.name()), second = %other.name(), "two nodes report being primary");
        }
        first
    }

    /// The next healthy replica, round robin; `None` if there is none.
    pub fn pick_replica(&self) -> Option<Arc<NodeState>> {
        let list = self.list.load();
        let replicas: Vec<&Arc<NodeState>> = list
            .iter()
            .filter(|n| n.is_up() && n.role() == Role::Replica)
            .collect();
        if replicas.is_empty() {
            return None;
        }
        let i = self.next_replica.fetch_add(1, Ordering::Relaxed) % replicas.len();
        Some(replicas[i].clone())
    }

    pub fn describe_all(&self) -> String {
        self.list
            .load()
            .iter()
            .map(|n| n.describe())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Applies a reloaded node list; unchanged nodes keep their state and monitor. Returns the
    /// nodes that need a new monitor.
    pub fn reconcile(&self, configs: &[NodeConfig]) -> Vec<Arc<NodeState>> {
        let old = self.list.load_full();
        let mut started = Vec::new();
        let new: Vec<Arc<NodeState>> = configs
            .iter()
            .map(|c| match old.iter().find(|n| n.config == *c) {
                Some(existing) => existing.clone(),
                None => {
                    let node = Arc::new(NodeState::new(c.clone()));
                    started.push(node.clone());
                    node
                }
            })
            .collect();
        for node in old.iter() {
            if !new.iter().any(|n| Arc::ptr_eq(n, node)) {
                node.retired.store(true, Ordering::Release);
            }
        }
        self.list.store(Arc::new(new));
        started
    }
}

/// Credentials pgherd uses for its own connections to nodes.
pub fn management_credentials(cluster: &ClusterSettings) -> ServerCredentials {
    ServerCredentials {
        password: cluster.password.clone(),
        scram_keys: None,
        md5_hash: None,
    }
}

/// One health check: (re)connect if needed and ask the node whether it is in recovery.
pub async fn check_once(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    conn: &mut Option<ServerConn>,
) -> Result<Role, String> {
    let timeout = Duration::from_millis(cluster.health_check_timeout_ms);
    if conn.is_none() {
        let credentials = management_credentials(cluster);
        let spec = ConnectSpec {
            node: &node.config.name,
            host: &node.config.host,
            port: node.config.port,
            user: &cluster.user,
            database: &cluster.database,
            credentials: &credentials,
            tls_mode: ctx.tls_mode,
            tls: ctx.tls.as_ref(),
            timeout,
        };
        let id = ctx.next_server_id.fetch_add(1, Ordering::Relaxed);
        *conn = Some(
            server::connect(&spec, id, 1)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let Some(c) = conn.as_mut() else {
        return Err("no management connection".into());
    };
    let answer = tokio::time::timeout(timeout, c.simple_query("SELECT pg_is_in_recovery()")).await;
    let rows = match answer {
        Ok(Ok(rows)) => rows,
        Ok(Err(QueryError::Sql(e))) => return Err(e.to_string()),
        Ok(Err(QueryError::Server(e))) => {
            *conn = None;
            return Err(e.to_string());
        }
        Err(_) => {
            *conn = None;
            return Err(format!("no answer within {} ms", timeout.as_millis()));
        }
    };
    match rows
        .first()
        .and_then(|r| r.first())
        .and_then(|v| v.as_deref())
    {
        Some("t") => Ok(Role::Replica),
        Some("f") => Ok(Role::Primary),
        other => Err(format!(
            "unexpected answer to pg_is_in_recovery(): {other:?}"
        )),
    }
}

/// Checks every node once, concurrently; used at startup so routing is known before the
/// first client arrives.
pub async fn check_all_once(
    nodes: &[Arc<NodeState>],
    cluster: &ClusterSettings,
    ctx: &Arc<ConnectContext>,
) {
    let mut checks = tokio::task::JoinSet::new();
    for node in nodes {
        let (node, cluster, ctx) = (node.clone(), cluster.clone(), ctx.clone());
        checks.spawn(async move {
            let mut conn = None;
            let outcome = check_once(&node, &cluster, &ctx, &mut conn).await;
            node.record(outcome);
        });
    }
    while checks.join_next().await.is_some() {}
}

/// Runs until the node is retired or `stop` fires.
pub async fn monitor(
    node: Arc<NodeState>,
    settings: impl Fn() -> ClusterSettings,
    ctx: Arc<ConnectContext>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut conn = None;
    loop {
        if node.retired.load(Ordering::Acquire) || *stop.borrow() {
            return;
        }
        let cluster = settings();
        let outcome = check_once(&node, &cluster, &ctx, &mut conn).await;
        node.record(outcome);
        let period = Duration::from_millis(cluster.health_check_period_ms);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => {}
        }
    }
}
