//! `[routes.usage]`: a route whose cost is what its upstream reports,
//! reserved before forwarding and settled when the answer says.

use std::collections::BTreeMap;
use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::usage::settings::{
    Abandoned, Drain, FailedAnswers, Fields, JsonPath, SOURCES, Settings, Source,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct UsageModel {
    reserve: Spanned<i64>,
    reserve_header: Option<Spanned<String>>,
    reserve_json: Option<Spanned<toml::Value>>,
    reserve_weight: Option<Spanned<toml::Value>>,
    reserve_add: Option<Spanned<i64>>,
    reserve_per_kib: Option<Spanned<i64>>,
    max_reserve: Option<Spanned<i64>>,
    report: Spanned<String>,
    units: Spanned<BTreeMap<Spanned<String>, Spanned<toml::Value>>>,
    failed: Option<Spanned<FailedModel>>,
    stream_include_usage: Option<Spanned<bool>>,
    abandoned: Option<Spanned<String>>,
    drain_time: Option<Spanned<String>>,
    drain_bytes: Option<Spanned<String>>,
    max_draining: Option<Spanned<i64>>,
}

/// `abandoned`, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Choice {
    Close,
    Drain,
}

/// `failed = { statuses = [400, 429, 500], charge = 0 }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FailedModel {
    statuses: Spanned<Vec<Spanned<i64>>>,
    #[serde(default)]
    charge: Option<Spanned<i64>>,
}

/// How many units a request reserves: at least `reserve`, plus
/// `reserve_add`, at most `max_reserve`.
struct Amounts {
    reserve: u64,
    add: u64,
    max: u64,
}

impl Validator<'_> {
    /// The usage settings of a route, or `None` after reporting what is
    /// wrong.
    pub(super) fn usage(&mut self, model: &Spanned<UsageModel>) -> Option<Arc<Settings>> {
        let m = model.get_ref();
        let amounts = self.reserve_amounts(m);
        let reserve_header = m
            .reserve_header
            .as_ref()
            .map_or(Some(None), |name| self.header_name(name).map(Some));
        let reserve_json = m
            .reserve_json
            .as_ref()
            .map_or(Some(None), |given| self.reserve_paths(given).map(Some));
        let reserve_weight = m
            .reserve_weight
            .as_ref()
            .map_or(Some(1.0), |w| self.weight(w));
        let source = self.report_source(&m.report);
        let (fields, weights) = self.usage_fields(&m.units, source.unwrap_or(Source::Json))?;
        let reserve_per_kib = self.reserve_per_kib(m.reserve_per_kib.as_ref());
        let failed = match &m.failed {
            None => Some(None),
            Some(f) => self.failed_answers(f).map(Some),
        };
        let stream_include_usage =
            self.stream_include_usage(m.stream_include_usage.as_ref(), source);
        let abandoned = self.abandoned(m, source);
        let amounts = amounts?;
        Some(Arc::new(Settings {
            abandoned: abandoned?,
            stream_include_usage: stream_include_usage?,
            reserve: amounts.reserve,
            reserve_header: reserve_header?,
            reserve_json: reserve_json?,
            reserve_weight: reserve_weight?,
            reserve_add: amounts.add,
            reserve_per_kib: reserve_per_kib?,
            max_reserve: amounts.max,
            source: source?,
            fields,
            weights,
            failed: failed?,
        }))
    }

    /// `reserve`, `reserve_add` and `max_reserve`, the last no less than
    /// the first.
    fn reserve_amounts(&mut self, m: &UsageModel) -> Option<Amounts> {
        let mut ok = true;
        let mut whole = |v: &mut Self, n: &Spanned<i64>, what: &str, least: i64| {
            if *n.get_ref() < least {
                v.problem(
                    n.span(),
                    format!("{what} must be a whole number of at least {least}"),
                );
                ok = false;
            }
            (*n.get_ref()).max(0) as u64
        };
        let reserve = whole(self, &m.reserve, "reserve", 1);
        let add = m
            .reserve_add
            .as_ref()
            .map_or(0, |n| whole(self, n, "reserve_add", 0));
        let max = m
            .max_reserve
            .as_ref()
            .map_or(reserve, |n| whole(self, n, "max_reserve", 1));
        if let Some(given) = &m.max_reserve
            && max < reserve
        {
            self.problem(
                given.span(),
                format!("max_reserve {max} is below reserve {reserve}; raise it"),
            );
            ok = false;
        }
        ok.then_some(Amounts { reserve, add, max })
    }

    /// `reserve_per_kib`: units reserved for each KiB of request body.
    fn reserve_per_kib(&mut self, given: Option<&Spanned<i64>>) -> Option<u64> {
        let Some(n) = given else {
            return Some(0);
        };
        match u64::try_from(*n.get_ref()) {
            Ok(n) => Some(n),
            Err(_) => {
                self.problem(
                    n.span(),
                    "reserve_per_kib is a whole number of units, 0 or more",
                );
                None
            }
        }
    }

    /// `stream_include_usage`, where a stream's events can carry usage.
    fn stream_include_usage(
        &mut self,
        given: Option<&Spanned<bool>>,
        source: Option<Source>,
    ) -> Option<bool> {
        match (given, source) {
            (Some(on), Some(Source::Sse | Source::JsonOrSse)) | (Some(on), None) => {
                Some(*on.get_ref())
            }
            (Some(on), Some(_)) => {
                if *on.get_ref() {
                    self.problem(
                        on.span(),
                        "stream_include_usage asks an upstream to report a stream's usage in its events; it needs report = \"sse\" or \"json_or_sse\"",
                    );
                    return None;
                }
                Some(false)
            }
            (None, _) => Some(false),
        }
    }

    /// `abandoned`, and the bounds of `"drain"`: given only with it, and
    /// only where the answer's body reports (a header report is read
    /// before the body goes out).
    fn abandoned(&mut self, m: &UsageModel, source: Option<Source>) -> Option<Abandoned> {
        let choice = self.choice(
            m.abandoned.as_ref(),
            "abandoned",
            &[("close", Choice::Close), ("drain", Choice::Drain)],
        )?;
        if choice == Choice::Close {
            let bounds = [
                ("drain_time", m.drain_time.as_ref().map(Spanned::span)),
                ("drain_bytes", m.drain_bytes.as_ref().map(Spanned::span)),
                ("max_draining", m.max_draining.as_ref().map(Spanned::span)),
            ];
            let mut ok = true;
            for (key, span) in bounds {
                if let Some(span) = span {
                    self.problem(
                        span,
                        format!("{key} bounds reading an answer on after its client left; it needs abandoned = \"drain\""),
                    );
                    ok = false;
                }
            }
            return ok.then_some(Abandoned::Close);
        }
        if source == Some(Source::Header)
            && let Some(given) = &m.abandoned
        {
            self.problem(
                given.span(),
                "abandoned = \"drain\" reads an answer's body for its report; with report = \"header\" the report is read before the body, so leave abandoned out",
            );
            return None;
        }
        let time = self.optional_duration(m.drain_time.as_ref(), "drain_time", Drain::TIME);
        let bytes = m
            .drain_bytes
            .as_ref()
            .map_or(Some(Drain::BYTES), |size| self.size(size, "drain_bytes"));
        let at_once = self.bounded(
            m.max_draining.as_ref(),
            Drain::AT_ONCE,
            1..=65_536,
            "max_draining is how many abandoned answers of the route are read on at once: a whole number from 1 to 65536",
        );
        Some(Abandoned::Drain(Drain {
            time: time?,
            bytes: bytes?,
            at_once: at_once?,
        }))
    }

    /// `failed`: statuses from 100 to 599, at least one; a charge of 0 or
    /// more (default 0).
    fn failed_answers(&mut self, model: &Spanned<FailedModel>) -> Option<FailedAnswers> {
        let m = model.get_ref();
        if m.statuses.get_ref().is_empty() {
            self.problem(
                m.statuses.span(),
                "statuses is empty; list the statuses of failed answers, like [400, 429, 500]",
            );
            return None;
        }
        let mut statuses = Vec::new();
        for status in m.statuses.get_ref() {
            match u16::try_from(*status.get_ref()) {
                Ok(code @ 100..=599) => statuses.push(code),
                _ => {
                    self.problem(status.span(), "a status is a number from 100 to 599");
                    return None;
                }
            }
        }
        let charge = match &m.charge {
            None => 0,
            Some(c) => match u64::try_from(*c.get_ref()) {
                Ok(n) => n,
                Err(_) => {
                    self.problem(c.span(), "charge is a whole number of units, 0 or more");
                    return None;
                }
            },
        };
        Some(FailedAnswers {
            statuses: statuses.into(),
            charge,
        })
    }

    /// `reserve_json`: one JSON path, or a list of them tried in order.
    fn reserve_paths(&mut self, given: &Spanned<toml::Value>) -> Option<Arc<[JsonPath]>> {
        let texts: Option<Vec<&str>> = match given.get_ref() {
            toml::Value::String(path) => Some(vec![path.as_str()]),
            toml::Value::Array(items) if !items.is_empty() => {
                items.iter().map(toml::Value::as_str).collect()
            }
            _ => None,
        };
        let Some(texts) = texts else {
            self.problem(
                given.span(),
                "reserve_json must be a JSON path (\"max_tokens\") or a list of them tried in order ([\"max_completion_tokens\", \"max_tokens\"])",
            );
            return None;
        };
        let mut paths = Vec::with_capacity(texts.len());
        for text in texts {
            let spanned = Spanned::new(given.span(), text.to_owned());
            paths.push(self.json_path(&spanned)?);
        }
        Some(paths.into())
    }

    /// Where the answer reports its units, or `None` after saying so.
    fn report_source(&mut self, report: &Spanned<String>) -> Option<Source> {
        let source = SOURCES
            .iter()
            .find(|(name, _)| *name == report.get_ref())
            .map(|&(_, source)| source);
        if source.is_none() {
            self.problem(
                report.span(),
                format!(
                    "report must be one of \"header\", \"trailer\", \"json\", \"sse\" or \"json_or_sse\", not {:?}",
                    report.get_ref()
                ),
            );
        }
        source
    }

    /// The reported fields and their weights: header names for `header`
    /// and `trailer`, dotted JSON paths for `json` and `sse`, parsed here
    /// once.
    fn usage_fields(
        &mut self,
        units: &Spanned<BTreeMap<Spanned<String>, Spanned<toml::Value>>>,
        source: Source,
    ) -> Option<(Fields, Box<[f64]>)> {
        if units.get_ref().is_empty() {
            self.problem(
                units.span(),
                "units names no field; name where the answer reports its units, e.g. units = { \"usage.total_tokens\" = 1 }",
            );
            return None;
        }
        let (mut headers, mut paths, mut weights) = (Vec::new(), Vec::new(), Vec::new());
        let mut ok = true;
        for (name, weight) in units.get_ref() {
            let weight = self.weight(weight);
            let named = match source {
                Source::Header | Source::Trailer => self.header_name(name).map(|h| headers.push(h)),
                Source::Json | Source::Sse | Source::JsonOrSse => {
                    self.json_path(name).map(|p| paths.push(p))
                }
            };
            match (weight, named) {
                (Some(w), Some(())) => weights.push(w),
                _ => ok = false,
            }
        }
        let fields = match source {
            Source::Header | Source::Trailer => Fields::Headers(headers.into()),
            Source::Json | Source::Sse | Source::JsonOrSse => Fields::Json(paths.into()),
        };
        ok.then(|| (fields, weights.into()))
    }

    /// A weight: a number above 0, or `None` after saying so.
    fn weight(&mut self, weight: &Spanned<toml::Value>) -> Option<f64> {
        let value = match weight.get_ref() {
            toml::Value::Integer(n) => Some(*n as f64),
            toml::Value::Float(f) => Some(*f),
            _ => None,
        };
        let w = value.filter(|w| w.is_finite() && *w > 0.0);
        if w.is_none() {
            self.problem(
                weight.span(),
                "a weight must be a number above 0 (units per unit named or reported)",
            );
        }
        w
    }

    /// The place in JSON `path` names (keys separated by dots), or `None`
    /// after saying what is wrong.
    fn json_path(&mut self, path: &Spanned<String>) -> Option<JsonPath> {
        let parsed = JsonPath::parse(path.get_ref());
        if parsed.is_none() {
            self.problem(
                path.span(),
                format!(
                    "{:?} is not a JSON path: name keys separated by dots, e.g. \"usage.output_tokens\"",
                    path.get_ref()
                ),
            );
        }
        parsed
    }
}
