//! Which node serves a read, and how far behind a replica is. Pure: the caller passes the
//! time, the turn counter and what it knows of each node, so every choice can be replayed in a
//! test.

use std::collections::VecDeque;

/// A WAL position, as PostgreSQL's `pg_lsn`.
pub type Lsn = u64;

/// Parses PostgreSQL's text form of an LSN, `16/B374D848`.
pub fn parse_lsn(text: &str) -> Option<Lsn> {
    let (high, low) = text.split_once('/')?;
    let high = u32::from_str_radix(high, 16).ok()?;
    let low = u32::from_str_radix(low, 16).ok()?;
    Some((u64::from(high) << 32) | u64::from(low))
}

pub fn format_lsn(lsn: Lsn) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

const WAL_PAGE_BYTES: u64 = 8192;
const WAL_SEGMENT_BYTES: u64 = 16 << 20;
const SHORT_PAGE_HEADER_BYTES: u64 = 24;
const LONG_PAGE_HEADER_BYTES: u64 = 40;

/// `pg_current_wal_insert_lsn()` points past the header of a page nothing was written to yet,
/// while a replica that replayed everything before that page reports the page boundary. No
/// record ends inside a page header, so the boundary is where the inserted WAL really ends.
/// Assumes the default 8 KiB pages and 16 MiB segments.
pub fn insert_lsn_as_end(lsn: Lsn) -> Lsn {
    if lsn % WAL_SEGMENT_BYTES == LONG_PAGE_HEADER_BYTES {
        lsn - LONG_PAGE_HEADER_BYTES
    } else if lsn % WAL_PAGE_BYTES == SHORT_PAGE_HEADER_BYTES
        && lsn % WAL_SEGMENT_BYTES != SHORT_PAGE_HEADER_BYTES
    {
        lsn - SHORT_PAGE_HEADER_BYTES
    } else {
        lsn
    }
}

/// The primary's WAL position over time, to turn a replica's replay position into a delay.
#[derive(Debug, Clone)]
pub struct LsnHistory {
    /// (when seen, in ms on the caller's clock; LSN), oldest first, LSNs increasing.
    samples: VecDeque<(u64, Lsn)>,
    capacity: usize,
}

impl LsnHistory {
    pub fn new(capacity: usize) -> Self {
        LsnHistory {
            samples: VecDeque::new(),
            capacity: capacity.max(2),
        }
    }

    /// Records the primary's position; unchanged positions keep their first sighting, so an
    /// idle primary does not push old history out.
    pub fn record(&mut self, at_ms: u64, lsn: Lsn) {
        match self.samples.back() {
            Some(&(_, last)) if lsn <= last => return,
            _ => {}
        }
        if self.samples.len() == self.capacity {
            self.samples.pop_front();
        }
        self.samples.push_back((at_ms, lsn));
    }

    pub fn latest(&self) -> Option<Lsn> {
        self.samples.back().map(|&(_, lsn)| lsn)
    }

    /// Forgets everything (the primary changed).
    pub fn clear(&mut self) {
        self.samples.clear();
    }

    /// How long ago the primary first had WAL that a replica at `replay` has not replayed:
    /// 0 when it has replayed everything seen. Underestimates by up to one sampling period.
    pub fn lag_ms(&self, replay: Lsn, now_ms: u64) -> u64 {
        self.samples
            .iter()
            .find(|&&(_, lsn)| lsn > replay)
            .map_or(0, |&(at, _)| now_ms.saturating_sub(at))
    }

    /// Bytes of WAL between the primary's last seen position and `replay`.
    pub fn lag_bytes(&self, replay: Lsn) -> u64 {
        self.latest()
            .map_or(0, |latest| latest.saturating_sub(replay))
    }
}

/// How reads are spread over the nodes that may serve them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    RoundRobin,
    /// The node with the fewest sessions running a statement on it right now.
    LeastOutstanding,
    /// In proportion to each node's `weight`.
    Weighted,
    Random,
}

impl Balance {
    pub fn parse(s: &str) -> Option<Balance> {
        Some(match s {
            "round_robin" => Balance::RoundRobin,
            "least_outstanding" => Balance::LeastOutstanding,
            "weighted" => Balance::Weighted,
            "random" => Balance::Random,
            _ => return None,
        })
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Balance::RoundRobin => "round_robin",
            Balance::LeastOutstanding => "least_outstanding",
            Balance::Weighted => "weighted",
            Balance::Random => "random",
        }
    }
}

/// What the chooser knows about one node that may serve reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub weight: u32,
    /// Sessions running a statement on the node right now.
    pub outstanding: u32,
    /// How far the node has replayed; `None` for the primary (it has everything).
    pub replay_lsn: Option<Lsn>,
    pub lag_bytes: u64,
    pub lag_ms: u64,
    /// Up, in the read set, and in the right role.
    pub healthy: bool,
}

/// The limits a read puts on the node that serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Requirement {
    /// 0 disables.
    pub max_lag_bytes: u64,
    /// 0 disables.
    pub max_lag_ms: u64,
    /// The node must have replayed at least this far (the session's last write).
    pub min_lsn: Lsn,
}

/// Why no node was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoChoice {
    /// No candidate is healthy with a non-zero weight and within the lag limits.
    NoneQualifies,
    /// Candidates qualify except that none has replayed the session's write yet; the index is
    /// the one furthest ahead, worth waiting for.
    NotCaughtUp(usize),
}

impl Candidate {
    fn within_limits(&self, req: &Requirement) -> bool {
        self.healthy
            && self.weight > 0
            && (req.max_lag_bytes == 0 || self.lag_bytes <= req.max_lag_bytes)
            && (req.max_lag_ms == 0 || self.lag_ms <= req.max_lag_ms)
    }

    fn caught_up(&self, min_lsn: Lsn) -> bool {
        self.replay_lsn.is_none_or(|replay| replay >= min_lsn)
    }
}

/// Picks the node for a read. `ticket` is a counter shared by all sessions for round robin
/// and weighted (so the shares hold exactly over any window), a random number for random,
/// and breaks ties for least-outstanding.
pub fn choose(
    balance: Balance,
    candidates: &[Candidate],
    req: &Requirement,
    ticket: u64,
) -> Result<usize, NoChoice> {
    let qualifies = |c: &Candidate| c.within_limits(req) && c.caught_up(req.min_lsn);
    let count = candidates.iter().filter(|c| qualifies(c)).count() as u64;
    if count == 0 {
        let best_waiting = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| c.within_limits(req))
            .max_by_key(|(_, c)| c.replay_lsn.unwrap_or(Lsn::MAX));
        return Err(match best_waiting {
            Some((i, _)) => NoChoice::NotCaughtUp(i),
            None => NoChoice::NoneQualifies,
        });
    }
    let nth_qualifying = |n: u64| {
        candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| qualifies(c))
            .nth(n as usize)
            .map(|(i, _)| i)
    };
    let chosen = match balance {
        Balance::RoundRobin | Balance::Random => nth_qualifying(ticket % count),
        Balance::Weighted => {
            let total: u64 = candidates
                .iter()
                .filter(|c| qualifies(c))
                .map(|c| u64::from(c.weight))
                .sum();
            let mut point = ticket % total;
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| qualifies(c))
                .find(|(_, c)| {
                    let w = u64::from(c.weight);
                    if point < w {
                        true
                    } else {
                        point -= w;
                        false
                    }
                })
                .map(|(i, _)| i)
        }
        Balance::LeastOutstanding => {
            let least = candidates
                .iter()
                .filter(|c| qualifies(c))
                .map(|c| c.outstanding)
                .min()
                .unwrap_or(0);
            let tied = candidates
                .iter()
                .filter(|c| qualifies(c) && c.outstanding == least)
                .count() as u64;
            candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| qualifies(c) && c.outstanding == least)
                .nth((ticket % tied.max(1)) as usize)
                .map(|(i, _)| i)
        }
    };
    chosen.ok_or(NoChoice::NoneQualifies)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(weight: u32, replay: Lsn) -> Candidate {
        Candidate {
            weight,
            outstanding: 0,
            replay_lsn: Some(replay),
            lag_bytes: 0,
            lag_ms: 0,
            healthy: true,
        }
    }

    #[test]
    fn lsn_text_round_trips() {
        assert_eq!(parse_lsn("16/B374D848"), Some(0x16_B374_D848));
        assert_eq!(format_lsn(0x16_B374_D848), "16/B374D848");
        assert_eq!(parse_lsn("0/0"), Some(0));
        assert_eq!(parse_lsn("garbage"), None);
        assert_eq!(parse_lsn("1/"), None);
    }

    #[test]
    fn insert_position_at_a_page_start_means_the_page_boundary() {
        assert_eq!(insert_lsn_as_end(0x300_2018), 0x300_2000);
        assert_eq!(insert_lsn_as_end(0x300_0028), 0x300_0000);
        assert_eq!(insert_lsn_as_end(0x300_2030), 0x300_2030);
        assert_eq!(insert_lsn_as_end(0x300_0018), 0x300_0018);
    }

    #[test]
    fn lag_is_time_since_the_primary_first_had_unreplayed_wal() {
        let mut h = LsnHistory::new(8);
        h.record(1_000, 100);
        h.record(1_100, 100);
        h.record(1_200, 300);
        h.record(1_300, 500);
        assert_eq!(h.lag_ms(500, 1_400), 0);
        assert_eq!(h.lag_ms(300, 1_400), 100);
        assert_eq!(h.lag_ms(150, 1_400), 200);
        assert_eq!(h.lag_bytes(150), 350);
        for i in 0..20 {
            h.record(2_000 + i, 1_000 + i);
        }
        assert_eq!(h.samples.len(), 8);
        // Older than the history: at least as old as the oldest sample.
        assert_eq!(h.lag_ms(0, 2_100), 2_100 - 2_012);
    }

    #[test]
    fn weighted_shares_are_exact_over_a_window() {
        let nodes = [replica(1, 0), replica(3, 0), replica(0, 0)];
        let mut counts = [0; 3];
        for ticket in 0..400 {
            counts[choose(Balance::Weighted, &nodes, &Requirement::default(), ticket).unwrap()] +=
                1;
        }
        assert_eq!(counts, [100, 300, 0]);
    }

    #[test]
    fn round_robin_skips_unhealthy_and_lagging_nodes() {
        let mut nodes = [replica(1, 0), replica(1, 0), replica(1, 0)];
        nodes[1].healthy = false;
        nodes[2].lag_bytes = 1_000;
        let req = Requirement {
            max_lag_bytes: 100,
            ..Default::default()
        };
        for ticket in 0..5 {
            assert_eq!(choose(Balance::RoundRobin, &nodes, &req, ticket), Ok(0));
        }
        nodes[0].lag_ms = 9_000;
        let req = Requirement {
            max_lag_ms: 1_000,
            ..req
        };
        assert_eq!(
            choose(Balance::RoundRobin, &nodes, &req, 0),
            Err(NoChoice::NoneQualifies)
        );
    }

    #[test]
    fn reads_after_a_write_only_go_where_it_was_replayed() {
        let nodes = [replica(1, 90), replica(1, 120), replica(1, 80)];
        let req = Requirement {
            min_lsn: 100,
            ..Default::default()
        };
        for ticket in 0..6 {
            assert_eq!(choose(Balance::RoundRobin, &nodes, &req, ticket), Ok(1));
        }
        let req = Requirement {
            min_lsn: 200,
            ..Default::default()
        };
        assert_eq!(
            choose(Balance::RoundRobin, &nodes, &req, 0),
            Err(NoChoice::NotCaughtUp(1))
        );
        // The primary (no replay position) always has the write.
        let with_primary = [
            replica(1, 90),
            Candidate {
                replay_lsn: None,
                ..replica(1, 0)
            },
        ];
        assert_eq!(choose(Balance::RoundRobin, &with_primary, &req, 0), Ok(1));
    }

    #[test]
    fn least_outstanding_prefers_the_idlest_and_rotates_ties() {
        let mut nodes = [replica(1, 0), replica(1, 0), replica(1, 0)];
        nodes[0].outstanding = 5;
        nodes[1].outstanding = 2;
        nodes[2].outstanding = 2;
        let picks: Vec<usize> = (0..4)
            .map(|t| {
                choose(
                    Balance::LeastOutstanding,
                    &nodes,
                    &Requirement::default(),
                    t,
                )
                .unwrap()
            })
            .collect();
        assert_eq!(picks, [1, 2, 1, 2]);
    }
}
