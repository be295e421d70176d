//! The in-process store: exact for a single instance, and the fallback while
//! a shared store is unreachable.
//!
//! State lives in sharded maps keyed by route and client. A decision locks one
//! shard for a few hundred nanoseconds and never across an await. Entries
//! whose every limit has expired are swept, so memory follows the number of
//! clients active within a window, not the number ever seen.

use super::algorithms::State;
use super::shards::{Shards, Slot};
use super::{Charge, Decision, Limit, Store, StoreError, Verdict, now_ms};

const SHARDS: usize = 64;

/// Counts limits in this process's memory.
#[derive(Debug)]
pub struct MemoryStore {
    shards: Shards<Entry>,
}

#[derive(Debug)]
struct Entry {
    /// The limits the states were made for; a reload that changes them
    /// starts the client afresh.
    limits: Box<[Limit]>,
    states: Box<[State]>,
    expires_at: u64,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self {
            shards: Shards::new(SHARDS),
        }
    }

    /// Decides `charge` at time `now` (milliseconds): all of its limits allow
    /// and are consumed, or none is.
    pub fn decide_at(&self, charge: Charge<'_>, now: u64) -> Decision {
        let (route, client) = (charge.route, charge.client);
        let (mut map, hash) = self.shards.lock(route, client);
        let slot = map
            .entry(hash)
            .or_insert_with(|| Slot::new(route, client, Entry::new(charge.limits)));
        if !slot.holds(route, client) || *slot.value.limits != *charge.limits {
            *slot = Slot::new(route, client, Entry::new(charge.limits));
        }
        let entry = &mut slot.value;
        let mut verdicts = [Verdict::default(); 8];
        let decision = if charge.limits.len() <= verdicts.len() {
            for (i, (state, limit)) in entry.states.iter_mut().zip(charge.limits).enumerate() {
                verdicts[i] = state.check(limit, now, charge.cost);
            }
            Decision::combine(verdicts[..charge.limits.len()].iter().copied())
        } else {
            let verdicts: Vec<Verdict> = entry
                .states
                .iter_mut()
                .zip(charge.limits)
                .map(|(state, limit)| state.check(limit, now, charge.cost))
                .collect();
            Decision::combine(verdicts)
        };
        if decision.allowed {
            for (state, limit) in entry.states.iter_mut().zip(charge.limits) {
                state.consume(limit, now, charge.cost);
            }
        }
        entry.expires_at = entry
            .states
            .iter()
            .zip(charge.limits)
            .map(|(s, l)| s.expires_at(l))
            .max()
            .unwrap_or(0);
        decision
    }

    /// Forgets every client whose state has expired by `now`; returns how
    /// many entries remain.
    pub fn sweep(&self, now: u64) -> usize {
        self.shards.retain(|e| e.expires_at > now)
    }

    /// Number of (route, client) entries held.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Entry {
    fn new(limits: &[Limit]) -> Self {
        Self {
            limits: limits.into(),
            states: limits.iter().map(|l| State::new(l.algorithm)).collect(),
            expires_at: 0,
        }
    }
}

impl Store for MemoryStore {
    async fn decide(&self, charge: Charge<'_>) -> Result<Decision, StoreError> {
        Ok(self.decide_at(charge, now_ms()))
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
            cost: 1,
        }
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
