//! gRPC and WebSocket through floodgate, with real peers on both sides
//! (grpcio and websockets, from `tests/peers/`): calls and their trailers
//! pass, an over-limit gRPC call is RESOURCE_EXHAUSTED, a WebSocket echo
//! works, its handshake counts against the route's limit, and a silent
//! upgraded connection is closed after `upgrade_idle_timeout`.

mod support;

use support::Floodgate;
use support::config::{Config, Route};
use support::peers::{PeerServer, client};

#[tokio::test]
async fn grpc_calls_pass_with_their_trailers_and_the_over_limit_one_is_resource_exhausted() {
    let server = PeerServer::start("grpc_peer.py");
    let toml = Config::new()
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
                .limit("sliding_log", 4, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let target = gate.addr.to_string();

    // One streaming call, then three unary ones (the limit is 4), then one
    // more unary call over the limit.
    let streamed = client(
        "grpc_peer.py",
        &["stream".into(), target.clone(), "5".into()],
    )
    .await;
    assert_eq!(streamed.len(), 1);
    let streamed = &streamed[0];
    assert_eq!(streamed["code"], "OK", "{streamed}");
    assert_eq!(
        streamed["messages"],
        serde_json::json!(["0", "1", "2", "3", "4"])
    );
    assert_eq!(streamed["trailers"]["x-peer-trailer"], "done", "{streamed}");
    assert_eq!(streamed["headers"]["ratelimit-policy"], "\"grpc\";q=4;w=60");

    let calls = client("grpc_peer.py", &["unary".into(), target, "4".into()]).await;
    assert_eq!(calls.len(), 4);
    for (i, call) in calls.iter().take(3).enumerate() {
        assert_eq!(call["code"], "OK", "{call}");
        assert_eq!(
            call["messages"],
            serde_json::json!([format!("echo:hello {i}")])
        );
    }
    let over = &calls[3];
    assert_eq!(over["code"], "RESOURCE_EXHAUSTED", "{over}");
    assert!(
        over["details"]
            .as_str()
            .is_some_and(|d| d.contains("rate limit of route \"grpc\" exceeded")),
        "{over}"
    );
    // The rate-limit fields come with it, in the trailers-only answer.
    assert_eq!(
        over["trailers"]["ratelimit-policy"], "\"grpc\";q=4;w=60",
        "{over}"
    );
    assert!(
        over["trailers"]["ratelimit"]
            .as_str()
            .is_some_and(|v| v.starts_with("\"grpc\";r=0;t=")),
        "{over}"
    );
}

#[tokio::test]
async fn grpc_refusals_are_grpc_statuses() {
    // Nothing listens on the upstream's port: floodgate's 502 must reach a
    // gRPC client as UNAVAILABLE, not as an HTTP error it cannot read.
    let port = support::free_port();
    let toml = Config::new()
        .upstream(
            "grpc",
            &[
                &format!(r#"url = "http://127.0.0.1:{port}""#),
                r#"protocol = "h2c""#,
            ],
        )
        .route(Route::new("grpc").upstream("grpc"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let calls = client(
        "grpc_peer.py",
        &["unary".into(), gate.addr.to_string(), "1".into()],
    )
    .await;
    assert_eq!(calls[0]["code"], "UNAVAILABLE", "{}", calls[0]);
    assert_eq!(
        calls[0]["details"], "the upstream is unreachable",
        "{}",
        calls[0]
    );
}

#[tokio::test]
async fn a_websocket_echo_works_and_its_handshake_counts_against_the_limit() {
    let server = PeerServer::start("ws_peer.py");
    let toml = Config::new()
        .route(
            Route::new("ws")
                .upstream(&format!("http://127.0.0.1:{}", server.port))
                .limit("sliding_log", 2, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let url = format!("ws://{}/chat", gate.addr);
    for _ in 0..2 {
        let echoed = client("ws_peer.py", &["echo".into(), url.clone(), "3".into()]).await;
        assert_eq!(
            echoed[0],
            serde_json::json!({
                "status": 101,
                "echoes": ["message 0", "message 1", "message 2"],
            })
        );
    }
    // Each handshake was one request; the messages were not.
    let third = client("ws_peer.py", &["echo".into(), url, "1".into()]).await;
    assert_eq!(third[0]["status"], 429, "{}", third[0]);
}

#[tokio::test]
async fn a_silent_upgraded_connection_is_closed_after_the_idle_timeout() {
    let server = PeerServer::start("ws_peer.py");
    let toml = Config::new()
        .server(r#"upgrade_idle_timeout = "1s""#)
        .admin()
        .route(Route::new("ws").upstream(&format!("http://127.0.0.1:{}", server.port)))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let url = format!("ws://{}/quiet", gate.addr);
    let silent = client("ws_peer.py", &["silent".into(), url, "10".into()]).await;
    let after = silent[0]["closed_after"]
        .as_f64()
        .unwrap_or_else(|| panic!("the silent connection stayed open: {}", silent[0]));
    assert!(
        (0.9..4.0).contains(&after),
        "closed after {after} s, not about 1 s"
    );
    let metrics = metrics_text(&gate).await;
    assert!(
        metrics.contains("floodgate_timeouts_total{phase=\"upgrade_idle\"} 1"),
        "{metrics}"
    );
}

async fn metrics_text(gate: &Floodgate) -> String {
    support::TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text()
}

#[tokio::test]
async fn an_upgraded_connection_holds_its_concurrency_slot_until_it_closes() {
    let server = PeerServer::start("ws_peer.py");
    let toml = Config::new()
        .server(r#"upgrade_idle_timeout = "2s""#)
        .admin()
        .route(
            Route::new("ws")
                .upstream(&format!("http://127.0.0.1:{}", server.port))
                .line(r#"concurrency = { max_in_flight = 1 }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let url = format!("ws://{}/quiet", gate.addr);
    let silent =
        tokio::spawn(
            async move { client("ws_peer.py", &["silent".into(), url, "10".into()]).await },
        );
    let http = support::TestClient::http1();
    let in_flight = |text: &str| text.contains("floodgate_concurrency_in_flight{route=\"ws\"} 1");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !in_flight(&metrics_text(&gate).await) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tunnel never took its slot"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The tunnel is open and silent: its slot is taken.
    assert_eq!(http.get(&gate.url("/plain"), &[]).await.status, 503);
    let closed = silent.await.expect("silent client");
    assert!(
        closed[0]["closed_after"].as_f64().is_some(),
        "{}",
        closed[0]
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !metrics_text(&gate)
        .await
        .contains("floodgate_concurrency_in_flight{route=\"ws\"} 0")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the slot was never given back"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_ne!(http.get(&gate.url("/plain"), &[]).await.status, 503);
}
