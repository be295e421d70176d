//! What the data path counts by: a request's outcome, the store that
//! decided, why a decision failed, which phase timed out, and what an
//! answer floodgate made itself is counted by.

use prometheus_client::metrics::counter::Counter;

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

/// Which store answered a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// The in-process store (`backend = "memory"`).
    Memory,
    /// Redis.
    Redis,
    /// The in-process fallback while Redis is down (`on_error = "local"`).
    Local,
    /// A denial remembered until its retry-after (no Redis call).
    Cache,
}

/// Why a store decision failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// No answer within `timeout`.
    Timeout,
    /// An error from Redis or the connection.
    Backend,
    /// Not asked: the circuit breaker is open.
    CircuitOpen,
    /// The store refused floodgate's settings (a configuration error).
    Refused,
}

/// The phases of an exchange that have a timeout of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The client's request head (`header_read_timeout`).
    ClientHead,
    /// The client's request body (`client_body_timeout`).
    ClientBody,
    /// The client reading floodgate's answer (`client_write_timeout`).
    ClientWrite,
    /// A new upstream connection (`upstream_connect_timeout`).
    UpstreamConnect,
    /// The upstream's response head (`upstream_timeout`).
    UpstreamHead,
    /// The upstream's response body (`upstream_body_timeout`).
    UpstreamBody,
    /// An upgraded connection (`upgrade_idle_timeout`).
    UpgradeIdle,
}

impl Phase {
    /// Every phase, in exposition order.
    pub const ALL: [Phase; 7] = [
        Phase::ClientHead,
        Phase::ClientBody,
        Phase::ClientWrite,
        Phase::UpstreamConnect,
        Phase::UpstreamHead,
        Phase::UpstreamBody,
        Phase::UpgradeIdle,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::ClientHead => "client_head",
            Self::ClientBody => "client_body",
            Self::ClientWrite => "client_write",
            Self::UpstreamConnect => "upstream_connect",
            Self::UpstreamHead => "upstream_head",
            Self::UpstreamBody => "upstream_body",
            Self::UpgradeIdle => "upgrade_idle",
        }
    }
}

/// The timeout counters, one per phase, resolved once.
#[derive(Debug, Clone)]
pub struct Timeouts {
    pub(super) counters: [Counter; 7],
}

impl Timeouts {
    /// Counts a timeout in `phase`.
    pub fn count(&self, phase: Phase) {
        self.counter(phase).inc();
    }

    /// The counter of `phase`, to keep where the timeout fires.
    pub fn counter(&self, phase: Phase) -> &Counter {
        &self.counters[phase as usize]
    }
}

/// What an answer floodgate made itself (a refusal) is counted by in
/// `floodgate_refusals`: the status sent and whose fault it was. The
/// refusal implements it, so counting one asks nothing of how answers are
/// built.
pub trait CountedRefusal {
    /// The status sent, as its three digits.
    fn status_label(&self) -> &str;

    /// Whose fault it was, as its label value.
    fn fault_label(&self) -> &'static str;
}
