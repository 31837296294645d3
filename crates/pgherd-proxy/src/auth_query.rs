//! `auth_query`: looking up users that are not in the config file in PostgreSQL itself, through
//! a small pool of connections made as the configured auth user on the primary.

use std::sync::Arc;

use pgherd_config::AuthQuery;

use crate::app::App;
use crate::server::QueryError;

/// The stored password of `user`: `None` if the query found no such user, `Some(None)` if the
/// user has no password.
pub async fn lookup(
    app: &Arc<App>,
    auth: &AuthQuery,
    user: &str,
) -> Result<Option<Option<String>>, String> {
    let node = app.nodes.writer().ok_or_else(|| {
        format!(
            "no primary node to run auth_query on ({})",
            app.nodes.describe_all()
        )
    })?;
    let pool = app.auth_pool(auth, &node);
    let mut conn = pool
        .acquire(&app.connect_context())
        .await
        .map_err(|e| format!("{e:?}"))?;
    let result = conn.query(&auth.query, &[user]).await;
    let reusable = !matches!(result, Err(QueryError::Server(_)));
    pool.release(conn, reusable);
    let rows = result.map_err(|e| e.to_string())?;
    match rows.as_slice() {
        [] => Ok(None),
        [row] => match row.as_slice() {
            [_, passwd, ..] => Ok(Some(passwd.clone())),
            _ => Err("auth_query must return two columns: the user name and its password".into()),
        },
        _ => Err(format!(
            "auth_query returned {} rows for one user",
            rows.len()
        )),
    }
}
