//! A session crossing between pgherd processes in an upgrade (`crate::handover`): sent from
//! the old one at its idle point, carried on in the new one with no startup and no login, and
//! the server connection it keeps (session mode, pinned) taken along.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use bytes::BytesMut;
use pgherd_wire::{PgError, SqlState};
use tokio::net::TcpStream;

use super::{log_end, routing_setup, send_error, serve_session, SessionRun};
use crate::app::App;
use crate::clients::ConnectionSlot;
use crate::error::Disconnect;
use crate::exec::ShardedSession;
use crate::handover::{ClientRecord, ServerRecord};
use crate::relay::params::SessionParams;
use crate::relay::{Held, Session, SessionSetup};
use crate::server::ServerAddr;
use crate::stream::Stream;

/// Sends a session that left at its idle point during an upgrade to the new process; if it
/// cannot go, the client is told to reconnect.
pub(super) async fn hand_over(run: &mut SessionRun) -> Disconnect {
    let sent = match run.session.take_for_handover() {
        Ok((connection, server, record)) => {
            crate::handover::send_client(&run.app, connection, server, record).await
        }
        Err(why) => Err(why),
    };
    match sent {
        Ok(()) => {
            run.session.let_moved_server_go().await;
            Disconnect::Moved
        }
        Err(why) => {
            tracing::warn!(client = run.shared.id, reason = %why, "upgrade: a client could not move to the new process");
            let end = Disconnect::CannotMove("the new process could not take it");
            run.session.farewell(&end).await;
            end
        }
    }
}

/// Runs a sharded session to its end; one that left at its idle point during an upgrade goes
/// to the new process (or is told to reconnect if it cannot).
pub(super) async fn serve_sharded(
    app: Arc<App>,
    mut session: ShardedSession,
    addr: std::net::SocketAddr,
    slot: ConnectionSlot,
) {
    let shared = session.shared.clone();
    let mut end = Box::pin(session.run()).await;
    if matches!(end, Disconnect::Moved) {
        let sent = match session.take_for_handover() {
            Ok((connection, record)) => {
                crate::handover::send_client(&app, connection, None, record).await
            }
            Err(why) => Err(why),
        };
        if let Err(why) = sent {
            tracing::warn!(client = shared.id, reason = %why, "upgrade: a client could not move to the new process");
            end = Disconnect::CannotMove("the new process could not take it");
            if let Some(error) = end.client_error() {
                send_error(&mut session.client, &error).await;
            }
        }
    }
    app.clients.unregister(&shared);
    log_end(&end, addr, Some(shared.id));
    drop(slot);
}

/// Carries on a session the old process sent during an upgrade (`crate::handover`): the
/// client logged in there, so there is no startup and no authentication, and it is counted
/// whatever the limits (it was within them). A session that keeps a server connection
/// (session mode, pinned) carries on with it: `server` is its socket.
pub async fn resume(
    app: Arc<App>,
    connection: OwnedFd,
    server: Option<OwnedFd>,
    mut record: ClientRecord,
) {
    let addr = record.addr;
    let Some(mut stream) = plain_tcp(connection).map(Stream::Plain) else {
        tracing::warn!(%addr, "upgrade: cannot take a moved client's connection");
        return;
    };
    let Some(mut slot) = app.clients.admit(usize::MAX) else {
        return;
    };
    slot.leave_pending();
    let _ = slot.log_in(usize::MAX);
    let resolved = serves_here(&app, &record);
    let key = pgherd_wire::startup::CancelKey {
        process_id: record.process_id,
        secret_key: record.secret_key,
    };
    let params =
        SessionParams::from_record(std::mem::take(&mut record.settings), &app.settings_interner);
    let held = match (&resolved, record.server.as_ref()) {
        (Some(_), Some(kept)) => {
            match adopt_server(&app, &record, kept, server, params.fingerprint()) {
                Ok(held) => Some(held),
                Err(why) => {
                    tracing::warn!(%addr, user = %record.user, db = %record.database, reason = why, "upgrade: a moved client's server connection cannot carry on here");
                    send_error(&mut stream, &cannot_carry_on(why)).await;
                    return;
                }
            }
        }
        _ => None,
    };
    let shared = resolved.as_ref().and_then(|_| {
        app.clients
            .register_moved(addr, &record.user, &record.database, key)
    });
    let (Some(resolved), Some(shared)) = (resolved, shared) else {
        let why = format!(
            "the new process does not serve database \"{}\" for user \"{}\" {}, or another client has this one's cancel key",
            record.database,
            record.user,
            match (record.sharded, record.session_mode) {
                (true, _) => "as a sharded endpoint",
                (false, true) => "in session mode",
                (false, false) => "in transaction or statement mode",
            },
        );
        if let Some(held) = held {
            // The backend kept the client's session: with the client gone it ends too.
            held.pool.release(held.conn, false);
        }
        send_error(&mut stream, &cannot_carry_on(&why)).await;
        tracing::warn!(%addr, user = %record.user, db = %record.database, "upgrade: a moved client cannot carry on here");
        return;
    };
    let routing = routing_setup(&app, &resolved, &record.database, &record.user);
    let client_in = BytesMut::from(record.unread.as_slice());
    if let Some(shards) = app.shards.clone() {
        let mut session = ShardedSession::new(
            app.clone(),
            shared.clone(),
            stream,
            client_in,
            params,
            routing,
            shards,
        );
        session.resume(&record);
        tracing::debug!(client = shared.id, %addr, user = %shared.user(), db = %shared.database(), "sharded client moved here from the old process");
        tokio::spawn(serve_sharded(app, session, addr, slot));
        return;
    }
    let mut session = Session::new(SessionSetup {
        app: app.clone(),
        shared: shared.clone(),
        client: stream,
        client_in,
        mode: resolved.pool.mode,
        routing,
        params,
    });
    session.resume(&record);
    if let Some(held) = held {
        if let Err(e) = session.hold(*held) {
            tracing::warn!(client = shared.id, error = %e, "upgrade: a moved client cannot take up its server connection");
            session
                .farewell(&Disconnect::CannotMove(
                    "the new process could not take its server connection",
                ))
                .await;
            app.clients.unregister(&shared);
            return;
        }
    }
    tracing::debug!(client = shared.id, %addr, user = %shared.user(), db = %shared.database(), "client moved here from the old process");
    tokio::spawn(serve_session(Box::new(SessionRun {
        shared,
        session,
        app,
        _slot: slot,
        addr,
    })));
}

/// What the new process's config says of a moved session's database and user, if it serves
/// them the way the session was served: a sharded endpoint's session only on a sharded
/// endpoint, a session-mode one only in session mode, another only in another mode.
fn serves_here(app: &App, record: &ClientRecord) -> Option<pgherd_config::ResolvedDatabase> {
    if record.sharded != app.shards.is_some() {
        return None;
    }
    app.config()
        .resolve(&record.database, &record.user)
        .filter(|r| {
            record.sharded
                || (r.pool.mode == pgherd_config::PoolMode::Session) == record.session_mode
        })
}

/// A TCP descriptor from the old process as a non-blocking tokio stream.
fn plain_tcp(socket: OwnedFd) -> Option<TcpStream> {
    let tcp = std::net::TcpStream::from(socket);
    tcp.set_nonblocking(true).ok()?;
    let tcp = TcpStream::from_std(tcp).ok()?;
    let _ = tcp.set_nodelay(true);
    Some(tcp)
}

/// A server connection handed over: TCP, or the node's Unix-domain socket.
fn server_stream(socket: OwnedFd) -> Result<(Stream, ServerAddr), &'static str> {
    let closed = "its server connection is closed";
    let cannot = "its server connection cannot be taken up";
    if !is_unix_socket(&socket) {
        let tcp = plain_tcp(socket).ok_or(cannot)?;
        let peer = tcp.peer_addr().map_err(|_| closed)?;
        return Ok((Stream::Plain(tcp), ServerAddr::Tcp(peer)));
    }
    let unix = std::os::unix::net::UnixStream::from(socket);
    let path = unix.peer_addr().map_err(|_| closed)?;
    let path = path.as_pathname().ok_or(closed)?.to_owned();
    let unix = crate::unix_socket::UnixSocket::from_std(unix).map_err(|_| cannot)?;
    Ok((Stream::Unix(unix), ServerAddr::unix(&path)))
}

fn is_unix_socket(socket: &OwnedFd) -> bool {
    socket2::SockRef::from(socket)
        .local_addr()
        .is_ok_and(|addr| addr.is_unix())
}

fn cannot_carry_on(why: &str) -> PgError {
    PgError::fatal(
        SqlState::ADMIN_SHUTDOWN,
        "terminating connection because pgherd was upgraded",
    )
    .with_detail(why.to_owned())
    .with_hint("reconnect")
}

/// The server connection a moved session keeps, taken up in this process's pool of its node
/// for its database and user (counted there as lent to it), carrying the session's settings
/// as they are.
fn adopt_server(
    app: &Arc<App>,
    record: &ClientRecord,
    kept: &ServerRecord,
    socket: Option<OwnedFd>,
    params_fp: u64,
) -> Result<Box<Held>, &'static str> {
    let (stream, peer) =
        server_stream(socket.ok_or("its server connection did not come with it")?)?;
    let node = app
        .nodes
        .get(&kept.node)
        .ok_or("its server's node is not in the new process's config")?;
    let pool = app
        .pool(&record.database, &record.user, &node)
        .ok_or("the new process has no pool for its database and user")?;
    let cancel_key = pgherd_wire::startup::CancelKey {
        process_id: kept.process_id,
        secret_key: kept.secret_key,
    };
    let mut conn = pool
        .adopt(
            &app.connect_context(),
            stream,
            peer,
            cancel_key,
            kept.reported.clone(),
        )
        .ok_or("the new process's pool for it is closed")?;
    conn.params_fp = params_fp;
    let generation = app
        .schema_generation
        .load(std::sync::atomic::Ordering::Relaxed);
    conn.statements.adopt(&kept.statements, generation);
    Ok(Box::new(Held { node, pool, conn }))
}
