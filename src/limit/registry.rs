//! What the key registry asks of a shared store, as the store sees it: a
//! record is an opaque string under its key's digest (hex), changed one
//! at a time with what the writer expects it to hold, each change
//! numbered, logged for the instances following it, and audited in the
//! same step. What a record means is the `keys` module's question.

use super::{Limiter, StoreError};

/// Audit entries a shared store keeps.
pub const AUDIT_KEPT: u64 = 100_000;

/// Every record, and the number of the last change they include.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The last change's number.
    pub seq: u64,
    /// Digest (hex) and record.
    pub records: Vec<(String, String)>,
}

/// One change, as the log tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// Its number: one more than the change before it.
    pub seq: u64,
    /// The key's digest (hex).
    pub digest: String,
    /// The record now; `None`: removed.
    pub record: Option<String>,
}

/// What a writer expects the record to hold before its change.
#[derive(Debug, Clone, Copy)]
pub enum Expect<'a> {
    /// No record: a new key.
    Absent,
    /// Exactly this record (the change is made from it).
    Holds(&'a str),
    /// Whatever it holds.
    Any,
}

impl Expect<'_> {
    /// As the store's script reads it.
    pub fn as_arg(&self) -> &str {
        match self {
            Self::Absent => "<absent>",
            Self::Holds(record) => record,
            Self::Any => "<any>",
        }
    }
}

/// Who changes a record, and why, for the audit.
#[derive(Debug, Clone, Copy)]
pub struct Audit<'a> {
    /// The operator (the admin token's name, or the keys file).
    pub operator: &'a str,
    /// What was done: `create`, `import`, `update`, `revoke`, `rotate`,
    /// `reconcile`.
    pub action: &'a str,
    /// Whose key it is.
    pub identity: &'a str,
    /// The key's public id.
    pub key: &'a str,
    /// Why.
    pub reason: &'a str,
}

/// A change of one record.
#[derive(Debug, Clone, Copy)]
pub struct Write<'a> {
    /// The key's digest (hex).
    pub digest: &'a str,
    /// The record after; `None`: removed.
    pub record: Option<&'a str>,
    /// What it must hold before.
    pub expect: Expect<'a>,
    /// The audit entry's fields.
    pub audit: Audit<'a>,
}

/// How a change went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// Made; the record before it.
    Done {
        /// What it held (`None`: nothing).
        before: Option<String>,
    },
    /// Not made: the record did not hold what was expected.
    Refused {
        /// What it holds.
        current: Option<String>,
    },
}

/// One audit entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditEntry {
    /// When (ms since the epoch, the store's clock).
    pub at_ms: u64,
    /// Who: the admin token's name, or the keys file.
    pub operator: String,
    /// What was done.
    pub action: String,
    /// Whose: the key's identity, or the client an action was on.
    pub identity: String,
    /// The key's public id, or the route an action was on.
    pub key: String,
    /// Why.
    pub reason: String,
    /// What it held before (a record, a standing).
    pub before: String,
    /// What it holds after.
    pub after: String,
}

/// The store holds no registry: the memory store's registry is the
/// instance's own, kept by the `keys` module in a file.
fn not_shared() -> StoreError {
    StoreError::Backend("the memory store keeps no shared key registry".to_owned())
}

impl Limiter {
    /// Whether the store is shared by instances (a registry can live in it).
    pub fn is_shared(&self) -> bool {
        matches!(self, Self::Redis(_))
    }

    /// Every record (see [`crate::limit::redis::RedisStore::registry_snapshot`]).
    pub async fn registry_snapshot(&self) -> Result<Snapshot, StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => shared.store().registry_snapshot().await,
        }
    }

    /// The record under `digest`, as the store holds it now.
    pub async fn registry_get(&self, digest: &str) -> Result<Option<String>, StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => shared.store().registry_get(digest).await,
        }
    }

    /// The changes after `seq`, or `None` when a snapshot must be read.
    pub async fn registry_changes(&self, seq: u64) -> Result<Option<Vec<Change>>, StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => shared.store().registry_changes(seq).await,
        }
    }

    /// One change of one record, logged and audited.
    pub async fn registry_write(&self, write: &Write<'_>) -> Result<Written, StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => shared.store().registry_write(write).await,
        }
    }

    /// Adds an operator's action to the audit.
    pub async fn audit_append(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => shared.store().audit_append(entry).await,
        }
    }

    /// The newest audit entries `keep` accepts, at most `count`.
    pub async fn audit_read(
        &self,
        count: usize,
        keep: &(dyn Fn(&AuditEntry) -> bool + Sync),
    ) -> Result<Vec<AuditEntry>, StoreError> {
        match self {
            Self::Memory(_) => Err(not_shared()),
            Self::Redis(shared) => {
                shared
                    .store()
                    .audit_read(
                        count,
                        usize::try_from(AUDIT_KEPT).unwrap_or(usize::MAX),
                        keep,
                    )
                    .await
            }
        }
    }
}
