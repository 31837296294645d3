//! pgherd processes for tests: a config builder and a handle that stops the process and shows
//! its log when a test fails.

use std::fmt::Write as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use pgherd_cluster::free_port;
use pgherd_wire::scram::ScramVerifier;

use crate::{print_log_tail, TestCluster, SUPERUSER, SUPERUSER_PASSWORD};

/// A pgherd.toml for a test cluster. Starts from the cluster's nodes and management
/// credentials; tests add users, rules and settings.
#[derive(Debug, Clone)]
pub struct PgherdConfig {
    pub port: u16,
    pub pool_mode: String,
    pub max_size: u32,
    pub wait_timeout_ms: u64,
    pub users: Vec<String>,
    pub hba: Vec<String>,
    /// `[databases]` entries; the `"*"` wildcard if empty.
    pub databases: Vec<String>,
    /// Raw TOML added to `[pgherd]`.
    pub proxy_extra: Vec<String>,
    /// Raw TOML added to `[pool]`.
    pub pool_extra: Vec<String>,
    /// Raw TOML added to `[cluster]`.
    pub cluster_extra: Vec<String>,
    /// How `[cluster]` gets its password (`password = ...` by default).
    pub cluster_password: Option<String>,
    /// Raw TOML sections appended at the end.
    pub sections: Vec<String>,
    /// Extra lines for a `[[nodes]]` entry, by node name.
    pub node_extra: Vec<(String, String)>,
    /// pgherd reaches these nodes on another port (a forwarder a test can cut).
    pub node_ports: Vec<(String, u16)>,
    /// Every node gets its `data_dir`: pgherd manages the nodes' processes (switchover).
    pub manage_nodes: bool,
}

impl PgherdConfig {
    pub fn new() -> Self {
        PgherdConfig {
            port: free_port().expect("no free port"),
            pool_mode: "transaction".into(),
            max_size: 10,
            wait_timeout_ms: 10_000,
            users: Vec::new(),
            hba: Vec::new(),
            databases: Vec::new(),
            proxy_extra: Vec::new(),
            pool_extra: Vec::new(),
            cluster_extra: Vec::new(),
            cluster_password: None,
            sections: Vec::new(),
            node_extra: Vec::new(),
            node_ports: Vec::new(),
            manage_nodes: false,
        }
    }

    /// pgherd may stop and start the nodes (their `data_dir` is in the config).
    pub fn manage_nodes(mut self) -> Self {
        self.manage_nodes = true;
        self
    }

    /// pgherd reaches `node` through `port` instead of the node's own.
    pub fn node_port(mut self, node: &str, port: u16) -> Self {
        self.node_ports.push((node.to_owned(), port));
        self
    }

    /// The node's share of reads under the `weighted` balance policy.
    pub fn node_weight(mut self, node: &str, weight: u32) -> Self {
        self.node_extra
            .push((node.to_owned(), format!("weight = {weight}")));
        self
    }

    /// Any line for `node`'s `[[nodes]]` entry, e.g. `zone = "a"`.
    pub fn node_line(mut self, node: &str, line: &str) -> Self {
        self.node_extra.push((node.to_owned(), line.to_owned()));
        self
    }

    pub fn mode(mut self, mode: &str) -> Self {
        self.pool_mode = mode.into();
        self
    }

    pub fn max_size(mut self, max: u32) -> Self {
        self.max_size = max;
        self
    }

    pub fn wait_timeout_ms(mut self, ms: u64) -> Self {
        self.wait_timeout_ms = ms;
        self
    }

    /// A user clients authenticate as with SCRAM (`verifier`), with extra TOML lines.
    pub fn user(mut self, name: &str, verifier: &ScramVerifier, extra: &str) -> Self {
        self.users.push(format!(
            "[users.\"{name}\"]\nscram = \"{verifier}\"\n{extra}\n"
        ));
        self
    }

    /// A user entry written by hand.
    pub fn user_raw(mut self, name: &str, body: &str) -> Self {
        self.users.push(format!("[users.\"{name}\"]\n{body}\n"));
        self
    }

    /// One `[[hba]]` rule, e.g. `method = "trust"`.
    pub fn hba(mut self, rule: &str) -> Self {
        self.hba.push(format!("[[hba]]\n{rule}\n"));
        self
    }

    pub fn database(mut self, name: &str, body: &str) -> Self {
        self.databases
            .push(format!("[databases.\"{name}\"]\n{body}\n"));
        self
    }

    pub fn proxy(mut self, line: &str) -> Self {
        self.proxy_extra.push(line.into());
        self
    }

    pub fn pool(mut self, line: &str) -> Self {
        self.pool_extra.push(line.into());
        self
    }

    pub fn cluster(mut self, line: &str) -> Self {
        self.cluster_extra.push(line.into());
        self
    }

    pub fn section(mut self, toml: &str) -> Self {
        self.sections.push(toml.into());
        self
    }

    /// The superuser as a client, with the verifier the cluster holds unknown: pgherd logs in to
    /// servers with the password.
    pub fn superuser(self) -> Self {
        let verifier = ScramVerifier::from_password(SUPERUSER_PASSWORD, b"pgherd-test-salt", 4096);
        self.user(
            SUPERUSER,
            &verifier,
            &format!("server_password = \"{SUPERUSER_PASSWORD}\""),
        )
    }

    /// `[cluster]`'s password line instead of the inline password, e.g. `password_file = ...`.
    pub fn cluster_password(mut self, line: &str) -> Self {
        self.cluster_password = Some(line.into());
        self
    }

    pub fn render(&self, cluster: &TestCluster) -> String {
        let mut t = String::new();
        let _ = writeln!(t, "[pgherd]\nlisten = [\"127.0.0.1:{}\"]", self.port);
        if !self
            .proxy_extra
            .iter()
            .any(|l| l.starts_with("shutdown_timeout_ms"))
        {
            let _ = writeln!(t, "shutdown_timeout_ms = 5000");
        }
        for line in &self.proxy_extra {
            let _ = writeln!(t, "{line}");
        }
        let password = self
            .cluster_password
            .clone()
            .unwrap_or_else(|| format!("password = \"{SUPERUSER_PASSWORD}\""));
        let _ = writeln!(t, "\n[cluster]\nuser = \"{SUPERUSER}\"\n{password}");
        // The test defaults, unless a test's own lines set them.
        for (key, value) in [
            ("health_check_period_ms", 200),
            ("health_check_timeout_ms", 2000),
        ] {
            if !self.cluster_extra.iter().any(|l| l.starts_with(key)) {
                let _ = writeln!(t, "{key} = {value}");
            }
        }
        for line in &self.cluster_extra {
            let _ = writeln!(t, "{line}");
        }
        t.push('\n');
        for node in &cluster.cluster.nodes {
            let port = self
                .node_ports
                .iter()
                .find(|(n, _)| *n == node.name)
                .map_or(node.port, |(_, p)| *p);
            let _ = writeln!(t, "[[nodes]]\nname = \"{}\"\nport = {port}", node.name);
            if self.manage_nodes {
                let _ = writeln!(t, "data_dir = \"{}\"", node.data_dir.display());
            }
            for (_, line) in self.node_extra.iter().filter(|(n, _)| *n == node.name) {
                let _ = writeln!(t, "{line}");
            }
            t.push('\n');
        }
        let _ = writeln!(
            t,
            "[pool]\nmode = \"{}\"\nmax_size = {}\nwait_timeout_ms = {}",
            self.pool_mode, self.max_size, self.wait_timeout_ms
        );
        for line in &self.pool_extra {
            let _ = writeln!(t, "{line}");
        }
        t.push('\n');
        if self.databases.is_empty() {
            t.push_str("[databases.\"*\"]\n\n");
        }
        for block in self
            .databases
            .iter()
            .chain(&self.users)
            .chain(&self.hba)
            .chain(&self.sections)
        {
            let _ = writeln!(t, "{block}");
        }
        t
    }
}

impl Default for PgherdConfig {
    fn default() -> Self {
        Self::new()
    }
}

/// A running pgherd process.
pub struct Pgherd {
    child: Option<Child>,
    pub port: u16,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    binary: PathBuf,
    /// Environment variables the next start passes on (a failpoint, say).
    env: Vec<(String, String)>,
    /// Processes that took over from it (`pgherd upgrade`), not its children: killed with it.
    successors: Vec<u32>,
}

impl Pgherd {
    /// Writes the config into the cluster's directory and starts `binary run` with it; returns
    /// once pgherd accepts connections.
    pub fn start(binary: &str, cluster: &TestCluster, config: &PgherdConfig) -> Pgherd {
        let id = rand::random::<u32>();
        let config_path = cluster.dir().join(format!("pgherd-{id}.toml"));
        let log_path = cluster.dir().join(format!("pgherd-{id}.log"));
        pgherd_config::write_private_file(&config_path, &config.render(cluster))
            .expect("write pgherd config");
        let mut pgherd = Pgherd {
            child: None,
            port: config.port,
            config_path,
            log_path,
            binary: PathBuf::from(binary),
            env: Vec::new(),
            successors: Vec::new(),
        };
        pgherd.spawn();
        pgherd
    }

    fn spawn(&mut self) {
        if let Err(status) = self.try_spawn() {
            print_log_tail(&self.log_path, 60);
            panic!("pgherd exited during startup: {status}");
        }
    }

    /// Starts the process; `Err` with its exit status if it stops before it listens.
    fn try_spawn(&mut self) -> Result<(), ExitStatus> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .expect("open pgherd log");
        let child = Command::new(&self.binary)
            .arg("run")
            .arg("--config")
            .arg(&self.config_path)
            .env(
                "PGHERD_LOG",
                std::env::var("PGHERD_TEST_LOG")
                    .unwrap_or_else(|_| "info,pgherd_proxy=debug".into()),
            )
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log handle"))
            .stderr(log)
            .spawn()
            .expect("cannot start pgherd");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.try_wait() {
                return Err(status);
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            assert!(
                Instant::now() < deadline,
                "pgherd did not listen within 30 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self, user: &str, password: &str, database: &str) -> String {
        format!(
            "postgres://{user}:{password}@127.0.0.1:{}/{database}",
            self.port
        )
    }

    /// A tokio-postgres style connection string.
    pub fn conninfo(&self, user: &str, password: &str, database: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname={database}",
            self.port
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn signal(&self, signal: i32) {
        // Without a child, pid 0 would signal the whole process group: the tests themselves.
        let pid = self.pid();
        if pid == 0 {
            return;
        }
        // SAFETY: kill(2) on our own child.
        unsafe { libc::kill(pid as i32, signal) };
    }

    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits for the process to exit on its own.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.try_wait() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Sets (or with `None` removes) an environment variable for the next start.
    pub fn set_env(&mut self, name: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != name);
        if let Some(value) = value {
            self.env.push((name.to_owned(), value.to_owned()));
        }
    }

    /// Stops pgherd with SIGTERM (it drains) and waits for it to exit.
    pub fn stop(&mut self) {
        self.signal(libc::SIGTERM);
        if self.wait_exit(Duration::from_secs(30)).is_none() {
            if let Some(child) = self.child.as_mut() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        self.child = None;
    }

    /// Stops pgherd and starts it again with the same config and log.
    pub fn restart(&mut self) {
        self.stop();
        self.spawn();
    }

    /// Stops pgherd and starts it again, expecting it to refuse to start: its exit status
    /// (the log says why). Panics if it starts.
    pub fn restart_refused(&mut self) -> ExitStatus {
        self.stop();
        match self.try_spawn() {
            Err(status) => status,
            Ok(()) => panic!("pgherd started although it was expected to refuse"),
        }
    }

    pub fn rewrite_config(&self, cluster: &TestCluster, config: &PgherdConfig) {
        pgherd_config::write_private_file(&self.config_path, &config.render(cluster))
            .expect("rewrite pgherd config");
    }

    /// A process that took over from this one (an upgrade's): it goes when this one is
    /// dropped.
    pub fn successor(&mut self, pid: u32) {
        self.successors.push(pid);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }
}

impl Drop for Pgherd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            print_log_tail(&self.log_path, 80);
        }
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for pid in self.successors.drain(..) {
            // SAFETY: kill(2) on a process this test started (through an upgrade).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}
