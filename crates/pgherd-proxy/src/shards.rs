//! The shards of a sharded endpoint (`[sharding]`): the map of sharded tables and the number
//! of shards, fixed at start, and one cluster per shard (its nodes as their monitors see them,
//! and its view; a reload reconciles its nodes). Shard 0's cluster is `App::nodes`; each shard
//! has its own monitors and its own failover task, which keeps its synchronous standbys too.
//! Switchover and DETACH act on shard 0 only; PAUSE, kept in shard 0's view, holds a sharded
//! session's next transaction whatever shards it reaches.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pgherd_config::Sharding;
use pgherd_route::shard_plan::ShardMap;
use pgherd_route::shard_shape::ShapePlan;

use crate::nodes::{CheckThresholds, Nodes};

pub struct Shards {
    pub map: ShardMap,
    clusters: Vec<Arc<Nodes>>,
    /// Drawn at start: this process's part of its two-phase gids (`two_phase::Gid`).
    pub instance: u64,
    sequence: AtomicU64,
    /// (shard, server database) pairs whose decisions table pgherd has made sure of.
    decision_tables: Mutex<HashSet<(u32, String)>>,
    /// Key-routed statement shapes planned once, by their literal-blind shape (at most
    /// [`MAX_SHAPES`]; the map of sharded tables they were planned with never changes).
    shapes: Mutex<HashMap<Box<[u8]>, Arc<ShapePlan>>>,
}

/// Shapes kept at most: beyond them, statements are planned in full each time.
const MAX_SHAPES: usize = 10_000;

impl Shards {
    pub fn new(sharding: &Sharding, shard0: Arc<Nodes>, thresholds: CheckThresholds) -> Shards {
        let mut clusters = vec![shard0];
        for nodes in sharding.shard_nodes.iter().skip(1) {
            clusters.push(Arc::new(Nodes::new(nodes, thresholds)));
        }
        Shards {
            map: sharding.map.clone(),
            clusters,
            instance: rand::random(),
            sequence: AtomicU64::new(1),
            decision_tables: Mutex::new(HashSet::new()),
            shapes: Mutex::new(HashMap::new()),
        }
    }

    /// The kept plan of a statement shape.
    pub fn shape(&self, key: &[u8]) -> Option<Arc<ShapePlan>> {
        self.shapes.lock().get(key).cloned()
    }

    /// Keeps the plan of a statement shape, while there is room.
    pub fn keep_shape(&self, key: &[u8], plan: ShapePlan) {
        let mut shapes = self.shapes.lock();
        if shapes.len() < MAX_SHAPES {
            shapes.insert(key.into(), Arc::new(plan));
        }
    }

    /// A new number for a two-phase transaction of this process (see `two_phase::Gid`).
    pub fn next_sequence(&self) -> u64 {
        self.sequence.fetch_add(1, Ordering::Relaxed)
    }

    /// Whether the decisions table of `database` on `shard` is known to exist.
    pub fn has_decision_table(&self, shard: u32, database: &str) -> bool {
        self.decision_tables
            .lock()
            .contains(&(shard, database.to_owned()))
    }

    pub fn decision_table_made(&self, shard: u32, database: &str) {
        self.decision_tables
            .lock()
            .insert((shard, database.to_owned()));
    }

    /// The (shard, database) pairs with a decisions table, for recovery's clean-up.
    pub fn decision_tables(&self) -> Vec<(u32, String)> {
        self.decision_tables.lock().iter().cloned().collect()
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
}
