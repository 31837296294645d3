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

pub mod params;
pub mod queue;
pub mod statements;

use std::future::{poll_fn, Future};
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use pgherd_config::{Balance, Consistency, PoolMode, Route};
use pgherd_route::balance::{
    choose, insert_lsn_as_end, parse_lsn, Lsn, NoChoice, Policy, Requirement,
};
use pgherd_route::{Target as RouteTarget, TxEffect};
use pgherd_wire::backend::{self, tag as btag, TxStatus};
use pgherd_wire::frame::{read_header, HEADER_BYTES};
use pgherd_wire::frontend::{self, tag as ftag, Target};
use pgherd_wire::{PgError, SqlState, WireError};
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio_util::io::poll_read_buf;

use crate::app::App;
use crate::buffers;
use crate::clients::{ClientShared, ServerTarget, SIGNAL_KILL, SIGNAL_SHUTDOWN};
use crate::error::{client_io, Disconnect, ServerError, ServerErrorKind};
use crate::nodes::{NodeState, Role};
use crate::pool::{AcquireError, Pool};
use crate::routing::{Routed, Router};
use crate::server::{ServerConn, MAX_SERVER_MESSAGE_BYTES};
use crate::stream::Stream;
use params::{may_change_session, session_changes, SessionParams, UNKNOWN};
use queue::{Request, ResponseQueue, Synthetic};
use statements::{ClientStatements, StatementDef, StatementError};

/// Stop reading from one side while this much is waiting to be written to the other.
const HIGH_WATER_BYTES: usize = 256 << 10;
/// How often a request waiting for a primary looks again when no node's standing changes
/// (a primary that restarts quickly never counts as down).
const PRIMARY_RECHECK: Duration = Duration::from_millis(50);
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

/// The server connection a session holds.
struct Lease {
    conn: Box<ServerConn>,
    pool: Arc<Pool>,
    node: Arc<NodeState>,
    /// The node was a replica when the lease began.
    on_replica: bool,
    flush_pending: bool,
    /// The client's unnamed statement exists on this server connection.
    unnamed_here: bool,
}

/// How a session's statements are routed, as configured for its database and user.
pub struct RoutingSetup {
    pub route: Route,
    pub consistency: Consistency,
    pub balance: Balance,
    pub primary_reads: bool,
    /// `None` in session mode: the client keeps one server, so nothing moves.
    pub router: Option<Arc<Router>>,
}

/// What pgherd asks the primary after a session's write transaction: the position the
/// replicas must reach before that session reads from them.
const LSN_PROBE_SQL: &[u8] = b"SELECT pg_current_wal_insert_lsn()";
/// How often a read waiting for a replica to replay the session's write asks it.
const REPLAY_POLL_INTERVAL: Duration = Duration::from_millis(1);
/// Times one request is moved to another node after the replica it was sent to failed.
const MAX_REPLAYS: u8 = 3;

/// Client messages sent to a replica and not answered yet, kept so they can be sent elsewhere
/// if the replica fails before answering anything.
#[derive(Default)]
struct Replay {
    bytes: BytesMut,
    /// False once a message that cannot be repeated (defining or closing a named statement,
    /// streamed COPY data) went out.
    repeatable: bool,
    /// Something of the answer already reached the client.
    answered: bool,
    attempts: u8,
}

impl Replay {
    /// Nothing sent is outstanding any more: start collecting afresh (a large buffer from a
    /// big request is not kept).
    fn restart(&mut self) {
        self.bytes.clear();
        if self.bytes.capacity() > HIGH_WATER_BYTES {
            self.bytes = BytesMut::new();
        }
        self.repeatable = true;
        self.answered = false;
    }
}

/// A session's routing state.
struct Routing {
    setup: RoutingSetup,
    /// `SET pgherd.route`.
    override_route: Option<Route>,
    /// Session state (a temporary table, a session lock...) ties the client to its server.
    pinned: Option<pgherd_route::Pin>,
    default_read_only: bool,
    /// The WAL position of the session's last write known to be committed.
    min_lsn: Lsn,
    /// Statements that may write sent to the primary, counted; and the count the last LSN
    /// probe answered for. Reads must wait for a probe while `write_seq > probed_seq`.
    write_seq: u64,
    probed_seq: u64,
    /// What the probe in flight returned.
    probe_lsn: Option<Lsn>,
    /// The decision for the statement at the front of the client's input, made to choose its
    /// node and reused when it is relayed.
    front: Option<Routed>,
    /// The next client message starts a new request (after a Query or Sync).
    at_unit_start: bool,
    unit_begins: bool,
    unit_ends: bool,
    unit_copies_in: bool,
    /// The next request needs the primary but the lease is a replica: it waits until the
    /// replica owes nothing, then the session moves.
    held: bool,
    replay: Option<Box<Replay>>,
}

impl Routing {
    fn new(setup: RoutingSetup) -> Self {
        Routing {
            setup,
            override_route: None,
            pinned: None,
            default_read_only: false,
            min_lsn: 0,
            write_seq: 0,
            probed_seq: 0,
            probe_lsn: None,
            front: None,
            at_unit_start: true,
            unit_begins: false,
            unit_ends: false,
            unit_copies_in: false,
            held: false,
            replay: None,
        }
    }

    fn route(&self) -> Route {
        self.override_route.unwrap_or(self.setup.route)
    }

    fn read_your_writes(&self) -> bool {
        self.setup.router.is_some() && self.setup.consistency == Consistency::ReadYourWrites
    }

    /// Where a request runs, from its decision (`None`: it has no statement).
    fn target(&self, routed: Option<&Routed>) -> RouteTarget {
        let route = self.route();
        if self.setup.router.is_none() {
            return match self.setup.route {
                Route::Replica => RouteTarget::Replica,
                _ => RouteTarget::Primary,
            };
        }
        let Some(routed) = routed else {
            return match route {
                Route::Replica => RouteTarget::Replica,
                _ => RouteTarget::Any,
            };
        };
        let target = routed.target(route);
        let automatic = routed.hint.is_none() && route == Route::Auto;
        if automatic
            && target == RouteTarget::Replica
            && self.setup.consistency == Consistency::Primary
        {
            return RouteTarget::Primary;
        }
        if automatic
            && self.default_read_only
            && routed.decision.pin.is_none()
            && routed.decision.tx == (TxEffect::Begin { read_only: false })
        {
            // default_transaction_read_only makes this BEGIN a read-only transaction.
            return RouteTarget::Replica;
        }
        target
    }
}

/// What the session loop must do next that needs an await.
enum Step {
    /// A request needs a server connection.
    NeedServer,
    /// The server owes nothing and the transaction is over: give it back.
    Release,
    /// Boxed: rare, and large enough to double the size of every idle session's task.
    ServerFailed(Box<ServerError>),
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
    /// The pool last used, and its node, to skip the registry on the next attach.
    last_pool: Option<(Arc<NodeState>, Arc<Pool>)>,
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
    /// When the current transaction's first request arrived (for the latency histogram).
    tx_started: Option<Instant>,
    client_tx: TxStatus,
    /// Bytes of a streamed COPY message still to pass from the client to the server.
    client_passthrough: usize,
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
    /// pgherd is shutting down: end the session at the next point where it is idle.
    stop_when_idle: bool,
    /// 0 disables.
    idle_timeout_ms: u64,
    idle_timer: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Session {
    pub fn new(setup: SessionSetup) -> Session {
        let config = setup.app.config();
        let idle_ms = config.proxy.client_idle_timeout_ms;
        Session {
            max_message_bytes: config.proxy.max_message_bytes,
            idle_timeout_ms: idle_ms,
            idle_timer: None,
            app: setup.app,
            shared: setup.shared,
            client: setup.client,
            client_in: setup.client_in,
            client_out: BytesMut::new(),
            client_flush_pending: false,
            mode: setup.mode,
            routing: Routing::new(setup.routing),
            lease: None,
            last_pool: None,
            queue: ResponseQueue::default(),
            statements: None,
            unnamed: None,
            portal_sql: None,
            params: setup.params,
            untracked_change: false,
            tx_failed: false,
            tx_started: None,
            client_tx: TxStatus::Idle,
            client_passthrough: 0,
            server_passthrough: None,
            local_skip_to_sync: false,
            pending_error: None,
            server_last_words: None,
            stop_when_idle: false,
        }
    }

    /// Relays until the client leaves or is sent away; returns why, after cleaning up.
    pub async fn run(&mut self) -> Disconnect {
        let end = self.serve().await;
        tracing::debug!(client = self.shared.id, reason = %end, holding_server = self.lease.is_some(), "session ending");
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
                Step::NeedServer => match self.attach().await {
                    Ok(()) => self.process_client_input(),
                    Err(err) => self.answer_request_with_error(err),
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
                    self.give_back_server(true);
                    Ok(())
                }
                Step::ServerFailed(e) => Box::pin(self.on_server_failure(*e)).await,
            };
            if let Err(end) = result {
                return end;
            }
        }
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
        if self.lease.is_some() {
            match self.poll_relay(cx) {
                Poll::Ready(Err(Relayed::Server(e))) => {
                    Poll::Ready(Ok(Step::ServerFailed(Box::new(e))))
                }
                Poll::Ready(Err(Relayed::Client(d))) => Poll::Ready(Err(d)),
                Poll::Ready(Ok(step)) => Poll::Ready(Ok(step)),
                Poll::Pending => Poll::Pending,
            }
        } else {
            self.poll_idle(cx)
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
    /// next request without holding buffers.
    fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<Result<Step, Disconnect>> {
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
            if self.stop_when_idle && self.client_tx == TxStatus::Idle {
                return Poll::Ready(Err(Disconnect::Shutdown));
            }
            buffers::ready_for_write(&mut self.client_out);
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
            match ready!(poll_read_when_ready(
                &mut self.client,
                cx,
                &mut self.client_in
            )) {
                Ok(0) => return Poll::Ready(Err(Disconnect::ClientClosed)),
                Ok(_) => self.idle_timer = None,
                Err(e) => return Poll::Ready(Err(client_io(e))),
            }
        }
    }

    /// Handles, without a server, the messages that need none. Returns true when the next
    /// message needs a server connection.
    fn handle_requests_without_server(&mut self) -> Result<bool, Disconnect> {
        while let Some(h) = read_header(&self.client_in, self.max_message_bytes)? {
            if self.client_in.len() < h.total_len() {
                return Ok(false);
            }
            if self.local_skip_to_sync {
                self.client_in.advance(h.total_len());
                match h.tag {
                    ftag::SYNC => {
                        self.local_skip_to_sync = false;
                        backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
                    }
                    ftag::TERMINATE => return Err(Disconnect::Terminated),
                    _ => {}
                }
                continue;
            }
            match h.tag {
                ftag::TERMINATE => return Err(Disconnect::Terminated),
                // Nothing is pending, so a Sync is answered at once and a Flush has nothing to flush.
                ftag::SYNC if self.mode_shares_servers() => {
                    self.client_in.advance(h.total_len());
                    backend::encode_ready_for_query(&mut self.client_out, self.client_tx);
                }
                ftag::FLUSH if self.mode_shares_servers() => self.client_in.advance(h.total_len()),
                // PostgreSQL ignores COPY messages outside COPY: a failed COPY leaves some behind.
                ftag::COPY_DATA | ftag::COPY_DONE | ftag::COPY_FAIL => {
                    self.client_in.advance(h.total_len())
                }
                t if !frontend::is_session_tag(t) => {
                    return Err(Disconnect::Protocol(WireError::UnexpectedTag {
                        tag: t,
                        context: "from a client (invalid frontend message type)",
                    }))
                }
                _ => {
                    if let Some(err) = self.pending_error.take() {
                        self.answer_request_with_error(*err)?;
                        continue;
                    }
                    return Ok(true);
                }
            }
        }
        Ok(false)
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
            self.client_in.advance(h.total_len());
            self.client_tx = TxStatus::Idle;
            backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
        } else {
            self.local_skip_to_sync = true;
        }
        Ok(())
    }

    // ----- attach / detach ----------------------------------------------------------------

    /// The routing decision for the request at the front of `input`: its first Query, Parse
    /// or Bind. `None` when routing is off, the request has no statement (a lone Sync) or is
    /// not complete yet. An invalid hint or `pgherd.route` value is the client's error.
    ///
    /// A decision made from a Query's or Parse's own text is kept in `routing.front`, so the
    /// statement is not classified again when it is relayed; a Bind's belongs to a statement
    /// prepared earlier and is not kept.
    fn route_front(&mut self, input: &[u8]) -> Result<Option<Routed>, PgError> {
        let routed = self.decide_front(input)?;
        self.routing.front = routed
            .as_ref()
            .filter(|(_, from_text)| *from_text)
            .map(|(r, _)| r.clone());
        Ok(routed.map(|(r, _)| r))
    }

    /// `route_front`'s decision, and whether it came from the statement's own text.
    fn decide_front(&self, input: &[u8]) -> Result<Option<(Routed, bool)>, PgError> {
        let Some(router) = self.routing.setup.router.as_ref() else {
            return Ok(None);
        };
        let mut at = 0;
        loop {
            let rest = &input[at..];
            let Ok(Some(h)) = read_header(rest, self.max_message_bytes) else {
                return Ok(None);
            };
            if rest.len() < h.total_len() {
                return Ok(None);
            }
            let body = &rest[HEADER_BYTES..h.total_len()];
            match h.tag {
                ftag::QUERY | ftag::PARSE => {
                    let sql = if h.tag == ftag::QUERY {
                        frontend::Query::parse(body).map(|q| q.sql)
                    } else {
                        frontend::Parse::parse(body).map(|p| p.query)
                    };
                    return match sql {
                        Ok(sql) => router.route(&self.app, sql).map(|r| Some((r, true))),
                        // Malformed: relaying it reports the protocol error.
                        Err(_) => Ok(None),
                    };
                }
                ftag::BIND => {
                    return Ok(frontend::Bind::parse(body)
                        .ok()
                        .and_then(|b| self.statement_routed(b.statement))
                        .map(|r| (r, false)))
                }
                ftag::FUNCTION_CALL => {
                    return Ok(Some((
                        Routed::primary("a function call by OID may write"),
                        false,
                    )))
                }
                ftag::SYNC | ftag::TERMINATE => return Ok(None),
                _ => at += h.total_len(),
            }
        }
    }

    /// The decision for a statement the client prepared (`""`: the unnamed one).
    fn statement_routed(&self, name: &[u8]) -> Option<Routed> {
        let router = self.routing.setup.router.as_ref()?;
        if name.is_empty() {
            return self
                .unnamed
                .as_ref()
                .filter(|u| u.present)
                .and_then(|u| u.routed.clone());
        }
        let def = statement(&self.statements, name).ok()?;
        Some(
            def.routed
                .get_or_init(|| {
                    router
                        .route(&self.app, &def.query)
                        .unwrap_or_else(|_| Routed::primary("its routing hint is invalid"))
                })
                .clone(),
        )
    }

    /// The node for a request with `target`, and the WAL position to wait for when the chosen
    /// replica has not replayed the session's last write yet.
    fn pick_node(&self, target: RouteTarget) -> Result<(Arc<NodeState>, Option<Lsn>), PgError> {
        match target {
            RouteTarget::Any => {
                // Transaction control and settings run wherever the session was last.
                if let Some((node, _)) = &self.last_pool {
                    let usable = match node.role() {
                        Role::Primary => !self.app.nodes.writes_paused(),
                        _ => node.in_read_set(),
                    };
                    if node.is_up() && !node.is_excluded() && usable {
                        return Ok((node.clone(), None));
                    }
                }
            }
            RouteTarget::Replica => {
                if let Some(choice) = self.pick_reader() {
                    return Ok(choice);
                }
            }
            RouteTarget::Primary => {
                if let Some(why) = self.app.nodes.writes_refused() {
                    return Err(PgError::error(
                        SqlState::READ_ONLY_SQL_TRANSACTION,
                        format!("writes are refused: {why}"),
                    )
                    .with_hint("writes resume when a synchronous standby streams again"));
                }
            }
        }
        // The primary rarely changes: reuse the last one while it still is the primary.
        if let Some((node, _)) = &self.last_pool {
            if node.is_usable_as(Role::Primary) && !self.app.nodes.writes_paused() {
                return Ok((node.clone(), None));
            }
        }
        let nodes = &self.app.nodes;
        nodes.primary().map(|n| (n, None)).ok_or_else(|| {
            PgError::error(
                SqlState::CONNECTION_FAILURE,
                format!(
                    "no {} node is available for database \"{}\"",
                    if target == RouteTarget::Primary {
                        "primary"
                    } else {
                        "replica or primary"
                    },
                    self.shared.database
                ),
            )
            .with_detail(format!("nodes: {}", nodes.describe_all()))
        })
    }

    /// A node for a read under the database's balance policy, lag limits and the session's
    /// consistency; `None` means the primary.
    fn pick_reader(&self) -> Option<(Arc<NodeState>, Option<Lsn>)> {
        let setup = &self.routing.setup;
        let read_your_writes = self.routing.read_your_writes();
        if read_your_writes && self.routing.write_seq > self.routing.probed_seq {
            // Where the session's last write ends is not known yet.
            return None;
        }
        let (nodes, candidates) = self.app.nodes.read_candidates(setup.primary_reads);
        if candidates.is_empty() {
            return None;
        }
        let config = self.app.config();
        let req = Requirement {
            max_lag_bytes: config.routing.max_lag_bytes,
            max_lag_ms: config.routing.max_lag_ms,
            min_lsn: if read_your_writes {
                self.routing.min_lsn
            } else {
                0
            },
        };
        let (policy, ticket) = match setup.balance {
            Balance::RoundRobin => (Policy::RoundRobin, self.app.nodes.next_read_ticket()),
            Balance::LeastOutstanding => {
                (Policy::LeastOutstanding, self.app.nodes.next_read_ticket())
            }
            Balance::Weighted => (Policy::Weighted, self.app.nodes.next_read_ticket()),
            Balance::Random => (Policy::Random, rand::random()),
        };
        match choose(policy, &candidates, &req, ticket) {
            Ok(i) => Some((nodes[i].clone(), None)),
            Err(NoChoice::NotCaughtUp(i)) if config.routing.read_your_writes_wait_ms > 0 => {
                Some((nodes[i].clone(), Some(req.min_lsn)))
            }
            Err(_) => None,
        }
    }

    fn pool_for(&mut self, node: &Arc<NodeState>) -> Result<Arc<Pool>, PgError> {
        if let Some((cached_node, pool)) = &self.last_pool {
            if Arc::ptr_eq(cached_node, node) && !pool.is_closed() {
                return Ok(pool.clone());
            }
        }
        let pool = self
            .app
            .pool(&self.shared.database, &self.shared.user, node)
            .ok_or_else(|| {
                PgError::error(
                    SqlState::INVALID_CATALOG_NAME,
                    format!(
                        "database \"{}\" is no longer served by pgherd",
                        self.shared.database
                    ),
                )
            })?;
        self.last_pool = Some((node.clone(), pool.clone()));
        Ok(pool)
    }

    /// Takes a server connection for the next request, on the node its routing decision
    /// allows, and makes it carry this session's settings. An idle connection is taken
    /// without waiting; otherwise the (boxed) slow path connects or queues. A replica that
    /// cannot be reached leaves the read set and the request goes elsewhere.
    async fn attach(&mut self) -> Result<(), PgError> {
        // The transaction's time, as its client sees it, includes any wait for a server.
        self.tx_started.get_or_insert_with(Instant::now);
        if self.app.pauses.is_paused(&self.shared.database) {
            Box::pin(self.wait_while_paused()).await?;
        }
        let input = std::mem::take(&mut self.client_in);
        let routed = self.route_front(&input);
        self.client_in = input;
        let mut target = self.routing.target(routed?.as_ref());
        let mut failures = 0;
        let mut held_since = None;
        let (node, pool, conn) = loop {
            let (node, wait_for_lsn) = match self.pick_node(target) {
                Ok(choice) => choice,
                Err(e) => {
                    if self
                        .interruptible(self.hold_for_primary(&mut held_since))
                        .await?
                    {
                        continue;
                    }
                    return Err(e);
                }
            };
            let pool = self.pool_for(&node)?;
            let acquired = match pool.try_acquire() {
                Some(conn) => Ok(conn),
                // Boxed: opening a connection has a large future, which would otherwise sit in
                // every idle session's task.
                None => {
                    Box::pin(self.interruptible(pool.acquire(&self.app.connect_context()))).await?
                }
            };
            let conn = match acquired {
                Ok(conn) => conn,
                Err(AcquireError::Server(e))
                    if node.role() == Role::Replica && failures < MAX_REPLAYS =>
                {
                    failures += 1;
                    node.leave_read_set(&e.to_string());
                    self.app.drop_idle_connections(&node);
                    continue;
                }
                Err(e) => {
                    // The primary does not answer: it may be restarting or being replaced.
                    if matches!(&e, AcquireError::Server(se) if se.is_transient())
                        && node.role() != Role::Replica
                        && self
                            .interruptible(self.hold_for_primary(&mut held_since))
                            .await?
                    {
                        continue;
                    }
                    return Err(self.acquire_error(e, &node));
                }
            };
            let Some(lsn) = wait_for_lsn else {
                break (node, pool, conn);
            };
            let wait = Duration::from_millis(self.app.config().routing.read_your_writes_wait_ms);
            match Box::pin(wait_for_replay(conn, &node, lsn, wait)).await {
                Ok(conn) => break (node, pool, conn),
                Err(conn) => {
                    if let Some(conn) = conn {
                        pool.release(conn, true);
                    }
                    target = RouteTarget::Primary;
                }
            }
        };
        self.shared.set_target(Some(ServerTarget {
            server_id: conn.id,
            peer: conn.peer,
            key: conn.cancel_key,
            node: ServerTarget::node_id(&node),
        }));
        node.begin_lease();
        let on_replica = node.role() == Role::Replica;
        let mut lease = Lease {
            conn,
            pool,
            node,
            on_replica,
            flush_pending: false,
            unnamed_here: false,
        };
        if lease.conn.params_fp != self.params.fingerprint() {
            // Reset and apply separately: a setting the server refuses must not roll back the
            // reset and leave the previous client's settings in place.
            if lease.conn.params_fp != params::BASELINE {
                frontend::encode_query(&mut lease.conn.write_buf, params::RESET_SQL.as_bytes())?;
                self.queue.push_internal(Request::Query { sql: None });
            }
            if let Some(sql) = self.params.apply_sql() {
                frontend::encode_query(&mut lease.conn.write_buf, sql.as_bytes())?;
                self.queue.push_internal(Request::Query { sql: None });
            }
            lease.conn.params_fp = self.params.fingerprint();
        }
        self.lease = Some(lease);
        self.routing.at_unit_start = true;
        if on_replica && self.client_tx == TxStatus::Idle {
            self.routing
                .replay
                .get_or_insert_with(Default::default)
                .restart();
        }
        Ok(())
    }

    /// `PAUSE` on the admin console holds the request (nothing sent yet) until `RESUME`, for
    /// at most `pool.wait_timeout_ms`, as a wait for a server connection would be.
    async fn wait_while_paused(&self) -> Result<(), PgError> {
        let database = &self.shared.database;
        tracing::debug!(client = self.shared.id, %database, "request waits: the database is paused");
        let limit = Duration::from_millis(self.app.config().pool.wait_timeout_ms);
        if self
            .interruptible(self.app.pauses.wait_resumed(database, limit))
            .await?
        {
            return Ok(());
        }
        Err(PgError::error(
            SqlState::CANNOT_CONNECT_NOW,
            format!(
                "database \"{database}\" is paused (PAUSE on the admin console) and was not resumed within {} ms",
                limit.as_millis()
            ),
        )
        .with_hint("retry after RESUME"))
    }

    /// Runs a wait for a server unless the client cancels its request first; then the request
    /// fails as PostgreSQL fails a cancelled statement.
    async fn interruptible<T>(&self, wait: impl Future<Output = T>) -> Result<T, PgError> {
        self.shared.begin_wait();
        let outcome = tokio::select! {
            biased;
            done = wait => Ok(done),
            () = self.shared.wait_cancelled() => Err(PgError::error(
                SqlState::QUERY_CANCELED,
                "canceling statement due to user request",
            )
            .with_detail("the request was still waiting for a server connection")),
        };
        self.shared.end_wait();
        outcome
    }

    /// Lets a request that has sent nothing yet wait a little for a node that accepts writes
    /// (a failover, a switchover or a restart of the primary) instead of failing it; false
    /// once `cluster.primary_wait_ms` has passed since it first waited.
    async fn hold_for_primary(&self, since: &mut Option<Instant>) -> bool {
        let limit = Duration::from_millis(self.app.config().cluster.primary_wait_ms);
        let started = *since.get_or_insert_with(|| {
            tracing::debug!(
                client = self.shared.id,
                "request waits for a node that accepts writes"
            );
            Instant::now()
        });
        let left = limit.saturating_sub(started.elapsed());
        if left.is_zero() {
            return false;
        }
        let _ = tokio::time::timeout(left.min(PRIMARY_RECHECK), self.app.nodes.standing_changed())
            .await;
        true
    }

    fn acquire_error(&mut self, e: AcquireError, node: &NodeState) -> PgError {
        match e {
            AcquireError::WaitTimeout { waited, max_size } => PgError::error(
                SqlState::TOO_MANY_CONNECTIONS,
                format!(
                    "no server connection became free within {} ms (pool for database \"{}\", user \"{}\" on node {} has max_size {max_size})",
                    waited.as_millis(),
                    self.shared.database,
                    self.shared.user,
                    node.name()
                ),
            )
            .with_hint("raise pool.max_size or pool.wait_timeout_ms, or shorten transactions"),
            AcquireError::Server(e) => {
                tracing::warn!(client = self.shared.id, error = %e, "cannot get a server connection");
                e.to_client_error()
            }
            AcquireError::Closed => {
                self.last_pool = None;
                PgError::error(SqlState::CANNOT_CONNECT_NOW, "the pool was closed; retry the request")
            }
        }
    }

    /// Gives the server connection back once no cancel is on its way to it. `reusable` is
    /// false if its state is unknown.
    async fn detach(&mut self, reusable: bool) {
        if self.lease.is_none() {
            return;
        }
        self.shared
            .clear_target(&self.app.clients.cancel_acknowledged)
            .await;
        self.give_back_server(reusable);
    }

    /// Returns the server connection to its pool; the cancel target must be cleared already.
    fn give_back_server(&mut self, reusable: bool) {
        let Some(Lease {
            mut conn,
            pool,
            node,
            ..
        }) = self.lease.take()
        else {
            return;
        };
        node.end_lease();
        self.routing.held = false;
        if let Some(replay) = self.routing.replay.as_mut() {
            replay.restart();
        }
        let clean = reusable && self.queue.is_settled() && conn.read_buf.is_empty();
        if !clean {
            conn.write_buf.clear();
        }
        pool.release(conn, clean);
        self.queue.clear();
        self.server_passthrough = None;
    }

    /// A server connection failed while attached. The client keeps its connection in
    /// transaction and statement mode: it gets an error for whatever was in flight, and its
    /// next request gets a new server.
    async fn on_server_failure(&mut self, e: ServerError) -> Result<(), Disconnect> {
        let e = match (e.kind, self.server_last_words.take()) {
            (ServerErrorKind::Closed(None), Some(words)) => {
                ServerError::new(&e.node, ServerErrorKind::Closed(Some(*words)))
            }
            (kind, _) => ServerError { node: e.node, kind },
        };
        if self.try_elsewhere(&e).await {
            return Ok(());
        }
        tracing::warn!(client = self.shared.id, error = %e, "server connection failed");
        let owed_ready = self.queue.client_ready_owed();
        let had_requests = self.queue.has_client_requests();
        let was_in_transaction = self.client_tx != TxStatus::Idle;
        self.detach(false).await;
        if self.mode == PoolMode::Session {
            return Err(Disconnect::ServerLost(e));
        }
        let mut err = e.to_client_error();
        if was_in_transaction {
            err = err.with_hint("the transaction was rolled back; retry it");
        }
        self.client_tx = TxStatus::Idle;
        self.tx_failed = false;
        self.tx_started = None;
        self.params.end_transaction(false);
        if had_requests {
            self.app.own_errors.count(&err.code);
            err.encode(&mut self.client_out)?;
            for _ in 0..owed_ready {
                backend::encode_ready_for_query(&mut self.client_out, TxStatus::Idle);
            }
            if owed_ready == 0 {
                // The client has not sent its Sync yet; it will get the ReadyForQuery for it.
                self.local_skip_to_sync = true;
            }
        } else if was_in_transaction {
            self.pending_error = Some(Box::new(err));
        }
        Ok(())
    }

    /// A replica failed before answering any of the reads sent to it: they had no effect
    /// there, so they are put back in front of the client's input to run on another node,
    /// and the replica leaves the read set. Returns false if that is not possible.
    async fn try_elsewhere(&mut self, e: &ServerError) -> bool {
        let Some(lease) = self.lease.as_ref() else {
            return false;
        };
        let Some(replay) = self.routing.replay.as_mut() else {
            return false;
        };
        if !lease.on_replica
            || self.client_tx != TxStatus::Idle
            || !replay.repeatable
            || replay.answered
            || replay.bytes.is_empty()
            || replay.attempts >= MAX_REPLAYS
            || self.client_passthrough > 0
        {
            return false;
        }
        replay.attempts += 1;
        let mut again = std::mem::take(&mut replay.bytes);
        again.extend_from_slice(&self.client_in);
        self.client_in = again;
        let node = lease.node.clone();
        tracing::warn!(client = self.shared.id, node = %node.name(), error = %e, "replica failed before answering; sending the request elsewhere");
        node.leave_read_set(&e.to_string());
        self.app.drop_idle_connections(&node);
        self.detach(false).await;
        self.routing.at_unit_start = true;
        true
    }

    /// Tells the client why it is being disconnected, then leaves the server in a state the
    /// next client can use, or closes it.
    async fn finish(&mut self, end: &Disconnect) {
        if let Some(err) = end.client_error() {
            self.app.own_errors.count(&err.code);
            if err.encode(&mut self.client_out).is_ok() {
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    let _ = self.client.write_all(&self.client_out).await;
                    let _ = self.client.flush().await;
                })
                .await;
            }
        }
        self.client_out.clear();
        let Some(lease) = self.lease.as_ref() else {
            return;
        };
        if lease.node.is_fenced() {
            // Failover took the node out (it may hang): nothing there is worth cleaning up.
            self.detach(false).await;
            return;
        }
        let reusable = matches!(
            tokio::time::timeout(CLEANUP_TIMEOUT, self.clean_up_server()).await,
            Ok(Ok(()))
        );
        self.detach(reusable).await;
    }

    /// The client left while holding a server: finish or cancel what runs, roll back an open
    /// transaction, and reset a session-mode connection.
    async fn clean_up_server(&mut self) -> Result<(), ()> {
        let lease = self.lease.as_mut().ok_or(())?;
        lease.conn.write_buf.clear();
        if self.queue.in_copy_in() {
            frontend::encode_copy_fail(&mut lease.conn.write_buf, b"client disconnected")
                .map_err(|_| ())?;
            self.queue.client_copy_finished();
        }
        if !self.queue.is_empty() {
            // Something is still running: ask the server to stop it.
            self.app.clients.cancel(self.shared.key, CLEANUP_TIMEOUT);
            frontend::encode_sync(&mut lease.conn.write_buf);
            self.queue.push_internal(Request::Sync);
        }
        self.drain_internal().await?;
        let lease = self.lease.as_mut().ok_or(())?;
        if lease.conn.tx_status != TxStatus::Idle {
            frontend::encode_query(&mut lease.conn.write_buf, b"ROLLBACK").map_err(|_| ())?;
            self.queue.push_internal(Request::Query { sql: None });
            self.drain_internal().await?;
        }
        let lease = self.lease.as_mut().ok_or(())?;
        let reset = lease.pool.settings().server_reset_query.clone();
        if self.mode == PoolMode::Session && !reset.is_empty() {
            frontend::encode_query(&mut lease.conn.write_buf, reset.as_bytes()).map_err(|_| ())?;
            self.queue.push_internal(Request::Query { sql: None });
            self.drain_internal().await?;
            let lease = self.lease.as_mut().ok_or(())?;
            lease.conn.params_fp = params::BASELINE;
            lease.conn.statements.clear();
        }
        Ok(())
    }

    /// Sends what is queued for the server and reads until it owes nothing, with every
    /// response going nowhere: the client is gone.
    async fn drain_internal(&mut self) -> Result<(), ()> {
        loop {
            let lease = self.lease.as_mut().ok_or(())?;
            if !lease.conn.write_buf.is_empty() {
                let conn = &mut lease.conn;
                conn.stream
                    .write_all(&conn.write_buf)
                    .await
                    .map_err(|_| ())?;
                conn.stream.flush().await.map_err(|_| ())?;
                conn.write_buf.clear();
            }
            if self.queue.is_empty() {
                return Ok(());
            }
            let n = poll_fn(|cx| match self.lease.as_mut() {
                Some(lease) => {
                    buffers::ready_for_read(&mut lease.conn.read_buf);
                    poll_read_buf(
                        Pin::new(&mut lease.conn.stream),
                        cx,
                        &mut lease.conn.read_buf,
                    )
                }
                None => Poll::Ready(Err(io::Error::other("no server"))),
            })
            .await
            .map_err(|_| ())?;
            if n == 0 {
                return Err(());
            }
            self.process_server_input().map_err(|_| ())?;
            self.client_out.clear();
        }
    }

    // ----- attached phase: the pump --------------------------------------------------------

    fn poll_relay(&mut self, cx: &mut Context<'_>) -> Poll<Result<Step, Relayed>> {
        loop {
            let mut progressed = false;
            let Some(lease) = self.lease.as_mut() else {
                return Poll::Ready(Ok(Step::Release));
            };
            let conn = &mut lease.conn;

            // Towards the server.
            if !conn.write_buf.is_empty() {
                match Pin::new(&mut conn.stream).poll_write(cx, &conn.write_buf) {
                    Poll::Ready(Ok(n)) => {
                        conn.write_buf.advance(n);
                        lease.flush_pending = conn.stream.is_tls();
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => {
                        return server_failed(&conn.node, ServerErrorKind::Io(e))
                    }
                    Poll::Pending => {}
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
            if !self.client_out.is_empty() {
                match Pin::new(&mut self.client).poll_write(cx, &self.client_out) {
                    Poll::Ready(Ok(n)) => {
                        self.client_out.advance(n);
                        self.client_flush_pending = self.client.is_tls();
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Relayed::Client(client_io(e)))),
                    Poll::Pending => {}
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
            if self.client_out.len() < HIGH_WATER_BYTES {
                let Some(lease) = self.lease.as_mut() else {
                    return Poll::Ready(Ok(Step::Release));
                };
                let conn = &mut lease.conn;
                buffers::ready_for_read(&mut conn.read_buf);
                match poll_read_buf(Pin::new(&mut conn.stream), cx, &mut conn.read_buf) {
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
                    Poll::Pending => {}
                }
            }

            // From the client.
            if server_backlog < HIGH_WATER_BYTES && !self.routing.held {
                buffers::ready_for_read(&mut self.client_in);
                match poll_read_buf(Pin::new(&mut self.client), cx, &mut self.client_in) {
                    Poll::Ready(Ok(0)) => {
                        return Poll::Ready(Err(Relayed::Client(Disconnect::ClientClosed)))
                    }
                    Poll::Ready(Ok(_)) => {
                        self.process_client_input()?;
                        progressed = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(Relayed::Client(client_io(e)))),
                    Poll::Pending => {}
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
            if self.can_release() {
                return Poll::Ready(Ok(Step::Release));
            }
            if self.stop_when_idle && self.at_idle_point() {
                return Poll::Ready(Err(Relayed::Client(Disconnect::Shutdown)));
            }
            if !progressed {
                return Poll::Pending;
            }
        }
    }

    /// True when the server owes nothing, the transaction is over, and this pool mode lends
    /// connections per transaction or statement.
    fn can_release(&self) -> bool {
        let Some(lease) = self.lease.as_ref() else {
            return false;
        };
        self.mode_shares_servers()
            && self.routing.pinned.is_none()
            && self.queue.is_settled()
            && lease.conn.tx_status == TxStatus::Idle
            && lease.conn.write_buf.is_empty()
            && !lease.flush_pending
            && self.server_passthrough.is_none()
    }

    // ----- client → server -----------------------------------------------------------------

    /// Turns buffered client messages into bytes for the server, queueing what each will be
    /// answered with.
    fn process_client_input(&mut self) -> Result<(), Disconnect> {
        // Borrow the bytes out of `self` so messages can be handled as slices, uncopied.
        let mut input = std::mem::take(&mut self.client_in);
        let result = self.consume_client_messages(&mut input);
        self.client_in = input;
        result?;
        self.emit_ready_synthetics()
    }

    fn consume_client_messages(&mut self, input: &mut BytesMut) -> Result<(), Disconnect> {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.statements.begin_batch();
        }
        loop {
            if self.client_passthrough > 0 {
                let n = self.client_passthrough.min(input.len());
                if n == 0 {
                    return Ok(());
                }
                if let Some(lease) = self.lease.as_mut() {
                    lease.conn.write_buf.extend_from_slice(&input[..n]);
                }
                input.advance(n);
                self.client_passthrough -= n;
                continue;
            }
            let Some(h) = read_header(input, self.max_message_bytes)? else {
                return Ok(());
            };
            if input.len() < h.total_len() {
                // COPY data streams through; everything else is inspected whole.
                if h.tag == ftag::COPY_DATA
                    && self.queue.in_copy_in()
                    && !self.queue.skipping_to_sync()
                {
                    self.client_passthrough = h.total_len();
                    if let Some(replay) = self.routing.replay.as_mut() {
                        replay.repeatable = false;
                    }
                    continue;
                }
                return Ok(());
            }
            if self.must_hold(&input[..]) {
                self.routing.held = true;
                return Ok(());
            }
            let message = &input[..h.total_len()];
            if let Some(replay) = self.routing.replay.as_mut() {
                if self.lease.as_ref().is_some_and(|l| l.on_replica) && replay.repeatable {
                    replay.bytes.extend_from_slice(message);
                }
            }
            // The request's first message decided where it runs; a Query or Sync starts the
            // next one (`end_unit`).
            if std::mem::take(&mut self.routing.at_unit_start) {
                self.tx_started.get_or_insert_with(Instant::now);
            }
            self.on_client_message(h.tag, message)?;
            input.advance(h.total_len());
        }
    }

    /// True when the request starting at the front of `input` must wait until the server it
    /// would otherwise follow owes nothing, then be routed afresh: a request for the primary
    /// while the session holds a replica, or a read while the session holds the primary only
    /// for pgherd's LSN probe (without waiting for its answer the read could not go to a
    /// replica).
    fn must_hold(&mut self, input: &[u8]) -> bool {
        if !self.routing.at_unit_start
            || self.routing.pinned.is_some()
            || !self.mode_shares_servers()
        {
            return false;
        }
        let Some(lease) = self.lease.as_ref() else {
            return false;
        };
        let wanted = if lease.on_replica {
            RouteTarget::Primary
        } else if self.client_tx == TxStatus::Idle
            && self.queue.has_probe()
            && !self.queue.has_client_requests()
        {
            RouteTarget::Replica
        } else {
            return false;
        };
        let routed = self.route_front(input).ok().flatten();
        self.routing.target(routed.as_ref()) == wanted
    }

    /// Notes what a statement the client sends means for routing: a `pgherd.route` setting,
    /// session state that pins the client to this server, a possible write (`executes`: it
    /// runs now, rather than being prepared).
    fn track_statement(&mut self, routed: &Routed, executes: bool) {
        let decision = &routed.decision;
        if let Some(value) = &decision.route_setting {
            self.routing.override_route = Route::parse(value);
        }
        self.routing.unit_copies_in |= decision.copy_in;
        match decision.tx {
            TxEffect::Begin { .. } => self.routing.unit_begins = true,
            TxEffect::End => self.routing.unit_ends = true,
            TxEffect::DefaultReadOnly(Some(on)) => self.routing.default_read_only = on,
            TxEffect::DefaultReadOnly(None) | TxEffect::SetReadOnly | TxEffect::None => {}
        }
        if let Some(pin) = decision.pin {
            if self.routing.pinned.is_none() && self.mode_shares_servers() {
                tracing::info!(client = self.shared.id, node = %self.node_name(), reason = pin.describe(), "session pinned to its server connection");
                self.routing.pinned = Some(pin);
            }
        }
        if executes {
            self.note_possible_write(decision.target == RouteTarget::Primary);
        }
    }

    fn note_possible_write(&mut self, writes: bool) {
        if writes && self.lease.as_ref().is_some_and(|l| !l.on_replica) {
            self.routing.write_seq += 1;
        }
    }

    /// The routing decision for a Query or Parse: the one made to choose the node if it is
    /// this statement's, otherwise a fresh one.
    fn statement_decision(&mut self, sql: &[u8]) -> Option<Result<Routed, PgError>> {
        let router = self.routing.setup.router.clone()?;
        if let Some(front) = self.routing.front.take() {
            return Some(Ok(front));
        }
        Some(router.route(&self.app, sql))
    }

    /// A Query or Sync ended a request. After a write that may have committed, the primary is
    /// asked for its WAL position in the same round trip.
    fn end_unit(&mut self) -> Result<(), Disconnect> {
        // Nothing may follow a COPY FROM STDIN before the client's data: the probe then waits
        // until the server is free again.
        let may_commit = !self.routing.unit_copies_in
            && (self.routing.unit_ends
                || (self.client_tx == TxStatus::Idle && !self.routing.unit_begins));
        self.routing.at_unit_start = true;
        self.routing.unit_begins = false;
        self.routing.unit_ends = false;
        self.routing.unit_copies_in = false;
        self.routing.front = None;
        if may_commit && self.write_needs_probe() && !self.queue.skipping_to_sync() {
            self.push_lsn_probe()?;
        }
        Ok(())
    }

    fn write_needs_probe(&self) -> bool {
        self.routing.read_your_writes()
            && self.routing.write_seq > self.routing.probed_seq
            && self.lease.as_ref().is_some_and(|l| !l.on_replica)
    }

    /// The transaction is over but where its writes end is still unknown: ask before the
    /// server goes back (rare: the probe usually rides along with the request).
    fn probe_before_release(&self) -> bool {
        self.write_needs_probe()
            && self.mode_shares_servers()
            && self.queue.is_settled()
            && self
                .lease
                .as_ref()
                .is_some_and(|l| l.conn.tx_status == TxStatus::Idle && l.conn.write_buf.is_empty())
    }

    fn push_lsn_probe(&mut self) -> Result<(), Disconnect> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        frontend::encode_query(&mut lease.conn.write_buf, LSN_PROBE_SQL)?;
        self.queue.push_internal(Request::LsnProbe {
            write_seq: self.routing.write_seq,
        });
        Ok(())
    }

    fn on_client_message(&mut self, tag: u8, message: &[u8]) -> Result<(), Disconnect> {
        tracing::trace!(client = self.shared.id, tag = %(tag as char), len = message.len(), "client message");
        if tag == ftag::TERMINATE {
            return Err(Disconnect::Terminated);
        }
        if !frontend::is_session_tag(tag) {
            return Err(Disconnect::Protocol(WireError::UnexpectedTag {
                tag,
                context: "from a client (invalid frontend message type)",
            }));
        }
        if self.queue.skipping_to_sync() && tag != ftag::SYNC {
            // The server (or pgherd) is discarding messages after an error, as the protocol says.
            return Ok(());
        }
        let body = &message[HEADER_BYTES..];
        self.relay_client_message(tag, message, body)?;
        if matches!(tag, ftag::QUERY | ftag::SYNC) {
            self.end_unit()?;
        }
        Ok(())
    }

    fn relay_client_message(
        &mut self,
        tag: u8,
        message: &[u8],
        body: &[u8],
    ) -> Result<(), Disconnect> {
        let rewrite = self.mode_shares_servers();
        let mut parse_routed = None;
        match tag {
            ftag::QUERY | ftag::PARSE => {
                let sql = if tag == ftag::QUERY {
                    frontend::Query::parse(body)?.sql
                } else {
                    frontend::Parse::parse(body)?.query
                };
                match self.statement_decision(sql) {
                    Some(Err(e)) => {
                        // pgherd's error in the request's place. A simple query still gets its
                        // ReadyForQuery: a Sync takes the query's place on the server.
                        self.queue.push_synthetic(Synthetic::Error(e));
                        if tag == ftag::QUERY {
                            if let Some(lease) = self.lease.as_mut() {
                                frontend::encode_sync(&mut lease.conn.write_buf);
                                self.queue.push_client(Request::Sync);
                            }
                        }
                        return Ok(());
                    }
                    Some(Ok(routed)) => {
                        self.track_statement(&routed, tag == ftag::QUERY);
                        parse_routed = Some(routed);
                    }
                    None => {}
                }
            }
            ftag::BIND if self.routing.setup.router.is_some() => {
                let b = frontend::Bind::parse(body)?;
                match self.statement_routed(b.statement) {
                    Some(routed) => self.track_statement(&routed, true),
                    None => self.note_possible_write(true),
                }
            }
            ftag::FUNCTION_CALL => self.note_possible_write(true),
            _ => {}
        }
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        match tag {
            ftag::QUERY => {
                let q = frontend::Query::parse(body)?;
                let sql = may_change_session(q.sql).then(|| Bytes::copy_from_slice(q.sql));
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Query { sql });
                lease.pool.stats.queries.fetch_add(1, Ordering::Relaxed);
            }
            ftag::FUNCTION_CALL => {
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Query { sql: None });
            }
            ftag::PARSE => {
                let p = frontend::Parse::parse(body)?;
                if p.name.is_empty() || !rewrite {
                    if p.name.is_empty() {
                        let unnamed = self.unnamed.get_or_insert_with(Default::default);
                        unnamed.query.clear();
                        unnamed.query.extend_from_slice(p.query);
                        unnamed.param_types.clear();
                        unnamed.param_types.extend_from_slice(p.param_types);
                        unnamed.present = true;
                        unnamed.routed = parse_routed;
                        lease.unnamed_here = true;
                    }
                    lease.conn.write_buf.extend_from_slice(message);
                    self.queue.push_client(Request::Parse { cached: None });
                } else {
                    let def = StatementDef::new(p.query, p.param_types);
                    if let Some(routed) = parse_routed {
                        let _ = def.routed.set(routed);
                    }
                    if let Some(replay) = self.routing.replay.as_mut() {
                        replay.repeatable = false;
                    }
                    if let Err(e) = self
                        .statements
                        .get_or_insert_with(Default::default)
                        .define(p.name, def.clone())
                    {
                        self.queue
                            .push_synthetic(Synthetic::Error(statement_error(e)));
                        return Ok(());
                    }
                    if lease.conn.statements.touch(&def.hash) {
                        self.queue.push_synthetic(Synthetic::ParseComplete);
                    } else {
                        evict_for(lease, &mut self.queue, &def)?;
                        frontend::encode_parse(
                            &mut lease.conn.write_buf,
                            &def.server_name,
                            &def.query,
                            &def.param_types,
                        )?;
                        self.queue.push_client(Request::Parse {
                            cached: Some(def.hash),
                        });
                    }
                }
            }
            ftag::BIND => {
                let b = frontend::Bind::parse(body)?;
                if b.statement.is_empty() || !rewrite {
                    if b.statement.is_empty() {
                        self.ensure_unnamed_here()?;
                        if b.portal.is_empty() {
                            self.portal_sql = self
                                .unnamed
                                .as_ref()
                                .filter(|u| u.present && may_change_session(&u.query))
                                .map(|u| u.query.clone().into_boxed_slice());
                        }
                    }
                    let Some(lease) = self.lease.as_mut() else {
                        return Ok(());
                    };
                    lease.conn.write_buf.extend_from_slice(message);
                } else {
                    let def = match statement(&self.statements, b.statement) {
                        Ok(def) => def.clone(),
                        Err(e) => {
                            self.queue
                                .push_synthetic(Synthetic::Error(statement_error(e)));
                            return Ok(());
                        }
                    };
                    ensure_prepared(lease, &mut self.queue, &def)?;
                    frontend::encode_bind(
                        &mut lease.conn.write_buf,
                        b.portal,
                        &def.server_name,
                        b.rest,
                    )?;
                    if b.portal.is_empty() {
                        self.portal_sql = may_change_session(&def.query)
                            .then(|| def.query.clone().into_boxed_slice());
                    }
                }
                self.queue.push_client(Request::Bind);
            }
            ftag::DESCRIBE => {
                let d = frontend::Describe::parse(body)?;
                match (d.target, d.name.is_empty(), rewrite) {
                    (Target::Statement, false, true) => {
                        let def = match statement(&self.statements, d.name) {
                            Ok(def) => def.clone(),
                            Err(e) => {
                                self.queue
                                    .push_synthetic(Synthetic::Error(statement_error(e)));
                                return Ok(());
                            }
                        };
                        ensure_prepared(lease, &mut self.queue, &def)?;
                        frontend::encode_describe(
                            &mut lease.conn.write_buf,
                            Target::Statement,
                            &def.server_name,
                        )?;
                    }
                    (Target::Statement, true, _) => {
                        self.ensure_unnamed_here()?;
                        let Some(lease) = self.lease.as_mut() else {
                            return Ok(());
                        };
                        lease.conn.write_buf.extend_from_slice(message);
                    }
                    _ => lease.conn.write_buf.extend_from_slice(message),
                }
                self.queue.push_client(Request::Describe);
            }
            ftag::EXECUTE => {
                let e = frontend::Execute::parse(body)?;
                let sql = if e.portal.is_empty() {
                    self.portal_sql.as_deref().map(Bytes::copy_from_slice)
                } else {
                    None
                };
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Execute { sql });
                lease.pool.stats.queries.fetch_add(1, Ordering::Relaxed);
            }
            ftag::CLOSE => {
                let c = frontend::Close::parse(body)?;
                if c.target == Target::Statement && !c.name.is_empty() && rewrite {
                    if let Some(replay) = self.routing.replay.as_mut() {
                        replay.repeatable = false;
                    }
                    // The server-side statement stays cached for others; only the name goes.
                    if let Some(statements) = self.statements.as_mut() {
                        statements.close(c.name);
                    }
                    self.queue.push_synthetic(Synthetic::CloseComplete);
                } else {
                    if c.target == Target::Statement && c.name.is_empty() {
                        if let Some(unnamed) = self.unnamed.as_mut() {
                            unnamed.present = false;
                        }
                    }
                    lease.conn.write_buf.extend_from_slice(message);
                    self.queue.push_client(Request::Close);
                }
            }
            ftag::SYNC => {
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Sync);
            }
            ftag::FLUSH => lease.conn.write_buf.extend_from_slice(message),
            ftag::COPY_DATA | ftag::COPY_DONE | ftag::COPY_FAIL => {
                if self.queue.in_copy_in() {
                    lease.conn.write_buf.extend_from_slice(message);
                    if tag != ftag::COPY_DATA {
                        self.queue.client_copy_finished();
                    }
                }
            }
            _ => {
                return Err(Disconnect::Protocol(WireError::UnexpectedTag {
                    tag,
                    context: "from a client after login",
                }))
            }
        }
        Ok(())
    }

    /// Makes sure the server holds the client's unnamed statement before a Bind or Describe
    /// that refers to it: after a change of server connection it is replayed.
    fn ensure_unnamed_here(&mut self) -> Result<(), Disconnect> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let Some(unnamed) = self.unnamed.as_ref().filter(|u| u.present) else {
            return Ok(());
        };
        if !lease.unnamed_here {
            frontend::encode_parse(
                &mut lease.conn.write_buf,
                b"",
                &unnamed.query,
                &unnamed.param_types,
            )?;
            self.queue.push_internal(Request::Parse { cached: None });
            lease.unnamed_here = true;
        }
        Ok(())
    }

    fn emit_ready_synthetics(&mut self) -> Result<(), Disconnect> {
        let mut due = Vec::new();
        self.queue.take_ready_synthetics(&mut due);
        self.write_synthetics(&due)
    }

    fn write_synthetics(&mut self, due: &[Synthetic]) -> Result<(), Disconnect> {
        for s in due {
            match s {
                Synthetic::ParseComplete => {
                    backend::encode_empty(&mut self.client_out, btag::PARSE_COMPLETE)
                }
                Synthetic::CloseComplete => {
                    backend::encode_empty(&mut self.client_out, btag::CLOSE_COMPLETE)
                }
                Synthetic::Error(e) => {
                    self.tx_failed = true;
                    self.app.own_errors.count(&e.code);
                    e.encode(&mut self.client_out)?
                }
            }
        }
        Ok(())
    }

    // ----- server → client -----------------------------------------------------------------

    fn process_server_input(&mut self) -> Result<(), Relayed> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let mut input = std::mem::take(&mut lease.conn.read_buf);
        let result = self.consume_server_messages(&mut input);
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.read_buf = input;
        }
        result
    }

    fn consume_server_messages(&mut self, input: &mut BytesMut) -> Result<(), Relayed> {
        let mut before = Vec::new();
        let mut after = Vec::new();
        loop {
            if let Some((to_client, remaining)) = self.server_passthrough {
                let n = remaining.min(input.len());
                if n == 0 {
                    return Ok(());
                }
                if to_client {
                    self.client_out.extend_from_slice(&input[..n]);
                    self.note_answered();
                }
                input.advance(n);
                self.server_passthrough = (remaining > n).then_some((to_client, remaining - n));
                continue;
            }
            let h = match read_header(input, MAX_SERVER_MESSAGE_BYTES) {
                Ok(Some(h)) => h,
                Ok(None) => return Ok(()),
                Err(e) => {
                    return Err(Relayed::Server(ServerError::new(
                        &self.node_name(),
                        ServerErrorKind::Protocol(e),
                    )))
                }
            };
            let whole = input.len() >= h.total_len();
            if !whole && !matches!(h.tag, btag::DATA_ROW | btag::COPY_DATA) {
                return Ok(());
            }
            before.clear();
            after.clear();
            let d = self
                .queue
                .on_server_message(h.tag, &mut before, &mut after)
                .map_err(|what| {
                    Relayed::Server(ServerError::new(
                        &self.node_name(),
                        ServerErrorKind::Unexpected(what),
                    ))
                })?;
            tracing::trace!(client = self.shared.id, tag = %(h.tag as char), to_client = d.to_client, "server message");
            self.write_synthetics(&before)?;
            if !whole {
                // Rows and COPY data stream through without being buffered whole.
                let n = input.len();
                if d.to_client {
                    self.client_out.extend_from_slice(input);
                    self.note_answered();
                }
                input.advance(n);
                self.server_passthrough = Some((d.to_client, h.total_len() - n));
                continue;
            }
            let message = &input[..h.total_len()];
            let body = &message[HEADER_BYTES..];
            let Some(lease) = self.lease.as_mut() else {
                return Ok(());
            };
            for hash in &d.uncached {
                lease.conn.statements.forget(hash);
            }
            let mut forward = d.to_client;
            match h.tag {
                btag::READY_FOR_QUERY => {
                    let status = backend::parse_ready_for_query(body).map_err(|e| {
                        Relayed::Server(ServerError::new(
                            &lease.conn.node,
                            ServerErrorKind::Protocol(e),
                        ))
                    })?;
                    lease.conn.tx_status = status;
                    if d.client_ready {
                        self.on_client_ready(status)?;
                    }
                    if let Some(write_seq) = d.probe {
                        self.on_probe_answered(write_seq, status);
                    }
                }
                // A server's warning that it is shutting down concerns pgherd, which moves
                // the client on, not the client.
                btag::NOTICE_RESPONSE
                    if PgError::parse(body).is_ok_and(|n| n.code == SqlState::ADMIN_SHUTDOWN) =>
                {
                    forward = false;
                }
                btag::DATA_ROW if d.probe.is_some() => {
                    self.routing.probe_lsn = backend::parse_data_row(body)
                        .ok()
                        .and_then(|values| values.into_iter().next().flatten())
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .and_then(parse_lsn);
                }
                btag::PARAMETER_STATUS if d.to_client => {
                    if let Ok(p) = backend::ParameterStatus::parse(body) {
                        self.params.record_reported(p.name, p.value);
                    }
                }
                btag::COMMAND_COMPLETE if d.to_client => {
                    let tag = backend::parse_command_complete(body).unwrap_or_default();
                    self.on_command_complete(tag, d.sql.as_deref());
                }
                btag::ERROR_RESPONSE => {
                    if d.to_client {
                        self.tx_failed = true;
                    }
                    if let Ok(err) = PgError::parse(body) {
                        if d.to_client {
                            lease.pool.stats.server_errors.count(&err.code);
                        }
                        if matches!(
                            err.severity,
                            pgherd_wire::Severity::Fatal | pgherd_wire::Severity::Panic
                        ) {
                            // The server is about to close; say so when the close is seen.
                            self.server_last_words = Some(Box::new(err));
                            forward = false;
                        } else if d.internal_error && d.probe.is_none() {
                            tracing::warn!(client = self.shared.id, error = %err, "pgherd's own statement failed on the server");
                            let notice = PgError::new(
                                pgherd_wire::Severity::Warning,
                                err.code,
                                format!(
                                    "pgherd could not restore session settings: {}",
                                    err.message
                                ),
                            );
                            notice.encode_notice(&mut self.client_out)?;
                        }
                    }
                }
                _ => {}
            }
            if forward {
                self.client_out.extend_from_slice(message);
                if !matches!(
                    h.tag,
                    btag::NOTICE_RESPONSE | btag::NOTIFICATION_RESPONSE | btag::PARAMETER_STATUS
                ) {
                    self.note_answered();
                }
            }
            input.advance(h.total_len());
            self.write_synthetics(&after)?;
            if let Some(replay) = self.routing.replay.as_mut() {
                if !replay.bytes.is_empty() && !self.queue.has_client_requests() {
                    // Everything sent was answered: nothing to repeat elsewhere any more.
                    replay.restart();
                    replay.attempts = 0;
                }
            }
        }
    }

    fn note_answered(&mut self) {
        if let Some(replay) = self.routing.replay.as_mut() {
            replay.answered = true;
        }
    }

    /// The primary said where the session's writes end (or could not: then reads stay on the
    /// primary until a later probe succeeds).
    fn on_probe_answered(&mut self, write_seq: u64, status: TxStatus) {
        let lsn = self.routing.probe_lsn.take();
        if status != TxStatus::Idle {
            // Asked inside a transaction that is still open: its commit comes later.
            return;
        }
        self.routing.probed_seq = self.routing.probed_seq.max(write_seq);
        self.routing.min_lsn = match lsn {
            Some(lsn) if self.routing.min_lsn == Lsn::MAX => insert_lsn_as_end(lsn),
            Some(lsn) => self.routing.min_lsn.max(insert_lsn_as_end(lsn)),
            None => Lsn::MAX,
        };
    }

    fn node_name(&self) -> String {
        self.lease
            .as_ref()
            .map_or_else(String::new, |l| l.conn.node.clone())
    }

    fn on_command_complete(&mut self, tag: &[u8], sql: Option<&[u8]>) {
        let word = tag.split(|&b| b == b' ').next().unwrap_or_default();
        match word {
            b"SET" | b"RESET" | b"DISCARD" => {
                if tag == b"DISCARD ALL" {
                    self.forget_server_statements();
                }
                if tag.starts_with(b"DISCARD") && tag != b"DISCARD ALL" {
                    return;
                }
                let changes = sql
                    .and_then(|s| std::str::from_utf8(s).ok())
                    .and_then(session_changes);
                match changes {
                    Some(changes) => self.params.record(changes),
                    None => {
                        tracing::debug!(client = self.shared.id, "a session change pgherd cannot replay; the server will be reset before its next client");
                        self.untracked_change = true;
                    }
                }
            }
            b"DEALLOCATE" if tag == b"DEALLOCATE ALL" => self.forget_server_statements(),
            b"ROLLBACK" => self.tx_failed = true,
            _ => {}
        }
    }

    fn forget_server_statements(&mut self) {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.statements.clear();
            lease.unnamed_here = false;
        }
    }

    fn on_client_ready(&mut self, status: TxStatus) -> Result<(), Relayed> {
        self.client_tx = status;
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        if status == TxStatus::Idle {
            self.params.end_transaction(!self.tx_failed);
            self.tx_failed = false;
            lease
                .pool
                .stats
                .transactions
                .fetch_add(1, Ordering::Relaxed);
            if let Some(started) = self.tx_started.take() {
                lease.pool.stats.transaction_time.observe(started.elapsed());
            }
            // A server carrying state the session cannot replay is reset before anyone uses it
            // again, this client included.
            lease.conn.params_fp = if self.untracked_change {
                UNKNOWN
            } else {
                self.params.fingerprint()
            };
            self.untracked_change = false;
        } else if self.mode == PoolMode::Statement {
            return Err(Relayed::Client(Disconnect::Refused(PgError::fatal(
                SqlState::FEATURE_NOT_SUPPORTED,
                "transaction blocks are not allowed in statement pooling mode",
            ))));
        }
        Ok(())
    }
}

/// The client's statement `name`, or the error PostgreSQL would give.
fn statement<'a>(
    statements: &'a Option<Box<ClientStatements>>,
    name: &[u8],
) -> Result<&'a Arc<StatementDef>, StatementError> {
    match statements {
        Some(s) => s.get(name),
        None => Err(StatementError::DoesNotExist(
            String::from_utf8_lossy(name).into_owned(),
        )),
    }
}

fn statement_error(e: StatementError) -> PgError {
    match e {
        StatementError::AlreadyExists(name) => PgError::error(
            SqlState::DUPLICATE_PREPARED_STATEMENT,
            format!("prepared statement \"{name}\" already exists"),
        ),
        StatementError::DoesNotExist(name) => PgError::error(
            SqlState::INVALID_SQL_STATEMENT_NAME,
            format!("prepared statement \"{name}\" does not exist"),
        ),
        StatementError::TooMany(max) => PgError::error(
            SqlState::CONFIGURATION_LIMIT_EXCEEDED,
            format!("a client may hold at most {max} named prepared statements"),
        ),
    }
}

/// Makes room in the server's statement cache for `def`, closing the least recently used one.
fn evict_for(
    lease: &mut Lease,
    queue: &mut ResponseQueue,
    def: &StatementDef,
) -> Result<(), WireError> {
    if let Some(victim) = lease.conn.statements.insert(def.hash) {
        frontend::encode_close(
            &mut lease.conn.write_buf,
            Target::Statement,
            &victim.server_name(),
        )?;
        queue.push_internal(Request::Close);
    }
    Ok(())
}

/// Prepares `def` on the server first if it does not hold it yet.
fn ensure_prepared(
    lease: &mut Lease,
    queue: &mut ResponseQueue,
    def: &StatementDef,
) -> Result<(), WireError> {
    if lease.conn.statements.touch(&def.hash) {
        return Ok(());
    }
    evict_for(lease, queue, def)?;
    frontend::encode_parse(
        &mut lease.conn.write_buf,
        &def.server_name,
        &def.query,
        &def.param_types,
    )?;
    queue.push_internal(Request::Parse {
        cached: Some(def.hash),
    });
    Ok(())
}

/// Asks a replica how far it has replayed until it reaches `lsn` or `wait` passes. Gives the
/// connection back in `Err` if it is still usable.
async fn wait_for_replay(
    mut conn: Box<ServerConn>,
    node: &NodeState,
    lsn: Lsn,
    wait: Duration,
) -> Result<Box<ServerConn>, Option<Box<ServerConn>>> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let rows = match conn.simple_query("SELECT pg_last_wal_replay_lsn()").await {
            Ok(rows) => rows,
            Err(_) => return Err(None),
        };
        let replayed = rows
            .first()
            .and_then(|r| r.first())
            .and_then(|v| v.as_deref())
            .and_then(parse_lsn)
            .unwrap_or(0);
        node.saw_replay(replayed);
        if replayed >= lsn {
            return Ok(conn);
        }
        if tokio::time::Instant::now() + REPLAY_POLL_INTERVAL > deadline {
            return Err(Some(conn));
        }
        tokio::time::sleep(REPLAY_POLL_INTERVAL).await;
    }
}

/// Reads once the socket is readable, holding a buffer only while bytes are there: readiness
/// can be stale, and an idle session must not park with a buffer taken for a read that would
/// have blocked.
fn poll_read_when_ready(
    stream: &mut Stream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    ready!(stream.poll_read_ready(cx))?;
    buffers::ready_for_read(buf);
    let read = poll_read_buf(Pin::new(stream), cx, buf);
    if read.is_pending() {
        buffers::release_if_empty(buf);
    }
    read
}
