//! What /proc says about a process: CPU time used and resident memory.

/// `/proc/<pid>/stat`'s fields after the command name (which is parenthesised and may contain
/// spaces), numbered from 0 (the state): the parent is field 1, user and system time in clock
/// ticks 11 and 12, those of reaped children 13 and 14.
fn stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = stat.get(stat.rfind(')')? + 2..)?;
    Some(after.split_whitespace().map(str::to_owned).collect())
}

fn field(fields: &[String], i: usize) -> Option<u64> {
    fields.get(i)?.parse().ok()
}

fn ticks_to_us(ticks: u64) -> u64 {
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * 1_000_000 / per_second
}

/// User plus system CPU time of `pid`, in microseconds.
pub fn cpu_us(pid: u32) -> Option<u64> {
    let fields = stat_fields(pid)?;
    Some(ticks_to_us(field(&fields, 11)? + field(&fields, 12)?))
}

/// Resident set size of `pid`, in KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Open file descriptors of `pid`.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Raises this process's open-file limit (inherited by what it starts) as far as allowed.
pub fn raise_fd_limit(want: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let target = if libc::geteuid() == 0 {
            want.max(lim.rlim_max)
        } else {
            lim.rlim_max
        };
        let new = libc::rlimit {
            rlim_cur: want.min(target),
            rlim_max: target,
        };
        if libc::setrlimit(libc::RLIMIT_NOFILE, &new) == 0 {
            return new.rlim_cur;
        }
    }
    lim.rlim_cur
}

/// CPU time of `root` and everything under it (each process's own time plus that of the
/// children it reaped), in microseconds: a forking server (PostgreSQL, Pgpool-II) as a whole.
pub fn tree_cpu_us(root: u32) -> u64 {
    let mut parent_of = Vec::new();
    let mut ticks = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(fields) = stat_fields(pid) else {
            continue;
        };
        let number = |i| field(&fields, i).unwrap_or(0);
        parent_of.push((pid, number(1) as u32));
        ticks.insert(pid, number(11) + number(12) + number(13) + number(14));
    }
    let mut in_tree = std::collections::HashSet::from([root]);
    // Parents may be listed after their children: repeat until nothing joins.
    loop {
        let before = in_tree.len();
        for &(pid, parent) in &parent_of {
            if in_tree.contains(&parent) {
                in_tree.insert(pid);
            }
        }
        if in_tree.len() == before {
            break;
        }
    }
    ticks_to_us(in_tree.iter().filter_map(|pid| ticks.get(pid)).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_tree_takes_in_its_children() {
        let me = std::process::id();
        let mut child = std::process::Command::new("sh")
            .args([
                "-c",
                "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done; sleep 5",
            ])
            .spawn()
            .expect("sh");
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let own = cpu_us(me).expect("own CPU time");
        let child_us = cpu_us(child.id()).expect("the child's CPU time");
        let tree = tree_cpu_us(me);
        let _ = child.kill();
        let _ = child.wait();
        assert!(child_us > 0, "the child counted");
        assert!(tree >= own + child_us, "{tree} < {own} + {child_us}");
    }
}
