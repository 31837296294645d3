//! `pgherd bench pooler`'s report: medians per workload, client count and target, the
//! Markdown tables (against direct PostgreSQL and PgBouncer, the baseline, the scraped and the
//! embedded-default comparisons) and the CSV.

use std::fmt::Write as _;

use super::super::pgbench::median;
use super::super::{
    csv_number, csv_text, fmt, output_prefix, write_csv_and_report, write_failed_runs,
};
use super::*;

/// One (workload, clients, target) cell's medians over rounds, and its failed transactions.
struct Medians {
    tps: f64,
    avg_ms: f64,
    p99_ms: f64,
    cpu_us: f64,
    user_us: f64,
    system_us: f64,
    voluntary_switches: f64,
    involuntary_switches: f64,
    server_cpu_us: f64,
    failed: u64,
}

fn medians(samples: &[Sample], workload: Workload, clients: u32, target: Target) -> Medians {
    let pick: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.workload == workload && s.clients == clients && s.target == target)
        .collect();
    let m = |f: &dyn Fn(&Sample) -> f64| median(&pick.iter().map(|s| f(s)).collect::<Vec<_>>());
    Medians {
        tps: m(&|s| s.result.tps),
        avg_ms: m(&|s| s.result.latency_avg_ms),
        p99_ms: m(&|s| s.result.latency_p99_ms),
        cpu_us: m(&|s| s.proxy_cost.map_or(f64::NAN, |c| c.cpu_us())),
        user_us: m(&|s| s.proxy_cost.map_or(f64::NAN, |c| c.user_us)),
        system_us: m(&|s| s.proxy_cost.map_or(f64::NAN, |c| c.system_us)),
        voluntary_switches: m(&|s| s.proxy_cost.map_or(f64::NAN, |c| c.voluntary_switches)),
        involuntary_switches: m(&|s| s.proxy_cost.map_or(f64::NAN, |c| c.involuntary_switches)),
        server_cpu_us: m(&|s| s.server_cpu_us_per_txn.unwrap_or(f64::NAN)),
        failed: pick.iter().map(|s| s.result.failed).sum(),
    }
}

/// One table row per workload and client count, in the order they were asked for.
fn write_rows(r: &mut String, options: &PoolerOptions, row: impl Fn(Workload, u32) -> String) {
    for &workload in &options.workloads {
        for &clients in &options.clients {
            let _ = writeln!(r, "{}", row(workload, clients));
        }
    }
}

/// A TPS median, or how many runs failed when none succeeded.
fn tps_cell(tps: f64, failed_runs: usize) -> String {
    match (tps.is_finite(), failed_runs) {
        (true, 0) => format!("{tps:.0}"),
        (true, n) => format!("{tps:.0} ({n} failed)"),
        (false, n) if n > 0 => "fails".into(),
        _ => "–".into(),
    }
}

/// Two pgherd targets side by side per workload and client count: TPS, their ratio (second
/// over first) and CPU per transaction (medians).
fn write_comparison(
    r: &mut String,
    options: &PoolerOptions,
    samples: &[Sample],
    heading: &str,
    ((a_name, a), (b_name, b)): ((&str, Target), (&str, Target)),
) {
    let _ = writeln!(r, "\n{heading} (medians):\n");
    let _ = writeln!(
        r,
        "| workload | clients | {a_name} TPS | {b_name} TPS | {b_name} / {a_name} | CPU µs/txn {a_name} / {b_name} | primary's CPU µs/txn {a_name} / {b_name} | failed |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|---:|");
    write_rows(r, options, |workload, clients| {
        let x = medians(samples, workload, clients, a);
        let y = medians(samples, workload, clients, b);
        format!(
            "| {} | {} | {} | {} | {} | {} / {} | {} / {} | {} |",
            workload.name(),
            clients,
            fmt(x.tps, 0),
            fmt(y.tps, 0),
            fmt(y.tps / x.tps, 3),
            fmt(x.cpu_us, 1),
            fmt(y.cpu_us, 1),
            fmt(x.server_cpu_us, 1),
            fmt(y.server_cpu_us, 1),
            x.failed + y.failed
        )
    });
}

/// pgherd's and PgBouncer's CPU per transaction split into user time (their own code) and
/// system time (the kernel's work for their socket calls and wake-ups), with context
/// switches. The last ratio is pgherd's system time over PgBouncer's whole cost: the CPU
/// ratio pgherd would reach if its own code cost nothing.
fn write_cpu_split(r: &mut String, options: &PoolerOptions, samples: &[Sample]) {
    let _ = writeln!(
        r,
        "\nWhere the poolers' CPU goes per transaction (medians; switches: voluntary / involuntary):\n"
    );
    let _ = writeln!(
        r,
        "| workload | clients | pgherd user / system µs | PgBouncer user / system µs | pgherd switches | PgBouncer switches | pgherd system / PgBouncer user + system |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|");
    write_rows(r, options, |workload, clients| {
        let h = medians(samples, workload, clients, Target::Pgherd);
        let b = medians(samples, workload, clients, Target::Pgbouncer);
        format!(
            "| {} | {} | {} / {} | {} / {} | {} / {} | {} / {} | {} |",
            workload.name(),
            clients,
            fmt(h.user_us, 1),
            fmt(h.system_us, 1),
            fmt(b.user_us, 1),
            fmt(b.system_us, 1),
            fmt(h.voluntary_switches, 2),
            fmt(h.involuntary_switches, 2),
            fmt(b.voluntary_switches, 2),
            fmt(b.involuntary_switches, 2),
            fmt(h.system_us / b.cpu_us, 2),
        )
    });
}

pub(super) fn render_report(
    options: &PoolerOptions,
    samples: &[Sample],
    memory: &[super::IdleMemory],
    took: Duration,
) -> String {
    let mut r = String::new();
    let _ = writeln!(
        r,
        "## pgherd bench pooler\n\n{} round(s) x {} s per run, scale {}, pool size {}, a primary and {} streaming replica(s), \
         pgbench -j {}, the poolers reaching the servers over {}, medians over rounds; {} min in all. \
         CPU is the pooler process's user+system time per transaction from /proc; the primary's \
         CPU, that of its postmaster and every process under it.{}\n",
        options.rounds,
        options.duration_s,
        options.scale,
        options.pool_size,
        options.replicas,
        options.client_threads,
        match options.server_transport {
            super::ServerTransport::Tcp => "TCP",
            super::ServerTransport::Unix => "their Unix-domain sockets",
        },
        took.as_secs() / 60,
        if options.targets.contains(&Target::PgherdDefault) {
            " pgherd-default and pgherd-default-primary run on a second cluster of the same \
             shape and data, whose commits the default's sync durability makes synchronous; \
             every other target's cluster commits asynchronously."
        } else {
            ""
        }
    );
    let _ = writeln!(r, "| workload | clients | direct TPS | pgherd TPS | PgBouncer TPS | pgherd / direct | pgherd / PgBouncer | avg ms direct / pgherd / PgBouncer | p99 ms direct / pgherd / PgBouncer | CPU µs/txn pgherd / PgBouncer | CPU ratio | failed |");
    let _ = writeln!(
        r,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let failed_runs = |workload: Workload, clients: u32, target: Target| {
        samples
            .iter()
            .filter(|s| {
                s.workload == workload
                    && s.clients == clients
                    && s.target == target
                    && s.error.is_some()
            })
            .count()
    };
    write_rows(&mut r, options, |workload, clients| {
        let d = medians(samples, workload, clients, Target::Direct);
        let h = medians(samples, workload, clients, Target::Pgherd);
        let b = medians(samples, workload, clients, Target::Pgbouncer);
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} / {} | {} / {} / {} | {} / {} | {} | {} |",
            workload.name(),
            clients,
            tps_cell(d.tps, failed_runs(workload, clients, Target::Direct)),
            tps_cell(h.tps, failed_runs(workload, clients, Target::Pgherd)),
            tps_cell(b.tps, failed_runs(workload, clients, Target::Pgbouncer)),
            fmt(h.tps / d.tps, 2),
            fmt(h.tps / b.tps, 2),
            fmt(d.avg_ms, 3),
            fmt(h.avg_ms, 3),
            fmt(b.avg_ms, 3),
            fmt(d.p99_ms, 3),
            fmt(h.p99_ms, 3),
            fmt(b.p99_ms, 3),
            fmt(h.cpu_us, 1),
            fmt(b.cpu_us, 1),
            fmt(h.cpu_us / b.cpu_us, 2),
            d.failed + h.failed + b.failed
        )
    });
    if options.targets.contains(&Target::Pgherd) && options.targets.contains(&Target::Pgbouncer) {
        write_cpu_split(&mut r, options, samples);
    }
    if options.clients.contains(&1) {
        let _ = writeln!(
            r,
            "\nLatency pgherd and PgBouncer add over direct PostgreSQL at 1 client (mean, ms):\n"
        );
        let _ = writeln!(r, "| workload | pgherd adds | PgBouncer adds | ratio |");
        let _ = writeln!(r, "|---|---:|---:|---:|");
        for &workload in &options.workloads {
            let d = medians(samples, workload, 1, Target::Direct).avg_ms;
            let h = medians(samples, workload, 1, Target::Pgherd).avg_ms - d;
            let b = medians(samples, workload, 1, Target::Pgbouncer).avg_ms - d;
            let _ = writeln!(
                r,
                "| {} | {} | {} | {} |",
                workload.name(),
                fmt(h, 3),
                fmt(b, 3),
                fmt(h / b, 2)
            );
        }
    }
    if let Some(baseline) = &options.baseline {
        let heading = format!(
            "This build against the baseline binary ({}), same run",
            baseline.display()
        );
        let pair = (
            ("baseline", Target::PgherdBaseline),
            ("pgherd", Target::Pgherd),
        );
        write_comparison(&mut r, options, samples, &heading, pair);
    }
    if options.targets.contains(&Target::PgherdDefault) {
        let heading = "The embedded default (`pgherd up`: route auto, read-your-writes, sync durability, failover) against route = primary on the same cluster (commits synchronous on both)";
        let pair = (
            ("primary", Target::PgherdDefaultPrimary),
            ("default", Target::PgherdDefault),
        );
        write_comparison(&mut r, options, samples, heading, pair);
        let heading = "The embedded default against direct PostgreSQL (the primary of the other targets' cluster, commits asynchronous)";
        let pair = (
            ("direct", Target::Direct),
            ("default", Target::PgherdDefault),
        );
        write_comparison(&mut r, options, samples, heading, pair);
    }
    if options.targets.contains(&Target::PgherdTwoWorkers) {
        let heading = format!(
            "pgherd with 2 worker threads against the same with {} (goal: CPU per transaction within 5%)",
            match options.pgherd_workers {
                0 => "its default (a quarter of the CPUs, at least one)".to_owned(),
                n => format!("{n}"),
            }
        );
        let pair = (
            ("pgherd", Target::Pgherd),
            ("2 workers", Target::PgherdTwoWorkers),
        );
        write_comparison(&mut r, options, samples, &heading, pair);
    }
    if options.targets.contains(&Target::PgherdTwoProcesses) {
        let heading = "pgherd as two processes of one worker each, the clients split between them, against one process with one worker (what a second poller costs with nothing shared)";
        let pair = (
            ("pgherd", Target::Pgherd),
            ("2 processes", Target::PgherdTwoProcesses),
        );
        write_comparison(&mut r, options, samples, heading, pair);
    }
    if options.targets.contains(&Target::PgherdScraped) {
        let heading = format!(
            "Cost of metrics: pgherd with a scraper reading /metrics every {} ms vs. the same pgherd unwatched",
            options.scrape_ms
        );
        let pair = (
            ("pgherd", Target::Pgherd),
            ("scraped", Target::PgherdScraped),
        );
        write_comparison(&mut r, options, samples, &heading, pair);
    }
    write_failed_runs(
        &mut r,
        samples.iter().filter_map(|s| {
            let e = s.error.as_ref()?;
            Some(format!(
                "- {} {} clients {}: {e}",
                s.workload.name(),
                s.clients,
                s.target.name()
            ))
        }),
    );
    if !memory.is_empty() {
        let _ = writeln!(
            r,
            "\nResident memory with {} idle clients connected, read as soon as all are \
             connected and again {} s later (pgherd parks clients idle for 1-2 s):\n",
            options.idle_clients,
            super::IDLE_SETTLE.as_secs()
        );
        let _ = writeln!(
            r,
            "| pooler | bytes per idle client, just connected | after {} s idle | RSS then (MiB) |",
            super::IDLE_SETTLE.as_secs()
        );
        let _ = writeln!(r, "|---|---:|---:|---:|");
        for m in memory {
            let _ = writeln!(
                r,
                "| {} | {:.0} | {:.0} | {:.1} |",
                m.target.name(),
                m.just_connected_bytes,
                m.settled_bytes,
                m.settled_rss_kib as f64 / 1024.0
            );
        }
    }
    r
}

pub(super) fn write_outputs(
    options: &PoolerOptions,
    samples: &[Sample],
    report: &str,
) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "pooler")?;
    let mut csv = String::from("round,workload,clients,target,tps,latency_avg_ms,latency_p99_ms,proxy_cpu_us_per_txn,proxy_user_us_per_txn,proxy_system_us_per_txn,proxy_voluntary_switches_per_txn,proxy_involuntary_switches_per_txn,primary_cpu_us_per_txn,transactions,failed,error\n");
    for s in samples {
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.1},{:.4},{:.4},{},{},{},{},{},{},{},{},{}",
            s.round + 1,
            s.workload.name(),
            s.clients,
            s.target.name(),
            s.result.tps,
            s.result.latency_avg_ms,
            s.result.latency_p99_ms,
            csv_number(s.proxy_cost.map(|c| c.cpu_us()), 2),
            csv_number(s.proxy_cost.map(|c| c.user_us), 2),
            csv_number(s.proxy_cost.map(|c| c.system_us), 2),
            csv_number(s.proxy_cost.map(|c| c.voluntary_switches), 2),
            csv_number(s.proxy_cost.map(|c| c.involuntary_switches), 2),
            csv_number(s.server_cpu_us_per_txn, 2),
            s.result.transactions,
            s.result.failed,
            csv_text(s.error.as_deref())
        );
    }
    write_csv_and_report(&prefix, &csv, report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(round: u32, target: Target, user_us: f64, system_us: f64) -> Sample {
        Sample {
            round,
            workload: Workload::SelectSimple,
            clients: 32,
            target,
            result: PgbenchResult {
                transactions: 1000,
                tps: 100.0,
                ..PgbenchResult::default()
            },
            proxy_cost: Some(procstat::CpuPerTxn {
                user_us,
                system_us,
                voluntary_switches: 0.25,
                involuntary_switches: 0.5,
            }),
            server_cpu_us_per_txn: None,
            error: None,
        }
    }

    #[test]
    fn the_cpu_split_shows_medians_by_mode_and_the_kernel_floor() {
        let options = super::super::pooler_options(&[
            "--targets",
            "pgherd,pgbouncer",
            "--workloads",
            "select-simple",
            "--clients",
            "32",
        ]);
        let samples = [
            sample(0, Target::Pgherd, 4.0, 16.0),
            sample(1, Target::Pgherd, 9.0, 17.0),
            sample(2, Target::Pgherd, 3.0, 15.0),
            sample(0, Target::Pgbouncer, 2.0, 18.0),
            sample(1, Target::Pgbouncer, 2.0, 18.0),
            sample(2, Target::Pgbouncer, 2.0, 18.0),
        ];
        let mut r = String::new();
        write_cpu_split(&mut r, &options, &samples);
        // Medians per column: user 4, system 16; PgBouncer's whole cost 20, so 16 / 20.
        assert!(
            r.contains("| select-simple | 32 | 4.0 / 16.0 | 2.0 / 18.0 | 0.25 / 0.50 | 0.25 / 0.50 | 0.80 |"),
            "{r}"
        );
    }
}
