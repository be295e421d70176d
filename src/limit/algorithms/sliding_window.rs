//! The sliding window counter (`lua/sliding_window.lua`): the current
//! aligned window's count plus the previous window's, weighted by how much
//! of it the trailing window still covers:
//! `previous × (window − elapsed) / window + current + cost ≤ limit`,
//! compared in whole unit-milliseconds so no rounding admits extra units.

use super::{Counter, Properties};
use crate::limit::{Limit, Verdict};

/// A sliding window counts in aligned windows and weighs them in
/// unit-milliseconds.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: false,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: false,
    follows_calendar: false,
    bounded_by_unit_ms: true,
    tells_arrival: false,
};

/// Counts of the current and the previous aligned window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Start of the current window.
    start: u64,
    /// Units in the current window.
    current: u64,
    /// Units in the window before it.
    previous: u64,
}

impl Counter for State {
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        check((self.start, self.current, self.previous), limit, now, cost)
    }

    fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
        let counts = (&mut self.start, &mut self.current, &mut self.previous);
        consume(counts, limit, now, cost);
    }

    fn give_back(&mut self, limit: &Limit, (now, at): (u64, u64), _reserved: u64, back: u64) {
        let counts = (&mut self.start, &mut self.current, &mut self.previous);
        settle(counts, limit, (now, at), back);
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        expires_at(self.start, limit)
    }
}

/// Whether `cost` units fit at `now` beside the current and the previous
/// window's counts.
pub(super) fn check(
    (start, current, previous): (u64, u64, u64),
    limit: &Limit,
    now: u64,
    cost: u64,
) -> Verdict {
    let w = limit.window_ms;
    let (t, window_start, cur, prev) = seen_at(start, current, previous, now, w);
    let elapsed = t - window_start;
    // Exact in integers: prev × (w − elapsed)/w + cur + cost ≤ limit.
    let weighted = prev * (w - elapsed);
    let allowed = weighted + (cur + cost) * w <= limit.limit * w;
    let used = weighted.div_ceil(w) + cur + if allowed { cost } else { 0 };
    let remaining = limit.limit.saturating_sub(used);
    let counts = Counts {
        window_start,
        weighted,
        prev,
    };
    if allowed {
        Verdict {
            allowed,
            remaining,
            next_ms: counts.next_unit(w, now, cur + cost),
            retry_after_ms: 0,
        }
    } else {
        Verdict {
            allowed,
            remaining,
            next_ms: counts.next_unit(w, now, cur),
            retry_after_ms: counts.wait(limit, now, cur, cost),
        }
    }
}

/// What the waits are told from: the current window's start, and the
/// previous window's count, alone and weighted by its overlap.
struct Counts {
    window_start: u64,
    weighted: u64,
    prev: u64,
}

impl Counts {
    /// The wait from `now` until `cost` more units fit beside `cur`;
    /// asked only when they do not fit now.
    fn wait(&self, limit: &Limit, now: u64, cur: u64, cost: u64) -> u64 {
        let w = limit.window_ms;
        if cost > limit.limit {
            // Never fits: told the wait until the limit is whole again.
            return match (cur, self.prev) {
                (0, 0) => w,
                (0, _) => self.window_start + w - now,
                _ => self.window_start + 2 * w - now,
            };
        }
        if cur + cost <= limit.limit {
            // Later in this window, once enough of the previous one has slid out.
            let room = limit.limit - cost - cur;
            self.window_start + w - room * w / self.prev - now
        } else {
            // Not before the next window, where this one's count is the previous.
            let room = limit.limit - cost;
            (self.window_start + w - now) + (w - room * w / cur)
        }
    }

    /// The wait from `now` until the weighted count falls by a unit, with
    /// `cur` counted in this window; 0 when nothing is counted.
    fn next_unit(&self, w: u64, now: u64, cur: u64) -> u64 {
        if self.weighted > 0 {
            let counted = self.weighted.div_ceil(w);
            self.window_start + w - (counted - 1) * w / self.prev - now
        } else {
            // Falls in the next window: `cur` is then the previous one.
            match ((cur.saturating_sub(1)) * w).checked_div(cur) {
                Some(kept) => (self.window_start + w - now) + (w - kept),
                None => 0,
            }
        }
    }
}

/// Counts `cost` units at `now` in the current window.
pub(super) fn consume(
    (start, current, previous): (&mut u64, &mut u64, &mut u64),
    limit: &Limit,
    now: u64,
    cost: u64,
) {
    let (_, window_start, cur, prev) = seen_at(*start, *current, *previous, now, limit.window_ms);
    (*start, *current, *previous) = (window_start, cur + cost, prev);
}

/// Gives back `back` units reserved at `at`, from the count they went
/// into, while its window is the current or the previous one.
pub(super) fn settle(
    (start, current, previous): (&mut u64, &mut u64, &mut u64),
    limit: &Limit,
    (now, at): (u64, u64),
    back: u64,
) {
    let w = limit.window_ms;
    let (_, window_start, mut cur, mut prev) = seen_at(*start, *current, *previous, now, w);
    let reserved_in = at - at % w;
    if reserved_in == window_start {
        cur -= back.min(cur);
    } else if reserved_in + w == window_start {
        prev -= back.min(prev);
    } else {
        return;
    }
    (*start, *current, *previous) = (window_start, cur, prev);
}

/// When the current window stops mattering: two windows after its start.
pub(super) fn expires_at(start: u64, limit: &Limit) -> u64 {
    start + 2 * limit.window_ms
}

/// The time the counts are read at (the later of `now` and the state's
/// window start), that window's start, and its current and previous counts.
fn seen_at(start: u64, current: u64, previous: u64, now: u64, w: u64) -> (u64, u64, u64, u64) {
    let t = now.max(start);
    let window_start = t - t % w;
    let (cur, prev) = if start == window_start {
        (current, previous)
    } else if start + w == window_start {
        (0, current)
    } else {
        (0, 0)
    };
    (t, window_start, cur, prev)
}
