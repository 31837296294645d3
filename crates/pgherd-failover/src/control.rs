//! What pgherd does to carry a decision out, as a pure step function: each [`Operation::step`]
//! says which changes to apply to the cluster view, which events to record and which one IO
//! to perform next (cut a node off, re-point a standby, promote, set the synchronous
//! standbys); the caller performs the IO and feeds its [`Outcome`] into the next step. The
//! proxy's failover task, `PROMOTE` and switchover execute the steps against real nodes; the
//! seeded simulation executes the same steps against its model, failures included. Neither
//! has rules of its own for what a verdict means.
//!
//! Architecture invariant: no sockets, no clocks; the same inputs give the same steps.

use crate::keeper::{preset_sync_set, sync_awaited};
use crate::{
    Change, Check, ClusterState, Durability, Lsn, NodeId, SyncInForce, SyncSet, Verdict, View,
};

/// A node as the steps need it beyond what the decision's view says.
#[derive(Debug, Clone, Copy)]
pub struct Member<'a> {
    pub id: NodeId,
    pub name: &'a str,
    /// May be a synchronous standby (node `sync = true`).
    pub may_be_sync: bool,
    /// How far it had received WAL (or replayed, whichever is further) at its last good check.
    pub received_lsn: Lsn,
}

/// What the steps read each time: the cluster view as it is now (the caller applied the
/// previous step's changes), the nodes, and the settings in force.
pub struct Context<'a> {
    pub state: &'a ClusterState,
    pub members: &'a [Member<'a>],
    pub durability: Durability,
    pub sync_standbys: usize,
}

/// One IO the caller performs; node numbers index [`Context::members`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Io {
    /// Stop pgherd's traffic to the node: its idle connections close, sessions using it end.
    /// `newly`: the node was not fenced before this operation, so the fence hook runs.
    CutOff { node: usize, newly: bool },
    /// Make `follower` stream from `primary` (slot there, `primary_conninfo`, reload).
    Repoint { follower: usize, primary: usize },
    /// `pg_promote()`, then check what the node is.
    Promote { node: usize },
    /// `synchronous_standby_names` on `node`, reloaded.
    SetSyncSet { node: usize, set: SyncSet },
}

/// What became of the last [`Io`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// `Promote`: the node answers as a primary now, having received WAL this far.
    Promoted {
        received_lsn: Lsn,
    },
    Failed(String),
}

/// A cluster event to record (`SHOW EVENTS`, the notify hook).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub kind: &'static str,
    pub node: usize,
    pub detail: String,
}

/// What one step asks of the caller, in this order: apply the changes, record the events,
/// perform the IO (none: the operation is over).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Step {
    pub changes: Vec<Change>,
    pub events: Vec<Event>,
    pub io: Option<Io>,
}

/// A decision being carried out.
#[derive(Debug)]
pub struct Operation {
    kind: Kind,
    stage: Stage,
    /// One sentence per thing done, for the operator who asked (`PROMOTE`'s answer).
    report: Vec<String>,
    /// Why it failed, if it did.
    error: Option<String>,
}

#[derive(Debug)]
enum Kind {
    Elect {
        node: usize,
        at_lsn: Lsn,
    },
    Fence {
        node: usize,
    },
    Promote {
        candidate: usize,
        old: Option<usize>,
        followers: Vec<usize>,
        /// Where each follower, and the candidate, had received WAL when this was decided:
        /// a follower beyond the candidate holds WAL the new primary never had.
        followers_received: Vec<Lsn>,
        candidate_received: Lsn,
    },
    /// A node promoted by someone else (a switchover) becomes the elected primary.
    ElectPromoted {
        node: usize,
        received_lsn: Lsn,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stage {
    Start,
    Repoint(usize),
    AwaitRepoint(usize),
    AwaitPromote,
    Preset {
        at_lsn: Lsn,
    },
    AwaitPreset {
        at_lsn: Lsn,
        set: SyncSet,
    },
    Elect {
        at_lsn: Lsn,
        preset: Option<Option<SyncSet>>,
    },
    Diverged(usize),
    Finish,
    Done,
}

impl Operation {
    /// What a failover verdict makes pgherd do; `None` for verdicts that only wait or report.
    pub fn for_verdict(verdict: &Verdict, view: &View, members: &[Member]) -> Option<Operation> {
        let kind = match verdict {
            Verdict::Elect { node } => Kind::Elect {
                node: *node,
                at_lsn: match view.nodes[*node].check {
                    Check::Primary { lsn, .. } => lsn,
                    _ => members[*node].received_lsn,
                },
            },
            Verdict::Fence { node } => Kind::Fence { node: *node },
            Verdict::Promote {
                candidate,
                old,
                followers,
            } => {
                return Some(Operation::promote(
                    *candidate,
                    Some(*old),
                    followers,
                    members,
                ))
            }
            _ => return None,
        };
        Some(Operation::new(kind))
    }

    /// Promotes `candidate` in place of `old` (when pgherd knows the primary it replaces) and
    /// re-points `followers` to it: failover's `Promote` verdict and the operator's `PROMOTE`.
    pub fn promote(
        candidate: usize,
        old: Option<usize>,
        followers: &[usize],
        members: &[Member],
    ) -> Operation {
        Operation::new(Kind::Promote {
            candidate,
            old,
            followers: followers.to_vec(),
            followers_received: followers.iter().map(|&f| members[f].received_lsn).collect(),
            candidate_received: members[candidate].received_lsn,
        })
    }

    /// Makes `node`, which a switchover just promoted, the elected primary, with its
    /// synchronous standbys set first in `sync` and `strict` durability.
    pub fn elect_promoted(node: usize, received_lsn: Lsn) -> Operation {
        Operation::new(Kind::ElectPromoted { node, received_lsn })
    }

    fn new(kind: Kind) -> Operation {
        Operation {
            kind,
            stage: Stage::Start,
            report: Vec::new(),
            error: None,
        }
    }

    /// The next step, given the outcome of the previous step's IO (`None` for the first).
    pub fn step(&mut self, outcome: Option<Outcome>, ctx: &Context) -> Step {
        let mut step = Step::default();
        if let Some(outcome) = outcome {
            self.take_outcome(outcome, ctx, &mut step);
        }
        while step.io.is_none() && self.stage != Stage::Done {
            self.advance(ctx, &mut step);
        }
        step
    }

    /// Over: the next step would ask for nothing.
    pub fn is_done(&self) -> bool {
        self.stage == Stage::Done
    }

    /// What was done, a sentence each, or why the operation failed.
    pub fn finish(self) -> Result<Vec<String>, String> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.report),
        }
    }

    fn take_outcome(&mut self, outcome: Outcome, ctx: &Context, step: &mut Step) {
        let name = |i: usize| ctx.members[i].name;
        match (self.stage.clone(), outcome) {
            (Stage::AwaitRepoint(i), outcome) => {
                let (follower, primary) = (self.followers()[i], self.candidate());
                let (kind, detail) = match outcome {
                    Outcome::Failed(e) => (
                        "repoint_failed",
                        format!("cannot follow {}: {e}", name(primary)),
                    ),
                    _ => ("repointed", format!("follows {} now", name(primary))),
                };
                self.tell(step, kind, follower, detail, ctx);
                self.stage = Stage::Repoint(i + 1);
            }
            (Stage::AwaitPromote, Outcome::Promoted { received_lsn }) => {
                self.stage = Stage::Preset {
                    at_lsn: received_lsn,
                };
            }
            (Stage::AwaitPromote, outcome) => {
                let error = match outcome {
                    Outcome::Failed(e) => e,
                    _ => format!("{} did not say it was promoted", name(self.candidate())),
                };
                step.events.push(Event {
                    kind: "promotion_failed",
                    node: self.candidate(),
                    detail: error.clone(),
                });
                // The fenced old primary stays elected, so writes wait for the next decision.
                step.changes.push(Change::AbandonPromotion);
                self.error = Some(error);
                self.stage = Stage::Done;
            }
            (Stage::AwaitPreset { at_lsn, set }, outcome) => {
                // A set that could not be applied is left to the keeper's next turn: the
                // view then says none is in force, and writes wait for one.
                let preset = (outcome == Outcome::Done).then_some(Some(set));
                self.stage = Stage::Elect { at_lsn, preset };
            }
            // A cut-off cannot fail: it only stops pgherd's own traffic.
            _ => {}
        }
    }

    fn advance(&mut self, ctx: &Context, step: &mut Step) {
        let id = |i: usize| ctx.members[i].id;
        match self.stage.clone() {
            Stage::Start => match &self.kind {
                Kind::Elect { node, at_lsn } => {
                    step.changes.push(Change::Elect {
                        node: id(*node),
                        at_lsn: *at_lsn,
                    });
                    self.stage = Stage::Done;
                }
                Kind::Fence { node } => {
                    let node = *node;
                    self.fence(node, ctx, step);
                    self.stage = Stage::Done;
                }
                Kind::Promote { candidate, old, .. } => {
                    let (candidate, old) = (*candidate, *old);
                    // From here until the candidate takes writes, no node gets them. The old
                    // primary does not answer, so it is only cut off now; the failover loop
                    // makes it read-only when it answers again.
                    step.changes.push(Change::BeginPromotion {
                        candidate: id(candidate),
                    });
                    if let Some(old) = old {
                        self.fence(old, ctx, step);
                        self.report.push(format!(
                            "{} fenced: no more traffic through pgherd",
                            ctx.members[old].name
                        ));
                    }
                    self.stage = Stage::Repoint(0);
                }
                Kind::ElectPromoted { received_lsn, .. } => {
                    self.stage = Stage::Preset {
                        at_lsn: *received_lsn,
                    };
                }
            },
            // The others follow the candidate before it is promoted (cascading until then):
            // a replaced primary that wakes up could otherwise still ship them WAL the
            // candidate never got, and they could not follow it.
            Stage::Repoint(i) if i < self.followers().len() => {
                step.io = Some(Io::Repoint {
                    follower: self.followers()[i],
                    primary: self.candidate(),
                });
                self.stage = Stage::AwaitRepoint(i);
            }
            Stage::Repoint(_) => {
                step.io = Some(Io::Promote {
                    node: self.candidate(),
                });
                self.stage = Stage::AwaitPromote;
            }
            Stage::Preset { at_lsn } => {
                // In `sync` durability the new primary waits for every other unfenced node
                // that may be synchronous before it is elected, in `strict` for every other
                // one that may be synchronous (fenced ones too), so its first commits are not
                // acknowledged on it alone; the keeper narrows the set to the standbys that
                // stream, or refuses writes in `strict` while none does.
                let candidate = self.candidate();
                let others = sync_awaited(
                    ctx.durability,
                    ctx.state,
                    ctx.members,
                    ctx.members[candidate].id,
                    &[],
                );
                match preset_sync_set(ctx.durability, ctx.sync_standbys, &others) {
                    Some(set) => {
                        step.io = Some(Io::SetSyncSet {
                            node: candidate,
                            set: set.clone(),
                        });
                        self.stage = Stage::AwaitPreset { at_lsn, set };
                    }
                    None => {
                        self.stage = Stage::Elect {
                            at_lsn,
                            preset: Some(None),
                        }
                    }
                }
            }
            Stage::Elect { at_lsn, preset } => {
                let candidate = id(self.candidate());
                step.changes.push(Change::Elect {
                    node: candidate,
                    at_lsn,
                });
                if let Some(preset) = preset {
                    // Its standbys confirm commits from here on; those acknowledged before (by
                    // the old primary) they hold only once they have received this far.
                    step.changes.push(Change::SyncInForce(
                        preset.map(|set| SyncInForce::from(candidate, set, None, at_lsn)),
                    ));
                }
                self.stage = match self.kind {
                    Kind::Promote { .. } => Stage::Diverged(0),
                    _ => Stage::Done,
                };
            }
            Stage::Diverged(i) => {
                let Kind::Promote {
                    followers,
                    followers_received,
                    candidate,
                    candidate_received,
                    ..
                } = &self.kind
                else {
                    self.stage = Stage::Done;
                    return;
                };
                let Some(&follower) = followers.get(i) else {
                    self.stage = Stage::Finish;
                    return;
                };
                self.stage = Stage::Diverged(i + 1);
                let had = followers_received[i];
                if had <= *candidate_received {
                    return;
                }
                // A follower with WAL the new primary never had cannot follow it until it is
                // rewound, and that WAL was never acknowledged: it must not be read. Fenced,
                // it is sealed and (with auto_rejoin) rewound like any fenced node.
                let detail = format!(
                    "had WAL up to {} beyond where {} was promoted ({}): it cannot follow until it rejoins",
                    crate::format_lsn(had),
                    ctx.members[*candidate].name,
                    crate::format_lsn(*candidate_received)
                );
                self.tell(step, "diverged", follower, detail, ctx);
                self.fence(follower, ctx, step);
            }
            Stage::Finish => {
                let candidate = self.candidate();
                let detail = "promoted; writes go to it now".to_owned();
                self.tell(step, "promoted", candidate, detail, ctx);
                self.stage = Stage::Done;
            }
            Stage::AwaitRepoint(_)
            | Stage::AwaitPromote
            | Stage::AwaitPreset { .. }
            | Stage::Done => self.stage = Stage::Done,
        }
    }

    /// An event about `node`, and the same words in the operator's report.
    fn tell(
        &mut self,
        step: &mut Step,
        kind: &'static str,
        node: usize,
        detail: String,
        ctx: &Context,
    ) {
        self.report
            .push(format!("{} {detail}", ctx.members[node].name));
        step.events.push(Event { kind, node, detail });
    }

    /// Fences `node` in the view and cuts it off; the first fencing is an event.
    fn fence(&self, node: usize, ctx: &Context, step: &mut Step) {
        let id = ctx.members[node].id;
        let newly = !ctx.state.is_fenced(id);
        step.changes.push(Change::Fence(id));
        if newly {
            step.events.push(Event {
                kind: "fenced",
                node,
                detail: "no more traffic through pgherd".to_owned(),
            });
        }
        step.io = Some(Io::CutOff { node, newly });
    }

    fn candidate(&self) -> usize {
        match &self.kind {
            Kind::Promote { candidate, .. } => *candidate,
            Kind::ElectPromoted { node, .. } | Kind::Elect { node, .. } | Kind::Fence { node } => {
                *node
            }
        }
    }

    fn followers(&self) -> &[usize] {
        match &self.kind {
            Kind::Promote { followers, .. } => followers,
            _ => &[],
        }
    }
}

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
