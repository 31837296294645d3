//! When to fail over and to whom, decided without IO.
//!
//! The proxy's health checks produce a [`View`] of the cluster: what every node answered (or
//! that it did not), which node pgherd routes writes to (the *elected* primary), the last WAL
//! position seen on it, and which standbys were synchronous. [`decide`] turns a view into one
//! [`Verdict`]; every verdict reads as a sentence ([`Verdict::sentence`]) that is logged and
//! asserted in tests. The proxy carries verdicts out (pg_promote, re-pointing, fencing).
//!
//! The rules, in the order they are applied:
//! 1. A node that accepts writes but is not the elected primary is fenced first: at most one
//!    node ever gets writes through pgherd ([`ClusterState::writer`]).
//! 2. With no elected primary yet, the single node that accepts writes is elected.
//! 3. The elected primary is down only after `failures_before_down` consecutive failed checks.
//! 4. Split-brain guard: if any replica (fenced ones too) still streams from the primary (not one that
//!    cascades from another replica), pgherd's own path is
//!    the problem and nothing is promoted. Promotion needs a majority of the replicas to answer
//!    pgherd and confirm that they lost the primary too.
//! 5. Candidates: answering replicas with priority above 0; in `async` mode at most
//!    `max_lag_on_failover_bytes` behind the primary's last known position; in `sync` modes
//!    only standbys that were synchronous, and only when enough of them answer that the one
//!    holding the newest acknowledged commit must be among them. The most advanced (received
//!    WAL) wins; ties go to the higher priority, then to the first in the configuration.
//!
//! Architecture invariant: no sockets, no clocks, no global state; the same view always gives
//! the same verdict.

use std::fmt::Write as _;

pub mod agreement;
pub mod control;
pub mod fenced;
pub mod keeper;
pub mod manual;
pub mod observe;
pub mod state;
mod sync;
pub use manual::{plan_promotion, Promotion, Refusal, Safeguard};
pub use state::{Change, ClusterState, Gate, GateReason, NodeId, SyncInForce};
pub use sync::{desired_sync_set, SyncSet};

/// A WAL position as a byte offset.
pub type Lsn = u64;

/// How commits are made durable, which decides who may be promoted (`[replication]
/// durability`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// pgherd leaves `synchronous_standby_names` alone; failover promotes the most advanced
    /// replica within the lag bound.
    Async,
    /// pgherd keeps `synchronous_standby_names = ANY k (streaming standbys)` on the primary and
    /// empties it (commits acknowledged on the primary alone) while no standby streams; only a
    /// synchronous standby may be promoted.
    Sync,
    /// Like `Sync`, but never degrades: with no standby streaming, writes are refused.
    Strict,
}

impl Durability {
    pub fn is_sync(self) -> bool {
        self != Durability::Async
    }

    pub fn parse(s: &str) -> Option<Durability> {
        Some(match s {
            "async" => Durability::Async,
            "sync" => Durability::Sync,
            "strict" => Durability::Strict,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Durability::Async => "async",
            Durability::Sync => "sync",
            Durability::Strict => "strict",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Consecutive failed checks before the primary counts as down.
    pub failures_before_down: u32,
    /// In async mode, a replica further behind the primary's last known position than this is
    /// never promoted (the writes in between would be lost).
    pub max_lag_on_failover_bytes: u64,
    pub durability: Durability,
}

/// What one health check of a node returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// No answer, an error, or too slow.
    Failed,
    /// `pg_is_in_recovery()` is false: the node accepts writes.
    Primary { timeline: u32, lsn: Lsn },
    /// A standby: how far it has received and replayed WAL, and whether its WAL receiver is
    /// streaming and has heard from its upstream recently (`pg_stat_wal_receiver`).
    Replica {
        timeline: u32,
        received_lsn: Lsn,
        replayed_lsn: Lsn,
        upstream_alive: bool,
        /// Its position is final for now: it did not move over the last checks, or only its
        /// replay moved, below a received position that did not. A standby that restarted
        /// reports a received position from before the WAL it holds on disk and replays that
        /// WAL for a while: until it is done, its position understates what it holds.
        settled: bool,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    pub name: String,
    /// 0 = never promoted; otherwise higher wins ties.
    pub priority: u32,
    pub check: Check,
    /// Failed checks in a row, this one included.
    pub consecutive_failures: u32,
    /// pgherd has fenced this node: it gets no traffic until rejoined.
    pub fenced: bool,
    /// The node a replica streams from, when its WAL receiver's sender is a node's address;
    /// `None` when that cannot be told.
    pub upstream: Option<String>,
}

impl NodeView {
    fn answers(&self) -> bool {
        self.check != Check::Failed
    }

    /// A replica whose WAL receiver still hears `primary` (the node of that name): a witness
    /// that it lives. One that streams from another replica (cascading) hears that replica,
    /// not the primary; one whose upstream cannot be told counts as hearing the primary.
    fn hears_primary(&self, primary: Option<&str>) -> bool {
        let streaming = matches!(
            self.check,
            Check::Replica {
                upstream_alive: true,
                ..
            }
        );
        streaming
            && match (self.upstream.as_deref(), primary) {
                (Some(upstream), Some(primary)) => upstream == primary,
                _ => true,
            }
    }

    fn received(&self) -> Option<Lsn> {
        match self.check {
            Check::Replica {
                received_lsn,
                replayed_lsn,
                ..
            } => Some(received_lsn.max(replayed_lsn)),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct View<'a> {
    pub nodes: &'a [NodeView],
    /// The node pgherd sends writes to, by index.
    pub elected: Option<usize>,
    /// The elected primary's WAL position at its last good check.
    pub last_primary_lsn: Option<Lsn>,
    /// Standbys that were in the synchronous set at the primary's last good check.
    pub synchronous: &'a [usize],
    /// `ANY k`: how many synchronous standbys confirm each commit.
    pub sync_quorum: usize,
    /// Where the synchronous set took effect (the primary's WAL position then, or at its
    /// election): commits acknowledged before were confirmed under another set or primary and
    /// lie below it, so in sync modes the standby promoted must have received this far.
    pub sync_since_lsn: Option<Lsn>,
}

impl View<'_> {
    /// In sync modes: with ANY k of n, a commit is on at least k of them, so it is certainly
    /// on one that answers only when at most k - 1 of them do not.
    /// `Err((answering, needed))` otherwise.
    fn sync_quorum_answers(&self) -> Result<(), (usize, usize)> {
        let answering = self
            .synchronous
            .iter()
            .filter(|&&i| self.nodes.get(i).is_some_and(|n| n.answers() && !n.fenced))
            .count();
        let needed = self
            .synchronous
            .len()
            .saturating_sub(self.sync_quorum.max(1))
            + 1;
        if self.synchronous.is_empty() || answering < needed {
            Err((answering, needed))
        } else {
            Ok(())
        }
    }
}

/// Why a replica may not be promoted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    NoAnswer,
    PriorityZero,
    Fenced,
    NotSynchronous,
    TooFarBehind {
        behind_bytes: u64,
    },
    /// A synchronous standby that may not be promoted holds WAL this one lacks, which may
    /// include acknowledged commits.
    MissesAcknowledgedWal {
        behind_bytes: u64,
    },
    /// A synchronous standby that has not received the WAL the primary had when its set
    /// took effect (or when it was elected): commits acknowledged before, under
    /// another set or primary, may be missing (a standby re-pointed after a failover, or
    /// added after `sync` degraded, and still catching up).
    BehindSyncFloor {
        behind_bytes: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The elected primary answers as a primary.
    PrimaryUp,
    /// The elected primary failed checks, not yet enough to call it down.
    Suspect { failures: u32, needed: u32 },
    /// The elected primary answers but as a standby: it was demoted behind pgherd's back.
    PrimaryDemoted,
    /// Replicas still stream from the primary, so only pgherd's path to it failed.
    Guarded { seen_by: Vec<usize> },
    /// Too few replicas answer and confirm the primary is gone for pgherd to be sure.
    NotConfirmed { confirmed: usize, needed: usize },
    /// The primary is down and no replica may take over.
    NoCandidate { rejected: Vec<(usize, Rejection)> },
    /// In sync mode too few synchronous standbys answer: the newest acknowledged commit may be
    /// only on one that does not.
    SyncQuorumLost { answering: usize, needed: usize },
    /// The primary is down but these replicas still replay WAL they hold beyond the position
    /// they report: choosing now could pass over the one holding the newest commits.
    Settling { replicas: Vec<usize> },
    /// Promote `candidate`; `old` is fenced; `followers` are re-pointed to the candidate.
    Promote {
        candidate: usize,
        old: usize,
        followers: Vec<usize>,
    },
    /// No primary was elected yet; this node is the only one accepting writes.
    Elect { node: usize },
    /// Several nodes accept writes and none is elected: pgherd routes no writes.
    Ambiguous { writable: Vec<usize> },
    /// A node accepts writes but is not the elected primary.
    Fence { node: usize },
    /// No node answers as a primary and none is elected.
    NoPrimary,
}

/// The one verdict for this view.
pub fn decide(policy: &Policy, view: &View) -> Verdict {
    let writable: Vec<usize> = (0..view.nodes.len())
        .filter(|&i| matches!(view.nodes[i].check, Check::Primary { .. }))
        .collect();
    if let Some(&node) = writable
        .iter()
        .find(|&&i| Some(i) != view.elected && !view.nodes[i].fenced)
    {
        if view.elected.is_some() {
            return Verdict::Fence { node };
        }
    }
    let Some(elected) = view.elected else {
        let unfenced: Vec<usize> = writable
            .into_iter()
            .filter(|&i| !view.nodes[i].fenced)
            .collect();
        return match unfenced.as_slice() {
            [] => Verdict::NoPrimary,
            [node] => Verdict::Elect { node: *node },
            _ => Verdict::Ambiguous { writable: unfenced },
        };
    };
    let primary = &view.nodes[elected];
    match primary.check {
        Check::Primary { .. } => return Verdict::PrimaryUp,
        Check::Replica { .. } => return Verdict::PrimaryDemoted,
        Check::Failed if primary.consecutive_failures < policy.failures_before_down => {
            return Verdict::Suspect {
                failures: primary.consecutive_failures,
                needed: policy.failures_before_down,
            }
        }
        Check::Failed => {}
    }
    let replicas: Vec<usize> = (0..view.nodes.len())
        .filter(|&i| i != elected && !view.nodes[i].fenced)
        .collect();
    // A fenced replica gets no traffic and is no candidate, but if it still streams from the
    // primary it is as good a witness that the primary lives as any.
    let seen_by: Vec<usize> = (0..view.nodes.len())
        .filter(|&i| i != elected && view.nodes[i].hears_primary(Some(&primary.name)))
        .collect();
    if !seen_by.is_empty() {
        return Verdict::Guarded { seen_by };
    }
    let confirmed = replicas
        .iter()
        .filter(|&&i| view.nodes[i].answers())
        .count();
    let needed = replicas.len() / 2 + 1;
    if confirmed < needed {
        return Verdict::NotConfirmed { confirmed, needed };
    }
    let settling: Vec<usize> = replicas
        .iter()
        .copied()
        .filter(|&i| matches!(view.nodes[i].check, Check::Replica { settled: false, .. }))
        .collect();
    if !settling.is_empty() {
        return Verdict::Settling { replicas: settling };
    }
    if policy.durability.is_sync() {
        if let Err((answering, needed)) = view.sync_quorum_answers() {
            return Verdict::SyncQuorumLost { answering, needed };
        }
    }
    // The newest WAL a synchronous standby has: every acknowledged commit is at or before it.
    let newest_sync = view
        .synchronous
        .iter()
        .filter_map(|&i| view.nodes.get(i).filter(|n| !n.fenced)?.received())
        .max();
    let mut rejected = Vec::new();
    let mut best: Option<(usize, Lsn)> = None;
    for &i in &replicas {
        match eligibility(policy, view, i) {
            Err(why) => rejected.push((i, why)),
            Ok(lsn) => {
                let better = match best {
                    None => true,
                    Some((b, best_lsn)) => {
                        lsn > best_lsn
                            || (lsn == best_lsn && view.nodes[i].priority > view.nodes[b].priority)
                    }
                };
                if better {
                    best = Some((i, lsn));
                }
            }
        }
    }
    if policy.durability.is_sync() {
        // The newest acknowledged commit is on the most advanced synchronous standby; if that
        // one may not be promoted (priority 0), promoting another would lose it.
        if let (Some(newest), Some((best_node, best_lsn))) = (newest_sync, best) {
            if best_lsn < newest {
                rejected.push((
                    best_node,
                    Rejection::MissesAcknowledgedWal {
                        behind_bytes: newest - best_lsn,
                    },
                ));
                return Verdict::NoCandidate { rejected };
            }
        }
    }
    match best {
        None => Verdict::NoCandidate { rejected },
        Some((candidate, candidate_lsn)) => Verdict::Promote {
            candidate,
            old: elected,
            followers: replicas
                .into_iter()
                .filter(|&i| i != candidate && view.nodes[i].answers())
                .filter(|&i| needs_repoint(view, i, Some(elected), candidate_lsn))
                .collect(),
        },
    }
}

/// Whether replica `i` must be re-pointed to the new primary: it streamed from the old one
/// (`old`, when pgherd knows it), or from a node that no longer answers or is fenced, or from
/// where pgherd cannot tell, or it holds WAL beyond the candidate's (the steps then find out
/// whether it must be rewound). One that cascades from another replica that answers, or from
/// the candidate, follows it: the tree of replicas is kept. Failover, `PROMOTE` and switchover
/// all ask this (switchover before the old primary stops, with an LSN no replica exceeds).
pub fn needs_repoint(view: &View, i: usize, old: Option<usize>, candidate_lsn: Lsn) -> bool {
    let node = &view.nodes[i];
    if node.received().is_some_and(|lsn| lsn > candidate_lsn) {
        return true;
    }
    let upstream = node
        .upstream
        .as_deref()
        .and_then(|name| view.nodes.iter().position(|n| n.name == name));
    match upstream {
        None => true,
        Some(u) => {
            let upstream = &view.nodes[u];
            // A primary other than the candidate is one being replaced, known or not.
            Some(u) == old
                || !upstream.answers()
                || upstream.fenced
                || matches!(upstream.check, Check::Primary { .. })
        }
    }
}

/// Whether replica `i` may be promoted, and how far it has received WAL if so. In sync modes
/// only a standby of the synchronous set qualifies, even one behind a replica outside it: the
/// WAL only that replica has was never acknowledged, and the proxy rewinds it afterwards.
fn eligibility(policy: &Policy, view: &View, i: usize) -> Result<Lsn, Rejection> {
    let node = &view.nodes[i];
    let received = node.received().ok_or(Rejection::NoAnswer)?;
    if node.fenced {
        return Err(Rejection::Fenced);
    }
    if node.priority == 0 {
        return Err(Rejection::PriorityZero);
    }
    if policy.durability.is_sync() {
        if !view.synchronous.contains(&i) {
            return Err(Rejection::NotSynchronous);
        }
        // Commits acknowledged before the set took effect lie below where it did.
        if let Some(since) = view.sync_since_lsn.filter(|&since| received < since) {
            return Err(Rejection::BehindSyncFloor {
                behind_bytes: since - received,
            });
        }
    } else if let Some(primary_lsn) = view.last_primary_lsn {
        let behind_bytes = primary_lsn.saturating_sub(received);
        if behind_bytes > policy.max_lag_on_failover_bytes {
            return Err(Rejection::TooFarBehind { behind_bytes });
        }
    }
    Ok(received)
}

impl Verdict {
    /// A sentence for the log and the event list, naming nodes.
    pub fn sentence(&self, view: &View) -> String {
        let name = |i: usize| {
            view.nodes
                .get(i)
                .map(|n| n.name.as_str())
                .unwrap_or("?")
                .to_owned()
        };
        let names = |v: &[usize]| v.iter().map(|&i| name(i)).collect::<Vec<_>>().join(", ");
        let primary = view.elected.map(name).unwrap_or_else(|| "none".into());
        match self {
            Verdict::PrimaryUp => format!("primary {primary} is up"),
            Verdict::Suspect { failures, needed } => format!(
                "primary {primary} failed {failures} check(s) in a row; down after {needed}"
            ),
            Verdict::PrimaryDemoted => format!(
                "primary {primary} answers as a standby; no writes are routed until a primary is elected"
            ),
            Verdict::Guarded { seen_by } => format!(
                "primary {primary} does not answer pgherd but {} still stream(s) from it: not promoting, pgherd's own path to it is the problem",
                names(seen_by)
            ),
            Verdict::NotConfirmed { confirmed, needed } => format!(
                "primary {primary} is down for pgherd but only {confirmed} replica(s) answer of the {needed} needed to confirm it: not promoting"
            ),
            Verdict::NoCandidate { rejected } => {
                let mut s = format!("primary {primary} is down and no replica may be promoted");
                for (i, why) in rejected {
                    let _ = write!(s, "; {}: {}", name(*i), why.reason());
                }
                s
            }
            Verdict::Settling { replicas } => format!(
                "primary {primary} is down; {} still replay(s) WAL beyond the position reported: choosing once positions stop moving",
                names(replicas)
            ),
            Verdict::SyncQuorumLost { answering, needed } => format!(
                "primary {primary} is down but only {answering} synchronous standby(s) answer of the {needed} needed to be sure the newest commit is among them: not promoting"
            ),
            Verdict::Promote {
                candidate,
                old,
                followers,
            } => {
                let lsn = view.nodes[*candidate]
                    .received()
                    .map(format_lsn)
                    .unwrap_or_default();
                let mut s = format!(
                    "primary {} is down and no replica sees it: promoting {} (received up to {lsn}",
                    name(*old),
                    name(*candidate)
                );
                if let Some(primary_lsn) = view.last_primary_lsn {
                    let _ = write!(s, ", primary last seen at {}", format_lsn(primary_lsn));
                }
                let _ = write!(s, "), fencing {}", name(*old));
                if !followers.is_empty() {
                    let _ = write!(s, ", re-pointing {}", names(followers));
                }
                s
            }
            Verdict::Elect { node } => format!("{} accepts writes: elected primary", name(*node)),
            Verdict::Ambiguous { writable } => format!(
                "{} all accept writes and none is elected: routing no writes",
                names(writable)
            ),
            Verdict::Fence { node } => format!(
                "{} accepts writes but {primary} is the elected primary: fencing {}",
                name(*node),
                name(*node)
            ),
            Verdict::NoPrimary => "no node accepts writes".into(),
        }
    }
}

impl Rejection {
    pub fn reason(&self) -> String {
        match self {
            Rejection::NoAnswer => "does not answer".into(),
            Rejection::PriorityZero => "priority 0".into(),
            Rejection::Fenced => "fenced".into(),
            Rejection::NotSynchronous => "was not a synchronous standby".into(),
            Rejection::TooFarBehind { behind_bytes } => {
                format!("{behind_bytes} bytes behind the primary, over max_lag_on_failover_bytes")
            }
            Rejection::BehindSyncFloor { behind_bytes } => format!(
                "{behind_bytes} bytes short of where the primary was when its synchronous set took effect: commits acknowledged before may be missing"
            ),
            Rejection::MissesAcknowledgedWal { behind_bytes } => format!(
                "{behind_bytes} bytes behind a synchronous standby that may not be promoted, which may hold acknowledged commits"
            ),
        }
    }
}

/// PostgreSQL's `X/Y` notation.
pub fn format_lsn(lsn: Lsn) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xFFFF_FFFF)
}

#[cfg(test)]
mod tests;
