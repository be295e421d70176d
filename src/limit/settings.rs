//! Where limits are counted and what happens when that store fails: the
//! store settings the limiter is built from. The configuration fills them
//! in (and so depends on `limit`), never the other way round.

use std::fmt;
use std::time::Duration;

/// Default cap on (route, client) entries in each in-process table.
pub const DEFAULT_MAX_CLIENT_ENTRIES: usize = 100_000;

/// `[store]`: where limits are counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// In-process counting: exact for one instance.
    Memory,
    /// One Redis, or one Redis Cluster, shared by every instance.
    Redis(RedisSettings),
}

/// Where the Redis store is.
#[derive(Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// One Redis: `redis://` or `rediss://` URL (may hold a password).
    Single(String),
    /// A Redis Cluster, found through these seed nodes.
    Cluster(Vec<String>),
    /// The current primary of a Sentinel-monitored group.
    Sentinel {
        /// The Sentinels to ask.
        urls: Vec<String>,
        /// The monitored group's name (`sentinel monitor <name> …`).
        master: String,
    },
}

/// `[store]` with a Redis backend (`redis`, `redis_cluster`,
/// `redis_sentinel`): the settings the Redis store
/// (`limit::redis::RedisStore`) and the limiter over it are built from.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RedisSettings {
    /// Where Redis is (URLs may hold passwords: never logged).
    pub endpoint: Endpoint,
    /// Prefix of every key floodgate writes.
    pub key_prefix: String,
    /// One decision's deadline, pool wait included.
    pub timeout: Duration,
    /// What to do when Redis is unreachable or late.
    pub on_error: OnError,
    /// With `on_error = "local"`: how many instances share the limits, so
    /// each enforces `limit / local_instances` while Redis is down.
    pub local_instances: u64,
    /// Certificates for `rediss://` beyond the system's trusted roots.
    pub tls: Tls,
    /// The secret client ids are digested with in keys (`id_secret`,
    /// `id_secret_file`); `None`: a fixed key, public, the same for every
    /// instance.
    pub id_secret: Option<IdSecret>,
}

/// The secret that keys the digests client ids are stored under, so that
/// whoever reads the store cannot confirm a guessed id. Instances sharing
/// a store must share it. Never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct IdSecret(pub Box<[u8]>);

impl fmt::Debug for IdSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("IdSecret(..)")
    }
}

/// TLS material for `rediss://`, read from files at load.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Tls {
    /// PEM certificates to trust instead of the system's roots.
    pub ca: Option<Vec<u8>>,
    /// PEM client certificate and key, for Redis that requires mTLS.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print key material.
        f.debug_struct("Tls")
            .field("ca", &self.ca.is_some())
            .field("client_certificate", &self.client.is_some())
            .finish()
    }
}

impl Endpoint {
    /// True when the URLs are `rediss://`.
    pub fn uses_tls(&self) -> bool {
        match self {
            Self::Single(url) => url.starts_with("rediss://"),
            Self::Cluster(urls) | Self::Sentinel { urls, .. } => {
                urls.iter().any(|u| u.starts_with("rediss://"))
            }
        }
    }
}

/// A Redis URL without its password: only where it points.
fn shown(url: &str) -> String {
    match url.split_once("://").zip(url.rsplit_once('@')) {
        Some(((scheme, _), (_, host))) => format!("{scheme}://***@{host}"),
        None => url.to_owned(),
    }
}

impl fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(url) => write!(f, "{}", shown(url)),
            Self::Cluster(urls) => f
                .debug_list()
                .entries(urls.iter().map(|u| shown(u)))
                .finish(),
            Self::Sentinel { urls, master } => f
                .debug_struct("Sentinel")
                .field("master", master)
                .field(
                    "sentinels",
                    &urls.iter().map(|u| shown(u)).collect::<Vec<_>>(),
                )
                .finish(),
        }
    }
}

/// As logs show it: plain text, passwords hidden.
impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(url) => f.write_str(&shown(url)),
            Self::Cluster(urls) => {
                let all: Vec<String> = urls.iter().map(|u| shown(u)).collect();
                write!(f, "cluster {}", all.join(" "))
            }
            Self::Sentinel { urls, master } => {
                let all: Vec<String> = urls.iter().map(|u| shown(u)).collect();
                write!(f, "sentinel {master} via {}", all.join(" "))
            }
        }
    }
}

/// Policy when the store cannot decide in time; shown as configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnError {
    /// Forward the request (fail open).
    Allow,
    /// Answer 503 with `Retry-After` (fail closed).
    Deny,
    /// Count in process with the same rules until the store is back.
    Local,
}

impl OnError {
    /// Every policy with its name in configuration files.
    pub const NAMES: [(&'static str, OnError); 3] = [
        ("allow", OnError::Allow),
        ("deny", OnError::Deny),
        ("local", OnError::Local),
    ];

    /// The name in configuration files.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize].0
    }
}

impl fmt::Display for OnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_error_names_follow_the_declaration_order() {
        for (i, (name, policy)) in OnError::NAMES.into_iter().enumerate() {
            assert_eq!((policy as usize, policy.name()), (i, name));
            assert_eq!(policy.to_string(), name);
        }
    }
}
