//! Faults and bad input: cancel requests, a server killed mid-query, malformed packets,
//! connection limits, login timeouts, reloads and draining shutdowns.

mod common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::*;
use pgherd_testkit::raw::{errors, first_column, send_cancel_and_close, RawClient};
use pgherd_wire::frontend;
use tokio_postgres::NoTls;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_stops_a_long_query_and_only_that_one() {
    let env = env(0, |c| c.max_size(2));
    let victim = env.app().await;
    let bystander = env.app().await;
    let token = victim.cancel_token();
    let started = Instant::now();
    let sleeper = tokio::spawn(async move { victim.simple_query("SELECT pg_sleep(30)").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let busy = tokio::spawn(async move {
        bystander
            .simple_query("SELECT pg_sleep(1), 'still here'")
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    token
        .cancel_query(NoTls)
        .await
        .expect("send cancel through pgherd");
    let err = sleeper
        .await
        .unwrap()
        .expect_err("the sleep must be cancelled");
    assert_eq!(code(&err), "57014");
    assert!(started.elapsed() < Duration::from_secs(10));
    // The other client's query, on another server connection, runs to the end.
    assert!(busy.await.unwrap().is_ok());
}

/// PgBouncer 1.18 drops a cancel whose socket closes right after sending; pgherd must not.
#[test]
fn cancel_request_is_honoured_when_its_socket_closes_at_once() {
    let env = env(0, |c| c.max_size(1));
    let mut victim = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let key = victim.key.expect("BackendKeyData");
    let mut out = BytesMut::new();
    frontend::encode_query(&mut out, b"SELECT pg_sleep(30)").unwrap();
    victim.send(&out);
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    send_cancel_and_close(env.pgherd.port, key);
    let answer = victim.recv_until_ready();
    assert_eq!(errors(&answer)[0].code.code(), "57014", "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(5));
    // A cancel with the wrong secret is ignored.
    let mut victim2 = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let mut key2 = victim2.key.unwrap();
    key2.secret_key = key2.secret_key.wrapping_add(1);
    victim2.send(&{
        let mut q = BytesMut::new();
        frontend::encode_query(&mut q, b"SELECT pg_sleep(0.5), 'done'").unwrap();
        q
    });
    send_cancel_and_close(env.pgherd.port, key2);
    assert_eq!(first_column(&victim2.recv_until_ready()), [""]);
}

/// A request still waiting for a server (a full pool, then a primary that is down) is
/// cancelled like a running statement: 57014 at once, and the pool keeps its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_ends_a_wait_for_a_server() {
    let env = env(0, |c| {
        c.max_size(1)
            .mode("transaction")
            .cluster("primary_wait_ms = 20000")
    });
    let holder = env.app().await;
    let waiter = env.app().await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();

    // The only server connection is in `holder`'s transaction: `waiter` queues for it.
    let token = waiter.cancel_token();
    let queued = tokio::spawn(async move {
        let result = first_value(&waiter, "SELECT 'served'").await;
        (waiter, result)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let cancelled_at = Instant::now();
    token.cancel_query(NoTls).await.expect("send cancel");
    let (waiter, result) = queued.await.unwrap();
    assert_eq!(
        code(&result.expect_err("the queued request must be cancelled")),
        "57014"
    );
    assert!(cancelled_at.elapsed() < Duration::from_secs(5));

    // The connection handed back by `holder` still serves both sessions.
    holder.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        first_value(&waiter, "SELECT 'served'").await.unwrap(),
        "served"
    );
    assert_eq!(
        first_value(&holder, "SELECT 'again'").await.unwrap(),
        "again"
    );

    // With the primary down, a request waits for it (primary_wait_ms) until cancelled.
    env.cluster
        .primary()
        .stop(pgherd_cluster::StopMode::Immediate)
        .unwrap();
    // Once pgherd has seen it down (3 failed checks 250 ms apart), nothing is sent to it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let token = waiter.cancel_token();
    let held = tokio::spawn(async move { first_value(&waiter, "SELECT 'held'").await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let cancelled_at = Instant::now();
    token.cancel_query(NoTls).await.expect("send cancel");
    let err = held
        .await
        .unwrap()
        .expect_err("the held request must be cancelled");
    assert_eq!(code(&err), "57014", "{err}");
    assert!(cancelled_at.elapsed() < Duration::from_secs(5));
}

/// A client that logs in while no node can serve it (its primary down, restarting) waits for
/// one, as a request that needs the primary does, up to `primary_wait_ms`; then 57P03, naming
/// every node's state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_while_no_node_can_serve_it_waits_for_one() {
    let env = env(0, |c| c.cluster("primary_wait_ms = 4000"));
    let first = env.app().await;
    drop(first);
    let primary = env.cluster.primary();
    let downs = || env.pgherd.log().matches("node is down").count();
    let stop_and_see_down = || {
        let before = downs();
        primary.stop(pgherd_cluster::StopMode::Immediate).unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while downs() == before {
            assert!(Instant::now() < deadline, "pgherd never saw pg1 down");
            std::thread::sleep(Duration::from_millis(50));
        }
    };

    // The primary comes back while the login waits: the login completes on it.
    stop_and_see_down();
    let url = env.app_url();
    let login = tokio::spawn(async move { try_connect(&url).await });
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(!login.is_finished(), "the login did not wait for a node");
    primary.start(Duration::from_secs(60)).unwrap();
    let client = login
        .await
        .unwrap()
        .expect("a login made while the primary restarts must complete once it is back");
    assert_eq!(
        first_value(&client, "SELECT 'served'").await.unwrap(),
        "served"
    );

    // It stays down: the login fails once primary_wait_ms has passed, saying why.
    stop_and_see_down();
    let started = Instant::now();
    let err = match try_connect(&env.app_url()).await {
        Ok(_) => panic!("a login with no node to serve it must fail"),
        Err(e) => e,
    };
    assert_eq!(code(&err), "57P03", "{err}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(3500),
        "failed after {waited:?}"
    );
    let detail = err.as_db_error().and_then(|e| e.detail()).unwrap_or("");
    assert!(detail.contains("pg1 (down"), "{detail}");
}

/// A cancel that comes while the session runs nothing is ignored, as PostgreSQL ignores one
/// for an idle backend: the next request runs. One that comes while pgherd holds the request
/// but has not taken a server for it yet (held here at a test hook) cancels it, unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_counts_for_a_request_in_hand_and_not_for_an_idle_session() {
    let mut env = env(0, |c| c.max_size(2));
    let client = env.app().await;
    client
        .cancel_token()
        .cancel_query(NoTls)
        .await
        .expect("send cancel");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        first_value(&client, "SELECT 'ran' FROM pg_sleep(0.5)")
            .await
            .expect("a cancel sent while idle cancels nothing later"),
        "ran"
    );

    env.pgherd
        .set_env("PGHERD_FAILPOINTS", Some("before-attach@1500"));
    env.pgherd.restart();
    let client = env.app().await;
    let token = client.cancel_token();
    let started = Instant::now();
    let sleeper = tokio::spawn(async move {
        let result = client.simple_query("SELECT pg_sleep(30)").await.map(|_| ());
        (client, result)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    token.cancel_query(NoTls).await.expect("send cancel");
    let (client, result) = sleeper.await.unwrap();
    let err = result.expect_err("the request in hand must be cancelled");
    assert_eq!(code(&err), "57014", "{err}");
    let detail = err.as_db_error().and_then(|e| e.detail()).unwrap_or("");
    assert_eq!(
        detail,
        "the cancel came before the request reached a server"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // The session carries on, and the cancel is not left over for its next request.
    assert_eq!(
        first_value(&client, "SELECT 'after'").await.unwrap(),
        "after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_mid_query_fails_that_query_and_the_next_one_works() {
    let env = env(0, |c| c.max_size(2).mode("transaction"));
    let client = env.app().await;
    let running = tokio::spawn(async move {
        let result = client.simple_query("SELECT pg_sleep(30)").await;
        (client, result)
    });
    // Find the backend running the sleep and kill it outright.
    let mut pid = String::new();
    for _ in 0..100 {
        pid = env.direct("SELECT pid FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'");
        if !pid.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!pid.is_empty(), "the sleeping backend was not found");
    let status = std::process::Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap();
    assert!(status.success());
    let (client, result) = running.await.unwrap();
    let err = result.expect_err("the killed query must fail");
    assert_eq!(code(&err), "08006", "{err}");
    // PostgreSQL restarts after a backend crash; the same client connection works again.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.query_one("SELECT 42", &[]).await {
            Ok(row) => {
                assert_eq!(row.get::<_, i32>(0), 42);
                break;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "no recovery: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Sends `bytes` on a fresh connection and expects an 08P01 error and a closed connection.
fn expect_protocol_violation(port: u16, bytes: &[u8], what: &str) {
    let mut c = RawClient::connect(port);
    c.send_lossy(bytes);
    let mut got = Vec::new();
    while let Some(m) = c.recv() {
        got.push(m);
    }
    let errs = errors(&got);
    assert_eq!(errs.len(), 1, "{what}: expected one error, got {got:?}");
    assert_eq!(errs[0].code.code(), "08P01", "{what}: {}", errs[0]);
}

fn logged_in_then(port: u16, bytes: &[u8]) -> Vec<pgherd_testkit::raw::Message> {
    let mut c = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    c.send_lossy(bytes);
    let mut got = Vec::new();
    while let Some(m) = c.recv() {
        got.push(m);
    }
    got
}

#[test]
fn malformed_input_gets_08p01_and_a_closed_connection_while_others_carry_on() {
    let env = env(0, |c| c.max_size(2).proxy("max_message_bytes = 65536"));
    let port = env.pgherd.port;
    let mut healthy = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();

    // Startup packets.
    expect_protocol_violation(port, &[0, 0, 0, 3], "startup length below the minimum");
    expect_protocol_violation(
        port,
        &[0, 0, 0x30, 0x00, 0, 3, 0, 0],
        "startup packet over 10000 bytes",
    );
    expect_protocol_violation(
        port,
        b"\0\0\0\x0f\0\x03\0\0user\0ab",
        "startup parameters without terminators",
    );
    expect_protocol_violation(
        port,
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        "an HTTP request",
    );
    let mut wrong_version = RawClient::connect(port);
    wrong_version.send_lossy(b"\0\0\0\x09\0\x02\0\0\0");
    let answer: Vec<_> = std::iter::from_fn(|| wrong_version.recv()).collect();
    assert_eq!(
        errors(&answer)[0].code.code(),
        "0A000",
        "old protocol version"
    );

    // After login.
    for (what, bytes) in [
        ("bad length", b"Q\0\0\0\x02".to_vec()),
        ("unknown message type", b"Y\0\0\0\x04".to_vec()),
        ("oversize message", {
            let mut q = BytesMut::new();
            frontend::encode_query(&mut q, "SELECT '".repeat(20_000).as_bytes()).unwrap();
            q.to_vec()
        }),
        ("truncated body", b"B\0\0\0\x06a\0".to_vec()),
    ] {
        let got = logged_in_then(port, &bytes);
        let errs = errors(&got);
        assert_eq!(errs.len(), 1, "{what}: {got:?}");
        assert_eq!(errs[0].code.code(), "08P01", "{what}: {}", errs[0]);
    }
    let oversize = errors(&logged_in_then(port, &{
        let mut q = BytesMut::new();
        frontend::encode_query(&mut q, "x".repeat(70_000).as_bytes()).unwrap();
        q.to_vec()
    }))
    .remove(0);
    assert!(
        oversize.message.contains("over the limit of 65536 bytes"),
        "{oversize}"
    );

    // The healthy client never noticed.
    assert_eq!(first_column(&healthy.query("SELECT 'fine'")), ["fine"]);
    assert!(!env.pgherd.log().contains("panicked"));
}

#[test]
fn connection_limit_and_login_timeout() {
    let env = env(0, |c| {
        c.proxy("max_client_connections = 2")
            .proxy("admin_reserved_connections = 0")
            .proxy("client_login_timeout_ms = 500")
    });
    let port = env.pgherd.port;
    let _a = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let mut silent = RawClient::connect(port);
    // Let pgherd admit the silent one before the third arrives.
    std::thread::sleep(Duration::from_millis(200));
    // At the limit, the connection logging in longest makes room for the new one.
    let _b = RawClient::login(port, APP, APP, APP_PASSWORD).expect("the silent one made room");
    let answer: Vec<_> = std::iter::from_fn(|| silent.recv()).collect();
    let errs = errors(&answer);
    assert_eq!(errs[0].code.code(), "53300");
    assert_eq!(errs[0].message, "sorry, too many clients already");
    // With every place taken by logged-in clients, a new connection is refused with
    // PostgreSQL's words.
    let mut third = RawClient::connect(port);
    let answer: Vec<_> = std::iter::from_fn(|| third.recv()).collect();
    let errs = errors(&answer);
    assert_eq!(errs[0].code.code(), "53300");
    assert_eq!(errs[0].message, "sorry, too many clients already");
    // A connection that does not log in is dropped after the login timeout.
    drop(_b);
    std::thread::sleep(Duration::from_millis(200));
    let mut silent = RawClient::connect(port);
    let started = Instant::now();
    let answer: Vec<_> = std::iter::from_fn(|| silent.recv()).collect();
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(errors(&answer)[0].code.code(), "08P01");
    assert!(RawClient::login(port, APP, APP, APP_PASSWORD).is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_changes_without_dropping_clients() {
    let cluster = pgherd_testkit::TestCluster::start(0);
    let app = cluster.create_user(APP, APP_PASSWORD);
    let late = cluster.create_user("late", "late-pw");
    let config = pgherd_testkit::PgherdConfig::new()
        .max_size(2)
        .user(APP, &app, "");
    let pgherd = pgherd_testkit::Pgherd::start(BIN, &cluster, &config);
    let client = connect(&pgherd.conninfo(APP, APP_PASSWORD, "postgres")).await;
    client
        .batch_execute("BEGIN; CREATE TEMP TABLE t (x int)")
        .await
        .unwrap();
    assert!(try_connect(&pgherd.conninfo("late", "late-pw", "postgres"))
        .await
        .is_err());

    // SIGHUP with a new user: the open transaction survives, the user can log in.
    pgherd.rewrite_config(&cluster, &config.clone().user("late", &late, ""));
    pgherd.signal(libc::SIGHUP);
    let deadline = Instant::now() + Duration::from_secs(10);
    while try_connect(&pgherd.conninfo("late", "late-pw", "postgres"))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "reload did not apply");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    client
        .batch_execute("INSERT INTO t VALUES (1); COMMIT")
        .await
        .unwrap();

    // A broken config is refused and the running one kept.
    std::fs::write(&pgherd.config_path, "[pool]\nmode = \"txn\"\n").unwrap();
    pgherd.signal(libc::SIGHUP);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        pgherd
            .log()
            .contains("reload failed; keeping the running config"),
        "{}",
        pgherd.log()
    );
    assert!(try_connect(&pgherd.conninfo("late", "late-pw", "postgres"))
        .await
        .is_ok());

    // RELOAD on the admin console does the same.
    pgherd.rewrite_config(
        &cluster,
        &config
            .clone()
            .user("late", &late, "")
            .superuser()
            .proxy("admin_users = [\"postgres\"]"),
    );
    pgherd.signal(libc::SIGHUP);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let admin = psql(
        &pgherd.url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd"),
        &["-c", "RELOAD", "-c", "SHOW NODES"],
    )
    .unwrap();
    assert!(admin.contains("pg1|127.0.0.1"), "{admin}");
    let denied = psql(
        &pgherd.url("late", "late-pw", "pgherd"),
        &["-c", "SHOW POOLS"],
    )
    .unwrap_err();
    assert!(
        denied.contains("is not allowed on the admin console"),
        "{denied}"
    );
    assert_eq!(
        client
            .query_one("SELECT 7", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        7
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_transactions_finish_then_closes_everyone() {
    let mut env = env(0, |c| c.max_size(2));
    let busy = env.app().await;
    let idle = env.app().await;
    busy.batch_execute("CREATE TABLE drained (x int)")
        .await
        .unwrap();
    busy.batch_execute("BEGIN; INSERT INTO drained VALUES (1)")
        .await
        .unwrap();
    env.pgherd.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // New connections are refused; the open transaction may finish.
    assert!(try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, APP))
        .await
        .is_err());
    busy.batch_execute("INSERT INTO drained VALUES (2); COMMIT")
        .await
        .unwrap();
    assert_eq!(env.direct("SELECT count(*) FROM drained"), "2");
    // Then both clients are told and the process exits well before the deadline.
    let status = env
        .pgherd
        .wait_exit(Duration::from_secs(10))
        .expect("pgherd did not exit after SIGTERM");
    assert!(status.success(), "{status}");
    assert!(idle.simple_query("SELECT 1").await.is_err());
}

/// A node stopped a moment ago, before its health checks tell (here they come every 5 s): a
/// login that needs a server of it (its startup settings not checked yet) waits, trying again,
/// rather than failing with `08001`, and completes once the node is back.
#[test]
fn a_login_to_a_node_that_just_stopped_waits_for_it() {
    let env = env(0, |c| {
        c.cluster("primary_wait_ms = 8000")
            .cluster("health_check_period_ms = 5000")
    });
    let primary = env.cluster.primary();
    primary.stop(pgherd_cluster::StopMode::Immediate).unwrap();
    let port = env.pgherd.port;
    let login = std::thread::spawn(move || {
        let startup = [
            ("user", APP),
            ("database", APP),
            ("options", "-c work_mem=3MB"),
        ];
        RawClient::login_with(port, &startup, APP_PASSWORD)
    });
    std::thread::sleep(Duration::from_millis(800));
    primary.start(Duration::from_secs(60)).unwrap();
    let mut c = login.join().unwrap().unwrap_or_else(|e| {
        panic!(
            "a login while the primary restarts: {e}\n{}",
            env.pgherd.log()
        )
    });
    assert_eq!(first_column(&c.query("SHOW work_mem")), ["3MB"]);
    assert!(env
        .pgherd
        .log()
        .contains("login: the node could not be reached"));
}
