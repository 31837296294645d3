//! One local PostgreSQL node: its data directory, port and log, and the programs that act on it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::binaries::PgBinaries;
use crate::command::{pg_command, run};
use crate::osuser::{hand_over, RunAs};
use crate::ClusterError;

/// Configuration files `pg_rewind` and `pg_basebackup` replace with the source's; a node that
/// rejoins keeps its own.
const OWN_FILES: &[&str] = &[
    "postgresql.conf",
    "postgresql.auto.conf",
    "pg_hba.conf",
    "pg_ident.conf",
];

/// Settings of a node's former role, dropped from its postgresql.auto.conf when it rejoins.
const ROLE_SETTINGS: &[&str] = &[
    "primary_conninfo",
    "primary_slot_name",
    "default_transaction_read_only",
    "synchronous_standby_names",
    "synchronous_commit",
];

/// The node's own configuration files in `dir` (each `None` when missing).
fn read_own_files(dir: &Path) -> Vec<(&'static str, Option<String>)> {
    OWN_FILES
        .iter()
        .map(|f| (*f, std::fs::read_to_string(dir.join(f)).ok()))
        .collect()
}

/// Writes `files` into `dir` (created if missing), handed to `run_as`; `drop_role_settings`
/// drops the former role's settings from postgresql.auto.conf.
fn write_own_files(
    dir: &Path,
    files: &[(&str, Option<String>)],
    drop_role_settings: bool,
    run_as: Option<&RunAs>,
) -> Result<(), ClusterError> {
    std::fs::create_dir_all(dir).map_err(|e| ClusterError::io(dir, e))?;
    for (file, text) in files {
        let Some(text) = text else { continue };
        let text = match *file == "postgresql.auto.conf" && drop_role_settings {
            true => text
                .lines()
                .filter(|l| {
                    let name = l.split('=').next().unwrap_or("").trim();
                    !ROLE_SETTINGS.contains(&name)
                })
                .map(|l| format!("{l}\n"))
                .collect(),
            false => text.clone(),
        };
        let path = dir.join(file);
        std::fs::write(&path, text).map_err(|e| ClusterError::io(&path, e))?;
        hand_over(&path, run_as, false)?;
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Waits for clients to disconnect.
    Smart,
    /// Disconnects clients and shuts down cleanly.
    Fast,
    /// Quits without a checkpoint, like a crash.
    Immediate,
}

impl StopMode {
    fn as_str(self) -> &'static str {
        match self {
            StopMode::Smart => "smart",
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        }
    }
}

#[derive(Debug, Clone)]
pub struct LocalNode {
    pub name: String,
    /// Where the node listens and others reach it: 127.0.0.1, or its address in `netns`.
    pub host: String,
    /// The network namespace its processes run in (fault drills cut its link).
    pub netns: Option<String>,
    pub port: u16,
    pub data_dir: PathBuf,
    pub log_file: PathBuf,
    pub socket_dir: PathBuf,
    pub binaries: PgBinaries,
    pub run_as: Option<RunAs>,
    pub superuser: String,
}

impl LocalNode {
    /// A node pgherd manages on this machine, laid out as [`crate::LocalCluster`] lays out its
    /// nodes: the log in `../logs/NAME.log` and the socket in `../run` next to the data
    /// directory. Run as the `postgres` OS user when pgherd runs as root.
    pub fn managed(
        name: &str,
        (host, port): (&str, u16),
        netns: Option<&str>,
        data_dir: &Path,
        superuser: &str,
    ) -> Result<LocalNode, ClusterError> {
        let parent = data_dir.parent().unwrap_or(Path::new("/"));
        Ok(LocalNode {
            name: name.to_owned(),
            host: host.to_owned(),
            netns: netns.map(str::to_owned),
            port,
            data_dir: data_dir.to_owned(),
            log_file: parent.join("logs").join(format!("{name}.log")),
            socket_dir: parent.join("run"),
            binaries: PgBinaries::find()?,
            run_as: crate::osuser::postgres_user()?,
            superuser: superuser.to_owned(),
        })
    }

    /// The WAL position of the latest checkpoint (after a clean stop: the shutdown checkpoint,
    /// the last record the node wrote), from `pg_controldata`.
    pub fn checkpoint_lsn(&self) -> Result<String, ClusterError> {
        let out = run(
            self.tool("pg_controldata").arg("-D").arg(&self.data_dir),
            &format!("reading the control file of node {}", self.name),
        )?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix("Latest checkpoint location:"))
            .map(|v| v.trim().to_owned())
            .ok_or_else(|| {
                ClusterError::Setup(format!(
                    "pg_controldata of node {} shows no latest checkpoint location",
                    self.name
                ))
            })
    }

    /// Makes the stopped node start as a standby streaming with `conninfo` (through `slot`,
    /// if any): `standby.signal` plus settings in postgresql.auto.conf.
    pub fn make_standby(&self, conninfo: &str, slot: Option<&str>) -> Result<(), ClusterError> {
        let signal = self.data_dir.join("standby.signal");
        std::fs::write(&signal, b"").map_err(|e| ClusterError::io(&signal, e))?;
        hand_over(&signal, self.run_as.as_ref(), false)?;
        let quote = |s: &str| format!("'{}'", s.replace('\'', "''"));
        let mut settings = vec![("primary_conninfo".to_owned(), quote(conninfo))];
        if let Some(slot) = slot {
            settings.push(("primary_slot_name".to_owned(), quote(slot)));
        }
        self.write_auto_settings(&settings)
    }

    /// Turns this stopped node, whose history may have diverged from `source` (a node that
    /// was a primary and was replaced), into a standby of it: `pg_rewind`, or a fresh
    /// `pg_basebackup` when rewinding fails (the old data directory is kept beside it as
    /// `NAME.before-rejoin`). The node's own configuration files survive either way; settings
    /// of its former role (`primary_conninfo`, `default_transaction_read_only`, ...) do not.
    /// Returns how it was done (the program, and why rewinding failed if it did).
    /// `source_conninfo` (for the programs; a superuser, as pg_rewind needs) holds no
    /// password: `password` reaches them through a password file. The standby then streams
    /// with `standby_conninfo` (password included; possibly another role).
    ///
    /// A rewind that does not finish (the source died under it, pgherd was killed) leaves the
    /// directory part the source's and part its own, which pg_rewind's manual calls beyond
    /// recovery: the node's own files are saved first in [`LocalNode::rewind_unfinished`]
    /// and, while that stands, a later rejoin copies the node afresh with its own files back
    /// rather than rewind it again; a failed attempt still leaves those files in place so the
    /// node starts on its port with its rules.
    pub fn rejoin(
        &self,
        source_conninfo: &str,
        password: Option<&str>,
        standby_conninfo: &str,
        slot: Option<&str>,
    ) -> Result<String, ClusterError> {
        let pass_file = password
            .map(|p| crate::PassFile::new(p, self.run_as.as_ref()))
            .transpose()?;
        let with_pass_file = |mut cmd: std::process::Command| {
            if let Some(file) = &pass_file {
                cmd.env("PGPASSFILE", file.path());
            }
            cmd
        };
        let unfinished = self.rewind_unfinished();
        let (saved, rewound) = if unfinished.is_dir() {
            let saved = read_own_files(&unfinished);
            let why = format!(
                "an earlier pg_rewind of node {} did not finish (its own files are in {})",
                self.name,
                unfinished.display()
            );
            (saved, Err(ClusterError::Setup(why)))
        } else {
            let saved = read_own_files(&self.data_dir);
            write_own_files(&unfinished, &saved, false, None)?;
            let rewound = run(
                with_pass_file(self.tool("pg_rewind"))
                    .arg("-D")
                    .arg(&self.data_dir)
                    .arg(format!("--source-server={source_conninfo}")),
                &format!("pg_rewind of node {}", self.name),
            );
            (saved, rewound)
        };
        let how = match rewound {
            Ok(_) => "pg_rewind".to_owned(),
            Err(rewind_error) => match self.copy_afresh(with_pass_file, source_conninfo) {
                Ok(()) => format!("pg_basebackup, as pg_rewind failed: {rewind_error}"),
                Err(copy_error) => {
                    write_own_files(&self.data_dir, &saved, false, self.run_as.as_ref())?;
                    return Err(ClusterError::Setup(format!(
                        "node {} could not rejoin: {rewind_error}; then {copy_error}",
                        self.name
                    )));
                }
            },
        };
        write_own_files(&self.data_dir, &saved, true, self.run_as.as_ref())?;
        std::fs::remove_dir_all(&unfinished).map_err(|e| ClusterError::io(&unfinished, e))?;
        self.make_standby(standby_conninfo, slot)?;
        Ok(how)
    }

    /// Where a rejoin keeps the node's own configuration files while its rewind has not
    /// finished (`NAME.rewind-unfinished`, beside the data directory); while it exists, the
    /// data directory is not to be trusted.
    pub fn rewind_unfinished(&self) -> PathBuf {
        self.data_dir.with_extension("rewind-unfinished")
    }

    /// Replaces the data directory with a `pg_basebackup` of the source, the old one kept as
    /// `NAME.before-rejoin` (and put back if the copy fails).
    fn copy_afresh(
        &self,
        with_pass_file: impl Fn(std::process::Command) -> std::process::Command,
        source_conninfo: &str,
    ) -> Result<(), ClusterError> {
        let aside = self.data_dir.with_extension("before-rejoin");
        if aside.exists() {
            std::fs::remove_dir_all(&aside).map_err(|e| ClusterError::io(&aside, e))?;
        }
        std::fs::rename(&self.data_dir, &aside).map_err(|e| ClusterError::io(&self.data_dir, e))?;
        let copied = run(
            with_pass_file(self.tool("pg_basebackup"))
                .arg("-d")
                .arg(source_conninfo)
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-X", "stream", "-c", "fast"]),
            &format!("pg_basebackup of node {}", self.name),
        );
        if let Err(copy_error) = copied {
            let _ = std::fs::remove_dir_all(&self.data_dir);
            std::fs::rename(&aside, &self.data_dir)
                .map_err(|e| ClusterError::io(&self.data_dir, e))?;
            return Err(copy_error);
        }
        Ok(())
    }

    pub(crate) fn tool(&self, name: &str) -> std::process::Command {
        pg_command(
            &self.binaries.tool(name),
            self.run_as.as_ref(),
            self.netns.as_deref(),
        )
    }

    /// Creates the data directory with `superuser` holding `password`; TCP logins need SCRAM,
    /// local socket logins (only the PostgreSQL OS user can reach the socket) are trusted.
    pub fn initdb(&self, superuser: &str, password: &str) -> Result<(), ClusterError> {
        let parent = self.data_dir.parent().unwrap_or(Path::new("/"));
        let pwfile = parent.join(format!(".{}.pw", self.name));
        {
            let mut f = std::fs::File::create(&pwfile).map_err(|e| ClusterError::io(&pwfile, e))?;
            f.write_all(password.as_bytes())
                .map_err(|e| ClusterError::io(&pwfile, e))?;
        }
        hand_over(&pwfile, self.run_as.as_ref(), false)?;
        let result = run(
            self.tool("initdb")
                .arg("-D")
                .arg(&self.data_dir)
                .arg("-U")
                .arg(superuser)
                .arg(format!("--pwfile={}", pwfile.display()))
                .args([
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                    "-E",
                    "UTF8",
                    "--locale=C.UTF-8",
                ]),
            &format!("initdb for node {}", self.name),
        );
        let _ = std::fs::remove_file(&pwfile);
        result.map(|_| ())
    }

    /// Makes the data directory a copy of an initdb'ed template.
    pub fn copy_from(&self, template: &Path) -> Result<(), ClusterError> {
        run(
            std::process::Command::new("cp")
                .arg("-a")
                .arg(template)
                .arg(&self.data_dir),
            &format!("copying the template into node {}", self.name),
        )?;
        hand_over(&self.data_dir, self.run_as.as_ref(), true)
    }

    fn append(&self, file: &str, settings: &[(String, String)]) -> Result<(), ClusterError> {
        let path = self.data_dir.join(file);
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| ClusterError::io(&path, e))?;
        let mut text = String::from("\n# written by pgherd\n");
        for (k, v) in settings {
            text.push_str(&format!("{k} = {v}\n"));
        }
        f.write_all(text.as_bytes())
            .map_err(|e| ClusterError::io(&path, e))
    }

    /// Appends settings to postgresql.conf.
    pub fn write_settings(&self, settings: &[(String, String)]) -> Result<(), ClusterError> {
        self.append("postgresql.conf", settings)
    }

    /// Appends settings to postgresql.auto.conf, which overrides postgresql.conf.
    pub fn write_auto_settings(&self, settings: &[(String, String)]) -> Result<(), ClusterError> {
        self.append("postgresql.auto.conf", settings)
    }

    pub fn start(&self, timeout: Duration) -> Result<(), ClusterError> {
        run(
            self.tool("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .arg("-l")
                .arg(&self.log_file)
                .args(["-w", "-t", &timeout.as_secs().to_string(), "start"]),
            &format!(
                "starting node {} (log: {})",
                self.name,
                self.log_file.display()
            ),
        )
        .map(|_| ())
    }

    pub fn stop(&self, mode: StopMode) -> Result<(), ClusterError> {
        run(
            self.tool("pg_ctl").arg("-D").arg(&self.data_dir).args([
                "-m",
                mode.as_str(),
                "-w",
                "-t",
                "60",
                "stop",
            ]),
            &format!("stopping node {}", self.name),
        )
        .map(|_| ())
    }

    pub fn is_running(&self) -> bool {
        self.tool("pg_ctl")
            .arg("-D")
            .arg(&self.data_dir)
            .arg("status")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// The postmaster's process id, from postmaster.pid.
    pub fn postmaster_pid(&self) -> Option<u32> {
        let text = std::fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        text.lines().next()?.trim().parse().ok()
    }

    /// Lets TCP logins (SCRAM) and replication in from `cidr` besides loopback.
    pub fn allow_hosts(&self, cidr: &str) -> Result<(), ClusterError> {
        let path = self.data_dir.join("pg_hba.conf");
        let mut hba = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| ClusterError::io(&path, e))?;
        writeln!(
            hba,
            "host all all {cidr} scram-sha-256\nhost replication all {cidr} scram-sha-256"
        )
        .map_err(|e| ClusterError::io(&path, e))
    }

    /// Clones `primary` into this node's data directory as a streaming replica. The password
    /// reaches pg_basebackup through a password file and the standby through its
    /// `primary_conninfo`.
    pub fn basebackup(
        &self,
        primary: &LocalNode,
        user: &str,
        password: &str,
    ) -> Result<(), ClusterError> {
        let pass_file = crate::PassFile::new(password, self.run_as.as_ref())?;
        let conninfo = format!(
            "host={} port={} user={}",
            crate::conninfo_value(&primary.host),
            primary.port,
            crate::conninfo_value(user)
        );
        run(
            self.tool("pg_basebackup")
                .env("PGPASSFILE", pass_file.path())
                .arg("-d")
                .arg(&conninfo)
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-X", "stream", "-c", "fast"]),
            &format!("pg_basebackup of node {} from {}", self.name, primary.name),
        )?;
        // Not `-R`: it would point primary_conninfo at the password file, which goes away.
        self.make_standby(&crate::with_password(&conninfo, Some(password)), None)
    }

    /// Runs SQL as the superuser over the node's local socket; returns unaligned rows.
    pub fn psql(&self, database: &str, sql: &str) -> Result<String, ClusterError> {
        let out = run(
            self.tool("psql")
                .args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-h"])
                .arg(&self.socket_dir)
                .args([
                    "-p",
                    &self.port.to_string(),
                    "-U",
                    &self.superuser,
                    "-d",
                    database,
                    "-c",
                    sql,
                ]),
            &format!("psql on node {}", self.name),
        )?;
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    /// Promotes a replica and waits for it to accept writes.
    pub fn promote(&self) -> Result<(), ClusterError> {
        run(
            self.tool("pg_ctl")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-w", "promote"]),
            &format!("promoting node {}", self.name),
        )
        .map(|_| ())
    }
}
