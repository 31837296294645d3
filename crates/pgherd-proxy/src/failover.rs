//! Carries out failover decisions: every check period, what the node monitors saw becomes a
//! `pgherd_failover::View`, `decide` gives one verdict, and this task acts on it: elect,
//! fence, or promote the chosen replica with `pg_promote()` and re-point the others. The
//! decision rules live in the pure `pgherd-failover` crate; this is their IO shell.
//!
//! The same task keeps the primary's synchronous standby set in `sync` and `strict`
//! durability ([`SyncKeeper`]): which standbys hold acknowledged commits is what failover may
//! promote in those modes.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use pgherd_config::Config;
use pgherd_failover::control::{Context, Io, Member, Operation, Outcome};
use pgherd_failover::fenced::{returning, FencedCare, FencedNode};
use pgherd_failover::keeper::{
    sync_awaited, sync_eligible, sync_holders, KeeperInput, KeeperStep, SyncHolders,
    SyncKeeper as PureKeeper,
};
use pgherd_failover::{decide, ClusterState, NodeId, NodeView, Policy, SyncSet, Verdict, View};

use crate::app::App;
use crate::node_ops::{promote, quote_literal, repoint, run_sql, seal};
use crate::nodes::{NodeState, Nodes, Role};

/// Runs until shutdown for one cluster: `App::nodes`, or another shard's. Decides nothing while
/// `[failover] enabled` is false, but still keeps the synchronous standbys and seals fenced
/// nodes that answer again.
pub async fn run(app: Arc<App>, cluster: Arc<Nodes>) {
    let mut stop = app.shutdown_signal();
    let mut last_sentence = String::new();
    let mut keeper = KeeperShell::new();
    let fenced_care = Arc::new(SharedCare {
        care: parking_lot::Mutex::new(FencedCare::default()),
        // The task's one clock: the keeper's.
        clock: keeper.started,
    });
    // The first turn runs at once: writes wait for the synchronous standby set, and the
    // initial node check has just given this task what it needs to put the set in force.
    let mut first_turn = true;
    loop {
        let config = app.config();
        if !std::mem::take(&mut first_turn) {
            let period = Duration::from_millis(config.cluster.health_check_period_ms);
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = stop.changed() => return,
            }
        }
        if *stop.borrow() {
            return;
        }
        // Every instance, leading or not, failover on or off: the sessions are this one's.
        crate::cut_off_sessions::end_cut_off_sessions(&app, &cluster.all());
        if cluster.is_switching() {
            // The switchover moves the primary itself; nodes stop and start on purpose.
            continue;
        }
        if !app.may_act() {
            // Another instance leads: it decides, and this one routes by its view.
            continue;
        }
        // A PROMOTE or switchover the operator started acts alone; this turn waits for it.
        let _turn = cluster.role_change.lock().await;
        // An upgrade may have given the duty away meanwhile.
        if cluster.is_switching() || !app.may_act() {
            continue;
        }
        let nodes = cluster.all();
        if config.failover.enabled {
            decide_and_act(&app, &cluster, &config, &nodes, &mut last_sentence).await;
        }
        seal_fenced(&app, &cluster, &config, &nodes, &fenced_care).await;
        // After the decision, so a primary elected in this turn gets its synchronous standbys
        // (and takes writes) now rather than a period later.
        if let Some(primary) = cluster
            .writer()
            .and_then(|p| nodes.iter().position(|n| n.name() == p.name()))
        {
            keeper.keep(&app, &cluster, &config, &nodes, primary).await;
        }
    }
}

/// One failover turn: the verdict on what the monitors saw, acted on.
async fn decide_and_act(
    app: &Arc<App>,
    cluster: &Nodes,
    config: &Config,
    nodes: &[Arc<NodeState>],
    last_sentence: &mut String,
) {
    let seen = Seen::now(cluster, nodes, None);
    let view = seen.view();
    let elected = view.elected;
    let verdict = decide(&policy(config), &view);
    let sentence = verdict.sentence(&view);
    if sentence != *last_sentence {
        match verdict {
            Verdict::PrimaryUp | Verdict::Elect { .. } => {
                tracing::info!(decision = %sentence, "failover")
            }
            _ => tracing::warn!(decision = %sentence, "failover"),
        }
        let node = match &verdict {
            Verdict::Elect { node } | Verdict::Fence { node } => nodes[*node].name(),
            Verdict::Promote { candidate, .. } => nodes[*candidate].name(),
            _ => elected.map_or("", |i| nodes[i].name()),
        };
        event(app, kind(&verdict), node, &sentence);
        *last_sentence = sentence;
    }
    let members = members(nodes);
    let Some(operation) = Operation::for_verdict(&verdict, &view, &members) else {
        return;
    };
    drop(members);
    // A failed promotion leaves the fenced old primary elected: the next turn decides again.
    if carry_out(app, cluster, config, nodes, operation)
        .await
        .is_err()
    {
        tracing::warn!("the promotion is retried at the next check");
    }
}

/// The care of fenced nodes, shared with the rejoins it starts in the background (which tell
/// it when they fail), and the clock its retry times count from.
struct SharedCare {
    care: parking_lot::Mutex<FencedCare>,
    clock: std::time::Instant,
}

impl SharedCare {
    fn now_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64
    }
}

/// Makes fenced nodes that answer again (a replaced primary restarted) refuse writes, and
/// rejoins them when configured (`pgherd_failover::fenced` decides which). Whoever fenced them
/// (failover, `PROMOTE`), and whether failover is on or not.
async fn seal_fenced(
    app: &Arc<App>,
    cluster: &Nodes,
    config: &Config,
    nodes: &[Arc<NodeState>],
    shared: &Arc<SharedCare>,
) {
    let state = cluster.view();
    let fenced = fenced_nodes(config, nodes);
    let to_seal = shared.care.lock().to_seal(&state, &fenced);
    for id in to_seal {
        let (Some(node), Some(fenced_node)) = (
            nodes.iter().find(|n| n.id == id),
            fenced.iter().find(|n| n.id == id),
        ) else {
            continue;
        };
        if !seal(&config.cluster, &app.connect_context(), node).await {
            continue;
        }
        event(
            app,
            "sealed",
            node.name(),
            "set read-only (default_transaction_read_only) and its client sessions ended",
        );
        let rejoin = shared.care.lock().sealed(fenced_node);
        if rejoin {
            rejoin_in_background(app, shared, id, node.name());
        }
    }
    let due = shared
        .care
        .lock()
        .to_retry(&state, &fenced, shared.now_ms());
    for id in due {
        if let Some(node) = nodes.iter().find(|n| n.id == id) {
            tracing::info!(node = node.name(), "rejoining again after a failed rejoin");
            rejoin_in_background(app, shared, id, node.name());
        }
    }
}

/// The nodes as the care of fenced nodes (`pgherd_failover::fenced`) needs them.
fn fenced_nodes(config: &Config, nodes: &[Arc<NodeState>]) -> Vec<FencedNode> {
    nodes
        .iter()
        .map(|n| FencedNode {
            id: n.id,
            answers: n.answers(),
            rejoining: n.is_rejoining(),
            rejoined_automatically: config.failover.auto_rejoin && n.config.data_dir.is_some(),
        })
        .collect()
}

/// Rejoins a fenced node in the background (rewinding can take a while and failover must go
/// on); a failure is told to the care, which tries again later.
fn rejoin_in_background(app: &Arc<App>, shared: &Arc<SharedCare>, id: NodeId, name: &str) {
    let (app, name, shared) = (app.clone(), name.to_owned(), shared.clone());
    tokio::spawn(async move {
        if let Err(e) = crate::rejoin::rejoin(&app, &name).await {
            let wait_ms = shared.care.lock().rejoin_failed(id, shared.now_ms());
            tracing::error!(node = %name, error = %e.message, retry_in_ms = wait_ms, "automatic rejoin failed; the node stays fenced and is rejoined again later (or by REJOIN)");
        }
    });
}

pub(crate) fn policy(config: &Config) -> Policy {
    Policy {
        failures_before_down: config.cluster.health_check_failures_before_down,
        max_lag_on_failover_bytes: config.failover.max_lag_on_failover_bytes,
        durability: config.replication.durability,
    }
}

/// What the monitors saw and the cluster view said at one moment, for the decision crate.
pub(crate) struct Seen {
    nodes: Vec<NodeView>,
    elected: Option<usize>,
    last_primary_lsn: Option<u64>,
    holders: SyncHolders,
}

impl Seen {
    /// `primary`: the node to treat as the primary when none is elected (manual promotion
    /// with failover off: the one last seen as primary).
    pub(crate) fn now(cluster: &Nodes, nodes: &[Arc<NodeState>], primary: Option<usize>) -> Seen {
        let state = cluster.view();
        let elected = state
            .elected
            .and_then(|id| nodes.iter().position(|n| n.id == id))
            .or(primary);
        let holders = holders(&state, nodes, elected);
        Seen {
            nodes: nodes.iter().map(|n| view_of(n, &state, nodes)).collect(),
            elected,
            last_primary_lsn: elected.map(|i| nodes[i].lsn()),
            holders,
        }
    }

    pub(crate) fn view(&self) -> View<'_> {
        View {
            nodes: &self.nodes,
            elected: self.elected,
            last_primary_lsn: self.last_primary_lsn,
            synchronous: &self.holders.members,
            sync_quorum: self.holders.quorum,
            sync_since_lsn: self.holders.since_lsn,
        }
    }
}

/// What `decide` is told about the synchronous set (`pgherd_failover::keeper::sync_holders`).
fn holders(state: &ClusterState, nodes: &[Arc<NodeState>], elected: Option<usize>) -> SyncHolders {
    let ids: Vec<(pgherd_failover::NodeId, &str)> =
        nodes.iter().map(|n| (n.id, n.name())).collect();
    sync_holders(state, &ids, elected)
}

/// Keeps `synchronous_standby_names` on the primary as `pgherd_failover::SyncKeeper` decides
/// each turn (`ANY k (standbys streaming now)`, with a grace period for a new primary's
/// standbys) and carries out its steps: SQL on the primary, changes to the cluster view.
struct KeeperShell {
    keeper: PureKeeper,
    /// The keeper's clock: milliseconds since this task started.
    started: std::time::Instant,
    /// Standbys streaming under a name no node has, reported once each.
    unknown_reported: HashSet<String>,
}

impl KeeperShell {
    fn new() -> Self {
        KeeperShell {
            keeper: PureKeeper::default(),
            started: std::time::Instant::now(),
            unknown_reported: HashSet::new(),
        }
    }

    async fn keep(
        &mut self,
        app: &App,
        cluster: &Nodes,
        config: &Config,
        nodes: &[Arc<NodeState>],
        primary: usize,
    ) {
        let primary = &nodes[primary];
        let Some(seen) = primary
            .health()
            .last_seen
            .filter(|s| s.role == Role::Primary)
        else {
            return;
        };
        let streaming = seen.streaming_standbys;
        for name in &streaming {
            if !nodes.iter().any(|n| n.name() == name) && self.unknown_reported.insert(name.clone())
            {
                tracing::warn!(primary = primary.name(), standby = %name, "a standby streams under a name that is no node's: it cannot be made synchronous; set application_name to its node name in its primary_conninfo");
            }
        }
        let view = cluster.view();
        let members = members(nodes);
        let eligible = sync_eligible(&view, &members, primary.id);
        let returning = returning(&view, &fenced_nodes(config, nodes));
        let awaited = sync_awaited(
            config.replication.durability,
            &view,
            &members,
            primary.id,
            &returning,
        );
        let input = KeeperInput {
            durability: config.replication.durability,
            sync_standbys: config.replication.sync_standbys as usize,
            synchronous_commit: config.replication.synchronous_commit.as_str(),
            primary: primary.id,
            primary_lsn: primary.lsn(),
            streaming: &streaming,
            eligible: &eligible,
            awaited: &awaited,
            now_ms: self.started.elapsed().as_millis() as u64,
        };
        match self.keeper.turn(&view, &input) {
            KeeperStep::Settled(changes) => {
                for change in changes {
                    cluster.change(change);
                }
            }
            KeeperStep::Apply {
                before,
                set,
                after,
                event: (kind, detail),
            } => {
                for change in before {
                    cluster.change(change);
                }
                // A successor must know which sets may be in force (a set emptied while no
                // standby streams, above all) before the primary acknowledges under it.
                if let Err(e) = recorded(app, cluster, &cluster.view()).await {
                    tracing::warn!(node = primary.name(), error = %e, "synchronous standbys not changed: the view could not be recorded in etcd");
                    return;
                }
                if let Err(e) = apply_sync_set(app, config, primary, &set).await {
                    tracing::warn!(node = primary.name(), error = %e, "cannot set the synchronous standbys; trying again at the next check");
                    return;
                }
                tracing::info!(node = primary.name(), %detail, "synchronous standbys set");
                event(app, kind, primary.name(), &detail);
                for change in after {
                    cluster.change(change);
                }
            }
        }
    }
}

/// Sets `node`'s synchronous standbys to `set` and reloads it.
async fn apply_sync_set(
    app: &App,
    config: &Config,
    node: &NodeState,
    set: &SyncSet,
) -> Result<(), String> {
    let ctx = app.connect_context();
    let statements = [
        format!(
            "ALTER SYSTEM SET synchronous_standby_names = {}",
            quote_literal(&set.setting())
        ),
        format!(
            "ALTER SYSTEM SET synchronous_commit = {}",
            quote_literal(config.replication.synchronous_commit.as_str())
        ),
        "SELECT pg_reload_conf()".to_owned(),
    ];
    // The loop that decides failover waits for these: a primary that goes silent in the
    // middle of one (cut off, stopped) must not hold it longer than it takes to be marked
    // down. What was not applied is applied at a later turn.
    let limit = upkeep_limit(config);
    for sql in &statements {
        tokio::time::timeout(limit, run_sql(node, &config.cluster, &ctx, sql))
            .await
            .map_err(|_| {
                format!(
                    "{} did not answer within {} ms",
                    node.name(),
                    limit.as_millis()
                )
            })??;
    }
    Ok(())
}

/// How long a statement of the failover loop's upkeep may wait for a node: as long as
/// health checks take to mark it down.
fn upkeep_limit(config: &Config) -> Duration {
    let cluster = &config.cluster;
    Duration::from_millis(
        cluster
            .health_check_timeout_ms
            .saturating_mul(u64::from(cluster.health_check_failures_before_down.max(1))),
    )
}

/// One word for a verdict in the event list.
fn kind(verdict: &Verdict) -> &'static str {
    match verdict {
        Verdict::PrimaryUp => "primary_up",
        Verdict::Suspect { .. } => "suspect",
        Verdict::PrimaryDemoted => "demoted",
        Verdict::Guarded { .. } => "guarded",
        Verdict::NotConfirmed { .. } => "not_confirmed",
        Verdict::NoCandidate { .. } => "no_candidate",
        Verdict::SyncQuorumLost { .. } => "sync_quorum_lost",
        Verdict::Settling { .. } => "settling",
        Verdict::Promote { .. } => "promoting",
        Verdict::Elect { .. } => "elected",
        Verdict::Ambiguous { .. } => "ambiguous",
        Verdict::Fence { .. } => "fencing",
        Verdict::NoPrimary => "no_primary",
    }
}

pub(crate) fn event(app: &App, kind: &'static str, node: &str, detail: &str) {
    let config = app.config();
    app.events.record(
        kind,
        node,
        detail,
        config.failover.notify_command.as_deref(),
    );
}

/// What the monitors last saw of a node, in the decision crate's terms.
fn view_of(node: &NodeState, state: &ClusterState, nodes: &[Arc<NodeState>]) -> NodeView {
    let upstream = node.upstream_among(nodes);
    let health = node.health();
    NodeView {
        upstream,
        name: node.name().to_owned(),
        // A detached replica is never promoted, but its WAL still counts: if it holds the
        // newest acknowledged commit, no other standby is promoted in its place.
        priority: if state.is_detached(node.id) {
            0
        } else {
            node.config.priority
        },
        check: health.track.check(),
        consecutive_failures: health.track.failed_streak(),
        fenced: state.is_fenced(node.id),
    }
}

/// The nodes as a [`Operation`]'s steps need them.
pub(crate) fn members(nodes: &[Arc<NodeState>]) -> Vec<Member<'_>> {
    nodes
        .iter()
        .map(|n| Member {
            id: n.id,
            name: n.name(),
            may_be_sync: n.config.sync,
            received_lsn: received(n),
        })
        .collect()
}

/// Carries `operation` out (`pgherd_failover::control`): each step's changes go to the cluster
/// view, its events to the event list, and its IO is performed here, the outcome fed back.
/// Failover's verdicts, `PROMOTE` and switchover's election all come here. Returns what was
/// done, a sentence each, or why the operation failed.
pub(crate) async fn carry_out(
    app: &Arc<App>,
    cluster: &Nodes,
    config: &Config,
    nodes: &[Arc<NodeState>],
    mut operation: Operation,
) -> Result<Vec<String>, String> {
    let mut outcome = None;
    loop {
        let step = {
            let state = cluster.view();
            let members = members(nodes);
            operation.step(
                outcome.take(),
                &Context {
                    state: &state,
                    members: &members,
                    durability: config.replication.durability,
                    sync_standbys: config.replication.sync_standbys as usize,
                },
            )
        };
        // An instance that lost the lead while an IO ran (stopped, cut off from etcd) leaves
        // the rest to the leader: its changes would be a view no leader wrote.
        if !step.changes.is_empty() && !app.may_act() {
            tracing::error!("this instance no longer leads the cluster: the operation stops here, the leader decides again");
            return Err("this instance no longer leads the cluster".to_owned());
        }
        // Writes go to a new primary only by a view in etcd: a successor must know of the
        // commits it takes, or it would fence it and rewind them away.
        if ClusterState::elects(&step.changes) {
            let next = cluster.view().after_all(&step.changes);
            if let Err(e) = recorded(app, cluster, &next).await {
                tracing::error!(error = %e, "the new primary is not elected: the view could not be recorded in etcd; the leader decides again");
                return Err(e);
            }
        }
        for change in step.changes {
            cluster.change(change);
        }
        for e in step.events {
            let node = nodes[e.node].name();
            match e.kind {
                "repointed" => tracing::info!(node, detail = %e.detail, "{}", e.kind),
                _ => tracing::warn!(node, detail = %e.detail, "{}", e.kind),
            }
            event(app, e.kind, node, &e.detail);
        }
        let Some(io) = step.io else {
            return operation.finish();
        };
        outcome = Some(match agreed(app, cluster, &io).await {
            Ok(()) => perform(app, cluster, config, nodes, io).await,
            Err(e) => {
                tracing::error!(error = %e, ?io, "not done: the decision could not be recorded in etcd");
                Outcome::Failed(e)
            }
        });
    }
}

/// With several instances, the view that led to an IO on a node is in etcd before the IO
/// runs, so an instance that takes over knows of it (a promotion under way, a fenced
/// primary); an instance that lost the lead does nothing. Before a promotion, every other
/// instance that holds a lease routes by that view too, so none sends writes to the old
/// primary any more (`pgherd_failover::agreement`). Cutting a node off pgherd's own traffic
/// needs no agreement.
async fn agreed(app: &App, cluster: &Nodes, io: &Io) -> Result<(), String> {
    if matches!(io, Io::CutOff { .. }) {
        return Ok(());
    }
    let state = cluster.view();
    recorded(app, cluster, &state).await?;
    match (agreeing(app, cluster), io) {
        // The others follow the view just recorded (or a newer one); the wait may be long (a
        // failsafe), so the lead is checked again after it.
        (Some(dcs), Io::Promote { .. }) => {
            dcs.await_followers(state.version)
                .await
                .map_err(|e| e.to_string())?;
            still_leads(dcs)
        }
        _ => Ok(()),
    }
}

/// With several instances: this one still leads, and `state` is the view in etcd.
async fn recorded(app: &App, cluster: &Nodes, state: &ClusterState) -> Result<(), String> {
    let Some(dcs) = agreeing(app, cluster) else {
        return Ok(());
    };
    still_leads(dcs)?;
    dcs.publish(app, state).await.map_err(|e| e.to_string())
}

/// The instances' agreement, for the one cluster it is about: `App::nodes` (config refuses
/// `[sharding]` with `[dcs]`, and another shard's view is never written to etcd as the
/// cluster's).
fn agreeing<'a>(app: &'a App, cluster: &Nodes) -> Option<&'a Arc<crate::dcs::Dcs>> {
    app.dcs
        .as_ref()
        .filter(|_| std::ptr::eq(cluster, Arc::as_ptr(&app.nodes)))
}

fn still_leads(dcs: &crate::dcs::Dcs) -> Result<(), String> {
    if dcs.is_leader() {
        Ok(())
    } else {
        Err(format!(
            "{} does not lead the cluster any more",
            dcs.instance
        ))
    }
}

/// One IO of an operation, on the real nodes.
async fn perform(
    app: &Arc<App>,
    cluster: &Nodes,
    config: &Config,
    nodes: &[Arc<NodeState>],
    io: Io,
) -> Outcome {
    let failed = |what: &str, node: &NodeState, e: String| {
        tracing::error!(node = node.name(), error = %e, "{what}");
        Outcome::Failed(e)
    };
    match io {
        Io::CutOff { node, newly } => {
            cut_off(app, &nodes[node], newly);
            Outcome::Done
        }
        Io::Repoint { follower, primary } => {
            let (follower, primary) = (&nodes[follower], &nodes[primary]);
            match repoint(config, &app.connect_context(), follower, primary).await {
                Ok(()) => Outcome::Done,
                Err(e) => failed(
                    "cannot re-point the replica to the new primary",
                    follower,
                    e,
                ),
            }
        }
        Io::Promote { node } => {
            let node = &nodes[node];
            match promote(app, cluster, node).await {
                // promote() recorded the check that saw it a primary.
                Ok(()) => Outcome::Promoted {
                    received_lsn: received(node).max(node.lsn()),
                },
                Err(e) => failed("promotion did not complete", node, e),
            }
        }
        Io::SetSyncSet { node, set } => {
            let node = &nodes[node];
            match apply_sync_set(app, config, node, &set).await {
                Ok(()) => Outcome::Done,
                Err(e) => failed(
                    "cannot set the new primary's synchronous standbys; the keeper tries again",
                    node,
                    e,
                ),
            }
        }
    }
}

/// How far a node had received WAL at its last good check.
pub(crate) fn received(node: &NodeState) -> u64 {
    node.health().track.received_lsn()
}

/// No more traffic through pgherd to `node`, which the view says is fenced; `newly` fenced,
/// the fence hook runs. Making it refuse writes is `node_ops::seal`'s, once it answers, so a primary
/// that was replaced cannot take writes from anyone.
fn cut_off(app: &App, node: &NodeState, newly: bool) {
    if newly {
        let config = app.config();
        if let Some(command) = config.failover.fence_command.as_deref() {
            crate::events::run_hook(
                "fence command",
                command,
                vec![
                    ("PGHERD_NODE", node.name().to_owned()),
                    ("PGHERD_HOST", node.config.host.clone()),
                    ("PGHERD_PORT", node.config.port.to_string()),
                    (
                        "PGHERD_DATA_DIR",
                        node.config
                            .data_dir
                            .as_ref()
                            .map(|d| d.display().to_string())
                            .unwrap_or_default(),
                    ),
                ],
            );
        }
    }
    end_sessions_on(
        app,
        node,
        &format!(
            "node {} was fenced by failover while this session used it",
            node.name()
        ),
    );
}

/// Drops the idle server connections to `node` and ends the client sessions using it, saying
/// `why`. Sessions in the middle of a request there may wait forever on a hung server; they
/// end now (their clients reconnect and reach the new primary).
pub(crate) fn end_sessions_on(app: &App, node: &NodeState, why: &str) {
    app.drop_idle_connections(node);
    let mut ended = 0;
    for client in app.clients.all() {
        if client.runs_on(node) {
            client.kill(why.to_owned());
            ended += 1;
        }
    }
    if ended > 0 {
        tracing::warn!(
            node = node.name(),
            sessions = ended,
            reason = why,
            "sessions using the node ended"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/ha.md's decision table names every verdict's event word.
    #[test]
    fn every_verdict_is_in_the_ha_doc() {
        let doc = include_str!("../../../docs/ha.md");
        let verdicts = [
            Verdict::PrimaryUp,
            Verdict::Suspect {
                failures: 1,
                needed: 3,
            },
            Verdict::PrimaryDemoted,
            Verdict::Guarded {
                seen_by: Vec::new(),
            },
            Verdict::NotConfirmed {
                confirmed: 0,
                needed: 1,
            },
            Verdict::NoCandidate {
                rejected: Vec::new(),
            },
            Verdict::SyncQuorumLost {
                answering: 0,
                needed: 1,
            },
            Verdict::Settling {
                replicas: Vec::new(),
            },
            Verdict::Promote {
                candidate: 0,
                old: 1,
                followers: Vec::new(),
            },
            Verdict::Elect { node: 0 },
            Verdict::Ambiguous {
                writable: Vec::new(),
            },
            Verdict::Fence { node: 0 },
            Verdict::NoPrimary,
        ];
        for verdict in &verdicts {
            let row = format!("| `{}` |", kind(verdict));
            assert!(doc.contains(&row), "docs/ha.md has no row {row}");
        }
    }

    /// The failover decisions reach the cluster view only as `control::Operation` steps and
    /// keeper steps, which the seeded simulation drives too: no other code in the proxy
    /// elects, promotes or changes the synchronous set (tests, and `nodes.rs`, which applies
    /// and logs changes, aside).
    #[test]
    fn failover_changes_come_only_from_the_pure_steps() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let decided_only = [
            "Change::Elect",
            "Change::BeginPromotion",
            "Change::AbandonPromotion",
            "Change::SyncInForce",
            "Change::SyncPending",
            "Change::SyncChanging",
            "Change::StrictWithoutStandby",
        ];
        let mut files = vec![src.clone()];
        let mut found = Vec::new();
        while let Some(path) = files.pop() {
            if path.is_dir() {
                files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
                continue;
            }
            // The view's writer names every change to log it.
            if path.ends_with("nodes.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            let code = text.split("#[cfg(test)]").next().unwrap();
            for change in decided_only {
                if code.contains(change) {
                    found.push(format!("{} uses {change}", path.display()));
                }
            }
        }
        assert!(found.is_empty(), "{found:#?}");
    }
}
