//! `pgherd up --instances N`: N pgherd instances in front of the local cluster, agreeing
//! through a local one-member etcd (Debian's `etcd-server`) that `up` starts and `down` stops.
//! Instance 1 keeps `pgherd.toml`; instance k has `pgherd-k.toml`, listening on the port after
//! instance k-1's (and the same for the HTTP API). Each writes its pid and log next to its
//! config (`pgherd-k.pid`, `pgherd-k.log`); etcd keeps its data in `etcd/`, its settings in
//! `etcd.yml`, its pid in `etcd.pid`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use pgherd_cluster::free_port;

const ETCD_CONFIG: &str = "etcd.yml";
const ETCD_PID: &str = "etcd.pid";
const ETCD_LOG: &str = "etcd.log";
/// The scope the instances of one local cluster share.
const SCOPE: &str = "pgherd-local";

/// The extra instances' config files, in order (instance 2, 3, ...).
pub fn extra_configs(dir: &Path) -> Vec<PathBuf> {
    (2..)
        .map(|k| config_path(dir, k))
        .take_while(|p| p.exists())
        .collect()
}

/// Instance `k`'s config file (1-based; instance 1's is `pgherd.toml`).
pub fn config_path(dir: &Path, k: usize) -> PathBuf {
    if k == 1 {
        dir.join(super::CONFIG_FILE)
    } else {
        dir.join(format!("pgherd-{k}.toml"))
    }
}

/// The `[dcs]` section of instance `k` (1-based), with the local etcd's client port.
pub fn dcs_section(k: usize, etcd_client_port: u16) -> String {
    format!(
        "# Several pgherd instances agree through the local etcd `pgherd up` started.\n{}",
        dcs_settings(&instance_name(k), etcd_client_port, 5, 1000)
    )
}

/// Instance `k`'s name (1-based).
pub fn instance_name(k: usize) -> String {
    format!("pgherd-{k}")
}

/// A `[dcs]` section for an instance of the local scope reaching etcd on `etcd_port`.
pub fn dcs_settings(
    instance: &str,
    etcd_port: u16,
    lease_ttl_s: u64,
    request_timeout_ms: u64,
) -> String {
    format!(
        "[dcs]\nendpoints = [\"http://127.0.0.1:{etcd_port}\"]\nscope = \"{SCOPE}\"\n\
         instance = \"{instance}\"\nlease_ttl_s = {lease_ttl_s}\nrequest_timeout_ms = {request_timeout_ms}\n"
    )
}

/// Writes etcd's settings for a new local cluster; returns its client port.
pub fn create_etcd(dir: &Path) -> Result<u16, String> {
    let client = free_port().map_err(|e| e.to_string())?;
    let peer = free_port().map_err(|e| e.to_string())?;
    let text = format!(
        "name: {SCOPE}\ndata-dir: {}\n\
         listen-client-urls: http://127.0.0.1:{client}\nadvertise-client-urls: http://127.0.0.1:{client}\n\
         listen-peer-urls: http://127.0.0.1:{peer}\ninitial-advertise-peer-urls: http://127.0.0.1:{peer}\n\
         initial-cluster: {SCOPE}=http://127.0.0.1:{peer}\n",
        dir.join("etcd").display()
    );
    let path = dir.join(ETCD_CONFIG);
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(client)
}

/// The local etcd's pid, if it runs.
pub fn etcd_pid(dir: &Path) -> Option<i32> {
    super::running_pid_in(&dir.join(ETCD_PID))
}

/// The client port etcd.yml names.
pub fn etcd_client_port(dir: &Path) -> Result<u16, String> {
    let path = dir.join(ETCD_CONFIG);
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .find_map(|l| l.strip_prefix("listen-client-urls: http://127.0.0.1:"))
        .and_then(|p| p.trim().parse().ok())
        .ok_or_else(|| format!("{} names no client URL", path.display()))
}

/// Starts the local etcd unless it runs; returns once it accepts clients.
pub fn start_etcd(dir: &Path) -> Result<(), String> {
    let port = etcd_client_port(dir)?;
    if super::running_pid_in(&dir.join(ETCD_PID)).is_some() {
        return Ok(());
    }
    let etcd = ["/usr/bin/etcd", "/usr/local/bin/etcd"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or("`pgherd up --instances` needs etcd: install the Debian package etcd-server")?;
    let mut command = std::process::Command::new(etcd);
    command.arg("--config-file").arg(dir.join(ETCD_CONFIG));
    let pid = super::start_in_background(
        command,
        "etcd",
        &dir.join(ETCD_PID),
        &dir.join(ETCD_LOG),
        SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(30),
    )?;
    println!("etcd is running (pid {pid}, port {port}).");
    Ok(())
}

/// Stops the local etcd, if `up` started one.
pub fn stop_etcd(dir: &Path) -> Result<(), String> {
    let Some(pid) = super::running_pid_in(&dir.join(ETCD_PID)) else {
        return Ok(());
    };
    super::stop_process(pid, Duration::from_secs(10))
        .map_err(|e| format!("etcd (pid {pid}): {e}"))?;
    let _ = std::fs::remove_file(dir.join(ETCD_PID));
    println!("etcd (pid {pid}) stopped.");
    Ok(())
}
