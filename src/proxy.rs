//! Forwarding an allowed request to its upstream and streaming the answer back.
//!
//! Bodies stream both ways (nothing is buffered whole), hop-by-hop headers are
//! dropped in both directions, and the upstream learns who asked through
//! `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host`.

use std::net::SocketAddr;
use std::time::Instant;

use http::header::{CONNECTION, HOST, HeaderName};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Response, StatusCode, Uri, request};
use http_body_util::Either;
use hyper::body::Incoming;

use crate::refusal::Refusal;
use crate::response::{self, Body};
use crate::routes::Upstream;

pub mod http1;
pub mod pool;

use pool::{Pools, SendError};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The client end of a connection, with its address already written the way
/// `X-Forwarded-For` carries it: once per connection, not per request.
#[derive(Debug)]
pub struct Peer {
    /// The connection's remote address.
    pub addr: SocketAddr,
    forwarded: Option<HeaderValue>,
    /// `X-Forwarded-Proto`: `https` on the TLS listener.
    proto: &'static HeaderValue,
}

static HTTP: HeaderValue = HeaderValue::from_static("http");
static HTTPS: HeaderValue = HeaderValue::from_static("https");

impl Peer {
    /// The peer at `addr`, connected over TLS or not.
    pub fn new(addr: SocketAddr, tls: bool) -> Self {
        let forwarded = response::header_value(format_args!("{}", addr.ip().to_canonical()));
        Self {
            addr,
            forwarded,
            proto: if tls { &HTTPS } else { &HTTP },
        }
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

    /// Forwards the request with head `request` and `body` to `upstream` as
    /// `path_and_query`, on behalf of `peer`; `now` is when forwarding began
    /// (the upstream timeout runs from it). The head's header map is taken
    /// for the answer's fields. Upstream trouble is a 502 or 504 refusal; a
    /// request body that breaks off is the client's 400.
    pub async fn forward(
        &self,
        upstream: &Upstream,
        request: &mut request::Parts,
        body: Incoming,
        path_and_query: PathAndQuery,
        peer: &Peer,
        now: Instant,
    ) -> Result<Response<Body>, Refusal> {
        let original_host = request
            .uri
            .authority()
            .map(|a| HeaderValue::from_str(a.as_str()))
            .and_then(Result::ok)
            .or_else(|| request.headers.get(HOST).cloned());
        // Origin form on the wire: the connection already names the host.
        request.uri = Uri::from(path_and_query);
        let headers = &request.headers;
        let rewrite = Rewrite {
            named: connection_named(headers),
            host: &upstream.host_header,
            forwarded_for: forwarded_for(headers, peer),
            forwarded_proto: peer.proto,
            forwarded_host: original_host,
        };

        let pool = self.pools.get_in(&upstream.pool, &upstream.authority);
        // The caller's clock reading serves the deadline and the pool's idle
        // bookkeeping: no more reads of the clock per request.
        let deadline = tokio::time::Instant::from_std(now) + upstream.timeout;
        match pool.send(request, body, &rewrite, now, deadline).await {
            // proxy::http1 leaves the upstream's hop-by-hop fields out.
            Ok(upstream_response) => Ok(upstream_response.map(Either::Left)),
            Err(SendError::Connect(e)) => {
                tracing::warn!(upstream = %upstream.authority, error = %e, "upstream unreachable");
                Err(Refusal::upstream(
                    StatusCode::BAD_GATEWAY,
                    "the upstream is unreachable",
                ))
            }
            // The client's fault, not the upstream's: its body was
            // malformed, or it went away while sending it.
            Err(SendError::Failed(http1::Error::RequestBody(e))) => {
                tracing::debug!(upstream = %upstream.authority, error = %e, "the request body broke off");
                Err(Refusal::client(
                    StatusCode::BAD_REQUEST,
                    "the request body is malformed or incomplete",
                ))
            }
            Err(e @ SendError::Failed(_)) => {
                tracing::warn!(upstream = %upstream.authority, error = %e, "upstream failed");
                Err(Refusal::upstream(
                    StatusCode::BAD_GATEWAY,
                    "the upstream failed to answer",
                ))
            }
            Err(SendError::TimedOut) => {
                tracing::warn!(
                    upstream = %upstream.authority,
                    timeout = ?upstream.timeout,
                    "upstream timed out"
                );
                Err(Refusal::upstream(
                    StatusCode::GATEWAY_TIMEOUT,
                    "the upstream did not answer in time",
                ))
            }
        }
    }
}

/// Whether `name` is a hop-by-hop field (RFC 9110 §7.6.1) that every
/// message drops, whatever its `Connection` names: a match on the text,
/// which the compiler turns into a switch on length and a comparison or two.
pub(crate) fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
    )
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
pub struct Rewrite<'a> {
    /// Headers the request's `Connection` names, dropped besides the
    /// standard hop-by-hop ones.
    named: Vec<HeaderName>,
    /// The upstream's own address.
    host: &'a HeaderValue,
    /// Earlier `X-Forwarded-For` values folded into one, then the peer.
    forwarded_for: Option<HeaderValue>,
    /// `http` or `https`: how the client reached floodgate.
    forwarded_proto: &'a HeaderValue,
    /// The host the client asked for.
    forwarded_host: Option<HeaderValue>,
}

impl Rewrite<'_> {
    /// Whether the client's `name` field goes upstream: not if it is
    /// hop-by-hop, or one of the fields [`Rewrite::added`] writes instead.
    pub fn keeps(&self, name: &HeaderName) -> bool {
        match name.as_str() {
            "host" | "x-forwarded-for" | "x-forwarded-proto" | "x-forwarded-host" => false,
            other => !is_hop_by_hop(other) && !self.named.contains(name),
        }
    }

    /// The fields written after the client's own: `Host` and
    /// `X-Forwarded-*`.
    pub fn added(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        [
            ("host", Some(self.host)),
            ("x-forwarded-for", self.forwarded_for.as_ref()),
            ("x-forwarded-proto", Some(self.forwarded_proto)),
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
    fn hop_by_hop_fields_and_the_ones_connection_names_stay_behind() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, X-Secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("proxy-authorization", HeaderValue::from_static("Basic x"));
        h.insert("te", HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        let rewrite = Rewrite {
            named: connection_named(&h),
            host: &HeaderValue::from_static("upstream:80"),
            forwarded_for: None,
            forwarded_proto: &HTTP,
            forwarded_host: None,
        };
        let kept: Vec<&str> = h
            .keys()
            .filter(|name| rewrite.keeps(name))
            .map(HeaderName::as_str)
            .collect();
        assert_eq!(kept, ["x-kept"]);

        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("Keep-Alive"));
        assert!(connection_named(&h).is_empty());
    }

    #[test]
    fn every_hop_by_hop_name_is_known() {
        for name in [
            CONNECTION,
            HeaderName::from_static("keep-alive"),
            HeaderName::from_static("proxy-connection"),
            http::header::PROXY_AUTHENTICATE,
            http::header::PROXY_AUTHORIZATION,
            http::header::TE,
            http::header::TRAILER,
            http::header::TRANSFER_ENCODING,
            http::header::UPGRADE,
        ] {
            assert!(is_hop_by_hop(name.as_str()), "{name}");
        }
        assert!(!is_hop_by_hop("content-length"));
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.1"));
        h.append(&X_FORWARDED_FOR, HeaderValue::from_static("10.0.0.1"));
        let peer = Peer::new("[::ffff:192.0.2.7]:4000".parse().expect("address"), false);
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
