//! The modelled etcd, as far as pgherd uses it: leases that expire unless renewed, the leader
//! key put on a lease only when absent, and the shared view written only by a transaction that
//! compares the leader key and its lease. It answers or not as a whole (`up`); each
//! instance's own link to it is the instance's to model.

use std::collections::BTreeMap;

use pgherd_failover::ClusterState;

#[derive(Debug, Clone)]
pub struct SharedView {
    pub state: ClusterState,
    pub written_by: String,
    pub lease: i64,
}

#[derive(Debug, Default)]
pub struct Etcd {
    pub up: bool,
    next_lease: i64,
    /// Lease id → when it expires (ms).
    leases: BTreeMap<i64, u64>,
    /// The leader key: the instance it names and the lease it is on.
    pub leader: Option<(String, i64)>,
    pub view: Option<SharedView>,
    /// Each instance's record, on its lease: the leader's view it routes by (the lease that
    /// view was written with, its version).
    pub records: BTreeMap<String, (i64, (i64, u64))>,
    /// Each instance's member key, on no lease: the lease of its latest session, whether
    /// that session routes by a view, and its failsafe.
    pub members: BTreeMap<String, (i64, bool, u64)>,
}

impl Etcd {
    pub fn new() -> Etcd {
        Etcd {
            up: true,
            next_lease: 1,
            ..Etcd::default()
        }
    }

    /// Lets leases whose time has come go, and keys on them with them.
    pub fn expire(&mut self, now_ms: u64) {
        self.leases.retain(|_, expires| *expires > now_ms);
        let leases = &self.leases;
        self.records
            .retain(|_, (lease, _)| leases.contains_key(lease));
        if self
            .leader
            .as_ref()
            .is_some_and(|(_, lease)| !self.leases.contains_key(lease))
        {
            self.leader = None;
        }
    }

    /// Renews `lease` for `ttl_ms` if etcd still has it (`false` if it is gone).
    pub fn renew(&mut self, lease: i64, now_ms: u64, ttl_ms: u64) -> bool {
        match self.leases.get_mut(&lease) {
            Some(expires) => {
                *expires = now_ms + ttl_ms;
                true
            }
            None => false,
        }
    }

    /// etcd starts again: it keeps its leases, each with its full TTL from now (as etcd's
    /// lessor does when a member becomes leader), so an outage alone expires none.
    pub fn restart(&mut self, now_ms: u64, ttl_ms: u64) {
        self.up = true;
        for expires in self.leases.values_mut() {
            *expires = now_ms + ttl_ms;
        }
    }

    pub fn grant(&mut self, now_ms: u64, ttl_ms: u64) -> i64 {
        let id = self.next_lease;
        self.next_lease += 1;
        self.leases.insert(id, now_ms + ttl_ms);
        id
    }

    /// An instance's record, on its lease: the leader's view it routes by; and its member key
    /// naming that lease and its failsafe, in the same transaction.
    pub fn register(&mut self, instance: &str, lease: i64, routed: (i64, u64), failsafe_ms: u64) {
        if self.leases.contains_key(&lease) {
            self.records.insert(instance.to_owned(), (lease, routed));
            self.members
                .insert(instance.to_owned(), (lease, routed.0 != 0, failsafe_ms));
        }
    }

    /// Removes a member key if it still names `session`.
    pub fn forget(&mut self, instance: &str, session: i64) {
        if self.members.get(instance).map(|m| m.0) == Some(session) {
            self.members.remove(instance);
        }
    }

    /// The other instances with a record that route by another leader's view, or by an older
    /// one of `leader_lease`'s than `version`.
    pub fn lagging(&self, instance: &str, leader_lease: i64, version: u64) -> usize {
        self.records
            .iter()
            .filter(|(name, (_, (view_lease, routed)))| {
                name.as_str() != instance && (*view_lease != leader_lease || *routed < version)
            })
            .count()
    }

    /// The campaign's transaction: puts the leader key on `lease` if it is absent; whether it
    /// did.
    pub fn campaign(&mut self, instance: &str, lease: i64) -> bool {
        let absent = self.leader.is_none();
        if absent {
            self.leader = Some((instance.to_owned(), lease));
        }
        absent
    }

    /// The publishing transaction: writes the view if `instance` holds the leader key with
    /// `lease`.
    pub fn publish(&mut self, instance: &str, lease: i64, state: &ClusterState) -> bool {
        let holds = self
            .leader
            .as_ref()
            .is_some_and(|(name, held)| name == instance && *held == lease);
        if holds {
            self.view = Some(SharedView {
                state: state.clone(),
                written_by: instance.to_owned(),
                lease,
            });
        }
        holds
    }
}
