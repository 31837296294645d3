//! Manual failover: the operator names the replica to promote (`PROMOTE node`), for when the
//! primary is dead and automatic failover is off or would not act. The same safeguards as
//! [`crate::decide`] apply, each one a sentence; the operator may skip a named one with
//! `--force`, never the checks without which promotion cannot work (the candidate must answer
//! as a replica and not be fenced).

use crate::{eligibility, needs_repoint, Check, Lsn, Policy, View};

/// A safeguard a manual promotion must pass unless the operator forces it by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Safeguard {
    /// The primary still answers: a switchover moves it without losing a write.
    PrimaryAnswers,
    /// A replica still streams from the primary: only pgherd's path to it may have failed.
    SplitBrainGuard,
    /// Fewer than a majority of the other replicas answer to confirm the primary is gone.
    Confirmed,
    /// A replica still replays WAL it holds beyond what it reports.
    Settled,
    /// The candidate is not a failover candidate (priority 0, outside the synchronous set,
    /// too far behind).
    Eligible,
    /// Another replica has received more WAL than the candidate: promoting it loses that WAL.
    MostAdvanced,
    /// In `sync`/`strict` durability too few synchronous standbys answer to know where the
    /// newest acknowledged commit is.
    SyncQuorum,
}

impl Safeguard {
    pub const ALL: [Safeguard; 7] = [
        Safeguard::PrimaryAnswers,
        Safeguard::SplitBrainGuard,
        Safeguard::Confirmed,
        Safeguard::Settled,
        Safeguard::Eligible,
        Safeguard::MostAdvanced,
        Safeguard::SyncQuorum,
    ];

    /// The name `--force` takes.
    pub fn name(self) -> &'static str {
        match self {
            Safeguard::PrimaryAnswers => "primary-answers",
            Safeguard::SplitBrainGuard => "split-brain-guard",
            Safeguard::Confirmed => "confirmed",
            Safeguard::Settled => "settled",
            Safeguard::Eligible => "eligible",
            Safeguard::MostAdvanced => "most-advanced",
            Safeguard::SyncQuorum => "sync-quorum",
        }
    }

    pub fn from_name(name: &str) -> Option<Safeguard> {
        Safeguard::ALL.into_iter().find(|s| s.name() == name)
    }
}

/// Why a manual promotion does not go ahead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `None`: no `--force` helps (the candidate cannot be promoted at all).
    pub safeguard: Option<Safeguard>,
    pub sentence: String,
}

/// What a manual promotion does: promote `candidate`, fence `old` (the primary it replaces,
/// if pgherd knows one), re-point `followers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Promotion {
    pub candidate: usize,
    pub old: Option<usize>,
    pub followers: Vec<usize>,
}

/// Checks promoting `candidate` in `view` (whose `elected` is the primary being replaced, if
/// known). Every safeguard that fails and is not in `forced` is a refusal; all of them are
/// returned, so the operator sees everything in one answer.
pub fn plan_promotion(
    policy: &Policy,
    view: &View,
    candidate: usize,
    forced: &[Safeguard],
) -> Result<Promotion, Vec<Refusal>> {
    let name = |i: usize| view.nodes[i].name.as_str();
    let node = &view.nodes[candidate];
    let candidate_lsn = match node.check {
        Check::Replica { .. } if node.fenced => {
            return Err(vec![Refusal {
                safeguard: None,
                sentence: format!(
                    "{} is fenced (a replaced or diverged node): rejoin it first",
                    name(candidate)
                ),
            }])
        }
        Check::Replica { .. } => node.received().unwrap_or(0),
        Check::Primary { .. } => {
            return Err(vec![Refusal {
                safeguard: None,
                sentence: format!("{} is not a replica: it accepts writes", name(candidate)),
            }])
        }
        Check::Failed => {
            return Err(vec![Refusal {
                safeguard: None,
                sentence: format!(
                    "{} does not answer pgherd's health checks: it cannot be promoted",
                    name(candidate)
                ),
            }])
        }
    };
    let mut refusals = Vec::new();
    let mut refuse = |safeguard: Safeguard, sentence: String| {
        if !forced.contains(&safeguard) {
            refusals.push(Refusal {
                safeguard: Some(safeguard),
                sentence,
            });
        }
    };
    let writable: Vec<usize> = (0..view.nodes.len())
        .filter(|&i| matches!(view.nodes[i].check, Check::Primary { .. }) && !view.nodes[i].fenced)
        .collect();
    for &i in &writable {
        refuse(
            Safeguard::PrimaryAnswers,
            format!(
                "{} answers as the primary: SWITCHOVER moves the primary without losing a write",
                name(i)
            ),
        );
    }
    let others: Vec<usize> = (0..view.nodes.len())
        .filter(|&i| i != candidate && Some(i) != view.elected && !view.nodes[i].fenced)
        .filter(|&i| !writable.contains(&i))
        .collect();
    let old_primary = view.elected.map(|e| view.nodes[e].name.as_str());
    let streaming: Vec<usize> = std::iter::once(candidate)
        .chain(others.iter().copied())
        .filter(|&i| view.nodes[i].hears_primary(old_primary))
        .collect();
    if !streaming.is_empty() {
        refuse(
            Safeguard::SplitBrainGuard,
            format!(
                "{} still stream{} from the primary: it may be alive and only pgherd's path to it broken",
                names(view, &streaming),
                if streaming.len() == 1 { "s" } else { "" }
            ),
        );
    }
    let answering = others.iter().filter(|&&i| view.nodes[i].answers()).count();
    // The candidate is a replica that answers too.
    let replicas = others.len() + 1;
    let needed = replicas / 2 + 1;
    if answering + 1 < needed {
        refuse(
            Safeguard::Confirmed,
            format!(
                "only {} of {replicas} replicas answer pgherd ({needed} needed to confirm the primary is gone)",
                answering + 1,
            ),
        );
    }
    let settling: Vec<usize> = std::iter::once(candidate)
        .chain(others.iter().copied())
        .filter(|&i| matches!(view.nodes[i].check, Check::Replica { settled: false, .. }))
        .collect();
    if !settling.is_empty() {
        refuse(
            Safeguard::Settled,
            format!(
                "{} still replay{} WAL: their positions may grow",
                names(view, &settling),
                if settling.len() == 1 { "s" } else { "" }
            ),
        );
    }
    if let Err(why) = eligibility(policy, view, candidate) {
        refuse(
            Safeguard::Eligible,
            format!(
                "{} is not a failover candidate: {}",
                name(candidate),
                why.reason()
            ),
        );
    }
    let ahead: Vec<(usize, Lsn)> = others
        .iter()
        .filter_map(|&i| Some((i, view.nodes[i].received()?)))
        .filter(|&(_, lsn)| lsn > candidate_lsn)
        .collect();
    if let Some(&(i, lsn)) = ahead.iter().max_by_key(|(_, lsn)| *lsn) {
        refuse(
            Safeguard::MostAdvanced,
            format!(
                "{} has received {} bytes of WAL more than {}: promoting {} loses them",
                name(i),
                lsn - candidate_lsn,
                name(candidate),
                name(candidate)
            ),
        );
    }
    if policy.durability.is_sync() {
        if let Err((answering, needed)) = view.sync_quorum_answers() {
            refuse(
                Safeguard::SyncQuorum,
                format!(
                    "{answering} synchronous standbys answer, {needed} needed to be sure the newest acknowledged commit is on one of them"
                ),
            );
        }
    }
    if !refusals.is_empty() {
        return Err(refusals);
    }
    let old = view.elected.filter(|&i| i != candidate);
    Ok(Promotion {
        candidate,
        old,
        followers: others
            .into_iter()
            .filter(|&i| matches!(view.nodes[i].check, Check::Replica { .. }))
            .filter(|&i| needs_repoint(view, i, old, candidate_lsn))
            .collect(),
    })
}

fn names(view: &View, nodes: &[usize]) -> String {
    nodes
        .iter()
        .map(|&i| view.nodes[i].name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{node, replica};
    use crate::{Durability, NodeView};

    fn policy(durability: Durability) -> Policy {
        Policy {
            failures_before_down: 3,
            max_lag_on_failover_bytes: 1 << 20,
            durability,
        }
    }

    fn plan(
        nodes: &[NodeView],
        candidate: usize,
        forced: &[Safeguard],
    ) -> Result<Promotion, Vec<(Option<&'static str>, String)>> {
        let view = View {
            nodes,
            elected: Some(0),
            last_primary_lsn: Some(100),
            synchronous: &[1, 2],
            sync_quorum: 1,
            sync_since_lsn: None,
        };
        plan_promotion(&policy(Durability::Async), &view, candidate, forced).map_err(|r| {
            r.into_iter()
                .map(|r| (r.safeguard.map(Safeguard::name), r.sentence))
                .collect()
        })
    }

    #[test]
    fn a_dead_primary_is_replaced_by_the_named_replica() {
        let nodes = [
            node("pg1", Check::Failed),
            node("pg2", replica(100, false)),
            node("pg3", replica(90, false)),
        ];
        assert_eq!(
            plan(&nodes, 1, &[]),
            Ok(Promotion {
                candidate: 1,
                old: Some(0),
                followers: vec![2],
            })
        );
    }

    #[test]
    fn a_promotion_keeps_the_tree_of_cascading_replicas() {
        let mut nodes = [
            node("pg1", Check::Failed),
            node("pg2", replica(100, false)),
            node("pg3", replica(100, false)),
            node("pg4", replica(100, false)),
            node("pg5", replica(100, false)),
        ];
        nodes[1].upstream = Some("pg1".into());
        nodes[2].upstream = Some("pg1".into());
        // pg4 cascades from pg3, pg5 from pg2: pg2 is promoted, pg3 follows it, pg4 keeps
        // following pg3 and pg5 follows pg2 already.
        nodes[3].upstream = Some("pg3".into());
        nodes[4].upstream = Some("pg2".into());
        assert_eq!(plan(&nodes, 1, &[]).map(|p| p.followers), Ok(vec![2]));
        // An upstream pgherd cannot name, one that is gone, and one that answers as a
        // primary: each is left by its replica for the new primary.
        nodes[3].upstream = None;
        assert_eq!(plan(&nodes, 1, &[]).map(|p| p.followers), Ok(vec![2, 3]));
        nodes[3].upstream = Some("pg9".into());
        assert_eq!(plan(&nodes, 1, &[]).map(|p| p.followers), Ok(vec![2, 3]));
        nodes[3].upstream = Some("pg3".into());
        nodes[2].check = Check::Failed;
        nodes[2].consecutive_failures = 3;
        assert_eq!(plan(&nodes, 1, &[]).map(|p| p.followers), Ok(vec![3]));
    }

    #[test]
    fn every_failed_safeguard_is_a_sentence_with_its_name() {
        let nodes = [
            node(
                "pg1",
                Check::Primary {
                    timeline: 1,
                    lsn: 100,
                },
            ),
            node("pg2", replica(80, true)),
            node("pg3", replica(100, false)),
        ];
        let refusals = plan(&nodes, 1, &[]).unwrap_err();
        let names: Vec<_> = refusals.iter().map(|r| r.0.unwrap()).collect();
        assert_eq!(
            names,
            ["primary-answers", "split-brain-guard", "most-advanced"]
        );
        assert_eq!(
            refusals[0].1,
            "pg1 answers as the primary: SWITCHOVER moves the primary without losing a write"
        );
        assert_eq!(
            refusals[2].1,
            "pg3 has received 20 bytes of WAL more than pg2: promoting pg2 loses them"
        );
        // Forcing one leaves the others.
        let left = plan(&nodes, 1, &[Safeguard::MostAdvanced]).unwrap_err();
        assert_eq!(left.len(), 2);
        let all = [
            Safeguard::PrimaryAnswers,
            Safeguard::SplitBrainGuard,
            Safeguard::MostAdvanced,
        ];
        assert!(plan(&nodes, 1, &all).is_ok());
    }

    #[test]
    fn no_force_promotes_a_primary_a_fenced_node_or_one_that_does_not_answer() {
        let mut nodes = [
            node("pg1", Check::Failed),
            node("pg2", replica(100, false)),
            node(
                "pg3",
                Check::Primary {
                    timeline: 2,
                    lsn: 5,
                },
            ),
        ];
        let all = Safeguard::ALL;
        assert_eq!(
            plan(&nodes, 0, &all).unwrap_err()[0].1,
            "pg1 does not answer pgherd's health checks: it cannot be promoted"
        );
        assert_eq!(
            plan(&nodes, 2, &all).unwrap_err()[0].1,
            "pg3 is not a replica: it accepts writes"
        );
        nodes[1].fenced = true;
        let refusal = &plan(&nodes, 1, &all).unwrap_err()[0];
        assert_eq!(refusal.0, None);
        assert!(refusal.1.contains("fenced"), "{}", refusal.1);
    }

    #[test]
    fn candidate_rules_are_those_of_automatic_failover() {
        let mut nodes = [
            node("pg1", Check::Failed),
            node("pg2", replica(100, false)),
            node("pg3", replica(100, false)),
        ];
        nodes[1].priority = 0;
        let refusals = plan(&nodes, 1, &[]).unwrap_err();
        assert_eq!(refusals[0].0, Some("eligible"));
        assert!(refusals[0].1.contains("priority 0"), "{}", refusals[0].1);
        // In sync durability only a synchronous standby, and only with the quorum answering.
        let view = View {
            nodes: &nodes,
            elected: Some(0),
            last_primary_lsn: None,
            synchronous: &[1],
            sync_quorum: 1,
            sync_since_lsn: None,
        };
        let refusals = plan_promotion(&policy(Durability::Sync), &view, 2, &[]).unwrap_err();
        let names: Vec<_> = refusals
            .iter()
            .map(|r| r.safeguard.unwrap().name())
            .collect();
        assert_eq!(names, ["eligible"]);
        for safeguard in Safeguard::ALL {
            assert_eq!(Safeguard::from_name(safeguard.name()), Some(safeguard));
        }
    }

    #[test]
    fn a_lone_replica_needs_no_one_to_confirm() {
        let nodes = [node("pg1", Check::Failed), node("pg2", replica(100, false))];
        assert!(plan(&nodes, 1, &[]).is_ok());
        // Two silent replicas out of three: not confirmed.
        let nodes = [
            node("pg1", Check::Failed),
            node("pg2", replica(100, false)),
            node("pg3", Check::Failed),
            node("pg4", Check::Failed),
        ];
        let refusals = plan(&nodes, 1, &[]).unwrap_err();
        assert_eq!(refusals[0].0, Some("confirmed"), "{refusals:?}");
    }
}
