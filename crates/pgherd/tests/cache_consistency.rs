//! The result cache under writers it does and does not see: writes through pgherd drop the
//! answers of their tables as their transaction ends, before the WAL says so; a differential
//! run of concurrent writers (through pgherd and directly on the primary) and readers checks
//! every answer against what was committed; after a failover nothing kept on the old primary
//! is served; many distinct statements keep the cache within its memory bound.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::cache::*;
use common::*;
use pgherd_route::balance::parse_lsn;
use std::sync::Mutex;
use tokio_postgres::Client;

const READ: &str = "/* pgherd:cache */ SELECT v FROM items WHERE id = 1";

/// Stops a process for as long as it lives (and lets it go on whatever happens).
struct Stopped(u32);

impl Stopped {
    fn new(pid: u32) -> Stopped {
        signal(pid, "STOP");
        Stopped(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success(), "kill -{name} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_through_pgherd_drop_answers_before_the_wal_says_so() {
    // Silence is allowed for long: the stream is held still on purpose below.
    let (env, console) = cache_env(0, |c| c.section("[cache]\nmax_silence_ms = 120000")).await;
    let writer = env.app().await;
    let reader = env.app().await;
    writer
        .batch_execute(
            "CREATE TABLE items (id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10)",
        )
        .await
        .expect("setup");
    assert_eq!(read_until_served(&reader, &console, READ).await, "10");

    // The cache's walsender, held still: nothing more is decoded.
    let pid: u32 = env
        .direct(
            "SELECT active_pid FROM pg_replication_slots \
             WHERE slot_name LIKE 'pgherd_cache_%' AND active",
        )
        .trim()
        .parse()
        .expect("the cache's walsender");
    let held = Stopped::new(pid);
    // A commit pgherd does not see is not known until decoded: the kept answer still comes.
    env.direct("UPDATE items SET v = 11 WHERE id = 1");
    assert_eq!(read_until_served(&reader, &console, READ).await, "10");

    // A write through pgherd drops it as its transaction ends, for every session.
    writer
        .batch_execute("UPDATE items SET v = 12 WHERE id = 1")
        .await
        .expect("the write");
    assert_eq!(first_value(&reader, READ).await.unwrap(), "12");
    assert_eq!(read_until_served(&reader, &console, READ).await, "12");
    writer
        .batch_execute("BEGIN; INSERT INTO items VALUES (2, 0); COMMIT")
        .await
        .expect("an unrelated write");
    assert_eq!(read_until_served(&reader, &console, READ).await, "12");
    writer.batch_execute("BEGIN").await.expect("a transaction");
    writer
        .batch_execute("UPDATE items SET v = 13 WHERE id = 1")
        .await
        .expect("the write");
    // Not committed yet: the committed answer may still be served.
    assert_eq!(first_value(&reader, READ).await.unwrap(), "12");
    writer.batch_execute("COMMIT").await.expect("commit");
    assert_eq!(first_value(&reader, READ).await.unwrap(), "13");
    // Prepared statements (extended protocol) too.
    assert_eq!(read_until_served(&reader, &console, READ).await, "13");
    let update = writer
        .prepare("UPDATE items SET v = $1 WHERE id = 1")
        .await
        .expect("prepare");
    writer.execute(&update, &[&14i32]).await.expect("the write");
    assert_eq!(first_value(&reader, READ).await.unwrap(), "14");
    drop(held);

    // Once the stream goes on, the direct commit it held back is decoded, and what pgherd
    // kept since is still right.
    let lsn = env.direct("SELECT pg_current_wal_lsn()");
    wait_decoded(&env, &console, lsn.trim(), None).await;
    assert_eq!(read_until_served(&reader, &console, READ).await, "14");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_failover_nothing_kept_on_the_old_primary_is_served() {
    let (env, console) = cache_env(1, |c| {
        c.manage_nodes().section("[failover]\nenabled = true")
    })
    .await;
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 1)",
    )
    .await
    .expect("setup");
    env.cluster.wait_replayed();
    assert_eq!(read_until_served(&app, &console, READ).await, "1");
    let restarts_before = figure(&console, "restarts").await;

    env.cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    wait_until(&env, "pg2 promoted", Duration::from_secs(60), || {
        env.cluster
            .node("pg2")
            .psql(APP, "SELECT pg_is_in_recovery()")
            .is_ok_and(|r| r.trim() == "f")
    });
    // The new primary takes a write pgherd does not see, at once.
    env.cluster
        .sql_on("pg2", APP, "UPDATE items SET v = 2 WHERE id = 1");

    // No read answers with the old primary's value from now on, and the cache comes back on
    // the new primary.
    let started = Instant::now();
    loop {
        let hits = figure(&console, "hits").await;
        match first_value(&app, READ).await {
            Ok(v) => {
                assert_eq!(v, "2", "a stale answer after the failover");
                if figure(&console, "hits").await > hits {
                    break;
                }
            }
            // The pool may still hold connections to the dead primary for a moment.
            Err(e) => assert!(
                started.elapsed() < Duration::from_secs(30),
                "reads did not recover: {e}"
            ),
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the cache did not serve again on the new primary: {:?}\n{}",
            cache_row(&console).await,
            env.pgherd.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(figure(&console, "restarts").await > restarts_before);
    let row = cache_row(&console).await;
    assert_eq!(field(&row, "following"), "pg2", "{row:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_distinct_statements_stay_within_the_memory_bound() {
    const MAX_BYTES: u64 = 256 << 10;
    let (env, console) = cache_env(0, |c| {
        c.section(&format!(
            "[cache]\nmax_bytes = {MAX_BYTES}\nmax_entry_bytes = 16384"
        ))
    })
    .await;
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v int); \
         INSERT INTO items SELECT g, g FROM generate_series(1, 2000) g",
    )
    .await
    .expect("setup");
    read_until_served(&app, &console, READ).await;

    // About 1.1 kB per answer, 2,000 of them: eight times the bound.
    for id in 1..=2000 {
        let sql =
            format!("/* pgherd:cache */ SELECT v, repeat('x', 1000) FROM items WHERE id = {id}");
        app.simple_query(&sql).await.expect("a read");
        if id % 250 == 0 {
            let bytes = figure(&console, "bytes").await;
            assert!(bytes <= MAX_BYTES, "{bytes} bytes kept, over the bound");
        }
    }
    let row = cache_row(&console).await;
    let number = |name: &str| field(&row, name).parse::<u64>().expect("a number");
    assert!(number("bytes") <= MAX_BYTES, "{row:?}");
    assert!(
        number("bytes") > MAX_BYTES / 2,
        "the bound is used: {row:?}"
    );
    assert!(number("evictions") >= 1000, "{row:?}");
    assert!(number("entries") >= 100, "{row:?}");

    // An answer larger than one entry may be is passed on whole and not kept.
    let stores = number("stores");
    for _ in 0..3 {
        let big = first_value(
            &app,
            "/* pgherd:cache */ SELECT repeat('y', 20000) FROM items WHERE id = 1",
        )
        .await
        .expect("a large answer");
        assert_eq!(big.len(), 20000);
    }
    assert_eq!(figure(&console, "stores").await, stores);
}

/// A commit a writer saw acknowledged: its row, the version it wrote, and where the primary's
/// WAL stood just after it (at or past the commit's end).
#[derive(Clone, Copy)]
struct Committed {
    id: i32,
    version: i32,
    wal_after: u64,
    acknowledged: Instant,
    through_pgherd: bool,
}

const ROWS: i32 = 16;

fn read_row_sql(id: i32) -> String {
    format!("/* pgherd:cache */ SELECT version FROM versions WHERE id = {id}")
}

async fn wal_position(c: &Client) -> u64 {
    parse_lsn(&first_value(c, "SELECT pg_current_wal_lsn()").await.unwrap()).expect("an LSN")
}

/// Writes new versions of random rows until `until`; a writer through pgherd checks after
/// each commit that its own next cached read sees it.
async fn write_versions(
    c: Client,
    through_pgherd: bool,
    until: Instant,
    log: Arc<Mutex<Vec<Committed>>>,
) {
    while Instant::now() < until {
        let id = (rand::random::<u32>() % ROWS as u32) as i32 + 1;
        let version: i32 = first_value(
            &c,
            &format!("UPDATE versions SET version = version + 1 WHERE id = {id} RETURNING version"),
        )
        .await
        .expect("a write")
        .parse()
        .unwrap();
        let acknowledged = Instant::now();
        let wal_after = wal_position(&c).await;
        log.lock().unwrap().push(Committed {
            id,
            version,
            wal_after,
            acknowledged,
            through_pgherd,
        });
        if through_pgherd {
            let seen: i32 = first_value(&c, &read_row_sql(id))
                .await
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                seen >= version,
                "row {id}: own write {version} missed, read {seen}"
            );
        }
        // Every commit drops the whole table's answers: writing much faster would leave the
        // readers few answers to take from the cache, and the run would test little.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A read: the row, the version it returned, what the stream had decoded before it was sent,
/// and when it was sent.
struct Read {
    id: i32,
    version: i32,
    decoded_before: u64,
    sent: Instant,
}

async fn read_versions(c: Client, console: Client, until: Instant) -> Vec<Read> {
    let mut reads = Vec::new();
    while Instant::now() < until {
        let id = (rand::random::<u32>() % ROWS as u32) as i32 + 1;
        let decoded_before = decoded_lsn(&console).await;
        let sent = Instant::now();
        let version = first_value(&c, &read_row_sql(id))
            .await
            .expect("a read")
            .parse()
            .unwrap();
        reads.push(Read {
            id,
            version,
            decoded_before,
            sent,
        });
    }
    reads
}

/// How long after each direct commit the stream had decoded it (found by sampling what it
/// had decoded as often as the console answers).
async fn sample_decoding(console: Client, until: Instant) -> Vec<(Instant, u64)> {
    let mut samples = Vec::new();
    while Instant::now() < until + Duration::from_secs(2) {
        let lsn = decoded_lsn(&console).await;
        samples.push((Instant::now(), lsn));
    }
    samples
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn differential_every_read_is_at_least_as_new_as_what_was_decoded_before_it() {
    // No replica: an answer the cache did not give comes from the primary, so any stale
    // answer is the cache's.
    let (env, console) = cache_env(0, |c| c).await;
    let app = env.app().await;
    app.batch_execute(&format!(
        "CREATE TABLE versions (id int PRIMARY KEY, version int NOT NULL); \
         INSERT INTO versions SELECT g, 0 FROM generate_series(1, {ROWS}) g"
    ))
    .await
    .expect("setup");
    read_until_served(&app, &console, &read_row_sql(1)).await;

    let until = Instant::now() + Duration::from_secs(12);
    let log = Arc::new(Mutex::new(Vec::new()));
    let primary_port = env.cluster.node("pg1").port;
    let mut writers = Vec::new();
    for through_pgherd in [true, false] {
        let c = if through_pgherd {
            env.app().await
        } else {
            connect_as_superuser(primary_port, APP).await
        };
        writers.push(tokio::spawn(write_versions(
            c,
            through_pgherd,
            until,
            log.clone(),
        )));
    }
    let mut readers = Vec::new();
    for _ in 0..3 {
        readers.push(tokio::spawn(read_versions(
            env.app().await,
            connect(&console_conninfo(&env)).await,
            until,
        )));
    }
    let sampler = tokio::spawn(sample_decoding(
        connect(&console_conninfo(&env)).await,
        until,
    ));
    for w in writers {
        w.await.expect("a writer");
    }
    let mut reads = Vec::new();
    for r in readers {
        reads.extend(r.await.expect("a reader"));
    }
    let samples = sampler.await.expect("the sampler");
    let commits = log.lock().unwrap().clone();

    // Per row, the commits in version order.
    let mut by_row: HashMap<i32, Vec<Committed>> = HashMap::new();
    for c in &commits {
        by_row.entry(c.id).or_default().push(*c);
    }
    let mut stale = Vec::new();
    for read in &reads {
        let Some(row) = by_row.get(&read.id) else {
            continue;
        };
        // The newest version the read must see: acknowledged before it was sent, and
        // either decoded before it was sent (the WAL position taken after the commit is at
        // or past its end) or committed through this pgherd. (A commit is decoded a moment
        // before the primary shows it to other sessions: until it is acknowledged, the old
        // version is still the primary's own answer.)
        let floor = row
            .iter()
            .filter(|c| {
                c.acknowledged < read.sent
                    && (c.through_pgherd || c.wal_after <= read.decoded_before)
            })
            .max_by_key(|c| c.version);
        if let Some(floor) = floor.filter(|c| read.version < c.version) {
            stale.push(format!(
                "row {}: read version {} but {} was committed before the read ({}, decoded {:X} ≥ {:X}: {}, acknowledged {:?} before it was sent)",
                read.id,
                read.version,
                floor.version,
                if floor.through_pgherd { "through pgherd" } else { "directly" },
                read.decoded_before,
                floor.wal_after,
                floor.wal_after <= read.decoded_before,
                read.sent.duration_since(floor.acknowledged),
            ));
        }
    }
    let hits = figure(&console, "hits").await;
    let invalidations = figure(&console, "invalidations").await;

    // Commit acknowledged → the stream's decoded position at or past the WAL position
    // taken after it, for the direct writes: an upper bound (that position may lie past the
    // commit, and the stream moves its position only with messages).
    let mut delays: Vec<Duration> = commits
        .iter()
        .filter(|c| !c.through_pgherd)
        .filter_map(|c| {
            samples
                .iter()
                .find(|(at, lsn)| *at >= c.acknowledged && *lsn >= c.wal_after)
                .map(|(at, _)| at.duration_since(c.acknowledged))
        })
        .collect();
    delays.sort();
    let direct = commits.iter().filter(|c| !c.through_pgherd).count();
    // pgherd's own figure: the commit's time on the primary → its answers dropped.
    let row = cache_row(&console).await;
    eprintln!(
        "differential: {} reads, {} commits ({} direct), {hits} hits, {invalidations} invalidations; \
         invalidation delay (commit time → dropped, pgherd's histogram): median {} ms, p99 {} ms; \
         acknowledged → decoded position past it (upper bound, sampled): median {:?}, p99 {:?} \
         ({} measured, {} samples)",
        reads.len(),
        commits.len(),
        direct,
        field(&row, "invalidation_delay_p50_ms"),
        field(&row, "invalidation_delay_p99_ms"),
        delays.get(delays.len() / 2).copied().unwrap_or_default(),
        if delays.is_empty() { Duration::ZERO } else { percentile(&delays, 0.99) },
        delays.len(),
        samples.len(),
    );
    assert!(
        !field(&row, "invalidation_delay_p99_ms").is_empty(),
        "commit times are decoded: {row:?}"
    );
    assert!(stale.is_empty(), "stale answers:\n{}", stale.join("\n"));
    // The run meant something: both kinds of writer committed, answers came from the cache,
    // and writes dropped what it kept.
    assert!(
        direct >= 100 && commits.len() - direct >= 100,
        "{} commits",
        commits.len()
    );
    assert!(hits >= 200, "only {hits} answers from the cache");
    assert!(invalidations >= 50, "only {invalidations} invalidations");
    assert_eq!(delays.len(), direct, "every direct commit was decoded");
}
