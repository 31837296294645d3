//! A session leaving for a new pgherd process during an upgrade (`crate::handover`), and one
//! arriving: whether it can move now, what it takes along, and how it carries on.
//!
//! Only a session between transactions with nothing under way moves: everything it is then is
//! in pgherd's hands (settings, statements, cancel key, the WAL position its reads need) and
//! fits a [`ClientRecord`], or is in the server connection it keeps (session mode, pinned),
//! which moves along, idle, as a socket and a [`ServerRecord`]. What the giver read from the
//! client but did not handle goes along too, so no byte is lost or handled twice.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;

use pgherd_config::PoolMode;
use pgherd_wire::backend::TxStatus;

use super::params::SessionParams;
use super::statements::{ClientStatements, StatementDef};
use super::{Session, SessionEffect, UnnamedStatement};
use crate::error::Disconnect;
use crate::handover::{ClientRecord, ServerRecord, SettingsRecord, StatementRecord};
use crate::stream::Stream;

/// Whether a session can move to another process.
pub(crate) enum Movable {
    Now,
    /// Once what is under way ends (a transaction, a request, a server given back).
    Later,
    /// Never, for this reason: the client must reconnect.
    Never(&'static str),
}

/// What every moving session takes along, whatever its kind: a duplicate of its client's
/// socket (its own closes when it ends) and its settings; why not when it cannot move now.
pub(crate) fn client_for_handover(
    movable: Movable,
    client: &Stream,
    params: &SessionParams,
) -> Result<(OwnedFd, SettingsRecord), String> {
    match movable {
        Movable::Now => {}
        Movable::Later => return Err("a request of it is under way".to_owned()),
        Movable::Never(why) => return Err(why.to_owned()),
    }
    let Stream::Plain(tcp) = client else {
        return Err("not a plain TCP connection".to_owned());
    };
    let settings = params
        .to_record()
        .ok_or("its settings have changes pending")?;
    let connection = tcp
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| format!("cannot duplicate the client's socket: {e}"))?;
    Ok((connection, settings))
}

impl Session {
    /// How a session at an idle point ends once pgherd is stopping or being upgraded;
    /// `None`: not yet (what is under way ends first).
    pub(super) fn end_at_idle_point(&self) -> Option<Disconnect> {
        if self.move_when_idle {
            match self.movable() {
                Movable::Now => return Some(Disconnect::Moved),
                Movable::Never(why) => return Some(Disconnect::CannotMove(why)),
                Movable::Later => {}
            }
        }
        // Not `then_some`: its argument is built and dropped on every call, several times
        // per transaction.
        if self.stop_when_idle {
            Some(Disconnect::Shutdown)
        } else {
            None
        }
    }

    pub(crate) fn movable(&self) -> Movable {
        if self.client.is_tls() {
            return Movable::Never(
                "it uses TLS, whose session keys stay in this process's TLS library",
            );
        }
        let server_busy = match &self.lease {
            None => false,
            Some(_) if !self.keeps_server() => true,
            Some(lease) => {
                if lease.conn.stream.is_tls() {
                    return Movable::Never("its server connection uses TLS, whose session keys stay in this process's TLS library");
                }
                !self.server_between_requests() || !lease.conn.read_buf.is_empty()
            }
        };
        let under_way = server_busy
            || self.untracked_change
            || self.client_tx != TxStatus::Idle
            || !self.queue.is_settled()
            || !self.client_out.is_empty()
            || self.client_stream.is_some()
            || self.server_passthrough.is_some()
            || self.local_skip_to_sync
            || self.pending_error.is_some()
            || self.probe_rows.is_some()
            || !self.after_stream.is_empty()
            || self.skip_preliminaries > 0
            || self.fill.is_some()
            || self.cache_candidate.is_some()
            // What ran may have left state on the server: a server that moves along keeps it.
            || (self.routing.lasting.effect != SessionEffect::None && !self.keeps_server())
            || self.routing.lasting.schema_change.is_some()
            // Kept for reuse: only what it holds counts.
            || self
                .routing
                .replay
                .as_ref()
                .is_some_and(|r| !r.bytes.is_empty() || r.refused)
            || self.routing.retry_on_primary
            || self.routing.held
            || !self.params.is_settled();
        if under_way {
            Movable::Later
        } else {
            Movable::Now
        }
    }

    /// Its server connection is its session's (session mode, or pinned): it moves with it.
    fn keeps_server(&self) -> bool {
        self.mode == PoolMode::Session || self.routing.lasting.pinned.is_some()
    }

    /// The server connection this session keeps, for the new process: a duplicate of its
    /// socket and what the new process needs to carry on with it.
    fn server_for_handover(&self) -> Result<Option<(OwnedFd, ServerRecord)>, String> {
        let Some(lease) = self.lease.as_ref() else {
            return Ok(None);
        };
        let Some(socket) = lease.conn.stream.plain_fd() else {
            return Err("its server connection is encrypted (TLS)".to_owned());
        };
        let socket = socket
            .try_clone_to_owned()
            .map_err(|e| format!("cannot duplicate the server's socket: {e}"))?;
        let generation = self.app.schema_generation.load(Ordering::Relaxed);
        let conn = &lease.conn;
        Ok(Some((
            socket,
            ServerRecord {
                node: lease.node.config.name.clone(),
                process_id: conn.cancel_key.process_id,
                secret_key: conn.cancel_key.secret_key,
                reported: conn.reported.clone(),
                pin: self.routing.lasting.pinned,
                statements: conn.statements.carried(generation),
            },
        )))
    }

    /// The client's connection (a duplicate of its descriptor: this session's own closes when
    /// it ends), its server's if it keeps one, and the record of its session, for the new
    /// process.
    pub fn take_for_handover(&self) -> Result<(OwnedFd, Option<OwnedFd>, ClientRecord), String> {
        let (connection, settings) =
            client_for_handover(self.movable(), &self.client, &self.params)?;
        let record = |name: &[u8], def: &StatementDef| StatementRecord {
            name: name.to_vec(),
            query: def.query.clone(),
            param_types: def.param_types.clone(),
        };
        let statements = self
            .statements
            .iter()
            .flat_map(|s| s.iter())
            .map(|(name, def)| record(name, def))
            .collect();
        let unnamed = self
            .unnamed
            .as_ref()
            .filter(|u| u.present)
            .map(|u| StatementRecord {
                name: Vec::new(),
                query: u.query.clone(),
                param_types: u.param_types.clone(),
            });
        let (server_socket, server) = self.server_for_handover()?.unzip();
        let shared = &self.shared;
        Ok((
            connection,
            server_socket,
            ClientRecord {
                addr: shared.addr,
                user: shared.user().to_string(),
                database: shared.database().to_string(),
                process_id: shared.key.process_id,
                secret_key: shared.key.secret_key,
                unread: self.client_in.to_vec(),
                settings,
                custom_settings: self.custom_settings.clone(),
                statements,
                unnamed,
                route_override: self
                    .routing
                    .lasting
                    .session
                    .override_route
                    .map(|r| r.as_str().to_owned()),
                default_read_only: self.routing.lasting.session.default_read_only,
                standard_conforming_strings: self.routing.lasting.standard_conforming_strings,
                min_lsn: self.routing.lasting.min_lsn,
                write_unconfirmed: self.routing.write_unconfirmed(),
                session_mode: self.mode == PoolMode::Session,
                server,
                sharded: false,
                shard_positions: Vec::new(),
            },
        ))
    }

    /// After its server connection went to the new process with it: this process lets go of
    /// its copy without a word to the server (the backend is the new process's now).
    pub async fn let_moved_server_go(&mut self) {
        self.detach(false).await;
    }

    /// Takes up what a moved session was: its statements, custom settings and routing state
    /// (the settings and the unread bytes came with its setup). What cannot be read is left
    /// out with a warning: the client then gets PostgreSQL's error for what is missing.
    pub fn resume(&mut self, record: &ClientRecord) {
        if !record.statements.is_empty() {
            let mut statements = ClientStatements::default();
            for s in &record.statements {
                let def =
                    StatementDef::new(&s.query, &s.param_types, self.params.current("search_path"));
                if let Err(e) = statements.define(&s.name, def) {
                    tracing::warn!(client = self.shared.id, error = ?e, "upgrade: a moved client's statement was left out");
                }
            }
            self.statements = Some(Box::new(statements));
        }
        if let Some(unnamed) = &record.unnamed {
            self.unnamed = Some(Box::new(UnnamedStatement {
                query: unnamed.query.clone(),
                param_types: unnamed.param_types.clone(),
                present: true,
                routed: None,
            }));
        }
        self.custom_settings = record.custom_settings.clone();
        let routing = &mut self.routing;
        routing.lasting.pinned = record.server.as_ref().and_then(|s| s.pin);
        if routing.lasting.pinned.is_some() {
            self.shared.set_may_park(false);
        }
        routing.lasting.session.override_route = record
            .route_override
            .as_deref()
            .and_then(pgherd_config::Route::parse);
        routing.lasting.session.default_read_only = record.default_read_only;
        routing.lasting.standard_conforming_strings = record.standard_conforming_strings;
        routing.lasting.min_lsn = record.min_lsn;
        if record.write_unconfirmed {
            routing.mark_write_unconfirmed();
        }
    }

    /// Tells the client why its session ends (after it ended without a server).
    pub async fn farewell(&mut self, end: &Disconnect) {
        self.finish(end).await;
    }
}
