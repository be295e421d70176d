//! One route's handles: resolved by name when rules are bound, so that
//! counting a request is an atomic add, and removed with the route when a
//! reload drops it.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;

use super::families::{RouteClass, RouteCounted, RouteLabel, RouteOutcome};
use super::histogram::Histogram;
use super::{Metrics, Outcome, UsageMetrics};

/// One route's metric handles, resolved once per load.
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    outcomes: [Counter; 5],
    upstream_classes: [Counter; 5],
    upstream_seconds: Histogram,
}

// === impl Metrics ===

impl Metrics {
    /// Resolves the handles of every route named in `routes`, in their
    /// order, and removes the series of routes the previous rules had and
    /// these do not. (A request still in flight on a removed route counts
    /// into handles that are no longer exported.)
    pub fn bind<'a>(&self, routes: impl IntoIterator<Item = &'a str>) -> Vec<RouteMetrics> {
        let names: Vec<String> = routes.into_iter().map(str::to_owned).collect();
        let mut bound = self
            .bound_routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in bound.iter().filter(|name| !names.contains(name)) {
            self.remove_route(gone);
        }
        *bound = names.clone();
        drop(bound);
        names
            .into_iter()
            .map(|name| {
                let outcome = |o: Outcome| {
                    self.requests
                        .get_or_create(&RouteOutcome {
                            route: name.clone(),
                            outcome: o.name().into(),
                        })
                        .clone()
                };
                let class = |c: usize| {
                    self.upstream_responses
                        .get_or_create(&RouteClass {
                            route: name.clone(),
                            class: format!("{c}xx"),
                        })
                        .clone()
                };
                RouteMetrics {
                    outcomes: Outcome::ALL.map(outcome),
                    upstream_classes: [1, 2, 3, 4, 5].map(class),
                    upstream_seconds: self
                        .upstream_seconds
                        .get_or_create(&RouteLabel {
                            route: name.clone(),
                        })
                        .clone(),
                }
            })
            .collect()
    }

    /// The usage handles of metered route `route` (bound by
    /// [`Self::bind`]'s caller for the routes that meter; removed with the
    /// route's other series).
    pub fn bind_usage(&self, route: &str) -> UsageMetrics {
        self.usage.bind(route)
    }

    /// Counts answers on route `route` that limits with `count_when`
    /// counted (`counted`) or gave back: a series made on first use, as
    /// few routes count by the answer.
    pub fn count_when(&self, route: &str, counted: bool, answers: u64) {
        self.count_when
            .get_or_create(&RouteCounted {
                route: route.to_owned(),
                counted: if counted { "yes" } else { "no" },
            })
            .inc_by(answers);
    }

    /// Counts a request route `route` refused by a limit with a penalty:
    /// a series made on first use, as few routes have one.
    pub fn penalized(&self, route: &str) {
        self.penalized
            .get_or_create(&RouteLabel {
                route: route.to_owned(),
            })
            .inc();
    }

    /// Removes every series labelled with route `name`.
    fn remove_route(&self, name: &str) {
        self.usage.remove(name);
        self.penalized.remove(&RouteLabel {
            route: name.to_owned(),
        });
        for counted in ["yes", "no"] {
            self.count_when.remove(&RouteCounted {
                route: name.to_owned(),
                counted,
            });
        }
        for outcome in Outcome::ALL {
            self.requests.remove(&RouteOutcome {
                route: name.to_owned(),
                outcome: outcome.name().into(),
            });
        }
        for class in 1..=5 {
            self.upstream_responses.remove(&RouteClass {
                route: name.to_owned(),
                class: format!("{class}xx"),
            });
        }
        self.upstream_seconds.remove(&RouteLabel {
            route: name.to_owned(),
        });
    }
}

// === impl RouteMetrics ===

impl RouteMetrics {
    /// The requests counted so far, by [`Outcome`] (in [`Outcome::ALL`]'s
    /// order).
    pub fn counts(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.outcomes[i].get())
    }

    /// Counts one request's outcome.
    pub fn count(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].inc();
    }

    /// Answers of 500 and above from the upstream so far.
    pub fn upstream_5xx(&self) -> u64 {
        self.upstream_classes[4].get()
    }

    /// Records an upstream's own answer (floodgate's refusals are counted
    /// apart).
    pub fn upstream(&self, status: u16, took: Duration) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.upstream_classes[class].inc();
        self.upstream_seconds.observe(took);
    }
}
