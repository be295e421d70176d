//! `[[routes]]`: which requests a route takes, what it does with them, and
//! its limits.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use ipnet::IpNet;

use super::upstreams::Defaults;
use super::{LimitModel, Server, Validator, answers, clients, concurrency, overrides};
use crate::client::ClientRule;
use crate::client::{DEFAULT_MAX_CLIENT_ID, TooLong};
use crate::limit::Limit;
use crate::routes::{Action, Match, Policy, Respond, Route};

/// The server's exempt networks and keys, which every route adds to.
type Exempt<'a> = (&'a [IpNet], &'a [crate::routes::KeyExemption]);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteModel {
    name: Spanned<String>,
    #[serde(rename = "match", default)]
    matcher: Option<Spanned<MatchModel>>,
    upstream: Option<Spanned<String>>,
    upstream_timeout: Option<Spanned<String>>,
    respond: Option<Spanned<RespondModel>>,
    /// Answers the caller's standing on these routes instead.
    standing: Option<Spanned<Vec<Spanned<String>>>>,
    client: Option<Spanned<clients::ClientModel>>,
    cost: Option<Spanned<i64>>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    exempt: Vec<Spanned<String>>,
    limits: Option<Spanned<Vec<Spanned<LimitModel>>>>,
    max_request_body: Option<Spanned<String>>,
    deny: Option<Spanned<answers::DenyModel>>,
    rate_limit_headers: Option<Spanned<String>>,
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
    pub(super) descriptor: Option<Spanned<super::descriptors::DescriptorModel>>,
}

impl RouteModel {
    /// The keys given that a descriptor route cannot have, with where.
    pub(super) fn not_with_descriptor(
        &self,
        plans_allowed: bool,
    ) -> Vec<(&'static str, Range<usize>)> {
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
    pub(super) fn has_plans(&self) -> bool {
        self.plans.as_ref().is_some_and(|p| !p.get_ref().is_empty())
    }

    /// The `key` of each of the route's own limits that has one.
    pub(super) fn limit_keys(&self) -> impl Iterator<Item = &Spanned<clients::ClientModel>> {
        self.limits
            .iter()
            .flat_map(|l| l.get_ref())
            .filter_map(|l| l.get_ref().key.as_ref())
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct MatchModel {
    path_prefix: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    host: Option<Spanned<String>>,
    #[serde(default)]
    ignore_case: bool,
    #[serde(default)]
    headers: BTreeMap<Spanned<String>, Spanned<toml::Value>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RespondModel {
    status: Spanned<i64>,
    #[serde(default)]
    body: String,
    content_type: Option<Spanned<String>>,
}

impl Validator<'_> {
    pub(super) fn routes(
        &mut self,
        models: &[Spanned<RouteModel>],
        (server, defaults): (Option<&Server>, Defaults),
        upstreams: &HashMap<String, Option<crate::proxy::settings::Upstream>>,
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
        (upstreams, defaults): (
            &HashMap<String, Option<crate::proxy::settings::Upstream>>,
            Defaults,
        ),
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
        (upstreams, defaults): (
            &HashMap<String, Option<crate::proxy::settings::Upstream>>,
            Defaults,
        ),
        (server_exempt, long_ids): (Exempt<'_>, (usize, TooLong)),
        catalog: &super::plans::Catalog<'_>,
    ) -> Option<Route> {
        let name = m.name.get_ref();
        let name_ok = valid_name(name);
        if !name_ok {
            self.problem(
                m.name.span(),
                format!(
                    "route name {name:?} may use only letters, digits, '_', '-' and '.' (1 to 64 of them)"
                ),
            );
        }
        let timeout = self.optional_duration(
            m.upstream_timeout.as_ref(),
            "upstream_timeout",
            defaults.timeout,
        );
        let action = match (&m.upstream, &m.respond, &m.standing) {
            (Some(u), None, None) => self
                .route_upstream(u, upstreams, defaults, timeout?)
                .map(Action::Upstream),
            (None, Some(r), None) => {
                if let Some(t) = &m.upstream_timeout {
                    self.problem(t.span(), "upstream_timeout has no meaning with respond");
                }
                self.respond(r).map(Action::Respond)
            }
            (None, None, Some(list)) => {
                if list.get_ref().is_empty() {
                    self.problem(
                        list.span(),
                        "standing lists the routes whose standing the caller reads; name at least one",
                    );
                    None
                } else {
                    Some(Action::Standing(
                        list.get_ref()
                            .iter()
                            .map(|n| Arc::from(n.get_ref().as_str()))
                            .collect(),
                    ))
                }
            }
            // Front proxies ask the decision listener about it; the proxy
            // listener has nothing to do with it.
            (None, None, None) if defaults.decisions || m.descriptor.is_some() => {
                Some(Action::Decide)
            }
            (None, None, None) => {
                self.problem(
                    span.clone(),
                    format!(
                        "route {name:?} needs upstream = \"http://host:port\" or respond = {{ status = 200 }} (or, to be only decided for front proxies, [server] decision_listen)"
                    ),
                );
                None
            }
            (u, r, st) => {
                let given: Vec<(&str, Range<usize>)> = [
                    ("upstream", u.as_ref().map(Spanned::span)),
                    ("respond", r.as_ref().map(Spanned::span)),
                    ("standing", st.as_ref().map(Spanned::span)),
                ]
                .into_iter()
                .filter_map(|(key, at)| Some((key, at?)))
                .collect();
                let names: Vec<&str> = given.iter().map(|(key, _)| *key).collect();
                let which = match names[..] {
                    [a, b] => format!("both {a} and {b}"),
                    _ => "upstream, respond and standing".to_owned(),
                };
                let at = given.first().map_or(span.clone(), |(_, at)| at.clone());
                self.problem(at, format!("route {name:?} has {which}; keep one"));
                None
            }
        };
        let cx = clients::Context {
            template: matcher
                .as_ref()
                .and_then(|m| m.template.as_ref().map(|(t, _)| t)),
            ignore_case: matcher.as_ref().is_some_and(|m| m.ignore_case),
            long_ids,
        };
        let client = self.client(m.client.as_ref(), &cx);
        let cost = match &m.cost {
            None => Some(1),
            Some(c) if *c.get_ref() < 1 => {
                self.problem(c.span(), "cost must be a whole number of at least 1");
                None
            }
            Some(c) => Some(*c.get_ref() as u64),
        };
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
        let mut exempt = server_exempt.0.to_vec();
        exempt.extend(self.networks(&m.exempt, "exempt"));
        let mut exempt_keys = server_exempt.1.to_vec();
        exempt_keys.extend(self.exempt_keys(&m.exempt_keys));
        let rate_limit_headers =
            self.header_mode(m.rate_limit_headers.as_ref(), defaults.rate_limit_headers);
        let deny = match &m.deny {
            None => Some(None),
            Some(d) => self.deny(d).map(Some),
        };
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
        let (policy, plans) = match &descriptor {
            Some(Some(_)) => {
                let policy = self.descriptor_policy(name, policy, span.clone());
                let plans: Option<Vec<Option<Policy>>> = plans
                    .into_iter()
                    .map(|plan| match plan {
                        Some(p) => self.descriptor_policy(name, p, span.clone()).map(Some),
                        None => Some(None),
                    })
                    .collect();
                (policy?, plans?)
            }
            _ => (policy, plans),
        };
        Some(Route {
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
            exempt,
            exempt_keys,
            concurrency: concurrency?,
            usage: usage?,
        })
    }

    /// A route's limits: its own and each plan's (with the budgets it
    /// draws from), and its overrides'; a metered route's reservations
    /// must fit them all.
    fn route_limits(
        &mut self,
        m: &RouteModel,
        (name, client, cx): (&str, Option<&ClientRule>, &clients::Context<'_>),
        cost: u64,
        usage: Option<&Option<std::sync::Arc<crate::usage::settings::Settings>>>,
        catalog: &super::plans::Catalog<'_>,
    ) -> Option<(Policy, Vec<Option<Policy>>, Vec<crate::routes::Override>)> {
        let draws = super::plans::Draws {
            budgets: m.budgets.as_ref(),
            plans: m.plans.as_ref(),
        };
        let policies =
            self.route_policies(name, m.limits.as_ref(), cost, client, cx, &draws, catalog);
        let budgets_only = super::plans::Draws {
            budgets: m.budgets.as_ref(),
            plans: None,
        };
        let override_policies: Vec<Option<Policy>> = m
            .overrides
            .iter()
            .map(|o| {
                self.route_policies(
                    name,
                    Some(o.get_ref().limits()),
                    cost,
                    client,
                    cx,
                    &budgets_only,
                    catalog,
                )
                .map(|(p, _)| p)
            })
            .collect();
        let overrides = self.overrides(&m.overrides, client, override_policies);
        if let (Some(Some(u)), Some((policy, plans)), Some(overrides), Some(model)) =
            (usage, &policies, &overrides, &m.usage)
        {
            let all = plans.iter().flatten().chain(std::iter::once(policy));
            self.reservations_fit(u, model.span(), all, overrides);
        }
        if let Some(first) = m.overrides.first()
            && m.limits.as_ref().is_none_or(|l| l.get_ref().is_empty())
        {
            self.problem(
                first.span(),
                "overrides change a route's limits, and this route has none; give it limits",
            );
        }
        let (policy, plans) = policies?;
        Some((policy, plans, overrides?))
    }

    /// A route's `strip_prefix`: a path of whole segments (`/api`), on a
    /// route that forwards, which its `path_prefix` (if any) begins with,
    /// so that it applies to every request the route matches.
    fn strip_prefix(
        &mut self,
        m: &RouteModel,
        matcher: Option<&Match>,
    ) -> Option<Option<Box<str>>> {
        let Some(prefix) = &m.strip_prefix else {
            return Some(None);
        };
        let text = prefix.get_ref();
        if !text.starts_with('/') || text.len() < 2 || text.ends_with('/') || text.contains("//") {
            self.problem(
                prefix.span(),
                format!("strip_prefix {text:?} must be a path of whole segments, like \"/api\" or \"/api/v1\" (starting with '/', not ending with one)"),
            );
            return None;
        }
        if m.upstream.is_none() {
            self.problem(
                prefix.span(),
                "strip_prefix applies only to a route with an upstream",
            );
            return None;
        }
        if let Some(path_prefix) = matcher.and_then(|m| m.path_prefix.as_deref()) {
            let covered = path_prefix
                .get(..text.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(text))
                && matches!(path_prefix.as_bytes().get(text.len()), None | Some(b'/'));
            if !covered {
                self.problem(
                    prefix.span(),
                    format!("strip_prefix {text:?} is not where the route's path_prefix {path_prefix:?} begins, so some requests would keep it; use a prefix of the path_prefix"),
                );
                return None;
            }
        }
        Some(Some(text.as_str().into()))
    }

    /// A metered request costs up to its largest reservation: that must
    /// fit every limit of the route and of its overrides.
    fn reservations_fit<'p>(
        &mut self,
        usage: &crate::usage::settings::Settings,
        span: Range<usize>,
        policies: impl Iterator<Item = &'p crate::routes::Policy>,
        overrides: &[crate::routes::Override],
    ) {
        let capacities = policies
            .flat_map(|p| p.limits.iter())
            .chain(overrides.iter().flat_map(|o| o.policy.limits.iter()))
            .filter(|l| !l.per_request)
            .map(Limit::capacity);
        if let Some(least) = capacities.min()
            && usage.max_reserve > least
        {
            self.problem(
                span,
                format!(
                    "usage may reserve {} units (max_reserve, or reserve), more than a limit of this route allows at once ({least}), so such a request could never pass; lower max_reserve or raise the limit",
                    usage.max_reserve
                ),
            );
        }
    }

    /// A route's `[routes.usage]`, where it can have a meaning: the route
    /// forwards, is limited, and has no fixed `cost`.
    fn route_usage(
        &mut self,
        m: &RouteModel,
        usage: &Spanned<super::usage::UsageModel>,
    ) -> Option<std::sync::Arc<crate::usage::settings::Settings>> {
        let settings = self.usage(usage)?;
        let problem = if m.cost.is_some() {
            Some("a route with usage takes its cost from its upstream's reports; remove cost")
        } else if m.respond.is_some() {
            Some("usage is reported by an upstream, and this route answers itself; remove usage")
        } else if m.limits.as_ref().is_none_or(|l| l.get_ref().is_empty())
            && m.budgets.as_ref().is_none_or(|b| b.get_ref().is_empty())
            && m.plans.as_ref().is_none_or(|p| p.get_ref().is_empty())
        {
            Some(
                "usage is counted against limits, and this route has none; give it limits or budgets",
            )
        } else {
            None
        };
        match problem {
            Some(message) => {
                self.problem(usage.span(), message);
                None
            }
            None => Some(settings),
        }
    }

    pub(super) fn matcher(&mut self, model: Option<&Spanned<MatchModel>>) -> Option<Match> {
        let default = MatchModel::default();
        let m = model.map_or(&default, Spanned::get_ref);
        let mut ok = true;
        let check_path = |v: &mut Self, p: &Spanned<String>, key: &str| -> Option<String> {
            let s = p.get_ref();
            if !s.starts_with('/') {
                v.problem(p.span(), format!("{key} must start with '/'"));
                return None;
            }
            if s.contains(';') {
                v.problem(
                    p.span(),
                    format!(
                        "{key} {s:?} has ';': requests are matched without their ;parameters, so write the path without them"
                    ),
                );
                return None;
            }
            let normal = crate::routes::normalize_path(s);
            if normal != *s && !s.contains('{') {
                v.problem(
                    p.span(),
                    format!(
                        "{key} {s:?} is not in normal form (requests are matched after normalising); write {normal:?}"
                    ),
                );
                return None;
            }
            Some(s.clone())
        };
        let path_prefix = match &m.path_prefix {
            Some(p) => {
                let r = check_path(self, p, "path_prefix");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        let path = match &m.path {
            Some(p) => {
                let r = check_path(self, p, "path");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        if let (Some(_), Some(p)) = (&m.path_prefix, &m.path) {
            self.problem(p.span(), "match has both path and path_prefix; keep one");
            ok = false;
        }
        // A path with {param} segments is a template, matched segment by
        // segment instead.
        let mut template = None;
        for (text, spanned, prefix) in [
            (&path, &m.path, false),
            (&path_prefix, &m.path_prefix, true),
        ] {
            let (Some(text), Some(spanned)) = (text, spanned) else {
                continue;
            };
            match crate::routes::Template::parse(text) {
                Ok(None) => {}
                Ok(Some(t)) => template = Some((t, prefix)),
                Err(e) => {
                    self.problem(spanned.span(), e);
                    ok = false;
                }
            }
        }
        let (path, path_prefix) = match &template {
            Some(_) => (None, None),
            None => (path, path_prefix),
        };
        let headers = self.header_conditions(&m.headers);
        ok &= headers.is_some();
        let mut methods = Vec::new();
        if let Some(list) = &m.methods {
            if list.get_ref().is_empty() {
                self.problem(
                    list.span(),
                    "methods is empty, so the route would match nothing; remove the key to match every method",
                );
                ok = false;
            }
            for method in list.get_ref() {
                match http::Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes()) {
                    Ok(parsed) => methods.push(parsed),
                    Err(_) => {
                        self.problem(
                            method.span(),
                            format!("{:?} is not an HTTP method", method.get_ref()),
                        );
                        ok = false;
                    }
                }
            }
        }
        methods.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        methods.dedup();
        let host = match &m.host {
            Some(h) => match crate::routes::HostMatch::parse(h.get_ref()) {
                Some(host) => Some(host),
                None => {
                    self.problem(
                        h.span(),
                        format!("host {:?} is not a host name such as \"api.example.com\" or \"api.example.com:8080\"", h.get_ref()),
                    );
                    ok = false;
                    None
                }
            },
            None => None,
        };
        ok.then_some(Match {
            path_prefix,
            path,
            template,
            headers: headers.unwrap_or_default(),
            methods,
            host,
            ignore_case: m.ignore_case,
        })
    }

    pub(super) fn respond(&mut self, r: &Spanned<RespondModel>) -> Option<Respond> {
        let m = r.get_ref();
        let status = match u16::try_from(*m.status.get_ref())
            .ok()
            .and_then(|s| http::StatusCode::from_u16(s).ok())
        {
            Some(s) => Some(s),
            None => {
                self.problem(
                    m.status.span(),
                    "status must be an HTTP status code from 100 to 999",
                );
                None
            }
        };
        let content_type = self.content_type(m.content_type.as_ref(), "content_type");
        Some(Respond {
            status: status?,
            body: bytes::Bytes::from(m.body.clone()),
            content_type: content_type?,
        })
    }
}

/// Route names and key prefixes end up in Redis keys, logs and headers.
pub(super) fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}
