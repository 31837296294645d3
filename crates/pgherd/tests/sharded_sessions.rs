//! A sharded endpoint's sessions as an unsharded cluster's behave: a shard with replicas serves
//! reads outside transaction blocks from them, each read seeing the session's own last
//! committed write on its shard (read-your-writes), a read a replica refuses for lack of a
//! table it has not replayed yet runs on the primary, and writes and transaction blocks stay
//! on the primaries; SIGTERM lets an open transaction finish before the session ends; a client
//! idle past `client_idle_timeout_ms` is closed.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{connect_as_superuser, shard_cluster, try_connect, BIN};
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
