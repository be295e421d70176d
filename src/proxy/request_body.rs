//! The client's request body on its way upstream, with an idle timeout: a
//! client that stops sending its body for `client_body_timeout` fails its
//! request with [`ClientBodyError::TimedOut`] (the client's 408, never the
//! upstream's 504), and one past `max_request_body` with
//! [`ClientBodyError::TooLarge`].

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::idle::IdleTimer;

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
