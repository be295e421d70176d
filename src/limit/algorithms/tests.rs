//! What every algorithm must do, checked against values worked out by
//! hand, and the helpers each algorithm's own tests use.

use super::*;

pub(super) const ALL: [Algorithm; Algorithm::ALL.len()] = Algorithm::ALL;

pub(super) fn limit(algorithm: Algorithm, limit: u64, window_ms: u64) -> Limit {
    Limit::new(algorithm, limit, window_ms)
}

/// Checks and, when allowed, consumes: one limit deciding alone.
pub(super) fn take(state: &mut State, l: &Limit, now: u64, cost: u64) -> Verdict {
    let v = state.check(l, now, cost);
    if v.allowed {
        state.consume(l, now, cost);
    }
    v
}

/// `t` (next_ms) and Retry-After for every algorithm under 10 per
/// minute, with units left, none left and on a denial, for requests of
/// 1 and of 5 units, against values worked out by hand.
#[test]
fn t_is_the_next_unit_and_retry_after_this_requests_own_wait() {
    const T: u64 = 1_200_000; // a minute boundary
    let v = |allowed, remaining, next_ms, retry_after_ms| Verdict {
        allowed,
        remaining,
        next_ms,
        retry_after_ms,
    };
    /// At, cost, and the verdict worked out by hand.
    type Step = (u64, u64, Verdict);
    // The same for both bucket algorithms.
    let buckets = vec![
        (T, 1, v(true, 9, 6_000, 0)),
        (T, 5, v(true, 4, 6_000, 0)),
        (T, 4, v(true, 0, 6_000, 0)),
        (T, 1, v(false, 0, 6_000, 6_000)),
        (T, 5, v(false, 0, 6_000, 30_000)),
        (T + 3_000, 5, v(false, 0, 3_000, 27_000)),
    ];
    let cases: [(Algorithm, Vec<Step>); Algorithm::ALL.len()] = [
        (
            // Until the minute ends, whatever is left.
            Algorithm::FixedWindow,
            vec![
                (T + 10_000, 1, v(true, 9, 50_000, 0)),
                (T + 10_000, 5, v(true, 4, 50_000, 0)),
                (T + 20_000, 5, v(false, 4, 40_000, 40_000)),
                (T + 20_000, 4, v(true, 0, 40_000, 0)),
                (T + 30_000, 1, v(false, 0, 30_000, 30_000)),
            ],
        ),
        (
            // Until the oldest logged unit leaves; a denial waits until
            // enough have.
            Algorithm::SlidingLog,
            vec![
                (T, 1, v(true, 9, 60_000, 0)),
                (T + 1_000, 5, v(true, 4, 59_000, 0)),
                (T + 2_000, 4, v(true, 0, 58_000, 0)),
                (T + 3_000, 1, v(false, 0, 57_000, 57_000)),
                (T + 3_000, 5, v(false, 0, 57_000, 58_000)),
            ],
        ),
        (
            // Nothing from the previous minute: the count falls by a
            // unit once the next minute has slid 1/counted of the way.
            Algorithm::SlidingWindow,
            vec![
                (T + 30_000, 1, v(true, 9, 30_000 + 60_000, 0)),
                (T + 30_000, 4, v(true, 5, 30_000 + 12_000, 0)),
                (T + 30_000, 5, v(true, 0, 30_000 + 6_000, 0)),
                (T + 30_000, 1, v(false, 0, 30_000 + 6_000, 30_000 + 6_000)),
                (T + 30_000, 5, v(false, 0, 30_000 + 6_000, 30_000 + 30_000)),
            ],
        ),
        (
            // One unit added every 6 s; a denial waits for all it needs.
            Algorithm::TokenBucket,
            buckets.clone(),
        ),
        (Algorithm::Gcra, buckets),
    ];
    for (algorithm, steps) in cases {
        let l = limit(algorithm, 10, 60_000);
        let mut s = State::new(algorithm);
        for (i, (at, cost, want)) in steps.into_iter().enumerate() {
            assert_eq!(take(&mut s, &l, at, cost), want, "{algorithm:?} step {i}");
        }
    }
}

/// How long a limit left alone after `now` takes to hold its whole
/// capacity again: what a request of nothing is told falls to nothing
/// taken. Found by halving, since what remains only grows while nothing
/// is asked.
fn time_to_full(state: &State, l: &Limit, now: u64) -> u64 {
    let full = |after: u64| state.clone().check(l, now + after, 0).remaining >= l.capacity();
    let (mut lo, mut hi) = (0, 4 * l.window_ms * l.capacity().max(1));
    if full(0) {
        return 0;
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if full(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// `t` (and OpenAI's resets, written from it) never says more than the
/// limit needs to be back to full, and says nothing only when it is
/// full: for every algorithm, after every step of a seeded run of
/// requests of 0 to 4 units, admitted or refused, read back at cost 0
/// too, at random gaps.
#[test]
fn t_never_exceeds_the_time_back_to_full() {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |below: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    };
    for algorithm in ALL {
        for (cap, window) in [(10, 60_000), (3, 1_000), (50, 10_000)] {
            let l = limit(algorithm, cap, window);
            let mut s = State::new(algorithm);
            let mut now = 1_200_000 + next(window);
            for step in 0..400 {
                now += next(window / 4 + 1);
                let cost = next(5);
                let v = take(&mut s, &l, now, cost);
                let full = time_to_full(&s, &l, now);
                let read = s.clone().check(&l, now, 0);
                for (what, t) in [("decided", v.next_ms), ("read", read.next_ms)] {
                    assert!(
                        t <= full,
                        "{algorithm:?} {cap}/{window} step {step} ({what}): t {t} > {full} to full; {v:?} {read:?} cost {cost} {s:?}"
                    );
                }
                assert_eq!(
                    read.next_ms == 0,
                    full == 0,
                    "{algorithm:?} step {step}: {read:?}, {full} to full"
                );
            }
        }
    }
}

/// Five requests just before a window boundary and five right at it,
/// under 5 per second: how many get in.
pub(super) fn admitted_across_a_boundary(algorithm: Algorithm) -> usize {
    let l = limit(algorithm, 5, 1000);
    let mut s = State::new(l.algorithm);
    [999; 5]
        .into_iter()
        .chain([1000; 5])
        .filter(|&now| take(&mut s, &l, now, 1).allowed)
        .count()
}

/// What each algorithm says it is, pinned: the buckets refill up to a
/// burst; every algorithm but the sliding log can be leased and
/// credited; only the fixed window keeps its windows' totals and
/// follows the calendar; every algorithm but the fixed window is held
/// to limit × window below 2^50; only GCRA tells an arrival time.
#[test]
fn each_algorithm_says_what_it_is() {
    use Algorithm::{FixedWindow, Gcra, SlidingLog, TokenBucket};
    for a in ALL {
        let p = a.properties();
        assert_eq!(p.has_burst, matches!(a, TokenBucket | Gcra), "{a:?}");
        assert_eq!(p.can_lease, a != SlidingLog, "{a:?}");
        assert_eq!(p.can_be_credited, a != SlidingLog, "{a:?}");
        assert_eq!(p.keeps_window_totals, a == FixedWindow, "{a:?}");
        assert_eq!(p.follows_calendar, a == FixedWindow, "{a:?}");
        assert_eq!(p.bounded_by_unit_ms, a != FixedWindow, "{a:?}");
        assert_eq!(p.tells_arrival, a == Gcra, "{a:?}");
    }
}

#[test]
fn a_clock_stepping_back_across_a_boundary_admits_no_more_than_the_limit() {
    // Five admitted right after a boundary, then the clock steps back
    // 1 ms into the window before: the counted window must hold.
    for alg in ALL {
        let l = limit(alg, 5, 1000);
        let mut s = State::new(alg);
        let admitted = [10_000; 5]
            .into_iter()
            .chain([9_999; 5])
            .filter(|&now| take(&mut s, &l, now, 1).allowed)
            .count();
        assert_eq!(admitted, 5, "{alg:?}");
        // The wait is told from the stepped-back clock and is exact.
        let v = s.clone().check(&l, 9_999, 1);
        assert!(!s.clone().check(&l, 9_999 + v.retry_after_ms - 1, 1).allowed);
        assert!(
            s.clone().check(&l, 9_999 + v.retry_after_ms, 1).allowed,
            "{alg:?}"
        );
    }
}

#[test]
fn a_denial_consumes_nothing() {
    for alg in ALL {
        let l = limit(alg, 2, 1000);
        let mut s = State::new(alg);
        assert!(take(&mut s, &l, 0, 2).allowed);
        let mut untouched = s.clone();
        assert!(!take(&mut s, &l, 10, 1).allowed);
        // Checking may tidy the state, but every later answer is the same
        // as if the denied request had never come.
        for now in [10, 500, 999, 1000, 1500, 2000, 5000] {
            let after_denial = take(&mut s, &l, now, 1);
            assert_eq!(
                after_denial,
                take(&mut untouched, &l, now, 1),
                "{alg:?} at {now}"
            );
        }
    }
}
