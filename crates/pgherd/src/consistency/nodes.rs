//! Who a consistency check compares and how it reaches them: a cluster's primary and
//! replicas through pgherd's own sessions (as the `[cluster]` user), or a replication set's
//! origin and its subscribers (each by its own connection string).

use pgherd_config::Config;
use pgherd_proxy::nodes::NodeState;
use pgherd_proxy::pool::ConnectContext;
use pgherd_proxy::server::ServerConn;
use pgherd_replication::consistency::SESSION_SETTINGS_SQL;

use super::CheckError;
use crate::sql_session::{first, QueryFailure, Rows, SqlSession};

/// A node being compared, with its session.
pub(super) struct Checked {
    pub(super) name: String,
    conn: Conn,
}

/// A cluster node's session (pgherd's own client), or a subscriber's (reached by its own
/// connection string).
enum Conn {
    Node(ServerConn),
    Subscriber(tokio_postgres::Client),
}

impl Checked {
    pub(super) async fn query(&mut self, sql: &str) -> Result<Rows, QueryFailure> {
        match &mut self.conn {
            Conn::Node(conn) => conn.rows(sql).await,
            Conn::Subscriber(client) => (&*client).rows(sql).await,
        }
    }

    pub(super) fn failed(&self, e: impl std::fmt::Display) -> CheckError {
        CheckError::Node {
            node: self.name.clone(),
            error: e.to_string(),
        }
    }
}

/// A second session on the primary, which takes the points' locks, and a session to each of
/// the nodes asked for (or all), the primary first; every one must answer.
pub(super) async fn connect_all(
    config: &Config,
    asked: &[String],
    database: &str,
) -> Result<(Checked, Vec<Checked>), CheckError> {
    let registry = crate::clone::registry(config);
    let chosen: Vec<std::sync::Arc<NodeState>> = if asked.is_empty() {
        registry.all().iter().cloned().collect()
    } else {
        asked
            .iter()
            .map(|name| {
                registry.get(name).ok_or_else(|| {
                    CheckError::Config(format!(
                        "no node \"{name}\" in the config (its nodes: {})",
                        config.node_names()
                    ))
                })
            })
            .collect::<Result<_, _>>()?
    };
    if chosen.len() < 2 {
        return Err(CheckError::Config(
            "a check compares at least two nodes".to_owned(),
        ));
    }
    let ctx = pgherd_proxy::app::connect_context(config, Default::default())
        .map_err(CheckError::Config)?;
    let mut checked = Vec::new();
    let mut primary = None;
    for node in &chosen {
        let mut session = open_session(node, config, &ctx, database).await?;
        let in_recovery = session
            .query("SELECT pg_is_in_recovery()::text")
            .await
            .map_err(|e| session.failed(e))?;
        if first(&in_recovery).as_deref() == Some("false") {
            if let Some((other, _)) = &primary {
                return Err(CheckError::Config(format!(
                    "{other} and {} both take writes: they are not one cluster's copies",
                    session.name
                )));
            }
            primary = Some((session.name.clone(), node.clone()));
            checked.insert(0, session);
        } else {
            checked.push(session);
        }
    }
    let Some((_, primary)) = primary else {
        return Err(CheckError::Config(
            "none of the nodes is the primary: it must be among them (its lock on a table is what makes the nodes' snapshots comparable)".to_owned(),
        ));
    };
    let locker = open_session(&primary, config, &ctx, database).await?;
    Ok((locker, checked))
}

async fn open_session(
    node: &NodeState,
    config: &Config,
    ctx: &ConnectContext,
    database: &str,
) -> Result<Checked, CheckError> {
    let name = node.config.name.clone();
    let failed = |e: &dyn std::fmt::Display| CheckError::Node {
        node: name.clone(),
        error: e.to_string(),
    };
    let conn = pgherd_proxy::monitor::management_connection(node, &config.cluster, ctx, database)
        .await
        .map_err(|e| failed(&e))?;
    into_checked(name, conn).await
}

/// A node's session, its settings those of a check.
async fn into_checked(name: String, conn: ServerConn) -> Result<Checked, CheckError> {
    let mut session = Checked {
        name,
        conn: Conn::Node(conn),
    };
    session
        .query(SESSION_SETTINGS_SQL)
        .await
        .map_err(|e| session.failed(e))?;
    Ok(session)
}

/// A set's origin (the node that answers as the primary) with a second session for the locks,
/// and each subscriber given, the origin first.
pub(super) async fn connect_set(
    config: &Config,
    database: &str,
    origin_name: Option<&str>,
    to: &[String],
) -> Result<(Checked, Vec<Checked>), CheckError> {
    let (node, conn) = crate::sets::find_origin(config, database, origin_name)
        .await
        .map_err(CheckError::Config)?;
    let origin = into_checked(node.name.clone(), conn).await?;
    let locker = crate::clone::session_in(config, &node, database)
        .await
        .map_err(CheckError::Config)?;
    let locker = into_checked(node.name.clone(), locker).await?;
    let mut nodes = vec![origin];
    for conninfo in to {
        let (name, parsed) = crate::sets::subscriber_at(conninfo).map_err(CheckError::Config)?;
        let client = crate::sets::connect_subscriber(&name, &parsed, &config.server_tls)
            .await
            .map_err(CheckError::Config)?;
        let mut subscriber = Checked {
            name,
            conn: Conn::Subscriber(client),
        };
        subscriber
            .query(SESSION_SETTINGS_SQL)
            .await
            .map_err(|e| subscriber.failed(e))?;
        nodes.push(subscriber);
    }
    Ok((locker, nodes))
}

impl SqlSession for Checked {
    async fn rows(&mut self, sql: &str) -> Result<Rows, QueryFailure> {
        self.query(sql).await
    }
}
