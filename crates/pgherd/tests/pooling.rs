//! Pooling through pgherd against real PostgreSQL: every pool mode with psql and pgbench,
//! prepared statements shared safely between clients, pipelines, session settings, COPY, pool
//! exhaustion, clients that leave mid-transaction, and server connections through a node's
//! Unix-domain socket.

mod common;

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use common::*;
use futures_util::{SinkExt, StreamExt};
use pgherd_testkit::raw::{errors, first_column, RawClient};
use pgherd_testkit::{Pgherd, PgherdConfig};
use pgherd_wire::frontend;

#[test]
fn psql_and_pgbench_in_every_pool_mode() {
    let env = env(0, |c| c.max_size(4));
    pgbench(&env.app_url(), &["-i", "-s", "1", "-q"]).expect("pgbench -i through pgherd");
    for mode in ["session", "transaction", "statement"] {
        // Session mode needs a server per client; the others share four among eight clients.
        let max_size = if mode == "session" { 8 } else { 4 };
        let config =
            PgherdConfig::new()
                .mode(mode)
                .max_size(max_size)
                .user(APP, &env.app_verifier, "");
        let pgherd = Pgherd::start(BIN, &env.cluster, &config);
        let url = pgherd.url(APP, APP_PASSWORD, APP);
        let table = format!("psql_{mode}");
        let out = psql(
            &url,
            &[
                "-c",
                &format!("CREATE TABLE {table} (id int)"),
                "-c",
                &format!("INSERT INTO {table} SELECT generate_series(1, 100)"),
                "-c",
                &format!("SELECT count(*), sum(id) FROM {table}"),
            ],
        )
        .unwrap_or_else(|e| panic!("psql in {mode} mode: {e}"));
        assert_eq!(out, "100|5050", "psql in {mode} mode");
        for protocol in ["simple", "extended", "prepared"] {
            let out = pgbench(
                &url,
                &["-S", "-c", "8", "-j", "2", "-T", "2", "-M", protocol],
            )
            .unwrap_or_else(|e| panic!("pgbench -S -M {protocol} in {mode} mode failed:\n{e}"));
            assert!(
                out.contains("number of failed transactions: 0"),
                "{mode}/{protocol}: {out}"
            );
        }
        let tpcb = pgbench(&url, &["-c", "4", "-j", "2", "-T", "2"]);
        if mode == "statement" {
            let err = tpcb.expect_err("TPC-B uses BEGIN, which statement mode refuses");
            assert!(
                err.contains("transaction blocks are not allowed in statement pooling mode"),
                "{err}"
            );
        } else {
            let out = tpcb.unwrap_or_else(|e| panic!("pgbench TPC-B in {mode} mode failed:\n{e}"));
            assert!(
                out.contains("number of failed transactions: 0"),
                "{mode}: {out}"
            );
        }
    }
}

/// A node with `socket_dir`: pgherd's server connections go through its Unix-domain socket
/// (the server sees no client address), pgbench runs through (the health checks that make the
/// node the primary go there too), and a cancel reaches the backend through the socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connections_through_the_nodes_unix_socket() {
    let env = env_on_sockets(0, |c| c.max_size(4).mode("transaction"));
    let c = env.app().await;
    assert_eq!(
        one(&c, "SELECT inet_client_addr() IS NULL").await,
        "t",
        "the server connection came over TCP"
    );

    pgbench(&env.app_url(), &["-i", "-s", "1", "-q"]).expect("pgbench -i through pgherd");
    let out = pgbench(&env.app_url(), &["-c", "8", "-j", "2", "-t", "200", "-S"])
        .expect("pgbench through the socket");
    assert!(out.contains("number of failed transactions: 0"), "{out}");

    cancel_ends_a_sleep(c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundred_clients_with_prepared_statements_share_five_server_connections() {
    let env = env(0, |c| c.max_size(5).mode("transaction"));
    let setup = env.app().await;
    setup.batch_execute("CREATE TABLE kv (k int PRIMARY KEY, v text); INSERT INTO kv SELECT i, 'v' || i FROM generate_series(1, 1000) i").await.unwrap();
    let mut tasks = Vec::new();
    for client_no in 0..100 {
        let conninfo = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
        tasks.push(tokio::spawn(async move {
            let client = connect(&conninfo).await;
            // Each client prepares its own statements; texts differ per client group so
            // server-side statements are both shared and distinct.
            let get = client
                .prepare("SELECT v FROM kv WHERE k = $1")
                .await
                .unwrap();
            let add = client
                .prepare(&format!("SELECT $1::int + {}", client_no % 7))
                .await
                .unwrap();
            for i in 0..50 {
                let k = (client_no * 50 + i) % 1000 + 1;
                let row = client.query_one(&get, &[&k]).await.unwrap();
                assert_eq!(row.get::<_, String>(0), format!("v{k}"));
                let row = client.query_one(&add, &[&i]).await.unwrap();
                assert_eq!(row.get::<_, i32>(0), i + client_no % 7);
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let backends = app_backends(&env);
    assert!(
        backends <= 5,
        "pgherd opened {backends} server connections with max_size 5"
    );
}

/// Two workers lend one small pool's connections to many clients at once, each worker from
/// its own lane of idle connections: every request is served (a client left waiting while a
/// connection sat idle in another worker's lane would time out after 20 s), no more than
/// `max_size` connections are opened, and once the clients are done the pool counts every
/// connection idle again, none lent, connecting or waited for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_a_small_pool_and_its_counts_come_back_whole() {
    let env = env(0, |c| {
        c.superuser()
            .max_size(3)
            .wait_timeout_ms(20_000)
            .mode("transaction")
            .proxy("workers = 2")
            .proxy("admin_users = [\"postgres\"]")
    });
    let mut tasks = Vec::new();
    for client_no in 0..40 {
        let conninfo = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
        tasks.push(tokio::spawn(async move {
            let client = connect(&conninfo).await;
            for i in 0..100 {
                if i % 5 == 0 {
                    client
                        .batch_execute("BEGIN; SELECT pg_backend_pid(); COMMIT")
                        .await
                        .expect("a transaction");
                } else {
                    let n = client_no * 1000 + i;
                    let row = client.query_one("SELECT $1::int", &[&n]).await.unwrap();
                    assert_eq!(row.get::<_, i32>(0), n);
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
    let backends = app_backends(&env);
    assert!(
        (1..=3).contains(&backends),
        "{backends} server connections with max_size 3"
    );
    let pools = psql(
        &env.pgherd
            .url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd"),
        &["-A", "-t", "-c", "SHOW POOLS"],
    )
    .expect("SHOW POOLS");
    let row: Vec<&str> = pools
        .lines()
        .find(|line| line.starts_with("app|app|"))
        .unwrap_or_else(|| panic!("no pool for app:\n{pools}"))
        .split('|')
        .collect();
    // cl_waiting, sv_active, sv_idle, sv_connecting
    assert_eq!(row[4..8], ["0", "0", &backends.to_string(), "0"], "{pools}");
}

/// Two clients use the same statement name for different statements on one shared server
/// connection; each must run its own.
#[test]
fn statement_names_from_different_clients_never_collide() {
    let env = env(0, |c| c.max_size(1));
    let mut a = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let mut b = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let prepare = |name: &str, sql: &str| {
        let mut out = BytesMut::new();
        frontend::encode_parse(&mut out, name.as_bytes(), sql.as_bytes(), &[0, 0]).unwrap();
        frontend::encode_sync(&mut out);
        out
    };
    let execute = |name: &str| {
        let mut out = BytesMut::new();
        frontend::encode_bind(&mut out, b"", name.as_bytes(), &[0, 0, 0, 0, 0, 0]).unwrap();
        frontend::encode_execute(&mut out, b"", 0).unwrap();
        frontend::encode_sync(&mut out);
        out
    };
    a.send(&prepare("S_1", "SELECT 'from a'"));
    assert!(errors(&a.recv_until_ready()).is_empty());
    b.send(&prepare("S_1", "SELECT 'from b'"));
    assert!(errors(&b.recv_until_ready()).is_empty());
    for _ in 0..3 {
        a.send(&execute("S_1"));
        assert_eq!(first_column(&a.recv_until_ready()), ["from a"]);
        b.send(&execute("S_1"));
        assert_eq!(first_column(&b.recv_until_ready()), ["from b"]);
    }
    // A name the client never prepared is an error, as PostgreSQL says it.
    a.send(&execute("S_2"));
    let err = errors(&a.recv_until_ready());
    assert_eq!(err[0].code.code(), "26000", "{err:?}");
    // Redefining a live name is refused; closing it frees the name.
    a.send(&prepare("S_1", "SELECT 'again'"));
    assert_eq!(errors(&a.recv_until_ready())[0].code.code(), "42P05");
    let mut close = BytesMut::new();
    frontend::encode_close(&mut close, frontend::Target::Statement, b"S_1").unwrap();
    frontend::encode_sync(&mut close);
    a.send(&close);
    assert!(errors(&a.recv_until_ready()).is_empty());
    a.send(&prepare("S_1", "SELECT 'again'"));
    assert!(errors(&a.recv_until_ready()).is_empty());
    a.send(&execute("S_1"));
    assert_eq!(first_column(&a.recv_until_ready()), ["again"]);
}

/// A pipeline with several Syncs keeps its server connection until the last ReadyForQuery it
/// is owed, even while another client waits for that connection.
#[test]
fn pipeline_with_several_syncs_keeps_its_server() {
    let env = env(0, |c| c.max_size(1));
    let mut a = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let mut b = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let mut pipeline = BytesMut::new();
    for (i, sql) in ["SELECT 'a1', pg_sleep(0.2)", "SELECT 'a2'", "SELECT 'a3'"]
        .iter()
        .enumerate()
    {
        frontend::encode_parse(&mut pipeline, b"", sql.as_bytes(), &[0, 0]).unwrap();
        frontend::encode_bind(&mut pipeline, b"", b"", &[0, 0, 0, 0, 0, 0]).unwrap();
        frontend::encode_execute(&mut pipeline, b"", 0).unwrap();
        frontend::encode_sync(&mut pipeline);
        if i == 0 {
            frontend::encode_query(&mut pipeline, b"SELECT 'a-simple'").unwrap();
        }
    }
    a.send(&pipeline);
    std::thread::sleep(Duration::from_millis(50));
    let b_thread = std::thread::spawn(move || {
        let answer = first_column(&b.query("SELECT 'b'"));
        (b, answer)
    });
    let mut got = Vec::new();
    for _ in 0..4 {
        got.extend(first_column(&a.recv_until_ready()));
    }
    assert_eq!(got, ["a1", "a-simple", "a2", "a3"]);
    let (_, b_answer) = b_thread.join().unwrap();
    assert_eq!(b_answer, ["b"]);
}

/// The first column of the first row of a simple query.
async fn one(c: &tokio_postgres::Client, sql: &str) -> String {
    let rows = c
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql}: no row"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_settings_follow_their_client_and_never_leak() {
    let env = env(0, |c| c.max_size(1).mode("transaction"));
    let a = env.app().await;
    let b = env.app().await;
    a.batch_execute("SET work_mem = '7MB'; SET search_path = custom, public; SET TIME ZONE 'Asia/Tokyo'; SET application_name = 'client-a'").await.unwrap();
    let default_zone = env.direct("SHOW TimeZone");
    for _ in 0..3 {
        assert_eq!(
            one(&b, "SHOW work_mem").await,
            "4MB",
            "b must not see a's work_mem"
        );
        assert_eq!(one(&b, "SHOW search_path").await, "\"$user\", public");
        assert_eq!(one(&b, "SHOW TimeZone").await, default_zone);
        assert_eq!(
            one(&a, "SHOW work_mem").await,
            "7MB",
            "a keeps its work_mem"
        );
        assert_eq!(one(&a, "SHOW search_path").await, "custom, public");
        assert_eq!(one(&a, "SHOW TimeZone").await, "Asia/Tokyo");
        assert_eq!(one(&a, "SHOW application_name").await, "client-a");
    }
    // Rolled-back and local settings do not stick; RESET does.
    a.batch_execute("BEGIN; SET work_mem = '9MB'; ROLLBACK")
        .await
        .unwrap();
    assert_eq!(one(&b, "SHOW work_mem").await, "4MB");
    assert_eq!(one(&a, "SHOW work_mem").await, "7MB");
    a.batch_execute("BEGIN; SET LOCAL work_mem = '11MB'; COMMIT")
        .await
        .unwrap();
    assert_eq!(one(&a, "SHOW work_mem").await, "7MB");
    // Savepoints: a ROLLBACK TO undoes the settings made since its savepoint and keeps the
    // earlier ones (after an error too), in one query string or statement by statement; the
    // transaction then commits them, and they follow a, never b.
    a.batch_execute(
        "BEGIN; SET work_mem = '5MB'; SAVEPOINT s; SET work_mem = '6MB'; ROLLBACK TO s; COMMIT",
    )
    .await
    .unwrap();
    assert_eq!(one(&b, "SHOW work_mem").await, "4MB");
    assert_eq!(one(&a, "SHOW work_mem").await, "5MB");
    for sql in [
        "BEGIN",
        "SET work_mem = '8MB'",
        "SAVEPOINT s",
        "SET work_mem = '9MB'",
    ] {
        a.batch_execute(sql).await.unwrap();
    }
    a.batch_execute("SELECT 1/0")
        .await
        .expect_err("division by zero");
    a.batch_execute("ROLLBACK TO SAVEPOINT s").await.unwrap();
    a.batch_execute("RELEASE s").await.unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(one(&b, "SHOW work_mem").await, "4MB");
    assert_eq!(one(&a, "SHOW work_mem").await, "8MB");
    // Comments before a SET as the server reads them: a line comment ends at a carriage
    // return too, block comments nest.
    for (sql, value) in [
        ("-- ends at a carriage return\rSET work_mem = '3MB'", "3MB"),
        (
            "/* outer /* inner */ still the comment */ SET work_mem = '2MB'",
            "2MB",
        ),
    ] {
        a.batch_execute(sql).await.unwrap();
        assert_eq!(one(&b, "SHOW work_mem").await, "4MB", "{sql}");
        assert_eq!(one(&a, "SHOW work_mem").await, value, "{sql}");
    }
    // The same texts with other values, often enough for their shapes to be remembered (what
    // the lexer found then comes from the memo), one with a `;` inside a literal before its
    // second statement.
    for (i, value) in ["12MB", "13MB", "14MB", "15MB"].into_iter().enumerate() {
        for sql in [
            format!("SET work_mem = '{value}'"),
            format!("SELECT 'x;{i}'; SET maintenance_work_mem = '{value}'"),
        ] {
            a.batch_execute(&sql).await.unwrap();
        }
        assert_eq!(one(&b, "SHOW work_mem").await, "4MB", "{value}");
        assert_eq!(
            one(&b, "SHOW maintenance_work_mem").await,
            "64MB",
            "{value}"
        );
        assert_eq!(one(&a, "SHOW work_mem").await, value);
        assert_eq!(one(&a, "SHOW maintenance_work_mem").await, value);
    }
    a.batch_execute("RESET maintenance_work_mem").await.unwrap();
    a.batch_execute("SET work_mem = '7MB'").await.unwrap();
    a.batch_execute("RESET work_mem").await.unwrap();
    assert_eq!(one(&b, "SHOW TimeZone").await, default_zone);
    assert_eq!(one(&a, "SHOW work_mem").await, "4MB");
    // A role change must not leak either.
    env.direct("GRANT pg_read_all_stats TO app");
    a.batch_execute("SET ROLE pg_read_all_stats").await.unwrap();
    assert_eq!(one(&b, "SELECT current_user").await, "app");
    assert_eq!(one(&a, "SELECT current_user").await, "pg_read_all_stats");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_parameters_apply_on_every_server_connection() {
    let env = env(0, |c| c.max_size(1));
    let base = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
    let a = connect(&format!("{base} application_name=alpha options='-c search_path=alpha_schema -c statement_timeout=1234'")).await;
    let b = connect(&format!("{base} application_name=beta")).await;
    for _ in 0..3 {
        assert_eq!(one(&a, "SHOW application_name").await, "alpha");
        assert_eq!(one(&a, "SHOW search_path").await, "alpha_schema");
        assert_eq!(one(&a, "SHOW statement_timeout").await, "1234ms");
        assert_eq!(one(&b, "SHOW application_name").await, "beta");
        assert_eq!(one(&b, "SHOW statement_timeout").await, "0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_in_and_out() {
    let env = env(0, |c| c.max_size(2));
    let client = env.app().await;
    client
        .batch_execute("CREATE TABLE copied (id int, payload text)")
        .await
        .unwrap();
    let rows = 200_000;
    let sink = client.copy_in("COPY copied FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    let mut chunk = String::new();
    for i in 0..rows {
        chunk.push_str(&format!("{i}\tpayload-{i}-{}\n", "x".repeat(i % 50)));
        if chunk.len() > 64 << 10 {
            sink.send(Bytes::from(std::mem::take(&mut chunk)))
                .await
                .unwrap();
        }
    }
    sink.send(Bytes::from(chunk)).await.unwrap();
    let copied = sink.finish().await.unwrap();
    assert_eq!(copied, rows as u64);
    assert_eq!(
        env.direct("SELECT count(*), sum(id) FROM copied"),
        format!("{rows}|{}", (rows as u64) * (rows as u64 - 1) / 2)
    );

    let stream = client
        .copy_out("COPY (SELECT * FROM copied ORDER BY id) TO STDOUT")
        .await
        .unwrap();
    futures_util::pin_mut!(stream);
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk.unwrap());
    }
    let text = String::from_utf8(bytes).unwrap();
    assert_eq!(text.lines().count(), rows);
    assert_eq!(
        text.lines().nth(12345).unwrap(),
        format!("12345\tpayload-12345-{}", "x".repeat(12345 % 50))
    );

    // A COPY the server rejects, and one the client aborts, leave the session usable.
    // (Raw protocol: tokio-postgres itself cannot continue after a failed copy_in, even
    // directly against PostgreSQL.)
    let mut raw = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let failed = raw.query("COPY nonexistent FROM STDIN");
    assert_eq!(errors(&failed)[0].code.code(), "42P01");
    let mut out = BytesMut::new();
    frontend::encode_query(&mut out, b"COPY copied FROM STDIN").unwrap();
    raw.send(&out);
    assert_eq!(raw.recv().unwrap().0, b'G');
    out.clear();
    pgherd_wire::frame::write_message(&mut out, b'd', |b| b.extend_from_slice(b"-1\tnever\n"))
        .unwrap();
    frontend::encode_copy_fail(&mut out, b"changed my mind").unwrap();
    raw.send(&out);
    let aborted = raw.recv_until_ready();
    assert_eq!(errors(&aborted)[0].code.code(), "57014", "{aborted:?}");
    assert_eq!(
        first_column(&raw.query("SELECT count(*) FROM copied WHERE id = -1")),
        ["0"]
    );

    // The COPY, its data and CopyDone in one write, before the server's CopyInResponse (as
    // asyncpg and pgx send them); then the extended protocol, everything pipelined, with a
    // Sync inside the copy (ignored by the server) and one after it (answered).
    let copy_data = |out: &mut BytesMut, rows: &[u8]| {
        pgherd_wire::frame::write_message(out, b'd', |b| b.extend_from_slice(rows)).unwrap();
        pgherd_wire::frame::write_message(out, b'c', |_| {}).unwrap();
    };
    out.clear();
    frontend::encode_query(&mut out, b"COPY copied FROM STDIN").unwrap();
    copy_data(&mut out, b"-2\tpipelined\n-3\tpipelined\n");
    frontend::encode_query(&mut out, b"SELECT count(*) FROM copied WHERE id < -1").unwrap();
    raw.send(&out);
    let copied = raw.recv_until_ready();
    assert!(errors(&copied).is_empty(), "{copied:?}");
    assert_eq!(first_column(&raw.recv_until_ready()), ["2"]);
    out.clear();
    frontend::encode_parse(&mut out, b"", b"COPY copied FROM STDIN", &[0; 2]).unwrap();
    frontend::encode_bind(&mut out, b"", b"", &[0; 6]).unwrap();
    frontend::encode_execute(&mut out, b"", 0).unwrap();
    frontend::encode_sync(&mut out);
    copy_data(&mut out, b"-4\textended\n");
    frontend::encode_sync(&mut out);
    raw.send(&out);
    let extended = raw.recv_until_ready();
    assert!(errors(&extended).is_empty(), "{extended:?}");
    assert!(extended.iter().any(|m| m.0 == b'C'), "{extended:?}");
    assert_eq!(
        first_column(&raw.query("SELECT count(*) FROM copied WHERE id < -1")),
        ["3"],
        "the next request is answered as its own"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_exhaustion_gives_the_wait_timeout_error_and_the_client_recovers() {
    let env = env(0, |c| c.max_size(1).wait_timeout_ms(300));
    let holder = env.app().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let waiter = env.app().await;
    let started = std::time::Instant::now();
    let err = waiter.simple_query("SELECT 2").await.unwrap_err();
    assert_eq!(code(&err), "53300", "{err}");
    let message = err.as_db_error().unwrap().message().to_owned();
    assert!(
        message.contains("no server connection became free within"),
        "{message}"
    );
    assert!(started.elapsed() >= Duration::from_millis(250));
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        waiter
            .query_one("SELECT 3", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_transaction_is_rolled_back_and_the_server_reused() {
    let env = env(0, |c| c.max_size(1));
    let setup = env.app().await;
    setup
        .batch_execute("CREATE TABLE left_behind (id int)")
        .await
        .unwrap();
    let backend_before: i32 = setup
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    {
        let leaver = env.app().await;
        leaver
            .batch_execute("BEGIN; INSERT INTO left_behind VALUES (1)")
            .await
            .unwrap();
        // Dropped here: the connection closes mid-transaction.
    }
    let after = env.app().await;
    let mut count = -1i64;
    for _ in 0..50 {
        match after
            .query_one("SELECT count(*) FROM left_behind", &[])
            .await
        {
            Ok(row) => {
                count = row.get(0);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(
        count, 0,
        "the insert of the departed client must be rolled back"
    );
    let backend_after: i32 = after
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        backend_before, backend_after,
        "the server connection should be reused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_and_failed_transactions_behave_as_in_postgresql() {
    let env = env(0, |c| c.max_size(2));
    let client = env.app().await;
    let err = client.simple_query("SELECT 1/0").await.unwrap_err();
    assert_eq!(code(&err), "22012");
    assert_eq!(
        client
            .query_one("SELECT 5", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        5
    );
    // A failed transaction stays failed until rolled back.
    client.batch_execute("BEGIN").await.unwrap();
    assert!(client.simple_query("SELECT 1/0").await.is_err());
    let err = client.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(code(&err), "25P02");
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        client
            .query_one("SELECT 6", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        6
    );
}

#[test]
fn notifications_reach_a_session_mode_listener() {
    let env = env(0, |c| c.mode("session"));
    let mut listener = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    listener.query("LISTEN pgherd_channel");
    let mut talker = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    talker.query("NOTIFY pgherd_channel, 'hello'");
    // The notification arrives while the listener is idle; pgherd must pass it on unasked.
    let message = listener.recv().expect("a notification");
    assert_eq!(
        message.0, b'A',
        "expected NotificationResponse, got {:?}",
        message.0 as char
    );
    assert!(String::from_utf8_lossy(&message.1).contains("hello"));
}

/// Server connections that ended while idle in the pool, just after their last use (the
/// server's `idle_session_timeout`, 250 ms here, which pgherd's half-second trust in a
/// connection just back from work does not see): the server had read nothing of the next
/// request, which runs on another connection, and no client sees an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connections_ended_while_idle_are_replaced_without_an_error() {
    let env = env(0, |c| c.max_size(2));
    env.direct("ALTER ROLE app SET idle_session_timeout = '250ms'");
    let mut failures = Vec::new();
    let mut next = env.app().await;
    for i in 0..6 {
        let c = next;
        let answer = match i % 2 {
            0 => first_value(&c, &format!("SELECT {i}")).await,
            _ => c
                .query_one("SELECT $1::int", &[&i])
                .await
                .map(|row| row.get::<_, i32>(0).to_string()),
        };
        let answered = tokio::time::Instant::now();
        match answer {
            Ok(value) if value == i.to_string() => {}
            other => failures.push(format!("client {i}: {other:?}")),
        }
        // The next client logs in now: a login under load can take longer than the window
        // between the server's timeout and the end of pgherd's trust.
        next = env.app().await;
        drop(c);
        // Past the server's timeout, inside pgherd's trust.
        tokio::time::sleep_until(answered + Duration::from_millis(380)).await;
    }
    assert!(failures.is_empty(), "{failures:?}\n{}", env.pgherd.log());
    assert!(
        env.pgherd
            .log()
            .contains("server connection had closed before it read the request"),
        "the timeouts were not met: {}",
        env.pgherd.log()
    );
}
