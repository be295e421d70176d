//! Whose key is this? The registry of customers' keys every instance
//! shares: a key maps to an identity (the customer; several keys may share
//! one), a plan, attributes (organisation, billing day, anything a limit
//! may key on), whether it is enabled, and an expiry.
//!
//! Keys are kept only as keyed digests (HMAC-SHA-256, keyed with the
//! store's `id_secret`, of the key's SHA-256, so a key can be imported by
//! its SHA-256 alone). The records live in the store (one Redis, Sentinel
//! or a Cluster: see `limit::redis`'s registry part) and each instance
//! holds all of them in memory ([`registry`]), following the store's log
//! of changes every `sync_every` (200 ms) and applying its own at once:
//! verifying a key, known or not, costs no store call, and revocations,
//! plan and attribute changes reach every instance within a second. With
//! the memory store the registry is the instance's own, kept in
//! `state_file` ([`file`]), written whole and atomically on every change.
//!
//! [`manage`] changes it (the admin API), each change audited with who
//! made it and why; [`reconcile`] applies the keys file; [`sync`] follows
//! the store.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use http::HeaderMap;

pub mod file;
pub mod manage;
pub mod metrics;
pub mod reconcile;
pub mod record;
pub mod registry;
pub mod settings;
pub mod sync;
mod write;

pub use reconcile::{KeysFile, Listed};
pub use record::{Attributes, Record, Source};
pub use settings::{KeyFrom, Settings};

use crate::limit::Limiter;
use registry::Replica;

/// Most asks of the store a second for keys an instance does not know
/// (keys made elsewhere a moment ago): a flood of made-up keys from many
/// addresses, each within its failure budget, costs the store no more.
pub const MAX_ASKS_PER_SECOND: u64 = 50;

/// What verifying a key found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Known, enabled and not expired.
    Valid,
    /// The request carries no key.
    Missing,
    /// No such key.
    Unknown,
    /// Known and disabled.
    Disabled,
    /// Known and past its expiry.
    Expired,
    /// Not looked up: the address sent too many unknown keys this minute.
    TooManyFailures,
    /// Not known yet: this instance has not read the store's records
    /// since it started (the store was down), so it cannot tell.
    Unavailable,
}

impl Outcome {
    /// Every outcome, in declaration order.
    pub const ALL: [Outcome; 7] = [
        Self::Valid,
        Self::Missing,
        Self::Unknown,
        Self::Disabled,
        Self::Expired,
        Self::TooManyFailures,
        Self::Unavailable,
    ];

    /// Its name in metrics and the access log.
    pub fn name(self) -> &'static str {
        match self {
            Self::Valid => "valid",
            Self::Missing => "missing",
            Self::Unknown => "unknown",
            Self::Disabled => "disabled",
            Self::Expired => "expired",
            Self::TooManyFailures => "too_many_failures",
            Self::Unavailable => "unavailable",
        }
    }
}

/// Where the registry's records live.
#[derive(Debug)]
enum Backing {
    /// The shared store.
    Store(Arc<Limiter>),
    /// The instance's own file (the memory store).
    File(file::StateFile),
}

/// The registry: this instance's copy of every record, and where the
/// records live.
#[derive(Debug)]
pub struct Keys {
    replica: Replica,
    backing: Backing,
    settings: Settings,
    /// When the store was last followed successfully (ms since the epoch).
    synced_ms: AtomicU64,
    /// Whether the last attempt to follow the store failed.
    sync_failing: AtomicBool,
    /// The keys file's last reconcile.
    reconciled: std::sync::Mutex<Option<manage::Reconciled>>,
    /// The keys file's reconcile, one at a time, and the file it has not
    /// finished applying (tried again on each follow).
    pending: tokio::sync::Mutex<Option<Arc<KeysFile>>>,
    /// The digests of the keys the keys file last read lists.
    listed: std::sync::RwLock<std::collections::HashSet<registry::Digest>>,
    /// Changes to the state file, one at a time.
    writing: tokio::sync::Mutex<()>,
    /// Asks of the store for keys this instance does not know, in the
    /// current second: the second in the high 32 bits, the count in the
    /// low 32.
    asks: AtomicU64,
    /// Asks of the store for keys this instance did not know, since
    /// start: made, and those that found the key.
    pub(crate) asked: [AtomicU64; 2],
    /// Unknown keys counted per address and minute (`None`: no limit).
    failures: Option<crate::client::Failures>,
}

/// Why the registry could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store's records could not be read.
    #[error("cannot read the key registry from the store: {0}")]
    Store(crate::limit::StoreError),
    /// The memory store's registry needs a file to be kept in.
    #[error("[keys] with the memory store needs state_file, where the instance's keys are kept")]
    NoStateFile,
    /// The state file could not be read or written.
    #[error("the key registry's state file {0}: {1}")]
    File(std::path::PathBuf, String),
}

impl Keys {
    /// The registry of `settings`, its digests keyed with `secret`, its
    /// records read from `limiter`'s store (a shared one) or from the
    /// state file (the memory store).
    pub async fn start(
        settings: Settings,
        limiter: Arc<Limiter>,
        secret: &[u8],
    ) -> Result<Arc<Self>, StartError> {
        let replica = Replica::new(secret);
        let backing = if limiter.is_shared() {
            Backing::Store(limiter)
        } else {
            let path = settings.state_file.clone().ok_or(StartError::NoStateFile)?;
            Backing::File(file::StateFile::open(path, &replica)?)
        };
        let keys = Arc::new(Self {
            replica,
            backing,
            synced_ms: AtomicU64::new(0),
            sync_failing: AtomicBool::new(false),
            reconciled: std::sync::Mutex::default(),
            pending: tokio::sync::Mutex::default(),
            listed: std::sync::RwLock::default(),
            writing: tokio::sync::Mutex::new(()),
            asks: AtomicU64::new(0),
            asked: Default::default(),
            failures: (settings.failures_per_minute > 0)
                .then(|| crate::client::Failures::new(settings.failures_per_minute)),
            settings,
        });
        if let Backing::Store(limiter) = &keys.backing {
            match limiter.registry_snapshot().await {
                Ok(snapshot) => keys.apply_snapshot(snapshot),
                // A store that refuses floodgate's settings is a
                // configuration error: floodgate does not start.
                Err(e @ crate::limit::StoreError::Refused(_)) => return Err(StartError::Store(e)),
                // One that is down may come back: the registry is read
                // then, and keys are answered 503 until it is.
                Err(e) => {
                    keys.sync_failing.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        error = %e,
                        "the key registry cannot be read from the store; keys are refused as unavailable (503) until it can"
                    );
                }
            }
        }
        Ok(keys)
    }

    /// The record of the key `key` if it is valid now, or why not, as
    /// this instance's copy of the registry says (no store call; the
    /// caller counts the outcome, see [`Self::count`]).
    pub fn verify(&self, key: &[u8]) -> Result<Arc<Record>, Outcome> {
        let digest = self.replica.digest_of_key(key);
        match self.replica.check(&digest, crate::clock::now_ms()) {
            Err(Outcome::Unknown) if !self.loaded() => Err(Outcome::Unavailable),
            judged => judged,
        }
    }

    /// Whether the registry's records were read: always with the memory
    /// store; with a shared one once a read of the store succeeded.
    fn loaded(&self) -> bool {
        !matches!(self.backing, Backing::Store(_)) || self.synced_ms.load(Ordering::Relaxed) > 0
    }

    /// [`Self::verify`] for a key this instance does not know: the store
    /// asked once (a key made on another instance a moment ago, whose
    /// change has not arrived yet), and what it finds kept. At most
    /// [`MAX_ASKS_PER_SECOND`] asks a second, and the caller bounds how
    /// often an address may make it ask (the failure budget): a flood of
    /// made-up keys costs the store a few calls, and nothing is kept for
    /// them.
    pub async fn ask(&self, key: &[u8]) -> Result<Arc<Record>, Outcome> {
        let now_ms = crate::clock::now_ms();
        let digest = self.replica.digest_of_key(key);
        let seq = self.replica.seq.load(Ordering::Acquire);
        let mut judged = self.replica.check(&digest, now_ms);
        if let (Err(Outcome::Unknown), Backing::Store(limiter)) = (&judged, &self.backing)
            && self.may_ask(now_ms)
        {
            let asked = limiter.registry_get(&registry::hex(&digest)).await;
            self.asked[0].fetch_add(1, Ordering::Relaxed);
            if let Ok(Some(text)) = asked
                && let Ok(record) = serde_json::from_str::<Record>(&text)
            {
                self.asked[1].fetch_add(1, Ordering::Relaxed);
                let record = Arc::new(record);
                judged = if self.replica.learn(digest, Arc::clone(&record), seq) {
                    registry::judged(Some(record), now_ms)
                } else {
                    // A change arrived meanwhile: the copy says now.
                    self.replica.check(&digest, now_ms)
                };
            }
        }
        judged
    }

    /// The record of the key `key`, valid or not, without counting a
    /// lookup (an operator naming a client by its key).
    pub fn lookup(&self, key: &[u8]) -> Option<Arc<Record>> {
        self.replica.get(&self.replica.digest_of_key(key))
    }

    /// Whether the store may be asked for one more unknown key this second
    /// (at most [`MAX_ASKS_PER_SECOND`], however many addresses send
    /// them), counting it.
    fn may_ask(&self, now_ms: u64) -> bool {
        let second = now_ms / 1000;
        let taken = self
            .asks
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |cell| {
                let (at, n) = (cell >> 32, cell & u64::from(u32::MAX));
                let next = if at == second { n + 1 } else { 1 };
                (next <= MAX_ASKS_PER_SECOND).then_some((second << 32) | next)
            });
        taken.is_ok()
    }

    /// Counts a lookup that found no key to verify.
    pub fn count(&self, outcome: Outcome) {
        self.replica.count(outcome);
    }

    /// How many keys the registry holds.
    pub fn len(&self) -> usize {
        self.replica.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Unknown keys sent per address and minute.
    pub fn failures(&self) -> Option<&crate::client::Failures> {
        self.failures.as_ref()
    }

    /// The settings it runs with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The registry's state for `/status.json`.
    pub fn status(&self) -> serde_json::Value {
        let lookups: serde_json::Map<String, serde_json::Value> = Outcome::ALL
            .iter()
            .zip(&self.replica.lookups)
            .map(|(o, n)| (o.name().to_owned(), n.load(Ordering::Relaxed).into()))
            .collect();
        let reconciled = self
            .reconciled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        serde_json::json!({
            "keys": self.len(),
            "kept_in": match &self.backing {
                Backing::Store(_) => "store".to_owned(),
                Backing::File(f) => f.path().display().to_string(),
            },
            "change": self.replica.seq.load(Ordering::Relaxed),
            "synced_ms": self.synced_ms.load(Ordering::Relaxed),
            "sync_failing": self.sync_failing.load(Ordering::Relaxed),
            "lookups": lookups,
            "store_asks": self.asked[0].load(Ordering::Relaxed),
            "store_asks_found": self.asked[1].load(Ordering::Relaxed),
            "file": reconciled,
        })
    }
}

/// The key a request carries, as `from` reads it: the credentials of an
/// `Authorization: Bearer` field (the scheme in any case), or a header's
/// whole value. A field sent twice carries none.
pub fn read_key<'h>(headers: &'h HeaderMap, from: &KeyFrom) -> Option<&'h [u8]> {
    let name = match from {
        KeyFrom::Bearer => &http::header::AUTHORIZATION,
        KeyFrom::Header(name) => name,
    };
    let mut values = headers.get_all(name).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let value = value.as_bytes().trim_ascii();
    let key = match from {
        KeyFrom::Bearer => {
            let (scheme, rest) = value.split_at_checked(7)?;
            if !scheme.eq_ignore_ascii_case(b"bearer ") {
                return None;
            }
            rest.trim_ascii()
        }
        KeyFrom::Header(_) => value,
    };
    (!key.is_empty()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_key_is_read_in_any_case_of_its_scheme() {
        let mut headers = HeaderMap::new();
        for (sent, read) in [
            ("Bearer sk-1", Some(&b"sk-1"[..])),
            ("bearer   sk-2 ", Some(b"sk-2")),
            ("BEARER sk-3", Some(b"sk-3")),
            ("Basic c2stMQ==", None),
            ("Bearer ", None),
            ("Bearersk-4", None),
        ] {
            headers.insert("authorization", sent.parse().expect("a value"));
            assert_eq!(read_key(&headers, &KeyFrom::Bearer), read, "{sent:?}");
        }
        headers.append("authorization", "Bearer sk-5".parse().expect("a value"));
        assert_eq!(read_key(&headers, &KeyFrom::Bearer), None, "sent twice");
        let named = KeyFrom::Header(http::HeaderName::from_static("x-api-key"));
        headers.insert("x-api-key", "k 1".parse().expect("a value"));
        assert_eq!(read_key(&headers, &named), Some(&b"k 1"[..]));
    }
}
