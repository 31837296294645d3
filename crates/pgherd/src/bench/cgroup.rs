//! CPU quotas for benchmark nodes: each PostgreSQL node gets its own cgroup v1 `cpu` group so
//! that several nodes on one machine behave like separate small servers.

use std::path::{Path, PathBuf};

const CPU_ROOT: &str = "/sys/fs/cgroup/cpu";
/// A short period spreads a small quota evenly: 10 ms slices instead of one long stall per
/// 100 ms, so a node's latency does not depend on where in the period a query lands.
const PERIOD_US: u64 = 10_000;

/// A parent group with one child group per node; removed when dropped.
pub struct CpuQuotas {
    parent: PathBuf,
    groups: Vec<PathBuf>,
}

impl CpuQuotas {
    /// Creates `pgherd-bench-<pid>` under the cgroup v1 cpu hierarchy.
    pub fn new() -> Result<Self, String> {
        let root = Path::new(CPU_ROOT);
        if !root.join("cpu.cfs_quota_us").is_file() {
            return Err(format!(
                "{CPU_ROOT} is not a cgroup v1 cpu hierarchy; CPU quotas per node need it \
                 (or pass --cpu-quota-percent 0 to run without quotas)"
            ));
        }
        let parent = root.join(format!("pgherd-bench-{}", std::process::id()));
        std::fs::create_dir_all(&parent).map_err(|e| {
            format!(
                "cannot create {}: {e} (CPU quotas need root)",
                parent.display()
            )
        })?;
        Ok(CpuQuotas {
            parent,
            groups: Vec::new(),
        })
    }

    /// Puts the process tree of `postmaster_pid` (the postmaster and its children; backends
    /// forked later inherit the group) under a quota of `percent` of one core.
    pub fn confine(&mut self, name: &str, postmaster_pid: u32, percent: u32) -> Result<(), String> {
        let group = self.parent.join(name);
        std::fs::create_dir_all(&group).map_err(|e| format!("{}: {e}", group.display()))?;
        write(&group.join("cpu.cfs_period_us"), &PERIOD_US.to_string())?;
        write(
            &group.join("cpu.cfs_quota_us"),
            &(PERIOD_US * u64::from(percent) / 100).to_string(),
        )?;
        for pid in process_tree(postmaster_pid) {
            // A child may exit between listing and moving; that is not an error.
            let _ = std::fs::write(group.join("cgroup.procs"), pid.to_string());
        }
        self.groups.push(group);
        Ok(())
    }

    /// The group's enforcement periods so far and how many of them ran out of quota; a node
    /// throttled in most periods is saturated, so the node, not the client side, is the limit.
    pub fn periods(&self, name: &str) -> Option<Periods> {
        let text = std::fs::read_to_string(self.parent.join(name).join("cpu.stat")).ok()?;
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key)?.trim().parse::<u64>().ok())
        };
        Some(Periods {
            total: field("nr_periods ")?,
            throttled: field("nr_throttled ")?,
        })
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Periods {
    pub total: u64,
    pub throttled: u64,
}

impl Periods {
    /// The share of periods between `earlier` and `self` in which the quota ran out.
    pub fn throttled_since(self, earlier: Periods) -> Option<f64> {
        let total = self.total.checked_sub(earlier.total)?;
        let throttled = self.throttled.checked_sub(earlier.throttled)?;
        (total > 0).then(|| throttled as f64 / total as f64)
    }
}

impl Drop for CpuQuotas {
    /// Moves whatever still runs back to the root group, then removes the groups. A backend
    /// forked or exiting meanwhile makes removal fail with EBUSY, so it is retried.
    fn drop(&mut self) {
        let root_procs = Path::new(CPU_ROOT).join("cgroup.procs");
        for group in self.groups.iter().rev() {
            for _ in 0..50 {
                if let Ok(text) = std::fs::read_to_string(group.join("cgroup.procs")) {
                    for pid in text.lines() {
                        let _ = std::fs::write(&root_procs, pid);
                    }
                }
                if std::fs::remove_dir(group).is_ok() || !group.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
        if let Err(e) = std::fs::remove_dir(&self.parent) {
            eprintln!(
                "warning: cannot remove {}: {e}; remove it with rmdir",
                self.parent.display()
            );
        }
    }
}

fn write(path: &Path, value: &str) -> Result<(), String> {
    std::fs::write(path, value)
        .map_err(|e| format!("cannot write {value} to {}: {e}", path.display()))
}

/// `pid` and its direct children, from /proc. PostgreSQL's processes are all children of the
/// postmaster.
fn process_tree(pid: u32) -> Vec<u32> {
    let mut out = vec![pid];
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(child) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if parent_pid(child) == Some(pid) {
            out.push(child);
        }
    }
    out
}

fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may contain spaces; fields after it are plain.
    let after = &stat[stat.rfind(')')? + 1..];
    after.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_its_own_parent() {
        let me = std::process::id();
        let parent = parent_pid(me).expect("own stat is readable");
        assert!(process_tree(parent).contains(&me));
    }
}
