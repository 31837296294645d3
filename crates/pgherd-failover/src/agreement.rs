//! The rules one pgherd instance follows when several agree through etcd (`[dcs]`): whom the
//! leader key names, until when this instance may act for the cluster, and which shared view
//! it adopts. The proxy's etcd session (`pgherd_proxy::dcs`) feeds these functions what etcd
//! answered and the time it read; the seeded simulation drives the same functions against a
//! modelled etcd, with instances that crash, stall and lose etcd.
//!
//! Time is in milliseconds from any origin the caller keeps fixed.
//!
//! Writes and etcd: an instance routes writes only while its own lease is known to be
//! valid, and a leader that replaces the primary first waits until every other instance has
//! either taken its view (the promotion under way, the old primary fenced) or lost its lease.
//! So no instance still sends writes to the old primary once the new one takes them, whatever
//! it missed (stopped, cut off from etcd, started late). An outage of etcd shorter than the
//! lease changes nothing (etcd keeps its leases through a restart, and instances keep using
//! theirs); a longer one holds writes until etcd answers again, the price of never writing to
//! two primaries.

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
    leading.then(|| lease_until_ms.saturating_sub(request_timeout_ms))
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

/// Whether the instance routes writes at `now_ms`: while its lease is known valid, as for
/// acting (its expiry as last renewed, less one request).
pub fn may_route_writes(lease_until_ms: u64, request_timeout_ms: u64, now_ms: u64) -> bool {
    now_ms < lease_until_ms.saturating_sub(request_timeout_ms)
}

/// Whether the leader may promote a new primary: no other instance that still holds its lease
/// routes by an older view than the one that fences the old primary (`lagging`).
pub fn may_promote(lagging: usize) -> bool {
    lagging == 0
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
    fn writes_are_routed_with_a_valid_lease_only() {
        assert!(may_route_writes(10_000, 500, 9_499));
        assert!(!may_route_writes(10_000, 500, 9_500));
        assert!(may_promote(0));
        assert!(!may_promote(1));
    }
}
