//! The synchronous standby keeper's decisions: each turn, from the durability mode, the
//! standbys streaming from the primary, the replicas eligible and the time, what the primary's
//! `synchronous_standby_names` must be and what the cluster view must say about it. The proxy
//! applies the set with SQL and the changes through its one view writer; the seeded simulation
//! runs the same turns.

use crate::state::{Change, ClusterState, NodeId, SyncInForce};
use crate::sync::{desired_sync_set, SyncSet};
use crate::{Durability, Lsn};

/// How long `sync` durability waits for a standby of a new primary (after startup, a failover
/// or a switchover) to stream before letting the primary acknowledge commits alone. Standbys
/// re-pointed or restarted need a few seconds to connect (PostgreSQL retries every
/// `wal_retrieve_retry_interval`, 5 s); degrading at once would acknowledge commits on one
/// node exactly when the cluster has just lost one.
pub const STANDBY_GRACE_MS: u64 = 15_000;

/// What one turn looks at.
#[derive(Debug, Clone)]
pub struct KeeperInput<'a> {
    pub durability: Durability,
    /// `[replication] sync_standbys`: the `k` of `ANY k`.
    pub sync_standbys: usize,
    /// `synchronous_commit` as configured, for the event's words.
    pub synchronous_commit: &'a str,
    /// The elected primary, which answered its last check as a primary.
    pub primary: NodeId,
    /// Its WAL position at that check: where a set put in force now takes effect.
    pub primary_lsn: Lsn,
    /// The standbys streaming from it now (`application_name`s), as its check reported.
    pub streaming: &'a [String],
    /// The replicas pgherd may make synchronous (configured, not fenced), in config order.
    pub eligible: &'a [String],
    /// What a young primary waits for while none of them streams: `eligible` and the fenced
    /// replicas on their way back ([`sync_awaited`]).
    pub awaited: &'a [String],
    /// Milliseconds on a monotonic clock the caller keeps.
    pub now_ms: u64,
}

/// What a turn asks the caller to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeeperStep {
    /// Nothing to set on the primary: apply these changes to the view.
    Settled(Vec<Change>),
    /// Apply `before` to the view, then set `set` on the primary (and reload it); if that
    /// worked, apply `after` and record the event; if not, try again next turn.
    Apply {
        before: Vec<Change>,
        set: SyncSet,
        after: Vec<Change>,
        event: (&'static str, String),
    },
}

/// The keeper's memory between turns: which primary it keeps and since when.
#[derive(Debug, Clone, Default)]
pub struct SyncKeeper {
    primary_since: Option<(NodeId, u64)>,
}

impl SyncKeeper {
    /// One turn against the current view.
    pub fn turn(&mut self, view: &ClusterState, input: &KeeperInput) -> KeeperStep {
        let durability = input.durability;
        if durability == Durability::Async {
            return KeeperStep::Settled(vec![
                Change::StrictWithoutStandby(None),
                Change::SyncInForce(None),
            ]);
        }
        let primary = input.primary;
        let in_force_now = view.sync.as_ref().filter(|sync| sync.primary == primary);
        let current = in_force_now.map(|sync| sync.set.clone());
        if self.primary_since.map(|(p, _)| p) != Some(primary) {
            self.primary_since = Some((primary, input.now_ms));
        }
        let young = self
            .primary_since
            .is_some_and(|(_, since)| input.now_ms.saturating_sub(since) < STANDBY_GRACE_MS);
        let Some(mut desired) = desired_sync_set(
            durability,
            input.sync_standbys,
            input.streaming,
            input.eligible,
            current.as_ref(),
        ) else {
            return KeeperStep::Settled(Vec::new());
        };
        // Every standby the new primary may get counts until one streams: commits wait for it
        // rather than rest on the primary alone. `strict` never lets them.
        let waiting_for_standbys = desired.standbys.is_empty()
            && match durability {
                Durability::Sync => young,
                Durability::Strict => true,
                Durability::Async => false,
            };
        if waiting_for_standbys {
            if let Some(all) = preset_sync_set(durability, input.sync_standbys, input.awaited) {
                desired = all;
            }
        }
        // A cluster without replicas has nothing to wait for, in any durability.
        let none_streams = !desired.standbys.is_empty()
            && !desired.standbys.iter().any(|s| input.streaming.contains(s));
        let strict = Change::StrictWithoutStandby(
            (durability == Durability::Strict && none_streams).then_some(primary),
        );
        let in_force = |set: SyncSet| {
            Some(SyncInForce::from(
                primary,
                set,
                in_force_now,
                input.primary_lsn,
            ))
        };
        if current.as_ref() == Some(&desired) {
            return KeeperStep::Settled(vec![strict, Change::SyncInForce(in_force(desired))]);
        }
        let mut before = vec![strict];
        // Until the primary has reloaded, either set may be in force.
        if let Some(current) = &current {
            before.push(Change::SyncChanging(in_force(current.union(&desired))));
        }
        let event = if input.awaited.is_empty() {
            (
                "sync_standbys",
                "no replica may be synchronous now (none is configured, or every one is fenced and not coming back by itself): commits are acknowledged by the primary alone"
                    .to_owned(),
            )
        } else if desired.standbys.is_empty() {
            (
                "sync_degraded",
                "no standby streams: commits are acknowledged by the primary alone until one does"
                    .to_owned(),
            )
        } else if none_streams && waiting_for_standbys && durability == Durability::Sync {
            (
                "sync_standbys",
                format!(
                    "no standby streams yet: synchronous_standby_names = '{}' while they connect (commits wait; up to {} s, then sync degrades)",
                    desired.setting(),
                    STANDBY_GRACE_MS / 1000
                ),
            )
        } else if none_streams {
            (
                "writes_refused",
                format!(
                    "no standby streams: synchronous_standby_names stays '{}' and writes are refused (durability = strict)",
                    desired.setting()
                ),
            )
        } else {
            (
                "sync_standbys",
                format!(
                    "synchronous_standby_names = '{}', synchronous_commit = {}",
                    desired.setting(),
                    input.synchronous_commit
                ),
            )
        };
        KeeperStep::Apply {
            before,
            after: vec![Change::SyncInForce(in_force(desired.clone()))],
            set: desired,
            event,
        }
    }
}

/// The standbys `primary` may have in its synchronous set: every other node that may be
/// synchronous (node `sync = true`) and is not fenced, by name. The keeper's turns, a new
/// primary's preset set and the simulation all take them from here.
pub fn sync_eligible(
    state: &ClusterState,
    members: &[crate::control::Member],
    primary: NodeId,
) -> Vec<String> {
    sync_awaited(Durability::Sync, state, members, primary, &[])
}

/// The standbys a primary's commits wait for while none streams, in config order. In `sync`
/// (for a young primary, [`STANDBY_GRACE_MS`]): the eligible ones and the fenced ones on their
/// way back as its standbys (`fenced::returning`); after a failover that fenced every other
/// node (the old primary and a replica that must be rewound), these are the only standbys the
/// primary will have, and without them its first commits would rest on it alone. In `strict`:
/// every other node that may be synchronous, fenced or not, coming back or not, because
/// strict never lets a commit rest on the primary alone: with none of them streaming, writes
/// are refused until one is back (an operator's rejoin, if pgherd does not bring it back).
pub fn sync_awaited(
    durability: Durability,
    state: &ClusterState,
    members: &[crate::control::Member],
    primary: NodeId,
    returning: &[NodeId],
) -> Vec<String> {
    members
        .iter()
        .filter(|m| {
            m.id != primary
                && m.may_be_sync
                && (durability == Durability::Strict
                    || !state.is_fenced(m.id)
                    || returning.contains(&m.id))
        })
        .map(|m| m.name.to_owned())
        .collect()
}

/// The set a just-promoted primary gets before it takes writes: every other unfenced node, so
/// its first commits wait for a standby rather than rest on it alone; the keeper narrows it to
/// the standbys that stream. `None` in `async` durability.
pub fn preset_sync_set(
    durability: Durability,
    sync_standbys: usize,
    eligible: &[String],
) -> Option<SyncSet> {
    desired_sync_set(durability, sync_standbys, eligible, eligible, None)
}

/// The synchronous standbys of the elected primary as `decide` needs them: indices into
/// `nodes` (ids and names, in config order), how many confirm each commit, and where the set
/// took effect (see [`SyncInForce::since_lsn`]). The set the view says is in force on that
/// primary; before there is one, every other unfenced node from the primary's election on, one
/// confirming (the most cautious reading).
pub fn sync_holders(
    view: &ClusterState,
    nodes: &[(NodeId, &str)],
    elected: Option<usize>,
) -> SyncHolders {
    let Some(elected) = elected else {
        return SyncHolders::default();
    };
    match &view.sync {
        Some(sync) if nodes[elected].0 == sync.primary => SyncHolders {
            members: sync
                .set
                .standbys
                .iter()
                .filter_map(|name| nodes.iter().position(|(_, n)| n == name))
                .collect(),
            quorum: sync.set.quorum,
            since_lsn: Some(sync.since_lsn),
        },
        _ => SyncHolders {
            members: (0..nodes.len())
                .filter(|&i| i != elected && !view.is_fenced(nodes[i].0))
                .collect(),
            quorum: 1,
            since_lsn: view.elected_at_lsn,
        },
    }
}

/// What [`sync_holders`] returns: `View::synchronous`, `View::sync_quorum`,
/// `View::sync_since_lsn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncHolders {
    pub members: Vec<usize>,
    pub quorum: usize,
    pub since_lsn: Option<Lsn>,
}

impl Default for SyncHolders {
    fn default() -> Self {
        SyncHolders {
            members: Vec::new(),
            quorum: 1,
            since_lsn: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: NodeId = NodeId(0);

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    fn input<'a>(
        durability: Durability,
        streaming: &'a [String],
        eligible: &'a [String],
        now_ms: u64,
    ) -> KeeperInput<'a> {
        KeeperInput {
            durability,
            sync_standbys: 1,
            synchronous_commit: "on",
            primary: P,
            primary_lsn: 0,
            streaming,
            eligible,
            awaited: eligible,
            now_ms,
        }
    }

    /// Applies a step as the proxy does when setting the set works.
    fn carry_out(view: ClusterState, step: &KeeperStep) -> ClusterState {
        let changes: Vec<&Change> = match step {
            KeeperStep::Settled(changes) => changes.iter().collect(),
            KeeperStep::Apply { before, after, .. } => before.iter().chain(after).collect(),
        };
        changes
            .into_iter()
            .fold(view, |view, change| view.apply(change).unwrap_or(view))
    }

    #[test]
    fn a_new_primary_waits_for_its_standbys_for_the_grace_period_then_sync_degrades() {
        let eligible = names(&["pg2", "pg3"]);
        let mut keeper = SyncKeeper::default();
        let view = ClusterState::default()
            .apply(&Change::Elect { node: P, at_lsn: 0 })
            .unwrap();
        let step = keeper.turn(&view, &input(Durability::Sync, &[], &eligible, 1_000));
        let KeeperStep::Apply { set, event, .. } = &step else {
            panic!("{step:?}");
        };
        assert_eq!(set.setting(), "ANY 1 (\"pg2\", \"pg3\")");
        assert!(event.1.contains("while they connect"), "{}", event.1);
        let view = carry_out(view, &step);
        assert!(!view.sync_pending);
        // Still young: nothing to change.
        let step = keeper.turn(&view, &input(Durability::Sync, &[], &eligible, 15_999));
        assert!(matches!(step, KeeperStep::Settled(_)), "{step:?}");
        // Past the grace period: the primary acknowledges alone, and says so.
        let step = keeper.turn(&view, &input(Durability::Sync, &[], &eligible, 16_000));
        let KeeperStep::Apply {
            set, event, before, ..
        } = &step
        else {
            panic!("{step:?}");
        };
        assert_eq!(set.setting(), "");
        assert_eq!(event.0, "sync_degraded");
        // From the moment the primary reloads, it may acknowledge alone: no standby is sure to
        // hold a commit, whichever instance reads the view.
        assert!(before
            .iter()
            .any(|c| matches!(c, Change::SyncChanging(Some(s)) if s.set.standbys.is_empty())));
    }

    #[test]
    fn after_a_failover_that_fenced_every_other_node_commits_wait_for_those_coming_back() {
        let pg2 = NodeId(1);
        let pg3 = NodeId(2);
        let members = [
            crate::control::Member {
                id: P,
                name: "pg1",
                may_be_sync: true,
                received_lsn: 0,
            },
            crate::control::Member {
                id: pg2,
                name: "pg2",
                may_be_sync: true,
                received_lsn: 0,
            },
            crate::control::Member {
                id: pg3,
                name: "pg3",
                may_be_sync: true,
                received_lsn: 0,
            },
        ];
        // pg1 was promoted; pg2 (the old primary) and pg3 (diverged) are fenced. pg3 answers
        // and is being rejoined; pg2 is down.
        let view = [
            Change::Elect { node: P, at_lsn: 0 },
            Change::Fence(pg2),
            Change::Fence(pg3),
        ]
        .iter()
        .fold(ClusterState::default(), |v, c| v.apply(c).unwrap());
        let eligible = sync_eligible(&view, &members, P);
        assert!(eligible.is_empty());
        let awaited = sync_awaited(Durability::Sync, &view, &members, P, &[pg3]);
        assert_eq!(awaited, names(&["pg3"]));
        let turn = |keeper: &mut SyncKeeper, view: &ClusterState, durability, now_ms| {
            keeper.turn(
                view,
                &KeeperInput {
                    awaited: &awaited,
                    ..input(durability, &[], &eligible, now_ms)
                },
            )
        };
        let mut keeper = SyncKeeper::default();
        let step = turn(&mut keeper, &view, Durability::Sync, 0);
        let KeeperStep::Apply { set, event, .. } = &step else {
            panic!("{step:?}");
        };
        assert_eq!(set.setting(), "ANY 1 (\"pg3\")", "not ''");
        assert!(event.1.contains("while they connect"), "{}", event.1);
        let synced = carry_out(view.clone(), &step);
        // Never coming back within the grace: sync degrades, as for any standby.
        let step = turn(&mut keeper, &synced, Durability::Sync, STANDBY_GRACE_MS);
        let KeeperStep::Apply { set, event, .. } = &step else {
            panic!("{step:?}");
        };
        assert_eq!((set.setting().as_str(), event.0), ("", "sync_degraded"));
        // `strict` waits for it with writes refused, however long it takes.
        let mut keeper = SyncKeeper::default();
        let step = turn(&mut keeper, &view, Durability::Strict, 0);
        let strict = carry_out(view.clone(), &step);
        assert_eq!(
            strict.sync.as_ref().map(|s| s.set.setting()),
            Some("ANY 1 (\"pg3\")".to_owned())
        );
        assert_eq!(
            strict.gate(),
            crate::Gate::Refuse(crate::GateReason::StrictWithoutStandby { primary: P })
        );
        // Nothing coming back: the primary acknowledges alone, and says why.
        let mut keeper = SyncKeeper::default();
        let step = keeper.turn(&view, &input(Durability::Sync, &[], &eligible, 0));
        let KeeperStep::Apply { set, event, .. } = &step else {
            panic!("{step:?}");
        };
        assert_eq!(set.setting(), "");
        assert!(event.1.contains("every one is fenced"), "{}", event.1);
        // `strict` waits for the fenced nodes whether or not they are coming back: writes
        // are refused until an operator brings one back, never acknowledged alone.
        let all = sync_awaited(Durability::Strict, &view, &members, P, &[]);
        assert_eq!(all, names(&["pg2", "pg3"]));
        let mut keeper = SyncKeeper::default();
        let step = keeper.turn(
            &view,
            &KeeperInput {
                awaited: &all,
                ..input(Durability::Strict, &[], &eligible, 0)
            },
        );
        let strict = carry_out(view.clone(), &step);
        assert_eq!(
            strict.sync.as_ref().map(|s| s.set.setting()),
            Some("ANY 1 (\"pg2\", \"pg3\")".to_owned())
        );
        assert_eq!(
            strict.gate(),
            crate::Gate::Refuse(crate::GateReason::StrictWithoutStandby { primary: P })
        );
    }

    #[test]
    fn streaming_standbys_become_the_set_and_strict_refuses_without_them() {
        let eligible = names(&["pg2", "pg3"]);
        let streaming = names(&["pg3"]);
        let mut keeper = SyncKeeper::default();
        let view = ClusterState::default()
            .apply(&Change::Elect { node: P, at_lsn: 0 })
            .unwrap();
        let step = keeper.turn(&view, &input(Durability::Strict, &streaming, &eligible, 0));
        let view = carry_out(view, &step);
        assert_eq!(
            view.sync.as_ref().map(|s| s.set.setting()),
            Some("ANY 1 (\"pg3\")".to_owned())
        );
        assert!(!matches!(view.gate(), crate::Gate::Refuse(_)));
        // pg3 stops streaming: strict keeps the set and refuses writes.
        let step = keeper.turn(&view, &input(Durability::Strict, &[], &eligible, 60_000));
        let view = carry_out(view, &step);
        assert_eq!(
            view.gate(),
            crate::Gate::Refuse(crate::GateReason::StrictWithoutStandby { primary: P })
        );
        assert_eq!(
            view.sync.as_ref().map(|s| s.set.setting()),
            Some("ANY 1 (\"pg3\")".to_owned())
        );
    }

    #[test]
    fn a_set_takes_effect_where_the_primary_is_when_it_loses_a_standby() {
        let eligible = names(&["pg2", "pg3"]);
        let mut keeper = SyncKeeper::default();
        let view = ClusterState::default()
            .apply(&Change::Elect { node: P, at_lsn: 0 })
            .unwrap();
        let pg2 = names(&["pg2"]);
        let at = |lsn, streaming, now_ms| KeeperInput {
            primary_lsn: lsn,
            ..input(Durability::Sync, streaming, &eligible, now_ms)
        };
        let view = carry_out(view.clone(), &keeper.turn(&view, &at(100, &pg2, 0)));
        assert_eq!(view.sync.as_ref().map(|s| s.since_lsn), Some(100));
        // The same set later keeps its position; a new one takes the primary's.
        let view = carry_out(view.clone(), &keeper.turn(&view, &at(300, &pg2, 1_000)));
        assert_eq!(view.sync.as_ref().map(|s| s.since_lsn), Some(100));
        // A standby joining keeps it: what pg2 confirmed alone is still on one of the set.
        let both = names(&["pg2", "pg3"]);
        let view = carry_out(view.clone(), &keeper.turn(&view, &at(500, &both, 2_000)));
        assert_eq!(view.sync.as_ref().map(|s| s.since_lsn), Some(100));
        // pg2 leaving moves it: what only pg2 confirmed may be missing on pg3.
        let pg3 = names(&["pg3"]);
        let view = carry_out(view.clone(), &keeper.turn(&view, &at(700, &pg3, 3_000)));
        assert_eq!(view.sync.as_ref().map(|s| s.since_lsn), Some(700));
        let ids = [(P, "pg1"), (NodeId(1), "pg2"), (NodeId(2), "pg3")];
        assert_eq!(
            sync_holders(&view, &ids, Some(0)),
            SyncHolders {
                members: vec![2],
                quorum: 1,
                since_lsn: Some(700),
            }
        );
        // Before any set, everyone else counts from the primary's election.
        let fresh = ClusterState::default()
            .apply(&Change::Elect {
                node: P,
                at_lsn: 42,
            })
            .unwrap();
        assert_eq!(sync_holders(&fresh, &ids, Some(0)).since_lsn, Some(42));
    }

    #[test]
    fn async_manages_nothing_and_opens_the_gate() {
        let mut keeper = SyncKeeper::default();
        let view = ClusterState::default();
        let step = keeper.turn(&view, &input(Durability::Async, &[], &[], 0));
        let view = carry_out(view, &step);
        assert_eq!(view.gate(), crate::Gate::Open);
        assert_eq!(view.sync, None);
        assert_eq!(
            preset_sync_set(Durability::Async, 1, &names(&["pg2"])),
            None
        );
    }
}
