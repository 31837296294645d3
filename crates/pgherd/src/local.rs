//! The embedded default: `pgherd up` builds a local cluster (a primary and streaming replicas)
//! on first run, writes a pgherd.toml for it and serves it; `pgherd down` stops it; `pgherd
//! status` reports on any pgherd config.

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pgherd_cluster::{free_port, ClusterSpec, LocalCluster, StopMode};
use pgherd_config::Config;
use pgherd_wire::scram::{ScramVerifier, DEFAULT_ITERATIONS};
use serde::Serialize;

pub const DEFAULT_DIR: &str = "pgherd-local";
const CONFIG_FILE: &str = "pgherd.toml";
const PID_FILE: &str = "pgherd.pid";
const LOG_FILE: &str = "pgherd.log";
const PASSWORD_FILE: &str = "passwords";
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
}

/// Which pgherd an operator command talks to: the one `pgherd up` made in `--dir`, or the
/// one running with `--config`.
#[derive(clap::Args, Debug)]
pub struct Where {
    /// The cluster directory made by `pgherd up` [default: as `pgherd up`'s].
    #[arg(long, conflicts_with = "config")]
    dir: Option<PathBuf>,
    /// Or any pgherd config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
}

impl Where {
    fn config_path(&self) -> Result<PathBuf, String> {
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

    /// `host:port:*:user:password` lines for pgherd's own address.
    fn save_pgpass(&self, path: &Path, listen: &SocketAddr) -> std::io::Result<()> {
        let escape = |s: &str| s.replace('\\', "\\\\").replace(':', "\\:");
        let (host, port) = (listen.ip(), listen.port());
        let text = format!(
            "{host}:{port}:*:{APP_USER}:{}\n{host}:{port}:*:{SUPERUSER}:{}\n",
            escape(&self.app),
            escape(&self.superuser)
        );
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
            "Using the existing cluster in {} (--replicas and --port apply to new clusters only).",
            dir.display()
        );
    }
    tighten_own_config(&config_path);
    let config = Config::load(&config_path).map_err(|e| e.to_string())?;
    let cluster = open_cluster(&dir, &config)?;
    cluster.start_all().map_err(|e| e.to_string())?;
    if let Some(pid) = running_pid(&dir) {
        println!("pgherd is already running (pid {pid}).");
        print_connect(&dir, &config);
        return Ok(());
    }
    if options.detach {
        let pid = spawn_detached(&dir, &config_path, &config)?;
        println!(
            "pgherd is running in the background (pid {pid}, log {}).",
            dir.join(LOG_FILE).display()
        );
        print_connect(&dir, &config);
        println!("Stop everything with: pgherd down --dir {}", dir.display());
        return Ok(());
    }
    crate::logging::init(&config.proxy);
    std::fs::write(dir.join(PID_FILE), std::process::id().to_string())
        .map_err(|e| format!("{}: {e}", dir.join(PID_FILE).display()))?;
    let rt = crate::runtime(config.proxy.workers)?;
    let served = rt.block_on(pgherd_proxy::serve(config.clone(), |_| {
        print_connect(&dir, &config);
        println!("Press Ctrl-C to stop pgherd and the cluster.");
    }));
    let _ = std::fs::remove_file(dir.join(PID_FILE));
    let stop_errors = cluster.stop_all(StopMode::Fast);
    for e in &stop_errors {
        eprintln!("pgherd: {e}");
    }
    served
}

fn create(dir: &Path, options: &UpOptions) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let passwords = Passwords {
        app: random_password(),
        superuser: random_password(),
    };
    let ports = (0..=options.replicas)
        .map(|_| free_port().map_err(|e| e.to_string()))
        .collect::<Result<Vec<u16>, String>>()?;
    println!(
        "Creating a primary and {} streaming replica(s) in {} ...",
        options.replicas,
        dir.display()
    );
    let cluster = LocalCluster::create(&ClusterSpec {
        dir: dir.to_owned(),
        ports,
        superuser: SUPERUSER.into(),
        superuser_password: passwords.superuser.clone(),
        settings: Vec::new(),
        template: None,
        netns: Vec::new(),
    })
    .map_err(|e| e.to_string())?;
    // The servers hold the very verifiers pgherd holds, so pgherd can pass a client's SCRAM
    // proof through instead of storing passwords.
    let app_verifier = verifier(&passwords.app);
    let superuser_verifier = verifier(&passwords.superuser);
    let primary = cluster.primary();
    let setup = [
        format!("CREATE ROLE {APP_USER} LOGIN PASSWORD '{app_verifier}'"),
        format!("CREATE DATABASE {APP_USER} OWNER {APP_USER}"),
        format!("ALTER ROLE {SUPERUSER} PASSWORD '{superuser_verifier}'"),
    ];
    for sql in &setup {
        primary.psql("postgres", sql).map_err(|e| e.to_string())?;
    }
    // Streaming replicas connect with the superuser's password; keep it unchanged for them.
    let config = render_config(
        &cluster,
        (options.port, options.api_port),
        &passwords,
        &app_verifier,
        &superuser_verifier,
    );
    passwords.save(dir)?;
    let path = dir.join(CONFIG_FILE);
    // It holds the superuser's password and the API token.
    pgherd_config::write_private_file(&path, &config)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Config::load(&path).map_err(|e| format!("the generated config is invalid (a bug): {e}"))?;
    Ok(())
}

/// `ports`: pgherd's and its HTTP API's.
fn render_config(
    cluster: &LocalCluster,
    (port, api_port): (u16, u16),
    passwords: &Passwords,
    app_verifier: &ScramVerifier,
    superuser_verifier: &ScramVerifier,
) -> String {
    let mut text = format!(
        "# Written by `pgherd up`. Edit freely; `pgherd check-config {CONFIG_FILE}` validates it.\n\n\
         [pgherd]\nlisten = [\"127.0.0.1:{port}\"]\nadmin_users = [\"{SUPERUSER}\"]\n\n\
         # How pgherd logs in to the nodes to watch them.\n\
         [cluster]\nuser = \"{SUPERUSER}\"\npassword = \"{}\"\n\n\
         # Health checks, metrics and JSON over HTTP; changes (switchover, rejoin) need the token.\n\
         [api]\nlisten = [\"127.0.0.1:{api_port}\"]\ntoken = \"{}\"\n\n",
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
            "[[nodes]]\nname = \"{}\"\nhost = \"127.0.0.1\"\nport = {}\ndata_dir = \"{data_dir}\"\n\n",
            node.name, node.port
        ));
    }
    text.push_str(&format!(
        "[pool]\nmode = \"transaction\"\nmax_size = 20\n\n\
         # Every database on the cluster, under its own name.\n[databases.\"*\"]\n\n\
         [users.{APP_USER}]\nscram = \"{app_verifier}\"\n\n\
         [users.{SUPERUSER}]\nscram = \"{superuser_verifier}\"\n\n\
         # No acknowledged commit exists on the primary alone while a replica streams.\n\
         [replication]\ndurability = \"sync\"\n\n\
         # A dead primary is replaced by the most advanced synchronous replica.\n\
         [failover]\nenabled = true\n\
         # The replaced primary, once it answers again, is rewound and follows the new one.\n\
         auto_rejoin = true\n"
    ));
    text
}

/// The local cluster described by a config written by `pgherd up`.
fn open_cluster(dir: &Path, config: &Config) -> Result<LocalCluster, String> {
    let nodes: Vec<(String, u16)> = config
        .nodes
        .iter()
        .filter(|n| n.data_dir.is_some())
        .map(|n| (n.name.clone(), n.port))
        .collect();
    if nodes.is_empty() {
        return Err(format!(
            "{} names no node with a data_dir that pgherd could start",
            config.source.display()
        ));
    }
    let password = config.cluster.password.clone().unwrap_or_default();
    LocalCluster::open(dir, &nodes, &config.cluster.user, &password).map_err(|e| e.to_string())
}

/// Says how to connect without printing a password: the passwords go to a libpq password
/// file next to the config (mode 0600), which the printed command names.
fn print_connect(dir: &Path, config: &Config) {
    let Some(listen) = config.proxy.listen.first() else {
        return;
    };
    let pgpass = dir.join(PGPASS_FILE);
    match Passwords::load(dir) {
        Some(passwords) => {
            if let Err(e) = passwords.save_pgpass(&pgpass, listen) {
                eprintln!("pgherd: cannot write {}: {e}", pgpass.display());
            }
            println!(
                "Connect:  PGPASSFILE={} psql \"postgres://{APP_USER}@{}:{}/{APP_USER}\"",
                pgpass.display(),
                listen.ip(),
                listen.port()
            );
            println!(
                "          (passwords of {APP_USER} and {SUPERUSER}: {}, readable only by you)",
                dir.join(PASSWORD_FILE).display()
            );
        }
        None => println!(
            "Connect:  psql \"postgres://{APP_USER}@{}:{}/{APP_USER}\"",
            listen.ip(),
            listen.port()
        ),
    }
    println!("Status:   pgherd status --dir {}", dir.display());
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    unsafe { libc::kill(pid, 0) == 0 }
}

fn running_pid(dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(dir.join(PID_FILE))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    pid_alive(pid).then_some(pid)
}

fn spawn_detached(dir: &Path, config_path: &Path, config: &Config) -> Result<i32, String> {
    use std::os::unix::process::CommandExt;
    let exe =
        std::env::current_exe().map_err(|e| format!("cannot find the pgherd executable: {e}"))?;
    let log_path = dir.join(LOG_FILE);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(|e| format!("{}: {e}", log_path.display()))?;
    let log_err = log.try_clone().map_err(|e| e.to_string())?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("run").arg("--config").arg(config_path);
    cmd.stdin(std::process::Stdio::null())
        .stdout(log)
        .stderr(log_err);
    // SAFETY: setsid is async-signal-safe; it detaches pgherd from this terminal's session.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("cannot start pgherd: {e}"))?;
    let pid = child.id() as i32;
    std::fs::write(dir.join(PID_FILE), pid.to_string()).map_err(|e| e.to_string())?;
    let listen = config
        .proxy
        .listen
        .first()
        .copied()
        .ok_or("no listen address")?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            let log = std::fs::read_to_string(&log_path).unwrap_or_default();
            let tail: Vec<&str> = log
                .lines()
                .rev()
                .take(15)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            return Err(format!(
                "pgherd exited ({status}) before it was ready:\n{}",
                tail.join("\n")
            ));
        }
        if TcpStream::connect_timeout(&listen, Duration::from_millis(200)).is_ok() {
            return Ok(pid);
        }
        if Instant::now() > deadline {
            return Err(format!(
                "pgherd did not listen on {listen} within 60 s; see {}",
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
    if let Some(pid) = running_pid(&dir) {
        // SAFETY: plain kill(2) on a pid read from our own pid file.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline =
            Instant::now() + Duration::from_millis(config.proxy.shutdown_timeout_ms + 5_000);
        while pid_alive(pid) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        if pid_alive(pid) {
            return Err(format!("pgherd (pid {pid}) did not stop"));
        }
        println!("pgherd (pid {pid}) stopped.");
    }
    let _ = std::fs::remove_file(dir.join(PID_FILE));
    let cluster = open_cluster(&dir, &config)?;
    let errors = cluster.stop_all(StopMode::Fast);
    if let Some(e) = errors.first() {
        return Err(e.to_string());
    }
    println!(
        "Nodes stopped: {}.",
        cluster
            .nodes
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[derive(Serialize)]
struct StatusReport {
    config: String,
    /// `pgherd` when the running pgherd answered (its HTTP API), `nodes` when pgherd is not
    /// running or has no `[api]` and the nodes were asked directly.
    source: &'static str,
    pgherd: ProxyStatus,
    nodes: Vec<NodeStatus>,
}

#[derive(Serialize)]
struct ProxyStatus {
    listen: Vec<String>,
    running: bool,
    pid: Option<i32>,
    /// The admin console, as a libpq URL for the `[cluster]` user (no password).
    console: Option<String>,
    /// The HTTP API's base URLs (`[api] listen`).
    api: Vec<String>,
}

#[derive(Serialize)]
struct NodeStatus {
    name: String,
    role: String,
    state: String,
    host: String,
    port: u16,
    data_dir: Option<String>,
    error: Option<String>,
    /// The primary's WAL insert position or a replica's replay position.
    lsn: Option<String>,
    /// How far a replica's replay is behind the primary's position, in bytes.
    lag_bytes: Option<u64>,
    /// The rest is known only from a running pgherd.
    lag_ms: Option<u64>,
    /// Writes go to this node now.
    takes_writes: Option<bool>,
    in_read_set: Option<bool>,
    /// Server connections pgherd holds to the node (in use and idle).
    server_connections: Option<u64>,
}

/// Runs `command` on the admin console of the pgherd configured by `dir` or `config_path`,
/// logging in as the `[cluster]` user (an admin user in configs `pgherd up` writes), and
/// prints its answer.
pub fn admin_command(at: &Where, command: &str) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let listen = config
        .proxy
        .listen
        .first()
        .ok_or_else(|| format!("{} has no listen address", path.display()))?;
    let address = connectable(*listen);
    let psql = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool("psql");
    let out = std::process::Command::new(&psql)
        .env(
            "PGPASSWORD",
            config.cluster.password.clone().unwrap_or_default(),
        )
        .args([
            "-X",
            "-h",
            &address.ip().to_string(),
            "-p",
            &address.port().to_string(),
            "-U",
            &config.cluster.user,
            "-d",
            "pgherd",
            "-c",
            command,
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", psql.display()))?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

pub fn status(at: &Where, json: bool) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let pid_dir = path.parent().unwrap_or(Path::new("/")).to_owned();
    let pid = running_pid(&pid_dir);
    let listening =
        config.proxy.listen.iter().any(|a| {
            TcpStream::connect_timeout(&connectable(*a), Duration::from_millis(500)).is_ok()
        });
    let from_pgherd = match config.api.listen.first() {
        Some(api) if listening => fetch_status(connectable(*api))
            .map_err(|e| eprintln!("pgherd's HTTP API did not answer ({e}); asking the nodes"))
            .ok(),
        _ => None,
    };
    let (source, nodes) = match from_pgherd {
        Some(answer) => ("pgherd", nodes_from_pgherd(&config, &answer)),
        None => ("nodes", crate::runtime(1)?.block_on(check_nodes(&config))),
    };
    let report = StatusReport {
        config: path.display().to_string(),
        source,
        pgherd: ProxyStatus {
            listen: config.proxy.listen.iter().map(|a| a.to_string()).collect(),
            running: listening,
            pid,
            console: config.proxy.listen.first().map(|a| {
                format!(
                    "postgres://{}@{}/pgherd",
                    config.cluster.user,
                    connectable(*a)
                )
            }),
            api: config
                .api
                .listen
                .iter()
                .map(|a| format!("http://{}", connectable(*a)))
                .collect(),
        },
        nodes,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?
        );
    } else {
        print_status(&report);
    }
    Ok(())
}

/// `pgherd events`: the running pgherd's event log, from its HTTP API.
pub fn events(at: &Where, json: bool) -> Result<(), String> {
    let path = at.config_path()?;
    let config = Config::load(&path).map_err(|e| e.to_string())?;
    let api = config.api.listen.first().ok_or_else(|| {
        format!(
            "{} has no [api] listen address; events are also on the admin console (SHOW EVENTS)",
            path.display()
        )
    })?;
    let events = fetch(connectable(*api), "/api/events")
        .map_err(|e| format!("pgherd's HTTP API at {api} did not answer: {e}"))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&events).map_err(|e| e.to_string())?
        );
        return Ok(());
    }
    for e in events.as_array().into_iter().flatten() {
        let at_s = e["at_epoch_s"].as_f64().unwrap_or(0.0);
        let millis = (at_s.fract() * 1000.0) as u32;
        let secs = at_s as i64;
        let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
        println!(
            "{h:02}:{m:02}:{s:02}.{millis:03} UTC  {:<16} {:<6} {}",
            e["kind"].as_str().unwrap_or(""),
            e["node"].as_str().unwrap_or(""),
            e["detail"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

/// `GET /api/status` from the running pgherd.
fn fetch_status(api: SocketAddr) -> Result<serde_json::Value, String> {
    fetch(api, "/api/status")
}

/// `GET path` from the running pgherd's HTTP API, as JSON.
fn fetch(api: SocketAddr, path: &str) -> Result<serde_json::Value, String> {
    ureq::get(&format!("http://{api}{path}"))
        .timeout(Duration::from_secs(3))
        .call()
        .map_err(|e| e.to_string())?
        .into_json()
        .map_err(|e| e.to_string())
}

/// The nodes as the running pgherd sees them.
fn nodes_from_pgherd(config: &Config, answer: &serde_json::Value) -> Vec<NodeStatus> {
    let rows = answer["nodes"].as_array().cloned().unwrap_or_default();
    let pools = answer["pools"].as_array().cloned().unwrap_or_default();
    rows.iter()
        .map(|n| {
            let name = n["name"].as_str().unwrap_or_default().to_owned();
            let connections = pools
                .iter()
                .filter(|p| p["node"].as_str() == Some(&name))
                .map(|p| p["sv_active"].as_u64().unwrap_or(0) + p["sv_idle"].as_u64().unwrap_or(0))
                .sum();
            let role = n["role"].as_str().unwrap_or("unknown").to_owned();
            NodeStatus {
                data_dir: config
                    .nodes
                    .iter()
                    .find(|c| c.name == name)
                    .and_then(|c| c.data_dir.as_ref())
                    .map(|d| d.display().to_string()),
                role: role.clone(),
                state: n["state"].as_str().unwrap_or("unknown").to_owned(),
                host: n["host"].as_str().unwrap_or_default().to_owned(),
                port: n["port"]
                    .as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .unwrap_or(0),
                error: n["last_error"].as_str().map(str::to_owned),
                lsn: n["lsn"].as_str().map(str::to_owned),
                lag_bytes: (role == "replica")
                    .then(|| n["lag_bytes"].as_u64())
                    .flatten(),
                lag_ms: (role == "replica").then(|| n["lag_ms"].as_u64()).flatten(),
                takes_writes: n["takes_writes"].as_bool(),
                in_read_set: n["in_read_set"].as_bool(),
                server_connections: Some(connections),
                name,
            }
        })
        .collect()
}

/// A wildcard listen address is reached through loopback.
fn connectable(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        let ip = if addr.is_ipv4() {
            std::net::IpAddr::from([127, 0, 0, 1])
        } else {
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST)
        };
        SocketAddr::new(ip, addr.port())
    } else {
        addr
    }
}

async fn check_nodes(config: &Config) -> Vec<NodeStatus> {
    let ctx = pgherd_proxy::pool::ConnectContext {
        tls_mode: config.server_tls.mode,
        tls: pgherd_proxy::tls::server_connector(&config.server_tls)
            .ok()
            .flatten(),
        next_server_id: Default::default(),
    };
    use pgherd_proxy::nodes::Role;
    use pgherd_route::balance::format_lsn;
    let registry = pgherd_proxy::nodes::Nodes::new(
        &config.nodes,
        pgherd_proxy::nodes::CheckThresholds {
            rejoin_after_checks: 1,
            failures_before_down: 1,
        },
    );
    let mut seen = Vec::new();
    for node in registry.all().iter() {
        let mut conn = None;
        seen.push(pgherd_proxy::nodes::check_once(node, &config.cluster, &ctx, &mut conn).await);
    }
    let primary_lsn = seen
        .iter()
        .filter_map(|s| s.as_ref().ok())
        .find(|s| s.role == Role::Primary)
        .map(|s| s.lsn);
    let mut out = Vec::new();
    for (node, outcome) in registry.all().iter().zip(seen) {
        let (role, state, error, lsn, lag_bytes) = match outcome {
            Ok(o) => (
                o.role.as_str().to_owned(),
                "up".to_owned(),
                None,
                Some(format_lsn(o.lsn)),
                match (o.role, primary_lsn) {
                    (Role::Replica, Some(p)) => Some(p.saturating_sub(o.lsn)),
                    _ => None,
                },
            ),
            Err(e) => ("unknown".to_owned(), "down".to_owned(), Some(e), None, None),
        };
        out.push(NodeStatus {
            name: node.config.name.clone(),
            role,
            state,
            host: node.config.host.clone(),
            port: node.config.port,
            data_dir: node
                .config
                .data_dir
                .as_ref()
                .map(|d| d.display().to_string()),
            error,
            lsn,
            lag_bytes,
            lag_ms: None,
            takes_writes: None,
            in_read_set: None,
            server_connections: None,
        });
    }
    out
}

fn print_status(report: &StatusReport) {
    println!(
        "pgherd  {}  listen {}{}",
        if report.pgherd.running {
            "running"
        } else {
            "not running"
        },
        report.pgherd.listen.join(", "),
        report
            .pgherd
            .pid
            .map(|p| format!("  pid {p}"))
            .unwrap_or_default()
    );
    if let Some(console) = &report.pgherd.console {
        println!("console {console}");
    }
    if !report.pgherd.api.is_empty() {
        println!("api     {}", report.pgherd.api.join(", "));
    }
    println!(
        "{}",
        if report.source == "pgherd" {
            "as pgherd sees the nodes:"
        } else {
            "pgherd did not answer over HTTP ([api]); the nodes as they answer directly:"
        }
    );
    println!();
    const COLUMNS: usize = 9;
    let header: [&str; COLUMNS] = [
        "NODE",
        "ROLE",
        "STATE",
        "WRITES",
        "READS",
        "ADDRESS",
        "LSN",
        "LAG",
        "CONNS / DATA DIR / ERROR",
    ];
    let yes_no = |b: Option<bool>| match b {
        Some(true) => "yes".to_owned(),
        Some(false) => "no".to_owned(),
        None => "?".to_owned(),
    };
    let rows: Vec<[String; COLUMNS]> = report
        .nodes
        .iter()
        .map(|n| {
            let lag = match (n.lag_bytes, n.lag_ms) {
                (Some(b), Some(ms)) => format!("{b} B / {ms} ms"),
                (Some(b), None) => format!("{b} B"),
                _ => String::new(),
            };
            let last = match (&n.error, n.server_connections) {
                (Some(e), _) => e.clone(),
                (None, Some(c)) => format!("{c} conns  {}", n.data_dir.clone().unwrap_or_default()),
                (None, None) => n.data_dir.clone().unwrap_or_default(),
            };
            [
                n.name.clone(),
                n.role.clone(),
                n.state.clone(),
                yes_no(n.takes_writes),
                yes_no(n.in_read_set),
                format!("{}:{}", n.host, n.port),
                n.lsn.clone().unwrap_or_default(),
                lag,
                last.trim_end().to_owned(),
            ]
        })
        .collect();
    let widths: Vec<usize> = (0..COLUMNS)
        .map(|i| {
            rows.iter()
                .map(|r| r[i].len())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let line = |cells: [&str; COLUMNS]| {
        cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_owned()
    };
    println!("{}", line(header));
    for r in &rows {
        println!("{}", line(std::array::from_fn(|i| r[i].as_str())));
    }
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
