//! What operators and clients ask of the in-process counts beyond
//! decisions: a client's standing read without consuming, an operator's
//! adjustment of one client's counts, and every client's window of a limit
//! for export.

use super::{Entry, MemoryStore, same_states};
use crate::limit::algorithms::State;
use crate::limit::penalty::Sentence;
use crate::limit::shards::Slot;
use crate::limit::{Charge, Limit, Standing};

impl MemoryStore {
    /// What each of `charge`'s limits holds at `now`, consuming nothing
    /// and making no entry: a client never seen holds every limit whole.
    pub fn peek_at(&self, charge: Charge<'_>, now: u64) -> Vec<Standing> {
        let look = |entry: Option<&Entry>, at: usize, limit: &Limit| {
            let mut state = entry
                .and_then(|e| e.states.get(at).cloned())
                .unwrap_or_else(|| State::new(limit.algorithm));
            Standing {
                verdict: state.check(limit, now, 0),
                granted: state.granted(limit, now),
            }
        };
        if !charge.keys.is_empty() && charge.keys.len() == charge.limits.len() {
            return charge
                .keys
                .iter()
                .zip(charge.limits)
                .map(|(key, limit)| {
                    let (map, hash) = self.shards.lock(&key.entry, &key.client);
                    let entry = map
                        .get(&hash)
                        .filter(|slot| slot.holds(&key.entry, &key.client))
                        .map(|slot| &slot.value)
                        .filter(|e| same_states(&e.limits, std::slice::from_ref(limit)));
                    look(entry, 0, limit)
                })
                .collect();
        }
        let (map, hash) = self.shards.lock(charge.route, charge.client);
        let entry = map
            .get(&hash)
            .filter(|slot| slot.holds(charge.route, charge.client))
            .map(|slot| &slot.value)
            .filter(|e| same_states(&e.limits, charge.limits));
        charge
            .limits
            .iter()
            .enumerate()
            .map(|(i, limit)| look(entry, i, limit))
            .collect()
    }

    /// Every client's fixed window of limit `index` of `scope` (a route's
    /// own limits, kept together per client) or of entry `entry` (a limit
    /// keyed on its own), as kept at `now`: its current window, and the
    /// last closed one of a window by the calendar.
    pub fn kept(
        &self,
        scope: &str,
        index: usize,
        entry: Option<&str>,
        limit: &Limit,
        now: u64,
    ) -> Vec<crate::limit::Kept> {
        let id_key = crate::limit::redis::IdKey::new(None);
        let mut out = Vec::new();
        let mut add = |client: &crate::client::ClientId, state: Option<&State>| {
            let Some(totals) = state.and_then(|s| s.window_totals(limit)) else {
                return;
            };
            let mut id = String::new();
            crate::limit::redis::write_client(&mut id, client, &id_key);
            let (start, end, count) = totals.counted;
            if count > 0 {
                out.push(crate::limit::Kept {
                    client: id.clone(),
                    start,
                    end,
                    units: count,
                    closed: end <= now,
                });
            }
            let (s, e, units) = totals.closed;
            if units > 0 && e > 0 {
                out.push(crate::limit::Kept {
                    client: id,
                    start: s,
                    end: e,
                    units,
                    closed: true,
                });
            }
        };
        match entry {
            Some(entry) => self
                .shards
                .each_of(entry, |client, e| add(client, e.states.first())),
            None => self
                .shards
                .each_of(scope, |client, e| add(client, e.states.get(index))),
        }
        out
    }

    /// Every penalty in force at `now`: a route's own limits are kept
    /// together under the route's name, a limit keyed on its own under its
    /// entry (`<scope>#<index>:…`).
    pub fn penalties_at(&self, now: u64) -> Vec<crate::limit::penalty::Served> {
        let id_key = crate::limit::redis::IdKey::new(None);
        let mut out = Vec::new();
        self.shards.each(|route, client, entry| {
            for (i, sentence) in entry.sentences.iter().enumerate() {
                let Some(ends_in_ms) = sentence.running(now) else {
                    continue;
                };
                let (scope, index) = match route.split_once('#') {
                    Some((scope, rest)) => {
                        let index = rest.split(':').next().and_then(|n| n.parse().ok());
                        (scope, index.unwrap_or(i))
                    }
                    None => (route, i),
                };
                let mut id = String::new();
                crate::limit::redis::write_client(&mut id, client, &id_key);
                out.push(crate::limit::penalty::Served {
                    scope: scope.to_owned(),
                    index,
                    client: id,
                    ends_in_ms,
                    offences: sentence.offences,
                });
            }
        });
        out
    }

    /// Applies an operator's `adjustment` at `now` to `charge`'s limits
    /// (only the one at `which`, when given) for its client.
    pub fn adjust_at(
        &self,
        charge: Charge<'_>,
        which: Option<usize>,
        adjustment: crate::limit::Adjustment,
        now: u64,
    ) {
        let forgive = |sentence: Option<&mut Sentence>| {
            if let Some(sentence) = sentence {
                *sentence = Sentence::default();
            }
        };
        let apply =
            |state: &mut State, sentence: Option<&mut Sentence>, limit: &Limit| match adjustment {
                crate::limit::Adjustment::Reset => {
                    *state = State::new(limit.algorithm);
                    forgive(sentence);
                }
                crate::limit::Adjustment::Lift => forgive(sentence),
                crate::limit::Adjustment::Credit(units) => state.grant(limit, now, units),
                crate::limit::Adjustment::Debit(units) => state.settle(limit, now, now, 0, units),
            };
        let chosen = |i: usize| which.is_none_or(|w| w == i);
        if !charge.keys.is_empty() && charge.keys.len() == charge.limits.len() {
            for (i, (key, limit)) in charge.keys.iter().zip(charge.limits).enumerate() {
                if !chosen(i) {
                    continue;
                }
                let one = std::slice::from_ref(limit);
                let (mut map, hash) = self.shards.lock(&key.entry, &key.client);
                let slot = map
                    .entry(hash)
                    .or_insert_with(|| Slot::new(&key.entry, &key.client, Entry::new(one)));
                if !slot.holds(&key.entry, &key.client) {
                    *slot = Slot::new(&key.entry, &key.client, Entry::new(one));
                }
                let entry = &mut slot.value;
                entry.adopt(one);
                apply(&mut entry.states[0], entry.sentences.get_mut(0), limit);
                entry.expires_at = entry.states[0]
                    .expires_at(limit)
                    .max(entry.remembered_until(0));
            }
            return;
        }
        let (route, client) = (charge.route, charge.client);
        let (mut map, hash) = self.shards.lock(route, client);
        let slot = map
            .entry(hash)
            .or_insert_with(|| Slot::new(route, client, Entry::new(charge.limits)));
        if !slot.holds(route, client) {
            *slot = Slot::new(route, client, Entry::new(charge.limits));
        }
        let entry = &mut slot.value;
        entry.adopt(charge.limits);
        let Entry {
            states, sentences, ..
        } = entry;
        for (i, (state, limit)) in states.iter_mut().zip(charge.limits).enumerate() {
            if chosen(i) {
                apply(state, sentences.get_mut(i), limit);
            }
        }
        entry.refresh_expiry(charge.limits);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::client::ClientId;
    use crate::limit::Algorithm;

    #[test]
    fn a_peek_reads_the_units_granted_in_force_until_the_window_ends() {
        let route: Arc<str> = "api".into();
        let client = ClientId::Addr([192, 0, 2, 1].into());
        let limits = [
            Limit::new(Algorithm::FixedWindow, 10, 60_000),
            Limit::new(Algorithm::TokenBucket, 6, 60_000),
        ];
        let store = MemoryStore::new();
        let c = Charge {
            route: &route,
            client: &client,
            limits: &limits,
            keys: &[],
            cost: 1,
            settle: None,
        };
        for t in 0..4 {
            assert!(store.decide_at(c, t).allowed);
        }
        store.adjust_at(c, Some(0), crate::limit::Adjustment::Credit(5), 5);
        let held = |now| -> Vec<(u64, u64)> {
            store
                .peek_at(c, now)
                .iter()
                .map(|s| (s.verdict.remaining, s.granted))
                .collect()
        };
        assert_eq!(held(5), [(11, 5), (2, 0)]);
        assert_eq!(held(60_000)[0], (10, 0), "a grant outlived its window");
    }
}
