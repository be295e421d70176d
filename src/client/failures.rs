//! How many failed credentials an address may send: a route that rejects
//! requests without a valid bearer token answers each forged one after a
//! signature check, which costs far more than the answer. Past
//! `failures_per_minute` failures from one address in a minute, tokens it
//! sends that are not already known to be valid are refused at once,
//! without a check, until the minute ends.
//!
//! Fixed memory: addresses share [`SLOTS`] counters by a keyed hash, so a
//! flood of addresses cannot grow it; two addresses that share a slot share
//! a budget.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters the addresses share.
pub const SLOTS: usize = 4_096;
/// The window the budget counts in.
const WINDOW_MS: u64 = 60_000;

/// Failed credentials per address and minute, counted.
pub struct Failures {
    /// Most failures an address may send in a minute.
    limit: u32,
    /// Per slot: the minute (since the epoch) in the high 40 bits, the
    /// failures in it in the low 24.
    slots: Box<[AtomicU64]>,
    seed: RandomState,
}

impl Failures {
    /// At most `limit` failures per address and minute.
    pub fn new(limit: u32) -> Self {
        Self {
            limit,
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            seed: RandomState::new(),
        }
    }

    /// The budget per address and minute.
    pub fn limit(&self) -> u32 {
        self.limit
    }

    fn slot(&self, address: IpAddr) -> &AtomicU64 {
        &self.slots[(self.seed.hash_one(address) as usize) % SLOTS]
    }

    /// `None` while `address` may still have a token checked at `now_ms`;
    /// else how long until it may again, in milliseconds.
    pub fn spent(&self, address: IpAddr, now_ms: u64) -> Option<u64> {
        let minute = now_ms / WINDOW_MS;
        let cell = self.slot(address).load(Ordering::Relaxed);
        let (at, count) = (cell >> 24, cell & 0xFF_FFFF);
        (at == minute && count >= u64::from(self.limit)).then(|| (minute + 1) * WINDOW_MS - now_ms)
    }

    /// Counts one failure of `address` at `now_ms`.
    pub fn count(&self, address: IpAddr, now_ms: u64) {
        let minute = now_ms / WINDOW_MS;
        let slot = self.slot(address);
        let mut current = slot.load(Ordering::Relaxed);
        loop {
            let (at, count) = (current >> 24, current & 0xFF_FFFF);
            let next = if at == minute {
                (minute << 24) | (count + 1).min(0xFF_FFFF)
            } else {
                (minute << 24) | 1
            };
            match slot.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }
}

impl std::fmt::Debug for Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Failures({} per address and minute)", self.limit)
    }
}

impl PartialEq for Failures {
    fn eq(&self, other: &Self) -> bool {
        self.limit == other.limit
    }
}

impl Eq for Failures {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_past_its_budget_waits_for_the_next_minute_and_others_do_not() {
        let failures = Failures::new(3);
        let (a, b): (IpAddr, IpAddr) = ([192, 0, 2, 1].into(), [192, 0, 2, 2].into());
        let now = 1_000 * WINDOW_MS + 15_000;
        for _ in 0..3 {
            assert_eq!(failures.spent(a, now), None);
            failures.count(a, now);
        }
        assert_eq!(failures.spent(a, now), Some(45_000));
        // Another address keeps its own budget (unless it shares the slot).
        if !std::ptr::eq(failures.slot(a), failures.slot(b)) {
            assert_eq!(failures.spent(b, now), None);
        }
        // The next minute starts afresh.
        assert_eq!(failures.spent(a, now + 45_000), None);
    }
}
