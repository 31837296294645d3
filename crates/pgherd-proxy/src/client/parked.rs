//! Idle clients parked: a client idle between transactions for `client_park_after_ms` gives up
//! its task, its socket's registration in the runtime and the per-transaction half of its
//! session, and waits here as its socket in one epoll set of pgherd's own plus the part of its
//! session that lasts ([`ParkedSession`]). When the client speaks (or closes), or a signal
//! comes for it (kill, shutdown, an upgrade's move, a cancel), it gets a task again and carries
//! on as it was. Thousands of idle application connections then cost about half the memory
//! they did (see docs/benchmarks.md), and nothing on the path of a client that is busy: the
//! sweep that finds idle clients runs once per period, and a busy session pays one branch on
//! the signals it already loads every poll.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;
use std::task::{Wake, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::Notify;

use super::{log_end, serve_session, SessionRun};
use crate::app::App;
use crate::clients::{
    ConnectionSlot, SIGNAL_CANCEL, SIGNAL_HANDOVER, SIGNAL_KILL, SIGNAL_SHUTDOWN,
};
use crate::error::Disconnect;
use crate::memory;
use crate::relay::{ParkedSession, Session};

/// Signals that a parked session must be woken for: it handles them as a live one does.
const UNPARK_SIGNALS: u8 = SIGNAL_SHUTDOWN | SIGNAL_KILL | SIGNAL_HANDOVER | SIGNAL_CANCEL;
/// Sockets taken from the epoll set per system call.
const EVENTS_PER_WAIT: usize = 64;
/// How often parked clients' idle deadlines are checked, at the longest (also when parking
/// is switched off: clients parked before a reload switched it off still time out).
const IDLE_CHECK_MS: u64 = 1_000;

/// The parked clients, by client id.
pub struct ParkingLot {
    epoll: AsyncFd<OwnedFd>,
    parked: Mutex<HashMap<u64, Box<Parked>>>,
    /// Registered as every parked client's waker: a signal raised for one of them wakes the
    /// lot, which finds which by its signals.
    signalled: Arc<Signalled>,
}

struct Parked {
    session: ParkedSession,
    tcp: std::net::TcpStream,
    /// Keeps the client counted against max_client_connections.
    slot: ConnectionSlot,
}

#[derive(Default)]
struct Signalled(Notify);

impl Wake for Signalled {
    fn wake(self: Arc<Self>) {
        self.0.notify_one();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.0.notify_one();
    }
}

impl ParkingLot {
    fn new() -> io::Result<ParkingLot> {
        // SAFETY: epoll_create1 has no memory arguments; a non-negative result is a new
        // descriptor that nothing else owns.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: see above.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an OwnedFd's descriptor stays open, and the same, for as long as it is owned.
        let epoll = unsafe { AsyncFd::register_with_interest(epoll, Interest::READABLE) }
            .map_err(io::Error::from)?;
        Ok(ParkingLot {
            epoll,
            parked: Mutex::new(HashMap::new()),
            signalled: Arc::default(),
        })
    }

    /// Clients parked now.
    pub fn parked_count(&self) -> usize {
        self.parked.lock().len()
    }

    fn watch(&self, fd: RawFd, id: u64) -> io::Result<()> {
        let mut event = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            u64: id,
        };
        // SAFETY: `event` lives across the call; the descriptors are open.
        let done =
            unsafe { libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut event) };
        match done {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }

    fn unwatch(&self, fd: RawFd) {
        // SAFETY: no event is read with EPOLL_CTL_DEL; the descriptors are open.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd,
                std::ptr::null_mut(),
            );
        }
    }

    /// The ids of parked clients whose sockets are readable (or closed), without waiting.
    fn ready(&self, ids: &mut Vec<u64>) -> io::Result<usize> {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; EVENTS_PER_WAIT];
        // SAFETY: `events` has room for EVENTS_PER_WAIT entries; a zero timeout never blocks.
        let n = unsafe {
            libc::epoll_wait(
                self.epoll.as_raw_fd(),
                events.as_mut_ptr(),
                EVENTS_PER_WAIT as i32,
                0,
            )
        };
        match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            0 => Err(io::ErrorKind::WouldBlock.into()),
            n => {
                let n = n as usize;
                ids.extend(events[..n].iter().map(|e| e.u64));
                Ok(n)
            }
        }
    }

    fn take(&self, id: u64) -> Option<Box<Parked>> {
        let parked = self.parked.lock().remove(&id)?;
        self.unwatch(parked.tcp.as_raw_fd());
        Some(parked)
    }

    /// Parked clients that a signal was raised for, or whose idle timeout is over. Each gets
    /// the lot's waker again: a wake that unparked nobody (a signal taken back) used up the
    /// one it had.
    fn due(&self, now: tokio::time::Instant) -> Vec<u64> {
        let waker = Waker::from(self.signalled.clone());
        let mut due = Vec::new();
        for (id, parked) in self.parked.lock().iter() {
            let shared = parked.session.shared();
            // Before reading the signals: one raised after the reading wakes the lot.
            shared.register_waker(&waker);
            if shared.signals() & UNPARK_SIGNALS != 0
                || parked.session.idle_deadline().is_some_and(|d| d <= now)
            {
                due.push(*id);
            }
        }
        due
    }
}

/// Parks a session that left its task to be parked ([`Disconnect::Parked`]); if the lot is
/// not running, gives it back to carry on.
pub(super) fn park(run: Box<SessionRun>) -> Option<Box<SessionRun>> {
    let Some(lot) = run.app.parking.get().cloned() else {
        return Some(run);
    };
    let SessionRun {
        session,
        app,
        shared,
        _slot: slot,
        addr: _,
    } = *run;
    let (tcp, session) = match session.park() {
        Ok(parked) => parked,
        Err(e) => {
            let end = Disconnect::ClientIo(e);
            app.clients.unregister(&shared);
            log_end(&end, shared.addr, Some(shared.id));
            return None;
        }
    };
    let id = shared.id;
    let fd = tcp.as_raw_fd();
    shared.set_parked(true);
    shared.register_waker(&Waker::from(lot.signalled.clone()));
    lot.parked
        .lock()
        .insert(id, Box::new(Parked { session, tcp, slot }));
    memory::note_parked();
    if let Err(e) = lot.watch(fd, id) {
        tracing::warn!(client = id, error = %e, "cannot park an idle client; it carries on unparked");
        unpark(&app, &lot, id);
        return None;
    }
    // A signal raised before the lot's waker was registered woke the session's task, gone.
    if shared.signals() & UNPARK_SIGNALS != 0 {
        unpark(&app, &lot, id);
    }
    None
}

/// Gives a parked client a task again.
fn unpark(app: &Arc<App>, lot: &ParkingLot, id: u64) {
    let Some(parked) = lot.take(id) else {
        return;
    };
    let Parked { session, tcp, slot } = *parked;
    let shared = session.shared().clone();
    let addr = shared.addr;
    shared.set_parked(false);
    let tcp = match TcpStream::from_std(tcp) {
        Ok(tcp) => tcp,
        Err(e) => {
            app.clients.unregister(&shared);
            log_end(&Disconnect::ClientIo(e), addr, Some(id));
            return;
        }
    };
    let session = Session::unpark(app.clone(), session, tcp);
    tokio::spawn(serve_session(Box::new(SessionRun {
        session,
        app: app.clone(),
        shared,
        _slot: slot,
        addr,
    })));
}

/// The lot's task, for the life of the process: finds idle clients (the sweep), and gives
/// parked ones a task again when their socket is readable, a signal comes for them or their
/// idle timeout ends.
pub async fn run(app: Arc<App>) {
    let lot = match ParkingLot::new() {
        Ok(lot) => Arc::new(lot),
        Err(e) => {
            tracing::warn!(error = %e, "idle clients cannot be parked: each keeps its task");
            return;
        }
    };
    if app.parking.set(lot.clone()).is_err() {
        return;
    }
    let mut ids = Vec::new();
    let mut next_check = tokio::time::Instant::now();
    let mut next_sweep = next_check;
    loop {
        tokio::select! {
            guard = lot.epoll.readable() => {
                let Ok(mut guard) = guard else {
                    tracing::warn!("the parking lot's epoll set failed; parked clients stay parked");
                    return;
                };
                ids.clear();
                if guard.try_io(|_| lot.ready(&mut ids)).is_ok() {
                    for id in ids.drain(..) {
                        unpark(&app, &lot, id);
                    }
                }
            }
            () = lot.signalled.0.notified() => {
                for id in lot.due(tokio::time::Instant::now()) {
                    unpark(&app, &lot, id);
                }
            }
            () = tokio::time::sleep_until(next_check) => {
                let park_after_ms = app.config().proxy.client_park_after_ms;
                let now = tokio::time::Instant::now();
                if park_after_ms > 0 && now >= next_sweep {
                    app.clients.sweep_idle();
                    next_sweep = now + Duration::from_millis(park_after_ms);
                }
                for id in lot.due(now) {
                    unpark(&app, &lot, id);
                }
                memory::start_period();
                // Deadlines are checked at least every IDLE_CHECK_MS, however long the sweep's
                // period: a parked client's idle timeout acts at most that late.
                let check_ms = match park_after_ms {
                    0 => IDLE_CHECK_MS,
                    ms => ms.min(IDLE_CHECK_MS),
                };
                next_check = now + Duration::from_millis(check_ms);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_parked_client_stays_in_its_allocation_class() {
        // mimalloc's 224-byte class: 10,000 parked clients are about 2.2 MiB of it.
        let allocated = std::mem::size_of::<super::Parked>();
        assert!(allocated <= 224, "{allocated} bytes");
    }
}
