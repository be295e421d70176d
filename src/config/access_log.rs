//! `[access_log]`: whether requests are logged, where and how.

use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::access_log::{Settings, ShowId};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct AccessLogModel {
    format: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    client_id: Option<Spanned<String>>,
    sample_allowed: Option<Spanned<f64>>,
    denied_per_client: Option<Spanned<i64>>,
}

impl Validator<'_> {
    /// The access log's settings (`None` when `format = "off"`) and how
    /// client ids are shown.
    pub(super) fn access_log(&mut self, m: &AccessLogModel) -> Option<(Option<Settings>, ShowId)> {
        let format = self.choice(
            m.format.as_ref(),
            "access_log format",
            &crate::access_log::FORMATS,
        );
        let client_id = self.choice(m.client_id.as_ref(), "access_log client_id", &ShowId::NAMES);
        let sample_allowed = match &m.sample_allowed {
            None => Some(1.0),
            Some(s) if (0.0..=1.0).contains(s.get_ref()) => Some(*s.get_ref()),
            Some(s) => {
                self.problem(
                    s.span(),
                    "sample_allowed is the share of allowed requests logged: a number from 0.0 to 1.0",
                );
                None
            }
        };
        let denied_per_client = self.bounded(
            m.denied_per_client.as_ref(),
            5,
            1..=1_000,
            "denied_per_client must be a whole number of lines a second from 1 to 1000",
        );
        let path = m.path.as_ref().map(|p| self.resolve(p));
        let (format, client_id, sample_allowed, denied_per_client) =
            (format?, client_id?, sample_allowed?, denied_per_client?);
        let settings = format.map(|format| Settings {
            format,
            path,
            sample_allowed,
            denied_per_client: denied_per_client as u64,
        });
        Some((settings, client_id))
    }
}
