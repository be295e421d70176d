//! The request's and the answer's header fields on their way through:
//! hop-by-hop fields dropped both ways, the upstream's `Host`, and the
//! forwarding fields that tell the upstream who asked (`X-Forwarded-*`,
//! and where an upstream asks for them RFC 7239 `Forwarded` and `Via`).

use std::net::SocketAddr;

use http::header::Entry;
use http::header::{CONNECTION, FORWARDED, HOST, HeaderName, TE, UPGRADE, VIA};
use http::{HeaderMap, HeaderValue, Version, request};

use super::settings::Endpoint;
use crate::response;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static TRAILERS: HeaderValue = HeaderValue::from_static("trailers");
pub(super) static UPGRADE_OPTION: HeaderValue = HeaderValue::from_static("upgrade");

/// The client end of a connection, with its address already written the way
/// `X-Forwarded-For` carries it: once per connection, not per request.
#[derive(Debug)]
pub struct Peer {
    /// The connection's remote address.
    pub addr: SocketAddr,
    forwarded: Option<HeaderValue>,
    /// `X-Forwarded-Proto`: `https` on the TLS listener.
    proto: &'static HeaderValue,
    /// In `trusted_proxies` (as of the configuration in force when the
    /// connection was accepted): its `X-Forwarded-*` are believed.
    pub trusted: bool,
    /// The connection's timer for its upstream answers' heads.
    pub head_timer: super::HeadTimer,
}

static HTTP: HeaderValue = HeaderValue::from_static("http");
static HTTPS: HeaderValue = HeaderValue::from_static("https");

impl Peer {
    /// The peer at `addr`, connected over TLS or not, trusted or not.
    pub fn new(addr: SocketAddr, tls: bool, trusted: bool) -> Self {
        let forwarded = response::header_value(format_args!("{}", addr.ip().to_canonical()));
        Self {
            addr,
            forwarded,
            proto: if tls { &HTTPS } else { &HTTP },
            trusted,
            head_timer: super::HeadTimer::default(),
        }
    }
}

/// The request's header fields as they go upstream, taken from `request`:
/// without hop-by-hop fields (but an upgrade's own, and `TE: trailers`,
/// which gRPC needs), with the upstream's `Host` and `X-Forwarded-*` telling
/// who asked. Every field is looked at once, and the map is edited only
/// where it must change (each edit hashes a name).
pub(super) fn upstream_headers(
    request: &mut request::Parts,
    upstream: &Endpoint,
    peer: &Peer,
    upgrade: bool,
) -> HeaderMap {
    let mut headers = std::mem::take(&mut request.headers);
    // Destructured: the flags outlive the borrow of the map.
    let Seen {
        hop_by_hop,
        te_trailers,
        earlier_for,
        earlier_host,
        earlier_forwarded,
        earlier_proto,
        earlier_claims,
    } = Seen::of(&headers);
    // A trusted proxy's account of the client is passed on; anyone else's
    // `X-Forwarded-*` is replaced by what floodgate saw itself.
    let forwarded_for = if earlier_for && peer.trusted {
        forwarded_for(&headers, peer)
    } else {
        peer.forwarded.clone()
    };
    let forwarded_proto = match earlier_proto {
        Some(value) if peer.trusted && value == HTTPS => &HTTPS,
        Some(value) if peer.trusted && value == HTTP => &HTTP,
        _ => peer.proto,
    };
    let protocol = if upgrade {
        headers.get(UPGRADE).cloned()
    } else {
        None
    };
    if hop_by_hop {
        strip_hop_by_hop(&mut headers, false);
    }
    if earlier_claims && !peer.trusted {
        strip_client_claims(&mut headers);
    }
    let authority = request
        .uri
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok());
    let client_host = upstream_host(&mut headers, upstream, authority.as_ref());
    let forwarding = upstream.forwarding;
    let seen_host = if forwarding.forwarded {
        authority.as_ref().or(client_host.as_ref()).cloned()
    } else {
        None
    };
    let forwarded_host = if earlier_host && peer.trusted {
        None
    } else {
        authority.or(client_host)
    };
    set_forwarding(&mut headers, &X_FORWARDED_FOR, forwarded_for, earlier_for);
    headers.insert(&X_FORWARDED_PROTO, forwarded_proto.clone());
    // A trusted proxy's value stays.
    let drop_host = earlier_host && !peer.trusted;
    set_forwarding(&mut headers, &X_FORWARDED_HOST, forwarded_host, drop_host);
    // RFC 7239: a trusted proxy's elements stay and floodgate's is added
    // after them; an untrusted client's never reach the upstream.
    if earlier_forwarded && !peer.trusted {
        headers.remove(FORWARDED);
    }
    if forwarding.forwarded
        && let Some(element) = forwarded_element(peer, seen_host.as_ref())
    {
        headers.append(FORWARDED, element);
    }
    if forwarding.via {
        headers.append(VIA, via(request.version).clone());
    }
    if te_trailers {
        headers.insert(TE, TRAILERS.clone());
    }
    if let Some(protocol) = protocol {
        headers.insert(UPGRADE, protocol);
        headers.insert(CONNECTION, UPGRADE_OPTION.clone());
    }
    headers
}

/// What one look at a request's header fields finds: the forwarding
/// fields already there, the client's other claims, and hop-by-hop
/// fields (among them `TE: trailers`).
#[derive(Default)]
struct Seen<'h> {
    hop_by_hop: bool,
    te_trailers: bool,
    earlier_for: bool,
    earlier_host: bool,
    earlier_forwarded: bool,
    /// The first `X-Forwarded-Proto`.
    earlier_proto: Option<&'h HeaderValue>,
    /// Other fields that tell an upstream who the client is: passed on
    /// from trusted proxies only.
    earlier_claims: bool,
}

impl<'h> Seen<'h> {
    /// Every field of `headers` looked at once.
    fn of(headers: &'h HeaderMap) -> Self {
        let mut seen = Self::default();
        for (name, value) in headers {
            if name == FORWARDED {
                seen.earlier_forwarded = true;
            } else if name == X_FORWARDED_FOR {
                seen.earlier_for = true;
            } else if name == X_FORWARDED_HOST {
                seen.earlier_host = true;
            } else if name == X_FORWARDED_PROTO {
                seen.earlier_proto = seen.earlier_proto.or(Some(value));
            } else if claims_client(name.as_str()) {
                seen.earlier_claims = true;
            } else if is_hop_by_hop(name.as_str()) {
                seen.hop_by_hop = true;
                seen.te_trailers |= name == TE
                    && value
                        .as_bytes()
                        .split(|&b| b == b',')
                        .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"));
            }
        }
        seen
    }
}

/// The forwarding field `name` set to floodgate's `value`; without one,
/// the earlier value removed when `drop_earlier` says so.
fn set_forwarding(
    headers: &mut HeaderMap,
    name: &HeaderName,
    value: Option<HeaderValue>,
    drop_earlier: bool,
) {
    match value {
        Some(value) => {
            headers.insert(name, value);
        }
        None if drop_earlier => {
            headers.remove(name);
        }
        None => {}
    }
}

/// The upstream's `Host` in `headers` (or the client's kept, with
/// `preserve_host`; the request's `authority` where it sent none), with
/// one hash for both the client's out and the upstream's in; the
/// client's own `Host`, if it sent one.
fn upstream_host(
    headers: &mut HeaderMap,
    upstream: &Endpoint,
    authority: Option<&HeaderValue>,
) -> Option<HeaderValue> {
    match headers.entry(HOST) {
        Entry::Occupied(host) if upstream.preserve_host => Some(host.get().clone()),
        Entry::Occupied(mut host) => Some(host.insert(upstream.host_header.clone())),
        Entry::Vacant(host) => {
            let value = match authority {
                Some(a) if upstream.preserve_host => a.clone(),
                _ => upstream.host_header.clone(),
            };
            host.insert(value);
            None
        }
    }
}

/// Floodgate's element of `Forwarded` (RFC 7239 §4): who connected, over
/// what, asking for which host.
fn forwarded_element(peer: &Peer, host: Option<&HeaderValue>) -> Option<HeaderValue> {
    use std::fmt::Write;
    let mut text = match peer.addr.ip().to_canonical() {
        std::net::IpAddr::V4(ip) => format!("for={ip}"),
        std::net::IpAddr::V6(ip) => format!("for=\"[{ip}]\""),
    };
    let proto = if *peer.proto == HTTPS {
        "https"
    } else {
        "http"
    };
    let _ = write!(text, ";proto={proto}");
    if let Some(host) = host.and_then(|h| h.to_str().ok()) {
        text.push_str(";host=\"");
        for c in host.chars() {
            if c == '"' || c == '\\' {
                text.push('\\');
            }
            text.push(c);
        }
        text.push('"');
    }
    HeaderValue::from_str(&text).ok()
}

/// Whether `name` (lowercase) is a field an upstream may read as who the
/// client is, other than the `X-Forwarded-For/-Proto/-Host` and
/// `Forwarded` that floodgate writes itself: every other `X-Forwarded-*`
/// (`-Port`, `-Prefix`, `-Server`, …), `X-Real-IP`, `True-Client-IP`,
/// `X-Client-IP`.
fn claims_client(name: &str) -> bool {
    match name.as_bytes().first() {
        Some(b'x') => {
            name.starts_with("x-forwarded-") || name == "x-real-ip" || name == "x-client-ip"
        }
        Some(b't') => name == "true-client-ip",
        _ => false,
    }
}

/// Removes the fields [`claims_client`] names (an untrusted peer's claims
/// about the client), keeping floodgate's own `X-Forwarded-*`.
fn strip_client_claims(headers: &mut HeaderMap) {
    let gone: Vec<HeaderName> = headers
        .keys()
        .filter(|name| {
            claims_client(name.as_str())
                && *name != X_FORWARDED_FOR
                && *name != X_FORWARDED_PROTO
                && *name != X_FORWARDED_HOST
        })
        .cloned()
        .collect();
    for name in gone {
        headers.remove(name);
    }
}

static VIA_1_0: HeaderValue = HeaderValue::from_static("1.0 floodgate");
static VIA_1_1: HeaderValue = HeaderValue::from_static("1.1 floodgate");
static VIA_2: HeaderValue = HeaderValue::from_static("2 floodgate");

/// Floodgate's `Via` entry for a message received as `version`.
pub(super) fn via(version: Version) -> &'static HeaderValue {
    match version {
        Version::HTTP_10 | Version::HTTP_09 => &VIA_1_0,
        Version::HTTP_2 | Version::HTTP_3 => &VIA_2,
        _ => &VIA_1_1,
    }
}

/// Removes the hop-by-hop fields of `headers` and those its `Connection`
/// names; a 101 answer (`switched`) keeps its `Upgrade`. Most messages have
/// none, or only a `Connection: keep-alive` (or `close`) that names no
/// other field: those cost one look at each name and, for the second, one
/// removal, and nothing is allocated.
pub(super) fn strip_hop_by_hop(headers: &mut HeaderMap, switched: bool) {
    let (mut connection, mut others) = (false, false);
    for name in headers.keys() {
        if name == CONNECTION {
            connection = true;
        } else if is_hop_by_hop(name.as_str()) && !(switched && name == UPGRADE) {
            others = true;
        }
    }
    if !connection && !others {
        // Fields named by `Connection` go only with it.
        return;
    }
    if !others
        && let Entry::Occupied(entry) = headers.entry(CONNECTION)
        && entry.iter().all(|v| names_no_field(v.as_bytes()))
    {
        entry.remove_entry_mult();
        return;
    }
    let named = connection_named(headers);
    let mut gone: Vec<HeaderName> = Vec::new();
    for name in headers.keys() {
        if switched && name == UPGRADE {
            continue;
        }
        if is_hop_by_hop(name.as_str()) || named.contains(name) {
            gone.push(name.clone());
        }
    }
    for name in gone {
        headers.remove(name);
    }
}

/// Whether a `Connection` value is only `keep-alive` or `close`, which
/// name no field (the common case, answered without parsing a list).
fn names_no_field(value: &[u8]) -> bool {
    // Exact bytes first, as nearly every sender writes them: a comparison
    // without case goes byte by byte, and this runs on every answer (about
    // 70 instructions a request saved, by callgrind).
    value == b"keep-alive"
        || value == b"close"
        || value.eq_ignore_ascii_case(b"keep-alive")
        || value.eq_ignore_ascii_case(b"close")
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
        if names_no_field(value.as_bytes()) {
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
        strip_hop_by_hop(&mut h, false);
        let kept: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(kept, ["x-kept"]);

        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("Keep-Alive"));
        assert!(connection_named(&h).is_empty());
    }

    #[test]
    fn a_connection_that_names_no_field_goes_alone() {
        // Every value of it, whatever their case.
        let mut h = HeaderMap::new();
        h.append(CONNECTION, HeaderValue::from_static("Keep-Alive"));
        h.append(CONNECTION, HeaderValue::from_static("close"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let kept: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(kept, ["x-kept"]);

        // With another hop-by-hop field beside it, both go.
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("keep-alive"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h, false);
        let kept: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(kept, ["x-kept"]);

        // A switch of protocols keeps its `Upgrade`, not its `Connection`.
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("upgrade"));
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        strip_hop_by_hop(&mut h, true);
        let kept: Vec<&str> = h.keys().map(HeaderName::as_str).collect();
        assert_eq!(kept, ["upgrade"]);
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
        let peer = Peer::new(
            "[::ffff:192.0.2.7]:4000".parse().expect("address"),
            false,
            true,
        );
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
