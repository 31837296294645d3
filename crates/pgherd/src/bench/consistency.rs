//! `pgherd bench consistency`: how fast `pgherd check-consistency` reads a pgbench database on
//! a primary and two streaming replicas, and what it costs a concurrent pgbench (TPC-B, on
//! the primary). Each round runs pgbench with a progress line a second, starts the check
//! after a lead-in, and compares the throughput of the seconds the check ran with the
//! seconds it did not; the check's rows per second alone comes from a run before the rounds.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::pgbench::median;
use super::targets::{BenchCluster, BenchUser};
use super::{pgbench_database, work_dir};

#[derive(clap::Args, Debug)]
pub struct ConsistencyOptions {
    /// pgbench scale (100: 10 million rows in pgbench_accounts).
    #[arg(long, default_value_t = 100)]
    scale: u32,
    /// pgbench clients writing beside the check.
    #[arg(long, default_value_t = 8)]
    clients: u32,
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Passed to the check.
    #[arg(long, default_value_t = 10_000)]
    chunk_rows: u64,
    /// Passed to the check (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_rows_per_s: u64,
    /// Seconds of pgbench before and after the check in each round.
    #[arg(long, default_value_t = 15)]
    lead_s: u64,
    /// Where the cluster lives [default: a temporary directory].
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// One check's figures, from its JSON report.
struct CheckRun {
    rows: u64,
    seconds: f64,
    /// Seconds from the start of pgbench.
    started_s: f64,
    same: bool,
}

pub fn run(options: ConsistencyOptions) -> Result<(), String> {
    let (dir, _tmp) = work_dir(options.dir.as_ref())?;
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let pgbench = binaries.tool("pgbench");
    let user = BenchUser::new("bench", 4096);
    eprintln!(
        "creating a primary and two replicas in {} ...",
        dir.display()
    );
    let cluster = BenchCluster::create(&dir, 2, Vec::new(), &[&user])?;
    pgbench_database(&cluster, &user, &pgbench, options.scale)?;
    let url = user.url(cluster.primary_port(), "bench");
    let config = write_config(&dir, &cluster)?;

    eprintln!("the check alone ...");
    let alone = run_check(&config, &options, Instant::now())?;
    eprintln!("  {} rows per node in {:.1} s", alone.rows, alone.seconds);
    let mut rows = Vec::new();
    for round in 1..=options.rounds {
        eprintln!(
            "round {round}: pgbench with the check started after {} s ...",
            options.lead_s
        );
        rows.push(round_with_load(&pgbench, &url, &config, &options, &alone)?);
    }
    print!("{}", report(&options, &alone, &rows));
    Ok(())
}

/// A config naming the three nodes and the superuser, for the check.
fn write_config(dir: &std::path::Path, cluster: &BenchCluster) -> Result<PathBuf, String> {
    let mut config = format!(
        "[pgherd]\nlisten = [\"127.0.0.1:1\"]\n\n[cluster]\nuser = \"postgres\"\npassword = \"{}\"\n\n",
        cluster.superuser_password
    );
    for node in &cluster.cluster.nodes {
        config.push_str(&format!(
            "[[nodes]]\nname = \"{}\"\nhost = \"{}\"\nport = {}\n\n",
            node.name, node.host, node.port
        ));
    }
    config.push_str("[databases.bench]\n");
    let path = dir.join("check-consistency.toml");
    pgherd_config::write_private_file(&path, &config).map_err(|e| e.to_string())?;
    Ok(path)
}

fn run_check(
    config: &std::path::Path,
    options: &ConsistencyOptions,
    since: Instant,
) -> Result<CheckRun, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let started = Instant::now();
    let out = Command::new(exe)
        .arg("check-consistency")
        .arg("--config")
        .arg(config)
        .args(["--database", "bench", "--json"])
        .args(["--chunk-rows", &options.chunk_rows.to_string()])
        .args(["--max-rows-per-s", &options.max_rows_per_s.to_string()])
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    let answer: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| format!("the check printed no report ({e})"))?;
    let same = answer["tables"].as_array().is_some_and(|t| {
        t.iter()
            .all(|t| t["differing"].as_array().is_some_and(|d| d.is_empty()))
    });
    Ok(CheckRun {
        rows: answer["rows_read"].as_u64().unwrap_or(0),
        seconds,
        started_s: started.duration_since(since).as_secs_f64(),
        same,
    })
}

/// One round's figures.
struct Round {
    check: CheckRun,
    tps_without: f64,
    tps_with: f64,
}

fn round_with_load(
    pgbench: &std::path::Path,
    url: &str,
    config: &std::path::Path,
    options: &ConsistencyOptions,
    alone: &CheckRun,
) -> Result<Round, String> {
    // Long enough for the check to end well inside it even if the load slows it threefold.
    let duration_s = options.lead_s * 2 + (alone.seconds * 3.0).ceil() as u64;
    let t0 = Instant::now();
    let child = Command::new(pgbench)
        .args(["-n", "-P", "1", "-j", "2"])
        .args(["-c", &options.clients.to_string()])
        .args(["-T", &duration_s.to_string()])
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run pgbench: {e}"))?;
    std::thread::sleep(Duration::from_secs(options.lead_s));
    let check = run_check(config, options, t0)?;
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    let progress = parse_progress(&String::from_utf8_lossy(&out.stderr));
    let (during, outside): (Vec<_>, Vec<_>) = progress.iter().partition(|(at_s, _)| {
        // A progress line covers the second before it.
        *at_s - 1.0 >= check.started_s && *at_s <= check.started_s + check.seconds
    });
    let mean =
        |v: &[&(f64, f64)]| v.iter().map(|(_, tps)| tps).sum::<f64>() / v.len().max(1) as f64;
    Ok(Round {
        tps_without: mean(&outside),
        tps_with: mean(&during),
        check,
    })
}

/// pgbench's `-P` lines: (seconds since its start, TPS in the second before).
pub(super) fn parse_progress(stderr: &str) -> Vec<(f64, f64)> {
    stderr
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix("progress: ")?;
            let mut fields = rest.split(", ");
            let at = fields.next()?.strip_suffix(" s")?.parse().ok()?;
            let tps = fields.next()?.strip_suffix(" tps")?.parse().ok()?;
            Some((at, tps))
        })
        .collect()
}

fn report(options: &ConsistencyOptions, alone: &CheckRun, rounds: &[Round]) -> String {
    let rate = |c: &CheckRun| c.rows as f64 / c.seconds.max(1e-3);
    let mut out = format!(
        "\n## check-consistency on pgbench scale {} (primary + 2 streaming replicas), {} pgbench TPC-B clients beside it, chunks of {} rows\n\n",
        options.scale, options.clients, options.chunk_rows
    );
    out.push_str(&format!(
        "check alone: {} rows per node in {:.1} s = {:.0} rows/s{}\n\n",
        alone.rows,
        alone.seconds,
        rate(alone),
        if alone.same {
            ""
        } else {
            " (REPORTED DIFFERENCES)"
        }
    ));
    out.push_str("| round | check under load, s | rows/s | pgbench TPS without the check | with it | ratio |\n|---|---|---|---|---|---|\n");
    for (i, r) in rounds.iter().enumerate() {
        out.push_str(&format!(
            "| {} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} |{}\n",
            i + 1,
            r.check.seconds,
            rate(&r.check),
            r.tps_without,
            r.tps_with,
            r.tps_with / r.tps_without.max(1e-9),
            if r.check.same {
                ""
            } else {
                " differences reported!"
            }
        ));
    }
    let med = |f: &dyn Fn(&Round) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    out.push_str(&format!(
        "| median | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} |\n",
        med(&|r| r.check.seconds),
        med(&|r| rate(&r.check)),
        med(&|r| r.tps_without),
        med(&|r| r.tps_with),
        med(&|r| r.tps_with / r.tps_without.max(1e-9)),
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn progress_lines_read() {
        let text = "starting vacuum...\nprogress: 1.0 s, 812.9 tps, lat 9.8 ms stddev 4.1, 0 failed\nprogress: 2.0 s, 799.0 tps, lat 10.0 ms stddev 3.9, 0 failed\n";
        assert_eq!(parse_progress(text), vec![(1.0, 812.9), (2.0, 799.0)]);
    }
}
