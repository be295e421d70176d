//! What a decision's keys are called: the route and client as a hash tag,
//! so a decision's keys share a Cluster slot, and each limit's place.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;

use redis::{RedisWrite, ToRedisArgs};
use sha2::{Digest, Sha256};

use crate::client::ClientId;
use crate::limit::Limit;

/// Header values up to this length made of safe characters appear in keys
/// as they are; anything else is hashed.
pub(super) const MAX_PLAIN_CLIENT: usize = 64;

/// A key: `{tag}:{index}:{algorithm}:{window_ms}`, written straight into
/// the command, without a buffer of its own.
pub(super) struct Key<'a> {
    pub(super) tag: &'a str,
    pub(super) index: usize,
    pub(super) limit: &'a Limit,
}

impl ToRedisArgs for Key<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut key = out.writer_for_next_arg();
        let mut digits = [0u8; 20];
        // Writing into the command's buffer cannot fail.
        let _ = key.write_all(self.tag.as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(decimal(self.index as u64, &mut digits));
        let _ = key.write_all(b":");
        let _ = key.write_all(self.limit.algorithm.name().as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(decimal(self.limit.window_ms, &mut digits));
    }
}

/// `n` in decimal, written at the end of `digits`.
pub(super) fn decimal(n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &digits[at..]
}

/// Writes a client id so that it cannot break the hash tag or the key's
/// structure, and two different ids never write the same text: addresses as
/// `a:<ip>`, short header values of safe characters as `h:<value>`, any
/// other header value as `s:<sha-256 hex>` (fixed length, whatever its size;
/// a value kept only as its digest writes the same), and composite ids as
/// `c:<part>|<part>…`.
pub fn write_client(out: &mut String, client: &ClientId) {
    match client {
        ClientId::Addr(IpAddr::V4(ip)) => {
            // The common case, written without the formatting machinery:
            // the same text as `Display`.
            out.push_str("a:");
            for (i, octet) in ip.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        ClientId::Addr(ip) => {
            let _ = write!(out, "a:{ip}");
        }
        ClientId::Header(bytes) => {
            let plain = bytes.len() <= MAX_PLAIN_CLIENT
                && bytes.iter().all(|&b| {
                    b.is_ascii_alphanumeric()
                        || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/' | b'=' | b'@')
                });
            if plain {
                out.push_str("h:");
                out.extend(bytes.iter().map(|&b| char::from(b)));
            } else {
                write_digest(out, &Sha256::digest(bytes).into());
            }
        }
        // The same text as the long value it stands for would write.
        ClientId::Digest(digest) => write_digest(out, digest),
        // One bucket for the whole route.
        ClientId::Global => out.push('g'),
        ClientId::Composite(parts) => {
            // No part's text contains '|', so the joined text is unambiguous.
            out.push_str("c:");
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                write_client(out, part);
            }
        }
    }
}

/// `s:` and a SHA-256 in hex.
pub(super) fn write_digest(out: &mut String, digest: &[u8; 32]) {
    out.push_str("s:");
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(client: &ClientId) -> String {
        let mut s = String::new();
        write_client(&mut s, client);
        s
    }

    #[test]
    fn addresses_and_plain_header_values_are_readable_in_keys() {
        assert_eq!(
            written(&ClientId::Addr([192, 0, 2, 1].into())),
            "a:192.0.2.1"
        );
        let key = ClientId::header("key-123");
        assert_eq!(written(&key), "h:key-123");
    }

    #[test]
    fn decimals_are_written_as_display_writes_them() {
        for n in [0, 1, 9, 10, 99, 100, 60_000, 1 << 50, u64::MAX] {
            let mut digits = [0u8; 20];
            assert_eq!(decimal(n, &mut digits), n.to_string().as_bytes());
        }
    }

    #[test]
    fn ipv4_addresses_are_written_as_display_writes_them() {
        // Every octet value in every position, without 2^32 cases.
        for octet in 0..=255u8 {
            for ip in [
                [octet, 0, 9, 255],
                [10, octet, 100, 1],
                [99, 199, octet, 0],
                [255, 1, 10, octet],
            ] {
                let ip = std::net::Ipv4Addr::from(ip);
                assert_eq!(written(&ClientId::Addr(ip.into())), format!("a:{ip}"));
            }
        }
    }

    #[test]
    fn header_values_that_look_like_addresses_do_not_share_their_bucket() {
        let header = ClientId::header("192.0.2.1");
        assert_ne!(
            written(&header),
            written(&ClientId::Addr([192, 0, 2, 1].into()))
        );
    }

    #[test]
    fn braces_colons_and_long_values_are_hashed_to_a_fixed_length() {
        for raw in ["a}b", "{x}", "a:b", &"k".repeat(65)] {
            let w = written(&ClientId::header(raw));
            assert!(w.starts_with("s:"), "{raw}: {w}");
            assert_eq!(w.len(), 2 + 64);
            assert!(!w.contains(['{', '}']));
        }
    }
}
