//! Settling a reservation: a decision took `reserved` units, the answer
//! reported what it used, and the difference is taken in the same state.
//! `lua/*.lua`'s `settle` functions are the twins, held equal by the
//! property tests.

use super::State;
use crate::limit::Limit;

impl State {
    /// Settles a reservation: `reserved` units were taken at `at` (the
    /// decision's time) and the answer reported `used`. Units beyond the
    /// reservation are charged at `now`, even past the limit (they were
    /// spent); unused units are given back only where they still count:
    ///
    /// - `fixed_window`: while the reservation's window is the current one;
    /// - `sliding_window`: while its window is the current or the previous
    ///   one, from the count it went into;
    /// - `sliding_log`: while its entry is inside the trailing window;
    /// - `token_bucket`, `gcra`: at most `reserved` units less what has
    ///   refilled since `at` (`limit` per window): had only `used` been
    ///   taken, the bucket could have been full in the meantime and that
    ///   extra lost, so this is the most the bucket can owe back. A quick
    ///   answer gets back all it did not use.
    ///
    /// A settlement never leaves less counted than was used: what it gives
    /// back is at most what the reservation took beyond `used`.
    pub fn settle(&mut self, limit: &Limit, now: u64, at: u64, reserved: u64, used: u64) {
        if used > reserved {
            return self.charge_over(limit, now, used - reserved);
        }
        let back = reserved - used;
        if back > 0 {
            self.give_back(limit, (now, at), reserved, back);
        }
    }
}

/// What a bucket may give back of `back` units reserved at `at`, scaled
/// (units × window): see [`State::settle`].
pub(super) fn bucket_gives_back(
    limit: &Limit,
    (now, at): (u64, u64),
    reserved: u64,
    back: u64,
) -> u64 {
    let w = limit.window_ms;
    (back * w).min((reserved * w).saturating_sub(now.saturating_sub(at) * limit.limit))
}

#[cfg(test)]
mod tests {
    use super::super::tests::{ALL, limit, take};
    use super::*;
    use crate::limit::Algorithm;

    /// Reserving `reserved` and settling to `used` at once leaves every
    /// algorithm exactly as if `used` had been charged in the first place.
    #[test]
    fn an_immediate_settlement_is_the_same_as_charging_what_was_used() {
        for alg in ALL {
            let l = limit(alg, 100, 60_000);
            for (reserved, used) in [(40, 10), (40, 40), (40, 0), (10, 25), (60, 100)] {
                let mut settled = State::new(alg);
                let mut direct = State::new(alg);
                assert!(take(&mut settled, &l, 5_000, 30).allowed);
                assert!(take(&mut direct, &l, 5_000, 30).allowed);
                assert!(take(&mut settled, &l, 7_000, reserved).allowed);
                settled.settle(&l, 7_000, 7_000, reserved, used);
                if used > 0 {
                    direct.charge_over(&l, 7_000, used);
                }
                for now in [7_000, 20_000, 59_999, 60_000, 65_000, 120_000, 200_000] {
                    assert_eq!(
                        settled.clone().check(&l, now, 1),
                        direct.clone().check(&l, now, 1),
                        "{alg:?} reserved {reserved} used {used} at {now}"
                    );
                }
            }
        }
    }

    /// A settlement arriving later never gives back more than charging
    /// `used` at the reservation would have left: at every later moment
    /// the settled state admits no more than the direct one.
    #[test]
    fn a_late_settlement_never_gives_back_more_than_was_unused() {
        for alg in ALL {
            let l = limit(alg, 200, 60_000);
            for delay in [0, 1, 500, 6_000, 30_000, 59_999, 60_000, 61_000, 150_000] {
                for (reserved, used) in [(50, 10), (100, 0), (30, 29)] {
                    let mut settled = State::new(alg);
                    let mut direct = State::new(alg);
                    assert!(take(&mut settled, &l, 10_000, reserved).allowed);
                    assert!(take(&mut direct, &l, 10_000, used).allowed || used == 0);
                    // Traffic in between, the same for both.
                    let between = 10_000 + delay / 2;
                    take(&mut settled, &l, between, 20);
                    take(&mut direct, &l, between, 20);
                    settled.settle(&l, 10_000 + delay, 10_000, reserved, used);
                    for later in [0, 1, 1_000, 30_000, 60_000, 120_000] {
                        let now = 10_000 + delay + later;
                        let s = settled.clone().check(&l, now, 1).remaining;
                        let d = direct.clone().check(&l, now, 1).remaining;
                        assert!(
                            s <= d,
                            "{alg:?} delay {delay} reserved {reserved} used {used} at +{later}: {s} > {d}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_refund_after_its_window_is_gone_changes_nothing() {
        for alg in [Algorithm::FixedWindow, Algorithm::SlidingLog] {
            let l = limit(alg, 10, 1_000);
            let mut s = State::new(alg);
            assert!(take(&mut s, &l, 500, 8).allowed);
            assert!(take(&mut s, &l, 1_600, 3).allowed);
            let before = s.clone();
            s.settle(&l, 1_700, 500, 8, 1);
            assert_eq!(s, before, "{alg:?}");
        }
        let l = limit(Algorithm::SlidingWindow, 10, 1_000);
        let mut s = State::new(l.algorithm);
        assert!(take(&mut s, &l, 500, 8).allowed);
        let before = s.clone();
        s.settle(&l, 2_100, 500, 8, 1);
        assert_eq!(s.check(&l, 2_100, 0), before.clone().check(&l, 2_100, 0));
    }

    #[test]
    fn units_reported_past_the_limit_are_owed_and_deny_until_paid() {
        for alg in ALL {
            let l = limit(alg, 10, 1_000);
            let mut s = State::new(alg);
            assert!(take(&mut s, &l, 0, 5).allowed);
            // Reported 25 for a reservation of 5: 20 more, 15 past the limit.
            s.settle(&l, 10, 0, 5, 25);
            let v = s.clone().check(&l, 10, 1);
            assert!(!v.allowed, "{alg:?}");
            assert_eq!(v.remaining, 0, "{alg:?}");
            assert!(v.retry_after_ms > 0, "{alg:?}");
            assert!(
                !s.clone().check(&l, 10 + v.retry_after_ms - 1, 1).allowed,
                "{alg:?}"
            );
            assert!(
                s.clone().check(&l, 10 + v.retry_after_ms, 1).allowed,
                "{alg:?}"
            );
        }
    }
}
