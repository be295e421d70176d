//! `max_request_body`: a declared length over the limit is 413 before the
//! upstream sees a byte; a chunked body that grows past it is cut and
//! answered 413; a body within it streams through whole, without being
//! held in memory.

mod support;

use http::Request;
use support::config::{Config, Route};
use support::{Floodgate, Generated, TestClient, Upstream};

async fn gate(upstream: &Upstream) -> Floodgate {
    let toml = Config::new()
        .admin()
        .server(r#"max_request_body = "1MiB""#)
        .route(
            Route::new("big")
                .matching(r#"host = "big.example""#)
                .upstream(&upstream.url())
                .line(r#"max_request_body = "300MB""#),
        )
        .route(Route::new("rest").upstream(&upstream.url()))
        .toml();
    Floodgate::start(&toml).await
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_413_before_the_upstream_sees_a_byte() {
    let upstream = Upstream::start().await;
    let gate = gate(&upstream).await;
    let request = Request::post(gate.url("/upload"))
        .body(http_body_util::Either::Right(Generated::new(
            2 * 1024 * 1024,
        )))
        .expect("request");
    let answer = TestClient::http1().send(request).await;
    let (status, detail) = answer.problem();
    assert_eq!(status, 413);
    assert!(
        detail.contains("max_request_body of 1048576 bytes"),
        "{detail}"
    );
    assert_eq!(upstream.hits(), 0);
    assert_eq!(upstream.connections(), 0);
    let metrics = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    assert!(
        metrics.contains("floodgate_refusals_total{status=\"413\",fault=\"client\"} 1"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_chunked_body_that_grows_past_the_limit_is_cut_and_answered_413() {
    let upstream = Upstream::start().await;
    let gate = gate(&upstream).await;
    let mut sender = support::http1_connection(gate.addr).await;
    let request = Request::post(gate.url("/upload"))
        .body(Generated::without_length(3 * 1024 * 1024))
        .expect("request");
    let response = sender.send_request(request).await.expect("an answer");
    assert_eq!(response.status(), 413);
    // Within the limit, chunked, it passes whole.
    let within = TestClient::http1()
        .send(
            Request::post(gate.url("/upload"))
                .body(http_body_util::Either::Right(Generated::new(1024 * 1024)))
                .expect("request"),
        )
        .await;
    assert_eq!(within.status, 200);
    assert_eq!(within.text(), (1024 * 1024).to_string());
}

#[tokio::test]
async fn a_200_megabyte_body_within_the_limit_streams_through() {
    let upstream = Upstream::start().await;
    let gate = gate(&upstream).await;
    // The route for host big.example allows 300 MB; the upstream counts
    // what arrives as it streams, never holding it.
    let answer = TestClient::http1()
        .send(
            Request::post(gate.url("/upload"))
                .header("host", "big.example")
                .body(http_body_util::Either::Right(Generated::new(200_000_000)))
                .expect("request"),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert!(answer.body.len() < 64, "not the upload's count");
    assert_eq!(answer.text(), "200000000");
}
