//! Client connections: one descriptor each, the open file limit raised to
//! what the system allows, and a cap past which new connections wait in the
//! listen backlog instead of failing.

mod support;

use std::time::Duration;

use support::config::{Config, Route};
use support::{Floodgate, FloodgateProcess, TestClient, free_port};
use tokio::net::TcpStream;

/// `floodgate_open_connections` from an admin listener's `/metrics`.
async fn open_connections(client: &TestClient, metrics_url: &str) -> u64 {
    let text = client.get(metrics_url, &[]).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix("floodgate_open_connections "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no floodgate_open_connections in:\n{text}"))
}

/// Waits until `floodgate_open_connections` is at least `n`.
async fn until_open(client: &TestClient, metrics_url: &str, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let open = open_connections(client, metrics_url).await;
        if open >= n {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "only {open} of {n} connections open"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn two_thousand_idle_connections_under_a_4096_file_limit_leave_floodgate_serving() {
    // Started with a soft limit of 1 024, which floodgate raises.
    // This test's own process holds the 2 000 client ends.
    let own = floodgate::server::raise_open_file_limit().expect("raise own limit");
    assert!(own >= 2_200, "the test needs 2 200 open files, has {own}");
    let port = free_port();
    let admin = free_port();
    let path = Config::new()
        .listen_on(port)
        .admin_on(admin)
        .server(r#"header_read_timeout = "60s""#)
        .route(Route::new("api"))
        .write("idle-connections");
    let gate = FloodgateProcess::spawn_with_open_files(&path, port, 4_096).await;
    // floodgate raised its soft limit of 1 024 to the hard 4 096.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", gate.pid())).expect("limits");
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .map(|l| l.split_whitespace().skip(3).take(2).collect())
        .unwrap_or_default();
    assert_eq!(open_files, ["4096", "4096"], "{limits}");
    let mut idle = Vec::with_capacity(2_000);
    for _ in 0..2_000 {
        idle.push(
            TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect"),
        );
    }
    let client = TestClient::http1();
    let metrics = format!("http://127.0.0.1:{admin}/metrics");
    // The probe connection of the spawn counts until it closes: at least
    // the 2 000.
    until_open(&client, &metrics, 2_000).await;
    // One descriptor per client connection.
    let descriptors = std::fs::read_dir(format!("/proc/{}/fd", gate.pid()))
        .expect("floodgate's descriptors")
        .count();
    assert!(
        (2_000..2_200).contains(&descriptors),
        "{descriptors} descriptors for 2 000 connections"
    );
    assert_eq!(client.get(&gate.url("/"), &[]).await.status, 200);
    let health = client
        .get(&format!("http://127.0.0.1:{admin}/healthz"), &[])
        .await;
    assert_eq!(health.status, 200);
    drop(idle);
}

#[tokio::test]
async fn past_max_connections_new_connections_wait_until_one_closes() {
    let toml = Config::new()
        .admin()
        .server("max_connections = 8")
        .server(r#"header_read_timeout = "60s""#)
        .route(Route::new("api"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(TcpStream::connect(gate.addr).await.expect("connect"));
    }
    until_open(&client, &gate.admin_url("/metrics"), 8).await;
    // A ninth connection is taken by the kernel but not served.
    let waiting = tokio::spawn({
        let (client, url) = (client.clone(), gate.url("/"));
        async move { client.get(&url, &[]).await.status.as_u16() }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "served past max_connections");
    // Once one closes, it is served.
    drop(idle.pop());
    let status = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("served once a connection closed")
        .expect("request task");
    assert_eq!(status, 200);
}

/// Reads until the peer closes, or `within` passes; what was read, or
/// `None` if the connection was still open.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<String> {
    use tokio::io::AsyncReadExt as _;
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, stream.read_to_end(&mut got)).await;
    read.ok()
        .map(|_| String::from_utf8_lossy(&got).into_owned())
}

#[tokio::test]
async fn the_admin_listener_closes_connections_that_send_no_head_in_time() {
    use tokio::io::AsyncWriteExt as _;
    let toml = Config::new()
        .admin()
        .server(r#"header_read_timeout = "300ms""#)
        .route(Route::new("api"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let admin = gate.admin.expect("admin listener");
    let mut silent = TcpStream::connect(admin).await.expect("connect");
    let mut dribbling = TcpStream::connect(admin).await.expect("connect");
    dribbling
        .write_all(b"GET /metrics HTTP/1.1\r\nHo")
        .await
        .expect("write");
    for (name, stream) in [("silent", &mut silent), ("dribbling", &mut dribbling)] {
        let closed = read_until_closed(stream, Duration::from_secs(3)).await;
        assert!(
            closed.is_some(),
            "the {name} admin connection was kept open"
        );
    }
    let client = TestClient::http1();
    assert_eq!(
        client.get(&gate.admin_url("/healthz"), &[]).await.status,
        200
    );
}

#[tokio::test]
async fn out_of_descriptors_floodgate_backs_off_logs_once_a_second_and_recovers() {
    let port = free_port();
    let dir = support::temp_dir("accept-backoff");
    let log = dir.join("floodgate.log");
    let path = Config::new()
        .listen_on(port)
        .server("max_connections = 1000")
        .server(r#"header_read_timeout = "60s""#)
        .route(Route::new("api"))
        .write("accept-backoff");
    let gate = FloodgateProcess::spawn_limited(&path, port, 64, 64, Some(&log)).await;
    // More connections than 64 descriptors hold: accept fails for the rest.
    let mut idle = Vec::new();
    for _ in 0..100 {
        idle.push(
            TcpStream::connect(("127.0.0.1", port))
                .await
                .expect("connect"),
        );
    }
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let failed = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains("accept failed"))
            .count()
    };
    let lines = failed();
    assert!(
        (1..=4).contains(&lines),
        "{lines} accept failure lines in 2.5 s:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    drop(idle);
    let client = TestClient::http1();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        match client.try_get(&gate.url("/")).await {
            Ok(status) => {
                assert_eq!(status, 200);
                break;
            }
            Err(e) => assert!(
                std::time::Instant::now() < deadline,
                "not serving again: {e}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log_text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(log_text.contains("accepting again"), "{log_text}");
    let _ = std::fs::remove_dir_all(dir);
}
