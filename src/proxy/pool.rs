//! Keep-alive HTTP/1.1 connections to upstreams, reused across requests.
//!
//! One pool per upstream `host:port`, shared by every route that names it
//! and kept across reloads. A connection goes back to its pool when the
//! response body it carried has been read to the end (or had none), so a
//! pooled connection is idle and takes the next request at once; a body
//! left half-read (the client went away) closes its connection instead.
//! Checkout is last-in first-out, so under light load a few connections stay
//! warm and the rest age out: idle connections older than [`IDLE_TIMEOUT`]
//! are dropped, at checkout and by [`Pools::sweep`].
//!
//! This is a deliberately small pool: compared with hyper-util's general
//! client it spends no hashing, boxing or extra task per request, which
//! matters on a proxy's hot path (see bench/RESULTS.md).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// How long an unused connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Idle connections kept per upstream; more are closed when returned.
pub const MAX_IDLE: usize = 256;

/// Time allowed to open a TCP connection to an upstream.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Sending a request found nothing to send it on.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be opened.
    Connect(std::io::Error),
    /// A connection took the request and failed before answering.
    Failed(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot connect: {e}"),
            Self::Failed(e) => write!(f, "{e}"),
        }
    }
}

/// Where a route's upstream keeps its pool once found: the pools outlive
/// reloads, the routes do not.
#[derive(Debug, Clone, Default)]
pub struct PoolSlot(Arc<OnceLock<Arc<Pool>>>);

/// Every upstream's pool, by `host:port`.
#[derive(Debug, Default)]
pub struct Pools {
    by_authority: Mutex<HashMap<Authority, Arc<Pool>>>,
}

impl Pools {
    /// The pool for `authority`, remembered in `slot`.
    pub fn get_in<'a>(&self, slot: &'a PoolSlot, authority: &Authority) -> &'a Arc<Pool> {
        slot.0.get_or_init(|| self.get(authority))
    }

    /// The pool for `authority`, created on first use. Called once per
    /// route and configuration, never per request.
    fn get(&self, authority: &Authority) -> Arc<Pool> {
        let mut all = self
            .by_authority
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(
            all.entry(authority.clone())
                .or_insert_with(|| Arc::new(Pool::new(authority.clone()))),
        )
    }

    /// Drops idle connections past [`IDLE_TIMEOUT`] and closed ones, in
    /// every pool (including those of upstreams no route names any more).
    pub fn sweep(&self) {
        let pools: Vec<Arc<Pool>> = self
            .by_authority
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        let now = Instant::now();
        for pool in pools {
            pool.idle().retain(|c| c.usable(now));
        }
    }
}

/// Idle connections to one upstream.
#[derive(Debug)]
pub struct Pool {
    authority: Authority,
    idle: Mutex<Vec<Idle>>,
}

#[derive(Debug)]
struct Idle {
    sender: SendRequest<Incoming>,
    since: Instant,
}

impl Idle {
    fn usable(&self, now: Instant) -> bool {
        !self.sender.is_closed() && now.saturating_duration_since(self.since) < IDLE_TIMEOUT
    }
}

impl Pool {
    fn new(authority: Authority) -> Self {
        Self {
            authority,
            idle: Mutex::new(Vec::new()),
        }
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sends `request` (origin-form target, `Host` set) on an idle
    /// connection, or a new one. A request that an idle connection refused
    /// unsent (the upstream had just closed it) is sent on the next one; a
    /// request that was sent is never repeated. `now` is when the request
    /// began: connections are judged idle, and later count as idle, from it.
    pub async fn send(
        self: &Arc<Self>,
        mut request: Request<Incoming>,
        now: Instant,
    ) -> Result<Response<PooledBody>, SendError> {
        loop {
            let (mut sender, fresh) = match self.checkout(now).await {
                Some(sender) => (sender, false),
                // Boxed: connecting is rare and its future large.
                None => (
                    Box::pin(self.connect()).await.map_err(SendError::Connect)?,
                    true,
                ),
            };
            match sender.try_send_request(request).await {
                Ok(response) => {
                    let pool = Arc::clone(self);
                    return Ok(response.map(|body| PooledBody::new(body, sender, pool, now)));
                }
                Err(mut e) => match e.take_message() {
                    Some(unsent) if !fresh => request = unsent,
                    _ => return Err(SendError::Failed(e.into_error())),
                },
            }
        }
    }

    /// The most recently returned connection that is still open.
    async fn checkout(&self, now: Instant) -> Option<SendRequest<Incoming>> {
        loop {
            let idle = self.idle().pop()?;
            if !idle.usable(now) {
                continue;
            }
            let mut sender = idle.sender;
            // Returned after its response ended, so this is ready at once or
            // as soon as its connection task has seen the end.
            if sender.ready().await.is_ok() {
                return Some(sender);
            }
        }
    }

    async fn connect(&self) -> std::io::Result<SendRequest<Incoming>> {
        let connecting = async {
            if self.authority.port().is_some() {
                TcpStream::connect(self.authority.as_str()).await
            } else {
                TcpStream::connect((self.authority.host().trim_matches(['[', ']']), 80)).await
            }
        };
        let stream = tokio::time::timeout(CONNECT_TIMEOUT, connecting)
            .await
            .map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::TimedOut, "connect timed out")
            })??;
        stream.set_nodelay(true)?;
        let (sender, connection) = http1::Builder::new()
            // One buffer and one write per request, as toward clients (see
            // server.rs).
            .writev(false)
            .handshake(TokioIo::new(stream))
            .await
            .map_err(std::io::Error::other)?;
        let authority = self.authority.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(upstream = %authority, error = %e, "upstream connection ended");
            }
        });
        Ok(sender)
    }

    /// Returns a connection whose last request began at `since`: it is
    /// counted as idle from then, which errs toward closing it early.
    fn put_back(&self, sender: SendRequest<Incoming>, since: Instant) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { sender, since });
        }
    }
}

/// An upstream response body that hands its connection back to the pool
/// once read to the end.
#[derive(Debug)]
pub struct PooledBody {
    inner: Incoming,
    /// The connection, until it is returned or dropped.
    connection: Option<(SendRequest<Incoming>, Arc<Pool>)>,
    /// When the request began.
    since: Instant,
    ended: bool,
}

impl PooledBody {
    fn new(
        inner: Incoming,
        sender: SendRequest<Incoming>,
        pool: Arc<Pool>,
        since: Instant,
    ) -> Self {
        Self {
            inner,
            connection: Some((sender, pool)),
            since,
            ended: false,
        }
    }

    fn release(&mut self) {
        if let Some((sender, pool)) = self.connection.take() {
            pool.put_back(sender, self.since);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                self.ended = true;
                self.release();
            }
            Poll::Ready(Some(Err(_))) => {
                // The connection is broken; never reuse it.
                self.connection = None;
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body never polled because it was empty (HEAD, 204, 304,
        // `Content-Length: 0`) also leaves its connection reusable.
        if self.ended || self.inner.is_end_stream() {
            self.release();
        }
    }
}
