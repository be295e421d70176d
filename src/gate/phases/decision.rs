//! The decide-only way in: a front proxy (nginx's `auth_request`, Caddy's
//! `forward_auth`, Traefik's `forwardAuth`, Envoy's `ext_authz` over HTTP)
//! asks whether a request may pass, and floodgate answers as its own proxy
//! listener would have decided it: the same phases (head → route →
//! identify → decide), the same keys, counts, metrics and access log, then
//! 200 with the `RateLimit` fields instead of forwarding, or the same 429.
//! A gRPC call is Envoy's rate limit service protocol, answered by
//! `phases::rls` for listed peers only.
//!
//! **Which request is decided.** The one the decision listener is sent,
//! unless its peer is one of `decision_peers`: a listed front proxy
//! describes the original with
//! - `X-Original-URI` (nginx) or `X-Forwarded-Uri` (Caddy, Traefik): the
//!   target, path and query;
//! - `X-Original-Method` (nginx) or `X-Forwarded-Method` (Caddy,
//!   Traefik): the method;
//! - `X-Forwarded-Host`: the host (else the request's own `Host`);
//! - `X-Forwarded-For`: its last address is the client's, as the front
//!   proxy saw it (the addresses before it are judged by the routes'
//!   `trusted_proxies`, as on the proxy listener).
//!
//! A front proxy passes the client's own headers on, so a client could
//! send the name the proxy does not set: both names of one field in a
//! request (`X-Original-URI` and `X-Forwarded-Uri`, say) are refused
//! rather than one of them believed, and so is a field given twice. Every
//! front proxy's documented configuration sets the fields it uses, so a
//! client's own values never reach floodgate as the proxy's.
//!
//! What the proxy listener does and this does not: no concurrency cap (the
//! request's end is never seen), and no body (a route reserving usage from
//! a JSON body reserves its default). A metered route's reservation is
//! named in the answer (`Floodgate-Reservation`) for the front proxy to
//! name back with the units the upstream reported (`Floodgate-Settle`,
//! see `settled`); never named back, it stands as charged.

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode, Uri};
use hyper::body::Incoming;

use super::ruling::Ruling;
use super::{Connection, Context, check_head};
use crate::gate::metering::{Reservation, Token};
use crate::limit::Charge;
use crate::proxy::{Body, Peer};
use crate::refusal::Refusal;
use crate::response;
use crate::routes::request_paths;

const X_ORIGINAL_URI: HeaderName = HeaderName::from_static("x-original-uri");
const X_FORWARDED_URI: HeaderName = HeaderName::from_static("x-forwarded-uri");
const X_ORIGINAL_METHOD: HeaderName = HeaderName::from_static("x-original-method");
const X_FORWARDED_METHOD: HeaderName = HeaderName::from_static("x-forwarded-method");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
/// On an admitted request of a metered route: its reservation, to name back.
const FLOODGATE_RESERVATION: HeaderName = HeaderName::from_static("floodgate-reservation");
/// On a settlement: the reservation settled.
const FLOODGATE_SETTLE: HeaderName = HeaderName::from_static("floodgate-settle");

/// The answer to a front proxy's question about one request on
/// `connection`: 200 with the `RateLimit` fields when it may pass, the 429
/// a client of the proxy listener would get when not, or floodgate's
/// refusal (404 with no route, 503 when the store is down and `on_error`
/// denies). As for a proxied request, the request's future is this
/// function's own, with no layer around it.
pub async fn decide<C: Connection>(
    connection: Arc<C>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let _busy = connection.begin();
    let (shared, peer) = (connection.shared(), connection.peer());
    if response::is_grpc(request.headers()) {
        // Descriptors are whatever the caller writes: only a listed
        // peer (Envoy) may spend clients' limits with them.
        if !peer.trusted {
            let refusal = Refusal::client(
                StatusCode::FORBIDDEN,
                "only the peers in decision_peers may ask Envoy's rate limit service",
            );
            shared.metrics.refused(&refusal);
            return Ok(refusal.into_grpc_response());
        }
        return Ok(Box::pin(super::rls::answer(shared, peer, request)).await);
    }
    let (mut head, _body) = request.into_parts();
    let rules = shared.rules.load_full();
    let settling = head.headers.contains_key(&FLOODGATE_SETTLE);
    let client = match (peer.trusted, settling) {
        (true, _) => original(&mut head),
        (false, false) => Ok(peer.addr),
        (false, true) => Err(Refusal::client(
            StatusCode::FORBIDDEN,
            "only the peers in decision_peers may settle reservations",
        )),
    };
    let client = match client {
        Ok(client) => client,
        Err(refusal) => {
            shared.metrics.refused(&refusal);
            return Ok(refusal.into_response());
        }
    };
    let client = Peer::new(
        client,
        false,
        crate::client::is_in(client.ip().to_canonical(), &rules.trusted_proxies),
    );
    drop(rules);
    let mut cx = Context::new(
        shared,
        &client,
        false,
        &head.method,
        &head.uri,
        head.version,
        Some(0),
    );
    let answered = if settling {
        Box::pin(settled(&mut cx, head)).await
    } else {
        decided(&mut cx, head).await
    };
    let response = match answered {
        Ok(response) => response,
        Err(refusal) => cx.refused(refusal),
    };
    Ok(cx.logged(response))
}

/// The phases from head to decide, then the answer: 200 (with the
/// decision's fields) or the denial.
async fn decided(cx: &mut Context<'_>, mut head: Parts) -> Result<Response<Body>, Refusal> {
    let host = check_head(&head)?;
    let rules = cx.shared.rules.load_full();
    let (_, matched_path) = request_paths(head.uri.path(), rules.escaped_slashes)?;
    let found = cx.route(&rules, &head, host, &matched_path)?;
    let mut who = cx
        .verified(&rules, &found, &mut head.headers, &matched_path)
        .await?;
    let decided = cx
        .decided(&rules, &found, &mut who, &head.headers, None)
        .await;
    // The front proxy's answer is not this one, and floodgate never sees
    // it: a limit that counts by the answer counts every admitted request.
    cx.by_answer = None;
    let allowed = match decided? {
        Ruling::Allowed { decision, limits } | Ruling::ShadowDenied { decision, limits } => {
            Some((decision, limits))
        }
        Ruling::Unlimited | Ruling::StoreDown(None) => None,
        Ruling::Denied { decision, limits } => {
            return Ok(cx.too_many_requests(found.route, &limits, &decision));
        }
        Ruling::StoreDown(Some(refusal)) => return Err(refusal),
    };
    let mut answer = Response::new(Body::empty());
    // A metered route's reservation, for the front proxy to name back
    // with the units the answer used (see `settled`); unsettled, it
    // stands as charged.
    if let Some(reservation) = cx.reservation.take()
        && let Ok(token) = HeaderValue::from_str(&reservation.token())
    {
        answer.headers_mut().insert(FLOODGATE_RESERVATION, token);
    }
    if let Some((d, policy)) = &allowed {
        response::annotate(answer.headers_mut(), found.route, policy, d);
    }
    Ok(answer)
}

/// A settlement: the front proxy names a reservation (`Floodgate-Settle:
/// ROUTE:AT_MS:RESERVED`, from the decision's `Floodgate-Reservation`),
/// describes the request again as for its decision, and passes the
/// answer's report fields as the route's `usage` reads them (`report =
/// "header"`). The request is identified again (the same route, client,
/// plan and keys) and the reservation settled to the reported units in
/// the same keys: 200 with the settled `RateLimit` fields; 422 when
/// nothing was settled (no report, or the store could not take it), and
/// the reservation stands.
async fn settled(cx: &mut Context<'_>, mut head: Parts) -> Result<Response<Body>, Refusal> {
    let token = head
        .headers
        .get(&FLOODGATE_SETTLE)
        .and_then(|v| v.to_str().ok())
        .and_then(Token::parse)
        .ok_or_else(|| bad("Floodgate-Settle must be the ROUTE:AT_MS:RESERVED of a decision's Floodgate-Reservation"))?;
    let host = check_head(&head)?;
    let rules = cx.shared.rules.load_full();
    let (_, matched_path) = request_paths(head.uri.path(), rules.escaped_slashes)?;
    let found = cx.route(&rules, &head, host, &matched_path)?;
    if *found.route.name != *token.route {
        return Err(Refusal::client(
            StatusCode::CONFLICT,
            format!(
                "the reservation is route \"{}\"'s and the request is on route \"{}\" (the rules changed since?): it stands",
                token.route, found.route.name
            ),
        ));
    }
    let (Some(usage), Some(Some(metering))) = (
        &found.route.usage,
        rules.live(found.index).map(|l| &l.metering),
    ) else {
        return Err(bad("the route has no usage: there is nothing to settle"));
    };
    let mut who = cx
        .verified(&rules, &found, &mut head.headers, &matched_path)
        .await?;
    let policy = who.policy.take();
    let (Some(client), Some(policy)) = (&who.client, policy) else {
        return Err(bad(
            "the request is not limited (exempt, or no limits): there is nothing to settle",
        ));
    };
    let charge = Charge::new(
        &found.route.name,
        client,
        &policy.limits,
        &who.keys,
        token.reserved,
    );
    let reservation = Reservation::resumed(usage, metering, &charge, token.at_ms, token.local);
    match reservation
        .settle_from_head(200, &cx.shared.limiter, &head.headers)
        .await
    {
        Some(settled) => {
            let mut answer = Response::new(Body::empty());
            response::annotate(answer.headers_mut(), found.route, &policy, &settled);
            Ok(answer)
        }
        None => Err(Refusal::client(
            StatusCode::UNPROCESSABLE_ENTITY,
            "not settled: the request reports no units as the route's usage reads them, or the store could not take it; the reservation stands",
        )),
    }
}

/// The original request as a listed front proxy describes it, put in
/// `head` in place of the question's own target, method and host; the
/// client's address, which `X-Forwarded-For` ends with, is returned and
/// taken off the list.
fn original(head: &mut Parts) -> Result<SocketAddr, Refusal> {
    let headers = &mut head.headers;
    if let Some(target) = either(headers, &X_ORIGINAL_URI, &X_FORWARDED_URI)? {
        head.uri = origin_form(&target)?;
    }
    if let Some(method) = either(headers, &X_ORIGINAL_METHOD, &X_FORWARDED_METHOD)? {
        head.method = http::Method::from_bytes(method.as_bytes())
            .map_err(|_| bad("the forwarded method is not a method"))?;
    }
    if let Some(host) = single(headers, &X_FORWARDED_HOST)? {
        headers.remove(&X_FORWARDED_HOST);
        headers.insert(http::header::HOST, host);
    }
    let client = last_forwarded_for(headers)?;
    Ok(SocketAddr::new(client, 0))
}

/// The value of `a` or of `b`, taken out of `headers`: refused when both
/// are there (one of them is the client's own) or either is repeated.
fn either(
    headers: &mut HeaderMap,
    a: &HeaderName,
    b: &HeaderName,
) -> Result<Option<HeaderValue>, Refusal> {
    let (first, second) = (single(headers, a)?, single(headers, b)?);
    headers.remove(a);
    headers.remove(b);
    match (first, second) {
        (Some(_), Some(_)) => Err(bad(format!(
            "the request carries both {a} and {b}: the front proxy should set one and clear the other"
        ))),
        (one, None) | (None, one) => Ok(one),
    }
}

/// The one value of `name`, if any; refused when it is repeated.
fn single(headers: &HeaderMap, name: &HeaderName) -> Result<Option<HeaderValue>, Refusal> {
    let mut values = headers.get_all(name).iter();
    let value = values.next().cloned();
    if values.next().is_some() {
        return Err(bad(format!("{name} is repeated")));
    }
    Ok(value)
}

/// A forwarded target: a path with its query.
fn origin_form(value: &HeaderValue) -> Result<Uri, Refusal> {
    let uri = Uri::try_from(value.as_bytes())
        .map_err(|_| bad("the forwarded URI is not a request target"))?;
    if uri.scheme().is_some() || !uri.path().starts_with('/') {
        return Err(bad("the forwarded URI must be a path (and query)"));
    }
    Ok(uri)
}

/// The last address of `X-Forwarded-For` (every field line read as one
/// list), which the front proxy added: the client as it saw it. The list
/// left is what came before, for the routes' `trusted_proxies` to judge.
fn last_forwarded_for(headers: &mut HeaderMap) -> Result<IpAddr, Refusal> {
    let mut list = String::new();
    for value in headers.get_all(&X_FORWARDED_FOR) {
        let text = value
            .to_str()
            .map_err(|_| bad("X-Forwarded-For is not text"))?;
        if !list.is_empty() {
            list.push(',');
        }
        list.push_str(text);
    }
    let (before, last) = match list.rsplit_once(',') {
        Some((before, last)) => (before.trim_end_matches([' ', ',']), last),
        None => ("", list.as_str()),
    };
    let last = last.trim();
    if last.is_empty() {
        return Err(bad(
            "the front proxy sent no X-Forwarded-For: floodgate cannot tell whose request this is",
        ));
    }
    let client = last
        .parse::<IpAddr>()
        .or_else(|_| last.parse::<SocketAddr>().map(|a| a.ip()))
        .map_err(|_| bad("the last X-Forwarded-For entry is not an address"))?;
    let before = before.trim();
    if before.is_empty() {
        headers.remove(&X_FORWARDED_FOR);
    } else {
        let value = HeaderValue::from_str(before)
            .map_err(|_| bad("X-Forwarded-For is not a list of addresses"))?;
        headers.insert(X_FORWARDED_FOR, value);
    }
    Ok(client.to_canonical())
}

/// The front proxy's question cannot be read: 400, naming why.
fn bad(detail: impl Into<std::borrow::Cow<'static, str>>) -> Refusal {
    Refusal::client(StatusCode::BAD_REQUEST, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(fields: &[(&str, &str)]) -> Parts {
        let mut request = Request::get("/decide").body(()).expect("request");
        for (name, value) in fields {
            request.headers_mut().append(
                HeaderName::from_bytes(name.as_bytes()).expect("name"),
                HeaderValue::from_str(value).expect("value"),
            );
        }
        request.into_parts().0
    }

    #[test]
    fn a_front_proxy_describes_the_original_request() {
        let mut h = head(&[
            ("x-original-uri", "/api/chat?model=a"),
            ("x-original-method", "POST"),
            ("x-forwarded-host", "api.example"),
            ("x-forwarded-for", "203.0.113.9, 10.0.0.1"),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        let client = original(&mut h).expect("original");
        assert_eq!(client.ip(), "198.51.100.7".parse::<IpAddr>().expect("ip"));
        assert_eq!(h.uri, "/api/chat?model=a");
        assert_eq!(h.method, http::Method::POST);
        assert_eq!(h.headers["host"], "api.example");
        assert_eq!(h.headers["x-forwarded-for"], "203.0.113.9, 10.0.0.1");
        assert!(h.headers.get("x-original-uri").is_none());
    }

    #[test]
    fn both_names_of_one_field_are_refused_not_one_of_them_believed() {
        let mut h = head(&[
            ("x-original-uri", "/cheap"),
            ("x-forwarded-uri", "/api/chat"),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        let refused = original(&mut h).expect_err("ambiguous");
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
        let mut h = head(&[
            ("x-forwarded-method", "GET"),
            ("x-forwarded-method", "POST"),
            ("x-forwarded-for", "198.51.100.7"),
        ]);
        assert!(original(&mut h).is_err());
    }

    #[test]
    fn without_the_clients_address_nothing_is_decided() {
        for fields in [
            &[("x-forwarded-uri", "/a")][..],
            &[("x-forwarded-for", "198.51.100.7, ")][..],
            &[("x-forwarded-for", "not-an-address")][..],
            &[
                ("x-forwarded-uri", "http://evil/a"),
                ("x-forwarded-for", "1.2.3.4"),
            ][..],
        ] {
            let mut h = head(fields);
            assert_eq!(
                original(&mut h).map_err(|r| r.status()).err(),
                Some(StatusCode::BAD_REQUEST),
                "{fields:?}"
            );
        }
        let mut h = head(&[("x-forwarded-for", "[2001:db8::1]:5000")]);
        assert_eq!(
            original(&mut h).expect("address").ip(),
            "2001:db8::1".parse::<IpAddr>().expect("ip")
        );
    }
}
