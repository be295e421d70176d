//! `[[routes]]`: which requests a route takes, what it does with them, and
//! its limits.
//!
//! This module reads the list (unique names, routes hidden by one above
//! them, `standing` naming routes that exist) and each route's model;
//! each of a route's questions is answered in its own module: `matcher`
//! (which requests), `action` (what it does with them), `policy` (what it
//! counts) and `descriptor` (what Envoy's descriptors it decides).

use std::collections::HashSet;
use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

use ipnet::IpNet;

use super::upstreams::{Defaults, NamedUpstreams};
use super::{LimitModel, Server, Validator, answers, clients, concurrency, overrides};
use crate::client::{DEFAULT_MAX_CLIENT_ID, TooLong};
use crate::routes::{KeyExemption, Match, Route};

mod action;
mod descriptor;
mod matcher;
mod policy;

/// The server's exempt networks and keys, which every route adds to.
type Exempt<'a> = (&'a [IpNet], &'a [KeyExemption]);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteModel {
    name: Spanned<String>,
    #[serde(rename = "match", default)]
    matcher: Option<Spanned<matcher::MatchModel>>,
    upstream: Option<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    respond: Option<Spanned<action::RespondModel>>,
    /// Answers the caller's standing on these routes instead.
    standing: Option<Spanned<Vec<Spanned<String>>>>,
    client: Option<Spanned<clients::ClientModel>>,
    /// Where the API key the registry verifies is read.
    api_key: Option<Spanned<super::keys::ApiKeyModel>>,
    cost: Option<Spanned<i64>>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    exempt: Vec<Spanned<String>>,
    limits: Option<Spanned<Vec<Spanned<LimitModel>>>>,
    max_request_body: Option<Spanned<String>>,
    deny: Option<Spanned<answers::DenyModel>>,
    rate_limit_headers: Option<Spanned<String>>,
    /// The shape of floodgate's own answers (default `problem`).
    answers: Option<Spanned<String>>,
    #[serde(default)]
    overrides: Vec<Spanned<overrides::OverrideModel>>,
    #[serde(default)]
    exempt_keys: overrides::ExemptKeysModel,
    concurrency: Option<Spanned<concurrency::ConcurrencyModel>>,
    usage: Option<Spanned<super::usage::UsageModel>>,
    strip_prefix: Option<Spanned<String>>,
    budgets: Option<Spanned<Vec<Spanned<String>>>>,
    plans: Option<Spanned<Vec<Spanned<String>>>>,
    /// Decided for Envoy's descriptors instead of matching requests.
    descriptor: Option<Spanned<descriptor::DescriptorModel>>,
}

impl RouteModel {
    /// The keys given that a descriptor route cannot have, with where.
    fn not_with_descriptor(&self, plans_allowed: bool) -> Vec<(&'static str, Range<usize>)> {
        let span = |s: Option<Range<usize>>| s;
        [
            ("match", span(self.matcher.as_ref().map(Spanned::span))),
            ("upstream", self.upstream.as_ref().map(Spanned::span)),
            ("respond", self.respond.as_ref().map(Spanned::span)),
            ("standing", self.standing.as_ref().map(Spanned::span)),
            ("client", self.client.as_ref().map(Spanned::span)),
            (
                "plans",
                self.plans
                    .as_ref()
                    .filter(|_| !plans_allowed)
                    .map(Spanned::span),
            ),
            ("usage", self.usage.as_ref().map(Spanned::span)),
            ("concurrency", self.concurrency.as_ref().map(Spanned::span)),
        ]
        .into_iter()
        .filter_map(|(key, at)| Some((key, at?)))
        .collect()
    }

    /// The route names plans.
    fn has_plans(&self) -> bool {
        self.plans.as_ref().is_some_and(|p| !p.get_ref().is_empty())
    }

    /// The `key` of each of the route's own limits that has one.
    fn limit_keys(&self) -> impl Iterator<Item = &Spanned<clients::ClientModel>> {
        self.limits
            .iter()
            .flat_map(|l| l.get_ref())
            .filter_map(|l| l.get_ref().key.as_ref())
    }
}

impl Validator<'_> {
    pub(super) fn routes(
        &mut self,
        models: &[Spanned<RouteModel>],
        (server, defaults): (Option<&Server>, Defaults),
        upstreams: &NamedUpstreams,
        catalog: &super::plans::Catalog<'_>,
    ) -> Vec<Route> {
        let mut used = Vec::new();
        let mut names = HashSet::new();
        let mut routes: Vec<Route> = Vec::new();
        let server_exempt = server.map_or((&[][..], &[][..]), |s| (&s.exempt, &s.exempt_keys));
        let long_ids = server.map_or((DEFAULT_MAX_CLIENT_ID, TooLong::Reject), |s| {
            (s.max_client_id, s.on_long_client_id)
        });
        // Every route's name and matcher, even those of routes with other
        // problems: a duplicate name or a route that can never match is
        // reported in the same run as the rest.
        let mut matchers: Vec<(String, Match)> = Vec::new();
        for model in models {
            let span = model.span();
            let name = model.get_ref().name.get_ref();
            let duplicate = !names.insert(name.clone());
            if duplicate {
                self.problem(
                    model.get_ref().name.span(),
                    format!("route name {name:?} is used twice; names must be unique"),
                );
            }
            for (budget, list) in [
                (true, &model.get_ref().budgets),
                (false, &model.get_ref().plans),
            ] {
                for entry in list.iter().flat_map(|l| l.get_ref()) {
                    used.push((budget, entry.span(), entry.get_ref().clone()));
                }
            }
            let (route, matcher) = self.route(
                model.get_ref(),
                span.clone(),
                (upstreams, defaults),
                (server_exempt, long_ids),
                catalog,
            );
            if let Some(matcher) = matcher.filter(|_| !duplicate) {
                let earlier = matchers.iter().find(|(_, m)| m.covers(&matcher));
                if let Some((earlier, _)) = earlier {
                    let message = format!(
                        "route {name:?} can never match: route {earlier:?} above it matches every request it would; move it above {earlier:?} or narrow {earlier:?}"
                    );
                    self.problem(span.clone(), message);
                    continue;
                }
                matchers.push((name.clone(), matcher));
            }
            if let Some(route) = route
                && !duplicate
            {
                routes.push(route);
            }
        }
        self.unused(catalog, &used);
        for model in models {
            for name in model.get_ref().standing.iter().flat_map(|l| l.get_ref()) {
                if !names.contains(name.get_ref()) {
                    self.problem(
                        name.span(),
                        format!(
                            "standing names route {:?}, and there is no route by that name",
                            name.get_ref()
                        ),
                    );
                }
            }
        }
        if models.is_empty() {
            self.problem(
                0..0,
                "there are no routes, so every request would be answered 404: add a [[routes]] table (see config/example.toml)",
            );
        }
        routes
    }

    pub(super) fn route(
        &mut self,
        m: &RouteModel,
        span: Range<usize>,
        (upstreams, defaults): (&NamedUpstreams, Defaults),
        (server_exempt, long_ids): (Exempt<'_>, (usize, TooLong)),
        catalog: &super::plans::Catalog<'_>,
    ) -> (Option<Route>, Option<Match>) {
        let matcher = self.matcher(m.matcher.as_ref());
        let route = self.route_matching(
            m,
            span,
            matcher.clone(),
            (upstreams, defaults),
            (server_exempt, long_ids),
            catalog,
        );
        // Envoy's descriptors reach a descriptor route, never a request:
        // it hides no route below it.
        (route, matcher.filter(|_| m.descriptor.is_none()))
    }

    /// [`Self::route`] once its matcher is known.
    fn route_matching(
        &mut self,
        m: &RouteModel,
        span: Range<usize>,
        matcher: Option<Match>,
        (upstreams, defaults): (&NamedUpstreams, Defaults),
        (server_exempt, long_ids): (Exempt<'_>, (usize, TooLong)),
        catalog: &super::plans::Catalog<'_>,
    ) -> Option<Route> {
        let name = m.name.get_ref();
        let name_ok = self.route_name(&m.name);
        let action = self.action(m, span.clone(), (upstreams, defaults));
        let cx = clients::Context {
            template: matcher
                .as_ref()
                .and_then(|m| m.template.as_ref().map(|(t, _)| t)),
            ignore_case: matcher.as_ref().is_some_and(|m| m.ignore_case),
            long_ids,
        };
        let client = self.client(m.client.as_ref(), &cx);
        let cost = self.route_cost(m.cost.as_ref());
        let usage = match &m.usage {
            None => Some(None),
            Some(u) => self.route_usage(m, u).map(Some),
        };
        let limits = self.route_limits(
            m,
            (name, client.as_ref(), &cx),
            cost.unwrap_or(1),
            usage.as_ref(),
            catalog,
        );
        let (exempt, exempt_keys) = self.route_exempt(m, server_exempt);
        let rate_limit_headers =
            self.header_mode(m.rate_limit_headers.as_ref(), defaults.rate_limit_headers);
        let deny = match &m.deny {
            None => Some(None),
            Some(d) => self.deny(d).map(Some),
        };
        let answers = self.answers(m.answers.as_ref(), m.deny.as_ref());
        let concurrency = match &m.concurrency {
            None => Some(None),
            Some(c) => self.concurrency(c).map(Some),
        };
        if !name_ok {
            return None;
        }
        let max_request_body = match &m.max_request_body {
            None => Some(defaults.max_request_body),
            Some(size) => self.size(size, "max_request_body").map(Some),
        };
        let strip_prefix = self.strip_prefix(m, matcher.as_ref());
        let descriptor = self.route_descriptor(m, defaults.decisions);
        let (policy, plans, overrides) = limits?;
        let (policy, plans) =
            self.descriptor_policies(name, descriptor.as_ref(), policy, plans, &span)?;
        self.answers_seen(
            m,
            span,
            (&policy, &plans, &overrides),
            (&usage, &descriptor, &action),
        )?;
        let limits = (&policy, &plans[..], &overrides[..]);
        let api_key = self.route_api_key(m, (defaults.keys, catalog), client.as_ref(), limits);
        Some(Route {
            api_key: api_key?,
            descriptor: descriptor?,
            strip_prefix: strip_prefix?,
            max_request_body: max_request_body?,
            name: name.as_str().into(),
            matcher: matcher?,
            action: action?,
            client: client?,
            cost: cost?,
            shadow: m.shadow,
            policy,
            plans,
            overrides,
            rate_limit_headers: rate_limit_headers?,
            deny: deny?,
            answers: answers?,
            exempt,
            exempt_keys,
            concurrency: concurrency?,
            usage: usage?,
        })
    }

    /// The route's `api_key`, and whether its rules need one: a route
    /// that counts by the key's registry record must verify the key.
    fn route_api_key(
        &mut self,
        m: &RouteModel,
        (has_registry, catalog): (bool, &super::plans::Catalog<'_>),
        client: Option<&crate::client::ClientRule>,
        (policy, plans, overrides): (
            &crate::routes::Policy,
            &[Option<crate::routes::Policy>],
            &[crate::routes::Override],
        ),
    ) -> Option<Option<crate::keys::KeyFrom>> {
        let api_key = match &m.api_key {
            Some(k) => self.api_key(k, has_registry).map(Some),
            None => Some(None),
        };
        if let (Some(k), Some(_)) = (&m.api_key, &m.descriptor) {
            self.problem(
                k.span(),
                "api_key does not apply to a descriptor route: Envoy's descriptors carry no key; verify keys on the routes requests reach",
            );
        }
        let plans_by_key = m.has_plans()
            && catalog
                .selection
                .as_ref()
                .is_some_and(|s| matches!(s.by, crate::routes::PlanSource::Key));
        let uses_key = plans_by_key || crate::routes::uses_key(client, policy, plans, overrides);
        let has_api_key = api_key.as_ref().is_none_or(Option::is_some);
        self.key_parts_need_api_key(uses_key, has_api_key, m.name.span());
        api_key
    }

    /// A route whose limits count by the answer (`count_when`) sees its
    /// answers, and one whose limits hold requests (`delay`) holds them
    /// itself: one that settles usage from its answers, or is decided for
    /// front proxies, is a problem at `span`.
    fn answers_seen<U, D>(
        &mut self,
        m: &RouteModel,
        span: Range<usize>,
        (policy, plans, overrides): (
            &crate::routes::Policy,
            &[Option<crate::routes::Policy>],
            &[crate::routes::Override],
        ),
        (usage, descriptor, action): (
            &Option<Option<U>>,
            &Option<Option<D>>,
            &Option<crate::routes::Action>,
        ),
    ) -> Option<()> {
        let by_answer = std::iter::once(policy)
            .chain(plans.iter().flatten())
            .chain(overrides.iter().map(|o| &o.policy))
            .any(crate::routes::Policy::counts_by_answer);
        let answerless = match (usage, descriptor, action) {
            (Some(Some(_)), ..) => {
                Some("settles its usage from the answer (count_when gives back whole requests)")
            }
            (_, Some(Some(_)), _) | (.., Some(crate::routes::Action::Decide)) => {
                Some("is decided for front proxies, which do not show floodgate the answer")
            }
            _ => None,
        };
        let front = matches!(
            (descriptor, action),
            (Some(Some(_)), _) | (_, Some(crate::routes::Action::Decide))
        );
        let holds = std::iter::once(policy)
            .chain(plans.iter().flatten())
            .chain(overrides.iter().map(|o| &o.policy))
            .any(|p| p.most_held_ms() > 0);
        if holds && front {
            self.problem(
                span.clone(),
                format!(
                    "route {:?} has a limit with a delay, but it is decided for front proxies, which go on at once; drop the delay, or move the limit to a proxied route",
                    m.name.get_ref()
                ),
            );
            return None;
        }
        if let (true, Some(why)) = (by_answer, answerless) {
            self.problem(
                span,
                format!(
                    "route {:?} has a limit with count_when, but it {why}; count every request on this route, or move the limit to a proxied route",
                    m.name.get_ref()
                ),
            );
            return None;
        }
        Some(())
    }

    /// Whether the route's name may name it in keys, logs and headers.
    fn route_name(&mut self, name: &Spanned<String>) -> bool {
        let ok = valid_name(name.get_ref());
        if !ok {
            self.problem(
                name.span(),
                format!(
                    "route name {:?} may use only letters, digits, '_', '-' and '.' (1 to 64 of them)",
                    name.get_ref()
                ),
            );
        }
        ok
    }

    /// `cost`: how many units a request counts (1 when not given).
    fn route_cost(&mut self, cost: Option<&Spanned<i64>>) -> Option<u64> {
        match cost {
            None => Some(1),
            Some(c) if *c.get_ref() < 1 => {
                self.problem(c.span(), "cost must be a whole number of at least 1");
                None
            }
            Some(c) => Some(*c.get_ref() as u64),
        }
    }

    /// The networks and keys exempt on this route: the server's and its own.
    fn route_exempt(
        &mut self,
        m: &RouteModel,
        (networks, keys): Exempt<'_>,
    ) -> (Vec<IpNet>, Vec<KeyExemption>) {
        let mut exempt = networks.to_vec();
        exempt.extend(self.networks(&m.exempt, "exempt"));
        let mut exempt_keys = keys.to_vec();
        exempt_keys.extend(self.exempt_keys(&m.exempt_keys));
        (exempt, exempt_keys)
    }
}

/// Route names and key prefixes end up in Redis keys, logs and headers.
pub(super) fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}
