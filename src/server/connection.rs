//! One client connection's life: its TLS handshake, which protocol it
//! speaks, the deadline for its first request head (and its socket back to
//! answer 408 on), closing it once idle, and finishing its requests when
//! floodgate shuts down.
//!
//! On the TLS listener the handshake comes first and ALPN tells the
//! protocol. Otherwise the protocol is told from the client's first bytes,
//! read with `MSG_PEEK` so that they stay for hyper, which then serves the
//! connection with its HTTP/1 or HTTP/2 connection directly. (hyper-util's protocol detection
//! reads them itself and wraps every later read and write of the connection
//! to replay them: work on every request, for a question settled once.)
//!
//! Timing is per connection, not per request. One timer ticks four times per
//! `header_read_timeout`; a tick that finds no request started since the
//! last one, and none in flight, is idle, and four idle ticks in a row close
//! the connection (408 if it never sent a request head). So a first head
//! must arrive within the timeout, an idle keep-alive connection (or one
//! dribbling its next head) is closed between one and one and a quarter
//! timeouts after its last request, and a request pays one flag and one
//! counter instead of a timer of its own. (hyper's own `header_read_timeout`
//! boxes, registers and cancels a timer for every request head.)
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
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio::time::Sleep;
use tokio_rustls::server::TlsStream;

use super::write_idle::WriteIdle;
pub use super::write_idle::WriteTimeout;
use crate::in_flight;

/// What every HTTP/2 connection sends first (RFC 9113 §3.4).
const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How connections are served: built once, shared by all of them.
#[derive(Debug)]
pub struct Protocols {
    /// HTTP/1 connections.
    pub http1: http1::Builder,
    /// HTTP/2 connections (prior knowledge: `h2c` without upgrade).
    pub http2: http2::Builder<TokioExecutor>,
    /// How long a client may take to send its first request head, and how
    /// long a keep-alive connection may idle.
    pub idle_timeout: Duration,
}

/// The connections being served, so that shutdown can ask each one to
/// finish its requests and then wait until all have.
#[derive(Debug, Default)]
pub struct Connections {
    closing: AtomicBool,
    /// Woken once, when shutdown begins.
    close: Notify,
    live: Arc<in_flight::Count>,
}

impl Connections {
    /// Counts a new connection as open until the returned guard is dropped.
    pub fn open(&self, gauge: Gauge) -> Open {
        gauge.inc();
        Open {
            _counted: self.live.begin(),
            gauge,
        }
    }

    /// Connections open now.
    pub fn count(&self) -> usize {
        self.live.count()
    }

    /// Asks every connection, and every one opened from now on, to finish
    /// its requests in flight and close.
    pub fn close_all(&self) {
        self.closing.store(true, Ordering::SeqCst);
        self.close.notify_waiters();
    }

    /// Completes once no connection is open.
    pub async fn all_closed(&self) {
        self.live.finished().await;
    }
}

/// An open connection, counted until dropped.
#[derive(Debug)]
pub struct Open {
    _counted: in_flight::Counted,
    gauge: Gauge,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// What the requests on one connection are doing, as the connection's timer
/// sees it.
#[derive(Debug, Default)]
pub struct Activity {
    /// A request has started since the timer last looked.
    requested: AtomicBool,
    in_flight: AtomicUsize,
}

impl Activity {
    /// Marks a request as started; it counts as in flight until the guard is
    /// dropped (when its response head is ready).
    pub fn begin(&self) -> Busy<'_> {
        self.requested.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Busy(self)
    }

    /// Whether a request started since the last look, and if not, whether
    /// one is still in flight.
    fn look(&self) -> Tick {
        if self.requested.swap(false, Ordering::Relaxed) {
            Tick::Requested
        } else if self.in_flight.load(Ordering::Relaxed) > 0 {
            Tick::Busy
        } else {
            Tick::Idle
        }
    }
}

/// A request in flight.
#[derive(Debug)]
pub struct Busy<'a>(&'a Activity);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a timer tick found.
enum Tick {
    Requested,
    Busy,
    Idle,
}

/// Ticks per idle timeout.
const TICKS: u32 = 4;

/// How a connection ended.
pub enum Ended {
    /// Served until the client, idleness or shutdown closed it; hyper's
    /// error, if any.
    Served(Option<Box<dyn StdError + Send + Sync>>),
    /// An HTTP/1 connection's first request head did not arrive in time:
    /// its socket, taken back from hyper, to answer 408 on.
    FirstHeadTimedOut(Socket),
}

/// A client connection's socket, plain or TLS.
pub enum Socket {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP.
    Tls(Box<TlsStream<TcpStream>>),
}

impl Socket {
    /// Writes `bytes` and closes the connection, within a second at most:
    /// the client may not be reading.
    pub async fn answer_and_close(self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt as _;
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            match self {
                Socket::Plain(mut s) => {
                    let _ = s.write_all(bytes).await;
                    let _ = s.shutdown().await;
                }
                Socket::Tls(mut s) => {
                    let _ = s.write_all(bytes).await;
                    let _ = s.shutdown().await;
                }
            }
        })
        .await;
    }
}

/// Serves `stream` with `service` until the connection ends, over TLS with
/// `tls` when given. The service reports its requests to `activity`; a
/// client that reads nothing of what is written to it for `write_timeout`
/// is cut off.
pub async fn serve<S, B>(
    stream: TcpStream,
    tls: Option<Arc<rustls::ServerConfig>>,
    service: S,
    activity: &Activity,
    write_timeout: &WriteTimeout,
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
    let accepted = tokio::time::Instant::now();
    let mut close = pin!(connections.close.notified());
    close.as_mut().enable();
    if connections.closing.load(Ordering::Acquire) {
        return Ended::Served(None);
    }
    let first_head = accepted + protocols.idle_timeout;
    let setting = Setting {
        accepted,
        activity,
        write_timeout,
        protocols,
        connections,
    };
    let Some(tls) = tls else {
        let protocol = tokio::select! {
            biased;
            () = &mut close => return Ended::Served(None),
            () = tokio::time::sleep_until(first_head) => {
                return Ended::FirstHeadTimedOut(Socket::Plain(stream));
            }
            protocol = protocol(&stream) => protocol,
        };
        return match protocol {
            // Closed, or reset, before sending anything.
            Ok(None) | Err(_) => Ended::Served(None),
            Ok(Some(protocol)) => {
                serve_on(stream, protocol, Socket::Plain, service, close, &setting).await
            }
        };
    };
    // The handshake counts against the first head's deadline; ALPN says
    // which protocol follows.
    let handshake = tokio_rustls::TlsAcceptor::from(tls).accept(stream);
    let stream = tokio::select! {
        biased;
        () = &mut close => return Ended::Served(None),
        () = tokio::time::sleep_until(first_head) => return Ended::Served(None),
        stream = handshake => match stream {
            Ok(stream) => stream,
            Err(e) => return Ended::Served(Some(e.into())),
        },
    };
    let protocol = match stream.get_ref().1.alpn_protocol() {
        Some(b"h2") => Protocol::Http2,
        _ => Protocol::Http1,
    };
    let socket = |stream| Socket::Tls(Box::new(stream));
    serve_on(stream, protocol, socket, service, close, &setting).await
}

/// What serving a connection needs besides its socket and service.
struct Setting<'a> {
    /// When it was accepted.
    accepted: tokio::time::Instant,
    activity: &'a Activity,
    write_timeout: &'a WriteTimeout,
    protocols: &'a Protocols,
    connections: &'a Connections,
}

/// Serves `io`, whose client speaks `protocol`, from its acceptance on;
/// `socket` makes it an answerable [`Socket`] again for a 408.
async fn serve_on<I, S, B>(
    io: I,
    protocol: Protocol,
    socket: impl FnOnce(I) -> Socket,
    service: S,
    close: Pin<&mut tokio::sync::futures::Notified<'_>>,
    setting: &Setting<'_>,
) -> Ended
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let Setting {
        accepted,
        activity,
        write_timeout,
        protocols,
        connections,
    } = *setting;
    let io = TokioIo::new(WriteIdle::new(io, write_timeout));
    // Ticks from the accept: any that passed while waiting for the first
    // bytes fire at once, and count as idle.
    let tick = (protocols.idle_timeout / TICKS).max(Duration::from_millis(1));
    let timer = Timer {
        sleep: tokio::time::sleep_until(accepted + tick),
        tick,
        activity,
    };
    match protocol {
        Protocol::Http1 => {
            // hyper's HTTP/1 connection is `Unpin`, so it stays here and
            // gives its socket back for the 408: no second descriptor on
            // the socket is needed to answer.
            let mut connection = protocols
                .http1
                .serve_connection(io, service)
                .with_upgrades();
            match drive(Pin::new(&mut connection), timer, close, connections).await {
                Drove::Ended(ended) => Ended::Served(ended),
                Drove::FirstHeadTimedOut => match connection.into_parts() {
                    Some(parts) => Ended::FirstHeadTimedOut(socket(parts.io.into_inner().io)),
                    // Upgraded: not idle, and not this connection's any more.
                    None => Ended::Served(None),
                },
            }
        }
        Protocol::Http2 => {
            let connection = pin!(protocols.http2.serve_connection(io, service));
            match drive(connection, timer, close, connections).await {
                Drove::Ended(ended) => Ended::Served(ended),
                // No HTTP/1 answer on an HTTP/2 connection.
                Drove::FirstHeadTimedOut => Ended::Served(None),
            }
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

/// A served connection that can be asked to finish its requests and close:
/// hyper's HTTP/1 connection with upgrades, and its HTTP/2 connection.
trait Graceful: Future<Output = hyper::Result<()>> {
    fn begin_shutdown(self: Pin<&mut Self>);
}

impl<I, S, B> Graceful for http1::UpgradeableConnection<I, S>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    fn begin_shutdown(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

impl<I, S, B, E> Graceful for http2::Connection<I, S, E>
where
    S: hyper::service::HttpService<Incoming, ResBody = B>,
    S::Error: Into<Box<dyn StdError + Send + Sync>>,
    I: hyper::rt::Read + hyper::rt::Write + Unpin + 'static,
    B: hyper::body::Body + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
    E: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    fn begin_shutdown(self: Pin<&mut Self>) {
        self.graceful_shutdown();
    }
}

/// A connection's idle timer.
struct Timer<'a> {
    sleep: Sleep,
    tick: Duration,
    activity: &'a Activity,
}

/// How [`drive`] left a connection.
enum Drove {
    /// It ended; hyper's error, if any.
    Ended(Option<Box<dyn StdError + Send + Sync>>),
    /// Its first request head did not arrive in time; hyper is no longer
    /// polled.
    FirstHeadTimedOut,
}

/// Polls `connection` to its end, closing it gracefully once shutdown
/// begins or it has idled for four ticks of `timer`.
async fn drive<C>(
    mut connection: Pin<&mut C>,
    timer: Timer<'_>,
    mut close: Pin<&mut tokio::sync::futures::Notified<'_>>,
    connections: &Connections,
) -> Drove
where
    C: Graceful,
{
    let Timer {
        sleep,
        tick,
        activity,
    } = timer;
    let mut sleep = pin!(sleep);
    // The shutdown wakeup is registered by the first poll; after that only
    // the flag is read, and the wakeup reaches this task through that one
    // registration. Likewise the timer is polled once per tick, to register
    // this task's waker, and otherwise only asked whether it has fired.
    let mut close_registered = false;
    let mut timer_registered = false;
    let mut closing = false;
    let mut served_any = false;
    let mut idle_ticks = 0;
    std::future::poll_fn(|cx| {
        loop {
            if !closing {
                let shutting_down = if close_registered {
                    connections.closing.load(Ordering::Acquire)
                } else {
                    close_registered = true;
                    close.as_mut().poll(cx).is_ready()
                };
                if shutting_down {
                    closing = true;
                    connection.as_mut().begin_shutdown();
                }
            }
            if let Poll::Ready(result) = connection.as_mut().poll(cx) {
                return Poll::Ready(Drove::Ended(result.err().map(Into::into)));
            }
            let fired = if timer_registered {
                sleep.is_elapsed()
            } else {
                timer_registered = true;
                sleep.as_mut().poll(cx).is_ready()
            };
            if !fired {
                return Poll::Pending;
            }
            match activity.look() {
                Tick::Requested => {
                    served_any = true;
                    idle_ticks = 0;
                }
                Tick::Busy => idle_ticks = 0,
                Tick::Idle => idle_ticks += 1,
            }
            if idle_ticks < TICKS || closing {
                let next = sleep.deadline() + tick;
                sleep.as_mut().reset(next);
                timer_registered = false;
                continue;
            }
            if !served_any {
                return Poll::Ready(Drove::FirstHeadTimedOut);
            }
            // Idle (or dribbling its next head): hyper closes an idle
            // connection at once and finishes one in flight first.
            closing = true;
            connection.as_mut().begin_shutdown();
        }
    })
    .await
}
