//! The units of routes whose cost is what their upstream reports:
//! reserved before forwarding, reported by the answers, given back and
//! charged beyond the reservation when settled, and the requests whose
//! reservation stood because nothing was reported, by reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::usage::{Abandonment, Unreported};

/// What `floodgate_usage_units_total`'s `kind` counts.
const KINDS: [&str; 4] = ["reserved", "reported", "refunded", "charged_over"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteKind {
    route: String,
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcome {
    route: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteReason {
    route: String,
    reason: &'static str,
}

/// The usage families.
#[derive(Debug, Clone, Default)]
pub(super) struct Families {
    units: Family<RouteKind, Counter>,
    unreported: Family<RouteReason, Counter>,
    abandoned: Family<RouteOutcome, Counter>,
}

/// One metered route's handles.
#[derive(Debug, Clone)]
pub struct UsageMetrics {
    /// Units reserved by admitted requests.
    pub reserved: Counter,
    /// Units the answers reported.
    pub reported: Counter,
    /// Units reserved and not used, given back.
    pub refunded: Counter,
    /// Units reported beyond the reservation, charged when settled.
    pub charged_over: Counter,
    unreported: [Counter; 5],
    abandoned: [Counter; 5],
}

impl UsageMetrics {
    /// Counts a request whose reservation stood, and why.
    pub fn unreported(&self, why: Unreported) {
        self.unreported[why as usize].inc();
    }

    /// Counts an answer whose client left before its report, and what
    /// became of it.
    pub fn abandoned(&self, outcome: Abandonment) {
        self.abandoned[outcome as usize].inc();
    }

    /// The units counted so far: reserved, reported, refunded, charged
    /// over.
    pub fn units(&self) -> [u64; 4] {
        [
            self.reserved.get(),
            self.reported.get(),
            self.refunded.get(),
            self.charged_over.get(),
        ]
    }

    /// Requests whose reservation stood, all reasons.
    pub fn unreported_total(&self) -> u64 {
        self.unreported.iter().map(Counter::get).sum()
    }
}

impl Families {
    pub(super) fn register(&self, registry: &mut Registry) {
        registry.register(
            "floodgate_usage_units",
            "Units of routes metered by their upstream's reports, by route and kind (reserved, reported, refunded, charged_over)",
            self.units.clone(),
        );
        registry.register(
            "floodgate_usage_unreported",
            "Requests whose answers reported no usage, by route and reason: their reservation stood as the charge (missing, upstream_failed, client_left, store_failed), or a failed answer was settled to the route's failed charge (failed_answer)",
            self.unreported.clone(),
        );
        registry.register(
            "floodgate_usage_abandoned",
            "Answers whose client left before their usage report, by route and outcome: read on and settled to their report (drained), closed at drain_time or drain_bytes (bound), closed at once because max_draining answers were being read on (full), broken off by the upstream while read on (broke), closed at once as abandoned = \"close\" says (closed)",
            self.abandoned.clone(),
        );
    }

    pub(super) fn bind(&self, route: &str) -> UsageMetrics {
        let units = KINDS.map(|kind| {
            self.units
                .get_or_create(&RouteKind {
                    route: route.to_owned(),
                    kind,
                })
                .clone()
        });
        let [reserved, reported, refunded, charged_over] = units;
        UsageMetrics {
            reserved,
            reported,
            refunded,
            charged_over,
            unreported: Unreported::ALL.map(|why| {
                self.unreported
                    .get_or_create(&RouteReason {
                        route: route.to_owned(),
                        reason: why.name(),
                    })
                    .clone()
            }),
            abandoned: Abandonment::ALL.map(|outcome| {
                self.abandoned
                    .get_or_create(&RouteOutcome {
                        route: route.to_owned(),
                        outcome: outcome.name(),
                    })
                    .clone()
            }),
        }
    }

    pub(super) fn remove(&self, route: &str) {
        for kind in KINDS {
            self.units.remove(&RouteKind {
                route: route.to_owned(),
                kind,
            });
        }
        for why in Unreported::ALL {
            self.unreported.remove(&RouteReason {
                route: route.to_owned(),
                reason: why.name(),
            });
        }
        for outcome in Abandonment::ALL {
            self.abandoned.remove(&RouteOutcome {
                route: route.to_owned(),
                outcome: outcome.name(),
            });
        }
    }
}
