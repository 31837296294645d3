//! Local PostgreSQL clusters for `pgherd up`, the test kit and the benchmarks: a primary made
//! with `initdb` and streaming replicas made with `pg_basebackup`, each on its own port.
//!
//! Everything is done through PostgreSQL's own programs (initdb, pg_ctl, pg_basebackup, psql).
//! PostgreSQL refuses to run as root, so when pgherd runs as root these programs run as the
//! `postgres` OS user (created as `pgherd` if no `postgres` user exists).
//!
//! Architecture invariant: this crate starts processes and writes files; it opens no sockets
//! except to find free ports.

mod binaries;
mod clone;
mod command;
pub use command::{pg_command, run as run_command, SERVICE_MANAGER_ENV};
pub mod network;
mod node;
mod osuser;
mod ports;
mod secret;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use binaries::PgBinaries;
pub use clone::CloneSource;
pub use node::{LocalNode, StopMode};
pub use osuser::RunAs;
pub use ports::{free_port, free_ports};
pub use secret::{conninfo_value, passfile_field, with_password, PassFile};

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("{0}")]
    NotInstalled(String),
    #[error("{what} failed: {detail}")]
    Command { what: String, detail: String },
    #[error("{path}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Setup(String),
}

impl ClusterError {
    pub(crate) fn io(path: &Path, error: std::io::Error) -> Self {
        ClusterError::Io {
            path: path.to_owned(),
            error,
        }
    }
}

/// How to build a cluster.
#[derive(Debug, Clone)]
pub struct ClusterSpec {
    /// Holds every node's data directory, logs and sockets.
    pub dir: PathBuf,
    /// Primary first.
    pub ports: Vec<u16>,
    pub superuser: String,
    pub superuser_password: String,
    /// Extra `postgresql.conf` settings for every node.
    pub settings: Vec<(String, String)>,
    /// Copy this initdb'ed data directory instead of running initdb (tests use this to save
    /// a second per cluster). It must have been made by [`LocalCluster::make_template`].
    pub template: Option<PathBuf>,
    /// Per node (primary first), a network namespace and the node's address in it, for
    /// fault drills that cut a node off; empty: every node on 127.0.0.1.
    pub netns: Vec<(String, String)>,
    /// A role (name, password) with REPLICATION and nothing else, made on the primary, that
    /// the replicas stream as; `None`: they stream as the superuser.
    pub replication_role: Option<(String, String)>,
    /// Before every node's name (`pg1`, `pg2`, ...), which is also its data directory's and
    /// the name it streams under: clusters behind one pgherd (shards) need names of their own.
    pub node_prefix: String,
}

/// The replication slot a standby named `node` streams through: its name as a slot may be
/// named (lower case letters, digits and `_`; a node name may also hold `-` and capitals).
pub fn slot_name(node: &str) -> String {
    node.chars()
        .map(|ch| match ch.to_ascii_lowercase() {
            ch @ ('a'..='z' | '0'..='9' | '_') => ch,
            _ => '_',
        })
        .collect()
}

/// A running local cluster.
#[derive(Debug)]
pub struct LocalCluster {
    pub dir: PathBuf,
    pub binaries: PgBinaries,
    pub run_as: Option<RunAs>,
    /// Primary first.
    pub nodes: Vec<LocalNode>,
    pub superuser: String,
    pub superuser_password: String,
}

impl LocalCluster {
    /// Creates and starts a primary and `spec.ports.len() - 1` streaming replicas, and waits
    /// until every replica streams.
    pub fn create(spec: &ClusterSpec) -> Result<LocalCluster, ClusterError> {
        let binaries = PgBinaries::find()?;
        let run_as = osuser::postgres_user()?;
        std::fs::create_dir_all(&spec.dir).map_err(|e| ClusterError::io(&spec.dir, e))?;
        for sub in ["logs", "run"] {
            let path = spec.dir.join(sub);
            std::fs::create_dir_all(&path).map_err(|e| ClusterError::io(&path, e))?;
        }
        osuser::hand_over(&spec.dir, run_as.as_ref(), true)?;
        osuser::check_reachable(&spec.dir, run_as.as_ref())?;
        let socket_dir = spec.dir.join("run");
        let nodes: Vec<LocalNode> = spec
            .ports
            .iter()
            .enumerate()
            .map(|(i, port)| LocalNode {
                name: format!("{}pg{}", spec.node_prefix, i + 1),
                host: spec
                    .netns
                    .get(i)
                    .map_or("127.0.0.1".to_owned(), |(_, address)| address.clone()),
                netns: spec.netns.get(i).map(|(ns, _)| ns.clone()),
                port: *port,
                data_dir: spec.dir.join(format!("{}pg{}", spec.node_prefix, i + 1)),
                log_file: spec.dir.join("logs").join(format!(
                    "{}pg{}.log",
                    spec.node_prefix,
                    i + 1
                )),
                socket_dir: socket_dir.clone(),
                binaries: binaries.clone(),
                run_as: run_as.clone(),
                superuser: spec.superuser.clone(),
            })
            .collect();
        let Some((primary, replicas)) = nodes.split_first() else {
            return Err(ClusterError::Setup(
                "a cluster needs at least one port".into(),
            ));
        };
        match &spec.template {
            Some(template) => primary.copy_from(template)?,
            None => primary.initdb(&spec.superuser, &spec.superuser_password)?,
        }
        primary.write_settings(&node_settings(primary, &spec.settings))?;
        if !spec.netns.is_empty() {
            // Nodes in namespaces reach each other, and pgherd reaches them, over their veths.
            primary.allow_hosts("10.0.0.0/8")?;
        }
        primary.start(Duration::from_secs(60))?;
        let (stream_user, stream_password) = match &spec.replication_role {
            Some((role, password)) => {
                primary.psql(
                    "postgres",
                    &format!(
                        "CREATE ROLE \"{}\" WITH REPLICATION LOGIN PASSWORD '{}'",
                        role.replace('"', "\"\""),
                        password.replace('\'', "''")
                    ),
                )?;
                (role.as_str(), password.as_str())
            }
            None => (spec.superuser.as_str(), spec.superuser_password.as_str()),
        };
        for replica in replicas {
            primary.psql(
                "postgres",
                &format!(
                    "SELECT pg_create_physical_replication_slot('{}')",
                    slot_name(&replica.name)
                ),
            )?;
            replica.basebackup(primary, stream_user, stream_password)?;
            let mut settings = node_settings(replica, &spec.settings);
            settings.push(("primary_slot_name".into(), slot_name(&replica.name)));
            replica.write_auto_settings(&settings)?;
            replica.start(Duration::from_secs(60))?;
        }
        let cluster = LocalCluster {
            dir: spec.dir.clone(),
            binaries,
            run_as,
            nodes,
            superuser: spec.superuser.clone(),
            superuser_password: spec.superuser_password.clone(),
        };
        cluster.wait_streaming(Duration::from_secs(60))?;
        Ok(cluster)
    }

    /// Runs initdb once into `dir`, for [`ClusterSpec::template`].
    pub fn make_template(dir: &Path, superuser: &str, password: &str) -> Result<(), ClusterError> {
        let binaries = PgBinaries::find()?;
        let run_as = osuser::postgres_user()?;
        let parent = dir.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(parent).map_err(|e| ClusterError::io(parent, e))?;
        osuser::hand_over(parent, run_as.as_ref(), false)?;
        let node = LocalNode {
            name: "template".into(),
            host: "127.0.0.1".into(),
            netns: None,
            port: 0,
            data_dir: dir.to_owned(),
            log_file: parent.join("template.log"),
            socket_dir: parent.to_owned(),
            binaries,
            run_as,
            superuser: superuser.to_owned(),
        };
        node.initdb(superuser, password)
    }

    /// Reattaches to a cluster created earlier (its nodes may be stopped).
    pub fn open(
        dir: &Path,
        nodes: &[(String, u16)],
        superuser: &str,
        password: &str,
    ) -> Result<LocalCluster, ClusterError> {
        let binaries = PgBinaries::find()?;
        let run_as = osuser::postgres_user()?;
        let nodes = nodes
            .iter()
            .map(|(name, port)| LocalNode {
                name: name.clone(),
                host: "127.0.0.1".into(),
                netns: None,
                port: *port,
                data_dir: dir.join(name),
                log_file: dir.join("logs").join(format!("{name}.log")),
                socket_dir: dir.join("run"),
                binaries: binaries.clone(),
                run_as: run_as.clone(),
                superuser: superuser.to_owned(),
            })
            .collect();
        Ok(LocalCluster {
            dir: dir.to_owned(),
            binaries,
            run_as,
            nodes,
            superuser: superuser.to_owned(),
            superuser_password: password.to_owned(),
        })
    }

    pub fn primary(&self) -> &LocalNode {
        &self.nodes[0]
    }

    pub fn replicas(&self) -> &[LocalNode] {
        &self.nodes[1..]
    }

    /// Waits until the primary reports every replica as streaming.
    pub fn wait_streaming(&self, timeout: Duration) -> Result<(), ClusterError> {
        let want = self.replicas().len();
        if want == 0 {
            return Ok(());
        }
        let deadline = Instant::now() + timeout;
        loop {
            let streaming = self
                .primary()
                .psql(
                    "postgres",
                    "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
                )
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .unwrap_or(0);
            if streaming >= want {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(ClusterError::Timeout(format!(
                    "only {streaming} of {want} replicas stream after {} s; see the logs in {}",
                    timeout.as_secs(),
                    self.dir.join("logs").display()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts every node that is not running.
    pub fn start_all(&self) -> Result<(), ClusterError> {
        for node in &self.nodes {
            if !node.is_running() {
                node.start(Duration::from_secs(60))?;
            }
        }
        Ok(())
    }

    /// Stops every node; errors are collected, not fatal, so one stuck node does not keep the
    /// others running.
    pub fn stop_all(&self, mode: StopMode) -> Vec<ClusterError> {
        self.nodes
            .iter()
            .rev()
            .filter(|n| n.is_running())
            .filter_map(|n| n.stop(mode).err())
            .collect()
    }
}

/// Settings every node gets: networking on loopback, sockets in the cluster's own directory,
/// and what streaming replication and the result cache's logical decoding need.
/// The settings a node of a local cluster runs with (its port, socket, name, replication), and
/// `extra`.
pub fn node_settings(node: &LocalNode, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut settings: Vec<(String, String)> = [
        ("listen_addresses", format!("'{}'", node.host)),
        ("port", node.port.to_string()),
        (
            "unix_socket_directories",
            format!("'{}'", node.socket_dir.display()),
        ),
        ("unix_socket_permissions", "0700".to_owned()),
        ("wal_level", "logical".to_owned()),
        ("max_wal_senders", "16".to_owned()),
        ("max_replication_slots", "16".to_owned()),
        ("hot_standby", "on".to_owned()),
        ("wal_log_hints", "on".to_owned()),
        // pg_rewind reads the target's WAL back to the last checkpoint before the histories
        // diverged: keep some, so a replaced primary can be rewound rather than copied.
        ("wal_keep_size", "'256MB'".to_owned()),
        // A standby pings a silent primary after half of wal_receiver_timeout, so a live one
        // is heard from at least that often; pgherd's split-brain guard counts a standby as
        // still hearing its primary only within the timeout, so a hung primary stops
        // guarding itself after 10 s rather than PostgreSQL's default 60.
        ("wal_receiver_timeout", "'10s'".to_owned()),
        ("wal_sender_timeout", "'10s'".to_owned()),
        ("max_connections", "200".to_owned()),
        ("log_line_prefix", "'%m [%p] %q%u@%d '".to_owned()),
        // A standby's WAL receiver reports cluster_name as its application_name: the name
        // pgherd lists in synchronous_standby_names.
        ("cluster_name", format!("'{}'", node.name)),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    settings.extend(extra.iter().cloned());
    settings
}

#[cfg(test)]
mod tests {
    #[test]
    fn slot_names_are_what_postgresql_accepts() {
        assert_eq!(super::slot_name("pg2"), "pg2");
        assert_eq!(super::slot_name("shard1-pg2"), "shard1_pg2");
        assert_eq!(super::slot_name("East-DB_1"), "east_db_1");
    }
}
