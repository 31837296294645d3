//! The core of a pool: its idle items, the count of items it has, and the clients waiting for
//! one; generic over the item so the concurrency can be tested on its own (`exchange_tests.rs`)
//! with the code production runs.
//!
//! A warm pool's lending and giving back touch no line another worker writes. Idle items sit
//! in lanes, one per worker thread (`counters::stripe`): a worker lends from and gives back to
//! its own lane, and takes from another's only when its own is empty. The count of items and
//! the number of waiting clients sit on one line every lend and give back reads, written only
//! when an item is made or discarded or a client starts or stops waiting. The waiters queue, in
//! arrival order, behind the central lock, which only the paths with no idle item take.
//!
//! A give-back and a client starting to wait can cross: the give-back puts its item in a lane
//! after the client looked there, and reads "nobody waits" before the client said it waits.
//! Both sides therefore write first (the item into a lane; the waiter's count), then fence, then
//! read the other's side; at least one of them sees the other and moves the item to the waiter.
//! While any client waits, lending skips the lanes, so a newcomer never overtakes a waiter.

use std::collections::VecDeque;
use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};
use tokio::sync::oneshot;

use crate::counters::{stripe, Padded, STRIPES};

/// What a waiting client receives.
#[derive(Debug)]
pub(crate) enum Handoff<T> {
    Item(T),
    /// A slot freed up (an item was discarded, the pool grew): try again, maybe to make one.
    Retry,
}

/// What a client that found no idle item in its lane does next.
#[derive(Debug)]
pub(crate) enum Next<T> {
    /// An idle item from another lane.
    Take(T),
    /// A slot was reserved (counted in the total): make an item, then `made` or `unmade`.
    Make,
    /// Every slot is taken: wait for a give-back or a retry.
    Wait(oneshot::Receiver<Handoff<T>>),
}

/// The exchange was closed: it lends nothing more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Closed;

/// Counts at one instant, taken with every lock held.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counts {
    pub idle: u32,
    pub lent: u32,
    pub connecting: u32,
    pub waiting: u32,
    pub total: u32,
}

enum GiveBack<T> {
    Done,
    Refused(T),
    NobodyWaits(T),
}

/// Read by every lend and give back, written rarely.
#[derive(Debug, Default)]
struct Shared {
    /// Clients in the queue (some may have given up and not yet been dropped from it).
    waiting: AtomicUsize,
    /// Items that exist: idle, lent, and being made. Grown only under the central lock, after
    /// checking the limit there; shrunk by anyone, which cannot break that check.
    total: AtomicU32,
    /// Set under the central lock.
    closed: AtomicBool,
}

#[derive(Debug)]
struct Central<T> {
    waiters: VecDeque<oneshot::Sender<Handoff<T>>>,
    /// Reserved slots whose item is being made.
    connecting: u32,
}

/// Lock order: central, then lanes in index order; a lane's lock is never held while taking
/// another lock, except by `counts` and `take_idle`, which hold the central lock first.
#[derive(Debug)]
pub(crate) struct Exchange<T> {
    lanes: [Padded<Mutex<Vec<T>>>; STRIPES],
    shared: Padded<Shared>,
    central: Mutex<Central<T>>,
}

impl<T> Default for Exchange<T> {
    fn default() -> Self {
        Exchange {
            lanes: std::array::from_fn(|_| Padded(Mutex::new(Vec::new()))),
            shared: Padded::default(),
            central: Mutex::new(Central {
                waiters: VecDeque::new(),
                connecting: 0,
            }),
        }
    }
}

impl<T> Exchange<T> {
    pub fn is_closed(&self) -> bool {
        self.shared.0.closed.load(Ordering::SeqCst)
    }

    pub fn total(&self) -> u32 {
        self.shared.0.total.load(Ordering::SeqCst)
    }

    /// An idle item, unless a client waits for one (it goes first) or none is idle. The path
    /// of every transaction on a warm pool: this thread's lane's lock, nothing shared written.
    pub fn try_take(&self) -> Option<T> {
        if self.shared.0.waiting.load(Ordering::SeqCst) > 0 || self.is_closed() {
            return None;
        }
        self.pop_any()
    }

    /// This thread's lane first, then the others.
    fn pop_any(&self) -> Option<T> {
        let own = stripe();
        (0..STRIPES).find_map(|i| self.lanes[(own + i) % STRIPES].0.lock().pop())
    }

    /// The way on when `try_take` found nothing: an idle item, a slot to make one below
    /// `max_total`, or a place in the queue.
    pub fn next(&self, max_total: u32) -> Result<Next<T>, Closed> {
        let mut central = self.central.lock();
        if let Some(next) = self.take_or_reserve(&mut central, max_total)? {
            return Ok(next);
        }
        Ok(Next::Wait(self.enqueue(&mut central, max_total)))
    }

    fn take_or_reserve(
        &self,
        central: &mut Central<T>,
        max_total: u32,
    ) -> Result<Option<Next<T>>, Closed> {
        if self.is_closed() {
            return Err(Closed);
        }
        self.serve_waiters(central);
        if central.waiters.is_empty() {
            if let Some(item) = self.pop_any() {
                return Ok(Some(Next::Take(item)));
            }
        }
        Ok(self
            .reserve_locked(central, max_total)
            .then_some(Next::Make))
    }

    fn enqueue(&self, central: &mut Central<T>, max_total: u32) -> oneshot::Receiver<Handoff<T>> {
        let (tx, rx) = oneshot::channel();
        central.waiters.push_back(tx);
        self.note_waiting(central);
        // Against a give-back or a discard that read "nobody waits" (the module's comment).
        fence(Ordering::SeqCst);
        self.serve_waiters(central);
        if self.total() < max_total {
            self.wake_one_to_retry(central);
        }
        rx
    }

    /// Reserves a slot if fewer than `below` items exist (warming up to a minimum).
    pub fn reserve(&self, below: u32) -> Result<bool, Closed> {
        let mut central = self.central.lock();
        if self.is_closed() {
            return Err(Closed);
        }
        Ok(self.reserve_locked(&mut central, below))
    }

    fn reserve_locked(&self, central: &mut Central<T>, below: u32) -> bool {
        if self.total() >= below {
            return false;
        }
        self.shared.0.total.fetch_add(1, Ordering::SeqCst);
        central.connecting += 1;
        true
    }

    /// A reserved slot's item was made; it is lent to the one who made it.
    pub fn made(&self) {
        let mut central = self.central.lock();
        central.connecting = central.connecting.saturating_sub(1);
    }

    /// A reserved slot's item could not be made: the slot is free again.
    pub fn unmade(&self) {
        {
            let mut central = self.central.lock();
            central.connecting = central.connecting.saturating_sub(1);
        }
        self.discard();
    }

    /// Counts an item that arrives lent (made elsewhere); false once closed.
    pub fn adopt(&self) -> bool {
        let _central = self.central.lock();
        if self.is_closed() {
            return false;
        }
        self.shared.0.total.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// A lent item will not come back (it was closed): its slot is free, and the first
    /// waiting client is told to retry.
    pub fn discard(&self) {
        self.shared.0.total.fetch_sub(1, Ordering::SeqCst);
        if self.shared.0.waiting.load(Ordering::SeqCst) > 0 {
            let mut central = self.central.lock();
            self.wake_one_to_retry(&mut central);
        }
    }

    /// Gives a lent item back: to the first waiting client, else into this thread's lane.
    /// `admit` says whether the item may still be lent (a pool reconnecting refuses older
    /// connections); it is asked under the lock that makes the give-back final, so a drain
    /// that follows a change of its answer finds every item it admitted. A refused item, or
    /// any item once the exchange is closed, comes back to the caller, still counted: close
    /// it and `discard`.
    pub fn give_back(&self, item: T, admit: impl Fn(&T) -> bool) -> Result<(), T> {
        let item = match self.give_to_waiting(item, &admit) {
            GiveBack::Done => return Ok(()),
            GiveBack::Refused(item) => return Err(item),
            GiveBack::NobodyWaits(item) => item,
        };
        self.put_idle(item, &admit)
    }

    fn give_to_waiting(&self, item: T, admit: &impl Fn(&T) -> bool) -> GiveBack<T> {
        if self.shared.0.waiting.load(Ordering::SeqCst) == 0 {
            return GiveBack::NobodyWaits(item);
        }
        let mut central = self.central.lock();
        if self.is_closed() || !admit(&item) {
            return GiveBack::Refused(item);
        }
        let handed = Self::hand_to_first_waiter(&mut central, item);
        self.note_waiting(&central);
        match handed {
            Ok(()) => GiveBack::Done,
            // Everyone in the queue had given up.
            Err(item) => GiveBack::NobodyWaits(item),
        }
    }

    fn put_idle(&self, item: T, admit: &impl Fn(&T) -> bool) -> Result<(), T> {
        {
            let mut lane = self.lanes[stripe()].0.lock();
            if self.is_closed() || !admit(&item) {
                return Err(item);
            }
            lane.push(item);
        }
        // Against a client that started waiting after looking in this lane (the module's
        // comment).
        fence(Ordering::SeqCst);
        if self.shared.0.waiting.load(Ordering::SeqCst) > 0 {
            let mut central = self.central.lock();
            self.serve_waiters(&mut central);
        }
        Ok(())
    }

    /// Hands idle items to the waiting clients, first come first served.
    fn serve_waiters(&self, central: &mut Central<T>) {
        while !central.waiters.is_empty() && !self.is_closed() {
            if central.waiters.front().is_some_and(|w| w.is_closed()) {
                central.waiters.pop_front();
                continue;
            }
            let Some(item) = self.pop_any() else { break };
            if let Err(item) = Self::hand_to_first_waiter(central, item) {
                // Everyone left had given up; the item stays idle (not closed: checked above,
                // and closing needs the central lock held here).
                self.lanes[stripe()].0.lock().push(item);
            }
        }
        self.note_waiting(central);
    }

    /// Sends `offer` to the first waiter still listening; gives it back when none is.
    fn send_first(central: &mut Central<T>, mut offer: Handoff<T>) -> Result<(), Handoff<T>> {
        while let Some(waiter) = central.waiters.pop_front() {
            match waiter.send(offer) {
                Ok(()) => return Ok(()),
                Err(back) => offer = back,
            }
        }
        Err(offer)
    }

    fn hand_to_first_waiter(central: &mut Central<T>, item: T) -> Result<(), T> {
        match Self::send_first(central, Handoff::Item(item)) {
            Err(Handoff::Item(item)) => Err(item),
            Ok(()) | Err(Handoff::Retry) => Ok(()),
        }
    }

    fn wake_one_to_retry(&self, central: &mut Central<T>) {
        let _ = Self::send_first(central, Handoff::Retry);
        self.note_waiting(central);
    }

    fn note_waiting(&self, central: &Central<T>) {
        self.shared
            .0
            .waiting
            .store(central.waiters.len(), Ordering::SeqCst);
    }

    /// A retry a waiting client received but will not use goes to the next one.
    pub fn pass_retry_on(&self) {
        let mut central = self.central.lock();
        self.wake_one_to_retry(&mut central);
    }

    /// Tells every waiting client to retry (the limit grew).
    pub fn wake_all_to_retry(&self) {
        let waiters = {
            let mut central = self.central.lock();
            let waiters = std::mem::take(&mut central.waiters);
            self.note_waiting(&central);
            waiters
        };
        for waiter in waiters {
            let _ = waiter.send(Handoff::Retry);
        }
    }

    fn lock_lanes(&self) -> Vec<MutexGuard<'_, Vec<T>>> {
        self.lanes.iter().map(|lane| lane.0.lock()).collect()
    }

    fn counts_locked(&self, central: &Central<T>, lanes: &[MutexGuard<'_, Vec<T>>]) -> Counts {
        let idle = lanes.iter().map(|lane| lane.len() as u32).sum::<u32>();
        let total = self.total();
        Counts {
            idle,
            lent: total.saturating_sub(idle + central.connecting),
            connecting: central.connecting,
            waiting: central.waiters.len() as u32,
            total,
        }
    }

    /// The counts at one instant: nothing moves between idle and lent while they are read.
    pub fn counts(&self) -> Counts {
        let central = self.central.lock();
        let lanes = self.lock_lanes();
        self.counts_locked(&central, &lanes)
    }

    /// Takes every idle item out (no longer counted; the caller closes them outside the
    /// locks), with the counts right after.
    pub fn take_idle(&self) -> (Vec<T>, Counts) {
        let central = self.central.lock();
        let mut lanes = self.lock_lanes();
        let idle: Vec<T> = lanes.iter_mut().flat_map(|lane| lane.drain(..)).collect();
        self.shared
            .0
            .total
            .fetch_sub(idle.len() as u32, Ordering::SeqCst);
        let counts = self.counts_locked(&central, &lanes);
        (idle, counts)
    }

    /// Closes the exchange: nothing more is lent, waiting clients are let go (their channel
    /// closes), and the idle items are returned to be closed.
    pub fn close(&self) -> Vec<T> {
        {
            let mut central = self.central.lock();
            self.shared.0.closed.store(true, Ordering::SeqCst);
            central.waiters.clear();
            self.note_waiting(&central);
        }
        self.take_idle().0
    }

    /// Keeps the idle items `keep` says to keep, least recently given back first within a
    /// lane; `keep` sees the total as it stands (the items dropped before it no longer
    /// counted). Returns the others, no longer counted.
    pub fn retain_idle(&self, mut keep: impl FnMut(&T, u32) -> bool) -> Vec<T> {
        let _central = self.central.lock();
        let mut dropped = Vec::new();
        for lane in &self.lanes {
            let mut lane = lane.0.lock();
            let mut kept = Vec::with_capacity(lane.len());
            for item in lane.drain(..) {
                if keep(&item, self.total()) {
                    kept.push(item);
                } else {
                    self.shared.0.total.fetch_sub(1, Ordering::SeqCst);
                    dropped.push(item);
                }
            }
            *lane = kept;
        }
        dropped
    }

    /// Something about each idle item.
    pub fn map_idle<R>(&self, mut f: impl FnMut(&T) -> R) -> Vec<R> {
        let mut out = Vec::new();
        for lane in &self.lanes {
            out.extend(lane.0.lock().iter().map(&mut f));
        }
        out
    }
}

#[cfg(test)]
#[path = "exchange_tests.rs"]
mod tests;
