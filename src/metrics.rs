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

/// The Prometheus text exposition of everything counted so far.
pub fn render(shared: &crate::server::Shared) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let rules = shared.rules();
    out.push_str("# HELP floodgate_requests_total Requests by route and outcome.\n");
    out.push_str("# TYPE floodgate_requests_total counter\n");
    for route in rules.routes.iter() {
        for outcome in Outcome::ALL {
            let _ = writeln!(
                out,
                "floodgate_requests_total{{route=\"{}\",outcome=\"{}\"}} {}",
                route.name,
                outcome.name(),
                route.outcomes.get(outcome)
            );
        }
    }
    let _ = writeln!(
        out,
        "floodgate_requests_total{{route=\"\",outcome=\"no_route\"}} {}",
        shared.no_route()
    );
    let (applied, refused) = shared.reloads();
    out.push_str("# HELP floodgate_config_reloads_total Configuration reloads by result.\n");
    out.push_str("# TYPE floodgate_config_reloads_total counter\n");
    let _ = writeln!(
        out,
        "floodgate_config_reloads_total{{result=\"success\"}} {applied}"
    );
    let _ = writeln!(
        out,
        "floodgate_config_reloads_total{{result=\"failure\"}} {refused}"
    );
    out.push_str("# HELP floodgate_config_info The configuration in force.\n");
    out.push_str("# TYPE floodgate_config_info gauge\n");
    let _ = writeln!(
        out,
        "floodgate_config_info{{digest=\"{}\"}} 1",
        shared.config_digest()
    );
    out.push_str(
        "# HELP floodgate_store_ready Whether the rate limit store answers (1) or not (0).\n",
    );
    out.push_str("# TYPE floodgate_store_ready gauge\n");
    let _ = writeln!(out, "floodgate_store_ready {}", u8::from(shared.ready()));
    out
}
