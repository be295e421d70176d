//! `[server]`: listeners and server-wide settings.

use std::net::SocketAddr;
use std::sync::Arc;

use ipnet::IpNet;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use std::path::PathBuf;

use super::{
    DEFAULT_CLIENT_BODY_TIMEOUT, DEFAULT_CLIENT_WRITE_TIMEOUT, DEFAULT_DRAIN_DELAY,
    DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_MAX_CLIENT_ENTRIES, DEFAULT_SHUTDOWN_GRACE,
    DEFAULT_UPGRADE_IDLE_TIMEOUT, DEFAULT_UPSTREAM_TIMEOUT, Server, Validator, overrides,
    upstreams,
};
use crate::client::{DEFAULT_MAX_CLIENT_ID, TooLong};

/// Most requests held at once on an instance when `max_held` is not set.
const DEFAULT_MAX_HELD: usize = 10_000;
/// Most of one client's when `max_held_per_client` is not set.
const DEFAULT_MAX_HELD_PER_CLIENT: usize = 1_000;
use crate::routes::EscapedSlashes;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ServerModel {
    listen: Spanned<String>,
    admin_listen: Option<Spanned<String>>,
    /// The decision listener: front proxies ask it whether a request may
    /// pass (`auth_request`, `forward_auth`, `forwardAuth`).
    decision_listen: Option<Spanned<String>>,
    /// The front proxies whose `X-Original-*` / `X-Forwarded-*` the
    /// decision listener believes.
    decision_peers: Option<Spanned<Vec<Spanned<String>>>>,
    /// Holds the bearer token operators' changes need.
    admin_token_file: Option<Spanned<String>>,
    #[serde(default)]
    trusted_proxies: Vec<Spanned<String>>,
    #[serde(default)]
    exempt: Vec<Spanned<String>>,
    #[serde(default)]
    strip_untrusted_headers: Vec<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    upstream_connect_timeout: Option<Spanned<String>>,
    upstream_body_timeout: Option<Spanned<String>>,
    client_body_timeout: Option<Spanned<String>>,
    client_write_timeout: Option<Spanned<String>>,
    upgrade_idle_timeout: Option<Spanned<String>>,
    max_request_body: Option<Spanned<String>>,
    request_buffer: Option<Spanned<String>>,
    client_body_min_rate: Option<Spanned<String>>,
    client_body_min_rate_after: Option<Spanned<String>>,
    http2_max_concurrent_streams: Option<Spanned<i64>>,
    shutdown_grace: Option<Spanned<String>>,
    drain_delay: Option<Spanned<String>>,
    denial_log_interval: Option<Spanned<String>>,
    header_read_timeout: Option<Spanned<String>>,
    #[serde(default = "yes")]
    reload_on_change: bool,
    max_client_id: Option<Spanned<i64>>,
    on_long_client_id: Option<Spanned<String>>,
    escaped_slashes: Option<Spanned<String>>,
    max_client_entries: Option<Spanned<i64>>,
    max_connections: Option<Spanned<i64>>,
    /// Most requests held until their limits fit (a limit's `delay`).
    max_held: Option<Spanned<i64>>,
    /// Most of them one client's.
    max_held_per_client: Option<Spanned<i64>>,
    tls: Option<Spanned<ListenerTlsModel>>,
    rate_limit_headers: Option<Spanned<String>>,
    #[serde(default)]
    exempt_keys: overrides::ExemptKeysModel,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ListenerTlsModel {
    cert_file: Spanned<String>,
    key_file: Spanned<String>,
    client_ca_file: Option<Spanned<String>>,
}

impl ServerModel {
    /// The file sets `decision_listen` (valid or not).
    pub(super) fn has_decision_listen(&self) -> bool {
        self.decision_listen.is_some()
    }
}

/// How often a route and client's denials are logged at most, by default.
const DEFAULT_DENIAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Request bodies up to this size are read whole before an upstream
/// connection is taken, by default.
const DEFAULT_REQUEST_BUFFER: u64 = 64 * 1024;
/// The slowest a request body may arrive on average, in bytes a second, by
/// default.
const DEFAULT_CLIENT_BODY_MIN_RATE: u64 = 1024;
/// How long a request body may arrive at any rate, by default.
const DEFAULT_CLIENT_BODY_MIN_RATE_AFTER: Duration = Duration::from_secs(10);
/// Concurrent streams an HTTP/2 client connection may open, by default
/// (nginx's default too).
const DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS: usize = 128;

fn yes() -> bool {
    true
}

/// `[server]`'s deadlines, each as given or its default.
struct Deadlines {
    upstream: Duration,
    upstream_connect: Duration,
    upstream_body: Duration,
    client_body: Duration,
    client_write: Duration,
    upgrade_idle: Duration,
    header_read: Duration,
}

/// How much of a request body is taken, buffered, and how slowly it may
/// arrive.
struct Bodies {
    max_request_body: Option<u64>,
    request_buffer: u64,
    client_body_min_rate: u64,
    client_body_min_rate_after: Duration,
}

/// How long a stop takes, and how often denials are logged.
struct Pacing {
    shutdown_grace: Duration,
    drain_delay: Duration,
    denial_log_interval: Duration,
}

/// How many streams, clients and connections the server holds at most,
/// and how long a client id may be.
struct Capacities {
    http2_max_concurrent_streams: u32,
    max_client_id: usize,
    on_long_client_id: TooLong,
    max_client_entries: usize,
    max_connections: Option<usize>,
    max_held: usize,
    max_held_per_client: usize,
}

impl Validator<'_> {
    pub(super) fn server(&mut self, model: &Spanned<ServerModel>) -> Option<Server> {
        let m = model.get_ref();
        let listen = self.socket_addr(&m.listen, "listen");
        let admin_listen = match &m.admin_listen {
            Some(a) => Some(self.socket_addr(a, "admin_listen")?),
            None => None,
        };
        let trusted_proxies = self.networks(&m.trusted_proxies, "trusted_proxies");
        let decisions = self.decisions(model);
        let exempt = self.networks(&m.exempt, "exempt");
        let deadlines = self.deadlines(m);
        let bodies = self.bodies(m);
        let pacing = self.pacing(m);
        let capacities = self.capacities(m);
        let escaped_slashes = self.choice(
            m.escaped_slashes.as_ref(),
            "escaped_slashes",
            &EscapedSlashes::NAMES,
        );
        let tls = match &m.tls {
            None => Some(None),
            Some(tls) => self.listener_tls(tls).map(Some),
        };
        let rate_limit_headers = self.header_mode(
            m.rate_limit_headers.as_ref(),
            crate::routes::HeaderMode::default(),
        );
        let admin_token_file = self.admin_token_file(m.admin_token_file.as_ref());
        let listen = listen?;
        let admin_token_file = admin_token_file?;
        let (deadlines, bodies, pacing) = (deadlines?, bodies?, pacing?);
        let (capacities, escaped_slashes) = (capacities?, escaped_slashes?);
        Some(Server {
            listen,
            admin_listen,
            decision_listen: decisions.as_ref().map(|d| d.0),
            decision_peers: decisions.map(|d| d.1).unwrap_or_default(),
            admin_token_file,
            trusted_proxies,
            exempt,
            upstream_timeout: deadlines.upstream,
            upstream_connect_timeout: deadlines.upstream_connect,
            upstream_body_timeout: deadlines.upstream_body,
            client_body_timeout: deadlines.client_body,
            client_write_timeout: deadlines.client_write,
            upgrade_idle_timeout: deadlines.upgrade_idle,
            max_request_body: bodies.max_request_body,
            request_buffer: bodies.request_buffer,
            client_body_min_rate: bodies.client_body_min_rate,
            client_body_min_rate_after: bodies.client_body_min_rate_after,
            http2_max_concurrent_streams: capacities.http2_max_concurrent_streams,
            shutdown_grace: pacing.shutdown_grace,
            drain_delay: pacing.drain_delay,
            denial_log_interval: pacing.denial_log_interval,
            header_read_timeout: deadlines.header_read,
            reload_on_change: m.reload_on_change,
            max_client_id: capacities.max_client_id,
            on_long_client_id: capacities.on_long_client_id,
            escaped_slashes,
            max_client_entries: capacities.max_client_entries,
            max_connections: capacities.max_connections,
            max_held: capacities.max_held,
            max_held_per_client: capacities.max_held_per_client,
            tls: tls?,
            rate_limit_headers: rate_limit_headers?,
            exempt_keys: self.exempt_keys(&m.exempt_keys),
            strip_untrusted_headers: m
                .strip_untrusted_headers
                .iter()
                .filter_map(|name| self.header_name(name))
                .collect(),
        })
    }

    /// The upstream, client and upgrade deadlines.
    fn deadlines(&mut self, m: &ServerModel) -> Option<Deadlines> {
        let mut timeout = |value: &Option<Spanned<String>>, key: &str, default: Duration| {
            self.optional_duration(value.as_ref(), key, default)
        };
        let upstream = timeout(
            &m.upstream_timeout,
            "upstream_timeout",
            DEFAULT_UPSTREAM_TIMEOUT,
        );
        let upstream_connect = timeout(
            &m.upstream_connect_timeout,
            "upstream_connect_timeout",
            upstreams::DEFAULT_CONNECT_TIMEOUT,
        );
        let upstream_body = timeout(
            &m.upstream_body_timeout,
            "upstream_body_timeout",
            upstreams::DEFAULT_BODY_TIMEOUT,
        );
        let client_body = timeout(
            &m.client_body_timeout,
            "client_body_timeout",
            DEFAULT_CLIENT_BODY_TIMEOUT,
        );
        let client_write = timeout(
            &m.client_write_timeout,
            "client_write_timeout",
            DEFAULT_CLIENT_WRITE_TIMEOUT,
        );
        let upgrade_idle = timeout(
            &m.upgrade_idle_timeout,
            "upgrade_idle_timeout",
            DEFAULT_UPGRADE_IDLE_TIMEOUT,
        );
        let header_read = timeout(
            &m.header_read_timeout,
            "header_read_timeout",
            DEFAULT_HEADER_READ_TIMEOUT,
        );
        Some(Deadlines {
            upstream: upstream?,
            upstream_connect: upstream_connect?,
            upstream_body: upstream_body?,
            client_body: client_body?,
            client_write: client_write?,
            upgrade_idle: upgrade_idle?,
            header_read: header_read?,
        })
    }

    /// The largest body, the buffered part, and the slowest arrival.
    fn bodies(&mut self, m: &ServerModel) -> Option<Bodies> {
        let max_request_body = match &m.max_request_body {
            None => Some(None),
            Some(size) => self.size(size, "max_request_body").map(Some),
        };
        // "0" turns these off; any other value is a size.
        let mut size_or_off = |value: &Option<Spanned<String>>, key: &str, default: u64| match value
        {
            None => Some(default),
            Some(v) if v.get_ref() == "0" => Some(0),
            Some(v) => self.size(v, key),
        };
        let request_buffer =
            size_or_off(&m.request_buffer, "request_buffer", DEFAULT_REQUEST_BUFFER);
        let client_body_min_rate = size_or_off(
            &m.client_body_min_rate,
            "client_body_min_rate",
            DEFAULT_CLIENT_BODY_MIN_RATE,
        );
        let client_body_min_rate_after = self.optional_duration(
            m.client_body_min_rate_after.as_ref(),
            "client_body_min_rate_after",
            DEFAULT_CLIENT_BODY_MIN_RATE_AFTER,
        );
        Some(Bodies {
            max_request_body: max_request_body?,
            request_buffer: request_buffer?,
            client_body_min_rate: client_body_min_rate?,
            client_body_min_rate_after: client_body_min_rate_after?,
        })
    }

    /// The grace and drain of a stop, and the denial log's interval.
    fn pacing(&mut self, m: &ServerModel) -> Option<Pacing> {
        let shutdown_grace = self.optional_duration(
            m.shutdown_grace.as_ref(),
            "shutdown_grace",
            DEFAULT_SHUTDOWN_GRACE,
        );
        // Zero is allowed: close the listener at once. Without an admin
        // listener there is no `/readyz` to turn 503 for load balancers, so
        // unless asked for, there is nothing to wait for.
        let drain_delay = match &m.drain_delay {
            None if m.admin_listen.is_none() => Some(Duration::ZERO),
            None => Some(DEFAULT_DRAIN_DELAY),
            Some(d) if matches!(d.get_ref().as_str(), "0" | "0s" | "0ms") => Some(Duration::ZERO),
            Some(d) => self.duration(d, "drain_delay"),
        };
        let denial_log_interval = self.optional_duration(
            m.denial_log_interval.as_ref(),
            "denial_log_interval",
            DEFAULT_DENIAL_LOG_INTERVAL,
        );
        Some(Pacing {
            shutdown_grace: shutdown_grace?,
            drain_delay: drain_delay?,
            denial_log_interval: denial_log_interval?,
        })
    }

    /// HTTP/2 streams, client ids, in-process tables and connections.
    fn capacities(&mut self, m: &ServerModel) -> Option<Capacities> {
        let http2_max_concurrent_streams = self.bounded(
            m.http2_max_concurrent_streams.as_ref(),
            DEFAULT_HTTP2_MAX_CONCURRENT_STREAMS,
            1..=10_000,
            "http2_max_concurrent_streams must be a whole number from 1 to 10000",
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
            &TooLong::NAMES,
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
        let max_held = self.bounded(
            m.max_held.as_ref(),
            DEFAULT_MAX_HELD,
            1..=10_000_000,
            "max_held must be a whole number from 1 to 10000000",
        );
        let max_held_per_client = self.bounded(
            m.max_held_per_client.as_ref(),
            DEFAULT_MAX_HELD_PER_CLIENT,
            1..=10_000_000,
            "max_held_per_client must be a whole number from 1 to 10000000",
        );
        Some(Capacities {
            max_held: max_held?,
            max_held_per_client: max_held_per_client?,
            http2_max_concurrent_streams: u32::try_from(http2_max_concurrent_streams?)
                .unwrap_or(u32::MAX),
            max_client_id: max_client_id?,
            on_long_client_id: on_long_client_id?,
            max_client_entries: max_client_entries?,
            max_connections: max_connections?,
        })
    }

    /// `admin_token_file`: a file whose first line is a long enough token.
    fn admin_token_file(&mut self, file: Option<&Spanned<String>>) -> Option<Option<PathBuf>> {
        let Some(file) = file else {
            return Some(None);
        };
        match self.first_line(file, "admin_token_file") {
            Some(token) if token.trim().len() < 16 => {
                self.problem(
                    file.span(),
                    "the admin token must be at least 16 characters (e.g. 32 random bytes in hex)",
                );
                None
            }
            Some(_) => Some(Some(self.resolve(file))),
            None => None,
        }
    }

    /// `decision_listen` with `decision_peers`: each needs the other, so
    /// that a decision listener never believes everyone's forwarded
    /// headers and a list of peers never sits unused.
    fn decisions(&mut self, model: &Spanned<ServerModel>) -> Option<(SocketAddr, Vec<IpNet>)> {
        let m = model.get_ref();
        match (&m.decision_listen, &m.decision_peers) {
            (None, None) => None,
            (Some(listen), None) => {
                self.problem(
                    listen.span(),
                    "decision_listen needs decision_peers: the addresses (CIDRs) of the front proxies whose X-Original-URI and X-Forwarded-* it believes, e.g. [\"127.0.0.1/32\"]",
                );
                None
            }
            (None, Some(peers)) => {
                self.problem(
                    peers.span(),
                    "decision_peers is only read with decision_listen: add the decision listener's address, or remove decision_peers",
                );
                None
            }
            (Some(listen), Some(peers)) => {
                if peers.get_ref().is_empty() {
                    self.problem(
                        peers.span(),
                        "decision_peers is empty: name the front proxies' addresses (CIDRs), e.g. [\"127.0.0.1/32\"]",
                    );
                    return None;
                }
                let listen = self.socket_addr(listen, "decision_listen");
                let peers = self.networks(peers.get_ref(), "decision_peers");
                Some((listen?, peers))
            }
        }
    }

    /// `[server.tls]`: the files, read and made into a rustls configuration
    /// now, so that a bad certificate is refused with its file's name.
    pub(super) fn listener_tls(
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
}
