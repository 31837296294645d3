//! The routing decisions a [`crate::routing::Router`] made, by statement key: one map shared
//! by every worker (behind a lock, filled on a miss) and each worker thread's own copies of
//! the decisions it used. A hit on a thread's copy takes no lock and writes nothing another
//! worker reads: the shared map's lock, its hit counter and the shared decision's reference
//! count would otherwise be written by every statement on every worker. (The thread that
//! made a decision keeps the shared one as its copy; each other thread touches it once, to
//! copy it.)
//!
//! A thread's copies are valid for the router generation they were made under (read before
//! the lookup): the router bumps it after anything that changes decisions (a catalog reading,
//! a statement a standby refused), which drops every thread's copies at their next lookup.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use pgherd_route::Decision;

use crate::counters::StripedCounter;

/// Routers a thread keeps copies for; more (routers replaced by reloads) empties its copies.
const MAX_ROUTERS_PER_THREAD: usize = 64;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A map by statement text or shape, looked up once or twice per statement. foldhash rather
/// than the standard SipHash: a fraction of the cost on keys of this length, still seeded
/// per process, and every such map is bounded (`remember`), so keys a client crafts to
/// collide can slow only lookups in a map of at most its capacity.
pub(crate) type KeyMap<V> = HashMap<Box<[u8]>, V, foldhash::fast::RandomState>;

/// Inserts into a map bounded by `capacity` entries, emptied when full: the decision cache's
/// maps and the router's memos.
pub(crate) fn remember<V>(map: &mut KeyMap<V>, capacity: usize, key: &[u8], value: V) {
    if map.len() >= capacity {
        map.clear();
    }
    map.insert(key.into(), value);
}

pub struct Decisions {
    /// Tells this cache's copies apart from other routers' in a thread's table (an address
    /// could be reused once a router is dropped).
    id: u64,
    shared: Mutex<KeyMap<Arc<Decision>>>,
    /// Entries the shared map and each thread's copies hold at most: emptied when full.
    capacity: usize,
    hits: StripedCounter,
    misses: StripedCounter,
}

/// One thread's copies of one router's decisions.
struct ThreadCopies {
    generation: u64,
    map: KeyMap<Arc<Decision>>,
}

thread_local! {
    static COPIES: RefCell<HashMap<u64, ThreadCopies, foldhash::fast::RandomState>> =
        RefCell::new(HashMap::default());
}

impl Decisions {
    pub fn new(capacity: usize) -> Self {
        Decisions {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            shared: Mutex::default(),
            capacity,
            hits: StripedCounter::default(),
            misses: StripedCounter::default(),
        }
    }

    /// Tells this cache's decisions apart from other routers' where a worker keeps them
    /// outside it (a statement shape's slot).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Counts a hit on a decision of this cache's found outside it (in a shape's slot).
    pub fn count_hit(&self) {
        self.hits.add(1);
    }

    /// The decision kept for `key`, counted as a hit or a miss. `generation` is the router's,
    /// read before this call.
    pub fn get(&self, key: &[u8], generation: u64) -> Option<Arc<Decision>> {
        let copy = COPIES
            .try_with(|copies| {
                let copies = copies.borrow();
                let mine = copies.get(&self.id)?;
                (mine.generation == generation)
                    .then(|| mine.map.get(key).cloned())
                    .flatten()
            })
            .ok()
            .flatten();
        if let Some(decision) = copy {
            self.hits.add(1);
            return Some(decision);
        }
        let shared = self.shared.lock().get(key).cloned();
        match shared {
            Some(decision) => {
                self.hits.add(1);
                // A copy of its own: the shared one's reference count is the line to avoid.
                let copy = Arc::new(Decision::clone(&decision));
                self.keep_here(key, generation, copy.clone());
                Some(copy)
            }
            None => {
                self.misses.add(1);
                None
            }
        }
    }

    /// Keeps a decision this thread just made (under `generation`, read before it was made):
    /// the thread keeps it as its own copy, others copy it from the shared map.
    pub fn insert(&self, key: &[u8], generation: u64, decision: Arc<Decision>) {
        self.keep_here(key, generation, decision.clone());
        self.insert_shared(key, decision);
    }

    /// Keeps a decision in the shared map only: the caller bumps the router's generation
    /// next, which retires the threads' copies.
    pub fn insert_shared(&self, key: &[u8], decision: Arc<Decision>) {
        remember(&mut self.shared.lock(), self.capacity, key, decision);
    }

    /// Forgets the shared decisions; the caller bumps the router's generation next.
    pub fn clear(&self) {
        self.shared.lock().clear();
    }

    /// (hits, misses) since start, summed over the threads.
    pub fn counts(&self) -> (u64, u64) {
        (self.hits.sum(), self.misses.sum())
    }

    fn keep_here(&self, key: &[u8], generation: u64, decision: Arc<Decision>) {
        let _ = COPIES.try_with(|copies| {
            let mut copies = copies.borrow_mut();
            if copies.len() >= MAX_ROUTERS_PER_THREAD && !copies.contains_key(&self.id) {
                copies.clear();
            }
            let mine = copies.entry(self.id).or_insert_with(|| ThreadCopies {
                generation,
                map: KeyMap::default(),
            });
            if mine.generation != generation {
                mine.generation = generation;
                mine.map.clear();
            }
            remember(&mut mine.map, self.capacity, key, decision);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decision(reason: &str) -> Arc<Decision> {
        let mut decision = Decision::unread("test");
        decision.reason = reason.to_owned();
        Arc::new(decision)
    }

    #[test]
    fn a_thread_hits_its_own_copy_until_the_generation_moves() {
        let cache = Decisions::new(16);
        assert!(cache.get(b"k", 0).is_none());
        let kept = decision("first");
        cache.insert(b"k", 0, kept.clone());
        let hit = cache.get(b"k", 0).expect("kept");
        assert!(Arc::ptr_eq(&kept, &hit), "the thread's own copy answers");
        // Another generation: the copy is stale, the shared map answers (and is copied anew).
        cache.insert_shared(b"k", decision("second"));
        assert_eq!(cache.get(b"k", 1).expect("shared").reason, "second");
        cache.clear();
        assert_eq!(cache.get(b"k", 1).expect("copy of gen 1").reason, "second");
        assert!(cache.get(b"k", 2).is_none(), "cleared and retired");
        assert_eq!(cache.counts(), (3, 2));
    }

    #[test]
    fn other_threads_copy_from_the_shared_map() {
        let cache = Decisions::new(16);
        let kept = decision("made here");
        cache.insert(b"k", 7, kept.clone());
        std::thread::scope(|scope| {
            scope.spawn(|| {
                let there = cache.get(b"k", 7).expect("shared");
                assert!(!Arc::ptr_eq(&kept, &there), "a copy of its own");
                assert_eq!(there.reason, "made here");
            });
        });
        assert_eq!(cache.counts(), (1, 0));
    }

    #[test]
    fn full_caches_are_emptied() {
        let cache = Decisions::new(2);
        for key in [&b"a"[..], b"b", b"c"] {
            cache.insert(key, 0, decision("x"));
        }
        assert!(cache.get(b"c", 0).is_some());
        assert!(cache.shared.lock().len() <= 2);
    }
}
