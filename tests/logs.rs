//! What floodgate writes to its log, read from a real process: JSON fields
//! are plain values, a client's credential never appears in clear, fatal
//! errors are JSON lines under `--log-format json`, and a `FLOODGATE_LOG`
//! that would silence everything is refused at start.

mod support;

use std::process::Command;
use std::time::Duration;

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
        .find(|l| l["message"] == "rate limit: request denied (429)")
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

/// A file with one route keyed by `x-api-key` (one request an hour), and a
/// second keyed by address, floodgate on `port`.
fn denials_config(dir: &std::path::Path, port: u16, extra: &str) -> std::path::PathBuf {
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            r#"[server]
listen = "127.0.0.1:{port}"
{extra}

[[routes]]
name = "login"
match = {{ path_prefix = "/login" }}
respond = {{ status = 200 }}
limits = [{{ algorithm = "fixed_window", limit = 1, window = "1h" }}]

[[routes]]
name = "keyed"
respond = {{ status = 200 }}
client = {{ from = "header", name = "x-api-key" }}
limits = [{{ algorithm = "fixed_window", limit = 1, window = "1h" }}]
"#
        ),
    )
    .expect("write config");
    config
}

/// Per route and client: the denials the log accounts for (a line for a
/// denial, and the count each line folded), from the JSON log `lines`.
fn denials_shown(lines: &[serde_json::Value]) -> std::collections::BTreeMap<(String, String), u64> {
    let mut shown = std::collections::BTreeMap::new();
    for line in lines.iter().filter(|l| l["target"] == "floodgate::denials") {
        assert_eq!(line["level"], "INFO", "{line}");
        let folded = line["folded"]
            .as_u64()
            .unwrap_or_else(|| panic!("no count: {line}"));
        let denial = u64::from(line["message"] == "rate limit: request denied (429)");
        let key = (
            line["route"].as_str().unwrap_or("").to_owned(),
            line["client"].as_str().unwrap_or("").to_owned(),
        );
        *shown.entry(key).or_insert(0) += denial + folded;
    }
    shown
}

/// Denials are logged at info by default, once per route and client per
/// interval with the count of what was folded since: every denial is
/// accounted for, and no API key is written.
#[tokio::test]
async fn denials_are_logged_at_info_once_per_route_and_client_with_the_folded_count() {
    let port = free_port();
    let dir = temp_dir("denial-log");
    let config = denials_config(&dir, port, "");
    let log = dir.join("floodgate.log");
    let mut process =
        FloodgateProcess::spawn_logging(&config, port, &[], &["--log-format", "json"], &log).await;
    let client = TestClient::http1();
    for (path, key) in [("/login", ""), ("/api", "alice-key"), ("/api", "bob-key")] {
        let headers: &[(&str, &str)] = if key.is_empty() {
            &[]
        } else {
            &[("x-api-key", key)]
        };
        for i in 0..76 {
            let a = client.get(&process.url(path), headers).await;
            assert_eq!(a.status, if i == 0 { 200 } else { 429 }, "{path} {key}");
        }
    }
    // The folded counts come out once the interval (10 s) has passed.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let shown = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let shown = denials_shown(&json_lines(&text));
        if shown.len() == 3 && shown.values().all(|n| *n == 75) {
            assert!(
                !text.contains("alice-key") && !text.contains("bob-key"),
                "{text}"
            );
            break shown;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "75 denials per route and client not accounted for: {shown:?}\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let routes: Vec<&str> = shown.keys().map(|(route, _)| route.as_str()).collect();
    assert_eq!(routes, ["keyed", "keyed", "login"]);
    let lines = json_lines(&std::fs::read_to_string(&log).unwrap_or_default())
        .into_iter()
        .filter(|l| l["target"] == "floodgate::denials")
        .count();
    assert!(lines <= 6, "{lines} lines for 3 clients in one interval");
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));
    let _ = std::fs::remove_dir_all(dir);
}

/// 10 000 denials of 100 clients: the log stays a few lines a second, and
/// still accounts for every denial.
#[tokio::test]
async fn a_flood_of_denials_writes_a_bounded_number_of_lines() {
    let port = free_port();
    let dir = temp_dir("denial-flood");
    let config = denials_config(&dir, port, r#"denial_log_interval = "2s""#);
    let log = dir.join("floodgate.log");
    let started = std::time::Instant::now();
    let mut process =
        FloodgateProcess::spawn_logging(&config, port, &[], &["--log-format", "json"], &log).await;
    let url = process.url("/api");
    let tasks: Vec<_> = (0..4)
        .map(|task| {
            let url = url.clone();
            tokio::spawn(async move {
                let client = TestClient::http1();
                let mut denied = 0u64;
                for key in (0..100).filter(|k| k % 4 == task) {
                    let key = format!("key-{key}");
                    for _ in 0..101 {
                        let a = client.get(&url, &[("x-api-key", &key)]).await;
                        denied += u64::from(a.status == 429);
                    }
                }
                denied
            })
        })
        .collect();
    let mut denied = 0;
    for task in tasks {
        denied += task.await.expect("client task");
    }
    assert_eq!(denied, 10_000);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines = json_lines(&text);
        let shown: u64 = denials_shown(&lines).values().sum();
        let written = lines
            .iter()
            .filter(|l| l["target"] == "floodgate::denials")
            .count();
        // At most 20 lines in each second of the clock (summaries
        // included), and the time since `started` touches at most its
        // whole seconds plus two partial ones.
        let seconds = started.elapsed().as_secs() + 2;
        assert!(
            written as u64 <= 20 * seconds,
            "{written} denial lines in {seconds} clock seconds"
        );
        if shown == 10_000 {
            assert!(written < 2_000, "{written} lines for 10 000 denials");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{shown} of 10 000 denials accounted for"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));
    let _ = std::fs::remove_dir_all(dir);
}
