//! Leases: a slice of one key's budget taken from the shared store in one
//! decision and spent in this instance's memory, for keys every request
//! of a route counts (a `global` limit, a big tenant's budget).
//!
//! A slice is taken with the store's own decision, its size as the cost,
//! so the store never hands out more than the limit: whatever the number
//! of instances, their failures or the network, the units admitted from
//! slices are units the store counted. What a slice did not spend when its
//! time is up goes back with the store's own settlement, which gives back
//! only what still counts (a fixed window's units while that window
//! lasts; a bucket's tokens less what refilled meanwhile).
//!
//! This file holds one key's lease: its slices and how big the next one
//! is; its `slice` module holds a slice in hand, and `table` this
//! instance's leases, one per key. The limiter asks the store for slices
//! ([`super::limiter`]'s `leased` module).
//!
//! - **Size**: about `interval` of this instance's own recent traffic on
//!   the key, at most four times the last slice, and never more than
//!   `share` of what the store said remains (a window), or of the burst (a
//!   bucket). Near a window's end, when `share` of what remains is less
//!   than two requests' worth, the key is decided per request until the
//!   window ends or an interval passes.
//! - **Lifetime**: while it is spent from, up to four intervals; a slice
//!   nobody spent from for an interval is up (its units go back for the
//!   other instances). Never past the end of the window it was counted in
//!   (measured from before the store was asked, so a slice never outlives
//!   its window on this instance's clock).
//! - **A bucket short of a slice**: the store's answer says when the slice
//!   would fit; until then (plus a stagger of this instance's own, so that
//!   instances do not all ask at once) the key's requests are refused here.
//!   The tokens are not lost: the bucket keeps filling (it cannot reach its
//!   burst before the slice fits, since the slice is smaller), and the
//!   next slice takes them.
//! - **Sliding logs cannot lease**: the log keeps each unit's own time, and
//!   units taken ahead would leave it before the requests that spend them
//!   (the configuration refuses it).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::{Limit, Verdict};
use crate::client::ClientId;
use crate::metrics::LeaseMetrics;

mod slice;
mod table;

pub use slice::Slice;
pub use table::Leases;

use slice::spent_rate;

/// Default lease interval: the traffic a slice is sized for, and how long
/// it may go unspent.
pub const DEFAULT_INTERVAL_MS: u32 = 250;

/// Default most of what remains one slice may take, in thousandths.
pub const DEFAULT_SHARE_PERMILLE: u16 = 125;

/// A limit's lease terms (`lease = { interval, share }`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Terms {
    /// The traffic a slice is sized for, and how long it may go unspent,
    /// in ms.
    pub interval_ms: u32,
    /// Most of what remains (a window) or of the burst (a bucket) one
    /// slice may take, in thousandths.
    pub share_permille: u16,
}

impl Default for Terms {
    fn default() -> Self {
        Self {
            interval_ms: DEFAULT_INTERVAL_MS,
            share_permille: DEFAULT_SHARE_PERMILLE,
        }
    }
}

/// Whose budget a lease is a slice of: the scope (a route, or a budget),
/// the id counted, the limit's place and the limit itself (a changed limit
/// is another lease).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Key {
    pub scope: Arc<str>,
    pub client: ClientId,
    pub index: usize,
    pub limit: Limit,
}

/// Why this instance does not spend from a slice for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    /// The key is decided per request (a window near its end, or a store
    /// that failed to hand out a slice).
    PerRequest,
    /// A bucket short of a slice: its requests are refused here.
    Refuse,
}

/// One key's lease on this instance.
#[derive(Debug)]
pub struct Lease {
    pub key: Key,
    pub terms: Terms,
    held: Mutex<Held>,
    /// Told when a refill ends, for the requests that waited on it.
    pub refilled: tokio::sync::Notify,
    metrics: LeaseMetrics,
}

#[derive(Debug, Default)]
struct Held {
    slice: Option<Slice>,
    /// Counts the slices taken, so that units given back after a request
    /// was refused elsewhere go to the slice they came from.
    generation: u64,
    refilling: bool,
    pause: Option<(Instant, Pause)>,
    /// What the store last said remains of the key, and when (ms, the
    /// store's clock): a window's remaining holds for that window only.
    remaining: Option<(u64, u64)>,
    /// Slices in a row the store had no room for (a bucket waits longer
    /// each time).
    shorts: u32,
    /// Units a millisecond this instance spent, as of the last slice.
    rate: Option<f64>,
    /// The last slice's size.
    last_size: u64,
    /// When a request last asked for this key.
    used: Option<Instant>,
}

/// What a request gets from a lease.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Take {
    /// Units taken from the slice in hand (of `generation`).
    Took(Verdict, u64),
    /// Refused here (a bucket short of a slice).
    Refused(Verdict),
    /// Decide this key per request.
    PerRequest,
    /// Another request is getting a slice: wait for it.
    Wait,
    /// Get a slice of this size (this request is the one to ask), after
    /// giving back what the old one left, if anything.
    Refill(u64, Option<Slice>),
}

impl Lease {
    fn new(key: Key, terms: Terms, metrics: LeaseMetrics) -> Self {
        Self {
            key,
            terms,
            held: Mutex::new(Held::default()),
            refilled: tokio::sync::Notify::new(),
            metrics,
        }
    }

    fn held(&self) -> std::sync::MutexGuard<'_, Held> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn metrics(&self) -> &LeaseMetrics {
        &self.metrics
    }

    /// Takes `units` for one request at `now`, or says what to do instead.
    pub fn take(&self, units: u64, now: Instant) -> Take {
        let mut held = self.held();
        held.used = Some(now);
        if let Some((until, pause)) = held.pause {
            if now < until {
                return match pause {
                    Pause::PerRequest => Take::PerRequest,
                    Pause::Refuse => {
                        let wait = ms_between(now, until).max(1);
                        Take::Refused(Verdict {
                            allowed: false,
                            remaining: 0,
                            next_ms: wait,
                            retry_after_ms: wait,
                        })
                    }
                };
            }
            held.pause = None;
        }
        let generation = held.generation;
        if let Some(slice) = held.slice.as_mut()
            && now < slice.lapses(self.interval())
            && slice.left >= units
        {
            slice.left -= units;
            slice.spent = now;
            let next_ms = slice.next_ms.saturating_sub(ms_between(slice.taken, now));
            let verdict = Verdict {
                allowed: true,
                remaining: slice.remaining + slice.left,
                next_ms,
                retry_after_ms: 0,
            };
            return Take::Took(verdict, generation);
        }
        if held.refilling {
            return Take::Wait;
        }
        let old = held.slice.take();
        if let Some(old) = &old {
            held.rate = Some(spent_rate(old, now));
        }
        match self.size(&held, units) {
            Some(size) => {
                held.refilling = true;
                Take::Refill(size, old.filter(|s| s.left > 0))
            }
            None => {
                // Until the window ends (the next one has its whole
                // budget) or an interval passes.
                let (start, len) = self.key.limit.span(crate::clock::now_ms());
                let to_end = (start + len).saturating_sub(crate::clock::now_ms());
                let pause = self.interval().min(Duration::from_millis(to_end));
                held.pause = Some((now + pause, Pause::PerRequest));
                // Nothing of the old slice is given back on this path but
                // what the keeper finds: put it back for the keeper.
                held.slice = old.filter(|s| s.left > 0).map(|s| Slice { ends: now, ..s });
                Take::PerRequest
            }
        }
    }

    /// Gives back `units` a request took from slice `generation` and did
    /// not use (another limit refused it).
    pub fn untake(&self, units: u64, generation: u64) {
        let mut held = self.held();
        if held.generation == generation
            && let Some(slice) = held.slice.as_mut()
        {
            slice.left = (slice.left + units).min(slice.size);
        }
    }

    /// The next slice's size for a request of `units`, or `None` to decide
    /// per request (a window's remaining too small to share).
    fn size(&self, held: &Held, units: u64) -> Option<u64> {
        let limit = &self.key.limit;
        let interval = f64::from(self.terms.interval_ms);
        let wanted = match held.rate {
            // About one interval of this instance's traffic, growing at
            // most fourfold a slice.
            Some(rate) => ((rate * interval).ceil() as u64).min(held.last_size.saturating_mul(4)),
            None => units.saturating_mul(16),
        }
        .max(units);
        let share = |of: u64| of.saturating_mul(u64::from(self.terms.share_permille)) / 1000;
        let cap = if limit.algorithm.has_burst() {
            share(limit.burst).max(units)
        } else {
            let now = crate::clock::now_ms();
            let remaining = match held.remaining {
                Some((at, r)) if limit.span(at).0 == limit.span(now).0 => r,
                _ => limit.limit,
            };
            let cap = share(remaining);
            if cap < units.saturating_mul(2) {
                return None;
            }
            cap
        };
        Some(wanted.min(cap).min(limit.capacity()))
    }

    /// A slice came: `size` units, counted at `at_ms` by the store, asked
    /// for at `taken`; the store's answer said `remaining` and `next_ms`.
    pub fn filled(&self, size: u64, at_ms: u64, taken: Instant, remaining: u64, next_ms: u64) {
        let limit = &self.key.limit;
        let interval = u64::from(self.terms.interval_ms);
        let most = interval.saturating_mul(4);
        let (lifetime, at_window_end) = if limit.algorithm.has_burst() {
            (most, false)
        } else {
            let (start, len) = limit.span(at_ms);
            let to_end = (start + len).saturating_sub(at_ms);
            (most.min(to_end), to_end <= most)
        };
        let mut held = self.held();
        held.generation += 1;
        held.last_size = size;
        held.remaining = Some((at_ms, remaining));
        held.shorts = 0;
        held.slice = Some(Slice {
            left: size,
            size,
            at_ms,
            taken,
            ends: taken + Duration::from_millis(lifetime),
            spent: taken,
            at_window_end,
            remaining,
            next_ms,
        });
        self.metrics.taken.inc();
        self.metrics.units_taken.inc_by(size);
    }

    /// The store had no slice of `size` for this instance at `at_ms`:
    /// `remaining` units were left, and `retry_after_ms` after `taken` it
    /// would fit.
    pub fn short(
        &self,
        size: u64,
        taken: Instant,
        (at_ms, remaining): (u64, u64),
        retry_after_ms: u64,
    ) {
        let limit = &self.key.limit;
        let mut held = self.held();
        held.remaining = Some((at_ms, remaining));
        held.last_size = size;
        held.shorts = held.shorts.saturating_add(1);
        let interval = interval_ms(self.interval());
        held.pause = match limit.algorithm {
            a if a.has_burst() => {
                // Instances short of a slice at once would all ask again
                // at once: each waits longer each time in a row it was
                // short, by a fraction of its own. Never so long that the
                // bucket could fill to its burst meanwhile (the tokens it
                // gathers are the next slice's, not lost).
                let backoff = retry_after_ms.saturating_mul(1 << (held.shorts - 1).min(4));
                let stagger = retry_after_ms.saturating_mul(stagger_permille(&self.key)) / 1000;
                let fills = limit
                    .burst
                    .saturating_sub(size)
                    .saturating_mul(limit.window_ms)
                    / limit.limit.max(1);
                let wait = backoff
                    .saturating_add(stagger)
                    .min(interval.saturating_mul(4))
                    .min(fills.max(retry_after_ms));
                Some((taken + Duration::from_millis(wait.max(1)), Pause::Refuse))
            }
            // What remains may still be shared by a smaller slice; else
            // per request until the window ends or an interval passes.
            _ if self.size(&held, 1).is_some_and(|s| s < size) => None,
            _ => {
                let (start, len) = limit.span(at_ms);
                let to_end = (start + len).saturating_sub(at_ms);
                Some((
                    taken + Duration::from_millis(interval.min(to_end)),
                    Pause::PerRequest,
                ))
            }
        };
        self.metrics.short.inc();
    }

    /// The store could not be asked for a slice: the key is decided per
    /// request (where `on_error` applies) for an interval.
    pub fn failed(&self, now: Instant) {
        self.held().pause = Some((now + self.interval(), Pause::PerRequest));
    }

    /// A refill ended, however it ended: the requests waiting may go on.
    pub fn refill_ended(&self) {
        self.held().refilling = false;
        self.refilled.notify_waiters();
    }

    /// The slice in hand if it is up at `now` (or `all`), taken out with
    /// what it left, for the keeper to give back.
    pub fn lapsed(&self, now: Instant, all: bool) -> Option<Slice> {
        let mut held = self.held();
        if held.refilling {
            return None;
        }
        let interval = self.interval();
        if !held.slice.is_some_and(|s| all || now >= s.lapses(interval)) {
            return None;
        }
        let slice = held.slice.take()?;
        held.rate = Some(spent_rate(&slice, now.min(slice.lapses(interval))));
        Some(slice)
    }

    /// When the slice in hand is up, if there is one.
    pub fn lapses(&self) -> Option<Instant> {
        let interval = self.interval();
        self.held().slice.map(|s| s.lapses(interval))
    }

    /// Units held unspent now.
    pub fn held_units(&self) -> u64 {
        self.held().slice.map_or(0, |s| s.left)
    }

    /// Whether the lease has been left alone long enough to forget it:
    /// nothing held, no refill, no request for ten intervals.
    fn idle(&self, now: Instant) -> bool {
        let held = self.held();
        held.slice.is_none()
            && !held.refilling
            && held
                .used
                .is_none_or(|u| now.saturating_duration_since(u) > self.interval() * 10)
    }

    fn interval(&self) -> Duration {
        Duration::from_millis(u64::from(self.terms.interval_ms))
    }
}

fn ms_between(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_millis()).unwrap_or(u64::MAX)
}

fn interval_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// This instance's own fraction (thousandths) of a wait, the same for a
/// key all along: from the process id and the key.
fn stagger_permille(key: &Key) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::hash::DefaultHasher::new();
    std::process::id().hash(&mut h);
    key.hash(&mut h);
    h.finish() % 1000
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;

    const DAY_MS: u64 = 86_400_000;

    fn lease(algorithm: Algorithm, limit: u64) -> Lease {
        Lease::new(
            Key {
                scope: "api".into(),
                client: ClientId::Global,
                index: 0,
                // A day's window: the tests' windows do not end while
                // they run.
                limit: Limit::new(algorithm, limit, DAY_MS),
            },
            Terms::default(),
            LeaseMetrics::default(),
        )
    }

    #[test]
    fn slices_follow_the_traffic_and_shrink_with_what_remains() {
        let l = lease(Algorithm::FixedWindow, 10_000);
        let t0 = Instant::now();
        // No rate yet: a small first slice.
        let Take::Refill(first, None) = l.take(1, t0) else {
            panic!("a first slice is asked for")
        };
        assert_eq!(first, 16);
        assert_eq!(l.take(1, t0), Take::Wait, "one request asks at a time");
        let now = crate::clock::now_ms();
        l.filled(first, now, t0, 9_984, 5_000);
        l.refill_ended();
        for _ in 0..16 {
            assert!(matches!(l.take(1, t0), Take::Took(..)));
        }
        // Spent in 40 ms: 0.4 a ms, 100 an interval, at most fourfold.
        let Take::Refill(second, None) = l.take(1, t0 + Duration::from_millis(40)) else {
            panic!("a second slice")
        };
        assert_eq!(second, 64);
        l.filled(second, now, t0, 9_920, 4_960);
        l.refill_ended();
        // Near the end: an eighth of 12 is less than two requests' worth.
        l.short(64, t0, (now, 12), 0);
        assert_eq!(l.take(1, t0), Take::PerRequest);
    }

    #[test]
    fn a_bucket_short_of_a_slice_refuses_until_it_fits() {
        let l = lease(Algorithm::TokenBucket, 100_000);
        let t0 = Instant::now();
        let Take::Refill(size, None) = l.take(1, t0) else {
            panic!("a slice is asked for")
        };
        l.short(size, t0, (0, 3), 130);
        l.refill_ended();
        let Take::Refused(v) = l.take(1, t0 + Duration::from_millis(10)) else {
            panic!("refused while the slice does not fit")
        };
        assert!(
            !v.allowed && (120..=250).contains(&v.retry_after_ms),
            "{v:?}"
        );
        assert!(matches!(
            l.take(1, t0 + Duration::from_millis(300)),
            Take::Refill(..)
        ));
    }

    #[test]
    fn a_slice_never_outlives_its_window() {
        let l = lease(Algorithm::FixedWindow, 10_000);
        let t0 = Instant::now();
        let Take::Refill(size, None) = l.take(1, t0) else {
            panic!("a slice")
        };
        // Counted 100 ms before its window ends.
        l.filled(size, 2 * DAY_MS - 100, t0, 9_000, 100);
        l.refill_ended();
        let lapses = l.lapses().expect("a slice in hand");
        assert_eq!(lapses - t0, Duration::from_millis(100));
        assert!(l.lapsed(t0 + Duration::from_millis(99), false).is_none());
        let slice = l
            .lapsed(t0 + Duration::from_millis(100), false)
            .expect("up");
        assert!(slice.ends_with_window(t0 + Duration::from_millis(100)) && slice.left == size);
    }

    #[test]
    fn units_given_back_go_to_their_own_slice() {
        let l = lease(Algorithm::FixedWindow, 10_000);
        let t0 = Instant::now();
        let Take::Refill(size, None) = l.take(1, t0) else {
            panic!("a slice")
        };
        l.filled(size, 1_000, t0, 9_000, 9_000);
        l.refill_ended();
        let Take::Took(_, generation) = l.take(2, t0) else {
            panic!("taken")
        };
        l.untake(2, generation);
        assert_eq!(l.held_units(), size);
        l.untake(2, generation + 1);
        assert_eq!(l.held_units(), size, "another slice's units stay out");
    }
}
