//! Deciding a route with leased limits: each leased limit from the slice
//! this instance holds of its key (see [`crate::limit::leases`]), the
//! others (and a leased key near its end) by the store, all or nothing;
//! and the keeper that gives back what slices did not spend.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Answer, Guarded};
use crate::clock::now_ms;
use crate::limit::leases::{Key, Lease, Slice, Take};
use crate::limit::{Backend, Charge, CountKey, Decision, Limit, Settlement, Verdict};

/// How often one request tries its lease before it is decided per request
/// instead (a refill that keeps ending without a slice for it).
const ATTEMPTS: usize = 3;

/// Units a request took from a slice, to give back if another limit
/// refuses it.
struct Taken {
    lease: Arc<Lease>,
    units: u64,
    generation: u64,
}

/// Clears a lease's refill when the request refilling it stops, however
/// it stops (done, or its future dropped mid-call): the requests waiting
/// on it must not wait for ever.
struct Refilling<'a>(&'a Lease);

impl Drop for Refilling<'_> {
    fn drop(&mut self) {
        self.0.refill_ended();
    }
}

impl<B: Backend> Guarded<B> {
    /// Decides `charge`, a route with at least one leased limit.
    pub(super) async fn decide_leased(&self, charge: Charge<'_>) -> Answer {
        let mut taken: Vec<Taken> = Vec::new();
        let mut verdicts: Vec<Option<Verdict>> = vec![None; charge.limits.len()];
        for (i, limit) in charge.limits.iter().enumerate() {
            let Some(terms) = limit.lease else {
                continue;
            };
            let Some(lease) = self.leases.get(lease_key(&charge, i), terms) else {
                continue;
            };
            let units = limit.cost_of(charge.cost);
            match self.take_from(&lease, units).await {
                Take::Took(verdict, generation) => {
                    verdicts[i] = Some(verdict);
                    taken.push(Taken {
                        lease,
                        units,
                        generation,
                    });
                }
                Take::Refused(verdict) => {
                    verdicts[i] = Some(verdict);
                    break;
                }
                _ => {}
            }
        }
        let refused = verdicts.iter().flatten().any(|v| !v.allowed);
        if refused {
            give_back(&taken);
            return Answer::Decided(self.combined(&charge, &verdicts, None));
        }
        if taken.is_empty() {
            return self.decide_plain(charge).await;
        }
        // The limits no slice decided go to the store, as a charge of
        // their own with their keys named.
        let rest: Vec<usize> = (0..charge.limits.len())
            .filter(|&i| verdicts[i].is_none())
            .collect();
        if rest.is_empty() {
            for t in &taken {
                t.lease.metrics().admitted.inc();
            }
            return Answer::Decided(self.combined(&charge, &verdicts, None));
        }
        let limits: Vec<Limit> = rest.iter().map(|&i| charge.limits[i]).collect();
        let keys: Vec<CountKey> = rest.iter().map(|&i| count_key(&charge, i)).collect();
        let answer = self
            .decide_plain(Charge {
                limits: &limits,
                keys: &keys,
                ..charge
            })
            .await;
        match answer {
            Answer::Decided(d) => {
                if d.allowed {
                    for t in &taken {
                        t.lease.metrics().admitted.inc();
                    }
                } else {
                    give_back(&taken);
                }
                Answer::Decided(self.combined(&charge, &verdicts, Some((&rest, d))))
            }
            Answer::Unavailable { deny, .. } => {
                if deny {
                    give_back(&taken);
                }
                answer
            }
        }
    }

    /// Takes `units` from `lease`, refilling it when this request is the
    /// one to; `Take::PerRequest` when the key is to be decided by the
    /// store.
    async fn take_from(&self, lease: &Lease, units: u64) -> Take {
        for _ in 0..ATTEMPTS {
            let refilled = lease.refilled.notified();
            tokio::pin!(refilled);
            refilled.as_mut().enable();
            match lease.take(units, Instant::now()) {
                Take::Wait => {
                    // A refill that hangs ends at the store's deadline;
                    // this bounds the wait whatever happens to it.
                    let _ = tokio::time::timeout(self.store.timeout() * 2, refilled).await;
                }
                Take::Refill(size, old) => {
                    let _refilling = Refilling(lease);
                    if let Some(old) = old {
                        self.give_back_slice(lease, old).await;
                    }
                    self.refill(lease, size).await;
                }
                done => return done,
            }
        }
        Take::PerRequest
    }

    /// Asks the store for a slice of `size` units of `lease`'s key.
    async fn refill(&self, lease: &Lease, size: u64) {
        let key = &lease.key;
        let terms = SliceTerms::of(key);
        let charge = terms.charge(key, size, None);
        let asked = Instant::now();
        match self.ask_store(charge, now_ms()).await {
            Ok(d) if d.allowed => {
                lease.filled(size, d.at_ms, asked, d.remaining, d.next_ms);
                self.leases.taken.notify_one();
            }
            Ok(d) => lease.short(size, asked, (d.at_ms, d.remaining), d.retry_after_ms),
            Err(_) => lease.failed(asked),
        }
    }

    /// Gives back to the store what `slice` of `lease` did not spend,
    /// with the store's own settlement; what is left when its window has
    /// ended is lost, and counted so.
    async fn give_back_slice(&self, lease: &Lease, slice: Slice) {
        if slice.left == 0 {
            return;
        }
        let metrics = lease.metrics();
        let key = &lease.key;
        let window = !key.limit.algorithm.has_burst();
        if window && (slice.ends_with_window(Instant::now()) || ended(&key.limit, slice.at_ms)) {
            metrics.units_lost.inc_by(slice.left);
            return;
        }
        let terms = SliceTerms::of(key);
        let settlement = Settlement {
            at_ms: slice.at_ms,
            reserved: slice.size,
            local: false,
            kind: crate::limit::Settled::Reservation,
        };
        let charge = terms.charge(key, slice.size - slice.left, Some(settlement));
        match self.ask_store(charge, now_ms()).await {
            Ok(_) => {
                metrics.returned.inc();
                // The settlement tells every instance, whose remembered
                // denials of the key end.
                metrics.units_returned.inc_by(slice.left);
            }
            // The store keeps them until the window ends (or the bucket
            // refills): not admitted by anyone.
            Err(_) => {
                metrics.units_lost.inc_by(slice.left);
            }
        }
    }

    /// Gives back, for ever, what slices leave when they are up (or, with
    /// `all`, once, every slice held: a reload or a stop).
    pub(super) async fn keep_leases(&self) {
        loop {
            let next = self.leases.next_lapse();
            let woken = self.leases.taken.notified();
            match next {
                Some(at) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(at.into()) => {}
                        () = woken => continue,
                    }
                }
                None => {
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        () = woken => continue,
                    }
                }
            }
            self.return_lapsed(false).await;
        }
    }

    /// Gives back what the slices that are up (or all, with `all`) left.
    pub(super) async fn return_lapsed(&self, all: bool) {
        for (lease, slice) in self.leases.lapsed(Instant::now(), all) {
            self.give_back_slice(&lease, slice).await;
        }
    }

    /// The route's decision from the slices' verdicts and, when the store
    /// decided the limits at `rest`, its decision.
    fn combined(
        &self,
        charge: &Charge<'_>,
        verdicts: &[Option<Verdict>],
        store: Option<(&[usize], Decision)>,
    ) -> Decision {
        let mut all: Vec<(usize, bool, Verdict)> = verdicts
            .iter()
            .enumerate()
            .filter_map(|(i, v)| v.map(|v| (i, charge.limits[i].counts_requests, v)))
            .collect();
        if let Some((rest, d)) = &store {
            let at = |i: usize| rest.get(i).copied().unwrap_or(0);
            all.push((
                at(d.limit),
                charge.limits[at(d.limit)].counts_requests,
                Verdict {
                    allowed: d.allowed,
                    remaining: d.remaining,
                    next_ms: d.next_ms,
                    retry_after_ms: d.retry_after_ms,
                },
            ));
            if let Some(o) = d.other {
                let i = at(usize::from(o.limit));
                all.push((
                    i,
                    charge.limits[i].counts_requests,
                    Verdict {
                        allowed: true,
                        remaining: o.remaining,
                        next_ms: o.next_ms,
                        retry_after_ms: 0,
                    },
                ));
            }
        }
        all.sort_unstable_by_key(|&(i, ..)| i);
        let mut decision = Decision::combine_at(all);
        match store {
            Some((_, d)) => {
                decision.at_ms = d.at_ms;
                decision.local = d.local;
            }
            None => decision.at_ms = now_ms(),
        }
        decision
    }
}

/// Gives units taken from slices back to them: another limit refused.
fn give_back(taken: &[Taken]) {
    for t in taken {
        t.lease.untake(t.units, t.generation);
    }
}

/// Whether the window `at_ms` fell in has ended, by this instance's clock.
fn ended(limit: &Limit, at_ms: u64) -> bool {
    let (start, len) = limit.span(at_ms);
    now_ms() >= start + len
}

/// What a slice of a key is asked for and settled as: its limit, with the
/// slice's size as its cost whatever the limit counts, and its key named.
/// (The key's in-process entry name is not used on the shared store.)
struct SliceTerms {
    limit: Limit,
    keys: [CountKey; 1],
}

impl SliceTerms {
    fn of(key: &Key) -> Self {
        Self {
            limit: Limit {
                counts_requests: false,
                ..key.limit
            },
            keys: [CountKey::new(
                &key.scope,
                &key.scope,
                key.index,
                key.client.clone(),
            )],
        }
    }

    /// The charge of `cost` units (or the settlement) of a slice of `key`.
    fn charge<'a>(&'a self, key: &'a Key, cost: u64, settle: Option<Settlement>) -> Charge<'a> {
        Charge {
            route: &key.scope,
            client: &key.client,
            limits: std::slice::from_ref(&self.limit),
            keys: &self.keys,
            cost,
            settle,
        }
    }
}

/// The lease key of limit `i` of `charge`.
fn lease_key(charge: &Charge<'_>, i: usize) -> Key {
    match charge.keys.get(i) {
        Some(k) => Key {
            scope: Arc::clone(&k.scope),
            client: k.client.clone(),
            index: k.index,
            limit: charge.limits[i],
        },
        None => Key {
            scope: Arc::clone(charge.route),
            client: charge.client.clone(),
            index: i,
            limit: charge.limits[i],
        },
    }
}

/// Whose count limit `i` of `charge` is, named.
fn count_key(charge: &Charge<'_>, i: usize) -> CountKey {
    match charge.keys.get(i) {
        Some(k) => k.clone(),
        None => CountKey::new(charge.route, charge.route, i, charge.client.clone()),
    }
}
