//! Sharded in-process maps keyed by (route, client), shared by the memory
//! store and the denial cache.
//!
//! A key is hashed once, with SipHash under random keys (clients choose
//! their ids, so the hash must be keyed), and that hash both picks the shard
//! and indexes the map. The slot keeps the route and client it belongs to:
//! two keys whose 64-bit hashes collide (vanishingly rare, and not
//! steerable without the random keys) replace each other's state rather
//! than share it.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::client::ClientId;

/// One shard's map.
pub type Map<V> = HashMap<u64, Slot<V>, BuildHasherDefault<Prehashed>>;

/// Maps from (route, client) to `V`, split over several locks.
#[derive(Debug)]
pub struct Shards<V> {
    shards: Box<[Mutex<Map<V>>]>,
    hasher: RandomState,
}

/// A value and the (route, client) it belongs to.
#[derive(Debug)]
pub struct Slot<V> {
    route: Arc<str>,
    client: ClientId,
    /// The value.
    pub value: V,
}

impl<V> Slot<V> {
    /// A slot for `route` and `client`.
    pub fn new(route: &Arc<str>, client: &ClientId, value: V) -> Self {
        Self {
            route: Arc::clone(route),
            client: client.clone(),
            value,
        }
    }

    /// Whether this slot belongs to `route` and `client`.
    pub fn holds(&self, route: &str, client: &ClientId) -> bool {
        &*self.route == route && self.client == *client
    }
}

impl<V> Shards<V> {
    /// `count` empty shards.
    pub fn new(count: usize) -> Self {
        Self {
            shards: (0..count.max(1))
                .map(|_| Mutex::new(Map::default()))
                .collect(),
            hasher: RandomState::new(),
        }
    }

    /// Locks the shard of (`route`, `client`) and returns it with the key's
    /// hash, the index into its map.
    pub fn lock(&self, route: &str, client: &ClientId) -> (MutexGuard<'_, Map<V>>, u64) {
        let hash = self.hasher.hash_one((route, client));
        let shard = &self.shards[hash as usize % self.shards.len()];
        (shard.lock().unwrap_or_else(PoisonError::into_inner), hash)
    }

    /// Keeps only the values `keep` says to; returns how many remain.
    pub fn retain(&self, mut keep: impl FnMut(&V) -> bool) -> usize {
        let mut remaining = 0;
        for shard in self.shards.iter() {
            let mut map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            map.retain(|_, slot| keep(&slot.value));
            remaining += map.len();
        }
        remaining
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
            .sum()
    }
}

/// A hasher for keys that already are keyed hashes: passes them through.
#[derive(Debug, Default)]
pub struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}
