//! How a transaction over several shards ends, decided without IO: which shards commit in one
//! phase, which prepare, where the decision is made durable, and what recovery does with a
//! transaction left prepared (the proxy's `exec/commit.rs` and `two_phase_recovery.rs` carry
//! these out).
//!
//! The decision is the commit of one participant, the *decider* (the lowest shard that wrote).
//! Its transaction inserts the decision row ([`DECISIONS_TABLE`], the transaction's gid as
//! primary key) before any other shard prepares, and commits once they all have: the commit
//! record of the decider is the commit record of the whole transaction, kept as durably as
//! that shard keeps any commit (synchronous standbys, failover; `synchronous_commit` is raised
//! to `on` for it), and readable by any pgherd. The row is inserted through
//! `pgherd.decide()`, which names the gid after the inserting transaction's own id: a session
//! connected to the shard cannot write the decision of anyone else's transaction.
//!
//! Recovery of a transaction left prepared inserts an abort row under the same gid. The primary
//! key makes that insert wait for a decider still running, then either meet the committed row
//! (commit everywhere) or make the abort final: a decider can never commit after recovery chose
//! to roll back, because its own insert would then conflict. No clock is involved in the
//! verdict.

use std::collections::HashSet;
use std::fmt;

/// The table holding decisions, on every shard that decides (created by pgherd).
pub const DECISIONS_TABLE: &str = "pgherd.decisions";

/// Makes the decisions table and the function clients record decisions with. Run by pgherd's
/// own user, who owns both; clients may only call the function, which records the decision of
/// the calling transaction and no other.
pub const DECISIONS_DDL: &str = "CREATE SCHEMA IF NOT EXISTS pgherd; \
     CREATE TABLE IF NOT EXISTS pgherd.decisions (\
     gid text PRIMARY KEY, committed boolean NOT NULL, decided_at timestamptz NOT NULL DEFAULT now()); \
     REVOKE ALL ON pgherd.decisions FROM PUBLIC; \
     CREATE OR REPLACE FUNCTION pgherd.decide(decider integer, instance text, sequence bigint) \
     RETURNS text LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog AS $$ \
     INSERT INTO pgherd.decisions (gid, committed) \
     VALUES (format('pgherd_%s_%s_%s_%s', decider, instance, sequence, txid_current()), true) \
     RETURNING gid $$; \
     GRANT USAGE ON SCHEMA pgherd TO PUBLIC";

/// A shard a transaction ran statements on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Participant {
    pub shard: u32,
    /// It ran a statement that may write (or change the schema).
    pub wrote: bool,
}

/// How a `COMMIT` over the participants is carried out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitPlan {
    /// No shard ran anything: the commit needs no server.
    Nothing,
    /// At most one shard wrote. The readers commit first, so that one failing (a
    /// serialization failure) still leaves the writer to roll back; then the writer.
    OnePhase {
        readers: Vec<u32>,
        writer: Option<u32>,
    },
    /// Several shards wrote: the readers commit first as above, `prepared` prepare, and the
    /// commit of `decider` (with its decision row) decides.
    TwoPhase {
        readers: Vec<u32>,
        decider: u32,
        prepared: Vec<u32>,
    },
}

pub fn plan_commit(participants: &[Participant]) -> CommitPlan {
    if participants.is_empty() {
        return CommitPlan::Nothing;
    }
    let shards = |wrote: bool| {
        let mut s: Vec<u32> = participants
            .iter()
            .filter(|p| p.wrote == wrote)
            .map(|p| p.shard)
            .collect();
        s.sort_unstable();
        s.dedup();
        s
    };
    let readers = shards(false);
    let writers = shards(true);
    match writers.split_first() {
        None => CommitPlan::OnePhase {
            readers,
            writer: None,
        },
        Some((&writer, [])) => CommitPlan::OnePhase {
            readers,
            writer: Some(writer),
        },
        Some((&decider, rest)) => CommitPlan::TwoPhase {
            readers,
            decider,
            prepared: rest.to_vec(),
        },
    }
}

/// A two-phase transaction's global identifier:
/// `pgherd_<decider>_<instance>_<sequence>_<decider's transaction id>`, where `instance` is a
/// random number drawn when pgherd starts. The decider's shard in it tells recovery where the
/// decision is; the transaction id ties the decision row to the transaction that wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gid {
    pub decider: u32,
    pub instance: u64,
    pub sequence: u64,
    pub xid: u64,
}

/// What every gid pgherd makes starts with (a `LIKE` pattern for it escapes the `_`).
pub const GID_PREFIX: &str = "pgherd_";

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{GID_PREFIX}{}_{:016x}_{}_{}",
            self.decider, self.instance, self.sequence, self.xid
        )
    }
}

/// The decider's statement, run in the client's transaction on the decider: its commit made
/// durable whatever the session's `synchronous_commit`, and the decision row inserted; it
/// answers the gid (see [`Gid::decided`]).
pub fn decide_sql(decider: u32, instance: u64, sequence: u64) -> String {
    format!(
        "SELECT set_config('synchronous_commit', CASE WHEN current_setting('synchronous_commit') \
         IN ('off', 'local') THEN 'on' ELSE current_setting('synchronous_commit') END, true); \
         SELECT pgherd.decide({decider}, '{instance:016x}', {sequence})"
    )
}

impl Gid {
    /// A gid pgherd made, or `None` (someone else's prepared transaction: never touched).
    pub fn parse(text: &str) -> Option<Gid> {
        let mut parts = text.strip_prefix(GID_PREFIX)?.split('_');
        let decider = parts.next()?.parse().ok()?;
        let instance = parts.next().filter(|s| s.len() == 16)?;
        let instance = u64::from_str_radix(instance, 16).ok()?;
        let sequence = parts.next()?.parse().ok()?;
        let xid = parts.next()?.parse().ok()?;
        if parts.next().is_some() {
            return None;
        }
        Some(Gid {
            decider,
            instance,
            sequence,
            xid,
        })
    }

    /// The gid `pgherd.decide()` answered for the [`decide_sql`] of these values, or `None`
    /// if the answer is not that.
    pub fn decided(answer: &str, decider: u32, instance: u64, sequence: u64) -> Option<Gid> {
        Gid::parse(answer).filter(|gid| {
            (gid.decider, gid.instance, gid.sequence) == (decider, instance, sequence)
        })
    }

    pub fn prepare_sql(&self) -> String {
        format!("PREPARE TRANSACTION '{self}'")
    }

    pub fn finish_sql(&self, resolution: Resolution) -> String {
        match resolution {
            Resolution::Commit => format!("COMMIT PREPARED '{self}'"),
            Resolution::Rollback => format!("ROLLBACK PREPARED '{self}'"),
        }
    }

    /// Recovery's question to the decider (as pgherd's user): the abort row is inserted
    /// unless a decision is there (waiting for a decider still running), then the decision is
    /// read.
    pub fn recovery_sql(&self) -> String {
        format!(
            "INSERT INTO {DECISIONS_TABLE} (gid, committed) VALUES ('{self}', false) \
             ON CONFLICT (gid) DO NOTHING; \
             SELECT committed FROM {DECISIONS_TABLE} WHERE gid = '{self}'"
        )
    }
}

/// How a participant answered a statement of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Done,
    /// The server answered with an error: the statement did not take effect.
    Refused,
    /// The connection failed before the answer: it may or may not have taken effect.
    Lost,
}

/// What follows the prepares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AfterPrepare {
    /// Every participant prepared: the decider commits.
    Decide,
    /// One did not: the decider rolls back (so the decision is abort), the prepared ones are
    /// rolled back now, and those whose answer was lost are left to recovery, which finds the
    /// decision absent and rolls them back.
    Abort {
        rollback_prepared: Vec<u32>,
        left_to_recovery: Vec<u32>,
    },
}

pub fn after_prepares(replies: &[(u32, Reply)]) -> AfterPrepare {
    if replies.iter().all(|(_, r)| *r == Reply::Done) {
        return AfterPrepare::Decide;
    }
    let with = |want: Reply| {
        replies
            .iter()
            .filter(|(_, r)| *r == want)
            .map(|(s, _)| *s)
            .collect()
    };
    AfterPrepare::Abort {
        rollback_prepared: with(Reply::Done),
        left_to_recovery: with(Reply::Lost),
    }
}

/// The transaction's fate, from the decider's answer to its `COMMIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Committed: the prepared participants commit (recovery finishes any that cannot now).
    Committed,
    /// The decider refused to commit (a deferred constraint, a serialization failure): the
    /// prepared participants roll back.
    Aborted,
    /// The answer was lost: only the decider's data knows. The client is told the outcome is
    /// unknown; recovery finishes every participant the way the decider went.
    Unknown,
}

pub fn verdict(decider_commit: Reply) -> Verdict {
    match decider_commit {
        Reply::Done => Verdict::Committed,
        Reply::Refused => Verdict::Aborted,
        Reply::Lost => Verdict::Unknown,
    }
}

/// How a prepared participant is finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Commit,
    Rollback,
}

/// Recovery's verdict from the decision row read after its abort insert.
pub fn resolve(decision_committed: bool) -> Resolution {
    if decision_committed {
        Resolution::Commit
    } else {
        Resolution::Rollback
    }
}

/// Decision rows no participant needs any more: their transaction is prepared nowhere.
/// `prepared` must be listed after `decisions` were read (a decision row visible then was
/// committed after all its participants prepared, so if none is prepared now, all finished).
pub fn removable_decisions(decisions: &[String], prepared: &HashSet<String>) -> Vec<String> {
    decisions
        .iter()
        .filter(|gid| !prepared.contains(*gid))
        .cloned()
        .collect()
}

#[cfg(test)]
#[path = "two_phase_tests.rs"]
mod tests;
