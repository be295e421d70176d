//! What floodgate writes to its log, read from a real process: JSON fields
//! are plain values, a client's credential never appears in clear, fatal
//! errors are JSON lines under `--log-format json`, and a `FLOODGATE_LOG`
//! that would silence everything is refused at start.

mod support;

use std::process::Command;

use support::{FloodgateProcess, TestClient, free_port, temp_dir};

/// The JSON objects of a log file, one per line; a line that is not one
/// fails the test.
fn json_lines(text: &str) -> Vec<serde_json::Value> {
    text.lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON line ({e}): {line}"))
        })
        .collect()
}

#[tokio::test]
async fn json_log_fields_are_plain_values_and_api_keys_are_not_written() {
    let (port, admin) = (free_port(), free_port());
    let dir = temp_dir("json-log");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"
drain_delay = "0s"

[[routes]]
name = "keyed"
respond = {{ status = 200 }}
client = {{ from = "header", name = "x-api-key" }}
limits = [{{ algorithm = "fixed_window", limit = 1, window = "1h" }}]
"#
        ),
    )
    .expect("write config");
    let log = dir.join("floodgate.log");
    let mut process = FloodgateProcess::spawn_logging(
        &config,
        port,
        &[("FLOODGATE_LOG", "info,floodgate=debug")],
        &["--log-format", "json"],
        &log,
    )
    .await;
    let client = TestClient::http1();
    let secret = "sk_live_4f9a8c2e7d1b";
    let statuses: Vec<u16> = [
        client
            .get(&process.url("/"), &[("x-api-key", secret)])
            .await,
        client
            .get(&process.url("/"), &[("x-api-key", secret)])
            .await,
    ]
    .iter()
    .map(|a| a.status.as_u16())
    .collect();
    assert_eq!(statuses, [200, 429]);
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));

    let text = std::fs::read_to_string(&log).expect("read the log");
    assert!(!text.contains(secret), "the API key is in the log:\n{text}");
    let lines = json_lines(&text);
    let listening = lines
        .iter()
        .find(|l| l["message"] == "floodgate listening")
        .expect("a start line");
    assert_eq!(listening["admin"], format!("127.0.0.1:{admin}"));
    assert_eq!(listening["listen"], format!("127.0.0.1:{port}"));
    let denied = lines
        .iter()
        .find(|l| l["message"] == "denied")
        .unwrap_or_else(|| panic!("no denial line:\n{text}"));
    assert_eq!(denied["route"], "keyed");
    let shown = denied["client"].as_str().expect("client is a string");
    assert!(
        shown.len() == 20
            && shown.starts_with("key:")
            && shown[4..].bytes().all(|b| b.is_ascii_hexdigit()),
        "client shown as {shown:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn fatal_errors_are_json_lines_under_log_format_json() {
    let root = env!("CARGO_MANIFEST_DIR");
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["--log-format", "json", "--config"])
        .arg(format!("{root}/config/invalid/upstream_health.toml"))
        .output()
        .expect("run floodgate");
    assert_eq!(output.status.code(), Some(1));
    let text = String::from_utf8_lossy(&output.stderr);
    let lines = json_lines(&text);
    assert_eq!(lines.len(), 3, "{text}");
    for line in &lines {
        assert_eq!(line["level"], "ERROR");
    }
    assert!(
        lines[0]["message"].as_str().is_some_and(
            |m| m.ends_with("upstream_health.toml:9:17: resolve_every must be at least 100ms")
        ),
        "{text}"
    );
}

#[test]
fn a_floodgate_log_that_names_no_level_is_refused_at_start() {
    let root = env!("CARGO_MANIFEST_DIR");
    for (value, format) in [("verbose", "text"), ("info,loud", "json")] {
        let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .env("FLOODGATE_LOG", value)
            .args(["--log-format", format, "--config"])
            .arg(format!("{root}/config/quickstart.toml"))
            .output()
            .expect("run floodgate");
        assert_eq!(output.status.code(), Some(1), "{value}");
        let text = String::from_utf8_lossy(&output.stderr);
        assert!(
            text.contains("is not a level; use trace, debug, info, warn, error or off"),
            "{value}: {text}"
        );
        if format == "json" {
            assert_eq!(json_lines(&text)[0]["level"], "ERROR");
        }
    }
    // Levels and TARGET=LEVEL directives are accepted.
    let output = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .env("FLOODGATE_LOG", "warn,floodgate::proxy=debug")
        .args(["--check", "--config"])
        .arg(format!("{root}/config/quickstart.toml"))
        .output()
        .expect("run floodgate");
    assert_eq!(output.status.code(), Some(0));
}

/// A client that stops sending its request body is the client's fault, and
/// the log line says so: it is not written as the upstream's trouble.
#[tokio::test]
async fn a_stalled_request_body_is_logged_as_the_clients_fault() {
    let upstream = support::Upstream::start().await;
    let port = free_port();
    let dir = temp_dir("stalled-body-log");
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[server]
listen = "127.0.0.1:{port}"
drain_delay = "0s"
client_body_timeout = "300ms"

[[routes]]
name = "upload"
upstream = "{}"
"#,
            upstream.url()
        ),
    )
    .expect("write config");
    let log = dir.join("floodgate.log");
    let mut process =
        FloodgateProcess::spawn_logging(&config, port, &[], &["--log-format", "json"], &log).await;
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n0123456789")
        .await
        .expect("write");
    let mut answer = vec![0u8; 1024];
    let n = s.read(&mut answer).await.expect("read");
    assert!(
        answer[..n].starts_with(b"HTTP/1.1 408 "),
        "{}",
        String::from_utf8_lossy(&answer[..n])
    );
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));

    let text = std::fs::read_to_string(&log).expect("read the log");
    let lines = json_lines(&text);
    let stalled = lines
        .iter()
        .find(|l| l["fault"] == "client")
        .unwrap_or_else(|| panic!("no line naming the client's fault:\n{text}"));
    assert_eq!(
        stalled["message"],
        "the client stopped sending its request body (408)"
    );
    assert!(stalled.get("upstream").is_none(), "{stalled}");
    let _ = std::fs::remove_dir_all(dir);
}
