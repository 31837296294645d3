//! Each shard of a sharded endpoint is a cluster pgherd keeps: its synchronous standbys set,
//! its primary replaced when it dies. A shard primary killed in the middle of two-phase
//! commits (a participant after the decision, the decider after the prepares), under
//! concurrent writers: once recovery has run, every transaction is committed on all its
//! shards or on none, no prepared transaction is left behind, and no acknowledged commit is
//! lost.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{connect_as_superuser, shard_cluster_with, try_connect, BIN};
use pgherd_cluster::StopMode;
use pgherd_route::shard_hash::{shard_of_text, KeyType};
use pgherd_testkit::{Pgherd, TestCluster, SUPERUSER, SUPERUSER_PASSWORD};

const WRITERS: usize = 3;
/// How long a two-phase commit waits at the armed point: the primary is killed meanwhile.
const PAUSE_MS: u64 = 3_000;

/// What the writers learned of their transactions.
#[derive(Default)]
struct Outcomes {
    acknowledged: Vec<i32>,
    failed: Vec<(i32, String)>,
}

/// The first key from `t * 100` on `shard` (of two): each transaction's keys are its own.
fn key_on(t: i32, shard: u32) -> i32 {
    (t * 100..)
        .find(|k| shard_of_text(KeyType::Int4, &k.to_string(), 2) == Ok(shard))
        .unwrap()
}

/// One transaction writing a row on each shard; `Ok` only when its COMMIT was acknowledged.
async fn transfer(port: u16, t: i32) -> Result<(), String> {
    let conninfo = format!(
        "host=127.0.0.1 port={port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname=postgres connect_timeout=5"
    );
    let client = try_connect(&conninfo).await.map_err(|e| e.to_string())?;
    for sql in [
        "BEGIN".to_owned(),
        format!("INSERT INTO ledger (k, t) VALUES ({}, {t})", key_on(t, 0)),
        format!("INSERT INTO ledger (k, t) VALUES ({}, {t})", key_on(t, 1)),
        "COMMIT".to_owned(),
    ] {
        let answer = tokio::time::timeout(Duration::from_secs(60), client.simple_query(&sql))
            .await
            .map_err(|_| format!("{sql}: no answer in 60 s"))?;
        answer.map_err(|e| format!("{sql}: {e:?}"))?;
    }
    Ok(())
}

/// Writers that each run transactions over both shards until told to stop.
struct Writers {
    stop: Arc<AtomicBool>,
    outcomes: Arc<Mutex<Outcomes>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    fn start(port: u16) -> Writers {
        let stop = Arc::new(AtomicBool::new(false));
        let outcomes = Arc::new(Mutex::new(Outcomes::default()));
        let next = Arc::new(AtomicI32::new(1));
        let tasks = (0..WRITERS)
            .map(|_| {
                let (stop, outcomes, next) = (stop.clone(), outcomes.clone(), next.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Relaxed) {
                        let t = next.fetch_add(1, Ordering::Relaxed);
                        match transfer(port, t).await {
                            Ok(()) => outcomes.lock().unwrap().acknowledged.push(t),
                            Err(e) => {
                                outcomes.lock().unwrap().failed.push((t, e));
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                        }
                    }
                })
            })
            .collect();
        Writers {
            stop,
            outcomes,
            tasks,
        }
    }

    fn acknowledged(&self) -> usize {
        self.outcomes.lock().unwrap().acknowledged.len()
    }

    async fn finish(self) -> Outcomes {
        self.stop.store(true, Ordering::Relaxed);
        for task in self.tasks {
            task.await.expect("writer");
        }
        Arc::try_unwrap(self.outcomes)
            .ok()
            .expect("writers done")
            .into_inner()
            .unwrap()
    }
}

/// How often a commit reached the point `name`.
fn reached(pgherd: &Pgherd, name: &str) -> usize {
    pgherd
        .log()
        .lines()
        .filter(|line| line.contains("failpoint reached") && line.contains(name))
        .count()
}

async fn wait_for(what: &str, limit: Duration, done: impl FnMut() -> bool) {
    wait_while_writing(what, limit, None, done).await
}

/// [`wait_for`], saying what the writers saw last if it is not done in time.
async fn wait_while_writing(
    what: &str,
    limit: Duration,
    writers: Option<&Writers>,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + limit;
    while !done() {
        if Instant::now() >= deadline {
            let last = writers.map(|w| {
                let outcomes = w.outcomes.lock().unwrap();
                let failed = &outcomes.failed;
                (
                    outcomes.acknowledged.len(),
                    failed[failed.len().saturating_sub(5)..].to_vec(),
                )
            });
            panic!("{what}: not within {limit:?} (writers: acknowledged, last failures: {last:?})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `sql`'s answer on `node`, asked directly; asked again for up to 10 s while the node is
/// being restarted (pgherd rejoins a replaced primary: a session may be cut or refused then).
fn answer(cluster: &TestCluster, node: &str, sql: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match cluster.node(node).psql("postgres", sql) {
            Ok(answer) => return answer,
            Err(e) if Instant::now() < deadline => {
                eprintln!("{node} did not answer ({e}); asking again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return format!("error: {e}"),
        }
    }
}

/// Kills `node` of `cluster` (armed point reached by a commit) and waits for `successor` to
/// take writes through pgherd: promoted, and new transactions acknowledged.
async fn kill_mid_commit(
    pgherd: &Pgherd,
    writers: &Writers,
    cluster: &TestCluster,
    (node, successor): (&str, &str),
    (point, reached_before): (&str, usize),
) {
    wait_while_writing(
        &format!("a two-phase commit at {point}"),
        Duration::from_secs(30),
        Some(writers),
        || reached(pgherd, point) > reached_before,
    )
    .await;
    cluster
        .node(node)
        .stop(StopMode::Immediate)
        .unwrap_or_else(|e| panic!("kill {node}: {e}"));
    wait_while_writing(
        &format!("{successor} promoted by pgherd"),
        Duration::from_secs(60),
        Some(writers),
        || answer(cluster, successor, "SELECT pg_is_in_recovery()") == "f",
    )
    .await;
    let before = writers.acknowledged();
    wait_while_writing(
        &format!("commits acknowledged after {node} was replaced"),
        Duration::from_secs(60),
        Some(writers),
        || writers.acknowledged() >= before + 3,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_primary_killed_mid_commit_loses_no_acknowledged_commit() {
    let shards = [shard_cluster_with(1, ""), shard_cluster_with(1, "s1-")];
    let config =
        common::sharded_config(&shards, &[("ledger", "k")]).section("[failover]\nenabled = true");
    let mut pgherd = Pgherd::start(BIN, &shards[0], &config);
    let through = connect_as_superuser(pgherd.port, "postgres").await;
    through
        .simple_query("CREATE TABLE ledger (k int PRIMARY KEY, t int NOT NULL)")
        .await
        .expect("create ledger");
    drop(through);
    // Every shard's primary has its standby synchronous: a commit or a prepare it
    // acknowledges is on the standby too.
    for (cluster, primary, standby) in
        [(&shards[0], "pg1", "pg2"), (&shards[1], "s1-pg1", "s1-pg2")]
    {
        let want = format!("ANY 1 (\"{standby}\")");
        wait_for(
            &format!("{primary}'s synchronous standby set"),
            Duration::from_secs(30),
            || answer(cluster, primary, "SHOW synchronous_standby_names") == want,
        )
        .await;
    }

    // A participant's primary killed after the decision: the commit is acknowledged (its
    // part there unconfirmed), and its prepared part, on the promoted standby, is committed
    // by recovery.
    let point = "2pc-after-decision";
    pgherd.set_env("PGHERD_FAILPOINTS", Some(&format!("{point}@{PAUSE_MS}")));
    pgherd.restart();
    let writers = Writers::start(pgherd.port);
    let armed = (point, reached(&pgherd, point));
    kill_mid_commit(&pgherd, &writers, &shards[1], ("s1-pg1", "s1-pg2"), armed).await;

    // The decider's primary killed after the prepares: the decision is lost with it, the
    // client hears that the outcome is unknown, and recovery rolls the prepared parts back.
    // (Counted by the point's name: commits of the instance stopping may still reach the
    // other one.)
    let point = "2pc-after-prepare";
    pgherd.set_env("PGHERD_FAILPOINTS", Some(&format!("{point}@{PAUSE_MS}")));
    let armed = (point, reached(&pgherd, point));
    pgherd.restart();
    kill_mid_commit(&pgherd, &writers, &shards[0], ("pg1", "pg2"), armed).await;
    let outcomes = writers.finish().await;

    let primaries = [(&shards[0], "pg2"), (&shards[1], "s1-pg2")];
    wait_for(
        "recovery to finish every prepared transaction",
        Duration::from_secs(60),
        || {
            primaries.iter().all(|(cluster, node)| {
                answer(cluster, node, "SELECT count(*) FROM pg_prepared_xacts") == "0"
            })
        },
    )
    .await;
    // Each transaction's rows, shard by shard.
    let mut rows: BTreeMap<i32, [u32; 2]> = BTreeMap::new();
    for (shard, (cluster, node)) in primaries.iter().enumerate() {
        let listed = answer(cluster, node, "SELECT string_agg(t::text, ',') FROM ledger");
        for t in listed.split(',').filter(|t| !t.is_empty()) {
            let t: i32 = t.parse().unwrap_or_else(|_| panic!("{node}: {listed}"));
            rows.entry(t).or_default()[shard] += 1;
        }
    }
    let torn: Vec<(&i32, &[u32; 2])> = rows.iter().filter(|(_, r)| **r != [1, 1]).collect();
    assert!(torn.is_empty(), "transactions not on both shards: {torn:?}");
    let lost: Vec<&i32> = outcomes
        .acknowledged
        .iter()
        .filter(|t| !rows.contains_key(t))
        .collect();
    assert!(
        lost.is_empty(),
        "acknowledged commits lost: {lost:?} (failures: {:?})",
        outcomes.failed
    );
    assert!(
        outcomes.acknowledged.len() >= 6,
        "{} acknowledged",
        outcomes.acknowledged.len()
    );
    // The participant's part of a decided commit was committed on its promoted standby; the
    // decider's lost decision rolled the other part back; its client was told.
    let log = pgherd.log();
    for done in ["committed", "rolled back"] {
        let line = format!("recovered a prepared transaction: {done} as shard 0 decided");
        assert!(log.contains(&line), "no \"{line}\" in the log");
    }
    assert!(
        outcomes
            .failed
            .iter()
            .any(|(_, e)| e.starts_with("COMMIT") && e.contains("E08007")),
        "no commit answered 08007: {:?}",
        outcomes.failed
    );
    eprintln!(
        "{} transactions acknowledged, {} failed",
        outcomes.acknowledged.len(),
        outcomes.failed.len()
    );
}

/// A transaction that wrote on a shard whose primary is replaced (here by the operator's
/// forced `PROMOTE` of that shard's standby, while the old primary still answers) does not
/// commit there: it is rolled back on every shard, and neither copy of the shard keeps its
/// row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_on_a_replaced_shard_primary_commits_nowhere() {
    let shards = [common::shard_cluster(), shard_cluster_with(1, "s1-")];
    let config = common::sharded_config(&shards, &[("ledger", "k")])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let through = connect_as_superuser(pgherd.port, "postgres").await;
    through
        .simple_query("CREATE TABLE ledger (k int PRIMARY KEY, t int NOT NULL)")
        .await
        .expect("create ledger");
    wait_for(
        "s1-pg1's synchronous standby",
        Duration::from_secs(30),
        || answer(&shards[1], "s1-pg1", "SHOW synchronous_standby_names") == "ANY 1 (\"s1-pg2\")",
    )
    .await;
    for sql in [
        "BEGIN".to_owned(),
        format!("INSERT INTO ledger (k, t) VALUES ({}, 1)", key_on(1, 0)),
        format!("INSERT INTO ledger (k, t) VALUES ({}, 1)", key_on(1, 1)),
    ] {
        through.simple_query(&sql).await.expect(&sql);
    }

    // Another shard's node, promoted through the console, which fences s1-pg1.
    // (Asked again while pgherd's last look at s1-pg2 saw it replaying, the CREATE TABLE's WAL
    // for instance: the next health check sees it settled.)
    let admin = connect_as_superuser(pgherd.port, "pgherd").await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match admin
            .simple_query("PROMOTE s1-pg2 FORCE primary-answers, split-brain-guard")
            .await
        {
            Ok(_) => break,
            Err(e)
                if e.as_db_error()
                    .is_some_and(|d| d.message().contains("still replays"))
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("PROMOTE s1-pg2: {e:?}"),
        }
    }
    let refused = through
        .simple_query("COMMIT")
        .await
        .expect_err("the commit reaches a replaced primary");
    assert!(
        ["40000", "08006", "08007"].contains(&common::code(&refused).as_str()),
        "{refused:?}"
    );
    for (cluster, node) in [
        (&shards[0], "pg1"),
        (&shards[1], "s1-pg1"),
        (&shards[1], "s1-pg2"),
    ] {
        assert_eq!(
            answer(cluster, node, "SELECT count(*) FROM ledger"),
            "0",
            "{node} keeps a row of the transaction"
        );
        assert_eq!(
            answer(cluster, node, "SELECT count(*) FROM pg_prepared_xacts"),
            "0",
            "{node}"
        );
    }
    // The shard takes writes on its new primary.
    through
        .simple_query(&format!(
            "INSERT INTO ledger (k, t) VALUES ({}, 2)",
            key_on(2, 1)
        ))
        .await
        .expect("a write on the promoted standby");
    assert_eq!(
        answer(&shards[1], "s1-pg2", "SELECT count(*) FROM ledger"),
        "1"
    );
}
