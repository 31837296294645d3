//! Client messages too large to hold whole (a 100 MB query, a Bind carrying a large value,
//! COPY data): pgherd reads what it needs from their first bytes and passes the rest to the
//! server as it arrives, or drops it, so one client never makes pgherd hold more than a
//! message's head plus the high-water marks.

use pgherd_wire::frame::Header as MessageHeader;

use super::client_input::{ensure_prepared, statement_or_error};
use super::*;

/// Client messages larger than this are streamed rather than held whole.
pub(super) const STREAM_MESSAGE_BYTES: usize = 256 << 10;
/// What pgherd waits for of a large message before streaming it: enough for a Bind's or
/// Parse's names.
pub(super) const STREAM_PREFIX_BYTES: usize = 8 << 10;

/// A client message passing through in pieces.
#[derive(Debug, Clone, Copy)]
pub(super) struct ClientStream {
    /// Bytes still to come.
    pub remaining: usize,
    /// False: the bytes are dropped (a message pgherd refused, or skipped as the protocol
    /// says after an error).
    pub to_server: bool,
    /// It is a simple query: its request ends when its last byte has passed.
    pub ends_unit: bool,
}

/// True when the message starting at the front of `input`, not whole yet, is large enough
/// to stream and its head has arrived.
pub(super) fn streams(h: &MessageHeader, buffered: usize) -> bool {
    h.total_len() > STREAM_MESSAGE_BYTES && buffered >= STREAM_PREFIX_BYTES
}

impl Session {
    /// Passes on (or drops) what arrived of the message being streamed; false when there is
    /// none.
    pub(super) fn continue_stream(&mut self, input: &mut BytesMut) -> Result<bool, Disconnect> {
        let Some(stream) = self.client_stream.as_mut() else {
            return Ok(false);
        };
        let n = stream.remaining.min(input.len());
        if stream.to_server {
            if let Some(lease) = self.lease.as_mut() {
                lease.conn.write_buf.extend_from_slice(&input[..n]);
            }
        }
        input.advance(n);
        stream.remaining -= n;
        if stream.remaining == 0 {
            let ends_unit = stream.ends_unit;
            self.client_stream = None;
            if ends_unit {
                self.end_unit()?;
            }
        }
        Ok(true)
    }

    /// Drops the message at the front of `input`, whole or not.
    pub(super) fn skip_message(&mut self, h: &MessageHeader, input: &mut BytesMut) {
        let n = h.total_len().min(input.len());
        input.advance(n);
        if n < h.total_len() {
            self.client_stream = Some(ClientStream {
                remaining: h.total_len() - n,
                to_server: false,
                ends_unit: false,
            });
        }
    }

    /// Starts passing a large message to the server: its head is in `input`, the rest will
    /// follow. What it means for routing and the session is decided from the head alone: a
    /// query or statement too large to parse runs on the primary and may have changed
    /// anything; a large named statement cannot be kept for re-preparing elsewhere and is
    /// refused where servers are shared.
    pub(super) fn start_stream(
        &mut self,
        h: &MessageHeader,
        input: &mut BytesMut,
    ) -> Result<(), Disconnect> {
        if let Some(replay) = self.routing.replay.as_mut() {
            replay.repeatable = false;
        }
        if self.queue.skipping_to_sync() || self.lease.is_none() {
            self.skip_message(h, input);
            return Ok(());
        }
        let body = &input[HEADER_BYTES..];
        let unread = Routed::primary("is too large to read, so the primary runs it");
        match h.tag {
            ftag::QUERY | ftag::FUNCTION_CALL => {
                self.track_statement(&unread, true);
                self.queue.push_client(Request::Query { sql: None });
                if let Some(lease) = self.lease.as_ref() {
                    lease.pool.stats.queries.add(1);
                }
                // A query's request ends with its last byte (`continue_stream`).
                self.stream_rest(h, input, 0, h.tag == ftag::QUERY);
            }
            ftag::PARSE => {
                let name = body.split(|&b| b == 0).next().unwrap_or_default();
                if !name.is_empty() && self.mode_shares_servers() {
                    self.queue.push_synthetic(Synthetic::Error(Box::new(PgError::error(
                        SqlState::PROGRAM_LIMIT_EXCEEDED,
                        format!(
                            "prepared statement \"{}\" is {} bytes long, more than the {STREAM_MESSAGE_BYTES} pgherd keeps to prepare it again on other server connections",
                            String::from_utf8_lossy(name),
                            h.total_len()
                        ),
                    )
                    .with_hint("use the unnamed statement, or session pooling, for statements this large"))));
                    self.skip_message(h, input);
                    return Ok(());
                }
                self.track_statement(&unread, false);
                if name.is_empty() {
                    // Not kept: a Bind on another server connection cannot re-prepare it.
                    if let Some(unnamed) = self.unnamed.as_mut() {
                        unnamed.present = false;
                    }
                }
                self.queue.push_client(Request::Parse { cached: None });
                self.stream_rest(h, input, 0, false);
            }
            ftag::BIND => return self.start_bind_stream(h, input),
            ftag::COPY_DATA | ftag::COPY_DONE | ftag::COPY_FAIL => self.skip_message(h, input),
            tag => {
                return Err(Disconnect::Protocol(WireError::UnexpectedTag {
                    tag,
                    context: "from a client (too large for its type)",
                }))
            }
        }
        Ok(())
    }

    /// Passes the head of the message at the front of `input` to the server, from `skip`
    /// bytes into it (what was already written in another form), and streams the rest.
    fn stream_rest(
        &mut self,
        h: &MessageHeader,
        input: &mut BytesMut,
        skip: usize,
        ends_unit: bool,
    ) {
        if let Some(lease) = self.lease.as_mut() {
            lease.conn.write_buf.extend_from_slice(&input[skip..]);
        }
        let n = input.len();
        input.advance(n);
        self.client_stream = Some(ClientStream {
            remaining: h.total_len() - n,
            to_server: true,
            ends_unit,
        });
    }

    /// A Bind with a large value: its statement is renamed (and prepared on this server
    /// first) from its head, the values stream.
    fn start_bind_stream(
        &mut self,
        h: &MessageHeader,
        input: &mut BytesMut,
    ) -> Result<(), Disconnect> {
        let body = &input[HEADER_BYTES..];
        let Some((portal, name, names_len)) = frontend::bind_names(body) else {
            return Err(Disconnect::Protocol(WireError::Malformed {
                message: "Bind",
                reason: "portal or statement name (longer than 8 kB)",
            }));
        };
        let (portal, name) = (portal.to_vec(), name.to_vec());
        let rest_len = h.total_len() - HEADER_BYTES - names_len;
        match self.statement_routed(&name) {
            Some(routed) => self.track_statement(&routed, true),
            None => {
                self.note_possible_write(true);
                self.note_session_effect(SessionEffect::Unknown);
            }
        }
        if name.is_empty() || !self.mode_shares_servers() {
            if name.is_empty() {
                self.ensure_unnamed_here()?;
                if portal.is_empty() {
                    self.portal_sql = self
                        .unnamed
                        .as_ref()
                        .filter(|u| u.may_change_session())
                        .map(|u| u.query.clone().into_boxed_slice());
                }
            }
            self.queue.push_client(Request::Bind);
            self.stream_rest(h, input, 0, false);
            return Ok(());
        }
        let Some(def) = statement_or_error(&self.statements, &mut self.queue, &name) else {
            self.skip_message(h, input);
            return Ok(());
        };
        let Some(lease) = self.lease.as_mut() else {
            self.skip_message(h, input);
            return Ok(());
        };
        let generation = self.app.schema_generation.load(Ordering::Relaxed);
        ensure_prepared(lease, &mut self.queue, &def, generation)?;
        frontend::encode_bind_head(
            &mut lease.conn.write_buf,
            &portal,
            &def.server_name,
            rest_len,
        )?;
        if portal.is_empty() {
            self.portal_sql = def
                .may_change_session
                .then(|| def.query.clone().into_boxed_slice());
        }
        self.queue.push_client(Request::Bind);
        self.stream_rest(h, input, HEADER_BYTES + names_len, false);
        Ok(())
    }
}
