//! Connections to upstreams, reused across requests.
//!
//! One pool per upstream (its scheme, address, protocol and TLS name),
//! shared by every route that names it and kept across reloads. HTTP/1.1
//! connections carry one exchange at a time: a connection goes back to its
//! pool when the response body it carried has been read to the end, and
//! when hyper says it is ready for the next request; a body left half-read
//! (the client went away) drops its connection instead. Checkout is
//! last-in first-out, so under light load a few connections stay warm and
//! the rest age out: idle connections older than [`IDLE_TIMEOUT`] are
//! dropped, at checkout and by [`Pools::sweep`]. An HTTP/2 upstream gets
//! one connection, which every request shares as streams.
//!
//! A request whose pooled connection turns out to be closed before the
//! request was written goes again on a new connection, whatever its method;
//! one whose connection the upstream closed after it was written goes again
//! only if it is idempotent and had no body (it cannot have been acted on
//! twice by a well-behaved upstream, and there is nothing to stream again).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use http::{Method, Response};
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::{http1, http2};

use super::connect::{self, ConnectError, Sender};
use super::outgoing::{Head, KeptHead, Wire};
use super::request_body::RequestBody;
use super::settings::{Endpoint, Protocol};

/// How long an unused connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Idle connections kept per upstream; more are closed when returned.
pub const MAX_IDLE: usize = 256;

/// Sending a request found nothing to send it on, or no answer came.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be opened.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// A connection took the request and failed before answering.
    #[error("{0}")]
    Failed(#[source] hyper::Error),
    /// The request is an upgrade and the upstream speaks only HTTP/2.
    #[error("the upstream speaks HTTP/2, which carries no HTTP/1.1 upgrade")]
    NoUpgrade,
    /// No response head within the upstream's timeout.
    #[error("the upstream did not answer in time")]
    TimedOut,
}

/// A send that failed, with the request given back when no byte of it was
/// written (so that it may go to another endpoint).
#[derive(Debug)]
pub struct SendFailure {
    /// What went wrong.
    pub error: SendError,
    /// The request, when it may go again: never written, or a bodiless
    /// idempotent request whose connection broke before any answer.
    pub unsent: Option<Box<(Head, RequestBody)>>,
    /// It already went twice to this endpoint: send it only to another.
    pub elsewhere_only: bool,
}

impl SendFailure {
    fn unsent(error: SendError, head: Head, body: RequestBody) -> Self {
        Self {
            error,
            unsent: Some(Box::new((head, body))),
            elsewhere_only: false,
        }
    }
}

impl From<SendError> for SendFailure {
    fn from(error: SendError) -> Self {
        Self {
            error,
            unsent: None,
            elsewhere_only: false,
        }
    }
}

/// Where an endpoint in force keeps its pool once found: the pools outlive
/// reloads and DNS changes, the endpoints do not.
#[derive(Debug, Clone, Default)]
pub struct PoolSlot(Arc<OnceLock<Arc<Pool>>>);

/// Every upstream's pool, by [`Endpoint::pool_key`].
#[derive(Debug, Default)]
pub struct Pools {
    by_key: Mutex<HashMap<Box<str>, Arc<Pool>>>,
}

impl Pools {
    /// The pool for `endpoint`, remembered in `slot` (its endpoint in
    /// force's).
    pub fn get_in<'a>(&self, slot: &'a PoolSlot, endpoint: &Endpoint) -> &'a Arc<Pool> {
        slot.0.get_or_init(|| self.get(&endpoint.pool_key))
    }

    /// The pool for `key`, created on first use. Called once per route and
    /// configuration, never per request.
    fn get(&self, key: &str) -> Arc<Pool> {
        let mut all = self.by_key.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(all.entry(key.into()).or_default())
    }

    /// Drops idle connections past [`IDLE_TIMEOUT`] and closed ones, in
    /// every pool (including those of upstreams no route names any more),
    /// and the pools that no endpoint uses and that hold nothing: the
    /// addresses of a DNS name come and go.
    pub fn sweep(&self) {
        let pools: Vec<Arc<Pool>> = self
            .by_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        let now = Instant::now();
        for pool in pools {
            pool.idle().retain(|c| c.usable(now));
            let mut shared = pool.shared();
            if shared.as_ref().is_some_and(http2::SendRequest::is_closed) {
                *shared = None;
            }
        }
        // Held by the map alone: no endpoint's slot has it.
        self.by_key
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|_, pool| {
                Arc::strong_count(pool) > 1 || !pool.idle().is_empty() || pool.shared().is_some()
            });
    }
}

/// Connections to one upstream.
#[derive(Debug, Default)]
pub struct Pool {
    idle: Mutex<Vec<Idle>>,
    /// The HTTP/2 connection, once one was made.
    shared: Mutex<Option<http2::SendRequest<RequestBody>>>,
    /// Held while opening a connection that may turn out to be HTTP/2, so
    /// that a burst of first requests shares one connection instead of
    /// each opening its own.
    opening: tokio::sync::Mutex<()>,
    /// The upstream answered ALPN with HTTP/1.1: connections may open in
    /// parallel, one per request in flight.
    http1_learned: std::sync::atomic::AtomicBool,
}

#[derive(Debug)]
struct Idle {
    sender: http1::SendRequest<RequestBody>,
    since: Instant,
}

impl Idle {
    fn usable(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) < IDLE_TIMEOUT && self.sender.is_ready()
    }
}

/// An HTTP/1.1 connection lent to one exchange, to go back to its pool
/// when the response body has been read whole.
#[derive(Debug)]
pub struct Release {
    sender: http1::SendRequest<RequestBody>,
    pool: Arc<Pool>,
    since: Instant,
}

impl Release {
    /// The response body was read to its end: the connection goes back to
    /// the pool as soon as hyper is done with the exchange (at once, unless
    /// the request body is still being sent after an early answer).
    pub fn finish(self) {
        let Release {
            mut sender,
            pool,
            since,
        } = self;
        if sender.is_ready() {
            pool.put_back(sender, since);
        } else if !sender.is_closed()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                if sender.ready().await.is_ok() {
                    pool.put_back(sender, since);
                }
            });
        }
    }
}

/// One try at an exchange: where, for what, and whether its connection
/// came from the pool (only then may a failed try go again).
#[derive(Clone, Copy)]
struct Attempt<'a> {
    upstream: &'a Endpoint,
    upgrade: bool,
    now: Instant,
    pooled: bool,
}

/// A try that failed: for good, or in a way that lets the request go once
/// more on a new connection.
enum Failure {
    Final(SendError),
    /// The request may go again: never written on a pooled connection,
    /// or bodiless and idempotent on a connection that closed or was reset
    /// before any answer. Boxed: rare, and large beside the other.
    Again(Box<(Head, RequestBody)>, hyper::Error),
}

impl Failure {
    fn into_error(self) -> SendError {
        match self {
            Self::Final(e) => e,
            Self::Again(_, e) => SendError::Failed(e),
        }
    }
}

/// Whether `error` says the connection went away before an answer came
/// (closed or reset), rather than that the upstream answered wrongly.
fn broke_off(error: &hyper::Error) -> bool {
    if error.is_incomplete_message() || error.is_closed() {
        return true;
    }
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            );
        }
        cause = e.source();
    }
    false
}

/// What [`Pool::send`] got back.
pub struct Exchange {
    /// The upstream's response.
    pub response: Response<Incoming>,
    /// The HTTP/1.1 connection it came on, to return when its body ends.
    pub release: Option<Release>,
    /// The sender of a connection that switched protocols, to keep until
    /// the upgrade is done.
    pub switched: Option<http1::SendRequest<RequestBody>>,
}

impl Pool {
    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn shared(&self) -> std::sync::MutexGuard<'_, Option<http2::SendRequest<RequestBody>>> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `head` and `body` to `upstream` on a pooled connection or a
    /// new one, and waits for the response head. An upgrade (`upgrade`)
    /// goes on an HTTP/1.1 connection. `now` is when the request began:
    /// connections are judged idle, and later count as idle, from it. The
    /// exchange is written into `out` (where the caller keeps it: moved
    /// back out through each layer, it was copied at every one).
    pub async fn send(
        self: &Arc<Self>,
        upstream: &Endpoint,
        head: Head,
        body: RequestBody,
        upgrade: bool,
        now: Instant,
        out: &mut Option<Exchange>,
    ) -> Result<(), SendFailure> {
        let (sender, pooled) = match self.checkout(upgrade, now) {
            Some(sender) => (sender, true),
            None => match self.connect(upstream, upgrade).await {
                Ok(sender) => (sender, false),
                Err(error) => return Err(SendFailure::unsent(error, head, body)),
            },
        };
        let attempt = Attempt {
            upstream,
            upgrade,
            now,
            pooled,
        };
        match self.send_on(sender, head, body, attempt, out).await {
            Ok(()) => Ok(()),
            Err(Failure::Final(e)) => Err(e.into()),
            // A new connection that broke: the endpoint is likely going
            // away, so the caller may send the request elsewhere.
            Err(Failure::Again(again, error)) if !pooled => Err(SendFailure {
                error: SendError::Failed(error),
                unsent: Some(again),
                elsewhere_only: false,
            }),
            // A pooled one: the keep-alive race; again on a new connection.
            Err(Failure::Again(again, error)) => {
                let (head, body) = *again;
                tracing::debug!(
                    %error,
                    "a pooled connection closed as the request arrived; sending it again on a new one"
                );
                let fresh = match self.connect(upstream, upgrade).await {
                    Ok(fresh) => fresh,
                    Err(error) => return Err(SendFailure::unsent(error, head, body)),
                };
                let last = Attempt {
                    pooled: false,
                    ..attempt
                };
                // Broken again: the endpoint is going away; the caller may
                // send it to another one (and only to another one).
                self.send_on(fresh, head, body, last, out)
                    .await
                    .map_err(|f| match f {
                        Failure::Again(again, error) => SendFailure {
                            error: SendError::Failed(error),
                            unsent: Some(again),
                            elsewhere_only: true,
                        },
                        f => f.into_error().into(),
                    })
            }
        }
    }

    /// One try at sending on `sender`.
    async fn send_on(
        self: &Arc<Self>,
        sender: Sender,
        head: Head,
        body: RequestBody,
        attempt: Attempt<'_>,
        out: &mut Option<Exchange>,
    ) -> Result<(), Failure> {
        let Attempt {
            upstream,
            upgrade,
            now,
            pooled,
        } = attempt;
        let mut sender = match sender {
            Sender::Http2(_) if upgrade => return Err(Failure::Final(SendError::NoUpgrade)),
            Sender::Http2(mut sender) => {
                let request = head.request(Wire::Http2, upstream, body);
                let response = sender.send_request(request).await.map_err(|e| {
                    if sender.is_closed() {
                        self.forget_shared();
                    }
                    Failure::Final(SendError::Failed(e))
                })?;
                *out = Some(Exchange {
                    response,
                    release: None,
                    switched: None,
                });
                return Ok(());
            }
            Sender::Http1(sender) => sender,
        };
        // Kept to send again only if it may be: idempotent, no body.
        let again = (idempotent(&head.method) && body.is_end_stream()).then(|| KeptHead::of(&head));
        let request = head.request(Wire::Http1, upstream, body);
        let mut error = match sender.try_send_request(request).await {
            Ok(response) => {
                *out = Some(self.exchange(response, sender, upgrade, now));
                return Ok(());
            }
            Err(error) => error,
        };
        match (error.take_message(), again) {
            // Never written: safe to send anywhere, any method.
            (Some(request), _) if pooled => Err(Failure::Again(
                Box::new(Head::of(request)),
                error.into_error(),
            )),
            // Closed or reset before any answer: the keep-alive race, or an
            // endpoint going away.
            (None, Some(copy)) if broke_off(error.error()) => Err(Failure::Again(
                Box::new((copy.head(), RequestBody::empty())),
                error.into_error(),
            )),
            _ => Err(Failure::Final(SendError::Failed(error.into_error()))),
        }
    }

    fn exchange(
        self: &Arc<Self>,
        response: Response<Incoming>,
        sender: http1::SendRequest<RequestBody>,
        upgrade: bool,
        now: Instant,
    ) -> Exchange {
        // A connection that switched protocols is the tunnel's now.
        if upgrade && response.status() == http::StatusCode::SWITCHING_PROTOCOLS {
            return Exchange {
                response,
                release: None,
                switched: Some(sender),
            };
        }
        Exchange {
            response,
            release: Some(Release {
                sender,
                pool: Arc::clone(self),
                since: now,
            }),
            switched: None,
        }
    }

    /// An idle connection that is still open: the shared HTTP/2 one, or
    /// the most recently returned HTTP/1.1 one; none for an upgrade.
    fn checkout(&self, upgrade: bool, now: Instant) -> Option<Sender> {
        if upgrade {
            // Only a connection opened for it can switch protocols.
            return None;
        }
        if let Some(shared) = self.shared().as_ref()
            && !shared.is_closed()
        {
            return Some(Sender::Http2(shared.clone()));
        }
        loop {
            let idle = self.idle().pop()?;
            if idle.usable(now) {
                return Some(Sender::Http1(idle.sender));
            }
        }
    }

    /// A new connection; an HTTP/2 one is kept for every later request.
    /// While one that may be HTTP/2 is being opened, others wait for it and
    /// share it.
    async fn connect(&self, upstream: &Endpoint, upgrade: bool) -> Result<Sender, SendError> {
        let may_be_h2 = !upgrade
            && match upstream.protocol {
                Protocol::H2 | Protocol::H2c => true,
                Protocol::Auto => !self.http1_learned.load(Ordering::Relaxed),
                Protocol::Http1 => false,
            };
        let _opening = if may_be_h2 {
            let guard = self.opening.lock().await;
            if let Some(shared) = self.shared().as_ref()
                && !shared.is_closed()
            {
                return Ok(Sender::Http2(shared.clone()));
            }
            Some(guard)
        } else {
            None
        };
        // Boxed: connecting is rare and its future large.
        let sender = Box::pin(connect::connect(upstream, upgrade)).await?;
        match &sender {
            Sender::Http2(sender) => *self.shared() = Some(sender.clone()),
            Sender::Http1(_) if !upgrade => self.http1_learned.store(true, Ordering::Relaxed),
            Sender::Http1(_) => {}
        }
        Ok(sender)
    }

    fn forget_shared(&self) {
        let mut shared = self.shared();
        if shared.as_ref().is_some_and(http2::SendRequest::is_closed) {
            *shared = None;
        }
    }

    /// Returns a connection whose last request began at `since`: it is
    /// counted as idle from then, which errs toward closing it early.
    fn put_back(&self, sender: http1::SendRequest<RequestBody>, since: Instant) {
        let mut idle = self.idle();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { sender, since });
        }
    }
}

/// Methods whose request, sent twice, has the effect of sending it once
/// (RFC 9110 §9.2.2).
fn idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}
