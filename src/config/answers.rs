//! A route's answers to denied requests: `deny = { … }` and which
//! rate-limit fields responses carry (`rate_limit_headers`), and the shape
//! of floodgate's own answers (`answers`).

use std::collections::BTreeMap;

use bytes::Bytes;
use http::header::HeaderName;
use http::{HeaderValue, StatusCode};
use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::routes::{Answers, DenyAnswer, HeaderMode};

/// `deny = { status, body, content_type, headers }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct DenyModel {
    status: Option<Spanned<i64>>,
    body: Option<Spanned<String>>,
    content_type: Option<Spanned<String>>,
    #[serde(default)]
    headers: BTreeMap<Spanned<String>, Spanned<String>>,
}

/// Headers floodgate sets itself on a denial; a `deny.headers` entry may not
/// name them.
const OWN_HEADERS: [&str; 7] = [
    "retry-after",
    "ratelimit",
    "ratelimit-policy",
    "x-ratelimit-limit",
    "x-ratelimit-remaining",
    "x-ratelimit-reset",
    "content-type",
];

/// Headers that would break the framing or the connection if set by hand.
const HOP_HEADERS: [&str; 6] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
];

impl Validator<'_> {
    /// A 4xx or 5xx status, `default` when absent.
    pub(super) fn error_status(
        &mut self,
        value: Option<&Spanned<i64>>,
        default: StatusCode,
        message: &str,
    ) -> Option<StatusCode> {
        let Some(value) = value else {
            return Some(default);
        };
        let status = u16::try_from(*value.get_ref())
            .ok()
            .filter(|s| (400..=599).contains(s))
            .and_then(|s| StatusCode::from_u16(s).ok());
        if status.is_none() {
            self.problem(value.span(), message);
        }
        status
    }

    /// A `Content-Type` value, `text/plain; charset=utf-8` when absent.
    pub(super) fn content_type(
        &mut self,
        value: Option<&Spanned<String>>,
        key: &str,
    ) -> Option<HeaderValue> {
        let Some(value) = value else {
            return Some(HeaderValue::from_static("text/plain; charset=utf-8"));
        };
        match HeaderValue::from_str(value.get_ref()) {
            Ok(v) => Some(v),
            Err(_) => {
                self.problem(value.span(), format!("{key} is not a valid header value"));
                None
            }
        }
    }

    /// The rate-limit header mode `value` names, or `default`.
    pub(super) fn header_mode(
        &mut self,
        value: Option<&Spanned<String>>,
        default: HeaderMode,
    ) -> Option<HeaderMode> {
        let Some(value) = value else {
            return Some(default);
        };
        self.choice(Some(value), "rate_limit_headers", &HeaderMode::NAMES)
    }

    /// A route's `answers`: `problem` unless it says otherwise. OpenAI's
    /// shape comes with its own denial body, so a route gives one of
    /// `deny` and `answers = "openai"`.
    pub(super) fn answers(
        &mut self,
        value: Option<&Spanned<String>>,
        deny: Option<&Spanned<DenyModel>>,
    ) -> Option<Answers> {
        let answers = self.choice(value, "answers", &Answers::NAMES)?;
        if let (Answers::OpenAi, Some(deny)) = (answers, deny) {
            self.problem(
                deny.span(),
                "deny writes the denial's body and answers = \"openai\" writes it in OpenAI's shape; keep one of them (each limit's deny_code says what an OpenAI denial reports)",
            );
            return None;
        }
        Some(answers)
    }

    /// A route's `deny` answer.
    pub(super) fn deny(&mut self, model: &Spanned<DenyModel>) -> Option<DenyAnswer> {
        let m = model.get_ref();
        let status = self.error_status(
            m.status.as_ref(),
            StatusCode::TOO_MANY_REQUESTS,
            "deny status must be a 4xx or 5xx code (a denial is an error to the client)",
        );
        let content_type = self.content_type(m.content_type.as_ref(), "deny content_type");
        let mut headers = Vec::with_capacity(m.headers.len());
        let mut ok = true;
        for (name, value) in &m.headers {
            let lower = name.get_ref().to_ascii_lowercase();
            let parsed = HeaderName::from_bytes(lower.as_bytes());
            let Ok(header) = parsed else {
                self.problem(
                    name.span(),
                    format!(
                        "deny header {:?} is not a valid header name",
                        name.get_ref()
                    ),
                );
                ok = false;
                continue;
            };
            let refused = if OWN_HEADERS.contains(&lower.as_str()) {
                Some("is set by floodgate itself (content_type is its own key)")
            } else if HOP_HEADERS.contains(&lower.as_str()) {
                Some("describes the connection or the framing and cannot be set")
            } else {
                None
            };
            if let Some(why) = refused {
                self.problem(
                    name.span(),
                    format!("deny header {:?} {why}", name.get_ref()),
                );
                ok = false;
                continue;
            }
            match HeaderValue::from_str(value.get_ref()) {
                Ok(v) => headers.push((header, v)),
                Err(_) => {
                    self.problem(
                        value.span(),
                        format!("deny header {:?} has an invalid value", name.get_ref()),
                    );
                    ok = false;
                }
            }
        }
        let body = m
            .body
            .as_ref()
            .map_or_else(Bytes::new, |b| Bytes::from(b.get_ref().clone()));
        if !ok {
            return None;
        }
        Some(DenyAnswer {
            status: status?,
            waits: body
                .windows(DenyAnswer::RETRY_AFTER.len())
                .any(|w| w == DenyAnswer::RETRY_AFTER.as_bytes()),
            body,
            content_type: content_type?,
            headers,
        })
    }
}
