//! Every answer floodgate makes itself in place of the upstream's, and whose
//! fault it is: the client's (4xx), the upstream's (502, 504) or the rate
//! limit store's (503 under `on_error = "deny"`). One body format for all,
//! an RFC 9457 problem document (OpenAI's error object on a route that
//! answers as OpenAI does), and one metric,
//! `floodgate_refusals_total{status, fault}`, so that floodgate's own 502s
//! and 504s are never mistaken for the upstream's answers.
//!
//! A gRPC request gets a gRPC status instead (HTTP 200, `grpc-status`
//! and `grpc-message` in the head), which is what gRPC clients read.
//!
//! The 429 of a denial is a problem document too, built in [`crate::response`]
//! with the route's rate-limit fields, and counted as `denied` in
//! `floodgate_requests_total`.

use std::borrow::Cow;

use http::header::RETRY_AFTER;
use http::{Response, StatusCode};

use crate::metrics::CountedRefusal;
use crate::response::{self, Body};
use crate::routes::Answers;

/// Whose fault a refusal is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The request: malformed, ambiguous, or not served here (4xx).
    Client,
    /// The upstream: unreachable, broken off or late (502, 504).
    Upstream,
    /// The rate limit store could not decide and `on_error = "deny"` (503).
    Store,
    /// The route (or the client) has as many requests in flight as its
    /// concurrency cap allows (503 or 429 by default).
    Capacity,
}

impl Fault {
    /// Every fault, in exposition order.
    pub const ALL: [Fault; 4] = [
        Fault::Client,
        Fault::Upstream,
        Fault::Store,
        Fault::Capacity,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Upstream => "upstream",
            Self::Store => "store",
            Self::Capacity => "capacity",
        }
    }
}

/// An answer of floodgate's own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    status: StatusCode,
    fault: Fault,
    detail: Cow<'static, str>,
    retry_after_ms: Option<u64>,
    /// The shape of its body.
    answers: Answers,
    /// OpenAI's error `code`, for a route that answers as OpenAI does.
    code: Option<&'static str>,
}

impl Refusal {
    /// The client's fault: `status` is a 4xx.
    pub fn client(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self::new(status, Fault::Client, detail)
    }

    /// The upstream's fault: 502 or 504.
    pub fn upstream(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self::new(status, Fault::Upstream, detail)
    }

    /// The store could not decide and policy says deny: 503, retry after
    /// `retry_after_ms`.
    pub fn store(retry_after_ms: u64) -> Self {
        Self {
            retry_after_ms: Some(retry_after_ms),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                Fault::Store,
                "the rate limit store is unavailable; retry later",
            )
        }
    }

    /// A concurrency cap is full: `status`, retry after a second.
    pub fn capacity(status: StatusCode, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            retry_after_ms: Some(1000),
            ..Self::new(status, Fault::Capacity, detail)
        }
    }

    fn new(status: StatusCode, fault: Fault, detail: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            fault,
            detail: detail.into(),
            retry_after_ms: None,
            answers: Answers::Problem,
            code: None,
        }
    }

    /// The client's credential is refused: `status` (401 or 403), with
    /// OpenAI's error `code` where the route answers as OpenAI does.
    pub fn credential(
        status: StatusCode,
        detail: impl Into<Cow<'static, str>>,
        code: &'static str,
    ) -> Self {
        Self {
            code: Some(code),
            ..Self::new(status, Fault::Client, detail)
        }
    }

    /// This refusal telling the client to retry after `ms`.
    pub fn retry_after(self, ms: u64) -> Self {
        Self {
            retry_after_ms: Some(ms),
            ..self
        }
    }

    /// This refusal with its body in the shape `answers` names (a route's
    /// `answers`).
    pub fn answered_as(self, answers: Answers) -> Self {
        Self { answers, ..self }
    }

    /// The status sent.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// Whose fault it is.
    pub fn fault(&self) -> Fault {
        self.fault
    }

    /// What the problem document's `detail` says.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The answer: a problem document (or OpenAI's error object, typed
    /// `server_error` for a 5xx, `invalid_request_error` for a 4xx), with
    /// `Retry-After` where there is one.
    pub fn into_response<U>(self) -> Response<Body<U>> {
        let mut response = match self.answers {
            Answers::Problem => response::problem(self.status, &self.detail),
            Answers::OpenAi => {
                let kind = if self.status.is_server_error() {
                    "server_error"
                } else {
                    "invalid_request_error"
                };
                response::openai::error(self.status, &self.detail, kind, self.code)
            }
        };
        if let Some(ms) = self.retry_after_ms {
            response
                .headers_mut()
                .insert(RETRY_AFTER, response::retry_after(ms));
        }
        response
    }
}

impl Refusal {
    /// The answer to a gRPC request: a trailers-only gRPC status. The code
    /// follows gRPC's mapping of HTTP statuses (400 INTERNAL, 401
    /// UNAUTHENTICATED, 403 PERMISSION_DENIED, 404 UNIMPLEMENTED, 502 and
    /// 503 UNAVAILABLE), except where floodgate knows more: a timeout (408,
    /// 504) is DEADLINE_EXCEEDED and 413 RESOURCE_EXHAUSTED.
    pub fn into_grpc_response<U>(self) -> Response<Body<U>> {
        let code = match self.status.as_u16() {
            401 => 16,
            403 => 7,
            404 => 12,
            408 | 504 => 4,
            413 | 429 => response::GRPC_RESOURCE_EXHAUSTED,
            502 | 503 => 14,
            400..=499 => 13,
            _ => 2,
        };
        let mut response = response::grpc_status(code, &self.detail);
        if let Some(ms) = self.retry_after_ms {
            response
                .headers_mut()
                .insert(RETRY_AFTER, response::retry_after(ms));
        }
        response
    }
}

impl CountedRefusal for Refusal {
    fn status_label(&self) -> &str {
        self.status.as_str()
    }

    fn fault_label(&self) -> &'static str {
        self.fault.name()
    }
}

impl From<crate::head::HeadError> for Refusal {
    fn from(e: crate::head::HeadError) -> Self {
        Self::client(e.status(), e.to_string())
    }
}

impl From<crate::routes::PathError> for Refusal {
    fn from(e: crate::routes::PathError) -> Self {
        Self::client(StatusCode::BAD_REQUEST, e.to_string())
    }
}

impl From<crate::client::ClientError> for Refusal {
    fn from(e: crate::client::ClientError) -> Self {
        use crate::client::ClientError;
        match e {
            ClientError::TooManyFailures(wait_ms) => Self {
                retry_after_ms: Some(wait_ms),
                ..Self::client(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            },
            ClientError::Token(_) => Self::client(StatusCode::UNAUTHORIZED, e.to_string()),
            ClientError::NoAttribute(_) => Self::client(StatusCode::FORBIDDEN, e.to_string()),
            _ => Self::client(StatusCode::BAD_REQUEST, e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};

    async fn body(response: Response<Body<Full<Bytes>>>) -> String {
        let bytes = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[tokio::test]
    async fn refusals_are_problem_documents_whatever_their_detail_holds() {
        let r = Refusal::client(
            StatusCode::BAD_REQUEST,
            "the \"X-Api-Key\" header \\ has\na control \u{1} character",
        );
        assert_eq!(
            (r.status(), r.fault()),
            (StatusCode::BAD_REQUEST, Fault::Client)
        );
        let response = r.into_response::<Full<Bytes>>();
        assert_eq!(
            response.headers().get("content-type").map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..])
        );
        let text = body(response).await;
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(json["status"], 400);
        assert_eq!(json["title"], "Bad Request");
        assert_eq!(
            json["detail"],
            "the \"X-Api-Key\" header \\ has\na control \u{1} character"
        );
    }

    #[test]
    fn grpc_requests_get_grpc_statuses_with_the_detail_encoded() {
        let response = Refusal::upstream(StatusCode::GATEWAY_TIMEOUT, "late: 100%\n")
            .into_grpc_response::<Full<Bytes>>();
        assert_eq!(response.status(), StatusCode::OK);
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap_or_default().to_owned())
        };
        assert_eq!(header("content-type").as_deref(), Some("application/grpc"));
        assert_eq!(header("grpc-status").as_deref(), Some("4"));
        assert_eq!(header("grpc-message").as_deref(), Some("late: 100%25%0A"));
        let unavailable = Refusal::store(1_000).into_grpc_response::<Full<Bytes>>();
        assert_eq!(
            unavailable
                .headers()
                .get("grpc-status")
                .map(|v| v.as_bytes()),
            Some(&b"14"[..])
        );
        assert!(unavailable.headers().contains_key(RETRY_AFTER));
    }

    #[tokio::test]
    async fn a_store_refusal_says_when_to_retry() {
        let response = Refusal::store(1_500).into_response::<Full<Bytes>>();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            response.headers().get(RETRY_AFTER).map(|v| v.as_bytes()),
            Some(&b"2"[..])
        );
    }
}
