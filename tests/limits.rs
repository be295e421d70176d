//! Limits through the proxy with the in-process store: who passes, who gets
//! 429, and what the headers say.

mod support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::{Floodgate, TestClient, Upstream};

fn config(upstream: &str, algorithm: &str, limit: u64, window: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "api"
match = {{ path_prefix = "/api" }}
upstream = "{upstream}"
client = {{ from = "header", name = "X-Client" }}
limits = [{{ algorithm = "{algorithm}", limit = {limit}, window = "{window}" }}]
"#
    )
}

#[tokio::test]
async fn fourth_request_is_denied_and_another_client_still_passes() {
    for algorithm in ["fixed_window", "sliding_log"] {
        let upstream = Upstream::start().await;
        let gate = Floodgate::start(&config(&upstream.url(), algorithm, 3, "60s")).await;
        let client = TestClient::http1();
        let url = gate.url("/api/items");
        for remaining in ["2", "1", "0"] {
            let a = client.get(&url, &[("x-client", "alice")]).await;
            assert_eq!(a.status, 200, "{algorithm}");
            assert_eq!(a.header("ratelimit-policy"), Some("\"api\";q=3;w=60"));
            let rl = a.header("ratelimit").unwrap_or_default();
            assert!(
                rl.starts_with(&format!("\"api\";r={remaining};t=")),
                "{algorithm}: {rl}"
            );
        }
        let denied = client.get(&url, &[("x-client", "alice")]).await;
        assert_eq!(denied.status, 429, "{algorithm}");
        let retry: u64 = denied
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After in seconds");
        assert!((1..=60).contains(&retry), "{algorithm}: retry {retry}");
        assert_eq!(
            denied.header("content-type"),
            Some("application/problem+json")
        );
        assert_eq!(denied.header("ratelimit-policy"), Some("\"api\";q=3;w=60"));
        assert!(
            denied
                .header("ratelimit")
                .unwrap_or_default()
                .starts_with("\"api\";r=0;t=")
        );
        let problem = denied.json();
        assert_eq!(problem["status"], 429);
        assert_eq!(problem["title"], "Too Many Requests");
        assert_eq!(
            upstream.hits(),
            3,
            "{algorithm}: the denied request reached the upstream"
        );

        let other = client.get(&url, &[("x-client", "bob")]).await;
        assert_eq!(other.status, 200, "{algorithm}");
        assert_eq!(upstream.hits(), 4);
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Sleeps until `offset_ms` past the next multiple of `window_ms`.
async fn sleep_until_window(window_ms: u64, offset_ms: u64) {
    let now = now_ms();
    let target = (now / window_ms + 1) * window_ms + offset_ms;
    tokio::time::sleep(Duration::from_millis(target - now)).await;
}

#[tokio::test]
async fn fixed_window_resets_at_its_boundary() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&config(&upstream.url(), "fixed_window", 3, "1s")).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    sleep_until_window(1000, 20).await;
    for _ in 0..3 {
        assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    }
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 429);
    sleep_until_window(1000, 20).await;
    for _ in 0..3 {
        assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    }
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 429);
}

#[tokio::test]
async fn sliding_log_admits_again_when_the_oldest_request_leaves_the_window() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&config(&upstream.url(), "sliding_log", 2, "1500ms")).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    let first = std::time::Instant::now();
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 429);
    // The first request leaves the window 1500 ms after it was admitted; the
    // second is still inside it then, so exactly one more fits.
    tokio::time::sleep_until((first + Duration::from_millis(1600)).into()).await;
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 200);
    assert_eq!(client.get(&url, &[("x-client", "c")]).await.status, 429);
}

#[tokio::test]
async fn two_hundred_concurrent_requests_under_a_limit_of_fifty_admit_exactly_fifty() {
    for algorithm in ["fixed_window", "sliding_log"] {
        let upstream = Upstream::start().await;
        let gate = Floodgate::start(&config(&upstream.url(), algorithm, 50, "60s")).await;
        let client = TestClient::http1();
        let url = gate.url("/api");
        let tasks: Vec<_> = (0..200)
            .map(|_| {
                let client = client.clone();
                let url = url.clone();
                tokio::spawn(async move { client.get(&url, &[("x-client", "one")]).await.status })
            })
            .collect();
        let mut ok = 0;
        let mut denied = 0;
        for t in tasks {
            match t.await.expect("request task").as_u16() {
                200 => ok += 1,
                429 => denied += 1,
                other => panic!("unexpected status {other}"),
            }
        }
        assert_eq!((ok, denied), (50, 150), "{algorithm}");
        assert_eq!(upstream.hits(), 50, "{algorithm}");
    }
}

#[tokio::test]
async fn cost_counts_units_and_every_limit_must_allow() {
    let upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "export"
upstream = "{}"
cost = 2
limits = [
  {{ algorithm = "sliding_log", limit = 5, window = "60s" }},
  {{ algorithm = "fixed_window", limit = 100, window = "60s" }},
]
"#,
        upstream.url()
    );
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/export");
    let a = client.get(&url, &[]).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.header("ratelimit-policy"),
        Some("\"export.1\";q=5;w=60, \"export.2\";q=100;w=60")
    );
    assert!(
        a.header("ratelimit")
            .unwrap_or_default()
            .starts_with("\"export.1\";r=3;")
    );
    assert_eq!(client.get(&url, &[]).await.status, 200);
    let denied = client.get(&url, &[]).await;
    assert_eq!(denied.status, 429);
    assert!(
        denied
            .header("ratelimit")
            .unwrap_or_default()
            .starts_with("\"export.1\";r=1;")
    );
    assert_eq!(upstream.hits(), 2);
}

#[tokio::test]
async fn shadow_routes_count_and_annotate_but_never_deny() {
    let upstream = Upstream::start().await;
    let toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "search"
upstream = "{}"
shadow = true
limits = [{{ algorithm = "sliding_log", limit = 2, window = "60s" }}]
"#,
        upstream.url()
    );
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    for remaining in ["1", "0"] {
        let a = client.get(&gate.url("/search"), &[]).await;
        assert_eq!(a.status, 200);
        let rl = a.header("ratelimit").unwrap_or_default();
        assert!(
            rl.starts_with(&format!("\"search\";r={remaining};")),
            "{rl}"
        );
    }
    // Past the limit: still served, and told nothing that claims a denial.
    for _ in 0..2 {
        let a = client.get(&gate.url("/search"), &[]).await;
        assert_eq!(a.status, 200);
        assert!(a.header("ratelimit").is_none());
        assert_eq!(a.header("ratelimit-policy"), Some("\"search\";q=2;w=60"));
    }
    assert_eq!(upstream.hits(), 4);
}

async fn status(client: &TestClient, url: &str, headers: &[(&str, &str)]) -> u16 {
    client.get(url, headers).await.status.as_u16()
}

#[tokio::test]
async fn missing_client_header_falls_back_or_is_rejected_as_configured() {
    let toml = r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "strict"
match = { path_prefix = "/strict" }
respond = { status = 200, body = "ok" }
client = { from = "header", name = "X-Api-Key", missing = "reject" }
limits = [{ algorithm = "sliding_log", limit = 1, window = "60s" }]

[[routes]]
name = "lenient"
match = { path_prefix = "/lenient" }
respond = { status = 200, body = "ok" }
client = { from = "header", name = "X-Api-Key" }
limits = [{ algorithm = "sliding_log", limit = 1, window = "60s" }]
"#;
    let gate = Floodgate::start(toml).await;
    let client = TestClient::http1();
    let strict = client.get(&gate.url("/strict"), &[]).await;
    assert_eq!(strict.status, 400);
    assert!(strict.text().contains("x-api-key"), "{}", strict.text());
    assert_eq!(
        status(&client, &gate.url("/strict"), &[("X-API-KEY", "k1")]).await,
        200
    );
    assert_eq!(
        status(&client, &gate.url("/strict"), &[("x-api-key", "k1")]).await,
        429
    );
    assert_eq!(
        status(&client, &gate.url("/strict"), &[("x-api-key", "k2")]).await,
        200
    );
    // Without the header the address is the client: one bucket for both requests.
    assert_eq!(client.get(&gate.url("/lenient"), &[]).await.status, 200);
    assert_eq!(client.get(&gate.url("/lenient"), &[]).await.status, 429);
    assert_eq!(
        status(&client, &gate.url("/lenient"), &[("x-api-key", "k")]).await,
        200
    );
}
