//! `pgherd bench pooler`: pgbench against direct PostgreSQL, pgherd and PgBouncer (transaction
//! pooling), interleaved round by round, with each pooler's CPU per transaction, the primary's,
//! and resident memory per idle client; or, with `--count-instructions`, instructions counted
//! per transaction (`instructions`).

mod instructions;
mod report;
mod split;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};

use super::pgbench::{Pgbench, PgbenchResult};
use super::procstat;
use super::targets::{
    start_pgbouncer, start_pgherd, BenchCluster, BenchUser, PgherdSetup, ProxyProcess,
};
use super::{outcome, pgbench_database, run_order, tempfile_dir, work_dir};
use report::{render_report, write_outputs};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Workload {
    /// pgbench -S, simple query protocol.
    SelectSimple,
    /// pgbench -S -M prepared.
    SelectPrepared,
    /// pgbench's TPC-B-like script.
    Tpcb,
    /// pgbench -S -C: a new connection per transaction.
    Connect,
    /// A hundred rows per statement (a pgbench script of its own): what each row passing
    /// through costs.
    SelectRows,
}

/// `select-rows`' script: a hundred consecutive accounts from anywhere in scale 1's range.
const SELECT_ROWS_SCRIPT: &str = "\\set aid random(1, 99900)\n\
    SELECT aid, bid, abalance, filler FROM pgbench_accounts WHERE aid BETWEEN :aid AND :aid + 99;\n";
const SELECT_ROWS_FILE: &str = "select-rows.sql";

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::SelectSimple => "select-simple",
            Workload::SelectPrepared => "select-prepared",
            Workload::Tpcb => "tpcb",
            Workload::Connect => "connect",
            Workload::SelectRows => "select-rows",
        }
    }

    /// `scripts`: the directory [`write_scripts`] wrote the custom scripts to.
    fn pgbench_args(self, scripts: &Path) -> Vec<String> {
        let fixed: &[&str] = match self {
            Workload::SelectSimple => &["-S", "-M", "simple"],
            Workload::SelectPrepared => &["-S", "-M", "prepared"],
            Workload::Tpcb => &["-M", "simple"],
            Workload::Connect => &["-S", "-C", "-M", "simple"],
            Workload::SelectRows => &["-M", "simple", "-f"],
        };
        let mut args: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
        if self == Workload::SelectRows {
            args.push(scripts.join(SELECT_ROWS_FILE).display().to_string());
        }
        args
    }
}

/// Writes the workloads' own pgbench scripts into `dir`.
fn write_scripts(dir: &Path) -> Result<(), String> {
    let path = dir.join(SELECT_ROWS_FILE);
    std::fs::write(&path, SELECT_ROWS_SCRIPT)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    Direct,
    Pgherd,
    /// The same pgherd while a scraper reads `/metrics` every `--scrape-ms`: the cost of
    /// being watched.
    PgherdScraped,
    /// Another pgherd binary (`--baseline`, an earlier build) in the same run: before/after.
    PgherdBaseline,
    /// pgherd as `pgherd up` configures it: reads routed per statement over every node with
    /// read-your-writes, sync durability, failover on (the target `pgherd` sends everything
    /// to the primary, as PgBouncer does). It runs on a cluster of its own, which its
    /// failover makes commit synchronously, and brings `pgherd-default-primary` with it.
    PgherdDefault,
    /// The target `pgherd` (route = primary) in front of `pgherd-default`'s cluster, where
    /// commits are synchronous: beside the default, what routing alone costs.
    PgherdDefaultPrimary,
    /// The target `pgherd` with two worker threads (`--pgherd-workers` sets the other's):
    /// what a second worker costs per transaction, in the same run.
    #[value(name = "pgherd-w2")]
    PgherdTwoWorkers,
    /// Two pgherd processes of one worker each (half the pool each), the clients split
    /// between them and run at the same time: a second worker with nothing shared at all, to
    /// tell what `pgherd-w2` pays for shared state from what it pays for a second poller.
    #[value(name = "pgherd-2p")]
    PgherdTwoProcesses,
    Pgbouncer,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Pgherd => "pgherd",
            Target::PgherdScraped => "pgherd-scraped",
            Target::PgherdBaseline => "pgherd-baseline",
            Target::PgherdDefault => "pgherd-default",
            Target::PgherdDefaultPrimary => "pgherd-default-primary",
            Target::PgherdTwoWorkers => "pgherd-w2",
            Target::PgherdTwoProcesses => "pgherd-2p",
            Target::Pgbouncer => "pgbouncer",
        }
    }
}

#[derive(Args, Debug)]
pub struct PoolerOptions {
    /// Client counts to run each workload at.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,96")]
    clients: Vec<u32>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "select-simple,select-prepared,tpcb,connect"
    )]
    workloads: Vec<Workload>,
    #[arg(long, value_delimiter = ',', default_value = "direct,pgherd,pgbouncer")]
    targets: Vec<Target>,
    /// Seconds per pgbench run.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// Each (workload, clients, target) runs this many times, interleaved; medians are reported.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// pgbench scale factor.
    #[arg(long, default_value_t = 20)]
    scale: u32,
    /// Streaming replicas beside the primary. pgherd knows them all (its health checks and
    /// monitor run as in production); the targets `pgherd` and PgBouncer still send
    /// everything to the primary, `pgherd-default` routes reads to them.
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// pgbench threads (`-j`), at most the client count. Two on this 2-core class of machine
    /// leave the pooler a core's worth of time; more threads than cores make the client the
    /// bottleneck and inflate every pooler's CPU per transaction with wakeups.
    #[arg(long, default_value_t = 2)]
    client_threads: u32,
    /// Server connections per pool, the same for pgherd and PgBouncer.
    #[arg(long, default_value_t = 20)]
    pool_size: u32,
    /// pgherd worker threads (0 = pgherd's default: a quarter of the CPUs, at least one).
    #[arg(long, default_value_t = 0)]
    pgherd_workers: usize,
    /// Idle clients for the memory measurement (0 skips it).
    #[arg(long, default_value_t = 10_000)]
    idle_clients: u32,
    /// How often the `pgherd-scraped` target's scraper reads /metrics (Prometheus scrapes
    /// every 15 s by default; this is far harsher).
    #[arg(long, default_value_t = 1000)]
    scrape_ms: u64,
    /// A pgherd binary from another build (the last release, the commit before a change),
    /// measured as target `pgherd-baseline` in the same interleaved run, which adds it to the
    /// targets.
    #[arg(long)]
    baseline: Option<PathBuf>,
    /// How the poolers (every pgherd and PgBouncer) reach the servers: TCP over loopback, or
    /// the nodes' Unix-domain sockets (pgherd's `socket_dir`, PgBouncer's `host=/dir`). The
    /// clients and the target `direct` use TCP either way.
    #[arg(long, value_enum, default_value = "tcp")]
    server_transport: ServerTransport,
    /// Instead of timed runs: the instructions each pooler among --targets (all but direct,
    /// pgherd-scraped and pgherd-2p) executes per transaction, counted by valgrind's callgrind
    /// over this many transactions per workload and client count. Repeatable to a fraction of
    /// a percent for a binary whatever else the machine does, where user CPU time per
    /// transaction moves by tens of percent. Needs valgrind (Debian: apt-get install valgrind).
    #[arg(long, value_name = "TRANSACTIONS")]
    count_instructions: Option<u64>,
    /// Where CSV and Markdown results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Working directory for the cluster (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ServerTransport {
    Tcp,
    Unix,
}

struct Sample {
    round: u32,
    workload: Workload,
    clients: u32,
    target: Target,
    result: PgbenchResult,
    /// What the pooler used per transaction (pgherd and PgBouncer only).
    proxy_cost: Option<procstat::CpuPerTxn>,
    /// The primary's CPU time per transaction (its postmaster and every process under it):
    /// what a pooler makes the server do besides the clients' statements.
    server_cpu_us_per_txn: Option<f64>,
    /// pgbench failed: the first line of its complaint.
    error: Option<String>,
}

struct Fixture {
    cluster: BenchCluster,
    /// `pgherd-default`'s own cluster, of the same shape and data, whose primary commits
    /// synchronously once that pgherd's failover has set it up.
    default_cluster: Option<BenchCluster>,
    pgherd: Option<ProxyProcess>,
    baseline: Option<ProxyProcess>,
    pgbouncer: Option<ProxyProcess>,
    default: Option<ProxyProcess>,
    /// route = primary in front of the default's cluster: what the default is compared with
    /// for the cost of routing alone.
    default_primary: Option<ProxyProcess>,
    two_workers: Option<ProxyProcess>,
    two_processes: Option<[ProxyProcess; 2]>,
    bench: BenchUser,
    /// A user whose verifier has 16 iterations: thousands of logins stay cheap for the client.
    cheap: BenchUser,
    pgbench: Pgbench,
    /// Where the workloads' own pgbench scripts are.
    scripts: PathBuf,
    _tmp: Option<tempfile_dir::TempDir>,
}

pub(super) fn run(mut options: PoolerOptions) -> Result<(), String> {
    add_companion_targets(&mut options)?;
    if let Some(transactions) = options.count_instructions {
        options.idle_clients = 0;
        return instructions::run(&options, transactions);
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
        let sample = measure(&fixture, &options, round, workload, clients, target)?;
        match &sample.error {
            Some(error) => eprintln!(
                "[{}/{total}] round {} {} {} clients {}: FAILED: {error}",
                samples.len() + 1,
                round + 1,
                workload.name(),
                clients,
                target.name()
            ),
            None => eprintln!(
                "[{}/{total}] round {} {:<16} {:>3} clients {:<9} {:>9.0} tps  avg {:.3} ms  p99 {:.3} ms{}",
                samples.len() + 1,
                round + 1,
                workload.name(),
                clients,
                target.name(),
                sample.result.tps,
                sample.result.latency_avg_ms,
                sample.result.latency_p99_ms,
                sample
                    .proxy_cost
                    .map(|c| format!(
                        "  cpu {:.1} us/txn ({:.1} user)",
                        c.cpu_us(),
                        c.user_us
                    ))
                    .unwrap_or_default()
            ),
        }
        samples.push(sample);
    }
    let memory = if options.idle_clients > 0 {
        idle_memory(&fixture, &options)?
    } else {
        Vec::new()
    };
    let report = render_report(&options, &samples, &memory, started.elapsed());
    println!("{report}");
    write_outputs(&options, &samples, &report)
}

/// Targets measured only together with another: `--baseline` brings `pgherd-baseline`, and
/// the default and route = primary in front of its cluster come as a pair (the second is what
/// the first is compared with for routing's cost).
fn add_companion_targets(options: &mut PoolerOptions) -> Result<(), String> {
    match (
        &options.baseline,
        options.targets.contains(&Target::PgherdBaseline),
    ) {
        (Some(_), false) => options.targets.push(Target::PgherdBaseline),
        (None, true) => return Err("target pgherd-baseline needs --baseline BINARY".into()),
        _ => {}
    }
    let default_pair = [Target::PgherdDefault, Target::PgherdDefaultPrimary];
    if default_pair.iter().any(|t| options.targets.contains(t)) {
        for target in default_pair {
            if !options.targets.contains(&target) {
                options.targets.push(target);
            }
        }
    }
    Ok(())
}

fn setup(options: &PoolerOptions) -> Result<Fixture, String> {
    let raised = procstat::raise_fd_limit(u64::from(options.idle_clients) * 2 + 4096);
    if options.idle_clients > 0 && raised < u64::from(options.idle_clients) + 1024 {
        return Err(format!("the open-file limit is {raised}; {} idle clients need more (run as root or raise ulimit -n)", options.idle_clients));
    }
    let (dir, tmp) = work_dir(options.dir.as_ref())?;
    write_scripts(&dir)?;
    let pgbench_bin = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool("pgbench");
    let bench = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    let cheap = BenchUser::new("cheaplogin", 16);
    let users = [&bench, &cheap];
    let cluster = database_cluster(&dir, options, (&bench, &cheap), &pgbench_bin)?;
    // The default's failover makes its cluster's commits synchronous (its durability): on a
    // cluster of its own, so that every other target keeps the asynchronous commits it is
    // compared under.
    let default_cluster = match options.targets.contains(&Target::PgherdDefault) {
        true => Some(database_cluster(
            &dir.join("default"),
            options,
            (&bench, &cheap),
            &pgbench_bin,
        )?),
        false => None,
    };
    let setup = |baseline| PgherdSetup {
        nodes: options.replicas + 1,
        users: &users,
        pool_size: options.pool_size,
        workers: options.pgherd_workers,
        database_keys: "route = \"primary\"",
        ha: false,
        admin: false,
        baseline,
        instance: None,
    };
    let pgherd = match options.targets.contains(&Target::Pgherd)
        || options.targets.contains(&Target::PgherdScraped)
    {
        true => Some(start_pgherd(&cluster, &setup(None))?),
        false => None,
    };
    let baseline = match &options.baseline {
        Some(binary) => Some(start_pgherd(&cluster, &setup(Some(binary)))?),
        None => None,
    };
    let pgbouncer = match options.targets.contains(&Target::Pgbouncer) {
        true => Some(start_pgbouncer(&cluster, &users, options.pool_size)?),
        false => None,
    };
    let (default, default_primary) = match &default_cluster {
        Some(own) => (
            Some(start_pgherd(
                own,
                &PgherdSetup {
                    database_keys: "",
                    ha: true,
                    admin: false,
                    instance: Some(("pgherd-default", "")),
                    ..setup(None)
                },
            )?),
            Some(start_pgherd(
                own,
                &PgherdSetup {
                    instance: Some(("pgherd-default-primary", "")),
                    ..setup(None)
                },
            )?),
        ),
        None => (None, None),
    };
    let two_workers = match options.targets.contains(&Target::PgherdTwoWorkers) {
        true => Some(start_pgherd(
            &cluster,
            &PgherdSetup {
                workers: 2,
                instance: Some(("pgherd-w2", "")),
                ..setup(None)
            },
        )?),
        false => None,
    };
    let two_processes = match options.targets.contains(&Target::PgherdTwoProcesses) {
        true => {
            let half = |name| {
                start_pgherd(
                    &cluster,
                    &PgherdSetup {
                        workers: 1,
                        pool_size: (options.pool_size / 2).max(1),
                        instance: Some((name, "")),
                        ..setup(None)
                    },
                )
            };
            Some([half("pgherd-2p-a")?, half("pgherd-2p-b")?])
        }
        false => None,
    };
    // The first round would otherwise pay for the load just made (replay, flushes).
    eprintln!("letting the cluster settle ...");
    for settling in std::iter::once(&cluster).chain(&default_cluster) {
        settling.settle()?;
    }
    let log_dir = dir.join("pgbench-logs");
    std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
    Ok(Fixture {
        cluster,
        default_cluster,
        pgherd,
        baseline,
        pgbouncer,
        default,
        default_primary,
        two_workers,
        two_processes,
        bench,
        cheap,
        pgbench: Pgbench {
            binary: pgbench_bin,
            log_dir,
        },
        scripts: dir,
        _tmp: tmp,
    })
}

/// A primary and `--replicas` streaming replicas under `dir`, with a `bench` database owned
/// by `owner` holding pgbench's tables at `--scale`, which `reader` may read.
fn database_cluster(
    dir: &std::path::Path,
    options: &PoolerOptions,
    (owner, reader): (&BenchUser, &BenchUser),
    pgbench_bin: &std::path::Path,
) -> Result<BenchCluster, String> {
    eprintln!("creating a PostgreSQL primary in {} ...", dir.display());
    let settings = [
        ("max_connections", "400"),
        ("shared_buffers", "'256MB'"),
        // TPC-B measures the poolers, not this machine's disk flushes.
        ("synchronous_commit", "off"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let mut cluster = BenchCluster::create(dir, options.replicas, settings, &[owner, reader])?;
    cluster.poolers_use_sockets = options.server_transport == ServerTransport::Unix;
    cluster.poolers_under_callgrind = options.count_instructions.is_some();
    pgbench_database(&cluster, owner, pgbench_bin, options.scale)?;
    cluster.sql(
        "bench",
        &format!(
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {}",
            reader.name
        ),
    )?;
    Ok(cluster)
}

/// The cluster `target` runs against.
fn cluster_of(fixture: &Fixture, target: Target) -> &BenchCluster {
    match (target, &fixture.default_cluster) {
        (Target::PgherdDefault | Target::PgherdDefaultPrimary, Some(own)) => own,
        _ => &fixture.cluster,
    }
}

fn port_of(fixture: &Fixture, target: Target) -> Result<(u16, Option<&ProxyProcess>), String> {
    Ok(match target {
        Target::Direct => (fixture.cluster.primary_port(), None),
        Target::Pgherd | Target::PgherdScraped => {
            let p = fixture.pgherd.as_ref().ok_or("pgherd is not running")?;
            (p.port, Some(p))
        }
        Target::PgherdBaseline => {
            let p = fixture
                .baseline
                .as_ref()
                .ok_or("the baseline pgherd is not running")?;
            (p.port, Some(p))
        }
        Target::Pgbouncer => {
            let p = fixture
                .pgbouncer
                .as_ref()
                .ok_or("pgbouncer is not running")?;
            (p.port, Some(p))
        }
        Target::PgherdDefault => {
            let p = fixture
                .default
                .as_ref()
                .ok_or("the default-config pgherd is not running")?;
            (p.port, Some(p))
        }
        Target::PgherdDefaultPrimary => {
            let p = fixture
                .default_primary
                .as_ref()
                .ok_or("route = primary on the default's cluster is not running")?;
            (p.port, Some(p))
        }
        Target::PgherdTwoWorkers => {
            let p = fixture
                .two_workers
                .as_ref()
                .ok_or("the two-worker pgherd is not running")?;
            (p.port, Some(p))
        }
        Target::PgherdTwoProcesses => {
            return Err("pgherd-2p is two processes: measured by split.rs".into())
        }
    })
}

fn measure(
    fixture: &Fixture,
    options: &PoolerOptions,
    round: u32,
    workload: Workload,
    clients: u32,
    target: Target,
) -> Result<Sample, String> {
    if target == Target::PgherdTwoProcesses {
        return split::measure(fixture, options, (round, workload, clients));
    }
    let (port, proxy) = port_of(fixture, target)?;
    let threads = clients.clamp(1, options.client_threads.max(1));
    let args = pgbench_args(
        fixture,
        workload,
        clients,
        threads,
        RunLength::Seconds(options.duration_s),
    );
    let cpu_before = proxy.map(|p| p.cpu_use());
    let server_cpu = ServerCpu::start(cluster_of(fixture, target));
    let timeout = pgbench_timeout(options);
    let url = fixture.user_for(workload).url(port, "bench");
    let scraper = match (target, proxy.and_then(|p| p.api_port)) {
        (Target::PgherdScraped, Some(api_port)) => {
            Some(Scraper::start(api_port, options.scrape_ms))
        }
        (Target::PgherdScraped, None) => return Err("pgherd runs without an HTTP API".into()),
        _ => None,
    };
    let (result, error) = outcome(fixture.pgbench.run(&url, &args, 0.25, timeout));
    if let Some(scraper) = scraper {
        let scrapes = scraper.stop();
        if scrapes == 0 {
            return Err("the scraper never read /metrics".into());
        }
    }
    let proxy_cost = match (proxy, cpu_before) {
        (Some(p), Some(before)) => p
            .cpu_use()
            .since(&before)
            .per_transaction(result.transactions),
        _ => None,
    };
    Ok(Sample {
        round,
        workload,
        clients,
        target,
        server_cpu_us_per_txn: server_cpu.per_transaction(result.transactions),
        result,
        proxy_cost,
        error,
    })
}

/// The primary's CPU time over a run: its postmaster and every process under it.
struct ServerCpu {
    postmaster_pid: Option<u32>,
    before_us: u64,
}

impl ServerCpu {
    fn start(cluster: &BenchCluster) -> Self {
        let postmaster_pid = cluster.primary_postmaster_pid();
        ServerCpu {
            postmaster_pid,
            before_us: postmaster_pid.map_or(0, procstat::tree_cpu_us),
        }
    }

    fn per_transaction(&self, transactions: u64) -> Option<f64> {
        let pid = self.postmaster_pid?;
        let used_us = procstat::tree_cpu_us(pid).saturating_sub(self.before_us);
        (transactions > 0).then(|| used_us as f64 / transactions as f64)
    }
}

/// How long a pgbench run lasts.
#[derive(Clone, Copy)]
enum RunLength {
    Seconds(u64),
    TransactionsPerClient(u64),
}

/// pgbench's arguments for `workload` at `clients` over `threads` for `length`.
fn pgbench_args(
    fixture: &Fixture,
    workload: Workload,
    clients: u32,
    threads: u32,
    length: RunLength,
) -> Vec<String> {
    let mut args = workload.pgbench_args(&fixture.scripts);
    args.extend([
        "-c".into(),
        clients.to_string(),
        "-j".into(),
        threads.to_string(),
    ]);
    args.extend(match length {
        RunLength::Seconds(s) => ["-T".into(), s.to_string()],
        RunLength::TransactionsPerClient(t) => ["-t".into(), t.to_string()],
    });
    args
}

fn pgbench_timeout(options: &PoolerOptions) -> Duration {
    Duration::from_secs(options.duration_s * 3 + 60)
}

impl Fixture {
    /// Connecting per transaction measures connection handling; the low-iteration SCRAM user
    /// keeps libpq's key derivation (5 ms per login at 4096 iterations) from hiding it.
    fn user_for(&self, workload: Workload) -> &BenchUser {
        match workload {
            Workload::Connect => &self.cheap,
            _ => &self.bench,
        }
    }
}

/// Reads pgherd's /metrics on a timer in its own thread, as Prometheus would.
struct Scraper {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Scraper {
    fn start(api_port: u16, every_ms: u64) -> Scraper {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let url = format!("http://127.0.0.1:{api_port}/metrics");
            let mut scrapes = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let read = ureq::get(&url)
                    .timeout(Duration::from_secs(5))
                    .call()
                    .map(|r| r.into_string().is_ok());
                if matches!(read, Ok(true)) {
                    scrapes += 1;
                }
                std::thread::sleep(Duration::from_millis(every_ms));
            }
            scrapes
        });
        Scraper { stop, thread }
    }

    /// Stops it; how many scrapes succeeded.
    fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().unwrap_or(0)
    }
}

/// How long idle clients stay connected before their memory is read the second time: pgherd
/// parks a client idle for one to two `client_park_after_ms` (1 s by default).
const IDLE_SETTLE: Duration = Duration::from_secs(4);

/// Resident memory of a pooler with `idle_clients` idle clients connected.
pub(super) struct IdleMemory {
    pub target: Target,
    /// Per client, read as soon as all are connected.
    pub just_connected_bytes: f64,
    /// Per client, read [`IDLE_SETTLE`] later: clients as they are while they idle.
    pub settled_bytes: f64,
    pub settled_rss_kib: u64,
}

/// Resident memory per idle client: RSS before, then with `idle_clients` connections open,
/// just connected and after idling a while.
fn idle_memory(fixture: &Fixture, options: &PoolerOptions) -> Result<Vec<IdleMemory>, String> {
    let script = fixture.pgbench.log_dir.join("idle.sql");
    let hold_s = 20 + options.idle_clients / 500 + IDLE_SETTLE.as_secs() as u32;
    std::fs::write(&script, format!("\\sleep {hold_s} s\n")).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for target in [Target::Pgherd, Target::PgherdBaseline, Target::Pgbouncer] {
        let Ok((port, Some(proxy))) = port_of(fixture, target) else {
            continue;
        };
        let before = procstat::rss_kib(proxy.pid()).unwrap_or(0);
        let fds_before = procstat::open_fds(proxy.pid());
        eprintln!(
            "opening {} idle clients to {} ...",
            options.idle_clients,
            target.name()
        );
        let mut child = std::process::Command::new(&fixture.pgbench.binary)
            .args([
                "-n",
                "-c",
                &options.idle_clients.to_string(),
                "-j",
                "16",
                "-t",
                "1",
                "-f",
            ])
            .arg(&script)
            .arg(fixture.cheap.url(port, "bench"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(u64::from(hold_s));
        let mut connected = 0;
        while Instant::now() < deadline {
            connected = procstat::open_fds(proxy.pid()).saturating_sub(fds_before);
            if connected >= options.idle_clients as usize {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        // Let allocations settle before reading.
        std::thread::sleep(Duration::from_millis(500));
        let just_connected = procstat::rss_kib(proxy.pid()).unwrap_or(0);
        std::thread::sleep(IDLE_SETTLE);
        let settled = procstat::rss_kib(proxy.pid()).unwrap_or(0);
        let _ = child.kill();
        let _ = child.wait();
        if connected < options.idle_clients as usize {
            return Err(format!(
                "only {connected} of {} idle clients connected to {}",
                options.idle_clients,
                target.name()
            ));
        }
        let per_client = |rss_kib: u64| {
            rss_kib.saturating_sub(before) as f64 * 1024.0 / f64::from(options.idle_clients)
        };
        out.push(IdleMemory {
            target,
            just_connected_bytes: per_client(just_connected),
            settled_bytes: per_client(settled),
            settled_rss_kib: settled,
        });
        // Give the proxy time to notice the clients left.
        std::thread::sleep(Duration::from_secs(2));
    }
    Ok(out)
}

/// `pgherd bench pooler`'s options as parsed from `args`, for the report's tests.
#[cfg(test)]
fn pooler_options(args: &[&str]) -> PoolerOptions {
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        options: PoolerOptions,
    }
    Cli::parse_from(std::iter::once("bench").chain(args.iter().copied())).options
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_and_route_primary_on_its_cluster_come_as_a_pair() {
        for given in ["pgherd-default", "pgherd-default-primary"] {
            let mut options = pooler_options(&["--targets", &format!("direct,{given}")]);
            add_companion_targets(&mut options).unwrap();
            assert!(options.targets.contains(&Target::PgherdDefault), "{given}");
            assert!(
                options.targets.contains(&Target::PgherdDefaultPrimary),
                "{given}"
            );
            assert_eq!(options.targets.len(), 3, "{given}");
        }
        let mut options = pooler_options(&["--targets", "direct,pgherd"]);
        add_companion_targets(&mut options).unwrap();
        assert_eq!(options.targets, [Target::Direct, Target::Pgherd]);
    }

    #[test]
    fn a_baseline_target_needs_a_baseline_binary() {
        let mut options = pooler_options(&["--targets", "pgherd,pgherd-baseline"]);
        assert!(add_companion_targets(&mut options).is_err());
        let mut options = pooler_options(&["--targets", "pgherd", "--baseline", "/bin/true"]);
        add_companion_targets(&mut options).unwrap();
        assert!(options.targets.contains(&Target::PgherdBaseline));
    }
}
