//! The care of fenced nodes, decided without IO: a fenced node that answers again (a replaced
//! primary restarted, a diverged standby) is made read-only ("sealed") once, whether failover
//! is on or not, and, with `auto_rejoin` on a node pgherd manages, rejoined after that. The
//! proxy's failover loop and the simulation both keep one [`FencedCare`]. A rejoin that
//! failed (the primary it should follow was down, say) is tried again after a backoff.

use std::collections::{BTreeMap, BTreeSet};

use crate::{ClusterState, NodeId};

/// A node as this needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FencedNode {
    pub id: NodeId,
    /// Its last health check succeeded.
    pub answers: bool,
    /// A rejoin works on it now: sealing it would leave it read-only for good.
    pub rejoining: bool,
    /// `auto_rejoin` is on and pgherd manages the node's processes: once sealed, it is
    /// rejoined.
    pub rejoined_automatically: bool,
}

/// The fenced nodes on their way back as standbys: being rejoined, or answering and rejoined
/// automatically once sealed, which takes seconds. A new primary's commits wait for them
/// rather than rest on it alone (`keeper::sync_awaited`).
pub fn returning(state: &ClusterState, nodes: &[FencedNode]) -> Vec<NodeId> {
    nodes
        .iter()
        .filter(|n| {
            state.is_fenced(n.id) && (n.rejoining || (n.answers && n.rejoined_automatically))
        })
        .map(|n| n.id)
        .collect()
}

/// The first wait before a failed rejoin is tried again; it doubles with every failure.
pub const REJOIN_RETRY_FIRST_MS: u64 = 5_000;
/// The longest wait between two tries of a rejoin.
pub const REJOIN_RETRY_MAX_MS: u64 = 60_000;

/// The fenced nodes already sealed (`ALTER SYSTEM` outlives restarts, so once is enough), and
/// the failed rejoins waiting to be tried again.
#[derive(Debug, Clone, Default)]
pub struct FencedCare {
    sealed: BTreeSet<NodeId>,
    /// Per node whose rejoin failed: when it may be tried again, and the failures in a row.
    retry: BTreeMap<NodeId, (u64, u32)>,
}

impl FencedCare {
    /// The nodes to seal now (and then rejoin): fenced, answering, not being rejoined, not
    /// sealed yet. A node no longer fenced is forgotten: once it has rejoined it may be
    /// fenced, and sealed, again.
    pub fn to_seal(&mut self, state: &ClusterState, nodes: &[FencedNode]) -> Vec<NodeId> {
        self.sealed.retain(|id| state.is_fenced(*id));
        self.retry.retain(|id, _| state.is_fenced(*id));
        nodes
            .iter()
            .filter(|n| {
                state.is_fenced(n.id) && n.answers && !n.rejoining && !self.sealed.contains(&n.id)
            })
            .map(|n| n.id)
            .collect()
    }

    /// The sealed nodes whose failed rejoin is due to be tried again now, answering or not (a
    /// rejoin that failed half-way may have left the node stopped; rejoining starts it). Each
    /// is counted as being tried until [`Self::rejoin_failed`] says otherwise.
    pub fn to_retry(
        &mut self,
        state: &ClusterState,
        nodes: &[FencedNode],
        now_ms: u64,
    ) -> Vec<NodeId> {
        let due: Vec<NodeId> = nodes
            .iter()
            .filter(|n| {
                state.is_fenced(n.id)
                    && !n.rejoining
                    && self.retry.get(&n.id).is_some_and(|&(at, _)| now_ms >= at)
            })
            .map(|n| n.id)
            .collect();
        for id in &due {
            if let Some(entry) = self.retry.get_mut(id) {
                entry.0 = u64::MAX;
            }
        }
        due
    }

    /// A rejoin of `node` failed: it is tried again after a wait that doubles with each
    /// failure in a row, up to [`REJOIN_RETRY_MAX_MS`]. Returns the wait.
    pub fn rejoin_failed(&mut self, node: NodeId, now_ms: u64) -> u64 {
        let failures = self.retry.get(&node).map_or(0, |&(_, f)| f) + 1;
        let wait_ms = REJOIN_RETRY_FIRST_MS
            .saturating_mul(1 << (failures - 1).min(16))
            .min(REJOIN_RETRY_MAX_MS);
        self.retry
            .insert(node, (now_ms.saturating_add(wait_ms), failures));
        wait_ms
    }

    /// Sealing `node` worked. Returns whether to rejoin it now: it is one pgherd rejoins
    /// automatically.
    pub fn sealed(&mut self, node: &FencedNode) -> bool {
        self.sealed.insert(node.id);
        node.rejoined_automatically
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
            rejoined_automatically: true,
        }
    }

    #[test]
    fn fenced_nodes_that_answer_or_are_being_rejoined_are_on_their_way_back() {
        let fenced = ClusterState::default()
            .apply(&Change::Fence(A))
            .unwrap()
            .apply(&Change::Fence(B))
            .unwrap();
        let manual = FencedNode {
            rejoined_automatically: false,
            ..node(A, true, false)
        };
        assert!(returning(&fenced, &[manual]).is_empty(), "waits for REJOIN");
        assert_eq!(
            returning(
                &fenced,
                &[FencedNode {
                    rejoining: true,
                    ..manual
                }]
            ),
            [A],
            "REJOIN works on it"
        );
        assert_eq!(
            returning(&fenced, &[node(A, false, false), node(B, true, false)]),
            [B],
            "A is down"
        );
        let unfenced = fenced.apply(&Change::Unfence(B)).unwrap();
        assert!(returning(&unfenced, &[node(B, true, false)]).is_empty());
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
        assert!(
            care.sealed(&node(A, true, false)),
            "auto_rejoin on a managed node"
        );
        assert!(
            care.to_seal(&fenced, &[node(A, true, false)]).is_empty(),
            "sealed already"
        );
        let manual = FencedNode {
            rejoined_automatically: false,
            ..node(A, true, false)
        };
        assert!(!care.sealed(&manual), "auto_rejoin off or not managed");
        // Rejoined (unfenced), then fenced again: sealed again.
        let rejoined = fenced.apply(&Change::Unfence(A)).unwrap();
        assert!(care.to_seal(&rejoined, &[node(A, true, false)]).is_empty());
        let fenced_again = rejoined.apply(&Change::Fence(A)).unwrap();
        assert_eq!(care.to_seal(&fenced_again, &[node(A, true, false)]), [A]);
    }

    #[test]
    fn a_failed_rejoin_is_tried_again_after_a_growing_wait() {
        let fenced = ClusterState::default().apply(&Change::Fence(A)).unwrap();
        let mut care = FencedCare::default();
        let answering = [node(A, true, false)];
        let stopped = [node(A, false, false)];
        assert_eq!(care.to_seal(&fenced, &answering), [A]);
        assert!(care.sealed(&answering[0]));
        assert!(
            care.to_retry(&fenced, &answering, 0).is_empty(),
            "nothing failed"
        );
        assert_eq!(care.rejoin_failed(A, 1_000), REJOIN_RETRY_FIRST_MS);
        assert!(
            care.to_seal(&fenced, &answering).is_empty(),
            "sealed already"
        );
        assert!(care.to_retry(&fenced, &stopped, 5_999).is_empty(), "waits");
        assert!(
            care.to_retry(&fenced, &[node(A, false, true)], 6_000)
                .is_empty(),
            "being rejoined by the operator"
        );
        assert_eq!(
            care.to_retry(&fenced, &stopped, 6_000),
            [A],
            "tried again, stopped or not"
        );
        assert!(
            care.to_retry(&fenced, &stopped, 100_000).is_empty(),
            "once, until it fails again"
        );
        assert_eq!(care.rejoin_failed(A, 6_000), 2 * REJOIN_RETRY_FIRST_MS);
        for _ in 0..10 {
            care.rejoin_failed(A, 0);
        }
        assert_eq!(care.rejoin_failed(A, 0), REJOIN_RETRY_MAX_MS, "bounded");
        // Rejoined after all: a later fencing starts over, from the first wait.
        let rejoined = fenced.apply(&Change::Unfence(A)).unwrap();
        assert!(care.to_seal(&rejoined, &answering).is_empty());
        assert_eq!(care.to_seal(&fenced, &answering), [A]);
        care.sealed(&answering[0]);
        assert_eq!(care.rejoin_failed(A, 0), REJOIN_RETRY_FIRST_MS);
    }
}
