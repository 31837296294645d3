//! A node cut off the network (its link down: packets dropped, nothing refused, the server
//! still running) while a request waits on it, with no failover to end the session: the
//! client must hear back, not wait the quarter of an hour TCP takes to give up. The node runs
//! in a network namespace of its own (root and iproute2, as the drill's partition rounds).

mod common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::*;
use pgherd_cluster::network::Network;
use pgherd_cluster::LocalNode;
use pgherd_testkit::{ClusterOptions, Pgherd, TestCluster};

/// One node in a namespace of its own, and pgherd in front of it with failover off: nothing
/// fences the node, so nothing else ends a session waiting on it. The network comes first,
/// so it is removed after the cluster stopped.
fn lone_node_in_a_namespace() -> (Network, Env) {
    let network = Network::create("pgherd-test", 1).expect("a network namespace (root, iproute2)");
    let (_, address) = network.nodes()[0].clone();
    let cluster = TestCluster::start_with(ClusterOptions {
        replicas: 0,
        netns: network.nodes(),
        ..Default::default()
    });
    let env = env_on(cluster, |c| {
        c.node_line("pg1", &format!("host = \"{address}\""))
    });
    (network, env)
}

/// Cuts `node`'s link, waits up to a minute for `answer`, and brings the link back; panics
/// with pgherd's log if nothing came. A minute: the node must first fail its health checks
/// (three timeouts of 2 s here).
async fn answer_while_cut_off<T>(
    network: &Network,
    node: &LocalNode,
    pgherd: &Pgherd,
    answer: impl Future<Output = T>,
) -> T {
    network.set_link(node, false).expect("cut the link");
    let cut = Instant::now();
    let answer = tokio::time::timeout(Duration::from_secs(60), answer).await;
    network.set_link(node, true).expect("restore the link");
    answer.unwrap_or_else(|_| {
        panic!(
            "no answer {} s after {} was cut off\n{}",
            cut.elapsed().as_secs(),
            node.name,
            pgherd.log()
        )
    })
}

fn message(error: &tokio_postgres::Error) -> &str {
    error.as_db_error().map(|e| e.message()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_a_node_cut_off_the_network_is_answered() {
    let (network, env) = lone_node_in_a_namespace();
    let c = env.app().await;
    c.simple_query("SELECT 1")
        .await
        .expect("a query while the link is up");

    let node = env.cluster.node("pg1").clone();
    let error = answer_while_cut_off(&network, &node, &env.pgherd, c.simple_query("SELECT 2"))
        .await
        .expect_err("the node cannot have answered");
    assert_eq!(code(&error), "57P01", "{error:?}");
    assert!(
        message(&error).contains("node pg1 is down")
            && message(&error).contains("cut off from this host"),
        "{}",
        message(&error)
    );

    // The link is back: the node passes its checks again and a new session works.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let c = env.app().await;
        match c.simple_query("SELECT 3").await {
            Ok(_) => break,
            Err(e) if Instant::now() < deadline => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("the node is back but a query fails: {e}"),
        }
    }
}

/// The same for a sharded endpoint: a transaction's statement waiting on a shard whose only
/// node was cut off, while the other shard is fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_statement_on_a_shard_cut_off_the_network_is_answered() {
    let network = Network::create("pgherd-test", 1).expect("a network namespace (root, iproute2)");
    let shards = [
        shard_cluster(),
        TestCluster::start_with(ClusterOptions {
            replicas: 0,
            netns: network.nodes(),
            settings: vec![("max_prepared_transactions".into(), "20".into())],
            ..Default::default()
        }),
    ];
    let config = sharded_config(&shards, &[]).section(
        "[[sharding.tables]]\ntable = \"events\"\ncolumn = \"id\"\ntype = \"bigint\"\n\
         method = \"range\"\nstarts = [0, 1000]\n",
    );
    let pgherd = Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    client
        .batch_execute(
            "CREATE TABLE events (id bigint PRIMARY KEY, v int); \
             INSERT INTO events (id, v) VALUES (1, 1), (1000, 2)",
        )
        .await
        .expect("a table on both shards");
    // In a transaction, so the statement after the cut goes through the link already open.
    client
        .batch_execute("BEGIN; SELECT v FROM events WHERE id = 1000")
        .await
        .expect("a read on the second shard while its link is up");

    let node = shards[1].primary().clone();
    let statement = client.simple_query("SELECT v FROM events WHERE id = 1000");
    let error = answer_while_cut_off(&network, &node, &pgherd, statement)
        .await
        .expect_err("the shard cannot have answered");
    assert_eq!(code(&error), "57P01", "{error:?}");
    assert!(
        message(&error).contains("cut off from this host"),
        "{}",
        message(&error)
    );
    // The other shard was never in question.
    let other = connect_as_superuser(pgherd.port, "postgres").await;
    assert_eq!(
        first_value(&other, "SELECT v FROM events WHERE id = 1")
            .await
            .expect("shard 0"),
        "1"
    );
}

/// A statement the node had acknowledged before the cut (a long one) leaves nothing to
/// retransmit: while the node is down its connection is probed closely, and fails within
/// seconds rather than after TCP keepalive's usual two and a half minutes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_statement_on_a_node_cut_off_the_network_is_answered() {
    let (network, env) = lone_node_in_a_namespace();
    let c = env.app().await;
    let sleeping = tokio::spawn(async move { c.simple_query("SELECT pg_sleep(300)").await });
    // The statement reached the node and was acknowledged; then the link goes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let node = env.cluster.node("pg1").clone();
    let error = answer_while_cut_off(&network, &node, &env.pgherd, sleeping)
        .await
        .expect("the query's task")
        .expect_err("the node cannot have answered");
    assert_eq!(code(&error), "08006", "{error:?}");
    assert!(
        message(&error).contains("node pg1") && message(&error).contains("timed out"),
        "{}",
        message(&error)
    );
}
