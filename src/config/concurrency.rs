//! A route's `concurrency = { … }`: how many requests it may have in flight.

use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{Validator, parse_duration};
use crate::concurrency::settings::{Adaptive, Per, Settings};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ConcurrencyModel {
    max_in_flight: Option<Spanned<i64>>,
    per: Option<Spanned<String>>,
    queue: Option<Spanned<i64>>,
    queue_timeout: Option<Spanned<String>>,
    status: Option<Spanned<i64>>,
    adaptive: Option<Spanned<AdaptiveModel>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdaptiveModel {
    min: Option<Spanned<i64>>,
    max: Option<Spanned<i64>>,
    interval: Option<Spanned<String>>,
    floor_every: Option<Spanned<String>>,
    tolerance: Option<Spanned<f64>>,
}

/// Largest cap or queue accepted.
const MAX_SLOTS: usize = 1_000_000;

impl Validator<'_> {
    pub(super) fn concurrency(&mut self, model: &Spanned<ConcurrencyModel>) -> Option<Settings> {
        let m = model.get_ref();
        let per = self.choice(m.per.as_ref(), "per", &Per::NAMES);
        let max_in_flight = match (&m.max_in_flight, &m.adaptive) {
            (Some(n), None) => self.bounded(
                Some(n),
                0,
                1..=MAX_SLOTS,
                "max_in_flight must be a whole number from 1 to 1000000",
            ),
            (None, Some(_)) => Some(0),
            (Some(n), Some(_)) => {
                self.problem(
                    n.span(),
                    "max_in_flight and adaptive exclude each other: adaptive finds the cap itself within its min and max",
                );
                None
            }
            (None, None) => {
                self.problem(
                    model.span(),
                    "concurrency needs max_in_flight = N, or adaptive = { min = 1, max = 100 }",
                );
                None
            }
        };
        let queue = self.bounded(
            m.queue.as_ref(),
            0,
            0..=MAX_SLOTS,
            "queue must be a whole number of waiting requests from 0 to 1000000",
        );
        let queue_timeout = match &m.queue_timeout {
            None => Some(Duration::from_secs(1)),
            Some(t) => self.duration(t, "queue_timeout"),
        };
        if let (Some(t), Some(0)) = (&m.queue_timeout, queue) {
            self.problem(t.span(), "queue_timeout has no meaning without a queue");
        }
        let default_status = match per {
            Some(Per::Client) => http::StatusCode::TOO_MANY_REQUESTS,
            _ => http::StatusCode::SERVICE_UNAVAILABLE,
        };
        let status = self.error_status(
            m.status.as_ref(),
            default_status,
            "status must be a 4xx or 5xx code",
        );
        let adaptive = match &m.adaptive {
            None => Some(None),
            Some(a) => {
                if per == Some(Per::Client) {
                    self.problem(
                        a.span(),
                        "an adaptive cap follows the upstream, so it is per = \"route\"",
                    );
                }
                self.adaptive(a.get_ref()).map(Some)
            }
        };
        Some(Settings {
            per: per?,
            max_in_flight: max_in_flight?,
            queue: queue?,
            queue_timeout: queue_timeout?,
            status: status?,
            adaptive: adaptive?,
        })
    }

    fn adaptive(&mut self, m: &AdaptiveModel) -> Option<Adaptive> {
        let min = self.bounded(
            m.min.as_ref(),
            1,
            1..=MAX_SLOTS,
            "min must be a whole number from 1 to 1000000",
        );
        let max = self.bounded(
            m.max.as_ref(),
            1000,
            1..=MAX_SLOTS,
            "max must be a whole number from 1 to 1000000",
        );
        if let (Some(lo), Some(hi), Some(span)) = (min, max, m.max.as_ref().or(m.min.as_ref()))
            && lo > hi
        {
            self.problem(span.span(), "min must not exceed max");
            return None;
        }
        let mut duration = |v: &Option<Spanned<String>>, key: &str, default: Duration| match v {
            None => Some(default),
            Some(t) => match parse_duration(t.get_ref()) {
                Ok(d) if d >= Duration::from_millis(50) => Some(d),
                Ok(_) => {
                    self.problem(t.span(), format!("{key} must be at least 50ms"));
                    None
                }
                Err(e) => {
                    self.problem(t.span(), format!("{key}: {e}"));
                    None
                }
            },
        };
        let interval = duration(&m.interval, "interval", Duration::from_millis(500));
        let floor_every = duration(&m.floor_every, "floor_every", Duration::from_secs(60));
        let tolerance = match &m.tolerance {
            None => Some(0.25),
            Some(t) if (0.0..=10.0).contains(t.get_ref()) => Some(*t.get_ref()),
            Some(t) => {
                self.problem(
                    t.span(),
                    "tolerance is a share of the floor from 0.0 to 10.0",
                );
                None
            }
        };
        Some(Adaptive {
            min: min?,
            max: max?,
            interval: interval?,
            floor_every: floor_every?,
            tolerance: tolerance?,
        })
    }
}
