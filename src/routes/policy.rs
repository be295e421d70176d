//! What a route's limits are called and how its answers carry them: the
//! policies (the route's own and its overrides), the clients an override or
//! an exemption names, the header mode and the deny answer. Compiled once
//! at load; `response` writes them out.

use std::collections::HashSet;
use std::fmt::Write as _;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use ipnet::IpNet;

use std::sync::Arc;

use super::{DenyCode, HeaderCondition};
use crate::client::{ClientId, ClientRule, sha256};
use crate::limit::Limit;

/// A route's limits and what the rate-limit headers call them.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    /// All must allow.
    pub limits: Vec<Limit>,
    /// The policy name of each limit, as sent in `RateLimit` headers.
    pub names: Vec<String>,
    /// The `RateLimit-Policy` value, computed once at load.
    pub header: Option<HeaderValue>,
    /// Each limit's quota `q` as an `X-RateLimit-Limit` value.
    pub quotas: Vec<HeaderValue>,
    /// Whose count each limit is, one per limit; empty when every limit
    /// counts the route's client in the route's own scope (the common
    /// case, which needs nothing more per request).
    pub counting: Vec<Counting>,
    /// Limits whose number a verified claim carries, by position.
    pub claimed: Vec<(usize, Arc<ClaimedLimit>)>,
    /// Limits whose windows follow the calendar, by position.
    pub calendars: Vec<(usize, Arc<CalendarLimit>)>,
    /// The `deny_code` each limit names, one per limit; empty when none
    /// names one (each then has the code [`DenyCode::of`] gives it).
    pub codes: Vec<Option<DenyCode>>,
}

impl Policy {
    /// `limits` of the route `route`, named for its headers.
    pub fn new(route: &str, limits: Vec<Limit>) -> Self {
        let names = policy_names(route, limits.len());
        Self::named(names, limits, Vec::new())
    }

    /// `limits` called `names` in headers, each counted as `counting` says
    /// (empty, or one per limit).
    pub fn named(names: Vec<String>, limits: Vec<Limit>, counting: Vec<Counting>) -> Self {
        let header = policy_header(&names, &limits);
        let quotas = limits
            .iter()
            .map(|l| HeaderValue::from(l.capacity()))
            .collect();
        Self {
            limits,
            names,
            header,
            quotas,
            counting,
            claimed: Vec::new(),
            calendars: Vec::new(),
            codes: Vec::new(),
        }
    }

    /// What a denial by limit `index` tells an OpenAI client.
    pub fn code(&self, index: usize) -> DenyCode {
        match self.codes.get(index) {
            Some(Some(code)) => *code,
            _ => self
                .limits
                .get(index)
                .map_or(DenyCode::RateLimitExceeded, DenyCode::of),
        }
    }

    /// Whether a request's limits differ from these (a number a claim
    /// carries, windows by the calendar): see [`Self::for_request`].
    pub fn varies_by_request(&self) -> bool {
        !self.claimed.is_empty() || !self.calendars.is_empty()
    }

    /// This policy for a request with `headers` at `now_ms` (this
    /// instance's clock): numbers from claims ([`Self::claimed_for`]),
    /// and each calendar window's boundaries around `now_ms` for the
    /// client's anchor (a claim that is missing, invalid or not a day of
    /// the month gets the default).
    pub fn for_request(&self, headers: &http::HeaderMap, now_ms: u64) -> Self {
        let mut policy = if self.claimed.is_empty() {
            self.clone()
        } else {
            self.claimed_for(headers)
        };
        if self.calendars.is_empty() {
            return policy;
        }
        for (position, calendar) in &self.calendars {
            let anchor = calendar.anchor_for(headers);
            if let Some(limit) = policy.limits.get_mut(*position) {
                limit.bounds = calendar
                    .remembered
                    .bounds(&calendar.calendar, now_ms, anchor);
            }
        }
        policy.header = policy_header(&policy.names, &policy.limits);
        policy.calendars = Vec::new();
        policy
    }

    /// This policy for a request with `headers`: each limit whose number a
    /// claim carries set from the request's verified token (see
    /// [`Self::with_claimed`]); a token that is missing, invalid or
    /// without the claim gets the default.
    pub fn claimed_for(&self, headers: &http::HeaderMap) -> Self {
        let values: Vec<Option<u64>> = self
            .claimed
            .iter()
            .map(|(_, claimed)| claimed.rule.claimed_number::<u64>(headers))
            .collect();
        let (limits, header) = self.with_claimed(&values);
        Self {
            quotas: limits
                .iter()
                .map(|l| HeaderValue::from(l.capacity()))
                .collect(),
            limits,
            header,
            names: self.names.clone(),
            counting: self.counting.clone(),
            claimed: Vec::new(),
            calendars: self.calendars.clone(),
            codes: self.codes.clone(),
        }
    }

    /// This policy's limits for a request whose verified token carries
    /// `values` for the claims of [`Self::claimed`] (in that order; `None`
    /// where absent): the default in place of a missing value, the ceiling
    /// in place of one above it. Also returns the `RateLimit-Policy` value
    /// for those numbers.
    pub fn with_claimed(&self, values: &[Option<u64>]) -> (Vec<Limit>, Option<HeaderValue>) {
        let mut limits = self.limits.clone();
        for ((position, claimed), value) in self.claimed.iter().zip(values) {
            if let Some(limit) = limits.get_mut(*position) {
                let n = value.map_or(claimed.default, |v| v.clamp(1, claimed.ceiling));
                let burst_follows = limit.burst == limit.limit;
                limit.limit = n;
                if burst_follows {
                    limit.burst = n;
                }
            }
        }
        let header = policy_header(&self.names, &limits);
        (limits, header)
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
            (_, Unit::Week) => format!(" from {:?}", c.week_starts),
            _ => String::new(),
        };
        format!("{} in {zone}{from}", c.unit.name())
    }

    /// The anchor day for a request with `headers`: a claim's value when
    /// it is a whole number from 1 to 31, else the default.
    pub fn anchor_for(&self, headers: &http::HeaderMap) -> u8 {
        match &self.anchor {
            Anchor::Day(day) => *day,
            Anchor::Claim { rule, default } => rule
                .claimed_number::<u8>(headers)
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
    /// Values, byte for byte.
    pub values: HashSet<Box<[u8]>>,
    /// SHA-256 digests of values.
    pub digests: HashSet<[u8; 32]>,
}

impl ClientSet {
    /// Whether `client` is in the set.
    pub fn contains(&self, client: &ClientId) -> bool {
        match client {
            ClientId::Addr(ip) => crate::client::is_in(*ip, &self.nets),
            ClientId::Header(value) => {
                self.values.contains(value)
                    || (!self.digests.is_empty() && self.digests.contains(&sha256(value)))
            }
            // A value too long to keep is counted by its SHA-256.
            ClientId::Digest(digest) => self.digests.contains(&**digest),
            ClientId::Composite(_) | ClientId::Global => false,
        }
    }
}

/// Requests carrying one of these values in `header` bypass the limits.
#[derive(Debug, Clone)]
pub struct KeyExemption {
    /// The header read.
    pub header: http::header::HeaderName,
    /// SHA-256 digests of the values that exempt.
    pub digests: HashSet<[u8; 32]>,
}

impl KeyExemption {
    /// Whether `headers` carry an exempting value (one value, one line).
    pub fn exempts(&self, headers: &http::HeaderMap) -> bool {
        let mut values = headers.get_all(&self.header).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => self.digests.contains(&sha256(value.as_bytes())),
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
fn policy_header(names: &[String], limits: &[Limit]) -> Option<HeaderValue> {
    if limits.is_empty() {
        return None;
    }
    let mut value = String::new();
    for (i, (name, limit)) in names.iter().zip(limits).enumerate() {
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
        let names = policy_names("login", 2);
        let v = policy_header(&names, &limits).expect("valid header");
        assert_eq!(v, "\"login.1\";q=5;w=60, \"login.2\";q=100;w=1");
        let one = policy_names("login", 1);
        let v = policy_header(&one, &limits[..1]).expect("valid header");
        assert_eq!(v, "\"login\";q=5;w=60");
    }
}
