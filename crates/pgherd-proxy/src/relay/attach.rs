//! Where a request runs and how the session gets there: the request's routing target, the
//! node under the balance policy and read-your-writes, a server connection from that node's
//! pool (carrying the client's settings), waits for a primary or a paused database. What
//! follows the server's use is `detach.rs`.

use pgherd_failover::GateReason;
use pgherd_route::plan::{choose_node, route_request, Framing, NoNode, Statements};

use super::client_input::statement;
use super::*;

/// The session's statements, as the planner asks for them: texts through the database's
/// router (as this session reads strings), prepared ones by name.
struct SessionStatements<'a>(&'a Session);

impl Statements for SessionStatements<'_> {
    type Error = PgError;

    fn route(&self, sql: &[u8]) -> Result<Routed, PgError> {
        let routing = &self.0.routing;
        match routing.lasting.setup.router.as_ref() {
            Some(router) => router.route(sql, routing.lasting.standard_conforming_strings),
            None => Ok(Routed::primary(
                "the session's statements are not classified",
            )),
        }
    }

    fn prepared(&self, name: &[u8]) -> Option<Routed> {
        self.0.statement_routed(name)
    }
}

/// Why a request got no server.
pub(super) enum AttachError {
    Failed(PgError),
    /// pgherd is being upgraded while the request waited, unsent: it moves with the session
    /// to the new process, which runs it.
    Moving,
}

impl From<PgError> for AttachError {
    fn from(e: PgError) -> Self {
        AttachError::Failed(e)
    }
}

/// A node chosen for a request, and the WAL position it must have replayed first.
type Choice = Result<(Arc<NodeState>, Option<Lsn>), PgError>;

/// Where a request that could not take an idle connection at once waits from.
pub(super) enum Waiting {
    /// The database is paused: routed once it may run.
    Paused,
    /// Routed to the target, its node chosen (or why none could be).
    Routed(RouteTarget, Option<Choice>),
}

impl Session {
    /// Where the request at the front of `input` must run ([`route_request`]); the decision
    /// made from its first statement is kept in `routing.front`, so it is not made again when
    /// relayed. A request a standby refused runs on the primary.
    pub(super) fn route_front(&mut self, input: &[u8]) -> Result<RouteTarget, PgError> {
        let session = self.routing.lasting.session;
        if std::mem::take(&mut self.routing.retry_on_primary) {
            self.routing.front = None;
            self.routing.replica_asked = session.route() == Route::Replica;
            return Ok(RouteTarget::Primary);
        }
        let framing = Framing {
            max_message_bytes: self.max_message_bytes,
            streams: client_stream::streams,
        };
        let planned = route_request(input, framing, &session, &SessionStatements(self));
        let planned = match planned {
            Ok(planned) => planned,
            Err(e) => {
                self.routing.front = None;
                self.routing.replica_asked = session.route() == Route::Replica;
                return Err(e);
            }
        };
        self.routing.front = planned.front;
        self.routing.replica_asked = planned.replica_asked;
        Ok(planned.target)
    }

    /// The decision for a statement the client prepared (`""`: the unnamed one).
    pub(super) fn statement_routed(&self, name: &[u8]) -> Option<Routed> {
        self.routing.lasting.setup.router.as_ref()?;
        if name.is_empty() {
            return self
                .unnamed
                .as_ref()
                .filter(|u| u.present)
                .and_then(|u| u.routed.clone());
        }
        let def = statement(&self.statements, name).ok()?;
        self.routed_of(&def)
    }

    /// The decision for one of the client's named statements, made once per router
    /// generation and kept with the statement.
    pub(super) fn routed_of(&self, def: &StatementDef) -> Option<Routed> {
        let router = self.routing.lasting.setup.router.as_ref()?;
        let generation = router.generation();
        let mut decided = def.routed.lock();
        if let Some((at, routed)) = decided.as_ref() {
            if *at == generation {
                return Some(routed.clone());
            }
        }
        let routed = router
            .route(&def.query, self.routing.lasting.standard_conforming_strings)
            .unwrap_or_else(|_| Routed::primary("its routing hint is invalid"));
        *decided = Some((generation, routed.clone()));
        Some(routed)
    }

    /// The node for a request with `target` ([`choose_node`]), and the WAL position to wait
    /// for when the chosen replica has not replayed the session's last write yet.
    pub(super) fn pick_node(&mut self, target: RouteTarget) -> Choice {
        if target == RouteTarget::Primary && !self.app.may_route_writes() {
            // The clock, not only the gate: a stalled instance may run this before its lease's
            // watch has closed the gate.
            return Err(self.writes_refused(Some(&GateReason::NoLease)));
        }
        let last = self.pools.last_node();
        let (routing, app) = (&self.routing, &self.app);
        let config = self.seen.config.load();
        let reads = || {
            let read_your_writes = routing.read_your_writes();
            // Under read-your-writes, the schema changes of every session count as the
            // session's own writes.
            let schema = app.schema_changes.read_needs();
            read_needs(
                config,
                (
                    routing.lasting.setup.balance,
                    routing.lasting.setup.primary_reads,
                ),
                read_your_writes.then_some(routing.lasting.min_lsn.max(schema.min_lsn)),
                routing.write_unconfirmed() || (read_your_writes && schema.unconfirmed),
            )
        };
        let snapshot = app.nodes.snapshot_from(&mut self.seen.nodes);
        match choose_node(&snapshot, target, last, reads) {
            Ok(plan) => Ok((plan.node, plan.wait_for_lsn)),
            Err(NoNode::WritesRefused(_)) => {
                Err(self.writes_refused(self.app.nodes.view().gate().reason()))
            }
            Err(NoNode::Unavailable) => Err(PgError::error(
                SqlState::CONNECTION_FAILURE,
                format!(
                    "no {} node is available for database \"{}\"",
                    if target == RouteTarget::Primary {
                        "primary"
                    } else {
                        "replica or primary"
                    },
                    self.shared.database()
                ),
            )
            .with_detail(format!("nodes: {}", self.app.nodes.describe_all()))),
        }
    }

    pub(super) fn pool_for(&mut self, node: &Arc<NodeState>) -> Result<Arc<Pool>, PgError> {
        let shared = &self.shared;
        self.app
            .pool_cached(&mut self.pools, shared.database(), shared.user(), node)
    }

    /// Takes a server connection for the next request, on the node its routing decision
    /// allows, and makes it carry this session's settings. An idle connection is taken
    /// without waiting ([`Self::attach_now`]); otherwise the boxed slow path waits, connects
    /// or queues: its state, kept in every session's task otherwise, is allocated only when a
    /// request needs it. A replica that cannot be reached leaves the read set and the request
    /// goes elsewhere.
    pub(super) async fn attach(&mut self) -> Result<(), AttachError> {
        // Where the step's own try left off, if it made one.
        let waiting = match self.waiting.take() {
            Some(waiting) => Some(*waiting),
            None => self.attach_start()?,
        };
        if let Some(waiting) = waiting {
            Box::pin(self.attach_waiting(waiting)).await?;
        }
        self.routing.lease_for_front = self.lease.is_some();
        Ok(())
    }

    /// [`Self::attach`] inside the session's step, for a request that takes an idle
    /// connection at once: it is relayed without a return to the session loop (a turn of it
    /// per transaction). `None` when the request must wait, from where this try left off
    /// (kept for `attach`), or when the test hook before attach is armed.
    pub(super) fn attach_in_step(&mut self) -> Option<Result<(), Disconnect>> {
        if crate::failpoint::is_armed(crate::failpoint::BEFORE_ATTACH) {
            return None;
        }
        match self.attach_start() {
            Ok(None) => {
                self.routing.lease_for_front = self.lease.is_some();
                Some(self.process_client_input())
            }
            Ok(Some(waiting)) => {
                self.waiting = Some(Box::new(waiting));
                None
            }
            Err(err) => Some(self.answer_request_with_error(err)),
        }
    }

    /// What both ways into [`Self::attach`] start with: a cancel that came first, then the
    /// warm path.
    fn attach_start(&mut self) -> Result<Option<Waiting>, PgError> {
        if self.shared.take_cancel() {
            return Err(PgError::error(
                SqlState::QUERY_CANCELED,
                "canceling statement due to user request",
            )
            .with_detail("the cancel came before the request reached a server"));
        }
        self.attach_now()
    }

    /// The warm path: routes the request and takes an idle connection of the chosen node at
    /// once; what the slow path starts from if it must wait.
    fn attach_now(&mut self) -> Result<Option<Waiting>, PgError> {
        // The pool's clock (tokio's, which tests may pause), read once for the request.
        let now = tokio::time::Instant::now();
        // The transaction's time, as its client sees it, includes any wait for a server.
        self.tx_started.get_or_insert(now.into_std());
        if self.app.nodes.is_paused(self.shared.database()) {
            return Ok(Some(Waiting::Paused));
        }
        let target = self.routed_front()?;
        let picked = self.pick_node(target);
        if let Ok((node, None)) = &picked {
            let pool = self.pool_for(node)?;
            if let Some(conn) = pool.try_acquire(now) {
                if crate::control::paused_since_acquired(&self.app, self.shared.database()) {
                    pool.release(conn, true);
                    return Ok(Some(Waiting::Paused));
                }
                self.take_lease(node.clone(), pool, conn)?;
                return Ok(None);
            }
        }
        // The choice stands: choosing again would move a balancing turn twice.
        Ok(Some(Waiting::Routed(target, Some(picked))))
    }

    fn routed_front(&mut self) -> Result<RouteTarget, PgError> {
        let input = std::mem::take(&mut self.client_in);
        let target = self.route_front(&input);
        self.client_in = input;
        if target.as_ref().is_ok_and(|t| *t != RouteTarget::Primary) {
            // A read that could use a replica: the session's writes are probed again (this one
            // runs on the primary if one is not).
            self.routing.lasting.writes_since_replica_read = 0;
        }
        target
    }

    /// The slow path of [`Self::attach`].
    async fn attach_waiting(&mut self, waiting: Waiting) -> Result<(), AttachError> {
        let (mut target, mut picked) = match waiting {
            Waiting::Routed(target, picked) => (target, picked),
            Waiting::Paused => {
                self.wait_while_paused().await?;
                (self.routed_front()?, None)
            }
        };
        let mut failures = 0;
        let mut held_since = None;
        let (node, pool, conn) = loop {
            let choice = picked.take().unwrap_or_else(|| self.pick_node(target));
            let (node, wait_for_lsn) = match choice {
                Ok(choice) => choice,
                // The write gate refuses: at once, as it says (a client of several instances
                // moves on), not after waiting for a primary.
                Err(e) if e.code == SqlState::READ_ONLY_SQL_TRANSACTION => return Err(e.into()),
                Err(e) => {
                    if self
                        .interruptible(self.hold_for_primary(&mut held_since))
                        .await?
                    {
                        continue;
                    }
                    return Err(e.into());
                }
            };
            let pool = self.pool_for(&node)?;
            let acquired = match pool.try_acquire(tokio::time::Instant::now()) {
                Some(conn) => Ok(conn),
                None => {
                    self.interruptible(pool.acquire(&self.app.connect_context()))
                        .await?
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
                    return Err(self.acquire_error(e, &node).into());
                }
            };
            let Some(lsn) = wait_for_lsn else {
                break (node, pool, conn);
            };
            let wait = Duration::from_millis(self.app.config().routing.read_your_writes_wait_ms);
            match wait_for_replay(conn, &node, lsn, wait).await {
                Ok(conn) => break (node, pool, conn),
                Err(conn) => {
                    if let Some(conn) = conn {
                        pool.release(conn, true);
                    }
                    target = RouteTarget::Primary;
                }
            }
        };
        if crate::control::paused_since_acquired(&self.app, self.shared.database()) {
            pool.release(conn, true);
            return Box::pin(self.attach_waiting(Waiting::Paused)).await;
        }
        Ok(self.take_lease(node, pool, conn)?)
    }

    /// Holds `conn` from here on: its cancel key is where the client's cancels go, and it is
    /// given the client's settings and cleared of what the last client left.
    pub(super) fn take_lease(
        &mut self,
        node: Arc<NodeState>,
        pool: Arc<Pool>,
        conn: Box<ServerConn>,
    ) -> Result<(), PgError> {
        self.shared.set_target(
            ServerTarget {
                server_id: conn.id,
                peer: conn.peer,
                key: conn.cancel_key,
                node: ServerTarget::node_id(&node),
            },
            conn.stream.tcp_fd(),
        );
        let counted = node.begin_lease();
        let on_replica = node.role() == Role::Replica;
        let mut lease = Lease {
            conn,
            pool,
            node,
            counted,
            on_replica,
            flush_pending: false,
            unnamed_here: false,
            bytes_to_server: 0,
            bytes_to_client: 0,
        };
        for sql in params::catch_up_sql(
            &self.params,
            lease.conn.params_fp,
            &lease.conn.residue,
            params::fresh_seed,
        ) {
            frontend::encode_query(&mut lease.conn.write_buf, sql.as_bytes())?;
            self.queue.push_internal(Request::Query { sql: None });
        }
        lease.conn.params_fp = self.params.fingerprint();
        lease.conn.residue = params::Residue::default();
        self.lease = Some(lease);
        self.routing.at_unit_start = true;
        // A request is kept until answered where it can run again elsewhere: any read of
        // a replica, and on the primary what a connection that died before reading it
        // never ran (shared servers only: a session's own cannot be replaced).
        if self.client_tx == TxStatus::Idle && (on_replica || self.mode_shares_servers()) {
            self.routing
                .replay
                .get_or_insert_with(Default::default)
                .restart();
        } else if let Some(replay) = self.routing.replay.as_mut() {
            replay.repeatable = false;
        }
        Ok(())
    }

    /// `PAUSE` on the admin console holds the request (see `control::wait_resumed`).
    pub(super) async fn wait_while_paused(&self) -> Result<(), AttachError> {
        let database = self.shared.database();
        tracing::debug!(client = self.shared.id, %database, "request waits: the database is paused");
        let resumed = crate::control::wait_resumed(&self.app, database);
        Ok(self.interruptible(resumed).await??)
    }

    /// Runs a wait for a server unless the client cancels its request first (then the request
    /// fails as PostgreSQL fails a cancelled statement), or pgherd is upgraded meanwhile and
    /// the session can move (then the request, unsent, goes with it).
    pub(super) async fn interruptible<T>(
        &self,
        wait: impl Future<Output = T>,
    ) -> Result<T, AttachError> {
        let may_move = matches!(self.movable(), super::moving::Movable::Now);
        // A cancel still raised now came while this request was in hand (one that came while
        // the session had none was forgotten at its idle point): it ends the wait at once.
        let outcome = tokio::select! {
            biased;
            done = wait => Ok(done),
            interrupt = self.shared.wait_interrupted(may_move) => Err(match interrupt {
                crate::clients::Interrupt::Cancelled => PgError::error(
                    SqlState::QUERY_CANCELED,
                    "canceling statement due to user request",
                )
                .with_detail("the request was still waiting for a server connection")
                .into(),
                crate::clients::Interrupt::Handover => AttachError::Moving,
            }),
        };
        self.shared.end_wait();
        outcome
    }

    /// Why the request at the front counts as one that may write, for a refusal's DETAIL: a
    /// read pgherd cannot prove harmless (a function or relation its catalog does not know
    /// yet) is refused like a write, and the client should be told which it was.
    fn why_on_the_primary(&self) -> Option<String> {
        let front = self.routing.front.as_ref()?;
        if front.hint == Some(Route::Primary) {
            return Some("its /* pgherd:primary */ hint sends it to the primary".to_owned());
        }
        if self.routing.lasting.session.route() == Route::Primary {
            return Some(
                "the session's route is primary (pgherd.route or the database's route)".to_owned(),
            );
        }
        (front.decision.target == RouteTarget::Primary)
            .then(|| format!("pgherd sends it to the primary: {}", front.decision.reason))
    }

    /// The error for a write the gate refuses, saying why and when writes resume.
    fn writes_refused(&self, reason: Option<&GateReason>) -> PgError {
        let why = reason.map_or_else(
            || "the write gate is closed".to_owned(),
            |r| self.app.nodes.gate_sentence(r),
        );
        let refused = PgError::error(
            SqlState::READ_ONLY_SQL_TRANSACTION,
            format!("writes are refused: {why}"),
        )
        .with_hint(reason.map_or("", |r| r.resumes_when()));
        match self.why_on_the_primary() {
            Some(why) => refused.with_detail(why),
            None => refused,
        }
    }

    /// Lets a request that has sent nothing yet wait a little for a node that accepts writes
    /// (a failover, a switchover or a restart of the primary) instead of failing it; false
    /// once `cluster.primary_wait_ms` has passed since it first waited.
    pub(super) async fn hold_for_primary(&self, since: &mut Option<Instant>) -> bool {
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

    pub(super) fn acquire_error(&mut self, e: AcquireError, node: &NodeState) -> PgError {
        match &e {
            AcquireError::Server(server) => {
                tracing::warn!(client = self.shared.id, error = %server, "cannot get a server connection");
            }
            AcquireError::Closed => self.pools.clear(),
            AcquireError::WaitTimeout { .. } => {}
        }
        e.to_client_error(self.shared.database(), self.shared.user(), node.name())
    }
}

/// Asks a replica how far it has replayed until it reaches `lsn` or `wait` passes. Gives the
/// connection back in `Err` if it is still usable. A replica on a fast link replays a commit
/// a fraction of a millisecond after it: the first few questions follow each other at once
/// (one round trip apart), later ones a poll interval apart, so a read right after its
/// session's write waits about as long as the replay and not a timer tick.
pub(crate) async fn wait_for_replay(
    mut conn: Box<ServerConn>,
    node: &NodeState,
    lsn: Lsn,
    wait: Duration,
) -> Result<Box<ServerConn>, Option<Box<ServerConn>>> {
    let deadline = tokio::time::Instant::now() + wait;
    for asked in 1u32.. {
        let rows = match conn
            .simple_query("SELECT pg_catalog.pg_last_wal_replay_lsn()")
            .await
        {
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
        if asked < REPLAY_QUICK_ASKS {
            if tokio::time::Instant::now() > deadline {
                return Err(Some(conn));
            }
            continue;
        }
        if tokio::time::Instant::now() + REPLAY_POLL_INTERVAL > deadline {
            return Err(Some(conn));
        }
        tokio::time::sleep(REPLAY_POLL_INTERVAL).await;
    }
    Err(Some(conn))
}
