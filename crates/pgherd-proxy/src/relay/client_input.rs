//! Client → server: each client message framed and inspected, renamed where server
//! connections are shared (statements), routed (writes, pins, session effects), and queued
//! with what the server will answer.

use super::*;

impl Session {
    /// Turns buffered client messages into bytes for the server, queueing what each will be
    /// answered with.
    pub(super) fn process_client_input(&mut self) -> Result<(), Disconnect> {
        // Borrow the bytes out of `self` so messages can be handled as slices, uncopied.
        let mut input = std::mem::take(&mut self.client_in);
        let result = self.consume_client_messages(&mut input);
        self.client_in = input;
        buffers::shrink_if_grown(&mut self.client_in);
        result?;
        self.emit_ready_synthetics()
    }

    pub(super) fn consume_client_messages(
        &mut self,
        input: &mut BytesMut,
    ) -> Result<(), Disconnect> {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.statements.begin_batch();
        }
        loop {
            if self.client_stream.is_some() {
                if input.is_empty() {
                    return Ok(());
                }
                self.continue_stream(input)?;
                continue;
            }
            let Some(h) = read_header(input, self.max_message_bytes)? else {
                return Ok(());
            };
            if input.len() < h.total_len() {
                // COPY data streams through, and so does anything large; everything else is
                // inspected whole.
                // Data may come before the server's answer to its COPY: a server outside
                // copy mode ignores it, as it would direct.
                if h.tag == ftag::COPY_DATA
                    && self.lease.is_some()
                    && !self.queue.skipping_to_sync()
                {
                    self.client_stream = Some(client_stream::ClientStream {
                        remaining: h.total_len(),
                        to_server: true,
                        ends_unit: false,
                    });
                    if let Some(replay) = self.routing.replay.as_mut() {
                        replay.repeatable = false;
                    }
                    continue;
                }
                if client_stream::streams(&h, input.len()) {
                    if self.must_hold(&input[..]) {
                        self.routing.held = true;
                        return Ok(());
                    }
                    if std::mem::take(&mut self.routing.at_unit_start) {
                        self.tx_started.get_or_insert_with(Instant::now);
                    }
                    self.start_stream(&h, input)?;
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
                if replay.repeatable && self.client_tx == TxStatus::Idle {
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
    pub(super) fn must_hold(&mut self, input: &[u8]) -> bool {
        // Routing it again would only repeat the choice the lease was taken by.
        if std::mem::take(&mut self.routing.lease_for_front) {
            return false;
        }
        if !self.routing.at_unit_start
            || self.routing.lasting.pinned.is_some()
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
            && self.queue.has_lsn_probe()
            && !self.queue.has_client_requests()
        {
            RouteTarget::Replica
        } else {
            return false;
        };
        self.route_front(input).ok() == Some(wanted)
    }

    /// Notes what a statement the client sends means for routing: a `pgherd.route` setting,
    /// session state that pins the client to this server, a possible write (`executes`: it
    /// runs now, rather than being prepared).
    pub(super) fn track_statement(&mut self, routed: &Routed, executes: bool) {
        let decision = &routed.decision;
        if let Some(value) = &decision.route_setting {
            self.routing.lasting.session.override_route = Route::parse(value);
        }
        self.routing.unit_copies_in |= decision.copy_in;
        match decision.tx {
            TxEffect::Begin { .. } => self.routing.unit_begins = true,
            TxEffect::End => self.routing.unit_ends = true,
            TxEffect::DefaultReadOnly(Some(on)) => {
                self.routing.lasting.session.default_read_only = on
            }
            TxEffect::DefaultReadOnly(None)
            | TxEffect::SetReadOnly
            | TxEffect::SetReadWrite
            | TxEffect::None => {}
        }
        if let Some(pin) = decision.pin {
            if self.routing.lasting.pinned.is_none() && self.mode_shares_servers() {
                self.pin_to_server(pin);
            }
        }
        if executes {
            self.note_possible_write(decision.target == RouteTarget::Primary);
            self.note_session_effect(decision.session);
            // A schema change, or the rollback of a transaction that made one: statements
            // prepared before may name what is gone (a temporary object concerns this
            // client's own pinned server only).
            let schema_changes =
                decision.changes_catalog && decision.pin != Some(RoutePin::TempTable);
            if schema_changes || (decision.rolls_back && self.routing.lasting.catalog_changed) {
                self.app.schema_generation.fetch_add(1, Ordering::Relaxed);
            }
            self.routing.lasting.catalog_changed |= decision.changes_catalog;
            for name in &decision.custom_settings {
                self.remember_custom_setting(name);
            }
        }
    }

    /// `set_config($n, ...)`: the setting's name is the Bind's parameter `$n` (a text
    /// value's bytes in either format), for the session-state probe to ask about.
    fn note_bound_custom_settings(&mut self, params: &[u16], bind_rest: &[u8]) {
        let Ok(values) = frontend::BindValues::parse(bind_rest) else {
            return;
        };
        for &number in params {
            let value = usize::from(number)
                .checked_sub(1)
                .and_then(|i| values.values.get(i).copied().flatten());
            let Some(name) = value.and_then(|v| std::str::from_utf8(v).ok()) else {
                continue;
            };
            let name = name.to_ascii_lowercase();
            if pgherd_route::catalog::is_custom_setting(&name) {
                self.remember_custom_setting(&name);
            }
        }
    }

    /// A custom setting the session may have set, for the session-state probe to ask about.
    fn remember_custom_setting(&mut self, name: &str) {
        if self.custom_settings.len() < MAX_CUSTOM_SETTINGS
            && !self.custom_settings.iter().any(|known| known == name)
        {
            self.custom_settings.push(name.to_owned());
        }
    }

    /// A statement that may have left session state behind was sent: sequences are
    /// cleared before another client's transaction; anything else is probed for before the
    /// server goes back.
    pub(super) fn note_session_effect(&mut self, effect: SessionEffect) {
        self.routing.lasting.effect = self.routing.lasting.effect.max(effect);
        if effect == SessionEffect::Sequences {
            if let Some(lease) = self.lease.as_mut() {
                lease.conn.residue.sequences = true;
            }
        }
    }

    pub(super) fn note_possible_write(&mut self, writes: bool) {
        if writes && self.lease.as_ref().is_some_and(|l| !l.on_replica) {
            self.routing.write_seq += 1;
            let since_read = &mut self.routing.lasting.writes_since_replica_read;
            *since_read = since_read.saturating_add(1);
        }
    }

    /// The routing decision for a Query or Parse: the one made to choose the node if it is
    /// this statement's, otherwise a fresh one.
    pub(super) fn statement_decision(&mut self, sql: &[u8]) -> Option<Result<Routed, PgError>> {
        let router = self.routing.lasting.setup.router.clone()?;
        if let Some(front) = self.routing.front.take() {
            return Some(Ok(front));
        }
        Some(router.route(sql, self.routing.lasting.standard_conforming_strings))
    }

    /// A Query or Sync ended a request. After a write that may have committed, the primary is
    /// asked for its WAL position in the same round trip.
    pub(super) fn end_unit(&mut self) -> Result<(), Disconnect> {
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

    pub(super) fn write_needs_probe(&self) -> bool {
        let own_writes_followed = ((self.routing.read_your_writes()
            && self.routing.probes_writes())
            || self.routing.lasting.cache_active)
            && self.routing.write_unconfirmed();
        (own_writes_followed || self.routing.lasting.schema_change.is_some())
            && self.lease.as_ref().is_some_and(|l| !l.on_replica)
    }

    /// The transaction is over but where its writes end is still unknown: ask before the
    /// server goes back (rare: the probe usually rides along with the request). A schema
    /// change's end is asked for in any mode: every session's reads wait for it.
    pub(super) fn probe_before_release(&self) -> bool {
        self.write_needs_probe()
            && (self.mode_shares_servers() || self.routing.lasting.schema_change.is_some())
            && self.server_between_requests()
    }

    pub(super) fn push_lsn_probe(&mut self) -> Result<(), Disconnect> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        frontend::encode_query(&mut lease.conn.write_buf, LSN_PROBE_SQL)?;
        self.queue.push_internal(Request::Probe(Probe::Lsn {
            write_seq: self.routing.write_seq,
        }));
        Ok(())
    }

    /// The transaction is over and what it ran may have changed the server's session in
    /// ways pgherd did not follow: look before anyone else gets the server.
    pub(super) fn state_probe_due(&self) -> bool {
        self.routing.lasting.effect == SessionEffect::Unknown
            && self.mode_shares_servers()
            && self.routing.lasting.pinned.is_none()
            && self.server_between_requests()
    }

    pub(super) fn push_state_probe(&mut self) -> Result<(), Disconnect> {
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        let mut names = self.custom_settings.clone();
        if let Some(router) = &self.routing.lasting.setup.router {
            names.extend(router.catalog().custom_settings().iter().cloned());
        }
        names.sort();
        names.dedup();
        frontend::encode_query(&mut lease.conn.write_buf, probe::sql(&names).as_bytes())?;
        self.queue.push_internal(Request::Probe(Probe::State));
        self.routing.lasting.effect = SessionEffect::None;
        self.probe_rows = Some(Box::new(Ok(Vec::new())));
        Ok(())
    }

    /// The session-state probe answered: session objects pin the client to this server;
    /// otherwise its settings become the client's and the server is reset before its next
    /// transaction, whoever runs it. A probe that failed leaves the state unknown, which
    /// pins too.
    pub(super) fn on_state_probe_answered(&mut self) {
        let rows = self.probe_rows.take().map(|b| *b);
        let findings = match rows {
            Some(Ok(rows)) => Some(probe::read(&rows, self.shared.user())),
            _ => None,
        };
        match findings {
            Some(f) if f.objects == 0 => {
                self.params.adopt(f.as_changes());
                if let Some(lease) = self.lease.as_mut() {
                    lease.conn.params_fp = UNKNOWN;
                    lease.conn.residue.sequences = true;
                    lease.conn.residue.seed = true;
                }
            }
            _ if self.routing.lasting.pinned.is_none() => {
                self.pin_to_server(pgherd_route::Pin::FoundState)
            }
            _ => {}
        }
    }

    /// Session state ties the client to its server from now on; it holds that server between
    /// transactions, so it never parks.
    fn pin_to_server(&mut self, pin: pgherd_route::Pin) {
        tracing::info!(client = self.shared.id, node = %self.node_name(), reason = pin.describe(), "session pinned to its server connection");
        self.routing.lasting.pinned = Some(pin);
        self.shared.set_may_park(false);
    }

    pub(super) fn on_client_message(&mut self, tag: u8, message: &[u8]) -> Result<(), Disconnect> {
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

    pub(super) fn relay_client_message(
        &mut self,
        tag: u8,
        message: &[u8],
        body: &[u8],
    ) -> Result<(), Disconnect> {
        let rewrite = self.mode_shares_servers();
        let mut text_routed = None;
        // Read once: routing and forwarding both need them.
        let query = (tag == ftag::QUERY)
            .then(|| frontend::Query::parse(body))
            .transpose()?;
        let parse = (tag == ftag::PARSE)
            .then(|| frontend::Parse::parse(body))
            .transpose()?;
        let bind = (tag == ftag::BIND)
            .then(|| frontend::Bind::parse(body))
            .transpose()?;
        // A Bind's named statement, for routing it and for sending it.
        let bound = match &bind {
            Some(b) if !b.statement.is_empty() => {
                self.statements.as_ref().and_then(|s| s.find(b.statement))
            }
            _ => None,
        };
        let statement_sql = match (&query, &parse) {
            (Some(q), _) => Some(q.sql),
            (_, Some(p)) => Some(p.query),
            _ => None,
        };
        if let Some(sql) = statement_sql {
            match self.statement_decision(sql) {
                Some(Err(e)) => {
                    // pgherd's error in the request's place. A simple query still gets its
                    // ReadyForQuery: a Sync takes the query's place on the server.
                    self.queue.push_synthetic(Synthetic::Error(Box::new(e)));
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
                    if tag == ftag::QUERY {
                        self.note_written_tables(sql, &routed);
                        self.consider_fill(sql, &routed, None);
                    } else {
                        self.consider_candidate_fill(message, &routed);
                    }
                    text_routed = Some(routed);
                }
                None => {}
            }
        }
        match tag {
            ftag::BIND if self.routing.lasting.setup.router.is_some() => {
                let Some(b) = &bind else { return Ok(()) };
                let routed = match &bound {
                    Some(def) => self.routed_of(def),
                    None => self.statement_routed(b.statement),
                };
                match routed {
                    Some(routed) => {
                        self.track_statement(&routed, true);
                        if !routed.decision.custom_setting_params.is_empty() {
                            self.note_bound_custom_settings(
                                &routed.decision.custom_setting_params,
                                b.rest,
                            );
                        }
                        self.consider_candidate_fill(message, &routed);
                        if self.writes_matter_to_cache(&routed) {
                            if let Some(def) = &bound {
                                self.note_written_tables(&def.query, &routed);
                            }
                        }
                    }
                    None => {
                        self.note_possible_write(true);
                        self.note_session_effect(SessionEffect::Unknown);
                    }
                }
            }
            ftag::FUNCTION_CALL => {
                self.note_possible_write(true);
                self.note_session_effect(SessionEffect::Unknown);
            }
            _ => {}
        }
        let Some(lease) = self.lease.as_mut() else {
            return Ok(());
        };
        match tag {
            ftag::QUERY => {
                let Some(q) = query else {
                    return Ok(());
                };
                if rewrite && self.translate_statement_reference(q.sql)? {
                    return Ok(());
                }
                let Some(lease) = self.lease.as_mut() else {
                    return Ok(());
                };
                let sql =
                    may_set(q.sql, text_routed.as_ref()).then(|| Bytes::copy_from_slice(q.sql));
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Query { sql });
                lease.pool.stats.queries.add(1);
            }
            ftag::FUNCTION_CALL => {
                lease.conn.write_buf.extend_from_slice(message);
                self.queue.push_client(Request::Query { sql: None });
            }
            ftag::PARSE => {
                let Some(p) = parse else {
                    return Ok(());
                };
                if p.name.is_empty() || !rewrite {
                    if p.name.is_empty() {
                        let unnamed = self.unnamed.get_or_insert_with(Default::default);
                        unnamed.query.clear();
                        unnamed.query.extend_from_slice(p.query);
                        unnamed.param_types.clear();
                        unnamed.param_types.extend_from_slice(p.param_types);
                        unnamed.present = true;
                        unnamed.routed = text_routed;
                        lease.unnamed_here = true;
                    }
                    lease.conn.write_buf.extend_from_slice(message);
                    self.queue.push_client(Request::Parse { cached: None });
                } else {
                    let def = StatementDef::new(
                        p.query,
                        p.param_types,
                        self.params.current("search_path"),
                    );
                    if let (Some(routed), Some(router)) =
                        (text_routed, self.routing.lasting.setup.router.as_ref())
                    {
                        *def.routed.lock() = Some((router.generation(), routed));
                    }
                    if let Err(e) = self
                        .statements
                        .get_or_insert_with(Default::default)
                        .define(p.name, def.clone())
                    {
                        self.queue
                            .push_synthetic(Synthetic::Error(Box::new(statement_error(e))));
                        return Ok(());
                    }
                    if let Some(replay) = self.routing.replay.as_mut() {
                        replay.defined.push(p.name.into());
                    }
                    let generation = self.app.schema_generation.load(Ordering::Relaxed);
                    if make_room(lease, &mut self.queue, &def, generation)? {
                        self.queue.push_synthetic(Synthetic::ParseComplete);
                    } else {
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
                let Some(b) = bind else { return Ok(()) };
                if b.statement.is_empty()
                    || !rewrite
                    || prepared_by_sql(
                        self.routing.lasting.pinned.is_some(),
                        &self.statements,
                        b.statement,
                    )
                {
                    if b.statement.is_empty() {
                        self.ensure_unnamed_here()?;
                        if b.portal.is_empty() {
                            self.portal_sql = self
                                .unnamed
                                .as_ref()
                                .filter(|u| u.may_change_session())
                                .map(|u| u.query.clone().into_boxed_slice());
                        }
                    }
                    let Some(lease) = self.lease.as_mut() else {
                        return Ok(());
                    };
                    lease.conn.write_buf.extend_from_slice(message);
                } else {
                    let Some(def) = bound else {
                        // PostgreSQL's error in its place.
                        statement_or_error(&self.statements, &mut self.queue, b.statement);
                        return Ok(());
                    };
                    let generation = self.app.schema_generation.load(Ordering::Relaxed);
                    ensure_prepared(lease, &mut self.queue, &def, generation)?;
                    frontend::encode_bind(
                        &mut lease.conn.write_buf,
                        b.portal,
                        &def.server_name,
                        b.rest,
                    )?;
                    if b.portal.is_empty() {
                        self.portal_sql = def
                            .may_change_session
                            .then(|| def.query.clone().into_boxed_slice());
                    }
                }
                self.queue.push_client(Request::Bind);
            }
            ftag::DESCRIBE => {
                let d = frontend::Describe::parse(body)?;
                let by_sql = prepared_by_sql(
                    self.routing.lasting.pinned.is_some(),
                    &self.statements,
                    d.name,
                );
                match (d.target, d.name.is_empty(), rewrite && !by_sql) {
                    (Target::Statement, false, true) => {
                        let generation = self.app.schema_generation.load(Ordering::Relaxed);
                        let Some(def) = prepared_on_server(
                            lease,
                            &self.statements,
                            &mut self.queue,
                            generation,
                            d.name,
                        )?
                        else {
                            return Ok(());
                        };
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
                lease.pool.stats.queries.add(1);
            }
            ftag::CLOSE => {
                let c = frontend::Close::parse(body)?;
                if c.target == Target::Statement
                    && !c.name.is_empty()
                    && rewrite
                    && !prepared_by_sql(
                        self.routing.lasting.pinned.is_some(),
                        &self.statements,
                        c.name,
                    )
                {
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
                // Passed on even before the server answered the COPY (drivers send the
                // statement and its data at once); a server not in copy mode ignores them.
                lease.conn.write_buf.extend_from_slice(message);
                if tag != ftag::COPY_DATA {
                    self.queue.client_copy_finished();
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
    pub(super) fn ensure_unnamed_here(&mut self) -> Result<(), Disconnect> {
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

    pub(super) fn emit_ready_synthetics(&mut self) -> Result<(), Disconnect> {
        let mut due = Vec::new();
        self.queue.take_ready_synthetics(&mut due);
        self.write_synthetics(&due)
    }

    /// `DEALLOCATE name` and `EXECUTE name(...)` in SQL, naming a statement the client
    /// prepared through the protocol, as PostgreSQL takes them on a connection of the client's
    /// own: the statement is forgotten (answered by pgherd, nothing to ask a server), or run
    /// under its name on the server. True if the query was handled so.
    fn translate_statement_reference(&mut self, sql: &[u8]) -> Result<bool, Disconnect> {
        let Some((kind, name, range)) = statements::sql_statement_reference(sql) else {
            return Ok(false);
        };
        let Ok(def) = statement(&self.statements, &name) else {
            // An SQL-level statement of a pinned session, or the server's error to give.
            return Ok(false);
        };
        match kind {
            statements::SqlUse::Deallocate if self.client_tx == TxStatus::Failed => Ok(false),
            statements::SqlUse::Deallocate => {
                if let Some(statements) = self.statements.as_mut() {
                    statements.close(&name);
                }
                self.queue.push_synthetic(Synthetic::Answered("DEALLOCATE"));
                Ok(true)
            }
            statements::SqlUse::Execute => {
                let generation = self.app.schema_generation.load(Ordering::Relaxed);
                let Some(lease) = self.lease.as_mut() else {
                    return Ok(false);
                };
                ensure_prepared(lease, &mut self.queue, &def, generation)?;
                let mut text = Vec::with_capacity(sql.len() + def.server_name.len());
                text.extend_from_slice(&sql[..range.start]);
                text.extend_from_slice(&def.server_name);
                text.extend_from_slice(&sql[range.end..]);
                frontend::encode_query(&mut lease.conn.write_buf, &text)?;
                self.queue.push_client(Request::Query { sql: None });
                lease.pool.stats.queries.add(1);
                Ok(true)
            }
        }
    }

    pub(super) fn write_synthetics(&mut self, due: &[Synthetic]) -> Result<(), Disconnect> {
        for s in due {
            match s {
                Synthetic::ParseComplete => {
                    backend::encode_empty(&mut self.client_out, btag::PARSE_COMPLETE)
                }
                Synthetic::CloseComplete => {
                    backend::encode_empty(&mut self.client_out, btag::CLOSE_COMPLETE)
                }
                Synthetic::Answered(tag) => {
                    backend::encode_command_complete(&mut self.client_out, tag)?;
                    backend::encode_ready_for_query(&mut self.client_out, self.client_tx);
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
}

/// A named statement the client's map does not hold, in a session `pinned` to its server: one
/// its SQL `PREPARE` made there, which protocol messages use under its own name.
fn prepared_by_sql(pinned: bool, statements: &Option<Box<ClientStatements>>, name: &[u8]) -> bool {
    pinned && !name.is_empty() && statement(statements, name).is_err()
}

/// The client's statement `name`, or the error PostgreSQL would give.
pub(super) fn statement(
    statements: &Option<Box<ClientStatements>>,
    name: &[u8],
) -> Result<Arc<StatementDef>, StatementError> {
    match statements {
        Some(s) => s.get(name),
        None => Err(StatementError::DoesNotExist(
            String::from_utf8_lossy(name).into_owned(),
        )),
    }
}

/// The client's statement `name`; without one, the error PostgreSQL gives is queued in the
/// place of its answer.
pub(super) fn statement_or_error(
    statements: &Option<Box<ClientStatements>>,
    queue: &mut ResponseQueue,
    name: &[u8],
) -> Option<Arc<StatementDef>> {
    match statement(statements, name) {
        Ok(def) => Some(def),
        Err(e) => {
            queue.push_synthetic(Synthetic::Error(Box::new(statement_error(e))));
            None
        }
    }
}

pub(super) fn statement_error(e: StatementError) -> PgError {
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

/// Readies the server's statement cache for `def` at schema `generation`: true if the server
/// holds a usable copy (nothing to send); otherwise a stale copy is closed, or the least
/// recently used statement when the cache is full, and the caller sends the Parse.
fn make_room(
    lease: &mut Lease,
    queue: &mut ResponseQueue,
    def: &StatementDef,
    generation: u64,
) -> Result<bool, WireError> {
    let close = |lease: &mut Lease, queue: &mut ResponseQueue, name: &[u8]| {
        frontend::encode_close(&mut lease.conn.write_buf, Target::Statement, name)?;
        queue.push_internal(Request::Close);
        Ok::<(), WireError>(())
    };
    match lease.conn.statements.touch(&def.hash, generation) {
        Holding::Fresh => return Ok(true),
        Holding::Stale => close(lease, queue, &def.server_name)?,
        Holding::Missing => {}
    }
    if let Some(victim) = lease.conn.statements.insert(def.hash, generation) {
        close(lease, queue, &victim.server_name())?;
    }
    Ok(false)
}

/// Prepares `def` on the server first unless it holds a usable copy.
/// The client's statement `name`, prepared on the leased server (queued ahead of what uses
/// it); `None` when the client has no such statement, PostgreSQL's error queued instead.
pub(super) fn prepared_on_server(
    lease: &mut Lease,
    statements: &Option<Box<ClientStatements>>,
    queue: &mut ResponseQueue,
    generation: u64,
    name: &[u8],
) -> Result<Option<Arc<StatementDef>>, WireError> {
    let Some(def) = statement_or_error(statements, queue, name) else {
        return Ok(None);
    };
    ensure_prepared(lease, queue, &def, generation)?;
    Ok(Some(def))
}

pub(super) fn ensure_prepared(
    lease: &mut Lease,
    queue: &mut ResponseQueue,
    def: &StatementDef,
    generation: u64,
) -> Result<(), WireError> {
    if make_room(lease, queue, def, generation)? {
        return Ok(());
    }
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
