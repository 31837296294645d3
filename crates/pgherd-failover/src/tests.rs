use super::*;

const POLICY: Policy = Policy {
    failures_before_down: 3,
    max_lag_on_failover_bytes: 1 << 20,
    durability: Durability::Async,
};

pub(crate) fn node(name: &str, check: Check) -> NodeView {
    NodeView {
        name: name.into(),
        priority: 1,
        consecutive_failures: u32::from(check == Check::Failed) * 3,
        check,
        fenced: false,
        upstream: None,
    }
}

pub(crate) fn replica(received_lsn: Lsn, upstream_alive: bool) -> Check {
    Check::Replica {
        timeline: 1,
        received_lsn,
        replayed_lsn: received_lsn,
        upstream_alive,
        settled: true,
    }
}

fn primary() -> Check {
    Check::Primary {
        timeline: 1,
        lsn: 1000,
    }
}

fn view<'a>(nodes: &'a [NodeView], synchronous: &'a [usize]) -> View<'a> {
    View {
        nodes,
        elected: Some(0),
        last_primary_lsn: Some(1000),
        synchronous,
        sync_quorum: 1,
        sync_since_lsn: None,
    }
}

fn verdict(policy: &Policy, nodes: &[NodeView], synchronous: &[usize]) -> (Verdict, String) {
    let v = view(nodes, synchronous);
    let verdict = decide(policy, &v);
    let sentence = verdict.sentence(&v);
    (verdict, sentence)
}

#[test]
fn a_primary_that_answers_is_up() {
    let nodes = [node("pg1", primary()), node("pg2", replica(1000, true))];
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(v, Verdict::PrimaryUp);
    assert_eq!(s, "primary pg1 is up");
    assert_eq!(writer_of(&view(&nodes, &[])), Some(0));
}

#[test]
fn a_few_failed_checks_are_only_suspicious() {
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
    ];
    nodes[0].consecutive_failures = 2;
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(
        v,
        Verdict::Suspect {
            failures: 2,
            needed: 3
        }
    );
    assert_eq!(s, "primary pg1 failed 2 check(s) in a row; down after 3");
    assert_eq!(writer_of(&view(&nodes, &[])), None);
}

#[test]
fn a_replica_that_still_streams_blocks_promotion() {
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(900, true)),
    ];
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(v, Verdict::Guarded { seen_by: vec![2] });
    assert_eq!(
        s,
        "primary pg1 does not answer pgherd but pg3 still stream(s) from it: not promoting, pgherd's own path to it is the problem"
    );
}

/// Found by the simulation with each instance's own links to the nodes: a fenced replica
/// that still streams from the primary proves it alive as well as any other.
#[test]
fn a_fenced_replica_that_still_streams_blocks_promotion_too() {
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, true)),
        node("pg3", replica(1000, false)),
    ];
    nodes[1].fenced = true;
    let (v, _) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(v, Verdict::Guarded { seen_by: vec![1] });
}

/// A replica cloned from another replica streams from it, not from the primary: its live
/// stream says nothing of the primary. Found by `pgherd clone` of a replica: failover never
/// came while the cascaded replica streamed.
#[test]
fn a_cascaded_replica_is_no_witness_for_the_primary() {
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(1000, false)),
        node("pg4", replica(1000, true)),
    ];
    nodes[3].upstream = Some("pg2".into());
    let (v, _) = verdict(&POLICY, &nodes, &[]);
    assert!(matches!(v, Verdict::Promote { .. }), "{v:?}");
    // Streaming from the primary, or from a sender pgherd cannot name, it still is one.
    for upstream in [Some("pg1".to_owned()), None] {
        nodes[3].upstream = upstream;
        let (v, _) = verdict(&POLICY, &nodes, &[]);
        assert_eq!(v, Verdict::Guarded { seen_by: vec![3] });
    }
}

/// After a failover only the replicas that streamed from the old primary are re-pointed: one
/// cascading from a replica that answers (or from the candidate) keeps streaming from it.
#[test]
fn a_failover_keeps_the_tree_of_cascading_replicas() {
    let followers = |nodes: &[NodeView]| match verdict(&POLICY, nodes, &[]).0 {
        Verdict::Promote { followers, .. } => followers,
        other => panic!("{other:?}"),
    };
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(1000, false)),
        node("pg4", replica(1000, true)),
    ];
    nodes[1].upstream = Some("pg1".into());
    nodes[2].upstream = Some("pg1".into());
    nodes[3].upstream = Some("pg2".into());
    // pg2 is promoted: pg4 streams from it already.
    assert_eq!(followers(&nodes), vec![2]);
    // pg3 is promoted: pg2 follows it, and pg4 follows pg2.
    nodes[2].check = replica(1100, false);
    assert_eq!(followers(&nodes), vec![1]);
    // pg4's upstream is gone too: pg4 is re-pointed.
    nodes[1].check = Check::Failed;
    nodes[1].consecutive_failures = 3;
    nodes[3].check = replica(1000, false);
    assert_eq!(followers(&nodes), vec![3]);
}

#[test]
fn promotion_needs_a_majority_of_replicas_to_confirm() {
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", Check::Failed),
        node("pg4", Check::Failed),
    ];
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(
        v,
        Verdict::NotConfirmed {
            confirmed: 1,
            needed: 2
        }
    );
    assert!(
        s.contains("only 1 replica(s) answer of the 2 needed"),
        "{s}"
    );
}

#[test]
fn the_most_advanced_replica_is_promoted_and_the_others_follow() {
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(990, false)),
        node("pg3", replica(1000, false)),
        node("pg4", replica(995, false)),
    ];
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(
        v,
        Verdict::Promote {
            candidate: 2,
            old: 0,
            followers: vec![1, 3]
        }
    );
    assert_eq!(
        s,
        "primary pg1 is down and no replica sees it: promoting pg3 (received up to 0/3E8, primary last seen at 0/3E8), fencing pg1, re-pointing pg2, pg4"
    );
}

#[test]
fn ties_go_to_priority_and_priority_zero_never_promotes() {
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(1000, false)),
        node("pg4", replica(2000, false)),
    ];
    nodes[2].priority = 5;
    nodes[3].priority = 0;
    let (v, _) = verdict(&POLICY, &nodes, &[]);
    assert!(matches!(v, Verdict::Promote { candidate: 2, .. }), "{v:?}");
}

#[test]
fn async_mode_never_promotes_a_replica_too_far_behind() {
    let nodes = [node("pg1", Check::Failed), node("pg2", replica(0, false))];
    let policy = Policy {
        max_lag_on_failover_bytes: 100,
        ..POLICY
    };
    let (v, s) = verdict(&policy, &nodes, &[]);
    assert_eq!(
        v,
        Verdict::NoCandidate {
            rejected: vec![(1, Rejection::TooFarBehind { behind_bytes: 1000 })]
        }
    );
    assert_eq!(
        s,
        "primary pg1 is down and no replica may be promoted; pg2: 1000 bytes behind the primary, over max_lag_on_failover_bytes"
    );
}

#[test]
fn sync_mode_promotes_only_a_synchronous_standby() {
    let policy = Policy {
        durability: Durability::Sync,
        ..POLICY
    };
    let behind = [
        node("pg1", Check::Failed),
        node("pg2", replica(800, false)),
        node("pg3", replica(900, false)),
    ];
    let (v, s) = verdict(&policy, &behind, &[2]);
    assert!(matches!(v, Verdict::Promote { candidate: 2, .. }), "{v:?}");
    assert!(s.contains("promoting pg3"), "{s}");
    // Even when a replica outside the set is further along: what only it has was never
    // acknowledged (the proxy rewinds it afterwards).
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(900, false)),
    ];
    let (v, _) = verdict(&policy, &nodes, &[2]);
    assert!(matches!(v, Verdict::Promote { candidate: 2, .. }), "{v:?}");
    let (v, s) = verdict(&policy, &nodes, &[]);
    assert_eq!(
        v,
        Verdict::SyncQuorumLost {
            answering: 0,
            needed: 1
        }
    );
    assert!(s.contains("only 0 synchronous standby(s) answer"), "{s}");
}

#[test]
fn sync_mode_waits_when_the_newest_commit_may_be_on_a_silent_standby() {
    let policy = Policy {
        durability: Durability::Sync,
        ..POLICY
    };
    // ANY 1 (pg2, pg3, pg4): a commit may be on pg4 alone, and pg4 does not answer, though
    // a majority of replicas confirms the primary is gone.
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(900, false)),
        node("pg3", replica(950, false)),
        node("pg4", Check::Failed),
    ];
    let (v, _) = verdict(&policy, &nodes, &[1, 2, 3]);
    assert_eq!(
        v,
        Verdict::SyncQuorumLost {
            answering: 2,
            needed: 3
        }
    );
}

#[test]
fn a_second_writable_node_is_fenced_and_never_routed() {
    let mut nodes = [
        node("pg1", primary()),
        node("pg2", primary()),
        node("pg3", replica(1000, true)),
    ];
    let (v, s) = verdict(&POLICY, &nodes, &[]);
    assert_eq!(v, Verdict::Fence { node: 1 });
    assert_eq!(
        s,
        "pg2 accepts writes but pg1 is the elected primary: fencing pg2"
    );
    assert_eq!(writer_of(&view(&nodes, &[])), Some(0));
    nodes[1].fenced = true;
    assert_eq!(verdict(&POLICY, &nodes, &[]).0, Verdict::PrimaryUp);
}

#[test]
fn election_needs_exactly_one_writable_node() {
    let nodes = [node("pg1", primary()), node("pg2", replica(1000, true))];
    let v = View {
        elected: None,
        ..view(&nodes, &[])
    };
    assert_eq!(decide(&POLICY, &v), Verdict::Elect { node: 0 });
    let both = [node("pg1", primary()), node("pg2", primary())];
    let v = View {
        elected: None,
        ..view(&both, &[])
    };
    let verdict = decide(&POLICY, &v);
    assert_eq!(
        verdict,
        Verdict::Ambiguous {
            writable: vec![0, 1]
        }
    );
    assert_eq!(writer_of(&v), None);
    assert_eq!(
        verdict.sentence(&v),
        "pg1, pg2 all accept writes and none is elected: routing no writes"
    );
}

#[test]
fn a_demoted_primary_gets_no_writes() {
    let nodes = [
        node("pg1", replica(1000, false)),
        node("pg2", replica(1000, false)),
    ];
    assert_eq!(verdict(&POLICY, &nodes, &[]).0, Verdict::PrimaryDemoted);
    assert_eq!(writer_of(&view(&nodes, &[])), None);
}

#[test]
fn sync_mode_never_skips_a_more_advanced_standby_it_may_not_promote() {
    let policy = Policy {
        durability: Durability::Sync,
        ..POLICY
    };
    let mut nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(1000, false)),
        node("pg3", replica(900, false)),
    ];
    nodes[1].priority = 0;
    let (v, s) = verdict(&policy, &nodes, &[1, 2]);
    assert_eq!(
        v,
        Verdict::NoCandidate {
            rejected: vec![
                (1, Rejection::PriorityZero),
                (2, Rejection::MissesAcknowledgedWal { behind_bytes: 100 })
            ]
        }
    );
    assert_eq!(
        s,
        "primary pg1 is down and no replica may be promoted; pg2: priority 0; pg3: 100 bytes behind a synchronous standby that may not be promoted, which may hold acknowledged commits"
    );
}

#[test]
fn a_restarted_standby_still_replaying_holds_the_choice_back() {
    let policy = Policy {
        durability: Durability::Sync,
        ..POLICY
    };
    // pg2 restarted after a crash: it reports a received position from before the WAL it
    // holds (900 → 0, the start of the segment) and its replay is still at 950, moving. pg3
    // streamed up to 1000. What pg2 holds beyond 1000 may be acknowledged commits.
    let recovering = Check::Replica {
        timeline: 1,
        received_lsn: 0,
        replayed_lsn: 950,
        upstream_alive: false,
        settled: false,
    };
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", recovering),
        node("pg3", replica(1000, false)),
    ];
    let (v, s) = verdict(&policy, &nodes, &[1, 2]);
    assert_eq!(v, Verdict::Settling { replicas: vec![1] });
    assert!(s.contains("pg2 still replay(s) WAL"), "{s}");
    // Once its replay stops at 1200, it is the most advanced and is promoted.
    let settled = Check::Replica {
        timeline: 1,
        received_lsn: 0,
        replayed_lsn: 1200,
        upstream_alive: false,
        settled: true,
    };
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", settled),
        node("pg3", replica(1000, false)),
    ];
    let (v, _) = verdict(&policy, &nodes, &[1, 2]);
    assert!(matches!(v, Verdict::Promote { candidate: 1, .. }), "{v:?}");
}

/// Where the proxy routes writes in this view: the cluster view's writer over the nodes that
/// answer as a primary.
fn writer_of(view: &View) -> Option<usize> {
    let id = |i: usize| NodeId(i as u32);
    let elect = view.elected.map(|e| Change::Elect {
        node: id(e),
        at_lsn: 0,
    });
    let fence = (0..view.nodes.len())
        .filter(|&i| view.nodes[i].fenced)
        .map(|i| Change::Fence(id(i)));
    let state = elect
        .into_iter()
        .chain(fence)
        .fold(ClusterState::default(), |state, change| {
            state.apply(&change).unwrap_or(state)
        });
    let primaries = (0..view.nodes.len())
        .filter(|&i| matches!(view.nodes[i].check, Check::Primary { .. }))
        .map(id);
    state.writer(primaries).map(|id| id.0 as usize)
}

/// Found by the simulation once it ran the proxy's keeper: a standby re-pointed to a new
/// primary (or added to the set after `sync` degraded) was taken for holding every
/// acknowledged commit before it had received the WAL the primary had when its set took
/// effect, where commits acknowledged by the old primary (or by this one alone) may end.
#[test]
fn a_synchronous_standby_short_of_where_its_set_took_effect_is_not_promoted() {
    let policy = Policy {
        durability: Durability::Sync,
        ..POLICY
    };
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(800, false)),
        node("pg3", replica(960, false)),
    ];
    // ANY 1 (pg2, pg3) took effect at 950: pg3 has received past it.
    let v = View {
        sync_since_lsn: Some(950),
        ..view(&nodes, &[1, 2])
    };
    let verdict = decide(&policy, &v);
    assert!(
        matches!(verdict, Verdict::Promote { candidate: 2, .. }),
        "{verdict:?}"
    );
    // Both short of it: nothing is promoted, and the sentence says why.
    let nodes = [
        node("pg1", Check::Failed),
        node("pg2", replica(800, false)),
        node("pg3", replica(900, false)),
    ];
    let v = View {
        sync_since_lsn: Some(950),
        ..view(&nodes, &[1, 2])
    };
    let verdict = decide(&policy, &v);
    assert_eq!(
        verdict,
        Verdict::NoCandidate {
            rejected: vec![
                (1, Rejection::BehindSyncFloor { behind_bytes: 150 }),
                (2, Rejection::BehindSyncFloor { behind_bytes: 50 }),
            ]
        }
    );
    assert!(
        verdict.sentence(&v).contains(
            "pg3: 50 bytes short of where the primary was when its synchronous set took effect"
        ),
        "{}",
        verdict.sentence(&v)
    );
}
