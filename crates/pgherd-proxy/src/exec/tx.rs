//! The client's transaction over the shards. pgherd begins it on a shard when a statement
//! first needs that shard (with the client's own `BEGIN` text, then the settings the
//! transaction made so far), keeps each shard's link for the rest of it, and ends it on all of
//! them at once ([`super::commit`]): `COMMIT` commits on every shard that wrote or on none.

use std::collections::{BTreeMap, BTreeSet};

use bytes::BytesMut;
use pgherd_route::shard_route::TxCommand;
use pgherd_route::tx_log::{Mark, NoSuchSavepoint, TxLog};
use pgherd_route::{Decision, TxEffect};
use pgherd_wire::backend::{self, TxStatus};
use pgherd_wire::{PgError, Severity, SqlState};

use super::commit::Ending;
use super::link::{encode_message, Link};
use super::{encode_error, Failed, ShardedSession};

pub struct Tx {
    /// What begins it on each shard: the client's `BEGIN` (isolation level and all).
    begin_sql: String,
    /// The shards it reached, each with its link inside the server's transaction.
    pub links: BTreeMap<u32, Link>,
    /// The shards it may have written on (or changed the schema of).
    pub wrote: BTreeSet<u32>,
    /// The settings it made and the savepoints it set, for the shards it reaches later.
    pub log: TxLog,
    /// A statement failed: until it ends (or rolls back to a savepoint), the transaction is
    /// aborted.
    pub failed: bool,
    /// Why its shards may no longer agree on its savepoints (a shard's part ended with its
    /// connection, or a savepoint command ran on some shards only): no `ROLLBACK TO` then.
    pub diverged: Option<String>,
    /// READ ONLY: no shard writes, so none takes part in a two-phase commit.
    pub read_only: bool,
    /// It changed the schema (which pgherd's catalog reads only once it commits).
    pub changed_schema: bool,
    /// The shard it was begun on first: its start time is the transaction's.
    pub first_shard: Option<u32>,
    /// The implicit transaction of several extended-protocol statements before a Sync, which
    /// ends at the Sync; the client's own BEGIN makes it an ordinary transaction block.
    pub implicit: bool,
}

impl Tx {
    pub fn new(begin_sql: &str, read_only: bool) -> Tx {
        Tx {
            begin_sql: begin_sql.to_owned(),
            links: BTreeMap::new(),
            wrote: BTreeSet::new(),
            log: TxLog::default(),
            failed: false,
            diverged: None,
            read_only,
            changed_schema: false,
            first_shard: None,
            implicit: false,
        }
    }

    /// The implicit transaction of several statements sent together (a query string, or
    /// extended-protocol messages before a Sync).
    pub fn implicit(read_only: bool) -> Tx {
        Tx {
            implicit: true,
            ..Tx::new("BEGIN", read_only)
        }
    }
}

impl ShardedSession {
    /// What `ReadyForQuery` says of the session.
    pub(super) fn tx_status(&self) -> TxStatus {
        match &self.tx {
            None => TxStatus::Idle,
            Some(tx) if tx.failed => TxStatus::Failed,
            Some(_) => TxStatus::InTransaction,
        }
    }

    /// BEGIN, COMMIT, ROLLBACK or a savepoint from the client, answered as PostgreSQL
    /// answers them.
    pub(super) async fn transaction(
        &mut self,
        command: TxCommand,
        decision: &Decision,
        sql: &str,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let tag = match command {
            TxCommand::Begin {
                start,
                with_options,
            } => {
                let read_only = match decision.tx {
                    TxEffect::Begin {
                        read_only: Some(read_only),
                    } => read_only,
                    _ => self.params.flags.default_transaction_read_only,
                };
                match &mut self.tx {
                    // Begun on no shard yet: begun as the client asks.
                    Some(tx) if tx.implicit && tx.links.is_empty() => {
                        self.tx = Some(Tx::new(sql, read_only));
                    }
                    Some(tx) if tx.implicit => {
                        if with_options {
                            // Its shards began without them; PostgreSQL would apply or refuse
                            // them there.
                            return Err(Failed::Statement(PgError::error(
                                SqlState::FEATURE_NOT_SUPPORTED,
                                "not supported on sharded tables: BEGIN with options after other statements of the same query string or extended-protocol batch",
                            )));
                        }
                        tx.implicit = false
                    }
                    Some(_) => warn(
                        out,
                        SqlState::ACTIVE_SQL_TRANSACTION,
                        "there is already a transaction in progress",
                    ),
                    None => self.tx = Some(Tx::new(sql, read_only)),
                }
                if start {
                    "START TRANSACTION"
                } else {
                    "BEGIN"
                }
            }
            TxCommand::Commit | TxCommand::Rollback => {
                let Some((failed, implicit)) = self.tx.as_ref().map(|tx| (tx.failed, tx.implicit))
                else {
                    warn(
                        out,
                        SqlState::NO_ACTIVE_SQL_TRANSACTION,
                        "there is no transaction in progress",
                    );
                    let tag = if command == TxCommand::Commit {
                        "COMMIT"
                    } else {
                        "ROLLBACK"
                    };
                    return complete(out, tag);
                };
                if implicit {
                    // As in PostgreSQL: the implicit transaction ends, with a warning.
                    warn(
                        out,
                        SqlState::NO_ACTIVE_SQL_TRANSACTION,
                        "there is no transaction in progress",
                    );
                }
                let commit = command == TxCommand::Commit && !failed;
                self.end_transaction(commit, out).await?;
                if commit {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                }
            }
            TxCommand::Savepoint(name) => self.savepoint(Savepoint::Set, &name, sql, out).await?,
            TxCommand::Release(name) => self.savepoint(Savepoint::Release, &name, sql, out).await?,
            TxCommand::RollbackTo(name) => {
                self.savepoint(Savepoint::RollbackTo, &name, sql, out)
                    .await?
            }
        };
        complete(out, tag)
    }

    /// A savepoint command: run on every shard the block reached and kept in its log, so a
    /// shard it reaches later sets the same savepoints after its `BEGIN` (a `ROLLBACK TO`
    /// then undoes there, too, exactly what was done since). Says the command's tag.
    async fn savepoint(
        &mut self,
        command: Savepoint,
        name: &str,
        sql: &str,
        out: &mut BytesMut,
    ) -> Result<&'static str, Failed> {
        let settings_made = self.params.changes_made();
        let Some(tx) = self.tx.as_mut().filter(|tx| !tx.implicit) else {
            return Err(Failed::Statement(PgError::error(
                SqlState::NO_ACTIVE_SQL_TRANSACTION,
                format!(
                    "{} can only be used in transaction blocks",
                    command.statement()
                ),
            )));
        };
        let unknown = |e: NoSuchSavepoint| {
            Failed::Statement(PgError::error(
                SqlState::INVALID_SAVEPOINT_SPECIFICATION,
                e.to_string(),
            ))
        };
        // The log changes once every shard ran the command.
        let mut log = tx.log.clone();
        let mark = match command {
            Savepoint::Set => None,
            Savepoint::Release => {
                log.release(name).map_err(unknown)?;
                None
            }
            Savepoint::RollbackTo => {
                if let Some(why) = &tx.diverged {
                    return Err(Failed::Statement(PgError::error(
                        SqlState::IN_FAILED_SQL_TRANSACTION,
                        format!("current transaction is aborted, commands ignored until end of transaction block ({why}, which no savepoint brings back)"),
                    )));
                }
                Some(log.rollback_to(name).map_err(unknown)?)
            }
        };
        for (ran_on, (&shard, link)) in tx.links.iter_mut().enumerate() {
            let failed = match link.run_own(sql).await {
                Ok(None) => None,
                Ok(Some(refused)) => Some(refused),
                Err(e) => {
                    tx.diverged = Some(format!(
                        "its part on shard {shard} ended with the connection"
                    ));
                    Some(e)
                }
            };
            if let Some(e) = failed {
                if ran_on > 0 && tx.diverged.is_none() {
                    tx.diverged = Some(format!(
                        "{} ran on some shards only (shard {shard} refused it)",
                        command.statement()
                    ));
                }
                return Err(Failed::Statement(e));
            }
        }
        tx.log = log;
        match (command, mark) {
            (Savepoint::Set, _) => {
                let mark = Mark {
                    read_only: tx.read_only,
                    settings_made,
                };
                tx.log.savepoint(name, sql, mark);
            }
            (Savepoint::RollbackTo, Some(mark)) => {
                tx.failed = false;
                tx.read_only = mark.read_only;
                self.params.undo_changes_after(mark.settings_made);
                // What the rollback restored (a SET since the savepoint), as a server reports it.
                let mut reported = tx.links.values_mut().map(Link::take_reported);
                for message in reported.next().unwrap_or_default() {
                    if let Ok(p) = backend::ParameterStatus::parse(&message.1) {
                        self.params.record_reported(p.name, p.value);
                    }
                    encode_message(out, &message);
                }
                reported.for_each(drop);
            }
            _ => {}
        }
        Ok(command.tag())
    }

    /// Ends the session's transaction on every shard it reached: commits on all of them or
    /// on none (`commit`), or rolls back. Its links go back to their pools.
    pub(super) async fn end_transaction(
        &mut self,
        commit: bool,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let Some(mut tx) = self.tx.take() else {
            return Ok(());
        };
        self.extended.end_transaction();
        let ending = Ending {
            app: &self.app,
            shards: &self.shards,
            database: &self.server_database,
            links: &mut tx.links,
            wrote: &tx.wrote,
        };
        let committing = commit && !tx.failed;
        // A rollback leaves what read-your-writes knows as it was (an earlier write's end may
        // still be unknown).
        if committing {
            tx.wrote.iter().for_each(|&shard| self.reads.wrote(shard));
        }
        let ended = if committing {
            ending.commit().await
        } else {
            ending.rollback().await;
            Ok(Vec::new())
        };
        // A commit that failed may have committed somewhere, and one a shard did not confirm
        // commits there later (recovery finishes it): until a later write's end is known, the
        // shards' reads stay on their primaries.
        if committing && ended.as_ref().is_ok_and(Vec::is_empty) {
            for &shard in &tx.wrote {
                if let (Some(link), Some(cluster)) =
                    (tx.links.get_mut(&shard), self.layout.cluster(shard))
                {
                    self.reads.write_ended(link, cluster).await;
                }
            }
        }
        self.params.end_transaction(commit && ended.is_ok());
        // What the end restored (a SET LOCAL, a SET rolled back), as the servers report it.
        if let Some(link) = tx.links.values_mut().next() {
            for message in link.take_reported() {
                if let Ok(p) = backend::ParameterStatus::parse(&message.1) {
                    self.params.record_reported(p.name, p.value);
                }
                encode_message(out, &message);
            }
        }
        for warning in ended.map_err(Failed::Statement)? {
            if warning.encode_notice(out).is_err() {
                encode_error(out, &warning);
            }
        }
        Ok(())
    }

    /// The transaction's links to `shards`, in shard order, taken out of it for a statement;
    /// a shard it has not reached yet is begun on first. [`Self::give_back`] returns them.
    pub(super) async fn tx_links(&mut self, shards: &[u32]) -> Result<Vec<Link>, PgError> {
        let missing: Vec<u32> = match &self.tx {
            Some(tx) => shards
                .iter()
                .copied()
                .filter(|s| !tx.links.contains_key(s))
                .collect(),
            None => Vec::new(),
        };
        for link in self.open_links(&missing).await? {
            self.join(link).await?;
        }
        let Some(tx) = self.tx.as_mut() else {
            return Ok(Vec::new());
        };
        Ok(shards
            .iter()
            .filter_map(|shard| tx.links.remove(shard))
            .collect())
    }

    /// Begins the transaction on a new link, with the settings it made so far.
    async fn join(&mut self, mut link: Link) -> Result<(), PgError> {
        let Some(tx) = self.tx.as_mut() else {
            return Ok(());
        };
        let shard = link.shard;
        let begin = std::iter::once(tx.begin_sql.as_str()).chain(tx.log.replay());
        for sql in begin {
            if let Some(refused) = link.run_own(sql).await? {
                return Err(refused);
            }
        }
        if tx.log.has_settings() {
            link.close_after_use();
        }
        tx.first_shard.get_or_insert(shard);
        tx.links.insert(shard, link);
        Ok(())
    }

    /// Puts links taken with [`Self::tx_links`] back; `wrote` if the statement may have written
    /// (in a READ ONLY transaction, none can).
    pub(super) fn give_back(&mut self, links: Vec<Link>, wrote: bool) {
        let Some(tx) = self.tx.as_mut() else {
            return;
        };
        for link in links {
            if !link.answered() {
                // Its answer was not read to the end (the statement stopped part-way): the
                // server's part of the transaction ends with the connection, and so does the
                // transaction.
                tx.failed = true;
                tx.diverged = Some(format!(
                    "its part on shard {} ended with the connection",
                    link.shard
                ));
                continue;
            }
            if wrote && !tx.read_only {
                tx.wrote.insert(link.shard);
            }
            tx.links.insert(link.shard, link);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Savepoint {
    Set,
    Release,
    RollbackTo,
}

impl Savepoint {
    /// As PostgreSQL names it in its errors.
    fn statement(self) -> &'static str {
        match self {
            Savepoint::Set => "SAVEPOINT",
            Savepoint::Release => "RELEASE SAVEPOINT",
            Savepoint::RollbackTo => "ROLLBACK TO SAVEPOINT",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Savepoint::Set => "SAVEPOINT",
            Savepoint::Release => "RELEASE",
            Savepoint::RollbackTo => "ROLLBACK",
        }
    }
}

fn warn(out: &mut BytesMut, code: SqlState, message: &str) {
    let _ = PgError::new(Severity::Warning, code, message).encode_notice(out);
}

fn complete(out: &mut BytesMut, tag: &str) -> Result<(), Failed> {
    backend::encode_command_complete(out, tag)
        .map_err(|e| Failed::Statement(PgError::error(SqlState::INTERNAL_ERROR, e.to_string())))
}
