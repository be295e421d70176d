//! Upgraded connections (WebSocket and the like). The `Upgrade` request goes
//! upstream on an HTTP/1.1 connection; once the upstream answers 101, the
//! client's connection and the upstream's are spliced byte for byte until
//! either side closes, or neither sends anything for `upgrade_idle_timeout`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::HeaderMap;
use http::header::{CONNECTION, UPGRADE};
use hyper::client::conn::http1::SendRequest;
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::idle::IdleTimer;
use super::request_body::RequestBody;

/// Whether `headers` ask to switch protocols: an `Upgrade` field, and
/// `upgrade` among the `Connection` options.
pub fn requested(headers: &HeaderMap) -> bool {
    headers.contains_key(UPGRADE)
        && headers.get_all(CONNECTION).iter().any(|value| {
            value
                .as_bytes()
                .split(|&b| b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"upgrade"))
        })
}

/// Splices the client's connection and the upstream's once both have
/// switched, on a task of its own that holds `hold` (the client
/// connection's place among the open connections) until the tunnel ends;
/// a tunnel closed for idling is counted in `idle_timeouts`. `sender` is
/// the upstream connection's, kept until the upgrade completes.
pub fn splice<H: Send + 'static>(
    client: OnUpgrade,
    upstream: OnUpgrade,
    sender: Option<SendRequest<RequestBody>>,
    idle: Duration,
    idle_timeouts: Counter,
    hold: H,
) {
    tokio::spawn(async move {
        let _hold = hold;
        // The upstream connection's sender lives until the upgrade is
        // done: with it gone, hyper would close the connection first.
        let (client, upstream) = match tokio::join!(client, upstream) {
            (Ok(client), Ok(upstream)) => {
                drop(sender);
                (client, upstream)
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::debug!(error = %e, "an upgrade did not complete");
                return;
            }
        };
        let moved = Arc::new(AtomicBool::new(false));
        let mut client = Watched {
            io: TokioIo::new(client),
            moved: Arc::clone(&moved),
        };
        let mut upstream = Watched {
            io: TokioIo::new(upstream),
            moved: Arc::clone(&moved),
        };
        let mut copy = std::pin::pin!(tokio::io::copy_bidirectional(&mut client, &mut upstream));
        let mut timer = IdleTimer::new(idle);
        let ended = std::future::poll_fn(|cx| match copy.as_mut().poll(cx) {
            Poll::Ready(result) => Poll::Ready(Some(result)),
            Poll::Pending => {
                if moved.swap(false, Ordering::Relaxed) {
                    timer.moved();
                }
                if timer.expired(cx) {
                    Poll::Ready(None)
                } else {
                    Poll::Pending
                }
            }
        })
        .await;
        match ended {
            Some(Ok((up, down))) => {
                tracing::debug!(up, down, "upgraded connection closed");
            }
            Some(Err(e)) => tracing::debug!(error = %e, "upgraded connection broke off"),
            None => {
                idle_timeouts.inc();
                tracing::debug!(?idle, "upgraded connection idle too long; closed");
            }
        }
    });
}

/// An I/O object that notes when bytes arrive.
struct Watched<T> {
    io: T,
    moved: Arc<AtomicBool>,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.moved.store(true, Ordering::Relaxed);
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn an_upgrade_needs_both_fields() {
        let mut h = HeaderMap::new();
        h.insert(UPGRADE, HeaderValue::from_static("websocket"));
        assert!(!requested(&h));
        h.insert(CONNECTION, HeaderValue::from_static("keep-alive, Upgrade"));
        assert!(requested(&h));
        h.remove(UPGRADE);
        assert!(!requested(&h));
    }
}
