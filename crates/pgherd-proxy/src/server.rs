//! Server connections: establishing them (TCP, TLS, startup, authentication) and the small
//! query runner pgherd uses for its own management queries.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use pgherd_config::ServerTlsMode;
use pgherd_wire::backend::{self, tag, Authentication, TxStatus};
use pgherd_wire::frontend;
use pgherd_wire::md5::md5_salted_response;
use pgherd_wire::scram::{ScramClient, ScramCredential, SCRAM_SHA_256};
use pgherd_wire::startup::{self, CancelKey};
use pgherd_wire::PgError;
use rustls::pki_types::ServerName;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpStream, UnixStream};
use tokio::time::Instant;

use crate::error::{ServerError, ServerErrorKind};
use crate::msgio::{read_message, write_flush, ReadError};
use crate::relay::params::{Residue, BASELINE};
use crate::relay::statements::ServerStatements;
use crate::stream::Stream;
use crate::unix_socket::UnixSocket;

/// Messages from servers pgherd reads whole (everything but rows and COPY data, which stream)
/// are refused beyond this size.
pub const MAX_SERVER_MESSAGE_BYTES: usize = 1 << 30;

/// How pgherd proves who it is to a server, in order of preference.
#[derive(Clone, Default)]
pub struct ServerCredentials {
    pub password: Option<String>,
    /// SCRAM keys recovered from a client's proof (passthrough).
    pub scram_keys: Option<ScramCredential>,
    /// A stored md5 hash, enough to answer an md5 challenge.
    pub md5_hash: Option<String>,
}

impl std::fmt::Debug for ServerCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerCredentials")
            .field("password", &self.password.is_some())
            .field("scram_keys", &self.scram_keys.is_some())
            .field("md5_hash", &self.md5_hash.is_some())
            .finish()
    }
}

/// Everything needed to open one server connection.
pub struct ConnectSpec<'a> {
    pub node: &'a str,
    pub host: &'a str,
    pub port: u16,
    pub user: &'a str,
    pub database: &'a str,
    pub credentials: &'a ServerCredentials,
    pub tls_mode: ServerTlsMode,
    pub tls: Option<&'a tokio_rustls::TlsConnector>,
    pub timeout: Duration,
    /// A logical replication connection to `database` (`replication=database`), for the
    /// result cache's decoding of the WAL.
    pub replication: bool,
    /// The node's Unix-domain socket directory: connect there instead of `host`.
    pub socket_dir: Option<&'a Path>,
}

/// Where a server connection goes: a TCP address, or the path of a Unix-domain socket. `Copy`:
/// a session's cancel target is set on every transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerAddr {
    Tcp(SocketAddr),
    Unix(&'static Path),
}

impl ServerAddr {
    /// The address of a Unix-domain socket. Its path is kept for the life of the process, once
    /// per path: there is one per node's socket, and reloads name the same again.
    pub fn unix(path: &Path) -> ServerAddr {
        static PATHS: parking_lot::Mutex<Vec<&'static Path>> = parking_lot::Mutex::new(Vec::new());
        let mut paths = PATHS.lock();
        if let Some(kept) = paths.iter().find(|kept| **kept == path) {
            return ServerAddr::Unix(kept);
        }
        let kept: &'static Path = Box::leak(path.to_owned().into_boxed_path());
        paths.push(kept);
        ServerAddr::Unix(kept)
    }
}

impl std::fmt::Display for ServerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServerAddr::Tcp(addr) => write!(f, "{addr}"),
            ServerAddr::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The socket PostgreSQL listens on for `port` in `dir`, named as libpq names it.
pub fn socket_path(dir: &Path, port: u16) -> PathBuf {
    dir.join(format!(".s.PGSQL.{port}"))
}

/// An established, authenticated server connection.
pub struct ServerConn {
    pub id: u64,
    pub stream: Stream,
    pub node: String,
    pub peer: ServerAddr,
    /// The server backend's own cancel key.
    pub cancel_key: CancelKey,
    /// ParameterStatus values the server reported at login.
    pub reported: Vec<(String, String)>,
    /// Fingerprint of the session settings this connection carries (see `relay::params`).
    pub params_fp: u64,
    /// What the last client's transactions left that settings do not cover.
    pub residue: Residue,
    pub statements: ServerStatements,
    pub created_at: Instant,
    pub last_used: Instant,
    pub tx_status: TxStatus,
    /// Bytes read from the server not yet relayed.
    pub read_buf: BytesMut,
    /// Bytes for the server not yet written.
    pub write_buf: BytesMut,
}

impl std::fmt::Debug for ServerConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConn")
            .field("id", &self.id)
            .field("node", &self.node)
            .field("backend_pid", &self.cancel_key.process_id)
            .finish()
    }
}

fn io_err(node: &str) -> impl Fn(io::Error) -> ServerError + '_ {
    move |e| ServerError::new(node, ServerErrorKind::Io(e))
}

pub(crate) fn read_err(node: &str, e: ReadError) -> ServerError {
    let kind = match e {
        ReadError::Eof => ServerErrorKind::Closed(None),
        ReadError::Io(e) => ServerErrorKind::Io(e),
        ReadError::Wire(e) => ServerErrorKind::Protocol(e),
    };
    ServerError::new(node, kind)
}

/// Opens a connection and logs in; bounded by `spec.timeout` as a whole.
pub async fn connect(
    spec: &ConnectSpec<'_>,
    id: u64,
    statement_capacity: usize,
) -> Result<ServerConn, ServerError> {
    match tokio::time::timeout(spec.timeout, connect_inner(spec, id, statement_capacity)).await {
        Ok(result) => result,
        Err(_) => Err(ServerError::new(spec.node, ServerErrorKind::ConnectTimeout)),
    }
}

async fn connect_inner(
    spec: &ConnectSpec<'_>,
    id: u64,
    statement_capacity: usize,
) -> Result<ServerConn, ServerError> {
    let node = spec.node;
    let (mut stream, peer) = open_stream(spec).await?;

    let mut out = BytesMut::with_capacity(256);
    let mut params = vec![("user", spec.user), ("database", spec.database)];
    if spec.replication {
        params.push(("replication", "database"));
    }
    startup::encode_startup(&mut out, params)
        .map_err(|e| ServerError::new(node, ServerErrorKind::Protocol(e)))?;
    write_flush(&mut stream, &out).await.map_err(io_err(node))?;

    let mut buf = BytesMut::with_capacity(8 << 10);
    authenticate(&mut stream, &mut buf, spec).await?;

    let mut reported = Vec::new();
    let mut cancel_key = CancelKey {
        process_id: 0,
        secret_key: 0,
    };
    loop {
        let (t, body) = read_message(&mut stream, &mut buf, MAX_SERVER_MESSAGE_BYTES)
            .await
            .map_err(|e| read_err(node, e))?;
        let protocol = |e| ServerError::new(node, ServerErrorKind::Protocol(e));
        match t {
            tag::PARAMETER_STATUS => {
                let p = backend::ParameterStatus::parse(&body).map_err(protocol)?;
                reported.push((p.name.to_owned(), p.value.to_owned()));
            }
            tag::BACKEND_KEY_DATA => {
                cancel_key = backend::parse_backend_key_data(&body).map_err(protocol)?
            }
            tag::READY_FOR_QUERY => {
                let status = backend::parse_ready_for_query(&body).map_err(protocol)?;
                let now = Instant::now();
                return Ok(ServerConn {
                    id,
                    stream,
                    node: node.to_owned(),
                    peer,
                    cancel_key,
                    reported,
                    params_fp: BASELINE,
                    residue: Residue::default(),
                    statements: ServerStatements::new(statement_capacity),
                    created_at: now,
                    last_used: now,
                    tx_status: status,
                    read_buf: buf,
                    write_buf: BytesMut::new(),
                });
            }
            tag::ERROR_RESPONSE => {
                let err = PgError::parse(&body).map_err(protocol)?;
                return Err(ServerError::new(node, ServerErrorKind::Rejected(err)));
            }
            tag::NOTICE_RESPONSE | tag::NEGOTIATE_PROTOCOL_VERSION => {}
            other => {
                return Err(ServerError::new(
                    node,
                    ServerErrorKind::Unexpected(format!(
                        "message {} during startup",
                        pgherd_wire::error::tag_name(other)
                    )),
                ))
            }
        }
    }
}

/// The connection's transport: the node's Unix-domain socket when it has a `socket_dir`
/// (no TLS there: its bytes never leave the machine, and PostgreSQL refuses TLS on it), TCP
/// with TLS as configured otherwise.
async fn open_stream(spec: &ConnectSpec<'_>) -> Result<(Stream, ServerAddr), ServerError> {
    let node = spec.node;
    if let Some(dir) = spec.socket_dir {
        let path = socket_path(dir, spec.port);
        let connected = UnixStream::connect(&path).await;
        let unix = connected.and_then(UnixSocket::from_tokio).map_err(|e| {
            let e = io::Error::new(e.kind(), format!("{}: {e}", path.display()));
            ServerError::new(node, ServerErrorKind::Connect(e))
        })?;
        return Ok((Stream::Unix(unix), ServerAddr::unix(&path)));
    }
    let tcp = TcpStream::connect((spec.host, spec.port))
        .await
        .map_err(|e| ServerError::new(node, ServerErrorKind::Connect(e)))?;
    let peer = tcp.peer_addr().map_err(io_err(node))?;
    tcp.set_nodelay(true).map_err(io_err(node))?;
    set_keepalive(&tcp);
    Ok((negotiate_tls(tcp, spec).await?, ServerAddr::Tcp(peer)))
}

fn set_keepalive(tcp: &TcpStream) {
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10));
    // Best effort: a socket without keepalive still works, dead peers are just found later.
    let _ = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive);
}

async fn negotiate_tls(mut tcp: TcpStream, spec: &ConnectSpec<'_>) -> Result<Stream, ServerError> {
    let node = spec.node;
    let Some(connector) = spec.tls else {
        return Ok(Stream::Plain(tcp));
    };
    let mut request = BytesMut::with_capacity(8);
    startup::encode_ssl_request(&mut request);
    write_flush(&mut tcp, &request)
        .await
        .map_err(io_err(node))?;
    let answer = tcp.read_u8().await.map_err(io_err(node))?;
    match answer {
        b'S' => {
            let name = ServerName::try_from(spec.host.to_owned()).map_err(|e| {
                ServerError::new(node, ServerErrorKind::Tls(format!("bad host name: {e}")))
            })?;
            let tls = connector
                .connect(name, tcp)
                .await
                .map_err(|e| ServerError::new(node, ServerErrorKind::Tls(e.to_string())))?;
            Ok(Stream::Tls(Box::new(tokio_rustls::TlsStream::Client(tls))))
        }
        b'N' if spec.tls_mode == ServerTlsMode::Prefer => Ok(Stream::Plain(tcp)),
        b'N' => Err(ServerError::new(
            node,
            ServerErrorKind::Tls("the server does not accept TLS connections".into()),
        )),
        other => Err(ServerError::new(
            node,
            ServerErrorKind::Unexpected(format!("answer {other:#04x} to SSLRequest")),
        )),
    }
}

async fn authenticate(
    stream: &mut Stream,
    buf: &mut BytesMut,
    spec: &ConnectSpec<'_>,
) -> Result<(), ServerError> {
    let node = spec.node;
    let creds = spec.credentials;
    let no_creds = |what: &str| {
        ServerError::new(
            node,
            ServerErrorKind::NoCredentials(format!(
                "the server asks for {what} for user \"{}\" and pgherd holds no usable credential \
                 (set users.{}.server_password, or log in with SCRAM so pgherd can pass the proof through)",
                spec.user, spec.user
            )),
        )
    };
    let protocol = |e| ServerError::new(node, ServerErrorKind::Protocol(e));
    let mut out = BytesMut::with_capacity(512);
    let mut scram: Option<ScramClient> = None;
    let mut scram_final = None;
    loop {
        let (t, body) = read_message(stream, buf, MAX_SERVER_MESSAGE_BYTES)
            .await
            .map_err(|e| read_err(node, e))?;
        if t == tag::ERROR_RESPONSE {
            let err = PgError::parse(&body).map_err(protocol)?;
            return Err(ServerError::new(node, ServerErrorKind::Rejected(err)));
        }
        if t != tag::AUTHENTICATION {
            return Err(ServerError::new(
                node,
                ServerErrorKind::Unexpected(format!(
                    "message {} during authentication",
                    pgherd_wire::error::tag_name(t)
                )),
            ));
        }
        out.clear();
        match Authentication::parse(&body).map_err(protocol)? {
            Authentication::Ok => return Ok(()),
            Authentication::CleartextPassword => {
                let password = creds
                    .password
                    .as_deref()
                    .ok_or_else(|| no_creds("a password"))?;
                frontend::encode_password(&mut out, password.as_bytes()).map_err(protocol)?;
            }
            Authentication::Md5Password { salt } => {
                let hash = match (&creds.password, &creds.md5_hash) {
                    (Some(p), _) => pgherd_wire::md5::md5_password_hash(spec.user, p),
                    (None, Some(h)) => h.clone(),
                    (None, None) => return Err(no_creds("an md5 password")),
                };
                let response = md5_salted_response(&hash, salt);
                frontend::encode_password(&mut out, response.as_bytes()).map_err(protocol)?;
            }
            Authentication::Sasl { mechanisms } => {
                if !mechanisms.contains(&SCRAM_SHA_256) {
                    return Err(ServerError::new(
                        node,
                        ServerErrorKind::Unexpected(format!(
                            "server offers only SASL mechanisms {mechanisms:?}"
                        )),
                    ));
                }
                let credential = match (&creds.password, &creds.scram_keys) {
                    (Some(p), _) => ScramCredential::Password(p.clone()),
                    (None, Some(keys)) => keys.clone(),
                    (None, None) => return Err(no_creds("SCRAM-SHA-256 authentication")),
                };
                let (client, first) = ScramClient::new(credential, &rand::random::<[u8; 18]>());
                scram = Some(client);
                frontend::encode_sasl_initial_response(&mut out, SCRAM_SHA_256, &first)
                    .map_err(protocol)?;
            }
            Authentication::SaslContinue { data } => {
                let client = scram.take().ok_or_else(|| {
                    ServerError::new(
                        node,
                        ServerErrorKind::Unexpected("SASL continue before SASL start".into()),
                    )
                })?;
                let (next, client_final) = client.server_first(data).map_err(|e| {
                    ServerError::new(node, ServerErrorKind::NoCredentials(e.to_string()))
                })?;
                scram_final = Some(next);
                frontend::encode_sasl_response(&mut out, &client_final).map_err(protocol)?;
            }
            Authentication::SaslFinal { data } => {
                let waiting = scram_final.take().ok_or_else(|| {
                    ServerError::new(
                        node,
                        ServerErrorKind::Unexpected("SASL final out of order".into()),
                    )
                })?;
                waiting.server_final(data).map_err(|e| {
                    ServerError::new(
                        node,
                        ServerErrorKind::Unexpected(format!(
                            "the server failed SCRAM verification: {e}"
                        )),
                    )
                })?;
                continue;
            }
            Authentication::Unsupported { code } => {
                return Err(ServerError::new(
                    node,
                    ServerErrorKind::Unexpected(format!(
                    "server asks for authentication method {code}, which pgherd does not support"
                )),
                ))
            }
        }
        write_flush(stream, &out).await.map_err(io_err(node))?;
    }
}

/// The result of a management query: rows of text values.
pub type Rows = Vec<Vec<Option<String>>>;

impl ServerConn {
    /// Runs one statement with text parameters through the extended protocol and returns its
    /// rows. For pgherd's own queries (health checks, auth_query), never for client traffic.
    pub async fn query(&mut self, sql: &str, params: &[&str]) -> Result<Rows, QueryError> {
        let mut out = BytesMut::with_capacity(128 + sql.len());
        let encode = |out: &mut BytesMut| -> Result<(), pgherd_wire::WireError> {
            frontend::encode_parse(out, b"", sql.as_bytes(), &[0, 0])?;
            let mut rest = BytesMut::new();
            rest.put_i16(0); // all parameters in text
            rest.put_i16(params.len() as i16);
            for p in params {
                rest.put_i32(p.len() as i32);
                rest.put_slice(p.as_bytes());
            }
            rest.put_i16(0); // results in text
            frontend::encode_bind(out, b"", b"", &rest)?;
            frontend::encode_execute(out, b"", 0)?;
            frontend::encode_sync(out);
            Ok(())
        };
        encode(&mut out).map_err(|e| {
            QueryError::Server(ServerError::new(&self.node, ServerErrorKind::Protocol(e)))
        })?;
        self.run(&out, &mut Vec::new()).await
    }

    /// Runs a simple query (possibly several statements) and returns the rows of all of them.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Rows, QueryError> {
        self.simple_query_reporting(sql, &mut Vec::new()).await
    }

    /// [`Self::simple_query`], collecting the parameters the server reports meanwhile (its
    /// normalised values of settings the statements changed).
    pub async fn simple_query_reporting(
        &mut self,
        sql: &str,
        reported: &mut Vec<(String, String)>,
    ) -> Result<Rows, QueryError> {
        let mut out = BytesMut::with_capacity(8 + sql.len());
        frontend::encode_query(&mut out, sql.as_bytes()).map_err(|e| {
            QueryError::Server(ServerError::new(&self.node, ServerErrorKind::Protocol(e)))
        })?;
        self.run(&out, reported).await
    }

    async fn run(
        &mut self,
        request: &[u8],
        reported: &mut Vec<(String, String)>,
    ) -> Result<Rows, QueryError> {
        let node = self.node.clone();
        write_flush(&mut self.stream, request)
            .await
            .map_err(|e| QueryError::Server(ServerError::new(&node, ServerErrorKind::Io(e))))?;
        let mut rows = Vec::new();
        let mut failure = None;
        loop {
            let (t, body) = read_message(
                &mut self.stream,
                &mut self.read_buf,
                MAX_SERVER_MESSAGE_BYTES,
            )
            .await
            .map_err(|e| QueryError::Server(read_err(&node, e)))?;
            let protocol =
                |e| QueryError::Server(ServerError::new(&node, ServerErrorKind::Protocol(e)));
            match t {
                tag::DATA_ROW => {
                    let values = backend::parse_data_row(&body).map_err(protocol)?;
                    rows.push(
                        values
                            .into_iter()
                            .map(|v| v.map(|b| String::from_utf8_lossy(b).into_owned()))
                            .collect(),
                    );
                }
                tag::ERROR_RESPONSE => failure = Some(PgError::parse(&body).map_err(protocol)?),
                tag::PARAMETER_STATUS => {
                    let p = backend::ParameterStatus::parse(&body).map_err(protocol)?;
                    reported.retain(|(name, _)| name != p.name);
                    reported.push((p.name.to_owned(), p.value.to_owned()));
                }
                tag::READY_FOR_QUERY => {
                    self.tx_status = backend::parse_ready_for_query(&body).map_err(protocol)?;
                    return match failure {
                        Some(e) => Err(QueryError::Sql(e)),
                        None => Ok(rows),
                    };
                }
                _ => {}
            }
        }
    }
}

#[derive(Debug)]
pub enum QueryError {
    /// The statement failed; the connection is still usable.
    Sql(PgError),
    /// The connection failed.
    Server(ServerError),
}

impl std::fmt::Display for QueryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            QueryError::Sql(e) => write!(f, "{e}"),
            QueryError::Server(e) => write!(f, "{e}"),
        }
    }
}

/// Asks the server to stop what `conn`'s backend runs, in a task of its own, for a connection
/// pgherd closes while its answer is still coming. PostgreSQL notices a closed client only
/// when it next writes to it: until then the statement would keep running, holding its locks
/// and a connection slot the pool already counts as free.
pub fn cancel_before_closing(conn: &ServerConn, timeout: Duration) {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let (peer, key, server, node) = (conn.peer, conn.cancel_key, conn.id, conn.node.clone());
    runtime.spawn(async move {
        match send_cancel(&peer, key, timeout).await {
            Ok(()) => tracing::info!(server, node = %node, "cancel sent to a server connection closed mid-statement"),
            Err(e) => tracing::warn!(server, node = %node, error = %e, "could not cancel what a closed server connection ran"),
        }
    });
}

/// Sends a CancelRequest for `key` to the server at `peer` and waits until the server has
/// taken it (it closes the connection once it has signalled the backend).
pub async fn send_cancel(peer: &ServerAddr, key: CancelKey, timeout: Duration) -> io::Result<()> {
    let attempt = async {
        let mut stream = match peer {
            ServerAddr::Tcp(addr) => Stream::Plain(TcpStream::connect(addr).await?),
            ServerAddr::Unix(path) => {
                Stream::Unix(UnixSocket::from_tokio(UnixStream::connect(path).await?)?)
            }
        };
        let mut request = BytesMut::with_capacity(16);
        startup::encode_cancel_request(&mut request, key);
        write_flush(&mut stream, &request).await?;
        let mut sink = [0u8; 64];
        while stream.read(&mut sink).await? > 0 {}
        Ok(())
    };
    tokio::time::timeout(timeout, attempt)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "cancel request timed out"))?
}
