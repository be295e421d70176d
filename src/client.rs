//! Who is asking: a request and its peer address become a [`ClientId`].
//!
//! The id decides which bucket a request counts against, so a client must not
//! be able to choose it freely: `X-Forwarded-For` is believed only when the
//! TCP peer is a trusted proxy, and only its rightmost untrusted entry counts.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// How a route identifies its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientRule {
    /// What the id is made of; several parts make a composite id.
    pub parts: Vec<Part>,
    /// What to do when a header part is absent.
    pub missing: MissingHeader,
    /// IPv6 addresses count by this prefix (`64`: one bucket per /64, since
    /// one host commonly owns a whole /64); 128 keeps whole addresses.
    pub ipv6_prefix: u8,
}

/// One part of a client id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The TCP peer's address.
    RemoteAddr,
    /// The rightmost `X-Forwarded-For` address that is not a trusted proxy,
    /// believed only when the peer itself is trusted.
    ForwardedFor,
    /// A request header's value, such as an API key (names are
    /// case-insensitive).
    Header(HeaderName),
}

/// What a rule does when a header part is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingHeader {
    /// Use the client's address in its place.
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
    /// A network address (IPv6 possibly reduced to its prefix).
    Addr(IpAddr),
    /// A header's value.
    Header(HeaderValue),
    /// Several parts, in the rule's order.
    Composite(Box<[ClientId]>),
}

/// Why no client id could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The route identifies clients by a header that the request lacks.
    #[error("this route requires the {0} header")]
    MissingHeader(HeaderName),
}

impl ClientRule {
    /// Counts by the TCP peer's address.
    pub fn remote_addr() -> Self {
        Self {
            parts: vec![Part::RemoteAddr],
            missing: MissingHeader::Fallback,
            ipv6_prefix: 128,
        }
    }

    /// Derives the client id of a request that arrived from `peer`.
    pub fn identify(
        &self,
        headers: &HeaderMap,
        peer: IpAddr,
        trusted: &[IpNet],
    ) -> Result<ClientId, ClientError> {
        match self.parts.as_slice() {
            [part] => self.part(part, headers, peer, trusted),
            parts => parts
                .iter()
                .map(|part| self.part(part, headers, peer, trusted))
                .collect::<Result<Box<[_]>, _>>()
                .map(ClientId::Composite),
        }
    }

    fn part(
        &self,
        part: &Part,
        headers: &HeaderMap,
        peer: IpAddr,
        trusted: &[IpNet],
    ) -> Result<ClientId, ClientError> {
        let address = |ip| ClientId::Addr(group_ipv6(ip, self.ipv6_prefix));
        match part {
            Part::RemoteAddr => Ok(address(peer.to_canonical())),
            Part::ForwardedFor => Ok(address(client_address(headers, peer, trusted))),
            Part::Header(name) => match headers.get(name) {
                Some(value) => Ok(ClientId::Header(value.clone())),
                None => match self.missing {
                    MissingHeader::Fallback => Ok(address(client_address(headers, peer, trusted))),
                    MissingHeader::Reject => Err(ClientError::MissingHeader(name.clone())),
                },
            },
        }
    }
}

/// Keeps the first `prefix` bits of an IPv6 address.
fn group_ipv6(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if prefix < 128 => {
            let mask = u128::MAX.checked_shl(u32::from(128 - prefix)).unwrap_or(0);
            IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask))
        }
        other => other,
    }
}

/// Whether `ip` is one of `nets`.
pub fn is_in(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|net| net.contains(&ip))
}

/// The address of whoever is really asking: the TCP peer, unless the peer is
/// a trusted proxy, in which case `X-Forwarded-For` is walked from the right,
/// past trusted proxies, to the first address that is not one. Anything
/// unparsable on the way ends the walk at the last trusted hop, so garbage
/// never becomes a bucket of its own.
pub fn client_address(headers: &HeaderMap, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    if !is_in(peer, trusted) {
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
            if !is_in(ip, trusted) {
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

    fn rule(parts: Vec<Part>) -> ClientRule {
        ClientRule {
            parts,
            ..ClientRule::remote_addr()
        }
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_forwards() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, ip("198.51.100.7"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("198.51.100.7"))));
    }

    #[test]
    fn two_trusted_hops_are_skipped() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["6.6.6.6, 203.0.113.9, 10.1.1.1"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }

    #[test]
    fn several_forwarded_for_headers_read_as_one_list() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9", "10.1.1.1"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }

    #[test]
    fn garbage_from_a_trusted_proxy_stops_at_the_last_trusted_hop() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9, nonsense"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("10.0.0.2"))));
    }

    #[test]
    fn forwarded_addresses_with_ports_and_brackets_are_read() {
        let trusted = nets(&["10.0.0.0/8"]);
        for (entry, want) in [
            ("203.0.113.9:4711", "203.0.113.9"),
            ("[2001:db8::7]:443", "2001:db8::7"),
            ("2001:DB8:0:0::7", "2001:db8::7"),
        ] {
            let id = rule(vec![Part::ForwardedFor]).identify(
                &headers(&[entry]),
                ip("10.0.0.2"),
                &trusted,
            );
            assert_eq!(id, Ok(ClientId::Addr(ip(want))), "{entry}");
        }
    }

    #[test]
    fn mapped_ipv6_peers_count_as_ipv4() {
        let id = ClientRule::remote_addr().identify(&HeaderMap::new(), ip("::ffff:192.0.2.1"), &[]);
        assert_eq!(id, Ok(ClientId::Addr(ip("192.0.2.1"))));
    }

    #[test]
    fn ipv6_clients_can_be_grouped_by_prefix() {
        let per_64 = ClientRule {
            ipv6_prefix: 64,
            ..ClientRule::remote_addr()
        };
        let a = per_64.identify(&HeaderMap::new(), ip("2001:db8:1:2:aaaa::1"), &[]);
        let b = per_64.identify(&HeaderMap::new(), ip("2001:db8:1:2:bbbb::2"), &[]);
        let c = per_64.identify(&HeaderMap::new(), ip("2001:db8:1:3::1"), &[]);
        assert_eq!(a, Ok(ClientId::Addr(ip("2001:db8:1:2::"))));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let v4 = per_64.identify(&HeaderMap::new(), ip("192.0.2.1"), &[]);
        assert_eq!(v4, Ok(ClientId::Addr(ip("192.0.2.1"))));
    }

    #[test]
    fn composite_ids_combine_their_parts_in_order() {
        let key = HeaderName::from_static("x-api-key");
        let r = rule(vec![Part::Header(key.clone()), Part::RemoteAddr]);
        let mut h = HeaderMap::new();
        h.insert(&key, HeaderValue::from_static("k1"));
        let id = r.identify(&h, ip("192.0.2.1"), &[]);
        assert_eq!(
            id,
            Ok(ClientId::Composite(
                vec![
                    ClientId::Header(HeaderValue::from_static("k1")),
                    ClientId::Addr(ip("192.0.2.1"))
                ]
                .into()
            ))
        );
        let other_addr = r.identify(&h, ip("192.0.2.2"), &[]);
        assert_ne!(id, other_addr);
    }

    #[test]
    fn a_missing_header_falls_back_to_the_forwarded_address_behind_a_proxy() {
        let trusted = nets(&["10.0.0.0/8"]);
        let r = rule(vec![Part::Header(HeaderName::from_static("x-api-key"))]);
        let id = r.identify(&headers(&["203.0.113.9"]), ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }
}
