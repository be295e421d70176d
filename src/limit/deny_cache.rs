//! Remembers denials until their retry-after, so a client flooding far past
//! its limit costs one Redis call per retry-after period instead of one per
//! request.
//!
//! This is exact, not an approximation: a denied request consumes nothing,
//! and until the retry-after the store told has passed, nothing can make the
//! same request fit (other instances only consume more). The deadline is
//! counted from when the request was sent to Redis, which is no later than
//! the moment Redis decided, so the cache never denies for longer than Redis
//! would.
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

    /// The denial in force for `route` and `client` at `now`, with its
    /// retry-after and reset shortened by the time that has passed.
    pub fn get(&self, route: &Arc<str>, client: &ClientId, now: Instant) -> Option<Decision> {
        let (map, hash) = self.shards.lock(route, client);
        let slot = map.get(&hash)?;
        let entry = &slot.value;
        if now >= entry.until || !slot.holds(route, client) {
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

    /// Remembers a denial decided for a request sent to the store at `sent`.
    pub fn insert(&self, route: &Arc<str>, client: &ClientId, sent: Instant, decision: Decision) {
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
            sent,
            until,
        };
        map.insert(hash, Slot::new(route, client, entry));
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
        cache.insert(&route, &client, sent, denial);
        let d = cache.get(&route, &client, sent + Duration::from_millis(100));
        assert_eq!(d.map(|d| (d.retry_after_ms, d.next_ms)), Some((200, 800)));
        assert!(cache.get(&route, &other, sent).is_none());
        assert!(cache.get(&"s".into(), &client, sent).is_none());
        assert!(
            cache
                .get(&route, &client, sent + Duration::from_millis(300))
                .is_none()
        );
        cache.sweep(sent + Duration::from_millis(300));
        assert!(cache.is_empty());
    }
}
