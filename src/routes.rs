//! The compiled rule table: which route a request belongs to.
//!
//! Routes are tried in file order and the first match wins. Matching happens
//! on a normalised path (see [`normalize_path`]) so that `/api/../login`,
//! `//login` and `/%6Cogin` all meet the `/login` route's limit.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{HeaderValue, Method, StatusCode};

use crate::client::ClientRule;
use crate::limit::Limit;
use crate::proxy::pool::PoolSlot;
use ipnet::IpNet;

/// The compiled routes of one configuration, in file order.
#[derive(Debug, Clone, Default)]
pub struct Table {
    routes: Vec<Arc<Route>>,
}

/// One `[[routes]]` entry, compiled.
#[derive(Debug, Clone)]
pub struct Route {
    /// Unique name, used in keys, logs, metrics and headers.
    pub name: Arc<str>,
    /// Which requests belong to this route.
    pub matcher: Match,
    /// What an allowed request gets.
    pub action: Action,
    /// How the client is identified.
    pub client: ClientRule,
    /// Units one request consumes.
    pub cost: u64,
    /// Count and annotate, but never reject.
    pub shadow: bool,
    /// All must allow; empty means the route is not limited.
    pub limits: Vec<Limit>,
    /// The policy name of each limit, as sent in `RateLimit` headers.
    pub policy_names: Vec<String>,
    /// The `RateLimit-Policy` value, computed once at load.
    pub policy_header: Option<HeaderValue>,
    /// Clients in these networks bypass the limits (`[server]`'s and the
    /// route's own `exempt`).
    pub exempt: Vec<IpNet>,
}

/// What a request must look like to belong to a route.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// Segment-wise prefix of the normalised path (`/api` matches `/api/x`, not `/apix`).
    pub path_prefix: Option<String>,
    /// Exact normalised path.
    pub path: Option<String>,
    /// Allowed methods; empty means any.
    pub methods: Vec<Method>,
    /// Host, compared without case.
    pub host: Option<HostMatch>,
}

/// A host to match, with an optional port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMatch {
    name: String,
    port: Option<u16>,
}

/// What happens to an allowed request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Forward to an upstream server.
    Upstream(Upstream),
    /// Answer directly.
    Respond(Respond),
}

/// An upstream server.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// `host:port` to connect to.
    pub authority: Authority,
    /// The `Host` header sent upstream.
    pub host_header: HeaderValue,
    /// Deadline for the response head (504 past it).
    pub timeout: Duration,
    /// The connection pool for `authority`, remembered after the first
    /// request so later ones skip the lookup.
    pub pool: PoolSlot,
}

/// A fixed answer.
#[derive(Debug, Clone)]
pub struct Respond {
    /// Status code.
    pub status: StatusCode,
    /// Body.
    pub body: Bytes,
    /// `Content-Type` of the body.
    pub content_type: HeaderValue,
}

/// The parts of a request that decide its route.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// The method.
    pub method: &'a Method,
    /// The host from the URI authority or `Host` header, with any port.
    pub host: Option<&'a str>,
    /// The path as matched: normalised, with encoded and back slashes as `/`.
    pub path: &'a str,
}

// === impl Table ===

impl Table {
    /// Builds a table; the first route that matches a request wins.
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            routes: routes.into_iter().map(Arc::new).collect(),
        }
    }

    /// The route a request belongs to, if any, and its position.
    pub fn find(&self, request: &RequestFacts<'_>) -> Option<(usize, &Arc<Route>)> {
        self.routes
            .iter()
            .enumerate()
            .find(|(_, r)| r.matcher.matches(request))
    }

    /// All routes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.iter()
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when there is no route.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

// === impl Match ===

impl Match {
    /// Whether a request belongs here.
    pub fn matches(&self, request: &RequestFacts<'_>) -> bool {
        if !self.methods.is_empty() && !self.methods.contains(request.method) {
            return false;
        }
        if let Some(host) = &self.host
            && !request.host.is_some_and(|h| host.matches(h))
        {
            return false;
        }
        if let Some(path) = &self.path
            && path != request.path
        {
            return false;
        }
        if let Some(prefix) = &self.path_prefix
            && !segment_prefix(prefix, request.path)
        {
            return false;
        }
        true
    }

    /// Whether every request `later` matches is matched by `self` too, which
    /// makes a route with `later` unreachable behind one with `self`.
    pub fn covers(&self, later: &Match) -> bool {
        let host = match (&self.host, &later.host) {
            (None, _) => true,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        let methods = self.methods.is_empty()
            || (!later.methods.is_empty()
                && later.methods.iter().all(|m| self.methods.contains(m)));
        let path = match (&self.path_prefix, &self.path) {
            (None, None) => true,
            (Some(p), _) => match (&later.path_prefix, &later.path) {
                (Some(q), _) | (None, Some(q)) => segment_prefix(p, q),
                (None, None) => p == "/",
            },
            (None, Some(x)) => later.path.as_ref() == Some(x),
        };
        host && methods && path
    }
}

/// `prefix` matches whole segments of `path`: `/api` matches `/api` and
/// `/api/x`, never `/apix`.
fn segment_prefix(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

// === impl HostMatch ===

impl HostMatch {
    /// Parses `name` or `name:port`; `None` when it is not a host.
    pub fn parse(s: &str) -> Option<Self> {
        let authority: Authority = s.parse().ok()?;
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return None;
        }
        Some(Self {
            name: authority.host().to_ascii_lowercase(),
            port: authority.port_u16(),
        })
    }

    /// Case-insensitive; the port counts only when the rule names one.
    fn matches(&self, request_host: &str) -> bool {
        let (name, port) = split_host_port(request_host);
        name.eq_ignore_ascii_case(&self.name)
            && match self.port {
                None => true,
                Some(p) => port.unwrap_or(80) == p,
            }
    }
}

fn split_host_port(host: &str) -> (&str, Option<u16>) {
    let host = host.strip_suffix('.').unwrap_or(host);
    if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return match rest.split_once(']') {
            Some((name, tail)) => (name, tail.strip_prefix(':').and_then(|p| p.parse().ok())),
            None => (host, None),
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => {
            let name = name.strip_suffix('.').unwrap_or(name);
            (name, port.parse().ok())
        }
        _ => (host, None),
    }
}

// === path normalisation ===

/// Why a request path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// A `%` not followed by two hex digits.
    #[error("malformed percent-encoding in the request path")]
    BadEscape,
    /// Not an absolute path (`*`, or no leading `/`).
    #[error("the request path must start with '/'")]
    NotAbsolute,
}

/// Normalises a request path for matching and forwarding: percent-encoded
/// unreserved characters are decoded, other escapes get upper-case hex,
/// dot-segments are removed (RFC 3986 §5.2.4) and repeated slashes
/// collapsed. Returns the input borrowed when it is already normal.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    match normalize(path, false) {
        Ok(p) => p,
        Err(_) => Cow::Borrowed(path),
    }
}

/// The forwarded path and the matched path of a request.
///
/// The matched path additionally reads `%2F`, `%5C` and `\` as `/`, so an
/// encoded separator cannot carry a request past a route that an upstream
/// decoding it would serve; the forwarded path keeps them as sent.
pub fn request_paths(path: &str) -> Result<(Cow<'_, str>, Cow<'_, str>), PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    let forward = normalize(path, false)?;
    let matched = match &forward {
        Cow::Borrowed(p) => normalize(p, true)?,
        Cow::Owned(p) => Cow::Owned(normalize(p, true)?.into_owned()),
    };
    Ok((forward, matched))
}

/// Whether `path` has anything [`normalize`] changes: an escape, a
/// backslash (when `separators`), `//`, or a `.` or `..` segment. One pass,
/// as this runs twice on every request.
fn needs_work(path: &str, separators: bool) -> bool {
    let b = path.as_bytes();
    b.iter().enumerate().any(|(i, &c)| match c {
        b'%' => true,
        b'\\' => separators,
        b'/' => matches!(
            &b[i + 1..],
            [b'/', ..] | [b'.'] | [b'.', b'/', ..] | [b'.', b'.'] | [b'.', b'.', b'/', ..]
        ),
        _ => false,
    })
}

fn normalize(path: &str, separators: bool) -> Result<Cow<'_, str>, PathError> {
    if !needs_work(path, separators) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path, separators)?;
    let trailing_slash =
        decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

fn decode_unreserved(path: &str, separators: bool) -> Result<String, PathError> {
    let b = path.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hi = b
                .get(i + 1)
                .and_then(|c| hex(*c))
                .ok_or(PathError::BadEscape)?;
            let lo = b
                .get(i + 2)
                .and_then(|c| hex(*c))
                .ok_or(PathError::BadEscape)?;
            let byte = hi << 4 | lo;
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                out.push(byte);
            } else if separators && matches!(byte, b'/' | b'\\') {
                out.push(b'/');
            } else {
                out.extend([b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]);
            }
            i += 3;
        } else {
            out.push(if separators && c == b'\\' { b'/' } else { c });
            i += 1;
        }
    }
    // Only ASCII was decoded or replaced, so the bytes are still UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_tricks_all_normalise_to_the_same_matched_path() {
        for trick in [
            "/login",
            "//login",
            "/./login",
            "/api/../login",
            "/%6Cogin",
            "/%6cogin",
            "/a/b/../../login",
            "/../login",
            "/login/.",
        ] {
            let (_, matched) = request_paths(trick)
                .map_err(|e| format!("{trick}: {e}"))
                .unwrap_or_default();
            let matched = matched.trim_end_matches('/');
            assert_eq!(matched, "/login", "{trick:?}");
        }
    }

    #[test]
    fn encoded_separators_match_as_slashes_but_are_forwarded_as_sent() {
        let (forward, matched) = request_paths("/login%2fadmin").unwrap_or_default();
        assert_eq!(forward, "/login%2Fadmin");
        assert_eq!(matched, "/login/admin");
        let (forward, matched) = request_paths("/login\\admin").unwrap_or_default();
        assert_eq!(forward, "/login\\admin");
        assert_eq!(matched, "/login/admin");
    }

    #[test]
    fn malformed_escapes_and_relative_paths_are_refused() {
        assert_eq!(request_paths("/a%zz").err(), Some(PathError::BadEscape));
        assert_eq!(request_paths("/a%4").err(), Some(PathError::BadEscape));
        assert_eq!(request_paths("*").err(), Some(PathError::NotAbsolute));
    }

    #[test]
    fn needs_work_spots_exactly_what_normalising_changes() {
        // The plain definition, checked against the one-pass scan on every
        // path of up to six characters from the alphabet that matters.
        let reference = |path: &str, separators: bool| {
            path.contains('%')
                || (separators && path.contains('\\'))
                || path.contains("//")
                || path.contains("/./")
                || path.contains("/../")
                || path.ends_with("/.")
                || path.ends_with("/..")
        };
        let alphabet = ['/', '.', 'a', '%', '\\'];
        let mut paths = vec![String::new()];
        let mut checked = 0;
        for _ in 0..6 {
            paths = paths
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            for path in &paths {
                for separators in [false, true] {
                    assert_eq!(
                        needs_work(path, separators),
                        reference(path, separators),
                        "{path:?} separators={separators}"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 2 * (5 + 25 + 125 + 625 + 3125 + 15625));
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize_path("/api/v1/users"), Cow::Borrowed(_)));
    }

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(segment_prefix("/login", "/login"));
        assert!(segment_prefix("/login", "/login/x"));
        assert!(!segment_prefix("/login", "/loginx"));
        assert!(segment_prefix("/", "/anything"));
        assert!(segment_prefix("/api/", "/api/x"));
    }

    #[test]
    fn hosts_match_without_case_and_port_unless_named() {
        let any_port = HostMatch::parse("API.example.com").unwrap_or_else(|| unreachable!());
        assert!(any_port.matches("api.EXAMPLE.com"));
        assert!(any_port.matches("api.example.com:8443"));
        assert!(!any_port.matches("example.com"));
        let port = HostMatch::parse("api.example.com:8443").unwrap_or_else(|| unreachable!());
        assert!(port.matches("api.example.com:8443"));
        assert!(!port.matches("api.example.com:9000"));
        assert!(!port.matches("api.example.com"));
    }
}
