//! Issue 17, attacked as a hostile or careless logged-in user would: no statement may take
//! pgherd down, leak session state to another client, poison the shared routing cache, send a
//! write to a replica or make pgherd hold unbounded memory; logins and cancels are throttled;
//! unauthenticated sockets and idle HTTP clients cannot lock anyone out.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use common::*;
use pgherd_testkit::raw::{errors, first_column, RawClient};
use pgherd_wire::frontend;
use tokio_postgres::Client;

fn rss_kib(pid: u32) -> u64 {
    common::proc_status_kib(pid, "VmRSS")
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// The tenant a row inserted now gets from the session's `app.tenant_id`.
async fn tenant_of_new_row(c: &Client) -> String {
    first_value(
        c,
        "INSERT INTO leak DEFAULT VALUES RETURNING coalesce(tenant, '<null>')",
    )
    .await
    .unwrap()
}

fn sqlstate(e: &tokio_postgres::Error) -> String {
    e.code().map(|c| c.code().to_owned()).unwrap_or_default()
}

/// A query too deep for any parser: pgherd stays up, PostgreSQL answers 54001, and other
/// clients never notice. 65,535 terms is the report; 1 MB of nesting is the bound asked for.
#[test]
fn deeply_nested_queries_do_not_take_pgherd_down() {
    let env = env(1, |c| c);
    let port = env.pgherd.port;
    let mut bystander = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let mut attacker = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let terms_65535 = format!("SELECT {};", vec!["1"; 65_535].join("+"));
    let one_megabyte = format!("SELECT {};", vec!["1"; 512 << 10].join("+"));
    for (name, sql) in [("65535 terms", terms_65535), ("1 MB", one_megabyte)] {
        let answer = attacker.query(&sql);
        let errs = errors(&answer);
        assert_eq!(errs.len(), 1, "{name}: {answer:?}");
        assert_eq!(errs[0].code.code(), "54001", "{name}: {}", errs[0]);
        assert_eq!(first_column(&bystander.query("SELECT 'alive'")), ["alive"]);
    }
    // Deep in a prepared statement too, and in a function call's arguments.
    let deep_call = format!(
        "SELECT abs({}1{})",
        "abs(".repeat(20_000),
        ")".repeat(20_000)
    );
    let answer = attacker.query(&deep_call);
    assert!(!errors(&answer).is_empty(), "{answer:?}");
    assert_eq!(
        first_column(&attacker.query("SELECT 'still here'")),
        ["still here"]
    );
    assert!(!env.pgherd.log().contains("overflowed its stack"));
}

/// Session state made by any statement (set_config, DO blocks, functions) stays with the
/// client that made it, in transaction mode, and no later client of the pool sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_state_never_leaks_to_the_next_client() {
    // Two server connections per pool: every later client lands on one the earlier used.
    let env = env(1, |c| c.max_size(2));
    env.direct(
        "CREATE TABLE leak (id serial, tenant text DEFAULT current_setting('app.tenant_id', true)); \
         GRANT ALL ON leak TO app; GRANT ALL ON SEQUENCE leak_id_seq TO app; \
         CREATE FUNCTION set_tenant(t text) RETURNS void LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM set_config('app.tenant_id', t, false); END $$; \
         CREATE VIEW tenant_view AS SELECT set_config('app.tenant_id', '77', false) AS t, \
           set_config('search_path', 'pg_catalog, public', false) AS p; \
         GRANT SELECT ON tenant_view TO app",
    );
    env.cluster.wait_replayed();

    // set_config for the session, directly and inside a user function.
    for setter in [
        "SELECT set_config('app.tenant_id', '42', false)",
        "SELECT set_tenant('42')",
    ] {
        let a = env.app().await;
        first_value(&a, setter).await.unwrap();
        // The client keeps its own setting in its later transactions, wherever they run.
        for _ in 0..3 {
            assert_eq!(tenant_of_new_row(&a).await, "42", "{setter}");
        }
        drop(a);
        for _ in 0..10 {
            let b = env.app().await;
            let tenant = tenant_of_new_row(&b).await;
            assert!(
                tenant == "<null>" || tenant.is_empty(),
                "{setter}: the next client wrote tenant {tenant:?}"
            );
        }
    }

    // search_path and statement_timeout through set_config: 10 of 10 later clients see the
    // defaults; the client itself keeps its values.
    let a = env.app().await;
    first_value(&a, "SELECT set_config('search_path', 'tenant_7, public', false), set_config('statement_timeout', '1234', false)").await.unwrap();
    assert_eq!(
        first_value(&a, "SHOW statement_timeout").await.unwrap(),
        "1234ms"
    );
    assert_eq!(
        first_value(&a, "SHOW search_path").await.unwrap(),
        "tenant_7, public"
    );
    let mut later = Vec::new();
    for _ in 0..10 {
        let b = env.app().await;
        later.push((
            first_value(&b, "SELECT current_setting('statement_timeout')")
                .await
                .unwrap(),
            first_value(&b, "SELECT current_setting('search_path')")
                .await
                .unwrap(),
        ));
    }
    assert!(
        later
            .iter()
            .all(|(t, p)| t == "0" && p == "\"$user\", public"),
        "later clients saw {later:?}"
    );
    assert_eq!(
        first_value(&a, "SHOW statement_timeout").await.unwrap(),
        "1234ms"
    );
    drop(a);

    // A setting whose name is a bind parameter: its client keeps it in every later
    // transaction (on whichever server), and no later client sees it.
    let a = env.app().await;
    a.query("SELECT set_config($1, $2, false)", &[&"app.bound", &"7"])
        .await
        .unwrap();
    let bound = "SELECT coalesce(current_setting('app.bound', true), '')";
    for _ in 0..4 {
        assert_eq!(first_value(&a, bound).await.unwrap(), "7");
        a.batch_execute("BEGIN; SELECT 1 FROM leak LIMIT 1; COMMIT")
            .await
            .unwrap();
    }
    let mut later = Vec::new();
    for _ in 0..6 {
        let b = env.app().await;
        later.push(first_value(&b, bound).await.unwrap());
    }
    assert!(
        later.iter().all(String::is_empty),
        "later clients saw {later:?}"
    );
    assert_eq!(first_value(&a, bound).await.unwrap(), "7");
    drop(a);

    // The same through a view that calls set_config (PostgreSQL records no dependency on a
    // built-in function), read inside a transaction and alone: its reader keeps the settings,
    // no later client sees them. The catalog has read the view by now (the unknown `leak`
    // asked for a reading more than a second ago).
    for reads in [
        &["BEGIN", "SELECT t FROM tenant_view", "COMMIT"][..],
        &["SELECT t FROM tenant_view"],
    ] {
        let a = env.app().await;
        for sql in reads {
            a.batch_execute(sql).await.unwrap();
        }
        assert_eq!(tenant_of_new_row(&a).await, "77", "{reads:?}");
        drop(a);
        let mut later = Vec::new();
        for _ in 0..10 {
            let b = env.app().await;
            b.batch_execute("BEGIN").await.unwrap();
            later.push(
                first_value(
                    &b,
                    "SELECT coalesce(current_setting('app.tenant_id', true), '') || '|' || current_setting('search_path')",
                )
                .await
                .unwrap(),
            );
            b.batch_execute("COMMIT").await.unwrap();
            later.push(
                first_value(&b, "SELECT coalesce(current_setting('app.tenant_id', true), '') || '|' || current_setting('search_path')")
                    .await
                    .unwrap(),
            );
        }
        assert!(
            later.iter().all(|s| s == "|\"$user\", public"),
            "{reads:?}: later clients saw {later:?}"
        );
    }

    // A temporary table made inside DO: the client can use it (it keeps its server), nobody
    // else can read it or its rows, and it is gone when the client leaves.
    let a = env.app().await;
    a.batch_execute(
        "DO $$ BEGIN CREATE TEMP TABLE secret (x int); INSERT INTO secret VALUES (7); END $$",
    )
    .await
    .unwrap();
    assert_eq!(
        first_value(&a, "SELECT x FROM pg_temp.secret")
            .await
            .unwrap(),
        "7"
    );
    for _ in 0..4 {
        let b = env.app().await;
        let seen = b.simple_query("SELECT x FROM pg_temp.secret").await;
        assert!(
            seen.is_err(),
            "another client read the temporary table: {seen:?}"
        );
    }
    drop(a);
    tokio::time::sleep(Duration::from_millis(300)).await;
    for _ in 0..4 {
        let b = env.app().await;
        assert!(b
            .simple_query("SELECT x FROM pg_temp.secret")
            .await
            .is_err());
    }

    // A session advisory lock taken inside DO stays with its client, and goes when it leaves.
    let a = env.app().await;
    a.batch_execute("DO $$ BEGIN PERFORM pg_advisory_lock(99); END $$")
        .await
        .unwrap();
    let held_elsewhere = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() /* pgherd:primary */";
    for _ in 0..4 {
        let b = env.app().await;
        assert_eq!(first_value(&b, held_elsewhere).await.unwrap(), "0");
    }
    // Its owner still holds it (the lock did not move with a server connection).
    assert_eq!(
        env.direct("SELECT pg_try_advisory_lock(99)"),
        "f",
        "the lock was released while its owner was connected"
    );
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while env.direct("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'") != "0" {
        assert!(Instant::now() < deadline, "the lock outlived its client");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A sequence's currval is the session's own.
    let a = env.app().await;
    first_value(&a, "SELECT nextval('leak_id_seq')")
        .await
        .unwrap();
    drop(a);
    for _ in 0..4 {
        let b = env.app().await;
        let e = b
            .simple_query("SELECT currval('leak_id_seq')")
            .await
            .unwrap_err();
        assert_eq!(sqlstate(&e), "55000", "{e}");
    }
    let log = env.pgherd.log();
    assert!(!log.contains("panicked"));
    // The catalog (functions, relations, their user code) was read: the checks above relied
    // on it, not on everything being unknown.
    assert!(!log.contains("cannot load the catalog"), "{log}");
    assert!(log.contains("catalog loaded"), "{log}");
}

/// `name'\'` is an identifier and a string, not an E-string: the statement after it is part
/// of the routing cache's key, so a cached read can never route a DELETE to a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_routing_cache_cannot_be_poisoned() {
    let env = env(2, |c| c);
    env.direct("CREATE TABLE rt (id int); INSERT INTO rt SELECT generate_series(1, 10); GRANT ALL ON rt TO app");
    env.cluster.wait_replayed();
    let benign = r"SELECT name'\'                                 ; SELECT 'z'";
    let hostile = r"SELECT name'\'; DELETE FROM rt WHERE id >= 0   ; SELECT 'z'";
    assert_eq!(benign.len(), hostile.len());
    for _ in 0..3 {
        let a = env.app().await;
        a.simple_query(benign).await.unwrap();
    }
    let b = env.app().await;
    b.simple_query(hostile)
        .await
        .unwrap_or_else(|e| panic!("the DELETE was not routed to the primary: {e}"));
    assert_eq!(env.direct("SELECT count(*) FROM rt"), "0");
}

/// Writes in an extended-protocol batch after a read, BEGIN READ WRITE under a read-only
/// default, and a rolled-back read-only default: all run on the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_in_batches_and_read_write_transactions_reach_the_primary() {
    let env = env(2, |c| c);
    env.direct("CREATE TABLE w (x int); GRANT ALL ON w TO app");
    env.cluster.wait_replayed();
    let primary = env.cluster.primary().port.to_string();
    let c = env.app().await;
    // Wait until plain reads go to replicas, so the checks below mean something.
    let deadline = Instant::now() + Duration::from_secs(20);
    while first_value(&c, "SELECT current_setting('port')")
        .await
        .unwrap()
        == primary
    {
        assert!(Instant::now() < deadline, "reads never reached a replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A pipeline: a read, then an INSERT, one Sync (pgbench -M extended).
    let script = env.cluster.dir().join("pipeline.sql");
    std::fs::write(
        &script,
        "\\startpipeline\nselect 1;\ninsert into w values (1);\n\\endpipeline\n",
    )
    .unwrap();
    let out = pgbench(
        &env.app_url(),
        &[
            "-n",
            "-M",
            "extended",
            "-t",
            "20",
            "-f",
            script.to_str().unwrap(),
        ],
    )
    .unwrap_or_else(|e| panic!("pipeline through pgherd: {e}"));
    assert!(out.contains("number of failed transactions: 0"), "{out}");

    // A named INSERT bound after a SELECT in one batch.
    let mut raw = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, b"sel", b"SELECT 1", &[0, 0]).unwrap();
    frontend::encode_parse(&mut out, b"ins", b"INSERT INTO w VALUES (2)", &[0, 0]).unwrap();
    frontend::encode_sync(&mut out);
    raw.send(&out);
    assert!(errors(&raw.recv_until_ready()).is_empty());
    out.clear();
    for name in [&b"sel"[..], b"ins"] {
        frontend::encode_bind(&mut out, b"", name, &[0, 0, 0, 0, 0, 0]).unwrap();
        frontend::encode_execute(&mut out, b"", 0).unwrap();
    }
    frontend::encode_sync(&mut out);
    raw.send(&out);
    let answer = raw.recv_until_ready();
    assert!(errors(&answer).is_empty(), "{:?}", errors(&answer));

    // BEGIN READ WRITE under default_transaction_read_only = on; READ ONLY, READ WRITE.
    c.batch_execute("SET default_transaction_read_only = on")
        .await
        .unwrap();
    c.batch_execute("BEGIN READ WRITE").await.unwrap();
    c.batch_execute("INSERT INTO w VALUES (3)").await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    c.batch_execute("RESET default_transaction_read_only")
        .await
        .unwrap();
    c.batch_execute("START TRANSACTION READ ONLY, READ WRITE")
        .await
        .unwrap();
    c.batch_execute("INSERT INTO w VALUES (4)").await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();

    // A SET of the read-only default rolled back is forgotten.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute("SET default_transaction_read_only = on")
        .await
        .unwrap();
    c.batch_execute("ROLLBACK").await.unwrap();
    c.batch_execute("INSERT INTO w VALUES (5)")
        .await
        .unwrap_or_else(|e| panic!("after a rolled-back SET: {e}"));
    assert_eq!(env.direct("SELECT count(*) FROM w WHERE x >= 2"), "4");
}

/// One client cannot make pgherd hold its messages: 10 clients each send a 100 MB query and
/// read a 100 MB notice at once; pgherd's resident memory stays within 200 MB of where it
/// started and comes back within 50 MB of it.
#[test]
fn large_messages_stream_through_with_bounded_memory() {
    let env = env(0, |c| c.max_size(10));
    let port = env.pgherd.port;
    let pid = env.pgherd.pid();
    // Warm up: pools and buffers exist before the baseline is taken.
    let mut warm = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    warm.query("SELECT 1");
    drop(warm);
    std::thread::sleep(Duration::from_millis(300));
    let baseline = rss_kib(pid);
    let peak = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (peak, sampling) = (peak.clone(), sampling.clone());
        std::thread::spawn(move || {
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak.fetch_max(rss_kib(pid), std::sync::atomic::Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    const MB100: usize = 100 << 20;
    let clients: Vec<_> = (0..10)
        .map(|_| {
            std::thread::spawn(move || {
                let mut c = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
                // A 100 MB query: a literal the server measures.
                let sql = format!("SELECT length('{}')", "x".repeat(MB100));
                let mut out = BytesMut::new();
                frontend::encode_query(&mut out, sql.as_bytes()).unwrap();
                drop(sql);
                c.send(&out);
                drop(out);
                let answer = c.recv_until_ready();
                assert_eq!(first_column(&answer), [MB100.to_string()]);
                // A 100 MB notice the server generates.
                let mut out = BytesMut::new();
                frontend::encode_query(
                    &mut out,
                    b"DO $$ BEGIN RAISE NOTICE '%', repeat('y', 100 * 1024 * 1024); END $$",
                )
                .unwrap();
                c.send(&out);
                let seen = c.skip_until_ready();
                let notice = seen.iter().find(|(t, _)| *t == b'N').map(|(_, len)| *len);
                assert!(notice.unwrap_or(0) > MB100, "{seen:?}");
            })
        })
        .collect();
    for c in clients {
        c.join().expect("client");
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
    std::thread::sleep(Duration::from_secs(2));
    let after = rss_kib(pid);
    eprintln!("pgherd RSS: baseline {baseline} KiB, peak {peak} KiB, after {after} KiB");
    assert!(
        peak < baseline + 200 * 1024,
        "peak {peak} KiB from {baseline} KiB"
    );
    assert!(
        after < baseline + 50 * 1024,
        "after {after} KiB from {baseline} KiB"
    );
    // 300,000 statements in one query: not parsed, run on the primary, nothing held.
    let mut c = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let answer = c.query(&"SELECT 1;".repeat(300_000));
    assert!(errors(&answer).is_empty());
    assert!(rss_kib(pid) < baseline + 100 * 1024);
}

/// A startup parameter the server refuses fails the login with the server's error, as it
/// would directly; the others are applied as a startup packet applies them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_settings_are_checked_by_a_server() {
    // One server connection: every client after the first gets the server the first used.
    let env = env(0, |c| c.max_size(1));
    let port = env.pgherd.port;
    let refused = RawClient::login_with(
        port,
        &[
            ("user", APP),
            ("database", APP),
            ("options", "-c search_path=myschema -c zz_typo=1"),
        ],
        APP_PASSWORD,
    )
    .err()
    .expect("the login must fail");
    assert_eq!(refused.code.code(), "42704", "{refused}");
    assert!(refused.message.contains("zz_typo"), "{refused}");
    let mut ok = RawClient::login_with(
        port,
        &[
            ("user", APP),
            ("database", APP),
            ("options", "-c search_path=myschema,public -c work_mem=8MB"),
        ],
        APP_PASSWORD,
    )
    .unwrap();
    // As PostgreSQL shows a startup packet's value: as given.
    assert_eq!(
        first_column(&ok.query("SHOW search_path")),
        ["myschema,public"]
    );
    assert_eq!(first_column(&ok.query("SHOW work_mem")), ["8MB"]);
    drop(ok);

    // RESET, SET ... TO DEFAULT and RESET ALL go back to the startup packet's values, as on a
    // server of the client's own, in a transaction and out of one; the next client with the
    // same startup packet does not get the server's defaults in their place.
    let startup = [
        ("user", APP),
        ("database", APP),
        ("options", "-c work_mem=8MB"),
        ("application_name", "started"),
    ];
    let show = |c: &mut RawClient, what: &str| first_column(&c.query(&format!("SHOW {what}")));
    for reset in ["RESET work_mem", "SET work_mem TO DEFAULT", "RESET ALL"] {
        let mut c = RawClient::login_with(port, &startup, APP_PASSWORD).unwrap();
        for sql in ["SET work_mem = '16MB'", "BEGIN", reset] {
            assert!(errors(&c.query(sql)).is_empty(), "{sql}");
        }
        assert_eq!(
            show(&mut c, "work_mem"),
            ["8MB"],
            "{reset}, in its transaction"
        );
        c.query("COMMIT");
        assert_eq!(show(&mut c, "work_mem"), ["8MB"], "{reset}, after it");
        c.query("SET work_mem = '16MB'");
        c.query(reset);
        assert_eq!(show(&mut c, "work_mem"), ["8MB"], "{reset}, on its own");
        assert_eq!(show(&mut c, "application_name"), ["started"], "{reset}");
        c.query("SET work_mem = '16MB'");
        c.query("BEGIN");
        c.query(reset);
        c.query("ROLLBACK");
        assert_eq!(show(&mut c, "work_mem"), ["16MB"], "{reset}, rolled back");
        c.query(reset);
        drop(c);
        let mut next = RawClient::login_with(port, &startup, APP_PASSWORD).unwrap();
        assert_eq!(
            show(&mut next, "work_mem"),
            ["8MB"],
            "{reset}: the next client"
        );
    }

    // A replication connection is refused by name, not served as a session that would read
    // IDENTIFY_SYSTEM as a syntax error; `replication=off` is an ordinary login.
    let login = |value: &str| {
        RawClient::login_with(
            port,
            &[("user", APP), ("database", APP), ("replication", value)],
            APP_PASSWORD,
        )
    };
    for (value, code) in [("database", "0A000"), ("true", "0A000"), ("maybe", "22023")] {
        let refused = login(value).err().expect("a replication login must fail");
        assert_eq!(refused.code.code(), code, "replication={value}: {refused}");
        assert!(refused.message.contains("replication"), "{refused}");
    }
    let mut ordinary = login("off").expect("replication=off is an ordinary session");
    assert_eq!(first_column(&ordinary.query("SELECT 1")), ["1"]);
}

/// Parse declares its parameter count as an unsigned 16-bit number: 40,000 types are fine.
#[test]
fn parse_accepts_up_to_65535_parameter_types() {
    let env = env(0, |c| c);
    let mut c = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD).unwrap();
    let count: u16 = 40_000;
    let mut types = count.to_be_bytes().to_vec();
    for _ in 0..count {
        types.extend_from_slice(&23u32.to_be_bytes());
    }
    let mut out = BytesMut::new();
    frontend::encode_parse(&mut out, b"many", b"SELECT $1::int", &types).unwrap();
    frontend::encode_sync(&mut out);
    c.send(&out);
    let answer = c.recv_until_ready();
    assert!(errors(&answer).is_empty(), "{:?}", errors(&answer));
    assert_eq!(
        answer.first().map(|m| m.0),
        Some(b'1'),
        "ParseComplete first"
    );
}

/// Guessing is slow: failed logins and cancel requests with wrong keys are answered later and
/// later from one address, and the log gets a few lines, not one per guess.
#[test]
fn failed_logins_and_wrong_cancel_keys_are_throttled() {
    let env = env(0, |c| c.proxy("auth_failure_delay_ms = 100"));
    let port = env.pgherd.port;
    // Five wrong passwords in a row wait 100 + 200 + 400 + 800 + 1600 ms at least.
    let started = Instant::now();
    for _ in 0..5 {
        let e = RawClient::login(port, APP, APP, "wrong")
            .err()
            .expect("refused");
        assert_eq!(e.code.code(), "28P01");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(3_100),
        "{:?}",
        started.elapsed()
    );
    // The right password still logs in (a client is not locked out, only slowed).
    let victim = RawClient::login(port, APP, APP, APP_PASSWORD).unwrap();
    let mut key = victim.key.expect("a cancel key");
    // 200 cancel requests guessing the secret, in parallel.
    let guesses: Vec<_> = (0..200i32)
        .map(|i| {
            key.secret_key = key.secret_key.wrapping_add(i + 1);
            let guess = key;
            std::thread::spawn(move || {
                let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
                let mut out = BytesMut::new();
                pgherd_wire::startup::encode_cancel_request(&mut out, guess);
                let _ = s.write_all(&out);
                let started = Instant::now();
                let mut answer = Vec::new();
                let _ = s.read_to_end(&mut answer);
                let refused = String::from_utf8_lossy(&answer).contains("too many failed logins");
                (started.elapsed(), refused)
            })
        })
        .collect();
    let answers: Vec<(Duration, bool)> = guesses.into_iter().map(|g| g.join().unwrap()).collect();
    // At most 16 guesses from one address wait for their (late) answer at a time; the others
    // are turned away at once: parallel guessing cannot outrun the delay.
    let turned_away = answers.iter().filter(|(_, refused)| *refused).count();
    let answered_late = answers
        .iter()
        .filter(|(waited, refused)| !refused && *waited >= Duration::from_millis(90))
        .count();
    assert!(turned_away >= 150, "{turned_away} of 200 turned away");
    assert!(answered_late >= 16, "{answered_late} answered late");
    let lines = env
        .pgherd
        .log()
        .lines()
        .filter(|l| l.contains("failed login or cancel request"))
        .count();
    assert!(lines <= 6, "{lines} log lines for 205 failures");
}

/// Sockets that never finish logging in cannot keep clients or the admin console out, and
/// the admin console has places of its own.
#[test]
fn unauthenticated_sockets_cannot_lock_anyone_out() {
    let env = env(0, |c| {
        c.superuser()
            .proxy("admin_users = [\"postgres\"]")
            .proxy("max_client_connections = 5")
            .proxy("admin_reserved_connections = 2")
    });
    let port = env.pgherd.port;
    let silent: Vec<TcpStream> = (0..30)
        .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut apps: Vec<RawClient> = (0..5)
        .map(|i| {
            RawClient::login(port, APP, APP, APP_PASSWORD)
                .unwrap_or_else(|e| panic!("client {i} locked out: {e}"))
        })
        .collect();
    // The sixth ordinary client is refused; the console still gets in.
    let sixth = RawClient::login(port, APP, APP, APP_PASSWORD)
        .err()
        .expect("refused");
    assert_eq!(sixth.code.code(), "53300");
    let mut console = RawClient::login(
        port,
        pgherd_testkit::SUPERUSER,
        "pgherd",
        pgherd_testkit::SUPERUSER_PASSWORD,
    )
    .unwrap_or_else(|e| panic!("the console is locked out: {e}"));
    assert!(!console.query("SHOW POOLS").is_empty());
    assert_eq!(first_column(&apps[0].query("SELECT 'ok'")), ["ok"]);
    drop(silent);
    apps.clear();
}

/// Idle HTTP connections are capped and time out: they cannot use up the descriptors
/// PostgreSQL clients need, and the API answers again once they are gone.
#[test]
fn idle_http_clients_are_bounded() {
    let api = pgherd_cluster::free_port().unwrap();
    let env = env(0, |c| {
        c.section(&format!("[api]\nlisten = [\"127.0.0.1:{api}\"]"))
    });
    let pid = env.pgherd.pid();
    let before = open_fds(pid);
    let idle: Vec<TcpStream> = (0..600)
        .filter_map(|_| TcpStream::connect(("127.0.0.1", api)).ok())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let during = open_fds(pid);
    assert!(
        during < before + 300,
        "{during} descriptors open (from {before})"
    );
    let mut c = RawClient::login(env.pgherd.port, APP, APP, APP_PASSWORD)
        .expect("PostgreSQL clients still connect");
    assert_eq!(first_column(&c.query("SELECT 1")), ["1"]);
    // The idle ones time out (no request head within 5 s) and the API answers again.
    std::thread::sleep(Duration::from_secs(6));
    let health = ureq::get(&format!("http://127.0.0.1:{api}/health"))
        .timeout(Duration::from_secs(5))
        .call()
        .expect("the API answers");
    assert_eq!(health.status(), 200);
    drop(idle);
}

/// Logins to databases that do not exist leave no pool behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_for_missing_databases_are_not_kept() {
    let env = env(0, |c| c.superuser().proxy("admin_users = [\"postgres\"]"));
    for i in 0..30 {
        let e = RawClient::login(env.pgherd.port, APP, &format!("nosuch_{i}"), APP_PASSWORD)
            .err()
            .expect("refused");
        assert_eq!(e.code.code(), "3D000", "{e}");
    }
    let mut console = RawClient::login(
        env.pgherd.port,
        pgherd_testkit::SUPERUSER,
        "pgherd",
        pgherd_testkit::SUPERUSER_PASSWORD,
    )
    .unwrap();
    let pools = console.query("SHOW POOLS");
    let names = first_column(&pools);
    assert!(
        names.iter().all(|db| !db.starts_with("nosuch_")),
        "pools kept for missing databases: {names:?}"
    );
}
