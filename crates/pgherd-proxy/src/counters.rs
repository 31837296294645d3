//! Counters many sessions update at once, for the metrics: event counts and a fixed-bucket
//! latency histogram, striped by thread so that workers never write the same cache line
//! (relaxed atomic adds on the thread's own stripe, summed when read; no lock, no
//! allocation), and errors by SQLSTATE class (rare, so behind a lock).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// Upper bounds of the buckets, in microseconds (100 µs to 10 s); anything slower lands in
/// the implicit `+Inf` bucket.
pub const BOUNDS_US: [u64; 16] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// Stripes per counter. Threads beyond this many share stripes (still correct, only no
/// longer free of shared writes); pgherd's workers are far fewer on machines it targets.
pub const STRIPES: usize = 8;

/// A value alone on its cache line (two lines: adjacent-line prefetch pairs them).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

static NEXT_STRIPE: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's stripe, handed out in turn as threads first count something.
    static STRIPE: usize = NEXT_STRIPE.fetch_add(1, Ordering::Relaxed) % STRIPES;
}

/// The calling thread's stripe (0 if its thread-locals are being torn down).
pub fn stripe() -> usize {
    STRIPE.try_with(|s| *s).unwrap_or(0)
}

/// A count written by every transaction: each thread adds to its own stripe, readers sum.
#[derive(Debug, Default)]
pub struct StripedCounter([Padded<AtomicU64>; STRIPES]);

impl StripedCounter {
    pub fn add(&self, n: u64) {
        self.0[stripe()].0.fetch_add(n, Ordering::Relaxed);
    }

    pub fn sum(&self) -> u64 {
        self.0.iter().map(|s| s.0.load(Ordering::Relaxed)).sum()
    }

    /// Counts one on the calling thread's stripe and returns that stripe's count before it:
    /// a ticket each thread cycles through on its own, so round-robin spreads each worker's
    /// requests without a line every worker writes.
    pub fn next_on_this_thread(&self) -> u64 {
        self.0[stripe()].0.fetch_add(1, Ordering::Relaxed)
    }
}

/// How many of something are held at once (server leases on a node), taken and given back by
/// every transaction: a thread takes on its own stripe, and a holder gives back on the stripe
/// it took from (a task may have moved to another thread meanwhile). So each stripe stays
/// exact, and a sum counts everything held throughout the time it reads.
#[derive(Debug, Default)]
pub struct StripedGauge([Padded<AtomicU32>; STRIPES]);

/// Where a holder of a [`StripedGauge`] counted itself, to give back there.
#[derive(Debug, Clone, Copy)]
pub struct GaugeStripe(usize);

impl StripedGauge {
    pub fn take(&self) -> GaugeStripe {
        let stripe = stripe();
        self.0[stripe].0.fetch_add(1, Ordering::Relaxed);
        GaugeStripe(stripe)
    }

    pub fn give_back(&self, taken: GaugeStripe) {
        self.0[taken.0].0.fetch_sub(1, Ordering::Relaxed);
    }

    pub fn sum(&self) -> u32 {
        self.0
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0, u32::saturating_add)
    }
}

#[derive(Debug, Default)]
struct HistogramStripe {
    /// Observations per bucket (not cumulative); the last one is `+Inf`.
    buckets: [AtomicU64; BOUNDS_US.len() + 1],
    sum_us: AtomicU64,
}

#[derive(Debug, Default)]
pub struct Histogram([Padded<HistogramStripe>; STRIPES]);

impl Histogram {
    pub fn observe(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_US.partition_point(|&bound| bound < us);
        let stripe = &self.0[stripe()].0;
        stripe.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        stripe.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Microseconds observed in all.
    pub fn sum_us(&self) -> u64 {
        self.0
            .iter()
            .map(|s| s.0.sum_us.load(Ordering::Relaxed))
            .fold(0, u64::saturating_add)
    }

    /// Observations per bucket, summed over the stripes.
    fn counts(&self) -> [u64; BOUNDS_US.len() + 1] {
        let mut counts = [0; BOUNDS_US.len() + 1];
        for stripe in &self.0 {
            for (count, bucket) in counts.iter_mut().zip(&stripe.0.buckets) {
                *count += bucket.load(Ordering::Relaxed);
            }
        }
        counts
    }

    /// The `q` quantile (0 < q ≤ 1) of what was observed, in microseconds, estimated as
    /// Prometheus's `histogram_quantile` does: linear within the bucket it falls in (so only
    /// as fine as the buckets). `None` before the first observation; the last bound when it
    /// falls beyond 10 s.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        quantile_of(&self.counts(), q)
    }

    /// Cumulative counts per bound (seconds), ending with `+Inf`; and the sum in seconds.
    pub fn snapshot(&self) -> (Vec<(f64, u64)>, f64) {
        let mut cumulative = 0;
        let mut out = Vec::with_capacity(BOUNDS_US.len() + 1);
        for (i, count) in self.counts().iter().enumerate() {
            cumulative += count;
            let bound = BOUNDS_US.get(i).map_or(f64::INFINITY, |&b| b as f64 / 1e6);
            out.push((bound, cumulative));
        }
        (out, self.sum_us() as f64 / 1e6)
    }
}

/// [`Histogram::quantile_us`] over per-bucket counts (the last one `+Inf`).
fn quantile_of(counts: &[u64], q: f64) -> Option<u64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (i, &count) in counts.iter().enumerate() {
        if count > 0 && (below + count) as f64 >= rank {
            let Some(&upper) = BOUNDS_US.get(i) else {
                return BOUNDS_US.last().copied();
            };
            let lower = if i == 0 { 0 } else { BOUNDS_US[i - 1] };
            let within = (rank - below as f64) / count as f64;
            return Some(lower + ((upper - lower) as f64 * within).round() as u64);
        }
        below += count;
    }
    BOUNDS_US.last().copied()
}

/// Errors by SQLSTATE class (the code's first two characters).
#[derive(Debug, Default)]
pub struct ErrorClasses(parking_lot::Mutex<std::collections::BTreeMap<[u8; 2], u64>>);

impl ErrorClasses {
    pub fn count(&self, code: &pgherd_wire::SqlState) {
        if let [a, b, ..] = code.code().as_bytes() {
            *self.0.lock().entry([*a, *b]).or_default() += 1;
        }
    }

    /// (class, count), classes in order.
    pub fn snapshot(&self) -> Vec<(String, u64)> {
        self.0
            .lock()
            .iter()
            .map(|(class, n)| (String::from_utf8_lossy(class).into_owned(), *n))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn observations_land_in_the_first_bucket_that_holds_them() {
        let h = Histogram::default();
        for us in [0, 100, 101, 999, 1_000, 20_000_000] {
            h.observe(Duration::from_micros(us));
        }
        let (buckets, sum) = h.snapshot();
        let count = |bound: f64| buckets.iter().find(|(b, _)| *b == bound).map(|(_, n)| *n);
        assert_eq!(
            count(0.0001),
            Some(2),
            "0 and 100 µs: le=100µs is inclusive"
        );
        assert_eq!(count(0.00025), Some(3));
        assert_eq!(count(0.001), Some(5));
        assert_eq!(count(10.0), Some(5));
        assert_eq!(buckets.last(), Some(&(f64::INFINITY, 6)));
        assert!((sum - (0.0 + 0.0001 + 0.000101 + 0.000999 + 0.001 + 20.0)).abs() < 1e-9);
    }

    #[test]
    fn stripes_written_by_several_threads_sum_on_read() {
        let counter = StripedCounter::default();
        let histogram = Histogram::default();
        std::thread::scope(|scope| {
            for _ in 0..STRIPES + 3 {
                let (counter, histogram) = (&counter, &histogram);
                scope.spawn(move || {
                    for _ in 0..1_000 {
                        counter.add(2);
                        histogram.observe(Duration::from_micros(300));
                    }
                });
            }
        });
        assert_eq!(counter.sum(), 2 * 1_000 * (STRIPES as u64 + 3));
        let (buckets, sum) = histogram.snapshot();
        assert_eq!(
            buckets.last(),
            Some(&(f64::INFINITY, 1_000 * (STRIPES as u64 + 3)))
        );
        assert!((sum - 0.0003 * 1_000.0 * (STRIPES as f64 + 3.0)).abs() < 1e-6);
    }

    #[test]
    fn a_gauge_given_back_on_another_thread_stays_exact_on_every_stripe() {
        let gauge = StripedGauge::default();
        let taken: Vec<GaugeStripe> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..STRIPES + 3)
                .map(|_| scope.spawn(|| (0..10).map(|_| gauge.take()).collect::<Vec<_>>()))
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().expect("a thread that takes"))
                .collect()
        });
        assert_eq!(gauge.sum(), 10 * (STRIPES as u32 + 3));
        // Given back from other threads (tasks move between workers), each on its own stripe.
        let (first, rest) = taken.split_at(5);
        std::thread::scope(|scope| {
            scope.spawn(|| rest.iter().for_each(|&t| gauge.give_back(t)));
        });
        assert_eq!(gauge.sum(), 5);
        for stripe in &gauge.0 {
            assert!(stripe.0.load(Ordering::Relaxed) <= 10, "no stripe wrapped");
        }
        first.iter().for_each(|&t| gauge.give_back(t));
        assert_eq!(gauge.sum(), 0);
    }

    #[test]
    fn next_on_this_thread_cycles_per_thread() {
        let tickets = StripedCounter::default();
        let mine: Vec<u64> = (0..4).map(|_| tickets.next_on_this_thread()).collect();
        assert_eq!(mine, [0, 1, 2, 3]);
        let other = std::thread::scope(|scope| {
            scope
                .spawn(|| tickets.next_on_this_thread())
                .join()
                .expect("another thread")
        });
        // Another thread's stripe starts at 0 unless it shares this one's (beyond STRIPES).
        assert!(other == 0 || other == 4, "{other}");
        assert_eq!(tickets.sum(), 5);
    }

    #[test]
    fn errors_count_by_class() {
        let e = ErrorClasses::default();
        e.count(&pgherd_wire::SqlState::QUERY_CANCELED);
        e.count(&pgherd_wire::SqlState::ADMIN_SHUTDOWN);
        e.count(&pgherd_wire::SqlState::SYNTAX_ERROR);
        assert_eq!(
            e.snapshot(),
            vec![("42".to_owned(), 1), ("57".to_owned(), 2)]
        );
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket() {
        let h = Histogram::default();
        assert_eq!(h.quantile_us(0.5), None);
        // 100 observations of 300 µs land in (250, 500]: the median is halfway through it.
        for _ in 0..100 {
            h.observe(Duration::from_micros(300));
        }
        assert_eq!(h.quantile_us(0.5), Some(375));
        assert_eq!(h.quantile_us(1.0), Some(500));
        // One slow outlier moves the maximum, hardly the median or p99.
        h.observe(Duration::from_secs(2));
        assert_eq!(h.quantile_us(0.5), Some(376));
        assert_eq!(h.quantile_us(0.99), Some(500));
        assert_eq!(h.quantile_us(1.0), Some(2_500_000));
        // Beyond the last bound: the last bound, not a made-up figure.
        h.observe(Duration::from_secs(60));
        assert_eq!(h.quantile_us(1.0), Some(10_000_000));
    }
}
