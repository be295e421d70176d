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
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::client::ClientId;

/// A route's concurrency settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// What one cap covers.
    pub per: Per,
    /// The cap: fixed, or where an adaptive one starts.
    pub max_in_flight: usize,
    /// Requests that may wait for a slot; 0 refuses at once.
    pub queue: usize,
    /// How long a request waits in the queue before it is refused.
    pub queue_timeout: Duration,
    /// The status a refused request gets.
    pub status: http::StatusCode,
    /// The cap follows the upstream's latency.
    pub adaptive: Option<Adaptive>,
}

/// What one cap covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Per {
    /// All of the route's requests.
    Route,
    /// Each client of the route, as the route identifies clients.
    Client,
}

impl Per {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, Per); 2] = [("route", Per::Route), ("client", Per::Client)];

    /// The name in configuration files.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize].0
    }
}

/// How an adaptive cap moves.
#[derive(Debug, Clone, PartialEq)]
pub struct Adaptive {
    /// The cap never goes below this.
    pub min: usize,
    /// Nor above this.
    pub max: usize,
    /// How often the cap is recomputed from the last interval's samples.
    pub interval: Duration,
    /// How often the round-trip floor is measured again.
    pub floor_every: Duration,
    /// How much slower than the floor still counts as "near it" (0.25: a
    /// quarter slower).
    pub tolerance: f64,
}

/// Samples that make a floor measurement.
const FLOOR_SAMPLES: usize = 25;
/// The longest a floor measurement waits for its samples.
const FLOOR_WINDOW: Duration = Duration::from_secs(2);
/// Samples kept per interval at most.
const MAX_SAMPLES: usize = 4096;

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

/// The counts and waiters of one cap.
#[derive(Debug)]
pub struct Cap {
    state: Mutex<State>,
    freed: Notify,
    adaptive: Option<Mutex<Gradient>>,
}

#[derive(Debug)]
struct State {
    in_flight: usize,
    waiting: usize,
    limit: usize,
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

impl Cap {
    fn new(settings: &Settings) -> Self {
        let adaptive = settings
            .adaptive
            .as_ref()
            .map(|a| Mutex::new(Gradient::new(a)));
        let limit = match &settings.adaptive {
            // The quiet window comes first: few requests in flight.
            Some(a) => a.min,
            None => settings.max_in_flight,
        };
        Self {
            state: Mutex::new(State {
                in_flight: 0,
                waiting: 0,
                limit,
            }),
            freed: Notify::new(),
            adaptive,
        }
    }

    /// A slot, waiting in the queue if allowed.
    async fn acquire(self: &Arc<Self>, settings: &Settings) -> Result<Arc<Cap>, Refused> {
        let deadline = Instant::now() + settings.queue_timeout;
        let mut queued = false;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            {
                let Ok(mut state) = self.state.lock() else {
                    return Err(Refused::Full);
                };
                if state.in_flight < state.limit {
                    state.in_flight += 1;
                    if queued {
                        state.waiting -= 1;
                    }
                    return Ok(Arc::clone(self));
                }
                if !queued {
                    if state.waiting >= settings.queue {
                        return Err(Refused::Full);
                    }
                    state.waiting += 1;
                    queued = true;
                }
                // Registered before the lock is let go, so a slot freed in
                // between still wakes this request.
                freed.as_mut().enable();
            }
            let woken = tokio::time::timeout_at(deadline.into(), freed).await;
            if woken.is_err() {
                if let Ok(mut state) = self.state.lock() {
                    state.waiting -= 1;
                }
                // The wake-up this request may have taken goes on.
                self.freed.notify_one();
                return Err(Refused::Timeout);
            }
        }
    }

    /// Gives a slot back; true when nothing is in flight or waiting after.
    fn release(&self) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        state.in_flight = state.in_flight.saturating_sub(1);
        let idle = state.in_flight == 0 && state.waiting == 0;
        drop(state);
        self.freed.notify_one();
        idle
    }

    /// `(in flight, waiting, limit)` now.
    fn counts(&self) -> (usize, usize, usize) {
        self.state
            .lock()
            .map_or((0, 0, 0), |s| (s.in_flight, s.waiting, s.limit))
    }

    fn sample(&self, took: Duration) {
        let Some(gradient) = &self.adaptive else {
            return;
        };
        let new_limit = match gradient.lock() {
            Ok(mut g) => g.sample(took, Instant::now()),
            Err(_) => None,
        };
        if let Some(limit) = new_limit
            && let Ok(mut state) = self.state.lock()
        {
            let grew = limit > state.limit;
            state.limit = limit;
            drop(state);
            if grew {
                // Each newly free slot may wake one waiter.
                self.freed.notify_waiters();
            }
        }
    }
}

/// The adaptive cap's reckoning.
#[derive(Debug)]
struct Gradient {
    settings: Adaptive,
    /// The cap, as a fraction so small steps add up.
    limit: f64,
    /// The round trip with few requests in flight, once measured.
    floor: Option<Duration>,
    /// Measuring the floor: samples so far and when it began.
    measuring: Option<(Vec<Duration>, Instant)>,
    /// When the floor was last measured.
    measured_at: Instant,
    /// This interval's samples and when it began.
    samples: Vec<Duration>,
    interval_start: Instant,
}

impl Gradient {
    fn new(settings: &Adaptive) -> Self {
        let now = Instant::now();
        Self {
            settings: settings.clone(),
            limit: settings.min as f64,
            floor: None,
            measuring: Some((Vec::with_capacity(FLOOR_SAMPLES), now)),
            measured_at: now,
            samples: Vec::new(),
            interval_start: now,
        }
    }

    /// Takes one round trip; returns the new cap when it changes.
    fn sample(&mut self, took: Duration, now: Instant) -> Option<usize> {
        if let Some((samples, started)) = &mut self.measuring {
            samples.push(took);
            if samples.len() < FLOOR_SAMPLES && now.duration_since(*started) < FLOOR_WINDOW {
                return None;
            }
            let floor = median(samples);
            self.measuring = None;
            self.floor = Some(floor);
            self.measured_at = now;
            self.samples.clear();
            self.interval_start = now;
            // Back to where the cap was before the quiet window.
            return Some(self.current());
        }
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(took);
        }
        if now.duration_since(self.interval_start) < self.settings.interval {
            return None;
        }
        let typical = median(&mut self.samples);
        self.samples.clear();
        self.interval_start = now;
        let floor = self.floor?;
        if typical < floor {
            // The upstream got faster: a lower floor.
            self.floor = Some(typical);
        }
        let floor = self.floor.unwrap_or(floor);
        // Within the tolerance of the floor the cap grows by a square-root
        // headroom (quickly while it is small, carefully once it is
        // large); above it, it shrinks in proportion to how much slower
        // the upstream has become, by half at most.
        let near = floor.as_secs_f64() * (1.0 + self.settings.tolerance);
        let ratio = (near / typical.as_secs_f64().max(1e-6)).clamp(0.5, 1.0);
        let headroom = if ratio >= 1.0 { self.limit.sqrt() } else { 0.0 };
        // Half way there each interval: the samples of one interval were
        // taken under the caps of the ones before, so a full step would
        // swing past the knee and back.
        let target = self.limit * ratio + headroom;
        self.limit =
            ((self.limit + target) / 2.0).clamp(self.settings.min as f64, self.settings.max as f64);
        if now.duration_since(self.measured_at) >= self.settings.floor_every {
            // Measure the floor again, with few requests in flight.
            self.measuring = Some((Vec::with_capacity(FLOOR_SAMPLES), now));
            return Some(self.settings.min);
        }
        Some(self.current())
    }

    fn current(&self) -> usize {
        self.limit.round() as usize
    }
}

fn median(samples: &mut [Duration]) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let middle = samples.len() / 2;
    *samples.select_nth_unstable(middle).1
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
