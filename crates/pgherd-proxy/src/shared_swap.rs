//! Values every plan reads and a reload or a decision replaces (the config, the node list,
//! the cluster view), kept so that sessions read them through caches of their own.

use std::ops::Deref;
use std::sync::Arc;

use arc_swap::cache::Cache;
use arc_swap::ArcSwap;

use crate::counters::Padded;

/// An `ArcSwap` shared with the sessions' caches ([`SharedSwap::cache`]). Each cache holds a
/// reference to it, taken at a login and given back when the session ends or parks: the
/// padding keeps that count off the line of the pointer every plan on every worker reads.
pub struct SharedSwap<T>(Arc<Padded<ArcSwap<T>>>);

/// A session's copy of a [`SharedSwap`]'s value: its `load` compares one pointer with the
/// shared one and loads again only after a change, where a plain load takes and gives back
/// a slot of the thread's debt list.
pub type SwapCache<T> = Cache<SharedSwap<T>, Arc<T>>;

impl<T> SharedSwap<T> {
    pub fn from_pointee(value: T) -> Self {
        SharedSwap(Arc::new(Padded(ArcSwap::from_pointee(value))))
    }

    pub fn cache(&self) -> SwapCache<T> {
        Cache::new(SharedSwap(self.0.clone()))
    }

    /// Whether `cache` is a copy of this value (and not of another instance's).
    pub fn is_cached_by(&self, cache: &SwapCache<T>) -> bool {
        std::ptr::eq(&**self, cache.arc_swap())
    }
}

impl<T> Deref for SharedSwap<T> {
    type Target = ArcSwap<T>;

    fn deref(&self) -> &ArcSwap<T> {
        &self.0 .0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pointer_sessions_read_is_on_a_line_of_its_own_and_their_caches_follow_it() {
        let shared = SharedSwap::from_pointee(1);
        // The reference counts sit just before the value; a value that starts a 128-byte
        // block has them on another line (and another pair of lines).
        assert_eq!(Arc::as_ptr(&shared.0) as usize % 128, 0);
        let mut cache = shared.cache();
        assert!(shared.is_cached_by(&cache));
        assert!(!SharedSwap::from_pointee(1).is_cached_by(&cache));
        assert_eq!(**cache.load(), 1);
        shared.store(Arc::new(2));
        assert_eq!(**cache.load(), 2);
    }
}
