//! The shards of a sharded endpoint (`[sharding]`): the layout (the map of sharded tables and
//! one cluster per shard: its nodes as their monitors see them, and its view; a reload
//! reconciles its nodes) and what lasts for the process whatever the layout (the two-phase
//! gids' parts, the decision tables made). Shard 0's cluster is `App::nodes`; each shard has
//! its own monitors and its own failover task, which keeps its synchronous standbys too.
//! Switchover and DETACH act on shard 0 only; PAUSE, kept in shard 0's view, holds a sharded
//! session's next transaction whatever shards it reaches.
//!
//! The layout may grow on a reload while every session is held by a drained `PAUSE`
//! ([`check_layout_change`]): shards appended, range and list tables placing keys anew. A
//! session takes the new layout before it plans its next transaction's first statement.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use pgherd_config::Sharding;
use pgherd_route::shard_plan::{Method, ShardMap};
use pgherd_route::shard_shape::ShapePlan;

use crate::nodes::{CheckThresholds, Nodes};

/// Which shard holds which rows, and each shard's cluster.
pub struct Layout {
    pub map: ShardMap,
    clusters: Vec<Arc<Nodes>>,
    /// Counts the layouts this process had: a session compares it with the one it planned by.
    pub generation: u64,
    /// Key-routed statement shapes planned once, by their literal-blind shape (at most
    /// [`MAX_SHAPES`]; planned with this layout's map, and gone with it).
    shapes: Mutex<HashMap<Box<[u8]>, Arc<ShapePlan>>>,
}

impl Layout {
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
}

pub struct Shards {
    layout: ArcSwap<Layout>,
    /// Drawn at start: this process's part of its two-phase gids (`two_phase::Gid`).
    pub instance: u64,
    sequence: AtomicU64,
    /// (shard, server database) pairs whose decisions table pgherd has made sure of.
    decision_tables: Mutex<HashSet<(u32, String)>>,
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
            layout: ArcSwap::from_pointee(Layout {
                map: sharding.map.clone(),
                clusters,
                generation: 1,
                shapes: Mutex::new(HashMap::new()),
            }),
            instance: rand::random(),
            sequence: AtomicU64::new(1),
            decision_tables: Mutex::new(HashSet::new()),
        }
    }

    /// The layout now.
    pub fn layout(&self) -> Arc<Layout> {
        self.layout.load_full()
    }

    /// The generation of the layout now, without taking it.
    pub fn generation(&self) -> u64 {
        self.layout.load().generation
    }

    /// Puts `map` in force with the clusters so far and `added` after them; the caller
    /// checked the change ([`check_layout_change`]) and holds every session by PAUSE.
    pub fn grow(&self, map: ShardMap, added: Vec<Arc<Nodes>>) {
        let old = self.layout.load_full();
        let mut clusters = old.clusters.clone();
        clusters.extend(added);
        self.layout.store(Arc::new(Layout {
            map,
            clusters,
            generation: old.generation + 1,
            shapes: Mutex::new(HashMap::new()),
        }));
    }

    pub fn count(&self) -> u32 {
        self.layout.load().count()
    }

    /// Shard `shard`'s cluster now (shards are only added: a number keeps its cluster).
    pub fn cluster(&self, shard: u32) -> Option<Arc<Nodes>> {
        self.layout.load().cluster(shard).cloned()
    }

    /// Every shard's cluster now, shard 0 first.
    pub fn clusters(&self) -> Vec<Arc<Nodes>> {
        self.layout.load().clusters.clone()
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
}

/// Whether a reload may put `new` in force where `old` is: the same sharded tables with the
/// same keys and methods; as many shards or more (a shard is never taken away: sessions and
/// recovery know shards by number); a hash-sharded table only with the count unchanged (a
/// new modulus places nearly every row anew). Range and list tables may place keys anew (a
/// split): the reload moves no row itself (`pgherd shard split` copies them before it), so
/// the rows must be where the new map places them before RESUME.
pub fn check_layout_change(old: &ShardMap, new: &ShardMap) -> Result<(), String> {
    if new.shards < old.shards {
        return Err(format!(
            "the number of shards would fall from {} to {}: shards are only added while pgherd runs",
            old.shards, new.shards
        ));
    }
    let names = |m: &ShardMap| m.tables.keys().cloned().collect::<Vec<_>>();
    if names(old) != names(new) {
        return Err(format!(
            "the sharded tables would change (from {} to {}): only with a restart",
            names(old).join(", "),
            names(new).join(", ")
        ));
    }
    for (name, was) in &old.tables {
        let Some(now) = new.tables.get(name) else {
            continue;
        };
        if now.key_column != was.key_column
            || now.key_type != was.key_type
            || now.method.name() != was.method.name()
        {
            return Err(format!(
                "{name}'s key or method would change: only with a restart"
            ));
        }
        if matches!(was.method, Method::Hash) && new.shards != old.shards {
            return Err(format!(
                "{name} is sharded by hash: another number of shards would place nearly every row anew"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_route::shard_hash::KeyType;
    use pgherd_route::shard_plan::ShardedTable;

    fn map(shards: u32, method: Method) -> ShardMap {
        let table = ShardedTable {
            key_column: "id".into(),
            key_type: KeyType::Int4,
            method,
            key_ordinal: None,
        };
        ShardMap {
            shards,
            tables: [("accounts".to_owned(), table)].into_iter().collect(),
        }
    }

    #[test]
    fn a_layout_grows_but_keeps_its_tables_and_shards() {
        let range = |starts: &[i64]| Method::Range {
            starts: starts.to_vec(),
        };
        let old = map(2, range(&[0, 1000]));
        assert_eq!(
            check_layout_change(&old, &map(3, range(&[0, 1000, 2000]))),
            Ok(())
        );
        assert_eq!(
            check_layout_change(&old, &map(3, range(&[0, 500, 1000]))),
            Ok(())
        );
        assert!(check_layout_change(&old, &map(1, range(&[0])))
            .unwrap_err()
            .contains("would fall from 2 to 1"));
        assert!(
            check_layout_change(&map(2, Method::Hash), &map(3, Method::Hash))
                .unwrap_err()
                .contains("sharded by hash")
        );
        assert_eq!(
            check_layout_change(&map(2, Method::Hash), &map(2, Method::Hash)),
            Ok(())
        );
        assert!(check_layout_change(&old, &map(2, Method::Hash))
            .unwrap_err()
            .contains("key or method would change"));
        let mut other = map(2, range(&[0, 1000]));
        other
            .tables
            .insert("orders".into(), other.tables["accounts"].clone());
        assert!(check_layout_change(&old, &other)
            .unwrap_err()
            .contains("sharded tables would change"));
    }

    /// What `pgherd shard split` writes into the config is a layout change the running
    /// pgherd takes.
    #[test]
    fn a_split_layout_is_a_change_reload_takes() {
        use pgherd_route::reshard::{plan_split, split_map, SplitAt};
        let old = map(
            2,
            Method::Range {
                starts: vec![0, 1000],
            },
        );
        let plan = plan_split(&old, 1, &[SplitAt::Every(1500)]).unwrap();
        assert_eq!(check_layout_change(&old, &split_map(&old, &plan)), Ok(()));
    }
}
