//! The node monitors: one task per node keeps a management connection open and checks the
//! node every `cluster.health_check_period_ms` (its role with `pg_is_in_recovery()`, its WAL
//! positions, whether its WAL receiver streams, who streams from it), and hands what it saw to
//! [`Nodes::record`]. Observations only: what to do about them is failover's.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use pgherd_config::ClusterSettings;
use pgherd_route::balance::{insert_lsn_as_end, parse_lsn};

use crate::error::{ServerError, ServerErrorKind};
use crate::nodes::{CheckFailure, CheckFailureKind, NodeState, Nodes, Observation, Role};
use crate::pool::ConnectContext;
use crate::server::{self, ConnectSpec, QueryError, ServerConn, ServerCredentials};

/// Credentials pgherd uses for its own connections to nodes.
pub fn management_credentials(cluster: &ClusterSettings) -> ServerCredentials {
    ServerCredentials {
        password: cluster.password.clone(),
        scram_keys: None,
        md5_hash: None,
    }
}

/// How pgherd's own user (`[cluster]`, with `credentials` from [`management_credentials`])
/// reaches `database` on `node`.
pub fn management_spec<'a>(
    node: &'a NodeState,
    cluster: &'a ClusterSettings,
    ctx: &'a ConnectContext,
    database: &'a str,
    credentials: &'a ServerCredentials,
) -> ConnectSpec<'a> {
    ConnectSpec {
        node: &node.config.name,
        host: &node.config.host,
        port: node.config.port,
        user: &cluster.user,
        database,
        credentials,
        tls_mode: ctx.tls_mode,
        tls: ctx.tls.as_ref(),
        timeout: Duration::from_millis(cluster.health_check_timeout_ms),
        replication: false,
        socket_dir: node.config.socket_dir.as_deref(),
    }
}

/// A connection as pgherd's own user (`[cluster]`) to `database` on `node`.
pub async fn management_connection(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    database: &str,
) -> Result<ServerConn, crate::error::ServerError> {
    let credentials = management_credentials(cluster);
    let spec = management_spec(node, cluster, ctx, database, &credentials);
    let id = ctx.next_server_id.fetch_add(1, Ordering::Relaxed);
    server::connect(&spec, id, 1).await
}

/// One health check: (re)connect if needed and ask the node whether it is in recovery. A
/// kept connection that turns out to be gone (its backend was terminated, as sealing a fenced
/// node does to every session, or the server restarted in between) gets one more try on a
/// fresh connection: a lost connection is not a node that does not answer. If that fails too,
/// the first failure is reported.
pub async fn check_once(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    conn: &mut Option<ServerConn>,
) -> Result<Observation, CheckFailure> {
    let reused = conn.is_some();
    match check_on(node, cluster, ctx, conn).await {
        Err(first) if reused && conn.is_none() => {
            check_on(node, cluster, ctx, conn).await.map_err(|_| first)
        }
        result => result,
    }
}

async fn check_on(
    node: &NodeState,
    cluster: &ClusterSettings,
    ctx: &ConnectContext,
    conn: &mut Option<ServerConn>,
) -> Result<Observation, CheckFailure> {
    let timeout = Duration::from_millis(cluster.health_check_timeout_ms);
    let c = match conn {
        Some(c) => c,
        None => conn.insert(
            management_connection(node, cluster, ctx, &cluster.database)
                .await
                .map_err(|e| failure_of(&e))?,
        ),
    };
    let answer = tokio::time::timeout(timeout, c.simple_query(CHECK_SQL)).await;
    let rows = match answer {
        Ok(Ok(rows)) => rows,
        Ok(Err(QueryError::Sql(e))) => {
            let kind = match e.code.code() {
                "57P01" | "57P02" => CheckFailureKind::ShuttingDown,
                "57P03" => CheckFailureKind::StartingUp,
                _ => CheckFailureKind::Sql,
            };
            if kind != CheckFailureKind::Sql {
                // The server ends the connection after these.
                *conn = None;
            }
            return Err(CheckFailure::new(kind, e.to_string()));
        }
        Ok(Err(QueryError::Server(e))) => {
            *conn = None;
            return Err(failure_of(&e));
        }
        Err(_) => {
            *conn = None;
            return Err(CheckFailure::new(
                CheckFailureKind::Timeout,
                format!("no answer within {} ms", timeout.as_millis()),
            ));
        }
    };
    let row = rows.first().map(|r| r.as_slice()).unwrap_or_default();
    let field = |i: usize| row.get(i).and_then(|v| v.as_deref());
    let lsn = |i: usize| field(i).and_then(parse_lsn).unwrap_or(0);
    let role = match field(0) {
        Some("t") => Role::Replica,
        Some("f") => Role::Primary,
        other => {
            return Err(CheckFailure::new(
                CheckFailureKind::Protocol,
                format!("unexpected answer to pg_is_in_recovery(): {other:?}"),
            ))
        }
    };
    Ok(Observation {
        role,
        lsn: match role {
            Role::Primary => insert_lsn_as_end(lsn(1)),
            _ => lsn(1),
        },
        receive_lsn: lsn(2),
        timeline: field(3).and_then(|t| t.parse().ok()).unwrap_or(0),
        upstream_streaming: field(4) == Some("t"),
        streaming_standbys: field(5)
            .map(|names| names.lines().map(str::to_owned).collect())
            .unwrap_or_default(),
        upstream_address: field(6).and_then(|sender| {
            let (host, port) = sender.rsplit_once(' ')?;
            Some((host.to_owned(), port.parse().ok()?))
        }),
    })
}

/// Role, then the primary's insert position or the replica's replay position, what a replica
/// has received, the checkpoint timeline, and whether a replica's WAL receiver is streaming and
/// heard from its upstream within `wal_receiver_timeout` (the split-brain guard asks replicas
/// whether they still hear the primary; a hung primary keeps the connection open but goes
/// silent), on a primary the standbys streaming from it (application names can hold no
/// newline; a logical subscriber's walsender, which holds a logical slot, is no standby, nor
/// is a rejoin's `pg_basebackup` copying a node, `node_ops::REBUILD_APPLICATION_PREFIX`), and
/// on a replica the address it streams from (a primary's, or another
/// replica's when it cascades).
const CHECK_SQL: &str = "SELECT pg_is_in_recovery(), \
     CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_insert_lsn() END, \
     pg_last_wal_receive_lsn(), \
     (SELECT timeline_id FROM pg_control_checkpoint()), \
     EXISTS (SELECT 1 FROM pg_stat_wal_receiver WHERE status = 'streaming' \
       AND (current_setting('wal_receiver_timeout')::interval = '0' \
            OR last_msg_receipt_time > now() - current_setting('wal_receiver_timeout')::interval)), \
     (SELECT string_agg(application_name, E'\\n') FROM pg_stat_replication WHERE state = 'streaming' \
       AND application_name NOT LIKE 'pgherd-rejoin %' \
       AND pid NOT IN (SELECT active_pid FROM pg_replication_slots \
                        WHERE slot_type = 'logical' AND active_pid IS NOT NULL)), \
     (SELECT sender_host || ' ' || sender_port FROM pg_stat_wal_receiver)";

/// Checks every node once, concurrently; used at startup so routing is known before the
/// first client arrives.
pub async fn check_all_once(
    nodes: &Arc<Nodes>,
    cluster: &ClusterSettings,
    ctx: &Arc<ConnectContext>,
) {
    let mut checks = tokio::task::JoinSet::new();
    for node in nodes.all().iter() {
        let (nodes, node, cluster, ctx) =
            (nodes.clone(), node.clone(), cluster.clone(), ctx.clone());
        checks.spawn(async move {
            let mut conn = None;
            let outcome = check_once(&node, &cluster, &ctx, &mut conn).await;
            nodes.record(&node, outcome);
        });
    }
    while checks.join_next().await.is_some() {}
}

/// Runs until the node is retired or `stop` fires.
pub async fn monitor(
    nodes: Arc<Nodes>,
    node: Arc<NodeState>,
    settings: impl Fn() -> ClusterSettings,
    ctx: Arc<ConnectContext>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut conn = None;
    loop {
        if node.is_retired() || *stop.borrow() {
            return;
        }
        let cluster = settings();
        let outcome = check_once(&node, &cluster, &ctx, &mut conn).await;
        nodes.record(&node, outcome);
        let period = Duration::from_millis(cluster.health_check_period_ms);
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => {}
        }
    }
}

/// A failed connection to a node as a health-check failure of the right kind.
fn failure_of(error: &ServerError) -> CheckFailure {
    let kind = match &error.kind {
        ServerErrorKind::Connect(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            CheckFailureKind::Refused
        }
        ServerErrorKind::Connect(_) => CheckFailureKind::Unreachable,
        ServerErrorKind::ConnectTimeout | ServerErrorKind::Timeout => CheckFailureKind::Timeout,
        ServerErrorKind::Tls(_) => CheckFailureKind::Tls,
        ServerErrorKind::NoCredentials(_) => CheckFailureKind::Auth,
        ServerErrorKind::Rejected(e) | ServerErrorKind::Closed(Some(e)) => match e.code.code() {
            code if code.starts_with("28") => CheckFailureKind::Auth,
            "57P03" => CheckFailureKind::StartingUp,
            "57P01" | "57P02" => CheckFailureKind::ShuttingDown,
            _ => CheckFailureKind::Rejected,
        },
        ServerErrorKind::Io(_) | ServerErrorKind::Closed(None) => CheckFailureKind::ShuttingDown,
        ServerErrorKind::Protocol(_) | ServerErrorKind::Unexpected(_) => CheckFailureKind::Protocol,
    };
    CheckFailure::new(kind, error.to_string())
}

#[cfg(test)]
mod tests {
    use crate::node_ops::{rebuild_application_name, REBUILD_APPLICATION_PREFIX};

    /// The health check's list of standbys leaves out exactly what a rejoin's programs call
    /// themselves, and a node's name never matches the pattern by a wildcard of its own.
    #[test]
    fn the_check_leaves_out_a_rejoins_copy() {
        let pattern = format!("application_name NOT LIKE '{REBUILD_APPLICATION_PREFIX}%'");
        assert!(super::CHECK_SQL.contains(&pattern), "{}", super::CHECK_SQL);
        assert!(!REBUILD_APPLICATION_PREFIX.contains(['%', '_', '\'', '\\']));
        let name = rebuild_application_name("pg1");
        assert!(name.starts_with(REBUILD_APPLICATION_PREFIX) && name != "pg1");
    }
}
