//! `pgherd shard move`: a shard of a running sharded endpoint goes to another cluster while
//! clients write through pgherd. Its schema is made there, its rows copied and compared, and
//! at the cut-over new transactions wait at pgherd for a moment: no client transaction fails,
//! every acknowledged write is on the shard's new node, pgherd routes the shard there (and its
//! config says so), and the old copy refuses writes.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{connect_as_superuser, shard_cluster, shard_cluster_with, BIN};
use pgherd_route::shard_hash::{shard_of_text, KeyType};
use pgherd_testkit::{Pgherd, SUPERUSER, SUPERUSER_PASSWORD};

const DB: &str = "postgres";
const ROWS: i32 = 400;

/// What the writers had acknowledged, and what failed.
#[derive(Default)]
struct Acknowledged {
    increments: BTreeMap<i32, i64>,
    inserted: Vec<i32>,
    failures: Vec<String>,
}

fn start_writers(
    port: u16,
    stop: &Arc<AtomicBool>,
    seen: &Arc<Mutex<Acknowledged>>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..3)
        .map(|w: i32| {
            let (stop, seen) = (stop.clone(), seen.clone());
            tokio::spawn(async move {
                let client = connect_as_superuser(port, DB).await;
                let mut n = 0;
                while !stop.load(Ordering::Relaxed) {
                    n += 1;
                    let id = (w * 131 + n * 7) % ROWS + 1;
                    let fresh = 10_000 + w * 100_000 + n;
                    let sql = match n % 5 {
                        0 => format!("INSERT INTO accounts (id, balance) VALUES ({fresh}, 0)"),
                        _ => format!("UPDATE accounts SET balance = balance + 1 WHERE id = {id}"),
                    };
                    let outcome = client.batch_execute(&sql).await;
                    {
                        let mut seen = seen.lock().unwrap();
                        match outcome {
                            Ok(()) if n % 5 == 0 => seen.inserted.push(fresh),
                            Ok(()) => *seen.increments.entry(id).or_default() += 1,
                            Err(e) => seen.failures.push(format!("{sql}: {e:?}")),
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            })
        })
        .collect()
}

/// Lets the writers write on for a moment, stops them and checks no write failed; the rows
/// (id, balance) their acknowledged writes leave.
async fn stop_writers(
    (stop, writers): (&Arc<AtomicBool>, Vec<tokio::task::JoinHandle<()>>),
    seen: &Arc<Mutex<Acknowledged>>,
) -> BTreeMap<i32, i64> {
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await.expect("a writer");
    }
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    assert!(
        seen.failures.is_empty(),
        "client errors: {:?}",
        seen.failures
    );
    assert!(!seen.inserted.is_empty() && !seen.increments.is_empty());
    let mut expected: BTreeMap<i32, i64> = (1..=ROWS).map(|id| (id, 0)).collect();
    for (id, n) in &seen.increments {
        *expected.entry(*id).or_default() += n;
    }
    for id in &seen.inserted {
        expected.insert(*id, 0);
    }
    expected
}

fn rows_of(answer: &[tokio_postgres::SimpleQueryMessage]) -> BTreeMap<i32, i64> {
    answer
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((r.get(0)?.parse().ok()?, r.get(1)?.parse().ok()?))
            }
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_moves_to_another_cluster_while_clients_write() {
    let shards = [shard_cluster(), shard_cluster()];
    let target = shard_cluster_with(0, "t-");
    let config = common::sharded_config(&shards, &[("accounts", "id")])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, DB).await;
    client
        .batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
             CREATE TABLE regions (id int PRIMARY KEY, name text NOT NULL); \
             CREATE TABLE audit (note text)",
        )
        .await
        .expect("tables made on both shards");
    client
        .batch_execute(&format!(
            "INSERT INTO accounts (id, balance) VALUES {}; \
             INSERT INTO regions (id, name) VALUES (1, 'north'), (2, 'south'); \
             INSERT INTO audit (note) VALUES ('made'), ('loaded')",
            (1..=ROWS)
                .map(|id| format!("({id}, 0)"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .await
        .expect("rows written");

    // A two-phase decision shard 1 recorded as a decider (a participant elsewhere may still
    // ask for it): it must be on the new node after the move.
    let decided = "pgherd_1_00000000000000ab_7_4242";
    shards[1].sql_on("pg1", DB, pgherd_route::two_phase::DECISIONS_DDL);
    shards[1].sql_on(
        "pg1",
        DB,
        &format!("INSERT INTO pgherd.decisions (gid, committed) VALUES ('{decided}', true)"),
    );

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Acknowledged::default()));
    let writers = start_writers(pgherd.port, &stop, &seen);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let target_port = target.node("t-pg1").port;
    let conninfo = format!(
        "host=127.0.0.1 port={target_port} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={DB}"
    );
    let config_path = pgherd.config_path.clone();
    let moved = tokio::task::spawn_blocking(move || {
        std::process::Command::new(BIN)
            .args(["shard", "move", "1", "--to", &conninfo, "--name", "s1-new"])
            .args(["--database", DB, "--config"])
            .arg(&config_path)
            .output()
            .expect("run pgherd shard move")
    })
    .await
    .expect("the move ran");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&moved.stdout),
        String::from_utf8_lossy(&moved.stderr)
    );
    assert!(moved.status.success(), "the move: {said}\n{}", pgherd.log());
    assert!(said.contains("shard 1 moved to s1-new"), "{said}");
    assert!(
        said.contains("public.audit has no primary key: published with REPLICA IDENTITY FULL"),
        "{said}"
    );
    eprintln!("{said}");
    // Writes go on after the cut-over, now to the new node.
    let expected = stop_writers((&stop, writers), &seen).await;

    // Every acknowledged write, through pgherd (which now reads shard 1 on the new node).
    let through = rows_of(
        &client
            .simple_query("SELECT id, balance FROM accounts")
            .await
            .expect("read through pgherd"),
    );
    if through != expected {
        let differing: Vec<String> = expected
            .iter()
            .filter(|(id, balance)| through.get(id) != Some(balance))
            .map(|(id, balance)| {
                let shard = shard_of_text(KeyType::Int4, &id.to_string(), 2).unwrap();
                let old = shards[1].sql_on(
                    "pg1",
                    DB,
                    &format!("SELECT balance FROM accounts WHERE id = {id}"),
                );
                format!(
                    "{id} (shard {shard}): acknowledged {balance}, read {:?}, old copy {old:?}",
                    through.get(id)
                )
            })
            .collect();
        panic!(
            "rows differ from what was acknowledged:\n{}\n{}",
            differing.join("\n"),
            pgherd.log()
        );
    }
    // Shard 1's rows are on the new node, directly; the table every shard holds came too.
    let on_target = rows_of(
        &connect_as_superuser(target_port, DB)
            .await
            .simple_query("SELECT id, balance FROM accounts")
            .await
            .expect("read the new node"),
    );
    let of_shard_1: BTreeMap<i32, i64> = expected
        .iter()
        .filter(|(id, _)| shard_of_text(KeyType::Int4, &id.to_string(), 2) == Ok(1))
        .map(|(id, balance)| (*id, *balance))
        .collect();
    assert_eq!(on_target, of_shard_1, "shard 1's rows on the new node");
    assert_eq!(
        target.sql_on(
            "t-pg1",
            DB,
            "SELECT string_agg(name, ',' ORDER BY id) FROM regions"
        ),
        "north,south"
    );
    assert_eq!(
        target.sql_on(
            "t-pg1",
            DB,
            &format!("SELECT committed FROM pgherd.decisions WHERE gid = '{decided}'")
        ),
        "t",
        "the shard's two-phase decisions moved with it"
    );
    // A table without a key moved too, and takes writes of every kind on the new node.
    client
        .batch_execute("UPDATE audit SET note = 'moved' WHERE note = 'made'; DELETE FROM audit WHERE note = 'loaded'")
        .await
        .expect("the keyless table takes updates and deletes through pgherd");
    assert_eq!(
        target.sql_on("t-pg1", DB, "SELECT string_agg(note, ',') FROM audit"),
        "moved"
    );
    // The old copy refuses writes, naming where they go now.
    let old = shards[1]
        .node("pg1")
        .psql(DB, "UPDATE accounts SET balance = 0");
    let refused = old.expect_err("the old copy refuses writes").to_string();
    assert!(refused.contains("s1-new"), "{refused}");
    let config_text = std::fs::read_to_string(&pgherd.config_path).expect("the config");
    assert!(
        config_text.contains("\"s1-new\"") && !config_text.contains("\"shard1\""),
        "{config_text}"
    );
}

/// The cut-over's PAUSE on a sharded endpoint: a transaction queued for a shard's server
/// connection before PAUSE came (the pool was full) does not start once PAUSE has said none
/// runs; it waits for RESUME. Otherwise it would start on the old copy just as `shard move`
/// refuses writes there, and fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_request_queued_before_pause_waits_for_resume() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = common::sharded_config(&shards, &[("accounts", "id")])
        .max_size(1)
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let holder = connect_as_superuser(pgherd.port, DB).await;
    holder
        .batch_execute("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)")
        .await
        .expect("the table on both shards");
    // Every shard's only server connection is taken by one transaction.
    holder
        .batch_execute("BEGIN; SELECT count(*) FROM accounts")
        .await
        .expect("a transaction on every shard");
    let queued = {
        let client = connect_as_superuser(pgherd.port, DB).await;
        tokio::spawn(async move { client.simple_query("SELECT count(*) FROM accounts").await })
    };
    let admin = connect_as_superuser(pgherd.port, "pgherd").await;
    common::pause_with_a_queued_request(admin, "PAUSE", &holder, &queued).await;
    let admin = connect_as_superuser(pgherd.port, "pgherd").await;
    admin.simple_query("RESUME").await.expect("RESUME");
    queued
        .await
        .unwrap()
        .expect("the queued request runs after RESUME");
}

/// A range-sharded endpoint gains a shard on RELOAD while clients stay connected: refused
/// unless PAUSE holds every session; under PAUSE (the rows the new map places elsewhere moved
/// meanwhile) the new layout is in force, and a session connected before plans by it from its
/// next transaction: a key of the new range is read from and written to the new shard, and a
/// fan-out reaches all three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_layout_gains_a_shard_on_reload() {
    let shards = [shard_cluster(), shard_cluster(), shard_cluster()];
    let node = |k: usize| {
        format!(
            "[[nodes]]\nname = \"shard{k}\"\nport = {}\nshard = {k}\n",
            shards[k].node("pg1").port
        )
    };
    let sharding = "[sharding]\n[[sharding.tables]]\ntable = \"accounts\"\ncolumn = \"id\"\n\
                    type = \"integer\"\nmethod = \"range\"\nstarts = [0, 1000]\n";
    let config = pgherd_testkit::PgherdConfig::new()
        .superuser()
        .section(sharding)
        .section(&node(1))
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, DB).await;
    client
        .batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
             INSERT INTO accounts (id, balance) VALUES (1, 0), (1500, 0), (2500, 0)",
        )
        .await
        .expect("rows on shards 0 and 1");
    shards[2].sql_on(
        "pg1",
        DB,
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
    );
    let before = connect_as_superuser(pgherd.port, DB).await;
    before
        .simple_query("SELECT count(*) FROM accounts")
        .await
        .expect("a session that ran under the old layout");
    let admin = connect_as_superuser(pgherd.port, "pgherd").await;

    // The new layout: keys from 2000 on shard 2.
    let text = std::fs::read_to_string(&pgherd.config_path).expect("the config");
    let grown = text.replace("starts = [0, 1000]", "starts = [0, 1000, 2000]") + "\n" + &node(2);
    std::fs::write(&pgherd.config_path, grown).expect("write the config");
    let refused = admin
        .simple_query("RELOAD")
        .await
        .expect_err("a layout change while sessions run");
    let refused = refused
        .as_db_error()
        .map_or_else(|| refused.to_string(), |e| e.message().to_owned());
    assert!(
        refused.contains("changes only while pgherd holds every session"),
        "{refused}"
    );

    admin.simple_query("PAUSE").await.expect("PAUSE");
    // The row the new map places on shard 2 goes there while nothing runs.
    shards[2].sql_on("pg1", DB, "INSERT INTO accounts VALUES (2500, 0)");
    shards[1].sql_on("pg1", DB, "DELETE FROM accounts WHERE id = 2500");
    admin
        .simple_query("RELOAD")
        .await
        .expect("RELOAD under PAUSE");
    admin.simple_query("RESUME").await.expect("RESUME");

    let one = |rows: Vec<tokio_postgres::SimpleQueryMessage>| {
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap_or_default()
    };
    assert_eq!(
        one(before
            .simple_query("SELECT balance FROM accounts WHERE id = 2500")
            .await
            .expect("a key of the new range, read by a session from before")),
        "0"
    );
    before
        .batch_execute("INSERT INTO accounts (id, balance) VALUES (2600, 7); UPDATE accounts SET balance = 1 WHERE id = 2500")
        .await
        .expect("writes to the new range");
    assert_eq!(
        shards[2].sql_on(
            "pg1",
            DB,
            "SELECT string_agg(id || ':' || balance, ',' ORDER BY id) FROM accounts"
        ),
        "2500:1,2600:7",
        "the new range's rows are on shard 2"
    );
    assert_eq!(
        one(before
            .simple_query("SELECT count(*) FROM accounts")
            .await
            .expect("a fan-out over three shards")),
        "4"
    );
    let shown = admin
        .simple_query("SHOW SHARDS")
        .await
        .expect("SHOW SHARDS");
    assert!(
        shown.iter().any(
            |m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some("2"))
        ),
        "SHOW SHARDS lists shard 2"
    );
}

/// `pgherd shard split`: the last shard of a range layout splits at a key while clients write
/// through pgherd. Its rows below the key go to one new cluster (which keeps its number), the
/// rest to another (a new shard), each checked; no client transaction fails, every
/// acknowledged write is read back once through pgherd (a fan-out counts no row twice), each
/// new node holds exactly its keys and the reference table, the config has the new layout and
/// the old copy refuses writes. A split the layout cannot take is refused first, with nothing
/// made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_range_shard_splits_while_clients_write() {
    let shards = [shard_cluster(), shard_cluster()];
    let (lower, upper) = (shard_cluster_with(0, "lo-"), shard_cluster_with(0, "hi-"));
    // Orders are split by a column outside their key (REPLICA IDENTITY FULL for the copy)
    // and take ids from a sequence; tags are listed by region and stay whole on shard 1.
    let sharding = "[sharding]\n[[sharding.tables]]\ntable = \"accounts\"\ncolumn = \"id\"\n\
                    type = \"integer\"\nmethod = \"range\"\nstarts = [0, 100]\n\
                    [[sharding.tables]]\ntable = \"orders\"\ncolumn = \"account\"\n\
                    type = \"integer\"\nmethod = \"range\"\nstarts = [0, 100]\n\
                    [[sharding.tables]]\ntable = \"tags\"\ncolumn = \"region\"\n\
                    type = \"integer\"\nmethod = \"list\"\nvalues = [[\"1\"], [\"2\"]]\n";
    let config = pgherd_testkit::PgherdConfig::new()
        .superuser()
        .section(sharding)
        .section(&format!(
            "[[nodes]]\nname = \"shard1\"\nport = {}\nshard = 1\n",
            shards[1].node("pg1").port
        ))
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, DB).await;
    client
        .batch_execute(
            "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL); \
             CREATE TABLE regions (id int PRIMARY KEY, name text NOT NULL); \
             CREATE TABLE orders (id serial PRIMARY KEY, account int NOT NULL); \
             CREATE TABLE tags (id int PRIMARY KEY, region int NOT NULL)",
        )
        .await
        .expect("tables on both shards");
    client
        .batch_execute(&format!(
            "INSERT INTO accounts (id, balance) VALUES {}; \
             INSERT INTO regions (id, name) VALUES (1, 'north'), (2, 'south'); \
             INSERT INTO orders (account) VALUES (120), (220), (320), (320); \
             INSERT INTO tags (id, region) VALUES (1, 1), (2, 2), (3, 2)",
            (1..=ROWS)
                .map(|id| format!("({id}, 0)"))
                .collect::<Vec<_>>()
                .join(", ")
        ))
        .await
        .expect("rows on both shards");
    let conninfo = |cluster: &pgherd_testkit::TestCluster, node: &str| {
        format!(
            "host=127.0.0.1 port={} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname={DB}",
            cluster.node(node).port
        )
    };
    let (to_lower, to_upper) = (conninfo(&lower, "lo-pg1"), conninfo(&upper, "hi-pg1"));
    let split = |args: Vec<String>| {
        let config_path = pgherd.config_path.clone();
        tokio::task::spawn_blocking(move || {
            let out = std::process::Command::new(BIN)
                .args(["shard", "split"])
                .args(&args)
                .args(["--database", DB, "--config"])
                .arg(&config_path)
                .output()
                .expect("run pgherd shard split");
            let said = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.success(), said)
        })
    };
    let sides = |at: &str| {
        [
            at,
            "--lower",
            &to_lower,
            "--lower-name",
            "s1-lo",
            "--upper",
            &to_upper,
            "--upper-name",
            "s2",
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let mut refused = sides("50");
    refused.insert(0, "0".into());
    refused.insert(1, "--at".into());
    let (ok, said) = split(refused).await.expect("the refused split ran");
    assert!(
        !ok && said.contains("only the last shard (1) can split"),
        "{said}"
    );
    assert_eq!(
        lower.sql_on(
            "lo-pg1",
            DB,
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'"
        ),
        "0",
        "a refused split makes nothing"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let seen = Arc::new(Mutex::new(Acknowledged::default()));
    let writers = start_writers(pgherd.port, &stop, &seen);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut args = sides("250");
    args.insert(0, "1".into());
    args.insert(1, "--at".into());
    let (ok, said) = split(args).await.expect("the split ran");
    assert!(ok, "the split: {said}\n{}", pgherd.log());
    assert!(
        said.contains("shard 1 split at accounts.id = 250, orders.account = 250: shard 1 is s1-lo"),
        "{said}"
    );
    eprintln!("{said}");
    let expected = stop_writers((&stop, writers), &seen).await;

    let through = client
        .simple_query("SELECT id, balance FROM accounts")
        .await
        .expect("read through pgherd");
    let read_rows = through
        .iter()
        .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
        .count();
    assert_eq!(read_rows, expected.len(), "a fan-out reads each row once");
    assert_eq!(rows_of(&through), expected, "every acknowledged write");
    let on = |cluster: &pgherd_testkit::TestCluster, node: &str, sql: &str| {
        cluster.sql_on(node, DB, sql)
    };
    let keys = "SELECT min(id) || '-' || max(id) || ':' || count(*) FROM accounts";
    let in_range = |lo: i32, hi: i32| {
        let ids: Vec<&i32> = expected
            .keys()
            .filter(|id| (lo..hi).contains(*id))
            .collect();
        format!("{}-{}:{}", ids[0], ids[ids.len() - 1], ids.len())
    };
    assert_eq!(on(&lower, "lo-pg1", keys), in_range(100, 250));
    assert_eq!(on(&upper, "hi-pg1", keys), in_range(250, i32::MAX));
    for (cluster, node) in [(&lower, "lo-pg1"), (&upper, "hi-pg1")] {
        assert_eq!(
            on(
                cluster,
                node,
                "SELECT string_agg(name, ',' ORDER BY id) FROM regions"
            ),
            "north,south",
            "the reference table on {node}"
        );
    }
    let old = shards[1]
        .node("pg1")
        .psql(DB, "UPDATE accounts SET balance = 0");
    let refused = old.expect_err("the old copy refuses writes").to_string();
    assert!(refused.contains("s1-lo"), "{refused}");
    let config_text = std::fs::read_to_string(&pgherd.config_path).expect("the config");
    assert!(
        said.contains("public.orders is split by a column outside its primary key"),
        "{said}"
    );
    let counted = |cluster: &pgherd_testkit::TestCluster, node: &str, table: &str| {
        on(cluster, node, &format!("SELECT count(*) FROM {table}"))
    };
    assert_eq!(counted(&lower, "lo-pg1", "orders WHERE account < 250"), "2");
    assert_eq!(counted(&lower, "lo-pg1", "orders"), "2");
    assert_eq!(counted(&upper, "hi-pg1", "orders"), "2");
    assert_eq!(
        counted(&lower, "lo-pg1", "tags"),
        "2",
        "a list table stays whole"
    );
    assert_eq!(counted(&upper, "hi-pg1", "tags"), "0");
    // The new shard's sequence was put where shard 1's was: a new order there takes a new id.
    client
        .batch_execute("INSERT INTO orders (account) VALUES (330)")
        .await
        .expect("an order on the new shard");
    assert_eq!(
        on(
            &upper,
            "hi-pg1",
            "SELECT string_agg(id::text, ',' ORDER BY id) FROM orders"
        ),
        "3,4,5"
    );
    assert!(
        config_text.contains("starts = [0, 100, 250]")
            && config_text.contains("values = [[\"1\"], [\"2\"], []]")
            && config_text.contains("\"s1-lo\"")
            && config_text.contains("\"s2\"")
            && !config_text.contains("\"shard1\""),
        "{config_text}"
    );
    // A write to each side lands where the new layout places it.
    client
        .batch_execute("UPDATE accounts SET balance = -1 WHERE id IN (101, 301)")
        .await
        .expect("writes to both sides");
    assert_eq!(
        on(
            &lower,
            "lo-pg1",
            "SELECT balance FROM accounts WHERE id = 101"
        ),
        "-1"
    );
    assert_eq!(
        on(
            &upper,
            "hi-pg1",
            "SELECT balance FROM accounts WHERE id = 301"
        ),
        "-1"
    );
}
