//! `pgherd check-consistency` against a real primary and two streaming replicas: while
//! pgbench writes, every table (a composite text key with awkward values, a table without a
//! key) is reported the same on all three, read at the same point on each; a replica whose
//! replay is paused stops the check with a message naming it, and leaves no lock behind;
//! an unknown node and a check without the primary are refused.

mod common;

use std::process::{Command, Output};
use std::time::Duration;

use common::*;

fn check(env: &Env, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("check-consistency")
        .arg("--config")
        .arg(&env.pgherd.config_path)
        .args(["--database", APP])
        .args(args)
        .output()
        .expect("run pgherd check-consistency")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_copies_are_the_same_under_writes_and_a_stalled_replica_is_named() {
    let env = env(2, |c| c.superuser().mode("transaction"));
    let url = format!("{}?sslmode=disable", env.app_url());
    pgbench(&url, &["-i", "-s", "2", "-q"]).expect("pgbench -i");
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE odd (region text, id int, note text, at timestamptz, v float8, \
                           PRIMARY KEY (region, id)); \
         INSERT INTO odd SELECT CASE i % 4 WHEN 0 THEN 'O''Brien' WHEN 1 THEN 'zürich' \
                                WHEN 2 THEN 'a,b' ELSE '' END, \
                           i, CASE WHEN i % 3 = 0 THEN NULL ELSE repeat('x', i % 50) END, \
                           '2026-01-01 00:00+00'::timestamptz + i * interval '1 minute', \
                           i / 7.0 \
           FROM generate_series(1, 3000) i; \
         CREATE TABLE keyless (line text); \
         INSERT INTO keyless SELECT 'line ' || i FROM generate_series(1, 500) i",
    )
    .await
    .unwrap();

    // Writes all over pgbench_accounts, branches, tellers and history while the check runs.
    let load = std::thread::spawn({
        let url = url.clone();
        move || pgbench(&url, &["-c", "4", "-j", "2", "-T", "12", "-n"])
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let out = check(&env, &["--chunk-rows", "7000"]);
    let report = text(&out);
    assert!(out.status.success(), "{report}");
    for table in [
        "public.pgbench_branches: same in 1 chunks",
        "public.pgbench_tellers: same in 1 chunks",
        "public.pgbench_history: same in 1 chunks",
        "public.odd: same in 1 chunks",
        "public.keyless: same in 1 chunks",
    ] {
        assert!(report.contains(table), "{table} missing in {report}");
    }
    assert!(
        // 28 chunks of 7,000 rows by the key's order, and the last 4,000.
        report.contains(
            "public.pgbench_accounts: same in 29 chunks; rows: pg1 200000, pg2 200000, pg3 200000"
        ),
        "{report}"
    );
    assert!(
        report.contains("(no primary key: compared whole)"),
        "{report}"
    );
    assert!(
        report.contains("6 tables checked on pg1, pg2, pg3: no difference"),
        "{report}"
    );
    let bench = load.join().unwrap().expect("pgbench ran beside the check");
    assert!(
        bench.contains("number of failed transactions: 0"),
        "{bench}"
    );

    // JSON for scripts, and a table pattern.
    let out = check(&env, &["--tables", "odd", "--json", "--chunk-rows", "1000"]);
    assert!(out.status.success(), "{}", text(&out));
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["tables"].as_array().unwrap().len(), 1);
    assert_eq!(answer["tables"][0]["table"], "public.odd");
    // Three full chunks and the open-ended one after the last key (empty here).
    assert_eq!(answer["tables"][0]["chunks"], 4);
    assert_eq!(
        answer["tables"][0]["rows"],
        serde_json::json!([3000, 3000, 3000])
    );

    // A replica that stops replaying: the check says which, and leaves nothing locked.
    env.cluster
        .sql_on("pg3", "postgres", "SELECT pg_wal_replay_pause()");
    app.batch_execute("UPDATE odd SET v = v + 1 WHERE id = 1")
        .await
        .unwrap();
    let out = check(&env, &["--tables", "odd", "--replay-timeout-ms", "1500"]);
    let report = text(&out);
    assert!(!out.status.success());
    assert!(
        report.contains("node pg3 did not replay up to") && report.contains("within 1500 ms"),
        "{report}"
    );
    tokio::time::timeout(
        Duration::from_secs(5),
        app.batch_execute("UPDATE odd SET v = v + 1 WHERE id = 2"),
    )
    .await
    .expect("no lock left behind")
    .unwrap();
    env.cluster
        .sql_on("pg3", "postgres", "SELECT pg_wal_replay_resume()");

    // Refusals.
    let out = check(&env, &["--nodes", "pg1,nope"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no node \"nope\" in the config"),
        "{}",
        text(&out)
    );
    let out = check(&env, &["--nodes", "pg2,pg3"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("none of the nodes is the primary"),
        "{}",
        text(&out)
    );
}
