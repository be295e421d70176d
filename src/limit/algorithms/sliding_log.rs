//! The sliding log (`lua/sliding_log.lua`): at most `limit` units in any
//! trailing `window`, exactly, by keeping each admitted request's time and
//! units. Exact, and the most memory per client: the log is as long as
//! the requests admitted in a window.

use std::collections::VecDeque;

use super::{Counter, Properties};
use crate::limit::{Limit, Verdict};

/// A sliding log keeps each unit at the time it was admitted: units taken
/// ahead (a lease) would leave it before the requests that spend them, and
/// units given back now (a credit) have no entry to come off.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: false,
    can_lease: false,
    can_be_credited: false,
    keeps_window_totals: false,
    follows_calendar: false,
    bounded_by_unit_ms: true,
    tells_arrival: false,
};

/// Admitted requests still inside the trailing window, oldest first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// `(time admitted, units)` per admitted request.
    entries: VecDeque<(u64, u64)>,
    /// Sum of the units in `entries`.
    total: u64,
}

impl Counter for State {
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        check(&mut self.entries, &mut self.total, limit, now, cost)
    }

    fn consume(&mut self, _limit: &Limit, now: u64, cost: u64) {
        consume(&mut self.entries, &mut self.total, now, cost);
    }

    fn give_back(&mut self, limit: &Limit, (now, at): (u64, u64), _reserved: u64, back: u64) {
        settle(&mut self.entries, &mut self.total, limit, (now, at), back);
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        expires_at(&self.entries, limit)
    }
}

/// Whether `cost` units fit at `now` in the trailing window; forgets the
/// entries that left it.
pub(super) fn check(
    entries: &mut VecDeque<(u64, u64)>,
    total: &mut u64,
    limit: &Limit,
    now: u64,
    cost: u64,
) -> Verdict {
    let w = limit.window_ms;
    forget_expired(entries, total, now, w);
    let allowed = *total + cost <= limit.limit;
    // The next unit is free when the oldest counted leaves (this
    // request's own, when it is the first); nothing is to come back to
    // an empty log that this request leaves empty.
    let next_ms = match entries.front() {
        Some(&(t, _)) => (t + w).saturating_sub(now),
        None if allowed && cost > 0 => w,
        None => 0,
    };
    if allowed {
        return Verdict {
            allowed,
            remaining: limit.limit - *total - cost,
            next_ms,
            retry_after_ms: 0,
        };
    }
    let excess = *total + cost - limit.limit;
    Verdict {
        allowed,
        remaining: limit.limit.saturating_sub(*total),
        next_ms,
        retry_after_ms: wait_for(entries, excess, now, w),
    }
}

/// Forgets the entries that left the trailing window: an entry admitted
/// at `t` counts while now < t + w.
fn forget_expired(entries: &mut VecDeque<(u64, u64)>, total: &mut u64, now: u64, w: u64) {
    while let Some(&(t, units)) = entries.front() {
        if t.saturating_add(w) > now {
            break;
        }
        entries.pop_front();
        *total -= units;
    }
}

/// Until enough of the oldest units have left the window for `excess`
/// more to fit.
fn wait_for(entries: &VecDeque<(u64, u64)>, excess: u64, now: u64, w: u64) -> u64 {
    let mut freed = 0;
    for &(t, units) in entries {
        freed += units;
        if freed >= excess {
            return (t + w).saturating_sub(now);
        }
    }
    w
}

/// Logs `cost` units at `now`.
pub(super) fn consume(entries: &mut VecDeque<(u64, u64)>, total: &mut u64, now: u64, cost: u64) {
    // Nothing taken logs nothing, as the Lua twin adds no member.
    if cost == 0 {
        return;
    }
    // Keep the log ordered even if the clock stepped back.
    let t = entries.back().map_or(now, |&(last, _)| last.max(now));
    entries.push_back((t, cost));
    *total += cost;
}

/// Gives back `back` units reserved at `at`, from the entries logged at
/// `at`, while they are inside the trailing window.
pub(super) fn settle(
    entries: &mut VecDeque<(u64, u64)>,
    total: &mut u64,
    limit: &Limit,
    (now, at): (u64, u64),
    back: u64,
) {
    if at.saturating_add(limit.window_ms) <= now {
        return;
    }
    let mut left = back;
    for entry in entries.iter_mut().rev().filter(|e| e.0 == at) {
        let taken = left.min(entry.1);
        entry.1 -= taken;
        *total -= taken;
        left -= taken;
    }
    entries.retain(|&(_, units)| units > 0);
}

/// When the newest entry leaves the window.
pub(super) fn expires_at(entries: &VecDeque<(u64, u64)>, limit: &Limit) -> u64 {
    entries.back().map_or(0, |&(t, _)| t + limit.window_ms)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{admitted_across_a_boundary, limit, take};
    use crate::limit::Algorithm;
    use crate::limit::algorithms::State;

    #[test]
    fn sliding_log_admits_again_exactly_when_the_oldest_entry_leaves() {
        let l = limit(Algorithm::SlidingLog, 3, 1000);
        let mut s = State::new(l.algorithm);
        assert!(take(&mut s, &l, 100, 1).allowed);
        assert!(take(&mut s, &l, 400, 1).allowed);
        assert!(take(&mut s, &l, 700, 1).allowed);
        let v = take(&mut s, &l, 800, 1);
        assert!(!v.allowed);
        assert_eq!((v.retry_after_ms, v.next_ms), (300, 300));
        assert!(!take(&mut s, &l, 1099, 1).allowed);
        let v = take(&mut s, &l, 1100, 1);
        assert!(v.allowed);
        assert_eq!(v.remaining, 0);
        assert!(!take(&mut s, &l, 1399, 1).allowed);
        assert!(take(&mut s, &l, 1400, 1).allowed);
    }

    #[test]
    fn sliding_log_has_no_boundary_burst() {
        assert_eq!(admitted_across_a_boundary(Algorithm::SlidingLog), 5);
    }

    #[test]
    fn sliding_log_waits_for_enough_units_when_cost_is_large() {
        let l = limit(Algorithm::SlidingLog, 4, 1000);
        let mut s = State::new(l.algorithm);
        assert!(take(&mut s, &l, 0, 1).allowed);
        assert!(take(&mut s, &l, 100, 1).allowed);
        assert!(take(&mut s, &l, 200, 2).allowed);
        // 3 units must leave: the first two entries (1 + 1) are not enough.
        let v = take(&mut s, &l, 300, 3);
        assert!(!v.allowed);
        assert_eq!(v.retry_after_ms, 900);
        assert!(!take(&mut s, &l, 1199, 3).allowed);
        assert!(take(&mut s, &l, 1200, 3).allowed);
    }
}
