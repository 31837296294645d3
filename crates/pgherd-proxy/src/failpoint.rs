//! Test hooks for faults at exact points: `PGHERD_FAILPOINTS=name[@ms][,name...]` makes pgherd
//! stop when it reaches one of those points (logging it), for good or for `ms` milliseconds,
//! so that a test can kill pgherd there, or a server while pgherd waits. Unset in production,
//! where every point costs one lookup in an empty list.

use std::sync::OnceLock;
use std::time::Duration;

/// Between the prepares of a two-phase commit and the decider's commit.
pub const AFTER_PREPARE: &str = "2pc-after-prepare";
/// After the decider committed, before the other shards commit their prepared transactions.
pub const AFTER_DECISION: &str = "2pc-after-decision";

/// A session has a request in hand and has not taken a server for it yet.
pub const BEFORE_ATTACH: &str = "before-attach";

/// An armed point: its name and how long it pauses (`None`: for good).
type Armed = (String, Option<Duration>);

fn armed() -> &'static [Armed] {
    static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var("PGHERD_FAILPOINTS")
            .map(|v| parse(&v))
            .unwrap_or_default()
    })
}

fn parse(list: &str) -> Vec<Armed> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|entry| match entry.split_once('@') {
            Some((name, ms)) => (
                name.to_owned(),
                // A pause that does not read as milliseconds pauses for good, as a bare name.
                ms.parse().ok().map(Duration::from_millis),
            ),
            None => (entry.to_owned(), None),
        })
        .collect()
}

/// Whether `name` is armed: a point on a hot path asks first, so its pause's state is only
/// allocated where a test armed it.
pub fn is_armed(name: &str) -> bool {
    armed().iter().any(|(armed, _)| armed == name)
}

/// Pauses here if `name` is armed: for its time, or for good.
pub async fn pause_if_armed(name: &str) {
    let Some((_, pause)) = armed().iter().find(|(armed, _)| armed == name) else {
        return;
    };
    match pause {
        Some(pause) => {
            tracing::warn!(
                failpoint = name,
                pause_ms = pause.as_millis() as u64,
                "failpoint reached: pausing here for a while"
            );
            tokio::time::sleep(*pause).await;
        }
        None => {
            tracing::warn!(failpoint = name, "failpoint reached: pausing here for good");
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn points_are_armed_for_good_or_for_a_while() {
        assert_eq!(
            parse(" a, b@1500 ,,c@soon"),
            vec![
                ("a".to_owned(), None),
                ("b".to_owned(), Some(Duration::from_millis(1500))),
                ("c".to_owned(), None),
            ]
        );
    }
}
