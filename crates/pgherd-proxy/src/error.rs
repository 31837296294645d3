//! The proxy's errors. [`Disconnect`] is the closed set of reasons a client connection ends; it
//! is logged and, when the client can still hear it, sent as an ErrorResponse. [`ServerError`]
//! records what failed on the server side, on which node, and whether retrying is safe.

use std::fmt;
use std::io;

use pgherd_wire::{PgError, SqlState, WireError};

#[derive(Debug)]
pub enum ServerErrorKind {
    Connect(io::Error),
    ConnectTimeout,
    Tls(String),
    /// The server refused the login (wrong credentials, unknown database, too many connections).
    Rejected(PgError),
    /// pgherd holds nothing it could log in with.
    NoCredentials(String),
    Protocol(WireError),
    /// The server sent something valid but out of place.
    Unexpected(String),
    Io(io::Error),
    /// The server closed the connection; its last words, if it said any, are kept.
    Closed(Option<PgError>),
    Timeout,
}

#[derive(Debug)]
pub struct ServerError {
    pub node: String,
    pub kind: ServerErrorKind,
}

impl ServerError {
    pub fn new(node: &str, kind: ServerErrorKind) -> Self {
        ServerError {
            node: node.to_owned(),
            kind,
        }
    }

    /// The node did not answer or is going down or starting up: trying again later, or on
    /// another node, may work. A refused login or a protocol error will not change by waiting.
    pub fn is_transient(&self) -> bool {
        match &self.kind {
            ServerErrorKind::Connect(_)
            | ServerErrorKind::ConnectTimeout
            | ServerErrorKind::Io(_)
            | ServerErrorKind::Timeout
            | ServerErrorKind::Closed(None) => true,
            // Class 57P: admin or crash shutdown, or not accepting connections yet.
            ServerErrorKind::Rejected(e) | ServerErrorKind::Closed(Some(e)) => {
                e.code.code().starts_with("57P")
            }
            ServerErrorKind::Tls(_)
            | ServerErrorKind::NoCredentials(_)
            | ServerErrorKind::Protocol(_)
            | ServerErrorKind::Unexpected(_) => false,
        }
    }

    /// What the client sees.
    pub fn to_client_error(&self) -> PgError {
        match &self.kind {
            // The server's own answer is the most precise thing to pass on.
            ServerErrorKind::Rejected(e) => PgError::error(e.code, e.message.clone()),
            ServerErrorKind::Closed(Some(e)) => PgError::error(e.code, e.message.clone())
                .with_detail(format!("node {} closed the connection", self.node)),
            ServerErrorKind::NoCredentials(_) => PgError::error(
                SqlState::INVALID_AUTHORIZATION_SPECIFICATION,
                self.to_string(),
            ),
            ServerErrorKind::Connect(_)
            | ServerErrorKind::ConnectTimeout
            | ServerErrorKind::Tls(_) => PgError::error(
                SqlState::SQLCLIENT_UNABLE_TO_ESTABLISH_SQLCONNECTION,
                self.to_string(),
            ),
            _ => PgError::error(SqlState::CONNECTION_FAILURE, self.to_string()),
        }
    }
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let node = &self.node;
        match &self.kind {
            ServerErrorKind::Connect(e) => write!(f, "cannot connect to node {node}: {e}"),
            ServerErrorKind::ConnectTimeout => write!(f, "timed out connecting to node {node}"),
            ServerErrorKind::Tls(e) => write!(f, "TLS with node {node} failed: {e}"),
            ServerErrorKind::Rejected(e) => write!(f, "node {node} refused the login: {e}"),
            ServerErrorKind::NoCredentials(why) => {
                write!(f, "pgherd cannot log in to node {node}: {why}")
            }
            ServerErrorKind::Protocol(e) => write!(f, "node {node} broke the protocol: {e}"),
            ServerErrorKind::Unexpected(what) => {
                write!(f, "unexpected message from node {node}: {what}")
            }
            ServerErrorKind::Io(e) => write!(f, "connection to node {node} failed: {e}"),
            ServerErrorKind::Closed(Some(e)) => {
                write!(f, "node {node} closed the connection: {e}")
            }
            ServerErrorKind::Closed(None) => {
                write!(f, "node {node} closed the connection unexpectedly")
            }
            ServerErrorKind::Timeout => write!(f, "node {node} did not answer in time"),
        }
    }
}

impl std::error::Error for ServerError {}

/// Why a client connection ended.
#[derive(Debug)]
pub enum Disconnect {
    /// The client sent Terminate.
    Terminated,
    /// The client closed its socket.
    ClientClosed,
    ClientIo(io::Error),
    /// The client broke the protocol; it is told so with SQLSTATE 08P01.
    Protocol(WireError),
    /// Refused before or during login (authentication, hba, unknown database, limits).
    /// Boxed, as `ServerLost`'s: a disconnect sits in every session task's state.
    Refused(Box<PgError>),
    LoginTimeout,
    IdleTimeout,
    Shutdown,
    /// pgherd is being upgraded and the session went to the new process, its connection
    /// with it: nothing to tell the client, whose session carries on.
    Moved,
    /// Not an end: the client was idle long enough to be parked (`client/parked.rs`), its
    /// session kept without a task until it speaks again.
    Parked,
    /// pgherd is being upgraded and the session cannot move to the new process (the reason):
    /// the client is told to reconnect.
    CannotMove(&'static str),
    /// In session mode the client's server connection is its session; losing it ends both.
    ServerLost(Box<ServerError>),
    /// Closed by an operator through the admin console.
    Killed(String),
    /// Cancel requests, TLS-only probes and the like end after one exchange.
    Done(&'static str),
    /// A cancel request whose key matches no client (a wrong secret, or no such client).
    CancelRefused,
    /// Still logging in when the connection limit was reached: the connection that had been
    /// logging in longest made room for a new one.
    LoginEvicted,
}

impl Disconnect {
    pub fn refused(e: PgError) -> Disconnect {
        Disconnect::Refused(Box::new(e))
    }

    /// The error to send before closing, if the client should be told.
    pub fn client_error(&self) -> Option<PgError> {
        match self {
            Disconnect::Protocol(e) => Some(PgError::from(e.clone())),
            Disconnect::Refused(e) => Some((**e).clone()),
            Disconnect::LoginTimeout => Some(PgError::fatal(
                SqlState::PROTOCOL_VIOLATION,
                "login timeout: the client did not complete authentication in time",
            )),
            Disconnect::IdleTimeout => Some(PgError::fatal(
                SqlState::ADMIN_SHUTDOWN,
                "terminating connection due to client idle timeout",
            )),
            Disconnect::Shutdown => Some(PgError::fatal(
                SqlState::ADMIN_SHUTDOWN,
                "terminating connection because pgherd is shutting down",
            )),
            Disconnect::CannotMove(why) => Some(
                PgError::fatal(
                    SqlState::ADMIN_SHUTDOWN,
                    "terminating connection because pgherd is being upgraded",
                )
                .with_detail(format!(
                    "this session cannot move to the new pgherd process: {why}"
                ))
                .with_hint("reconnect: the new process accepts connections"),
            ),
            Disconnect::ServerLost(e) => {
                let mut err = e.to_client_error();
                err.severity = pgherd_wire::Severity::Fatal;
                Some(err)
            }
            Disconnect::Killed(why) => Some(PgError::fatal(
                SqlState::ADMIN_SHUTDOWN,
                format!("terminating connection due to administrator command: {why}"),
            )),
            Disconnect::LoginEvicted => Some(
                PgError::fatal(SqlState::TOO_MANY_CONNECTIONS, "sorry, too many clients already")
                    .with_detail("the connection limit was reached while this connection was still logging in, and it had been logging in longest"),
            ),
            Disconnect::Terminated
            | Disconnect::ClientClosed
            | Disconnect::ClientIo(_)
            | Disconnect::Done(_)
            | Disconnect::Moved
            | Disconnect::Parked
            | Disconnect::CancelRefused => None,
        }
    }

    /// A wrong password, a refused certificate or host, a cancel request with a wrong key:
    /// what guessing looks like, slowed down per address.
    pub fn is_guess(&self) -> bool {
        match self {
            Disconnect::Refused(e) => e.code.class() == "28",
            Disconnect::CancelRefused => true,
            _ => false,
        }
    }

    /// True for ends that are part of normal operation and are logged at debug level.
    pub fn is_routine(&self) -> bool {
        matches!(
            self,
            Disconnect::Terminated
                | Disconnect::ClientClosed
                | Disconnect::Done(_)
                | Disconnect::Moved
                | Disconnect::Parked
        )
    }
}

impl fmt::Display for Disconnect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Disconnect::Terminated => f.write_str("client sent Terminate"),
            Disconnect::ClientClosed => f.write_str("client closed the connection"),
            Disconnect::ClientIo(e) => write!(f, "client connection failed: {e}"),
            Disconnect::Protocol(e) => write!(f, "protocol violation by client: {e}"),
            Disconnect::Refused(e) => write!(f, "refused: {e}"),
            Disconnect::LoginTimeout => f.write_str("login timeout"),
            Disconnect::IdleTimeout => f.write_str("client idle timeout"),
            Disconnect::Shutdown => f.write_str("pgherd is shutting down"),
            Disconnect::Moved => f.write_str("moved to the new pgherd process (upgrade)"),
            Disconnect::Parked => f.write_str("parked while idle"),
            Disconnect::CannotMove(why) => write!(
                f,
                "pgherd is being upgraded and the session cannot move: {why}"
            ),
            Disconnect::ServerLost(e) => write!(f, "server connection lost: {e}"),
            Disconnect::Killed(why) => write!(f, "killed by administrator: {why}"),
            Disconnect::Done(what) => f.write_str(what),
            Disconnect::CancelRefused => f.write_str("cancel request with a wrong or unknown key"),
            Disconnect::LoginEvicted => {
                f.write_str("still logging in when the connection limit was reached")
            }
        }
    }
}

impl From<WireError> for Disconnect {
    fn from(e: WireError) -> Self {
        Disconnect::Protocol(e)
    }
}

/// Maps a failed client read or write: a reset or broken pipe means the client left.
pub fn client_io(e: io::Error) -> Disconnect {
    match e.kind() {
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionAborted => Disconnect::ClientClosed,
        _ => Disconnect::ClientIo(e),
    }
}
