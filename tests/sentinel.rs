//! Redis behind Sentinel: floodgate finds the primary through the
//! Sentinels, answers per `on_error` while it is lost, and limits exactly
//! again once the Sentinels have promoted the replica.

mod support;

use std::time::{Duration, Instant};

use support::config::{Config, Route};
use support::redis::unique_prefix;
use support::sentinel::{MASTER, TestSentinels};
use support::{Floodgate, TestClient};

fn config(urls: &[String], prefix: &str) -> String {
    Config::new()
        .redis_sentinel(urls, MASTER, prefix)
        .store(r#"timeout = "300ms""#)
        .store(r#"on_error = "deny""#)
        .route(
            Route::new("api")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Client""#)
                .limit("sliding_window", 2, "1h"),
        )
        .toml()
}

async fn three(gate: &Floodgate, client: &str) -> Vec<u16> {
    let http = TestClient::http1();
    let mut out = Vec::new();
    for _ in 0..3 {
        out.push(
            http.get(&gate.url("/"), &[("x-client", client)])
                .await
                .status
                .as_u16(),
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgate_follows_a_sentinel_failover_and_limits_exactly_after_it() {
    let mut group = TestSentinels::start().await;
    let gate = Floodgate::start(&config(&group.urls(), &unique_prefix("sentinel"))).await;
    assert_eq!(three(&gate, "before").await, [200, 200, 429]);

    let old = group.kill_primary().await;
    let http = TestClient::http1();
    let mut gap = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(40);
    while group.current_primary() == Some(old) {
        let status = http
            .get(&gate.url("/"), &[("x-client", "gap")])
            .await
            .status
            .as_u16();
        assert!([200, 429, 503].contains(&status), "{status}");
        gap.push(status);
        assert!(Instant::now() < deadline, "the Sentinels never failed over");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        gap.contains(&503),
        "on_error = deny answered while the primary was gone: {gap:?}"
    );
    group.wait_for_new_primary(old).await;

    let deadline = Instant::now() + Duration::from_secs(30);
    while http
        .get(&gate.url("/"), &[("x-client", "probe")])
        .await
        .status
        == 503
    {
        assert!(
            Instant::now() < deadline,
            "floodgate never found the new primary"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(three(&gate, "after").await, [200, 200, 429]);
}

/// The key registry behind Sentinel: a key made through one instance is
/// admitted by another, which found the primary through the Sentinels,
/// and a key disabled on the second is refused (403) on the first within
/// a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_registry_lives_behind_the_sentinels_too() {
    let group = TestSentinels::start().await;
    let dir = support::temp_dir("sentinel-keys");
    let token = "0123456789abcdef0123456789abcdef";
    std::fs::write(dir.join("token"), format!("{token}\n")).expect("write the token");
    let toml = Config::new()
        .redis_sentinel(&group.urls(), MASTER, &unique_prefix("sentinel-keys"))
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("token").display()
        ))
        .tables("[keys]\n")
        .route(
            Route::new("api")
                .respond("status = 200")
                .line(r#"api_key = { from = "bearer" }"#)
                .client(r#"from = "key""#)
                .limit("sliding_window", 100, "1h"),
        )
        .toml();
    let (a, b) = (Floodgate::start(&toml).await, Floodgate::start(&toml).await);
    let admin = |gate: &Floodgate, method: &str, path: &str, body: &str| {
        http::Request::builder()
            .method(method)
            .uri(gate.admin_url(path))
            .header("authorization", format!("Bearer {token}"))
            .body(support::text_body(body))
            .expect("a request")
    };
    let http = TestClient::http1();
    let made = http
        .send(admin(
            &a,
            "POST",
            "/keys",
            r#"{"identity": "sam", "reason": "signed up"}"#,
        ))
        .await;
    assert_eq!(made.status, 201, "{}", made.text());
    let bearer = format!("Bearer {}", made.json()["key"].as_str().expect("a key"));
    let id = made.json()["record"]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    assert_eq!(
        http.get(&b.url("/"), &[("authorization", &bearer)])
            .await
            .status,
        200
    );
    let disabled = http
        .send(admin(
            &b,
            "PATCH",
            &format!("/keys/{id}"),
            r#"{"enabled": false, "reason": "test"}"#,
        ))
        .await;
    assert_eq!(disabled.status, 200, "{}", disabled.text());
    let start = Instant::now();
    while http
        .get(&a.url("/"), &[("authorization", &bearer)])
        .await
        .status
        != 403
    {
        assert!(start.elapsed() < Duration::from_secs(5), "never disabled");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "disabled after {took:?}");
}
