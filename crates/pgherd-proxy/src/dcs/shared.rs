//! The cluster view as the instances share it in etcd: nodes by name (node ids are each
//! process's own), written by the leader and adopted whole by the others.

use std::collections::BTreeSet;

use pgherd_failover::{ClusterState, NodeId, SyncInForce, SyncSet};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedView {
    /// The instance that wrote it, and the lease it led with (a restarted instance is a new
    /// leader under the same name).
    pub leader: String,
    pub lease: i64,
    pub version: u64,
    pub epoch: u64,
    pub elected: Option<String>,
    pub elected_at_lsn: Option<u64>,
    pub promoting: Option<String>,
    pub fenced: Vec<String>,
    pub detached: Vec<String>,
    pub sync: Option<SharedSync>,
    pub sync_pending: bool,
    pub strict_without_standby: Option<String>,
    pub switching: bool,
    pub paused_all: bool,
    pub paused: Vec<String>,
    /// The leader waits out each instance's failsafe before a promotion: followers keep one
    /// only under such a leader (one of an earlier version would not wait for it).
    #[serde(default)]
    pub honours_failsafe: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedSync {
    pub primary: String,
    pub quorum: usize,
    pub standbys: Vec<String>,
    pub since_lsn: u64,
}

impl SharedView {
    pub fn of(
        state: &ClusterState,
        leader: &str,
        lease: i64,
        name_of: impl Fn(NodeId) -> String,
    ) -> Self {
        let names = |ids: &BTreeSet<NodeId>| ids.iter().map(|&id| name_of(id)).collect();
        SharedView {
            leader: leader.to_owned(),
            lease,
            version: state.version,
            epoch: state.epoch,
            elected: state.elected.map(&name_of),
            elected_at_lsn: state.elected_at_lsn,
            promoting: state.promoting.map(&name_of),
            fenced: names(&state.fenced),
            detached: names(&state.detached),
            sync: state.sync.as_ref().map(|sync| SharedSync {
                primary: name_of(sync.primary),
                quorum: sync.set.quorum,
                standbys: sync.set.standbys.clone(),
                since_lsn: sync.since_lsn,
            }),
            sync_pending: state.sync_pending,
            strict_without_standby: state.strict_without_standby.map(&name_of),
            switching: state.switching,
            paused_all: state.paused_all,
            paused: state.paused.iter().cloned().collect(),
            honours_failsafe: true,
        }
    }

    /// The view in this process's node ids; a node this instance's config does not have is an
    /// error (the instances' configs disagree).
    pub fn state(&self, id_of: impl Fn(&str) -> Option<NodeId>) -> Result<ClusterState, String> {
        let id = |name: &str| {
            id_of(name).ok_or_else(|| format!("the leader's view names node {name:?}, which this instance's config does not have"))
        };
        let ids = |names: &[String]| {
            names
                .iter()
                .map(|n| id(n))
                .collect::<Result<BTreeSet<_>, _>>()
        };
        Ok(ClusterState {
            version: self.version,
            epoch: self.epoch,
            elected: self.elected.as_deref().map(id).transpose()?,
            elected_at_lsn: self.elected_at_lsn,
            promoting: self.promoting.as_deref().map(id).transpose()?,
            fenced: ids(&self.fenced)?,
            detached: ids(&self.detached)?,
            sync: match &self.sync {
                Some(sync) => Some(SyncInForce {
                    primary: id(&sync.primary)?,
                    set: SyncSet {
                        quorum: sync.quorum,
                        standbys: sync.standbys.clone(),
                    },
                    since_lsn: sync.since_lsn,
                }),
                None => None,
            },
            sync_pending: self.sync_pending,
            strict_without_standby: self.strict_without_standby.as_deref().map(id).transpose()?,
            switching: self.switching,
            paused_all: self.paused_all,
            paused: self.paused.iter().cloned().collect(),
            // The leader's view: it has one, and a lease.
            awaiting_view: false,
            lease_lapsed: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pgherd_failover::Change;

    #[test]
    fn a_view_goes_through_names_and_json_and_comes_back_the_same() {
        let names = ["pg1", "pg2", "pg3"];
        let mut state = ClusterState::default();
        for change in [
            Change::Elect {
                node: NodeId(0),
                at_lsn: 7,
            },
            Change::Elect {
                node: NodeId(1),
                at_lsn: 99,
            },
            Change::Fence(NodeId(0)),
            Change::Detach(NodeId(2)),
            Change::SyncInForce(Some(SyncInForce {
                primary: NodeId(1),
                set: SyncSet {
                    quorum: 1,
                    standbys: vec!["pg3".to_owned()],
                },
                since_lsn: 99,
            })),
            Change::Pause(Some("app".to_owned())),
        ] {
            state = state.apply(&change).unwrap();
        }
        let shared = SharedView::of(&state, "a", 7, |id| names[id.0 as usize].to_owned());
        let json = serde_json::to_string(&shared).unwrap();
        let back: SharedView = serde_json::from_str(&json).unwrap();
        let id_of = |n: &str| names.iter().position(|m| *m == n).map(|i| NodeId(i as u32));
        assert_eq!(back.state(id_of).unwrap(), state);
        let unknown = back.state(|n| (n != "pg3").then(|| id_of(n)).flatten());
        assert!(unknown.unwrap_err().contains("\"pg3\""));
    }
}
