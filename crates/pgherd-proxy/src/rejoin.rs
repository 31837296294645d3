//! Brings a node back as a standby of the primary: the replaced primary after a failover
//! (fenced, its history diverged) or a replica that lost its way. The node is stopped,
//! rewound with `pg_rewind` from the primary (or copied afresh with `pg_basebackup` when that
//! fails), restarted as a standby with its own slot on the primary, and unfenced: it gets
//! reads again once its monitor has seen it healthy `rejoin_after_checks` times.

use std::sync::Arc;

use pgherd_cluster::{LocalNode, StopMode};
use pgherd_failover::Change;
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use crate::failover::event;
use crate::node_ops::{
    conninfo_as, create_slot, primary_conninfo, rebuild_application_name, run_sql,
};
use crate::nodes::{NodeState, Nodes};
use crate::switchover::{blocking, managed_node, START_TIMEOUT};

/// Rejoins node `name`; returns what was done, one sentence per step.
pub async fn rejoin(app: &Arc<App>, name: &str) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
    let refuse = |msg: String| PgError::error(SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, msg);
    // Any shard's node, rejoined to its own shard's primary.
    let (cluster, node) = app.node_named(name).ok_or_else(|| {
        PgError::error(
            SqlState::UNDEFINED_OBJECT,
            format!("no node named \"{name}\""),
        )
    })?;
    let primary = cluster
        .writer()
        .ok_or_else(|| refuse("no node accepts writes: there is no primary to follow".into()))?;
    if primary.name() == node.name() {
        return Err(refuse(format!(
            "{name} is the primary pgherd sends writes to; it cannot rejoin as a standby"
        )));
    }
    if cluster.is_switching() {
        return Err(refuse(format!(
            "a switchover is under way; rejoin {name} after it"
        )));
    }
    // Automatic rejoins (sealing, divergence) and operators may ask at once: one rewind per
    // data directory.
    let Some(_claim) = node.claim_rejoin() else {
        return Err(PgError::error(
            SqlState::OBJECT_IN_USE,
            format!("{name} is being rejoined already"),
        ));
    };
    let local = managed_node(
        app,
        &node,
        &format!("rejoin stops, rewinds and restarts {name}"),
    )?;
    run(app, &cluster, &node, &primary, local)
        .await
        .map_err(|e| {
            event(app, "rejoin_failed", name, &e);
            refuse(format!("rejoin of {name} failed: {e}"))
        })
}

async fn run(
    app: &Arc<App>,
    cluster: &Nodes,
    node: &Arc<NodeState>,
    primary: &Arc<NodeState>,
    local: LocalNode,
) -> Result<Vec<String>, String> {
    let config = app.config();
    let ctx = app.connect_context();
    let mut steps = Vec::new();
    // No traffic while it changes; it stays fenced if anything below fails.
    cluster.change(Change::Fence(node.id));
    app.drop_idle_connections(node);
    // The primary first: if it cannot be reached, the node is left running as it is.
    let slot = pgherd_cluster::slot_name(node.name());
    create_slot(&config.cluster, &ctx, primary, &slot).await?;
    // pg_rewind reads the source's timeline from its control file, which a just-promoted
    // primary updates only at its next checkpoint: without one, rewind sees the same
    // timeline and changes nothing.
    run_sql(primary, &config.cluster, &ctx, "CHECKPOINT").await?;
    let stopping = local.clone();
    blocking(move || {
        if stopping.is_running() {
            stopping.stop(StopMode::Fast)
        } else {
            Ok(())
        }
    })
    .await?;
    cluster.mark_stopped(node, "stopped to rejoin");
    steps.push(format!("{} stopped", node.name()));
    // pg_rewind reads the source as pgherd's own user (it needs more than replication); the
    // standby then streams as the replication role.
    let source = format!(
        "{} dbname=postgres",
        conninfo_as(
            primary,
            &rebuild_application_name(node.name()),
            &config.cluster.user
        )
    );
    let standby = primary_conninfo(&config, primary, node.name());
    let rejoining = local.clone();
    let password = config.cluster.password.clone();
    let how =
        blocking(move || rejoining.rejoin(&source, password.as_deref(), &standby, Some(&slot)))
            .await?;
    steps.push(format!(
        "{} made a standby of {} with {how}",
        node.name(),
        primary.name()
    ));
    blocking(move || local.start(START_TIMEOUT)).await?;
    cluster.change(Change::Unfence(node.id));
    let done = format!(
        "{} rejoined as a standby of {} ({how})",
        node.name(),
        primary.name()
    );
    tracing::warn!(node = node.name(), %how, "rejoined as a standby");
    event(app, "rejoined", node.name(), &done);
    steps.push(done);
    Ok(steps)
}
