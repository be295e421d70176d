//! The admin listener's dashboard, rendered by headless Chromium against a
//! real floodgate with real traffic: its script reads `/status.json`,
//! `/history.json` and `/clients/top` and fills in the routes with their
//! limits, counts and charts of every outcome over floodgate's own 15
//! minutes of history, the store's state node by node, and the most
//! limited clients, worst first. Screenshots are left for people to look
//! at.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use support::cluster::TestCluster;
use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient, Upstream, temp_dir};

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

/// A route that answers 200 itself and counts each `x-client` without
/// ever limiting it.
fn counted() -> Route {
    Route::new("api")
        .respond("status = 200")
        .client(r#"from = "header", name = "x-client""#)
        .limit("fixed_window", 1_000_000, "1h")
}

/// The page after its scripts ran, as Chromium's DOM dump; `None` when
/// Chromium is not installed and the test may skip.
async fn rendered(page: &str, dir: &Path, name: &str) -> Option<String> {
    chromium(page, &dir.join(format!("profile-{name}")), &["--dump-dom"]).await
}

/// Saves a screenshot of `page` in `dir` and checks it is a real picture.
async fn screenshot(page: &str, dir: &Path, name: &str) {
    let shot = dir.join(format!("{name}.png"));
    let flag = format!("--screenshot={}", shot.display());
    chromium(
        page,
        &dir.join(format!("profile-{name}-shot")),
        &[&flag, "--window-size=1280,720"],
    )
    .await;
    let png = std::fs::read(&shot).expect("a screenshot");
    assert!(
        png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
        "{} bytes",
        png.len()
    );
    println!("dashboard screenshot: {}", shot.display());
}

/// The row of route `name` in the dump, up to its end.
fn route_row<'a>(dom: &'a str, name: &str) -> &'a str {
    let start = dom
        .find(&format!("<tr data-route=\"{name}\""))
        .unwrap_or_else(|| panic!("no row for {name}: {dom}"));
    let row = &dom[start..];
    &row[..row.find("</tr>").unwrap_or(row.len())]
}

/// The value of attribute `name` on the first element of `html` that has it.
fn attribute<'a>(html: &'a str, name: &str) -> &'a str {
    let key = format!(" {name}=\"");
    let start = html
        .find(&key)
        .unwrap_or_else(|| panic!("no {name} in {html}"))
        + key.len();
    &html[start..start + html[start..].find('"').unwrap_or(0)]
}

/// The per-point counts the chart in `row` drew for `series`, oldest first.
fn series(row: &str, name: &str) -> Vec<u64> {
    let at = row
        .find(&format!("data-series=\"{name}\""))
        .unwrap_or_else(|| panic!("no {name} series in {row}"));
    let element = &row[at..row[at..].find('>').map_or(row.len(), |e| at + e)];
    attribute(element, "data-counts")
        .split(',')
        .filter(|c| !c.is_empty())
        .map(|c| c.parse().expect("a count"))
        .collect()
}

/// Routes `bulk`, `login`, `catalog` and `api` answered by floodgate, and
/// `metered` on `upstream`; `catalog` draws from budget `calls` and offers
/// plan `pro`.
fn five_routes_with_a_plan_and_a_budget(upstream: &Upstream) -> String {
    Config::new()
        .admin()
        .access_log(&[r#"format = "off""#, r#"client_id = "raw""#])
        .route(
            Route::new("bulk")
                .matching(r#"path_prefix = "/bulk""#)
                .respond("status = 200")
                .client(r#"from = "header", name = "x-client""#)
                .limit("fixed_window", 100, "1m"),
        )
        .route(
            Route::new("login")
                .matching(r#"path_prefix = "/login""#)
                .respond("status = 200")
                .client(r#"from = "header", name = "x-client""#)
                .limit("sliding_log", 5, "1m"),
        )
        .route(
            Route::new("guard")
                .matching(r#"path_prefix = "/guard""#)
                .respond("status = 200")
                .limits(r#"{ algorithm = "sliding_log", limit = 5, window = "10m", count_when = { status = [401, "5xx"] }, penalty = { duration = "15m", factor = 2, max = "4h" } }"#)
                .limits(r#"{ algorithm = "gcra", limit = 10, window = "1s", burst = 9, delay = "1200ms" }"#),
        )
        .route(
            Route::new("metered")
                .matching(r#"path_prefix = "/metered""#)
                .upstream(&upstream.url())
                .line(r#"usage = { reserve = 5, report = "header", units = { "x-units" = 1 } }"#)
                .limit("fixed_window", 100, "1m"),
        )
        .route(
            Route::new("catalog")
                .matching(r#"path_prefix = "/catalog""#)
                .respond("status = 200")
                .client(r#"from = "header", name = "x-client""#)
                .line(r#"plans = ["pro"]"#)
                .line(r#"budgets = ["calls"]"#)
                .limits(r#"{ algorithm = "sliding_log", limit = 7, window = "1m", key = { from = "remote_addr" } }"#),
        )
        .route(
            Route::new("api")
                .respond("status = 200")
                .line("concurrency = { max_in_flight = 4 }")
                .limit("token_bucket", 1000, "1s"),
        )
        .tables(
            r#"[budgets.calls]
limits = [{ algorithm = "fixed_window", limit = 900, window = "1h", key = { from = "global" } }]

[plan_selection]
by = { from = "header", name = "x-plan" }

[plans.pro]
limits = [{ algorithm = "sliding_log", limit = 70, window = "1m" }]"#,
        )
        .toml()
}

/// Denied most to least: mallory 20, trudy 12, carol 10, eve 3; alice
/// never. carol asks most and her route comes first in the file, so
/// neither requests nor configuration order puts mallory first: only
/// denials do. Then 30 requests to `api` and one to `metered`.
async fn traffic_denied_most_to_least(client: &TestClient, gate: &Floodgate) {
    for (who, path, times) in [
        ("carol", "/bulk", 110),
        ("mallory", "/login", 25),
        ("trudy", "/login", 17),
        ("eve", "/login", 8),
        ("alice", "/login", 3),
    ] {
        for _ in 0..times {
            client.get(&gate.url(path), &[("x-client", who)]).await;
        }
    }
    for _ in 0..30 {
        client.get(&gate.url("/api/x"), &[]).await;
    }
    client.get(&gate.url("/metered/x"), &[]).await;
}

/// Six rows, `bulk` first, each with its limits (what a limit counts, its
/// penalty and its delay among them), allowed and denied counts and units where a
/// route meters them.
fn each_route_shows_its_limits_and_counts(dom: &str) {
    let rows: Vec<&str> = dom.split("<tr data-route=").skip(1).collect();
    assert_eq!(rows.len(), 6, "{dom}");
    assert!(rows[0].starts_with("\"bulk\""), "{dom}");
    let login = route_row(dom, "login");
    assert!(login.contains("5/60s sliding_log"), "{login}");
    assert!(login.contains("<svg class=\"chart\""), "a chart: {login}");
    // login: 5 allowed each for mallory, trudy and eve, 3 for alice; 35
    // denied.
    assert!(
        login.contains(r#"<td class="n">18</td><td class="n">35</td>"#),
        "{login}"
    );
    // Units on the metered route only.
    assert!(
        login.contains(r#"<td class="n">–</td><td class="n">–</td>"#),
        "{login}"
    );
    let metered = route_row(dom, "metered");
    assert!(
        metered.contains("5 reserved · 0 reported · 1 unsettled"),
        "{metered}"
    );
    let api = route_row(dom, "api");
    assert!(api.contains("1000/1s token_bucket"), "{api}");
    let guard = route_row(dom, "guard");
    assert!(
        guard.contains(
            "5/600s sliding_log counting status 401, 5xx (penalty 15m, ×2 to 4h, forgotten after 4h)"
        ),
        "{guard}"
    );
    assert!(
        guard.contains("10/1s gcra, held up to 1200 ms past the burst"),
        "{guard}"
    );
}

/// Whose count each limit is, the budget it belongs to, each plan's
/// limits, and the budgets and plans with the routes that use them.
fn the_catalog_shows_its_budget_and_plan(dom: &str) {
    let catalog = route_row(dom, "catalog");
    assert!(
        catalog.contains(
            "7/60s sliding_log per remote_addr, budget calls: 900/3600s fixed_window per global"
        ),
        "{catalog}"
    );
    assert!(
        catalog.contains("plan pro: </span><code>70/60s sliding_log, budget calls: 900/3600s fixed_window per global</code>"),
        "{catalog}"
    );
    assert!(
        dom.contains(
            r#"<tr data-budget="calls"><th>budget calls</th><td>drawn from by catalog</td></tr>"#
        ),
        "{dom}"
    );
    assert!(
        dom.contains(r#"<tr data-plan-routes="pro"><th>plan pro</th><td>on catalog</td></tr>"#),
        "{dom}"
    );
    assert!(
        dom.contains("<th>plans chosen by</th><td>header x-plan from trusted proxies"),
        "{dom}"
    );
}

fn in_flight_shows_each_cap(dom: &str) {
    let login = route_row(dom, "login");
    let api = route_row(dom, "api");
    // In flight: none capped on login; api's cap of 4.
    assert!(login.ends_with(r#"<td class="n">–</td>"#), "{login}");
    let in_flight = &api[api.rfind("<td").unwrap_or(0)..];
    assert!(
        in_flight.ends_with(r#"/4</td>"#) && !in_flight.contains("refused"),
        "{api}"
    );
}

fn every_outcome_is_charted_with_axes_and_legend(dom: &str) {
    let login = route_row(dom, "login");
    // Every outcome has its series, with the axes and the legend.
    for name in floodgate::metrics::history::SERIES {
        series(login, name);
    }
    assert!(
        login.contains(">-15m<") && login.contains(">now<"),
        "{login}"
    );
    assert!(
        login.contains("/s</text>"),
        "a y axis in requests per second: {login}"
    );
    assert!(dom.contains("store errors (on_error)"), "the legend");
}

/// The memory store has no breaker to speak of.
fn the_memory_store_shows_no_breaker(dom: &str) {
    let store = dom
        .split("<tbody id=\"store\">")
        .nth(1)
        .expect("the store table");
    let store = &store[..store.find("</tbody>").unwrap_or(store.len())];
    assert!(
        store.contains("memory") && !store.contains("breaker"),
        "{store}"
    );
}

/// The clients table: mallory, trudy, carol, eve by denials; never alice.
fn the_most_limited_clients_come_worst_first(dom: &str) {
    let top = dom
        .split("<tbody id=\"top\">")
        .nth(1)
        .expect("the clients table");
    let top: Vec<&str> = top[..top.find("</tbody>").unwrap_or(top.len())]
        .split("<tr>")
        .skip(1)
        .collect();
    assert!(
        top[0].starts_with("<td>login</td><td><code>mallory</code></td><td class=\"n\">5</td><td class=\"n\">20</td>"),
        "{top:?}"
    );
    assert!(top[1].contains("trudy"), "{top:?}");
    assert!(
        top[2].starts_with("<td>bulk</td><td><code>carol</code></td><td class=\"n\">100</td><td class=\"n\">10</td>"),
        "{top:?}"
    );
    assert!(top[3].contains("eve") && top.len() == 4, "{top:?}");
    assert!(
        !top.iter().any(|r| r.contains("alice")),
        "alice was never denied: {top:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_routes_limits_store_and_the_most_limited_client() {
    // An upstream that reports no units: the metered route's one request
    // stays at its reservation.
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&five_routes_with_a_plan_and_a_budget(&upstream)).await;
    let client = TestClient::http1();
    traffic_denied_most_to_least(&client, &gate).await;

    let dir = temp_dir("dashboard");
    let page = gate.admin_url("/");
    let Some(dom) = rendered(&page, &dir, "dom").await else {
        return;
    };
    each_route_shows_its_limits_and_counts(&dom);
    the_catalog_shows_its_budget_and_plan(&dom);
    in_flight_shows_each_cap(&dom);
    every_outcome_is_charted_with_axes_and_legend(&dom);
    the_memory_store_shows_no_breaker(&dom);
    the_most_limited_clients_come_worst_first(&dom);
    screenshot(&page, &dir, "dashboard").await;
}

/// A page opened after a minute of traffic draws that minute at once, from
/// floodgate's own history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_opened_after_a_minute_of_traffic_draws_that_minute() {
    let toml = Config::new().admin().route(counted()).toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let started = std::time::Instant::now();
    let mut sent = 0u64;
    while started.elapsed() < Duration::from_secs(62) {
        assert_eq!(
            client
                .get(&gate.url("/"), &[("x-client", "a")])
                .await
                .status,
            200
        );
        sent += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let dir = temp_dir("dashboard-history");
    let page = gate.admin_url("/");
    let Some(dom) = rendered(&page, &dir, "dom").await else {
        return;
    };
    let row = route_row(&dom, "api");
    let span: u64 = attribute(row, "data-span-seconds").parse().expect("span");
    assert!(span >= 55, "the chart spans {span} s of the minute: {row}");
    let allowed = series(row, "allowed");
    let busy = allowed.iter().filter(|&&n| n > 0).count();
    assert!(
        busy >= 11,
        "{busy} points with traffic in a minute of 5 s buckets: {allowed:?}"
    );
    // Every request of the minute is in the history (the bucket still open
    // is drawn once it is half a second old).
    let drawn: u64 = allowed.iter().sum();
    assert!(
        drawn <= sent && drawn * 10 >= sent * 9,
        "drew {drawn} of {sent}: {allowed:?}"
    );
    screenshot(&page, &dir, "dashboard-history").await;
}

/// While Redis is down and `on_error = "allow"` lets requests through,
/// the chart shows store errors, not silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_is_drawn_as_store_errors_not_silence() {
    let mut redis = TestRedis::start_process().await;
    let toml = Config::new()
        .admin()
        .redis(&redis.url, &unique_prefix("dashboard-outage"))
        .store(r#"timeout = "200ms""#)
        .store(r#"on_error = "allow""#)
        .route(counted())
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let send_for = |seconds: u64| {
        let (client, url) = (client.clone(), gate.url("/"));
        async move {
            let until = std::time::Instant::now() + Duration::from_secs(seconds);
            while std::time::Instant::now() < until {
                assert_eq!(client.get(&url, &[("x-client", "a")]).await.status, 200);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    send_for(12).await;
    redis.kill();
    send_for(12).await;

    let dir = temp_dir("dashboard-outage");
    let page = gate.admin_url("/");
    let Some(dom) = rendered(&page, &dir, "dom").await else {
        return;
    };
    let row = route_row(&dom, "api");
    let (allowed, errors) = (series(row, "allowed"), series(row, "store_error"));
    assert_eq!(allowed.len(), errors.len());
    // Before: decided and allowed, no store errors. After the last point
    // with anything allowed (the bucket the kill fell in), only store
    // errors: at least one whole bucket's worth, and nothing decided.
    assert!(
        allowed.iter().take(2).all(|&n| n > 0) && errors.iter().take(2).all(|&n| n == 0),
        "allowed {allowed:?}, store errors {errors:?}"
    );
    let last_allowed = allowed.iter().rposition(|&n| n > 0).unwrap_or(0);
    let after = last_allowed + 1..allowed.len();
    assert!(
        after.len() >= 2
            && after.clone().all(|i| allowed[i] == 0)
            && after.clone().any(|i| errors[i] >= 100),
        "allowed {allowed:?}, store errors {errors:?}"
    );
    let store = dom
        .split("<tbody id=\"store\">")
        .nth(1)
        .expect("the store table");
    assert!(
        store.contains("<span class=\"badge bad\">down</span>") && store.contains("breaker open"),
        "{store}"
    );
    screenshot(&page, &dir, "dashboard-outage").await;
}

/// A Cluster with one primary frozen: that node's breaker shows open, the
/// others closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_cluster_primary_is_shown_open_and_the_others_closed() {
    let cluster = TestCluster::start().await;
    let toml = Config::new()
        .admin()
        .redis_cluster(&cluster.urls(), &unique_prefix("dashboard-cluster"))
        .store(r#"timeout = "300ms""#)
        .store(r#"on_error = "allow""#)
        .route(counted())
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let clients: Vec<String> = (0..60).map(|i| format!("c{i}")).collect();
    for c in &clients {
        client.get(&gate.url("/"), &[("x-client", c)]).await;
    }
    let primaries = cluster.primaries();
    let victim = primaries[0];
    cluster.freeze(victim);
    // Requests for every slot, until the frozen node's breaker opens.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let metrics = loop {
        let asked: Vec<_> = clients
            .iter()
            .map(|c| {
                let (client, url, c) = (client.clone(), gate.url("/"), c.clone());
                tokio::spawn(async move { client.get(&url, &[("x-client", &c)]).await })
            })
            .collect();
        for a in asked {
            a.await.expect("request");
        }
        let metrics = client.get(&gate.admin_url("/metrics"), &[]).await.text();
        if metrics.contains(&format!(
            "floodgate_redis_node_circuit_open{{node=\"127.0.0.1:{victim}\"}} 1"
        )) {
            break metrics;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the frozen node's breaker never opened: {metrics}"
        );
    };

    let dir = temp_dir("dashboard-cluster");
    let page = gate.admin_url("/");
    let dom = rendered(&page, &dir, "dom").await;
    cluster.thaw(victim);
    let Some(dom) = dom else {
        return;
    };
    for port in primaries {
        let start = dom
            .find(&format!("<tr data-node=\"127.0.0.1:{port}\""))
            .unwrap_or_else(|| panic!("no row for node {port}: {dom}\n{metrics}"));
        let row = &dom[start..start + dom[start..].find("</tr>").unwrap_or(0)];
        let shown = if port == victim {
            "<span class=\"badge bad\">breaker open</span>"
        } else {
            "<span class=\"badge ok\">breaker closed</span>"
        };
        assert!(row.contains(shown), "node {port}: {row}");
    }
    assert!(
        dom.contains("<span class=\"badge warn\">degraded</span>"),
        "{dom}"
    );
}

/// A refused reload is shown with its problem, naming file, line and
/// column, while the rules in force stay; a reload that applies says when.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_reload_is_shown_with_its_problem() {
    let dir = temp_dir("dashboard-reload");
    let file = dir.join("floodgate.toml");
    let good = Config::new()
        .admin()
        .route(Route::new("api").respond("status = 200"))
        .toml();
    std::fs::write(&file, &good).expect("write");
    let gate = Floodgate::start_file(&file).await;
    let client = TestClient::http1();
    let status = client
        .get(&gate.admin_url("/status.json"), &[])
        .await
        .json();
    assert_eq!(status["reload"], serde_json::Value::Null, "{status}");

    std::fs::write(&file, good.replace("status = 200", "status = 2000")).expect("write");
    gate.reload.notify_one();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        let status = client
            .get(&gate.admin_url("/status.json"), &[])
            .await
            .json();
        if status["reload"] != serde_json::Value::Null {
            break status;
        }
        assert!(std::time::Instant::now() < deadline, "no reload: {status}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(status["reload"]["result"], "refused", "{status}");
    let problem = status["reload"]["problem"].as_str().expect("the problem");
    let place = format!("{}:", file.display());
    assert!(problem.starts_with(&place), "{problem}");
    assert_eq!(
        client.get(&gate.url("/"), &[]).await.status,
        200,
        "the old rules stay"
    );

    let page = gate.admin_url("/");
    let Some(dom) = rendered(&page, &dir, "dom").await else {
        return;
    };
    assert!(dom.contains("reload refused"), "{dom}");
    assert!(
        dom.contains("Configuration refused; the previous rules stay") && dom.contains(&place),
        "{dom}"
    );

    std::fs::write(&file, &good).expect("write");
    gate.reload.notify_one();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let status = client
            .get(&gate.admin_url("/status.json"), &[])
            .await
            .json();
        if status["reload"]["result"] == "applied" {
            assert!(status["reload"]["at"].as_u64().is_some(), "{status}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not applied: {status}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client under a penalty is listed with its route, its limit, the time
/// left and its offences; the store names the client by a digest of its
/// key, never the key itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_in_force_are_listed_with_their_route_and_time_left() {
    let toml = Config::new()
        .admin()
        .route(
            Route::new("guard")
                .respond("status = 401")
                .client(r#"from = "header", name = "x-client""#)
                .limits(r#"{ algorithm = "sliding_log", limit = 2, window = "1m", penalty = { duration = "10m" } }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            let answer = client.get(&gate.url("/"), &[("x-client", "oscar")]).await;
            out.push(answer.status.as_u16());
        }
        out
    };
    assert_eq!(statuses, [401, 401, 429], "the third starts the penalty");
    let dir = temp_dir("dashboard-penalties");
    let Some(dom) = rendered(&gate.admin_url("/"), &dir, "dom").await else {
        return;
    };
    let start = dom
        .find(r#"<tr data-penalty="guard">"#)
        .unwrap_or_else(|| panic!("no penalty listed: {dom}"));
    let row = &dom[start..start + dom[start..].find("</tr>").unwrap_or(0)];
    assert!(
        row.starts_with(r#"<tr data-penalty="guard"><td>guard</td><td>guard</td><td><code>k:"#),
        "{row}"
    );
    assert!(
        !row.contains("oscar"),
        "the key itself is never shown: {row}"
    );
    assert!(
        row.ends_with(r#"s</td><td class="n">1</td>"#) && row.contains(r#"<td class="n">"#),
        "{row}"
    );
    let left: u64 = row
        .rsplit(r#"<td class="n">"#)
        .nth(1)
        .and_then(|cell| cell.strip_suffix("s</td>"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    assert!((500..=600).contains(&left), "about ten minutes left: {row}");
}

/// The key registry's panel: how many keys, where they are kept, the
/// lookups by outcome since start; the key itself never shown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_registry_is_shown_with_its_lookups() {
    let dir = temp_dir("dashboard-keys");
    let token = "0123456789abcdef0123456789abcdef";
    std::fs::write(dir.join("token"), format!("{token}\n")).expect("write the token");
    let state = dir.join("keys.json");
    let toml = Config::new()
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("token").display()
        ))
        .tables(&format!(
            "[keys]\nstate_file = {:?}\n",
            state.display().to_string()
        ))
        .route(
            Route::new("api")
                .respond("status = 200")
                .line(r#"api_key = { from = "bearer" }"#)
                .client(r#"from = "key""#)
                .limit("fixed_window", 100, "1h"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let create = http::Request::post(gate.admin_url("/keys"))
        .header("authorization", format!("Bearer {token}"))
        .body(support::text_body(
            r#"{"identity": "pia", "reason": "signed up"}"#,
        ))
        .expect("a request");
    let client = TestClient::http1();
    let made = client.send(create).await;
    assert_eq!(made.status, 201, "{}", made.text());
    let key = made.json()["key"].as_str().expect("a key").to_owned();
    let bearer = format!("Bearer {key}");
    for _ in 0..2 {
        assert_eq!(
            client
                .get(&gate.url("/"), &[("authorization", &bearer)])
                .await
                .status,
            200
        );
    }
    let unknown = client
        .get(&gate.url("/"), &[("authorization", "Bearer sk-nope")])
        .await;
    assert_eq!(unknown.status, 401);
    let Some(dom) = rendered(&gate.admin_url("/"), &dir, "dom").await else {
        return;
    };
    let row = |name: &str| {
        let start = dom
            .find(&format!(r#"<tr data-keys="{name}">"#))
            .unwrap_or_else(|| panic!("no {name} row: {dom}"));
        dom[start..start + dom[start..].find("</tr>").unwrap_or(0)].to_owned()
    };
    assert!(row("keys").ends_with("<td>1</td>"), "{}", row("keys"));
    assert!(row("kept in").contains(&state.display().to_string()));
    assert!(
        row("lookups").contains("valid 2 · unknown 1"),
        "{}",
        row("lookups")
    );
    assert!(!dom.contains(&key), "the key itself is never shown");
}

/// The keys file's last reconcile is shown with what it listed and
/// changed; the lookups with their outcomes.
#[tokio::test]
async fn the_key_registry_and_the_keys_files_last_reconcile_are_shown() {
    use sha2::Digest as _;
    let dir = temp_dir("dashboard-keys");
    let keys = dir.join("keys.toml");
    let sha: String = sha2::Sha256::digest(b"sk-shown")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    std::fs::write(
        &keys,
        format!("[[key]]\nsha256 = \"{sha}\"\nidentity = \"cust_42\"\n"),
    )
    .expect("write the keys file");
    let toml = Config::new()
        .admin()
        .route(
            Route::new("api")
                .respond("status = 200")
                .line(r#"api_key = { from = "bearer" }"#),
        )
        .tables(&format!(
            "[keys]\nstate_file = {:?}\nfile = {:?}\n",
            dir.join("keys.json").display().to_string(),
            keys.display().to_string()
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/");
    let known = client
        .get(&url, &[("authorization", "Bearer sk-shown")])
        .await;
    assert_eq!(known.status, 200, "{}", known.text());
    let unknown = client
        .get(&url, &[("authorization", "Bearer sk-made-up")])
        .await;
    assert_eq!(unknown.status, 401);

    let Some(dom) = rendered(&gate.admin_url("/"), &dir, "keys").await else {
        return;
    };
    assert!(dom.contains("Key registry"), "{dom}");
    let lookups = dom.find("<th>lookups</th>").map_or("", |i| &dom[i..]);
    let lookups = &lookups[..lookups.find("</tr>").unwrap_or(lookups.len())];
    assert!(
        lookups.contains("valid 1") && lookups.contains("unknown"),
        "{lookups}"
    );
    let start = dom.find("data-keys-file").expect("the keys file's row");
    let row = &dom[start..];
    let row = &row[..row.find("</tr>").unwrap_or(row.len())];
    assert!(row.contains(&keys.display().to_string()), "{row}");
    assert!(
        row.contains("1 listed; 1 added, 0 updated, 0 removed"),
        "{row}"
    );
}
