//! The operator's levers that are not failover: take a node out of traffic and back
//! (`DETACH`/`ATTACH`), hold new transactions of a database or of all (`PAUSE`/`RESUME`,
//! PgBouncer's; kept in the cluster view), end a database's sessions (`KILL`). The admin console and the HTTP API both act through
//! these functions; each answers with the steps it took, or a PostgreSQL-style error.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgherd_failover::control::Operation;
use pgherd_failover::{plan_promotion, Change, Refusal, Safeguard};
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use crate::failover::{carry_out, event, members, policy, Seen};
use crate::nodes::{NodeState, Role};
use crate::pool::Pool;
use crate::switchover::ROLE_CHANGE_WAIT;

/// How long `PAUSE` waits for running transactions to give their server connections back.
const PAUSE_DRAIN: Duration = Duration::from_secs(30);

/// Saves DETACH and PAUSE to the state file; a step saying so if that failed (the lever is in
/// force, but a restart forgets it).
fn keep_levers(app: &App) -> Option<String> {
    let error = crate::kept::save(app).err()?;
    tracing::error!(%error, "DETACH/PAUSE state not saved: a restart forgets it");
    Some(format!(
        "warning: not saved ({error}): a restart of pgherd forgets it"
    ))
}

/// A node of shard 0's cluster (`App::nodes`), which the levers kept in the state file act on.
fn find_node(app: &App, name: &str) -> Result<Arc<NodeState>, PgError> {
    match app.node_named(name) {
        Some((cluster, node)) if Arc::ptr_eq(&cluster, &app.nodes) => Ok(node),
        Some(_) => Err(PgError::error(
            SqlState::FEATURE_NOT_SUPPORTED,
            format!("{name} belongs to a shard other than shard 0: DETACH and ATTACH act on shard 0's nodes only for now"),
        )),
        None => Err(no_such_node(name)),
    }
}

fn no_such_node(name: &str) -> PgError {
    PgError::error(
        SqlState::UNDEFINED_OBJECT,
        format!("no node named \"{name}\" in the config"),
    )
}

/// `DETACH node`: no new traffic to the node; sessions using it finish what they run.
pub fn detach(app: &App, name: &str) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
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
    let mut steps = vec![format!("{name} detached: {detail}")];
    steps.extend(keep_levers(app));
    Ok(steps)
}

/// `ATTACH node`: undoes DETACH.
pub fn attach(app: &App, name: &str) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
    let node = find_node(app, name)?;
    if !app.nodes.change(Change::Attach(node.id)) {
        return Ok(vec![format!("{name} was not detached")]);
    }
    let checks = app.config().routing.rejoin_after_checks;
    let detail = format!("traffic allowed again; reads after {checks} healthy checks");
    tracing::info!(node = name, "attached by the operator");
    event(app, "attached", name, &detail);
    let mut steps = vec![format!("{name} attached: {detail}")];
    steps.extend(keep_levers(app));
    Ok(steps)
}

/// `PAUSE [db]`: new transactions of the database (or of all) wait; returns once running
/// ones have given their server connections back.
pub async fn pause(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
    let what = scope(app, database)?;
    app.nodes.change(Change::Pause(database.map(str::to_owned)));
    // Paired with the fence in `paused_since_acquired`: a request that took a server
    // connection is counted below, or sees the pause there and gives it back.
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    let not_kept = keep_levers(app);
    event(
        app,
        "paused",
        "",
        &format!("new transactions of {what} wait"),
    );
    let started = Instant::now();
    loop {
        let in_use = sum_over_pools(app, database, |p| p.snapshot().lent);
        if in_use == 0 {
            let mut steps = vec![format!(
                "{what} paused: new transactions wait, none is running ({} ms)",
                started.elapsed().as_millis()
            )];
            steps.extend(not_kept);
            return Ok(steps);
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

/// Whether `database` is paused, asked by a request that has just taken its server
/// connections and sent nothing: one checked before PAUSE came may have waited for them (a
/// full pool) or been between its check and the taking while PAUSE counted none in use. With
/// the fence in [`pause`], either PAUSE counts these connections (and waits for them) or this
/// sees the pause: the request then gives them back and waits, so no transaction starts once
/// PAUSE has said none runs.
pub fn paused_since_acquired(app: &App, database: &str) -> bool {
    std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    app.nodes.is_paused(database)
}

/// Holds a request (nothing sent yet) while `database` is paused, until `RESUME`, for at most
/// `pool.wait_timeout_ms`, as a wait for a server connection would be.
pub async fn wait_resumed(app: &App, database: &str) -> Result<(), PgError> {
    let limit = Duration::from_millis(app.config().pool.wait_timeout_ms);
    match app.nodes.wait_resumed(database, limit).await {
        true => Ok(()),
        false => Err(paused_too_long(database, limit)),
    }
}

/// A request that waited `limit` for `RESUME` of `database` in vain.
fn paused_too_long(database: &str, limit: Duration) -> PgError {
    PgError::error(
        SqlState::CANNOT_CONNECT_NOW,
        format!(
            "database \"{database}\" is paused (PAUSE on the admin console) and was not resumed within {} ms",
            limit.as_millis()
        ),
    )
    .with_hint("retry after RESUME")
}

/// `RESUME [db]`.
pub fn resume(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
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
    let mut steps = vec![format!("{what} resumed")];
    steps.extend(keep_levers(app));
    Ok(steps)
}

/// `KILL db`: ends every client session of the database at once; its idle server
/// connections close.
pub fn kill(app: &App, database: &str) -> Result<Vec<String>, PgError> {
    check_database(app, database)?;
    let mut ended = 0;
    for client in app.clients.all() {
        if client.database() == database {
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

/// The database a command names (checked to be served), or all: how the answer calls it.
fn scope(app: &App, database: Option<&str>) -> Result<String, PgError> {
    if let Some(db) = database {
        check_database(app, db)?;
    }
    Ok(database.map_or("all databases".to_owned(), |d| format!("database \"{d}\"")))
}

/// `count` summed over the pools of `database` (all pools without one).
pub(crate) fn sum_over_pools(
    app: &App,
    database: Option<&str>,
    count: impl Fn(&Pool) -> u32,
) -> u32 {
    app.pools()
        .iter()
        .filter(|p| database.is_none_or(|d| p.database == d))
        .map(|p| count(p))
        .sum()
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

/// `PROMOTE node [FORCE safeguard, ...]`: manual failover, for a dead primary when automatic
/// failover is off or will not act. The same safeguards as failover (`pgherd_failover::
/// plan_promotion`), each refusal a sentence naming the safeguard `FORCE` skips; then the same
/// steps (fence the old primary, re-point the others, promote, elect with its synchronous
/// standbys).
pub async fn promote(
    app: &Arc<App>,
    name: &str,
    forced: &[Safeguard],
) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
    // Any shard's node: each shard fails over on its own.
    let (cluster, node) = app.node_named(name).ok_or_else(|| no_such_node(name))?;
    let refuse = |msg: String| PgError::error(SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, msg);
    let Ok(_turn) = tokio::time::timeout(ROLE_CHANGE_WAIT, cluster.role_change.lock()).await else {
        return Err(PgError::error(
            SqlState::OBJECT_IN_USE,
            "another role change (a failover or switchover) is under way",
        ));
    };
    if cluster.is_switching() {
        return Err(refuse("a switchover is under way".to_owned()));
    }
    let config = app.config();
    let nodes = cluster.all();
    let Some(candidate) = nodes.iter().position(|n| n.id == node.id) else {
        return Err(refuse(format!("{name} left the config")));
    };
    // With nothing elected (failover off), the primary being replaced is the node last seen
    // as one.
    let last_primary = nodes.iter().position(|n| {
        n.health()
            .last_seen
            .is_some_and(|seen| seen.role == Role::Primary)
    });
    let seen = Seen::now(&cluster, &nodes, last_primary);
    let promotion = plan_promotion(&policy(&config), &seen.view(), candidate, forced)
        .map_err(|refusals| refusal_error(name, &refusals))?;
    let what = format!(
        "manual promotion of {name}{}",
        if forced.is_empty() {
            String::new()
        } else {
            let names: Vec<&str> = forced.iter().map(|s| s.name()).collect();
            format!(" (forced: {})", names.join(", "))
        }
    );
    tracing::warn!(node = name, "{what}");
    event(app, "promoting", name, &what);
    let operation = Operation::promote(
        promotion.candidate,
        promotion.old,
        &promotion.followers,
        &members(&nodes),
    );
    carry_out(app, &cluster, &config, &nodes, operation)
        .await
        .map_err(|e| refuse(format!("promotion of {name} failed: {e}")))
}

fn refusal_error(name: &str, refusals: &[Refusal]) -> PgError {
    let forceable: Vec<&str> = refusals
        .iter()
        .filter_map(|r| r.safeguard.map(Safeguard::name))
        .collect();
    let sentences: Vec<&str> = refusals.iter().map(|r| r.sentence.as_str()).collect();
    let error = PgError::error(
        SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!("{name} is not promoted: {}", sentences.join("; ")),
    );
    if forceable.len() == refusals.len() {
        error.with_hint(format!(
            "if you know better, PROMOTE {name} FORCE {} (pgherd promote {name} --force {})",
            forceable.join(", "),
            forceable.join(" --force ")
        ))
    } else {
        error
    }
}

/// The safeguards named after `FORCE` (commas or spaces between them).
pub fn parse_safeguards(words: &[&str]) -> Result<Vec<Safeguard>, PgError> {
    words
        .iter()
        .flat_map(|w| w.split(','))
        .filter(|w| !w.is_empty())
        .map(|w| {
            Safeguard::from_name(&w.to_ascii_lowercase()).ok_or_else(|| {
                let known: Vec<&str> = Safeguard::ALL.iter().map(|s| s.name()).collect();
                PgError::error(
                    SqlState::INVALID_PARAMETER_VALUE,
                    format!("no safeguard named \"{w}\""),
                )
                .with_hint(format!("safeguards: {}", known.join(", ")))
            })
        })
        .collect()
}

/// `RECONNECT [db]`: every server connection of the database (or of all) is opened anew:
/// idle ones close now, lent ones when their client gives them back.
pub fn reconnect(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    let what = scope(app, database)?;
    let lent = sum_over_pools(app, database, Pool::reconnect);
    let detail = format!(
        "server connections of {what} are opened anew; {lent} in use close when released (WAIT_CLOSE waits for them)"
    );
    event(app, "reconnect", "", &detail);
    Ok(vec![detail])
}

/// How long `WAIT_CLOSE` waits for connections still in use.
const WAIT_CLOSE_LIMIT: Duration = Duration::from_secs(60);

/// `WAIT_CLOSE [db]`: returns once every server connection `RECONNECT` asked to close (of the
/// database, or of all) has closed.
pub async fn wait_close(app: &App, database: Option<&str>) -> Result<Vec<String>, PgError> {
    let what = scope(app, database)?;
    let started = Instant::now();
    loop {
        let left = sum_over_pools(app, database, Pool::close_needed);
        if left == 0 {
            return Ok(vec![format!(
                "no server connection of {what} is left to close ({} ms)",
                started.elapsed().as_millis()
            )]);
        }
        if started.elapsed() > WAIT_CLOSE_LIMIT {
            return Err(PgError::error(
                SqlState::OBJECT_IN_USE,
                format!(
                    "{left} server connection(s) of {what} are still in use after {} s",
                    WAIT_CLOSE_LIMIT.as_secs()
                ),
            )
            .with_hint("their clients hold them (session mode, or a long transaction); WAIT_CLOSE again to keep waiting"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
