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
//! matters on a proxy's hot path (see bench/RESULTS.md). Requests are
//! written and answers read by [`super::http1`], from the client's task.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Response, request};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::net::TcpStream;

use super::Rewrite;
use super::http1::{self, Connection, Framing};

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
    Failed(http1::Error),
    /// The deadline passed before the answer's head arrived.
    TimedOut,
}

impl From<http1::Error> for SendError {
    fn from(e: http1::Error) -> Self {
        match e {
            http1::Error::TimedOut => Self::TimedOut,
            e => Self::Failed(e),
        }
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(e) => write!(f, "cannot connect: {e}"),
            Self::Failed(e) => write!(f, "{e}"),
            Self::TimedOut => f.write_str("the upstream did not answer in time"),
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
    connection: Box<Connection>,
    since: Instant,
}

impl Idle {
    fn usable(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.since) < IDLE_TIMEOUT && !self.connection.is_closed()
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

    /// Sends the request with head `request` (origin-form target) and
    /// `body`, its headers changed by `rewrite`, on an idle connection or a
    /// new one, and reads the answer's head (see [`Connection::send`]).
    ///
    /// An idle connection is checked before the request goes out on it
    /// (the upstream may have closed it). If the upstream closes it anyway
    /// as the request arrives, a request without a body and with an
    /// idempotent method is sent once more on a new connection; any other
    /// is not repeated. `now` is when the request began: connections are
    /// judged idle, and later count as idle, from it. Past `deadline`
    /// (connecting included) the answer is [`SendError::TimedOut`].
    pub async fn send(
        self: &Arc<Self>,
        request: &mut request::Parts,
        body: Incoming,
        rewrite: &Rewrite<'_>,
        now: Instant,
        deadline: tokio::time::Instant,
    ) -> Result<Response<PooledBody>, SendError> {
        let (mut connection, pooled) = match self.checkout(now) {
            Some(connection) => (connection, true),
            None => (self.connect_by(deadline).await?, false),
        };
        let answer = match connection.send(request, body, rewrite, deadline).await {
            Ok(answer) => answer,
            Err(e) if pooled && connection.may_resend(&e) => {
                // The upstream closed this idle connection as the request
                // reached it (too late for the check at checkout to see):
                // the request goes once more, on a new connection.
                tracing::debug!(
                    upstream = %self.authority,
                    error = %e,
                    "a pooled connection closed as the request arrived; sending it again"
                );
                let mut fresh = self.connect_by(deadline).await?;
                let answer = fresh.resend(&mut connection, deadline).await;
                connection = fresh;
                answer.map_err(SendError::from)?
            }
            Err(e) => return Err(e.into()),
        };
        let body = PooledBody {
            connection: Some(connection),
            framing: answer.body,
            reusable: answer.reusable,
            pool: Arc::clone(self),
            since: now,
            broken: None,
        };
        Ok(Response::from_parts(answer.head, body))
    }

    /// A new connection, unless `deadline` comes first.
    async fn connect_by(
        &self,
        deadline: tokio::time::Instant,
    ) -> Result<Box<Connection>, SendError> {
        // Boxed: connecting is rare and its future large.
        tokio::time::timeout_at(deadline, Box::pin(self.connect()))
            .await
            .map_err(|_| SendError::TimedOut)?
            .map_err(SendError::Connect)
    }

    /// The most recently returned connection that is still open.
    fn checkout(&self, now: Instant) -> Option<Box<Connection>> {
        loop {
            let idle = self.idle().pop()?;
            if idle.usable(now) {
                return Some(idle.connection);
            }
        }
    }

    /// A new connection, boxed so that handing it between the pool, the
    /// exchange and the response body moves a pointer.
    async fn connect(&self) -> std::io::Result<Box<Connection>> {
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
        Ok(Box::new(Connection::new(stream)))
    }

    /// Returns a connection whose last request began at `since`: it is
    /// counted as idle from then, which errs toward closing it early.
    fn put_back(&self, connection: Box<Connection>, since: Instant) {
        let mut idle = self.idle();
        if idle.len() < MAX_IDLE {
            idle.push(Idle { connection, since });
        }
    }
}

/// An upstream response body, read from its connection as the client's
/// side asks for it; the connection goes back to the pool once the body has
/// been read to the end, if it can carry another request.
#[derive(Debug)]
pub struct PooledBody {
    /// The connection, until it is returned or dropped.
    connection: Option<Box<Connection>>,
    framing: Framing,
    reusable: bool,
    pool: Arc<Pool>,
    /// When the request began.
    since: Instant,
    /// The connection broke; reported on the next poll, after the client's
    /// side has sent what came before it.
    broken: Option<http1::Error>,
}

impl PooledBody {
    fn release(&mut self) {
        if let Some(connection) = self.connection.take()
            && self.reusable
        {
            self.pool.put_back(connection, self.since);
        }
    }
}

impl Body for PooledBody {
    type Data = Bytes;
    type Error = http1::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, http1::Error>>> {
        let this = &mut *self;
        if let Some(e) = this.broken.take() {
            return Poll::Ready(Some(Err(e)));
        }
        let Some(connection) = this.connection.as_mut() else {
            return Poll::Ready(None);
        };
        match this.framing.poll_next(connection, cx) {
            Poll::Ready(None) => {
                this.release();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(data))) => {
                if this.framing.is_done() {
                    this.release();
                }
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            Poll::Ready(Some(Err(e))) => {
                // The connection is broken; never reuse it. The error waits
                // one poll, so that what was read before it (the head, and
                // data already read along with it) goes out first and the
                // client sees an answer cut short rather than none.
                this.connection = None;
                this.broken = Some(e);
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.framing.is_done()
    }

    fn size_hint(&self) -> SizeHint {
        http1::size_hint(self.framing)
    }
}

impl Drop for PooledBody {
    fn drop(&mut self) {
        // A body never polled because it was empty (HEAD, 204, 304,
        // `Content-Length: 0`) also leaves its connection reusable.
        if self.framing.is_done() {
            self.release();
        }
    }
}
