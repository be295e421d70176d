//! OpenAI's error object, `{"error": {"message", "type", "param",
//! "code"}}`, for floodgate's own answers on a route with `answers =
//! "openai"`: what OpenAI's SDKs read into their exceptions (`code` tells
//! a client to wait or to stop).

use std::fmt::Write as _;

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Response, StatusCode};

use super::{Body, NO_STORE, json_escape};
use crate::limit::Decision;
use crate::routes::{DenyCode, Policy, Route};

/// What OpenAI says of a spent quota.
const QUOTA: &str = "You exceeded your current quota, please check your plan and billing details.";

/// The 429 of a request `route`'s limits denied, whose wait is `wait`
/// seconds: the code of the limit that refused it ([`Policy::code`]),
/// typed as OpenAI types it (`requests` or `tokens` for a rate,
/// `insufficient_quota` for a quota).
pub(super) fn denial<U>(
    route: &Route,
    limits: &Policy,
    decision: &Decision,
    wait: u64,
) -> Response<Body<U>> {
    let code = limits.code(decision.limit);
    if code == DenyCode::InsufficientQuota {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            QUOTA,
            code.name(),
            Some(code.name()),
        );
    }
    let counted = limits.limits.get(decision.limit);
    let units_are_requests = route.usage.is_none() && route.cost == 1;
    let kind = if counted.is_some_and(|l| l.counts_requests) || units_are_requests {
        "requests"
    } else {
        "tokens"
    };
    let name = limits.name(decision.limit).unwrap_or(&route.name);
    let mut message = format!("Rate limit reached for {kind} on {name}");
    if let Some(limit) = counted {
        let _ = write!(
            message,
            ": Limit {} per {}s",
            limit.capacity(),
            limit.window_now_ms().div_ceil(1000)
        );
    }
    let _ = write!(message, ". Please try again in {wait}s.");
    error(
        StatusCode::TOO_MANY_REQUESTS,
        &message,
        kind,
        Some(code.name()),
    )
}

/// An answer of `status` in OpenAI's shape: `message`, its `type`
/// `kind`, `param` null, and `code` (null when `None`).
pub fn error<U>(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response<Body<U>> {
    let mut body = String::with_capacity(96 + message.len());
    body.push_str("{\"error\":{\"message\":\"");
    json_escape(&mut body, message);
    body.push_str("\",\"type\":\"");
    json_escape(&mut body, kind);
    body.push_str("\",\"param\":null,\"code\":");
    match code {
        Some(code) => {
            body.push('"');
            json_escape(&mut body, code);
            body.push('"');
        }
        None => body.push_str("null"),
    }
    body.push_str("}}\n");
    let mut response = Response::new(Body::whole(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, NO_STORE);
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn errors_are_openai_error_objects_whatever_their_message_holds() {
        let response = error::<http_body_util::Empty<bytes::Bytes>>(
            StatusCode::SERVICE_UNAVAILABLE,
            "a \"quoted\"\nline",
            "server_error",
            None,
        );
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        let bytes = response
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
        assert_eq!(
            json,
            serde_json::json!({"error": {
                "message": "a \"quoted\"\nline", "type": "server_error",
                "param": null, "code": null,
            }})
        );
    }
}
