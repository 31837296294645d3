//! Which node a statement may run on and what it may do to the session, decided with
//! PostgreSQL's own parser (`pg_query`), and the sentence that says why. Anything pgherd
//! cannot prove to be a read goes to the primary; anything it cannot prove harmless to the
//! session is an unknown session effect, which the proxy checks on the server.
//!
//! Two views of one parse: the statement tree for what each top-level statement is, and the
//! library's summary (its C walker visits every expression) for every function called and
//! every relation touched, wherever in the text they are.

use pg_query::protobuf::summary_result::Context;
use pg_query::protobuf::{node::Node as NodeEnum, TransactionStmtKind, VariableSetKind};
use pg_query::NodeRef;

use crate::catalog::{custom_settings_set_in, literal_first_arguments, Catalog};
use crate::decision::{Decision, Pin, SessionEffect, ShardSetting, Target, TxEffect};
use crate::lexer::Lexed;
use crate::parse::{self, Parsed};

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

/// Built-in (or C extension) functions that change session state: settings, the random
/// seed, replication slots and origins tied to the session, extension settings and
/// connections.
const SESSION_CHANGING_FUNCTIONS: &[&str] = &[
    "set_config",
    "setseed",
    "pg_create_logical_replication_slot",
    "pg_create_physical_replication_slot",
    "pg_replication_origin_session_setup",
    "set_limit",
];

/// Functions that open a `dblink` connection kept in the server process.
const DBLINK_FUNCTIONS: &[&str] = &["dblink_connect", "dblink_connect_u"];

/// Built-in (or C extension) functions whose call leaves state in the server's session:
/// settings, the random seed, session locks, slots and origins, connections. A view that
/// calls one makes whoever reads it call it, so the catalog reading counts such a view as
/// running user code, as it counts one that calls a user function.
pub fn leaving_session_state() -> impl Iterator<Item = &'static str> {
    SESSION_CHANGING_FUNCTIONS
        .iter()
        .chain(SESSION_LOCK_FUNCTIONS)
        .chain(DBLINK_FUNCTIONS)
        .copied()
}

/// Built-in functions that run SQL given to them as text (or name a relation in a literal),
/// which the classifier cannot see into.
const SQL_RUNNING_FUNCTIONS: &[&str] = &[
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "table_to_xml",
    "table_to_xmlschema",
    "table_to_xml_and_xmlschema",
    "schema_to_xml",
    "schema_to_xmlschema",
    "schema_to_xml_and_xmlschema",
    "database_to_xml",
    "database_to_xmlschema",
    "database_to_xml_and_xmlschema",
    "ts_stat",
    "ts_rewrite",
];

/// Functions that draw from sequences.
const SEQUENCE_FUNCTIONS: &[&str] = &["nextval", "setval"];

/// Built-in functions a hot standby answers otherwise than the primary (or refuses): the
/// client talks to "the database", which is the primary.
const STANDBY_REVEALING_FUNCTIONS: &[&str] = &[
    "pg_is_in_recovery",
    "pg_last_wal_receive_lsn",
    "pg_last_wal_replay_lsn",
    "pg_last_xact_replay_timestamp",
    "pg_is_wal_replay_paused",
    "pg_get_wal_replay_pause_state",
    "pg_current_wal_lsn",
    "pg_current_wal_insert_lsn",
    "pg_current_wal_flush_lsn",
    "pg_walfile_name",
    "pg_walfile_name_offset",
    "pg_control_checkpoint",
    "pg_control_recovery",
];

/// Settings a hot standby reports otherwise than the primary.
const STANDBY_REVEALING_SETTINGS: &[&str] = &["transaction_read_only", "in_hot_standby", "all"];

/// System views that describe the server answering rather than the database: its
/// replication, its settings, its sessions and locks.
const SERVER_DESCRIBING_RELATIONS: &[&str] = &[
    "pg_settings",
    "pg_stat_replication",
    "pg_stat_wal_receiver",
    "pg_replication_slots",
    "pg_stat_replication_slots",
    "pg_stat_activity",
    "pg_locks",
];

/// The name pgherd's own routing setting goes by.
pub const ROUTE_SETTING: &str = "pgherd.route";

/// The setting that names the shard a sharded endpoint runs a session's statements on.
pub const SHARD_SETTING: &str = "pgherd.shard";

/// Classifies `sql` (which `lexed` describes). Text the server would read differently from
/// the parser library, or that is too large or deep to parse, goes to the primary unread.
pub fn classify(
    sql: &str,
    lexed: &Lexed,
    catalog: &dyn Catalog,
    max_parse_bytes: usize,
) -> Decision {
    if lexed.strings_depend_on_settings {
        return Decision::unread(
            "has a backslash the server may read otherwise (standard_conforming_strings, the client's encoding), so the primary runs it",
        );
    }
    let parsed = match parse::parse(sql, lexed, max_parse_bytes) {
        Ok(p) => p,
        Err(e) => return Decision::unread(format!("{e}, so the primary runs it")),
    };
    let mut decision: Option<Decision> = None;
    for raw in &parsed.tree.protobuf.stmts {
        let Some(node) = raw.stmt.as_ref().and_then(|s| s.node.as_ref()) else {
            continue;
        };
        let d = classify_statement(node);
        decision = Some(match decision {
            None => d,
            Some(previous) => previous.merge(d),
        });
    }
    let Some(decision) = decision else {
        return Decision::new(Target::Any, "is empty");
    };
    let decision = function_effects(decision, &parsed, lexed, catalog);
    let mut decision = relation_effects(decision, &parsed, catalog);
    if catalog.mentions_user_code(sql) {
        // A type whose cast or domain check runs user code, an operator implemented by one.
        decision = decision.with_session(SessionEffect::Unknown);
    }
    if decision.session == SessionEffect::Unknown && calls(&parsed, "set_config") {
        // The names are literals the cache key keeps (see the lexer).
        decision.custom_settings = custom_settings_set_in(sql);
        decision.custom_setting_params = set_config_name_params(&parsed);
    }
    if calls(&parsed, "current_setting") {
        decision = settings_read(decision, sql, lexed);
    }
    decision
}

/// `current_setting(name)` of a setting a standby reports otherwise (`transaction_read_only`
/// is on there) is the primary's to answer; so is one whose name pgherd cannot read.
fn settings_read(decision: Decision, sql: &str, lexed: &Lexed) -> Decision {
    let names = literal_first_arguments(&sql.to_ascii_lowercase(), "current_setting");
    let unreadable = names.len() < lexed.current_setting_names || names.iter().any(Option::is_none);
    let revealing = names
        .iter()
        .flatten()
        .find(|n| STANDBY_REVEALING_SETTINGS.contains(&n.as_str()));
    match (revealing, unreadable) {
        (Some(name), _) => decision.merge(Decision::new(
            Target::Primary,
            format!("reads setting {name}, which a standby reports otherwise"),
        )),
        (None, true) => decision.merge(Decision::new(
            Target::Primary,
            "reads a setting whose name is not a literal, which a standby may report otherwise",
        )),
        (None, false) => decision,
    }
}

fn calls(parsed: &Parsed, name: &str) -> bool {
    parsed
        .summary
        .functions
        .iter()
        .any(|f| f.context == Context::Call && f.function_name.eq_ignore_ascii_case(name))
}

/// What the functions a statement calls, anywhere in it, mean for where it runs and for
/// the session.
fn function_effects(
    mut decision: Decision,
    parsed: &Parsed,
    lexed: &Lexed,
    catalog: &dyn Catalog,
) -> Decision {
    for function in &parsed.summary.functions {
        if function.context != Context::Call {
            continue;
        }
        let bare = function.function_name.to_lowercase();
        let name = bare.as_str();
        if SESSION_LOCK_FUNCTIONS.contains(&name) {
            let mut d = Decision::new(
                Target::Primary,
                format!("calls {name}, which takes a session lock"),
            );
            d.pin = Some(Pin::AdvisoryLock);
            decision = decision.merge(d);
            continue;
        }
        if DBLINK_FUNCTIONS.contains(&name) {
            let mut d = Decision::new(
                Target::Primary,
                format!("calls {name}, which keeps a connection in the session"),
            );
            d.pin = Some(Pin::Dblink);
            decision = decision.merge(d);
            continue;
        }
        if SQL_RUNNING_FUNCTIONS.contains(&name) {
            let mut d = Decision::new(
                Target::Primary,
                format!("calls {name}, which runs SQL pgherd cannot see"),
            );
            d.session = SessionEffect::Unknown;
            decision = decision.merge(d);
            continue;
        }
        if name == "set_config" && sets_locally(parsed, lexed) {
            // set_config(..., true) ends with the transaction, as SET LOCAL does.
        } else if SESSION_CHANGING_FUNCTIONS.contains(&name) {
            decision = decision.with_session(SessionEffect::Unknown);
        }
        if SEQUENCE_FUNCTIONS.contains(&name) {
            decision = decision.with_session(SessionEffect::Sequences);
        }
        if STANDBY_REVEALING_FUNCTIONS.contains(&name) {
            decision = decision.merge(Decision::new(
                Target::Primary,
                format!("calls {name}, which a standby answers otherwise"),
            ));
        }
        if HARMLESS_VOLATILE.contains(&name) {
            continue;
        }
        match catalog.function(name) {
            Some(info) => {
                if info.user_defined {
                    decision = decision.with_session(SessionEffect::Unknown);
                }
                if info.volatile {
                    decision = decision.merge(Decision::new(
                        Target::Primary,
                        format!("calls volatile function {name}"),
                    ));
                }
            }
            None => {
                let mut d = Decision::new(
                    Target::Primary,
                    format!("calls function {name}, whose volatility is unknown"),
                );
                d.needs_catalog = true;
                d.session = SessionEffect::Unknown;
                decision = decision.merge(d);
            }
        }
    }
    decision
}

/// The call is one of `set_config` (schema-qualified or not).
fn names_set_config(call: &pg_query::protobuf::FuncCall) -> bool {
    call.funcname
        .last()
        .and_then(|n| n.node.as_ref())
        .is_some_and(
            |n| matches!(n, NodeEnum::String(s) if s.sval.eq_ignore_ascii_case("set_config")),
        )
}

/// The bind parameters (`$n`, cast or not) passed as `set_config`'s setting name.
fn set_config_name_params(parsed: &Parsed) -> Vec<u16> {
    let mut params = Vec::new();
    for (node, ..) in parsed.tree.protobuf.nodes() {
        let NodeRef::FuncCall(call) = node else {
            continue;
        };
        let is_set_config = names_set_config(call);
        let mut name = call.args.first().and_then(|a| a.node.as_ref());
        if let Some(NodeEnum::TypeCast(cast)) = name {
            name = cast.arg.as_ref().and_then(|a| a.node.as_ref());
        }
        if let (true, Some(NodeEnum::ParamRef(p))) = (is_set_config, name) {
            params.extend(u16::try_from(p.number).ok());
        }
    }
    params
}

/// Every `set_config` call in the text passes `true` as its third argument (the tree's
/// walk must have found as many calls as the text has tokens naming the function).
fn sets_locally(parsed: &Parsed, lexed: &Lexed) -> bool {
    let mut local_calls = 0;
    for (node, ..) in parsed.tree.protobuf.nodes() {
        let NodeRef::FuncCall(call) = node else {
            continue;
        };
        let is_set_config = names_set_config(call);
        if !is_set_config {
            continue;
        }
        let local = call.args.get(2).and_then(|a| a.node.as_ref()).is_some_and(|a| {
            matches!(a, NodeEnum::AConst(c)
                if matches!(&c.val, Some(pg_query::protobuf::a_const::Val::Boolval(b)) if b.boolval))
        });
        if !local {
            return false;
        }
        local_calls += 1;
    }
    local_calls > 0 && local_calls == lexed.set_config_names
}

/// What the relations a statement touches mean: unlogged and temporary relations cannot be
/// read on a standby; user code that may run when they are touched; sequences drawn when
/// they are written.
fn relation_effects(mut decision: Decision, parsed: &Parsed, catalog: &dyn Catalog) -> Decision {
    let writes = decision.target == Target::Primary;
    for table in &parsed.summary.tables {
        let name = table.table_name.as_str();
        if table.schema_name.starts_with("pg_temp") {
            decision = decision.merge(Decision::new(Target::Primary, "uses a temporary table"));
            continue;
        }
        if SERVER_DESCRIBING_RELATIONS.contains(&name)
            && matches!(table.schema_name.as_str(), "" | "pg_catalog")
        {
            decision = decision.merge(Decision::new(
                Target::Primary,
                format!("reads {name}, which describes the server answering"),
            ));
        }
        match catalog.relation(name) {
            Some(info) => {
                if info.runs_user_code {
                    decision = decision.with_session(SessionEffect::Unknown);
                }
                if info.draws_sequences && writes && table.context != Context::Select {
                    decision = decision.with_session(SessionEffect::Sequences);
                }
                if info.standby_unreadable {
                    decision = decision.merge(Decision::new(
                        Target::Primary,
                        format!("uses {name}, which is unlogged or temporary (a standby cannot read it)"),
                    ));
                }
            }
            None => {
                // Created since the catalog was read, or a temporary table of this session.
                decision.needs_catalog = true;
                decision = decision.with_session(SessionEffect::Unknown);
            }
        }
    }
    decision
}

/// The value of a `transaction_read_only` option; the last one counts, as in PostgreSQL
/// (`START TRANSACTION READ ONLY, READ WRITE` is read-write).
fn read_only_option(options: &[pg_query::protobuf::Node]) -> Option<bool> {
    options.iter().rev().find_map(|o| match o.node.as_ref() {
        Some(NodeEnum::DefElem(d)) if d.defname == "transaction_read_only" => {
            match d.arg.as_ref().and_then(|a| a.node.as_ref()) {
                Some(NodeEnum::AConst(c)) => Some(matches!(
                    &c.val,
                    Some(pg_query::protobuf::a_const::Val::Ival(i)) if i.ival == 1
                )),
                _ => None,
            }
        }
        _ => None,
    })
}

/// The words of a SET's value, e.g. `on` or `replica`.
/// The value a statement that pgherd records for a session setting gives it: `SET name = v`
/// (or `TO v`), or `SELECT pg_catalog.set_config('name', 'v', false)` as pgherd writes a
/// startup setting. `None` for anything else.
pub fn setting_value(sql: &str) -> Option<String> {
    use pg_query::protobuf::a_const::Val;
    let parsed = pg_query::parse(sql).ok()?;
    let [statement] = parsed.protobuf.stmts.as_slice() else {
        return None;
    };
    match statement.stmt.as_ref()?.node.as_ref()? {
        NodeEnum::VariableSetStmt(set) => set_value(&set.args),
        NodeEnum::SelectStmt(select) => {
            let target = select.target_list.first()?.node.as_ref()?;
            let NodeEnum::ResTarget(target) = target else {
                return None;
            };
            let NodeEnum::FuncCall(call) = target.val.as_ref()?.node.as_ref()? else {
                return None;
            };
            match call.funcname.last()?.node.as_ref()? {
                NodeEnum::String(name) if name.sval == "set_config" => {}
                _ => return None,
            }
            match call.args.get(1)?.node.as_ref()? {
                NodeEnum::AConst(c) => match c.val.as_ref()? {
                    Val::Sval(s) => Some(s.sval.clone()),
                    _ => None,
                },
                _ => None,
            }
        }
        _ => None,
    }
}

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

fn is_temporary(relation: Option<&pg_query::protobuf::RangeVar>) -> bool {
    relation.is_some_and(|r| r.relpersistence == "t" || r.schemaname.starts_with("pg_temp"))
}

fn temporary_object(reason: &str) -> Decision {
    let mut d = Decision::ddl(Target::Primary, reason);
    d.pin = Some(Pin::TempTable);
    d
}

fn classify_statement(node: &NodeEnum) -> Decision {
    match node {
        NodeEnum::SelectStmt(s) => match &s.into_clause {
            Some(into) if is_temporary(into.rel.as_ref()) => {
                temporary_object("SELECT INTO TEMP creates session state")
            }
            Some(_) => Decision::ddl(Target::Primary, "SELECT INTO creates a table"),
            None => classify_read(node, "SELECT reads"),
        },
        NodeEnum::InsertStmt(_) => Decision::new(Target::Primary, "INSERT writes"),
        NodeEnum::UpdateStmt(_) => Decision::new(Target::Primary, "UPDATE writes"),
        NodeEnum::DeleteStmt(_) => Decision::new(Target::Primary, "DELETE writes"),
        NodeEnum::MergeStmt(_) => Decision::new(Target::Primary, "MERGE writes"),
        NodeEnum::TransactionStmt(t) => classify_transaction(t),
        NodeEnum::VariableSetStmt(v) => classify_set(v),
        NodeEnum::VariableShowStmt(s)
            if STANDBY_REVEALING_SETTINGS.contains(&s.name.to_lowercase().as_str()) =>
        {
            Decision::new(
                Target::Primary,
                format!(
                    "SHOW {} reads a setting a standby reports otherwise",
                    s.name
                ),
            )
        }
        NodeEnum::VariableShowStmt(_) => Decision::new(Target::Any, "SHOW reads a setting"),
        NodeEnum::DeallocateStmt(_) => {
            Decision::new(Target::Any, "DEALLOCATE forgets a prepared statement")
        }
        NodeEnum::DiscardStmt(discard) => {
            let mut d = Decision::new(Target::Any, "DISCARD resets the session");
            // DISCARD_ALL
            if discard.target == 1 {
                d.shard_setting = Some(ShardSetting::Reset);
            }
            d
        }
        NodeEnum::ExplainStmt(e) => {
            let analyze = e.options.iter().any(
                |o| matches!(o.node.as_ref(), Some(NodeEnum::DefElem(d)) if d.defname == "analyze"),
            );
            match e.query.as_ref().and_then(|q| q.node.as_ref()) {
                Some(inner) if analyze => {
                    let mut d = classify_statement(inner);
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
                    Some(inner) => classify_read(inner, "COPY TO reads"),
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
        )
        .with_session(SessionEffect::Unknown),
        NodeEnum::DeclareCursorStmt(c) => {
            const CURSOR_OPT_HOLD: i32 = 0x0020;
            let mut d = match c.query.as_ref().and_then(|q| q.node.as_ref()) {
                Some(inner) => classify_read(inner, "DECLARE reads"),
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
        NodeEnum::DoStmt(_) => Decision::new(Target::Primary, "DO runs a block of code")
            .with_session(SessionEffect::Unknown),
        NodeEnum::CallStmt(_) => Decision::new(Target::Primary, "CALL runs a procedure")
            .with_session(SessionEffect::Unknown),
        NodeEnum::LoadStmt(_) => {
            let mut d = Decision::new(Target::Primary, "LOAD loads a library into the session");
            d.pin = Some(Pin::LoadedLibrary);
            d
        }
        NodeEnum::CreateStmt(c) if is_temporary(c.relation.as_ref()) => {
            temporary_object("CREATE TEMPORARY TABLE creates session state")
        }
        NodeEnum::CreateStmt(_) => {
            Decision::ddl(Target::Primary, "CREATE TABLE changes the schema")
        }
        NodeEnum::CreateTableAsStmt(c)
            if is_temporary(c.into.as_ref().and_then(|i| i.rel.as_ref())) =>
        {
            temporary_object("CREATE TEMPORARY TABLE AS creates session state")
        }
        NodeEnum::CreateTableAsStmt(_) => Decision::ddl(Target::Primary, "CREATE TABLE AS writes"),
        NodeEnum::ViewStmt(v) if is_temporary(v.view.as_ref()) => {
            temporary_object("CREATE TEMPORARY VIEW creates session state")
        }
        NodeEnum::CreateSeqStmt(s) if is_temporary(s.sequence.as_ref()) => {
            temporary_object("CREATE TEMPORARY SEQUENCE creates session state")
        }
        _ => Decision::ddl(
            Target::Primary,
            "is not a statement pgherd can prove read-only, so the primary runs it",
        ),
    }
}

fn classify_transaction(t: &pg_query::protobuf::TransactionStmt) -> Decision {
    let kind = TransactionStmtKind::try_from(t.kind).unwrap_or(TransactionStmtKind::Undefined);
    match kind {
        TransactionStmtKind::TransStmtBegin | TransactionStmtKind::TransStmtStart => {
            let read_only = read_only_option(&t.options);
            let mut d = if read_only == Some(true) {
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
            d.rolls_back = kind == TransactionStmtKind::TransStmtRollback;
            d
        }
        TransactionStmtKind::TransStmtRollbackTo => {
            let mut d = Decision::new(Target::Any, "rolls back to a savepoint");
            d.rolls_back = true;
            d
        }
        _ => Decision::new(Target::Any, "marks the current transaction"),
    }
}

fn classify_set(v: &pg_query::protobuf::VariableSetStmt) -> Decision {
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
    } else if name == SHARD_SETTING {
        d.shard_setting = Some(match kind {
            _ if v.is_local => ShardSetting::Local,
            VariableSetKind::VarSetValue => {
                ShardSetting::To(set_value(&v.args).unwrap_or_default())
            }
            _ => ShardSetting::Reset,
        });
    } else if kind == VariableSetKind::VarResetAll {
        d.shard_setting = Some(ShardSetting::Reset);
    } else if name == "transaction" && kind == VariableSetKind::VarSetMulti {
        match read_only_option(&v.args) {
            Some(true) => d.tx = TxEffect::SetReadOnly,
            Some(false) => d.tx = TxEffect::SetReadWrite,
            None => {}
        }
    } else if name == "session characteristics" {
        if let Some(on) = read_only_option(&v.args) {
            d.tx = TxEffect::DefaultReadOnly(Some(on));
        }
    } else if name == "default_transaction_read_only" {
        let on = match kind {
            VariableSetKind::VarSetValue => {
                set_value(&v.args).map(|s| matches!(s.as_str(), "on" | "true" | "1" | "yes"))
            }
            _ => Some(false),
        };
        d.tx = TxEffect::DefaultReadOnly(on);
    }
    d
}

/// A read statement (SELECT, VALUES, a COPY or cursor query): the replica may run it unless
/// something inside it writes or locks.
fn classify_read(node: &NodeEnum, reason: &str) -> Decision {
    for (inner, _depth, _context, _) in node.nodes() {
        match inner {
            NodeRef::SelectStmt(s) if !s.locking_clause.is_empty() => {
                return Decision::new(Target::Primary, "SELECT ... FOR UPDATE/SHARE locks rows");
            }
            NodeRef::RangeVar(r) if is_temporary(Some(r)) => {
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
