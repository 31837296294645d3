//! The result cache's invalidation stream, the IO shell around `pgherd-cache`: for one
//! database, a temporary logical replication slot on the primary (`test_decoding`, made by
//! this connection and dropped by PostgreSQL when it closes, so a pgherd that dies leaves
//! none behind), read as a stream of commits; each commit drops the entries of the tables it
//! changed and holds those tables until a snapshot of the primary's shows the commit is no
//! longer in progress (a second, ordinary connection asks).
//!
//! [`follow`] runs one stream until it fails; whoever runs it starts it again, on the new
//! primary after a failover. The store is cleared whenever a stream starts or ends, so no
//! entry outlives the stream that would have dropped it.

use std::collections::HashSet;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, BytesMut};
use parking_lot::Mutex;
use pgherd_cache::{Cache, Decoder, Invalidation, Store};
use pgherd_route::balance::{format_lsn, parse_lsn};
use pgherd_wire::backend::tag;
use pgherd_wire::frame::write_message;
use pgherd_wire::frontend;

use crate::msgio::{read_message, write_flush};
use crate::server::{self, ConnectSpec, QueryError, ServerConn, MAX_SERVER_MESSAGE_BYTES};

/// One database's cache, shared by its sessions and its stream.
pub struct DatabaseCache {
    /// The server database.
    pub database: String,
    pub state: Mutex<Cache>,
    /// When this cache was made: the clock its times are counted from.
    pub epoch: Instant,
    pub following: crate::result_cache::Following,
    /// An answer was stored once: until then sessions skip looking (and locking) at all.
    pub ever_stored: std::sync::atomic::AtomicBool,
    /// The id of the node whose WAL the stream follows ([`NOT_FOLLOWING`] when none):
    /// nothing is served unless it is the node the cluster view names as writer now, so a
    /// failover stops serving at once, not when the task notices.
    pub followed_node: std::sync::atomic::AtomicU64,
    /// From a commit on the primary to its tables' answers dropped here (the primary's clock
    /// against pgherd's: only meaningful while they agree).
    pub invalidation_delay: crate::counters::Histogram,
}

/// [`DatabaseCache::followed_node`] when no stream runs.
pub const NOT_FOLLOWING: u64 = u64::MAX;

impl DatabaseCache {
    pub fn new(database: &str, store: Store) -> DatabaseCache {
        DatabaseCache {
            database: database.to_owned(),
            state: Mutex::new(Cache::new(store)),
            epoch: Instant::now(),
            following: Default::default(),
            ever_stored: Default::default(),
            followed_node: std::sync::atomic::AtomicU64::new(NOT_FOLLOWING),
            invalidation_delay: Default::default(),
        }
    }

    /// The node whose WAL the stream follows now.
    pub fn followed_node_id(&self) -> Option<pgherd_failover::NodeId> {
        let id = self
            .followed_node
            .load(std::sync::atomic::Ordering::Acquire);
        u32::try_from(id).ok().map(pgherd_failover::NodeId)
    }

    /// Whether the stream follows the node `writer` (the cluster view's writer now).
    pub fn follows(&self, writer: Option<&crate::node_state::NodeState>) -> bool {
        writer.is_some_and(|w| self.followed_node_id() == Some(w.id))
    }

    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

/// How the stream is kept.
#[derive(Debug, Clone, Copy)]
pub struct FeedSettings {
    /// How often pgherd confirms its position and asks the server for a reply (which is how
    /// a silent stream is told from a dead one).
    pub status_interval_ms: u64,
    /// How soon a commit that was decoded but not yet visible is looked at again.
    pub visibility_retry_ms: u64,
}

impl Default for FeedSettings {
    fn default() -> Self {
        FeedSettings {
            status_interval_ms: 500,
            visibility_retry_ms: 2,
        }
    }
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
pub enum FeedError {
    #[error("{0}")]
    Server(#[from] crate::error::ServerError),
    #[error("{0}")]
    Query(String),
    #[error("the server's wal_level is {0}: the result cache needs logical")]
    WalLevel(String),
    #[error("unexpected replication message: {0}")]
    Protocol(String),
    #[error("a commit without its transaction id: starting over")]
    Unattributed,
}

impl From<QueryError> for FeedError {
    fn from(e: QueryError) -> Self {
        FeedError::Query(e.to_string())
    }
}

/// Microseconds from 2000-01-01 (PostgreSQL's epoch) to 1970-01-01 is negative this much.
const POSTGRES_EPOCH_UNIX_SECONDS: u64 = 946_684_800;

/// Follows the primary `spec` names (a superuser or a role with REPLICATION) until the
/// stream fails. The cache serves only while this runs.
pub async fn follow(
    cache: &DatabaseCache,
    spec: &ConnectSpec<'_>,
    slot_name: &str,
    settings: FeedSettings,
) -> FeedError {
    let result = follow_inner(cache, spec, slot_name, settings).await;
    cache.state.lock().went_down();
    match result {
        Ok(never) => match never {},
        Err(e) => e,
    }
}

async fn follow_inner(
    cache: &DatabaseCache,
    spec: &ConnectSpec<'_>,
    slot_name: &str,
    settings: FeedSettings,
) -> Result<std::convert::Infallible, FeedError> {
    let mut checker = server::connect(spec, 0, 1).await?;
    let mut roles = roles_fingerprint(&mut checker).await?;
    let rows = checker.simple_query("SHOW wal_level").await?;
    let wal_level = crate::node_ops::first_value(&rows).unwrap_or_default();
    if wal_level != "logical" {
        return Err(FeedError::WalLevel(wal_level.to_owned()));
    }
    let replication_spec = ConnectSpec {
        replication: true,
        ..*spec
    };
    let mut stream = server::connect(&replication_spec, 0, 1).await?;
    let rows = stream
        .simple_query(&format!(
            "CREATE_REPLICATION_SLOT {slot_name} TEMPORARY LOGICAL test_decoding NOEXPORT_SNAPSHOT"
        ))
        .await?;
    let consistent_point = rows
        .first()
        .and_then(|row| row.get(1).cloned().flatten())
        .and_then(|text| parse_lsn(&text))
        .ok_or_else(|| FeedError::Protocol("CREATE_REPLICATION_SLOT gave no position".into()))?;
    let mut start = BytesMut::new();
    frontend::encode_query(
        &mut start,
        format!(
            "START_REPLICATION SLOT {slot_name} LOGICAL 0/0 (\"include-xids\" '1', \"include-timestamp\" '1', \"skip-empty-xacts\" '0')"
        )
        .as_bytes(),
    )
    .map_err(|e| FeedError::Protocol(e.to_string()))?;
    write_flush(&mut stream.stream, &start)
        .await
        .map_err(|e| FeedError::Protocol(e.to_string()))?;
    loop {
        let (t, body) = read(&mut stream).await?;
        match t {
            tag::COPY_BOTH_RESPONSE => break,
            tag::ERROR_RESPONSE => return Err(server_refused(&body)),
            _ => {}
        }
    }
    cache
        .state
        .lock()
        .went_live(cache.now_ms(), consistent_point);
    tracing::info!(
        database = spec.database,
        slot = slot_name,
        "result cache: following the primary's WAL from {}",
        format_lsn(consistent_point)
    );
    let mut decoder = Decoder::default();
    let mut status = tokio::time::interval(Duration::from_millis(settings.status_interval_ms));
    status.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let retry = Duration::from_millis(settings.visibility_retry_ms);
    loop {
        let pending = cache.state.lock().store.has_held_commits();
        tokio::select! {
            message = read(&mut stream) => {
                let (t, body) = message?;
                if on_message(cache, &mut decoder, t, body)? {
                    send_status(&mut stream, cache).await?;
                }
            }
            _ = status.tick() => {
                send_status(&mut stream, cache).await?;
                check_roles(cache, &mut checker, &mut roles).await?;
            }
            _ = tokio::time::sleep(retry), if pending => check_visibility(cache, &mut checker).await?,
        }
    }
}

async fn read(conn: &mut ServerConn) -> Result<(u8, BytesMut), FeedError> {
    read_message(
        &mut conn.stream,
        &mut conn.read_buf,
        MAX_SERVER_MESSAGE_BYTES,
    )
    .await
    .map_err(|e| FeedError::Server(server::read_err(&conn.node, e)))
}

/// The server's ErrorResponse, as the reason the stream ended.
fn server_refused(body: &[u8]) -> FeedError {
    match pgherd_wire::PgError::parse(body) {
        Ok(err) => FeedError::Query(err.to_string()),
        Err(e) => FeedError::Protocol(e.to_string()),
    }
}

/// One message of the stream; returns whether the server asked for a reply now.
fn on_message(
    cache: &DatabaseCache,
    decoder: &mut Decoder,
    t: u8,
    mut body: BytesMut,
) -> Result<bool, FeedError> {
    match t {
        tag::COPY_DATA => {}
        tag::ERROR_RESPONSE => return Err(server_refused(&body)),
        tag::NOTICE_RESPONSE | tag::PARAMETER_STATUS => return Ok(false),
        other => {
            return Err(FeedError::Protocol(format!(
                "message {} in the stream",
                pgherd_wire::error::tag_name(other)
            )))
        }
    }
    let short = || FeedError::Protocol("a short replication message".into());
    if body.is_empty() {
        return Err(short());
    }
    match body.get_u8() {
        b'w' => {
            if body.len() < 24 {
                return Err(short());
            }
            let data_start = body.get_u64();
            let _wal_end = body.get_u64();
            let _sent_at = body.get_u64();
            let text = String::from_utf8_lossy(&body);
            let commit = decoder
                .feed(&text)
                .map_err(|e| FeedError::Protocol(e.to_string()))?;
            let mut state = cache.state.lock();
            if let Some(commit) = commit {
                if let Some(committed_at_us) = commit.committed_at_unix_us {
                    let delay_us = unix_now_us().saturating_sub(committed_at_us).max(0);
                    cache
                        .invalidation_delay
                        .observe(Duration::from_micros(delay_us as u64));
                }
                // Without its id pgherd could not tell when the commit is visible.
                let Some(xid) = commit.xid else {
                    return Err(FeedError::Unattributed);
                };
                match commit.invalidates {
                    Invalidation::Tables(tables) => {
                        state
                            .store
                            .commit_decoded(xid, tables.into_iter().collect());
                    }
                    Invalidation::All => {
                        state.store.commit_decoded_everything(xid);
                    }
                }
            }
            // Transactions are sent whole at their commits, in commit order: every commit
            // before this message's position has been sent before it.
            state.feed.heard(cache.now_ms(), data_start);
            Ok(false)
        }
        b'k' => {
            if body.len() < 17 {
                return Err(short());
            }
            let sent_through = body.get_u64();
            let _sent_at = body.get_u64();
            let reply_requested = body.get_u8() == 1;
            cache.state.lock().feed.heard(cache.now_ms(), sent_through);
            Ok(reply_requested)
        }
        other => Err(FeedError::Protocol(format!(
            "replication message {:?}",
            other as char
        ))),
    }
}

fn unix_now_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}

/// Confirms what was decoded (so the slot holds no WAL back) and asks for a reply.
async fn send_status(conn: &mut ServerConn, cache: &DatabaseCache) -> Result<(), FeedError> {
    let decoded = cache.state.lock().feed.decoded_lsn();
    let now_us = unix_now_us() - (POSTGRES_EPOCH_UNIX_SECONDS as i64) * 1_000_000;
    let mut update = BytesMut::with_capacity(40);
    write_message(&mut update, frontend::tag::COPY_DATA, |b| {
        b.put_u8(b'r');
        // Written, flushed and applied: all of it, once decoded.
        b.put_u64(decoded);
        b.put_u64(decoded);
        b.put_u64(decoded);
        b.put_i64(now_us);
        // Reply at once: how a silent stream is told from a dead one.
        b.put_u8(1);
    })
    .map_err(|e| FeedError::Protocol(e.to_string()))?;
    write_flush(&mut conn.stream, &update)
        .await
        .map_err(|e| FeedError::Protocol(e.to_string()))
}

/// Who may read what beyond the database's own catalog: role memberships (with their
/// options), the roles and their attributes, and role and database settings (`ALTER ROLE
/// ... SET`), whole rows. They live in shared catalogs, which no event trigger and no
/// decoding sees, so they are compared each status period.
const ROLES_SQL: &str = "\
SELECT pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(pg_catalog.concat_ws('|', \
  (SELECT pg_catalog.string_agg(m::text, ',' ORDER BY m::text) FROM pg_catalog.pg_auth_members m), \
  (SELECT pg_catalog.string_agg(r::text, ',' ORDER BY r.oid) FROM pg_catalog.pg_roles r), \
  (SELECT pg_catalog.string_agg(s::text, ',' ORDER BY s::text) FROM pg_catalog.pg_db_role_setting s)), \
  'UTF8')), 'hex')";

async fn roles_fingerprint(conn: &mut ServerConn) -> Result<String, FeedError> {
    let rows = conn.simple_query(ROLES_SQL).await?;
    Ok(crate::node_ops::first_value(&rows)
        .unwrap_or_default()
        .to_owned())
}

/// Drops every entry when roles changed since the last look (a `REVOKE role FROM user`
/// served no older answer from then on).
async fn check_roles(
    cache: &DatabaseCache,
    conn: &mut ServerConn,
    last: &mut String,
) -> Result<(), FeedError> {
    let now = roles_fingerprint(conn).await?;
    if now != *last {
        let dropped = cache.state.lock().store.drop_all();
        tracing::info!(
            dropped,
            "result cache: roles or their settings changed; every entry dropped"
        );
        *last = now;
    }
    Ok(())
}

/// Asks the primary for a snapshot; the held commits it shows visible are visible to every
/// snapshot from now on, and their tables may take entries again.
async fn check_visibility(cache: &DatabaseCache, conn: &mut ServerConn) -> Result<(), FeedError> {
    let rows = conn
        .simple_query(
            "SELECT pg_catalog.pg_snapshot_xmax(s)::text, x::text \
             FROM pg_catalog.pg_current_snapshot() AS s \
             LEFT JOIN pg_catalog.pg_snapshot_xip(s) AS x ON true",
        )
        .await?;
    let low_bits = |text: &Option<String>| {
        text.as_deref()
            .and_then(|t| t.parse::<u64>().ok())
            .map(|xid8| xid8 as u32)
    };
    let xmax = rows
        .first()
        .and_then(|row| row.first())
        .and_then(low_bits)
        .ok_or_else(|| FeedError::Query("the primary's snapshot had no xmax".into()))?;
    let in_progress: HashSet<u32> = rows
        .iter()
        .filter_map(|row| row.get(1).and_then(low_bits))
        .collect();
    cache.state.lock().store.commits_visible(xmax, &in_progress);
    Ok(())
}
