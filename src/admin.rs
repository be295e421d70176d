//! The admin listener: `/healthz` (the process is up), `/readyz` (the
//! instance should get traffic: not stopping, and not refusing everything
//! because the store is down under `on_error = "deny"`), `/metrics`
//! (Prometheus), `/clients/top` (who is limited), and a dashboard at `/`
//! over `/status.json`, `/history.json` and `/clients/top`; and, in
//! `operations`, operators on one client's counts (`POST /clients/…`) and
//! usage per window (`GET /usage/…`). Separate from the traffic listener
//! so it can stay private.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{ACCEPT, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;

use crate::gate::{Readiness, Shared};
use crate::metrics::Outcome;

mod keys;
mod operations;
mod reply;
mod tokens;

/// The dashboard: one page, its script polling `/status.json`,
/// `/history.json` and `/clients/top`; no external assets.
const DASHBOARD: &str = include_str!("admin/dashboard.html");

/// Most admin connections open at once: scrapers and probes need a few.
const MAX_ADMIN_CONNECTIONS: usize = 64;

/// Serves admin requests on `listener` until the task is dropped. A client
/// must send each request head within `head_timeout`, so a silent or
/// dribbling connection cannot hold a slot, and at most 64 connections are
/// open at once; more wait in the listen backlog.
pub async fn serve(
    listener: TcpListener,
    shared: Arc<Shared>,
    head_timeout: Duration,
    token_file: Option<std::path::PathBuf>,
) {
    let token_file = token_file.map(Arc::new);
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        .header_read_timeout(Some(head_timeout));
    let http1 = Arc::new(http1);
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_ADMIN_CONNECTIONS));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Ok((stream, peer)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let shared = Arc::clone(&shared);
        let http1 = Arc::clone(&http1);
        let token_file = token_file.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let service = service_fn(move |request: Request<Incoming>| {
                let shared = Arc::clone(&shared);
                let token_file = token_file.clone();
                async move {
                    if keys::is_keys(request.uri().path()) {
                        let file = token_file.as_deref().map(std::path::PathBuf::as_path);
                        return Ok::<_, Infallible>(keys::answer(&shared, request, file).await);
                    }
                    if request.method() == Method::GET && request.uri().path() == "/penalties" {
                        return Ok::<_, Infallible>(operations::penalties(&shared).await);
                    }
                    if request.method() == Method::GET && operations::is_usage(request.uri().path())
                    {
                        return Ok::<_, Infallible>(operations::usage(&shared, &request).await);
                    }
                    if request.method() == Method::POST
                        && operations::is_operation(request.uri().path())
                    {
                        let file = token_file.as_deref().map(std::path::PathBuf::as_path);
                        return Ok::<_, Infallible>(
                            operations::answer(&shared, request, peer, file).await,
                        );
                    }
                    Ok::<_, Infallible>(answer(&shared, &request))
                }
            });
            let _ = http1.serve_connection(TokioIo::new(stream), service).await;
        });
    }
}

fn answer(shared: &Shared, request: &Request<Incoming>) -> Response<Full<Bytes>> {
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n".into());
    }
    match request.uri().path() {
        "/healthz" => text(StatusCode::OK, "ok\n".into()),
        "/readyz" => {
            let (status, says) = match shared.readiness() {
                Readiness::Ready => (StatusCode::OK, "ready\n"),
                Readiness::StoreDown => (
                    StatusCode::OK,
                    "ready: the rate limit store is not answering; on_error decides meanwhile\n",
                ),
                Readiness::Refusing => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "not ready: the rate limit store is not answering and on_error = \"deny\" refuses limited requests\n",
                ),
                Readiness::Draining => (StatusCode::SERVICE_UNAVAILABLE, "not ready: stopping\n"),
                Readiness::Refused => {
                    let why = shared.store_refused().unwrap_or_default();
                    return text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("not ready: {why}\n"),
                    );
                }
            };
            text(status, says.into())
        }
        "/metrics" => {
            shared.refresh_gauges();
            // OpenMetrics unless the scraper asks for the older text format
            // alone (as `promtool` and some agents do).
            let accept = request
                .headers()
                .get_all(ACCEPT)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect::<Vec<_>>()
                .join(",");
            let (body, kind) = if accept.contains("text/plain")
                && !accept.contains("application/openmetrics-text")
            {
                (
                    shared.metrics().render_text(),
                    "text/plain; version=0.0.4; charset=utf-8",
                )
            } else {
                (
                    shared.metrics().render(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            };
            let mut response = text(StatusCode::OK, body);
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static(kind));
            response
        }
        "/" => {
            let mut response = text(StatusCode::OK, DASHBOARD.to_owned());
            response.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            );
            response
        }
        "/status.json" => json(status_json(shared)),
        "/history.json" => json(shared.history_json()),
        "/clients/top" => {
            let n = request
                .uri()
                .query()
                .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("n=")))
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or(10)
                .clamp(1, 100);
            json(top_clients(shared, n))
        }
        _ => text(StatusCode::NOT_FOUND, "not found\n".into()),
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// A 200 carrying `body` as JSON.
fn json(body: String) -> Response<Full<Bytes>> {
    let mut response = text(StatusCode::OK, body);
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// `/clients/top`: the `n` clients with the most denials over the last
/// minute across routes (`worst`, each with its route), then per limited
/// route its `n` heaviest clients by requests, as JSON; ids shown as the
/// access log shows them.
fn top_clients(shared: &Shared, n: usize) -> String {
    use std::fmt::Write;
    let rules = shared.rules();
    let now = crate::clock::now_ms() / 1000;
    let mut out = String::from("{\"window_seconds\":60,\"worst\":[");
    if rules.live.iter().all(|l| l.top.is_none()) {
        out.push_str("],\"routes\":[]}");
        return out;
    }
    let mut routes = Vec::new();
    let mut worst = Vec::new();
    for (route, live) in rules.routes.iter().zip(&rules.live) {
        let Some(route_top) = &live.top else {
            continue;
        };
        if route.policy.limits.is_empty() {
            continue;
        }
        let (all, held) = route_top.heaviest(usize::MAX, now);
        worst.extend(
            all.iter()
                .filter(|h| h.denied > 0)
                .map(|h| (&*route.name, h.clone())),
        );
        routes.push((
            &*route.name,
            held,
            all.into_iter().take(n).collect::<Vec<_>>(),
        ));
    }
    worst.sort_by(|(_, a), (_, b)| b.denied.cmp(&a.denied).then(b.allowed.cmp(&a.allowed)));
    worst.truncate(n);
    let client = |out: &mut String, route: Option<&str>, h: &crate::top::Heavy| {
        out.push('{');
        if let Some(route) = route {
            out.push_str("\"route\":");
            crate::access_log::json_string(out, route);
            out.push(',');
        }
        let shown = shared.ids().show(&h.client);
        out.push_str("\"client\":");
        crate::access_log::json_string(out, shown.as_deref().unwrap_or("-"));
        let _ = write!(
            out,
            ",\"requests\":{},\"allowed\":{},\"denied\":{},\"over\":{}}}",
            h.allowed + h.denied,
            h.allowed,
            h.denied,
            h.over
        );
    };
    for (i, (route, h)) in worst.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        client(&mut out, Some(route), h);
    }
    out.push_str("],\"routes\":[");
    for (i, (route, held, heaviest)) in routes.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"route\":");
        crate::access_log::json_string(&mut out, route);
        let _ = write!(out, ",\"tracked\":{held},\"clients\":[");
        for (j, h) in heaviest.iter().enumerate() {
            if j > 0 {
                out.push(',');
            }
            client(&mut out, None, h);
        }
        out.push_str("]}");
    }
    out.push_str("]}");
    out
}

/// `/status.json`, which the dashboard polls: the configuration in
/// force, the store's state, and each route's limits and counts.
fn status_json(shared: &Shared) -> String {
    use std::fmt::Write;
    let rules = shared.rules();
    let readiness = match shared.readiness() {
        Readiness::Ready => "ready",
        Readiness::StoreDown => "store_down",
        Readiness::Refusing => "refusing",
        Readiness::Draining => "draining",
        Readiness::Refused => "store_refused",
    };
    let mut out = String::from("{\"version\":");
    crate::access_log::json_string(&mut out, env!("CARGO_PKG_VERSION"));
    out.push_str(",\"config\":");
    crate::access_log::json_string(&mut out, &shared.metrics().config_digest());
    let _ = write!(out, ",\"readiness\":\"{readiness}\",\"store\":");
    store_json(&mut out, shared);
    out.push_str(",\"reload\":");
    reload_json(&mut out, shared);
    out.push_str(",\"keys\":");
    match shared.keys() {
        Some(keys) => out.push_str(&keys.status().to_string()),
        None => out.push_str("null"),
    }
    out.push_str(",\"routes\":[");
    for (i, (route, live)) in rules.routes.iter().zip(&rules.live).enumerate() {
        let (counts, capacity, metering) = (&live.metrics, &live.capacity, &live.metering);
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"name\":");
        crate::access_log::json_string(&mut out, &route.name);
        let _ = write!(out, ",\"shadow\":{},\"api_key\":", route.shadow);
        match &route.api_key {
            None => out.push_str("null"),
            Some(from) => crate::access_log::json_string(&mut out, &from.describe()),
        }
        out.push_str(",\"limits\":");
        crate::gate::shown::policy_json(&mut out, &route.policy);
        let names = rules
            .routes
            .plan_selection
            .as_ref()
            .map_or(&[][..], |s| s.names.as_slice());
        route_plans_json(&mut out, names.iter().zip(&route.plans));
        for (outcome, n) in Outcome::ALL.iter().zip(counts.counts()) {
            let _ = write!(out, ",\"{}\":{n}", outcome.name());
        }
        usage_json(&mut out, metering.as_deref());
        match capacity {
            None => out.push_str(",\"concurrency\":null"),
            Some(c) => {
                let refused = c.refused();
                let _ = write!(
                    out,
                    ",\"concurrency\":{{\"per\":\"{}\",\"adaptive\":{},\"limit\":{},\"in_flight\":{},\"waiting\":{},\"refused\":{refused}}}",
                    c.settings().per.name(),
                    c.settings().adaptive.is_some(),
                    c.limit(),
                    c.in_flight(),
                    c.waiting()
                );
            }
        }
        out.push('}');
    }
    out.push_str("],\"budgets\":");
    crate::gate::shown::budgets_json(&mut out, &rules.routes);
    out.push_str(",\"plans\":");
    crate::gate::shown::plans_json(&mut out, &rules.routes, &shared.plan_table());
    out.push('}');
    out
}

/// A route's `plans` in `/status.json`: each plan it refers to, with
/// its limits on the route.
fn route_plans_json<'a>(
    out: &mut String,
    plans: impl Iterator<Item = (&'a Arc<str>, &'a Option<crate::gate::shown::Policy>)>,
) {
    out.push_str(",\"plans\":{");
    let mut first = true;
    for (name, policy) in plans {
        let Some(policy) = policy else { continue };
        if !std::mem::take(&mut first) {
            out.push(',');
        }
        crate::access_log::json_string(out, name);
        out.push(':');
        crate::gate::shown::policy_json(out, policy);
    }
    out.push('}');
}

/// A route's `usage` in `/status.json`: `null` unless it meters; its
/// units and the requests left at their reservation, since start.
fn usage_json(out: &mut String, metering: Option<&crate::gate::metering::Metering>) {
    use std::fmt::Write;
    let Some(m) = metering else {
        out.push_str(",\"usage\":null");
        return;
    };
    let [reserved, reported, refunded, charged_over] = m.metrics.units();
    let _ = write!(
        out,
        ",\"usage\":{{\"reserved\":{reserved},\"reported\":{reported},\"refunded\":{refunded},\"charged_over\":{charged_over},\"unreported\":{}}}",
        m.metrics.unreported_total()
    );
}

/// `/status.json`'s `store`: its kind and state, and each node's breaker.
fn store_json(out: &mut String, shared: &Shared) {
    use std::fmt::Write;
    let (kind, up, on_error) = shared.store();
    let _ = write!(
        out,
        "{{\"kind\":\"{kind}\",\"up\":{up},\"degraded\":{},\"on_error\":\"{on_error}\",\"redis_calls\":{},\"nodes\":[",
        shared.store_degraded(),
        shared.metrics().redis_calls.get(),
    );
    for (i, (node, open, since)) in shared.store_nodes().iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str("{\"node\":");
        crate::access_log::json_string(out, node);
        let breaker = if *open { "open" } else { "closed" };
        let since = since.map_or_else(|| "null".to_owned(), |ms| ms.to_string());
        let _ = write!(out, ",\"breaker\":\"{breaker}\",\"since\":{since}}}");
    }
    out.push_str("]}");
}

/// `/status.json`'s `reload`: `null` when there was none since start.
fn reload_json(out: &mut String, shared: &Shared) {
    use std::fmt::Write;
    let Some(reload) = shared.last_reload() else {
        out.push_str("null");
        return;
    };
    let result = if reload.problem.is_some() {
        "refused"
    } else {
        "applied"
    };
    let _ = write!(
        out,
        "{{\"result\":\"{result}\",\"at\":{},\"problem\":",
        reload.at_ms
    );
    match &reload.problem {
        Some(problem) => crate::access_log::json_string(out, problem),
        None => out.push_str("null"),
    }
    out.push('}');
}
