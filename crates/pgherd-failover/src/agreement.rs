//! The rules one pgherd instance follows when several agree through etcd (`[dcs]`): whom the
//! leader key names, until when this instance may act for the cluster, and which shared view
//! it adopts. The proxy's etcd session (`pgherd_proxy::dcs`) feeds these functions what etcd
//! answered and the time it read; the seeded simulation drives the same functions against a
//! modelled etcd, with instances that crash, stall and lose etcd.
//!
//! Time is in milliseconds from any origin the caller keeps fixed.
//!
//! Writes and etcd: an instance routes writes while its own lease is known to be valid, and
//! for `failsafe_ms` past it (the failsafe: an outage of etcd that long costs no write), to
//! the primary of the last view it read while that primary answers and is not fenced. A
//! leader that replaces the primary first waits until every other instance has either taken
//! its view (the promotion under way, the old primary fenced) or lost its lease and its
//! failsafe ([`Sightings`]: it tells from the members and records in etcd since when one
//! may have been cut off). So no instance still sends writes to the old primary once the new
//! one takes them, whatever it missed (stopped, cut off from etcd, started late). The price:
//! a promotion after an instance vanished (its machine died with the primary's) waits the
//! failsafe out too.

use std::collections::BTreeMap;

/// The leader key as etcd returned it: the instance it names and the lease it is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderKey<'a> {
    pub instance: &'a str,
    pub lease: i64,
}

/// Whom an instance takes for the leader after reading the leader key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leadership {
    /// The leader's name as shown (`SHOW CLUSTER`); `None` when the key is absent.
    pub leader: Option<String>,
    /// This instance holds the key with the lease of its current session.
    pub leading: bool,
}

/// Reads the leader key. A key naming this instance on another lease is from its previous
/// run (a restart within the TTL): it leads nobody until etcd lets it expire, and says so.
pub fn leadership(instance: &str, lease: i64, key: Option<LeaderKey>) -> Leadership {
    match key {
        None => Leadership {
            leader: None,
            leading: false,
        },
        Some(key) if key.instance == instance && key.lease != lease => Leadership {
            leader: Some(format!("{instance} (previous run)")),
            leading: false,
        },
        Some(key) => Leadership {
            leader: Some(key.instance.to_owned()),
            leading: key.instance == instance,
        },
    }
}

/// Until when a leading instance may act: its lease's expiry as last renewed (counted from
/// when the renewal was sent, which is before etcd counted it), less the time one request may
/// take, so it stops before etcd can let the lease go and another instance take over. `None`
/// when it does not lead.
pub fn leading_until_ms(
    leading: bool,
    lease_until_ms: u64,
    request_timeout_ms: u64,
) -> Option<u64> {
    leading.then(|| lease_expiry_ms(lease_until_ms, request_timeout_ms))
}

/// Whether the instance may act for the cluster (fail over, set standbys, run the operator's
/// actions) at `now_ms`.
pub fn may_act(leading_until_ms: Option<u64>, now_ms: u64) -> bool {
    leading_until_ms.is_some_and(|until| now_ms < until)
}

/// How often a lease of `ttl_s` seconds is renewed: three times per TTL, so two renewals may
/// fail before it runs out.
pub fn renew_every_ms(lease_ttl_s: u64) -> u64 {
    lease_ttl_s * 1000 / 3
}

/// What an instance does with the shared view it read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adoption {
    /// It leads and wrote that view itself with this session's lease: its own is the same or
    /// newer.
    Keep,
    /// It follows: the leader's view replaces its own whole, whatever its epoch (the leader's
    /// view is the cluster's; an instance that led once may hold changes it never
    /// published, and must not route by them).
    Follow,
    /// It has just taken over: it adopts its predecessor's view before it acts, so it knows of
    /// a promotion under way, unless its own is of a newer epoch (it led before and elected a
    /// primary it could not publish).
    TakeOver,
}

pub fn adoption(
    instance: &str,
    lease: i64,
    leading: bool,
    written_by: &str,
    written_with_lease: i64,
) -> Adoption {
    if !leading {
        Adoption::Follow
    } else if written_by != instance || written_with_lease != lease {
        Adoption::TakeOver
    } else {
        Adoption::Keep
    }
}

/// Where an instance stands for routing writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteLease {
    /// Its lease is known valid (or it never had one: then it has read no view either, and
    /// the gate holds writes for that).
    Valid,
    /// Past its lease, within its failsafe: writes go on for this long.
    Failsafe {
        left_ms: u64,
    },
    Lapsed,
}

impl WriteLease {
    pub fn may_route_writes(self) -> bool {
        self != WriteLease::Lapsed
    }
}

/// Where an instance stands at `now_ms` with its lease as last renewed (`None`: it never had
/// one): valid as for acting (its expiry less one request), then `failsafe_ms` of failsafe.
pub fn write_lease(
    lease_until_ms: Option<u64>,
    request_timeout_ms: u64,
    failsafe_ms: u64,
    now_ms: u64,
) -> WriteLease {
    let Some(lease_until_ms) = lease_until_ms else {
        return WriteLease::Valid;
    };
    let expiry_ms = lease_expiry_ms(lease_until_ms, request_timeout_ms);
    let failsafe_until_ms = expiry_ms.saturating_add(failsafe_ms);
    if now_ms < expiry_ms {
        WriteLease::Valid
    } else if now_ms < failsafe_until_ms {
        WriteLease::Failsafe {
            left_ms: failsafe_until_ms - now_ms,
        }
    } else {
        WriteLease::Lapsed
    }
}

fn lease_expiry_ms(lease_until_ms: u64, request_timeout_ms: u64) -> u64 {
    lease_until_ms.saturating_sub(request_timeout_ms)
}

/// One instance as etcd lists it: its member key (on no lease, put with each of its records:
/// the session's lease and whether it routes by a view yet) and whether its record (on that
/// lease) is still there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member<'a> {
    pub instance: &'a str,
    pub session: i64,
    /// The session has routed by a view: an instance opens its write gate only once its
    /// record (and member key) says so, so a session that never did routed no write.
    pub routed: bool,
    /// The failsafe that session keeps (its own `failsafe_s`: instances may differ).
    pub failsafe_ms: u64,
    pub live: bool,
}

/// How long after a member's record was found gone the leader waits: its failsafe, and one
/// part in a thousand more, for clocks of different machines that do not run at quite the
/// same rate (NTP slews them by up to half that).
pub fn failsafe_wait_ms(failsafe_ms: u64) -> u64 {
    failsafe_ms.saturating_add(failsafe_ms / 1000)
}

/// What an instance has seen of the members in etcd: since when each one whose record is gone
/// (its lease expired: dead, stopped, or cut off from etcd) may have been routing writes in
/// failsafe. Every instance keeps it from its first read on, so a follower that takes over
/// knows what happened before; a fresh one counts from its first read. Member keys outlive
/// leases, so an instance that came and went unseen (while this one could not read etcd) is
/// still found gone.
#[derive(Debug, Clone, Default)]
pub struct Sightings {
    read_once: bool,
    /// Members without a record: the session that ended, when the read that first found it
    /// ended came back (by then etcd had let the lease go, and the instance's own count of it
    /// had run out before), and that session's failsafe.
    gone: BTreeMap<String, (i64, u64, u64)>,
}

impl Sightings {
    /// The members as a read that came back at `received_ms` found them. An instance back
    /// with a record, or with a newer session, stopped routing by its old one (it closes its
    /// gate before it puts a new lease's record): its old session is not waited for.
    pub fn read<'a>(&mut self, received_ms: u64, members: impl IntoIterator<Item = Member<'a>>) {
        let mut gone = BTreeMap::new();
        for member in members.into_iter().filter(|m| !m.live && m.routed) {
            let since_ms = match self.gone.get(member.instance) {
                Some(&(session, since_ms, _)) if session == member.session => since_ms,
                _ => received_ms,
            };
            gone.insert(
                member.instance.to_owned(),
                (member.session, since_ms, member.failsafe_ms),
            );
        }
        self.gone = gone;
        self.read_once = true;
    }

    /// From when no member whose record is gone can still route writes in failsafe
    /// (`u64::MAX`: no read yet). Members with a record are the leader's to wait for by it.
    pub fn failsafe_over_at_ms(&self) -> u64 {
        if !self.read_once {
            return u64::MAX;
        }
        self.gone
            .values()
            .map(|&(_, since_ms, failsafe_ms)| {
                since_ms.saturating_add(failsafe_wait_ms(failsafe_ms))
            })
            .max()
            .unwrap_or(0)
    }

    /// Members whose failsafe is over at `now_ms`, with their ended session: the leader
    /// removes their keys (if they still name that session; a new run of the instance puts its
    /// own).
    pub fn forgettable(&self, now_ms: u64) -> Vec<(String, i64)> {
        self.gone
            .iter()
            .filter(|(_, &(_, since_ms, failsafe_ms))| {
                now_ms >= since_ms.saturating_add(failsafe_wait_ms(failsafe_ms))
            })
            .map(|(instance, &(session, _, _))| (instance.clone(), session))
            .collect()
    }
}

/// Whether the leader may promote a new primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    Go,
    /// Instances that still hold their lease route by an older view than the one that fences
    /// the old primary.
    Lagging(usize),
    /// An instance that vanished may route writes to the old primary in failsafe until then.
    Failsafe {
        until_ms: u64,
    },
}

pub fn may_promote(lagging: usize, failsafe_over_at_ms: u64, now_ms: u64) -> Promotion {
    if lagging > 0 {
        Promotion::Lagging(lagging)
    } else if now_ms < failsafe_over_at_ms {
        Promotion::Failsafe {
            until_ms: failsafe_over_at_ms,
        }
    } else {
        Promotion::Go
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_leader_key_names_the_leader_and_a_previous_run_leads_nobody() {
        assert_eq!(
            leadership("a", 7, None),
            Leadership {
                leader: None,
                leading: false
            }
        );
        let key = |instance, lease| Some(LeaderKey { instance, lease });
        assert!(leadership("a", 7, key("a", 7)).leading);
        assert_eq!(
            leadership("a", 7, key("b", 3)),
            Leadership {
                leader: Some("b".into()),
                leading: false
            }
        );
        assert_eq!(
            leadership("a", 7, key("a", 3)),
            Leadership {
                leader: Some("a (previous run)".into()),
                leading: false
            }
        );
    }

    #[test]
    fn a_leader_stops_acting_one_request_before_its_lease_can_expire() {
        assert_eq!(leading_until_ms(true, 10_000, 500), Some(9_500));
        assert_eq!(leading_until_ms(false, 10_000, 500), None);
        assert!(may_act(Some(9_500), 9_499));
        assert!(!may_act(Some(9_500), 9_500));
        assert!(!may_act(None, 0));
        assert_eq!(renew_every_ms(3), 1_000);
    }

    #[test]
    fn a_follower_follows_and_a_leader_takes_over_views_it_did_not_write() {
        assert_eq!(adoption("a", 7, true, "a", 7), Adoption::Keep);
        assert_eq!(
            adoption("a", 7, true, "a", 3),
            Adoption::TakeOver,
            "its previous run's view"
        );
        assert_eq!(
            adoption("a", 7, true, "b", 7),
            Adoption::TakeOver,
            "its predecessor's view"
        );
        assert_eq!(
            adoption("a", 7, false, "a", 7),
            Adoption::Follow,
            "a follower takes whatever the leader wrote"
        );
    }

    #[test]
    fn writes_are_routed_with_a_valid_lease_and_through_the_failsafe() {
        let at = |now_ms, failsafe_ms| write_lease(Some(10_000), 500, failsafe_ms, now_ms);
        assert_eq!(at(9_499, 0), WriteLease::Valid);
        assert_eq!(at(9_500, 0), WriteLease::Lapsed, "no failsafe");
        assert_eq!(at(9_499, 3_000), WriteLease::Valid);
        assert_eq!(at(9_500, 3_000), WriteLease::Failsafe { left_ms: 3_000 });
        assert_eq!(at(12_499, 3_000), WriteLease::Failsafe { left_ms: 1 });
        assert!(at(12_499, 3_000).may_route_writes());
        assert_eq!(at(12_500, 3_000), WriteLease::Lapsed);
        assert!(!at(12_500, 3_000).may_route_writes());
        assert_eq!(
            write_lease(None, 500, 0, u64::MAX),
            WriteLease::Valid,
            "never had one"
        );
    }

    #[test]
    fn a_promotion_waits_for_lagging_instances_then_the_failsafe_of_vanished_ones() {
        let member = |instance, session, live| Member {
            instance,
            session,
            routed: true,
            failsafe_ms: 3_000,
            live,
        };
        let mut seen = Sightings::default();
        assert_eq!(seen.failsafe_over_at_ms(), u64::MAX, "never read");
        assert_eq!(
            may_promote(0, u64::MAX, 1_000_000),
            Promotion::Failsafe { until_ms: u64::MAX }
        );
        // All live: nothing to wait for.
        seen.read(1_010, [member("a", 1, true), member("b", 2, true)]);
        assert_eq!(seen.failsafe_over_at_ms(), 0);
        // b's record goes: its failsafe (and the clocks' allowance) counts from the read that
        // found it gone.
        assert_eq!(failsafe_wait_ms(3_000), 3_003);
        seen.read(2_010, [member("a", 1, true), member("b", 2, false)]);
        assert_eq!(seen.failsafe_over_at_ms(), 5_013);
        seen.read(2_210, [member("a", 1, true), member("b", 2, false)]);
        assert_eq!(seen.failsafe_over_at_ms(), 5_013, "from the first read");
        assert_eq!(may_promote(1, 5_013, 9_000), Promotion::Lagging(1));
        assert_eq!(
            may_promote(0, 5_013, 5_012),
            Promotion::Failsafe { until_ms: 5_013 }
        );
        assert_eq!(may_promote(0, 5_013, 5_013), Promotion::Go);
        assert!(seen.forgettable(5_012).is_empty());
        assert_eq!(seen.forgettable(5_013), vec![("b".to_owned(), 2)]);
        // b ran again, unseen, and its new session ended too: counted anew.
        seen.read(6_000, [member("a", 1, true), member("b", 7, false)]);
        assert_eq!(seen.failsafe_over_at_ms(), 9_003);
        // b back with a record: it routes nothing before it reads the view; no wait for it.
        seen.read(6_200, [member("a", 1, true), member("b", 8, true)]);
        assert_eq!(seen.failsafe_over_at_ms(), 0);
        // Each member's own failsafe counts, whatever the leader's.
        let longer = Member {
            failsafe_ms: 20_000,
            ..member("b", 8, false)
        };
        seen.read(6_400, [member("a", 1, true), longer]);
        assert_eq!(seen.failsafe_over_at_ms(), 26_420);
        // A fresh instance's first read counts every gone member from then.
        let mut fresh = Sightings::default();
        fresh.read(100, [member("a", 1, false)]);
        assert_eq!(fresh.failsafe_over_at_ms(), 3_103);
        // A session that never routed by a view (it crashed, or could not read the view,
        // before) routed no write: a crash loop does not hold promotions back.
        let never_routed = Member {
            routed: false,
            ..member("b", 9, false)
        };
        seen.read(7_000, [member("a", 1, true), never_routed]);
        assert_eq!(seen.failsafe_over_at_ms(), 0);
    }
}
