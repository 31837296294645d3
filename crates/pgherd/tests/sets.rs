//! Replication sets against real clusters: a set of some of a database's tables on the
//! pgherd cluster's primary, subscribed to by a second cluster: its rows are copied, writes
//! through pgherd reach the subscriber, tables outside the set do not, and `pgherd set list`
//! shows the set, its subscriber and its lag; a DDL script through `execute-script` while
//! writes go on (a column added on the subscriber first, a new table joining the set through
//! the scan, a column dropped on the origin first) loses no row. Refused with nothing changed:
//! a table without a primary key, patterns that match nothing, a bad name, a subscriber that
//! lacks a table, one that does not answer, an unknown set, a script with a syntax error, one
//! missing a subscriber.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::sets::*;
use common::*;
use pgherd_testkit::{TestCluster, SUPERUSER, SUPERUSER_PASSWORD};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_set_of_some_tables_replicates_to_a_second_cluster() {
    let api_port = pgherd_cluster::free_port().expect("free port");
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section("[sets]\ndatabases = [\"app\"]\npoll_ms = 200")
            .section(&format!("[api]\nlisten = [\"127.0.0.1:{api_port}\"]"))
    });
    env.direct(
        "CREATE TABLE orders (id int PRIMARY KEY, item text); \
         CREATE TABLE order_lines (id int PRIMARY KEY, qty int); \
         CREATE TABLE audit_log (at timestamptz, what text); \
         CREATE TABLE private_notes (id int PRIMARY KEY, note text); \
         INSERT INTO orders SELECT g, 'item ' || g FROM generate_series(1, 1000) g; \
         INSERT INTO order_lines SELECT g, g % 7 FROM generate_series(1, 500) g; \
         INSERT INTO private_notes VALUES (1, 'stays home'); \
         CREATE SEQUENCE order_ids; SELECT setval('order_ids', 1234); \
         GRANT ALL ON ALL TABLES IN SCHEMA public TO app",
    );
    let subscriber = TestCluster::start(0);
    subscriber.sql(&format!("CREATE DATABASE {APP}"));
    let sub_port = subscriber.node("pg1").port;
    let to = format!(
        "host=127.0.0.1 port={sub_port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={APP}"
    );
    subscriber.sql_on(
        "pg1",
        APP,
        "CREATE TABLE orders (id int PRIMARY KEY, item text); \
         CREATE TABLE private_notes (id int PRIMARY KEY, note text)",
    );

    // Refusals first, each leaving nothing behind.
    refused(
        &set(&env, &["create", "shop", "--tables", "order*,audit_log"]),
        "public.audit_log has no primary key",
    );
    refused(
        &set(&env, &["create", "shop", "--tables", "nothing*"]),
        "match no table of the database: a set with no tables is refused",
    );
    refused(
        &set(&env, &["create", "Shop", "--tables", "orders"]),
        "cannot name a set",
    );
    assert_eq!(
        env.direct("SELECT count(*) FROM pg_publication").trim(),
        "0",
        "no publication was left by a refused set"
    );

    refused(
        &set(
            &env,
            &[
                "create",
                "shop",
                "--tables",
                "order*",
                "--sequences",
                "nope*",
            ],
        ),
        "the sequence patterns nope* match no sequence of the database",
    );
    let out = set(
        &env,
        &[
            "create",
            "shop",
            "--tables",
            "order*",
            "--sequences",
            "order*",
        ],
    );
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("set shop created on pg1 (app): 2 tables: public.order_lines, public.orders; sequences kept in step: public.order_ids"),
        "{said}"
    );
    refused(
        &set(&env, &["create", "shop", "--tables", "orders"]),
        "a set named shop exists already",
    );

    refused(
        &set(&env, &["subscribe", "shop", "--to", &to]),
        "the subscriber has no table public.order_lines: create it there first",
    );
    no_subscription_on(&env, &subscriber);
    refused(
        &set(
            &env,
            &[
                "subscribe",
                "shop",
                "--to",
                "host=127.0.0.1 port=1 user=x dbname=app",
            ],
        ),
        "cannot connect to the subscriber 127.0.0.1:1/app",
    );
    no_subscription_on(&env, &subscriber);
    refused(
        &set(&env, &["subscribe", "nope", "--to", &to]),
        "no set named nope in app",
    );
    no_subscription_on(&env, &subscriber);

    subscriber.sql_on(
        "pg1",
        APP,
        "CREATE TABLE order_lines (id int PRIMARY KEY, qty int)",
    );
    refused(
        &set(&env, &["subscribe", "shop", "--to", &to]),
        "the subscriber has no sequence public.order_ids: create it there first",
    );
    no_subscription_on(&env, &subscriber);
    subscriber.sql_on("pg1", APP, "CREATE SEQUENCE order_ids");
    // A subscribe that stops waiting for the copy (no time at all here: its first look comes
    // before PostgreSQL's table-sync workers start) says how to finish, and the same command
    // again waits for the rest and finishes.
    let out = set(&env, &["subscribe", "shop", "--to", &to, "--wait-s", "0"]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("tables copied after 0 s")
            && said.contains("the same `pgherd set subscribe` again waits for the rest"),
        "{said}"
    );
    let out = set(&env, &["subscribe", "shop", "--to", &to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("has the subscription"), "{said}");
    assert!(
        said.contains(&format!(
            "127.0.0.1:{sub_port}/app is subscribed to shop: 2 tables copied"
        )),
        "{said}"
    );
    assert!(
        !said.contains(SUPERUSER_PASSWORD),
        "no password shown: {said}"
    );
    assert_eq!(
        subscriber
            .sql_on("pg1", APP, "SELECT last_value FROM order_ids")
            .trim(),
        "1234",
        "the sequence is in step after subscribing"
    );
    let local_write = subscriber
        .node("pg1")
        .psql(APP, "INSERT INTO orders VALUES (99999, 'local')")
        .expect_err("a subscriber's copy refuses local writes");
    assert!(
        local_write
            .to_string()
            .contains("is in replication set shop, whose origin is pg1"),
        "{local_write}"
    );
    let on_subscriber = |sql: &str| subscriber.sql_on("pg1", APP, sql).trim().to_owned();
    assert_eq!(on_subscriber("SELECT count(*) FROM orders"), "1000");
    assert_eq!(
        on_subscriber("SELECT sum(qty) FROM order_lines"),
        env.direct("SELECT sum(qty) FROM order_lines").trim()
    );

    // Writes through pgherd reach the subscriber; a table outside the set does not.
    let app = env.app().await;
    app.batch_execute(
        "INSERT INTO orders VALUES (1001, 'new'); UPDATE orders SET item = 'changed' WHERE id = 1; \
         DELETE FROM order_lines WHERE id <= 10; INSERT INTO private_notes VALUES (2, 'also home')",
    )
    .await
    .expect("writes through pgherd");
    let started = Instant::now();
    while on_subscriber("SELECT count(*) || '/' || (SELECT item FROM orders WHERE id = 1) || '/' || (SELECT count(*) FROM order_lines) FROM orders")
        != "1001/changed/490"
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the subscriber receives the set's changes: {}",
            on_subscriber("SELECT count(*) FROM orders")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(on_subscriber("SELECT count(*) FROM private_notes"), "0");

    // The running pgherd follows the set: SHOW SETS names its subscriber, streaming.
    let console = connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    let started = Instant::now();
    loop {
        let rows = console.simple_query("SHOW SETS").await.expect("SHOW SETS");
        let shown = rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get("set") == Some("shop") => Some((
                r.get("subscriber").map(str::to_owned),
                r.get("streaming").map(str::to_owned),
                r.get("lag_bytes").map(str::to_owned),
                r.get("tables").map(str::to_owned),
            )),
            _ => None,
        });
        if let Some((subscriber, streaming, lag, tables)) = &shown {
            if streaming.as_deref() == Some("yes") {
                assert_eq!(
                    subscriber.as_deref(),
                    Some(format!("127.0.0.1:{sub_port}/app").as_str())
                );
                assert!(
                    lag.as_deref().is_some_and(|l| l.parse::<u64>().is_ok()),
                    "{shown:?}"
                );
                assert_eq!(tables.as_deref(), Some("public.order_lines, public.orders"));
                break;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "SHOW SETS shows the subscriber streaming: {shown:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The same through the HTTP API and the metrics.
    let get = |path: &str| {
        ureq::get(&format!("http://127.0.0.1:{api_port}{path}"))
            .call()
            .expect("the API answers")
            .into_string()
            .expect("text")
    };
    let api_sets: serde_json::Value = serde_json::from_str(&get("/api/sets")).expect("JSON");
    let api_text = api_sets.to_string();
    assert!(
        api_text.contains("\"shop\"") && api_text.contains(&format!("127.0.0.1:{sub_port}/app")),
        "{api_sets}"
    );
    // And on the dashboard (in headless Chromium): the set's row, streaming, with its lag.
    let shown = format!("127.0.0.1:{sub_port}/app");
    let api = format!("http://127.0.0.1:{api_port}");
    let said = tokio::task::spawn_blocking(move || {
        dashboard_phase(
            &api,
            "",
            "sets",
            &[("SET", "shop"), ("SUBSCRIBER", shown.as_str())],
        )
    })
    .await
    .expect("the dashboard phase ran");
    assert!(said.contains("sets: ok"), "{said}");
    let metrics = get("/metrics");
    let labels = format!("database=\"app\",set=\"shop\",subscriber=\"127.0.0.1:{sub_port}/app\"");
    assert!(
        metrics.contains(&format!("pgherd_set_subscriber_streaming{{{labels}}} 1")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!("pgherd_set_subscriber_lag_bytes{{{labels}}} ")),
        "{metrics}"
    );

    let out = set(&env, &["list", "--json"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    let listed: serde_json::Value = serde_json::from_str(said.trim()).expect("JSON");
    assert_eq!(listed[0]["name"], "shop");
    assert_eq!(listed[0]["origin"], "pg1");
    assert_eq!(
        listed[0]["tables"],
        serde_json::json!(["public.order_lines", "public.orders"])
    );
    let sub = &listed[0]["subscribers"][0];
    assert_eq!(sub["subscriber"], format!("127.0.0.1:{sub_port}/app"));
    assert_eq!(sub["streaming"], true, "{said}");
    assert!(sub["lag_bytes"].as_i64().is_some(), "{said}");
    let out = set(&env, &["list"]);
    assert!(
        text(&out).contains("set shop on pg1: public.order_lines, public.orders"),
        "{}",
        text(&out)
    );

    // DDL through execute-script while writes go on through pgherd.
    let script_file = |name: &str, sql: &str| {
        let path = env.cluster.dir().join(name);
        std::fs::write(&path, sql).expect("script");
        path
    };
    let execute = |path: &std::path::Path, to: &[&str]| {
        let mut cmd = Command::new(BIN);
        cmd.arg("execute-script")
            .arg(path)
            .args(["--set", "shop", "--database", APP]);
        for t in to {
            cmd.args(["--to", t]);
        }
        cmd.arg("--config")
            .arg(&env.pgherd.config_path)
            .output()
            .expect("run execute-script")
    };
    let bad = script_file(
        "bad.sql",
        "ALTER TABLE orders ADD COLUMN note text;\nALTER TABEL orders ADD COLUMN x int;\n",
    );
    refused(
        &execute(&bad, &[&to]),
        "statement 2 (line 2) does not parse: syntax error at or near \"TABEL\"; nothing was run",
    );
    let good = script_file(
        "good.sql",
        "-- notes on orders\n\
         ALTER TABLE orders ADD COLUMN note text;\n\
         CREATE TABLE order_notes (id int PRIMARY KEY, note text);\n\
         ALTER TABLE order_lines DROP COLUMN qty;\n",
    );
    // A statement that fails on a node stops the script, saying what ran where.
    let failing = script_file(
        "failing.sql",
        "CREATE INDEX orders_item ON orders (item);\nGRANT SELECT ON orders TO app;\nCREATE INDEX orders_id ON orders (id);\n",
    );
    let out = execute(&failing, &[&to]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("statement 1 (line 1): on the origin first; locks SHARE on public.orders"),
        "{said}"
    );
    assert!(
        said.contains(&format!(
            "statement 2 (line 2) failed on 127.0.0.1:{sub_port}/app: role \"app\" does not exist (42704); it ran on pg1; not on any other node; the 1 statement(s) after it were not run"
        )),
        "{said}"
    );
    refused(&execute(&good, &[]), "its subscriber 127.0.0.1:");
    assert_eq!(
        env.direct("SELECT count(*) FROM information_schema.columns WHERE table_name = 'orders' AND column_name = 'note'").trim(),
        "0",
        "a refused script ran nowhere"
    );
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, url) = (stop.clone(), env.pgherd.conninfo(APP, APP_PASSWORD, APP));
        tokio::spawn(async move {
            let client = connect(&url).await;
            let mut id = 2000;
            let mut failed = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                id += 1;
                if let Err(e) = client
                    .batch_execute(&format!(
                        "INSERT INTO orders (id, item) VALUES ({id}, 'during')"
                    ))
                    .await
                {
                    failed.push(e.to_string());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            (id - 2000, failed)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = execute(&good, &[&to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("statement 1 (line 2): on the subscribers first; locks ACCESS EXCLUSIVE on public.orders"), "{said}");
    assert!(said.contains("statement 3 (line 4): on the origin first; locks ACCESS EXCLUSIVE on public.order_lines"), "{said}");
    assert!(
        said.contains("set shop: public.order_notes joined it"),
        "{said}"
    );
    env.direct("GRANT ALL ON order_notes TO app");
    app.batch_execute("INSERT INTO orders (id, item, note) VALUES (5000, 'noted', 'a note'); INSERT INTO order_notes VALUES (1, 'first')")
        .await
        .expect("writes using the new column and table");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (written, failed) = writer.await.expect("writer");
    assert!(
        failed.is_empty(),
        "writes failed during the script: {failed:?}"
    );
    assert!(written > 10, "writes went on during the script: {written}");
    let started = Instant::now();
    loop {
        let there = on_subscriber("SELECT (SELECT count(*) FROM orders) || '/' || (SELECT coalesce(note, '-') FROM orders WHERE id = 5000) || '/' || (SELECT count(*) FROM order_notes)");
        let expected = format!(
            "{}/a note/1",
            env.direct("SELECT count(*) FROM orders").trim()
        );
        if there == expected {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the subscriber has every row, the new column's value and the new table's row: {there} (expected {expected})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The order kept the stream applying: not one apply error on the subscriber (a column the
    // origin sent before the subscriber had it would have stopped the apply worker).
    assert_eq!(
        on_subscriber("SELECT coalesce(sum(apply_error_count + sync_error_count), 0) FROM pg_stat_subscription_stats"),
        "0"
    );
    assert_eq!(
        on_subscriber("SELECT count(*) FROM information_schema.columns WHERE table_name = 'order_lines' AND column_name = 'qty'"),
        "0",
        "the dropped column is gone on the subscriber too"
    );

    // Sequences in step again after the origin handed out more values.
    env.direct("SELECT nextval('order_ids'); SELECT nextval('order_ids')");
    let out = set(&env, &["sync-sequences", "shop", "--to", &to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("set shop: 1 sequence in step on 127.0.0.1:"),
        "{said}"
    );
    assert_eq!(
        subscriber
            .sql_on("pg1", APP, "SELECT last_value FROM order_ids")
            .trim(),
        "1236"
    );

    // A sequence taken out of the set is no longer moved on the subscriber; added back, it is.
    refused(
        &set(&env, &["drop-sequences", "shop", "--sequences", "nope*"]),
        "the patterns nope* match no sequence it keeps in step",
    );
    let out = set(
        &env,
        &["drop-sequences", "shop", "--sequences", "order_ids"],
    );
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("set shop: public.order_ids no longer kept in step"),
        "{said}"
    );
    env.direct("SELECT nextval('order_ids')");
    let out = set(&env, &["sync-sequences", "shop", "--to", &to]);
    assert!(
        text(&out).contains("set shop: 0 sequences in step"),
        "{}",
        text(&out)
    );
    let last_value = || {
        subscriber
            .sql_on("pg1", APP, "SELECT last_value FROM order_ids")
            .trim()
            .to_owned()
    };
    assert_eq!(last_value(), "1236", "a sequence out of the set stays");
    let out = set(
        &env,
        &[
            "add-sequences",
            "shop",
            "--sequences",
            "order_ids",
            "--to",
            &to,
        ],
    );
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("1 sequence in step on 127.0.0.1:"), "{said}");
    assert_eq!(last_value(), "1237", "added back, it is in step at once");

    // The set's copies compared at one point (the origin's lock, the set's marker): the same;
    // then a row changed behind replication's back on the subscriber is found, with its range.
    let check = |extra: &[&str]| {
        Command::new(BIN)
            .args([
                "check-consistency",
                "--database",
                APP,
                "--set",
                "shop",
                "--to",
                &to,
            ])
            .args(extra)
            .arg("--config")
            .arg(&env.pgherd.config_path)
            .output()
            .expect("run check-consistency")
    };
    let out = check(&["--chunk-rows", "100"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("public.orders: same in"), "{said}");
    assert!(said.contains("public.order_notes: same in"), "{said}");
    assert!(
        !said.contains("private_notes"),
        "only the set's tables: {said}"
    );
    subscriber.sql_on(
        "pg1",
        APP,
        "SET session_replication_role = replica; UPDATE orders SET item = 'tampered' WHERE id = 450",
    );
    let out = check(&["--chunk-rows", "100"]);
    let said = text(&out);
    assert!(
        !out.status.success(),
        "a difference fails the check: {said}"
    );
    assert!(said.contains("public.orders: DIFFERS in 1 of"), "{said}");
    assert!(
        said.contains("key > (400) and <= (500)")
            && said.contains(&format!("differs on 127.0.0.1:{sub_port}/app")),
        "{said}"
    );
    assert!(said.contains("public.order_lines: same in"), "{said}");

    // A move that fails half-way is undone: the would-be origin already has a publication of
    // the set's name, so it cannot publish the set after it stopped following; it follows the
    // old origin again from where it was, and the old origin's writes reach it.
    subscriber.sql_on("pg1", APP, "CREATE PUBLICATION pgherd_shop");
    let out = set(&env, &["move", "shop", "--new-origin", &to]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("already exists")
            && said.contains("the move was undone: pg1 is the set's origin and every subscriber follows it as before"),
        "{said}"
    );
    subscriber.sql_on("pg1", APP, "DROP PUBLICATION pgherd_shop");
    app.batch_execute("INSERT INTO orders (id, item) VALUES (9999, 'after the undo')")
        .await
        .expect("the old origin still takes the set's writes");
    let started = Instant::now();
    while on_subscriber("SELECT count(*) FROM orders WHERE id = 9999") != "1" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the subscriber follows the old origin again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The set's origin moves to the subscriber while writes go on through pgherd: every
    // acknowledged write reaches the new origin, the writes held back are refused (25006),
    // and from then on the new origin takes writes, which reach the old one.
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::<i64>::new()));
    let refusals = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (acked, refusals, stop) = (acked.clone(), refusals.clone(), stop.clone());
        let url = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
        tokio::spawn(async move {
            let client = connect(&url).await;
            let mut id = 10_000i64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                id += 1;
                match client
                    .batch_execute(&format!(
                        "INSERT INTO orders (id, item) VALUES ({id}, 'moving')"
                    ))
                    .await
                {
                    Ok(()) => acked.lock().unwrap().push(id),
                    Err(e) => refusals.lock().unwrap().push(code(&e)),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = set(&env, &["move", "shop", "--new-origin", &to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    eprintln!("{}", said.trim());
    assert!(
        said.contains(&format!(
            "set shop moved from pg1 to 127.0.0.1:{sub_port}/app: writes to its tables were held"
        )),
        "{said}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.expect("writer");
    let acked = acked.lock().unwrap().clone();
    let refusals = refusals.lock().unwrap().clone();
    assert!(
        acked.len() > 10,
        "writes went on before the move: {}",
        acked.len()
    );
    assert!(!refusals.is_empty(), "writes after the move were refused");
    assert!(
        refusals.iter().all(|c| c == "25006"),
        "only the move's refusals: {refusals:?}"
    );
    let list: Vec<String> = acked.iter().map(i64::to_string).collect();
    assert_eq!(
        on_subscriber(&format!(
            "SELECT count(*) FROM orders WHERE id IN ({})",
            list.join(",")
        )),
        acked.len().to_string(),
        "every acknowledged write is on the new origin"
    );
    let refused_here = app
        .batch_execute("INSERT INTO orders (id, item) VALUES (88888, 'old origin')")
        .await
        .expect_err("the old origin refuses the set's writes");
    assert_eq!(code(&refused_here), "25006");
    subscriber.sql_on(
        "pg1",
        APP,
        "INSERT INTO orders (id, item) VALUES (77777, 'new origin')",
    );
    let started = Instant::now();
    while env
        .direct("SELECT count(*) FROM orders WHERE id = 77777")
        .trim()
        != "1"
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the old origin follows the new one"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Sequences in step: the new origin hands out the value after the old one's last.
    assert_eq!(on_subscriber("SELECT nextval('order_ids')"), "1238");
}

/// A table leaves a set: the origin stops publishing it, the subscriber keeps its copy as its
/// own writable table and no longer receives the origin's changes to it, and the scan after a
/// script does not add it back although it still matches the set's patterns. Taking out a
/// table the set does not have, every table, or without the subscriber is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_leaves_a_set_and_stays_out() {
    let env = env(0, |c| c.superuser().manage_nodes());
    let tables = "CREATE TABLE orders (id int PRIMARY KEY, item text); \
                  CREATE TABLE order_lines (id int PRIMARY KEY, qty int)";
    env.direct(tables);
    env.direct("INSERT INTO orders VALUES (1, 'a'); INSERT INTO order_lines VALUES (1, 1)");
    let subscriber = TestCluster::start(0);
    subscriber.sql(&format!("CREATE DATABASE {APP}"));
    subscriber.sql_on("pg1", APP, tables);
    let sub_port = subscriber.node("pg1").port;
    let to = format!(
        "host=127.0.0.1 port={sub_port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={APP}"
    );
    let out = set(&env, &["create", "shop", "--tables", "order*"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = set(&env, &["subscribe", "shop", "--to", &to]);
    assert!(out.status.success(), "{}", text(&out));

    let drop = |patterns: &str, to: &[&str]| {
        let mut args = vec!["drop-tables", "shop", "--tables", patterns];
        for t in to {
            args.extend(["--to", t]);
        }
        set(&env, &args)
    };
    refused(
        &drop("nope", &[&to]),
        "the patterns nope match no table of the set",
    );
    refused(&drop("order*", &[&to]), "a set keeps at least one");
    refused(
        &drop("order_lines", &[]),
        &format!("its subscriber 127.0.0.1:{sub_port}/app was not given with --to"),
    );
    let published = || {
        env.direct(
            "SELECT string_agg(tablename, ',' ORDER BY tablename) FROM pg_publication_tables \
             WHERE pubname = 'pgherd_shop' AND schemaname = 'public'",
        )
        .trim()
        .to_owned()
    };
    assert_eq!(
        published(),
        "order_lines,orders",
        "refusals changed nothing"
    );

    let out = drop("order_lines", &[&to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "set shop: public.order_lines left it on pg1; 127.0.0.1:{sub_port}/app keeps it as its own"
        )),
        "{said}"
    );
    assert_eq!(published(), "orders");
    subscriber.sql_on("pg1", APP, "INSERT INTO order_lines VALUES (2, 2)");
    env.direct("INSERT INTO orders VALUES (2, 'b'); INSERT INTO order_lines VALUES (3, 3)");
    let started = Instant::now();
    while subscriber
        .sql_on("pg1", APP, "SELECT count(*) FROM orders WHERE id = 2")
        .trim()
        != "1"
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "orders still replicates"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        subscriber
            .sql_on(
                "pg1",
                APP,
                "SELECT string_agg(id::text, ',' ORDER BY id) FROM order_lines"
            )
            .trim(),
        "1,2",
        "the subscriber's order_lines is its own: the origin's new row did not come"
    );

    // A script's scan does not add it back, though it matches order*.
    let script = env.cluster.dir().join("index.sql");
    std::fs::write(&script, "CREATE INDEX orders_item ON orders (item);\n").expect("script");
    let out = Command::new(BIN)
        .arg("execute-script")
        .arg(&script)
        .args(["--set", "shop", "--database", APP, "--to", &to, "--config"])
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run execute-script");
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(published(), "orders", "the scan left order_lines out");

    // Tables join with add-tables (a pattern naming the table taken out leaves it out, said)
    // and with the scan on its own, from cron; the subscriber copies their rows.
    let invoices = "CREATE TABLE invoices (id int PRIMARY KEY, total int)";
    env.direct(invoices);
    subscriber.sql_on("pg1", APP, invoices);
    env.direct("INSERT INTO invoices VALUES (1, 10), (2, 20)");
    refused(
        &set(&env, &["add-tables", "shop", "--tables", "invoices"]),
        &format!("its subscriber 127.0.0.1:{sub_port}/app was not given with --to"),
    );
    let out = set(
        &env,
        &[
            "add-tables",
            "shop",
            "--tables",
            "invoices,order_lines",
            "--to",
            &to,
        ],
    );
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("public.order_lines taken out of it"),
        "{said}"
    );
    assert!(said.contains("public.invoices joined it"), "{said}");
    // Made after: it matches order*.
    let notes = "CREATE TABLE order_notes (id int PRIMARY KEY, note text)";
    env.direct(notes);
    subscriber.sql_on("pg1", APP, notes);
    env.direct("INSERT INTO order_notes VALUES (1, 'n')");
    let out = set(&env, &["scan", "shop", "--to", &to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("public.order_notes joined it"), "{said}");
    assert_eq!(published(), "invoices,order_notes,orders");
    let started = Instant::now();
    while subscriber
        .sql_on(
            "pg1",
            APP,
            "SELECT (SELECT sum(total) FROM invoices) || '/' || (SELECT count(*) FROM order_notes)",
        )
        .trim()
        != "30/1"
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the subscriber copies the tables that joined"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = set(&env, &["scan", "shop", "--to", &to]);
    assert!(
        text(&out).contains("set shop: no table joined it"),
        "{}",
        text(&out)
    );

    // The whole set goes; the subscriber keeps its copies, writable, and nothing follows.
    refused(
        &set(&env, &["drop", "shop"]),
        &format!("its subscriber 127.0.0.1:{sub_port}/app was not given with --to"),
    );
    let out = set(&env, &["drop", "shop", "--to", &to]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("set shop dropped on pg1"), "{said}");
    no_subscription_on(&env, &subscriber);
    assert_eq!(published(), "", "the publication went");
    subscriber.sql_on("pg1", APP, "INSERT INTO orders VALUES (99, 'mine')");
    assert_eq!(
        subscriber
            .sql_on("pg1", APP, "SELECT count(*) FROM invoices")
            .trim(),
        "2",
        "no row was dropped"
    );
    let out = set(&env, &["create", "shop", "--tables", "order*"]);
    assert!(
        out.status.success(),
        "the name is free again: {}",
        text(&out)
    );
}
