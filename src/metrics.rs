//! Counters the data path bumps and the admin listener reads: lock-free
//! atomics, labelled only by route and outcome (never by client).

use std::sync::atomic::{AtomicU64, Ordering};

/// What happened to a request on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The limits allowed it (or the route has none).
    Allowed,
    /// The limits denied it: 429.
    Denied,
    /// The limits would have denied it, but the route is in shadow mode.
    ShadowDenied,
    /// The client is exempt from the route's limits.
    Exempt,
    /// The store could not decide; `on_error` applied.
    StoreError,
}

impl Outcome {
    /// Every outcome, in exposition order.
    pub const ALL: [Outcome; 5] = [
        Outcome::Allowed,
        Outcome::Denied,
        Outcome::ShadowDenied,
        Outcome::Exempt,
        Outcome::StoreError,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
            Self::ShadowDenied => "shadow_denied",
            Self::Exempt => "exempt",
            Self::StoreError => "store_error",
        }
    }
}

/// Requests by outcome, for one route.
#[derive(Debug, Default)]
pub struct Outcomes([AtomicU64; 5]);

impl Outcomes {
    /// Counts one request.
    pub fn count(&self, outcome: Outcome) {
        self.0[outcome as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests counted with `outcome` so far.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.0[outcome as usize].load(Ordering::Relaxed)
    }
}
