//! A circuit breaker around one node of the shared store (the one Redis,
//! or one primary of a cluster), so a dead or hung node costs
//! one timeout now and then instead of one per request.
//!
//! Closed: every decision goes to the store; `threshold` failures in a row
//! open it. Open: decisions skip the store (the `on_error` policy answers at
//! once) until `cooldown` has passed. Then one probe at a time goes to the
//! store, a decision or the limiter's own check (`Limiter::recover`): success
//! closes the breaker, failure opens it again.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Failures in a row that open the breaker.
pub const DEFAULT_THRESHOLD: u32 = 5;
/// How long the breaker stays open before probing.
pub const DEFAULT_COOLDOWN_MS: u64 = 500;

/// A lock-free circuit breaker.
#[derive(Debug)]
pub struct Breaker {
    failures: AtomicU32,
    /// 0 while closed; otherwise when the next probe may go (ms).
    open_until: AtomicU64,
    probing: AtomicBool,
    /// When it last opened or closed (ms); 0: never, closed since start.
    changed_at: AtomicU64,
    threshold: u32,
    cooldown_ms: u64,
}

/// Whether a decision may go to the store.
#[derive(Debug)]
pub enum Pass<'a> {
    /// The breaker is closed: go ahead.
    Closed,
    /// This decision is the probe; report its result through the guard.
    Probe(Probe<'a>),
    /// The breaker is open: don't wait on the store.
    Open,
}

/// The one decision allowed through a half-open breaker. Dropping it
/// without a result (the request went away) lets another probe go.
#[derive(Debug)]
pub struct Probe<'a>(&'a Breaker);

/// A change of state worth one log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Nothing changed.
    None,
    /// The breaker opened: the store is considered down.
    Opened,
    /// The breaker closed: the store answers again.
    Closed,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(threshold: u32, cooldown_ms: u64) -> Self {
        Self {
            failures: AtomicU32::new(0),
            open_until: AtomicU64::new(0),
            probing: AtomicBool::new(false),
            changed_at: AtomicU64::new(0),
            threshold: threshold.max(1),
            cooldown_ms,
        }
    }

    /// Whether a decision at `now` may use the store.
    pub fn pass(&self, now: u64) -> Pass<'_> {
        let open_until = self.open_until.load(Ordering::Acquire);
        if open_until == 0 {
            return Pass::Closed;
        }
        if now < open_until {
            return Pass::Open;
        }
        match self
            .probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Pass::Probe(Probe(self)),
            Err(_) => Pass::Open,
        }
    }

    /// Records a store success.
    pub fn success(&self) -> Change {
        self.failures.store(0, Ordering::Relaxed);
        if self.open_until.swap(0, Ordering::AcqRel) != 0 {
            self.changed_at
                .store(crate::clock::now_ms(), Ordering::Relaxed);
            Change::Closed
        } else {
            Change::None
        }
    }

    /// Records a store failure at `now`.
    pub fn failure(&self, now: u64) -> Change {
        let failures = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < self.threshold {
            return Change::None;
        }
        self.open_now(now)
    }

    /// Opens the breaker at once (e.g. the store is down at startup).
    pub fn open_now(&self, now: u64) -> Change {
        let previous = self
            .open_until
            .swap(now + self.cooldown_ms, Ordering::AcqRel);
        if previous == 0 {
            self.changed_at.store(now, Ordering::Relaxed);
            Change::Opened
        } else {
            Change::None
        }
    }

    /// True while the store is considered down.
    pub fn is_open(&self) -> bool {
        self.open_until.load(Ordering::Acquire) != 0
    }

    /// When the breaker last opened or closed (ms since the epoch); `None`
    /// when it has been closed since it was made.
    pub fn changed_at(&self) -> Option<u64> {
        match self.changed_at.load(Ordering::Relaxed) {
            0 => None,
            at => Some(at),
        }
    }
}

impl Probe<'_> {
    /// Reports the probe's result.
    pub fn finish(self, ok: bool, now: u64) -> Change {
        let change = if ok {
            self.0.success()
        } else {
            self.0.open_now(now);
            Change::None
        };
        drop(self);
        change
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_failures_and_skips_the_store_until_cooldown() {
        let b = Breaker::new(3, 500);
        assert_eq!(b.failure(0), Change::None);
        assert_eq!(b.failure(1), Change::None);
        assert!(matches!(b.pass(2), Pass::Closed));
        assert_eq!(b.failure(2), Change::Opened);
        assert!(b.is_open());
        assert!(matches!(b.pass(3), Pass::Open));
        assert!(matches!(b.pass(501), Pass::Open));
    }

    #[test]
    fn one_probe_at_a_time_and_its_result_decides() {
        let b = Breaker::new(1, 500);
        b.failure(0);
        let Pass::Probe(probe) = b.pass(500) else {
            panic!("expected a probe")
        };
        assert!(
            matches!(b.pass(500), Pass::Open),
            "a second probe while one is out"
        );
        assert_eq!(probe.finish(false, 600), Change::None);
        assert!(matches!(b.pass(1_099), Pass::Open));
        let Pass::Probe(probe) = b.pass(1_100) else {
            panic!("expected a probe")
        };
        assert_eq!(probe.finish(true, 1_100), Change::Closed);
        assert!(matches!(b.pass(1_101), Pass::Closed));
        assert!(!b.is_open());
    }

    #[test]
    fn an_abandoned_probe_lets_another_go() {
        let b = Breaker::new(1, 10);
        b.failure(0);
        let first = b.pass(10);
        assert!(matches!(first, Pass::Probe(_)));
        drop(first);
        assert!(matches!(b.pass(10), Pass::Probe(_)));
    }
}
