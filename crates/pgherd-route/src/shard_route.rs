//! What a sharded endpoint does with one statement of the simple query protocol: the pure plan
//! its executor carries out (`pgherd-proxy/src/exec`). A read of no sharded table runs on any
//! one shard; a schema change or maintenance command on every shard; a statement whose key
//! predicate names one shard runs there unchanged, as a routed query would; a key-less read
//! fans out with a merge ([`crate::merge_plan`]). What cannot run exactly yet is refused with
//! `0A000` naming it: never sent to too few shards.

use std::collections::BTreeSet;

use pg_query::protobuf::node::Node as NodeEnum;
use pg_query::protobuf::{TransactionStmt, TransactionStmtKind};
use pg_query::NodeRef;
use pgherd_wire::SqlState;

use crate::decision::{Decision, Target};
use crate::lexer::lex;
use crate::merge_plan::{plan_fan_out, FanOut};
use crate::parse::{parse, NotParsed, DEFAULT_MAX_PARSE_BYTES};
use crate::shard_plan::{self, ResolveError, ShardMap, ShardPlan, Unsupported};

/// How a statement runs over the shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// It reads no sharded table (or only session state): any one shard answers.
    AnyShard,
    /// A schema change or maintenance command: every shard runs it as sent.
    EveryShard,
    /// It changes a session setting: pgherd records it and carries it to every shard's
    /// connection; one shard checks it.
    Setting,
    /// It runs unchanged on this one shard.
    OneShard(u32),
    /// A read over several shards: each runs the rewritten statement, the rows are merged.
    FanOut {
        shards: BTreeSet<u32>,
        plan: Box<FanOut>,
    },
    /// A write over several shards, unchanged on each (an `UPDATE` or `DELETE` whose key
    /// predicate names several, a write to a table every shard holds): one transaction over
    /// them, committed atomically (two-phase); the counts add up and returned rows are all
    /// passed on.
    Write {
        shards: BTreeSet<u32>,
        /// The table is one every shard holds whole: each shard's answer must be the same,
        /// and one of them is the answer.
        copies: bool,
    },
    /// BEGIN, COMMIT or ROLLBACK of the client's transaction, which pgherd carries over the
    /// shards it touches.
    Transaction(TxCommand),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxCommand {
    Begin,
    Commit,
    Rollback,
}

/// Why a statement does not run on a sharded endpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    #[error(transparent)]
    Unsupported(#[from] Unsupported),
    #[error(transparent)]
    Key(#[from] ResolveError),
    /// pgherd cannot read it, so it cannot know where its rows are: PostgreSQL's parser's
    /// own message, as the server would give it.
    #[error("{0}")]
    Syntax(String),
}

impl ShardError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            ShardError::Unsupported(e) => e.sqlstate(),
            ShardError::Key(e) => e.sqlstate(),
            ShardError::Syntax(_) => SqlState::SYNTAX_ERROR,
        }
    }
}

fn refuse(what: &str) -> ShardError {
    ShardError::Unsupported(Unsupported(what.to_owned()))
}

/// Plans one query string. `decision` is the routing classification of the same text (what
/// it may write, the session state it leaves); `is_user_aggregate` says whether a function
/// name may be an aggregate the database defines (from its catalog; when unsure, say yes).
pub fn route_statement(
    sql: &str,
    map: &ShardMap,
    decision: &Decision,
    is_user_aggregate: &dyn Fn(&str) -> bool,
) -> Result<Execution, ShardError> {
    let mut key = Vec::new();
    // The parser reads strings as standard_conforming_strings = on; the session is refused
    // the other value (`route_node`), so the server reads the text as pgherd did.
    let lexed = lex(sql.as_bytes(), true, &mut key);
    let parsed = match parse(sql, &lexed, DEFAULT_MAX_PARSE_BYTES) {
        Ok(parsed) => parsed,
        // Never sent on unread: the server might read it otherwise (a newer syntax), and
        // pgherd would not know where its rows are.
        Err(NotParsed::Syntax(message)) => return Err(ShardError::Syntax(message)),
        Err(e) => return Err(refuse(&format!("a statement that {e}"))),
    };
    if let Some(pin) = decision.pin {
        return Err(refuse(&format!(
            "session state that stays on one server connection ({pin:?}: {}) through a sharded endpoint",
            decision.reason
        )));
    }
    let statements = &parsed.tree.protobuf.stmts;
    let statement = match statements.as_slice() {
        [] => return Ok(Execution::AnyShard),
        [one] => one.stmt.as_ref().and_then(|s| s.node.as_ref()),
        _ => return Err(refuse("several statements in one query string")),
    };
    let Some(statement) = statement else {
        return Ok(Execution::AnyShard);
    };
    let execution = route_node(statement, map, is_user_aggregate)?;
    if matches!(execution, Execution::Write { copies: true, .. }) {
        // Every copy of a table that lives on every shard must come out the same.
        if let Some(call) = first_function_call(&parsed.tree) {
            return Err(refuse(&format!(
                "a write to a table that is not sharded calling {call} (each shard would compute its own value, and the copies would differ)"
            )));
        }
    }
    if execution == Execution::AnyShard && decision.target == Target::Primary {
        // A write outside the sharded tables (a sequence, a function that writes, a
        // data-modifying WITH) would change one shard's copy only.
        return Err(refuse(&format!(
            "a statement that may write outside the sharded tables ({}): it would run on one shard only",
            decision.reason
        )));
    }
    Ok(execution)
}

fn route_node(
    statement: &NodeEnum,
    map: &ShardMap,
    is_user_aggregate: &dyn Fn(&str) -> bool,
) -> Result<Execution, ShardError> {
    match statement {
        NodeEnum::SelectStmt(_)
        | NodeEnum::InsertStmt(_)
        | NodeEnum::UpdateStmt(_)
        | NodeEnum::DeleteStmt(_) => route_data(statement, map, is_user_aggregate),
        NodeEnum::ExplainStmt(explain) => {
            let inner = explain.query.as_ref().and_then(|q| q.node.as_ref());
            match inner.map(|q| route_node(q, map, is_user_aggregate)) {
                Some(Ok(Execution::FanOut { .. })) => {
                    Err(refuse("EXPLAIN of a statement over several shards"))
                }
                Some(other) => other,
                None => Ok(Execution::AnyShard),
            }
        }
        NodeEnum::VariableShowStmt(_) => Ok(Execution::AnyShard),
        NodeEnum::VariableSetStmt(set) if set.name == "standard_conforming_strings" => Err(refuse(
            "changing standard_conforming_strings through a sharded endpoint",
        )),
        NodeEnum::VariableSetStmt(_) => Ok(Execution::Setting),
        NodeEnum::TransactionStmt(tx) => transaction_command(tx),
        NodeEnum::CopyStmt(_) => Err(refuse("COPY through a sharded endpoint (not built yet)")),
        NodeEnum::CreateTableAsStmt(_) => Err(refuse(
            "CREATE TABLE AS or SELECT INTO through a sharded endpoint",
        )),
        node if is_schema_or_maintenance(node) => {
            if hides_a_sharded_table(node, map) {
                return Err(refuse(
                    "a view over, or a renaming of, a sharded table (pgherd would no longer see it)",
                ));
            }
            Ok(Execution::EveryShard)
        }
        other => Err(refuse(&format!(
            "{} through a sharded endpoint",
            statement_name(other)
        ))),
    }
}

/// A read or write of rows: where the key predicate or the rows' keys place it.
fn route_data(
    statement: &NodeEnum,
    map: &ShardMap,
    is_user_aggregate: &dyn Fn(&str) -> bool,
) -> Result<Execution, ShardError> {
    let reads_only = match statement {
        NodeEnum::SelectStmt(select) => select.into_clause.is_none(),
        _ => false,
    };
    let plan = shard_plan::plan(statement, map)?;
    match &plan {
        ShardPlan::Unsharded if reads_only => Ok(Execution::AnyShard),
        ShardPlan::Unsharded => match statement {
            NodeEnum::InsertStmt(_) => Err(refuse(
                "an INSERT into a table that is not sharded (its column defaults may give each shard's copy another value; not built yet)",
            )),
            _ => Ok(Execution::Write {
                shards: (0..map.shards).collect(),
                copies: true,
            }),
        },
        ShardPlan::InsertRows { table, .. } => {
            let shards: BTreeSet<u32> = plan.row_shards(map, &[])?.into_iter().collect();
            match shards.first() {
                None => Ok(Execution::OneShard(0)),
                Some(&shard) if shards.len() == 1 => Ok(Execution::OneShard(shard)),
                Some(_) => Err(refuse(&format!(
                    "an INSERT of rows for several shards of {table} in one statement (splitting its rows is not built yet)"
                ))),
            }
        }
        ShardPlan::Table { table, restriction } => {
            let sharded = map
                .tables
                .get(table)
                .ok_or_else(|| refuse(&format!("table {table}, missing from the sharding map")))?;
            let shards = restriction.shards(sharded, map.shards, &[])?;
            if shards.len() <= 1 {
                // No shard: no row can match, and any one shard says so.
                return Ok(Execution::OneShard(shards.first().copied().unwrap_or(0)));
            }
            let NodeEnum::SelectStmt(select) = statement else {
                return Ok(Execution::Write {
                    shards,
                    copies: false,
                });
            };
            let plan = plan_fan_out(select, &sharded.key_column, is_user_aggregate)?;
            Ok(Execution::FanOut {
                shards,
                plan: Box::new(plan),
            })
        }
    }
}

/// BEGIN, COMMIT and ROLLBACK; what pgherd cannot carry over the shards yet is refused.
fn transaction_command(tx: &TransactionStmt) -> Result<Execution, ShardError> {
    let kind = TransactionStmtKind::try_from(tx.kind).unwrap_or(TransactionStmtKind::Undefined);
    let command = match kind {
        TransactionStmtKind::TransStmtBegin | TransactionStmtKind::TransStmtStart => {
            TxCommand::Begin
        }
        TransactionStmtKind::TransStmtCommit | TransactionStmtKind::TransStmtRollback
            if tx.chain =>
        {
            return Err(refuse(
                "COMMIT AND CHAIN or ROLLBACK AND CHAIN through a sharded endpoint",
            ));
        }
        TransactionStmtKind::TransStmtCommit => TxCommand::Commit,
        TransactionStmtKind::TransStmtRollback => TxCommand::Rollback,
        TransactionStmtKind::TransStmtSavepoint
        | TransactionStmtKind::TransStmtRelease
        | TransactionStmtKind::TransStmtRollbackTo => {
            return Err(refuse(
                "savepoints through a sharded endpoint (not built yet)",
            ));
        }
        TransactionStmtKind::TransStmtPrepare
        | TransactionStmtKind::TransStmtCommitPrepared
        | TransactionStmtKind::TransStmtRollbackPrepared
        | TransactionStmtKind::Undefined => {
            return Err(refuse(
                "PREPARE TRANSACTION, COMMIT PREPARED or ROLLBACK PREPARED from a client of a sharded endpoint (pgherd runs two-phase commit over the shards itself)",
            ));
        }
    };
    Ok(Execution::Transaction(command))
}

/// The first function the statement calls (`now()`, `CURRENT_TIMESTAMP`, a column's
/// `DEFAULT`; an operator's function is not seen), by name.
fn first_function_call(tree: &pg_query::ParseResult) -> Option<String> {
    tree.protobuf
        .nodes()
        .into_iter()
        .find_map(|(node, ..)| match node {
            NodeRef::FuncCall(call) => Some(
                call.funcname
                    .iter()
                    .filter_map(|n| match &n.node {
                        Some(NodeEnum::String(s)) => Some(s.sval.as_str()),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("."),
            ),
            NodeRef::SqlvalueFunction(_) => {
                Some("a date/time or user function (CURRENT_TIMESTAMP, ...)".into())
            }
            NodeRef::SetToDefault(_) => Some("a column's DEFAULT".into()),
            _ => None,
        })
}

/// A view over a sharded table, or a new name or schema for one: statements naming the view
/// or the new name would no longer be seen to touch the sharded table.
fn hides_a_sharded_table(node: &NodeEnum, map: &ShardMap) -> bool {
    matches!(
        node,
        NodeEnum::ViewStmt(_) | NodeEnum::RenameStmt(_) | NodeEnum::AlterObjectSchemaStmt(_)
    ) && !shard_plan::sharded_mentions(node, map).is_empty()
}

/// Statements every shard runs: what makes and changes the schema, and maintenance.
fn is_schema_or_maintenance(node: &NodeEnum) -> bool {
    matches!(
        node,
        NodeEnum::CreateStmt(_)
            | NodeEnum::AlterTableStmt(_)
            | NodeEnum::DropStmt(_)
            | NodeEnum::IndexStmt(_)
            | NodeEnum::TruncateStmt(_)
            | NodeEnum::VacuumStmt(_)
            | NodeEnum::CreateSchemaStmt(_)
            | NodeEnum::ViewStmt(_)
            | NodeEnum::CreateSeqStmt(_)
            | NodeEnum::AlterSeqStmt(_)
            | NodeEnum::RenameStmt(_)
            | NodeEnum::CommentStmt(_)
            | NodeEnum::CreateFunctionStmt(_)
            | NodeEnum::CreateExtensionStmt(_)
            | NodeEnum::GrantStmt(_)
            | NodeEnum::CreateEnumStmt(_)
            | NodeEnum::CompositeTypeStmt(_)
            | NodeEnum::CreateDomainStmt(_)
            | NodeEnum::AlterObjectSchemaStmt(_)
            | NodeEnum::AlterOwnerStmt(_)
            | NodeEnum::ReindexStmt(_)
            | NodeEnum::ClusterStmt(_)
    )
}

/// The statement's kind as a sentence names it (`DoStmt` → `DO`).
fn statement_name(node: &NodeEnum) -> String {
    let debug = format!("{node:?}");
    let kind = debug.split('(').next().unwrap_or("this statement");
    let kind = kind.strip_suffix("Stmt").unwrap_or(kind);
    let mut words = String::new();
    for (i, ch) in kind.char_indices() {
        if i > 0 && ch.is_ascii_uppercase() {
            words.push(' ');
        }
        words.push(ch.to_ascii_uppercase());
    }
    words
}

#[cfg(test)]
#[path = "shard_route_tests.rs"]
mod tests;
