//! `pgherd clone` against a real cluster: a replica cloned from a replica (cascading) streams
//! from it with the data already there, the running pgherd knows it and its upstream after the
//! reload, and through a failover of the top primary it keeps receiving writes and its
//! upstream (the tree is kept); an unknown source and a name already taken are refused with
//! nothing made.

mod common;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};

fn clone(env: &Env, args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("clone")
        .args(args)
        .arg("--config")
        .arg(&env.pgherd.config_path)
        .output()
        .expect("run pgherd clone")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cascaded_clone_streams_from_its_replica_and_follows_a_failover() {
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
    let port: u16 = said
        .split("on port ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {said}"));
    let data_dir = env.cluster.dir().join("pg4");
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

    // The top primary dies; writes resume through pgherd and reach the clone.
    env.cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    let started = Instant::now();
    loop {
        let written = async {
            let c = try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, APP)).await?;
            c.batch_execute("INSERT INTO t VALUES (2)").await
        };
        if written.await.is_ok() {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "writes resumed after the failover"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let started = Instant::now();
    while first_value(&pg4, "SELECT count(*) FROM t")
        .await
        .ok()
        .as_deref()
        != Some("2")
    {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the clone receives the new primary's writes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

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
}
