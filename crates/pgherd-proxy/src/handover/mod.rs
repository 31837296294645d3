//! Upgrading pgherd's binary without dropping a client (`pgherd upgrade`, `UPGRADE` on the
//! console, SIGUSR2).
//!
//! The running process (the giver, `give.rs`) starts the binary it was started from (the file
//! now there, so the new version) with its own arguments and `--takeover-fd`, an end of a
//! Unix socket pair (`channel.rs`). Over it the new process (the taker, `take.rs`) receives the
//! listening sockets, the cluster view and the server credentials learnt from clients' logins,
//! starts, checks the nodes, and says it is ready. Only then does the giver stop accepting and
//! tell every session to move at its next idle point: between transactions, holding no
//! server, a plain TCP client in transaction or statement mode is sent over with its session
//! (`ClientRecord`: settings, prepared statements, cancel key, read-your-writes position) and
//! carries on in the new process without a byte lost or repeated. A session that keeps its
//! server connection (session mode, or pinned to it by a temporary table, a session lock,
//! LISTEN...) takes it along at its next idle point: the server socket moves too, with the
//! backend's key and pgherd's statements on it, so the backend and everything in it carry on
//! untouched. A session that cannot move (TLS, whose keys live in the giver's TLS library, on
//! either side) is told why at its next idle point and reconnects. The giver exits once it
//! holds no client.
//!
//! Failover duty moves with the view: the giver stops acting (taking every cluster's role-change
//! lock, so no turn is half done; operator commands are refused from then on) before it sends
//! the view, and the taker adopts it, checks the nodes, says it is ready, and starts deciding
//! and accepting only once the giver, having stopped accepting, says go: no failover starts
//! twice or in neither, and the few seconds in between delay one, never lose it. A taker that
//! does not say it is ready in time is killed, and the giver acts and serves on as before; one
//! that dies after it (its end of the line closes) is undone the same way: the giver accepts,
//! decides and keeps its clients again. Cancel requests the taker receives for clients the
//! giver still holds (their keys came with the state) are passed back to it.
//!
//! One of several instances (`[dcs]`) gives its etcd lease too: the taker's sessions with etcd
//! keep it, so the leader key and the instance's record stay where they are, and a leader stays
//! the leader across the upgrade with no election and no failsafe to wait out. From the moment
//! the giver stops acting it only follows the shared view (it publishes nothing, and the taker
//! publishes only after go), so exactly one process writes the view at any time.
//!
//! A sharded endpoint moves the same way: every shard's view goes along, and a sharded
//! session moves between statements outside a transaction block, when it holds no link to a
//! shard, with its settings, prepared statements and per-shard read-your-writes positions.
//! Transactions left prepared on the shards are finished by whichever process's recovery
//! finds them first (the decision rows decide, see `two_phase_recovery`).

mod channel;
mod give;
mod take;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use arc_swap::ArcSwapOption;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::dcs::shared::SharedView;
use channel::Channel;

pub use give::{record_launch, send_client, upgrade};
pub use take::{forward_cancel, take_over, Takeover};

/// The argument that makes a new process a taker.
pub const TAKEOVER_FD_ARG: &str = "--takeover-fd";

/// How long the taker may take to start and say it is ready.
const READY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// A process's part in upgrades, in `App`.
pub struct HandoverState {
    /// An upgrade was started (one at a time).
    upgrading: AtomicBool,
    /// This process gave its duties to a new one: it decides nothing for the cluster.
    handed_over: AtomicBool,
    /// This process accepts no more connections (the new one does).
    stop_accepting: watch::Sender<bool>,
    /// The line to the process this one gives its clients to.
    to_new: ArcSwapOption<Channel>,
    /// The line from the process this one took over from, while it lives; and the cancel keys
    /// of the clients it held when it gave its state (their cancels go to it).
    from_old: ArcSwapOption<Channel>,
    old_keys: Mutex<HashSet<(i32, i32)>>,
    /// Duplicates of this process's listening sockets, to give away.
    listeners: Mutex<Listeners>,
}

#[derive(Default)]
struct Listeners {
    clients: Vec<(SocketAddr, OwnedFd)>,
    api: Vec<(SocketAddr, OwnedFd)>,
}

impl Default for HandoverState {
    fn default() -> Self {
        HandoverState {
            upgrading: AtomicBool::new(false),
            handed_over: AtomicBool::new(false),
            stop_accepting: watch::channel(false).0,
            to_new: ArcSwapOption::empty(),
            from_old: ArcSwapOption::empty(),
            old_keys: Mutex::new(HashSet::new()),
            listeners: Mutex::new(Listeners::default()),
        }
    }
}

impl HandoverState {
    /// This process gave its duties to a new one (or is giving them).
    pub fn handed_over(&self) -> bool {
        self.handed_over.load(Ordering::Acquire)
    }

    /// A new process serves in this one's place (an upgrade went through).
    pub fn given(&self) -> bool {
        *self.stop_accepting.borrow()
    }

    /// Becomes true once this process must accept no more connections.
    pub fn stop_accepting(&self) -> watch::Receiver<bool> {
        self.stop_accepting.subscribe()
    }

    /// Duplicates of the kept listening sockets (clients', the API's), for a process that took
    /// its duties back to accept on again.
    pub fn listener_copies(&self) -> std::io::Result<(Vec<OwnedFd>, Vec<OwnedFd>)> {
        let listeners = self.listeners.lock();
        let copy = |kept: &[(SocketAddr, OwnedFd)]| {
            kept.iter()
                .map(|(_, fd)| fd.try_clone())
                .collect::<std::io::Result<Vec<_>>>()
        };
        Ok((copy(&listeners.clients)?, copy(&listeners.api)?))
    }

    /// Closes the kept duplicates: once pgherd stops, its ports must stop taking connections.
    pub fn release_listeners(&self) {
        *self.listeners.lock() = Listeners::default();
    }

    /// Keeps duplicates of the listening sockets, for an upgrade to give away.
    pub fn keep_listeners(
        &self,
        clients: &[tokio::net::TcpListener],
        api: &[tokio::net::TcpListener],
    ) -> std::io::Result<()> {
        let kept = |listeners: &[tokio::net::TcpListener]| {
            listeners
                .iter()
                .map(|l| Ok((l.local_addr()?, l.as_fd().try_clone_to_owned()?)))
                .collect::<std::io::Result<Vec<_>>>()
        };
        *self.listeners.lock() = Listeners {
            clients: kept(clients)?,
            api: kept(api)?,
        };
        Ok(())
    }
}

/// What goes over the line.
#[derive(Debug, Serialize, Deserialize)]
enum Message {
    /// Giver → taker, first: what it takes over. The listeners' descriptors come attached,
    /// the clients' first, then the HTTP API's.
    State(Box<InitialState>),
    /// Taker → giver: it has started and checked the nodes.
    Ready { pid: u32 },
    /// Giver → taker: this process accepts nobody and decides nothing any more; take over.
    Go,
    /// Taker → giver: it cannot start.
    Failed { reason: String },
    /// Giver → taker: a client, its connection attached.
    Client(Box<ClientRecord>),
    /// Taker → giver: a cancel request for a client the taker does not have.
    Cancel { process_id: i32, secret_key: i32 },
}

#[derive(Debug, Serialize, Deserialize)]
struct InitialState {
    version: String,
    pid: u32,
    listen: Vec<SocketAddr>,
    api: Vec<SocketAddr>,
    view: SharedView,
    credentials: Vec<CredentialRecord>,
    /// The cancel keys of the clients the giver holds.
    cancel_keys: Vec<(i32, i32)>,
    /// One of several instances: the lease of the giver's session with etcd, which the
    /// taker's keep.
    #[serde(default)]
    dcs_lease: Option<i64>,
    /// A sharded endpoint: the views of shards 1.. (shard 0's is `view`).
    #[serde(default)]
    shard_views: Vec<SharedView>,
}

/// What pgherd learnt of a user's server login from clients' logins (passthrough SCRAM keys,
/// an md5 hash from an auth query), which the taker could not learn again without them.
#[derive(Debug, Serialize, Deserialize)]
struct CredentialRecord {
    user: String,
    scram: Option<ScramKeysRecord>,
    md5_hash: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
struct ScramKeysRecord {
    client_key: Vec<u8>,
    server_key: Vec<u8>,
    salt: Vec<u8>,
    iterations: u32,
}

/// An idle session, as the taker needs it to carry on.
#[derive(Debug, Serialize, Deserialize)]
pub struct ClientRecord {
    pub addr: SocketAddr,
    pub user: String,
    pub database: String,
    /// The cancel key the client was given at login.
    pub process_id: i32,
    pub secret_key: i32,
    /// Bytes the client sent that the giver read but did not handle yet.
    pub unread: Vec<u8>,
    pub settings: SettingsRecord,
    /// Custom settings it set with `set_config`, which a probe asks for.
    pub custom_settings: Vec<String>,
    /// Its protocol-level prepared statements: name, text, parameter types as sent.
    pub statements: Vec<StatementRecord>,
    /// Its unnamed statement, if any.
    pub unnamed: Option<StatementRecord>,
    /// `SET pgherd.route` (`primary`, `replica`, `auto`).
    pub route_override: Option<String>,
    pub default_read_only: bool,
    pub standard_conforming_strings: bool,
    /// The WAL position its last committed write reached (read-your-writes).
    pub min_lsn: u64,
    /// A write whose end is not known yet: reads stay on the primary until it is.
    pub write_unconfirmed: bool,
    /// It logged in to a session-mode pool: it moves only to a process that serves its
    /// database and user in session mode too (and a transaction-mode one only to one that
    /// does not).
    #[serde(default)]
    pub session_mode: bool,
    /// The server connection it keeps (session mode, or pinned), its socket attached after
    /// the client's.
    #[serde(default)]
    pub server: Option<ServerRecord>,
    /// A sharded endpoint's session (its prepared statements, the unnamed one's name empty,
    /// are all in `statements`): it moves only to a process that is one too.
    #[serde(default)]
    pub sharded: bool,
    /// A sharded endpoint's session: per shard, the WAL position its last committed write
    /// there reached and whether a write's end there is not known yet (read-your-writes).
    #[serde(default)]
    pub shard_positions: Vec<(u64, bool)>,
}

/// A server connection moving with its session: the backend, as it is, now the new process's.
#[derive(Debug, Serialize, Deserialize)]
pub struct ServerRecord {
    /// The node it is connected to, by name.
    pub node: String,
    /// The backend's cancel key.
    pub process_id: i32,
    pub secret_key: i32,
    /// What the server reported at its login.
    pub reported: Vec<(String, String)>,
    /// Why a transaction-mode session keeps it; none in session mode.
    pub pin: Option<pgherd_route::Pin>,
    /// pgherd's own prepared statements on it (`pgherd_` and the hash): the hash, and whether
    /// it is still usable (one prepared before a schema change is closed before it is used).
    pub statements: Vec<([u8; 16], bool)>,
}

/// A session's settings: from its startup packet (what `RESET` goes back to) and since.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SettingsRecord {
    pub standard_conforming_strings: bool,
    pub default_transaction_read_only: bool,
    pub startup: Vec<(String, String)>,
    pub entries: Vec<(String, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct StatementRecord {
    pub name: Vec<u8>,
    pub query: Vec<u8>,
    pub param_types: Vec<u8>,
}

fn encode(message: &Message) -> Result<Vec<u8>, String> {
    serde_json::to_vec(message).map_err(|e| format!("cannot encode a handover message: {e}"))
}

fn decode(json: &[u8]) -> Result<Message, String> {
    serde_json::from_slice(json).map_err(|e| format!("a handover message pgherd cannot read: {e}"))
}
