//! The `pgherd-2p` target of `pgherd bench pooler`: the clients split between two pgherd
//! processes of one worker each, both halves run at the same time and read as one run. Beside
//! `pgherd-w2` (one process, two workers) it tells what a second worker costs because state is
//! shared from what it costs because a second poller shares the machine.

use super::super::outcome;
use super::super::pgbench::PgbenchResult;
use super::{pgbench_args, pgbench_timeout, Fixture, PoolerOptions, Sample, Target};
use super::{procstat, ProxyProcess, ServerCpu, Workload};

pub(super) fn measure(
    fixture: &Fixture,
    options: &PoolerOptions,
    (round, workload, clients): (u32, Workload, u32),
) -> Result<Sample, String> {
    let processes = fixture
        .two_processes
        .as_ref()
        .ok_or("the two pgherd processes are not running")?;
    let halves = split(clients, options.client_threads);
    let cpu_before: Vec<_> = processes.iter().map(ProxyProcess::cpu_use).collect();
    let server_cpu = ServerCpu::start(&fixture.cluster);
    let timeout = pgbench_timeout(options);
    let user = fixture.user_for(workload);
    let runs: Vec<Result<PgbenchResult, String>> = std::thread::scope(|scope| {
        let handles: Vec<_> = processes
            .iter()
            .zip(halves)
            .filter(|(_, (clients, _))| *clients > 0)
            .map(|(process, (clients, threads))| {
                let args = pgbench_args(
                    fixture,
                    workload,
                    clients,
                    threads,
                    super::RunLength::Seconds(options.duration_s),
                );
                let url = user.url(process.port, "bench");
                scope.spawn(move || fixture.pgbench.run(&url, &args, 0.25, timeout))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a pgbench thread panicked".into()))
            })
            .collect()
    });
    let run = runs
        .into_iter()
        .try_fold(None, |merged: Option<PgbenchResult>, run| {
            let run = run?;
            Ok::<_, String>(Some(match merged {
                Some(merged) => merge(&merged, &run),
                None => run,
            }))
        })
        .and_then(|merged| merged.ok_or_else(|| "no clients to run".to_owned()));
    let (result, error) = outcome(run);
    let used = processes
        .iter()
        .zip(cpu_before)
        .map(|(p, before)| p.cpu_use().since(&before))
        .fold(procstat::CpuUse::default(), |sum, one| sum + one);
    let proxy_cost = used.per_transaction(result.transactions);
    Ok(Sample {
        round,
        workload,
        clients,
        target: Target::PgherdTwoProcesses,
        server_cpu_us_per_txn: server_cpu.per_transaction(result.transactions),
        result,
        proxy_cost,
        error,
    })
}

/// (clients, pgbench threads) for each process: the clients halved (the first gets the odd
/// one), the threads too, at least one each and never more than the half's clients.
fn split(clients: u32, client_threads: u32) -> [(u32, u32); 2] {
    let first = clients.div_ceil(2);
    let second = clients / 2;
    let threads = (client_threads / 2).max(1);
    [
        (first, threads.min(first.max(1))),
        (second, threads.min(second.max(1))),
    ]
}

/// Two pgbench runs over the same seconds read as one: counts and rates add up, the mean
/// latency is weighted by transactions, and each percentile is the larger of the two (an upper
/// bound: the halves' logs are not merged).
fn merge(a: &PgbenchResult, b: &PgbenchResult) -> PgbenchResult {
    let transactions = a.transactions + b.transactions;
    let weighted = |x: f64, y: f64| match transactions {
        0 => f64::NAN,
        n => (x * a.transactions as f64 + y * b.transactions as f64) / n as f64,
    };
    PgbenchResult {
        transactions,
        failed: a.failed + b.failed,
        tps: a.tps + b.tps,
        latency_avg_ms: weighted(a.latency_avg_ms, b.latency_avg_ms),
        latency_p50_ms: a.latency_p50_ms.max(b.latency_p50_ms),
        latency_p95_ms: a.latency_p95_ms.max(b.latency_p95_ms),
        latency_p99_ms: a.latency_p99_ms.max(b.latency_p99_ms),
        initial_connection_ms: a.initial_connection_ms.max(b.initial_connection_ms),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_and_threads_split_in_halves() {
        assert_eq!(split(32, 2), [(16, 1), (16, 1)]);
        assert_eq!(split(9, 4), [(5, 2), (4, 2)]);
        assert_eq!(split(1, 2), [(1, 1), (0, 1)]);
    }

    #[test]
    fn halves_read_as_one_run() {
        let run = |transactions, tps, avg, p99| PgbenchResult {
            transactions,
            failed: 1,
            tps,
            latency_avg_ms: avg,
            latency_p50_ms: avg,
            latency_p95_ms: p99,
            latency_p99_ms: p99,
            initial_connection_ms: 3.0,
        };
        let merged = merge(&run(300, 30.0, 1.0, 4.0), &run(100, 10.0, 3.0, 2.0));
        assert_eq!(merged.transactions, 400);
        assert_eq!(merged.failed, 2);
        assert_eq!(merged.tps, 40.0);
        assert!((merged.latency_avg_ms - 1.5).abs() < 1e-9);
        assert_eq!(merged.latency_p99_ms, 4.0);
    }
}
