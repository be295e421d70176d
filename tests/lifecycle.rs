//! Starting and stopping: the quickstart end to end through the real binary,
//! and graceful shutdown that finishes in-flight requests.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Floodgate, TestClient, Upstream};

#[tokio::test]
async fn stop_finishes_in_flight_requests_and_refuses_new_connections() {
    let upstream = Upstream::start().await;
    let toml = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\n\n[[routes]]\nname = \"all\"\nupstream = \"{}\"\n",
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

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The README's quickstart, with its port swapped for a free one.
#[tokio::test]
async fn quickstart_serves_200s_then_429_and_stops_on_sigterm() {
    let root = env!("CARGO_MANIFEST_DIR");
    let text = std::fs::read_to_string(format!("{root}/config/quickstart.toml")).expect("read");
    let port = free_port();
    let text = text.replace("127.0.0.1:8080", &format!("127.0.0.1:{port}"));
    let dir = std::env::temp_dir().join(format!("floodgate-quickstart-{port}"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let config = dir.join("floodgate.toml");
    std::fs::write(&config, text).expect("write config");

    let mut child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start floodgate");
    let url = format!("http://127.0.0.1:{port}/hello");
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            Instant::now() < deadline,
            "floodgate did not start listening"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = TestClient::http1();
    for _ in 0..5 {
        let a = client.get(&url, &[]).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.text(), "hello from floodgate\n");
    }
    let denied = client.get(&url, &[]).await;
    assert_eq!(denied.status, 429);
    assert!(denied.header("retry-after").is_some());

    let pid = child.id().to_string();
    let killed = Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "floodgate did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0));
    let _ = std::fs::remove_dir_all(dir);
}
