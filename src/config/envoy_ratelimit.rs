//! envoyproxy/ratelimit's configuration (one YAML document a domain)
//! translated into floodgate's descriptor routes, for
//! `floodgate --from-envoy-ratelimit FILE…`: each node of a domain's
//! descriptor tree that has a `rate_limit` becomes a route whose entries
//! are the keys (and fixed values) on the way to it, with a fixed window
//! of one unit, as that service counts. What floodgate cannot express the
//! same way is refused, naming the key and where it is.
//!
//! The order of the routes keeps the service's preference for a node
//! with the descriptor's value over a sibling with its key alone: at each
//! level, fixed values come first, and floodgate takes the first route
//! that matches. One difference remains, and is stated in the output when
//! a tree has it: where the service stops at a value's node whose children
//! do not match, floodgate goes on to the key-only sibling's routes.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Deserialize;

/// One YAML document of the service's configuration.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DomainModel {
    domain: String,
    #[serde(default)]
    descriptors: Vec<NodeModel>,
}

/// A node of the descriptor tree. Keys floodgate cannot express are read
/// so that they are refused by name rather than as unknown.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeModel {
    key: String,
    value: Option<String>,
    rate_limit: Option<RateLimitModel>,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    descriptors: Vec<NodeModel>,
    /// Metrics naming only: floodgate's metrics are per route.
    #[serde(default)]
    detailed_metric: bool,
    /// Metrics naming only.
    #[serde(default)]
    value_to_metric: bool,
    share_threshold: Option<serde_yaml_ng::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RateLimitModel {
    unit: Option<String>,
    requests_per_unit: Option<u64>,
    #[serde(default)]
    unlimited: bool,
    /// A name for `replaces`; metrics only otherwise.
    name: Option<String>,
    replaces: Option<serde_yaml_ng::Value>,
}

/// Why a file cannot be translated, each problem with where it is.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.join("\n"))]
pub struct TranslateError(pub Vec<String>);

/// One route the translation makes.
struct Made {
    name: String,
    domain: String,
    entries: Vec<String>,
    limit: Option<(u64, &'static str)>,
    shadow: bool,
}

/// The TOML routes for the YAML documents of `files` (name, text), in
/// order; or every problem found, each naming its file and where in it.
pub fn translate(files: &[(String, String)]) -> Result<String, TranslateError> {
    let mut problems = Vec::new();
    let mut routes = Vec::new();
    let mut notes = Vec::new();
    for (file, text) in files {
        for document in serde_yaml_ng::Deserializer::from_str(text) {
            let model = match DomainModel::deserialize(document) {
                Ok(model) => model,
                Err(e) => {
                    problems.push(format!("{file}: {e}"));
                    continue;
                }
            };
            let mut walk = Walk {
                file,
                domain: &model.domain,
                problems: &mut problems,
                routes: &mut routes,
                notes: &mut notes,
            };
            walk.level(&model.descriptors, &mut Vec::new(), "descriptors");
        }
    }
    let mut names = BTreeMap::new();
    for route in &mut routes {
        let n = names.entry(route.name.clone()).or_insert(0);
        *n += 1;
        if *n > 1 {
            route.name = format!("{}-{n}", route.name);
        }
    }
    if !problems.is_empty() {
        return Err(TranslateError(problems));
    }
    Ok(toml(&routes, &notes))
}

/// The translation's state while walking one domain's tree.
struct Walk<'a> {
    file: &'a str,
    domain: &'a str,
    problems: &'a mut Vec<String>,
    routes: &'a mut Vec<Made>,
    notes: &'a mut Vec<String>,
}

impl Walk<'_> {
    /// The nodes of one level, fixed values before keys alone.
    fn level(&mut self, nodes: &[NodeModel], path: &mut Vec<String>, at: &str) {
        let mut order: Vec<(usize, &NodeModel)> = nodes.iter().enumerate().collect();
        order.sort_by_key(|(_, n)| n.value.is_none());
        for (i, node) in order {
            let here = format!("{at}[{i}]");
            if node.value.is_some()
                && !node.descriptors.is_empty()
                && nodes
                    .iter()
                    .any(|n| n.key == node.key && n.value.is_none() && !n.descriptors.is_empty())
            {
                self.notes.push(format!(
                    "{}: domain {:?}, {here}: where the service stops at {}={} when its children do not match, floodgate goes on to the routes under {} alone",
                    self.file,
                    self.domain,
                    node.key,
                    node.value.as_deref().unwrap_or_default(),
                    node.key
                ));
            }
            self.node(node, path, &here);
        }
    }

    fn node(&mut self, node: &NodeModel, path: &mut Vec<String>, at: &str) {
        let mut refuse = |what: &str, why: &str| {
            self.problems.push(format!(
                "{}: domain {:?}, {at}.{what}: {why}",
                self.file, self.domain
            ));
        };
        if node.key.is_empty() || node.key.contains('=') {
            refuse("key", "must be a key without '='");
        }
        match &node.value {
            Some(v) if v.ends_with('*') => refuse(
                "value",
                "a value matching by prefix (ending in '*') has no equivalent: floodgate matches a descriptor's values exactly, or any value",
            ),
            Some(v) if v.is_empty() => refuse("value", "is empty: leave it out to match any value"),
            _ => {}
        }
        if node.share_threshold.is_some() {
            refuse(
                "share_threshold",
                "goes with values matching by prefix, which floodgate does not have",
            );
        }
        let _ = (node.detailed_metric, node.value_to_metric);
        path.push(match &node.value {
            Some(v) => format!("{}={v}", node.key),
            None => node.key.clone(),
        });
        if let Some(rate) = &node.rate_limit {
            self.rate_limit(rate, node.shadow_mode, path, at);
        }
        let below = format!("{at}.descriptors");
        self.level(&node.descriptors, path, &below);
        path.pop();
    }

    fn rate_limit(&mut self, rate: &RateLimitModel, shadow: bool, path: &[String], at: &str) {
        let mut refuse = |what: &str, why: String| {
            self.problems.push(format!(
                "{}: domain {:?}, {at}.rate_limit.{what}: {why}",
                self.file, self.domain
            ));
        };
        if rate.replaces.is_some() {
            refuse(
                "replaces",
                "one limit replacing others has no equivalent: floodgate decides every limit of every descriptor, all or nothing".into(),
            );
        }
        let _ = &rate.name;
        let limit = if rate.unlimited {
            None
        } else {
            let window = match rate.unit.as_deref().map(str::to_ascii_lowercase).as_deref() {
                Some("second") => Some("1s"),
                Some("minute") => Some("1m"),
                Some("hour") => Some("1h"),
                Some("day") => Some("1d"),
                Some(unit @ ("week" | "month" | "year")) => {
                    refuse(
                        "unit",
                        format!(
                            "{unit} is counted by the service in its own way; write floodgate's calendar window (window = \"{unit}\") by hand, knowing its boundaries follow the calendar"
                        ),
                    );
                    None
                }
                Some(other) => {
                    refuse(
                        "unit",
                        format!("{other:?} is not second, minute, hour or day"),
                    );
                    None
                }
                None => {
                    refuse("unit", "is missing".into());
                    None
                }
            };
            let per_unit = match rate.requests_per_unit {
                Some(n) if n > 0 => Some(n),
                _ => {
                    refuse(
                        "requests_per_unit",
                        "must be at least 1 (unlimited: true for no limit)".into(),
                    );
                    None
                }
            };
            match (per_unit, window) {
                (Some(n), Some(w)) => Some((n, w)),
                _ => return,
            }
        };
        self.routes.push(Made {
            name: route_name(self.domain, path),
            domain: self.domain.to_owned(),
            entries: path.to_vec(),
            limit,
            shadow,
        });
    }
}

/// A route name from the domain and entries: floodgate's names are
/// letters, digits, '_', '-' and '.', at most 64.
fn route_name(domain: &str, path: &[String]) -> String {
    let raw = std::iter::once(domain.to_owned())
        .chain(path.iter().cloned())
        .collect::<Vec<_>>()
        .join(".");
    let mut name: String = raw
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.') {
                c
            } else {
                '_'
            }
        })
        .collect();
    name.truncate(60);
    name
}

/// A TOML string.
fn quoted(text: &str) -> String {
    toml::Value::String(text.to_owned()).to_string()
}

fn toml(routes: &[Made], notes: &[String]) -> String {
    let mut out = String::from(
        "# Translated from envoyproxy/ratelimit's configuration by floodgate --from-envoy-ratelimit.\n\
         # Put these routes in a file whose [server] has decision_listen and decision_peers\n\
         # (Envoy's address), and point Envoy's rate_limit_service at the decision listener.\n",
    );
    for note in notes {
        let _ = writeln!(out, "# Note: {note}");
    }
    for route in routes {
        let entries: Vec<String> = route.entries.iter().map(|e| quoted(e)).collect();
        let _ = write!(
            out,
            "\n[[routes]]\nname = {}\ndescriptor = {{ domain = {}, entries = [{}] }}\n",
            quoted(&route.name),
            quoted(&route.domain),
            entries.join(", ")
        );
        match route.limit {
            Some((n, window)) => {
                let _ = writeln!(
                    out,
                    "limits = [{{ algorithm = \"fixed_window\", limit = {n}, window = \"{window}\" }}]"
                );
            }
            None => out.push_str("# unlimited: decided OK, counted nowhere\n"),
        }
        if route.shadow {
            out.push_str("shadow = true\n");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(text: &str) -> Result<String, TranslateError> {
        translate(&[("ratelimit.yaml".into(), text.into())])
    }

    #[test]
    fn each_limited_node_becomes_a_route_values_first() {
        let out = one("domain: edge\n\
             descriptors:\n\
             \x20 - key: remote_address\n\
             \x20   rate_limit: { unit: minute, requests_per_unit: 60 }\n\
             \x20 - key: generic_key\n\
             \x20   descriptors:\n\
             \x20     - key: user\n\
             \x20       rate_limit: { unit: hour, requests_per_unit: 1000 }\n\
             \x20 - key: generic_key\n\
             \x20   value: api\n\
             \x20   shadow_mode: true\n\
             \x20   rate_limit: { unit: second, requests_per_unit: 5 }\n\
             \x20 - key: health\n\
             \x20   rate_limit: { unlimited: true }\n")
        .expect("translates");
        let api = out.find("\"generic_key=api\"").expect("the value's route");
        let user = out
            .find("\"generic_key\", \"user\"")
            .expect("the key's route");
        assert!(api < user, "{out}");
        assert!(out.contains("limit = 60, window = \"1m\""), "{out}");
        assert!(
            out.contains("limit = 5, window = \"1s\" }]\nshadow = true"),
            "{out}"
        );
        assert!(out.contains("# unlimited"), "{out}");
        let parsed: toml::Value = toml::from_str(&out).expect("valid TOML");
        assert_eq!(parsed["routes"].as_array().map(Vec::len), Some(4));
    }

    #[test]
    fn what_floodgate_cannot_express_is_refused_by_name() {
        let err = one("domain: edge\n\
             descriptors:\n\
             \x20 - key: path\n\
             \x20   value: /api/*\n\
             \x20   rate_limit: { unit: minute, requests_per_unit: 1 }\n\
             \x20 - key: user\n\
             \x20   rate_limit: { unit: month, requests_per_unit: 1, replaces: [{ name: x }] }\n")
        .expect_err("refused");
        let text = err.to_string();
        assert!(
            text.contains("descriptors[0].value: a value matching by prefix"),
            "{text}"
        );
        assert!(
            text.contains("descriptors[1].rate_limit.replaces"),
            "{text}"
        );
        assert!(
            text.contains("descriptors[1].rate_limit.unit: month"),
            "{text}"
        );
        // A key the translation does not know is named with its place.
        let unknown = one("domain: edge\ndescriptors:\n  - key: org\n    quota_mode: true\n")
            .expect_err("refused")
            .to_string();
        assert!(unknown.contains("unknown field `quota_mode`"), "{unknown}");
        assert!(unknown.contains("line 4 column 5"), "{unknown}");
    }
}
