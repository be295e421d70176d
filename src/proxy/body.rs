//! The two bodies a forwarded exchange streams: the client's request body
//! on its way upstream, and the upstream's response body on its way back.
//!
//! Each carries an idle timeout. A client that stops sending its body for
//! `client_body_timeout` fails its request with [`ClientBodyError::TimedOut`]
//! (the client's 408, never the upstream's 504); an upstream whose body
//! stalls for `upstream_body_timeout` is cut off. The response body also
//! hands its HTTP/1.1 connection back to the pool once it has been read to
//! the end.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus_client::metrics::counter::Counter;

use super::idle::IdleTimer;
use super::pool::Release;

/// Why a client's request body did not reach its end.
#[derive(Debug, thiserror::Error)]
pub enum ClientBodyError {
    /// Nothing arrived for `client_body_timeout`.
    #[error("the client sent nothing of its request body for {0:?}")]
    TimedOut(Duration),
    /// More than `max_request_body` bytes.
    #[error("the request body is larger than {0} bytes")]
    TooLarge(u64),
    /// Malformed, or the client went away.
    #[error("the request body broke off: {0}")]
    Broken(#[source] hyper::Error),
}

/// When a request body reached its end, in milliseconds since the
/// forwarding began (0 while it has not): the upstream's response-head
/// deadline runs from then, so that a slow upload is never the upstream's
/// 504.
#[derive(Debug, Default)]
pub struct Sent(AtomicU64);

impl Sent {
    /// How long after the forwarding began the body was sent whole; `None`
    /// while it is still being sent.
    pub fn at(&self) -> Option<Duration> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }
}

/// A request body on its way upstream.
#[derive(Debug)]
pub struct RequestBody {
    inner: Option<Incoming>,
    idle: IdleTimer,
    /// Most bytes it may carry, and how many it has.
    max: Option<u64>,
    seen: u64,
    /// Told when the body ends, for bodies that did not begin ended.
    sent: Option<(Arc<Sent>, tokio::time::Instant)>,
}

impl RequestBody {
    /// The client's `body`, failing after `idle` without data, or past
    /// `max` bytes. When the body has anything to send, the returned
    /// [`Sent`] says when it ended.
    pub fn new(
        body: Incoming,
        idle: std::time::Duration,
        max: Option<u64>,
    ) -> (Self, Option<Arc<Sent>>) {
        let sent = (!body.is_end_stream()).then(|| Arc::new(Sent::default()));
        let body = Self {
            inner: Some(body),
            idle: IdleTimer::new(idle),
            max,
            seen: 0,
            sent: sent
                .as_ref()
                .map(|s| (Arc::clone(s), tokio::time::Instant::now())),
        };
        (body, sent)
    }

    /// No body: a request sent again after its connection failed (only
    /// requests without a body are).
    pub fn empty() -> Self {
        Self {
            inner: None,
            idle: IdleTimer::new(Duration::MAX),
            max: None,
            seen: 0,
            sent: None,
        }
    }

    fn ended(&mut self) {
        if let Some((sent, began)) = self.sent.take() {
            let ms = began.elapsed().as_millis().max(1);
            sent.0
                .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Release);
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.idle.moved();
                if let (Some(max), Some(data)) = (this.max, frame.data_ref()) {
                    let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
                    this.seen = this.seen.saturating_add(len);
                    if this.seen > max {
                        // Not a byte past the limit goes upstream.
                        this.inner = None;
                        return Poll::Ready(Some(Err(ClientBodyError::TooLarge(max))));
                    }
                }
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.ended();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(ClientBodyError::Broken(e)))),
            Poll::Ready(None) => {
                this.ended();
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.idle.expired(cx) {
                    let timeout = this.idle.timeout();
                    return Poll::Ready(Some(Err(ClientBodyError::TimedOut(timeout))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

/// Why an upstream's response body did not reach its end.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamBodyError {
    /// Nothing arrived for `upstream_body_timeout`.
    #[error("the upstream sent nothing of its response body for {0:?}")]
    TimedOut(Duration),
    /// The connection broke or the framing was wrong.
    #[error("the upstream's response body broke off: {0}")]
    Broken(#[source] hyper::Error),
}

/// An upstream's response body on its way to the client.
#[derive(Debug)]
pub struct UpstreamBody {
    inner: Incoming,
    idle: IdleTimer,
    /// Counts the idle timeouts.
    timeouts: Counter,
    /// The HTTP/1.1 connection it came on, back to its pool at the end.
    release: Option<Release>,
}

impl UpstreamBody {
    /// `body`, cut after `idle` without data; `release` returns its
    /// connection once it has been read whole.
    /// The idle timeouts are counted in `timeouts`.
    pub fn new(
        body: Incoming,
        idle: Duration,
        release: Option<Release>,
        timeouts: Counter,
    ) -> Self {
        Self {
            inner: body,
            idle: IdleTimer::new(idle),
            timeouts,
            release,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = UpstreamBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamBodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.idle.moved();
                // Trailers are always last; the server may not poll past them.
                if (frame.is_trailers() || this.inner.is_end_stream())
                    && let Some(release) = this.release.take()
                {
                    release.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.release = None;
                Poll::Ready(Some(Err(UpstreamBodyError::Broken(e))))
            }
            Poll::Ready(None) => {
                if let Some(release) = this.release.take() {
                    release.finish();
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.idle.expired(cx) {
                    // The connection is mid-body: never reused.
                    this.release = None;
                    this.timeouts.inc();
                    tracing::warn!(timeout = ?this.idle.timeout(), "the upstream's response body stalled; cut off");
                    return Poll::Ready(Some(Err(UpstreamBodyError::TimedOut(
                        this.idle.timeout(),
                    ))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        // A body with nothing to read (HEAD, 204, 304, `Content-Length: 0`)
        // may never be polled; its connection is as reusable as any.
        if self.inner.is_end_stream()
            && let Some(release) = self.release.take()
        {
            release.finish();
        }
    }
}
