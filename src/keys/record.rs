//! What the registry knows of one key: whose it is, its plan and
//! attributes, whether it is enabled and until when it is valid.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where a record came from: a key made or imported through the admin
/// API, or one the keys file lists (the file's reconcile owns those).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The admin API.
    #[default]
    Api,
    /// The keys file.
    File,
}

/// One key's record, as the store keeps it (JSON) under the key's digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// The key's public id (`key_` and 16 hex digits of its digest): how
    /// operators name it.
    pub id: String,
    /// The customer it belongs to; several keys may share one.
    pub identity: String,
    /// The plan its requests are on (a `[plans.NAME]`); `None`: the
    /// default plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<String>,
    /// Anything a limit may key on (`org`, `billing_day`, ...).
    #[serde(default, skip_serializing_if = "Attributes::is_empty")]
    pub attributes: Attributes,
    /// A disabled key is refused (403) until enabled again.
    pub enabled: bool,
    /// When it stops being valid (ms since the epoch); `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_ms: Option<u64>,
    /// A label for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The start of a key floodgate made (its prefix and 4 characters),
    /// to tell keys apart; never more of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// Where it came from.
    #[serde(default)]
    pub source: Source,
    /// When it was made (ms since the epoch).
    pub created_ms: u64,
    /// When it last changed (ms since the epoch).
    pub updated_ms: u64,
}

impl Record {
    /// Whether it is expired at `now_ms`.
    pub fn expired_at(&self, now_ms: u64) -> bool {
        self.expires_ms.is_some_and(|end| end <= now_ms)
    }
}

/// A key's attributes, name → value, sorted by name in one boxed slice:
/// every instance holds every key's, so they take a few bytes more than
/// their text (a map's node would take about 550 bytes whatever it held).
/// Written and read as a JSON object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes(Box<[(Box<str>, Box<str>)]>);

impl Attributes {
    /// The value of attribute `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .binary_search_by(|(n, _)| (**n).cmp(name))
            .ok()
            .map(|i| &*self.0[i].1)
    }

    /// Every attribute, sorted by name.
    pub fn as_slice(&self) -> &[(Box<str>, Box<str>)] {
        &self.0
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl From<BTreeMap<String, String>> for Attributes {
    fn from(map: BTreeMap<String, String>) -> Self {
        Self(map.into_iter().map(|(n, v)| (n.into(), v.into())).collect())
    }
}

impl Serialize for Attributes {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(n, v)| (&**n, &**v)))
    }
}

impl<'de> Deserialize<'de> for Attributes {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(deserializer).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_found_by_name_and_read_and_written_as_an_object() {
        let map: BTreeMap<String, String> = [("org", "acme"), ("billing_day", "15"), ("tier", "x")]
            .into_iter()
            .map(|(n, v)| (n.to_owned(), v.to_owned()))
            .collect();
        let attributes = Attributes::from(map);
        assert_eq!(attributes.get("org"), Some("acme"));
        assert_eq!(attributes.get("billing_day"), Some("15"));
        assert_eq!(attributes.get("zone"), None);
        let json = serde_json::to_string(&attributes).expect("json");
        assert_eq!(json, r#"{"billing_day":"15","org":"acme","tier":"x"}"#);
        let back: Attributes = serde_json::from_str(&json).expect("read back");
        assert_eq!(back, attributes);
    }
}
