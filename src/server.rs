//! The accept loop, one request's way through the proxy, graceful shutdown
//! and the swap of rules on reload.

use std::borrow::Cow;
use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use ipnet::IpNet;
use tokio::net::TcpListener;

use crate::config::Config;
use crate::limit::{Charge, Limiter, Outcome};
use crate::proxy::Forwarder;
use crate::response::{self, Body};
use crate::routes::{Action, RequestFacts, Table, request_paths};

/// Largest request head accepted (request line and headers together); past it
/// HTTP/1 answers 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most header fields accepted in one request.
const MAX_HEADERS: usize = 100;

/// The part of a configuration that a reload swaps.
#[derive(Debug)]
pub struct Rules {
    /// Routes, first match wins.
    pub routes: Table,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
}

impl Rules {
    /// The swappable rules of `config`.
    pub fn from_config(config: &Config) -> Self {
        Self {
            routes: config.routes.clone(),
            trusted_proxies: config.server.trusted_proxies.clone(),
        }
    }
}

/// Everything a request needs, shared by all connections.
#[derive(Debug)]
struct Shared {
    rules: ArcSwap<Rules>,
    limiter: Limiter,
    forwarder: Forwarder,
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store could not be set up.
    #[error("cannot set up the rate limit store: {0}")]
    Store(#[from] crate::limit::StoreError),
}

/// Serves `config` on `listener` until `shutdown` completes, then stops
/// accepting, lets in-flight requests finish within the configured grace
/// period, and returns.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    if let Some(admin) = config.server.admin_listen {
        tracing::warn!(%admin, "admin_listen is accepted but not served by this version");
    }
    let limiter = Limiter::new(&config.store).await?;
    let shared = Arc::new(Shared {
        rules: ArcSwap::from_pointee(Rules::from_config(&config)),
        limiter,
        forwarder: Forwarder::new(),
    });
    let sweeper = tokio::spawn(sweep(Arc::clone(&shared)));

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(config.server.header_read_timeout)
        .max_buf_size(MAX_HEAD_BYTES)
        .max_headers(MAX_HEADERS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(MAX_HEAD_BYTES as u32);

    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let shared = Arc::clone(&shared);
                let service = service_fn(move |request| {
                    let shared = Arc::clone(&shared);
                    async move { Ok::<_, Infallible>(handle(&shared, peer, request).await) }
                });
                let connection = builder.serve_connection(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    if let Err(e) = connection.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            () = &mut shutdown => break,
        }
    }
    drop(listener);
    tracing::info!(
        connections = graceful.count(),
        grace = ?config.server.shutdown_grace,
        "shutting down: finishing in-flight requests"
    );
    tokio::select! {
        () = graceful.shutdown() => tracing::info!("all connections closed"),
        () = tokio::time::sleep(config.server.shutdown_grace) => {
            tracing::warn!("grace period over; closing the remaining connections");
        }
    }
    sweeper.abort();
    Ok(())
}

/// Evicts expired in-process state every second.
async fn sweep(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.limiter.sweep();
    }
}

/// One request: route, client, limit, then forward or deny.
async fn handle(shared: &Shared, peer: SocketAddr, request: Request<Incoming>) -> Response<Body> {
    let rules = shared.rules.load_full();
    let (forward_path, matched_path) = match request_paths(request.uri().path()) {
        Ok(paths) => paths,
        Err(e) => return response::text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };
    let host = request.uri().authority().map(|a| a.as_str()).or_else(|| {
        request
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
    });
    let facts = RequestFacts {
        method: request.method(),
        host,
        path: &matched_path,
    };
    let Some(route) = rules.routes.find(&facts) else {
        return response::text(StatusCode::NOT_FOUND, "no route matches this request\n");
    };
    let route = Arc::clone(route);
    let path_and_query = match (&forward_path, request.uri().path_and_query()) {
        (Cow::Borrowed(_), Some(pq)) => Ok(pq.clone()),
        (_, pq) => {
            let query = pq.and_then(PathAndQuery::query);
            let text = match query {
                Some(q) => format!("{forward_path}?{q}"),
                None => forward_path.clone().into_owned(),
            };
            PathAndQuery::try_from(text)
        }
    };
    let Ok(path_and_query) = path_and_query else {
        return response::text(StatusCode::BAD_REQUEST, "invalid request path\n");
    };

    let client = match route
        .client
        .identify(request.headers(), peer.ip(), &rules.trusted_proxies)
    {
        Ok(client) => client,
        Err(e) => return response::text_owned(StatusCode::BAD_REQUEST, format!("{e}\n")),
    };

    let mut decision = None;
    if !route.limits.is_empty() {
        let charge = Charge {
            route: &route.name,
            client: &client,
            limits: &route.limits,
            cost: route.cost,
        };
        match shared.limiter.decide(charge).await {
            Outcome::Decided(d) if d.allowed => decision = Some(d),
            Outcome::Decided(d) if route.shadow => {
                tracing::info!(route = %route.name, client = ?client, "shadow: would have denied");
                decision = Some(d);
            }
            Outcome::Decided(d) => {
                tracing::debug!(route = %route.name, client = ?client, "denied");
                return response::too_many_requests(&route, &d);
            }
            Outcome::Unavailable {
                deny: true,
                retry_after_ms,
            } if !route.shadow => {
                return response::store_unavailable(retry_after_ms);
            }
            Outcome::Unavailable { .. } => {}
        }
    }

    let mut response = match &route.action {
        Action::Respond(r) => response::respond(r),
        Action::Upstream(upstream) => {
            shared
                .forwarder
                .forward(upstream, request, path_and_query, peer.ip())
                .await
        }
    };
    if let Some(d) = &decision {
        response::annotate(response.headers_mut(), &route, d);
    }
    response
}
