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
