//! What the client's transaction does to its session settings, followed from the command tags
//! the server sends and the texts of the statements that may change settings: the changes a
//! transaction made count once it commits (`SessionParams`), a `ROLLBACK TO SAVEPOINT` undoes
//! those made since that savepoint (and keeps the earlier ones, even after an error), a
//! `ROLLBACK` all of them. A query string of several statements gets one tag per statement,
//! in order: each tag is matched to its own statement's text.

use std::ops::Range;

use bytes::Bytes;
use pgherd_route::parse::split_query;
use pgherd_route::shard_route::{tx_command_of, TxCommand};
use pgherd_route::tx_log::{Mark, TxLog};

use pgherd_wire::frontend;

use super::params::session_changes;
use super::queue::Request;
use super::Session;

/// Kept per client once it sent a statement that may change settings (boxed: most clients
/// never do, and an idle client should stay small).
#[derive(Default)]
pub(super) struct TxSettings {
    savepoints: TxLog,
    script: Option<Script>,
}

/// The statements of the request whose tags are arriving, and which tag comes next.
struct Script {
    sql: Bytes,
    statements: Vec<Range<usize>>,
    next: usize,
}

impl TxSettings {
    /// The text of the statement the next tag of the request `sql` ends.
    fn next_statement(&mut self, sql: &Bytes) -> Option<&str> {
        let fresh = self
            .script
            .as_ref()
            .is_none_or(|s| s.sql.as_ptr() != sql.as_ptr() || s.sql.len() != sql.len());
        if fresh {
            self.script = Some(Script {
                sql: sql.clone(),
                statements: statement_ranges(sql),
                next: 0,
            });
        }
        let script = self.script.as_mut()?;
        // One statement (an Execute of a portal, maybe again): every tag is its own.
        let at = if script.statements.len() == 1 {
            0
        } else {
            script.next
        };
        script.next += 1;
        let range = script.statements.get(at)?.clone();
        std::str::from_utf8(script.sql.get(range)?).ok()
    }
}

/// Where each statement of `sql` is; the whole text as one if it cannot be split.
fn statement_ranges(sql: &[u8]) -> Vec<Range<usize>> {
    let whole = std::iter::once(0..sql.len()).collect();
    let Ok(text) = std::str::from_utf8(sql) else {
        return whole;
    };
    match split_query(text) {
        Ok(pieces) if !pieces.is_empty() => pieces
            .iter()
            .map(|piece| {
                let start = piece.as_ptr() as usize - text.as_ptr() as usize;
                start..start + piece.len()
            })
            .collect(),
        _ => whole,
    }
}

impl Session {
    /// A statement of the client's ended with `tag`; `sql`: its request's text, kept when it
    /// may change settings.
    pub(super) fn follow_settings(&mut self, tag: &[u8], sql: Option<&Bytes>) {
        let word = tag.split(|&b| b == b' ').next().unwrap_or_default();
        let follows = matches!(
            word,
            b"SET" | b"RESET" | b"DISCARD" | b"SAVEPOINT" | b"RELEASE" | b"ROLLBACK" | b"COMMIT"
        );
        let statement = match sql {
            Some(sql) => {
                // Every tag of the request moves the cursor, whether it is followed or not.
                let tracked = self.tx_settings.get_or_insert_with(Box::default);
                let statement = tracked.next_statement(sql);
                if !follows {
                    return;
                }
                statement.map(str::to_owned)
            }
            None if follows => None,
            None => return,
        };
        match word {
            b"SET" | b"RESET" | b"DISCARD" => {
                if tag.starts_with(b"DISCARD") && tag != b"DISCARD ALL" {
                    return;
                }
                match statement.as_deref().and_then(session_changes) {
                    Some(changes) => {
                        let restore = self.params.startup_values_reset_by(&changes).join("; ");
                        self.params.record(changes);
                        if !restore.is_empty() {
                            self.restore_startup_values(&restore);
                        }
                    }
                    None => {
                        tracing::debug!(client = self.shared.id, "a session change pgherd cannot replay; the server will be reset before its next client");
                        self.untracked_change = true;
                    }
                }
            }
            b"SAVEPOINT" | b"RELEASE" | b"ROLLBACK" => {
                let command = statement.as_deref().map(tx_command_of);
                let made = self.params.changes_made();
                let savepoints = &mut self.tx_settings.get_or_insert_with(Box::default).savepoints;
                let followed = match command {
                    Some(Some(TxCommand::Savepoint(name))) => {
                        let mark = Mark {
                            read_only: false,
                            settings_made: made,
                        };
                        savepoints.savepoint(&name, "", mark);
                        true
                    }
                    Some(Some(TxCommand::Release(name))) => savepoints.release(&name).is_ok(),
                    Some(Some(TxCommand::RollbackTo(name))) => {
                        // The transaction runs on, without what was done since.
                        let mark = savepoints.rollback_to(&name);
                        if let Ok(mark) = &mark {
                            self.params.undo_changes_after(mark.settings_made);
                        }
                        self.tx_failed = false;
                        mark.is_ok()
                    }
                    // A ROLLBACK (or a COMMIT of a failed transaction) ended the transaction.
                    Some(Some(TxCommand::Rollback | TxCommand::Commit)) if tag == b"ROLLBACK" => {
                        *savepoints = TxLog::default();
                        self.params.end_transaction(false);
                        self.tx_failed = false;
                        true
                    }
                    // Which statement it was is not known (a named portal's), or the tag is
                    // not its statement's: whether a ROLLBACK ended the transaction or went
                    // back to a savepoint cannot be told, so the settings are left as they
                    // were, and the server is reset before it serves another client.
                    _ => false,
                };
                if !followed {
                    tracing::debug!(client = self.shared.id, "a savepoint command pgherd cannot follow; the server will be reset before its next client");
                    self.untracked_change = true;
                    if tag == b"ROLLBACK" {
                        // As if it ended the transaction: its changes are not kept.
                        self.tx_failed = true;
                    }
                }
            }
            _ if tag == b"COMMIT" => {
                // Committed here, whatever follows in the same query string.
                self.params.end_transaction(true);
                self.tx_failed = false;
                if let Some(tracked) = self.tx_settings.as_mut() {
                    tracked.savepoints = TxLog::default();
                }
            }
            _ => {}
        }
    }

    /// The client reset settings its startup packet gave: the server went back to its own
    /// startup values, so the client's are set again right behind the statement (in its
    /// transaction, if it is in one: a rollback undoes both). Should anything differ all the
    /// same (the reset was rolled back with a later statement of the same query string),
    /// the server is also reset and the client's settings replayed before its next
    /// transaction.
    fn restore_startup_values(&mut self, statements: &str) {
        self.untracked_change = true;
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        if frontend::encode_query(&mut lease.conn.write_buf, statements.as_bytes()).is_ok() {
            self.queue.push_internal(Request::Restore);
        }
    }

    /// The client's request was answered to its ReadyForQuery: the next tag is another
    /// request's; outside a transaction no savepoint is left.
    pub(super) fn settings_request_done(&mut self, status: pgherd_wire::backend::TxStatus) {
        if let Some(tracked) = self.tx_settings.as_mut() {
            tracked.script = None;
            if status == pgherd_wire::backend::TxStatus::Idle {
                tracked.savepoints = TxLog::default();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_tag_of_a_query_string_finds_its_own_statement() {
        let sql = Bytes::from_static(b"BEGIN; SET work_mem = '6MB'; SAVEPOINT s; ROLLBACK TO s");
        let mut tracked = TxSettings::default();
        let seen: Vec<String> = (0..5)
            .map_while(|_| tracked.next_statement(&sql).map(str::to_owned))
            .collect();
        assert_eq!(
            seen,
            [
                "BEGIN",
                " SET work_mem = '6MB'",
                " SAVEPOINT s",
                " ROLLBACK TO s"
            ]
        );
        // One statement: every tag is its own (a portal executed again).
        let one = Bytes::from_static(b"SET work_mem = '6MB'");
        assert_eq!(tracked.next_statement(&one), Some("SET work_mem = '6MB'"));
        assert_eq!(tracked.next_statement(&one), Some("SET work_mem = '6MB'"));
    }
}
