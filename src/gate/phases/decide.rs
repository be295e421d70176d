//! The decide phase: the limits a request falls under asked of the store
//! (at once when the memory store decides, else the shared store's
//! answer awaited, boxed as the rare path), and the answer counted
//! (metrics, top clients, denials, the access log) and concluded: the
//! request goes on with the decision its answer is annotated with, or is
//! answered by its denial or a refusal.

use http::{Response, StatusCode};

use super::identify::Identity;
use super::{Context, Found};
use crate::client::ClientId;
use crate::gate::metering::Reservation;
use crate::gate::rules::Rules;
use crate::limit::{Answer, Charge, Decision};
use crate::metrics::Outcome;
use crate::proxy::Body;
use crate::refusal::Refusal;
use crate::response;
use crate::routes::{Policy, Route};
use crate::usage::BodyRead;

/// The limits a request falls under: as compiled with the rules (the
/// route's, its plan's or an override's), or made for this request (the
/// numbers its token carries). A pointer either way: the decide phase's
/// results are moved between its steps, and a policy is large.
pub(super) enum Limits<'r> {
    Compiled(&'r Policy),
    ForRequest(Box<Policy>),
}

impl std::ops::Deref for Limits<'_> {
    type Target = Policy;

    fn deref(&self) -> &Policy {
        match self {
            Self::Compiled(policy) => policy,
            Self::ForRequest(policy) => policy,
        }
    }
}

/// What the decide phase concluded for a request that goes on.
pub(super) type Allowed<'r> = Option<(Decision, Limits<'r>)>;

/// The decide phase's end: `Ok(Ok)` with what the request goes on with,
/// `Ok(Err)` with the denial that answers it (boxed: the phase's result
/// is moved between its steps, and an answer is large), or the refusal (a
/// malformed reservation, a store down that `on_error` closes on).
type Decided<'r> = Result<Result<Allowed<'r>, Box<Response<Body>>>, Refusal>;

/// The store's answer concluded: the decision to annotate the answer
/// with (none when the store was unavailable), or the denial.
type Concluded = Result<Result<Option<Decision>, Box<Response<Body>>>, Refusal>;

/// The decide phase as far as it goes without waiting: done, or a
/// question for the shared store (whose count, under which policy, for how
/// many units).
enum Deciding<'r, 'w> {
    Done(Decided<'r>),
    Ask {
        client: &'w ClientId,
        keys: &'w [crate::limit::CountKey],
        policy: Limits<'r>,
        cost: u64,
    },
}

/// A concluded decision with the `policy` it was made under, for the
/// answer's `RateLimit` fields.
fn with_policy(concluded: Concluded, policy: Limits<'_>) -> Decided<'_> {
    match concluded {
        Ok(Ok(decision)) => Ok(Ok(decision.map(|d| (d, policy)))),
        Ok(Err(denial)) => Ok(Err(denial)),
        Err(refusal) => Err(refusal),
    }
}

/// What a request on `route` asks of the store for `client`: `cost` units
/// from every limit of `policy`, counted as `keys` say.
fn charge<'c>(
    route: &'c Route,
    client: &'c ClientId,
    policy: &'c Policy,
    keys: &'c [crate::limit::CountKey],
    cost: u64,
) -> Charge<'c> {
    Charge {
        route: &route.name,
        client,
        limits: &policy.limits,
        keys,
        cost,
        settle: None,
    }
}

impl Context<'_> {
    /// The rate decision, counted and logged, as far as it goes at once:
    /// done (see [`Decided`]), or a question for the shared store (the
    /// request's policy and cost), which [`Context::ask`] puts.
    fn decide<'r, 'w>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        who: &'w mut Identity<'r>,
        headers: &http::HeaderMap,
        read: Option<BodyRead>,
    ) -> Deciding<'r, 'w> {
        let route = found.route;
        if who.exempt {
            return Deciding::Done(Ok(Ok(self.unlimited(rules, found, Outcome::Exempt))));
        }
        let policy = who.policy.take().filter(|p| !p.limits.is_empty());
        let (Some(client), Some(policy)) = (&who.client, policy) else {
            return Deciding::Done(Ok(Ok(self.unlimited(rules, found, Outcome::Allowed))));
        };
        let cost = match &route.usage {
            None => route.cost,
            Some(usage) => match crate::usage::reservation(usage, headers, read) {
                Ok(cost) => cost,
                Err(message) => {
                    return Deciding::Done(Err(Refusal::client(StatusCode::BAD_REQUEST, message)));
                }
            },
        };
        let charge = charge(route, client, &policy, &who.keys, cost);
        match self.shared.limiter.decide_at_once(charge) {
            Some(answer) => {
                let concluded = self.concluded(rules, found, &policy, charge, answer);
                Deciding::Done(with_policy(concluded, policy))
            }
            None => Deciding::Ask {
                client,
                keys: &who.keys,
                policy,
                cost,
            },
        }
    }

    /// The decide phase whole: at once, or with the shared store's answer
    /// (boxed, as the rare path for every request's future).
    pub(super) async fn decided<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        who: &mut Identity<'r>,
        headers: &http::HeaderMap,
        read: Option<BodyRead>,
    ) -> Decided<'r> {
        match self.decide(rules, found, who, headers, read) {
            Deciding::Done(decided) => decided,
            Deciding::Ask {
                client,
                keys,
                policy,
                cost,
            } => Box::pin(self.ask(rules, found, client, keys, policy, cost)).await,
        }
    }

    /// The shared store's answer to the question [`Context::decide`] left,
    /// concluded.
    async fn ask<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        client: &ClientId,
        keys: &[crate::limit::CountKey],
        policy: Limits<'r>,
        cost: u64,
    ) -> Decided<'r> {
        let charge = charge(found.route, client, &policy, keys, cost);
        let answer = self.shared.limiter.decide(charge).await;
        let concluded = self.concluded(rules, found, &policy, charge, answer);
        with_policy(concluded, policy)
    }

    /// The store's `answer` to `charge` under `policy`, counted and
    /// logged: `Ok` with the decision to annotate the answer with (none
    /// when the store was unavailable), or `Err` with the denial that
    /// answers the request.
    fn concluded(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        policy: &Policy,
        charge: Charge<'_>,
        answer: Answer,
    ) -> Concluded {
        let route = found.route;
        let counts = &rules.metrics[found.index];
        let client = charge.client;
        self.log_decision(rules, found, client, policy, &answer);
        match answer {
            Answer::Decided(d) if d.allowed => {
                counts.count(Outcome::Allowed);
                self.reserved(rules, found, &charge, &d);
                Ok(Ok(Some(d)))
            }
            Answer::Decided(d) if route.shadow => {
                counts.count(Outcome::ShadowDenied);
                self.shared.log_shadow(&route.name, client);
                Ok(Ok(Some(d)))
            }
            Answer::Decided(d) => {
                counts.count(Outcome::Denied);
                let quota = policy.limits.get(d.limit).map_or(0, |l| l.limit);
                self.shared
                    .denials
                    .denied(&route.name, client, quota, crate::clock::now_ms());
                Ok(Err(Box::new(if self.grpc {
                    response::grpc_too_many_requests(route, policy, &d)
                } else {
                    response::too_many_requests(route, policy, &d)
                })))
            }
            Answer::Unavailable {
                deny,
                retry_after_ms,
            } => {
                counts.count(Outcome::StoreError);
                if deny && !route.shadow {
                    return Err(Refusal::store(retry_after_ms));
                }
                Ok(Ok(None))
            }
        }
    }

    /// On a metered route, keeps the reservation `charge` took when `d`
    /// admitted it, for the answer to settle.
    fn reserved(&mut self, rules: &Rules, found: &Found<'_>, charge: &Charge<'_>, d: &Decision) {
        let (Some(usage), Some(Some(metering))) =
            (&found.route.usage, rules.metering.get(found.index))
        else {
            return;
        };
        let reservation = Reservation::new(usage, metering, charge, d);
        if let Some(r) = self.log.as_mut() {
            r.units(&reservation.tally);
        }
        self.reservation = Some(Box::new(reservation));
    }

    /// Counts and logs a request its route does not limit.
    fn unlimited<'r>(&mut self, rules: &Rules, found: &Found<'r>, outcome: Outcome) -> Allowed<'r> {
        rules.metrics[found.index].count(outcome);
        if let Some(r) = self.log.as_mut() {
            r.decided(outcome, None, None);
        }
        None
    }

    /// The decision into the access log's record and the route's top
    /// clients.
    fn log_decision(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        client: &ClientId,
        policy: &Policy,
        answer: &Answer,
    ) {
        if let Some(r) = self.log.as_mut() {
            let (outcome, limit) = match answer {
                Answer::Decided(d) => (
                    if d.allowed {
                        Outcome::Allowed
                    } else if found.route.shadow {
                        Outcome::ShadowDenied
                    } else {
                        Outcome::Denied
                    },
                    policy
                        .names
                        .get(d.limit)
                        .map(|name| (name.as_str(), d.remaining)),
                ),
                Answer::Unavailable { .. } => (Outcome::StoreError, None),
            };
            r.decided(outcome, Some(client), limit);
        }
        if let Answer::Decided(d) = answer {
            rules.count_top(found.index, client, !d.allowed);
        }
    }
}
