//! What a node's health checks add up to for failover: the check the view reports, the run of
//! failed checks that makes a node down, and whether a standby's position has settled. The
//! proxy's node monitors and the seeded simulation both keep one [`Track`] per node, so the
//! simulation's view of a node is built by the rules production uses.

use crate::{Check, Lsn};

/// Good checks in a row a standby's position must hold still before failover trusts it: one
/// quiet interval could be a pause in a restarted standby's replay.
pub const SETTLED_CHECKS: u32 = 2;

/// What one good check saw, in failover's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sighting {
    /// `pg_is_in_recovery()` was false.
    pub primary: bool,
    pub timeline: u32,
    /// A primary's WAL insert position, or a standby's replay position.
    pub lsn: Lsn,
    /// A standby's last received position (0 on a primary).
    pub received_lsn: Lsn,
    /// A standby's WAL receiver streams and hears from its upstream.
    pub upstream_alive: bool,
}

/// One node's checks so far.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Track {
    failed_streak: u32,
    settled_checks: u32,
    last: Option<Sighting>,
}

impl Track {
    /// A good check. Its position is settled when it is where the previous good check left
    /// it, or only replay moved, below an unchanged received position (see
    /// [`Check::Replica::settled`]).
    pub fn saw(&mut self, now: Sighting) {
        let settled = self.last.is_some_and(|prev| {
            prev.primary == now.primary
                && prev.received_lsn == now.received_lsn
                && (prev.lsn == now.lsn || now.lsn <= now.received_lsn)
        });
        self.settled_checks = if settled {
            self.settled_checks.saturating_add(1)
        } else {
            0
        };
        self.failed_streak = 0;
        self.last = Some(now);
    }

    /// A check that failed: no answer, an error, too slow.
    pub fn failed(&mut self) {
        self.failed_streak = self.failed_streak.saturating_add(1);
        self.settled_checks = 0;
    }

    /// Failed checks since the last good one.
    pub fn failed_streak(&self) -> u32 {
        self.failed_streak
    }

    /// What the last good check saw, kept through failures.
    pub fn last_seen(&self) -> Option<&Sighting> {
        self.last.as_ref()
    }

    /// The check the decision's view reports: the last one's result, `Failed` while checks fail.
    pub fn check(&self) -> Check {
        match self.last {
            Some(seen) if self.failed_streak == 0 => {
                if seen.primary {
                    Check::Primary {
                        timeline: seen.timeline,
                        lsn: seen.lsn,
                    }
                } else {
                    Check::Replica {
                        timeline: seen.timeline,
                        received_lsn: seen.received_lsn,
                        replayed_lsn: seen.lsn,
                        upstream_alive: seen.upstream_alive,
                        settled: self.settled_checks >= SETTLED_CHECKS,
                    }
                }
            }
            _ => Check::Failed,
        }
    }

    /// How far the node had received WAL (or replayed or written it, whichever is further) at
    /// its last good check; 0 before one.
    pub fn received_lsn(&self) -> Lsn {
        self.last.map_or(0, |s| s.received_lsn.max(s.lsn))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn standby(received_lsn: Lsn, lsn: Lsn) -> Sighting {
        Sighting {
            primary: false,
            timeline: 1,
            lsn,
            received_lsn,
            upstream_alive: false,
        }
    }

    fn settled(track: &Track) -> bool {
        matches!(track.check(), Check::Replica { settled: true, .. })
    }

    #[test]
    fn a_standby_settles_after_two_quiet_checks_and_unsettles_when_it_moves_or_fails() {
        let mut track = Track::default();
        assert_eq!(track.check(), Check::Failed);
        track.saw(standby(100, 100));
        track.saw(standby(100, 100));
        assert!(!settled(&track), "one quiet interval is not enough");
        track.saw(standby(100, 100));
        assert!(settled(&track));
        // Replay catching up below an unchanged received position is still settled.
        track.saw(standby(100, 90));
        track.saw(standby(100, 95));
        assert!(settled(&track));
        // Received WAL moved: not final.
        track.saw(standby(120, 120));
        assert!(!settled(&track));
        track.saw(standby(120, 120));
        track.saw(standby(120, 120));
        assert!(settled(&track));
        track.failed();
        assert_eq!(track.check(), Check::Failed);
        assert_eq!(track.failed_streak(), 1);
        assert_eq!(track.received_lsn(), 120, "the last good check is kept");
        track.saw(standby(120, 120));
        assert!(!settled(&track), "a failure starts the count again");
        assert_eq!(track.failed_streak(), 0);
    }

    #[test]
    fn a_replay_past_received_is_movement_and_a_role_change_is_not_settled() {
        let mut track = Track::default();
        for _ in 0..3 {
            track.saw(standby(100, 100));
        }
        // Replay beyond what it received (WAL on disk from before a restart): moving.
        track.saw(standby(100, 150));
        assert!(!settled(&track));
        let mut track = Track::default();
        for _ in 0..3 {
            track.saw(standby(0, 100));
        }
        track.saw(Sighting {
            primary: true,
            ..standby(0, 100)
        });
        track.saw(Sighting {
            primary: true,
            ..standby(0, 100)
        });
        assert_eq!(
            track.check(),
            Check::Primary {
                timeline: 1,
                lsn: 100
            }
        );
        track.saw(standby(0, 100));
        assert!(!settled(&track), "a new standby starts unsettled");
    }
}
