//! What a sharded endpoint does with one statement (a simple query, or an extended-protocol
//! statement with its bound parameters): the pure plan
//! its executor carries out (`pgherd-proxy/src/exec`). A read of no sharded table runs on any
//! one shard; a schema change or maintenance command on every shard; a statement whose key
//! predicate names one shard runs there unchanged, as a routed query would; a key-less read
//! fans out with a merge ([`crate::merge_plan`]). What cannot run exactly yet is refused with
//! `0A000` naming it: never sent to too few shards.

use std::collections::{BTreeMap, BTreeSet};

use pg_query::protobuf::node::Node as NodeEnum;
use pg_query::protobuf::{
    CopyStmt, InsertStmt, OnConflictAction, OverridingKind, TransactionStmt, TransactionStmtKind,
};
use pgherd_wire::SqlState;

use crate::copy_split::{self, CopyIn};
use crate::decision::{Decision, Target};
use crate::lexer::lex;
use crate::merge_plan::{plan_fan_out, FanOut};
use crate::parse::{parse_tree, NotParsed, DEFAULT_MAX_PARSE_BYTES};
use crate::pin::{self, Pinned};
use crate::shard_plan::{self, BoundParam, ResolveError, ShardMap, ShardPlan, Unsupported};
use crate::tree::{first_node, last_name, string, SYSTEM_COLUMNS};

/// How a statement runs over the shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Execution {
    /// It reads no sharded table (or only session state): any one shard answers.
    AnyShard,
    /// A schema change: every shard runs it as sent.
    EveryShard,
    /// TRUNCATE, VACUUM, ANALYZE, REINDEX, CLUSTER: every shard runs it as sent; the schema
    /// stays as it was.
    Maintenance,
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
        /// An INSERT whose rows go to several shards: each shard's own statement with its
        /// rows (`None`: the statement as sent, on each).
        split: Option<Box<SplitInsert>>,
        /// Of a table every shard holds: the statement with the transaction's times it reads
        /// (`now()`, `CURRENT_TIMESTAMP`, ...) as parameters, computed once on the first shard.
        pinned: Option<Box<Pinned>>,
    },
    /// BEGIN, COMMIT or ROLLBACK of the client's transaction, which pgherd carries over the
    /// shards it touches.
    Transaction(TxCommand),
    /// `COPY ... FROM STDIN`: every shard takes the COPY, each row goes to the shard of its
    /// key (or, for a table every shard holds, to every shard), in one transaction.
    CopyIn(Box<CopyPlan>),
    /// A command about the session pgherd keeps, answered by pgherd without a shard.
    Session(SessionCommand),
    /// `COPY ... TO STDOUT` of rows on several shards: each shard's output in turn, as one
    /// COPY (the header line, if any, once).
    CopyOut { shards: BTreeSet<u32>, header: bool },
}

/// The session commands a sharded endpoint answers itself: its links serve one statement or
/// transaction each, so what these reset on a server lives in pgherd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionCommand {
    /// `DISCARD ALL`: the session's settings, prepared statements and portals forgotten.
    DiscardAll,
    /// `DISCARD PLANS`, `SEQUENCES` or `TEMP` (its command tag): nothing of what they reset
    /// outlives a statement on a sharded endpoint (the temporary tables and sequence draws
    /// they would reset are refused there).
    DiscardNothing(&'static str),
    /// `DEALLOCATE name`, or `DEALLOCATE ALL` (`None`): prepared statements forgotten.
    Deallocate(Option<String>),
}

/// How a `COPY ... FROM STDIN` is split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyPlan {
    pub copy: CopyIn,
    /// The sharded table's key (`None`: a table every shard holds, whose rows all go to
    /// every shard).
    pub key: Option<CopyKey>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyKey {
    pub table: String,
    pub column: String,
    /// The key's field in each row; `None` without a column list: its place among the
    /// table's columns, which the server knows.
    pub index: Option<usize>,
}

/// An `INSERT ... VALUES` split by the shards of its rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitInsert {
    /// Each shard's statement: the INSERT with only that shard's rows.
    pub statements: BTreeMap<u32, String>,
    /// Each row's shard, in the order written: rows a `RETURNING` gives back are put in this
    /// order again.
    pub row_shards: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxCommand {
    /// `BEGIN` or `START TRANSACTION` (`start`), with an isolation level, access mode or
    /// deferrability (`with_options`), as the parser read it (comments and all).
    Begin {
        start: bool,
        with_options: bool,
    },
    Commit,
    Rollback,
    /// `SAVEPOINT name`, `RELEASE [SAVEPOINT] name`, `ROLLBACK TO [SAVEPOINT] name`: the
    /// name as the server folds it.
    Savepoint(String),
    Release(String),
    RollbackTo(String),
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
    /// A table every shard holds is written, and pgherd's catalog does not know it (yet: a
    /// table just made is read soon after).
    #[error("not supported on sharded tables: a write to table {0}, which pgherd's catalog does not know (yet)")]
    CatalogBehind(String),
}

impl ShardError {
    pub fn sqlstate(&self) -> SqlState {
        match self {
            ShardError::Unsupported(e) => e.sqlstate(),
            ShardError::Key(e) => e.sqlstate(),
            ShardError::Syntax(_) => SqlState::SYNTAX_ERROR,
            ShardError::CatalogBehind(_) => SqlState::FEATURE_NOT_SUPPORTED,
        }
    }
}

fn refuse(what: &str) -> ShardError {
    ShardError::Unsupported(Unsupported(what.to_owned()))
}

/// What the database's catalog says, as far as planning over the shards needs it.
pub struct CatalogFacts<'a> {
    /// Whether a function name may be one the database defines (an aggregate of its own, or
    /// a function shadowing a built-in's name; when unsure, yes).
    pub is_user_aggregate: &'a dyn Fn(&str) -> bool,
    /// Of a table every shard holds, by name: what could make its copies differ when
    /// written; `None` if the catalog does not know it.
    pub copy_facts: &'a dyn Fn(&str) -> Option<CopyFacts>,
    /// The text names a type or operator whose casts, checks or code are the database's own.
    pub mentions_user_code: &'a dyn Fn(&str) -> bool,
}

/// What could make the copies of a table every shard holds differ when written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyFacts {
    /// An ordinary or partitioned table (not a view, a materialized view or a foreign table,
    /// which every shard's write would reach differently).
    pub is_table: bool,
    /// Triggers, rules or defaults run user code.
    pub runs_user_code: bool,
    /// Columns whose default is not a constant (`now()`, a sequence, an identity).
    pub varying_defaults: Vec<String>,
}

/// Plans one query string. `decision` is the routing classification of the same text (what
/// it may write, the session state it leaves); `params` are the values bound to its
/// parameters (extended protocol; none for a simple query).
pub fn route_statement(
    sql: &str,
    map: &ShardMap,
    decision: &Decision,
    catalog: &CatalogFacts,
    params: &[BoundParam],
) -> Result<Execution, ShardError> {
    let is_user_aggregate = catalog.is_user_aggregate;
    let mut key = Vec::new();
    // The parser reads strings as standard_conforming_strings = on; the session is refused
    // the other value (`route_node`), so the server reads the text as pgherd did.
    let lexed = lex(sql.as_bytes(), true, &mut key);
    let tree = match parse_tree(sql, &lexed, DEFAULT_MAX_PARSE_BYTES) {
        Ok(tree) => tree,
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
    let statements = &tree.protobuf.stmts;
    let statement = match statements.as_slice() {
        [] => return Ok(Execution::AnyShard),
        [one] => one.stmt.as_ref().and_then(|s| s.node.as_ref()),
        // A simple query's string is split before planning: this is one Parse's text.
        _ => {
            return Err(ShardError::Syntax(
                "cannot insert multiple commands into a prepared statement".into(),
            ))
        }
    };
    let Some(statement) = statement else {
        return Ok(Execution::AnyShard);
    };
    let mut execution = route_node(statement, map, is_user_aggregate, params)?;
    if matches!(execution, Execution::Write { copies: true, .. })
        || matches!(&execution, Execution::CopyIn(plan) if plan.key.is_none())
    {
        copies_written_alike(statement, catalog)?;
        let pinned = pin::pin(sql, statement, params.len())
            .map_err(|e| {
                refuse(&format!(
                    "a write to a table that is not sharded with {e} pgherd cannot place"
                ))
            })?
            .map(Box::new);
        match &mut execution {
            Execution::Write { pinned: slot, .. } => *slot = pinned,
            // A COPY's rows reach every shard in a statement of its own: a time in its WHERE
            // would be each shard's.
            _ if pinned.is_some() => {
                return Err(refuse(
                    "COPY into a table that is not sharded reading the transaction's time (each shard would keep other rows)",
                ))
            }
            _ => {}
        }
        if (catalog.mentions_user_code)(sql) {
            return Err(refuse(
                "a write to a table that is not sharded using a type or operator whose code is the database's own (each shard could come to its own values)",
            ));
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

/// A statement planned by [`route_statement`] (`planned`), run on the one shard a hint
/// (`/* pgherd:shard=N */`) or `SET pgherd.shard` names instead: a read sees that shard's
/// rows only, as sent (a single SELECT pgherd could not merge over the shards runs there too);
/// a write runs there only if its rows are there; what would make the shards' copies or
/// schemas differ (TRUNCATE included) is refused, and so is whatever else was refused.
pub fn on_named_shard(
    sql: &str,
    planned: Result<Execution, ShardError>,
    decision: &Decision,
    shard: u32,
) -> Result<Execution, ShardError> {
    let reads = decision.target != Target::Primary && decision.pin.is_none();
    let named = |what: &str| {
        refuse(&format!(
            "{what} with one shard named (pgherd:shard or pgherd.shard: {shard})"
        ))
    };
    match planned {
        Ok(
            execution @ (Execution::Setting | Execution::Transaction(_) | Execution::Session(_)),
        ) => Ok(execution),
        Ok(Execution::Maintenance) if named_kind(sql) == NamedKind::Truncate => Err(named(
            "TRUNCATE (the copies of a table every shard holds would differ)",
        )),
        Ok(
            Execution::AnyShard
            | Execution::FanOut { .. }
            | Execution::CopyOut { .. }
            | Execution::Maintenance,
        ) => Ok(Execution::OneShard(shard)),
        Ok(Execution::OneShard(placed)) if placed == shard || reads => {
            Ok(Execution::OneShard(shard))
        }
        Ok(Execution::OneShard(placed)) => Err(refuse(&format!(
            "a write whose rows are on shard {placed}, with shard {shard} named (pgherd:shard or pgherd.shard)"
        ))),
        Ok(Execution::EveryShard) => Err(named("a schema change (every shard keeps the same schema)")),
        Ok(Execution::Write { copies: true, .. }) => Err(named(
            "a write to a table every shard holds (its copies would differ)",
        )),
        Ok(Execution::Write { .. }) => Err(named("a write whose rows are on several shards")),
        Ok(Execution::CopyIn(_)) => Err(named("COPY FROM")),
        // What pgherd cannot run over the shards, one SELECT runs as sent on the named one.
        Err(ShardError::Unsupported(_) | ShardError::Key(_))
            if reads && named_kind(sql) == NamedKind::Select =>
        {
            Ok(Execution::OneShard(shard))
        }
        Err(e) => Err(e),
    }
}

#[derive(PartialEq, Eq)]
enum NamedKind {
    /// One SELECT (or EXPLAIN of one) that creates nothing.
    Select,
    Truncate,
    Other,
}

/// What `sql` is, as far as a named shard needs to know (parsed only then).
fn named_kind(sql: &str) -> NamedKind {
    let Ok(parsed) = pg_query::parse(sql) else {
        return NamedKind::Other;
    };
    let [statement] = parsed.protobuf.stmts.as_slice() else {
        return NamedKind::Other;
    };
    let plain_select = |node: Option<&NodeEnum>| matches!(node, Some(NodeEnum::SelectStmt(s)) if s.into_clause.is_none());
    match statement.stmt.as_ref().and_then(|s| s.node.as_ref()) {
        node if plain_select(node) => NamedKind::Select,
        Some(NodeEnum::ExplainStmt(explain))
            if plain_select(explain.query.as_ref().and_then(|q| q.node.as_ref())) =>
        {
            NamedKind::Select
        }
        Some(NodeEnum::TruncateStmt(_)) => NamedKind::Truncate,
        _ => NamedKind::Other,
    }
}

fn route_node(
    statement: &NodeEnum,
    map: &ShardMap,
    is_user_aggregate: &dyn Fn(&str) -> bool,
    params: &[BoundParam],
) -> Result<Execution, ShardError> {
    match statement {
        NodeEnum::SelectStmt(_)
        | NodeEnum::InsertStmt(_)
        | NodeEnum::UpdateStmt(_)
        | NodeEnum::DeleteStmt(_) => route_data(statement, map, is_user_aggregate, params),
        NodeEnum::ExplainStmt(explain) => {
            let inner = explain.query.as_ref().and_then(|q| q.node.as_ref());
            match inner.map(|q| route_node(q, map, is_user_aggregate, params)) {
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
        NodeEnum::DiscardStmt(discard) => {
            use pg_query::protobuf::DiscardMode;
            Ok(Execution::Session(
                match DiscardMode::try_from(discard.target) {
                    Ok(DiscardMode::DiscardAll) => SessionCommand::DiscardAll,
                    Ok(DiscardMode::DiscardPlans) => {
                        SessionCommand::DiscardNothing("DISCARD PLANS")
                    }
                    Ok(DiscardMode::DiscardSequences) => {
                        SessionCommand::DiscardNothing("DISCARD SEQUENCES")
                    }
                    Ok(DiscardMode::DiscardTemp) => SessionCommand::DiscardNothing("DISCARD TEMP"),
                    _ => return Err(refuse("this DISCARD")),
                },
            ))
        }
        NodeEnum::DeallocateStmt(deallocate) => Ok(Execution::Session(SessionCommand::Deallocate(
            (!deallocate.isall && !deallocate.name.is_empty()).then(|| deallocate.name.clone()),
        ))),
        NodeEnum::CopyStmt(copy) if copy.is_from => plan_copy(copy, map),
        NodeEnum::CopyStmt(copy) => plan_copy_out(copy, map, is_user_aggregate, params),
        NodeEnum::CreateTableAsStmt(_) => Err(refuse(
            "CREATE TABLE AS or SELECT INTO through a sharded endpoint",
        )),
        node if is_maintenance(node) => Ok(Execution::Maintenance),
        node if is_schema_change(node) => {
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
    params: &[BoundParam],
) -> Result<Execution, ShardError> {
    let reads_only = match statement {
        NodeEnum::SelectStmt(select) => select.into_clause.is_none(),
        _ => false,
    };
    let plan = shard_plan::plan(statement, map)?;
    match &plan {
        ShardPlan::Unsharded if reads_only => Ok(Execution::AnyShard),
        ShardPlan::Unsharded => Ok(Execution::Write {
            shards: (0..map.shards).collect(),
            copies: true,
            split: None,
            pinned: None,
        }),
        ShardPlan::InsertRows { table, .. } => {
            let row_shards = plan.row_shards(map, params)?;
            let shards: BTreeSet<u32> = row_shards.iter().copied().collect();
            match (shards.first(), statement) {
                (None, _) => Ok(Execution::OneShard(0)),
                (Some(&shard), _) if shards.len() == 1 => Ok(Execution::OneShard(shard)),
                (Some(_), NodeEnum::InsertStmt(insert)) => Ok(Execution::Write {
                    shards,
                    copies: false,
                    split: Some(Box::new(split_insert(insert, table, row_shards)?)),
                    pinned: None,
                }),
                (Some(_), _) => Err(refuse(&format!("an INSERT into {table} of this shape"))),
            }
        }
        ShardPlan::Table { table, restriction } => {
            let sharded = map
                .tables
                .get(table)
                .ok_or_else(|| refuse(&format!("table {table}, missing from the sharding map")))?;
            let shards = restriction.shards(sharded, map.shards, params)?;
            if shards.len() <= 1 {
                // No shard: no row can match, and any one shard says so.
                return Ok(Execution::OneShard(shards.first().copied().unwrap_or(0)));
            }
            let NodeEnum::SelectStmt(select) = statement else {
                return Ok(Execution::Write {
                    shards,
                    copies: false,
                    split: None,
                    pinned: None,
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

/// A `COPY ... FROM STDIN` into a sharded table, or into one every shard holds.
fn plan_copy(copy: &CopyStmt, map: &ShardMap) -> Result<Execution, ShardError> {
    let Some(relation) = copy.relation.as_ref().filter(|_| copy.query.is_none()) else {
        return Err(refuse("COPY of a query through a sharded endpoint"));
    };
    let copy_in = copy_split::copy_in(copy).map_err(|e| refuse(&e.to_string()))?;
    let key = match map.table(relation) {
        None => None,
        Some((table, sharded)) => {
            let index = if copy_in.columns.is_empty() {
                None
            } else {
                Some(
                    copy_in
                        .columns
                        .iter()
                        .position(|c| *c == sharded.key_column)
                        .ok_or_else(|| {
                            refuse(&format!(
                                "COPY into {table} without its shard key column {}",
                                sharded.key_column
                            ))
                        })?,
                )
            };
            Some(CopyKey {
                table: table.to_owned(),
                column: sharded.key_column.clone(),
                index,
            })
        }
    };
    Ok(Execution::CopyIn(Box::new(CopyPlan { copy: copy_in, key })))
}

/// A `COPY ... TO STDOUT`: a table every shard holds, or rows on one shard, run where they
/// are as sent; a sharded table, or a query whose rows need no merge, on each shard in turn.
fn plan_copy_out(
    copy: &CopyStmt,
    map: &ShardMap,
    is_user_aggregate: &dyn Fn(&str) -> bool,
    params: &[BoundParam],
) -> Result<Execution, ShardError> {
    if copy.is_program || !copy.filename.is_empty() {
        // A file would be written on whichever shard's server ran it.
        return Err(refuse(
            "COPY TO a file or program through a sharded endpoint (only TO STDOUT)",
        ));
    }
    let shards = match (copy.relation.as_ref(), copy.query.as_ref()) {
        (Some(relation), None) => match map.table(relation) {
            None => return Ok(Execution::AnyShard),
            Some(_) => (0..map.shards).collect(),
        },
        (None, Some(query)) => {
            let Some(query) = query.node.as_ref() else {
                return Err(refuse("this COPY"));
            };
            match route_data(query, map, is_user_aggregate, params)? {
                execution @ (Execution::AnyShard | Execution::OneShard(_)) => return Ok(execution),
                Execution::FanOut { shards, plan } if plan.merge == Default::default() => shards,
                _ => {
                    return Err(refuse(
                        "COPY of a query over several shards whose rows must be merged (ORDER BY, LIMIT, DISTINCT, aggregates)",
                    ))
                }
            }
        }
        _ => return Err(refuse("this COPY")),
    };
    let header = copy_split::copy_out_header(copy).map_err(|e| refuse(&e.to_string()))?;
    Ok(Execution::CopyOut { shards, header })
}

/// The INSERT once per shard, each with its own rows (PostgreSQL's deparser writes them).
fn split_insert(
    insert: &InsertStmt,
    table: &str,
    row_shards: Vec<u32>,
) -> Result<SplitInsert, ShardError> {
    let skips_rows = insert.on_conflict_clause.as_ref().is_some_and(|c| {
        c.action == OnConflictAction::OnconflictNothing as i32 || c.where_clause.is_some()
    });
    if skips_rows && !insert.returning_list.is_empty() {
        // The rows given back could not be matched with the rows written.
        return Err(refuse(&format!(
            "an INSERT of rows for several shards of {table} with RETURNING and an ON CONFLICT that may skip rows"
        )));
    }
    let values = match insert.select_stmt.as_ref().and_then(|s| s.node.as_ref()) {
        Some(NodeEnum::SelectStmt(select)) if select.values_lists.len() == row_shards.len() => {
            select
        }
        _ => return Err(refuse(&format!("an INSERT into {table} of this shape"))),
    };
    // The statement and its VALUES without rows, cloned once; each shard gets its own rows.
    let empty_values = pg_query::protobuf::SelectStmt {
        values_lists: Vec::new(),
        ..values.as_ref().clone()
    };
    let without_rows = InsertStmt {
        select_stmt: None,
        ..insert.clone()
    };
    let mut statements = BTreeMap::new();
    for &shard in row_shards.iter().collect::<BTreeSet<_>>() {
        let select = pg_query::protobuf::SelectStmt {
            values_lists: values
                .values_lists
                .iter()
                .zip(&row_shards)
                .filter(|(_, s)| **s == shard)
                .map(|(row, _)| row.clone())
                .collect(),
            ..empty_values.clone()
        };
        let own = InsertStmt {
            select_stmt: Some(Box::new(pg_query::protobuf::Node {
                node: Some(NodeEnum::SelectStmt(Box::new(select))),
            })),
            ..without_rows.clone()
        };
        let sql = NodeEnum::InsertStmt(Box::new(own))
            .deparse()
            .map_err(|e| refuse(&format!("an INSERT pgherd cannot write back ({e})")))?;
        statements.insert(shard, sql);
    }
    Ok(SplitInsert {
        statements,
        row_shards,
    })
}

/// BEGIN, COMMIT, ROLLBACK and savepoints; what pgherd cannot carry over the shards is refused.
fn transaction_command(tx: &TransactionStmt) -> Result<Execution, ShardError> {
    if tx.chain {
        return Err(refuse(
            "COMMIT AND CHAIN or ROLLBACK AND CHAIN through a sharded endpoint",
        ));
    }
    match tx_command(tx) {
        Some(command) => Ok(Execution::Transaction(command)),
        None => Err(refuse(
            "PREPARE TRANSACTION, COMMIT PREPARED or ROLLBACK PREPARED from a client of a sharded endpoint (pgherd runs two-phase commit over the shards itself)",
        )),
    }
}

/// What a transaction statement does (`END` is a COMMIT, `ABORT` a ROLLBACK, AND CHAIN
/// aside); `None` for the two-phase commands (PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED).
fn tx_command(tx: &TransactionStmt) -> Option<TxCommand> {
    let name = || tx.savepoint_name.clone();
    Some(match TransactionStmtKind::try_from(tx.kind).ok()? {
        kind @ (TransactionStmtKind::TransStmtBegin | TransactionStmtKind::TransStmtStart) => {
            TxCommand::Begin {
                start: kind == TransactionStmtKind::TransStmtStart,
                with_options: !tx.options.is_empty(),
            }
        }
        TransactionStmtKind::TransStmtCommit => TxCommand::Commit,
        TransactionStmtKind::TransStmtRollback => TxCommand::Rollback,
        TransactionStmtKind::TransStmtSavepoint => TxCommand::Savepoint(name()),
        TransactionStmtKind::TransStmtRelease => TxCommand::Release(name()),
        TransactionStmtKind::TransStmtRollbackTo => TxCommand::RollbackTo(name()),
        _ => return None,
    })
}

/// [`tx_command`] of a text that is one transaction statement (parsed within the usual
/// bounds); `None` for any other text.
pub fn tx_command_of(sql: &str) -> Option<TxCommand> {
    let mut key = Vec::new();
    let lexed = lex(sql.as_bytes(), true, &mut key);
    let tree = parse_tree(sql, &lexed, DEFAULT_MAX_PARSE_BYTES).ok()?;
    let [statement] = tree.protobuf.stmts.as_slice() else {
        return None;
    };
    match statement.stmt.as_ref()?.node.as_ref()? {
        NodeEnum::TransactionStmt(tx) => tx_command(tx),
        _ => None,
    }
}

/// A write to a table every shard holds must leave every copy the same: nothing in it may
/// compute a value (a function, a column's non-constant default, a trigger's user code) or
/// pick rows (a subquery, `FROM`, `USING`, `INSERT ... SELECT`) another way on another shard.
fn copies_written_alike(statement: &NodeEnum, catalog: &CatalogFacts) -> Result<(), ShardError> {
    let differ = |what: &str| {
        refuse(&format!(
            "a write to a table that is not sharded {what} (each shard could come to its own values, and the copies would differ)"
        ))
    };
    // Every WITH holds a CommonTableExpr, which the walk meets.
    let found = first_node(
        statement,
        "an expression pgherd cannot read".to_owned(),
        |key, value| match key {
            // The transaction's time is computed once and bound on every shard, unless the
            // database defines a function of that name.
            "FuncCall"
                if pin::transaction_time(key, value).is_some()
                    && !last_name(value.get("funcname")?)
                        .is_some_and(|name| (catalog.is_user_aggregate)(&name)) =>
            {
                None
            }
            "SqlvalueFunction" if pin::transaction_time(key, value).is_some() => None,
            "FuncCall" => Some(format!(
                "calling {}",
                last_name(value.get("funcname")?).unwrap_or_default()
            )),
            "SqlvalueFunction" => Some("calling CURRENT_USER or a function like it".into()),
            "SetToDefault" => Some("calling a column's DEFAULT".into()),
            "SubLink" => Some("with a subquery".into()),
            "CommonTableExpr" => Some("with a WITH clause".into()),
            "AConst" => {
                let text = value.get("val")?.get("Sval")?.get("sval")?.as_str()?;
                is_date_time_word(text).then(|| format!("with the date/time word '{text}'"))
            }
            "ColumnRef" => {
                let column = last_name(value.get("fields")?)?;
                SYSTEM_COLUMNS
                    .contains(&column.as_str())
                    .then(|| format!("reading the system column {column}"))
            }
            _ => None,
        },
    );
    if let Some(what) = found {
        return Err(differ(&what));
    }
    let (relation, listed) = match statement {
        NodeEnum::UpdateStmt(u) if u.from_clause.is_empty() => (u.relation.as_ref(), None),
        // Without a column list a COPY gives every column.
        NodeEnum::CopyStmt(c) => {
            let columns: Vec<&str> = c.attlist.iter().filter_map(string).collect();
            let all = columns.is_empty();
            (c.relation.as_ref(), (!all).then_some(columns))
        }
        NodeEnum::DeleteStmt(d) if d.using_clause.is_empty() => (d.relation.as_ref(), None),
        NodeEnum::InsertStmt(i) => {
            if i.r#override == OverridingKind::OverridingUserValue as i32 {
                return Err(differ("with OVERRIDING USER VALUE"));
            }
            let values_only = matches!(
                i.select_stmt.as_ref().and_then(|s| s.node.as_ref()),
                Some(NodeEnum::SelectStmt(s)) if !s.values_lists.is_empty()
            );
            if !values_only {
                return Err(differ("from a query (INSERT ... SELECT)"));
            }
            let columns: Vec<&str> = i
                .cols
                .iter()
                .filter_map(|c| match &c.node {
                    Some(NodeEnum::ResTarget(r)) => Some(r.name.as_str()),
                    _ => None,
                })
                .collect();
            (i.relation.as_ref(), Some(columns))
        }
        _ => return Err(differ("reading other tables (FROM or USING)")),
    };
    let Some(relation) = relation else {
        return Err(differ("of this shape"));
    };
    let name = &relation.relname;
    let facts =
        (catalog.copy_facts)(name).ok_or_else(|| ShardError::CatalogBehind(name.clone()))?;
    if !facts.is_table {
        return Err(differ(&format!(
            "({name} is a view or a foreign table, not a table every shard holds)"
        )));
    }
    if facts.runs_user_code {
        return Err(differ(&format!(
            "({name}, whose triggers, rules or defaults run user code)"
        )));
    }
    if let Some(listed) = listed {
        // Without a column list, any column may be left to its default.
        let left = facts
            .varying_defaults
            .iter()
            .find(|c| listed.is_empty() || !listed.contains(&c.as_str()));
        if let Some(column) = left {
            return Err(differ(&format!(
                "leaving column {column} of {name} to its default, which is not a constant (name the column and give its value)"
            )));
        }
    }
    Ok(())
}

/// Literals PostgreSQL reads as the time they are read at.
pub fn is_date_time_word(text: &str) -> bool {
    let word = text.trim().to_ascii_lowercase();
    matches!(word.as_str(), "now" | "today" | "tomorrow" | "yesterday")
}

/// A view over a sharded table, or a new name or schema for one: statements naming the view
/// or the new name would no longer be seen to touch the sharded table.
fn hides_a_sharded_table(node: &NodeEnum, map: &ShardMap) -> bool {
    matches!(
        node,
        NodeEnum::ViewStmt(_) | NodeEnum::RenameStmt(_) | NodeEnum::AlterObjectSchemaStmt(_)
    ) && !shard_plan::sharded_mentions(node, map).is_empty()
}

/// Commands that keep the schema as it is.
fn is_maintenance(node: &NodeEnum) -> bool {
    matches!(
        node,
        NodeEnum::TruncateStmt(_)
            | NodeEnum::VacuumStmt(_)
            | NodeEnum::ReindexStmt(_)
            | NodeEnum::ClusterStmt(_)
    )
}

/// Statements every shard runs that make and change the schema.
fn is_schema_change(node: &NodeEnum) -> bool {
    matches!(
        node,
        NodeEnum::CreateStmt(_)
            | NodeEnum::AlterTableStmt(_)
            | NodeEnum::DropStmt(_)
            | NodeEnum::IndexStmt(_)
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
pub(crate) mod tests;
