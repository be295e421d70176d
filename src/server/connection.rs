//! One client connection's life: which protocol it speaks, the deadline for
//! its first request head, and finishing its requests when floodgate shuts
//! down.
//!
//! The protocol is told from the client's first bytes, read with `MSG_PEEK`
//! so that they stay for hyper, which then serves the connection with its
//! HTTP/1 or HTTP/2 connection directly. (hyper-util's protocol detection
//! reads them itself and wraps every later read and write of the connection
//! to replay them: work on every request, for a question settled once.)
//!
//! Shutdown is a flag read on each poll, and one wakeup registered per
//! connection, rather than a watch future polled along with every request.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::server::conn::http2;
use hyper::service::Service;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::GracefulConnection;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Sleep;

/// What every HTTP/2 connection sends first (RFC 9113 §3.4).
const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How connections are served: built once, shared by all of them.
#[derive(Debug)]
pub struct Protocols {
    /// HTTP/1 connections.
    pub http1: http1::Builder,
    /// HTTP/2 connections (prior knowledge: `h2c` without upgrade).
    pub http2: http2::Builder<TokioExecutor>,
    /// How long a client may take to send its first request head.
    pub first_head_timeout: Duration,
}

/// The connections being served, so that shutdown can ask each one to
/// finish its requests and then wait until all have.
#[derive(Debug, Default)]
pub struct Connections {
    closing: AtomicBool,
    /// Woken once, when shutdown begins.
    close: Notify,
    live: AtomicUsize,
    /// Woken when the last connection has ended.
    none_left: Notify,
}

impl Connections {
    /// Counts a new connection as open until the returned guard is dropped.
    pub fn open(self: &Arc<Self>, gauge: Gauge) -> Open {
        self.live.fetch_add(1, Ordering::SeqCst);
        gauge.inc();
        Open {
            connections: Arc::clone(self),
            gauge,
        }
    }

    /// Connections open now.
    pub fn count(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Asks every connection, and every one opened from now on, to finish
    /// its requests in flight and close.
    pub fn close_all(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.close.notify_waiters();
    }

    /// Completes once no connection is open.
    pub async fn all_closed(&self) {
        loop {
            let mut wake = pin!(self.none_left.notified());
            wake.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            wake.await;
        }
    }
}

/// An open connection, counted until dropped.
#[derive(Debug)]
pub struct Open {
    connections: Arc<Connections>,
    gauge: Gauge,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.gauge.dec();
        if self.connections.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.connections.none_left.notify_waiters();
        }
    }
}

/// How a connection ended.
pub enum Ended {
    /// Served until the client or shutdown closed it; hyper's error, if any.
    Served(Option<Box<dyn StdError + Send + Sync>>),
    /// The first request head did not arrive in time.
    FirstHeadTimedOut,
}

/// Serves `stream` with `service` until the connection ends. `started` is
/// set by the service when a request arrives, which ends the first-head
/// deadline.
pub async fn serve<S, B>(
    stream: TcpStream,
    service: S,
    started: &AtomicBool,
    protocols: &Protocols,
    connections: &Connections,
) -> Ended
where
    S: Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let mut deadline = pin!(Some(tokio::time::sleep(protocols.first_head_timeout)));
    let mut close = pin!(connections.close.notified());
    close.as_mut().enable();
    if connections.closing.load(Ordering::Acquire) {
        return Ended::Served(None);
    }

    let protocol = tokio::select! {
        biased;
        () = &mut close => return Ended::Served(None),
        () = until(deadline.as_mut()) => return Ended::FirstHeadTimedOut,
        protocol = protocol(&stream) => protocol,
    };
    let io = TokioIo::new(stream);
    match protocol {
        // Closed, or reset, before sending anything.
        Ok(None) | Err(_) => Ended::Served(None),
        Ok(Some(Protocol::Http1)) => {
            let connection = protocols.http1.serve_connection(io, service);
            drive(connection, started, deadline, close, connections).await
        }
        Ok(Some(Protocol::Http2)) => {
            let connection = protocols.http2.serve_connection(io, service);
            drive(connection, started, deadline, close, connections).await
        }
    }
}

enum Protocol {
    Http1,
    Http2,
}

/// The protocol `stream`'s client speaks, from its first bytes, which are
/// left unread; nothing if it closed without sending any.
async fn protocol(stream: &TcpStream) -> std::io::Result<Option<Protocol>> {
    let mut first = [0u8; HTTP2_PREFACE.len()];
    let mut pause = Duration::from_millis(1);
    loop {
        let n = stream.peek(&mut first).await?;
        if n == 0 {
            return Ok(None);
        }
        if !HTTP2_PREFACE.starts_with(&first[..n]) {
            return Ok(Some(Protocol::Http1));
        }
        if n == HTTP2_PREFACE.len() {
            return Ok(Some(Protocol::Http2));
        }
        // Part of the preface (or an HTTP/1 request that begins like it,
        // such as "P"): wait for more. Clients send the preface in one
        // write, so this is rare; peeking again after a pause is simpler
        // than another readiness wakeup, and the first-head deadline bounds
        // it.
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// Completes when `deadline` passes; never if there is none.
async fn until(deadline: Pin<&mut Option<Sleep>>) {
    match deadline.as_pin_mut() {
        Some(sleep) => sleep.await,
        None => std::future::pending().await,
    }
}

/// Polls `connection` to its end, closing it gracefully once shutdown
/// begins and giving up on it if its first request head is late.
async fn drive<C>(
    connection: C,
    started: &AtomicBool,
    mut deadline: Pin<&mut Option<Sleep>>,
    mut close: Pin<&mut tokio::sync::futures::Notified<'_>>,
    connections: &Connections,
) -> Ended
where
    C: GracefulConnection,
    C::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let mut connection = pin!(connection);
    // The shutdown wakeup is registered by the first poll; after that only
    // the flag is read, and the wakeup reaches this task through that one
    // registration.
    let mut registered = false;
    let mut closing = false;
    std::future::poll_fn(|cx| {
        if !closing {
            let shutting_down = if registered {
                connections.closing.load(Ordering::Acquire)
            } else {
                registered = true;
                close.as_mut().poll(cx).is_ready()
            };
            if shutting_down {
                closing = true;
                connection.as_mut().graceful_shutdown();
            }
        }
        if let Poll::Ready(result) = connection.as_mut().poll(cx) {
            return Poll::Ready(Ended::Served(result.err().map(Into::into)));
        }
        // The first request head must arrive in time. Once it has, the
        // timer is dropped rather than polled along with every request.
        if started.load(Ordering::Relaxed) {
            if deadline.is_some() {
                deadline.set(None);
            }
        } else if let Some(sleep) = deadline.as_mut().as_pin_mut()
            && sleep.poll(cx).is_ready()
        {
            return Poll::Ready(Ended::FirstHeadTimedOut);
        }
        Poll::Pending
    })
    .await
}
