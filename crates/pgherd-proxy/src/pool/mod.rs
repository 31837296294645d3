//! Server connection pools, one per (database, user, node).
//!
//! A pool's idle connections, its count of connections and its FIFO of waiting clients are an
//! [`exchange::Exchange`]: on a warm pool a transaction takes a connection from its worker's
//! own lane and gives it back there, writing nothing another worker writes; a released
//! connection goes straight to the first waiting client if there is one. Every connection is
//! counted exactly once in the total, whether idle, lent out, or still connecting, so
//! `max_size` is never exceeded. Connections are boxed, so lending one out moves a pointer;
//! taking an idle one needs no await.

mod exchange;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use parking_lot::Mutex;
use pgherd_config::PoolSettings;
use pgherd_wire::backend::TxStatus;
use pgherd_wire::startup::CancelKey;
use pgherd_wire::{PgError, SqlState};
use tokio::time::Instant;

use crate::counters::StripedCounter;
use crate::error::ServerError;
use crate::relay::statements::ServerStatements;
use crate::server::{self, ConnectSpec, ServerConn, ServerCredentials};
use crate::stream::Stream;
use exchange::{Closed, Exchange, Handoff, Next};

/// A connection released this recently is handed out without a liveness check.
const TRUST_RECENTLY_USED: Duration = Duration::from_millis(500);

/// A slot counted in `total` while its connection opens; given back unless the opening
/// succeeds (it failed, or it was abandoned because the waiting request was cancelled).
struct ConnectingSlot<'a> {
    pool: &'a Pool,
}

impl Drop for ConnectingSlot<'_> {
    fn drop(&mut self) {
        self.pool.idle.unmade();
    }
}

/// A place in the pool's wait queue. If the waiter is dropped just after a connection was
/// handed to it, that connection goes back to the pool instead of vanishing with the channel.
struct WaitTicket<'a> {
    pool: &'a Pool,
    rx: tokio::sync::oneshot::Receiver<Handoff<Box<ServerConn>>>,
}

impl Drop for WaitTicket<'_> {
    fn drop(&mut self) {
        self.rx.close();
        match self.rx.try_recv() {
            Ok(Handoff::Item(conn)) => self.pool.release(conn, true),
            // The free slot it was told about goes to the next waiter.
            Ok(Handoff::Retry) => self.pool.idle.pass_retry_on(),
            Err(_) => {}
        }
    }
}

/// Counters for SHOW POOLS / SHOW STATS.
#[derive(Debug, Default)]
pub struct PoolStats {
    /// Written by every transaction: striped by thread (`counters`), summed when read.
    pub transactions: StripedCounter,
    pub queries: StripedCounter,
    /// Written only by requests that waited.
    pub wait_us_max: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub wait_timeouts: AtomicU64,
    /// Bytes written to this pool's server connections (client messages, pgherd's own
    /// statements) and to clients from them.
    pub bytes_to_servers: StripedCounter,
    pub bytes_to_clients: StripedCounter,
    /// From a transaction's first message (or its wait for a server) to the ReadyForQuery
    /// that ends it.
    pub transaction_time: crate::counters::Histogram,
    /// Waits of requests that found no idle connection (the fast path is not timed).
    pub wait_time: crate::counters::Histogram,
    /// Errors the servers sent to clients.
    pub server_errors: crate::counters::ErrorClasses,
}

/// A pool's view of the node it connects to.
#[derive(Debug, Clone)]
pub struct NodeAddress {
    pub name: String,
    pub host: String,
    pub port: u16,
    pub socket_dir: Option<std::path::PathBuf>,
}

/// The settings every release reads, copied out of `Pool::settings` so that giving a
/// connection back takes no slot of the thread's debt list (as a load of the settings does).
struct ReleaseLimits {
    max_size: AtomicU32,
    server_lifetime_ms: AtomicU64,
}

impl ReleaseLimits {
    fn new(settings: &PoolSettings) -> Self {
        ReleaseLimits {
            max_size: AtomicU32::new(settings.max_size),
            server_lifetime_ms: AtomicU64::new(settings.server_lifetime_ms),
        }
    }

    fn set(&self, settings: &PoolSettings) {
        self.max_size.store(settings.max_size, Ordering::Relaxed);
        self.server_lifetime_ms
            .store(settings.server_lifetime_ms, Ordering::Relaxed);
    }
}

/// Shared pieces a pool needs to open connections.
pub struct ConnectContext {
    pub tls_mode: pgherd_config::ServerTlsMode,
    pub tls: Option<tokio_rustls::TlsConnector>,
    /// Shared across reloads so server ids never repeat.
    pub next_server_id: Arc<AtomicU64>,
}

/// ParameterStatus values a server reported: (name, value).
pub type ReportedParams = Vec<(String, String)>;

pub struct Pool {
    pub database: String,
    pub user: String,
    pub server_dbname: String,
    pub node: NodeAddress,
    settings: ArcSwap<PoolSettings>,
    /// `settings`' limits on a release, kept in step by `update_settings`.
    release_limits: ReleaseLimits,
    /// Idle connections, the count of all, and the clients waiting.
    idle: Exchange<Box<ServerConn>>,
    /// `RECONNECT`: connections opened at or before this instant (`since_epoch_ns`; 0 for
    /// none) close when they are released. Read by every release, so kept outside any lock.
    reconnect_before_ns: AtomicU64,
    /// Where `reconnect_before_ns` counts from.
    epoch: Instant,
    /// Lent connections `RECONNECT` asked to close, still out (`WAIT_CLOSE`). Its lock also
    /// orders a stale connection's closing against `RECONNECT`'s counting.
    close_needed: Mutex<u32>,
    pub stats: PoolStats,
    /// ParameterStatus values from the newest login, shown to clients at their login.
    template_params: Mutex<Arc<Vec<(String, String)>>>,
    /// Startup settings a server accepted, by their fingerprint, with what it reported for
    /// them: clients sending the same ones log in without asking a server again.
    validated: Mutex<HashMap<u64, Arc<ReportedParams>>>,
    credentials: Arc<Mutex<ServerCredentials>>,
}

#[derive(Debug)]
pub enum AcquireError {
    WaitTimeout { waited: Duration, max_size: u32 },
    Server(ServerError),
    Closed,
}

impl AcquireError {
    /// What the client whose request waited is told.
    pub fn to_client_error(&self, database: &str, user: &str, node: &str) -> PgError {
        match self {
            AcquireError::WaitTimeout { waited, max_size } => PgError::error(
                SqlState::TOO_MANY_CONNECTIONS,
                format!(
                    "no server connection became free within {} ms (pool for database \"{database}\", user \"{user}\" on node {node} has max_size {max_size})",
                    waited.as_millis(),
                ),
            )
            .with_hint("raise pool.max_size or pool.wait_timeout_ms, or shorten transactions"),
            AcquireError::Server(e) => e.to_client_error(),
            AcquireError::Closed => {
                PgError::error(SqlState::CANNOT_CONNECT_NOW, "the pool was closed; retry the request")
            }
        }
    }
}

/// A snapshot for SHOW POOLS.
#[derive(Debug, Clone)]
pub struct PoolSnapshot {
    pub idle: u32,
    pub lent: u32,
    pub connecting: u32,
    pub waiting: usize,
    pub max_size: u32,
    pub mode: pgherd_config::PoolMode,
}

impl Pool {
    pub fn new(
        database: String,
        user: String,
        server_dbname: String,
        node: NodeAddress,
        settings: PoolSettings,
        credentials: Arc<Mutex<ServerCredentials>>,
    ) -> Self {
        Pool {
            database,
            user,
            server_dbname,
            node,
            release_limits: ReleaseLimits::new(&settings),
            settings: ArcSwap::from_pointee(settings),
            idle: Exchange::default(),
            reconnect_before_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            close_needed: Mutex::new(0),
            stats: PoolStats::default(),
            template_params: Mutex::new(Arc::default()),
            validated: Mutex::default(),
            credentials,
        }
    }

    pub fn settings(&self) -> Arc<PoolSettings> {
        self.settings.load_full()
    }

    pub fn update_settings(&self, settings: PoolSettings) {
        self.release_limits.set(&settings);
        self.settings.store(Arc::new(settings));
        // A larger pool may let waiters connect now.
        self.idle.wake_all_to_retry();
    }

    pub fn template_params(&self) -> Arc<Vec<(String, String)>> {
        self.template_params.lock().clone()
    }

    pub fn has_template_params(&self) -> bool {
        !self.template_params.lock().is_empty()
    }

    /// What a server reported for startup settings with this fingerprint, if it accepted
    /// them before.
    pub fn validated_settings(&self, fingerprint: u64) -> Option<Arc<ReportedParams>> {
        self.validated.lock().get(&fingerprint).cloned()
    }

    pub fn remember_validated_settings(&self, fingerprint: u64, reported: Vec<(String, String)>) {
        /// Distinct startup settings remembered per pool.
        const MAX_VALIDATED: usize = 256;
        let mut validated = self.validated.lock();
        if validated.len() >= MAX_VALIDATED {
            validated.clear();
        }
        validated.insert(fingerprint, Arc::new(reported));
    }

    /// The idle connections: (server id, backend pid, age, idle for).
    pub fn idle_servers(&self) -> Vec<(u64, i32, Duration, Duration)> {
        let now = Instant::now();
        self.idle.map_idle(|c| {
            (
                c.id,
                c.cancel_key.process_id,
                now.duration_since(c.created_at),
                now.duration_since(c.last_used),
            )
        })
    }

    pub fn snapshot(&self) -> PoolSnapshot {
        let settings = self.settings.load();
        let counts = self.idle.counts();
        PoolSnapshot {
            idle: counts.idle,
            lent: counts.lent,
            connecting: counts.connecting,
            waiting: counts.waiting as usize,
            max_size: settings.max_size,
            mode: settings.mode,
        }
    }

    /// An idle connection, if one is ready now: the path every transaction takes when the pool
    /// is warm. No await, no allocation, nothing another worker writes. `now` is the caller's
    /// reading of the clock for this request (taken before it was routed: one reading serves
    /// the whole request, and a connection is trusted for at most that much longer).
    pub fn try_acquire(&self, now: Instant) -> Option<Box<ServerConn>> {
        loop {
            let conn = self.idle.try_take()?;
            if let Some(conn) = self.check_idle_conn(conn, now) {
                return Some(conn);
            }
        }
    }

    /// Takes a connection: an idle one, a new one if below `max_size`, or the next one released
    /// within the wait timeout. Safe to drop at any await (a cancelled wait): a slot being
    /// connected is given back, and a connection handed over at that moment returns to the pool.
    pub async fn acquire(&self, ctx: &ConnectContext) -> Result<Box<ServerConn>, AcquireError> {
        let started = Instant::now();
        let (wait_timeout, max_size) = {
            let s = self.settings.load();
            (s.wait_timeout(), s.max_size)
        };
        // Only requests that found no idle connection are timed (`wait_time`), as its metric
        // says.
        let mut found_none_idle = false;
        loop {
            let next = self
                .idle
                .next(self.settings.load().max_size)
                .map_err(|Closed| AcquireError::Closed)?;
            match next {
                Next::Take(conn) => match self.check_idle_conn(conn, Instant::now()) {
                    Some(conn) if found_none_idle => return Ok(self.record_wait(conn, started)),
                    Some(conn) => return Ok(conn),
                    None => continue,
                },
                Next::Make => {
                    let conn = self.open(ctx).await?;
                    return Ok(self.record_wait(conn, started));
                }
                Next::Wait(rx) => {
                    found_none_idle = true;
                    let remaining = wait_timeout.saturating_sub(started.elapsed());
                    let mut ticket = WaitTicket { pool: self, rx };
                    match tokio::time::timeout(remaining, &mut ticket.rx).await {
                        Ok(Ok(Handoff::Item(conn))) => {
                            match self.check_idle_conn(conn, Instant::now()) {
                                Some(conn) => return Ok(self.record_wait(conn, started)),
                                None => continue,
                            }
                        }
                        Ok(Ok(Handoff::Retry)) => continue,
                        // The pool dropped our sender: it is closing.
                        Ok(Err(_)) => return Err(AcquireError::Closed),
                        Err(_) => {
                            self.stats.wait_timeouts.fetch_add(1, Ordering::Relaxed);
                            return Err(AcquireError::WaitTimeout {
                                waited: started.elapsed(),
                                max_size,
                            });
                        }
                    }
                }
            }
        }
    }

    fn record_wait(&self, conn: Box<ServerConn>, started: Instant) -> Box<ServerConn> {
        let waited = started.elapsed();
        self.stats.wait_time.observe(waited);
        self.stats
            .wait_us_max
            .fetch_max(waited.as_micros() as u64, Ordering::Relaxed);
        conn
    }

    /// Opens a connection for a slot already reserved; it is lent once open.
    async fn open(&self, ctx: &ConnectContext) -> Result<Box<ServerConn>, AcquireError> {
        let slot = ConnectingSlot { pool: self };
        let credentials = self.credentials.lock().clone();
        let settings = self.settings.load_full();
        let spec = ConnectSpec {
            node: &self.node.name,
            host: &self.node.host,
            port: self.node.port,
            user: &self.user,
            database: &self.server_dbname,
            credentials: &credentials,
            tls_mode: ctx.tls_mode,
            tls: ctx.tls.as_ref(),
            timeout: Duration::from_millis(settings.server_connect_timeout_ms),
            replication: false,
            socket_dir: self.node.socket_dir.as_deref(),
        };
        let id = ctx.next_server_id.fetch_add(1, Ordering::Relaxed);
        self.stats.connects.fetch_add(1, Ordering::Relaxed);
        match server::connect(&spec, id, settings.prepared_statements_per_server).await {
            Ok(conn) => {
                std::mem::forget(slot);
                self.idle.made();
                *self.template_params.lock() = Arc::new(conn.reported.clone());
                tracing::debug!(server = id, node = %self.node.name, db = %self.database, user = %self.user, "server connection opened");
                Ok(Box::new(conn))
            }
            Err(e) => {
                self.stats.connect_failures.fetch_add(1, Ordering::Relaxed);
                drop(slot);
                Err(AcquireError::Server(e))
            }
        }
    }

    /// Drops an idle connection that died while it sat in the pool. Connections back from
    /// work a moment ago are trusted (a failure is still caught by the relay); older ones are
    /// checked through the reactor's readiness, which costs no syscall unless data arrived.
    fn check_idle_conn(&self, conn: Box<ServerConn>, now: Instant) -> Option<Box<ServerConn>> {
        if now.saturating_duration_since(conn.last_used) < TRUST_RECENTLY_USED {
            return Some(conn);
        }
        let mut cx = Context::from_waker(Waker::noop());
        if conn.stream.poll_read_ready(&mut cx).is_ready() {
            // Readiness may be stale; only bytes or EOF prove something happened.
            let mut probe = [0u8; 1];
            if let Some(read) = conn.stream.try_read_plain(&mut probe) {
                if read.is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock) {
                    return Some(conn);
                }
                tracing::info!(server = conn.id, node = %conn.node, "closing server connection: it closed or spoke while idle");
                self.release(conn, false);
                return None;
            }
        }
        Some(conn)
    }

    /// A connection that arrives lent: a session's, moved here with it by an upgrade
    /// (`crate::handover`). Counted as opened and lent, as if this pool had opened it for the
    /// session; `None` once the pool is closed.
    pub fn adopt(
        &self,
        ctx: &ConnectContext,
        stream: Stream,
        peer: server::ServerAddr,
        cancel_key: CancelKey,
        reported: Vec<(String, String)>,
    ) -> Option<Box<ServerConn>> {
        if !self.idle.adopt() {
            return None;
        }
        let now = Instant::now();
        Some(Box::new(ServerConn {
            id: ctx.next_server_id.fetch_add(1, Ordering::Relaxed),
            stream,
            node: self.node.name.clone(),
            peer,
            cancel_key,
            reported,
            params_fp: crate::relay::params::BASELINE,
            residue: Default::default(),
            statements: ServerStatements::new(self.settings.load().prepared_statements_per_server),
            created_at: now,
            last_used: now,
            tx_status: TxStatus::Idle,
            read_buf: BytesMut::new(),
            write_buf: BytesMut::new(),
        }))
    }

    /// Returns a lent connection. `reusable` is false when the connection is broken or its
    /// state unknown; it is then closed.
    pub fn release(&self, conn: Box<ServerConn>, reusable: bool) {
        self.release_at(conn, reusable, Instant::now());
    }

    /// [`Self::release`] with the time already read: a session reads the clock when its
    /// transaction ends, and gives the connection back moments later.
    pub fn release_at(&self, mut conn: Box<ServerConn>, reusable: bool, now: Instant) {
        let lifetime_ms = self
            .release_limits
            .server_lifetime_ms
            .load(Ordering::Relaxed);
        let expired = lifetime_ms > 0
            && now.duration_since(conn.created_at) >= Duration::from_millis(lifetime_ms);
        let keep = reusable
            && !expired
            && conn.tx_status == TxStatus::Idle
            && conn.read_buf.is_empty()
            && conn.write_buf.is_empty()
            // Above the limit after the pool shrank.
            && self.idle.total() <= self.release_limits.max_size.load(Ordering::Relaxed);
        conn.last_used = now;
        let refused = if keep {
            match self
                .idle
                .give_back(conn, |c| !self.opened_before_reconnect(c))
            {
                Ok(()) => return,
                Err(refused) => refused,
            }
        } else {
            conn
        };
        {
            // Under the lock `reconnect` counts under: a connection it counted as lent is
            // found opened before it here, and one closed first was not counted.
            let mut close_needed = self.close_needed.lock();
            if self.opened_before_reconnect(&refused) {
                *close_needed = close_needed.saturating_sub(1);
            }
            self.idle.discard();
        }
        tracing::debug!(server = refused.id, node = %refused.node, reusable, expired, "server connection closed");
    }

    /// Whether `RECONNECT` asked for this connection to close: it was opened at or before
    /// the newest one (which only ever moves later).
    fn opened_before_reconnect(&self, conn: &ServerConn) -> bool {
        let before_ns = self.reconnect_before_ns.load(Ordering::SeqCst);
        before_ns != 0 && self.since_epoch_ns(conn.created_at) <= before_ns
    }

    fn since_epoch_ns(&self, at: Instant) -> u64 {
        u64::try_from(at.duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Periodic upkeep: closes idle connections past their idle timeout or lifetime and
    /// reports how many connections are missing to reach `min_size`.
    pub fn maintain(&self) -> u32 {
        let settings = self.settings.load_full();
        let idle_limit = Duration::from_millis(settings.server_idle_timeout_ms);
        let life_limit = Duration::from_millis(settings.server_lifetime_ms);
        let closing = self.idle.retain_idle(|conn, total| {
            let idle_too_long = settings.server_idle_timeout_ms > 0
                && conn.last_used.elapsed() >= idle_limit
                && total > settings.min_size;
            let too_old =
                settings.server_lifetime_ms > 0 && conn.created_at.elapsed() >= life_limit;
            let over_size = total > settings.max_size;
            !(idle_too_long || too_old || over_size)
        });
        for conn in closing {
            tracing::debug!(server = conn.id, node = %conn.node, "closing idle server connection (idle timeout, lifetime or pool shrink)");
        }
        if self.idle.is_closed() {
            0
        } else {
            settings.min_size.saturating_sub(self.idle.total())
        }
    }

    /// Opens one connection towards `min_size` and parks it idle.
    pub async fn warm_up_one(&self, ctx: &ConnectContext) -> Result<(), AcquireError> {
        let below = self.settings.load().min_size;
        if !self.idle.reserve(below).unwrap_or(false) {
            return Ok(());
        }
        let conn = self.open(ctx).await?;
        self.release(conn, true);
        Ok(())
    }

    /// Closes idle connections and refuses new acquisitions; lent ones close on release.
    pub fn close(&self) {
        drop(self.idle.close());
    }

    /// `RECONNECT`: idle connections close now, lent ones when they come back, so every
    /// server connection of the pool is opened anew (after a change on the server side, such
    /// as a moved database or new settings). Returns how many are still lent out.
    pub fn reconnect(&self) -> u32 {
        let mut close_needed = self.close_needed.lock();
        let now_ns = self.since_epoch_ns(Instant::now()).max(1);
        self.reconnect_before_ns.store(now_ns, Ordering::SeqCst);
        // Idle connections exist only while nobody waits: closing them wakes no one. A
        // connection given back from here on is refused (`opened_before_reconnect`), and
        // one closing for that waits for this lock, so the count below includes it.
        let (idle, counts) = self.idle.take_idle();
        *close_needed = counts.lent;
        drop(close_needed);
        drop(idle);
        counts.lent
    }

    /// Connections `RECONNECT` asked to close that are still lent out (`WAIT_CLOSE`).
    pub fn close_needed(&self) -> u32 {
        *self.close_needed.lock()
    }

    /// Closes idle connections now, keeping the pool open.
    pub fn drop_idle(&self) {
        drop(self.idle.take_idle());
    }

    pub fn total(&self) -> u32 {
        self.idle.total()
    }

    pub fn is_closed(&self) -> bool {
        self.idle.is_closed()
    }
}
