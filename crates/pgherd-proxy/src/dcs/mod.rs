//! Several pgherd instances agreeing through etcd (`[dcs]`): each holds a lease and campaigns
//! for the leader key with it; the leader alone runs the failover task (decisions, promotions,
//! the synchronous standbys, sealing) and operator actions, and writes its cluster view to
//! etcd, guarded by holding the leader key; the others adopt that view and route by it. An
//! instance that cannot reach etcd keeps routing by the last view it had (to its primary while
//! that answers and is not fenced) through its lease and its failsafe (`failsafe_s`), and
//! never acts without a lease it knows to be valid.
//!
//! Keys under `/<scope>/`: `leader` (the leader's instance name, on its lease), `view` (the
//! shared view, JSON, [`shared::SharedView`]), `instances/<name>` (each instance's addresses
//! and pid, on its lease), `members/<name>` (the lease of each instance's latest session, on
//! no lease: a leader knows which instances may be routing writes in failsafe, even those
//! that came and went while it could not read etcd; it removes those whose failsafe is over).

mod lease;
mod records;
pub mod shared;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, Identity, PutOptions, TlsOptions, Txn,
    TxnOp,
};
use parking_lot::Mutex;
use pgherd_config::DcsSettings;
use pgherd_failover::{agreement, Change, ClusterState};
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use lease::open_lease;
pub use records::InstanceRecord;
use records::{list_instances, register, Listed};
use shared::SharedView;

/// How often the view is published (leader) or read (the others): a promotion reaches every
/// instance within about this long.
const SYNC_PERIOD: Duration = Duration::from_millis(200);
/// Wait before connecting again after etcd failed.
const RETRY: Duration = Duration::from_millis(500);

/// What an instance knows of the agreement.
#[derive(Debug, Clone, Default)]
pub struct Status {
    pub reachable: bool,
    /// The leader's instance name as last read.
    pub leader: Option<String>,
    /// The leader key named this instance with its session's lease at the last campaign;
    /// until when it may act follows from the lease ([`Dcs::is_leader`]).
    leading: bool,
    pub last_error: Option<String>,
    /// The lease of the current (or last) session with etcd: the next session keeps it if
    /// etcd still has it, so a short outage (etcd restarting, a connection lost) does not hand
    /// the leadership over.
    pub lease: Option<i64>,
    /// The leader's view this instance routes by, as its record says: (the lease it was
    /// written with, its version).
    routed: Option<(i64, u64)>,
    /// The instances registered under `/<scope>/instances/`, as last read.
    pub instances: Vec<InstanceRecord>,
}

/// This instance's side of the agreement.
pub struct Dcs {
    pub instance: String,
    pub settings: DcsSettings,
    status: Mutex<Status>,
    /// The connection and lease of the current session with etcd, for publishing the view
    /// between the periodic turns (before a promotion's IO).
    session: tokio::sync::Mutex<Option<(Client, i64)>>,
    /// When this instance's lease runs out unless renewed, as it counts it ([`Dcs::now_ms`];
    /// 0: it never had one). Read by every write's plan.
    lease_until_ms: AtomicU64,
    /// The last view published (lease, epoch, version): publishes go out one at a time and
    /// never put an older view over a newer one.
    published: tokio::sync::Mutex<Option<(i64, u64, u64)>>,
    /// The instances' records as read over time: until when one that vanished may still
    /// route writes in failsafe.
    sightings: Mutex<agreement::Sightings>,
    /// The leader's view says it waits out failsafes ([`SharedView::honours_failsafe`]):
    /// until then this instance keeps none.
    failsafe_honoured: std::sync::atomic::AtomicBool,
    /// The origin of the agreement's times.
    clock: Instant,
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
    #[error("no session with etcd (it cannot be reached)")]
    NoSession,
    #[error("TLS to etcd: {0}")]
    Tls(String),
    #[error("the shared view cannot be read: {0}")]
    BadView(String),
    #[error("instances {0} still route by an older view of the cluster")]
    Lagging(String),
    #[error("an instance that lost etcd may route writes to the old primary in failsafe for {0} ms more")]
    Failsafe(u64),
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
            lease_until_ms: AtomicU64::new(0),
            published: tokio::sync::Mutex::new(None),
            sightings: Mutex::new(agreement::Sightings::default()),
            failsafe_honoured: std::sync::atomic::AtomicBool::new(false),
            clock: Instant::now(),
        }
    }

    pub fn status(&self) -> Status {
        self.status.lock().clone()
    }

    /// Keeps the lease of the process this one takes over from in an upgrade: the first
    /// session renews it (its leader key and record stay on it) rather than taking a new one.
    pub fn inherit_lease(&self, lease: i64) {
        self.status.lock().lease = Some(lease);
    }

    /// This instance may act for the cluster now.
    pub fn is_leader(&self) -> bool {
        let leading = self.status.lock().leading;
        let leading_until_ms = agreement::leading_until_ms(
            leading,
            self.lease_until_ms.load(Ordering::Acquire),
            self.settings.request_timeout_ms,
        );
        agreement::may_act(leading_until_ms, self.now_ms())
    }

    fn now_ms(&self) -> u64 {
        self.ms(Instant::now())
    }

    fn ms(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.clock).as_millis() as u64
    }

    fn key(&self, name: &str) -> String {
        format!("/{}/{name}", self.settings.scope)
    }

    /// Timeouts, TLS (etcd's CA, this instance's certificate; the files are read at each
    /// connection, so renewed certificates are picked up) and the etcd user.
    fn connect_options(&self) -> Result<ConnectOptions, DcsError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(self.timeout())
            .with_timeout(self.timeout());
        if let Some(tls) = &self.settings.tls {
            let read = |path: &std::path::Path| {
                std::fs::read(path).map_err(|e| DcsError::Tls(format!("{}: {e}", path.display())))
            };
            let mut config =
                TlsOptions::new().ca_certificate(Certificate::from_pem(read(&tls.ca_file)?));
            if let Some((cert, key)) = &tls.identity {
                config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
            }
            options = options.with_tls(config);
        }
        if let Some((name, password)) = &self.settings.user {
            options = options.with_user(name.clone(), password.clone());
        }
        Ok(options)
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
    pub async fn publish(&self, app: &App, state: &ClusterState) -> Result<(), DcsError> {
        let session = self.session.lock().await;
        let Some((client, lease)) = session.as_ref() else {
            return Err(DcsError::NoSession);
        };
        let mut client = client.clone();
        let lease = *lease;
        drop(session);
        self.publish_with(&mut client, lease, app, state).await
    }

    async fn publish_with(
        &self,
        client: &mut Client,
        lease: i64,
        app: &App,
        state: &ClusterState,
    ) -> Result<(), DcsError> {
        let mut published = self.published.lock().await;
        if published.is_some_and(|(l, epoch, version)| {
            l == lease && (state.epoch, state.version) <= (epoch, version)
        }) {
            // A newer view, or this one, is in etcd already.
            return Ok(());
        }
        let shared = SharedView::of(state, &self.instance, lease, |id| app.nodes.name_of(id));
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
            *published = Some((lease, state.epoch, state.version));
            Ok(())
        } else {
            Err(DcsError::NotLeader)
        }
    }

    /// Where this instance stands for routing writes now ([`agreement::write_lease`]).
    /// Asked by every write's plan, so a stalled instance does not route one before its watch
    /// closes the gate: two atomic loads and the clock.
    pub fn write_lease(&self) -> agreement::WriteLease {
        // 0: it never had a lease.
        let lease_until_ms = Some(self.lease_until_ms.load(Ordering::Acquire)).filter(|&ms| ms > 0);
        agreement::write_lease(
            lease_until_ms,
            self.settings.request_timeout_ms,
            self.failsafe_ms(),
            self.now_ms(),
        )
    }

    /// The failsafe this instance keeps: its own `failsafe_s`, under a leader that waits it
    /// out.
    fn failsafe_ms(&self) -> u64 {
        if self.failsafe_honoured.load(Ordering::Acquire) {
            self.configured_failsafe_ms()
        } else {
            0
        }
    }

    fn configured_failsafe_ms(&self) -> u64 {
        self.settings.failsafe_s * 1000
    }

    /// Waits until every other instance that holds a lease routes by view `version` or a
    /// newer one (they read the view every [`SYNC_PERIOD`]), and every one that lost its lease
    /// (and its record) has come to the end of its failsafe: then none routes writes to the old
    /// primary any more ([`agreement::may_promote`]).
    pub async fn await_followers(&self, version: u64) -> Result<(), DcsError> {
        let session = self.session.lock().await;
        let Some((client, lease)) = session.as_ref() else {
            return Err(DcsError::NoSession);
        };
        let (mut client, lease) = (client.clone(), *lease);
        drop(session);
        // A lagging instance loses its record within the lease; its failsafe follows.
        let deadline = Instant::now()
            + Duration::from_secs(self.settings.lease_ttl_s)
            + Duration::from_millis(agreement::failsafe_wait_ms(self.configured_failsafe_ms()))
            + 2 * self.timeout();
        let mut said = false;
        loop {
            let listed = list_instances(self, &mut client).await?;
            self.sighted(&listed);
            let lagging: Vec<String> = listed
                .records
                .iter()
                .map(|(r, _)| r)
                .filter(|r| {
                    r.instance != self.instance && (r.view_lease != lease || r.version < version)
                })
                .map(|r| r.instance.clone())
                .collect();
            let failsafe_over_at_ms = self.sightings.lock().failsafe_over_at_ms();
            let now_ms = self.now_ms();
            let hold = match agreement::may_promote(lagging.len(), failsafe_over_at_ms, now_ms) {
                agreement::Promotion::Go => return Ok(()),
                agreement::Promotion::Lagging(_) => DcsError::Lagging(lagging.join(", ")),
                agreement::Promotion::Failsafe { until_ms } => {
                    let wait_ms = until_ms.saturating_sub(now_ms);
                    if !std::mem::replace(&mut said, true) {
                        tracing::info!(instance = %self.instance, wait_ms, "before promoting, waiting out the failsafe of an instance that lost its lease");
                    }
                    DcsError::Failsafe(wait_ms)
                }
            };
            if Instant::now() >= deadline {
                return Err(hold);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Closes the write gate (`no_lease`) once this instance's lease and failsafe may have run
    /// out, and opens it when the lease is valid again.
    fn watch_lease(&self, app: &App, failsafe_said: &mut bool) {
        let lease = self.write_lease();
        let in_failsafe = matches!(lease, agreement::WriteLease::Failsafe { .. });
        if in_failsafe && !*failsafe_said {
            tracing::warn!(instance = %self.instance, failsafe_s = self.settings.failsafe_s, "etcd out of reach for longer than the lease: writes go on to the primary of the last view, in failsafe");
        }
        *failsafe_said = in_failsafe;
        let lapsed = !lease.may_route_writes();
        let view = app.nodes.view();
        if lapsed != view.lease_lapsed {
            if lapsed {
                tracing::warn!(instance = %self.instance, "etcd out of reach for longer than the lease and the failsafe: writes are refused until it answers");
            }
            app.nodes.change(Change::LeaseLapsed(lapsed));
            if lapsed {
                end_sessions_on_primary(
                    app,
                    "this pgherd instance lost etcd for longer than its lease and failsafe: another instance may be replacing the primary",
                );
            }
        }
    }

    /// Takes the shared view as [`agreement::adoption`] says.
    fn adopt(
        &self,
        app: &App,
        shared: &SharedView,
        adoption: agreement::Adoption,
    ) -> Result<(), DcsError> {
        let build = || {
            shared
                .state(|name| app.nodes.get(name).map(|n| n.id))
                .map(Box::new)
                .map_err(DcsError::BadView)
        };
        let before = app.nodes.view();
        match adoption {
            agreement::Adoption::Keep => return Ok(()),
            agreement::Adoption::Follow => app.nodes.change(Change::Follow(build()?)),
            agreement::Adoption::TakeOver => app.nodes.change(Change::Adopt(build()?)),
        };
        // The leader fenced them: sessions through this instance stop using them too.
        let after = app.nodes.view();
        for id in after.fenced.difference(&before.fenced) {
            if let Some(node) = app.nodes.by_id(*id) {
                let why = format!(
                    "node {} was fenced by the leading pgherd instance while this session used it",
                    node.name()
                );
                crate::failover::end_sessions_on(app, &node, &why);
            }
        }
        Ok(())
    }
}

/// Ends the sessions holding a connection to the elected primary (session pooling, a
/// transaction under way): they would go on writing there while another instance may be
/// replacing it.
fn end_sessions_on_primary(app: &App, why: &str) {
    if let Some(primary) = app.nodes.view().elected.and_then(|id| app.nodes.by_id(id)) {
        crate::failover::end_sessions_on(app, &primary, why);
    }
}

/// Refuses an operator's action on an instance that does not lead: its change to the view
/// would be overwritten by the leader's.
pub fn must_lead(app: &App) -> Result<(), PgError> {
    if app.handover.handed_over() {
        return Err(PgError::error(
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            "this pgherd process is handing its duties to the new one of an upgrade; run it there",
        ));
    }
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

/// How often the lease's validity is checked for the write gate: well within one request
/// timeout, so the gate closes before etcd can let the lease go.
const LEASE_WATCH_PERIOD: Duration = Duration::from_millis(50);

/// Runs until shutdown: sessions with etcd, one after another, and the lease's watch.
pub async fn run(app: Arc<App>, dcs: Arc<Dcs>) {
    let watch = {
        let (app, dcs) = (app.clone(), dcs.clone());
        let mut stop = app.shutdown_signal();
        async move {
            let mut failsafe_said = false;
            loop {
                dcs.watch_lease(&app, &mut failsafe_said);
                tokio::select! {
                    _ = tokio::time::sleep(LEASE_WATCH_PERIOD) => {}
                    _ = stop.changed() => return,
                }
            }
        }
    };
    tokio::spawn(watch);
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
    let options = dcs.connect_options()?;
    let mut client = dcs
        .within(Client::connect(&dcs.settings.endpoints, Some(options)))
        .await?;
    let mut live = open_lease(dcs, &mut client).await?;
    let lease = live.id;
    if !live.kept {
        // A new lease: this instance has no record any leader waits for, so it routes no
        // writes until it has one and has read the view.
        app.nodes.change(Change::AwaitView(true));
        register(app, dcs, &mut client, lease, (0, 0)).await?;
        dcs.status.lock().routed = Some((0, 0));
    }
    dcs.lease_until_ms
        .store(dcs.ms(live.until), Ordering::Release);
    *dcs.session.lock().await = Some((client.clone(), lease));
    tracing::info!(instance = %dcs.instance, endpoints = ?dcs.settings.endpoints, lease, "connected to etcd");

    let renew_every = Duration::from_millis(agreement::renew_every_ms(dcs.settings.lease_ttl_s));
    let mut renewed_at = Instant::now();
    loop {
        if renewed_at.elapsed() >= renew_every {
            renewed_at = Instant::now();
            live.renew(dcs).await?;
            dcs.lease_until_ms
                .store(dcs.ms(live.until), Ordering::Release);
        }
        let (agreement::Leadership { leader, leading }, shared_version) =
            match campaign(app, dcs, &mut client, lease).await {
                Err(DcsError::BadView(why)) => {
                    return Err(cannot_follow(app, dcs, &mut client, lease, why).await)
                }
                campaigned => campaigned?,
            };
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
            status.leading = leading;
        }
        // A process handing over to a new one on the same lease does not say it stops
        // leading: the new one leads on (a hook moving a virtual IP must not move it away).
        if leading != was_leading && !app.handover.handed_over() {
            role_changed(app, dcs, leading);
        }
        // The record says which of the leader's views this instance routes by: the one it has
        // just followed (its own, for the leader). Not its own version, which its own changes
        // (the lease's gate) move too.
        let routed = match (leading, shared_version) {
            (false, Some(followed)) => followed,
            _ => (lease, app.nodes.view().version),
        };
        let registered = dcs.status.lock().routed;
        // A process that handed its duties to a new one leaves the instance's record (its
        // pid, the view it routes by) to that one.
        if registered != Some(routed) && !app.handover.handed_over() {
            register(app, dcs, &mut client, lease, routed).await?;
            dcs.status.lock().routed = Some(routed);
        }
        // Writes flow only once etcd says which view this session routes by: a session that
        // vanishes before has routed none, and the leader need not wait out its failsafe.
        let routes_by_a_view = leading || shared_version.is_some();
        if app.nodes.view().awaiting_view && routes_by_a_view {
            app.nodes.change(Change::AwaitView(false));
        }
        if leading {
            // Only a newer view goes out (publish_with keeps track).
            dcs.publish_with(&mut client, lease, app, &app.nodes.view())
                .await?;
            dcs.forget_members(&mut client).await?;
        }
        tokio::time::sleep(SYNC_PERIOD).await;
    }
}

/// The leader's view cannot be read (an instance of another version, a node this one's
/// config lacks): this instance can follow nobody. It holds writes and gives its lease up, so
/// the leader does not wait for it before a promotion; its next sessions take new leases and
/// never route writes until they can read the view.
async fn cannot_follow(
    app: &App,
    dcs: &Dcs,
    client: &mut Client,
    lease: i64,
    why: String,
) -> DcsError {
    app.nodes.change(Change::AwaitView(true));
    tracing::error!(instance = %dcs.instance, error = %why, "the leader's view cannot be read: this instance holds writes and gives its lease up until it can");
    end_sessions_on_primary(
        app,
        "this pgherd instance cannot read the leader's view of the cluster",
    );
    // A process that gave its duties to a new one in an upgrade shares its lease: giving it up
    // would take the new one's leadership and record.
    if !app.handover.handed_over() {
        let _ = dcs.within(client.lease_revoke(lease)).await;
        dcs.status.lock().lease = None;
        dcs.lease_until_ms.store(0, Ordering::Release);
    }
    DcsError::BadView(why)
}

/// Takes the leader key with this lease when nobody holds it, and reads the shared view in
/// the same transaction; a follower adopts it, a new leader adopts it before acting. Returns
/// whom the key names, and the shared view read (the lease it was written with, its version).
async fn campaign(
    app: &App,
    dcs: &Dcs,
    client: &mut Client,
    lease: i64,
) -> Result<(agreement::Leadership, Option<(i64, u64)>), DcsError> {
    let leader_key = dcs.key("leader");
    let view_key = dcs.key("view");
    // The members and their records too, each turn: a leader must know when one vanished.
    let reads = |mut ops: Vec<TxnOp>| {
        ops.extend(records::listing_reads(dcs));
        ops
    };
    let txn = Txn::new()
        .when(vec![Compare::create_revision(
            leader_key.clone(),
            CompareOp::Equal,
            0,
        )])
        .and_then(reads(vec![
            TxnOp::put(
                leader_key.clone(),
                dcs.instance.clone(),
                Some(PutOptions::new().with_lease(lease)),
            ),
            TxnOp::get(leader_key.clone(), None),
            TxnOp::get(view_key.clone(), None),
        ]))
        .or_else(reads(vec![
            TxnOp::get(leader_key, None),
            TxnOp::get(view_key, None),
        ]));
    let response = dcs.within(client.txn(txn)).await?;
    let mut gets = records::gets(response);
    let leader_kv = gets.next().and_then(|g| g.kvs().first().cloned());
    let view_kv = gets.next().and_then(|g| g.kvs().first().cloned());
    let listed = Listed::of(dcs, gets.next(), gets.next());
    dcs.sighted(&listed);
    dcs.status.lock().instances = listed.records.into_iter().map(|(r, _)| r).collect();
    let leader_name = leader_kv
        .as_ref()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
    let mut leadership = agreement::leadership(
        &dcs.instance,
        lease,
        leader_kv
            .as_ref()
            .zip(leader_name.as_deref())
            .map(|(kv, instance)| agreement::LeaderKey {
                instance,
                lease: kv.lease(),
            }),
    );
    // A process handing its duties to a new one (an upgrade; both hold the same lease)
    // follows the shared view and publishes nothing: one writer of the view at any time.
    leadership.leading &= !app.handover.handed_over();
    let mut shared_version = None;
    if let Some(view) = view_kv {
        let shared: SharedView =
            serde_json::from_slice(view.value()).map_err(|e| DcsError::BadView(e.to_string()))?;
        shared_version = Some((shared.lease, shared.version));
        dcs.failsafe_honoured
            .store(shared.honours_failsafe, Ordering::Release);
        let adoption = agreement::adoption(
            &dcs.instance,
            lease,
            leadership.leading,
            &shared.leader,
            shared.lease,
        );
        dcs.adopt(app, &shared, adoption)?;
    }
    Ok((leadership, shared_version))
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
