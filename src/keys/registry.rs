//! The registry as each instance holds it: every key's record by its
//! keyed digest, in memory, so that verifying a key (known or not) costs
//! no call to the store and a flood of made-up keys grows nothing. The
//! store's records are the truth; the instance follows their changes (see
//! `keys::sync`) and applies its own at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use sha2::{Digest as _, Sha256};

use super::Outcome;
use super::record::Record;

/// A key's keyed digest: HMAC-SHA-256 of its SHA-256.
pub type Digest = [u8; 32];

/// Every key's record, by digest, as this instance last heard.
pub(super) struct Replica {
    secret: ring::hmac::Key,
    records: RwLock<HashMap<Digest, Arc<Record>>>,
    /// The number of the last change applied.
    pub(super) seq: AtomicU64,
    /// Lookups by outcome, in [`Outcome::ALL`]'s order.
    pub(super) lookups: [AtomicU64; Outcome::ALL.len()],
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica")
            .field("keys", &self.len())
            .field("seq", &self.seq.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Replica {
    /// An empty registry whose digests are keyed with `secret`.
    pub(super) fn new(secret: &[u8]) -> Self {
        Self {
            secret: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret),
            records: RwLock::default(),
            seq: AtomicU64::new(0),
            lookups: Default::default(),
        }
    }

    /// The digest of a key given as it is.
    pub(super) fn digest_of_key(&self, key: &[u8]) -> Digest {
        self.digest_of_sha256(&Sha256::digest(key).into())
    }

    /// The digest of a key given by its SHA-256.
    pub(super) fn digest_of_sha256(&self, sha: &[u8; 32]) -> Digest {
        let tag = ring::hmac::sign(&self.secret, sha);
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// The record of the key whose digest is `digest`, if it is valid at
    /// `now_ms`, or why not (not counted).
    pub(super) fn check(&self, digest: &Digest, now_ms: u64) -> Result<Arc<Record>, Outcome> {
        judged(self.get(digest), now_ms)
    }

    /// Counts one lookup's outcome.
    pub(super) fn count(&self, outcome: Outcome) {
        if let Some(counter) = self.lookups.get(outcome as usize) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The record under `digest`.
    pub(super) fn get(&self, digest: &Digest) -> Option<Arc<Record>> {
        self.records
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(digest)
            .cloned()
    }

    /// Every record whose `keep` is true, with its digest.
    pub(super) fn find(&self, keep: impl Fn(&Record) -> bool) -> Vec<(Digest, Arc<Record>)> {
        self.records
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(_, r)| keep(r))
            .map(|(d, r)| (*d, Arc::clone(r)))
            .collect()
    }

    /// How many keys it holds.
    pub(super) fn len(&self) -> usize {
        self.records
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .len()
    }

    /// Puts `record` under `digest` (`None`: removes it).
    pub(super) fn set(&self, digest: Digest, record: Option<Arc<Record>>) {
        self.put(digest, record, None);
    }

    fn put(&self, digest: Digest, record: Option<Arc<Record>>, seq: Option<u64>) {
        let mut records = self
            .records
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match record {
            Some(record) => records.insert(digest, record),
            None => records.remove(&digest),
        };
        if let Some(seq) = seq {
            self.seq.store(seq, Ordering::Release);
        }
    }

    /// Applies change `seq`: `record` under `digest` (`None`: removed),
    /// the number stored while the table is still held.
    pub(super) fn apply(&self, digest: Digest, record: Option<Arc<Record>>, seq: u64) {
        self.put(digest, record, Some(seq));
    }

    /// Puts `record`, read from the store after change `seq` was applied
    /// here, under `digest`, unless a change was applied since (it may
    /// have been this record's end).
    pub(super) fn learn(&self, digest: Digest, record: Arc<Record>, seq: u64) -> bool {
        let mut records = self
            .records
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.seq.load(Ordering::Acquire) != seq {
            return false;
        }
        records.entry(digest).or_insert(record);
        true
    }

    /// Replaces every record with `records`, as of change `seq`.
    pub(super) fn replace(&self, records: HashMap<Digest, Arc<Record>>, seq: u64) {
        *self
            .records
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = records;
        self.seq.store(seq, Ordering::Release);
    }

    /// Every record, for the state file.
    pub(super) fn all(&self) -> Vec<(Digest, Arc<Record>)> {
        self.find(|_| true)
    }
}

/// `digest` as 64 hex digits, as the store names it.
pub fn hex(digest: &Digest) -> String {
    crate::client::hex(digest)
}

/// A digest read from 64 hex digits.
pub fn from_hex(text: &str) -> Option<Digest> {
    crate::client::sha256_from_hex(text)
}

/// A key's public id: `key_` and the first 16 hex digits of its digest.
pub fn id_of(digest: &Digest) -> String {
    let mut id = String::from("key_");
    id.push_str(&hex(digest)[..16]);
    id
}

/// `found` if it is valid at `now_ms`, or why not.
pub(super) fn judged(found: Option<Arc<Record>>, now_ms: u64) -> Result<Arc<Record>, Outcome> {
    match found {
        None => Err(Outcome::Unknown),
        Some(record) if !record.enabled => Err(Outcome::Disabled),
        Some(record) if record.expired_at(now_ms) => Err(Outcome::Expired),
        Some(record) => Ok(record),
    }
}
