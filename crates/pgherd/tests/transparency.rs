//! Issue 16: what an application sees through pgherd is what it would see from PostgreSQL,
//! with read/write splitting on and in each pool mode: unlogged tables, settings a standby
//! reports otherwise, SQL that names protocol-level statements, statements whose types were
//! recreated, the server's ParameterStatus values, and the backend's identity in session mode.

mod common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::*;
use pgherd_testkit::raw::{errors, first_column, Message, RawClient};
use pgherd_wire::frontend;

fn drivers_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/drivers")
}

/// Parse (named), Bind, Execute, Sync: the statement's rows and errors.
fn run_prepared(c: &mut RawClient, name: &str, sql: &str, param: Option<&str>) -> Vec<Message> {
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, name.as_bytes(), sql.as_bytes(), &[0, 0]).unwrap();
    bind_execute(&mut out, name, param);
    c.send(&out);
    c.recv_until_ready()
}

fn bind_execute(out: &mut BytesMut, name: &str, param: Option<&str>) {
    let mut rest = Vec::new();
    rest.extend_from_slice(&0i16.to_be_bytes());
    match param {
        Some(p) => {
            rest.extend_from_slice(&1i16.to_be_bytes());
            rest.extend_from_slice(&(p.len() as i32).to_be_bytes());
            rest.extend_from_slice(p.as_bytes());
        }
        None => rest.extend_from_slice(&0i16.to_be_bytes()),
    }
    rest.extend_from_slice(&0i16.to_be_bytes());
    frontend::encode_bind(out, b"", name.as_bytes(), &rest).unwrap();
    frontend::encode_execute(out, b"", 0).unwrap();
    frontend::encode_sync(out);
}

/// Unlogged tables (created through pgherd, or directly on the primary a moment ago) are
/// read on the primary; a standby's `transaction_read_only` never shows; ordinary reads stay
/// on the replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_standby_cannot_read_or_answers_otherwise_runs_on_the_primary() {
    let env = env(2, |c| c);
    let primary = env.cluster.primary().port.to_string();
    env.direct("CREATE TABLE plain (x int); INSERT INTO plain SELECT generate_series(1, 100); GRANT ALL ON plain TO app");
    env.cluster.wait_replayed();
    let c = env.app().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while first_value(&c, "SELECT current_setting('port') FROM plain LIMIT 1")
        .await
        .unwrap()
        == primary
    {
        assert!(Instant::now() < deadline, "reads never reached a replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Made through pgherd, read by a new session at once.
    c.batch_execute("CREATE UNLOGGED TABLE ul (x int); INSERT INTO ul VALUES (1), (2)")
        .await
        .unwrap();
    let other = env.app().await;
    assert_eq!(
        first_value(&other, "SELECT count(*) FROM ul")
            .await
            .unwrap(),
        "2"
    );
    // Made behind pgherd's back, read at once (a standby refuses it; pgherd runs it again on
    // the primary), with the simple and the extended protocol.
    env.direct(
        "CREATE UNLOGGED TABLE ul2 (x int); INSERT INTO ul2 VALUES (1); GRANT ALL ON ul2 TO app",
    );
    assert_eq!(
        first_value(&other, "SELECT count(*) FROM ul2")
            .await
            .unwrap(),
        "1"
    );
    env.direct("CREATE UNLOGGED TABLE ul3 (x int); INSERT INTO ul3 VALUES (1), (2), (3); GRANT ALL ON ul3 TO app");
    let row = other
        .query_one("SELECT count(*) FROM ul3", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 3);
    // Remembered: the next time it goes straight to the primary.
    assert_eq!(
        first_value(&other, "SELECT count(*) FROM ul2")
            .await
            .unwrap(),
        "1"
    );

    // Made on the primary a moment ago, not replayed by the replicas yet (replay paused): the
    // replica lacks the table, and the primary answers, with either protocol.
    for replica in ["pg2", "pg3"] {
        env.cluster
            .sql_on(replica, "postgres", "SELECT pg_wal_replay_pause()");
    }
    env.direct(
        "CREATE TABLE fresh (x int); INSERT INTO fresh VALUES (7); GRANT ALL ON fresh TO app",
    );
    assert_eq!(
        first_value(&other, "SELECT max(x) FROM fresh")
            .await
            .unwrap(),
        "7"
    );
    let row = other
        .query_one("SELECT max(x) FROM fresh", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i32>>(0), Some(7));
    for replica in ["pg2", "pg3"] {
        env.cluster
            .sql_on(replica, "postgres", "SELECT pg_wal_replay_resume()");
    }
    // A name nobody has is the primary's error too.
    let missing = first_value(&other, "SELECT * FROM no_such_table")
        .await
        .unwrap_err();
    assert_eq!(
        missing.code(),
        Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE)
    );

    // Settings a standby reports otherwise.
    assert_eq!(
        first_value(&other, "SELECT current_setting('transaction_read_only')")
            .await
            .unwrap(),
        "off"
    );
    assert_eq!(
        first_value(&other, "SHOW transaction_read_only")
            .await
            .unwrap(),
        "off"
    );
    assert_eq!(
        first_value(&other, "SELECT pg_is_in_recovery()")
            .await
            .unwrap(),
        "f"
    );
    other.batch_execute("BEGIN READ ONLY").await.unwrap();
    assert_eq!(
        first_value(&other, "SELECT current_setting('transaction_read_only')")
            .await
            .unwrap(),
        "on"
    );
    other.batch_execute("COMMIT").await.unwrap();

    // Ordinary reads did not move: all of 60 on the replicas.
    let reader = env.app().await;
    let mut on_primary = 0;
    for i in 0..60 {
        let port = first_value(
            &reader,
            &format!(
                "SELECT current_setting('port') FROM plain WHERE x = {}",
                i % 100 + 1
            ),
        )
        .await
        .unwrap();
        on_primary += usize::from(port == primary);
    }
    assert_eq!(on_primary, 0, "ordinary reads went to the primary");
}

/// A read a replica refuses after some of its rows went to the client is not run again on the
/// primary, where its rows would come a second time: the client gets the rows and the
/// replica's error, with either protocol. One refused before any row is, and the client sees
/// one row description, not the replica's and the primary's. Rows and a simple query's row
/// description pass the relay in runs of their own, so this pins what such a run must still
/// count: each row as an answer, each row description as an acknowledgement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_a_replica_refuses_runs_again_on_the_primary_only_if_no_row_went_out() {
    let env = env(2, |c| c);
    let primary = env.cluster.primary().port.to_string();
    // Stable by its declaration, so routed to a replica, but it draws from a sequence from
    // its third row on, which a standby refuses.
    env.direct(
        "CREATE TABLE numbers (x int); INSERT INTO numbers SELECT generate_series(1, 5); \
         CREATE SEQUENCE drawn START 100; \
         CREATE FUNCTION from_three(i int) RETURNS bigint STABLE LANGUAGE plpgsql AS \
         $$ BEGIN IF i >= 3 THEN RETURN nextval('drawn'); END IF; RETURN i; END $$; \
         GRANT ALL ON numbers, drawn TO app",
    );
    env.cluster.wait_replayed();
    let c = env.app().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while first_value(
        &c,
        "SELECT current_setting('port'), from_three(1) FROM numbers LIMIT 1",
    )
    .await
    .unwrap()
        == primary
    {
        assert!(Instant::now() < deadline, "reads never reached a replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let port = env.pgherd.port;
    let mut raw = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let read_only = pgherd_wire::SqlState::READ_ONLY_SQL_TRANSACTION;
    let after_rows = "SELECT from_three(x) FROM numbers";
    // Reads go to the replicas; should one go to the primary after all (a replica briefly
    // out of the read set), it answers every row once, and the next try is read again.
    let mut refused = [false, false];
    for _ in 0..20 {
        for (protocol, answer) in [
            raw.query(after_rows),
            run_prepared(&mut raw, "after_rows", after_rows, None),
        ]
        .into_iter()
        .enumerate()
        {
            let values = first_column(&answer);
            assert_eq!(values[..2], ["1", "2"], "{answer:?}");
            let errors = errors(&answer);
            if errors.is_empty() {
                assert_eq!(values.len(), 5, "{answer:?}");
                continue;
            }
            assert_eq!(values.len(), 2, "{answer:?}");
            assert_eq!(errors.len(), 1, "{errors:?}");
            assert_eq!(errors[0].code, read_only, "{errors:?}");
            refused[protocol] = true;
        }
        if refused == [true, true] {
            break;
        }
    }
    assert_eq!(refused, [true, true], "never refused by a replica");

    let before_rows = "SELECT from_three(x) FROM numbers WHERE x >= 3";
    // One row description for the simple query; the extended protocol asked for none.
    for (answer, descriptions_owed) in [
        (raw.query(before_rows), 1),
        (run_prepared(&mut raw, "before_rows", before_rows, None), 0),
    ] {
        assert!(errors(&answer).is_empty(), "{:?}", errors(&answer));
        let descriptions = answer
            .iter()
            .filter(|(tag, _)| *tag == pgherd_wire::backend::tag::ROW_DESCRIPTION)
            .count();
        assert_eq!(descriptions, descriptions_owed, "{answer:?}");
        let drawn: Vec<i64> = first_column(&answer)
            .iter()
            .map(|v| v.parse().unwrap())
            .collect();
        assert_eq!(drawn.len(), 3, "{answer:?}");
        assert!(drawn[0] >= 100 && drawn.windows(2).all(|w| w[1] == w[0] + 1));
    }
}

/// psycopg with the system's libpq (older than 17) evicts statements with SQL `DEALLOCATE
/// name`; SQL `EXECUTE` and `DEALLOCATE` name statements made through the protocol; `DISCARD
/// ALL` forgets them; SQL `PREPARE`d ones are usable through the protocol; in every pool mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_protocol_prepared_statements_meet_as_on_postgresql() {
    let env = env(1, |c| {
        c.max_size(2)
            .database(APP, "mode = \"transaction\"")
            .database("app_statement", "dbname = \"app\"\nmode = \"statement\"")
            .database("app_session", "dbname = \"app\"\nmode = \"session\"")
    });
    let port = env.pgherd.port;
    let out = std::process::Command::new("python3")
        .arg(drivers_dir().join("python/transparency.py"))
        .arg("psycopg")
        .env("PSYCOPG_IMPL", "python")
        .env("PGHERD_HOST", "127.0.0.1")
        .env("PGHERD_PORT", port.to_string())
        .env("PGHERD_USER", APP)
        .env("PGHERD_PASSWORD", APP_PASSWORD)
        .env("PGHERD_DB", APP)
        .output()
        .expect("run python3");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "psycopg with the system libpq:\n{text}"
    );
    assert!(text.contains("implementation python"), "{text}");
    for (database, transactions) in [(APP, true), ("app_statement", false), ("app_session", true)] {
        prepared_statements_meet(port, database, transactions);
    }
}

fn prepared_statements_meet(port: u16, database: &str, transactions: bool) {
    let mut c = RawClient::login(port, APP, database, APP_PASSWORD).unwrap();
    let answer = run_prepared(&mut c, "s1", "SELECT $1::int * 2", Some("21"));
    assert_eq!(first_column(&answer), ["42"], "{database}");
    // SQL EXECUTE of the protocol-level statement, inside a transaction too.
    assert_eq!(
        first_column(&c.query("EXECUTE s1(5)")),
        ["10"],
        "{database}"
    );
    if transactions {
        c.query("BEGIN");
        assert_eq!(
            first_column(&c.query("EXECUTE s1(6)")),
            ["12"],
            "{database}"
        );
        c.query("COMMIT");
    }
    // SQL DEALLOCATE forgets it; the protocol then finds nothing, as PostgreSQL would say.
    let answer = c.query("DEALLOCATE s1");
    assert!(
        errors(&answer).is_empty(),
        "{database}: {:?}",
        errors(&answer)
    );
    let mut out = BytesMut::new();
    bind_execute(&mut out, "s1", Some("1"));
    c.send(&out);
    let errs = errors(&c.recv_until_ready());
    assert_eq!(errs[0].code.code(), "26000", "{database}: {}", errs[0]);
    // DISCARD ALL forgets every statement.
    run_prepared(&mut c, "s2", "SELECT 2", None);
    c.query("DISCARD ALL");
    let mut out = BytesMut::new();
    bind_execute(&mut out, "s2", None);
    c.send(&out);
    assert_eq!(
        errors(&c.recv_until_ready())[0].code.code(),
        "26000",
        "{database}"
    );
    // SQL PREPARE, then Bind through the protocol under its own name (the session is pinned
    // to its server, where the statement lives).
    c.query("PREPARE by_sql(int) AS SELECT $1 + 1");
    let mut out = BytesMut::new();
    bind_execute(&mut out, "by_sql", Some("41"));
    c.send(&out);
    assert_eq!(first_column(&c.recv_until_ready()), ["42"], "{database}");
}

/// A statement prepared against a type that is then dropped and made again, or made inside
/// a savepoint that rolls back, works when prepared again, as on PostgreSQL: pgherd does not
/// hand out the server's stale copy.
#[test]
fn statements_follow_types_made_again() {
    let env = env(0, |c| c.max_size(1));
    env.direct("CREATE TYPE mood AS ENUM ('sad', 'ok'); GRANT USAGE ON TYPE mood TO app; GRANT CREATE ON SCHEMA public TO app");
    let port = env.pgherd.port;
    let mut a = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let sql = "SELECT $1::text::mood::text";
    assert_eq!(
        first_column(&run_prepared(&mut a, "m", sql, Some("ok"))),
        ["ok"]
    );
    drop(a);
    // The type made again, with another value, through pgherd.
    let mut ddl = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    ddl.query("DROP TYPE mood");
    ddl.query("CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')");
    drop(ddl);
    let mut b = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let answer = run_prepared(&mut b, "m", sql, Some("happy"));
    assert!(errors(&answer).is_empty(), "{:?}", errors(&answer));
    assert_eq!(first_column(&answer), ["happy"]);

    // Inside a savepoint that rolls back.
    b.query("BEGIN");
    b.query("SAVEPOINT s");
    b.query("DROP TYPE mood");
    b.query("CREATE TYPE mood AS ENUM ('only')");
    let answer = run_prepared(&mut b, "n", sql, Some("only"));
    assert_eq!(first_column(&answer), ["only"], "{:?}", errors(&answer));
    b.query("ROLLBACK TO SAVEPOINT s");
    let answer = run_prepared(&mut b, "o", sql, Some("happy"));
    assert_eq!(first_column(&answer), ["happy"], "{:?}", errors(&answer));
    b.query("COMMIT");
    // Made again behind pgherd's back: the server's error makes pgherd prepare afresh.
    env.direct(
        "DROP TYPE mood; CREATE TYPE mood AS ENUM ('back'); GRANT USAGE ON TYPE mood TO app",
    );
    let first = run_prepared(&mut b, "p", sql, Some("back"));
    let second = run_prepared(&mut b, "q", sql, Some("back"));
    assert!(
        first_column(&first) == ["back"] || first_column(&second) == ["back"],
        "{:?} / {:?}",
        errors(&first),
        errors(&second)
    );

    // A schema per tenant: the same text names another table (with other columns) under
    // each client's search_path, set at login or with SET. Each gets its own tenant's
    // rows, on the first try, over the one server connection they share.
    env.direct(
        "CREATE SCHEMA tenant_a AUTHORIZATION app; CREATE SCHEMA tenant_b AUTHORIZATION app; \
         CREATE TABLE tenant_a.t (x int); INSERT INTO tenant_a.t VALUES (1); \
         CREATE TABLE tenant_b.t (x text, y text); INSERT INTO tenant_b.t VALUES ('b', 'bee'); \
         ALTER TABLE tenant_a.t OWNER TO app; ALTER TABLE tenant_b.t OWNER TO app",
    );
    let tenant = |schema: &str| {
        RawClient::login_with(
            port,
            &[
                ("user", APP),
                ("database", APP),
                ("options", &format!("-c search_path={schema}")),
            ],
            APP_PASSWORD,
        )
        .unwrap()
    };
    let (mut a, mut b) = (tenant("tenant_a"), tenant("tenant_b"));
    for round in 0..2 {
        let answer = run_prepared(&mut a, &format!("t{round}"), "SELECT * FROM t", None);
        assert_eq!(first_column(&answer), ["1"], "{:?}", errors(&answer));
        let answer = run_prepared(&mut b, &format!("t{round}"), "SELECT * FROM t", None);
        assert_eq!(first_column(&answer), ["b"], "{:?}", errors(&answer));
    }
    b.query("SET search_path = tenant_a");
    let answer = run_prepared(&mut b, "after_set", "SELECT * FROM t", None);
    assert_eq!(first_column(&answer), ["1"], "{:?}", errors(&answer));
}

/// Reads reach the replica `pg2` (it joined the read set).
async fn wait_for_replica_reads(env: &Env, c: &tokio_postgres::Client) {
    let replica = env.cluster.node("pg2").port.to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    while first_value(c, "SELECT current_setting('port')")
        .await
        .unwrap()
        != replica
    {
        assert!(Instant::now() < deadline, "reads never reached the replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A driver's prepared statement after another session made its type again through pgherd:
/// under read-your-writes no session reads a replica that has not replayed a schema change
/// made through pgherd; under eventual consistency a statement pgherd prepares again on a
/// replica that lacks its type runs on the primary; a type gone everywhere is the server's
/// error, never an answer with neither rows nor error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_prepared_again_after_another_sessions_schema_change() {
    let env = env(1, |c| {
        c.database(APP, "")
            .database("eventual", "dbname = \"app\"\nconsistency = \"eventual\"")
            .database("session", "dbname = \"app\"\nmode = \"session\"")
    });
    env.direct("GRANT CREATE ON SCHEMA public TO app");
    let ddl = env.app().await;
    ddl.batch_execute("CREATE TYPE mood2 AS ENUM ('a', 'b')")
        .await
        .unwrap();
    env.cluster.wait_replayed();
    let value = |row: tokio_postgres::Row| row.get::<_, String>(0);
    let sql = "SELECT $1::text::mood2::text";
    let (pause, resume) = (
        "SELECT pg_wal_replay_pause()",
        "SELECT pg_wal_replay_resume()",
    );

    // Eventual: the replica has replayed the drop, not the new type.
    let eventual = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "eventual")).await;
    wait_for_replica_reads(&env, &eventual).await;
    let eventual_statement = eventual.prepare(sql).await.unwrap();
    let row = eventual.query_one(&eventual_statement, &[&"a"]).await;
    assert_eq!(value(row.unwrap()), "a");
    ddl.batch_execute("DROP TYPE mood2").await.unwrap();
    env.cluster.wait_replayed();
    env.cluster.sql_on("pg2", "postgres", pause);
    ddl.batch_execute("CREATE TYPE mood2 AS ENUM ('a', 'b', 'c')")
        .await
        .unwrap();
    for _ in 0..3 {
        let row = eventual.query_one(&eventual_statement, &[&"c"]).await;
        assert_eq!(value(row.unwrap()), "c");
    }
    env.cluster.sql_on("pg2", "postgres", resume);
    env.cluster.wait_replayed();

    // Read-your-writes: the replica has replayed neither the drop nor the new type, made by
    // a session-mode session.
    let session_ddl = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "session")).await;
    let own = env.app().await;
    wait_for_replica_reads(&env, &own).await;
    let statement = own.prepare(sql).await.unwrap();
    assert_eq!(
        value(own.query_one(&statement, &[&"c"]).await.unwrap()),
        "c"
    );
    env.cluster.sql_on("pg2", "postgres", pause);
    session_ddl
        .batch_execute("DROP TYPE mood2; CREATE TYPE mood2 AS ENUM ('a', 'b', 'c', 'd')")
        .await
        .unwrap();
    for _ in 0..3 {
        let row = own.query_one(&statement, &[&"d"]).await;
        assert_eq!(value(row.unwrap()), "d");
    }
    env.cluster.sql_on("pg2", "postgres", resume);
    // Once the replica has replayed the change, reads go back to it (the session that made
    // it holds nothing back).
    wait_for_replica_reads(&env, &own).await;

    // Gone everywhere: the server's error, and the sessions go on.
    ddl.batch_execute("DROP TYPE mood2").await.unwrap();
    env.cluster.wait_replayed();
    for (c, statement) in [(&own, &statement), (&eventual, &eventual_statement)] {
        let gone = c.query_one(statement, &[&"a"]).await.unwrap_err();
        assert_eq!(
            gone.code(),
            Some(&tokio_postgres::error::SqlState::UNDEFINED_OBJECT),
            "{gone:?}"
        );
        assert_eq!(first_value(c, "SELECT 41 + 1").await.unwrap(), "42");
    }
}

/// Startup settings come back as the server reports them.
#[test]
fn parameter_status_is_the_servers() {
    let env = env(0, |c| c);
    let port = env.pgherd.port;
    for (encoding, reported) in [("utf8", "UTF8"), ("eucjp", "EUC_JP"), ("LATIN1", "LATIN1")] {
        let mut c = RawClient::login_with(
            port,
            &[
                ("user", APP),
                ("database", APP),
                ("client_encoding", encoding),
            ],
            APP_PASSWORD,
        )
        .unwrap();
        assert_eq!(
            c.parameter("client_encoding").as_deref(),
            Some(reported),
            "{encoding}"
        );
        assert_eq!(first_column(&c.query("SHOW client_encoding")), [reported]);
    }
    let c = RawClient::login_with(
        port,
        &[("user", APP), ("database", APP), ("DateStyle", "german")],
        APP_PASSWORD,
    )
    .unwrap();
    assert_eq!(c.parameter("DateStyle").as_deref(), Some("German, DMY"));
}

/// Session mode: the client knows its server's process id (pg_backend_pid(),
/// pg_terminate_backend from another session, its own notifications); transaction mode: its
/// own notifications carry the process id it was given.
#[test]
fn the_backend_identity_is_the_clients() {
    let env = env(0, |c| {
        c.database(APP, "mode = \"session\"")
            .database("postgres", "mode = \"transaction\"")
    });
    let port = env.pgherd.port;
    let mut a = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let pid = a.key.unwrap().process_id;
    assert_eq!(
        first_column(&a.query("SELECT pg_backend_pid()")),
        [pid.to_string()]
    );
    let notified = |c: &mut RawClient, pid: i32| {
        let answer = c.query("LISTEN ch; NOTIFY ch, 'hi'");
        let notes: Vec<i32> = answer
            .iter()
            .filter(|(t, _)| *t == b'A')
            .map(|(_, b)| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(notes, [pid], "notifications {answer:?}");
    };
    notified(&mut a, pid);
    // Cancel still goes through pgherd with the id the client knows.
    let mut b = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    assert_ne!(b.key.unwrap().process_id, pid);
    assert_eq!(
        first_column(&b.query(&format!("SELECT pg_terminate_backend({pid})"))),
        ["t"]
    );
    let last: Vec<Message> = std::iter::from_fn(|| a.recv()).collect();
    assert!(
        !errors(&last).is_empty(),
        "the client whose backend was terminated is told and closed: {last:?}"
    );
    // Transaction mode: the id is pgherd's, and the session's own notifications carry it.
    let mut t = RawClient::login(port, APP, "postgres", APP_PASSWORD).unwrap();
    let tpid = t.key.unwrap().process_id;
    notified(&mut t, tpid);
}
