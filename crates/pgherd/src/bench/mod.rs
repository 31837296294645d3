//! `pgherd bench`: benchmarks that measure pgherd side by side with its peers in the same run.
//! Figures are printed and written as CSV and Markdown; nothing here asserts a speed.

mod cache;
mod cgroup;
mod consistency;
mod durability;
mod pgbench;
mod pooler;
mod procstat;
mod repmgr;
mod scaling;
mod shard_move;
mod shards;
mod soak;
mod svg;
pub(crate) mod targets;
mod workloads;
mod workloads_failover;

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Subcommand;
use pgbench::PgbenchResult;
use pooler::PoolerOptions;

#[derive(Subcommand)]
pub enum BenchCommand {
    /// pgbench against direct PostgreSQL, pgherd and PgBouncer (transaction pooling), interleaved,
    /// plus resident memory per idle client.
    Pooler(PoolerOptions),
    /// Read scaling over 1 to 4 nodes, each under its own CPU quota: one node direct, pgherd and
    /// Pgpool-II (streaming replication, load balancing) at 1–120 clients, interleaved; CSV,
    /// SVG plots and a ratio table.
    Scaling(scaling::ScalingOptions),
    /// The seeds' benchmarks 3 and 4: index-scan selects by aid and a sequential scan
    /// aggregating over pgbench_accounts, through a sharded pgherd over 1–4 one-node shards
    /// beside the same data on a master/slave cluster of 1–4 nodes behind pgherd, every node
    /// under a CPU quota, interleaved; CSV, SVG plots and a ratio table.
    Shards(scaling::ScalingOptions),
    /// The result cache: a hot-read and a 90/10 read/write pgbench script (Zipf-skewed keys)
    /// through pgherd without and with its cache and through Pgpool-II with its in-memory
    /// query cache, interleaved; TPS, hit ratio, CPU per transaction of the middleware and of
    /// PostgreSQL.
    Cache(cache::CacheOptions),
    /// Thousands of clients for a long time (transaction and session mode, reads and writes,
    /// prepared statements, clients killed in a transaction, cancels) while replicas restart
    /// and a switchover happens; pgherd's memory, descriptors, server connections and waits
    /// read every second; fails if one grows without bound after the warm-up.
    Soak(soak::SoakOptions),
    /// `pgherd check-consistency` on a pgbench database (primary and two streaming replicas):
    /// rows per second alone and beside a pgbench TPC-B load, and that load's throughput while
    /// the check runs and while it does not.
    Consistency(consistency::ConsistencyOptions),
    /// `pgherd shard move` under pgbench load: two one-node shards behind a sharded pgherd,
    /// shard 1 moved to a third cluster while pgbench writes through pgherd; failed client
    /// transactions, the cut-over's pause, throughput around the move, and whether every
    /// committed transaction is in the data afterwards.
    ShardMove(shard_move::ShardMoveOptions),
    /// `pgherd shard split` under pgbench load: two one-node shards with `pgbench_accounts`
    /// by `aid` ranges, the last split at the middle of its range into two new clusters while
    /// pgbench writes through pgherd; the same figures as `shard-move`.
    ShardSplit(shard_move::ShardMoveOptions),
    /// The seeds' replica experiment (002) with each durability mode's price on the writes:
    /// 0 to N replicas (optionally each node under a CPU quota), TPC-B through pgherd under
    /// async, sync and remote_apply with k = 1..N confirming standbys, select-only per replica
    /// count; CSV, SVG plots and a table.
    Durability(durability::DurabilityOptions),
    /// Seed 001's six workloads (read only with and without data, inserts and updates,
    /// deletes, and the two read/write mixes) through pgherd and through HAProxy in front of
    /// one PgBouncer per node, on a primary and two replicas, interleaved; TPS and latency
    /// percentiles; CSV, SVG plots and a table.
    Workloads(workloads::WorkloadsOptions),
}

pub fn run(command: BenchCommand) -> Result<(), String> {
    match command {
        BenchCommand::Pooler(options) => pooler::run(options),
        BenchCommand::Scaling(options) => scaling::scaling(options),
        BenchCommand::Shards(options) => scaling::shards(options),
        BenchCommand::Cache(options) => cache::cache(options),
        BenchCommand::Soak(options) => soak::soak(options),
        BenchCommand::Consistency(options) => consistency::run(options),
        BenchCommand::ShardMove(options) => shard_move::run(options, shard_move::Reshape::Move),
        BenchCommand::ShardSplit(options) => shard_move::run(options, shard_move::Reshape::Split),
        BenchCommand::Durability(options) => durability::run(options),
        BenchCommand::Workloads(options) => workloads::run(options),
    }
}

pub(crate) mod tempfile_dir {
    /// A directory removed when dropped.
    pub struct TempDir(pub std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn fmt(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "–".into()
    }
}

/// `<prefix>.csv` and `<prefix>.md`, and where they went.
fn write_csv_and_report(prefix: &std::path::Path, csv: &str, report: &str) -> Result<(), String> {
    let csv_path = prefix.with_extension("csv");
    std::fs::write(&csv_path, csv).map_err(|e| format!("{}: {e}", csv_path.display()))?;
    let md_path = prefix.with_extension("md");
    std::fs::write(&md_path, report).map_err(|e| format!("{}: {e}", md_path.display()))?;
    eprintln!("wrote {} and {}", csv_path.display(), md_path.display());
    Ok(())
}

/// Every (round, workload, clients, target) run of an interleaved benchmark, in the order
/// they run: the targets' order rotates each round so no target always runs first (a warm
/// cache, the machine's other load) and medians compare like with like.
fn run_order<W: Copy, T: Copy>(
    rounds: u32,
    workloads: &[W],
    clients: &[u32],
    targets: &[T],
) -> Vec<(u32, W, u32, T)> {
    let mut order = Vec::new();
    for round in 0..rounds {
        for &workload in workloads {
            for &count in clients {
                for k in 0..targets.len() {
                    let target = targets[(k + round as usize) % targets.len()];
                    order.push((round, workload, count, target));
                }
            }
        }
    }
    order
}

/// The benchmark's working directory: `dir` if given, otherwise a temporary one removed when
/// the returned guard drops.
pub(crate) fn work_dir(
    dir: Option<&PathBuf>,
) -> Result<(PathBuf, Option<tempfile_dir::TempDir>), String> {
    let (dir, tmp) = match dir {
        Some(d) => (d.clone(), None),
        None => {
            let d = std::env::temp_dir().join(format!("pgherd-bench-{}", std::process::id()));
            (d.clone(), Some(tempfile_dir::TempDir(d)))
        }
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok((dir, tmp))
}

/// A `bench` database on `cluster`'s primary owned by `owner`, holding pgbench's tables at
/// `scale`, loaded as `owner`.
fn pgbench_database(
    cluster: &targets::BenchCluster,
    owner: &targets::BenchUser,
    pgbench: &std::path::Path,
    scale: u32,
) -> Result<(), String> {
    cluster.sql(
        "postgres",
        &format!("CREATE DATABASE bench OWNER {}", owner.name),
    )?;
    pgbench_init(pgbench, &owner.url(cluster.primary_port(), "bench"), scale)
}

/// `pgbench -i` at `scale`.
fn pgbench_init(pgbench: &std::path::Path, url: &str, scale: u32) -> Result<(), String> {
    eprintln!("pgbench -i -s {scale} ...");
    let init = std::process::Command::new(pgbench)
        .args(["-i", "-q", "-s", &scale.to_string()])
        .arg(url)
        .output()
        .map_err(|e| e.to_string())?;
    if !init.status.success() {
        return Err(format!(
            "pgbench -i failed: {}",
            String::from_utf8_lossy(&init.stderr)
        ));
    }
    Ok(())
}

/// A run's figures, or figures of NaN and the first line of pgbench's complaint. A peer failing
/// a workload is a result too (PgBouncer before 1.21 cannot do protocol-level prepared
/// statements in transaction mode).
fn outcome(run: Result<PgbenchResult, String>) -> (PgbenchResult, Option<String>) {
    match run {
        Ok(result) => (result, None),
        Err(e) => {
            let first = e
                .lines()
                .find(|l| l.contains("ERROR") || l.contains("error"))
                .unwrap_or(&e)
                .trim()
                .to_owned();
            let nan = PgbenchResult {
                tps: f64::NAN,
                latency_avg_ms: f64::NAN,
                latency_p50_ms: f64::NAN,
                latency_p95_ms: f64::NAN,
                latency_p99_ms: f64::NAN,
                ..Default::default()
            };
            (nan, Some(first))
        }
    }
}

/// The report's list of failed runs, each once, if there were any.
fn write_failed_runs(r: &mut String, lines: impl Iterator<Item = String>) {
    let mut errors: Vec<String> = lines.collect();
    errors.dedup();
    if !errors.is_empty() {
        let _ = writeln!(r, "\nFailed runs:\n\n{}", errors.join("\n"));
    }
}

/// `out/<name>-<unix seconds>`, the stem every output file of one run shares.
fn output_prefix(out: &std::path::Path, name: &str) -> Result<PathBuf, String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(out.join(format!("{name}-{stamp}")))
}

/// A CSV number with `decimals` places, empty when there is none.
fn csv_number(v: Option<f64>, decimals: usize) -> String {
    v.map(|v| format!("{v:.decimals$}")).unwrap_or_default()
}

/// A free-text CSV field: quoted, inner quotes made single.
fn csv_text(text: Option<&str>) -> String {
    text.map(|e| format!("\"{}\"", e.replace('"', "'")))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn run_order_rotates_the_targets_each_round() {
        let order = super::run_order(2, &["w"], &[1, 8], &['a', 'b', 'c']);
        let targets: String = order.iter().map(|r| r.3).collect();
        assert_eq!(targets, "abcabcbcabca");
        assert!(order[..6].iter().all(|r| r.0 == 0) && order[6..].iter().all(|r| r.0 == 1));
        assert_eq!(order[3].2, 8);
    }
}
