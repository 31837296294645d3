//! The PostgreSQL nodes pgherd fronts: their roles, discovered with `pg_is_in_recovery()` rather
//! than trusted from the config, and whether they answer. One monitor task per node keeps a
//! management connection open and checks it every `cluster.health_check_period_ms`.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pgherd_config::{ClusterSettings, NodeConfig};
use pgherd_route::balance::{
    format_lsn, insert_lsn_as_end, parse_lsn, Balance, Candidate, Lsn, LsnHistory,
};
use pgherd_route::plan::{ClusterView, NodeStanding};

use crate::pool::ConnectContext;
use crate::server::{self, ConnectSpec, QueryError, ServerConn, ServerCredentials};

pub use pgherd_route::Role;

#[derive(Debug, Default, Clone)]
pub struct NodeHealth {
    pub last_error: Option<String>,
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
    /// May serve reads: taken out on a failed check or connection, back after
    /// `routing.rejoin_after_checks` healthy checks.
    in_read_set: AtomicBool,
    /// Why the node gets no traffic: [`FENCED`] by failover (a primary that was replaced, or a
    /// node that accepts writes but was not elected), [`DETACHED`] by the operator. One atomic,
    /// so the per-transaction check stays one load.
    excluded: AtomicU8,
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

const FENCED: u8 = 1;
const DETACHED: u8 = 2;

impl NodeState {
    fn new(config: NodeConfig) -> Self {
        NodeState {
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
            excluded: AtomicU8::new(0),
            rejoining: AtomicBool::new(false),
        }
    }

    pub fn is_fenced(&self) -> bool {
        self.excluded.load(Ordering::Acquire) & FENCED != 0
    }

    /// The operator took the node out of traffic (`DETACH`).
    pub fn is_detached(&self) -> bool {
        self.excluded.load(Ordering::Acquire) & DETACHED != 0
    }

    /// Claims the node for a rejoin; `None` if one is under way.
    pub fn claim_rejoin(&self) -> Option<RejoinClaim<'_>> {
        (!self.rejoining.swap(true, Ordering::AcqRel)).then_some(RejoinClaim(self))
    }

    /// Fenced or detached: no traffic either way.
    pub fn is_excluded(&self) -> bool {
        self.excluded.load(Ordering::Acquire) != 0
    }

    /// Lets the node have traffic again (it rejoined as a standby); reads still wait for
    /// `rejoin_after_checks` healthy checks.
    pub fn unfence(&self) {
        self.excluded.fetch_and(!FENCED, Ordering::AcqRel);
    }

    /// Takes the node out of all traffic; returns whether it was not fenced before.
    pub fn fence(&self) -> bool {
        self.exclude(FENCED)
    }

    /// The operator's exclusion; returns whether it was not detached before.
    pub fn detach(&self) -> bool {
        self.exclude(DETACHED)
    }

    /// Undoes [`Self::detach`]; returns whether it was detached. Reads come back after
    /// `rejoin_after_checks` healthy checks, as after a failure.
    pub fn attach(&self) -> bool {
        self.healthy_streak.store(0, Ordering::Release);
        self.excluded.fetch_and(!DETACHED, Ordering::AcqRel) & DETACHED != 0
    }

    fn exclude(&self, why: u8) -> bool {
        let first = self.excluded.fetch_or(why, Ordering::AcqRel) & why == 0;
        if first {
            self.in_read_set.store(false, Ordering::Release);
        }
        first
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

    fn candidate(&self, role: Role) -> Candidate {
        Candidate {
            weight: self.config.weight,
            outstanding: self.outstanding.load(Ordering::Relaxed),
            replay_lsn: (role == Role::Replica).then(|| self.lsn()),
            lag_bytes: self.lag_bytes(),
            lag_ms: self.lag_ms(),
            healthy: self.is_usable_as(role) && (role == Role::Primary || self.in_read_set()),
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

    /// Up, in `role` and neither fenced nor detached: three atomic loads, cheap enough for
    /// every transaction.
    pub fn is_usable_as(&self, role: Role) -> bool {
        self.is_up() && self.role() == role && !self.is_excluded()
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

    fn record(&self, outcome: Result<Observation, String>, thresholds: CheckThresholds) {
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
                    && !self.is_excluded()
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
                    tracing::warn!(node = %self.config.name, %error, failed_streak, failures_before_down = thresholds.failures_before_down, "node health check failed");
                } else if health.checks_failed == 1 {
                    tracing::warn!(node = %self.config.name, %error, "node health check failed");
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
                .unwrap_or_else(|| "not checked yet".into());
            format!("{} (down: {error})", self.config.name)
        }
    }
}

pub struct Nodes {
    list: ArcSwap<Vec<Arc<NodeState>>>,
    next_replica: AtomicUsize,
    /// Shared by all sessions so round-robin and weighted shares hold across them.
    read_ticket: AtomicU64,
    /// The primary's WAL position over time (ms since `clock_origin`), to express replica lag
    /// in time.
    primary_history: Mutex<(String, LsnHistory)>,
    clock_origin: Instant,
    pub rejoin_after_checks: AtomicU32,
    pub failures_before_down: AtomicU32,
    /// The node failover elected as the primary; `None` until it runs (and always when it is
    /// off), when the node that reports being primary is used.
    elected: Mutex<Option<String>>,
    /// Woken when a node goes up or down, changes role, or the election changes: requests
    /// waiting for a primary look again.
    standing: tokio::sync::Notify,
    /// Why writes are refused even though a primary answers (`strict` durability with no
    /// synchronous standby streaming).
    writes_refused: Mutex<Option<String>>,
    /// `writes_refused` is set: the one load every write pays.
    any_writes_refused: AtomicBool,
    /// A switchover is under way: no node takes new transactions as the primary (they wait)
    /// and failover does not act.
    switching: AtomicBool,
    /// Set at startup and whenever another node is elected; cleared once the writer's
    /// synchronous standbys are in force (or durability is `async`).
    sync_pending: AtomicBool,
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
            read_ticket: AtomicU64::new(0),
            primary_history: Mutex::new((String::new(), LsnHistory::new(PRIMARY_HISTORY_SAMPLES))),
            clock_origin: Instant::now(),
            rejoin_after_checks: AtomicU32::new(thresholds.rejoin_after_checks),
            failures_before_down: AtomicU32::new(thresholds.failures_before_down),
            elected: Mutex::new(None),
            standing: tokio::sync::Notify::new(),
            writes_refused: Mutex::new(None),
            any_writes_refused: AtomicBool::new(false),
            switching: AtomicBool::new(false),
            sync_pending: AtomicBool::new(true),
        }
    }

    /// Refuses writes with `reason`, or accepts them again with `None`.
    pub fn refuse_writes(&self, reason: Option<String>) {
        let mut refused = self.writes_refused.lock();
        if *refused != reason {
            match &reason {
                Some(why) => tracing::warn!(reason = %why, "writes are refused"),
                None => tracing::info!("writes are accepted again"),
            }
            self.any_writes_refused
                .store(reason.is_some(), Ordering::Release);
            *refused = reason;
            drop(refused);
            self.standing.notify_waiters();
        }
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

    /// Starts a switchover; false if one is under way already.
    pub fn begin_switching(&self) -> bool {
        self.switching
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Ends a switchover: new transactions go to the (new) primary.
    pub fn end_switching(&self) {
        self.switching.store(false, Ordering::Release);
        self.standing.notify_waiters();
    }

    pub fn is_switching(&self) -> bool {
        self.switching.load(Ordering::Acquire)
    }

    /// New transactions wait rather than go to the primary: a switchover is under way, or
    /// in `sync`/`strict` durability the primary's synchronous standbys are not set yet (a
    /// commit acknowledged now could exist on the primary alone).
    pub fn writes_paused(&self) -> bool {
        self.switching.load(Ordering::Acquire) || self.sync_pending.load(Ordering::Acquire)
    }

    /// Whether the writer's synchronous standbys still have to be set before it takes writes.
    pub fn set_sync_pending(&self, pending: bool) {
        if self.sync_pending.swap(pending, Ordering::AcqRel) != pending {
            if pending {
                tracing::info!("writes wait until the primary's synchronous standbys are set");
            }
            self.standing.notify_waiters();
        }
    }

    pub fn writes_refused(&self) -> Option<String> {
        if !self.any_writes_refused.load(Ordering::Acquire) {
            return None;
        }
        self.writes_refused.lock().clone()
    }

    /// Resolves when some node's standing may have changed (see `standing`); callers look
    /// again on a timer as well, since a change can land between their look and this call.
    pub async fn standing_changed(&self) {
        self.standing.notified().await
    }

    /// Records a health check and, for replicas, how far behind the primary they are.
    pub fn record(&self, node: &NodeState, outcome: Result<Observation, String>) {
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
        );
        if before != (node.is_up(), node.role()) {
            self.standing.notify_waiters();
        }
    }

    /// Where a read may go, in config order, with what the chooser needs to know; the primary
    /// is among them only when `primary_reads`.
    pub fn read_candidates(&self, primary_reads: bool) -> (Vec<Arc<NodeState>>, Vec<Candidate>) {
        // The primary being switched over drains; it takes no new reads either.
        let primary_reads = primary_reads && !self.writes_paused();
        let list = self.list.load();
        let reads_here = |n: &Arc<NodeState>| {
            let role = n.role();
            role == Role::Replica || (primary_reads && role == Role::Primary)
        };
        if !list.iter().any(reads_here) {
            // A cluster without replicas pays nothing for routing.
            return (Vec::new(), Vec::new());
        }
        let mut nodes = Vec::with_capacity(list.len());
        let mut candidates = Vec::with_capacity(list.len());
        for node in list.iter() {
            let role = node.role();
            if role == Role::Replica || (primary_reads && role == Role::Primary) {
                candidates.push(node.candidate(role));
                nodes.push(node.clone());
            }
        }
        (nodes, candidates)
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

    /// The node sessions send writes to: [`Self::writer`], unless writes are paused (a
    /// switchover, or a primary whose synchronous standbys are not set yet).
    pub fn primary(&self) -> Option<Arc<NodeState>> {
        if self.writes_paused() {
            return None;
        }
        self.writer()
    }

    /// The node that accepts writes: the elected primary when failover runs. Without an
    /// election, if monitoring ever sees two, the first in config order is used and both are
    /// reported.
    pub fn writer(&self) -> Option<Arc<NodeState>> {
        let list = self.list.load();
        if let Some(elected) = self.elected.lock().as_deref() {
            return list
                .iter()
                .find(|n| n.name() == elected && n.is_usable_as(Role::Primary))
                .cloned();
        }
        let mut primaries = list.iter().filter(|n| n.is_usable_as(Role::Primary));
        let first = primaries.next().cloned();
        if let Some(other) = primaries.next() {
            tracing::error!(first = %first.as_ref().map_or("", |n| n.name()), second = %other.name(), "two nodes report being primary");
        }
        first
    }

    pub fn elected(&self) -> Option<String> {
        self.elected.lock().clone()
    }

    /// Failover's choice of primary (`None` while a promotion is under way: no writes).
    pub fn elect(&self, name: Option<&str>) {
        let mut elected = self.elected.lock();
        if name.is_some() && elected.as_deref() != name {
            // Another primary: its synchronous standbys must be set before it takes writes.
            self.sync_pending.store(true, Ordering::Release);
        }
        *elected = name.map(str::to_owned);
        drop(elected);
        self.standing.notify_waiters();
    }

    /// The next healthy replica, round robin; `None` if there is none.
    pub fn pick_replica(&self) -> Option<Arc<NodeState>> {
        let list = self.list.load();
        let replicas: Vec<&Arc<NodeState>> = list
            .iter()
            .filter(|n| n.is_usable_as(Role::Replica))
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

/// The data path's view of the cluster for the planner: the nodes' atomics, read at the
/// moment of the plan.
impl ClusterView for Nodes {
    type Node = Arc<NodeState>;

    fn standing(&self, node: &Arc<NodeState>) -> NodeStanding {
        NodeStanding {
            role: node.role(),
            up: node.is_up(),
            excluded: node.is_excluded(),
            in_read_set: node.in_read_set(),
        }
    }

    fn primary(&self) -> Option<Arc<NodeState>> {
        Nodes::primary(self)
    }

    fn writes_paused(&self) -> bool {
        Nodes::writes_paused(self)
    }

    fn writes_refused(&self) -> Option<String> {
        Nodes::writes_refused(self)
    }

    fn read_candidates(&self, primary_reads: bool) -> (Vec<Arc<NodeState>>, Vec<Candidate>) {
        Nodes::read_candidates(self, primary_reads)
    }

    fn read_ticket(&self, balance: Balance) -> u64 {
        match balance {
            Balance::Random => rand::random(),
            _ => self.next_read_ticket(),
        }
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

/// A connection as pgherd's own user (`[cluster]`) to `database` on `node`.
pub async fn management_connection(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    database: &str,
) -> Result<ServerConn, crate::error::ServerError> {
    let credentials = management_credentials(cluster);
    let spec = ConnectSpec {
        node: &node.config.name,
        host: &node.config.host,
        port: node.config.port,
        user: &cluster.user,
        database,
        credentials: &credentials,
        tls_mode: ctx.tls_mode,
        tls: ctx.tls.as_ref(),
        timeout: Duration::from_millis(cluster.health_check_timeout_ms),
    };
    let id = ctx.next_server_id.fetch_add(1, Ordering::Relaxed);
    server::connect(&spec, id, 1).await
}

/// One health check: (re)connect if needed and ask the node whether it is in recovery.
pub async fn check_once(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    conn: &mut Option<ServerConn>,
) -> Result<Observation, String> {
    let timeout = Duration::from_millis(cluster.health_check_timeout_ms);
    if conn.is_none() {
        *conn = Some(
            management_connection(node, cluster, ctx, &cluster.database)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let Some(c) = conn.as_mut() else {
        return Err("no management connection".into());
    };
    let answer = tokio::time::timeout(timeout, c.simple_query(CHECK_SQL)).await;
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
    let row = rows.first().map(|r| r.as_slice()).unwrap_or_default();
    let field = |i: usize| row.get(i).and_then(|v| v.as_deref());
    let lsn = |i: usize| field(i).and_then(parse_lsn).unwrap_or(0);
    let role = match field(0) {
        Some("t") => Role::Replica,
        Some("f") => Role::Primary,
        other => {
            return Err(format!(
                "unexpected answer to pg_is_in_recovery(): {other:?}"
            ))
        }
    };
    Ok(Observation {
        role,
        lsn: match role {
            Role::Primary => insert_lsn_as_end(lsn(1)),
            _ => lsn(1),
        },
        receive_lsn: lsn(2),
        timeline: field(3).and_then(|t| t.parse().ok()).unwrap_or(0),
        upstream_streaming: field(4) == Some("t"),
        streaming_standbys: field(5)
            .map(|names| names.lines().map(str::to_owned).collect())
            .unwrap_or_default(),
    })
}

/// Role, then the primary's insert position or the replica's replay position, what a replica
/// has received, the checkpoint timeline, and whether a replica's WAL receiver is streaming and
/// heard from its upstream within `wal_receiver_timeout` (the split-brain guard asks replicas
/// whether they still hear the primary; a hung primary keeps the connection open but goes
/// silent), and on a primary
/// the standbys streaming from it (application names can hold no newline).
const CHECK_SQL: &str = "SELECT pg_is_in_recovery(), \
     CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END, \
     pg_last_wal_receive_lsn(), \
     (SELECT timeline_id FROM pg_control_checkpoint()), \
     EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming' \
       AND (current_setting('wal_receiver_timeout')::interval = '0' \
            OR last_msg_receipt_time > now() - current_setting('wal_receiver_timeout')::interval)), \
     (SELECT string_agg(application_name, E'\\n') FROM pg_stat_replication WHERE state = 'streaming')";

/// Checks every node once, concurrently; used at startup so routing is known before the
/// first client arrives.
pub async fn check_all_once(
    nodes: &Arc<Nodes>,
    cluster: &ClusterSettings,
    ctx: &Arc<ConnectContext>,
) {
    let mut checks = tokio::task::JoinSet::new();
    for node in nodes.all().iter() {
        let (nodes, node, cluster, ctx) =
            (nodes.clone(), node.clone(), cluster.clone(), ctx.clone());
        checks.spawn(async move {
            let mut conn = None;
            let outcome = check_once(&node, &cluster, &ctx, &mut conn).await;
            nodes.record(&node, outcome);
        });
    }
    while checks.join_next().await.is_some() {}
}

/// Runs until the node is retired or `stop` fires.
pub async fn monitor(
    nodes: Arc<Nodes>,
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
        nodes.record(&node, outcome);
        let period = Duration::from_millis(cluster.health_check_period_ms);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_node(failures_before_down: u32) -> (Nodes, Arc<NodeState>) {
        let config = NodeConfig {
            name: "pg1".into(),
            host: "127.0.0.1".into(),
            port: 5432,
            data_dir: None,
            netns: None,
            weight: 1,
            priority: 1,
        };
        let nodes = Nodes::new(
            &[config],
            CheckThresholds {
                rejoin_after_checks: 2,
                failures_before_down,
            },
        );
        let node = nodes.list.load()[0].clone();
        (nodes, node)
    }

    fn seen(role: Role) -> Result<Observation, String> {
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
        nodes.record(&node, Err("no answer within 2000 ms".into()));
        nodes.record(&node, Err("no answer within 2000 ms".into()));
        assert!(node.is_up() && node.in_read_set(), "two slow checks");
        // A good check in between starts the count again.
        nodes.record(&node, seen(Role::Replica));
        nodes.record(&node, Err("no answer within 2000 ms".into()));
        nodes.record(&node, Err("no answer within 2000 ms".into()));
        assert!(node.is_up());
        nodes.record(&node, Err("connection refused".into()));
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
        nodes.record(&node, Err("connection refused".into()));
        assert!(!node.is_up());
        assert!(nodes.primary().is_none());
    }
}
