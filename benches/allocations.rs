//! Counts heap allocations per proxied request: requests straight to an
//! upstream, then the same requests through a bare hyper gateway (hyper's
//! server and one hyper client connection, nothing else: the floor, as
//! `bench/gateway` is for instructions), through the same gateway adding
//! the header fields floodgate adds (`X-Forwarded-For/-Proto/-Host` on the
//! request, `RateLimit` and `RateLimit-Policy` on the answer), then through
//! floodgate (memory store, a limit that never triggers; and the Redis
//! store when `redis-server` is on PATH or REDIS_URL is set). The
//! difference from the straight requests is each proxy's share.
//!
//! Everything runs in this one process, so the count includes what the
//! client and the upstream allocate for what a proxy sends them: hyper
//! allocates each header name it does not know as it parses it (five a
//! request for the five fields above). The gateway with those fields is
//! therefore the floor for floodgate's job; floodgate's own allocations
//! are what it makes beyond that.
//! Run with `cargo bench --bench allocations`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

mod support;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full};
use hyper::header::{HeaderName, HeaderValue};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::BenchRedis;
use tokio::net::TcpListener;

struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

async fn upstream() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|_req| async {
                    Ok::<_, Infallible>(hyper::Response::new(Full::new(Bytes::from_static(b"ok"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
static X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");

/// The bare gateway in front of `upstream`: per accepted connection, hyper's
/// HTTP/1.1 server and one hyper HTTP/1.1 client connection, with
/// `send_request` between them; with `fields`, adding (fixed values of)
/// the header fields floodgate adds.
async fn gateway(upstream: std::net::SocketAddr, fields: bool) -> std::net::SocketAddr {
    use hyper::client::conn::http1 as client;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let Ok((sender, connection)) = client::handshake(TokioIo::new(up)).await else {
                    return;
                };
                tokio::spawn(connection);
                let sender = Arc::new(tokio::sync::Mutex::new(sender));
                let service =
                    service_fn(move |mut request: hyper::Request<hyper::body::Incoming>| {
                        let sender = Arc::clone(&sender);
                        async move {
                            if fields {
                                let headers = request.headers_mut();
                                headers.insert(
                                    &X_FORWARDED_FOR,
                                    HeaderValue::from_static("127.0.0.1"),
                                );
                                headers
                                    .insert(&X_FORWARDED_PROTO, HeaderValue::from_static("http"));
                                headers
                                    .insert(&X_FORWARDED_HOST, HeaderValue::from_static("gateway"));
                            }
                            let mut response = sender.lock().await.send_request(request).await?;
                            if fields {
                                let headers = response.headers_mut();
                                headers.insert(
                                    &RATELIMIT,
                                    HeaderValue::from_static("\"api\";r=999999;t=1"),
                                );
                                headers.insert(
                                    &RATELIMIT_POLICY,
                                    HeaderValue::from_static("\"api\";q=1000000;w=1"),
                                );
                            }
                            Ok::<_, hyper::Error>(response)
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

async fn floodgate(toml: &str) -> std::net::SocketAddr {
    let config =
        floodgate::config::parse(std::path::Path::new("bench.toml"), toml).expect("config");
    let proxy = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = proxy.local_addr().expect("addr");
    let listeners = floodgate::Listeners {
        proxy,
        admin: None,
        decisions: None,
    };
    tokio::spawn(floodgate::run(
        config,
        listeners,
        std::future::pending(),
        Arc::new(tokio::sync::Notify::new()),
    ));
    addr
}

/// Allocations per request for `n` sequential GETs to `url`.
async fn allocations_per_request(url: &str, n: u64) -> f64 {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let uri: hyper::Uri = url.parse().expect("uri");
    for _ in 0..500 {
        let r = client.get(uri.clone()).await.expect("warm-up request");
        let _ = r.into_body().collect().await;
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    for _ in 0..n {
        let r = client.get(uri.clone()).await.expect("request");
        assert!(r.status().is_success());
        let _ = r.into_body().collect().await;
    }
    (ALLOCATIONS.load(Ordering::Relaxed) - before) as f64 / n as f64
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let redis = support::BenchRedis::start();
    runtime.block_on(async {
        let n = 20_000;
        let up = upstream().await;
        let direct = allocations_per_request(&format!("http://{up}/x"), n).await;
        let bare = gateway(up, false).await;
        let through_gateway = allocations_per_request(&format!("http://{bare}/x"), n).await;
        let same_job = gateway(up, true).await;
        let through_same_job = allocations_per_request(&format!("http://{same_job}/x"), n).await;
        let route = format!(
            "[[routes]]\nname = \"api\"\nupstream = \"http://{up}\"\nlimits = [{{ algorithm = \"gcra\", limit = 1000000, window = \"1s\" }}]\n"
        );
        let memory = floodgate(&format!("[server]\nlisten = \"127.0.0.1:0\"\n{route}")).await;
        let through_memory = allocations_per_request(&format!("http://{memory}/x"), n).await;
        println!("| path | allocations per request |");
        println!("|---|---:|");
        println!("| client → upstream (baseline) | {direct:.1} |");
        println!(
            "| client → bare hyper gateway → upstream | {through_gateway:.1} (gateway: {:.1}) |",
            through_gateway - direct
        );
        println!(
            "| client → bare gateway adding floodgate's five fields → upstream (the floor) | {through_same_job:.1} (gateway: {:.1}) |",
            through_same_job - direct
        );
        println!(
            "| client → floodgate (memory store) → upstream | {through_memory:.1} (floodgate: {:.1}; beyond the floor: {:.1}) |",
            through_memory - direct,
            through_memory - through_same_job
        );
        if let Some(BenchRedis { url, .. }) = &redis {
            let with_redis = floodgate(&format!(
                "[server]\nlisten = \"127.0.0.1:0\"\n[store]\nbackend = \"redis\"\nurl = \"{url}\"\nkey_prefix = \"alloc-bench\"\n{route}"
            ))
            .await;
            let through_redis = allocations_per_request(&format!("http://{with_redis}/x"), n).await;
            println!(
                "| client → floodgate (Redis store) → upstream | {through_redis:.1} (floodgate: {:.1}; beyond the floor: {:.1}) |",
                through_redis - direct,
                through_redis - through_same_job
            );
        }
    });
}
