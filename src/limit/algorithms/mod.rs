//! The algorithms as pure Rust: state, the time `now` in milliseconds and a
//! cost in, a verdict out. No clock, no I/O.
//!
//! Deciding is two steps so that several limits can decide all or nothing:
//! [`State::check`] answers whether `cost` units fit at `now` (it may tidy the
//! state, e.g. forget expired entries, but never consumes), and
//! [`State::consume`] takes the units once every limit said yes. The Lua
//! scripts in `lua/` follow the same steps and are tested against this code.
//!
//! Each algorithm has a module of its own beside its script (`lua/<name>.lua`):
//! its check, consume, settle and expiry, and its [`Properties`], what the
//! rest of floodgate asks of it. This module holds what they share: the
//! [`State`] of every algorithm, and the dispatch from it to each one.

use std::collections::VecDeque;

use super::{Algorithm, Limit, Verdict};

mod fixed_window;
mod gcra;
mod settle;
mod sliding_log;
mod sliding_window;
mod token_bucket;

/// What an algorithm is, as the rest of floodgate asks it: how it counts,
/// and so what may be done with its counts. Each algorithm's module gives
/// its own answers ([`Algorithm::properties`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Properties {
    /// Refills continuously up to a burst rather than counting in windows:
    /// it takes a `burst`, its capacity is that burst, and it has no window
    /// end (for a lease's slice to expire at, or for what remains to hold
    /// until).
    pub has_burst: bool,
    /// Can be decided from slices of the store's budget taken ahead
    /// (`lease = { … }`; see [`super::leases`]).
    pub can_lease: bool,
    /// Can be given units back now by an operator (a credit,
    /// [`super::Adjustment::Credit`]).
    pub can_be_credited: bool,
    /// Keeps each window's total until the window after it ends, so closed
    /// windows can be exported ([`super::Kept`]).
    pub keeps_window_totals: bool,
    /// Can count in windows by the calendar (`window = "month"`; see
    /// [`super::calendar`]).
    pub follows_calendar: bool,
}

impl Algorithm {
    /// What this algorithm is: its module's answers.
    pub const fn properties(self) -> &'static Properties {
        match self {
            Algorithm::FixedWindow => &fixed_window::PROPERTIES,
            Algorithm::SlidingLog => &sliding_log::PROPERTIES,
            Algorithm::SlidingWindow => &sliding_window::PROPERTIES,
            Algorithm::TokenBucket => &token_bucket::PROPERTIES,
            Algorithm::Gcra => &gcra::PROPERTIES,
        }
    }

    /// Refills continuously up to a burst (see [`Properties::has_burst`]).
    pub const fn has_burst(self) -> bool {
        self.properties().has_burst
    }

    /// Can be leased (see [`Properties::can_lease`]).
    pub const fn can_lease(self) -> bool {
        self.properties().can_lease
    }

    /// Can be credited (see [`Properties::can_be_credited`]).
    pub const fn can_be_credited(self) -> bool {
        self.properties().can_be_credited
    }

    /// Keeps closed windows' totals (see [`Properties::keeps_window_totals`]).
    pub const fn keeps_window_totals(self) -> bool {
        self.properties().keeps_window_totals
    }

    /// Can count by the calendar (see [`Properties::follows_calendar`]).
    pub const fn follows_calendar(self) -> bool {
        self.properties().follows_calendar
    }
}

/// One limit's counting state for one client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Units counted in the window that starts at `start`.
    FixedWindow {
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
    },
    /// Admitted requests still inside the trailing window, oldest first.
    SlidingLog {
        /// `(time admitted, units)` per admitted request.
        entries: VecDeque<(u64, u64)>,
        /// Sum of the units in `entries`.
        total: u64,
    },
    /// Counts of the current and the previous aligned window.
    SlidingWindow {
        /// Start of the current window.
        start: u64,
        /// Units in the current window.
        current: u64,
        /// Units in the window before it.
        previous: u64,
    },
    /// Tokens, in units of one token = `window_ms` (so refilling `limit`
    /// tokens per window adds exactly `limit` per millisecond: integers only).
    TokenBucket {
        /// Scaled tokens at `last`.
        tokens: u64,
        /// When `tokens` was computed (ms); `None` for a full, untouched bucket.
        last: Option<u64>,
    },
    /// Theoretical arrival time, as whole milliseconds plus a fraction in
    /// 1/`limit` ms, so an emission interval of `window/limit` ms is exact.
    Gcra {
        /// Whole milliseconds of the theoretical arrival time.
        tat_ms: u64,
        /// Extra `1/limit` ms (always below `limit`).
        tat_frac: u64,
    },
}

impl State {
    /// Fresh state: nothing consumed.
    pub fn new(algorithm: Algorithm) -> Self {
        match algorithm {
            Algorithm::FixedWindow => Self::FixedWindow {
                start: 0,
                count: 0,
                extra: 0,
                end: 0,
                closed: (0, 0, 0),
            },
            Algorithm::SlidingLog => Self::SlidingLog {
                entries: VecDeque::new(),
                total: 0,
            },
            Algorithm::SlidingWindow => Self::SlidingWindow {
                start: 0,
                current: 0,
                previous: 0,
            },
            Algorithm::TokenBucket => Self::TokenBucket {
                tokens: 0,
                last: None,
            },
            Algorithm::Gcra => Self::Gcra {
                tat_ms: 0,
                tat_frac: 0,
            },
        }
    }

    /// Whether `cost` units fit at `now`, and the verdict if they are taken.
    ///
    /// Time never runs backwards inside a state: a `now` before the
    /// window a window state counts in (the clock stepped back) is read as
    /// that window's start, and the others already decide at the later of
    /// `now` and the latest time they hold, or grow only stricter when
    /// `now` is earlier (see `lua/prelude.lua`).
    pub fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
        match self {
            Self::FixedWindow {
                start,
                count,
                extra,
                ..
            } => fixed_window::check(*start, *count, *extra, limit, now, cost),
            Self::SlidingLog { entries, total } => {
                sliding_log::check(entries, total, limit, now, cost)
            }
            Self::SlidingWindow {
                start,
                current,
                previous,
            } => sliding_window::check((*start, *current, *previous), limit, now, cost),
            Self::TokenBucket { tokens, last } => {
                token_bucket::check(*tokens, *last, limit, now, cost)
            }
            Self::Gcra { tat_ms, tat_frac } => gcra::check(*tat_ms, *tat_frac, limit, now, cost),
        }
    }

    /// Takes `cost` units at `now`; call only after [`State::check`] allowed
    /// at the same `now`.
    pub fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
        match self {
            Self::FixedWindow { .. } => fixed_window::consume(self, limit, now, cost),
            Self::SlidingWindow {
                start,
                current,
                previous,
            } => sliding_window::consume((start, current, previous), limit, now, cost),
            Self::TokenBucket { tokens, last } => {
                token_bucket::consume(tokens, last, limit, now, cost);
            }
            Self::Gcra { tat_ms, tat_frac } => gcra::consume(tat_ms, tat_frac, limit, now, cost),
            Self::SlidingLog { entries, total } => sliding_log::consume(entries, total, now, cost),
        }
    }

    /// Units an operator granted past the limit still in force at `now`:
    /// a fixed window's, while its window is current; the others take a
    /// credit as units given back, so hold none apart.
    pub fn granted(&self, limit: &Limit, now: u64) -> u64 {
        match self {
            Self::FixedWindow {
                start,
                count,
                extra,
                ..
            } => fixed_window::granted(*start, *count, *extra, limit, now),
            _ => 0,
        }
    }

    /// When this state holds nothing that matters any more.
    pub fn expires_at(&self, limit: &Limit) -> u64 {
        match self {
            Self::FixedWindow { start, .. } => fixed_window::expires_at(*start, limit),
            Self::SlidingLog { entries, .. } => sliding_log::expires_at(entries, limit),
            Self::SlidingWindow { start, .. } => sliding_window::expires_at(*start, limit),
            Self::TokenBucket { tokens, last } => token_bucket::expires_at(*tokens, *last, limit),
            Self::Gcra { tat_ms, tat_frac } => gcra::expires_at(*tat_ms, *tat_frac),
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
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
    /// follows the calendar; the fixed window and the sliding log count
    /// whole units.
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
}
