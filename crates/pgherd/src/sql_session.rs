//! One way for pgherd's commands to ask a node a question, whichever way they reached it:
//! pgherd's own session to a cluster node ([`ServerConn`], as the `[cluster]` user) or a
//! subscriber's session by its own connection string ([`tokio_postgres::Client`]). What is
//! asked the same way of both (a set's marker, a first value) is written once on top of it.

use pgherd_proxy::server::{QueryError, ServerConn};

/// A statement's rows, each value as text.
pub(crate) type Rows = Vec<Vec<Option<String>>>;

/// A statement's failure on a node, with its SQLSTATE when the server gave one.
#[derive(Debug)]
pub(crate) struct QueryFailure {
    sqlstate: Option<String>,
    message: String,
}

impl std::fmt::Display for QueryFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl QueryFailure {
    /// A failure found in what the server answered (no SQLSTATE of its own).
    pub(crate) fn new(message: impl Into<String>) -> Self {
        QueryFailure {
            sqlstate: None,
            message: message.into(),
        }
    }

    pub(crate) fn is(&self, sqlstate: &str) -> bool {
        self.sqlstate.as_deref() == Some(sqlstate)
    }
}

impl From<QueryError> for QueryFailure {
    fn from(e: QueryError) -> Self {
        QueryFailure {
            sqlstate: match &e {
                QueryError::Sql(e) => Some(e.code.code().to_owned()),
                QueryError::Server(_) => None,
            },
            message: e.to_string(),
        }
    }
}

impl From<tokio_postgres::Error> for QueryFailure {
    fn from(e: tokio_postgres::Error) -> Self {
        QueryFailure {
            sqlstate: e.code().map(|c| c.code().to_owned()),
            message: pg_error(&e),
        }
    }
}

/// A session that runs simple-protocol statements.
pub(crate) trait SqlSession {
    async fn rows(&mut self, sql: &str) -> Result<Rows, QueryFailure>;
}

impl SqlSession for ServerConn {
    async fn rows(&mut self, sql: &str) -> Result<Rows, QueryFailure> {
        Ok(self.simple_query(sql).await?)
    }
}

impl SqlSession for &tokio_postgres::Client {
    async fn rows(&mut self, sql: &str) -> Result<Rows, QueryFailure> {
        Ok(client_rows(self, sql).await?)
    }
}

/// A statement's rows on a client's session, each value as text.
pub(crate) async fn client_rows(
    client: &tokio_postgres::Client,
    sql: &str,
) -> Result<Rows, tokio_postgres::Error> {
    Ok(client
        .simple_query(sql)
        .await?
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect())
}

/// The first row's first value.
pub(crate) fn first(rows: &[Vec<Option<String>>]) -> Option<String> {
    rows.first()?.first()?.clone()
}

/// A server's error with its SQLSTATE, or the connection's.
pub(crate) fn pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}
