//! Concurrency caps against a real upstream that sleeps and records how many
//! requests it holds at once: fixed caps per route and per client, the
//! queue and its timeout, no slot leaked on any path out, an adaptive cap
//! that finds a slowing upstream's knee, and the order of concurrency and
//! rate decisions.

mod support;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient};
use tokio::net::TcpListener;

/// An upstream that holds each request for a latency that depends on how
/// many it holds at once: `floor` ms up to `knee` requests, and `floor`
/// more for each request past it. It records the most it ever held.
struct Sleeper {
    addr: SocketAddr,
    held: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
    floor_ms: Arc<AtomicU64>,
    knee: Arc<AtomicUsize>,
    /// Latencies given, in ms, and how many: their mean since the last
    /// reset.
    given: Arc<(AtomicU64, AtomicU64)>,
    task: tokio::task::JoinHandle<()>,
}

/// Counts a request held until it is dropped (answered, or abandoned when
/// the client goes away).
struct Holding(Arc<AtomicUsize>);

impl Drop for Holding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Sleeper {
    async fn start(floor_ms: u64, knee: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let held = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let floor = Arc::new(AtomicU64::new(floor_ms));
        let knee_at = Arc::new(AtomicUsize::new(knee));
        let given = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
        let (h, m, f, k, g) = (
            Arc::clone(&held),
            Arc::clone(&most),
            Arc::clone(&floor),
            Arc::clone(&knee_at),
            Arc::clone(&given),
        );
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (h, m, f, k, g) = (
                    Arc::clone(&h),
                    Arc::clone(&m),
                    Arc::clone(&f),
                    Arc::clone(&k),
                    Arc::clone(&g),
                );
                tokio::spawn(async move {
                    let service = service_fn(move |_req: Request<Incoming>| {
                        let now = h.fetch_add(1, Ordering::SeqCst) + 1;
                        m.fetch_max(now, Ordering::SeqCst);
                        let holding = Holding(Arc::clone(&h));
                        let floor = f.load(Ordering::SeqCst);
                        let knee = k.load(Ordering::SeqCst);
                        let over = now.saturating_sub(knee) as u64;
                        let latency = Duration::from_millis(floor * (1 + over));
                        g.0.fetch_add(floor * (1 + over), Ordering::SeqCst);
                        g.1.fetch_add(1, Ordering::SeqCst);
                        async move {
                            tokio::time::sleep(latency).await;
                            drop(holding);
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("done"))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            held,
            most,
            floor_ms: floor,
            knee: knee_at,
            given,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }

    fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }

    fn reset_most(&self) {
        self.most.store(self.held(), Ordering::SeqCst);
        self.given.0.store(0, Ordering::SeqCst);
        self.given.1.store(0, Ordering::SeqCst);
    }

    /// The mean latency given since the last reset, in ms.
    fn mean_latency_ms(&self) -> f64 {
        let (sum, n) = (
            self.given.0.load(Ordering::SeqCst),
            self.given.1.load(Ordering::SeqCst),
        );
        sum as f64 / n.max(1) as f64
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A sample of `name{route="route"…}` from the admin listener's metrics.
async fn metric(client: &TestClient, gate: &Floodgate, name: &str, labels: &str) -> f64 {
    let text = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    let prefix = format!("{name}{{{labels}}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {prefix} in:\n{text}"))
}

async fn in_flight_returns_to_zero(client: &TestClient, gate: &Floodgate, route: &str) {
    let labels = format!("route=\"{route}\"");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = metric(client, gate, "floodgate_concurrency_in_flight", &labels).await;
        let w = metric(client, gate, "floodgate_concurrency_waiting", &labels).await;
        if n == 0.0 && w == 0.0 {
            return;
        }
        assert!(Instant::now() < deadline, "{n} in flight, {w} waiting");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Sends `n` GETs at once; their statuses, in no particular order.
async fn burst(
    client: &TestClient,
    url: &str,
    n: usize,
    headers: &[(&'static str, &'static str)],
) -> Vec<u16> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let client = client.clone();
            let url = url.to_owned();
            let headers = headers.to_vec();
            tokio::spawn(async move { client.get(&url, &headers).await.status.as_u16() })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

fn count(statuses: &[u16], status: u16) -> usize {
    statuses.iter().filter(|&&s| s == status).count()
}

#[tokio::test]
async fn a_route_cap_holds_the_upstream_to_five_with_a_queue_of_ten() {
    let upstream = Sleeper::start(400, 1000).await;
    let toml = Config::new()
        .admin()
        .route(
            Route::new("reports")
                .upstream(&upstream.url())
                .line(r#"concurrency = { max_in_flight = 5, queue = 10, queue_timeout = "2s" }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let statuses = burst(&client, &gate.url("/reports"), 40, &[]).await;
    assert!(
        upstream.most() <= 5,
        "the upstream held {}",
        upstream.most()
    );
    assert_eq!(upstream.most(), 5);
    // Five at once, ten waiting (done within 3 × 400 ms < 2 s), the rest
    // refused at once.
    assert_eq!(
        count(&statuses, 200) + count(&statuses, 503),
        40,
        "{statuses:?}"
    );
    assert!(count(&statuses, 200) >= 15, "{statuses:?}");
    let refused = client.get(&gate.url("/reports"), &[]).await;
    assert_eq!(refused.status, 200, "a slot is free again");
    in_flight_returns_to_zero(&client, &gate, "reports").await;
    let full = metric(
        &client,
        &gate,
        "floodgate_concurrency_refusals_total",
        r#"route="reports",reason="full""#,
    )
    .await;
    assert_eq!(full as usize, count(&statuses, 503));

    // A refusal is a problem document with Retry-After.
    let holders: Vec<_> = (0..15)
        .map(|_| {
            let client = client.clone();
            let url = gate.url("/reports");
            tokio::spawn(async move { client.get(&url, &[]).await.status })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(150)).await;
    let a = client.get(&gate.url("/reports"), &[]).await;
    assert_eq!(a.problem().0, 503);
    assert!(a.problem().1.contains("in flight"), "{}", a.text());
    assert_eq!(a.header("retry-after"), Some("1"));
    for h in holders {
        let _ = h.await;
    }
    in_flight_returns_to_zero(&client, &gate, "reports").await;
}

#[tokio::test]
async fn a_request_that_waits_past_queue_timeout_is_refused() {
    let upstream = Sleeper::start(1500, 1000).await;
    let toml = Config::new()
        .admin()
        .route(
            Route::new("slow")
                .upstream(&upstream.url())
                .line(r#"concurrency = { max_in_flight = 1, queue = 5, queue_timeout = "300ms", status = 429 }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let first = {
        let client = client.clone();
        let url = gate.url("/slow");
        tokio::spawn(async move { client.get(&url, &[]).await.status.as_u16() })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let statuses = burst(&client, &gate.url("/slow"), 3, &[]).await;
    let waited = started.elapsed();
    assert_eq!(statuses, [429, 429, 429]);
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(1200),
        "{waited:?}"
    );
    assert_eq!(first.await.expect("first"), 200);
    assert_eq!(upstream.most(), 1);
    let timeouts = metric(
        &client,
        &gate,
        "floodgate_concurrency_refusals_total",
        r#"route="slow",reason="queue_timeout""#,
    )
    .await;
    assert_eq!(timeouts, 3.0);
    in_flight_returns_to_zero(&client, &gate, "slow").await;
}

#[tokio::test]
async fn no_slot_is_leaked_by_departed_clients_upstream_errors_or_timeouts() {
    let upstream = Sleeper::start(2000, 1000).await;
    // A port nothing listens on.
    let gone = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let gone_url = format!("http://{}", gone.local_addr().expect("addr"));
    drop(gone);
    let cap = r#"concurrency = { max_in_flight = 3, queue = 0 }"#;
    let toml = Config::new()
        .admin()
        .route(
            Route::new("slow")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/slow""#)
                .line(cap),
        )
        .route(
            Route::new("late")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/late""#)
                .line(r#"upstream_timeout = "200ms""#)
                .line(cap),
        )
        .route(
            Route::new("down")
                .upstream(&gone_url)
                .matching(r#"path_prefix = "/down""#)
                .line(cap),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();

    // Clients that leave mid-request.
    let leaving: Vec<_> = (0..3)
        .map(|_| {
            let client = client.clone();
            let url = gate.url("/slow");
            tokio::spawn(async move { client.get(&url, &[]).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(upstream.held(), 3);
    assert_eq!(client.get(&gate.url("/slow"), &[]).await.status, 503);
    for task in leaving {
        task.abort();
    }
    in_flight_returns_to_zero(&client, &gate, "slow").await;

    // Upstream timeouts (504) and an unreachable upstream (502).
    let late = burst(&client, &gate.url("/late"), 3, &[]).await;
    assert_eq!(late, [504, 504, 504]);
    in_flight_returns_to_zero(&client, &gate, "late").await;
    let down = burst(&client, &gate.url("/down"), 3, &[]).await;
    assert_eq!(down, [502, 502, 502]);
    in_flight_returns_to_zero(&client, &gate, "down").await;

    // And the caps still hold all three slots.
    upstream.floor_ms.store(100, Ordering::SeqCst);
    let again = burst(&client, &gate.url("/slow"), 3, &[]).await;
    assert_eq!(again, [200, 200, 200]);
}

#[tokio::test]
async fn a_client_cap_limits_one_client_and_not_another() {
    let upstream = Sleeper::start(500, 1000).await;
    let toml = Config::new()
        .admin()
        .route(
            Route::new("api")
                .upstream(&upstream.url())
                .client(r#"from = "header", name = "X-Client""#)
                .line(r#"concurrency = { max_in_flight = 3, per = "client" }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    let greedy = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move { burst(&client, &url, 20, &[("x-client", "greedy")]).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let calm = burst(&client, &url, 3, &[("x-client", "calm")]).await;
    let greedy = greedy.await.expect("greedy");
    assert_eq!(calm, [200, 200, 200]);
    assert_eq!(count(&greedy, 200), 3, "{greedy:?}");
    assert_eq!(count(&greedy, 429), 17, "{greedy:?}");
    assert!(upstream.most() <= 6, "{}", upstream.most());
    in_flight_returns_to_zero(&client, &gate, "api").await;
}

#[tokio::test]
async fn a_request_refused_for_concurrency_costs_no_rate_units() {
    let redis = TestRedis::start().await;
    let upstream = Sleeper::start(600, 1000).await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &unique_prefix("concurrency-rate"))
        .route(
            Route::new("api")
                .upstream(&upstream.url())
                .client(r#"from = "header", name = "X-Client""#)
                .line(r#"concurrency = { max_in_flight = 1 }"#)
                .limit("sliding_log", 3, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    let holder = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move { client.get(&url, &[("x-client", "c")]).await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    let refused = burst(&client, &url, 5, &[("x-client", "c")]).await;
    assert_eq!(refused, [503; 5]);
    let first = holder.await.expect("holder");
    // t: until the oldest counted request (the holder's) leaves.
    assert_eq!(first.header("ratelimit"), Some("\"api\";r=2;t=60"));
    // Two units are left: the five refusals took none.
    let a = client.get(&url, &[("x-client", "c")]).await;
    let field = a.header("ratelimit").unwrap_or_default();
    assert!(
        field == "\"api\";r=1;t=60" || field == "\"api\";r=1;t=59",
        "{field}"
    );
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    // Denied by rate: no slot held, so the next denial is a 429, not a 503.
    for _ in 0..3 {
        assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 429);
    }
    in_flight_returns_to_zero(&client, &gate, "api").await;
}

/// The adaptive cap the admin's metrics show for route `api` (NaN when
/// absent).
async fn adaptive_cap(client: &TestClient, gate: &Floodgate) -> f64 {
    let text = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix("floodgate_concurrency_limit{route=\"api\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN)
}

/// 32 clients sending to `url` one request after another while `running`.
fn steady_load(
    client: &TestClient,
    url: &str,
    running: &Arc<std::sync::atomic::AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..32)
        .map(|_| {
            let client = client.clone();
            let url = url.to_owned();
            let running = Arc::clone(running);
            tokio::spawn(async move {
                while running.load(Ordering::SeqCst) {
                    let _ = client.get(&url, &[]).await;
                }
            })
        })
        .collect()
}

/// Settling: within 30 s the cap stays between 6 and 12 for 5 s, and the
/// upstream holds little more than its knee, its latency near its floor.
async fn the_cap_settles_near_the_knee(client: &TestClient, gate: &Floodgate, upstream: &Sleeper) {
    let started = Instant::now();
    let mut settled_since: Option<Instant> = None;
    let mut seen = Vec::new();
    loop {
        let l = adaptive_cap(client, gate).await;
        seen.push(l);
        if (6.0..=12.0).contains(&l) {
            let since = *settled_since.get_or_insert_with(|| {
                upstream.reset_most();
                Instant::now()
            });
            if since.elapsed() >= Duration::from_secs(5) {
                break;
            }
        } else {
            settled_since = None;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the cap did not settle between 6 and 12: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        upstream.most() <= 13,
        "the upstream held {} at once while the cap was settled",
        upstream.most()
    );
    // Its latency stays near its floor of 40 ms (up to 8 at once).
    let mean = upstream.mean_latency_ms();
    println!(
        "settled: caps {seen:?}, mean latency {mean:.1} ms, most held {}",
        upstream.most()
    );
    assert!(mean <= 80.0, "mean latency {mean:.1} ms while settled");
}

/// The upstream speeds up (its knee moves to 32): the cap rises again.
async fn the_cap_rises_when_the_upstream_speeds_up(
    client: &TestClient,
    gate: &Floodgate,
    upstream: &Sleeper,
) {
    upstream.knee.store(32, Ordering::SeqCst);
    let raised = Instant::now();
    loop {
        let l = adaptive_cap(client, gate).await;
        if l >= 20.0 {
            break;
        }
        assert!(
            raised.elapsed() < Duration::from_secs(20),
            "the cap stayed at {l} after the upstream sped up"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn an_adaptive_cap_finds_the_upstream_knee_and_follows_it() {
    // 40 ms up to 8 requests at once, 40 ms more for each one past 8.
    let upstream = Arc::new(Sleeper::start(40, 8).await);
    let toml = Config::new()
        .admin()
        .route(Route::new("api").upstream(&upstream.url()).line(
            r#"concurrency = { adaptive = { min = 2, max = 64, interval = "250ms" }, queue = 200, queue_timeout = "10s" }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let running = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let load = steady_load(&client, &gate.url("/api"), &running);

    the_cap_settles_near_the_knee(&client, &gate, &upstream).await;
    the_cap_rises_when_the_upstream_speeds_up(&client, &gate, &upstream).await;

    running.store(false, Ordering::SeqCst);
    for task in load {
        let _ = task.await;
    }
    in_flight_returns_to_zero(&client, &gate, "api").await;
}

#[tokio::test]
async fn a_streamed_answer_holds_its_slot_until_its_body_is_sent() {
    let upstream = support::Upstream::start().await;
    let toml = Config::new()
        .admin()
        .route(
            Route::new("files")
                .upstream(&upstream.url())
                .line(r#"concurrency = { max_in_flight = 1 }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    // 64 MB, far more than the sockets buffer: it cannot all be sent
    // before the client reads it.
    let mut conn = support::http1_connection(gate.addr).await;
    let request = Request::get("/download?bytes=67108864")
        .header("host", "files")
        .body(support::empty())
        .expect("request");
    let response = conn.send_request(request).await.expect("response head");
    assert_eq!(response.status(), 200);
    assert_eq!(client.get(&gate.url("/other"), &[]).await.status, 503);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .expect("body")
        .to_bytes();
    assert_eq!(body.len(), 67_108_864);
    in_flight_returns_to_zero(&client, &gate, "files").await;
    assert_eq!(client.get(&gate.url("/other"), &[]).await.status, 200);
}

#[tokio::test]
async fn a_reload_keeps_an_unchanged_cap_and_what_it_counts() {
    let upstream = Sleeper::start(800, 1000).await;
    let dir = support::temp_dir("concurrency-reload");
    let path = dir.join("config.toml");
    let config = |other_limit: u64, cap: usize| {
        Config::new()
            .admin()
            .route(
                Route::new("api")
                    .upstream(&upstream.url())
                    .matching(r#"path_prefix = "/api""#)
                    .line(&format!("concurrency = {{ max_in_flight = {cap} }}")),
            )
            .route(Route::new("other").limit("sliding_log", other_limit, "60s"))
            .toml()
    };
    std::fs::write(&path, config(5, 1)).expect("write config");
    let gate = Floodgate::start_file(&path).await;
    let client = TestClient::http1();
    let holder = {
        let client = client.clone();
        let url = gate.url("/api");
        tokio::spawn(async move { client.get(&url, &[]).await.status.as_u16() })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    // Another route changes: the cap, and the request it holds, stay.
    std::fs::write(&path, config(6, 1)).expect("rewrite config");
    gate.reload.notify_one();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !client
        .get(&gate.url("/other"), &[])
        .await
        .header("ratelimit-policy")
        .is_some_and(|p| p.contains("q=6"))
    {
        assert!(Instant::now() < deadline, "the reload never applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(client.get(&gate.url("/api"), &[]).await.status, 503);
    assert_eq!(holder.await.expect("holder"), 200);
    in_flight_returns_to_zero(&client, &gate, "api").await;
}
