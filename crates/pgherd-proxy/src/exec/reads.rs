//! Where a sharded session's statements run within a shard. Outside a transaction block a read
//! goes to a node of its shard's cluster as the unsharded relay would choose one
//! (`pgherd_route::plan::choose_node`: the balance policy, the lag limits, read-your-writes);
//! writes and transaction blocks stay on the shards' primaries.
//!
//! Read-your-writes holds per shard: a write sent to a shard makes its replicas unusable for the
//! session until the write's end is known; once it committed, the primary's WAL position is
//! asked, and that shard's replicas serve the session again when they have replayed it.

use std::sync::Arc;

use pgherd_config::{Balance, Route};
use pgherd_route::balance::{insert_lsn_as_end, parse_lsn, Lsn};
use pgherd_route::plan::{choose_node, NoNode, ReadNeeds, SessionRouting};
use pgherd_route::{Routed, Target};

use super::link::Link;
use crate::app::App;
use crate::nodes::{NodeState, Nodes};
use crate::relay::RoutingSetup;

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
    pub fn confirmed(&mut self, shard: u32, lsn: Option<Lsn>) {
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
            let config = app.config();
            let i = shard as usize;
            ReadNeeds {
                balance: self.balance,
                primary_reads: self.primary_reads,
                max_lag_bytes: config.routing.max_lag_bytes,
                max_lag_ms: config.routing.max_lag_ms,
                min_lsn: self
                    .session
                    .read_your_writes()
                    .then(|| self.min_lsn.get(i).copied().unwrap_or(0)),
                write_unconfirmed: self.unconfirmed.get(i).copied().unwrap_or(true),
                may_wait: config.routing.read_your_writes_wait_ms > 0,
            }
        };
        choose_node(&cluster.snapshot(), target, last, reads).map(|plan| NodeChoice {
            node: plan.node,
            wait_for_lsn: plan.wait_for_lsn,
        })
    }
}
