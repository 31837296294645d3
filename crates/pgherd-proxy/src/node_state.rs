//! One node as the monitors see it: up or not, its role (discovered with
//! `pg_is_in_recovery()`, never trusted from the config), WAL positions and lag, read-set
//! membership by health, and what its health checks found. Observations only: what pgherd
//! decided about the node is in the cluster view (`nodes.rs`).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use parking_lot::Mutex;
use pgherd_config::NodeConfig;
use pgherd_failover::observe::{Sighting, Track};
use pgherd_failover::NodeId;
use pgherd_route::balance::{format_lsn, Balance, Candidate, Lsn};

use crate::counters::{GaugeStripe, StripedGauge};

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
    /// The checks as failover counts them (failed in a row, a standby's settled position):
    /// `pgherd_failover::observe`, which the simulation keeps too.
    pub track: Track,
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
    /// On a replica: the address its WAL receiver streams from (`pg_stat_wal_receiver`'s
    /// sender), when it is connected.
    pub upstream_address: Option<(String, u16)>,
}

impl NodeState {
    /// The node among `nodes` at the address this replica's WAL receiver streams from (a
    /// cascading replica's is another replica); `None` when not streaming or no node's.
    pub fn upstream_among(&self, nodes: &[Arc<NodeState>]) -> Option<String> {
        let health = self.health();
        let (host, port) = health.last_seen.as_ref()?.upstream_address.as_ref()?;
        nodes
            .iter()
            .find(|n| &n.config.host == host && n.config.port == *port)
            .map(|n| n.name().to_owned())
    }
}

impl Observation {
    /// What failover takes from it; `None` for a node whose role is not known.
    pub fn sighting(&self) -> Option<Sighting> {
        let primary = match self.role {
            Role::Primary => true,
            Role::Replica => false,
            Role::Unknown => return None,
        };
        Some(Sighting {
            primary,
            timeline: self.timeline,
            lsn: self.lsn,
            received_lsn: self.receive_lsn,
            upstream_alive: self.upstream_streaming,
        })
    }
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
    /// Sessions holding a server connection to this node right now. Striped: every
    /// transaction takes and gives one back, and the fields above are read by every plan on
    /// every worker.
    outstanding: StripedGauge,
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
    pub(crate) fn new(config: NodeConfig, id: NodeId) -> Self {
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
            outstanding: StripedGauge::default(),
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

    /// A reload removed the node: its monitor stops.
    pub(crate) fn retire(&self) {
        self.retired.store(true, Ordering::Release);
    }

    /// pgherd stopped the node on purpose: down, in no role, until its monitor sees it again.
    pub(crate) fn mark_stopped(&self, why: &str) {
        self.up.store(false, Ordering::Release);
        self.role.store(Role::Unknown.to_u8(), Ordering::Release);
        self.leave_read_set(why);
    }

    pub(crate) fn set_lag(&self, bytes: u64, ms: u64) {
        self.lag_bytes.store(bytes, Ordering::Relaxed);
        self.lag_ms.store(ms, Ordering::Relaxed);
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

    /// A session holds a server connection to this node from now on: give the result back to
    /// [`Self::end_lease`].
    pub fn begin_lease(&self) -> GaugeStripe {
        self.outstanding.take()
    }

    pub fn end_lease(&self, begun: GaugeStripe) {
        self.outstanding.give_back(begun);
    }

    /// A session could not use the node: no reads until it passes enough checks again. The
    /// primary keeps its role and its writes; only its place among readers is affected.
    pub fn leave_read_set(&self, why: &str) {
        self.healthy_streak.store(0, Ordering::Release);
        if self.in_read_set.swap(false, Ordering::AcqRel) {
            tracing::warn!(node = %self.config.name, reason = why, "node leaves the read set");
        }
    }

    /// What the chooser needs to know of this node. The sessions it serves are summed only
    /// when `least_outstanding` asks: the sum reads every worker's stripe.
    pub(crate) fn candidate(&self, role: Role, excluded: bool, balance: Balance) -> Candidate {
        Candidate {
            weight: self.config.weight,
            outstanding: if balance == Balance::LeastOutstanding {
                self.outstanding.sum()
            } else {
                0
            },
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
        self.outstanding.sum()
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
        self.is_up() && self.health.lock().track.failed_streak() == 0
    }

    pub fn health(&self) -> NodeHealth {
        self.health.lock().clone()
    }

    /// `excluded`: the view fences or detaches the node, which keeps it out of the read set.
    pub(crate) fn record(
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
                match seen.sighting() {
                    Some(sighting) => health.track.saw(sighting),
                    None => health.track.failed(),
                }
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
                health.track.failed();
                let failed_streak = health.track.failed_streak();
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

/// How many checks in a row change a node's standing.
#[derive(Debug, Clone, Copy)]
pub struct CheckThresholds {
    /// Healthy checks before a replica taken out of the read set gets reads again.
    pub rejoin_after_checks: u32,
    /// Failed checks before a node counts as down.
    pub failures_before_down: u32,
}
