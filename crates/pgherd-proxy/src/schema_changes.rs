//! Schema changes made through this pgherd, as every session's reads see them. Under
//! `read_your_writes` a session never reads a replica that has not replayed its own writes;
//! a schema change is everyone's: once one commits, no such session reads a replica that
//! has not replayed it, or an application that made a table or type in one connection and
//! uses it in the next would find it missing or old there. Schema changes are rare, so the
//! price (reads of everyone go to the primary while one commits, then wait for replicas to
//! pass it) is paid rarely.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use pgherd_route::balance::Lsn;

#[derive(Debug, Default)]
pub struct SchemaChanges {
    /// Transactions that changed the schema and may have committed, whose end in the WAL is
    /// not known yet: reads go to the primary meanwhile.
    unconfirmed: AtomicUsize,
    /// The furthest WAL position a schema change made through pgherd is known to end at.
    end_lsn: AtomicU64,
}

/// What a read needs of a replica because of the schema changes made so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaReadNeeds {
    /// Replicas must have replayed this far.
    pub min_lsn: Lsn,
    /// A schema change's end is not known yet: only the primary is sure to have it.
    pub unconfirmed: bool,
}

impl SchemaChanges {
    /// A transaction that changed the schema is about to end: until its end is known (or
    /// the returned value is dropped) reads go to the primary.
    pub fn ending(self: &Arc<Self>) -> SchemaChangeEnding {
        self.unconfirmed.fetch_add(1, Ordering::SeqCst);
        SchemaChangeEnding {
            changes: self.clone(),
        }
    }

    pub fn read_needs(&self) -> SchemaReadNeeds {
        SchemaReadNeeds {
            unconfirmed: self.unconfirmed.load(Ordering::SeqCst) > 0,
            min_lsn: self.end_lsn.load(Ordering::SeqCst),
        }
    }
}

/// A schema change whose transaction is ending, held by its session until the primary says
/// where its writes end.
#[derive(Debug)]
pub struct SchemaChangeEnding {
    changes: Arc<SchemaChanges>,
}

impl SchemaChangeEnding {
    /// The transaction ended and its writes end at `end_lsn`, or where is unknown (`None`:
    /// the probe failed; reads go back to the lag limits alone).
    pub fn ended(self, end_lsn: Option<Lsn>) {
        if let Some(lsn) = end_lsn {
            self.changes.end_lsn.fetch_max(lsn, Ordering::SeqCst);
        }
    }
}

impl Drop for SchemaChangeEnding {
    fn drop(&mut self) {
        self.changes.unconfirmed.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_need_the_primary_until_the_end_is_known_then_a_replica_past_it() {
        let changes = Arc::new(SchemaChanges::default());
        assert_eq!(
            changes.read_needs(),
            SchemaReadNeeds {
                min_lsn: 0,
                unconfirmed: false
            }
        );
        let first = changes.ending();
        let second = changes.ending();
        assert!(changes.read_needs().unconfirmed);
        second.ended(Some(200));
        assert!(
            changes.read_needs().unconfirmed,
            "the first is still ending"
        );
        first.ended(Some(100));
        assert_eq!(
            changes.read_needs(),
            SchemaReadNeeds {
                min_lsn: 200,
                unconfirmed: false
            }
        );
        // A session that fails before the answer lets go without moving the position.
        drop(changes.ending());
        assert_eq!(changes.read_needs().min_lsn, 200);
        assert!(!changes.read_needs().unconfirmed);
    }
}
