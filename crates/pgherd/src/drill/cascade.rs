//! The cascade fault: the primary killed, then its replacement a second after it took its
//! first write, while the first is still on its way back (restarted, then fenced and rejoined
//! by pgherd). The second primary restarts after [`DOUBLE_OUTAGE`]. Whatever pgherd does in
//! between (promote the remaining standby, wait for the second primary to come back, rejoin
//! the first to it), no acknowledged write may be lost and writes may move once per kill.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pgherd_cluster::LocalNode;

use super::process::{blocking_start, postmaster_pid, signal, wait_gone};
use super::{
    first_ack_elsewhere, node_by_port, poll, writes_resumed, Fault, Injection, Log, Round, Start,
    DOUBLE_OUTAGE, RECOVERY_TIMEOUT,
};
use crate::bench::targets::BenchCluster;

/// How long after the replacement's first acknowledged write it is killed too.
const SECOND_KILL_AFTER: Duration = Duration::from_secs(1);

pub async fn round(
    cluster: &BenchCluster,
    log: &Mutex<Log>,
    start: &Start,
    injections: &mut Vec<Injection>,
) -> Result<Round, String> {
    let old = &start.old;
    let old_pid = postmaster_pid(old)?;
    signal(old_pid, libc::SIGKILL)?;
    let first = poll(Duration::from_millis(20), async || {
        first_ack_elsewhere(log, start.injected, start.old_port)
    })
    .await;
    // The old primary comes back whatever happens next, as the kill fault's undo brings it.
    let old_back = {
        let old = old.clone();
        tokio::spawn(async move {
            wait_gone(&old, old_pid).await;
            blocking_start(&old).await
        })
    };
    let second = match first {
        Ok(Some(first)) => kill_replacement(cluster, log, start, &first, injections).await,
        Ok(None) => Err(format!(
            "no write was acknowledged by another node within {} s of the first kill",
            RECOVERY_TIMEOUT.as_secs()
        )),
        Err(e) => Err(e),
    };
    let old_started = old_back
        .await
        .map_err(|e| format!("restarting {}: {e}", old.name))?;
    let (second, resumed) = second?;
    old_started?;
    let (first_after, last_before, errors) = resumed;
    Ok(Round {
        fault: Fault::Cascade,
        hit: format!("{}+{}", old.name, second.name),
        new_primary: node_by_port(cluster, first_after.port)?.name,
        leader_after: None,
        rto: last_before.map(|t| first_after.at.duration_since(t)),
        errors,
        violation: None,
    })
}

/// Kills the node that took over (`first` is its first acknowledged write) a second after it
/// took over, restarts it after [`DOUBLE_OUTAGE`], and waits for writes to go on: on another
/// node after the kill, or on this one once it is back. Returns the node and what the wait
/// found (as `writes_resumed`).
async fn kill_replacement(
    cluster: &BenchCluster,
    log: &Mutex<Log>,
    start: &Start,
    first: &super::Ack,
    injections: &mut Vec<Injection>,
) -> Result<(LocalNode, (super::Ack, Option<Instant>, usize)), String> {
    let replacement = node_by_port(cluster, first.port)?;
    tokio::time::sleep_until((first.at + SECOND_KILL_AFTER).into()).await;
    let pid = postmaster_pid(&replacement)?;
    signal(pid, libc::SIGKILL)?;
    let killed_at = Instant::now();
    injections.push(Injection::same_round(injections, killed_at));
    tokio::time::sleep(DOUBLE_OUTAGE).await;
    wait_gone(&replacement, pid).await;
    let back_at = Instant::now();
    blocking_start(&replacement).await?;
    let resumed = writes_resumed(log, start, killed_at, |a| {
        a.port != replacement.port || a.at > back_at
    })
    .await?
    .ok_or_else(|| {
        format!(
            "no write was acknowledged within {} s of {}'s restart",
            RECOVERY_TIMEOUT.as_secs(),
            replacement.name
        )
    })?;
    Ok((replacement, resumed))
}
