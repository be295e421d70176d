//! Remembers denials until their retry-after, so a client flooding far past
//! its limit costs one Redis call per retry-after period instead of one per
//! request.
//!
//! This is exact, not an approximation: a denied request consumes nothing,
//! and until the retry-after the store told has passed, nothing can make a
//! request needing as many units fit (other instances only consume more).
//! A request needing fewer units than the one refused may fit, so it is
//! not refused here but asked of the store; and when this instance gives
//! units back (a usage settlement below its reservation), the denial is
//! forgotten. (Units another instance gives back are seen once the denial
//! runs out.) The deadline is counted from when the request was sent to
//! Redis, which is no later than the moment Redis decided, so the cache
//! never denies for longer than Redis would.
//!
//! The cache holds at most its capacity of denials; one that finds no room
//! is simply not remembered, which costs a Redis call per request of that
//! client and changes no decision.

use std::sync::Arc;
use std::time::Instant;

use super::Decision;
use super::shards::{Shards, Slot};
use crate::client::ClientId;
use crate::metrics::TableMetrics;

const SHARDS: usize = 32;

/// Denials in force, by route and client.
#[derive(Debug)]
pub struct DenyCache {
    shards: Shards<Entry>,
    metrics: TableMetrics,
}

#[derive(Debug)]
struct Entry {
    decision: Decision,
    /// Units the refused request needed.
    cost: u64,
    sent: Instant,
    until: Instant,
}

impl Default for DenyCache {
    fn default() -> Self {
        Self::new()
    }
}

impl DenyCache {
    /// An empty cache of the default capacity.
    pub fn new() -> Self {
        Self::with_capacity(
            super::settings::DEFAULT_MAX_CLIENT_ENTRIES,
            TableMetrics::default(),
        )
    }

    /// An empty cache holding at most `entries` denials, counting its size
    /// and the denials it had no room for in `metrics`.
    pub fn with_capacity(entries: usize, metrics: TableMetrics) -> Self {
        Self {
            shards: Shards::new(SHARDS, entries),
            metrics,
        }
    }

    /// The denial in force for a request of `cost` units from `client` on
    /// `route` at `now`, with its retry-after and reset shortened by the
    /// time that has passed: only when the request needs at least the
    /// units of the one refused.
    pub fn get(
        &self,
        route: &Arc<str>,
        client: &ClientId,
        cost: u64,
        now: Instant,
    ) -> Option<Decision> {
        let (map, hash) = self.shards.lock(route, client);
        let slot = map.get(&hash)?;
        let entry = &slot.value;
        if now >= entry.until || cost < entry.cost || !slot.holds(route, client) {
            return None;
        }
        let passed = now.duration_since(entry.sent).as_millis() as u64;
        let d = entry.decision;
        Some(Decision {
            retry_after_ms: d.retry_after_ms.saturating_sub(passed).max(1),
            next_ms: d.next_ms.saturating_sub(passed),
            ..d
        })
    }

    /// Remembers a denial decided for a request of `cost` units sent to the
    /// store at `sent`.
    pub fn insert(
        &self,
        route: &Arc<str>,
        client: &ClientId,
        cost: u64,
        sent: Instant,
        decision: Decision,
    ) {
        if decision.allowed || decision.retry_after_ms == 0 {
            return;
        }
        let until = sent + std::time::Duration::from_millis(decision.retry_after_ms);
        let (mut map, hash) = self.shards.lock(route, client);
        if !self.shards.has_room(&map, hash) {
            self.metrics.full.inc();
            return;
        }
        let entry = Entry {
            decision,
            cost,
            sent,
            until,
        };
        map.insert(hash, Slot::new(route, client, entry));
    }

    /// Forgets the denial of `client` on `route`: units were given back.
    pub fn forget(&self, route: &Arc<str>, client: &ClientId) {
        let (mut map, hash) = self.shards.lock(route, client);
        if map.get(&hash).is_some_and(|slot| slot.holds(route, client)) {
            map.remove(&hash);
        }
    }

    /// Forgets denials that have run out.
    pub fn sweep(&self, now: Instant) {
        let remaining = self.shards.retain(|e| e.until > now);
        self.metrics.entries.set(remaining as i64);
    }

    /// Forgets everything (the rules changed).
    pub fn clear(&self) {
        self.shards.retain(|_| false);
    }

    /// Denials held.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// True when no denial is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_denial_holds_until_its_retry_after_and_no_longer() {
        let cache = DenyCache::new();
        let route: Arc<str> = "r".into();
        let client = ClientId::Addr([192, 0, 2, 1].into());
        let other = ClientId::Addr([192, 0, 2, 2].into());
        let sent = Instant::now();
        let denial = Decision {
            allowed: false,
            remaining: 0,
            next_ms: 900,
            retry_after_ms: 300,
            limit: 0,
            ..Decision::default()
        };
        cache.insert(&route, &client, 5, sent, denial);
        let d = cache.get(&route, &client, 5, sent + Duration::from_millis(100));
        assert_eq!(d.map(|d| (d.retry_after_ms, d.next_ms)), Some((200, 800)));
        assert!(cache.get(&route, &other, 5, sent).is_none());
        assert!(cache.get(&"s".into(), &client, 5, sent).is_none());
        assert!(
            cache
                .get(&route, &client, 5, sent + Duration::from_millis(300))
                .is_none()
        );
        cache.sweep(sent + Duration::from_millis(300));
        assert!(cache.is_empty());
    }

    #[test]
    fn a_request_needing_fewer_units_or_after_a_refund_is_not_refused() {
        let cache = DenyCache::new();
        let route: Arc<str> = "r".into();
        let client = ClientId::header("k");
        let sent = Instant::now();
        let denial = Decision {
            allowed: false,
            retry_after_ms: 60_000,
            ..Decision::default()
        };
        cache.insert(&route, &client, 5, sent, denial);
        assert!(
            cache.get(&route, &client, 4, sent).is_none(),
            "4 units may fit"
        );
        assert!(cache.get(&route, &client, 5, sent).is_some());
        assert!(cache.get(&route, &client, 50, sent).is_some());
        cache.forget(&route, &client);
        assert!(
            cache.get(&route, &client, 50, sent).is_none(),
            "units came back"
        );
    }
}
