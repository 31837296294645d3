//! Read/write splitting against real clusters: writes never reach a replica, reads spread by
//! weight, read-your-writes against a replica that replays late, a replica killed mid-workload,
//! hints and settings, and session state that pins a client to its server.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::*;

/// Waits until every one of `replicas` serves reads by SHOW NODES (in the read set, within the
/// default lag limits), and returns the last SHOW NODES. `wait_for_replica_reads` is not
/// enough where the test counts per replica: on a loaded machine a replica whose first health
/// check failed must pass several in a row before it joins the read set, which can come after
/// the other replica already serves.
async fn wait_for_readers(env: &Env, replicas: &[&str]) -> String {
    const DEFAULT_MAX_LAG_MS: u64 = 5_000;
    const DEFAULT_MAX_LAG_BYTES: u64 = 16 << 20;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let nodes = admin_rows(env, "SHOW NODES");
        // name|host|port|zone|standby|role|state|takes_writes|write_gate|lsn|timeline|
        // lag_bytes|lag_ms|in_read_set|...
        let reading = |name: &str| {
            nodes.lines().any(|row| {
                let field: Vec<&str> = row.split('|').collect();
                let number = |i: usize| field.get(i).and_then(|v| v.parse::<u64>().ok());
                field.first() == Some(&name)
                    && field.get(13) == Some(&"yes")
                    && number(11).is_some_and(|b| b <= DEFAULT_MAX_LAG_BYTES)
                    && number(12).is_some_and(|ms| ms <= DEFAULT_MAX_LAG_MS)
            })
        };
        if replicas.iter().all(|r| reading(r)) {
            return nodes;
        }
        assert!(
            Instant::now() < deadline,
            "not every one of {replicas:?} came to serve reads:\n{nodes}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Makes replica `pg2` replay `delay` late and creates table `t (id int PRIMARY KEY)` for the
/// app, replayed everywhere before the test goes on.
fn late_replica_and_table(env: &Env, delay: &str) {
    env.cluster
        .node("pg2")
        .write_auto_settings(&[("recovery_min_apply_delay".into(), format!("'{delay}'"))])
        .unwrap();
    env.cluster
        .sql_on("pg2", "postgres", "SELECT pg_reload_conf()");
    env.direct("CREATE TABLE t (id int PRIMARY KEY); GRANT ALL ON t TO app");
    env.cluster.wait_replayed();
}

fn admin_rows(env: &Env, command: &str) -> String {
    psql(
        &env.pgherd
            .url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd"),
        &["-c", command],
    )
    .unwrap_or_else(|e| panic!("{command}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_go_to_the_primary_and_reads_to_replicas_under_a_mixed_workload() {
    let env = env(2, |c| {
        c.superuser()
            .max_size(10)
            .proxy("admin_users = [\"postgres\"]")
    });
    let primary = env.cluster.primary().port;
    pgbench(&env.app_url(), &["-i", "-s", "2", "-q"]).expect("pgbench -i through pgherd");
    env.direct("CREATE SEQUENCE s; CREATE TABLE log (id int)");
    env.direct(
        "CREATE FUNCTION bump() RETURNS int VOLATILE LANGUAGE sql AS 'INSERT INTO log VALUES (1) RETURNING 1'",
    );
    env.direct("GRANT ALL ON ALL TABLES IN SCHEMA public TO app; GRANT ALL ON SEQUENCE s TO app");
    env.cluster.wait_replayed();
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;

    // Statements a replica would refuse, each answered without error through pgherd.
    for sql in [
        "SELECT nextval('s')",
        "SELECT bump()",
        "SELECT aid FROM pgbench_accounts WHERE aid = 1 FOR UPDATE",
        "WITH x AS (UPDATE pgbench_branches SET bbalance = bbalance WHERE bid = 1 RETURNING 1) SELECT count(*) FROM x",
        "CREATE TABLE made_here (a int)",
        "SELECT setval('s', 10)",
    ] {
        first_value(&c, sql)
            .await
            .unwrap_or_else(|e| panic!("{sql} failed through pgherd: {e}"));
    }
    assert_eq!(
        served_by(&c, "BEGIN; SELECT current_setting('port'); COMMIT").await,
        primary,
        "a transaction that may write runs on the primary"
    );
    // A session without writes of its own, so read-your-writes does not hold it back.
    let reader = env.app().await;
    reader.simple_query("BEGIN READ ONLY").await.unwrap();
    assert_ne!(
        served_by(&reader, WHERE).await,
        primary,
        "BEGIN READ ONLY runs on a replica"
    );
    reader.simple_query("COMMIT").await.unwrap();

    // TPC-B writers and select-only readers at once: no write may reach a replica.
    let url = env.app_url();
    let writers = {
        let url = url.clone();
        std::thread::spawn(move || pgbench(&url, &["-c", "4", "-j", "2", "-T", "6", "-n"]))
    };
    let readers = pgbench(&url, &["-S", "-c", "12", "-j", "2", "-T", "6", "-n"]);
    let writers = writers.join().expect("writer thread");
    let writers = writers.unwrap_or_else(|e| panic!("TPC-B through pgherd failed: {e}"));
    let readers = readers.unwrap_or_else(|e| panic!("select-only through pgherd failed: {e}"));
    for out in [&writers, &readers] {
        assert!(
            !out.contains("read-only transaction"),
            "a write reached a replica:\n{out}"
        );
        assert!(out.contains("number of failed transactions: 0"), "{out}");
    }
    // The replicas did serve reads: pgherd's own pool counters per node say so.
    let pools = admin_rows(&env, "SHOW POOLS");
    let replica_pools: Vec<&str> = pools
        .lines()
        .filter(|l| l.contains("|pg2|") || l.contains("|pg3|"))
        .collect();
    assert!(!replica_pools.is_empty(), "no pool on a replica:\n{pools}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_spread_by_weight() {
    let env = env(2, |c| {
        c.database("app", "balance = \"weighted\"")
            .node_weight("pg1", 0)
            .node_weight("pg2", 1)
            .node_weight("pg3", 3)
            .superuser()
            .proxy("admin_users = [\"postgres\"]")
    });
    let primary = env.cluster.primary().port;
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;
    let port = |name: &str| env.cluster.node(name).port;
    // A replica that misses a health check on a loaded machine leaves the read set for a
    // moment and the other takes its share meanwhile: as it should, but not what this test
    // measures. A batch disturbed so is measured again, at most twice; a wrong spread fails
    // every batch.
    for attempt in 1..=3 {
        wait_for_readers(&env, &["pg2", "pg3"]).await;
        let mut counts: HashMap<u16, u32> = HashMap::new();
        for _ in 0..400 {
            *counts.entry(served_by(&c, WHERE).await).or_default() += 1;
        }
        let (light, heavy) = (
            counts.get(&port("pg2")).copied().unwrap_or(0),
            counts.get(&port("pg3")).copied().unwrap_or(0),
        );
        assert_eq!(
            counts.get(&primary),
            None,
            "weight 0 keeps reads off the primary: {counts:?}"
        );
        // 1:3 within 10 percentage points of the reads.
        if (60..=140).contains(&light) && (260..=340).contains(&heavy) {
            return;
        }
        let nodes = admin_rows(&env, "SHOW NODES");
        assert!(
            attempt < 3,
            "expected about 100 and 300 reads, got pg2={light} pg3={heavy}; the nodes now:\n{nodes}"
        );
        eprintln!("batch {attempt}: pg2={light} pg3={heavy}, measured again; the nodes:\n{nodes}");
    }
}

/// A session never reads a replica older than its own last commit; `eventual` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_your_writes_against_a_replica_that_replays_late() {
    let env = env(1, |c| {
        c.superuser()
            .database("app", "consistency = \"read_your_writes\"")
            .database("eventual", "dbname = \"app\"\nconsistency = \"eventual\"")
            .section("[routing]\nread_your_writes_wait_ms = 0")
    });
    let primary = env.cluster.primary().port;
    late_replica_and_table(&env, "500ms");

    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;
    let insert = c.prepare("INSERT INTO t VALUES ($1)").await.unwrap();
    let read = c
        .prepare("SELECT count(*) FROM t WHERE id = $1")
        .await
        .unwrap();
    for id in 0..10_000i32 {
        c.execute(&insert, &[&id]).await.unwrap();
        let seen: i64 = c
            .query_one(&read, &[&id])
            .await
            .unwrap_or_else(|e| panic!("iteration {id}: {e:?}"))
            .get(0);
        assert_eq!(
            seen, 1,
            "iteration {id}: the session did not see its own write"
        );
    }
    // Reads that follow no write of the session still use the replica.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let fresh = env.app().await;
    assert_ne!(
        served_by(&fresh, WHERE).await,
        primary,
        "a new session reads from the replica"
    );

    let e = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "eventual")).await;
    wait_for_replica_reads(&e, primary).await;
    let mut stale = 0;
    for id in 100_000..100_100i32 {
        e.execute(&format!("INSERT INTO t VALUES ({id})"), &[])
            .await
            .unwrap();
        let seen: i64 = e
            .query_one(&format!("SELECT count(*) FROM t WHERE id = {id}"), &[])
            .await
            .unwrap()
            .get(0);
        if seen == 0 {
            stale += 1;
        }
    }
    assert!(
        stale > 0,
        "eventual consistency never read from the late replica"
    );
}

/// With a replica that keeps up, read-your-writes waits briefly and still reads from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_your_writes_uses_a_replica_once_it_has_replayed_the_write() {
    let env = env(1, |c| {
        c.superuser()
            .section("[routing]\nread_your_writes_wait_ms = 2000")
    });
    let primary = env.cluster.primary().port;
    env.direct("CREATE TABLE t (id int PRIMARY KEY); GRANT ALL ON t TO app");
    env.cluster.wait_replayed();
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;
    let mut replica_reads = 0;
    for id in 0..200i32 {
        c.execute(&format!("INSERT INTO t VALUES ({id})"), &[])
            .await
            .unwrap();
        let row = c
            .query_one(
                &format!("SELECT count(*), current_setting('port') FROM t WHERE id = {id}"),
                &[],
            )
            .await
            .unwrap();
        let (seen, port): (i64, String) = (row.get(0), row.get(1));
        assert_eq!(
            seen, 1,
            "iteration {id}: the session did not see its own write"
        );
        if port != primary.to_string() {
            replica_reads += 1;
        }
    }
    assert!(
        replica_reads > 150,
        "reads after writes should wait for the replica, not fall back: {replica_reads}/200 on the replica"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_mid_workload_costs_no_query_and_rejoins() {
    let env = env(2, |c| {
        c.max_size(10).section("[routing]\nrejoin_after_checks = 3")
    });
    let primary = env.cluster.primary().port;
    pgbench(&env.app_url(), &["-i", "-s", "1", "-q"]).expect("pgbench -i");
    env.cluster.wait_replayed();
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;

    let url = env.app_url();
    let readers =
        std::thread::spawn(move || pgbench(&url, &["-S", "-c", "8", "-j", "2", "-T", "8", "-n"]));
    std::thread::sleep(Duration::from_secs(3));
    let victim = env.cluster.node("pg2");
    victim
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("stop pg2");
    let out = readers.join().expect("reader thread");
    // A read the replica had started answering when it died cannot be repeated elsewhere
    // (PostgreSQL flushes what it buffered with its shutdown warning, and part of the answer
    // has reached the client): that one client may fail, with the replica named. Every other
    // read in flight is sent elsewhere, so a broken retry shows as several failures.
    let out = match out {
        Ok(out) => out,
        Err(out) => {
            let aborted: Vec<&str> = out
                .lines()
                .filter(|l| l.contains("aborted in command"))
                .collect();
            assert!(
                aborted.len() == 1
                    && aborted[0].contains("node pg2 closed the connection unexpectedly"),
                "reads failed when a replica died: {out}"
            );
            out
        }
    };
    assert!(out.contains("number of failed transactions: 0"), "{out}");

    // While it is down no read goes there, and the other nodes answer.
    for _ in 0..20 {
        assert_ne!(served_by(&c, WHERE).await, victim.port);
    }
    victim.start(Duration::from_secs(30)).expect("restart pg2");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut ports = Vec::new();
        for _ in 0..10 {
            ports.push(served_by(&c, WHERE).await);
        }
        if ports.contains(&victim.port) {
            break;
        }
        assert!(Instant::now() < deadline, "pg2 never rejoined the read set");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        env.pgherd.log().contains("rejoins the read set"),
        "{}",
        env.pgherd.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hints_and_the_route_setting() {
    let writer =
        pgherd_wire::scram::ScramVerifier::from_password(APP_PASSWORD, b"writer-salt", 4096);
    let env = env(1, |c| {
        c.user(
            "writer",
            &writer,
            &format!("route = \"primary\"\nserver_password = \"{APP_PASSWORD}\""),
        )
    });
    let primary = env.cluster.primary().port;
    let replica = env.cluster.node("pg2").port;
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;

    assert_eq!(
        served_by(&c, &format!("/* pgherd:primary */ {WHERE}")).await,
        primary
    );
    assert_eq!(
        served_by(&c, &format!("{WHERE} -- pgherd:replica")).await,
        replica
    );

    for bad in [
        "/* pgherd:elsewhere */ SELECT 1",
        "SET pgherd.route = 'nowhere'",
    ] {
        let err = c.simple_query(bad).await.expect_err(bad);
        assert_eq!(code(&err), "22023", "{bad}: {err}");
        let text = err
            .as_db_error()
            .map(|d| format!("{} {}", d.message(), d.hint().unwrap_or("")))
            .unwrap_or_default();
        assert!(
            text.contains("primary") && text.contains("replica"),
            "{bad}: {text}"
        );
        // The connection stays usable, in extended protocol too.
        assert_eq!(first_value(&c, "SELECT 1").await.unwrap(), "1");
    }
    let err = c
        .prepare("/* pgherd:bogus */ SELECT 1")
        .await
        .expect_err("bad hint in Parse");
    assert_eq!(code(&err), "22023");
    assert_eq!(
        c.query_one("SELECT 2", &[]).await.unwrap().get::<_, i32>(0),
        2
    );

    // Shards are named only where there are shards: never silently ignored.
    for sharded in ["/* pgherd:shard=1 */ SELECT 1", "SET pgherd.shard = 1"] {
        let err = c.simple_query(sharded).await.expect_err(sharded);
        assert_eq!(code(&err), "0A000", "{sharded}: {err}");
    }
    c.simple_query("RESET ALL").await.expect("RESET ALL");

    // PRIMARY is an SQL keyword, so the value is quoted.
    c.simple_query("SET pgherd.route = 'primary'")
        .await
        .unwrap();
    assert_eq!(served_by(&c, WHERE).await, primary);
    assert_eq!(
        first_value(&c, "SHOW pgherd.route").await.unwrap(),
        "primary"
    );
    c.simple_query("SET pgherd.route = 'auto'").await.unwrap();
    assert_eq!(served_by(&c, WHERE).await, replica);

    // A per-user default.
    env.cluster.create_user("writer", APP_PASSWORD);
    env.direct("GRANT CONNECT ON DATABASE app TO writer");
    let w = connect(&env.pgherd.conninfo("writer", APP_PASSWORD, APP)).await;
    for _ in 0..5 {
        assert_eq!(served_by(&w, WHERE).await, primary);
    }
}

/// Server connections of the app whose last statement was pgherd's LSN probe.
fn lsn_probes_last(env: &Env) -> String {
    env.direct(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' \
         AND query = 'SELECT pg_catalog.pg_current_wal_insert_lsn()'",
    )
}

/// Under route = auto a session that only writes stops asking for the WAL position after a
/// few writes (nothing would use the answer); its next read runs on the primary and sees
/// every one of its writes, and from then on its writes are probed again, so that the reads
/// after them may use the replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_only_writes_stops_probing_until_it_reads() {
    let env = env(1, |c| {
        c.superuser()
            .section("[routing]\nread_your_writes_wait_ms = 3000")
    });
    let primary = env.cluster.primary().port;
    let replica = env.cluster.node("pg2");
    late_replica_and_table(&env, "300ms");
    let c = env.app().await;
    wait_for_replica_reads(&c, primary).await;

    let insert = c.prepare("INSERT INTO t VALUES ($1)").await.unwrap();
    for id in 0..30i32 {
        c.execute(&insert, &[&id]).await.unwrap();
    }
    assert_eq!(
        lsn_probes_last(&env),
        "0",
        "a write-only session kept probing"
    );
    let seen: i64 = c
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        seen, 30,
        "the read after unprobed writes missed some of them"
    );

    c.execute(&insert, &[&100i32]).await.unwrap();
    assert_ne!(
        lsn_probes_last(&env),
        "0",
        "a read made the session probe again"
    );
    assert_eq!(
        served_by(&c, WHERE).await,
        replica.port,
        "the read after a probed write waits for the replica"
    );
}

/// A session routed to the primary asks for no WAL position after its writes (PgBouncer's
/// cost per transaction, not one query more) until a hint sends a read towards a replica: that
/// first hinted read after a write runs on the primary, and from then on the session's writes
/// are followed as read-your-writes does (until it writes 8 times with no such read between).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_routed_to_the_primary_asks_for_no_lsn_until_a_hint_needs_one() {
    let env = env(1, |c| {
        c.superuser().database(
            "app",
            "route = \"primary\"\nconsistency = \"read_your_writes\"",
        )
    });
    let primary = env.cluster.primary().port;
    late_replica_and_table(&env, "500ms");
    // Another session waits for the replica to serve hinted reads: this one has no hint yet.
    let waiter = env.app().await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while served_by(&waiter, &format!("/* pgherd:replica */ {WHERE}")).await == primary {
        assert!(
            Instant::now() < deadline,
            "hinted reads never reached the replica"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let probes_last = || lsn_probes_last(&env);

    let c = env.app().await;
    let insert = c.prepare("INSERT INTO t VALUES ($1)").await.unwrap();
    for id in 0..50i32 {
        c.execute(&insert, &[&id]).await.unwrap();
        c.simple_query(&format!("INSERT INTO t VALUES ({})", 1000 + id))
            .await
            .unwrap();
    }
    assert_eq!(
        probes_last(),
        "0",
        "writes of a primary-routed session were probed"
    );

    for id in 2000..2020i32 {
        c.execute(&insert, &[&id]).await.unwrap();
        let seen: i64 = c
            .query_one(
                &format!("/* pgherd:replica */ SELECT count(*) FROM t WHERE id = {id}"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            seen, 1,
            "row {id}: a hinted read missed the session's own write"
        );
    }
    c.execute(&insert, &[&3000i32]).await.unwrap();
    assert_ne!(
        probes_last(),
        "0",
        "after a hinted read the session's writes are followed again"
    );
    // Once the replica has replayed, hinted reads go there again.
    env.cluster.wait_replayed();
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        served_by(&c, &format!("/* pgherd:replica */ {WHERE}")).await,
        env.cluster.node("pg2").port
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_pins_the_client_to_its_server() {
    let env = env(1, |c| c.max_size(2));
    let c = env.app().await;
    c.simple_query("CREATE TEMP TABLE scratch (a int)")
        .await
        .unwrap();
    // Other clients keep the pool busy; the temp table must stay visible to its session.
    let others: Vec<_> = (0..4)
        .map(|_| {
            let url = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
            tokio::spawn(async move {
                let o = connect(&url).await;
                for _ in 0..50 {
                    o.simple_query("SELECT 1").await.unwrap();
                }
            })
        })
        .collect();
    for i in 0..50 {
        c.simple_query(&format!("INSERT INTO scratch VALUES ({i})"))
            .await
            .unwrap();
        assert_eq!(
            first_value(&c, "SELECT count(*) FROM scratch")
                .await
                .unwrap(),
            (i + 1).to_string()
        );
    }
    for o in others {
        o.await.unwrap();
    }
    assert!(
        env.pgherd.log().contains("session pinned"),
        "{}",
        env.pgherd.log()
    );
}

/// Zones: pgherd in zone a sends reads to the replica in zone a, never to the one in zone b
/// while the local one can take them; with the local one detached, zone b serves. The
/// asynchronous standby (`sync = false`) stays out of the synchronous set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_stay_in_the_local_zone_and_an_async_standby_stays_out_of_the_set() {
    let env = env(2, |c| {
        c.superuser()
            .proxy("zone = \"a\"")
            .proxy("admin_users = [\"postgres\"]")
            .node_line("pg1", "zone = \"a\"")
            .node_line("pg2", "zone = \"a\"")
            .node_line("pg3", "zone = \"b\"")
            .node_line("pg3", "sync = false")
    });
    let primary_port = env.cluster.primary().port;
    let local = env.cluster.node("pg2").port;
    let remote = env.cluster.node("pg3").port;
    let c = env.app().await;
    wait_for_replica_reads(&c, primary_port).await;
    wait_for_readers(&env, &["pg2", "pg3"]).await;
    for _ in 0..30 {
        let port = served_by(&c, WHERE).await;
        assert_ne!(port, remote, "a read went to the other zone");
    }
    let nodes = admin_rows(&env, "SHOW NODES");
    assert!(nodes.contains("async"), "{nodes}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let cluster = admin_rows(&env, "SHOW CLUSTER");
        if cluster.contains("ANY 1 (\"pg2\")") {
            break;
        }
        assert!(!cluster.contains("\"pg3\""), "{cluster}");
        assert!(Instant::now() < deadline, "{cluster}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    admin_rows(&env, "DETACH pg2");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let port = served_by(&c, WHERE).await;
        assert_ne!(port, local, "a read reached the detached replica");
        if port == remote {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the other zone never served reads with the local replica out"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
