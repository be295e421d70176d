//! This instance's leases: one per key, at most a capacity of them; which
//! are up, and the gauges of the units they hold.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use super::{Key, Lease, Slice, Terms};
use crate::metrics::{LeaseFamilies, LeaseMetrics};

/// This instance's leases, one per key, at most `capacity` of them.
#[derive(Debug)]
pub struct Leases {
    table: Mutex<HashMap<Key, Arc<Lease>>>,
    capacity: usize,
    /// Told when a slice is taken, so the keeper looks again at when the
    /// first one is up.
    pub taken: tokio::sync::Notify,
    metrics: LeaseFamilies,
}

impl Leases {
    /// An empty table of at most `capacity` leases.
    pub fn new(capacity: usize, metrics: LeaseFamilies) -> Self {
        Self {
            table: Mutex::new(HashMap::new()),
            capacity,
            taken: tokio::sync::Notify::new(),
            metrics,
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Arc<Lease>>> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The lease on `key`, made if there is room; `None` when the table is
    /// full (the key is then decided per request).
    pub fn get(&self, key: Key, terms: Terms) -> Option<Arc<Lease>> {
        let mut table = self.table();
        if let Some(lease) = table.get(&key) {
            return Some(Arc::clone(lease));
        }
        if table.len() >= self.capacity {
            return None;
        }
        let metrics = self.metrics.of(&key.scope, key.index);
        let lease = Arc::new(Lease::new(key.clone(), terms, metrics));
        table.insert(key, Arc::clone(&lease));
        Some(lease)
    }

    /// Every lease's slice that is up at `now` (or every slice, with
    /// `all`), taken out to be given back; leases left alone for long are
    /// forgotten.
    pub fn lapsed(&self, now: Instant, all: bool) -> Vec<(Arc<Lease>, Slice)> {
        let mut table = self.table();
        let out = table
            .values()
            .filter_map(|l| l.lapsed(now, all).map(|s| (Arc::clone(l), s)))
            .collect();
        table.retain(|_, l| !l.idle(now));
        out
    }

    /// When the first slice in hand is up.
    pub fn next_lapse(&self) -> Option<Instant> {
        self.table().values().filter_map(|l| l.lapses()).min()
    }

    /// Whether any lease is held.
    pub fn is_empty(&self) -> bool {
        self.table().is_empty()
    }

    /// Brings the units-held gauges up to date: each the sum over the
    /// leases of its limit (one per client, for a limit keyed by client).
    pub fn refresh_gauges(&self) {
        let table = self.table();
        let mut sums: HashMap<(&str, usize), (u64, &LeaseMetrics)> = HashMap::new();
        for lease in table.values() {
            let sum = sums
                .entry((&lease.key.scope, lease.key.index))
                .or_insert((0, &lease.metrics));
            sum.0 += lease.held_units();
        }
        for (held, metrics) in sums.into_values() {
            metrics.held.set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }
}
