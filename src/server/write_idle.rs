//! A client that stops reading its answer is cut off: every write may wait
//! at most `client_write_timeout` for the client to read.

use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

/// How long a client may leave written data unread, and where the cuts
/// are counted.
#[derive(Debug, Clone)]
pub struct WriteTimeout {
    /// The time allowed.
    pub after: Duration,
    /// Counts the connections cut.
    pub timeouts: prometheus_client::metrics::counter::Counter,
}

/// A client connection that fails a write which has waited `timeout` for
/// the client to read: a client that stops reading is cut off, and the
/// upstream exchange it held is dropped with it.
pub struct WriteIdle<T> {
    pub(super) io: T,
    idle: crate::proxy::IdleTimer,
    timeouts: prometheus_client::metrics::counter::Counter,
}

impl<T> WriteIdle<T> {
    pub(super) fn new(io: T, write_timeout: &WriteTimeout) -> Self {
        Self {
            io,
            idle: crate::proxy::IdleTimer::new(write_timeout.after),
            timeouts: write_timeout.timeouts.clone(),
        }
    }

    /// `polled`, a write's outcome: a write still waiting after the
    /// timeout is an error.
    fn watch<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        polled: Poll<std::io::Result<R>>,
    ) -> Poll<std::io::Result<R>> {
        match polled {
            Poll::Pending if self.idle.expired(cx) => {
                self.timeouts.inc();
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the client read nothing for client_write_timeout",
                )))
            }
            Poll::Pending => Poll::Pending,
            ready => {
                self.idle.moved();
                ready
            }
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteIdle<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteIdle<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
