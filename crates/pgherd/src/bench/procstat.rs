//! What /proc says about a process: CPU time used and resident memory.

/// User plus system CPU time of `pid`, in microseconds.
pub fn cpu_us(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is parenthesised and may contain spaces.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Some((utime + stime) * 1_000_000 / ticks)
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
    let mut times = std::collections::HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some(close) = stat.rfind(')') else {
            continue;
        };
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let number = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        parent_of.push((pid, number(1) as u32));
        times.insert(pid, number(11) + number(12) + number(13) + number(14));
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
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    in_tree.iter().filter_map(|pid| times.get(pid)).sum::<u64>() * 1_000_000 / ticks
}
