//! The upstream's response body on its way back, with an idle timeout: an
//! upstream whose body stalls for `upstream_body_timeout` is cut off. It
//! hands its HTTP/1.1 connection back to the pool once it has been read to
//! the end.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use prometheus_client::metrics::counter::Counter;

use super::idle::IdleTimer;
use super::pool::Release;

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

/// A body's first frame, kept small: the body moves with its answer.
#[derive(Debug)]
enum First {
    Data(Bytes),
    /// Trailers first (a body with no data): rare, so boxed.
    Trailers(Box<Frame<Bytes>>),
}

impl First {
    fn of(frame: Frame<Bytes>) -> Self {
        match frame.into_data() {
            Ok(data) => Self::Data(data),
            Err(frame) => Self::Trailers(Box::new(frame)),
        }
    }

    fn frame(self) -> Frame<Bytes> {
        match self {
            Self::Data(data) => Frame::data(data),
            Self::Trailers(frame) => *frame,
        }
    }

    fn len(&self) -> usize {
        match self {
            Self::Data(data) => data.len(),
            Self::Trailers(_) => 0,
        }
    }
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
    /// The first frame, read before the answer went out.
    first: Option<First>,
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
            first: None,
        }
    }

    /// Reads the body's first frame before any of the answer goes out, so
    /// that a body that breaks before its first byte is the caller's `502`
    /// rather than a connection cut with nothing sent. The frame read is
    /// sent first. It waits as the body's own idle timeout allows: most
    /// answers' first bytes come with their head.
    pub async fn read_first(&mut self) -> Result<(), UpstreamBodyError> {
        if self.inner.is_end_stream() {
            return Ok(());
        }
        match std::future::poll_fn(|cx| self.poll_inner(cx)).await {
            Some(Ok(frame)) => {
                self.first = Some(First::of(frame));
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Ok(()),
        }
    }

    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamBodyError>>> {
        let this = self;
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
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = UpstreamBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamBodyError>>> {
        if let Some(first) = self.first.take() {
            return Poll::Ready(Some(Ok(first.frame())));
        }
        self.poll_inner(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let hint = self.inner.size_hint();
        let Some(len) = self.first.as_ref().map(First::len) else {
            return hint;
        };
        let len = len as u64;
        let mut with_first = SizeHint::new();
        with_first.set_lower(hint.lower() + len);
        if let Some(upper) = hint.upper() {
            with_first.set_upper(upper + len);
        }
        with_first
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
