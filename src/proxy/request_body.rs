//! The client's request body on its way upstream, with an idle timeout: a
//! client that stops sending its body for `client_body_timeout` fails its
//! request with [`ClientBodyError::TimedOut`] (the client's 408, never the
//! upstream's 504), and one past `max_request_body` with
//! [`ClientBodyError::TooLarge`].

use std::collections::VecDeque;
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
    /// Slower on average than `client_body_min_rate` (bytes a second) once
    /// `client_body_min_rate_after` had passed.
    #[error("the client sent its request body slower than {0} bytes a second")]
    TooSlow(u64),
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

/// A request body on its way upstream: nothing for a request that came
/// without one (most do), so that what moves with every request head, on
/// its way through the pool and hyper's dispatch, is a pointer.
#[derive(Debug)]
pub struct RequestBody(Option<Box<Streaming>>);

/// A body that had something to send when forwarding began.
#[derive(Debug)]
struct Streaming {
    inner: Option<Incoming>,
    /// Frames read ahead (see [`RequestBody::read_ahead`]), sent first.
    ahead: VecDeque<Frame<Bytes>>,
    idle: IdleTimer,
    /// Most bytes it may carry, and how many it has.
    max: Option<u64>,
    seen: u64,
    /// The slowest it may arrive on average, in bytes a second, after the
    /// grace (0: any rate).
    min_rate: u64,
    grace: Duration,
    /// Told when the body ends; and when it began.
    sent: Option<(Arc<Sent>, tokio::time::Instant)>,
}

impl RequestBody {
    /// The client's `body`, failing as `client` says: after its idle
    /// timeout without data, past its largest size, or slower than its
    /// minimum rate. When the body has anything to send, the returned
    /// [`Sent`] says when it ended.
    pub fn new(body: Incoming, client: &super::ClientSide) -> (Self, Option<Arc<Sent>>) {
        if body.is_end_stream() {
            return (Self::empty(), None);
        }
        let sent = Arc::new(Sent::default());
        let body = Streaming {
            inner: Some(body),
            ahead: VecDeque::new(),
            idle: IdleTimer::new(client.body),
            max: client.max_body,
            seen: 0,
            min_rate: client.min_rate,
            grace: client.min_rate_after,
            sent: Some((Arc::clone(&sent), tokio::time::Instant::now())),
        };
        (Self(Some(Box::new(body))), Some(sent))
    }

    /// No body: a request that came without one, or one sent again after
    /// its connection failed (only requests without a body are).
    pub fn empty() -> Self {
        Self(None)
    }

    /// Reads the body ahead, before any upstream connection is taken, until
    /// it ends or more than `limit` bytes have come (the rest then streams
    /// as usual): a small upload that trickles in holds no upstream
    /// connection. The client's faults (stalled, too slow, too large,
    /// broken) come back as they happen.
    pub async fn read_ahead(&mut self, limit: u64) -> Result<(), ClientBodyError> {
        self.read_ahead_inner(limit).await
    }

    /// The bytes read ahead so far, in order.
    pub fn read(&self) -> impl Iterator<Item = &Bytes> {
        self.0
            .iter()
            .flat_map(|body| body.ahead.iter().filter_map(Frame::data_ref))
    }

    /// Replaces the data read ahead of a body read whole with `bytes` (a
    /// rewritten body); false, changing nothing, for one not read whole.
    pub fn replace_read(&mut self, bytes: Bytes) -> bool {
        if !self.read_whole() {
            return false;
        }
        let Some(body) = self.0.as_deref_mut() else {
            return false;
        };
        body.ahead.retain(|frame| !frame.is_data());
        body.ahead.push_front(Frame::data(bytes));
        true
    }

    /// Whether everything the body carries has been read ahead (or it
    /// carries nothing).
    pub fn read_whole(&self) -> bool {
        self.0
            .as_deref()
            .is_none_or(|body| body.inner.as_ref().is_none_or(Body::is_end_stream))
    }

    async fn read_ahead_inner(&mut self, limit: u64) -> Result<(), ClientBodyError> {
        let Some(body) = self.0.as_deref_mut() else {
            return Ok(());
        };
        if body.inner.as_ref().is_none_or(Body::is_end_stream) || body.size_hint().lower() > limit {
            return Ok(());
        }
        let mut read = 0u64;
        while read <= limit {
            match std::future::poll_fn(|cx| body.poll_inner(cx)).await {
                Some(Ok(frame)) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                    body.ahead.push_back(frame);
                }
                Some(Err(e)) => return Err(e),
                None => break,
            }
            if body.inner.as_ref().is_none_or(Body::is_end_stream) {
                break;
            }
        }
        Ok(())
    }
}

impl Streaming {
    fn size_hint(&self) -> SizeHint {
        let hint = self
            .inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        if self.ahead.is_empty() {
            return hint;
        }
        let ahead: u64 = self
            .ahead
            .iter()
            .filter_map(Frame::data_ref)
            .map(|d| d.len() as u64)
            .sum();
        let mut with_ahead = SizeHint::new();
        with_ahead.set_lower(hint.lower() + ahead);
        if let Some(upper) = hint.upper() {
            with_ahead.set_upper(upper + ahead);
        }
        with_ahead
    }

    /// Whether, `seen` bytes in, the body is slower than its minimum rate.
    fn too_slow(&self) -> bool {
        let Some((_, began)) = &self.sent else {
            return false;
        };
        if self.min_rate == 0 {
            return false;
        }
        let took = began.elapsed();
        took > self.grace && (self.seen as f64) < self.min_rate as f64 * took.as_secs_f64()
    }

    fn ended(&mut self) {
        if let Some((sent, began)) = self.sent.take() {
            let ms = began.elapsed().as_millis().max(1);
            sent.0
                .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Release);
        }
    }

    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let this = self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        match Pin::new(inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                this.idle.moved();
                if let Some(data) = frame.data_ref() {
                    let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
                    this.seen = this.seen.saturating_add(len);
                    if let Some(max) = this.max
                        && this.seen > max
                    {
                        // Not a byte past the limit goes upstream.
                        this.inner = None;
                        return Poll::Ready(Some(Err(ClientBodyError::TooLarge(max))));
                    }
                }
                if this.inner.as_ref().is_some_and(Body::is_end_stream) {
                    this.ended();
                } else if this.too_slow() {
                    this.inner = None;
                    return Poll::Ready(Some(Err(ClientBodyError::TooSlow(this.min_rate))));
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
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ClientBodyError>>> {
        let Some(body) = self.get_mut().0.as_deref_mut() else {
            return Poll::Ready(None);
        };
        if let Some(frame) = body.ahead.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        body.poll_inner(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_deref().is_none_or(|body| {
            body.ahead.is_empty() && body.inner.as_ref().is_none_or(Body::is_end_stream)
        })
    }

    fn size_hint(&self) -> SizeHint {
        self.0
            .as_deref()
            .map_or_else(|| SizeHint::with_exact(0), Streaming::size_hint)
    }
}
