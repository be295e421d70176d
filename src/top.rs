//! Who is limited, live: for each limited route, the heaviest clients of
//! the last minute with their allowed and denied counts, for the admin
//! listener's `/clients/top`.
//!
//! Memory is fixed whatever the clients send: each route keeps six
//! ten-second slots, and each slot a Space-Saving sketch of at most
//! [`TRACKED`] clients (Metwally, Agrawal and El Abbadi, 2005). A client
//! seen when a slot is full takes the place of the one with the fewest
//! requests, inheriting that count as its possible overestimate (`over`),
//! so any client with more than a slot's requests / [`TRACKED`] is always
//! among those kept, with counts exact if it was kept from its first
//! request on. Denied counts include shadow denials (requests a shadow
//! route would have refused).

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use crate::client::ClientId;

/// Clients kept per ten-second slot of a route.
pub const TRACKED: usize = 64;
/// Seconds per slot.
const SLOT_SECONDS: u64 = 10;
/// Slots per route: one minute.
const SLOTS: usize = 6;

/// The heavy hitters of one route.
#[derive(Debug, Default)]
pub struct RouteTop {
    slots: Mutex<[Sketch; SLOTS]>,
}

#[derive(Debug, Default)]
struct Sketch {
    /// Which ten-second period (seconds / 10) it counts.
    period: u64,
    index: HashMap<ClientId, usize>,
    entries: Vec<Entry>,
}

#[derive(Debug, Clone)]
struct Entry {
    id: ClientId,
    allowed: u64,
    denied: u64,
    over: u64,
}

impl Entry {
    fn total(&self) -> u64 {
        self.allowed + self.denied + self.over
    }
}

/// A client's counts over the last minute.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heavy {
    /// Who.
    pub client: ClientId,
    /// Requests allowed.
    pub allowed: u64,
    /// Requests denied (shadow denials included).
    pub denied: u64,
    /// How much the counts may exceed the truth, from evictions.
    pub over: u64,
}

impl RouteTop {
    /// Counts a decided request of `client` at `now` (seconds).
    pub fn count(&self, client: &ClientId, denied: bool, now: u64) {
        let period = now / SLOT_SECONDS;
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let sketch = &mut slots[(period % SLOTS as u64) as usize];
        if sketch.period != period {
            sketch.period = period;
            sketch.index.clear();
            sketch.entries.clear();
        }
        sketch.add(client, denied);
    }

    /// The `n` clients with the most requests over the minute before `now`,
    /// most first, and how many entries the sketches hold.
    pub fn heaviest(&self, n: usize, now: u64) -> (Vec<Heavy>, usize) {
        let period = now / SLOT_SECONDS;
        let oldest = period.saturating_sub(SLOTS as u64 - 1);
        let slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        let mut merged: HashMap<&ClientId, Heavy> = HashMap::new();
        let mut held = 0;
        for sketch in slots
            .iter()
            .filter(|s| (oldest..=period).contains(&s.period))
        {
            held += sketch.entries.len();
            for e in &sketch.entries {
                let h = merged.entry(&e.id).or_insert_with(|| Heavy {
                    client: e.id.clone(),
                    allowed: 0,
                    denied: 0,
                    over: 0,
                });
                h.allowed += e.allowed;
                h.denied += e.denied;
                h.over += e.over;
            }
        }
        let mut all: Vec<Heavy> = merged.into_values().collect();
        all.sort_by(|a, b| {
            (b.allowed + b.denied, b.denied)
                .cmp(&(a.allowed + a.denied, a.denied))
                .then_with(|| format!("{}", a.client).cmp(&format!("{}", b.client)))
        });
        all.truncate(n);
        (all, held)
    }
}

impl Sketch {
    fn add(&mut self, client: &ClientId, denied: bool) {
        let i = match self.index.get(client) {
            Some(&i) => i,
            None if self.entries.len() < TRACKED => {
                self.entries.push(Entry {
                    id: client.clone(),
                    allowed: 0,
                    denied: 0,
                    over: 0,
                });
                self.index.insert(client.clone(), self.entries.len() - 1);
                self.entries.len() - 1
            }
            None => {
                // Full: the least counted makes room, and its count is the
                // newcomer's possible overestimate.
                let (i, least) = self
                    .entries
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, e)| e.total())
                    .map(|(i, e)| (i, e.total()))
                    .unwrap_or((0, 0));
                self.index.remove(&self.entries[i].id);
                self.entries[i] = Entry {
                    id: client.clone(),
                    allowed: 0,
                    denied: 0,
                    over: least,
                };
                self.index.insert(client.clone(), i);
                i
            }
        };
        let e = &mut self.entries[i];
        if denied {
            e.denied += 1;
        } else {
            e.allowed += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> ClientId {
        ClientId::header(s)
    }

    #[test]
    fn a_heavy_client_stays_counted_exactly_among_many_light_ones() {
        let top = RouteTop::default();
        let now = 1_000;
        for i in 0..5_000 {
            top.count(&id(&format!("light-{i}")), false, now);
            if i % 5 == 0 {
                top.count(&id("heavy"), i % 10 == 0, now);
            }
        }
        let (heaviest, held) = top.heaviest(3, now);
        assert!(held <= TRACKED, "{held}");
        assert_eq!(heaviest[0].client, id("heavy"));
        assert_eq!(
            (heaviest[0].allowed, heaviest[0].denied, heaviest[0].over),
            (500, 500, 0)
        );
    }

    #[test]
    fn counts_older_than_a_minute_are_forgotten() {
        let top = RouteTop::default();
        top.count(&id("a"), true, 1_000);
        top.count(&id("b"), false, 1_030);
        let (now, _) = top.heaviest(10, 1_055);
        assert_eq!(now.len(), 2);
        let (later, _) = top.heaviest(10, 1_065);
        assert_eq!(later.len(), 1);
        assert_eq!(later[0].client, id("b"));
        let (much_later, held) = top.heaviest(10, 2_000);
        assert!(much_later.is_empty());
        assert_eq!(held, 0);
    }
}
