//! Clients an operator names, and what comes with each: the one lookup
//! behind a route's exempt keys, an override's clients and the plan
//! table. Each is written as it is (an API key, a claim, an address as
//! text) or as `sha256:<64 hex digits>`, so a file need not hold a
//! credential in the clear; a request's value is found either way.
//!
//! The key registry answers the same question for keys made through the
//! admin API or a keys file, but keeps its digests keyed with the store's
//! secret and lives in the store (see `keys`).

use std::collections::HashMap;

use super::{ClientId, sha256, sha256_from_hex};

/// A value as a file or the configuration writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// The value itself, byte for byte.
    Value(Box<[u8]>),
    /// The value's SHA-256 (`sha256:<64 hex digits>`).
    Digest([u8; 32]),
}

impl Written {
    /// `text` as written: `sha256:` and 64 hex digits is a digest, any
    /// other text the value itself; `None` for a `sha256:` entry whose
    /// digits are not 64 hex digits.
    pub fn read(text: &str) -> Option<Self> {
        match text.strip_prefix("sha256:") {
            Some(hex) => sha256_from_hex(hex).map(Self::Digest),
            None => Some(Self::Value(text.as_bytes().into())),
        }
    }

    /// What an entry that is not understood is told.
    pub const BAD_DIGEST: &'static str = "a sha256: entry is \"sha256:\" and 64 hex digits";
}

/// Clients named by value or by SHA-256, each with what comes with it
/// (`T`: nothing for a set, a plan's name for a plan table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Known<T> {
    /// Values, byte for byte.
    values: HashMap<Box<[u8]>, T>,
    /// SHA-256 digests of values.
    digests: HashMap<[u8; 32], T>,
}

impl<T> Default for Known<T> {
    fn default() -> Self {
        Self {
            values: HashMap::new(),
            digests: HashMap::new(),
        }
    }
}

impl<T> Known<T> {
    /// Names `written` with `with` (a later entry for the same value or
    /// digest replaces an earlier one).
    pub fn insert(&mut self, written: Written, with: T) {
        match written {
            Written::Value(value) => {
                self.values.insert(value, with);
            }
            Written::Digest(digest) => {
                self.digests.insert(digest, with);
            }
        }
    }

    /// What comes with `value`: found as it is, or by its SHA-256 (hashed
    /// only when some entry is a digest).
    pub fn get(&self, value: &[u8]) -> Option<&T> {
        self.values.get(value).or_else(|| {
            if self.digests.is_empty() {
                None
            } else {
                self.digests.get(&sha256(value))
            }
        })
    }

    /// What comes with the client `id`: a value read from the request
    /// found as in [`Self::get`], one too long to keep by its SHA-256, an
    /// address by its text; a composite or the global client is never
    /// named.
    pub fn of(&self, id: &ClientId) -> Option<&T> {
        match id {
            ClientId::Header(value) => self.get(value),
            ClientId::Digest(digest) => self.digests.get(&**digest),
            ClientId::Addr(ip) => self.get(ip.to_string().as_bytes()),
            ClientId::Composite(_) | ClientId::Global => None,
        }
    }

    /// How many clients it names.
    pub fn len(&self) -> usize {
        self.values.len() + self.digests.len()
    }

    /// Whether it names none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn known(entries: &[(&str, u8)]) -> Known<u8> {
        let mut known = Known::default();
        for &(text, with) in entries {
            known.insert(Written::read(text).expect("a valid entry"), with);
        }
        known
    }

    #[test]
    fn a_value_is_found_as_written_or_by_its_digest() {
        let digest = crate::client::hex(&sha256(b"secret"));
        let known = known(&[("plain", 1), (&format!("sha256:{digest}"), 2)]);
        assert_eq!(known.get(b"plain"), Some(&1));
        assert_eq!(known.get(b"secret"), Some(&2));
        assert_eq!(known.get(b"other"), None);
        assert_eq!(known.of(&ClientId::header("secret")), Some(&2));
        assert_eq!(known.of(&ClientId::digest_of("secret")), Some(&2));
        // A value too long to keep is counted by its digest: named as it
        // is, it is not found that way.
        assert_eq!(known.of(&ClientId::digest_of("plain")), None);
        assert_eq!(known.len(), 2);
    }

    #[test]
    fn an_address_is_found_by_its_text_and_a_composite_never() {
        let known = known(&[("10.0.0.7", 3)]);
        assert_eq!(known.of(&ClientId::Addr([10, 0, 0, 7].into())), Some(&3));
        assert_eq!(known.of(&ClientId::Addr([10, 0, 0, 8].into())), None);
        let both = ClientId::Composite(vec![ClientId::header("10.0.0.7")].into());
        assert_eq!(known.of(&both), None);
        assert_eq!(known.of(&ClientId::Global), None);
    }

    #[test]
    fn a_digest_entry_needs_64_hex_digits() {
        assert_eq!(Written::read("sha256:abc"), None);
        assert_eq!(Written::read(&format!("sha256:{}", "g".repeat(64))), None);
        assert_eq!(
            Written::read("sha25:abc"),
            Some(Written::Value(b"sha25:abc"[..].into()))
        );
    }
}
