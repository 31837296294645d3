//! `pgherd bench cache`: the result cache against the same reads without it and against
//! Pgpool-II's in-memory query cache, interleaved in one run. Two pgbench scripts over
//! `pgbench_accounts` with a skewed key choice (Zipf): only reads, and nine reads to one
//! write. Per target: TPS, the share of transactions answered from a cache, and CPU per
//! transaction of the middleware and of PostgreSQL (what the cache spares the server).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};

use super::pgbench::{median, Pgbench, PgbenchResult};
use super::procstat;
use super::targets::{
    start_pgherd, start_pgpool, BenchCluster, BenchUser, PgherdSetup, ProxyProcess,
};
use super::tempfile_dir;
use super::{
    csv_text, fmt, outcome, output_prefix, pgbench_database, run_order, work_dir,
    write_csv_and_report, write_failed_runs,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum CacheWorkload {
    /// One primary-key read per transaction, keys drawn with a Zipf skew.
    HotRead,
    /// The same reads, and one transaction in ten an UPDATE of a key drawn the same way.
    #[value(name = "mix-90-10")]
    Mix9010,
}

impl CacheWorkload {
    fn name(self) -> &'static str {
        match self {
            CacheWorkload::HotRead => "hot-read",
            CacheWorkload::Mix9010 => "mix-90-10",
        }
    }

    /// The pgbench script. The hint asks pgherd's cache; Pgpool-II caches every SELECT of
    /// the simple protocol anyway, and reads the hint as the comment it is.
    fn script(self, zipf_s: f64) -> String {
        let read = "/* pgherd:cache */ SELECT abalance FROM pgbench_accounts WHERE aid = :aid;";
        let pick = format!("\\set aid random_zipfian(1, :naccounts, {zipf_s})\n");
        match self {
            CacheWorkload::HotRead => format!("{pick}{read}\n"),
            CacheWorkload::Mix9010 => format!(
                "{pick}\\set r random(1, 10)\n\\if :r = 1\n\
                 UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n\
                 \\else\n{read}\n\\endif\n"
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum CacheTarget {
    /// The primary alone, no middleware.
    Direct,
    /// pgherd with `[cache] enabled = false`: the same reads without the cache.
    PgherdNocache,
    /// pgherd with its result cache.
    PgherdCache,
    /// Pgpool-II without its cache.
    Pgpool,
    /// Pgpool-II with `memory_cache_enabled` (shared memory, the same size as pgherd's).
    PgpoolCache,
}

impl CacheTarget {
    fn name(self) -> &'static str {
        match self {
            CacheTarget::Direct => "direct",
            CacheTarget::PgherdNocache => "pgherd-nocache",
            CacheTarget::PgherdCache => "pgherd-cache",
            CacheTarget::Pgpool => "pgpool",
            CacheTarget::PgpoolCache => "pgpool-cache",
        }
    }
}

#[derive(Args, Debug)]
pub struct CacheOptions {
    /// Client counts to run each workload at.
    #[arg(long, value_delimiter = ',', default_value = "32")]
    clients: Vec<u32>,
    #[arg(long, value_delimiter = ',', default_value = "hot-read,mix-90-10")]
    workloads: Vec<CacheWorkload>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "pgherd-nocache,pgherd-cache,pgpool-cache"
    )]
    targets: Vec<CacheTarget>,
    /// Seconds per pgbench run.
    #[arg(long, default_value_t = 20)]
    duration_s: u64,
    /// Seconds of the same workload run unmeasured before each measured run, so caches are
    /// warm (the 90/10 mix's writes empty them, and the rounds interleave).
    #[arg(long, default_value_t = 5)]
    warmup_s: u64,
    /// Each (workload, clients, target) runs this many times, interleaved; medians reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// pgbench scale factor (100,000 accounts each).
    #[arg(long, default_value_t = 20)]
    scale: u32,
    /// The Zipf skew of the keys read (pgbench's random_zipfian parameter, > 1).
    #[arg(long, default_value_t = 1.1)]
    zipf_s: f64,
    /// Cache size, the same for pgherd and Pgpool-II, in MiB.
    #[arg(long, default_value_t = 64)]
    cache_mib: u64,
    /// Server connections per pool for pgherd.
    #[arg(long, default_value_t = 20)]
    pool_size: u32,
    /// Where CSV and Markdown results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Working directory for the cluster (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

struct Fixture {
    cluster: BenchCluster,
    user: BenchUser,
    proxies: BTreeMap<CacheTarget, ProxyProcess>,
    pgbench: Pgbench,
    psql: PathBuf,
    scripts: BTreeMap<CacheWorkload, PathBuf>,
    postmaster_pid: u32,
    _tmp: Option<tempfile_dir::TempDir>,
}

struct Sample {
    round: u32,
    workload: CacheWorkload,
    clients: u32,
    target: CacheTarget,
    result: PgbenchResult,
    /// Transactions answered from a cache, over all transactions.
    hit_ratio: Option<f64>,
    proxy_cpu_us_per_txn: Option<f64>,
    server_cpu_us_per_txn: f64,
    error: Option<String>,
}

pub fn cache(options: CacheOptions) -> Result<(), String> {
    if options.zipf_s <= 1.0 {
        return Err("--zipf-s must be above 1".into());
    }
    let fixture = setup(&options)?;
    let started = Instant::now();
    let order = run_order(
        options.rounds,
        &options.workloads,
        &options.clients,
        &options.targets,
    );
    let total = order.len();
    let mut samples = Vec::new();
    for (round, workload, clients, target) in order {
        let s = measure(&fixture, &options, round, workload, clients, target)?;
        eprintln!(
            "[{}/{total}] round {} {:<10} {:>3} clients {:<15} {}",
            samples.len() + 1,
            round + 1,
            workload.name(),
            clients,
            target.name(),
            match &s.error {
                Some(e) => format!("FAILED: {e}"),
                None => format!(
                    "{:>9.0} tps  hits {}  middleware {} us/txn  server {:.1} us/txn",
                    s.result.tps,
                    s.hit_ratio
                        .map_or("–".into(), |h| format!("{:.1} %", h * 100.0)),
                    s.proxy_cpu_us_per_txn
                        .map_or("–".into(), |c| format!("{c:.1}")),
                    s.server_cpu_us_per_txn
                ),
            }
        );
        samples.push(s);
    }
    let report = render_report(&options, &samples, started.elapsed());
    println!("{report}");
    write_outputs(&options, &samples, &report)
}

fn setup(options: &CacheOptions) -> Result<Fixture, String> {
    let (dir, tmp) = work_dir(options.dir.as_ref())?;
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let user = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    eprintln!("creating a PostgreSQL primary in {} ...", dir.display());
    let settings = [
        ("max_connections", "400"),
        ("shared_buffers", "'256MB'"),
        ("synchronous_commit", "off"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let cluster = BenchCluster::create(&dir, 0, settings, &[&user])?;
    let pgbench_bin = binaries.tool("pgbench");
    pgbench_database(&cluster, &user, &pgbench_bin, options.scale)?;
    let cache_bytes = options.cache_mib << 20;
    let max_clients = options.clients.iter().copied().max().unwrap_or(1);
    let mut proxies = BTreeMap::new();
    for &target in &options.targets {
        let cache_section = match target {
            CacheTarget::PgherdNocache => "[cache]\nenabled = false\n".to_owned(),
            CacheTarget::PgherdCache => format!("[cache]\nmax_bytes = {cache_bytes}\n"),
            _ => String::new(),
        };
        let proxy = match target {
            CacheTarget::Direct => continue,
            CacheTarget::PgherdNocache | CacheTarget::PgherdCache => start_pgherd(
                &cluster,
                &PgherdSetup {
                    nodes: 1,
                    users: &[&user],
                    pool_size: options.pool_size,
                    workers: 0,
                    database_keys: "",
                    ha: false,
                    admin: false,
                    baseline: None,
                    instance: Some((target.name(), &cache_section)),
                },
            )?,
            CacheTarget::Pgpool => start_pgpool(&cluster, 1, &user, max_clients, false, None)?,
            CacheTarget::PgpoolCache => {
                start_pgpool(&cluster, 1, &user, max_clients, false, Some(cache_bytes))?
            }
        };
        proxies.insert(target, proxy);
    }
    let mut scripts = BTreeMap::new();
    for &workload in &options.workloads {
        let path = dir.join(format!("{}.sql", workload.name()));
        std::fs::write(&path, workload.script(options.zipf_s)).map_err(|e| e.to_string())?;
        scripts.insert(workload, path);
    }
    let postmaster_pid = cluster
        .primary_postmaster_pid()
        .ok_or("cannot read the primary's postmaster.pid")?;
    let log_dir = dir.join("pgbench-logs");
    std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
    Ok(Fixture {
        cluster,
        user,
        proxies,
        pgbench: Pgbench {
            binary: pgbench_bin,
            log_dir,
        },
        psql: binaries.tool("psql"),
        scripts,
        postmaster_pid,
        _tmp: tmp,
    })
}

/// Answers from a cache so far: pgherd's counter from /metrics, Pgpool-II's `SHOW
/// pool_cache`.
fn cache_hits(fixture: &Fixture, target: CacheTarget) -> Option<u64> {
    let proxy = fixture.proxies.get(&target)?;
    match target {
        CacheTarget::PgherdCache | CacheTarget::PgherdNocache => {
            let text = proxy.metrics_text()?;
            let hits =
                super::targets::metric_sum(&text, "pgherd_cache_hits_total{database=\"bench\"}");
            // No cache made for the database (switched off): no hits.
            Some(hits.map_or(0, |v| v as u64))
        }
        CacheTarget::PgpoolCache => {
            let out = std::process::Command::new(&fixture.psql)
                .args(["-X", "-At", "-c", "SHOW pool_cache"])
                .arg(fixture.user.url(proxy.port, "bench"))
                .output()
                .ok()?;
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .next()?
                .split('|')
                .next()?
                .trim()
                .parse()
                .ok()
        }
        CacheTarget::Direct | CacheTarget::Pgpool => None,
    }
}

fn measure(
    fixture: &Fixture,
    options: &CacheOptions,
    round: u32,
    workload: CacheWorkload,
    clients: u32,
    target: CacheTarget,
) -> Result<Sample, String> {
    let proxy = fixture.proxies.get(&target);
    let port = proxy.map_or(fixture.cluster.primary_port(), |p| p.port);
    let script = &fixture.scripts[&workload];
    let base_args: Vec<String> = vec![
        "-M".into(),
        "simple".into(),
        "-f".into(),
        script.display().to_string(),
        "-D".into(),
        format!("naccounts={}", u64::from(options.scale) * 100_000),
        "-c".into(),
        clients.to_string(),
        "-j".into(),
        clients.clamp(1, 4).to_string(),
    ];
    let run_args = |seconds: u64| -> Vec<String> {
        let mut args = base_args.clone();
        args.extend(["-T".into(), seconds.to_string()]);
        args
    };
    let url = fixture.user.url(port, "bench");
    let timeout = Duration::from_secs(options.duration_s.max(options.warmup_s) * 3 + 60);
    if options.warmup_s > 0 {
        if let (_, Some(error)) = outcome(fixture.pgbench.run(
            &url,
            &run_args(options.warmup_s),
            0.001,
            timeout,
        )) {
            return Ok(failed(round, workload, clients, target, error));
        }
        settle();
    }
    let hits_before = cache_hits(fixture, target);
    let proxy_cpu_before = proxy.map(|p| procstat::tree_cpu_us(p.pid()));
    let server_cpu_before = procstat::tree_cpu_us(fixture.postmaster_pid);
    let (result, error) = outcome(fixture.pgbench.run(
        &url,
        &run_args(options.duration_s),
        0.1,
        timeout,
    ));
    settle();
    let per_txn = |us: u64| us as f64 / result.transactions.max(1) as f64;
    let server_cpu_us_per_txn =
        per_txn(procstat::tree_cpu_us(fixture.postmaster_pid).saturating_sub(server_cpu_before));
    let proxy_cpu_us_per_txn = proxy
        .zip(proxy_cpu_before)
        .map(|(p, before)| per_txn(procstat::tree_cpu_us(p.pid()).saturating_sub(before)));
    let hit_ratio = hits_before
        .zip(cache_hits(fixture, target))
        .map(|(before, after)| {
            after.saturating_sub(before) as f64 / result.transactions.max(1) as f64
        });
    Ok(Sample {
        round,
        workload,
        clients,
        target,
        result,
        hit_ratio,
        proxy_cpu_us_per_txn,
        server_cpu_us_per_txn,
        error,
    })
}

/// Lets the backends of pgbench's connections end and be reaped (their CPU time then moves
/// to the postmaster's count of its children) before CPU time is read.
fn settle() {
    std::thread::sleep(Duration::from_millis(500));
}

fn failed(
    round: u32,
    workload: CacheWorkload,
    clients: u32,
    target: CacheTarget,
    error: String,
) -> Sample {
    let (result, _) = outcome(Err(error.clone()));
    Sample {
        round,
        workload,
        clients,
        target,
        result,
        hit_ratio: None,
        proxy_cpu_us_per_txn: None,
        server_cpu_us_per_txn: f64::NAN,
        error: Some(error),
    }
}

fn render_report(options: &CacheOptions, samples: &[Sample], took: Duration) -> String {
    let mut r = String::new();
    let _ = writeln!(
        r,
        "# pgherd bench cache\n\n{} rounds of {} s per cell after {} s unmeasured, interleaved (order rotated each round); \
         scale {}, keys drawn with random_zipfian(s = {}); caches of {} MiB (pgherd `max_bytes`, \
         Pgpool-II `memqcache_total_size`, shared memory, no expiry); pgherd pool {}, Pgpool-II one \
         child per client; simple protocol; took {:.0} s. Medians over rounds. Hits: transactions \
         answered from a cache over all transactions. CPU per transaction: the middleware's \
         process tree, and PostgreSQL's.\n",
        options.rounds,
        options.duration_s,
        options.warmup_s,
        options.scale,
        options.zipf_s,
        options.cache_mib,
        options.pool_size,
        took.as_secs_f64()
    );
    let _ = writeln!(
        r,
        "| workload | clients | target | TPS | × without cache | hits | middleware µs/txn | PostgreSQL µs/txn | p99 ms |\n|---|---|---|---|---|---|---|---|---|"
    );
    for &workload in &options.workloads {
        for &clients in &options.clients {
            let cell = |target: CacheTarget, read: fn(&Sample) -> Option<f64>| {
                let values: Vec<f64> = samples
                    .iter()
                    .filter(|s| {
                        s.workload == workload
                            && s.clients == clients
                            && s.target == target
                            && s.error.is_none()
                    })
                    .filter_map(read)
                    .collect();
                median(&values)
            };
            let base = cell(CacheTarget::PgherdNocache, |s| Some(s.result.tps));
            for &target in &options.targets {
                let tps = cell(target, |s| Some(s.result.tps));
                let _ = writeln!(
                    r,
                    "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                    workload.name(),
                    clients,
                    target.name(),
                    fmt(tps, 0),
                    fmt(tps / base, 2),
                    fmt(cell(target, |s| s.hit_ratio.map(|h| h * 100.0)), 1) + " %",
                    fmt(cell(target, |s| s.proxy_cpu_us_per_txn), 1),
                    fmt(cell(target, |s| Some(s.server_cpu_us_per_txn)), 1),
                    fmt(cell(target, |s| Some(s.result.latency_p99_ms)), 3),
                );
            }
        }
    }
    write_failed_runs(
        &mut r,
        samples.iter().filter_map(|s| {
            s.error.as_ref().map(|e| {
                format!(
                    "- {} {} clients {}: {e}",
                    s.workload.name(),
                    s.clients,
                    s.target.name()
                )
            })
        }),
    );
    r
}

fn write_outputs(options: &CacheOptions, samples: &[Sample], report: &str) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "cache")?;
    let mut csv = String::from(
        "round,workload,clients,target,tps,hit_ratio,middleware_cpu_us_per_txn,server_cpu_us_per_txn,latency_avg_ms,latency_p99_ms,transactions,failed,error\n",
    );
    let opt = |v: Option<f64>| super::csv_number(v, 4);
    for s in samples {
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.1},{},{},{:.2},{:.4},{:.4},{},{},{}",
            s.round + 1,
            s.workload.name(),
            s.clients,
            s.target.name(),
            s.result.tps,
            opt(s.hit_ratio),
            opt(s.proxy_cpu_us_per_txn),
            s.server_cpu_us_per_txn,
            s.result.latency_avg_ms,
            s.result.latency_p99_ms,
            s.result.transactions,
            s.result.failed,
            csv_text(s.error.as_deref())
        );
    }
    write_csv_and_report(&prefix, &csv, report)
}
