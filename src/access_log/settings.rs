//! `[access_log]` and `client_id`, as the configuration describes them:
//! plain data that `config` fills in.

use std::path::PathBuf;

/// How lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line.
    Json,
    /// `key=value` text after a combined-log-like head.
    Text,
}

/// Every `format` of `[access_log]` by name: `off` is no log at all.
pub const FORMATS: [(&str, Option<Format>); 3] = [
    ("json", Some(Format::Json)),
    ("text", Some(Format::Text)),
    ("off", None),
];

/// How a client's id appears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShowId {
    /// As sent (an API key in clear).
    Raw,
    /// A keyed digest: 16 hex digits of SHA-256 over a key and the id.
    Hash,
    /// Not at all.
    Hidden,
}

impl ShowId {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, ShowId); 3] = [
        ("hash", ShowId::Hash),
        ("raw", ShowId::Raw),
        ("none", ShowId::Hidden),
    ];
}

/// `[access_log]`, when it is on.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// How lines are written.
    pub format: Format,
    /// The file; standard error when `None`.
    pub path: Option<PathBuf>,
    /// The share of allowed requests logged, 0 to 1.
    pub sample_allowed: f64,
    /// Most denial lines a second for one client.
    pub denied_per_client: u64,
}
