//! Server → client: each server message matched against what the server owes, dropped when
//! it answers pgherd, forwarded otherwise (rows and large messages streamed, never held
//! whole), with what pgherd learns on the way (settings, transaction state, probe answers).

use super::*;

/// Server messages larger than this are not held whole: pgherd reads what it needs from their
/// first bytes and streams the rest to the client (or drops it).
pub(super) const STREAM_MESSAGE_BYTES: usize = 256 << 10;
/// How much of a large error or notice pgherd waits for before streaming it: its severity and
/// code come first.
const ERROR_PREFIX_BYTES: usize = 4 << 10;

/// Answers that acknowledge a message rather than carry a result.
fn acknowledges(tag: u8) -> bool {
    matches!(
        tag,
        btag::PARSE_COMPLETE
            | btag::BIND_COMPLETE
            | btag::CLOSE_COMPLETE
            | btag::PARAMETER_DESCRIPTION
            | btag::ROW_DESCRIPTION
            | btag::NO_DATA
    )
}

/// What a hot standby answers a request it cannot run: a write (25006, read-only
/// transaction), an unlogged or temporary table, a WAL control function.
fn refused_as_standby(err: &PgError) -> bool {
    err.code == SqlState::READ_ONLY_SQL_TRANSACTION
        || err.message.contains("during recovery")
        || err.message == "recovery is in progress"
}

/// What a replica that has not replayed an object's creation yet answers a request naming
/// it: the primary has the authoritative answer (the same error, if it lacks it too).
fn missing_on_replica(err: &PgError) -> bool {
    [
        SqlState::UNDEFINED_TABLE,
        SqlState::UNDEFINED_FUNCTION,
        SqlState::UNDEFINED_OBJECT,
        SqlState::INVALID_SCHEMA_NAME,
    ]
    .contains(&err.code)
}

/// A replica's refusal the primary may answer otherwise: it refused as a standby, or lacks
/// what the request names.
pub(crate) fn primary_may_answer(err: &PgError) -> bool {
    refused_as_standby(err) || missing_on_replica(err)
}

/// A command tag of a statement that changes the catalog. `CREATE TABLE AS` and
/// `SELECT INTO` answer `SELECT n` and are not told apart from reads by their tag.
fn changes_the_schema(tag: &[u8]) -> bool {
    let word = tag.split(|&b| b == b' ').next().unwrap_or_default();
    matches!(
        word,
        b"CREATE"
            | b"ALTER"
            | b"DROP"
            | b"COMMENT"
            | b"GRANT"
            | b"REVOKE"
            | b"SECURITY"
            | b"IMPORT"
    )
}

/// The server's words for a prepared statement whose plan names what no longer exists, or
/// whose result changed shape: preparing it again mends it.
fn names_a_stale_plan(err: &PgError) -> bool {
    (err.code == SqlState::INTERNAL_ERROR && err.message.starts_with("cache lookup failed for"))
        || (err.code == SqlState::FEATURE_NOT_SUPPORTED
            && err.message == "cached plan must not change result type")
}

impl Session {
    pub(super) fn process_server_input(&mut self) -> Result<(), Relayed> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let mut input = std::mem::take(&mut lease.conn.read_buf);
        let result = self.consume_server_messages(&mut input);
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.read_buf = input;
            // A buffer a large message grew is let go once emptied.
            buffers::shrink_if_grown(&mut lease.conn.read_buf);
        }
        result
    }

    pub(super) fn consume_server_messages(&mut self, input: &mut BytesMut) -> Result<(), Relayed> {
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
                if self.server_passthrough.is_none() && !self.after_stream.is_empty() {
                    let due = std::mem::take(&mut self.after_stream);
                    self.write_synthetics(&due)?;
                }
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
            if matches!(h.tag, btag::DATA_ROW | btag::ROW_DESCRIPTION)
                && self.forward_passing_results(h, input)
            {
                continue;
            }
            let whole = input.len() >= h.total_len();
            if !whole && !self.may_stream(h.tag, h.total_len(), input.len()) {
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
            if !before.is_empty() {
                self.write_synthetics(&before)?;
            }
            if !whole {
                // Rows, COPY data and anything large stream through, never held whole.
                let mut to_client = d.to_client;
                if matches!(h.tag, btag::ERROR_RESPONSE | btag::NOTICE_RESPONSE) {
                    let seen = PgError::parse_prefix(&input[HEADER_BYTES..]);
                    to_client &= self.on_error_or_notice(h.tag, seen, &d)?;
                }
                if d.probe.is_some() {
                    // pgherd's probes answer in a few bytes; this one cannot be read.
                    self.routing.probe_lsn = None;
                    self.probe_rows = Some(Box::new(Err(())));
                }
                if let Some(lease) = self.lease.as_mut() {
                    for hash in &d.uncached {
                        lease.conn.statements.forget(hash);
                    }
                }
                let n = input.len();
                if to_client {
                    self.spoil_fill();
                    self.client_out.extend_from_slice(input);
                    if !matches!(h.tag, btag::NOTICE_RESPONSE | btag::NOTIFICATION_RESPONSE) {
                        self.note_answered();
                    }
                }
                input.advance(n);
                self.server_passthrough = Some((to_client, h.total_len() - n));
                // What pgherd answers after this message waits until it has passed whole.
                self.after_stream.append(&mut after);
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
                    let refused = self.routing.replay.as_ref().is_some_and(|r| r.refused);
                    if d.client_ready && !refused {
                        self.on_client_ready(status)?;
                    }
                    match d.probe {
                        Some(Probe::Lsn { write_seq }) => self.on_probe_answered(write_seq, status),
                        Some(Probe::State) => self.on_state_probe_answered(),
                        None => {}
                    }
                }
                btag::NOTICE_RESPONSE | btag::ERROR_RESPONSE => {
                    if let Ok(err) = PgError::parse(body) {
                        forward &= self.on_error_or_notice(h.tag, err, &d)?;
                    } else if h.tag == btag::ERROR_RESPONSE && d.to_client {
                        self.tx_failed = true;
                    }
                }
                btag::DATA_ROW if d.probe == Some(Probe::State) => {
                    let text =
                        |v: Option<&[u8]>| v.map(|b| String::from_utf8_lossy(b).into_owned());
                    let row =
                        backend::parse_data_row(body)
                            .ok()
                            .and_then(|values| match values[..] {
                                [Some(kind), name, value] => Some((
                                    String::from_utf8_lossy(kind).into_owned(),
                                    text(name),
                                    text(value),
                                )),
                                _ => None,
                            });
                    if let (Some(row), Some(rows)) = (row, self.probe_rows.as_mut()) {
                        if let Ok(rows) = rows.as_mut() {
                            rows.push(row);
                        }
                    }
                }
                btag::DATA_ROW if d.probe.is_some() => {
                    self.routing.probe_lsn = backend::parse_data_row(body)
                        .ok()
                        .and_then(|values| values.into_iter().next().flatten())
                        .and_then(|v| std::str::from_utf8(v).ok())
                        .and_then(parse_lsn);
                }
                btag::PARAMETER_STATUS => {
                    if let Ok(p) = backend::ParameterStatus::parse(body) {
                        // What the server session now has, whoever's statement changed it
                        // (pgherd's own restore of the client's settings included).
                        let flag = params::parse_bool(p.value);
                        match (p.name, flag) {
                            ("default_transaction_read_only", Some(on)) => {
                                self.routing.lasting.session.default_read_only = on
                            }
                            ("standard_conforming_strings", Some(on)) => {
                                self.routing.lasting.standard_conforming_strings = on
                            }
                            _ => {}
                        }
                        if d.to_client || d.restores {
                            self.params.record_reported(p.name, p.value);
                        }
                    }
                    // A restored startup value is the client's again, as a RESET on a server
                    // of its own would have left it.
                    forward |= d.restores;
                }
                btag::COMMAND_COMPLETE if d.to_client => {
                    let tag = backend::parse_command_complete(body).unwrap_or_default();
                    self.on_command_complete(tag, d.sql.as_ref());
                }
                _ => {}
            }
            let asynchronous = matches!(
                h.tag,
                btag::NOTICE_RESPONSE | btag::NOTIFICATION_RESPONSE | btag::PARAMETER_STATUS
            );
            if forward && d.to_client && !asynchronous {
                forward = self.answer_still_owed(h.tag);
            }
            if forward {
                if self.fill.is_some() {
                    self.fill_message(h.tag, message);
                }
                let at = self.client_out.len();
                self.client_out.extend_from_slice(message);
                if h.tag == btag::NOTIFICATION_RESPONSE {
                    self.notifications_from_itself(at);
                }
                if !asynchronous {
                    self.note_answer(h.tag);
                } else if let Some(replay) = self.routing.replay.as_mut() {
                    replay.heard = true;
                }
            }
            input.advance(h.total_len());
            if !after.is_empty() {
                self.write_synthetics(&after)?;
            }
            if let Some(replay) = self.routing.replay.as_mut() {
                if !replay.bytes.is_empty() && !replay.refused && !self.queue.has_client_requests()
                {
                    // Everything sent was answered: nothing to repeat elsewhere any more.
                    replay.restart();
                    replay.attempts = 0;
                }
            }
        }
    }

    /// Forwards the whole rows (and a simple query's row description) at the front of `input`
    /// that answer the client's own request, in one copy. They need what the general path
    /// below would do for each and nothing else: the queue stays as it is, a row counts as
    /// an answer, a row description as an acknowledgement, and a result being kept for the
    /// cache keeps them. A large result is mostly rows, and this spares each the
    /// classification every other message gets. Anything else (a message not yet whole or
    /// over the limit, an acknowledgement to drop after a replay, a refused request's rest)
    /// is left to the general path. `first` is the header at the front of `input`. True if
    /// it forwarded any.
    fn forward_passing_results(
        &mut self,
        first: pgherd_wire::frame::Header,
        input: &mut BytesMut,
    ) -> bool {
        let passing = self.queue.front_passes();
        if passing == queue::PassingResults::None
            || self.lease.is_none()
            || self.routing.replay.as_ref().is_some_and(|r| r.refused)
        {
            return false;
        }
        let (mut end, mut messages, mut h) = (0, 0, first);
        loop {
            let message_end = end + h.total_len();
            // An acknowledgement a replay already gave the client is the general path's to drop.
            if !passing.includes(h.tag)
                || message_end > input.len()
                || (acknowledges(h.tag) && self.skip_preliminaries > 0)
            {
                break;
            }
            self.note_answer(h.tag);
            if self.fill.is_some() {
                self.fill_message(h.tag, &input[end..message_end]);
            }
            end = message_end;
            messages += 1;
            match read_header(&input[end..], MAX_SERVER_MESSAGE_BYTES) {
                Ok(Some(next)) => h = next,
                _ => break,
            }
        }
        if end > 0 {
            tracing::trace!(
                client = self.shared.id,
                messages,
                bytes = end,
                "server rows"
            );
            self.client_out.extend_from_slice(&input[..end]);
            input.advance(end);
        }
        end > 0
    }

    /// Whether a message not yet whole may start streaming now: rows, COPY data and anything
    /// larger than [`STREAM_MESSAGE_BYTES`] (an error or notice once its first bytes are in),
    /// but never a ReadyForQuery, nor a probe's rows of ordinary size.
    fn may_stream(&self, tag: u8, total: usize, available: usize) -> bool {
        let large = total > STREAM_MESSAGE_BYTES;
        match tag {
            btag::READY_FOR_QUERY => false,
            btag::ERROR_RESPONSE | btag::NOTICE_RESPONSE => {
                large && available >= ERROR_PREFIX_BYTES
            }
            btag::DATA_ROW | btag::COPY_DATA => large || !self.queue.front_is_probe(),
            _ => large,
        }
    }

    /// What an error or notice means to pgherd; false if the client must not see it. A
    /// server's warning that it is shutting down concerns pgherd, which moves the client on;
    /// a FATAL error is reported when the server's close is seen; an error answering pgherd's
    /// own statement becomes a warning.
    fn on_error_or_notice(
        &mut self,
        tag: u8,
        err: PgError,
        d: &queue::Disposition,
    ) -> Result<bool, Disconnect> {
        if tag == btag::NOTICE_RESPONSE {
            return Ok(err.code != SqlState::ADMIN_SHUTDOWN);
        }
        let fatal = matches!(
            err.severity,
            pgherd_wire::Severity::Fatal | pgherd_wire::Severity::Panic
        );
        if d.unsolicited && !fatal {
            tracing::warn!(client = self.shared.id, error = %err, "a server sent an error no request asked for; dropped");
            return Ok(false);
        }
        if d.to_client && self.may_retry_on_primary(&err) {
            tracing::debug!(client = self.shared.id, error = %err, "a standby refused the request");
            if let Some(replay) = self.routing.replay.as_mut() {
                replay.refused = true;
            }
            // Nothing more of the client's goes to this replica: the refused request runs
            // first, elsewhere.
            self.routing.held = true;
            return Ok(false);
        }
        if d.to_client {
            self.tx_failed = true;
            if let Some(lease) = self.lease.as_mut() {
                lease.pool.stats.server_errors.count(&err.code);
                if names_a_stale_plan(&err) {
                    // A schema change pgherd did not see: no statement any server holds is to
                    // be trusted, so every server prepares again what it uses next.
                    self.app.schema_generation.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if fatal {
            // The server is about to close; say so when the close is seen.
            self.server_last_words = Some(Box::new(err));
            return Ok(false);
        }
        if d.probe == Some(Probe::State) {
            tracing::warn!(client = self.shared.id, error = %err, "the session-state probe failed; the client keeps its server connection");
            self.probe_rows = Some(Box::new(Err(())));
        } else if d.internal_error && d.probe.is_none() {
            tracing::warn!(client = self.shared.id, error = %err, "pgherd's own statement failed on the server");
            let notice = PgError::new(
                pgherd_wire::Severity::Warning,
                err.code,
                format!("pgherd could not restore session settings: {}", err.message),
            );
            notice.encode_notice(&mut self.client_out)?;
        }
        Ok(true)
    }

    /// A replica refused the request as a standby, or lacks what it names, and nothing of its
    /// results reached the client yet: it can run on the primary instead.
    fn may_retry_on_primary(&self, err: &PgError) -> bool {
        let on_replica = self.lease.as_ref().is_some_and(|l| l.on_replica);
        let Some(replay) = self.routing.replay.as_ref() else {
            return false;
        };
        on_replica
            && !self.routing.replica_asked
            && primary_may_answer(err)
            && self.client_tx == TxStatus::Idle
            && replay.repeatable
            && !replay.answered
            && !replay.refused
            && !replay.bytes.is_empty()
            && replay.attempts < MAX_REPLAYS
            && self.client_stream.is_none()
    }

    /// A notification the session's own server sent (NOTIFY in the same session) carries the
    /// process id the client knows, where servers are shared (pgherd's own): drivers tell
    /// their own notifications by it. `at` is where the message starts in `client_out`.
    fn notifications_from_itself(&mut self, at: usize) {
        let Some(lease) = self.lease.as_ref() else {
            return;
        };
        let server_pid = lease.conn.cancel_key.process_id;
        let own_pid = self.shared.key.process_id;
        let Some(pid) = self
            .client_out
            .get_mut(at + HEADER_BYTES..at + HEADER_BYTES + 4)
        else {
            return;
        };
        if server_pid != own_pid && *pid == server_pid.to_be_bytes() {
            pid.copy_from_slice(&own_pid.to_be_bytes());
        }
    }

    pub(super) fn note_answered(&mut self) {
        self.skip_preliminaries = 0;
        if let Some(replay) = self.routing.replay.as_mut() {
            replay.answered = true;
        }
    }

    /// An answer went to the client: an acknowledgement is counted (a replay elsewhere drops
    /// as many), anything else is a result.
    fn note_answer(&mut self, tag: u8) {
        if acknowledges(tag) {
            if let Some(replay) = self.routing.replay.as_mut() {
                replay.preliminaries += 1;
            }
        } else {
            self.note_answered();
        }
    }

    /// False for an answer the client must not get: the rest of a request a standby refused
    /// (it runs again on the primary), or an acknowledgement the client already got before
    /// the request moved.
    fn answer_still_owed(&mut self, tag: u8) -> bool {
        if self.routing.replay.as_ref().is_some_and(|r| r.refused) {
            return false;
        }
        if self.skip_preliminaries > 0 && acknowledges(tag) {
            self.skip_preliminaries -= 1;
            return false;
        }
        true
    }

    /// The primary said where the session's writes end (or could not: then reads stay on the
    /// primary until a later probe succeeds).
    pub(super) fn on_probe_answered(&mut self, write_seq: u64, status: TxStatus) {
        let lsn = self.routing.probe_lsn.take();
        if status != TxStatus::Idle {
            // Asked inside a transaction that is still open: its commit comes later.
            return;
        }
        if let Some(change) = self.routing.lasting.schema_change.take() {
            change.ended(lsn.map(insert_lsn_as_end));
        }
        self.routing.probed_seq = self.routing.probed_seq.max(write_seq);
        self.routing.lasting.min_lsn = match lsn {
            Some(lsn) if self.routing.lasting.min_lsn == Lsn::MAX => insert_lsn_as_end(lsn),
            Some(lsn) => self.routing.lasting.min_lsn.max(insert_lsn_as_end(lsn)),
            None => Lsn::MAX,
        };
    }

    pub(super) fn node_name(&self) -> String {
        self.lease
            .as_ref()
            .map_or_else(String::new, |l| l.conn.node.clone())
    }

    pub(super) fn on_command_complete(&mut self, tag: &[u8], sql: Option<&Bytes>) {
        if tag == b"DISCARD ALL" || tag == b"DEALLOCATE ALL" {
            self.forget_server_statements();
        }
        if self.routing.lasting.setup.router.is_none() && changes_the_schema(tag) {
            // Without a router (session mode) no statement was classified: its tag says it
            // changed the schema. Statements prepared elsewhere are prepared again, and the
            // change is waited for as one a router saw.
            self.routing.lasting.catalog_changed = true;
            self.app.schema_generation.fetch_add(1, Ordering::Relaxed);
        }
        self.follow_settings(tag, sql);
    }

    /// After `DISCARD ALL` or `DEALLOCATE ALL` the server holds no prepared statement, and
    /// neither does the client's session: its protocol-level statements are gone too, as they
    /// would be on a server of its own.
    pub(super) fn forget_server_statements(&mut self) {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.statements.clear();
            lease.unnamed_here = false;
        }
        if let Some(statements) = self.statements.as_mut() {
            statements.clear();
        }
        if let Some(unnamed) = self.unnamed.as_mut() {
            unnamed.present = false;
        }
    }

    pub(super) fn on_client_ready(&mut self, status: TxStatus) -> Result<(), Relayed> {
        self.finish_fill(status);
        self.client_tx = status;
        self.settings_request_done(status);
        if status == TxStatus::Idle {
            self.drop_written_tables();
        }
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        if status == TxStatus::Idle {
            if std::mem::take(&mut self.routing.lasting.catalog_changed) {
                if self.routing.lasting.schema_change.is_none() {
                    // Before the client learns the change is done (its ReadyForQuery goes out
                    // after this), so that no one reads a replica between the commit and the
                    // LSN probe's answer.
                    self.routing.lasting.schema_change = Some(self.app.schema_changes.ending());
                }
                if let Some(router) = &self.routing.lasting.setup.router {
                    router.catalog_changed();
                }
                if let Some(cache) = self.routing.lasting.setup.cache.as_ref() {
                    // No answer kept so far is trusted (the WAL announces the change too,
                    // through pgherd's event trigger, a little later).
                    cache.db.state.lock().store.drop_all();
                }
            }
            self.params.end_transaction(!self.tx_failed);
            self.tx_failed = false;
            lease.pool.stats.transactions.add(1);
            lease.flush_byte_counts();
            // One reading for the histogram and for the pool's give-back that follows.
            let ended = tokio::time::Instant::now();
            self.tx_ended = Some(ended);
            if let Some(started) = self.tx_started.take() {
                let took = ended.into_std().saturating_duration_since(started);
                lease.pool.stats.transaction_time.observe(took);
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
            return Err(Relayed::Client(Disconnect::refused(PgError::fatal(
                SqlState::FEATURE_NOT_SUPPORTED,
                "transaction blocks are not allowed in statement pooling mode",
            ))));
        }
        Ok(())
    }
}
