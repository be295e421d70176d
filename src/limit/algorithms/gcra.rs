//! The generic cell rate algorithm (`lua/gcra.lua`): one unit per
//! `window / limit`, bursts up to `burst`. The state is the theoretical
//! arrival time (TAT), as whole milliseconds plus a fraction in 1/`limit`
//! ms, so an emission interval of `window/limit` ms is exact.
//!
//! With a delay (`Limit::delay_ms`), a request past the burst is not
//! refused while the TAT it leaves is at most the delay beyond the
//! tolerance: it is admitted, its units taken now, and told to wait until
//! it fits (the time a denial without a delay would have told it); one
//! past the delay is refused, told to come back when it would be admitted
//! held for the whole delay. Its place is then held
//! in the TAT, which is what makes the wait exact across instances: every
//! later request is decided behind it. nginx's `limit_req rate=r burst=b
//! delay=d` is `limit = r`, `window = "1s"`, `burst = d + 1`, and a delay
//! of `(b − d) / r` seconds.

use super::{Counter, Properties, bucket_gives_back};
use crate::limit::{Limit, Verdict};

/// GCRA lets units through at a steady rate up to its burst: no window end.
pub(super) const PROPERTIES: Properties = Properties {
    has_burst: true,
    can_lease: true,
    can_be_credited: true,
    keeps_window_totals: false,
    follows_calendar: false,
    bounded_by_unit_ms: true,
    tells_arrival: true,
};

/// Theoretical arrival time, as whole milliseconds plus a fraction in
/// 1/`limit` ms, so an emission interval of `window/limit` ms is exact.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Whole milliseconds of the theoretical arrival time.
    tat_ms: u64,
    /// Extra `1/limit` ms (always below `limit`).
    tat_frac: u64,
}

impl Counter for State {
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        check(self.tat_ms, self.tat_frac, limit, now, cost)
    }

    fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
        consume(&mut self.tat_ms, &mut self.tat_frac, limit, now, cost);
    }

    fn give_back(&mut self, limit: &Limit, (now, at): (u64, u64), reserved: u64, back: u64) {
        let give = bucket_gives_back(limit, (now, at), reserved, back);
        settle(&mut self.tat_ms, &mut self.tat_frac, limit, now, give);
    }

    fn expires_at(&self, _limit: &Limit) -> u64 {
        expires_at(self.tat_ms, self.tat_frac)
    }
}

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
    } else if (after - tolerance).div_ceil(rate) <= limit.delay_ms {
        // Admitted past the burst, held until it fits (the wait is at
        // least 1 ms, so no delay never gets here).
        Verdict {
            allowed: true,
            remaining: 0,
            next_ms: next_unit(after),
            retry_after_ms: (after - tolerance).div_ceil(rate),
        }
    } else {
        Verdict {
            allowed,
            // A clock that stepped back leaves the TAT further ahead than
            // the tolerance: nothing remains.
            remaining: tolerance.saturating_sub(ahead) / w,
            next_ms: next_unit(ahead),
            // Until it would be admitted, held for the whole delay if it
            // has one (so a remembered denial ends when a held admission
            // would begin).
            retry_after_ms: (after - tolerance).div_ceil(rate) - limit.delay_ms,
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

#[cfg(test)]
mod tests {
    use super::super::State;
    use super::super::tests::take;
    use crate::limit::{Algorithm, Limit};

    /// nginx's `limit_req rate=10r/s burst=20 delay=8`: of 25 requests at
    /// once, 9 go at once, the next 12 are held 100 ms apart, the last 4
    /// are refused, told to come back in 100 ms; what is held holds its
    /// place, so 150 ms later one more is held behind the last, 1 150 ms.
    #[test]
    fn a_burst_goes_at_once_the_next_are_held_and_past_the_delay_refused() {
        let mut l = Limit::new(Algorithm::Gcra, 10, 1_000).with_burst(9);
        l.delay_ms = 1_200;
        let mut s = State::new(l.algorithm);
        let t0 = 1_700_000_000_000;
        let got: Vec<(bool, u64)> = (0..25)
            .map(|_| take(&mut s, &l, t0, 1))
            .map(|v| (v.allowed, v.retry_after_ms))
            .collect();
        let mut want = vec![(true, 0); 9];
        want.extend((1..=12).map(|n| (true, n * 100)));
        // Refused: back in 100 ms, to be held the whole 1.2 s.
        want.extend([(false, 100); 4]);
        assert_eq!(got, want);
        let v = take(&mut s, &l, t0 + 150, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (true, 1_150));
        // Without the delay, the same limit refuses past its burst.
        l.delay_ms = 0;
        let v = take(&mut s, &l, t0 + 150, 1);
        assert_eq!((v.allowed, v.retry_after_ms), (false, 1_250));
    }
}
