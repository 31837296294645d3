//! One line per rule: input SQL → where it runs, what it does to the session, and why.

use super::catalog::{FunctionInfo, RelationInfo};
use super::parse::DEFAULT_MAX_PARSE_BYTES;
use super::*;

/// A catalog where `nextval`, `setval` and `bump_counter` are volatile and `lower`, `now`
/// and `count` are not; `bump_counter` and `tenant_fn` are user code; relations `t`, `u`,
/// `pgbench_accounts` are plain, `audited` runs user code, `orders` draws sequences,
/// `staging` is unlogged. Anything else is unknown.
struct Catalog;

impl catalog::Catalog for Catalog {
    fn function(&self, name: &str) -> Option<FunctionInfo> {
        let (volatile, user_defined) = match name {
            "nextval"
            | "setval"
            | "txid_current"
            | "pg_advisory_xact_lock"
            | "set_config"
            | "setseed" => (true, false),
            "bump_counter" => (true, true),
            "tenant_fn" => (false, true),
            "lower" | "now" | "count" | "sum" | "abs" | "current_setting" | "generate_series" => {
                (false, false)
            }
            _ => return None,
        };
        Some(FunctionInfo {
            volatile,
            user_defined,
        })
    }

    fn relation(&self, name: &str) -> Option<RelationInfo> {
        let plain = RelationInfo::default();
        Some(match name {
            "t" | "u" | "x" | "pgbench_accounts" | "pgbench_branches" | "new_t" | "made_here" => {
                plain
            }
            "audited" => RelationInfo {
                runs_user_code: true,
                ..plain
            },
            "orders" => RelationInfo {
                draws_sequences: true,
                ..plain
            },
            "staging" => RelationInfo {
                standby_unreadable: true,
                ..plain
            },
            _ => return None,
        })
    }
}

fn decide(sql: &str) -> Decision {
    let mut key = Vec::new();
    let lexed = lex(sql.as_bytes(), true, &mut key);
    classify(sql, &lexed, &Catalog, DEFAULT_MAX_PARSE_BYTES)
}

#[track_caller]
fn check(sql: &str, target: Target, reason_contains: &str) {
    let d = decide(sql);
    assert_eq!(d.target, target, "{sql}: {}", d.reason);
    assert!(
        d.reason.contains(reason_contains),
        "{sql}: reason {:?} lacks {reason_contains:?}",
        d.reason
    );
}

#[track_caller]
fn effect(sql: &str, expected: SessionEffect) {
    let d = decide(sql);
    assert_eq!(d.session, expected, "{sql}: {}", d.reason);
}

#[test]
fn reads_go_to_replicas() {
    check(
        "SELECT abalance FROM pgbench_accounts WHERE aid = 1",
        Target::Replica,
        "SELECT reads",
    );
    check(
        "SELECT count(*), lower(name) FROM t JOIN u USING (id) WHERE now() > ts",
        Target::Replica,
        "SELECT reads",
    );
    check(
        "WITH x AS (SELECT 1) SELECT * FROM x",
        Target::Replica,
        "SELECT reads",
    );
    check("VALUES (1), (2)", Target::Replica, "SELECT reads");
    check(
        "SELECT random(), clock_timestamp()",
        Target::Replica,
        "SELECT reads",
    );
    check(
        "COPY (SELECT * FROM t) TO STDOUT",
        Target::Replica,
        "COPY TO reads",
    );
    check("COPY t TO STDOUT", Target::Replica, "COPY TO reads");
    check(
        "EXPLAIN SELECT * FROM t",
        Target::Replica,
        "EXPLAIN only plans",
    );
    check(
        "EXPLAIN UPDATE t SET a = 1",
        Target::Replica,
        "EXPLAIN only plans",
    );
}

#[test]
fn writes_and_ddl_go_to_the_primary() {
    check("INSERT INTO t VALUES (1)", Target::Primary, "INSERT writes");
    check("UPDATE t SET a = 1", Target::Primary, "UPDATE writes");
    check("DELETE FROM t", Target::Primary, "DELETE writes");
    check(
        "MERGE INTO t USING u ON t.id = u.id WHEN MATCHED THEN DELETE",
        Target::Primary,
        "MERGE writes",
    );
    check(
        "CREATE TABLE t (a int)",
        Target::Primary,
        "CREATE TABLE changes the schema",
    );
    check(
        "ALTER TABLE t ADD COLUMN b int",
        Target::Primary,
        "primary runs it",
    );
    check("DROP TABLE t", Target::Primary, "primary runs it");
    check("TRUNCATE t", Target::Primary, "primary runs it");
    check("VACUUM t", Target::Primary, "primary runs it");
    check("COPY t FROM STDIN", Target::Primary, "COPY FROM writes");
    check("COPY t TO '/tmp/x'", Target::Primary, "server file");
    check(
        "SELECT * INTO new_t FROM t",
        Target::Primary,
        "SELECT INTO creates a table",
    );
    check(
        "CREATE TABLE x AS SELECT 1",
        Target::Primary,
        "CREATE TABLE AS writes",
    );
    check(
        "EXPLAIN ANALYZE DELETE FROM t",
        Target::Primary,
        "EXPLAIN ANALYZE runs a statement that DELETE writes",
    );
    check("CALL my_proc()", Target::Primary, "CALL runs a procedure");
    check(
        "DO $$ BEGIN PERFORM 1; END $$",
        Target::Primary,
        "DO runs a block of code",
    );
    assert!(decide("CREATE INDEX i ON t (a)").changes_catalog);
    assert!(!decide("DO $$ BEGIN PERFORM 1; END $$").changes_catalog);
    assert!(!decide("INSERT INTO t VALUES (1)").changes_catalog);
}

#[test]
fn locking_reads_and_modifying_ctes_go_to_the_primary() {
    check(
        "SELECT * FROM t WHERE id = 1 FOR UPDATE",
        Target::Primary,
        "FOR UPDATE/SHARE",
    );
    check(
        "SELECT * FROM t FOR SHARE SKIP LOCKED",
        Target::Primary,
        "FOR UPDATE/SHARE",
    );
    check(
        "SELECT * FROM (SELECT * FROM t FOR UPDATE) s",
        Target::Primary,
        "FOR UPDATE/SHARE",
    );
    check(
        "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
        Target::Primary,
        "data-modifying WITH",
    );
    check(
        "WITH i AS (INSERT INTO t VALUES (1) RETURNING id) SELECT id FROM i",
        Target::Primary,
        "data-modifying WITH",
    );
    check("LOCK TABLE t", Target::Primary, "LOCK takes table locks");
}

#[test]
fn volatile_and_unknown_functions_go_to_the_primary() {
    check(
        "SELECT nextval('s')",
        Target::Primary,
        "volatile function nextval",
    );
    check(
        "SELECT setval('s', 5)",
        Target::Primary,
        "volatile function setval",
    );
    check(
        "SELECT public.bump_counter(1)",
        Target::Primary,
        "volatile function bump_counter",
    );
    check(
        "SELECT * FROM t WHERE id = txid_current()",
        Target::Primary,
        "volatile function txid_current",
    );
    check(
        "SELECT mystery(1)",
        Target::Primary,
        "volatility is unknown",
    );
    check(
        "SELECT pg_advisory_xact_lock(1)",
        Target::Primary,
        "volatile function pg_advisory_xact_lock",
    );
}

#[test]
fn session_state_pins_the_session() {
    let pin = |sql: &str| decide(sql).pin;
    assert_eq!(pin("CREATE TEMP TABLE tt (a int)"), Some(Pin::TempTable));
    assert_eq!(
        pin("CREATE TEMPORARY TABLE tt AS SELECT 1"),
        Some(Pin::TempTable)
    );
    assert_eq!(pin("SELECT pg_advisory_lock(42)"), Some(Pin::AdvisoryLock));
    assert_eq!(
        pin("SELECT pg_try_advisory_lock_shared(42)"),
        Some(Pin::AdvisoryLock)
    );
    assert_eq!(pin("PREPARE p AS SELECT 1"), Some(Pin::SqlPrepare));
    assert_eq!(pin("LISTEN channel"), Some(Pin::Listen));
    assert_eq!(
        pin("DECLARE c CURSOR WITH HOLD FOR SELECT 1"),
        Some(Pin::HoldCursor)
    );
    assert_eq!(pin("DECLARE c CURSOR FOR SELECT 1"), None);
    assert_eq!(pin("SELECT pg_advisory_xact_lock(1)"), None);
    assert_eq!(pin("CREATE TABLE t (a int)"), None);
    check("LISTEN channel", Target::Primary, "LISTEN");
    check(
        "PREPARE p AS SELECT 1",
        Target::Primary,
        "PREPARE creates session state",
    );
}

#[test]
fn transactions() {
    let tx = |sql: &str| decide(sql).tx;
    check("BEGIN", Target::Primary, "may write");
    check(
        "START TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        Target::Primary,
        "may write",
    );
    check("BEGIN READ ONLY", Target::Replica, "read-only transaction");
    check(
        "START TRANSACTION READ ONLY, ISOLATION LEVEL REPEATABLE READ",
        Target::Replica,
        "read-only transaction",
    );
    assert_eq!(tx("BEGIN"), TxEffect::Begin { read_only: None });
    assert_eq!(
        tx("BEGIN TRANSACTION READ ONLY"),
        TxEffect::Begin {
            read_only: Some(true)
        }
    );
    assert_eq!(
        tx("BEGIN READ WRITE"),
        TxEffect::Begin {
            read_only: Some(false)
        }
    );
    // The last option counts, as in PostgreSQL.
    assert_eq!(
        tx("START TRANSACTION READ ONLY, READ WRITE"),
        TxEffect::Begin {
            read_only: Some(false)
        }
    );
    check(
        "START TRANSACTION READ ONLY, READ WRITE",
        Target::Primary,
        "may write",
    );
    assert_eq!(
        tx("SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE"),
        TxEffect::DefaultReadOnly(Some(false))
    );
    assert_eq!(tx("SET TRANSACTION READ ONLY"), TxEffect::SetReadOnly);
    assert_eq!(
        tx("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ WRITE"),
        TxEffect::SetReadWrite
    );
    assert_eq!(
        tx("SET default_transaction_read_only = on"),
        TxEffect::DefaultReadOnly(Some(true))
    );
    assert_eq!(
        tx("SET default_transaction_read_only TO off"),
        TxEffect::DefaultReadOnly(Some(false))
    );
    assert_eq!(
        tx("RESET default_transaction_read_only"),
        TxEffect::DefaultReadOnly(Some(false))
    );
    assert_eq!(
        tx("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"),
        TxEffect::DefaultReadOnly(Some(true))
    );
    check("COMMIT", Target::Any, "transaction");
    check("ROLLBACK", Target::Any, "transaction");
    check("SAVEPOINT a", Target::Any, "transaction");
    check("PREPARE TRANSACTION 'x'", Target::Primary, "two-phase");
    check("COMMIT PREPARED 'x'", Target::Primary, "two-phase");
}

#[test]
fn settings_and_utilities_run_anywhere() {
    check("SET work_mem = '4MB'", Target::Any, "setting");
    check("SHOW work_mem", Target::Any, "SHOW");
    check("DEALLOCATE ALL", Target::Any, "DEALLOCATE");
    check("DISCARD ALL", Target::Any, "DISCARD");
    check("FETCH 10 FROM c", Target::Any, "cursor");
    assert!(!decide("SET work_mem = '4MB'").cacheable);
    assert!(decide("SELECT 1").cacheable);
}

#[test]
fn pgherd_route_setting_is_recognised() {
    let setting = |sql: &str| decide(sql).route_setting;
    assert_eq!(
        setting("SET pgherd.route = replica"),
        Some("replica".into())
    );
    assert_eq!(
        setting("SET pgherd.route TO 'primary'"),
        Some("primary".into())
    );
    assert_eq!(setting("SET pgherd.route = bogus"), Some("bogus".into()));
    assert_eq!(setting("RESET pgherd.route"), Some("auto".into()));
    assert_eq!(setting("SET work_mem = 1"), None);
}

#[test]
fn pgherd_shard_setting_is_recognised() {
    use crate::ShardSetting::{Local, Reset, To};
    let setting = |sql: &str| decide(sql).shard_setting;
    assert_eq!(setting("SET pgherd.shard = 1"), Some(To("1".into())));
    assert_eq!(setting("SET pgherd.shard TO '2'"), Some(To("2".into())));
    assert_eq!(setting("SET pgherd.shard = x"), Some(To("x".into())));
    for reset in [
        "RESET pgherd.shard",
        "SET pgherd.shard TO DEFAULT",
        "RESET ALL",
        "DISCARD ALL",
    ] {
        assert_eq!(setting(reset), Some(Reset), "{reset}");
    }
    assert_eq!(setting("SET LOCAL pgherd.shard = 1"), Some(Local));
    assert_eq!(setting("DISCARD PLANS"), None);
    assert_eq!(setting("SET pgherd.route = primary"), None);
}

#[test]
fn setting_values_are_read_back_from_recorded_statements() {
    use crate::setting_value;
    assert_eq!(setting_value("SET pgherd.shard = 1"), Some("1".into()));
    assert_eq!(setting_value("SET pgherd.shard TO '3'"), Some("3".into()));
    assert_eq!(
        setting_value("SELECT pg_catalog.set_config('pgherd.shard', '2', false)"),
        Some("2".into())
    );
    assert_eq!(setting_value("SELECT 1"), None);
    assert_eq!(setting_value("SET a = 1; SET b = 2"), None);
}

#[test]
fn multiple_statements_take_the_strictest() {
    check(
        "SELECT 1; INSERT INTO t VALUES (1)",
        Target::Primary,
        "INSERT writes",
    );
    check("SET x.y = 1; SELECT 1", Target::Replica, "SELECT reads");
    check("SHOW work_mem; SHOW TimeZone", Target::Any, "SHOW");
    assert_eq!(
        decide("SELECT 1; CREATE TEMP TABLE x (a int)").pin,
        Some(Pin::TempTable)
    );
}

#[test]
fn unparsable_text_goes_to_the_primary() {
    check("SELEC 1", Target::Primary, "cannot be parsed");
    check("", Target::Any, "empty");
}

#[test]
fn temporary_tables_and_transaction_ends() {
    check(
        "SELECT * FROM pg_temp.scratch",
        Target::Primary,
        "temporary table",
    );
    let d = decide("COMMIT");
    assert_eq!((d.target, d.tx), (Target::Any, TxEffect::End));
    let d = decide("COPY t FROM STDIN");
    assert!(d.copy_in && d.target == Target::Primary);
    assert!(!decide("COPY t FROM '/tmp/x'").copy_in);
    assert!(decide("SELECT unknown_fn(1)").needs_catalog);
}

#[test]
fn session_effects() {
    use SessionEffect::*;
    // Plain reads and writes leave nothing behind.
    effect("SELECT abalance FROM pgbench_accounts WHERE aid = 1", None);
    effect(
        "UPDATE pgbench_accounts SET abalance = 1 WHERE aid = 1",
        None,
    );
    effect("SELECT lower('A'), now(), count(*) FROM t", None);
    effect("SET search_path = a", None);
    effect("BEGIN", None);
    // set_config for the session, anywhere in the text, and everything else that can
    // change state pgherd does not follow.
    effect("SELECT set_config('app.tenant_id', '42', false)", Unknown);
    effect(
        "SELECT 1 FROM t WHERE set_config('app.a', 'b', false) IS NOT NULL",
        Unknown,
    );
    effect("VALUES (set_config('app.a', 'b', false))", Unknown);
    effect("SELECT setseed(0.5)", Unknown);
    effect("DO $$ BEGIN CREATE TEMP TABLE tt (x int); END $$", Unknown);
    effect("CALL my_proc()", Unknown);
    effect("SELECT tenant_fn()", Unknown);
    effect("SELECT * FROM generate_series(1, tenant_fn())", Unknown);
    effect("INSERT INTO t VALUES (bump_counter(1))", Unknown);
    effect("SELECT mystery()", Unknown);
    effect("SELECT * FROM audited", Unknown);
    effect("DELETE FROM audited WHERE id = 1", Unknown);
    effect("SELECT * FROM not_in_catalog", Unknown);
    effect("ALTER TABLE t ADD COLUMN b int", Unknown);
    effect("SELECT 1 + 1 AS two; EXECUTE p", Unknown);
    // set_config for the transaction only: as SET LOCAL.
    effect("SELECT set_config('app.tenant_id', $1, true)", None);
    effect(
        "SELECT set_config('app.a', 'x', true), set_config('app.b', 'y', false)",
        Unknown,
    );
    // Sequences: explicit, and through a table's defaults when written.
    effect("SELECT nextval('s')", Sequences);
    effect("INSERT INTO orders (item) VALUES (1)", Sequences);
    effect("SELECT * FROM orders", None);
    // CTE names are not relations.
    effect("WITH w AS (SELECT 1) SELECT * FROM w", None);
    assert_eq!(
        decide("SELECT set_config('app.tenant_id', '42', false)").custom_settings,
        ["app.tenant_id"]
    );
    // A name in a bind parameter: its number, for the proxy to read from each Bind.
    assert_eq!(
        decide("SELECT set_config($2, $1, false), set_config($3::text, 'x', false)")
            .custom_setting_params,
        [2, 3]
    );
    assert!(decide("SELECT set_config('app.a', $1, false)")
        .custom_setting_params
        .is_empty());
    // The setting's name is part of the cache key (the lexer keeps it), so such decisions
    // are cached.
    assert!(decide("SELECT set_config('app.tenant_id', '42', false)").cacheable);
    assert!(decide("SELECT set_config('app.tenant_id', $1, true)").cacheable);
}

#[test]
fn what_a_standby_answers_otherwise_runs_on_the_primary() {
    check(
        "SELECT current_setting('transaction_read_only')",
        Target::Primary,
        "reads setting transaction_read_only",
    );
    check(
        "SELECT pg_catalog.current_setting('in_hot_standby')",
        Target::Primary,
        "in_hot_standby",
    );
    check(
        "SELECT current_setting('search_path'), current_setting('TimeZone')",
        Target::Replica,
        "SELECT reads",
    );
    check(
        "SELECT current_setting(name) FROM t",
        Target::Primary,
        "not a literal",
    );
    check("SHOW transaction_read_only", Target::Primary, "standby");
    check("SHOW ALL", Target::Primary, "standby");
    check("SHOW search_path", Target::Any, "SHOW reads a setting");
    check(
        "SELECT pg_last_wal_replay_lsn()",
        Target::Primary,
        "standby answers otherwise",
    );
    check(
        "SELECT count(*) FROM pg_stat_activity",
        Target::Primary,
        "describes the server",
    );
    check(
        "SELECT setting FROM pg_catalog.pg_settings",
        Target::Primary,
        "describes the server",
    );
    // Decided by the literal, yet cached safely: the name is part of the key.
    let key = |sql: &str| {
        let mut key = Vec::new();
        lex(sql.as_bytes(), true, &mut key);
        key
    };
    assert_ne!(
        key("SELECT current_setting('transaction_read_only')"),
        key("SELECT current_setting('search_pathxxxxxxxx')")
    );
    assert_eq!(
        key("SELECT current_setting('search_path'), 1"),
        key("SELECT current_setting('search_path'), 2")
    );
}

#[test]
fn temporary_objects_and_libraries_pin() {
    let pin = |sql: &str| decide(sql).pin;
    assert_eq!(pin("SELECT 1 INTO TEMP tt"), Some(Pin::TempTable));
    assert_eq!(pin("CREATE TEMP VIEW v AS SELECT 1"), Some(Pin::TempTable));
    assert_eq!(pin("CREATE TEMP SEQUENCE s"), Some(Pin::TempTable));
    assert_eq!(pin("CREATE TABLE pg_temp.tt (a int)"), Some(Pin::TempTable));
    assert_eq!(pin("LOAD 'auto_explain'"), Some(Pin::LoadedLibrary));
    assert!(Pin::LoadedLibrary.forbids_reuse() && !Pin::TempTable.forbids_reuse());
}

#[test]
fn unlogged_relations_are_read_on_the_primary() {
    check("SELECT count(*) FROM staging", Target::Primary, "unlogged");
    check(
        "SELECT * FROM t JOIN staging USING (id)",
        Target::Primary,
        "unlogged",
    );
    check("SELECT * FROM t", Target::Replica, "SELECT reads");
}

#[test]
fn modifying_statements_in_values_lists_and_limits_are_seen() {
    check(
        "VALUES (nextval('s'))",
        Target::Primary,
        "volatile function nextval",
    );
    check(
        "SELECT 1 LIMIT bump_counter(1)",
        Target::Primary,
        "bump_counter",
    );
}

#[test]
fn text_that_cannot_be_read_safely_goes_to_the_primary() {
    let deep = format!("SELECT {}", vec!["1"; 2_000].join("+"));
    let d = decide(&deep);
    assert_eq!(
        (d.target, d.session, d.cacheable),
        (Target::Primary, SessionEffect::Unknown, false)
    );
    assert!(d.reason.contains("nests too deeply"), "{}", d.reason);
    let large = "SELECT 1;".repeat(300_000);
    let d = decide(&large);
    assert!(d.reason.contains("more than the"), "{}", d.reason);
    assert_eq!(d.target, Target::Primary);
    // With standard_conforming_strings off the parser library would read this otherwise.
    let sql = r"SELECT 'a\' , 'b; DELETE FROM t; --'";
    let mut key = Vec::new();
    let lexed = lex(sql.as_bytes(), false, &mut key);
    let d = classify(sql, &lexed, &Catalog, DEFAULT_MAX_PARSE_BYTES);
    assert_eq!(
        (d.target, d.session),
        (Target::Primary, SessionEffect::Unknown)
    );
    assert!(
        d.reason.contains("standard_conforming_strings"),
        "{}",
        d.reason
    );
    // With it on too: a statement pipelined just before may have turned it off.
    check(sql, Target::Primary, "backslash");
}
