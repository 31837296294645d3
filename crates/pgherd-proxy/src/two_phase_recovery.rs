//! Finishes two-phase transactions left prepared on a shard: by a pgherd that died between its
//! prepares and its commits, a connection lost in between, or a shard primary that failed over
//! with prepared transactions. Each round lists pgherd's prepared transactions on every shard's
//! primary, asks the decider of each (`pgherd_route::two_phase`: the abort insert that waits
//! for a decider still running) and commits or rolls back accordingly; then removes decision
//! rows no prepared transaction needs. Runs at start and every [`ROUND_MS`].

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use pgherd_route::two_phase::{removable_decisions, resolve, Gid, Resolution, DECISIONS_TABLE};
use pgherd_wire::SqlState;

use crate::app::App;
use crate::node_ops::{ask_node, quote_literal, run_sql_in, NodeSqlError};
use crate::shards::Shards;

const ROUND_MS: u64 = 5_000;

/// Prepared transactions younger than this are left to the pgherd finishing them.
const GRACE_SECONDS: u32 = 2;

/// Decision rows are kept at least this long after their commit.
const KEEP_DECISIONS_SECONDS: u32 = 60;

pub fn spawn(app: Arc<App>, shards: Arc<Shards>) {
    tokio::spawn(async move {
        loop {
            round(&app, &shards).await;
            tokio::time::sleep(Duration::from_millis(ROUND_MS)).await;
        }
    });
}

/// One of pgherd's transactions prepared on a shard.
struct Prepared {
    shard: u32,
    database: String,
    gid: String,
    /// Older than the grace period.
    due: bool,
}

async fn round(app: &App, shards: &Shards) {
    for prepared in list_prepared(app, shards).await.0 {
        if !prepared.due {
            continue;
        }
        let Some(gid) = Gid::parse(&prepared.gid) else {
            continue;
        };
        if let Err(e) = finish(app, shards, &prepared, &gid).await {
            tracing::warn!(shard = prepared.shard, gid = %prepared.gid, error = %e, "a prepared transaction could not be finished yet; the next round tries again");
        }
    }
    clean_decisions(app, shards).await;
}

/// pgherd's prepared transactions on every shard's primary, and whether every shard could be
/// asked (a shard without a primary, or not answering, is skipped).
async fn list_prepared(app: &App, shards: &Shards) -> (Vec<Prepared>, bool) {
    let config = app.config();
    let ctx = app.connect_context();
    let sql = format!(
        "SELECT gid, database, (prepared < now() - interval '{GRACE_SECONDS} seconds')::text \
         FROM pg_prepared_xacts WHERE gid LIKE 'pgherd\\_%'"
    );
    let mut found = Vec::new();
    let mut every_shard = true;
    for (shard, cluster) in (0u32..).zip(shards.clusters()) {
        let Some(primary) = cluster.primary() else {
            every_shard = false;
            continue;
        };
        let rows = match run_sql_in(
            &primary,
            &config.cluster,
            &ctx,
            &config.cluster.database,
            &sql,
        )
        .await
        {
            Ok(rows) => rows,
            Err(e) => {
                tracing::debug!(shard, error = %e, "prepared transactions not listed");
                every_shard = false;
                continue;
            }
        };
        for row in rows {
            if let [Some(gid), Some(database), Some(due)] = row.as_slice() {
                found.push(Prepared {
                    shard,
                    database: database.clone(),
                    gid: gid.clone(),
                    due: due == "true",
                });
            }
        }
    }
    (found, every_shard)
}

/// Asks the decider, then finishes the participant its way.
async fn finish(app: &App, shards: &Shards, prepared: &Prepared, gid: &Gid) -> Result<(), String> {
    let config = app.config();
    let ctx = app.connect_context();
    let primary_of = |shard: u32| {
        shards
            .cluster(shard)
            .and_then(|c| c.primary())
            .ok_or_else(|| format!("no primary is available for shard {shard}"))
    };
    if !shards.has_decision_table(gid.decider, &prepared.database) {
        crate::exec::make_decision_table(app, shards, gid.decider, &prepared.database)
            .await
            .map_err(|e| e.message)?;
    }
    let decider = primary_of(gid.decider)?;
    // A decider still running holds its row: wait for it, but not for ever.
    let ask = format!("SET lock_timeout = '2s'; {}", gid.recovery_sql());
    let rows = run_sql_in(&decider, &config.cluster, &ctx, &prepared.database, &ask).await?;
    let committed = match rows.last().and_then(|r| r.first()).cloned().flatten() {
        Some(value) => value == "t" || value == "true",
        None => return Err("the decision row could not be read".into()),
    };
    let resolution = resolve(committed);
    let participant = primary_of(prepared.shard)?;
    let finish_sql = gid.finish_sql(resolution);
    match ask_node(
        &participant,
        &config.cluster,
        &ctx,
        &prepared.database,
        &finish_sql,
    )
    .await
    {
        Ok(_) => {}
        // Finished meanwhile by the pgherd that prepared it.
        Err(NodeSqlError::Refused(e)) if e.code == SqlState::UNDEFINED_OBJECT => return Ok(()),
        Err(e) => return Err(e.into()),
    }
    let done = match resolution {
        Resolution::Commit => "committed",
        Resolution::Rollback => "rolled back",
    };
    tracing::warn!(shard = prepared.shard, gid = %prepared.gid, "recovered a prepared transaction: {done} as shard {} decided", gid.decider);
    crate::failover::event(
        app,
        "two_phase_recovered",
        &format!("shard{}", prepared.shard),
        &format!(
            "prepared transaction {} on shard {} {done}, as shard {} decided",
            prepared.gid, prepared.shard, gid.decider
        ),
    );
    Ok(())
}

/// Removes the decision rows no prepared transaction needs, on every (shard, database) with a
/// decisions table: all of them read first, then every shard's prepared transactions listed
/// once (see `removable_decisions`).
async fn clean_decisions(app: &App, shards: &Shards) {
    let config = app.config();
    let ctx = app.connect_context();
    let old = format!(
        "SELECT gid FROM {DECISIONS_TABLE} \
         WHERE decided_at < now() - interval '{KEEP_DECISIONS_SECONDS} seconds'"
    );
    let mut tables = Vec::new();
    for (shard, database) in shards.decision_tables() {
        let Some(primary) = shards.cluster(shard).and_then(|c| c.primary()) else {
            continue;
        };
        match run_sql_in(&primary, &config.cluster, &ctx, &database, &old).await {
            Ok(rows) => {
                let decisions: Vec<String> = rows
                    .into_iter()
                    .filter_map(|row| row.into_iter().next().flatten())
                    .collect();
                if !decisions.is_empty() {
                    tables.push((primary, database, decisions));
                }
            }
            Err(e) => tracing::debug!(shard, database, error = %e, "old commit decisions not read"),
        }
    }
    if tables.is_empty() {
        return;
    }
    let (listed, every_shard) = list_prepared(app, shards).await;
    if !every_shard {
        // A shard not asked may hold one of them prepared.
        return;
    }
    let prepared: HashSet<String> = listed.into_iter().map(|p| p.gid).collect();
    for (primary, database, decisions) in tables {
        let removable = removable_decisions(&decisions, &prepared);
        if removable.is_empty() {
            continue;
        }
        let list: Vec<String> = removable.iter().map(|g| quote_literal(g)).collect();
        let delete = format!(
            "DELETE FROM {DECISIONS_TABLE} WHERE gid IN ({})",
            list.join(", ")
        );
        if let Err(e) = run_sql_in(&primary, &config.cluster, &ctx, &database, &delete).await {
            tracing::debug!(database, error = %e, "old commit decisions not removed yet");
        }
    }
}
