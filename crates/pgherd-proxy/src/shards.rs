//! The shards of a sharded endpoint (`[sharding]`): the map of sharded tables, fixed at start,
//! and one cluster per shard (its nodes as their monitors see them, and its view). Shard 0's
//! cluster is `App::nodes`, which failover, the console's node commands and the instances'
//! agreement act on; the others are watched by their own monitors and route by the primary
//! those find, without failover or synchronous standbys yet.

use std::sync::Arc;

use pgherd_config::Sharding;
use pgherd_route::shard_plan::ShardMap;

use crate::nodes::{CheckThresholds, Nodes};

pub struct Shards {
    pub map: ShardMap,
    clusters: Vec<Arc<Nodes>>,
}

impl Shards {
    pub fn new(sharding: &Sharding, shard0: Arc<Nodes>, thresholds: CheckThresholds) -> Shards {
        let mut clusters = vec![shard0];
        for nodes in sharding.shard_nodes.iter().skip(1) {
            // No failover task keeps synchronous standbys for these shards yet: their
            // commits are acknowledged as the primary's own (asynchronous durability).
            clusters.push(Arc::new(Nodes::new_unkept(nodes, thresholds)));
        }
        Shards {
            map: sharding.map.clone(),
            clusters,
        }
    }

    pub fn count(&self) -> u32 {
        self.clusters.len() as u32
    }

    /// Shard `shard`'s cluster; the planner gives only shards below [`Self::count`].
    pub fn cluster(&self, shard: u32) -> Option<&Arc<Nodes>> {
        self.clusters.get(shard as usize)
    }

    /// Every shard's cluster, shard 0 first.
    pub fn clusters(&self) -> &[Arc<Nodes>] {
        &self.clusters
    }

    /// The clusters besides shard 0's, whose nodes need monitors of their own.
    pub fn other_clusters(&self) -> &[Arc<Nodes>] {
        &self.clusters[1..]
    }
}
