//! How many requests a route may have in flight at once, per instance.
//!
//! Rates say how often; a cap on requests in flight says how many at once,
//! which is what keeps a slowing upstream from drowning in a burst of slow
//! requests that each fit the rate. A route's [`Capacity`] hands out
//! [`Slot`]s: one per request, held for the whole exchange (the response
//! body streamed, an upgraded connection's tunnel) and given back when the
//! last holder drops it, on every path out. A request that finds no free
//! slot waits in a bounded queue for at most `queue_timeout`, or is refused
//! at once.
//!
//! The cap is fixed (`max_in_flight`), or adaptive: it follows the
//! upstream's latency the way Envoy's adaptive concurrency filter does. It
//! first measures the upstream's round trip with few requests in flight
//! (the quiet window), then every interval compares the typical round
//! trip of the last interval with that floor: near it, the cap grows; above
//! it, the cap shrinks in proportion, half a step at a time, within `min`
//! and `max`.
//!
//! Counting is per instance: in-flight counts across instances would cost a
//! store round trip at the end of every request.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::client::ClientId;

mod cap;
pub mod metrics;
pub mod settings;

use cap::Cap;
pub use settings::{Adaptive, Per, Settings};

/// Why no slot was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every slot was taken and the queue was full (or there is none).
    Full,
    /// The request waited `queue_timeout` without a slot freeing.
    Timeout,
}

impl Refused {
    /// Both reasons.
    pub const ALL: [Refused; 2] = [Refused::Full, Refused::Timeout];

    /// The label value in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Timeout => "queue_timeout",
        }
    }
}

/// A slot in flight: given back when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Slot(Arc<Held>);

#[derive(Debug)]
struct Held {
    /// Taken out when the slot is given back.
    cap: Option<Arc<Cap>>,
    /// The per-client table to tidy when this was the client's last slot.
    owner: Option<(Arc<Capacity>, ClientId)>,
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(cap) = self.cap.take() else {
            return;
        };
        let idle = cap.release();
        // The table's reference is the last one left when nobody else uses
        // this client's cap.
        drop(cap);
        if let (true, Some((capacity, client))) = (idle, self.owner.take()) {
            capacity.forget_if_idle(&client);
        }
    }
}

impl Slot {
    /// Records the upstream's round trip for this request (adaptive caps).
    pub fn sample(&self, took: Duration) {
        if let Some(cap) = &self.0.cap {
            cap.sample(took);
        }
    }
}

/// A route's concurrency caps: one for the route, or one per client.
#[derive(Debug)]
pub struct Capacity {
    settings: Settings,
    route: Arc<Cap>,
    clients: Mutex<HashMap<ClientId, Arc<Cap>>>,
    max_clients: usize,
    /// Refusals so far, by [`Refused`] reason.
    refused: [AtomicUsize; 2],
}

impl Capacity {
    /// Caps with `settings`; at most `max_clients` clients tracked at once
    /// (past that, new clients share one cap).
    pub fn new(settings: Settings, max_clients: usize) -> Self {
        Self {
            route: Arc::new(Cap::new(&settings)),
            settings,
            clients: Mutex::new(HashMap::new()),
            max_clients,
            refused: Default::default(),
        }
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// A slot for a request of `client`, waiting in the queue if allowed.
    pub async fn acquire(self: &Arc<Self>, client: Option<&ClientId>) -> Result<Slot, Refused> {
        let (cap, owner) = match (self.settings.per, client) {
            (Per::Client, Some(client)) => {
                let cap = self.client_cap(client);
                (cap, Some((Arc::clone(self), client.clone())))
            }
            _ => (Arc::clone(&self.route), None),
        };
        let acquired = cap.acquire(&self.settings).await;
        drop(cap);
        match acquired {
            Ok(cap) => Ok(Slot(Arc::new(Held {
                cap: Some(cap),
                owner,
            }))),
            Err(reason) => {
                self.refused[reason as usize].fetch_add(1, Ordering::Relaxed);
                if let Some((_, client)) = owner {
                    self.forget_if_idle(&client);
                }
                Err(reason)
            }
        }
    }

    fn client_cap(&self, client: &ClientId) -> Arc<Cap> {
        let Ok(mut clients) = self.clients.lock() else {
            return Arc::clone(&self.route);
        };
        if let Some(cap) = clients.get(client) {
            return Arc::clone(cap);
        }
        if clients.len() >= self.max_clients {
            // Bounded memory: newcomers past the table's size share the
            // route's cap.
            return Arc::clone(&self.route);
        }
        let cap = Arc::new(Cap::new(&self.settings));
        clients.insert(client.clone(), Arc::clone(&cap));
        cap
    }

    fn forget_if_idle(&self, client: &ClientId) {
        if let Ok(mut clients) = self.clients.lock()
            && let Some(cap) = clients.get(client)
            && Arc::strong_count(cap) == 1
            && matches!(cap.counts(), (0, 0, _))
        {
            clients.remove(client);
        }
    }

    /// Requests in flight: the route's, or all clients' together.
    pub fn in_flight(&self) -> usize {
        self.sum(|c| c.counts().0)
    }

    /// Requests waiting for a slot.
    pub fn waiting(&self) -> usize {
        self.sum(|c| c.counts().1)
    }

    /// The cap now: the route's (an adaptive one moves), or each
    /// client's.
    pub fn limit(&self) -> usize {
        match self.settings.per {
            Per::Route => self.route.counts().2,
            Per::Client => self.settings.max_in_flight,
        }
    }

    /// Requests refused so far for `reason`.
    pub fn refusals(&self, reason: Refused) -> usize {
        self.refused[reason as usize].load(Ordering::Relaxed)
    }

    /// Requests refused so far, for either reason.
    pub fn refused(&self) -> usize {
        Refused::ALL.into_iter().map(|r| self.refusals(r)).sum()
    }

    /// Clients with requests in flight or waiting (per-client caps).
    pub fn clients(&self) -> usize {
        self.clients.lock().map_or(0, |c| c.len())
    }

    fn sum(&self, read: impl Fn(&Cap) -> usize) -> usize {
        let clients = self
            .clients
            .lock()
            .map_or(0, |c| c.values().map(|cap| read(cap)).sum());
        read(&self.route) + clients
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::cap::{FLOOR_SAMPLES, Gradient};
    use super::*;

    fn settings(max: usize, queue: usize, timeout_ms: u64) -> Settings {
        Settings {
            per: Per::Route,
            max_in_flight: max,
            queue,
            queue_timeout: Duration::from_millis(timeout_ms),
            status: http::StatusCode::SERVICE_UNAVAILABLE,
            adaptive: None,
        }
    }

    #[test]
    fn names_follow_the_declaration_order() {
        for (i, (name, per)) in Per::NAMES.into_iter().enumerate() {
            assert_eq!((per as usize, per.name()), (i, name));
        }
        for (i, reason) in Refused::ALL.into_iter().enumerate() {
            assert_eq!(reason as usize, i);
        }
    }

    #[tokio::test]
    async fn slots_are_capped_queued_and_given_back_on_drop() {
        let capacity = Arc::new(Capacity::new(settings(2, 1, 200), 100));
        let a = capacity.acquire(None).await;
        let b = capacity.acquire(None).await;
        assert!(a.is_ok() && b.is_ok());
        assert_eq!(capacity.in_flight(), 2);
        // The third waits in the queue; a fourth finds it full.
        let waiting = {
            let capacity = Arc::clone(&capacity);
            tokio::spawn(async move { capacity.acquire(None).await.map(|_| ()) })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(capacity.waiting(), 1);
        assert_eq!(capacity.acquire(None).await.err(), Some(Refused::Full));
        // A clone keeps the slot; the last drop frees it for the waiter.
        let a = a.ok();
        let clone = a.clone();
        drop(a);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(capacity.waiting(), 1);
        drop(clone);
        assert_eq!(waiting.await.ok(), Some(Ok(())));
        drop(b);
        assert_eq!(capacity.in_flight(), 0);
        assert_eq!(capacity.waiting(), 0);
    }

    /// Waits (without a deadline) until `capacity` has `n` waiters.
    async fn until_waiting(capacity: &Capacity, n: usize) {
        while capacity.waiting() != n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_queued_request_is_served_before_a_later_newcomer() {
        for round in 0..100 {
            let capacity = Arc::new(Capacity::new(settings(1, 5, 60_000), 100));
            let held = capacity.acquire(None).await.ok();
            let (order, mut served) = tokio::sync::mpsc::unbounded_channel();
            let queued = {
                let (capacity, order) = (Arc::clone(&capacity), order.clone());
                tokio::spawn(async move {
                    let slot = capacity.acquire(None).await.ok();
                    let _ = order.send("queued");
                    slot
                })
            };
            until_waiting(&capacity, 1).await;
            // The slot freed goes to the waiter, not to whoever asks next.
            drop(held);
            assert_eq!(
                (capacity.in_flight(), capacity.waiting()),
                (1, 0),
                "round {round}: the freed slot was not handed to the waiter"
            );
            let newcomer = {
                let capacity = Arc::clone(&capacity);
                tokio::spawn(async move {
                    let slot = capacity.acquire(None).await.ok();
                    let _ = order.send("newcomer");
                    slot
                })
            };
            until_waiting(&capacity, 1).await;
            let first = queued.await.ok().flatten();
            assert!(first.is_some(), "round {round}: the waiter got no slot");
            drop(first);
            let second = newcomer.await.ok().flatten();
            assert!(second.is_some(), "round {round}: the newcomer got no slot");
            assert_eq!(served.recv().await, Some("queued"), "round {round}");
            assert_eq!(served.recv().await, Some("newcomer"), "round {round}");
        }
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_leaves_the_queue() {
        let capacity = Arc::new(Capacity::new(settings(1, 5, 60_000), 100));
        let held = capacity.acquire(None).await.ok();
        let gone = {
            let capacity = Arc::clone(&capacity);
            tokio::spawn(async move { capacity.acquire(None).await.map(|_| ()) })
        };
        let next = {
            let capacity = Arc::clone(&capacity);
            tokio::spawn(async move { capacity.acquire(None).await.map(|_| ()) })
        };
        until_waiting(&capacity, 2).await;
        gone.abort();
        let _ = gone.await;
        assert_eq!(capacity.waiting(), 1);
        // The slot goes to the one still waiting.
        drop(held);
        assert_eq!(next.await.ok(), Some(Ok(())));
        assert_eq!((capacity.in_flight(), capacity.waiting()), (0, 0));
    }

    #[tokio::test]
    async fn a_queued_request_is_refused_after_the_timeout() {
        let capacity = Arc::new(Capacity::new(settings(1, 5, 50), 100));
        let _held = capacity.acquire(None).await;
        let started = Instant::now();
        assert_eq!(capacity.acquire(None).await.err(), Some(Refused::Timeout));
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(capacity.waiting(), 0);
        assert_eq!(capacity.refusals(Refused::Timeout), 1);
        assert_eq!(capacity.refusals(Refused::Full), 0);
    }

    #[tokio::test]
    async fn each_client_has_its_own_cap_and_is_forgotten_when_idle() {
        let capacity = Arc::new(Capacity::new(
            Settings {
                per: Per::Client,
                ..settings(1, 0, 0)
            },
            100,
        ));
        let alice = ClientId::header("alice");
        let bob = ClientId::header("bob");
        let a = capacity.acquire(Some(&alice)).await;
        assert!(a.is_ok());
        assert_eq!(
            capacity.acquire(Some(&alice)).await.err(),
            Some(Refused::Full)
        );
        let b = capacity.acquire(Some(&bob)).await;
        assert!(b.is_ok());
        assert_eq!(capacity.clients(), 2);
        drop((a, b));
        assert_eq!(capacity.clients(), 0);
        assert_eq!(capacity.in_flight(), 0);
    }

    #[test]
    fn the_gradient_grows_near_the_floor_and_shrinks_above_it() {
        let settings = Adaptive {
            min: 2,
            max: 100,
            interval: Duration::from_millis(100),
            floor_every: Duration::from_secs(3600),
            tolerance: 0.25,
        };
        let mut g = Gradient::new(&settings);
        let mut now = Instant::now();
        let ms = Duration::from_millis;
        for _ in 0..FLOOR_SAMPLES {
            g.sample(ms(10), now);
        }
        assert_eq!(g.floor, Some(ms(10)));
        // At the floor for a while: the cap grows.
        let mut limit = 0;
        for _ in 0..20 {
            now += ms(101);
            limit = g.sample(ms(10), now).unwrap_or(limit);
        }
        assert!(limit > 20, "{limit}");
        // Latency three times the floor: it shrinks.
        let before = limit;
        now += ms(101);
        limit = g.sample(ms(30), now).unwrap_or(limit);
        assert!(limit < before, "{limit} < {before}");
        for _ in 0..20 {
            now += ms(101);
            limit = g.sample(ms(30), now).unwrap_or(limit);
        }
        assert_eq!(limit, 2);
    }
}
