//! The end of a client's transaction over the shards, as `pgherd_route::two_phase` plans it:
//! one shard commits on its own; several that wrote commit with two-phase commit, the
//! decider's commit (with its decision row) deciding. What this shell cannot finish (a lost
//! connection after the decision) `two_phase_recovery` finishes the way the decision went.

use std::collections::{BTreeMap, BTreeSet};

use futures_util::future::join_all;
use pgherd_route::two_phase::{
    after_prepares, decide_sql, plan_commit, verdict, AfterPrepare, CommitPlan, Gid, Participant,
    Reply, Resolution, Verdict,
};
use pgherd_wire::{PgError, Severity, SqlState};

use super::each::with_detail;
use super::link::Link;
use crate::app::App;
use crate::failpoint;
use crate::shards::Shards;

/// The shards' links of one transaction and which of them wrote.
pub struct Ending<'a> {
    pub app: &'a App,
    pub shards: &'a Shards,
    /// The server database the links are connected to.
    pub database: &'a str,
    pub links: &'a mut BTreeMap<u32, Link>,
    pub wrote: &'a BTreeSet<u32>,
}

impl Ending<'_> {
    /// Commits on every shard or on none. `Ok` carries warnings for the client (a shard that
    /// did not confirm its part of a commit already decided).
    pub async fn commit(mut self) -> Result<Vec<PgError>, PgError> {
        if let Some(shard) = self.replaced_primary() {
            rollback_all(self.links).await;
            return Err(PgError::error(
                SqlState::TRANSACTION_ROLLBACK,
                format!("shard {shard}'s primary was replaced while this transaction wrote there: it was rolled back on every shard"),
            )
            .with_hint("run the transaction again: it reaches the new primary"));
        }
        let participants: Vec<Participant> = self
            .links
            .keys()
            .map(|&shard| Participant {
                shard,
                wrote: self.wrote.contains(&shard),
            })
            .collect();
        match plan_commit(&participants) {
            CommitPlan::Nothing => Ok(Vec::new()),
            CommitPlan::OnePhase { readers, writer } => {
                self.commit_readers(&readers).await?;
                if let Some(writer) = writer {
                    self.commit_one(writer).await?;
                }
                Ok(Vec::new())
            }
            CommitPlan::TwoPhase {
                readers,
                decider,
                prepared,
            } => {
                self.commit_readers(&readers).await?;
                self.two_phase(decider, &prepared).await
            }
        }
    }

    /// A shard written to on a node failover has fenced since: what was written there must not
    /// commit (failover may have promoted a standby that never got it). A fenced node that
    /// still answers is made read-only soon after; this closes the moment in between.
    fn replaced_primary(&self) -> Option<u32> {
        self.links.iter().find_map(|(&shard, link)| {
            let fenced = self.wrote.contains(&shard)
                && self
                    .shards
                    .cluster(shard)
                    .is_some_and(|c| c.view().is_fenced(link.node_id()));
            fenced.then_some(shard)
        })
    }

    /// Rolls back on every shard (answers are not awaited beyond each link's own).
    pub async fn rollback(self) {
        rollback_all(self.links).await;
    }

    /// Readers commit first: one refusing (a serialization failure) rolls back the rest.
    async fn commit_readers(&mut self, readers: &[u32]) -> Result<(), PgError> {
        for shard in readers {
            let Some(link) = self.links.get_mut(shard) else {
                continue;
            };
            match link.run_expecting("COMMIT", "COMMIT").await {
                Ok(None) => {}
                Ok(Some(refused)) => {
                    self.links.remove(shard);
                    rollback_all(self.links).await;
                    return Err(refused);
                }
                // It wrote nothing: its end does not change what the others commit.
                Err(lost) => {
                    tracing::warn!(shard, error = %lost.message, "a shard read from in the transaction was lost at its commit");
                }
            }
        }
        Ok(())
    }

    async fn commit_one(&mut self, shard: u32) -> Result<(), PgError> {
        let Some(link) = self.links.get_mut(&shard) else {
            return Ok(());
        };
        match link.run_expecting("COMMIT", "COMMIT").await {
            Ok(None) => Ok(()),
            Ok(Some(refused)) => Err(refused),
            Err(lost) => Err(outcome_unknown(shard, &lost)),
        }
    }

    async fn two_phase(mut self, decider: u32, prepared: &[u32]) -> Result<Vec<PgError>, PgError> {
        if let Err(e) = self.make_decision_table(decider).await {
            rollback_all(self.links).await;
            return Err(e);
        }
        let gid = match self.decide(decider).await {
            Ok(gid) => gid,
            Err(e) => {
                rollback_all(self.links).await;
                return Err(e);
            }
        };
        let replies = self
            .on_each(prepared, &gid.prepare_sql(), Some("PREPARE TRANSACTION"))
            .await;
        let first_failure = replies.iter().find_map(|(shard, r)| match r {
            Ok(Some(e)) | Err(e) => Some((*shard, e.clone())),
            Ok(None) => None,
        });
        let outcomes: Vec<(u32, Reply)> = replies
            .iter()
            .map(|(shard, r)| (*shard, reply(r)))
            .collect();
        if let AfterPrepare::Abort {
            rollback_prepared,
            left_to_recovery,
        } = after_prepares(&outcomes)
        {
            if let Some(link) = self.links.get_mut(&decider) {
                let _ = link.run_own("ROLLBACK").await;
            }
            self.on_each(
                &rollback_prepared,
                &gid.finish_sql(Resolution::Rollback),
                None,
            )
            .await;
            let (shard, error) = first_failure.unwrap_or((decider, internal(decider)));
            let mut detail = format!(
                "shard {shard} could not prepare the transaction; it was rolled back on every shard"
            );
            if !left_to_recovery.is_empty() {
                detail.push_str(&format!(
                    " (shards {left_to_recovery:?} lost their connection: pgherd's recovery rolls them back)"
                ));
            }
            return Err(with_detail(error, detail));
        }
        failpoint::pause_if_armed(failpoint::AFTER_PREPARE).await;
        let Some(decider_link) = self.links.get_mut(&decider) else {
            return Err(internal(decider));
        };
        let decided = decider_link.run_expecting("COMMIT", "COMMIT").await;
        match verdict(reply(&decided)) {
            Verdict::Committed => {}
            Verdict::Aborted => {
                self.on_each(prepared, &gid.finish_sql(Resolution::Rollback), None)
                    .await;
                let refused = decided.ok().flatten().unwrap_or_else(|| internal(decider));
                return Err(with_detail(
                    refused,
                    format!("shard {decider} refused to commit; the transaction was rolled back on every shard"),
                ));
            }
            Verdict::Unknown => {
                let lost = decided.err().unwrap_or_else(|| internal(decider));
                return Err(outcome_unknown(decider, &lost));
            }
        }
        failpoint::pause_if_armed(failpoint::AFTER_DECISION).await;
        let finished = self
            .on_each(prepared, &gid.finish_sql(Resolution::Commit), None)
            .await;
        Ok(unconfirmed(&gid, finished))
    }

    /// The decision row inserted in the decider's transaction, which names the gid.
    async fn decide(&mut self, decider: u32) -> Result<Gid, PgError> {
        let (instance, sequence) = (self.shards.instance, self.shards.next_sequence());
        let link = self
            .links
            .get_mut(&decider)
            .ok_or_else(|| internal(decider))?;
        let answer = link
            .ask_own(&decide_sql(decider, instance, sequence))
            .await?;
        if let Some(refused) = answer.refused {
            return Err(refused);
        }
        answer
            .value
            .as_deref()
            .and_then(|value| Gid::decided(value, decider, instance, sequence))
            .ok_or_else(|| {
                PgError::error(
                    SqlState::PROTOCOL_VIOLATION,
                    format!(
                        "shard {decider} answered {:?} for the transaction's decision",
                        answer.value
                    ),
                )
            })
    }

    /// Runs `sql` on the links of `shards` at once (expecting command tag `tag`, if given).
    async fn on_each(
        &mut self,
        shards: &[u32],
        sql: &str,
        tag: Option<&str>,
    ) -> Vec<(u32, Result<Option<PgError>, PgError>)> {
        let runs = self
            .links
            .iter_mut()
            .filter(|(shard, _)| shards.contains(shard))
            .map(|(&shard, link)| async move {
                let answer = match tag {
                    Some(tag) => link.run_expecting(sql, tag).await,
                    None => link.run_own(sql).await,
                };
                (shard, answer)
            });
        join_all(runs).await
    }

    /// The decisions table on the decider, made once per shard and database by pgherd's own
    /// user (clients may only insert into it).
    async fn make_decision_table(&self, decider: u32) -> Result<(), PgError> {
        if self.shards.has_decision_table(decider, self.database) {
            return Ok(());
        }
        make_decision_table(self.app, self.shards, decider, self.database).await
    }
}

/// Makes the decisions table of `database` on `shard`'s primary (once it is known to exist,
/// not again).
pub async fn make_decision_table(
    app: &App,
    shards: &Shards,
    shard: u32,
    database: &str,
) -> Result<(), PgError> {
    let primary = shards
        .cluster(shard)
        .and_then(|c| c.primary())
        .ok_or_else(|| {
            PgError::error(
                SqlState::CONNECTION_FAILURE,
                format!("no primary is available for shard {shard}"),
            )
        })?;
    let config = app.config();
    let ctx = app.connect_context();
    let ddl = pgherd_route::two_phase::DECISIONS_DDL;
    // Two sessions making it at once: one of them meets the other's schema; once more.
    let mut made =
        crate::node_ops::run_sql_in(&primary, &config.cluster, &ctx, database, ddl).await;
    if made.is_err() {
        made = crate::node_ops::run_sql_in(&primary, &config.cluster, &ctx, database, ddl).await;
    }
    made.map_err(|e| {
        PgError::error(
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("cannot make pgherd's table of commit decisions on shard {shard}: {e}"),
        )
        .with_hint(format!(
            "a transaction writing to several shards needs it: pgherd's user ({}) must be able to create schema pgherd in database {database}",
            config.cluster.user
        ))
    })?;
    shards.decision_table_made(shard, database);
    Ok(())
}

fn reply(answer: &Result<Option<PgError>, PgError>) -> Reply {
    match answer {
        Ok(None) => Reply::Done,
        Ok(Some(_)) => Reply::Refused,
        Err(_) => Reply::Lost,
    }
}

/// Warnings for the shards that did not confirm their `COMMIT PREPARED`: the transaction is
/// committed (the decision is), recovery commits what is left. One that no longer exists was
/// finished by recovery already.
fn unconfirmed(gid: &Gid, finished: Vec<(u32, Result<Option<PgError>, PgError>)>) -> Vec<PgError> {
    finished
        .into_iter()
        .filter_map(|(shard, answer)| {
            let e = match answer {
                Ok(None) => return None,
                Ok(Some(e)) if e.code == SqlState::UNDEFINED_OBJECT => return None,
                Ok(Some(e)) | Err(e) => e,
            };
            tracing::warn!(shard, %gid, error = %e.message, "a committed transaction's part on a shard is not finished yet; recovery finishes it");
            Some(PgError::new(
                Severity::Warning,
                SqlState::SUCCESSFUL_COMPLETION,
                format!("the transaction committed, but shard {shard} has not confirmed its part yet: pgherd's recovery commits it there"),
            ).with_detail(e.message))
        })
        .collect()
}

async fn rollback_all(links: &mut BTreeMap<u32, Link>) {
    join_all(links.values_mut().map(|link| link.run_own("ROLLBACK"))).await;
}

fn outcome_unknown(shard: u32, lost: &PgError) -> PgError {
    PgError::error(
        SqlState::TRANSACTION_RESOLUTION_UNKNOWN,
        format!("the outcome of this commit is unknown: the connection to shard {shard} failed while it committed"),
    )
    .with_detail(lost.message.clone())
    .with_hint(format!("what shard {shard} did decides for every shard (pgherd's recovery finishes the others that way): check the data before retrying"))
}

fn internal(shard: u32) -> PgError {
    PgError::error(
        SqlState::INTERNAL_ERROR,
        format!("the transaction has no connection to shard {shard}"),
    )
}
