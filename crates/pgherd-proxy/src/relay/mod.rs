//! The data path: one [`Session`] per logged-in client, relaying between the client socket and
//! the server connection it holds at the moment.
//!
//! The session is one poll-driven state machine ([`Session::poll_step`]). *Idle*: no server
//! connection and no buffers; it waits for the client's socket to become readable. *Attached*:
//! it holds a server connection and pumps bytes both ways, reading and writing whichever side
//! can make progress, so a client that pipelines without reading (or a server streaming a huge
//! result) can never deadlock the pair. In transaction and statement mode the server goes back
//! to the pool as soon as the response queue says it owes nothing and the transaction is over.
//!
//! The warm path of a transaction (take an idle server, relay, give it back) takes no await
//! beyond socket readiness, no allocation, and no lock but the pool's.

mod attach;
mod cached;
pub(crate) use attach::wait_for_replay;
pub(crate) use moving::{client_for_handover, Movable};
pub(crate) use server_input::primary_may_answer;
mod client_input;
mod client_stream;
mod detach;
mod extended_request;
mod moving;
pub mod params;
mod parked;
mod read_wakes;
mod routing_state;
pub use parked::ParkedSession;
pub mod probe;
pub mod queue;
mod server_input;
pub mod statements;
mod tx_settings;

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use pgherd_config::{PoolMode, Route};
use pgherd_route::balance::{insert_lsn_as_end, parse_lsn, Lsn};
use pgherd_route::{Pin as RoutePin, SessionEffect, Target as RouteTarget, TxEffect};
use pgherd_wire::backend::{self, tag as btag, TxStatus};
use pgherd_wire::frame::{read_header, HEADER_BYTES};
use pgherd_wire::frontend::{self, tag as ftag, Target};
use pgherd_wire::{PgError, SqlState, WireError};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_util::io::poll_read_buf;

use crate::app::{App, PoolCache};
use crate::buffers;
use crate::clients::{ClientShared, ServerTarget, SIGNAL_HANDOVER, SIGNAL_KILL, SIGNAL_SHUTDOWN};
use crate::counters::GaugeStripe;
use crate::error::{client_io, Disconnect, ServerError, ServerErrorKind};
use crate::nodes::{NodeState, Role, PRIMARY_RECHECK};
use crate::pool::{AcquireError, Pool};
use crate::routing::Routed;
use crate::server::{ServerConn, MAX_SERVER_MESSAGE_BYTES};
use crate::stream::{poll_read_when_ready, Stream};
use params::{SessionParams, UNKNOWN};
use pgherd_route::may_change_session;
use queue::{Probe, Request, ResponseQueue, Synthetic};
use statements::{ClientStatements, Holding, StatementDef, StatementError};

pub(crate) use routing_state::read_needs;
pub use routing_state::RoutingSetup;
use routing_state::{
    Replay, Routing, LSN_PROBE_SQL, MAX_REPLAYS, REPLAY_POLL_INTERVAL, REPLAY_QUICK_ASKS,
};

/// Stop reading from one side while this much is waiting to be written to the other.
const HIGH_WATER_BYTES: usize = 256 << 10;
/// How long cleaning up after a departed client may take before the server is dropped.
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(5);

/// The text of the client's unnamed statement.
#[derive(Default)]
struct UnnamedStatement {
    query: Vec<u8>,
    param_types: Vec<u8>,
    /// False once the client closed it (the buffers are kept for reuse).
    present: bool,
    routed: Option<Routed>,
}

impl UnnamedStatement {
    /// The client prepared it and its text may change session settings.
    fn may_change_session(&self) -> bool {
        self.present && may_set(&self.query, self.routed.as_ref())
    }
}

/// Whether `sql` may change session settings: the lexer's answer, found with the text's
/// shape, when the text was routed (`routed`); the plain check otherwise.
fn may_set(sql: &[u8], routed: Option<&Routed>) -> bool {
    routed.map_or_else(
        || may_change_session(sql),
        |routed| routed.may_change_session,
    )
}

/// The server connection a session holds.
struct Lease {
    conn: Box<ServerConn>,
    pool: Arc<Pool>,
    node: Arc<NodeState>,
    /// Where `node` counted this lease (`NodeState::begin_lease`).
    counted: GaugeStripe,
    /// The node was a replica when the lease began.
    on_replica: bool,
    flush_pending: bool,
    /// The client's unnamed statement exists on this server connection.
    unnamed_here: bool,
    /// Bytes written to the server and to the client since they were last added to the
    /// pool's counters: counted here per write, added there once per transaction (a shared
    /// counter per socket write would be contended by every session of the pool).
    bytes_to_server: u64,
    bytes_to_client: u64,
}

impl Lease {
    /// Adds the bytes counted so far to the pool's counters.
    fn flush_byte_counts(&mut self) {
        let stats = &self.pool.stats;
        if self.bytes_to_server > 0 {
            stats
                .bytes_to_servers
                .add(std::mem::take(&mut self.bytes_to_server));
        }
        if self.bytes_to_client > 0 {
            stats
                .bytes_to_clients
                .add(std::mem::take(&mut self.bytes_to_client));
        }
    }
}

/// A server connection a session starts with: session mode keeps the one its login used,
/// whose process id the client was given.
pub struct Held {
    pub node: Arc<NodeState>,
    pub pool: Arc<Pool>,
    pub conn: Box<ServerConn>,
}

/// Custom setting names a session's probes ask for, at most.
const MAX_CUSTOM_SETTINGS: usize = 64;

/// What the session loop must do next that needs an await.
enum Step {
    /// A request needs a server connection.
    NeedServer,
    /// The server owes nothing and the transaction is over: give it back.
    Release,
    /// Boxed: rare, and large enough to double the size of every idle session's task.
    ServerFailed(Box<ServerError>),
    /// A replica refused the request as a standby must: run it on the primary.
    RefusedByStandby,
}

/// The directions that answered Pending in the current turn of the pump.
#[derive(Default)]
struct Blocked {
    server_write: bool,
    client_write: bool,
    server_read: bool,
    client_read: bool,
}

/// Where a relay step failed.
enum Relayed {
    Server(ServerError),
    Client(Disconnect),
}

impl From<WireError> for Relayed {
    fn from(e: WireError) -> Self {
        Relayed::Client(Disconnect::Protocol(e))
    }
}

impl From<Disconnect> for Relayed {
    fn from(d: Disconnect) -> Self {
        Relayed::Client(d)
    }
}

fn server_failed<T>(node: &str, kind: ServerErrorKind) -> Poll<Result<T, Relayed>> {
    Poll::Ready(Err(Relayed::Server(ServerError::new(node, kind))))
}

/// What a session keeps of shared values it reads on every plan ([`Session::pick_node`]) and
/// every result-cache check.
struct Seen {
    config: crate::app::ConfigCache,
    nodes: crate::nodes::NodesCache,
}

/// The parameters a session starts with.
pub struct SessionSetup {
    pub app: Arc<App>,
    pub shared: Arc<ClientShared>,
    pub client: Stream,
    /// Bytes the client sent after its startup packet, already read.
    pub client_in: BytesMut,
    pub mode: PoolMode,
    pub routing: RoutingSetup,
    pub params: SessionParams,
}

/// What the client knows about its current session, kept across server connections.
pub struct Session {
    app: Arc<App>,
    pub shared: Arc<ClientShared>,
    client: Stream,
    client_in: BytesMut,
    client_out: BytesMut,
    client_flush_pending: bool,
    mode: PoolMode,
    routing: Routing,
    max_message_bytes: usize,
    lease: Option<Lease>,
    /// Which socket woke the session in the pump (`read_wakes`); made at its first turn there.
    read_wakes: Option<read_wakes::ReadWakes>,
    /// The pools used, the last first, to skip the registry on the next attach.
    pools: PoolCache,
    /// The config, and the nodes and cluster view, as this session last saw them: each plan
    /// checks them against the shared ones instead of loading those.
    seen: Seen,
    queue: ResponseQueue,
    /// Created at the client's first named statement.
    statements: Option<Box<ClientStatements>>,
    /// The client's last unnamed Parse, replayed if a later Bind lands on another server.
    /// Boxed and reused: most clients never send one, and an idle client should be small.
    unnamed: Option<Box<UnnamedStatement>>,
    /// Statement text bound to the unnamed portal, when it might change session settings.
    portal_sql: Option<Box<[u8]>>,
    params: SessionParams,
    /// A statement changed session state in a way pgherd could not follow.
    untracked_change: bool,
    /// The client's current transaction saw an error or a rollback.
    tx_failed: bool,
    /// Savepoints and the statements of the request at hand, as far as settings need them.
    tx_settings: Option<Box<tx_settings::TxSettings>>,
    /// When the current transaction's first request arrived (for the latency histogram).
    tx_started: Option<Instant>,
    /// When the last transaction on the held server ended: the time the server is given
    /// back at, without reading the clock again.
    tx_ended: Option<tokio::time::Instant>,
    /// Where the step's try at a server left off, for the session loop to wait from.
    waiting: Option<Box<attach::Waiting>>,
    client_tx: TxStatus,
    /// Bytes of a streamed COPY message still to pass from the client to the server.
    client_stream: Option<client_stream::ClientStream>,
    /// Bytes of a streamed message still to pass from the server; `true` if they go to the
    /// client, `false` if they are dropped.
    server_passthrough: Option<(bool, usize)>,
    /// After pgherd answered a request with an error without a server, skip the client's
    /// messages until its Sync and answer that Sync itself.
    local_skip_to_sync: bool,
    /// An error to give the client in answer to its next request (its transaction was lost).
    pending_error: Option<Box<PgError>>,
    /// A server's last words before it closed (FATAL), reported when the close is noticed.
    server_last_words: Option<Box<PgError>>,
    /// Rows of a session-state probe in flight (`relay::probe`); `Some(Err)` if it failed.
    probe_rows: Option<Box<Result<Vec<probe::Row>, ()>>>,
    /// Custom settings the client set with `set_config` for its session, which a probe asks
    /// for (PostgreSQL lists no placeholder settings).
    custom_settings: Vec<String>,
    /// Answers pgherd owes right after a server message still streaming to the client.
    after_stream: Vec<queue::Synthetic>,
    /// Acknowledgements (ParseComplete, BindComplete, descriptions) of a request sent again on
    /// another server that the client already got from the first: dropped.
    skip_preliminaries: u32,
    /// An answer being kept for the result cache on its way to the client.
    fill: Option<Box<cached::Fill>>,
    /// An extended-protocol request asked to be cached that the cache did not answer, found
    /// in the idle phase; its first Parse or Bind takes it.
    cache_candidate: Option<Box<cached::CacheCandidate>>,
    /// pgherd is shutting down: end the session at the next point where it is idle.
    stop_when_idle: bool,
    /// pgherd is being upgraded: move the session to the new process at the next point where
    /// it is idle, or end it saying why it cannot move (`moving.rs`).
    move_when_idle: bool,
    /// 0 disables.
    idle_timeout_ms: u64,
    idle_timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Session {
    pub fn new(setup: SessionSetup) -> Session {
        let SessionSetup {
            app,
            shared,
            client,
            client_in,
            mode,
            routing,
            params,
        } = setup;
        let routing = Routing::new(routing, params.flags);
        Session::assemble(app, shared, client, client_in, mode, routing, params)
    }

    /// A session between transactions, routed by `routing` (new, or taken up again).
    fn assemble(
        app: Arc<App>,
        shared: Arc<ClientShared>,
        client: Stream,
        client_in: BytesMut,
        mode: PoolMode,
        routing: Routing,
        params: SessionParams,
    ) -> Session {
        let config = app.config();
        let idle_ms = config.proxy.client_idle_timeout_ms;
        let seen = Seen {
            config: app.config_cache(),
            nodes: app.nodes.cache(),
        };
        let session = Session {
            max_message_bytes: config.proxy.max_message_bytes,
            idle_timeout_ms: idle_ms,
            idle_timer: None,
            app,
            shared,
            client,
            client_in,
            client_out: BytesMut::new(),
            client_flush_pending: false,
            mode,
            routing,
            lease: None,
            read_wakes: None,
            pools: PoolCache::default(),
            seen,
            queue: ResponseQueue::default(),
            statements: None,
            unnamed: None,
            portal_sql: None,
            params,
            untracked_change: false,
            tx_failed: false,
            tx_settings: None,
            tx_started: None,
            tx_ended: None,
            waiting: None,
            client_tx: TxStatus::Idle,
            client_stream: None,
            server_passthrough: None,
            local_skip_to_sync: false,
            pending_error: None,
            server_last_words: None,
            probe_rows: None,
            custom_settings: Vec::new(),
            skip_preliminaries: 0,
            after_stream: Vec::new(),
            fill: None,
            cache_candidate: None,
            stop_when_idle: false,
            move_when_idle: false,
        };
        if session.may_ever_park() {
            session.shared.set_may_park(true);
        }
        session
    }

    /// Starts holding the server connection the login used.
    pub fn hold(&mut self, held: Held) -> Result<(), PgError> {
        let Held { node, pool, conn } = held;
        self.pools.put_last(node.clone(), pool.clone());
        self.take_lease(node, pool, conn)
    }

    /// Relays until the client leaves or is sent away; returns why, after cleaning up.
    pub async fn run(&mut self) -> Disconnect {
        let end = self.serve().await;
        if matches!(end, Disconnect::Parked) {
            return end;
        }
        tracing::debug!(client = self.shared.id, reason = %end, holding_server = self.lease.is_some(), "session ending");
        if matches!(end, Disconnect::Moved) && self.lease.is_some() {
            // Its server connection goes with it, as it is: nothing is reset or given back
            // until the new process has it (or could not take it: see `farewell`).
            return end;
        }
        // Cleanup can wait on a server: keep its state out of the session's own future.
        Box::pin(self.finish(&end)).await;
        buffers::release_if_empty(&mut self.client_in);
        buffers::release_if_empty(&mut self.client_out);
        end
    }

    async fn serve(&mut self) -> Disconnect {
        loop {
            let step = match poll_fn(|cx| self.poll_step(cx)).await {
                Ok(step) => step,
                Err(end) => return end,
            };
            let result = match step {
                Step::NeedServer => match self.attach_after_failpoint().await {
                    Ok(()) => self.process_client_input(),
                    Err(attach::AttachError::Failed(err)) => self.answer_request_with_error(err),
                    // The request, still unsent, goes with the session.
                    Err(attach::AttachError::Moving) => return Disconnect::Moved,
                },
                Step::Release => {
                    if !self.shared.try_clear_target() {
                        // A cancel is on its way to this server: it must land before anyone
                        // else's query runs there. Rare, so its wait lives in a box.
                        Box::pin(
                            self.shared
                                .clear_target(&self.app.clients.cancel_acknowledged),
                        )
                        .await;
                    }
                    self.give_back_server_after_transaction();
                    Ok(())
                }
                Step::ServerFailed(e) => Box::pin(self.on_server_failure(*e)).await,
                Step::RefusedByStandby => {
                    Box::pin(self.retry_on_primary()).await;
                    Ok(())
                }
            };
            if let Err(end) = result {
                return end;
            }
        }
    }

    /// [`Self::attach`], after the test hook that holds a request before it takes a server
    /// (boxed: every session's future would carry the pause's state otherwise).
    async fn attach_after_failpoint(&mut self) -> Result<(), attach::AttachError> {
        if crate::failpoint::is_armed(crate::failpoint::BEFORE_ATTACH) {
            Box::pin(crate::failpoint::pause_if_armed(
                crate::failpoint::BEFORE_ATTACH,
            ))
            .await;
        }
        self.attach().await
    }

    fn mode_shares_servers(&self) -> bool {
        self.mode != PoolMode::Session
    }

    /// One turn of the state machine: check signals, then the idle or the attached phase.
    fn poll_step(&mut self, cx: &mut Context<'_>) -> Poll<Result<Step, Disconnect>> {
        self.shared.register_waker(cx.waker());
        let signals = self.shared.signals();
        if signals & SIGNAL_KILL != 0 {
            return Poll::Ready(Err(Disconnect::Killed(
                self.shared.kill_reason().unwrap_or_default(),
            )));
        }
        if signals & SIGNAL_SHUTDOWN != 0 {
            self.stop_when_idle = true;
        }
        // Taken back if an upgrade is undone.
        self.move_when_idle = signals & SIGNAL_HANDOVER != 0;
        let park_asked = self.shared.take_park_request(signals);
        loop {
            let step = if self.lease.is_some() {
                let relayed = self.poll_relay(cx);
                read_wakes::ReadWakes::end_turn(&mut self.read_wakes, relayed.is_pending());
                match relayed {
                    Poll::Ready(Err(Relayed::Server(e))) => {
                        Poll::Ready(Ok(Step::ServerFailed(Box::new(e))))
                    }
                    Poll::Ready(Err(Relayed::Client(d))) => Poll::Ready(Err(d)),
                    Poll::Ready(Ok(step)) => Poll::Ready(Ok(step)),
                    Poll::Pending => Poll::Pending,
                }
            } else {
                read_wakes::ReadWakes::end_turn(&mut self.read_wakes, false);
                self.poll_idle(cx, park_asked)
            };
            // Taking an idle server and giving it back need no wait when nothing is in the
            // way: done here, they cost no return to the session loop.
            match &step {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(Step::NeedServer)) => match self.attach_in_step() {
                    Some(Ok(())) => {}
                    Some(Err(end)) => return Poll::Ready(Err(end)),
                    None => return step,
                },
                Poll::Ready(Ok(Step::Release)) if self.shared.try_clear_target() => {
                    self.give_back_server_after_transaction();
                }
                _ => return step,
            }
        }
    }

    /// Between transactions with nothing in flight.
    fn at_idle_point(&self) -> bool {
        self.client_tx == TxStatus::Idle
            && self.queue.is_settled()
            && self.client_out.is_empty()
            && self
                .lease
                .as_ref()
                .is_none_or(|l| l.conn.write_buf.is_empty() && l.conn.tx_status == TxStatus::Idle)
    }

    // ----- idle phase -------------------------------------------------------------------

    /// No server: flush what the client is owed, answer what needs no server, and wait for the
    /// next request without holding buffers; or park, if asked and nothing is under way.
    fn poll_idle(
        &mut self,
        cx: &mut Context<'_>,
        park_asked: bool,
    ) -> Poll<Result<Step, Disconnect>> {
        loop {
            while !self.client_out.is_empty() {
                let n = ready!(Pin::new(&mut self.client).poll_write(cx, &self.client_out))
                    .map_err(client_io)?;
                self.client_out.advance(n);
                self.client_flush_pending = self.client.is_tls();
            }
            if self.client_flush_pending {
                ready!(Pin::new(&mut self.client).poll_flush(cx)).map_err(client_io)?;
                self.client_flush_pending = false;
            }
            if self.client_tx == TxStatus::Idle {
                if let Some(end) = self.end_at_idle_point() {
                    return Poll::Ready(Err(end));
                }
            }
            // Without input nothing is answered: no buffer is taken only to be given back
            // before the read.
            if !self.client_in.is_empty() {
                buffers::ready_for_write(&mut self.client_out);
            }
            if self.handle_requests_without_server()? {
                self.idle_timer = None;
                return Poll::Ready(Ok(Step::NeedServer));
            }
            if !self.client_out.is_empty() {
                continue;
            }
            buffers::release_if_empty(&mut self.client_in);
            buffers::release_if_empty(&mut self.client_out);
            if self.idle_timeout_ms > 0 {
                let timeout = Duration::from_millis(self.idle_timeout_ms);
                let timer = self
                    .idle_timer
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(Disconnect::IdleTimeout));
                }
            }
            let read = match poll_read_when_ready(&mut self.client, cx, &mut self.client_in) {
                Poll::Ready(read) => read,
                Poll::Pending => {
                    // Nothing in hand: a cancel now is for nothing (one for a request this
                    // session holds stays raised until attach answers it).
                    if self.client_in.is_empty() {
                        self.shared.forget_cancel();
                    }
                    if park_asked && self.can_park_now() {
                        return Poll::Ready(Err(Disconnect::Parked));
                    }
                    return Poll::Pending;
                }
            };
            match read {
                Ok(0) => return Poll::Ready(Err(Disconnect::ClientClosed)),
                Ok(_) => self.idle_timer = None,
                Err(e) => return Poll::Ready(Err(client_io(e))),
            }
        }
    }

    /// Handles, without a server, the messages that need none. Returns true when the next
    /// message needs a server connection.
    fn handle_requests_without_server(&mut self) -> Result<bool, Disconnect> {
        loop {
            if self.client_stream.is_some() {
                // The rest of a message being dropped (no server holds this session).
                let mut input = std::mem::take(&mut self.client_in);
                let dropped = self.continue_stream(&mut input);
                self.client_in = input;
                dropped?;
                if self.client_stream.is_some() {
                    return Ok(false);
                }
                continue;
            }
            let Some(h) = read_header(&self.client_in, self.max_message_bytes)? else {
                return Ok(false);
            };
            let whole = self.client_in.len() >= h.total_len();
            if !whole && !client_stream::streams(&h, self.client_in.len()) {
                return Ok(false);
            }
            if self.local_skip_to_sync {
                let mut input = std::mem::take(&mut self.client_in);
                self.skip_message(&h, &mut input);
                self.client_in = input;
                match h.tag {
                    ftag::SYNC if whole => {
                        self.local_skip_to_sync = false;
                        backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
                    }
                    ftag::TERMINATE if whole => return Err(Disconnect::Terminated),
                    _ => {}
                }
                continue;
            }
            match h.tag {
                ftag::TERMINATE | ftag::SYNC | ftag::FLUSH if !whole => {
                    return Err(Disconnect::Protocol(WireError::Malformed {
                        message: "Sync, Flush or Terminate",
                        reason: "length (they have no body)",
                    }))
                }
                ftag::TERMINATE => return Err(Disconnect::Terminated),
                // Nothing is pending, so a Sync is answered at once and a Flush has nothing to flush.
                ftag::SYNC if self.mode_shares_servers() => {
                    self.client_in.advance(h.total_len());
                    backend::encode_ready_for_query(&mut self.client_out, self.client_tx);
                }
                ftag::FLUSH if self.mode_shares_servers() => self.client_in.advance(h.total_len()),
                // PostgreSQL ignores COPY messages outside COPY: a failed COPY leaves some behind.
                ftag::COPY_DATA | ftag::COPY_DONE | ftag::COPY_FAIL => {
                    let mut input = std::mem::take(&mut self.client_in);
                    self.skip_message(&h, &mut input);
                    self.client_in = input;
                }
                t if !frontend::is_session_tag(t) => {
                    return Err(Disconnect::Protocol(WireError::UnexpectedTag {
                        tag: t,
                        context: "from a client (invalid frontend message type)",
                    }))
                }
                _ => {
                    // Only the request found below may take it.
                    self.cache_candidate = None;
                    if let Some(err) = self.pending_error.take() {
                        self.answer_request_with_error(*err)?;
                        continue;
                    }
                    if h.tag == ftag::QUERY && whole && self.answer_from_cache(h.total_len())? {
                        continue;
                    }
                    if matches!(h.tag, ftag::PARSE | ftag::BIND)
                        && self.answer_extended_from_cache()?
                    {
                        continue;
                    }
                    return Ok(true);
                }
            }
        }
    }

    /// Answers the request at the front of the buffer with `err`, without a server: a simple
    /// query gets the error and ReadyForQuery; an extended-protocol batch gets the error and its
    /// messages are skipped up to the Sync, which is answered.
    fn answer_request_with_error(&mut self, err: PgError) -> Result<(), Disconnect> {
        self.app.own_errors.count(&err.code);
        self.tx_started = None;
        err.encode(&mut self.client_out)?;
        let Some(h) = read_header(&self.client_in, self.max_message_bytes)? else {
            return Ok(());
        };
        if matches!(h.tag, ftag::QUERY | ftag::FUNCTION_CALL) {
            let mut input = std::mem::take(&mut self.client_in);
            self.skip_message(&h, &mut input);
            self.client_in = input;
            self.client_tx = TxStatus::Idle;
            backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
        } else {
            self.local_skip_to_sync = true;
        }
        Ok(())
    }

    // ----- attached phase: the pump --------------------------------------------------------

    fn poll_relay(&mut self, cx: &mut Context<'_>) -> Poll<Result<Step, Relayed>> {
        // A direction that answered Pending in this turn has the task's waker and stays
        // Pending until the runtime sees new readiness, which wakes the task for a new turn:
        // asking it again in the same turn only costs (a readiness check and a waker compare
        // under the socket's lock per ask, several per request).
        // Across turns, a read still waiting with its own waker, which has not fired, is not
        // asked either (`read_wakes`).
        let Some(server_id) = self.lease.as_ref().map(|l| l.conn.id) else {
            return Poll::Ready(Ok(Step::Release));
        };
        let quiet = read_wakes::ReadWakes::begin_turn(&mut self.read_wakes, cx.waker(), server_id);
        let mut blocked = Blocked {
            server_read: quiet.server_read,
            client_read: quiet.client_read,
            ..Blocked::default()
        };
        loop {
            let mut progressed = false;
            let Some(lease) = self.lease.as_mut() else {
                return Poll::Ready(Ok(Step::Release));
            };
            let conn = &mut lease.conn;

            // Towards the server.
            if !conn.write_buf.is_empty() && !blocked.server_write {
                match Pin::new(&mut conn.stream).poll_write(cx, &conn.write_buf) {
                    Poll::Ready(Ok(n)) => {
                        conn.write_buf.advance(n);
                        buffers::shrink_if_grown(&mut conn.write_buf);
                        lease.flush_pending = conn.stream.is_tls();
                        lease.bytes_to_server += n as u64;
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => {
                        return server_failed(&conn.node, ServerErrorKind::Io(e))
                    }
                    Poll::Pending => blocked.server_write = true,
                }
            }
            if lease.flush_pending && conn.write_buf.is_empty() {
                match Pin::new(&mut conn.stream).poll_flush(cx) {
                    Poll::Ready(Ok(())) => lease.flush_pending = false,
                    Poll::Ready(Err(e)) => {
                        return server_failed(&conn.node, ServerErrorKind::Io(e))
                    }
                    Poll::Pending => {}
                }
            }
            let server_backlog = conn.write_buf.len();

            // Towards the client.
            if !self.client_out.is_empty() && !blocked.client_write {
                match Pin::new(&mut self.client).poll_write(cx, &self.client_out) {
                    Poll::Ready(Ok(n)) => {
                        self.client_out.advance(n);
                        buffers::shrink_if_grown(&mut self.client_out);
                        self.client_flush_pending = self.client.is_tls();
                        lease.bytes_to_client += n as u64;
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Relayed::Client(client_io(e)))),
                    Poll::Pending => blocked.client_write = true,
                }
            }
            if self.client_flush_pending && self.client_out.is_empty() {
                match Pin::new(&mut self.client).poll_flush(cx) {
                    Poll::Ready(Ok(())) => self.client_flush_pending = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Relayed::Client(client_io(e)))),
                    Poll::Pending => {}
                }
            }

            // From the server.
            if self.client_out.len() < HIGH_WATER_BYTES && !blocked.server_read {
                let Some(lease) = self.lease.as_mut() else {
                    return Poll::Ready(Ok(Step::Release));
                };
                let conn = &mut lease.conn;
                buffers::ready_for_read(&mut conn.read_buf);
                let read = read_wakes::poll_read(
                    &mut self.read_wakes,
                    read_wakes::Side::Server(conn.id),
                    &mut conn.stream,
                    cx,
                    &mut conn.read_buf,
                );
                match read {
                    Poll::Ready(Ok(0)) => {
                        return server_failed(&conn.node, ServerErrorKind::Closed(None))
                    }
                    Poll::Ready(Ok(_)) => {
                        self.process_server_input()?;
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => {
                        return server_failed(&conn.node, ServerErrorKind::Io(e))
                    }
                    Poll::Pending => blocked.server_read = true,
                }
            }

            // From the client.
            if server_backlog < HIGH_WATER_BYTES && !self.routing.held && !blocked.client_read {
                buffers::ready_for_read(&mut self.client_in);
                let read = read_wakes::poll_read(
                    &mut self.read_wakes,
                    read_wakes::Side::Client,
                    &mut self.client,
                    cx,
                    &mut self.client_in,
                );
                match read {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(Relayed::Client(Disconnect::ClientClosed)))
                    }
                    Poll::Ready(Ok(_)) => {
                        self.process_client_input()?;
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Relayed::Client(client_io(e)))),
                    Poll::Pending => blocked.client_read = true,
                }
            }

            if self.routing.held && self.queue.is_settled() {
                let in_transaction = self
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.conn.tx_status != TxStatus::Idle);
                if in_transaction || !self.mode_shares_servers() {
                    // The transaction lives on this server: the request follows it there.
                    self.routing.held = false;
                    self.routing.at_unit_start = false;
                    self.process_client_input()?;
                    progressed = true;
                }
            }
            if self.probe_before_release() {
                self.push_lsn_probe()?;
                continue;
            }
            if self.state_probe_due() {
                self.push_state_probe()?;
                continue;
            }
            if self
                .routing
                .replay
                .as_ref()
                .is_some_and(|r| r.refused && self.queue.is_settled())
            {
                return Poll::Ready(Ok(Step::RefusedByStandby));
            }
            if self.can_release() {
                return Poll::Ready(Ok(Step::Release));
            }
            if self.at_idle_point() {
                // With a server still held: a session that can move gives it back first.
                if let Some(end) = self.end_at_idle_point() {
                    return Poll::Ready(Err(Relayed::Client(end)));
                }
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }

    /// True when the server owes nothing, the transaction is over, and this pool mode lends
    /// connections per transaction or statement.
    fn can_release(&self) -> bool {
        self.mode_shares_servers()
            && self.routing.lasting.pinned.is_none()
            && self.server_between_requests()
    }

    /// The server owes nothing, runs no transaction, has nothing on its way in either
    /// direction, and no client message is half passed to it: pgherd may add a request of
    /// its own, or give it back.
    fn server_between_requests(&self) -> bool {
        self.lease.as_ref().is_some_and(|lease| {
            self.queue.is_settled()
                && lease.conn.tx_status == TxStatus::Idle
                && lease.conn.write_buf.is_empty()
                && !lease.flush_pending
                && self.server_passthrough.is_none()
                && self.client_stream.is_none()
        })
    }
}
