//! The care of fenced nodes, decided without IO: a fenced node that answers again (a replaced
//! primary restarted, a diverged standby) is made read-only ("sealed") once, whether failover
//! is on or not, and, with `auto_rejoin` on a node pgherd manages, rejoined after that. The
//! proxy's failover loop and the simulation both keep one [`FencedCare`].

use std::collections::BTreeSet;

use crate::{ClusterState, NodeId};

/// A node as this needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FencedNode {
    pub id: NodeId,
    /// Its last health check succeeded.
    pub answers: bool,
    /// A rejoin works on it now: sealing it would leave it read-only for good.
    pub rejoining: bool,
}

/// The fenced nodes already sealed (`ALTER SYSTEM` outlives restarts, so once is enough).
#[derive(Debug, Clone, Default)]
pub struct FencedCare {
    sealed: BTreeSet<NodeId>,
}

impl FencedCare {
    /// The nodes to seal now: fenced, answering, not being rejoined, not sealed yet. A node no
    /// longer fenced is forgotten: once it has rejoined it may be fenced, and sealed, again.
    pub fn to_seal(&mut self, state: &ClusterState, nodes: &[FencedNode]) -> Vec<NodeId> {
        self.sealed.retain(|id| state.is_fenced(*id));
        nodes
            .iter()
            .filter(|n| {
                state.is_fenced(n.id) && n.answers && !n.rejoining && !self.sealed.contains(&n.id)
            })
            .map(|n| n.id)
            .collect()
    }

    /// Sealing `node` worked. Returns whether to rejoin it now: `auto_rejoin` is on and pgherd
    /// manages the node's processes.
    pub fn sealed(&mut self, node: NodeId, auto_rejoin: bool, managed: bool) -> bool {
        self.sealed.insert(node);
        auto_rejoin && managed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Change;

    const A: NodeId = NodeId(0);
    const B: NodeId = NodeId(1);

    fn node(id: NodeId, answers: bool, rejoining: bool) -> FencedNode {
        FencedNode {
            id,
            answers,
            rejoining,
        }
    }

    #[test]
    fn a_fenced_node_is_sealed_once_when_it_answers_and_again_after_it_rejoined() {
        let fenced = ClusterState::default().apply(&Change::Fence(A)).unwrap();
        let mut care = FencedCare::default();
        assert!(
            care.to_seal(&fenced, &[node(A, false, false)]).is_empty(),
            "does not answer"
        );
        assert!(
            care.to_seal(&fenced, &[node(A, true, true)]).is_empty(),
            "being rejoined"
        );
        assert_eq!(
            care.to_seal(&fenced, &[node(A, true, false), node(B, true, false)]),
            [A]
        );
        // Sealing failed (no call to `sealed`): asked again next turn.
        assert_eq!(care.to_seal(&fenced, &[node(A, true, false)]), [A]);
        assert!(care.sealed(A, true, true), "auto_rejoin on a managed node");
        assert!(
            care.to_seal(&fenced, &[node(A, true, false)]).is_empty(),
            "sealed already"
        );
        assert!(!care.sealed(A, true, false), "not managed: no rejoin");
        assert!(!care.sealed(A, false, true), "auto_rejoin off");
        // Rejoined (unfenced), then fenced again: sealed again.
        let rejoined = fenced.apply(&Change::Unfence(A)).unwrap();
        assert!(care.to_seal(&rejoined, &[node(A, true, false)]).is_empty());
        let fenced_again = rejoined.apply(&Change::Fence(A)).unwrap();
        assert_eq!(care.to_seal(&fenced_again, &[node(A, true, false)]), [A]);
    }
}
