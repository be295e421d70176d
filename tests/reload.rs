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

// === the plan table and the keys file, read anew on their own ===

/// A route whose plans come from `plans.txt` and whose keys are verified
/// against a registry the keys file `keys.toml` fills, beside `dir`'s
/// configuration, on the memory store.
fn tables_and_keys(dir: &std::path::Path, port: u16, admin: u16) -> String {
    let keys = format!(
        "[keys]\nstate_file = \"{}\"\nfile = \"keys.toml\"\n",
        dir.join("keys.json").display()
    );
    plans_from_a_table(port, admin, &keys, "api_key = { from = \"bearer\" }")
}

/// A keys file listing `key` (by its SHA-256) for cust_42 on plan pro.
fn listing(key: &str) -> String {
    use sha2::Digest as _;
    let sha: String = sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("[[key]]\nsha256 = \"{sha}\"\nidentity = \"cust_42\"\nplan = \"pro\"\n")
}

/// The process's reload standing: `floodgate_config_last_reload_successful`
/// and `/status.json`'s `reload`.
async fn standing(admin: u16) -> (u64, serde_json::Value) {
    let metrics = support::load::admin_get(admin, "/metrics")
        .await
        .unwrap_or_default();
    let status = support::load::admin_get(admin, "/status.json")
        .await
        .unwrap_or_default();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
    (
        metric(&metrics, "floodgate_config_last_reload_successful "),
        status["reload"].clone(),
    )
}

/// Waits (10 s at most) until the reload standing is `successful`, with a
/// problem holding `problem` when refused: the problem.
async fn until_standing(admin: u16, successful: u64, problem: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (now, reload) = standing(admin).await;
        let said = reload["problem"].as_str().unwrap_or("").to_owned();
        let result = reload["result"].as_str().unwrap_or("");
        let refused = successful == 0 && result == "refused" && said.contains(problem);
        if now == successful && (refused || (successful == 1 && result == "applied")) {
            return said;
        }
        assert!(
            Instant::now() < deadline,
            "reload standing stays {now} {reload}, not {successful} {problem:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (10 s at most) until `key` is answered `status`.
async fn until_key(url: &str, key: &str, status: u16) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let bearer = format!("Bearer {key}");
    loop {
        let answer = TestClient::http1()
            .get(url, &[("authorization", &bearer), ("x-customer", "c1")])
            .await;
        if answer.status == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{key} still answered {}",
            answer.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits (10 s at most) until the log has a WARN line holding every one
/// of `words`.
async fn until_warned(log: &std::path::Path, words: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text
            .lines()
            .any(|l| l.contains("WARN") && words.iter().all(|w| l.contains(w)))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no warning with {words:?} in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_refused_plan_table_or_keys_file_is_a_failed_reload_until_fixed() {
    let dir = temp_dir("reload-side-files");
    let (port, admin) = (free_port(), free_port());
    let (table, keys) = (dir.join("plans.txt"), dir.join("keys.toml"));
    std::fs::write(&table, "c1 pro\n").expect("write the table");
    std::fs::write(&keys, listing("sk-one")).expect("write the keys file");
    let config = dir.join("floodgate.toml");
    std::fs::write(&config, tables_and_keys(&dir, port, admin)).expect("write config");
    let log = dir.join("floodgate.log");
    let process = FloodgateProcess::spawn_logging(&config, port, &[], &[], &log).await;
    let url = process.url("/");
    until_key(&url, "sk-one", 200).await;
    assert_eq!(standing(admin).await.0, 1);

    // A table with a bad line: refused, a failed reload; fixed: applied.
    std::fs::write(&table, "c1 platinum\n").expect("write a bad table");
    let problem = until_standing(admin, 0, "plans.txt:1:1").await;
    assert!(problem.contains("platinum"), "{problem}");
    std::fs::write(&table, "c1 free\n").expect("fix the table");
    until_standing(admin, 1, "").await;

    // A keys file with a bad key: refused whole, the registry as it was.
    std::fs::write(
        &keys,
        listing("sk-two").replace("sha256 = \"", "sha256 = \"x"),
    )
    .expect("write");
    let problem = until_standing(admin, 0, "keys.toml:2:10").await;
    assert!(
        problem.contains("sha256 must be 64 hex digits"),
        "{problem}"
    );
    until_key(&url, "sk-one", 200).await;
    // Fixed, listing another key: applied, the first key removed.
    std::fs::write(&keys, listing("sk-two")).expect("fix the keys file");
    until_standing(admin, 1, "").await;
    until_key(&url, "sk-two", 200).await;
    until_key(&url, "sk-one", 401).await;
    let status = support::load::admin_get(admin, "/status.json")
        .await
        .unwrap_or_default();
    let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
    assert_eq!(
        status["keys"]["file"]["changed"],
        serde_json::json!([1, 0, 1])
    );

    // Empty files: warnings naming them. The empty table applies (every
    // client on the default plan); the empty keys file does not (it does
    // not say key = []), so the key stays.
    std::fs::write(&table, "").expect("empty the table");
    until_warned(&log, &["plans.txt", "lists no client"]).await;
    std::fs::write(&keys, "").expect("empty the keys file");
    until_warned(&log, &["keys.toml", "lists no key"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    until_key(&url, "sk-two", 200).await;
    assert_eq!(
        standing(admin).await.0,
        1,
        "an empty file is no failed reload"
    );

    // Deleted files: warnings naming them; what they put in force stays.
    std::fs::remove_file(&table).expect("delete the table");
    std::fs::remove_file(&keys).expect("delete the keys file");
    until_warned(&log, &["plans.txt", "gone"]).await;
    until_warned(&log, &["keys.toml", "gone"]).await;
    until_key(&url, "sk-two", 200).await;

    // A keys file that says it lists no key removes every key it owned.
    std::fs::write(&keys, "key = []\n").expect("write no keys");
    until_key(&url, "sk-two", 401).await;
    assert_eq!(standing(admin).await.0, 1);
    drop(process);
    let _ = std::fs::remove_dir_all(dir);
}

/// A route whose plans come from `plans.txt` beside the configuration
/// (free: 900 000 an hour, pro: 800 000, so each is told by its `q`),
/// with `server_extra` after `[server]` and `route_extra` in the route.
fn plans_from_a_table(port: u16, admin: u16, server_extra: &str, route_extra: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:{port}"
admin_listen = "127.0.0.1:{admin}"

{server_extra}
[[routes]]
name = "api"
{route_extra}
respond = {{ status = 200, body = "ok" }}
client = {{ from = "header", name = "X-Customer" }}
limits = [{{ algorithm = "fixed_window", limit = 1000000, window = "1h" }}]
plans = ["free", "pro"]

[plan_selection]
by = {{ from = "header", name = "X-Customer" }}
table = "plans.txt"
default = "free"

[plans.free]
limits = [{{ algorithm = "fixed_window", limit = 900000, window = "1h" }}]

[plans.pro]
limits = [{{ algorithm = "fixed_window", limit = 800000, window = "1h" }}]
"#
    )
}

/// Waits (10 s at most) until customer c1's `RateLimit-Policy` holds
/// `want`.
async fn until_plan_quota(url: &str, want: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let answer = TestClient::http1().get(url, &[("x-customer", "c1")]).await;
        let policy = answer.header("ratelimit-policy").unwrap_or_default();
        if policy.contains(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "c1's policy stays {policy:?}, never {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_plan_table_in_force_follows_its_file_after_a_refused_reload() {
    let dir = temp_dir("reload-table-after-refusal");
    let (port, admin) = (free_port(), free_port());
    let table = dir.join("plans.txt");
    std::fs::write(&table, "c1 pro\n").expect("write the table");
    let config = dir.join("floodgate.toml");
    std::fs::write(&config, plans_from_a_table(port, admin, "", "")).expect("write config");
    let process = FloodgateProcess::spawn(&config, port).await;
    let url = process.url("/");
    until_plan_quota(&url, "q=800000").await;

    // A configuration that loads but is refused when applied (the key
    // registry starts only with floodgate): the rules in force stay, and
    // so must the table they read their plans from.
    let state = dir.join("keys.json");
    let with_keys = format!("[keys]\nstate_file = \"{}\"\n", state.display());
    std::fs::write(&config, plans_from_a_table(port, admin, &with_keys, "")).expect("write config");
    let problem = until_standing(admin, 0, "[keys] was added").await;
    assert!(problem.contains("restart"), "{problem}");

    // The table's file changes: the table in force follows it.
    std::fs::write(&table, "c1 free\n").expect("rewrite the table");
    until_plan_quota(&url, "q=900000").await;
    std::fs::write(&table, "c1 pro\n").expect("rewrite the table again");
    until_plan_quota(&url, "q=800000").await;
    drop(process);
    let _ = std::fs::remove_dir_all(dir);
}
