//! The admin console against a real cluster: every SHOW, the commands that steer (DETACH,
//! ATTACH, PAUSE, RESUME, KILL), wrong syntax and an unprivileged user, each answered with a
//! precise error on a connection that stays usable.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};
use tokio_postgres::{Client, SimpleQueryMessage};

/// Rows as column-name → value maps.
async fn node_row(admin: &Client, name: &str) -> Vec<(String, String)> {
    rows(admin, "SHOW NODES")
        .await
        .expect("SHOW NODES")
        .into_iter()
        .find(|r| field(r, "name") == name)
        .expect("the node is listed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_with_its_errors() {
    let env = env(1, |c| {
        c.superuser()
            .manage_nodes()
            .mode("transaction")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
            .proxy(&format!("stats_users = [\"{APP}\"]"))
    });
    let admin = connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    let stats = connect(&env.pgherd.conninfo(APP, APP_PASSWORD, "pgherd")).await;
    let app = env.app().await;
    first_value(&app, "SELECT 1").await.expect("a query");

    // Every SHOW answers with its columns, for admins and stats users alike.
    for (command, column) in [
        ("SHOW NODES", "in_read_set"),
        ("SHOW CLUSTER", "write_gate"),
        ("SHOW POOLS", "sv_idle"),
        ("SHOW STATS", "total_xact_count"),
        ("SHOW LISTS", "items"),
        ("SHOW CLIENTS", "addr"),
        ("SHOW SERVERS", "backend_pid"),
        ("SHOW CONFIG", "value"),
        ("SHOW EVENTS", "kind"),
        ("SHOW VERSION", "version"),
        ("SHOW HELP", "command"),
    ] {
        for who in [&admin, &stats] {
            let messages = who
                .simple_query(command)
                .await
                .unwrap_or_else(|e| panic!("{command}: {e}"));
            let found = messages.iter().any(|m| match m {
                SimpleQueryMessage::RowDescription(cols) => cols.iter().any(|c| c.name() == column),
                _ => false,
            });
            assert!(found, "{command} has no column {column}");
        }
    }
    let stats_rows = rows(&admin, "SHOW STATS").await.unwrap();
    assert!(
        stats_rows
            .iter()
            .any(|r| field(r, "database") == APP && field(r, "total_query_count") != "0"),
        "{stats_rows:?}"
    );
    // The app's server connection, idle in its pool now, with its backend's pid.
    let servers = rows(&admin, "SHOW SERVERS").await.unwrap();
    assert!(
        servers.iter().any(|r| field(r, "database") == APP
            && field(r, "state") == "idle"
            && field(r, "backend_pid").parse::<i32>().is_ok_and(|p| p > 0)),
        "{servers:?}"
    );
    let lists = rows(&admin, "SHOW LISTS").await.unwrap();
    let clients = lists
        .iter()
        .find(|r| field(r, "list") == "clients")
        .expect("clients");
    assert_eq!(
        field(clients, "items"),
        "3",
        "admin, stats and app: {lists:?}"
    );

    // Errors: precise, and the connection stays usable.
    for (command, code, needle) in [
        ("FROBNICATE", "42601", "unknown admin command"),
        ("DETACH", "42601", "DETACH node"),
        ("PAUSE a b", "42601", "PAUSE [db]"),
        ("SHOW NOTHING", "42601", "SHOW HELP|VERSION"),
        ("DETACH nosuch", "42704", "nosuch"),
        ("DETACH pg1", "55000", "takes the writes"),
        ("KILL", "42601", "KILL db"),
        ("RESUME", "55000", "not paused"),
    ] {
        let err = admin.simple_query(command).await.expect_err(command);
        let db = err
            .as_db_error()
            .unwrap_or_else(|| panic!("{command}: {err}"));
        assert_eq!(db.code().code(), code, "{command}: {db:?}");
        let text = format!("{} {}", db.message(), db.hint().unwrap_or(""));
        assert!(text.contains(needle), "{command}: {text}");
    }
    for command in [
        "DETACH pg2",
        "PAUSE",
        "RESUME",
        "KILL app",
        "RELOAD",
        "SHUTDOWN",
    ] {
        let err = stats.simple_query(command).await.expect_err(command);
        assert_eq!(code(&err), "42501", "{command} by a stats user: {err}");
    }
    assert_eq!(rows(&stats, "SHOW VERSION").await.unwrap().len(), 1);

    // DETACH: reads stop going to the replica; ATTACH brings them back.
    let primary_port = env.cluster.primary().port.to_string();
    let replica_port = env.cluster.node("pg2").port.to_string();
    let steps = rows(&admin, "DETACH pg2").await.expect("DETACH pg2");
    assert!(
        field(&steps[0], "step").contains("pg2 detached"),
        "{steps:?}"
    );
    assert_eq!(field(&node_row(&admin, "pg2").await, "state"), "detached");
    let cluster = rows(&admin, "SHOW CLUSTER").await.expect("SHOW CLUSTER");
    assert_eq!(field(&cluster[0], "detached"), "pg2", "{cluster:?}");
    assert_eq!(field(&cluster[0], "writer"), "pg1", "{cluster:?}");
    assert_eq!(field(&cluster[0], "write_gate"), "open", "{cluster:?}");
    assert_eq!(field(&node_row(&admin, "pg1").await, "write_gate"), "open");
    let detached_at: u64 = field(&cluster[0], "version").parse().unwrap();
    for _ in 0..20 {
        let port = first_value(&app, "/* pgherd:replica */ SELECT current_setting('port')")
            .await
            .expect("a read while pg2 is detached");
        assert_eq!(port, primary_port, "a read reached the detached replica");
    }
    let err = admin
        .simple_query("SWITCHOVER TO pg2")
        .await
        .expect_err("switch to detached");
    assert_eq!(code(&err), "55000", "{err}");
    rows(&admin, "ATTACH pg2").await.expect("ATTACH pg2");
    let mut back = false;
    for _ in 0..100 {
        let port = first_value(&app, "/* pgherd:replica */ SELECT current_setting('port')")
            .await
            .expect("a read after ATTACH");
        if port == replica_port {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back, "reads did not return to pg2 after ATTACH");
    let events = rows(&admin, "SHOW EVENTS").await.unwrap();
    for kind in ["detached", "attached"] {
        assert!(
            events.iter().any(|r| field(r, "kind") == kind),
            "{events:?}"
        );
    }

    // PAUSE waits for the running transaction; new ones wait until RESUME.
    app.batch_execute("BEGIN; SELECT 1")
        .await
        .expect("open a transaction");
    let pause_done = Arc::new(AtomicBool::new(false));
    let pausing = {
        let url = env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd");
        let done = pause_done.clone();
        tokio::spawn(async move {
            let admin = connect(&url).await;
            let result = admin.simple_query(&format!("PAUSE {APP}")).await;
            done.store(true, Ordering::SeqCst);
            result.map(|_| ())
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !pause_done.load(Ordering::SeqCst),
        "PAUSE returned while a transaction still ran"
    );
    app.batch_execute("COMMIT").await.expect("commit");
    pausing
        .await
        .unwrap()
        .expect("PAUSE completes once the transaction ended");
    let other = env.app().await;
    let resumed = Arc::new(AtomicBool::new(false));
    let waiting = {
        let resumed = resumed.clone();
        tokio::spawn(async move {
            let value = first_value(&other, "SELECT 'ran'").await;
            (resumed.load(Ordering::SeqCst), value)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "a query ran while the database was paused"
    );
    resumed.store(true, Ordering::SeqCst);
    rows(&admin, &format!("RESUME {APP}"))
        .await
        .expect("RESUME");
    let (after_resume, value) = waiting.await.unwrap();
    assert!(after_resume);
    assert_eq!(value.expect("the held query runs after RESUME"), "ran");

    // PAUSE of everything is the write gate's reason, in the view, SHOW NODES and /ready's
    // words; every change counted a version.
    rows(&admin, "PAUSE").await.expect("PAUSE");
    let cluster = rows(&admin, "SHOW CLUSTER").await.unwrap();
    assert_eq!(field(&cluster[0], "write_gate"), "held", "{cluster:?}");
    assert_eq!(field(&cluster[0], "gate_reason"), "paused", "{cluster:?}");
    assert_eq!(field(&cluster[0], "paused"), "*", "{cluster:?}");
    assert_eq!(
        field(&node_row(&admin, "pg1").await, "write_gate"),
        "held: the operator paused all databases"
    );
    let paused_at: u64 = field(&cluster[0], "version").parse().unwrap();
    // ATTACH, PAUSE app, RESUME app, PAUSE: at least four changes since DETACH (the
    // synchronous standby keeper may have made more).
    assert!(paused_at >= detached_at + 4, "{cluster:?}");
    rows(&admin, "RESUME").await.expect("RESUME");
    let cluster = rows(&admin, "SHOW CLUSTER").await.unwrap();
    assert_eq!(field(&cluster[0], "write_gate"), "open", "{cluster:?}");
    assert_eq!(field(&cluster[0], "paused"), "", "{cluster:?}");

    // KILL ends the database's sessions, and what they run on the server (a read, on
    // whichever node ran it); new ones work.
    let sleeper = env.app().await;
    let asleep =
        tokio::spawn(async move { first_value(&sleeper, "SELECT pg_sleep(30)::text").await });
    let sleeping = || {
        ["pg1", "pg2"]
            .iter()
            .map(|node| {
                env.cluster.sql_on(
                    node,
                    APP,
                    "SELECT count(*) FROM pg_stat_activity \
                     WHERE query = 'SELECT pg_sleep(30)::text' AND state = 'active'",
                )
            })
            .filter(|count| count != "0")
            .count()
    };
    wait_until(&env, "the sleep started", Duration::from_secs(10), || {
        sleeping() == 1
    });
    rows(&admin, &format!("KILL {APP}")).await.expect("KILL");
    let killed = asleep.await.unwrap().expect_err("the sleep was killed");
    assert!(
        killed.code().is_some_and(|c| c.code() == "57P01"),
        "{killed}"
    );
    wait_until(
        &env,
        "the killed sleep stopped on the server",
        Duration::from_secs(10),
        || sleeping() == 0,
    );
    let err = first_value(&app, "SELECT 1")
        .await
        .expect_err("a killed session");
    assert!(
        err.as_db_error()
            .is_some_and(|d| d.code().code() == "57P01")
            || err.is_closed(),
        "{err}"
    );
    let fresh = env.app().await;
    assert_eq!(
        first_value(&fresh, "SELECT 'again'").await.unwrap(),
        "again"
    );
    assert_eq!(rows(&admin, "SHOW VERSION").await.unwrap().len(), 1);
}

/// DETACH and PAUSE are kept in the state file and come back after a restart; a state file
/// that cannot be parsed stops pgherd with the place and the reason.
/// A request that was already waiting for a server connection when PAUSE came (the pool was
/// full) does not start its transaction once PAUSE has said none runs: the connection it gets
/// goes back and it waits for RESUME. (Before, it ran on the connection the finishing
/// transaction freed, after PAUSE's drain had begun: `shard move` refuses writes on the old
/// copy at that moment, so such a transaction failed with 25006.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_before_pause_waits_for_resume() {
    let env = env(0, |c| {
        c.superuser()
            .mode("transaction")
            .max_size(1)
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    let admin_url = env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd");
    let holder = env.app().await;
    holder
        .batch_execute("BEGIN; SELECT 1")
        .await
        .expect("the only server connection is taken");
    let queued = {
        let client = env.app().await;
        tokio::spawn(async move { first_value(&client, "SELECT 'queued'").await })
    };
    let admin = connect(&admin_url).await;
    pause_with_a_queued_request(admin, &format!("PAUSE {APP}"), &holder, &queued).await;
    let admin = connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    rows(&admin, &format!("RESUME {APP}"))
        .await
        .expect("RESUME");
    assert_eq!(
        queued
            .await
            .unwrap()
            .expect("the queued request runs after RESUME"),
        "queued"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_and_pause_survive_a_restart() {
    let mut env = env(1, |c| {
        c.superuser()
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    let console = env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd");
    let admin = connect(&console).await;
    rows(&admin, "DETACH pg2").await.expect("DETACH");
    rows(&admin, &format!("PAUSE {APP}")).await.expect("PAUSE");
    let state_file = env
        .pgherd
        .config_path
        .parent()
        .unwrap()
        .join("pgherd.state.json");
    let kept = std::fs::read_to_string(&state_file).expect("the state file is written");
    assert!(
        kept.contains("\"pg2\"") && kept.contains("\"app\""),
        "{kept}"
    );
    drop(admin);

    env.pgherd.restart();
    let admin = connect(&console).await;
    let cluster = rows(&admin, "SHOW CLUSTER").await.unwrap();
    assert_eq!(field(&cluster[0], "detached"), "pg2", "{cluster:?}");
    assert_eq!(field(&cluster[0], "paused"), APP, "{cluster:?}");
    assert_eq!(field(&node_row(&admin, "pg2").await, "state"), "detached");
    assert!(
        env.pgherd.log().contains("operator levers restored"),
        "{}",
        env.pgherd.log()
    );
    // Still paused: a query of the database waits until RESUME.
    let app = env.app().await;
    let waiting = tokio::spawn(async move { first_value(&app, "SELECT 'ran'").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "a query ran in a paused database");
    rows(&admin, &format!("RESUME {APP}"))
        .await
        .expect("RESUME");
    assert_eq!(waiting.await.unwrap().expect("runs after RESUME"), "ran");
    rows(&admin, "ATTACH pg2").await.expect("ATTACH");
    let kept = std::fs::read_to_string(&state_file).unwrap();
    assert!(!kept.contains("pg2") && !kept.contains("\"app\""), "{kept}");
    drop(admin);

    std::fs::write(&state_file, "{\n  \"detached\": [\"pg2\",]\n}\n").unwrap();
    let status = env.pgherd.restart_refused();
    assert!(!status.success());
    let log = env.pgherd.log();
    let place = format!("{}:2:", state_file.display());
    assert!(
        log.contains(&place) && log.contains("the state file is not valid"),
        "{log}"
    );
}

/// The cluster password from a file and a user's server password from the environment: pgherd
/// checks the nodes and logs in with them, and SHOW CONFIG shows neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_from_a_file_and_the_environment() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let password_file = dir.path().join("cluster.password");
    std::fs::write(&password_file, format!("{SUPERUSER_PASSWORD}\n")).unwrap();
    std::fs::set_permissions(&password_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    // Only this test reads this variable; pgherd inherits it.
    std::env::set_var("PGHERD_TEST_SUPERUSER_PASSWORD", SUPERUSER_PASSWORD);
    let verifier = pgherd_wire::scram::ScramVerifier::from_password(
        SUPERUSER_PASSWORD,
        b"pgherd-test-salt",
        4096,
    );
    let env = env(1, |c| {
        c.cluster_password(&format!("password_file = \"{}\"", password_file.display()))
            .user(
                SUPERUSER,
                &verifier,
                "server_password_env = \"PGHERD_TEST_SUPERUSER_PASSWORD\"",
            )
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    let admin = connect(&env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")).await;
    for name in ["pg1", "pg2"] {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let row = node_row(&admin, name).await;
            if field(&row, "state") == "up" {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{row:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // The superuser's server login uses the password from the environment.
    let postgres = connect(
        &env.pgherd
            .conninfo(SUPERUSER, SUPERUSER_PASSWORD, "postgres"),
    )
    .await;
    assert_eq!(
        first_value(&postgres, "SELECT current_user").await.unwrap(),
        SUPERUSER
    );
    let config = rows(&admin, "SHOW CONFIG").await.unwrap();
    assert!(
        !format!("{config:?}").contains(SUPERUSER_PASSWORD),
        "{config:?}"
    );
}

/// RECONNECT closes idle server connections at once and lent ones when released; WAIT_CLOSE
/// returns when none is left; SHOW DATABASES and SHOW USERS describe the config without
/// secrets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_wait_close_and_the_config_views() {
    let env = env(1, |c| {
        c.superuser()
            .mode("transaction")
            .proxy(&format!("admin_users = [\"{SUPERUSER}\"]"))
    });
    let console = env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd");
    let admin = connect(&console).await;
    let app = env.app().await;
    // One connection held inside a transaction, another idle in the pool.
    let holder = env.app().await;
    holder.batch_execute("BEGIN").await.unwrap();
    let held_pid = primary_pid(&holder).await;
    let idle_pid = primary_pid(&app).await;
    assert_ne!(idle_pid, held_pid);

    let steps = rows(&admin, &format!("RECONNECT {APP}"))
        .await
        .expect("RECONNECT");
    // At least the transaction's connection is in use (counted per pool, replicas included).
    assert!(
        field(&steps[0], "step").contains(" in use close when released")
            && !field(&steps[0], "step").contains("; 0 in use"),
        "{steps:?}"
    );
    // The idle connection is gone from the server at once.
    let gone = |pid: String| {
        let env = &env;
        move || {
            env.direct(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}"
            )) == "0"
        }
    };
    wait_until(
        &env,
        "the idle connection closed",
        Duration::from_secs(10),
        gone(idle_pid.clone()),
    );
    let waiting = tokio::spawn(async move {
        let admin = connect(&console).await;
        rows(&admin, &format!("WAIT_CLOSE {APP}")).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "WAIT_CLOSE returned while a connection was in use"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let steps = waiting.await.unwrap().expect("WAIT_CLOSE");
    assert!(
        field(&steps[0], "step").starts_with("no server connection"),
        "{steps:?}"
    );
    wait_until(
        &env,
        "the released connection closed",
        Duration::from_secs(10),
        gone(held_pid.clone()),
    );
    // New transactions get new connections.
    let fresh = primary_pid(&app).await;
    assert!(fresh != idle_pid && fresh != held_pid);
    let events = rows(&admin, "SHOW EVENTS").await.unwrap();
    assert!(
        events.iter().any(|e| field(e, "kind") == "reconnect"),
        "{events:?}"
    );

    let databases = rows(&admin, "SHOW DATABASES")
        .await
        .expect("SHOW DATABASES");
    // The test config serves every database through its wildcard entry.
    let served = databases
        .iter()
        .find(|r| field(r, "name") == "*")
        .unwrap_or_else(|| panic!("{databases:?}"));
    assert_eq!(field(served, "pool_mode"), "transaction");
    assert_eq!(field(served, "paused"), "no");
    assert!(
        field(served, "clients").parse::<u32>().unwrap() >= 2,
        "{served:?}"
    );
    assert!(
        field(served, "server_connections").parse::<u32>().unwrap() >= 1,
        "{served:?}"
    );
    let users = rows(&admin, "SHOW USERS").await.expect("SHOW USERS");
    let user = |name: &str| {
        users
            .iter()
            .find(|r| field(r, "name") == name)
            .unwrap_or_else(|| panic!("{users:?}"))
            .clone()
    };
    assert_eq!(field(&user(APP), "verifier"), "scram-sha-256");
    assert_eq!(field(&user(SUPERUSER), "has_server_password"), "yes");
    assert!(!format!("{users:?}").contains(SUPERUSER_PASSWORD));
    // SHOW STATS counts the traffic and estimates latency per pool.
    let stats = rows(&admin, "SHOW STATS").await.expect("SHOW STATS");
    let busy = stats
        .iter()
        .find(|r| field(r, "database") == APP && field(r, "total_xact_count") != "0")
        .unwrap_or_else(|| panic!("{stats:?}"));
    for column in [
        "bytes_to_servers",
        "bytes_to_clients",
        "xact_p50_us",
        "xact_p99_us",
    ] {
        let value: u64 = field(busy, column).parse().unwrap_or(0);
        assert!(value > 0, "{column}: {busy:?}");
    }
    let err = admin
        .simple_query("RECONNECT a b")
        .await
        .expect_err("wrong syntax");
    assert_eq!(code(&err), "42601", "{err}");
}

async fn primary_pid(c: &Client) -> String {
    first_value(c, "/* pgherd:primary */ SELECT pg_backend_pid()")
        .await
        .expect("pid")
}
