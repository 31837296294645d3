//! Where a sharded session's statements run within a shard. Outside a transaction block a read
//! goes to a node of its shard's cluster as the unsharded relay would choose one
//! (`pgherd_route::plan::choose_node`: the balance policy, the lag limits, read-your-writes);
//! writes and transaction blocks stay on the shards' primaries.
//!
//! Read-your-writes holds per shard: a write sent to a shard makes its replicas unusable for the
//! session until the write's end is known; once it committed, the primary's WAL position is
//! asked, and that shard's replicas serve the session again when they have replayed it.

use std::sync::Arc;
use std::time::Duration;

use pgherd_config::{Balance, Route};
use pgherd_route::balance::{insert_lsn_as_end, parse_lsn, Lsn};
use pgherd_route::plan::{choose_node, NoNode, SessionRouting};
use pgherd_route::{Routed, Target};
use pgherd_wire::{PgError, SqlState};

use super::link::{Link, OpenError};
use super::ShardedSession;
use crate::app::App;
use crate::nodes::{NodeState, Nodes, Role};
use crate::pool::AcquireError;
use crate::relay::{read_needs, RoutingSetup};

/// Replicas a read tries on one shard, at most, before it goes to the primary.
const MAX_REPLICA_FAILURES: u32 = 3;

/// What pgherd asks a shard's primary after the session's write there committed.
const LSN_PROBE_SQL: &str = "SELECT pg_catalog.pg_current_wal_insert_lsn()";

pub struct ShardReads {
    pub session: SessionRouting,
    balance: Balance,
    primary_reads: bool,
    /// Per shard: where the session's last write known to have committed there ends.
    min_lsn: Vec<Lsn>,
    /// Per shard: a write was sent there whose end is not known: reads go to the primary.
    unconfirmed: Vec<bool>,
}

/// The node a statement's link on one shard takes, and the WAL position a replica must have
/// replayed first.
pub struct NodeChoice {
    pub node: Arc<NodeState>,
    pub wait_for_lsn: Option<Lsn>,
}

impl ShardReads {
    pub fn new(setup: &RoutingSetup, default_read_only: bool, shard_count: u32) -> ShardReads {
        ShardReads {
            session: SessionRouting {
                splitting: true,
                configured: setup.route,
                override_route: None,
                consistency: setup.consistency,
                default_read_only,
            },
            balance: setup.balance,
            primary_reads: setup.primary_reads,
            min_lsn: vec![0; shard_count as usize],
            unconfirmed: vec![false; shard_count as usize],
        }
    }

    /// A reload added shards: they start with nothing written by this session.
    pub fn grow(&mut self, shard_count: u32) {
        self.min_lsn.resize(shard_count as usize, 0);
        self.unconfirmed.resize(shard_count as usize, false);
    }

    /// Per shard: its read-your-writes position and whether a write's end there is unknown,
    /// for a session moving to a new pgherd process.
    pub fn positions(&self) -> Vec<(u64, bool)> {
        self.min_lsn
            .iter()
            .copied()
            .zip(self.unconfirmed.iter().copied())
            .collect()
    }

    /// Takes up what [`Self::positions`] gave (a shard the record does not cover keeps what
    /// it has).
    pub fn adopt_positions(&mut self, positions: &[(u64, bool)]) {
        for (i, (lsn, unconfirmed)) in positions.iter().enumerate() {
            if let (Some(min), Some(flag)) = (self.min_lsn.get_mut(i), self.unconfirmed.get_mut(i))
            {
                *min = *lsn;
                *flag = *unconfirmed;
            }
        }
    }

    /// Where a statement routed as `routed` runs, after the session's route and hints.
    pub fn target(&self, routed: &Routed) -> Target {
        self.session.target(Some(routed))
    }

    /// `SET pgherd.route` (an unknown value leaves the configured route).
    pub fn set_route(&mut self, value: &str) {
        self.session.override_route = Route::parse(value);
    }

    /// A write is about to be sent to `shard`.
    pub fn wrote(&mut self, shard: u32) {
        if let Some(flag) = self.unconfirmed.get_mut(shard as usize) {
            *flag = true;
        }
    }

    /// The writes sent to `shard` ended (committed) by `lsn` on its primary, or were rolled
    /// back (`None`): its replicas may serve the session once they reach its last write.
    fn confirmed(&mut self, shard: u32, lsn: Option<Lsn>) {
        let i = shard as usize;
        if let (Some(flag), Some(min)) = (self.unconfirmed.get_mut(i), self.min_lsn.get_mut(i)) {
            *flag = false;
            if let Some(lsn) = lsn {
                *min = (*min).max(lsn);
            }
        }
    }

    /// A write sent through `link` (on its shard's primary, `cluster`'s) has ended, on its own
    /// or with its transaction's commit: the shard's replicas serve the session again once they
    /// have replayed the primary's WAL position, asked now when read-your-writes needs it. A
    /// link whose answer did not end, or that cannot say, leaves the shard's reads on its
    /// primary until a later write's end is known.
    pub async fn write_ended(&mut self, link: &mut Link, cluster: &Nodes) {
        if !link.answered() {
            return;
        }
        if !(self.session.read_your_writes() && cluster.all().len() > 1) {
            self.confirmed(link.shard, None);
            return;
        }
        if self.session.route() == Route::Primary {
            // Reads go to the primaries anyway; should the route change, this shard's wait
            // for the next write's end.
            return;
        }
        let lsn = match link.ask_own(LSN_PROBE_SQL).await {
            Ok(answer) if answer.refused.is_none() => answer
                .value
                .as_deref()
                .and_then(parse_lsn)
                .map(insert_lsn_as_end),
            _ => None,
        };
        if let Some(lsn) = lsn {
            self.confirmed(link.shard, Some(lsn));
        }
    }

    /// The node of `cluster` (shard `shard`) for a statement with `target`.
    pub fn choose(
        &self,
        app: &App,
        shard: u32,
        cluster: &Nodes,
        target: Target,
        last: Option<&Arc<NodeState>>,
    ) -> Result<NodeChoice, NoNode> {
        let reads = || {
            let i = shard as usize;
            read_needs(
                &app.config(),
                (self.balance, self.primary_reads),
                self.session
                    .read_your_writes()
                    .then(|| self.min_lsn.get(i).copied().unwrap_or(0)),
                self.unconfirmed.get(i).copied().unwrap_or(true),
            )
        };
        choose_node(&cluster.snapshot(), target, last, reads).map(|plan| NodeChoice {
            node: plan.node,
            wait_for_lsn: plan.wait_for_lsn,
        })
    }
}

impl ShardedSession {
    /// Links to the primaries of `shards`, taken in ascending shard order, one after the
    /// other: two statements each holding one shard's last connection and waiting for the
    /// other's cannot happen. A transaction block takes its links as its statements need
    /// them, in any order: two blocks can then wait for each other's connections (until the
    /// pool's wait times out, 53300) or rows (locks on two shards: no server sees that
    /// deadlock; `lock_timeout` ends it).
    pub(super) async fn open_links(&mut self, shards: &[u32]) -> Result<Vec<Link>, PgError> {
        self.open_links_for(shards, Target::Primary).await
    }

    /// [`Self::open_links`] for a statement with `target`: a read may take a replica.
    pub(super) async fn open_links_for(
        &mut self,
        shards: &[u32],
        target: Target,
    ) -> Result<Vec<Link>, PgError> {
        // A transaction starts: `PAUSE` holds it (one under way goes on, so PAUSE's wait for
        // server connections to come back ends).
        let starts = self.tx.as_ref().is_none_or(|tx| tx.links.is_empty()) && !shards.is_empty();
        loop {
            if starts && self.wait_while_paused().await? {
                // Planned before the pause (it came between the plan and these links): a
                // layout changed meanwhile may place its rows elsewhere.
                if self.shards.generation() != self.layout.generation {
                    return Err(PgError::error(
                        SqlState::T_R_SERIALIZATION_FAILURE,
                        "the shard layout changed while this statement waited for PAUSE to end; nothing of it ran: run it again",
                    ));
                }
            }
            let mut links = Vec::with_capacity(shards.len());
            for &shard in shards {
                links.push(self.open_link(shard, target).await?);
            }
            // PAUSE came while the links were taken: they go back (nothing was sent on them
            // but the session's settings) and the transaction waits.
            if starts && crate::control::paused_since_acquired(&self.app, self.shared.database()) {
                drop(links);
                continue;
            }
            return Ok(links);
        }
    }

    /// A link to `shard`: for a read, on a node [`ShardReads::choose`] picks (a
    /// replica that cannot be reached leaves the read set and the read goes elsewhere; one
    /// that has not replayed the session's writes in time gives way to the primary); else on
    /// its primary, waited for up to `primary_wait_ms` while one is elected.
    pub(super) async fn open_link(&mut self, shard: u32, target: Target) -> Result<Link, PgError> {
        let (Some(cluster), Some(pool_cache)) = (
            self.layout.cluster(shard),
            self.pools.get_mut(shard as usize),
        ) else {
            return Err(PgError::error(
                SqlState::INTERNAL_ERROR,
                format!("no shard {shard}"),
            ));
        };
        let mut target = target;
        let mut replica_failures = 0;
        loop {
            let last = pool_cache.last_node();
            let chosen = match target {
                Target::Primary => None,
                _ => self
                    .reads
                    .choose(&self.app, shard, cluster, target, last)
                    .ok(),
            };
            let choice = match chosen {
                Some(choice) => choice,
                None => NodeChoice {
                    node: super::cancellable(&self.shared, primary_of(&self.app, shard, cluster))
                        .await?,
                    wait_for_lsn: None,
                },
            };
            let on_replica = choice.node.role() == Role::Replica;
            match Link::open(
                &self.app,
                &self.shared,
                shard,
                choice,
                &self.params,
                pool_cache,
            )
            .await
            {
                Ok(Some(link)) => return Ok(link),
                // The replica has not replayed the session's last write in time.
                Ok(None) => target = Target::Primary,
                Err(OpenError::Acquire(AcquireError::Server(e), node)) if on_replica => {
                    node.leave_read_set(&e.to_string());
                    self.app.drop_idle_connections(&node);
                    replica_failures += 1;
                    if replica_failures >= MAX_REPLICA_FAILURES {
                        target = Target::Primary;
                    }
                }
                Err(e) => return Err(e.into_pg(&self.shared)),
            }
        }
    }
}

/// The primary of `shard` (its `cluster`), waited for up to `primary_wait_ms`.
async fn primary_of(app: &App, shard: u32, cluster: &Nodes) -> Result<Arc<NodeState>, PgError> {
    let wait = Duration::from_millis(app.config().cluster.primary_wait_ms);
    cluster.primary_within(wait).await.ok_or_else(|| {
        PgError::error(
            SqlState::CONNECTION_FAILURE,
            format!("no primary is available for shard {shard}"),
        )
        .with_detail(format!(
            "nodes of shard {shard}: {}",
            cluster.describe_all()
        ))
    })
}
