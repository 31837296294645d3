//! Durability modes against real clusters: in `sync` pgherd keeps the primary's
//! `synchronous_standby_names` equal to the standbys streaming now and degrades to the primary
//! alone when none is left; in `strict` it refuses writes instead.

mod common;

use std::time::{Duration, Instant};

use common::*;
use pgherd_cluster::StopMode;

const SUPERUSER: &str = pgherd_testkit::SUPERUSER;

fn sync_names(env: &Env) -> String {
    env.cluster
        .sql_on("pg1", "postgres", "SHOW synchronous_standby_names")
}

fn wait_sync_names(env: &Env, expected: &str) {
    wait_until(
        env,
        &format!("synchronous_standby_names became {expected:?}"),
        Duration::from_secs(20),
        || sync_names(env) == expected,
    );
}

/// Table `t` with one row, written while pg2 is pg1's synchronous standby, and replayed there.
async fn first_row_on_both_nodes(env: &Env) {
    wait_sync_names(env, "ANY 1 (\"pg2\")");
    env.app()
        .await
        .batch_execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
        .await
        .expect("write with a synchronous standby");
    env.cluster.wait_replayed();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_keeps_the_streaming_standbys_synchronous_and_degrades_when_none_is_left() {
    let env = env(2, |c| {
        c.superuser()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    wait_sync_names(&env, "ANY 1 (\"pg2\", \"pg3\")");
    assert_eq!(
        env.cluster.sql_on(
            "pg1",
            "postgres",
            "SELECT string_agg(application_name || ':' || sync_state, ',' ORDER BY application_name) FROM pg_stat_replication"
        ),
        "pg2:quorum,pg3:quorum"
    );
    let c = env.app().await;
    c.batch_execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
        .await
        .expect("write with two synchronous standbys");

    env.cluster
        .node("pg3")
        .stop(StopMode::Immediate)
        .expect("stop pg3");
    wait_sync_names(&env, "ANY 1 (\"pg2\")");
    c.batch_execute("INSERT INTO t VALUES (2)")
        .await
        .expect("write with one synchronous standby");

    env.cluster
        .node("pg2")
        .stop(StopMode::Immediate)
        .expect("stop pg2");
    wait_sync_names(&env, "");
    c.batch_execute("INSERT INTO t VALUES (3)")
        .await
        .expect("write once sync has degraded to the primary alone");

    env.cluster
        .node("pg2")
        .start(Duration::from_secs(30))
        .expect("start pg2");
    wait_sync_names(&env, "ANY 1 (\"pg2\")");
    c.batch_execute("INSERT INTO t VALUES (4)")
        .await
        .expect("write with pg2 synchronous again");
    assert_eq!(env.direct("SELECT count(*) FROM t"), "4");

    let events = psql(
        &env.pgherd
            .url(SUPERUSER, pgherd_testkit::SUPERUSER_PASSWORD, "pgherd"),
        &["-c", "SHOW EVENTS"],
    )
    .expect("SHOW EVENTS");
    for kind in ["|sync_standbys|", "|sync_degraded|"] {
        assert!(events.contains(kind), "no {kind} event in:\n{events}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_refuses_writes_rather_than_acknowledge_them_on_the_primary_alone() {
    let env = env(1, |c| {
        c.cluster("primary_wait_ms = 1000").section(
            "[replication]\ndurability = \"strict\"\nsynchronous_commit = \"remote_apply\"",
        )
    });
    wait_sync_names(&env, "ANY 1 (\"pg2\")");
    assert_eq!(
        env.cluster
            .sql_on("pg1", "postgres", "SHOW synchronous_commit"),
        "remote_apply"
    );
    let c = env.app().await;
    c.batch_execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
        .await
        .expect("write with a synchronous standby");
    // remote_apply: the standby shows a commit before the client hears of it.
    assert_eq!(
        env.cluster.sql_on("pg2", APP, "SELECT count(*) FROM t"),
        "1"
    );

    env.cluster
        .node("pg2")
        .stop(StopMode::Immediate)
        .expect("stop pg2");
    wait_until(
        &env,
        "pgherd refused writes",
        Duration::from_secs(20),
        || env.pgherd.log().contains("writes are refused"),
    );
    let err = c
        .batch_execute("INSERT INTO t VALUES (2)")
        .await
        .expect_err("a write without a synchronous standby must be refused");
    assert_eq!(code(&err), "25006", "{err:?}");
    assert!(
        err.as_db_error()
            .is_some_and(|e| e.message().contains("no synchronous standby streams")),
        "{err:?}"
    );
    // Which request counts as a write, and why: a read pgherd cannot prove harmless is
    // refused the same way.
    assert_eq!(
        err.as_db_error().and_then(|e| e.detail()),
        Some("pgherd sends it to the primary: INSERT writes"),
        "{err:?}"
    );
    // Refused, not committed locally and left waiting.
    assert_eq!(env.direct("SELECT count(*) FROM t"), "1");
    assert_eq!(sync_names(&env), "ANY 1 (\"pg2\")");
    // Reads still work.
    assert_eq!(
        first_value(&c, "SELECT count(*) FROM t")
            .await
            .expect("read"),
        "1"
    );

    env.cluster
        .node("pg2")
        .start(Duration::from_secs(30))
        .expect("start pg2");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match c.batch_execute("INSERT INTO t VALUES (3)").await {
            Ok(()) => break,
            Err(e) => assert!(
                Instant::now() < deadline,
                "writes did not resume with the standby back: {e}\n{}",
                env.pgherd.log()
            ),
        }
    }
    assert_eq!(env.direct("SELECT count(*) FROM t"), "2");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_without_replicas_takes_writes() {
    let env = env(0, |c| {
        c.cluster("primary_wait_ms = 2000")
            .section("[replication]\ndurability = \"strict\"")
    });
    let c = env.app().await;
    c.batch_execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
        .await
        .expect("a cluster without replicas has no standby to wait for");
    assert_eq!(sync_names(&env), "");
}

/// After a failover in a two-node cluster the old primary is the new one's only standby, and
/// it is fenced until pgherd has rewound it. While pgherd brings it back (it answers, or is
/// being rejoined), the new primary's commits wait for it rather than rest on the primary
/// alone; while it is down, nothing is coming and the primary acknowledges alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_commits_wait_for_the_old_primary_pgherd_is_bringing_back() {
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section("[failover]\nenabled = true\nauto_rejoin = true")
    });
    first_row_on_both_nodes(&env).await;
    let console = env
        .pgherd
        .url(SUPERUSER, pgherd_testkit::SUPERUSER_PASSWORD, "pgherd");
    // (elected, fenced, synchronous_standby_names in force), one row of SHOW CLUSTER.
    let cluster = || {
        let row = psql(&console, &["-c", "SHOW CLUSTER"]).unwrap_or_default();
        let fields: Vec<&str> = row.split('|').collect();
        let field = |i: usize| fields.get(i).copied().unwrap_or_default().to_owned();
        (field(2), field(8), field(10))
    };

    env.cluster
        .node("pg1")
        .stop(StopMode::Immediate)
        .expect("stop pg1");
    wait_until(
        &env,
        "pg2 elected with no standby to wait for (pg1 is down)",
        Duration::from_secs(30),
        || {
            let (elected, fenced, sync) = cluster();
            elected == "pg2" && fenced.contains("pg1") && sync.is_empty()
        },
    );
    let elected_at = Instant::now();
    env.cluster
        .node("pg1")
        .start(Duration::from_secs(30))
        .expect("start pg1");
    // From the moment pg1 answers until its rejoin ends, it is fenced and yet the standby
    // pg2's commits wait for.
    let mut awaited_while_fenced = false;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, fenced, sync) = cluster();
        let fenced = fenced.contains("pg1");
        awaited_while_fenced |= fenced && sync == "ANY 1 (\"pg1\")";
        if !fenced && sync == "ANY 1 (\"pg1\")" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pg1 did not rejoin as pg2's synchronous standby: fenced {fenced}, set {sync:?}\n{}",
            env.pgherd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        awaited_while_fenced,
        "pg2 acknowledged commits alone while pg1 was being brought back ({:?} after the election)\n{}",
        elected_at.elapsed(),
        env.pgherd.log()
    );
    wait_until(
        &env,
        "pg2's synchronous_standby_names named pg1",
        Duration::from_secs(20),
        || {
            env.cluster
                .sql_on("pg2", "postgres", "SHOW synchronous_standby_names")
                == "ANY 1 (\"pg1\")"
        },
    );
    let c = env.app().await;
    c.batch_execute("INSERT INTO t VALUES (2)")
        .await
        .expect("write with pg1 synchronous again");
    assert_eq!(
        first_value(&c, "/* pgherd:primary */ SELECT count(*) FROM t")
            .await
            .expect("read"),
        "2"
    );
}

/// In `strict`, a failover that leaves the new primary no standby (the old primary is down,
/// fenced, and nothing brings it back by itself) refuses writes: the new primary waits for the
/// fenced node rather than acknowledge commits alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_after_a_failover_refuses_writes_while_the_old_primary_is_not_back() {
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .cluster("primary_wait_ms = 1000")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section("[failover]\nenabled = true\nauto_rejoin = false")
            .section("[replication]\ndurability = \"strict\"")
    });
    first_row_on_both_nodes(&env).await;

    env.cluster
        .node("pg1")
        .stop(StopMode::Immediate)
        .expect("stop pg1");
    wait_until(
        &env,
        "pg2 promoted, with writes refused (pg1, its only standby, is down and fenced)",
        Duration::from_secs(40),
        || {
            env.cluster
                .sql_on("pg2", "postgres", "SELECT pg_is_in_recovery()")
                == "f"
                && env.pgherd.log().contains("writes are refused")
        },
    );
    assert_eq!(
        env.cluster
            .sql_on("pg2", "postgres", "SHOW synchronous_standby_names"),
        "ANY 1 (\"pg1\")",
        "{}",
        env.pgherd.log()
    );
    let c = env.app().await;
    let err = c
        .batch_execute("INSERT INTO t VALUES (2)")
        .await
        .expect_err("strict must not acknowledge a commit on the new primary alone");
    assert_eq!(code(&err), "25006", "{err:?}");
    assert_eq!(
        env.cluster.sql_on("pg2", APP, "SELECT count(*) FROM t"),
        "1"
    );
}
