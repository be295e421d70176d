//! Several endpoints behind one upstream: which one takes a request, and
//! which are left alone for a while because they keep failing.
//!
//! Choice is by the power of two choices on requests in flight (two
//! endpoints drawn, the less busy one taken; on a tie, the one not chosen
//! last, so that a lightly loaded pair alternates rather than drifting by
//! chance), or round robin. Health is passive: an endpoint whose connections fail
//! (refused, timed out) `eject_after` times in a row is ejected for
//! `eject_for`, doubled at each ejection in a row up to [`MAX_EJECTION`];
//! when that passes it takes requests again, and one more failure ejects
//! it at once while a success clears its record. Ejection never empties the
//! set: with every endpoint ejected, requests go to the one whose ejection
//! ends first.
//!
//! The state lives with the compiled configuration, so a reload starts
//! every endpoint afresh.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use crate::routes::Upstream;

/// Longest an endpoint stays ejected.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

/// How a group chooses among its endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// The less busy of two drawn at random.
    LeastInFlight,
    /// Each in turn.
    RoundRobin,
}

/// An upstream's endpoints and what is known of their health.
#[derive(Debug)]
pub struct Group {
    /// The endpoints, in configuration order.
    pub endpoints: Vec<Upstream>,
    health: Vec<Health>,
    balance: Balance,
    eject_after: u32,
    eject_for: Duration,
    turn: AtomicUsize,
    /// The endpoint chosen last.
    last: AtomicUsize,
}

#[derive(Debug, Default)]
struct Health {
    in_flight: AtomicUsize,
    failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds (of [`crate::limit::now_ms`]) until which it is
    /// ejected; 0 when it is not.
    ejected_until: AtomicU64,
}

/// A request in flight on an endpoint, counted until dropped.
#[derive(Debug)]
pub struct InFlight<'a>(&'a Health);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Group {
    /// A group of `endpoints` (at least one).
    pub fn new(
        endpoints: Vec<Upstream>,
        balance: Balance,
        eject_after: u32,
        eject_for: Duration,
    ) -> Self {
        let health = endpoints.iter().map(|_| Health::default()).collect();
        Self {
            endpoints,
            health,
            balance,
            eject_after: eject_after.max(1),
            eject_for,
            turn: AtomicUsize::new(0),
            last: AtomicUsize::new(usize::MAX),
        }
    }

    /// The endpoint to try next, other than `avoid` if there is another.
    pub fn pick(&self, avoid: Option<usize>) -> usize {
        let now = crate::limit::now_ms();
        let n = self.endpoints.len();
        let usable = |i: usize| {
            Some(i) != avoid && self.health[i].ejected_until.load(Ordering::Relaxed) <= now
        };
        let candidates: Vec<usize> = (0..n).filter(|&i| usable(i)).collect();
        if candidates.is_empty() {
            // All ejected (or the one left is to be avoided): the one whose
            // ejection ends first, preferring not `avoid`.
            return (0..n)
                .min_by_key(|&i| {
                    (
                        Some(i) == avoid && n > 1,
                        self.health[i].ejected_until.load(Ordering::Relaxed),
                    )
                })
                .unwrap_or(0);
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        match (self.balance, candidates.len()) {
            (_, 1) => candidates[0],
            (Balance::RoundRobin, c) => candidates[turn % c],
            (Balance::LeastInFlight, c) => {
                // Two distinct draws from a scrambled counter.
                let r = turn.wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as usize);
                let a = candidates[(r >> 7) % c];
                let b = candidates[((r >> 7) % c + 1 + (r >> 29) % (c - 1)) % c];
                let load = |i: usize| self.health[i].in_flight.load(Ordering::Relaxed);
                let chosen = match load(a).cmp(&load(b)) {
                    std::cmp::Ordering::Less => a,
                    std::cmp::Ordering::Greater => b,
                    std::cmp::Ordering::Equal if self.last.load(Ordering::Relaxed) == a => b,
                    std::cmp::Ordering::Equal => a,
                };
                self.last.store(chosen, Ordering::Relaxed);
                chosen
            }
        }
    }

    /// Counts a request in flight on endpoint `i` until the guard drops.
    pub fn begin(&self, i: usize) -> InFlight<'_> {
        let h = &self.health[i];
        h.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(h)
    }

    /// Endpoint `i` answered: its record is cleared.
    pub fn succeeded(&self, i: usize) {
        let h = &self.health[i];
        if h.failures.load(Ordering::Relaxed) != 0 || h.ejections.load(Ordering::Relaxed) != 0 {
            h.failures.store(0, Ordering::Relaxed);
            h.ejections.store(0, Ordering::Relaxed);
            h.ejected_until.store(0, Ordering::Relaxed);
            tracing::info!(endpoint = %self.endpoints[i].target, "upstream endpoint answers again");
        }
    }

    /// A connection to endpoint `i` failed or timed out.
    pub fn failed(&self, i: usize) {
        let h = &self.health[i];
        let failures = h.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < self.eject_after {
            return;
        }
        let now = crate::limit::now_ms();
        if h.ejected_until.load(Ordering::Relaxed) > now {
            return;
        }
        let ejections = h.ejections.fetch_add(1, Ordering::Relaxed);
        let interval = self
            .eject_for
            .saturating_mul(1 << ejections.min(16))
            .min(MAX_EJECTION);
        let until = now.saturating_add(u64::try_from(interval.as_millis()).unwrap_or(u64::MAX));
        h.ejected_until.store(until, Ordering::Relaxed);
        tracing::warn!(
            endpoint = %self.endpoints[i].target,
            failures,
            ejected_for = ?interval,
            "upstream endpoint ejected"
        );
    }
}
