//! `pgherd drill`: fault drills on a local cluster with pgherd in front, as `pgherd up` sets
//! it (sync durability, automatic failover and rejoin). Writers insert rows with unique ids
//! through pgherd and remember every acknowledged one and the node that took it; faults are
//! injected on the primary round after round; afterwards the drill checks that every
//! acknowledged id is on the final primary and that writes never went back and forth between
//! nodes within a round (two nodes taking writes through pgherd), and reports the RTO seen by
//! the clients: from the last acknowledged write before the fault to the first one after it.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pgherd_cluster::{LocalNode, StopMode};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::bench::targets::{start_pgherd, BenchCluster, BenchUser, PgherdSetup};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fault {
    /// SIGKILL of the primary's postmaster.
    Kill,
    /// `pg_ctl stop -m immediate` of the primary.
    Immediate,
    /// SIGSTOP of the primary's processes (a hung server), SIGCONT once it was replaced.
    Sigstop,
    /// A planned switchover under load.
    Switchover,
    /// SIGKILL of the primary and of one synchronous standby together; the standby restarts
    /// after a few seconds. Until it does, no survivor is sure to hold every acknowledged
    /// commit, so pgherd must not promote one.
    Double,
    /// The primary cut off the network: every node runs in its own network namespace, and
    /// the primary's veth goes down (pgherd and the replicas stop hearing it, it keeps
    /// running); the link comes back once writes go on elsewhere.
    Partition,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Immediate => "immediate",
            Fault::Sigstop => "sigstop",
            Fault::Switchover => "switchover",
            Fault::Double => "double",
            Fault::Partition => "partition",
        }
    }
}

#[derive(Args, Debug)]
pub struct DrillOptions {
    /// Faults injected, one per round, in turn.
    #[arg(long, value_delimiter = ',', default_values_t = [Fault::Kill, Fault::Immediate, Fault::Sigstop, Fault::Switchover].to_vec(), value_enum)]
    faults: Vec<Fault>,
    /// Rounds (one fault each).
    #[arg(long, alias = "kills", default_value_t = 4)]
    rounds: usize,
    #[arg(long, default_value_t = 2)]
    replicas: usize,
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    writers: usize,
    /// Where the cluster lives (default: a temporary directory removed afterwards).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Before the faults, this many seconds of heavy load without any fault, counting the
    /// health checks that failed anyway and the nodes wrongly marked down (false positives).
    #[arg(long, default_value_t = 0)]
    calm_s: u64,
    /// Readers (sequential scans through pgherd) that load the cluster during the calm phase.
    #[arg(long, default_value_t = 16)]
    calm_readers: usize,
}

/// One acknowledged write: its id, when the client heard back, and the port of the node that
/// committed it.
#[derive(Debug, Clone, Copy)]
struct Ack {
    id: i64,
    at: Instant,
    port: u16,
}

#[derive(Default)]
struct Log {
    acks: Vec<Ack>,
    errors: usize,
}

struct Round {
    fault: Fault,
    old_primary: String,
    new_primary: String,
    rto: Option<Duration>,
    errors: usize,
    /// What went wrong in the round beyond lost writes (a promotion that should not be).
    violation: Option<String>,
}

/// How long the second node of a double failure stays down.
const DOUBLE_OUTAGE: Duration = Duration::from_secs(4);

/// How long a round may take to get writes going again, and the cluster back to full strength.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

pub fn run(options: DrillOptions) -> Result<(), String> {
    if options.faults.is_empty() || options.rounds == 0 || options.replicas == 0 {
        return Err("a drill needs at least one fault, one round and one replica".into());
    }
    let (dir, _tmp) = crate::bench::work_dir(options.dir.as_ref())?;
    // The postmasters pg_ctl starts are orphans; adopting them lets the drill reap the one it
    // kills (a container's first process may never do it, and a zombie postmaster still
    // holds its lock files in PostgreSQL's eyes).
    // SAFETY: prctl with PR_SET_CHILD_SUBREAPER only changes this process's attributes.
    unsafe {
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let user = BenchUser::new("drill", 4096);
    eprintln!(
        "creating a primary and {} replicas in {}",
        options.replicas,
        dir.display()
    );
    // Declared before the cluster so it is torn down after the nodes stopped.
    let network = match options.faults.contains(&Fault::Partition) {
        true => Some(Network::create(options.replicas + 1)?),
        false => None,
    };
    let cluster = BenchCluster::create_in(
        &dir,
        options.replicas,
        Vec::new(),
        &[&user],
        network.as_ref().map(Network::nodes).unwrap_or_default(),
    )?;
    cluster.sql("postgres", "CREATE DATABASE drill OWNER drill")?;
    let pgherd = start_pgherd(
        &cluster,
        &PgherdSetup {
            nodes: options.replicas + 1,
            users: &[&user],
            pool_size: 20,
            workers: 0,
            database_keys: "",
            ha: true,
            baseline: None,
        },
    )?;
    let rt = crate::runtime(2)?;
    let result = rt.block_on(drill(
        &options,
        &cluster,
        network.as_ref(),
        &user,
        pgherd.port,
    ));
    if result.is_err() {
        eprintln!("pgherd's log: {}", pgherd.log.display());
    }
    result
}

async fn drill(
    options: &DrillOptions,
    cluster: &BenchCluster,
    network: Option<&Network>,
    user: &BenchUser,
    port: u16,
) -> Result<(), String> {
    let app_url = user.url(port, "drill");
    let admin_url = format!(
        "postgres://postgres:{}@127.0.0.1:{port}/pgherd",
        cluster.superuser_password
    );
    // Through pgherd as the superuser: pg_stat_replication shows its state only to those.
    let super_url = format!(
        "postgres://postgres:{}@127.0.0.1:{port}/postgres",
        cluster.superuser_password
    );
    let setup = connect(&app_url).await?;
    setup
        .batch_execute("CREATE TABLE drill_writes (id bigint PRIMARY KEY, writer int)")
        .await
        .map_err(|e| format!("creating the table: {e}"))?;

    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Log::default()));
    let writers: Vec<_> = (0..options.writers)
        .map(|w| tokio::spawn(writer(w as i64, app_url.clone(), stop.clone(), log.clone())))
        .collect();

    if options.calm_s > 0 {
        calm(options, &app_url, &admin_url).await?;
    }
    let mut rounds = Vec::new();
    let mut injections = Vec::new();
    let mut failure = None;
    for r in 0..options.rounds {
        let fault = options.faults[r % options.faults.len()];
        match round(
            cluster,
            network,
            &super_url,
            &admin_url,
            fault,
            &log,
            &mut injections,
        )
        .await
        {
            Ok(round) => {
                eprintln!(
                    "round {}: {} of {}: writes on {} after {}",
                    r + 1,
                    fault.name(),
                    round.old_primary,
                    round.new_primary,
                    round
                        .rto
                        .map_or("?".to_owned(), |d| format!("{} ms", d.as_millis()))
                );
                rounds.push(round);
            }
            Err(e) => {
                failure = Some(format!("round {} ({}): {e}", r + 1, fault.name()));
                break;
            }
        }
    }
    // Let writes run on the last primary, then stop and check.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        let _ = w.await;
    }
    let log = std::mem::take(&mut *log.lock().map_err(|_| "writer log poisoned")?);
    let (primary_port, on_primary) = stored_ids(cluster, &app_url).await?;
    let lost: Vec<i64> = log
        .acks
        .iter()
        .map(|a| a.id)
        .filter(|id| !on_primary.contains(id))
        .collect();
    let mut violations = split_brain(&log.acks, &injections);
    violations.extend(rounds.iter().filter_map(|r| r.violation.clone()));
    report(&rounds, &log, &lost, &violations, primary_port);
    for id in lost.iter().take(10) {
        if let Some(ack) = log.acks.iter().find(|a| a.id == *id) {
            let round = injections.iter().rposition(|&t| t <= ack.at);
            let since = round.map(|r| ack.at.duration_since(injections[r]).as_millis());
            println!(
                "  lost id {id}: acknowledged by port {} {}",
                ack.port,
                match (round, since) {
                    (Some(r), Some(ms)) => format!("in round {} ({ms} ms after its fault)", r + 1),
                    _ => "before the first fault".to_owned(),
                }
            );
        }
    }
    if let Some(f) = failure {
        return Err(f);
    }
    if !lost.is_empty() || !violations.is_empty() {
        return Err(format!(
            "{} acknowledged write(s) lost, {} split-brain sign(s)",
            lost.len(),
            violations.len()
        ));
    }
    Ok(())
}

/// One fault on the current primary, and the wait until writes go on and every node streams
/// again.
async fn round(
    cluster: &BenchCluster,
    network: Option<&Network>,
    super_url: &str,
    admin_url: &str,
    fault: Fault,
    log: &Mutex<Log>,
    injections: &mut Vec<Instant>,
) -> Result<Round, String> {
    let c = connect(super_url).await?;
    wait_full_strength(&c, cluster.cluster.nodes.len() - 1).await?;
    // Writes flow before the fault, so the RTO has a start.
    let ready = Instant::now();
    let deadline = ready + RECOVERY_TIMEOUT;
    while log
        .lock()
        .map_err(|_| "poisoned")?
        .acks
        .last()
        .is_none_or(|a| a.at <= ready)
    {
        if Instant::now() > deadline {
            return Err("no write was acknowledged with the cluster whole".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let old_port: u16 = value(&c, "/* pgherd:primary */ SELECT current_setting('port')")
        .await?
        .parse()
        .map_err(|_| "unreadable port")?;
    let old = node_by_port(cluster, old_port)?;
    let errors_before = log.lock().map_err(|_| "poisoned")?.errors;
    let injected = Instant::now();
    injections.push(injected);
    let mut stopped_pids = Vec::new();
    let mut killed = None;
    let mut violation = None;
    match fault {
        Fault::Kill => {
            let pid = postmaster_pid(&old)?;
            signal(pid, libc::SIGKILL)?;
            killed = Some(pid);
        }
        Fault::Partition => set_link(network, &old, false)?,
        Fault::Double => {
            let standby = cluster
                .cluster
                .nodes
                .iter()
                .find(|n| n.port != old_port)
                .cloned()
                .ok_or("a double failure needs a replica")?;
            let standby_pid = postmaster_pid(&standby)?;
            let pid = postmaster_pid(&old)?;
            signal(pid, libc::SIGKILL)?;
            signal(standby_pid, libc::SIGKILL)?;
            killed = Some(pid);
            tokio::time::sleep(DOUBLE_OUTAGE).await;
            if let Some(Ack { port, .. }) = first_ack_elsewhere(log, injected, old_port)? {
                violation = Some(format!(
                    "double failure: the node on port {port} took writes while synchronous standby {} was down",
                    standby.name
                ));
            }
            wait_gone(&standby, standby_pid).await;
            blocking_start(&standby).await?;
        }
        Fault::Immediate => blocking_stop(&old, StopMode::Immediate).await?,
        Fault::Sigstop => {
            stopped_pids = node_pids(&old)?;
            for pid in &stopped_pids {
                signal(*pid, libc::SIGSTOP)?;
            }
        }
        Fault::Switchover => {
            let admin = connect(admin_url).await?;
            admin
                .simple_query("SWITCHOVER")
                .await
                .map_err(|e| format!("SWITCHOVER: {}", db_message(&e)))?;
        }
    }
    // Writes resume on another node.
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    let first_after = loop {
        if let Some(ack) = first_ack_elsewhere(log, injected, old_port)? {
            break ack;
        }
        if Instant::now() > deadline {
            return Err(format!(
                "no write was acknowledged by another node within {} s",
                RECOVERY_TIMEOUT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (last_before, errors) = {
        let log = log.lock().map_err(|_| "poisoned")?;
        (
            log.acks
                .iter()
                .filter(|a| a.at < injected)
                .map(|a| a.at)
                .max(),
            log.errors - errors_before,
        )
    };
    let new = node_by_port(cluster, first_after.port)?;
    // The replaced primary comes back; pgherd fences it and rejoins it as a standby.
    if let Some(pid) = killed {
        wait_gone(&old, pid).await;
    }
    match fault {
        Fault::Kill | Fault::Immediate | Fault::Double => blocking_start(&old).await?,
        Fault::Sigstop => {
            for pid in &stopped_pids {
                let _ = signal(*pid, libc::SIGCONT);
            }
        }
        Fault::Switchover => {}
        Fault::Partition => set_link(network, &old, true)?,
    }
    Ok(Round {
        fault,
        old_primary: old.name.clone(),
        new_primary: new.name.clone(),
        rto: last_before.map(|t| first_after.at.duration_since(t)),
        errors,
        violation,
    })
}

/// Heavy load and no fault for `calm_s` seconds: every health check that fails, node marked
/// down or failover event in that time is a false positive.
async fn calm(options: &DrillOptions, app_url: &str, admin_url: &str) -> Result<(), String> {
    let admin = connect(admin_url).await?;
    let before = check_counts(&admin).await?;
    let events_before = admin
        .simple_query("SHOW EVENTS")
        .await
        .map_err(|e| db_message(&e))?
        .iter()
        .filter(|m| matches!(m, SimpleQueryMessage::Row(_)))
        .count();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..options.calm_readers)
        .map(|_| {
            let (url, stop) = (app_url.to_owned(), stop.clone());
            tokio::spawn(async move {
                let mut reads = 0u64;
                let Ok(c) = connect(&url).await else {
                    return reads;
                };
                while !stop.load(Ordering::Relaxed) {
                    // A sequential scan of the growing table: CPU on whichever node serves it.
                    if c.simple_query("SELECT sum(id), count(*) FROM drill_writes")
                        .await
                        .is_ok()
                    {
                        reads += 1;
                    }
                }
                reads
            })
        })
        .collect();
    eprintln!(
        "calm phase: {} s of load ({} readers) without a fault",
        options.calm_s, options.calm_readers
    );
    tokio::time::sleep(Duration::from_secs(options.calm_s)).await;
    stop.store(true, Ordering::Relaxed);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap_or(0);
    }
    let after = check_counts(&admin).await?;
    let events: Vec<String> = admin
        .simple_query("SHOW EVENTS")
        .await
        .map_err(|e| db_message(&e))?
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(format!(
                "{} {}: {}",
                r.get(1).unwrap_or(""),
                r.get(2).unwrap_or(""),
                r.get(3).unwrap_or("")
            )),
            _ => None,
        })
        .skip(events_before)
        .collect();
    let (mut checks, mut failed, mut down) = (0, 0, 0);
    for (name, (ok_after, failed_after, down_after)) in &after {
        let (ok_before, failed_before, down_before) = before.get(name).copied().unwrap_or_default();
        checks += ok_after - ok_before + failed_after - failed_before;
        failed += failed_after - failed_before;
        down += down_after - down_before;
    }
    println!(
        "calm phase: {} s, {reads} scans; health checks {checks}, failed {failed}, nodes marked down {down}, events {}",
        options.calm_s,
        events.len()
    );
    for e in &events {
        println!("  event: {e}");
    }
    Ok(())
}

/// Per node: (checks ok, checks failed, times marked down), from SHOW NODES.
async fn check_counts(
    admin: &Client,
) -> Result<std::collections::HashMap<String, (u64, u64, u64)>, String> {
    let messages = admin
        .simple_query("SHOW NODES")
        .await
        .map_err(|e| db_message(&e))?;
    let mut counts = std::collections::HashMap::new();
    for m in &messages {
        if let SimpleQueryMessage::Row(r) = m {
            let number = |column: &str| -> Result<u64, String> {
                r.try_get(column)
                    .ok()
                    .flatten()
                    .and_then(|v: &str| v.parse().ok())
                    .ok_or_else(|| format!("SHOW NODES has no number in column {column}"))
            };
            counts.insert(
                r.get("name").unwrap_or_default().to_owned(),
                (
                    number("checks_ok")?,
                    number("checks_failed")?,
                    number("times_down")?,
                ),
            );
        }
    }
    Ok(counts)
}

/// Inserts rows with unique ids through pgherd until told to stop, logging each
/// acknowledgement with the node that committed it; reconnects after errors.
async fn writer(w: i64, url: String, stop: Arc<AtomicBool>, log: Arc<Mutex<Log>>) {
    let mut n: i64 = 0;
    let mut client: Option<Client> = None;
    while !stop.load(Ordering::Relaxed) {
        let c = match &client {
            Some(c) => c,
            None => match connect(&url).await {
                Ok(c) => client.insert(c),
                Err(_) => {
                    if let Ok(mut log) = log.lock() {
                        log.errors += 1;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        n += 1;
        let id = w * 1_000_000_000 + n;
        let sql = format!(
            "INSERT INTO drill_writes VALUES ({id}, {w}) RETURNING current_setting('port')"
        );
        match c.simple_query(&sql).await {
            Ok(messages) => {
                let port = first(&messages).and_then(|p| p.parse().ok()).unwrap_or(0);
                if let Ok(mut log) = log.lock() {
                    log.acks.push(Ack {
                        id,
                        at: Instant::now(),
                        port,
                    });
                }
            }
            Err(_) => {
                if let Ok(mut log) = log.lock() {
                    log.errors += 1;
                }
                client = None;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Waits until the primary streams to every replica (the previous round's old primary has
/// rejoined), so each round starts from a whole cluster.
async fn wait_full_strength(c: &Client, replicas: usize) -> Result<(), String> {
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    loop {
        let streaming = value(
            c,
            "/* pgherd:primary */ SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .await
        .unwrap_or_default();
        if streaming == replicas.to_string() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the primary streams to {streaming} of {replicas} replicas after {} s",
                RECOVERY_TIMEOUT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The final primary's port and the ids it holds.
async fn stored_ids(cluster: &BenchCluster, app_url: &str) -> Result<(u16, HashSet<i64>), String> {
    let c = connect(app_url).await?;
    let port: u16 = value(&c, "/* pgherd:primary */ SELECT current_setting('port')")
        .await?
        .parse()
        .map_err(|_| "unreadable port")?;
    // Straight to the node, not through pgherd: what it holds, whatever pgherd routes.
    let node = node_by_port(cluster, port)?;
    let direct = connect(&format!(
        "postgres://postgres:{}@{}:{port}/drill",
        cluster.superuser_password, node.host
    ))
    .await?;
    let rows = direct
        .query("SELECT id FROM drill_writes", &[])
        .await
        .map_err(|e| db_message(&e))?;
    Ok((port, rows.iter().map(|r| r.get::<_, i64>(0)).collect()))
}

/// Signs that two nodes took writes at once: the node acknowledging writes changes more than
/// once after a fault (back and forth), or before the first fault. `injections`: when each
/// fault was injected.
fn split_brain(acks: &[Ack], injections: &[Instant]) -> Vec<String> {
    let mut acks = acks.to_vec();
    acks.sort_by_key(|a| a.at);
    let round_of = |at: Instant| injections.iter().rposition(|&t| t <= at);
    let mut violations = Vec::new();
    let mut changes = vec![0usize; injections.len()];
    for pair in acks.windows(2) {
        if pair[0].port == pair[1].port {
            continue;
        }
        match round_of(pair[1].at) {
            None => violations.push(format!(
                "writes moved from port {} to {} before any fault",
                pair[0].port, pair[1].port
            )),
            Some(r) => {
                changes[r] += 1;
                if changes[r] > 1 {
                    violations.push(format!(
                        "round {}: writes moved again, from port {} to {}",
                        r + 1,
                        pair[0].port,
                        pair[1].port
                    ));
                }
            }
        }
    }
    violations
}

fn report(rounds: &[Round], log: &Log, lost: &[i64], violations: &[String], primary_port: u16) {
    println!("round  fault       old   new   RTO ms  client errors");
    for (i, r) in rounds.iter().enumerate() {
        println!(
            "{:>5}  {:<10}  {:<4}  {:<4}  {:>6}  {:>13}",
            i + 1,
            r.fault.name(),
            r.old_primary,
            r.new_primary,
            r.rto.map_or("?".to_owned(), |d| d.as_millis().to_string()),
            r.errors
        );
    }
    let summary = |what: &str, of: &dyn Fn(&Round) -> bool| {
        let mut rtos: Vec<u128> = rounds
            .iter()
            .filter(|r| of(r))
            .filter_map(|r| r.rto.map(|d| d.as_millis()))
            .collect();
        rtos.sort_unstable();
        let pick = |q: f64| {
            rtos.get(((rtos.len() as f64 - 1.0) * q).round() as usize)
                .map_or("-".to_owned(), |v| v.to_string())
        };
        println!(
            "RTO {what}: median {} ms, p95 {} ms over {} round(s)",
            pick(0.5),
            pick(0.95),
            rtos.len()
        );
    };
    summary("all", &|_| true);
    let mut faults: Vec<Fault> = rounds.iter().map(|r| r.fault).collect();
    faults.dedup();
    faults.sort_by_key(|f| f.name());
    faults.dedup();
    for fault in faults {
        summary(fault.name(), &|r| r.fault == fault);
    }
    println!(
        "acknowledged writes: {}, lost: {}, client errors: {}, split-brain signs: {}, final primary port {primary_port}",
        log.acks.len(),
        lost.len(),
        log.errors,
        violations.len()
    );
    for v in violations {
        println!("  {v}");
    }
}

async fn connect(url: &str) -> Result<Client, String> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| db_message(&e))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

async fn value(c: &Client, sql: &str) -> Result<String, String> {
    let messages = c.simple_query(sql).await.map_err(|e| db_message(&e))?;
    Ok(first(&messages).unwrap_or_default().to_owned())
}

fn first(messages: &[SimpleQueryMessage]) -> Option<&str> {
    messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => r.get(0),
        _ => None,
    })
}

fn db_message(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => e.to_string(),
    }
}

fn node_by_port(cluster: &BenchCluster, port: u16) -> Result<LocalNode, String> {
    cluster
        .cluster
        .nodes
        .iter()
        .find(|n| n.port == port)
        .cloned()
        .ok_or_else(|| format!("no cluster node listens on port {port}"))
}

/// A network for a cluster whose nodes each run in their own namespace: a bridge on the host
/// (10.X.0.1) and per node a namespace with a veth pair, the node's end at 10.X.0.(i+2).
/// Nodes reach each other through the bridge (no IP forwarding needed); cutting a node is
/// taking its host-side veth down. Removed when dropped.
struct Network {
    id: u32,
    subnet: u8,
    nodes: usize,
}

impl Network {
    fn create(nodes: usize) -> Result<Network, String> {
        let id = std::process::id() % 100_000;
        let subnet = 100 + (id % 100) as u8;
        let network = Network { id, subnet, nodes };
        let bridge = network.bridge();
        ip(&["link", "add", &bridge, "type", "bridge"])?;
        ip(&[
            "addr",
            "add",
            &format!("10.{subnet}.0.1/24"),
            "dev",
            &bridge,
        ])?;
        ip(&["link", "set", &bridge, "up"])?;
        for i in 0..nodes {
            let (ns, host_end, node_end) = network.names(i);
            ip(&["netns", "add", &ns])?;
            ip(&[
                "link", "add", &host_end, "type", "veth", "peer", "name", &node_end,
            ])?;
            ip(&["link", "set", &node_end, "netns", &ns])?;
            ip(&["link", "set", &host_end, "master", &bridge])?;
            ip(&["link", "set", &host_end, "up"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{}/24", network.address(i)),
                "dev",
                &node_end,
            ])?;
            ip(&["-n", &ns, "link", "set", &node_end, "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(network)
    }

    fn bridge(&self) -> String {
        format!("phb{}", self.id)
    }

    /// (namespace, host-side veth, node-side veth).
    fn names(&self, i: usize) -> (String, String, String) {
        (
            format!("pgherd-drill-{}-{i}", self.id),
            format!("phv{}h{i}", self.id),
            format!("phv{}n{i}", self.id),
        )
    }

    fn address(&self, i: usize) -> String {
        format!("10.{}.0.{}", self.subnet, i + 2)
    }

    /// (namespace, address) per node, for the cluster.
    fn nodes(&self) -> Vec<(String, String)> {
        (0..self.nodes)
            .map(|i| (self.names(i).0, self.address(i)))
            .collect()
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for i in 0..self.nodes {
            let _ = ip(&["netns", "del", &self.names(i).0]);
        }
        let _ = ip(&["link", "del", &self.bridge()]);
    }
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {} (network namespaces need root)",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Takes the node's link to everyone down, or brings it back up: its host-side veth.
fn set_link(network: Option<&Network>, node: &LocalNode, up: bool) -> Result<(), String> {
    let network = network.ok_or("a partition needs the nodes in network namespaces")?;
    let i = (0..network.nodes)
        .find(|&i| node.netns.as_deref() == Some(network.names(i).0.as_str()))
        .ok_or_else(|| format!("node {} runs in none of the drill's namespaces", node.name))?;
    let host_end = network.names(i).1;
    ip(&["link", "set", &host_end, if up { "up" } else { "down" }])
}

/// The first write acknowledged after `since` by a node other than the one on `old_port`.
fn first_ack_elsewhere(
    log: &Mutex<Log>,
    since: Instant,
    old_port: u16,
) -> Result<Option<Ack>, String> {
    Ok(log
        .lock()
        .map_err(|_| "writer log poisoned")?
        .acks
        .iter()
        .find(|a| a.at > since && a.port != old_port)
        .copied())
}

fn postmaster_pid(node: &LocalNode) -> Result<u32, String> {
    node.postmaster_pid()
        .ok_or_else(|| format!("node {} has no postmaster.pid", node.name))
}

/// The postmaster and its children.
fn node_pids(node: &LocalNode) -> Result<Vec<u32>, String> {
    let postmaster = postmaster_pid(node)?;
    let mut pids = vec![postmaster];
    let out = std::process::Command::new("pgrep")
        .args(["-P", &postmaster.to_string()])
        .output()
        .map_err(|e| format!("pgrep: {e}"))?;
    pids.extend(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse::<u32>().ok()),
    );
    Ok(pids)
}

/// Waits until a killed postmaster is gone, reaping it (the drill adopted it). One that stays
/// a zombie anyway still holds its lock files in PostgreSQL's eyes: they are removed so the
/// node can start again.
async fn wait_gone(node: &LocalNode, pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // SAFETY: waitpid on one process id with WNOHANG; it only reaps that process.
        unsafe {
            libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG);
        }
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Err(_) => return,
            Ok(stat) => {
                // "pid (comm) S ...": the state follows the command name.
                let state = stat
                    .rsplit(')')
                    .next()
                    .and_then(|r| r.split_whitespace().next());
                if state == Some("Z") {
                    let socket = format!(".s.PGSQL.{}", node.port);
                    for file in [
                        node.data_dir.join("postmaster.pid"),
                        node.socket_dir.join(format!("{socket}.lock")),
                        node.socket_dir.join(socket),
                    ] {
                        let _ = std::fs::remove_file(file);
                    }
                    return;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn signal(pid: u32, sig: libc::c_int) -> Result<(), String> {
    // SAFETY: kill(2) on a PostgreSQL process of the drill's own cluster.
    if unsafe { libc::kill(pid as libc::pid_t, sig) } == 0 {
        Ok(())
    } else {
        Err(format!(
            "cannot signal process {pid}: {}",
            std::io::Error::last_os_error()
        ))
    }
}

async fn blocking_start(node: &LocalNode) -> Result<(), String> {
    let node = node.clone();
    tokio::task::spawn_blocking(move || node.start(RECOVERY_TIMEOUT))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}

async fn blocking_stop(node: &LocalNode, mode: StopMode) -> Result<(), String> {
    let node = node.clone();
    tokio::task::spawn_blocking(move || node.stop(mode))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())
}
