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

#[cfg(test)]
use std::sync::Arc;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::Action;

    /// The group of a configuration's only route, over three endpoints.
    fn group(balance: &str) -> Arc<Group> {
        let text = format!(
            r#"
[server]
listen = "127.0.0.1:0"

[upstreams.three]
endpoints = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
balance = "{balance}"
eject_after = 2
eject_for = "10s"

[[routes]]
name = "all"
upstream = "three"
"#
        );
        let config = crate::config::parse(std::path::Path::new("t.toml"), &text)
            .unwrap_or_else(|e| panic!("{e}"));
        let route = config.routes.iter().next().cloned();
        match route.as_deref().map(|r| &r.action) {
            Some(Action::Upstream(u)) => u.group.clone().unwrap_or_else(|| panic!("no group")),
            _ => panic!("no upstream"),
        }
    }

    fn picks(g: &Group, n: usize) -> Vec<usize> {
        (0..n).map(|_| g.pick(None)).collect()
    }

    #[test]
    fn idle_endpoints_take_turns_and_busy_ones_are_passed_over() {
        let g = group("least_in_flight");
        let chosen = picks(&g, 300);
        for i in 0..3 {
            let n = chosen.iter().filter(|&&c| c == i).count();
            assert!((60..=140).contains(&n), "endpoint {i} took {n} of 300");
        }
        // Two draws among three: an endpoint busier than both others is
        // never taken.
        let _busy: Vec<_> = (0..5).map(|_| g.begin(0)).collect();
        assert!(picks(&g, 100).iter().all(|&c| c != 0));
        let rr = group("round_robin");
        assert_eq!(picks(&rr, 6), [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn an_endpoint_failing_in_a_row_is_ejected_for_a_doubling_time_and_a_success_clears_it() {
        let g = group("round_robin");
        g.failed(1);
        assert!(picks(&g, 9).contains(&1), "one failure does not eject");
        g.failed(1);
        assert!(!picks(&g, 9).contains(&1), "two in a row do");
        let until = |i: usize| g.health[i].ejected_until.load(Ordering::Relaxed);
        let first = until(1) - crate::limit::now_ms();
        assert!((9_000..=10_000).contains(&first), "{first} ms");
        // Its ejection over (made so here), one more failure ejects it again
        // for twice as long.
        g.health[1].ejected_until.store(1, Ordering::Relaxed);
        g.failed(1);
        let second = until(1) - crate::limit::now_ms();
        assert!((19_000..=20_000).contains(&second), "{second} ms");
        g.succeeded(1);
        assert_eq!(until(1), 0);
        assert!(picks(&g, 9).contains(&1));
        g.failed(1);
        assert!(picks(&g, 9).contains(&1), "the record started afresh");
    }

    #[test]
    fn with_every_endpoint_ejected_the_one_back_soonest_is_used() {
        let g = group("least_in_flight");
        for i in 0..3 {
            g.failed(i);
            g.failed(i);
        }
        g.health[0].ejected_until.store(5, Ordering::Relaxed);
        // Ejection 0 "ended" at 5 ms since the epoch: it is usable again.
        assert!(picks(&g, 5).iter().all(|&c| c == 0));
        // All ejected: the one whose ejection ends first is used.
        let now = crate::limit::now_ms();
        for (i, ends) in [(0, now + 3_000), (1, now + 2_000), (2, now + 1_000)] {
            g.health[i].ejected_until.store(ends, Ordering::Relaxed);
        }
        assert!(picks(&g, 5).iter().all(|&c| c == 2));
        // Avoiding it (a retry), the next soonest.
        assert_eq!(g.pick(Some(2)), 1);
    }
}
