//! `pgherd drill` end to end: every fault it knows, one round each, on its own local cluster;
//! it must report no lost acknowledged write, no sign of two primaries and no promotion while
//! a double failure left no survivor sure to hold every acknowledged commit, and every round
//! must end with writes on another node.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::BIN;

/// The longest a drill of these tests may take. A round waits at most a minute for writes and a
/// minute for the cluster to be whole again, and the drill bounds its every wait, so it ends
/// well within this; a drill still running then is hung, and is killed so the suite goes on.
const DRILL_LIMIT: Duration = Duration::from_secs(15 * 60);

/// Runs `pgherd drill` with `faults`, one round each, and more `args`; it must succeed with no
/// acknowledged write lost, no sign of two primaries, no write left unanswered, and a round of
/// every fault. Returns what it printed. Its progress (stderr) shows as it runs, so a CI log
/// tells how far a drill got.
fn drill(faults: &[&str], args: &[&str]) -> String {
    // A file, not a pipe: a process the drill started and left behind could hold a pipe open,
    // and reading to its end would wait for that process too.
    let stdout_path = std::env::temp_dir().join(format!(
        "pgherd-drill-{}-{}.out",
        std::process::id(),
        faults.join("-")
    ));
    let stdout_file = std::fs::File::create(&stdout_path).expect("the drill's output file");
    let mut child = std::process::Command::new(BIN)
        .args(["drill", "--rounds", &faults.len().to_string()])
        .args(["--faults", &faults.join(",")])
        .args(args)
        .stdout(stdout_file)
        .stderr(Stdio::inherit())
        .spawn()
        .expect("run pgherd drill");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for pgherd drill") {
            break Some(status);
        }
        if started.elapsed() > DRILL_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
    let _ = std::fs::remove_file(&stdout_path);
    let status = status.unwrap_or_else(|| {
        panic!(
            "the drill was still running after {} s, killed:\n{stdout}",
            DRILL_LIMIT.as_secs()
        )
    });
    assert!(status.success(), "drill failed:\n{stdout}");
    assert!(stdout.contains(", lost: 0,"), "{stdout}");
    assert!(stdout.contains("split-brain signs: 0"), "{stdout}");
    assert!(stdout.contains("never answered: 0,"), "{stdout}");
    for fault in faults {
        assert!(
            stdout.lines().any(|l| l.contains(&format!(" {fault} "))),
            "no {fault} round in:\n{stdout}"
        );
    }
    eprintln!("{stdout}");
    stdout
}

#[test]
fn every_fault_keeps_every_acknowledged_write() {
    let faults = [
        "kill",
        "immediate",
        "sigstop",
        "switchover",
        "double",
        "cascade",
        "partition",
    ];
    let stdout = drill(&faults, &["--writers", "3", "--calm-s", "3"]);
    // Not asserted to be free of failed checks: a shared CI machine may stall one.
    assert!(stdout.contains("calm phase: 3 s,"), "{stdout}");
}

/// `pgherd drill --instances 2`: two pgherd instances agreeing through a local etcd, the
/// writers spread over both as a multi-host connection string does. The leader instance
/// killed (alone and with the primary), stopped, cut off from etcd, and etcd down: no
/// acknowledged write lost, no sign of two primaries, and no failover unless the primary
/// failed (the drill itself fails a round whose writes moved to another node then, or where
/// no other instance took the lease). etcd down for longer than the lease and the failsafe
/// holds writes until it is back, without a failover.
#[test]
fn instance_faults_keep_every_acknowledged_write() {
    let faults = [
        "instance-kill",
        "etcd-cut",
        "kill",
        "etcd-down",
        "instance-kill-primary",
        "switchover",
        "instance-stop",
        "etcd-down-long",
    ];
    let stdout = drill(&faults, &["--instances", "2", "--writers", "4"]);
    // Writes went through both instances.
    let through = stdout
        .lines()
        .find(|l| l.starts_with("acknowledged through:"))
        .unwrap_or_else(|| panic!("no per-instance figures in:\n{stdout}"));
    for instance in ["pgherd-1", "pgherd-2"] {
        let count: u64 = through
            .split(", ")
            .find_map(|part| {
                part.trim_start_matches("acknowledged through: ")
                    .strip_prefix(&format!("{instance} "))
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no figure for {instance} in {through}"));
        assert!(count > 0, "{through}");
    }
}
