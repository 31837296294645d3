//! A session parked while its client is idle (`crate::client::parked`): what of it lasts
//! between transactions, without the task, the socket's registration, the buffers and the
//! per-transaction state that an idle client would otherwise keep.
//!
//! Only a session with nothing under way parks, the same condition an upgrade's move has
//! ([`Movable::Now`]) and no server connection held: everything it is then is its routing
//! state, its settings, its prepared statements and its idle deadline, taken up again as they
//! were when the client speaks.

use std::io;
use std::sync::Arc;

use bytes::BytesMut;
use pgherd_config::PoolMode;
use tokio::net::TcpStream;

use super::params::SessionParams;
use super::routing_state::LastingRouting;
use super::statements::ClientStatements;
use super::{Movable, Routing, Session, UnnamedStatement};
use crate::app::App;
use crate::clients::ClientShared;
use crate::stream::Stream;

/// A parked session: about a quarter of a live one.
pub struct ParkedSession {
    shared: Arc<ClientShared>,
    mode: PoolMode,
    routing: LastingRouting,
    /// A write was sent whose end no probe has told.
    write_unconfirmed: bool,
    params: SessionParams,
    /// What many clients never have; boxed, so that a client without it pays one pointer
    /// (the parked client stays in the allocator's 224-byte class).
    defined: Option<Box<Defined>>,
    tx_failed: bool,
    /// When `client_idle_timeout_ms` ends the session, counted from before it parked.
    idle_deadline: Option<tokio::time::Instant>,
}

/// What a session defined that outlives a transaction: prepared statements, the unnamed
/// statement and portal's text, custom settings.
struct Defined {
    statements: Option<Box<ClientStatements>>,
    unnamed: Option<Box<UnnamedStatement>>,
    portal_sql: Option<Box<[u8]>>,
    custom_settings: Vec<String>,
}

impl ParkedSession {
    pub fn shared(&self) -> &Arc<ClientShared> {
        &self.shared
    }

    pub fn idle_deadline(&self) -> Option<tokio::time::Instant> {
        self.idle_deadline
    }
}

impl Session {
    /// Whether its kind can ever park: plain TCP (TLS keeps its keys in a live stream), a
    /// mode that shares servers (session mode holds its server).
    pub(super) fn may_ever_park(&self) -> bool {
        !self.client.is_tls() && self.mode_shares_servers()
    }

    /// Whether it can park now: nothing under way, no server held, nothing unread.
    pub(super) fn can_park_now(&self) -> bool {
        self.may_ever_park()
            && self.lease.is_none()
            && self.client_in.is_empty()
            && self.idle_timer.as_ref().is_none_or(|t| !t.is_elapsed())
            && self.routing.at_rest()
            && matches!(self.movable(), Movable::Now)
    }

    /// What lasts of this session, and its client's socket out of the runtime's reactor. On
    /// an error the socket is lost (it could not be taken out of the reactor).
    pub fn park(self) -> io::Result<(std::net::TcpStream, ParkedSession)> {
        let Session {
            shared,
            client,
            mode,
            routing,
            params,
            statements,
            unnamed,
            portal_sql,
            custom_settings,
            tx_failed,
            idle_timer,
            ..
        } = self;
        let Stream::Plain(tcp) = client else {
            return Err(io::Error::other("only a plain TCP connection parks"));
        };
        let tcp = tcp.into_std()?;
        let defined = (statements.is_some()
            || unnamed.is_some()
            || portal_sql.is_some()
            || !custom_settings.is_empty())
        .then(|| {
            Box::new(Defined {
                statements,
                unnamed,
                portal_sql,
                custom_settings,
            })
        });
        let (routing, write_unconfirmed) = routing.into_lasting();
        let parked = ParkedSession {
            shared,
            mode,
            routing,
            write_unconfirmed,
            params,
            defined,
            tx_failed,
            idle_deadline: idle_timer.map(|t| t.deadline()),
        };
        Ok((tcp, parked))
    }

    /// The session a parked one was, on `tcp` (its socket, back in this runtime's reactor).
    pub fn unpark(app: Arc<App>, parked: ParkedSession, tcp: TcpStream) -> Session {
        let ParkedSession {
            shared,
            mode,
            routing,
            write_unconfirmed,
            params,
            defined,
            tx_failed,
            idle_deadline,
        } = parked;
        let mut session = Session::assemble(
            app,
            shared,
            Stream::Plain(tcp),
            BytesMut::new(),
            mode,
            Routing::from_lasting(routing, write_unconfirmed),
            params,
        );
        if let Some(defined) = defined {
            let Defined {
                statements,
                unnamed,
                portal_sql,
                custom_settings,
            } = *defined;
            session.statements = statements;
            session.unnamed = unnamed;
            session.portal_sql = portal_sql;
            session.custom_settings = custom_settings;
        }
        session.tx_failed = tx_failed;
        session.idle_timer = idle_deadline.map(|d| Box::pin(tokio::time::sleep_until(d)));
        session
    }
}
