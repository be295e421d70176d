//! The decide phase: the limits a request falls under asked of the store
//! (at once when the memory store decides, else the shared store's
//! answer awaited, boxed as the rare path), and the answer ruled and
//! recorded (see `ruling`): the front door renders the ruling, going on
//! with the decision its answer is annotated with, or answering with the
//! denial or the refusal.

use http::StatusCode;

use super::identify::Identity;
use super::ruling::{Ruling, Whose};
use super::{Context, Found};
use crate::client::ClientId;
use crate::gate::by_answer::ByAnswer;
use crate::gate::metering::Reservation;
use crate::gate::rules::Rules;
use crate::limit::{Answer, Charge};
use crate::metrics::Outcome;
use crate::refusal::Refusal;
use crate::routes::Policy;
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

/// The decide phase's end: the ruling, with the limits a store decided
/// under; or the refusal of a malformed reservation, before anything is
/// decided.
type Decided<'r> = Result<Ruling<Limits<'r>>, Refusal>;

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
            return Deciding::Done(self.unlimited(rules, found, Outcome::Exempt));
        }
        let policy = who.policy.take().filter(|p| !p.limits.is_empty());
        let (Some(client), Some(policy)) = (&who.client, policy) else {
            return Deciding::Done(self.unlimited(rules, found, Outcome::Allowed));
        };
        let policy = self.place_among_the_held(client, policy);
        let cost = match &route.usage {
            None => route.cost,
            Some(usage) => match crate::usage::reservation(usage, headers, read) {
                Ok(cost) => cost,
                Err(message) => {
                    return Deciding::Done(Err(Refusal::client(StatusCode::BAD_REQUEST, message)));
                }
            },
        };
        let charge = Charge::new(&route.name, client, &policy.limits, &who.keys, cost);
        match self.shared.limiter.decide_at_once(charge) {
            Some(answer) => {
                self.reserved(rules, found, &charge, &answer);
                self.counted_by_answer(&charge, &policy, &answer);
                Deciding::Done(Ok(self.ruled(rules, found, client, policy, answer)))
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
        let decided = match self.decide(rules, found, who, headers, read) {
            Deciding::Done(decided) => decided,
            Deciding::Ask {
                client,
                keys,
                policy,
                cost,
            } => Box::pin(self.ask(rules, found, client, keys, policy, cost)).await,
        };
        // floodgate asked for the stream's usage: the answer's usage event
        // is read, then taken out of what the client receives.
        if let (Some(r), Some(BodyRead { usage_unasked, .. })) = (self.reservation.as_mut(), read) {
            r.usage_unasked = usage_unasked;
        }
        decided
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
        let charge = Charge::new(&found.route.name, client, &policy.limits, keys, cost);
        let answer = self.shared.limiter.decide(charge).await;
        self.reserved(rules, found, &charge, &answer);
        self.counted_by_answer(&charge, &policy, &answer);
        Ok(self.ruled(rules, found, client, policy, answer))
    }

    /// The store's `answer` for `client` under `policy`, ruled and
    /// recorded.
    fn ruled<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        client: &ClientId,
        policy: Limits<'r>,
        answer: Answer,
    ) -> Ruling<Limits<'r>> {
        let ruling = Ruling::of(answer, (found.route.shadow, found.route.answers), policy);
        let whose = Whose {
            counted: std::iter::once((found.index, client)),
            denied: (&found.route.name, client),
            logged: client,
        };
        self.record(rules, &ruling, whose);
        ruling
    }

    /// An admitted request that a limit's delay holds waits `wait_ms` in
    /// its place, until it fits: a timer in the request's own future,
    /// which a client leaving drops, and with it the place.
    pub(super) async fn held(&mut self, wait_ms: u64) {
        if let Some(r) = self.log.as_mut() {
            r.held(wait_ms);
        }
        let wait = std::time::Duration::from_millis(wait_ms);
        match self.place.as_mut() {
            Some(place) => place.hold(wait).await,
            // Not reached: a policy that holds takes a place before it is
            // decided. Waiting all the same keeps the store's word.
            None => tokio::time::sleep(wait).await,
        }
    }

    /// On a policy whose limits hold requests (`delay`), the request's
    /// place among the held, kept in the context; when a bound is full,
    /// the policy without its delays instead, so that the request goes at
    /// once if it fits and is otherwise refused, taking nothing.
    fn place_among_the_held<'r>(&mut self, client: &ClientId, policy: Limits<'r>) -> Limits<'r> {
        if policy.most_held_ms() == 0 {
            return policy;
        }
        match self.shared.holds.take(client) {
            Ok(place) => {
                self.place = Some(Box::new(place));
                policy
            }
            Err(_) => Limits::ForRequest(Box::new(policy.without_delays())),
        }
    }

    /// On a metered route, keeps the reservation `charge` took when the
    /// store's `answer` admitted it, for the answer to settle.
    fn reserved(&mut self, rules: &Rules, found: &Found<'_>, charge: &Charge<'_>, answer: &Answer) {
        let (Answer::Decided(d), Some(usage), Some(Some(metering))) = (
            answer,
            &found.route.usage,
            rules.live(found.index).map(|l| &l.metering),
        ) else {
            return;
        };
        if !d.allowed {
            return;
        }
        let reservation = Reservation::new(usage, metering, charge, d);
        if let Some(r) = self.log.as_mut() {
            r.units(&reservation.tally);
        }
        self.reservation = Some(Box::new(reservation));
    }

    /// Where `policy` counts by the answer, keeps what the admitted
    /// `charge` took, for the answer to say which limits keep it.
    fn counted_by_answer(&mut self, charge: &Charge<'_>, policy: &Policy, answer: &Answer) {
        if !policy.counts_by_answer() {
            return;
        }
        if let Answer::Decided(d) = answer {
            self.by_answer = ByAnswer::new(charge, &policy.terms, d);
        }
    }

    /// Counts and logs a request its route does not limit.
    fn unlimited<'r>(&mut self, rules: &Rules, found: &Found<'r>, outcome: Outcome) -> Decided<'r> {
        if let Some(live) = rules.live(found.index) {
            live.metrics.count(outcome);
        }
        if let Some(r) = self.log.as_mut() {
            r.decided(outcome, None, None);
        }
        Ok(Ruling::Unlimited)
    }
}
