//! The embedded default: `pgherd up` builds a local cluster (a primary and streaming replicas)
//! on first run, writes a pgherd.toml for it and serves it; `pgherd down` stops it. Where its
//! directory is ([`local_dir`]) and which pgherd an operator command means ([`Where`]).

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pgherd_cluster::{free_port, ClusterSpec, LocalCluster, StopMode};
use pgherd_config::Config;
use pgherd_wire::scram::{ScramVerifier, DEFAULT_ITERATIONS};

pub mod instances;
mod shards;

pub const DEFAULT_DIR: &str = "pgherd-local";
const CONFIG_FILE: &str = "pgherd.toml";
const PASSWORD_FILE: &str = "passwords";
/// The role `up`'s replicas stream as.
const REPLICATION_USER: &str = "replicator";
/// The same passwords as a libpq password file, for `PGPASSFILE`.
const PGPASS_FILE: &str = "pgpass";
const APP_USER: &str = "app";
const SUPERUSER: &str = "postgres";

#[derive(clap::Args)]
pub struct UpOptions {
    /// Where the cluster, its config and its logs live [default: ./pgherd-local, or
    /// /var/lib/pgherd/local as root where PostgreSQL's OS user cannot reach ./]
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Streaming replicas to create (first run only).
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// The port pgherd listens on, on 127.0.0.1 (first run only).
    #[arg(long, default_value_t = 6432)]
    port: u16,
    /// The port of pgherd's HTTP API (health checks, metrics, JSON), on 127.0.0.1 (first run
    /// only).
    #[arg(long, default_value_t = 8008)]
    api_port: u16,
    /// Return once everything is ready, leaving pgherd running in the background.
    #[arg(long)]
    detach: bool,
    /// pgherd instances in front of the cluster (first run only): with more than one, `up`
    /// also starts a local etcd they agree through, runs them all in the background, and
    /// they listen on consecutive ports from --port (their APIs from --api-port).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=9))]
    instances: u16,
    /// Shards (first run only): with more than one, each is a cluster of its own (a primary
    /// and --replicas replicas) behind the one endpoint.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    shards: u16,
    /// A sharded table and its key column, with the key's type (smallint, integer, bigint
    /// (the default), text, uuid); repeatable (first run only, with --shards).
    #[arg(long = "shard-key", value_name = "TABLE.COLUMN[:TYPE]")]
    shard_keys: Vec<String>,
}

/// Which pgherd an operator command talks to: the one `pgherd up` made in `--dir`, or the
/// one running with `--config`.
#[derive(clap::Args, Debug, Clone)]
pub struct Where {
    /// The cluster directory made by `pgherd up` [default: as `pgherd up`'s].
    #[arg(long, conflicts_with = "config")]
    dir: Option<PathBuf>,
    /// Or any pgherd config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
}

impl Where {
    pub(crate) fn config_path(&self) -> Result<PathBuf, String> {
        match &self.config {
            Some(p) => absolute(p),
            None => {
                let path = local_dir(self.dir.as_deref())?.join(CONFIG_FILE);
                tighten_own_config(&path);
                Ok(path)
            }
        }
    }
}

/// Configs `up` wrote before it wrote them owner-only (they hold the superuser's password)
/// are made so: the directory is `up`'s own, so is the file.
fn tighten_own_config(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    let Ok(meta) = std::fs::metadata(path) else {
        return;
    };
    if meta.permissions().mode() & 0o077 != 0
        && std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).is_ok()
    {
        eprintln!(
            "pgherd: {} holds passwords; made it readable by its owner only (mode 0600)",
            path.display()
        );
    }
}

fn absolute(path: &Path) -> Result<PathBuf, String> {
    std::path::absolute(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Where the root-run fallback puts the local cluster.
const ROOT_FALLBACK_DIR: &str = "/var/lib/pgherd/local";

/// The local cluster's directory: the one asked for, else ./pgherd-local. As root, PostgreSQL
/// runs as another OS user, which cannot reach a directory under a closed parent (a clone in
/// /root): then /var/lib/pgherd/local, unless ./pgherd-local already exists. `up`, `down` and
/// `status` decide alike, so they find the same cluster.
pub fn local_dir(asked: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(dir) = asked {
        return absolute(dir);
    }
    let here = absolute(Path::new(DEFAULT_DIR))?;
    // SAFETY: geteuid has no preconditions.
    let is_root = unsafe { libc::geteuid() } == 0;
    if !is_root || here.exists() || others_can_traverse(&here) {
        return Ok(here);
    }
    eprintln!(
        "pgherd: {} is under a directory other OS users cannot enter, and PostgreSQL must not \
         run as root: using {ROOT_FALLBACK_DIR} (choose another with --dir).",
        here.display()
    );
    Ok(PathBuf::from(ROOT_FALLBACK_DIR))
}

/// Whether every existing ancestor of `path` lets other users through (the `o+x` bit).
fn others_can_traverse(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.ancestors()
        .skip(1)
        .filter_map(|dir| std::fs::metadata(dir).ok())
        .all(|meta| meta.permissions().mode() & 0o001 != 0)
}

fn random_password() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789";
    let mut rng = rand::thread_rng();
    (0..20)
        .map(|_| ALPHABET[rng.gen_range(0..ALPHABET.len())] as char)
        .collect()
}

fn verifier(password: &str) -> ScramVerifier {
    ScramVerifier::from_password(password, &rand::random::<[u8; 16]>(), DEFAULT_ITERATIONS)
}

/// Passwords `pgherd up` generated, kept next to the config (mode 0600) so later runs can
/// print how to connect.
struct Passwords {
    app: String,
    superuser: String,
}

impl Passwords {
    fn load(dir: &Path) -> Option<Passwords> {
        let text = std::fs::read_to_string(dir.join(PASSWORD_FILE)).ok()?;
        let get = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{key}=")).map(str::to_owned))
        };
        Some(Passwords {
            app: get(APP_USER)?,
            superuser: get(SUPERUSER)?,
        })
    }

    /// `host:port:*:user:password` lines for each of pgherd's addresses.
    fn save_pgpass(&self, path: &Path, listen: &[SocketAddr]) -> std::io::Result<()> {
        let text: String = listen
            .iter()
            .map(|a| {
                let (host, port) = (a.ip(), a.port());
                format!(
                    "{host}:{port}:*:{APP_USER}:{}\n{host}:{port}:*:{SUPERUSER}:{}\n",
                    pgherd_cluster::passfile_field(&self.app),
                    pgherd_cluster::passfile_field(&self.superuser)
                )
            })
            .collect();
        pgherd_config::write_private_file(path, &text)
    }

    fn save(&self, dir: &Path) -> Result<(), String> {
        let path = dir.join(PASSWORD_FILE);
        let text = format!("{APP_USER}={}\n{SUPERUSER}={}\n", self.app, self.superuser);
        pgherd_config::write_private_file(&path, &text)
            .map_err(|e| format!("{}: {e}", path.display()))
    }
}

pub fn up(options: UpOptions) -> Result<(), String> {
    let dir = local_dir(options.dir.as_deref())?;
    let config_path = dir.join(CONFIG_FILE);
    if !config_path.exists() {
        create(&dir, &options)?;
    } else {
        println!(
            "Using the existing cluster in {} (--replicas, --instances and the ports apply to new clusters only).",
            dir.display()
        );
    }
    tighten_own_config(&config_path);
    let config = Config::load(&config_path).map_err(|e| e.to_string())?;
    let clusters = shards::open_clusters(&config)?;
    for cluster in &clusters {
        cluster.start_all().map_err(|e| e.to_string())?;
    }
    let extra = instances::extra_configs(&dir);
    if !extra.is_empty() {
        return up_instances(&dir, &config_path, &extra);
    }
    if let Some(pid) = running_pid(&dir) {
        println!("pgherd is already running (pid {pid}).");
        print_connect(&dir, &config);
        return Ok(());
    }
    if options.detach {
        let pid = spawn_detached(&config_path, &config)?;
        println!(
            "pgherd is running in the background (pid {pid}, log {}).",
            log_file(&config_path).display()
        );
        print_connect(&dir, &config);
        println!("Stop everything with: pgherd down --dir {}", dir.display());
        return Ok(());
    }
    crate::logging::init(&config.proxy);
    std::fs::write(pid_file(&config_path), std::process::id().to_string())
        .map_err(|e| format!("{}: {e}", pid_file(&config_path).display()))?;
    let rt = crate::runtime(config.proxy.workers)?;
    let served = rt.block_on(pgherd_proxy::serve(config.clone(), |_| {
        print_connect(&dir, &config);
        println!("Press Ctrl-C to stop pgherd and the cluster.");
    }));
    let _ = std::fs::remove_file(pid_file(&config_path));
    for cluster in &clusters {
        for e in &cluster.stop_all(StopMode::Fast) {
            eprintln!("pgherd: {e}");
        }
    }
    served
}

/// Several instances: etcd first, then every instance not running yet, all in the background.
fn up_instances(dir: &Path, main: &Path, extra: &[PathBuf]) -> Result<(), String> {
    instances::start_etcd(dir)?;
    let mut configs = Vec::new();
    for path in std::iter::once(main).chain(extra.iter().map(PathBuf::as_path)) {
        tighten_own_config(path);
        let config = Config::load(path).map_err(|e| e.to_string())?;
        match running_pid_in(&pid_file(path)) {
            Some(pid) => println!("{} is already running (pid {pid}).", instance_name(path)),
            None => {
                let pid = spawn_detached(path, &config)?;
                println!(
                    "{} is running in the background (pid {pid}, log {}).",
                    instance_name(path),
                    log_file(path).display()
                );
            }
        }
        configs.push(config);
    }
    let listen: Vec<SocketAddr> = configs
        .iter()
        .filter_map(|c| c.proxy.listen.first().copied())
        .collect();
    print_connect_to(dir, &listen);
    println!("Stop everything with: pgherd down --dir {}", dir.display());
    Ok(())
}

fn instance_name(config_path: &Path) -> String {
    config_path
        .file_stem()
        .map_or_else(|| "pgherd".to_owned(), |s| s.to_string_lossy().into_owned())
}

/// `pgherd.toml` → `pgherd.pid`, `pgherd-2.toml` → `pgherd-2.pid`.
fn pid_file(config_path: &Path) -> PathBuf {
    config_path.with_extension("pid")
}

fn log_file(config_path: &Path) -> PathBuf {
    config_path.with_extension("log")
}

fn create(dir: &Path, options: &UpOptions) -> Result<(), String> {
    let shard_keys = options
        .shard_keys
        .iter()
        .map(|k| shards::parse_shard_key(k))
        .collect::<Result<Vec<_>, String>>()?;
    if options.shards > 1 && options.instances > 1 {
        return Err("--shards and --instances cannot be combined yet".into());
    }
    if options.shards == 1 && !shard_keys.is_empty() {
        return Err("--shard-key needs --shards 2 or more".into());
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let passwords = Passwords {
        app: random_password(),
        superuser: random_password(),
    };
    let ports = (0..=options.replicas)
        .map(|_| free_port().map_err(|e| e.to_string()))
        .collect::<Result<Vec<u16>, String>>()?;
    if options.shards > 1 {
        println!(
            "Creating {} shards, each a primary and {} streaming replica(s), in {} ...",
            options.shards,
            options.replicas,
            dir.display()
        );
    } else {
        println!(
            "Creating a primary and {} streaming replica(s) in {} ...",
            options.replicas,
            dir.display()
        );
    }
    // Replicas stream as a role that can replicate and nothing else.
    let replication_password = random_password();
    // A transaction writing to several shards commits with two-phase commit.
    let settings: Vec<(String, String)> = if options.shards > 1 {
        vec![("max_prepared_transactions".into(), "64".into())]
    } else {
        Vec::new()
    };
    let make = |cluster_dir: PathBuf, ports: Vec<u16>, node_prefix: String| {
        LocalCluster::create(&ClusterSpec {
            dir: cluster_dir,
            ports,
            superuser: SUPERUSER.into(),
            superuser_password: passwords.superuser.clone(),
            settings: settings.clone(),
            template: None,
            netns: Vec::new(),
            replication_role: Some((REPLICATION_USER.into(), replication_password.clone())),
            node_prefix,
        })
        .map_err(|e| e.to_string())
    };
    let cluster = make(dir.to_owned(), ports, String::new())?;
    let mut other_shards = Vec::new();
    for shard in 1..usize::from(options.shards) {
        let ports = (0..=options.replicas)
            .map(|_| free_port().map_err(|e| e.to_string()))
            .collect::<Result<Vec<u16>, String>>()?;
        other_shards.push(make(
            shards::shard_dir(dir, shard),
            ports,
            shards::node_prefix(shard),
        )?);
    }
    // The servers hold the very verifiers pgherd holds, so pgherd can pass a client's SCRAM
    // proof through instead of storing passwords.
    let app_verifier = verifier(&passwords.app);
    let superuser_verifier = verifier(&passwords.superuser);
    let setup = [
        format!("CREATE ROLE {APP_USER} LOGIN PASSWORD '{app_verifier}'"),
        format!("CREATE DATABASE {APP_USER} OWNER {APP_USER}"),
        format!("ALTER ROLE {SUPERUSER} PASSWORD '{superuser_verifier}'"),
    ];
    for each in std::iter::once(&cluster).chain(&other_shards) {
        for sql in &setup {
            each.primary()
                .psql("postgres", sql)
                .map_err(|e| e.to_string())?;
        }
    }
    let mut config = render_config(
        &cluster,
        &passwords,
        &replication_password,
        &app_verifier,
        &superuser_verifier,
    );
    for (i, shard) in other_shards.iter().enumerate() {
        config.push('\n');
        config.push_str(&shards::nodes_section(i + 1, shard));
    }
    if options.shards > 1 {
        config.push_str(&shards::sharding_section(&shard_keys));
    }
    passwords.save(dir)?;
    let etcd_port = if options.instances > 1 {
        Some(instances::create_etcd(dir)?)
    } else {
        None
    };
    for k in 1..=usize::from(options.instances) {
        let offset = (k - 1) as u16;
        let (port, api_port) = (
            options.port.checked_add(offset),
            options.api_port.checked_add(offset),
        );
        let (Some(port), Some(api_port)) = (port, api_port) else {
            return Err("--port and --api-port leave no room for every instance".to_owned());
        };
        let mut text = config
            .replace("{PORT}", &port.to_string())
            .replace("{API_PORT}", &api_port.to_string());
        if let Some(etcd_port) = etcd_port {
            text.push('\n');
            text.push_str(&instances::dcs_section(k, etcd_port));
        }
        let path = instances::config_path(dir, k);
        // It holds the superuser's password and the API token.
        pgherd_config::write_private_file(&path, &text)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Config::load(&path).map_err(|e| format!("the generated config is invalid (a bug): {e}"))?;
    }
    Ok(())
}

/// The config of every instance, with `{PORT}` and `{API_PORT}` for pgherd's and its HTTP
/// API's ports.
/// pgherd's connections to a node on this machine go through its Unix-domain socket (cheaper
/// than TCP over loopback), written relative to the config file as `data_dir` is; none when its
/// path would be too long for a socket.
fn socket_dir_line(node: &pgherd_cluster::LocalNode) -> String {
    if !pgherd_config::socket_dir_fits(&node.socket_dir) {
        return String::new();
    }
    let beside_config = node.data_dir.parent().unwrap_or(Path::new("/"));
    let dir = node
        .socket_dir
        .strip_prefix(beside_config)
        .unwrap_or(&node.socket_dir);
    format!("socket_dir = \"{}\"\n", dir.display())
}

fn render_config(
    cluster: &LocalCluster,
    passwords: &Passwords,
    replication_password: &str,
    app_verifier: &ScramVerifier,
    superuser_verifier: &ScramVerifier,
) -> String {
    let mut text = format!(
        "# Written by `pgherd up`. Edit freely; `pgherd check-config {CONFIG_FILE}` validates it.\n\n\
         [pgherd]\nlisten = [\"127.0.0.1:{{PORT}}\"]\nadmin_users = [\"{SUPERUSER}\"]\n\n\
         # How pgherd logs in to the nodes to watch them.\n\
         [cluster]\nuser = \"{SUPERUSER}\"\npassword = \"{}\"\n\n\
         # Health checks, metrics and JSON over HTTP; changes (switchover, rejoin) need the token.\n\
         [api]\nlisten = [\"127.0.0.1:{{API_PORT}}\"]\ntoken = \"{}\"\n\n",
        passwords.superuser,
        random_password()
    );
    for node in &cluster.nodes {
        let data_dir = node
            .data_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        text.push_str(&format!(
            "[[nodes]]\nname = \"{}\"\nhost = \"127.0.0.1\"\nport = {}\ndata_dir = \"{data_dir}\"\n{}\n",
            node.name,
            node.port,
            socket_dir_line(node)
        ));
    }
    text.push_str(&format!(
        "[pool]\nmode = \"transaction\"\nmax_size = 20\n\n\
         # Every database on the cluster, under its own name.\n[databases.\"*\"]\n\n\
         [users.{APP_USER}]\nscram = \"{app_verifier}\"\n\n\
         [users.{SUPERUSER}]\nscram = \"{superuser_verifier}\"\n\n\
         # No acknowledged commit exists on the primary alone while a replica streams.\n\
         [replication]\ndurability = \"sync\"\n\
         # The role replicas stream as: it can replicate and nothing else.\n\
         user = \"{REPLICATION_USER}\"\npassword = \"{replication_password}\"\n\n\
         # A dead primary is replaced by the most advanced synchronous replica.\n\
         [failover]\nenabled = true\n\
         # The replaced primary, once it answers again, is rewound and follows the new one.\n\
         auto_rejoin = true\n"
    ));
    text
}

/// Says how to connect without printing a password: the passwords go to a libpq password
/// file next to the config (mode 0600), which the printed command names.
fn print_connect(dir: &Path, config: &Config) {
    print_connect_to(
        dir,
        &config.proxy.listen[..config.proxy.listen.len().min(1)],
    );
}

/// `listen`: the first address of each instance; several make a multi-host connection string.
fn print_connect_to(dir: &Path, listen: &[SocketAddr]) {
    if listen.is_empty() {
        return;
    }
    let hosts: Vec<String> = listen.iter().map(ToString::to_string).collect();
    let hosts = hosts.join(",");
    let pgpass = dir.join(PGPASS_FILE);
    match Passwords::load(dir) {
        Some(passwords) => {
            if let Err(e) = passwords.save_pgpass(&pgpass, listen) {
                eprintln!("pgherd: cannot write {}: {e}", pgpass.display());
            }
            println!(
                "Connect:  PGPASSFILE={} psql \"postgres://{APP_USER}@{hosts}/{APP_USER}\"",
                pgpass.display(),
            );
            println!(
                "          (passwords of {APP_USER} and {SUPERUSER}: {}, readable only by you)",
                dir.join(PASSWORD_FILE).display()
            );
        }
        None => println!("Connect:  psql \"postgres://{APP_USER}@{hosts}/{APP_USER}\""),
    }
    println!("Status:   pgherd status --dir {}", dir.display());
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

pub(crate) fn running_pid(dir: &Path) -> Option<i32> {
    running_pid_in(&pid_file(&dir.join(CONFIG_FILE)))
}

/// The pid a pid file names, if that process runs.
fn running_pid_in(path: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(path).ok()?.trim().parse().ok()?;
    pid_alive(pid).then_some(pid)
}

/// Starts `command` in a session of its own (detached from this terminal), its output
/// appended to `log`.
fn spawn_in_background(
    mut command: std::process::Command,
    log: &Path,
) -> Result<std::process::Child, String> {
    use std::os::unix::process::CommandExt;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("{}: {e}", log.display()))?;
    let file_err = file.try_clone().map_err(|e| e.to_string())?;
    command
        .stdin(std::process::Stdio::null())
        .stdout(file)
        .stderr(file_err);
    // SAFETY: setsid is async-signal-safe; it detaches the child from this terminal's session.
    unsafe {
        command.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    command
        .spawn()
        .map_err(|e| format!("cannot start {:?}: {e}", command.get_program()))
}

/// SIGTERM, then waits up to `timeout` for the process to go.
fn stop_process(pid: i32, timeout: Duration) -> Result<(), String> {
    // SAFETY: plain kill(2) on a pid read from our own pid file.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let deadline = Instant::now() + timeout;
    while pid_alive(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if pid_alive(pid) {
        return Err("did not stop".to_owned());
    }
    Ok(())
}

/// Runs `pgherd run` with `config_path` in the background (pid and log next to the config);
/// returns its pid once it listens.
fn spawn_detached(config_path: &Path, config: &Config) -> Result<i32, String> {
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the pgherd executable: {e}"))?;
    let mut command = std::process::Command::new(exe);
    command.arg("run").arg("--config").arg(config_path);
    let listen = config
        .proxy
        .listen
        .first()
        .copied()
        .ok_or("no listen address")?;
    start_in_background(
        command,
        "pgherd",
        &pid_file(config_path),
        &log_file(config_path),
        listen,
        Duration::from_secs(60),
    )
}

/// Starts `command` in the background with its pid in `pid_path` and its output in
/// `log_path`; returns its pid once `ready_at` accepts connections. If it exits first, the
/// end of its log says why.
fn start_in_background(
    command: std::process::Command,
    what: &str,
    pid_path: &Path,
    log_path: &Path,
    ready_at: SocketAddr,
    timeout: Duration,
) -> Result<i32, String> {
    let mut child = spawn_in_background(command, log_path)?;
    let pid = child.id() as i32;
    std::fs::write(pid_path, pid.to_string())
        .map_err(|e| format!("{}: {e}", pid_path.display()))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(log_path).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = &lines[lines.len().saturating_sub(15)..];
            return Err(format!(
                "{what} exited ({status}) before it was ready:\n{}",
                tail.join("\n")
            ));
        }
        if TcpStream::connect_timeout(&ready_at, Duration::from_millis(200)).is_ok() {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{what} did not listen on {ready_at} within {} s; see {}",
                timeout.as_secs(),
                log_path.display()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn down(dir: Option<&Path>) -> Result<(), String> {
    let dir = local_dir(dir)?;
    let config_path = dir.join(CONFIG_FILE);
    tighten_own_config(&config_path);
    let config = Config::load(&config_path).map_err(|e| e.to_string())?;
    let extra = instances::extra_configs(&dir);
    let timeout = Duration::from_millis(config.proxy.shutdown_timeout_ms + 5_000);
    for path in std::iter::once(&config_path).chain(&extra) {
        if let Some(pid) = running_pid_in(&pid_file(path)) {
            stop_process(pid, timeout)
                .map_err(|e| format!("{} (pid {pid}) {e}", instance_name(path)))?;
            println!("{} (pid {pid}) stopped.", instance_name(path));
        }
        let _ = std::fs::remove_file(pid_file(path));
    }
    instances::stop_etcd(&dir)?;
    let clusters = shards::open_clusters(&config)?;
    let mut stopped = Vec::new();
    for cluster in &clusters {
        if let Some(e) = cluster.stop_all(StopMode::Fast).first() {
            return Err(e.to_string());
        }
        stopped.extend(cluster.nodes.iter().map(|n| n.name.clone()));
    }
    println!("Nodes stopped: {}.", stopped.join(", "));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_closed_parent_stops_other_users() {
        let top = tempfile::tempdir().expect("tempdir");
        let open = top.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        // /tmp and / let others through on any machine the tests run on.
        assert!(others_can_traverse(&open.join(DEFAULT_DIR)));
        std::fs::set_permissions(top.path(), std::fs::Permissions::from_mode(0o700))
            .expect("chmod");
        assert!(!others_can_traverse(&open.join(DEFAULT_DIR)));
    }

    #[test]
    fn an_asked_directory_is_taken_as_given() {
        let dir = local_dir(Some(Path::new("/srv/somewhere"))).expect("dir");
        assert_eq!(dir, PathBuf::from("/srv/somewhere"));
    }
}
