//! `pgherd drill --instances N`: N pgherd instances in front of the cluster, agreeing through a
//! local etcd, each reaching etcd through a [`Relay`] of the drill's so that one can be cut off
//! from etcd alone; and the rounds whose fault hits an instance or etcd rather than PostgreSQL.
//!
//! What such a round expects: clients of the instance that failed move to another one and
//! write on (the RTO is the longest any one writer went without an acknowledgement); another
//! instance takes the lease when the leader is gone, stopped or cut off; and nobody fails over
//! unless the primary failed too (a write acknowledged by another node is a violation).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::runtime::Runtime;

use super::process::{blocking_start, postmaster_pid, signal, wait_gone};
use super::relay::Relay;
use super::{
    first_ack_elsewhere, node_by_port, poll, start_round, Fault, Front, Log, Round, Start,
    RECOVERY_TIMEOUT,
};
use crate::bench::targets::{start_pgherd, BenchCluster, PgherdSetup, ProxyProcess};
use crate::local::instances as local;

/// How long a stopped instance stays stopped before SIGCONT, and then still cut off.
const WAKE_CUT_OFF: Duration = Duration::from_secs(2);

pub struct Instances {
    processes: Vec<ProxyProcess>,
    relays: Vec<Relay>,
    etcd_dir: PathBuf,
    lease_ttl_s: u64,
}

impl Instances {
    /// A local etcd and `count` pgherd instances; instance k reaches etcd through relay k.
    pub fn start(
        rt: &Runtime,
        cluster: &BenchCluster,
        setup: &PgherdSetup,
        count: usize,
        lease_ttl_s: u64,
    ) -> Result<Instances, String> {
        let etcd_dir = cluster.dir.join("etcd-drill");
        std::fs::create_dir_all(&etcd_dir).map_err(|e| format!("{}: {e}", etcd_dir.display()))?;
        let etcd_port = local::create_etcd(&etcd_dir)?;
        local::start_etcd(&etcd_dir)?;
        let mut instances = Instances {
            processes: Vec::new(),
            relays: Vec::new(),
            etcd_dir,
            lease_ttl_s,
        };
        for k in 1..=count {
            let relay = rt.block_on(Relay::start(etcd_port))?;
            let name = local::instance_name(k);
            let dcs = local::dcs_settings(&name, relay.port, lease_ttl_s, 500);
            let setup = PgherdSetup {
                instance: Some((&name, &dcs)),
                ..*setup
            };
            instances.processes.push(start_pgherd(cluster, &setup)?);
            instances.relays.push(relay);
        }
        Ok(instances)
    }

    pub fn ports(&self) -> Vec<u16> {
        self.processes.iter().map(|p| p.port).collect()
    }

    pub fn names(&self) -> Vec<String> {
        self.processes.iter().map(|p| p.name.clone()).collect()
    }

    /// Where their logs are, for a failed drill.
    pub fn logs(&self) -> String {
        let logs: Vec<String> = self
            .processes
            .iter()
            .map(|p| p.log.display().to_string())
            .collect();
        format!(
            "{}; etcd's: {}",
            logs.join(", "),
            self.etcd_dir.join("etcd.log").display()
        )
    }

    /// Long enough for a lease held by an instance that stopped renewing it to expire and be
    /// taken by another.
    fn lease_turnover(&self) -> Duration {
        Duration::from_secs(2 * self.lease_ttl_s + 2)
    }

    fn kill_etcd(&self) -> Result<(), String> {
        let pid = local::etcd_pid(&self.etcd_dir).ok_or("etcd does not run")?;
        signal(pid as u32, libc::SIGKILL)?;
        reap(pid as u32);
        Ok(())
    }
}

impl Drop for Instances {
    fn drop(&mut self) {
        // The instances first, so none of them logs etcd's going as an outage.
        self.processes.clear();
        let _ = local::stop_etcd(&self.etcd_dir);
    }
}

/// Waits for a killed child of the drill to go, so its pid is not taken for a live process.
fn reap(pid: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        // SAFETY: waitpid on one pid this process started; WNOHANG, so it never blocks.
        let reaped =
            unsafe { libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), libc::WNOHANG) };
        if reaped != 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One fault on the leading instance or on etcd, and the wait until every writer writes again
/// and the fault is undone.
pub async fn round(
    cluster: &BenchCluster,
    front: &Front,
    instances: &mut Instances,
    writers: usize,
    fault: Fault,
    log: &Mutex<Log>,
    injections: &mut Vec<super::Injection>,
) -> Result<Round, String> {
    let Start {
        old_port,
        old,
        leader,
        errors_before,
        injected,
    } = start_round(cluster, front, log, injections).await?;
    let leader_name = front.names[leader].clone();
    let mut killed_postmaster = None;
    let hit = match fault {
        Fault::InstanceKill => {
            signal(instances.processes[leader].pid(), libc::SIGKILL)?;
            format!("{leader_name} (leader)")
        }
        Fault::InstanceKillPrimary => {
            let pid = postmaster_pid(&old)?;
            signal(pid, libc::SIGKILL)?;
            signal(instances.processes[leader].pid(), libc::SIGKILL)?;
            killed_postmaster = Some(pid);
            format!("{leader_name} (leader)+{}", old.name)
        }
        Fault::InstanceStop => {
            instances.relays[leader].set_cut(true);
            signal(instances.processes[leader].pid(), libc::SIGSTOP)?;
            format!("{leader_name} (leader)")
        }
        Fault::EtcdCut => {
            instances.relays[leader].set_cut(true);
            format!("{leader_name} (leader)")
        }
        Fault::EtcdDown | Fault::EtcdDownLong => {
            instances.kill_etcd()?;
            "etcd".to_owned()
        }
        _ => return Err(format!("{} is not a fault of pgherd or etcd", fault.name())),
    };

    // How long the fault lasts: a killed instance or primary until writes go on without it;
    // the others until the lease can have changed hands (etcd down briefly: half the lease).
    let lasts = match fault {
        Fault::InstanceStop | Fault::EtcdCut | Fault::EtcdDownLong => instances.lease_turnover(),
        Fault::EtcdDown => Duration::from_millis(instances.lease_ttl_s * 500),
        _ => Duration::ZERO,
    };
    if fault == Fault::InstanceKillPrimary {
        wait_writes(log, injected, writers, Some(old_port)).await?;
    }
    tokio::time::sleep_until((injected + lasts).into()).await;
    let leader_after = match fault {
        Fault::EtcdDown | Fault::EtcdDownLong => None,
        _ => Some(new_leader(front, leader).await?),
    };

    let restored = Instant::now();
    match fault {
        Fault::InstanceKill | Fault::InstanceKillPrimary => {
            if let Some(pid) = killed_postmaster {
                wait_gone(&old, pid).await;
                blocking_start(&old).await?;
            }
            tokio::task::block_in_place(|| instances.processes[leader].restart())?;
        }
        Fault::InstanceStop => {
            let _ = signal(instances.processes[leader].pid(), libc::SIGCONT);
            // It wakes believing it leads, its lease long gone and etcd out of reach: it must
            // not act on that belief.
            tokio::time::sleep(WAKE_CUT_OFF).await;
            instances.relays[leader].set_cut(false);
        }
        Fault::EtcdCut => instances.relays[leader].set_cut(false),
        Fault::EtcdDown | Fault::EtcdDownLong => {
            let dir = instances.etcd_dir.clone();
            tokio::task::spawn_blocking(move || local::start_etcd(&dir))
                .await
                .map_err(|e| e.to_string())??;
        }
        _ => {}
    }
    // Every writer writes again once the fault is undone (through another instance if its
    // own failed); the RTO is the longest any of them waited, from the fault on.
    wait_writes(log, restored, writers, None).await?;
    let rto = match fault {
        Fault::InstanceKillPrimary => primary_rto(log, injected, old_port)?,
        _ => {
            let wait = longest_wait(log, injected)?;
            if let Some((waited, writer, began)) = wait {
                eprintln!(
                    "  longest wait: writer {writer}, {} ms from {} ms after the fault",
                    waited.as_millis(),
                    began.as_millis()
                );
            }
            wait.map(|(waited, _, _)| waited)
        }
    };
    let (new_port, errors) = {
        let log = log.lock().map_err(|_| "poisoned")?;
        let last = log.acks.last().map_or(old_port, |a| a.port);
        (last, log.errors - errors_before)
    };
    let violation = match fault {
        Fault::InstanceKillPrimary => None,
        _ => first_ack_elsewhere(log, injected, old_port)?.map(|ack| {
            format!(
                "{}: writes moved to port {} though the primary on port {old_port} did not fail",
                fault.name(),
                ack.port
            )
        }),
    };
    Ok(Round {
        fault,
        hit,
        new_primary: node_by_port(cluster, new_port)?.name,
        leader_after,
        rto,
        errors,
        violation,
    })
}

/// Waits until every writer has written since `since` (and, with `elsewhere_than`, a node
/// other than the one on that port has taken a write).
async fn wait_writes(
    log: &Mutex<Log>,
    since: Instant,
    writers: usize,
    elsewhere_than: Option<u16>,
) -> Result<(), String> {
    poll(Duration::from_millis(20), async || {
        let moved_on = match elsewhere_than {
            Some(port) => first_ack_elsewhere(log, since, port)?.is_some(),
            None => true,
        };
        Ok((moved_on && every_writer_acked_after(log, since, writers)?).then_some(()))
    })
    .await?
    .ok_or_else(|| {
        format!(
            "not every writer wrote again within {} s",
            RECOVERY_TIMEOUT.as_secs()
        )
    })
}

fn every_writer_acked_after(
    log: &Mutex<Log>,
    since: Instant,
    writers: usize,
) -> Result<bool, String> {
    let log = log.lock().map_err(|_| "poisoned")?;
    let mut acked = vec![false; writers];
    for ack in log.acks.iter().rev().take_while(|a| a.at > since) {
        if let Some(seen) = acked.get_mut(ack.writer) {
            *seen = true;
        }
    }
    Ok(acked.iter().all(|&a| a))
}

/// The longest any one writer went without an acknowledgement from the fault on: between
/// its last write before the fault and each later one, up to now. Also which writer, and when
/// its wait began (from the fault).
fn longest_wait(
    log: &Mutex<Log>,
    injected: Instant,
) -> Result<Option<(Duration, usize, Duration)>, String> {
    let log = log.lock().map_err(|_| "poisoned")?;
    let writers = log.acks.iter().map(|a| a.writer).max().map_or(0, |w| w + 1);
    Ok((0..writers)
        .filter_map(|w| {
            let mine: Vec<Instant> = log
                .acks
                .iter()
                .filter(|a| a.writer == w)
                .map(|a| a.at)
                .collect();
            let start = mine.iter().rposition(|&at| at <= injected)?;
            mine[start..]
                .windows(2)
                .map(|pair| {
                    let began = pair[0].saturating_duration_since(injected);
                    (pair[1].duration_since(pair[0]), w, began)
                })
                .max()
        })
        .max())
}

/// As for a fault of PostgreSQL alone: from the last write acknowledged before the fault to
/// the first one a new primary acknowledged.
fn primary_rto(
    log: &Mutex<Log>,
    injected: Instant,
    old_port: u16,
) -> Result<Option<Duration>, String> {
    let first_after = first_ack_elsewhere(log, injected, old_port)?;
    let log = log.lock().map_err(|_| "poisoned")?;
    let last_before = log
        .acks
        .iter()
        .filter(|a| a.at < injected)
        .map(|a| a.at)
        .max();
    Ok(first_after
        .zip(last_before)
        .map(|(a, b)| a.at.duration_since(b)))
}

/// The instance another instance than the old leader names as leading (itself or a third).
async fn new_leader(front: &Front, old_leader: usize) -> Result<String, String> {
    poll(Duration::from_millis(100), async || {
        for i in (0..front.ports.len()).filter(|&i| i != old_leader) {
            if let Some(seen) = front.seen_by(i).await {
                let leader = front.names.iter().position(|n| *n == seen.leader);
                if leader.is_some_and(|l| l != old_leader) {
                    return Ok(Some(seen.leader));
                }
            }
        }
        Ok(None)
    })
    .await?
    .ok_or_else(|| {
        format!(
            "no other instance took the lease within {} s",
            RECOVERY_TIMEOUT.as_secs()
        )
    })
}
