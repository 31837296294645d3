//! Read and write buffers lent to sessions while they are busy. An idle client holds no buffer;
//! a busy one takes one from its thread's free list instead of the allocator, so the data path
//! allocates nothing per transaction and 10,000 idle clients cost no buffer memory.

use std::cell::RefCell;

use bytes::BytesMut;

/// Size of a fresh buffer; larger messages grow it.
pub const BUFFER_BYTES: usize = 8 << 10;
/// Buffers kept per thread; beyond this they go back to the allocator.
const MAX_FREE_PER_THREAD: usize = 512;
/// Buffers that grew past this are not kept (one huge message should not pin memory).
const MAX_KEPT_CAPACITY: usize = 64 << 10;

thread_local! {
    static FREE: RefCell<Vec<BytesMut>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer with room for at least [`BUFFER_BYTES`].
pub fn take() -> BytesMut {
    let mut buf = FREE
        .with(|free| free.borrow_mut().pop())
        .unwrap_or_else(|| BytesMut::with_capacity(BUFFER_BYTES));
    // Reclaims space freed by `advance` without allocating when possible.
    buf.reserve(BUFFER_BYTES);
    buf
}

/// Returns a buffer that is no longer needed.
pub fn give(mut buf: BytesMut) {
    // Small buffers (grown from nothing by a write) would only be reallocated later.
    if buf.capacity() < BUFFER_BYTES / 2 || buf.capacity() > MAX_KEPT_CAPACITY {
        return;
    }
    buf.clear();
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        if free.len() < MAX_FREE_PER_THREAD {
            free.push(buf);
        }
    });
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
