//! repmgr (from the distribution) managing a bench cluster: the failover manager a HAProxy +
//! PgBouncer stack is run with in production, so that the failover run compares pgherd with a
//! peer that fails over too. Every node is registered, repmgrd watches each, and a dead
//! primary is replaced by a standby without anyone's help.

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use pgherd_cluster::{pg_command, run_command, LocalCluster, LocalNode};

use super::targets::BenchCluster;

/// repmgrd's detection, set as fast as it goes (its intervals are whole seconds): the primary
/// checked every second, given up after two failed reconnections a second apart. pgherd's own
/// defaults notice a dead primary after three failed checks 250 ms apart.
const MONITOR_INTERVAL_S: u32 = 1;
const RECONNECT_ATTEMPTS: u32 = 2;
const RECONNECT_INTERVAL_S: u32 = 1;

/// repmgrd on every node, stopped when dropped.
pub struct Repmgr {
    daemons: Vec<Child>,
}

impl Drop for Repmgr {
    fn drop(&mut self) {
        for daemon in &mut self.daemons {
            let _ = daemon.kill();
            let _ = daemon.wait();
        }
    }
}

/// What every node's configuration needs before it starts for repmgrd to watch it.
pub fn node_settings() -> Vec<(String, String)> {
    vec![("shared_preload_libraries".to_owned(), "'repmgr'".to_owned())]
}

/// Registers the cluster's nodes with repmgr (the primary first) and starts repmgrd on each.
pub fn start(cluster: &BenchCluster) -> Result<Repmgr, String> {
    let local = &cluster.cluster;
    let repmgr = local.binaries.tool("repmgr");
    if !repmgr.is_file() {
        return Err(format!(
            "repmgr is not installed (Debian: apt-get install postgresql-{}-repmgr)",
            local.binaries.major_version
        ));
    }
    let dir = cluster.dir.join("repmgr");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    give_to_postgres(local, &dir)?;
    let mut configs = Vec::new();
    for (k, node) in local.nodes.iter().enumerate() {
        let path = dir.join(format!("{}.conf", node.name));
        let login = (
            local.superuser.as_str(),
            cluster.superuser_password.as_str(),
        );
        let text = node_config((k + 1, node), login, &repmgr, &path);
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
        give_to_postgres(local, &path)?;
        configs.push(path);
    }
    for (k, config) in configs.iter().enumerate() {
        let role = if k == 0 { "primary" } else { "standby" };
        run_command(
            pg_command(&repmgr, local.run_as.as_ref(), None).args([
                "-f",
                &config.to_string_lossy(),
                role,
                "register",
            ]),
            &format!("repmgr {role} register"),
        )
        .map_err(|e| e.to_string())?;
    }
    let repmgrd = local.binaries.tool("repmgrd");
    let mut started = Repmgr {
        daemons: Vec::new(),
    };
    for (node, config) in local.nodes.iter().zip(&configs) {
        let log = dir.join(format!("{}-repmgrd.out", node.name));
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = pg_command(&repmgrd, local.run_as.as_ref(), None)
            .args(["-f", &config.to_string_lossy(), "--daemonize=false"])
            .stdout(out)
            .stderr(Stdio::from(err))
            .spawn()
            .map_err(|e| format!("cannot start repmgrd: {e}"))?;
        started.daemons.push(child);
    }
    Ok(started)
}

/// One node's repmgr.conf: automatic failover, promotion and following through repmgr itself.
fn node_config(
    (id, node): (usize, &LocalNode),
    (user, password): (&str, &str),
    repmgr: &Path,
    path: &Path,
) -> String {
    let log: PathBuf = path.with_extension("log");
    let (repmgr, config) = (repmgr.display(), path.display());
    format!(
        "node_id={id}\nnode_name='{name}'\n\
         conninfo='host={host} port={port} user={user} password={password} dbname=postgres connect_timeout=2'\n\
         data_directory='{data}'\npg_bindir='{bin}'\n\
         failover='automatic'\n\
         promote_command='{repmgr} standby promote -f {config} --log-to-file'\n\
         follow_command='{repmgr} standby follow -f {config} --log-to-file --upstream-node-id=%n'\n\
         monitor_interval_secs={MONITOR_INTERVAL_S}\nreconnect_attempts={RECONNECT_ATTEMPTS}\n\
         reconnect_interval={RECONNECT_INTERVAL_S}\n\
         log_file='{log}'\nrepmgrd_pid_file='{pid}'\n",
        name = node.name,
        host = node.host,
        port = node.port,
        data = node.data_dir.display(),
        bin = node.binaries.bin_dir.display(),
        log = log.display(),
        pid = path.with_extension("pid").display(),
    )
}

fn give_to_postgres(local: &LocalCluster, path: &Path) -> Result<(), String> {
    match &local.run_as {
        Some(user) => std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
            .map_err(|e| format!("{}: {e}", path.display())),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_fails_over_by_itself_through_repmgr() {
        let binaries = pgherd_cluster::PgBinaries {
            bin_dir: PathBuf::from("/usr/lib/postgresql/15/bin"),
            major_version: 15,
        };
        let node = LocalNode {
            name: "pg2".into(),
            host: "127.0.0.1".into(),
            netns: None,
            port: 5433,
            data_dir: PathBuf::from("/c/pg2"),
            log_file: PathBuf::from("/c/logs/pg2.log"),
            socket_dir: PathBuf::from("/c/run"),
            binaries,
            run_as: None,
            superuser: "postgres".into(),
        };
        let repmgr = Path::new("/usr/lib/postgresql/15/bin/repmgr");
        let text = node_config(
            (2, &node),
            ("postgres", "secret"),
            repmgr,
            Path::new("/c/repmgr/pg2.conf"),
        );
        let lines: Vec<&str> = text.lines().collect();
        for expected in [
            "node_id=2",
            "node_name='pg2'",
            "conninfo='host=127.0.0.1 port=5433 user=postgres password=secret dbname=postgres connect_timeout=2'",
            "data_directory='/c/pg2'",
            "failover='automatic'",
            "promote_command='/usr/lib/postgresql/15/bin/repmgr standby promote -f /c/repmgr/pg2.conf --log-to-file'",
            "follow_command='/usr/lib/postgresql/15/bin/repmgr standby follow -f /c/repmgr/pg2.conf --log-to-file --upstream-node-id=%n'",
            "reconnect_attempts=2",
            "log_file='/c/repmgr/pg2.log'",
        ] {
            assert!(lines.contains(&expected), "{expected} missing from\n{text}");
        }
    }
}
