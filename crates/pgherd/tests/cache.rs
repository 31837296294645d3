//! The result cache's invalidation stream against a real primary: commits made directly on
//! the primary (not through pgherd) drop the entries of the tables they changed; a commit
//! decoded before it is visible (a synchronous commit waiting for its standby) keeps its
//! tables from taking new entries until it is; a broken stream empties the cache.

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pgherd_cache::{Limits, Store, Stored};
use pgherd_config::ServerTlsMode;
use pgherd_proxy::cache_feed::{follow, DatabaseCache, FeedSettings};
use pgherd_proxy::server::{ConnectSpec, ServerCredentials};
use pgherd_testkit::{TestCluster, SUPERUSER, SUPERUSER_PASSWORD};

fn offer(cache: &DatabaseCache, key: &str, table: &str) -> Stored {
    let mut state = cache.state.lock();
    let ticket = state.store.ticket();
    let now_ms = cache.now_ms();
    state.store.insert(
        key.as_bytes(),
        Bytes::from(format!("answer of {key}")),
        &[table.to_owned()],
        ticket,
        now_ms,
    )
}

fn cached(cache: &DatabaseCache, key: &str) -> bool {
    let now_ms = cache.now_ms();
    cache
        .state
        .lock()
        .store
        .get(key.as_bytes(), now_ms)
        .is_some()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn signal_walreceiver(node: &str, signal: &str) {
    let out = Command::new("pgrep")
        .args(["-f", &format!("postgres: {node}: walreceiver")])
        .output()
        .expect("pgrep");
    let pids = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!pids.trim().is_empty(), "no walreceiver of {node}");
    for pid in pids.split_whitespace() {
        let status = Command::new("kill")
            .args([signal, pid])
            .status()
            .expect("kill");
        assert!(status.success());
    }
}

#[test]
fn commits_on_the_primary_drop_entries_and_hold_their_tables_until_visible() {
    let cluster = TestCluster::start(1);
    cluster.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v int); CREATE TABLE u (id int); \
         CREATE TABLE nokey (v int); INSERT INTO t VALUES (1, 0)",
    );
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let cache = Arc::new(DatabaseCache::new(
        "postgres",
        Store::new(Limits {
            max_bytes: 1 << 20,
            max_entry_bytes: 1 << 16,
            ttl_ms: 0,
        }),
    ));
    let primary = cluster.primary().clone();
    let follower = cache.clone();
    let stream = runtime.spawn(async move {
        let credentials = ServerCredentials {
            password: Some(SUPERUSER_PASSWORD.to_owned()),
            ..Default::default()
        };
        let spec = ConnectSpec {
            node: &primary.name,
            host: &primary.host,
            port: primary.port,
            user: SUPERUSER,
            database: "postgres",
            credentials: &credentials,
            tls_mode: ServerTlsMode::Disable,
            tls: None,
            timeout: Duration::from_secs(10),
            replication: false,
            socket_dir: None,
        };
        follow(
            &follower,
            &spec,
            "pgherd_cache_test",
            FeedSettings::default(),
        )
        .await
    });
    wait_for("the stream is live", Duration::from_secs(30), || {
        cache.state.lock().feed.is_live()
    });

    // A commit made directly on the primary drops the entries of the table it changed, and
    // only those; once it is visible the table takes entries again.
    assert_eq!(offer(&cache, "t1", "t"), Stored::Stored);
    assert_eq!(offer(&cache, "u1", "u"), Stored::Stored);
    cluster.sql("UPDATE t SET v = 1 WHERE id = 1");
    wait_for("the update is decoded", Duration::from_secs(10), || {
        !cached(&cache, "t1")
    });
    assert!(cached(&cache, "u1"), "u did not change");
    wait_for("t takes entries again", Duration::from_secs(10), || {
        offer(&cache, "t2", "t") == Stored::Stored
    });
    // TRUNCATE is decoded too; a table without a primary key still takes updates (no
    // publication is involved).
    cluster.sql("TRUNCATE u; UPDATE nokey SET v = 2");
    wait_for("the truncate is decoded", Duration::from_secs(10), || {
        !cached(&cache, "u1")
    });

    // A synchronous commit is decoded once flushed, before other sessions see it: its table
    // takes no entry until it is visible.
    cluster.sql("ALTER SYSTEM SET synchronous_standby_names = 'pg2'");
    cluster.sql("SELECT pg_reload_conf()");
    wait_for("pg2 is synchronous", Duration::from_secs(30), || {
        cluster.sql("SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'") == "1"
    });
    assert_eq!(offer(&cache, "t3", "t"), Stored::Stored);
    signal_walreceiver("pg2", "-STOP");
    // Resumed however the block below ends, so a failure does not leave the writer waiting.
    struct Resume;
    impl Drop for Resume {
        fn drop(&mut self) {
            signal_walreceiver("pg2", "-CONT");
        }
    }
    std::thread::scope(|scope| {
        let _resume = Resume;
        let writer = scope.spawn(|| cluster.sql("UPDATE t SET v = 2 WHERE id = 1"));
        wait_for(
            "the waiting commit is decoded",
            Duration::from_secs(10),
            || !cached(&cache, "t3"),
        );
        for _ in 0..5 {
            assert_eq!(
                cluster.sql("SELECT v FROM t WHERE id = 1"),
                "1",
                "the commit is not visible yet"
            );
            assert_eq!(offer(&cache, "t4", "t"), Stored::Raced);
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            offer(&cache, "u2", "u"),
            Stored::Stored,
            "other tables are not held"
        );
        drop(_resume);
        writer.join().unwrap();
    });
    wait_for(
        "t takes entries once the commit is visible",
        Duration::from_secs(10),
        || offer(&cache, "t5", "t") == Stored::Stored,
    );
    assert_eq!(cluster.sql("SELECT v FROM t WHERE id = 1"), "2");

    // A broken stream empties the cache and stops it.
    cluster.sql(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE backend_type = 'walsender' AND datname = 'postgres'",
    );
    let ended =
        runtime.block_on(async { tokio::time::timeout(Duration::from_secs(10), stream).await });
    assert!(ended.is_ok(), "the stream did not end");
    assert!(!cache.state.lock().feed.is_live());
    assert!(!cached(&cache, "t5") && !cached(&cache, "u2"));
    // Its temporary slot went with it.
    wait_for(
        "the temporary slot is gone",
        Duration::from_secs(10),
        || {
            cluster.sql("SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'")
                == "0"
        },
    );
}
