//! Running PostgreSQL's programs with errors that say what failed and why.

use std::process::{Command, Output, Stdio};

use crate::osuser::RunAs;
use crate::ClusterError;

/// Environment variables that would change where PostgreSQL's tools connect.
const PG_ENV: &[&str] = &[
    "PGHOST",
    "PGHOSTADDR",
    "PGPORT",
    "PGDATABASE",
    "PGUSER",
    "PGPASSWORD",
    "PGPASSFILE",
    "PGSERVICE",
    "PGSSLMODE",
    "PGOPTIONS",
    "PGAPPNAME",
    "PGDATA",
];

/// What systemd gives the service it starts: a program pgherd runs must not notify systemd or
/// feed its watchdog in pgherd's name (PostgreSQL built for systemd would say READY=1).
pub const SERVICE_MANAGER_ENV: &[&str] = &["NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// A command for `program`, run as `run_as` when set, with a clean PostgreSQL environment;
/// inside network namespace `netns` when set (through `ip netns exec`, then `setpriv` to drop
/// to `run_as`, since entering a namespace needs the root the uid change gives up).
pub fn pg_command(
    program: &std::path::Path,
    run_as: Option<&RunAs>,
    netns: Option<&str>,
) -> Command {
    let mut cmd = match netns {
        None => Command::new(program),
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]);
            if let Some(user) = run_as {
                cmd.arg("setpriv")
                    .arg(format!("--reuid={}", user.uid))
                    .arg(format!("--regid={}", user.gid))
                    .args(["--clear-groups", "--"]);
            }
            cmd.arg(program);
            cmd
        }
    };
    for var in PG_ENV.iter().chain(SERVICE_MANAGER_ENV) {
        cmd.env_remove(var);
    }
    cmd.env("LC_ALL", "C.UTF-8");
    if let Some(user) = run_as {
        use std::os::unix::process::CommandExt;
        if netns.is_none() {
            // std drops root's supplementary groups when it changes the uid.
            cmd.uid(user.uid).gid(user.gid);
        }
        cmd.env("HOME", &user.home);
        cmd.env("USER", &user.name);
    }
    cmd.stdin(Stdio::null());
    cmd
}

/// Runs to completion; a non-zero exit is an error carrying the end of stderr.
pub fn run(cmd: &mut Command, what: &str) -> Result<Output, ClusterError> {
    let out = cmd.output().map_err(|e| ClusterError::Command {
        what: what.to_owned(),
        detail: format!("cannot start {:?}: {e}", cmd.get_program()),
    })?;
    if out.status.success() {
        return Ok(out);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let text = if stderr.trim().is_empty() {
        stdout
    } else {
        stderr
    };
    let tail: Vec<&str> = text.lines().rev().take(12).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(ClusterError::Command {
        what: what.to_owned(),
        detail: format!("{} ({})", tail.join("\n"), out.status),
    })
}
