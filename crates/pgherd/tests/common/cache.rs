//! The result cache as the tests watch it: `SHOW CACHE` figures, waiting for the stream to
//! decode a position, reading until an answer comes from the cache.

use std::time::{Duration, Instant};

use pgherd_route::balance::parse_lsn;
use tokio_postgres::Client;

use super::*;

/// The `SHOW CACHE` row of database `app` (empty before it has a cache).
pub async fn cache_row(console: &Client) -> Vec<(String, String)> {
    rows(console, "SHOW CACHE")
        .await
        .expect("SHOW CACHE")
        .into_iter()
        .find(|row| field(row, "database") == APP)
        .unwrap_or_default()
}

pub async fn figure(console: &Client, name: &str) -> u64 {
    let row = cache_row(console).await;
    if row.is_empty() {
        return 0;
    }
    field(&row, name).parse().expect("a number")
}

/// What the cache's stream has decoded, as `SHOW CACHE` says (0 before it has a cache).
pub async fn decoded_lsn(console: &Client) -> u64 {
    let row = cache_row(console).await;
    if row.is_empty() {
        return 0;
    }
    parse_lsn(field(&row, "decoded_lsn")).unwrap_or(0)
}

/// Waits until the cache's stream has decoded the primary's WAL up to `lsn`, and `replica`
/// (if any) has replayed it (a read the cache does not answer may go there: its staleness is
/// routing's business, not the cache's).
pub async fn wait_decoded(env: &Env, console: &Client, lsn: &str, replica: Option<&str>) {
    if let Some(replica) = replica {
        let replayed = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'");
        wait_until(
            env,
            "the replica replayed the change",
            Duration::from_secs(20),
            // Until it has replayed the database's creation, it refuses the connection.
            || {
                env.cluster
                    .node(replica)
                    .psql(APP, &replayed)
                    .is_ok_and(|out| out.trim() == "t")
            },
        );
    }
    let target = parse_lsn(lsn).expect("an LSN");
    let started = Instant::now();
    while decoded_lsn(console).await < target {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the cache did not decode up to {lsn}: {:?}",
            cache_row(console).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads `sql` until the cache serves it (the stream must be live first); returns the answer.
pub async fn read_until_served(app: &Client, console: &Client, sql: &str) -> String {
    let started = Instant::now();
    loop {
        let hits = figure(console, "hits").await;
        let value = first_value(app, sql).await.expect("the cached read");
        if figure(console, "hits").await > hits {
            return value;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "never served from the cache: {:?}",
            cache_row(console).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The admin console's connection string, as the test clusters' superuser.
pub fn console_conninfo(env: &Env) -> String {
    use pgherd_testkit::{SUPERUSER, SUPERUSER_PASSWORD};
    env.pgherd.conninfo(SUPERUSER, SUPERUSER_PASSWORD, "pgherd")
}

/// A cluster with `replicas` and pgherd in transaction mode, its cluster user a superuser
/// (the cache's stream and its schema-change trigger need one) who may use the admin
/// console, configured further by `tweak`; and a console connection.
pub async fn cache_env(
    replicas: usize,
    tweak: impl FnOnce(pgherd_testkit::PgherdConfig) -> pgherd_testkit::PgherdConfig,
) -> (Env, Client) {
    let env = env(replicas, |c| {
        tweak(c.superuser().mode("transaction").proxy(&format!(
            "admin_users = [\"{}\"]",
            pgherd_testkit::SUPERUSER
        )))
    });
    let console = connect(&console_conninfo(&env)).await;
    (env, console)
}
