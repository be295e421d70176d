//! The operator's TOML file: its serde model, validation, and compilation into
//! the runtime rule table.
//!
//! The format is the contract in `CONFIG.md`. Every problem found while loading
//! is reported with the file, line and column it comes from, and all of them
//! are reported at once, so an operator fixes a file in one pass.
//!
//! This file holds the loaded [`Config`] and the file's top-level model;
//! `validator` is one run over a file and the checks every section shares,
//! and each section is read in its own module:
//! `document` (the file into the model, every refusal reported), `server`,
//! `store`, `upstreams`, `routes` (match, action, policy, descriptor), with
//! `limits` (one limit entry), `calendars` (its windows by the calendar),
//! `matching` (header conditions), `clients`, `overrides`
//! (per-client limits, exempt keys), `plans` (keys per limit, budgets,
//! plans and their selection), `answers` (deny answers, header modes),
//! `concurrency`, `usage` and `access_log`; `summary` is what `--check`
//! prints of a valid file, and `probe` what `--probe` reads of one;
//! `durations` and `problems` serve them all. The settings other modules
//! own are defined there and filled in here: the store's in
//! [`crate::limit::settings`], and each enumeration's names (`NAMES`) beside
//! the enumeration, so `config` depends on the rest and nothing on it but
//! the server that runs a [`Config`].

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use serde::Deserialize;
use toml::Spanned;

use crate::client::TooLong;
use crate::routes::{EscapedSlashes, Table};

mod access_log;
mod answers;
mod calendars;
mod clients;
mod concurrency;
mod document;
mod durations;
pub mod envoy_ratelimit;
mod keys;
mod keys_file;
mod limits;
mod matching;
mod overrides;
mod plans;
mod probe;
mod problems;
mod routes;
mod server;
mod store;
mod summary;
mod upstreams;
mod usage;
mod validator;

use upstreams::{Defaults, UpstreamModel};

pub use crate::limit::settings::{
    DEFAULT_MAX_CLIENT_ENTRIES, Endpoint, OnError, RedisSettings, Store, Tls,
};
/// A client → plan table as the configuration reads it.
pub use crate::routes::PlanTable;
pub use durations::{parse_duration, parse_size};
pub use keys_file::{load_keys_file, parse_keys_file};
use limits::LimitModel;
pub use plans::{PlanTableFile, load_plan_table};
pub use probe::{ListenAddresses, listen_addresses};
pub use problems::{LoadError, Problem};
use routes::{RouteModel, valid_name};
use server::ServerModel;
use store::StoreModel;
use validator::Validator;

/// Default deadline for an upstream's response head.
const DEFAULT_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);
/// Default time in-flight requests get to finish after SIGTERM.
const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// Default time `/readyz` says 503 before the listener closes at a stop.
const DEFAULT_DRAIN_DELAY: Duration = Duration::from_secs(5);
/// Default deadline for one store decision, pool wait included.
const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_millis(50);
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
    /// The upstreams the routes forward to, each once, in the order first
    /// named; a route's [`crate::routes::Upstream::index`] points here.
    pub upstreams: Vec<crate::proxy::settings::Upstream>,
    /// First 16 hex digits of the file's SHA-256: which file is in force.
    pub digest: String,
    /// Listener addresses from the command line, which replace the file's.
    pub overrides: Overrides,
    /// The access log, if on.
    pub access_log: Option<crate::access_log::Settings>,
    /// How client ids appear in the access log and on `/clients/top`.
    pub client_ids: crate::access_log::ShowId,
    /// The key registry (`[keys]`), if on.
    pub keys: Option<crate::keys::Settings>,
    /// The keys file (`[keys] file`) as read with this configuration.
    pub keys_file: Option<Arc<crate::keys::KeysFile>>,
}

/// Listener addresses given on the command line (`--listen`,
/// `--admin-listen`), which replace the file's: several instances on one
/// host can share one file (and its digest). They hold across reloads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Overrides {
    /// Replaces `[server] listen`.
    pub listen: Option<SocketAddr>,
    /// Replaces (or adds) `[server] admin_listen`.
    pub admin_listen: Option<SocketAddr>,
}

impl Overrides {
    /// `config` with these addresses in place of the file's, remembered
    /// so that a reload applies them again.
    pub fn apply(self, mut config: Config) -> Config {
        if let Some(listen) = self.listen {
            config.server.listen = listen;
        }
        if let Some(admin) = self.admin_listen {
            config.server.admin_listen = Some(admin);
        }
        config.overrides = self;
        config
    }

    /// `addresses` with these in place of the file's.
    pub fn apply_to(self, mut addresses: ListenAddresses) -> ListenAddresses {
        if let Some(listen) = self.listen {
            addresses.listen = listen;
        }
        if let Some(admin) = self.admin_listen {
            addresses.admin_listen = Some(admin);
        }
        addresses
    }
}

impl Config {
    /// The files whose contents decide this configuration: the file
    /// itself, the listener's TLS files, the upstreams' CA and client
    /// certificates, and the keys JWT clients are verified with.
    pub fn files(&self) -> Vec<PathBuf> {
        let mut files = vec![self.path.clone()];
        if let Some((tls, _)) = &self.server.tls {
            files.extend(tls.files().map(Path::to_path_buf));
        }
        for route in self.routes.iter() {
            for part in &route.client.parts {
                if let crate::client::Part::Claim(rule) = part {
                    files.extend(rule.source.clone());
                }
            }
        }
        for upstream in &self.upstreams {
            for endpoint in &upstream.endpoints {
                if let Some(tls) = &endpoint.tls {
                    files.extend(tls.files().map(Path::to_path_buf));
                }
            }
        }
        files.sort();
        files.dedup();
        files
    }

    /// The client → plan table file, when plans are chosen by one: its
    /// path, the plans it may name, and the table as read with this
    /// configuration (a change of the file alone is read without reading
    /// the rest again).
    pub fn plan_table(&self) -> Option<PlanTableFile> {
        let selection = self.routes.plan_selection.as_ref()?;
        match &selection.by {
            crate::routes::PlanSource::Table { path, read, .. } => Some(PlanTableFile {
                path: path.clone(),
                names: selection.names.clone(),
                read: Arc::clone(read),
            }),
            _ => None,
        }
    }

    /// The plans (`[plans.NAME]`) by name, in the file's order.
    pub fn plan_names(&self) -> Vec<Arc<str>> {
        self.routes
            .plan_selection
            .as_ref()
            .map(|s| s.names.clone())
            .unwrap_or_default()
    }

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
        if a.decision_listen != b.decision_listen {
            out.push("decision_listen");
        }
        if a.shutdown_grace != b.shutdown_grace {
            out.push("shutdown_grace");
        }
        if a.drain_delay != b.drain_delay {
            out.push("drain_delay");
        }
        if a.denial_log_interval != b.denial_log_interval {
            out.push("denial_log_interval");
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
        if a.max_held != b.max_held {
            out.push("max_held");
        }
        if a.max_held_per_client != b.max_held_per_client {
            out.push("max_held_per_client");
        }
        if a.http2_max_concurrent_streams != b.http2_max_concurrent_streams {
            out.push("http2_max_concurrent_streams");
        }
        if a.reload_on_change != b.reload_on_change {
            out.push("reload_on_change");
        }
        if self.store != new.store {
            out.push("store");
        }
        if self.keys != new.keys {
            out.push("keys");
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
    /// The decision listener, if any: front proxies ask it whether a
    /// request may pass, and floodgate decides as on the proxy listener.
    pub decision_listen: Option<SocketAddr>,
    /// Peers of the decision listener whose `X-Original-*` and
    /// `X-Forwarded-*` describe the request to decide (empty without a
    /// decision listener).
    pub decision_peers: Vec<IpNet>,
    /// The file holding the bearer token operators' changes need
    /// (`/clients/reset`, `/clients/credit`, `/clients/debit`); without
    /// one, changes are refused.
    pub admin_token_file: Option<std::path::PathBuf>,
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
    /// Request bodies up to this many bytes are read whole before an
    /// upstream connection is taken (0: every body streams).
    pub request_buffer: u64,
    /// A request body that arrives slower than this on average, in bytes a
    /// second, after `client_body_min_rate_after`, is the client's 408 (0:
    /// no minimum).
    pub client_body_min_rate: u64,
    /// How long a request body may arrive at any rate.
    pub client_body_min_rate_after: Duration,
    /// Concurrent streams an HTTP/2 client connection may open.
    pub http2_max_concurrent_streams: u32,
    /// How long in-flight requests may take to finish after SIGTERM.
    pub shutdown_grace: Duration,
    /// After SIGTERM, how long `/readyz` answers 503 while new connections
    /// are still accepted, so load balancers stop sending before the
    /// listener closes.
    pub drain_delay: Duration,
    /// A route and client's denials are logged once per this interval at
    /// most, each line with the count folded into it.
    pub denial_log_interval: Duration,
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
    /// Most requests held until their limits fit (a limit's `delay`) at
    /// once on this instance; past it a request is decided without delay.
    pub max_held: usize,
    /// Most of them one client's.
    pub max_held_per_client: usize,
    /// TLS on the proxy listener: where the files are, and the rustls
    /// configuration read from them at load.
    pub tls: Option<(crate::tls::ListenerTls, Arc<rustls::ServerConfig>)>,
    /// Which rate-limit fields responses carry, unless a route says otherwise.
    pub rate_limit_headers: crate::routes::HeaderMode,
    /// Requests carrying one of these header values bypass every route's
    /// limits.
    pub exempt_keys: Vec<crate::routes::KeyExemption>,
    /// Headers removed from requests of peers not in `trusted_proxies`,
    /// beyond the forwarding headers that always are.
    pub strip_untrusted_headers: Vec<http::HeaderName>,
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
    #[serde(default)]
    budgets: BTreeMap<Spanned<String>, Spanned<plans::BudgetModel>>,
    #[serde(default)]
    plans: BTreeMap<Spanned<String>, Spanned<plans::PlanModel>>,
    plan_selection: Option<Spanned<plans::PlanSelectionModel>>,
    keys: Option<Spanned<keys::KeysModel>>,
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
        upstreams: Vec::new(),
        upstream_index: HashMap::new(),
        removed: document::Removed::default(),
    };
    let Some((model, removed)) = v.model() else {
        return Err(LoadError::Invalid(v.sorted_problems()));
    };
    v.removed = removed;
    let server = v.server(&model.server);
    let store = v.store(model.store.as_ref());
    let keys = match &model.keys {
        Some(k) => v.keys(k, store.as_ref()).map(Some),
        None => Some(None),
    };
    let mut defaults = Defaults::of(server.as_ref());
    // Asked of the file, not of a `[server]` with a mistake elsewhere: a
    // route only decided is no mistake of its own then.
    defaults.decisions = model.server.get_ref().has_decision_listen();
    defaults.keys = model.keys.is_some();
    let upstreams = v.upstreams(&model.upstreams, defaults);
    let mut catalog = v.catalog(&model.budgets, &model.plans, model.plan_selection.as_ref());
    let routes = v.routes(
        &model.routes,
        (server.as_ref(), defaults),
        &upstreams,
        &catalog,
    );
    let selection = catalog.selection.take();
    let plan_names: Vec<Arc<str>> = model
        .plans
        .keys()
        .map(|n| n.get_ref().as_str().into())
        .collect();
    let keys_file = match &model.keys {
        Some(k) => v.keys_file(k, &plan_names),
        None => Some(None),
    };
    let access_log = match &model.access_log {
        Some(m) => v.access_log(m.get_ref()),
        None => Some((None, crate::access_log::ShowId::Hash)),
    };
    match (
        server,
        store,
        access_log,
        (keys, keys_file),
        v.problems.is_empty(),
    ) {
        (
            Some(server),
            Some(store),
            Some((access_log, client_ids)),
            (Some(keys), Some(keys_file)),
            true,
        ) => Ok(Config {
            path: path.to_owned(),
            server,
            store,
            routes: Table::new(routes).with_plans(selection),
            upstreams: std::mem::take(&mut v.upstreams),
            digest: digest(text),
            overrides: Overrides::default(),
            access_log,
            client_ids,
            keys,
            keys_file,
        }),
        _ => Err(LoadError::Invalid(v.sorted_problems())),
    }
}

/// Largest `max(limit, burst) × window_ms`: keeps every intermediate value of
/// every algorithm, in Rust and in Lua, an exact integer.
const MAX_UNIT_MS: u64 = 1 << 50;

/// The largest `limit` accepted: counts stay far from overflow in every store.
const MAX_LIMIT: i64 = 1 << 40;

fn parse_cidr(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<std::net::IpAddr>().ok().map(IpNet::from))
        .map(|n| n.trunc())
}

impl Config {
    /// First 16 hex digits of the SHA-256 of what decides the counts in a
    /// shared store: each route's name, cost, limits and overrides, in
    /// order. Instances whose files differ elsewhere (listeners, logs)
    /// share it; instances that count the same keys differently do not.
    pub fn rules_digest(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut hash = Sha256::new();
        for route in self.routes.iter() {
            let overrides: Vec<_> = route
                .overrides
                .iter()
                .map(|o| (format!("{:?}", o.clients), &o.policy.limits))
                .collect();
            // Whose count each limit is, and each plan's limits, count too.
            let keyed = |p: &crate::routes::Policy| {
                p.counting()
                    .into_iter()
                    .flatten()
                    .map(|c| format!("{}#{}:{}", c.scope, c.index, c.shown))
                    .collect::<Vec<_>>()
            };
            let plans: Vec<_> = route
                .plans
                .iter()
                .map(|p| p.as_ref().map(|p| (&p.limits, keyed(p))))
                .collect();
            hash.update(
                format!(
                    "{}|{}|{:?}|{:?}|{}|{:?}|{:?}\n",
                    route.name,
                    route.cost,
                    route.policy.limits,
                    overrides,
                    route.usage.is_some(),
                    keyed(&route.policy),
                    plans
                )
                .as_bytes(),
            );
        }
        crate::client::hex(&hash.finalize()[..8])
    }
}

/// The digest a configuration's text is known by: the first 16 hex digits
/// of its SHA-256 (`floodgate_config_info`, the startup and reload lines).
pub fn digest(text: &str) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(text.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}
