//! Windows by the calendar in a limit entry: `window = "month"` (or
//! `minute`, `hour`, `day`, `week`, `year`), `time_zone`, `week_starts`,
//! and `anchor`, the day of the month a client's months start on (a
//! number, or a verified claim with a default).

use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::jwt::ClaimRule;
use crate::limit::Algorithm;
use crate::limit::calendar::{Calendar, Unit};
use crate::routes::{Anchor, CalendarLimit};

/// `anchor = 15`, `anchor = { claim = "billing_day", default = 1 }` or
/// `anchor = { key = "billing_day", default = 1 }`.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum AnchorModel {
    Day(i64),
    Claim {
        claim: String,
        default: i64,
    },
    /// `anchor = { key = "billing_day", default = 1 }`: an attribute of
    /// the request's verified API key.
    Key {
        key: String,
        default: i64,
    },
}

/// A limit entry's keys that concern the calendar, as the entry gives them.
pub(super) struct CalendarKeys<'a> {
    pub(super) algorithm: &'a Spanned<String>,
    pub(super) window: &'a Spanned<String>,
    pub(super) time_zone: Option<&'a Spanned<String>>,
    pub(super) week_starts: Option<&'a Spanned<String>>,
    pub(super) anchor: Option<&'a Spanned<AnchorModel>>,
}

/// Week days by their names in configuration files.
const WEEKDAYS: [(&str, jiff::civil::Weekday); 7] = [
    ("monday", jiff::civil::Weekday::Monday),
    ("tuesday", jiff::civil::Weekday::Tuesday),
    ("wednesday", jiff::civil::Weekday::Wednesday),
    ("thursday", jiff::civil::Weekday::Thursday),
    ("friday", jiff::civil::Weekday::Friday),
    ("saturday", jiff::civil::Weekday::Saturday),
    ("sunday", jiff::civil::Weekday::Sunday),
];

impl Validator<'_> {
    /// The calendar a limit entry's window follows, if it names a calendar
    /// unit: `Some(None)` for a window that is a duration, `None` (with the
    /// problems recorded) for calendar settings that are wrong or given to
    /// a duration. `jwt` verifies an anchor read from a claim.
    pub(super) fn calendar_of(
        &mut self,
        m: &CalendarKeys<'_>,
        jwt: Option<&ClaimRule>,
    ) -> Option<Option<CalendarLimit>> {
        let Some(unit) = Unit::parse(m.window.get_ref()) else {
            let stray = [
                m.time_zone.map(|z| (z.span(), "time_zone")),
                m.week_starts.map(|w| (w.span(), "week_starts")),
                m.anchor.map(|a| (a.span(), "anchor")),
            ];
            let mut ok = true;
            for (span, key) in stray.into_iter().flatten() {
                self.problem(
                    span,
                    format!("{key} applies to a window by the calendar (window = \"day\", \"week\", \"month\", …), not to a duration"),
                );
                ok = false;
            }
            return ok.then_some(None);
        };
        let named = Algorithm::NAMES
            .iter()
            .find(|(n, _)| n == m.algorithm.get_ref());
        if !named.is_some_and(|(_, a)| a.follows_calendar()) {
            self.problem(
                m.algorithm.span(),
                format!(
                    "window {:?} follows the calendar and counts as a fixed window: use algorithm = \"fixed_window\"",
                    unit.name()
                ),
            );
            return None;
        }
        let zone = match m.time_zone {
            None => Some(jiff::tz::TimeZone::UTC),
            Some(name) => match jiff::tz::TimeZone::get(name.get_ref()) {
                Ok(zone) => Some(zone),
                Err(_) => {
                    self.problem(
                        name.span(),
                        format!("unknown time zone {:?}; use an IANA name such as \"Europe/Berlin\" or \"America/New_York\" (or \"UTC\")", name.get_ref()),
                    );
                    None
                }
            },
        };
        let week_starts = match m.week_starts {
            None => Some(jiff::civil::Weekday::Monday),
            Some(_) if unit != Unit::Week => {
                let span = m.week_starts.map_or(0..0, Spanned::span);
                self.problem(span, "week_starts applies to window = \"week\"");
                None
            }
            Some(day) => self.choice(Some(day), "week_starts", &WEEKDAYS),
        };
        let anchor = match m.anchor {
            None => Some(Anchor::Day(1)),
            Some(a) if unit != Unit::Month => {
                self.problem(
                    a.span(),
                    "anchor (the day of the month a client's months start on) applies to window = \"month\"",
                );
                None
            }
            Some(a) => self.anchor(a.get_ref(), jwt, a.span()),
        };
        Some(Some(CalendarLimit {
            calendar: Calendar {
                unit,
                zone: zone?,
                week_starts: week_starts?,
            },
            anchor: anchor?,
            remembered: Default::default(),
        }))
    }

    fn anchor(
        &mut self,
        model: &AnchorModel,
        jwt: Option<&ClaimRule>,
        span: std::ops::Range<usize>,
    ) -> Option<Anchor> {
        let day = |v: &mut Self, n: i64| match n {
            1..=31 => Some(n as u8),
            _ => {
                v.problem(
                    span.clone(),
                    format!("anchor day {n}: a day of the month is 1 to 31 (31: the last day of every month)"),
                );
                None
            }
        };
        match model {
            AnchorModel::Day(n) => day(self, *n).map(Anchor::Day),
            AnchorModel::Claim { claim, default } => {
                let default = day(self, *default);
                let Some(jwt) = jwt else {
                    self.problem(
                        span,
                        "anchor = { claim = … } reads a verified token claim: give the route a jwt client (client = { from = \"jwt\", … }) or choose plans by a jwt claim",
                    );
                    return None;
                };
                if claim.is_empty() {
                    self.problem(span, "the claim's name is empty");
                    return None;
                }
                Some(Anchor::Claim {
                    rule: Arc::new(jwt.for_claim(claim)),
                    default: default?,
                })
            }
            AnchorModel::Key { key, default } => {
                let default = day(self, *default);
                if key.is_empty() {
                    self.problem(span, "the attribute's name is empty");
                    return None;
                }
                Some(Anchor::Key {
                    attribute: key.as_str().into(),
                    default: default?,
                })
            }
        }
    }
}
