//! Which id a request gets under a rule: each part read from the request
//! (the peer's address, the forwarded address, a header, a path
//! parameter, a verified claim), an identifying header held to one value,
//! and IPv6 addresses grouped by their prefix.

use std::net::{IpAddr, Ipv6Addr};

use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

use super::{
    ClientError, ClientId, ClientRule, KeyFacts, MissingHeader, Part, Repeated, TooLong,
    client_address,
};

/// What one identification reads: the request, its peer, and what the
/// key registry says of its key.
#[derive(Clone, Copy)]
struct Asked<'a> {
    headers: &'a HeaderMap,
    path: &'a str,
    peer: IpAddr,
    trusted: &'a [IpNet],
    key: Option<&'a KeyFacts<'a>>,
}

impl ClientRule {
    /// Makes sure each header this rule reads holds one value, so that the
    /// value counted is the value forwarded: a header sent in several lines
    /// or as a comma list is refused, or (`first`, `last`) replaced by the
    /// one value that will be counted.
    pub fn single_values(&self, headers: &mut HeaderMap) -> Result<(), ClientError> {
        for part in &self.parts {
            let Part::Header(name) = part else {
                continue;
            };
            let mut values = headers.get_all(name).iter();
            let Some(first) = values.next() else {
                continue;
            };
            let several = values.next().is_some();
            if !several && !first.as_bytes().contains(&b',') {
                continue;
            }
            let chosen = {
                let mut items = headers
                    .get_all(name)
                    .iter()
                    .flat_map(|v| v.as_bytes().split(|&b| b == b','))
                    .map(<[u8]>::trim_ascii)
                    .filter(|item| !item.is_empty());
                match self.repeated {
                    Repeated::Reject => None,
                    Repeated::First => items.next(),
                    Repeated::Last => items.next_back(),
                }
                .and_then(|item| HeaderValue::from_bytes(item).ok())
            };
            match chosen {
                Some(value) => {
                    headers.insert(name, value);
                }
                None => return Err(ClientError::Repeated(name.clone())),
            }
        }
        Ok(())
    }

    /// Derives the client id of a request that arrived from `peer`. A header
    /// part sent several times or as a comma list is refused: counting one
    /// of its values while another is forwarded would let the client choose
    /// which one is counted.
    ///
    /// `path` is the path the route matched, where path parameters are read.
    pub fn identify(
        &self,
        headers: &HeaderMap,
        path: &str,
        peer: IpAddr,
        trusted: &[IpNet],
    ) -> Result<ClientId, ClientError> {
        self.identify_keyed(headers, path, peer, trusted, None)
    }

    /// [`ClientRule::identify`] for a request whose API key the registry
    /// verified, as `key` says it is.
    pub fn identify_keyed(
        &self,
        headers: &HeaderMap,
        path: &str,
        peer: IpAddr,
        trusted: &[IpNet],
        key: Option<&KeyFacts<'_>>,
    ) -> Result<ClientId, ClientError> {
        let asked = Asked {
            headers,
            path,
            peer,
            trusted,
            key,
        };
        match self.parts.as_slice() {
            [part] => self.part(part, &asked),
            parts => parts
                .iter()
                .map(|part| self.part(part, &asked))
                .collect::<Result<Box<[_]>, _>>()
                .map(ClientId::Composite),
        }
    }

    fn part(&self, part: &Part, asked: &Asked<'_>) -> Result<ClientId, ClientError> {
        let Asked {
            headers,
            path,
            peer,
            trusted,
            key,
        } = *asked;
        let address = |ip| ClientId::Addr(group_ipv6(ip, self.ipv6_prefix));
        match part {
            Part::Key(attribute) => {
                let facts = key.ok_or(ClientError::NoKey)?;
                match facts.value(attribute.as_deref()) {
                    Some(value) if value.len() <= self.max_len => Ok(ClientId::header(value)),
                    Some(value) => Ok(ClientId::digest_of(value)),
                    None => match (self.missing, attribute) {
                        (MissingHeader::Fallback, _) | (_, None) => {
                            Ok(ClientId::header(facts.identity))
                        }
                        (MissingHeader::Reject, Some(name)) => {
                            Err(ClientError::NoAttribute(name.clone()))
                        }
                    },
                }
            }
            Part::RemoteAddr => Ok(address(peer.to_canonical())),
            Part::ForwardedFor => Ok(address(client_address(headers, peer, trusted))),
            Part::Global => Ok(ClientId::Global),
            Part::PathParam {
                index, fold_case, ..
            } => {
                // The route's template matched, so the segment exists and
                // is not empty; its length is bounded by the request line.
                let segment = path
                    .split('/')
                    .nth(index + 1)
                    .unwrap_or_default()
                    .as_bytes();
                if segment.len() > self.max_len {
                    return Ok(ClientId::digest_of(segment));
                }
                Ok(if *fold_case {
                    ClientId::Header(segment.to_ascii_lowercase().into())
                } else {
                    ClientId::header(segment)
                })
            }
            Part::Claim(rule) => match self.claim(rule, headers, peer, trusted) {
                Ok(value) if value.len() <= self.max_len => Ok(ClientId::Header(value.into())),
                Ok(value) => Ok(ClientId::digest_of(value)),
                Err(e @ ClientError::TooManyFailures(_)) => Err(e),
                Err(e) => match self.missing {
                    MissingHeader::Fallback => Ok(address(client_address(headers, peer, trusted))),
                    MissingHeader::Reject => Err(e),
                },
            },
            Part::Header(name) => {
                let mut values = headers.get_all(name).iter();
                match values.next() {
                    Some(value) if values.next().is_some() || value.as_bytes().contains(&b',') => {
                        Err(ClientError::Repeated(name.clone()))
                    }
                    Some(value) if value.len() <= self.max_len => Ok(ClientId::header(value)),
                    Some(value) => match self.too_long {
                        TooLong::Reject => Err(ClientError::TooLong(name.clone(), self.max_len)),
                        TooLong::Hash => Ok(ClientId::digest_of(value)),
                    },
                    None => match self.missing {
                        MissingHeader::Fallback => {
                            Ok(address(client_address(headers, peer, trusted)))
                        }
                        MissingHeader::Reject => Err(ClientError::MissingHeader(name.clone())),
                    },
                }
            }
        }
    }

    /// The verified claim of the request's token under `rule`. With a
    /// failure budget, a failure is counted against the client's address,
    /// and an address past its budget has tokens not already known to be
    /// valid refused without a signature check.
    fn claim(
        &self,
        rule: &crate::jwt::ClaimRule,
        headers: &HeaderMap,
        peer: IpAddr,
        trusted: &[IpNet],
    ) -> Result<Vec<u8>, ClientError> {
        let Some(failures) = &self.failures else {
            return rule.claim(headers).map_err(ClientError::Token);
        };
        // The address is looked for only when a token is not already
        // known: a client's every request carries the same one.
        let address = || client_address(headers, peer, trusted);
        let now_ms = crate::clock::now_ms();
        let mut spent = None;
        let claimed = rule.claim_if(headers, now_ms / 1000, || {
            spent = failures.spent(address(), now_ms);
            spent.is_none()
        });
        match (claimed, spent) {
            (Ok(claim), _) => Ok(claim),
            (Err(_), Some(wait)) => Err(ClientError::TooManyFailures(wait)),
            (Err(e), None) => {
                failures.count(address(), now_ms);
                Err(ClientError::Token(e))
            }
        }
    }

    /// [`ClientRule::identify`] for a request about to be forwarded: a
    /// header sent several times or as a list is refused, or with
    /// `repeated = "first"` or `"last"` cut down in `headers` to the one
    /// value that is then counted ([`ClientRule::single_values`]).
    pub fn identify_forwarded(
        &self,
        headers: &mut HeaderMap,
        path: &str,
        peer: IpAddr,
        trusted: &[IpNet],
        key: Option<&KeyFacts<'_>>,
    ) -> Result<ClientId, ClientError> {
        match self.identify_keyed(headers, path, peer, trusted, key) {
            Err(ClientError::Repeated(_)) if self.repeated != Repeated::Reject => {
                self.single_values(headers)?;
                self.identify_keyed(headers, path, peer, trusted, key)
            }
            answer => answer,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::X_FORWARDED_FOR;
    use http::header::HeaderName;

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
        let id = rule(vec![Part::ForwardedFor]).identify(&h, "/", ip("198.51.100.7"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("198.51.100.7"))));
    }

    #[test]
    fn two_trusted_hops_are_skipped() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["6.6.6.6, 203.0.113.9, 10.1.1.1"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, "/", ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }

    #[test]
    fn several_forwarded_for_headers_read_as_one_list() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9", "10.1.1.1"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, "/", ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }

    #[test]
    fn garbage_from_a_trusted_proxy_stops_at_the_last_trusted_hop() {
        let trusted = nets(&["10.0.0.0/8"]);
        let h = headers(&["203.0.113.9, nonsense"]);
        let id = rule(vec![Part::ForwardedFor]).identify(&h, "/", ip("10.0.0.2"), &trusted);
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
                "/",
                ip("10.0.0.2"),
                &trusted,
            );
            assert_eq!(id, Ok(ClientId::Addr(ip(want))), "{entry}");
        }
    }

    #[test]
    fn mapped_ipv6_peers_count_as_ipv4() {
        let id =
            ClientRule::remote_addr().identify(&HeaderMap::new(), "/", ip("::ffff:192.0.2.1"), &[]);
        assert_eq!(id, Ok(ClientId::Addr(ip("192.0.2.1"))));
    }

    #[test]
    fn ipv6_clients_can_be_grouped_by_prefix() {
        let per_64 = ClientRule {
            ipv6_prefix: 64,
            ..ClientRule::remote_addr()
        };
        let a = per_64.identify(&HeaderMap::new(), "/", ip("2001:db8:1:2:aaaa::1"), &[]);
        let b = per_64.identify(&HeaderMap::new(), "/", ip("2001:db8:1:2:bbbb::2"), &[]);
        let c = per_64.identify(&HeaderMap::new(), "/", ip("2001:db8:1:3::1"), &[]);
        assert_eq!(a, Ok(ClientId::Addr(ip("2001:db8:1:2::"))));
        assert_eq!(a, b);
        assert_ne!(a, c);
        let v4 = per_64.identify(&HeaderMap::new(), "/", ip("192.0.2.1"), &[]);
        assert_eq!(v4, Ok(ClientId::Addr(ip("192.0.2.1"))));
    }

    #[test]
    fn composite_ids_combine_their_parts_in_order() {
        let key = HeaderName::from_static("x-api-key");
        let r = rule(vec![Part::Header(key.clone()), Part::RemoteAddr]);
        let mut h = HeaderMap::new();
        h.insert(&key, HeaderValue::from_static("k1"));
        let id = r.identify(&h, "/", ip("192.0.2.1"), &[]);
        assert_eq!(
            id,
            Ok(ClientId::Composite(
                vec![ClientId::header("k1"), ClientId::Addr(ip("192.0.2.1"))].into()
            ))
        );
        let other_addr = r.identify(&h, "/", ip("192.0.2.2"), &[]);
        assert_ne!(id, other_addr);
    }

    #[test]
    fn header_ids_are_copies_not_slices_of_the_request() {
        let key = HeaderName::from_static("x-api-key");
        let head = bytes::Bytes::from(format!("k1{}", "x".repeat(50_000)));
        let mut h = HeaderMap::new();
        h.insert(
            &key,
            HeaderValue::from_maybe_shared(head.slice(0..2)).unwrap_or_else(|_| unreachable!()),
        );
        let id = rule(vec![Part::Header(key)]).identify(&h, "/", ip("192.0.2.1"), &[]);
        assert_eq!(id, Ok(ClientId::header("k1")));
        drop(h);
        // The id owns two bytes; the 50 kB head it came from is the test's
        // alone again.
        assert!(head.is_unique());
    }

    #[test]
    fn long_header_ids_are_refused_or_hashed_as_the_rule_says() {
        let key = HeaderName::from_static("x-api-key");
        let mut h = HeaderMap::new();
        h.insert(&key, HeaderValue::from_static("0123456789"));
        let refuse = ClientRule {
            max_len: 9,
            ..rule(vec![Part::Header(key.clone())])
        };
        assert_eq!(
            refuse.identify(&h, "/", ip("192.0.2.1"), &[]),
            Err(ClientError::TooLong(key.clone(), 9))
        );
        let hash = ClientRule {
            too_long: TooLong::Hash,
            ..refuse.clone()
        };
        assert_eq!(
            hash.identify(&h, "/", ip("192.0.2.1"), &[]),
            Ok(ClientId::digest_of("0123456789"))
        );
        let fits = ClientRule {
            max_len: 10,
            ..refuse
        };
        assert_eq!(
            fits.identify(&h, "/", ip("192.0.2.1"), &[]),
            Ok(ClientId::header("0123456789"))
        );
    }

    #[test]
    fn a_repeated_or_listed_header_is_refused_or_cut_to_the_value_counted() {
        let key = HeaderName::from_static("x-api-key");
        let lines = |values: &[&str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(
                    &key,
                    HeaderValue::from_str(v).unwrap_or_else(|_| unreachable!()),
                );
            }
            h
        };
        let with = |repeated| ClientRule {
            repeated,
            ..rule(vec![Part::Header(key.clone())])
        };
        for sent in [
            &["victim", "throwaway-1"][..],
            &["victim, throwaway-1"],
            &["victim,"],
        ] {
            let mut h = lines(sent);
            assert_eq!(
                with(Repeated::Reject).single_values(&mut h),
                Err(ClientError::Repeated(key.clone())),
                "{sent:?}"
            );
        }
        for (repeated, want) in [(Repeated::First, "victim"), (Repeated::Last, "throwaway-1")] {
            for sent in [&["victim", "throwaway-1"][..], &["victim , throwaway-1"]] {
                let mut h = lines(sent);
                assert_eq!(with(repeated).single_values(&mut h), Ok(()));
                let forwarded: Vec<_> = h.get_all(&key).iter().collect();
                assert_eq!(forwarded, [want], "{repeated:?} {sent:?}");
            }
        }
        let mut one = lines(&["victim"]);
        assert_eq!(with(Repeated::Reject).single_values(&mut one), Ok(()));
        assert_eq!(one.get_all(&key).iter().count(), 1);
        // Identifying alone never counts one of several values.
        let peer = ip("192.0.2.1");
        for repeated in [Repeated::Reject, Repeated::First, Repeated::Last] {
            let h = lines(&["victim", "throwaway-1"]);
            assert_eq!(
                with(repeated).identify(&h, "/", peer, &[]),
                Err(ClientError::Repeated(key.clone()))
            );
        }
        let mut h = lines(&["victim, throwaway-1"]);
        let id = with(Repeated::First).identify_forwarded(&mut h, "/", peer, &[], None);
        assert_eq!(id, Ok(ClientId::header("victim")));
        assert_eq!(h.get_all(&key).iter().collect::<Vec<_>>(), ["victim"]);
        let mut h = lines(&["victim", "throwaway-1"]);
        let id = with(Repeated::Reject).identify_forwarded(&mut h, "/", peer, &[], None);
        assert_eq!(id, Err(ClientError::Repeated(key.clone())));
    }

    #[test]
    fn a_missing_header_falls_back_to_the_forwarded_address_behind_a_proxy() {
        let trusted = nets(&["10.0.0.0/8"]);
        let r = rule(vec![Part::Header(HeaderName::from_static("x-api-key"))]);
        let id = r.identify(&headers(&["203.0.113.9"]), "/", ip("10.0.0.2"), &trusted);
        assert_eq!(id, Ok(ClientId::Addr(ip("203.0.113.9"))));
    }
}
