//! One change to the registry, made where it is kept: a compare-and-set
//! in the shared store (applied here when it was made), or on the memory
//! store, a change of this instance's copy written to its state file now
//! or, for the keys file's reconcile, once it is done.

use std::sync::Arc;

use super::manage::{ManageError, Who};
use super::registry::{Digest, hex};
use super::{Backing, Keys, Record};
use crate::limit::registry::{Audit, AuditEntry, Expect, Write, Written};

impl Keys {
    /// [`Self::write_as`], the state file written at once.
    pub(super) async fn write(
        &self,
        digest: Digest,
        next: Option<&Arc<Record>>,
        before: Option<&Arc<Record>>,
        action: &str,
        who: Who<'_>,
    ) -> Result<Written, ManageError> {
        self.write_as(digest, (next, before), action, who, Commit::Now)
            .await
    }

    /// Writes `next` (`None`: removes) under `digest`, expecting `before`
    /// (`None`: no record), and applies it here when it was made.
    pub(super) async fn write_as(
        &self,
        digest: Digest,
        (next, before): (Option<&Arc<Record>>, Option<&Arc<Record>>),
        action: &str,
        who: Who<'_>,
        commit: Commit,
    ) -> Result<Written, ManageError> {
        let to_json = |r: &Record| serde_json::to_string(r).unwrap_or_default();
        let (next_text, before_text) = (next.map(|r| to_json(r)), before.map(|r| to_json(r)));
        let shown = next.or(before);
        let digest_hex = hex(&digest);
        let audit = Audit {
            operator: who.operator,
            action,
            identity: shown.map_or("", |r| r.identity.as_str()),
            key: shown.map_or("", |r| r.id.as_str()),
            reason: who.reason,
        };
        match &self.backing {
            Backing::Store(limiter) => {
                let write = Write {
                    digest: &digest_hex,
                    record: next_text.as_deref(),
                    expect: before_text.as_deref().map_or(Expect::Absent, Expect::Holds),
                    audit,
                };
                let written = limiter.registry_write(&write).await?;
                if let Written::Done { .. } = written {
                    self.replica.set(digest, next.cloned());
                }
                Ok(written)
            }
            Backing::File(file) => {
                let _one = self.writing.lock().await;
                let current = self.replica.get(&digest);
                let holds = match (&current, before) {
                    (None, None) => true,
                    (Some(c), Some(b)) => to_json(c) == to_json(b),
                    _ => false,
                };
                if !holds {
                    return Ok(Written::Refused {
                        current: current.map(|c| to_json(&c)),
                    });
                }
                self.replica.set(digest, next.cloned());
                let seq = self.replica.seq.load(std::sync::atomic::Ordering::Acquire) + 1;
                self.replica
                    .seq
                    .store(seq, std::sync::atomic::Ordering::Release);
                let entry = AuditEntry {
                    at_ms: crate::clock::now_ms(),
                    operator: who.operator.to_owned(),
                    action: action.to_owned(),
                    identity: audit.identity.to_owned(),
                    key: audit.key.to_owned(),
                    reason: who.reason.to_owned(),
                    before: before_text.clone().unwrap_or_default(),
                    after: next_text.unwrap_or_default(),
                };
                match commit {
                    Commit::Now => file
                        .commit(&self.replica, Some(entry))
                        .await
                        .map_err(ManageError::File)?,
                    Commit::Later => file.note(entry).await,
                }
                Ok(Written::Done {
                    before: before_text,
                })
            }
        }
    }
}

/// When a change made with the memory store reaches its state file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Commit {
    /// With the change: the file written whole, with it.
    Now,
    /// Later, with the changes made after it ([`Keys::commit_deferred`]):
    /// for the keys file's reconcile, whose changes a restart makes again
    /// from the file, so a file of many keys is written once, not once a
    /// key.
    Later,
}

impl Keys {
    /// Writes the state file with the changes made with
    /// [`Commit::Later`] (nothing to do on a shared store, where each
    /// change is the store's at once).
    pub(super) async fn commit_deferred(&self) -> Result<(), ManageError> {
        let Backing::File(file) = &self.backing else {
            return Ok(());
        };
        let _one = self.writing.lock().await;
        file.commit(&self.replica, None)
            .await
            .map_err(ManageError::File)
    }
}
