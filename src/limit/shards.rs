//! Sharded in-process maps keyed by (route, client), shared by the memory
//! store and the denial cache.
//!
//! A key is hashed once, with SipHash under random keys (clients choose
//! their ids, so the hash must be keyed), and that hash both picks the shard
//! and indexes the map. The slot keeps the route and client it belongs to:
//! two keys whose 64-bit hashes collide (vanishingly rare, and not
//! steerable without the random keys) replace each other's state rather
//! than share it.
//!
//! Each shard holds at most its part of the table's capacity; a store asks
//! [`Shards::has_room`] before it adds a key, and decides what a key that
//! finds no room gets (memory store: a shared overflow bucket; denial
//! cache: not remembered). Keys already held are never evicted to make
//! room: evicting a counted client would hand it a fresh limit.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::client::ClientId;

/// One shard's map.
pub type Map<V> = HashMap<u64, Slot<V>, BuildHasherDefault<Prehashed>>;

/// Maps from (route, client) to `V`, split over several locks.
#[derive(Debug)]
pub struct Shards<V> {
    shards: Box<[Mutex<Map<V>>]>,
    hasher: RandomState,
    /// Most keys one shard holds.
    per_shard: usize,
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
    /// `count` empty shards holding at most `capacity` keys in all.
    pub fn new(count: usize, capacity: usize) -> Self {
        let count = count.max(1);
        Self {
            shards: (0..count).map(|_| Mutex::new(Map::default())).collect(),
            hasher: RandomState::new(),
            per_shard: (capacity / count).max(1),
        }
    }

    /// Whether `map`, a shard of these, may hold the key `hash`: it already
    /// does, or the shard is below its part of the capacity.
    pub fn has_room(&self, map: &Map<V>, hash: u64) -> bool {
        map.len() < self.per_shard || map.contains_key(&hash)
    }

    /// The key's hash. The key is laid out in one buffer and hashed with one
    /// call when it fits (each call into SipHash pays for its own buffering:
    /// this halves the cost for an address), else hashed part by part.
    fn hash(&self, route: &str, client: &ClientId) -> u64 {
        let mut key = KeyBytes::default();
        if key.push(route.as_bytes()) && key.push(&[0xff]) && key.client(client) {
            let mut hasher = self.hasher.build_hasher();
            hasher.write(key.bytes());
            hasher.finish()
        } else {
            self.hasher.hash_one((route, client))
        }
    }

    /// Locks the shard of (`route`, `client`) and returns it with the key's
    /// hash, the index into its map.
    pub fn lock(&self, route: &str, client: &ClientId) -> (MutexGuard<'_, Map<V>>, u64) {
        let hash = self.hash(route, client);
        let shard = &self.shards[hash as usize % self.shards.len()];
        (shard.lock().unwrap_or_else(PoisonError::into_inner), hash)
    }

    /// The shard of (`route`, `client`) and the key's hash, without
    /// locking: for a caller that locks several shards at once, in order.
    pub fn place(&self, route: &str, client: &ClientId) -> (usize, u64) {
        let hash = self.hash(route, client);
        (hash as usize % self.shards.len(), hash)
    }

    /// Locks shard `index` (from [`Shards::place`]).
    pub fn lock_shard(&self, index: usize) -> MutexGuard<'_, Map<V>> {
        self.shards[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
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

    /// Calls `f` with the route, client and value of every slot held of
    /// route (or entry) `route`, one shard locked at a time.
    pub fn each_of(&self, route: &str, mut f: impl FnMut(&ClientId, &V)) {
        for shard in self.shards.iter() {
            let map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for slot in map.values() {
                if &*slot.route == route {
                    f(&slot.client, &slot.value);
                }
            }
        }
    }

    /// Calls `f` with every value held, its route (or entry) and client.
    pub fn each(&self, mut f: impl FnMut(&str, &ClientId, &V)) {
        for shard in self.shards.iter() {
            let map = shard.lock().unwrap_or_else(PoisonError::into_inner);
            for slot in map.values() {
                f(&slot.route, &slot.client, &slot.value);
            }
        }
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
/// A (route, client) key as bytes: the route, `0xff` (which UTF-8 never
/// holds), then the client, each part tagged and each header value preceded
/// by its length, so that two different keys never lay out alike.
struct KeyBytes {
    buf: [u8; 128],
    len: usize,
}

impl Default for KeyBytes {
    fn default() -> Self {
        Self {
            buf: [0; 128],
            len: 0,
        }
    }
}

impl KeyBytes {
    /// Appends `bytes`; false if they do not fit.
    fn push(&mut self, bytes: &[u8]) -> bool {
        let Some(room) = self.buf.get_mut(self.len..self.len + bytes.len()) else {
            return false;
        };
        room.copy_from_slice(bytes);
        self.len += bytes.len();
        true
    }

    fn client(&mut self, client: &ClientId) -> bool {
        match client {
            ClientId::Addr(IpAddr::V4(a)) => self.push(&[4]) && self.push(&a.octets()),
            ClientId::Addr(IpAddr::V6(a)) => self.push(&[6]) && self.push(&a.octets()),
            ClientId::Header(bytes) => {
                self.push(b"h")
                    && self.push(&(bytes.len() as u64).to_le_bytes())
                    && self.push(bytes)
            }
            ClientId::Digest(digest) => self.push(b"d") && self.push(&digest[..]),
            ClientId::Global => self.push(b"g"),
            ClientId::Composite(parts) => {
                self.push(b"c")
                    && self.push(&(parts.len() as u64).to_le_bytes())
                    && parts.iter().all(|part| self.client(part))
            }
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn header(s: &str) -> ClientId {
        ClientId::header(s)
    }

    fn layout(route: &str, client: &ClientId) -> Option<Vec<u8>> {
        let mut key = KeyBytes::default();
        (key.push(route.as_bytes()) && key.push(&[0xff]) && key.client(client))
            .then(|| key.bytes().to_vec())
    }

    #[test]
    fn different_keys_never_lay_out_alike() {
        let keys = [
            (
                "api",
                ClientId::Addr("10.0.0.1".parse().unwrap_or_else(|_| unreachable!())),
            ),
            (
                "api",
                ClientId::Addr("::ffff:10.0.0.1".parse().unwrap_or_else(|_| unreachable!())),
            ),
            ("api", header("abcd")),
            ("api", header("ab")),
            ("ap", header("iab")),
            ("api", ClientId::Composite(Box::new([header("ab")]))),
            (
                "api",
                ClientId::Composite(Box::new([header("a"), header("b")])),
            ),
            ("api", ClientId::Composite(Box::new([header("a")]))),
            ("api", ClientId::Composite(Box::new([]))),
            ("api", ClientId::digest_of("ab")),
            ("api", header(&"\0".repeat(32))),
        ];
        let layouts: Vec<Vec<u8>> = keys
            .iter()
            .map(|(route, client)| layout(route, client).unwrap_or_default())
            .collect();
        for (i, a) in layouts.iter().enumerate() {
            assert!(!a.is_empty(), "{:?} fits", keys[i]);
            for b in &layouts[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn a_full_shard_has_room_only_for_keys_it_holds() {
        let shards: Shards<()> = Shards::new(2, 4);
        let route: Arc<str> = "api".into();
        let mut added = 0;
        for i in 0..100u8 {
            let client = header(&format!("c{i}"));
            let (mut map, hash) = shards.lock(&route, &client);
            if shards.has_room(&map, hash) {
                map.insert(hash, Slot::new(&route, &client, ()));
                added += 1;
            } else {
                assert!(!map.contains_key(&hash));
            }
        }
        assert_eq!((added, shards.len()), (4, 4));
        for i in 0..100u8 {
            let client = header(&format!("c{i}"));
            let (map, hash) = shards.lock(&route, &client);
            assert_eq!(shards.has_room(&map, hash), map.contains_key(&hash));
        }
    }

    #[test]
    fn keys_hash_the_same_every_time_whether_or_not_they_fit() {
        let shards: Shards<()> = Shards::new(4, 100);
        let short = header("key-1");
        let long = header(&"k".repeat(200));
        assert!(layout("api", &long).is_none(), "too long for one buffer");
        for client in [&short, &long] {
            assert_eq!(shards.hash("api", client), shards.hash("api", client));
        }
        assert_ne!(shards.hash("api", &short), shards.hash("api", &long));
        assert_ne!(shards.hash("api", &short), shards.hash("web", &short));
    }
}
