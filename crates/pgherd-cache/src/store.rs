//! Cached answers of one database: bounded by bytes (least recently used first out), by
//! entry size and by age, and dropped per table.
//!
//! An entry is only stored if none of its tables was invalidated since the statement that
//! filled it was sent ([`FillTicket`]): a commit decoded while the answer was on its way may
//! have been missed by the server's snapshot, and the entry would outlive the invalidation
//! that should have dropped it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use bytes::Bytes;

/// The bounds of one store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// All entries together, keys and answers and bookkeeping.
    pub max_bytes: usize,
    /// One entry's answer; a larger one is not kept.
    pub max_entry_bytes: usize,
    /// An entry older than this is not served (0: no limit). A second guard only: entries are
    /// dropped when their tables change.
    pub ttl_ms: u64,
}

/// What the store has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    pub hits: u64,
    /// Statements asked to be cached that the cache did not answer ([`Store::note_miss`]):
    /// a lookup by key alone cannot tell them from statements nobody asked to cache.
    pub misses: u64,
    pub stores: u64,
    /// Entries pushed out to stay within `max_bytes`.
    pub evictions: u64,
    /// Entries dropped because a table they read changed (or the cache was cleared).
    pub invalidations: u64,
    /// Entries found older than the TTL.
    pub expirations: u64,
    /// Answers not kept: larger than `max_entry_bytes`, or a table changed while they were on
    /// their way.
    pub not_stored: u64,
    pub entries: u64,
    pub bytes: u64,
}

/// Taken when a statement that may fill an entry is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillTicket {
    invalidations_seen: u64,
}

/// What became of an answer offered to the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    Stored,
    /// A table it read changed after the statement was sent.
    Raced,
    TooLarge,
}

/// Bookkeeping per entry beyond its key and answer, for the byte bound.
const ENTRY_OVERHEAD_BYTES: usize = 160;

struct HeldCommit {
    xid: u32,
    /// `None`: the commit changed what pgherd cannot attribute to tables (a schema change):
    /// no answer at all is stored while it is held.
    tables: Option<Vec<String>>,
}

/// Whether a transaction is visible to a snapshot: it precedes the snapshot's `xmax`
/// (which only moves past a transaction once it has ended: a synchronous commit waiting for
/// its standby has not) and is not listed in progress. Compared modulo 2^32, as PostgreSQL
/// compares transaction ids.
fn is_visible(xid: u32, xmax: u32, in_progress: &HashSet<u32>) -> bool {
    (xid.wrapping_sub(xmax) as i32) < 0 && !in_progress.contains(&xid)
}

struct Entry {
    answer: Bytes,
    tables: Box<[String]>,
    stored_at_ms: u64,
    last_used: u64,
    size: usize,
}

type Key = Arc<[u8]>;

pub struct Store {
    limits: Limits,
    entries: HashMap<Key, Entry>,
    /// Use order: tick of last use → key.
    by_use: BTreeMap<u64, Key>,
    by_table: HashMap<String, HashSet<Key>>,
    /// Counts invalidations; each table remembers the count at its last one.
    invalidations: u64,
    table_invalidated_at: HashMap<String, u64>,
    /// Decoded commits not yet known to be visible: no answer reading their tables is
    /// stored, as its snapshot may not include them.
    held_commits: Vec<HeldCommit>,
    /// How many of `held_commits` changed each table (an index of them).
    held: HashMap<String, u32>,
    /// How many of `held_commits` hold every table.
    held_everything: u32,
    cleared_at: u64,
    tick: u64,
    bytes: usize,
    figures: Figures,
}

impl Store {
    pub fn new(limits: Limits) -> Store {
        Store {
            limits,
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            by_table: HashMap::new(),
            invalidations: 0,
            table_invalidated_at: HashMap::new(),
            held_commits: Vec::new(),
            held: HashMap::new(),
            held_everything: 0,
            cleared_at: 0,
            tick: 0,
            bytes: 0,
            figures: Figures::default(),
        }
    }

    /// New bounds (a reload): entries beyond them go at once.
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
        self.evict_to(limits.max_bytes);
    }

    /// The answer stored under `key`, if there is one young enough.
    pub fn get(&mut self, key: &[u8], now_ms: u64) -> Option<Bytes> {
        let ttl_ms = self.limits.ttl_ms;
        let entry = self.entries.get(key)?;
        if ttl_ms > 0 && now_ms.saturating_sub(entry.stored_at_ms) >= ttl_ms {
            self.remove(key);
            self.figures.expirations += 1;
            return None;
        }
        self.tick += 1;
        let tick = self.tick;
        let entry = self.entries.get_mut(key)?;
        let key = self.by_use.remove(&entry.last_used)?;
        entry.last_used = tick;
        let answer = entry.answer.clone();
        self.by_use.insert(tick, key);
        self.figures.hits += 1;
        Some(answer)
    }

    /// A statement asked to be cached goes to the server.
    pub fn note_miss(&mut self) {
        self.figures.misses += 1;
    }

    /// To be taken before the statement that may fill an entry is sent.
    pub fn ticket(&self) -> FillTicket {
        FillTicket {
            invalidations_seen: self.invalidations,
        }
    }

    /// Offers the answer of a statement sent after `ticket` was taken, which read `tables`.
    pub fn insert(
        &mut self,
        key: &[u8],
        answer: Bytes,
        tables: &[String],
        ticket: FillTicket,
        now_ms: u64,
    ) -> Stored {
        let raced = self.cleared_at > ticket.invalidations_seen
            || self.held_everything > 0
            || tables.iter().any(|t| self.held.contains_key(t))
            || tables.iter().any(|t| {
                self.table_invalidated_at
                    .get(t)
                    .is_some_and(|&at| at > ticket.invalidations_seen)
            });
        if raced {
            self.figures.not_stored += 1;
            return Stored::Raced;
        }
        let size = ENTRY_OVERHEAD_BYTES
            + key.len()
            + answer.len()
            + tables.iter().map(|t| t.len() + 24).sum::<usize>();
        if answer.len() > self.limits.max_entry_bytes || size > self.limits.max_bytes {
            self.figures.not_stored += 1;
            return Stored::TooLarge;
        }
        self.remove(key);
        self.evict_to(self.limits.max_bytes - size);
        self.tick += 1;
        let key: Key = Arc::from(key);
        for table in tables {
            self.by_table
                .entry(table.clone())
                .or_default()
                .insert(key.clone());
        }
        self.by_use.insert(self.tick, key.clone());
        self.entries.insert(
            key,
            Entry {
                answer,
                tables: tables.into(),
                stored_at_ms: now_ms,
                last_used: self.tick,
                size,
            },
        );
        self.bytes += size;
        self.figures.stores += 1;
        Stored::Stored
    }

    /// Drops every entry that read `table`; an answer on its way that read it will not be
    /// stored. Returns how many entries went.
    pub fn invalidate_table(&mut self, table: &str) -> usize {
        self.invalidations += 1;
        self.table_invalidated_at
            .insert(table.to_owned(), self.invalidations);
        let Some(keys) = self.by_table.remove(table) else {
            return 0;
        };
        let mut dropped = 0;
        for key in keys {
            if self.remove(&key) {
                dropped += 1;
            }
        }
        self.figures.invalidations += dropped as u64;
        dropped
    }

    /// A commit (transaction `xid`) that changed `tables` was decoded: their entries go, and
    /// none is stored again until [`Self::commits_visible`] finds that every new snapshot
    /// includes the commit. Returns how many entries went.
    pub fn commit_decoded(&mut self, xid: u32, tables: Vec<String>) -> usize {
        let mut dropped = 0;
        for table in &tables {
            *self.held.entry(table.clone()).or_default() += 1;
            dropped += self.invalidate_table(table);
        }
        self.held_commits.push(HeldCommit {
            xid,
            tables: Some(tables),
        });
        dropped
    }

    /// A commit (transaction `xid`) that changed what no table list says (a schema change,
    /// announced by pgherd's event trigger) was decoded: every entry goes, and none is stored
    /// until [`Self::commits_visible`] finds the commit visible. Returns how many went.
    pub fn commit_decoded_everything(&mut self, xid: u32) -> usize {
        self.held_everything += 1;
        self.held_commits.push(HeldCommit { xid, tables: None });
        self.drop_all()
    }

    pub fn has_held_commits(&self) -> bool {
        !self.held_commits.is_empty()
    }

    /// Given a fresh snapshot of the primary's (its `xmax` and the ids it lists as in
    /// progress, low 32 bits), lets go of the held commits it shows visible: answers whose
    /// statement is sent from now on may be stored; those sent before may not have seen
    /// them. Returns how many commits were let go.
    pub fn commits_visible(&mut self, xmax: u32, in_progress: &HashSet<u32>) -> usize {
        let (visible, still): (Vec<HeldCommit>, Vec<HeldCommit>) =
            std::mem::take(&mut self.held_commits)
                .into_iter()
                .partition(|c| is_visible(c.xid, xmax, in_progress));
        self.held_commits = still;
        for commit in &visible {
            let Some(tables) = &commit.tables else {
                self.held_everything -= 1;
                // Answers sent before it was visible may have missed it.
                self.drop_all();
                continue;
            };
            for table in tables {
                if let Some(count) = self.held.get_mut(table.as_str()) {
                    *count -= 1;
                    if *count == 0 {
                        self.held.remove(table.as_str());
                    }
                }
                self.invalidate_table(table);
            }
        }
        visible.len()
    }

    /// Drops every entry (the console's `CACHE CLEAR`, a schema change); no answer on its way
    /// is stored. Commits still held stay held.
    pub fn drop_all(&mut self) -> usize {
        self.invalidations += 1;
        self.cleared_at = self.invalidations;
        let dropped = self.entries.len();
        self.entries.clear();
        self.by_use.clear();
        self.by_table.clear();
        // The clear mark covers every table's older invalidations.
        self.table_invalidated_at.clear();
        self.bytes = 0;
        self.figures.invalidations += dropped as u64;
        dropped
    }

    /// Drops everything, held commits included: their stream ended, and the next one starts
    /// from a point where every earlier commit is visible.
    pub fn clear(&mut self) -> usize {
        self.held_commits.clear();
        self.held.clear();
        self.held_everything = 0;
        self.drop_all()
    }

    pub fn figures(&self) -> Figures {
        Figures {
            entries: self.entries.len() as u64,
            bytes: self.bytes as u64,
            ..self.figures
        }
    }

    fn evict_to(&mut self, max_bytes: usize) {
        while self.bytes > max_bytes {
            let Some((_, key)) = self.by_use.pop_first() else {
                break;
            };
            if self.remove(&key) {
                self.figures.evictions += 1;
            }
        }
    }

    fn remove(&mut self, key: &[u8]) -> bool {
        let Some(entry) = self.entries.remove(key) else {
            return false;
        };
        self.by_use.remove(&entry.last_used);
        for table in entry.tables.iter() {
            if let Some(keys) = self.by_table.get_mut(table) {
                keys.remove(key);
                if keys.is_empty() {
                    self.by_table.remove(table);
                }
            }
        }
        self.bytes -= entry.size;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_bytes: 4096,
            max_entry_bytes: 1024,
            ttl_ms: 1000,
        }
    }

    fn tables(names: &[&str]) -> Vec<String> {
        names.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_stored_answer_is_served_until_a_table_it_read_changes() {
        let mut store = Store::new(limits());
        let ticket = store.ticket();
        let stored = store.insert(
            b"k",
            Bytes::from_static(b"rows"),
            &tables(&["a", "b"]),
            ticket,
            0,
        );
        assert_eq!(stored, Stored::Stored);
        assert_eq!(store.get(b"k", 10).as_deref(), Some(&b"rows"[..]));
        assert_eq!(store.invalidate_table("c"), 0);
        assert!(store.get(b"k", 10).is_some());
        assert_eq!(store.invalidate_table("b"), 1);
        assert!(store.get(b"k", 10).is_none());
        store.note_miss();
        let f = store.figures();
        assert_eq!(
            (f.hits, f.misses, f.invalidations, f.entries, f.bytes),
            (2, 1, 1, 0, 0)
        );
    }

    #[test]
    fn an_answer_that_raced_an_invalidation_of_its_table_is_not_stored() {
        let mut store = Store::new(limits());
        let ticket = store.ticket();
        store.invalidate_table("a");
        let stored = store.insert(b"k", Bytes::from_static(b"old"), &tables(&["a"]), ticket, 0);
        assert_eq!(stored, Stored::Raced);
        // Another table's change does not hold it back.
        let ticket = store.ticket();
        store.invalidate_table("z");
        let stored = store.insert(b"k", Bytes::from_static(b"new"), &tables(&["a"]), ticket, 0);
        assert_eq!(stored, Stored::Stored);
        // Nor does a clear before the ticket; one after it does.
        store.clear();
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"j", Bytes::new(), &tables(&["a"]), ticket, 0),
            Stored::Stored
        );
        let ticket = store.ticket();
        store.clear();
        assert_eq!(
            store.insert(b"j", Bytes::new(), &tables(&["q"]), ticket, 0),
            Stored::Raced
        );
    }

    #[test]
    fn tables_of_a_decoded_commit_take_no_answer_until_it_is_visible() {
        let mut store = Store::new(limits());
        let t = tables(&["t"]);
        let none = HashSet::new();
        let ticket = store.ticket();
        store.insert(b"k", Bytes::from_static(b"v1"), &t, ticket, 0);
        assert_eq!(store.commit_decoded(7, t.clone()), 1);
        // Sent after the decode, but perhaps before the commit was visible.
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"k", Bytes::from_static(b"v1"), &t, ticket, 0),
            Stored::Raced
        );
        // Two commits in flight: visible one by one.
        store.commit_decoded(8, t.clone());
        assert_eq!(store.commits_visible(9, &HashSet::from([7])), 1);
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"k", Bytes::from_static(b"v1"), &t, ticket, 0),
            Stored::Raced
        );
        assert_eq!(store.commits_visible(9, &none), 1);
        assert!(!store.has_held_commits());
        // A statement sent before the commit was visible is not stored...
        assert_eq!(
            store.insert(b"k", Bytes::from_static(b"v1"), &t, ticket, 0),
            Stored::Raced
        );
        // ...one sent after is.
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"k", Bytes::from_static(b"v2"), &t, ticket, 0),
            Stored::Stored
        );
        // Other tables were never held.
        let ticket = store.ticket();
        store.commit_decoded(10, t.clone());
        assert_eq!(
            store.insert(b"o", Bytes::new(), &tables(&["o"]), ticket, 0),
            Stored::Stored
        );
        // A clear lets go of what was held.
        store.clear();
        assert!(!store.has_held_commits());
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"k", Bytes::new(), &t, ticket, 0),
            Stored::Stored
        );
    }

    #[test]
    fn a_schema_change_drops_everything_and_holds_every_table_until_visible() {
        let mut store = Store::new(limits());
        let none = HashSet::new();
        let ticket = store.ticket();
        store.insert(b"a", Bytes::new(), &tables(&["a"]), ticket, 0);
        store.insert(b"b", Bytes::new(), &tables(&["b"]), ticket, 0);
        store.commit_decoded(5, tables(&["a"]));
        assert_eq!(store.commit_decoded_everything(6), 1);
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"z", Bytes::new(), &tables(&["z"]), ticket, 0),
            Stored::Raced
        );
        // The console's clear keeps what is held.
        store.drop_all();
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"z", Bytes::new(), &tables(&["z"]), ticket, 0),
            Stored::Raced
        );
        // Visible: answers sent before are still refused, those sent after stored.
        assert_eq!(store.commits_visible(7, &none), 2);
        assert_eq!(
            store.insert(b"z", Bytes::new(), &tables(&["z"]), ticket, 0),
            Stored::Raced
        );
        let ticket = store.ticket();
        assert_eq!(
            store.insert(b"z", Bytes::new(), &tables(&["a"]), ticket, 0),
            Stored::Stored
        );
    }

    #[test]
    fn a_commit_is_visible_once_a_snapshot_neither_lists_it_nor_reaches_it_with_xmax() {
        let mut store = Store::new(limits());
        store.commit_decoded(7, tables(&["a"]));
        store.commit_decoded(8, tables(&["b"]));
        store.commit_decoded(10, tables(&["c"]));
        // 7 is listed; 10 is not, but the snapshot's xmax has not passed it (a commit waiting
        // for its synchronous standby has not ended).
        assert_eq!(store.commits_visible(10, &HashSet::from([7, 9])), 1);
        let held = |store: &mut Store, table: &str| {
            let ticket = store.ticket();
            store.insert(b"x", Bytes::new(), &tables(&[table]), ticket, 0) == Stored::Raced
        };
        assert!(held(&mut store, "a") && !held(&mut store, "b") && held(&mut store, "c"));
        assert_eq!(store.commits_visible(11, &HashSet::new()), 2);
        assert!(!store.has_held_commits());
        // Across the wrap of 32-bit ids.
        store.commit_decoded(u32::MAX, tables(&["d"]));
        assert_eq!(store.commits_visible(u32::MAX, &HashSet::new()), 0);
        assert_eq!(store.commits_visible(2, &HashSet::new()), 1);
    }

    #[test]
    fn the_least_recently_used_go_first_and_bytes_stay_within_the_bound() {
        let mut store = Store::new(limits());
        let answer = Bytes::from(vec![0u8; 700]);
        for key in [b"a", b"b", b"c", b"d"] {
            let ticket = store.ticket();
            assert_eq!(
                store.insert(key, answer.clone(), &tables(&["t"]), ticket, 0),
                Stored::Stored
            );
            assert!(store.figures().bytes <= 4096);
        }
        assert!(store.get(b"a", 0).is_some(), "a fits with b, c and d");
        let ticket = store.ticket();
        store.insert(b"e", answer.clone(), &tables(&["t"]), ticket, 0);
        store.insert(b"f", answer.clone(), &tables(&["t"]), ticket, 0);
        assert!(store.get(b"a", 0).is_some(), "used last, so kept");
        assert!(
            store.get(b"b", 0).is_none(),
            "used least recently, so evicted"
        );
        assert!(store.figures().evictions >= 1);
        assert!(store.figures().bytes <= 4096);
        // Dropping a table drops every entry of it and leaves the figures exact.
        store.invalidate_table("t");
        assert_eq!((store.figures().entries, store.figures().bytes), (0, 0));
    }

    #[test]
    fn too_large_and_too_old_answers_are_not_served() {
        let mut store = Store::new(limits());
        let ticket = store.ticket();
        let big = Bytes::from(vec![0u8; 1025]);
        assert_eq!(store.insert(b"big", big, &[], ticket, 0), Stored::TooLarge);
        store.insert(b"k", Bytes::from_static(b"x"), &[], ticket, 100);
        assert!(store.get(b"k", 1099).is_some());
        assert!(store.get(b"k", 1100).is_none());
        assert_eq!(store.figures().expirations, 1);
        assert_eq!(store.figures().entries, 0);
    }

    #[test]
    fn storing_a_key_again_replaces_its_entry() {
        let mut store = Store::new(limits());
        let ticket = store.ticket();
        store.insert(b"k", Bytes::from_static(b"one"), &tables(&["a"]), ticket, 0);
        store.insert(b"k", Bytes::from_static(b"two"), &tables(&["b"]), ticket, 0);
        assert_eq!(store.figures().entries, 1);
        assert_eq!(store.invalidate_table("a"), 0);
        assert_eq!(store.get(b"k", 0).as_deref(), Some(&b"two"[..]));
        store.set_limits(Limits {
            max_bytes: 10,
            ..limits()
        });
        assert_eq!(store.figures().entries, 0);
    }
}
