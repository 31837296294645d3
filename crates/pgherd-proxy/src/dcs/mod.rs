//! Several pgherd instances agreeing through etcd (`[dcs]`): each holds a lease and campaigns
//! for the leader key with it; the leader alone runs the failover task (decisions, promotions,
//! the synchronous standbys, sealing) and operator actions, and writes its cluster view to
//! etcd, guarded by holding the leader key; the others adopt that view and route by it. An
//! instance that cannot reach etcd keeps routing by the last view it had (to its primary while
//! that answers and is not fenced) and never acts without a lease it knows to be valid.
//!
//! Keys under `/<scope>/`: `leader` (the leader's instance name, on its lease), `view` (the
//! shared view, JSON, [`shared::SharedView`]), `instances/<name>` (each instance's addresses
//! and pid, on its lease).

pub mod shared;

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, GetOptions, LeaseKeepAliveStream, LeaseKeeper,
    PutOptions, Txn, TxnOp, TxnOpResponse,
};
use parking_lot::Mutex;
use pgherd_config::DcsSettings;
use pgherd_failover::Change;
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use shared::SharedView;

/// How often the view is published (leader) or read (the others): a promotion reaches every
/// instance within about this long.
const SYNC_PERIOD: Duration = Duration::from_millis(200);
/// How often the registered instances are read, for `SHOW INSTANCES` and `pgherd status`.
const LIST_PERIOD: Duration = Duration::from_secs(1);
/// Wait before connecting again after etcd failed.
const RETRY: Duration = Duration::from_millis(500);

/// What an instance knows of the agreement.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub reachable: bool,
    /// The leader's instance name as last read.
    pub leader: Option<String>,
    /// This instance leads until then: its lease's expiry as last renewed, less the time one
    /// renewal may take, so it stops acting before another instance can take over.
    leading_until: Option<Instant>,
    pub last_error: Option<String>,
    /// The lease of the current (or last) session with etcd.
    pub lease: Option<i64>,
    /// The instances registered under `/<scope>/instances/`, as last read.
    pub instances: Vec<InstanceRecord>,
}

/// What an instance says of itself in etcd (on its lease: it is gone once the lease is).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct InstanceRecord {
    pub instance: String,
    pub listen: Vec<String>,
    pub api: Vec<String>,
    pub pid: u32,
}

/// This instance's side of the agreement.
pub struct Dcs {
    pub instance: String,
    pub settings: DcsSettings,
    status: Mutex<Status>,
    /// The connection and lease of the current session with etcd, for publishing the view
    /// between the periodic turns (before a promotion's IO).
    session: tokio::sync::Mutex<Option<(Client, i64)>>,
    /// The lease of the last session: the next session keeps it if etcd still has it, so a
    /// short outage (etcd restarting, a connection lost) does not hand the leadership over.
    last_lease: Mutex<Option<i64>>,
}

/// Why a request to etcd failed.
#[derive(Debug, thiserror::Error)]
pub enum DcsError {
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    #[error("etcd did not answer within {0} ms")]
    Timeout(u64),
    #[error("the lease expired")]
    LeaseExpired,
    #[error("the keep-alive stream closed")]
    KeepAliveClosed,
    #[error("this instance does not hold the leader key")]
    NotLeader,
    #[error("the shared view cannot be read: {0}")]
    BadView(String),
}

impl Dcs {
    pub fn new(settings: DcsSettings, listen_port: u16) -> Dcs {
        let instance = settings.instance.clone().unwrap_or_else(|| {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_owned())
                .unwrap_or_else(|_| "localhost".to_owned());
            format!("{host}:{listen_port}")
        });
        Dcs {
            instance,
            settings,
            status: Mutex::new(Status::default()),
            session: tokio::sync::Mutex::new(None),
            last_lease: Mutex::new(None),
        }
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// This instance may act for the cluster now.
    pub fn is_leader(&self) -> bool {
        let status = self.status.lock();
        status.leader.as_deref() == Some(self.instance.as_str())
            && status
                .leading_until
                .is_some_and(|until| Instant::now() < until)
    }

    fn key(&self, name: &str) -> String {
        format!("/{}/{name}", self.settings.scope)
    }

    fn timeout(&self) -> Duration {
        Duration::from_millis(self.settings.request_timeout_ms)
    }

    async fn within<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, DcsError> {
        match tokio::time::timeout(self.timeout(), request).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(DcsError::Timeout(self.settings.request_timeout_ms)),
        }
    }

    fn lost(&self, error: &DcsError) {
        let mut status = self.status.lock();
        let was_leading = status.leader.as_deref() == Some(self.instance.as_str());
        let message = error.to_string();
        // Said once per outage (and when the reason changes), not at every retry.
        let news = status.reachable || status.last_error.as_deref() != Some(message.as_str());
        status.reachable = false;
        status.last_error = Some(message);
        drop(status);
        if !news {
            tracing::debug!(instance = %self.instance, error = %error, "etcd still unreachable");
        } else if was_leading {
            tracing::warn!(instance = %self.instance, error = %error, "etcd unreachable: this instance stops acting for the cluster when its lease runs out");
        } else {
            tracing::warn!(instance = %self.instance, error = %error, "etcd unreachable; routing by the last view");
        }
    }

    /// Writes this instance's view as the shared one, if it still holds the leader key with
    /// its lease; otherwise it is not the leader and says so.
    pub async fn publish(&self, app: &App) -> Result<(), DcsError> {
        let session = self.session.lock().await;
        let Some((client, lease)) = session.as_ref() else {
            return Err(DcsError::NotLeader);
        };
        let mut client = client.clone();
        let lease = *lease;
        drop(session);
        self.publish_with(&mut client, lease, app).await
    }

    async fn publish_with(
        &self,
        client: &mut Client,
        lease: i64,
        app: &App,
    ) -> Result<(), DcsError> {
        let view = app.nodes.view();
        let shared = SharedView::of(&view, &self.instance, lease, |id| app.nodes.name_of(id));
        let json = serde_json::to_string(&shared).map_err(|e| DcsError::BadView(e.to_string()))?;
        let leader_key = self.key("leader");
        let txn = Txn::new()
            .when(vec![
                Compare::value(leader_key.clone(), CompareOp::Equal, self.instance.clone()),
                Compare::lease(leader_key, CompareOp::Equal, lease),
            ])
            .and_then(vec![TxnOp::put(self.key("view"), json, None)]);
        let response = self.within(client.txn(txn)).await?;
        if response.succeeded() {
            Ok(())
        } else {
            Err(DcsError::NotLeader)
        }
    }

    /// Adopts the shared view unless it is this instance's own or from an older epoch.
    fn adopt(&self, app: &App, shared: &SharedView) -> Result<(), DcsError> {
        let state = shared
            .state(|name| app.nodes.get(name).map(|n| n.id))
            .map_err(DcsError::BadView)?;
        app.nodes.change(Change::Adopt(Box::new(state)));
        Ok(())
    }
}

/// Refuses an operator's action on an instance that does not lead: its change to the view
/// would be overwritten by the leader's.
pub fn must_lead(app: &App) -> Result<(), PgError> {
    let Some(dcs) = app.dcs.as_ref().filter(|_| !app.may_act()) else {
        return Ok(());
    };
    let status = dcs.status();
    Err(PgError::error(
        SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!(
            "this pgherd instance ({}) does not lead the cluster; {}",
            dcs.instance,
            match status.leader {
                Some(leader) if status.reachable => format!("run it on the leader, {leader}"),
                _ => "no leader is known (etcd cannot be reached)".to_owned(),
            }
        ),
    ))
}

/// Runs until shutdown: sessions with etcd, one after another.
pub async fn run(app: Arc<App>, dcs: Arc<Dcs>) {
    let mut stop = app.shutdown_signal();
    loop {
        tokio::select! {
            result = session(&app, &dcs) => {
                if let Err(e) = result {
                    dcs.lost(&e);
                }
                *dcs.session.lock().await = None;
            }
            _ = stop.changed() => return,
        }
        tokio::select! {
            _ = tokio::time::sleep(RETRY) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One connection to etcd with one lease: renews it, campaigns, and keeps the view in step
/// until something fails.
async fn session(app: &App, dcs: &Dcs) -> Result<(), DcsError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(dcs.timeout())
        .with_timeout(dcs.timeout());
    let mut client = dcs
        .within(Client::connect(&dcs.settings.endpoints, Some(options)))
        .await?;
    let mut live = open_lease(dcs, &mut client).await?;
    let lease = live.id;
    dcs.status.lock().lease = Some(lease);
    *dcs.session.lock().await = Some((client.clone(), lease));
    register(app, dcs, &mut client, lease).await?;
    tracing::info!(instance = %dcs.instance, endpoints = ?dcs.settings.endpoints, lease, "connected to etcd");

    let renew_every = Duration::from_millis(dcs.settings.lease_ttl_s * 1000 / 3);
    let mut renewed_at = Instant::now();
    let mut published: Option<(u64, u64)> = None;
    let mut listed_at: Option<Instant> = None;
    loop {
        if listed_at.is_none_or(|at| at.elapsed() >= LIST_PERIOD) {
            let instances = list_instances(dcs, &mut client).await?;
            dcs.status.lock().instances = instances;
            listed_at = Some(Instant::now());
        }
        if renewed_at.elapsed() >= renew_every {
            renewed_at = Instant::now();
            live.renew(dcs).await?;
        }
        let lease_until = live.until;
        let leader = campaign(app, dcs, &mut client, lease).await?;
        let leading = leader.as_deref() == Some(dcs.instance.as_str());
        let was_leading = dcs.is_leader();
        {
            let mut status = dcs.status.lock();
            if status.leader != leader {
                match &leader {
                    Some(_) if leading => {
                        tracing::warn!(instance = %dcs.instance, "this instance leads the cluster now")
                    }
                    Some(l) => {
                        tracing::info!(instance = %dcs.instance, leader = %l, "following the leader")
                    }
                    None => tracing::warn!(instance = %dcs.instance, "no leader"),
                }
            }
            status.reachable = true;
            status.last_error = None;
            status.leader = leader;
            status.leading_until = leading
                .then(|| lease_until.checked_sub(dcs.timeout()))
                .flatten();
        }
        if leading != was_leading {
            role_changed(app, dcs, leading);
        }
        if leading {
            let view = app.nodes.view();
            let now = (view.epoch, view.version);
            if published != Some(now) {
                dcs.publish_with(&mut client, lease, app).await?;
                published = Some(now);
            }
        } else {
            published = None;
        }
        tokio::time::sleep(SYNC_PERIOD).await;
    }
}

/// A lease kept alive by one session.
struct LiveLease {
    id: i64,
    keeper: LeaseKeeper,
    renewals: LeaseKeepAliveStream,
    /// When etcd lets the lease expire unless it is renewed: counted from when the last
    /// renewal was sent, which is before etcd got it.
    until: Instant,
}

impl LiveLease {
    /// Starts keeping lease `id` alive. Opening the stream renews the lease once (etcd-client
    /// reads that answer itself and fails if the lease is gone), so every later answer on it
    /// is the one to the renewal just sent.
    async fn start(dcs: &Dcs, client: &mut Client, id: i64) -> Result<LiveLease, DcsError> {
        let sent = Instant::now();
        let (keeper, renewals) = match dcs.within(client.lease_keep_alive(id)).await {
            Err(DcsError::Etcd(etcd_client::Error::LeaseKeepAliveError(_))) => {
                return Err(DcsError::LeaseExpired)
            }
            opened => opened?,
        };
        Ok(LiveLease {
            id,
            keeper,
            renewals,
            until: sent + Duration::from_secs(dcs.settings.lease_ttl_s),
        })
    }

    async fn renew(&mut self, dcs: &Dcs) -> Result<(), DcsError> {
        let sent = Instant::now();
        dcs.within(self.keeper.keep_alive()).await?;
        self.until = sent + renewal_ttl(dcs, &mut self.renewals).await?;
        Ok(())
    }
}

/// The TTL the next answer on the keep-alive stream grants; an error if the lease is gone.
async fn renewal_ttl(dcs: &Dcs, renewals: &mut LeaseKeepAliveStream) -> Result<Duration, DcsError> {
    let answer = dcs
        .within(renewals.message())
        .await?
        .ok_or(DcsError::KeepAliveClosed)?;
    match u64::try_from(answer.ttl()) {
        Ok(ttl) if ttl > 0 => Ok(Duration::from_secs(ttl)),
        _ => Err(DcsError::LeaseExpired),
    }
}

/// The lease of a new session: the last session's while etcd still has it (the leader key
/// and the instance's record stay on it), else a new one.
async fn open_lease(dcs: &Dcs, client: &mut Client) -> Result<LiveLease, DcsError> {
    let last = *dcs.last_lease.lock();
    if let Some(id) = last {
        match LiveLease::start(dcs, client, id).await {
            Err(DcsError::LeaseExpired) => {}
            kept => return kept,
        }
    }
    let ttl = dcs.settings.lease_ttl_s as i64;
    let id = dcs.within(client.lease_grant(ttl, None)).await?.id();
    *dcs.last_lease.lock() = Some(id);
    LiveLease::start(dcs, client, id).await
}

/// Takes the leader key with this lease when nobody holds it, and reads the shared view in
/// the same transaction; a follower adopts it, a new leader adopts it before acting. Returns
/// the leader's name.
async fn campaign(
    app: &App,
    dcs: &Dcs,
    client: &mut Client,
    lease: i64,
) -> Result<Option<String>, DcsError> {
    let leader_key = dcs.key("leader");
    let view_key = dcs.key("view");
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            leader_key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(vec![
            TxnOp::put(
                leader_key.clone(),
                dcs.instance.clone(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(leader_key.clone(), None),
            TxnOp::get(view_key.clone(), None),
        ])
        .or_else(vec![
            TxnOp::get(leader_key, None),
            TxnOp::get(view_key, None),
        ]);
    let response = dcs.within(client.txn(txn)).await?;
    let mut gets = response.op_responses().into_iter().filter_map(|r| match r {
        TxnOpResponse::Get(get) => Some(get),
        _ => None,
    });
    let leader_kv = gets.next().and_then(|g| g.kvs().first().cloned());
    let view_kv = gets.next().and_then(|g| g.kvs().first().cloned());
    // The key names this instance only if it holds it with this session's lease: a key left
    // by this instance's previous life (a restart within the TTL) leads nobody until it
    // expires.
    let leader = leader_kv.map(|kv| {
        let name = String::from_utf8_lossy(kv.value()).into_owned();
        if name == dcs.instance && kv.lease() != lease {
            format!("{name} (previous run)")
        } else {
            name
        }
    });
    let leading = leader.as_deref() == Some(dcs.instance.as_str());
    if leading && app.nodes.view().awaiting_view {
        app.nodes.change(Change::AwaitView(false));
    }
    if let Some(view) = view_kv {
        let shared: SharedView =
            serde_json::from_slice(view.value()).map_err(|e| DcsError::BadView(e.to_string()))?;
        let written_by_me = shared.leader == dcs.instance && shared.lease == lease;
        // A leader adopts only a view another instance wrote (it took over); its own it has.
        if !leading || !written_by_me {
            dcs.adopt(app, &shared)?;
        }
    }
    Ok(leader)
}

/// Tells the operator's `on_role_change` command (a virtual IP to move, as keepalived's notify
/// scripts do) that this instance leads now, or does not any more.
fn role_changed(app: &App, dcs: &Dcs, leading: bool) {
    let role = if leading { "leader" } else { "follower" };
    crate::failover::event(
        app,
        if leading { "leads" } else { "follows" },
        "",
        &format!("instance {} is {role} now", dcs.instance),
    );
    if let Some(command) = dcs.settings.on_role_change.as_deref() {
        crate::events::run_hook(
            "on_role_change command",
            command,
            vec![
                ("PGHERD_ROLE", role.to_owned()),
                ("PGHERD_INSTANCE", dcs.instance.clone()),
            ],
        );
    }
}

/// The instances registered under `/<scope>/instances/`.
async fn list_instances(dcs: &Dcs, client: &mut Client) -> Result<Vec<InstanceRecord>, DcsError> {
    let prefix = dcs.key("instances/");
    let answer = dcs
        .within(client.get(prefix, Some(GetOptions::new().with_prefix())))
        .await?;
    Ok(answer
        .kvs()
        .iter()
        .filter_map(|kv| serde_json::from_slice(kv.value()).ok())
        .collect())
}

/// Puts this instance's record (addresses, pid) on its lease, for `pgherd status`.
async fn register(app: &App, dcs: &Dcs, client: &mut Client, lease: i64) -> Result<(), DcsError> {
    let config = app.config();
    let record = InstanceRecord {
        instance: dcs.instance.clone(),
        listen: config
            .proxy
            .listen
            .iter()
            .map(ToString::to_string)
            .collect(),
        api: config.api.listen.iter().map(ToString::to_string).collect(),
        pid: std::process::id(),
    };
    let record = serde_json::to_string(&record).map_err(|e| DcsError::BadView(e.to_string()))?;
    dcs.within(client.put(
        dcs.key(&format!("instances/{}", dcs.instance)),
        record,
        Some(PutOptions::new().with_lease(lease)),
    ))
    .await?;
    Ok(())
}
