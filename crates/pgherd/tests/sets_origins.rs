//! Replication sets across clusters and origins: a subscriber that takes TLS only, a
//! subscriber copying a set again after its origin's cluster failed over, and two sets whose
//! origins are two clusters of one config, each subscribing to the other's.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::sets::*;
use common::*;
use pgherd_testkit::{TestCluster, SUPERUSER, SUPERUSER_PASSWORD};

/// A subscriber that takes TCP connections over TLS only (`hostssl`) is reached over TLS by
/// every set command, as its connection string's `sslmode` says: subscribed, compared, its
/// sequences put in step; with `sslmode=disable` it refuses pgherd, and the error says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_takes_only_tls_is_reached_over_tls() {
    let env = env(0, |c| c.superuser().manage_nodes());
    let tables = "CREATE TABLE orders (id int PRIMARY KEY, item text); CREATE SEQUENCE order_ids";
    env.direct(tables);
    env.direct("INSERT INTO orders VALUES (1, 'a'), (2, 'b'); SELECT setval('order_ids', 42)");
    let (subscriber, _certs, probe) = tls_only_cluster();
    subscriber.sql(&format!("CREATE DATABASE {APP}"));
    subscriber.sql_on("pg1", APP, tables);
    let sub_port = subscriber.node("pg1").port;
    let to = |mode: &str| {
        format!(
            "host=127.0.0.1 port={sub_port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={APP} sslmode={mode}"
        )
    };
    let out = set(
        &env,
        &[
            "create",
            "shop",
            "--tables",
            "orders",
            "--sequences",
            "order_ids",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    refused(
        &set(&env, &["subscribe", "shop", "--to", &to("disable")]),
        "no encryption",
    );
    no_subscription_on(&env, &subscriber);
    let out = set(&env, &["subscribe", "shop", "--to", &to("require")]);
    assert!(out.status.success(), "{}", text(&out));
    assert_eq!(
        subscriber
            .sql_on(
                "pg1",
                APP,
                "SELECT count(*) || '/' || (SELECT last_value FROM order_ids) FROM orders"
            )
            .trim(),
        "2/42"
    );
    // The default, prefer, tries TLS first.
    let out = set(&env, &["sync-sequences", "shop", "--to", &to("prefer")]);
    assert!(out.status.success(), "{}", text(&out));
    let out = Command::new(BIN)
        .args([
            "check-consistency",
            "--database",
            APP,
            "--set",
            "shop",
            "--to",
        ])
        .arg(to("require"))
        .arg("--config")
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run check-consistency");
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("no difference"), "{said}");
    let _ = std::fs::remove_dir_all(&probe);
}

/// The origin's primary fails: pgherd promotes its standby, which has the set's catalog and
/// publication but not the subscriber's logical slot (PostgreSQL 15 keeps those on the primary
/// only). `set subscribe` refuses to call the dead origin's subscription done, and with
/// `--again` the subscriber copies the set anew from the new primary: every row is there,
/// writes after the failover stream, and the copies compare equal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_copies_the_set_again_after_the_origin_fails_over() {
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .section("[failover]\nenabled = true")
    });
    let tables = "CREATE TABLE orders (id int PRIMARY KEY, item text)";
    env.direct(tables);
    env.direct(&format!(
        "GRANT ALL ON orders TO {APP}; INSERT INTO orders SELECT g, 'before' FROM generate_series(1, 50) g"
    ));
    let subscriber = TestCluster::start(0);
    subscriber.sql(&format!("CREATE DATABASE {APP}"));
    subscriber.sql_on("pg1", APP, tables);
    let sub_port = subscriber.node("pg1").port;
    let to = format!(
        "host=127.0.0.1 port={sub_port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={APP}"
    );
    let out = set(&env, &["create", "shop", "--tables", "orders"]);
    assert!(out.status.success(), "{}", text(&out));
    let out = set(&env, &["subscribe", "shop", "--to", &to]);
    assert!(out.status.success(), "{}", text(&out));

    env.cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    // Writes resume through pgherd on the promoted standby.
    let started = Instant::now();
    loop {
        let written = async {
            let c = try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, APP)).await?;
            c.batch_execute("INSERT INTO orders VALUES (51, 'after')")
                .await
        };
        if written.await.is_ok() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "writes resumed through pgherd"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    refused(
        &set(&env, &["subscribe", "shop", "--to", &to]),
        "follows another node than the set's origin pg2",
    );
    let out = set(&env, &["subscribe", "shop", "--to", &to, "--again"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("copying them anew from pg2"), "{said}");
    let count = || {
        subscriber
            .sql_on("pg1", APP, "SELECT count(*) FROM orders")
            .trim()
            .to_owned()
    };
    assert_eq!(
        count(),
        "51",
        "every row, the one written after the failover too"
    );
    env.cluster
        .sql_on("pg2", APP, "INSERT INTO orders VALUES (52, 'streamed')");
    let started = Instant::now();
    while count() != "52" {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "writes on the new origin stream to the subscriber"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let out = Command::new(BIN)
        .args([
            "check-consistency",
            "--database",
            APP,
            "--set",
            "shop",
            "--to",
            &to,
        ])
        .arg("--config")
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run check-consistency");
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("no difference"), "{said}");
}

/// Several sets with different origins on the same nodes, as Slony-I sites ran them: two
/// clusters of one config (here the shards of a sharded config), each the origin of one set
/// and a subscriber of the other's. Each set's rows reach the other cluster, each copy refuses
/// local writes, and each origin lists its own set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sets_with_different_origins_follow_each_other() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = sharded_config(&shards, &[("accounts", "id")]);
    let pgherd = pgherd_testkit::Pgherd::start(BIN, &shards[0], &config);
    let db = "postgres";
    let tables = "CREATE TABLE a_items (id int PRIMARY KEY, v text); \
                  CREATE TABLE b_items (id int PRIMARY KEY, v text)";
    for cluster in &shards {
        cluster.sql_on("pg1", db, tables);
    }
    let conninfo = |cluster: &TestCluster| {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={db}",
            cluster.node("pg1").port
        )
    };
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .arg("set")
            .args(args)
            .args(["--database", db, "--config"])
            .arg(&pgherd.config_path)
            .output()
            .expect("run pgherd set");
        assert!(out.status.success(), "pgherd set {args:?}: {}", text(&out));
        text(&out)
    };
    // Set a from shard 0's primary (the default origin) to shard 1; set b the other way.
    run(&["create", "a", "--tables", "a_items"]);
    run(&["subscribe", "a", "--to", &conninfo(&shards[1])]);
    run(&["create", "b", "--tables", "b_items", "--origin", "shard1"]);
    run(&[
        "subscribe",
        "b",
        "--origin",
        "shard1",
        "--to",
        &conninfo(&shards[0]),
    ]);

    shards[0].sql_on("pg1", db, "INSERT INTO a_items VALUES (1, 'from a')");
    shards[1].sql_on("pg1", db, "INSERT INTO b_items VALUES (1, 'from b')");
    let started = Instant::now();
    loop {
        let on_1 = shards[1].sql_on("pg1", db, "SELECT count(*) FROM a_items");
        let on_0 = shards[0].sql_on("pg1", db, "SELECT count(*) FROM b_items");
        if on_1.trim() == "1" && on_0.trim() == "1" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "each set's rows reach the other cluster (a on shard 1: {on_1}, b on shard 0: {on_0})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = shards[0]
        .node("pg1")
        .psql(db, "INSERT INTO b_items VALUES (2, 'local')")
        .expect_err("a copy refuses local writes");
    assert!(
        refused.to_string().contains("whose origin is shard1"),
        "{refused}"
    );
    let listed_a = run(&["list"]);
    let listed_b = run(&["list", "--origin", "shard1"]);
    assert!(
        listed_a.contains("a") && !listed_a.contains("b_items"),
        "{listed_a}"
    );
    assert!(
        listed_b.contains("b_items") && !listed_b.contains("a_items"),
        "{listed_b}"
    );
}
