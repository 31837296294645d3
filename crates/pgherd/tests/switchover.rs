//! Switchover under load: clients writing through pgherd (our own writers, which check every
//! acknowledged id, and pgbench's TPC-B) see no error and lose no acknowledged write while the
//! primary role moves; the old primary comes back as a standby of the new one and the other
//! replica follows it.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use std::sync::Mutex;

const SUPERUSER: &str = pgherd_testkit::SUPERUSER;
const WRITERS: usize = 6;

#[derive(Default)]
struct Tally {
    acked: Vec<i64>,
    errors: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchover_under_load_loses_nothing_and_fails_no_client() {
    let env = env(2, |c| {
        c.manage_nodes()
            .superuser()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .database(APP, "")
            .database("app_session", "dbname = \"app\"\nmode = \"session\"")
    });
    // A session-mode client, idle on the primary: it owes nothing, so the drain does not
    // wait for it (writes would wait the whole drain); its session ends with the server's.
    let session = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "app_session")).await;
    session
        .batch_execute("SET application_name = 'held'")
        .await
        .expect("session");
    let c = env.app().await;
    c.batch_execute("CREATE TABLE acked (id bigint PRIMARY KEY, note text)")
        .await
        .expect("create");
    let admin = env
        .pgherd
        .url(SUPERUSER, pgherd_testkit::SUPERUSER_PASSWORD, "pgherd");
    // A bad target is refused with a reason, and nothing changes.
    let refused = psql(&admin, &["-c", "SWITCHOVER TO pg9"]).expect_err("unknown node");
    assert!(refused.contains("no node named \"pg9\""), "{refused}");

    // pgbench's TPC-B through pgherd too: any failed transaction aborts its client.
    let url = env.app_url();
    pgbench(&url, &["-i", "-s", "1", "-q"]).expect("pgbench -i through pgherd");
    let tpcb = std::thread::spawn(move || pgbench(&url, &["-n", "-c", "4", "-j", "2", "-T", "5"]));

    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (stop, tally, url) = (
            stop.clone(),
            tally.clone(),
            env.pgherd.conninfo(APP, APP_PASSWORD, APP),
        );
        writers.push(tokio::spawn(async move {
            let c = connect(&url).await;
            let mut n: i64 = 0;
            while !stop.load(Ordering::Relaxed) {
                let id = (w as i64) * 1_000_000 + n;
                n += 1;
                // Autocommit writes, and transactions of several statements (which the
                // switchover lets finish).
                let sql = if n % 3 == 0 {
                    format!("BEGIN; INSERT INTO acked VALUES ({id}, 'tx'); SELECT pg_sleep(0.01); COMMIT")
                } else {
                    format!("INSERT INTO acked VALUES ({id}, 'auto')")
                };
                match c.batch_execute(&sql).await {
                    Ok(()) => tally.lock().unwrap().acked.push(id),
                    Err(e) => tally.lock().unwrap().errors.push(format!("{id}: {e:?}")),
                }
                if let Err(e) = c.simple_query("SELECT count(*) FROM acked").await {
                    tally.lock().unwrap().errors.push(format!("read: {e:?}"));
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let before = tally.lock().unwrap().acked.len();
    let answer = psql(&admin, &["-c", "SWITCHOVER TO pg2"]);
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.expect("writer");
    }
    let answer = answer.unwrap_or_else(|e| panic!("switchover failed: {e}\n{}", env.pgherd.log()));
    assert!(
        answer.contains("switched over from pg1 to pg2"),
        "{answer}\n{}",
        env.pgherd.log()
    );
    assert!(
        answer.contains("transactions on pg1 finished"),
        "the drain waited for an idle session: {answer}"
    );
    let ended = session
        .simple_query("SELECT 1")
        .await
        .expect_err("its server stopped");
    assert!(
        ended.to_string().contains("closed") || code(&ended) == "57P01",
        "{ended:?}"
    );
    let tpcb = tpcb.join().expect("pgbench thread");
    let tpcb = tpcb.unwrap_or_else(|e| panic!("pgbench failed across the switchover: {e}"));
    assert!(tpcb.contains("number of failed transactions: 0"), "{tpcb}");
    let tally = std::mem::take(&mut *tally.lock().expect("tally"));
    assert!(
        tally.errors.is_empty(),
        "{} client error(s) during the switchover, first: {}\n{}",
        tally.errors.len(),
        tally.errors[0],
        env.pgherd.log()
    );
    assert!(
        tally.acked.len() > before,
        "no write was acknowledged after the switchover began"
    );
    eprintln!(
        "{} writes acknowledged, {before} before the switchover; steps:\n{answer}",
        tally.acked.len()
    );

    // Every acknowledged write is on the new primary.
    let on_new = env.cluster.sql_on(
        "pg2",
        APP,
        &format!(
            "SELECT count(*) FROM acked WHERE id IN ({})",
            tally
                .acked
                .iter()
                .map(|id| id.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ),
    );
    assert_eq!(on_new, tally.acked.len().to_string());
    assert_eq!(
        env.cluster
            .sql_on("pg2", "postgres", "SELECT pg_is_in_recovery()"),
        "f"
    );
    assert_eq!(
        env.cluster
            .sql_on("pg1", "postgres", "SELECT pg_is_in_recovery()"),
        "t",
        "the old primary did not come back as a standby"
    );
    // Writes go to pg2, and both other nodes replay them.
    let c = env.app().await;
    assert_eq!(
        first_value(&c, "/* pgherd:primary */ SELECT current_setting('port')")
            .await
            .expect("port"),
        env.cluster.node("pg2").port.to_string()
    );
    c.batch_execute("INSERT INTO acked VALUES (-1, 'after')")
        .await
        .expect("write after the switchover");
    for follower in ["pg1", "pg3"] {
        wait_until(
            &env,
            &format!("{follower} replayed a write made after the switchover"),
            Duration::from_secs(30),
            || {
                env.cluster
                    .sql_on(follower, APP, "SELECT count(*) FROM acked WHERE id = -1")
                    == "1"
            },
        );
    }

    // And back, with the command-line tool, to the most advanced replica (no --to).
    let out = std::process::Command::new(BIN)
        .args(["switchover", "--config"])
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run pgherd switchover");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && printed.contains("switched over from pg2 to"),
        "{printed}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        env.pgherd.log()
    );
    c.batch_execute("INSERT INTO acked VALUES (-2, 'after the second')")
        .await
        .expect("write after the second switchover");
    assert_eq!(
        env.cluster
            .sql_on("pg2", "postgres", "SELECT pg_is_in_recovery()"),
        "t"
    );

    let events = psql(&admin, &["-c", "SHOW EVENTS"]).expect("SHOW EVENTS");
    for kind in [
        "|switchover_started|",
        "|promoted|",
        "|rejoined|",
        "|switched_over|",
    ] {
        assert!(events.contains(kind), "no {kind} event in:\n{events}");
    }
}
