//! One cap: its counts, its bounded queue of waiters, and (adaptive) the
//! gradient that moves it with the upstream's latency.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::{Adaptive, Refused, Settings};

/// Samples that make a floor measurement.
pub(super) const FLOOR_SAMPLES: usize = 25;
/// The longest a floor measurement waits for its samples.
const FLOOR_WINDOW: Duration = Duration::from_secs(2);
/// Samples kept per interval at most.
const MAX_SAMPLES: usize = 4096;

/// The counts and waiters of one cap.
///
/// The queue is first come, first served: a slot given back goes straight
/// to the request that has waited longest (it stays counted in flight), so
/// a newcomer takes a free slot only when nobody waits, and never
/// overtakes a waiter.
#[derive(Debug)]
pub struct Cap {
    state: Mutex<State>,
    adaptive: Option<Mutex<Gradient>>,
}

#[derive(Debug)]
struct State {
    in_flight: usize,
    limit: usize,
    /// The requests waiting for a slot, oldest first.
    waiters: VecDeque<Waiter>,
    /// The next waiter's ticket.
    next_ticket: u64,
}

/// One request in the queue: its ticket, and where its slot is handed.
#[derive(Debug)]
struct Waiter {
    ticket: u64,
    granted: oneshot::Sender<()>,
}

impl State {
    /// Hands free slots to the oldest waiters; true when one was handed.
    fn hand_over(&mut self) -> bool {
        let mut handed = false;
        while self.in_flight < self.limit {
            let Some(waiter) = self.waiters.pop_front() else {
                break;
            };
            // A waiter that went away takes nothing (it leaves the queue
            // itself; this is for safety).
            if waiter.granted.send(()).is_ok() {
                self.in_flight += 1;
                handed = true;
            }
        }
        handed
    }
}

/// A place in the queue: leaves it when dropped, and gives back a slot it
/// was handed but never took (its request went away at that moment).
struct Queued<'a> {
    cap: &'a Cap,
    ticket: u64,
    granted: Option<oneshot::Receiver<()>>,
}

impl Queued<'_> {
    /// The slot was taken: nothing to undo.
    fn taken(mut self) {
        self.granted = None;
    }
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        let Some(mut granted) = self.granted.take() else {
            return;
        };
        let Ok(mut state) = self.cap.state.lock() else {
            return;
        };
        if let Some(at) = state.waiters.iter().position(|w| w.ticket == self.ticket) {
            state.waiters.remove(at);
            return;
        }
        drop(state);
        // Not in the queue any more: it was handed a slot.
        if granted.try_recv().is_ok() {
            self.cap.release();
        }
    }
}

impl Cap {
    pub(super) fn new(settings: &Settings) -> Self {
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
                limit,
                waiters: VecDeque::new(),
                next_ticket: 0,
            }),
            adaptive,
        }
    }

    /// A slot: at once when one is free and nobody waits, else after
    /// every earlier waiter, within `queue_timeout`, if the queue has room.
    pub(super) async fn acquire(
        self: &Arc<Self>,
        settings: &Settings,
    ) -> Result<Arc<Cap>, Refused> {
        let deadline = Instant::now() + settings.queue_timeout;
        let mut queued = {
            let Ok(mut state) = self.state.lock() else {
                return Err(Refused::Full);
            };
            if state.in_flight < state.limit && state.waiters.is_empty() {
                state.in_flight += 1;
                return Ok(Arc::clone(self));
            }
            if state.waiters.len() >= settings.queue {
                return Err(Refused::Full);
            }
            let (sender, receiver) = oneshot::channel();
            let ticket = state.next_ticket;
            state.next_ticket += 1;
            state.waiters.push_back(Waiter {
                ticket,
                granted: sender,
            });
            Queued {
                cap: self,
                ticket,
                granted: Some(receiver),
            }
        };
        let Some(granted) = queued.granted.as_mut() else {
            return Err(Refused::Full);
        };
        match tokio::time::timeout_at(deadline.into(), granted).await {
            Ok(Ok(())) => {
                queued.taken();
                Ok(Arc::clone(self))
            }
            // The cap went away with its queue.
            Ok(Err(_)) => Err(Refused::Full),
            // Out of the queue; a slot handed over at this very moment is
            // given back by `queued`.
            Err(_) => Err(Refused::Timeout),
        }
    }

    /// Gives a slot back (to the oldest waiter, if any); true when nothing
    /// is in flight or waiting after.
    pub(super) fn release(&self) -> bool {
        let Ok(mut state) = self.state.lock() else {
            return false;
        };
        state.in_flight = state.in_flight.saturating_sub(1);
        state.hand_over();
        state.in_flight == 0 && state.waiters.is_empty()
    }

    /// `(in flight, waiting, limit)` now.
    pub(super) fn counts(&self) -> (usize, usize, usize) {
        self.state
            .lock()
            .map_or((0, 0, 0), |s| (s.in_flight, s.waiters.len(), s.limit))
    }

    pub(super) fn sample(&self, took: Duration) {
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
            state.limit = limit;
            // Each newly free slot goes to a waiter, oldest first.
            state.hand_over();
        }
    }
}

/// The adaptive cap's reckoning.
#[derive(Debug)]
pub(super) struct Gradient {
    settings: Adaptive,
    /// The cap, as a fraction so small steps add up.
    limit: f64,
    /// The round trip with few requests in flight, once measured.
    pub(super) floor: Option<Duration>,
    /// Measuring the floor: samples so far and when it began.
    measuring: Option<(Vec<Duration>, Instant)>,
    /// When the floor was last measured.
    measured_at: Instant,
    /// This interval's samples and when it began.
    samples: Vec<Duration>,
    interval_start: Instant,
}

impl Gradient {
    pub(super) fn new(settings: &Adaptive) -> Self {
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
    pub(super) fn sample(&mut self, took: Duration, now: Instant) -> Option<usize> {
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

    pub(super) fn current(&self) -> usize {
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
