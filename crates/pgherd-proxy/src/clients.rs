//! Connected clients: the cancel keys pgherd hands out, where each client's queries currently
//! run (so a CancelRequest reaches the right server backend), and the list SHOW CLIENTS reads.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;
use pgherd_wire::startup::CancelKey;
use tokio::sync::Notify;

/// pgherd is shutting down: end the session at its next idle point.
pub const SIGNAL_SHUTDOWN: u8 = 1;
/// An operator killed the session: end it now.
pub const SIGNAL_KILL: u8 = 2;
/// The client cancelled the request that waits for a server (raised only during such a wait).
pub const SIGNAL_CANCEL: u8 = 4;
/// pgherd is being upgraded: move the session to the new process at its next idle point.
pub const SIGNAL_HANDOVER: u8 = 8;
/// The idle sweep saw the session and it has not been polled since (`sweep_idle`).
pub const SIGNAL_PARK_CANDIDATE: u8 = 16;
/// Not polled for a whole sweep: park if idle (`client/parked.rs`).
pub const SIGNAL_PARK: u8 = 32;
/// Parked now: the sweep leaves it alone.
pub const SIGNAL_PARKED: u8 = 64;
/// A session that can park (plain TCP, servers shared between transactions): the only kind
/// the sweep asks; others (TLS, session mode, a sharded endpoint, the console) never are.
pub const SIGNAL_MAY_PARK: u8 = 128;

use crate::server::send_cancel;

/// What ended a wait for a server before it was over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupt {
    Cancelled,
    Handover,
}

/// Where a client's requests run right now.
#[derive(Debug, Clone, Copy)]
pub struct ServerTarget {
    pub server_id: u64,
    pub peer: crate::server::ServerAddr,
    pub key: CancelKey,
    /// The node, by the address of its `NodeState` (see [`ServerTarget::is_on`]): exact
    /// whatever the node's host is called, and free to copy on every transaction.
    pub node: usize,
}

impl ServerTarget {
    pub fn node_id(node: &crate::nodes::NodeState) -> usize {
        node as *const crate::nodes::NodeState as usize
    }

    pub fn is_on(&self, node: &crate::nodes::NodeState) -> bool {
        self.node == Self::node_id(node)
    }
}

/// What few clients' shared state ever holds, boxed: every client carries one word for it
/// instead of its size, which keeps the shared state in the allocator's 192-byte class.
#[derive(Debug, Default)]
struct Rare {
    /// The other servers running the same statement (a sharded endpoint's links): a cancel
    /// reaches each of them too.
    also: Vec<(ServerTarget, Option<RawFd>)>,
    kill_reason: Option<Box<str>>,
}

#[derive(Debug, Default)]
struct Live {
    target: Option<ServerTarget>,
    /// Cancels sent to `target` that the server has not acknowledged yet. The server connection
    /// is not handed to another client until this is zero, so a late cancel can never hit
    /// someone else's query.
    cancels_in_flight: u32,
    /// `target`'s TCP socket plus one (`None` through a Unix-domain socket, or with no
    /// target), which `cut_off_sessions` asks the kernel about while the node is down. Plus
    /// one so that `None` needs no room of its own and the field fits beside the count.
    tcp_fd_plus_one: Option<NonZeroU32>,
    rare: Option<Box<Rare>>,
}

impl Live {
    /// The other servers running the statement, each with its TCP socket.
    fn also(&self) -> &[(ServerTarget, Option<RawFd>)] {
        self.rare.as_ref().map_or(&[], |rare| &rare.also)
    }

    fn targets(&self) -> impl Iterator<Item = &ServerTarget> {
        self.target.iter().chain(self.also().iter().map(|(t, _)| t))
    }

    fn clear_targets(&mut self) {
        self.target = None;
        self.tcp_fd_plus_one = None;
        if let Some(rare) = &mut self.rare {
            rare.also.clear();
        }
    }
}

/// A socket's descriptor plus one, so that `None` takes no room of its own.
fn plus_one(fd: Option<RawFd>) -> Option<NonZeroU32> {
    fd.and_then(|fd| u32::try_from(fd).ok()?.checked_add(1))
        .and_then(NonZeroU32::new)
}

/// What other tasks may see of a client.
#[derive(Debug)]
pub struct ClientShared {
    pub id: u64,
    pub key: CancelKey,
    pub addr: SocketAddr,
    /// Shared by every client that logged in with the same pair (`ClientRegistry::login`).
    login: Arc<Login>,
    pub tls: bool,
    /// When it connected, in seconds since the Unix epoch.
    pub connected_at_unix_s: u64,
    live: Mutex<Live>,
    /// Signals for the session (SIGNAL_*), read with one atomic load per poll instead of
    /// registering a waiter per transaction.
    signals: AtomicU8,
    waker: AtomicWaker,
}

impl ClientShared {
    /// The user the client logged in as.
    pub fn user(&self) -> &str {
        &self.login.user
    }

    /// The database the client logged in to.
    pub fn database(&self) -> &str {
        &self.login.database
    }

    /// Where the client's requests run now, and the TCP socket they go through (`None`
    /// through a Unix-domain socket).
    pub fn set_target(&self, target: ServerTarget, tcp_fd: Option<RawFd>) {
        let mut live = self.live.lock();
        live.target = Some(target);
        live.tcp_fd_plus_one = plus_one(tcp_fd);
    }

    /// The servers running the client's request that it reaches over TCP, with their sockets.
    pub fn target_sockets(&self) -> Vec<(ServerTarget, RawFd)> {
        let live = self.live.lock();
        let first = live.target.zip(
            live.tcp_fd_plus_one
                .and_then(|fd| RawFd::try_from(fd.get() - 1).ok()),
        );
        let also = live
            .also()
            .iter()
            .filter_map(|(target, fd)| Some((*target, (*fd)?)));
        first.into_iter().chain(also).collect()
    }

    /// Several servers run the client's statement, each with its TCP socket (`None` through
    /// a Unix-domain socket): a cancel reaches every one of them.
    pub fn set_targets(&self, mut targets: impl Iterator<Item = (ServerTarget, Option<RawFd>)>) {
        let mut live = self.live.lock();
        live.clear_targets();
        if let Some((target, fd)) = targets.next() {
            live.target = Some(target);
            live.tcp_fd_plus_one = plus_one(fd);
        }
        match &mut live.rare {
            Some(rare) => rare.also.extend(targets),
            None => {
                let also: Vec<(ServerTarget, Option<RawFd>)> = targets.collect();
                if !also.is_empty() {
                    live.rare = Some(Box::new(Rare {
                        also,
                        kill_reason: None,
                    }));
                }
            }
        }
    }

    pub fn target(&self) -> Option<ServerTarget> {
        self.live.lock().target
    }

    /// Whether one of the servers running the client's statement is on `node`.
    pub fn runs_on(&self, node: &crate::nodes::NodeState) -> bool {
        let live = self.live.lock();
        let runs = live.targets().any(|t| t.is_on(node));
        runs
    }

    /// Clears the target unless a cancel for it is still on its way (then returns false and
    /// [`Self::clear_target`] must be awaited).
    pub fn try_clear_target(&self) -> bool {
        let mut live = self.live.lock();
        if live.cancels_in_flight == 0 {
            live.clear_targets();
            true
        } else {
            false
        }
    }

    /// Clears the target once no cancel for it is still on its way. `acknowledged` is the
    /// registry's [`ClientRegistry::cancel_acknowledged`].
    pub async fn clear_target(&self, acknowledged: &Notify) {
        loop {
            let notified = acknowledged.notified();
            {
                let mut live = self.live.lock();
                if live.cancels_in_flight == 0 {
                    live.clear_targets();
                    return;
                }
            }
            notified.await;
        }
    }

    /// Takes a cancel raised while the session had its request but no server for it: true
    /// if there was one (the request is then answered as cancelled, unsent).
    pub fn take_cancel(&self) -> bool {
        // Asked before every request: a load, and a write only when one was raised.
        self.signals() & SIGNAL_CANCEL != 0
            && self.signals.fetch_and(!SIGNAL_CANCEL, Ordering::AcqRel) & SIGNAL_CANCEL != 0
    }

    /// Forgets a cancel raised while the session runs nothing and has no request in hand:
    /// PostgreSQL ignores a cancel for an idle backend, and a late one (its statement just
    /// ended) must not cancel the next.
    pub fn forget_cancel(&self) {
        // Every idle session passes here once per request: a load, and a write only when set.
        if self.signals() & SIGNAL_CANCEL != 0 {
            self.signals.fetch_and(!SIGNAL_CANCEL, Ordering::AcqRel);
        }
    }

    /// Ends the wait; a cancel that arrives from now on is for a running query (or ignored).
    pub fn end_wait(&self) {
        self.signals.fetch_and(!SIGNAL_CANCEL, Ordering::AcqRel);
    }

    /// Resolves when the current wait must end: the client cancelled its request, or (if
    /// `may_move`) pgherd is being upgraded and the session goes to the new process.
    pub async fn wait_interrupted(&self, may_move: bool) -> Interrupt {
        std::future::poll_fn(|cx| {
            self.register_waker(cx.waker());
            let signals = self.signals();
            if signals & SIGNAL_CANCEL != 0 {
                std::task::Poll::Ready(Interrupt::Cancelled)
            } else if may_move && signals & SIGNAL_HANDOVER != 0 {
                std::task::Poll::Ready(Interrupt::Handover)
            } else {
                std::task::Poll::Pending
            }
        })
        .await
    }

    /// Reads the idle sweep's marks off `signals` (as the session just loaded them) and
    /// clears them, since being polled means not idle: true if the session was asked to park.
    pub fn take_park_request(&self, signals: u8) -> bool {
        const MARKS: u8 = SIGNAL_PARK_CANDIDATE | SIGNAL_PARK;
        // Every poll passes here: a write only when the sweep marked the session.
        signals & MARKS != 0 && self.signals.fetch_and(!MARKS, Ordering::AcqRel) & SIGNAL_PARK != 0
    }

    pub fn set_parked(&self, parked: bool) {
        match parked {
            true => self.signals.fetch_or(SIGNAL_PARKED, Ordering::AcqRel),
            false => self.signals.fetch_and(!SIGNAL_PARKED, Ordering::AcqRel),
        };
    }

    /// Idle and parked (`client/parked.rs`): no task runs for it until it speaks.
    pub fn is_parked(&self) -> bool {
        self.signals() & SIGNAL_PARKED != 0
    }

    /// Whether the session can park (its kind, and no server it is pinned to): the sweep asks
    /// only those that can.
    pub fn set_may_park(&self, may: bool) {
        match may {
            true => self.signals.fetch_or(SIGNAL_MAY_PARK, Ordering::AcqRel),
            false => self.signals.fetch_and(
                !(SIGNAL_MAY_PARK | SIGNAL_PARK_CANDIDATE | SIGNAL_PARK),
                Ordering::AcqRel,
            ),
        };
    }

    pub fn kill(&self, reason: String) {
        let mut live = self.live.lock();
        live.rare.get_or_insert_with(Box::default).kill_reason = Some(reason.into_boxed_str());
        drop(live);
        self.raise(SIGNAL_KILL);
    }

    pub fn raise(&self, signal: u8) {
        self.signals.fetch_or(signal, Ordering::AcqRel);
        self.waker.wake();
    }

    pub fn signals(&self) -> u8 {
        self.signals.load(Ordering::Acquire)
    }

    /// The session's task, to wake when a signal is raised.
    pub fn register_waker(&self, waker: &std::task::Waker) {
        self.waker.register(waker);
    }

    pub fn kill_reason(&self) -> Option<String> {
        let live = self.live.lock();
        let reason = live.rare.as_ref()?.kill_reason.as_deref()?;
        Some(reason.to_owned())
    }
}

/// All connected clients, by their cancel key (process id and secret: a session-mode client
/// carries its server's process id, which another server may use too).
#[derive(Default)]
pub struct ClientRegistry {
    by_key: Mutex<HashMap<(i32, i32), Arc<ClientShared>>>,
    next_pid: AtomicI32,
    next_id: AtomicU64,
    /// Connections counted: logging in or logged in.
    count: AtomicUsize,
    /// Connections logged in (to a database or the console).
    logged_in: AtomicUsize,
    /// Connections still logging in, oldest first, each with what ends its login.
    pending: Mutex<std::collections::VecDeque<(u64, Arc<Notify>)>>,
    next_slot: AtomicU64,
    /// Recent failed logins and wrong cancel secrets, by address.
    pub failures: Mutex<crate::throttle::FailureLedger>,
    /// Notified whenever any cancel has been delivered; one for all clients, since cancels are
    /// rare and a client need not carry its own.
    pub cancel_acknowledged: Notify,
    /// Time for the failure ledger.
    clock: Clock,
    /// Signals raised on every client, which clients registered later start with.
    raised_for_all: AtomicU8,
    /// The user and database pairs clients logged in with, each kept once.
    names: Mutex<Names>,
}

/// A user and database a client logged in with.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Login {
    user: Box<str>,
    database: Box<str>,
}

/// Login pairs kept once for every client that uses them: a client's shared state holds one
/// pointer for both. A pair no client holds any more is dropped when the set has doubled
/// since it was last pruned, so that a stream of distinct names (generated users, a database
/// per tenant) does not grow it for the life of the process.
struct Names {
    kept: std::collections::HashSet<Arc<Login>>,
    prune_at: usize,
}

const NAMES_PRUNED_FROM: usize = 1024;

impl Default for Names {
    fn default() -> Self {
        Names {
            kept: Default::default(),
            prune_at: NAMES_PRUNED_FROM,
        }
    }
}

impl Names {
    fn intern(&mut self, user: &str, database: &str) -> Arc<Login> {
        let login = Login {
            user: user.into(),
            database: database.into(),
        };
        if let Some(kept) = self.kept.get(&login) {
            return kept.clone();
        }
        if self.kept.len() >= self.prune_at {
            self.kept.retain(|kept| Arc::strong_count(kept) > 1);
            self.prune_at = (self.kept.len() * 2).max(NAMES_PRUNED_FROM);
        }
        let kept = Arc::new(login);
        self.kept.insert(kept.clone());
        kept
    }
}

/// When the registry was made: the failure ledger's times count from it.
struct Clock(std::time::Instant);

impl Default for Clock {
    fn default() -> Self {
        Clock(std::time::Instant::now())
    }
}

impl Clock {
    fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

impl ClientRegistry {
    pub fn new() -> Self {
        ClientRegistry {
            // Start somewhere random so keys from a restarted pgherd do not repeat.
            next_pid: AtomicI32::new(rand::random::<i32>() & 0x3fff_ffff),
            ..Default::default()
        }
    }

    /// Counts a new connection, which starts logging in; `None` if `limit` connections are
    /// already counted and none of them is still logging in. Otherwise the connection that
    /// has been logging in longest makes room (it is told to end): sockets that never
    /// finish logging in cannot keep everyone else out.
    pub fn admit(self: &Arc<Self>, limit: usize) -> Option<ConnectionSlot> {
        let previous = self.count.fetch_add(1, Ordering::AcqRel);
        if previous >= limit {
            let oldest = self.pending.lock().pop_front();
            match oldest {
                Some((_, evict)) => evict.notify_one(),
                None => {
                    self.count.fetch_sub(1, Ordering::AcqRel);
                    return None;
                }
            }
        }
        let id = self.next_slot.fetch_add(1, Ordering::Relaxed);
        let evicted = Arc::new(Notify::new());
        self.pending.lock().push_back((id, evicted.clone()));
        Some(ConnectionSlot {
            registry: self.clone(),
            id,
            evicted: Some(evicted),
            logged_in: std::sync::atomic::AtomicBool::new(false),
        })
    }

    pub fn connected(&self) -> usize {
        self.count.load(Ordering::Acquire)
    }

    /// Connections logged in.
    pub fn logged_in(&self) -> usize {
        self.logged_in.load(Ordering::Acquire)
    }

    /// Answers a failure (a wrong password, a wrong cancel secret) from `address` late:
    /// later the more that address failed lately. Returns how many it made lately.
    pub async fn delay_failure(&self, address: std::net::IpAddr, base: Duration) -> u32 {
        let now_ms = self.clock.elapsed().as_millis() as u64;
        let base_ms = base.as_millis() as u64;
        let (delay, recent) = {
            let mut ledger = self.failures.lock();
            let answer = ledger.fail(address, now_ms, base_ms);
            ledger.waiting(address, true);
            answer
        };
        tokio::time::sleep(delay).await;
        self.failures.lock().waiting(address, false);
        recent
    }

    /// So many failures from `address` wait for their answer that it must wait too.
    pub fn failing_too_much(&self, address: std::net::IpAddr) -> bool {
        self.failures.lock().saturated(address)
    }

    /// Registers a logged-in client under a fresh cancel key: pgherd's own process id, or
    /// `process_id` (a session-mode client's server's), with a secret of pgherd's.
    pub fn register(
        &self,
        addr: SocketAddr,
        user: &str,
        database: &str,
        tls: bool,
        process_id: Option<i32>,
    ) -> Arc<ClientShared> {
        let mut map = self.by_key.lock();
        let key = loop {
            let process_id = process_id
                .unwrap_or_else(|| self.next_pid.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff);
            let key = CancelKey {
                process_id,
                secret_key: rand::random(),
            };
            if process_id != 0 && !map.contains_key(&(key.process_id, key.secret_key)) {
                break key;
            }
        };
        let shared = self.new_client(key, addr, user, database, tls);
        map.insert((key.process_id, key.secret_key), shared.clone());
        shared
    }

    /// `user` and `database`, shared with every client that logged in with them.
    fn login(&self, user: &str, database: &str) -> Arc<Login> {
        self.names.lock().intern(user, database)
    }

    fn new_client(
        &self,
        key: CancelKey,
        addr: SocketAddr,
        user: &str,
        database: &str,
        tls: bool,
    ) -> Arc<ClientShared> {
        Arc::new(ClientShared {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            key,
            addr,
            login: self.login(user, database),
            tls,
            connected_at_unix_s: SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            live: Mutex::new(Live::default()),
            signals: AtomicU8::new(self.raised_for_all.load(Ordering::Acquire)),
            waker: AtomicWaker::new(),
        })
    }

    /// Registers a client moved from an earlier pgherd process under the cancel key it was
    /// given there; `None` if a client here has that key already.
    pub fn register_moved(
        &self,
        addr: SocketAddr,
        user: &str,
        database: &str,
        key: CancelKey,
    ) -> Option<Arc<ClientShared>> {
        let mut map = self.by_key.lock();
        if map.contains_key(&(key.process_id, key.secret_key)) {
            return None;
        }
        let shared = self.new_client(key, addr, user, database, false);
        map.insert((key.process_id, key.secret_key), shared.clone());
        Some(shared)
    }

    pub fn unregister(&self, shared: &ClientShared) {
        self.by_key
            .lock()
            .remove(&(shared.key.process_id, shared.key.secret_key));
    }

    /// Raises `signal` on every registered client, and on every client registered from now
    /// on (one still logging in would miss it otherwise).
    pub fn signal_all(&self, signal: u8) {
        let map = self.by_key.lock();
        self.raised_for_all.fetch_or(signal, Ordering::AcqRel);
        for client in map.values() {
            client.raise(signal);
        }
    }

    /// Takes back a signal [`Self::signal_all`] raised (an upgrade undone).
    pub fn clear_for_all(&self, signal: u8) {
        let map = self.by_key.lock();
        self.raised_for_all.fetch_and(!signal, Ordering::AcqRel);
        for client in map.values() {
            client.signals.fetch_and(!signal, Ordering::AcqRel);
            client.waker.wake();
        }
    }

    /// One turn of the idle sweep (every `client_park_after_ms`): a client marked last turn
    /// and not polled since is asked to park; the others are marked. A client is so asked
    /// after one to two turns without a message or a signal, if its session said it may park.
    pub fn sweep_idle(&self) {
        let map = self.by_key.lock();
        for client in map.values() {
            let signals = client.signals();
            if signals & SIGNAL_MAY_PARK == 0 || signals & (SIGNAL_PARK | SIGNAL_PARKED) != 0 {
                continue;
            }
            if signals & SIGNAL_PARK_CANDIDATE != 0 {
                client.raise(SIGNAL_PARK);
            } else {
                client
                    .signals
                    .fetch_or(SIGNAL_PARK_CANDIDATE, Ordering::AcqRel);
            }
        }
    }

    pub fn all(&self) -> Vec<Arc<ClientShared>> {
        let mut all: Vec<_> = self.by_key.lock().values().cloned().collect();
        all.sort_by_key(|c| c.id);
        all
    }

    /// Forwards a cancel request to the server running the client's query, if any. The work
    /// happens in its own task, so it completes even if the requesting socket closes at once.
    /// False if the key matches no client: guessing keys is what that looks like, and the
    /// caller slows the address down.
    pub fn cancel(self: &Arc<Self>, key: CancelKey, timeout: Duration) -> bool {
        let Some(client) = self
            .by_key
            .lock()
            .get(&(key.process_id, key.secret_key))
            .cloned()
        else {
            return false;
        };
        let targets = {
            let mut live = client.live.lock();
            match live.target {
                Some(t) => {
                    let targets: Vec<ServerTarget> = std::iter::once(t)
                        .chain(live.also().iter().map(|(t, _)| *t))
                        .collect();
                    live.cancels_in_flight += targets.len() as u32;
                    targets
                }
                None => {
                    // For a request the session holds but has not sent to a server yet (it
                    // waits for one, or has not taken one yet): the session answers it as
                    // cancelled. If it has no request in hand, it forgets the cancel at its
                    // idle point, as PostgreSQL ignores a cancel for an idle session.
                    client.raise(SIGNAL_CANCEL);
                    tracing::debug!(
                        client = client.id,
                        "cancel request for a client that runs nothing on a server"
                    );
                    return true;
                }
            }
        };
        for target in targets {
            let (registry, client) = (self.clone(), client.clone());
            tokio::spawn(async move {
                match send_cancel(&target.peer, target.key, timeout).await {
                    Ok(()) => tracing::info!(
                        client = client.id,
                        server = target.server_id,
                        "cancel request forwarded"
                    ),
                    Err(e) => {
                        tracing::warn!(client = client.id, server = target.server_id, error = %e, "cancel request could not be forwarded")
                    }
                }
                client.live.lock().cancels_in_flight -= 1;
                registry.cancel_acknowledged.notify_waiters();
            });
        }
        true
    }
}

/// Holds one place in the connection count; gives it back when dropped.
pub struct ConnectionSlot {
    registry: Arc<ClientRegistry>,
    id: u64,
    /// Until the login is over (`leave_pending`).
    evicted: Option<Arc<Notify>>,
    logged_in: std::sync::atomic::AtomicBool,
}

impl ConnectionSlot {
    /// Resolves when a newer connection needs this one's place while it still logs in.
    pub async fn evicted(&self) {
        match &self.evicted {
            Some(evicted) => evicted.notified().await,
            None => std::future::pending().await,
        }
    }

    /// The login is over, whatever its outcome: the connection can no longer be made to
    /// make room (and no longer keeps what would tell it to).
    pub fn leave_pending(&mut self) {
        if self.evicted.take().is_some() {
            self.registry
                .pending
                .lock()
                .retain(|(id, _)| *id != self.id);
        }
    }

    /// The connection logged in: it counts as logged in; `None` (the login is refused) if
    /// `limit` connections are logged in already.
    pub fn log_in(&self, limit: usize) -> Option<()> {
        let previous = self.registry.logged_in.fetch_add(1, Ordering::AcqRel);
        if previous >= limit {
            self.registry.logged_in.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        self.logged_in.store(true, Ordering::Release);
        Some(())
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        if self.logged_in.load(Ordering::Acquire) {
            self.registry.logged_in.fetch_sub(1, Ordering::AcqRel);
        }
        self.leave_pending();
        self.registry.count.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_no_client_holds_are_pruned_and_held_ones_stay_shared() {
        let mut names = Names::default();
        let held = names.intern("app", "app");
        assert!(Arc::ptr_eq(&held, &names.intern("app", "app")));
        assert!(!Arc::ptr_eq(&held, &names.intern("app", "other")));
        for i in 0..10 * NAMES_PRUNED_FROM {
            drop(names.intern("app", &format!("tenant_{i}")));
        }
        assert!(
            names.kept.len() <= NAMES_PRUNED_FROM,
            "{} names kept",
            names.kept.len()
        );
        assert!(Arc::ptr_eq(&held, &names.intern("app", "app")));
    }

    /// A client whose session may park.
    fn client(registry: &ClientRegistry) -> Arc<ClientShared> {
        let addr = SocketAddr::from(([127, 0, 0, 1], 5000));
        let client = registry.register(addr, "app", "app", false, None);
        client.set_may_park(true);
        client
    }

    fn asked(client: &ClientShared) -> bool {
        client.take_park_request(client.signals())
    }

    #[test]
    fn the_sweep_asks_a_client_to_park_after_a_whole_turn_without_a_poll() {
        let registry = ClientRegistry::new();
        let idle = client(&registry);
        let busy = client(&registry);
        registry.sweep_idle();
        assert!(!asked(&busy), "marked, not asked yet");
        registry.sweep_idle();
        assert!(asked(&idle), "idle for a whole turn");
        assert!(
            !asked(&busy),
            "polled during the turn: marked again, not asked"
        );
        assert!(!asked(&idle), "the request is read once");
        registry.sweep_idle();
        registry.sweep_idle();
        assert!(asked(&busy), "idle since its last poll");
    }

    #[test]
    fn parked_clients_and_those_that_never_park_are_left_alone() {
        let registry = ClientRegistry::new();
        let parked = client(&registry);
        let never = registry.register(
            SocketAddr::from(([127, 0, 0, 1], 5001)),
            "app",
            "app",
            true,
            None,
        );
        parked.set_parked(true);
        for _ in 0..3 {
            registry.sweep_idle();
        }
        assert_eq!(parked.signals(), SIGNAL_MAY_PARK | SIGNAL_PARKED);
        assert!(parked.is_parked());
        assert_eq!(never.signals(), 0, "a session that never said it may park");
        parked.set_parked(false);
        assert!(!parked.is_parked());
        registry.sweep_idle();
        registry.sweep_idle();
        assert!(asked(&parked), "unparked, it is swept again");
    }

    #[test]
    fn a_client_pinned_to_its_server_is_no_longer_swept() {
        let registry = ClientRegistry::new();
        let pinned = client(&registry);
        registry.sweep_idle();
        pinned.set_may_park(false);
        assert_eq!(pinned.signals(), 0, "its mark goes with the permission");
        for _ in 0..3 {
            registry.sweep_idle();
        }
        assert!(!asked(&pinned));
    }

    #[test]
    fn a_clients_shared_state_stays_in_its_allocation_class() {
        // With the Arc's two counts: mimalloc's 192-byte class, apart from the 256-byte one the
        // runtime's socket registrations (freed when a client parks) use.
        let allocated = std::mem::size_of::<ClientShared>() + 16;
        assert!(allocated <= 192, "{allocated} bytes");
    }

    #[test]
    fn a_cancel_reaches_every_server_running_the_statement() {
        let registry = ClientRegistry::new();
        let c = client(&registry);
        let target = |server_id| ServerTarget {
            server_id,
            peer: crate::server::ServerAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 5432))),
            key: CancelKey {
                process_id: 1,
                secret_key: 2,
            },
            node: 7,
        };
        c.set_targets(
            [(1, Some(11)), (2, None), (3, Some(13))]
                .map(|(id, fd)| (target(id), fd))
                .into_iter(),
        );
        let live = c.live.lock();
        let ids: Vec<u64> = live.targets().map(|t| t.server_id).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        drop(live);
        let sockets: Vec<(u64, RawFd)> = c
            .target_sockets()
            .iter()
            .map(|(t, fd)| (t.server_id, *fd))
            .collect();
        assert_eq!(sockets, vec![(1, 11), (3, 13)], "only those over TCP");
        c.set_targets([4].into_iter().map(|id| (target(id), None)));
        assert!(c.target_sockets().is_empty());
        assert!(c.live.lock().also().is_empty());
        assert!(c.try_clear_target());
        assert!(c.target().is_none());
    }
}
