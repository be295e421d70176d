//! What `--check` prints for a valid file: each route's limits and whose
//! count each is, where it reads the API key it verifies, the plans and
//! the budgets, who uses them, and the key registry, so an operator reads
//! what the file means before it runs.

use std::fmt::Write as _;

use super::Config;
use crate::limit::settings::Store;
use crate::routes::{Policy, Route};

impl Config {
    /// The file's limits in plain lines: one per route (its own limits,
    /// and where it reads the API key it verifies), one per plan a route
    /// refers to, then the budgets, the plans and the key registry.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let names = self
            .routes
            .plan_selection
            .as_ref()
            .map_or(&[][..], |s| s.names.as_slice());
        for route in self.routes.iter() {
            // How the route is reached, when not by the proxy listener.
            let reached = match (&route.descriptor, &route.action) {
                (Some(d), _) => {
                    let entries: Vec<String> = d
                        .entries
                        .iter()
                        .map(|(k, v)| {
                            v.as_ref()
                                .map_or_else(|| k.to_string(), |v| format!("{k}={v}"))
                        })
                        .collect();
                    format!(
                        " (Envoy's descriptors in domain {}: {})",
                        d.domain,
                        entries.join(", ")
                    )
                }
                (None, crate::routes::Action::Decide) => {
                    " (decided for front proxies only)".to_owned()
                }
                _ => String::new(),
            };
            let api_key = route.api_key.as_ref().map_or(String::new(), |from| {
                format!(" (api key: {})", from.describe())
            });
            let _ = writeln!(
                out,
                "route {}{reached}{api_key}: {}",
                route.name,
                limits(route, &route.policy)
            );
            for (name, policy) in names.iter().zip(&route.plans) {
                if let Some(policy) = policy {
                    let _ = writeln!(out, "  plan {name}: {}", limits(route, policy));
                }
            }
        }
        for (budget, routes) in self.routes.budgets() {
            let _ = writeln!(out, "budget {budget}: drawn from by {}", routes.join(", "));
        }
        if let Some(selection) = &self.routes.plan_selection {
            let read = self.plan_table().map(|file| file.read).unwrap_or_default();
            let by = selection.by.describe(&read);
            let default = selection
                .default
                .and_then(|d| selection.names.get(d))
                .map_or("the route's own limits".to_owned(), |d| format!("plan {d}"));
            let _ = writeln!(out, "plans chosen by {by}; without one: {default}");
            for (i, name) in selection.names.iter().enumerate() {
                let routes: Vec<&str> = self.routes.on_plan(i).collect();
                let _ = writeln!(out, "plan {name}: on {}", routes.join(", "));
            }
        }
        if let Some(keys) = &self.keys {
            let _ = writeln!(out, "{}", registry(keys, &self.store));
        }
        out
    }
}

/// The key registry in one line: where its records live, the prefix of
/// the keys it makes, how often it follows the store, its keys file and
/// how many unknown keys an address may send.
fn registry(keys: &crate::keys::Settings, store: &Store) -> String {
    let mut out = match (store, &keys.state_file) {
        (Store::Redis(_), _) => "key registry: in the store".to_owned(),
        (Store::Memory, Some(path)) => format!("key registry: in {}", path.display()),
        (Store::Memory, None) => "key registry: in this instance".to_owned(),
    };
    let _ = write!(out, ", prefix {}", keys.prefix);
    if let Store::Redis(_) = store {
        let every = u64::try_from(keys.sync_every.as_millis()).unwrap_or(u64::MAX);
        let _ = write!(out, ", synced every {}", crate::clock::written(every));
    }
    if let Some(file) = &keys.file {
        let _ = write!(out, ", keys file {}", file.display());
    }
    match keys.failures_per_minute {
        0 => out.push_str(", unknown keys not limited per address"),
        n => {
            let _ = write!(out, ", at most {n} unknown keys a minute per address");
        }
    }
    out
}
/// A policy's limits, each with whose count it is.
fn limits(route: &Route, policy: &Policy) -> String {
    if policy.limits.is_empty() {
        return "not limited".to_owned();
    }
    let parts: Vec<String> = policy
        .limits
        .iter()
        .enumerate()
        .map(|(i, limit)| {
            let terms = policy.terms.get(i);
            let counting = policy.counting_of(i);
            let whose = match counting.map(|c| &*c.shown) {
                None | Some("client") => format!("per client ({})", route.client.describe()),
                Some("global") => "for everyone together".to_owned(),
                Some(key) => format!("per {key}"),
            };
            let number = match terms.and_then(|t| t.claimed.as_ref()) {
                Some(c) => format!(
                    "claim {} (default {}, at most {})",
                    c.rule.claim, c.default, c.ceiling
                ),
                None => limit.limit.to_string(),
            };
            let number = if limit.counts_requests {
                format!("{number} requests")
            } else {
                number
            };
            let budget = counting
                .and_then(|c| c.budget.as_deref())
                .map_or(String::new(), |b| format!("budget {b}: "));
            let per = match terms.and_then(|t| t.calendar.as_ref()) {
                Some(c) => format!("calendar {}", c.describe()),
                None => crate::clock::written(limit.window_ms),
            };
            let leased = limit.lease.map_or(String::new(), |l| {
                let of = if limit.algorithm.has_burst() {
                    "the burst"
                } else {
                    "what remains"
                };
                format!(
                    ", leased ({}ms slices, at most {} of {of})",
                    l.interval_ms,
                    f64::from(l.share_permille) / 1000.0
                )
            });
            let answers = terms
                .and_then(|t| t.count_when.as_ref())
                .map_or(String::new(), |c| {
                    format!(", counting answers with {}", c.describe())
                });
            let answers = match &limit.penalty {
                Some(p) => format!("{answers}, penalty {}", p.describe()),
                None => answers,
            };
            let answers = match limit.delay_ms {
                0 => answers,
                ms => format!(
                    "{answers}, past the burst held up to {} until it fits",
                    crate::clock::written(ms)
                ),
            };
            format!(
                "{budget}{number} per {per} {} {whose}{leased}{answers}",
                limit.algorithm.name()
            )
        })
        .collect();
    parts.join("; ")
}
