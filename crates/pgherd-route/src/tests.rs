//! One line per rule: input SQL → where it runs and why.

use super::*;

/// A catalog where `nextval`, `setval` and `bump_counter` are volatile and `lower`,
/// `now` and `count` are not; anything else is unknown.
struct Catalog;

impl FunctionCatalog for Catalog {
    fn volatile(&self, name: &str) -> Option<bool> {
        match name {
            "nextval" | "setval" | "bump_counter" | "txid_current" | "pg_advisory_xact_lock" => {
                Some(true)
            }
            "lower" | "now" | "count" | "sum" | "abs" => Some(false),
            _ => None,
        }
    }
}

#[track_caller]
fn check(sql: &str, target: Target, reason_contains: &str) {
    let d = classify(sql, &Catalog);
    assert_eq!(d.target, target, "{sql}: {}", d.reason);
    assert!(
        d.reason.contains(reason_contains),
        "{sql}: reason {:?} lacks {reason_contains:?}",
        d.reason
    );
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
    check("CALL my_proc()", Target::Primary, "primary runs it");
    check(
        "DO $$ BEGIN PERFORM 1; END $$",
        Target::Primary,
        "primary runs it",
    );
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
    let pin = |sql: &str| classify(sql, &Catalog).pin;
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
    let tx = |sql: &str| classify(sql, &Catalog).tx;
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
    assert_eq!(tx("BEGIN"), TxEffect::Begin { read_only: false });
    assert_eq!(
        tx("BEGIN TRANSACTION READ ONLY"),
        TxEffect::Begin { read_only: true }
    );
    assert_eq!(tx("BEGIN READ WRITE"), TxEffect::Begin { read_only: false });
    assert_eq!(tx("SET TRANSACTION READ ONLY"), TxEffect::SetReadOnly);
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
    assert!(!classify("SET work_mem = '4MB'", &Catalog).cacheable);
    assert!(classify("SELECT 1", &Catalog).cacheable);
}

#[test]
fn pgherd_route_setting_is_recognised() {
    let setting = |sql: &str| classify(sql, &Catalog).route_setting;
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
fn multiple_statements_take_the_strictest() {
    check(
        "SELECT 1; INSERT INTO t VALUES (1)",
        Target::Primary,
        "INSERT writes",
    );
    check("SET x.y = 1; SELECT 1", Target::Replica, "SELECT reads");
    check("SHOW work_mem; SHOW TimeZone", Target::Any, "SHOW");
    assert_eq!(
        classify("SELECT 1; CREATE TEMP TABLE x (a int)", &Catalog).pin,
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
    let d = classify("COMMIT", &Catalog);
    assert_eq!((d.target, d.tx), (Target::Any, TxEffect::End));
    let d = classify("COPY t FROM STDIN", &Catalog);
    assert!(d.copy_in && d.target == Target::Primary);
    assert!(!classify("COPY t FROM '/tmp/x'", &Catalog).copy_in);
    assert!(classify("SELECT unknown_fn(1)", &Catalog).needs_catalog);
}
