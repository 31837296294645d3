//! The PostgreSQL nodes pgherd fronts, in two parts. What the monitors (`monitor.rs`)
//! *observe* of each node (`node_state.rs`): up or not, its role, WAL positions and lag, kept
//! in atomics the data path reads. And what pgherd *decided* about the cluster: the cluster
//! view (`pgherd_failover::ClusterState`: the elected primary, fenced and detached nodes, the
//! synchronous set, the write gate with its reason), one versioned value changed only through
//! [`Nodes::change`] and read by sessions without a lock ([`Nodes::snapshot`], `snapshot.rs`).

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use pgherd_config::NodeConfig;
use pgherd_failover::{Change, ClusterState, GateReason, NodeId};
use pgherd_route::balance::{format_lsn, LsnHistory};
use pgherd_route::plan::ClusterView;

use crate::counters::StripedCounter;

pub use crate::node_state::{
    CheckFailure, CheckFailureKind, CheckThresholds, NodeHealth, NodeState, Observation,
    RejoinClaim, Role,
};
use crate::shared_swap::{SharedSwap, SwapCache};
use crate::snapshot::Held;
pub use crate::snapshot::Snapshot;

/// A session's copies of one [`Nodes`]' list and view ([`Nodes::cache`]). An old copy lives
/// until the session plans again or ends.
pub struct NodesCache {
    list: SwapCache<Vec<Arc<NodeState>>>,
    view: SwapCache<ClusterState>,
}

/// How often a request waiting for a primary looks again when no node's standing changes
/// (a primary that restarts quickly never counts as down; a change that came before the wait
/// began).
pub const PRIMARY_RECHECK: std::time::Duration = std::time::Duration::from_millis(50);

pub struct Nodes {
    list: SharedSwap<Vec<Arc<NodeState>>>,
    /// Every node name seen since startup; a node's [`NodeId`] is its index here.
    names: Mutex<Vec<String>>,
    /// The cluster view. Read by sessions with a lock-free load; written only by
    /// [`Nodes::change`].
    view: SharedSwap<ClusterState>,
    /// Whether the view pauses some database: stored before the view it describes, so that
    /// false answers every session's pause check without loading the view (see
    /// [`Nodes::is_paused`]).
    any_paused: AtomicBool,
    /// Held by [`Nodes::change`]: one writer at a time, so no change is lost between a load
    /// and a store.
    view_writer: Mutex<()>,
    /// Round robin of logins over the replicas, per worker thread as `read_ticket`.
    next_replica: StripedCounter,
    /// One ticket per worker thread: round-robin and weighted shares hold across the sessions
    /// of each worker (so across all of them), and no worker writes a line another reads.
    read_ticket: StripedCounter,
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
    pub(crate) local_zone: arc_swap::ArcSwapOption<String>,
    /// Held by whoever changes this cluster's primary (its failover task's turn, `PROMOTE`,
    /// switchover), so two never act on it at once; each shard's cluster has its own.
    pub role_change: tokio::sync::Mutex<()>,
}

/// Primary positions kept to date replica lag: at a 100 ms check period, about two minutes of
/// a busy primary.
const PRIMARY_HISTORY_SAMPLES: usize = 1_200;

impl Nodes {
    pub fn new(configs: &[NodeConfig], thresholds: CheckThresholds) -> Self {
        let nodes = Nodes {
            list: SharedSwap::from_pointee(Vec::new()),
            names: Mutex::new(Vec::new()),
            view: SharedSwap::from_pointee(ClusterState::default()),
            any_paused: AtomicBool::new(false),
            view_writer: Mutex::new(()),
            next_replica: StripedCounter::default(),
            read_ticket: StripedCounter::default(),
            primary_history: Mutex::new((String::new(), LsnHistory::new(PRIMARY_HISTORY_SAMPLES))),
            clock_origin: Instant::now(),
            rejoin_after_checks: AtomicU32::new(thresholds.rejoin_after_checks),
            failures_before_down: AtomicU32::new(thresholds.failures_before_down),
            standing: tokio::sync::Notify::new(),
            local_zone: arc_swap::ArcSwapOption::empty(),
            role_change: tokio::sync::Mutex::new(()),
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
        Snapshot::new(
            self,
            Held::Loaded(self.list.load()),
            Held::Loaded(self.view.load()),
        )
    }

    /// A session's own copies of the list and the view, for [`Nodes::snapshot_from`].
    pub fn cache(&self) -> NodesCache {
        NodesCache {
            list: self.list.cache(),
            view: self.view.cache(),
        }
    }

    /// As [`Nodes::snapshot`], from the copies `cache` keeps: each is checked against the
    /// shared one (a pointer compared) and loaded again only if that changed. Saves a session
    /// the two loads of [`Nodes::snapshot`] on every plan: each takes and returns a slot of the
    /// thread's debt list, about a hundred instructions.
    pub fn snapshot_from<'a>(&'a self, cache: &'a mut NodesCache) -> Snapshot<'a> {
        debug_assert!(self.list.is_cached_by(&cache.list) && self.view.is_cached_by(&cache.view));
        Snapshot::new(
            self,
            Held::Cached(cache.list.load()),
            Held::Cached(cache.view.load()),
        )
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
        let next = Arc::new(next);
        self.any_paused.store(next.any_paused(), Ordering::SeqCst);
        self.view.store(next.clone());
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
        // From what changed, not from how: a view adopted from the leader fences, detaches
        // and attaches too.
        let leaving = next
            .fenced
            .difference(&current.fenced)
            .map(|id| (id, "fenced"))
            .chain(
                next.detached
                    .difference(&current.detached)
                    .map(|id| (id, "detached")),
            )
            .chain(
                current
                    .detached
                    .difference(&next.detached)
                    .map(|id| (id, "attached: reads after healthy checks")),
            );
        for (id, why) in leaving {
            if let Some(node) = self.by_id(*id) {
                node.leave_read_set(why);
            }
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
            Change::AwaitView(true) => "waiting for the leader's view from etcd".to_owned(),
            Change::AwaitView(false) => "this instance leads: its view is the cluster's".to_owned(),
            Change::LeaseLapsed(true) => {
                "etcd out of reach beyond the lease: writes are refused".to_owned()
            }
            Change::LeaseLapsed(false) => "the lease is valid again".to_owned(),
            Change::Adopt(view) => format!(
                "the previous leader's view taken over (epoch {}, version {})",
                view.epoch, view.version
            ),
            Change::Follow(view) => format!(
                "the leader's view adopted (epoch {}, version {})",
                view.epoch, view.version
            ),
        }
    }

    /// A reason of the write gate as a sentence with node names.
    pub fn gate_sentence(&self, reason: &GateReason) -> String {
        reason.sentence(|id| self.name_of(id))
    }

    pub fn by_id(&self, id: NodeId) -> Option<Arc<NodeState>> {
        self.list.load().iter().find(|n| n.id == id).cloned()
    }

    /// Up, in `role`, and neither fenced nor detached (for the operator's commands; a plan
    /// asks its [`Snapshot`]).
    pub fn usable_as(&self, node: &NodeState, role: Role) -> bool {
        self.snapshot().usable_as(node, role)
    }

    pub fn is_fenced(&self, node: &NodeState) -> bool {
        self.view.load().is_fenced(node.id)
    }

    /// pgherd stopped `node` on purpose: it is down, in no role, until its monitor sees it
    /// answer again (a switchover's old primary comes back as a standby, and no session may
    /// take it for the primary in between).
    pub fn mark_stopped(&self, node: &NodeState, why: &str) {
        node.mark_stopped(why);
        self.standing.notify_waiters();
    }

    /// Whether new transactions of `database` wait for `RESUME`: one load when nothing is
    /// paused.
    pub fn is_paused(&self, database: &str) -> bool {
        // False here comes before PAUSE's store in every order (PAUSE stores it before the
        // view, then fences, then counts connections in use), so PAUSE counts what the
        // caller took before its own fence: `crate::control::paused_since_acquired` holds.
        self.any_paused.load(Ordering::SeqCst) && self.view.load().is_paused(database)
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

    /// The primary, waiting up to `limit` for one (writes held through a failover or while
    /// synchronous standbys are being set); `None` if none came.
    pub async fn primary_within(&self, limit: std::time::Duration) -> Option<Arc<NodeState>> {
        self.node_within(limit, Self::primary).await
    }

    /// The node `pick` chooses, waiting up to `limit` for it to choose one; `None` if it did
    /// not.
    pub async fn node_within(
        &self,
        limit: std::time::Duration,
        pick: impl Fn(&Self) -> Option<Arc<NodeState>>,
    ) -> Option<Arc<NodeState>> {
        let started = tokio::time::Instant::now();
        loop {
            if let Some(node) = pick(self) {
                return Some(node);
            }
            let left = limit.saturating_sub(started.elapsed());
            if left.is_zero() {
                return None;
            }
            // A change wakes the wait; the recheck covers one that came before it began.
            let _ = tokio::time::timeout(left.min(PRIMARY_RECHECK), self.standing_changed()).await;
        }
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
                    node.set_lag(0, 0);
                }
                Role::Replica => {
                    let replay = seen.lsn.max(node.lsn());
                    node.set_lag(
                        history.1.lag_bytes(replay),
                        history.1.lag_ms(replay, now_ms),
                    );
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
        self.read_ticket.next_on_this_thread()
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

    /// The next healthy replica, round robin; `None` if there is none.
    pub fn pick_replica(&self) -> Option<Arc<NodeState>> {
        let snapshot = self.snapshot();
        let replicas: Vec<&Arc<NodeState>> = snapshot
            .nodes()
            .iter()
            .filter(|n| snapshot.usable_as(n, Role::Replica))
            .collect();
        if replicas.is_empty() {
            return None;
        }
        let i = (self.next_replica.next_on_this_thread() % replicas.len() as u64) as usize;
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
                node.retire();
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

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_route::plan::ReadNeeds;

    fn config(name: &str, port: u16) -> NodeConfig {
        NodeConfig {
            name: name.into(),
            host: "127.0.0.1".into(),
            port,
            socket_dir: None,
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

    /// pg1 seen as a primary, pg2 as its replica.
    fn primary_and_replica() -> (Nodes, Arc<NodeState>, Arc<NodeState>) {
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
        (nodes, pg1, pg2)
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
            upstream_address: None,
        })
    }

    #[test]
    fn a_view_adopted_from_the_leader_takes_fenced_and_detached_nodes_out_of_reads() {
        let (nodes, node) = one_node(3);
        nodes.record(&node, seen(Role::Replica));
        assert!(node.in_read_set());
        let leaders = ClusterState::default()
            .apply(&Change::Detach(node.id))
            .unwrap();
        assert!(nodes.change(Change::Follow(Box::new(leaders.clone()))));
        assert!(!node.in_read_set(), "detached by the leader");
        nodes.record(&node, seen(Role::Replica));
        nodes.record(&node, seen(Role::Replica));
        let attached = leaders.apply(&Change::Attach(node.id)).unwrap();
        assert!(nodes.change(Change::Follow(Box::new(attached))));
        assert!(
            !node.in_read_set(),
            "attached: back only after healthy checks"
        );
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
        assert_eq!(node.health().track.failed_streak(), 3);
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

    fn names<N: AsRef<NodeState>>(nodes: &[N]) -> Vec<&str> {
        nodes.iter().map(|n| n.as_ref().name()).collect()
    }

    /// A read under eventual consistency, round robin.
    fn any_read(primary_reads: bool) -> ReadNeeds {
        ReadNeeds {
            balance: pgherd_route::balance::Balance::RoundRobin,
            primary_reads,
            max_lag_bytes: u64::MAX,
            max_lag_ms: u64::MAX,
            min_lsn: None,
            write_unconfirmed: false,
            may_wait: false,
        }
    }

    #[test]
    fn the_view_decides_where_writes_and_reads_go() {
        let (nodes, pg1, pg2) = primary_and_replica();
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
        let (readers, candidates) = snapshot.read_candidates(&any_read(true));
        assert_eq!(
            names(&readers),
            ["pg2"],
            "the primary reads only while writes flow"
        );
        assert!(candidates[0].healthy);
        drop(readers);
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
    fn pause_checks_follow_every_change_of_the_view() {
        let (nodes, _) = one_node(1);
        assert!(!nodes.is_paused("app"));
        nodes.change(Change::Pause(Some("app".into())));
        assert!(nodes.is_paused("app") && !nodes.is_paused("other"));
        nodes.change(Change::Pause(None));
        assert!(nodes.is_paused("other"));
        nodes.change(Change::Resume(None));
        assert!(!nodes.is_paused("app") && !nodes.is_paused("other"));
        // A change that is not about pauses keeps what the view says.
        nodes.change(Change::Pause(Some("app".into())));
        let pg1 = nodes.get("pg1").unwrap().id;
        nodes.change(Change::Detach(pg1));
        assert!(nodes.is_paused("app"));
        nodes.change(Change::Resume(Some("app".into())));
        assert!(!nodes.is_paused("app"));
    }

    #[test]
    fn a_sessions_cached_snapshot_sees_every_change_of_the_view_and_the_list() {
        let (nodes, pg1, _) = primary_and_replica();
        let mut cache = nodes.cache();
        let writes_go_to = |cache: &mut NodesCache| {
            nodes
                .snapshot_from(cache)
                .primary()
                .map(|n| n.name().to_owned())
        };
        assert_eq!(
            writes_go_to(&mut cache),
            None,
            "held until the synchronous set is known"
        );
        nodes.change(Change::SyncInForce(None));
        assert_eq!(writes_go_to(&mut cache).as_deref(), Some("pg1"));
        nodes.change(Change::Fence(pg1.id));
        assert_eq!(writes_go_to(&mut cache), None);
        // A reload that takes pg1 out and adds pg3 reaches the cached list too.
        let started = nodes.reconcile(&[config("pg2", 5433), config("pg3", 5434)]);
        assert_eq!(names(&started), ["pg3"]);
        let snapshot = nodes.snapshot_from(&mut cache);
        assert_eq!(names(snapshot.nodes()), ["pg2", "pg3"]);
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
            let (readers, candidates) = snapshot.read_candidates(&any_read(false));
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
