//! The operator's TOML file: its serde model, validation, and compilation into
//! the runtime rule table.
//!
//! The format is the contract in `CONFIG.md`. Every problem found while loading
//! is reported with the file, line and column it comes from, and all of them
//! are reported at once, so an operator fixes a file in one pass.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use ipnet::IpNet;
use serde::Deserialize;
use toml::Spanned;

use crate::client::{DEFAULT_MAX_CLIENT_ID, TooLong};
use crate::limit::{Algorithm, Limit};
use crate::routes::{Action, EscapedSlashes, Match, Respond, Route, Table};

mod access_log;
mod answers;
mod clients;
mod document;
mod matching;
mod overrides;
mod upstreams;

use upstreams::{Defaults, UpstreamModel};

/// Default deadline for an upstream's response head.
const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time in-flight requests get to finish after SIGTERM.
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Default time `/readyz` says 503 before the listener closes at a stop.
const DEFAULT_DRAIN_DELAY: Duration = Duration::from_secs(5);
/// Default deadline for one store decision, pool wait included.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(50);
/// Default cap on (route, client) entries in each in-process table.
pub const DEFAULT_MAX_CLIENT_ENTRIES: usize = 100_000;
/// Default timeout for a client to send a request head.
const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default idle timeout of a client's request body.
const DEFAULT_CLIENT_BODY_TIMEOUT: Duration = Duration::from_secs(60);
/// Default time a client may leave floodgate's answer unread.
const DEFAULT_CLIENT_WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Default idle timeout of an upgraded (WebSocket) connection.
const DEFAULT_UPGRADE_IDLE_TIMEOUT: Duration = Duration::from_secs(300);

// === the loaded configuration ===

/// A validated configuration, ready to serve.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where the file came from (for reload and messages).
    pub path: PathBuf,
    /// Listener and server-wide settings.
    pub server: Server,
    /// Where limits are counted.
    pub store: Store,
    /// The compiled routes, first match wins.
    pub routes: Table,
    /// First 16 hex digits of the file's SHA-256: which file is in force.
    pub digest: String,
    /// The access log, if on.
    pub access_log: Option<crate::access_log::Settings>,
    /// How client ids appear in the access log and on `/clients/top`.
    pub client_ids: crate::access_log::ShowId,
}

impl Config {
    /// The settings that differ between `self` and `new` and cannot change
    /// while floodgate runs.
    pub fn differences_needing_restart(&self, new: &Config) -> Vec<&'static str> {
        let (a, b) = (&self.server, &new.server);
        let mut out = Vec::new();
        if a.listen != b.listen {
            out.push("listen");
        }
        if a.admin_listen != b.admin_listen {
            out.push("admin_listen");
        }
        if a.shutdown_grace != b.shutdown_grace {
            out.push("shutdown_grace");
        }
        if a.drain_delay != b.drain_delay {
            out.push("drain_delay");
        }
        if a.header_read_timeout != b.header_read_timeout {
            out.push("header_read_timeout");
        }
        if a.max_client_entries != b.max_client_entries {
            out.push("max_client_entries");
        }
        if a.max_connections != b.max_connections {
            out.push("max_connections");
        }
        if self.store != new.store {
            out.push("store");
        }
        if self.access_log != new.access_log || self.client_ids != new.client_ids {
            out.push("access_log");
        }
        out
    }
}

/// `[server]`: listeners and server-wide settings.
#[derive(Debug, Clone)]
pub struct Server {
    /// The proxy's listener.
    pub listen: SocketAddr,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`), if any.
    pub admin_listen: Option<SocketAddr>,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// Clients that bypass every route's limits.
    pub exempt: Vec<IpNet>,
    /// Default deadline for an upstream's response head (504 past it).
    pub upstream_timeout: Duration,
    /// Deadline for a new upstream connection, TLS handshake included.
    pub upstream_connect_timeout: Duration,
    /// An upstream response body that sends nothing for this long is cut.
    pub upstream_body_timeout: Duration,
    /// A client request body that sends nothing for this long is a 408.
    pub client_body_timeout: Duration,
    /// A client that reads nothing of its answer for this long is cut off.
    pub client_write_timeout: Duration,
    /// An upgraded connection silent both ways for this long is closed.
    pub upgrade_idle_timeout: Duration,
    /// Largest request body forwarded, in bytes, unless a route says
    /// otherwise (413 past it); `None`: no limit.
    pub max_request_body: Option<u64>,
    /// How long in-flight requests may take to finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long `/readyz` answers 503 while new connections
    /// are still accepted, so load balancers stop sending before the
    /// listener closes.
    pub drain_delay: Duration,
    /// How long a client may take to send its first request head (408 past
    /// it), and how long a keep-alive connection may go without a request.
    pub header_read_timeout: Duration,
    /// Reload when the file's contents change (SIGHUP always reloads).
    pub reload_on_change: bool,
    /// The longest header value used as a client id as it is, in bytes.
    pub max_client_id: usize,
    /// What happens to a longer one.
    pub on_long_client_id: TooLong,
    /// What `%2F`, `%5C` and `\` in a request path do.
    pub escaped_slashes: EscapedSlashes,
    /// Most (route, client) entries each in-process table holds: the
    /// memory store, the local fallback, the remembered denials.
    pub max_client_entries: usize,
    /// Most client connections open at once; past it new ones wait in the
    /// listen backlog. `None`: three quarters of the open file limit.
    pub max_connections: Option<usize>,
    /// TLS on the proxy listener: where the files are, and the rustls
    /// configuration read from them at load.
    pub tls: Option<(crate::tls::ListenerTls, Arc<rustls::ServerConfig>)>,
    /// Which rate-limit fields responses carry, unless a route says otherwise.
    pub rate_limit_headers: crate::response::HeaderMode,
    /// Requests carrying one of these header values bypass every route's
    /// limits.
    pub exempt_keys: Vec<crate::routes::KeyExemption>,
}

/// `[store]`: where limits are counted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Store {
    /// In-process counting: exact for one instance.
    Memory,
    /// One Redis, or one Redis Cluster, shared by every instance.
    Redis(RedisStore),
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

/// Settings of a Redis-backed store.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct RedisStore {
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

impl fmt::Display for OnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
            Self::Local => "local",
        })
    }
}

// === errors ===

/// One problem in a configuration file, located by line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file it was found in.
    pub path: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub column: usize,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.path.display(),
            self.line,
            self.column,
            self.message
        )
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read at all.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is not a valid configuration.
    #[error("{}", list(.0))]
    Invalid(Vec<Problem>),
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

// === the file's serde model ===

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileModel {
    server: Spanned<ServerModel>,
    store: Option<Spanned<StoreModel>>,
    #[serde(default)]
    upstreams: BTreeMap<String, Spanned<UpstreamModel>>,
    #[serde(default)]
    routes: Vec<Spanned<RouteModel>>,
    access_log: Option<Spanned<access_log::AccessLogModel>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ServerModel {
    listen: Spanned<String>,
    admin_listen: Option<Spanned<String>>,
    #[serde(default)]
    trusted_proxies: Vec<Spanned<String>>,
    #[serde(default)]
    exempt: Vec<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    upstream_connect_timeout: Option<Spanned<String>>,
    upstream_body_timeout: Option<Spanned<String>>,
    client_body_timeout: Option<Spanned<String>>,
    client_write_timeout: Option<Spanned<String>>,
    upgrade_idle_timeout: Option<Spanned<String>>,
    max_request_body: Option<Spanned<String>>,
    shutdown_grace: Option<Spanned<String>>,
    drain_delay: Option<Spanned<String>>,
    header_read_timeout: Option<Spanned<String>>,
    #[serde(default = "yes")]
    reload_on_change: bool,
    max_client_id: Option<Spanned<i64>>,
    on_long_client_id: Option<Spanned<String>>,
    escaped_slashes: Option<Spanned<String>>,
    max_client_entries: Option<Spanned<i64>>,
    max_connections: Option<Spanned<i64>>,
    tls: Option<Spanned<ListenerTlsModel>>,
    rate_limit_headers: Option<Spanned<String>>,
    #[serde(default)]
    exempt_keys: overrides::ExemptKeysModel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListenerTlsModel {
    cert_file: Spanned<String>,
    key_file: Spanned<String>,
    client_ca_file: Option<Spanned<String>>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StoreModel {
    backend: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    urls: Option<Spanned<Vec<String>>>,
    key_prefix: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    on_error: Option<Spanned<String>>,
    local_instances: Option<Spanned<i64>>,
    tls_ca_file: Option<Spanned<String>>,
    tls_cert_file: Option<Spanned<String>>,
    tls_key_file: Option<Spanned<String>>,
    master_name: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteModel {
    name: Spanned<String>,
    #[serde(rename = "match", default)]
    matcher: Option<Spanned<MatchModel>>,
    upstream: Option<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    respond: Option<Spanned<RespondModel>>,
    client: Option<Spanned<clients::ClientModel>>,
    cost: Option<Spanned<i64>>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    exempt: Vec<Spanned<String>>,
    limits: Option<Spanned<Vec<Spanned<LimitModel>>>>,
    max_request_body: Option<Spanned<String>>,
    deny: Option<Spanned<answers::DenyModel>>,
    rate_limit_headers: Option<Spanned<String>>,
    #[serde(default)]
    overrides: Vec<Spanned<overrides::OverrideModel>>,
    #[serde(default)]
    exempt_keys: overrides::ExemptKeysModel,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct MatchModel {
    path_prefix: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    host: Option<Spanned<String>>,
    #[serde(default)]
    ignore_case: bool,
    #[serde(default)]
    headers: BTreeMap<Spanned<String>, Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RespondModel {
    status: Spanned<i64>,
    #[serde(default)]
    body: String,
    content_type: Option<Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LimitModel {
    algorithm: Spanned<String>,
    limit: Spanned<i64>,
    window: Spanned<String>,
    burst: Option<Spanned<i64>>,
}

// === loading ===

/// Reads, parses and validates the file at `path`.
pub fn load(path: &Path) -> Result<Config, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse(path, &text)
}

/// Parses and validates `text`, naming `path` in messages.
pub fn parse(path: &Path, text: &str) -> Result<Config, LoadError> {
    let mut v = Validator {
        path,
        text,
        problems: Vec::new(),
        upstream_urls: HashMap::new(),
        removed: document::Removed::default(),
    };
    let Some((model, removed)) = v.model() else {
        return Err(LoadError::Invalid(v.sorted_problems()));
    };
    v.removed = removed;
    let server = v.server(&model.server);
    let store = v.store(model.store.as_ref());
    let defaults = Defaults::of(server.as_ref());
    let upstreams = v.upstreams(&model.upstreams, defaults);
    let routes = v.routes(&model.routes, server.as_ref(), &upstreams);
    let access_log = match &model.access_log {
        Some(m) => v.access_log(m.get_ref()),
        None => Some((None, crate::access_log::ShowId::Hash)),
    };
    match (server, store, access_log, v.problems.is_empty()) {
        (Some(server), Some(store), Some((access_log, client_ids)), true) => Ok(Config {
            path: path.to_owned(),
            server,
            store,
            routes: Table::new(routes),
            digest: digest(text),
            access_log,
            client_ids,
        }),
        _ => Err(LoadError::Invalid(v.sorted_problems())),
    }
}

struct Validator<'a> {
    path: &'a Path,
    text: &'a str,
    problems: Vec<Problem>,
    /// The upstreams routes gave as URLs, one group per URL.
    upstream_urls: HashMap<String, Arc<crate::proxy::balance::Group>>,
    /// Entries taken out of the file because serde refused them (already
    /// reported).
    removed: document::Removed,
}

impl Validator<'_> {
    fn problem(&mut self, span: Range<usize>, message: impl Into<String>) {
        // A table that lacks what was taken out of it is not a second fault.
        if self.removed.explains(&span) {
            return;
        }
        let (line, column) = line_column(self.text, span.start);
        self.problems.push(Problem {
            path: self.path.to_owned(),
            line,
            column,
            message: message.into(),
        });
    }

    /// The problems found, in the order of the file.
    fn sorted_problems(&mut self) -> Vec<Problem> {
        let mut problems = std::mem::take(&mut self.problems);
        problems.sort_by_key(|p| (p.line, p.column));
        problems
    }

    /// A whole number in `range`, or `default` when `value` is absent.
    fn bounded(
        &mut self,
        value: Option<&Spanned<i64>>,
        default: usize,
        range: std::ops::RangeInclusive<usize>,
        message: &str,
    ) -> Option<usize> {
        let Some(value) = value else {
            return Some(default);
        };
        match usize::try_from(*value.get_ref()) {
            Ok(n) if range.contains(&n) => Some(n),
            _ => {
                self.problem(value.span(), message);
                None
            }
        }
    }

    /// One of `choices` by name (the first when `value` is absent).
    fn choice<T: Copy>(
        &mut self,
        value: Option<&Spanned<String>>,
        key: &str,
        choices: &[(&str, T)],
    ) -> Option<T> {
        let Some(value) = value else {
            return choices.first().map(|&(_, c)| c);
        };
        let found = choices
            .iter()
            .find(|(name, _)| *name == value.get_ref().as_str());
        if found.is_none() {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
            self.problem(
                value.span(),
                format!(
                    "{key} {:?} is not one of {}",
                    value.get_ref(),
                    names.join(", ")
                ),
            );
        }
        found.map(|&(_, c)| c)
    }

    fn duration(&mut self, value: &Spanned<String>, what: &str) -> Option<Duration> {
        match parse_duration(value.get_ref()) {
            Ok(d) if d.is_zero() => {
                self.problem(value.span(), format!("{what} must be greater than zero"));
                None
            }
            Ok(d) => Some(d),
            Err(message) => {
                self.problem(value.span(), format!("{what}: {message}"));
                None
            }
        }
    }

    /// A size in bytes: `"512KiB"`, `"10MB"`, `"1GiB"`.
    fn size(&mut self, value: &Spanned<String>, what: &str) -> Option<u64> {
        match parse_size(value.get_ref()) {
            Ok(n) => Some(n),
            Err(message) => {
                self.problem(value.span(), format!("{what}: {message}"));
                None
            }
        }
    }

    fn optional_duration(
        &mut self,
        value: Option<&Spanned<String>>,
        what: &str,
        default: Duration,
    ) -> Option<Duration> {
        match value {
            Some(value) => self.duration(value, what),
            None => Some(default),
        }
    }

    fn socket_addr(&mut self, value: &Spanned<String>, what: &str) -> Option<SocketAddr> {
        match value.get_ref().parse() {
            Ok(addr) => Some(addr),
            Err(_) => {
                self.problem(
                    value.span(),
                    format!(
                        "{what} {:?} is not an address and port such as \"0.0.0.0:8080\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    fn networks(&mut self, list: &[Spanned<String>], key: &str) -> Vec<IpNet> {
        let mut nets = Vec::new();
        for cidr in list {
            match parse_cidr(cidr.get_ref()) {
                Some(net) => nets.push(net),
                None => self.problem(
                    cidr.span(),
                    format!(
                        "{key} entry {:?} is not an address or CIDR such as \"10.0.0.0/8\"",
                        cidr.get_ref()
                    ),
                ),
            }
        }
        nets
    }

    fn server(&mut self, model: &Spanned<ServerModel>) -> Option<Server> {
        let m = model.get_ref();
        let listen = self.socket_addr(&m.listen, "listen");
        let admin_listen = match &m.admin_listen {
            Some(a) => Some(self.socket_addr(a, "admin_listen")?),
            None => None,
        };
        let trusted_proxies = self.networks(&m.trusted_proxies, "trusted_proxies");
        let exempt = self.networks(&m.exempt, "exempt");
        let upstream_timeout = self.optional_duration(
            m.upstream_timeout.as_ref(),
            "upstream_timeout",
            DEFAULT_UPSTREAM_TIMEOUT,
        );
        let mut timeout = |value: &Option<Spanned<String>>, key: &str, default: Duration| {
            self.optional_duration(value.as_ref(), key, default)
        };
        let upstream_connect_timeout = timeout(
            &m.upstream_connect_timeout,
            "upstream_connect_timeout",
            upstreams::DEFAULT_CONNECT_TIMEOUT,
        );
        let upstream_body_timeout = timeout(
            &m.upstream_body_timeout,
            "upstream_body_timeout",
            upstreams::DEFAULT_BODY_TIMEOUT,
        );
        let client_body_timeout = timeout(
            &m.client_body_timeout,
            "client_body_timeout",
            DEFAULT_CLIENT_BODY_TIMEOUT,
        );
        let client_write_timeout = timeout(
            &m.client_write_timeout,
            "client_write_timeout",
            DEFAULT_CLIENT_WRITE_TIMEOUT,
        );
        let upgrade_idle_timeout = timeout(
            &m.upgrade_idle_timeout,
            "upgrade_idle_timeout",
            DEFAULT_UPGRADE_IDLE_TIMEOUT,
        );
        let max_request_body = match &m.max_request_body {
            None => Some(None),
            Some(size) => self.size(size, "max_request_body").map(Some),
        };
        let shutdown_grace = self.optional_duration(
            m.shutdown_grace.as_ref(),
            "shutdown_grace",
            DEFAULT_SHUTDOWN_GRACE,
        );
        // Zero is allowed: close the listener at once.
        let drain_delay = match &m.drain_delay {
            None => Some(DEFAULT_DRAIN_DELAY),
            Some(d) if matches!(d.get_ref().as_str(), "0" | "0s" | "0ms") => Some(Duration::ZERO),
            Some(d) => self.duration(d, "drain_delay"),
        };
        let header_read_timeout = self.optional_duration(
            m.header_read_timeout.as_ref(),
            "header_read_timeout",
            DEFAULT_HEADER_READ_TIMEOUT,
        );
        let max_client_id = self.bounded(
            m.max_client_id.as_ref(),
            DEFAULT_MAX_CLIENT_ID,
            16..=8192,
            "max_client_id must be a number of bytes from 16 to 8192",
        );
        let on_long_client_id = self.choice(
            m.on_long_client_id.as_ref(),
            "on_long_client_id",
            &[("reject", TooLong::Reject), ("hash", TooLong::Hash)],
        );
        let escaped_slashes = self.choice(
            m.escaped_slashes.as_ref(),
            "escaped_slashes",
            &[
                ("reject", EscapedSlashes::Reject),
                ("decode", EscapedSlashes::Decode),
                ("keep", EscapedSlashes::Keep),
            ],
        );
        let max_client_entries = self.bounded(
            m.max_client_entries.as_ref(),
            DEFAULT_MAX_CLIENT_ENTRIES,
            1_000..=100_000_000,
            "max_client_entries must be a whole number from 1000 to 100000000",
        );
        let max_connections = match &m.max_connections {
            None => Some(None),
            some => self
                .bounded(
                    some.as_ref(),
                    0,
                    1..=10_000_000,
                    "max_connections must be a whole number from 1 to 10000000",
                )
                .map(Some),
        };
        let tls = match &m.tls {
            None => Some(None),
            Some(tls) => self.listener_tls(tls).map(Some),
        };
        let rate_limit_headers = self.header_mode(
            m.rate_limit_headers.as_ref(),
            crate::response::HeaderMode::default(),
        );
        Some(Server {
            listen: listen?,
            admin_listen,
            trusted_proxies,
            exempt,
            upstream_timeout: upstream_timeout?,
            upstream_connect_timeout: upstream_connect_timeout?,
            upstream_body_timeout: upstream_body_timeout?,
            client_body_timeout: client_body_timeout?,
            client_write_timeout: client_write_timeout?,
            upgrade_idle_timeout: upgrade_idle_timeout?,
            max_request_body: max_request_body?,
            shutdown_grace: shutdown_grace?,
            drain_delay: drain_delay?,
            header_read_timeout: header_read_timeout?,
            reload_on_change: m.reload_on_change,
            max_client_id: max_client_id?,
            on_long_client_id: on_long_client_id?,
            escaped_slashes: escaped_slashes?,
            max_client_entries: max_client_entries?,
            max_connections: max_connections?,
            tls: tls?,
            rate_limit_headers: rate_limit_headers?,
            exempt_keys: self.exempt_keys(&m.exempt_keys),
        })
    }

    fn store(&mut self, model: Option<&Spanned<StoreModel>>) -> Option<Store> {
        let Some(model) = model else {
            return Some(Store::Memory);
        };
        let m = model.get_ref();
        let backend = m
            .backend
            .as_ref()
            .map_or("memory", |b| b.get_ref().as_str());
        let backend_span = m
            .backend
            .as_ref()
            .map_or_else(|| model.span(), Spanned::span);
        let key_prefix = match &m.key_prefix {
            Some(p) if !valid_name(p.get_ref()) => {
                self.problem(
                    p.span(),
                    "key_prefix may use only letters, digits, '_', '-' and '.' (1 to 64 of them)",
                );
                None
            }
            Some(p) => Some(p.get_ref().clone()),
            None => Some("floodgate".to_owned()),
        };
        let timeout = self.optional_duration(m.timeout.as_ref(), "timeout", DEFAULT_STORE_TIMEOUT);
        let on_error = match &m.on_error {
            None => Some(OnError::Allow),
            Some(s) => match s.get_ref().as_str() {
                "allow" => Some(OnError::Allow),
                "deny" => Some(OnError::Deny),
                "local" => Some(OnError::Local),
                other => {
                    self.problem(
                        s.span(),
                        format!("on_error {other:?} is not one of \"allow\", \"deny\", \"local\""),
                    );
                    None
                }
            },
        };
        let local_instances = match &m.local_instances {
            None => Some(1),
            Some(n) if (1..=10_000).contains(n.get_ref()) => {
                if on_error != Some(OnError::Local) {
                    self.problem(
                        n.span(),
                        "local_instances is only used with on_error = \"local\"",
                    );
                }
                Some(*n.get_ref() as u64)
            }
            Some(n) => {
                self.problem(
                    n.span(),
                    "local_instances must be a whole number from 1 to 10000",
                );
                None
            }
        };
        match backend {
            "memory" => {
                for (key, present) in [
                    ("url", m.url.as_ref().map(Spanned::span)),
                    ("urls", m.urls.as_ref().map(Spanned::span)),
                ] {
                    if let Some(span) = present {
                        self.problem(
                            span,
                            format!("{key} has no meaning for backend \"memory\"; remove it or set backend = \"redis\""),
                        );
                    }
                }
                Some(Store::Memory)
            }
            "redis" | "redis_cluster" | "redis_sentinel" => {
                let single = backend == "redis";
                let (wanted, unwanted, example) = if single {
                    (
                        "url",
                        m.urls.as_ref().map(Spanned::span),
                        "url = \"redis://host:6379/0\"",
                    )
                } else {
                    (
                        "urls",
                        m.url.as_ref().map(Spanned::span),
                        "urls = [\"redis://10.0.0.1:7000\", \"redis://10.0.0.2:7000\"]",
                    )
                };
                if let Some(span) = unwanted {
                    self.problem(
                        span,
                        format!("backend {backend:?} takes {wanted}, not this key"),
                    );
                }
                if backend != "redis_sentinel"
                    && let Some(name) = &m.master_name
                {
                    self.problem(
                        name.span(),
                        "master_name is only used with backend = \"redis_sentinel\"",
                    );
                }
                let check = |v: &mut Self, url: &str, span: Range<usize>| -> Option<String> {
                    if url.starts_with("redis://") || url.starts_with("rediss://") {
                        Some(url.to_owned())
                    } else {
                        v.problem(
                            span,
                            format!("{url:?} must start with redis:// or rediss://"),
                        );
                        None
                    }
                };
                let urls = match &m.urls {
                    Some(list) if !single && !list.get_ref().is_empty() => {
                        let urls: Vec<Option<String>> = list
                            .get_ref()
                            .iter()
                            .map(|u| check(self, u, list.span()))
                            .collect();
                        urls.into_iter().collect::<Option<Vec<_>>>()
                    }
                    _ => None,
                };
                let endpoint = match (backend, &m.url, urls) {
                    ("redis", Some(u), _) => {
                        check(self, u.get_ref(), u.span()).map(Endpoint::Single)
                    }
                    ("redis_cluster", _, Some(urls)) => Some(Endpoint::Cluster(urls)),
                    ("redis_sentinel", _, Some(urls)) => match &m.master_name {
                        Some(name) if !name.get_ref().is_empty() => Some(Endpoint::Sentinel {
                            urls,
                            master: name.get_ref().clone(),
                        }),
                        _ => {
                            self.problem(
                                backend_span.clone(),
                                "backend \"redis_sentinel\" needs master_name = \"mymaster\" (the monitored group)",
                            );
                            None
                        }
                    },
                    _ => {
                        self.problem(backend_span, format!("backend {backend:?} needs {example}"));
                        None
                    }
                };
                let tls = self.tls(m);
                if endpoint.as_ref().is_some_and(|e| !e.uses_tls())
                    && let Some(key) = [&m.tls_ca_file, &m.tls_cert_file, &m.tls_key_file]
                        .into_iter()
                        .flatten()
                        .next()
                {
                    self.problem(key.span(), "TLS files apply only to rediss:// URLs");
                }
                Some(Store::Redis(RedisStore {
                    endpoint: endpoint?,
                    key_prefix: key_prefix?,
                    timeout: timeout?,
                    on_error: on_error?,
                    local_instances: local_instances?,
                    tls: tls?,
                }))
            }
            other => {
                self.problem(
                    backend_span,
                    format!(
                        "backend {other:?} is not one of \"memory\", \"redis\", \"redis_cluster\", \"redis_sentinel\""
                    ),
                );
                None
            }
        }
    }

    /// `[server.tls]`: the files, read and made into a rustls configuration
    /// now, so that a bad certificate is refused with its file's name.
    fn listener_tls(
        &mut self,
        model: &Spanned<ListenerTlsModel>,
    ) -> Option<(crate::tls::ListenerTls, Arc<rustls::ServerConfig>)> {
        let m = model.get_ref();
        let resolve = |v: &Self, path: &Spanned<String>| {
            v.path.parent().map_or_else(
                || PathBuf::from(path.get_ref()),
                |dir| dir.join(path.get_ref()),
            )
        };
        let files = crate::tls::ListenerTls {
            cert_file: resolve(self, &m.cert_file),
            key_file: resolve(self, &m.key_file),
            client_ca_file: m.client_ca_file.as_ref().map(|p| resolve(self, p)),
        };
        match files.server_config() {
            Ok(config) => Some((files, config)),
            Err(e) => {
                let span = match &e {
                    crate::tls::TlsError::Read { path, .. }
                    | crate::tls::TlsError::NoPem { path, .. }
                    | crate::tls::TlsError::UpstreamCa { path, .. }
                    | crate::tls::TlsError::ClientCa { path, .. } => {
                        if Some(path) == files.client_ca_file.as_ref() {
                            m.client_ca_file
                                .as_ref()
                                .map_or(model.span(), Spanned::span)
                        } else if *path == files.key_file {
                            m.key_file.span()
                        } else {
                            m.cert_file.span()
                        }
                    }
                    crate::tls::TlsError::Certificate { .. }
                    | crate::tls::TlsError::ServerName { .. } => m.cert_file.span(),
                };
                self.problem(span, format!("[server.tls]: {e}"));
                None
            }
        }
    }

    fn tls(&mut self, m: &StoreModel) -> Option<Tls> {
        let read = |v: &mut Self, file: &Option<Spanned<String>>, key: &str| match file {
            None => Some(None),
            Some(path) => {
                let resolved = v.path.parent().map_or_else(
                    || PathBuf::from(path.get_ref()),
                    |dir| dir.join(path.get_ref()),
                );
                match std::fs::read(&resolved) {
                    Ok(bytes) if bytes.starts_with(b"-----BEGIN") => Some(Some(bytes)),
                    Ok(_) => {
                        v.problem(
                            path.span(),
                            format!("{key} {:?} is not a PEM file", path.get_ref()),
                        );
                        None
                    }
                    Err(e) => {
                        v.problem(
                            path.span(),
                            format!("cannot read {key} {}: {e}", resolved.display()),
                        );
                        None
                    }
                }
            }
        };
        let ca = read(self, &m.tls_ca_file, "tls_ca_file");
        let cert = read(self, &m.tls_cert_file, "tls_cert_file");
        let key = read(self, &m.tls_key_file, "tls_key_file");
        let client = match (cert?, key?) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => {
                let span = m
                    .tls_cert_file
                    .as_ref()
                    .or(m.tls_key_file.as_ref())
                    .map_or(0..0, Spanned::span);
                self.problem(span, "tls_cert_file and tls_key_file go together");
                return None;
            }
        };
        Some(Tls { ca: ca?, client })
    }

    fn routes(
        &mut self,
        models: &[Spanned<RouteModel>],
        server: Option<&Server>,
        upstreams: &HashMap<String, Option<Arc<crate::proxy::balance::Group>>>,
    ) -> Vec<Route> {
        let mut names = HashSet::new();
        let mut routes: Vec<Route> = Vec::new();
        let defaults = Defaults::of(server);
        let server_exempt = server.map_or((&[][..], &[][..]), |s| (&s.exempt, &s.exempt_keys));
        let long_ids = server.map_or((DEFAULT_MAX_CLIENT_ID, TooLong::Reject), |s| {
            (s.max_client_id, s.on_long_client_id)
        });
        for model in models {
            let span = model.span();
            let route = self.route(
                model.get_ref(),
                span.clone(),
                (upstreams, defaults),
                server_exempt,
                long_ids,
            );
            let Some(route) = route else {
                continue;
            };
            if !names.insert(route.name.clone()) {
                self.problem(
                    model.get_ref().name.span(),
                    format!(
                        "route name {:?} is used twice; names must be unique",
                        route.name
                    ),
                );
                continue;
            }
            if let Some(earlier) = routes.iter().find(|r| r.matcher.covers(&route.matcher)) {
                let message = format!(
                    "route {:?} can never match: route {:?} above it matches every request it would; move it above {:?} or narrow {:?}",
                    route.name, earlier.name, earlier.name, earlier.name
                );
                self.problem(span.clone(), message);
                continue;
            }
            routes.push(route);
        }
        routes
    }

    fn route(
        &mut self,
        m: &RouteModel,
        span: Range<usize>,
        (upstreams, defaults): (
            &HashMap<String, Option<Arc<crate::proxy::balance::Group>>>,
            Defaults,
        ),
        server_exempt: (&[IpNet], &[crate::routes::KeyExemption]),
        long_ids: (usize, TooLong),
    ) -> Option<Route> {
        let name = m.name.get_ref();
        let name_ok = valid_name(name);
        if !name_ok {
            self.problem(
                m.name.span(),
                format!(
                    "route name {name:?} may use only letters, digits, '_', '-' and '.' (1 to 64 of them)"
                ),
            );
        }
        let matcher = self.matcher(m.matcher.as_ref());
        let timeout = self.optional_duration(
            m.upstream_timeout.as_ref(),
            "upstream_timeout",
            defaults.timeout,
        );
        let action = match (&m.upstream, &m.respond) {
            (Some(u), None) => self
                .route_upstream(u, upstreams, defaults, timeout?)
                .map(Action::Upstream),
            (None, Some(r)) => {
                if let Some(t) = &m.upstream_timeout {
                    self.problem(t.span(), "upstream_timeout has no meaning with respond");
                }
                self.respond(r).map(Action::Respond)
            }
            (Some(u), Some(_)) => {
                self.problem(
                    u.span(),
                    format!("route {name:?} has both upstream and respond; keep one"),
                );
                None
            }
            (None, None) => {
                self.problem(
                    span.clone(),
                    format!(
                        "route {name:?} needs upstream = \"http://host:port\" or respond = {{ status = 200 }}"
                    ),
                );
                None
            }
        };
        let client = self.client(
            m.client.as_ref(),
            &clients::Context {
                template: matcher
                    .as_ref()
                    .and_then(|m| m.template.as_ref().map(|(t, _)| t)),
                ignore_case: matcher.as_ref().is_some_and(|m| m.ignore_case),
                long_ids,
            },
        );
        let cost = match &m.cost {
            None => Some(1),
            Some(c) if *c.get_ref() < 1 => {
                self.problem(c.span(), "cost must be a whole number of at least 1");
                None
            }
            Some(c) => Some(*c.get_ref() as u64),
        };
        let limits = self.limits(m.limits.as_ref(), cost.unwrap_or(1));
        let overrides = self.overrides(name, &m.overrides, client.as_ref(), cost.unwrap_or(1));
        if let (Some(first), Some(limits)) = (m.overrides.first(), &limits)
            && limits.is_empty()
        {
            self.problem(
                first.span(),
                "overrides change a route's limits, and this route has none; give it limits",
            );
        }
        let mut exempt = server_exempt.0.to_vec();
        exempt.extend(self.networks(&m.exempt, "exempt"));
        let mut exempt_keys = server_exempt.1.to_vec();
        exempt_keys.extend(self.exempt_keys(&m.exempt_keys));
        let rate_limit_headers =
            self.header_mode(m.rate_limit_headers.as_ref(), defaults.rate_limit_headers);
        let deny = match &m.deny {
            None => Some(None),
            Some(d) => self.deny(d).map(Some),
        };
        if !name_ok {
            return None;
        }
        let max_request_body = match &m.max_request_body {
            None => Some(defaults.max_request_body),
            Some(size) => self.size(size, "max_request_body").map(Some),
        };
        Some(Route {
            max_request_body: max_request_body?,
            name: name.as_str().into(),
            matcher: matcher?,
            action: action?,
            client: client?,
            cost: cost?,
            shadow: m.shadow,
            policy: crate::routes::Policy::new(name, limits?),
            overrides: overrides?,
            rate_limit_headers: rate_limit_headers?,
            deny: deny?,
            exempt,
            exempt_keys,
        })
    }

    fn matcher(&mut self, model: Option<&Spanned<MatchModel>>) -> Option<Match> {
        let default = MatchModel::default();
        let m = model.map_or(&default, Spanned::get_ref);
        let mut ok = true;
        let check_path = |v: &mut Self, p: &Spanned<String>, key: &str| -> Option<String> {
            let s = p.get_ref();
            if !s.starts_with('/') {
                v.problem(p.span(), format!("{key} must start with '/'"));
                return None;
            }
            if s.contains(';') {
                v.problem(
                    p.span(),
                    format!(
                        "{key} {s:?} has ';': requests are matched without their ;parameters, so write the path without them"
                    ),
                );
                return None;
            }
            let normal = crate::routes::normalize_path(s);
            if normal != *s && !s.contains('{') {
                v.problem(
                    p.span(),
                    format!(
                        "{key} {s:?} is not in normal form (requests are matched after normalising); write {normal:?}"
                    ),
                );
                return None;
            }
            Some(s.clone())
        };
        let path_prefix = match &m.path_prefix {
            Some(p) => {
                let r = check_path(self, p, "path_prefix");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        let path = match &m.path {
            Some(p) => {
                let r = check_path(self, p, "path");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        if let (Some(_), Some(p)) = (&m.path_prefix, &m.path) {
            self.problem(p.span(), "match has both path and path_prefix; keep one");
            ok = false;
        }
        // A path with {param} segments is a template, matched segment by
        // segment instead.
        let mut template = None;
        for (text, spanned, prefix) in [
            (&path, &m.path, false),
            (&path_prefix, &m.path_prefix, true),
        ] {
            let (Some(text), Some(spanned)) = (text, spanned) else {
                continue;
            };
            match crate::routes::Template::parse(text) {
                Ok(None) => {}
                Ok(Some(t)) => template = Some((t, prefix)),
                Err(e) => {
                    self.problem(spanned.span(), e);
                    ok = false;
                }
            }
        }
        let (path, path_prefix) = match &template {
            Some(_) => (None, None),
            None => (path, path_prefix),
        };
        let headers = self.header_conditions(&m.headers);
        ok &= headers.is_some();
        let mut methods = Vec::new();
        if let Some(list) = &m.methods {
            if list.get_ref().is_empty() {
                self.problem(
                    list.span(),
                    "methods is empty, so the route would match nothing; remove the key to match every method",
                );
                ok = false;
            }
            for method in list.get_ref() {
                match http::Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes()) {
                    Ok(parsed) => methods.push(parsed),
                    Err(_) => {
                        self.problem(
                            method.span(),
                            format!("{:?} is not an HTTP method", method.get_ref()),
                        );
                        ok = false;
                    }
                }
            }
        }
        methods.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        methods.dedup();
        let host = match &m.host {
            Some(h) => match crate::routes::HostMatch::parse(h.get_ref()) {
                Some(host) => Some(host),
                None => {
                    self.problem(
                        h.span(),
                        format!("host {:?} is not a host name such as \"api.example.com\" or \"api.example.com:8080\"", h.get_ref()),
                    );
                    ok = false;
                    None
                }
            },
            None => None,
        };
        ok.then_some(Match {
            path_prefix,
            path,
            template,
            headers: headers.unwrap_or_default(),
            methods,
            host,
            ignore_case: m.ignore_case,
        })
    }

    fn respond(&mut self, r: &Spanned<RespondModel>) -> Option<Respond> {
        let m = r.get_ref();
        let status = match u16::try_from(*m.status.get_ref())
            .ok()
            .and_then(|s| http::StatusCode::from_u16(s).ok())
        {
            Some(s) => Some(s),
            None => {
                self.problem(
                    m.status.span(),
                    "status must be an HTTP status code from 100 to 999",
                );
                None
            }
        };
        let content_type = match &m.content_type {
            Some(ct) => match HeaderValue::from_str(ct.get_ref()) {
                Ok(v) => Some(v),
                Err(_) => {
                    self.problem(ct.span(), "content_type is not a valid header value");
                    None
                }
            },
            None => Some(HeaderValue::from_static("text/plain; charset=utf-8")),
        };
        Some(Respond {
            status: status?,
            body: bytes::Bytes::from(m.body.clone()),
            content_type: content_type?,
        })
    }

    fn limits(
        &mut self,
        model: Option<&Spanned<Vec<Spanned<LimitModel>>>>,
        cost: u64,
    ) -> Option<Vec<Limit>> {
        let Some(list) = model else {
            return Some(Vec::new());
        };
        if list.get_ref().is_empty() {
            self.problem(
                list.span(),
                "limits is empty; add a limit, or remove the key for a route without limits",
            );
            return None;
        }
        let mut out = Vec::new();
        let mut ok = true;
        for item in list.get_ref() {
            match self.limit(item, cost) {
                Some(l) => out.push(l),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn limit(&mut self, item: &Spanned<LimitModel>, cost: u64) -> Option<Limit> {
        let m = item.get_ref();
        let algorithm = match m.algorithm.get_ref().as_str() {
            "fixed_window" => Some(Algorithm::FixedWindow),
            "sliding_log" => Some(Algorithm::SlidingLog),
            "sliding_window" => Some(Algorithm::SlidingWindow),
            "token_bucket" => Some(Algorithm::TokenBucket),
            "gcra" => Some(Algorithm::Gcra),
            other => {
                self.problem(
                    m.algorithm.span(),
                    format!(
                        "algorithm {other:?} is not one of \"fixed_window\", \"sliding_log\", \"sliding_window\", \"token_bucket\", \"gcra\""
                    ),
                );
                None
            }
        };
        let limit = self.count(&m.limit, "limit");
        let burst = match (&m.burst, algorithm) {
            (None, _) => limit,
            (Some(b), Some(Algorithm::TokenBucket | Algorithm::Gcra)) => self.count(b, "burst"),
            (Some(b), Some(other)) => {
                self.problem(
                    b.span(),
                    format!(
                        "burst applies only to \"token_bucket\" and \"gcra\", not {:?}",
                        other.name()
                    ),
                );
                None
            }
            (Some(_), None) => None,
        };
        let window_ms = match self.duration(&m.window, "window") {
            Some(w) if w.subsec_nanos() % 1_000_000 != 0 => {
                self.problem(
                    m.window.span(),
                    "window must be a whole number of milliseconds",
                );
                None
            }
            Some(w) => Some(w.as_millis() as u64),
            None => None,
        };
        let limit = Limit::new(algorithm?, limit?, window_ms?).with_burst(burst?);
        if cost > limit.capacity() {
            let (span, what) = match (&m.burst, limit.capacity() == limit.burst) {
                (Some(b), true) => (b.span(), "burst"),
                _ => (m.limit.span(), "limit"),
            };
            self.problem(
                span,
                format!(
                    "the route's cost {cost} exceeds {what} {}, so no request could ever pass; raise the {what} or lower the cost",
                    limit.capacity()
                ),
            );
            return None;
        }
        // The algorithms count in unit-milliseconds; Lua's numbers are exact
        // integers only up to 2^53, so leave room below that.
        if limit.limit.max(limit.burst).saturating_mul(limit.window_ms) > MAX_UNIT_MS {
            self.problem(
                item.span(),
                format!(
                    "limit × window is too large to count exactly (at most {MAX_UNIT_MS} unit-milliseconds); lower the limit or burst, or shorten the window"
                ),
            );
            return None;
        }
        Some(limit)
    }

    fn count(&mut self, value: &Spanned<i64>, what: &str) -> Option<u64> {
        match *value.get_ref() {
            n if n < 1 => {
                self.problem(
                    value.span(),
                    format!("{what} must be a whole number of at least 1"),
                );
                None
            }
            n if n > MAX_LIMIT => {
                self.problem(value.span(), format!("{what} must be at most {MAX_LIMIT}"));
                None
            }
            n => Some(n as u64),
        }
    }
}

/// Largest `max(limit, burst) × window_ms`: keeps every intermediate value of
/// every algorithm, in Rust and in Lua, an exact integer.
const MAX_UNIT_MS: u64 = 1 << 50;

/// The largest `limit` accepted: counts stay far from overflow in every store.
const MAX_LIMIT: i64 = 1 << 40;

/// Route names and key prefixes end up in Redis keys, logs and headers.
fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

fn parse_cidr(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))
        .map(|n| n.trunc())
}

fn digest(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Parses `"250ms"`, `"1s"`, `"5m"`, `"1h"`, `"1d"`: a whole number and a unit.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let hint =
        "write a whole number and a unit: \"250ms\", \"1s\", \"60s\", \"5m\", \"1h\", \"1d\"";
    if number.is_empty() {
        return Err(format!("{s:?} is not a duration; {hint}"));
    }
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is too large"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => return Err(format!("{s:?} has no unit; {hint}")),
        _ => return Err(format!("{s:?} has an unknown unit {unit:?}; {hint}")),
    };
    let ms = n
        .checked_mul(unit_ms)
        .filter(|ms| *ms <= 365 * 86_400_000)
        .ok_or_else(|| format!("{s:?} is longer than a year"))?;
    Ok(Duration::from_millis(ms))
}

/// Parses a size: a whole number of bytes and a unit, `B`, `KB`, `MB`,
/// `GB` (powers of 1000) or `KiB`, `MiB`, `GiB` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let hint = "write a whole number and a unit: \"512KiB\", \"10MB\", \"1GiB\"";
    if number.is_empty() {
        return Err(format!("{s:?} is not a size; {hint}"));
    }
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is too large"))?;
    let unit: u64 = match unit {
        "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "" => return Err(format!("{s:?} has no unit; {hint}")),
        _ => return Err(format!("{s:?} has an unknown unit {unit:?}; {hint}")),
    };
    match n.checked_mul(unit) {
        Some(0) => Err(format!("{s:?} must be more than nothing")),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_a_number_and_a_unit() {
        assert_eq!(parse_size("512KiB"), Ok(512 * 1024));
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("100B"), Ok(100));
        for bad in ["", "10", "MB", "10mb", "0B", "99999999999GiB", "1.5MB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_take_a_number_and_a_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        for bad in [
            "",
            "s",
            "10",
            "1.5s",
            "10 s",
            "-1s",
            "1w",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn line_and_column_count_from_one() {
        let text = "a = 1\nbb = 2\n  ccé = 3";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 6), (2, 1));
        assert_eq!(line_column(text, 9), (2, 4));
        assert_eq!(line_column(text, text.find('=').map_or(0, |_| 19)), (3, 6));
    }
}
