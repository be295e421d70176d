//! The admin listener's dashboard, rendered by headless Chromium: its
//! script polls `/status.json` and `/clients/top` and fills in the routes
//! with their limits, counts and rate charts, the store's state and the
//! most limited clients. A screenshot is left for people to look at.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::config::{Config, Route};
use support::{Floodgate, TestClient, temp_dir};

/// Runs headless Chromium on `url` with `extra` flags (a screenshot, or
/// the DOM after its scripts ran); `None` when Chromium is not installed
/// and the test is allowed to skip it.
async fn chromium(url: &str, profile: &Path, extra: &[&str]) -> Option<String> {
    let mut args: Vec<String> = [
        "60",
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--virtual-time-budget=6000",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    args.push(format!("--user-data-dir={}", profile.display()));
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args.push(url.to_owned());
    let found = Command::new("chromium").arg("--version").output().is_ok();
    if !found {
        assert!(
            std::env::var_os("FLOODGATE_TEST_NEEDS_CHROMIUM").is_none(),
            "Chromium is required here and not installed"
        );
        eprintln!("chromium is not installed: the dashboard test is skipped");
        return None;
    }
    let out = tokio::task::spawn_blocking(move || Command::new("timeout").args(&args).output())
        .await
        .expect("chromium task")
        .expect("run chromium");
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_routes_limits_store_and_the_most_limited_client() {
    let toml = Config::new()
        .admin()
        .access_log(&[r#"format = "off""#, r#"client_id = "raw""#])
        .route(
            Route::new("login")
                .matching(r#"path_prefix = "/login""#)
                .respond("status = 200")
                .client(r#"from = "header", name = "x-client""#)
                .limit("sliding_log", 5, "1m"),
        )
        .route(
            Route::new("api")
                .respond("status = 200")
                .line("concurrency = { max_in_flight = 4 }")
                .limit("token_bucket", 1000, "1s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    for _ in 0..25 {
        client
            .get(&gate.url("/login"), &[("x-client", "mallory")])
            .await;
    }
    for _ in 0..3 {
        client
            .get(&gate.url("/login"), &[("x-client", "alice")])
            .await;
    }
    // Traffic while the page polls, so that its charts have rates to draw.
    let load = tokio::spawn({
        let (client, url) = (client.clone(), gate.url("/api/x"));
        async move {
            for _ in 0..400 {
                client.get(&url, &[]).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    });

    let dir = temp_dir("dashboard");
    let page = gate.admin_url("/");
    let Some(dom) = chromium(&page, &dir.join("profile-dom"), &["--dump-dom"]).await else {
        return;
    };
    let rows: Vec<&str> = dom.split("<tr data-route=").skip(1).collect();
    assert_eq!(rows.len(), 2, "{dom}");
    assert!(rows[0].starts_with("\"login\""), "{}", rows[0]);
    assert!(rows[0].contains("5/60s sliding_log"), "{}", rows[0]);
    assert!(rows[0].contains("<canvas"), "a rate chart: {}", rows[0]);
    // login: 5 allowed for mallory, 3 for alice; 20 denied.
    assert!(
        rows[0].contains(r#"<td class="n">8</td><td class="n">20</td>"#),
        "{}",
        rows[0]
    );
    assert!(rows[1].contains("1000/1s token_bucket"), "{}", rows[1]);
    // In flight: none capped on login; api's cap of 4.
    let row = |r: &str| r.split("</tr>").next().unwrap_or_default().to_owned();
    assert!(
        row(rows[0]).ends_with(r#"<td class="n">–</td>"#),
        "{}",
        rows[0]
    );
    assert!(
        row(rows[1]).ends_with(r#"/4</td>"#) && !row(rows[1]).contains("refused"),
        "{}",
        rows[1]
    );
    assert!(dom.contains("up, breaker closed"), "store state");
    let top = dom
        .split("<tbody id=\"top\">")
        .nth(1)
        .expect("the clients table");
    assert!(
        top.starts_with("<tr><td>login</td><td><code>mallory</code></td><td class=\"n\">5</td><td class=\"n\">20</td></tr>"),
        "{top}"
    );
    assert!(!top.contains("alice"), "alice was never denied: {top}");

    let shot = dir.join("dashboard.png");
    let flag = format!("--screenshot={}", shot.display());
    chromium(
        &page,
        &dir.join("profile-shot"),
        &[&flag, "--window-size=1280,520"],
    )
    .await;
    load.await.expect("load");
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    println!("dashboard screenshot: {}", shot.display());
}
