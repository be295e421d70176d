//! A route's concurrency settings, as the configuration describes them:
//! plain data that `config` fills in and [`super::Capacity`] is built from.

use std::time::Duration;

/// A route's concurrency settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// What one cap covers.
    pub per: Per,
    /// The cap: fixed, or where an adaptive one starts.
    pub max_in_flight: usize,
    /// Requests that may wait for a slot; 0 refuses at once.
    pub queue: usize,
    /// How long a request waits in the queue before it is refused.
    pub queue_timeout: Duration,
    /// The status a refused request gets.
    pub status: http::StatusCode,
    /// The cap follows the upstream's latency.
    pub adaptive: Option<Adaptive>,
}

/// What one cap covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    /// All of the route's requests.
    Route,
    /// Each client of the route, as the route identifies clients.
    Client,
}

impl Per {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, Per); 2] = [("route", Per::Route), ("client", Per::Client)];

    /// The name in configuration files.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize].0
    }
}

/// How an adaptive cap moves.
#[derive(Debug, Clone, PartialEq)]
pub struct Adaptive {
    /// The cap never goes below this.
    pub min: usize,
    /// Nor above this.
    pub max: usize,
    /// How often the cap is recomputed from the last interval's samples.
    pub interval: Duration,
    /// How often the round-trip floor is measured again.
    pub floor_every: Duration,
    /// How much slower than the floor still counts as "near it" (0.25: a
    /// quarter slower).
    pub tolerance: f64,
}
