//! Following the store: every `sync_every` each instance asks for the
//! changes after the last one it applied (one call, nothing to read when
//! nothing changed) and applies them in order; when the log cannot tell
//! (it was trimmed past this instance, or the registry started over) it
//! reads every record again. An instance whose store is down keeps the
//! records it has and says so in `/status.json` and the metrics. The same
//! task tries a keys file's reconcile that did not finish again.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::registry::from_hex;
use super::{Backing, Keys, Record};
use crate::limit::registry::{Change, Snapshot};

/// How often a keys file's reconcile that did not finish is tried again.
const RECONCILE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl Keys {
    /// Replaces the replica with `snapshot`'s records.
    pub(super) fn apply_snapshot(&self, snapshot: Snapshot) {
        let mut records = HashMap::with_capacity(snapshot.records.len());
        for (digest, record) in snapshot.records {
            match (from_hex(&digest), serde_json::from_str::<Record>(&record)) {
                (Some(digest), Ok(record)) => {
                    records.insert(digest, Arc::new(record));
                }
                (_, Err(e)) => unreadable(&digest, &e.to_string()),
                (None, _) => unreadable(&digest, "not a digest"),
            }
        }
        self.replica.replace(records, snapshot.seq);
        self.synced();
    }

    /// Applies `changes`, oldest first.
    fn apply(&self, changes: Vec<Change>) {
        for change in changes {
            let Some(digest) = from_hex(&change.digest) else {
                unreadable(&change.digest, "not a digest");
                self.replica.seq.store(change.seq, Ordering::Release);
                continue;
            };
            let record = match change.record.as_deref().map(serde_json::from_str::<Record>) {
                Some(Ok(record)) => Some(Arc::new(record)),
                Some(Err(e)) => {
                    unreadable(&change.digest, &e.to_string());
                    None
                }
                None => None,
            };
            self.replica.apply(digest, record, change.seq);
        }
    }

    fn synced(&self) {
        self.synced_ms
            .store(crate::clock::now_ms(), Ordering::Relaxed);
        if self.sync_failing.swap(false, Ordering::Relaxed) {
            tracing::info!("the key registry follows the store again");
        }
    }

    /// Asks the store once for what changed, and applies it.
    pub async fn follow_once(&self) {
        let Backing::Store(limiter) = &self.backing else {
            return;
        };
        let seq = self.replica.seq.load(Ordering::Acquire);
        let changes = if self.synced_ms.load(Ordering::Relaxed) == 0 {
            // Never read: the records whole.
            Ok(None)
        } else {
            limiter.registry_changes(seq).await
        };
        let result = match changes {
            Ok(Some(changes)) => {
                self.apply(changes);
                Ok(())
            }
            Ok(None) => limiter
                .registry_snapshot()
                .await
                .map(|snapshot| self.apply_snapshot(snapshot)),
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => self.synced(),
            Err(e) => {
                if !self.sync_failing.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        error = %e,
                        "the key registry cannot follow the store; verifying keys by the records this instance has"
                    );
                }
            }
        }
    }

    /// Follows the store every `sync_every`, and tries a keys file's
    /// reconcile that did not finish again every second, as long as it
    /// runs.
    pub async fn follow(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.settings.sync_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut retry = tokio::time::interval(RECONCILE_RETRY);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let follows = matches!(self.backing, Backing::Store(_));
        loop {
            tokio::select! {
                _ = every.tick(), if follows => self.follow_once().await,
                _ = retry.tick() => self.reconcile_pending().await,
            }
        }
    }
}

fn unreadable(digest: &str, why: &str) {
    tracing::warn!(
        digest = %digest.get(..16).unwrap_or(digest),
        why,
        "a key registry record cannot be read; that key is refused as unknown"
    );
}
