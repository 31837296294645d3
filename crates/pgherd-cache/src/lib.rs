//! The result cache's pure core.
//!
//! - [`store`]: entries, their bounds (bytes, per-entry size, TTL) and LRU eviction, and
//!   invalidation by table with the check that keeps a fill which raced an invalidation out.
//! - [`decode`]: `test_decoding`'s text, read into the tables each committed transaction
//!   changed.
//! - [`gate`]: whether the cache may serve a session now: the invalidation stream is live,
//!   caught up and has decoded the session's own last write.
//!
//! Nothing here reads a socket or a clock: the proxy's cache feed and the session pass in
//! what they saw and when, so every rule is unit-tested with data.

pub mod decode;
pub mod gate;
pub mod store;

pub use decode::{Commit, DecodeError, Decoder, Invalidation, SCHEMA_CHANGE_PREFIX};
pub use gate::{Feed, GateLimits, NotServing};
pub use store::{Figures, FillTicket, Limits, Store, Stored};

/// One database's cache: its entries and the state of the stream that keeps them true,
/// which change together.
pub struct Cache {
    pub store: Store,
    pub feed: Feed,
}

impl Cache {
    pub fn new(store: Store) -> Cache {
        Cache {
            store,
            feed: Feed::default(),
        }
    }

    /// A stream starts from its slot's consistent point: nothing stored before counts.
    pub fn went_live(&mut self, now_ms: u64, start_lsn: u64) {
        self.store.clear();
        self.feed.went_live(now_ms, start_lsn);
    }

    /// The stream ended: no entry may outlive the stream that would have dropped it.
    pub fn went_down(&mut self) {
        self.feed.went_down();
        self.store.clear();
    }
}
