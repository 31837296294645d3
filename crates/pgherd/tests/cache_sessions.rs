//! The result cache through pgherd: hinted simple queries are answered from the cache; a
//! commit made directly on the primary, once decoded, is never answered around; a session
//! always sees its own writes; a schema change made directly on the primary drops what was
//! kept; the console shows and clears the cache; prepared statements are served by their
//! parameter values.

mod common;

use common::cache::*;
use common::*;

const READ: &str = "/* pgherd:cache */ SELECT v FROM items WHERE id = 1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hinted_reads_are_served_and_never_outlive_a_decoded_commit() {
    let (env, console) = cache_env(1, |c| c).await;
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10), (2, 20)",
    )
    .await
    .expect("setup");

    // Served from the cache once the stream is live, with the committed value.
    assert_eq!(read_until_served(&app, &console, READ).await, "10");
    assert!(figure(&console, "stores").await >= 1);
    assert!(figure(&console, "entries").await >= 1);

    // A commit made directly on the primary: once decoded, never answered around.
    for v in 11..16 {
        env.direct(&format!("UPDATE items SET v = {v} WHERE id = 1"));
        let lsn = env.direct("SELECT pg_current_wal_lsn()");
        wait_decoded(&env, &console, lsn.trim(), Some("pg2")).await;
        assert_eq!(first_value(&app, READ).await.unwrap(), v.to_string());
        // And kept again afterwards.
        assert_eq!(read_until_served(&app, &console, READ).await, v.to_string());
    }

    // A session reads its own writes at once, whatever the stream has decoded.
    let own = env.app().await;
    assert_eq!(first_value(&own, READ).await.unwrap(), "15");
    for v in 100..120 {
        own.simple_query(&format!("UPDATE items SET v = {v} WHERE id = 1"))
            .await
            .expect("the write");
        assert_eq!(first_value(&own, READ).await.unwrap(), v.to_string());
    }

    // A statement that is not cacheable runs every time.
    let hits = figure(&console, "hits").await;
    for _ in 0..5 {
        first_value(
            &app,
            "/* pgherd:cache */ SELECT v + random()::int FROM items WHERE id = 2",
        )
        .await
        .unwrap();
        first_value(&app, "SELECT v FROM items WHERE id = 2")
            .await
            .unwrap();
    }
    assert_eq!(figure(&console, "hits").await, hits);

    // A schema change made directly on the primary drops what was kept.
    let wide = "/* pgherd:cache */ SELECT * FROM items WHERE id = 2";
    let columns = |messages: Vec<tokio_postgres::SimpleQueryMessage>| {
        messages.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.len()),
            _ => None,
        })
    };
    read_until_served(&app, &console, wide).await;
    env.direct("ALTER TABLE items ADD COLUMN w int DEFAULT 7");
    let lsn = env.direct("SELECT pg_current_wal_lsn()");
    wait_decoded(&env, &console, lsn.trim(), Some("pg2")).await;
    assert_eq!(columns(app.simple_query(wide).await.unwrap()), Some(3));

    // The console clears one table's entries, or all.
    read_until_served(&app, &console, READ).await;
    assert!(figure(&console, "entries").await >= 1);
    console
        .simple_query("CACHE CLEAR public.Items")
        .await
        .expect("CACHE CLEAR items");
    assert_eq!(figure(&console, "entries").await, 0);
    read_until_served(&app, &console, READ).await;
    console
        .simple_query("CACHE CLEAR")
        .await
        .expect("CACHE CLEAR");
    assert_eq!(figure(&console, "entries").await, 0);
}

/// Reads `read` until the cache answers it (hits grow); returns the answer.
async fn served<T>(console: &tokio_postgres::Client, mut read: impl AsyncFnMut() -> T) -> T {
    let started = std::time::Instant::now();
    loop {
        let hits = figure(console, "hits").await;
        let value = read().await;
        if figure(console, "hits").await > hits {
            return value;
        }
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "never served from the cache: {:?}",
            cache_row(console).await
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The extended protocol: a named prepared statement executed with different values (binary
/// results), and the unnamed statement parsed, described and executed in one request, are
/// answered from the cache under their parameter values; never across values, never across
/// protocols, never after a decoded commit, and a session sees its own writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_are_served_by_their_parameter_values() {
    use tokio_postgres::types::Type;
    let (env, console) = cache_env(1, |c| c).await;
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10), (2, 20)",
    )
    .await
    .expect("setup");
    let sql = "/* pgherd:cache */ SELECT v FROM items WHERE id = $1";
    let named = app.prepare(sql).await.expect("prepare");
    let by_name = async |id: i32| -> i32 {
        app.query_one(&named, &[&id])
            .await
            .expect("the read")
            .get(0)
    };
    let unnamed = async |id: i32| -> i32 {
        let rows = app
            .query_typed(sql, &[(&id, Type::INT4)])
            .await
            .expect("the read");
        rows[0].get(0)
    };
    // Read until served: the stream goes live and the answers are kept.
    assert_eq!(served(&console, async || by_name(1).await).await, 10);
    assert_eq!(served(&console, async || by_name(2).await).await, 20);
    assert_eq!(served(&console, async || unnamed(1).await).await, 10);
    assert_eq!(served(&console, async || unnamed(2).await).await, 20);
    // The simple protocol's text answer is kept apart.
    let simple = "/* pgherd:cache */ SELECT v FROM items WHERE id = 1";
    assert_eq!(read_until_served(&app, &console, simple).await, "10");
    assert_eq!(by_name(1).await, 10);
    assert_eq!(unnamed(2).await, 20);

    // A commit made directly on the primary, once decoded, is never answered around.
    for v in 11..16 {
        env.direct(&format!("UPDATE items SET v = {v} WHERE id = 1"));
        let lsn = env.direct("SELECT pg_current_wal_lsn()");
        wait_decoded(&env, &console, lsn.trim(), Some("pg2")).await;
        assert_eq!(by_name(1).await, v);
        assert_eq!(unnamed(1).await, v);
        assert_eq!(by_name(2).await, 20);
        assert_eq!(served(&console, async || by_name(1).await).await, v);
    }
    // Its own writes, at once.
    for v in 100..110 {
        app.execute("UPDATE items SET v = $1 WHERE id = 2", &[&v])
            .await
            .expect("the write");
        assert_eq!(by_name(2).await, v);
        assert_eq!(unnamed(2).await, v);
    }
    // A value no row has: no row, also when served.
    let none = async || app.query(&named, &[&3i32]).await.expect("the read").len();
    assert_eq!(served(&console, none).await, 0);
}

/// What the cache must never answer, end to end: a table under row-level security, a read
/// that locks rows, a session's temporary table; and what its key keeps apart: users (one
/// without the privilege gets the server's refusal, not another user's answer), and the
/// settings that change what a statement reads or how its values are written (`search_path`,
/// `TimeZone`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_never_served_and_what_the_key_keeps_apart() {
    let other_verifier =
        pgherd_wire::scram::ScramVerifier::from_password(APP_PASSWORD, b"other-salt", 4096);
    let (env, console) = cache_env(1, |c| {
        c.user(
            "other",
            &other_verifier,
            &format!("server_password = \"{APP_PASSWORD}\""),
        )
    })
    .await;
    let app = env.app().await;
    app.batch_execute(
        "CREATE TABLE items (id int PRIMARY KEY, v int); INSERT INTO items VALUES (1, 10);
         CREATE TABLE secrets (id int, owner name);
         ALTER TABLE secrets ENABLE ROW LEVEL SECURITY;
         CREATE POLICY own ON secrets USING (owner = current_user);
         INSERT INTO secrets VALUES (1, 'app');
         CREATE SCHEMA s1; CREATE SCHEMA s2;
         CREATE TABLE s1.t (v text); CREATE TABLE s2.t (v text);
         INSERT INTO s1.t VALUES ('one'); INSERT INTO s2.t VALUES ('two');
         CREATE TABLE stamps (at timestamptz); INSERT INTO stamps VALUES ('2026-01-01 00:00:00+00')",
    )
    .await
    .expect("setup");
    // The stream is live and answers are kept: what follows is refused for its own reasons.
    assert_eq!(read_until_served(&app, &console, READ).await, "10");

    let never_served = [
        "/* pgherd:cache */ SELECT count(*) FROM secrets",
        "/* pgherd:cache */ SELECT v FROM items WHERE id = 1 FOR UPDATE",
        "/* pgherd:cache */ SELECT v FROM items WHERE id = 1 FOR SHARE",
    ];
    let hits = figure(&console, "hits").await;
    for sql in never_served {
        for _ in 0..5 {
            first_value(&app, sql).await.expect(sql);
        }
    }
    // A temporary table (the session is pinned to its server, and the table is not cached).
    let pinned = env.app().await;
    pinned
        .batch_execute("CREATE TEMP TABLE scratch (v int); INSERT INTO scratch VALUES (5)")
        .await
        .expect("temp table");
    for _ in 0..5 {
        assert_eq!(
            first_value(&pinned, "/* pgherd:cache */ SELECT v FROM scratch")
                .await
                .unwrap(),
            "5"
        );
        assert_eq!(first_value(&pinned, READ).await.unwrap(), "10");
    }
    assert_eq!(figure(&console, "hits").await, hits, "{never_served:?}");

    // Users: one without the privilege is refused by the server, never given app's answer.
    env.direct(&format!(
        "CREATE ROLE other LOGIN PASSWORD '{APP_PASSWORD}'"
    ));
    env.direct("GRANT CONNECT ON DATABASE app TO other; GRANT USAGE ON SCHEMA public TO other");
    let other = connect(&env.pgherd.conninfo("other", APP_PASSWORD, APP)).await;
    for _ in 0..3 {
        assert_eq!(read_until_served(&app, &console, READ).await, "10");
        let refused = first_value(&other, READ).await.expect_err("no privilege");
        assert_eq!(code(&refused), "42501");
    }
    // Once granted (a schema change: what was kept is dropped), it is served its own answer.
    env.direct("GRANT SELECT ON items TO other");
    let lsn = env.direct("SELECT pg_current_wal_lsn()");
    wait_decoded(&env, &console, lsn.trim(), Some("pg2")).await;
    assert_eq!(read_until_served(&other, &console, READ).await, "10");
    // A privilege held through a role: taking the role away (a shared catalog no event
    // trigger sees) drops what was kept, and the user is refused again.
    env.direct(
        "REVOKE SELECT ON items FROM other; CREATE ROLE readers; GRANT SELECT ON items TO readers; GRANT readers TO other",
    );
    let lsn = env.direct("SELECT pg_current_wal_lsn()");
    wait_decoded(&env, &console, lsn.trim(), Some("pg2")).await;
    assert_eq!(read_until_served(&other, &console, READ).await, "10");
    let invalidations = figure(&console, "invalidations").await;
    env.direct("REVOKE readers FROM other");
    let started = std::time::Instant::now();
    while figure(&console, "invalidations").await == invalidations {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the role change never dropped the cache: {:?}",
            cache_row(&console).await
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let refused = first_value(&other, READ)
        .await
        .expect_err("the role is gone");
    assert_eq!(code(&refused), "42501");

    // search_path: the same text reads another table.
    let by_path = async |path: &str| {
        let c = env.app().await;
        c.simple_query(&format!("SET search_path = {path}"))
            .await
            .expect("SET search_path");
        c
    };
    let (one, two) = (by_path("s1").await, by_path("s2").await);
    let t = "/* pgherd:cache */ SELECT v FROM t";
    assert_eq!(read_until_served(&one, &console, t).await, "one");
    assert_eq!(read_until_served(&two, &console, t).await, "two");
    assert_eq!(read_until_served(&one, &console, t).await, "one");

    // TimeZone: the same value is written otherwise.
    let by_zone = async |zone: &str| {
        let c = env.app().await;
        c.simple_query(&format!("SET TimeZone = '{zone}'"))
            .await
            .expect("SET TimeZone");
        c
    };
    let (utc, tokyo) = (by_zone("UTC").await, by_zone("Asia/Tokyo").await);
    let at = "/* pgherd:cache */ SELECT at FROM stamps";
    assert_eq!(
        read_until_served(&utc, &console, at).await,
        "2026-01-01 00:00:00+00"
    );
    assert_eq!(
        read_until_served(&tokyo, &console, at).await,
        "2026-01-01 09:00:00+09"
    );
    assert_eq!(
        read_until_served(&utc, &console, at).await,
        "2026-01-01 00:00:00+00"
    );
}
