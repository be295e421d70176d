//! The token bucket (`lua/token_bucket.lua`): `limit` tokens added per
//! `window`, continuously, up to `burst`. Tokens are counted in units of
//! one token = `window_ms`, so refilling `limit` tokens per window adds
//! exactly `limit` per millisecond: integers only.

use super::{Counter, Properties, bucket_gives_back};
use crate::limit::{Limit, Verdict};

/// A token bucket refills continuously up to its burst: no window end.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: true,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: false,
    follows_calendar: false,
    bounded_by_unit_ms: true,
    tells_arrival: false,
};

/// Tokens, in units of one token = `window_ms` (so refilling `limit`
/// tokens per window adds exactly `limit` per millisecond: integers only).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Scaled tokens at `last`.
    tokens: u64,
    /// When `tokens` was computed (ms); `None` for a full, untouched bucket.
    last: Option<u64>,
}

impl Counter for State {
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        check(self.tokens, self.last, limit, now, cost)
    }

    fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
        consume(&mut self.tokens, &mut self.last, limit, now, cost);
    }

    fn give_back(&mut self, limit: &Limit, (now, at): (u64, u64), reserved: u64, back: u64) {
        let give = bucket_gives_back(limit, (now, at), reserved, back);
        settle(&mut self.tokens, &mut self.last, limit, now, give);
    }

    fn charge_over(&mut self, limit: &Limit, now: u64, units: u64) {
        charge_over(&mut self.tokens, &mut self.last, limit, now, units);
    }

    fn expires_at(&self, limit: &Limit) -> u64 {
        expires_at(self.tokens, self.last, limit)
    }
}

/// Whether `cost` tokens are in the bucket at `now`.
pub(super) fn check(tokens: u64, last: Option<u64>, limit: &Limit, now: u64, cost: u64) -> Verdict {
    let w = limit.window_ms;
    let capacity = limit.burst * w;
    let (available, t) = seen_at(tokens, last, capacity, now, limit.limit);
    let shift = t - now;
    let need = cost * w;
    let allowed = available >= need;
    // Until the next whole token is added; 0 while the bucket is full.
    let next_token = |held: u64| {
        if held >= capacity {
            0
        } else {
            (w - held % w).div_ceil(limit.limit) + shift
        }
    };
    if allowed {
        let after = available - need;
        Verdict {
            allowed,
            remaining: after / w,
            next_ms: next_token(after),
            retry_after_ms: 0,
        }
    } else {
        Verdict {
            allowed,
            remaining: available / w,
            next_ms: next_token(available),
            retry_after_ms: (need - available).div_ceil(limit.limit) + shift,
        }
    }
}

/// Takes `cost` tokens at `now`.
pub(super) fn consume(
    tokens: &mut u64,
    last: &mut Option<u64>,
    limit: &Limit,
    now: u64,
    cost: u64,
) {
    let capacity = limit.burst * limit.window_ms;
    let (available, t) = seen_at(*tokens, *last, capacity, now, limit.limit);
    (*tokens, *last) = (available - cost * limit.window_ms, Some(t));
}

/// Takes `units` at `now` whether or not they fit. A bucket that runs dry
/// owes the rest: its tokens are counted from a moment in the future, so
/// it refills only after paying back.
pub(super) fn charge_over(
    tokens: &mut u64,
    last: &mut Option<u64>,
    limit: &Limit,
    now: u64,
    units: u64,
) {
    let w = limit.window_ms;
    let capacity = limit.burst * w;
    let (available, t) = seen_at(*tokens, *last, capacity, now, limit.limit);
    let need = units * w;
    if available >= need {
        (*tokens, *last) = (available - need, Some(t));
    } else {
        let debt = need - available;
        let wait = debt.div_ceil(limit.limit);
        (*tokens, *last) = ((wait * limit.limit - debt).min(capacity), Some(t + wait));
    }
}

/// Puts back `give` scaled tokens at `now` (see `settle`'s notes on how
/// much a bucket may give back), never past the burst.
pub(super) fn settle(tokens: &mut u64, last: &mut Option<u64>, limit: &Limit, now: u64, give: u64) {
    if give == 0 {
        return;
    }
    let capacity = limit.burst * limit.window_ms;
    let (available, t) = seen_at(*tokens, *last, capacity, now, limit.limit);
    (*tokens, *last) = ((available + give).min(capacity), Some(t));
}

/// When the bucket is full again; 0 for one never touched.
pub(super) fn expires_at(tokens: u64, last: Option<u64>, limit: &Limit) -> u64 {
    match last {
        None => 0,
        Some(last) => last + (limit.burst * limit.window_ms - tokens).div_ceil(limit.limit),
    }
}

/// Scaled tokens available, counted at the later of `now` and when they
/// were last counted, and that time.
fn seen_at(tokens: u64, last: Option<u64>, capacity: u64, now: u64, rate: u64) -> (u64, u64) {
    let Some(last) = last else {
        return (capacity, now);
    };
    let elapsed = now.saturating_sub(last);
    let available = if elapsed >= (capacity - tokens).div_ceil(rate) {
        capacity
    } else {
        tokens + elapsed * rate
    };
    (available, now.max(last))
}
