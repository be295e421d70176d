//! The access log, read from a real floodgate process: one line per
//! request with its route, decision, limit, client (hashed unless asked
//! otherwise), upstream endpoint, bytes and times; allowed requests
//! sampled; denials capped per client; the file reopened on SIGUSR1.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::config::{Config, Route};
use support::{FloodgateProcess, TestClient, Upstream, free_port};

/// The log's lines once it has at least `count` (waiting up to 5 s).
async fn lines(path: &Path, count: usize) -> Vec<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        if lines.len() >= count {
            return lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} lines in {}, not {count}:\n{text}",
            lines.len(),
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn json(line: &str) -> serde_json::Value {
    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"))
}

/// floodgate started on `config`, its access log at `access.log` beside it.
async fn start(test: &str, config: Config) -> (FloodgateProcess, PathBuf) {
    let port = free_port();
    let path = config
        .listen_on(port)
        .server(r#"drain_delay = "0s""#)
        .write(test);
    let log = path.with_file_name("access.log");
    let _ = std::fs::remove_file(&log);
    (FloodgateProcess::spawn(&path, port).await, log)
}

#[tokio::test]
async fn json_lines_tell_the_route_decision_limit_client_endpoint_bytes_and_times() {
    let upstream = Upstream::start().await;
    let (process, log) = start(
        "access-json",
        Config::new().access_log(&[r#"path = "access.log""#]).route(
            Route::new("api")
                .matching(r#"path_prefix = "/api""#)
                .upstream(&upstream.url())
                .client(r#"from = "header", name = "x-api-key""#)
                .limit("fixed_window", 2, "1h"),
        ),
    )
    .await;
    let client = TestClient::http1();
    let key = [("x-api-key", "sk_live_secret_1")];
    let mut bodies = Vec::new();
    for _ in 0..3 {
        let answer = client.get(&process.url("/api/a?x=1"), &key).await;
        bodies.push((answer.status.as_u16(), answer.body.len()));
    }
    assert_eq!(client.get(&process.url("/nowhere"), &[]).await.status, 404);
    assert_eq!(
        bodies.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        [200, 200, 429]
    );

    let lines = lines(&log, 4).await;
    assert_eq!(lines.len(), 4, "{lines:#?}");
    assert!(lines.iter().all(|l| !l.contains("sk_live_secret_1")));
    let first = json(&lines[0]);
    assert_eq!(first["method"], "GET");
    assert_eq!(first["path"], "/api/a?x=1");
    assert_eq!(first["status"], 200);
    assert_eq!(first["route"], "api");
    assert_eq!(first["decision"], "allowed");
    assert_eq!(first["limit"], "api");
    assert_eq!(first["remaining"], 1);
    // Decided by the memory store, by this instance's clock, just now.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis();
    let decided_at = first["decided_at_ms"].as_u64().map(u128::from);
    assert!(
        decided_at.is_some_and(|at| at <= now_ms && now_ms - at < 60_000),
        "{first}"
    );
    assert_eq!(first["upstream"], upstream.url());
    assert_eq!(first["bytes_out"], bodies[0].1);
    assert!(first["upstream_ms"].as_f64().is_some_and(|ms| ms >= 0.0));
    assert!(first["ms"].as_f64() >= first["upstream_ms"].as_f64());
    assert!(
        first["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with("127.0.0.1:"))
    );
    assert!(
        first["time"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z') && t.len() == 24)
    );
    let client_shown = first["client"].as_str().expect("a client");
    assert!(
        client_shown.len() == 16 && client_shown.bytes().all(|b| b.is_ascii_hexdigit()),
        "{client_shown}"
    );
    let denied = json(&lines[2]);
    assert_eq!(denied["status"], 429);
    assert_eq!(denied["decision"], "denied");
    assert_eq!(denied["remaining"], 0);
    assert_eq!(denied["client"], client_shown, "one client, one digest");
    assert!(denied.get("upstream").is_none());
    let unrouted = json(&lines[3]);
    assert_eq!(unrouted["status"], 404);
    assert_eq!(unrouted["route"], "");
    assert_eq!(unrouted["decision"], "-");
}

#[tokio::test]
async fn denials_are_capped_per_client_and_allowed_requests_can_be_sampled_out() {
    let (process, log) = start(
        "access-caps",
        Config::new()
            .admin_on(free_port())
            .access_log(&[
                r#"path = "access.log""#,
                r#"format = "text""#,
                r#"client_id = "raw""#,
                "sample_allowed = 0.0",
                "denied_per_client = 3",
            ])
            .route(
                Route::new("api")
                    .respond("status = 200")
                    .client(r#"from = "header", name = "x-client""#)
                    .limit("fixed_window", 1, "1h"),
            ),
    )
    .await;
    let client = TestClient::http1();
    for (who, times) in [("flood", 60), ("calm", 3)] {
        for _ in 0..times {
            client.get(&process.url("/x"), &[("x-client", who)]).await;
        }
    }
    // A last line that is not capped shows the writer has caught up.
    client
        .get(&process.url("/x"), &[("x-client", "last")])
        .await;
    client
        .get(&process.url("/x"), &[("x-client", "last")])
        .await;
    let lines = lines(&log, 1).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut lines = lines;
    while !lines.iter().any(|l| l.contains(" last ")) {
        assert!(std::time::Instant::now() < deadline, "{lines:#?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        lines = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
    }
    let of = |who: &str| {
        lines
            .iter()
            .filter(|l| l.contains(&format!(" {who} ")))
            .count()
    };
    // Denials: at most 3 a second each (6 if the flood crossed a second).
    assert!((3..=6).contains(&of("flood")), "{lines:#?}");
    // calm: one allowed (sampled out), two denied, under the cap.
    assert_eq!(of("calm"), 2, "{lines:#?}");
    // No allowed request was logged.
    assert!(lines.iter().all(|l| l.contains("\" 429 ")), "{lines:#?}");
    assert!(
        lines[0].contains("\"GET /x HTTP/1.1\" 429 ")
            && lines[0].contains(" route=api decision=denied limit=api remaining=0"),
        "{}",
        lines[0]
    );
}

#[tokio::test]
async fn sigusr1_reopens_the_file_that_logrotate_moved() {
    let (process, log) = start(
        "access-rotate",
        Config::new()
            .access_log(&[r#"path = "access.log""#])
            .route(Route::new("all").respond("status = 204")),
    )
    .await;
    let client = TestClient::http1();
    client.get(&process.url("/before"), &[]).await;
    lines(&log, 1).await;
    let rotated = log.with_file_name("access.log.1");
    std::fs::rename(&log, &rotated).expect("rotate");
    process.signal("-USR1");
    // The signal is handled asynchronously: give it a moment.
    tokio::time::sleep(Duration::from_millis(200)).await;
    client.get(&process.url("/after"), &[]).await;
    let now = lines(&log, 1).await;
    assert_eq!(now.len(), 1);
    assert_eq!(json(&now[0])["path"], "/after");
    let old = std::fs::read_to_string(&rotated).expect("the rotated file");
    assert_eq!(old.lines().count(), 1);
    assert!(old.contains("\"/before\""));
}

#[tokio::test]
async fn a_store_that_cannot_decide_is_logged_as_a_store_error() {
    let closed = free_port();
    let (process, log) = start(
        "access-store-error",
        Config::new()
            .redis(&format!("redis://127.0.0.1:{closed}"), "access")
            .store(r#"on_error = "allow""#)
            .access_log(&[r#"path = "access.log""#, r#"client_id = "none""#])
            .route(
                Route::new("api")
                    .respond("status = 200")
                    .limit("fixed_window", 5, "1m"),
            ),
    )
    .await;
    let client = TestClient::http1();
    assert_eq!(client.get(&process.url("/x"), &[]).await.status, 200);
    let line = json(&lines(&log, 1).await[0]);
    assert_eq!(line["decision"], "store_error");
    assert_eq!(line["status"], 200);
    assert!(line.get("client").is_none(), "client_id = \"none\": {line}");
    assert!(line.get("limit").is_none());
}
