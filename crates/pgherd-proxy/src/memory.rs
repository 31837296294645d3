//! Giving memory back while clients idle: the allocator's hook for returning freed pages, and
//! what each worker thread does about it as it is about to wait for work.
//!
//! A burst of logins, or of clients parking, frees memory in a wave on the thread that served
//! them; the allocator (mimalloc, per thread) keeps freed pages while that thread allocates
//! little, as one serving idle clients does, and the IO buffers' free lists keep what the burst
//! lent. Both are given back on the thread that holds them, once per period (the parking lot
//! starts one every second or sooner).

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use crate::buffers;

/// Clients parked on a thread in a period that make it worth asking the allocator to return
/// pages: the call stalls the thread for about a millisecond with 10,000 clients (measured),
/// too much to pay every period for a few clients whose memory the next ones reuse anyway.
const RELEASE_AFTER_PARKED: usize = 256;
/// Bytes of buffers freed by one trim that make it worth the same.
const RELEASE_AFTER_TRIMMED_BYTES: usize = 1 << 20;

/// What gives freed memory back to the system (the binary's allocator).
static RELEASE: OnceLock<fn()> = OnceLock::new();
/// Periods started: a thread looks at what it can give back at most once per period.
static PERIOD: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The period this thread last looked in.
    static SEEN_PERIOD: Cell<u64> = const { Cell::new(0) };
    /// Clients that parked on this thread since it last looked.
    static PARKED: Cell<usize> = const { Cell::new(0) };
}

/// Sets what gives freed pages back (once, at startup).
pub fn set_release(release: fn()) {
    let _ = RELEASE.set(release);
}

/// Starts a period: each thread's next wait looks at what it can give back.
pub fn start_period() {
    PERIOD.fetch_add(1, Ordering::Relaxed);
}

/// A client parked on this thread: what its task and session held is freed here.
pub fn note_parked() {
    PARKED.with(|parked| parked.set(parked.get() + 1));
}

/// For each worker thread as it is about to wait for work (the runtime's park hook): once per
/// period, frees the IO buffers its free list kept unlent through the whole period before, and
/// returns freed pages to the system after a large trim or a wave of parked clients. One
/// thread-local read and one atomic load otherwise.
pub fn on_thread_idle() {
    let period = PERIOD.load(Ordering::Relaxed);
    if SEEN_PERIOD.with(|seen| seen.replace(period)) == period {
        return;
    }
    let trimmed_bytes = buffers::trim_unlent();
    let parked = PARKED.with(|parked| parked.replace(0));
    if trimmed_bytes >= RELEASE_AFTER_TRIMMED_BYTES || parked >= RELEASE_AFTER_PARKED {
        if let Some(release) = RELEASE.get() {
            release();
        }
    }
}
