//! Limits that count by the answer (`count_when`): a login route that
//! counts only failed logins.
//!
//! The decision takes a request's units from every limit as any decision
//! does, so requests in flight hold their place: a guesser cannot send a
//! hundred guesses at once past a limit of five. Once the answer's head
//! is known, the units of each limit whose `count_when` it does not meet
//! are given back before the answer goes out (so the client's next
//! request meets the limit as it stands), the way the store gives back the
//! parts of a refused request (the same keys, the units the decision took
//! or one for a limit that counts requests, and the message that ends
//! other instances' remembered denials). An answer floodgate never sees
//! (the client left before the upstream answered) keeps its units: a
//! guess whose answer is unknown counts.

use std::sync::Arc;

use http::HeaderMap;

use crate::client::ClientId;
use crate::in_flight;
use crate::limit::{Charge, CountKey, Decision, Limit, Limiter, Settlement};
use crate::metrics::Metrics;
use crate::routes::{CountWhen, LimitTerms};

/// An admitted request's units in the limits that count by the answer,
/// until its answer says which keep them.
pub(crate) struct ByAnswer {
    route: Arc<str>,
    client: ClientId,
    limits: Vec<Limit>,
    keys: Vec<CountKey>,
    when: Vec<Arc<CountWhen>>,
    settlement: Settlement,
}

impl ByAnswer {
    /// What `charge` took under the limits `terms` (one per limit) says
    /// count by the answer, when decision `d` admitted it; `None` when it
    /// was not admitted or no limit counts by the answer. The charge names
    /// each limit's key (a policy that counts by the answer keeps them).
    pub(crate) fn new(
        charge: &Charge<'_>,
        terms: &[LimitTerms],
        d: &Decision,
    ) -> Option<Box<Self>> {
        if !d.allowed {
            return None;
        }
        let mut limits = Vec::new();
        let mut keys = Vec::new();
        let mut when = Vec::new();
        for (i, t) in terms.iter().enumerate() {
            let Some(counts) = &t.count_when else {
                continue;
            };
            limits.push(*charge.limits.get(i)?);
            keys.push(charge.keys.get(i)?.clone());
            when.push(Arc::clone(counts));
        }
        if limits.is_empty() {
            return None;
        }
        Some(Box::new(Self {
            route: Arc::clone(charge.route),
            client: charge.client.clone(),
            limits,
            keys,
            when,
            settlement: Settlement {
                at_ms: d.at_ms,
                reserved: charge.cost,
                local: d.local,
                kind: crate::limit::Settled::GiveBack,
            },
        }))
    }

    /// The answer is known (`status`, `headers`): keeps only the limits
    /// it does not count, and whether there are any.
    fn not_counted(&mut self, (status, headers): (u16, &HeaderMap), metrics: &Metrics) -> bool {
        let counted: Vec<bool> = self
            .when
            .iter()
            .map(|w| w.counts(status, headers))
            .collect();
        let kept = counted.iter().filter(|&&c| c).count();
        metrics.count_when(&self.route, true, kept as u64);
        if kept == counted.len() {
            return false;
        }
        metrics.count_when(&self.route, false, (counted.len() - kept) as u64);
        let mut keep = counted.iter();
        self.limits.retain(|_| keep.next().is_some_and(|c| !c));
        let mut keep = counted.iter();
        self.keys.retain(|_| keep.next().is_some_and(|c| !c));
        true
    }

    /// Gives the request's units back to the limits left.
    async fn give_back(&self, limiter: &Limiter) {
        let charge = Charge {
            route: &self.route,
            client: &self.client,
            limits: &self.limits,
            keys: &self.keys,
            cost: 0,
            settle: Some(self.settlement),
        };
        if let Err(e) = limiter.settle(charge).await {
            tracing::warn!(
                route = &*self.route,
                error = %e,
                "an answer count_when does not count could not be given back: the request stays counted"
            );
        }
    }

    /// The answer is known: each limit it does not count gets the
    /// request's units back before the answer goes out, so the client's
    /// next request meets the limit as it stands.
    pub(crate) async fn settle(
        mut self: Box<Self>,
        answer: (u16, &HeaderMap),
        limiter: &Limiter,
        metrics: &Metrics,
    ) {
        if self.not_counted(answer, metrics) {
            self.give_back(limiter).await;
        }
    }

    /// The answer floodgate made itself (a refusal: the upstream down,
    /// late) is known: as [`Self::settle`], in a task of its own counted
    /// in `settlements` (a stop waits for it), which the caller awaits
    /// before the answer goes out and which ends its work even if the
    /// client leaves meanwhile.
    pub(crate) fn settle_apart(
        mut self: Box<Self>,
        answer: (u16, &HeaderMap),
        limiter: &Arc<Limiter>,
        settlements: &Arc<in_flight::Count>,
        metrics: &Metrics,
    ) -> Option<tokio::task::JoinHandle<()>> {
        if !self.not_counted(answer, metrics) {
            return None;
        }
        let runtime = tokio::runtime::Handle::try_current().ok()?;
        let limiter = Arc::clone(limiter);
        let counted = settlements.begin();
        Some(runtime.spawn(async move {
            self.give_back(&limiter).await;
            drop(counted);
        }))
    }
}
