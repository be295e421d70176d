//! Opening a connection to an upstream: TCP within `upstream_connect_timeout`,
//! TLS with rustls for `https://` upstreams (the upstream's host as SNI
//! unless `server_name` says otherwise, ALPN for the protocol), then hyper's
//! HTTP/1.1 or HTTP/2 client handshake. The connection itself runs on a task
//! of its own; what comes back is hyper's handle to send requests on it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::request_body::RequestBody;
use super::settings::{Endpoint, Protocol};

/// A connection's request sender, by the protocol it speaks.
#[derive(Debug)]
pub enum Sender {
    /// HTTP/1.1: one exchange at a time.
    Http1(http1::SendRequest<RequestBody>),
    /// HTTP/2: many streams at once; cloned for each.
    Http2(http2::SendRequest<RequestBody>),
}

/// Why no connection could be opened.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// TCP failed (refused, unreachable, no such host).
    #[error("cannot connect: {0}")]
    Tcp(#[source] std::io::Error),
    /// TCP and TLS together took longer than `upstream_connect_timeout`.
    #[error("connecting took longer than {0:?}")]
    TimedOut(Duration),
    /// The TLS handshake failed; rustls's reason says why (an unknown
    /// issuer, a name mismatch, an expired certificate).
    #[error("TLS handshake failed: {0}")]
    Tls(#[source] std::io::Error),
    /// The HTTP/2 handshake failed.
    #[error("HTTP handshake failed: {0}")]
    Handshake(#[source] hyper::Error),
}

/// Opens a connection to `upstream`; one that speaks HTTP/1.1 whatever the
/// upstream's protocol when `http1_only` (for upgrades, which HTTP/2 does
/// not carry the HTTP/1.1 way).
pub async fn connect(upstream: &Endpoint, http1_only: bool) -> Result<Sender, ConnectError> {
    let timeout = upstream.connect_timeout;
    tokio::time::timeout(timeout, open(upstream, http1_only))
        .await
        .map_err(|_| ConnectError::TimedOut(timeout))?
}

async fn open(upstream: &Endpoint, http1_only: bool) -> Result<Sender, ConnectError> {
    let authority = &upstream.authority;
    let port = authority.port_u16().unwrap_or(upstream.default_port());
    let host = authority.host().trim_matches(['[', ']']);
    let tcp = TcpStream::connect((host, port))
        .await
        .map_err(ConnectError::Tcp)?;
    let _ = tcp.set_nodelay(true);
    let Some(tls) = &upstream.tls else {
        let h2 = upstream.protocol == Protocol::H2c && !http1_only;
        return handshake(TokioIo::new(LateWriteError::new(tcp)), h2, http1_only).await;
    };
    let config = if http1_only {
        &tls.http1_config
    } else {
        &tls.config
    };
    let stream = tokio_rustls::TlsConnector::from(std::sync::Arc::clone(config))
        .connect(tls.server_name.clone(), tcp)
        .await
        .map_err(ConnectError::Tls)?;
    let h2 = !http1_only
        && match upstream.protocol {
            Protocol::H2 => true,
            Protocol::Auto => stream.get_ref().1.alpn_protocol() == Some(b"h2"),
            Protocol::Http1 | Protocol::H2c => false,
        };
    handshake(TokioIo::new(LateWriteError::new(stream)), h2, http1_only).await
}

/// hyper's client handshake on `io`; the connection is driven by a task of
/// its own until it closes.
async fn handshake<I>(io: I, h2: bool, upgradable: bool) -> Result<Sender, ConnectError>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    if h2 {
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(io)
            .await
            .map_err(ConnectError::Handshake)?;
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
            }
        });
        Ok(Sender::Http2(sender))
    } else {
        let (sender, connection) = http1::Builder::new()
            .handshake(io)
            .await
            .map_err(ConnectError::Handshake)?;
        // Only a connection opened for an upgrade is made able to carry one:
        // the wrapper costs every poll something.
        if upgradable {
            tokio::spawn(async move {
                if let Err(e) = connection.with_upgrades().await {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
            });
        } else {
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "upstream connection ended with an error");
                }
            });
        }
        Ok(Sender::Http1(sender))
    }
}

/// An upstream connection whose first failed write is reported only once
/// the read side has had its say, so that an answer the upstream sent
/// before it closed is read first.
///
/// An upstream that refuses an upload answers (413, 401) and closes while
/// floodgate is still sending the body; the close turns the next write into
/// a reset. The answer is already in the socket's receive buffer, readable
/// before the error, but hyper stops at the first failed write, often before
/// the reactor has even said the socket is readable. So a failed write
/// waits until a read completes (the answer, the end of the stream or its
/// error; a reset socket always becomes readable), or at most
/// [`READ_GRACE`], and fails then.
struct LateWriteError<T> {
    io: T,
    failed: Option<Failed>,
}

struct Failed {
    error: std::io::Error,
    /// A read completed since the write failed.
    read: bool,
    grace: Pin<Box<tokio::time::Sleep>>,
}

/// Longest a failed write waits for the read side.
const READ_GRACE: Duration = Duration::from_secs(1);

impl<T> LateWriteError<T> {
    fn new(io: T) -> Self {
        Self { io, failed: None }
    }

    /// A write's outcome, `polled` (or `None` once one has failed).
    fn outcome<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Option<Poll<std::io::Result<R>>>,
    ) -> Poll<std::io::Result<R>> {
        if let Some(Poll::Ready(Err(error))) = polled {
            self.failed = Some(Failed {
                error,
                read: false,
                grace: Box::pin(tokio::time::sleep(READ_GRACE)),
            });
        } else if let Some(polled) = polled {
            return polled;
        }
        let Some(failed) = &mut self.failed else {
            return Poll::Pending;
        };
        if failed.read || failed.grace.as_mut().poll(cx).is_ready() {
            let error = std::mem::replace(
                &mut failed.error,
                std::io::Error::from(std::io::ErrorKind::BrokenPipe),
            );
            return Poll::Ready(Err(error));
        }
        Poll::Pending
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for LateWriteError<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if polled.is_ready()
            && let Some(failed) = &mut self.failed
            && !failed.read
        {
            failed.read = true;
            // The write side waits on this.
            cx.waker().wake_by_ref();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for LateWriteError<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = self
            .failed
            .is_none()
            .then(|| Pin::new(&mut self.io).poll_write(cx, buf));
        self.outcome(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let polled = self
            .failed
            .is_none()
            .then(|| Pin::new(&mut self.io).poll_write_vectored(cx, bufs));
        self.outcome(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = self
            .failed
            .is_none()
            .then(|| Pin::new(&mut self.io).poll_flush(cx));
        self.outcome(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
