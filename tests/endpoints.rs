//! An upstream with several endpoints: requests are shared between them, an
//! endpoint that dies costs no request (what was never sent goes to the
//! other; GETs it dropped in flight go again), it is ejected, and it comes
//! back into rotation once it answers again. One that fails its active
//! health check is left out until it passes; a DNS name whose addresses
//! change is followed; each endpoint's metrics say what happened to it.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::{Floodgate, TestClient};
use tokio::task::{JoinHandle, JoinSet};

/// An upstream that answers its name (after 300 ms on `/slow`), and that
/// can be killed with every connection it holds, and started again on the
/// same port. `/healthz` answers 200 or 503 as `healthy` says, and is not
/// counted in `hits`.
struct Endpoint {
    name: &'static str,
    port: u16,
    hits: Arc<AtomicUsize>,
    /// The `POST`s among them.
    posts: Arc<AtomicUsize>,
    healthy: Arc<AtomicBool>,
    task: Option<JoinHandle<()>>,
}

impl Endpoint {
    async fn start(name: &'static str, port: u16) -> Self {
        Self::start_at(name, "127.0.0.1", port).await
    }

    async fn start_at(name: &'static str, ip: &str, port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind((ip, port))
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let hits = Arc::new(AtomicUsize::new(0));
        let posts = Arc::new(AtomicUsize::new(0));
        let healthy = Arc::new(AtomicBool::new(true));
        let counter = Arc::clone(&hits);
        let post_counter = Arc::clone(&posts);
        let health = Arc::clone(&healthy);
        let task = tokio::spawn(async move {
            // Connections live in this task's set: aborting it closes them.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let counter = Arc::clone(&counter);
                        let post_counter = Arc::clone(&post_counter);
                        let health = Arc::clone(&health);
                        connections.spawn(async move {
                            let service = service_fn(move |request: Request<Incoming>| {
                                let check = request.uri().path() == "/healthz";
                                let status = if check && !health.load(Ordering::SeqCst) {
                                    StatusCode::SERVICE_UNAVAILABLE
                                } else {
                                    StatusCode::OK
                                };
                                if !check {
                                    counter.fetch_add(1, Ordering::SeqCst);
                                }
                                if request.method() == hyper::Method::POST {
                                    post_counter.fetch_add(1, Ordering::SeqCst);
                                }
                                async move {
                                    if request.uri().path() == "/slow" {
                                        tokio::time::sleep(Duration::from_millis(300)).await;
                                    }
                                    let mut response =
                                        Response::new(Full::new(Bytes::from_static(name.as_bytes())));
                                    *response.status_mut() = status;
                                    Ok::<_, std::convert::Infallible>(response)
                                }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Self {
            name,
            port,
            hits,
            posts,
            healthy,
            task: Some(task),
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Kills it, and every connection it holds.
    async fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A configuration with the upstream "pair" of `a` and `b`, set up further
/// by `line`.
fn pair(a: &Endpoint, b: &Endpoint, line: &str) -> Config {
    Config::new().upstream(
        "pair",
        &[
            &format!(r#"endpoints = ["{}", "{}"]"#, a.url(), b.url()),
            line,
        ],
    )
}

/// `count` GETs of `path`, `at_once` at a time; every answer's status and
/// body.
async fn requests(
    gate: &Floodgate,
    path: &str,
    count: usize,
    at_once: usize,
) -> Vec<(u16, String)> {
    let client = TestClient::http1();
    let mut answers = Vec::with_capacity(count);
    let mut running = JoinSet::new();
    for i in 0..count {
        if running.len() == at_once
            && let Some(done) = running.join_next().await
        {
            answers.push(done.expect("request"));
        }
        let client = client.clone();
        let url = gate.url(&format!("{path}?i={i}"));
        running.spawn(async move {
            let answer = client.get(&url, &[]).await;
            (answer.status.as_u16(), answer.text())
        });
    }
    while let Some(done) = running.join_next().await {
        answers.push(done.expect("request"));
    }
    answers
}

/// The metric label naming `endpoint`.
fn endpoint_label(endpoint: &Endpoint) -> String {
    format!("endpoint=\"{}\"", endpoint.url())
}

/// 400 requests, 16 at a time, are all answered and split within 10 % of
/// even between `a` and `b`.
async fn the_load_is_shared_evenly(gate: &Floodgate, a: &Endpoint, b: &Endpoint) {
    let answers = requests(gate, "/x", 400, 16).await;
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "{answers:?}"
    );
    let (on_a, on_b) = (a.hits(), b.hits());
    assert_eq!(on_a + on_b, 400);
    assert!(
        (180..=220).contains(&on_a),
        "a took {on_a} of 400, b {on_b}: not within 10 % of even"
    );
}

/// Four slow GETs sent at once; the task returns their statuses.
fn four_slow_gets(gate: &Floodgate) -> JoinHandle<Vec<u16>> {
    let url = gate.url("/slow");
    tokio::spawn(async move {
        let client = TestClient::http1();
        let mut calls = JoinSet::new();
        for _ in 0..4 {
            let (client, url) = (client.clone(), url.clone());
            calls.spawn(async move { client.get(&url, &[]).await.status.as_u16() });
        }
        let mut statuses = Vec::new();
        while let Some(s) = calls.join_next().await {
            statuses.push(s.expect("call"));
        }
        statuses
    })
}

/// The dead endpoint's metrics say what happened to it: refused
/// connections, an ejection; the live one had no trouble.
async fn the_metrics_show_the_dead_endpoint_ejected(gate: &Floodgate, a: &Endpoint, b: &Endpoint) {
    let text = metrics(gate).await;
    let (on_a, on_b) = (endpoint_label(a), endpoint_label(b));
    let errors = |label: &str, kind: &str| {
        metric(
            &text,
            "floodgate_upstream_endpoint_errors_total",
            &[label, &format!("kind=\"{kind}\"")],
        )
    };
    assert!(
        metric(
            &text,
            "floodgate_upstream_endpoint_ejections_total",
            &[&on_b]
        ) >= 1.0,
        "{text}"
    );
    assert!(errors(&on_b, "connect") >= 1.0, "{text}");
    for kind in ["connect", "timeout", "protocol"] {
        assert_eq!(errors(&on_a, kind), 0.0, "{text}");
    }
    assert_eq!(
        metric(
            &text,
            "floodgate_upstream_endpoint_ejections_total",
            &[&on_a]
        ),
        0.0
    );
}

/// Back on its port once its ejection has ended, `b` takes a share of 100
/// requests again; both endpoints end healthy with nothing in flight, and
/// each counts every request sent to it, `b` also the failed attempts.
async fn the_restarted_endpoint_takes_its_share_again(
    gate: &Floodgate,
    a: &Endpoint,
    b: &Endpoint,
    b_again: &Endpoint,
) {
    let later = requests(gate, "/z", 100, 4).await;
    assert!(later.iter().all(|(status, _)| *status == 200), "{later:?}");
    assert!(
        b_again.hits() >= 20,
        "the restarted endpoint took {} of 100",
        b_again.hits()
    );
    let text = metrics(gate).await;
    let (on_a, on_b) = (endpoint_label(a), endpoint_label(b));
    for label in [&on_a, &on_b] {
        assert_eq!(
            metric(&text, "floodgate_upstream_endpoint_in_flight", &[label]),
            0.0
        );
        assert_eq!(
            metric(&text, "floodgate_upstream_endpoint_healthy", &[label]),
            1.0
        );
    }
    // Every request that reached a counts there; b's count also holds the
    // attempts that failed on it.
    let sent = |label: &str| {
        metric(
            &text,
            "floodgate_upstream_endpoint_requests_total",
            &[label],
        )
    };
    assert!(sent(&on_a) >= a.hits() as f64, "{text}");
    assert!(sent(&on_b) > (b.hits() + b_again.hits()) as f64, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_share_the_load_and_one_that_dies_costs_no_request() {
    let a = Endpoint::start("a", 0).await;
    let mut b = Endpoint::start("b", 0).await;
    let toml = pair(&a, &b, r#"eject_for = "1s""#)
        .route(Route::new("all").upstream("pair"))
        .admin()
        .toml();
    let gate = Floodgate::start(&toml).await;
    the_load_is_shared_evenly(&gate, &a, &b).await;

    // Slow GETs in flight on both when b dies: none is lost.
    let slow = four_slow_gets(&gate);
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.kill().await;
    let after = requests(&gate, "/y", 200, 8).await;
    assert!(
        after
            .iter()
            .all(|(status, body)| *status == 200 && body == "a"),
        "a request failed or reached the dead endpoint: {:?}",
        after.iter().find(|(s, b)| *s != 200 || b != "a")
    );
    assert_eq!(slow.await.expect("slow calls"), [200, 200, 200, 200]);
    the_metrics_show_the_dead_endpoint_ejected(&gate, &a, &b).await;

    // Back on its port, it is tried again once its ejection ends.
    let b_again = Endpoint::start(b.name, b.port).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    the_restarted_endpoint_takes_its_share_again(&gate, &a, &b, &b_again).await;
}

/// GETs in flight to an endpoint that dies, on connections new and reused
/// alike, are answered by the other endpoint; a `POST` in flight there gets
/// `502` and is never sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_gets_to_a_dying_endpoint_go_to_the_other_and_a_post_is_never_repeated() {
    let a = Endpoint::start("a", 0).await;
    let mut b = Endpoint::start("b", 0).await;
    let toml = pair(&a, &b, r#"balance = "round_robin""#)
        .route(Route::new("all").upstream("pair"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    // Four connections to each endpoint are pooled; the twenty GETs below
    // take those and open new ones.
    let warm = requests(&gate, "/warm", 8, 8).await;
    assert!(warm.iter().all(|(s, _)| *s == 200), "{warm:?}");
    let client = TestClient::http1();
    let mut calls = JoinSet::new();
    // The POSTs first, each in flight before the next is sent: round robin
    // gives two to each endpoint, whatever order the tasks run in.
    for i in 0..4 {
        let (client, url) = (client.clone(), gate.url(&format!("/slow?post={i}")));
        calls.spawn(async move {
            let request = hyper::Request::post(&url)
                .body(support::text_body("order"))
                .expect("request");
            let answer = client.send(request).await;
            ("POST", answer.status.as_u16(), answer.text())
        });
        while a.posts.load(Ordering::SeqCst) + b.posts.load(Ordering::SeqCst) < i + 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for i in 0..20 {
        let (client, url) = (client.clone(), gate.url(&format!("/slow?get={i}")));
        calls.spawn(async move {
            let answer = client.get(&url, &[]).await;
            ("GET", answer.status.as_u16(), answer.text())
        });
    }
    // Every request has reached its endpoint before b dies.
    while a.hits() + b.hits() < 8 + 24 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (posts_on_a, posts_on_b) = (
        a.posts.load(Ordering::SeqCst),
        b.posts.load(Ordering::SeqCst),
    );
    b.kill().await;
    let mut answers = Vec::new();
    while let Some(done) = calls.join_next().await {
        answers.push(done.expect("call"));
    }
    let gets: Vec<_> = answers.iter().filter(|(m, _, _)| *m == "GET").collect();
    assert!(
        gets.iter()
            .all(|(_, status, body)| *status == 200 && body == "a"),
        "a GET was lost with the endpoint: {gets:?}"
    );
    let posts: Vec<_> = answers.iter().filter(|(m, _, _)| *m == "POST").collect();
    assert!(
        posts_on_b >= 1,
        "no POST was in flight on b ({posts_on_a} on a)"
    );
    assert_eq!(
        posts.iter().filter(|(_, status, _)| *status == 502).count(),
        posts_on_b,
        "{posts:?}"
    );
    assert_eq!(
        posts.iter().filter(|(_, status, _)| *status == 200).count(),
        posts_on_a,
        "{posts:?}"
    );
    // None was sent twice: a saw only its own.
    assert_eq!(a.posts.load(Ordering::SeqCst), posts_on_a);
}

/// The admin listener's `/metrics` text.
async fn metrics(gate: &Floodgate) -> String {
    TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text()
}

/// The value of the one sample of `name` whose labels include every one
/// of `labels` (each written `key="value"`); 0 when none does, and a
/// failure when several do.
fn metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    let found: Vec<f64> = text
        .lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                && labels.iter().all(|l| line.contains(l))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse().ok())
        .collect();
    assert!(found.len() <= 1, "{name} {labels:?} matches {found:?}");
    found.first().copied().unwrap_or(0.0)
}

/// Waits up to `within` for `met` to say yes, asking every 50 ms.
async fn eventually<F, Fut>(within: Duration, what: &str, mut met: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + within;
    while !met().await {
        assert!(
            tokio::time::Instant::now() < until,
            "not within {within:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_its_health_check_is_left_out_until_it_passes_again() {
    let a = Endpoint::start("a", 0).await;
    let b = Endpoint::start("b", 0).await;
    let toml = Config::new()
        .upstream(
            "pair",
            &[
                &format!(r#"endpoints = ["{}", "{}"]"#, a.url(), b.url()),
                r#"health_check = { path = "/healthz", every = "100ms", timeout = "1s", unhealthy_after = 2, healthy_after = 2 }"#,
            ],
        )
        .route(Route::new("all").upstream("pair"))
        .admin()
        .toml();
    let gate = Floodgate::start(&toml).await;
    let healthy = |endpoint: &Endpoint| {
        let label = format!("endpoint=\"{}\"", endpoint.url());
        let gate = &gate;
        async move {
            metric(
                &metrics(gate).await,
                "floodgate_upstream_endpoint_healthy",
                &[&label],
            )
        }
    };

    let answers = requests(&gate, "/x", 100, 4).await;
    assert!(answers.iter().all(|(s, _)| *s == 200), "{answers:?}");
    assert!(
        a.hits() >= 20 && b.hits() >= 20,
        "a {} b {}",
        a.hits(),
        b.hits()
    );

    b.healthy.store(false, Ordering::SeqCst);
    eventually(Duration::from_secs(3), "b is marked unhealthy", || async {
        healthy(&b).await == 0.0
    })
    .await;
    let before = b.hits();
    let answers = requests(&gate, "/y", 100, 4).await;
    assert!(
        answers.iter().all(|(s, body)| *s == 200 && body == "a"),
        "{answers:?}"
    );
    assert_eq!(b.hits(), before, "b took requests while failing its check");
    assert_eq!(healthy(&a).await, 1.0);

    // Both failing: the set is never empty, requests are still served.
    a.healthy.store(false, Ordering::SeqCst);
    eventually(Duration::from_secs(3), "a is marked unhealthy", || async {
        healthy(&a).await == 0.0
    })
    .await;
    let answers = requests(&gate, "/z", 20, 4).await;
    assert!(answers.iter().all(|(s, _)| *s == 200), "{answers:?}");

    a.healthy.store(true, Ordering::SeqCst);
    b.healthy.store(true, Ordering::SeqCst);
    eventually(Duration::from_secs(3), "b passes again", || async {
        healthy(&b).await == 1.0 && healthy(&a).await == 1.0
    })
    .await;
    let before = b.hits();
    let answers = requests(&gate, "/w", 100, 4).await;
    assert!(answers.iter().all(|(s, _)| *s == 200), "{answers:?}");
    assert!(
        b.hits() - before >= 20,
        "b took {} of 100 once healthy again",
        b.hits() - before
    );
}

/// Lines of `/etc/hosts` for one name, removed again when dropped: the
/// test's own resolver records, read by the system resolver floodgate uses.
struct HostsEntry {
    name: String,
}

impl HostsEntry {
    const FILE: &'static str = "/etc/hosts";

    fn new(name: &str, addresses: &[&str]) -> Self {
        let entry = Self {
            name: name.to_owned(),
        };
        entry.point_to(addresses);
        entry
    }

    /// The name resolves to `addresses` from now on.
    fn point_to(&self, addresses: &[&str]) {
        let mut text = self.others();
        for address in addresses {
            text.push_str(&format!("{address} {}\n", self.name));
        }
        std::fs::write(Self::FILE, text).unwrap_or_else(|e| {
            panic!(
                "this test controls DNS through {}, which it cannot write ({e}); run it as root, as CI does",
                Self::FILE
            )
        });
    }

    /// The file without this name's lines.
    fn others(&self) -> String {
        let text = std::fs::read_to_string(Self::FILE).unwrap_or_default();
        let suffix = format!(" {}", self.name);
        text.lines()
            .filter(|line| !line.ends_with(&suffix))
            .map(|line| format!("{line}\n"))
            .collect()
    }
}

impl Drop for HostsEntry {
    fn drop(&mut self) {
        let _ = std::fs::write(Self::FILE, self.others());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_whose_addresses_change_is_followed() {
    let a = Endpoint::start_at("a", "127.0.0.1", 0).await;
    let b = Endpoint::start_at("b", "127.0.0.2", a.port).await;
    let name = format!("floodgate-dns-{}.test", std::process::id());
    let hosts = HostsEntry::new(&name, &["127.0.0.1"]);
    let toml = Config::new()
        .upstream(
            "named",
            &[
                &format!(r#"url = "http://{name}:{}""#, a.port),
                r#"resolve_every = "200ms""#,
            ],
        )
        .route(Route::new("all").upstream("named"))
        .admin()
        .toml();
    let gate = Floodgate::start(&toml).await;
    let answers = requests(&gate, "/x", 40, 4).await;
    assert!(
        answers.iter().all(|(s, body)| *s == 200 && body == "a"),
        "{answers:?}"
    );

    // The record changes: new requests go to the new address, and none
    // after that goes to the old one over a kept-alive connection.
    hosts.point_to(&["127.0.0.2"]);
    eventually(Duration::from_secs(5), "requests reach b", || async {
        requests(&gate, "/y", 4, 1)
            .await
            .iter()
            .all(|(_, body)| body == "b")
    })
    .await;
    let a_before = a.hits();
    let answers = requests(&gate, "/z", 40, 4).await;
    assert!(
        answers.iter().all(|(s, body)| *s == 200 && body == "b"),
        "{answers:?}"
    );
    assert_eq!(a.hits(), a_before);

    // Two records, as a headless service has: both addresses take requests,
    // each an endpoint with series of its own.
    hosts.point_to(&["127.0.0.1", "127.0.0.2"]);
    let address = |ip: &str| format!("address=\"{ip}:{}\"", a.port);
    eventually(
        Duration::from_secs(5),
        "both addresses are endpoints",
        || async {
            let text = metrics(&gate).await;
            ["127.0.0.1", "127.0.0.2"].iter().all(|ip| {
                text.lines().any(|l| {
                    l.starts_with("floodgate_upstream_endpoint_healthy")
                        && l.contains(&address(ip))
                        && l.contains("upstream=\"named\"")
                })
            })
        },
    )
    .await;
    let (a_before, b_before) = (a.hits(), b.hits());
    let answers = requests(&gate, "/w", 100, 4).await;
    assert!(answers.iter().all(|(s, _)| *s == 200), "{answers:?}");
    let (on_a, on_b) = (a.hits() - a_before, b.hits() - b_before);
    assert!(on_a >= 30 && on_b >= 30, "a took {on_a}, b {on_b} of 100");
    let text = metrics(&gate).await;
    let endpoint = format!("endpoint=\"http://{name}:{}\"", a.port);
    assert!(
        metric(
            &text,
            "floodgate_upstream_endpoint_requests_total",
            &[&endpoint, &address("127.0.0.2")]
        ) >= on_b as f64,
        "{text}"
    );
}
