//! Pool behaviour at its limits: the bounded statement cache, idle timeouts, lifetimes and
//! min_size, the session-mode reset, explicit replica routing, and the shutdown deadline.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_server_statement_cache_is_bounded_and_evicts_transparently() {
    let env = env(0, |c| {
        c.max_size(1).pool("prepared_statements_per_server = 3")
    });
    let client = env.app().await;
    let mut statements = Vec::new();
    for i in 0..10 {
        statements.push(
            client
                .prepare(&format!("SELECT $1::int + {i}"))
                .await
                .unwrap(),
        );
    }
    for round in 0..3 {
        for (i, s) in statements.iter().enumerate() {
            let v: i32 = client.query_one(s, &[&round]).await.unwrap().get(0);
            assert_eq!(v, round + i as i32);
        }
    }
    // The one server connection holds at most the cache size (plus, transiently, the statement
    // of the batch being run).
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'pgherd_%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        held <= 4,
        "{held} statements held with prepared_statements_per_server = 3"
    );
}

#[test]
fn idle_timeout_lifetime_and_min_size_are_kept() {
    let env = env(0, |c| {
        c.max_size(4)
            .pool("min_size = 2")
            .pool("server_idle_timeout_ms = 500")
            .pool("server_lifetime_ms = 2000")
    });
    // min_size opens connections once the pool exists (after the first login).
    psql(&env.app_url(), &["-c", "SELECT 1"]).unwrap();
    wait_until(
        "min_size connections are open",
        Duration::from_secs(10),
        || app_backends(&env) >= 2,
    );
    // Four busy clients grow the pool; once idle past the timeout it shrinks back to min_size.
    let handles: Vec<_> = (0..4)
        .map(|_| {
            let url = env.app_url();
            std::thread::spawn(move || psql(&url, &["-c", "SELECT pg_sleep(0.5)"]).unwrap())
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(app_backends(&env) >= 3, "the pool should have grown");
    wait_until(
        "idle connections beyond min_size are closed",
        Duration::from_secs(10),
        || app_backends(&env) == 2,
    );
    // Past their lifetime, connections are replaced, so backends change.
    let pids = env.direct("SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity WHERE usename = 'app'");
    wait_until(
        "old connections are replaced",
        Duration::from_secs(15),
        || {
            let now = env.direct("SELECT string_agg(pid::text, ',' ORDER BY pid) FROM pg_stat_activity WHERE usename = 'app'");
            !now.is_empty() && now.split(',').all(|p| !pids.split(',').any(|q| q == p))
        },
    );
}

/// A reload's pool size and server lifetime reach connections that were lent while it
/// happened: each is judged by the new settings when it comes back (the release reads them
/// from atomics of their own, beside the settings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_judges_connections_lent_across_it_when_they_come_back() {
    let env = env(0, |c| c.max_size(2));
    let config = || {
        pgherd_testkit::PgherdConfig::new()
            .user(APP, &env.app_verifier, "")
            .max_size(1)
    };
    let reloads = || env.pgherd.log().matches("config reloaded (SIGHUP)").count();
    let reload = |config: pgherd_testkit::PgherdConfig| {
        let before = reloads();
        env.pgherd.rewrite_config(&env.cluster, &config);
        env.pgherd.signal(libc::SIGHUP);
        let deadline = Instant::now() + Duration::from_secs(10);
        while reloads() == before {
            assert!(
                Instant::now() < deadline,
                "reload did not apply: {}",
                env.pgherd.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let pid = |c| async move { first_value(c, "SELECT pg_backend_pid()").await.unwrap() };
    let first = env.app().await;
    let second = env.app().await;
    // The queries after a COMMIT come from another client: one the same client sent before
    // its session gave the server back would ride on it.
    let third = env.app().await;
    first.batch_execute("BEGIN").await.unwrap();
    second.batch_execute("BEGIN").await.unwrap();
    let first_pid = pid(&first).await;

    // One connection at most from now on: the second, coming back while the first is still
    // lent, is one too many and closes. Another client's query then waits for the first's.
    reload(config());
    second.batch_execute("COMMIT").await.unwrap();
    let waiting = tokio::spawn(async move {
        let pid = first_value(&third, "SELECT pg_backend_pid()")
            .await
            .unwrap();
        (pid, third)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "a query found a connection the smaller pool should have closed"
    );
    first.batch_execute("COMMIT").await.unwrap();
    let (served_by, third) = waiting.await.unwrap();
    assert_eq!(served_by, first_pid);

    // Connections live a millisecond from now on: the one lent across the reload closes
    // when it comes back, and the next query gets a new one.
    first.batch_execute("BEGIN").await.unwrap();
    let lent_pid = pid(&first).await;
    reload(config().pool("server_lifetime_ms = 1"));
    tokio::time::sleep(Duration::from_millis(5)).await;
    first.batch_execute("COMMIT").await.unwrap();
    assert_ne!(pid(&third).await, lent_pid);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_resets_the_server_for_the_next_client() {
    let env = env(0, |c| c.mode("session").max_size(1));
    let first = env.app().await;
    first
        .batch_execute("CREATE TEMP TABLE mine (x int); SET work_mem = '9MB'; PREPARE p AS SELECT 1; LISTEN chan")
        .await
        .unwrap();
    let pid: i32 = first
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    drop(first);
    let second = env.app().await;
    let mut same = false;
    for _ in 0..50 {
        let now: i32 = second
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        if now == pid {
            same = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        same,
        "the second client should get the first one's server connection"
    );
    let temp: i64 = second
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname = 'mine' AND relpersistence = 't'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        temp, 0,
        "temp tables must not survive into another client's session"
    );
    let work_mem: String = second.query_one("SHOW work_mem", &[]).await.unwrap().get(0);
    assert_eq!(work_mem, "4MB");
    let prepared: i64 = second
        .query_one(
            "SELECT count(*) FROM pg_prepared_statements WHERE name = 'p'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(prepared, 0);
}

#[test]
fn replica_route_reads_from_a_replica_and_writes_are_refused_there() {
    let env = env(1, |c| {
        c.database("app", "")
            .database("app_ro", "dbname = \"app\"\nroute = \"replica\"")
    });
    psql(
        &env.app_url(),
        &[
            "-c",
            "CREATE TABLE t (x int)",
            "-c",
            "INSERT INTO t VALUES (1)",
        ],
    )
    .unwrap();
    env.cluster.wait_replayed();
    let ro = env.pgherd.url(APP, APP_PASSWORD, "app_ro");
    let out = psql(&ro, &["-c", "SELECT pg_is_in_recovery(), count(*) FROM t"]).unwrap();
    assert_eq!(out, "t|1", "route = replica should land on the replica");
    let err = psql(&ro, &["-c", "INSERT INTO t VALUES (2)"]).unwrap_err();
    assert!(
        err.contains("cannot execute INSERT in a read-only transaction"),
        "{err}"
    );
    // With the replica gone, the primary serves the reads.
    env.cluster
        .node("pg2")
        .stop(pgherd_cluster::StopMode::Immediate)
        .unwrap();
    wait_until(
        "reads fall back to the primary",
        Duration::from_secs(10),
        || {
            psql(&ro, &["-c", "SELECT pg_is_in_recovery()"])
                .map(|o| o == "f")
                .unwrap_or(false)
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_what_is_left_at_the_deadline() {
    let mut env = env(0, |c| c.proxy("shutdown_timeout_ms = 1000"));
    let stuck = env.app().await;
    stuck.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let started = Instant::now();
    env.pgherd.signal(libc::SIGTERM);
    let status = env
        .pgherd
        .wait_exit(Duration::from_secs(10))
        .expect("pgherd must exit at the deadline");
    assert!(status.success());
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "exited before the deadline"
    );
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "exited long after the deadline"
    );
    assert!(stuck.simple_query("SELECT 1").await.is_err());
    // The abandoned transaction was rolled back by PostgreSQL when its connection closed.
    wait_until(
        "the server session is gone",
        Duration::from_secs(10),
        || app_backends(&env) == 0,
    );
}
