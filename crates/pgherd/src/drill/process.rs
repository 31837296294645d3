//! Faults on processes: PostgreSQL's postmasters and their children, signalled, reaped and
//! started again.

use std::time::{Duration, Instant};

use pgherd_cluster::{LocalNode, StopMode};

use super::RECOVERY_TIMEOUT;

pub fn postmaster_pid(node: &LocalNode) -> Result<u32, String> {
    node.postmaster_pid()
        .ok_or_else(|| format!("node {} has no postmaster.pid", node.name))
}

/// The postmaster and its children.
pub fn node_pids(node: &LocalNode) -> Result<Vec<u32>, String> {
    let postmaster = postmaster_pid(node)?;
    let mut pids = vec![postmaster];
    let out = std::process::Command::new("pgrep")
        .args(["-P", &postmaster.to_string()])
        .output()
        .map_err(|e| format!("pgrep: {e}"))?;
    pids.extend(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u32>().ok()),
    );
    Ok(pids)
}

/// Waits until a killed postmaster is gone, reaping it (the drill adopted it). One that stays
/// a zombie anyway still holds its lock files in PostgreSQL's eyes: they are removed so the
/// node can start again.
pub async fn wait_gone(node: &LocalNode, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // SAFETY: waitpid on one process id with WNOHANG; it only reaps that process.
        unsafe {
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG);
        }
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return,
            Ok(stat) => {
                // "pid (comm) S ...": the state follows the command name.
                let state = stat
                    .rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next());
                if state == Some("Z") {
                    let socket = format!(".s.PGSQL.{}", node.port);
                    for file in [
                        node.data_dir.join("postmaster.pid"),
                        node.socket_dir.join(format!("{socket}.lock")),
                        node.socket_dir.join(socket),
                    ] {
                        let _ = std::fs::remove_file(file);
                    }
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn signal(pid: u32, sig: libc::c_int) -> Result<(), String> {
    // SAFETY: kill(2) on a PostgreSQL process of the drill's own cluster.
    if unsafe { libc::kill(pid as libc::pid_t, sig) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "cannot signal process {pid}: {}",
            std::io::Error::last_os_error()
        ))
    }
}

pub async fn blocking_start(node: &LocalNode) -> Result<(), String> {
    let node = node.clone();
    tokio::task::spawn_blocking(move || node.start(RECOVERY_TIMEOUT))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

pub async fn blocking_stop(node: &LocalNode, mode: StopMode) -> Result<(), String> {
    let node = node.clone();
    tokio::task::spawn_blocking(move || node.stop(mode))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}
