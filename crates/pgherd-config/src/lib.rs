//! `pgherd.toml`: what every setting means, its default, and validation whose errors name the
//! file, line, column and field (`pgherd.toml:14:11: hba[2].address: ...`).
//!
//! Architecture invariant: this crate reads the config file (and, for `pgherd up`, the bench and
//! the tests, writes one owner-only) and nothing else: no sockets, no processes, no clocks. Certificates and keys named by the config are read by the proxy.

mod cache;
mod dcs;
mod error;
pub mod hba;
mod raw;
mod secrets;
mod sets;
mod sharding;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use cache::CacheSettings;
pub use dcs::{DcsSettings, DcsTls};
pub use error::{line_column, ConfigError};
pub use hba::{AuthMethod, ConnectionFacts, HbaRule};
use pgherd_wire::scram::ScramVerifier;
pub use sets::SetsSettings;
pub use sharding::Sharding;

/// The database entry that applies to every database not listed by name.
pub const WILDCARD_DATABASE: &str = "*";

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it was read from (for messages and reloads).
    pub source: PathBuf,
    /// Where the file holds its first secret (a password, an md5 hash, the API token), if it
    /// holds any: such a file must not be readable by other users.
    pub secret: Option<ConfigError>,
    pub proxy: ProxySettings,
    pub client_tls: Option<ClientTls>,
    pub server_tls: ServerTls,
    pub cluster: ClusterSettings,
    /// The nodes of the cluster (with `[sharding]`, of shard 0: the one failover, the
    /// instances' agreement and the console's node commands act on).
    pub nodes: Vec<NodeConfig>,
    pub pool: PoolSettings,
    pub databases: BTreeMap<String, DatabaseConfig>,
    pub users: BTreeMap<String, UserConfig>,
    pub auth_query: Option<AuthQuery>,
    /// Ordered; the first match decides. Never empty: a file without rules gets one rule
    /// that asks everybody for SCRAM.
    pub hba: Vec<HbaRule>,
    pub routing: RoutingSettings,
    pub failover: FailoverSettings,
    pub replication: ReplicationSettings,
    pub api: ApiSettings,
    /// `[dcs]`: several instances agreeing through etcd; `None`: one instance.
    pub dcs: Option<DcsSettings>,
    /// `[sharding]`: tables spread over several clusters; `None`: one cluster.
    pub sharding: Option<Sharding>,
    /// `[cache]`: the result cache.
    pub cache: CacheSettings,
    /// `[sets]`: the replication sets the running pgherd follows.
    pub sets: SetsSettings,
}

/// The HTTP API, health endpoints, metrics and dashboard (`[api]`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ApiSettings {
    /// Empty: no HTTP listener.
    pub listen: Vec<SocketAddr>,
    /// Bearer token the changing endpoints need; without one they are refused.
    pub token: Option<String>,
}

/// Automatic failover (`[failover]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailoverSettings {
    /// Off by default for clusters pgherd did not make (promoting is the operator's call to
    /// delegate); `pgherd up` turns it on.
    pub enabled: bool,
    /// A replica further behind the primary's last known position is never promoted.
    pub max_lag_on_failover_bytes: u64,
    /// Run through `sh -c` for every failover event, with the event in `PGHERD_*` variables.
    pub notify_command: Option<String>,
    /// How long a switchover lets transactions on the old primary finish before ending them.
    pub switchover_drain_ms: u64,
    /// A fenced node pgherd manages locally is rewound and rejoined as a standby as soon as it
    /// answers again.
    pub auto_rejoin: bool,
    /// Run through `sh -c` when a node is fenced (STONITH: power it off, cut its network),
    /// with the node in `PGHERD_*` variables.
    pub fence_command: Option<String>,
}

/// How commits are made durable (`[replication]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicationSettings {
    pub durability: Durability,
    /// `k` in `ANY k (...)`: standbys that confirm each commit (fewer while fewer stream).
    pub sync_standbys: u32,
    /// What a synchronous standby confirms before the commit is acknowledged.
    pub synchronous_commit: SynchronousCommit,
    /// The role standbys stream as (`primary_conninfo`), when not `[cluster] user`: a role
    /// with REPLICATION and nothing else.
    pub user: Option<String>,
    pub password: Option<String>,
}

impl ReplicationSettings {
    /// Who standbys log in as to stream: the replication role, else pgherd's own user.
    pub fn standby_login<'a>(&'a self, cluster: &'a ClusterSettings) -> (&'a str, Option<&'a str>) {
        match &self.user {
            Some(user) => (user, self.password.as_deref()),
            None => (&cluster.user, cluster.password.as_deref()),
        }
    }
}

/// The failover decisions' own notion, so config and decisions cannot drift apart.
pub use pgherd_failover::Durability;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynchronousCommit {
    /// The standby has flushed the commit to disk.
    On,
    /// The standby has written it (not flushed).
    RemoteWrite,
    /// The standby has replayed it: reads there see it before the client hears back.
    RemoteApply,
}

impl SynchronousCommit {
    pub fn parse(s: &str) -> Option<SynchronousCommit> {
        Some(match s {
            "on" => SynchronousCommit::On,
            "remote_write" => SynchronousCommit::RemoteWrite,
            "remote_apply" => SynchronousCommit::RemoteApply,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SynchronousCommit::On => "on",
            SynchronousCommit::RemoteWrite => "remote_write",
            SynchronousCommit::RemoteApply => "remote_apply",
        }
    }
}

/// Cluster-wide rules for sending reads to replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingSettings {
    /// A replica further behind the primary than this gets no reads (0 disables the check).
    pub max_lag_bytes: u64,
    /// A replica that has not replayed WAL the primary wrote this long ago gets no reads
    /// (0 disables the check).
    pub max_lag_ms: u64,
    /// How long a read after a write may wait for a replica to replay that write before the
    /// primary serves it instead.
    pub read_your_writes_wait_ms: u64,
    /// A replica taken out of the read set comes back after this many healthy checks in a row.
    pub rejoin_after_checks: u32,
    /// Routing decisions kept per database, keyed by statement shape.
    pub decision_cache_entries: usize,
    /// Statements longer than this are not parsed: they run on the primary, and pgherd
    /// checks the session's state after them (parsing costs up to a kilobyte of memory and
    /// a microsecond of CPU per byte of text, on the thread that serves other clients too).
    pub max_parse_bytes: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Human,
    Json,
}

#[derive(Debug, Clone)]
pub struct ProxySettings {
    pub listen: Vec<SocketAddr>,
    /// Threads serving connections; 0 means a quarter of the CPUs, at least one.
    pub workers: usize,
    /// Logged-in clients, the admin console's users excepted.
    pub max_client_connections: usize,
    /// Places beyond `max_client_connections` only the admin console's users may take.
    pub admin_reserved_connections: usize,
    /// A failed login (or a cancel request with a wrong key) is answered after this long,
    /// doubled for each recent failure from the same address (up to 16 times); 0 disables.
    pub auth_failure_delay_ms: u64,
    /// Largest message accepted from a client, header included.
    pub max_message_bytes: usize,
    pub client_login_timeout_ms: u64,
    /// 0 disables.
    pub client_idle_timeout_ms: u64,
    /// A client idle between transactions about this long is parked: its session kept in a
    /// compact form, without a task or buffers, until it speaks again. 0 disables.
    pub client_park_after_ms: u64,
    pub shutdown_timeout_ms: u64,
    pub admin_users: Vec<String>,
    pub stats_users: Vec<String>,
    pub log_format: LogFormat,
    pub log_level: String,
    /// Where the operator's levers (DETACH, PAUSE) are kept across restarts; relative to the
    /// config file's directory.
    pub state_file: PathBuf,
    /// The zone this pgherd runs in: reads prefer replicas of the same zone.
    pub zone: Option<String>,
}

/// The state file's name when `state_file` is not set: next to the config file.
pub const DEFAULT_STATE_FILE: &str = "pgherd.state.json";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientTlsMode {
    /// TLS offered; plain connections accepted too.
    Allow,
    /// Plain connections refused.
    Require,
}

#[derive(Debug, Clone)]
pub struct ClientTls {
    pub mode: ClientTlsMode,
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Certificates of clients using `cert` auth must chain to this CA.
    pub client_ca_file: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ServerTlsMode {
    Disable,
    /// TLS if the server offers it, without checking its certificate.
    Prefer,
    /// TLS or fail, without checking the certificate.
    Require,
    /// TLS with the certificate checked against `ca_file`, not the host name.
    VerifyCa,
    /// TLS with the certificate and host name checked.
    VerifyFull,
}

#[derive(Debug, Clone)]
pub struct ServerTls {
    pub mode: ServerTlsMode,
    pub ca_file: Option<PathBuf>,
}

/// How pgherd itself logs in to nodes to watch them.
#[derive(Debug, Clone)]
pub struct ClusterSettings {
    pub user: String,
    pub password: Option<String>,
    pub database: String,
    pub health_check_period_ms: u64,
    pub health_check_timeout_ms: u64,
    /// Failed checks in a row before a node counts as down.
    pub health_check_failures_before_down: u32,
    /// How long a request that needs the primary waits while none accepts writes.
    pub primary_wait_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeConfig {
    pub name: String,
    pub host: String,
    pub port: u16,
    /// The directory of the node's Unix-domain socket (`unix_socket_directories`): pgherd's
    /// own connections to the node go through `.s.PGSQL.<port>` there instead of TCP; other
    /// nodes still replicate from `host` and `port`.
    pub socket_dir: Option<PathBuf>,
    /// Set when pgherd manages the node's processes on this machine (`pgherd up`).
    pub data_dir: Option<PathBuf>,
    /// The network namespace a managed node's processes run in (pgherd starts, stops and
    /// rewinds it there).
    pub netns: Option<String>,
    /// Share of reads under the `weighted` policy; 0 keeps reads off the node.
    pub weight: u32,
    /// Failover preference among equally advanced replicas; 0 = never promoted.
    pub priority: u32,
    /// Where the node runs (a data centre, an availability zone); `None`: no zone.
    pub zone: Option<String>,
    /// May be one of the primary's synchronous standbys (`ANY k`). An asynchronous standby
    /// (false) never holds commits acknowledged to clients, so in `sync`/`strict` durability
    /// it is never promoted either.
    pub sync: bool,
}

/// The kernel's limit on a Unix-domain socket's path (`sun_path`, less its final NUL).
pub const MAX_SOCKET_PATH_BYTES: usize = 107;

/// Whether PostgreSQL's socket for any port fits in `dir` (`.s.PGSQL.65535` the longest name).
pub fn socket_dir_fits(dir: &Path) -> bool {
    dir.join(".s.PGSQL.65535").as_os_str().len() <= MAX_SOCKET_PATH_BYTES
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolMode {
    /// A client keeps its server connection until it disconnects.
    Session,
    /// A client holds a server connection for one transaction.
    Transaction,
    /// A client holds a server connection for one statement; transactions are refused.
    Statement,
}

impl PoolMode {
    pub fn parse(s: &str) -> Option<PoolMode> {
        Some(match s {
            "session" => PoolMode::Session,
            "transaction" => PoolMode::Transaction,
            "statement" => PoolMode::Statement,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
            PoolMode::Statement => "statement",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSettings {
    pub mode: PoolMode,
    pub max_size: u32,
    pub min_size: u32,
    /// How long a client waits for a server connection before it gets an error.
    pub wait_timeout_ms: u64,
    /// Idle server connections older than this are closed (0 disables).
    pub server_idle_timeout_ms: u64,
    /// Server connections are closed once released after living this long (0 disables).
    pub server_lifetime_ms: u64,
    pub server_connect_timeout_ms: u64,
    /// Run when a session-mode client leaves; empty disables.
    pub server_reset_query: String,
    /// Named prepared statements each server connection keeps in transaction mode.
    pub prepared_statements_per_server: usize,
}

impl PoolSettings {
    pub fn wait_timeout(&self) -> Duration {
        Duration::from_millis(self.wait_timeout_ms)
    }
}

/// Where a session's statements go unless a hint says otherwise (the routing crate owns it).
pub use pgherd_route::Route;

/// How fresh reads must be and how they are spread (the routing crate owns them too).
pub use pgherd_route::{Balance, Consistency};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseConfig {
    /// The name on the servers; `None` for the wildcard entry (the client's name is used).
    pub dbname: Option<String>,
    pub mode: Option<PoolMode>,
    pub max_size: Option<u32>,
    pub min_size: Option<u32>,
    pub route: Route,
    pub consistency: Consistency,
    pub balance: Balance,
    /// The primary also serves reads (with its weight under `weighted`).
    pub primary_reads: bool,
}

#[derive(Clone, PartialEq, Eq)]
pub struct UserConfig {
    pub scram: Option<ScramVerifier>,
    /// `md5` + hex, as PostgreSQL stores it.
    pub md5: Option<String>,
    /// Used to log in to servers instead of passing the client's credentials through.
    pub server_password: Option<String>,
    pub mode: Option<PoolMode>,
    /// Overrides the database's route for this user.
    pub route: Option<Route>,
    /// Overrides the database's consistency for this user.
    pub consistency: Option<Consistency>,
}

impl std::fmt::Debug for UserConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UserConfig")
            .field("scram", &self.scram.is_some())
            .field("md5", &self.md5.is_some())
            .field("server_password", &self.server_password.is_some())
            .field("mode", &self.mode)
            .field("route", &self.route)
            .field("consistency", &self.consistency)
            .finish()
    }
}

/// Look up users missing from `[users]` in PostgreSQL.
#[derive(Debug, Clone)]
pub struct AuthQuery {
    /// Takes the user name as `$1`; returns the name and its SCRAM verifier or md5 hash.
    pub query: String,
    pub user: String,
    pub password: Option<String>,
    pub database: String,
}

/// What a (database, user) pair resolves to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedDatabase {
    pub server_dbname: String,
    pub route: Route,
    pub consistency: Consistency,
    pub balance: Balance,
    pub primary_reads: bool,
    pub pool: PoolSettings,
}

impl Config {
    /// Reads and validates `path`. A file holding secrets that every local user can read is
    /// refused, as PostgreSQL refuses such a key file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let source = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::unplaced(path, "", format!("cannot read: {e}")))?;
        let config = Config::parse(&source, path)?;
        if let Some(secret) = &config.secret {
            let mode = file_mode(path)
                .map_err(|e| ConfigError::unplaced(path, "", format!("cannot stat: {e}")))?;
            if mode & 0o004 != 0 {
                return Err(ConfigError {
                    message: format!(
                        "holds a secret, but the file is readable by every user (mode {:04o}); \
                         run `chmod 600 {}` (or 640 for a group you trust)",
                        mode & 0o7777,
                        path.display()
                    ),
                    ..secret.clone()
                });
            }
        }
        Ok(config)
    }

    /// A warning when the file's secrets are readable by its group (allowed: the group may
    /// be a trusted operators' group), for the log.
    pub fn group_readable_secret(&self) -> Option<String> {
        let secret = self.secret.as_ref()?;
        let mode = file_mode(&self.source).ok()?;
        (mode & 0o040 != 0).then(|| {
            format!(
                "{secret} readable by the file's group (mode {:04o}); make sure only operators are in it",
                mode & 0o7777
            )
        })
    }

    /// Validates `source`, naming `path` in errors.
    pub fn parse(source: &str, path: &Path) -> Result<Config, ConfigError> {
        validate::validate(source, path)
    }

    /// The pool settings and server database for a client's (database, user), or `None` if the
    /// database is not served.
    pub fn resolve(&self, database: &str, user: &str) -> Option<ResolvedDatabase> {
        let entry = self
            .databases
            .get(database)
            .or_else(|| self.databases.get(WILDCARD_DATABASE))?;
        let mut pool = self.pool.clone();
        if let Some(mode) = entry.mode {
            pool.mode = mode;
        }
        if let Some(max) = entry.max_size {
            pool.max_size = max;
        }
        if let Some(min) = entry.min_size {
            pool.min_size = min;
        }
        let user = self.users.get(user);
        if let Some(mode) = user.and_then(|u| u.mode) {
            pool.mode = mode;
        }
        Some(ResolvedDatabase {
            server_dbname: entry.dbname.clone().unwrap_or_else(|| database.to_owned()),
            route: user.and_then(|u| u.route).unwrap_or(entry.route),
            consistency: user
                .and_then(|u| u.consistency)
                .unwrap_or(entry.consistency),
            balance: entry.balance,
            primary_reads: entry.primary_reads,
            pool,
        })
    }

    pub fn node(&self, name: &str) -> Option<&NodeConfig> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// The names of the nodes `[[nodes]]` lists, for a message naming the choices.
    pub fn node_names(&self) -> String {
        self.nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The shard a node of the config belongs to (0 without `[sharding]`).
    pub fn shard_of(&self, name: &str) -> Option<u32> {
        match &self.sharding {
            Some(sharding) => (0u32..)
                .zip(&sharding.shard_nodes)
                .find_map(|(shard, nodes)| nodes.iter().any(|n| n.name == name).then_some(shard)),
            None => self.node(name).map(|_| 0),
        }
    }

    /// A node of any shard (of the one cluster without `[sharding]`).
    pub fn node_of_any_shard(&self, name: &str) -> Option<&NodeConfig> {
        let shards = self
            .sharding
            .iter()
            .flat_map(|s| s.shard_nodes.iter().skip(1));
        self.node(name)
            .or_else(|| shards.flatten().find(|n| n.name == name))
    }
}

/// Writes a file only its owner can read or write (mode 0600 from the start, never briefly
/// readable by others): configs holding secrets, password files.
pub fn write_private_file(path: &Path, contents: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    // An existing file keeps its old mode through open(): narrow it too.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(contents.as_bytes())
}

pub(crate) fn file_mode(path: &Path) -> std::io::Result<u32> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.mode())
}

#[cfg(test)]
mod tests;
