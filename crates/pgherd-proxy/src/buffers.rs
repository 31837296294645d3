//! Read and write buffers lent to sessions while they are busy. An idle client holds no buffer;
//! a busy one takes one from its thread's free list instead of the allocator, so the data path
//! allocates nothing per transaction and 10,000 idle clients cost no buffer memory. What a
//! free list kept unlent for a whole period (after a burst of logins, say) goes back to the
//! allocator ([`trim_unlent`], from `crate::memory`).

use std::cell::RefCell;

use bytes::BytesMut;

/// Size of a fresh buffer; larger messages grow it.
pub const BUFFER_BYTES: usize = 8 << 10;
/// Buffers kept per thread; beyond this they go back to the allocator.
const MAX_FREE_PER_THREAD: usize = 512;
/// Buffers that grew past this are not kept (one huge message should not pin memory).
const MAX_KEPT_CAPACITY: usize = 64 << 10;

thread_local! {
    static FREE: RefCell<FreeList> = const { RefCell::new(FreeList { buffers: Vec::new(), unlent: 0 }) };
}

struct FreeList {
    buffers: Vec<BytesMut>,
    /// The fewest buffers the list held since it was last trimmed: that many at its bottom
    /// were not lent once in that time.
    unlent: usize,
}

/// An empty buffer with room for at least half of [`BUFFER_BYTES`] (see [`give`]).
pub fn take() -> BytesMut {
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        let buf = free.buffers.pop();
        free.unlent = free.unlent.min(free.buffers.len());
        buf
    })
    .unwrap_or_else(|| BytesMut::with_capacity(BUFFER_BYTES))
}

/// Returns a buffer that is no longer needed.
pub fn give(mut buf: BytesMut) {
    buf.clear();
    // A buffer that was read from starts where its reader left off. Its space is taken back
    // (without allocating) only once less than half is left: done at every return, it cost
    // about fifty instructions twice per transaction.
    if buf.capacity() < BUFFER_BYTES / 2 && !buf.try_reclaim(BUFFER_BYTES) {
        // Small: grown from nothing by a write, it would only be reallocated later.
        return;
    }
    if buf.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        if free.buffers.len() < MAX_FREE_PER_THREAD {
            free.buffers.push(buf);
        }
    });
}

/// Frees the buffers this thread's free list held unlent since it was last trimmed (the
/// oldest, at the bottom of the stack), and returns their bytes.
pub fn trim_unlent() -> usize {
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        let unlent = free.unlent.min(free.buffers.len());
        let freed_bytes = free.buffers.drain(..unlent).map(|b| b.capacity()).sum();
        free.unlent = free.buffers.len();
        if free.buffers.is_empty() {
            free.buffers = Vec::new();
        }
        freed_bytes
    })
}

/// Takes `slot`'s buffer back to the free list if it is empty.
pub fn release_if_empty(slot: &mut BytesMut) {
    if slot.is_empty() && slot.capacity() > 0 {
        give(std::mem::take(slot));
    }
}

/// Lets go of a buffer that one large message grew, once it is empty, so memory goes back.
pub fn shrink_if_grown(slot: &mut BytesMut) {
    if slot.is_empty() && slot.capacity() > MAX_KEPT_CAPACITY {
        *slot = BytesMut::new();
    }
}

/// Gives an empty `slot` a pooled buffer before something is written into it.
pub fn ready_for_write(slot: &mut BytesMut) {
    if slot.capacity() == 0 {
        *slot = take();
    }
}

/// Makes sure `slot` can take a read of at least half a buffer.
pub fn ready_for_read(slot: &mut BytesMut) {
    if slot.capacity() == 0 {
        *slot = take();
    } else if slot.capacity() - slot.len() < BUFFER_BYTES / 2 {
        slot.reserve(BUFFER_BYTES);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_len() -> usize {
        FREE.with(|free| free.borrow().buffers.len())
    }

    #[test]
    fn buffers_unlent_for_a_whole_period_go_back_and_lent_ones_stay() {
        let lent: Vec<BytesMut> = (0..4).map(|_| take()).collect();
        lent.into_iter().for_each(give);
        assert_eq!(free_len(), 4);
        // The period in which they came back: each was lent in it.
        assert_eq!(trim_unlent(), 0);
        let again = take();
        give(again);
        // One lent since; the three below it were not.
        assert_eq!(trim_unlent(), 3 * BUFFER_BYTES);
        assert_eq!(free_len(), 1);
        assert_eq!(trim_unlent(), BUFFER_BYTES);
        assert_eq!(free_len(), 0);
        assert_eq!(trim_unlent(), 0);
    }

    #[test]
    fn a_thread_going_idle_gives_back_what_a_burst_left_once_a_period_passed() {
        let burst: Vec<BytesMut> = (0..8).map(|_| take()).collect();
        burst.into_iter().for_each(give);
        crate::memory::start_period();
        crate::memory::on_thread_idle();
        // Waits without a new period do nothing more.
        crate::memory::on_thread_idle();
        assert_eq!(free_len(), 8);
        crate::memory::start_period();
        crate::memory::on_thread_idle();
        assert_eq!(free_len(), 0);
    }

    #[test]
    fn a_buffer_read_from_comes_back_and_gets_its_room_again_without_allocating() {
        use bytes::Buf;
        let read_into = |buf: &mut BytesMut, bytes: usize| {
            buf.extend_from_slice(&vec![7u8; bytes]);
            buf.advance(bytes);
        };
        let mut buf = take();
        let start = buf.as_ptr();
        // A little read: lent again as it is, where the reader left off.
        read_into(&mut buf, 1000);
        give(buf);
        let mut buf = take();
        assert_eq!(buf.capacity(), BUFFER_BYTES - 1000);
        assert!(ready_for_read_keeps(&mut buf));
        // Past half: its whole room again, in the same allocation.
        read_into(&mut buf, 4000);
        give(buf);
        let buf = take();
        assert_eq!(buf.capacity(), BUFFER_BYTES);
        assert_eq!(buf.as_ptr(), start);
        give(buf);
        // A small buffer grown by a write is not kept.
        let mut small = BytesMut::new();
        small.extend_from_slice(b"hello");
        let before = free_len();
        give(small);
        assert_eq!(free_len(), before);
    }

    /// `ready_for_read` finds room for a read in `buf` without replacing it.
    fn ready_for_read_keeps(buf: &mut BytesMut) -> bool {
        let at = buf.as_ptr();
        ready_for_read(buf);
        buf.as_ptr() == at && buf.capacity() - buf.len() >= BUFFER_BYTES / 2
    }
}
