//! The keys file (`[keys] file`), reconciled into the registry: for teams
//! that keep their customers' keys in git, by SHA-256, beside the rest of
//! the configuration.
//!
//! The file owns the keys it lists: a record it lists is added when the
//! registry lacks it and updated when it differs, and a record it added
//! (`source = file`) is removed when it no longer lists it. Keys made or
//! imported through the admin API are never touched (a listed key the API
//! already holds is left as it is, and said so); the API in turn refuses
//! to change the file's keys or to import one the file lists.
//!
//! Every change is one compare-and-set in the store, so instances that
//! read the same file converge: the first to reconcile writes, the others
//! find each record as the file says and write nothing. Each change is
//! audited with the operator `keys file` and the file's path.
//!
//! `config` reads the file (file:line:column for every problem, a file
//! with one refused whole); this module applies what it lists.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures_util::StreamExt as _;

use super::manage::{ATTEMPTS, ManageError, Reconciled, Spec, Who, read_stored};
use super::registry::Digest;
use super::write::Commit;
use super::{Keys, Record, Source};
use crate::limit::registry::Written;

/// How many of the file's keys are written at once: on a shared store,
/// as many round trips in flight (each key's change is its own
/// compare-and-set, so they do not wait on one another).
const IN_FLIGHT: usize = 32;

/// The operator the audit names for the file's changes.
pub const FILE_OPERATOR: &str = "keys file";

/// The keys file as read: where it is and the keys it lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysFile {
    /// Where it is.
    pub path: PathBuf,
    /// The keys it lists. `None`: it lists none without saying so (empty,
    /// or comments only), which is taken for a file cut short or not yet
    /// written, not for "remove every key": it is not applied, with a
    /// warning. A file that means no keys says `key = []`.
    pub keys: Option<Vec<Listed>>,
}

/// One key the file lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// The key's SHA-256.
    pub sha256: [u8; 32],
    /// Its record as the file describes it.
    pub spec: Spec,
    /// Where the file lists it (`keys.toml:12:1`), for messages.
    pub at: String,
}

/// What reconciling one listed key did.
enum Step {
    Added,
    Updated,
    Same,
    /// The admin API holds it: left as it is.
    NotOwned(String),
}

impl Keys {
    /// Applies `file` to the registry (see the module's doc) and records
    /// the reconcile for `/status.json` and the metrics. An error (the
    /// store down, a record changing too often) leaves the changes made
    /// so far; the whole file is tried again on each follow of the store
    /// until one reconcile finishes.
    pub async fn reconcile(&self, file: &Arc<KeysFile>) -> Result<Reconciled, ManageError> {
        let mut pending = self.pending.lock().await;
        *pending = Some(Arc::clone(file));
        let path = file.path.display().to_string();
        let mut reconciled = Reconciled {
            path: path.clone(),
            at_ms: crate::clock::now_ms(),
            keys: 0,
            changed: [0; 3],
            problem: None,
            warning: None,
            not_owned: Vec::new(),
        };
        let result = match &file.keys {
            None => {
                let warning = format!(
                    "{path} lists no key; it is not applied and the keys it listed stay (a file that means no keys says key = [])"
                );
                tracing::warn!(path = %path, "keys file lists no key; not applied (write key = [] to remove every key it owned)");
                reconciled.warning = Some(warning);
                Ok(())
            }
            Some(listed) => self.apply_file(&path, listed, &mut reconciled).await,
        };
        match &result {
            Ok(()) => *pending = None,
            Err(e) => reconciled.problem = Some(format!("{e}; tried again shortly")),
        }
        self.reconciled(reconciled.clone());
        result.map(|()| reconciled)
    }

    /// Records that the keys file at `path` was refused for `problem`:
    /// the registry stays as the last reconcile left it, whose counts and
    /// time stay shown beside the problem.
    pub fn file_refused(&self, path: &Path, problem: &str) {
        let mut reconciled = self
            .reconciled
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let last = reconciled.get_or_insert_with(|| Reconciled {
            path: path.display().to_string(),
            at_ms: 0,
            keys: 0,
            changed: [0; 3],
            problem: None,
            warning: None,
            not_owned: Vec::new(),
        });
        last.problem = Some(problem.to_owned());
    }

    /// Tries again a reconcile that did not finish, if one is waiting and
    /// none runs.
    pub(super) async fn reconcile_pending(&self) {
        let file = match self.pending.try_lock() {
            Ok(pending) => pending.clone(),
            Err(_) => return,
        };
        if let Some(file) = file
            && let Err(e) = self.reconcile(&file).await
        {
            tracing::debug!(error = %e, "the keys file's reconcile is still not finished");
        }
    }

    /// Whether the keys file last read lists the key `digest`.
    pub(super) fn listed_in_file(&self, digest: &Digest) -> bool {
        self.listed
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(digest)
    }

    async fn apply_file(
        &self,
        path: &str,
        listed: &[Listed],
        reconciled: &mut Reconciled,
    ) -> Result<(), ManageError> {
        let wanted: HashMap<Digest, &Listed> = listed
            .iter()
            .map(|l| (self.replica.digest_of_sha256(&l.sha256), l))
            .collect();
        *self
            .listed
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = wanted.keys().copied().collect();
        reconciled.keys = wanted.len();
        let mut failed = self.add_listed(path, &wanted, reconciled).await.err();
        if failed.is_none() {
            failed = self.remove_unlisted(path, &wanted, reconciled).await.err();
        }
        // What was changed so far reaches the state file, whether or not
        // all of it could be.
        if reconciled.changed.iter().any(|&n| n > 0) {
            self.commit_deferred().await?;
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let [added, updated, removed] = reconciled.changed;
        if added + updated + removed > 0 {
            tracing::info!(
                path,
                keys = reconciled.keys,
                added,
                updated,
                removed,
                "keys file reconciled into the registry"
            );
        }
        Ok(())
    }

    /// Adds or updates every key of `wanted`, [`IN_FLIGHT`] at a time,
    /// counting what each did in `reconciled`; the first error, once the
    /// keys in flight are done (none is started after it).
    async fn add_listed(
        &self,
        path: &str,
        wanted: &HashMap<Digest, &Listed>,
        reconciled: &mut Reconciled,
    ) -> Result<(), ManageError> {
        let reason = format!("listed in {path}");
        let who = Who {
            operator: FILE_OPERATOR,
            reason: &reason,
        };
        let mut listed = wanted.iter();
        let mut running = futures_util::stream::FuturesUnordered::new();
        let mut failed = None;
        loop {
            while failed.is_none() && running.len() < IN_FLIGHT {
                let Some((digest, entry)) = listed.next() else {
                    break;
                };
                running.push(self.step(*digest, entry, who));
            }
            let Some((entry, step)) = running.next().await else {
                break;
            };
            match step {
                Err(e) => {
                    failed.get_or_insert(e);
                }
                Ok(Step::Added) => reconciled.changed[0] += 1,
                Ok(Step::Updated) => reconciled.changed[1] += 1,
                Ok(Step::Same) => {}
                Ok(Step::NotOwned(id)) => {
                    tracing::warn!(
                        key = %id,
                        at = %entry.at,
                        "the keys file lists a key the admin API made or imported; the file leaves it as it is (revoke it through the API to hand it to the file)"
                    );
                    reconciled.not_owned.push(id);
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }

    /// Removes the file's keys `wanted` no longer lists.
    async fn remove_unlisted(
        &self,
        path: &str,
        wanted: &HashMap<Digest, &Listed>,
        reconciled: &mut Reconciled,
    ) -> Result<(), ManageError> {
        let reason = format!("no longer listed in {path}");
        let who = Who {
            operator: FILE_OPERATOR,
            reason: &reason,
        };
        for (digest, record) in self.replica.find(|r| r.source == Source::File) {
            if !wanted.contains_key(&digest) && self.remove_one(digest, record, who).await? {
                reconciled.changed[2] += 1;
            }
        }
        Ok(())
    }

    /// [`Self::reconcile_one`], with the entry it was for.
    async fn step<'e>(
        &self,
        digest: Digest,
        entry: &'e Listed,
        who: Who<'_>,
    ) -> (&'e Listed, Result<Step, ManageError>) {
        (entry, self.reconcile_one(digest, entry, who).await)
    }

    /// Makes the record of `digest` what `entry` says, from the record as
    /// the store holds it.
    async fn reconcile_one(
        &self,
        digest: Digest,
        entry: &Listed,
        who: Who<'_>,
    ) -> Result<Step, ManageError> {
        let mut current = self.replica.get(&digest);
        for _ in 0..ATTEMPTS {
            let mut next = self.new_record(&digest, entry.spec.clone(), None, Source::File)?;
            let action = match &current {
                Some(c) if c.source != Source::File => return Ok(Step::NotOwned(c.id.clone())),
                Some(c) if as_listed(c, &next) => return Ok(Step::Same),
                Some(c) => {
                    next.created_ms = c.created_ms;
                    "update"
                }
                None => "import",
            };
            let next = Arc::new(next);
            let change = (Some(&next), current.as_ref());
            match self
                .write_as(digest, change, action, who, Commit::Later)
                .await?
            {
                Written::Done { .. } if current.is_some() => return Ok(Step::Updated),
                Written::Done { .. } => return Ok(Step::Added),
                Written::Refused { current: now } => {
                    current = now.map(|t| read_stored(&t).map(Arc::new)).transpose()?;
                }
            }
        }
        Err(ManageError::Busy)
    }

    /// Removes the file's record of `digest`, unless another change (an
    /// instance reading the file at the same time) removed it first.
    /// Whether this call removed it.
    async fn remove_one(
        &self,
        digest: Digest,
        mut record: Arc<Record>,
        who: Who<'_>,
    ) -> Result<bool, ManageError> {
        for _ in 0..ATTEMPTS {
            match self
                .write_as(digest, (None, Some(&record)), "revoke", who, Commit::Later)
                .await?
            {
                Written::Done { .. } => return Ok(true),
                Written::Refused { current: None } => return Ok(false),
                Written::Refused {
                    current: Some(text),
                } => {
                    let now = read_stored(&text)?;
                    if now.source != Source::File {
                        return Ok(false);
                    }
                    record = Arc::new(now);
                }
            }
        }
        Err(ManageError::Busy)
    }
}

/// Whether `record` already says what the file lists (`listed`, made
/// now): everything but when it was made and changed.
fn as_listed(record: &Record, listed: &Record) -> bool {
    record.identity == listed.identity
        && record.plan == listed.plan
        && record.attributes == listed.attributes
        && record.enabled == listed.enabled
        && record.expires_ms == listed.expires_ms
        && record.name == listed.name
        && record.hint == listed.hint
        && record.source == listed.source
}
