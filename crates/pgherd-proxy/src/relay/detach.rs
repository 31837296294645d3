//! What follows a server's use: giving it back to its pool (at the end of a transaction, or
//! with its state unknown), a server that failed under a request (the request run elsewhere
//! or again on the primary, or the client told), and the session's end (its server cleaned up
//! and reset for the next client, or closed).

use super::*;

impl Session {
    /// Gives the server connection back once no cancel is on its way to it. `reusable` is
    /// false if its state is unknown.
    pub(super) async fn detach(&mut self, reusable: bool) {
        if self.lease.is_none() {
            return;
        }
        self.shared
            .clear_target(&self.app.clients.cancel_acknowledged)
            .await;
        self.give_back_server(reusable);
    }

    /// Returns the server connection to its pool; the cancel target must be cleared already.
    pub(super) fn give_back_server(&mut self, reusable: bool) {
        self.tx_ended = None;
        self.give_back_server_at(reusable, tokio::time::Instant::now());
    }

    /// [`Self::give_back_server`] as the transaction that just ended leaves it: the time it
    /// ended is when the server was last used.
    pub(super) fn give_back_server_after_transaction(&mut self) {
        let now = self
            .tx_ended
            .take()
            .unwrap_or_else(tokio::time::Instant::now);
        self.give_back_server_at(true, now);
    }

    fn give_back_server_at(&mut self, reusable: bool, now: tokio::time::Instant) {
        if let Some(lease) = self.lease.as_mut() {
            lease.flush_byte_counts();
        }
        let Some(Lease {
            mut conn,
            pool,
            node,
            counted,
            ..
        }) = self.lease.take()
        else {
            return;
        };
        node.end_lease(counted);
        self.routing.held = false;
        self.routing.lease_for_front = false;
        // What ran there stays there: a probe ran, or the server was reset or closed.
        self.routing.lasting.effect = SessionEffect::None;
        if let Some(replay) = self.routing.replay.as_mut() {
            replay.restart();
        }
        let clean = reusable && self.queue.is_settled() && conn.read_buf.is_empty();
        if !clean {
            conn.write_buf.clear();
        }
        buffers::shrink_if_grown(&mut conn.read_buf);
        buffers::shrink_if_grown(&mut conn.write_buf);
        pool.release_at(conn, clean, now);
        self.queue.clear();
        self.server_passthrough = None;
        self.after_stream.clear();
        // A probe whose answer can no longer come (the server failed under it) must not
        // leave the session looking busy: it could never move in an upgrade.
        self.probe_rows = None;
    }

    /// A server connection failed while attached. The client keeps its connection in
    /// transaction and statement mode: it gets an error for whatever was in flight, and its
    /// next request gets a new server.
    pub(super) async fn on_server_failure(&mut self, e: ServerError) -> Result<(), Disconnect> {
        self.fill = None;
        // Whether it committed is unknown: what it wrote is dropped anyway, and where a
        // schema change it made ends will not be known.
        self.drop_written_tables();
        self.routing.lasting.schema_change = None;
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
            return Err(Disconnect::ServerLost(Box::new(e)));
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

    /// A server failed before the request ran there, so it is put back in front of the
    /// client's input to run on another connection: a replica that failed before answering
    /// any of the reads sent to it (it also leaves the read set), or a primary connection
    /// nothing of the request reached ([`Self::ran_nowhere_on_primary`]). The pool's other
    /// idle connections to the node, likely ended alike, are closed. Returns false if that is
    /// not possible or not sure.
    pub(super) async fn try_elsewhere(&mut self, e: &ServerError) -> bool {
        let Some(lease) = self.lease.as_ref() else {
            return false;
        };
        let (on_replica, node) = (lease.on_replica, lease.node.clone());
        let sure = on_replica || self.ran_nowhere_on_primary(e);
        let Some(replay) = self.routing.replay.as_mut() else {
            return false;
        };
        if !sure
            || self.client_tx != TxStatus::Idle
            || !replay.repeatable
            || replay.answered
            || replay.bytes.is_empty()
            || replay.attempts >= MAX_REPLAYS
            || self.client_stream.is_some()
        {
            return false;
        }
        replay.attempts += 1;
        self.skip_preliminaries = replay.preliminaries;
        forget_defined(&mut self.statements, replay);
        let mut again = std::mem::take(&mut replay.bytes);
        again.extend_from_slice(&self.client_in);
        self.client_in = again;
        if on_replica {
            tracing::warn!(client = self.shared.id, node = %node.name(), error = %e, "replica failed before answering; sending the request elsewhere");
            node.leave_read_set(&e.to_string());
        } else {
            tracing::warn!(client = self.shared.id, node = %node.name(), error = %e, "server connection had closed before it read the request; sending it on another");
        }
        self.app.drop_idle_connections(&node);
        self.detach(false).await;
        self.routing.at_unit_start = true;
        true
    }

    /// Nothing of the request reached the failed primary connection: nothing was written to
    /// it since its last transaction ended (the write failed, or it had closed before), or
    /// its last words were an idle session timeout, which a server raises only while it
    /// waits for a request; and nothing of the server's reached the client. Shared servers
    /// only: a session's own cannot be replaced. Otherwise the server may have read the
    /// request, and committed it.
    fn ran_nowhere_on_primary(&self, e: &ServerError) -> bool {
        let idle_timeout = matches!(
            &e.kind,
            ServerErrorKind::Closed(Some(words)) if words.code == SqlState::IDLE_SESSION_TIMEOUT
        );
        let nothing_sent = self.lease.as_ref().is_some_and(|l| l.bytes_to_server == 0);
        self.mode_shares_servers()
            && (nothing_sent || idle_timeout)
            && self
                .routing
                .replay
                .as_ref()
                .is_some_and(|r| !r.heard && r.preliminaries == 0)
    }

    /// The replica refused the request as a standby must (an unlogged table, a write, a WAL
    /// function), or lacked an object it names, before any of its results reached the
    /// client: it runs on the primary, and its statements are remembered to run there from
    /// now on.
    pub(super) async fn retry_on_primary(&mut self) {
        self.fill = None;
        let Some(replay) = self.routing.replay.as_mut() else {
            return;
        };
        replay.refused = false;
        replay.attempts += 1;
        self.skip_preliminaries = replay.preliminaries;
        forget_defined(&mut self.statements, replay);
        let again = std::mem::take(&mut replay.bytes);
        // Remembered, also for an object the replica lacked: a prepared statement's later
        // executions must find it where it was prepared again.
        if let Some(router) = self.routing.lasting.setup.router.clone() {
            for sql in statement_texts(&again, self.max_message_bytes) {
                router.remember_primary(sql, self.routing.lasting.standard_conforming_strings);
            }
        }
        let mut again = BytesMut::from(&again[..]);
        again.extend_from_slice(&self.client_in);
        self.client_in = again;
        tracing::info!(client = self.shared.id, node = %self.node_name(), "a standby refused the request; it runs on the primary");
        self.detach(true).await;
        self.routing.retry_on_primary = true;
        self.routing.at_unit_start = true;
    }

    /// Tells the client why it is being disconnected, then leaves the server in a state the
    /// next client can use, or closes it.
    pub(super) async fn finish(&mut self, end: &Disconnect) {
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
        if self.app.nodes.is_fenced(&lease.node) {
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
    pub(super) async fn clean_up_server(&mut self) -> Result<(), ()> {
        if self.client_stream.is_some_and(|s| s.to_server) {
            // A message half passed to the server cannot be ended: anything written now
            // would be read as part of it.
            return Err(());
        }
        let lease = self.lease.as_mut().ok_or(())?;
        lease.conn.write_buf.clear();
        if self.queue.in_copy_in() {
            frontend::encode_copy_fail(&mut lease.conn.write_buf, b"client disconnected")
                .map_err(|_| ())?;
            self.queue.client_copy_finished();
        }
        if self.queue.has_client_requests() {
            // Something of the client's is still running: ask the server to stop it (pgherd's
            // own probes finish quickly and are waited for).
            let _ = self.app.clients.cancel(self.shared.key, CLEANUP_TIMEOUT);
        }
        if !self.queue.is_empty() {
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
        if self
            .routing
            .lasting
            .pinned
            .is_some_and(|p| p.forbids_reuse())
        {
            // A library stays loaded: no reset undoes it.
            return Err(());
        }
        // A shared server that held this client's own session state (it was pinned, or ran
        // something not probed yet) is reset completely before anyone else gets it.
        let unknown_state = self.mode_shares_servers()
            && (self.routing.lasting.pinned.is_some()
                || self.routing.lasting.effect == SessionEffect::Unknown);
        let lease = self.lease.as_mut().ok_or(())?;
        let reset = if unknown_state {
            "DISCARD ALL".to_owned()
        } else if self.mode == PoolMode::Session {
            lease.pool.settings().server_reset_query.clone()
        } else {
            String::new()
        };
        if !reset.is_empty() {
            frontend::encode_query(&mut lease.conn.write_buf, reset.as_bytes()).map_err(|_| ())?;
            self.queue.push_internal(Request::Query { sql: None });
            self.drain_internal().await?;
            let lease = self.lease.as_mut().ok_or(())?;
            lease.conn.params_fp = params::BASELINE;
            lease.conn.statements.clear();
            // DISCARD ALL clears sequences, but not the random seed.
            lease.conn.residue = params::Residue {
                sequences: false,
                seed: unknown_state || lease.conn.residue.seed,
            };
        }
        Ok(())
    }

    /// Sends what is queued for the server and reads until it owes nothing, with every
    /// response going nowhere: the client is gone.
    pub(super) async fn drain_internal(&mut self) -> Result<(), ()> {
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
}

/// The statement texts of the Query and Parse messages in `bytes`.
fn statement_texts(bytes: &[u8], max_message_bytes: usize) -> Vec<&[u8]> {
    let mut texts = Vec::new();
    let mut at = 0;
    while let Ok(Some(h)) = read_header(&bytes[at..], max_message_bytes) {
        let Some(body) = bytes.get(at + HEADER_BYTES..at + h.total_len()) else {
            break;
        };
        match h.tag {
            ftag::QUERY => texts.extend(frontend::Query::parse(body).ok().map(|q| q.sql)),
            ftag::PARSE => texts.extend(frontend::Parse::parse(body).ok().map(|p| p.query)),
            _ => {}
        }
        at += h.total_len();
    }
    texts
}

/// The named statements a request defined, forgotten before it is sent again (which defines
/// them anew).
fn forget_defined(statements: &mut Option<Box<ClientStatements>>, replay: &mut Replay) {
    for name in replay.defined.drain(..) {
        if let Some(statements) = statements.as_mut() {
            statements.close(&name);
        }
    }
}
