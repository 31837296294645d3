//! Telling systemd what pgherd is doing when it runs as a `Type=notify` unit: ready once
//! clients can connect, reloading while a new config is applied, stopping while it drains, and
//! the watchdog fed while the runtime runs. Outside systemd (no `NOTIFY_SOCKET`) every call
//! does nothing.

use std::time::Duration;

use sd_notify::NotifyState;

/// Clients can connect: systemd lets units ordered after pgherd start, and `systemctl start`
/// returns.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A reload has begun; `ready` ends it. The timestamp lets systemd 253+ (`Type=notify-reload`)
/// match the reload to its request; older versions ignore it.
pub fn reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => send(&[NotifyState::Reloading, now]),
        Err(e) => tracing::warn!(error = %e, "cannot read the monotonic clock for systemd"),
    }
}

/// pgherd stops accepting clients and drains: `systemctl status` says so meanwhile.
pub fn stopping() {
    send(&[
        NotifyState::Stopping,
        NotifyState::Status("draining: waiting for clients to finish"),
    ]);
}

/// An upgrade's new process (`pid`) serves from now on: systemd follows it as the unit's main
/// process, so this one may exit.
pub fn main_pid(pid: u32) {
    send(&[NotifyState::MainPid(pid)]);
}

/// Feeds systemd's watchdog (`WatchdogSec=` in the unit) at half its period from the runtime
/// itself, so a runtime that stops making progress gets pgherd restarted.
pub fn spawn_watchdog(taking_over: bool) {
    let mut period_us = 0;
    if !sd_notify::watchdog_enabled(false, &mut period_us) {
        // An upgrade's new process inherited `WATCHDOG_PID` naming the old one: the period
        // is still the unit's, and it feeds the watchdog once it is the main process.
        period_us = std::env::var("WATCHDOG_USEC")
            .ok()
            .filter(|_| taking_over)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
    }
    if period_us == 0 {
        return;
    }
    let interval = Duration::from_micros(period_us / 2).max(Duration::from_millis(10));
    tracing::info!(period_ms = period_us / 1000, "feeding systemd's watchdog");
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(interval);
        loop {
            ticks.tick().await;
            send(&[NotifyState::Watchdog]);
        }
    });
}

fn send(states: &[NotifyState]) {
    // The environment stays set: reload and stop notify later. Programs pgherd starts do not
    // inherit it (pgherd-cluster's commands and hooks clear it).
    if let Err(e) = sd_notify::notify(false, states) {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}
