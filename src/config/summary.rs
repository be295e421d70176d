//! What `--check` prints for a valid file: each route's limits and whose
//! count each is, the plans and the budgets, and who uses them, so an
//! operator reads what the file means before it runs.

use std::fmt::Write as _;

use super::Config;
use crate::routes::{PlanSource, Policy, Route};

impl Config {
    /// The file's limits in plain lines: one per route (its own limits),
    /// one per plan a route refers to, then the budgets and the plans.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        let names = self
            .routes
            .plan_selection
            .as_ref()
            .map_or(&[][..], |s| s.names.as_slice());
        let mut budgets: Vec<(String, Vec<String>)> = Vec::new();
        for route in self.routes.iter() {
            let _ = writeln!(
                out,
                "route {}: {}",
                route.name,
                limits(route, &route.policy)
            );
            for (name, policy) in names.iter().zip(&route.plans) {
                if let Some(policy) = policy {
                    let _ = writeln!(out, "  plan {name}: {}", limits(route, policy));
                }
            }
            let drawn = std::iter::once(&route.policy)
                .chain(route.plans.iter().flatten())
                .flat_map(|p| &p.counting)
                .filter_map(|c| c.budget.as_deref());
            for budget in drawn {
                match budgets.iter_mut().find(|(b, _)| b == budget) {
                    Some((_, routes)) if routes.iter().any(|r| **r == *route.name) => {}
                    Some((_, routes)) => routes.push(route.name.to_string()),
                    None => budgets.push((budget.to_owned(), vec![route.name.to_string()])),
                }
            }
        }
        for (budget, routes) in &budgets {
            let _ = writeln!(out, "budget {budget}: drawn from by {}", routes.join(", "));
        }
        if let Some(selection) = &self.routes.plan_selection {
            let by = match &selection.by {
                PlanSource::Claim(rule) => format!("the verified claim {}", rule.claim),
                PlanSource::Header(name) => format!("header {name} from trusted proxies"),
                PlanSource::Table {
                    client,
                    path,
                    table,
                } => format!(
                    "the table {} ({} clients) by {}",
                    path.display(),
                    table.load().len(),
                    client.describe()
                ),
            };
            let default = selection
                .default
                .and_then(|d| selection.names.get(d))
                .map_or("the route's own limits".to_owned(), |d| format!("plan {d}"));
            let _ = writeln!(out, "plans chosen by {by}; without one: {default}");
            for (i, name) in selection.names.iter().enumerate() {
                let routes: Vec<&str> = self
                    .routes
                    .iter()
                    .filter(|r| r.plans.get(i).is_some_and(Option::is_some))
                    .map(|r| &*r.name)
                    .collect();
                let _ = writeln!(out, "plan {name}: on {}", routes.join(", "));
            }
        }
        out
    }
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
            let counting = policy.counting.get(i);
            let whose = match counting.map(|c| &*c.shown) {
                None | Some("client") => format!("per client ({})", route.client.describe()),
                Some("global") => "for everyone together".to_owned(),
                Some(key) => format!("per {key}"),
            };
            let number = match policy.claimed.iter().find(|(at, _)| *at == i) {
                Some((_, c)) => format!(
                    "claim {} (default {}, at most {})",
                    c.rule.claim, c.default, c.ceiling
                ),
                None => limit.limit.to_string(),
            };
            let number = if limit.per_request {
                format!("{number} requests")
            } else {
                number
            };
            let budget = counting
                .and_then(|c| c.budget.as_deref())
                .map_or(String::new(), |b| format!("budget {b}: "));
            format!(
                "{budget}{number} per {} {} {whose}",
                window(limit.window_ms),
                limit.algorithm.name()
            )
        })
        .collect();
    parts.join("; ")
}

/// A window as the file would write it: `"1m"`, `"1d"`, `"250ms"`.
fn window(ms: u64) -> String {
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}
