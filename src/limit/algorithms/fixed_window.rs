//! The fixed window (`lua/fixed_window.lua`): at most `limit` units in each
//! window aligned to multiples of `window`, or between the boundaries of a
//! window by the calendar. It counts whole units (a count and what an
//! operator granted), so it is the one algorithm whose windows' totals
//! are worth keeping for export.

use super::{Properties, State};
use crate::limit::{Limit, Verdict};

/// A fixed window counts in windows with an end, units as they are.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: false,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: true,
    follows_calendar: true,
};

/// Whether `cost` units fit at `now` in the window the state counts.
pub(super) fn check(
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

/// Takes `cost` units at `now`.
pub(super) fn consume(state: &mut State, limit: &Limit, now: u64, cost: u64) {
    write(state, limit, now, |count, extra| (count + cost, extra));
}

/// Gives back `back` units reserved at `at`, while the reservation's
/// window is the current one.
pub(super) fn settle(state: &mut State, limit: &Limit, now: u64, at: u64, back: u64) {
    let State::FixedWindow { start, count, .. } = state else {
        return;
    };
    let (window_start, ..) = seen_at(*start, *count, 0, now, limit);
    if window_start == limit.span(at).0 {
        write(state, limit, now, |counted, granted| {
            (counted - back.min(counted), granted)
        });
    }
}

/// An operator's grant: `units` more admitted in the current window,
/// past the limit, until it ends.
pub(super) fn grant(state: &mut State, limit: &Limit, now: u64, units: u64) {
    write(state, limit, now, |counted, granted| {
        (counted, granted + units)
    });
}

/// The units granted in the window `now` falls in.
pub(super) fn granted(start: u64, count: u64, extra: u64, limit: &Limit, now: u64) -> u64 {
    seen_at(start, count, extra, now, limit).3
}

/// When a fixed window state starting at `start` stops mattering: its
/// window's end, or for a window by the calendar, the end of the window
/// after it (until then it is the previous window, kept for export).
pub(super) fn expires_at(start: u64, limit: &Limit) -> u64 {
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
    let State::FixedWindow {
        start,
        count,
        extra,
        end,
        closed,
    } = state
    else {
        return;
    };
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
