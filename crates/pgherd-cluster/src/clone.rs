//! A new standby cloned from any node of a cluster with `pg_basebackup`: from the primary, or
//! from a standby, which the copy then streams from (cascading replication).

use std::io::Read;
use std::process::Stdio;
use std::time::Duration;

use crate::node::LocalNode;
use crate::ClusterError;

/// Where a clone streams from, and as whom.
pub struct CloneSource<'a> {
    pub name: &'a str,
    pub host: &'a str,
    pub port: u16,
    /// A role with the REPLICATION attribute, and its password.
    pub user: &'a str,
    pub password: Option<&'a str>,
    /// The physical replication slot made for the clone on the source.
    pub slot: &'a str,
}

impl LocalNode {
    /// Copies `source` into this node's data directory (which must not exist yet), makes it a
    /// standby streaming from `source` through its slot under this node's name, and starts
    /// it. `progress` hears pg_basebackup's progress as it goes: kB copied, kB in all.
    pub fn clone_from(
        &self,
        source: &CloneSource,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<(), ClusterError> {
        if self.data_dir.exists() {
            return Err(ClusterError::Setup(format!(
                "{} exists already: a clone starts from an empty directory",
                self.data_dir.display()
            )));
        }
        let conninfo = format!(
            "host={} port={} user={}",
            crate::conninfo_value(source.host),
            source.port,
            crate::conninfo_value(source.user)
        );
        let what = format!("pg_basebackup of node {} from {}", self.name, source.name);
        let pass_file = source
            .password
            .map(|p| crate::PassFile::new(p, self.run_as.as_ref()))
            .transpose()?;
        let mut command = self.tool("pg_basebackup");
        if let Some(file) = &pass_file {
            command.env("PGPASSFILE", file.path());
        }
        command
            .arg("-d")
            .arg(&conninfo)
            .arg("-D")
            .arg(&self.data_dir)
            .args(["-X", "stream", "-c", "fast", "-P"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().map_err(|e| ClusterError::Command {
            what: what.clone(),
            detail: format!("cannot start pg_basebackup: {e}"),
        })?;
        let said = follow_progress(child.stderr.take(), progress);
        let status = child.wait().map_err(|e| ClusterError::Command {
            what: what.clone(),
            detail: e.to_string(),
        })?;
        if !status.success() {
            return Err(ClusterError::Command {
                what,
                detail: format!("{said} ({status})"),
            });
        }
        // The copy keeps the source's settings (a standby needs max_connections and the like
        // at least as high as its primary's) but not what names the node and where it
        // listens, nor where the source itself streamed from: overridden below (the last
        // setting of a name in a file counts).
        const OWN: [&str; 5] = [
            "listen_addresses",
            "port",
            "unix_socket_directories",
            "unix_socket_permissions",
            "cluster_name",
        ];
        let mut settings: Vec<(String, String)> = crate::node_settings(self, &[])
            .into_iter()
            .filter(|(name, _)| OWN.contains(&name.as_str()))
            .collect();
        settings.push(("primary_slot_name".into(), format!("'{}'", source.slot)));
        self.write_auto_settings(&settings)?;
        let stream_as = format!(
            "{conninfo} application_name={}",
            crate::conninfo_value(&self.name)
        );
        self.make_standby(
            &crate::with_password(&stream_as, source.password),
            Some(source.slot),
        )?;
        self.start(Duration::from_secs(120)).map_err(|e| {
            // What the server said is in its log: the caller's user should not have to look.
            let log = std::fs::read_to_string(&self.log_file).unwrap_or_default();
            let lines: Vec<&str> = log.lines().collect();
            let tail = lines[lines.len().saturating_sub(6)..].join("\n");
            ClusterError::Setup(format!("{e}\n{tail}"))
        })
    }
}

/// Reads pg_basebackup's standard error to its end, passing each progress report (`123/456
/// kB (26%), ...`, ended by a carriage return) to `progress`; the last lines of anything else
/// it said, for an error.
fn follow_progress(
    stderr: Option<std::process::ChildStderr>,
    progress: &mut dyn FnMut(u64, u64),
) -> String {
    let Some(mut stderr) = stderr else {
        return String::new();
    };
    let mut said: Vec<String> = Vec::new();
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match stderr.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        for &byte in &buf[..n] {
            if byte != b'\r' && byte != b'\n' {
                line.push(byte);
                continue;
            }
            let text = String::from_utf8_lossy(&line).trim().to_owned();
            line.clear();
            match parse_progress(&text) {
                Some((done, total)) => progress(done, total),
                None if !text.is_empty() => said.push(text),
                None => {}
            }
        }
    }
    let from = said.len().saturating_sub(8);
    said[from..].join("\n")
}

/// `1234/5678 kB (21%), 0/1 tablespace` → (1234, 5678).
fn parse_progress(text: &str) -> Option<(u64, u64)> {
    let (counts, _) = text.split_once(" kB")?;
    let (done, total) = counts.split_once('/')?;
    Some((done.trim().parse().ok()?, total.trim().parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_reports_read() {
        assert_eq!(
            parse_progress("22860/22860 kB (100%), 1/1 tablespace"),
            Some((22860, 22860))
        );
        assert_eq!(
            parse_progress("  1024/22860 kB (4%), 0/1 tablespace (...)"),
            Some((1024, 22860))
        );
        assert_eq!(
            parse_progress("pg_basebackup: error: connection failed"),
            None
        );
    }
}
