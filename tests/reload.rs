//! Hot reload: a changed file or SIGHUP swaps the rules without dropping
//! anything; a broken file is refused and the old rules stay.

mod support;

use std::time::{Duration, Instant};

use support::{Floodgate, FloodgateProcess, TestClient, Upstream, free_port, temp_dir};

fn rules(listen: &str, limit: u64, extra_server: &str) -> String {
    format!(
        r#"
[server]
listen = "{listen}"
admin_listen = "127.0.0.1:0"
{extra_server}

[[routes]]
name = "api"
respond = {{ status = 200, body = "ok" }}
limits = [{{ algorithm = "fixed_window", limit = {limit}, window = "1h" }}]
"#
    )
}

/// The `RateLimit-Policy` quota `q` the route reports now.
async fn quota(url: &str) -> String {
    let a = TestClient::http1().get(url, &[]).await;
    a.header("ratelimit-policy").unwrap_or_default().to_owned()
}

async fn wait_for_quota(url: &str, want: &str, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if quota(url).await.contains(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

fn metric(text: &str, series: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(u64::MAX)
}

#[tokio::test]
async fn a_changed_file_applies_a_broken_one_is_refused_and_in_flight_requests_finish() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("reload");
    let path = dir.join("floodgate.toml");
    let slow_route = format!(
        "\n[[routes]]\nname = \"slow\"\nmatch = {{ path_prefix = \"/slow\" }}\nupstream = \"{}\"\n",
        upstream.url()
    );
    let with_slow = |limit| {
        let text = rules("127.0.0.1:0", limit, "");
        text.replace(
            "[[routes]]\nname = \"api\"",
            &format!("{slow_route}\n[[routes]]\nname = \"api\""),
        )
    };
    std::fs::write(&path, with_slow(2)).expect("write");
    let gate = Floodgate::start_file(&path).await;
    let client = TestClient::http1();
    let api = gate.url("/api");
    let started = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    assert_eq!(
        metric(&started, "floodgate_config_last_reload_successful"),
        1,
        "the file read at start was applied"
    );
    assert_eq!(client.get(&api, &[]).await.status, 200);
    assert_eq!(client.get(&api, &[]).await.status, 200);
    assert_eq!(client.get(&api, &[]).await.status, 429);

    let slow_url = gate.url("/slow?ms=1500");
    let in_flight = tokio::spawn(async move { TestClient::http1().get(&slow_url, &[]).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    std::fs::write(&path, with_slow(5)).expect("rewrite");
    assert!(
        wait_for_quota(&api, "q=5", Duration::from_secs(5)).await,
        "new limit never applied"
    );
    assert_eq!(
        in_flight.await.expect("in flight").status,
        200,
        "reload cut an in-flight request"
    );

    // A broken file: logged, counted, and the limit of 5 stays.
    std::fs::write(
        &path,
        "[server]\nlisten = \"127.0.0.1:0\"\n[[routes]]\nname = \"api\"\nlimits = 7\n",
    )
    .expect("break");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = TestClient::http1()
            .get(&gate.admin_url("/metrics"), &[])
            .await
            .text();
        if metric(
            &metrics,
            "floodgate_config_reloads_total{result=\"failure\"}",
        ) == 1
        {
            assert_eq!(
                metric(
                    &metrics,
                    "floodgate_config_reloads_total{result=\"success\"}"
                ),
                1
            );
            // The alert's gauge stays 0 for as long as the file is broken.
            assert_eq!(
                metric(&metrics, "floodgate_config_last_reload_successful"),
                0
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the broken file was not noticed:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        quota(&api).await.contains("q=5"),
        "old rules must stay after a broken file"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A reload that removes a route removes its series from `/metrics`; a
/// route that stays keeps its counts.
#[tokio::test]
async fn a_reload_that_removes_a_route_removes_its_metrics() {
    let dir = temp_dir("reload-metrics");
    let path = dir.join("floodgate.toml");
    let without_old = rules("127.0.0.1:0", 100, "");
    let with_old = without_old.replace(
        "[[routes]]\nname = \"api\"",
        "[[routes]]\nname = \"old\"\nmatch = { path_prefix = \"/old\" }\nrespond = { status = 200 }\n\n[[routes]]\nname = \"api\"",
    );
    std::fs::write(&path, &with_old).expect("write");
    let gate = Floodgate::start_file(&path).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/old"), &[]).await.status, 200);
    assert_eq!(client.get(&gate.url("/api"), &[]).await.status, 200);
    let scrape = || async {
        TestClient::http1()
            .get(&gate.admin_url("/metrics"), &[])
            .await
            .text()
    };
    let old_allowed = "floodgate_requests_total{route=\"old\",outcome=\"allowed\"}";
    let api_allowed = "floodgate_requests_total{route=\"api\",outcome=\"allowed\"}";
    let text = scrape().await;
    assert_eq!(metric(&text, old_allowed), 1, "{text}");

    std::fs::write(&path, &without_old).expect("rewrite");
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let text = scrape().await;
        if !text.contains("route=\"old\"") {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the removed route's series stayed:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(metric(&text, api_allowed), 1, "{text}");
    assert_eq!(client.get(&gate.url("/old"), &[]).await.status, 200);
    let text = scrape().await;
    assert_eq!(metric(&text, api_allowed), 2, "/old is now the api route");
    assert!(!text.contains("route=\"old\""), "{text}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn reload_notification_applies_the_file_when_watching_is_off() {
    let dir = temp_dir("sighup");
    let path = dir.join("floodgate.toml");
    std::fs::write(&path, rules("127.0.0.1:0", 2, "reload_on_change = false")).expect("write");
    let gate = Floodgate::start_file(&path).await;
    let api = gate.url("/api");
    assert!(quota(&api).await.contains("q=2"));
    std::fs::write(&path, rules("127.0.0.1:0", 9, "reload_on_change = false")).expect("rewrite");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        quota(&api).await.contains("q=2"),
        "the file was applied without being asked"
    );
    gate.reload.notify_one();
    assert!(wait_for_quota(&api, "q=9", Duration::from_secs(3)).await);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn sighup_reloads_the_real_binary() {
    let dir = temp_dir("sighup-bin");
    let path = dir.join("floodgate.toml");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let text = |limit| {
        rules(&listen, limit, "reload_on_change = false")
            .replace("admin_listen = \"127.0.0.1:0\"\n", "")
    };
    std::fs::write(&path, text(2)).expect("write");
    let mut process = FloodgateProcess::spawn(&path, port).await;
    let api = process.url("/api");
    assert!(quota(&api).await.contains("q=2"));
    std::fs::write(&path, text(6)).expect("rewrite");
    process.signal("-HUP");
    assert!(
        wait_for_quota(&api, "q=6", Duration::from_secs(5)).await,
        "SIGHUP did not reload"
    );
    process.signal("-TERM");
    assert_eq!(process.exit_code().await, Some(0));
    let _ = std::fs::remove_dir_all(dir);
}
