//! What an upstream is, as the configuration describes it: its endpoints,
//! the protocol and TLS they speak, how one is chosen, when one is ejected,
//! how often DNS names are looked up again and how endpoints are checked.
//!
//! Plain data that `config` compiles the file into and that the live side
//! ([`super::balance::Group`], the pools) is built from; it imports nothing
//! else of floodgate's. The TLS client configuration is built (files read,
//! checked) when the configuration loads, by `crate::tls`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme};
use rustls::ClientConfig;
use rustls_pki_types::ServerName;

/// One upstream: the endpoints a route forwards to and how they are used.
/// Routes refer to it by its index in the configuration's list.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// As metrics and logs name it: the `[upstreams.NAME]`, or the URL a
    /// route gave.
    pub name: Box<str>,
    /// The endpoints as configured (at least one); a host may be a DNS
    /// name, resolved when the upstream starts and every `resolve_every`.
    pub endpoints: Vec<Endpoint>,
    /// How an endpoint is chosen.
    pub balance: Balance,
    /// Connection failures in a row that eject an endpoint.
    pub eject_after: u32,
    /// How long a first ejection lasts (doubled at each one in a row).
    pub eject_for: Duration,
    /// How often DNS names are resolved again.
    pub resolve_every: Duration,
    /// The active health check, if any.
    pub check: Option<Check>,
}

/// One upstream server: an address to connect to and how to talk to it.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// `scheme://host:port`, as logs name it (with the address connected
    /// to when the host is a DNS name).
    pub target: Box<str>,
    /// `http` or `https`.
    pub scheme: Scheme,
    /// `host:port` to connect to.
    pub authority: Authority,
    /// The `Host` header sent upstream.
    pub host_header: HeaderValue,
    /// Send the client's `Host` instead of `host_header`.
    pub preserve_host: bool,
    /// Which forwarding headers beyond `X-Forwarded-*` it is sent.
    pub forwarding: Forwarding,
    /// Which HTTP it speaks.
    pub protocol: Protocol,
    /// TLS to an `https://` upstream.
    pub tls: Option<Arc<UpstreamTls>>,
    /// Deadline for a new connection, TLS handshake included.
    pub connect_timeout: Duration,
    /// A response body that sends nothing for this long is cut off.
    pub body_timeout: Duration,
    /// Which pool its connections share: endpoints with the same scheme,
    /// address, protocol and TLS name share one.
    pub pool_key: Box<str>,
}

impl Endpoint {
    /// The port when the address names none: 443 for `https`, else 80.
    pub fn default_port(&self) -> u16 {
        if self.scheme == Scheme::HTTPS {
            443
        } else {
            80
        }
    }
}

/// The optional forwarding headers of RFC 7239 and RFC 9110.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Forwarding {
    /// Send `Forwarded: for=…;proto=…;host=…` (RFC 7239).
    pub forwarded: bool,
    /// Add floodgate to `Via` (RFC 9110 §7.6.3).
    pub via: bool,
}

/// Which HTTP an upstream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 (the default for `http://`).
    Http1,
    /// HTTP/2 over plain TCP, by prior knowledge.
    H2c,
    /// HTTP/2 over TLS.
    H2,
    /// Over TLS, what ALPN agrees: HTTP/2 if the upstream offers it, else
    /// HTTP/1.1 (the default for `https://`).
    Auto,
}

impl Protocol {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, Protocol); 4] = [
        ("http1", Protocol::Http1),
        ("h2c", Protocol::H2c),
        ("h2", Protocol::H2),
        ("auto", Protocol::Auto),
    ];
}

/// How a group chooses among its endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// The less busy of two drawn at random.
    LeastInFlight,
    /// Each in turn.
    RoundRobin,
}

impl Balance {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, Balance); 2] = [
        ("least_in_flight", Balance::LeastInFlight),
        ("round_robin", Balance::RoundRobin),
    ];
}

/// The active health check of an upstream's endpoints.
#[derive(Debug, Clone)]
pub struct Check {
    /// What is requested (`GET`).
    pub path: PathAndQuery,
    /// How often each endpoint is checked.
    pub every: Duration,
    /// How long a check may take, connection included.
    pub timeout: Duration,
    /// Failed checks in a row that leave an endpoint out.
    pub unhealthy_after: u32,
    /// Passed checks in a row that bring it back.
    pub healthy_after: u32,
}

/// Where an `https://` upstream's trust and client certificate come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UpstreamTlsFiles {
    /// CA certificates (PEM) the upstream's certificate must chain to,
    /// instead of the system's roots.
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM) to present, with `key_file`.
    pub cert_file: Option<PathBuf>,
    /// The client certificate's key (PEM).
    pub key_file: Option<PathBuf>,
}

/// TLS to one `https://` upstream, ready to connect with.
#[derive(Debug)]
pub struct UpstreamTls {
    /// The name sent as SNI and checked in the upstream's certificate.
    pub server_name: ServerName<'static>,
    /// The configuration, with ALPN for the upstream's protocol.
    pub config: Arc<ClientConfig>,
    /// The same, offering HTTP/1.1 alone (for upgrades).
    pub http1_config: Arc<ClientConfig>,
    /// Where it came from.
    pub files: UpstreamTlsFiles,
}

impl UpstreamTls {
    /// The files a change of which should reload the configuration.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [
            self.files.ca_file.as_ref(),
            self.files.cert_file.as_ref(),
            self.files.key_file.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
    }
}
