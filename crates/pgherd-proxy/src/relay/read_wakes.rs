//! Which of the session's two sockets woke it, so a turn of the pump does not ask the other
//! one again.
//!
//! A read that answered Pending leaves the waker it was asked with in the socket's
//! registration until the socket becomes readable, and the runtime then wakes that waker
//! once. Asked with the task's own waker, any wake-up (the other socket, a write, a signal)
//! looks the same, so every turn asked both reads again: a readiness check and a waker
//! compare under the socket's lock, about 150 instructions each time, roughly one such ask in
//! every turn that answered nothing. Here each read is asked with a waker of its own that
//! notes itself before waking the task. A read is skipped in a turn only when it is *armed*
//! and its note is not set: armed means its last ask, in an earlier turn of the same run of
//! pump turns, was made with its own waker on the same socket (the same server connection)
//! and answered Pending, so that waker is still registered and nothing has arrived since.
//! Anything else (a note, another server connection, a turn after the session left the pump,
//! another task waker) disarms it and it is asked as before. TLS streams are never armed: a
//! TLS read may wait on the socket's writes, which the task's waker registers.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::BytesMut;

use crate::stream::Stream;

/// One read's waker: notes that it fired, then wakes the task.
struct ReadWake {
    fired: AtomicBool,
    task: Waker,
}

impl Wake for ReadWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // Before the wake: the turn it causes reads the note.
        self.fired.store(true, Ordering::Release);
        self.task.wake_by_ref();
    }
}

struct Direction {
    wake: Arc<ReadWake>,
    waker: Waker,
}

impl Direction {
    fn new(task: &Waker) -> Direction {
        let wake = Arc::new(ReadWake {
            fired: AtomicBool::new(false),
            task: task.clone(),
        });
        let waker = Waker::from(wake.clone());
        Direction { wake, waker }
    }

    /// Takes the note (a plain load first: most turns find it unset).
    fn take_fired(&self) -> bool {
        self.wake.fired.load(Ordering::Acquire) && self.wake.fired.swap(false, Ordering::Acquire)
    }
}

/// The session's two read wakers and what each read's last ask left registered.
pub(super) struct ReadWakes {
    client: Direction,
    server: Direction,
    /// The client read's last ask, with its own waker, answered Pending.
    client_armed: bool,
    /// The same for the server read, on the server connection with this id.
    server_armed: Option<u64>,
    /// The last turn of the session ended in the pump, waiting: nothing else has asked the
    /// sockets since.
    continuing: bool,
}

/// Reads a turn may skip: their wakers are registered and have not fired.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Quiet {
    pub client_read: bool,
    pub server_read: bool,
}

impl ReadWakes {
    pub fn new(task: &Waker) -> ReadWakes {
        ReadWakes {
            client: Direction::new(task),
            server: Direction::new(task),
            client_armed: false,
            server_armed: None,
            continuing: false,
        }
    }

    /// The start of a pump turn run by `task` with server connection `server_id` leased:
    /// which reads need no ask.
    pub fn begin_turn(this: &mut Option<ReadWakes>, task: &Waker, server_id: u64) -> Quiet {
        let wakes = match this {
            Some(wakes) if wakes.client.wake.task.will_wake(task) => wakes,
            _ => this.insert(ReadWakes::new(task)),
        };
        if !std::mem::take(&mut wakes.continuing) {
            wakes.client_armed = false;
            wakes.server_armed = None;
        }
        if wakes.client.take_fired() {
            wakes.client_armed = false;
        }
        if wakes.server.take_fired() || wakes.server_armed != Some(server_id) {
            wakes.server_armed = None;
        }
        Quiet {
            client_read: wakes.client_armed,
            server_read: wakes.server_armed.is_some(),
        }
    }

    /// The client's read, asked with its own waker, answered: `pending` arms it.
    fn client_asked(&mut self, pending: bool) {
        self.client_armed = pending;
    }

    /// The server's read on connection `server_id`, asked with its own waker, answered.
    fn server_asked(&mut self, server_id: u64, pending: bool) {
        self.server_armed = pending.then_some(server_id);
    }

    /// How the turn ended: waiting in the pump (the next turn may skip) or anything else.
    pub fn end_turn(this: &mut Option<ReadWakes>, waiting_in_pump: bool) {
        if let Some(wakes) = this {
            wakes.continuing = waiting_in_pump;
        }
    }
}

/// Whose read the pump asks.
#[derive(Debug, Clone, Copy)]
pub(super) enum Side {
    Client,
    /// The leased server connection, by id.
    Server(u64),
}

/// One read of the pump: asked with `side`'s own waker (a Pending arms it), or, for a TLS
/// stream or before the wakes exist, with the task's.
pub(super) fn poll_read(
    this: &mut Option<ReadWakes>,
    side: Side,
    stream: &mut Stream,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    let Some(wakes) = this.as_mut().filter(|_| !stream.is_tls()) else {
        return stream.poll_read_buf(cx, buf);
    };
    let direction = match side {
        Side::Client => &wakes.client,
        Side::Server(_) => &wakes.server,
    };
    let mut own = Context::from_waker(&direction.waker);
    let read = stream.poll_read_buf(&mut own, buf);
    match side {
        Side::Client => wakes.client_asked(read.is_pending()),
        Side::Server(id) => wakes.server_asked(id, read.is_pending()),
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct CountingTask(AtomicUsize);

    impl Wake for CountingTask {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn task() -> (Arc<CountingTask>, Waker) {
        let task = Arc::new(CountingTask(AtomicUsize::new(0)));
        let waker = Waker::from(task.clone());
        (task, waker)
    }

    fn turn(wakes: &mut Option<ReadWakes>, task: &Waker, server: u64) -> (bool, bool) {
        let quiet = ReadWakes::begin_turn(wakes, task, server);
        (quiet.client_read, quiet.server_read)
    }

    #[test]
    fn a_read_is_skipped_only_while_its_own_waker_waits_unfired() {
        let (counter, task) = task();
        let mut wakes = None;
        assert_eq!(
            turn(&mut wakes, &task, 1),
            (false, false),
            "nothing asked yet"
        );
        let w = wakes.as_mut().unwrap();
        w.client_asked(true);
        w.server_asked(1, true);
        ReadWakes::end_turn(&mut wakes, true);
        assert_eq!(turn(&mut wakes, &task, 1), (true, true));
        ReadWakes::end_turn(&mut wakes, true);

        // The server's socket fires: the task is woken and that read asked again.
        wakes.as_ref().unwrap().server.waker.wake_by_ref();
        assert_eq!(counter.0.load(Ordering::SeqCst), 1);
        assert_eq!(turn(&mut wakes, &task, 1), (true, false));
        // Fired and not asked in that turn (say the client's buffer was full): still asked
        // in the next one.
        ReadWakes::end_turn(&mut wakes, true);
        assert_eq!(turn(&mut wakes, &task, 1), (true, false));

        // A read that answered data is asked again next turn.
        wakes.as_mut().unwrap().client_asked(false);
        ReadWakes::end_turn(&mut wakes, true);
        assert_eq!(turn(&mut wakes, &task, 1), (false, false));
    }

    #[test]
    fn leaving_the_pump_another_connection_or_another_task_disarms() {
        let (_counter, task) = task();
        let mut wakes = None;
        let arm = |wakes: &mut Option<ReadWakes>, server| {
            let w = wakes.as_mut().unwrap();
            w.client_asked(true);
            w.server_asked(server, true);
            ReadWakes::end_turn(wakes, true);
        };
        turn(&mut wakes, &task, 1);
        arm(&mut wakes, 1);
        assert_eq!(
            turn(&mut wakes, &task, 2),
            (true, false),
            "another connection"
        );

        arm(&mut wakes, 2);
        ReadWakes::end_turn(&mut wakes, false);
        assert_eq!(
            turn(&mut wakes, &task, 2),
            (false, false),
            "the turn left the pump"
        );

        arm(&mut wakes, 2);
        let (_other_counter, other_task) = self::task();
        assert_eq!(
            turn(&mut wakes, &other_task, 2),
            (false, false),
            "another task"
        );
        assert!(wakes
            .as_ref()
            .unwrap()
            .client
            .wake
            .task
            .will_wake(&other_task));
    }
}
