//! Finding PostgreSQL's server programs on this machine.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ClusterError;

#[derive(Debug, Clone)]
pub struct PgBinaries {
    pub bin_dir: PathBuf,
    /// Major version, e.g. 15.
    pub major_version: u32,
}

const TOOLS: &[&str] = &[
    "initdb",
    "pg_ctl",
    "pg_basebackup",
    "pg_controldata",
    "pg_rewind",
    "postgres",
    "psql",
];

const INSTALL_HINT: &str = "Install them, e.g. `apt-get install postgresql` on Debian or Ubuntu \
    (`dnf install postgresql-server` on Fedora), or point PGHERD_PG_BIN at their directory.";

impl PgBinaries {
    /// Looks in `$PGHERD_PG_BIN`, then `pg_config --bindir`, then `/usr/lib/postgresql/*/bin`
    /// (newest version first).
    pub fn find() -> Result<PgBinaries, ClusterError> {
        if let Some(dir) = std::env::var_os("PGHERD_PG_BIN") {
            // An explicit choice is final: silently using other binaries would surprise.
            let dir = PathBuf::from(dir);
            return match TOOLS.iter().find(|t| !dir.join(t).is_file()) {
                None => Ok(PgBinaries {
                    major_version: version_of(&dir.join("postgres")).unwrap_or(0),
                    bin_dir: dir,
                }),
                Some(missing) => Err(ClusterError::NotInstalled(format!(
                    "PGHERD_PG_BIN is {} but it has no {missing}. {INSTALL_HINT}",
                    dir.display()
                ))),
            };
        }
        let mut candidates: Vec<PathBuf> = Vec::new();
        if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
            if out.status.success() {
                candidates.push(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()));
            }
        }
        let mut versioned: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let version = e.file_name().to_string_lossy().parse::<u32>().ok()?;
                Some((version, e.path().join("bin")))
            })
            .collect();
        versioned.sort_by_key(|v| std::cmp::Reverse(v.0));
        candidates.extend(versioned.into_iter().map(|(_, p)| p));
        for dir in candidates {
            if TOOLS.iter().all(|t| dir.join(t).is_file()) {
                let major_version = version_of(&dir.join("postgres")).unwrap_or(0);
                return Ok(PgBinaries {
                    bin_dir: dir,
                    major_version,
                });
            }
        }
        Err(ClusterError::NotInstalled(format!(
            "PostgreSQL server programs (initdb, pg_ctl, pg_basebackup, pg_controldata, pg_rewind, postgres, psql) were not \
             found by `pg_config --bindir` or in /usr/lib/postgresql/*/bin. {INSTALL_HINT}"
        )))
    }

    pub fn tool(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }
}

fn version_of(postgres: &Path) -> Option<u32> {
    let out = Command::new(postgres).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "postgres (PostgreSQL) 15.18 (Debian ...)"
    let version = text.split_whitespace().nth(2)?;
    version.split('.').next()?.parse().ok()
}
