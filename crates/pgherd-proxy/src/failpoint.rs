//! Test hooks for faults at exact points: `PGHERD_FAILPOINTS=name[,name...]` makes pgherd stop
//! for good when it reaches one of those points (logging it), so that a test can kill it
//! there. Unset in production, where every point costs one lookup in an empty list.

use std::sync::OnceLock;

/// Between the prepares of a two-phase commit and the decider's commit.
pub const AFTER_PREPARE: &str = "2pc-after-prepare";
/// After the decider committed, before the other shards commit their prepared transactions.
pub const AFTER_DECISION: &str = "2pc-after-decision";

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var("PGHERD_FAILPOINTS")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Never returns if `name` is armed.
pub async fn pause_if_armed(name: &str) {
    if armed().iter().any(|a| a == name) {
        tracing::warn!(failpoint = name, "failpoint reached: pausing here for good");
        std::future::pending::<()>().await;
    }
}
