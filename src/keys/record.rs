//! What the registry knows of one key: whose it is, its plan and
//! attributes, whether it is enabled and until when it is valid.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where a record came from: a key made or imported through the admin
/// API, or one the keys file lists (the file's reconcile owns those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The admin API.
    #[default]
    Api,
    /// The keys file.
    File,
}

/// One key's record, as the store keeps it (JSON) under the key's digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The key's public id (`key_` and 16 hex digits of its digest): how
    /// operators name it.
    pub id: String,
    /// The customer it belongs to; several keys may share one.
    pub identity: String,
    /// The plan its requests are on (a `[plans.NAME]`); `None`: the
    /// default plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// Anything a limit may key on (`org`, `billing_day`, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub attributes: BTreeMap<String, String>,
    /// A disabled key is refused (403) until enabled again.
    pub enabled: bool,
    /// When it stops being valid (ms since the epoch); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    /// A label for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The start of a key floodgate made (its prefix and 4 characters),
    /// to tell keys apart; never more of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Where it came from.
    #[serde(default)]
    pub source: Source,
    /// When it was made (ms since the epoch).
    pub created_ms: u64,
    /// When it last changed (ms since the epoch).
    pub updated_ms: u64,
}

impl Record {
    /// Whether it is expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_ms.is_some_and(|end| end <= now_ms)
    }
}
