//! The test kit: real PostgreSQL clusters in temporary directories on free ports, many at once,
//! and pgherd processes in front of them. Nothing here mocks PostgreSQL.
//!
//! When a test panics, the kit prints the end of every log it owns (PostgreSQL's and pgherd's)
//! so the failure explains itself.

mod certs;
mod etcd;
mod pgherd;
pub mod raw;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

pub use certs::TestCerts;
pub use etcd::TestEtcd;
pub use pgherd::{Pgherd, PgherdConfig};
use pgherd_cluster::{free_port, ClusterSpec, LocalCluster, LocalNode, StopMode};
use pgherd_wire::scram::{ScramVerifier, DEFAULT_ITERATIONS};

/// The superuser of every test cluster.
pub const SUPERUSER: &str = "postgres";
pub const SUPERUSER_PASSWORD: &str = "pgherd-test-superuser";

/// A cluster that lives as long as the value, then stops and disappears.
pub struct TestCluster {
    pub cluster: LocalCluster,
    dir: tempfile::TempDir,
}

/// What a test needs from its cluster.
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    pub replicas: usize,
    /// Extra postgresql.conf settings.
    pub settings: Vec<(String, String)>,
    /// Before the nodes' names (`pg1`, ...): shards behind one pgherd need names of their own.
    pub node_prefix: String,
    /// Per node, the network namespace it runs in and its address there
    /// (`pgherd_cluster::network::Network::nodes`); empty: every node on 127.0.0.1.
    pub netns: Vec<(String, String)>,
}

impl TestCluster {
    pub fn start(replicas: usize) -> TestCluster {
        Self::start_with(ClusterOptions {
            replicas,
            ..Default::default()
        })
    }

    pub fn start_with(options: ClusterOptions) -> TestCluster {
        let dir = tempfile::Builder::new()
            .prefix("pgherd-test-")
            .tempdir()
            .expect("cannot create a temporary directory");
        let ports: Vec<u16> = (0..=options.replicas)
            .map(|_| free_port().expect("no free port"))
            .collect();
        let mut settings: Vec<(String, String)> = [
            // Durability across OS crashes is not what these tests test; process crashes keep
            // their guarantees with fsync off.
            ("fsync", "off"),
            ("shared_buffers", "'32MB'"),
            ("max_connections", "300"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        settings.extend(options.settings);
        let spec = ClusterSpec {
            dir: dir.path().join("cluster"),
            ports,
            superuser: SUPERUSER.into(),
            superuser_password: SUPERUSER_PASSWORD.into(),
            settings,
            template: Some(template().to_owned()),
            netns: options.netns,
            replication_role: None,
            node_prefix: options.node_prefix,
        };
        let cluster = LocalCluster::create(&spec).unwrap_or_else(|e| {
            print_logs(&spec.dir.join("logs"));
            panic!("cannot start a test cluster: {e}")
        });
        TestCluster { cluster, dir }
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn primary(&self) -> &LocalNode {
        self.cluster.primary()
    }

    pub fn node(&self, name: &str) -> &LocalNode {
        self.cluster
            .nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name}"))
    }

    /// Runs SQL on the primary as the superuser.
    pub fn sql(&self, sql: &str) -> String {
        self.sql_on(&self.primary().name, "postgres", sql)
    }

    pub fn sql_on(&self, node: &str, database: &str, sql: &str) -> String {
        self.node(node)
            .psql(database, sql)
            .unwrap_or_else(|e| panic!("SQL failed on {node}: {sql}\n{e}"))
    }

    /// Creates a login role on the primary whose stored verifier is returned, so pgherd can be
    /// given the very same one (which lets it pass SCRAM proofs through).
    pub fn create_user(&self, name: &str, password: &str) -> ScramVerifier {
        let verifier =
            ScramVerifier::from_password(password, &rand::random::<[u8; 16]>(), DEFAULT_ITERATIONS);
        self.sql(&format!(
            "CREATE ROLE \"{name}\" LOGIN PASSWORD '{verifier}'"
        ));
        verifier
    }

    /// Waits until every replica has replayed everything the primary has written so far.
    pub fn wait_replayed(&self) {
        let lsn = self.sql("SELECT pg_current_wal_lsn()");
        for replica in self.cluster.replicas() {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let caught_up = replica
                    .psql(
                        "postgres",
                        &format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'"),
                    )
                    .map(|s| s == "t")
                    .unwrap_or(false);
                if caught_up {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "{} did not replay {lsn} in 30 s",
                    replica.name
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    pub fn logs_dir(&self) -> PathBuf {
        self.cluster.dir.join("logs")
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_logs(&self.logs_dir());
        }
        let _ = self.cluster.stop_all(StopMode::Immediate);
    }
}

/// Prints the last lines of every log file in `dir`.
pub fn print_logs(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        print_log_tail(&entry.path(), 40);
    }
}

pub fn print_log_tail(path: &Path, lines: usize) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(lines).collect();
    eprintln!(
        "----- last {} lines of {} -----",
        tail.len(),
        path.display()
    );
    for line in tail.iter().rev() {
        eprintln!("{line}");
    }
}

/// An initdb'ed data directory shared by every cluster of every test process, made once.
fn template() -> &'static Path {
    static TEMPLATE: OnceLock<PathBuf> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let root = std::env::temp_dir().join("pgherd-testkit-template-v1");
        let data = root.join("data");
        std::fs::create_dir_all(&root).expect("cannot create the template directory");
        let lock_path = root.join("lock");
        let lock = std::fs::File::create(&lock_path).expect("cannot create the template lock");
        // Serialize creation across test processes running at the same time.
        let fd = std::os::unix::io::AsRawFd::as_raw_fd(&lock);
        // SAFETY: flock on a file descriptor we own.
        unsafe { libc::flock(fd, libc::LOCK_EX) };
        if !data.join("PG_VERSION").exists() || !data.join("global").join("pg_control").exists() {
            let _ = std::fs::remove_dir_all(&data);
            LocalCluster::make_template(&data, SUPERUSER, SUPERUSER_PASSWORD)
                .unwrap_or_else(|e| panic!("cannot initdb the test template: {e}"));
        }
        // SAFETY: as above.
        unsafe { libc::flock(fd, libc::LOCK_UN) };
        data
    })
}

/// Runs a program to completion and returns its output, failing the test with its stderr.
pub fn run_ok(cmd: &mut std::process::Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {:?}: {e}", cmd.get_program()));
    assert!(
        out.status.success(),
        "{:?} failed ({}):\nstdout: {}\nstderr: {}",
        cmd,
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The directory of PostgreSQL's client programs (psql, pgbench).
pub fn pg_bin(tool: &str) -> PathBuf {
    pgherd_cluster::PgBinaries::find()
        .expect("PostgreSQL binaries not found")
        .tool(tool)
}
