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

/// What a process has used so far: CPU time by mode, and its threads' context switches
/// (voluntary: it waited; involuntary: it was preempted), summed over its live threads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuUse {
    pub user_us: u64,
    pub system_us: u64,
    pub voluntary_switches: u64,
    pub involuntary_switches: u64,
}

impl CpuUse {
    /// `pid`'s use so far; None when it is gone.
    pub fn of(pid: u32) -> Option<CpuUse> {
        let fields = stat_fields(pid)?;
        let (voluntary_switches, involuntary_switches) =
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
                .map(|status| context_switches(&status))
                .fold((0, 0), |(v, i), (tv, ti)| (v + tv, i + ti));
        Some(CpuUse {
            user_us: ticks_to_us(field(&fields, 11)?),
            system_us: ticks_to_us(field(&fields, 12)?),
            voluntary_switches,
            involuntary_switches,
        })
    }

    /// This use spread over `transactions` (none when there were none).
    pub fn per_transaction(&self, transactions: u64) -> Option<CpuPerTxn> {
        let per = |x: u64| x as f64 / transactions as f64;
        (transactions > 0).then(|| CpuPerTxn {
            user_us: per(self.user_us),
            system_us: per(self.system_us),
            voluntary_switches: per(self.voluntary_switches),
            involuntary_switches: per(self.involuntary_switches),
        })
    }

    /// What was used between `before` and this reading.
    pub fn since(&self, before: &CpuUse) -> CpuUse {
        CpuUse {
            user_us: self.user_us.saturating_sub(before.user_us),
            system_us: self.system_us.saturating_sub(before.system_us),
            voluntary_switches: self
                .voluntary_switches
                .saturating_sub(before.voluntary_switches),
            involuntary_switches: self
                .involuntary_switches
                .saturating_sub(before.involuntary_switches),
        }
    }
}

/// [`CpuUse`] per transaction of a run. Of a pooler: its system time is the kernel's work for
/// its socket calls and the wake-ups they cause, which its own code changes only by making
/// fewer calls; its user time is what its code adds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuPerTxn {
    pub user_us: f64,
    pub system_us: f64,
    pub voluntary_switches: f64,
    pub involuntary_switches: f64,
}

impl CpuPerTxn {
    pub fn cpu_us(&self) -> f64 {
        self.user_us + self.system_us
    }
}

impl std::ops::Add for CpuUse {
    type Output = CpuUse;
    fn add(self, other: CpuUse) -> CpuUse {
        CpuUse {
            user_us: self.user_us + other.user_us,
            system_us: self.system_us + other.system_us,
            voluntary_switches: self.voluntary_switches + other.voluntary_switches,
            involuntary_switches: self.involuntary_switches + other.involuntary_switches,
        }
    }
}

/// (voluntary, involuntary) context switches from a thread's `/proc/.../status`.
fn context_switches(status: &str) -> (u64, u64) {
    let count = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        count("voluntary_ctxt_switches:"),
        count("nonvoluntary_ctxt_switches:"),
    )
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
    fn context_switches_are_read_from_a_status_file() {
        let status =
            "Name:\tpgherd\nvoluntary_ctxt_switches:\t120\nnonvoluntary_ctxt_switches:\t7\n";
        assert_eq!(context_switches(status), (120, 7));
        assert_eq!(context_switches("Name:\tx\n"), (0, 0));
    }

    fn thread_cpu_us() -> u64 {
        let mut now = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into the timespec it is given.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
        now.tv_sec as u64 * 1_000_000 + now.tv_nsec as u64 / 1_000
    }

    #[test]
    fn use_per_transaction_keeps_the_modes_apart() {
        let used = CpuUse {
            user_us: 300,
            system_us: 1_200,
            voluntary_switches: 20,
            involuntary_switches: 50,
        };
        let both = used + used;
        assert_eq!(both.since(&used), used);
        assert_eq!(used.since(&both), CpuUse::default(), "never below zero");
        let per = both.per_transaction(100).expect("transactions");
        assert_eq!(
            per,
            CpuPerTxn {
                user_us: 6.0,
                system_us: 24.0,
                voluntary_switches: 0.4,
                involuntary_switches: 1.0,
            }
        );
        assert_eq!(per.cpu_us(), 30.0);
        assert_eq!(used.per_transaction(0), None);
    }

    #[test]
    fn a_process_use_sums_its_threads_and_splits_its_modes() {
        let me = std::process::id();
        let before = CpuUse::of(me).expect("own use");
        // A thread that sleeps a few times adds voluntary switches of its own; it stays
        // alive while read, as a thread that ended takes its switch counts with it.
        let (done, worked) = std::sync::mpsc::channel();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            for _ in 0..5 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            // 100 ms of this thread's own CPU, all of it in user mode.
            let mut x = 0u64;
            while thread_cpu_us() < 100_000 {
                for _ in 0..100_000 {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            let _ = done.send(());
            let _ = released.recv();
        });
        worked.recv().expect("the thread worked");
        let used = CpuUse::of(me).expect("own use").since(&before);
        let _ = release.send(());
        thread.join().expect("thread");
        assert!(used.voluntary_switches >= 5, "{used:?}");
        assert!(used.user_us >= 80_000, "{used:?}");
        assert!(used.system_us < used.user_us, "{used:?}");
    }

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
        let cpu_us = |pid| CpuUse::of(pid).map(|c| c.user_us + c.system_us);
        let own = cpu_us(me).expect("own CPU time");
        let child_us = cpu_us(child.id()).expect("the child's CPU time");
        let tree = tree_cpu_us(me);
        let _ = child.kill();
        let _ = child.wait();
        assert!(child_us > 0, "the child counted");
        assert!(tree >= own + child_us, "{tree} < {own} + {child_us}");
    }
}
