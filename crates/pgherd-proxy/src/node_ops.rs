//! What pgherd does on a node as its own user, for failover, switchover, rejoin and the
//! sharded endpoint's two-phase commit: SQL over a management connection, promotion (and what
//! a lost answer to it means), sealing a fenced node, re-pointing a replica, replication slots
//! and the `primary_conninfo` standbys stream with.

use std::time::Duration;

use pgherd_cluster::{conninfo_value, with_password};
use pgherd_config::{ClusterSettings, Config};

use pgherd_wire::PgError;

use crate::app::App;
use crate::monitor::{check_once, management_connection};
use crate::nodes::{NodeState, Nodes, Role};
use crate::pool::ConnectContext;

/// How long a node whose promotion answer was lost is watched for an answer.
const PROMOTE_SETTLE_MS: u64 = 15_000;

/// Promotes `node` with `pg_promote()` and checks that it accepts writes now. Whatever the
/// answer (it may be lost after the promotion happened), the node is asked what it is; this
/// also records it as a primary before its monitor's next check.
///
/// An answer lost with its connection says nothing of the promotion: the node may be
/// restarting (a crash of one of its processes restarts them all). It is then watched for up
/// to [`PROMOTE_SETTLE_MS`] until it answers, and, if it came back a standby and this instance
/// still may act for the cluster, asked once more, so that one dropped connection does not
/// leave the cluster without a primary.
pub(crate) async fn promote(app: &App, cluster: &Nodes, node: &NodeState) -> Result<(), String> {
    let config = app.config();
    let ctx = app.connect_context();
    let promote_sql = "SELECT pg_promote(true, 60)";
    let ask = || {
        ask_node(
            node,
            &config.cluster,
            &ctx,
            &config.cluster.database,
            promote_sql,
        )
    };
    let mut answer = ask().await;
    let mut conn = None;
    let settle_until = tokio::time::Instant::now() + Duration::from_millis(PROMOTE_SETTLE_MS);
    let mut asked_again = false;
    loop {
        let seen = check_once(node, &config.cluster, &ctx, &mut conn).await;
        let role = seen.as_ref().ok().map(|s| s.role);
        cluster.record(node, seen);
        if role == Some(Role::Primary) {
            return Ok(());
        }
        let lost = matches!(answer, Err(NodeSqlError::Lost(_)));
        if !lost || tokio::time::Instant::now() >= settle_until {
            break;
        }
        if role == Some(Role::Replica) {
            if asked_again || !app.may_act() {
                break;
            }
            tracing::warn!(node = node.name(), "the promotion's answer was lost and the node answers as a standby: promoting it again");
            asked_again = true;
            answer = ask().await;
            continue;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(match answer {
        Ok(rows) => format!(
            "{} was not promoted (pg_promote() answered {:?})",
            node.name(),
            first_value(&rows)
        ),
        Err(e) => format!(
            "{} was not promoted (pg_promote() failed: {e})",
            node.name()
        ),
    })
}

/// Makes a fenced node refuse writes and ends its client sessions; false if it does not
/// answer.
pub(crate) async fn seal(
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    node: &NodeState,
) -> bool {
    let statements = [
        "ALTER SYSTEM SET default_transaction_read_only = on",
        "SELECT pg_reload_conf()",
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
    ];
    for sql in statements {
        if let Err(e) = run_sql(node, cluster, ctx, sql).await {
            tracing::debug!(node = node.name(), error = %e, "fencing statement not applied (node unreachable)");
            return false;
        }
    }
    tracing::warn!(
        node = node.name(),
        "fenced node set read-only and its sessions ended"
    );
    true
}

/// Points `replica` at `primary`: its replication slot is created there first (slots are not
/// copied by promotion), then `primary_conninfo` is changed and reloaded; the replica follows
/// the new timeline (`recovery_target_timeline = 'latest'` is PostgreSQL's default).
pub(crate) async fn repoint(
    config: &Config,
    ctx: &ConnectContext,
    replica: &NodeState,
    primary: &NodeState,
) -> Result<(), String> {
    let cluster = &config.cluster;
    let slot = run_sql(replica, cluster, ctx, "SHOW primary_slot_name").await?;
    if let Some(slot) = first_value(&slot).filter(|s| !s.is_empty()) {
        create_slot(cluster, ctx, primary, slot).await?;
    }
    let conninfo = primary_conninfo(config, primary, replica.name());
    run_sql(
        replica,
        cluster,
        ctx,
        &format!(
            "ALTER SYSTEM SET primary_conninfo = {}",
            quote_literal(&conninfo)
        ),
    )
    .await?;
    run_sql(replica, cluster, ctx, "SELECT pg_reload_conf()").await?;
    tracing::warn!(
        node = replica.name(),
        primary = primary.name(),
        "replica re-pointed to the new primary"
    );
    Ok(())
}

/// Creates the physical replication slot `slot` on `primary` unless it exists.
pub(crate) async fn create_slot(
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    primary: &NodeState,
    slot: &str,
) -> Result<(), String> {
    run_sql(
        primary,
        cluster,
        ctx,
        &format!(
            "SELECT pg_create_physical_replication_slot({}) \
             WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = {})",
            quote_literal(slot),
            quote_literal(slot)
        ),
    )
    .await
    .map(|_| ())
}

/// How a standby named `standby` streams from `primary` (its name is its application_name,
/// the name synchronous_standby_names lists), as the replication role when there is one.
pub(crate) fn primary_conninfo(config: &Config, primary: &NodeState, standby: &str) -> String {
    let (user, password) = config.replication.standby_login(&config.cluster);
    with_password(&conninfo_as(primary, standby, user), password)
}

/// What the programs that rebuild a node (`pg_rewind`, and `pg_basebackup`, whose WAL stream
/// shows as `streaming` in `pg_stat_replication`) call themselves on its primary: a prefix
/// and the node's name. Not the node's own name: under that, a copy half made would count as
/// the node streaming, and the synchronous standbys would be set to wait for it (and a
/// failover to need it) while it is no standby at all. The health check leaves these out.
pub(crate) const REBUILD_APPLICATION_PREFIX: &str = "pgherd-rejoin ";

pub(crate) fn rebuild_application_name(node: &str) -> String {
    format!("{REBUILD_APPLICATION_PREFIX}{node}")
}

/// A connection to `primary` as `user`, named `application`, without a password (programs
/// get it from a password file).
pub(crate) fn conninfo_as(primary: &NodeState, application: &str, user: &str) -> String {
    format!(
        "host={} port={} user={} application_name={}",
        conninfo_value(&primary.config.host),
        primary.config.port,
        conninfo_value(user),
        conninfo_value(application)
    )
}

pub(crate) async fn run_sql(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    sql: &str,
) -> Result<crate::server::Rows, String> {
    run_sql_in(node, cluster, ctx, &cluster.database, sql).await
}

/// [`run_sql`] in `database`.
pub(crate) async fn run_sql_in(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    database: &str,
    sql: &str,
) -> Result<crate::server::Rows, String> {
    Ok(ask_node(node, cluster, ctx, database, sql).await?)
}

/// Why SQL pgherd ran on a node did not answer rows.
#[derive(Debug)]
pub(crate) enum NodeSqlError {
    /// The server answered with an error: the statement did not take effect.
    Refused(PgError),
    /// No connection, or it failed before an answer: the statement may have taken effect.
    Lost(String),
}

impl std::fmt::Display for NodeSqlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeSqlError::Refused(e) => write!(f, "{e}"),
            NodeSqlError::Lost(e) => f.write_str(e),
        }
    }
}

impl From<NodeSqlError> for String {
    fn from(e: NodeSqlError) -> String {
        e.to_string()
    }
}

/// [`run_sql_in`], saying whether the server refused the statement or its answer was lost.
pub(crate) async fn ask_node(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    database: &str,
    sql: &str,
) -> Result<crate::server::Rows, NodeSqlError> {
    let mut conn = management_connection(node, cluster, ctx, database)
        .await
        .map_err(|e| NodeSqlError::Lost(e.to_string()))?;
    // pg_promote() itself waits up to 60 s.
    let deadline = Duration::from_secs(90);
    match tokio::time::timeout(deadline, conn.simple_query(sql)).await {
        Ok(Ok(rows)) => Ok(rows),
        Ok(Err(crate::server::QueryError::Sql(e))) => Err(NodeSqlError::Refused(e)),
        Ok(Err(crate::server::QueryError::Server(e))) => Err(NodeSqlError::Lost(e.to_string())),
        Err(_) => Err(NodeSqlError::Lost(format!(
            "no answer within {} ms",
            deadline.as_millis()
        ))),
    }
}

pub(crate) fn first_value(rows: &crate::server::Rows) -> Option<&str> {
    rows.first()?.first()?.as_deref()
}

/// A SQL string literal.
pub(crate) fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
