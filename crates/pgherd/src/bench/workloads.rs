//! `pgherd bench workloads`: seed 001's six workloads (read only with and without data, writes
//! by inserts and updates, writes by deletes, and the two read/write mixes) through pgherd
//! and through the stack that seed measured, HAProxy in front of one PgBouncer per node, on a
//! primary with two streaming replicas (the seed's master, hot standby and async standby).
//!
//! The HAProxy stack cannot look inside a connection, so, as its users do, the application
//! picks the port: read-only workloads go to HAProxy's read port (round robin over every
//! node's PgBouncer), anything that writes to the write port (the primary's PgBouncer).
//! pgherd takes every workload on one port and routes each statement itself (reads to the
//! replicas, writes to the primary, read-your-writes on), which is what the comparison is
//! about. Throughput and latency percentiles per workload and client count, interleaved
//! rounds, medians; CSV, Markdown and one SVG per workload (the seed's "transaction
//! throughput vs threads").

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::ValueEnum;

use super::pgbench::{median, Pgbench, PgbenchResult};
use super::svg::{LineChart, Series};
use super::targets::{
    start_haproxy_stack, start_pgherd, BenchCluster, BenchUser, HaproxyStack, PgherdSetup,
    ProxyProcess,
};
use super::workloads_failover::{self, FailoverRun};
use super::{csv_text, fmt, outcome, output_prefix, pgbench_database, run_order, work_dir};
use super::{write_csv_and_report, write_failed_runs};

#[derive(clap::Args, Debug)]
pub struct WorkloadsOptions {
    /// Default: all six.
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<SeedWorkload>,
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "direct,pgherd,pgherd-no-wait,haproxy-pgbouncer"
    )]
    targets: Vec<WorkloadTarget>,
    /// Client counts (the seed's JMeter threads).
    #[arg(long, value_delimiter = ',', default_value = "8,32")]
    pub(super) clients: Vec<u32>,
    /// Seconds per pgbench run.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// Each (workload, clients, target) runs this many times, interleaved; medians reported
    /// (0: only the failover runs).
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// pgbench scale.
    #[arg(long, default_value_t = 10)]
    pub(super) scale: u32,
    /// Rows in the table the delete workloads delete from (refilled before each of their
    /// runs).
    #[arg(long, default_value_t = 200_000)]
    pub(super) delete_rows: u32,
    /// Server connections per pool (pgherd's per node, each PgBouncer's).
    #[arg(long, default_value_t = 20)]
    pub(super) pool_size: u32,
    /// Then each workload once more while the primary fails (a fresh cluster for each, at
    /// the most clients), through `--failover-targets`.
    #[arg(long)]
    failover: bool,
    /// What the failover runs go through.
    #[arg(long, value_delimiter = ',', default_value = "pgherd,haproxy-repmgr")]
    pub(super) failover_targets: Vec<WorkloadTarget>,
    /// Seconds per failover run; the primary is stopped a third of the way in.
    #[arg(long, default_value_t = 30)]
    pub(super) failover_duration_s: u64,
    /// Where CSV, Markdown and SVG results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Working directory for the cluster (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Seed 001's six tests, as pgbench scripts over pgbench's tables and a table to delete from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum SeedWorkload {
    /// "Read only without data execution": a primary-key lookup that finds no row.
    ReadNoData,
    /// "Read only with data execution": ten rows of pgbench_accounts by a key range.
    ReadData,
    /// "Simple write with inserts and updates": a history insert and an account update.
    WriteInsertUpdate,
    /// "Simple write with deletes": one row deleted by key.
    WriteDelete,
    /// "Read write with selects, inserts and updates": a lookup, an insert, an update.
    MixInsertUpdate,
    /// "Read write with selects and deletes": a row read by key, then deleted.
    MixDelete,
}

const ALL_WORKLOADS: [SeedWorkload; 6] = [
    SeedWorkload::ReadNoData,
    SeedWorkload::ReadData,
    SeedWorkload::WriteInsertUpdate,
    SeedWorkload::WriteDelete,
    SeedWorkload::MixInsertUpdate,
    SeedWorkload::MixDelete,
];

impl SeedWorkload {
    pub(super) fn name(self) -> &'static str {
        match self {
            SeedWorkload::ReadNoData => "read-no-data",
            SeedWorkload::ReadData => "read-data",
            SeedWorkload::WriteInsertUpdate => "write-insert-update",
            SeedWorkload::WriteDelete => "write-delete",
            SeedWorkload::MixInsertUpdate => "mix-insert-update",
            SeedWorkload::MixDelete => "mix-delete",
        }
    }

    /// The seed's name for the test.
    pub(super) fn seed_name(self) -> &'static str {
        match self {
            SeedWorkload::ReadNoData => "Read Only without data execution",
            SeedWorkload::ReadData => "Read Only with data execution",
            SeedWorkload::WriteInsertUpdate => "Simple Write with Inserts and Updates",
            SeedWorkload::WriteDelete => "Simple Write with Deletes",
            SeedWorkload::MixInsertUpdate => "Read Write with Selects, Inserts and Updates",
            SeedWorkload::MixDelete => "Read Write with Selects and Deletes",
        }
    }

    pub(super) fn writes(self) -> bool {
        !matches!(self, SeedWorkload::ReadNoData | SeedWorkload::ReadData)
    }

    fn deletes(self) -> bool {
        matches!(self, SeedWorkload::WriteDelete | SeedWorkload::MixDelete)
    }

    /// The pgbench script. Each statement commits on its own, as each of the seed's HTTP
    /// requests ran its statements: a read in a mix may go to a replica.
    pub(super) fn script(self, delete_rows: u32) -> String {
        let account = "\\set aid random(1, 100000 * :scale)\n\\set delta random(-5000, 5000)\n";
        let item = format!("\\set id random(1, {delete_rows})\n");
        let insert = "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) \
                      VALUES (1, 1, :aid, :delta, CURRENT_TIMESTAMP);\n";
        let update = "UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;\n";
        match self {
            SeedWorkload::ReadNoData => {
                format!("{account}SELECT abalance FROM pgbench_accounts WHERE aid = -:aid;\n")
            }
            SeedWorkload::ReadData => "\\set aid random(1, 100000 * :scale - 9)\n\
                 SELECT aid, bid, abalance, filler FROM pgbench_accounts \
                 WHERE aid BETWEEN :aid AND :aid + 9;\n"
                .to_owned(),
            SeedWorkload::WriteInsertUpdate => format!("{account}{insert}{update}"),
            SeedWorkload::WriteDelete => format!("{item}DELETE FROM bench_items WHERE id = :id;\n"),
            SeedWorkload::MixInsertUpdate => format!(
                "{account}SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n{insert}{update}"
            ),
            SeedWorkload::MixDelete => format!(
                "{item}SELECT id, payload FROM bench_items WHERE id = :id;\n\
                 DELETE FROM bench_items WHERE id = :id;\n"
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum WorkloadTarget {
    /// The primary alone, nothing in front: the base line.
    Direct,
    /// One pgherd over the three nodes, routing per statement (reads to the replicas,
    /// read-your-writes), asynchronous replication as the seed's stack has.
    Pgherd,
    /// The same pgherd with `read_your_writes_wait_ms = 0`: a read right after the session's
    /// write goes to the primary at once instead of waiting for a replica to replay it.
    PgherdNoWait,
    /// HAProxy (TCP) in front of one PgBouncer (transaction pooling) per node: read-only
    /// workloads on its round-robin read port, the rest on its write port (the primary).
    HaproxyPgbouncer,
    /// The same stack with repmgr failing over (repmgrd on every node) and HAProxy's write
    /// port following the primary: for the failover runs only.
    HaproxyRepmgr,
}

impl WorkloadTarget {
    pub(super) fn name(self) -> &'static str {
        match self {
            WorkloadTarget::Direct => "direct",
            WorkloadTarget::Pgherd => "pgherd",
            WorkloadTarget::PgherdNoWait => "pgherd-no-wait",
            WorkloadTarget::HaproxyPgbouncer => "haproxy-pgbouncer",
            WorkloadTarget::HaproxyRepmgr => "haproxy-repmgr",
        }
    }
}

struct Sample {
    round: u32,
    workload: SeedWorkload,
    clients: u32,
    target: WorkloadTarget,
    result: PgbenchResult,
    error: Option<String>,
}

struct Fixture {
    cluster: BenchCluster,
    user: BenchUser,
    pgbench: Pgbench,
    scripts: BTreeMap<SeedWorkload, PathBuf>,
    pgherd: Option<ProxyProcess>,
    pgherd_no_wait: Option<ProxyProcess>,
    haproxy: Option<HaproxyStack>,
}

pub fn run(mut options: WorkloadsOptions) -> Result<(), String> {
    if options.workloads.is_empty() {
        options.workloads = ALL_WORKLOADS.to_vec();
    }
    if options.targets.contains(&WorkloadTarget::HaproxyRepmgr) {
        return Err("haproxy-repmgr is measured only while the primary fails: give it to --failover-targets, with --failover".into());
    }
    let (dir, _tmp) = work_dir(options.dir.as_ref())?;
    let samples = match options.rounds {
        0 => Vec::new(),
        _ => steady_runs(&options, &dir)?,
    };
    let failovers = match options.failover {
        true => workloads_failover::run(&options, &dir, &options.workloads)?,
        false => Vec::new(),
    };
    let mut report = match samples.is_empty() {
        true => "## pgherd bench workloads (seed 001)\n".to_owned(),
        false => render(&options, &samples),
    };
    if !failovers.is_empty() {
        workloads_failover::render(&mut report, &options, &failovers);
    }
    println!("{report}");
    write_outputs(&options, &samples, &failovers, &report)
}

/// Every (round, workload, clients, target) on one cluster, interleaved; the cluster stops
/// before the failover runs make their own.
fn steady_runs(options: &WorkloadsOptions, dir: &Path) -> Result<Vec<Sample>, String> {
    let fixture = setup(options, dir)?;
    let order = run_order(
        options.rounds,
        &options.workloads,
        &options.clients,
        &options.targets,
    );
    let mut samples = Vec::new();
    for (k, &(round, workload, clients, target)) in order.iter().enumerate() {
        let sample = measure(&fixture, options, (round, workload, clients, target));
        eprintln!(
            "[{}/{}] round {} {:<20} {:>3} clients {:<18} {}",
            k + 1,
            order.len(),
            round + 1,
            workload.name(),
            clients,
            target.name(),
            match &sample.error {
                Some(e) => format!("FAILED: {e}"),
                None => format!(
                    "{:>8.0} tps  p50 {:.2} ms  p99 {:.2} ms",
                    sample.result.tps, sample.result.latency_p50_ms, sample.result.latency_p99_ms
                ),
            }
        );
        samples.push(sample);
    }
    Ok(samples)
}

/// A primary and two replicas with pgbench's tables at `--scale` and the delete workloads'
/// table filled, room for `clients` and every pooler's pools.
pub(super) fn create_cluster(
    options: &WorkloadsOptions,
    dir: &Path,
    (pgbench, user): (&Path, &BenchUser),
    clients: u32,
    extra_settings: Vec<(String, String)>,
) -> Result<BenchCluster, String> {
    let mut settings = vec![
        (
            "max_connections".to_owned(),
            (clients + 4 * options.pool_size + 30).to_string(),
        ),
        ("shared_buffers".to_owned(), "'128MB'".to_owned()),
    ];
    settings.extend(extra_settings);
    eprintln!("creating a primary and 2 replicas in {} ...", dir.display());
    let cluster = BenchCluster::create(dir, 2, settings, &[user])?;
    pgbench_database(&cluster, user, pgbench, options.scale)?;
    for sql in [
        "CREATE TABLE bench_items (id integer PRIMARY KEY, payload text)".to_owned(),
        "ALTER TABLE bench_items OWNER TO bench".to_owned(),
        format!(
            "INSERT INTO bench_items SELECT g, md5(g::text) FROM generate_series(1, {}) g",
            options.delete_rows
        ),
        "VACUUM ANALYZE".to_owned(),
    ] {
        cluster.sql("bench", &sql)?;
    }
    Ok(cluster)
}

/// pgherd over the three nodes: as the benchmarks run it (asynchronous, no failover) or, with
/// `ha`, as `pgherd up` does; `instance` names it and adds config sections.
pub(super) fn start_seed_pgherd(
    cluster: &BenchCluster,
    user: &BenchUser,
    options: &WorkloadsOptions,
    (ha, instance): (bool, Option<(&str, &str)>),
) -> Result<ProxyProcess, String> {
    start_pgherd(
        cluster,
        &PgherdSetup {
            nodes: 3,
            users: &[user],
            pool_size: options.pool_size,
            workers: 0,
            database_keys: "",
            ha,
            admin: false,
            baseline: None,
            instance,
        },
    )
}

fn setup(options: &WorkloadsOptions, dir: &Path) -> Result<Fixture, String> {
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let user = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    let max_clients = options.clients.iter().copied().max().unwrap_or(1);
    let pgbench_bin = binaries.tool("pgbench");
    let cluster = create_cluster(options, dir, (&pgbench_bin, &user), max_clients, Vec::new())?;
    let log_dir = dir.join("pgbench-logs");
    std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
    let mut scripts = BTreeMap::new();
    for &workload in &options.workloads {
        let path = log_dir.join(format!("{}.sql", workload.name()));
        std::fs::write(&path, workload.script(options.delete_rows))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        scripts.insert(workload, path);
    }
    let start = |name: &str, sections: &str| {
        start_seed_pgherd(&cluster, &user, options, (false, Some((name, sections))))
    };
    let pgherd = match options.targets.contains(&WorkloadTarget::Pgherd) {
        true => Some(start("pgherd", "")?),
        false => None,
    };
    let pgherd_no_wait = match options.targets.contains(&WorkloadTarget::PgherdNoWait) {
        true => Some(start(
            "pgherd-no-wait",
            "[routing]\nread_your_writes_wait_ms = 0\n",
        )?),
        false => None,
    };
    let haproxy = match options.targets.contains(&WorkloadTarget::HaproxyPgbouncer) {
        true => Some(start_haproxy_stack(
            &cluster,
            &[&user],
            options.pool_size,
            false,
        )?),
        false => None,
    };
    cluster.wait_caught_up();
    Ok(Fixture {
        cluster,
        user,
        pgbench: Pgbench {
            binary: pgbench_bin,
            log_dir,
        },
        scripts,
        pgherd,
        pgherd_no_wait,
        haproxy,
    })
}

fn measure(
    fixture: &Fixture,
    options: &WorkloadsOptions,
    (round, workload, clients, target): (u32, SeedWorkload, u32, WorkloadTarget),
) -> Sample {
    let prepared = prepare(fixture, options, workload);
    let port = match target {
        WorkloadTarget::Direct => Ok(fixture.cluster.primary_port()),
        WorkloadTarget::Pgherd | WorkloadTarget::PgherdNoWait => match target {
            WorkloadTarget::Pgherd => fixture.pgherd.as_ref(),
            _ => fixture.pgherd_no_wait.as_ref(),
        }
        .map(|p| p.port)
        .ok_or_else(|| format!("{} is not running", target.name())),
        WorkloadTarget::HaproxyPgbouncer | WorkloadTarget::HaproxyRepmgr => fixture
            .haproxy
            .as_ref()
            .map(|h| match workload.writes() {
                true => h.write_port(),
                false => h.read_port,
            })
            .ok_or_else(|| "HAProxy is not running".to_owned()),
    };
    let run = prepared.and(port).and_then(|port| {
        let script = &fixture.scripts[&workload];
        let args: Vec<String> = vec![
            "-M".into(),
            "simple".into(),
            "-f".into(),
            script.display().to_string(),
            "-c".into(),
            clients.to_string(),
            "-j".into(),
            clients.clamp(1, 2).to_string(),
            "-T".into(),
            options.duration_s.to_string(),
        ];
        let url = fixture.user.url(port, "bench");
        let timeout = Duration::from_secs(options.duration_s * 3 + 60);
        fixture.pgbench.run(&url, &args, 0.2, timeout)
    });
    let (result, error) = outcome(run);
    Sample {
        round,
        workload,
        clients,
        target,
        result,
        error,
    }
}

/// Before a run: the rows the delete workloads delete put back, and the replicas caught up
/// with every earlier write (so neither a lagging replica nor the last run's tail is measured).
fn prepare(
    fixture: &Fixture,
    options: &WorkloadsOptions,
    workload: SeedWorkload,
) -> Result<(), String> {
    if workload.deletes() {
        fixture.cluster.sql(
            "bench",
            &format!(
                "INSERT INTO bench_items SELECT g, md5(g::text) FROM generate_series(1, {}) g \
                 ON CONFLICT DO NOTHING",
                options.delete_rows
            ),
        )?;
    }
    fixture.cluster.wait_caught_up();
    Ok(())
}

/// Medians per (workload, clients, target) of TPS and the latency percentiles.
struct Medians {
    tps: f64,
    p50_ms: f64,
    p95_ms: f64,
    p99_ms: f64,
}

fn medians(samples: &[Sample]) -> BTreeMap<(SeedWorkload, u32, WorkloadTarget), Medians> {
    let mut groups: BTreeMap<_, Vec<&PgbenchResult>> = BTreeMap::new();
    for s in samples {
        groups
            .entry((s.workload, s.clients, s.target))
            .or_default()
            .push(&s.result);
    }
    groups
        .into_iter()
        .map(|(key, results)| {
            let of = |f: fn(&PgbenchResult) -> f64| {
                median(&results.iter().map(|r| f(r)).collect::<Vec<_>>())
            };
            let m = Medians {
                tps: of(|r| r.tps),
                p50_ms: of(|r| r.latency_p50_ms),
                p95_ms: of(|r| r.latency_p95_ms),
                p99_ms: of(|r| r.latency_p99_ms),
            };
            (key, m)
        })
        .collect()
}

fn render(options: &WorkloadsOptions, samples: &[Sample]) -> String {
    let m = medians(samples);
    let mut r = String::new();
    let _ = writeln!(
        r,
        "## pgherd bench workloads (seed 001)\n\n{} round(s) x {} s, scale {}, a primary and two \
         streaming replicas (asynchronous), pool size {}, pgbench -M simple; medians over rounds. \
         HAProxy+PgBouncer: read-only workloads on the read port, the rest on the write port.\n",
        options.rounds, options.duration_s, options.scale, options.pool_size
    );
    let targets = &options.targets;
    let mut header = String::from("| workload (seed's name) | clients |");
    let mut rule = String::from("|---|---:|");
    for t in targets {
        let _ = write!(header, " {} TPS |", t.name());
        rule.push_str("---:|");
    }
    let compare = targets.contains(&WorkloadTarget::Pgherd)
        && targets.contains(&WorkloadTarget::HaproxyPgbouncer);
    if compare {
        header.push_str(" pgherd / HAProxy+PgBouncer |");
        rule.push_str("---:|");
    }
    for t in targets {
        let _ = write!(header, " {} p50 / p95 / p99 ms |", t.name());
        rule.push_str("---:|");
    }
    let _ = writeln!(r, "{header}\n{rule}");
    let get = |w, c, t| m.get(&(w, c, t));
    for &workload in &options.workloads {
        for &clients in &options.clients {
            let _ = write!(
                r,
                "| {} ({}) | {clients} |",
                workload.name(),
                workload.seed_name()
            );
            for &t in targets {
                let _ = write!(
                    r,
                    " {} |",
                    fmt(get(workload, clients, t).map_or(f64::NAN, |x| x.tps), 0)
                );
            }
            if compare {
                let ratio = match (
                    get(workload, clients, WorkloadTarget::Pgherd),
                    get(workload, clients, WorkloadTarget::HaproxyPgbouncer),
                ) {
                    (Some(a), Some(b)) => a.tps / b.tps,
                    _ => f64::NAN,
                };
                let _ = write!(r, " {} |", fmt(ratio, 2));
            }
            for &t in targets {
                let cell = get(workload, clients, t).map_or_else(
                    || "–".to_owned(),
                    |x| {
                        format!(
                            "{} / {} / {}",
                            fmt(x.p50_ms, 2),
                            fmt(x.p95_ms, 2),
                            fmt(x.p99_ms, 2)
                        )
                    },
                );
                let _ = write!(r, " {cell} |");
            }
            r.push('\n');
        }
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
    r
}

fn write_outputs(
    options: &WorkloadsOptions,
    samples: &[Sample],
    failovers: &[FailoverRun],
    report: &str,
) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "workloads")?;
    let mut csv = String::from(
        "round,workload,clients,target,tps,latency_avg_ms,latency_p50_ms,latency_p95_ms,latency_p99_ms,transactions,failed,error\n",
    );
    for s in samples {
        let r = &s.result;
        let _ = writeln!(
            csv,
            "{},{},{},{},{:.1},{:.4},{:.4},{:.4},{:.4},{},{},{}",
            s.round + 1,
            s.workload.name(),
            s.clients,
            s.target.name(),
            r.tps,
            r.latency_avg_ms,
            r.latency_p50_ms,
            r.latency_p95_ms,
            r.latency_p99_ms,
            r.transactions,
            r.failed,
            csv_text(s.error.as_deref())
        );
    }
    write_csv_and_report(&prefix, &csv, report)?;
    let m = medians(samples);
    let steady = match samples.is_empty() {
        true => &[][..],
        false => &options.workloads[..],
    };
    for &workload in steady {
        let series = options
            .targets
            .iter()
            .map(|&t| Series {
                name: t.name().to_owned(),
                points: options
                    .clients
                    .iter()
                    .map(|&c| {
                        let tps = m.get(&(workload, c, t)).map_or(f64::NAN, |x| x.tps);
                        (f64::from(c), tps)
                    })
                    .collect(),
                dashed: t == WorkloadTarget::Direct,
            })
            .collect();
        let chart = LineChart {
            title: format!(
                "{}: transaction throughput vs clients",
                workload.seed_name()
            ),
            x_label: "clients".into(),
            y_label: "transactions per second".into(),
            series,
        };
        let path = format!("{}-{}.svg", prefix.display(), workload.name());
        std::fs::write(&path, chart.render()).map_err(|e| format!("{path}: {e}"))?;
        eprintln!("wrote {path}");
    }
    if failovers.is_empty() {
        return Ok(());
    }
    let mut timeline = String::from("workload,target,second,tps\n");
    for run in failovers {
        for (k, tps) in run.per_second.iter().enumerate() {
            let _ = writeln!(
                timeline,
                "{},{},{},{tps:.1}",
                run.workload.name(),
                run.target.name(),
                k + 1
            );
        }
    }
    let path = format!("{}-failover.csv", prefix.display());
    std::fs::write(&path, timeline).map_err(|e| format!("{path}: {e}"))?;
    eprintln!("wrote {path}");
    for (name, svg) in workloads_failover::charts(failovers, &options.workloads) {
        let path = format!("{}-{name}.svg", prefix.display());
        std::fs::write(&path, svg).map_err(|e| format!("{path}: {e}"))?;
        eprintln!("wrote {path}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_workload_has_a_script_that_reads_or_writes_as_named() {
        for w in ALL_WORKLOADS {
            let script = w.script(1000);
            let writes = ["INSERT", "UPDATE", "DELETE"]
                .iter()
                .any(|verb| script.contains(verb));
            assert_eq!(writes, w.writes(), "{}", w.name());
            assert_eq!(script.contains("bench_items"), w.deletes(), "{}", w.name());
        }
        assert!(SeedWorkload::MixDelete
            .script(1000)
            .contains("random(1, 1000)"));
    }
}
