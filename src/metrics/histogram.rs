//! A histogram of durations that requests observe without a lock.
//!
//! `prometheus_client`'s histogram takes a mutex and walks its buckets in
//! order for every observation; two of them are observed per proxied
//! request (the decision's and the upstream's latency). This one keeps a
//! counter per bucket, finds the bucket by a binary search over its bounds
//! in nanoseconds, and adds to the sum with one atomic add: three relaxed
//! atomic operations. Its exposition is the same as the library's, with the
//! same bounds: the total count is the sum of the buckets' counts when
//! scraped, so a scrape never shows a count that its buckets disagree with.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// Durations by bucket; cloning shares the counts.
#[derive(Debug, Clone)]
pub struct Histogram(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// Upper bounds (inclusive) in seconds, as exposed.
    bounds: Box<[f64]>,
    /// The same in nanoseconds, searched when observing.
    bounds_ns: Box<[u64]>,
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    counts: Box<[AtomicU64]>,
    /// The sum of the observations, in nanoseconds.
    sum_ns: AtomicU64,
}

impl Histogram {
    /// A histogram with these upper bounds, in seconds, ascending (`+Inf`
    /// is always the last; others not finite are left out, as the library
    /// does).
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let bounds: Box<[f64]> = bounds.into_iter().filter(|b| b.is_finite()).collect();
        let bounds_ns = bounds
            .iter()
            .map(|&b| Duration::try_from_secs_f64(b).map_or(u64::MAX, duration_ns))
            .collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        Self(Arc::new(Inner {
            bounds,
            bounds_ns,
            counts,
            sum_ns: AtomicU64::new(0),
        }))
    }

    /// Counts one observation of `took`.
    pub fn observe(&self, took: Duration) {
        let ns = duration_ns(took);
        let inner = &*self.0;
        let bucket = inner.bounds_ns.partition_point(|&bound| bound < ns);
        if let Some(count) = inner.counts.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        inner.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// Observations so far, and their sum in seconds.
    #[cfg(test)]
    fn totals(&self) -> (u64, f64) {
        let count = self
            .0
            .counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum();
        (count, self.0.sum_ns.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// `d` in whole nanoseconds, saturating (past 584 years).
fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // Per bucket, as the library's encoders take them (they sum them
        // into the cumulative counts they write); the last bound is `+Inf`.
        let inner = &*self.0;
        let mut count = 0;
        let buckets: Vec<(f64, u64)> = inner
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(inner.counts.iter())
            .map(|(bound, n)| {
                let n = n.load(Ordering::Relaxed);
                count += n;
                (bound, n)
            })
            .collect();
        let sum = inner.sum_ns.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::registry::Registry;

    #[test]
    fn exposes_what_the_library_histogram_exposes_for_the_same_observations() {
        let bounds = [0.001, 0.002_5, 0.005, 0.01, 0.025, 1.0];
        let ours = Histogram::new(bounds);
        let theirs = prometheus_client::metrics::histogram::Histogram::new(bounds);
        let seen = [
            Duration::from_micros(1),
            Duration::from_millis(1), // on a bound: in it, as the library does
            Duration::from_micros(2_400),
            Duration::from_millis(7),
            Duration::from_millis(24),
            Duration::from_millis(999),
            Duration::from_secs(3), // past every bound: +Inf only
        ];
        for took in seen {
            ours.observe(took);
            theirs.observe(took.as_secs_f64());
        }
        let text = |register: &dyn Fn(&mut Registry)| {
            let mut registry = Registry::default();
            register(&mut registry);
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
            out
        };
        let ours_text = text(&|r| r.register("latency", "how long", ours.clone()));
        let theirs_text = text(&|r| r.register("latency", "how long", theirs.clone()));
        // The sums differ in their last digits (nanoseconds against the
        // library's float additions); every other line is the same.
        let without_sum = |t: &str| {
            t.lines()
                .filter(|l| !l.starts_with("latency_sum"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        assert_eq!(without_sum(&ours_text), without_sum(&theirs_text));
        assert!(ours_text.contains("latency_bucket{le=\"0.001\"} 2"));
        assert!(ours_text.contains("latency_bucket{le=\"+Inf\"} 7"));
        let (count, sum) = ours.totals();
        assert_eq!(count, 7);
        assert!((sum - 4.033_401).abs() < 1e-9, "{sum}");
    }
}
