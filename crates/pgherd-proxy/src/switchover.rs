//! Planned role change with no lost transaction and no client error: new transactions wait at
//! pgherd, running ones finish, the old primary stops cleanly (so its last WAL reaches the
//! standbys), the target replays all of it and is promoted, the old primary restarts as its
//! standby and the other replicas follow; then the waiting transactions go to the new primary.
//!
//! The old primary must be managed by pgherd on this machine (`data_dir` in its node entry):
//! stopping and restarting it is done with PostgreSQL's own programs, as its OS user.

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgherd_cluster::{LocalNode, StopMode};
use pgherd_failover::control::Operation;
use pgherd_failover::{needs_repoint, Change};
use pgherd_route::balance::{format_lsn, parse_lsn, Lsn};
use pgherd_wire::{PgError, SqlState};

use crate::app::App;
use crate::failover::{carry_out, event, received, Seen};
use crate::monitor::check_once;
use crate::node_ops::{create_slot, first_value, primary_conninfo, promote, repoint, run_sql};
use crate::nodes::{NodeState, Nodes, Role};

/// How long the target may take to replay the old primary's last WAL.
const REPLAY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a node pgherd starts may take to accept connections.
pub(crate) const START_TIMEOUT: Duration = Duration::from_secs(60);

/// `node` as a node pgherd manages on this machine; an error saying why (`needed_for`) when
/// its entry has no `data_dir`.
pub(crate) fn managed_node(
    app: &App,
    node: &NodeState,
    needed_for: &str,
) -> Result<LocalNode, PgError> {
    let data_dir = node.config.data_dir.as_deref().ok_or_else(|| {
        PgError::error(
            SqlState::FEATURE_NOT_SUPPORTED,
            format!("{needed_for}, so pgherd must manage it on this machine"),
        )
        .with_hint("set data_dir in its [[nodes]] entry")
    })?;
    LocalNode::managed(
        node.name(),
        (&node.config.host, node.config.port),
        node.config.netns.as_deref(),
        data_dir,
        &app.config().cluster.user,
    )
    .map_err(|e| PgError::error(SqlState::SYSTEM_ERROR, e.to_string()))
}

/// Switches the primary over to `to` (or the most advanced streaming replica); returns what
/// was done, one sentence per step. The cluster is `to`'s (any shard's), or shard 0's.
pub async fn switchover(app: &Arc<App>, to: Option<&str>) -> Result<Vec<String>, PgError> {
    crate::dcs::must_lead(app)?;
    let cluster = match to.and_then(|name| app.node_named(name)) {
        Some((cluster, _)) => cluster,
        None => app.nodes.clone(),
    };
    let nodes = cluster.all();
    let old = cluster.writer().ok_or_else(|| {
        PgError::error(
            SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
            "no node accepts writes: there is no primary to switch over from",
        )
    })?;
    let local = managed_node(
        app,
        &old,
        &format!(
            "switchover stops and restarts the old primary {}",
            old.name()
        ),
    )?;
    // A replica that has just (re)joined streams before pgherd's next health check says so:
    // give the checks a moment before refusing.
    let waited = Instant::now();
    let target = loop {
        match choose_target(&cluster, &nodes, &old, to) {
            Ok(target) => break target,
            Err(e)
                if e.code == SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE
                    && to != Some(old.name())
                    && waited.elapsed() < TARGET_WAIT =>
            {
                let period = app.config().cluster.health_check_period_ms;
                tokio::time::sleep(Duration::from_millis(period.max(50))).await;
            }
            Err(e) => return Err(e),
        }
    };
    let Ok(_turn) = tokio::time::timeout(ROLE_CHANGE_WAIT, cluster.role_change.lock()).await else {
        return Err(PgError::error(
            SqlState::OBJECT_IN_USE,
            "another role change (a failover or PROMOTE) is under way",
        ));
    };
    if !cluster.change(Change::BeginSwitchover) {
        return Err(PgError::error(
            SqlState::OBJECT_IN_USE,
            "a switchover is already under way",
        ));
    }
    let mut run = Run {
        app,
        cluster: &cluster,
        steps: Vec::new(),
    };
    let result = run.steps(&nodes, &old, local, &target).await;
    cluster.change(Change::EndSwitchover);
    match result {
        Ok(()) => Ok(run.steps),
        Err(e) => {
            event(app, "switchover_failed", old.name(), &e);
            Err(PgError::error(
                SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!("switchover failed: {e}"),
            )
            .with_detail(run.steps.join("; ")))
        }
    }
}

/// How long an operator's role change waits for one under way (a failover turn that is
/// promoting) before it is refused.
pub(crate) const ROLE_CHANGE_WAIT: Duration = Duration::from_secs(10);

/// How long a switchover waits for a replica that streams (as pgherd's checks see it).
const TARGET_WAIT: Duration = Duration::from_secs(3);

/// The named replica, or the most advanced one streaming from the primary itself, then one
/// that cascades (priority breaks ties; priority 0 never).
fn choose_target(
    cluster: &Nodes,
    nodes: &[Arc<NodeState>],
    old: &NodeState,
    to: Option<&str>,
) -> Result<Arc<NodeState>, PgError> {
    let refuse = |msg: String| PgError::error(SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, msg);
    let streaming = |n: &NodeState| {
        n.health()
            .last_seen
            .is_some_and(|s| s.role == Role::Replica && s.upstream_streaming)
    };
    if let Some(name) = to {
        let node = nodes.iter().find(|n| n.name() == name).ok_or_else(|| {
            PgError::error(
                SqlState::UNDEFINED_OBJECT,
                format!("no node named \"{name}\""),
            )
        })?;
        if node.name() == old.name() {
            return Err(refuse(format!("{name} is the primary already")));
        }
        if !cluster.usable_as(node, Role::Replica) {
            return Err(refuse(format!(
                "{name} cannot become the primary: it is not an answering replica ({})",
                node.describe()
            )));
        }
        if !streaming(node) {
            return Err(refuse(format!(
                "{name} does not stream from {}: it could miss WAL",
                old.name()
            )));
        }
        return Ok(node.clone());
    }
    // One that streams from the primary itself before one that cascades from a replica.
    let direct = |n: &NodeState| {
        n.upstream_among(nodes)
            .is_none_or(|upstream| upstream == old.name())
    };
    nodes
        .iter()
        .filter(|n| cluster.usable_as(n, Role::Replica) && n.config.priority > 0 && streaming(n))
        .max_by_key(|n| (direct(n), n.lsn(), n.config.priority))
        .cloned()
        .ok_or_else(|| refuse("no replica streams from the primary and may be promoted".into()))
}

/// The replicas that must follow the target once it is promoted: those that streamed from the
/// old primary or from where pgherd cannot tell ([`pgherd_failover::needs_repoint`]); one
/// that cascades from another replica, or from the target, keeps its upstream.
fn followers(
    cluster: &Nodes,
    nodes: &[Arc<NodeState>],
    old: &NodeState,
    target: &NodeState,
) -> Vec<Arc<NodeState>> {
    let old_index = nodes.iter().position(|n| n.id == old.id);
    let seen = Seen::now(cluster, nodes, old_index);
    let view = seen.view();
    nodes
        .iter()
        .enumerate()
        .filter(|(_, n)| n.id != old.id && n.id != target.id)
        // The target has every WAL record the old primary wrote once it stopped cleanly.
        .filter(|&(i, _)| needs_repoint(&view, i, old_index, Lsn::MAX))
        .map(|(_, n)| n.clone())
        .collect()
}

struct Run<'a> {
    app: &'a Arc<App>,
    cluster: &'a Arc<Nodes>,
    steps: Vec<String>,
}

impl Run<'_> {
    fn step(&mut self, kind: &'static str, node: &str, text: String) {
        tracing::warn!(node, step = %text, "switchover");
        event(self.app, kind, node, &text);
        self.steps.push(text);
    }

    async fn steps(
        &mut self,
        nodes: &[Arc<NodeState>],
        old: &Arc<NodeState>,
        local: LocalNode,
        target: &Arc<NodeState>,
    ) -> Result<(), String> {
        let app = self.app;
        let config = app.config();
        let cluster = &config.cluster;
        let ctx = app.connect_context();
        // Read while every replica still streams from where it did: afterwards the old
        // primary's replicas have lost their upstream and look alike.
        let followers = followers(self.cluster, nodes, old, target);
        self.step(
            "switchover_started",
            old.name(),
            format!(
                "switching over from {} to {}: new transactions wait",
                old.name(),
                target.name()
            ),
        );
        let drain = Duration::from_millis(config.failover.switchover_drain_ms);
        let started = Instant::now();
        let mut watch = None;
        let mut left = busy_sessions(app, old, &mut watch, drain).await;
        while left > 0 && started.elapsed() < drain {
            tokio::time::sleep(Duration::from_millis(20)).await;
            left = busy_sessions(
                app,
                old,
                &mut watch,
                drain.saturating_sub(started.elapsed()),
            )
            .await;
        }
        self.step(
            "drained",
            old.name(),
            if left == 0 {
                format!(
                    "transactions on {} finished in {} ms",
                    old.name(),
                    started.elapsed().as_millis()
                )
            } else {
                format!(
                    "{left} session(s) still held {} after {} ms; stopping it ends them",
                    old.name(),
                    drain.as_millis()
                )
            },
        );
        app.drop_idle_connections(old);

        let node = local.clone();
        blocking(move || node.stop(StopMode::Fast)).await?;
        self.cluster.mark_stopped(old, "stopped for a switchover");
        let node = local.clone();
        let last = blocking(move || node.checkpoint_lsn()).await?;
        let last_lsn =
            parse_lsn(&last).ok_or_else(|| format!("unreadable checkpoint LSN {last}"))?;
        self.step(
            "stopped",
            old.name(),
            format!(
                "{} stopped cleanly; its last WAL ends at {last}",
                old.name()
            ),
        );

        if let Err(e) = wait_replayed(app, target, last_lsn).await {
            self.restart_as_primary(&local, old).await;
            return Err(e);
        }
        self.step(
            "caught_up",
            target.name(),
            format!("{} replayed all of {}'s WAL", target.name(), old.name()),
        );

        if let Err(e) = promote(app, self.cluster, target).await {
            // Only a target that still answers as a standby proves the old primary may take
            // writes again; otherwise two primaries could result.
            let mut conn = None;
            let seen = check_once(target, cluster, &ctx, &mut conn).await;
            if matches!(seen, Ok(s) if s.role == Role::Replica) {
                self.restart_as_primary(&local, old).await;
                return Err(e);
            }
            return Err(format!(
                "{e}; {} is left stopped: check {} and rejoin one of them",
                old.name(),
                target.name()
            ));
        }
        let Some(index) = nodes.iter().position(|n| n.id == target.id) else {
            return Err(format!("{} left the config", target.name()));
        };
        // Its synchronous standbys first, then the election: a failure to set them leaves
        // writes held until the keeper sets them.
        let _ = carry_out(
            app,
            self.cluster,
            &config,
            nodes,
            Operation::elect_promoted(index, received(target).max(target.lsn())),
        )
        .await;
        self.step(
            "promoted",
            target.name(),
            format!("promoted {}; writes go to it now", target.name()),
        );

        // The old primary follows the new one from where it stopped: no rewind is needed
        // after a clean shutdown whose WAL the target replayed.
        let slot = pgherd_cluster::slot_name(old.name());
        create_slot(cluster, &ctx, target, &slot).await?;
        let conninfo = primary_conninfo(&config, target, old.name());
        let node = local.clone();
        blocking(move || {
            node.make_standby(&conninfo, Some(&slot))?;
            node.start(START_TIMEOUT)
        })
        .await?;
        self.step(
            "rejoined",
            old.name(),
            format!("{} restarted as a standby of {}", old.name(), target.name()),
        );
        for follower in followers
            .iter()
            .filter(|n| self.cluster.usable_as(n, Role::Replica))
        {
            match repoint(&config, &ctx, follower, target).await {
                Ok(()) => self.step(
                    "repointed",
                    follower.name(),
                    format!("{} follows {} now", follower.name(), target.name()),
                ),
                Err(e) => self.step(
                    "repoint_failed",
                    follower.name(),
                    format!("{} cannot follow {}: {e}", follower.name(), target.name()),
                ),
            }
        }
        self.step(
            "switched_over",
            target.name(),
            format!(
                "switched over from {} to {} in {} ms",
                old.name(),
                target.name(),
                started.elapsed().as_millis()
            ),
        );
        Ok(())
    }

    /// Undoes a switchover that failed before the promotion: the old primary, unchanged,
    /// takes writes again.
    async fn restart_as_primary(&mut self, local: &LocalNode, old: &NodeState) {
        let node = local.clone();
        match blocking(move || node.start(START_TIMEOUT)).await {
            Ok(()) => self.step(
                "switchover_aborted",
                old.name(),
                format!("{} restarted as the primary; nothing changed", old.name()),
            ),
            Err(e) => self.step(
                "switchover_aborted",
                old.name(),
                format!("{} could not be restarted: {e}", old.name()),
            ),
        }
    }
}

/// How many sessions run something on `old`: a query, or a transaction not ended (a state
/// this role may not see counts as running). An idle session-mode connection holds the node
/// but owes nothing, so the drain does not wait for it (writes wait meanwhile, and would wait
/// the whole drain for sessions that never end). Asked over one connection (`watch`), within
/// `time_left`; without an answer, what pgherd lends counts.
async fn busy_sessions(
    app: &App,
    old: &NodeState,
    watch: &mut Option<crate::server::ServerConn>,
    time_left: Duration,
) -> u32 {
    if old.outstanding() == 0 {
        return 0;
    }
    let config = app.config();
    let asked = tokio::time::timeout(time_left, async {
        if watch.is_none() {
            *watch = crate::monitor::management_connection(
                old,
                &config.cluster,
                &app.connect_context(),
                &config.cluster.database,
            )
            .await
            .ok();
        }
        let conn = watch.as_mut()?;
        conn.simple_query(
            "SELECT count(*) FROM pg_catalog.pg_stat_activity \
             WHERE backend_type = 'client backend' \
             AND coalesce(state, 'active') <> 'idle' \
             AND pid <> pg_catalog.pg_backend_pid()",
        )
        .await
        .ok()
    })
    .await;
    match asked {
        Ok(Some(rows)) => first_value(&rows)
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| old.outstanding()),
        _ => {
            *watch = None;
            old.outstanding()
        }
    }
}

/// Waits until `target` has replayed WAL up to `lsn`.
async fn wait_replayed(app: &App, target: &NodeState, lsn: Lsn) -> Result<(), String> {
    let config = app.config();
    let ctx = app.connect_context();
    let started = Instant::now();
    let mut replayed = 0;
    while started.elapsed() < REPLAY_TIMEOUT {
        let rows = run_sql(
            target,
            &config.cluster,
            &ctx,
            "SELECT pg_last_wal_replay_lsn()",
        )
        .await?;
        replayed = first_value(&rows).and_then(parse_lsn).unwrap_or(0);
        if replayed >= lsn {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Err(format!(
        "{} replayed only up to {} of {} within {} s",
        target.name(),
        format_lsn(replayed),
        format_lsn(lsn),
        REPLAY_TIMEOUT.as_secs()
    ))
}

/// Runs a PostgreSQL program (pg_ctl, pg_controldata) off the async workers.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, pgherd_cluster::ClusterError> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(f).await {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(e) => Err(format!("the task running a PostgreSQL program failed: {e}")),
    }
}
