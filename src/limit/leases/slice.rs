//! A slice in hand: what it holds, what the answers report while it
//! lasts, and when it is up.

use std::time::{Duration, Instant};

use super::ms_between;

/// A slice in hand.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slice {
    /// Units not spent yet.
    pub left: u64,
    /// Units it took from the store.
    pub size: u64,
    /// When the store counted it (ms, the store's clock): what its
    /// settlement names.
    pub at_ms: u64,
    /// When it was asked for, on this instance's clock.
    pub taken: Instant,
    /// When it is up whatever is spent from it: four intervals after it
    /// was taken, or its window's end.
    pub ends: Instant,
    /// When a request last spent from it: it is also up an interval
    /// after that (units nobody spends go back).
    pub spent: Instant,
    /// Whether `ends` is its window's end.
    pub at_window_end: bool,
    /// What the store said remained after it, and when it next adds units
    /// (ms from `taken`): what the answers report meanwhile.
    pub remaining: u64,
    pub next_ms: u64,
}

impl Slice {
    /// When it is up: at its end, or when nobody spent from it for an
    /// `interval`.
    pub fn lapses(&self, interval: Duration) -> Instant {
        self.ends.min(self.spent + interval)
    }

    /// Whether it ends at its window's end, not before: what it did not
    /// spend is then lost, not given back.
    pub fn ends_with_window(&self, now: Instant) -> bool {
        self.at_window_end && now >= self.ends
    }
}

/// Units a millisecond `slice` spent from `taken` to `now`.
pub(super) fn spent_rate(slice: &Slice, now: Instant) -> f64 {
    let elapsed = ms_between(slice.taken, now).max(1);
    (slice.size - slice.left) as f64 / elapsed as f64
}
