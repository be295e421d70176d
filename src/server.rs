//! The listeners, the accept loop with its connection cap, and graceful
//! shutdown; each request is handed to [`crate::gate`].

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::client::is_in;
use crate::config::Config;
use crate::gate::{self, Shared};
use crate::metrics::Metrics;
use crate::proxy::Peer;
use crate::refusal::Refusal;
use crate::response;

mod background;
mod connection;
mod write_idle;

use background::Background;
use connection::{Activity, Connections, Ended, Protocols, Socket, WriteTimeout};

/// Largest request head accepted (request line and headers together); past it
/// HTTP/1 answers 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most streams an HTTP/2 client may reset before they are accepted, and
/// most floodgate resets for its errors, on one connection.
const HTTP2_MAX_RESET_STREAMS: usize = 100;
/// Most header fields accepted in one request.
const MAX_HEADERS: usize = 100;

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

/// The sockets floodgate serves on.
#[derive(Debug)]
pub struct Listeners {
    /// The proxy's listener.
    pub proxy: TcpListener,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`), if any.
    pub admin: Option<TcpListener>,
    /// The decision listener front proxies ask, if any.
    pub decisions: Option<TcpListener>,
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
        let decisions = match server.decision_listen {
            Some(addr) => Some(bind(addr).await?),
            None => None,
        };
        Ok(Self {
            proxy,
            admin,
            decisions,
        })
    }
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The store or the access log could not be set up.
    #[error(transparent)]
    Start(#[from] gate::StartError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
}

/// Serves `config` until `shutdown` completes, then answers `/readyz` with
/// 503 for `drain_delay` while still accepting, stops accepting, lets
/// in-flight requests finish within the configured grace period, and
/// returns. The rules are reloaded from `config.path` when `reload` is
/// notified (SIGHUP) and when the file's contents change.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
    reload: Arc<Notify>,
) -> Result<(), ServeError> {
    let baseline = crate::reload::Baseline::of(&config);
    let shared = Arc::new(Shared::start(&config).await?);
    let Listeners {
        proxy,
        admin,
        decisions: decision_listener,
    } = listeners;
    let background = Background::start(&shared, &config, reload, baseline, admin);
    let protocols = Arc::new(protocols(&config));

    let connections = Arc::new(Connections::default());
    let max_connections = config
        .server
        .max_connections
        .unwrap_or_else(default_max_connections);
    // One permit per connection, on either listener: at the cap, accepting
    // pauses and new connections wait in the listen backlog until one
    // closes.
    let slots = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let shutdown = drain_then_stop(
        shutdown,
        Arc::clone(&shared),
        config.server.drain_delay,
        stopping,
    );
    let accepting = Accepting {
        slots: &slots,
        max_connections,
        shared: &shared,
        connections: &connections,
        protocols: &protocols,
    };
    let decisions = async {
        if let Some(listener) = decision_listener {
            accepting
                .accept(listener, Door::Decisions, until_stopped(stopped.clone()))
                .await;
        }
    };
    tokio::join!(
        shutdown,
        accepting.accept(proxy, Door::Proxy, until_stopped(stopped.clone())),
        decisions,
    );
    let grace_over = finish_in_flight(&connections, &shared, config.server.shutdown_grace).await;
    background.stop(&shared, grace_over).await;
    Ok(())
}

/// Once `shutdown` completes: `/readyz` turns to 503 and accepting goes
/// on for `drain_delay`, so that load balancers stop sending new
/// connections before the listeners close; then `stopping` says stop.
async fn drain_then_stop(
    shutdown: impl Future<Output = ()>,
    shared: Arc<Shared>,
    drain_delay: Duration,
    stopping: tokio::sync::watch::Sender<bool>,
) {
    shutdown.await;
    shared.start_draining();
    if !drain_delay.is_zero() {
        tracing::info!(
            ?drain_delay,
            "stopping: /readyz answers 503; still accepting until drain_delay passes"
        );
        tokio::time::sleep(drain_delay).await;
    }
    let _ = stopping.send(true);
}

/// Completes once `stopped` says stop.
async fn until_stopped(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|stop| *stop).await;
}

/// In-flight requests finished within `grace` (the connections told to
/// close, and those left closed when it is over), then the usage
/// settlements in flight within the same grace; when the grace is over.
async fn finish_in_flight(
    connections: &Connections,
    shared: &Shared,
    grace: Duration,
) -> tokio::time::Instant {
    tracing::info!(
        connections = connections.count(),
        ?grace,
        "shutting down: finishing in-flight requests"
    );
    connections.close_all();
    let grace_over = tokio::time::Instant::now() + grace;
    tokio::select! {
        () = connections.all_closed() => tracing::info!("all connections closed"),
        () = tokio::time::sleep_until(grace_over) => {
            tracing::warn!("grace period over; closing the remaining connections");
        }
    }
    // Answers that report their units in the body are settled after they
    // have gone out: within the same grace, those settlements land.
    let settlements = shared.settlements();
    if settlements.count() > 0 {
        tracing::info!(
            settlements = settlements.count(),
            "waiting for usage settlements in flight"
        );
        tokio::select! {
            () = settlements.finished() => {}
            () = tokio::time::sleep_until(grace_over) => tracing::warn!(
                settlements = settlements.count(),
                "grace period over; usage settlements still in flight stand at their reservations"
            ),
        }
    }
    grace_over
}

/// hyper's HTTP/1 and HTTP/2 server settings, and the idle timeout that
/// `connection::serve` applies to both.
fn protocols(config: &Config) -> Protocols {
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
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        // Each stream is a request that may hold an upstream connection:
        // one client connection gets no more than this at once.
        .max_concurrent_streams(config.server.http2_max_concurrent_streams)
        // Streams a client opens and resets before they are accepted (the
        // "rapid reset" flood), and streams floodgate itself resets for a
        // client's protocol errors, are bounded per connection; past them
        // the connection is closed.
        .max_pending_accept_reset_streams(HTTP2_MAX_RESET_STREAMS)
        .max_local_error_reset_streams(HTTP2_MAX_RESET_STREAMS);
    Protocols {
        http1,
        http2,
        idle_timeout: header_read_timeout,
    }
}

/// Which listener a connection came in on: the proxy's, whose requests
/// are forwarded, or the decision listener's, whose requests are only
/// decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Door {
    Proxy,
    Decisions,
}

/// What the accept loops share.
struct Accepting<'a> {
    slots: &'a Arc<tokio::sync::Semaphore>,
    max_connections: usize,
    shared: &'a Arc<Shared>,
    connections: &'a Arc<Connections>,
    protocols: &'a Arc<Protocols>,
}

impl Accepting<'_> {
    /// Accepts on `listener` until `stop` completes, each connection
    /// served on a task of its own.
    async fn accept(&self, listener: TcpListener, door: Door, stop: impl Future<Output = ()>) {
        tokio::pin!(stop);
        let mut cap_logged = false;
        let mut accept_trouble = AcceptTrouble::default();
        loop {
            let slot = match Arc::clone(self.slots).try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    if !cap_logged {
                        cap_logged = true;
                        tracing::warn!(
                            max_connections = self.max_connections,
                            "connection cap reached; new connections wait until one closes"
                        );
                    }
                    tokio::select! {
                        slot = Arc::clone(self.slots).acquire_owned() => match slot {
                            Ok(slot) => slot,
                            Err(_) => break,
                        },
                        () = &mut stop => break,
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
                    serve(stream, peer, slot, door, self.shared, self.connections, self.protocols);
                }
                () = &mut stop => break,
            }
        }
    }
}

/// One accepted connection, served on a task of its own: the client as
/// the request phases see it, its write timeout, and the service that
/// hands each of its requests to `gate::handle`.
fn serve(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    slot: tokio::sync::OwnedSemaphorePermit,
    door: Door,
    shared: &Arc<Shared>,
    connections: &Arc<Connections>,
    protocols: &Arc<Protocols>,
) {
    let _ = stream.set_nodelay(true);
    let open = connections.open(shared.metrics().open_connections.clone());
    let on_timeout = Arc::clone(shared);
    // The decision listener speaks plain HTTP to the front proxies beside
    // it; whose forwarded headers it believes is its own list.
    let rules = shared.rules();
    let (tls, trusted) = match door {
        Door::Proxy => (shared.tls(), &rules.trusted_proxies),
        Door::Decisions => (None, &rules.decision_peers),
    };
    let trusted = is_in(peer.ip().to_canonical(), trusted);
    let client = Arc::new(Client {
        peer: Peer::new(peer, tls.is_some(), trusted),
        activity: Activity::default(),
        shared: Arc::clone(shared),
        _open: open,
        _slot: slot,
    });
    let write_timeout = WriteTimeout {
        after: rules.client_write_timeout,
        timeouts: shared
            .metrics()
            .timeouts()
            .counter(crate::metrics::Phase::ClientWrite)
            .clone(),
    };
    let connection = Served {
        stream,
        tls,
        on_connection: Arc::clone(&client),
        write_timeout,
        protocols: Arc::clone(protocols),
        connections: Arc::clone(connections),
        on_timeout,
        peer,
    };
    // One reference count taken per request, the connection's own: the
    // shared state is reached through it, so requests on every thread do
    // not all count references on the one `Shared`. Each listener's
    // requests have a service of their own, so that a proxied request's
    // future holds nothing of a decision's.
    match door {
        // The request's future is `gate::handle`'s own: no layer around it.
        Door::Proxy => connection.spawn(service_fn(move |request| {
            gate::handle(Arc::clone(&client), request)
        })),
        Door::Decisions => connection.spawn(service_fn(move |request| {
            gate::decide(Arc::clone(&client), request)
        })),
    }
}

/// An accepted connection and what serving it needs.
struct Served {
    stream: tokio::net::TcpStream,
    tls: Option<Arc<rustls::ServerConfig>>,
    on_connection: Arc<Client>,
    write_timeout: WriteTimeout,
    protocols: Arc<Protocols>,
    connections: Arc<Connections>,
    on_timeout: Arc<Shared>,
    peer: SocketAddr,
}

impl Served {
    /// Serves the connection with `service` on a task of its own.
    fn spawn<S, B>(self, service: S)
    where
        S: hyper::service::Service<
                http::Request<hyper::body::Incoming>,
                Response = http::Response<B>,
            > + Send
            + 'static,
        S::Future: Send + 'static,
        S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        tokio::spawn(async move {
            let served = connection::serve(
                self.stream,
                self.tls,
                service,
                &self.on_connection.activity,
                &self.write_timeout,
                &self.protocols,
                &self.connections,
            );
            match served.await {
                Ended::Served(None) => {}
                Ended::Served(Some(e)) => {
                    tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                }
                Ended::FirstHeadTimedOut(socket) => {
                    request_timeout(socket, self.on_timeout.metrics()).await;
                }
            }
        });
    }
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

/// The client end of a connection, as its requests see it. It counts as
/// an open connection, holding its place under `max_connections`, until the
/// connection and any tunnel an upgrade made of it have ended.
struct Client {
    peer: Peer,
    activity: Activity,
    /// What every request needs, reached through the connection.
    shared: Arc<Shared>,
    _open: connection::Open,
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl gate::Connection for Client {
    type Busy<'a> = connection::Busy<'a>;

    fn shared(&self) -> &Shared {
        &self.shared
    }

    fn peer(&self) -> &Peer {
        &self.peer
    }

    fn begin(&self) -> connection::Busy<'_> {
        self.activity.begin()
    }
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
