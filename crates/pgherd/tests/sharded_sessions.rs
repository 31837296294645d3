//! A sharded endpoint's sessions as an unsharded cluster's behave: a shard with replicas serves
//! reads outside transaction blocks from them, each read seeing the session's own last
//! committed write on its shard (read-your-writes), a read a replica refuses for lack of a
//! table it has not replayed yet runs on the primary, and writes and transaction blocks stay
//! on the primaries; SIGTERM lets an open transaction finish before the session ends; a client
//! idle past `client_idle_timeout_ms` is closed; a query string of several statements answers
//! as one node answers it (an implicit transaction over the shards, up to the first error); a
//! cancel ends a statement still waiting for its connections, and one sent while idle is for
//! nothing.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{code, connect_as_superuser, psql_with_input, shard_cluster, try_connect, BIN};
use pgherd_route::shard_hash::{shard_of_text, KeyType};
use pgherd_testkit::{Pgherd, TestCluster, SUPERUSER, SUPERUSER_PASSWORD};
use tokio_postgres::{Client, SimpleQueryMessage};

/// The first row of `sql`'s answer, as text.
async fn row(client: &Client, sql: &str) -> Vec<String> {
    let answer = client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    answer
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or("NULL").to_owned())
                    .collect(),
            ),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{sql}: no row"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_reads_run_on_replicas_and_see_the_sessions_own_writes() {
    // Replicas replay 300 ms late: a read that ran on one before it replayed the session's
    // write would miss it.
    let lagging = |node_prefix: &str| {
        TestCluster::start_with(pgherd_testkit::ClusterOptions {
            replicas: 1,
            settings: vec![
                ("max_prepared_transactions".into(), "20".into()),
                ("recovery_min_apply_delay".into(), "300ms".into()),
            ],
            node_prefix: node_prefix.to_owned(),
            ..Default::default()
        })
    };
    let shards = [lagging(""), lagging("s1-")];
    let config = common::sharded_config(&shards, &[("items", "k")]);
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .simple_query("CREATE TABLE items (k int PRIMARY KEY, v int NOT NULL)")
        .await
        .expect("create items");
    let primaries = [shards[0].node("pg1").port, shards[1].node("s1-pg1").port];
    let replicas = [shards[0].node("pg2").port, shards[1].node("s1-pg2").port];
    let port_of = |sql_port: &str| -> u16 { sql_port.parse().expect("a port") };

    // Until pgherd has seen each replica healthy, reads go to the primaries.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen = row(&client, "SELECT inet_server_port()").await;
        if replicas.contains(&port_of(&seen[0])) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no read reached a replica in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Each key-routed read, and the count over every shard, right after the session's own
    // write: never older than that write, wherever it ran.
    let mut reads_by_port: BTreeMap<u16, usize> = BTreeMap::new();
    for k in 0..120 {
        client
            .simple_query(&format!("INSERT INTO items (k, v) VALUES ({k}, {k})"))
            .await
            .unwrap_or_else(|e| panic!("insert {k}: {e:?}"));
        let read = row(
            &client,
            &format!("SELECT v, inet_server_port() FROM items WHERE k = {k}"),
        )
        .await;
        assert_eq!(read[0], k.to_string(), "key {k} read without its write");
        *reads_by_port.entry(port_of(&read[1])).or_default() += 1;
        let counted = row(&client, "SELECT count(*) FROM items").await;
        assert_eq!(counted[0], (k + 1).to_string(), "count after key {k}");
    }
    // A transaction block's writes, read after its commit.
    for k in 0..20 {
        for sql in [
            "BEGIN".to_owned(),
            format!("UPDATE items SET v = v + 1000 WHERE k = {k}"),
            "COMMIT".to_owned(),
        ] {
            client
                .simple_query(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
        }
        let read = row(
            &client,
            &format!("SELECT v, inet_server_port() FROM items WHERE k = {k}"),
        )
        .await;
        assert_eq!(
            read[0],
            (k + 1000).to_string(),
            "key {k} read without its update"
        );
        *reads_by_port.entry(port_of(&read[1])).or_default() += 1;
    }
    // Once replayed, the rows are read from the replicas.
    tokio::time::sleep(Duration::from_millis(600)).await;
    for k in 0..40 {
        let read = row(
            &client,
            &format!("SELECT inet_server_port() FROM items WHERE k = {k}"),
        )
        .await;
        *reads_by_port.entry(port_of(&read[0])).or_default() += 1;
    }
    for (shard, replica) in replicas.iter().enumerate() {
        assert!(
            reads_by_port.get(replica).copied().unwrap_or(0) > 0,
            "no read of shard {shard} ran on its replica: {reads_by_port:?}"
        );
    }
    // A table another session made a moment ago, which the replicas have not replayed yet:
    // the read a replica refuses (42P01) runs on the primary instead.
    let other = connect_as_superuser(pgherd.port, "postgres").await;
    for round in 0..5 {
        other
            .simple_query(&format!("CREATE TABLE fresh{round} (n int)"))
            .await
            .unwrap_or_else(|e| panic!("create fresh{round}: {e:?}"));
        let read = row(&client, &format!("SELECT count(*) FROM fresh{round}")).await;
        assert_eq!(read[0], "0", "fresh{round}");
    }
    // A transaction block stays on the primaries, its reads included.
    client.simple_query("BEGIN").await.expect("begin");
    let in_block = row(&client, "SELECT inet_server_port() FROM items WHERE k = 1").await;
    client.simple_query("COMMIT").await.expect("commit");
    let block_port = port_of(&in_block[0]);
    assert!(
        primaries.contains(&block_port),
        "read in a block ran on {block_port}"
    );
    // SET pgherd.route = primary keeps the session's reads on the primaries.
    client
        .simple_query("SET pgherd.route = 'primary'")
        .await
        .expect("set pgherd.route");
    for k in 0..10 {
        let read = row(
            &client,
            &format!("SELECT inet_server_port() FROM items WHERE k = {k}"),
        )
        .await;
        assert!(
            primaries.contains(&port_of(&read[0])),
            "read of key {k} with pgherd.route = primary ran on {}",
            read[0]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_sharded_transaction_finish_and_idle_clients_time_out() {
    let shards = [shard_cluster(), shard_cluster()];
    let config =
        common::sharded_config(&shards, &[("drained", "k")]).proxy("client_idle_timeout_ms = 1500");
    let mut pgherd = Pgherd::start(BIN, &shards[0], &config);
    let conninfo = pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "postgres");

    // Idle past the timeout: closed, with the reason; a busy client is not.
    let idle = connect_as_superuser(pgherd.port, "postgres").await;
    let busy = connect_as_superuser(pgherd.port, "postgres").await;
    busy.simple_query("CREATE TABLE drained (k int PRIMARY KEY)")
        .await
        .expect("create drained");
    for k in 0..6 {
        busy.simple_query(&format!("INSERT INTO drained (k) VALUES ({k})"))
            .await
            .expect("insert while the other idles");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let closed = idle
        .simple_query("SELECT 1")
        .await
        .expect_err("idle client closed");
    assert!(closed.is_closed(), "idle client: {closed:?}");
    assert!(
        pgherd.log().contains("client idle timeout"),
        "the log says why the idle client was closed"
    );

    // SIGTERM with a transaction open over both shards: it may finish, then the session ends.
    busy.simple_query("BEGIN").await.expect("begin");
    busy.simple_query("INSERT INTO drained (k) VALUES (100), (101)")
        .await
        .expect("insert in the transaction");
    pgherd.signal(libc::SIGTERM);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        try_connect(&conninfo).await.is_err(),
        "new client accepted while draining"
    );
    busy.simple_query("INSERT INTO drained (k) VALUES (102), (103)")
        .await
        .expect("the open transaction goes on");
    busy.simple_query("COMMIT")
        .await
        .expect("the open transaction commits");
    let status = pgherd
        .wait_exit(Duration::from_secs(10))
        .expect("pgherd did not exit after SIGTERM");
    assert!(status.success(), "{status}");
    let committed: usize = shards
        .iter()
        .map(|s| {
            s.node("pg1")
                .psql("postgres", "SELECT count(*) FROM drained WHERE k >= 100")
                .expect("count")
                .parse::<usize>()
                .expect("a count")
        })
        .sum();
    assert_eq!(committed, 4, "the drained transaction's rows");
}

/// What a query string answered, comparable between two servers: each statement's rows and
/// command tag's count, or the SQLSTATE it failed with; then whether the session was left in
/// a transaction (and an aborted one).
async fn outcome(client: &Client, sql: &str) -> String {
    let answered = match client.simple_query(sql).await {
        Ok(messages) => messages
            .iter()
            .map(|m| match m {
                SimpleQueryMessage::Row(r) => (0..r.len())
                    .map(|i| r.get(i).unwrap_or("NULL"))
                    .collect::<Vec<_>>()
                    .join(","),
                SimpleQueryMessage::CommandComplete(n) => format!("complete {n}"),
                _ => "other".to_owned(),
            })
            .collect::<Vec<_>>()
            .join("; "),
        Err(e) => format!("error {}", code(&e)),
    };
    let after = match client.simple_query("SELECT count(*) FROM items").await {
        Ok(_) => "then idle or in a transaction",
        Err(e) if code(&e) == "25P02" => "then in an aborted transaction",
        Err(_) => "then an error",
    };
    format!("{answered} / {after}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_statements_in_one_query_string_answer_as_one_node_answers_them() {
    let shards = [shard_cluster(), shard_cluster()];
    shards[0].sql("CREATE DATABASE whole");
    let config = common::sharded_config(&shards, &[("items", "k")]);
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let sharded = connect_as_superuser(pgherd.port, "postgres").await;
    let whole = connect_as_superuser(shards[0].node("pg1").port, "whole").await;
    let on = |shard: u32, from: i32| {
        (from..)
            .find(|k| shard_of_text(KeyType::Int4, &k.to_string(), 2) == Ok(shard))
            .expect("a key")
    };
    // Keys on shard 0 (a...) and on shard 1 (b...).
    let [a0, a1, a2, a3] = [on(0, 1), on(0, 100), on(0, 200), on(0, 300)];
    let [b0, b1, b2, b3, b4] = [on(1, 1), on(1, 100), on(1, 200), on(1, 300), on(1, 400)];
    // For the savepoints: more on shard 0 (c...) and on shard 1 (d...).
    let [c0, c1, c2, c3] = [on(0, 500), on(0, 600), on(0, 700), on(0, 800)];
    let [d0, d1, d2, d3] = [on(1, 500), on(1, 600), on(1, 700), on(1, 800)];
    let insert = |k: i32| format!("INSERT INTO items (k, v) VALUES ({k}, 1)");
    let scripts = [
        "CREATE TABLE items (k int PRIMARY KEY, v int NOT NULL); CREATE TABLE kinds (id int PRIMARY KEY)".to_owned(),
        format!("{}; {}; SELECT count(*) FROM items", insert(a0), insert(b0)),
        // An error undoes the statements before it on every shard.
        format!("{}; {}; SELECT 1/0", insert(a1), insert(b1)),
        format!("{}; INSERT INTO kinds (id) VALUES (1); {}", insert(b1), insert(a0)),
        // A block of the client's own stays open, aborted, until it ends it.
        format!("BEGIN; {}; SELECT 1/0; COMMIT", insert(b2)),
        "ROLLBACK".to_owned(),
        // What a COMMIT ended stays; a ROLLBACK undoes the implicit transaction before it.
        format!("{}; COMMIT; {}", insert(a2), insert(b0)),
        format!("{}; ROLLBACK; SELECT count(*) FROM items", insert(b2)),
        format!("SELECT 1; BEGIN; {}", insert(b3)),
        "COMMIT".to_owned(),
        // Settings last as the transaction they were made in.
        "SET work_mem = '7MB'; SHOW work_mem".to_owned(),
        "SHOW work_mem".to_owned(),
        "SET work_mem = '9MB'; SELECT 1/0".to_owned(),
        "SHOW work_mem".to_owned(),
        format!(
            "UPDATE items SET v = v + 1; SELECT sum(v) FROM items; DELETE FROM items WHERE k = {a3}; SELECT count(*) FROM items"
        ),
        "VACUUM items; SELECT 1".to_owned(),
        // Savepoints: a shard the block reaches after one is set sets it too, so rolling
        // back to it undoes there what was done since, and no more.
        "BEGIN".to_owned(),
        insert(c0),
        "SAVEPOINT s1".to_owned(),
        insert(d0),
        "SELECT count(*) FROM items".to_owned(),
        "ROLLBACK TO SAVEPOINT s1".to_owned(),
        "SELECT count(*) FROM items".to_owned(),
        "SAVEPOINT s2; SET work_mem = '5MB'; SHOW work_mem".to_owned(),
        "ROLLBACK TO s2; SHOW work_mem".to_owned(),
        // An error, then a rollback to a savepoint: the block runs on.
        insert(c0),
        "SELECT 1".to_owned(),
        "ROLLBACK TO s1".to_owned(),
        insert(d0),
        "SAVEPOINT s1".to_owned(),
        insert(d1),
        "RELEASE s1".to_owned(),
        "ROLLBACK TO s1".to_owned(),
        "SELECT 1".to_owned(),
        "ROLLBACK TO s1".to_owned(),
        "SELECT count(*) FROM items".to_owned(),
        "RELEASE s1; SELECT count(*) FROM items".to_owned(),
        "ROLLBACK TO nowhere".to_owned(),
        "ROLLBACK".to_owned(),
        "SAVEPOINT outside".to_owned(),
        "RELEASE outside".to_owned(),
        format!("{}; SAVEPOINT implicit", insert(c1)),
        format!(
            "BEGIN; SAVEPOINT \"Mixed Case\"; {}; {}; RELEASE SAVEPOINT \"Mixed Case\"; COMMIT",
            insert(c1),
            insert(d1)
        ),
        format!(
            "BEGIN; SAVEPOINT a; SET work_mem = '6MB'; {}; SAVEPOINT a; {}; ROLLBACK TO a; ROLLBACK TO a; COMMIT; SHOW work_mem",
            insert(c2),
            insert(d2)
        ),
        // READ ONLY set after a savepoint ends with a rollback to it: the writes after it
        // commit on both shards.
        format!(
            "BEGIN; SAVEPOINT r; SET TRANSACTION READ ONLY; ROLLBACK TO r; {}; {}; COMMIT",
            insert(c3),
            insert(d3)
        ),
        // A comment is no option of BEGIN's, even after a statement began the block.
        "SELECT count(*) FROM items; BEGIN /* no options */ WORK; SELECT 2".to_owned(),
        "COMMIT".to_owned(),
        "SELECT k, v FROM items ORDER BY k; SELECT id FROM kinds ORDER BY id;".to_owned(),
    ];
    let mut differences = Vec::new();
    for script in &scripts {
        let (through, direct) = (
            outcome(&sharded, script).await,
            outcome(&whole, script).await,
        );
        if through != direct {
            differences.push(format!(
                "{script}\n  through pgherd: {through}\n  one node:       {direct}"
            ));
        }
    }
    assert!(differences.is_empty(), "{}", differences.join("\n"));
    // Nothing was left prepared on a shard, and every shard holds only its own keys.
    for (i, shard) in shards.iter().enumerate() {
        assert_eq!(shard.sql("SELECT count(*) FROM pg_prepared_xacts"), "0");
        let keys = shard.sql("SELECT string_agg(k::text, ',' ORDER BY k) FROM items");
        for key in keys.split(',').filter(|k| !k.is_empty()) {
            let key: i32 = key.parse().expect("a key");
            assert_eq!(
                shard_of_text(KeyType::Int4, &key.to_string(), 2),
                Ok(i as u32)
            );
        }
    }
    // BEGIN's options could no longer reach the shards an implicit block began on.
    let refused = sharded
        .simple_query("SELECT 1; BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT 2")
        .await
        .expect_err("options after a statement");
    assert_eq!(code(&refused), "0A000", "{refused:?}");
    // One Parse of several statements is refused as PostgreSQL refuses it.
    let refused = sharded
        .prepare("SELECT 1; SELECT 2")
        .await
        .expect_err("several statements in one Parse");
    assert_eq!(code(&refused), "42601", "{refused:?}");
    // COPY among other statements reads its rows from the client in between (psql).
    let url = pgherd.url(SUPERUSER, SUPERUSER_PASSWORD, "postgres");
    let copied = psql_with_input(
        &url,
        "SELECT 41 + 1; COPY items (k, v) FROM STDIN; SELECT count(*) FROM items",
        &format!("{a3}\t5\n{b4}\t5\n"),
    )
    .unwrap_or_else(|e| panic!("COPY among statements: {e}"));
    let total = row(&sharded, "SELECT count(*) FROM items").await;
    assert!(
        copied.starts_with("42\n")
            && copied.contains("COPY 2")
            && copied.lines().any(|l| l.trim() == total[0]),
        "{copied}"
    );
    // The command tag names the command the client sent, whatever comment comes first.
    let tags = psql_with_input(&url, "/* c */ START TRANSACTION; COMMIT", "")
        .unwrap_or_else(|e| panic!("START TRANSACTION: {e}"));
    assert_eq!(tags, "START TRANSACTION\nCOMMIT");
}

/// A statement's waiting for its server connections (here a pool of one, held by another
/// session's transaction) ends at once when its client cancels it; a cancel sent while the
/// session is idle is for nothing and does not end its next statement's wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_ends_a_sharded_statement_waiting_for_its_connections() {
    let shards = [shard_cluster(), shard_cluster()];
    let mut config = common::sharded_config(&shards, &[("waits", "k")]).max_size(1);
    config.wait_timeout_ms = 20_000;
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let holder = connect_as_superuser(pgherd.port, "postgres").await;
    holder
        .simple_query("CREATE TABLE waits (k int PRIMARY KEY)")
        .await
        .expect("create waits");
    let waiter = connect_as_superuser(pgherd.port, "postgres").await;
    waiter
        .simple_query("SELECT count(*) FROM waits")
        .await
        .expect("a read while nothing holds the pools");

    // The holder's transaction keeps both shards' only connections.
    holder
        .simple_query("BEGIN; SELECT count(*) FROM waits")
        .await
        .expect("hold the pools");
    let token = waiter.cancel_token();
    let started = Instant::now();
    let waiting = tokio::spawn(async move {
        let answer = waiter.simple_query("SELECT count(*) FROM waits").await;
        (waiter, answer)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    token
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("send the cancel");
    let (waiter, answer) = waiting.await.expect("the waiting statement");
    let error = answer.expect_err("the cancel ends the wait");
    assert_eq!(code(&error), "57014", "{error:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "ended by the cancel, not by the pool's 20 s wait: {:?}",
        started.elapsed()
    );

    // Idle, a cancel is for nothing: the next statement waits for the holder, then runs.
    token
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("send a cancel while idle");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = tokio::spawn(async move { waiter.simple_query("SELECT count(*) FROM waits").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    holder.simple_query("COMMIT").await.expect("commit");
    let next = next.await.expect("the next statement");
    assert!(
        next.is_ok(),
        "a cancel sent while idle ended the next statement: {next:?}"
    );
}

/// An operator's KILL ends a sharded session whose statement is still running on a shard,
/// at once, not when the statement ends (as it ends a pooled session's), and the statement
/// with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_ends_a_sharded_statement_still_running() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = common::sharded_config(&shards, &[("events", "id")])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .batch_execute(
            "CREATE TABLE events (id int PRIMARY KEY, v int); \
             INSERT INTO events (id, v) VALUES (1, 1)",
        )
        .await
        .expect("a sharded table");
    let started = Instant::now();
    let sleeper = tokio::spawn(async move {
        client
            .simple_query("SELECT pg_sleep(30), v FROM events WHERE id = 1")
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let admin = connect_as_superuser(pgherd.port, "pgherd").await;
    admin.simple_query("KILL postgres").await.expect("KILL");
    let ended = tokio::time::timeout(Duration::from_secs(20), sleeper)
        .await
        .expect("the session still ran its statement 20 s after the KILL")
        .expect("the sleeper's task");
    let error = ended.expect_err("killed before its statement ended");
    assert_eq!(code(&error), "57P01", "{error:?}");
    assert!(started.elapsed() < Duration::from_secs(25));
    // The shard's backend stops too: a closed connection alone would leave it sleeping (and
    // holding its locks and its connection slot) until its statement ended.
    let asleep = "SELECT count(*) FROM pg_stat_activity \
                  WHERE query LIKE '%pg_sleep(30)%' AND state = 'active' AND pid <> pg_backend_pid()";
    let deadline = Instant::now() + Duration::from_secs(10);
    while shards.iter().any(|shard| shard.sql(asleep) != "0") {
        assert!(
            Instant::now() < deadline,
            "a shard still ran the killed statement 10 s after the KILL"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
