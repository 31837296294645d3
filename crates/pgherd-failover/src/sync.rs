//! The synchronous standby set pgherd keeps on the primary in `sync` and `strict` durability:
//! `synchronous_standby_names = ANY k (standbys streaming now)`, so no acknowledged commit
//! exists only on the primary while a standby streams. Pure: the proxy reports who streams and
//! applies the answer.

use crate::Durability;

/// A value of `synchronous_standby_names` pgherd manages: `ANY quorum (standbys...)`, or no
/// synchronous standby when `standbys` is empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncSet {
    /// `k`: how many of `standbys` confirm each commit.
    pub quorum: usize,
    /// Standby names (`application_name`s, which pgherd makes its node names).
    pub standbys: Vec<String>,
}

impl SyncSet {
    /// The text for `synchronous_standby_names`; names are quoted so any node name works.
    pub fn setting(&self) -> String {
        if self.standbys.is_empty() {
            return String::new();
        }
        let names: Vec<String> = self
            .standbys
            .iter()
            .map(|n| format!("\"{}\"", n.replace('"', "\"\"")))
            .collect();
        format!("ANY {} ({})", self.quorum, names.join(", "))
    }

    /// Every standby of either set, with the smaller quorum: while the primary switches from
    /// one to the other, an acknowledged commit is on `quorum` of these. If either set is
    /// empty, the primary may acknowledge commits alone: no standby is sure to hold them, and
    /// the union is empty too.
    pub fn union(&self, other: &SyncSet) -> SyncSet {
        if self.standbys.is_empty() || other.standbys.is_empty() {
            return SyncSet {
                quorum: 0,
                standbys: Vec::new(),
            };
        }
        let mut standbys = self.standbys.clone();
        for name in &other.standbys {
            if !standbys.contains(name) {
                standbys.push(name.clone());
            }
        }
        SyncSet {
            quorum: self.quorum.min(other.quorum),
            standbys,
        }
    }
}

/// What the primary's set should be. `streaming`: the standbys the primary streams to now;
/// `eligible`: the replicas pgherd may make synchronous (configured, not fenced), in
/// configuration order, which is also the order of the result; `current`: the set in force.
/// `None` in `async` durability: pgherd leaves the setting alone.
pub fn desired_sync_set(
    durability: Durability,
    sync_standbys: usize,
    streaming: &[String],
    eligible: &[String],
    current: Option<&SyncSet>,
) -> Option<SyncSet> {
    if durability == Durability::Async {
        return None;
    }
    let standbys: Vec<String> = eligible
        .iter()
        .filter(|name| streaming.contains(name))
        .cloned()
        .collect();
    if !standbys.is_empty() {
        return Some(SyncSet {
            quorum: sync_standbys.clamp(1, standbys.len()),
            standbys,
        });
    }
    Some(match durability {
        // No standby streams: acknowledge on the primary alone rather than stop writes.
        Durability::Sync | Durability::Async => SyncSet::default(),
        // Never degrade: keep waiting for the standbys there were (or all of them).
        Durability::Strict => match current.filter(|c| !c.standbys.is_empty()) {
            Some(current) => current.clone(),
            None => SyncSet {
                quorum: sync_standbys.clamp(1, eligible.len().max(1)),
                standbys: eligible.to_vec(),
            },
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn streaming_standbys_become_the_quorum_set() {
        let set = desired_sync_set(
            Durability::Sync,
            1,
            &names(&["pg3", "walreceiver", "pg2"]),
            &names(&["pg2", "pg3", "pg4"]),
            None,
        )
        .unwrap();
        assert_eq!(set.setting(), "ANY 1 (\"pg2\", \"pg3\")");
        // k never exceeds the standbys that stream.
        let set = desired_sync_set(
            Durability::Sync,
            3,
            &names(&["pg2"]),
            &names(&["pg2", "pg3"]),
            None,
        )
        .unwrap();
        assert_eq!(set.setting(), "ANY 1 (\"pg2\")");
    }

    #[test]
    fn sync_degrades_strict_keeps_waiting() {
        let current = SyncSet {
            quorum: 1,
            standbys: names(&["pg2", "pg3"]),
        };
        let eligible = names(&["pg2", "pg3"]);
        let degraded =
            desired_sync_set(Durability::Sync, 1, &[], &eligible, Some(&current)).unwrap();
        assert_eq!(degraded.setting(), "");
        let strict =
            desired_sync_set(Durability::Strict, 1, &[], &eligible, Some(&current)).unwrap();
        assert_eq!(strict, current);
        let strict_fresh = desired_sync_set(Durability::Strict, 2, &[], &eligible, None).unwrap();
        assert_eq!(strict_fresh.setting(), "ANY 2 (\"pg2\", \"pg3\")");
        assert_eq!(
            desired_sync_set(Durability::Async, 1, &eligible, &eligible, None),
            None
        );
    }

    #[test]
    fn union_is_the_conservative_transition() {
        let a = SyncSet {
            quorum: 2,
            standbys: names(&["pg2", "pg3"]),
        };
        let b = SyncSet {
            quorum: 1,
            standbys: names(&["pg3", "pg4"]),
        };
        let u = a.union(&b);
        assert_eq!(u.standbys, names(&["pg2", "pg3", "pg4"]));
        assert_eq!(u.quorum, 1);
        // From or to the primary acknowledging alone: no standby is sure to hold a commit.
        assert!(SyncSet::default().union(&b).standbys.is_empty());
        assert!(b.union(&SyncSet::default()).standbys.is_empty());
        assert_eq!(
            SyncSet {
                quorum: 1,
                standbys: names(&["a\"b"])
            }
            .setting(),
            "ANY 1 (\"a\"\"b\")"
        );
    }
}
