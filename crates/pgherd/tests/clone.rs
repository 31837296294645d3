//! `pgherd clone` against a real cluster: a replica cloned from a replica (cascading) streams
//! from it with the data already there, the running pgherd knows it and its upstream after the
//! reload, and through a switchover and then a failover of the top primary it keeps receiving
//! writes and its upstream (the tree is kept: only the replicas of the replaced primary
//! follow the new one); an unknown source and a name already taken are refused with nothing
//! made.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};

/// `pgherd COMMAND ARGS --config <the test's config>`.
fn pgherd(env: &Env, command: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg(command)
        .args(args)
        .arg("--config")
        .arg(&env.pgherd.config_path)
        .output()
        .unwrap_or_else(|e| panic!("run pgherd {command}: {e}"))
}

fn clone(env: &Env, args: &[&str]) -> Output {
    pgherd(env, "clone", args)
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The clone's port, as `pgherd clone` says it ("... on port N; ...").
fn port_in(said: &str) -> u16 {
    said.split("on port ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {said}"))
}

/// Stops the cloned node when the test ends (the cluster's own stop does not know it).
struct Clone(pgherd_cluster::LocalNode);

impl Drop for Clone {
    fn drop(&mut self) {
        let _ = self.0.stop(pgherd_cluster::StopMode::Immediate);
    }
}

/// The node `node` streams from, as `SHOW NODES` says.
async fn upstream_of(console: &tokio_postgres::Client, node: &str) -> Option<String> {
    console
        .simple_query("SHOW NODES")
        .await
        .unwrap()
        .into_iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some(node) => {
                r.get("upstream").map(str::to_owned)
            }
            _ => None,
        })
}

/// Inserts `id` into `t` through pgherd, retrying while a failover goes on.
async fn app_writes(env: &Env, id: u32) {
    let started = Instant::now();
    loop {
        let written = async {
            let c = try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, APP)).await?;
            c.batch_execute(&format!("INSERT INTO t VALUES ({id})"))
                .await
        };
        if written.await.is_ok() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "writes resumed through pgherd"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits for the clone to hold `rows` rows of `t`.
async fn clone_has(clone: &tokio_postgres::Client, rows: u32) {
    let started = Instant::now();
    while first_value(clone, "SELECT count(*) FROM t").await.ok() != Some(rows.to_string()) {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the clone receives the primary's writes ({rows} rows)"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascaded_clone_streams_from_its_replica_and_keeps_it_through_switchover_and_failover() {
    let env = env(2, |c| {
        c.superuser()
            .manage_nodes()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section("[failover]\nenabled = true")
    });
    let app = env.app().await;
    app.batch_execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
        .await
        .unwrap();

    let out = clone(&env, &["pg4", "--from", "pg2"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("pg4 streams from pg2 (cascading from a replica)"),
        "{said}"
    );
    let port = port_in(&said);
    let data_dir = said
        .split("data directory ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .map(|line| std::path::PathBuf::from(line.trim()))
        .unwrap_or_else(|| panic!("no data directory in {said}"));
    assert!(data_dir.join("PG_VERSION").is_file(), "{said}");
    let _clone = Clone(
        pgherd_cluster::LocalNode::managed("pg4", ("127.0.0.1", port), None, &data_dir, SUPERUSER)
            .unwrap(),
    );
    assert!(
        env.cluster
            .sql_on(
                "pg2",
                "postgres",
                "SELECT application_name FROM pg_stat_replication"
            )
            .contains("pg4"),
        "pg2 serves pg4's stream"
    );
    let config = std::fs::read_to_string(&env.pgherd.config_path).unwrap();
    assert!(config.contains("name = \"pg4\""), "{config}");
    let pg4 = connect(&format!(
        "host=127.0.0.1 port={port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={APP}"
    ))
    .await;
    assert_eq!(
        first_value(&pg4, "SELECT count(*) FROM t").await.unwrap(),
        "1"
    );
    assert_eq!(
        first_value(&pg4, "SELECT pg_is_in_recovery()::text")
            .await
            .unwrap(),
        "true"
    );
    // The running pgherd reloaded, knows the new node and where it streams from.
    let console = connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    let started = Instant::now();
    loop {
        let upstream = upstream_of(&console, "pg4").await;
        if upstream.as_deref() == Some("pg2") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "pgherd lists pg4 streaming from pg2: {upstream:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A switchover to pg3: pg2, which streamed from pg1, follows pg3; pg4 keeps pg2, and
    // pg1 restarts as pg3's standby.
    let steps = console
        .simple_query("SWITCHOVER TO pg3")
        .await
        .unwrap_or_else(|e| panic!("switchover: {e}\n{}", env.pgherd.log()));
    let steps: Vec<String> = steps
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                (0..r.len())
                    .filter_map(|i| r.get(i))
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            _ => None,
        })
        .collect();
    let steps = steps.join("\n");
    assert!(steps.contains("pg2 follows pg3"), "{steps}");
    let started = Instant::now();
    loop {
        let tree = (
            upstream_of(&console, "pg1").await,
            upstream_of(&console, "pg2").await,
            upstream_of(&console, "pg4").await,
        );
        let pg3 = Some("pg3".to_owned());
        if tree == (pg3.clone(), pg3, Some("pg2".to_owned())) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "after the switchover pg1 and pg2 stream from pg3, pg4 from pg2: {tree:?}\n{steps}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        !steps.contains("pg4 follows"),
        "pg4 was not re-pointed: {steps}"
    );
    app_writes(&env, 2).await;
    clone_has(&pg4, 2).await;

    // The new primary dies; writes resume through pgherd and reach the clone.
    env.cluster
        .node("pg3")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg3");
    app_writes(&env, 3).await;
    clone_has(&pg4, 3).await;

    // The tree is kept: pg4 was not re-pointed (pg2 was promoted, or was re-pointed itself).
    let started = Instant::now();
    while upstream_of(&console, "pg4").await.as_deref() != Some("pg2") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "pg4 still streams from pg2: {:?}",
            upstream_of(&console, "pg4").await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Refusals, with nothing made.
    let out = clone(&env, &["pg5", "--from", "nope"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no node \"nope\""), "{}", text(&out));
    let out = clone(&env, &["pg4", "--from", "pg3"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("has a node named pg4 already"),
        "{}",
        text(&out)
    );
    assert!(!env.cluster.dir().join("pg5").exists());

    // Removal: pg2 has pg4 streaming from it (or is the primary now), so it stays; pg4 goes
    // (stopped, its slot on pg2 dropped, its entry out of the config) while pgherd runs.
    let out = pgherd(&env, "remove", &["pg2"]);
    let said = text(&out);
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("pg2 is not removed: pg4 streams from it")
            || said.contains("pg2 is not removed: it is the primary"),
        "{said}"
    );
    let out = pgherd(&env, "remove", &["pg4"]);
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("pg4 is removed from the cluster; its replication slot is dropped on pg2"),
        "{said}"
    );
    assert!(!_clone.0.is_running(), "pg4 was stopped: {said}");
    assert!(data_dir.exists(), "its data directory is kept");
    let config = std::fs::read_to_string(&env.pgherd.config_path).unwrap();
    assert!(!config.contains("name = \"pg4\""), "{config}");
    let slots = env.cluster.sql_on(
        "pg2",
        "postgres",
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE '%pg4%'",
    );
    assert_eq!(slots.trim(), "0", "pg4's slot on pg2 is dropped");
    let listed = |rows: Vec<tokio_postgres::SimpleQueryMessage>| {
        rows.into_iter().any(
            |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("pg4")),
        )
    };
    assert!(
        !listed(console.simple_query("SHOW NODES").await.unwrap()),
        "the running pgherd no longer lists pg4"
    );
    app_writes(&env, 4).await;
    let out = pgherd(&env, "remove", &["pg4"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("no node \"pg4\""), "{}", text(&out));
}

/// A node of another shard's cluster is cloned into that shard: its `[[nodes]]` entry says
/// `shard = 1`, the running pgherd lists it among shard 1's nodes after the reload, and it
/// streams shard 1's rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_node_is_cloned_into_its_shard() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = sharded_config(&shards, &[("accounts", "id")])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = pgherd_testkit::Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .batch_execute(&format!(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
             INSERT INTO accounts (id, balance) VALUES {}",
            (1..=40)
                .map(|id| format!("({id}, 0)"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .await
        .expect("rows on both shards");
    let shard1 = shards[1].node("pg1");
    let data_dir = shard1
        .data_dir
        .parent()
        .expect("the node's directory")
        .join("s1b");
    let out = Command::new(BIN)
        .args(["clone", "s1b", "--from", "shard1", "--data-dir"])
        .arg(&data_dir)
        .arg("--config")
        .arg(&pgherd.config_path)
        .output()
        .expect("run pgherd clone");
    let said = text(&out);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("s1b streams from shard1 (from the primary)"),
        "{said}"
    );
    let port = port_in(&said);
    let _clone = Clone(
        pgherd_cluster::LocalNode::managed("s1b", ("127.0.0.1", port), None, &data_dir, SUPERUSER)
            .unwrap(),
    );
    let config_text = std::fs::read_to_string(&pgherd.config_path).expect("the config");
    let entry = config_text
        .split("[[nodes]]")
        .find(|e| e.contains("name = \"s1b\""))
        .unwrap_or_else(|| panic!("no entry for s1b: {config_text}"));
    assert!(entry.contains("shard = 1"), "{entry}");

    let admin = connect_as_superuser(pgherd.port, "pgherd").await;
    let started = Instant::now();
    loop {
        let listed = admin
            .simple_query("SHOW SHARDS")
            .await
            .expect("SHOW SHARDS")
            .iter()
            .any(|m| {
                matches!(m, tokio_postgres::SimpleQueryMessage::Row(r)
                    if r.get(0) == Some("1") && r.get(1) == Some("s1b"))
            });
        if listed {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "pgherd lists s1b among shard 1's nodes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let on_shard1 = shards[1].sql_on("pg1", "postgres", "SELECT count(*) FROM accounts");
    let copy = connect_as_superuser(port, "postgres").await;
    assert_eq!(
        first_value(&copy, "SELECT count(*) FROM accounts")
            .await
            .expect("read the clone"),
        on_shard1.trim(),
        "the clone holds shard 1's rows"
    );
}
