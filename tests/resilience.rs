//! When Redis or the upstream fails, floodgate holds: every request is
//! answered per `on_error`, the circuit breaker stops waiting on a dead
//! store, and limiting resumes by itself when Redis is back.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use support::config::{Config, Route};
use support::redis::{TestRedis, has_functions, unique_prefix};
use support::relay::Relay;
use support::{Floodgate, TestClient, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config(redis: &str, prefix: &str, on_error: &str, extra_store: &str, limit: u64) -> String {
    let mut config = Config::new()
        .admin()
        .redis(redis, prefix)
        .store(r#"timeout = "100ms""#)
        .store(&format!(r#"on_error = "{on_error}""#));
    if !extra_store.is_empty() {
        config = config.store(extra_store);
    }
    config
        .route(
            Route::new("plain")
                .matching(r#"path_prefix = "/plain""#)
                .respond(r#"status = 200, body = "plain""#),
        )
        .route(
            Route::new("api")
                .respond(r#"status = 200, body = "api""#)
                .client(r#"from = "header", name = "X-Client""#)
                .limit("sliding_log", limit, "1h"),
        )
        .toml()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

/// Waits until a request from `client` is decided by Redis again (it carries
/// RateLimit headers), so the breaker has closed.
async fn until_redis_decides(gate: &Floodgate, client: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let a = TestClient::http1()
            .get(&gate.url("/api"), &[("x-client", client)])
            .await;
        if a.header("ratelimit").is_some() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "limiting did not resume by itself"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until Redis decides again, then expects the route's limit of 3
/// to hold exactly for a fresh client: three admitted, the fourth denied.
async fn limits_exactly_again(gate: &Floodgate) {
    until_redis_decides(gate, "probe").await;
    let client = TestClient::http1();
    let me = [("x-client", "after")];
    for expected in [200, 200, 200, 429] {
        assert_eq!(client.get(&gate.url("/api"), &me).await.status, expected);
    }
}

/// Eight clients, each its own, sending to `/api` one request after another
/// until 3 s after `started`; each task returns every request's (sent at,
/// took, status).
fn three_seconds_of_load(
    gate: &Arc<Floodgate>,
    started: Instant,
) -> Vec<tokio::task::JoinHandle<Vec<(Duration, Duration, u16)>>> {
    (0..8)
        .map(|i| {
            let gate = Arc::clone(gate);
            tokio::spawn(async move {
                let client = TestClient::http1();
                let mut seen = Vec::new();
                while started.elapsed() < Duration::from_millis(3_000) {
                    let t = Instant::now();
                    let a = client
                        .get(&gate.url("/api"), &[("x-client", &format!("c{i}"))])
                        .await;
                    seen.push((started.elapsed(), t.elapsed(), a.status.as_u16()));
                }
                seen
            })
        })
        .collect()
}

/// How long each of 100 requests to the route without limits took.
async fn times_without_limits(gate: &Floodgate) -> Vec<Duration> {
    let client = TestClient::http1();
    let mut plain = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        assert_eq!(client.get(&gate.url("/plain"), &[]).await.status, 200);
        plain.push(t.elapsed());
    }
    plain
}

/// With on_error = "allow" the instance serves through the outage: it
/// stays ready, and says why it might not look it.
async fn stays_ready_through_the_outage(gate: &Floodgate) {
    let ready = TestClient::http1()
        .get(&gate.admin_url("/readyz"), &[])
        .await;
    assert_eq!(ready.status, 200, "/readyz under on_error = allow");
    assert!(
        ready.text().contains("store is not answering"),
        "{}",
        ready.text()
    );
    assert_eq!(
        TestClient::http1()
            .get(&gate.admin_url("/healthz"), &[])
            .await
            .status,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_under_load_every_request_is_answered_and_the_breaker_stops_waiting() {
    let mut redis = TestRedis::start_process().await;
    let gate = Arc::new(
        Floodgate::start(&config(
            &redis.url,
            &unique_prefix("kill"),
            "allow",
            "",
            1_000_000,
        ))
        .await,
    );
    let started = Instant::now();
    let load = three_seconds_of_load(&gate, started);
    tokio::time::sleep(Duration::from_millis(800)).await;
    redis.kill();
    let killed_at = started.elapsed();
    let mut all = Vec::new();
    for task in load {
        all.extend(task.await.expect("load task"));
    }
    assert!(
        all.iter().all(|&(_, _, status)| status == 200),
        "on_error = allow answers every request with 200"
    );
    assert!(
        all.iter().any(|&(at, _, _)| at < killed_at),
        "load ran before the kill"
    );
    // Once the breaker is open (a second after the kill, generously), a
    // request takes about as long as one to a route without limits.
    let open: Vec<Duration> = all
        .iter()
        .filter(|&&(at, _, _)| at > killed_at + Duration::from_secs(1))
        .map(|&(_, took, _)| took)
        .collect();
    assert!(
        open.len() > 50,
        "too few requests after the kill: {}",
        open.len()
    );
    let plain = times_without_limits(&gate).await;
    let (open, plain) = (median(open), median(plain));
    assert!(
        open < plain * 10 + Duration::from_millis(5),
        "median with the breaker open {open:?} vs without limits {plain:?}"
    );
    stays_ready_through_the_outage(&gate).await;
}

#[tokio::test]
async fn redis_frozen_decisions_stay_within_the_timeout_and_resume_after_sigcont() {
    let redis = TestRedis::start_process().await;
    let gate = Floodgate::start(&config(&redis.url, &unique_prefix("stop"), "deny", "", 3)).await;
    let client = TestClient::http1();
    assert_eq!(
        client
            .get(&gate.url("/api"), &[("x-client", "warm")])
            .await
            .status,
        200
    );
    redis.pause();
    for _ in 0..10 {
        let t = Instant::now();
        let a = client
            .get(&gate.url("/api"), &[("x-client", "frozen")])
            .await;
        assert_eq!(a.status, 503);
        // timeout is 100 ms; the margin is for slow CI machines.
        assert!(
            t.elapsed() < Duration::from_millis(100 + 600),
            "took {:?}",
            t.elapsed()
        );
    }
    assert_eq!(
        TestClient::http1()
            .get(&gate.admin_url("/readyz"), &[])
            .await
            .status,
        503
    );
    redis.resume();
    limits_exactly_again(&gate).await;
    assert_eq!(
        TestClient::http1()
            .get(&gate.admin_url("/readyz"), &[])
            .await
            .status,
        200
    );
}

/// Decisions that queue behind calls stuck on a frozen Redis still end by
/// their own deadline: each is answered within `timeout` of its request,
/// not after a call of its own has waited `timeout` more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decisions_queued_behind_a_frozen_redis_end_by_their_own_deadline() {
    let redis = TestRedis::start_process().await;
    let toml = Config::new()
        .redis(&redis.url, &unique_prefix("queued"))
        .store(r#"timeout = "1s""#)
        .store(r#"on_error = "deny""#)
        .route(
            Route::new("api")
                .respond(r#"status = 200, body = "api""#)
                .client(r#"from = "header", name = "X-Client""#)
                .limit("sliding_log", 100, "1h"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let warm = [("x-client", "warm")];
    assert_eq!(client.get(&gate.url("/api"), &warm).await.status, 200);
    redis.pause();
    // More at once than there are calls in flight: most wait in the queue.
    let asked: Vec<_> = (0..12)
        .map(|i| {
            let (client, url) = (client.clone(), gate.url("/api"));
            tokio::spawn(async move {
                let t = Instant::now();
                let me = format!("queued-{i}");
                let status = client.get(&url, &[("x-client", &me)]).await.status;
                (status, t.elapsed())
            })
        })
        .collect();
    for task in asked {
        let (status, took) = task.await.expect("request");
        assert_eq!(status, 503);
        // The timeout is 1 s; a queued decision given a whole timeout of
        // its own once a call is free would take about 2 s.
        assert!(took < Duration::from_millis(1_500), "took {took:?}");
    }
    redis.resume();
}

/// Redis lost without a word: its connections stay open and nothing
/// answers on them, nor on new ones. Then the address answers again, for
/// new connections only (a new host under the same name). The breaker's
/// probes connect afresh instead of waiting on the silent connections, so
/// limiting resumes by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_lost_without_a_word_is_reached_again_on_new_connections() {
    let redis = TestRedis::start_private().await;
    let relay = Relay::start(redis.addr().await).await;
    let url = redis.url_via(relay.addr);
    let gate = Floodgate::start(&config(&url, &unique_prefix("silent"), "deny", "", 3)).await;
    let client = TestClient::http1();
    let me = [("x-client", "before")];
    assert_eq!(client.get(&gate.url("/api"), &me).await.status, 200);

    relay.go_silent();
    let me = [("x-client", "during")];
    for _ in 0..8 {
        assert_eq!(client.get(&gate.url("/api"), &me).await.status, 503);
    }
    assert_eq!(
        client.get(&gate.admin_url("/readyz"), &[]).await.status,
        503
    );

    relay.serve_new_connections();
    limits_exactly_again(&gate).await;
}

/// A Redis at its `maxmemory` under `noeviction` refuses decisions, as it
/// refuses every write: floodgate answers per `on_error` and limits
/// exactly again once Redis has room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_out_of_memory_refuses_decisions_until_it_has_room() {
    let redis = TestRedis::start_private().await;
    let gate = Floodgate::start(&config(&redis.url, &unique_prefix("oom"), "deny", "", 3)).await;
    let client = TestClient::http1();
    let me = [("x-client", "before")];
    assert_eq!(client.get(&gate.url("/api"), &me).await.status, 200);

    let mut conn = redis.connection().await;
    let mut config_set = async |key: &str, value: &str| {
        let set: redis::RedisResult<()> = redis::cmd("CONFIG")
            .arg("SET")
            .arg(key)
            .arg(value)
            .query_async(&mut conn)
            .await;
        set.unwrap_or_else(|e| panic!("CONFIG SET {key} {value}: {e}"));
    };
    config_set("maxmemory-policy", "noeviction").await;
    config_set("maxmemory", "1").await;
    let me = [("x-client", "full")];
    for _ in 0..3 {
        let a = client.get(&gate.url("/api"), &me).await;
        assert_eq!(a.status, 503);
        assert!(a.header("retry-after").is_some());
    }

    config_set("maxmemory", "0").await;
    limits_exactly_again(&gate).await;
}

#[tokio::test]
async fn redis_restarted_empty_gets_the_script_again_and_limits() {
    let mut redis = TestRedis::start_process().await;
    let gate = Floodgate::start(&config(
        &redis.url,
        &unique_prefix("restart"),
        "deny",
        "",
        3,
    ))
    .await;
    let client = TestClient::http1();
    assert_eq!(
        client
            .get(&gate.url("/api"), &[("x-client", "before")])
            .await
            .status,
        200
    );
    redis.restart().await;
    limits_exactly_again(&gate).await;
    let mut conn = redis.connection().await;
    if has_functions(&mut conn).await {
        let libraries: Vec<redis::Value> = redis::cmd("FUNCTION")
            .arg("LIST")
            .arg("LIBRARYNAME")
            .arg("floodgate_*")
            .query_async(&mut conn)
            .await
            .expect("function list");
        assert_eq!(
            libraries.len(),
            1,
            "the fresh Redis was given the function library"
        );
    } else {
        let scripts: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(redis::Script::new(floodgate::limit::redis::SCRIPT).get_hash())
            .query_async(&mut conn)
            .await
            .expect("script exists");
        assert_eq!(scripts, [true], "the fresh Redis was given the script");
    }
}

#[tokio::test]
async fn local_fallback_enforces_the_limit_per_instance_while_redis_is_down() {
    let mut redis = TestRedis::start_process().await;
    let prefix = unique_prefix("local");
    let one = Floodgate::start(&config(&redis.url, &prefix, "local", "", 3)).await;
    let two = Floodgate::start(&config(&redis.url, &prefix, "local", "", 3)).await;
    let scaled = Floodgate::start(&config(
        &redis.url,
        &prefix,
        "local",
        "local_instances = 3",
        6,
    ))
    .await;
    redis.kill();
    let client = TestClient::http1();
    let me = [("x-client", "me")];
    for gate in [&one, &two] {
        for expected in [200, 200, 200, 429, 429] {
            let a = client.get(&gate.url("/api"), &me).await;
            assert_eq!(a.status, expected);
        }
    }
    // 6 shared by 3 instances: 2 here.
    for expected in [200, 200, 429] {
        assert_eq!(client.get(&scaled.url("/api"), &me).await.status, expected);
    }
}

/// An upstream that sends a response head promising 1000 bytes, sends 10,
/// then closes.
async fn broken_upstream() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = s.read(&mut buf).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n0123456789")
                    .await;
                let _ = s.shutdown().await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn an_upstream_closing_mid_response_breaks_that_response_and_nothing_else() {
    let addr = broken_upstream().await;
    let upstream = Upstream::start().await;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[[routes]]\nname = \"broken\"\nmatch = {{ path_prefix = \"/broken\" }}\nupstream = \"http://{addr}\"\n\n[[routes]]\nname = \"good\"\nupstream = \"{}\"\n",
        upstream.url()
    );
    let gate = Floodgate::start(&toml).await;
    let raw_client =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<http_body_util::Empty<bytes::Bytes>>();
    for _ in 0..3 {
        let response = tokio::time::timeout(
            Duration::from_secs(5),
            raw_client.get(gate.url("/broken").parse().expect("uri")),
        )
        .await
        .expect("no hang on the head")
        .expect("head arrives");
        assert_eq!(response.status(), 200);
        let body = tokio::time::timeout(
            Duration::from_secs(5),
            http_body_util::BodyExt::collect(response.into_body()),
        )
        .await
        .expect("no hang on the body");
        assert!(body.is_err(), "a truncated body must not look complete");
    }
    assert_eq!(
        TestClient::http1()
            .get(&gate.url("/fine"), &[])
            .await
            .status,
        200
    );
}
