//! Which node a statement may run on, decided with PostgreSQL's own parser (`pg_query`), and
//! the sentence that says why. Anything pgherd cannot prove to be a read goes to the primary.

use pg_query::protobuf::{node::Node as NodeEnum, TransactionStmtKind, VariableSetKind};
use pg_query::{Context, NodeRef};

/// Where a statement may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// Only the primary.
    Primary,
    /// Any replica (or the primary).
    Replica,
    /// Wherever the session is: transaction control, SHOW, SET, DEALLOCATE...
    Any,
}

/// Session state that ties a client to one server connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Pin {
    TempTable,
    AdvisoryLock,
    SqlPrepare,
    Listen,
    HoldCursor,
}

impl Pin {
    pub fn describe(&self) -> &'static str {
        match self {
            Pin::TempTable => "a temporary table",
            Pin::AdvisoryLock => "a session-level advisory lock",
            Pin::SqlPrepare => "an SQL-level PREPARE",
            Pin::Listen => "LISTEN",
            Pin::HoldCursor => "a cursor WITH HOLD",
        }
    }
}

/// What a statement does to the transaction state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TxEffect {
    None,
    /// BEGIN / START TRANSACTION; `read_only` when it says READ ONLY.
    Begin {
        read_only: bool,
    },
    /// SET TRANSACTION READ ONLY inside a transaction.
    SetReadOnly,
    /// SET [SESSION] default_transaction_read_only; `Some(true)` = on.
    DefaultReadOnly(Option<bool>),
    /// COMMIT, END, ROLLBACK, ABORT.
    End,
}

/// The verdict on one query string (which may hold several statements).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Decision {
    pub target: Target,
    /// Why, in a sentence fragment: "INSERT writes", "calls volatile function nextval".
    pub reason: String,
    pub pin: Option<Pin>,
    pub tx: TxEffect,
    /// False when the decision depends on literal values (SET statements), so it must not be
    /// reused for another query of the same shape.
    pub cacheable: bool,
    /// `SET pgherd.route = ...` (or RESET: "auto"): pgherd's own routing setting.
    pub route_setting: Option<String>,
    /// A function's volatility was unknown, so the verdict may change once the catalog is
    /// loaded; not to be cached.
    pub needs_catalog: bool,
    /// `COPY ... FROM STDIN`: the server will wait for the client's data, so nothing may be
    /// queued behind it.
    pub copy_in: bool,
}

impl Decision {
    pub fn new(target: Target, reason: impl Into<String>) -> Self {
        Decision {
            target,
            reason: reason.into(),
            pin: None,
            tx: TxEffect::None,
            cacheable: true,
            route_setting: None,
            needs_catalog: false,
            copy_in: false,
        }
    }

    /// Combines the verdicts of several statements in one query: the strictest wins.
    fn merge(self, other: Decision) -> Decision {
        let rank = |t: Target| match t {
            Target::Any => 0,
            Target::Replica => 1,
            Target::Primary => 2,
        };
        let (mut winner, loser) = if rank(other.target) > rank(self.target) {
            (other, self)
        } else {
            (self, other)
        };
        winner.pin = winner.pin.or(loser.pin);
        winner.cacheable &= loser.cacheable;
        winner.needs_catalog |= loser.needs_catalog;
        winner.copy_in |= loser.copy_in;
        if winner.tx == TxEffect::None {
            winner.tx = loser.tx;
        }
        winner.route_setting = winner.route_setting.or(loser.route_setting);
        winner
    }
}

/// What pgherd knows about the functions of a database.
pub trait FunctionCatalog {
    /// `Some(true)` if any function of that (lower-case, unqualified) name is VOLATILE,
    /// `Some(false)` if all are STABLE or IMMUTABLE, `None` if the name is unknown.
    fn volatile(&self, name: &str) -> Option<bool>;
}

/// Volatile functions that change nothing, so a replica may run them.
const HARMLESS_VOLATILE: &[&str] = &[
    "random",
    "clock_timestamp",
    "timeofday",
    "pg_sleep",
    "pg_sleep_for",
    "pg_sleep_until",
    "gen_random_uuid",
];

/// Functions that take session-level advisory locks (the `_xact_` ones end with the
/// transaction and only need the primary, as any volatile function).
const SESSION_LOCK_FUNCTIONS: &[&str] = &[
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
];

/// The name pgherd's own routing setting goes by.
pub const ROUTE_SETTING: &str = "pgherd.route";

/// Classifies `sql`. Unparsable text goes to the primary.
pub fn classify(sql: &str, functions: &dyn FunctionCatalog) -> Decision {
    let parsed = match pg_query::parse(sql) {
        Ok(p) => p,
        Err(e) => {
            return Decision::new(
                Target::Primary,
                format!("cannot be parsed ({e}), so the primary runs it"),
            );
        }
    };
    let mut decision: Option<Decision> = None;
    for raw in &parsed.protobuf.stmts {
        let Some(node) = raw.stmt.as_ref().and_then(|s| s.node.as_ref()) else {
            continue;
        };
        let d = classify_statement(node, functions);
        decision = Some(match decision {
            None => d,
            Some(previous) => previous.merge(d),
        });
    }
    let Some(mut decision) = decision else {
        return Decision::new(Target::Any, "is empty");
    };
    if decision.target == Target::Replica || decision.target == Target::Any {
        // Function calls anywhere in a read decide too.
        for (name, context) in &parsed.functions {
            if *context != Context::Call {
                continue;
            }
            let bare = name.rsplit('.').next().unwrap_or(name).to_lowercase();
            if SESSION_LOCK_FUNCTIONS.contains(&bare.as_str()) {
                let mut d = Decision::new(
                    Target::Primary,
                    format!("calls {bare}, which takes a session lock"),
                );
                d.pin = Some(Pin::AdvisoryLock);
                decision = decision.merge(d);
                continue;
            }
            if HARMLESS_VOLATILE.contains(&bare.as_str()) {
                continue;
            }
            match functions.volatile(&bare) {
                Some(false) => {}
                Some(true) => {
                    decision = decision.merge(Decision::new(
                        Target::Primary,
                        format!("calls volatile function {bare}"),
                    ));
                }
                None => {
                    let mut d = Decision::new(
                        Target::Primary,
                        format!("calls function {bare}, whose volatility is unknown"),
                    );
                    d.needs_catalog = true;
                    decision = decision.merge(d);
                }
            }
        }
    }
    decision
}

fn is_read_only_option(options: &[pg_query::protobuf::Node]) -> bool {
    options.iter().any(|o| match o.node.as_ref() {
        Some(NodeEnum::DefElem(d)) if d.defname == "transaction_read_only" => d
            .arg
            .as_ref()
            .and_then(|a| a.node.as_ref())
            .is_some_and(|a| match a {
                NodeEnum::AConst(c) => {
                    matches!(&c.val, Some(pg_query::protobuf::a_const::Val::Ival(i)) if i.ival == 1)
                }
                _ => false,
            }),
        _ => false,
    })
}

/// The words of a SET's value, e.g. `on` or `replica`.
fn set_value(args: &[pg_query::protobuf::Node]) -> Option<String> {
    use pg_query::protobuf::a_const::Val;
    let arg = args.first()?.node.as_ref()?;
    match arg {
        NodeEnum::AConst(c) => match c.val.as_ref()? {
            Val::Sval(s) => Some(s.sval.to_lowercase()),
            Val::Ival(i) => Some(i.ival.to_string()),
            Val::Boolval(b) => Some(if b.boolval { "on" } else { "off" }.to_owned()),
            _ => None,
        },
        _ => None,
    }
}

fn classify_statement(node: &NodeEnum, functions: &dyn FunctionCatalog) -> Decision {
    match node {
        NodeEnum::SelectStmt(s) => {
            if s.into_clause.is_some() {
                return Decision::new(Target::Primary, "SELECT INTO creates a table");
            }
            classify_read(node, "SELECT reads", functions)
        }
        NodeEnum::InsertStmt(_) => Decision::new(Target::Primary, "INSERT writes"),
        NodeEnum::UpdateStmt(_) => Decision::new(Target::Primary, "UPDATE writes"),
        NodeEnum::DeleteStmt(_) => Decision::new(Target::Primary, "DELETE writes"),
        NodeEnum::MergeStmt(_) => Decision::new(Target::Primary, "MERGE writes"),
        NodeEnum::TransactionStmt(t) => {
            let kind =
                TransactionStmtKind::try_from(t.kind).unwrap_or(TransactionStmtKind::Undefined);
            match kind {
                TransactionStmtKind::TransStmtBegin | TransactionStmtKind::TransStmtStart => {
                    let read_only = is_read_only_option(&t.options);
                    let mut d = if read_only {
                        Decision::new(
                            Target::Replica,
                            "BEGIN READ ONLY opens a read-only transaction",
                        )
                    } else {
                        Decision::new(Target::Primary, "BEGIN opens a transaction that may write")
                    };
                    d.tx = TxEffect::Begin { read_only };
                    d
                }
                TransactionStmtKind::TransStmtPrepare
                | TransactionStmtKind::TransStmtCommitPrepared
                | TransactionStmtKind::TransStmtRollbackPrepared => {
                    Decision::new(Target::Primary, "two-phase commit needs the primary")
                }
                TransactionStmtKind::TransStmtCommit | TransactionStmtKind::TransStmtRollback => {
                    let mut d = Decision::new(Target::Any, "ends the current transaction");
                    d.tx = TxEffect::End;
                    d
                }
                _ => Decision::new(Target::Any, "marks the current transaction"),
            }
        }
        NodeEnum::VariableSetStmt(v) => {
            let name = v.name.to_lowercase();
            let kind = VariableSetKind::try_from(v.kind).unwrap_or(VariableSetKind::Undefined);
            let mut d = Decision::new(Target::Any, "changes a setting");
            d.cacheable = false;
            if name == ROUTE_SETTING {
                d.route_setting = Some(match kind {
                    VariableSetKind::VarSetValue => set_value(&v.args).unwrap_or_default(),
                    _ => "auto".to_owned(),
                });
                d.reason = "sets pgherd's routing".into();
            } else if name == "transaction"
                && kind == VariableSetKind::VarSetMulti
                && is_read_only_option(&v.args)
            {
                d.tx = TxEffect::SetReadOnly;
            } else if name == "session characteristics" && is_read_only_option(&v.args) {
                d.tx = TxEffect::DefaultReadOnly(Some(true));
            } else if name == "default_transaction_read_only" {
                let on = match kind {
                    VariableSetKind::VarSetValue => set_value(&v.args)
                        .map(|s| matches!(s.as_str(), "on" | "true" | "1" | "yes")),
                    _ => Some(false),
                };
                d.tx = TxEffect::DefaultReadOnly(on);
            }
            d
        }
        NodeEnum::VariableShowStmt(_) => Decision::new(Target::Any, "SHOW reads a setting"),
        NodeEnum::DeallocateStmt(_) => {
            Decision::new(Target::Any, "DEALLOCATE forgets a prepared statement")
        }
        NodeEnum::DiscardStmt(_) => Decision::new(Target::Any, "DISCARD resets the session"),
        NodeEnum::ExplainStmt(e) => {
            let analyze = e.options.iter().any(
                |o| matches!(o.node.as_ref(), Some(NodeEnum::DefElem(d)) if d.defname == "analyze"),
            );
            match e.query.as_ref().and_then(|q| q.node.as_ref()) {
                Some(inner) if analyze => {
                    let mut d = classify_statement(inner, functions);
                    d.reason = format!("EXPLAIN ANALYZE runs a statement that {}", d.reason);
                    d
                }
                _ => Decision::new(Target::Replica, "EXPLAIN only plans"),
            }
        }
        NodeEnum::CopyStmt(c) => {
            if c.is_from {
                let mut d = Decision::new(Target::Primary, "COPY FROM writes");
                d.copy_in = c.filename.is_empty() && !c.is_program;
                d
            } else if c.is_program || !c.filename.is_empty() {
                Decision::new(
                    Target::Primary,
                    "COPY TO a server file or program runs on the primary",
                )
            } else {
                match c.query.as_ref().and_then(|q| q.node.as_ref()) {
                    Some(inner) => classify_read(inner, "COPY TO reads", functions),
                    None => Decision::new(Target::Replica, "COPY TO reads"),
                }
            }
        }
        NodeEnum::LockStmt(_) => Decision::new(Target::Primary, "LOCK takes table locks"),
        NodeEnum::ListenStmt(_) => {
            let mut d = Decision::new(Target::Primary, "LISTEN needs the primary's notifications");
            d.pin = Some(Pin::Listen);
            d
        }
        NodeEnum::UnlistenStmt(_) => Decision::new(Target::Primary, "UNLISTEN belongs with LISTEN"),
        NodeEnum::NotifyStmt(_) => Decision::new(Target::Primary, "NOTIFY sends a notification"),
        NodeEnum::PrepareStmt(_) => {
            let mut d = Decision::new(Target::Primary, "PREPARE creates session state");
            d.pin = Some(Pin::SqlPrepare);
            d
        }
        NodeEnum::ExecuteStmt(_) => Decision::new(
            Target::Primary,
            "EXECUTE runs an SQL-level prepared statement",
        ),
        NodeEnum::DeclareCursorStmt(c) => {
            const CURSOR_OPT_HOLD: i32 = 0x0020;
            let mut d = match c.query.as_ref().and_then(|q| q.node.as_ref()) {
                Some(inner) => classify_read(inner, "DECLARE reads", functions),
                None => Decision::new(Target::Primary, "DECLARE"),
            };
            if c.options & CURSOR_OPT_HOLD != 0 {
                d.pin = Some(Pin::HoldCursor);
            }
            d
        }
        NodeEnum::FetchStmt(_) | NodeEnum::ClosePortalStmt(_) => {
            Decision::new(Target::Any, "uses a cursor of the current transaction")
        }
        NodeEnum::CreateStmt(c) => {
            let temp = c.relation.as_ref().is_some_and(|r| r.relpersistence == "t");
            let mut d = Decision::new(Target::Primary, "CREATE TABLE changes the schema");
            if temp {
                d.reason = "CREATE TEMPORARY TABLE creates session state".into();
                d.pin = Some(Pin::TempTable);
            }
            d
        }
        NodeEnum::CreateTableAsStmt(c) => {
            let temp = c
                .into
                .as_ref()
                .and_then(|i| i.rel.as_ref())
                .is_some_and(|r| r.relpersistence == "t");
            let mut d = Decision::new(Target::Primary, "CREATE TABLE AS writes");
            if temp {
                d.pin = Some(Pin::TempTable);
            }
            d
        }
        _ => Decision::new(
            Target::Primary,
            "is not a statement pgherd can prove read-only, so the primary runs it",
        ),
    }
}

/// A read statement (SELECT, VALUES, a COPY or cursor query): the replica may run it unless
/// something inside it writes or locks.
fn classify_read(node: &NodeEnum, reason: &str, _functions: &dyn FunctionCatalog) -> Decision {
    for (inner, _depth, _context, _) in node.nodes() {
        match inner {
            NodeRef::SelectStmt(s) if !s.locking_clause.is_empty() => {
                return Decision::new(Target::Primary, "SELECT ... FOR UPDATE/SHARE locks rows");
            }
            NodeRef::RangeVar(r)
                if r.relpersistence == "t" || r.schemaname.starts_with("pg_temp") =>
            {
                return Decision::new(Target::Primary, "uses a temporary table");
            }
            NodeRef::InsertStmt(_)
            | NodeRef::UpdateStmt(_)
            | NodeRef::DeleteStmt(_)
            | NodeRef::MergeStmt(_) => {
                return Decision::new(Target::Primary, "a data-modifying WITH clause writes");
            }
            _ => {}
        }
    }
    Decision::new(Target::Replica, reason)
}
