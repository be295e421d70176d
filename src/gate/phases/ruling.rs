//! What deciding a request concludes (its [`Ruling`]), written down the
//! same way by every front door: the proxy listener, the decision
//! listener and Envoy's rate limit service each render it in their own
//! protocol at the end, and none counts it on its own.

use std::ops::Deref;

use http::Response;

use super::Context;
use crate::client::ClientId;
use crate::gate::rules::Rules;
use crate::limit::{Answer, Decision};
use crate::metrics::Outcome;
use crate::proxy::Body;
use crate::refusal::Refusal;
use crate::response;
use crate::routes::{Answers, Policy, Route};

/// What deciding a request concluded, with the `limits` (`P`: a
/// [`Policy`] held one way or another) a store decided it under, for
/// the answer's `RateLimit` fields or its denial.
///
/// A request held until its limits fit (a limit's `delay`: the store's
/// arrival time) is `Allowed`, its decision's
/// [`Decision::held_ms`] the wait; one refused while its client is
/// under penalty is `Denied`.
pub(super) enum Ruling<P> {
    /// Nothing limits the request (its client is exempt, or its route
    /// has no limits): it goes on, its answer not annotated.
    Unlimited,
    /// Every limit allowed it: it goes on, its answer annotated.
    Allowed { decision: Decision, limits: P },
    /// A limit refused it on a route in shadow mode: it goes on as if
    /// allowed, the denial counted and logged.
    ShadowDenied { decision: Decision, limits: P },
    /// A limit refused it: answered 429 (gRPC `RESOURCE_EXHAUSTED`,
    /// Envoy's `OVER_LIMIT`).
    Denied { decision: Decision, limits: P },
    /// The store could not decide: `on_error` lets the request go on
    /// unannotated (`None`), or refuses it (503, gRPC `UNAVAILABLE`).
    StoreDown(Option<Refusal>),
}

/// Whose a ruling is, for its record.
pub(super) struct Whose<'a, I> {
    /// Each route (its index in the rules) and client the ruling counts
    /// on.
    pub(super) counted: I,
    /// The route and client a denial (or a shadow one) is logged for.
    pub(super) denied: (&'a str, &'a ClientId),
    /// The client the access log names.
    pub(super) logged: &'a ClientId,
}

impl<P: Deref<Target = Policy>> Ruling<P> {
    /// The store's `answer` under `limits`, on a route in shadow mode or
    /// not, whose own answers take the shape `answers`.
    pub(super) fn of(answer: Answer, (shadow, answers): (bool, Answers), limits: P) -> Self {
        match answer {
            Answer::Decided(decision) if decision.allowed => Self::Allowed { decision, limits },
            Answer::Decided(decision) if shadow => Self::ShadowDenied { decision, limits },
            Answer::Decided(decision) => Self::Denied { decision, limits },
            Answer::Unavailable {
                deny,
                retry_after_ms,
            } => Self::StoreDown(
                (deny && !shadow).then(|| Refusal::store(retry_after_ms).answered_as(answers)),
            ),
        }
    }

    /// The decision a store made, with the limits it was made under.
    pub(super) fn decided(&self) -> Option<(&Decision, &Policy)> {
        match self {
            Self::Allowed { decision, limits }
            | Self::ShadowDenied { decision, limits }
            | Self::Denied { decision, limits } => Some((decision, limits)),
            Self::Unlimited | Self::StoreDown(_) => None,
        }
    }

    /// How the route's requests counter counts it.
    fn outcome(&self) -> Outcome {
        match self {
            Self::Unlimited | Self::Allowed { .. } => Outcome::Allowed,
            Self::ShadowDenied { .. } => Outcome::ShadowDenied,
            Self::Denied { .. } => Outcome::Denied,
            Self::StoreDown(_) => Outcome::StoreError,
        }
    }
}

// === impl Context ===

impl Context<'_> {
    /// `ruling` written down: counted on every route it counts on (the
    /// client among the route's top clients when a store decided), a
    /// denial logged, and the decision in the access log. (A refusal is
    /// counted where it is rendered, as every refusal is.)
    pub(super) fn record<'a, P: Deref<Target = Policy>>(
        &mut self,
        rules: &Rules,
        ruling: &Ruling<P>,
        whose: Whose<'a, impl Iterator<Item = (usize, &'a ClientId)>>,
    ) {
        let outcome = ruling.outcome();
        let decided = ruling.decided();
        for (index, client) in whose.counted {
            if let Some(live) = rules.live(index) {
                live.metrics.count(outcome);
            }
            if let Some((d, _)) = decided {
                rules.count_top(index, client, !d.allowed);
            }
        }
        let (route, client) = whose.denied;
        match ruling {
            Ruling::ShadowDenied { .. } => self.shared.log_shadow(route, client),
            Ruling::Denied { decision, limits } => {
                let refusing = limits.limits.get(decision.limit);
                if refusing.is_some_and(|l| l.penalty.is_some()) {
                    self.shared.metrics.penalized(route);
                }
                let quota = refusing.map_or(0, |l| l.limit);
                self.shared
                    .denials
                    .denied(route, client, quota, crate::clock::now_ms());
            }
            Ruling::Unlimited | Ruling::Allowed { .. } | Ruling::StoreDown(_) => {}
        }
        if let Some(r) = self.log.as_mut() {
            let limit = decided.and_then(|(d, limits)| Some((limits.name(d.limit)?, d.remaining)));
            r.decided(outcome, Some(whose.logged), limit);
            // A remembered denial was decided before (its instant is 0).
            if let Some((d, _)) = decided.filter(|(d, _)| d.at_ms > 0) {
                r.decided_at(d.at_ms);
            }
        }
    }

    /// The answer to a request `route`'s limits denied, in the request's
    /// protocol.
    pub(super) fn too_many_requests(
        &self,
        route: &Route,
        limits: &Policy,
        decision: &Decision,
    ) -> Response<Body> {
        if self.grpc {
            response::grpc_too_many_requests(route, limits, decision)
        } else {
            response::too_many_requests(route, limits, decision)
        }
    }
}
