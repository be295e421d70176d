//! The compiled rule table: which route a request belongs to.
//!
//! Routes are tried in file order and the first match wins. Matching happens
//! on a normalised path (see [`request_paths`]) so that `/api/../login`,
//! `//login` and `/%6Cogin` all meet the `/login` route's limit, and that
//! same normalised path is what the upstream receives: the path that decided
//! the route is the path the upstream acts on.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::Authority;
use http::{HeaderValue, Method, StatusCode};
use ipnet::IpNet;

use crate::client::{ClientId, ClientRule};

mod answers;
mod count_when;
mod descriptor;
mod keyed;
mod path;
mod plans;
mod policy;
mod template;

pub use answers::{Answers, DenyCode};
pub use count_when::CountWhen;
pub use descriptor::{Descriptor, Entry as DescriptorEntry};
pub use keyed::uses_key;
pub use path::{EscapedSlashes, PathError, normalize_path, request_paths};
pub use plans::{PlanSelection, PlanSource, PlanTable};
pub use policy::{
    Anchor, CalendarLimit, ClaimedLimit, ClientSet, Counting, DenyAnswer, HeaderMode, KeyExemption,
    KeySource, LimitTerms, Override, Policy,
};
pub use template::{Segment, Template};

/// The compiled routes of one configuration, in file order.
#[derive(Debug, Clone, Default)]
pub struct Table {
    routes: Vec<Arc<Route>>,
    /// How a request's plan is chosen, when the file defines plans.
    pub plan_selection: Option<Arc<PlanSelection>>,
}

/// One `[[routes]]` entry, compiled.
#[derive(Debug, Clone)]
pub struct Route {
    /// Unique name, used in keys, logs, metrics and headers.
    pub name: Arc<str>,
    /// Which requests belong to this route.
    pub matcher: Match,
    /// What an allowed request gets.
    pub action: Action,
    /// How the client is identified.
    pub client: ClientRule,
    /// Units one request consumes.
    pub cost: u64,
    /// Count and annotate, but never reject.
    pub shadow: bool,
    /// The limits, all of which must allow; no limits means the route is
    /// not limited.
    pub policy: Policy,
    /// Other limits for some clients, tried in order before `policy`.
    pub overrides: Vec<Override>,
    /// The limits of each plan this route refers to, by the plan's index
    /// (`None`: the route does not refer to it, and its clients get the
    /// route's own limits); empty when it refers to none, so that no plan
    /// is read for its requests.
    pub plans: Vec<Option<Policy>>,
    /// Which rate-limit fields responses carry.
    pub rate_limit_headers: HeaderMode,
    /// The answer to a denied request, when not the default 429.
    pub deny: Option<DenyAnswer>,
    /// The shape of floodgate's own answers: denials and store outages.
    pub answers: Answers,
    /// Clients in these networks bypass the limits (`[server]`'s and the
    /// route's own `exempt`).
    pub exempt: Vec<IpNet>,
    /// Requests carrying one of these header values bypass the limits
    /// (`[server]`'s and the route's own `exempt_keys`).
    pub exempt_keys: Vec<KeyExemption>,
    /// Where the API key the key registry verifies is read, when the route
    /// verifies keys: an unknown, disabled or expired key is refused
    /// before anything is counted.
    pub api_key: Option<crate::keys::settings::KeyFrom>,
    /// Largest request body forwarded, in bytes (413 past it).
    pub max_request_body: Option<u64>,
    /// How many requests may be in flight at once, if capped.
    pub concurrency: Option<crate::concurrency::settings::Settings>,
    /// The route's cost is what its upstream reports: reserved, then
    /// settled.
    pub usage: Option<Arc<crate::usage::settings::Settings>>,
    /// A leading path taken off before forwarding (`/api` sends `/api/v1/x`
    /// upstream as `/v1/x`), at a segment boundary only.
    pub strip_prefix: Option<Box<str>>,
    /// The descriptors of Envoy's rate limit service protocol this route
    /// decides; such a route is never an HTTP request's.
    pub descriptor: Option<Descriptor>,
}

impl Route {
    /// `path` as this route forwards it: without its `strip_prefix` when
    /// the path starts with it at a segment boundary (compared without
    /// case on an `ignore_case` route), `/` when nothing is left; `None`
    /// when nothing is stripped.
    pub fn stripped<'p>(&self, path: &'p str) -> Option<&'p str> {
        let prefix = self.strip_prefix.as_deref()?;
        let head = path.get(..prefix.len())?;
        let same = if self.matcher.ignore_case {
            head.eq_ignore_ascii_case(prefix)
        } else {
            head == prefix
        };
        if !same {
            return None;
        }
        match &path[prefix.len()..] {
            "" => Some("/"),
            rest if rest.starts_with('/') => Some(rest),
            _ => None,
        }
    }

    /// Whether anything limits this route's requests: its own limits (a
    /// budget's among them), or a plan's.
    pub fn limited(&self) -> bool {
        !self.policy.limits.is_empty() || !self.plans.is_empty()
    }

    /// The limits `client`'s request falls under: the first override that
    /// applies, else those of its `plan` when the route refers to it, else
    /// the route's own.
    pub fn policy_for(
        &self,
        client: &ClientId,
        headers: &http::HeaderMap,
        plan: Option<usize>,
    ) -> &Policy {
        self.overrides
            .iter()
            .find(|o| {
                o.clients.as_ref().is_none_or(|set| set.contains(client))
                    && o.headers.iter().all(|h| h.holds(headers))
            })
            .map(|o| &o.policy)
            .or_else(|| plan.and_then(|p| self.plans.get(p)?.as_ref()))
            .unwrap_or(&self.policy)
    }
}

/// What a request must look like to belong to a route.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Match {
    /// Segment-wise prefix of the normalised path (`/api` matches `/api/x`, not `/apix`).
    pub path_prefix: Option<String>,
    /// Exact normalised path.
    pub path: Option<String>,
    /// A `path` or `path_prefix` with `{param}` segments, in their place;
    /// `true` when it is a prefix.
    pub template: Option<(Template, bool)>,
    /// Conditions on request headers; all must hold.
    pub headers: Vec<HeaderCondition>,
    /// Allowed methods; empty means any.
    pub methods: Vec<Method>,
    /// Host, compared without case.
    pub host: Option<HostMatch>,
    /// Paths and methods compared without case, for upstreams that route
    /// without it (`/SEARCH` is `/search`, `post` is `POST`).
    pub ignore_case: bool,
}

/// A condition on one request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeaderCondition {
    /// The header (names are case-insensitive).
    pub name: http::header::HeaderName,
    /// What it must hold.
    pub test: HeaderTest,
}

/// What a header must hold. A header sent more than once matches only
/// `Present(true)`: with two values, which one an upstream reads is
/// anyone's guess, so no value condition is met by either.
#[derive(Debug, Clone)]
pub enum HeaderTest {
    /// Exactly this value.
    Equals(HeaderValue),
    /// Present (`true`) or absent (`false`).
    Present(bool),
    /// A value the regular expression matches (anchor it with `^…$` for a
    /// whole-value match).
    Regex(regex::bytes::Regex),
}

impl PartialEq for HeaderTest {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Equals(a), Self::Equals(b)) => a == b,
            (Self::Present(a), Self::Present(b)) => a == b,
            (Self::Regex(a), Self::Regex(b)) => a.as_str() == b.as_str(),
            _ => false,
        }
    }
}

impl Eq for HeaderTest {}

impl HeaderCondition {
    /// Whether `headers` meet the condition.
    pub fn holds(&self, headers: &http::HeaderMap) -> bool {
        let mut values = headers.get_all(&self.name).iter();
        let first = values.next();
        match (&self.test, first) {
            (HeaderTest::Present(want), first) => first.is_some() == *want,
            (_, None) => false,
            (_, Some(_)) if values.next().is_some() => false,
            (HeaderTest::Equals(want), Some(v)) => v == want,
            (HeaderTest::Regex(re), Some(v)) => re.is_match(v.as_bytes()),
        }
    }
}

/// A host to match, with an optional port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMatch {
    name: String,
    port: Option<u16>,
}

/// What happens to an allowed request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Forward to an upstream server.
    Upstream(Upstream),
    /// Answer directly.
    Respond(Respond),
    /// Answer the caller's standing on these routes (their limits, what
    /// remains, when more comes back), consuming nothing.
    Standing(Box<[Arc<str>]>),
    /// Only decided, for front proxies asking the decision listener; the
    /// proxy listener answers 404 as if no route matched.
    Decide,
}

/// Where a route forwards: one of the configuration's upstreams, with the
/// route's own deadline for the response head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstream {
    /// The upstream's index in the configuration's list of upstreams
    /// (`Config::upstreams`); routes that name the same upstream share it,
    /// and with it its endpoints' health and connections.
    pub index: usize,
    /// Deadline for the response head (504 past it), from when the request
    /// was sent whole.
    pub timeout: Duration,
}

/// A fixed answer.
#[derive(Debug, Clone)]
pub struct Respond {
    /// Status code.
    pub status: StatusCode,
    /// Body.
    pub body: Bytes,
    /// `Content-Type` of the body.
    pub content_type: HeaderValue,
}

/// The parts of a request that decide its route.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// The method.
    pub method: &'a Method,
    /// The host from the URI authority or `Host` header, with any port.
    pub host: Option<&'a str>,
    /// The path as matched: normalised (see [`request_paths`]).
    pub path: &'a str,
    /// The request's headers.
    pub headers: &'a http::HeaderMap,
}

// === impl Table ===

impl Table {
    /// Builds a table; the first route that matches a request wins.
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            routes: routes.into_iter().map(Arc::new).collect(),
            plan_selection: None,
        }
    }

    /// This table with plans chosen by `selection`.
    pub fn with_plans(mut self, selection: Option<PlanSelection>) -> Self {
        self.plan_selection = selection.map(Arc::new);
        self
    }

    /// The route a request belongs to, if any, and its position.
    pub fn find(&self, request: &RequestFacts<'_>) -> Option<(usize, &Arc<Route>)> {
        self.routes
            .iter()
            .enumerate()
            .find(|(_, r)| r.descriptor.is_none() && r.matcher.matches(request))
    }

    /// The route a descriptor of Envoy's protocol (its `entries`, key and
    /// value, in `domain`) is on, if any, and its position.
    pub fn for_descriptor<'e>(
        &self,
        domain: &str,
        entries: impl ExactSizeIterator<Item = (&'e str, &'e str)> + Clone,
    ) -> Option<(usize, &Arc<Route>)> {
        self.routes.iter().enumerate().find(|(_, r)| {
            r.descriptor
                .as_ref()
                .is_some_and(|d| d.matches(domain, entries.clone()))
        })
    }

    /// Each budget routes draw from, in the order first drawn, with the
    /// routes that draw from it (on their own limits or a plan's).
    pub fn budgets(&self) -> Vec<(&str, Vec<&str>)> {
        let mut budgets: Vec<(&str, Vec<&str>)> = Vec::new();
        for route in &self.routes {
            let drawn = std::iter::once(&route.policy)
                .chain(route.plans.iter().flatten())
                .flat_map(|p| p.counting().into_iter().flatten())
                .filter_map(|c| c.budget.as_deref());
            for budget in drawn {
                match budgets.iter_mut().find(|(b, _)| *b == budget) {
                    Some((_, routes)) if routes.contains(&&*route.name) => {}
                    Some((_, routes)) => routes.push(&route.name),
                    None => budgets.push((budget, vec![&route.name])),
                }
            }
        }
        budgets
    }

    /// The routes that refer to plan `index`, in order.
    pub fn on_plan(&self, index: usize) -> impl Iterator<Item = &str> {
        self.routes
            .iter()
            .filter(move |r| r.plans.get(index).is_some_and(Option::is_some))
            .map(|r| &*r.name)
    }

    /// All routes, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.routes.iter()
    }

    /// Number of routes.
    pub fn len(&self) -> usize {
        self.routes.len()
    }

    /// True when there is no route.
    pub fn is_empty(&self) -> bool {
        self.routes.is_empty()
    }
}

// === impl Match ===

impl Match {
    /// Whether a request belongs here.
    pub fn matches(&self, request: &RequestFacts<'_>) -> bool {
        if !self.methods.is_empty()
            && !self.methods.iter().any(|m| {
                m == request.method
                    || (self.ignore_case
                        && m.as_str().eq_ignore_ascii_case(request.method.as_str()))
            })
        {
            return false;
        }
        if let Some(host) = &self.host
            && !request.host.is_some_and(|h| host.matches(h))
        {
            return false;
        }
        if let Some(path) = &self.path
            && !exact_path(path, request.path, self.ignore_case)
        {
            return false;
        }
        if let Some(prefix) = &self.path_prefix
            && !segment_prefix(prefix, request.path, self.ignore_case)
        {
            return false;
        }
        if let Some((template, prefix)) = &self.template
            && !template.matches(request.path, *prefix, self.ignore_case)
        {
            return false;
        }
        self.headers.iter().all(|h| h.holds(request.headers))
    }

    /// Whether every request `later` matches is matched by `self` too, which
    /// makes a route with `later` unreachable behind one with `self`.
    pub fn covers(&self, later: &Match) -> bool {
        let host = match (&self.host, &later.host) {
            (None, _) => true,
            (Some(a), Some(b)) => a == b,
            (Some(_), None) => false,
        };
        let case = self.ignore_case || !later.ignore_case;
        let methods = self.methods.is_empty()
            || (!later.methods.is_empty()
                && later.methods.iter().all(|m| self.methods.contains(m)));
        // A later template's paths all start with its literal head.
        let later_head = later.template.as_ref().map(|(t, _)| t.literal_head());
        let later_prefix = later.path_prefix.as_ref().or(later_head.as_ref());
        let path = match (&self.path_prefix, &self.path, &self.template) {
            (_, _, Some(template)) => later.template.as_ref() == Some(template),
            (None, None, None) => true,
            (Some(p), _, _) => match (later_prefix, &later.path) {
                (Some(q), _) | (None, Some(q)) => segment_prefix(p, q, self.ignore_case),
                (None, None) => p == "/",
            },
            (None, Some(x), None) => later
                .path
                .as_ref()
                .is_some_and(|y| exact_path(x, y, self.ignore_case)),
        };
        // Every condition of ours must be one of the later route's.
        let headers = self.headers.iter().all(|h| later.headers.contains(h));
        host && case && methods && path && headers
    }
}

/// `prefix` matches whole segments of `path`: `/api` matches `/api` and
/// `/api/x`, never `/apix`.
fn segment_prefix(prefix: &str, path: &str, ignore_case: bool) -> bool {
    let (p, q) = (prefix.as_bytes(), path.as_bytes());
    let Some(head) = q.get(..p.len()) else {
        return false;
    };
    let same = if ignore_case {
        head.eq_ignore_ascii_case(p)
    } else {
        head == p
    };
    let rest = &q[p.len()..];
    same && (rest.is_empty() || p.ends_with(b"/") || rest.starts_with(b"/"))
}

/// `path` is the exact path `want`, or it with a trailing slash (which
/// `/login/` and `/login/.` normalise to): upstreams commonly serve both
/// alike, so both must meet the route's limit.
fn exact_path(want: &str, path: &str, ignore_case: bool) -> bool {
    let path = match path.strip_suffix('/') {
        Some(trimmed) if !want.ends_with('/') && !trimmed.is_empty() => trimmed,
        _ => path,
    };
    if ignore_case {
        want.eq_ignore_ascii_case(path)
    } else {
        want == path
    }
}

// === impl HostMatch ===

impl HostMatch {
    /// Parses `name` or `name:port`; `None` when it is not a host.
    pub fn parse(s: &str) -> Option<Self> {
        let authority: Authority = s.parse().ok()?;
        if authority.as_str().contains('@') || authority.host().is_empty() {
            return None;
        }
        Some(Self {
            name: authority.host().to_ascii_lowercase(),
            port: authority.port_u16(),
        })
    }

    /// Case-insensitive; the port counts only when the rule names one.
    fn matches(&self, request_host: &str) -> bool {
        let (name, port) = split_host_port(request_host);
        name.eq_ignore_ascii_case(&self.name)
            && match self.port {
                None => true,
                Some(p) => port.unwrap_or(80) == p,
            }
    }
}

fn split_host_port(host: &str) -> (&str, Option<u16>) {
    let host = host.strip_suffix('.').unwrap_or(host);
    if let Some(rest) = host.strip_prefix('[') {
        // [v6]:port
        return match rest.split_once(']') {
            Some((name, tail)) => (name, tail.strip_prefix(':').and_then(|p| p.parse().ok())),
            None => (host, None),
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') => {
            let name = name.strip_suffix('.').unwrap_or(name);
            (name, port.parse().ok())
        }
        _ => (host, None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(segment_prefix("/login", "/login", false));
        assert!(segment_prefix("/login", "/login/x", false));
        assert!(!segment_prefix("/login", "/loginx", false));
        assert!(segment_prefix("/", "/anything", false));
        assert!(segment_prefix("/api/", "/api/x", false));
        assert!(!segment_prefix("/search", "/SEARCH/q", false));
        assert!(segment_prefix("/search", "/SEARCH/q", true));
        assert!(!segment_prefix("/search", "/SEARCHx", true));
    }

    #[test]
    fn exact_paths_match_with_a_trailing_slash_too() {
        assert!(exact_path("/login", "/login", false));
        assert!(exact_path("/login", "/login/", false));
        assert!(!exact_path("/login", "/login/x", false));
        assert!(!exact_path("/login", "/LOGIN", false));
        assert!(exact_path("/login", "/LOGIN/", true));
        assert!(exact_path("/", "/", false));
        assert!(!exact_path("/api/", "/api", false));
    }

    #[test]
    fn hosts_match_without_case_and_port_unless_named() {
        let any_port = HostMatch::parse("API.example.com").unwrap_or_else(|| unreachable!());
        assert!(any_port.matches("api.EXAMPLE.com"));
        assert!(any_port.matches("api.example.com:8443"));
        assert!(!any_port.matches("example.com"));
        let port = HostMatch::parse("api.example.com:8443").unwrap_or_else(|| unreachable!());
        assert!(port.matches("api.example.com:8443"));
        assert!(!port.matches("api.example.com:9000"));
        assert!(!port.matches("api.example.com"));
    }
}
