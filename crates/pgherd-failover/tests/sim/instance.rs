//! One modelled pgherd instance: its view, its monitors' counts, its failover task's memory and
//! its side of the agreement; and the agreement engine when several run.

use pgherd_failover::agreement::Sightings;
use pgherd_failover::control::{Io, Operation};
use pgherd_failover::fenced::FencedCare;
use pgherd_failover::keeper::SyncKeeper;
use pgherd_failover::observe::Track;
use pgherd_failover::{Change, ClusterState, Lsn, NodeId};

use super::etcd::Etcd;

/// One pgherd instance: its view, its monitors' counts, its failover task's memory, and its
/// side of the agreement.
pub struct Instance {
    pub name: String,
    pub alive: bool,
    /// Stopped (SIGSTOP) until this tick.
    pub stalled_until: usize,
    pub cut_from_etcd: bool,
    /// Its own links to the nodes, cut (the others' may be fine).
    pub cut_from_node: Vec<bool>,
    pub state: ClusterState,
    pub tracks: Vec<Track>,
    pub last_primary_lsn: Option<Lsn>,
    pub keeper: SyncKeeper,
    pub fenced_care: FencedCare,
    /// This run's lease, and when it runs out as this instance counts (from its renewal).
    pub lease: Option<i64>,
    pub lease_until_ms: u64,
    pub leading_until_ms: Option<u64>,
    /// The leader key named this instance with its lease at its last campaign.
    pub leading: bool,
    /// The leader's view it routes by: the lease it was written with, its version.
    pub routed: (i64, u64),
    /// What it has read of the others' records, for the failsafe of those that vanish.
    pub sightings: Sightings,
    /// An operation stopped between agreeing to an IO and performing it: it performs that IO
    /// when it wakes, as a stopped process would.
    pub suspended: Option<(Operation, Io)>,
}

impl Instance {
    /// A process that has just started: with `[dcs]` it waits for a view before it routes.
    pub fn start(name: String, nodes: usize, dcs: bool) -> Instance {
        let mut state = ClusterState::default();
        if dcs {
            if let Some(next) = state.apply(&Change::AwaitView(true)) {
                state = next;
            }
        }
        Instance {
            name,
            alive: true,
            stalled_until: 0,
            cut_from_etcd: false,
            cut_from_node: vec![false; nodes],
            state,
            tracks: vec![Track::default(); nodes],
            last_primary_lsn: None,
            keeper: SyncKeeper::default(),
            fenced_care: FencedCare::default(),
            lease: None,
            lease_until_ms: 0,
            leading_until_ms: None,
            leading: false,
            routed: (0, 0),
            sightings: Sightings::default(),
            suspended: None,
        }
    }

    pub fn runs(&self, tick: usize) -> bool {
        self.alive && tick >= self.stalled_until
    }

    pub fn change(&mut self, change: Change) {
        if let Some(next) = self.state.apply(&change) {
            self.state = next;
        }
    }

    pub fn elected(&self) -> Option<usize> {
        self.state.elected.map(|id| id.0 as usize)
    }

    pub fn fenced(&self, i: usize) -> bool {
        self.state.is_fenced(NodeId(i as u32))
    }
}

/// The agreement engine and its settings, when several instances run.
pub struct Dcs {
    pub etcd: Etcd,
    pub lease_ttl_ms: u64,
    /// Each instance's `[dcs] failsafe_s`, in milliseconds.
    pub failsafe_ms: Vec<u64>,
}
