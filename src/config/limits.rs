//! One limit entry (`{ algorithm, limit, window, burst, key, limit_from,
//! counts }`): read and checked for any list of limits (a route's, an
//! override's, a plan's, a budget's).

use serde::Deserialize;
use toml::Spanned;

use super::calendars::{AnchorModel, CalendarKeys};
use super::{MAX_LIMIT, MAX_UNIT_MS, Validator};
use crate::limit::leases::Terms;
use crate::limit::{Algorithm, Limit};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LimitModel {
    pub(super) algorithm: Spanned<String>,
    limit: Option<Spanned<i64>>,
    /// A duration, or a calendar unit (`day`, `week`, `month`, …).
    pub(super) window: Spanned<String>,
    burst: Option<Spanned<i64>>,
    /// Whose count it is (default: the route's client).
    pub(super) key: Option<Spanned<super::clients::ClientModel>>,
    /// Its number from a verified token claim.
    pub(super) limit_from: Option<Spanned<ClaimLimitModel>>,
    /// What it counts: the route's units (default) or requests.
    counts: Option<Spanned<String>>,
    /// A calendar window's zone (default UTC).
    time_zone: Option<Spanned<String>>,
    /// A calendar week's first day (default Monday).
    week_starts: Option<Spanned<String>>,
    /// The day a calendar month starts on (default 1).
    anchor: Option<Spanned<AnchorModel>>,
    /// Decided from slices taken ahead (`lease = { interval, share }`).
    lease: Option<Spanned<LeaseModel>>,
    /// What its denial tells an OpenAI client (`answers = "openai"`).
    pub(super) deny_code: Option<Spanned<String>>,
    /// The answers it counts (`count_when = { status = [401, 403] }`);
    /// the others are given back.
    pub(super) count_when: Option<Spanned<CountWhenModel>>,
    /// A client it refuses stays refused (`penalty = { duration = "15m" }`).
    penalty: Option<Spanned<PenaltyModel>>,
    /// Requests past the burst held up to this long until they fit,
    /// instead of refused (`delay = "1200ms"`, `gcra` only).
    delay: Option<Spanned<String>>,
}

/// `penalty = { duration = "15m", factor = 2, max = "4h", forget = "1d" }`:
/// only `duration` is required; `factor` (default 1: the same each time)
/// lengthens each offence in a row, up to `max` (default: `duration` ×
/// 64, at most 30 days), and offences are forgotten `forget` after the
/// last (default: the longest penalty).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PenaltyModel {
    duration: Spanned<String>,
    factor: Option<Spanned<f64>>,
    max: Option<Spanned<String>>,
    forget: Option<Spanned<String>>,
}

/// `count_when = { status = [401, "5xx", "500-504"], header = "X-Login-Failed" }`:
/// the answers a limit counts, by status (a code, a class or a range) or
/// a response header the upstream sets; at least one of them.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CountWhenModel {
    #[serde(default)]
    status: Vec<Spanned<StatusModel>>,
    header: Option<Spanned<String>>,
}

/// A status as written: a number, or a class or range as a string.
#[derive(Deserialize)]
#[serde(untagged)]
enum StatusModel {
    Code(i64),
    Text(String),
}

/// `limit_from = { claim = "rpm", default = 60, max = 1000 }`: the
/// limit's number from a verified token claim (checked with the plans,
/// where the route's token is known).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClaimLimitModel {
    pub(super) claim: Spanned<String>,
    pub(super) default: Spanned<i64>,
    pub(super) max: Spanned<i64>,
}

impl LimitModel {
    /// The keys that say how the limit's window follows the calendar.
    pub(super) fn calendar(&self) -> CalendarKeys<'_> {
        CalendarKeys {
            algorithm: &self.algorithm,
            window: &self.window,
            time_zone: self.time_zone.as_ref(),
            week_starts: self.week_starts.as_ref(),
            anchor: self.anchor.as_ref(),
        }
    }
}

/// `lease = { interval = "250ms", share = 0.125 }`: both optional.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseModel {
    /// A slice's lifetime, and how much of this instance's traffic it is
    /// sized for.
    interval: Option<Spanned<String>>,
    /// Most of what remains (a window) or of the burst (a bucket) one
    /// slice takes.
    share: Option<Spanned<f64>>,
}

impl Validator<'_> {
    pub(super) fn limits(
        &mut self,
        model: Option<&Spanned<Vec<Spanned<LimitModel>>>>,
        cost: u64,
    ) -> Option<Vec<Limit>> {
        let Some(list) = model else {
            return Some(Vec::new());
        };
        if list.get_ref().is_empty() {
            self.problem(
                list.span(),
                "limits is empty; add a limit, or remove the key for a route without limits",
            );
            return None;
        }
        let mut out = Vec::new();
        let mut ok = true;
        for item in list.get_ref() {
            match self.limit(item, cost) {
                Some(l) => out.push(l),
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    pub(super) fn limit(&mut self, item: &Spanned<LimitModel>, cost: u64) -> Option<Limit> {
        let m = item.get_ref();
        let algorithm = self.choice(Some(&m.algorithm), "algorithm", &Algorithm::NAMES);
        let limit = self.limit_number(item);
        let burst = self.burst(m, algorithm, limit);
        let calendar = crate::limit::calendar::Unit::parse(m.window.get_ref());
        let window_ms = match calendar {
            Some(unit) => Some(unit.nominal_ms()),
            None => self.window(&m.window),
        };
        let counts_requests = self.counts_requests(m);
        let lease = match &m.lease {
            None => Some(None),
            Some(lease) => algorithm.and_then(|a| self.lease(lease, a)).map(Some),
        };
        let mut limit = Limit::new(algorithm?, limit?, window_ms?).with_burst(burst?);
        if counts_requests? {
            limit = limit.counting_requests();
        }
        limit.lease = lease?;
        if let Some(p) = &m.penalty {
            limit.penalty = Some(self.penalty(p, limit.lease.is_some())?);
        }
        if let Some(d) = &m.delay {
            limit.delay_ms = self.delay(d, &limit)?;
        }
        self.cost_fits(item, &limit, cost)?;
        self.counts_exactly(item, &limit)?;
        Some(limit)
    }

    /// The limit's number: `limit = N`, or the most `limit_from` may claim.
    fn limit_number(&mut self, item: &Spanned<LimitModel>) -> Option<u64> {
        let m = item.get_ref();
        match (&m.limit, &m.limit_from) {
            (Some(l), None) => self.count(l, "limit"),
            (None, Some(from)) => self.count(&from.get_ref().max, "max"),
            (Some(l), Some(_)) => {
                self.problem(
                    l.span(),
                    "a limit has limit = N or limit_from = { claim = … }, not both",
                );
                None
            }
            (None, None) => {
                self.problem(
                    item.span(),
                    "a limit needs limit = N (or limit_from = { claim = \"…\", default = N, max = N })",
                );
                None
            }
        }
    }

    /// The burst of an algorithm that has one (the limit when not given).
    fn burst(
        &mut self,
        m: &LimitModel,
        algorithm: Option<Algorithm>,
        limit: Option<u64>,
    ) -> Option<u64> {
        match (&m.burst, algorithm) {
            (None, _) => limit,
            (Some(b), Some(a)) if a.has_burst() => self.count(b, "burst"),
            (Some(b), Some(other)) => {
                self.problem(
                    b.span(),
                    format!(
                        "burst applies only to \"token_bucket\" and \"gcra\", not {:?}",
                        other.name()
                    ),
                );
                None
            }
            (Some(_), None) => None,
        }
    }

    /// `counts`: whether the limit counts requests rather than units.
    fn counts_requests(&mut self, m: &LimitModel) -> Option<bool> {
        match m.counts.as_ref().map(|c| (c, c.get_ref().as_str())) {
            None | Some((_, "units")) => Some(false),
            Some((_, "requests")) => Some(true),
            Some((c, other)) => {
                self.problem(
                    c.span(),
                    format!("counts {other:?} is not \"units\" (the route's cost or usage, the default) or \"requests\" (one per request)"),
                );
                None
            }
        }
    }

    /// The route's cost fits in the limit at once, or no request could pass.
    fn cost_fits(&mut self, item: &Spanned<LimitModel>, limit: &Limit, cost: u64) -> Option<()> {
        let m = item.get_ref();
        let cost = limit.cost_of(cost);
        if cost <= limit.capacity() {
            return Some(());
        }
        let limit_span = m.limit.as_ref().map_or_else(
            || m.limit_from.as_ref().map_or(item.span(), Spanned::span),
            Spanned::span,
        );
        let (span, what) = match (&m.burst, limit.capacity() == limit.burst) {
            (Some(b), true) => (b.span(), "burst"),
            _ => (limit_span, "limit"),
        };
        self.problem(
            span,
            format!(
                "the route's cost {cost} exceeds {what} {}, so no request could ever pass; raise the {what} or lower the cost",
                limit.capacity()
            ),
        );
        None
    }

    /// The limit's counts stay exact integers in every store.
    fn counts_exactly(&mut self, item: &Spanned<LimitModel>, limit: &Limit) -> Option<()> {
        // Most algorithms count in unit-milliseconds; Lua's numbers are
        // exact integers only up to 2^53, so leave room below that.
        if limit.algorithm.properties().bounded_by_unit_ms
            && limit.limit.max(limit.burst).saturating_mul(limit.window_ms) > MAX_UNIT_MS
        {
            self.problem(
                item.span(),
                format!(
                    "limit × window is too large to count exactly (at most {MAX_UNIT_MS} unit-milliseconds); lower the limit or burst, or shorten the window"
                ),
            );
            return None;
        }
        Some(())
    }

    /// The answers a limit counts, checked: with a lease, a slice would
    /// have to be given back to the store a request was never decided by.
    pub(super) fn count_when(
        &mut self,
        model: &Spanned<CountWhenModel>,
        leased: bool,
    ) -> Option<crate::routes::CountWhen> {
        let m = model.get_ref();
        if leased {
            self.problem(
                model.span(),
                "count_when cannot be leased: a slice is decided ahead, and an answer that does not count has nothing to give back to; drop the lease or count every answer",
            );
            return None;
        }
        let mut ok = true;
        let mut statuses = Vec::new();
        for status in &m.status {
            let text = match status.get_ref() {
                StatusModel::Code(n) => n.to_string(),
                StatusModel::Text(t) => t.clone(),
            };
            match crate::routes::CountWhen::parse_status(&text) {
                Some(range) => statuses.push(range),
                None => {
                    self.problem(
                        status.span(),
                        format!("{text:?} is not a status from 100 to 599, a class (\"4xx\") or a range (\"500-504\")"),
                    );
                    ok = false;
                }
            }
        }
        let header = match &m.header {
            None => None,
            Some(name) => {
                let header = self.header_name(name);
                ok &= header.is_some();
                header
            }
        };
        if ok && statuses.is_empty() && header.is_none() {
            self.problem(
                model.span(),
                "count_when names no answer to count: give status = [401, 403] (codes, \"4xx\", \"500-504\"), header = \"X-Name\", or both",
            );
            ok = false;
        }
        ok.then_some(crate::routes::CountWhen { statuses, header })
    }

    /// A limit's penalty terms: durations of at most 30 days, a factor
    /// from 1 to 100; not with a lease (a slice refuses without the store,
    /// where the penalty is kept).
    fn penalty(
        &mut self,
        model: &Spanned<PenaltyModel>,
        leased: bool,
    ) -> Option<crate::limit::penalty::Penalty> {
        const MOST_MS: u64 = 30 * 86_400_000;
        let m = model.get_ref();
        if leased {
            self.problem(
                model.span(),
                "a penalty cannot be leased: a slice refuses on its own, and the penalty is kept in the store; drop the lease or the penalty",
            );
            return None;
        }
        let within = |v: &mut Self, d: &Spanned<String>, key: &str| {
            let ms = u64::try_from(v.duration(d, key)?.as_millis()).unwrap_or(u64::MAX);
            if ms > MOST_MS || ms == 0 {
                v.problem(d.span(), format!("{key} must be from 1ms to 30 days"));
                return None;
            }
            Some(ms)
        };
        let duration = within(self, &m.duration, "duration");
        let factor = match &m.factor {
            None => Some(1_000),
            Some(f) if (1.0..=100.0).contains(f.get_ref()) => {
                Some((f.get_ref() * 1000.0).round() as u64)
            }
            Some(f) => {
                self.problem(
                    f.span(),
                    "factor must be from 1 (the same penalty each time) to 100",
                );
                None
            }
        };
        let max = match &m.max {
            None => duration.map(|d| d.saturating_mul(64).min(MOST_MS)),
            Some(d) => within(self, d, "max"),
        };
        let forget = match &m.forget {
            None => max,
            Some(d) => within(self, d, "forget"),
        };
        let (duration, factor, max, forget) = (duration?, factor?, max?, forget?);
        if max < duration {
            self.problem(
                m.max.as_ref().map_or(model.span(), Spanned::span),
                "max is shorter than duration; raise it",
            );
            return None;
        }
        Some(crate::limit::penalty::Penalty {
            duration_ms: duration,
            factor_permille: factor,
            max_ms: max,
            forget_ms: forget,
        })
    }

    /// How long a `gcra` limit holds a request past its burst: from 1 ms
    /// to a minute; not with a lease (a slice decides without the
    /// store's arrival time, which is what holds a request's place).
    fn delay(&mut self, d: &Spanned<String>, limit: &Limit) -> Option<u64> {
        const MOST_MS: u64 = 60_000;
        if !limit.algorithm.properties().tells_arrival {
            self.problem(
                d.span(),
                format!(
                    "delay holds a request until it fits, which only algorithm = \"gcra\" tells; this limit is {:?}: make it gcra, or drop the delay",
                    limit.algorithm.name()
                ),
            );
            return None;
        }
        if limit.lease.is_some() {
            self.problem(
                d.span(),
                "a delay cannot be leased: a held request's place is the store's arrival time; drop the lease or the delay",
            );
            return None;
        }
        let ms = u64::try_from(self.duration(d, "delay")?.as_millis()).unwrap_or(u64::MAX);
        if ms > MOST_MS {
            self.problem(
                d.span(),
                "delay must be at most 60s: a client is held that long without an answer; refuse past a shorter delay",
            );
            return None;
        }
        Some(ms)
    }

    /// A limit's lease terms.
    fn lease(&mut self, model: &Spanned<LeaseModel>, algorithm: Algorithm) -> Option<Terms> {
        if !algorithm.can_lease() {
            self.problem(
                model.span(),
                format!(
                    "{:?} cannot be leased: the log keeps each unit's own time, and units taken ahead would leave it before the requests that spend them; lease a \"fixed_window\", \"sliding_window\", \"token_bucket\" or \"gcra\"",
                    algorithm.name()
                ),
            );
            return None;
        }
        let m = model.get_ref();
        let mut terms = Terms::default();
        if let Some(interval) = &m.interval {
            let ms = self.duration(interval, "interval")?.as_millis();
            if !(10..=60_000).contains(&ms) {
                self.problem(
                    interval.span(),
                    "a lease's interval must be from 10ms to 60s",
                );
                return None;
            }
            terms.interval_ms = ms as u32;
        }
        if let Some(share) = &m.share {
            let value = *share.get_ref();
            if !(value > 0.0 && value <= 1.0) {
                self.problem(
                    share.span(),
                    "a lease's share is a fraction above 0 and at most 1 (0.125: a slice takes at most an eighth of what remains)",
                );
                return None;
            }
            terms.share_permille = ((value * 1000.0).round() as u16).max(1);
        }
        Some(terms)
    }

    /// A limit's window as a duration, in whole milliseconds.
    fn window(&mut self, window: &Spanned<String>) -> Option<u64> {
        match self.duration(window, "window") {
            Some(w) if w.subsec_nanos() % 1_000_000 != 0 => {
                self.problem(
                    window.span(),
                    "window must be a whole number of milliseconds",
                );
                None
            }
            Some(w) => Some(w.as_millis() as u64),
            None => None,
        }
    }

    pub(super) fn count(&mut self, value: &Spanned<i64>, what: &str) -> Option<u64> {
        match *value.get_ref() {
            n if n < 1 => {
                self.problem(
                    value.span(),
                    format!("{what} must be a whole number of at least 1"),
                );
                None
            }
            n if n > MAX_LIMIT => {
                self.problem(value.span(), format!("{what} must be at most {MAX_LIMIT}"));
                None
            }
            n => Some(n as u64),
        }
    }
}
