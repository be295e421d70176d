//! `[upstreams.NAME]`: upstreams that need more than a URL (TLS settings, a
//! protocol), named once and referred to by routes; and the plain URLs
//! routes may give instead.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::HeaderValue;
use http::uri::{Authority, PathAndQuery, Scheme, Uri};
use serde::Deserialize;
use toml::Spanned;

use super::{Server, Validator};
use crate::proxy::settings::{
    self, Balance, Check, Endpoint, Forwarding, Protocol, UpstreamTls, UpstreamTlsFiles,
};
use crate::routes::Upstream;
use crate::tls::TlsError;

/// Default deadline for a new upstream connection, TLS included.
pub(super) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default first ejection of a failing endpoint.
const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(5);
/// Default interval between DNS lookups of an endpoint's name.
const DEFAULT_RESOLVE_EVERY: Duration = Duration::from_secs(10);
/// Shortest interval between DNS lookups or health checks.
const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// Default interval between health checks of an endpoint.
const DEFAULT_CHECK_EVERY: Duration = Duration::from_secs(5);
/// Default time a health check may take.
const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// Default idle timeout of an upstream's response body.
pub(super) const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UpstreamModel {
    url: Option<Spanned<String>>,
    endpoints: Option<Spanned<Vec<Spanned<String>>>>,
    balance: Option<Spanned<String>>,
    eject_after: Option<Spanned<i64>>,
    eject_for: Option<Spanned<String>>,
    protocol: Option<Spanned<String>>,
    server_name: Option<Spanned<String>>,
    ca_file: Option<Spanned<String>>,
    cert_file: Option<Spanned<String>>,
    key_file: Option<Spanned<String>>,
    #[serde(default)]
    preserve_host: bool,
    resolve_every: Option<Spanned<String>>,
    health_check: Option<Spanned<HealthCheckModel>>,
    #[serde(default)]
    forwarded: bool,
    #[serde(default)]
    via: bool,
}

/// `health_check = { path = "/healthz", ... }` of an `[upstreams.NAME]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct HealthCheckModel {
    path: Spanned<String>,
    every: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    unhealthy_after: Option<Spanned<i64>>,
    healthy_after: Option<Spanned<i64>>,
}

/// The upstream settings that come from `[server]`.
#[derive(Clone, Copy)]
pub(super) struct Defaults {
    pub timeout: Duration,
    pub connect_timeout: Duration,
    pub body_timeout: Duration,
    /// `[server] max_request_body`.
    pub max_request_body: Option<u64>,
    /// `[server] rate_limit_headers`.
    pub rate_limit_headers: crate::routes::HeaderMode,
    /// `[server] decision_listen` is set: a route may be only decided.
    pub decisions: bool,
    /// `[keys]` is given: a route may verify keys (`api_key`).
    pub keys: bool,
}

impl Defaults {
    pub(super) fn of(server: Option<&Server>) -> Self {
        server.map_or(
            Self {
                timeout: super::DEFAULT_UPSTREAM_TIMEOUT,
                connect_timeout: DEFAULT_CONNECT_TIMEOUT,
                body_timeout: DEFAULT_BODY_TIMEOUT,
                max_request_body: None,
                rate_limit_headers: crate::routes::HeaderMode::default(),
                decisions: false,
                keys: false,
            },
            |s| Self {
                timeout: s.upstream_timeout,
                connect_timeout: s.upstream_connect_timeout,
                body_timeout: s.upstream_body_timeout,
                max_request_body: s.max_request_body,
                rate_limit_headers: s.rate_limit_headers,
                decisions: s.decision_listen.is_some(),
                keys: false,
            },
        )
    }
}

/// The `[upstreams.NAME]` tables by name: each compiled, or `None` where
/// its table had a problem (already reported).
pub(super) type NamedUpstreams = HashMap<String, Option<settings::Upstream>>;

impl Validator<'_> {
    /// Every `[upstreams.NAME]`, compiled; one with a problem is reported
    /// and left out (routes naming it report nothing more). Only those
    /// that routes name join the configuration's list of upstreams.
    pub(super) fn upstreams(
        &mut self,
        models: &BTreeMap<String, Spanned<UpstreamModel>>,
        defaults: Defaults,
    ) -> NamedUpstreams {
        let mut out = HashMap::new();
        for (name, model) in models {
            if !super::valid_name(name) {
                self.problem(
                    model.span(),
                    format!(
                        "upstream name {name:?} may use only letters, digits, '_', '-' and '.' (1 to 64 of them)"
                    ),
                );
            }
            let upstream = self.named_upstream(name, model.get_ref(), model.span(), defaults);
            out.insert(name.clone(), upstream);
        }
        out
    }

    /// An `[upstreams.NAME]`: one endpoint (`url`), or several
    /// (`endpoints`) balanced as a group.
    fn named_upstream(
        &mut self,
        name: &str,
        m: &UpstreamModel,
        span: std::ops::Range<usize>,
        defaults: Defaults,
    ) -> Option<settings::Upstream> {
        let urls: Vec<&Spanned<String>> = match (&m.url, &m.endpoints) {
            (Some(url), None) => vec![url],
            (None, Some(list)) if !list.get_ref().is_empty() => list.get_ref().iter().collect(),
            (None, Some(list)) => {
                self.problem(list.span(), format!("upstream {name:?} has no endpoints"));
                return None;
            }
            (Some(url), Some(_)) => {
                self.problem(
                    url.span(),
                    format!("upstream {name:?} has both url and endpoints; keep one"),
                );
                return None;
            }
            (None, None) => {
                self.problem(
                    span,
                    format!(
                        "upstream {name:?} needs url = \"http://host:port\" or endpoints = [...]"
                    ),
                );
                return None;
            }
        };
        let balance = self.choice(m.balance.as_ref(), "balance", &Balance::NAMES);
        let eject_after = self.bounded(
            m.eject_after.as_ref(),
            3,
            1..=1000,
            "eject_after must be a whole number of failures from 1 to 1000",
        );
        let eject_for =
            self.optional_duration(m.eject_for.as_ref(), "eject_for", DEFAULT_EJECT_FOR);
        let resolve_every = self.interval(
            m.resolve_every.as_ref(),
            "resolve_every",
            DEFAULT_RESOLVE_EVERY,
        );
        let check = match &m.health_check {
            Some(c) => Some(self.health_check(c.get_ref())?),
            None => None,
        };
        let mut endpoints = Vec::with_capacity(urls.len());
        let mut first_scheme = None;
        for url in urls {
            let (scheme, authority) = self.url(url)?;
            if first_scheme.get_or_insert_with(|| scheme.clone()) != &scheme {
                self.problem(
                    url.span(),
                    format!("upstream {name:?} mixes http:// and https:// endpoints; give them one scheme"),
                );
                return None;
            }
            let endpoint = self.endpoint(name, m, scheme, authority, defaults)?;
            endpoints.push(endpoint);
        }
        Some(settings::Upstream {
            name: name.into(),
            endpoints,
            balance: balance?,
            eject_after: u32::try_from(eject_after?).unwrap_or(3),
            eject_for: eject_for?,
            resolve_every: resolve_every?,
            check,
        })
    }

    /// A duration of at least [`MIN_INTERVAL`], or `default`.
    fn interval(
        &mut self,
        value: Option<&Spanned<String>>,
        what: &str,
        default: Duration,
    ) -> Option<Duration> {
        let d = self.optional_duration(value, what, default)?;
        if d < MIN_INTERVAL {
            let span = value.map_or(0..0, Spanned::span);
            self.problem(span, format!("{what} must be at least 100ms"));
            return None;
        }
        Some(d)
    }

    /// An upstream's `health_check`.
    fn health_check(&mut self, m: &HealthCheckModel) -> Option<Check> {
        let text = m.path.get_ref();
        let path = match PathAndQuery::try_from(text.as_str()) {
            Ok(p) if text.starts_with('/') => Some(p),
            _ => {
                self.problem(
                    m.path.span(),
                    format!("health_check path {text:?} must be a path such as \"/healthz\""),
                );
                None
            }
        };
        let every = self.interval(m.every.as_ref(), "health_check every", DEFAULT_CHECK_EVERY);
        let timeout = self.optional_duration(
            m.timeout.as_ref(),
            "health_check timeout",
            DEFAULT_CHECK_TIMEOUT,
        );
        let unhealthy_after = self.bounded(
            m.unhealthy_after.as_ref(),
            2,
            1..=100,
            "unhealthy_after must be a whole number of checks from 1 to 100",
        );
        let healthy_after = self.bounded(
            m.healthy_after.as_ref(),
            2,
            1..=100,
            "healthy_after must be a whole number of checks from 1 to 100",
        );
        Some(Check {
            path: path?,
            every: every?,
            timeout: timeout?,
            unhealthy_after: u32::try_from(unhealthy_after?).unwrap_or(2),
            healthy_after: u32::try_from(healthy_after?).unwrap_or(2),
        })
    }

    /// One endpoint of an `[upstreams.NAME]`, at `scheme://authority`.
    fn endpoint(
        &mut self,
        name: &str,
        m: &UpstreamModel,
        scheme: Scheme,
        authority: Authority,
        defaults: Defaults,
    ) -> Option<Endpoint> {
        let https = scheme == Scheme::HTTPS;
        let protocol = self.protocol(m.protocol.as_ref(), https)?;
        let tls = if https {
            Some(self.upstream_tls(name, m, &authority, protocol)?)
        } else {
            self.no_tls_keys(name, m)?;
            None
        };
        let mut endpoint = self.compiled(scheme, authority, protocol, tls, defaults);
        endpoint.preserve_host = m.preserve_host;
        endpoint.forwarding = Forwarding {
            forwarded: m.forwarded,
            via: m.via,
        };
        Some(endpoint)
    }

    /// `protocol`, one an `https://` (or a plain) upstream can speak;
    /// without it, `auto` over TLS and HTTP/1.1 without.
    fn protocol(&mut self, protocol: Option<&Spanned<String>>, https: bool) -> Option<Protocol> {
        let Some(p) = protocol else {
            return Some(if https {
                Protocol::Auto
            } else {
                Protocol::Http1
            });
        };
        let chosen = self.choice(Some(p), "protocol", &Protocol::NAMES)?;
        match (chosen, https) {
            (Protocol::H2c, true) => {
                self.problem(
                    p.span(),
                    "protocol \"h2c\" is HTTP/2 without TLS; an https:// upstream speaks \"h2\" (or \"auto\")",
                );
                None
            }
            (Protocol::H2 | Protocol::Auto, false) => {
                self.problem(
                    p.span(),
                    "protocol \"h2\" and \"auto\" need an https:// upstream; HTTP/2 without TLS is \"h2c\"",
                );
                None
            }
            (chosen, _) => Some(chosen),
        }
    }

    /// A plain upstream has no TLS keys to set.
    fn no_tls_keys(&mut self, name: &str, m: &UpstreamModel) -> Option<()> {
        let tls_keys = [&m.server_name, &m.ca_file, &m.cert_file, &m.key_file];
        if let Some(key) = tls_keys.iter().copied().flatten().next() {
            self.problem(
                key.span(),
                format!("upstream {name:?} is not https://, so it has no TLS to set up"),
            );
            return None;
        }
        Some(())
    }

    /// TLS to an `https://` upstream: its files read now, so that a bad
    /// one is refused with its key's place.
    fn upstream_tls(
        &mut self,
        name: &str,
        m: &UpstreamModel,
        authority: &Authority,
        protocol: Protocol,
    ) -> Option<UpstreamTls> {
        if m.cert_file.is_some() != m.key_file.is_some() {
            let span = m
                .cert_file
                .as_ref()
                .or(m.key_file.as_ref())
                .map_or(0..0, Spanned::span);
            self.problem(span, "cert_file and key_file go together");
            return None;
        }
        let files = UpstreamTlsFiles {
            ca_file: m.ca_file.as_ref().map(|p| self.resolve(p)),
            cert_file: m.cert_file.as_ref().map(|p| self.resolve(p)),
            key_file: m.key_file.as_ref().map(|p| self.resolve(p)),
        };
        let server_name = m
            .server_name
            .as_ref()
            .map_or_else(|| authority.host().to_owned(), |n| n.get_ref().clone());
        match UpstreamTls::new(files.clone(), &server_name, protocol) {
            Ok(tls) => Some(tls),
            Err(e) => {
                let span = match &e {
                    TlsError::Read { path, .. }
                    | TlsError::NoPem { path, .. }
                    | TlsError::UpstreamCa { path, .. }
                    | TlsError::ClientCa { path, .. } => {
                        if Some(path) == files.ca_file.as_ref() {
                            m.ca_file.as_ref().map(Spanned::span)
                        } else if Some(path) == files.key_file.as_ref() {
                            m.key_file.as_ref().map(Spanned::span)
                        } else {
                            m.cert_file.as_ref().map(Spanned::span)
                        }
                    }
                    TlsError::Certificate { .. } => m.cert_file.as_ref().map(Spanned::span),
                    TlsError::ServerName { .. } => m.server_name.as_ref().map(Spanned::span),
                }
                .or_else(|| m.url.as_ref().map(Spanned::span))
                .unwrap_or(0..0);
                self.problem(span, format!("[upstreams.{name}]: {e}"));
                None
            }
        }
    }

    /// A route's `upstream`: a URL, or the name of an `[upstreams.NAME]`.
    /// Routes that give the same URL or name share one upstream, and with
    /// it its endpoints' health.
    pub(super) fn route_upstream(
        &mut self,
        u: &Spanned<String>,
        named: &NamedUpstreams,
        defaults: Defaults,
        timeout: Duration,
    ) -> Option<Upstream> {
        let text = u.get_ref();
        if let Some(&index) = self.upstream_index.get(text) {
            return Some(Upstream { index, timeout });
        }
        let upstream = if text.contains("://") {
            let (scheme, authority) = self.url(u)?;
            let https = scheme == Scheme::HTTPS;
            let (protocol, tls) = if https {
                match UpstreamTls::new(
                    UpstreamTlsFiles::default(),
                    authority.host(),
                    Protocol::Auto,
                ) {
                    Ok(tls) => (Protocol::Auto, Some(tls)),
                    Err(e) => {
                        self.problem(u.span(), format!("upstream {text:?}: {e}"));
                        return None;
                    }
                }
            } else {
                (Protocol::Http1, None)
            };
            let endpoint = self.compiled(scheme, authority, protocol, tls, defaults);
            settings::Upstream {
                name: text.as_str().into(),
                endpoints: vec![endpoint],
                balance: Balance::LeastInFlight,
                eject_after: 3,
                eject_for: DEFAULT_EJECT_FOR,
                resolve_every: DEFAULT_RESOLVE_EVERY,
                check: None,
            }
        } else {
            match named.get(text.as_str()) {
                Some(Some(upstream)) => upstream.clone(),
                // Already reported.
                Some(None) => return None,
                None => {
                    let mut names: Vec<&str> = named.keys().map(String::as_str).collect();
                    names.sort_unstable();
                    let known = if names.is_empty() {
                        "there is no [upstreams.NAME] section".to_owned()
                    } else {
                        format!("the named ones are {}", names.join(", "))
                    };
                    let hint = if text.parse::<Authority>().is_ok_and(|a| a.port().is_some()) {
                        format!("; did you mean \"http://{text}\"?")
                    } else {
                        super::problems::closest(text, names.iter().copied())
                            .map(|near| format!("; did you mean {near:?}?"))
                            .unwrap_or_default()
                    };
                    self.problem(
                        u.span(),
                        format!(
                            "upstream {text:?} is neither a URL such as \"http://host:port\" nor a named upstream ({known}){hint}"
                        ),
                    );
                    return None;
                }
            }
        };
        let index = self.upstreams.len();
        self.upstreams.push(upstream);
        self.upstream_index.insert(text.clone(), index);
        Some(Upstream { index, timeout })
    }

    /// An `http://` or `https://` URL with no path: its scheme and address.
    fn url(&mut self, u: &Spanned<String>) -> Option<(Scheme, Authority)> {
        let text = u.get_ref();
        let uri: Uri = match text.parse() {
            Ok(uri) => uri,
            Err(e) => {
                self.problem(u.span(), format!("upstream {text:?} is not a URL: {e}"));
                return None;
            }
        };
        let scheme = match uri.scheme() {
            Some(s) if *s == Scheme::HTTP || *s == Scheme::HTTPS => s.clone(),
            _ => {
                self.problem(
                    u.span(),
                    format!("upstream {text:?} must be an http:// or https:// URL"),
                );
                return None;
            }
        };
        let has_path = uri.path_and_query().is_some_and(|p| p.as_str() != "/");
        if has_path {
            self.problem(
                u.span(),
                format!(
                    "upstream {text:?} has a path or query; give only scheme, host and port (the request's path is kept)"
                ),
            );
            return None;
        }
        let Some(authority) = uri.authority().cloned() else {
            self.problem(u.span(), format!("upstream {text:?} names no host"));
            return None;
        };
        if authority.as_str().contains('@') {
            self.problem(
                u.span(),
                format!("upstream {text:?} has user information; give only scheme, host and port"),
            );
            return None;
        }
        Some((scheme, authority))
    }

    fn compiled(
        &self,
        scheme: Scheme,
        authority: Authority,
        protocol: Protocol,
        tls: Option<UpstreamTls>,
        defaults: Defaults,
    ) -> Endpoint {
        let server_name = tls
            .as_ref()
            .map(|t| format!("{:?}", t.server_name))
            .unwrap_or_default();
        let files = tls
            .as_ref()
            .map(|t| format!("{:?}", t.files))
            .unwrap_or_default();
        Endpoint {
            target: format!("{scheme}://{authority}").into(),
            pool_key: format!("{scheme}://{authority} {protocol:?} {server_name} {files}").into(),
            host_header: HeaderValue::from_str(authority.as_str())
                .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
            preserve_host: false,
            forwarding: Forwarding::default(),
            scheme,
            authority,
            protocol,
            tls: tls.map(Arc::new),
            connect_timeout: defaults.connect_timeout,
            body_timeout: defaults.body_timeout,
        }
    }

    /// A file named in the configuration, relative to the file's folder.
    pub(super) fn resolve(&self, path: &Spanned<String>) -> PathBuf {
        self.path.parent().map_or_else(
            || PathBuf::from(path.get_ref()),
            |dir| dir.join(path.get_ref()),
        )
    }
}
