//! `pgherd drill`: fault drills on a local cluster with pgherd in front, as `pgherd up` sets
//! it (sync durability, automatic failover and rejoin). Writers insert rows with unique ids
//! through pgherd and remember every acknowledged one and the node that took it; faults are
//! injected on the primary round after round; afterwards the drill checks that every
//! acknowledged id is on the final primary and that writes never went back and forth between
//! nodes within a round (two nodes taking writes through pgherd), and reports the RTO seen by
//! the clients: from the last acknowledged write before the fault to the first one after it.
//!
//! With `--instances N`, N pgherd instances agree through a local etcd and the writers use
//! them as a multi-host connection string does (each writer prefers another instance); the
//! faults then include pgherd's own: the leader instance killed, alone or with the primary,
//! stopped, cut off from etcd, and etcd itself down ([`instances`]).

mod calm;
mod cascade;
mod front;
mod instances;
mod process;
mod relay;
mod report;
mod writer;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pgherd_cluster::{LocalNode, StopMode};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

use crate::bench::targets::{start_pgherd, BenchCluster, BenchUser, PgherdSetup};
use crate::sql_session::{client_rows, first, pg_error};
use front::Front;
use instances::Instances;
use pgherd_cluster::network::Network;
use process::{blocking_start, blocking_stop, node_pids, postmaster_pid, signal, wait_gone};
use report::{report, split_brain, unanswered, Injection};
use writer::{Patience, Writer};

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
    /// SIGKILL of the primary, then of its replacement a second after that took its first
    /// write, while the first is still on its way back (restarted, fenced, rejoined); the
    /// replacement restarts after a few seconds.
    Cascade,
    /// The primary cut off the network: every node runs in its own network namespace, and
    /// the primary's veth goes down (pgherd and the replicas stop hearing it, it keeps
    /// running); the link comes back once writes go on elsewhere.
    Partition,
    /// SIGKILL of the leading pgherd instance (`--instances`); it starts again once the
    /// clients write through the others.
    InstanceKill,
    /// SIGKILL of the leading pgherd instance and of the primary together: another instance
    /// must take the lease before it may fail over.
    InstanceKillPrimary,
    /// SIGSTOP of the leading pgherd instance, its link to etcd cut as well (a hung host);
    /// SIGCONT after the lease changed hands, the link back a little later.
    InstanceStop,
    /// The leading pgherd instance cut off from etcd (it still reaches clients and
    /// PostgreSQL): it stops acting, another takes the lease, nobody fails over.
    EtcdCut,
    /// etcd killed (the majority of a one-member etcd lost) for half the lease: nothing
    /// changes for the clients, nobody fails over.
    EtcdDown,
    /// etcd killed for twice the lease: once their leases may have run out the instances hold
    /// writes (another could lead), until etcd answers again; nobody fails over.
    EtcdDownLong,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Immediate => "immediate",
            Fault::Sigstop => "sigstop",
            Fault::Switchover => "switchover",
            Fault::Double => "double",
            Fault::Cascade => "cascade",
            Fault::Partition => "partition",
            Fault::InstanceKill => "instance-kill",
            Fault::InstanceKillPrimary => "instance-kill-primary",
            Fault::InstanceStop => "instance-stop",
            Fault::EtcdCut => "etcd-cut",
            Fault::EtcdDown => "etcd-down",
            Fault::EtcdDownLong => "etcd-down-long",
        }
    }

    /// A fault of pgherd's own instances or of etcd, not of PostgreSQL.
    fn hits_instances(self) -> bool {
        matches!(
            self,
            Fault::InstanceKill
                | Fault::InstanceKillPrimary
                | Fault::InstanceStop
                | Fault::EtcdCut
                | Fault::EtcdDown
                | Fault::EtcdDownLong
        )
    }
}

/// The faults a drill injects when `--faults` names none.
fn default_faults(instances: usize) -> Vec<Fault> {
    match instances {
        0 | 1 => vec![
            Fault::Kill,
            Fault::Immediate,
            Fault::Sigstop,
            Fault::Switchover,
        ],
        _ => vec![
            Fault::Kill,
            Fault::InstanceKill,
            Fault::Immediate,
            Fault::EtcdCut,
            Fault::InstanceKillPrimary,
            Fault::Sigstop,
            Fault::EtcdDown,
            Fault::Switchover,
            Fault::InstanceStop,
            Fault::EtcdDownLong,
        ],
    }
}

#[derive(Args, Debug)]
pub struct DrillOptions {
    /// Faults injected, one per round, in turn (default: kill, immediate, sigstop,
    /// switchover; with `--instances` the instance faults are mixed in).
    #[arg(long, value_delimiter = ',', value_enum)]
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
    /// pgherd instances in front of the cluster, agreeing through a local etcd (Debian's
    /// etcd-server) when more than one.
    #[arg(long, default_value_t = 1)]
    instances: usize,
    /// The instances' leader lease (`[dcs] lease_ttl_s`).
    #[arg(long, default_value_t = 3)]
    lease_ttl_s: u64,
}

/// One acknowledged write: its id, when the client heard back, the port of the node that
/// committed it, the writer and the pgherd instance it went through.
#[derive(Debug, Clone, Copy)]
struct Ack {
    id: i64,
    at: Instant,
    port: u16,
    writer: usize,
    instance: usize,
}

/// A write pgherd never answered: sent at `sent_at`, no answer within [`HUNG_AFTER`].
#[derive(Debug, Clone, Copy)]
struct Hung {
    writer: usize,
    id: i64,
    sent_at: Instant,
}

#[derive(Default)]
struct Log {
    acks: Vec<Ack>,
    errors: usize,
    hung: Vec<Hung>,
}

struct Round {
    fault: Fault,
    /// What the fault hit: the primary's name, or the pgherd instance's.
    hit: String,
    new_primary: String,
    /// The instance leading after the fault, when several run.
    leader_after: Option<String>,
    rto: Option<Duration>,
    errors: usize,
    /// What went wrong in the round beyond lost writes (a promotion that should not be).
    violation: Option<String>,
}

/// How long the second node of a double failure (or of a cascade) stays down.
const DOUBLE_OUTAGE: Duration = Duration::from_secs(4);

/// How long a round may take to get writes going again, and the cluster back to full strength.
const RECOVERY_TIMEOUT: Duration = Duration::from_secs(60);

/// Asks `check` every `period` until it has an answer; `None` once [`RECOVERY_TIMEOUT`] has
/// passed without one. An error from `check` ends the wait at once.
async fn poll<T>(
    period: Duration,
    mut check: impl AsyncFnMut() -> Result<Option<T>, String>,
) -> Result<Option<T>, String> {
    let deadline = Instant::now() + RECOVERY_TIMEOUT;
    loop {
        if let Some(answer) = check().await? {
            return Ok(Some(answer));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        tokio::time::sleep(period).await;
    }
}

/// How long a client waits for a connection (libpq's `connect_timeout`) before it tries the
/// next instance.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// How long a client of several instances waits for an answer before it gives up on the
/// connection (a socket timeout) and reconnects, to another instance if this one hangs.
const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a client of one instance, and the drill's own queries, wait for an answer before
/// the drill calls it a hang: pgherd ends the sessions on a node it replaced and bounds every
/// wait of its own, so no answer should take this long.
const HUNG_AFTER: Duration = RECOVERY_TIMEOUT;

pub fn run(mut options: DrillOptions) -> Result<(), String> {
    if options.faults.is_empty() {
        options.faults = default_faults(options.instances);
    }
    if options.rounds == 0 || options.replicas == 0 || options.instances == 0 {
        return Err("a drill needs at least one round, one replica and one instance".into());
    }
    if options.instances == 1 {
        if let Some(f) = options.faults.iter().find(|f| f.hits_instances()) {
            return Err(format!(
                "the fault {} needs several pgherd instances (--instances 2 or more)",
                f.name()
            ));
        }
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
        true => Some(Network::create("pgherd-drill", options.replicas + 1)?),
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
    let rt = crate::runtime(2)?;
    let setup = PgherdSetup {
        nodes: options.replicas + 1,
        users: &[&user],
        pool_size: 20,
        workers: 0,
        database_keys: "",
        ha: true,
        admin: false,
        baseline: None,
        instance: None,
    };
    let (single, mut instances) = match options.instances {
        1 => (Some(start_pgherd(&cluster, &setup)?), None),
        n => {
            eprintln!("starting etcd and {n} pgherd instances");
            let instances = Instances::start(&rt, &cluster, &setup, n, options.lease_ttl_s)?;
            (None, Some(instances))
        }
    };
    let front = Front {
        ports: match (&single, &instances) {
            (Some(p), _) => vec![p.port],
            (None, Some(i)) => i.ports(),
            (None, None) => Vec::new(),
        },
        names: match &instances {
            Some(i) => i.names(),
            None => vec!["pgherd".to_owned()],
        },
        superuser_password: cluster.superuser_password.clone(),
        user,
    };
    let result = rt.block_on(drill(
        &options,
        &cluster,
        network.as_ref(),
        &front,
        instances.as_mut(),
    ));
    if result.is_err() {
        match (&single, &instances) {
            (Some(p), _) => eprintln!("pgherd's log: {}", p.log.display()),
            (None, Some(i)) => eprintln!("pgherd's logs: {}", i.logs()),
            (None, None) => {}
        }
    }
    result
}

async fn drill(
    options: &DrillOptions,
    cluster: &BenchCluster,
    network: Option<&Network>,
    front: &Front,
    mut instances: Option<&mut Instances>,
) -> Result<(), String> {
    front.agreed_leader().await?;
    let setup = connect(&front.app_urls()[0]).await?;
    setup
        .batch_execute("CREATE TABLE drill_writes (id bigint PRIMARY KEY, writer int)")
        .await
        .map_err(|e| format!("creating the table: {e}"))?;

    let stop = Arc::new(AtomicBool::new(false));
    let log = Arc::new(Mutex::new(Log::default()));
    let urls = Arc::new(front.app_urls());
    // A client of several instances gives up on a hung one, as one with a socket timeout does.
    let patience = match options.instances {
        1 => Patience::HungAfter(HUNG_AFTER),
        _ => Patience::GivesUpAfter(QUERY_TIMEOUT),
    };
    let writers: Vec<_> = (0..options.writers)
        .map(|w| {
            let writer = Writer {
                number: w,
                urls: urls.clone(),
                patience,
            };
            tokio::spawn(writer.run(stop.clone(), log.clone()))
        })
        .collect();

    if options.calm_s > 0 {
        calm::calm(options, front).await?;
    }
    let mut rounds = Vec::new();
    let mut injections = Vec::new();
    let mut failure = None;
    for r in 0..options.rounds {
        let fault = options.faults[r % options.faults.len()];
        let outcome = match (&mut instances, fault.hits_instances()) {
            (Some(instances), true) => {
                instances::round(
                    cluster,
                    front,
                    instances,
                    options.writers,
                    fault,
                    &log,
                    &mut injections,
                )
                .await
            }
            _ => round(cluster, network, front, fault, &log, &mut injections).await,
        };
        match outcome {
            Ok(round) => {
                eprintln!(
                    "round {}: {} of {}: writes on {} after {}",
                    r + 1,
                    fault.name(),
                    round.hit,
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
    let (primary_port, on_primary) = stored_ids(cluster, front).await?;
    let lost: Vec<i64> = log
        .acks
        .iter()
        .map(|a| a.id)
        .filter(|id| !on_primary.contains(id))
        .collect();
    let mut violations = split_brain(&log.acks, &injections);
    violations.extend(rounds.iter().filter_map(|r| r.violation.clone()));
    report(&rounds, &log, &lost, &violations, primary_port, front);
    unanswered(&log, &lost, &injections, front);
    if let Some(f) = failure {
        return Err(f);
    }
    if !lost.is_empty() || !violations.is_empty() || !log.hung.is_empty() {
        return Err(format!(
            "{} acknowledged write(s) lost, {} split-brain sign(s), {} write(s) never answered",
            lost.len(),
            violations.len(),
            log.hung.len()
        ));
    }
    Ok(())
}

/// Where a round starts from: the primary (its port and node), the leading instance, the
/// client errors so far, and when the fault is injected (now, as it returns).
struct Start {
    old_port: u16,
    old: LocalNode,
    leader: usize,
    errors_before: usize,
    injected: Instant,
}

/// Waits until the cluster is whole (the primary streams to every replica, the instances agree
/// on a leader) and writes flow, so the fault and the RTO have a start; records the fault's
/// time in `injections`.
async fn start_round(
    cluster: &BenchCluster,
    front: &Front,
    log: &Mutex<Log>,
    injections: &mut Vec<Injection>,
) -> Result<Start, String> {
    // Through pgherd as the superuser: pg_stat_replication shows its state only to those.
    let c = front.superuser("postgres").await?;
    let names: Vec<&str> = cluster
        .cluster
        .nodes
        .iter()
        .map(|n| n.name.as_str())
        .collect();
    wait_full_strength(&c, &names).await?;
    let leader = front.agreed_leader().await?;
    let ready = Instant::now();
    poll(Duration::from_millis(10), async || {
        let log = log.lock().map_err(|_| "poisoned")?;
        Ok(log.acks.last().filter(|a| a.at > ready).map(|_| ()))
    })
    .await?
    .ok_or("no write was acknowledged with the cluster whole")?;
    let old_port = value(&c, "/* pgherd:primary */ SELECT current_setting('port')")
        .await?
        .parse()
        .map_err(|_| "unreadable port")?;
    let errors_before = log.lock().map_err(|_| "poisoned")?.errors;
    let injected = Instant::now();
    injections.push(Injection::next_round(injections, injected));
    Ok(Start {
        old_port,
        old: node_by_port(cluster, old_port)?,
        leader,
        errors_before,
        injected,
    })
}

/// One fault on the current primary, and the wait until writes go on and every node streams
/// again.
async fn round(
    cluster: &BenchCluster,
    network: Option<&Network>,
    front: &Front,
    fault: Fault,
    log: &Mutex<Log>,
    injections: &mut Vec<Injection>,
) -> Result<Round, String> {
    let start = start_round(cluster, front, log, injections).await?;
    if fault == Fault::Cascade {
        return cascade::round(cluster, log, &start, injections).await;
    }
    let injected = inject(cluster, network, front, fault, log, &start).await?;
    let resumed = writes_elsewhere(log, &start).await;
    // Undone whatever the wait found: a node left stopped or cut off would hold its clients'
    // requests, and the drill with them, forever.
    let undone = undo(network, fault, &start.old, &injected).await;
    let (first_after, last_before, errors) = resumed?;
    undone?;
    Ok(Round {
        fault,
        hit: start.old.name.clone(),
        new_primary: node_by_port(cluster, first_after.port)?.name,
        leader_after: None,
        rto: last_before.map(|t| first_after.at.duration_since(t)),
        errors,
        violation: injected.violation,
    })
}

/// What injecting a fault left to undo, and what it found wrong.
#[derive(Default)]
struct Injected {
    /// Processes stopped with SIGSTOP.
    stopped_pids: Vec<u32>,
    /// The postmaster killed.
    killed: Option<u32>,
    violation: Option<String>,
}

async fn inject(
    cluster: &BenchCluster,
    network: Option<&Network>,
    front: &Front,
    fault: Fault,
    log: &Mutex<Log>,
    start: &Start,
) -> Result<Injected, String> {
    let old = &start.old;
    let mut injected = Injected::default();
    match fault {
        Fault::Kill => {
            let pid = postmaster_pid(old)?;
            signal(pid, libc::SIGKILL)?;
            injected.killed = Some(pid);
        }
        Fault::Partition => set_link(network, old, false)?,
        Fault::Double => {
            let standby = cluster
                .cluster
                .nodes
                .iter()
                .find(|n| n.port != start.old_port)
                .cloned()
                .ok_or("a double failure needs a replica")?;
            let standby_pid = postmaster_pid(&standby)?;
            let pid = postmaster_pid(old)?;
            signal(pid, libc::SIGKILL)?;
            injected.killed = Some(pid);
            signal(standby_pid, libc::SIGKILL)?;
            tokio::time::sleep(DOUBLE_OUTAGE).await;
            if let Some(Ack { port, .. }) =
                first_ack_elsewhere(log, start.injected, start.old_port)?
            {
                injected.violation = Some(format!(
                    "double failure: the node on port {port} took writes while synchronous standby {} was down",
                    standby.name
                ));
            }
            wait_gone(&standby, standby_pid).await;
            blocking_start(&standby).await?;
        }
        Fault::Immediate => blocking_stop(old, StopMode::Immediate).await?,
        Fault::Sigstop => {
            for pid in node_pids(old)? {
                signal(pid, libc::SIGSTOP)?;
                injected.stopped_pids.push(pid);
            }
        }
        Fault::Switchover => {
            let admin = connect(&front.superuser_url(start.leader, "pgherd")).await?;
            within(HUNG_AFTER, "SWITCHOVER", admin.simple_query("SWITCHOVER"))
                .await?
                .map_err(|e| format!("SWITCHOVER: {}", pg_error(&e)))?;
        }
        _ => return Err(format!("{} is not a fault of PostgreSQL", fault.name())),
    }
    Ok(injected)
}

/// Waits for the first write another node acknowledges after the fault: that write, the last
/// one acknowledged before the fault, and the client errors since the round started.
async fn writes_elsewhere(
    log: &Mutex<Log>,
    start: &Start,
) -> Result<(Ack, Option<Instant>, usize), String> {
    writes_resumed(log, start, start.injected, |a| a.port != start.old_port)
        .await?
        .ok_or_else(|| {
            format!(
                "no write was acknowledged by another node within {} s",
                RECOVERY_TIMEOUT.as_secs()
            )
        })
}

/// Waits for the first write acknowledged after `since` that `resumes` accepts: that write,
/// the last one acknowledged before `since`, and the client errors since the round started;
/// `None` after [`RECOVERY_TIMEOUT`].
async fn writes_resumed(
    log: &Mutex<Log>,
    start: &Start,
    since: Instant,
    resumes: impl Fn(&Ack) -> bool,
) -> Result<Option<(Ack, Option<Instant>, usize)>, String> {
    let first_after = poll(Duration::from_millis(20), async || {
        let log = log.lock().map_err(|_| "writer log poisoned")?;
        Ok(log
            .acks
            .iter()
            .find(|a| a.at > since && resumes(a))
            .copied())
    })
    .await?;
    let Some(first_after) = first_after else {
        return Ok(None);
    };
    let log = log.lock().map_err(|_| "poisoned")?;
    let last_before = log.acks.iter().filter(|a| a.at < since).map(|a| a.at).max();
    Ok(Some((
        first_after,
        last_before,
        log.errors - start.errors_before,
    )))
}

/// Brings the replaced primary back, as it was before the fault; pgherd fences it and rejoins
/// it as a standby.
async fn undo(
    network: Option<&Network>,
    fault: Fault,
    old: &LocalNode,
    injected: &Injected,
) -> Result<(), String> {
    if let Some(pid) = injected.killed {
        wait_gone(old, pid).await;
    }
    match fault {
        Fault::Kill | Fault::Immediate | Fault::Double => blocking_start(old).await,
        Fault::Sigstop => {
            for pid in &injected.stopped_pids {
                let _ = signal(*pid, libc::SIGCONT);
            }
            Ok(())
        }
        Fault::Partition => set_link(network, old, true),
        _ => Ok(()),
    }
}

/// Waits until the primary streams to every replica (the previous round's old primary has
/// rejoined) and has a synchronous standby among them, so each round starts from a whole
/// cluster. Streaming alone is not whole: until pgherd's next check names a rejoined standby
/// in the set, a primary that took over with every other node fenced acknowledges commits
/// alone, and failing it then leaves no survivor sure to hold them (pgherd rightly refuses to
/// promote). A drill that hung here on 2026-12-02 was a SIGSTOP round that began in that
/// window. Only the nodes' own standbys count (each streams under its node name): a node being
/// rebuilt by pg_basebackup streams WAL too, under another name, and a round that began then
/// (2026-12-07, after a cascade round) cut off a primary whose only other synchronous
/// candidate was not a standby yet.
async fn wait_full_strength(c: &Client, node_names: &[&str]) -> Result<(), String> {
    let replicas = node_names.len() - 1;
    let names = node_names
        .iter()
        .map(|n| format!("'{}'", n.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(", ");
    let mut seen = String::new();
    let whole = poll(Duration::from_millis(100), async || {
        // "<streaming>/<streaming in the synchronous set>"
        seen = value(
            c,
            &format!(
                "/* pgherd:primary */ SELECT count(*) FILTER (WHERE state = 'streaming') || '/' || \
                 count(*) FILTER (WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum')) \
                 FROM pg_stat_replication WHERE application_name IN ({names})"
            ),
        )
        .await
        .unwrap_or_default();
        let whole = seen
            .split_once('/')
            .is_some_and(|(streaming, synchronous)| {
                streaming == replicas.to_string() && synchronous != "0"
            });
        Ok(whole.then_some(()))
    })
    .await?;
    whole.ok_or_else(|| {
        format!(
            "after {} s the primary's replicas streaming / synchronous: {seen} (of {replicas})",
            RECOVERY_TIMEOUT.as_secs()
        )
    })
}

/// The final primary's port and the ids it holds.
async fn stored_ids(cluster: &BenchCluster, front: &Front) -> Result<(u16, HashSet<i64>), String> {
    let c = front.superuser("drill").await?;
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
    let sql = "SELECT id FROM drill_writes";
    let rows = within(HUNG_AFTER, sql, direct.query(sql, &[]))
        .await?
        .map_err(|e| pg_error(&e))?;
    Ok((port, rows.iter().map(|r| r.get::<_, i64>(0)).collect()))
}

/// As [`connect`], giving up after `limit` (a hung instance accepts and never answers).
pub(crate) async fn connect_within(url: &str, limit: Duration) -> Result<Client, String> {
    within(limit, "connecting", connect(url)).await?
}

/// `future`, or an error naming `what` once `limit` passed without its answer: no wait of the
/// drill may outlast a hang it is there to find.
async fn within<T>(
    limit: Duration,
    what: &str,
    future: impl std::future::Future<Output = T>,
) -> Result<T, String> {
    tokio::time::timeout(limit, future)
        .await
        .map_err(|_| format!("{what}: no answer within {} ms", limit.as_millis()))
}

async fn connect(url: &str) -> Result<Client, String> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(|e| pg_error(&e))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// `sql` in the simple protocol, bounded by [`HUNG_AFTER`].
async fn simple_rows(c: &Client, sql: &str) -> Result<Vec<SimpleQueryMessage>, String> {
    within(HUNG_AFTER, sql, c.simple_query(sql))
        .await?
        .map_err(|e| pg_error(&e))
}

async fn value(c: &Client, sql: &str) -> Result<String, String> {
    let rows = within(HUNG_AFTER, sql, client_rows(c, sql))
        .await?
        .map_err(|e| pg_error(&e))?;
    Ok(first(&rows).unwrap_or_default())
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

/// Takes the node's link down or back up, in a drill that made its network.
fn set_link(network: Option<&Network>, node: &LocalNode, up: bool) -> Result<(), String> {
    network
        .ok_or("a partition needs the nodes in network namespaces")?
        .set_link(node, up)
}
