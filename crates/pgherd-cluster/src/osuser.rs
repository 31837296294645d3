//! The unprivileged OS user PostgreSQL runs as when pgherd is started as root.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::command::run;
use crate::ClusterError;

#[derive(Debug, Clone)]
pub struct RunAs {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// `None` when not running as root (PostgreSQL then runs as the current user). As root: the
/// `postgres` user, or a `pgherd` system user created for the purpose.
pub fn postgres_user() -> Result<Option<RunAs>, ClusterError> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Ok(None);
    }
    for name in ["postgres", "pgherd"] {
        if let Some(user) = lookup(name) {
            return Ok(Some(user));
        }
    }
    run(
        Command::new("useradd").args([
            "--system",
            "--user-group",
            "--no-create-home",
            "--home-dir",
            "/nonexistent",
            "--shell",
            "/usr/sbin/nologin",
            "pgherd",
        ]),
        "creating the pgherd OS user for PostgreSQL",
    )?;
    lookup("pgherd").map(Some).ok_or_else(|| {
        ClusterError::Setup("created the pgherd OS user but cannot look it up".into())
    })
}

fn lookup(name: &str) -> Option<RunAs> {
    let cname = CString::new(name).ok()?;
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: all pointers refer to live, correctly sized buffers for the duration of the call.
    let rc = unsafe {
        libc::getpwnam_r(
            cname.as_ptr(),
            &mut pwd,
            buf.as_mut_ptr(),
            buf.len(),
            &mut result,
        )
    };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: getpwnam_r succeeded, so pw_dir points into `buf`, NUL-terminated.
    let home = unsafe { CStr::from_ptr(pwd.pw_dir) }
        .to_string_lossy()
        .into_owned();
    Some(RunAs {
        name: name.to_owned(),
        uid: pwd.pw_uid,
        gid: pwd.pw_gid,
        home: PathBuf::from(home),
    })
}

/// Gives `path` (and everything below it, if `recursive`) to the PostgreSQL user.
pub fn hand_over(path: &Path, run_as: Option<&RunAs>, recursive: bool) -> Result<(), ClusterError> {
    let Some(user) = run_as else {
        return Ok(());
    };
    let mut cmd = Command::new("chown");
    if recursive {
        cmd.arg("-R");
    }
    cmd.arg(format!("{}:{}", user.uid, user.gid)).arg(path);
    run(
        &mut cmd,
        &format!("handing {} to the {} OS user", path.display(), user.name),
    )?;
    Ok(())
}

/// Fails with advice if the PostgreSQL user cannot write to `dir` (a parent directory such as
/// /root may be closed to other users).
pub fn check_reachable(dir: &Path, run_as: Option<&RunAs>) -> Result<(), ClusterError> {
    let Some(user) = run_as else {
        return Ok(());
    };
    let mut cmd = crate::command::pg_command(Path::new("/usr/bin/test"), Some(user), None);
    cmd.arg("-w").arg(dir);
    let ok = cmd.status().map(|s| s.success()).unwrap_or(false);
    if ok {
        Ok(())
    } else {
        Err(ClusterError::Setup(format!(
            "PostgreSQL runs as the OS user {} (it refuses to run as root), and that user cannot \
             write to {}: a parent directory is probably closed to other users. Choose a \
             directory it can reach, e.g. --dir /var/tmp/pgherd.",
            user.name,
            dir.display()
        )))
    }
}
