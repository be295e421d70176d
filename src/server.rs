//! The accept loop, one request's way through the proxy, graceful shutdown
//! and the swap of rules on reload.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use ipnet::IpNet;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::client::{client_address, is_in};
use crate::config::Config;
use crate::limit::{Answer, Charge, Limiter};
use crate::metrics::{Metrics, Outcome, RouteMetrics};
use crate::proxy::{ClientSide, Forwarder, Peer};
use crate::refusal::Refusal;
use crate::response::{self, Body};
use crate::routes::{Action, EscapedSlashes, RequestFacts, Table, request_paths};

mod connection;

use connection::{Activity, Connections, Ended, Protocols, Socket, WriteTimeout};

/// Largest request head accepted (request line and headers together); past it
/// HTTP/1 answers 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields accepted in one request.
const MAX_HEADERS: usize = 100;
/// Longest request target (path and query) accepted; past it 414.
const MAX_URI_BYTES: usize = 8 * 1024;

/// Raises this process's soft limit on open files to its hard limit and
/// returns the limit now in force (`u64::MAX` when unlimited).
pub fn raise_open_file_limit() -> std::io::Result<u64> {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        )?;
    }
    Ok(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

/// The connection cap when `[server] max_connections` is not set: three
/// quarters of the open file limit, so that the rest stays for upstream
/// connections, Redis and the listeners.
fn default_max_connections() -> usize {
    let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    usize::try_from(limit / 4 * 3)
        .unwrap_or(usize::MAX)
        .clamp(64, 1_000_000)
}

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
}

impl Rules {
    /// The swappable rules of `config`, counting into `metrics`.
    pub fn new(config: &Config, metrics: &Metrics) -> Self {
        Self {
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
        }
    }
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
}

impl Shared {
    /// False while the shared store is considered down.
    pub fn ready(&self) -> bool {
        self.limiter.ready()
    }

    /// Brings gauges that are read rather than counted up to date.
    pub fn refresh_gauges(&self) {
        self.metrics
            .circuit_open
            .set(i64::from(!self.limiter.ready()));
    }

    /// The metrics, as exposed on `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Applies a newly loaded configuration's rules; parts that cannot
    /// change while running are reported and keep their old values.
    pub fn reload(&self, running: &Config, new: Config) {
        for what in running.differences_needing_restart(&new) {
            tracing::warn!(
                setting = what,
                "{what} changed but cannot be applied while running; restart floodgate to apply it"
            );
        }
        self.rules.store(Arc::new(Rules::new(&new, &self.metrics)));
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
                ?client,
                "shadow: would have denied (further ones this second at debug)"
            );
        } else {
            tracing::debug!(route, ?client, "shadow: would have denied");
        }
    }
}

/// The sockets floodgate serves on.
#[derive(Debug)]
pub struct Listeners {
    /// The proxy's listener.
    pub proxy: TcpListener,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`), if any.
    pub admin: Option<TcpListener>,
}

impl Listeners {
    /// Binds the addresses `[server]` names.
    pub async fn bind(server: &crate::config::Server) -> Result<Self, ServeError> {
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })
        };
        let proxy = bind(server.listen).await?;
        let admin = match server.admin_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        Ok(Self { proxy, admin })
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store could not be set up.
    #[error("cannot set up the rate limit store: {0}")]
    Store(#[from] crate::limit::StoreError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Serves `config` until `shutdown` completes, then stops accepting, lets
/// in-flight requests finish within the configured grace period, and
/// returns. The rules are reloaded from `config.path` when `reload` is
/// notified (SIGHUP) and when the file's contents change.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    reload: Arc<Notify>,
) -> Result<(), ServeError> {
    let metrics = Metrics::new();
    metrics.config_loaded(&config.digest);
    let limiter = Limiter::new(
        &config.store,
        config.server.max_client_entries,
        metrics.store(),
    )
    .await?;
    let shared = Arc::new(Shared {
        rules: ArcSwap::from_pointee(Rules::new(&config, &metrics)),
        tls: arc_swap::ArcSwapOption::new(config.server.tls.as_ref().map(|(_, c)| Arc::clone(c))),
        limiter,
        forwarder: Forwarder::new(metrics.timeouts().clone()),
        metrics,
        shadow_logged: AtomicU64::new(0),
    });
    let sweeper = tokio::spawn(sweep(Arc::clone(&shared)));
    let recoverer = tokio::spawn(recover(Arc::clone(&shared)));
    let watcher = tokio::spawn(crate::reload::watch(
        Arc::clone(&shared),
        config.clone(),
        reload,
    ));
    let admin = listeners.admin.map(|listener| {
        tokio::spawn(crate::admin::serve(
            listener,
            Arc::clone(&shared),
            config.server.header_read_timeout,
        ))
    });
    let listener = listeners.proxy;

    let header_read_timeout = config.server.header_read_timeout;
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        // Request heads and idle connections are timed by
        // `connection::serve`, once per connection rather than per request.
        .header_read_timeout(None)
        // 431 past this: enforced on the parsed head, not left to where
        // the read buffer happens to fill up.
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS)
        // Head and body copied into one buffer and sent with one write:
        // cheaper than queueing them for writev when bodies are small, and
        // the copy of a large body is bounded by the buffer's limit.
        .writev(false);
    let mut http2 = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http2
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32);
    let protocols = Arc::new(Protocols {
        http1,
        http2,
        idle_timeout: header_read_timeout,
    });

    let connections = Arc::new(Connections::default());
    let max_connections = config
        .server
        .max_connections
        .unwrap_or_else(default_max_connections);
    // One permit per connection: at the cap, accepting pauses and new
    // connections wait in the listen backlog until one closes.
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut cap_logged = false;
    let mut accept_trouble = AcceptTrouble::default();
    tokio::pin!(shutdown);
    loop {
        let slot = match Arc::clone(&slots).try_acquire_owned() {
            Ok(slot) => slot,
            Err(_) => {
                if !cap_logged {
                    cap_logged = true;
                    tracing::warn!(
                        max_connections,
                        "connection cap reached; new connections wait until one closes"
                    );
                }
                tokio::select! {
                    slot = Arc::clone(&slots).acquire_owned() => match slot {
                        Ok(slot) => slot,
                        Err(_) => break,
                    },
                    () = &mut shutdown => break,
                }
            }
        };
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => {
                        accept_trouble.recovered();
                        a
                    }
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tokio::time::sleep(accept_trouble.failed(&e)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let open = connections.open(shared.metrics.open_connections.clone());
                let on_timeout = Arc::clone(&shared);
                let shared = Arc::clone(&shared);
                let tls = shared.tls.load_full();
                let client = Arc::new(Client {
                    peer: Peer::new(
                        peer,
                        tls.is_some(),
                        is_in(peer.ip().to_canonical(), &shared.rules.load().trusted_proxies),
                    ),
                    activity: Activity::default(),
                    _open: open,
                    _slot: slot,
                });
                let write_timeout = WriteTimeout {
                    after: shared.rules.load().client_write_timeout,
                    timeouts: shared
                        .metrics
                        .timeouts()
                        .counter(crate::metrics::Phase::ClientWrite)
                        .clone(),
                };
                let on_connection = Arc::clone(&client);
                let service = service_fn(move |request| {
                    let shared = Arc::clone(&shared);
                    let client = Arc::clone(&client);
                    async move {
                        let _busy = client.activity.begin();
                        Ok::<_, Infallible>(handle(&shared, &client, request).await)
                    }
                });
                let protocols = Arc::clone(&protocols);
                let connections = Arc::clone(&connections);
                tokio::spawn(async move {
                    let served = connection::serve(
                        stream,
                        tls,
                        service,
                        &on_connection.activity,
                        &write_timeout,
                        &protocols,
                        &connections,
                    );
                    match served.await {
                        Ended::Served(None) => {}
                        Ended::Served(Some(e)) => {
                            tracing::debug!(%peer, error = %e, "connection ended with an error");
                        }
                        Ended::FirstHeadTimedOut(socket) => {
                            request_timeout(socket, &on_timeout.metrics).await;
                        }
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(
        connections = connections.count(),
        grace = ?config.server.shutdown_grace,
        "shutting down: finishing in-flight requests"
    );
    connections.close_all();
    tokio::select! {
        () = connections.all_closed() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(config.server.shutdown_grace) => {
            tracing::warn!("grace period over; closing the remaining connections");
        }
    }
    sweeper.abort();
    recoverer.abort();
    watcher.abort();
    if let Some(admin) = admin {
        admin.abort();
    }
    Ok(())
}

/// Accept failures in a row (out of descriptors, most often): how long to
/// wait before the next accept, doubling from 5 ms to a second, and a log
/// line at most once a second that says how many failed.
#[derive(Debug, Default)]
struct AcceptTrouble {
    failures: u64,
    backoff: Duration,
    last_logged: Option<Instant>,
}

impl AcceptTrouble {
    /// Counts a failure; returns how long to wait.
    fn failed(&mut self, error: &std::io::Error) -> Duration {
        self.failures += 1;
        self.backoff = (self.backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
        if self
            .last_logged
            .is_none_or(|at| at.elapsed() >= Duration::from_secs(1))
        {
            self.last_logged = Some(Instant::now());
            tracing::warn!(
                error = %error,
                failures = self.failures,
                backoff = ?self.backoff,
                "accept failed; backing off"
            );
        }
        self.backoff
    }

    /// An accept worked: the next failure starts afresh.
    fn recovered(&mut self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "accepting again");
            *self = Self::default();
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

/// The client end of a connection, as its requests see it. It counts as
/// an open connection, holding its place under `max_connections`, until the
/// connection and any tunnel an upgrade made of it have ended.
struct Client {
    peer: Peer,
    activity: Activity,
    _open: connection::Open,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

/// Answers 408 on a connection whose first request head did not arrive in
/// time, then closes it.
async fn request_timeout(socket: Socket, metrics: &Metrics) {
    let refusal = Refusal::client(
        StatusCode::REQUEST_TIMEOUT,
        "no request head arrived within header_read_timeout",
    );
    metrics.refused(&refusal);
    metrics.timeouts().count(crate::metrics::Phase::ClientHead);
    let body = response::problem_body(refusal.status(), refusal.detail());
    let answer = format!(
        "HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-type: application/problem+json\r\ncache-control: no-store\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.answer_and_close(answer.as_bytes()).await;
}

/// Evicts expired in-process state every second.
async fn sweep(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.limiter.sweep();
        shared.forwarder.sweep();
    }
}

/// Checks a store that is considered down twice a second, so that it is
/// used again as soon as it answers, with or without requests.
async fn recover(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.limiter.recover().await;
    }
}

/// One request: route, client, limit, then forward or deny. Every answer
/// floodgate makes itself is counted by status and fault.
async fn handle(
    shared: &Shared,
    client: &Arc<Client>,
    request: Request<Incoming>,
) -> Response<Body> {
    let grpc = response::is_grpc(request.headers());
    match answer(shared, client, request, grpc).await {
        Ok(response) => response,
        Err(refusal) => {
            shared.metrics.refused(&refusal);
            if grpc {
                refusal.into_grpc_response()
            } else {
                refusal.into_response()
            }
        }
    }
}

/// [`handle`]'s work: the answer, or what floodgate answers instead.
async fn answer(
    shared: &Shared,
    caller: &Arc<Client>,
    request: Request<Incoming>,
    grpc: bool,
) -> Result<Response<Body>, Refusal> {
    let peer = &caller.peer;
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
    let exempt = !route.exempt.is_empty()
        && is_in(
            client_address(&request.headers, peer.addr.ip(), &rules.trusted_proxies),
            &route.exempt,
        );
    let mut decision = None;
    if exempt {
        counts.count(Outcome::Exempt);
    } else if route.limits.is_empty() {
        counts.count(Outcome::Allowed);
    } else {
        let client = route.client.identify_forwarded(
            &mut request.headers,
            peer.addr.ip(),
            &rules.trusted_proxies,
        )?;
        let charge = Charge {
            route: &route.name,
            client: &client,
            limits: &route.limits,
            cost: route.cost,
        };
        match shared.limiter.decide(charge).await {
            Answer::Decided(d) if d.allowed => {
                counts.count(Outcome::Allowed);
                decision = Some(d);
            }
            Answer::Decided(d) if route.shadow => {
                counts.count(Outcome::ShadowDenied);
                shared.log_shadow(&route.name, &client);
                decision = Some(d);
            }
            Answer::Decided(d) => {
                counts.count(Outcome::Denied);
                tracing::debug!(route = %route.name, client = ?client, "denied");
                return Ok(if grpc {
                    response::grpc_too_many_requests(route, &d)
                } else {
                    response::too_many_requests(route, &d)
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
            let response = shared
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
                    || Arc::clone(caller),
                )
                .await?;
            counts.upstream(response.status().as_u16(), started.elapsed());
            response
        }
    };
    if let Some(d) = &decision {
        response::annotate(response.headers_mut(), route, d);
    }
    Ok(response)
}
