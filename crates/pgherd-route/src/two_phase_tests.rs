use super::*;

fn p(shard: u32, wrote: bool) -> Participant {
    Participant { shard, wrote }
}

#[test]
fn the_plan_follows_the_writers() {
    assert_eq!(plan_commit(&[]), CommitPlan::Nothing);
    assert_eq!(
        plan_commit(&[p(2, false), p(0, false)]),
        CommitPlan::OnePhase {
            readers: vec![0, 2],
            writer: None
        }
    );
    assert_eq!(
        plan_commit(&[p(2, true), p(0, false)]),
        CommitPlan::OnePhase {
            readers: vec![0],
            writer: Some(2)
        }
    );
    assert_eq!(
        plan_commit(&[p(3, true), p(1, false), p(2, true), p(0, true)]),
        CommitPlan::TwoPhase {
            readers: vec![1],
            decider: 0,
            prepared: vec![2, 3]
        }
    );
}

#[test]
fn gids_read_back_and_others_are_left_alone() {
    let gid = Gid {
        decider: 3,
        instance: 0xdead_beef,
        sequence: 42,
        xid: 777,
    };
    assert_eq!(gid.to_string(), "pgherd_3_00000000deadbeef_42_777");
    assert_eq!(Gid::parse(&gid.to_string()), Some(gid));
    assert_eq!(
        Gid::decided(&gid.to_string(), 3, 0xdead_beef, 42),
        Some(gid)
    );
    assert_eq!(Gid::decided(&gid.to_string(), 3, 0xdead_beef, 43), None);
    assert!(decide_sql(3, 0xdead_beef, 42).contains("pgherd.decide(3, '00000000deadbeef', 42)"));
    for other in [
        "",
        "pgherd_",
        "pgherd_x_00000000deadbeef_1_1",
        "pgherd_1_deadbeef_1_1",
        "pgherd_1_00000000deadbeef_1",
        "pgherd_1_00000000deadbeef_1_2_3",
        "app_1_00000000deadbeef_1_1",
        "pgherd_1_00000000deadbeef_1_",
    ] {
        assert_eq!(Gid::parse(other), None, "{other}");
    }
}

#[test]
fn a_prepare_not_done_aborts() {
    use Reply::*;
    assert_eq!(
        after_prepares(&[(1, Done), (2, Done)]),
        AfterPrepare::Decide
    );
    assert_eq!(
        after_prepares(&[(1, Done), (2, Refused), (3, Lost)]),
        AfterPrepare::Abort {
            rollback_prepared: vec![1],
            left_to_recovery: vec![3]
        }
    );
    assert_eq!(verdict(Done), Verdict::Committed);
    assert_eq!(verdict(Refused), Verdict::Aborted);
    assert_eq!(verdict(Lost), Verdict::Unknown);
}

#[test]
fn only_decisions_prepared_nowhere_are_removed() {
    let prepared: HashSet<String> = ["a".to_owned()].into();
    assert_eq!(
        removable_decisions(&["a".into(), "b".into()], &prepared),
        vec!["b".to_owned()]
    );
}

/// A tiny deterministic generator, so a failing seed replays.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shard {
    Open,
    Prepared,
    Committed,
    RolledBack,
}

/// The protocol under random answers, lost connections and a coordinator that may die at any
/// step, then recovery: every participant ends committed or every one rolled back, and a
/// client told "committed" (or "rolled back") was told the truth.
#[test]
fn simulated_commits_are_atomic_whatever_fails() {
    for seed in 1..=20_000u64 {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let count = 2 + rng.below(3) as u32;
        let participants: Vec<Participant> = (0..count)
            .map(|s| p(s, s < 2 || rng.below(2) == 0))
            .collect();
        let CommitPlan::TwoPhase {
            decider, prepared, ..
        } = plan_commit(&participants)
        else {
            panic!("seed {seed}: two writers at least");
        };
        let mut state = vec![Shard::Open; count as usize];
        // The decider's decision row: None (not inserted or rolled back), Some(false) pending,
        // Some(true) committed.
        let mut decision_committed: Option<bool> = Some(false);
        let mut told: Option<bool> = None;
        let crash_at = rng.below(6);
        let mut replies = Vec::new();
        for &shard in &prepared {
            let reply = match rng.below(6) {
                0 => Reply::Refused,
                1 => Reply::Lost,
                _ => Reply::Done,
            };
            // A lost answer may hide a prepare that happened.
            if reply == Reply::Done || (reply == Reply::Lost && rng.below(2) == 0) {
                state[shard as usize] = Shard::Prepared;
            } else {
                state[shard as usize] = Shard::RolledBack;
            }
            replies.push((shard, reply));
        }
        'coordinator: {
            if crash_at == 0 {
                break 'coordinator;
            }
            match after_prepares(&replies) {
                AfterPrepare::Abort {
                    rollback_prepared, ..
                } => {
                    decision_committed = None;
                    state[decider as usize] = Shard::RolledBack;
                    told = Some(false);
                    for shard in rollback_prepared {
                        if crash_at == 1 {
                            break 'coordinator;
                        }
                        state[shard as usize] = Shard::RolledBack;
                    }
                }
                AfterPrepare::Decide => {
                    if crash_at == 2 {
                        break 'coordinator;
                    }
                    let reply = match rng.below(5) {
                        0 => Reply::Refused,
                        1 => Reply::Lost,
                        _ => Reply::Done,
                    };
                    let happened =
                        reply == Reply::Done || (reply == Reply::Lost && rng.below(2) == 0);
                    if happened {
                        decision_committed = Some(true);
                        state[decider as usize] = Shard::Committed;
                    } else {
                        decision_committed = None;
                        state[decider as usize] = Shard::RolledBack;
                    }
                    let finish = match verdict(reply) {
                        Verdict::Committed => {
                            told = Some(true);
                            Shard::Committed
                        }
                        Verdict::Aborted => {
                            told = Some(false);
                            Shard::RolledBack
                        }
                        Verdict::Unknown => break 'coordinator,
                    };
                    for &shard in &prepared {
                        if crash_at == 3 || rng.below(4) == 0 {
                            continue; // lost: left to recovery
                        }
                        if state[shard as usize] == Shard::Prepared {
                            state[shard as usize] = finish;
                        }
                    }
                }
            }
        }
        // The coordinator is gone: the decider's open transaction dies with its connection.
        if decision_committed == Some(false) {
            decision_committed = None;
            state[decider as usize] = Shard::RolledBack;
        }
        // Recovery: the abort insert, then the row's verdict for every prepared participant.
        let committed = *decision_committed.get_or_insert(false);
        for s in state.iter_mut().filter(|s| **s == Shard::Prepared) {
            *s = match resolve(committed) {
                Resolution::Commit => Shard::Committed,
                Resolution::Rollback => Shard::RolledBack,
            };
        }
        // Readers committed first and wrote nothing: only the writers' fate counts.
        let writers: Vec<Shard> = std::iter::once(decider)
            .chain(prepared.iter().copied())
            .map(|shard| state[shard as usize])
            .collect();
        let all = |want: Shard| writers.iter().all(|s| *s == want);
        assert!(
            all(Shard::Committed) || all(Shard::RolledBack),
            "seed {seed}: {state:?}"
        );
        if let Some(committed) = told {
            assert_eq!(
                all(Shard::Committed),
                committed,
                "seed {seed}: the client was told otherwise: {state:?}"
            );
        }
    }
}
