//! The key registry as configured (`[keys]`): plain data that `config`
//! fills in and the registry reads.

use std::path::PathBuf;
use std::time::Duration;

/// `[keys]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// What every key floodgate generates starts with (`sk-`).
    pub prefix: String,
    /// With the memory store: the file the instance's registry is kept
    /// in, written whole and atomically on every change.
    pub state_file: Option<PathBuf>,
    /// A declarative file of keys (by SHA-256) reconciled into the
    /// registry when it changes.
    pub file: Option<PathBuf>,
    /// How often each instance asks the store for changes.
    pub sync_every: Duration,
    /// Unknown keys an address may send a minute before its keys are
    /// refused without a lookup (0: no limit).
    pub failures_per_minute: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            prefix: "sk-".to_owned(),
            state_file: None,
            file: None,
            sync_every: Duration::from_millis(200),
            failures_per_minute: 20,
        }
    }
}

/// How a route reads the key a client sends (`api_key`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyFrom {
    /// `Authorization: Bearer <key>`, the scheme in any case.
    Bearer,
    /// A header's (or gRPC metadata's) whole value.
    Header(http::HeaderName),
}

impl KeyFrom {
    /// As operators read it: `bearer`, `header x-api-key`.
    pub fn describe(&self) -> String {
        match self {
            Self::Bearer => "bearer".to_owned(),
            Self::Header(name) => format!("header {name}"),
        }
    }
}
