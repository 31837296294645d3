//! `pgherd bench scaling`: the seeds' load-balancing experiment on one machine. Each PostgreSQL
//! node runs under its own CPU quota so that 1 to 4 nodes behave like small separate servers;
//! pgbench reads and writes through pgherd and through Pgpool-II (streaming replication, load
//! balancing on) at growing client counts, interleaved, against one node direct as the base.
//!
//! `pgherd bench shards` is the same run with the seeds' benchmarks 3 and 4 (index-scan selects
//! by `aid`, a sequential scan aggregating over `pgbench_accounts`) through a sharded pgherd
//! over 1–4 one-node shards ([`super::shards`]) beside the master/slave cluster behind an
//! unsharded pgherd.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};

use super::cgroup::{CpuQuotas, Periods};
use super::pgbench::{median, Pgbench, PgbenchResult};
use super::shards::{self, ProxySettings, ShardClusters};
use super::svg::{LineChart, Series};
use super::targets::{
    start_pgherd, start_pgpool, BenchCluster, BenchUser, PgherdSetup, ProxyProcess,
};
use super::tempfile_dir;
use super::{csv_text, fmt, outcome, output_prefix, pgbench_init, work_dir, write_failed_runs};

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
    error: Option<String>,
}

struct Fixture {
    /// Declared (so dropped) before the cluster: nodes leave their groups before they stop,
    /// so the groups can be removed.
    quotas: Option<CpuQuotas>,
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
    let report = render_report(&options, &nodes, &samples, &parser, started.elapsed());
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
    let settings = [
        ("max_connections", max_connections.to_string()),
        ("shared_buffers", "'128MB'".into()),
        // Writes measure CPU, not this machine's disk flushes; replication is asynchronous
        // as in the seeds' setups.
        ("synchronous_commit", "off".into()),
        // A parallel scan would hide the quota behind extra worker processes.
        ("max_parallel_workers_per_gather", "0".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect::<Vec<_>>();
    let cluster = BenchCluster::create(&dir, max_nodes - 1, settings.clone(), &[&user])?;
    cluster.sql("postgres", "CREATE DATABASE bench OWNER bench")?;
    pgbench_init(
        &pgbench_bin,
        &user.url(cluster.primary_port(), "bench"),
        options.scale(),
    )?;
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
    wait_caught_up(&cluster);
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
    Ok(Fixture {
        cluster,
        quotas,
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

/// Waits until every replica has replayed all the primary's WAL, so a read run does not start
/// while replicas still replay the previous write run (pgherd would rightly keep reads off
/// lagging replicas, and the run would measure the write run's tail).
pub(super) fn wait_caught_up(cluster: &BenchCluster) {
    use pgherd_route::balance::parse_lsn;
    let deadline = Instant::now() + Duration::from_secs(120);
    let primary = cluster.cluster.primary();
    loop {
        let target = primary
            .psql("postgres", "SELECT pg_current_wal_lsn()")
            .ok()
            .and_then(|s| parse_lsn(s.trim()));
        let behind = cluster.cluster.replicas().iter().any(|replica| {
            let replayed = replica
                .psql("postgres", "SELECT pg_last_wal_replay_lsn()")
                .ok()
                .and_then(|s| parse_lsn(s.trim()));
            match (target, replayed) {
                (Some(t), Some(r)) => r < t,
                _ => true,
            }
        });
        if !behind {
            return;
        }
        if Instant::now() > deadline {
            eprintln!("warning: replicas still replaying after 120 s; going on");
            return;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
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
        wait_caught_up(&fixture.cluster);
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
    let run = fixture.pgbench.run(&url, &args, 0.1, timeout);
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
        error,
    }
}

/// Median TPS per (workload, target, nodes, clients) (the mean, by the thesis's method).
pub(super) type Medians = BTreeMap<(ScalingWorkload, ScalingTarget, usize, u32), f64>;

fn medians(samples: &[Sample], options: &ScalingOptions) -> Medians {
    let mut groups: BTreeMap<_, Vec<f64>> = BTreeMap::new();
    for s in samples {
        let tps = match options.transactions_per_client {
            Some(_) => s.result.tps_including_connections(),
            None => s.result.tps,
        };
        groups
            .entry((s.workload, s.target, s.nodes, s.clients))
            .or_default()
            .push(tps);
    }
    let by_mean = options.transactions_per_client.is_some();
    groups
        .into_iter()
        .map(|(k, v)| {
            let tps = match by_mean {
                true => mean_of_finite(&v),
                false => median(&v),
            };
            (k, tps)
        })
        .collect()
}

/// The mean of the values that ran (failed runs are NaN); NaN if none did.
fn mean_of_finite(values: &[f64]) -> f64 {
    let ran: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    match ran.len() {
        0 => f64::NAN,
        n => ran.iter().sum::<f64>() / n as f64,
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
        wait_caught_up(cluster);
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
        wait_caught_up(self.0);
    }
}

/// The best median over client counts, and the client count it was reached at.
pub(super) fn peak(
    m: &Medians,
    workload: ScalingWorkload,
    target: ScalingTarget,
    nodes: usize,
) -> (f64, u32) {
    m.iter()
        .filter(|((w, t, n, _), tps)| {
            *w == workload && *t == target && *n == nodes && tps.is_finite()
        })
        .map(|((_, _, _, c), tps)| (*tps, *c))
        .fold((f64::NAN, 0), |best, x| {
            if best.0.is_nan() || x.0 > best.0 {
                x
            } else {
                best
            }
        })
}

/// What classifying a statement with PostgreSQL's parser costs in pgherd, against computing
/// the literal-blind shape that the decision cache is keyed by (what a cache hit costs).
struct ParserCost {
    statement: &'static str,
    classify_us: f64,
    shape_us: f64,
}

fn parser_cost() -> Vec<ParserCost> {
    use pgherd_route::catalog::{FunctionInfo, RelationInfo};
    struct AllStable;
    impl pgherd_route::Catalog for AllStable {
        fn function(&self, _: &str) -> Option<FunctionInfo> {
            Some(FunctionInfo::default())
        }
        fn relation(&self, _: &str) -> Option<RelationInfo> {
            Some(RelationInfo::default())
        }
    }
    const STATEMENTS: &[&str] = &[
        "SELECT abalance FROM pgbench_accounts WHERE aid = 48213;",
        "SELECT count(*) FROM seq_scan WHERE k = 812;",
        "UPDATE pgbench_accounts SET abalance = abalance + -3121 WHERE aid = 48213;",
        "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) VALUES (7, 1, 48213, -3121, CURRENT_TIMESTAMP);",
    ];
    const ITERATIONS: u32 = 20_000;
    STATEMENTS
        .iter()
        .map(|&statement| {
            let time = |f: &dyn Fn()| {
                f();
                let start = Instant::now();
                for _ in 0..ITERATIONS {
                    f();
                }
                start.elapsed().as_secs_f64() * 1e6 / f64::from(ITERATIONS)
            };
            ParserCost {
                statement,
                classify_us: time(&|| {
                    let mut key = Vec::new();
                    let lexed = pgherd_route::lex(statement.as_bytes(), true, &mut key);
                    std::hint::black_box(pgherd_route::classify(
                        std::hint::black_box(statement),
                        &lexed,
                        &AllStable,
                        pgherd_route::parse::DEFAULT_MAX_PARSE_BYTES,
                    ));
                }),
                shape_us: time(&|| {
                    let mut key = Vec::with_capacity(statement.len() + 16);
                    std::hint::black_box(pgherd_route::lex(
                        std::hint::black_box(statement.as_bytes()),
                        true,
                        &mut key,
                    ));
                }),
            }
        })
        .collect()
}

fn render_report(
    options: &ScalingOptions,
    nodes: &[usize],
    samples: &[Sample],
    parser: &[ParserCost],
    took: Duration,
) -> String {
    let m = medians(samples, options);
    let get = |w, t, n, c| m.get(&(w, t, n, c)).copied().unwrap_or(f64::NAN);
    let base_nodes = nodes[0];
    let mut r = String::new();
    let _ = writeln!(
        r,
        "## pgherd bench scaling\n\n{} round(s) x {}, scale {}, every node limited to {}% of a core \
         (cgroup v1 cpu quota; 0 = none), pgherd balance {}, Pgpool-II {} load balancing; {} over rounds; \
         {} min in all. `direct` is one node with nothing in front.\n",
        options.rounds,
        match options.transactions_per_client {
            Some(t) => format!("{t} transactions per client (TPS counting the connections' opening)"),
            None => format!("{} s per run", options.duration_s),
        },
        options.scale(),
        options.cpu_quota_percent,
        options.balance,
        if options.pgpool_statement_level { "statement-level" } else { "session-level (its default)" },
        if options.transactions_per_client.is_some() { "means" } else { "medians" },
        took.as_secs() / 60
    );
    for &workload in &options.workloads {
        let _ = writeln!(r, "### {} (TPS)\n", workload.name());
        let mut header = String::from("| clients | direct |");
        let mut rule = String::from("|---:|---:|");
        for target in PROXIES {
            if !options.targets.contains(&target) {
                continue;
            }
            for &n in nodes {
                let _ = write!(header, " {} {n} |", target.name());
                rule.push_str("---:|");
            }
        }
        let _ = writeln!(r, "{header}\n{rule}");
        for &clients in &options.clients {
            let _ = write!(
                r,
                "| {clients} | {} |",
                fmt(get(workload, ScalingTarget::Direct, 1, clients), 0)
            );
            for target in PROXIES {
                if !options.targets.contains(&target) {
                    continue;
                }
                for &n in nodes {
                    let _ = write!(r, " {} |", fmt(get(workload, target, n, clients), 0));
                }
            }
            r.push('\n');
        }
        r.push('\n');
    }
    let _ = writeln!(
        r,
        "### Scaling (like the thesis's Table 2)\n\nPeak TPS over client counts (clients at the peak), \
         and its ratio to one node direct and to the same middleware on {base_nodes} node(s).\n"
    );
    let _ = writeln!(
        r,
        "| workload | nodes | pgherd peak | pgherd / direct | pgherd / pgherd {base_nodes} | Pgpool-II peak | Pgpool-II / direct | Pgpool-II / Pgpool-II {base_nodes} | pgherd / Pgpool-II |"
    );
    let _ = writeln!(r, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for &workload in &options.workloads {
        let direct = peak(&m, workload, ScalingTarget::Direct, 1).0;
        let h1 = peak(&m, workload, ScalingTarget::Pgherd, base_nodes).0;
        let p1 = peak(&m, workload, ScalingTarget::Pgpool, base_nodes).0;
        for &n in nodes {
            let (h, hc) = peak(&m, workload, ScalingTarget::Pgherd, n);
            let (p, pc) = peak(&m, workload, ScalingTarget::Pgpool, n);
            let _ = writeln!(
                r,
                "| {} | {n} | {} ({hc}) | {} | {} | {} ({pc}) | {} | {} | {} |",
                workload.name(),
                fmt(h, 0),
                fmt(h / direct, 2),
                fmt(h / h1, 2),
                fmt(p, 0),
                fmt(p / direct, 2),
                fmt(p / p1, 2),
                fmt(h / p, 2)
            );
        }
    }
    if options.targets.contains(&ScalingTarget::PgherdShards) {
        shards::report(&mut r, &options.workloads, nodes, &m);
    }
    let throttled: Vec<String> = options
        .workloads
        .iter()
        .flat_map(|&w| nodes.iter().map(move |&n| (w, n)))
        .filter_map(|(w, n)| {
            let shares: Vec<f64> = samples
                .iter()
                .filter(|s| s.workload == w && s.nodes == n && s.target == ScalingTarget::Pgherd)
                .filter(|s| Some(s.clients) == options.clients.iter().copied().max())
                .filter_map(|s| s.throttled)
                .collect();
            (!shares.is_empty())
                .then(|| format!("{} {n} node(s): {:.0}%", w.name(), median(&shares) * 100.0))
        })
        .collect();
    if !throttled.is_empty() {
        let _ = writeln!(
            r,
            "\nShare of the nodes' CPU periods that ran out of quota through pgherd at the most clients \
             (near 100% means the nodes, not pgbench or pgherd, were the limit): {}.",
            throttled.join("; ")
        );
    }
    let _ = writeln!(
        r,
        "\n### Parser cost\n\nMicroseconds per statement in this process, one core: classifying with \
         PostgreSQL's parser (a decision-cache miss) against the literal-blind shape that keys the \
         cache (what every request pays; a hit adds one hash-map lookup).\n"
    );
    let _ = writeln!(r, "| statement | classify µs | shape µs |");
    let _ = writeln!(r, "|---|---:|---:|");
    for p in parser {
        let _ = writeln!(
            r,
            "| `{}` | {:.2} | {:.3} |",
            p.statement, p.classify_us, p.shape_us
        );
    }
    write_failed_runs(
        &mut r,
        samples.iter().filter_map(|s| {
            let e = s.error.as_ref()?;
            Some(format!(
                "- {} {} node(s) {} clients {}: {e}",
                s.workload.name(),
                s.nodes,
                s.clients,
                s.target.name()
            ))
        }),
    );
    r
}

fn write_outputs(
    options: &ScalingOptions,
    nodes: &[usize],
    samples: &[Sample],
    report: &str,
) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "scaling")?;
    let mut csv = String::from(
        "round,workload,nodes,clients,target,tps,tps_including_connections,latency_avg_ms,latency_p99_ms,transactions,failed,nodes_throttled_share,error\n",
    );
    for s in samples {
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{:.1},{:.1},{:.4},{:.4},{},{},{},{}",
            s.round + 1,
            s.workload.name(),
            s.nodes,
            s.clients,
            s.target.name(),
            s.result.tps,
            s.result.tps_including_connections(),
            s.result.latency_avg_ms,
            s.result.latency_p99_ms,
            s.result.transactions,
            s.result.failed,
            s.throttled.map(|t| format!("{t:.3}")).unwrap_or_default(),
            csv_text(s.error.as_deref())
        );
    }
    let mut written = vec![
        format!("{}.csv", prefix.display()),
        format!("{}.md", prefix.display()),
    ];
    std::fs::write(&written[0], csv).map_err(|e| e.to_string())?;
    std::fs::write(&written[1], report).map_err(|e| e.to_string())?;
    let m = medians(samples, options);
    for &workload in &options.workloads {
        for target in PROXIES {
            if !options.targets.contains(&target) {
                continue;
            }
            let line = |t: ScalingTarget, n: usize| -> Vec<(f64, f64)> {
                options
                    .clients
                    .iter()
                    .map(|&c| {
                        (
                            f64::from(c),
                            m.get(&(workload, t, n, c)).copied().unwrap_or(f64::NAN),
                        )
                    })
                    .collect()
            };
            let mut series = vec![Series {
                name: "1 node direct".into(),
                points: line(ScalingTarget::Direct, 1),
                dashed: true,
            }];
            series.extend(nodes.iter().map(|&n| Series {
                name: format!(
                    "{} {n} node{}",
                    target_label(target),
                    if n == 1 { "" } else { "s" }
                ),
                points: line(target, n),
                dashed: false,
            }));
            let chart = LineChart {
                title: format!(
                    "{}: {} over 1–{} nodes",
                    workload.name(),
                    target_label(target),
                    nodes[nodes.len() - 1]
                ),
                x_label: "clients".into(),
                y_label: "transactions per second".into(),
                series,
            };
            let path = format!(
                "{}-{}-{}.svg",
                prefix.display(),
                workload.name(),
                target.name()
            );
            std::fs::write(&path, chart.render()).map_err(|e| format!("{path}: {e}"))?;
            written.push(path);
        }
    }
    eprintln!("wrote {}", written.join(", "));
    Ok(())
}

fn target_label(target: ScalingTarget) -> &'static str {
    match target {
        ScalingTarget::Direct => "direct",
        ScalingTarget::Pgherd => "pgherd",
        ScalingTarget::Pgpool => "Pgpool-II",
        ScalingTarget::PgherdShards => "pgherd sharded",
    }
}
