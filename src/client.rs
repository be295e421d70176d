//! Who is asking: a request and its peer address become a [`ClientId`].
//!
//! The id decides which bucket a request counts against, so a client must not
//! be able to choose it freely: `X-Forwarded-For` is believed only when the
//! TCP peer is a trusted proxy, and only its rightmost untrusted entry counts.

use std::net::{IpAddr, SocketAddr};

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// How a route identifies its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientRule {
    /// The TCP peer's address.
    RemoteAddr,
    /// The rightmost `X-Forwarded-For` address that is not a trusted proxy,
    /// believed only when the peer itself is trusted.
    ForwardedFor,
    /// A request header's value, such as an API key.
    Header {
        /// The header (names are case-insensitive).
        name: HeaderName,
        /// What to do when it is absent.
        missing: MissingHeader,
    },
}

/// What a `header` rule does when the header is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingHeader {
    /// Count the request against the peer address instead.
    Fallback,
    /// Answer 400.
    Reject,
}

/// The identity a request is counted under.
///
/// Header values are kept as raw bytes; stores must escape or hash them
/// before using them in keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// A network address.
    Addr(IpAddr),
    /// A header's value.
    Header(HeaderValue),
}

/// Why no client id could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The route identifies clients by a header that the request lacks.
    #[error("this route requires the {0} header")]
    MissingHeader(HeaderName),
}

impl ClientRule {
    /// Derives the client id of a request that arrived from `peer`.
    pub fn identify(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        trusted: &[IpNet],
    ) -> Result<ClientId, ClientError> {
        let peer = peer.to_canonical();
        match self {
            Self::RemoteAddr => Ok(ClientId::Addr(peer)),
            Self::ForwardedFor => Ok(ClientId::Addr(forwarded_client(headers, peer, trusted))),
            Self::Header { name, missing } => match headers.get(name) {
                Some(value) => Ok(ClientId::Header(value.clone())),
                None => match missing {
                    MissingHeader::Fallback => Ok(ClientId::Addr(peer)),
                    MissingHeader::Reject => Err(ClientError::MissingHeader(name.clone())),
                },
            },
        }
    }
}

fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|net| net.contains(&ip))
}

/// Walks `X-Forwarded-For` from the right, past trusted proxies, to the first
/// address that is not one. Anything unparsable on the way ends the walk at
/// the last trusted hop, so garbage never becomes a bucket of its own.
fn forwarded_client(headers: &HeaderMap, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    if !is_trusted(peer, trusted) {
        return peer;
    }
    let mut last_trusted = peer;
    let values: Vec<&HeaderValue> = headers.get_all(&X_FORWARDED_FOR).iter().collect();
    for value in values.iter().rev() {
        let Ok(text) = value.to_str() else {
            return last_trusted;
        };
        for entry in text.rsplit(',') {
            let Some(ip) = parse_forwarded_addr(entry.trim()) else {
                return last_trusted;
            };
            if !is_trusted(ip, trusted) {
                return ip;
            }
            last_trusted = ip;
        }
    }
    last_trusted
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`
/// or `[2001:db8::1]:443`.
fn parse_forwarded_addr(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip().to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in xff {
            h.append(
                &X_FORWARDED_FOR,
                HeaderValue::from_str(v).expect("test header"),
            );
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test address")
    }

    fn nets(list: &[&str]) -> Vec<IpNet> {
        list.iter().map(|s| s.parse().expect("test net")).collect()
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_forwards() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9"]);
        let id = ClientRule::ForwardedFor.identify(&h, ip("198.51.100.7"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("198.51.100.7"))));
    }

    #[test]
    fn two_trusted_hops_are_skipped() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["6.6.6.6, 203.0.113.9, 10.1.1.1"]);
        let id = ClientRule::ForwardedFor.identify(&h, ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }

    #[test]
    fn garbage_from_a_trusted_proxy_stops_at_the_last_trusted_hop() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9, nonsense"]);
        let id = ClientRule::ForwardedFor.identify(&h, ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("10.0.0.2"))));
    }

    #[test]
    fn mapped_ipv6_peers_count_as_ipv4() {
        let id = ClientRule::RemoteAddr.identify(&HeaderMap::new(), ip("::ffff:192.0.2.1"), &[]);
        assert_eq!(id, Ok(ClientId::Addr(ip("192.0.2.1"))));
    }
}
