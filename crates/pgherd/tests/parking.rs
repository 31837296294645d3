//! Idle clients parked (`client_park_after_ms`): a client idle between transactions gives up
//! its task and its socket's registration, and carries on exactly as it was when it speaks
//! again (its settings, custom settings and prepared statements, on whatever server
//! connection is free then); while parked it is still killed, timed out, cancelled and shut
//! down as a live client is; TLS-less clients of a session-mode pool never park.

mod common;

use std::time::Duration;

use common::*;
use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};
use tokio_postgres::{Client, NoTls};

/// The `parked` column of SHOW CLIENTS for the clients of database `app`.
async fn parked_flags(admin: &Client) -> Vec<String> {
    rows(admin, "SHOW CLIENTS")
        .await
        .expect("SHOW CLIENTS")
        .iter()
        .filter(|r| field(r, "database") == APP)
        .map(|r| field(r, "parked").to_owned())
        .collect()
}

/// Waits until `n` clients of database `app` are listed and all are parked.
async fn wait_all_parked(env: &Env, admin: &Client, n: usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let flags = parked_flags(admin).await;
        if flags.len() == n && flags.iter().all(|f| f == "yes") {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{n} clients parked within 20 s: {flags:?}\n--- pgherd log ---\n{}",
            env.pgherd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn parking_env(mode: &str, extra: &str) -> Env {
    env(0, |c| {
        c.superuser()
            .mode(mode)
            .max_size(2)
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .proxy("client_park_after_ms = 200")
            .proxy(extra)
    })
}

async fn admin(env: &Env) -> Client {
    connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_client_carries_on_as_it_was() {
    let env = parking_env("transaction", "");
    let admin = admin(&env).await;
    let parked = env.app().await;
    parked
        .batch_execute(
            "SET statement_timeout = '77s'; SET application_name = 'parked-one'; \
             SELECT set_config('myapp.tenant', '42', false)",
        )
        .await
        .expect("session settings");
    let doubled = parked.prepare("SELECT $1::int * 2").await.expect("prepare");
    for round in 0..3 {
        wait_all_parked(&env, &admin, 1).await;
        // Others use the server connections meanwhile, with settings of their own.
        let other = env.app().await;
        other
            .batch_execute("SET statement_timeout = '5s'; SELECT pg_sleep(0.05)")
            .await
            .expect("another client");
        drop(other);
        let row = parked
            .query_one(
                "SELECT current_setting('statement_timeout'), current_setting('application_name'), \
                 current_setting('myapp.tenant')",
                &[],
            )
            .await
            .unwrap_or_else(|e| panic!("round {round}: a parked client's query: {e}"));
        let got: (String, String, String) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(
            got,
            ("77s".into(), "parked-one".into(), "42".into()),
            "round {round}: settings kept across parking"
        );
        let four: i32 = parked
            .query_one(&doubled, &[&(21 + round)])
            .await
            .unwrap_or_else(|e| panic!("round {round}: the prepared statement: {e}"))
            .get(0);
        assert_eq!(four, 42 + 2 * round, "round {round}");
    }
    // A transaction spanning a wait longer than the park delay holds its session: nothing
    // parks mid-transaction, and the transaction's writes and snapshot are intact.
    parked
        .batch_execute("CREATE TABLE IF NOT EXISTS spans (x int)")
        .await
        .unwrap();
    parked
        .batch_execute("BEGIN; INSERT INTO spans VALUES (1)")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert_eq!(
        parked_flags(&admin).await,
        vec!["no".to_owned()],
        "a client in a transaction is not parked"
    );
    parked
        .batch_execute("INSERT INTO spans VALUES (2); COMMIT")
        .await
        .expect("the transaction carries on");
    assert_eq!(env.direct("SELECT count(*) FROM spans"), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_parked_clients_wake_at_once() {
    let env = parking_env("transaction", "");
    let admin = admin(&env).await;
    let mut clients = Vec::new();
    for _ in 0..100 {
        clients.push(env.app().await);
    }
    wait_all_parked(&env, &admin, 100).await;
    let mut tasks = Vec::new();
    for (n, client) in clients.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let row = client
                .query_one("SELECT $1::int + 1", &[&(n as i32)])
                .await
                .map(|r| r.get::<_, i32>(0));
            (n, row, client)
        }));
    }
    let mut clients = Vec::new();
    for task in tasks {
        let (n, row, client) = task.await.expect("task");
        assert_eq!(row.expect("a parked client's query"), n as i32 + 1);
        clients.push(client);
    }
    // And they park again.
    wait_all_parked(&env, &admin, 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_clients_are_killed_timed_out_and_cancelled_as_live_ones() {
    let env = parking_env("transaction", "client_idle_timeout_ms = 2500");
    let admin = admin(&env).await;

    // Idle timeout: counted from before the client parked, and said why.
    let idle = env.app().await;
    wait_all_parked(&env, &admin, 1).await;
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let closed = idle
        .simple_query("SELECT 1")
        .await
        .expect_err("a parked client idle past the timeout is closed");
    assert!(closed.is_closed(), "{closed:?}");
    assert!(
        env.pgherd.log().contains("client idle timeout"),
        "the log says why"
    );

    // A cancel for a parked client's key finds nothing running; the client carries on.
    let cancelled = env.app().await;
    let token = cancelled.cancel_token();
    wait_all_parked(&env, &admin, 1).await;
    token.cancel_query(NoTls).await.expect("send cancel");
    // A query sent at the very moment a cancel lands may be the one cancelled, parked or not.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let one = cancelled
        .simple_query("SELECT 1")
        .await
        .expect("a cancel for an idle client cancels nothing");
    assert!(!one.is_empty());

    // KILL: the parked client is told and closed.
    wait_all_parked(&env, &admin, 1).await;
    rows(&admin, &format!("KILL {APP}")).await.expect("KILL");
    let killed = cancelled
        .simple_query("SELECT 1")
        .await
        .expect_err("a killed parked client is closed");
    assert!(
        killed.is_closed() || code(&killed) == "57P01",
        "told it was killed: {killed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_parked_clients_at_once() {
    let mut env = parking_env("transaction", "");
    let admin = admin(&env).await;
    let parked = env.app().await;
    wait_all_parked(&env, &admin, 1).await;
    drop(admin);
    env.pgherd.signal(libc::SIGTERM);
    let status = env
        .pgherd
        .wait_exit(Duration::from_secs(10))
        .expect("pgherd exits after SIGTERM with a parked client");
    assert!(status.success(), "{status}");
    assert!(parked.simple_query("SELECT 1").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_clients_never_park() {
    let env = parking_env("session", "");
    let admin = admin(&env).await;
    let client = env.app().await;
    first_value(&client, "SELECT 1").await.expect("a query");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(parked_flags(&admin).await, vec!["no".to_owned()]);
    first_value(&client, "SELECT 1")
        .await
        .expect("still served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_client_moves_in_an_upgrade_with_its_session() {
    let mut env = parking_env("transaction", "");
    let console = admin(&env).await;
    let parked = env.app().await;
    parked
        .batch_execute("SET statement_timeout = '88s'")
        .await
        .unwrap();
    let plus_one = parked.prepare("SELECT $1::int + 1").await.unwrap();
    wait_all_parked(&env, &console, 1).await;
    let old_pid = env.pgherd.pid();
    let answer = first_value(&console, "UPGRADE").await.expect("UPGRADE");
    let new_pid = upgrade_pid(&answer);
    env.pgherd.successor(new_pid);
    assert_ne!(new_pid, old_pid);
    drop(console);
    // The old process leaves once its clients moved: the parked one among them.
    let exited = env
        .pgherd
        .wait_exit(Duration::from_secs(30))
        .expect("the old process exits once its clients, the parked one too, moved");
    assert!(exited.success(), "{exited}");
    assert_eq!(
        first_value(&parked, "SHOW statement_timeout")
            .await
            .expect("the moved client's query"),
        "88s"
    );
    let two: i32 = parked
        .query_one(&plus_one, &[&1i32])
        .await
        .expect("its prepared statement moved too")
        .get(0);
    assert_eq!(two, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_client_still_reads_its_own_writes() {
    let env = env(1, |c| {
        c.superuser()
            .database("app", "consistency = \"read_your_writes\"")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .proxy("client_park_after_ms = 200")
            .section("[routing]\nread_your_writes_wait_ms = 0")
    });
    let primary = env.cluster.primary().port;
    env.direct("CREATE TABLE t (id int PRIMARY KEY); GRANT ALL ON t TO app");
    env.cluster.wait_replayed();
    // The replica applies each commit 5 s late: long after the client parked.
    env.cluster
        .node("pg2")
        .write_auto_settings(&[("recovery_min_apply_delay".into(), "'5s'".into())])
        .unwrap();
    env.cluster
        .sql_on("pg2", "postgres", "SELECT pg_reload_conf()");
    let admin = admin(&env).await;
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;
    c.batch_execute("INSERT INTO t VALUES (1)").await.unwrap();
    wait_all_parked(&env, &admin, 1).await;
    let seen: i64 = c
        .query_one("SELECT count(*) FROM t WHERE id = 1", &[])
        .await
        .expect("a read after parking")
        .get(0);
    assert_eq!(
        seen, 1,
        "the session did not see its own write after it parked"
    );
    // Reads that follow no write still use the replica once the write is replayed there.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_ne!(
        served_by(&c, WHERE).await,
        primary,
        "reads reach the replica again"
    );
}
