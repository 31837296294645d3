//! Passwords for the PostgreSQL programs pgherd runs, kept off their command lines and out of
//! their environment: a libpq password file for one command, and conninfo quoting.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::osuser::{hand_over, RunAs};
use crate::ClusterError;

/// A password file in libpq's format for one command (`PGPASSFILE`), readable only by the OS
/// user the command runs as, and removed when dropped.
pub struct PassFile {
    path: PathBuf,
}

impl PassFile {
    pub fn new(password: &str, run_as: Option<&RunAs>) -> Result<PassFile, ClusterError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "pgherd-passfile-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let mut file = std::fs::OpenOptions::new()
            .create_new(true)
            .write(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| ClusterError::io(&path, e))?;
        let pass_file = PassFile { path };
        file.write_all(passfile_line(password).as_bytes())
            .map_err(|e| ClusterError::io(&pass_file.path, e))?;
        hand_over(&pass_file.path, run_as, false)?;
        Ok(pass_file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for PassFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// One line matching any host, port, database and user (the file serves one command).
/// A field of a libpq password file: `\` and `:` escaped.
pub fn passfile_field(value: &str) -> String {
    value.replace('\\', "\\\\").replace(':', "\\:")
}

fn passfile_line(password: &str) -> String {
    format!("*:*:*:*:{}\n", passfile_field(password))
}

/// A libpq connection-string value, quoted when it needs to be.
pub fn conninfo_value(s: &str) -> String {
    if !s.is_empty() && !s.contains([' ', '\'', '\\']) {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// `conninfo` with ` password=...` appended when there is one.
pub fn with_password(conninfo: &str, password: Option<&str>) -> String {
    match password {
        Some(password) => format!("{conninfo} password={}", conninfo_value(password)),
        None => conninfo.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(conninfo_value("pg1"), "pg1");
        assert_eq!(conninfo_value("a b'c"), "'a b\\'c'");
        assert_eq!(conninfo_value(""), "''");
        assert_eq!(passfile_line("a:b\\c"), "*:*:*:*:a\\:b\\\\c\n");
        assert_eq!(
            with_password("host=h", Some("p w")),
            "host=h password='p w'"
        );
    }

    #[test]
    fn a_pass_file_is_private_and_goes_away() {
        use std::os::unix::fs::MetadataExt;
        let file = PassFile::new("secret", None).unwrap();
        let path = file.path().to_owned();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "*:*:*:*:secret\n");
        drop(file);
        assert!(!path.exists());
    }
}
