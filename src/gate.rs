//! One request's way through floodgate, as named phases: the head checked,
//! the route found, the client identified, the limit decided, then the
//! request forwarded (or answered by the route) and annotated, or refused.
//! Also the rules a reload swaps and the state every request shares.

use std::borrow::Cow;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use ipnet::IpNet;

use crate::access_log::{AccessLog, Ids, Logged, Record};
use crate::client::{client_address, is_in};
use crate::concurrency::{Capacity, Per, Slot};
use crate::config::Config;
use crate::limit::{Answer, Charge, Limiter};
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::proxy::balance::Group;
use crate::proxy::{ClientSide, Forwarder, Peer};
use crate::refusal::Refusal;
use crate::response::{self, Body};
use crate::routes::{Action, EscapedSlashes, RequestFacts, Table, request_paths};
use crate::top::RouteTop;

/// Longest request target (path and query) accepted; past it 414.
const MAX_URI_BYTES: usize = 8 * 1024;

/// The part of a configuration that a reload swaps.
#[derive(Debug)]
pub struct Rules {
    /// Routes, first match wins.
    pub routes: Table,
    /// Each route's metric handles, in route order.
    pub metrics: Vec<RouteMetrics>,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// What `%2F`, `%5C` and `\` in a request path do.
    pub escaped_slashes: EscapedSlashes,
    /// How long a client's request body and an upgraded connection may idle.
    pub client_timeouts: ClientSide,
    /// How long a client may leave its answer unread.
    pub client_write_timeout: Duration,
    /// Each route's heaviest clients, in route order; counted only when
    /// the admin listener (which shows them) is configured.
    pub top: Option<Vec<RouteTop>>,
    /// Each route's concurrency caps, in route order (`None`: uncapped).
    /// A reload keeps a route's caps, and what they count, when its name
    /// and settings are unchanged.
    pub capacity: Vec<Option<Arc<Capacity>>>,
}

impl Rules {
    /// The swappable rules of `config`, counting into `metrics`, keeping
    /// the concurrency caps of `previous` rules that did not change.
    pub fn new(config: &Config, metrics: &Metrics, previous: Option<&Rules>) -> Self {
        metrics.bind_upstreams(upstreams(config));
        let capacity: Vec<Option<Arc<Capacity>>> = config
            .routes
            .iter()
            .map(|route| {
                let settings = route.concurrency.as_ref()?;
                let kept = previous.and_then(|p| {
                    p.routes
                        .iter()
                        .zip(&p.capacity)
                        .find(|(r, c)| {
                            r.name == route.name
                                && c.as_ref().is_some_and(|c| c.settings() == settings)
                        })
                        .and_then(|(_, c)| c.clone())
                });
                Some(kept.unwrap_or_else(|| {
                    Arc::new(Capacity::new(
                        settings.clone(),
                        config.server.max_client_entries,
                    ))
                }))
            })
            .collect();
        metrics.bind_capacity(
            config
                .routes
                .iter()
                .zip(&capacity)
                .filter_map(|(r, c)| Some((Arc::clone(&r.name), Arc::clone(c.as_ref()?))))
                .collect(),
        );
        Self {
            capacity,
            metrics: metrics.bind(&config.routes),
            routes: config.routes.clone(),
            trusted_proxies: config.server.trusted_proxies.clone(),
            escaped_slashes: config.server.escaped_slashes,
            client_timeouts: ClientSide {
                body: config.server.client_body_timeout,
                upgraded: config.server.upgrade_idle_timeout,
                max_body: None,
            },
            client_write_timeout: config.server.client_write_timeout,
            top: config
                .server
                .admin_listen
                .map(|_| config.routes.iter().map(|_| RouteTop::default()).collect()),
        }
    }
}

/// The upstreams `config`'s routes forward to, each once.
fn upstreams(config: &Config) -> Vec<Arc<Group>> {
    let mut groups: Vec<Arc<Group>> = Vec::new();
    for route in config.routes.iter() {
        if let Action::Upstream(u) = &route.action
            && !groups.iter().any(|g| Arc::ptr_eq(g, &u.group))
        {
            groups.push(Arc::clone(&u.group));
        }
    }
    groups
}

/// Resolves the DNS names of `config`'s upstreams (all at once), and starts
/// resolving them again and checking their endpoints; each task ends when
/// its upstream is dropped by a reload. Called before the rules go live.
pub async fn start_upstreams(config: &Config) {
    let mut starting = tokio::task::JoinSet::new();
    for group in upstreams(config) {
        starting.spawn(async move { group.start().await });
    }
    while starting.join_next().await.is_some() {}
}

/// Everything a request needs, shared by all connections.
#[derive(Debug)]
pub struct Shared {
    rules: ArcSwap<Rules>,
    /// TLS for new connections on the proxy listener, if configured; a
    /// reload swaps it, and open connections keep the one they began with.
    tls: arc_swap::ArcSwapOption<rustls::ServerConfig>,
    limiter: Limiter,
    forwarder: Forwarder,
    metrics: Metrics,
    /// When a shadow denial was last logged (ms): at most one line a second.
    shadow_logged: AtomicU64,
    /// The access log, if on.
    access_log: Option<Arc<AccessLog>>,
    /// How client ids are shown.
    ids: Arc<Ids>,
    /// A stop was asked for: `/readyz` says so while the listener drains.
    draining: AtomicBool,
}

/// What `/readyz` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Serving, the store answering.
    Ready,
    /// Serving while the store is down: `on_error` allows or counts locally.
    StoreDown,
    /// Not serving usefully: the store is down and `on_error = "deny"`
    /// refuses every limited request.
    Refusing,
    /// Stopping: the listener closes after `drain_delay`.
    Draining,
}

impl Readiness {
    /// Whether load balancers should send this instance traffic.
    pub fn ready(self) -> bool {
        matches!(self, Self::Ready | Self::StoreDown)
    }
}

impl Shared {
    /// The state for serving `config`, deciding with `limiter`, counting
    /// into `metrics`, logging requests into `access_log`, showing client
    /// ids as `ids` says.
    pub fn new(
        config: &Config,
        limiter: Limiter,
        metrics: Metrics,
        access_log: Option<Arc<AccessLog>>,
        ids: Arc<Ids>,
    ) -> Self {
        Self {
            rules: ArcSwap::from_pointee(Rules::new(config, &metrics, None)),
            tls: arc_swap::ArcSwapOption::new(
                config.server.tls.as_ref().map(|(_, c)| Arc::clone(c)),
            ),
            limiter,
            forwarder: Forwarder::new(metrics.timeouts().clone()),
            metrics,
            shadow_logged: AtomicU64::new(0),
            access_log,
            ids,
            draining: AtomicBool::new(false),
        }
    }

    /// The rules in force.
    pub fn rules(&self) -> arc_swap::Guard<Arc<Rules>> {
        self.rules.load()
    }

    /// TLS for a connection accepted now, if the listener has it.
    pub fn tls(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.tls.load_full()
    }

    /// Evicts expired in-process state (every second).
    pub fn sweep(&self) {
        self.limiter.sweep();
        self.forwarder.sweep();
    }

    /// Asks a store considered down whether it answers again.
    pub async fn recover(&self) {
        self.limiter.recover().await;
    }

    /// Whether the instance should get traffic, and why not. A store that
    /// is down makes it unready only where `on_error = "deny"` refuses
    /// everything limited: with `allow` or `local` it still serves, and
    /// taking every replica out of service at once (they share the store)
    /// would turn a fail-open policy into an outage.
    pub fn readiness(&self) -> Readiness {
        if self.draining.load(Ordering::Relaxed) {
            Readiness::Draining
        } else if self.limiter.ready() {
            Readiness::Ready
        } else if self.limiter.refuses_when_down() {
            Readiness::Refusing
        } else {
            Readiness::StoreDown
        }
    }

    /// The shared store: its kind, whether it answers, its `on_error`.
    pub fn store(&self) -> (&'static str, bool, crate::limit::settings::OnError) {
        (
            self.limiter.kind(),
            self.limiter.ready(),
            self.limiter.on_error(),
        )
    }

    /// Whether some but not all of a Redis Cluster's primaries are
    /// considered down (their slots get `on_error`).
    pub fn store_degraded(&self) -> bool {
        self.limiter.degraded()
    }

    /// How client ids are shown to operators.
    pub fn ids(&self) -> &Ids {
        &self.ids
    }

    /// A stop was asked for: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Brings gauges that are read rather than counted up to date.
    pub fn refresh_gauges(&self) {
        self.metrics
            .circuit_open
            .set(i64::from(!self.limiter.ready()));
        self.limiter.refresh_gauges();
    }

    /// The metrics, as exposed on `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Applies a newly loaded configuration's rules (its upstreams started
    /// with [`start_upstreams`]); parts that cannot change while running
    /// are reported and keep their old values.
    pub fn reload(&self, running: &Config, new: Config) {
        for what in running.differences_needing_restart(&new) {
            tracing::warn!(
                setting = what,
                "{what} changed but cannot be applied while running; restart floodgate to apply it"
            );
        }
        let rules = Rules::new(&new, &self.metrics, Some(&self.rules.load()));
        self.rules.store(Arc::new(rules));
        self.tls
            .store(new.server.tls.as_ref().map(|(_, c)| Arc::clone(c)));
        self.limiter.rules_changed();
        self.metrics.reloaded(true, &new.digest);
        tracing::info!(
            path = %new.path.display(),
            routes = new.routes.len(),
            digest = %new.digest,
            "configuration reloaded"
        );
    }

    /// Records a reload that was refused; the old rules stay.
    pub fn reload_refused(&self, error: &crate::config::LoadError) {
        self.metrics.reloaded(false, "");
        for line in error.to_string().lines() {
            tracing::error!("{line}");
        }
        tracing::error!("configuration not reloaded; the previous rules stay in force");
    }

    /// Logs a shadow denial, at most once a second at info (the rest at debug).
    fn log_shadow(&self, route: &str, client: &crate::client::ClientId) {
        let now = crate::limit::now_ms();
        let last = self.shadow_logged.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1_000
            && self
                .shadow_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::info!(
                route,
                %client,
                "shadow: would have denied (further ones this second at debug)"
            );
        } else {
            tracing::debug!(route, %client, "shadow: would have denied");
        }
    }
}

/// The path and query sent upstream: the request's own when its path was
/// already normal, else the normalised path with the original query.
fn forwarded_target(forward_path: Cow<'_, str>, uri: &http::Uri) -> Option<PathAndQuery> {
    match (forward_path, uri.path_and_query()) {
        (Cow::Borrowed(_), Some(pq)) => Some(pq.clone()),
        (path, pq) => {
            let text = match pq.and_then(PathAndQuery::query) {
                Some(q) => format!("{path}?{q}"),
                None => path.into_owned(),
            };
            PathAndQuery::try_from(text).ok()
        }
    }
}

/// One request from `peer`: route, client, limit, then forward or deny.
/// Every answer floodgate makes itself is counted by status and fault. An
/// upgraded connection's tunnel holds what `hold` gives until it ends.
pub async fn handle<H: Send + 'static>(
    shared: &Shared,
    peer: &Peer,
    request: Request<Incoming>,
    hold: impl FnOnce() -> H,
) -> Response<Logged> {
    let grpc = response::is_grpc(request.headers());
    let mut record = shared.access_log.as_ref().map(|_| {
        Record::begin(
            request.method(),
            request.uri(),
            request.version(),
            peer.addr,
            hyper::body::Body::size_hint(request.body()).exact(),
        )
    });
    let mut slot = None;
    let response = match answer(shared, peer, request, grpc, hold, &mut record, &mut slot).await {
        Ok(response) => response,
        Err(refusal) => {
            shared.metrics.refused(&refusal);
            if grpc {
                refusal.into_grpc_response()
            } else {
                refusal.into_response()
            }
        }
    };
    if let Some(r) = record.as_mut() {
        r.status(response.status().as_u16());
    }
    response.map(|body| Logged::new(body, record, shared.access_log.as_ref()).holding(slot))
}

/// [`handle`]'s work: the answer, or what floodgate answers instead.
async fn answer<H: Send + 'static>(
    shared: &Shared,
    peer: &Peer,
    request: Request<Incoming>,
    grpc: bool,
    hold: impl FnOnce() -> H,
    log: &mut Option<Record>,
    slot_out: &mut Option<Slot>,
) -> Result<Response<Body>, Refusal> {
    // Taken apart once: the head is lent, not moved, on its way upstream.
    let (mut request, body) = request.into_parts();
    if request
        .uri
        .path_and_query()
        .is_some_and(|pq| pq.as_str().len() > MAX_URI_BYTES)
    {
        return Err(Refusal::client(
            StatusCode::URI_TOO_LONG,
            "the request target is longer than 8 KiB",
        ));
    }
    let host = crate::head::check(&request)?;
    let rules = shared.rules.load_full();
    let (forward_path, matched_path) = request_paths(request.uri.path(), rules.escaped_slashes)?;
    let facts = RequestFacts {
        method: &request.method,
        host,
        path: &matched_path,
        headers: &request.headers,
    };
    let Some((index, route)) = rules.routes.find(&facts) else {
        shared.metrics.no_route.inc();
        return Err(Refusal::client(
            StatusCode::NOT_FOUND,
            "no route matches this request",
        ));
    };
    // `post` is not `POST` to floodgate, but is to many servers: it is
    // served only on a route that compares methods without case.
    if !route.matcher.ignore_case
        && let Some(standard) = crate::head::miscased_standard(&request.method)
    {
        return Err(crate::head::HeadError::MethodCase(standard).into());
    }
    let counts = &rules.metrics[index];
    if let Some(r) = log.as_mut() {
        r.route(&route.name);
    }
    // A body declared too large is refused before anything else is spent
    // on it; one that grows too large on the way is cut (proxy::body).
    if let (Action::Upstream(_), Some(max)) = (&route.action, route.max_request_body)
        && hyper::body::Body::size_hint(&body).lower() > max
    {
        return Err(Refusal::client(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than this route's max_request_body of {max} bytes"),
        ));
    }

    // Exempt clients skip identification too: a health checker need not
    // send the API key header that limits everyone else.
    let exempt = (!route.exempt.is_empty()
        && is_in(
            client_address(&request.headers, peer.addr.ip(), &rules.trusted_proxies),
            &route.exempt,
        ))
        || route
            .exempt_keys
            .iter()
            .any(|keys| keys.exempts(&request.headers));
    let capacity = rules.capacity.get(index).and_then(Option::as_ref);
    let per_client = capacity.is_some_and(|c| c.settings().per == Per::Client);
    let client = if !exempt && (!route.policy.limits.is_empty() || per_client) {
        Some(route.client.identify_forwarded(
            &mut request.headers,
            &matched_path,
            peer.addr.ip(),
            &rules.trusted_proxies,
        )?)
    } else {
        None
    };
    // Room in flight first, so a request refused for it costs no rate
    // units; a request the rate refuses drops its slot on the way out.
    let slot = match capacity {
        Some(capacity) if !(per_client && client.is_none()) => {
            match capacity.acquire(client.as_ref()).await {
                Ok(slot) => Some(slot),
                Err(reason) => {
                    let whose = match capacity.settings().per {
                        Per::Route => "route",
                        Per::Client => "this client on route",
                    };
                    let detail = format!(
                        "{whose} \"{}\" has as many requests in flight as it allows ({}); retry shortly",
                        route.name,
                        capacity.limit()
                    );
                    tracing::debug!(route = %route.name, reason = reason.name(), "concurrency cap full");
                    return Err(Refusal::capacity(capacity.settings().status, detail));
                }
            }
        }
        _ => None,
    };
    let hold = {
        let slot = slot.clone();
        move || (hold(), slot)
    };
    let mut decision = None;
    if exempt {
        counts.count(Outcome::Exempt);
        if let Some(r) = log.as_mut() {
            r.decided(Outcome::Exempt, None, None);
        }
    } else if route.policy.limits.is_empty() {
        counts.count(Outcome::Allowed);
        if let Some(r) = log.as_mut() {
            r.decided(Outcome::Allowed, None, None);
        }
    } else if let Some(client) = client {
        let policy = route.policy_for(&client, &request.headers);
        let charge = Charge {
            route: &route.name,
            client: &client,
            limits: &policy.limits,
            cost: route.cost,
        };
        let answer = shared.limiter.decide(charge).await;
        if let Some(r) = log.as_mut() {
            let (outcome, limit) = match &answer {
                Answer::Decided(d) => (
                    if d.allowed {
                        Outcome::Allowed
                    } else if route.shadow {
                        Outcome::ShadowDenied
                    } else {
                        Outcome::Denied
                    },
                    policy
                        .names
                        .get(d.limit)
                        .map(|name| (name.as_str(), d.remaining)),
                ),
                Answer::Unavailable { .. } => (Outcome::StoreError, None),
            };
            r.decided(outcome, Some(&client), limit);
        }
        if let (Some(top), Answer::Decided(d)) = (&rules.top, &answer)
            && let Some(route_top) = top.get(index)
        {
            route_top.count(&client, !d.allowed, crate::limit::now_ms() / 1000);
        }
        match answer {
            Answer::Decided(d) if d.allowed => {
                counts.count(Outcome::Allowed);
                decision = Some((d, policy));
            }
            Answer::Decided(d) if route.shadow => {
                counts.count(Outcome::ShadowDenied);
                shared.log_shadow(&route.name, &client);
                decision = Some((d, policy));
            }
            Answer::Decided(d) => {
                counts.count(Outcome::Denied);
                tracing::debug!(route = %route.name, %client, "denied");
                return Ok(if grpc {
                    response::grpc_too_many_requests(route, policy, &d)
                } else {
                    response::too_many_requests(route, policy, &d)
                });
            }
            Answer::Unavailable {
                deny,
                retry_after_ms,
            } => {
                counts.count(Outcome::StoreError);
                if deny && !route.shadow {
                    return Err(Refusal::store(retry_after_ms));
                }
            }
        }
    }

    let mut response = match &route.action {
        Action::Respond(r) => response::respond(r),
        Action::Upstream(upstream) => {
            let Some(path_and_query) = forwarded_target(forward_path, &request.uri) else {
                return Err(Refusal::client(
                    StatusCode::BAD_REQUEST,
                    "the request path cannot be forwarded",
                ));
            };
            let started = Instant::now();
            // Only the upstream's own answers count as upstream responses;
            // floodgate's 502 and 504 are refusals.
            let (response, endpoint) = shared
                .forwarder
                .forward(
                    upstream,
                    &mut request,
                    body,
                    path_and_query,
                    peer,
                    started,
                    ClientSide {
                        max_body: route.max_request_body,
                        ..rules.client_timeouts
                    },
                    hold,
                )
                .await?;
            let took = started.elapsed();
            if let Some(slot) = &slot {
                slot.sample(took);
            }
            counts.upstream(response.status().as_u16(), took);
            if let Some(r) = log.as_mut() {
                r.upstream(&endpoint.endpoint.target, took);
            }
            response
        }
    };
    if let Some((d, policy)) = &decision {
        response::annotate(response.headers_mut(), route, policy, d);
    }
    // The answer's body holds the slot until it is sent (an upgraded
    // connection's tunnel holds a clone); refusals and denials drop it
    // when this returns.
    *slot_out = slot;
    Ok(response)
}
