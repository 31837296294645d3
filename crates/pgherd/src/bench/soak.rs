//! `pgherd bench soak`: thousands of clients on pgherd for a long time while the cluster
//! changes under them, watching what pgherd holds. A leak shows as a figure that keeps
//! growing once the load is steady; this measures that and fails when one does.
//!
//! The load: pgbench clients in transaction mode (TPC-B in the simple protocol, select-only
//! prepared), a few in session mode, all rate-limited so most are idle at any moment (as an
//! application's pool is), and a churn of psql clients that die in the middle of a
//! transaction (SIGKILL) or cancel a running statement (SIGINT: psql sends a CancelRequest).
//! Meanwhile a replica is restarted every `--replica-restart-every-s` and one switchover
//! happens half way. Every second: pgherd's resident memory, open descriptors, clients,
//! server connections and clients waiting for one. After the warm-up the first and the last
//! quarter of the run are compared; a figure whose last quarter's peak exceeds the first's by
//! more than `--tolerance-pct` (and a small absolute slack) grows, and the run fails.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Args;
use pgherd_cluster::StopMode;

use super::procstat;
use super::targets::{start_pgherd, BenchCluster, BenchUser, PgherdSetup, ProxyProcess};

#[derive(Args, Debug, Clone)]
pub struct SoakOptions {
    /// Clients connected through the whole run.
    #[arg(long, default_value_t = 5000)]
    clients: u32,
    /// How long the load runs.
    #[arg(long, default_value_t = 1800)]
    duration_s: u64,
    /// Seconds not compared at the start (logins, pools filling); default a tenth of the run.
    #[arg(long)]
    warmup_s: Option<u64>,
    /// Transactions per second asked of all pgbench clients together (most clients idle).
    #[arg(long, default_value_t = 1500)]
    rate: u32,
    /// A replica is restarted this often (0: never).
    #[arg(long, default_value_t = 300)]
    replica_restart_every_s: u64,
    /// A figure grows if its last quarter's peak exceeds the first's by more than this.
    #[arg(long, default_value_t = 5.0)]
    tolerance_pct: f64,
    /// Server connections per pool.
    #[arg(long, default_value_t = 20)]
    pool_size: u32,
    /// pgbench scale factor.
    #[arg(long, default_value_t = 10)]
    scale: u32,
    /// Where CSV and Markdown results go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Working directory for the cluster (a temporary one by default).
    #[arg(long)]
    dir: Option<PathBuf>,
}

/// Clients in session mode (each holds a server connection for its life).
const SESSION_CLIENTS: u32 = 40;

/// One reading, a second apart.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    pub at_s: f64,
    pub rss_kib: f64,
    pub fds: f64,
    pub clients: f64,
    pub servers: f64,
    pub waiting: f64,
}

/// What became of one figure over the run.
#[derive(Debug, Clone, PartialEq)]
pub struct Trend {
    pub name: &'static str,
    pub first_peak: f64,
    pub last_peak: f64,
    pub grows: bool,
}

/// A figure: its name, how it reads, and the change below which it is noise.
type Figure = (&'static str, fn(&Reading) -> f64, f64);

/// Compares the first and the last quarter of the readings after `warmup_s` (peaks, so a
/// moment's low does not hide a leak): a figure grows if its last peak exceeds its first by
/// more than `tolerance_pct` and by more than its slack (a few descriptors or connections,
/// 2 MiB of memory: noise on a small figure is not a leak).
pub fn trends(readings: &[Reading], warmup_s: f64, tolerance_pct: f64) -> Vec<Trend> {
    let steady: Vec<&Reading> = readings.iter().filter(|r| r.at_s >= warmup_s).collect();
    let quarter = (steady.len() / 4).max(1);
    let figures: [Figure; 4] = [
        ("resident memory (KiB)", |r| r.rss_kib, 2048.0),
        ("open descriptors", |r| r.fds, 16.0),
        ("server connections", |r| r.servers, 4.0),
        ("clients waiting for a server", |r| r.waiting, 8.0),
    ];
    figures
        .into_iter()
        .map(|(name, value, slack)| {
            let peak = |part: &[&Reading]| part.iter().map(|r| value(r)).fold(0.0, f64::max);
            let first_peak = peak(&steady[..quarter.min(steady.len())]);
            let last_peak = peak(&steady[steady.len().saturating_sub(quarter)..]);
            let grows = last_peak > first_peak * (1.0 + tolerance_pct / 100.0)
                && last_peak - first_peak > slack;
            Trend {
                name,
                first_peak,
                last_peak,
                grows,
            }
        })
        .collect()
}

pub fn soak(options: SoakOptions) -> Result<(), String> {
    let raised = procstat::raise_fd_limit(u64::from(options.clients) * 3 + 8192);
    if raised < u64::from(options.clients) * 2 + 1024 {
        return Err(format!(
            "the open-file limit is {raised}; {} clients need more (run as root or raise ulimit -n)",
            options.clients
        ));
    }
    let (dir, _tmp) = super::work_dir(options.dir.as_ref())?;
    let pgbench_bin = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool("pgbench");
    let psql_bin = pgherd_cluster::PgBinaries::find()
        .map_err(|e| e.to_string())?
        .tool("psql");
    // 16 iterations: thousands of logins stay cheap for pgbench and pgherd alike.
    let user = BenchUser::new("soak", 16);
    eprintln!(
        "creating a primary and two replicas in {} ...",
        dir.display()
    );
    let settings = [("max_connections", "300"), ("shared_buffers", "'128MB'")]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let cluster = BenchCluster::create(&dir, 2, settings, &[&user])?;
    super::pgbench_database(&cluster, &user, &pgbench_bin, options.scale)?;
    cluster.sql(
        "bench",
        "CREATE TABLE soak_churn (id bigserial PRIMARY KEY, at timestamptz DEFAULT now()); \
         GRANT ALL ON soak_churn, soak_churn_id_seq TO soak",
    )?;
    let users = [&user];
    let session_db = format!(
        "[databases.bench_session]\ndbname = \"bench\"\nmode = \"session\"\nmax_size = {}\n\n",
        SESSION_CLIENTS + 10
    );
    let pgherd = start_pgherd(
        &cluster,
        &PgherdSetup {
            nodes: 3,
            users: &users,
            pool_size: options.pool_size,
            workers: 0,
            database_keys: "",
            ha: true,
            admin: false,
            baseline: None,
            instance: Some(("pgherd", &session_db)),
        },
    )?;
    let api = pgherd.api_port.ok_or("the soak's pgherd has no HTTP API")?;
    let warmup_s = options
        .warmup_s
        .unwrap_or((options.duration_s / 10).max(30));
    let logs = dir.join("soak-logs");
    std::fs::create_dir_all(&logs).map_err(|e| e.to_string())?;

    let load = start_load(&pgbench_bin, &user, &pgherd, &options, &logs)?;
    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (stop, url) = (stop.clone(), user.url(pgherd.port, "bench"));
        let psql = psql_bin.clone();
        std::thread::spawn(move || churn(&psql, &url, &stop))
    };
    let events = Arc::new(Mutex::new(Vec::<String>::new()));
    let changes = {
        let (stop, events) = (stop.clone(), events.clone());
        let console = format!(
            "postgres://postgres:{}@127.0.0.1:{}/pgherd",
            cluster.superuser_password, pgherd.port
        );
        let cluster_nodes: Vec<_> = cluster.cluster.nodes.to_vec();
        let every = options.replica_restart_every_s;
        let duration = options.duration_s;
        std::thread::spawn(move || {
            change_cluster(
                &cluster_nodes,
                api,
                &psql_bin,
                &console,
                every,
                duration,
                &stop,
                &events,
            )
        })
    };

    let started = Instant::now();
    let mut readings = Vec::new();
    let deadline = started + Duration::from_secs(options.duration_s);
    let mut last_print = Instant::now();
    while Instant::now() < deadline {
        let reading = read(&pgherd, api, started);
        if last_print.elapsed() >= Duration::from_secs(30) {
            eprintln!(
                "{:>6.0} s  rss {:>7.0} KiB  fds {:>6.0}  clients {:>5.0}  servers {:>3.0}  waiting {:>4.0}",
                reading.at_s, reading.rss_kib, reading.fds, reading.clients, reading.servers, reading.waiting
            );
            last_print = Instant::now();
        }
        readings.push(reading);
        std::thread::sleep(Duration::from_secs(1));
    }
    stop.store(true, Ordering::Release);
    let outcomes = finish_load(load);
    let churned = churn.join().unwrap_or_default();
    let _ = changes.join();
    let events = events.lock().map(|e| e.clone()).unwrap_or_default();
    let steady = readings
        .iter()
        .filter(|r| r.at_s >= warmup_s as f64)
        .count();
    if steady < 8 {
        return Err(format!(
            "only {steady} readings after the {warmup_s} s warm-up: too few to tell a trend (run longer)"
        ));
    }
    let trends = trends(&readings, warmup_s as f64, options.tolerance_pct);
    let after = after_the_load(api);
    let report = render(
        &options,
        warmup_s,
        &Observed {
            readings: &readings,
            trends: &trends,
            outcomes: &outcomes,
            churned: &churned,
            events: &events,
            after: &after,
        },
    );
    println!("{report}");
    std::fs::create_dir_all(&options.out).map_err(|e| e.to_string())?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let csv = options.out.join(format!("soak-{stamp}.csv"));
    let md = options.out.join(format!("soak-{stamp}.md"));
    write_csv(&csv, &readings)?;
    std::fs::write(&md, &report).map_err(|e| e.to_string())?;
    eprintln!("wrote {} and {}", csv.display(), md.display());
    drop(pgherd);
    match trends
        .iter()
        .filter(|t| t.grows)
        .map(|t| t.name)
        .collect::<Vec<_>>()
    {
        _ if after.leaked() => Err(format!(
            "after the load, with {} clients left, {} server connections were still in use: leaked",
            after.clients, after.servers_in_use
        )),
        grown if grown.is_empty() => Ok(()),
        grown => Err(format!("grew without bound: {}", grown.join(", "))),
    }
}

/// What pgherd holds once every client of the load has gone.
#[derive(Debug, Clone, Copy, Default)]
struct AfterTheLoad {
    clients: f64,
    servers_in_use: f64,
    servers_idle: f64,
}

impl AfterTheLoad {
    /// A server connection still in use with no client left is one pgherd lost track of.
    fn leaked(&self) -> bool {
        self.clients == 0.0 && self.servers_in_use > 0.0
    }
}

/// Waits (up to 15 s: the last clients' disconnects, a server connection being reset) until
/// no client is left and no server connection is in use, and says what is left.
fn after_the_load(api: u16) -> AfterTheLoad {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let lists = lists(api);
        let item = |name: &str| list_items(&lists, name);
        let after = AfterTheLoad {
            clients: item("clients"),
            servers_in_use: item("servers_active") + item("servers_connecting"),
            servers_idle: item("servers_idle"),
        };
        let settled = after.clients == 0.0 && after.servers_in_use == 0.0;
        if settled || Instant::now() >= deadline {
            return after;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// pgbench runs of the whole duration: (what they are, the process, where its output goes);
/// killed if the run ends early.
struct Load(Vec<(String, Child, PathBuf)>);

impl Drop for Load {
    fn drop(&mut self) {
        for (_, child, _) in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn start_load(
    pgbench: &Path,
    user: &BenchUser,
    pgherd: &ProxyProcess,
    options: &SoakOptions,
    logs: &Path,
) -> Result<Load, String> {
    let session_script = logs.join("session.sql");
    std::fs::write(
        &session_script,
        "SET application_name = 'soak-session';\n\\set aid random(1, 100000 * :scale)\nSELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n",
    )
    .map_err(|e| e.to_string())?;
    let pooled = options.clients.saturating_sub(SESSION_CLIENTS).max(2);
    let half = pooled / 2;
    let rate = |share: f64| ((f64::from(options.rate) * share).max(1.0) as u32).to_string();
    let duration = options.duration_s.to_string();
    let runs: Vec<(String, Vec<String>, String)> = vec![
        (
            format!("TPC-B, simple protocol, transaction mode, {half} clients"),
            vec![
                "-M".into(),
                "simple".into(),
                "-c".into(),
                half.to_string(),
                "-R".into(),
                rate(0.3),
            ],
            user.url(pgherd.port, "bench"),
        ),
        (
            format!(
                "select-only, prepared, transaction mode, {} clients",
                pooled - half
            ),
            vec![
                "-S".into(),
                "-M".into(),
                "prepared".into(),
                "-c".into(),
                (pooled - half).to_string(),
                "-R".into(),
                rate(0.6),
            ],
            user.url(pgherd.port, "bench"),
        ),
        (
            format!("SET and select, session mode, {SESSION_CLIENTS} clients"),
            vec![
                "-f".into(),
                session_script.display().to_string(),
                "-c".into(),
                SESSION_CLIENTS.to_string(),
                "-R".into(),
                rate(0.1),
            ],
            user.url(pgherd.port, "bench_session"),
        ),
    ];
    let mut load = Load(Vec::new());
    for (i, (what, args, url)) in runs.into_iter().enumerate() {
        let out = logs.join(format!("pgbench-{i}.log"));
        let file = std::fs::File::create(&out).map_err(|e| e.to_string())?;
        let err = file.try_clone().map_err(|e| e.to_string())?;
        eprintln!("starting pgbench: {what}");
        let child = Command::new(pgbench)
            .args(["-n", "-j", "4", "-T", &duration])
            .args(&args)
            .arg(url)
            .env_remove("PGPASSWORD")
            .stdout(file)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot run pgbench: {e}"))?;
        load.0.push((what, child, out));
    }
    Ok(load)
}

/// What each pgbench run reported: its summary, and its error lines grouped by message.
struct Outcome {
    what: String,
    transactions: u64,
    failed: u64,
    errors: Vec<(String, usize)>,
}

fn finish_load(mut load: Load) -> Vec<Outcome> {
    std::mem::take(&mut load.0)
        .into_iter()
        .map(|(what, mut child, out)| {
            let _ = child.wait();
            let text = std::fs::read_to_string(&out).unwrap_or_default();
            let report = super::pgbench::parse_report(&text);
            let mut errors: Vec<(String, usize)> = Vec::new();
            for line in text
                .lines()
                .filter(|l| l.contains("error") || l.contains("FATAL"))
            {
                // The message without the client number, so alike errors group.
                let message = line
                    .split_once("aborted in command")
                    .map_or(line, |(_, rest)| rest)
                    .to_owned();
                match errors.iter_mut().find(|(m, _)| *m == message) {
                    Some((_, n)) => *n += 1,
                    None => errors.push((message, 1)),
                }
            }
            Outcome {
                what,
                transactions: report.as_ref().map_or(0, |r| r.transactions),
                failed: report.as_ref().map_or(0, |r| r.failed),
                errors,
            }
        })
        .collect()
}

/// What the churn's clients saw.
#[derive(Debug, Default, Clone)]
struct Churned {
    killed_in_transaction: u64,
    cancelled: u64,
    /// Cancels that did not stop their statement, which ran to its end: the cancel came
    /// before the statement started (PostgreSQL ignores a cancel for a backend running
    /// nothing, and pgherd one for a session that has no request under way).
    cancel_too_early: u64,
    /// psql output that says something else than the cancel it was sent (or nothing).
    unexplained: Vec<String>,
}

/// Until `stop`: every quarter second a psql client that dies (SIGKILL) while its transaction
/// waits, or one whose running statement is cancelled (SIGINT makes psql send a CancelRequest).
fn churn(psql: &Path, url: &str, stop: &AtomicBool) -> Churned {
    let mut churned = Churned::default();
    let mut cancel = false;
    while !stop.load(Ordering::Acquire) {
        cancel = !cancel;
        let sql = if cancel {
            "SELECT pg_sleep(60)"
        } else {
            "BEGIN; INSERT INTO soak_churn DEFAULT VALUES; SELECT pg_sleep(60)"
        };
        let child = Command::new(psql)
            .arg(url)
            .args(["-X", "-q", "-c", sql])
            .env_remove("PGPASSWORD")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn();
        let Ok(child) = child else {
            std::thread::sleep(Duration::from_millis(250));
            continue;
        };
        std::thread::sleep(Duration::from_millis(300));
        let signal = if cancel { libc::SIGINT } else { libc::SIGKILL };
        // SAFETY: kill(2) on a child this thread started and has not reaped.
        unsafe { libc::kill(child.id() as libc::pid_t, signal) };
        let (succeeded, stderr) = child
            .wait_with_output()
            .map(|o| {
                (
                    o.status.success(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            })
            .unwrap_or_default();
        if !cancel {
            churned.killed_in_transaction += 1;
        } else if stderr.contains("canceling statement due to user request") {
            churned.cancelled += 1;
        } else if succeeded && stderr.trim() == "Cancel request sent" {
            churned.cancel_too_early += 1;
        } else if churned.unexplained.len() < 20 {
            churned
                .unexplained
                .push(format!("cancel: {}", stderr.trim()));
        }
    }
    churned
}

/// Restarts a replica every `every_s` (one pgherd says is a replica) and switches over once,
/// half way through; each step is noted in `events`.
#[allow(clippy::too_many_arguments)]
fn change_cluster(
    nodes: &[pgherd_cluster::LocalNode],
    api: u16,
    psql: &Path,
    console: &str,
    every_s: u64,
    duration_s: u64,
    stop: &AtomicBool,
    events: &Mutex<Vec<String>>,
) {
    let started = Instant::now();
    let note = |text: String| {
        eprintln!("{:>6.0} s  {text}", started.elapsed().as_secs_f64());
        if let Ok(mut events) = events.lock() {
            events.push(format!("{:.0} s: {text}", started.elapsed().as_secs_f64()));
        }
    };
    let mut next_restart = every_s;
    let mut switched = false;
    let mut turn = 0usize;
    while !stop.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_secs(1));
        let at = started.elapsed().as_secs();
        if !switched && at >= duration_s / 2 {
            switched = true;
            let out = Command::new(psql)
                .arg(console)
                .args(["-X", "-A", "-t", "-c", "SWITCHOVER"])
                .output();
            match out {
                Ok(o) if o.status.success() => note("switchover done".into()),
                Ok(o) => note(format!(
                    "switchover failed: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                )),
                Err(e) => note(format!("switchover not run: {e}")),
            }
        }
        if every_s > 0 && at >= next_restart {
            next_restart += every_s;
            let replicas = replica_names(api);
            turn += 1;
            let Some(name) = replicas.get(turn % replicas.len().max(1)) else {
                note("no replica to restart".into());
                continue;
            };
            let Some(node) = nodes.iter().find(|n| &n.name == name) else {
                continue;
            };
            let restarted = node
                .stop(StopMode::Fast)
                .and_then(|()| node.start(Duration::from_secs(60)));
            note(match restarted {
                Ok(()) => format!("replica {name} restarted"),
                Err(e) => format!("replica {name} restart failed: {e}"),
            });
        }
    }
}

fn api_get(api: u16, path: &str) -> Option<serde_json::Value> {
    ureq::get(&format!("http://127.0.0.1:{api}{path}"))
        .timeout(Duration::from_secs(3))
        .call()
        .ok()?
        .into_json()
        .ok()
}

fn replica_names(api: u16) -> Vec<String> {
    api_get(api, "/api/nodes")
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter(|n| n["role"].as_str() == Some("replica"))
        .filter_map(|n| n["name"].as_str().map(str::to_owned))
        .collect()
}

fn read(pgherd: &ProxyProcess, api: u16, started: Instant) -> Reading {
    let lists = lists(api);
    let item = |name: &str| list_items(&lists, name);
    let pid = pgherd.pid();
    Reading {
        at_s: started.elapsed().as_secs_f64(),
        rss_kib: procstat::rss_kib(pid).unwrap_or(0) as f64,
        fds: procstat::open_fds(pid) as f64,
        clients: item("clients"),
        servers: item("servers_active") + item("servers_idle") + item("servers_connecting"),
        waiting: item("clients_waiting"),
    }
}

/// pgherd's lists and their sizes (`/api/lists`).
fn lists(api: u16) -> Vec<serde_json::Value> {
    api_get(api, "/api/lists")
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

fn list_items(lists: &[serde_json::Value], name: &str) -> f64 {
    lists
        .iter()
        .find(|r| r["list"].as_str() == Some(name))
        .and_then(|r| r["items"].as_f64())
        .unwrap_or(0.0)
}

fn write_csv(path: &Path, readings: &[Reading]) -> Result<(), String> {
    let mut f = std::fs::File::create(path).map_err(|e| e.to_string())?;
    writeln!(
        f,
        "at_s,rss_kib,fds,clients,server_connections,clients_waiting"
    )
    .map_err(|e| e.to_string())?;
    for r in readings {
        writeln!(
            f,
            "{:.1},{},{},{},{},{}",
            r.at_s, r.rss_kib, r.fds, r.clients, r.servers, r.waiting
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// What a run saw, for its report.
struct Observed<'a> {
    readings: &'a [Reading],
    trends: &'a [Trend],
    outcomes: &'a [Outcome],
    churned: &'a Churned,
    events: &'a [String],
    after: &'a AfterTheLoad,
}

fn render(options: &SoakOptions, warmup_s: u64, observed: &Observed) -> String {
    let Observed {
        readings,
        trends,
        outcomes,
        churned,
        events,
        after,
    } = *observed;
    let mut out = format!(
        "# pgherd bench soak\n\n{} clients for {} s ({} s warm-up not compared), {} transactions per second asked, a replica restarted every {} s, one switchover half way; {} readings a second apart.\n\n",
        options.clients, options.duration_s, warmup_s, options.rate, options.replica_restart_every_s, readings.len()
    );
    out.push_str("| figure | first quarter's peak | last quarter's peak | change | verdict |\n|---|---:|---:|---:|---|\n");
    for t in trends {
        let change = if t.first_peak > 0.0 {
            format!("{:+.1} %", (t.last_peak / t.first_peak - 1.0) * 100.0)
        } else {
            "–".into()
        };
        out.push_str(&format!(
            "| {} | {:.0} | {:.0} | {change} | {} |\n",
            t.name,
            t.first_peak,
            t.last_peak,
            if t.grows { "**grows**" } else { "flat" }
        ));
    }
    out.push_str("\n| load | transactions | failed | client errors |\n|---|---:|---:|---|\n");
    for o in outcomes {
        let errors = if o.errors.is_empty() {
            "none".to_owned()
        } else {
            o.errors
                .iter()
                .map(|(m, n)| format!("{n}× {}", m.trim()))
                .collect::<Vec<_>>()
                .join("; ")
        };
        out.push_str(&format!(
            "| {} | {} | {} | {errors} |\n",
            o.what, o.transactions, o.failed
        ));
    }
    out.push_str(&format!(
        "\nChurn: {} clients killed inside a transaction, {} statements cancelled by their client, {} cancels that did not stop their statement (it ran to its end: the cancel came before the statement started, at PostgreSQL, which ignores a cancel for a backend running nothing, or while pgherd still routed it); {} unexplained{}\n",
        churned.killed_in_transaction,
        churned.cancelled,
        churned.cancel_too_early,
        churned.unexplained.len(),
        if churned.unexplained.is_empty() {
            String::new()
        } else {
            format!(": {}", churned.unexplained.join(" | "))
        }
    ));
    out.push_str("\nCluster changes:\n");
    for e in events {
        out.push_str(&format!("- {e}\n"));
    }
    out.push_str(&format!(
        "\nAfter the load: {} clients left, {} server connections in use ({}), {} idle in the pools.\n",
        after.clients,
        after.servers_in_use,
        if after.leaked() { "**leaked**" } else { "none leaked" },
        after.servers_idle,
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readings(values: impl Fn(f64) -> f64) -> Vec<Reading> {
        (0..200)
            .map(|i| {
                let at = f64::from(i);
                Reading {
                    at_s: at,
                    rss_kib: values(at),
                    fds: 5000.0,
                    clients: 5000.0,
                    servers: 20.0,
                    waiting: 0.0,
                }
            })
            .collect()
    }

    #[test]
    fn a_figure_that_keeps_rising_grows_and_a_flat_one_does_not() {
        // Memory rising 100 KiB a second after the warm-up: a leak.
        let leak = trends(&readings(|t| 50_000.0 + t * 100.0), 20.0, 5.0);
        assert!(leak[0].grows, "{leak:?}");
        assert!(!leak[1].grows && !leak[2].grows && !leak[3].grows);
        // A burst during the warm-up, then flat with noise: no leak.
        let flat = trends(
            &readings(|t| {
                if t < 20.0 {
                    90_000.0
                } else {
                    50_000.0 + (t % 7.0) * 100.0
                }
            }),
            20.0,
            5.0,
        );
        assert!(!flat[0].grows, "{flat:?}");
        // More than the tolerance, but within the slack: noise on a small figure.
        let small = trends(
            &readings(|t| if t > 150.0 { 1500.0 } else { 1000.0 }),
            20.0,
            5.0,
        );
        assert!(!small[0].grows, "{small:?}");
    }
}
