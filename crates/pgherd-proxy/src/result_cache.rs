//! The result cache as the app runs it: one [`DatabaseCache`] per server database, made when
//! a session of that database first may use it, and a task that keeps its invalidation
//! stream ([`crate::cache_feed::follow`]) running on whichever node is the primary.
//!
//! The task follows the primary the cluster view names and starts over when that changes
//! (a failover or switchover: the store is emptied, a slot is made anew on the new primary),
//! when the stream breaks, and when pgherd's schema-change trigger cannot be made. While it is
//! not following, the cache serves nothing; sessions run their statements as without it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use pgherd_cache::{GateLimits, Limits, Store, SCHEMA_CHANGE_PREFIX};
use pgherd_config::CacheSettings;

use crate::app::App;
use crate::cache_feed::{follow, DatabaseCache, FeedSettings, NOT_FOLLOWING};
use crate::server::{self, ConnectSpec};

/// How long the task waits before trying again after the stream ended, at first and at
/// most (doubling in between).
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How often the task looks whether the primary is still the one it follows.
const PRIMARY_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// The event trigger that announces schema changes in the WAL (a transactional logical
/// message, decoded with the change's commit): `ALTER TABLE`, `DROP`, `GRANT` and the like
/// change answers without changing rows, and `test_decoding` shows only rows. Made once per
/// database by the first pgherd whose cache follows it; needs a superuser.
const SCHEMA_CHANGE_TRIGGER_SQL: &str = "\
DO $pgherd$ BEGIN \
  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_event_trigger \
                 WHERE evtname = 'pgherd_cache_schema_change') THEN \
    CREATE SCHEMA IF NOT EXISTS pgherd; \
    CREATE OR REPLACE FUNCTION pgherd.cache_schema_change() RETURNS event_trigger \
      LANGUAGE plpgsql AS $f$ BEGIN \
        IF pg_catalog.current_setting('wal_level') = 'logical' THEN \
          PERFORM pg_catalog.pg_logical_emit_message(true, 'PREFIX', ''); \
        END IF; \
      END $f$; \
    CREATE EVENT TRIGGER pgherd_cache_schema_change ON ddl_command_end \
      EXECUTE FUNCTION pgherd.cache_schema_change(); \
  END IF; \
END $pgherd$";

/// What a session that may use the cache holds.
#[derive(Clone)]
pub struct CacheUse {
    pub db: Arc<DatabaseCache>,
    /// The config asks for every cacheable read of this database or user, hint or not.
    pub every_read: bool,
    /// The config names statements to cache without a hint.
    pub statement_patterns: bool,
}

/// The app's caches, by server database.
#[derive(Default)]
pub struct Caches {
    by_database: Mutex<std::collections::BTreeMap<String, Arc<DatabaseCache>>>,
}

/// The stream's state as the console shows it.
#[derive(Debug, Default, Clone)]
pub struct FeedStatus {
    /// Why the last stream ended (or could not start).
    pub last_error: Option<String>,
    pub restarts: u64,
}

/// The task keeping one database's stream.
#[derive(Default)]
pub struct Following {
    pub started: AtomicBool,
    pub status: Mutex<FeedStatus>,
}

pub fn limits_of(settings: &CacheSettings) -> Limits {
    Limits {
        max_bytes: settings.max_bytes as usize,
        max_entry_bytes: settings.max_entry_bytes as usize,
        ttl_ms: settings.ttl_ms,
    }
}

pub fn gate_limits_of(settings: &CacheSettings) -> GateLimits {
    GateLimits {
        max_silence_ms: settings.max_silence_ms,
        max_lag_bytes: settings.max_lag_bytes,
    }
}

impl Caches {
    /// The cache of `server_dbname`, made (empty, not following yet) on first use.
    pub fn of(&self, server_dbname: &str, settings: &CacheSettings) -> Arc<DatabaseCache> {
        let mut by_database = self.by_database.lock();
        if let Some(db) = by_database.get(server_dbname) {
            return db.clone();
        }
        let db = Arc::new(DatabaseCache::new(
            server_dbname,
            Store::new(limits_of(settings)),
        ));
        by_database.insert(server_dbname.to_owned(), db.clone());
        db
    }

    pub fn all(&self) -> Vec<Arc<DatabaseCache>> {
        self.by_database.lock().values().cloned().collect()
    }

    /// A reload: new bounds for every store; switched off, every entry goes (sessions then
    /// keep none).
    pub fn reconfigure(&self, settings: &CacheSettings) {
        for db in self.all() {
            let mut state = db.state.lock();
            state.store.set_limits(limits_of(settings));
            if !settings.enabled {
                state.store.drop_all();
            }
        }
    }
}

/// Starts the task that keeps `db`'s stream running, unless it runs already.
pub fn start_following(app: &Arc<App>, db: &Arc<DatabaseCache>) {
    // Read first: every asked-for statement comes here, and a swap would write the shared
    // line each time.
    if db.following.started.load(Ordering::Acquire)
        || db.following.started.swap(true, Ordering::AcqRel)
    {
        return;
    }
    tokio::spawn(keep_following(app.clone(), db.clone()));
}

async fn keep_following(app: Arc<App>, db: Arc<DatabaseCache>) {
    let mut shutdown = app.shutdown_signal();
    let mut retry = RETRY_FIRST;
    let slot_name = slot_name(
        app.dcs.as_ref().map(|dcs| dcs.instance.as_str()),
        std::process::id(),
        rand::random(),
        SLOT_SEQUENCE.fetch_add(1, Ordering::Relaxed),
    );
    while !app.is_shutting_down() {
        let ended = tokio::select! {
            ended = follow_primary(&app, &db, &slot_name) => ended,
            _ = shutdown.changed() => break,
        };
        {
            let mut status = db.following.status.lock();
            status.restarts += 1;
            if let Some(why) = &ended {
                status.last_error = Some(why.clone());
            }
        }
        match &ended {
            Some(why) => {
                tracing::warn!(database = %db.database, error = %why, retry_ms = retry.as_millis() as u64, "result cache: not following the primary's WAL; the cache serves nothing until it does")
            }
            None => {
                tracing::info!(database = %db.database, "result cache: the primary changed; following the new one")
            }
        }
        let wait = if ended.is_some() { retry } else { RETRY_FIRST };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = shutdown.changed() => break,
        }
        retry = if ended.is_some() {
            (retry * 2).min(RETRY_MAX)
        } else {
            RETRY_FIRST
        };
    }
    db.state.lock().went_down();
}

/// Slot names of this process, told apart.
static SLOT_SEQUENCE: AtomicU64 = AtomicU64::new(1);

/// The name of a stream's slot, unique among every pgherd in front of the cluster: the
/// instance's name (with `[dcs]`, unique among the instances), the process id and a random
/// number (two hosts' pgherds may well share a process id: 1 in containers), the stream's
/// sequence number. Lower case letters, digits and underscores, as PostgreSQL allows, and
/// within its 63 bytes.
fn slot_name(instance: Option<&str>, pid: u32, nonce: u32, sequence: u64) -> String {
    let instance: String = instance
        .unwrap_or_default()
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '_',
        })
        .take(20)
        .collect();
    let mut name = format!("pgherd_cache_{instance}_{pid}_{nonce:08x}_{sequence}");
    name.truncate(63);
    name
}

/// Follows the current primary until the stream ends (`Some(why)`) or another node becomes
/// the primary (`None`).
async fn follow_primary(app: &Arc<App>, db: &DatabaseCache, slot_name: &str) -> Option<String> {
    let Some(primary) = app.nodes.writer() else {
        return Some("no node is the primary".to_owned());
    };
    let config = app.config();
    let ctx = app.connect_context();
    let credentials = crate::monitor::management_credentials(&config.cluster);
    let spec = crate::monitor::management_spec(
        &primary,
        &config.cluster,
        &ctx,
        &db.database,
        &credentials,
    );
    if let Err(why) = ensure_schema_change_trigger(&spec).await {
        return Some(why);
    }
    db.followed_node
        .store(u64::from(primary.id.0), Ordering::Release);
    let primary_changed = async {
        loop {
            tokio::time::sleep(PRIMARY_CHECK_INTERVAL).await;
            if app.nodes.writer().is_none_or(|now| now.id != primary.id) {
                return;
            }
        }
    };
    let ended = tokio::select! {
        ended = follow(db, &spec, slot_name, FeedSettings::default()) => Some(ended.to_string()),
        _ = primary_changed => {
            // The stream may still be live on the old primary; its entries go with it.
            db.state.lock().went_down();
            None
        }
    };
    db.followed_node.store(NOT_FOLLOWING, Ordering::Release);
    ended
}

/// Makes pgherd's schema-change trigger in the database unless it is there.
async fn ensure_schema_change_trigger(spec: &ConnectSpec<'_>) -> Result<(), String> {
    let mut conn = server::connect(spec, 0, 1)
        .await
        .map_err(|e| e.to_string())?;
    let sql = SCHEMA_CHANGE_TRIGGER_SQL.replace("PREFIX", SCHEMA_CHANGE_PREFIX);
    conn.simple_query(&sql).await.map(|_| ()).map_err(|e| {
        format!("pgherd's schema-change event trigger could not be made (a superuser must run pgherd's [cluster] user): {e}")
    })
}

/// One database's cache as the console and the metrics show it.
pub struct CacheReport {
    pub database: String,
    pub serving: Result<(), pgherd_cache::NotServing>,
    pub decoded_lsn: u64,
    pub lag_bytes: u64,
    pub figures: pgherd_cache::Figures,
    pub status: FeedStatus,
    /// The node whose WAL the stream follows now.
    pub following: Option<String>,
    /// Commit on the primary → its answers dropped here: median and 99th percentile, in
    /// microseconds (as fine as the histogram's buckets).
    pub invalidation_delay_us: Option<(u64, u64)>,
}

/// Every database's cache, read once for `SHOW CACHE` and `/metrics`.
pub fn reports(app: &App) -> Vec<CacheReport> {
    let config = app.config();
    let limits = gate_limits_of(&config.cache);
    let primary_lsn = app.nodes.writer().map_or(0, |n| n.lsn());
    app.caches
        .all()
        .iter()
        .map(|db| {
            let now_ms = db.now_ms();
            let status = db.following.status.lock().clone();
            let state = db.state.lock();
            CacheReport {
                database: db.database.clone(),
                serving: state.feed.may_serve(now_ms, 0, primary_lsn, limits),
                decoded_lsn: state.feed.decoded_lsn(),
                lag_bytes: state.feed.lag_bytes(primary_lsn),
                figures: state.store.figures(),
                status,
                following: db
                    .followed_node_id()
                    .and_then(|id| app.nodes.by_id(id))
                    .map(|node| node.config.name.clone()),
                invalidation_delay_us: db
                    .invalidation_delay
                    .quantile_us(0.5)
                    .zip(db.invalidation_delay.quantile_us(0.99)),
            }
        })
        .collect()
}

/// `SHOW CACHE`: per database, whether the cache serves and its figures.
pub fn view(app: &App) -> crate::views::Table {
    let columns = &[
        "database",
        "state",
        "following",
        "decoded_lsn",
        "lag_bytes",
        "entries",
        "bytes",
        "hits",
        "misses",
        "stores",
        "not_stored",
        "evictions",
        "invalidations",
        "expirations",
        "restarts",
        "invalidation_delay_p50_ms",
        "invalidation_delay_p99_ms",
        "last_error",
    ];
    let rows = reports(app)
        .into_iter()
        .map(|r| {
            let f = r.figures;
            let state = match r.serving {
                Ok(()) => "serving".to_owned(),
                Err(why) => format!("not serving: {why}"),
            };
            vec![
                r.database.into(),
                state.into(),
                r.following.unwrap_or_default().into(),
                pgherd_route::balance::format_lsn(r.decoded_lsn).into(),
                r.lag_bytes.into(),
                f.entries.into(),
                f.bytes.into(),
                f.hits.into(),
                f.misses.into(),
                f.stores.into(),
                f.not_stored.into(),
                f.evictions.into(),
                f.invalidations.into(),
                f.expirations.into(),
                r.status.restarts.into(),
                delay_ms(r.invalidation_delay_us.map(|d| d.0)).into(),
                delay_ms(r.invalidation_delay_us.map(|d| d.1)).into(),
                r.status.last_error.unwrap_or_default().into(),
            ]
        })
        .collect();
    crate::views::Table { columns, rows }
}

fn delay_ms(us: Option<u64>) -> String {
    us.map_or_else(String::new, |us| format!("{:.3}", us as f64 / 1000.0))
}

/// A table name as the console's `CACHE CLEAR` got it: folded to lower case unless in
/// double quotes, as PostgreSQL reads names; a schema before it is dropped (entries are
/// kept by unqualified name).
pub fn table_name(text: &str) -> String {
    let mut rest = text;
    let mut last = String::new();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            // A quoted part ends at a quote not doubled.
            let mut name = String::new();
            let mut chars = quoted.char_indices().peekable();
            rest = "";
            while let Some((i, c)) = chars.next() {
                if c != '"' {
                    name.push(c);
                } else if chars.peek().is_some_and(|&(_, next)| next == '"') {
                    name.push('"');
                    chars.next();
                } else {
                    rest = &quoted[i + 1..];
                    break;
                }
            }
            last = name;
        } else {
            let end = rest.find('.').unwrap_or(rest.len());
            last = rest[..end].to_lowercase();
            rest = &rest[end..];
        }
        rest = rest.strip_prefix('.').unwrap_or(rest);
    }
    last
}

/// The console's `CACHE CLEAR [table]`: every database's entries, or those that read
/// `table`. Returns how many went.
pub fn clear(app: &App, table: Option<&str>) -> usize {
    app.caches
        .all()
        .iter()
        .map(|db| {
            let mut state = db.state.lock();
            match table {
                Some(table) => state.store.invalidate_table(table),
                None => state.store.drop_all(),
            }
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_are_what_postgresql_allows_and_tell_instances_apart() {
        let a = slot_name(Some("Host-A:6432"), 1, 0xdead_beef, 1);
        assert_eq!(a, "pgherd_cache_host_a_6432_1_deadbeef_1");
        let long = slot_name(Some(&"é".repeat(80)), u32::MAX, u32::MAX, u64::MAX);
        assert!(long.len() <= 63, "{long}");
        assert!(long
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'));
        assert_ne!(slot_name(None, 1, 1, 1), slot_name(None, 1, 2, 1));
    }

    #[test]
    fn console_table_names_are_read_as_postgresql_reads_them() {
        assert_eq!(table_name("Accounts"), "accounts");
        assert_eq!(table_name("public.Accounts"), "accounts");
        assert_eq!(table_name("\"Mixed Case\""), "Mixed Case");
        assert_eq!(table_name("s.\"a.b\""), "a.b");
        assert_eq!(table_name("\"say \"\"hi\"\"\""), "say \"hi\"");
    }
}
