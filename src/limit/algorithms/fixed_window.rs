//! The fixed window (`lua/fixed_window.lua`): at most `limit` units in each
//! window aligned to multiples of `window`, or between the boundaries of a
//! window by the calendar. It counts whole units (a count and what an
//! operator granted), so it is the one algorithm whose windows' totals
//! are worth keeping for export.

use super::{Counter, Properties, WindowTotals};
use crate::limit::{Limit, Verdict};

/// A fixed window counts in windows with an end, units as they are.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: false,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: true,
    follows_calendar: true,
    bounded_by_unit_ms: false,
    tells_arrival: false,
};

/// Units counted in the window that starts at `start`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Start of the counted window (a multiple of the window length).
    start: u64,
    /// Units consumed in it.
    count: u64,
    /// Units an operator granted in it beyond the limit.
    extra: u64,
    /// A window by the calendar: the counted window's end (0
    /// otherwise), kept so its total can be exported once it closes.
    end: u64,
    /// A window by the calendar: the last window that counted anything
    /// before the counted one, as `(start, end, units)`, kept until the
    /// end of the window after it; `(0, 0, 0)` for none (what Redis
    /// keeps at `<key>:closed:<start>`).
    closed: (u64, u64, u64),
}

impl Counter for State {
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        check(self.start, self.count, self.extra, limit, now, cost)
    }

    fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
        write(self, limit, now, |count, extra| (count + cost, extra));
    }

    fn give_back(&mut self, limit: &Limit, (now, at): (u64, u64), _reserved: u64, back: u64) {
        settle(self, limit, now, at, back);
    }

    fn grant(&mut self, limit: &Limit, now: u64, units: u64) {
        write(self, limit, now, |counted, granted| {
            (counted, granted + units)
        });
    }

    fn granted(&self, limit: &Limit, now: u64) -> u64 {
        seen_at(self.start, self.count, self.extra, now, limit).3
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        expires_at(self.start, limit)
    }

    fn window_totals(&self, limit: &Limit) -> Option<WindowTotals> {
        let end = if self.end > 0 {
            self.end
        } else {
            self.start + limit.window_ms
        };
        Some(WindowTotals {
            counted: (self.start, end, self.count),
            closed: self.closed,
        })
    }
}

/// Whether `cost` units fit at `now` in the window the state counts.
fn check(
    start: u64,
    count: u64,
    extra: u64,
    limit: &Limit,
    now: u64,
    cost: u64,
) -> Verdict {
    let (window_start, counted, len, extra) = seen_at(start, count, extra, now, limit);
    let window_end = window_start + len - now;
    let allowed = counted + cost <= limit.limit + extra;
    // Units settled after the fact may leave the count above the limit.
    let taken = counted + if allowed { cost } else { 0 };
    let remaining = (limit.limit + extra).saturating_sub(taken);
    Verdict {
        allowed,
        remaining,
        // More units come only with the next window; none are to come
        // back while the window has counted nothing.
        next_ms: if taken > 0 { window_end } else { 0 },
        retry_after_ms: if allowed { 0 } else { window_end },
    }
}

/// Gives back `back` units reserved at `at`, while the reservation's
/// window is the current one.
fn settle(state: &mut State, limit: &Limit, now: u64, at: u64, back: u64) {
    let (window_start, ..) = seen_at(state.start, state.count, 0, now, limit);
    if window_start == limit.span(at).0 {
        write(state, limit, now, |counted, granted| {
            (counted - back.min(counted), granted)
        });
    }
}

/// When a fixed window state starting at `start` stops mattering: its
/// window's end, or for a window by the calendar, the end of the window
/// after it (until then it is the previous window, kept for export).
fn expires_at(start: u64, limit: &Limit) -> u64 {
    let (window_start, len) = limit.span(start);
    let end = window_start + len;
    if limit.bounds.is_none() {
        return end;
    }
    let (next, next_len) = limit.span(end);
    next + next_len
}

/// Writes a fixed window state at `now`: the count and the units granted
/// in the window `now` falls in become what `change` makes of them. A
/// window by the calendar keeps its end, and one this moves past that
/// counted anything becomes the closed one.
fn write(state: &mut State, limit: &Limit, now: u64, change: impl FnOnce(u64, u64) -> (u64, u64)) {
    let State {
        start,
        count,
        extra,
        end,
        closed,
    } = state;
    let (window_start, counted, len, granted) = seen_at(*start, *count, *extra, now, limit);
    let calendar = limit.bounds.is_some();
    if window_start != *start && calendar && *count > 0 {
        let ended = if *end > 0 {
            *end
        } else {
            let (s, l) = limit.span(*start);
            s + l
        };
        *closed = (*start, ended, *count);
    }
    let (c, e) = change(counted, granted);
    (*start, *count, *extra) = (window_start, c, e);
    *end = if calendar { window_start + len } else { 0 };
}

/// A fixed window's start, count, length and units granted as seen at
/// `now`: the window is chosen at the later of `now` and the state's own
/// window (a clock that stepped back never reopens a counted window), and
/// an earlier window counts 0.
fn seen_at(start: u64, count: u64, extra: u64, now: u64, limit: &Limit) -> (u64, u64, u64, u64) {
    let t = now.max(start);
    let (window_start, len) = limit.span(t);
    if start == window_start {
        (window_start, count, len, extra)
    } else {
        (window_start, 0, len, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{admitted_across_a_boundary, limit, take};
    use crate::limit::algorithms::State;
    use crate::limit::{Algorithm, Verdict};

    #[test]
    fn fixed_window_denies_the_fourth_and_resets_at_the_boundary() {
        let l = limit(Algorithm::FixedWindow, 3, 1000);
        let mut s = State::new(l.algorithm);
        for (i, remaining) in [2, 1, 0].into_iter().enumerate() {
            let v = take(&mut s, &l, 10_100 + i as u64, 1);
            assert!(v.allowed);
            assert_eq!(v.remaining, remaining);
        }
        let v = take(&mut s, &l, 10_400, 1);
        assert_eq!(
            v,
            Verdict {
                allowed: false,
                remaining: 0,
                next_ms: 600,
                retry_after_ms: 600
            }
        );
        assert!(!take(&mut s, &l, 10_999, 1).allowed);
        let v = take(&mut s, &l, 11_000, 1);
        assert!(v.allowed);
        // Units remain, and `t` is still the time to the window's end.
        assert_eq!((v.remaining, v.next_ms), (2, 1000));
    }

    #[test]
    fn fixed_window_admits_twice_the_limit_across_a_boundary() {
        // The algorithm's known weakness, pinned so nobody mistakes it for a bug.
        assert_eq!(admitted_across_a_boundary(Algorithm::FixedWindow), 10);
    }
}
