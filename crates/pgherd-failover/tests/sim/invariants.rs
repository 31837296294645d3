//! What must hold, checked against the modelled truth: writes and acknowledged commits on one
//! history, and every promotion decision.

use pgherd_failover::{Check, Durability, Lsn, Verdict, View};

use crate::Sim;

impl Sim {
    /// A write reached node `p` through instance `k`: writes move on to newer histories only,
    /// never back to a node another one has taken writes after (two primaries).
    pub(crate) fn written(&mut self, p: usize, k: usize) -> Result<(), String> {
        let timeline = self.cluster.nodes[p].timeline;
        if let Some((node, on_timeline, through)) = &self.last_written {
            if *node != p && timeline <= *on_timeline {
                return Err(format!(
                    "writes reached pg{} (timeline {timeline}) through {} after pg{} (timeline {on_timeline}) took writes through {through}: two primaries",
                    p + 1,
                    self.instances[k].name,
                    node + 1,
                ));
            }
        }
        self.last_written = Some((p, timeline, self.instances[k].name.clone()));
        Ok(())
    }

    /// Commits up to `durable` acknowledged on node `p`: they must extend the one history of
    /// acknowledged commits, never go back to a node that history left.
    pub(crate) fn acknowledged(&mut self, p: usize, durable: Lsn) -> Result<(), String> {
        let timeline = self.cluster.nodes[p].timeline;
        match self.acked_on {
            Some((node, _)) if node == p => self.acked = self.acked.max(durable),
            Some((node, on_timeline)) if timeline <= on_timeline && durable > 0 => {
                return Err(format!(
                    "commits acknowledged on pg{} (timeline {timeline}) after pg{} (timeline {on_timeline}) took them: two histories",
                    p + 1,
                    node + 1
                ));
            }
            _ if durable > 0 => {
                self.acked_on = Some((p, timeline));
                self.acked = self.acked.max(durable);
            }
            _ => {}
        }
        Ok(())
    }

    /// Invariants on a decision, checked against the truth.
    pub(crate) fn check(&self, view: &View, verdict: &Verdict) -> Result<(), String> {
        let Verdict::Promote { candidate, old, .. } = verdict else {
            return Ok(());
        };
        let (candidate, old) = (*candidate, *old);
        let nodes = &self.cluster.nodes;
        for (i, node) in view.nodes.iter().enumerate() {
            let answers = node.check != Check::Failed;
            if i != old && answers && self.cluster.streams(i) && nodes[i].upstream == Some(old) {
                return Err(format!(
                    "promoted pg{} while pg{} still streams from pg{}",
                    candidate + 1,
                    i + 1,
                    old + 1
                ));
            }
        }
        // Recompute the best candidate independently.
        let eligible = |i: usize| {
            let n = &view.nodes[i];
            let Check::Replica {
                received_lsn,
                replayed_lsn,
                ..
            } = n.check
            else {
                return None;
            };
            let received_lsn = received_lsn.max(replayed_lsn);
            let lag_ok = match (self.policy.durability, view.last_primary_lsn) {
                (Durability::Async, Some(p)) => {
                    p.saturating_sub(received_lsn) <= self.policy.max_lag_on_failover_bytes
                }
                (Durability::Async, None) => true,
                _ => view.synchronous.contains(&i),
            };
            (i != old && n.priority > 0 && !n.fenced && lag_ok).then_some(received_lsn)
        };
        let best = (0..view.nodes.len()).filter_map(eligible).max();
        if eligible(candidate).is_none() || eligible(candidate) != best {
            return Err(format!(
                "promoted pg{} ({:?}) but the best eligible position is {best:?}",
                candidate + 1,
                eligible(candidate)
            ));
        }
        if self.policy.durability.is_sync() {
            if !view.synchronous.contains(&candidate) {
                return Err(format!(
                    "sync mode promoted non-synchronous pg{}",
                    candidate + 1
                ));
            }
            if nodes[candidate].lsn < self.acked {
                return Err(format!(
                    "sync mode promoted pg{} at {} but {} was acknowledged: writes lost",
                    candidate + 1,
                    nodes[candidate].lsn,
                    self.acked
                ));
            }
        }
        Ok(())
    }
}
