//! Requests held until their limits fit (a `gcra` limit's `delay`): how
//! many this instance holds, in all and per client, each bounded
//! (`[server] max_held`, `max_held_per_client`).
//!
//! A place is taken before the store decides, so that a request finding
//! no place is decided as if its limits had no delay (it goes at once if
//! it fits, else it is refused, taking nothing) rather than taking a unit
//! it could not wait for. A place is given back when its guard drops:
//! when the store needed no wait, when the wait is over, or when the
//! client leaves and its request's future is dropped mid-wait, so nothing
//! of a held request outlives it. The wait is a timer in the request's
//! own future; no connection to the store is held.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use crate::client::ClientId;
use crate::metrics::{HeldBound, HeldEnd};

/// The bound a request found full.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// This instance holds `max_held` requests.
    Instance,
    /// This instance holds `max_held_per_client` of the client's.
    Client,
}

impl Full {
    /// The `bound` label of `floodgate_held_full_total`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Instance => "instance",
            Self::Client => "client",
        }
    }
}

/// The places of held requests on this instance.
#[derive(Debug)]
pub struct Holds {
    most: usize,
    most_per_client: usize,
    /// Places taken, held or about to be decided.
    taken: AtomicUsize,
    per_client: Mutex<HashMap<ClientId, usize>>,
    /// Requests waiting now.
    holding: Gauge,
    /// Holds ended, by how.
    ended: Family<HeldEnd, Counter>,
    /// Requests that found a bound full.
    full: Family<HeldBound, Counter>,
}

impl Holds {
    /// At most `most` places on this instance, `most_per_client` of them a
    /// client's, counted in `metrics`.
    pub fn new(most: usize, most_per_client: usize, metrics: &crate::metrics::Metrics) -> Self {
        let (holding, ended, full) = metrics.held();
        Self {
            most,
            most_per_client,
            taken: AtomicUsize::new(0),
            per_client: Mutex::new(HashMap::new()),
            holding,
            ended,
            full,
        }
    }

    /// A place for one of `client`'s requests, or the bound that is full
    /// (counted).
    pub fn take(&self, client: &ClientId) -> Result<Place<'_>, Full> {
        let taken = self
            .taken
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.most).then_some(n + 1)
            });
        if taken.is_err() {
            return Err(self.found_full(Full::Instance));
        }
        let mut per_client = self
            .per_client
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mine = per_client.entry(client.clone()).or_insert(0);
        if *mine >= self.most_per_client {
            drop(per_client);
            self.taken.fetch_sub(1, Ordering::AcqRel);
            return Err(self.found_full(Full::Client));
        }
        *mine += 1;
        Ok(Place {
            holds: self,
            client: client.clone(),
            holding: false,
        })
    }

    /// Requests holding a place now, waiting or about to be decided.
    pub fn taken(&self) -> usize {
        self.taken.load(Ordering::Acquire)
    }

    fn found_full(&self, full: Full) -> Full {
        self.full
            .get_or_create(&HeldBound { bound: full.name() })
            .inc();
        full
    }
}

/// One request's place among the held, given back when dropped.
#[derive(Debug)]
pub struct Place<'a> {
    holds: &'a Holds,
    client: ClientId,
    /// Waiting: the wait began and has not ended.
    holding: bool,
}

impl Place<'_> {
    /// Waits `wait` in this place. Dropped before the wait ends (its
    /// client left), the hold is counted as left.
    pub async fn hold(&mut self, wait: Duration) {
        self.holding = true;
        self.holds.holding.inc();
        tokio::time::sleep(wait).await;
        self.holding = false;
        self.holds.holding.dec();
        self.holds
            .ended
            .get_or_create(&HeldEnd { ended: "went" })
            .inc();
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        if self.holding {
            self.holds.holding.dec();
            self.holds
                .ended
                .get_or_create(&HeldEnd { ended: "left" })
                .inc();
        }
        let mut per_client = self
            .holds
            .per_client
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(mine) = per_client.get_mut(&self.client) {
            *mine -= 1;
            if *mine == 0 {
                per_client.remove(&self.client);
            }
        }
        drop(per_client);
        self.holds.taken.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(n: u8) -> ClientId {
        ClientId::Addr([10, 0, 0, n].into())
    }

    #[test]
    fn places_are_bounded_per_instance_and_per_client_and_given_back_when_dropped() {
        let metrics = crate::metrics::Metrics::new();
        let holds = Holds::new(3, 2, &metrics);
        let a1 = holds.take(&client(1)).expect("first of a");
        let a2 = holds.take(&client(1)).expect("second of a");
        assert_eq!(holds.take(&client(1)).err(), Some(Full::Client));
        let b1 = holds.take(&client(2)).expect("first of b");
        assert_eq!(holds.take(&client(3)).err(), Some(Full::Instance));
        assert_eq!(holds.taken(), 3);
        drop(a1);
        let c1 = holds.take(&client(3)).expect("a place given back");
        drop((a2, b1, c1));
        assert_eq!(holds.taken(), 0);
        assert!(holds.per_client.lock().expect("map").is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_hold_dropped_mid_wait_is_counted_as_left_and_its_place_given_back() {
        let metrics = crate::metrics::Metrics::new();
        let holds = Holds::new(10, 10, &metrics);
        let mut place = holds.take(&client(1)).expect("a place");
        {
            let wait = place.hold(Duration::from_secs(5));
            let cut = tokio::time::timeout(Duration::from_secs(1), wait).await;
            assert!(cut.is_err(), "still waiting after a second");
        }
        assert_eq!(holds.holding.get(), 1);
        drop(place);
        assert_eq!((holds.holding.get(), holds.taken()), (0, 0));
        let left = holds.ended.get_or_create(&HeldEnd { ended: "left" }).get();
        assert_eq!(left, 1);
    }
}
