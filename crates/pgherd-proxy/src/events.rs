//! Cluster events (failover decisions and what was done about them), kept for the admin
//! console's `SHOW EVENTS` and handed to an optional notification command.

use std::collections::VecDeque;
use std::time::SystemTime;

use parking_lot::Mutex;

/// Events kept; older ones are dropped (the log has them all).
const KEPT: usize = 1_000;

#[derive(Debug, Clone)]
pub struct Event {
    pub at: SystemTime,
    /// One word: `elected`, `suspect`, `guarded`, `promoting`, `promoted`, `fenced`, ...
    pub kind: &'static str,
    /// The node it concerns, if one.
    pub node: String,
    /// The decision's sentence or what happened.
    pub detail: String,
}

#[derive(Default)]
pub struct Events {
    kept: Mutex<VecDeque<Event>>,
    /// Events of each kind since start (the kept list is bounded; metrics count everything).
    counts: Mutex<std::collections::BTreeMap<&'static str, u64>>,
}

impl Events {
    /// Keeps the event and, when `notify_command` is set, runs it through `sh -c` with the
    /// event in `PGHERD_EVENT`, `PGHERD_NODE`, `PGHERD_DETAIL` and `PGHERD_TIME` (seconds since
    /// the epoch). The command runs in the background; its failure is logged, never fatal.
    pub fn record(
        &self,
        kind: &'static str,
        node: &str,
        detail: &str,
        notify_command: Option<&str>,
    ) {
        let event = Event {
            at: SystemTime::now(),
            kind,
            node: node.to_owned(),
            detail: detail.to_owned(),
        };
        {
            let mut kept = self.kept.lock();
            if kept.len() == KEPT {
                kept.pop_front();
            }
            kept.push_back(event.clone());
        }
        *self.counts.lock().entry(kind).or_default() += 1;
        if let Some(command) = notify_command.filter(|c| !c.trim().is_empty()) {
            notify(command, event);
        }
    }

    pub fn list(&self) -> Vec<Event> {
        self.kept.lock().iter().cloned().collect()
    }

    /// How many events are kept.
    pub fn kept_count(&self) -> usize {
        self.kept.lock().len()
    }

    /// How many events of each kind happened since start.
    pub fn counts(&self) -> Vec<(&'static str, u64)> {
        self.counts.lock().iter().map(|(k, n)| (*k, *n)).collect()
    }
}

fn notify(command: &str, event: Event) {
    let seconds = event
        .at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    run_hook(
        "notification command",
        command,
        vec![
            ("PGHERD_EVENT", event.kind.to_owned()),
            ("PGHERD_NODE", event.node),
            ("PGHERD_DETAIL", event.detail),
            ("PGHERD_TIME", seconds.to_string()),
        ],
    );
}

/// Runs an operator's command through `sh -c` in the background with `vars` in its
/// environment; its failure is logged, never fatal.
pub fn run_hook(what: &'static str, command: &str, vars: Vec<(&'static str, String)>) {
    let mut cmd = tokio::process::Command::new("sh");
    for var in pgherd_cluster::SERVICE_MANAGER_ENV {
        cmd.env_remove(var);
    }
    cmd.arg("-c")
        .arg(command)
        .envs(vars)
        .stdin(std::process::Stdio::null())
        .kill_on_drop(false);
    let command = command.to_owned();
    tokio::spawn(async move {
        match cmd.status().await {
            Ok(status) if status.success() => {}
            Ok(status) => tracing::warn!(%command, %status, what, "hook command failed"),
            Err(e) => tracing::warn!(%command, error = %e, what, "cannot run the hook command"),
        }
    });
}
