//! Plans defined once: which plan a request is on. A plan is a named set
//! of limits that routes refer to (each route keeps its own counts under
//! it); the request's plan is read from a verified token claim, from a
//! header only trusted proxies may set, from the key registry's record of
//! the request's API key, or from a table of client → plan read from a
//! file of its own. The table is live state beside the rules (the gate
//! holds the one in force, replaced whole when the file changes): what the
//! rules compiled from the configuration hold is where it is read and the
//! table as it was read with them.

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::HeaderMap;
use http::header::HeaderName;
use ipnet::IpNet;

use crate::client::{ClientId, ClientRule, Known, Written};

/// How a request's plan is chosen (`[plan_selection]`), and the plans'
/// names.
#[derive(Debug)]
pub struct PlanSelection {
    /// Every plan's name, by index.
    pub names: Vec<Arc<str>>,
    /// Where the plan is read.
    pub by: PlanSource,
    /// The plan of a request none is read for; `None`: the route's own
    /// limits.
    pub default: Option<usize>,
}

/// Where a request's plan is read.
#[derive(Debug)]
pub enum PlanSource {
    /// A claim of the request's bearer token, once verified, names it.
    Claim(Arc<crate::jwt::ClaimRule>),
    /// A header names it; believed only when the peer is one of
    /// `trusted_proxies` (from anyone else it is ignored).
    Header(HeaderName),
    /// The key registry's record of the request's verified API key names
    /// it.
    Key,
    /// A table lists each client's plan.
    Table {
        /// Identifies the client the table is looked up by.
        client: Box<ClientRule>,
        /// The file the table is read from.
        path: PathBuf,
        /// The table as read with the configuration: what is put in force
        /// when these rules are (a change of the file alone replaces the
        /// one in force, not this).
        read: Arc<PlanTable>,
    },
}

/// Clients and their plans, as a table file lists them: values (API
/// keys, claims, addresses) as they are or by their SHA-256, each with
/// its plan's name (so a table read for other plans than the rules in
/// force names none of theirs rather than the wrong one).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PlanTable(Known<Arc<str>>);

impl PlanTable {
    /// Reads a table: one `<client> <plan>` per line (`#` starts a
    /// comment), a client written as it is or as `sha256:<64 hex digits>`,
    /// a plan one of `names`. Every line that is not understood is
    /// returned with its number (from 1) and what is wrong.
    pub fn parse(text: &str, names: &[Arc<str>]) -> Result<Self, Vec<(usize, String)>> {
        let mut table = Known::default();
        let mut problems = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(client), Some(plan), None) = (words.next(), words.next(), words.next())
            else {
                problems.push((i + 1, "expected \"<client> <plan>\"".to_owned()));
                continue;
            };
            let Some(name) = names.iter().find(|n| &***n == plan) else {
                problems.push((
                    i + 1,
                    format!(
                        "no plan is called {plan:?}; the plans are {}",
                        names.join(", ")
                    ),
                ));
                continue;
            };
            match Written::read(client) {
                Some(written) => table.insert(written, Arc::clone(name)),
                None => problems.push((i + 1, "a sha256: client needs 64 hex digits".to_owned())),
            }
        }
        if problems.is_empty() {
            Ok(Self(table))
        } else {
            Err(problems)
        }
    }

    /// The name of the plan the table lists for `client`.
    pub fn plan_of(&self, client: &ClientId) -> Option<&str> {
        self.0.of(client).map(|name| &**name)
    }

    /// How many clients it lists.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it lists none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl PlanSource {
    /// Where the plan is read, as operators read it: `the verified claim
    /// plan`, `header x-plan from trusted proxies`, `the table
    /// /etc/plans.txt (3 clients) by header x-api-key` (the clients of the
    /// table in force, `table`).
    pub fn describe(&self, table: &PlanTable) -> String {
        match self {
            Self::Claim(rule) => format!("the verified claim {}", rule.claim),
            Self::Header(name) => format!("header {name} from trusted proxies"),
            Self::Key => "the API key's record in the key registry".to_owned(),
            Self::Table { client, path, .. } => format!(
                "the table {} ({} clients) by {}",
                path.display(),
                table.len(),
                client.describe()
            ),
        }
    }
}

impl PlanSelection {
    /// The plan of a request with `headers`, from the peer `peer` (whose
    /// address is in `trusted` or not), whose matched path is `path`, whose
    /// verified API key's record names `key_plan`, looked up in `table`
    /// (the client → plan table in force) when plans come from a table:
    /// what its source reads, else the default. A claim or table entry
    /// that names no plan counts as none; so does a header from a peer
    /// that is not a trusted proxy.
    pub fn plan(
        &self,
        headers: &HeaderMap,
        (path, peer, trusted): (&str, IpAddr, &[IpNet]),
        key_plan: Option<&str>,
        table: &ArcSwap<PlanTable>,
    ) -> Option<usize> {
        let read = match &self.by {
            PlanSource::Key => key_plan.and_then(|name| self.index_of(name.as_bytes())),
            PlanSource::Claim(rule) => rule
                .claim(headers)
                .ok()
                .and_then(|name| self.index_of(&name)),
            PlanSource::Header(name) => {
                if crate::client::is_in(peer.to_canonical(), trusted) {
                    let mut values = headers.get_all(name).iter();
                    match (values.next(), values.next()) {
                        (Some(value), None) => self.index_of(value.as_bytes()),
                        _ => None,
                    }
                } else {
                    None
                }
            }
            PlanSource::Table { client, .. } => client
                .identify(headers, path, peer, trusted)
                .ok()
                .and_then(|id| self.index_of(table.load().plan_of(&id)?.as_bytes())),
        };
        read.or(self.default)
    }

    fn index_of(&self, name: &[u8]) -> Option<usize> {
        self.names.iter().position(|n| n.as_bytes() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<Arc<str>> {
        vec!["free".into(), "pro".into()]
    }

    #[test]
    fn a_table_lists_values_and_digests_and_skips_comments() {
        let digest = crate::client::hex(&crate::client::sha256(b"secret-key"));
        let text = format!(
            "# client plan\nkey-1 pro  # a comment\n\n  key-2\tfree\nsha256:{digest} pro\n10.0.0.7 pro\n"
        );
        let table = PlanTable::parse(&text, &names()).expect("a valid table");
        assert_eq!(table.len(), 4);
        assert_eq!(table.plan_of(&ClientId::header("key-1")), Some("pro"));
        assert_eq!(table.plan_of(&ClientId::header("key-2")), Some("free"));
        assert_eq!(table.plan_of(&ClientId::header("secret-key")), Some("pro"));
        assert_eq!(
            table.plan_of(&ClientId::digest_of("secret-key")),
            Some("pro")
        );
        assert_eq!(
            table.plan_of(&ClientId::Addr([10, 0, 0, 7].into())),
            Some("pro")
        );
        assert_eq!(table.plan_of(&ClientId::header("key-3")), None);
    }

    #[test]
    fn every_wrong_line_of_a_table_is_named() {
        let text = "key-1 pro\nkey-2 gold\nkey-3\nsha256:abc free\nkey-4 pro extra\n";
        let problems = PlanTable::parse(text, &names()).expect_err("an invalid table");
        let lines: Vec<usize> = problems.iter().map(|(line, _)| *line).collect();
        assert_eq!(lines, [2, 3, 4, 5]);
        assert!(problems[0].1.contains("\"gold\""), "{}", problems[0].1);
    }
}
