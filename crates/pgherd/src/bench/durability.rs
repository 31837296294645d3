//! `pgherd bench durability`: the seeds' replica experiment (002: Pgpool-II with 0–3 replicas,
//! reads faster and writes slower as replicas are added, replicas under CPU caps to behave
//! like separate machines) with the price of each durability mode on the writes: `async`,
//! `sync` with k = 1..N standbys confirming each commit (`synchronous_commit = on`), and
//! `remote_apply` with k = 1..N (k = N is Postgres-R's "every copy has it at commit", 004).
//!
//! One cluster of a primary and N replicas (each node optionally under a CPU quota); for each
//! replica count r a pgherd over the primary and r replicas; for each mode the primary's
//! `synchronous_standby_names` and `synchronous_commit` set as pgherd's `[replication]`
//! writes them (`ANY k (...)` over the first r replicas), then pgbench's TPC-B through pgherd
//! for the write latency, and once per r pgbench's select-only for the reads (which
//! durability does not touch). CSV, a Markdown table and two SVG plots.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use super::cgroup::CpuQuotas;
use super::pgbench::{Pgbench, PgbenchResult};
use super::svg::{LineChart, Series};
use super::targets::{start_pgherd, BenchCluster, BenchUser, PgherdSetup};
use super::{csv_text, output_prefix, pgbench_database, work_dir};

#[derive(clap::Args, Debug)]
pub struct DurabilityOptions {
    /// The most replicas measured (0 up to this many).
    #[arg(long, default_value_t = 3)]
    max_replicas: usize,
    /// pgbench scale.
    #[arg(long, default_value_t = 10)]
    scale: u32,
    /// pgbench clients.
    #[arg(long, default_value_t = 8)]
    clients: u32,
    /// Seconds per pgbench run.
    #[arg(long, default_value_t = 10)]
    duration_s: u64,
    /// Rounds over every cell; the report gives each cell's medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// CPU quota of every PostgreSQL node, in percent of one core (0 = no quota).
    #[arg(long, default_value_t = 0)]
    cpu_quota_percent: u32,
    /// Where the clusters live [default: a temporary directory].
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Where CSV, Markdown and SVG results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
}

/// How commits wait for the standbys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Async,
    /// `ANY k`, `synchronous_commit = on`: k standbys flushed the commit.
    Sync(usize),
    /// `ANY k`, `synchronous_commit = remote_apply`: k standbys show the commit to reads.
    RemoteApply(usize),
}

impl Mode {
    fn name(self) -> String {
        match self {
            Mode::Async => "async".to_owned(),
            Mode::Sync(k) => format!("sync k={k}"),
            Mode::RemoteApply(k) => format!("remote_apply k={k}"),
        }
    }

    /// The modes measured with `replicas` standbys.
    pub fn all(replicas: usize) -> Vec<Mode> {
        let mut modes = vec![Mode::Async];
        modes.extend((1..=replicas).map(Mode::Sync));
        modes.extend((1..=replicas).map(Mode::RemoteApply));
        modes
    }

    /// The primary's settings for this mode over `standbys`, as pgherd's `[replication]`
    /// writes them: statements to run one by one (`ALTER SYSTEM` takes no transaction block).
    pub fn settings_sql(self, standbys: &[String]) -> [String; 3] {
        let (names, commit) = match self {
            Mode::Async => (String::new(), "on"),
            Mode::Sync(k) | Mode::RemoteApply(k) => {
                let quoted: Vec<String> = standbys.iter().map(|s| format!("\"{s}\"")).collect();
                let commit = match self {
                    Mode::RemoteApply(_) => "remote_apply",
                    _ => "on",
                };
                (format!("ANY {k} ({})", quoted.join(", ")), commit)
            }
        };
        [
            format!(
                "ALTER SYSTEM SET synchronous_standby_names = '{}'",
                names.replace('\'', "''")
            ),
            format!("ALTER SYSTEM SET synchronous_commit = '{commit}'"),
            "SELECT pg_reload_conf()".to_owned(),
        ]
    }
}

/// One pgbench run's figures, or why it failed (or a cell's medians over the rounds).
struct Cell {
    round: usize,
    replicas: usize,
    workload: &'static str,
    mode: Mode,
    result: Result<PgbenchResult, String>,
}

pub fn run(options: DurabilityOptions) -> Result<(), String> {
    let (dir, _tmp) = work_dir(options.dir.as_ref())?;
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let user = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    eprintln!(
        "creating a primary and {} replica(s) in {} ...",
        options.max_replicas,
        dir.display()
    );
    let settings = vec![
        ("max_connections".to_owned(), "200".to_owned()),
        ("shared_buffers".to_owned(), "'128MB'".to_owned()),
    ];
    let cluster = BenchCluster::create(&dir, options.max_replicas, settings, &[&user])?;
    let pgbench_bin = binaries.tool("pgbench");
    pgbench_database(&cluster, &user, &pgbench_bin, options.scale)?;
    cluster.sql("bench", "VACUUM ANALYZE")?;
    let _quotas = confine(&cluster, options.cpu_quota_percent)?;
    let log_dir = dir.join("pgbench-logs");
    std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
    let pgbench = Pgbench {
        binary: pgbench_bin,
        log_dir,
    };
    let mut cells = Vec::new();
    for round in 0..options.rounds {
        eprintln!("round {} of {}", round + 1, options.rounds);
        cells.extend(run_round(&cluster, (&user, &pgbench), &options, round)?);
    }
    let medians = summarize(&cells);
    let report = render(&options, &medians);
    println!("{report}");
    write_outputs(&options, (&cells, &medians), &report)
}

/// Every cell once: for each replica count a pgherd over the primary and that many replicas,
/// TPC-B under each mode, then select-only.
fn run_round(
    cluster: &BenchCluster,
    (user, pgbench): (&BenchUser, &Pgbench),
    options: &DurabilityOptions,
    round: usize,
) -> Result<Vec<Cell>, String> {
    let standbys: Vec<String> = cluster
        .cluster
        .replicas()
        .iter()
        .map(|n| n.name.clone())
        .collect();
    let mut cells = Vec::new();
    for replicas in 0..=options.max_replicas {
        let pgherd = start_pgherd(
            cluster,
            &PgherdSetup {
                nodes: replicas + 1,
                users: &[user],
                pool_size: 20,
                workers: 0,
                database_keys: "",
                ha: false,
                admin: false,
                baseline: None,
                instance: Some((&format!("pgherd-r{replicas}"), "")),
            },
        )?;
        let url = user.url(pgherd.port, "bench");
        for mode in Mode::all(replicas) {
            for sql in mode.settings_sql(&standbys[..replicas]) {
                cluster.sql("postgres", &sql)?;
            }
            cluster.wait_caught_up();
            let result = confirm_mode(cluster, mode, &standbys[..replicas])
                .and_then(|()| run_pgbench(pgbench, &url, options, &[]));
            report_cell(replicas, "tpcb", mode, &result);
            cells.push(Cell {
                round,
                replicas,
                workload: "tpcb",
                mode,
                result,
            });
        }
        for sql in Mode::Async.settings_sql(&[]) {
            cluster.sql("postgres", &sql)?;
        }
        cluster.wait_caught_up();
        let result = run_pgbench(pgbench, &url, options, &["-S"]);
        report_cell(replicas, "select-only", Mode::Async, &result);
        cells.push(Cell {
            round,
            replicas,
            workload: "select-only",
            mode: Mode::Async,
            result,
        });
    }
    Ok(cells)
}

/// Each cell's medians over its rounds that ran (TPS, mean and p99 latency; transactions
/// and failures summed); a cell whose every round failed keeps the first error.
fn summarize(cells: &[Cell]) -> Vec<Cell> {
    let mut out: Vec<Cell> = Vec::new();
    for cell in cells.iter().filter(|c| c.round == 0) {
        let same: Vec<&Cell> = cells
            .iter()
            .filter(|c| {
                c.replicas == cell.replicas && c.workload == cell.workload && c.mode == cell.mode
            })
            .collect();
        let ran: Vec<&PgbenchResult> = same.iter().filter_map(|c| c.result.as_ref().ok()).collect();
        let median_of = |f: &dyn Fn(&PgbenchResult) -> f64| {
            super::pgbench::median(&ran.iter().map(|r| f(r)).collect::<Vec<f64>>())
        };
        let result = match ran.is_empty() {
            true => Err(same
                .iter()
                .find_map(|c| c.result.as_ref().err().cloned())
                .unwrap_or_default()),
            false => Ok(PgbenchResult {
                transactions: ran.iter().map(|r| r.transactions).sum(),
                failed: ran.iter().map(|r| r.failed).sum(),
                tps: median_of(&|r| r.tps),
                latency_avg_ms: median_of(&|r| r.latency_avg_ms),
                latency_p50_ms: median_of(&|r| r.latency_p50_ms),
                latency_p95_ms: median_of(&|r| r.latency_p95_ms),
                latency_p99_ms: median_of(&|r| r.latency_p99_ms),
                initial_connection_ms: median_of(&|r| r.initial_connection_ms),
            }),
        };
        out.push(Cell {
            round: 0,
            replicas: cell.replicas,
            workload: cell.workload,
            mode: cell.mode,
            result,
        });
    }
    out
}

/// Waits (10 s at most) until the primary runs with the mode's settings and reports every
/// standby `ANY k` names as a quorum candidate (none in `async`), so a cell never measures a
/// mode that is not in force.
fn confirm_mode(cluster: &BenchCluster, mode: Mode, standbys: &[String]) -> Result<(), String> {
    let [names, commit, _] = mode.settings_sql(standbys);
    let setting = |sql: &str| {
        sql.split_once(" = ")
            .map(|(_, v)| v.to_owned())
            .unwrap_or_default()
    };
    let wanted = format!(
        "{} {} {}",
        setting(&names),
        setting(&commit),
        if mode == Mode::Async {
            0
        } else {
            standbys.len()
        }
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let seen = cluster.sql(
            "postgres",
            "SELECT quote_literal(current_setting('synchronous_standby_names')) || ' ' || \
                    quote_literal(current_setting('synchronous_commit')) || ' ' || \
                    (SELECT count(*) FROM pg_stat_replication WHERE sync_state IN ('sync', 'quorum'))",
        )?;
        if seen.trim() == wanted {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            return Err(format!(
                "{} asked ({wanted}), but the primary runs with {}",
                mode.name(),
                seen.trim()
            ));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Each node in its own CPU quota, as the seed capped its replicas.
fn confine(cluster: &BenchCluster, percent: u32) -> Result<Option<CpuQuotas>, String> {
    if percent == 0 {
        return Ok(None);
    }
    let mut quotas = CpuQuotas::new()?;
    for node in &cluster.cluster.nodes {
        let pid = node
            .postmaster_pid()
            .ok_or_else(|| format!("{} has no postmaster.pid", node.name))?;
        quotas.confine(&node.name, pid, percent)?;
    }
    eprintln!("each node limited to {percent}% of a core");
    Ok(Some(quotas))
}

fn run_pgbench(
    pgbench: &Pgbench,
    url: &str,
    options: &DurabilityOptions,
    extra: &[&str],
) -> Result<PgbenchResult, String> {
    let mut args: Vec<String> = [
        "-c",
        &options.clients.to_string(),
        "-j",
        "2",
        "-T",
        &options.duration_s.to_string(),
        "-M",
        "simple",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    pgbench.run(
        url,
        &args,
        0.2,
        Duration::from_secs(options.duration_s + 120),
    )
}

fn report_cell(
    replicas: usize,
    workload: &str,
    mode: Mode,
    result: &Result<PgbenchResult, String>,
) {
    match result {
        Ok(r) => eprintln!(
            "{replicas} replica(s), {workload}, {}: {:.0} TPS, {:.2} ms mean, {:.2} ms p99",
            mode.name(),
            r.tps,
            r.latency_avg_ms,
            r.latency_p99_ms
        ),
        Err(e) => eprintln!("{replicas} replica(s), {workload}, {}: {e}", mode.name()),
    }
}

/// The Markdown report: the writes by mode and replica count, then the reads.
fn render(options: &DurabilityOptions, cells: &[Cell]) -> String {
    let mut out = format!(
        "## Replicas and durability modes (seed 002; 004's all-copies commit)\n\n\
         pgbench through pgherd, {} clients, {} s per run, scale {}, {}; medians of {} round(s), interleaved.\n\n\
         ### Writes: TPC-B\n\n| replicas | mode | TPS | latency mean, ms | latency p99, ms | vs async |\n|---:|---|---:|---:|---:|---:|\n",
        options.clients,
        options.duration_s,
        options.scale,
        match options.cpu_quota_percent {
            0 => "no CPU quota".to_owned(),
            p => format!("every node under a {p}% CPU quota"),
        },
        options.rounds
    );
    for cell in cells.iter().filter(|c| c.workload == "tpcb") {
        let baseline = cells
            .iter()
            .find(|c| c.workload == "tpcb" && c.replicas == cell.replicas && c.mode == Mode::Async)
            .and_then(|c| c.result.as_ref().ok())
            .map(|r| r.latency_avg_ms);
        let _ = match &cell.result {
            Ok(r) => writeln!(
                out,
                "| {} | {} | {:.0} | {:.2} | {:.2} | {} |",
                cell.replicas,
                cell.mode.name(),
                r.tps,
                r.latency_avg_ms,
                r.latency_p99_ms,
                baseline.map_or("".to_owned(), |b| format!("{:.2}×", r.latency_avg_ms / b))
            ),
            Err(e) => writeln!(
                out,
                "| {} | {} | failed: {e} | | | |",
                cell.replicas,
                cell.mode.name()
            ),
        };
    }
    out.push_str("\n### Reads: select-only\n\n| replicas | TPS | latency mean, ms | latency p99, ms |\n|---:|---:|---:|---:|\n");
    for cell in cells.iter().filter(|c| c.workload == "select-only") {
        let _ = match &cell.result {
            Ok(r) => writeln!(
                out,
                "| {} | {:.0} | {:.2} | {:.2} |",
                cell.replicas, r.tps, r.latency_avg_ms, r.latency_p99_ms
            ),
            Err(e) => writeln!(out, "| {} | failed: {e} | | |", cell.replicas),
        };
    }
    out
}

/// The write latency against replicas, a line per mode family (async, sync with k = 1 and
/// with k = every replica, remote_apply likewise), and the read TPS against replicas.
fn charts(cells: &[Cell]) -> (LineChart, LineChart) {
    let line = |name: &str,
                dashed: bool,
                pick: &dyn Fn(&Cell) -> bool,
                value: &dyn Fn(&PgbenchResult) -> f64| Series {
        name: name.to_owned(),
        dashed,
        points: cells
            .iter()
            .filter(|c| pick(c))
            .map(|c| (c.replicas as f64, c.result.as_ref().map_or(f64::NAN, value)))
            .collect(),
    };
    let latency = |r: &PgbenchResult| r.latency_avg_ms;
    let tpcb = |c: &Cell| c.workload == "tpcb";
    let writes = LineChart {
        title: "TPC-B write latency through pgherd by durability mode".to_owned(),
        x_label: "replicas".to_owned(),
        y_label: "mean latency, ms".to_owned(),
        series: vec![
            line(
                "async",
                false,
                &|c| tpcb(c) && c.mode == Mode::Async,
                &latency,
            ),
            line(
                "sync k=1",
                false,
                &|c| tpcb(c) && c.mode == Mode::Sync(1),
                &latency,
            ),
            line(
                "sync k=all",
                true,
                &|c| tpcb(c) && c.replicas > 0 && c.mode == Mode::Sync(c.replicas),
                &latency,
            ),
            line(
                "remote_apply k=1",
                false,
                &|c| tpcb(c) && c.mode == Mode::RemoteApply(1),
                &latency,
            ),
            line(
                "remote_apply k=all",
                true,
                &|c| tpcb(c) && c.replicas > 0 && c.mode == Mode::RemoteApply(c.replicas),
                &latency,
            ),
        ],
    };
    let reads = LineChart {
        title: "select-only through pgherd".to_owned(),
        x_label: "replicas".to_owned(),
        y_label: "TPS".to_owned(),
        series: vec![line(
            "select-only",
            false,
            &|c| c.workload == "select-only",
            &|r| r.tps,
        )],
    };
    (writes, reads)
}

fn write_outputs(
    options: &DurabilityOptions,
    (cells, medians): (&[Cell], &[Cell]),
    report: &str,
) -> Result<(), String> {
    let prefix = output_prefix(&options.out, "durability")?;
    let mut csv = String::from(
        "round,replicas,workload,mode,tps,latency_avg_ms,latency_p99_ms,transactions,failed,error\n",
    );
    for c in cells {
        let r = c.result.as_ref().ok();
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{},{},{}",
            c.round + 1,
            c.replicas,
            c.workload,
            c.mode.name(),
            r.map_or(String::new(), |r| format!("{:.1}", r.tps)),
            r.map_or(String::new(), |r| format!("{:.4}", r.latency_avg_ms)),
            r.map_or(String::new(), |r| format!("{:.4}", r.latency_p99_ms)),
            r.map_or(String::new(), |r| r.transactions.to_string()),
            r.map_or(String::new(), |r| r.failed.to_string()),
            csv_text(c.result.as_ref().err().map(String::as_str))
        );
    }
    let (writes, reads) = charts(medians);
    let files = [
        (format!("{}.csv", prefix.display()), csv),
        (format!("{}.md", prefix.display()), report.to_owned()),
        (format!("{}-writes.svg", prefix.display()), writes.render()),
        (format!("{}-reads.svg", prefix.display()), reads.render()),
    ];
    for (path, text) in &files {
        std::fs::write(path, text).map_err(|e| format!("{path}: {e}"))?;
    }
    eprintln!(
        "written: {}",
        files
            .iter()
            .map(|(p, _)| p.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_mode_sets_what_pgherd_would() {
        let standbys = ["pg2".to_owned(), "pg3".to_owned()];
        assert_eq!(
            Mode::all(2),
            vec![
                Mode::Async,
                Mode::Sync(1),
                Mode::Sync(2),
                Mode::RemoteApply(1),
                Mode::RemoteApply(2)
            ]
        );
        assert_eq!(Mode::all(0), vec![Mode::Async]);
        let [names, commit, _] = Mode::Sync(2).settings_sql(&standbys);
        assert_eq!(
            names,
            "ALTER SYSTEM SET synchronous_standby_names = 'ANY 2 (\"pg2\", \"pg3\")'"
        );
        assert_eq!(commit, "ALTER SYSTEM SET synchronous_commit = 'on'");
        let [_, commit, _] = Mode::RemoteApply(1).settings_sql(&standbys);
        assert!(commit.contains("'remote_apply'"));
        let [names, _, _] = Mode::Async.settings_sql(&[]);
        assert_eq!(names, "ALTER SYSTEM SET synchronous_standby_names = ''");
    }
}
