//! The PostgreSQL nodes pgherd fronts, in two parts. What the monitors (`monitor.rs`)
//! *observe* of each node: up or not, its role (discovered with `pg_is_in_recovery()`, never
//! trusted from the config), WAL positions and lag, kept in atomics the data path reads. And
//! what pgherd *decided* about the cluster: the cluster view (`pgherd_failover::ClusterState`:
//! the elected primary, fenced and detached nodes, the synchronous set, the write gate with its
//! reason), one versioned value changed only through [`Nodes::change`] and read by sessions
//! without a lock ([`Nodes::snapshot`]).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;
use pgherd_config::NodeConfig;
use pgherd_failover::{Change, ClusterState, GateReason, NodeId};
use pgherd_route::balance::{format_lsn, Balance, Candidate, Lsn, LsnHistory};
use pgherd_route::plan::{ClusterView, NodeStanding};

pub use pgherd_route::Role;

/// What kind of failure a health check met: the word `SHOW NODES` and `/api/nodes` show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckFailureKind {
    /// Nothing listens on the node's port.
    Refused,
    /// The node's address cannot be reached (no route, reset, DNS).
    Unreachable,
    /// No answer within `health_check_timeout_ms` (connecting or asking).
    Timeout,
    /// The node refused pgherd's login (class 28), or pgherd has no credentials for it.
    Auth,
    /// The node is starting up, or in crash recovery (57P03).
    StartingUp,
    /// The node is shutting down (57P01, 57P02) or closed the connection.
    ShuttingDown,
    /// It refused pgherd's connection for another reason (too many connections, no such
    /// database).
    Rejected,
    Tls,
    /// The check query failed with an SQL error.
    Sql,
    /// The node answered something pgherd cannot read.
    Protocol,
}

impl CheckFailureKind {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckFailureKind::Refused => "refused",
            CheckFailureKind::Unreachable => "unreachable",
            CheckFailureKind::Timeout => "timeout",
            CheckFailureKind::Auth => "auth",
            CheckFailureKind::StartingUp => "starting_up",
            CheckFailureKind::ShuttingDown => "shutting_down",
            CheckFailureKind::Rejected => "rejected",
            CheckFailureKind::Tls => "tls",
            CheckFailureKind::Sql => "sql",
            CheckFailureKind::Protocol => "protocol",
        }
    }
}

/// A failed health check: its kind and what happened, in words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckFailure {
    pub kind: CheckFailureKind,
    pub message: String,
}

impl CheckFailure {
    pub fn new(kind: CheckFailureKind, message: impl Into<String>) -> Self {
        CheckFailure {
            kind,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for CheckFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

#[derive(Debug, Default, Clone)]
pub struct NodeHealth {
    pub last_error: Option<CheckFailure>,
    pub last_check: Option<SystemTime>,
    pub checks_ok: u64,
    pub checks_failed: u64,
    /// How often the node went from up to down.
    pub times_down: u64,
    /// Failed checks since the last good one.
    pub failed_streak: u32,
    /// Good checks in a row at which the node's WAL position was final for now: unchanged,
    /// or only replay moving below an unchanged received position (see
    /// `pgherd_failover::Check::Replica::settled`).
    pub settled_checks: u32,
    /// What the last good check saw.
    pub last_seen: Option<Observation>,
}

/// What one health check learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observation {
    pub role: Role,
    /// The primary's WAL insert position, or a replica's replay position (0 if none yet).
    pub lsn: Lsn,
    /// A replica's last received position (0 on a primary).
    pub receive_lsn: Lsn,
    /// The timeline of the node's latest checkpoint.
    pub timeline: u32,
    /// A replica's WAL receiver is streaming from its upstream right now.
    pub upstream_streaming: bool,
    /// On a primary: the `application_name`s of the standbys streaming from it.
    pub streaming_standbys: Vec<String>,
}

#[derive(Debug)]
pub struct NodeState {
    /// The node's identity in the cluster view.
    pub id: NodeId,
    pub config: NodeConfig,
    role: AtomicU8,
    up: AtomicBool,
    /// Set when a reload removed the node; its monitor then stops.
    retired: AtomicBool,
    health: Mutex<NodeHealth>,
    /// The primary's WAL insert position or a replica's replay position, as last seen.
    lsn: AtomicU64,
    receive_lsn: AtomicU64,
    lag_bytes: AtomicU64,
    lag_ms: AtomicU64,
    /// Sessions holding a server connection to this node right now.
    outstanding: AtomicU32,
    /// Healthy checks in a row since the last failure.
    healthy_streak: AtomicU32,
    /// May serve reads as far as its health goes: taken out on a failed check or connection
    /// (and when it is fenced or detached), back after `routing.rejoin_after_checks` healthy
    /// checks. Fenced and detached nodes get no reads whatever this says.
    in_read_set: AtomicBool,
    /// A rejoin (rewind or copy) is working on the node's data directory.
    rejoining: AtomicBool,
}

/// Held while a rejoin works on a node; a second one is refused meanwhile.
pub struct RejoinClaim<'a>(&'a NodeState);

impl Drop for RejoinClaim<'_> {
    fn drop(&mut self) {
        self.0.rejoining.store(false, Ordering::Release);
    }
}

impl NodeState {
    fn new(config: NodeConfig, id: NodeId) -> Self {
        NodeState {
            id,
            config,
            role: AtomicU8::new(Role::Unknown.to_u8()),
            up: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            health: Mutex::new(NodeHealth::default()),
            lsn: AtomicU64::new(0),
            receive_lsn: AtomicU64::new(0),
            lag_bytes: AtomicU64::new(0),
            lag_ms: AtomicU64::new(0),
            outstanding: AtomicU32::new(0),
            healthy_streak: AtomicU32::new(0),
            in_read_set: AtomicBool::new(false),
            rejoining: AtomicBool::new(false),
        }
    }

    /// Claims the node for a rejoin; `None` if one is under way.
    pub fn claim_rejoin(&self) -> Option<RejoinClaim<'_>> {
        (!self.rejoining.swap(true, Ordering::AcqRel)).then_some(RejoinClaim(self))
    }

    /// A rejoin is working on the node's data directory now.
    pub fn is_rejoining(&self) -> bool {
        self.rejoining.load(Ordering::Acquire)
    }

    /// A reload removed the node.
    pub fn is_retired(&self) -> bool {
        self.retired.load(Ordering::Acquire)
    }

    pub fn lsn(&self) -> Lsn {
        self.lsn.load(Ordering::Acquire)
    }

    pub fn receive_lsn(&self) -> Lsn {
        self.receive_lsn.load(Ordering::Acquire)
    }

    pub fn lag_bytes(&self) -> u64 {
        self.lag_bytes.load(Ordering::Relaxed)
    }

    pub fn lag_ms(&self) -> u64 {
        self.lag_ms.load(Ordering::Relaxed)
    }

    pub fn in_read_set(&self) -> bool {
        self.in_read_set.load(Ordering::Acquire)
    }

    /// A session saw this replica replay at least `lsn` (a fresher figure than the monitor's).
    pub fn saw_replay(&self, lsn: Lsn) {
        self.lsn.fetch_max(lsn, Ordering::AcqRel);
    }

    pub fn begin_lease(&self) {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
    }

    pub fn end_lease(&self) {
        self.outstanding.fetch_sub(1, Ordering::Relaxed);
    }

    /// A session could not use the node: no reads until it passes enough checks again. The
    /// primary keeps its role and its writes; only its place among readers is affected.
    pub fn leave_read_set(&self, why: &str) {
        self.healthy_streak.store(0, Ordering::Release);
        if self.in_read_set.swap(false, Ordering::AcqRel) {
            tracing::warn!(node = %self.config.name, reason = why, "node leaves the read set");
        }
    }

    fn candidate(&self, role: Role, excluded: bool) -> Candidate {
        Candidate {
            weight: self.config.weight,
            outstanding: self.outstanding.load(Ordering::Relaxed),
            replay_lsn: (role == Role::Replica).then(|| self.lsn()),
            lag_bytes: self.lag_bytes(),
            lag_ms: self.lag_ms(),
            healthy: self.is_up()
                && self.role() == role
                && !excluded
                && (role == Role::Primary || self.in_read_set()),
        }
    }

    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Sessions holding a server connection to this node right now.
    pub fn outstanding(&self) -> u32 {
        self.outstanding.load(Ordering::Relaxed)
    }

    pub fn role(&self) -> Role {
        Role::from_u8(self.role.load(Ordering::Acquire))
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Acquire)
    }

    /// Up and its last health check passed: pgherd declares a node down only after
    /// `health_check_failures_before_down` failed checks, but one failed check is news for
    /// load balancers and for sealing.
    pub fn answers(&self) -> bool {
        self.is_up() && self.health.lock().failed_streak == 0
    }

    pub fn health(&self) -> NodeHealth {
        self.health.lock().clone()
    }

    /// `excluded`: the view fences or detaches the node, which keeps it out of the read set.
    fn record(
        &self,
        outcome: Result<Observation, CheckFailure>,
        thresholds: CheckThresholds,
        excluded: bool,
    ) {
        let mut health = self.health.lock();
        health.last_check = Some(SystemTime::now());
        match outcome {
            Ok(seen) => {
                let role = seen.role;
                let previous = self.role();
                let was_up = self.is_up();
                self.role.store(role.to_u8(), Ordering::Release);
                if previous != role {
                    self.lsn.store(seen.lsn, Ordering::Release);
                } else {
                    self.lsn.fetch_max(seen.lsn, Ordering::AcqRel);
                }
                self.receive_lsn.store(seen.receive_lsn, Ordering::Release);
                self.up.store(true, Ordering::Release);
                health.checks_ok += 1;
                health.failed_streak = 0;
                let settled = health.last_seen.as_ref().is_some_and(|prev| {
                    prev.role == seen.role
                        && prev.receive_lsn == seen.receive_lsn
                        && (prev.lsn == seen.lsn || seen.lsn <= seen.receive_lsn)
                });
                health.settled_checks = if settled {
                    health.settled_checks.saturating_add(1)
                } else {
                    0
                };
                let seen_lsn = seen.lsn;
                health.last_seen = Some(seen);
                health.last_error = None;
                let streak = self.healthy_streak.fetch_add(1, Ordering::AcqRel) + 1;
                // The first check after startup admits a node at once; after a failure it must
                // prove itself several times.
                let first_ever = health.checks_failed == 0 && health.checks_ok == 1;
                // A fenced or detached node stays out of the read set however healthy it is.
                if !self.in_read_set()
                    && !excluded
                    && (first_ever || streak >= thresholds.rejoin_after_checks)
                {
                    self.in_read_set.store(true, Ordering::Release);
                    if !first_ever {
                        tracing::info!(node = %self.config.name, healthy_checks = streak, "node rejoins the read set");
                    }
                }
                if previous != role || !was_up {
                    tracing::info!(node = %self.config.name, role = role.as_str(), lsn = %format_lsn(seen_lsn), "node is up");
                }
            }
            Err(error) => {
                health.checks_failed += 1;
                health.failed_streak = health.failed_streak.saturating_add(1);
                health.settled_checks = 0;
                let failed_streak = health.failed_streak;
                // One slow check on a busy machine must not take a node out of service: it is
                // down only after several failures in a row (failed connections from sessions
                // still take a replica out of the read set at once).
                let down = failed_streak >= thresholds.failures_before_down;
                if self.is_up() {
                    tracing::warn!(node = %self.config.name, %error, kind = error.kind.as_str(), failed_streak, failures_before_down = thresholds.failures_before_down, "node health check failed");
                } else if health.checks_failed == 1 {
                    tracing::warn!(node = %self.config.name, %error, kind = error.kind.as_str(), "node health check failed");
                }
                health.last_error = Some(error);
                let went_down = down && self.up.swap(false, Ordering::AcqRel);
                if went_down {
                    health.times_down += 1;
                }
                drop(health);
                if down {
                    if went_down {
                        tracing::warn!(node = %self.config.name, failed_streak, "node is down");
                    }
                    self.leave_read_set("health check failed");
                }
            }
        }
    }

    /// "pg1 (replica, lag 0 B / 0 ms)" or "pg1 (down: connection refused)", for error messages.
    pub fn describe(&self) -> String {
        if self.is_up() && self.role() == Role::Replica {
            format!(
                "{} (replica{}, lag {} B / {} ms)",
                self.config.name,
                if self.in_read_set() {
                    ""
                } else {
                    ", out of the read set"
                },
                self.lag_bytes(),
                self.lag_ms()
            )
        } else if self.is_up() {
            format!("{} ({})", self.config.name, self.role().as_str())
        } else {
            let error = self
                .health()
                .last_error
                .map_or_else(|| "not checked yet".to_owned(), |e| e.message);
            format!("{} (down: {error})", self.config.name)
        }
    }
}

pub struct Nodes {
    list: ArcSwap<Vec<Arc<NodeState>>>,
    /// Every node name seen since startup; a node's [`NodeId`] is its index here.
    names: Mutex<Vec<String>>,
    /// The cluster view. Read by sessions with a lock-free load; written only by
    /// [`Nodes::change`].
    view: ArcSwap<ClusterState>,
    /// Held by [`Nodes::change`]: one writer at a time, so no change is lost between a load
    /// and a store.
    view_writer: Mutex<()>,
    next_replica: AtomicUsize,
    /// Shared by all sessions so round-robin and weighted shares hold across them.
    read_ticket: AtomicU64,
    /// The primary's WAL position over time (ms since `clock_origin`), to express replica lag
    /// in time.
    primary_history: Mutex<(String, LsnHistory)>,
    clock_origin: Instant,
    pub rejoin_after_checks: AtomicU32,
    pub failures_before_down: AtomicU32,
    /// Woken when a node goes up or down or changes role, and when the view changes: requests
    /// waiting for a primary look again.
    standing: tokio::sync::Notify,
    /// The zone this pgherd runs in (`[pgherd] zone`): reads prefer its replicas.
    local_zone: arc_swap::ArcSwapOption<String>,
}

/// How many checks in a row change a node's standing.
#[derive(Debug, Clone, Copy)]
pub struct CheckThresholds {
    /// Healthy checks before a replica taken out of the read set gets reads again.
    pub rejoin_after_checks: u32,
    /// Failed checks before a node counts as down.
    pub failures_before_down: u32,
}

/// Primary positions kept to date replica lag: at a 100 ms check period, about two minutes of
/// a busy primary.
const PRIMARY_HISTORY_SAMPLES: usize = 1_200;

impl Nodes {
    pub fn new(configs: &[NodeConfig], thresholds: CheckThresholds) -> Self {
        let nodes = Nodes {
            list: ArcSwap::from_pointee(Vec::new()),
            names: Mutex::new(Vec::new()),
            view: ArcSwap::from_pointee(ClusterState::default()),
            view_writer: Mutex::new(()),
            next_replica: AtomicUsize::new(0),
            read_ticket: AtomicU64::new(0),
            primary_history: Mutex::new((String::new(), LsnHistory::new(PRIMARY_HISTORY_SAMPLES))),
            clock_origin: Instant::now(),
            rejoin_after_checks: AtomicU32::new(thresholds.rejoin_after_checks),
            failures_before_down: AtomicU32::new(thresholds.failures_before_down),
            standing: tokio::sync::Notify::new(),
            local_zone: arc_swap::ArcSwapOption::empty(),
        };
        let list = configs
            .iter()
            .map(|c| Arc::new(NodeState::new(c.clone(), nodes.id_for(&c.name))))
            .collect();
        nodes.list.store(Arc::new(list));
        nodes
    }

    /// The id of the node named `name`: the one it had if it was ever configured, else a new
    /// one.
    fn id_for(&self, name: &str) -> NodeId {
        let mut names = self.names.lock();
        let index = match names.iter().position(|n| n == name) {
            Some(index) => index,
            None => {
                names.push(name.to_owned());
                names.len() - 1
            }
        };
        NodeId(index as u32)
    }

    /// The name behind an id (for sentences; the data path never needs it).
    pub fn name_of(&self, id: NodeId) -> String {
        self.names
            .lock()
            .get(id.0 as usize)
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }

    /// Sets the zone reads prefer (`[pgherd] zone`).
    pub fn set_local_zone(&self, zone: Option<String>) {
        self.local_zone.store(zone.map(Arc::new));
    }

    /// The cluster view as it is now.
    pub fn view(&self) -> Arc<ClusterState> {
        self.view.load_full()
    }

    /// The nodes and the view, loaded once: what one plan reads.
    pub fn snapshot(&self) -> Snapshot<'_> {
        Snapshot {
            nodes: self,
            list: self.list.load(),
            view: self.view.load(),
        }
    }

    /// Applies one decision to the cluster view: the only way the view changes. Returns
    /// whether it changed anything. Nodes fenced or detached leave the read set (and come back
    /// only after healthy checks); waiting requests look again.
    pub fn change(&self, change: Change) -> bool {
        let writer = self.view_writer.lock();
        let current = self.view.load_full();
        let Some(next) = current.apply(&change) else {
            return false;
        };
        let (gate_before, gate_after) = (current.gate(), next.gate());
        let (version, epoch) = (next.version, next.epoch);
        self.view.store(Arc::new(next));
        drop(writer);
        tracing::info!(version, epoch, change = %self.describe_change(&change), "cluster view changed");
        if gate_before != gate_after {
            match &gate_after {
                pgherd_failover::Gate::Open => tracing::info!("writes go to the primary again"),
                pgherd_failover::Gate::Hold(why) => {
                    tracing::info!(reason = %self.gate_sentence(why), "writes wait")
                }
                pgherd_failover::Gate::Refuse(why) => {
                    tracing::warn!(reason = %self.gate_sentence(why), "writes are refused")
                }
            }
        }
        match &change {
            Change::Fence(id) | Change::Detach(id) | Change::Attach(id) => {
                if let Some(node) = self.by_id(*id) {
                    node.leave_read_set(match change {
                        Change::Fence(_) => "fenced",
                        Change::Detach(_) => "detached",
                        _ => "attached: reads after healthy checks",
                    });
                }
            }
            _ => {}
        }
        self.standing.notify_waiters();
        true
    }

    fn describe_change(&self, change: &Change) -> String {
        let name = |id: &NodeId| self.name_of(*id);
        match change {
            Change::Elect { node, at_lsn } => {
                format!("{} elected primary at {}", name(node), format_lsn(*at_lsn))
            }
            Change::BeginPromotion { candidate } => format!("promoting {}", name(candidate)),
            Change::AbandonPromotion => "promotion given up".to_owned(),
            Change::Fence(id) => format!("{} fenced", name(id)),
            Change::Unfence(id) => format!("{} unfenced", name(id)),
            Change::Detach(id) => format!("{} detached", name(id)),
            Change::Attach(id) => format!("{} attached", name(id)),
            Change::BeginSwitchover => "switchover begins".to_owned(),
            Change::EndSwitchover => "switchover ends".to_owned(),
            Change::SyncPending => "synchronous standbys to be set".to_owned(),
            Change::SyncInForce(None) => "no synchronous standby set managed".to_owned(),
            Change::SyncInForce(Some(sync)) => format!(
                "synchronous_standby_names = '{}' on {}",
                sync.set.setting(),
                name(&sync.primary)
            ),
            Change::SyncChanging(sync) => format!(
                "synchronous standbys changing on {}: '{}' while the primary reloads",
                sync.as_ref().map_or(String::new(), |s| name(&s.primary)),
                sync.as_ref().map_or(String::new(), |s| s.set.setting())
            ),
            Change::StrictWithoutStandby(None) => "a synchronous standby streams".to_owned(),
            Change::StrictWithoutStandby(Some(id)) => {
                format!("no synchronous standby streams from {}", name(id))
            }
            Change::Pause(None) => "all databases paused".to_owned(),
            Change::Pause(Some(db)) => format!("database \"{db}\" paused"),
            Change::Resume(None) => "everything resumed".to_owned(),
            Change::Resume(Some(db)) => format!("database \"{db}\" resumed"),
            Change::Forget(id) => format!("{} left the config", name(id)),
        }
    }

    /// A reason of the write gate as a sentence with node names.
    pub fn gate_sentence(&self, reason: &GateReason) -> String {
        reason.sentence(|id| self.name_of(id))
    }

    fn by_id(&self, id: NodeId) -> Option<Arc<NodeState>> {
        self.list.load().iter().find(|n| n.id == id).cloned()
    }

    /// Up, in `role`, and neither fenced nor detached.
    pub fn usable_as(&self, node: &NodeState, role: Role) -> bool {
        node.is_up() && node.role() == role && !self.view.load().is_excluded(node.id)
    }

    pub fn is_fenced(&self, node: &NodeState) -> bool {
        self.view.load().is_fenced(node.id)
    }

    pub fn is_detached(&self, node: &NodeState) -> bool {
        self.view.load().is_detached(node.id)
    }

    /// pgherd stopped `node` on purpose: it is down, in no role, until its monitor sees it
    /// answer again (a switchover's old primary comes back as a standby, and no session may
    /// take it for the primary in between).
    pub fn mark_stopped(&self, node: &NodeState, why: &str) {
        node.up.store(false, Ordering::Release);
        node.role.store(Role::Unknown.to_u8(), Ordering::Release);
        node.leave_read_set(why);
        self.standing.notify_waiters();
    }

    /// Whether new transactions of `database` wait for `RESUME`: one load when nothing is
    /// paused.
    pub fn is_paused(&self, database: &str) -> bool {
        self.view.load().is_paused(database)
    }

    /// Waits until `database` is resumed; false if `limit` passed first.
    pub async fn wait_resumed(&self, database: &str, limit: std::time::Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.standing.notified();
            if !self.is_paused(database) {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return !self.is_paused(database);
            }
        }
    }

    pub fn is_switching(&self) -> bool {
        self.view.load().switching
    }

    /// Why writes fail at once, as a sentence, if they do.
    pub fn writes_refused(&self) -> Option<String> {
        self.snapshot().writes_refused()
    }

    /// Resolves when some node's standing may have changed (see `standing`); callers look
    /// again on a timer as well, since a change can land between their look and this call.
    pub async fn standing_changed(&self) {
        self.standing.notified().await
    }

    /// Records a health check and, for replicas, how far behind the primary they are.
    pub fn record(&self, node: &NodeState, outcome: Result<Observation, CheckFailure>) {
        let now_ms = self.clock_origin.elapsed().as_millis() as u64;
        if let Ok(seen) = &outcome {
            let mut history = self.primary_history.lock();
            match seen.role {
                Role::Primary => {
                    if history.0 != node.config.name {
                        history.0 = node.config.name.clone();
                        history.1.clear();
                    }
                    history.1.record(now_ms, seen.lsn);
                    node.lag_bytes.store(0, Ordering::Relaxed);
                    node.lag_ms.store(0, Ordering::Relaxed);
                }
                Role::Replica => {
                    let replay = seen.lsn.max(node.lsn());
                    node.lag_bytes
                        .store(history.1.lag_bytes(replay), Ordering::Relaxed);
                    node.lag_ms
                        .store(history.1.lag_ms(replay, now_ms), Ordering::Relaxed);
                }
                Role::Unknown => {}
            }
        }
        let before = (node.is_up(), node.role());
        node.record(
            outcome,
            CheckThresholds {
                rejoin_after_checks: self.rejoin_after_checks.load(Ordering::Relaxed),
                failures_before_down: self.failures_before_down.load(Ordering::Relaxed),
            },
            self.view.load().is_excluded(node.id),
        );
        if before != (node.is_up(), node.role()) {
            self.standing.notify_waiters();
        }
    }

    pub fn next_read_ticket(&self) -> u64 {
        self.read_ticket.fetch_add(1, Ordering::Relaxed)
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

    /// The node sessions send new writes to: [`Self::writer`], unless the write gate is
    /// closed.
    pub fn primary(&self) -> Option<Arc<NodeState>> {
        self.snapshot().primary()
    }

    /// The node that accepts writes, gate or not (see [`Snapshot::writer`]).
    pub fn writer(&self) -> Option<Arc<NodeState>> {
        self.snapshot().writer()
    }

    /// The elected primary's name, if one was elected.
    pub fn elected(&self) -> Option<String> {
        self.view.load().elected.map(|id| self.name_of(id))
    }

    /// The next healthy replica, round robin; `None` if there is none.
    pub fn pick_replica(&self) -> Option<Arc<NodeState>> {
        let snapshot = self.snapshot();
        let replicas: Vec<&Arc<NodeState>> = snapshot
            .list
            .iter()
            .filter(|n| snapshot.usable_as(n, Role::Replica))
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

    /// Applies a reloaded node list; unchanged nodes keep their state and monitor, and a node
    /// whose name stays keeps its id (and so its place in the view). Returns the nodes that
    /// need a new monitor.
    pub fn reconcile(&self, configs: &[NodeConfig]) -> Vec<Arc<NodeState>> {
        let old = self.list.load_full();
        let mut started = Vec::new();
        let new: Vec<Arc<NodeState>> = configs
            .iter()
            .map(|c| match old.iter().find(|n| n.config == *c) {
                Some(existing) => existing.clone(),
                None => {
                    let node = Arc::new(NodeState::new(c.clone(), self.id_for(&c.name)));
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
        self.list.store(Arc::new(new.clone()));
        for node in old.iter() {
            if !new.iter().any(|n| n.id == node.id) {
                self.change(Change::Forget(node.id));
            }
        }
        started
    }
}

/// The nodes and the cluster view as one plan sees them: loaded once, without a lock.
pub struct Snapshot<'a> {
    nodes: &'a Nodes,
    list: Guard<Arc<Vec<Arc<NodeState>>>>,
    view: Guard<Arc<ClusterState>>,
}

impl Snapshot<'_> {
    /// Up, in `role`, and neither fenced nor detached.
    fn usable_as(&self, node: &NodeState, role: Role) -> bool {
        node.is_up() && node.role() == role && !self.view.is_excluded(node.id)
    }

    /// The node that accepts writes: `ClusterState::writer` over the nodes that are up and
    /// report being primary, the same function the failover simulation checks.
    pub fn writer(&self) -> Option<Arc<NodeState>> {
        let primaries = || {
            self.list
                .iter()
                .filter(|n| n.is_up() && n.role() == Role::Primary)
        };
        let Some(id) = self.view.writer(primaries().map(|n| n.id)) else {
            if self.view.elected.is_none() {
                let unexcluded: Vec<&str> = primaries()
                    .filter(|n| !self.view.is_excluded(n.id))
                    .map(|n| n.name())
                    .collect();
                if unexcluded.len() > 1 {
                    tracing::error!(nodes = %unexcluded.join(", "), "several nodes report being primary and none is elected: no writes");
                }
            }
            return None;
        };
        primaries().find(|n| n.id == id).cloned()
    }
}

/// With a local zone and a healthy candidate in it, candidates elsewhere take no reads: a
/// replica across zones serves only when none in this one can.
fn prefer_zone(local: Option<&str>, nodes: &[Arc<NodeState>], candidates: &mut [Candidate]) {
    let Some(local) = local else { return };
    let in_zone = |node: &NodeState| node.config.zone.as_deref() == Some(local);
    let any_local = nodes
        .iter()
        .zip(candidates.iter())
        .any(|(n, c)| c.healthy && in_zone(n));
    if any_local {
        for (node, candidate) in nodes.iter().zip(candidates.iter_mut()) {
            if !in_zone(node) {
                candidate.healthy = false;
            }
        }
    }
}

/// The data path's view of the cluster for the planner.
impl ClusterView for Snapshot<'_> {
    type Node = Arc<NodeState>;

    fn standing(&self, node: &Arc<NodeState>) -> NodeStanding {
        NodeStanding {
            role: node.role(),
            up: node.is_up(),
            excluded: self.view.is_excluded(node.id),
            in_read_set: node.in_read_set(),
        }
    }

    fn primary(&self) -> Option<Arc<NodeState>> {
        if self.view.writes_held() {
            return None;
        }
        self.writer()
    }

    fn writes_paused(&self) -> bool {
        self.view.writes_held()
    }

    fn writes_refused(&self) -> Option<String> {
        self.view
            .writes_refused()
            .map(|why| self.nodes.gate_sentence(&why))
    }

    /// Where a read may go, in config order; the primary is among them only when
    /// `primary_reads` (and not while the write gate holds: a primary being switched over
    /// drains).
    fn read_candidates(&self, primary_reads: bool) -> (Vec<Arc<NodeState>>, Vec<Candidate>) {
        let primary_reads = primary_reads && !self.view.writes_held();
        let reads_here = |n: &Arc<NodeState>| {
            let role = n.role();
            role == Role::Replica || (primary_reads && role == Role::Primary)
        };
        if !self.list.iter().any(reads_here) {
            // A cluster without replicas pays nothing for routing.
            return (Vec::new(), Vec::new());
        }
        let mut nodes = Vec::with_capacity(self.list.len());
        let mut candidates = Vec::with_capacity(self.list.len());
        for node in self.list.iter() {
            let role = node.role();
            if role == Role::Replica || (primary_reads && role == Role::Primary) {
                candidates.push(node.candidate(role, self.view.is_excluded(node.id)));
                nodes.push(node.clone());
            }
        }
        prefer_zone(
            self.nodes.local_zone.load().as_deref().map(String::as_str),
            &nodes,
            &mut candidates,
        );
        (nodes, candidates)
    }

    fn read_ticket(&self, balance: Balance) -> u64 {
        match balance {
            Balance::Random => rand::random(),
            _ => self.nodes.next_read_ticket(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(name: &str, port: u16) -> NodeConfig {
        NodeConfig {
            name: name.into(),
            host: "127.0.0.1".into(),
            port,
            data_dir: None,
            netns: None,
            weight: 1,
            priority: 1,
            zone: None,
            sync: true,
        }
    }

    fn one_node(failures_before_down: u32) -> (Nodes, Arc<NodeState>) {
        let nodes = Nodes::new(
            &[config("pg1", 5432)],
            CheckThresholds {
                rejoin_after_checks: 2,
                failures_before_down,
            },
        );
        let node = nodes.list.load()[0].clone();
        (nodes, node)
    }

    fn timeout() -> CheckFailure {
        CheckFailure::new(CheckFailureKind::Timeout, "no answer within 2000 ms")
    }

    fn refused() -> CheckFailure {
        CheckFailure::new(CheckFailureKind::Refused, "connection refused")
    }

    fn seen(role: Role) -> Result<Observation, CheckFailure> {
        Ok(Observation {
            role,
            lsn: 100,
            receive_lsn: 0,
            timeline: 1,
            upstream_streaming: false,
            streaming_standbys: Vec::new(),
        })
    }

    #[test]
    fn a_node_is_down_only_after_consecutive_failed_checks() {
        let (nodes, node) = one_node(3);
        nodes.record(&node, seen(Role::Replica));
        assert!(node.is_up() && node.in_read_set());
        nodes.record(&node, Err(timeout()));
        nodes.record(&node, Err(timeout()));
        assert!(node.is_up() && node.in_read_set(), "two slow checks");
        // A good check in between starts the count again.
        nodes.record(&node, seen(Role::Replica));
        nodes.record(&node, Err(timeout()));
        nodes.record(&node, Err(timeout()));
        assert!(node.is_up());
        nodes.record(&node, Err(refused()));
        assert!(!node.is_up() && !node.in_read_set());
        assert_eq!(node.health().failed_streak, 3);
        // Back up at once, back in the read set after `rejoin_after_checks` good checks.
        nodes.record(&node, seen(Role::Replica));
        assert!(node.is_up() && !node.in_read_set());
        nodes.record(&node, seen(Role::Replica));
        assert!(node.in_read_set());
    }

    #[test]
    fn one_failure_is_enough_when_configured() {
        let (nodes, node) = one_node(1);
        nodes.record(&node, seen(Role::Primary));
        nodes.record(&node, Err(refused()));
        assert!(!node.is_up());
        assert!(nodes.primary().is_none());
    }

    fn names(nodes: &[Arc<NodeState>]) -> Vec<&str> {
        nodes.iter().map(|n| n.name()).collect()
    }

    #[test]
    fn the_view_decides_where_writes_and_reads_go() {
        let nodes = Nodes::new(
            &[config("pg1", 5432), config("pg2", 5433)],
            CheckThresholds {
                rejoin_after_checks: 1,
                failures_before_down: 1,
            },
        );
        let (pg1, pg2) = (nodes.get("pg1").unwrap(), nodes.get("pg2").unwrap());
        nodes.record(&pg1, seen(Role::Primary));
        nodes.record(&pg2, seen(Role::Replica));
        // The first view holds writes until the synchronous set is known.
        assert!(nodes.primary().is_none());
        assert_eq!(nodes.writer().map(|n| n.id), Some(pg1.id));
        assert!(nodes.change(Change::SyncInForce(None)));
        assert_eq!(nodes.primary().map(|n| n.id), Some(pg1.id));
        nodes.change(Change::Elect {
            node: pg1.id,
            at_lsn: 0,
        });
        assert!(
            nodes.primary().is_none(),
            "a new epoch waits for its standbys"
        );
        nodes.change(Change::SyncInForce(None));
        assert_eq!(nodes.view().epoch, 1);

        // Failover replaces pg1: from here no node takes writes until pg2 is elected, even
        // once pg2 reports being primary.
        nodes.change(Change::BeginPromotion { candidate: pg2.id });
        nodes.change(Change::Fence(pg1.id));
        assert!(nodes.writer().is_none());
        let snapshot = nodes.snapshot();
        let (readers, candidates) = snapshot.read_candidates(true);
        assert_eq!(
            names(&readers),
            ["pg2"],
            "the primary reads only while writes flow"
        );
        assert!(candidates[0].healthy);
        drop(snapshot);
        nodes.record(&pg2, seen(Role::Primary));
        assert!(nodes.writer().is_none(), "promoting: not yet");
        nodes.change(Change::Elect {
            node: pg2.id,
            at_lsn: 0,
        });
        assert_eq!(nodes.writer().map(|n| n.id), Some(pg2.id));
        assert!(nodes.primary().is_none(), "its synchronous standbys first");
        nodes.change(Change::SyncInForce(None));
        assert_eq!(nodes.primary().map(|n| n.id), Some(pg2.id));
        // The fenced pg1 answers as a primary again: it gets nothing.
        nodes.record(&pg1, seen(Role::Primary));
        assert_eq!(nodes.writer().map(|n| n.id), Some(pg2.id));
        assert!(!pg1.in_read_set());
        let view = nodes.view();
        assert_eq!((view.epoch, view.elected), (2, Some(pg2.id)));
        assert!(
            !nodes.change(Change::Fence(pg1.id)),
            "fencing twice changes nothing"
        );
        assert_eq!(nodes.view().version, view.version);
    }

    #[test]
    fn a_node_keeps_its_id_and_its_place_in_the_view_across_reloads() {
        let nodes = Nodes::new(
            &[config("pg1", 5432), config("pg2", 5433)],
            CheckThresholds {
                rejoin_after_checks: 1,
                failures_before_down: 1,
            },
        );
        let pg2 = nodes.get("pg2").unwrap().id;
        nodes.change(Change::Detach(pg2));
        // pg2 moves to another port: a new monitor, the same identity and standing.
        let started = nodes.reconcile(&[config("pg1", 5432), config("pg2", 6433)]);
        assert_eq!(names(&started), ["pg2"]);
        assert_eq!(started[0].id, pg2);
        assert!(nodes.view().is_detached(pg2));
        // Removed, it leaves the view; added again, it comes back with its old id, attached.
        nodes.reconcile(&[config("pg1", 5432)]);
        assert!(!nodes.view().is_detached(pg2));
        let started = nodes.reconcile(&[
            config("pg1", 5432),
            config("pg3", 5434),
            config("pg2", 5433),
        ]);
        assert_eq!(names(&started), ["pg3", "pg2"]);
        assert_eq!(started[1].id, pg2);
        assert_ne!(started[0].id, pg2);
    }

    #[test]
    fn reads_stay_in_pgherds_zone_while_a_replica_there_can_take_them() {
        let zoned = |name: &str, port: u16, zone: &str| NodeConfig {
            zone: Some(zone.into()),
            ..config(name, port)
        };
        let nodes = Nodes::new(
            &[
                zoned("pg1", 5432, "a"),
                zoned("pg2", 5433, "a"),
                zoned("pg3", 5434, "b"),
            ],
            CheckThresholds {
                rejoin_after_checks: 1,
                failures_before_down: 1,
            },
        );
        for (name, role) in [
            ("pg1", Role::Primary),
            ("pg2", Role::Replica),
            ("pg3", Role::Replica),
        ] {
            nodes.record(&nodes.get(name).unwrap(), seen(role));
        }
        let healthy = |nodes: &Nodes| {
            let snapshot = nodes.snapshot();
            let (readers, candidates) = snapshot.read_candidates(false);
            readers
                .iter()
                .zip(&candidates)
                .filter(|(_, c)| c.healthy)
                .map(|(n, _)| n.name().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(
            healthy(&nodes),
            ["pg2", "pg3"],
            "no zone of its own: every replica"
        );
        nodes.set_local_zone(Some("a".into()));
        assert_eq!(healthy(&nodes), ["pg2"]);
        nodes.set_local_zone(Some("b".into()));
        assert_eq!(healthy(&nodes), ["pg3"]);
        // The local replica out: the other zone serves.
        nodes.change(Change::Detach(nodes.get("pg3").unwrap().id));
        assert_eq!(healthy(&nodes), ["pg2"]);
    }
}
