//! The admin listener's answers: problem documents and JSON.

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

/// An RFC 9457 problem document.
pub(super) fn problem(status: StatusCode, detail: &str) -> Response<Full<Bytes>> {
    let mut body = String::new();
    body.push_str(&format!(
        "{{\"type\":\"about:blank\",\"title\":\"{}\",\"status\":{},\"detail\":",
        status.canonical_reason().unwrap_or(""),
        status.as_u16()
    ));
    crate::access_log::json_string(&mut body, detail);
    body.push('}');
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// `body` as a JSON answer.
pub(super) fn json_answer(body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
