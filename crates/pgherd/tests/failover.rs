//! Automatic failover against real clusters: the primary killed with `pg_ctl stop -m
//! immediate` is replaced by the most advanced replica, the other replica follows it, and the
//! old primary, restarted, gets no traffic and is made read-only; and when only pgherd's own
//! path to the primary is cut while the replicas still stream from it, nothing is promoted.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

const FAILOVER: &str = "[failover]\nenabled = true";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_and_fenced() {
    // Declared before the environment, so removed after pgherd stops: its hooks may still
    // run (a rejoin) after the checks below.
    let hooks_dir = tempfile::Builder::new()
        .prefix("pgherd-notify-")
        .tempdir()
        .expect("a directory for the hooks' output");
    let notified = hooks_dir.path().join("notified");
    let fenced_file = hooks_dir.path().join("fenced");
    let section = format!(
        "{FAILOVER}\nnotify_command = \"echo \\\"$PGHERD_EVENT $PGHERD_NODE\\\" >> {}\"\n\
         fence_command = \"echo \\\"$PGHERD_NODE $PGHERD_PORT\\\" >> {}\"",
        notified.display(),
        fenced_file.display()
    );
    let env = env(2, |c| {
        c.superuser()
            .manage_nodes()
            .proxy("admin_users = [\"postgres\"]")
            .section(&section)
    });
    let c = env.app().await;
    c.batch_execute("CREATE TABLE acked (id int PRIMARY KEY)")
        .await
        .expect("create");
    c.batch_execute("INSERT INTO acked VALUES (1)")
        .await
        .expect("insert before the fault");
    env.cluster.wait_replayed();
    wait_until(&env, "pgherd elected pg1", Duration::from_secs(10), || {
        env.pgherd
            .log()
            .contains("pg1 accepts writes: elected primary")
    });

    let old = env.cluster.node("pg1");
    old.stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    let fault = Instant::now();
    // Writes resume through the same endpoint once a replica is promoted.
    let mut id = 2;
    let recovered = loop {
        let attempt = async {
            let c = try_connect(&env.pgherd.conninfo(APP, APP_PASSWORD, APP)).await?;
            c.batch_execute(&format!("INSERT INTO acked VALUES ({id})"))
                .await?;
            // The hint: the port must be the primary's, not a replica's that serves the read.
            first_value(&c, "/* pgherd:primary */ SELECT current_setting('port')").await
        };
        match attempt.await {
            Ok(port) => break port,
            Err(_) if fault.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!(
                "no write succeeded within 30 s of the fault: {e}\n--- pgherd log ---\n{}",
                env.pgherd.log()
            ),
        }
        id += 1;
    };
    let rto = fault.elapsed();
    let new_primary = env
        .cluster
        .cluster
        .nodes
        .iter()
        .find(|n| n.port.to_string() == recovered)
        .expect("writes land on a cluster node");
    assert_ne!(new_primary.name, "pg1");
    let log = env.pgherd.log();
    assert!(
        log.contains("primary pg1 is down and no replica sees it: promoting"),
        "{log}"
    );
    eprintln!("writes resumed on {} after {rto:?}", new_primary.name);

    // The write acknowledged before the fault survived, on the new primary.
    let c = env.app().await;
    assert_eq!(
        first_value(&c, "SELECT count(*) FROM acked WHERE id = 1")
            .await
            .expect("read"),
        "1"
    );
    // The other replica follows the new primary: a write after the failover reaches it.
    let follower = env
        .cluster
        .cluster
        .nodes
        .iter()
        .find(|n| n.name != "pg1" && n.name != new_primary.name)
        .expect("a third node");
    let last = id;
    wait_until(
        &env,
        "the other replica replayed a write made after the failover",
        Duration::from_secs(30),
        || {
            follower
                .psql(
                    APP,
                    &format!("SELECT count(*) FROM acked WHERE id = {last}"),
                )
                .map(|s| s == "1")
                .unwrap_or(false)
        },
    );

    // The old primary comes back writable on its own: pgherd sends it nothing and makes it
    // read-only.
    old.start(Duration::from_secs(30)).expect("restart pg1");
    wait_sealed(&env, old);
    // Every step is an event, on the admin console and through the notification command. The
    // node reads as read-only a moment before pgherd records that it sealed it.
    let console = env
        .pgherd
        .url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd");
    let show_events = || psql(&console, &["-c", "SHOW EVENTS"]).expect("SHOW EVENTS");
    wait_until(
        &env,
        "the sealed event was recorded",
        Duration::from_secs(10),
        || show_events().contains("|sealed|"),
    );
    let events = show_events();
    for kind in [
        "elected",
        "suspect",
        "promoting",
        "fenced",
        "promoted",
        "repointed",
        "sealed",
    ] {
        assert!(
            events.contains(&format!("|{kind}|")),
            "no {kind} event in:\n{events}"
        );
    }
    let nodes = psql(&console, &["-c", "SHOW NODES"]).expect("SHOW NODES");
    assert!(
        nodes
            .lines()
            .any(|l| l.starts_with("pg1|") && l.contains("|fenced|")),
        "{nodes}"
    );
    let mut notes = String::new();
    wait_until(
        &env,
        "the notification command ran for the promotion",
        Duration::from_secs(10),
        || {
            notes = std::fs::read_to_string(&notified).unwrap_or_default();
            notes.contains(&format!("promoted {}", new_primary.name))
        },
    );
    // The fencing hook ran once for the old primary, with its address.
    let fenced = std::fs::read_to_string(&fenced_file).unwrap_or_default();
    assert_eq!(
        fenced.trim(),
        format!("pg1 {}", old.port),
        "fence command output"
    );
    for _ in 0..20 {
        let port = match first_value(&c, "SELECT current_setting('port')").await {
            Ok(port) => port,
            Err(e) => panic!(
                "a read after the old primary returned failed: {e}\n--- pgherd log ---\n{}",
                env.pgherd.log()
            ),
        };
        assert_ne!(
            port,
            old.port.to_string(),
            "traffic reached the fenced node"
        );
        c.batch_execute(&format!("INSERT INTO acked VALUES ({})", id + 100))
            .await
            .expect("write after the old primary returned");
        id += 1;
    }

    // The old primary's history diverged (its end-of-recovery checkpoint, and a row written
    // to it directly); REJOIN rewinds it into a standby of the new primary.
    old.psql(
        APP,
        // Not waiting for the synchronous standbys it had as the primary.
        "BEGIN READ WRITE; SET LOCAL synchronous_commit = local; \
         INSERT INTO acked VALUES (999999); COMMIT",
    )
    .expect("a write only the old primary has");
    let admin = env
        .pgherd
        .url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd");
    let steps = psql(&admin, &["-c", "REJOIN pg1"])
        .unwrap_or_else(|e| panic!("REJOIN failed: {e}\n{}", env.pgherd.log()));
    assert!(
        steps.contains(&format!(
            "pg1 rejoined as a standby of {} (pg_rewind)",
            new_primary.name
        )),
        "{steps}"
    );
    eprintln!("rejoin:\n{steps}");
    assert_eq!(
        old.psql("postgres", "SELECT pg_is_in_recovery()")
            .expect("pg1 answers"),
        "t"
    );
    c.batch_execute("INSERT INTO acked VALUES (424242)")
        .await
        .expect("write after the rejoin");
    wait_until(
        &env,
        "the rejoined node replayed a new write",
        Duration::from_secs(30),
        || {
            old.psql(APP, "SELECT count(*) FROM acked WHERE id = 424242")
                .map(|s| s == "1")
                .unwrap_or(false)
        },
    );
    assert_eq!(
        old.psql(APP, "SELECT count(*) FROM acked WHERE id = 999999")
            .expect("query"),
        "0",
        "the diverged write survived the rewind"
    );
    let nodes = psql(&admin, &["-c", "SHOW NODES"]).expect("SHOW NODES");
    assert!(
        nodes
            .lines()
            .any(|l| l.starts_with("pg1|") && !l.contains("|fenced|")),
        "{nodes}"
    );
}

/// A TCP forwarder to a node that the test can cut: pgherd's only path to it.
struct Forwarder {
    tasks: Arc<std::sync::Mutex<JoinSet<()>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl Forwarder {
    /// Forwards connections accepted on `listener` to `target`.
    fn start(listener: std::net::TcpListener, target: u16) -> Forwarder {
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = TcpListener::from_std(listener).expect("tokio listener");
        let tasks: Arc<std::sync::Mutex<JoinSet<()>>> = Arc::default();
        let spawned = tasks.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                spawned.lock().expect("lock").spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", target)).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Forwarder { tasks, accept }
    }

    /// Closes the listener and every forwarded connection.
    fn cut(&self) {
        self.accept.abort();
        self.tasks.lock().expect("lock").abort_all();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_promotion_when_only_pgherds_path_to_the_primary_fails() {
    let path = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let path_port = path.local_addr().expect("addr").port();
    let env = env(2, |c| c.section(FAILOVER).node_port("pg1", path_port));
    let forwarder = Forwarder::start(path, env.cluster.primary().port);
    wait_until(&env, "pgherd elected pg1", Duration::from_secs(10), || {
        env.pgherd
            .log()
            .contains("pg1 accepts writes: elected primary")
    });
    let c = env.app().await;
    c.batch_execute("CREATE TABLE t (id int)")
        .await
        .expect("write through the path");

    forwarder.cut();
    wait_until(
        &env,
        "pgherd saw the replicas still streaming and refused to promote",
        Duration::from_secs(15),
        || {
            env.pgherd
                .log()
                .contains("still stream(s) from it: not promoting")
        },
    );
    // Well past detection (3 failures at 200 ms): still no promotion, both replicas follow pg1.
    std::thread::sleep(Duration::from_secs(3));
    for replica in ["pg2", "pg3"] {
        assert_eq!(
            env.cluster
                .sql_on(replica, "postgres", "SELECT pg_is_in_recovery()"),
            "t",
            "{replica} was promoted although it still streamed from the primary\n{}",
            env.pgherd.log()
        );
    }
    assert!(
        !env.pgherd.log().contains("no replica sees it: promoting"),
        "{}",
        env.pgherd.log()
    );
    // The primary itself was never touched.
    assert_eq!(env.direct("SELECT count(*) FROM t"), "0");
}

/// When `pg_rewind` cannot work (here: the old primary's WAL is gone), REJOIN copies the node
/// afresh with `pg_basebackup`, keeps the old directory aside, and the node follows the new
/// primary without its diverged write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejoin_falls_back_to_a_fresh_copy_when_rewind_fails() {
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .proxy("admin_users = [\"postgres\"]")
            .section(FAILOVER)
    });
    let c = env.app().await;
    c.batch_execute("CREATE TABLE acked (id int PRIMARY KEY); INSERT INTO acked VALUES (1)")
        .await
        .expect("write before the fault");
    wait_until(&env, "pgherd elected pg1", Duration::from_secs(10), || {
        env.pgherd
            .log()
            .contains("pg1 accepts writes: elected primary")
    });
    let old = env.cluster.node("pg1");
    old.stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    wait_until(&env, "pg2 was promoted", Duration::from_secs(30), || {
        env.pgherd.log().contains("promoted")
            && env
                .cluster
                .node("pg2")
                .psql("postgres", "SELECT pg_is_in_recovery()")
                .is_ok_and(|s| s == "f")
    });

    // The old primary comes back, takes a write of its own, and loses its WAL.
    old.start(Duration::from_secs(30)).expect("restart pg1");
    old.psql(
        APP,
        "BEGIN READ WRITE; SET LOCAL synchronous_commit = local; \
         INSERT INTO acked VALUES (999999); COMMIT",
    )
    .expect("a write only the old primary has");
    old.stop(pgherd_cluster::StopMode::Fast).expect("stop pg1");
    let wal = old.data_dir.join("pg_wal");
    for entry in std::fs::read_dir(&wal).expect("read pg_wal") {
        let path = entry.expect("entry").path();
        if path.is_file() {
            std::fs::remove_file(&path).expect("remove a WAL segment");
        }
    }

    let admin = env
        .pgherd
        .url("postgres", pgherd_testkit::SUPERUSER_PASSWORD, "pgherd");
    // What streams from the new primary while the copy runs, sampled until REJOIN is done.
    let copying = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (primary, copying) = (env.cluster.node("pg2").clone(), copying.clone());
        std::thread::spawn(move || {
            let mut samples = Vec::new();
            while copying.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok(rows) = primary.psql(
                    "postgres",
                    "SELECT coalesce(string_agg(application_name || ':' || state, ','), '') \
                     FROM pg_stat_replication",
                ) {
                    samples.push(rows);
                }
            }
            samples
        })
    };
    let steps = psql(&admin, &["-c", "REJOIN pg1"]);
    copying.store(false, std::sync::atomic::Ordering::Relaxed);
    let samples = watcher.join().expect("the watcher");
    let steps = steps.unwrap_or_else(|e| panic!("REJOIN failed: {e}\n{}", env.pgherd.log()));
    assert!(
        steps.contains("pg1 rejoined as a standby of pg2 (pg_basebackup, as pg_rewind failed"),
        "{steps}"
    );
    // The copy's WAL stream shows as `streaming` beside the backup itself. Under the node's
    // own name it counted as pg1 streaming, and the synchronous standbys waited for it.
    let during_copy: Vec<&String> = samples.iter().filter(|s| s.contains(":backup")).collect();
    assert!(
        !during_copy.is_empty(),
        "the copy was never seen: {samples:?}"
    );
    for sample in during_copy {
        assert!(
            sample
                .split(',')
                .all(|row| row.starts_with("pgherd-rejoin pg1:")),
            "the copy streamed under another name than a rejoin's: {sample}"
        );
    }
    assert!(old.data_dir.with_extension("before-rejoin").is_dir());
    assert_eq!(
        old.psql("postgres", "SELECT pg_is_in_recovery()")
            .expect("pg1 answers"),
        "t"
    );
    c.batch_execute("INSERT INTO acked VALUES (424242)")
        .await
        .expect("write after the rejoin");
    wait_until(
        &env,
        "the copied node replayed a new write",
        Duration::from_secs(30),
        || {
            old.psql(APP, "SELECT count(*) FROM acked WHERE id IN (1, 424242)")
                .map(|s| s == "2")
                .unwrap_or(false)
        },
    );
    assert_eq!(
        old.psql(APP, "SELECT count(*) FROM acked WHERE id = 999999")
            .expect("query"),
        "0",
        "the diverged write survived the copy"
    );

    // A rewind cut short (its source died, pgherd was killed) leaves the node's own files
    // saved aside and those in its directory half-copied: the next rejoin copies it afresh
    // with its own files back, and never rewinds that directory again.
    let unfinished = old.rewind_unfinished();
    std::fs::create_dir_all(&unfinished).expect("create the saved files' directory");
    for file in ["postgresql.conf", "postgresql.auto.conf", "pg_hba.conf"] {
        std::fs::copy(old.data_dir.join(file), unfinished.join(file)).expect("save a file");
    }
    std::fs::write(old.data_dir.join("pg_hba.conf"), "").expect("a half-copied pg_hba.conf");
    std::fs::write(old.data_dir.join("postgresql.conf"), "# half").expect("and settings");
    let steps = psql(&admin, &["-c", "REJOIN pg1"]).unwrap_or_else(|e| {
        panic!(
            "REJOIN after an unfinished rewind failed: {e}\n{}",
            env.pgherd.log()
        )
    });
    assert!(
        steps.contains("pg1 rejoined as a standby of pg2 (pg_basebackup, as pg_rewind failed: an earlier pg_rewind of node pg1 did not finish"),
        "{steps}"
    );
    assert!(!unfinished.exists(), "the saved files outlived the rejoin");
    assert_eq!(
        old.psql("postgres", "SELECT pg_is_in_recovery()")
            .expect("pg1 answers on its own port with its own rules"),
        "t"
    );
}

/// Waits until pgherd has made the fenced `node` read-only.
fn wait_sealed(env: &Env, node: &pgherd_cluster::LocalNode) {
    wait_until(
        env,
        &format!("{} was set read-only", node.name),
        Duration::from_secs(30),
        || {
            node.psql("postgres", "SHOW default_transaction_read_only")
                .map(|s| s == "on")
                .unwrap_or(false)
        },
    );
}

fn message(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned())
}

/// Manual failover with automatic failover off: PROMOTE refuses a primary, a live primary and
/// unknown safeguards with sentences; once the primary is dead it promotes the named replica,
/// fences the old primary (sealed when it comes back), re-points the other replica, and writes
/// go to the new primary with nothing acknowledged lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promote_by_hand_when_failover_is_off() {
    let env = env(2, |c| {
        c.superuser()
            .manage_nodes()
            .proxy("admin_users = [\"postgres\"]")
    });
    let admin = connect(&env.pgherd.conninfo(
        pgherd_testkit::SUPERUSER,
        pgherd_testkit::SUPERUSER_PASSWORD,
        "pgherd",
    ))
    .await;
    let c = env.app().await;
    c.batch_execute("CREATE TABLE acked (id int PRIMARY KEY); INSERT INTO acked VALUES (1)")
        .await
        .expect("write before the fault");
    env.cluster.wait_replayed();

    let err = admin
        .simple_query("PROMOTE pg1")
        .await
        .expect_err("a primary");
    assert_eq!(code(&err), "55000", "{err}");
    assert!(message(&err).contains("pg1 is not a replica"), "{err:?}");
    let err = admin
        .simple_query("PROMOTE pg2")
        .await
        .expect_err("live primary");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "55000", "{err}");
    assert!(
        db.message().contains("pg1 answers as the primary"),
        "{}",
        db.message()
    );
    assert!(
        db.hint()
            .is_some_and(|h| h.contains("FORCE primary-answers")),
        "{:?}",
        db.hint()
    );
    let err = admin
        .simple_query("PROMOTE pg2 FORCE everything")
        .await
        .expect_err("unknown safeguard");
    assert_eq!(code(&err), "22023", "{err}");
    let err = admin
        .simple_query("PROMOTE nosuch")
        .await
        .expect_err("no node");
    assert_eq!(code(&err), "42704", "{err}");

    let old = env.cluster.node("pg1");
    old.stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    // The replicas need a moment to notice that their upstream is gone and to settle: until
    // then PROMOTE refuses, naming why. Whichever replica holds the most WAL is the one to
    // promote.
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut candidate = "pg2";
    let steps = loop {
        match rows(&admin, &format!("PROMOTE {candidate}")).await {
            Ok(steps) => break steps,
            Err(e) if Instant::now() < deadline => {
                let message = e
                    .as_db_error()
                    .map(|d| d.message().to_owned())
                    .unwrap_or_default();
                assert_eq!(code(&e), "55000", "{e}");
                if message.contains(&format!("more than {candidate}")) {
                    candidate = if candidate == "pg2" { "pg3" } else { "pg2" };
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("PROMOTE still refused: {e:?}\n{}", env.pgherd.log()),
        }
    };
    let follower = if candidate == "pg2" { "pg3" } else { "pg2" };
    let steps: Vec<&str> = steps.iter().map(|r| r[0].1.as_str()).collect();
    assert!(
        steps.contains(&"pg1 fenced: no more traffic through pgherd"),
        "{steps:?}"
    );
    assert!(
        steps.contains(&format!("{follower} follows {candidate} now").as_str()),
        "{steps:?}"
    );
    assert_eq!(
        steps.last().copied(),
        Some(format!("{candidate} promoted; writes go to it now").as_str())
    );
    // The stopped primary's checks fail as refused connections, and say so.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let nodes = rows(&admin, "SHOW NODES").await.unwrap();
        let pg1 = nodes.iter().find(|r| field(r, "name") == "pg1").unwrap();
        if field(pg1, "last_error_kind") == "refused" {
            assert!(!field(pg1, "last_error").is_empty(), "{pg1:?}");
            break;
        }
        assert!(Instant::now() < deadline, "{pg1:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let cluster = rows(&admin, "SHOW CLUSTER").await.unwrap();
    assert_eq!(field(&cluster[0], "elected"), candidate, "{cluster:?}");
    assert_eq!(field(&cluster[0], "fenced"), "pg1", "{cluster:?}");
    assert_eq!(field(&cluster[0], "epoch"), "1", "{cluster:?}");

    // Writes go to the new primary; the acknowledged one is there; the follower gets them.
    let new_port = env.cluster.node(candidate).port.to_string();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let attempt = async {
            let c = try_connect(&env.app_url()).await?;
            c.batch_execute("INSERT INTO acked VALUES (2)").await?;
            first_value(&c, "/* pgherd:primary */ SELECT current_setting('port')").await
        };
        match attempt.await {
            Ok(port) => {
                assert_eq!(port, new_port);
                break;
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("write after PROMOTE: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no write after PROMOTE: {e}\n{}", env.pgherd.log()),
        }
    }
    let c = env.app().await;
    assert_eq!(
        first_value(&c, "SELECT count(*) FROM acked").await.unwrap(),
        "2"
    );
    wait_until(
        &env,
        "the follower replayed the write after PROMOTE",
        Duration::from_secs(30),
        || {
            env.cluster
                .node(follower)
                .psql(APP, "SELECT count(*) FROM acked WHERE id = 2")
                .map(|s| s == "1")
                .unwrap_or(false)
        },
    );

    // The old primary restarts writable on its own: fenced, it gets nothing and is sealed,
    // with failover off too.
    old.start(Duration::from_secs(30)).expect("restart pg1");
    wait_sealed(&env, old);
    let err = admin.simple_query("PROMOTE pg1").await.expect_err("fenced");
    assert!(
        message(&err).contains("fenced") || message(&err).contains("not a replica"),
        "{err}"
    );
    for _ in 0..10 {
        let port = first_value(&c, "/* pgherd:primary */ SELECT current_setting('port')")
            .await
            .unwrap();
        assert_eq!(port, new_port);
    }
}
