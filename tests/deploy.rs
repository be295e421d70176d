//! The deployment kit is checked, not just shipped: the alert rules load in
//! `promtool` and the Grafana dashboard is valid JSON, and every metric
//! either names is one floodgate exports; the image has a CA bundle and a
//! small build context; Compose waits long enough for a stop to drain.

mod support;

use std::collections::BTreeSet;
use std::process::Command;

use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient, Upstream};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn read(path: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{path}")).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Every name floodgate's exposition has a sample under, histograms'
/// `_bucket`, `_sum` and `_count` included: an instance counting in memory
/// and one counting in Redis (whose store has series of its own).
async fn exported_names() -> BTreeSet<String> {
    let redis = TestRedis::start().await;
    let mut names = names_of(Config::new()).await;
    names.extend(names_of(Config::new().redis(&redis.url, &unique_prefix("deploy"))).await);
    names
}

async fn names_of(config: Config) -> BTreeSet<String> {
    let upstream = Upstream::start().await;
    let toml = config
        .admin()
        .upstream("api", &[&format!(r#"endpoints = ["{}"]"#, upstream.url())])
        .route(
            Route::new("api")
                .matching(r#"path_prefix = "/api""#)
                .upstream("api")
                .line("concurrency = { max_in_flight = 10 }"),
        )
        .route(
            Route::new("metered")
                .matching(r#"path_prefix = "/metered""#)
                .upstream("api")
                .line(r#"usage = { reserve = 5, report = "header", units = { "x-units" = 1 } }"#)
                .limit("sliding_window", 100, "1m"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    // A request, and one that no route takes: series that appear only
    // once something happened (refusals) appear too.
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/api/x"), &[]).await.status, 200);
    assert_eq!(client.get(&gate.url("/metered"), &[]).await.status, 200);
    assert_eq!(client.get(&gate.url("/nowhere"), &[]).await.status, 404);
    let text = client
        .get(
            &gate.admin_url("/metrics"),
            &[("accept", "text/plain;version=0.0.4")],
        )
        .await
        .text();
    let mut names = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
                continue;
            };
            names.insert(name.to_owned());
            if kind == "histogram" {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
        }
    }
    names
}

/// The metric names `text` mentions: words that begin `floodgate_` or
/// `process_`.
fn mentioned(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("floodgate_") || w.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn the_alert_rules_load_and_name_only_exported_metrics() {
    let path = format!("{ROOT}/deploy/prometheus/alerts.yml");
    match Command::new("promtool")
        .args(["check", "rules", &path])
        .output()
    {
        Ok(out) => assert!(
            out.status.success(),
            "promtool check rules: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        Err(e) => assert!(
            std::env::var_os("FLOODGATE_TEST_NEEDS_PROMTOOL").is_none(),
            "promtool is required here and cannot run: {e}"
        ),
    }
    let rules = read("deploy/prometheus/alerts.yml");
    let exported = exported_names().await;
    let names = mentioned(&rules);
    assert!(names.len() >= 8, "{names:?}");
    let unknown: Vec<_> = names.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "alerts name unexported metrics: {unknown:?}"
    );
}

#[tokio::test]
async fn the_grafana_dashboard_is_json_whose_queries_name_exported_metrics() {
    let text = read("deploy/grafana/floodgate.json");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(panels.len() >= 8);
    let mut queries = String::new();
    for panel in panels {
        let targets = panel["targets"].as_array().expect("targets");
        assert!(!targets.is_empty(), "{} has no query", panel["title"]);
        for target in targets {
            let expr = target["expr"].as_str().expect("an expression");
            queries.push_str(expr);
            queries.push('\n');
        }
    }
    let exported = exported_names().await;
    let names = mentioned(&queries);
    let unknown: Vec<_> = names.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "the dashboard names unexported metrics: {unknown:?}"
    );
    for must in [
        "floodgate_requests_total",
        "floodgate_store_circuit_open",
        "floodgate_upstream_endpoint_healthy",
        "floodgate_redis_node_circuit_open",
        "floodgate_config_last_reload_successful",
        "floodgate_usage_units_total",
        "floodgate_usage_unreported_total",
    ] {
        assert!(names.contains(must), "the dashboard lacks {must}");
    }
}

#[test]
fn the_image_has_a_ca_bundle_and_a_small_build_context() {
    let ignore = read(".dockerignore");
    assert!(
        ignore
            .lines()
            .any(|l| l.trim() == "target/" || l.trim() == "target")
    );
    let dockerfile = read("Dockerfile");
    let runtime = dockerfile
        .rsplit_once("\nFROM ")
        .map(|(_, stage)| stage)
        .expect("a runtime stage");
    assert!(
        runtime.contains("ca-certificates"),
        "the runtime image installs no CA bundle"
    );
}

#[test]
fn compose_waits_for_a_stop_to_drain_and_finish() {
    let compose = read("docker-compose.yml");
    let grace = compose
        .lines()
        .find_map(|l| l.trim().strip_prefix("stop_grace_period:"))
        .and_then(|v| v.trim().strip_suffix('s'))
        .and_then(|v| v.parse::<u64>().ok())
        .expect("floodgate's stop_grace_period in seconds");
    let config =
        floodgate::config::load(std::path::Path::new(&format!("{ROOT}/config/compose.toml")))
            .unwrap_or_else(|e| panic!("{e}"));
    let needed = config.server.drain_delay + config.server.shutdown_grace;
    assert!(
        std::time::Duration::from_secs(grace) > needed,
        "stop_grace_period {grace}s does not cover drain_delay + shutdown_grace = {needed:?}"
    );
}
