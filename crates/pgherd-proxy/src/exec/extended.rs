//! The extended query protocol on a sharded endpoint. pgherd is the client's server here: it
//! keeps the client's prepared statements and portals, answers Parse, Bind and Close itself,
//! and runs each Execute as one statement over the shards, planned with the bound values (a
//! key given as a parameter places the statement as a literal would) and sent to each shard
//! it needs as the unnamed statement and portal (Parse, Bind, Describe, Execute, Sync). A
//! Describe of a statement asks one shard: every shard has the schema.
//!
//! As in PostgreSQL, the messages up to a Sync are one implicit transaction: several Executes
//! before a Sync run in one transaction over the shards, committed at the Sync (rolled back if
//! one failed), so a batch of writes is atomic as on one server. A lone Execute before its
//! Sync (what most drivers send) runs as a simple query would, at no extra cost.
//!
//! A portal read a few rows at a time (Execute with a row limit) runs whole at its first
//! Execute; its rows are handed out as asked, up to [`fan_out::MAX_FAN_OUT_BYTES`] held.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use pgherd_route::shard_plan::BoundParam;
use pgherd_route::shard_route::Execution;
use pgherd_wire::backend::{self, tag as btag};
use pgherd_wire::frontend::{self, tag as ftag, BindValues, Target};
use pgherd_wire::{PgError, SqlState};

use super::fan_out;
use super::link::{encode_message, Bound, Link, Message, Query};
use super::tx::Tx;
use super::{Failed, ShardedSession};

/// The client's prepared statements and portals, and where its message stream stands.
#[derive(Default)]
pub struct Extended {
    statements: HashMap<Bytes, Prepared>,
    portals: HashMap<Bytes, Portal>,
    /// An error ended the messages before the next Sync: they are ignored until it comes.
    pub skip_to_sync: bool,
    /// The portal whose Describe waits for the Execute right after it, whose answer starts
    /// with the description.
    describe_next: Option<Bytes>,
    /// The answer under way is held whole (a portal read a few rows at a time).
    hold_answers: bool,
}

impl Extended {
    pub fn holds_answers(&self) -> bool {
        self.hold_answers
    }

    /// The rows suspended portals hold, together.
    fn held_bytes(&self) -> usize {
        self.portals
            .values()
            .flat_map(|p| p.pending.iter().flatten())
            .map(|m| m.1.len())
            .sum()
    }

    /// Nothing is under way between messages (no portal, no error waiting for its Sync, no
    /// answer held): the session may move to a new pgherd process.
    pub fn is_settled(&self) -> bool {
        self.portals.is_empty()
            && !self.skip_to_sync
            && !self.hold_answers
            && self.describe_next.is_none()
    }

    /// The prepared statements (the unnamed one's name empty), for a session moving to a new
    /// pgherd process.
    pub fn records(&self) -> Vec<crate::handover::StatementRecord> {
        self.statements
            .iter()
            .map(|(name, p)| crate::handover::StatementRecord {
                name: name.to_vec(),
                query: p.sql.as_bytes().to_vec(),
                param_types: p.param_types.to_vec(),
            })
            .collect()
    }

    /// Takes up a moved session's statements; one whose text is not UTF-8 (it could not have
    /// been prepared) is left out.
    pub fn adopt(&mut self, records: &[crate::handover::StatementRecord]) {
        for record in records {
            let Ok(sql) = std::str::from_utf8(&record.query) else {
                continue;
            };
            self.statements.insert(
                Bytes::copy_from_slice(&record.name),
                Prepared {
                    sql: Arc::from(sql),
                    param_types: Bytes::copy_from_slice(&record.param_types),
                    described_types: None,
                },
            );
        }
    }

    /// The portals end with the transaction they ran in.
    pub fn end_transaction(&mut self) {
        self.portals.clear();
    }

    /// `DISCARD ALL`: every prepared statement and portal.
    pub fn forget_all(&mut self) {
        self.statements.clear();
        self.portals.clear();
    }

    /// `DEALLOCATE ALL`: the named prepared statements (the unnamed one is the protocol's).
    pub fn deallocate_all(&mut self) {
        self.statements.retain(|name, _| name.is_empty());
    }

    /// `DEALLOCATE name`; false if there is no such statement.
    pub fn deallocate(&mut self, name: &[u8]) -> bool {
        !name.is_empty() && self.statements.remove(name).is_some()
    }
}

#[derive(Clone)]
struct Prepared {
    sql: Arc<str>,
    /// The Parse's parameter type section, as sent.
    param_types: Bytes,
    /// The parameter types a shard described for it (what a client binding in binary was
    /// told), once it was described.
    described_types: Option<Arc<[u32]>>,
}

impl Prepared {
    /// Each parameter's type: declared, else described, else 0 (the server infers it).
    fn param_type(&self, index: usize) -> u32 {
        let declared = type_at(&self.param_types, index);
        match (declared, &self.described_types) {
            (0, Some(described)) => described.get(index).copied().unwrap_or(0),
            _ => declared,
        }
    }
}

/// The type OID at `index` of a Parse's type section (or a ParameterDescription's body),
/// 0 if it has none there.
pub(super) fn type_at(section: &[u8], index: usize) -> u32 {
    let at = 2 + index * 4;
    section.get(at..at + 4).map_or(0, |oid| {
        u32::from_be_bytes([oid[0], oid[1], oid[2], oid[3]])
    })
}

struct Portal {
    statement: Prepared,
    /// The Bind's body after the names, as sent (read when it came).
    bind_rest: Bytes,
    /// Of a portal suspended after some of its rows: the rest of its answer.
    pending: Option<VecDeque<Message>>,
}

/// The messages a client queued after the one at hand, already read.
pub type Queued = VecDeque<(u8, BytesMut)>;

/// More than one held answer's worth of rows.
pub fn too_many_held_rows() -> PgError {
    PgError::error(
        SqlState::PROGRAM_LIMIT_EXCEEDED,
        format!(
            "the rows of this portal exceed the {} MiB pgherd holds for a client reading them a few at a time",
            fan_out::MAX_FAN_OUT_BYTES >> 20
        ),
    )
    .with_hint("read the rows without a row limit, or add a LIMIT")
}

fn protocol(e: pgherd_wire::WireError) -> PgError {
    PgError::error(SqlState::PROTOCOL_VIOLATION, e.to_string())
}

fn no_shard() -> PgError {
    PgError::error(SqlState::INTERNAL_ERROR, "no shard to ask")
}

fn quoted(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

impl ShardedSession {
    /// One Parse, Bind, Describe, Execute or Close; its answer goes to `out`.
    pub(super) async fn extended_message(
        &mut self,
        tag: u8,
        body: &[u8],
        queued: &Queued,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        match tag {
            ftag::PARSE => self.parse(body, out).map_err(Failed::Statement),
            ftag::BIND => self.bind(body, out).map_err(Failed::Statement),
            ftag::DESCRIBE => self.describe(body, queued, out).await,
            ftag::EXECUTE => {
                let execute = frontend::Execute::parse(body).map_err(protocol)?;
                let describe = self
                    .extended
                    .describe_next
                    .take()
                    .is_some_and(|name| name == execute.portal);
                self.execute_portal(execute.portal, execute.max_rows, describe, queued, out)
                    .await
            }
            _ => {
                let close = frontend::Close::parse(body).map_err(protocol)?;
                match close.target {
                    Target::Statement => {
                        self.extended.statements.remove(close.name);
                    }
                    Target::Portal => {
                        self.extended.portals.remove(close.name);
                    }
                }
                backend::encode_empty(out, btag::CLOSE_COMPLETE);
                Ok(())
            }
        }
    }

    fn parse(&mut self, body: &[u8], out: &mut BytesMut) -> Result<(), PgError> {
        let parse = frontend::Parse::parse(body).map_err(protocol)?;
        let sql = std::str::from_utf8(parse.query).map_err(|_| {
            PgError::error(
                SqlState::CHARACTER_NOT_IN_REPERTOIRE,
                "invalid byte sequence for encoding \"UTF8\" in the statement",
            )
        })?;
        if !parse.name.is_empty() && self.extended.statements.contains_key(parse.name) {
            return Err(PgError::error(
                SqlState::DUPLICATE_PREPARED_STATEMENT,
                format!(
                    "prepared statement \"{}\" already exists",
                    quoted(parse.name)
                ),
            ));
        }
        self.extended.statements.insert(
            Bytes::copy_from_slice(parse.name),
            Prepared {
                sql: Arc::from(sql),
                param_types: Bytes::copy_from_slice(parse.param_types),
                described_types: None,
            },
        );
        backend::encode_empty(out, btag::PARSE_COMPLETE);
        Ok(())
    }

    fn bind(&mut self, body: &[u8], out: &mut BytesMut) -> Result<(), PgError> {
        let bind = frontend::Bind::parse(body).map_err(protocol)?;
        BindValues::parse(bind.rest).map_err(protocol)?;
        let statement = self.prepared(bind.statement)?;
        if !bind.portal.is_empty() && self.extended.portals.contains_key(bind.portal) {
            return Err(PgError::error(
                SqlState::DUPLICATE_CURSOR,
                format!("portal \"{}\" already exists", quoted(bind.portal)),
            ));
        }
        self.extended.portals.insert(
            Bytes::copy_from_slice(bind.portal),
            Portal {
                statement,
                bind_rest: Bytes::copy_from_slice(bind.rest),
                pending: None,
            },
        );
        backend::encode_empty(out, btag::BIND_COMPLETE);
        Ok(())
    }

    fn prepared(&self, name: &[u8]) -> Result<Prepared, PgError> {
        self.extended.statements.get(name).cloned().ok_or_else(|| {
            PgError::error(
                SqlState::INVALID_SQL_STATEMENT_NAME,
                format!("prepared statement \"{}\" does not exist", quoted(name)),
            )
        })
    }

    fn portal(&mut self, name: &[u8]) -> Result<&mut Portal, PgError> {
        self.extended.portals.get_mut(name).ok_or_else(|| {
            PgError::error(
                SqlState::INVALID_CURSOR_NAME,
                format!("portal \"{}\" does not exist", quoted(name)),
            )
        })
    }

    /// A statement's parameter and row descriptions, or a portal's row description. A
    /// portal's Describe right before its Execute is answered by the execution.
    async fn describe(
        &mut self,
        body: &[u8],
        queued: &Queued,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let describe = frontend::Describe::parse(body).map_err(protocol)?;
        if self.tx.as_ref().is_some_and(|tx| tx.failed) {
            return Err(Failed::Statement(super::aborted_transaction()));
        }
        let (statement, bind_rest) = match describe.target {
            Target::Statement => (self.prepared(describe.name)?, None),
            Target::Portal => {
                let portal = self.portal(describe.name)?;
                let executed_next = queued.front().is_some_and(|(tag, body)| {
                    *tag == ftag::EXECUTE
                        && frontend::Execute::parse(body).is_ok_and(|e| e.portal == describe.name)
                });
                if executed_next && portal.pending.is_none() {
                    self.extended.describe_next = Some(Bytes::copy_from_slice(describe.name));
                    return Ok(());
                }
                (portal.statement.clone(), Some(portal.bind_rest.clone()))
            }
        };
        let bind_rest = bind_rest.as_deref();
        let mut links = self.one_shard_link().await?;
        let described = match links.first_mut() {
            Some(link) => {
                link.describe(&statement.sql, &statement.param_types, bind_rest)
                    .await
            }
            None => Err(no_shard()),
        };
        self.give_back(links, false);
        let described = described??;
        if describe.target == Target::Statement {
            let types = described
                .iter()
                .find(|(tag, _)| *tag == btag::PARAMETER_DESCRIPTION)
                .map(|(_, body)| {
                    let count = body
                        .get(..2)
                        .map_or(0, |c| u16::from_be_bytes([c[0], c[1]]));
                    (0..usize::from(count)).map(|i| type_at(body, i)).collect()
                });
            if let Some(prepared) = self.extended.statements.get_mut(describe.name) {
                prepared.described_types = types;
            }
        }
        described.iter().for_each(|m| encode_message(out, m));
        Ok(())
    }

    /// A link to one shard (in a transaction, one it reached), for [`Self::give_back`].
    async fn one_shard_link(&mut self) -> Result<Vec<Link>, PgError> {
        let shards = self.shards_for(&Execution::AnyShard);
        if self.tx.is_some() {
            self.tx_links(&shards).await
        } else {
            self.open_links(&shards).await
        }
    }

    /// Runs a portal, or hands out more rows of one suspended.
    async fn execute_portal(
        &mut self,
        name: &[u8],
        max_rows: i32,
        describe: bool,
        queued: &Queued,
        out: &mut BytesMut,
    ) -> Result<(), Failed> {
        let row_limit = usize::try_from(max_rows).ok().filter(|&n| n > 0);
        let failed = self.tx.as_ref().is_some_and(|tx| tx.failed);
        let portal = self.portal(name)?;
        if let Some(pending) = portal.pending.as_mut() {
            if failed {
                return Err(Failed::Statement(super::aborted_transaction()));
            }
            if hand_out(pending, row_limit, out) {
                portal.pending = None;
            }
            return Ok(());
        }
        let statement = portal.statement.clone();
        let bind_rest = portal.bind_rest.clone();
        let values = BindValues::parse(&bind_rest).map_err(protocol)?;
        let params: Vec<BoundParam> = values
            .values
            .iter()
            .enumerate()
            .map(|(i, value)| BoundParam {
                value: *value,
                binary: values.is_binary(i),
                type_oid: statement.param_type(i),
            })
            .collect();
        let (execution, decision, target) = self.plan(&statement.sql, &params).await?;
        if self.in_failed_transaction(&execution) {
            return Err(Failed::Statement(super::aborted_transaction()));
        }
        let transaction = matches!(execution, Execution::Transaction(_));
        if self.tx.is_none() && !transaction && !alone_before_sync(queued) {
            self.tx = Some(Tx::implicit(
                self.params.flags.default_transaction_read_only,
            ));
        }
        let bound = Bound {
            param_types: statement.param_types.clone(),
            bind_rest,
            describe,
        };
        let query = Query {
            sql: &statement.sql,
            bound: Some(&bound),
        };
        let Some(limit) = row_limit else {
            return self.execute(execution, &decision, target, query, out).await;
        };
        let mut answer = BytesMut::new();
        self.extended.hold_answers = true;
        let ran = self
            .execute(execution, &decision, target, query, &mut answer)
            .await;
        self.extended.hold_answers = false;
        let mut messages = split_messages(answer);
        if ran.is_err() {
            // What came with the failure (the server's own error, notices) is the client's;
            // the rows held before it, which it did not ask for yet, are not.
            messages
                .iter()
                .filter(|m| m.0 != btag::DATA_ROW)
                .for_each(|m| encode_message(out, m));
            return ran;
        }
        if !hand_out(&mut messages, Some(limit), out) {
            let held: usize = messages.iter().map(|m| m.1.len()).sum();
            if self.extended.held_bytes() + held > fan_out::MAX_FAN_OUT_BYTES {
                return Err(Failed::Statement(too_many_held_rows()));
            }
            if let Ok(portal) = self.portal(name) {
                portal.pending = Some(messages);
            }
        }
        Ok(())
    }

    /// A Sync: the implicit transaction of the messages before it ends, committed unless one
    /// failed; the portals end with their transaction.
    pub(super) async fn sync(&mut self, out: &mut BytesMut) -> Result<(), Failed> {
        self.extended.skip_to_sync = false;
        self.extended.describe_next = None;
        let ended = self.end_implicit_block(out).await;
        if self.tx.is_none() {
            self.extended.portals.clear();
        }
        ended
    }

    /// Ends the implicit transaction of extended messages, if one is open.
    pub(super) async fn end_implicit_block(&mut self, out: &mut BytesMut) -> Result<(), Failed> {
        match &self.tx {
            Some(tx) if tx.implicit => {
                let commit = !tx.failed;
                self.end_transaction(commit, out).await
            }
            _ => Ok(()),
        }
    }
}

/// `bound` with a type for every parameter: as the client declared them, or, where it left
/// one to the server, as a shard infers it for the whole statement `sql`. A shard's part of a
/// split INSERT may not mention a parameter, whose type the server could then not infer.
pub(super) async fn typed(link: &mut Link, sql: &str, bound: &Bound) -> Result<Bound, Failed> {
    let values = BindValues::parse(&bound.bind_rest).map_err(protocol)?;
    let declared = &bound.param_types;
    let all_declared = (0..values.values.len()).all(|i| type_at(declared, i) != 0);
    if all_declared {
        return Ok(bound.clone());
    }
    let described = link.describe(sql, declared, None).await??;
    let inferred = described
        .into_iter()
        .find(|(tag, _)| *tag == btag::PARAMETER_DESCRIPTION)
        .ok_or_else(|| {
            PgError::error(
                SqlState::PROTOCOL_VIOLATION,
                format!("shard {} did not describe the parameters", link.shard),
            )
        })?;
    Ok(Bound {
        // A ParameterDescription's body is a Parse's type section.
        param_types: inferred.1.freeze(),
        ..bound.clone()
    })
}

/// The Execute at hand is the last message before the next Sync that could fail or run, and
/// that Sync is queued already: it runs as a statement of its own. Otherwise (more to come, a
/// message whose failure would undo it, or the Sync not seen yet) it opens an implicit
/// transaction for them.
fn alone_before_sync(queued: &Queued) -> bool {
    queued
        .iter()
        .find(|(tag, _)| !matches!(*tag, ftag::FLUSH | ftag::CLOSE))
        .is_some_and(|(tag, _)| *tag == ftag::SYNC)
}

/// The messages of an answer held whole.
pub(super) fn split_messages(mut answer: BytesMut) -> VecDeque<Message> {
    let mut messages = VecDeque::new();
    while let Ok(Some(message)) = crate::msgio::take_buffered_message(&mut answer, usize::MAX) {
        messages.push_back(message);
    }
    messages
}

/// Hands out the next rows of a held answer, up to `limit`: then PortalSuspended (and
/// `false`), or, once fewer are left, the rest of the answer with its command tag counting
/// the rows of this Execute, as PostgreSQL's does (and `true`).
fn hand_out(messages: &mut VecDeque<Message>, limit: Option<usize>, out: &mut BytesMut) -> bool {
    let mut rows = 0usize;
    while let Some(message) = messages.pop_front() {
        // As PostgreSQL, which stops at the limit without looking whether rows are left.
        let rest = matches!(message.0, btag::DATA_ROW | btag::COMMAND_COMPLETE);
        if rest && limit == Some(rows) {
            messages.push_front(message);
            backend::encode_empty(out, btag::PORTAL_SUSPENDED);
            return false;
        }
        match message.0 {
            btag::DATA_ROW => rows += 1,
            btag::COMMAND_COMPLETE => {
                let tag = super::link::command_tag(&message.1).unwrap_or_default();
                if let Some(("SELECT", _)) = tag.split_once(' ') {
                    if backend::encode_command_complete(out, &format!("SELECT {rows}")).is_ok() {
                        continue;
                    }
                }
            }
            _ => {}
        }
        encode_message(out, &message);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(rows: usize) -> VecDeque<Message> {
        let mut out = BytesMut::new();
        backend::encode_text_row_description(&mut out, &["n"]).unwrap();
        for i in 0..rows {
            let value = i.to_string();
            backend::encode_data_row(&mut out, [Some(value.as_bytes())].into_iter()).unwrap();
        }
        backend::encode_command_complete(&mut out, &format!("SELECT {rows}")).unwrap();
        split_messages(out)
    }

    fn tags(out: &BytesMut) -> Vec<(u8, String)> {
        split_messages(out.clone())
            .into_iter()
            .map(|(tag, body)| (tag, String::from_utf8_lossy(&body).into_owned()))
            .collect()
    }

    #[test]
    fn a_portal_hands_out_its_rows_as_asked() {
        let mut held = answer(5);
        let mut out = BytesMut::new();
        assert!(!hand_out(&mut held, Some(2), &mut out));
        let first: Vec<u8> = tags(&out).iter().map(|t| t.0).collect();
        assert_eq!(first, b"TDDs");
        out.clear();
        assert!(!hand_out(&mut held, Some(2), &mut out));
        assert_eq!(tags(&out).len(), 3);
        out.clear();
        // The last row, then the tag counting this Execute's rows.
        assert!(hand_out(&mut held, Some(2), &mut out));
        let last = tags(&out);
        assert_eq!(last[0].0, btag::DATA_ROW);
        assert_eq!(last[1], (btag::COMMAND_COMPLETE, "SELECT 1\0".to_owned()));
        assert!(held.is_empty());

        // Exactly the limit: no suspension is owed when no row is left.
        let mut held = answer(2);
        out.clear();
        assert!(!hand_out(&mut held, Some(2), &mut out));
        out.clear();
        assert!(hand_out(&mut held, Some(2), &mut out));
        assert_eq!(
            tags(&out),
            vec![(btag::COMMAND_COMPLETE, "SELECT 0\0".to_owned())]
        );
    }

    #[test]
    fn only_a_lone_execute_before_a_queued_sync_runs_on_its_own() {
        let queue =
            |tags: &[u8]| -> Queued { tags.iter().map(|t| (*t, BytesMut::new())).collect() };
        assert!(alone_before_sync(&queue(&[ftag::SYNC])));
        assert!(alone_before_sync(&queue(&[
            ftag::FLUSH,
            ftag::SYNC,
            ftag::EXECUTE
        ])));
        assert!(!alone_before_sync(&queue(&[
            ftag::BIND,
            ftag::EXECUTE,
            ftag::SYNC
        ])));
        assert!(!alone_before_sync(&queue(&[])));
        assert!(!alone_before_sync(&queue(&[ftag::FLUSH])));
        assert!(!alone_before_sync(&queue(&[ftag::QUERY, ftag::SYNC])));
        assert!(alone_before_sync(&queue(&[ftag::CLOSE, ftag::SYNC])));
        // A Describe that fails after it must undo it, as the Sync's transaction would.
        assert!(!alone_before_sync(&queue(&[ftag::DESCRIBE, ftag::SYNC])));
    }
}
