//! One backend link of a sharded statement: a server connection from the pool of a shard's
//! primary, carrying the client's settings, that runs one statement (a simple query, or with
//! the client's bound parameters in the extended protocol) and hands back its answer message
//! by message. The connection goes back to its pool when the link is dropped:
//! reusable only once its answer was read to the end (`ReadyForQuery`, idle).

use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};
use pgherd_wire::backend::{self, tag as btag, TxStatus};
use pgherd_wire::{frontend, PgError, SqlState, WireError};

use super::reads::NodeChoice;
use crate::app::{App, PoolCache};
use crate::clients::{ClientShared, ServerTarget};
use crate::counters::GaugeStripe;
use crate::error::{ServerError, ServerErrorKind};
use crate::msgio::{read_message, write_flush, ReadError};
use crate::nodes::NodeState;
use crate::pool::AcquireError;
use crate::pool::Pool;
use crate::relay::params::{self, SessionParams};
use crate::relay::wait_for_replay;
use crate::server::{ServerConn, MAX_SERVER_MESSAGE_BYTES};

/// How long a cancel for a link dropped mid-answer may take to reach its server.
const CANCEL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

pub struct Link {
    pub shard: u32,
    node: Arc<NodeState>,
    /// Where `node` counted this lease (`NodeState::begin_lease`).
    counted: GaugeStripe,
    pool: Arc<Pool>,
    conn: Option<Box<ServerConn>>,
    /// The answer was read to its `ReadyForQuery`: the connection may serve someone else.
    settled: bool,
    /// The last answer was read to its `ReadyForQuery` (idle or inside a transaction).
    answered: bool,
    /// The statement may have left session state pgherd does not follow (a setting, a
    /// sequence's `currval`, whatever user code did): the connection is closed, not reused.
    leaves_state: bool,
    /// ParameterStatus messages of pgherd's own statements, for the client.
    reported: Vec<Message>,
    /// A `COPY ... FROM STDIN` pgherd sent is under way.
    copying: bool,
    /// The statement under way was sent with the extended protocol for a client that did not
    /// ask for its row description: the server's is not passed on.
    hide_description: bool,
}

/// A statement as it reaches a server.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub sql: &'a str,
    /// Extended protocol: the client's parameter types and bound values (`None`: a simple
    /// query).
    pub bound: Option<&'a Bound>,
}

impl<'a> Query<'a> {
    pub fn simple(sql: &'a str) -> Query<'a> {
        Query { sql, bound: None }
    }

    /// The same parameters with another text (a shard's own statement).
    pub fn with_sql(self, sql: &'a str) -> Query<'a> {
        Query { sql, ..self }
    }
}

/// What the client's Parse and Bind gave a statement run with the extended protocol.
#[derive(Debug, Clone)]
pub struct Bound {
    /// The Parse's parameter type section (a count, then that many type OIDs).
    pub param_types: Bytes,
    /// The Bind's body after its names: parameter formats and values, result formats.
    pub bind_rest: Bytes,
    /// The client described the portal: the answer starts with its row description.
    pub describe: bool,
}

/// Why a link could not be opened.
pub enum OpenError {
    Pg(PgError),
    /// No server connection of `node`'s pool.
    Acquire(AcquireError, Arc<NodeState>),
}

impl From<PgError> for OpenError {
    fn from(e: PgError) -> Self {
        OpenError::Pg(e)
    }
}

impl OpenError {
    pub fn into_pg(self, shared: &ClientShared) -> PgError {
        match self {
            OpenError::Pg(e) => e,
            OpenError::Acquire(e, node) => {
                e.to_client_error(shared.database(), shared.user(), node.name())
            }
        }
    }
}

/// One message of an answer: its tag and body.
pub type Message = (u8, BytesMut);

/// What the server answered to one of pgherd's own statements.
#[derive(Debug, Default)]
pub struct OwnAnswer {
    pub refused: Option<PgError>,
    pub tag: Option<String>,
    pub value: Option<String>,
    /// The last row, as the server sent it.
    pub last_row: Option<BytesMut>,
}

impl Link {
    /// A connection to `node` of `shard` for the client, with the client's settings on it;
    /// `pool_cache` is the session's last pool on this shard. A replica that has not replayed
    /// `wait_for_lsn` within `read_your_writes_wait_ms` gives `Ok(None)`.
    pub async fn open(
        app: &App,
        shared: &ClientShared,
        shard: u32,
        choice: NodeChoice,
        params: &SessionParams,
        pool_cache: &mut PoolCache,
    ) -> Result<Option<Link>, OpenError> {
        let node = choice.node;
        let pool = app
            .pool_cached(pool_cache, shared.database(), shared.user(), &node)
            .map_err(OpenError::Pg)?;
        let mut conn = match pool.try_acquire(tokio::time::Instant::now()) {
            Some(conn) => conn,
            None => {
                let acquire = async {
                    pool.acquire(&app.connect_context())
                        .await
                        .map_err(|e| OpenError::Acquire(e, node.clone()))
                };
                super::cancellable(shared, acquire).await?
            }
        };
        if let Some(lsn) = choice.wait_for_lsn {
            let wait =
                std::time::Duration::from_millis(app.config().routing.read_your_writes_wait_ms);
            match Box::pin(wait_for_replay(conn, &node, lsn, wait)).await {
                Ok(caught_up) => conn = caught_up,
                Err(behind) => {
                    if let Some(conn) = behind {
                        pool.release(conn, true);
                    }
                    return Ok(None);
                }
            }
        }
        let counted = node.begin_lease();
        let mut link = Link {
            shard,
            node,
            counted,
            pool,
            conn: Some(conn),
            settled: true,
            answered: true,
            leaves_state: false,
            reported: Vec::new(),
            copying: false,
            hide_description: false,
        };
        link.carry_settings(params).await.map_err(OpenError::Pg)?;
        Ok(Some(link))
    }

    /// The link's node was a replica when it was taken.
    pub fn on_replica(&self) -> bool {
        self.node.role() == crate::nodes::Role::Replica
    }

    fn conn(&mut self) -> Result<&mut ServerConn, PgError> {
        self.conn.as_deref_mut().ok_or_else(|| {
            PgError::error(
                SqlState::CONNECTION_FAILURE,
                "the server connection of this shard was lost",
            )
        })
    }

    /// Resets what the connection's last client set and applies this client's settings, as
    /// the relay does before a request.
    async fn carry_settings(&mut self, params: &SessionParams) -> Result<(), PgError> {
        let conn = self.conn()?;
        let statements =
            params::catch_up_sql(params, conn.params_fp, &conn.residue, params::fresh_seed);
        for sql in statements {
            if let Err(e) = conn.simple_query(&sql).await {
                self.settled = false;
                return Err(match e {
                    crate::server::QueryError::Sql(e) => e,
                    crate::server::QueryError::Server(e) => e.to_client_error(),
                });
            }
        }
        conn.params_fp = params.fingerprint();
        conn.residue = params::Residue::default();
        Ok(())
    }

    /// Its last answer was read to the end: the link can take another statement.
    pub fn answered(&self) -> bool {
        self.answered && self.conn.is_some()
    }

    /// The connection is closed once used: its statement may leave session state behind.
    pub fn close_after_use(&mut self) {
        self.leaves_state = true;
    }

    /// The node this link's server connection is on.
    pub fn node_id(&self) -> pgherd_failover::NodeId {
        self.node.id
    }

    /// Where a cancel for this link's statement goes, and the TCP socket it runs through.
    pub fn target(&self) -> Option<(ServerTarget, Option<std::os::fd::RawFd>)> {
        self.conn.as_ref().map(|conn| {
            let target = ServerTarget {
                server_id: conn.id,
                peer: conn.peer,
                key: conn.cancel_key,
                node: ServerTarget::node_id(&self.node),
            };
            (target, conn.stream.tcp_fd())
        })
    }

    /// Sends one simple query.
    pub async fn send(&mut self, sql: &str) -> Result<(), PgError> {
        self.send_query(Query::simple(sql)).await
    }

    /// Sends one statement: a simple query, or Parse, Bind, Describe, Execute and Sync of the
    /// unnamed statement and portal with the client's parameters.
    pub async fn send_query(&mut self, query: Query<'_>) -> Result<(), PgError> {
        let mut out = BytesMut::with_capacity(query.sql.len() + 64);
        let sql = query.sql.as_bytes();
        match query.bound {
            None => frontend::encode_query(&mut out, sql).map_err(too_long)?,
            Some(bound) => {
                frontend::encode_parse(&mut out, b"", sql, &bound.param_types).map_err(too_long)?;
                frontend::encode_bind(&mut out, b"", b"", &bound.bind_rest).map_err(too_long)?;
                frontend::encode_describe(&mut out, frontend::Target::Portal, b"")
                    .map_err(too_long)?;
                frontend::encode_execute(&mut out, b"", 0).map_err(too_long)?;
                frontend::encode_sync(&mut out);
            }
        }
        self.hide_description = query.bound.is_some_and(|b| !b.describe);
        self.send_encoded(&out).await
    }

    /// What the server says of `sql` (with `bind_rest`, of its portal) without running it:
    /// the parameter and row descriptions (`Ok(Err(e))` if it refused the statement).
    pub async fn describe(
        &mut self,
        sql: &str,
        param_types: &[u8],
        bind_rest: Option<&[u8]>,
    ) -> Result<Result<Vec<Message>, PgError>, PgError> {
        let mut out = BytesMut::with_capacity(sql.len() + 64);
        frontend::encode_parse(&mut out, b"", sql.as_bytes(), param_types).map_err(too_long)?;
        let target = match bind_rest {
            Some(rest) => {
                frontend::encode_bind(&mut out, b"", b"", rest).map_err(too_long)?;
                frontend::Target::Portal
            }
            None => frontend::Target::Statement,
        };
        frontend::encode_describe(&mut out, target, b"").map_err(too_long)?;
        frontend::encode_sync(&mut out);
        self.hide_description = false;
        self.send_encoded(&out).await?;
        let mut described = Vec::new();
        let mut refused = None;
        loop {
            let (tag, body) = self.next().await?;
            match tag {
                btag::READY_FOR_QUERY => return Ok(refused.map_or(Ok(described), Err)),
                btag::ERROR_RESPONSE => {
                    refused.get_or_insert(server_error(self.shard, &body));
                }
                btag::PARAMETER_DESCRIPTION | btag::ROW_DESCRIPTION | btag::NO_DATA => {
                    described.push((tag, body))
                }
                _ => {}
            }
        }
    }

    /// Runs a statement of pgherd's own (`BEGIN`, `PREPARE TRANSACTION`, ...) whose answer the
    /// client does not see: `Ok(None)` done, `Ok(Some(error))` the server refused it, `Err` the
    /// connection failed before the answer ended.
    pub async fn run_own(&mut self, sql: &str) -> Result<Option<PgError>, PgError> {
        Ok(self.ask_own(sql).await?.refused)
    }

    /// [`Self::run_own`], keeping what the answer said: its error, last command tag and
    /// last row (its first value as text). Reported parameters are kept for [`Self::take_reported`].
    pub async fn ask_own(&mut self, sql: &str) -> Result<OwnAnswer, PgError> {
        self.send(sql).await?;
        self.ask_answer().await
    }

    /// The answer to what was sent, read to its `ReadyForQuery`.
    pub async fn ask_answer(&mut self) -> Result<OwnAnswer, PgError> {
        let mut answer = OwnAnswer::default();
        loop {
            let (tag, body) = self.next().await?;
            match tag {
                btag::READY_FOR_QUERY => return Ok(answer),
                btag::ERROR_RESPONSE => {
                    answer
                        .refused
                        .get_or_insert(server_error(self.shard, &body));
                }
                btag::COMMAND_COMPLETE => answer.tag = command_tag(&body).map(str::to_owned),
                btag::DATA_ROW => {
                    answer.value = backend::parse_data_row(&body)
                        .ok()
                        .and_then(|values| values.first().copied().flatten())
                        .map(|v| String::from_utf8_lossy(v).into_owned());
                    answer.last_row = Some(body);
                }
                btag::PARAMETER_STATUS => self.reported.push((tag, body)),
                _ => {}
            }
        }
    }

    /// [`Self::ask_own`] of a statement that must end with `tag`: a transaction that had
    /// failed answers `ROLLBACK` to `COMMIT` or `PREPARE TRANSACTION`, which is a refusal.
    pub async fn run_expecting(
        &mut self,
        sql: &str,
        tag: &str,
    ) -> Result<Option<PgError>, PgError> {
        let answer = self.ask_own(sql).await?;
        if answer.refused.is_some() || answer.tag.as_deref() == Some(tag) {
            return Ok(answer.refused);
        }
        Ok(Some(PgError::error(
            SqlState::TRANSACTION_ROLLBACK,
            format!(
                "shard {} rolled back its part of the transaction: it answered {} to {tag}",
                self.shard,
                answer.tag.as_deref().unwrap_or("nothing")
            ),
        )))
    }

    /// Sends `COPY ... FROM STDIN` and reads to the server's CopyInResponse: `Ok(Ok(body))` the
    /// server waits for data, `Ok(Err(e))` it refused (the answer read to its end).
    pub async fn start_copy_in(&mut self, sql: &str) -> Result<Result<BytesMut, PgError>, PgError> {
        self.send(sql).await?;
        self.copying = true;
        let mut refused = None;
        loop {
            let (tag, body) = self.next().await?;
            match tag {
                btag::COPY_IN_RESPONSE => return Ok(Ok(body)),
                btag::ERROR_RESPONSE => {
                    refused.get_or_insert(server_error(self.shard, &body));
                }
                btag::READY_FOR_QUERY => {
                    self.copying = false;
                    return Ok(Err(refused.unwrap_or_else(|| {
                        PgError::error(
                            SqlState::PROTOCOL_VIOLATION,
                            format!("shard {} did not start the COPY", self.shard),
                        )
                    })));
                }
                _ => {}
            }
        }
    }

    /// Whether a COPY pgherd started on it is under way.
    pub fn is_copying(&self) -> bool {
        self.copying
    }

    /// Sends messages already encoded (a query, CopyData, CopyDone, CopyFail) without
    /// waiting for an answer.
    pub async fn send_encoded(&mut self, messages: &[u8]) -> Result<(), PgError> {
        self.settled = false;
        self.answered = false;
        let conn = self.conn()?;
        let written = write_flush(&mut conn.stream, messages).await;
        written.map_err(|e| ServerError::new(&conn.node, ServerErrorKind::Io(e)).to_client_error())
    }

    /// After CopyDone or CopyFail: the COPY's answer, read to its end (its row count, or the
    /// server's error).
    pub async fn finish_copy(&mut self) -> Result<Result<u64, PgError>, PgError> {
        let answer = self.ask_answer().await;
        self.copying = false;
        let answer = answer?;
        if let Some(refused) = answer.refused {
            return Ok(Err(refused));
        }
        let count = answer.tag.as_deref().and_then(copied_rows);
        Ok(count.ok_or_else(|| {
            PgError::error(
                SqlState::PROTOCOL_VIOLATION,
                format!("shard {} ended the COPY with {:?}", self.shard, answer.tag),
            )
        }))
    }

    /// Parameters the server reported while running pgherd's own statements, in order.
    pub fn take_reported(&mut self) -> Vec<Message> {
        std::mem::take(&mut self.reported)
    }

    /// The next message of the answer; `ReadyForQuery` is the last, after which the link may
    /// be given back. The server's ParseComplete and BindComplete are not passed on: pgherd
    /// answered the client's Parse and Bind itself.
    pub async fn next(&mut self) -> Result<Message, PgError> {
        loop {
            let message = self.next_any().await?;
            let hidden = match message.0 {
                btag::PARSE_COMPLETE | btag::BIND_COMPLETE => true,
                btag::ROW_DESCRIPTION | btag::NO_DATA => self.hide_description,
                _ => false,
            };
            if !hidden {
                return Ok(message);
            }
        }
    }

    async fn next_any(&mut self) -> Result<Message, PgError> {
        let copying = self.copying;
        let conn = self.conn()?;
        let read = read_message(
            &mut conn.stream,
            &mut conn.read_buf,
            MAX_SERVER_MESSAGE_BYTES,
        )
        .await;
        let (tag, body) = match read {
            Ok(message) => message,
            Err(ReadError::Eof) => return Err(lost(&conn.node, "it closed the connection")),
            Err(ReadError::Io(e)) => return Err(lost(&conn.node, &e.to_string())),
            Err(ReadError::Wire(e)) => return Err(lost(&conn.node, &e.to_string())),
        };
        match tag {
            btag::READY_FOR_QUERY => {
                let status = backend::parse_ready_for_query(&body)
                    .map_err(|e| lost(&conn.node, &e.to_string()))?;
                conn.tx_status = status;
                self.settled = status == TxStatus::Idle;
                self.answered = true;
            }
            btag::COPY_IN_RESPONSE if copying => {}
            // A COPY out needs nothing of pgherd (its rows pass like any answer's); one that
            // waits for data pgherd did not ask for is not followed.
            btag::COPY_IN_RESPONSE | btag::COPY_BOTH_RESPONSE => {
                return Err(lost(&conn.node, "it started a COPY pgherd did not ask for"));
            }
            _ => {}
        }
        Ok((tag, body))
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.node.end_lease(self.counted);
            if !self.answered {
                // Dropped mid-answer: a kill, the client gone, another shard's error.
                crate::server::cancel_before_closing(&conn, CANCEL_TIMEOUT);
            }
            self.pool.release(conn, self.settled && !self.leaves_state);
        }
    }
}

fn too_long(e: WireError) -> PgError {
    PgError::error(SqlState::PROGRAM_LIMIT_EXCEEDED, e.to_string())
}

/// A CommandComplete's tag (`UPDATE 3`), if it reads as one.
pub fn command_tag(body: &[u8]) -> Option<&str> {
    backend::parse_command_complete(body)
        .ok()
        .and_then(|tag| std::str::from_utf8(tag).ok())
}

/// The row count of a `COPY n` command tag.
pub fn copied_rows(tag: &str) -> Option<u64> {
    tag.strip_prefix("COPY ")?.parse().ok()
}

/// The connection to `node` failed while an answer was read.
fn lost(node: &str, detail: &str) -> PgError {
    PgError::error(
        SqlState::CONNECTION_FAILURE,
        format!("the server connection to node {node} failed"),
    )
    .with_detail(detail)
}

/// The error an ErrorResponse of shard `shard` carries (one pgherd cannot read is a protocol
/// violation naming the shard).
pub fn server_error(shard: u32, body: &[u8]) -> PgError {
    PgError::parse(body).unwrap_or_else(|e| {
        PgError::error(SqlState::PROTOCOL_VIOLATION, format!("shard {shard}: {e}"))
    })
}

/// Appends a message as the wire carries it.
pub fn encode_message(out: &mut BytesMut, (tag, body): &Message) {
    out.put_u8(*tag);
    out.put_i32(body.len() as i32 + 4);
    out.put_slice(body);
}
