//! Decisions whose limits count different keys (a key per limit, a
//! budget, the whole API): each limit an entry of its own, the shards
//! holding them locked together for the decision.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Entry, settle_state, untaken};
use crate::limit::shards::Slot;
use crate::limit::{Charge, CountKey, Decision, Limit, Settlement, Verdict};

/// The shards (and overflow buckets) a keyed decision holds locked, and
/// where each of its limits' entries is.
pub(super) struct Held<'a> {
    pub(super) guards: Vec<std::sync::MutexGuard<'a, crate::limit::shards::Map<Entry>>>,
    pub(super) overflow: Option<std::sync::MutexGuard<'a, HashMap<Arc<str>, Entry>>>,
    /// The locked shards' indices, ascending, one per guard.
    pub(super) order: Vec<usize>,
    /// Per limit, whether its entry is its scope's overflow bucket.
    pub(super) in_overflow: Vec<bool>,
    /// Per limit, its entry's shard and hash.
    pub(super) places: Vec<(usize, u64)>,
}

impl Held<'_> {
    /// The entry of the limit at `i`, counting `key` by `limit`: in its
    /// shard or in its overflow bucket; made before this is asked.
    pub(super) fn entry(&mut self, i: usize, key: &CountKey, limit: &Limit) -> &mut Entry {
        if self.in_overflow[i]
            && let Some(entry) = self.overflow.as_mut().and_then(|o| o.get_mut(&key.entry))
        {
            return entry;
        }
        let (shard, hash) = self.places[i];
        let map = &mut self.guards[self.order.partition_point(|&s| s < shard)];
        &mut map
            .entry(hash)
            .or_insert_with(|| {
                Slot::new(
                    &key.entry,
                    &key.client,
                    Entry::new(std::slice::from_ref(limit)),
                )
            })
            .value
    }

    /// Settles `charge`'s reservation (or makes an operator's grant) in
    /// each limit's entry.
    pub(super) fn settle(&mut self, charge: &Charge<'_>, now: u64, settle: Settlement) -> Decision {
        Decision::combine_kinds((0..charge.keys.len()).map(|i| {
            let limit = &charge.limits[i];
            let e = self.entry(i, &charge.keys[i], limit);
            if !limit.counts_requests || settle.kind == crate::limit::Settled::GiveBack {
                settle_state(&mut e.states[0], limit, now, settle, charge.cost);
            }
            e.expires_at = e.states[0].expires_at(limit).max(e.remembered_until(0));
            let verdict = Verdict {
                allowed: true,
                retry_after_ms: 0,
                ..e.states[0].check(limit, now, 0)
            };
            (limit.counts_requests, verdict)
        }))
    }

    /// Decides `charge` at `now`: every limit's entry checked, then
    /// consumed from all if all allow.
    pub(super) fn check_and_consume(&mut self, charge: &Charge<'_>, now: u64) -> Decision {
        let keys = charge.keys;
        let mut verdicts: Vec<Verdict> = (0..keys.len())
            .map(|i| {
                let limit = &charge.limits[i];
                self.entry(i, &keys[i], limit)
                    .judge(0, limit, now, limit.cost_of(charge.cost))
            })
            .collect();
        let kinds = charge.limits.iter().map(|l| l.counts_requests);
        let decision = Decision::combine_kinds(kinds.clone().zip(verdicts.iter().copied()));
        if !decision.allowed {
            for (i, v) in verdicts.iter_mut().enumerate() {
                let limit = &charge.limits[i];
                self.entry(i, &keys[i], limit).offended(0, limit, now, v);
            }
            untaken(&mut verdicts, |i| {
                let limit = &charge.limits[i];
                self.entry(i, &keys[i], limit).states[0].check(limit, now, 0)
            });
            return Decision::combine_kinds(kinds.zip(verdicts));
        }
        for (i, limit) in charge.limits.iter().enumerate() {
            let e = self.entry(i, &keys[i], limit);
            e.states[0].consume(limit, now, limit.cost_of(charge.cost));
            e.expires_at = e.states[0].expires_at(limit).max(e.remembered_until(0));
        }
        decision
    }
}
