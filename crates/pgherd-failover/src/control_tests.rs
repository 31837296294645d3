//! The steps of each operation, driven as the proxy drives them: changes applied to the view
//! between steps, each IO answered by a scripted outcome.

use super::*;
use crate::NodeView;

const NAMES: [&str; 4] = ["pg1", "pg2", "pg3", "pg4"];

fn members(received: [Lsn; 4]) -> Vec<Member<'static>> {
    (0..4)
        .map(|i| Member {
            id: NodeId(i as u32),
            name: NAMES[i],
            may_be_sync: i != 3,
            received_lsn: received[i],
        })
        .collect()
}

/// Runs `op` to its end; `answer` gives each IO's outcome. Returns every step and the result.
fn drive(
    mut op: Operation,
    state: &mut ClusterState,
    members: &[Member],
    durability: Durability,
    mut answer: impl FnMut(&Io) -> Outcome,
) -> (Vec<Step>, Result<Vec<String>, String>) {
    let mut steps = Vec::new();
    let mut outcome = None;
    loop {
        let ctx = Context {
            state,
            members,
            durability,
            sync_standbys: 1,
        };
        let step = op.step(outcome.take(), &ctx);
        for change in &step.changes {
            if let Some(next) = state.apply(change) {
                *state = next;
            }
        }
        outcome = step.io.as_ref().map(&mut answer);
        let over = step.io.is_none();
        steps.push(step);
        if over {
            assert!(op.is_done());
            return (steps, op.finish());
        }
        assert!(steps.len() < 20, "the operation does not end");
    }
}

fn elected(node: u32) -> ClusterState {
    ClusterState::default()
        .apply(&Change::Elect {
            node: NodeId(node),
            at_lsn: 100,
        })
        .unwrap()
}

fn kinds(steps: &[Step]) -> Vec<&'static str> {
    steps
        .iter()
        .flat_map(|s| s.events.iter().map(|e| e.kind))
        .collect()
}

fn ios(steps: &[Step]) -> Vec<Io> {
    steps.iter().filter_map(|s| s.io.clone()).collect()
}

fn promotion(members: &[Member]) -> Operation {
    // pg2 replaces pg1; pg3 and pg4 follow it.
    Operation::promote(1, Some(0), &[2, 3], members)
}

/// Every IO works; the candidate had received WAL up to 5,100 when promoted.
fn every_io_works(io: &Io) -> Outcome {
    match io {
        Io::Promote { .. } => Outcome::Promoted {
            received_lsn: 5_100,
        },
        _ => Outcome::Done,
    }
}

#[test]
fn a_promotion_fences_repoints_promotes_presets_and_elects_in_that_order() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Sync,
        every_io_works,
    );
    assert_eq!(
        steps[0].changes,
        vec![
            Change::BeginPromotion {
                candidate: NodeId(1)
            },
            Change::Fence(NodeId(0))
        ]
    );
    assert_eq!(
        ios(&steps),
        vec![
            Io::CutOff {
                node: 0,
                newly: true
            },
            Io::Repoint {
                follower: 2,
                primary: 1
            },
            Io::Repoint {
                follower: 3,
                primary: 1
            },
            Io::Promote { node: 1 },
            // pg1 is fenced and pg4 may not be synchronous: the set is pg3 alone.
            Io::SetSyncSet {
                node: 1,
                set: SyncSet {
                    quorum: 1,
                    standbys: vec!["pg3".to_owned()]
                }
            },
        ]
    );
    assert_eq!(
        kinds(&steps),
        ["fenced", "repointed", "repointed", "promoted"]
    );
    let elect = &steps[steps.len() - 1].changes;
    assert_eq!(
        elect[0],
        Change::Elect {
            node: NodeId(1),
            at_lsn: 5_100
        }
    );
    assert!(
        matches!(&elect[1], Change::SyncInForce(Some(s)) if s.primary == NodeId(1) && s.since_lsn == 5_100)
    );
    assert_eq!(state.elected, Some(NodeId(1)));
    assert!(state.is_fenced(NodeId(0)));
    assert_eq!(
        result.unwrap(),
        [
            "pg1 fenced: no more traffic through pgherd",
            "pg3 follows pg2 now",
            "pg4 follows pg2 now",
            "pg2 promoted; writes go to it now"
        ]
    );
}

#[test]
fn a_failed_promotion_is_abandoned_and_the_old_primary_stays_elected_and_fenced() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Sync,
        |io| match io {
            Io::Promote { .. } => Outcome::Failed("pg_promote() failed: timeout".to_owned()),
            _ => Outcome::Done,
        },
    );
    assert_eq!(result.unwrap_err(), "pg_promote() failed: timeout");
    assert_eq!(
        kinds(&steps),
        ["fenced", "repointed", "repointed", "promotion_failed"]
    );
    assert_eq!(
        steps.last().unwrap().changes,
        vec![Change::AbandonPromotion]
    );
    assert_eq!(state.elected, Some(NodeId(0)));
    assert!(state.is_fenced(NodeId(0)));
    assert_eq!(state.promoting, None);
    // Writes wait: the elected primary is fenced.
    assert_eq!(state.write_target(vec![NodeId(0)]), None);
}

#[test]
fn a_failed_repoint_is_reported_and_the_promotion_goes_on() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Async,
        |io| match io {
            Io::Repoint { follower: 2, .. } => Outcome::Failed("connection refused".to_owned()),
            Io::Promote { .. } => Outcome::Promoted {
                received_lsn: 5_000,
            },
            _ => Outcome::Done,
        },
    );
    assert_eq!(
        kinds(&steps),
        ["fenced", "repoint_failed", "repointed", "promoted"]
    );
    assert!(result
        .unwrap()
        .contains(&"pg3 cannot follow pg2: connection refused".to_owned()));
    // Async durability: no set to preset, none in force.
    assert!(!ios(&steps)
        .iter()
        .any(|io| matches!(io, Io::SetSyncSet { .. })));
    assert!(steps
        .last()
        .unwrap()
        .changes
        .contains(&Change::SyncInForce(None)));
    assert_eq!(state.elected, Some(NodeId(1)));
}

#[test]
fn in_strict_a_promotion_presets_the_fenced_old_primary_too() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Strict,
        every_io_works,
    );
    assert!(result.is_ok(), "{result:?}");
    // pg1 is fenced, yet strict lets no commit of pg2's rest on pg2 alone until a standby
    // streams: the set waits for pg1 as for pg3 (pg4 may not be synchronous).
    assert!(
        ios(&steps).contains(&Io::SetSyncSet {
            node: 1,
            set: SyncSet {
                quorum: 1,
                standbys: vec!["pg1".to_owned(), "pg3".to_owned()]
            }
        }),
        "{:?}",
        ios(&steps)
    );
}

#[test]
fn a_preset_that_fails_leaves_no_set_in_force_for_the_keeper_to_put_right() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Strict,
        |io| match io {
            Io::SetSyncSet { .. } => Outcome::Failed("no answer".to_owned()),
            Io::Promote { .. } => Outcome::Promoted {
                received_lsn: 5_000,
            },
            _ => Outcome::Done,
        },
    );
    assert!(result.is_ok());
    let last = &steps.last().unwrap().changes;
    assert_eq!(
        last,
        &vec![Change::Elect {
            node: NodeId(1),
            at_lsn: 5_000
        }]
    );
    assert_eq!(state.sync, None);
}

#[test]
fn a_follower_ahead_of_the_promoted_candidate_is_fenced_as_diverged() {
    // pg3 had received more than pg2 when pg2 was chosen (pg2 was forced, say).
    let members = members([0, 5_000, 6_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        promotion(&members),
        &mut state,
        &members,
        Durability::Async,
        |io| match io {
            Io::Promote { .. } => Outcome::Promoted {
                received_lsn: 5_000,
            },
            _ => Outcome::Done,
        },
    );
    assert_eq!(
        kinds(&steps),
        [
            "fenced",
            "repointed",
            "repointed",
            "diverged",
            "fenced",
            "promoted"
        ]
    );
    assert!(ios(&steps).contains(&Io::CutOff {
        node: 2,
        newly: true
    }));
    assert!(state.is_fenced(NodeId(2)));
    assert!(!state.is_fenced(NodeId(3)));
    assert!(result.unwrap()[3]
        .starts_with("pg3 had WAL up to 0/1770 beyond where pg2 was promoted (0/1388)"));
}

#[test]
fn verdicts_become_operations() {
    let view_nodes: Vec<NodeView> = (0..4)
        .map(|i| NodeView {
            upstream: None,
            name: NAMES[i].to_owned(),
            priority: 1,
            check: if i == 0 {
                Check::Primary {
                    timeline: 1,
                    lsn: 777,
                }
            } else {
                Check::Failed
            },
            consecutive_failures: 0,
            fenced: false,
        })
        .collect();
    let view = View {
        nodes: &view_nodes,
        elected: None,
        last_primary_lsn: None,
        synchronous: &[],
        sync_quorum: 0,
        sync_since_lsn: None,
    };
    let members = members([0; 4]);
    let mut state = ClusterState::default();

    let elect = Operation::for_verdict(&Verdict::Elect { node: 0 }, &view, &members).unwrap();
    let (steps, _) = drive(elect, &mut state, &members, Durability::Async, |_| {
        Outcome::Done
    });
    assert_eq!(
        steps,
        vec![Step {
            changes: vec![Change::Elect {
                node: NodeId(0),
                at_lsn: 777
            }],
            ..Step::default()
        }]
    );

    // Fencing a node fenced already cuts it off again, without a second event or hook.
    for (newly, events) in [(true, 1), (false, 0)] {
        let fence = Operation::for_verdict(&Verdict::Fence { node: 2 }, &view, &members).unwrap();
        let (steps, _) = drive(fence, &mut state, &members, Durability::Async, |_| {
            Outcome::Done
        });
        assert_eq!(ios(&steps), vec![Io::CutOff { node: 2, newly }]);
        assert_eq!(kinds(&steps).len(), events);
    }

    for waits in [Verdict::PrimaryUp, Verdict::NoPrimary] {
        assert!(Operation::for_verdict(&waits, &view, &members).is_none());
    }
}

#[test]
fn a_node_promoted_by_a_switchover_is_elected_after_its_set() {
    let members = members([0, 5_000, 4_000, 4_000]);
    let mut state = elected(0);
    let (steps, result) = drive(
        Operation::elect_promoted(1, 5_200),
        &mut state,
        &members,
        Durability::Sync,
        |_| Outcome::Done,
    );
    assert_eq!(
        ios(&steps),
        vec![Io::SetSyncSet {
            node: 1,
            set: SyncSet {
                quorum: 1,
                standbys: vec!["pg1".to_owned(), "pg3".to_owned()]
            }
        }]
    );
    assert_eq!(state.elected, Some(NodeId(1)));
    assert_eq!(state.elected_at_lsn, Some(5_200));
    assert!(kinds(&steps).is_empty());
    assert!(result.unwrap().is_empty());
}
