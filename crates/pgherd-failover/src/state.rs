//! The cluster view: everything pgherd has decided about the cluster, as one value with a
//! version. Where writes go (the elected primary), which nodes get no traffic (fenced by
//! failover, detached by the operator), the synchronous standby set in force, and the one gate
//! that holds or refuses writes, with its reason.
//!
//! The value changes only through [`ClusterState::apply`], which takes one [`Change`] and
//! returns the next value (or nothing when the change changes nothing); the proxy keeps the
//! current value where sessions read it without a lock and funnels every change through one
//! writer. What the health checks *observe* (up, role, positions) is not part of it: those are
//! measurements, and the view is what was decided from them.
//!
//! Architecture invariant: pure, like the rest of the crate. No clock, no IO; versions count
//! changes, not time.

use std::collections::BTreeSet;
use std::fmt;

use crate::sync::SyncSet;
use crate::Lsn;

/// A node's identity for as long as pgherd runs: given when its name first appears in the
/// config and kept across reloads (a node removed and added again gets its old id back), so a
/// view never confuses two nodes that happen to sit at the same index or behind a new pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

/// Why new writes do not go to the primary now. Some reasons hold writes (they wait for the
/// gate to open, up to the pool's wait limit), others refuse them at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateReason {
    /// `durability = "strict"` and no synchronous standby streams from the primary.
    StrictWithoutStandby { primary: NodeId },
    /// Failover is promoting `candidate`; the old primary is fenced.
    Promoting { candidate: NodeId },
    /// A switchover is moving the primary.
    Switching,
    /// The operator paused every database (`PAUSE` without a name).
    Paused,
    /// The elected primary's synchronous standbys are not in force yet (startup, or a new
    /// primary): a commit acknowledged now could exist on the primary alone.
    SyncPending,
    /// One of several instances (`[dcs]`) that has neither read the leader's view from etcd
    /// nor leads: it does not know where the others send writes.
    NoView,
    /// One of several instances that lost etcd for longer than its lease: another instance
    /// may lead and be replacing the primary this instance knows (see `agreement`).
    NoLease,
}

/// The write gate: open, or closed for one reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gate {
    Open,
    /// Writes wait.
    Hold(GateReason),
    /// Writes fail at once.
    Refuse(GateReason),
}

impl Gate {
    /// `open`, `held` or `refused`: the word `SHOW CLUSTER`, `SHOW NODES` and metrics use.
    pub fn state(&self) -> &'static str {
        match self {
            Gate::Open => "open",
            Gate::Hold(_) => "held",
            Gate::Refuse(_) => "refused",
        }
    }

    /// Why it is closed; `None` when open.
    pub fn reason(&self) -> Option<&GateReason> {
        match self {
            Gate::Open => None,
            Gate::Hold(why) | Gate::Refuse(why) => Some(why),
        }
    }
}

impl GateReason {
    /// Whether writes fail rather than wait: waiting for a standby that may never come would
    /// only turn a clear error into a timeout.
    pub fn refuses(&self) -> bool {
        matches!(
            self,
            GateReason::StrictWithoutStandby { .. } | GateReason::NoLease
        )
    }

    /// When writes refused for this reason resume, for the client's hint.
    pub fn resumes_when(&self) -> &'static str {
        match self {
            GateReason::NoLease => {
                "writes resume when this pgherd instance reaches etcd again; another instance may take them now"
            }
            GateReason::StrictWithoutStandby { .. } => {
                "writes resume when a synchronous standby streams again"
            }
            _ => "writes resume when the reason is gone",
        }
    }

    /// One word for the reason (`SHOW NODES`, `/ready`, metrics labels).
    pub fn kind(&self) -> &'static str {
        match self {
            GateReason::StrictWithoutStandby { .. } => "strict_without_standby",
            GateReason::Promoting { .. } => "promoting",
            GateReason::Switching => "switching",
            GateReason::Paused => "paused",
            GateReason::SyncPending => "sync_pending",
            GateReason::NoView => "no_view",
            GateReason::NoLease => "no_lease",
        }
    }

    /// The reason as a sentence, with node names from `name`.
    pub fn sentence(&self, name: impl Fn(NodeId) -> String) -> String {
        match self {
            GateReason::StrictWithoutStandby { primary } => format!(
                "no synchronous standby streams from primary {} and durability is strict",
                name(*primary)
            ),
            GateReason::Promoting { candidate } => {
                format!("failover is promoting {}", name(*candidate))
            }
            GateReason::Switching => "a switchover is moving the primary".to_owned(),
            GateReason::Paused => "the operator paused all databases".to_owned(),
            GateReason::SyncPending => {
                "the primary's synchronous standbys are being set".to_owned()
            }
            GateReason::NoView => {
                "this instance has not read the cluster view from etcd yet".to_owned()
            }
            GateReason::NoLease => {
                "this instance lost etcd for longer than its lease: another instance may lead"
                    .to_owned()
            }
        }
    }
}

/// The cluster view. Build the first one with [`ClusterState::default`]; every later one comes
/// from [`ClusterState::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterState {
    /// Counts the changes applied: two views with the same version are the same view.
    pub version: u64,
    /// Counts the primaries elected: a view from an older epoch never routes writes anywhere
    /// a newer one does not.
    pub epoch: u64,
    /// The node writes go to, once elected; `None` while nothing was elected (failover off,
    /// or not run yet), when the one node that reports being primary takes them.
    pub elected: Option<NodeId>,
    /// The elected primary's WAL position when it was elected: commits acknowledged before
    /// (under an earlier primary, or before pgherd watched) may exist on it alone, so in
    /// `sync`/`strict` durability a standby that has not received this far may not replace it.
    pub elected_at_lsn: Option<Lsn>,
    /// A promotion under way: no node takes writes until it is elected or given up.
    pub promoting: Option<NodeId>,
    /// Replaced primaries and diverged or rejoining nodes: no traffic through pgherd.
    pub fenced: BTreeSet<NodeId>,
    /// Taken out of traffic by the operator; never promoted while detached.
    pub detached: BTreeSet<NodeId>,
    /// The synchronous standbys pgherd put in force on `primary` (while they change, the
    /// union of the old and the new set).
    pub sync: Option<SyncInForce>,
    /// The elected primary's synchronous standbys still have to be set (see
    /// [`GateReason::SyncPending`]); true in the first view.
    pub sync_pending: bool,
    /// `strict` durability found no streaming synchronous standby on this primary.
    pub strict_without_standby: Option<NodeId>,
    pub switching: bool,
    /// `PAUSE` of every database.
    pub paused_all: bool,
    /// One of several instances that has no view from the leader yet (see
    /// [`GateReason::NoView`]).
    pub awaiting_view: bool,
    /// One of several instances whose lease may have run out (see [`GateReason::NoLease`]).
    pub lease_lapsed: bool,
    /// Databases paused by name (their new transactions wait, reads too).
    pub paused: BTreeSet<String>,
}

/// The synchronous standby set in force on a primary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncInForce {
    pub primary: NodeId,
    pub set: SyncSet,
    /// The primary's WAL position when this set took effect (or when the primary was
    /// elected, for the set it got then). Commits acknowledged earlier were confirmed by other
    /// standbys, or by an earlier primary's: all of them lie below this position, so a
    /// standby of this set holds them only once it has received this far.
    pub since_lsn: Lsn,
}

impl SyncInForce {
    /// `set` in force on `primary`, replacing `current`. Where it takes effect stays where the
    /// current one did when the change only adds standbys without asking more of each commit
    /// (every commit acknowledged so far is still on `k` standbys of the set); otherwise it is
    /// `primary_lsn`: a standby left (its share may be the only copy), `k` grew, or commits
    /// were acknowledged by the primary alone (no set, or an empty one). The same set again
    /// changes nothing: an empty set's position is never read (no standby holds commits under
    /// it), and the set that replaces it starts at the primary's position then.
    pub fn from(
        primary: NodeId,
        set: SyncSet,
        current: Option<&SyncInForce>,
        primary_lsn: Lsn,
    ) -> SyncInForce {
        let covered = |c: &&SyncInForce| {
            c.primary == primary
                && (c.set == set
                    || (!c.set.standbys.is_empty()
                        && c.set.standbys.iter().all(|s| set.standbys.contains(s))
                        && set.quorum <= c.set.quorum))
        };
        let since_lsn = current.filter(covered).map_or(primary_lsn, |c| c.since_lsn);
        SyncInForce {
            primary,
            set,
            since_lsn,
        }
    }
}

impl Default for ClusterState {
    fn default() -> Self {
        ClusterState {
            version: 0,
            epoch: 0,
            elected: None,
            elected_at_lsn: None,
            promoting: None,
            fenced: BTreeSet::new(),
            detached: BTreeSet::new(),
            sync: None,
            sync_pending: true,
            strict_without_standby: None,
            switching: false,
            paused_all: false,
            awaiting_view: false,
            lease_lapsed: false,
            paused: BTreeSet::new(),
        }
    }
}

/// One decision about the cluster: the only way a view changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `node` takes the writes; `at_lsn` is its WAL position now (see
    /// [`ClusterState::elected_at_lsn`]). A different node than before starts a new epoch and
    /// waits for its synchronous standbys; a promotion under way ends.
    Elect {
        node: NodeId,
        at_lsn: Lsn,
    },
    /// Failover starts promoting `candidate` in place of the elected primary.
    BeginPromotion {
        candidate: NodeId,
    },
    /// The promotion failed: the elected (fenced) primary stays, and failover decides again.
    AbandonPromotion,
    Fence(NodeId),
    Unfence(NodeId),
    Detach(NodeId),
    Attach(NodeId),
    BeginSwitchover,
    EndSwitchover,
    /// The elected primary's synchronous standbys must be set (again) before it takes writes.
    SyncPending,
    /// `set` is in force on `primary` (`None`: pgherd manages no set, `async` durability);
    /// writes stop waiting for it.
    SyncInForce(Option<SyncInForce>),
    /// The primary is being given a new set: until it has reloaded, either may be in force,
    /// so the view holds their union. Writes that waited for a set still wait.
    SyncChanging(Option<SyncInForce>),
    /// In `strict` durability, whether `primary` has no streaming synchronous standby.
    StrictWithoutStandby(Option<NodeId>),
    Pause(Option<String>),
    /// Resumes one database, or with `None` everything paused.
    Resume(Option<String>),
    /// Whether this instance still waits for a view from the leader: set when it starts as one
    /// of several, cleared when it leads (a leader's own view is the view).
    AwaitView(bool),
    /// Whether this instance's lease may have run out.
    LeaseLapsed(bool),
    /// A predecessor's view, read by an instance that has just taken the lead: replaces this
    /// one whole, version included, unless it is from an older epoch (never acted on).
    Adopt(Box<ClusterState>),
    /// The leader's view, read by a follower: replaces this one whole, whatever its epoch.
    Follow(Box<ClusterState>),
    /// The node left the config: it keeps no place in the view.
    Forget(NodeId),
}

impl ClusterState {
    /// The write gate and its one reason. Refusals come first (they answer at once), then the
    /// holds in the order an operator most needs to know them.
    pub fn gate(&self) -> Gate {
        let reason = if self.awaiting_view {
            GateReason::NoView
        } else if self.lease_lapsed {
            GateReason::NoLease
        } else if let Some(primary) = self.strict_without_standby {
            GateReason::StrictWithoutStandby { primary }
        } else if let Some(candidate) = self.promoting {
            GateReason::Promoting { candidate }
        } else if self.switching {
            GateReason::Switching
        } else if self.paused_all {
            GateReason::Paused
        } else if self.sync_pending {
            GateReason::SyncPending
        } else {
            return Gate::Open;
        };
        if reason.refuses() {
            Gate::Refuse(reason)
        } else {
            Gate::Hold(reason)
        }
    }

    pub fn is_fenced(&self, node: NodeId) -> bool {
        self.fenced.contains(&node)
    }

    pub fn is_detached(&self, node: NodeId) -> bool {
        self.detached.contains(&node)
    }

    /// Fenced or detached: no traffic either way.
    pub fn is_excluded(&self, node: NodeId) -> bool {
        self.is_fenced(node) || self.is_detached(node)
    }

    /// Whether new transactions of some database wait for `RESUME`.
    pub fn any_paused(&self) -> bool {
        self.paused_all || !self.paused.is_empty()
    }

    /// Whether new transactions of `database` wait for `RESUME`.
    pub fn is_paused(&self, database: &str) -> bool {
        self.paused_all || self.paused.contains(database)
    }

    /// The node writes go to, given the nodes that answer as a primary now (up, not in
    /// recovery): the elected primary while it is among them and neither fenced nor detached;
    /// none while a promotion is under way. With nothing elected (failover off, or before its
    /// first turn) the one unexcluded node among them; none if there are several, since which
    /// one is right is for failover or the operator to say. At most one node, always.
    pub fn writer(&self, primaries: impl IntoIterator<Item = NodeId>) -> Option<NodeId> {
        if self.promoting.is_some() {
            return None;
        }
        let mut usable = primaries.into_iter().filter(|&n| !self.is_excluded(n));
        match self.elected {
            Some(elected) => usable.find(|&n| n == elected),
            None => {
                let first = usable.next()?;
                usable.next().is_none().then_some(first)
            }
        }
    }

    /// Where new writes go now: [`Self::writer`], unless the write gate is closed.
    pub fn write_target(&self, primaries: impl IntoIterator<Item = NodeId>) -> Option<NodeId> {
        match self.gate() {
            Gate::Open => self.writer(primaries),
            _ => None,
        }
    }

    /// The view after every one of `changes`, in order.
    pub fn after_all(&self, changes: &[Change]) -> ClusterState {
        changes.iter().fold(self.clone(), |state, change| {
            state.apply(change).unwrap_or(state)
        })
    }

    /// Whether `changes` elect a primary: writes would go to it.
    pub fn elects(changes: &[Change]) -> bool {
        changes.iter().any(|c| matches!(c, Change::Elect { .. }))
    }

    /// The view after `change`, with the next version; `None` if it changes nothing.
    pub fn apply(&self, change: &Change) -> Option<ClusterState> {
        match change {
            // The leader's view, with this instance's own gates: its lease, not the leader's,
            // says whether it may route writes, and it waits for a view until its record in
            // etcd says which one it routes by (`AwaitView(false)` then).
            Change::Adopt(leader) | Change::Follow(leader) => {
                let newer = matches!(change, Change::Follow(_)) || leader.epoch >= self.epoch;
                let next = ClusterState {
                    lease_lapsed: self.lease_lapsed,
                    awaiting_view: self.awaiting_view,
                    ..(**leader).clone()
                };
                return (newer && next != *self).then_some(next);
            }
            _ => {}
        }
        let mut next = self.clone();
        match change {
            Change::Elect { node, at_lsn } => {
                if next.elected != Some(*node) {
                    next.epoch += 1;
                    next.sync_pending = true;
                    next.strict_without_standby = None;
                    next.elected_at_lsn = Some(*at_lsn);
                }
                next.elected = Some(*node);
                next.promoting = None;
            }
            Change::BeginPromotion { candidate } => next.promoting = Some(*candidate),
            Change::AbandonPromotion => next.promoting = None,
            Change::Fence(node) => {
                next.fenced.insert(*node);
            }
            Change::Unfence(node) => {
                next.fenced.remove(node);
            }
            Change::Detach(node) => {
                next.detached.insert(*node);
            }
            Change::Attach(node) => {
                next.detached.remove(node);
            }
            Change::BeginSwitchover => next.switching = true,
            Change::EndSwitchover => next.switching = false,
            Change::SyncPending => next.sync_pending = true,
            Change::SyncInForce(set) => {
                next.sync = set.clone();
                next.sync_pending = false;
            }
            Change::SyncChanging(set) => next.sync = set.clone(),
            Change::StrictWithoutStandby(primary) => next.strict_without_standby = *primary,
            Change::Pause(None) => next.paused_all = true,
            Change::Pause(Some(database)) => {
                next.paused.insert(database.clone());
            }
            Change::Resume(None) => {
                next.paused_all = false;
                next.paused.clear();
            }
            Change::Resume(Some(database)) => {
                next.paused.remove(database);
            }
            Change::Adopt(_) | Change::Follow(_) => {}
            Change::AwaitView(awaiting) => next.awaiting_view = *awaiting,
            Change::LeaseLapsed(lapsed) => next.lease_lapsed = *lapsed,
            Change::Forget(node) => {
                next.fenced.remove(node);
                next.detached.remove(node);
                if next.elected == Some(*node) {
                    next.elected = None;
                    next.elected_at_lsn = None;
                }
                if next.promoting == Some(*node) {
                    next.promoting = None;
                }
            }
        }
        if next == *self {
            return None;
        }
        next.version = self.version + 1;
        Some(next)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: NodeId = NodeId(0);
    const B: NodeId = NodeId(1);

    fn after(changes: &[Change]) -> ClusterState {
        changes
            .iter()
            .fold(ClusterState::default(), |state, change| {
                state.apply(change).unwrap_or(state)
            })
    }

    #[test]
    fn the_first_view_holds_writes_until_the_sync_set_is_known() {
        let state = ClusterState::default();
        assert_eq!(state.gate(), Gate::Hold(GateReason::SyncPending));
        let state = after(&[Change::SyncInForce(None)]);
        assert_eq!(state.gate(), Gate::Open);
        assert_eq!(state.version, 1);
    }

    #[test]
    fn a_new_primary_is_a_new_epoch_and_waits_for_its_standbys() {
        let state = after(&[
            Change::Elect { node: A, at_lsn: 0 },
            Change::SyncInForce(None),
        ]);
        assert_eq!((state.epoch, state.gate()), (1, Gate::Open));
        // The same node again changes nothing, not even the version.
        assert_eq!(state.apply(&Change::Elect { node: A, at_lsn: 0 }), None);
        let next = state.apply(&Change::Elect { node: B, at_lsn: 0 }).unwrap();
        assert_eq!(next.epoch, 2);
        assert_eq!(next.gate(), Gate::Hold(GateReason::SyncPending));
        assert_eq!(next.version, state.version + 1);
    }

    #[test]
    fn a_promotion_holds_writes_until_the_candidate_is_elected() {
        let state = after(&[
            Change::Elect { node: A, at_lsn: 0 },
            Change::SyncInForce(None),
            Change::Fence(A),
            Change::BeginPromotion { candidate: B },
        ]);
        assert_eq!(
            state.gate(),
            Gate::Hold(GateReason::Promoting { candidate: B })
        );
        assert!(state.is_excluded(A));
        let given_up = state.apply(&Change::AbandonPromotion).unwrap();
        assert_eq!(
            given_up.elected,
            Some(A),
            "the fenced primary stays elected"
        );
        let elected = state.apply(&Change::Elect { node: B, at_lsn: 0 }).unwrap();
        assert_eq!(elected.promoting, None);
        assert_eq!(elected.gate(), Gate::Hold(GateReason::SyncPending));
    }

    #[test]
    fn refusal_outranks_every_hold() {
        let state = after(&[
            Change::Elect { node: A, at_lsn: 0 },
            Change::BeginSwitchover,
            Change::StrictWithoutStandby(Some(A)),
        ]);
        assert_eq!(
            state.gate(),
            Gate::Refuse(GateReason::StrictWithoutStandby { primary: A })
        );
        assert!(!matches!(state.gate(), Gate::Hold(_)));
        // Electing another primary clears a refusal that was about the old one.
        let next = state.apply(&Change::Elect { node: B, at_lsn: 0 }).unwrap();
        assert_eq!(next.gate(), Gate::Hold(GateReason::Switching));
    }

    #[test]
    fn pauses_are_per_database_or_all() {
        assert!(!after(&[Change::SyncInForce(None)]).any_paused());
        let state = after(&[Change::SyncInForce(None), Change::Pause(Some("app".into()))]);
        assert!(state.is_paused("app") && !state.is_paused("other") && state.any_paused());
        assert_eq!(
            state.gate(),
            Gate::Open,
            "one database's pause is not a write gate"
        );
        let all = state.apply(&Change::Pause(None)).unwrap();
        assert!(all.is_paused("other"));
        assert_eq!(all.gate(), Gate::Hold(GateReason::Paused));
        let resumed = all.apply(&Change::Resume(None)).unwrap();
        assert!(!resumed.is_paused("app") && resumed.gate() == Gate::Open);
        assert!(!resumed.any_paused());
    }

    #[test]
    fn writes_go_to_one_node_at_most() {
        const C: NodeId = NodeId(2);
        let state = after(&[Change::SyncInForce(None)]);
        // Nothing elected: the one node that says it is primary, none of two.
        assert_eq!(state.writer([A]), Some(A));
        assert_eq!(state.writer([A, B]), None);
        assert_eq!(state.writer([]), None);
        let fenced = state.apply(&Change::Fence(B)).unwrap();
        assert_eq!(
            fenced.writer([A, B]),
            Some(A),
            "a fenced one does not count"
        );
        // Elected: only that one, whoever else says they are primary.
        let elected = after(&[
            Change::Elect { node: A, at_lsn: 0 },
            Change::SyncInForce(None),
        ]);
        assert_eq!(elected.writer([B, C]), None);
        assert_eq!(elected.writer([B, A]), Some(A));
        assert_eq!(elected.write_target([A]), Some(A));
        let detached = elected.apply(&Change::Detach(A)).unwrap();
        assert_eq!(detached.writer([A]), None);
        let promoting = elected
            .apply(&Change::BeginPromotion { candidate: B })
            .unwrap();
        assert_eq!(promoting.writer([A, B]), None);
        // The gate holds writes, not the writer.
        let switching = elected.apply(&Change::BeginSwitchover).unwrap();
        assert_eq!(switching.writer([A]), Some(A));
        assert_eq!(switching.write_target([A]), None);
    }

    #[test]
    fn a_forgotten_node_leaves_no_trace() {
        let state = after(&[
            Change::Elect { node: A, at_lsn: 0 },
            Change::Fence(B),
            Change::Detach(B),
        ]);
        let forgotten = state.apply(&Change::Forget(B)).unwrap();
        assert!(!forgotten.is_excluded(B));
        assert_eq!(forgotten.elected, Some(A));
        assert_eq!(forgotten.apply(&Change::Forget(B)), None);
    }

    #[test]
    fn a_leaders_view_is_adopted_whole_unless_its_epoch_is_older() {
        let local = after(&[Change::Elect { node: A, at_lsn: 1 }, Change::Fence(B)]);
        let leader = after(&[
            Change::Elect { node: A, at_lsn: 1 },
            Change::Elect { node: B, at_lsn: 9 },
            Change::Fence(A),
            Change::Pause(None),
        ]);
        let adopted = local
            .apply(&Change::Adopt(Box::new(leader.clone())))
            .unwrap();
        assert_eq!(adopted, leader, "version and all");
        assert_eq!(
            adopted.apply(&Change::Adopt(Box::new(leader.clone()))),
            None
        );
        assert_eq!(
            leader.apply(&Change::Adopt(Box::new(local.clone()))),
            None,
            "older epoch"
        );
        assert_eq!(
            leader.apply(&Change::Follow(Box::new(local.clone()))),
            Some(local),
            "a follower takes the leader's view whatever its epoch"
        );
    }

    #[test]
    fn an_empty_set_kept_in_force_does_not_change_the_view() {
        let empty = |since_lsn| {
            Change::SyncInForce(Some(SyncInForce::from(
                A,
                SyncSet::default(),
                None,
                since_lsn,
            )))
        };
        let state = after(&[Change::Elect { node: A, at_lsn: 1 }, empty(10)]);
        let again = SyncInForce::from(A, SyncSet::default(), state.sync.as_ref(), 20);
        assert_eq!(again.since_lsn, 10);
        assert_eq!(state.apply(&Change::SyncInForce(Some(again))), None);
        // The set that replaces it starts where the primary is then.
        let one = SyncSet {
            quorum: 1,
            standbys: vec!["pg2".to_owned()],
        };
        assert_eq!(
            SyncInForce::from(A, one, state.sync.as_ref(), 30).since_lsn,
            30
        );
    }

    #[test]
    fn an_instance_without_a_view_holds_writes_before_anything_else() {
        let state = after(&[
            Change::AwaitView(true),
            Change::Elect { node: A, at_lsn: 1 },
            Change::SyncInForce(None),
            Change::Pause(None),
        ]);
        assert_eq!(state.gate(), Gate::Hold(GateReason::NoView));
        assert_eq!(state.write_target([A]), None);
        // Taking the leader's view keeps it waiting until its record says it routes by it.
        let leader = after(&[Change::Elect { node: A, at_lsn: 1 }]);
        let followed = state.apply(&Change::Follow(Box::new(leader))).unwrap();
        assert_eq!(followed.gate(), Gate::Hold(GateReason::NoView));
        let leading = state.apply(&Change::AwaitView(false)).unwrap();
        assert_eq!(leading.gate(), Gate::Hold(GateReason::Paused));
        // Refused at once: a client with several pgherd instances moves on to one that has a
        // lease.
        let lapsed = leading.apply(&Change::LeaseLapsed(true)).unwrap();
        assert_eq!(lapsed.gate(), Gate::Refuse(GateReason::NoLease));
        assert_eq!(lapsed.write_target([A]), None);
    }

    #[test]
    fn every_reason_has_a_word_and_a_sentence() {
        let name = |id: NodeId| format!("pg{}", id.0 + 1);
        for reason in [
            GateReason::StrictWithoutStandby { primary: A },
            GateReason::Promoting { candidate: B },
            GateReason::Switching,
            GateReason::Paused,
            GateReason::SyncPending,
            GateReason::NoView,
            GateReason::NoLease,
        ] {
            assert!(!reason.kind().is_empty());
            assert!(!reason.sentence(name).is_empty());
        }
        assert_eq!(
            GateReason::Promoting { candidate: B }.sentence(name),
            "failover is promoting pg2"
        );
    }
}
