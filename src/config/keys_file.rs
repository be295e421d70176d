//! The keys file (`[keys] file = "keys.toml"`): customers' keys by
//! SHA-256, for teams that keep them in git, read with every problem at
//! its file:line:column. A file with a problem is refused whole.
//!
//! ```toml
//! [[key]]
//! sha256 = "<64 hex digits: the key's SHA-256>"
//! identity = "cust_42"
//! plan = "pro"                                       # optional: a [plans.NAME]
//! attributes = { org = "acme", billing_day = "15" }  # optional
//! enabled = true                                     # optional, default true
//! expires = "2027-01-01T00:00:00Z"                   # optional, RFC 3339
//! name = "CI key"                                    # optional
//! ```
//!
//! A file that lists no key is not applied (see [`KeysFile::keys`]) unless
//! it says so with `key = []`.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use super::problems::Lines;
use super::{LoadError, Problem};
use crate::keys::manage::{Spec, check_attributes, check_identity};
use crate::keys::{KeysFile, Listed};

/// The file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFileModel {
    key: Option<Vec<ListedKeyModel>>,
}

/// One `[[key]]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ListedKeyModel {
    sha256: Spanned<String>,
    identity: Spanned<String>,
    plan: Option<Spanned<String>>,
    attributes: Option<Spanned<BTreeMap<String, String>>>,
    enabled: Option<bool>,
    expires: Option<Spanned<String>>,
    name: Option<Spanned<String>>,
}

/// The longest name, in bytes.
const MAX_NAME: usize = 256;

/// Reads the keys file at `path`, whose plans must be among `plans`.
pub fn load_keys_file(path: &Path, plans: &[Arc<str>]) -> Result<KeysFile, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    parse_keys_file(path, &text, plans)
}

/// Reads `text` as the keys file at `path`.
pub fn parse_keys_file(path: &Path, text: &str, plans: &[Arc<str>]) -> Result<KeysFile, LoadError> {
    let mut file = Reading {
        path,
        lines: Lines::new(text),
        plans,
        problems: Vec::new(),
    };
    let model: KeysFileModel = match toml::from_str(text) {
        Ok(model) => model,
        Err(e) => {
            let at = e.span().map_or(0, |s| s.start);
            file.problem(at, super::problems::in_plain_words(e.message(), None));
            return Err(LoadError::Invalid(file.problems));
        }
    };
    let Some(models) = model.key else {
        return Ok(KeysFile {
            path: path.to_owned(),
            keys: None,
        });
    };
    let mut keys = Vec::with_capacity(models.len());
    let mut seen: HashMap<[u8; 32], usize> = HashMap::with_capacity(models.len());
    for m in models {
        let offset = m.sha256.span().start;
        if let Some(sha256) = sha256_of(m.sha256.get_ref()) {
            let (line, _) = file.lines.at(offset);
            if let Some(first) = seen.insert(sha256, line) {
                seen.insert(sha256, first);
                file.problem(
                    offset,
                    format!("this key is listed twice (first at line {first}); list each key once"),
                );
            }
        }
        if let Some(listed) = file.key(m) {
            keys.push(listed);
        }
    }
    if file.problems.is_empty() {
        Ok(KeysFile {
            path: path.to_owned(),
            keys: Some(keys),
        })
    } else {
        file.problems.sort_by_key(|p| (p.line, p.column));
        Err(LoadError::Invalid(file.problems))
    }
}

/// One read of the file, and the problems found so far.
struct Reading<'a> {
    path: &'a Path,
    /// The file's text, by lines.
    lines: Lines<'a>,
    plans: &'a [Arc<str>],
    problems: Vec<Problem>,
}

impl Reading<'_> {
    fn problem(&mut self, offset: usize, message: String) {
        let (line, column) = self.lines.at(offset);
        self.problems.push(Problem {
            path: self.path.to_owned(),
            line,
            column,
            message,
        });
    }

    /// One `[[key]]` as the registry takes it, or `None` (reported).
    fn key(&mut self, m: ListedKeyModel) -> Option<Listed> {
        let before = self.problems.len();
        let sha256 = sha256_of(m.sha256.get_ref());
        if sha256.is_none() {
            self.problem(
                m.sha256.span().start,
                "sha256 must be 64 hex digits: the key's SHA-256 (printf %s \"$KEY\" | sha256sum)"
                    .to_owned(),
            );
        }
        if let Err(e) = check_identity(m.identity.get_ref()) {
            self.problem(m.identity.span().start, e.to_string());
        }
        if let Some(plan) = &m.plan
            && !self.plans.iter().any(|p| **p == **plan.get_ref())
        {
            let known = if self.plans.is_empty() {
                format!("none is defined (add [plans.{}])", plan.get_ref())
            } else {
                self.plans.join(", ")
            };
            self.problem(
                plan.span().start,
                format!(
                    "no plan is called {:?}; the plans are {known}",
                    plan.get_ref()
                ),
            );
        }
        if let Some(attributes) = &m.attributes
            && let Err(e) = check_attributes(attributes.get_ref())
        {
            self.problem(attributes.span().start, e.to_string());
        }
        let expires_ms = m.expires.as_ref().and_then(|e| self.expiry(e));
        if let Some(name) = &m.name
            && name.get_ref().len() > MAX_NAME
        {
            self.problem(name.span().start, format!("name: at most {MAX_NAME} bytes"));
        }
        let sha256 = sha256.filter(|_| self.problems.len() == before)?;
        let (line, column) = self.lines.at(m.sha256.span().start);
        Some(Listed {
            sha256,
            at: format!("{}:{line}:{column}", self.path.display()),
            spec: Spec {
                identity: m.identity.into_inner(),
                plan: m.plan.map(Spanned::into_inner),
                attributes: m.attributes.map(Spanned::into_inner).unwrap_or_default(),
                enabled: Some(m.enabled.unwrap_or(true)),
                expires_ms,
                name: m.name.map(Spanned::into_inner),
            },
        })
    }

    /// An RFC 3339 time as ms since the epoch, or `None` (reported).
    fn expiry(&mut self, expires: &Spanned<String>) -> Option<u64> {
        let parsed = expires.get_ref().parse::<jiff::Timestamp>();
        match parsed.map(|t| u64::try_from(t.as_millisecond())) {
            Ok(Ok(ms)) => Some(ms),
            Ok(Err(_)) => {
                self.problem(
                    expires.span().start,
                    "expires: a time after 1970".to_owned(),
                );
                None
            }
            Err(e) => {
                self.problem(
                    expires.span().start,
                    format!("expires must be an RFC 3339 time, as \"2027-01-01T00:00:00Z\": {e}"),
                );
                None
            }
        }
    }
}

/// 64 hex digits (either case) as the 32 bytes they write.
fn sha256_of(text: &str) -> Option<[u8; 32]> {
    text.bytes()
        .all(|b| b.is_ascii_hexdigit())
        .then(|| crate::keys::registry::from_hex(text))
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

    fn read(text: &str) -> Result<KeysFile, String> {
        let plans: Vec<Arc<str>> = vec!["free".into(), "pro".into()];
        parse_keys_file(Path::new("keys.toml"), text, &plans).map_err(|e| e.to_string())
    }

    #[test]
    fn a_listed_key_is_read_with_every_field() {
        let file = read(&format!(
            "[[key]]\nsha256 = \"{SHA}\"\nidentity = \"cust_42\"\nplan = \"pro\"\nattributes = {{ org = \"acme\" }}\nenabled = false\nexpires = \"2027-01-01T00:00:00Z\"\nname = \"CI key\"\n"
        ))
        .expect("a valid file");
        let keys = file.keys.expect("keys listed");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].spec.identity, "cust_42");
        assert_eq!(keys[0].spec.plan.as_deref(), Some("pro"));
        assert_eq!(keys[0].spec.enabled, Some(false));
        assert_eq!(keys[0].spec.expires_ms, Some(1_798_761_600_000));
        assert_eq!(keys[0].at, "keys.toml:2:10");
    }

    #[test]
    fn a_file_listing_nothing_is_not_taken_for_no_keys_unless_it_says_so() {
        assert_eq!(read("").expect("valid").keys, None);
        assert_eq!(read("# all keys moved\n").expect("valid").keys, None);
        assert_eq!(read("key = []\n").expect("valid").keys, Some(Vec::new()));
    }

    #[test]
    fn every_problem_is_named_at_its_line_and_column() {
        let text = format!(
            "[[key]]\nsha256 = \"abc\"\nidentity = \"a\"\n\n[[key]]\nsha256 = \"{SHA}\"\nidentity = \"b\"\nplan = \"gold\"\nexpires = \"soon\"\n\n[[key]]\nsha256 = \"{SHA}\"\nidentity = \"c\"\n"
        );
        let refused = read(&text).expect_err("refused");
        let lines: Vec<&str> = refused.lines().collect();
        assert!(
            lines[0].starts_with("keys.toml:2:10: sha256 must be 64 hex"),
            "{refused}"
        );
        assert!(
            lines[1]
                .starts_with("keys.toml:8:8: no plan is called \"gold\"; the plans are free, pro"),
            "{refused}"
        );
        assert!(
            lines[2].starts_with("keys.toml:9:11: expires must be an RFC 3339"),
            "{refused}"
        );
        assert!(
            lines[3].starts_with("keys.toml:12:10: this key is listed twice (first at line 6)"),
            "{refused}"
        );
        assert_eq!(lines.len(), 4, "{refused}");
    }

    #[test]
    fn bad_toml_and_unknown_fields_are_refused_where_they_are() {
        let refused = read("[[key]]\nsha256 = \n").expect_err("refused");
        assert!(refused.starts_with("keys.toml:2:"), "{refused}");
        let refused = read(&format!(
            "[[key]]\nsha256 = \"{SHA}\"\nidentity = \"a\"\nplna = \"pro\"\n"
        ))
        .expect_err("refused");
        assert!(refused.starts_with("keys.toml:"), "{refused}");
        assert!(refused.contains("plna"), "{refused}");
    }
}
