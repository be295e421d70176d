//! Operators on one client's counts: `POST /clients/standing` reads them,
//! `/clients/reset`, `/clients/lift` (a penalty), `/clients/credit` and
//! `/clients/debit` change them.
//! The client is named as it presents itself (the headers it sends, the
//! address it comes from); floodgate identifies it on the route as it
//! would its requests.
//!
//! Changes need `Authorization: Bearer <token>`, the token being the first
//! line of `[server] admin_token_file`, read again on every change (so it
//! can be rotated without a restart): without the header `401`, with
//! another token `403`, and with no token file configured every change is
//! refused (`403`). Each change writes one audit line (target
//! `floodgate::audit`): who asked (the admin peer and its `X-Operator`
//! header), what, the reason given, and the client's standing before and
//! after. A client's header values are logged only as digests.

use std::net::IpAddr;
use std::path::Path;

use bytes::Bytes;
use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::reply::{json_answer, problem};
use crate::gate::{Adjustment, Operation, OperationError, Shared, kept, operate};

/// The largest operation body read.
const MAX_BODY: usize = 64 * 1024;

/// An operation as the operator writes it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    route: String,
    #[serde(default)]
    client: ClientAsked,
    /// One limit by its policy name; all of the route's when absent.
    limit: Option<String>,
    /// Units to credit or debit.
    units: Option<u64>,
    /// Why: required for a change, and written in the audit line.
    reason: Option<String>,
}

/// The client as it presents itself.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ClientAsked {
    #[serde(default)]
    headers: std::collections::BTreeMap<String, String>,
    address: Option<IpAddr>,
}

/// Whether `path` is an operation's.
pub(super) fn is_operation(path: &str) -> bool {
    matches!(
        path,
        "/clients/standing"
            | "/clients/reset"
            | "/clients/lift"
            | "/clients/credit"
            | "/clients/debit"
    )
}

/// Answers one operation.
pub(super) async fn answer(
    shared: &Shared,
    request: Request<Incoming>,
    peer: std::net::SocketAddr,
    token_file: Option<&Path>,
) -> Response<Full<Bytes>> {
    let path = request.uri().path().to_owned();
    let changes = path != "/clients/standing";
    let operator = if changes {
        match super::tokens::operator(request.headers(), token_file) {
            Ok(name) => name,
            Err(refused) => return *refused,
        }
    } else {
        String::new()
    };
    let on_behalf = request
        .headers()
        .get("x-operator")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the operation's body is over 64 KiB, or broke off",
            );
        }
    };
    let asked: Asked = match serde_json::from_slice(&body) {
        Ok(asked) => asked,
        Err(e) => {
            return problem(
                StatusCode::BAD_REQUEST,
                &format!("the operation is not one floodgate reads: {e}"),
            );
        }
    };
    let op = match operation_of(&path, &asked) {
        Ok(op) => op,
        Err(refused) => return *refused,
    };
    let reason = asked.reason.as_deref().map_or("", str::trim);
    match operate(shared, &op).await {
        Ok((before, after)) => {
            if let Some(after) = &after {
                let done = Done {
                    operator: &operator,
                    on_behalf: &on_behalf,
                    peer,
                    action: path.trim_start_matches("/clients/"),
                    asked: &asked,
                    address: op.address,
                    reason,
                };
                audited(shared, &done, &before, after).await;
            }
            let body = match &after {
                Some(after) => format!("{{\"before\":{before},\"after\":{after}}}"),
                None => before,
            };
            json_answer(body)
        }
        Err(OperationError::Invalid(why)) => problem(StatusCode::UNPROCESSABLE_ENTITY, &why),
        Err(OperationError::Store(why)) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the rate limit store could not be read or changed: {why}"),
        ),
    }
}

/// An operator's change, as the audit records it.
struct Done<'a> {
    operator: &'a str,
    on_behalf: &'a str,
    peer: std::net::SocketAddr,
    action: &'a str,
    asked: &'a Asked,
    address: IpAddr,
    reason: &'a str,
}

/// Writes the audit line of `done`, and its entry in the store's audit:
/// by the key's identity when the client is named by a key the registry
/// knows, else as the client is described.
async fn audited(shared: &Shared, done: &Done<'_>, before: &str, after: &str) {
    let asked = done.asked;
    let client = described(&asked.client, done.address);
    tracing::info!(
        target: "floodgate::audit",
        operator = %done.operator,
        on_behalf = %done.on_behalf,
        peer = %done.peer,
        action = %done.action,
        units = asked.units.unwrap_or(0),
        route = %asked.route,
        limit = %asked.limit.as_deref().unwrap_or("all"),
        client = %client,
        reason = %done.reason,
        before = %before,
        after = %after,
        "an operator changed a client's counts"
    );
    let entry = crate::gate::AuditEntry {
        at_ms: crate::clock::now_ms(),
        operator: done.operator.to_owned(),
        action: done.action.to_owned(),
        identity: shared.key_identity(&asked.client.headers).unwrap_or(client),
        key: format!(
            "{} {}",
            asked.route,
            asked.limit.as_deref().unwrap_or("all")
        ),
        reason: done.reason.to_owned(),
        before: before.to_owned(),
        after: after.to_owned(),
    };
    if let Err(e) = shared.audit(entry).await {
        tracing::warn!(error = %e, "the operator's action is not in the store's audit");
    }
}

/// The client for the audit line: its address, and each header with its
/// value's digest (a key is a credential).
fn described(client: &ClientAsked, address: IpAddr) -> String {
    let mut out = format!("address={address}");
    for (name, value) in &client.headers {
        let digest = Sha256::digest(value.as_bytes());
        let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
        out.push_str(&format!(" {}=sha256:{hex}…", name.to_ascii_lowercase()));
    }
    out
}

/// `GET /penalties`: every penalty in force, with the route and limit it
/// is under, the client as the store names it, the seconds left and the
/// offences in a row.
pub(super) async fn penalties(shared: &Shared) -> Response<Full<Bytes>> {
    match crate::gate::penalties(shared).await {
        Ok(body) => json_answer(body),
        Err(OperationError::Invalid(why)) => problem(StatusCode::UNPROCESSABLE_ENTITY, &why),
        Err(OperationError::Store(why)) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the rate limit store could not be read: {why}"),
        ),
    }
}

/// Whether `path` is one of the usage exports.
pub(super) fn is_usage(path: &str) -> bool {
    matches!(path, "/usage/closed" | "/usage/top")
}

/// `GET /usage/closed?route=R&limit=L`: every closed window's total of
/// the fixed-window limit `L` (its policy name) on route `R`, per client,
/// as JSON lines; `GET /usage/top?route=R&limit=L&n=10`: the clients that
/// used the most of it in their current window.
pub(super) async fn usage(shared: &Shared, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    let query = request.uri().query().unwrap_or("");
    let param = |name: &str| {
        query.split('&').find_map(|p| {
            let value = p.strip_prefix(name)?.strip_prefix('=')?;
            Some(percent_decoded(value))
        })
    };
    let (Some(route), Some(limit)) = (param("route"), param("limit")) else {
        return problem(
            StatusCode::BAD_REQUEST,
            "name the route and its limit: ?route=chat&limit=chat (the limit's policy name, as in RateLimit-Policy)",
        );
    };
    let (scope, mut windows) = match kept(shared, &route, &limit).await {
        Ok(found) => found,
        Err(OperationError::Invalid(why)) => {
            return problem(StatusCode::UNPROCESSABLE_ENTITY, &why);
        }
        Err(OperationError::Store(why)) => {
            return problem(
                StatusCode::SERVICE_UNAVAILABLE,
                &format!("the rate limit store could not be read: {why}"),
            );
        }
    };
    let line = |out: &mut String, w: &crate::gate::Kept| {
        out.push_str("{\"route\":");
        crate::access_log::json_string(out, &route);
        out.push_str(",\"limit\":");
        crate::access_log::json_string(out, &limit);
        out.push_str(",\"scope\":");
        crate::access_log::json_string(out, &scope);
        out.push_str(",\"client\":");
        crate::access_log::json_string(out, &w.client);
        out.push_str(&format!(
            ",\"window_start\":{},\"window_end\":{},\"units\":{}}}",
            w.start, w.end, w.units
        ));
    };
    let mut out = String::new();
    let kind = if request.uri().path() == "/usage/closed" {
        windows.retain(|w| w.closed);
        windows.sort_by(|a, b| (&a.client, a.start).cmp(&(&b.client, b.start)));
        for w in &windows {
            line(&mut out, w);
            out.push('\n');
        }
        "application/x-ndjson"
    } else {
        let n = param("n")
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(10)
            .clamp(1, 1000);
        windows.retain(|w| !w.closed);
        windows.sort_by(|a, b| b.units.cmp(&a.units).then(a.client.cmp(&b.client)));
        windows.truncate(n);
        out.push_str("{\"clients\":[");
        for (i, w) in windows.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            line(&mut out, w);
        }
        out.push_str("]}");
        "application/json"
    };
    let mut response = Response::new(Full::new(Bytes::from(out)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(kind));
    response
}

/// `%XX` escapes and `+` of a query value decoded (lossily).
pub(super) fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match u8::from_str_radix(value.get(i + 1..i + 3).unwrap_or(""), 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The operation `asked` at `path` names, or why it is refused (400).
fn operation_of(path: &str, asked: &Asked) -> Result<Operation, Box<Response<Full<Bytes>>>> {
    let bad = |why: &str| Box::new(problem(StatusCode::BAD_REQUEST, why));
    let adjustment = match (path, asked.units) {
        ("/clients/standing", _) => None,
        ("/clients/reset", None) => Some(Adjustment::Reset),
        ("/clients/lift", None) => Some(Adjustment::Lift),
        ("/clients/lift", Some(_)) => return Err(bad("a lift takes no units")),
        ("/clients/credit", Some(units)) if units > 0 => Some(Adjustment::Credit(units)),
        ("/clients/debit", Some(units)) if units > 0 => Some(Adjustment::Debit(units)),
        ("/clients/reset", Some(_)) => return Err(bad("a reset takes no units")),
        _ => {
            return Err(bad(
                "a credit or debit needs \"units\": a whole number of at least 1",
            ));
        }
    };
    let reason = asked.reason.as_deref().map_or("", str::trim);
    if adjustment.is_some() && reason.is_empty() {
        return Err(bad(
            "a change needs a \"reason\", written in the audit line",
        ));
    }
    let mut headers = HeaderMap::new();
    for (name, value) in &asked.client.headers {
        let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) else {
            return Err(bad(&format!("header {name:?} is not a valid header")));
        };
        headers.append(name, value);
    }
    Ok(Operation {
        route: asked.route.clone(),
        headers,
        address: asked.client.address.unwrap_or(IpAddr::from([127, 0, 0, 1])),
        limit: asked.limit.clone(),
        adjustment,
    })
}
