//! Who a consistency check compares and how it reaches them: a cluster's primary and
//! replicas through pgherd's own sessions (as the `[cluster]` user), or a replication set's
//! origin and its subscribers (each by its own connection string).

use pgherd_config::Config;
use pgherd_proxy::nodes::NodeState;
use pgherd_proxy::pool::ConnectContext;
use pgherd_proxy::server::{QueryError, ServerConn};
use pgherd_replication::consistency::{quote_literal, SESSION_SETTINGS_SQL};
use pgherd_replication::sets;

use super::{first_value, CheckError};

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

/// A statement's failure on a node, with its SQLSTATE when the server gave one.
#[derive(Debug)]
pub(super) struct NodeQueryError {
    sqlstate: Option<String>,
    message: String,
}

impl std::fmt::Display for NodeQueryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl NodeQueryError {
    pub(super) fn is(&self, sqlstate: &str) -> bool {
        self.sqlstate.as_deref() == Some(sqlstate)
    }
}

impl Checked {
    pub(super) async fn query(
        &mut self,
        sql: &str,
    ) -> Result<Vec<Vec<Option<String>>>, NodeQueryError> {
        match &mut self.conn {
            Conn::Node(conn) => conn.simple_query(sql).await.map_err(|e| NodeQueryError {
                sqlstate: match &e {
                    QueryError::Sql(e) => Some(e.code.code().to_owned()),
                    QueryError::Server(_) => None,
                },
                message: e.to_string(),
            }),
            Conn::Subscriber(client) => {
                crate::sets::client_rows(client, sql)
                    .await
                    .map_err(|e| NodeQueryError {
                        sqlstate: e.code().map(|c| c.code().to_owned()),
                        message: crate::sets::pg_error(&e),
                    })
            }
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
        if first_value(&in_recovery).as_deref() == Some("false") {
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
    let mut session = Checked {
        name: name.clone(),
        conn: Conn::Node(conn),
    };
    session
        .query(SESSION_SETTINGS_SQL)
        .await
        .map_err(|e| failed(&e))?;
    Ok(session)
}

/// The set's tables (`schema.table`), from its publication on the origin.
pub(super) async fn set_members(
    origin: &mut Checked,
    set: &str,
) -> Result<Vec<String>, CheckError> {
    let rows = origin
        .query(&format!(
            "SELECT schemaname || '.' || tablename FROM pg_publication_tables \
              WHERE pubname = {} AND schemaname <> 'pgherd'",
            quote_literal(&sets::publication(set))
        ))
        .await
        .map_err(|e| origin.failed(e))?;
    let tables: Vec<String> = rows
        .into_iter()
        .filter_map(|r| r.into_iter().next().flatten())
        .collect();
    if tables.is_empty() {
        return Err(CheckError::Config(format!(
            "no set named {set} with tables on {}",
            origin.name
        )));
    }
    Ok(tables)
}

/// A set's origin (the node that answers as the primary) with a second session for the locks,
/// and each subscriber given, the origin first.
pub(super) async fn connect_set(
    config: &Config,
    database: &str,
    origin_name: Option<&str>,
    to: &[String],
) -> Result<(Checked, Vec<Checked>), CheckError> {
    let registry = match origin_name {
        Some(name) => {
            let node = config
                .node_of_any_shard(name)
                .ok_or_else(|| CheckError::Config(format!("no node \"{name}\" in the config")))?;
            crate::clone::registry_of(std::slice::from_ref(node))
        }
        None => crate::clone::registry(config),
    };
    let ctx = pgherd_proxy::app::connect_context(config, Default::default())
        .map_err(CheckError::Config)?;
    let mut origin = None;
    for node in registry.all().iter() {
        let Ok(mut session) = open_session(node, config, &ctx, database).await else {
            continue;
        };
        let rows = session
            .query("SELECT (NOT pg_is_in_recovery())::text")
            .await
            .map_err(|e| session.failed(e))?;
        if first_value(&rows).as_deref() == Some("true") {
            origin = Some((node.clone(), session));
            break;
        }
    }
    let Some((node, origin)) = origin else {
        return Err(CheckError::Config(
            "no node answers as the primary to be the set's origin".to_owned(),
        ));
    };
    let locker = open_session(&node, config, &ctx, database).await?;
    let mut nodes = vec![origin];
    for conninfo in to {
        let (name, parsed) = crate::sets::subscriber_at(conninfo).map_err(CheckError::Config)?;
        let client = crate::sets::connect_subscriber(&name, &parsed)
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
