//! Starting and stopping: the quickstart end to end through the real binary,
//! and graceful shutdown that finishes in-flight requests.

mod support;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::{Floodgate, FloodgateProcess, TestClient, Upstream, free_port, temp_dir};

/// With `drain_delay = "0s"` the listener closes as soon as a stop is asked.
#[tokio::test]
async fn stop_finishes_in_flight_requests_and_refuses_new_connections() {
    let upstream = Upstream::start().await;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\ndrain_delay = \"0s\"\n\n[[routes]]\nname = \"all\"\nupstream = \"{}\"\n",
        upstream.url()
    );
    let mut gate = Floodgate::start(&toml).await;
    let url = gate.url("/slow?ms=800");
    let in_flight = tokio::spawn(async move { TestClient::http1().get(&url, &[]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.begin_stop();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let refused = tokio::net::TcpStream::connect(gate.addr).await;
    assert!(refused.is_err(), "a new connection was accepted after stop");
    let answer = in_flight.await.expect("in-flight task");
    assert_eq!(answer.status, 200, "the in-flight request was cut off");
    gate.join().await.expect("clean stop");
}

#[tokio::test]
async fn stop_closes_idle_connections_at_once_and_lets_http2_requests_finish() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream = Upstream::start().await;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nshutdown_grace = \"30s\"\ndrain_delay = \"0s\"\n\n\
         [[routes]]\nname = \"all\"\nupstream = \"{}\"\n",
        upstream.url()
    );
    let mut gate = Floodgate::start(&toml).await;

    // An HTTP/1 keep-alive connection, idle after one answered request.
    let mut idle = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    idle.write_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut buf = vec![0u8; 4096];
    let n = idle.read(&mut buf).await.expect("read");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK\r\n"));

    // An HTTP/2 request in flight.
    let url = gate.url("/slow?ms=800");
    let in_flight = tokio::spawn(async move { TestClient::h2c().get(&url, &[]).await });
    tokio::time::sleep(Duration::from_millis(200)).await;

    gate.begin_stop();
    // Closed by floodgate, not left for the grace period.
    let read = tokio::time::timeout(Duration::from_secs(10), idle.read(&mut buf))
        .await
        .expect("the idle connection was not closed at stop");
    assert!(matches!(read, Ok(0)), "{read:?}");
    let answer = in_flight.await.expect("in-flight task");
    assert_eq!(
        answer.status, 200,
        "the in-flight HTTP/2 request was cut off"
    );
    tokio::time::timeout(Duration::from_secs(10), gate.join())
        .await
        .expect("stop waited for the grace period")
        .expect("clean stop");
}

/// The README's quickstart, with its port swapped for a free one.
#[tokio::test]
async fn quickstart_serves_200s_then_429_and_stops_on_sigterm() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/config/quickstart.toml")).expect("read");
    let port = free_port();
    let text = text.replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"));
    let dir = temp_dir("quickstart");
    let config = dir.join("floodgate.toml");
    std::fs::write(&config, text).expect("write config");

    // As it starts on a multi-core machine, and pinned to one core (as in a
    // container limited to one CPU).
    for one_cpu in [false, true] {
        let mut process = if one_cpu {
            FloodgateProcess::spawn_on_one_cpu(&config, port).await
        } else {
            FloodgateProcess::spawn(&config, port).await
        };
        let client = TestClient::http1();
        for _ in 0..5 {
            let a = client.get(&process.url("/hello"), &[]).await;
            assert_eq!(a.status, 200, "one cpu: {one_cpu}");
            assert_eq!(a.text(), "hello from floodgate\n");
        }
        let denied = client.get(&process.url("/hello"), &[]).await;
        assert_eq!(denied.status, 429, "one cpu: {one_cpu}");
        assert!(denied.header("retry-after").is_some());

        process.signal("-TERM");
        assert_eq!(process.exit_code().await, Some(0), "one cpu: {one_cpu}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// SIGTERM, in order: `/readyz` turns 503 at once while new connections
/// are still served for `drain_delay`; then the listener closes, the
/// request in flight finishes, and the process exits 0.
#[tokio::test]
async fn sigterm_turns_readyz_to_503_then_drains_and_lets_a_slow_response_finish() {
    let upstream = Upstream::start().await;
    let (port, admin) = (free_port(), free_port());
    let dir = temp_dir("sigterm");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
             drain_delay = \"1500ms\"\n\n[[routes]]\nname = \"all\"\nupstream = \"{}\"\n",
            upstream.url()
        ),
    )
    .expect("write config");
    let mut process = FloodgateProcess::spawn(&config, port).await;
    let client = TestClient::http1();
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    assert_eq!(client.get(&readyz, &[]).await.status, 200);
    let url = process.url("/slow?ms=2500");
    let in_flight = tokio::spawn(async move { TestClient::http1().get(&url, &[]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    process.signal("-TERM");
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Draining: not ready, yet a new connection is still served.
    let ready = client.get(&readyz, &[]).await;
    assert_eq!(ready.status, 503);
    assert_eq!(ready.text(), "not ready: stopping\n");
    let late = TestClient::http1().get(&process.url("/late"), &[]).await;
    assert_eq!(
        late.status, 200,
        "a connection during drain_delay was refused"
    );

    // Past drain_delay: the listener is closed.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err(),
        "a new connection was accepted after drain_delay"
    );
    let answer = in_flight.await.expect("in-flight task");
    assert_eq!(answer.status, 200, "the slow response was cut off");
    assert_eq!(answer.json()["uri"], "/slow?ms=2500");
    assert_eq!(process.exit_code().await, Some(0));
    let _ = std::fs::remove_dir_all(dir);
}

/// The quickstart has no admin listener, so no `/readyz` to turn 503 for a
/// load balancer: a stop skips the drain and closes at once.
#[tokio::test]
async fn without_an_admin_listener_a_stop_skips_the_drain() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/config/quickstart.toml")).expect("read");
    assert!(!text.contains("admin_listen") && !text.contains("drain_delay"));
    let port = free_port();
    let dir = temp_dir("quickstart-stop");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        text.replace("127.0.0.1:8080", &format!("127.0.0.1:{port}")),
    )
    .expect("write config");
    let log = dir.join("floodgate.log");
    let mut process = FloodgateProcess::spawn_logging(&config, port, &[], &[], &log).await;
    let asked = std::time::Instant::now();
    process.signal("-INT");
    assert_eq!(process.exit_code().await, Some(0));
    let took = asked.elapsed();
    let text = std::fs::read_to_string(&log).expect("read the log");
    // The drain announces itself with this line (src/server.rs); a bare
    // "503" would also match a timestamp or a digest in the log.
    assert!(
        text.contains("stop signal received"),
        "the stop was not logged:\n{text}"
    );
    assert!(
        !text.contains("/readyz answers 503") && !text.contains("drain_delay"),
        "the stop drained for a /readyz nobody can ask:\n{text}"
    );
    // The drain it skipped would have been 5 s.
    assert!(took < Duration::from_secs(4), "stopping took {took:?}");
    let _ = std::fs::remove_dir_all(dir);
}

/// A second SIGTERM while a stop drains stops at once: the listener
/// closes and the request in flight is cut, as nginx and Envoy do.
#[tokio::test]
async fn a_second_sigterm_during_a_drain_stops_at_once() {
    let upstream = Upstream::start().await;
    let (port, admin) = (free_port(), free_port());
    let dir = temp_dir("second-sigterm");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\n\
             drain_delay = \"60s\"\nshutdown_grace = \"60s\"\n\n[[routes]]\nname = \"all\"\nupstream = \"{}\"\n",
            upstream.url()
        ),
    )
    .expect("write config");
    let log = dir.join("floodgate.log");
    let mut process = FloodgateProcess::spawn_logging(&config, port, &[], &[], &log).await;
    let mut in_flight = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    in_flight
        .write_all(b"GET /slow?ms=60000 HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("send");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while upstream.hits() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never reached the upstream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    process.signal("-TERM");
    let readyz = format!("http://127.0.0.1:{admin}/readyz");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while TestClient::http1().get(&readyz, &[]).await.status != 503 {
        assert!(std::time::Instant::now() < deadline, "no drain began");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let asked = std::time::Instant::now();
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));
    // The drain and the slow request would have held it a minute.
    let took = asked.elapsed();
    assert!(took < Duration::from_secs(10), "stopping took {took:?}");
    // The connection of the request in flight ends without an answer.
    let mut answer = Vec::new();
    let read =
        tokio::time::timeout(Duration::from_secs(30), in_flight.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection in flight stayed open");
    assert!(
        answer.is_empty(),
        "the request in flight was answered: {}",
        String::from_utf8_lossy(&answer)
    );
    let text = std::fs::read_to_string(&log).expect("read the log");
    assert!(text.contains("second stop signal"), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

/// `--listen` and `--admin-listen` replace the file's addresses, so two
/// instances on one host share one file, and report the same digest.
#[tokio::test]
async fn two_instances_share_one_file_with_listen_flags() {
    let dir = temp_dir("listen-flags");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        "[server]\nlisten = \"127.0.0.1:1\"\n\n[[routes]]\nname = \"all\"\nrespond = { status = 200, body = \"ok\" }\n",
    )
    .expect("write config");
    let mut digests = Vec::new();
    let mut processes = Vec::new();
    for n in 0..2 {
        let (port, admin) = (free_port(), free_port());
        let log = dir.join(format!("{n}.log"));
        let (listen, admin_listen) = (format!("127.0.0.1:{port}"), format!("127.0.0.1:{admin}"));
        let env = [("FLOODGATE_ADMIN_LISTEN", admin_listen.as_str())];
        let process =
            FloodgateProcess::spawn_logging(&config, port, &env, &["--listen", &listen], &log)
                .await;
        let client = TestClient::http1();
        assert_eq!(client.get(&process.url("/"), &[]).await.text(), "ok");
        let metrics = client
            .get(&format!("http://{admin_listen}/metrics"), &[])
            .await
            .text();
        let digest = metrics
            .lines()
            .find(|l| l.starts_with("floodgate_config_info"))
            .unwrap_or_else(|| panic!("no config info:\n{metrics}"))
            .to_owned();
        digests.push(digest);
        processes.push(process);
    }
    assert_eq!(digests[0], digests[1]);
    let _ = std::fs::remove_dir_all(dir);
}
