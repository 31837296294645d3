//! Running pgbench and reading its results: throughput, mean latency, and the 99th percentile
//! from its per-transaction log.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// One pgbench run's figures.
#[derive(Debug, Clone, Default)]
pub struct PgbenchResult {
    pub transactions: u64,
    pub failed: u64,
    pub tps: f64,
    pub latency_avg_ms: f64,
    pub latency_p50_ms: f64,
    pub latency_p95_ms: f64,
    pub latency_p99_ms: f64,
    /// How long pgbench took to open its connections before the run (not in `tps`).
    pub initial_connection_ms: f64,
}

impl PgbenchResult {
    /// Throughput with the connections' opening counted in the run's time, as pgbench before
    /// PostgreSQL 14 reported it ("including connections establishing") and the thesis read it.
    pub fn tps_including_connections(&self) -> f64 {
        if self.tps <= 0.0 {
            return self.tps;
        }
        let run_s = self.transactions as f64 / self.tps;
        self.transactions as f64 / (run_s + self.initial_connection_ms / 1000.0)
    }
}

pub struct Pgbench {
    pub binary: PathBuf,
    /// Where per-transaction logs go (cleared after each run).
    pub log_dir: PathBuf,
}

impl Pgbench {
    /// Runs pgbench with `args` against `url` and parses its report. `sample` (0..1] is the
    /// fraction of transactions logged for percentiles.
    pub fn run(
        &self,
        url: &str,
        args: &[String],
        sample: f64,
        timeout: Duration,
    ) -> Result<PgbenchResult, String> {
        let prefix = self
            .log_dir
            .join(format!("pgbench-{}", rand::random::<u32>()));
        let mut cmd = Command::new(&self.binary);
        cmd.args(args)
            .arg("-n")
            .arg("-l")
            .arg(format!("--log-prefix={}", prefix.display()))
            .arg(format!("--sampling-rate={sample}"))
            .arg(url)
            .env_remove("PGPASSWORD")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd
            .spawn()
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        let out = wait_with_timeout(child, "pgbench", timeout)?;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut latencies = read_latencies(&self.log_dir, &prefix);
        if !out.status.success() {
            return Err(format!(
                "pgbench {} failed: {}",
                args.join(" "),
                tail(&text, 8)
            ));
        }
        let mut result = parse_report(&text)
            .ok_or_else(|| format!("cannot read pgbench's report:\n{}", tail(&text, 12)))?;
        result.latency_p50_ms = percentile(&mut latencies, 0.50) / 1000.0;
        result.latency_p95_ms = percentile(&mut latencies, 0.95) / 1000.0;
        result.latency_p99_ms = percentile(&mut latencies, 0.99) / 1000.0;
        Ok(result)
    }
}

/// Waits for `child` (a program named `what`, for the error) at most `timeout`, then kills it.
/// Its output must be small: the pipes are read only once it has exited.
pub(super) fn wait_with_timeout(
    mut child: std::process::Child,
    what: &str,
    timeout: Duration,
) -> Result<std::process::Output, String> {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => return child.wait_with_output().map_err(|e| e.to_string()),
            Ok(None) if std::time::Instant::now() > deadline => {
                let _ = child.kill();
                return Err(format!(
                    "{what} did not finish within {} s",
                    timeout.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.to_string()),
        }
    }
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// The number after `key` on its line; of `done/planned` (pgbench -t), the first.
fn number_after(text: &str, key: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.trim_start().starts_with(key))?;
    line[line.find(key)? + key.len()..]
        .split_whitespace()
        .next()?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// Reads pgbench's summary (PostgreSQL 13+ wording).
pub fn parse_report(text: &str) -> Option<PgbenchResult> {
    Some(PgbenchResult {
        transactions: number_after(text, "number of transactions actually processed:")? as u64,
        failed: number_after(text, "number of failed transactions:").unwrap_or(0.0) as u64,
        tps: number_after(text, "tps =")?,
        latency_avg_ms: number_after(text, "latency average =")?,
        latency_p50_ms: 0.0,
        latency_p95_ms: 0.0,
        latency_p99_ms: 0.0,
        initial_connection_ms: number_after(text, "initial connection time =").unwrap_or(0.0),
    })
}

/// Latencies in microseconds from the per-transaction logs, which are then removed.
fn read_latencies(dir: &Path, prefix: &Path) -> Vec<f64> {
    let stem = prefix
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with(&stem) {
            continue;
        }
        if let Ok(text) = std::fs::read_to_string(entry.path()) {
            // client_id transaction_no time_us script_no epoch epoch_us
            out.extend(
                text.lines()
                    .filter_map(|l| l.split_whitespace().nth(2)?.parse::<f64>().ok()),
            );
        }
        let _ = std::fs::remove_file(entry.path());
    }
    out
}

pub fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((values.len() as f64 - 1.0) * q).round() as usize;
    values[rank.min(values.len() - 1)]
}

pub fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    percentile(&mut v, 0.5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_pgbench_15_report() {
        let text = "transaction type: <builtin: select only>\nnumber of transactions actually processed: 4521\n\
                    number of failed transactions: 0 (0.000%)\nlatency average = 0.221 ms\n\
                    initial connection time = 3.812 ms\ntps = 4518.330000 (without initial connection time)\n";
        let r = parse_report(text).unwrap();
        assert_eq!(r.transactions, 4521);
        assert_eq!(r.failed, 0);
        assert!((r.tps - 4518.33).abs() < 1e-6);
        assert!((r.latency_avg_ms - 0.221).abs() < 1e-9);
        assert!((r.initial_connection_ms - 3.812).abs() < 1e-9);
        // 4521 transactions took 1.000590 s, plus 3.812 ms of connecting.
        assert!(
            (r.tps_including_connections() - 4521.0 / (4521.0 / 4518.33 + 0.003812)).abs() < 1e-6
        );
        assert!(r.tps_including_connections() < r.tps);
        let fixed = text.replace("processed: 4521", "processed: 4521/4600");
        assert_eq!(parse_report(&fixed).unwrap().transactions, 4521);
        assert!(parse_report("garbage").is_none());
    }

    #[test]
    fn percentiles_and_medians() {
        let mut v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&mut v, 0.99), 99.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert!(median(&[]).is_nan());
    }
}
