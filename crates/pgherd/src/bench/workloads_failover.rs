//! `pgherd bench workloads --failover`: seed 001's workloads while the primary fails. Each
//! (workload, target) gets a fresh primary and two replicas; clients run the workload's
//! pgbench script and a third of the way in the primary is stopped as a crash would
//! (`pg_ctl stop -m immediate`). pgherd runs as `pgherd up` sets it (failover on,
//! synchronous durability); the HAProxy stack has no failover manager (the seed paired it
//! with repmgr, which this bench does not run), so it shows what HAProxy and PgBouncer alone
//! do when the primary dies.
//!
//! pgbench ends a client at its first error, and a client busy on the primary when it dies
//! must get one (its statement's fate is unknown), so every pgbench client would end. The
//! clients here are the bench's own (tokio-postgres, the simple protocol): each runs the same
//! script, counts an error and carries on, reconnecting when its connection is gone, as an
//! application does. Per second: scripts completed and errors.

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::SeedableRng;

use pgherd_cluster::StopMode;

use super::fmt;
use super::repmgr;
use super::svg::{LineChart, Series};
use super::targets::{start_haproxy_stack, BenchUser};
use super::workloads::{
    create_cluster, start_seed_pgherd, SeedWorkload, WorkloadTarget, WorkloadsOptions,
};

/// One run through a failure.
pub(super) struct FailoverRun {
    pub workload: SeedWorkload,
    pub target: WorkloadTarget,
    pub clients: u32,
    /// Transactions per second, one per second of the run (pgbench's progress report).
    pub per_second: Vec<f64>,
    /// The second the primary was stopped at.
    pub kill_at_s: u64,
    /// Scripts that failed (a statement's error, or no connection).
    pub errors: u64,
    pub first_error: Option<String>,
    pub error: Option<String>,
}

impl FailoverRun {
    fn mean(values: &[f64]) -> f64 {
        match values.len() {
            0 => f64::NAN,
            n => values.iter().sum::<f64>() / n as f64,
        }
    }

    /// Mean TPS over the whole seconds before the failure.
    pub fn before_tps(&self) -> f64 {
        let end = (self.kill_at_s as usize).min(self.per_second.len());
        Self::mean(&self.per_second[..end])
    }

    /// Mean TPS over the last third of the run.
    pub fn after_tps(&self) -> f64 {
        let n = self.per_second.len();
        Self::mean(&self.per_second[n - n / 3..])
    }

    /// Scripts completed in the whole run.
    pub fn scripts_done(&self) -> u64 {
        self.per_second.iter().sum::<f64>() as u64
    }

    /// Seconds after the failure in which not one transaction completed.
    pub fn seconds_without_transactions(&self) -> usize {
        self.per_second
            .iter()
            .skip(self.kill_at_s as usize)
            .filter(|tps| **tps == 0.0)
            .count()
    }
}

pub(super) fn run(
    options: &WorkloadsOptions,
    dir: &Path,
    workloads: &[SeedWorkload],
) -> Result<Vec<FailoverRun>, String> {
    let binaries = pgherd_cluster::PgBinaries::find().map_err(|e| e.to_string())?;
    let pgbench = binaries.tool("pgbench");
    let clients = options.clients.iter().copied().max().unwrap_or(8);
    let mut runs = Vec::new();
    for &workload in workloads {
        for &target in &options.failover_targets {
            let cell_dir = dir.join(format!("failover-{}-{}", workload.name(), target.name()));
            eprintln!(
                "failover: {} through {} ({clients} clients) ...",
                workload.name(),
                target.name()
            );
            let run = run_one(options, &cell_dir, &pgbench, (workload, target, clients));
            let _ = std::fs::remove_dir_all(&cell_dir);
            let run = run.unwrap_or_else(|e| FailoverRun {
                workload,
                target,
                clients,
                per_second: Vec::new(),
                kill_at_s: 0,
                errors: 0,
                first_error: None,
                error: Some(e),
            });
            eprintln!(
                "  before {} tps, after {} tps, {} s without a transaction, {} failed{}",
                fmt(run.before_tps(), 0),
                fmt(run.after_tps(), 0),
                run.seconds_without_transactions(),
                run.errors,
                run.error
                    .as_ref()
                    .map(|e| format!(" ({e})"))
                    .unwrap_or_default()
            );
            runs.push(run);
        }
    }
    Ok(runs)
}

fn run_one(
    options: &WorkloadsOptions,
    dir: &Path,
    pgbench: &Path,
    (workload, target, clients): (SeedWorkload, WorkloadTarget, u32),
) -> Result<FailoverRun, String> {
    let user = BenchUser::new("bench", pgherd_wire::scram::DEFAULT_ITERATIONS);
    let managed = target == WorkloadTarget::HaproxyRepmgr;
    let settings = match managed {
        true => repmgr::node_settings(),
        false => Vec::new(),
    };
    let cluster = create_cluster(options, dir, (pgbench, &user), clients, settings)?;
    // Registered before the stack starts, so that HAProxy finds a watched primary.
    let _repmgr = match managed {
        true => Some(repmgr::start(&cluster)?),
        false => None,
    };
    let (_pgherd, _haproxy, port) = match target {
        WorkloadTarget::HaproxyPgbouncer | WorkloadTarget::HaproxyRepmgr => {
            let stack = start_haproxy_stack(&cluster, &[&user], options.pool_size, managed)?;
            let port = match workload.writes() {
                true => stack.write_port(),
                false => stack.read_port,
            };
            (None, Some(stack), port)
        }
        _ => {
            let pgherd = start_seed_pgherd(&cluster, &user, options, (true, None))?;
            let port = pgherd.port;
            (Some(pgherd), None, port)
        }
    };
    cluster.wait_caught_up();
    // pgherd with synchronous durability takes writes once its standby is in the set.
    std::thread::sleep(Duration::from_secs(3));
    let duration_s = options.failover_duration_s;
    let kill_at_s = duration_s / 3;
    let script = Script::parse(&workload.script(options.delete_rows), options.scale)?;
    let load = Load::new(duration_s);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let url = user.url(port, "bench");
    let tasks: Vec<_> = (0..clients)
        .map(|_| runtime.spawn(client(url.clone(), script.clone(), load.clone())))
        .collect();
    std::thread::sleep(Duration::from_secs(kill_at_s));
    cluster
        .cluster
        .primary()
        .stop(StopMode::Immediate)
        .map_err(|e| format!("cannot stop the primary: {e}"))?;
    std::thread::sleep(Duration::from_secs(duration_s - kill_at_s));
    load.stop.store(true, Ordering::Relaxed);
    runtime.block_on(async {
        for task in tasks {
            let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
        }
    });
    runtime.shutdown_timeout(Duration::from_secs(1));
    let per_second: Vec<f64> = load
        .done
        .iter()
        .map(|n| n.load(Ordering::Relaxed) as f64)
        .collect();
    let errors: u64 = load.errors.iter().map(|n| n.load(Ordering::Relaxed)).sum();
    let first_error = load.first_error.lock().ok().and_then(|e| e.clone());
    Ok(FailoverRun {
        workload,
        target,
        clients,
        per_second,
        kill_at_s,
        errors,
        first_error,
        error: None,
    })
}

/// A pgbench script as the bench's own clients run it: its `\\set name random(lo, hi)` lines
/// (bounds of integers, `:scale`, `*`, `+` and `-`) and its statements with `:name` in them.
#[derive(Clone)]
pub(super) struct Script {
    draws: Vec<(String, i64, i64)>,
    statements: Vec<String>,
}

impl Script {
    pub(super) fn parse(text: &str, scale: u32) -> Result<Script, String> {
        let mut draws = Vec::new();
        let mut statements = Vec::new();
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let Some(set) = line.strip_prefix("\\set ") else {
                statements.push(line.to_owned());
                continue;
            };
            let (name, expr) = set
                .split_once(' ')
                .ok_or_else(|| format!("bad line: {line}"))?;
            let bounds = expr
                .trim()
                .strip_prefix("random(")
                .and_then(|e| e.strip_suffix(')'))
                .and_then(|e| e.split_once(','))
                .ok_or_else(|| format!("not random(lo, hi): {line}"))?;
            let value = |e: &str| integer_expression(&e.replace(":scale", &scale.to_string()));
            draws.push((name.to_owned(), value(bounds.0)?, value(bounds.1)?));
        }
        // Longer names first, so that `:aid` is not read as `:a` followed by `id`.
        draws.sort_by_key(|(name, _, _)| std::cmp::Reverse(name.len()));
        Ok(Script { draws, statements })
    }

    /// The statements with a fresh draw of every variable.
    pub(super) fn draw(&self, rng: &mut impl rand::Rng) -> Vec<String> {
        let values: Vec<(String, i64)> = self
            .draws
            .iter()
            .map(|(name, lo, hi)| (format!(":{name}"), rng.gen_range(*lo..=*hi)))
            .collect();
        self.statements
            .iter()
            .map(|sql| {
                values.iter().fold(sql.clone(), |sql, (name, v)| {
                    sql.replace(name, &v.to_string())
                })
            })
            .collect()
    }
}

/// `a * b - c + d`: integers, `*` before `+` and `-`.
fn integer_expression(text: &str) -> Result<i64, String> {
    let bad = || format!("not an integer expression: {text}");
    let mut total = 0i64;
    let mut sign = 1i64;
    let mut term: Option<i64> = None;
    let mut multiply = false;
    for token in text.split_whitespace() {
        match token {
            "*" => multiply = true,
            "+" | "-" => {
                total += sign * term.ok_or_else(bad)?;
                sign = if token == "-" { -1 } else { 1 };
                term = None;
            }
            number => {
                let n: i64 = number.parse().map_err(|_| bad())?;
                term = Some(match (term, multiply) {
                    (Some(t), true) => t * n,
                    (None, false) => n,
                    _ => return Err(bad()),
                });
                multiply = false;
            }
        }
    }
    if multiply {
        return Err(bad());
    }
    Ok(total + sign * term.ok_or_else(bad)?)
}

/// What the clients count, per second of the run.
#[derive(Clone)]
struct Load {
    started: Instant,
    stop: Arc<AtomicBool>,
    done: Arc<Vec<AtomicU64>>,
    errors: Arc<Vec<AtomicU64>>,
    first_error: Arc<Mutex<Option<String>>>,
}

impl Load {
    fn new(duration_s: u64) -> Load {
        let seconds = || Arc::new((0..duration_s).map(|_| AtomicU64::new(0)).collect());
        Load {
            started: Instant::now(),
            stop: Arc::new(AtomicBool::new(false)),
            done: seconds(),
            errors: seconds(),
            first_error: Arc::new(Mutex::new(None)),
        }
    }

    fn count(&self, of: &[AtomicU64]) {
        let second = self.started.elapsed().as_secs() as usize;
        if let Some(n) = of.get(second) {
            n.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn failed(&self, error: String) {
        self.count(&self.errors);
        if let Ok(mut first) = self.first_error.lock() {
            first.get_or_insert(error);
        }
    }
}

/// One client: the script again and again until told to stop; an error is counted and the
/// script starts over (on a new connection if the old one is gone).
async fn client(url: String, script: Script, load: Load) {
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut connection: Option<tokio_postgres::Client> = None;
    while !load.stop.load(Ordering::Relaxed) {
        let conn = match &connection {
            Some(c) if !c.is_closed() => c,
            _ => match crate::drill::connect_within(&url, Duration::from_secs(5)).await {
                Ok(c) => connection.insert(c),
                Err(e) => {
                    load.failed(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let mut ok = true;
        for sql in script.draw(&mut rng) {
            if let Err(e) = conn.simple_query(&sql).await {
                load.failed(
                    e.as_db_error()
                        .map_or_else(|| e.to_string(), |d| d.message().to_owned()),
                );
                ok = false;
                break;
            }
        }
        if ok {
            load.count(&load.done);
        }
    }
}

/// The failover runs' table, and one timeline plot per workload (both targets).
pub(super) fn render(r: &mut String, options: &WorkloadsOptions, runs: &[FailoverRun]) {
    let _ = writeln!(
        r,
        "\n### While the primary fails\n\n{} s per run, the primary stopped as a crash would \
         (`pg_ctl stop -m immediate`) at second {}; pgherd as `pgherd up` sets it (failover on, \
         synchronous durability); `haproxy-repmgr`: HAProxy and PgBouncer with repmgr \
         failing over (repmgrd on every node, the primary checked every second and given up \
         after two failed reconnections a second apart; HAProxy's write port asks each node \
         through its PgBouncer whether it is in recovery every 500 ms, two answers to change \
         its mind); `haproxy-pgbouncer`: the same stack without a failover manager. The \
         clients run the workload's script, count an error and carry on (reconnecting when \
         they must).\n",
        options.failover_duration_s,
        options.failover_duration_s / 3
    );
    let _ = writeln!(
        r,
        "| workload | target | clients | TPS before | TPS in the last third | after / before | seconds without a transaction | failed scripts | scripts done |"
    );
    let _ = writeln!(r, "|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for run in runs {
        let _ = writeln!(
            r,
            "| {} | {} | {} | {} | {} | {} | {} | {}{} | {} |",
            run.workload.name(),
            run.target.name(),
            run.clients,
            fmt(run.before_tps(), 0),
            fmt(run.after_tps(), 0),
            fmt(run.after_tps() / run.before_tps(), 2),
            run.seconds_without_transactions(),
            run.errors,
            run.error
                .as_ref()
                .map(|e| format!(" (failed: {e})"))
                .unwrap_or_default(),
            run.scripts_done()
        );
    }
    let firsts: Vec<String> = runs
        .iter()
        .filter_map(|run| {
            let first = run.first_error.as_ref()?;
            Some(format!(
                "- {} {}: {first}",
                run.workload.name(),
                run.target.name()
            ))
        })
        .collect();
    if !firsts.is_empty() {
        let _ = writeln!(r, "\nThe first error, per run:\n\n{}", firsts.join("\n"));
    }
}

pub(super) fn charts(runs: &[FailoverRun], workloads: &[SeedWorkload]) -> Vec<(String, String)> {
    workloads
        .iter()
        .map(|&workload| {
            let series = runs
                .iter()
                .filter(|run| run.workload == workload)
                .map(|run| Series {
                    name: run.target.name().to_owned(),
                    points: run
                        .per_second
                        .iter()
                        .enumerate()
                        .map(|(k, tps)| (k as f64 + 1.0, *tps))
                        .collect(),
                    dashed: false,
                })
                .collect();
            let chart = LineChart {
                title: format!("{}: the primary fails", workload.seed_name()),
                x_label: "seconds".into(),
                y_label: "transactions per second".into(),
                series,
            };
            (format!("failover-{}", workload.name()), chart.render())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_the_workloads_pgbench_scripts() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let script = Script::parse(&SeedWorkload::MixInsertUpdate.script(1000), 5).unwrap();
        assert_eq!(script.statements.len(), 3);
        for _ in 0..100 {
            let drawn = script.draw(&mut rng);
            assert!(drawn.iter().all(|sql| !sql.contains(':')), "{drawn:?}");
            let aid: i64 = drawn[0]
                .rsplit("aid = ")
                .next()
                .and_then(|v| v.trim_end_matches(';').parse().ok())
                .unwrap();
            assert!((1..=500_000).contains(&aid));
        }
        let reads = Script::parse(&SeedWorkload::ReadData.script(1000), 2).unwrap();
        assert_eq!(reads.draws, vec![("aid".to_owned(), 1, 199_991)]);
        assert_eq!(
            integer_expression("100000 * 5 - 9 + 2 * 3").unwrap(),
            500_006 - 9
        );
        assert!(integer_expression("5 *").is_err());
        assert!(Script::parse("\\set x exp(1)\n", 1).is_err());
    }

    #[test]
    fn reads_a_runs_figures() {
        let run = FailoverRun {
            workload: SeedWorkload::WriteDelete,
            target: WorkloadTarget::Pgherd,
            clients: 8,
            per_second: vec![100.0, 100.0, 0.0, 0.0, 50.0, 80.0],
            kill_at_s: 2,
            errors: 3,
            first_error: None,
            error: None,
        };
        assert_eq!(run.before_tps(), 100.0);
        assert_eq!(run.after_tps(), 65.0);
        assert_eq!(run.seconds_without_transactions(), 2);
        assert_eq!(run.scripts_done(), 330);
    }
}
