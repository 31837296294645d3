//! A client's startup settings, applied on a server before its login completes, as PostgreSQL
//! applies them at connection start: a setting the server refuses (an unknown parameter, a bad
//! value) fails the login with the server's error, and what the server reports back (its
//! normalised values: `UTF8` for `utf8`) is what the client is told. The server keeps the
//! settings, so the client's first transaction usually finds them there. Settings a server of
//! the pool accepted before are not asked about again, unless the client keeps the server
//! (session mode).

use std::sync::Arc;

use pgherd_wire::{PgError, Severity, SqlState};

use crate::app::App;
use crate::error::{Disconnect, ServerError};
use crate::pool::{AcquireError, Pool, ReportedParams};
use crate::relay::params::{SessionParams, BASELINE, RESET_SQL, UNKNOWN};
use crate::server::{QueryError, ServerConn};

/// What a login learned from a server about its settings.
pub struct Checked {
    /// The server's values of the reported parameters the settings changed.
    pub reported: Arc<ReportedParams>,
    /// The server connection, for a client that keeps one for its whole session.
    pub server: Option<Box<ServerConn>>,
}

/// A login that a server of its pool failed, and whether waiting may help: the node could
/// not be reached or is starting or stopping ([`ServerError::is_transient`]), rather than
/// refusing this user, database or setting.
pub struct LoginFailure {
    pub end: Disconnect,
    pub transient: bool,
}

impl LoginFailure {
    /// The server's failure, told to the client as the login's (FATAL).
    pub fn server(e: &ServerError) -> Self {
        let mut err = e.to_client_error();
        err.severity = Severity::Fatal;
        LoginFailure::new(err, e.is_transient())
    }

    fn new(err: PgError, transient: bool) -> Self {
        LoginFailure {
            end: Disconnect::refused(err),
            transient,
        }
    }
}

/// Checks `settings` on a server of `pool`; `keep` keeps that server for the client.
pub async fn check(
    app: &Arc<App>,
    pool: &Arc<Pool>,
    settings: &SessionParams,
    keep: bool,
) -> Result<Checked, LoginFailure> {
    let cached = pool.validated_settings(settings.fingerprint());
    if !keep && (settings.is_empty() || cached.is_some()) {
        return Ok(Checked {
            reported: cached.unwrap_or_default(),
            server: None,
        });
    }
    let mut conn = acquire(app, pool).await?;
    match apply(&mut conn, settings).await {
        Ok(reported) => {
            let reported = match cached {
                // The server already carried these settings: what it reported then.
                Some(cached) if reported.is_empty() => cached,
                _ => Arc::new(reported),
            };
            if !settings.is_empty() {
                pool.remember_validated_settings(settings.fingerprint(), (*reported).clone());
            }
            if keep {
                return Ok(Checked {
                    reported,
                    server: Some(conn),
                });
            }
            pool.release(conn, true);
            Ok(Checked {
                reported,
                server: None,
            })
        }
        Err((reusable, e)) => {
            pool.release(conn, reusable);
            Err(e)
        }
    }
}

/// Applies the settings on `conn` (reset first if it carries someone else's), collecting what
/// the server reports. The error says whether the connection can still be used.
async fn apply(
    conn: &mut ServerConn,
    settings: &SessionParams,
) -> Result<ReportedParams, (bool, LoginFailure)> {
    let fingerprint = settings.fingerprint();
    if conn.params_fp == fingerprint {
        return Ok(Vec::new());
    }
    let apply = settings.apply_sql();
    let sql = match (conn.params_fp == BASELINE, apply) {
        (true, Some(apply)) => apply,
        (false, Some(apply)) => format!("{RESET_SQL}; {apply}"),
        (false, None) => RESET_SQL.to_owned(),
        (true, None) => return Ok(Vec::new()),
    };
    let mut reported = Vec::new();
    match conn.simple_query_reporting(&sql, &mut reported).await {
        Ok(_) => {
            conn.params_fp = fingerprint;
            Ok(reported)
        }
        Err(QueryError::Sql(mut e)) => {
            // The statements ran in one implicit transaction: nothing of them stayed.
            conn.params_fp = UNKNOWN;
            e.severity = Severity::Fatal;
            Err((true, LoginFailure::new(e, false)))
        }
        Err(QueryError::Server(e)) => Err((false, LoginFailure::server(&e))),
    }
}

async fn acquire(app: &Arc<App>, pool: &Arc<Pool>) -> Result<Box<ServerConn>, LoginFailure> {
    match pool.acquire(&app.connect_context()).await {
        Ok(conn) => Ok(conn),
        Err(AcquireError::Server(e)) => Err(LoginFailure::server(&e)),
        Err(AcquireError::WaitTimeout { waited, .. }) => Err(LoginFailure::new(
            PgError::fatal(
                SqlState::TOO_MANY_CONNECTIONS,
                format!(
                    "no server connection became free within {} ms for the login",
                    waited.as_millis()
                ),
            ),
            false,
        )),
        // The pool was replaced (its node left or came back): another may serve.
        Err(AcquireError::Closed) => Err(LoginFailure::new(
            PgError::fatal(
                SqlState::CANNOT_CONNECT_NOW,
                "the pool was closed during login; retry",
            ),
            true,
        )),
    }
}
