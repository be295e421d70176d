//! What a decision's keys are called: the route and client as a hash tag,
//! so a decision's keys share a Cluster slot, and each limit's place.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;

use redis::{RedisWrite, ToRedisArgs};
use sha2::{Digest, Sha256};

use crate::client::ClientId;
use crate::limit::Limit;

/// The key client ids are digested with in Redis keys: HMAC-SHA-256 with
/// the configured `id_secret`, or with a fixed key when there is none.
#[derive(Clone)]
pub struct IdKey(ring::hmac::Key);

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdKey(..)")
    }
}

/// The key used when no `id_secret` is configured: the digests still keep
/// credentials out of the store, though not guessable ids.
const DEFAULT_ID_SECRET: &[u8] = b"floodgate client id digest, v1";

impl IdKey {
    /// A key from `secret`, or the default one.
    pub fn new(secret: Option<&[u8]>) -> Self {
        Self(ring::hmac::Key::new(
            ring::hmac::HMAC_SHA256,
            secret.unwrap_or(DEFAULT_ID_SECRET),
        ))
    }

    /// The first 16 bytes of `value`'s HMAC, in hex.
    fn digest(&self, value: &[u8]) -> [u8; 16] {
        let tag = ring::hmac::sign(&self.0, value);
        let mut out = [0u8; 16];
        out.copy_from_slice(&tag.as_ref()[..16]);
        out
    }

    /// What the marker key holds for this key: instances that find
    /// another value there digest ids with another secret.
    pub(super) fn marker(&self) -> String {
        let mut out = String::new();
        for b in self.digest(b"floodgate id secret marker") {
            let _ = write!(out, "{b:02x}");
        }
        out
    }
}

/// A key: `{tag}:{index}:{algorithm}:{window_ms}`, written straight into
/// the command, without a buffer of its own.
pub(super) struct Key<'a> {
    pub(super) tag: &'a str,
    pub(super) index: usize,
    pub(super) limit: &'a Limit,
}

impl Key<'_> {
    /// Writes the key into `key`.
    fn write(&self, key: &mut impl std::io::Write) {
        let mut digits = itoa::Buffer::new();
        // Writing into the command's buffer cannot fail.
        let _ = key.write_all(self.tag.as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(digits.format(self.index as u64).as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(self.limit.algorithm.name().as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(digits.format(self.limit.window_ms).as_bytes());
    }
}

impl ToRedisArgs for Key<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        self.write(&mut out.writer_for_next_arg());
    }
}

/// The key of a limit's penalty: its count's key and `:p`, in the same
/// slot (see `penalized` in `lua/decide.lua`).
pub(super) struct PenaltyOf<'a>(pub(super) &'a Key<'a>);

impl ToRedisArgs for PenaltyOf<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut key = out.writer_for_next_arg();
        self.0.write(&mut key);
        let _ = key.write_all(b":p");
    }
}

/// Writes a client id so that it cannot break the hash tag or the key's
/// structure, two different ids never write the same text, and no
/// credential can be read from it: addresses as `a:<ip>`, a value read
/// from the request (a header, a claim, a path parameter) as `k:` and the
/// first 16 bytes in hex of the HMAC, keyed with `key`, of its SHA-256
/// (fixed length, whatever its size; a value kept only as its SHA-256
/// writes the same), and composite ids as `c:<part>|<part>…`.
pub fn write_client(out: &mut String, client: &ClientId, key: &IdKey) {
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
        ClientId::Header(bytes) => write_digest(out, &Sha256::digest(bytes).into(), key),
        // The same text as the long value it stands for would write.
        ClientId::Digest(digest) => write_digest(out, digest, key),
        // One bucket for the whole route.
        ClientId::Global => out.push('g'),
        ClientId::Composite(parts) => {
            // No part's text contains '|', so the joined text is unambiguous.
            out.push_str("c:");
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                write_client(out, part, key);
            }
        }
    }
}

/// `k:` and the keyed digest of a SHA-256, in hex.
fn write_digest(out: &mut String, sha256: &[u8; 32], key: &IdKey) {
    out.push_str("k:");
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for b in key.digest(sha256) {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 15)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(client: &ClientId) -> String {
        let mut s = String::new();
        write_client(&mut s, client, &IdKey::new(None));
        s
    }

    #[test]
    fn addresses_are_readable_in_keys_and_header_values_are_not() {
        assert_eq!(
            written(&ClientId::Addr([192, 0, 2, 1].into())),
            "a:192.0.2.1"
        );
        let key = written(&ClientId::header("key-123"));
        assert!(key.starts_with("k:") && key.len() == 34, "{key}");
        assert!(!key.contains("key-123"), "{key}");
        assert_eq!(key, written(&ClientId::digest_of("key-123")));
        let mut other = String::new();
        write_client(
            &mut other,
            &ClientId::header("key-123"),
            &IdKey::new(Some(b"another secret of 32 bytes or so")),
        );
        assert_ne!(key, other, "the secret keys the digest");
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
            assert!(w.starts_with("k:"), "{raw}: {w}");
            assert_eq!(w.len(), 2 + 32);
            assert!(!w.contains(['{', '}']));
        }
    }
}
