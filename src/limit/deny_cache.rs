//! Remembers denials until their retry-after, so a client flooding far past
//! its limit costs one Redis call per retry-after period instead of one per
//! request.
//!
//! This is exact, not an approximation: a denied request consumes nothing,
//! and until the retry-after the store told has passed, nothing but units
//! given back can make a request needing as many units fit (other requests
//! only consume more). So:
//! - a request needing fewer units than the one refused may fit: it is not
//!   refused here but asked of the store;
//! - units given back (a usage settlement below its reservation) by any
//!   instance end the denials of the keys they came back to: the store
//!   tells every instance, on the channel `{key_prefix}:given-back`, the
//!   hash tag (route or budget, and client) of each key a settlement gave
//!   units back to, as part of the same atomic call ([`GivenBack`]); this
//!   instance's own settlements forget at once. A denial is remembered
//!   only while this instance listens to that channel, and a denial whose
//!   request was sent before a message for one of its keys arrived is not
//!   held (the message may tell of a settlement Redis ran after it).
//!
//! A message is in this instance's subscription socket before the
//! settlement that sent it returns, but the listener may read it later:
//! before refusing from memory, a [`Barrier`] round reads every message
//! already sent, and the denial is looked up again (see [`barrier`]).
//!
//! A denial holds only for a request facing the very limits it was refused
//! under: a client whose plan changed, or whose token carries another
//! number, is asked of the store.
//!
//! The deadline is counted from when the request was sent to Redis, which
//! is no later than the moment Redis decided, so the cache never denies for
//! longer than Redis would.
//!
//! The cache holds at most its capacity of denials; one that finds no room
//! is simply not remembered, which costs a Redis call per request of that
//! client and changes no decision.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;

use super::shards::{Shards, Slot};
use super::{Decision, Limit};
use crate::client::ClientId;
use crate::metrics::TableMetrics;

pub mod barrier;

pub use barrier::{Barrier, Subscription};

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
    /// The limits the request was refused under.
    limits: Box<[Limit]>,
    /// Units the refused request needed.
    cost: u64,
    sent: Instant,
    until: Instant,
    /// What [`GivenBack::mark`] said when the request was sent.
    mark: u64,
    /// The [`GivenBack`] buckets of the request's keys' hash tags.
    tags: Box<[u16]>,
}

/// Buckets hash tags fall into: a message for one tag ends the denials of
/// every tag in its bucket (one more store call for those, no other harm).
const BUCKETS: usize = 4096;

/// Where units were given back lately, as the store's messages tell this
/// instance: a sequence number per message, and for each bucket of hash
/// tags the number of the last message that named one of them. A denial
/// whose request was sent at mark `m` still holds while no bucket of its
/// keys has a message numbered above `m`, and this instance has listened
/// without a break since before `m`.
#[derive(Debug)]
pub struct GivenBack {
    /// The last message's number (or restart's, see [`Self::listening`]).
    seq: AtomicU64,
    buckets: Box<[AtomicU64]>,
    /// The number at which listening last (re)started: messages before it
    /// may have been missed.
    since: AtomicU64,
    /// Whether this instance listens now.
    live: AtomicBool,
    /// Messages heard (`floodgate_store_given_back_heard_total`).
    heard: Counter,
    /// 1 while listening (`floodgate_store_listening`).
    listening: Gauge,
    /// Reading every message already sent, before a refusal from memory.
    barrier: Barrier,
}

impl Default for GivenBack {
    fn default() -> Self {
        Self::new(Counter::default(), Gauge::default(), Counter::default())
    }
}

impl GivenBack {
    /// Not listening yet; counts the messages it hears in `heard`, shows
    /// whether it listens in `listening` and counts the PINGs its
    /// [`Barrier`] rounds cost in `barrier_pings`.
    pub fn new(heard: Counter, listening: Gauge, barrier_pings: Counter) -> Self {
        Self {
            seq: AtomicU64::new(0),
            buckets: (0..BUCKETS).map(|_| AtomicU64::new(0)).collect(),
            since: AtomicU64::new(0),
            live: AtomicBool::new(false),
            heard,
            listening,
            barrier: Barrier::new(barrier_pings),
        }
    }

    /// The rounds that read every message already sent.
    pub fn barrier(&self) -> &Barrier {
        &self.barrier
    }

    /// Waits, at most `within`, until every message the store sent this
    /// instance before this call has been read and noted; whether it was
    /// (see [`Barrier::passed`]).
    pub async fn caught_up(&self, within: Duration) -> bool {
        self.barrier.passed(within).await
    }

    /// The bucket of hash tag `tag`.
    pub fn bucket(tag: &[u8]) -> u16 {
        // FNV-1a: cheap, and a collision costs only a store call.
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in tag {
            hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        (hash % BUCKETS as u64) as u16
    }

    /// Taken when a request is sent to the store: `None` while this
    /// instance does not listen (then no denial is remembered).
    pub fn mark(&self) -> Option<u64> {
        if !self.live.load(Ordering::SeqCst) {
            return None;
        }
        Some(self.seq.load(Ordering::SeqCst))
    }

    /// The store told that units were given back under hash tag `tag`.
    pub fn note(&self, tag: &[u8]) {
        self.note_again(tag);
        self.heard.inc();
    }

    /// The store told again of units given back under `tag` (a cluster's
    /// message heard from a second node): noted, not counted as heard.
    pub fn note_again(&self, tag: &[u8]) {
        let n = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        self.buckets[usize::from(Self::bucket(tag))].fetch_max(n, Ordering::SeqCst);
    }

    /// Listening (again): messages sent before now may have been missed,
    /// so the denials remembered so far no longer hold.
    pub fn listening(&self) {
        let n = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
        self.since.store(n, Ordering::SeqCst);
        self.live.store(true, Ordering::SeqCst);
        self.listening.set(1);
    }

    /// Not listening: no denial holds, and none is remembered.
    pub fn deaf(&self) {
        self.live.store(false, Ordering::SeqCst);
        self.listening.set(0);
    }

    /// Whether this instance listens now.
    pub fn is_listening(&self) -> bool {
        self.live.load(Ordering::SeqCst)
    }

    /// Whether a denial of a request sent at `mark`, for keys in `tags`,
    /// still holds as far as units given back go.
    fn holds(&self, mark: u64, tags: &[u16]) -> bool {
        self.live.load(Ordering::SeqCst)
            && self.since.load(Ordering::SeqCst) <= mark
            && tags
                .iter()
                .all(|&b| self.buckets[usize::from(b)].load(Ordering::SeqCst) <= mark)
    }
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
    /// `route` facing `limits` at `now`, with its retry-after and reset
    /// shortened by the time that has passed: only when the request faces
    /// the limits the refused one did and needs at least its units, and no
    /// units were given back to its keys since (as far as `given_back`
    /// knows).
    pub fn get(
        &self,
        (route, client, limits): (&Arc<str>, &ClientId, &[Limit]),
        cost: u64,
        now: Instant,
        given_back: &GivenBack,
    ) -> Option<Decision> {
        let (map, hash) = self.shards.lock(route, client);
        let slot = map.get(&hash)?;
        let entry = &slot.value;
        if now >= entry.until
            || cost < entry.cost
            || *entry.limits != *limits
            || !slot.holds(route, client)
            || !given_back.holds(entry.mark, &entry.tags)
        {
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

    /// Remembers a denial decided under `limits` for a request of `cost`
    /// units sent to the store at `sent`, when [`GivenBack::mark`] said `mark` (nothing is
    /// remembered for `None`), whose keys' hash tags fall in the buckets
    /// `tags` makes (called only for a denial).
    pub fn insert(
        &self,
        (route, client, limits): (&Arc<str>, &ClientId, &[Limit]),
        cost: u64,
        (sent, mark): (Instant, Option<u64>),
        decision: Decision,
        tags: impl FnOnce() -> Box<[u16]>,
    ) {
        let Some(mark) = mark else {
            return;
        };
        if decision.allowed || decision.retry_after_ms == 0 {
            return;
        }
        let until = sent + std::time::Duration::from_millis(decision.retry_after_ms);
        let tags = tags();
        let (mut map, hash) = self.shards.lock(route, client);
        if !self.shards.has_room(&map, hash) {
            self.metrics.full.inc();
            return;
        }
        let entry = Entry {
            decision,
            limits: limits.into(),
            cost,
            sent,
            until,
            mark,
            tags,
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

    /// The limits requests are refused under here: a plan's 10 an hour.
    const FREE: [Limit; 1] = [Limit::new(
        crate::limit::Algorithm::SlidingLog,
        10,
        3_600_000,
    )];

    /// A denial whose retry-after is a minute away.
    fn refused_for_a_minute() -> Decision {
        Decision {
            allowed: false,
            retry_after_ms: 60_000,
            ..Decision::default()
        }
    }

    fn listening() -> GivenBack {
        let given_back = GivenBack::default();
        given_back.listening();
        given_back
    }

    fn tags(names: &[&str]) -> impl FnOnce() -> Box<[u16]> {
        let buckets: Box<[u16]> = names
            .iter()
            .map(|t| GivenBack::bucket(t.as_bytes()))
            .collect();
        move || buckets
    }

    #[test]
    fn a_denial_holds_until_its_retry_after_and_no_longer() {
        let cache = DenyCache::new();
        let given_back = listening();
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
        let mark = given_back.mark();
        cache.insert(
            (&route, &client, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["t"]),
        );
        let get =
            |route: &Arc<str>, client, at| cache.get((route, client, &FREE), 5, at, &given_back);
        let d = get(&route, &client, sent + Duration::from_millis(100));
        assert_eq!(d.map(|d| (d.retry_after_ms, d.next_ms)), Some((200, 800)));
        assert!(get(&route, &other, sent).is_none());
        assert!(get(&"s".into(), &client, sent).is_none());
        assert!(get(&route, &client, sent + Duration::from_millis(300)).is_none());
        cache.sweep(sent + Duration::from_millis(300));
        assert!(cache.is_empty());
    }

    #[test]
    fn a_request_needing_fewer_units_or_after_a_refund_is_not_refused() {
        let cache = DenyCache::new();
        let given_back = listening();
        let route: Arc<str> = "r".into();
        let client = ClientId::header("k");
        let sent = Instant::now();
        let denial = refused_for_a_minute();
        let mark = given_back.mark();
        cache.insert(
            (&route, &client, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["t"]),
        );
        let get = |cost| cache.get((&route, &client, &FREE), cost, sent, &given_back);
        assert!(get(4).is_none(), "4 units may fit");
        assert!(get(5).is_some());
        assert!(get(50).is_some());
        cache.forget(&route, &client);
        assert!(get(50).is_none(), "units came back");
    }

    #[test]
    fn a_request_facing_other_limits_is_asked_of_the_store() {
        let cache = DenyCache::new();
        let given_back = listening();
        let route: Arc<str> = "r".into();
        let client = ClientId::header("k");
        let sent = Instant::now();
        let denial = refused_for_a_minute();
        let mark = given_back.mark();
        cache.insert(
            (&route, &client, &FREE),
            1,
            (sent, mark),
            denial,
            tags(&["t"]),
        );
        // The client moved to a plan of 30 an hour: its count may fit.
        let pro = [Limit::new(
            crate::limit::Algorithm::SlidingLog,
            30,
            3_600_000,
        )];
        let get = |limits: &[Limit]| cache.get((&route, &client, limits), 1, sent, &given_back);
        assert!(get(&pro).is_none(), "another plan's limits");
        assert!(get(&FREE).is_some(), "the same limits");
    }

    #[test]
    fn units_given_back_by_any_instance_end_the_denials_of_their_keys() {
        let cache = DenyCache::new();
        let given_back = GivenBack::default();
        let route: Arc<str> = "r".into();
        let (a, b) = (ClientId::header("a"), ClientId::header("b"));
        let sent = Instant::now();
        let denial = refused_for_a_minute();
        // Not listening: nothing is remembered.
        let mark = given_back.mark();
        assert_eq!(mark, None);
        cache.insert(
            (&route, &a, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["{r:a}"]),
        );
        assert!(cache.is_empty());

        given_back.listening();
        let mark = given_back.mark();
        cache.insert(
            (&route, &a, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["{r:a}", "{g}"]),
        );
        cache.insert(
            (&route, &b, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["{r:b}"]),
        );
        let held = |client| {
            cache
                .get((&route, client, &FREE), 5, sent, &given_back)
                .is_some()
        };
        assert!(held(&a) && held(&b));
        // Units given back to a key of a's (the global one) end a's denial
        // only.
        given_back.note(b"{g}");
        assert!(!held(&a) && held(&b));
        // A message that arrived while b's request was on its way (after
        // its mark) ends the denial remembered from its answer.
        let mark = given_back.mark();
        given_back.note(b"{r:a}");
        cache.insert(
            (&route, &a, &FREE),
            5,
            (sent, mark),
            denial,
            tags(&["{r:a}"]),
        );
        assert!(!held(&a));
        // Listening broke: no denial holds, and once listening again the
        // ones from before do not come back (messages may have been lost).
        given_back.deaf();
        assert!(!held(&b));
        given_back.listening();
        assert!(!held(&b));
    }
}
