//! A client's identity as counted, and the digests that stand for it where
//! an id must not appear as sent.

use std::net::IpAddr;

use sha2::{Digest as _, Sha256};

/// The identity a request is counted under.
///
/// Header values are kept as raw bytes, owned; stores must escape or hash
/// them before using them in keys.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ClientId {
    /// A network address (IPv6 possibly reduced to its prefix).
    Addr(IpAddr),
    /// A value read from the request (a header, a path parameter, a
    /// verified claim), copied out of it.
    Header(Box<[u8]>),
    /// The SHA-256 of a header value longer than the rule's `max_len`.
    Digest(Box<[u8; 32]>),
    /// Several parts, in the rule's order.
    Composite(Box<[ClientId]>),
    /// Every client of the route (`from = "global"`).
    Global,
}

impl ClientId {
    /// An id made of a header value (copied).
    pub fn header(value: impl AsRef<[u8]>) -> Self {
        Self::Header(value.as_ref().into())
    }

    /// The id of a header value too long to keep: its SHA-256.
    pub fn digest_of(value: impl AsRef<[u8]>) -> Self {
        Self::Digest(Box::new(sha256(value.as_ref())))
    }
}

/// `value`'s SHA-256: how a long id is counted, and how configured API keys
/// and client values are kept without the values themselves.
pub fn sha256(value: &[u8]) -> [u8; 32] {
    Sha256::digest(value).into()
}

/// How logs show a client: an address as it is; a header's value (an API
/// key, a token) as `key:` and 16 hex digits of a SHA-256 keyed with a
/// secret of this process, so that the logs of one instance name a client
/// the same way each time without holding its credential.
impl std::fmt::Display for ClientId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Addr(ip) => write!(f, "{ip}"),
            Self::Header(value) => write!(f, "key:{}", redacted(value)),
            Self::Digest(digest) => write!(f, "key:{}", redacted(&digest[..])),
            Self::Global => f.write_str("global"),
            Self::Composite(parts) => {
                for (i, part) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str("+")?;
                    }
                    write!(f, "{part}")?;
                }
                Ok(())
            }
        }
    }
}

/// The first 8 bytes, in hex, of `value`'s SHA-256 keyed with this
/// process's secret.
fn redacted(value: &[u8]) -> String {
    keyed_digest(process_key(), value)
}

/// The first 8 bytes of `value`'s SHA-256 keyed with `key`, in hex: how
/// operators are shown a credential they must not read.
pub(crate) fn keyed_digest(key: &[u8; 32], value: &[u8]) -> String {
    let digest = Sha256::new()
        .chain_update(key)
        .chain_update(value)
        .finalize();
    hex(&digest[..8])
}

/// A SHA-256 written as 64 hex digits (how files name a credential
/// without holding it: `sha256:<hex>`), or `None` when it is not one.
pub fn sha256_from_hex(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// `bytes` in lower-case hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

/// A secret drawn once per process from the system's random source (or,
/// lacking one, from the process's hash seeds and the time).
pub(crate) fn process_key() -> &'static [u8; 32] {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        let mut key = [0u8; 32];
        let read = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut key));
        if read.is_err() {
            use std::hash::{BuildHasher, Hasher};
            let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
            hasher.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos()),
            );
            key = Sha256::digest(hasher.finish().to_le_bytes()).into();
        }
        key
    })
}
