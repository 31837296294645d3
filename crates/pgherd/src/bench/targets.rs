//! What benchmarks measure against: a local PostgreSQL primary, pgherd and PgBouncer in front
//! of it, each started fresh for the run and stopped when dropped.

use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pgherd_cluster::{free_port, ClusterSpec, LocalCluster, RunAs, StopMode};
use pgherd_wire::scram::ScramVerifier;

use super::procstat;

/// A role pgbench logs in as, and the verifier both the server and the poolers hold.
#[derive(Clone)]
pub struct BenchUser {
    pub name: String,
    pub password: String,
    pub verifier: ScramVerifier,
}

impl BenchUser {
    /// `iterations` below PostgreSQL's 4096 keep thousands of logins cheap for the client side
    /// of the idle-memory measurement; the server side costs the same either way.
    pub fn new(name: &str, iterations: u32) -> Self {
        let password = format!("{name}-{}", rand::random::<u32>());
        let verifier =
            ScramVerifier::from_password(&password, &rand::random::<[u8; 16]>(), iterations);
        BenchUser {
            name: name.to_owned(),
            password,
            verifier,
        }
    }

    pub fn url(&self, port: u16, database: &str) -> String {
        format!(
            "postgres://{}:{}@127.0.0.1:{port}/{database}",
            self.name, self.password
        )
    }
}

pub struct BenchCluster {
    pub cluster: LocalCluster,
    pub dir: PathBuf,
    pub superuser_password: String,
    /// pgherd and PgBouncer reach the nodes through their Unix-domain sockets, not TCP.
    pub poolers_use_sockets: bool,
    /// pgherd and PgBouncer start under valgrind's callgrind, which counts the instructions
    /// they execute (`pgherd bench pooler --count-instructions`).
    pub poolers_under_callgrind: bool,
}

impl BenchCluster {
    /// A primary (plus `replicas`) under `dir`, with `users` created on it.
    pub fn create(
        dir: &Path,
        replicas: usize,
        settings: Vec<(String, String)>,
        users: &[&BenchUser],
    ) -> Result<Self, String> {
        Self::create_in(dir, replicas, settings, users, Vec::new())
    }

    /// As [`Self::create`], each node in its network namespace at its address (`netns`:
    /// (namespace, address) per node, primary first).
    pub fn create_in(
        dir: &Path,
        replicas: usize,
        settings: Vec<(String, String)>,
        users: &[&BenchUser],
        netns: Vec<(String, String)>,
    ) -> Result<Self, String> {
        let superuser_password = format!("bench-{}", rand::random::<u32>());
        let ports = (0..=replicas)
            .map(|_| free_port().map_err(|e| e.to_string()))
            .collect::<Result<Vec<_>, _>>()?;
        let cluster = LocalCluster::create(&ClusterSpec {
            dir: dir.join("cluster"),
            ports,
            superuser: "postgres".into(),
            superuser_password: superuser_password.clone(),
            settings,
            template: None,
            netns,
            replication_role: None,
            node_prefix: String::new(),
        })
        .map_err(|e| e.to_string())?;
        for user in users {
            cluster
                .primary()
                .psql(
                    "postgres",
                    &format!(
                        "CREATE ROLE {} LOGIN PASSWORD '{}'",
                        user.name, user.verifier
                    ),
                )
                .map_err(|e| e.to_string())?;
        }
        Ok(BenchCluster {
            cluster,
            dir: dir.to_owned(),
            superuser_password,
            poolers_use_sockets: false,
            poolers_under_callgrind: false,
        })
    }

    /// Waits until every replica has replayed all the primary's WAL, so a read run does not start
    /// while replicas still replay the previous write run (pgherd would rightly keep reads off
    /// lagging replicas, and the run would measure the write run's tail).
    pub fn wait_caught_up(&self) {
        use pgherd_route::balance::parse_lsn;
        let deadline = Instant::now() + Duration::from_secs(120);
        let primary = self.cluster.primary();
        loop {
            let target = primary
                .psql("postgres", "SELECT pg_current_wal_lsn()")
                .ok()
                .and_then(|s| parse_lsn(s.trim()));
            let behind = self.cluster.replicas().iter().any(|replica| {
                let replayed = replica
                    .psql("postgres", "SELECT pg_last_wal_replay_lsn()")
                    .ok()
                    .and_then(|s| parse_lsn(s.trim()));
                match (target, replayed) {
                    (Some(t), Some(r)) => r < t,
                    _ => true,
                }
            });
            if !behind {
                return;
            }
            if Instant::now() > deadline {
                eprintln!("warning: replicas still replaying after 120 s; going on");
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Lets the cluster come to rest after it was built and loaded: a checkpoint on the
    /// primary, every replica caught up, a restartpoint on each, so the first measured run
    /// does not pay for the load's writes, its replay and its flushes.
    pub fn settle(&self) -> Result<(), String> {
        self.sql("postgres", "CHECKPOINT")?;
        self.wait_caught_up();
        for replica in self.cluster.replicas() {
            replica
                .psql("postgres", "CHECKPOINT")
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    pub fn primary_port(&self) -> u16 {
        self.cluster.primary().port
    }

    /// The primary's postmaster, from its `postmaster.pid`.
    pub fn primary_postmaster_pid(&self) -> Option<u32> {
        std::fs::read_to_string(self.cluster.primary().data_dir.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    pub fn sql(&self, database: &str, sql: &str) -> Result<String, String> {
        self.cluster
            .primary()
            .psql(database, sql)
            .map_err(|e| e.to_string())
    }

    pub fn run_as(&self) -> Option<&RunAs> {
        self.cluster.run_as.as_ref()
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        let _ = self.cluster.stop_all(StopMode::Fast);
    }
}

/// A pooler process started for the benchmark.
pub struct ProxyProcess {
    pub name: String,
    pub port: u16,
    /// pgherd's HTTP API (metrics), if the process has one.
    pub api_port: Option<u16>,
    child: Child,
    pub log: PathBuf,
    /// Where callgrind writes the process's counts (each dump to this path with `.1`, `.2`,
    /// ... appended), when it runs under callgrind.
    pub callgrind_out: Option<PathBuf>,
    /// How to start it again (pgherd's binary and config), for drills that kill it.
    relaunch: Option<(PathBuf, PathBuf)>,
}

impl ProxyProcess {
    /// The config it was started with (a pgherd's; a peer's is not kept here).
    pub fn config_path(&self) -> Option<&Path> {
        self.relaunch.as_ref().map(|(_, config)| config.as_path())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// pgherd's /metrics as text, if it has an HTTP API and answers.
    pub fn metrics_text(&self) -> Option<String> {
        let url = format!("http://127.0.0.1:{}/metrics", self.api_port?);
        ureq::get(&url)
            .timeout(Duration::from_secs(10))
            .call()
            .ok()?
            .into_string()
            .ok()
    }

    /// Reaps the process if it exited (a drill killed it) and starts it again with the same
    /// binary and config; returns once it listens.
    pub fn restart(&mut self) -> Result<(), String> {
        let (exe, config) = self
            .relaunch
            .clone()
            .ok_or_else(|| format!("{} cannot be restarted", self.name))?;
        if self.child.try_wait().map_err(|e| e.to_string())?.is_none() {
            return Err(format!("{} still runs", self.name));
        }
        self.child = spawn_pgherd(&exe, &config, &self.log, true)?;
        self.wait_listening()
    }

    /// What the process has used so far (nothing, if it is gone).
    pub fn cpu_use(&self) -> procstat::CpuUse {
        procstat::CpuUse::of(self.pid()).unwrap_or_default()
    }

    fn wait_ready(mut self) -> Result<Self, String> {
        self.wait_listening()?;
        Ok(self)
    }

    fn wait_listening(&mut self) -> Result<(), String> {
        // Under callgrind a start takes some fifty times longer.
        let limit_s = if self.callgrind_out.is_some() {
            300
        } else {
            30
        };
        let deadline = Instant::now() + Duration::from_secs(limit_s);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                let log = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(format!(
                    "{} exited at startup ({status}):\n{log}",
                    self.name
                ));
            }
            if TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("{} did not listen within {limit_s} s", self.name));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ProxyProcess {
    /// SIGINT first: all three stop quickly on it, and Pgpool-II takes its pre-forked children
    /// down with it (SIGKILL would leave them holding server connections).
    fn drop(&mut self) {
        // SAFETY: kill(2) with a pid this process spawned and has not yet reaped.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGINT);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The log file (new, or `append`ed to) as stdout and stderr.
fn log_file(path: &Path, append: bool) -> Result<(std::fs::File, std::fs::File), String> {
    let f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let g = f.try_clone().map_err(|e| e.to_string())?;
    Ok((f, g))
}

/// What a pgherd started for a benchmark fronts and how.
#[derive(Clone, Copy)]
pub struct PgherdSetup<'a> {
    /// The cluster's first `nodes` nodes (the primary first).
    pub nodes: usize,
    pub users: &'a [&'a BenchUser],
    /// Server connections per pool.
    pub pool_size: u32,
    /// 0 = pgherd's default.
    pub workers: usize,
    /// Keys for the `[databases."*"]` section.
    pub database_keys: &'a str,
    /// High availability as `pgherd up` sets it (sync durability, failover, auto rejoin, the
    /// nodes' data directories, the superuser on the admin console) instead of the
    /// benchmarks' asynchronous replication without failover.
    pub ha: bool,
    /// The superuser on the admin console (as `ha` has it) without the rest of `ha`: for a
    /// command that asks the running pgherd to pause and reload (`pgherd shard move`).
    pub admin: bool,
    /// Another pgherd binary (an earlier build) to run instead of this one, as
    /// `pgherd-baseline`: before/after figures from one interleaved run.
    pub baseline: Option<&'a Path>,
    /// A pgherd of its own among several (instances agreeing through etcd, the sharded
    /// endpoint over N shards): its name (for the files and the log) and the config sections
    /// added for it (`[dcs]`; `[sharding]` and the other shards' nodes).
    pub instance: Option<(&'a str, &'a str)>,
}

/// pgherd in transaction mode, as its own process so its CPU time can be read.
pub fn start_pgherd(cluster: &BenchCluster, setup: &PgherdSetup) -> Result<ProxyProcess, String> {
    let PgherdSetup {
        nodes,
        users,
        pool_size,
        workers,
        database_keys,
        ha,
        admin,
        baseline,
        instance,
    } = setup;
    let admin = *ha || *admin;
    let name = match (instance, baseline) {
        (Some((name, _)), _) => name,
        (None, Some(_)) => "pgherd-baseline",
        (None, None) => "pgherd",
    };
    let port = free_port().map_err(|e| e.to_string())?;
    let api_port = free_port().map_err(|e| e.to_string())?;
    // Valgrind slows everything some fifty-fold: health checks, which run by the clock, would
    // be counted as a large part of each transaction at the usual period, and a login's SCRAM
    // key derivation would outlast the usual time limits.
    let (cluster_keys, pool_keys) = match cluster.poolers_under_callgrind {
        true => (
            "health_check_period_ms = 60000\nhealth_check_timeout_ms = 60000\n",
            "server_connect_timeout_ms = 60000\n",
        ),
        false => ("", ""),
    };
    let mut config = format!(
        "[pgherd]\nlisten = [\"127.0.0.1:{port}\"]\nworkers = {workers}\nmax_client_connections = 20000\nlog_level = \"{}\"\n{}\n\
         [cluster]\nuser = \"postgres\"\npassword = \"{}\"\n{cluster_keys}\n[api]\nlisten = [\"127.0.0.1:{api_port}\"]\n\n",
        if *ha { "info" } else { "warn" },
        if admin { "admin_users = [\"postgres\"]\n" } else { "" },
        cluster.superuser_password
    );
    for node in cluster.cluster.nodes.iter().take(*nodes) {
        config.push_str(&format!(
            "[[nodes]]\nname = \"{}\"\nhost = \"{}\"\nport = {}\n",
            node.name, node.host, node.port
        ));
        if let Some(netns) = &node.netns {
            config.push_str(&format!("netns = \"{netns}\"\n"));
        } else if cluster.poolers_use_sockets {
            config.push_str(&format!("socket_dir = \"{}\"\n", node.socket_dir.display()));
        }
        if *ha {
            config.push_str(&format!("data_dir = \"{}\"\n", node.data_dir.display()));
        }
        config.push('\n');
    }
    config.push_str(&format!(
        "[pool]\nmode = \"transaction\"\nmax_size = {pool_size}\n{pool_keys}\n[databases.\"*\"]\n{database_keys}\n\n"
    ));
    if *ha {
        config.push_str("[failover]\nenabled = true\nauto_rejoin = true\n\n");
    } else {
        // The peers replicate asynchronously; so does pgherd here, so the figures compare
        // the middleware and not the durability.
        config.push_str("[replication]\ndurability = \"async\"\n\n");
    }
    if admin {
        let superuser = ScramVerifier::from_password(
            &cluster.superuser_password,
            &rand::random::<[u8; 16]>(),
            4096,
        );
        config.push_str(&format!(
            "[users.postgres]\nscram = \"{superuser}\"\nserver_password = \"{}\"\n\n",
            cluster.superuser_password
        ));
    }
    for user in users.iter() {
        config.push_str(&format!(
            "[users.{}]\nscram = \"{}\"\n\n",
            user.name, user.verifier
        ));
    }
    if let Some((_, dcs)) = instance {
        config.push_str(dcs);
    }
    let path = cluster.dir.join(format!("{name}.toml"));
    pgherd_config::write_private_file(&path, &config).map_err(|e| e.to_string())?;
    let log = cluster.dir.join(format!("{name}.log"));
    let exe = match baseline {
        Some(binary) => binary.to_path_buf(),
        None => std::env::current_exe().map_err(|e| e.to_string())?,
    };
    let (mut cmd, callgrind_out) = pooler_command(cluster, &exe, &cluster.dir, name);
    cmd.args(["run", "--config"]).arg(&path);
    let child = spawn_logged(cmd, &log, false)?;
    ProxyProcess {
        name: name.to_owned(),
        port,
        api_port: Some(api_port),
        child,
        log,
        callgrind_out,
        relaunch: Some((exe, path)),
    }
    .wait_ready()
}

/// `pgherd run --config <config>`, logging to `log` (appended to on a restart).
fn spawn_pgherd(exe: &Path, config: &Path, log: &Path, append: bool) -> Result<Child, String> {
    let mut cmd = Command::new(exe);
    cmd.args(["run", "--config"]).arg(config);
    spawn_logged(cmd, log, append)
}

/// Starts pgherd's command, logging to `log`.
fn spawn_logged(mut cmd: Command, log: &Path, append: bool) -> Result<Child, String> {
    let (out, err) = log_file(log, append)?;
    cmd.stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start pgherd: {e}"))
}

/// The command that starts a pooler's `program`: under valgrind's callgrind when the cluster
/// asks for counts, which then go to `dir/<name>.callgrind` (returned). The process keeps its
/// pid (valgrind runs the program in its own process), which vgdb addresses.
fn pooler_command(
    cluster: &BenchCluster,
    program: &Path,
    dir: &Path,
    name: &str,
) -> (Command, Option<PathBuf>) {
    if !cluster.poolers_under_callgrind {
        return (Command::new(program), None);
    }
    let out = dir.join(format!("{name}.callgrind"));
    let mut cmd = Command::new("valgrind");
    cmd.arg("--tool=callgrind")
        .arg(format!("--callgrind-out-file={}", out.display()))
        .arg(program);
    (cmd, Some(out))
}

/// PgBouncer (from the distribution) in transaction mode with the same pool size and the same
/// SCRAM verifiers, run as the PostgreSQL OS user because it refuses to run as root.
pub fn start_pgbouncer(
    cluster: &BenchCluster,
    users: &[&BenchUser],
    pool_size: u32,
) -> Result<ProxyProcess, String> {
    start_pgbouncer_for(
        cluster,
        users,
        pool_size,
        ("pgbouncer", cluster.primary_port()),
    )
}

/// A peer's binary as the distribution installs it (Debian's package has the same name).
fn installed(name: &str) -> Result<PathBuf, String> {
    ["/usr/sbin", "/usr/bin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("{name} is not installed (Debian: apt-get install {name})"))
}

/// [`start_pgbouncer`] in front of the node on `port`, its files in a directory `name`.
fn start_pgbouncer_for(
    cluster: &BenchCluster,
    users: &[&BenchUser],
    pool_size: u32,
    (name, node_port): (&str, u16),
) -> Result<ProxyProcess, String> {
    let binary = installed("pgbouncer")?;
    let dir = cluster.dir.join(name);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let port = free_port().map_err(|e| e.to_string())?;
    let userlist: String = users
        .iter()
        .map(|u| format!("\"{}\" \"{}\"\n", u.name, u.verifier))
        .collect();
    std::fs::write(dir.join("userlist.txt"), userlist).map_err(|e| e.to_string())?;
    let socket_dir = cluster
        .cluster
        .nodes
        .iter()
        .find(|n| n.port == node_port && n.netns.is_none())
        .map(|n| n.socket_dir.display().to_string());
    let host = match (cluster.poolers_use_sockets, socket_dir) {
        (true, Some(dir)) => dir,
        _ => "127.0.0.1".to_owned(),
    };
    let ini = format!(
        "[databases]\n* = host={host} port={node_port}\n\n[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\n\
         unix_socket_dir =\nauth_type = scram-sha-256\nauth_file = {}\npool_mode = transaction\n\
         default_pool_size = {pool_size}\nmax_client_conn = 20000\nserver_reset_query =\n\
         ignore_startup_parameters = extra_float_digits\nlogfile = {}\npidfile = {}\nlog_connections = 0\nlog_disconnections = 0\n",
        dir.join("userlist.txt").display(),
        dir.join("pgbouncer.log").display(),
        dir.join("pgbouncer.pid").display(),
    );
    let ini_path = dir.join("pgbouncer.ini");
    std::fs::write(&ini_path, ini).map_err(|e| e.to_string())?;
    // Counts in its own directory: the PostgreSQL OS user it runs as must write them.
    let (mut cmd, callgrind_out) = pooler_command(cluster, &binary, &dir, name);
    cmd.arg(&ini_path);
    spawn_as_postgres_user(cluster, (name, &dir, port), cmd, callgrind_out)
}

/// Seed 001's stack: one PgBouncer per node and HAProxy (TCP mode) in front of them, with a
/// write port on the primary's PgBouncer and a read port balancing round robin over all of
/// them; HAProxy checks each PgBouncer by connecting every second.
pub struct HaproxyStack {
    /// Declared first: HAProxy stops before the PgBouncers behind it.
    haproxy: ProxyProcess,
    pub read_port: u16,
    _bouncers: Vec<ProxyProcess>,
}

impl HaproxyStack {
    pub fn write_port(&self) -> u16 {
        self.haproxy.port
    }
}

/// `find_primary`: the write port lists every node's PgBouncer and sends to the one whose
/// server says it is not in recovery, and the read port to those whose server answers (asked
/// every 500 ms, two answers in a row to change its mind), as a stack whose primary a
/// failover manager (repmgr) can move must; otherwise the write port sends to the first
/// node's PgBouncer and the read port to every PgBouncer that accepts connections.
pub fn start_haproxy_stack(
    cluster: &BenchCluster,
    users: &[&BenchUser],
    pool_size: u32,
    find_primary: bool,
) -> Result<HaproxyStack, String> {
    let binary = installed("haproxy")?;
    let bouncers = cluster
        .cluster
        .nodes
        .iter()
        .map(|node| {
            let name = format!("pgbouncer-{}", node.name);
            start_pgbouncer_for(cluster, users, pool_size, (&name, node.port))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let write_port = free_port().map_err(|e| e.to_string())?;
    let read_port = free_port().map_err(|e| e.to_string())?;
    let dir = cluster.dir.join("haproxy");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let tcp_checked = |k: usize, b: &ProxyProcess| {
        format!(
            "    server n{k} 127.0.0.1:{} check inter 1s fall 3 rise 2\n",
            b.port
        )
    };
    let (global, write, read) = match find_primary {
        true => {
            let user = users
                .first()
                .ok_or("HAProxy's checks need a user to log in as")?;
            let checked = |sql: &str, expect: &str, file: &str| -> Result<String, String> {
                let script = check_script(cluster, &dir, user, (file, sql, expect))?;
                let mut section = format!(
                    "    option external-check\n    external-check path \"/usr/bin:/bin\"\n    \
                     external-check command {}\n",
                    script.display()
                );
                for (k, b) in bouncers.iter().enumerate() {
                    section.push_str(&format!(
                        "    server n{k} 127.0.0.1:{} check inter 500 fall 2 rise 2 \
                         on-marked-down shutdown-sessions\n",
                        b.port
                    ));
                }
                Ok(section)
            };
            (
                "    external-check\n    insecure-fork-wanted\n",
                checked("SELECT pg_is_in_recovery()", "f", "is-primary.sh")?,
                checked("SELECT 1", "1", "is-up.sh")?,
            )
        }
        false => {
            let read: String = bouncers
                .iter()
                .enumerate()
                .map(|(k, b)| tcp_checked(k, b))
                .collect();
            ("", tcp_checked(0, &bouncers[0]), read)
        }
    };
    let config = format!(
        "global\n    maxconn 4000\n{global}\ndefaults\n    mode tcp\n    timeout connect 5s\n    \
         timeout client 1h\n    timeout server 1h\n\nlisten write\n    bind 127.0.0.1:{write_port}\n{write}\n\
         listen read\n    bind 127.0.0.1:{read_port}\n    balance roundrobin\n{read}"
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, config).map_err(|e| format!("{}: {e}", path.display()))?;
    let log = dir.join("haproxy.log");
    let (out, err) = log_file(&log, false)?;
    let child = Command::new(binary)
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start haproxy: {e}"))?;
    let haproxy = ProxyProcess {
        name: "haproxy".to_owned(),
        port: write_port,
        api_port: None,
        child,
        log,
        callgrind_out: None,
        relaunch: None,
    }
    .wait_ready()?;
    Ok(HaproxyStack {
        haproxy,
        read_port,
        _bouncers: bouncers,
    })
}

/// An HAProxy external check, `file` in `dir`: passes when the server behind the PgBouncer at
/// `$3:$4` answers `sql` with `expect`.
fn check_script(
    cluster: &BenchCluster,
    dir: &Path,
    user: &BenchUser,
    (file, sql, expect): (&str, &str, &str),
) -> Result<PathBuf, String> {
    let path = dir.join(file);
    let script = format!(
        "#!/bin/sh\nexport PGPASSWORD='{}' PGCONNECT_TIMEOUT=1\n\
         test \"$({} -X -A -t -h \"$3\" -p \"$4\" -U {} -d postgres -c '{sql}' 2>/dev/null)\" = {expect}\n",
        user.password,
        cluster.cluster.binaries.tool("psql").display(),
        user.name
    );
    std::fs::write(&path, script).map_err(|e| format!("{}: {e}", path.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

/// Pgpool-II (from the distribution) in streaming-replication mode with load balancing over the
/// cluster's first `nodes` nodes, every node weighted 1 as in the seeds' benchmarks. Clients
/// authenticate with SCRAM against `pool_passwd`; one pre-forked child per client as Pgpool-II
/// requires (`num_init_children`), each keeping one pooled connection per node.
pub fn start_pgpool(
    cluster: &BenchCluster,
    nodes: usize,
    user: &BenchUser,
    max_clients: u32,
    statement_level_load_balance: bool,
    memory_cache_bytes: Option<u64>,
) -> Result<ProxyProcess, String> {
    let binary = PathBuf::from("/usr/sbin/pgpool");
    if !binary.is_file() {
        return Err("Pgpool-II is not installed (Debian: apt-get install pgpool2)".into());
    }
    let dir = cluster.dir.join(match memory_cache_bytes {
        Some(_) => format!("pgpool-{nodes}-cache"),
        None => format!("pgpool-{nodes}"),
    });
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let port = free_port().map_err(|e| e.to_string())?;
    let pcp_port = free_port().map_err(|e| e.to_string())?;
    let mut conf = format!(
        "backend_clustering_mode = 'streaming_replication'\n\
         listen_addresses = '127.0.0.1'\nport = {port}\nsocket_dir = '{d}'\n\
         pcp_listen_addresses = '127.0.0.1'\npcp_port = {pcp_port}\npcp_socket_dir = '{d}'\n\
         pid_file_name = '{d}/pgpool.pid'\nlogdir = '{d}'\n\
         num_init_children = {max_clients}\nmax_pool = 1\nreserved_connections = 0\n\
         enable_pool_hba = on\npool_passwd = 'pool_passwd'\n\
         load_balance_mode = on\nstatement_level_load_balance = {}\n\
         sr_check_user = 'postgres'\nsr_check_password = '{}'\nsr_check_database = 'postgres'\n\
         health_check_period = 0\nfailover_on_backend_error = off\nuse_watchdog = off\n\
         log_min_messages = warning\n",
        if statement_level_load_balance {
            "on"
        } else {
            "off"
        },
        cluster.superuser_password,
        d = dir.display(),
    );
    if let Some(bytes) = memory_cache_bytes {
        // Its in-memory query cache in shared memory, invalidated by the writes that pass
        // through it (per table) and never by time, as pgherd's is bounded by bytes.
        conf.push_str(&format!(
            "memory_cache_enabled = on\nmemqcache_method = 'shmem'\nmemqcache_total_size = {bytes}\n\
             memqcache_max_num_cache = 1000000\nmemqcache_expire = 0\n\
             memqcache_auto_cache_invalidation = on\nmemqcache_maxcache = 409600\n\
             memqcache_cache_block_size = 1048576\nmemqcache_oiddir = '{}/oiddir'\n",
            dir.display()
        ));
    }
    for (i, node) in cluster.cluster.nodes.iter().take(nodes).enumerate() {
        conf.push_str(&format!(
            "backend_hostname{i} = '127.0.0.1'\nbackend_port{i} = {}\nbackend_weight{i} = 1\n\
             backend_flag{i} = 'DISALLOW_TO_FAILOVER'\nbackend_application_name{i} = '{}'\n",
            node.port, node.name
        ));
    }
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join(name), text).map_err(|e| format!("{name}: {e}"))
    };
    write("pgpool.conf", &conf)?;
    write("pcp.conf", "")?;
    write(
        "pool_hba.conf",
        "host all all 127.0.0.1/32 scram-sha-256\nlocal all all trust\n",
    )?;
    // Pgpool-II needs the clear password to answer the servers' SCRAM challenges itself.
    write(
        "pool_passwd",
        &format!(
            "{}:TEXT{}\npostgres:TEXT{}\n",
            user.name, user.password, cluster.superuser_password
        ),
    )?;
    let mut cmd = Command::new(binary);
    cmd.arg("-n")
        .arg("-f")
        .arg(dir.join("pgpool.conf"))
        .arg("-F")
        .arg(dir.join("pcp.conf"))
        .arg("-a")
        .arg(dir.join("pool_hba.conf"));
    spawn_as_postgres_user(cluster, ("pgpool", &dir, port), cmd, None)
}

/// Starts a peer that refuses to run as root as the PostgreSQL OS user, owning `dir`, logging
/// to `dir/<name>.stderr`, and waits until it listens on `port` (longer when `cmd` runs it
/// under callgrind, writing to `callgrind_out`).
fn spawn_as_postgres_user(
    cluster: &BenchCluster,
    (name, dir, port): (&str, &Path, u16),
    mut cmd: Command,
    callgrind_out: Option<PathBuf>,
) -> Result<ProxyProcess, String> {
    cmd.stdin(Stdio::null());
    if let Some(user) = cluster.run_as() {
        use std::os::unix::process::CommandExt;
        let _ = Command::new("chown")
            .arg("-R")
            .arg(format!("{}:{}", user.uid, user.gid))
            .arg(dir)
            .status();
        cmd.uid(user.uid).gid(user.gid);
    }
    let log = dir.join(format!("{name}.stderr"));
    let (out, err) = log_file(&log, false)?;
    let child = cmd
        .stdout(out)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    ProxyProcess {
        name: name.to_owned(),
        port,
        api_port: None,
        child,
        log,
        callgrind_out,
        relaunch: None,
    }
    .wait_ready()
}

/// The sum of the /metrics samples whose line starts with `prefix` (a metric's name and the
/// start of its labels); `None` when there is none.
pub fn metric_sum(metrics: &str, prefix: &str) -> Option<f64> {
    let values: Vec<f64> = metrics
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}
