//! The operator's levers that are not failover: take a node out of traffic and back
//! (`DETACH`/`ATTACH`), hold new transactions of a database or of all (`PAUSE`/`RESUME`,
//! PgBouncer's; kept in the cluster view), end a database's sessions (`KILL`). The admin console and the HTTP API both act through
//! these functions; each answers with the steps it took, or a PostgreSQL-style error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgherd_failover::Change;
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use crate::failover::event;
use crate::nodes::NodeState;

/// How long `PAUSE` waits for running transactions to give their server connections back.
const PAUSE_DRAIN: Duration = Duration::from_secs(30);

fn find_node(app: &App, name: &str) -> Result<Arc<NodeState>, PgError> {
    app.nodes.get(name).ok_or_else(|| {
        PgError::error(
            SqlState::UNDEFINED_OBJECT,
            format!("no node named \"{name}\" in the config"),
        )
    })
}

/// `DETACH node`: no new traffic to the node; sessions using it finish what they run.
pub fn detach(app: &App, name: &str) -> Result<Vec<String>, PgError> {
    let node = find_node(app, name)?;
    if app.nodes.writer().is_some_and(|w| w.name() == name) {
        return Err(PgError::error(
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("{name} takes the writes; detaching it would stop them"),
        )
        .with_hint("run SWITCHOVER to another node first"));
    }
    if !app.nodes.change(Change::Detach(node.id)) {
        return Ok(vec![format!("{name} was already detached")]);
    }
    app.drop_idle_connections(&node);
    let detail = "no new traffic through pgherd (operator); running transactions there finish; never promoted while detached";
    tracing::warn!(node = name, "detached by the operator");
    event(app, "detached", name, detail);
    Ok(vec![format!("{name} detached: {detail}")])
}

/// `ATTACH node`: undoes DETACH.
pub fn attach(app: &App, name: &str) -> Result<Vec<String>, PgError> {
    let node = find_node(app, name)?;
    if !app.nodes.change(Change::Attach(node.id)) {
        return Ok(vec![format!("{name} was not detached")]);
    }
    let checks = app.config().routing.rejoin_after_checks;
    let detail = format!("traffic allowed again; reads after {checks} healthy checks");
    tracing::info!(node = name, "attached by the operator");
    event(app, "attached", name, &detail);
    Ok(vec![format!("{name} attached: {detail}")])
}

/// `PAUSE [db]`: new transactions of the database (or of all) wait; returns once running
/// ones have given their server connections back.
pub async fn pause(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    if let Some(db) = database {
        check_database(app, db)?;
    }
    app.nodes.change(Change::Pause(database.map(str::to_owned)));
    let what = database.map_or("all databases".to_owned(), |d| format!("database \"{d}\""));
    event(
        app,
        "paused",
        "",
        &format!("new transactions of {what} wait"),
    );
    let started = Instant::now();
    loop {
        let in_use: u32 = app
            .pools()
            .iter()
            .filter(|p| database.is_none_or(|d| p.database == d))
            .map(|p| p.snapshot().lent)
            .sum();
        if in_use == 0 {
            return Ok(vec![format!(
                "{what} paused: new transactions wait, none is running ({} ms)",
                started.elapsed().as_millis()
            )]);
        }
        if started.elapsed() > PAUSE_DRAIN {
            return Err(PgError::error(
                SqlState::OBJECT_IN_USE,
                format!(
                    "{what} is paused, but {in_use} server connection(s) are still in use after {} s",
                    PAUSE_DRAIN.as_secs()
                ),
            )
            .with_hint("PAUSE again to keep waiting, RESUME to let new transactions run"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `RESUME [db]`.
pub fn resume(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    let what = database.map_or("all databases".to_owned(), |d| format!("database \"{d}\""));
    if !app
        .nodes
        .change(Change::Resume(database.map(str::to_owned)))
    {
        return Err(PgError::error(
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!("{what} is not paused"),
        ));
    }
    event(
        app,
        "resumed",
        "",
        &format!("{what} takes new transactions again"),
    );
    Ok(vec![format!("{what} resumed")])
}

/// `KILL db`: ends every client session of the database at once; its idle server
/// connections close.
pub fn kill(app: &App, database: &str) -> Result<Vec<String>, PgError> {
    check_database(app, database)?;
    let mut ended = 0;
    for client in app.clients.all() {
        if client.database == database {
            client.kill(format!("KILL {database} on the admin console"));
            ended += 1;
        }
    }
    for pool in app.pools() {
        if pool.database == database {
            pool.drop_idle();
        }
    }
    event(
        app,
        "killed",
        "",
        &format!("{ended} session(s) of database \"{database}\" ended"),
    );
    Ok(vec![format!(
        "{ended} session(s) of database \"{database}\" ended"
    )])
}

fn check_database(app: &App, database: &str) -> Result<(), PgError> {
    let config = app.config();
    let served = config.databases.contains_key(database)
        || config
            .databases
            .contains_key(pgherd_config::WILDCARD_DATABASE)
        || app.pools().iter().any(|p| p.database == database);
    if served {
        Ok(())
    } else {
        Err(PgError::error(
            SqlState::INVALID_CATALOG_NAME,
            format!("database \"{database}\" is not served by pgherd"),
        ))
    }
}
