//! The memory store's registry, kept in the instance's own file: every
//! record by its digest, the number of the last change and the newest
//! audit entries, as one JSON document written to a temporary file beside
//! it, flushed, and renamed over it, so a crash leaves the old file or
//! the new one, never half of one.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::StartError;
use super::record::Record;
use super::registry::{Replica, from_hex, hex};
use crate::limit::registry::AuditEntry;

/// Audit entries the file keeps.
const AUDIT_KEPT: usize = 10_000;

/// The file's document.
#[derive(Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Document {
    seq: u64,
    records: BTreeMap<String, Record>,
    #[serde(default)]
    audit: Vec<AuditEntry>,
}

/// The state file and the audit entries it keeps (the records are the
/// replica's).
#[derive(Debug)]
pub struct StateFile {
    path: PathBuf,
    /// Newest last.
    audit: tokio::sync::Mutex<Vec<AuditEntry>>,
}

impl StateFile {
    /// Opens the file at `path` (none yet: an empty registry) and loads
    /// its records into `replica`.
    pub(super) fn open(path: PathBuf, replica: &Replica) -> Result<Self, StartError> {
        let failed = |e: String| StartError::File(path.clone(), e);
        let document = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice::<Document>(&bytes)
                .map_err(|e| failed(format!("cannot be read: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Document::default(),
            Err(e) => return Err(failed(e.to_string())),
        };
        let mut records = HashMap::with_capacity(document.records.len());
        for (digest, record) in document.records {
            let digest = from_hex(&digest)
                .ok_or_else(|| failed(format!("holds a digest that is not one: {digest:?}")))?;
            records.insert(digest, Arc::new(record));
        }
        replica.replace(records, document.seq);
        let file = Self {
            path: path.clone(),
            audit: tokio::sync::Mutex::new(Vec::new()),
        };
        // Written once at start, so that a path floodgate cannot write is
        // a refusal to start, not a change lost later.
        file.write(replica, &document.audit).map_err(failed)?;
        Ok(Self {
            audit: tokio::sync::Mutex::new(document.audit),
            ..file
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Adds `entry` to the audit and writes the file, with `replica`'s
    /// records as they are now.
    pub(super) async fn commit(
        &self,
        replica: &Replica,
        entry: Option<AuditEntry>,
    ) -> Result<(), String> {
        let mut audit = self.audit.lock().await;
        if let Some(entry) = entry {
            push(&mut audit, entry);
        }
        self.write(replica, &audit)
    }

    /// Adds `entry` to the audit, for the next [`Self::commit`] to write.
    pub(super) async fn note(&self, entry: AuditEntry) {
        push(&mut *self.audit.lock().await, entry);
    }

    /// The audit entries `keep` accepts, newest first, at most `count`.
    pub(super) async fn audit(
        &self,
        count: usize,
        keep: &(dyn Fn(&AuditEntry) -> bool + Sync),
    ) -> Vec<AuditEntry> {
        let audit = self.audit.lock().await;
        audit
            .iter()
            .rev()
            .filter(|e| keep(e))
            .take(count)
            .cloned()
            .collect()
    }

    fn write(&self, replica: &Replica, audit: &[AuditEntry]) -> Result<(), String> {
        #[derive(Serialize)]
        struct Written<'a> {
            seq: u64,
            records: BTreeMap<String, &'a Record>,
            audit: &'a [AuditEntry],
        }
        let all = replica.all();
        let document = Written {
            seq: replica.seq.load(std::sync::atomic::Ordering::Acquire),
            records: all.iter().map(|(d, r)| (hex(d), &**r)).collect(),
            audit,
        };
        let bytes = serde_json::to_vec(&document).map_err(|e| e.to_string())?;
        let mut temporary = self.path.clone().into_os_string();
        temporary.push(".writing");
        let temporary = PathBuf::from(temporary);
        let written = std::fs::File::create(&temporary).and_then(|mut file| {
            file.write_all(&bytes)?;
            file.sync_all()
        });
        written
            .and_then(|()| std::fs::rename(&temporary, &self.path))
            .map_err(|e| format!("cannot be written: {e}"))
    }
}

/// Adds `entry` to `audit`, the oldest entries past the kept number gone.
fn push(audit: &mut Vec<AuditEntry>, entry: AuditEntry) {
    audit.push(entry);
    let over = audit.len().saturating_sub(AUDIT_KEPT);
    audit.drain(..over);
}
