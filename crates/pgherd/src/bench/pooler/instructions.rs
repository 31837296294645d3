//! `pgherd bench pooler --count-instructions N`: the instructions each pooler executes per
//! transaction, counted by valgrind's callgrind, side by side in one run.
//!
//! On a shared machine user CPU time per transaction moves by tens of percent between runs of
//! one binary; the count of instructions for the same binary and load moves by a fraction of a
//! percent, so a change to the data path shows in it even when it is inside the timed runs'
//! noise. It is not a speed: it leaves out the kernel (system calls, wake-ups), caches and
//! branch prediction, which the timed runs (`pgherd bench pooler` without this option) keep.

use std::fmt::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::super::pgbench::wait_with_timeout;
use super::super::targets::{metric_sum, ProxyProcess};
use super::super::{csv_number, csv_text, output_prefix, run_order, write_csv_and_report};
use super::{
    pgbench_args, pgbench_timeout, port_of, setup, Fixture, PoolerOptions, RunLength, Target,
    Workload,
};

/// Transactions run (in all, split over the clients) twice before counting: the pools'
/// connections, the router's catalog reading and first decisions, and each allocator's first
/// growth fall outside the count.
const WARM_UP_TRANSACTIONS: u64 = 400;
/// Between the two warm-up runs: a catalog reading asked for by the first statements runs in
/// the background and must be over before counting starts.
const WARM_UP_PAUSE: Duration = Duration::from_secs(3);
/// How long a dump may take to appear once asked for.
const DUMP_WAIT: Duration = Duration::from_secs(60);
/// How long vgdb may take to hand callgrind a command.
const CONTROL_WAIT: Duration = Duration::from_secs(60);

struct Count {
    round: u32,
    workload: Workload,
    clients: u32,
    target: Target,
    /// Transactions and the instructions they took, or why they could not be counted
    /// (PgBouncer refuses prepared statements in transaction pooling, say).
    counted: Result<(u64, u64), String>,
    /// pgherd's catalog readings for routing that finished while counting (`None`: not
    /// known, a peer or a build without the metric). Its reading once a minute is tens of
    /// millions of instructions, thousands per transaction of a count it falls into.
    catalog_readings: Option<u64>,
}

impl Count {
    fn per_transaction(&self) -> Option<f64> {
        let (transactions, instructions) = self.counted.as_ref().ok()?;
        Some(*instructions as f64 / (*transactions).max(1) as f64)
    }

    fn read_the_catalog(&self) -> bool {
        self.catalog_readings.is_some_and(|n| n > 0)
    }
}

/// pgherd's catalog readings so far, summed over its databases, from its /metrics.
fn catalog_readings(proxy: &ProxyProcess) -> Option<u64> {
    let text = proxy.metrics_text()?;
    metric_sum(&text, "pgherd_catalog_readings_total{").map(|n| n as u64)
}

pub(super) fn run(options: &PoolerOptions, transactions: u64) -> Result<(), String> {
    for tool in ["valgrind", "vgdb"] {
        installed(tool)?;
    }
    if options.clients.contains(&0) {
        return Err("--clients: 0 is not a number of clients".into());
    }
    let targets: Vec<Target> = options
        .targets
        .iter()
        .copied()
        .filter(|t| {
            let counted = !matches!(
                t,
                Target::Direct | Target::PgherdScraped | Target::PgherdTwoProcesses
            );
            if !counted {
                eprintln!("{}: not counted (no pooler process of its own)", t.name());
            }
            counted
        })
        .collect();
    if targets.is_empty() {
        return Err("--count-instructions needs a pooler among --targets".into());
    }
    let fixture = setup(options)?;
    // Dumps a reused --dir holds from an earlier run: this run's would take their numbers.
    for &target in &targets {
        if let (_, Some(proxy)) = port_of(&fixture, target)? {
            for stale in proxy
                .callgrind_out
                .as_deref()
                .map(dumps)
                .transpose()?
                .unwrap_or_default()
            {
                std::fs::remove_file(&stale).map_err(|e| format!("{}: {e}", stale.display()))?;
            }
        }
    }
    let started = Instant::now();
    let mut counts = Vec::new();
    // Dumps asked of each target so far: callgrind numbers them from 1.
    let mut dumps_asked = vec![0u32; targets.len()];
    let rounds = options.rounds.max(1);
    for (round, workload, clients, target) in
        run_order(rounds, &options.workloads, &options.clients, &targets)
    {
        let asked = targets
            .iter()
            .position(|t| *t == target)
            .map(|i| &mut dumps_asked[i])
            .ok_or("a target outside the run's")?;
        let counted = count_one(
            &fixture,
            options,
            (workload, clients, target),
            transactions,
            asked,
        );
        let count = Count {
            round,
            workload,
            clients,
            target,
            catalog_readings: counted.as_ref().ok().and_then(|(_, _, readings)| *readings),
            counted: counted.map(|(transactions, instructions, _)| (transactions, instructions)),
        };
        let outcome = match &count.counted {
            Ok(_) => format!(
                "{:>9.0} instructions per transaction{}",
                count.per_transaction().unwrap_or_default(),
                if count.read_the_catalog() {
                    " (a catalog reading fell in)"
                } else {
                    ""
                }
            ),
            Err(e) => format!("FAILED: {}", e.lines().next().unwrap_or_default()),
        };
        eprintln!(
            "round {} {:<16} {:>3} clients {:<16} {outcome}",
            round + 1,
            workload.name(),
            clients,
            target.name(),
        );
        counts.push(count);
    }
    let report = render(options, &targets, &counts, started.elapsed());
    println!("{report}");
    let prefix = output_prefix(&options.out, "instructions")?;
    let mut csv = String::from(
        "round,workload,clients,target,transactions,instructions,per_txn,catalog_readings,error\n",
    );
    for c in &counts {
        let (transactions, instructions) = c.counted.as_ref().map_or((None, None), |(t, i)| {
            (Some(t.to_string()), Some(i.to_string()))
        });
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{}",
            c.round + 1,
            c.workload.name(),
            c.clients,
            c.target.name(),
            transactions.unwrap_or_default(),
            instructions.unwrap_or_default(),
            csv_number(c.per_transaction(), 0),
            c.catalog_readings
                .map(|n| n.to_string())
                .unwrap_or_default(),
            csv_text(c.counted.as_ref().err().map(String::as_str)),
        );
    }
    write_csv_and_report(&prefix, &csv, &report)
}

/// Warms the target up, zeroes its counters, runs `transactions` (split over the clients),
/// and reads the counts callgrind dumps: the transactions run and the instructions they took.
/// The clients' logins fall inside the count (pgbench connects as it starts): at 8 clients and
/// 2,000 transactions some 400 instructions per transaction. `dumps_asked` counts the target's
/// dumps, which callgrind numbers. Also the catalog readings that finished meanwhile, read
/// from /metrics before the counters are zeroed and after the dump, outside the count.
fn count_one(
    fixture: &Fixture,
    options: &PoolerOptions,
    (workload, clients, target): (Workload, u32, Target),
    transactions: u64,
    dumps_asked: &mut u32,
) -> Result<(u64, u64, Option<u64>), String> {
    let (port, proxy) = port_of(fixture, target)?;
    let proxy = proxy.ok_or_else(|| format!("{} has no process to count", target.name()))?;
    let out = proxy
        .callgrind_out
        .as_deref()
        .ok_or_else(|| format!("{} does not run under callgrind", target.name()))?;
    let url = fixture.user_for(workload).url(port, "bench");
    let threads = clients.clamp(1, options.client_threads.max(1));
    let pgbench = |per_client: u64| {
        let length = RunLength::TransactionsPerClient(per_client);
        let args = pgbench_args(fixture, workload, clients, threads, length);
        // Under valgrind a pooler runs some fifty times slower than on its own.
        let timeout = pgbench_timeout(options) * 10 + Duration::from_secs(per_client / 2);
        fixture.pgbench.run(&url, &args, 0.01, timeout)
    };
    let warm_up = (WARM_UP_TRANSACTIONS / u64::from(clients)).max(10);
    pgbench(warm_up)?;
    std::thread::sleep(WARM_UP_PAUSE);
    pgbench(warm_up)?;
    let readings_before = catalog_readings(proxy);
    control(proxy, "zero")?;
    let per_client = (transactions / u64::from(clients)).max(1);
    let result = pgbench(per_client)?;
    // Counted before asking: a dump that comes late (or a command that did reach callgrind
    // but timed out here) keeps its number, and no later count reads it as its own.
    *dumps_asked += 1;
    control(proxy, "dump")?;
    let instructions = wait_for_dump(out, *dumps_asked)?;
    let readings = readings_before
        .zip(catalog_readings(proxy))
        .map(|(before, after)| after.saturating_sub(before));
    Ok((result.transactions, instructions, readings))
}

/// Hands callgrind's monitor command (`zero`, `dump`) to the pooler through vgdb, which exits
/// with an error when no such process runs under valgrind (callgrind_control says so on its
/// output and exits 0). Run as the user the pooler runs as, with the same environment: vgdb
/// finds the pooler by pipes in /tmp named after it and its user.
fn control(proxy: &ProxyProcess, command: &str) -> Result<(), String> {
    let pid = proxy.pid();
    let mut cmd = Command::new("vgdb");
    cmd.arg(format!("--pid={pid}"))
        .arg(command)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some((uid, gid)) = owner(pid) {
        cmd.uid(uid).gid(gid);
    }
    let child = cmd.spawn().map_err(|e| format!("cannot run vgdb: {e}"))?;
    let output = wait_with_timeout(child, "vgdb", CONTROL_WAIT)?;
    if !output.status.success() {
        return Err(format!(
            "vgdb {command} for {} (pid {pid}) failed: {}",
            proxy.name,
            String::from_utf8_lossy(&output.stderr).trim()
        ));
    }
    Ok(())
}

/// The real user and group a process runs as.
fn owner(pid: u32) -> Option<(u32, u32)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let first = |key: &str| -> Option<u32> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some((first("Uid:")?, first("Gid:")?))
}

/// The dumps callgrind wrote so far for `out`: `out.1`, `out.2`, ...
fn dumps(out: &Path) -> Result<Vec<PathBuf>, String> {
    let dir = out.parent().ok_or("callgrind's output has no directory")?;
    let name = out
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("callgrind's output has no name")?;
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let part = path
                .file_name()?
                .to_str()?
                .strip_prefix(name)?
                .strip_prefix('.')?
                .parse()
                .ok()?;
            Some((part, path))
        })
        .collect();
    found.sort();
    Ok(found.into_iter().map(|(_, path)| path).collect())
}

/// Waits for dump number `part` of `out` to be complete and reads the instructions it counted.
fn wait_for_dump(out: &Path, part: u32) -> Result<u64, String> {
    let mut path = out.as_os_str().to_owned();
    path.push(format!(".{part}"));
    let path = PathBuf::from(path);
    let deadline = Instant::now() + DUMP_WAIT;
    loop {
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if let Some(totals) = dump_totals(&text) {
            return totals.parse().map_err(|_| {
                format!("{}: cannot read the totals line {totals:?}", path.display())
            });
        }
        if Instant::now() > deadline {
            return Err(format!(
                "callgrind wrote no dump for {} within {} s",
                out.display(),
                DUMP_WAIT.as_secs()
            ));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The instructions a dump counted: its `totals:` line, once the file is whole (the line is
/// its last and ends with a newline; callgrind writes through a buffer, so a reader can see
/// the line cut short).
fn dump_totals(text: &str) -> Option<&str> {
    let last = text.strip_suffix('\n')?.lines().next_back()?;
    last.strip_prefix("totals:").map(str::trim)
}

/// The lower of the two middle values of an even count: counts only ever grow by the
/// clock-driven work that falls into them, so the smaller is the data path's.
fn lower_median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
        .get((sorted.len().max(1) - 1) / 2)
        .copied()
        .unwrap_or(0.0)
}

fn installed(tool: &str) -> Result<(), String> {
    let found = std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()));
    match found {
        true => Ok(()),
        false => Err(format!(
            "--count-instructions needs {tool} (Debian: apt-get install valgrind)"
        )),
    }
}

fn render(
    options: &PoolerOptions,
    targets: &[Target],
    counts: &[Count],
    elapsed: Duration,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Instructions per transaction (callgrind)\n\nMedian (lower middle) of {} rounds of {} transactions \
         each after two warm-up runs, leaving out rounds pgherd's catalog reading fell into \
         while others remain (the CSV's catalog_readings); user space only (the kernel's work \
         is not counted); the primary and {} replicas, each target configured as in the timed \
         runs; {:.0} s.\n",
        options.rounds.max(1),
        options.count_instructions.unwrap_or(0),
        options.replicas,
        elapsed.as_secs_f64()
    );
    let names: Vec<&str> = targets.iter().map(|t| t.name()).collect();
    let has_pgbouncer = targets.contains(&Target::Pgbouncer);
    let mut header = format!("| workload | clients | {} |", names.join(" | "));
    let mut rule = format!("|---|---:|{}", "---:|".repeat(names.len()));
    if has_pgbouncer {
        for name in names.iter().filter(|n| **n != Target::Pgbouncer.name()) {
            let _ = write!(header, " {name} / pgbouncer |");
            rule.push_str("---:|");
        }
    }
    let _ = writeln!(out, "{header}\n{rule}");
    for &workload in &options.workloads {
        for &clients in &options.clients {
            // The median over rounds (the lower middle of an even number), of the rounds no
            // catalog reading fell into when there are any: the reading once a minute is
            // clock-driven work, and valgrind stretches each count over more of the clock.
            let of = |target: Target| {
                let cell: Vec<&Count> = counts
                    .iter()
                    .filter(|c| {
                        c.workload == workload && c.clients == clients && c.target == target
                    })
                    .filter(|c| c.counted.is_ok())
                    .collect();
                let quiet: Vec<&Count> = cell
                    .iter()
                    .copied()
                    .filter(|c| !c.read_the_catalog())
                    .collect();
                let kept = if quiet.is_empty() { cell } else { quiet };
                let per_round: Vec<f64> = kept.iter().filter_map(|c| c.per_transaction()).collect();
                (!per_round.is_empty()).then(|| lower_median(&per_round))
            };
            let mut row = format!("| {} | {clients} |", workload.name());
            for &target in targets {
                let _ = write!(row, " {} |", of(target).map_or("failed".into(), thousands));
            }
            if has_pgbouncer {
                let peer = of(Target::Pgbouncer);
                for &target in targets.iter().filter(|t| **t != Target::Pgbouncer) {
                    let ratio = of(target).zip(peer).map(|(v, p)| format!("{:.2}", v / p));
                    let _ = write!(row, " {} |", ratio.unwrap_or_else(|| "–".into()));
                }
            }
            let _ = writeln!(out, "{row}");
        }
    }
    out.push_str(&failure_notes(options, counts));
    out
}

/// One line per cell that failed in some round: how often, and the first error.
fn failure_notes(options: &PoolerOptions, counts: &[Count]) -> String {
    let mut notes = String::new();
    let mut told = Vec::new();
    for c in counts {
        let cell = (c.workload, c.clients, c.target);
        if let (Err(e), false) = (&c.counted, told.contains(&cell)) {
            told.push(cell);
            let failures = counts
                .iter()
                .filter(|o| (o.workload, o.clients, o.target) == cell && o.counted.is_err())
                .count();
            let _ = writeln!(
                notes,
                "\n{} at {} clients through {} failed in {failures} of {} rounds, first: {}",
                c.workload.name(),
                c.clients,
                c.target.name(),
                options.rounds.max(1),
                e.lines().next().unwrap_or_default()
            );
        }
    }
    notes
}

/// 73331.4 as "73,331".
fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(c);
    }
    grouped
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report of `counts`, pgherd's and PgBouncer's, over `rounds` rounds of TPC-B at 1 client.
    fn report(rounds: &str, counts: &[Count]) -> String {
        let options = super::super::pooler_options(&[
            "--workloads",
            "tpcb",
            "--clients",
            "1",
            "--rounds",
            rounds,
        ]);
        render(
            &options,
            &[Target::Pgherd, Target::Pgbouncer],
            counts,
            Duration::from_secs(1),
        )
    }

    fn counted(round: u32, target: Target, counted: Result<(u64, u64), String>) -> Count {
        Count {
            round,
            workload: Workload::Tpcb,
            clients: 1,
            target,
            counted,
            catalog_readings: None,
        }
    }

    #[test]
    fn rounds_a_catalog_reading_fell_into_leave_the_median_while_others_remain() {
        let read = |round: u32, instructions: u64| Count {
            catalog_readings: Some(1),
            ..counted(round, Target::Pgherd, Ok((1000, instructions)))
        };
        let quiet = |round: u32, instructions: u64| Count {
            catalog_readings: Some(0),
            ..counted(round, Target::Pgherd, Ok((1000, instructions)))
        };
        let peer = |round: u32| counted(round, Target::Pgbouncer, Ok((1000, 28_000_000)));
        // Two of three rounds read the catalog: the median is the quiet one's.
        let counts = [
            read(0, 86_000_000),
            quiet(1, 66_600_000),
            read(2, 86_100_000),
            peer(0),
            peer(1),
            peer(2),
        ];
        assert!(
            report("3", &counts).contains("| tpcb | 1 | 66,600 | 28,000 | 2.38 |"),
            "{}",
            report("3", &counts)
        );
        // Every round read it: all of them count, as before.
        let counts = [read(0, 86_000_000), read(1, 86_200_000), peer(0), peer(1)];
        assert!(
            report("2", &counts).contains("| tpcb | 1 | 86,000 | 28,000 |"),
            "{}",
            report("2", &counts)
        );
    }

    #[test]
    fn each_cell_shows_its_median_and_the_ratio_to_pgbouncer() {
        let counts = [
            // A round a catalog reading fell into: the median leaves it out.
            counted(0, Target::Pgherd, Ok((1000, 92_000_000))),
            counted(1, Target::Pgherd, Ok((1000, 70_000_000))),
            counted(2, Target::Pgherd, Ok((1000, 70_400_000))),
            counted(0, Target::Pgbouncer, Ok((1000, 28_000_000))),
            counted(
                1,
                Target::Pgbouncer,
                Err("pgbench failed: boom\nmore".into()),
            ),
            counted(2, Target::Pgbouncer, Ok((1000, 28_000_000))),
        ];
        let report = report("3", &counts);
        assert!(
            report.contains("| tpcb | 1 | 70,400 | 28,000 | 2.51 |"),
            "{report}"
        );
        assert!(
            report.contains("tpcb at 1 clients through pgbouncer failed in 1 of 3 rounds, first: pgbench failed: boom"),
            "{report}"
        );
    }

    #[test]
    fn a_cell_with_no_count_says_so() {
        let counts = [
            counted(0, Target::Pgherd, Ok((10, 1000))),
            counted(0, Target::Pgbouncer, Err("refused".into())),
        ];
        let report = report("1", &counts);
        assert!(
            report.contains("| tpcb | 1 | 100 | failed | – |"),
            "{report}"
        );
    }

    #[test]
    fn dumps_are_read_in_the_order_callgrind_wrote_them() {
        let dir =
            std::env::temp_dir().join(format!("pgherd-callgrind-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("pgherd.callgrind");
        for part in [10, 2, 1] {
            std::fs::write(dir.join(format!("pgherd.callgrind.{part}")), "").unwrap();
        }
        std::fs::write(dir.join("pgherd.callgrind"), "").unwrap();
        std::fs::write(dir.join("pgbouncer.callgrind.3"), "").unwrap();
        let found = dumps(&out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let names: Vec<_> = found
            .iter()
            .map(|p| p.file_name().unwrap().to_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            names,
            [
                "pgherd.callgrind.1",
                "pgherd.callgrind.2",
                "pgherd.callgrind.10"
            ]
        );
    }

    #[test]
    fn a_dump_is_read_only_once_its_totals_line_is_whole() {
        let whole = "events: Ir\nsummary: 123\nfn=main\n1 5\n\ntotals: 140228891\n";
        assert_eq!(dump_totals(whole), Some("140228891"));
        // Cut inside the number, or before its newline: not yet.
        assert_eq!(dump_totals("events: Ir\n\ntotals: 1402"), None);
        assert_eq!(dump_totals("events: Ir\n\ntotals: 140228891"), None);
        assert_eq!(dump_totals("events: Ir\nsummary: 123\n"), None);
        assert_eq!(dump_totals(""), None);
    }

    #[test]
    fn the_median_of_an_even_count_is_its_lower_middle() {
        assert_eq!(lower_median(&[70_100.0, 89_700.0]), 70_100.0);
        assert_eq!(lower_median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(lower_median(&[4.0, 1.0, 3.0, 2.0]), 2.0);
        assert_eq!(lower_median(&[5.0]), 5.0);
    }

    #[test]
    fn thousands_are_grouped() {
        assert_eq!(thousands(0.4), "0");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(73_331.4), "73,331");
        assert_eq!(thousands(1_234_567.0), "1,234,567");
    }
}
