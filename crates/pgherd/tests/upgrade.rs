//! Upgrading pgherd's binary (`UPGRADE` on the console, what `pgherd upgrade` and SIGUSR2 do):
//! under pgbench load (simple and prepared protocol, transaction and session mode) no
//! transaction fails and no client is dropped; a client's session (settings, prepared
//! statement, cancel key) carries on in the new process, one inside a transaction moves when
//! it commits; one pinned to its server and one in session mode carry on with their server
//! connection (the same backend: temporary table, session lock and statements still there);
//! one on TLS (whose keys stay in the old process's TLS library) is told why it must
//! reconnect, and can; the old process exits by itself. A server connection through a node's
//! Unix-domain socket moves too. A new process that cannot start changes nothing.

mod common;

use std::time::Duration;

use common::cache::console_conninfo;
use common::*;
use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};

/// The environment, its TLS files, and their directory (removed when dropped).
fn upgrade_env() -> (Env, pgherd_testkit::TestCerts, tempfile::TempDir) {
    let dir = tempfile::Builder::new()
        .prefix("pgherd-upgrade-")
        .tempdir()
        .expect("a directory for the TLS files");
    let certs = pgherd_testkit::TestCerts::create(dir.path());
    let tls = format!(
        "[tls]\nmode = \"allow\"\ncert_file = \"{}\"\nkey_file = \"{}\"",
        certs.server_cert.display(),
        certs.server_key.display()
    );
    let env = env(1, |c| {
        c.superuser()
            .mode("transaction")
            .database(APP, "")
            .database("app_session", "dbname = \"app\"\nmode = \"session\"")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section(&tls)
    });
    (env, certs, dir)
}

/// psql over TLS running `script` from its standard input: what it printed, or its error.
fn psql_tls(env: &Env, certs: &pgherd_testkit::TestCerts, script: &str) -> Result<String, String> {
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        env.app_url(),
        certs.ca_file.display()
    );
    psql_tls_url(&url, script)
}

fn psql_tls_url(url: &str, script: &str) -> Result<String, String> {
    use std::io::Write;
    let mut child = std::process::Command::new(pgherd_testkit::pg_bin("psql"))
        .arg(url)
        .args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("psql");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Asks for an upgrade on the console; the new process's pid, which the test then owns.
async fn upgrade(env: &mut Env) -> Result<u32, tokio_postgres::Error> {
    upgrade_at(&mut env.pgherd).await
}

async fn upgrade_at(pgherd: &mut pgherd_testkit::Pgherd) -> Result<u32, tokio_postgres::Error> {
    let console = connect(&pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    let answer = first_value(&console, "UPGRADE").await?;
    let pid = upgrade_pid(&answer);
    pgherd.successor(pid);
    Ok(pid)
}

/// The pid of the process an upgrade started, once the log says it serves.
async fn successor_in_log(env: &mut Env) -> u32 {
    let started = std::time::Instant::now();
    loop {
        let log = env.pgherd.log();
        let line = log
            .lines()
            .find(|l| l.contains("upgrade: the new process serves"));
        if let Some(pid) = line
            .and_then(|l| l.split("pid=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|pid| pid.parse().ok())
        {
            env.pgherd.successor(pid);
            return pid;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no upgrade in the log"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every pgbench run beside the upgrade ended with no failed transaction, and the old process
/// exited by itself once its clients were gone.
fn load_ran_through_and_the_old_process_left(
    load: Vec<std::thread::JoinHandle<Result<String, String>>>,
    pgherd: &mut pgherd_testkit::Pgherd,
) {
    for run in load {
        let output = run
            .join()
            .unwrap()
            .expect("pgbench ran through the upgrade");
        assert!(
            output.contains("number of failed transactions: 0"),
            "{output}"
        );
    }
    let exited = pgherd
        .wait_exit(Duration::from_secs(30))
        .expect("the old process exits once its clients are gone");
    assert!(exited.success(), "{exited}");
}

fn alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_under_load_moves_every_client_with_its_session() {
    let (mut env, certs, _certs_dir) = upgrade_env();
    pgbench(
        &format!("{}?sslmode=disable", env.app_url()),
        &["-i", "-s", "1", "-q"],
    )
    .expect("pgbench -i");
    // Sessions that carry state: settings and a prepared statement; a transaction open when
    // the upgrade begins; a temporary table (pinned to its server).
    let app = env.app().await;
    app.batch_execute("SET statement_timeout = '123s'; SET application_name = 'mover'")
        .await
        .unwrap();
    let prepared = app
        .prepare("SELECT abalance FROM pgbench_accounts WHERE aid = $1")
        .await
        .unwrap();
    let in_tx = env.app().await;
    in_tx
        .batch_execute("CREATE TABLE moved (v int); BEGIN; INSERT INTO moved VALUES (1)")
        .await
        .unwrap();
    // Sessions whose state lives in their backend: pinned by a temporary table and a session
    // lock (transaction mode), and one in session mode with a protocol-level statement too.
    let pinned = env.app().await;
    pinned
        .batch_execute("CREATE TEMP TABLE mine (v int); SELECT pg_advisory_lock(42)")
        .await
        .unwrap();
    let pinned_backend = first_value(&pinned, "SELECT pg_backend_pid()")
        .await
        .unwrap();
    // Prepared under pgherd's own name on its server, which moves with it.
    let pinned_statement = pinned
        .prepare("SELECT count(*) FROM mine WHERE v = $1")
        .await
        .unwrap();
    pinned.query_one(&pinned_statement, &[&1i32]).await.unwrap();
    let session_url = env.pgherd.url(APP, APP_PASSWORD, "app_session");
    let in_session = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "app_session")).await;
    in_session
        .batch_execute(
            "CREATE TEMP TABLE kept (v int); INSERT INTO kept VALUES (7); SET work_mem = '7MB'",
        )
        .await
        .unwrap();
    let session_statement = in_session
        .prepare("SELECT v FROM kept WHERE v = $1")
        .await
        .unwrap();
    let session_backend = first_value(&in_session, "SELECT pg_backend_pid()")
        .await
        .unwrap();
    // A TLS client, idle across the upgrade.
    let tls_client = std::thread::spawn({
        let (env_url, ca) = (env.app_url(), certs.ca_file.clone());
        move || {
            let url = format!("{env_url}?sslmode=verify-full&sslrootcert={}", ca.display());
            let script = "SELECT 'before';\n\\! sleep 4\nSELECT 'after';\n";
            psql_tls_url(&url, script)
        }
    });
    // Plain TCP: libpq would take the TLS pgherd offers.
    let url = format!("{}?sslmode=disable", env.app_url());
    let session_url = format!("{session_url}?sslmode=disable");
    let load: Vec<_> = [
        (&url, vec!["-c", "4", "-j", "2", "-T", "8", "-M", "simple"]),
        (
            &url,
            vec!["-c", "4", "-j", "2", "-T", "8", "-M", "prepared", "-S"],
        ),
        (
            &session_url,
            vec!["-c", "2", "-j", "1", "-T", "8", "-M", "prepared", "-S"],
        ),
    ]
    .into_iter()
    .map(|(url, args)| {
        let url = url.clone();
        std::thread::spawn(move || pgbench(&url, &args))
    })
    .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let old_pid = env.pgherd.pid();
    let new_pid = upgrade(&mut env).await.expect("UPGRADE");
    assert_ne!(new_pid, old_pid);

    // The open transaction ends after the handover began; the client then moves.
    in_tx
        .batch_execute("INSERT INTO moved VALUES (2); COMMIT")
        .await
        .unwrap();
    load_ran_through_and_the_old_process_left(load, &mut env.pgherd);
    assert!(alive(new_pid));

    // The sessions carry on in the new process.
    assert_eq!(
        first_value(&app, "SHOW statement_timeout").await.unwrap(),
        "123s"
    );
    assert_eq!(
        first_value(&app, "SHOW application_name").await.unwrap(),
        "mover"
    );
    app.query_one(&prepared, &[&1i32]).await.unwrap();
    assert_eq!(
        first_value(&in_tx, "SELECT count(*) FROM moved")
            .await
            .unwrap(),
        "2"
    );
    // Its cancel key, given by the old process, still cancels.
    let cancel = app.cancel_token();
    let sleeper = tokio::spawn(async move {
        let slept = app.simple_query("SELECT pg_sleep(30)").await;
        (app, slept)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    cancel
        .cancel_query(tokio_postgres::NoTls)
        .await
        .expect("cancel request");
    let (_app, slept) = tokio::time::timeout(Duration::from_secs(10), sleeper)
        .await
        .expect("the cancel ended the sleep")
        .unwrap();
    assert_eq!(code(&slept.expect_err("cancelled")), "57014");
    // The pinned and the session-mode client carry on with the same backend, its state intact.
    assert_eq!(
        first_value(&pinned, "SELECT pg_backend_pid()")
            .await
            .unwrap(),
        pinned_backend
    );
    let counted: i64 = pinned
        .query_one(&pinned_statement, &[&1i32])
        .await
        .unwrap()
        .get(0);
    assert_eq!(counted, 0);
    assert_eq!(
        first_value(&pinned, "SELECT pg_advisory_unlock(42)::text")
            .await
            .unwrap(),
        "true",
        "the session lock is still held"
    );
    assert_eq!(
        first_value(&in_session, "SELECT pg_backend_pid()")
            .await
            .unwrap(),
        session_backend
    );
    assert_eq!(
        first_value(&in_session, "SHOW work_mem").await.unwrap(),
        "7MB"
    );
    let kept: i32 = in_session
        .query_one(&session_statement, &[&7i32])
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 7);
    assert!(
        !env.pgherd
            .log()
            .contains("the session cannot move: its session state"),
        "no pinned session was sent away"
    );
    // The TLS client could not move, and was told why; a new TLS connection works.
    let told = tls_client
        .join()
        .unwrap()
        .expect_err("the TLS session ended");
    assert!(told.contains("it uses TLS"), "{told}");
    assert_eq!(psql_tls(&env, &certs, "SELECT 'again';").unwrap(), "again");
    // The new process is the one answering.
    let console = connect(&console_conninfo(&env)).await;
    let version = first_value(&console, "SHOW VERSION").await.unwrap();
    assert!(version.contains(&format!("(pid {new_pid})")), "{version}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_that_cannot_start_changes_nothing() {
    let (mut env, _certs, _certs_dir) = upgrade_env();
    let app = env.app().await;
    app.batch_execute("SET statement_timeout = '77s'")
        .await
        .unwrap();
    // The new process reads the config file again; this one it refuses.
    let config = std::fs::read_to_string(&env.pgherd.config_path).unwrap();
    std::fs::write(
        &env.pgherd.config_path,
        format!("{config}\nthis is not TOML\n"),
    )
    .unwrap();
    let refused = upgrade(&mut env).await.expect_err("the upgrade fails");
    assert_eq!(code(&refused), "55000", "{refused:?}");
    let message = refused.as_db_error().map(|e| e.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.contains("nothing changed")),
        "{message:?}"
    );
    std::fs::write(&env.pgherd.config_path, config).unwrap();
    // The old process serves on, the session intact.
    assert!(env.pgherd.try_wait().is_none());
    assert_eq!(
        first_value(&app, "SHOW statement_timeout").await.unwrap(),
        "77s"
    );
    let fresh = env.app().await;
    assert_eq!(first_value(&fresh, "SELECT 1").await.unwrap(), "1");
    // And an upgrade works afterwards, by signal this time.
    env.pgherd.signal(libc::SIGUSR2);
    let new_pid = successor_in_log(&mut env).await;
    assert!(env.pgherd.wait_exit(Duration::from_secs(30)).is_some());
    assert!(alive(new_pid));
    assert_eq!(
        first_value(&app, "SHOW statement_timeout").await.unwrap(),
        "77s"
    );
}

/// The primary dies as an upgrade starts: the old process stops deciding, the new one takes
/// the view and the duty and fails over; writers keep writing through it all. Every write
/// acknowledged is on the one primary left, and only one node takes writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_during_a_failover_loses_no_acknowledged_write() {
    use std::sync::{Arc, Mutex};
    let mut env = env(2, |c| {
        c.superuser()
            .manage_nodes()
            .mode("transaction")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .section("[failover]\nenabled = true")
    });
    let setup = env.app().await;
    setup
        .batch_execute("CREATE TABLE acked (id bigint PRIMARY KEY)")
        .await
        .unwrap();
    let acked = Arc::new(Mutex::new(Vec::<i64>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..4i64)
        .map(|w| {
            let (acked, stop) = (acked.clone(), stop.clone());
            let url = env.pgherd.conninfo(APP, APP_PASSWORD, APP);
            tokio::spawn(async move {
                let mut n = 0i64;
                let mut client = None;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if client.is_none() {
                        client = try_connect(&url).await.ok();
                    }
                    let Some(c) = &client else {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    let id = w * 1_000_000 + n;
                    n += 1;
                    match c
                        .batch_execute(&format!("INSERT INTO acked VALUES ({id})"))
                        .await
                    {
                        Ok(()) => acked.lock().unwrap().push(id),
                        // A write cut by the failover: unacknowledged, allowed to be lost.
                        Err(e) if e.is_closed() => client = None,
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    env.cluster
        .node("pg1")
        .stop(pgherd_cluster::StopMode::Immediate)
        .expect("kill pg1");
    let new_pid = upgrade(&mut env)
        .await
        .expect("UPGRADE while the primary is dead");
    assert!(
        env.pgherd.wait_exit(Duration::from_secs(30)).is_some(),
        "the old process exits"
    );
    // Writes resume on a promoted replica, through the new process.
    let before = acked.lock().unwrap().len();
    let started = std::time::Instant::now();
    while acked.lock().unwrap().len() < before + 50 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "writes did not resume after the failover:\n{}",
            env.pgherd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    assert!(alive(new_pid));
    let primaries: Vec<&str> = ["pg2", "pg3"]
        .into_iter()
        .filter(|n| {
            env.cluster
                .sql_on(n, "postgres", "SELECT pg_is_in_recovery()")
                == "f"
        })
        .collect();
    assert_eq!(primaries.len(), 1, "one node takes writes: {primaries:?}");
    let acked = acked.lock().unwrap().clone();
    let on_primary = rows_present(&env.cluster, primaries[0], "acked", &acked);
    assert_eq!(on_primary, acked.len(), "acknowledged writes lost");
    let log = env.pgherd.log();
    assert!(log.contains("promoting"), "nobody failed over");
    // Writers waiting in the old process for a primary moved, their requests unsent, rather
    // than waiting there for the deadline.
    assert!(
        log.contains("holds no more clients it can keep; stopping clients_left=0"),
        "{log}"
    );
}

/// The new process dies after it took over, while the old one still holds a client in a
/// transaction: the old one takes its duties back (accepts, decides, answers operator
/// commands), keeps that client, and does not exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_whose_new_process_dies_is_undone() {
    let (mut env, _certs, _certs_dir) = upgrade_env();
    let old_pid = env.pgherd.pid();
    let in_tx = env.app().await;
    in_tx
        .batch_execute("CREATE TABLE kept (v int); BEGIN; INSERT INTO kept VALUES (1)")
        .await
        .unwrap();
    let new_pid = upgrade(&mut env).await.expect("UPGRADE");
    // SAFETY: kill(2) on the process the upgrade started.
    unsafe { libc::kill(new_pid as i32, libc::SIGKILL) };
    let started = std::time::Instant::now();
    while !env.pgherd.log().contains("upgrade undone") {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the old process did not take its duties back:\n{}",
            env.pgherd.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let console = connect(&console_conninfo(&env)).await;
    let version = first_value(&console, "SHOW VERSION").await.unwrap();
    assert!(version.contains(&format!("(pid {old_pid})")), "{version}");
    // Operator commands run here again (they were refused while handing over).
    console
        .simple_query("DETACH pg2")
        .await
        .expect("DETACH after the upgrade was undone");
    console.simple_query("ATTACH pg2").await.expect("ATTACH");
    let app = env.app().await;
    assert_eq!(first_value(&app, "SELECT 1").await.unwrap(), "1");
    // The client in its transaction stays here and finishes it.
    in_tx
        .batch_execute("INSERT INTO kept VALUES (2); COMMIT")
        .await
        .unwrap();
    assert_eq!(
        first_value(&in_tx, "SELECT count(*) FROM kept")
            .await
            .unwrap(),
        "2"
    );
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(env.pgherd.try_wait().is_none(), "the old process stopped");
}

/// A sharded endpoint (two one-node shards) upgraded under pgbench reads and writes of a
/// sharded table: its sessions move between statements with their settings and prepared
/// statements, one in a transaction over both shards when it commits; no transaction fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_endpoint_is_upgraded_with_its_sessions() {
    let shards = [shard_cluster(), shard_cluster()];
    let config = sharded_config(&shards, &[("items", "k")])
        .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"));
    let mut pgherd = pgherd_testkit::Pgherd::start(BIN, &shards[0], &config);
    let client = connect_as_superuser(pgherd.port, "postgres").await;
    let rows: Vec<String> = (1..=100).map(|k| format!("({k}, 0)")).collect();
    client
        .batch_execute(&format!(
            "CREATE TABLE items (k int PRIMARY KEY, v int NOT NULL); \
             INSERT INTO items (k, v) VALUES {}",
            rows.join(", ")
        ))
        .await
        .unwrap();
    client
        .batch_execute("SET application_name = 'sharded-mover'")
        .await
        .unwrap();
    let prepared = client
        .prepare("SELECT v FROM items WHERE k = $1")
        .await
        .unwrap();
    // A transaction over both shards, open when the upgrade begins.
    let in_tx = connect_as_superuser(pgherd.port, "postgres").await;
    in_tx
        .batch_execute("BEGIN; UPDATE items SET v = v + 1000")
        .await
        .unwrap();

    let dir = tempfile::tempdir().unwrap();
    let read = dir.path().join("read.sql");
    std::fs::write(
        &read,
        "\\set k random(1, 100)\nSELECT v FROM items WHERE k = :k;\n",
    )
    .unwrap();
    let write = dir.path().join("write.sql");
    std::fs::write(
        &write,
        "\\set k random(1, 100)\nUPDATE items SET v = v + 1 WHERE k = :k;\n",
    )
    .unwrap();
    let url = format!(
        "{}?sslmode=disable",
        pgherd.url(SUPERUSER, SUPERUSER_PASSWORD, "postgres")
    );
    let load: Vec<_> = [(read.clone(), "prepared"), (write.clone(), "simple")]
        .into_iter()
        .map(|(script, protocol)| {
            let url = url.clone();
            std::thread::spawn(move || {
                let script = script.display().to_string();
                pgbench(
                    &url,
                    &[
                        "-n", "-c", "3", "-j", "1", "-T", "8", "-M", protocol, "-f", &script,
                    ],
                )
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let old_pid = pgherd.pid();
    let new_pid = upgrade_at(&mut pgherd).await.expect("UPGRADE");
    assert_ne!(new_pid, old_pid);
    in_tx.batch_execute("COMMIT").await.unwrap();
    load_ran_through_and_the_old_process_left(load, &mut pgherd);
    assert!(alive(new_pid));
    // Every client moved: pgbench's six, the idle one and the one in a transaction.
    let log = pgherd.log();
    assert_eq!(
        log.matches("sharded client moved here from the old process")
            .count(),
        8,
        "{log}"
    );
    assert!(!log.contains("could not move"), "{log}");

    // The sessions carry on in the new process.
    assert_eq!(
        first_value(&client, "SHOW application_name").await.unwrap(),
        "sharded-mover"
    );
    let v: i32 = client.query_one(&prepared, &[&7i32]).await.unwrap().get(0);
    assert!(v >= 1000, "the committed transaction's write is there: {v}");
    assert_eq!(
        first_value(&in_tx, "SELECT count(*) FROM items WHERE v >= 1000")
            .await
            .unwrap(),
        "100"
    );
    let console = connect(&pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    let version = first_value(&console, "SHOW VERSION").await.unwrap();
    assert!(version.contains(&format!("(pid {new_pid})")), "{version}");
}

/// A session-mode client whose server connection goes through the node's Unix-domain socket
/// carries on with that connection in the new process (the same backend, its temporary
/// table), and a cancel sent after the upgrade still reaches the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_connection_through_a_unix_socket_moves_with_its_session() {
    let mut env = env_on_sockets(0, |c| {
        c.superuser()
            .mode("session")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    let c = env.app().await;
    c.batch_execute("CREATE TEMP TABLE kept (v int); INSERT INTO kept VALUES (7)")
        .await
        .unwrap();
    let backend = first_value(&c, "SELECT pg_backend_pid()").await.unwrap();
    let old = env.pgherd.pid();
    let new = upgrade(&mut env).await.expect("UPGRADE");
    assert_ne!(old, new);

    assert_eq!(first_value(&c, "SELECT v FROM kept").await.unwrap(), "7");
    assert_eq!(
        first_value(&c, "SELECT pg_backend_pid()").await.unwrap(),
        backend
    );
    assert_eq!(
        first_value(&c, "SELECT inet_client_addr() IS NULL")
            .await
            .unwrap(),
        "t"
    );
    let exited = env
        .pgherd
        .wait_exit(Duration::from_secs(30))
        .expect("the old process exits once its clients are gone");
    assert!(exited.success(), "{exited}");

    cancel_ends_a_sleep(c).await;
}
