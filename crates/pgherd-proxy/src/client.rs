//! A client connection from accept to the start of its session: connection limit, SSLRequest
//! and TLS, CancelRequest, the startup packet, host-based rules, authentication, and the
//! login handshake (ParameterStatus, BackendKeyData, ReadyForQuery).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use pgherd_config::{AuthMethod, ClientTlsMode, ConnectionFacts, Route};
use pgherd_wire::backend::{self, TxStatus};
use pgherd_wire::frontend::{self, tag as ftag, SaslInitialResponse};
use pgherd_wire::md5::verify_md5_response;
use pgherd_wire::scram::{ScramCredential, ScramError, ScramServer, ScramVerifier, SCRAM_SHA_256};
use pgherd_wire::startup::{parse_startup_packet, StartupPacket, StartupParams};
use pgherd_wire::{PgError, SqlState};
use tokio::net::TcpStream;

use crate::admin;
use crate::app::App;
use crate::error::{client_io, Disconnect};
use crate::msgio::{read_message, read_startup_packet, write_flush, ReadError};
use crate::nodes::Nodes;
use crate::pool::AcquireError;
use crate::relay::params::SessionParams;
use crate::relay::{RoutingSetup, Session, SessionSetup};
use crate::startup_settings::LoginFailure;
use crate::stream::Stream;

mod moved;
mod parked;

pub use moved::resume;
pub use parked::{run as run_parking_lot, ParkingLot};

/// The virtual database of the admin console.
pub const ADMIN_DATABASE: &str = "pgherd";

/// Serves one accepted connection to its end.
pub async fn handle(app: Arc<App>, tcp: TcpStream, addr: SocketAddr) {
    let proxy = app.config().proxy.clone();
    if app.clients.failing_too_much(addr.ip()) {
        let err = PgError::fatal(
            SqlState::TOO_MANY_CONNECTIONS,
            "too many failed logins from this address are waiting for their answer",
        )
        .with_hint("retry in a few seconds");
        refuse_raw(tcp, err).await;
        return;
    }
    let limit = proxy.max_client_connections + proxy.admin_reserved_connections;
    let Some(mut slot) = app.clients.admit(limit) else {
        let err = PgError::fatal(
            SqlState::TOO_MANY_CONNECTIONS,
            "sorry, too many clients already",
        )
        .with_detail(format!(
            "pgherd.max_client_connections is {} (and {} for admin users)",
            proxy.max_client_connections, proxy.admin_reserved_connections
        ));
        refuse_raw(tcp, err).await;
        tracing::warn!(%addr, "connection refused: too many clients");
        return;
    };
    let login_timeout = Duration::from_millis(proxy.client_login_timeout_ms);
    let mut stream = Stream::Plain(tcp);
    let mut buf = BytesMut::new();
    // Boxed: the login's state (TLS handshake, SCRAM) is large and must not stay allocated in
    // this task for the whole session.
    let login = tokio::select! {
        biased;
        () = slot.evicted() => Err(Disconnect::LoginEvicted),
        login = tokio::time::timeout(
            login_timeout,
            Box::pin(login(&app, &mut stream, &mut buf, addr, &slot)),
        ) => login.unwrap_or(Err(Disconnect::LoginTimeout)),
    };
    slot.leave_pending();
    let end = match login {
        Ok(LoggedIn::Client {
            shared,
            mode,
            routing,
            params,
            server,
        }) => {
            tracing::debug!(client = shared.id, %addr, user = %shared.user(), db = %shared.database(), "client logged in");
            if let Some(shards) = app.shards.clone() {
                // A sharded session takes a link per shard for each statement.
                if let Some(held) = server {
                    held.pool.release(held.conn, true);
                }
                let session = crate::exec::ShardedSession::new(
                    app.clone(),
                    shared.clone(),
                    stream,
                    buf,
                    params,
                    routing,
                    shards,
                );
                tokio::spawn(moved::serve_sharded(app, session, addr, slot));
                return;
            }
            // The session gets a task of its own, so nothing of the login stays allocated for
            // the life of the connection.
            let mut run = Box::new(SessionRun {
                shared: shared.clone(),
                session: Session::new(SessionSetup {
                    app: app.clone(),
                    shared,
                    client: stream,
                    client_in: buf,
                    mode,
                    routing,
                    params,
                }),
                app: app.clone(),
                _slot: slot,
                addr,
            });
            if let Some(server) = server {
                if let Err(e) = run.session.hold(*server) {
                    tracing::warn!(client = run.shared.id, error = %e, "cannot start the session on its login's server");
                }
            }
            tokio::spawn(serve_session(run));
            return;
        }
        Ok(LoggedIn::Admin { shared, can_modify }) => {
            let end = Box::pin(admin::serve(&app, &shared, &mut stream, buf, can_modify)).await;
            app.clients.unregister(&shared);
            end
        }
        Err(end) => end,
    };
    if end.is_guess() && proxy.auth_failure_delay_ms > 0 {
        // Answered late, the place still held (at most a few per address, see `handle`):
        // guessing from one address gets slow.
        let base = Duration::from_millis(proxy.auth_failure_delay_ms);
        let recent = app.clients.delay_failure(addr.ip(), base).await;
        if crate::throttle::worth_logging(recent) {
            tracing::warn!(%addr, recent, reason = %end, "failed login or cancel request; answers to this address are slowed down");
        }
    }
    if let Some(err) = end.client_error() {
        send_error(&mut stream, &err).await;
    }
    log_end(&end, addr, None);
    drop(slot);
}

/// Counts a connection that authenticated as logged in, before it is told so; refused if
/// the places for its kind are taken (the admin console's users may use the reserved ones).
fn take_place(
    app: &Arc<App>,
    slot: &crate::clients::ConnectionSlot,
    admin_console: bool,
) -> Result<(), Disconnect> {
    let proxy = &app.config().proxy;
    let mut limit = proxy.max_client_connections;
    if admin_console {
        limit += proxy.admin_reserved_connections;
    }
    if slot.log_in(limit).is_some() {
        return Ok(());
    }
    Err(Disconnect::refused(
        PgError::fatal(SqlState::TOO_MANY_CONNECTIONS, "sorry, too many clients already")
            .with_detail(format!(
                "pgherd.max_client_connections is {}; {} more places are reserved for the admin console's users",
                proxy.max_client_connections, proxy.admin_reserved_connections
            )),
    ))
}

/// Everything a session's task owns, boxed so the task itself stays small: an idle client
/// costs this box, the task, and its socket.
struct SessionRun {
    session: Session,
    app: Arc<App>,
    shared: Arc<crate::clients::ClientShared>,
    /// Keeps the client counted against max_client_connections.
    _slot: crate::clients::ConnectionSlot,
    addr: SocketAddr,
}

/// Runs a logged-in client's session to its end.
async fn serve_session(mut run: Box<SessionRun>) {
    let mut end = run.session.run().await;
    while matches!(end, Disconnect::Parked) {
        match parked::park(run) {
            None => return,
            // The lot is not running: nothing asked it to park, but carry on if so.
            Some(back) => run = back,
        }
        end = run.session.run().await;
    }
    if matches!(end, Disconnect::Moved) {
        // Boxed: once in a session's life, and as large as the rest of its task.
        end = Box::pin(moved::hand_over(&mut run)).await;
    }
    run.app.clients.unregister(&run.shared);
    log_end(&end, run.addr, Some(run.shared.id));
}

fn log_end(end: &Disconnect, addr: SocketAddr, client: Option<u64>) {
    if end.is_routine() {
        tracing::debug!(%addr, client, reason = %end, "client disconnected");
    } else {
        tracing::info!(%addr, client, reason = %end, "client disconnected");
    }
}

async fn refuse_raw(mut tcp: TcpStream, err: PgError) {
    let mut buf = BytesMut::new();
    if err.encode(&mut buf).is_ok() {
        let _ = tokio::time::timeout(Duration::from_secs(1), write_flush(&mut tcp, &buf)).await;
    }
}

/// Tells the client `err` (given up on after a second: it may not be reading).
pub(crate) async fn send_error(stream: &mut Stream, err: &PgError) {
    let mut buf = BytesMut::new();
    if err.encode(&mut buf).is_ok() {
        let _ = tokio::time::timeout(Duration::from_secs(1), write_flush(stream, &buf)).await;
    }
}

enum LoggedIn {
    Client {
        shared: Arc<crate::clients::ClientShared>,
        mode: pgherd_config::PoolMode,
        routing: RoutingSetup,
        params: SessionParams,
        /// The server a session-mode client keeps from its login on (its identity is the
        /// client's: its process id is in the client's cancel key).
        server: Option<Box<crate::relay::Held>>,
    },
    Admin {
        shared: Arc<crate::clients::ClientShared>,
        can_modify: bool,
    },
}

fn startup_read_error(e: ReadError) -> Disconnect {
    match e {
        ReadError::Eof => Disconnect::Done("client closed before sending a startup packet"),
        ReadError::Io(e) => client_io(e),
        ReadError::Wire(e) => Disconnect::Protocol(e),
    }
}

fn login_read_error(e: ReadError) -> Disconnect {
    match e {
        ReadError::Eof => Disconnect::Done("client closed during authentication"),
        ReadError::Io(e) => client_io(e),
        ReadError::Wire(e) => Disconnect::Protocol(e),
    }
}

async fn login(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
    addr: SocketAddr,
    slot: &crate::clients::ConnectionSlot,
) -> Result<LoggedIn, Disconnect> {
    if app.is_shutting_down() {
        return Err(Disconnect::refused(PgError::fatal(
            SqlState::CANNOT_CONNECT_NOW,
            "pgherd is shutting down",
        )));
    }
    let params = loop {
        let packet = read_startup_packet(stream, buf)
            .await
            .map_err(startup_read_error)?;
        match parse_startup_packet(&packet)? {
            StartupPacket::SslRequest => {
                negotiate_tls(app, stream, buf).await?;
            }
            StartupPacket::GssEncRequest => {
                write_flush(stream, b"N").await.map_err(client_io)?;
            }
            StartupPacket::Cancel(key) => {
                // During an upgrade the client may still be in the old process.
                if !app.clients.cancel(key, Duration::from_secs(5))
                    && !crate::handover::forward_cancel(app, key)
                {
                    return Err(Disconnect::CancelRefused);
                }
                return Err(Disconnect::Done("cancel request handled"));
            }
            StartupPacket::Startup(params) => break params,
        }
    };
    let config = app.config();
    if !stream.is_tls()
        && config
            .client_tls
            .as_ref()
            .is_some_and(|t| t.mode == ClientTlsMode::Require)
    {
        return Err(Disconnect::refused(PgError::fatal(
            SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
            "pgherd accepts TLS connections only (tls.mode = \"require\")",
        )));
    }
    let user = params.user().ok_or_else(|| {
        Disconnect::refused(PgError::fatal(
            SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
            "no PostgreSQL user name specified in startup packet",
        ))
    })?;
    let user = user.to_owned();
    let database = params.database().unwrap_or(&user).to_owned();
    refuse_replication(&params).map_err(Disconnect::refused)?;
    negotiate_protocol(stream, &params).await?;

    let facts = ConnectionFacts {
        address: addr.ip(),
        tls: stream.is_tls(),
        user: &user,
        database: &database,
    };
    let method = match pgherd_config::hba::choose_method(&config.hba, &facts) {
        Some((_, AuthMethod::Reject)) | None => {
            return Err(Disconnect::refused(PgError::fatal(
                SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
                format!(
                    "pgherd hba rules reject connection for host \"{}\", user \"{user}\", database \"{database}\", {}",
                    addr.ip(),
                    if stream.is_tls() { "TLS" } else { "no encryption" }
                ),
            )))
        }
        Some((_, method)) => method,
    };
    // The rest of the handshake goes out in one write with the last authentication message.
    let mut out = authenticate(app, stream, buf, &user, method).await?;
    take_place(app, slot, database == ADMIN_DATABASE)?;

    if database == ADMIN_DATABASE {
        let shared = app
            .clients
            .register(addr, &user, &database, stream.is_tls(), None);
        let proxy = &config.proxy;
        let can_modify = proxy.admin_users.iter().any(|u| u == &user);
        let can_read = can_modify || proxy.stats_users.iter().any(|u| u == &user);
        if !can_read {
            app.clients.unregister(&shared);
            return Err(Disconnect::refused(PgError::fatal(
                SqlState::INSUFFICIENT_PRIVILEGE,
                format!("user \"{user}\" is not allowed on the admin console (add it to pgherd.admin_users or pgherd.stats_users)"),
            )));
        }
        admin::write_login(&mut out, shared.key)?;
        write_flush(stream, &out).await.map_err(client_io)?;
        return Ok(LoggedIn::Admin { shared, can_modify });
    }
    finish_login(app, stream, out, &params, addr, &user, &database).await
}

/// A replication connection (`replication=true` or `database`) speaks the walsender's
/// protocol, which pgherd does not relay: refused by name, rather than served as an ordinary
/// session where `IDENTIFY_SYSTEM` or `START_REPLICATION` would fail as syntax errors. The
/// values PostgreSQL accepts, and its error for any other.
fn refuse_replication(params: &StartupParams) -> Result<(), PgError> {
    let Some(value) = params.get("replication") else {
        return Ok(());
    };
    match (value, crate::relay::params::parse_bool(value)) {
        (_, Some(false)) => Ok(()),
        ("database", _) | (_, Some(true)) => Err(PgError::fatal(
            SqlState::FEATURE_NOT_SUPPORTED,
            format!("pgherd does not relay replication connections (replication={value})"),
        )
        .with_hint("connect replication clients (standbys, pg_basebackup, logical decoding) to a node directly")),
        (_, None) => Err(PgError::fatal(
            SqlState::INVALID_PARAMETER_VALUE,
            format!("invalid value for parameter \"replication\": \"{value}\""),
        )
        .with_hint("Valid values are: \"false\", 0, \"true\", 1, \"database\".")),
    }
}

/// How long a login waits before it tries again when the node it took could not be reached.
const LOGIN_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The node a new connection is served by, its pool, and the client's startup settings
/// checked by one of its servers. While no node can serve it (a failover under way, pgherd
/// just started, the primary restarting), or the one chosen cannot be reached (killed a
/// moment ago, before its health checks tell), the login waits for one up to
/// `primary_wait_ms`, as a request that needs the primary does.
async fn login_node(
    app: &Arc<App>,
    route: Route,
    settings: &SessionParams,
    session_mode: bool,
    user: &str,
    database: &str,
) -> Result<
    (
        Arc<crate::nodes::NodeState>,
        Arc<crate::pool::Pool>,
        crate::startup_settings::Checked,
    ),
    Disconnect,
> {
    let wait = Duration::from_millis(app.config().cluster.primary_wait_ms);
    let deadline = tokio::time::Instant::now() + wait;
    let pick = |nodes: &Nodes| match route {
        Route::Primary => nodes.writer(),
        Route::Auto => nodes.writer().or_else(|| nodes.pick_replica()),
        Route::Replica => nodes.pick_replica().or_else(|| nodes.writer()),
    };
    loop {
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let node = app
            .nodes
            .node_within(remaining, pick)
            .await
            .ok_or_else(|| {
                Disconnect::refused(
                    PgError::fatal(
                        SqlState::CANNOT_CONNECT_NOW,
                        "no node is available to serve this connection",
                    )
                    .with_detail(format!("nodes: {}", app.nodes.describe_all())),
                )
            })?;
        let pool = app.pool(database, user, &node).ok_or_else(|| {
            Disconnect::refused(PgError::fatal(
                SqlState::INVALID_CATALOG_NAME,
                format!("database \"{database}\" does not exist"),
            ))
        })?;
        match serve_login(app, &pool, settings, session_mode, user, database).await {
            Ok(checked) => return Ok((node, pool, checked)),
            Err(failed)
                if failed.transient
                    && tokio::time::Instant::now() + LOGIN_RETRY_PAUSE < deadline =>
            {
                tracing::info!(node = node.name(), user, database, error = ?failed.end.client_error().map(|e| e.message), "login: the node could not be reached; waiting for it or another");
                tokio::time::sleep(LOGIN_RETRY_PAUSE).await;
            }
            Err(failed) => return Err(failed.end),
        }
    }
}

/// The first client of a pool logs in to a server to learn what to report (which also
/// proves the server accepts this user and database); then the client's startup settings
/// are checked by a server.
async fn serve_login(
    app: &Arc<App>,
    pool: &Arc<crate::pool::Pool>,
    settings: &SessionParams,
    session_mode: bool,
    user: &str,
    database: &str,
) -> Result<crate::startup_settings::Checked, LoginFailure> {
    if !pool.has_template_params() {
        match pool.acquire(&app.connect_context()).await {
            Ok(conn) => pool.release(conn, true),
            Err(AcquireError::Server(e)) => {
                tracing::warn!(user, database, error = %e, "first server login failed");
                app.forget_pool_if_unused(pool);
                return Err(LoginFailure::server(&e));
            }
            Err(AcquireError::WaitTimeout { .. }) | Err(AcquireError::Closed) => {}
        }
    }
    crate::startup_settings::check(app, pool, settings, session_mode).await
}

async fn finish_login(
    app: &Arc<App>,
    stream: &mut Stream,
    mut out: BytesMut,
    params: &StartupParams,
    addr: SocketAddr,
    user: &str,
    database: &str,
) -> Result<LoggedIn, Disconnect> {
    let resolved = app.config().resolve(database, user).ok_or_else(|| {
        Disconnect::refused(
            PgError::fatal(
                SqlState::INVALID_CATALOG_NAME,
                format!("database \"{database}\" does not exist"),
            )
            .with_hint("pgherd serves the databases listed under [databases] in its config"),
        )
    })?;
    let settings = SessionParams::from_startup(&params.params, &app.settings_interner);
    let session_mode = resolved.pool.mode == pgherd_config::PoolMode::Session;
    let (node, pool, checked) =
        login_node(app, resolved.route, &settings, session_mode, user, database).await?;
    let own = checked.reported;
    let shared = app.clients.register(
        addr,
        user,
        database,
        stream.is_tls(),
        checked.server.as_ref().map(|c| c.cancel_key.process_id),
    );
    let server = checked.server.map(|conn| {
        Box::new(crate::relay::Held {
            node: node.clone(),
            pool: pool.clone(),
            conn,
        })
    });
    let template = pool.template_params();
    for (name, value) in template.iter() {
        let value = own
            .iter()
            .find(|(n, _)| n == name)
            .map_or(value, |(_, v)| v);
        backend::encode_parameter_status(&mut out, name, value)?;
    }
    for (name, value) in own.iter() {
        if !template.iter().any(|(k, _)| k == name) {
            backend::encode_parameter_status(&mut out, name, value)?;
        }
    }
    backend::encode_backend_key_data(&mut out, shared.key)?;
    backend::encode_ready_for_query(&mut out, TxStatus::Idle);
    if let Err(e) = write_flush(stream, &out).await {
        app.clients.unregister(&shared);
        if let Some(held) = server {
            held.pool.release(held.conn, true);
        }
        return Err(client_io(e));
    }
    Ok(LoggedIn::Client {
        server,
        shared,
        mode: resolved.pool.mode,
        routing: routing_setup(app, &resolved, database, user),
        params: settings,
    })
}

/// How a session of `database` and `user` is routed, as `resolved` from the config says.
fn routing_setup(
    app: &Arc<App>,
    resolved: &pgherd_config::ResolvedDatabase,
    database: &str,
    user: &str,
) -> RoutingSetup {
    RoutingSetup {
        route: resolved.route,
        consistency: resolved.consistency,
        balance: resolved.balance,
        primary_reads: resolved.primary_reads,
        // A session-mode client keeps one server, so there is nothing to route.
        router: (resolved.pool.mode != pgherd_config::PoolMode::Session)
            .then(|| app.router(&resolved.server_dbname)),
        cache: session_cache(app, resolved, database, user),
    }
}

/// The result cache a session may use: not in session mode (the client holds its server),
/// not on a sharded endpoint (one stream per shard is still to come), not when switched off.
fn session_cache(
    app: &Arc<App>,
    resolved: &pgherd_config::ResolvedDatabase,
    database: &str,
    user: &str,
) -> Option<crate::result_cache::CacheUse> {
    let config = app.config();
    let usable = config.cache.enabled
        && app.shards.is_none()
        && resolved.pool.mode != pgherd_config::PoolMode::Session;
    usable.then(|| crate::result_cache::CacheUse {
        db: app.caches.of(&resolved.server_dbname, &config.cache),
        every_read: config.cache.asked_for(database, user),
        statement_patterns: !config.cache.statements.is_empty(),
    })
}

async fn negotiate_tls(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
) -> Result<(), Disconnect> {
    if stream.is_tls() {
        return Err(Disconnect::Protocol(pgherd_wire::WireError::Malformed {
            message: "SSLRequest",
            reason: "request (TLS is already established)",
        }));
    }
    let Some(acceptor) = app.client_tls() else {
        write_flush(stream, b"N").await.map_err(client_io)?;
        return Ok(());
    };
    if !buf.is_empty() {
        // Bytes sent after SSLRequest but before the handshake could be injected by a
        // man in the middle (CVE-2021-23214); PostgreSQL refuses them too.
        return Err(Disconnect::refused(PgError::fatal(
            SqlState::PROTOCOL_VIOLATION,
            "received unencrypted data after SSL request",
        )));
    }
    write_flush(stream, b"S").await.map_err(client_io)?;
    stream.accept_tls(&acceptor).await.map_err(|e| {
        Disconnect::refused(PgError::fatal(
            SqlState::PROTOCOL_VIOLATION,
            format!("TLS handshake failed: {e}"),
        ))
    })
}

/// Clients asking for a newer minor version or for protocol options learn that this session
/// speaks 3.0 without them.
async fn negotiate_protocol(stream: &mut Stream, params: &StartupParams) -> Result<(), Disconnect> {
    let options: Vec<&str> = params.protocol_options().collect();
    if params.minor_version == 0 && options.is_empty() {
        return Ok(());
    }
    let mut out = BytesMut::new();
    backend::encode_negotiate_protocol_version(&mut out, 0, &options)?;
    write_flush(stream, &out).await.map_err(client_io)
}

/// What pgherd knows to check a user's password against.
#[derive(Default)]
struct UserSecrets {
    scram: Option<ScramVerifier>,
    md5: Option<String>,
    /// The user exists but has no password at all.
    exists: bool,
}

async fn user_secrets(app: &Arc<App>, user: &str) -> Result<UserSecrets, Disconnect> {
    let config = app.config();
    if let Some(entry) = config.users.get(user) {
        return Ok(UserSecrets {
            scram: entry.scram.clone(),
            md5: entry.md5.clone(),
            exists: true,
        });
    }
    let Some(auth) = &config.auth_query else {
        return Ok(UserSecrets::default());
    };
    let passwd = crate::auth_query::lookup(app, auth, user)
        .await
        .map_err(|e| {
            tracing::warn!(user, error = %e, "auth_query failed");
            Disconnect::refused(PgError::fatal(
                SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
                format!("pgherd could not look up user \"{user}\": {e}"),
            ))
        })?;
    Ok(match passwd {
        None => UserSecrets::default(),
        Some(None) => UserSecrets {
            exists: true,
            ..Default::default()
        },
        Some(Some(secret)) if secret.starts_with("SCRAM-SHA-256$") => UserSecrets {
            scram: ScramVerifier::parse(&secret).ok(),
            md5: None,
            exists: true,
        },
        Some(Some(secret)) if pgherd_wire::md5::is_md5_hash(&secret) => UserSecrets {
            scram: None,
            md5: Some(secret),
            exists: true,
        },
        Some(Some(_)) => UserSecrets {
            exists: true,
            ..Default::default()
        },
    })
}

fn auth_failed(user: &str) -> Disconnect {
    Disconnect::refused(PgError::fatal(
        SqlState::INVALID_PASSWORD,
        format!("password authentication failed for user \"{user}\""),
    ))
}

async fn authenticate(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
    user: &str,
    method: AuthMethod,
) -> Result<BytesMut, Disconnect> {
    let mut out = BytesMut::with_capacity(1024);
    match method {
        AuthMethod::Reject => return Err(auth_failed(user)),
        AuthMethod::Trust => {}
        AuthMethod::Cert => {
            let common_name = stream
                .peer_certificates()
                .and_then(|chain| chain.first().and_then(crate::tls::certificate_common_name));
            match common_name {
                Some(cn) if cn == user => {}
                Some(cn) => {
                    return Err(Disconnect::refused(
                        PgError::fatal(
                            SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
                            format!("certificate authentication failed for user \"{user}\""),
                        )
                        .with_detail(format!("the certificate is for \"{cn}\"")),
                    ))
                }
                None => {
                    return Err(Disconnect::refused(PgError::fatal(
                        SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
                        "connection requires a valid client certificate",
                    )))
                }
            }
        }
        AuthMethod::ScramSha256 | AuthMethod::Md5 => {
            let secrets = user_secrets(app, user).await?;
            let use_md5 = method == AuthMethod::Md5
                && secrets.scram.is_none()
                && (secrets.md5.is_some() || !secrets.exists);
            if use_md5 {
                md5_exchange(app, stream, buf, user, secrets.md5.as_deref()).await?;
            } else {
                scram_exchange(app, stream, buf, &mut out, user, secrets.scram).await?;
            }
        }
    }
    backend::encode_auth_ok(&mut out)?;
    Ok(out)
}

async fn read_password_message(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
) -> Result<BytesMut, Disconnect> {
    let max = app.config().proxy.max_message_bytes.min(64 << 10);
    let (tag, body) = read_message(stream, buf, max)
        .await
        .map_err(login_read_error)?;
    if tag != ftag::PASSWORD {
        return Err(Disconnect::Protocol(
            pgherd_wire::WireError::UnexpectedTag {
                tag,
                context: "during authentication (expected a password message)",
            },
        ));
    }
    Ok(body)
}

async fn md5_exchange(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
    user: &str,
    stored: Option<&str>,
) -> Result<(), Disconnect> {
    let salt: [u8; 4] = rand::random();
    let mut out = BytesMut::new();
    backend::encode_auth_md5(&mut out, salt)?;
    write_flush(stream, &out).await.map_err(client_io)?;
    let body = read_password_message(app, stream, buf).await?;
    let response = frontend::parse_password(&body)?;
    match stored {
        Some(hash) if verify_md5_response(hash, salt, response) => {
            let creds = app.user_credentials(user);
            let mut c = creds.lock();
            if c.md5_hash.is_none() {
                c.md5_hash = Some(hash.to_owned());
            }
            Ok(())
        }
        _ => Err(auth_failed(user)),
    }
}

/// Runs the SCRAM exchange; the final server message is left in `last` for the caller to send
/// with what follows it.
async fn scram_exchange(
    app: &Arc<App>,
    stream: &mut Stream,
    buf: &mut BytesMut,
    last: &mut BytesMut,
    user: &str,
    verifier: Option<ScramVerifier>,
) -> Result<(), Disconnect> {
    let mut out = BytesMut::new();
    backend::encode_auth_sasl(&mut out, &[SCRAM_SHA_256])?;
    write_flush(stream, &out).await.map_err(client_io)?;
    let nonce: [u8; 18] = rand::random();
    let server = match &verifier {
        Some(v) => ScramServer::new(v.clone(), &nonce),
        None => ScramServer::mock(user, &app.mock_secret, &nonce),
    };
    let body = read_password_message(app, stream, buf).await?;
    let initial = SaslInitialResponse::parse(&body)?;
    if initial.mechanism != SCRAM_SHA_256 {
        return Err(Disconnect::refused(PgError::fatal(
            SqlState::PROTOCOL_VIOLATION,
            format!(
                "client selected an invalid SASL authentication mechanism \"{}\"",
                initial.mechanism
            ),
        )));
    }
    let scram_failure = |e: ScramError| match e {
        ScramError::ProofMismatch => auth_failed(user),
        other => Disconnect::refused(PgError::fatal(other.sqlstate(), other.to_string())),
    };
    let (server, server_first) = server.client_first(initial.data).map_err(scram_failure)?;
    out.clear();
    backend::encode_auth_sasl_continue(&mut out, &server_first)?;
    write_flush(stream, &out).await.map_err(client_io)?;
    let body = read_password_message(app, stream, buf).await?;
    let success = server.client_final(&body).map_err(scram_failure)?;
    backend::encode_auth_sasl_final(last, &success.server_final)?;
    if let Some(v) = verifier {
        // Keep what lets pgherd log in to servers holding the same verifier as this user.
        let creds = app.user_credentials(user);
        creds.lock().scram_keys = Some(ScramCredential::Keys {
            client_key: success.client_key,
            server_key: v.server_key,
            salt: v.salt,
            iterations: v.iterations,
        });
    }
    Ok(())
}
