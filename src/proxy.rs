//! Forwarding an allowed request to its upstream and streaming the answer back.
//!
//! Bodies stream both ways (nothing is buffered whole), hop-by-hop headers are
//! dropped in both directions, and the upstream learns who asked through
//! `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host`.

use std::net::SocketAddr;
use std::time::Instant;

use http::header::{CONNECTION, HOST, HeaderName, TE, TRAILER, TRANSFER_ENCODING, UPGRADE};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri, Version};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::response::{self, Body};
use crate::routes::Upstream;

pub mod http1;
pub mod pool;

use pool::{Pools, SendError};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
static PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
static PROXY_AUTHENTICATE: HeaderName = HeaderName::from_static("proxy-authenticate");
static PROXY_AUTHORIZATION: HeaderName = HeaderName::from_static("proxy-authorization");

/// The client end of a connection, with its address already written the way
/// `X-Forwarded-For` carries it: once per connection, not per request.
#[derive(Debug)]
pub struct Peer {
    /// The connection's remote address.
    pub addr: SocketAddr,
    forwarded: Option<HeaderValue>,
}

impl Peer {
    /// The peer at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        let forwarded = response::header_value(format_args!("{}", addr.ip().to_canonical()));
        Self { addr, forwarded }
    }
}

/// Sends requests to upstreams over pooled keep-alive connections.
#[derive(Debug, Default)]
pub struct Forwarder {
    pools: Pools,
}

impl Forwarder {
    /// A forwarder with no connections yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Closes idle connections that have outlived their keep-alive time.
    pub fn sweep(&self) {
        self.pools.sweep();
    }

    /// Forwards `request` to `upstream` as `path_and_query`, on behalf of
    /// `peer`; `now` is when forwarding began (the upstream timeout runs
    /// from it). Never fails: upstream trouble becomes 502 or 504.
    pub async fn forward(
        &self,
        upstream: &Upstream,
        mut request: Request<Incoming>,
        path_and_query: PathAndQuery,
        peer: &Peer,
        now: Instant,
    ) -> Response<Body> {
        let original_host = request
            .uri()
            .authority()
            .map(|a| HeaderValue::from_str(a.as_str()))
            .and_then(Result::ok)
            .or_else(|| request.headers().get(HOST).cloned());
        // Origin form on the wire: the connection already names the host.
        *request.uri_mut() = Uri::from(path_and_query);
        *request.version_mut() = Version::HTTP_11;
        let headers = request.headers();
        let rewrite = Rewrite {
            named: connection_named(headers),
            host: upstream.host_header.clone(),
            forwarded_for: forwarded_for(headers, peer),
            forwarded_host: original_host,
        };

        let pool = self.pools.get_in(&upstream.pool, &upstream.authority);
        // The caller's clock reading serves the deadline and the pool's idle
        // bookkeeping: no more reads of the clock per request.
        let deadline = tokio::time::Instant::from_std(now) + upstream.timeout;
        let answer = tokio::time::timeout_at(deadline, pool.send(request, &rewrite, now)).await;
        match answer {
            Ok(Ok(mut upstream_response)) => {
                strip_hop_by_hop(upstream_response.headers_mut());
                upstream_response.map(Either::Left)
            }
            Ok(Err(SendError::Connect(e))) => {
                tracing::warn!(upstream = %upstream.authority, error = %e, "upstream unreachable");
                response::text(StatusCode::BAD_GATEWAY, "upstream unreachable\n")
            }
            Ok(Err(e)) => {
                tracing::warn!(upstream = %upstream.authority, error = %e, "upstream failed");
                response::text(StatusCode::BAD_GATEWAY, "upstream failed to answer\n")
            }
            Err(_) => {
                tracing::warn!(
                    upstream = %upstream.authority,
                    timeout = ?upstream.timeout,
                    "upstream timed out"
                );
                response::text(StatusCode::GATEWAY_TIMEOUT, "upstream timed out\n")
            }
        }
    }
}

/// Hop-by-hop headers (RFC 9110 §7.6.1) that are not named in `Connection`.
static HOP_BY_HOP: [&HeaderName; 9] = [
    &CONNECTION,
    &KEEP_ALIVE,
    &PROXY_CONNECTION,
    &PROXY_AUTHENTICATE,
    &PROXY_AUTHORIZATION,
    &TE,
    &TRAILER,
    &TRANSFER_ENCODING,
    &UPGRADE,
];

/// Where `name` is in [`HOP_BY_HOP`]: a match on the text, which the
/// compiler turns into a switch on length and a comparison or two.
fn hop_by_hop_index(name: &str) -> Option<usize> {
    Some(match name {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "proxy-authenticate" => 3,
        "proxy-authorization" => 4,
        "te" => 5,
        "trailer" => 6,
        "transfer-encoding" => 7,
        "upgrade" => 8,
        _ => return None,
    })
}

/// Removes the headers that describe one connection rather than the message
/// (RFC 9110 §7.6.1), including any that `Connection` names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names, noting which hop-by-hop headers are present:
    // most messages carry none or only `Connection: keep-alive`, and a miss
    // costs no hashing.
    let mut present = 0u16;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name.as_str()) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    // `Connection` is HOP_BY_HOP[0].
    let named = if present & 1 != 0 {
        connection_named(headers)
    } else {
        Vec::new()
    };
    for name in named {
        headers.remove(name);
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(*name);
        }
    }
}

/// Headers that `headers`' `Connection` fields name, to be dropped with the
/// standard hop-by-hop ones (rare: `close` and `keep-alive` are not header
/// names, and most messages say only one of those two, which is answered
/// without parsing a list).
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    let mut named = Vec::new();
    for value in headers.get_all(CONNECTION) {
        let bytes = value.as_bytes();
        if bytes.eq_ignore_ascii_case(b"keep-alive") || bytes.eq_ignore_ascii_case(b"close") {
            continue;
        }
        named.extend(
            value
                .to_str()
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .filter(|t| {
                    !t.eq_ignore_ascii_case("close") && !t.eq_ignore_ascii_case("keep-alive")
                })
                .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok()),
        );
    }
    named
}

/// How a request's header section changes on its way upstream. It is
/// applied as the request head is written, so the client's header map is
/// not edited (each edit of a header map hashes and may grow it).
#[derive(Debug)]
pub struct Rewrite {
    /// Headers the request's `Connection` names, dropped besides the
    /// standard hop-by-hop ones.
    named: Vec<HeaderName>,
    /// The upstream's own address.
    host: HeaderValue,
    /// Earlier `X-Forwarded-For` values folded into one, then the peer.
    forwarded_for: Option<HeaderValue>,
    /// The host the client asked for.
    forwarded_host: Option<HeaderValue>,
}

static FORWARDED_PROTO: HeaderValue = HeaderValue::from_static("http");

impl Rewrite {
    /// Whether the client's `name` field goes upstream: not if it is
    /// hop-by-hop, or one of the fields [`Rewrite::added`] writes instead.
    pub fn keeps(&self, name: &HeaderName) -> bool {
        match name.as_str() {
            "host" | "x-forwarded-for" | "x-forwarded-proto" | "x-forwarded-host" => false,
            other => hop_by_hop_index(other).is_none() && !self.named.contains(name),
        }
    }

    /// The fields written after the client's own: `Host` and
    /// `X-Forwarded-*`.
    pub fn added(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        [
            ("host", Some(&self.host)),
            ("x-forwarded-for", self.forwarded_for.as_ref()),
            ("x-forwarded-proto", Some(&FORWARDED_PROTO)),
            ("x-forwarded-host", self.forwarded_host.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value?)))
    }
}

/// `X-Forwarded-For` for the upstream: the request's earlier values folded
/// into one, then `peer`.
fn forwarded_for(headers: &HeaderMap, peer: &Peer) -> Option<HeaderValue> {
    let own = peer.forwarded.as_ref();
    let mut earlier = headers.get_all(&X_FORWARDED_FOR).iter();
    match (earlier.next(), earlier.next(), own) {
        (None, _, own) => own.cloned(),
        (Some(one), None, None) => Some(one.clone()),
        (Some(one), None, Some(own)) => match one.to_str() {
            // An address is ASCII, so `own` always reads as text.
            Ok(s) => {
                response::header_value(format_args!("{s}, {}", own.to_str().unwrap_or_default()))
            }
            Err(_) => Some(own.clone()),
        },
        _ => {
            let values = headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .chain(own)
                .filter_map(|v| v.to_str().ok())
                .collect::<Vec<_>>();
            if values.is_empty() {
                return None;
            }
            response::header_value(format_args!("{}", values.join(", ")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_named_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));

        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("Keep-Alive"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn every_hop_by_hop_name_is_found_at_its_place() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name.as_str()), Some(i), "{name}");
        }
        assert_eq!(hop_by_hop_index("content-length"), None);
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.1"));
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        let peer = Peer::new("[::ffff:192.0.2.7]:4000".parse().expect("address"));
        assert_eq!(
            forwarded_for(&h, &peer).as_ref().map(HeaderValue::as_bytes),
            Some(&b"203.0.113.1, 10.0.0.1, 192.0.2.7"[..])
        );
        h.remove(&X_FORWARDED_FOR);
        assert_eq!(
            forwarded_for(&h, &peer).as_ref().map(HeaderValue::as_bytes),
            Some(&b"192.0.2.7"[..])
        );
        h.insert(&X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.1"));
        assert_eq!(
            forwarded_for(&h, &peer).as_ref().map(HeaderValue::as_bytes),
            Some(&b"203.0.113.1, 192.0.2.7"[..])
        );
    }
}
