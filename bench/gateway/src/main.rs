//! A bare hyper gateway: hyper's HTTP/1.1 server on each accepted
//! connection, one hyper HTTP/1.1 client connection to the upstream per
//! client connection, and `send_request` in between. No pool, no headers
//! added or removed, no limits, no timers, no logs: what proxying costs with
//! the same codecs floodgate uses, to measure floodgate's own layers
//! against.
//!
//! With `--same-job` it also does, in the fewest lines, the job floodgate
//! does by default for a route with one limit that never triggers: a GCRA
//! decision per client address in a map behind a lock (the wall clock read
//! once), the hop-by-hop fields taken off the request and the answer,
//! `X-Forwarded-For/-Proto/-Host` on the request, a deadline for the
//! upstream's answer, and `RateLimit-Policy` and `RateLimit` on the answer.
//! The smallest thing that does floodgate's job, measured beside it.
//!
//!   bare-gateway LISTEN UPSTREAM [--same-job]   e.g. 127.0.0.1:8080 127.0.0.1:9000

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;

/// The one limit: a rate that never triggers, as in bench/callgrind.sh.
const LIMIT: u64 = 100_000_000;
const WINDOW_MS: u64 = 1_000;
/// How long the upstream has to answer.
const DEADLINE: Duration = Duration::from_secs(30);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: bare-gateway LISTEN UPSTREAM [--same-job]";
    let listen: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let upstream: SocketAddr = args.next().ok_or(usage)?.parse()?;
    let same_job = args.next().is_some_and(|a| a == "--same-job");
    let listener = TcpListener::bind(listen).await?;
    let limits = Arc::new(Limits::default());
    loop {
        let (stream, peer) = listener.accept().await?;
        let limits = Arc::clone(&limits);
        tokio::spawn(async move {
            let Ok(up) = TcpStream::connect(upstream).await else {
                return;
            };
            let Ok((sender, connection)) = client::handshake(TokioIo::new(up)).await else {
                return;
            };
            tokio::spawn(connection);
            // HTTP/1.1 serves one request at a time per connection: the lock
            // is never contended.
            let io = TokioIo::new(stream);
            if !same_job {
                let sender = Arc::new(Mutex::new(sender));
                let service = service_fn(move |request: Request<Incoming>| {
                    let sender = Arc::clone(&sender);
                    async move {
                        let response: Response<Incoming> =
                            sender.lock().await.send_request(request).await?;
                        Ok::<_, hyper::Error>(response)
                    }
                });
                let _ = server::Builder::new().serve_connection(io, service).await;
                return;
            }
            // The client's address as a field value, and the deadline's
            // timer (moved later for each request), once per connection.
            let Ok(ip) = HeaderValue::from_str(&peer.ip().to_string()) else {
                return;
            };
            let upstream = Arc::new(Mutex::new((sender, Box::pin(tokio::time::sleep(DEADLINE)))));
            let service = service_fn(move |mut request: Request<Incoming>| {
                let upstream = Arc::clone(&upstream);
                let limits = Arc::clone(&limits);
                let ip = ip.clone();
                async move {
                    let Some(remaining) = limits.decide(peer.ip()) else {
                        return Ok::<_, hyper::Error>(status(StatusCode::TOO_MANY_REQUESTS));
                    };
                    forwarding(request.headers_mut(), ip);
                    let mut upstream = upstream.lock().await;
                    let (sender, deadline) = &mut *upstream;
                    deadline
                        .as_mut()
                        .reset(tokio::time::Instant::now() + DEADLINE);
                    let send = sender.send_request(request);
                    let mut response = tokio::select! {
                        biased;
                        answered = send => match answered {
                            Ok(response) => response,
                            Err(_) => return Ok(status(StatusCode::BAD_GATEWAY)),
                        },
                        () = deadline.as_mut() => return Ok(status(StatusCode::GATEWAY_TIMEOUT)),
                    };
                    strip_hop_by_hop(response.headers_mut());
                    annotate(response.headers_mut(), remaining);
                    Ok(response.map(Body::Upstream))
                }
            });
            let _ = server::Builder::new().serve_connection(io, service).await;
        });
    }
}

/// The upstream's body, or a whole one of the gateway's own (empty).
enum Body {
    Upstream(Incoming),
    Empty,
}

impl hyper::body::Body for Body {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;
    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        match self.get_mut() {
            Body::Upstream(body) => std::pin::Pin::new(body).poll_frame(cx),
            Body::Empty => std::task::Poll::Ready(None),
        }
    }
    fn is_end_stream(&self) -> bool {
        match self {
            Body::Upstream(body) => body.is_end_stream(),
            Body::Empty => true,
        }
    }
}

fn status(status: StatusCode) -> Response<Body> {
    let mut response = Response::new(Body::Empty);
    *response.status_mut() = status;
    response
}

/// GCRA per client address: each address's theoretical arrival time.
#[derive(Default)]
struct Limits {
    tat: std::sync::Mutex<HashMap<IpAddr, u64>>,
}

impl Limits {
    /// What remains of the address's limit after this request, or `None`
    /// when it is over.
    fn decide(&self, who: IpAddr) -> Option<u64> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let interval = WINDOW_MS * 1_000 / LIMIT.max(1);
        let burst = WINDOW_MS * 1_000;
        let mut tats = self.tat.lock().unwrap_or_else(|e| e.into_inner());
        let tat = tats.entry(who).or_insert(now);
        let next = (*tat).max(now) + interval.max(1);
        if next - now > burst {
            return None;
        }
        *tat = next;
        Some(LIMIT.saturating_sub((next - now) / interval.max(1)))
    }
}

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

const HOP_BY_HOP: [HeaderName; 6] = [
    hyper::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    hyper::header::PROXY_AUTHORIZATION,
    hyper::header::TE,
    hyper::header::TRAILER,
    hyper::header::UPGRADE,
];

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The request as the upstream should see it: no hop-by-hop fields, and
/// who asked, how and for which host.
fn forwarding(headers: &mut HeaderMap, ip: HeaderValue) {
    strip_hop_by_hop(headers);
    let host = headers.get(hyper::header::HOST).cloned();
    let value = match headers.get(&X_FORWARDED_FOR) {
        Some(before) => {
            let mut joined = before.as_bytes().to_vec();
            joined.extend_from_slice(b", ");
            joined.extend_from_slice(ip.as_bytes());
            HeaderValue::from_bytes(&joined).unwrap_or(ip)
        }
        None => ip,
    };
    headers.insert(X_FORWARDED_FOR, value);
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST, host);
    }
}

/// The limit's fields on the answer.
fn annotate(headers: &mut HeaderMap, remaining: u64) {
    headers.insert(
        RATELIMIT_POLICY,
        HeaderValue::from_static("\"default\";q=100000000;w=1"),
    );
    let mut value = String::with_capacity(40);
    value.push_str("\"default\";r=");
    value.push_str(itoa::Buffer::new().format(remaining));
    value.push_str(";t=0");
    if let Ok(value) = HeaderValue::from_str(&value) {
        headers.insert(RATELIMIT, value);
    }
}
