//! The nodes and the cluster view as one plan reads them: loaded once, without a lock, and
//! offered to the planner as its `ClusterView`.

use std::sync::Arc;

use arc_swap::Guard;
use pgherd_failover::{ClusterState, Gate};
use pgherd_route::balance::{Balance, Candidate};
use pgherd_route::plan::{ClusterView, NodeStanding, ReadNeeds, ReadSet};

use crate::nodes::{NodeState, Nodes, Role};

/// A shared value as a snapshot holds it: loaded for it, or a session's cached copy.
pub(crate) enum Held<'a, T> {
    Loaded(Guard<Arc<T>>),
    Cached(&'a Arc<T>),
}

impl<T> std::ops::Deref for Held<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        match self {
            Held::Loaded(guard) => guard,
            Held::Cached(arc) => arc,
        }
    }
}

/// The nodes and the cluster view as one plan sees them: loaded once, without a lock.
pub struct Snapshot<'a> {
    nodes: &'a Nodes,
    list: Held<'a, Vec<Arc<NodeState>>>,
    view: Held<'a, ClusterState>,
    /// The write gate, folded once: a write's plan asks about it several times.
    gate: Gate,
}

impl<'a> Snapshot<'a> {
    pub(crate) fn new(
        nodes: &'a Nodes,
        list: Held<'a, Vec<Arc<NodeState>>>,
        view: Held<'a, ClusterState>,
    ) -> Self {
        let gate = view.gate();
        Snapshot {
            nodes,
            list,
            view,
            gate,
        }
    }

    /// The nodes, in config order.
    pub fn nodes(&self) -> &[Arc<NodeState>] {
        &self.list
    }

    /// Up, in `role`, and neither fenced nor detached.
    pub(crate) fn usable_as(&self, node: &NodeState, role: Role) -> bool {
        node.is_up() && node.role() == role && !self.view.is_excluded(node.id)
    }

    /// The node that accepts writes: `ClusterState::writer` over the nodes that are up and
    /// report being primary, the same function the failover simulation checks.
    pub fn writer(&self) -> Option<Arc<NodeState>> {
        let primaries = || {
            self.list
                .iter()
                .filter(|n| n.is_up() && n.role() == Role::Primary)
        };
        let Some(id) = self.view.writer(primaries().map(|n| n.id)) else {
            if self.view.elected.is_none() {
                let unexcluded: Vec<&str> = primaries()
                    .filter(|n| !self.view.is_excluded(n.id))
                    .map(|n| n.name())
                    .collect();
                if unexcluded.len() > 1 {
                    tracing::error!(nodes = %unexcluded.join(", "), "several nodes report being primary and none is elected: no writes");
                }
            }
            return None;
        };
        self.list.iter().find(|n| n.id == id).cloned()
    }
}

/// With a local zone and a healthy candidate in it, candidates elsewhere take no reads: a
/// replica across zones serves only when none in this one can.
fn prefer_zone(local: Option<&str>, nodes: &[&Arc<NodeState>], candidates: &mut [Candidate]) {
    let Some(local) = local else { return };
    let in_zone = |node: &NodeState| node.config.zone.as_deref() == Some(local);
    let any_local = nodes
        .iter()
        .zip(candidates.iter())
        .any(|(n, c)| c.healthy && in_zone(n));
    if any_local {
        for (node, candidate) in nodes.iter().zip(candidates.iter_mut()) {
            if !in_zone(node) {
                candidate.healthy = false;
            }
        }
    }
}

/// The data path's view of the cluster for the planner.
impl ClusterView for Snapshot<'_> {
    type Node = Arc<NodeState>;

    fn standing(&self, node: &Arc<NodeState>) -> NodeStanding {
        NodeStanding {
            role: node.role(),
            // A node a reload took out is no longer watched: its last state says nothing (a
            // session's last node may be one, e.g. after `pgherd shard move`).
            up: node.is_up() && !node.is_retired(),
            excluded: self.view.is_excluded(node.id),
            in_read_set: node.in_read_set(),
        }
    }

    fn primary(&self) -> Option<Arc<NodeState>> {
        if self.writes_paused() {
            return None;
        }
        self.writer()
    }

    fn writes_paused(&self) -> bool {
        matches!(self.gate, Gate::Hold(_))
    }

    fn writes_refused(&self) -> Option<String> {
        match &self.gate {
            Gate::Refuse(why) => Some(self.nodes.gate_sentence(why)),
            _ => None,
        }
    }

    /// Where a read may go, in config order; the primary is among them only when
    /// `primary_reads` (and not while the write gate holds: a primary being switched over
    /// drains).
    fn read_candidates(&self, reads: &ReadNeeds) -> (ReadSet<&Arc<NodeState>>, ReadSet<Candidate>) {
        let primary_reads = reads.primary_reads && !self.writes_paused();
        let reads_here =
            |role: Role| role == Role::Replica || (primary_reads && role == Role::Primary);
        if !self.list.iter().any(|n| reads_here(n.role())) {
            // A cluster without replicas pays nothing for routing.
            return (ReadSet::new(), ReadSet::new());
        }
        let mut nodes = ReadSet::new();
        let mut candidates = ReadSet::new();
        for node in self.list.iter() {
            let role = node.role();
            if reads_here(role) {
                candidates.push(node.candidate(
                    role,
                    self.view.is_excluded(node.id),
                    reads.balance,
                ));
                nodes.push(node);
            }
        }
        // Few clusters name zones: the local zone is looked up only when a node has one.
        if nodes.iter().any(|n| n.config.zone.is_some()) {
            prefer_zone(
                self.nodes.local_zone.load().as_deref().map(String::as_str),
                &nodes,
                &mut candidates,
            );
        }
        (nodes, candidates)
    }

    fn read_ticket(&self, balance: Balance) -> u64 {
        match balance {
            Balance::Random => rand::random(),
            _ => self.nodes.next_read_ticket(),
        }
    }
}
