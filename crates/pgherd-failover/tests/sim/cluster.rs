//! The modelled PostgreSQL cluster: what each node really is, which pgherd only sees through
//! checks, and how WAL flows and commits are acknowledged.

use pgherd_failover::observe::Sighting;
use pgherd_failover::{Lsn, SyncSet};
use rand::rngs::StdRng;
use rand::Rng;

/// The truth about one node.
#[derive(Debug, Clone)]
pub struct SimNode {
    pub alive: bool,
    pub writable: bool,
    pub timeline: u32,
    /// WAL this node holds (received, for a standby).
    pub lsn: Lsn,
    /// What it reports: equal to `lsn` except while a restarted standby replays the WAL it
    /// holds, when the received position it reports is from before that WAL (PostgreSQL
    /// reports the start of the segment it would stream from) and replay is still short of it.
    pub replayed: Lsn,
    pub reported_received: Lsn,
    pub upstream: Option<usize>,
    /// Cut off from every pgherd instance (they run side by side).
    pub cut_from_pgherd: bool,
    pub cut_from_cluster: bool,
    pub priority: u32,
    /// Has held all of its upstream's WAL at some point since it started following it: only
    /// then does PostgreSQL count it as a synchronous standby (walsender state `streaming`).
    pub caught_up: bool,
    /// Node setting `sync`: may be a synchronous standby (false: an asynchronous one, say in
    /// another zone).
    pub may_be_sync: bool,
    /// Holds WAL its upstream's timeline forked off before: PostgreSQL will not let it
    /// follow that upstream until it is rewound.
    pub diverged: bool,
    /// A rejoin (pg_rewind, then following the primary) works on it.
    pub rejoining: bool,
    /// Its `synchronous_standby_names`, as pgherd last set it on this node.
    pub sync_setting: Option<SyncSet>,
}

pub struct Cluster {
    pub nodes: Vec<SimNode>,
    pub names: Vec<String>,
}

impl Cluster {
    pub fn new(rng: &mut StdRng, count: usize) -> Cluster {
        let nodes = (0..count)
            .map(|i| SimNode {
                alive: true,
                writable: i == 0,
                timeline: 1,
                lsn: 0,
                replayed: 0,
                reported_received: 0,
                upstream: (i > 0).then_some(0),
                cut_from_pgherd: false,
                cut_from_cluster: false,
                priority: if rng.gen_bool(0.15) {
                    0
                } else {
                    rng.gen_range(1..4)
                },
                caught_up: true,
                may_be_sync: i == 0 || rng.gen_bool(0.8),
                diverged: false,
                rejoining: false,
                sync_setting: None,
            })
            .collect();
        Cluster {
            nodes,
            names: (0..count).map(|i| format!("pg{}", i + 1)).collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// pgherd can reach the node (health checks, SQL, writes).
    pub fn reachable(&self, i: usize) -> bool {
        self.nodes[i].alive && !self.nodes[i].cut_from_pgherd
    }

    pub fn streams(&self, replica: usize) -> bool {
        let r = &self.nodes[replica];
        let Some(u) = r.upstream else { return false };
        let up = &self.nodes[u];
        r.alive
            && !r.writable
            && !r.diverged
            // A restarted standby replays what it holds before it streams again.
            && r.replayed == r.lsn
            && up.alive
            && up.writable
            && !r.cut_from_cluster
            && !up.cut_from_cluster
            && up.timeline >= r.timeline
    }

    /// Node crashes and restarts, and links to pgherd or to the other nodes lost and back.
    pub fn faults(&mut self, rng: &mut StdRng) {
        let pick = rng.gen_range(0..self.nodes.len());
        let roll: f64 = rng.gen();
        let unreplayed = rng.gen_range(0..8000);
        let node = &mut self.nodes[pick];
        match roll {
            r if r < 0.03 => node.alive = false,
            r if r < 0.10 => {
                if !node.alive && !node.writable {
                    // Crash recovery: replays WAL on disk, reporting less than it holds.
                    node.replayed = node.lsn.saturating_sub(unreplayed);
                    node.reported_received = node.replayed - node.replayed % 4096;
                }
                node.alive = true;
            }
            r if r < 0.13 => node.cut_from_pgherd = true,
            r if r < 0.20 => node.cut_from_pgherd = false,
            r if r < 0.22 => node.cut_from_cluster = true,
            r if r < 0.29 => node.cut_from_cluster = false,
            _ => {}
        }
    }

    /// A write through pgherd on node `p`, if it takes it: the WAL grows; returns the position
    /// up to which commits are acknowledged there, as PostgreSQL acknowledges them under the
    /// node's own `synchronous_standby_names`: once `k` of its listed standbys that stream
    /// from it (and have caught up) hold them; by the primary alone with no set.
    pub fn write(&mut self, rng: &mut StdRng, p: usize) -> Option<Lsn> {
        let primary = &self.nodes[p];
        if !primary.alive || !primary.writable || primary.cut_from_pgherd {
            return None;
        }
        self.nodes[p].lsn += rng.gen_range(1..2000);
        Some(self.durable(p))
    }

    fn durable(&self, p: usize) -> Lsn {
        match self.nodes[p].sync_setting.as_ref() {
            Some(set) if !set.standbys.is_empty() => {
                let mut held: Vec<Lsn> = set
                    .standbys
                    .iter()
                    .filter_map(|name| self.names.iter().position(|n| n == name))
                    .filter(|&s| {
                        self.streams(s)
                            && self.nodes[s].upstream == Some(p)
                            && self.nodes[s].caught_up
                    })
                    .map(|s| self.nodes[s].lsn)
                    .collect();
                held.sort_unstable_by(|a, b| b.cmp(a));
                held.get(set.quorum.max(1) - 1)
                    .copied()
                    .unwrap_or(0)
                    .min(self.nodes[p].lsn)
            }
            _ => self.nodes[p].lsn,
        }
    }

    /// Replication for one period: streaming standbys receive, restarted ones replay.
    pub fn replicate(&mut self, rng: &mut StdRng) {
        for r in 0..self.nodes.len() {
            if self.streams(r) {
                let u = self.nodes[r].upstream.unwrap_or(r);
                let target = self.nodes[u].lsn;
                let step = rng.gen_range(0..3000);
                let node = &mut self.nodes[r];
                node.lsn = (node.lsn + step).min(target);
                node.replayed = node.lsn;
                node.reported_received = node.lsn;
                if node.lsn == target {
                    node.caught_up = true;
                }
            } else if self.nodes[r].alive && self.nodes[r].replayed < self.nodes[r].lsn {
                let step = rng.gen_range(0..2500);
                let node = &mut self.nodes[r];
                node.replayed = (node.replayed + step).min(node.lsn);
            }
        }
    }

    /// What a health check of node `i` returns, if it answers (`slow`: this check timed out).
    pub fn sighting(&self, i: usize, slow: bool) -> Option<Sighting> {
        let node = &self.nodes[i];
        if !self.reachable(i) || slow {
            return None;
        }
        Some(if node.writable {
            Sighting {
                primary: true,
                timeline: node.timeline,
                lsn: node.lsn,
                received_lsn: 0,
                upstream_alive: false,
            }
        } else {
            Sighting {
                primary: false,
                timeline: node.timeline,
                lsn: node.replayed,
                received_lsn: node.reported_received,
                upstream_alive: self.streams(i),
            }
        })
    }
}
