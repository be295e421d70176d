//! Usage-based limits end to end: routes whose cost is what their upstream
//! reports, reserved before forwarding and settled in Redis to the units a
//! real upstream reports in a header, a JSON body, an event stream's last
//! event and gRPC trailers, with two floodgate instances sharing one Redis.
//! Every count is read back from Redis and compared with a model the test
//! keeps.

mod support;

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::peers::{PeerServer, client};
use support::redis::{TestRedis, unique_prefix};
use support::{Chunks, Floodgate, FloodgateProcess, TestClient, free_port, text_body};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::sync::mpsc::Sender;

/// A metered API: it reports the units it was asked to in the query
/// (`?in=N&out=M`), the way its path says.
///
/// - `/header`: in `x-usage-input` and `x-usage-output`;
/// - `/json`: as `usage.input_units` and `usage.output_units` of a JSON
///   body sent in pieces; `/json/none` sends no usage;
/// - `/sse`: in the last of several `text/event-stream` events (an earlier
///   one carries other numbers);
/// - `/held`: as `/json`, once the test lets it answer (`release`);
/// - `/sse/held`: one event, then the rest once released;
/// - `/sse/done-held`: the usage event and `data: [DONE]`, then the
///   stream's end once released (as a server whose stream outlives its
///   last event).
struct Metered {
    url: String,
    /// Requests that arrived, held or not.
    arrived: Arc<AtomicUsize>,
    /// Held answers go on one per permit.
    release: Arc<Semaphore>,
}

impl Metered {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let arrived = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(Semaphore::new(0));
        let (count, gate) = (Arc::clone(&arrived), Arc::clone(&release));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (count, gate) = (Arc::clone(&count), Arc::clone(&gate));
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        count.fetch_add(1, Ordering::SeqCst);
                        answer(req, Arc::clone(&gate))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            url,
            arrived,
            release,
        }
    }
}

impl Metered {
    /// Waits until `n` requests have reached the upstream (long enough
    /// for a loaded machine; it ends as soon as they have), and insists.
    async fn until_arrived(&self, n: usize) {
        for _ in 0..600 {
            if self.arrived.load(Ordering::SeqCst) == n {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            self.arrived.load(Ordering::SeqCst),
            n,
            "requests never reached the upstream"
        );
    }
}

/// Sends a whole event stream with its usage and `[DONE]`, then holds the
/// body open until `gate` lets it go: the body ends when `tx` goes.
fn stream_done_then_hold(tx: Sender<Bytes>, gate: Arc<Semaphore>, usage: &str) {
    let events = format!(
        "data: {{\"delta\":\"Hi\"}}\n\ndata: {{\"choices\":[],{usage}}}\n\ndata: [DONE]\n\n"
    );
    tokio::spawn(async move {
        let _ = tx.send(Bytes::from(events)).await;
        if let Ok(permit) = gate.acquire().await {
            permit.forget();
        }
        // The body ends when `tx` goes.
    });
}

/// Sends an event stream whose first event carries a partial usage and a
/// later `done` event the whole `usage`; when `held`, waits for `gate`
/// after the first event.
fn stream_usage_in_pieces(tx: Sender<Bytes>, gate: Arc<Semaphore>, usage: &str, held: bool) {
    let first = "data: {\"delta\":\"Hel\",\"usage\":{\"input_units\":1,\"output_units\":1}}\n\n";
    let rest = vec![
        "data: {\"delta\":\"lo\"}\n\n".to_owned(),
        format!("event: done\ndata: {{{usage}}}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ];
    tokio::spawn(async move {
        let _ = tx.send(Bytes::from(first)).await;
        if held {
            let Ok(permit) = gate.acquire().await else {
                return;
            };
            permit.forget();
        }
        for piece in rest {
            if tx.send(Bytes::from(piece)).await.is_err() {
                return;
            }
        }
    });
}

async fn answer(
    req: Request<Incoming>,
    gate: Arc<Semaphore>,
) -> Result<Response<Chunks>, Infallible> {
    let (req, body) = req.into_parts();
    // The request body arrives whole: its length is told back.
    let length = body.collect().await.map_or(0, |b| b.to_bytes().len());
    let query = req.uri.query().unwrap_or("");
    let number = |key: &str| {
        query
            .split('&')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let (input, output) = (number("in"), number("out"));
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut response = Response::builder().header("x-body-length", length);
    let usage = format!(r#""usage":{{"input_units":{input},"output_units":{output}}}"#);
    let pieces: Vec<String> = match req.uri.path() {
        "/header" => {
            response = response
                .header("x-usage-input", input)
                .header("x-usage-output", output);
            vec!["ok".into()]
        }
        "/json" | "/held" => {
            if req.uri.path() == "/held" {
                gate.acquire().await.expect("semaphore").forget();
            }
            // Cut inside the usage object, as a network may.
            let body = format!(r#"{{"id":"r1","text":"a \"usage\": {{}}",{usage}}}"#);
            let (a, b) = body.split_at(body.len() - 12);
            vec![a.into(), b.into()]
        }
        "/json/none" => vec![r#"{"id":"r1","text":"no usage here"}"#.into()],
        "/json/failed" => {
            response = response.status(400);
            vec![r#"{"error":{"message":"bad request"}}"#.into()]
        }
        "/sse/done-held" => {
            response = response.header("content-type", "text/event-stream");
            stream_done_then_hold(tx.clone(), gate, &usage);
            Vec::new()
        }
        "/sse" | "/sse/held" => {
            response = response.header("content-type", "text/event-stream");
            let held = req.uri.path() == "/sse/held";
            stream_usage_in_pieces(tx.clone(), gate, &usage, held);
            Vec::new()
        }
        _ => vec!["not a metered path".into()],
    };
    tokio::spawn(async move {
        for piece in pieces {
            let _ = tx.send(Bytes::from(piece)).await;
        }
    });
    Ok(response.body(Chunks(rx)).expect("response"))
}

/// A floodgate on a fresh Redis prefix named for `test`, with an admin
/// listener and route `sse` metering the `Metered` API's event streams,
/// reserving `reserve`.
async fn metered_stream(test: &str, reserve: u64) -> (TestRedis, String, Metered, Floodgate) {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix(test);
    let api = Metered::start().await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .admin()
        .route(metered(
            "sse",
            "/sse",
            &api.url,
            10_000,
            &format!(r#"reserve = {reserve}, report = "sse", units = {{ "usage.input_units" = 1, "usage.output_units" = 1 }}"#),
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    (redis, prefix, api, gate)
}

/// Asks floodgate at `addr` for `target` on a raw connection, reads the
/// answer until `seen` has passed, and goes away.
async fn read_then_leave(addr: std::net::SocketAddr, target: &str, seen: &str) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream
        .write_all(format!("GET {target} HTTP/1.1\r\nhost: api\r\n\r\n").as_bytes())
        .await
        .expect("send");
    let mut read = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&read).contains(seen) {
        let n = stream.read(&mut buf).await.expect("read");
        assert!(
            n > 0,
            "the answer ended early: {}",
            String::from_utf8_lossy(&read)
        );
        read.extend_from_slice(&buf[..n]);
    }
}

/// A route for the paths under `path`, forwarding to `url`, counted in a
/// sliding log (so Redis holds one member per unit: its size is the
/// charge) of `budget` units an hour, metered as `usage` says.
fn metered(name: &str, path: &str, url: &str, budget: u64, usage: &str) -> Route {
    Route::new(name)
        .upstream(url)
        .matching(&format!(r#"path_prefix = "{path}""#))
        .limit("sliding_log", budget, "1h")
        .line(&format!("usage = {{ {usage} }}"))
}

/// Units charged to route `route` in Redis: the members of its one key.
async fn charged(redis: &TestRedis, prefix: &str, route: &str) -> u64 {
    let keys = redis.keys(&format!("{prefix}:{{{route}:*")).await;
    let Some(key) = keys.first() else {
        return 0;
    };
    redis::cmd("ZCARD")
        .arg(key)
        .query_async(&mut redis.connection().await)
        .await
        .expect("zcard")
}

/// Waits until route `route` has `want` units charged, for settlements
/// that happen when a body ends; returns what it found last. The wait is
/// long enough for a loaded machine: it ends as soon as the count is there.
async fn settled(redis: &TestRedis, prefix: &str, route: &str, want: u64) -> u64 {
    let mut found = 0;
    for _ in 0..600 {
        found = charged(redis, prefix, route).await;
        if found == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    found
}

/// `r` of a `RateLimit` field: the units remaining.
fn remaining(field: &str) -> Option<u64> {
    field
        .split(';')
        .find_map(|p| p.strip_prefix("r=")?.parse().ok())
}

#[tokio::test]
async fn units_reported_in_a_header_a_json_body_and_an_event_stream_are_settled_exactly_across_two_instances()
 {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-sources");
    let api = Metered::start().await;
    let weights = r#"reserve = 500, units = { "usage.input_units" = 1, "usage.output_units" = 2 }"#;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(metered(
            "header",
            "/header",
            &api.url,
            1_000_000,
            r#"reserve = 500, report = "header", units = { "X-Usage-Input" = 1, "X-Usage-Output" = 2 }"#,
        ))
        .route(metered(
            "json",
            "/json",
            &api.url,
            1_000_000,
            &format!(r#"report = "json", {weights}"#),
        ))
        .route(metered(
            "sse",
            "/sse",
            &api.url,
            1_000_000,
            &format!(r#"report = "sse", {weights}"#),
        ))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let client = TestClient::http1();

    // (input, output): output units weigh 2. The last is past the
    // reservation of 500: the 100 beyond it are charged when settled.
    let reports = [(12, 30), (0, 0), (200, 100), (7, 1), (100, 250), (3, 4)];
    let mut model = 0u64;
    for (i, (input, output)) in reports.into_iter().enumerate() {
        let gate = &gates[i % 2];
        let units = input + 2 * output;
        model += units;
        let query = format!("?in={input}&out={output}");

        let answer = client.get(&gate.url(&format!("/header{query}")), &[]).await;
        assert_eq!(answer.status, 200);
        // Settled before the head went out: the fields show the charge.
        let field = answer.header("ratelimit").expect("a RateLimit field");
        assert_eq!(remaining(field), Some(1_000_000 - model), "{field}");

        for path in ["/json", "/sse"] {
            let answer = client.get(&gate.url(&format!("{path}{query}")), &[]).await;
            assert_eq!(answer.status, 200, "{path}");
            assert!(!answer.body.is_empty(), "{path}");
        }
    }
    // Each route's Redis state is the sum of what was reported, exactly.
    assert_eq!(charged(&redis, &prefix, "header").await, model);
    assert_eq!(settled(&redis, &prefix, "json", model).await, model);
    assert_eq!(settled(&redis, &prefix, "sse", model).await, model);
}

#[tokio::test]
async fn units_in_grpc_trailers_are_settled() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-grpc");
    let server = PeerServer::start("grpc_peer.py");
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .upstream(
            "grpc",
            &[
                &format!(r#"url = "http://127.0.0.1:{}""#, server.port),
                r#"protocol = "h2c""#,
            ],
        )
        .route(
            Route::new("grpc")
                .upstream("grpc")
                .limit("sliding_log", 10_000, "1h")
                .line(r#"usage = { reserve = 50, report = "trailer", units = { "x-usage-units" = 1 } }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let units = ["7", "13", "0", "60"];
    let args: Vec<String> = ["metered".to_owned(), gate.addr.to_string()]
        .into_iter()
        .chain(units.iter().map(|u| (*u).to_owned()))
        .collect();
    let calls = client("grpc_peer.py", &args).await;
    assert_eq!(calls.len(), units.len());
    for (call, units) in calls.iter().zip(units) {
        assert_eq!(call["code"], "OK", "{call}");
        assert_eq!(call["trailers"]["x-usage-units"], units, "{call}");
    }
    // 7 + 13 + 0 + 60: the last 10 past its reservation of 50.
    assert_eq!(settled(&redis, &prefix, "grpc", 80).await, 80);
}

#[tokio::test]
async fn fifty_parallel_requests_reserving_their_maximum_never_exceed_the_budget() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-parallel");
    let api = Metered::start().await;
    // A budget of 1 000 units; each request may use up to 100.
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(metered(
            "held",
            "/held",
            &api.url,
            1_000,
            r#"reserve = 100, reserve_header = "x-max-units", max_reserve = 100, report = "json", units = { "usage.input_units" = 1, "usage.output_units" = 1 }"#,
        ))
        .toml();
    let gates = Arc::new([Floodgate::start(&toml).await, Floodgate::start(&toml).await]);
    let denied = Arc::new(AtomicUsize::new(0));
    let mut calls = tokio::task::JoinSet::new();
    for i in 0..50 {
        let (gates, denied) = (Arc::clone(&gates), Arc::clone(&denied));
        calls.spawn(async move {
            let url = gates[i % 2].url("/held?in=10&out=15");
            let answer = TestClient::http1()
                .get(&url, &[("x-max-units", "100")])
                .await;
            if answer.status == 429 {
                denied.fetch_add(1, Ordering::SeqCst);
            }
            answer.status.as_u16()
        });
    }
    // Every decision is made while the admitted requests are held
    // upstream, before any is settled.
    for _ in 0..1_200 {
        if denied.load(Ordering::SeqCst) == 40 && api.arrived.load(Ordering::SeqCst) == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(denied.load(Ordering::SeqCst), 40);
    assert_eq!(
        api.arrived.load(Ordering::SeqCst),
        10,
        "the budget allows 10"
    );
    assert_eq!(charged(&redis, &prefix, "held").await, 1_000);

    api.release.add_permits(10);
    let mut statuses = Vec::new();
    while let Some(status) = calls.join_next().await {
        statuses.push(status.expect("call"));
    }
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 10);
    assert_eq!(api.arrived.load(Ordering::SeqCst), 10);
    // Settled: each used 25 of its 100.
    assert_eq!(settled(&redis, &prefix, "held", 250).await, 250);
}

/// The value of the series `name{labels}` in a scrape, 0 when absent.
fn series(scrape: &str, name: &str, labels: &str) -> u64 {
    scrape
        .lines()
        .find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix('{')?;
            let (have, value) = rest.split_once("} ")?;
            let mut have: Vec<&str> = have.split(',').collect();
            let mut want: Vec<&str> = labels.split(',').collect();
            have.sort_unstable();
            want.sort_unstable();
            (have == want).then(|| value.trim().parse::<f64>().ok())?
        })
        .map_or(0, |v| v as u64)
}

/// Scrapes `metrics` until the series `name{labels}` is `want` (settled in
/// the background: the wait ends as soon as it is), and returns the last
/// scrape.
async fn scrape_until(metrics: &str, name: &str, labels: &str, want: u64) -> String {
    let client = TestClient::http1();
    let mut scrape = String::new();
    for _ in 0..600 {
        scrape = String::from_utf8_lossy(&client.get(metrics, &[]).await.body).into_owned();
        if series(&scrape, name, labels) == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    scrape
}

/// The scrape of instance `admin`: two reservations of 40, 3 reported and
/// 37 given back, one answer without its units, and three Redis calls.
async fn the_metrics_show_one_answer_without_units(admin: u16) {
    let metrics = format!("http://127.0.0.1:{admin}/metrics");
    let reported = r#"route="json",kind="reported""#;
    let scrape = scrape_until(&metrics, "floodgate_usage_units_total", reported, 3).await;
    let units = |kind: &str| {
        series(
            &scrape,
            "floodgate_usage_units_total",
            &format!(r#"route="json",kind="{kind}""#),
        )
    };
    assert_eq!(
        [
            units("reserved"),
            units("reported"),
            units("refunded"),
            units("charged_over")
        ],
        [80, 3, 37, 0],
        "{scrape}"
    );
    let unreported = |reason: &str| {
        series(
            &scrape,
            "floodgate_usage_unreported_total",
            &format!(r#"route="json",reason="{reason}""#),
        )
    };
    assert_eq!(unreported("missing"), 1, "{scrape}");
    assert_eq!(unreported("client_left"), 0, "{scrape}");
    // One Redis call per decision and one per settlement: none for the
    // answer that reported nothing.
    let calls = scrape
        .lines()
        .find_map(|l| l.strip_prefix("floodgate_redis_calls_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert_eq!(calls, Some(3.0), "{scrape}");
}

/// The access log's two lines: both reserved 40; only the second reported
/// its 3 units.
async fn the_access_log_shows_the_units_of_each_answer(path: &Path) {
    let access = path.with_file_name("access.log");
    let mut lines = Vec::new();
    for _ in 0..600 {
        lines = std::fs::read_to_string(&access)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
            .collect();
        if lines.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["units_reserved"], 40);
    assert!(lines[0].get("units_reported").is_none(), "{}", lines[0]);
    assert_eq!(lines[1]["units_reserved"], 40);
    assert_eq!(lines[1]["units_reported"], 3);
}

#[tokio::test]
async fn an_answer_without_its_units_leaves_the_reservation_counted_logged_and_shown() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-missing");
    let api = Metered::start().await;
    let (port, admin) = (free_port(), free_port());
    let path = Config::new()
        .redis(&redis.url, &prefix)
        .listen_on(port)
        .admin_on(admin)
        .access_log(&[r#"path = "access.log""#])
        .route(metered(
            "json",
            "/json",
            &api.url,
            10_000,
            r#"reserve = 40, report = "json", units = { "usage.output_units" = 1 }"#,
        ))
        .write("usage-missing");
    let stderr = path.with_file_name("stderr.log");
    let process = FloodgateProcess::spawn_logging(&path, port, &[], &[], &stderr).await;
    let client = TestClient::http1();

    assert_eq!(
        client.get(&process.url("/json/none"), &[]).await.status,
        200
    );
    assert_eq!(
        client.get(&process.url("/json?out=3"), &[]).await.status,
        200
    );
    // The first stands at its reservation of 40; the second settles to 3.
    assert_eq!(settled(&redis, &prefix, "json", 43).await, 43);

    the_metrics_show_one_answer_without_units(admin).await;

    let logged = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert!(
        logged.lines().any(|l| l.contains("usage not settled")
            && l.contains("missing")
            && l.contains("json")),
        "{logged}"
    );
    the_access_log_shows_the_units_of_each_answer(&path).await;
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_is_charged_its_reservation_once() {
    let (redis, prefix, api, gate) = metered_stream("usage-left", 70).await;

    // A raw connection that reads the first event and goes away.
    read_then_leave(gate.addr, "/sse/held?in=5&out=5", "Hel").await;

    let client = TestClient::http1();
    let metrics = gate.admin_url("/metrics");
    let left = r#"route="sse",reason="client_left""#;
    let scrape = scrape_until(&metrics, "floodgate_usage_unreported_total", left, 1).await;
    assert_eq!(
        series(&scrape, "floodgate_usage_unreported_total", left),
        1,
        "{scrape}"
    );
    // The upstream may go on now: nothing reads it, nothing more is charged.
    api.release.add_permits(1);
    assert_eq!(charged(&redis, &prefix, "sse").await, 70);
    // A whole stream after it settles to its report, beside the 70.
    let answer = client.get(&gate.url("/sse?in=2&out=3"), &[]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(settled(&redis, &prefix, "sse", 75).await, 75);
    let scrape = String::from_utf8_lossy(&client.get(&metrics, &[]).await.body).into_owned();
    assert_eq!(
        series(&scrape, "floodgate_usage_unreported_total", left),
        1,
        "counted once: {scrape}"
    );
}

#[tokio::test]
async fn requests_and_units_on_one_route_each_refuse_at_their_own_bound() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-requests");
    let api = Metered::start().await;
    let route = Route::new("both")
        .upstream(&api.url)
        .matching(r#"path_prefix = "/header""#)
        .client(r#"from = "header", name = "X-Key""#)
        .limits(r#"{ algorithm = "sliding_log", limit = 10, window = "1h", counts = "requests" }"#)
        .limits(r#"{ algorithm = "sliding_log", limit = 2000, window = "1h" }"#)
        .line(r#"usage = { reserve = 500, report = "header", units = { "x-usage-input" = 1, "x-usage-output" = 1 } }"#);
    let in_memory = Config::new().route(route.clone()).toml();
    let in_redis = Config::new().redis(&redis.url, &prefix).route(route).toml();
    for toml in [in_memory, in_redis] {
        let gate = Floodgate::start(&toml).await;
        let client = TestClient::http1();
        // Small answers: the request limit refuses the eleventh.
        for i in 0..10 {
            let a = client
                .get(&gate.url("/header?in=1&out=1"), &[("x-key", "chatty")])
                .await;
            assert_eq!(a.status, 200, "request {i}");
        }
        let refused = client
            .get(&gate.url("/header?in=1&out=1"), &[("x-key", "chatty")])
            .await;
        assert_eq!(refused.status, 429);
        assert_eq!(refused.header("ratelimit"), Some("\"both.1\";r=0;t=3600"));
        // Large answers: 300 units each, reserved 500. Six settle to 1 800;
        // the seventh's 500 do not fit the 2 000, with requests to spare.
        for i in 0..6 {
            let a = client
                .get(&gate.url("/header?in=100&out=200"), &[("x-key", "wordy")])
                .await;
            assert_eq!(a.status, 200, "request {i}");
        }
        let refused = client
            .get(&gate.url("/header?in=100&out=200"), &[("x-key", "wordy")])
            .await;
        assert_eq!(refused.status, 429);
        assert_eq!(
            refused
                .header("ratelimit")
                .map(|v| v.split(";t=").next().unwrap_or("").to_owned()),
            Some("\"both.2\";r=200".to_owned())
        );
    }
    // In Redis: 16 requests in the request logs, whatever the answers
    // reported; 10 × 2 + 6 × 300 in the unit logs.
    assert_eq!(
        redis
            .logged(&format!("{prefix}:{{both:*}}:0:sliding_log:*"))
            .await,
        16
    );
    assert_eq!(
        redis
            .logged(&format!("{prefix}:{{both:*}}:1:sliding_log:*"))
            .await,
        20 + 1_800
    );
}

#[tokio::test]
async fn a_failed_answer_without_usage_is_settled_to_the_failed_charge() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-failed");
    let api = Metered::start().await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .admin()
        .route(metered(
            "json",
            "/json",
            &api.url,
            10_000,
            r#"reserve = 70, report = "json", units = { "usage.input_units" = 1 }, failed = { statuses = [400, 500], charge = 2 }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    // A 400 without usage: charged 2, not its 70.
    assert_eq!(client.get(&gate.url("/json/failed"), &[]).await.status, 400);
    assert_eq!(settled(&redis, &prefix, "json", 2).await, 2);
    // A 200 without usage is not a failed answer: its 70 stand.
    assert_eq!(client.get(&gate.url("/json/none"), &[]).await.status, 200);
    assert_eq!(settled(&redis, &prefix, "json", 72).await, 72);
    let scrape = String::from_utf8_lossy(&client.get(&gate.admin_url("/metrics"), &[]).await.body)
        .into_owned();
    for (reason, want) in [("failed_answer", 1), ("missing", 1)] {
        let labels = format!(r#"route="json",reason="{reason}""#);
        assert_eq!(
            series(&scrape, "floodgate_usage_unreported_total", &labels),
            want,
            "{reason}: {scrape}"
        );
    }
}

#[tokio::test]
async fn a_client_that_closes_at_done_after_the_usage_event_is_settled_to_its_report() {
    let (redis, prefix, api, gate) = metered_stream("usage-done", 400).await;
    // As the OpenAI SDK does: read to `data: [DONE]`, then close, before
    // the stream's own end.
    for _ in 0..3 {
        read_then_leave(gate.addr, "/sse/done-held?in=100&out=55", "[DONE]").await;
    }
    // Each settled to its 155, not its reservation of 400.
    assert_eq!(settled(&redis, &prefix, "sse", 465).await, 465);
    let client = TestClient::http1();
    let scrape = String::from_utf8_lossy(&client.get(&gate.admin_url("/metrics"), &[]).await.body)
        .into_owned();
    let left = r#"route="sse",reason="client_left""#;
    assert_eq!(
        series(&scrape, "floodgate_usage_unreported_total", left),
        0,
        "{scrape}"
    );
    api.release.add_permits(3);
}

#[tokio::test]
async fn a_reservation_named_in_the_json_body_is_read_first_and_the_body_goes_whole() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-body");
    let api = Metered::start().await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(metered(
            "held",
            "/held",
            &api.url,
            10_000,
            r#"reserve = 1000, reserve_json = "max_tokens", reserve_add = 5, max_reserve = 2000, report = "json", units = { "usage.output_units" = 1 }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let post = |body: String| {
        let request = Request::post(gate.url("/held?out=9"))
            .header("content-type", "application/json")
            .body(text_body(&body))
            .expect("request");
        let client = TestClient::http1();
        tokio::spawn(async move { client.send(request).await })
    };
    // The largest body read first, and one past it: its reservation may
    // be named beyond what was read, so it reserves the most.
    let small = r#"{"model":"m","max_tokens":40,"messages":[{"max_tokens":900}]}"#.to_owned();
    let padding = "x".repeat(80 * 1024);
    let large = format!(r#"{{"padding":"{padding}","max_tokens":40}}"#);
    for (body, reserved) in [(small, 45), (large, 2000)] {
        let length = body.len();
        let call = post(body);
        for _ in 0..600 {
            if charged(&redis, &prefix, "held").await == reserved {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Held upstream, the request has its reservation charged.
        assert_eq!(charged(&redis, &prefix, "held").await, reserved);
        api.release.add_permits(1);
        let answer = call.await.expect("call");
        assert_eq!(answer.status, 200);
        assert_eq!(
            answer.header("x-body-length"),
            Some(length.to_string().as_str())
        );
        // Settled to the 9 reported.
        assert_eq!(settled(&redis, &prefix, "held", 9).await, 9);
        redis::cmd("DEL")
            .arg(redis.keys(&format!("{prefix}:*")).await)
            .query_async::<()>(&mut redis.connection().await)
            .await
            .expect("del");
    }
}

#[tokio::test]
async fn the_memory_store_settles_the_same_way() {
    let api = Metered::start().await;
    let toml = Config::new()
        .route(metered(
            "header",
            "/header",
            &api.url,
            1_000,
            r#"reserve = 100, report = "header", units = { "x-usage-input" = 1, "x-usage-output" = 1 }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let mut used = 0;
    for (input, output) in [(3, 4), (0, 0), (60, 90)] {
        used += input + output;
        let url = gate.url(&format!("/header?in={input}&out={output}"));
        let answer = client.get(&url, &[]).await;
        assert_eq!(answer.status, 200);
        let field = answer.header("ratelimit").expect("a RateLimit field");
        assert_eq!(remaining(field), Some(1_000 - used), "{field}");
    }
    // 157 used of 1 000. Ten more each reserve 100 and settle to 0 before
    // the next comes: all fit, where ten fixed costs of 100 would not.
    let mut admitted = 0;
    for _ in 0..10 {
        let answer = client.get(&gate.url("/header?in=0&out=0"), &[]).await;
        admitted += usize::from(answer.status == 200);
    }
    assert_eq!(admitted, 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_go_to_the_cluster_primary_that_holds_each_clients_keys() {
    let cluster = support::cluster::TestCluster::start().await;
    let prefix = unique_prefix("usage-cluster");
    let api = Metered::start().await;
    let toml = Config::new()
        .redis_cluster(&cluster.urls(), &prefix)
        .route(
            metered(
                "header",
                "/header",
                &api.url,
                1_000,
                r#"reserve = 100, report = "header", units = { "x-usage-input" = 1, "x-usage-output" = 1 }"#,
            )
            .client(r#"from = "header", name = "X-Client""#),
        )
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let client = TestClient::http1();
    // Twelve clients, their keys spread over the three primaries; each
    // sees only its own settled charges.
    for round in 0..3u64 {
        for i in 0..12u64 {
            let who = format!("client-{i}");
            let url = gates[((round + i) % 2) as usize].url(&format!("/header?in={i}&out=1"));
            let answer = client.get(&url, &[("x-client", &who)]).await;
            assert_eq!(answer.status, 200, "{who}");
            let field = answer.header("ratelimit").expect("a RateLimit field");
            assert_eq!(
                remaining(field),
                Some(1_000 - (round + 1) * (i + 1)),
                "{who} round {round}: {field}"
            );
        }
    }
    for port in cluster.primaries() {
        assert!(cluster.keys_on(port) > 0, "no keys on primary {port}");
    }
}

#[tokio::test]
async fn a_stop_waits_for_the_settlements_still_in_flight() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-stop");
    let api = Metered::start().await;
    // The store waits out the pause below instead of failing the call.
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .store(r#"timeout = "60s""#)
        .server(r#"drain_delay = "0s""#)
        .server(r#"shutdown_grace = "60s""#)
        .route(metered(
            "held",
            "/held",
            &api.url,
            1_000_000,
            r#"reserve = 500, report = "json", units = { "usage.input_units" = 1, "usage.output_units" = 1 }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let url = gate.url("/held?in=3&out=4");
    let asked = tokio::spawn(async move { TestClient::http1().get(&url, &[]).await });
    // Decided and forwarded: the reservation is charged.
    assert_eq!(settled(&redis, &prefix, "held", 500).await, 500);
    assert_eq!(api.arrived.load(Ordering::SeqCst), 1);

    // Redis holds every write for a while: the settlement that the
    // answer's end starts waits in it.
    let _: () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(5_000)
        .arg("WRITE")
        .query_async(&mut redis.connection().await)
        .await
        .expect("client pause");
    api.release.add_permits(1);
    let answer = asked.await.expect("client task");
    assert_eq!(answer.status, 200);
    let body = String::from_utf8_lossy(&answer.body);
    assert!(body.contains("output_units"), "{body}");
    // The answer went out whole; its settlement is held in Redis (reads
    // still answer during the pause).
    assert_eq!(charged(&redis, &prefix, "held").await, 500);

    // The stop returns only once the settlement has landed: the charge is
    // the 7 units reported, not the reservation.
    gate.stop().await.expect("stopped cleanly");
    assert_eq!(charged(&redis, &prefix, "held").await, 7);
}

/// A remembered denial refuses only requests needing as many units as the
/// one refused, and is forgotten when this instance gives units back: a
/// smaller reservation that fits is admitted, and units a settlement gave
/// back are admitted at once (Redis, where denials are remembered).
#[tokio::test]
async fn a_remembered_denial_admits_smaller_reservations_and_refunds() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-deny-cache");
    let api = Metered::start().await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(metered(
            "budget",
            "/",
            &api.url,
            10,
            r#"reserve = 1, reserve_header = "x-max-units", max_reserve = 8, report = "json", units = { "usage.input_units" = 1, "usage.output_units" = 1 }"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    // A reserves 8 and is held upstream.
    let url = gate.url("/held?in=0&out=1");
    let held = tokio::spawn(async move {
        TestClient::http1()
            .get(&url, &[("x-max-units", "8")])
            .await
            .status
    });
    api.until_arrived(1).await;
    let ask = |units: &'static str| {
        let (client, url) = (client.clone(), gate.url("/json?in=0&out=1"));
        async move {
            client
                .get(&url, &[("x-max-units", units)])
                .await
                .status
                .as_u16()
        }
    };
    // 2 left: 5 is refused, and remembered; 1 still fits.
    assert_eq!(ask("5").await, 429);
    assert_eq!(ask("5").await, 429);
    assert_eq!(
        ask("1").await,
        200,
        "a smaller reservation that fits was refused"
    );
    assert_eq!(settled(&redis, &prefix, "budget", 9).await, 9);
    // A settles to 1 of its 8: 7 units come back, and 5 fit at once.
    api.release.add_permits(1);
    assert_eq!(held.await.expect("A"), 200);
    assert_eq!(settled(&redis, &prefix, "budget", 2).await, 2);
    assert_eq!(ask("5").await, 200, "units given back were still refused");
}

/// The value of the unlabelled series `name` in a scrape, 0 when absent.
fn plain_series(scrape: &str, name: &str) -> u64 {
    scrape
        .lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map_or(0, |v| v as u64)
}

/// The admin's metrics scrape of `gate`.
async fn scrape_of(client: &TestClient, gate: &Floodgate) -> String {
    String::from_utf8_lossy(&client.get(&gate.admin_url("/metrics"), &[]).await.body).into_owned()
}

/// Asks `gate` for an answer of 5 units, reserving them all.
async fn ask_for_five(client: &TestClient, gate: &Floodgate) -> u16 {
    client
        .get(&gate.url("/json?in=0&out=5"), &[("x-max-units", "5")])
        .await
        .status
        .as_u16()
}

/// A flood of 50 requests for 5 units on `gate`, each refused, costs it at
/// most 2 store calls; returns how many given-back messages it had heard.
async fn a_refused_flood_is_remembered(client: &TestClient, gate: &Floodgate) -> u64 {
    let calls = |scrape: &str| plain_series(scrape, "floodgate_redis_calls_total");
    let before = scrape_of(client, gate).await;
    for _ in 0..50 {
        assert_eq!(ask_for_five(client, gate).await, 429);
    }
    let after = scrape_of(client, gate).await;
    assert!(
        calls(&after) - calls(&before) <= 2,
        "a flood of 50 refused requests cost {} store calls",
        calls(&after) - calls(&before)
    );
    plain_series(&after, "floodgate_store_given_back_heard_total")
}

/// Waits until `gate` has heard more given-back messages than `heard`,
/// and insists.
async fn hears_units_given_back(client: &TestClient, gate: &Floodgate, heard: u64) {
    let mut heard_now = heard;
    for _ in 0..600 {
        heard_now = plain_series(
            &scrape_of(client, gate).await,
            "floodgate_store_given_back_heard_total",
        );
        if heard_now > heard {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        heard_now > heard,
        "the second instance heard of no units given back"
    );
}

/// Two instances, one store: a reservation held on the first leaves too
/// little for 5 units, so both refuse 5 and remember it (a flood of 50 on
/// the second costs it at most 2 store calls); once the reservation
/// settles below what it held, the second hears of the units given back
/// and admits 5 at once, and so does the first.
async fn units_given_back_end_remembered_denials_on_every_instance(store: Config) {
    let api = Metered::start().await;
    let toml = store
        .admin()
        .route(metered(
            "budget",
            "/",
            &api.url,
            20,
            r#"reserve = 1, reserve_header = "x-max-units", max_reserve = 16, report = "json", units = { "usage.input_units" = 1, "usage.output_units" = 1 }"#,
        ))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let client = TestClient::http1();
    for (i, gate) in gates.iter().enumerate() {
        assert_eq!(
            plain_series(&scrape_of(&client, gate).await, "floodgate_store_listening"),
            1,
            "instance {i} does not listen for units given back"
        );
    }
    // A reserves 16 on the first instance and is held upstream: 4 left.
    let url = gates[0].url("/held?in=0&out=1");
    let held = tokio::spawn(async move {
        TestClient::http1()
            .get(&url, &[("x-max-units", "16")])
            .await
            .status
    });
    api.until_arrived(1).await;
    assert_eq!(ask_for_five(&client, &gates[0]).await, 429);
    let heard = a_refused_flood_is_remembered(&client, &gates[1]).await;
    // A settles to 1 of its 16: 15 come back. The second instance hears
    // of it (the message is part of the settlement's atomic call), and
    // admits 5 at once; the first forgot its own denial when it settled.
    api.release.add_permits(1);
    assert_eq!(held.await.expect("A"), 200);
    hears_units_given_back(&client, &gates[1], heard).await;
    assert_eq!(
        ask_for_five(&client, &gates[1]).await,
        200,
        "units given back were refused on the other instance"
    );
    assert_eq!(
        ask_for_five(&client, &gates[0]).await,
        200,
        "units given back were refused on the instance that settled"
    );
    // 1 + 5 + 5 of 20 taken: 9 left, and 16 no longer fit.
    let answer = client
        .get(&gates[1].url("/json?in=0&out=1"), &[("x-max-units", "16")])
        .await;
    assert_eq!(answer.status, 429);
}

#[tokio::test]
async fn units_given_back_end_remembered_denials_on_every_instance_on_one_redis() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-given-back");
    units_given_back_end_remembered_denials_on_every_instance(
        Config::new().redis(&redis.url, &prefix),
    )
    .await;
    assert_eq!(settled(&redis, &prefix, "budget", 11).await, 11);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_given_back_end_remembered_denials_on_every_instance_on_a_cluster() {
    let cluster = support::cluster::TestCluster::start().await;
    let prefix = unique_prefix("usage-given-back-cluster");
    units_given_back_end_remembered_denials_on_every_instance(
        Config::new().redis_cluster(&cluster.urls(), &prefix),
    )
    .await;
}

// === abandoned answers read on: at a bound, full, broken off ===

/// An event stream upstream on a raw socket: each answer sends its head
/// and a first event, then waits for `release` to change, then on
/// `/flood` sends 64 KiB of events without a report (and holds the rest),
/// and on `/broken` drops the connection mid-body (no last chunk).
async fn stream_then(release: tokio::sync::watch::Receiver<u32>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut release = release.clone();
            // Only a release after the request came lets it go on.
            release.borrow_and_update();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let flood = String::from_utf8_lossy(&head).starts_with("GET /flood");
                let chunk = |data: &str| format!("{:x}\r\n{data}\r\n", data.len());
                let first = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{}",
                    chunk("data: {\"delta\":\"Hel\"}\n\n")
                );
                if stream.write_all(first.as_bytes()).await.is_err() {
                    return;
                }
                if release.changed().await.is_err() || !flood {
                    // Dropped: the body breaks off.
                    return;
                }
                let filler = chunk(&"data: {\"delta\":\"lo\"}\n\n".repeat(200));
                for _ in 0..16 {
                    if stream.write_all(filler.as_bytes()).await.is_err() {
                        return;
                    }
                }
                // Held open: only a bound ends the reading.
                let _ = release.changed().await;
            });
        }
    });
    url
}

/// With `abandoned = "drain"` and one answer read on at a time: of two
/// clients that leave their streams, the second is closed at once
/// (`full`); the first is read on until its upstream has sent more than
/// `drain_bytes` without a report (`bound`), and of two more, the one
/// read on breaks off when its upstream drops the connection (`broke`).
/// Each stands charged its reservation, and no answer counts as another
/// outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_read_on_ends_at_its_bound_when_the_reading_is_full_or_when_it_breaks_off() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("usage-drain-ends");
    let (release, waiting) = tokio::sync::watch::channel(0u32);
    let url = stream_then(waiting).await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .admin()
        .route(metered(
            "sse",
            "/",
            &url,
            10_000,
            r#"reserve = 70, report = "sse", units = { "usage.input_units" = 1, "usage.output_units" = 1 }, abandoned = "drain", drain_time = "1m", drain_bytes = "16KiB", max_draining = 1"#,
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let metrics = gate.admin_url("/metrics");
    let outcome = |o: &str| format!(r#"route="sse",outcome="{o}""#);
    let name = "floodgate_usage_abandoned_total";
    for (path, ended, full) in [("/flood", "bound", 1), ("/broken", "broke", 2)] {
        // Two leave: one is read on and holds the only place, so the other
        // is closed at once, whichever comes first.
        read_then_leave(gate.addr, path, "Hel").await;
        read_then_leave(gate.addr, path, "Hel").await;
        let scrape = scrape_until(&metrics, name, &outcome("full"), full).await;
        assert_eq!(series(&scrape, name, &outcome("full")), full, "{scrape}");
        release.send_modify(|n| *n += 1);
        let scrape = scrape_until(&metrics, name, &outcome(ended), 1).await;
        assert_eq!(
            series(&scrape, name, &outcome(ended)),
            1,
            "{path}: {scrape}"
        );
    }
    let scrape = scrape_until(&metrics, name, &outcome("bound"), 1).await;
    for (o, want) in [
        ("drained", 0),
        ("closed", 0),
        ("bound", 1),
        ("broke", 1),
        ("full", 2),
    ] {
        assert_eq!(series(&scrape, name, &outcome(o)), want, "{o}: {scrape}");
    }
    assert_eq!(settled(&redis, &prefix, "sse", 4 * 70).await, 4 * 70);
}
