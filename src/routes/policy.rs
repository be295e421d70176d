//! What a route's limits are called and how its answers carry them: the
//! policies (the route's own and its overrides), the clients an override or
//! an exemption names, the header mode and the deny answer. Compiled once
//! at load; `response` writes them out.

use std::fmt::Write as _;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use ipnet::IpNet;

use std::sync::Arc;

use super::{CountWhen, DenyCode, HeaderCondition};
use crate::client::{ClientId, ClientRule, KeyFacts, Known};
use crate::limit::Limit;

/// A route's limits: their numbers as a request meets them (what the
/// store decides on, and what the headers say of them) and the terms each
/// limit keeps whatever the request (its name, whose count it is, where
/// its number or windows come from, what a denial by it tells a client).
#[derive(Debug, Clone)]
pub struct Policy {
    /// All must allow.
    pub limits: Vec<Limit>,
    /// Each limit's quota `q` as an `X-RateLimit-Limit` value.
    pub quotas: Vec<HeaderValue>,
    /// The `RateLimit-Policy` value, computed once at load (and for a
    /// request whose numbers differ, once for it).
    pub header: Option<HeaderValue>,
    /// One per limit, in order; shared by every request's copy.
    pub terms: Arc<[LimitTerms]>,
    /// Some limit counts another identity or scope than the route's
    /// client at its own place: requests need a key per limit.
    keyed: bool,
    /// Some limit's number or windows depend on the request (a claim,
    /// the calendar), and this copy has not been made for one.
    varies: bool,
    /// Some limit counts only the answers its `count_when` names.
    by_answer: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Self::with_terms(Vec::new(), Vec::new())
    }
}

/// What one limit of a policy is besides its numbers.
#[derive(Debug, Clone)]
pub struct LimitTerms {
    /// The policy name, as sent in `RateLimit` headers.
    pub name: String,
    /// Whose count it is; `None`: the route's client at the limit's own
    /// place in the route's scope (the common case, which needs nothing
    /// more per request).
    pub counting: Option<Counting>,
    /// A verified claim carries its number.
    pub claimed: Option<Arc<ClaimedLimit>>,
    /// Its windows follow the calendar.
    pub calendar: Option<Arc<CalendarLimit>>,
    /// The `deny_code` it names; `None`: the code [`DenyCode::of`] gives it.
    pub code: Option<DenyCode>,
    /// The answers it counts; `None`: every admitted request.
    pub count_when: Option<Arc<CountWhen>>,
}

impl LimitTerms {
    /// A limit called `name`, counting the route's client, with nothing
    /// more to it.
    pub fn named(name: String) -> Self {
        Self {
            name,
            counting: None,
            claimed: None,
            calendar: None,
            code: None,
            count_when: None,
        }
    }
}

impl Policy {
    /// `limits` of the route `route`, named for its headers.
    pub fn new(route: &str, limits: Vec<Limit>) -> Self {
        let terms = policy_names(route, limits.len())
            .into_iter()
            .map(LimitTerms::named)
            .collect();
        Self::with_terms(limits, terms)
    }

    /// `limits` with their `terms`, one each.
    pub fn with_terms(limits: Vec<Limit>, terms: Vec<LimitTerms>) -> Self {
        debug_assert_eq!(limits.len(), terms.len());
        let keyed = terms.iter().any(|t| t.counting.is_some());
        let varies = terms
            .iter()
            .any(|t| t.claimed.is_some() || t.calendar.is_some());
        let by_answer = terms.iter().any(|t| t.count_when.is_some());
        let mut policy = Self {
            limits,
            quotas: Vec::new(),
            header: None,
            terms: terms.into(),
            keyed,
            varies,
            by_answer,
        };
        policy.numbers_changed();
        policy
    }

    /// The headers' values again, after the numbers changed.
    fn numbers_changed(&mut self) {
        self.quotas = self
            .limits
            .iter()
            .map(|l| HeaderValue::from(l.capacity()))
            .collect();
        self.header = policy_header(&self.terms, &self.limits);
    }

    /// Limit `index`'s name in headers.
    pub fn name(&self, index: usize) -> Option<&str> {
        self.terms.get(index).map(|t| t.name.as_str())
    }

    /// Whose count each limit is, when not every one counts the route's
    /// client at its own place; `None` when every one does.
    pub fn counting(&self) -> Option<impl Iterator<Item = &Counting>> {
        self.keyed
            .then(|| self.terms.iter().filter_map(|t| t.counting.as_ref()))
    }

    /// Whose count limit `index` is, when the policy counts by limit.
    pub fn counting_of(&self, index: usize) -> Option<&Counting> {
        self.terms.get(index)?.counting.as_ref()
    }

    /// What a denial by limit `index` tells an OpenAI client.
    pub fn code(&self, index: usize) -> DenyCode {
        match self.terms.get(index).and_then(|t| t.code) {
            Some(code) => code,
            None => self
                .limits
                .get(index)
                .map_or(DenyCode::RateLimitExceeded, DenyCode::of),
        }
    }

    /// The longest a limit holds a request past its burst (`delay`;
    /// 0 for none): what a request on this policy may wait.
    pub fn most_held_ms(&self) -> u64 {
        self.limits.iter().map(|l| l.delay_ms).max().unwrap_or(0)
    }

    /// The same limits holding no request: each `delay` dropped.
    pub fn without_delays(&self) -> Self {
        let mut policy = self.clone();
        for limit in &mut policy.limits {
            limit.delay_ms = 0;
        }
        policy
    }

    /// Whether some calendar window starts on the day an attribute of the
    /// request's API key names.
    pub fn calendars_use_key(&self) -> bool {
        self.terms.iter().any(|t| {
            t.calendar
                .as_ref()
                .is_some_and(|c| matches!(c.anchor, Anchor::Key { .. }))
        })
    }

    /// Whether some limit counts only the answers its `count_when` names.
    pub fn counts_by_answer(&self) -> bool {
        self.by_answer
    }

    /// Whether a request's limits differ from these (a number a claim
    /// carries, windows by the calendar): see [`Self::for_request`].
    pub fn varies_by_request(&self) -> bool {
        self.varies
    }

    /// This policy for a request with `headers` at `now_ms` (this
    /// instance's clock): numbers from claims ([`Self::with_claimed`]; a
    /// token that is missing, invalid or without the claim gets the
    /// default), and each calendar window's boundaries around `now_ms` for
    /// the client's anchor (a claim that is missing, invalid or not a day
    /// of the month gets the default).
    pub fn for_request(
        &self,
        headers: &http::HeaderMap,
        now_ms: u64,
        key: Option<&KeyFacts<'_>>,
    ) -> Self {
        let values: Vec<Option<u64>> = self
            .terms
            .iter()
            .filter_map(|t| t.claimed.as_ref())
            .map(|claimed| claimed.rule.claimed_number::<u64>(headers))
            .collect();
        let mut limits = self.with_claimed(&values);
        for (limit, terms) in limits.iter_mut().zip(self.terms.iter()) {
            if let Some(calendar) = &terms.calendar {
                let anchor = calendar.anchor_for(headers, key);
                limit.bounds = calendar
                    .remembered
                    .bounds(&calendar.calendar, now_ms, anchor);
            }
        }
        let claimed = !values.is_empty();
        let mut policy = Self {
            limits,
            quotas: Vec::new(),
            header: None,
            terms: Arc::clone(&self.terms),
            keyed: self.keyed,
            varies: false,
            by_answer: self.by_answer,
        };
        if claimed {
            policy.numbers_changed();
        } else {
            // A calendar moves the windows, not the quotas: only the
            // policy's value is written again.
            policy.quotas.clone_from(&self.quotas);
            policy.header = policy_header(&policy.terms, &policy.limits);
        }
        policy
    }

    /// This policy's limits for a request whose verified token carries
    /// `values` for the limits whose number a claim carries (in their
    /// order; `None` where absent): the default in place of a missing
    /// value, the ceiling in place of one above it.
    pub fn with_claimed(&self, values: &[Option<u64>]) -> Vec<Limit> {
        let mut limits = self.limits.clone();
        let claimed = limits
            .iter_mut()
            .zip(self.terms.iter())
            .filter_map(|(limit, t)| Some((limit, t.claimed.as_ref()?)));
        for ((limit, claimed), value) in claimed.zip(values) {
            let n = value.map_or(claimed.default, |v| v.clamp(1, claimed.ceiling));
            let burst_follows = limit.burst == limit.limit;
            limit.limit = n;
            if burst_follows {
                limit.burst = n;
            }
        }
        limits
    }
}

/// A limit whose number a verified token claim carries (a per-key number
/// set by whoever issues the tokens), with a default for tokens without
/// it and a ceiling no token can claim past.
#[derive(Debug)]
pub struct ClaimedLimit {
    /// The rule reading (and verifying) the claim.
    pub rule: Arc<crate::jwt::ClaimRule>,
    /// The number when the token lacks the claim.
    pub default: u64,
    /// The most a token may claim; more is clamped to this.
    pub ceiling: u64,
}

/// A limit whose windows follow the calendar, and the day of the month
/// each client's months start on.
#[derive(Debug)]
pub struct CalendarLimit {
    pub calendar: crate::limit::calendar::Calendar,
    pub anchor: Anchor,
    /// The boundaries last computed, by anchor day.
    pub remembered: crate::limit::calendar::Remembered,
}

/// The day of the month a client's months start on.
#[derive(Debug)]
pub enum Anchor {
    /// The same for every client (1: calendar months).
    Day(u8),
    /// A verified token claim (a billing day), this day without it.
    Claim {
        rule: Arc<crate::jwt::ClaimRule>,
        default: u8,
    },
    /// An attribute of the request's verified API key (its billing day),
    /// this day without it.
    Key { attribute: Box<str>, default: u8 },
}

impl CalendarLimit {
    /// As operators read it: `month in Europe/Berlin from day 15`, `week
    /// in UTC from Sunday`, `month in UTC from claim billing_day (default
    /// 1)`.
    pub fn describe(&self) -> String {
        use crate::limit::calendar::Unit;
        let c = &self.calendar;
        let zone = c.zone.iana_name().unwrap_or("UTC");
        let from = match (&self.anchor, c.unit) {
            (Anchor::Day(day), Unit::Month) => format!(" from day {day}"),
            (Anchor::Claim { rule, default }, Unit::Month) => {
                format!(" from claim {} (default {default})", rule.claim)
            }
            (Anchor::Key { attribute, default }, Unit::Month) => {
                format!(" from the key's {attribute} (default {default})")
            }
            (_, Unit::Week) => format!(" from {:?}", c.week_starts),
            _ => String::new(),
        };
        format!("{} in {zone}{from}", c.unit.name())
    }

    /// The anchor day for a request with `headers` and a key the registry
    /// says `key` of: a claim's or the key's attribute's value when it is
    /// a whole number from 1 to 31, else the default.
    pub fn anchor_for(&self, headers: &http::HeaderMap, key: Option<&KeyFacts<'_>>) -> u8 {
        match &self.anchor {
            Anchor::Day(day) => *day,
            Anchor::Claim { rule, default } => rule
                .claimed_number::<u8>(headers)
                .filter(|d| (1..=31).contains(d))
                .unwrap_or(*default),
            Anchor::Key { attribute, default } => key
                .and_then(|k| k.value(Some(attribute)))
                .and_then(|v| v.parse::<u8>().ok())
                .filter(|d| (1..=31).contains(d))
                .unwrap_or(*default),
        }
    }
}

/// Whose count one limit is: its scope (the route, or a budget routes
/// share), its place among the scope's limits, and the identity counted.
#[derive(Debug, Clone)]
pub struct Counting {
    /// The route's name, or `@` and the budget's name.
    pub scope: Arc<str>,
    /// `scope`, `index`, algorithm and window in one name, for the
    /// in-process tables (what a Redis key names).
    pub entry: Arc<str>,
    /// The limit's place among its scope's limits.
    pub index: usize,
    /// The identity counted.
    pub key: KeySource,
    /// The identity as operators read it (`client`, `global`,
    /// `header X-Org`, …).
    pub shown: Box<str>,
    /// The budget the limit belongs to, if any.
    pub budget: Option<Arc<str>>,
}

/// The identity a limit counts.
#[derive(Debug, Clone)]
pub enum KeySource {
    /// The route's client (`client = { … }`), the default.
    Client,
    /// An identity of its own, derived from the request as a route's
    /// client is (a header, a verified claim, the address, a path
    /// parameter, several of them, or the whole API).
    Rule(Box<ClientRule>),
}

impl Counting {
    /// Whether this limit counts the route's client at its own place in
    /// the route's scope, as a policy without `counting` does.
    pub fn is_plain(&self, route: &str, position: usize) -> bool {
        matches!(self.key, KeySource::Client) && &*self.scope == route && self.index == position
    }
}

/// Limits of their own for some of a route's clients: those whose id is in
/// `clients`, or whose requests meet `headers`, or both when both are given.
#[derive(Debug, Clone)]
pub struct Override {
    /// The client ids it applies to; `None`: any.
    pub clients: Option<ClientSet>,
    /// Header conditions that must hold.
    pub headers: Vec<HeaderCondition>,
    /// Its limits.
    pub policy: Policy,
}

/// Client ids, as the route identifies clients: addresses by network,
/// values (API keys, claims, path parameters) as they are or by their
/// SHA-256, so a file need not hold a credential in the clear.
#[derive(Debug, Clone, Default)]
pub struct ClientSet {
    /// Networks an address id may be in.
    pub nets: Vec<IpNet>,
    /// Values, as they are or by their SHA-256.
    pub values: Known<()>,
}

impl ClientSet {
    /// Whether `client` is in the set.
    pub fn contains(&self, client: &ClientId) -> bool {
        match client {
            ClientId::Addr(ip) => crate::client::is_in(*ip, &self.nets),
            other => self.values.of(other).is_some(),
        }
    }
}

/// Requests carrying one of these values in `header` bypass the limits.
#[derive(Debug, Clone)]
pub struct KeyExemption {
    /// The header read.
    pub header: http::header::HeaderName,
    /// The values that exempt, as they are or by their SHA-256.
    pub keys: Known<()>,
}

impl KeyExemption {
    /// Whether `headers` carry an exempting value (one value, one line).
    pub fn exempts(&self, headers: &http::HeaderMap) -> bool {
        let mut values = headers.get_all(&self.header).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => self.keys.get(value.as_bytes()).is_some(),
            _ => false,
        }
    }
}

/// Policy names of a route's limits: the route's name when it has one limit,
/// `name.1`, `name.2`, … when it has several.
fn policy_names(route: &str, count: usize) -> Vec<String> {
    if count == 1 {
        vec![route.to_owned()]
    } else {
        (1..=count).map(|i| format!("{route}.{i}")).collect()
    }
}

/// The `RateLimit-Policy` value for a route, built once at load: each
/// limit's quota `q` is the most units it grants at once (the burst of
/// `token_bucket` and `gcra`), so `r` never exceeds it.
fn policy_header(terms: &[LimitTerms], limits: &[Limit]) -> Option<HeaderValue> {
    if limits.is_empty() {
        return None;
    }
    let mut value = String::new();
    for (i, (terms, limit)) in terms.iter().zip(limits).enumerate() {
        let name = &terms.name;
        if i > 0 {
            value.push_str(", ");
        }
        let _ = write!(
            value,
            "\"{name}\";q={};w={}",
            limit.capacity(),
            limit.window_now_ms().div_ceil(1000)
        );
    }
    HeaderValue::from_str(&value).ok()
}

impl DenyAnswer {
    /// The placeholder the body may hold for the wait.
    pub const RETRY_AFTER: &'static str = "{retry_after}";

    /// The body for a request that must wait `seconds`.
    pub fn body_for(&self, seconds: u64) -> Bytes {
        if !self.waits {
            return self.body.clone();
        }
        let text = String::from_utf8_lossy(&self.body);
        Bytes::from(text.replace(Self::RETRY_AFTER, &seconds.to_string()))
    }
}

/// Which rate-limit fields a route's responses carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderMode {
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers-10).
    #[default]
    Ietf,
    /// `X-RateLimit-Limit`, `-Remaining` and `-Reset`, as many clients still read.
    XRateLimit,
    /// Both sets.
    Both,
    /// OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`:
    /// the most constrained limit that counts requests, and the most
    /// constrained that counts the route's units (tokens), each on its own.
    OpenAi,
    /// None (a 429 still carries `Retry-After`).
    None,
}

impl HeaderMode {
    /// Every mode with its name in configuration files.
    pub const NAMES: [(&'static str, HeaderMode); 5] = [
        ("ietf", HeaderMode::Ietf),
        ("x-ratelimit", HeaderMode::XRateLimit),
        ("both", HeaderMode::Both),
        ("openai", HeaderMode::OpenAi),
        ("none", HeaderMode::None),
    ];

    /// The mode a configuration file names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, m)| m)
    }

    /// Whether the IETF fields are sent.
    pub fn ietf(self) -> bool {
        matches!(self, Self::Ietf | Self::Both)
    }

    /// Whether the `X-RateLimit-*` fields are sent.
    pub fn x_ratelimit(self) -> bool {
        matches!(self, Self::XRateLimit | Self::Both)
    }

    /// Whether OpenAI's `x-ratelimit-*-requests` and `-tokens` fields are
    /// sent.
    pub fn openai(self) -> bool {
        self == Self::OpenAi
    }
}

/// A route's own answer to a request its limits deny, in place of the
/// default 429 problem document. `Retry-After` and the route's rate-limit
/// fields are always added to it.
#[derive(Debug, Clone)]
pub struct DenyAnswer {
    /// The status (4xx or 5xx).
    pub status: StatusCode,
    /// The body, sent as it is, but for `{retry_after}`, replaced by the
    /// request's wait in whole seconds (as `Retry-After` says).
    pub body: Bytes,
    /// Whether the body holds `{retry_after}`.
    pub waits: bool,
    /// Its `Content-Type`.
    pub content_type: HeaderValue,
    /// Further headers, in file order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;

    #[test]
    fn policy_lists_every_limit_with_window_in_seconds() {
        let limits = [
            Limit::new(Algorithm::SlidingLog, 5, 60_000),
            Limit::new(Algorithm::FixedWindow, 100, 250),
        ];
        let v = Policy::new("login", limits.to_vec()).header;
        assert_eq!(
            v.expect("valid header"),
            "\"login.1\";q=5;w=60, \"login.2\";q=100;w=1"
        );
        let v = Policy::new("login", limits[..1].to_vec()).header;
        let v = v.expect("valid header");
        assert_eq!(v, "\"login\";q=5;w=60");
    }
}
