//! A route's `descriptor`: the descriptors of Envoy's rate limit service
//! protocol it decides (`{ domain = "edge", entries = ["generic_key=api",
//! "user_id"] }`), and what such a route cannot also say.
//!
//! A descriptor route is asked only by Envoy, on the decision listener:
//! it has no `match`, `upstream`, `respond` or `standing` (it forwards
//! nothing), no `client` (whose count it is comes from the descriptor's
//! values), no `plans`, `usage` or `concurrency` (a descriptor carries no
//! header, body or request end to read them from), and its limits count
//! the descriptor's values or the whole route (`key = { from = "global" }`).

use serde::Deserialize;
use toml::Spanned;

use super::{RouteModel, Validator};
use crate::routes::{Descriptor, DescriptorEntry, Policy};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DescriptorModel {
    domain: Spanned<String>,
    entries: Spanned<Vec<Spanned<String>>>,
    /// The key of the entry whose value names the route's plan.
    plan: Option<Spanned<String>>,
}

impl Validator<'_> {
    /// The route's descriptor, if it has one: `Some(None)` when it has
    /// none, `None` after a problem.
    pub(super) fn route_descriptor(
        &mut self,
        m: &RouteModel,
        decisions: bool,
    ) -> Option<Option<Descriptor>> {
        let Some(model) = m.descriptor.as_ref() else {
            return Some(None);
        };
        let d = model.get_ref();
        let mut ok = true;
        if !decisions {
            self.problem(
                model.span(),
                "a descriptor route is asked by Envoy on the decision listener: set [server] decision_listen and decision_peers",
            );
            ok = false;
        }
        for (key, given) in m.not_with_descriptor(d.plan.is_some()) {
            self.problem(
                given,
                format!("{key} has no meaning on a descriptor route: {}", why(key)),
            );
            ok = false;
        }
        for key in m.limit_keys() {
            if !matches!(key.get_ref().names_global(), Some(true)) {
                self.problem(
                    key.span(),
                    "a descriptor route's limit counts the descriptor's values (no key) or the whole route (key = { from = \"global\" }); a descriptor carries nothing else",
                );
                ok = false;
            }
        }
        if d.domain.get_ref().is_empty() {
            self.problem(
                d.domain.span(),
                "domain is empty: name the domain Envoy's rate limit filter sends",
            );
            ok = false;
        }
        let entries = self.descriptor_entries(&d.entries);
        ok &= entries.is_some();
        let entries = entries.unwrap_or_default();
        if let Some(plan) = &d.plan {
            let key = plan.get_ref().as_str();
            if !entries.is_empty() && !entries.iter().any(|(k, v)| &**k == key && v.is_none()) {
                self.problem(
                    plan.span(),
                    format!("plan names the entry whose value chooses the plan: {key:?} must be one of entries, without a fixed value"),
                );
                ok = false;
            }
            if !m.has_plans() {
                self.problem(
                    plan.span(),
                    "plan chooses among the route's plans, and it has none: give it plans = [...]",
                );
                ok = false;
            }
        }
        ok.then(|| {
            Some(Descriptor {
                domain: d.domain.get_ref().as_str().into(),
                entries,
                plan: d.plan.as_ref().map(|p| p.get_ref().as_str().into()),
            })
        })
    }
}

impl Validator<'_> {
    /// The route's policy and its plans', each with its counts named as a
    /// descriptor route's decisions key them (as they are on any other
    /// route).
    pub(super) fn descriptor_policies(
        &mut self,
        route: &str,
        descriptor: Option<&Option<Descriptor>>,
        policy: Policy,
        plans: Vec<Option<Policy>>,
        span: &std::ops::Range<usize>,
    ) -> Option<(Policy, Vec<Option<Policy>>)> {
        let Some(Some(_)) = descriptor else {
            return Some((policy, plans));
        };
        let policy = self.descriptor_policy(route, policy, span.clone());
        let plans: Option<Vec<Option<Policy>>> = plans
            .into_iter()
            .map(|plan| match plan {
                Some(p) => self.descriptor_policy(route, p, span.clone()).map(Some),
                None => Some(None),
            })
            .collect();
        Some((policy?, plans?))
    }

    /// A descriptor route's `policy` with every limit's count named (the
    /// descriptor's values, or the whole route), as its decisions key
    /// them; a limit counting anything else (a budget's limit keyed by a
    /// header) is a problem at `span`.
    fn descriptor_policy(
        &mut self,
        route: &str,
        policy: crate::routes::Policy,
        span: std::ops::Range<usize>,
    ) -> Option<crate::routes::Policy> {
        use crate::routes::{Counting, KeySource, LimitTerms};
        let policy = if policy.counting().is_some() {
            policy
        } else {
            let scope: std::sync::Arc<str> = route.into();
            let terms = policy
                .limits
                .iter()
                .zip(policy.terms.iter())
                .enumerate()
                .map(|(i, (limit, terms))| LimitTerms {
                    counting: Some(Counting {
                        scope: std::sync::Arc::clone(&scope),
                        entry: format!(
                            "{scope}#{i}:{}:{}",
                            limit.algorithm.name(),
                            limit.window_ms
                        )
                        .into(),
                        index: i,
                        key: KeySource::Client,
                        shown: "descriptor value".into(),
                        budget: None,
                    }),
                    ..terms.clone()
                })
                .collect();
            crate::routes::Policy::with_terms(policy.limits, terms)
        };
        let other = policy
            .counting()
            .into_iter()
            .flatten()
            .find(|c| match &c.key {
                KeySource::Client => false,
                KeySource::Rule(rule) => rule.parts != [crate::client::Part::Global],
            });
        if let Some(c) = other {
            self.problem(
                span,
                format!(
                    "route {route:?} is a descriptor route, and a limit it draws counts {}: a descriptor carries only its values; count them, or the whole route",
                    c.shown
                ),
            );
            return None;
        }
        Some(policy)
    }
}

impl Validator<'_> {
    /// A descriptor's entries, each key and its fixed value if any;
    /// `None` after a problem.
    fn descriptor_entries(
        &mut self,
        list: &Spanned<Vec<Spanned<String>>>,
    ) -> Option<Vec<DescriptorEntry>> {
        if list.get_ref().is_empty() {
            self.problem(
                list.span(),
                "entries is empty: list the descriptor's keys in order, each \"key\" (counted per value) or \"key=value\"",
            );
            return None;
        }
        let mut ok = true;
        let mut entries = Vec::new();
        for entry in list.get_ref() {
            let text = entry.get_ref();
            let (key, value) = match text.split_once('=') {
                Some((key, value)) => (key, Some(value)),
                None => (text.as_str(), None),
            };
            if key.is_empty() || value.is_some_and(str::is_empty) {
                self.problem(
                    entry.span(),
                    format!("entry {text:?} must be \"key\" or \"key=value\", neither part empty"),
                );
                ok = false;
                continue;
            }
            entries.push((key.into(), value.map(Into::into)));
        }
        ok.then_some(entries)
    }
}

/// Why a route key does not go with `descriptor`.
fn why(key: &str) -> &'static str {
    match key {
        "match" => "Envoy's descriptors choose it, never an HTTP request",
        "upstream" | "respond" | "standing" => "it is only decided, never forwarded or answered",
        "client" => "whose count it is comes from the values of the entries it does not fix",
        "plans" => {
            "a descriptor carries no header or token to choose a plan by; name the entry that does (descriptor = { …, plan = \"KEY\" })"
        }
        "usage" => "a descriptor carries no answer to report units",
        _ => "floodgate never sees the request's end",
    }
}
