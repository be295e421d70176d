//! A route's `match.headers`: conditions on request headers, so that
//! routes on one path can serve different classes of client.

use std::collections::BTreeMap;

use http::HeaderValue;
use toml::Spanned;

use super::Validator;
use crate::routes::{HeaderCondition, HeaderTest};

/// The longest regular expression accepted, compiled size included.
const MAX_REGEX: usize = 1 << 20;

impl Validator<'_> {
    /// `headers = { "X-Plan" = "paid", "X-Beta" = true, "X-Client" = { regex = "^mobile/" } }`.
    pub(super) fn header_conditions(
        &mut self,
        model: &BTreeMap<Spanned<String>, Spanned<toml::Value>>,
    ) -> Option<Vec<HeaderCondition>> {
        let mut out = Vec::with_capacity(model.len());
        let mut ok = true;
        for (name, test) in model {
            let Some(header) = self.header_name(name) else {
                ok = false;
                continue;
            };
            let parsed = match test.get_ref() {
                toml::Value::String(value) => match HeaderValue::from_str(value) {
                    Ok(v) => Some(HeaderTest::Equals(v)),
                    Err(_) => {
                        self.problem(test.span(), "not a valid header value");
                        None
                    }
                },
                toml::Value::Boolean(present) => Some(HeaderTest::Present(*present)),
                toml::Value::Table(table) => match (table.get("regex"), table.len()) {
                    (Some(toml::Value::String(pattern)), 1) => {
                        match regex::bytes::RegexBuilder::new(pattern)
                            .size_limit(MAX_REGEX)
                            .build()
                        {
                            Ok(re) => Some(HeaderTest::Regex(re)),
                            Err(e) => {
                                self.problem(test.span(), format!("regex: {e}"));
                                None
                            }
                        }
                    }
                    _ => {
                        self.problem(
                            test.span(),
                            "a header condition table is { regex = \"...\" } and nothing else",
                        );
                        None
                    }
                },
                _ => {
                    self.problem(
                        test.span(),
                        "a header condition is a value (\"paid\"), true (present), false (absent) or { regex = \"...\" }",
                    );
                    None
                }
            };
            match parsed {
                Some(test) => out.push(HeaderCondition { name: header, test }),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }
}
