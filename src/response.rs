//! What floodgate itself answers, and the rate-limit headers it adds.
//!
//! Headers follow draft-ietf-httpapi-ratelimit-headers in structured-field
//! syntax: `RateLimit-Policy: "login";q=5;w=60` names every limit of a route,
//! and `RateLimit: "login";r=0;t=41` reports the most constrained one (`t`:
//! seconds until at least one more unit, per draft -10).
//! Denials, and every other answer floodgate makes itself
//! ([`crate::refusal`]), are RFC 9457 problem documents, or OpenAI's
//! error objects on a route that answers as OpenAI does ([`openai`]).

use std::cell::RefCell;
use std::fmt::Write as _;

use bytes::BytesMut;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, HeaderName, RETRY_AFTER};
use http::{HeaderMap, HeaderValue, Response, StatusCode};

use crate::limit::Decision;
use crate::routes::{Answers, Policy, Route};

mod body;
pub mod openai;

pub use body::{Body, BoxError, Rest, Watcher};

/// `RateLimit-Policy` header name.
pub static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit` header name.
pub static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
/// `X-RateLimit-Limit`: the most constrained limit's quota.
pub static X_RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
/// `X-RateLimit-Remaining`: units left in it.
pub static X_RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
/// `X-RateLimit-Reset`: seconds until it has at least one more unit.
pub static X_RATELIMIT_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

const PROBLEM_JSON: HeaderValue = HeaderValue::from_static("application/problem+json");
const NO_STORE: HeaderValue = HeaderValue::from_static("no-store");

/// Formats a header value through a stack buffer, so the value itself is
/// the only allocation; `None` if the text is not a valid header value.
pub fn header_value(args: std::fmt::Arguments<'_>) -> Option<HeaderValue> {
    use std::io::Write as _;
    let mut buf = [0u8; 256];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    if cursor.write_fmt(args).is_ok() {
        let n = cursor.position() as usize;
        return HeaderValue::from_bytes(&buf[..n]).ok();
    }
    HeaderValue::from_str(&std::fmt::format(args)).ok()
}

/// Whole seconds for headers: rounded up, so a client that waits that long is
/// never early.
fn seconds(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// Adds the rate-limit fields of `route`'s header mode for `decision`. A
/// shadow route never denies, so on a decision it would have denied it
/// sends only the policy, no state that claims a denial.
pub fn annotate(headers: &mut HeaderMap, route: &Route, limits: &Policy, decision: &Decision) {
    let Some(policy) = &limits.header else {
        return;
    };
    let state = decision.allowed || !route.shadow;
    if route.rate_limit_headers.openai() {
        openai_fields(headers, route, limits, decision, state);
        return;
    }
    if route.rate_limit_headers.x_ratelimit() {
        if let Some(quota) = limits.quotas.get(decision.limit) {
            headers.insert(X_RATELIMIT_LIMIT.clone(), quota.clone());
        }
        if state {
            headers.insert(
                X_RATELIMIT_REMAINING.clone(),
                HeaderValue::from(decision.remaining),
            );
            headers.insert(
                X_RATELIMIT_RESET.clone(),
                HeaderValue::from(seconds(decision.next_ms)),
            );
        }
    }
    if !route.rate_limit_headers.ietf() {
        return;
    }
    headers.insert(RATELIMIT_POLICY.clone(), policy.clone());
    if !state {
        return;
    }
    let name = limits.name(decision.limit).unwrap_or(&route.name);
    let Some(value) = ratelimit_value(name, decision.remaining, seconds(decision.next_ms)) else {
        return;
    };
    headers.insert(RATELIMIT.clone(), value);
}

/// OpenAI's names: `x-ratelimit-{limit,remaining,reset}-requests`, then
/// the same for `-tokens`.
static OPENAI: [[HeaderName; 3]; 2] = [
    [
        HeaderName::from_static("x-ratelimit-limit-requests"),
        HeaderName::from_static("x-ratelimit-remaining-requests"),
        HeaderName::from_static("x-ratelimit-reset-requests"),
    ],
    [
        HeaderName::from_static("x-ratelimit-limit-tokens"),
        HeaderName::from_static("x-ratelimit-remaining-tokens"),
        HeaderName::from_static("x-ratelimit-reset-tokens"),
    ],
];

/// OpenAI's fields (`rate_limit_headers = "openai"`): for the most
/// constrained limit that counts requests and the most constrained that
/// counts the route's units (tokens), its quota, what remains and the
/// wait until it has at least one more unit, as a duration (`6m0s`). A
/// route without usage or a `cost` counts requests with every limit.
fn openai_fields(
    headers: &mut HeaderMap,
    route: &Route,
    limits: &Policy,
    decision: &Decision,
    state: bool,
) {
    let units_are_requests = route.usage.is_none() && route.cost == 1;
    let briefs = [
        Some((decision.limit, decision.remaining, decision.next_ms)),
        decision
            .other
            .map(|o| (usize::from(o.limit), o.remaining, o.next_ms)),
    ];
    for (limit, remaining, next_ms) in briefs.into_iter().flatten() {
        let Some(counted) = limits.limits.get(limit) else {
            continue;
        };
        let kind = usize::from(!(counted.counts_requests || units_are_requests));
        let [quota, left, reset] = &OPENAI[kind];
        if let Some(q) = limits.quotas.get(limit) {
            headers.insert(quota.clone(), q.clone());
        }
        if state {
            headers.insert(left.clone(), HeaderValue::from(remaining));
            if let Some(value) = header_value(format_args!("{}", GoDuration(next_ms))) {
                headers.insert(reset.clone(), value);
            }
        }
    }
}

/// A wait as OpenAI writes its resets (Go's duration text): `20ms`, `1s`,
/// `1.5s`, `6m0s`, `1h2m3s`; whole milliseconds.
struct GoDuration(u64);

impl std::fmt::Display for GoDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms = self.0;
        if ms == 0 {
            return f.write_str("0s");
        }
        if ms < 1000 {
            return write!(f, "{ms}ms");
        }
        let (hours, minutes) = (ms / 3_600_000, ms / 60_000 % 60);
        let (secs, frac) = (ms / 1000 % 60, ms % 1000);
        if hours > 0 {
            write!(f, "{hours}h{minutes}m")?;
        } else if minutes > 0 {
            write!(f, "{minutes}m")?;
        }
        if frac == 0 {
            return write!(f, "{secs}s");
        }
        let frac = format!("{frac:03}");
        write!(f, "{secs}.{}s", frac.trim_end_matches('0'))
    }
}

/// Size of the blocks `RateLimit` values are written into.
const VALUE_BLOCK: usize = 4096;

thread_local! {
    /// The block this thread writes `RateLimit` values into.
    static VALUES: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// `"name";r=N;t=M` as a share of this thread's value block: one block
/// serves about a hundred responses, so a value costs no allocation of its
/// own (a block is freed with the last value in it, or reused once all its
/// values are gone). Written straight into the block, since this runs on
/// every response: no buffer zeroed and copied, and a name of any length
/// written whole.
fn ratelimit_value(name: &str, remaining: u64, reset: u64) -> Option<HeaderValue> {
    let mut digits = itoa::Buffer::new();
    VALUES.with_borrow_mut(|block| {
        // A quote, the name, `";r=`, up to 20 digits, `;t=`, up to 20.
        let most = name.len() + 48;
        if block.capacity() - block.len() < most {
            block.reserve(VALUE_BLOCK.max(most));
        }
        block.extend_from_slice(b"\"");
        block.extend_from_slice(name.as_bytes());
        block.extend_from_slice(b"\";r=");
        block.extend_from_slice(digits.format(remaining).as_bytes());
        block.extend_from_slice(b";t=");
        block.extend_from_slice(digits.format(reset).as_bytes());
        // Checked, though it is visible ASCII by construction (a route's
        // name is, by the configuration's rules): the check is a scan of a
        // few dozen bytes, and floodgate has no `unsafe`.
        HeaderValue::from_maybe_shared(block.split().freeze()).ok()
    })
}

/// `Retry-After` for a wait of `ms`: whole seconds, rounded up, at least 1.
pub fn retry_after(ms: u64) -> HeaderValue {
    HeaderValue::from(seconds(ms).max(1))
}

/// The answer to a request `route`'s limits denied: the route's own `deny`
/// answer, a 429 in OpenAI's shape (`answers = "openai"`), or a 429
/// problem document.
pub fn too_many_requests<U>(
    route: &Route,
    limits: &Policy,
    decision: &Decision,
) -> Response<Body<U>> {
    let mut response = match &route.deny {
        Some(deny) => {
            let wait = seconds(decision.retry_after_ms).max(1);
            let mut response = Response::new(Body::whole(deny.body_for(wait)));
            *response.status_mut() = deny.status;
            let headers = response.headers_mut();
            headers.insert(CONTENT_TYPE, deny.content_type.clone());
            for (name, value) in &deny.headers {
                headers.append(name.clone(), value.clone());
            }
            response
        }
        None if route.answers == Answers::OpenAi => openai::denial(
            route,
            limits,
            decision,
            seconds(decision.retry_after_ms).max(1),
        ),
        None => {
            let wait = seconds(decision.retry_after_ms).max(1);
            let detail = format!(
                "rate limit of route \"{}\" exceeded; retry in {wait} s",
                route.name
            );
            problem(StatusCode::TOO_MANY_REQUESTS, &detail)
        }
    };
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, retry_after(decision.retry_after_ms));
    annotate(headers, route, limits, decision);
    response
}

/// A request's answer must be gRPC's when its `Content-Type` says gRPC
/// (`application/grpc`, `+proto`, `+json`, `-web`): gRPC clients read the
/// outcome from `grpc-status`, not the HTTP status.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// gRPC's RESOURCE_EXHAUSTED for a request `route`'s limits denied, as
/// Envoy answers a rate-limited gRPC call: HTTP 200, the status in the
/// head (a trailers-only answer), and the rate-limit fields.
pub fn grpc_too_many_requests<U>(
    route: &Route,
    limits: &Policy,
    decision: &Decision,
) -> Response<Body<U>> {
    let wait = seconds(decision.retry_after_ms).max(1);
    let message = format!(
        "rate limit of route \"{}\" exceeded; retry in {wait} s",
        route.name
    );
    let mut response = grpc_status(GRPC_RESOURCE_EXHAUSTED, &message);
    let headers = response.headers_mut();
    headers.insert(RETRY_AFTER, retry_after(decision.retry_after_ms));
    annotate(headers, route, limits, decision);
    response
}

/// gRPC's status code RESOURCE_EXHAUSTED.
pub const GRPC_RESOURCE_EXHAUSTED: u8 = 8;

/// A trailers-only gRPC answer: HTTP 200 with `grpc-status` `code` and
/// `grpc-message` (percent-encoded as gRPC requires) in the head, no body.
pub fn grpc_status<U>(code: u8, message: &str) -> Response<Body<U>> {
    let mut response = Response::new(Body::empty());
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    let mut encoded = String::with_capacity(message.len());
    for &b in message.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            encoded.push(char::from(b));
        } else {
            let _ = write!(encoded, "%{b:02X}");
        }
    }
    if let Ok(value) = HeaderValue::from_str(&encoded) {
        headers.insert("grpc-message", value);
    }
    response
}

/// An RFC 9457 problem document: `status`, its reason as the title, and
/// `detail` (escaped here).
pub fn problem<U>(status: StatusCode, detail: &str) -> Response<Body<U>> {
    let body = problem_body(status, detail);
    let mut response = Response::new(Body::whole(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, PROBLEM_JSON);
    headers.insert(CACHE_CONTROL, NO_STORE);
    response
}

/// The JSON of [`problem`]'s document, for answers written without hyper.
pub fn problem_body(status: StatusCode, detail: &str) -> String {
    let mut body = String::with_capacity(96 + detail.len());
    let _ = write!(
        body,
        "{{\"type\":\"about:blank\",\"title\":\"{}\",\"status\":{},\"detail\":\"",
        status.canonical_reason().unwrap_or("Error"),
        status.as_u16()
    );
    json_escape(&mut body, detail);
    body.push_str("\"}\n");
    body
}

/// Appends `text` as the inside of a JSON string.
fn json_escape(out: &mut String, text: &str) {
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
}

/// A route's configured fixed answer.
pub fn respond<U>(respond: &crate::routes::Respond) -> Response<Body<U>> {
    let mut response = Response::new(Body::whole(respond.body.clone()));
    *response.status_mut() = respond.status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, respond.content_type.clone());
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_are_written_as_openai_writes_its_resets() {
        let text = |ms| GoDuration(ms).to_string();
        assert_eq!(text(0), "0s");
        assert_eq!(text(20), "20ms");
        assert_eq!(text(1000), "1s");
        assert_eq!(text(1500), "1.5s");
        assert_eq!(text(59_640), "59.64s");
        assert_eq!(text(360_000), "6m0s");
        assert_eq!(text(90_500), "1m30.5s");
        assert_eq!(text(3_723_000), "1h2m3s");
        assert_eq!(text(7_200_000), "2h0m0s");
    }

    #[test]
    fn values_keep_their_bytes_across_blocks() {
        // Enough values to fill several blocks, all alive at once, then one
        // whose name is longer than a block.
        let values: Vec<(String, HeaderValue)> = (0..1000)
            .map(|i| {
                let text = format!("\"api\";r={i};t=1");
                (
                    text,
                    ratelimit_value("api", i, 1).unwrap_or_else(|| HeaderValue::from(0)),
                )
            })
            .collect();
        for (text, value) in &values {
            assert_eq!(value.as_bytes(), text.as_bytes());
        }
        drop(values);
        let long = "x".repeat(VALUE_BLOCK + 1);
        let value = ratelimit_value(&long, u64::MAX, 7).map(|v| v.as_bytes().to_vec());
        assert_eq!(
            value,
            Some(format!("\"{long}\";r={};t=7", u64::MAX).into_bytes())
        );
        let after = ratelimit_value("after", 0, 0).map(|v| v.as_bytes().to_vec());
        assert_eq!(after, Some(b"\"after\";r=0;t=0".to_vec()));
    }

    #[test]
    fn header_seconds_round_up() {
        assert_eq!(seconds(0), 0);
        assert_eq!(seconds(1), 1);
        assert_eq!(seconds(1000), 1);
        assert_eq!(seconds(1001), 2);
        assert_eq!(retry_after(0), HeaderValue::from(1u64));
    }
}
