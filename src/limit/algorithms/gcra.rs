//! The generic cell rate algorithm (`lua/gcra.lua`): one unit per
//! `window / limit`, bursts up to `burst`. The state is the theoretical
//! arrival time (TAT), as whole milliseconds plus a fraction in 1/`limit`
//! ms, so an emission interval of `window/limit` ms is exact.

use super::Properties;
use crate::limit::{Limit, Verdict};

/// GCRA lets units through at a steady rate up to its burst: no window end.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: true,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: false,
    follows_calendar: false,
};

/// Whether `cost` units fit under the tolerance at `now`.
pub(super) fn check(tat_ms: u64, tat_frac: u64, limit: &Limit, now: u64, cost: u64) -> Verdict {
    let w = limit.window_ms;
    let rate = limit.limit;
    let ahead = ahead(tat_ms, tat_frac, now, rate);
    let tolerance = w * limit.burst;
    let after = ahead + w * cost;
    let allowed = after <= tolerance;
    // Until one more emission interval fits under the tolerance with
    // `outstanding` ahead; 0 when nothing is (the bucket is full).
    let next_unit = |outstanding: u64| {
        if outstanding == 0 {
            return 0;
        }
        let units = tolerance.saturating_sub(outstanding) / w;
        (outstanding + (units + 1) * w - tolerance).div_ceil(rate)
    };
    if allowed {
        Verdict {
            allowed,
            remaining: (tolerance - after) / w,
            next_ms: next_unit(after),
            retry_after_ms: 0,
        }
    } else {
        Verdict {
            allowed,
            // A clock that stepped back leaves the TAT further ahead than
            // the tolerance: nothing remains.
            remaining: tolerance.saturating_sub(ahead) / w,
            next_ms: next_unit(ahead),
            retry_after_ms: (after - tolerance).div_ceil(rate),
        }
    }
}

/// Moves the TAT on by `cost` emission intervals from `now`.
pub(super) fn consume(tat_ms: &mut u64, tat_frac: &mut u64, limit: &Limit, now: u64, cost: u64) {
    let rate = limit.limit;
    let after = ahead(*tat_ms, *tat_frac, now, rate) + limit.window_ms * cost;
    *tat_ms = now + after / rate;
    *tat_frac = after % rate;
}

/// Moves the TAT back by `give` (in 1/rate ms; see `settle`'s notes on how
/// much a bucket may give back), never before `now`.
pub(super) fn settle(tat_ms: &mut u64, tat_frac: &mut u64, limit: &Limit, now: u64, give: u64) {
    let rate = limit.limit;
    let ahead = ahead(*tat_ms, *tat_frac, now, rate);
    if give == 0 || ahead == 0 {
        return;
    }
    let after = ahead - give.min(ahead);
    *tat_ms = now + after / rate;
    *tat_frac = after % rate;
}

/// When the TAT is reached: nothing is outstanding after it.
pub(super) fn expires_at(tat_ms: u64, tat_frac: u64) -> u64 {
    tat_ms + u64::from(tat_frac > 0)
}

/// How far the theoretical arrival time is ahead of `now`, in 1/rate ms.
fn ahead(tat_ms: u64, tat_frac: u64, now: u64, rate: u64) -> u64 {
    if tat_ms >= now {
        (tat_ms - now) * rate + tat_frac
    } else {
        0
    }
}
