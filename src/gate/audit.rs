//! The audit trail operators' actions and registry changes are recorded
//! in, kept in the store: the key registry's (the shared store's, or the
//! memory store's state file), or, with no registry, the shared store's
//! own; the memory store without a registry keeps none (the log line
//! stays).

use super::shared::Shared;
pub use crate::limit::registry::AuditEntry;

/// Why the audit could not be written or read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct AuditError(String);

impl Shared {
    /// Records an operator's action in the store's audit.
    pub async fn audit(&self, entry: AuditEntry) -> Result<(), AuditError> {
        match &self.keys {
            Some(keys) => keys
                .audit_action(entry)
                .await
                .map_err(|e| AuditError(e.to_string())),
            None if self.limiter.is_shared() => self
                .limiter
                .audit_append(&entry)
                .await
                .map_err(|e| AuditError(e.to_string())),
            None => Ok(()),
        }
    }

    /// The newest audit entries, at most `count`, of `identity` when given;
    /// `None` when no audit is kept.
    pub async fn audit_entries(
        &self,
        identity: Option<&str>,
        count: usize,
    ) -> Result<Option<Vec<AuditEntry>>, AuditError> {
        match &self.keys {
            Some(keys) => keys
                .audit(identity, count)
                .await
                .map(Some)
                .map_err(|e| AuditError(e.to_string())),
            None if self.limiter.is_shared() => {
                let keep = |e: &AuditEntry| identity.is_none_or(|i| e.identity == i);
                self.limiter
                    .audit_read(count, &keep)
                    .await
                    .map(Some)
                    .map_err(|e| AuditError(e.to_string()))
            }
            None => Ok(None),
        }
    }

    /// The identity of a key the registry knows among `headers` (as an
    /// operator names a client: `Authorization: Bearer …` or a header
    /// holding the key).
    pub fn key_identity(
        &self,
        headers: &std::collections::BTreeMap<String, String>,
    ) -> Option<String> {
        let keys = self.keys.as_ref()?;
        headers.iter().find_map(|(name, value)| {
            let value = value.trim();
            let key = if name.eq_ignore_ascii_case("authorization") {
                let (scheme, rest) = value.split_at_checked(7)?;
                scheme
                    .eq_ignore_ascii_case("bearer ")
                    .then_some(rest.trim())?
            } else {
                value
            };
            keys.lookup(key.as_bytes()).map(|r| r.identity.clone())
        })
    }

    /// The plans' names, for a key's plan to be one of them.
    pub fn plan_names(&self) -> Vec<std::sync::Arc<str>> {
        self.rules()
            .routes
            .plan_selection
            .as_ref()
            .map(|s| s.names.clone())
            .unwrap_or_default()
    }
}
