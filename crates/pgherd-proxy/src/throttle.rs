//! Slowing down guessing: failed logins and cancel requests with a wrong secret, counted per
//! client address. Each failure from an address makes its next failure answer later (doubling
//! up to a ceiling), as PostgreSQL's `auth_delay` does with a fixed delay; an address that
//! stops failing is forgotten after a minute. Pure: the time is passed in.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

/// Failures older than this no longer count.
const FORGET_AFTER_MS: u64 = 60_000;
/// The delay doubles per recent failure up to this many times the base.
const MAX_FACTOR: u64 = 16;
/// Addresses remembered at most; the stalest are dropped beyond.
const MAX_ADDRESSES: usize = 10_000;
/// Failures of one address waiting for their answer at once, at most: beyond, new
/// connections from it are refused until some are answered, so parallel guesses cannot
/// outrun the delay or take every connection place.
pub const MAX_WAITING_PER_ADDRESS: u32 = 16;

#[derive(Debug, Clone, Copy)]
struct Record {
    failures: u32,
    last_ms: u64,
    /// Failures being answered late right now.
    waiting: u32,
}

/// Recent failures by address.
#[derive(Debug, Default)]
pub struct FailureLedger {
    records: HashMap<IpAddr, Record>,
}

impl FailureLedger {
    /// Records a failure at `now_ms` and says how long to wait before answering it, with
    /// `base_ms` the delay of a first failure; also how many failures the address has made
    /// recently (this one included).
    pub fn fail(&mut self, address: IpAddr, now_ms: u64, base_ms: u64) -> (Duration, u32) {
        if self.records.len() >= MAX_ADDRESSES && !self.records.contains_key(&address) {
            self.forget_stale(now_ms);
            if self.records.len() >= MAX_ADDRESSES {
                if let Some(stalest) = self
                    .records
                    .iter()
                    .min_by_key(|(_, r)| r.last_ms)
                    .map(|(a, _)| *a)
                {
                    self.records.remove(&stalest);
                }
            }
        }
        let record = self.records.entry(address).or_insert(Record {
            failures: 0,
            last_ms: now_ms,
            waiting: 0,
        });
        if now_ms.saturating_sub(record.last_ms) > FORGET_AFTER_MS {
            record.failures = 0;
        }
        record.failures = record.failures.saturating_add(1);
        record.last_ms = now_ms;
        let factor = 1u64 << (record.failures - 1).min(MAX_FACTOR.trailing_zeros());
        (
            Duration::from_millis(base_ms.saturating_mul(factor)),
            record.failures,
        )
    }

    /// A failure's delayed answer starts or ends.
    pub fn waiting(&mut self, address: IpAddr, starts: bool) {
        if let Some(record) = self.records.get_mut(&address) {
            record.waiting = if starts {
                record.waiting.saturating_add(1)
            } else {
                record.waiting.saturating_sub(1)
            };
        }
    }

    /// So many failures of `address` wait for their answer that new connections from it
    /// are refused.
    pub fn saturated(&self, address: IpAddr) -> bool {
        self.records
            .get(&address)
            .is_some_and(|r| r.waiting >= MAX_WAITING_PER_ADDRESS)
    }

    /// A successful login from `address` clears its record.
    pub fn succeed(&mut self, address: IpAddr) {
        self.records.remove(&address);
    }

    fn forget_stale(&mut self, now_ms: u64) {
        self.records
            .retain(|_, r| r.waiting > 0 || now_ms.saturating_sub(r.last_ms) <= FORGET_AFTER_MS);
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// Whether the `n`th recent failure from an address is worth a log line: the first, then
/// every power of ten, so a flood of guesses logs a handful of lines, not one per guess.
pub fn worth_logging(n: u32) -> bool {
    n == 1 || (n >= 10 && 10u32.pow(n.ilog10()) == n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn delays_double_per_recent_failure_up_to_a_ceiling() {
        let mut ledger = FailureLedger::default();
        let delays: Vec<u64> = (0..7)
            .map(|i| ledger.fail(ip(1), i * 100, 250).0.as_millis() as u64)
            .collect();
        assert_eq!(delays, [250, 500, 1000, 2000, 4000, 4000, 4000]);
        // Another address starts from the base.
        assert_eq!(ledger.fail(ip(2), 700, 250).0, Duration::from_millis(250));
        // A minute without failures: forgotten.
        assert_eq!(
            ledger.fail(ip(1), 700 + 60_001, 250).0,
            Duration::from_millis(250)
        );
        // A success clears the record.
        ledger.succeed(ip(1));
        assert_eq!(ledger.fail(ip(1), 70_000, 250).1, 1);
    }

    #[test]
    fn an_address_with_many_answers_waiting_is_saturated() {
        let mut ledger = FailureLedger::default();
        for _ in 0..MAX_WAITING_PER_ADDRESS {
            ledger.fail(ip(1), 0, 100);
            ledger.waiting(ip(1), true);
        }
        assert!(ledger.saturated(ip(1)));
        assert!(!ledger.saturated(ip(2)));
        ledger.waiting(ip(1), false);
        assert!(!ledger.saturated(ip(1)));
    }

    #[test]
    fn the_ledger_stays_bounded() {
        let mut ledger = FailureLedger::default();
        for i in 0..(MAX_ADDRESSES as u64 + 500) {
            let address = IpAddr::from((i as u128).to_be_bytes());
            ledger.fail(address, i, 1);
        }
        assert!(ledger.len() <= MAX_ADDRESSES);
    }

    #[test]
    fn logging_thins_out() {
        let logged: Vec<u32> = (1..=1000).filter(|&n| worth_logging(n)).collect();
        assert_eq!(logged, [1, 10, 100, 1000]);
    }
}
