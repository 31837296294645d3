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
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use pgherd_config::{PoolMode, Route};
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
use crate::nodes::NodeState;
use crate::pool::{AcquireError, Pool};
use crate::server::{ServerConn, MAX_SERVER_MESSAGE_BYTES};
use crate::stream::Stream;
use params::{may_change_session, session_changes, SessionParams, UNKNOWN};
use queue::{Request, ResponseQueue, Synthetic};
use statements::{ClientStatements, StatementDef, StatementError};

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
}

/// The server connection a session holds.
struct Lease {
    conn: Box<ServerConn>,
    pool: Arc<Pool>,
    flush_pending: bool,
    /// The client's unnamed statement exists on this server connection.
    unnamed_here: bool,
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
    pub route: Route,
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
    route: Route,
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
            route: setup.route,
            lease: None,
            last_pool: None,
            queue: ResponseQueue::default(),
            statements: None,
            unnamed: None,
            portal_sql: None,
            params: setup.params,
            untracked_change: false,
            tx_failed: false,
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

    fn pick_node(&self) -> Result<Arc<NodeState>, PgError> {
        // The primary rarely changes: reuse the last one while it still is the primary.
        if self.route == Route::Primary {
            if let Some((node, _)) = &self.last_pool {
                if node.is_usable_as(crate::nodes::Role::Primary) {
                    return Ok(node.clone());
                }
            }
        }
        let nodes = &self.app.nodes;
        let node = match self.route {
            Route::Primary => nodes.primary(),
            Route::Replica => nodes.pick_replica().or_else(|| nodes.primary()),
        };
        node.ok_or_else(|| {
            PgError::error(
                SqlState::CONNECTION_FAILURE,
                format!(
                    "no {} node is available for database \"{}\"",
                    if self.route == Route::Primary {
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

    /// Takes a server connection for the next request and makes it carry this session's
    /// settings. An idle connection is taken without waiting; otherwise the (boxed) slow path
    /// connects or queues.
    async fn attach(&mut self) -> Result<(), PgError> {
        let node = self.pick_node()?;
        let pool = self.pool_for(&node)?;
        let conn = match pool.try_acquire() {
            Some(conn) => conn,
            // Boxed: opening a connection has a large future, which would otherwise sit in every
            // idle session's task.
            None => Box::pin(self.acquire_slow(&pool, &node)).await?,
        };
        self.shared.set_target(Some(ServerTarget {
            server_id: conn.id,
            peer: conn.peer,
            key: conn.cancel_key,
        }));
        let mut lease = Lease {
            conn,
            pool,
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
        Ok(())
    }

    async fn acquire_slow(
        &mut self,
        pool: &Arc<Pool>,
        node: &NodeState,
    ) -> Result<Box<ServerConn>, PgError> {
        match pool.acquire(&self.app.connect_context()).await {
            Ok(conn) => Ok(conn),
            Err(AcquireError::WaitTimeout { waited, max_size }) => Err(PgError::error(
                SqlState::TOO_MANY_CONNECTIONS,
                format!(
                    "no server connection became free within {} ms (pool for database \"{}\", user \"{}\" on node {} has max_size {max_size})",
                    waited.as_millis(),
                    self.shared.database,
                    self.shared.user,
                    node.name()
                ),
            )
            .with_hint("raise pool.max_size or pool.wait_timeout_ms, or shorten transactions")),
            Err(AcquireError::Server(e)) => {
                tracing::warn!(client = self.shared.id, error = %e, "cannot get a server connection");
                Err(e.to_client_error())
            }
            Err(AcquireError::Closed) => {
                self.last_pool = None;
                Err(PgError::error(SqlState::CANNOT_CONNECT_NOW, "the pool was closed; retry the request"))
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
        let Some(Lease { mut conn, pool, .. }) = self.lease.take() else {
            return;
        };
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
        self.params.end_transaction(false);
        if had_requests {
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

    /// Tells the client why it is being disconnected, then leaves the server in a state the
    /// next client can use, or closes it.
    async fn finish(&mut self, end: &Disconnect) {
        if let Some(err) = end.client_error() {
            if err.encode(&mut self.client_out).is_ok() {
                let _ = tokio::time::timeout(Duration::from_secs(1), async {
                    let _ = self.client.write_all(&self.client_out).await;
                    let _ = self.client.flush().await;
                })
                .await;
            }
        }
        self.client_out.clear();
        if self.lease.is_none() {
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
            if server_backlog < HIGH_WATER_BYTES {
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
                    continue;
                }
                return Ok(());
            }
            self.on_client_message(h.tag, &input[..h.total_len()])?;
            input.advance(h.total_len());
        }
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
        let rewrite = self.mode_shares_servers();
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
                        lease.unnamed_here = true;
                    }
                    lease.conn.write_buf.extend_from_slice(message);
                    self.queue.push_client(Request::Parse { cached: None });
                } else {
                    let def = StatementDef::new(p.query, p.param_types);
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
                        if matches!(
                            err.severity,
                            pgherd_wire::Severity::Fatal | pgherd_wire::Severity::Panic
                        ) {
                            // The server is about to close; say so when the close is seen.
                            self.server_last_words = Some(Box::new(err));
                            forward = false;
                        } else if d.internal_error {
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
            }
            input.advance(h.total_len());
            self.write_synthetics(&after)?;
        }
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
