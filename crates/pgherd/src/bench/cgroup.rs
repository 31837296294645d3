//! cgroup v1 groups for benchmark nodes: each PostgreSQL node gets its own `cpu` group (a CPU
//! quota) and, for data larger than memory, its own `memory` group (a cap that counts the
//! node's page cache), so that several nodes on one machine behave like separate small servers.

use std::path::{Path, PathBuf};

const CPU_ROOT: &str = "/sys/fs/cgroup/cpu";
const MEMORY_ROOT: &str = "/sys/fs/cgroup/memory";
/// A short period spreads a small quota evenly: 10 ms slices instead of one long stall per
/// 100 ms, so a node's latency does not depend on where in the period a query lands.
const PERIOD_US: u64 = 10_000;

/// A parent group under one controller's hierarchy with one child group per node; removed
/// when dropped.
struct Groups {
    root: &'static str,
    parent: PathBuf,
    groups: Vec<PathBuf>,
}

impl Groups {
    /// Creates `pgherd-bench-<pid>` under `root`, whose file `probe` shows it is a cgroup v1
    /// hierarchy of the controller wanted.
    fn new(root: &'static str, probe: &str, what: &str) -> Result<Self, String> {
        if !Path::new(root).join(probe).is_file() {
            return Err(format!(
                "{root} is not a cgroup v1 hierarchy with {probe}; {what} per node need it"
            ));
        }
        let parent = Path::new(root).join(format!("pgherd-bench-{}", std::process::id()));
        std::fs::create_dir_all(&parent)
            .map_err(|e| format!("cannot create {}: {e} ({what} need root)", parent.display()))?;
        Ok(Groups {
            root,
            parent,
            groups: Vec::new(),
        })
    }

    /// Puts the process tree of `postmaster_pid` (the postmaster and its children; backends
    /// forked later inherit the group) into a group `name` with `limits` (file, value).
    fn confine(
        &mut self,
        name: &str,
        postmaster_pid: u32,
        limits: &[(&str, String)],
    ) -> Result<(), String> {
        let group = self.parent.join(name);
        std::fs::create_dir_all(&group).map_err(|e| format!("{}: {e}", group.display()))?;
        for (file, value) in limits {
            write(&group.join(file), value)?;
        }
        for pid in process_tree(postmaster_pid) {
            // A child may exit between listing and moving; that is not an error.
            let _ = std::fs::write(group.join("cgroup.procs"), pid.to_string());
        }
        self.groups.push(group);
        Ok(())
    }

    fn read(&self, name: &str, file: &str) -> Option<String> {
        std::fs::read_to_string(self.parent.join(name).join(file)).ok()
    }
}

/// Every node under a CPU quota.
pub struct CpuQuotas(Groups);

impl CpuQuotas {
    pub fn new() -> Result<Self, String> {
        Groups::new(CPU_ROOT, "cpu.cfs_quota_us", "CPU quotas").map(CpuQuotas)
    }

    /// The node's processes under a quota of `percent` of one core.
    pub fn confine(&mut self, name: &str, postmaster_pid: u32, percent: u32) -> Result<(), String> {
        let quota_us = PERIOD_US * u64::from(percent) / 100;
        self.0.confine(
            name,
            postmaster_pid,
            &[
                ("cpu.cfs_period_us", PERIOD_US.to_string()),
                ("cpu.cfs_quota_us", quota_us.to_string()),
            ],
        )
    }

    /// The group's enforcement periods so far and how many of them ran out of quota; a node
    /// throttled in most periods is saturated, so the node, not the client side, is the limit.
    pub fn periods(&self, name: &str) -> Option<Periods> {
        let text = self.0.read(name, "cpu.stat")?;
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

/// Every node under a memory cap. cgroup v1 charges the page cache a node reads through to
/// its group, so a node whose data exceeds the cap reads from the disk, as a server whose
/// data exceeds its RAM does (seed 003).
pub struct MemoryCaps(Groups);

impl MemoryCaps {
    pub fn new() -> Result<Self, String> {
        Groups::new(MEMORY_ROOT, "memory.limit_in_bytes", "memory caps").map(MemoryCaps)
    }

    /// The node's processes, and what they read from then on, under `megabytes`.
    pub fn confine(
        &mut self,
        name: &str,
        postmaster_pid: u32,
        megabytes: u64,
    ) -> Result<(), String> {
        self.0.confine(
            name,
            postmaster_pid,
            &[("memory.limit_in_bytes", (megabytes << 20).to_string())],
        )
    }

    /// The most the group has held, in bytes: at the cap when the node's reads filled it.
    pub fn peak_bytes(&self, name: &str) -> Option<u64> {
        self.0
            .read(name, "memory.max_usage_in_bytes")?
            .trim()
            .parse()
            .ok()
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

impl Drop for Groups {
    /// Moves whatever still runs back to the root group, then removes the groups. A backend
    /// forked or exiting meanwhile makes removal fail with EBUSY, so it is retried.
    fn drop(&mut self) {
        let root_procs = Path::new(self.root).join("cgroup.procs");
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
