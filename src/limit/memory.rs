//! The in-process store: exact for a single instance, and the fallback while
//! a shared store is unreachable.
//!
//! State lives in sharded maps keyed by route and client. A decision locks one
//! shard for a few hundred nanoseconds and never across an await. Entries
//! whose every limit has expired are swept, so memory follows the number of
//! clients active within a window, not the number ever seen.
//!
//! However many ids clients invent, the store holds at most its capacity of
//! (route, client) entries. A new client that finds its shard full is
//! counted in its route's overflow bucket, shared by every client without
//! room, until sweeping frees space: clients already counted keep their
//! state (evicting one would hand it a fresh limit), and newcomers stay
//! limited, together.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use super::algorithms::State;
use super::penalty::{Sentence, refused_for};
use super::shards::{Shards, Slot};
use super::{Charge, Decision, Limit, Verdict};
use crate::metrics::TableMetrics;

mod keyed;
mod operations;

use keyed::Held;

const SHARDS: usize = 64;

/// Counts limits in this process's memory.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Shards<Entry>,
    /// Per route, the bucket of clients that found no room.
    overflow: Mutex<HashMap<Arc<str>, Entry>>,
    metrics: TableMetrics,
}

#[derive(Debug)]
struct Entry {
    /// The limits the states count for; limits that count in other states
    /// (another algorithm or window) start the client afresh.
    limits: Box<[Limit]>,
    states: Box<[State]>,
    /// Each limit's penalty, if it has one running or offences remembered;
    /// empty while no limit has a penalty (see [`sentences_for`]).
    sentences: Box<[Sentence]>,
    expires_at: u64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store of the default capacity.
    pub fn new() -> Self {
        Self::with_capacity(
            super::settings::DEFAULT_MAX_CLIENT_ENTRIES,
            TableMetrics::default(),
        )
    }

    /// An empty store holding at most `entries` (route, client) entries,
    /// counting its size and the clients it had no room for in `metrics`.
    pub fn with_capacity(entries: usize, metrics: TableMetrics) -> Self {
        Self {
            shards: Shards::new(SHARDS, entries),
            overflow: Mutex::new(HashMap::new()),
            metrics,
        }
    }

    /// Decides `charge` at time `now` (milliseconds): all of its limits allow
    /// and are consumed, or none is.
    pub fn decide_at(&self, charge: Charge<'_>, now: u64) -> Decision {
        if !charge.keys.is_empty() && charge.keys.len() == charge.limits.len() {
            return self.decide_keyed(charge, now);
        }
        let (route, client) = (charge.route, charge.client);
        let (mut map, hash) = self.shards.lock(route, client);
        if !self.shards.has_room(&map, hash) {
            drop(map);
            self.metrics.full.inc();
            let mut overflow = self.overflow.lock().unwrap_or_else(PoisonError::into_inner);
            let entry = overflow
                .entry(Arc::clone(route))
                .or_insert_with(|| Entry::new(charge.limits));
            return entry.decide(charge, now);
        }
        let slot = map
            .entry(hash)
            .or_insert_with(|| Slot::new(route, client, Entry::new(charge.limits)));
        if !slot.holds(route, client) {
            *slot = Slot::new(route, client, Entry::new(charge.limits));
        }
        slot.value.decide(charge, now)
    }

    /// Decides (or settles) a charge whose limits count different keys:
    /// each limit is an entry of its own, keyed by its [`CountKey`]. The
    /// shards holding them are locked together, in shard order (so two
    /// decisions never wait on each other in a circle), every limit is
    /// checked, and all are consumed only if all allow.
    fn decide_keyed(&self, charge: Charge<'_>, now: u64) -> Decision {
        let mut held = self.lock_keyed(charge.keys);
        self.make_entries(&mut held, &charge);
        let mut decision = match charge.settle {
            Some(settle) => held.settle(&charge, now, settle),
            None => held.check_and_consume(&charge, now),
        };
        decision.at_ms = now;
        decision
    }

    /// Locks the shards holding `keys`' entries, in shard order.
    fn lock_keyed(&self, keys: &[super::CountKey]) -> Held<'_> {
        let places: Vec<(usize, u64)> = keys
            .iter()
            .map(|k| self.shards.place(&k.entry, &k.client))
            .collect();
        let mut order: Vec<usize> = places.iter().map(|&(shard, _)| shard).collect();
        order.sort_unstable();
        order.dedup();
        let guards: Vec<_> = order.iter().map(|&i| self.shards.lock_shard(i)).collect();
        Held {
            guards,
            overflow: None,
            order,
            in_overflow: vec![false; keys.len()],
            places,
        }
    }

    /// Gives each limit of `charge` its entry, counting by that limit: in
    /// its shard, or its scope's overflow bucket when the shard is full.
    fn make_entries<'a>(&'a self, held: &mut Held<'a>, charge: &Charge<'_>) {
        for (i, (key, &(shard, hash))) in charge.keys.iter().zip(&held.places).enumerate() {
            let limit = std::slice::from_ref(&charge.limits[i]);
            let map = &mut held.guards[held.order.partition_point(|&s| s < shard)];
            if !self.shards.has_room(map, hash) {
                self.metrics.full.inc();
                held.in_overflow[i] = true;
                let bucket = held
                    .overflow
                    .get_or_insert_with(|| {
                        self.overflow.lock().unwrap_or_else(PoisonError::into_inner)
                    })
                    .entry(Arc::clone(&key.entry))
                    .or_insert_with(|| Entry::new(limit));
                bucket.adopt(limit);
                continue;
            }
            let slot = map
                .entry(hash)
                .or_insert_with(|| Slot::new(&key.entry, &key.client, Entry::new(limit)));
            if slot.holds(&key.entry, &key.client) {
                slot.value.adopt(limit);
            } else {
                *slot = Slot::new(&key.entry, &key.client, Entry::new(limit));
            }
        }
    }

    /// Forgets every client whose state has expired by `now`; returns how
    /// many entries remain.
    pub fn sweep(&self, now: u64) -> usize {
        self.overflow
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|_, e| e.expires_at > now);
        let remaining = self.shards.retain(|e| e.expires_at > now);
        self.metrics.entries.set(remaining as i64);
        remaining
    }

    /// Number of (route, client) entries held, overflow buckets aside.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A refused request's verdicts: each limit that would have allowed it
/// reads again, taking nothing (`check` of its index at cost 0), so that
/// every verdict is what the store holds after the refusal.
fn untaken(verdicts: &mut [Verdict], mut check: impl FnMut(usize) -> Verdict) {
    for (i, v) in verdicts.iter_mut().enumerate() {
        if v.allowed {
            *v = Verdict {
                allowed: true,
                retry_after_ms: 0,
                ..check(i)
            };
        }
    }
}

/// Settles a reservation in `state` (or makes an operator's grant).
fn settle_state(state: &mut State, limit: &Limit, now: u64, settle: super::Settlement, cost: u64) {
    if settle.kind == super::Settled::Grant {
        state.grant(limit, now, settle.reserved);
    } else if settle.kind == super::Settled::GiveBack {
        state.settle(limit, now, settle.at_ms, limit.cost_of(settle.reserved), 0);
    } else {
        state.settle(limit, now, settle.at_ms, settle.reserved, cost);
    }
}

/// A penalty's place for each of `limits` when one of them has a penalty;
/// none when no limit has one (the common case costs nothing).
fn sentences_for(limits: &[Limit]) -> Box<[Sentence]> {
    if limits.iter().any(|l| l.penalty.is_some()) {
        vec![Sentence::default(); limits.len()].into()
    } else {
        Box::default()
    }
}

/// Whether two lists of limits count in the same states: the same
/// algorithms over the same windows, as a Redis key names them. Their
/// numbers may differ (a plan changed, a claim carries another number, a
/// reload raised a limit): the count so far still holds.
fn same_states(a: &[Limit], b: &[Limit]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.algorithm == y.algorithm && x.window_ms == y.window_ms)
}

impl Entry {
    /// Counts by `limits` from now on: starts afresh when they count in
    /// other states, else keeps the count and takes their numbers.
    fn adopt(&mut self, limits: &[Limit]) {
        if !same_states(&self.limits, limits) {
            *self = Entry::new(limits);
        } else if *self.limits != *limits {
            self.limits = limits.into();
            if self.sentences.len() != limits.len() {
                self.sentences = sentences_for(limits);
            }
        }
    }

    fn new(limits: &[Limit]) -> Self {
        Self {
            limits: limits.into(),
            states: limits.iter().map(|l| State::new(l.algorithm)).collect(),
            sentences: sentences_for(limits),
            expires_at: 0,
        }
    }

    /// Limit `i`'s verdict on `cost` units at `now`: refused to its end
    /// while its penalty runs, else as its count says.
    fn judge(&mut self, i: usize, limit: &Limit, now: u64, cost: u64) -> Verdict {
        if limit.penalty.is_some()
            && let Some(wait) = self.sentences.get(i).and_then(|s| s.running(now))
        {
            return refused_for(wait);
        }
        self.states[i].check(limit, now, cost)
    }

    /// When limit `i`'s remembered offences are forgotten (0: none).
    fn remembered_until(&self, i: usize) -> u64 {
        self.sentences.get(i).map_or(0, |s| s.remembered_until)
    }

    /// A refused request's offence against limit `i`, when the limit
    /// itself refused it (`verdict`) and has a penalty: its penalty starts,
    /// told in the verdict.
    fn offended(&mut self, i: usize, limit: &Limit, now: u64, verdict: &mut Verdict) {
        let Some(penalty) = &limit.penalty else {
            return;
        };
        let Some(sentence) = self.sentences.get_mut(i) else {
            return;
        };
        if verdict.allowed || sentence.running(now).is_some() {
            return;
        }
        let serves = sentence.offend(penalty, now);
        *verdict = refused_for(serves);
        self.expires_at = self.expires_at.max(sentence.remembered_until);
    }

    /// Decides (or settles) `charge` at `now` against this entry's states.
    fn decide(&mut self, charge: Charge<'_>, now: u64) -> Decision {
        self.adopt(charge.limits);
        let mut decision = match charge.settle {
            None => self.check_and_consume(charge, now),
            Some(settle) => {
                let states = self.states.iter_mut().zip(charge.limits);
                Decision::combine_kinds(states.map(|(state, limit)| {
                    if !limit.counts_requests || settle.kind == super::Settled::GiveBack {
                        settle_state(state, limit, now, settle, charge.cost);
                    }
                    let verdict = Verdict {
                        allowed: true,
                        retry_after_ms: 0,
                        ..state.check(limit, now, 0)
                    };
                    (limit.counts_requests, verdict)
                }))
            }
        };
        decision.at_ms = now;
        self.refresh_expiry(charge.limits);
        decision
    }

    /// When this entry stops mattering: when the last of its states (and
    /// remembered offences) does.
    fn refresh_expiry(&mut self, limits: &[Limit]) {
        let states = self.states.iter().zip(limits).map(|(s, l)| s.expires_at(l));
        let sentences = self.sentences.iter().map(|s| s.remembered_until);
        self.expires_at = states.chain(sentences).max().unwrap_or(0);
    }

    /// Decides `charge` at `now`: every limit checked, then consumed from
    /// all if all allow.
    fn check_and_consume(&mut self, charge: Charge<'_>, now: u64) -> Decision {
        let mut in_hand = [Verdict::default(); 8];
        let mut more = Vec::new();
        let verdicts: &mut [Verdict] = if charge.limits.len() <= in_hand.len() {
            &mut in_hand[..charge.limits.len()]
        } else {
            more.resize(charge.limits.len(), Verdict::default());
            &mut more
        };
        for (i, (v, limit)) in verdicts.iter_mut().zip(charge.limits).enumerate() {
            *v = self.judge(i, limit, now, limit.cost_of(charge.cost));
        }
        let kinds = charge.limits.iter().map(|l| l.counts_requests);
        let decision = Decision::combine_kinds(kinds.clone().zip(verdicts.iter().copied()));
        if !decision.allowed {
            for (i, (v, limit)) in verdicts.iter_mut().zip(charge.limits).enumerate() {
                self.offended(i, limit, now, v);
            }
            let states = &mut self.states;
            untaken(verdicts, |i| states[i].check(&charge.limits[i], now, 0));
            return Decision::combine_kinds(kinds.zip(verdicts.iter().copied()));
        }
        for (state, limit) in self.states.iter_mut().zip(charge.limits) {
            state.consume(limit, now, limit.cost_of(charge.cost));
        }
        decision
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::client::ClientId;
    use crate::limit::Algorithm;

    fn charge<'a>(route: &'a Arc<str>, client: &'a ClientId, limits: &'a [Limit]) -> Charge<'a> {
        Charge {
            route,
            client,
            limits,
            keys: &[],
            cost: 1,
            settle: None,
        }
    }

    #[test]
    fn a_calendar_windows_total_is_kept_once_it_closes() {
        let route: Arc<str> = "api".into();
        let (a, b) = (ClientId::header("a"), ClientId::header("b"));
        let mut limit = Limit::new(Algorithm::FixedWindow, 100, 60_000);
        limit.bounds = Some([0, 60_000, 120_000, 180_000]);
        let limits = [limit];
        let store = MemoryStore::new();
        let cost = |client, cost| Charge {
            cost,
            ..charge(&route, client, &limits)
        };
        assert!(store.decide_at(cost(&a, 3), 60_001).allowed);
        assert!(store.decide_at(cost(&a, 4), 60_002).allowed);
        assert!(store.decide_at(cost(&b, 5), 60_003).allowed);
        // The window closes; a comes back, b does not.
        assert!(store.decide_at(cost(&a, 2), 120_001).allowed);
        let mut kept = store.kept("api", 0, None, &limit, 120_002);
        kept.sort_by_key(|k| (k.closed, k.start, k.units));
        let seen: Vec<(u64, u64, u64, bool)> = kept
            .iter()
            .map(|k| (k.start, k.end, k.units, k.closed))
            .collect();
        assert_eq!(
            seen,
            [
                (120_000, 180_000, 2, false),
                (60_000, 120_000, 5, true),
                (60_000, 120_000, 7, true),
            ]
        );
    }

    #[test]
    fn a_peek_reads_each_limit_and_takes_nothing() {
        let route: Arc<str> = "api".into();
        let client = ClientId::Addr([192, 0, 2, 1].into());
        let other = ClientId::Addr([192, 0, 2, 2].into());
        let limits = [
            Limit::new(Algorithm::FixedWindow, 10, 60_000),
            Limit::new(Algorithm::SlidingLog, 4, 60_000),
        ];
        let store = MemoryStore::new();
        let c = charge(&route, &client, &limits);
        for t in 0..3 {
            assert!(store.decide_at(c, t).allowed);
        }
        let remaining = |client| -> Vec<u64> {
            store
                .peek_at(charge(&route, client, &limits), 10)
                .iter()
                .map(|s| s.verdict.remaining)
                .collect()
        };
        assert_eq!(remaining(&client), [7, 1]);
        assert_eq!(remaining(&client), [7, 1], "a peek took something");
        assert_eq!(remaining(&other), [10, 4]);
        assert_eq!(store.len(), 1, "a peek made an entry");
        let d = store.decide_at(c, 10);
        assert_eq!((d.allowed, d.remaining), (true, 0));
    }

    #[test]
    fn a_denial_by_one_limit_consumes_nothing_from_the_others() {
        let route: Arc<str> = "api".into();
        let client = ClientId::Addr([192, 0, 2, 1].into());
        let limits = [
            Limit::new(Algorithm::SlidingLog, 10, 60_000),
            Limit::new(Algorithm::FixedWindow, 2, 1_000),
        ];
        let store = MemoryStore::new();
        let c = charge(&route, &client, &limits);
        assert!(store.decide_at(c, 0).allowed);
        assert!(store.decide_at(c, 1).allowed);
        for t in 2..10 {
            assert!(!store.decide_at(c, t).allowed);
        }
        // Eight denials took nothing from the 10-per-minute limit: 8 left.
        let d = store.decide_at(c, 1_000);
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining), (1, 1));
        let d = store.decide_at(c, 1_001);
        assert_eq!((d.limit, d.remaining), (1, 0));
        // Two per second until the log's ten are used up at 4_001.
        for t in [2_000, 2_001, 3_000, 3_001, 4_000] {
            assert!(store.decide_at(c, t).allowed, "at {t}");
        }
        let d = store.decide_at(c, 4_001);
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining), (0, 0));
        let d = store.decide_at(c, 5_000);
        assert!(!d.allowed);
        assert_eq!((d.limit, d.retry_after_ms), (0, 55_000));
    }

    #[test]
    fn a_refused_request_reports_every_limit_as_it_stands_nothing_taken() {
        let route: Arc<str> = "api".into();
        let client = ClientId::Addr([192, 0, 2, 1].into());
        let limits = [
            Limit::new(Algorithm::FixedWindow, 2, 1_000).counting_requests(),
            Limit::new(Algorithm::SlidingLog, 100, 60_000),
        ];
        let store = MemoryStore::new();
        let c = Charge {
            cost: 30,
            ..charge(&route, &client, &limits)
        };
        assert!(store.decide_at(c, 0).allowed);
        assert!(store.decide_at(c, 1).allowed);
        // Refused by the requests' limit: the tokens' still holds 40.
        let d = store.decide_at(c, 2);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 0, 0));
        let other = d.other.expect("the tokens' limit");
        assert_eq!((other.limit, other.remaining), (1, 40));
        // Refused by the tokens' limit: the requests' still holds 2.
        let d = store.decide_at(Charge { cost: 50, ..c }, 1_000);
        assert_eq!((d.allowed, d.limit, d.remaining), (false, 1, 40));
        let other = d.other.expect("the requests' limit");
        assert_eq!((other.limit, other.remaining), (0, 2));
    }

    #[test]
    fn new_clients_past_the_capacity_share_one_bucket_and_counted_ones_keep_theirs() {
        let route: Arc<str> = "api".into();
        let limits = [Limit::new(Algorithm::FixedWindow, 2, 1_000)];
        let metrics = TableMetrics::default();
        let store = MemoryStore::with_capacity(64, metrics.clone());
        let client = |i: u32| ClientId::Addr(std::net::Ipv4Addr::from(i).into());
        // A counted client at its limit.
        let first = client(0);
        assert!(store.decide_at(charge(&route, &first, &limits), 0).allowed);
        assert!(store.decide_at(charge(&route, &first, &limits), 0).allowed);
        // A flood of new ids fills the table; the rest share one bucket.
        let admitted = (1..10_000)
            .filter(|&i| {
                store
                    .decide_at(charge(&route, &client(i), &limits), 1)
                    .allowed
            })
            .count();
        assert!(store.len() <= 64, "{} entries", store.len());
        assert!(metrics.full.get() > 9_000, "{} refused", metrics.full.get());
        // Each with room was admitted; the overflow bucket admitted 2 in all.
        assert_eq!(admitted, store.len() - 1 + 2);
        // The counted client was not evicted: still at its limit.
        assert!(!store.decide_at(charge(&route, &first, &limits), 2).allowed);
        // Once swept, new clients find room again.
        store.sweep(1_000);
        assert_eq!(metrics.entries.get(), 0);
        assert!(
            store
                .decide_at(charge(&route, &client(20_000), &limits), 1_000)
                .allowed
        );
        assert_eq!(store.len(), 1);
    }

    #[test]
    fn expired_clients_are_swept() {
        let route: Arc<str> = "api".into();
        let limits = [Limit::new(Algorithm::SlidingLog, 1, 1_000)];
        let store = MemoryStore::new();
        for i in 0..10_000u32 {
            let client = ClientId::Addr(std::net::Ipv4Addr::from(i).into());
            store.decide_at(charge(&route, &client, &limits), 500);
        }
        assert_eq!(store.len(), 10_000);
        assert_eq!(store.sweep(1_499), 10_000);
        assert_eq!(store.sweep(1_500), 0);
    }
}
