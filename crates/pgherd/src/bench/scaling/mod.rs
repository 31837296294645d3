//! `pgherd bench scaling`: the seeds' load-balancing experiment on one machine. Each PostgreSQL
//! node runs under its own CPU quota so that 1 to 4 nodes behave like small separate servers;
//! pgbench reads and writes through pgherd and through Pgpool-II (streaming replication, load
//! balancing on) at growing client counts, interleaved, against one node direct as the base.
//!
//! `pgherd bench shards` is the same run with the seeds' benchmarks 3 and 4 (index-scan selects
//! by `aid`, a sequential scan aggregating over `pgbench_accounts`) through a sharded pgherd
//! over 1–4 one-node shards ([`super::shards`]) beside the master/slave cluster behind an
//! unsharded pgherd.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};

use super::cgroup::{CpuQuotas, MemoryCaps, Periods};
use super::pgbench::{Pgbench, PgbenchResult};
use super::shards::{self, ProxySettings, ShardClusters};
use super::targets::{
    start_pgherd, start_pgpool, BenchCluster, BenchUser, PgherdSetup, ProxyProcess,
};
use super::tempfile_dir;
use super::{outcome, pgbench_database, work_dir};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum ScalingWorkload {
    /// pgbench -S: one primary-key lookup per transaction.
    IndexScan,
    /// pgbench -S with pgbench_accounts' primary key dropped for the block, so every lookup
    /// scans the table: the thesis's benchmark 2 ("the same query with indexes dropped").
    IndexlessScan,
    /// A count over a table without an index.
    SeqScan,
    /// pgbench's TPC-B-like writes.
    Tpcb,
    /// A sequential scan aggregating over pgbench_accounts (count and sum of one branch's
    /// accounts; bid has no index): on every shard at once through a sharded endpoint.
    Aggregate,
}

impl ScalingWorkload {
    pub(super) fn name(self) -> &'static str {
        match self {
            ScalingWorkload::IndexScan => "index-scan",
            ScalingWorkload::IndexlessScan => "indexless-scan",
            ScalingWorkload::SeqScan => "seq-scan",
            ScalingWorkload::Tpcb => "tpcb",
            ScalingWorkload::Aggregate => "aggregate",
        }
    }

    fn reads_only(self) -> bool {
        self != ScalingWorkload::Tpcb
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum ScalingTarget {
    /// The primary alone, no middleware: the one-node base line.
    Direct,
    Pgherd,
    Pgpool,
    /// A sharded pgherd over as many one-node shards as the block has nodes.
    PgherdShards,
}

impl ScalingTarget {
    fn name(self) -> &'static str {
        match self {
            ScalingTarget::Direct => "direct",
            ScalingTarget::Pgherd => "pgherd",
            ScalingTarget::Pgpool => "pgpool",
            ScalingTarget::PgherdShards => "pgherd-shards",
        }
    }
}

/// The middlewares, in the order reports list them.
const PROXIES: [ScalingTarget; 3] = [
    ScalingTarget::Pgherd,
    ScalingTarget::PgherdShards,
    ScalingTarget::Pgpool,
];

#[derive(Args, Debug)]
pub struct ScalingOptions {
    /// Node counts (the primary plus replicas) to measure; the cluster has the largest.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3,4")]
    nodes: Vec<usize>,
    #[arg(long, value_delimiter = ',', default_value = "1,10,30,60,90,120")]
    clients: Vec<u32>,
    /// Default: index-scan,seq-scan,tpcb (`bench shards`: index-scan,aggregate).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<ScalingWorkload>,
    /// Default: direct,pgherd,pgpool (`bench shards`: direct,pgherd,pgherd-shards).
    #[arg(long, value_delimiter = ',')]
    targets: Vec<ScalingTarget>,
    /// Seconds per pgbench run.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// The thesis's method: each client runs this many transactions (pgbench -t, not
    /// --duration-s), TPS counts the connections' opening, and rounds are averaged, not
    /// taken by median.
    #[arg(long)]
    transactions_per_client: Option<u32>,
    /// Each point runs this many times, interleaved; medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// CPU quota of every PostgreSQL node, in percent of one core (0 = no quota).
    #[arg(long, default_value_t = 20)]
    cpu_quota_percent: u32,
    /// Memory cap of every PostgreSQL node in MiB, its page cache included (cgroup v1; 0 = no
    /// cap): with a scale whose data exceeds it, reads go to the disk as on a server whose
    /// data exceeds its RAM (seed 003). shared_buffers is then a quarter of the cap.
    #[arg(long, default_value_t = 0)]
    node_memory_mb: u64,
    /// pgbench scale factor (`bench shards`: 2 unless given).
    #[arg(long)]
    scale: Option<u32>,
    /// Rows in the table the sequential-scan workload counts over.
    #[arg(long, default_value_t = 10_000)]
    seq_scan_rows: u32,
    /// pgherd's server connections per node.
    #[arg(long, default_value_t = 20)]
    pool_size: u32,
    /// pgherd's read balancing policy.
    #[arg(long, default_value = "least_outstanding")]
    balance: String,
    /// pgherd worker threads (0 = pgherd's default).
    #[arg(long, default_value_t = 0)]
    pgherd_workers: usize,
    /// Let Pgpool-II choose a node per statement instead of per session (its default).
    #[arg(long)]
    pgpool_statement_level: bool,
    /// Where CSV, Markdown and SVG results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Working directory for the cluster (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

struct Sample {
    round: u32,
    nodes: usize,
    workload: ScalingWorkload,
    clients: u32,
    target: ScalingTarget,
    result: PgbenchResult,
    /// Mean over the nodes in use of the share of CPU periods that ran out of quota.
    throttled: Option<f64>,
    /// KiB read from the machine's disks per transaction during the run.
    disk_read_kib_per_txn: Option<f64>,
    error: Option<String>,
}

struct Fixture {
    /// Declared (so dropped) before the cluster: nodes leave their groups before they stop,
    /// so the groups can be removed.
    quotas: Option<CpuQuotas>,
    memory_caps: Option<MemoryCaps>,
    cluster: BenchCluster,
    user: BenchUser,
    pgbench: Pgbench,
    seq_scan_script: PathBuf,
    aggregate_script: PathBuf,
    /// With the pgherd-shards target: one-node clusters, one per shard.
    shards: Option<ShardClusters>,
    _tmp: Option<tempfile_dir::TempDir>,
}

impl ScalingOptions {
    fn scale(&self) -> u32 {
        self.scale.unwrap_or(10)
    }
}

/// `pgherd bench shards`: the scaling run with the sharding workloads and targets.
pub fn shards(mut options: ScalingOptions) -> Result<(), String> {
    if options.workloads.is_empty() {
        options.workloads = vec![ScalingWorkload::IndexScan, ScalingWorkload::Aggregate];
    }
    if options.targets.is_empty() {
        options.targets = vec![
            ScalingTarget::Direct,
            ScalingTarget::Pgherd,
            ScalingTarget::PgherdShards,
        ];
    }
    options.scale = Some(options.scale.unwrap_or(2));
    scaling(options)
}

pub fn scaling(mut options: ScalingOptions) -> Result<(), String> {
    if options.workloads.is_empty() {
        options.workloads = vec![
            ScalingWorkload::IndexScan,
            ScalingWorkload::SeqScan,
            ScalingWorkload::Tpcb,
        ];
    }
    if options.targets.is_empty() {
        options.targets = vec![
            ScalingTarget::Direct,
            ScalingTarget::Pgherd,
            ScalingTarget::Pgpool,
        ];
    }
    let mut nodes = options.nodes.clone();
    nodes.sort_unstable();
    nodes.dedup();
    if nodes.first() == Some(&0) || nodes.is_empty() {
        return Err("--nodes takes counts of 1 or more".into());
    }
    if options.workloads.contains(&ScalingWorkload::IndexlessScan)
        && options.targets.contains(&ScalingTarget::PgherdShards)
    {
        return Err(
            "indexless-scan drops the master/slave cluster's index only: not with pgherd-shards"
                .into(),
        );
    }
    let fixture = setup(&options, &nodes)?;
    let started = Instant::now();
    let mut samples = Vec::new();
    // The base line is one node with nothing in front: measured once, in the first block.
    let block_targets = |n: usize| -> Vec<ScalingTarget> {
        options
            .targets
            .iter()
            .copied()
            .filter(|t| *t != ScalingTarget::Direct || n == nodes[0])
            .collect()
    };
    let total: usize = nodes.iter().map(|&n| block_targets(n).len()).sum::<usize>()
        * options.rounds as usize
        * options.workloads.len()
        * options.clients.len();
    for &n in &nodes {
        // Both middlewares run for the whole block so their runs interleave; Pgpool-II's idle
        // children cost the nodes nothing.
        let pgherd = match options.targets.contains(&ScalingTarget::Pgherd) {
            true => Some(start_pgherd(
                &fixture.cluster,
                &PgherdSetup {
                    nodes: n,
                    users: &[&fixture.user],
                    pool_size: options.pool_size,
                    workers: options.pgherd_workers,
                    database_keys: &format!(
                        "primary_reads = true\nbalance = \"{}\"",
                        options.balance
                    ),
                    ha: false,
                    admin: false,
                    baseline: None,
                    instance: None,
                },
            )?),
            false => None,
        };
        let proxy_settings = ProxySettings {
            user: &fixture.user,
            pool_size: options.pool_size,
            workers: options.pgherd_workers,
        };
        let sharded = match (
            &fixture.shards,
            options.targets.contains(&ScalingTarget::PgherdShards),
        ) {
            (Some(shards), true) => Some(shards.start_pgherd(n, &proxy_settings)?),
            _ => None,
        };
        let pgpool = match options.targets.contains(&ScalingTarget::Pgpool) {
            true => Some(start_pgpool(
                &fixture.cluster,
                n,
                &fixture.user,
                options.clients.iter().copied().max().unwrap_or(1),
                options.pgpool_statement_level,
                None,
            )?),
            false => None,
        };
        let targets = block_targets(n);
        for round in 0..options.rounds {
            for &workload in &options.workloads {
                let _index = IndexDropped::for_block(&fixture.cluster, workload)?;
                for &clients in &options.clients {
                    for k in 0..targets.len() {
                        let target = targets[(k + round as usize) % targets.len()];
                        let proxy = match target {
                            ScalingTarget::Direct => None,
                            ScalingTarget::Pgherd => pgherd.as_ref(),
                            ScalingTarget::Pgpool => pgpool.as_ref(),
                            ScalingTarget::PgherdShards => sharded.as_ref(),
                        };
                        let used = if target == ScalingTarget::Direct {
                            1
                        } else {
                            n
                        };
                        let sample = measure(
                            &fixture, &options, round, used, workload, clients, target, proxy,
                        );
                        eprintln!(
                            "[{}/{total}] round {} {} node(s) {:<10} {:>3} clients {:<6} {}",
                            samples.len() + 1,
                            round + 1,
                            used,
                            workload.name(),
                            clients,
                            target.name(),
                            match &sample.error {
                                Some(e) => format!("FAILED: {e}"),
                                None => format!(
                                    "{:>8.0} tps  avg {:.2} ms{}",
                                    sample.result.tps,
                                    sample.result.latency_avg_ms,
                                    sample
                                        .throttled
                                        .map(|t| format!("  nodes throttled {:.0}%", t * 100.0))
                                        .unwrap_or_default()
                                ),
                            }
                        );
                        samples.push(sample);
                    }
                }
            }
        }
    }
    let parser = parser_cost();
    let mut report = render_report(&options, &nodes, &samples, &parser, started.elapsed());
    if let Some(caps) = &fixture.memory_caps {
        let peaks: Vec<String> = fixture
            .cluster
            .cluster
            .nodes
            .iter()
            .filter_map(|n| {
                Some(format!(
                    "{} {} MiB",
                    n.name,
                    caps.peak_bytes(&n.name)? >> 20
                ))
            })
            .collect();
        report.push_str(&format!(
            "\nThe most each node's memory group held during the run (the cap binds when it \
             equals the cap): {}.\n",
            peaks.join(", ")
        ));
    }
    println!("{report}");
    write_outputs(&options, &nodes, &samples, &report)
}

fn setup(options: &ScalingOptions, node_counts: &[usize]) -> Result<Fixture, String> {
    let max_nodes = node_counts.last().copied().unwrap_or(1);
    let (dir, tmp) = work_dir(options.dir.as_ref())?;
    let mut quotas = match options.cpu_quota_percent {
        0 => None,
        _ => Some(CpuQuotas::new()?),
    };
    let pgbench_bin = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool("pgbench");
    let user = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    let max_clients = options.clients.iter().copied().max().unwrap_or(1);
    // Pgpool-II holds a connection per child per node, pgherd its pool, direct runs their
    // clients; all may be open at once during a block.
    let max_connections = 2 * max_clients + options.pool_size + 30;
    eprintln!(
        "creating a primary and {} replica(s) in {} ...",
        max_nodes - 1,
        dir.display()
    );
    // Shared buffers are charged to the node's group and cannot be reclaimed (no swap): they
    // stay well inside a memory cap, which the page cache then fills.
    let shared_buffers_mb = match options.node_memory_mb {
        0 => 128,
        cap => (cap / 4).max(16),
    };
    let settings = [
        ("max_connections", max_connections.to_string()),
        ("shared_buffers", format!("'{shared_buffers_mb}MB'")),
        // Writes measure CPU, not this machine's disk flushes; replication is asynchronous
        // as in the seeds' setups.
        ("synchronous_commit", "off".into()),
        // A parallel scan would hide the quota behind extra worker processes.
        ("max_parallel_workers_per_gather", "0".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect::<Vec<_>>();
    check_memory_cap(
        options.node_memory_mb,
        shared_buffers_mb,
        max_clients + options.pool_size,
    )?;
    let cluster = BenchCluster::create(&dir, max_nodes - 1, settings.clone(), &[&user])?;
    pgbench_database(&cluster, &user, &pgbench_bin, options.scale())?;
    let shards = match options.targets.contains(&ScalingTarget::PgherdShards) {
        true => Some(ShardClusters::create(
            &dir,
            (max_nodes, super::shards::hash_layout),
            &settings,
            &ProxySettings {
                user: &user,
                pool_size: options.pool_size,
                workers: options.pgherd_workers,
            },
            (node_counts, options.scale()),
            &pgbench_bin,
        )?),
        false => None,
    };
    for sql in [
        "CREATE TABLE seq_scan (k integer, filler text)".to_owned(),
        format!(
            "INSERT INTO seq_scan SELECT g, repeat('x', 80) FROM generate_series(1, {}) g",
            options.seq_scan_rows
        ),
        "ALTER TABLE seq_scan OWNER TO bench".to_owned(),
        "VACUUM ANALYZE seq_scan".to_owned(),
        "CHECKPOINT".to_owned(),
    ] {
        cluster.sql("bench", &sql)?;
    }
    let log_dir = dir.join("pgbench-logs");
    std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
    let seq_scan_script = log_dir.join("seq-scan.sql");
    std::fs::write(
        &seq_scan_script,
        format!(
            "\\set k random(1, {})\nSELECT count(*) FROM seq_scan WHERE k = :k;\n",
            options.seq_scan_rows
        ),
    )
    .map_err(|e| e.to_string())?;
    let aggregate_script = log_dir.join("aggregate.sql");
    std::fs::write(
        &aggregate_script,
        format!(
            "\\set b random(1, {})\nSELECT count(*), sum(abalance) FROM pgbench_accounts WHERE bid = :b;\n",
            options.scale()
        ),
    )
    .map_err(|e| e.to_string())?;
    cluster.wait_caught_up();
    if let Some(quotas) = quotas.as_mut() {
        for node in &cluster.cluster.nodes {
            let pid = node
                .postmaster_pid()
                .ok_or_else(|| format!("{} has no postmaster.pid", node.name))?;
            quotas.confine(&node.name, pid, options.cpu_quota_percent)?;
        }
        for (name, node) in shards.iter().flat_map(ShardClusters::nodes) {
            let pid = node
                .postmaster_pid()
                .ok_or_else(|| format!("{name} has no postmaster.pid"))?;
            quotas.confine(&name, pid, options.cpu_quota_percent)?;
        }
        eprintln!(
            "each node limited to {}% of a core",
            options.cpu_quota_percent
        );
    }
    let memory_caps = cap_memory(&cluster, shards.as_ref(), options.node_memory_mb)?;
    Ok(Fixture {
        cluster,
        quotas,
        memory_caps,
        user,
        pgbench: Pgbench {
            binary: pgbench_bin,
            log_dir,
        },
        seq_scan_script,
        aggregate_script,
        shards,
        _tmp: tmp,
    })
}

/// What one backend holds of its own (its private memory and page tables), which a memory
/// cap must leave room for besides the page cache: about 4.5 MiB measured on PostgreSQL 15.
const BACKEND_MIB: u64 = 5;

/// Refuses a memory cap that the node's own processes would fill: the kernel would then kill
/// a backend (and PostgreSQL restart every session) instead of evicting cached data.
fn check_memory_cap(cap_mb: u64, shared_buffers_mb: u64, backends: u32) -> Result<(), String> {
    let needed_mb = shared_buffers_mb + u64::from(backends) * BACKEND_MIB + 64;
    match cap_mb {
        0 => Ok(()),
        cap if cap < needed_mb => Err(format!(
            "--node-memory-mb {cap} is too small for {backends} backends per node (about \
             {BACKEND_MIB} MiB each, plus shared_buffers and 64 MiB): give at least {needed_mb}, \
             and a --scale whose data exceeds the cap"
        )),
        _ => Ok(()),
    }
}

/// Every node under a memory cap of `megabytes` (0: none), after its data was written.
fn cap_memory(
    cluster: &BenchCluster,
    shards: Option<&ShardClusters>,
    megabytes: u64,
) -> Result<Option<MemoryCaps>, String> {
    if megabytes == 0 {
        return Ok(None);
    }
    let mut caps = MemoryCaps::new()?;
    let nodes = cluster.cluster.nodes.iter().map(|n| (n.name.clone(), n));
    for (name, node) in nodes.chain(shards.into_iter().flat_map(ShardClusters::nodes)) {
        let pid = node
            .postmaster_pid()
            .ok_or_else(|| format!("{name} has no postmaster.pid"))?;
        caps.confine(&name, pid, megabytes)?;
    }
    // What the setup read and wrote stays cached, charged to no node, and would serve every
    // read from memory: the machine's clean page cache is dropped, so each node's reads from
    // now on are charged to (and bounded by) its own group.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", "1")
        .map_err(|e| format!("cannot drop the page cache (root needed): {e}"))?;
    eprintln!("each node's memory, page cache included, capped at {megabytes} MiB");
    Ok(Some(caps))
}

/// Sectors read from the machine's disks so far (whole devices, not their partitions, from
/// /proc/diskstats; loop and RAM devices left out).
fn disk_sectors_read() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/diskstats").ok()?;
    let disks: Vec<String> = std::fs::read_dir("/sys/block")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|d| !d.starts_with("loop") && !d.starts_with("ram"))
        .collect();
    Some(
        text.lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let name = fields.get(2)?;
                disks.iter().any(|d| d == name).then_some(())?;
                fields.get(5)?.parse::<u64>().ok()
            })
            .sum(),
    )
}

#[allow(clippy::too_many_arguments)]
fn measure(
    fixture: &Fixture,
    options: &ScalingOptions,
    round: u32,
    nodes: usize,
    workload: ScalingWorkload,
    clients: u32,
    target: ScalingTarget,
    proxy: Option<&ProxyProcess>,
) -> Sample {
    if workload.reads_only() {
        fixture.cluster.wait_caught_up();
    }
    let port = proxy
        .map(|p| p.port)
        .unwrap_or_else(|| fixture.cluster.primary_port());
    let mut args: Vec<String> = match workload {
        ScalingWorkload::IndexScan | ScalingWorkload::IndexlessScan => vec!["-S".into()],
        ScalingWorkload::SeqScan => {
            vec!["-f".into(), fixture.seq_scan_script.display().to_string()]
        }
        ScalingWorkload::Aggregate => {
            vec!["-f".into(), fixture.aggregate_script.display().to_string()]
        }
        ScalingWorkload::Tpcb => vec![],
    };
    args.extend([
        "-M".into(),
        "simple".into(),
        "-c".into(),
        clients.to_string(),
        "-j".into(),
        clients.clamp(1, 4).to_string(),
    ]);
    match options.transactions_per_client {
        Some(transactions) => args.extend(["-t".into(), transactions.to_string()]),
        None => args.extend(["-T".into(), options.duration_s.to_string()]),
    }
    let node_names: Vec<String> = match target {
        ScalingTarget::PgherdShards => (0..nodes).map(shards::quota_name).collect(),
        _ => fixture
            .cluster
            .cluster
            .nodes
            .iter()
            .take(nodes)
            .map(|n| n.name.clone())
            .collect(),
    };
    let periods = |quotas: &CpuQuotas| -> Vec<Option<Periods>> {
        node_names.iter().map(|n| quotas.periods(n)).collect()
    };
    let before = fixture.quotas.as_ref().map(periods);
    let timeout = match options.transactions_per_client {
        // A fixed count of transactions takes what it takes.
        Some(_) => Duration::from_secs(3600),
        None => Duration::from_secs(options.duration_s * 3 + 60),
    };
    let url = fixture.user.url(port, "bench");
    let sectors_before = disk_sectors_read();
    let run = fixture.pgbench.run(&url, &args, 0.1, timeout);
    let disk_read_kib_per_txn = match (&run, sectors_before, disk_sectors_read()) {
        (Ok(r), Some(before), Some(after)) if r.transactions > 0 => {
            Some(after.saturating_sub(before) as f64 / 2.0 / r.transactions as f64)
        }
        _ => None,
    };
    let throttled = match (fixture.quotas.as_ref(), before) {
        (Some(quotas), Some(before)) => {
            let shares: Vec<f64> = periods(quotas)
                .into_iter()
                .zip(before)
                .filter_map(|(after, before)| after?.throttled_since(before?))
                .collect();
            (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
        }
        _ => None,
    };
    let (result, error) = outcome(run);
    Sample {
        round,
        nodes,
        workload,
        clients,
        target,
        result,
        throttled,
        disk_read_kib_per_txn,
        error,
    }
}

/// pgbench_accounts' primary key, dropped for an indexless-scan block and made again after
/// it (and the replicas caught up with both).
struct IndexDropped<'a>(&'a BenchCluster);

impl<'a> IndexDropped<'a> {
    fn for_block(
        cluster: &'a BenchCluster,
        workload: ScalingWorkload,
    ) -> Result<Option<IndexDropped<'a>>, String> {
        if workload != ScalingWorkload::IndexlessScan {
            return Ok(None);
        }
        cluster.sql(
            "bench",
            "ALTER TABLE pgbench_accounts DROP CONSTRAINT IF EXISTS pgbench_accounts_pkey",
        )?;
        cluster.wait_caught_up();
        Ok(Some(IndexDropped(cluster)))
    }
}

impl Drop for IndexDropped<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.sql(
            "bench",
            "ALTER TABLE pgbench_accounts ADD PRIMARY KEY (aid)",
        ) {
            eprintln!("pgbench_accounts' primary key was not made again: {e}");
        }
        self.0.wait_caught_up();
    }
}

mod report;
use report::{parser_cost, render_report, write_outputs};
pub(super) use report::{peak, Medians};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_memory_cap_must_leave_room_for_the_backends() {
        assert!(check_memory_cap(0, 128, 10_000).is_ok());
        // 256 MiB of shared buffers, 120 backends at 5 MiB, 64 MiB: 920 MiB.
        assert!(check_memory_cap(920, 256, 120).is_ok());
        let refused = check_memory_cap(919, 256, 120).unwrap_err();
        assert!(refused.contains("at least 920"), "{refused}");
    }

    #[test]
    fn reads_this_machines_disk_counters() {
        // Every Linux machine this runs on has /proc/diskstats and /sys/block; a figure, even
        // zero, shows both were read.
        assert!(disk_sectors_read().is_some());
    }
}
