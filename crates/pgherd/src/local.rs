//! The embedded default: `pgherd up` builds a local cluster (a primary and streaming replicas)
//! on first run, writes a pgherd.toml for it and serves it; `pgherd down` stops it. Where its
//! directory is ([`local_dir`]) and which pgherd an operator command means ([`Where`]).

use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pgherd_cluster::{free_port, ClusterSpec, LocalCluster, StopMode};
use pgherd_config::Config;
use pgherd_wire::scram::{ScramVerifier, DEFAULT_ITERATIONS};

pub const DEFAULT_DIR: &str = "pgherd-local";
const CONFIG_FILE: &str = "pgherd.toml";
const PID_FILE: &str = "pgherd.pid";
const LOG_FILE: &str = "pgherd.log";
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
    // Replicas stream as a role that can replicate and nothing else.
    let replication_password = random_password();
    let cluster = LocalCluster::create(&ClusterSpec {
        dir: dir.to_owned(),
        ports,
        superuser: SUPERUSER.into(),
        superuser_password: passwords.superuser.clone(),
        settings: Vec::new(),
        template: None,
        netns: Vec::new(),
        replication_role: Some((REPLICATION_USER.into(), replication_password.clone())),
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
    let config = render_config(
        &cluster,
        (options.port, options.api_port),
        &passwords,
        &replication_password,
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
    replication_password: &str,
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

pub(crate) fn running_pid(dir: &Path) -> Option<i32> {
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
