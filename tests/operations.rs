//! Operating floodgate: exact metrics after a scripted mix of requests,
//! parsed as a whole by a Prometheus text parser; health and readiness; the
//! container's health probe and build command.

mod support;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient, Upstream};

/// Every sample of the exposition, by name and sorted labels.
fn scrape(text: &str) -> HashMap<String, f64> {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("a valid exposition");
    let mut out = HashMap::new();
    for sample in scrape.samples {
        let mut labels: Vec<String> = sample
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        labels.sort();
        let value = match sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count),
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.insert(format!("{}{{{}}}", sample.metric, labels.join(",")), value);
    }
    out
}

fn value(samples: &HashMap<String, f64>, key: &str) -> f64 {
    *samples.get(key).unwrap_or_else(|| {
        let mut keys: Vec<_> = samples.keys().collect();
        keys.sort();
        panic!("no sample {key}; have:\n{keys:#?}")
    })
}

/// Routes `limited`, `shadow` (limited, not enforced), `exempt` (for
/// loopback) answered by floodgate, and `proxied` to `upstream_url`.
fn four_routes(upstream_url: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"

[[routes]]
name = "limited"
match = {{ path_prefix = "/limited" }}
respond = {{ status = 200 }}
limits = [{{ algorithm = "fixed_window", limit = 2, window = "1h" }}]

[[routes]]
name = "shadow"
match = {{ path_prefix = "/shadow" }}
respond = {{ status = 200 }}
shadow = true
limits = [{{ algorithm = "gcra", limit = 1, window = "1h" }}]

[[routes]]
name = "exempt"
match = {{ path_prefix = "/exempt" }}
respond = {{ status = 200 }}
exempt = ["127.0.0.0/8"]
limits = [{{ algorithm = "sliding_log", limit = 1, window = "1h" }}]

[[routes]]
name = "proxied"
match = {{ path_prefix = "/status" }}
upstream = "{upstream_url}"
"#
    )
}

/// The scripted mix, one request at a time; the statuses in order.
async fn send_the_mix(client: &TestClient, gate: &Floodgate) -> Vec<u16> {
    let mut statuses = Vec::new();
    for (path, times) in [
        ("/limited", 5),
        ("/shadow", 3),
        ("/exempt", 3),
        ("/status?code=200", 2),
        ("/status?code=404", 1),
        ("/status?code=503", 1),
        ("/nowhere", 4),
    ] {
        for _ in 0..times {
            statuses.push(client.get(&gate.url(path), &[]).await.status.as_u16());
        }
    }
    statuses
}

/// Each request counted once, by route and outcome; the memory store sends
/// nothing to Redis.
fn requests_are_counted_by_route_and_outcome(m: &HashMap<String, f64>) {
    let requests = |route: &str, outcome: &str| {
        value(
            m,
            &format!("floodgate_requests_total{{outcome={outcome},route={route}}}"),
        )
    };
    assert_eq!(requests("limited", "allowed"), 2.0);
    assert_eq!(requests("limited", "denied"), 3.0);
    assert_eq!(requests("shadow", "allowed"), 1.0);
    assert_eq!(requests("shadow", "shadow_denied"), 2.0);
    assert_eq!(requests("exempt", "exempt"), 3.0);
    assert_eq!(requests("exempt", "allowed"), 0.0);
    assert_eq!(requests("proxied", "allowed"), 4.0);
    assert_eq!(requests("limited", "store_error"), 0.0);
    assert_eq!(value(m, "floodgate_requests_no_route_total{}"), 4.0);
    assert_eq!(
        value(m, "floodgate_refusals_total{fault=client,status=404}"),
        4.0
    );
    // The memory store sends nothing to Redis.
    assert_eq!(value(m, "floodgate_redis_calls_total{}"), 0.0);
}

/// The upstream's answers by class, decisions only where a limit is
/// counted, no store errors, no reloads, and one config digest.
fn answers_decisions_and_the_store_are_counted(m: &HashMap<String, f64>) {
    let class = |c: &str| {
        value(
            m,
            &format!("floodgate_upstream_responses_total{{class={c},route=proxied}}"),
        )
    };
    assert_eq!(
        (class("2xx"), class("4xx"), class("5xx"), class("3xx")),
        (2.0, 1.0, 1.0, 0.0)
    );
    assert_eq!(
        value(m, "floodgate_upstream_seconds_count{route=proxied}"),
        4.0
    );
    // Decisions: 5 limited + 3 shadow; exempt and unlimited routes decide nothing.
    assert_eq!(
        value(m, "floodgate_decision_seconds_count{store=memory}"),
        8.0
    );
    assert_eq!(value(m, "floodgate_store_errors_total{kind=timeout}"), 0.0);
    assert_eq!(value(m, "floodgate_store_circuit_open{}"), 0.0);
    assert_eq!(
        value(m, "floodgate_config_reloads_total{result=success}"),
        0.0
    );
    assert_eq!(
        value(m, "floodgate_config_reloads_total{result=failure}"),
        0.0
    );
    assert!(value(m, "floodgate_open_connections{}") >= 1.0);
    let digests: Vec<_> = m
        .keys()
        .filter(|k| k.starts_with("floodgate_config_info"))
        .collect();
    assert_eq!(digests.len(), 1, "{digests:?}");
}

/// The upstream's endpoint has series of its own, labelled with its
/// address; no client address is in any label.
fn the_upstream_endpoint_is_labelled_and_no_client_is(
    m: &HashMap<String, f64>,
    text: &str,
    upstream: &Upstream,
) {
    let upstream_addr = upstream.addr.to_string();
    let url = upstream.url();
    let endpoint = |name: &str, extra: &str| {
        value(
            m,
            &format!("{name}{{address={upstream_addr},endpoint={url},{extra}upstream={url}}}"),
        )
    };
    assert_eq!(
        endpoint("floodgate_upstream_endpoint_requests_total", ""),
        4.0
    );
    assert_eq!(endpoint("floodgate_upstream_endpoint_in_flight", ""), 0.0);
    assert_eq!(endpoint("floodgate_upstream_endpoint_healthy", ""), 1.0);
    assert_eq!(
        endpoint("floodgate_upstream_endpoint_ejections_total", ""),
        0.0
    );
    for kind in ["connect", "timeout", "protocol"] {
        assert_eq!(
            endpoint(
                "floodgate_upstream_endpoint_errors_total",
                &format!("kind={kind},")
            ),
            0.0
        );
    }
    for line in text.lines().filter(|l| l.contains("127.0.0.1")) {
        assert!(
            line.starts_with("floodgate_upstream_endpoint_")
                && line.matches("127.0.0.1").count() == line.matches(&upstream_addr).count(),
            "a client address leaked into a label: {line}"
        );
    }
}

#[tokio::test]
async fn metrics_count_a_scripted_mix_exactly() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&four_routes(&upstream.url())).await;
    let client = TestClient::http1();
    let statuses = send_the_mix(&client, &gate).await;
    assert_eq!(
        statuses,
        [
            200, 200, 429, 429, 429, 200, 200, 200, 200, 200, 200, 200, 200, 404, 503, 404, 404,
            404, 404
        ]
    );

    let text = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    let m = scrape(&text);
    requests_are_counted_by_route_and_outcome(&m);
    answers_decisions_and_the_store_are_counted(&m);
    the_upstream_endpoint_is_labelled_and_no_client_is(&m, &text, &upstream);
}

/// An instance with an admin listener and one route that answers 200 by
/// itself under `limit`, counting in the Redis at `url` and letting
/// requests through while Redis cannot answer.
fn redis_instance(url: &str, prefix: &str, limit: &str, on_error: &str) -> String {
    Config::new()
        .admin()
        .redis(url, prefix)
        .store(r#"timeout = "100ms""#)
        .store(&format!("on_error = {on_error:?}"))
        .route(Route::new("api").respond("status = 200").limits(limit))
        .toml()
}

/// The status `path` on `gate`'s admin listener answers with.
async fn admin_status(client: &TestClient, gate: &Floodgate, path: &str) -> u16 {
    client.get(&gate.admin_url(path), &[]).await.status.as_u16()
}

/// With `on_error = "deny"` an instance whose store is down refuses every
/// limited request: it is not ready.
#[tokio::test]
async fn readyz_follows_redis_where_on_error_denies_and_healthz_stays_up() {
    let mut redis = TestRedis::start_process().await;
    let gate = Floodgate::start(&redis_instance(
        &redis.url,
        &unique_prefix("readyz"),
        r#"{ algorithm = "token_bucket", limit = 1000, window = "1s" }"#,
        "deny",
    ))
    .await;
    let client = TestClient::http1();
    let status = |path| admin_status(&client, &gate, path);
    assert_eq!(status("/readyz").await, 200);
    redis.kill();
    // Traffic finds out: the breaker opens after a few failed decisions.
    let deadline = Instant::now() + Duration::from_secs(10);
    while status("/readyz").await != 503 {
        let _ = client.get(&gate.url("/"), &[]).await;
        assert!(
            Instant::now() < deadline,
            "/readyz never reported Redis down"
        );
    }
    assert_eq!(status("/healthz").await, 200);
    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while status("/readyz").await != 200 {
        let _ = client.get(&gate.url("/"), &[]).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(Instant::now() < deadline, "/readyz never recovered");
    }
    let m = scrape(&client.get(&gate.admin_url("/metrics"), &[]).await.text());
    assert!(value(&m, "floodgate_store_errors_total{kind=backend}") >= 1.0);
    assert_eq!(value(&m, "floodgate_store_circuit_open{}"), 0.0);
}

/// With `on_error = "allow"` (or `"local"`) the instance serves through a
/// store outage, so it stays ready: every replica shares the store, and
/// taking them all out of service at once would be the outage the policy
/// chose to avoid. The outage shows in the metrics instead.
#[tokio::test]
async fn readyz_stays_200_through_a_redis_outage_where_on_error_allows() {
    let mut redis = TestRedis::start_process().await;
    let gate = Floodgate::start(&redis_instance(
        &redis.url,
        &unique_prefix("readyz-allow"),
        r#"{ algorithm = "token_bucket", limit = 1000, window = "1s" }"#,
        "allow",
    ))
    .await;
    let client = TestClient::http1();
    let circuit_open = || async {
        let m = scrape(&client.get(&gate.admin_url("/metrics"), &[]).await.text());
        value(&m, "floodgate_store_circuit_open{}")
    };
    redis.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while circuit_open().await != 1.0 {
        assert_eq!(client.get(&gate.url("/"), &[]).await.status, 200);
        assert!(Instant::now() < deadline, "the breaker never opened");
    }
    let ready = client.get(&gate.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, 200);
    assert!(
        ready.text().contains("store is not answering"),
        "{}",
        ready.text()
    );
    assert_eq!(client.get(&gate.url("/"), &[]).await.status, 200);
    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while circuit_open().await != 0.0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(Instant::now() < deadline, "the breaker never closed");
    }
    assert_eq!(
        client.get(&gate.admin_url("/readyz"), &[]).await.text(),
        "ready\n"
    );
}

/// An instance that started while Redis was down under `on_error = "deny"`
/// is out of service (`/readyz` answers 503), so a load balancer sends it
/// no requests: it must find Redis again by itself, and then limit from the
/// first request on.
#[tokio::test]
async fn readyz_recovers_without_requests_once_redis_is_up() {
    let mut redis = TestRedis::start_process().await;
    redis.kill();
    let gate = Floodgate::start(&redis_instance(
        &redis.url,
        &unique_prefix("recover"),
        r#"{ algorithm = "sliding_log", limit = 2, window = "60s" }"#,
        "deny",
    ))
    .await;
    let client = TestClient::http1();
    let status = |path| admin_status(&client, &gate, path);
    assert_eq!(status("/readyz").await, 503);
    redis.restart().await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while status("/readyz").await != 200 {
        assert!(
            Instant::now() < deadline,
            "/readyz did not recover without requests"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The first requests, all at once, are Redis's to decide: none is
    // refused by `on_error`.
    let requests: Vec<_> = (0..20)
        .map(|_| {
            let client = client.clone();
            let url = gate.url("/");
            tokio::spawn(async move { client.get(&url, &[]).await.status.as_u16() })
        })
        .collect();
    let mut codes = Vec::new();
    for request in requests {
        codes.push(request.await.expect("request"));
    }
    codes.sort_unstable();
    assert_eq!(codes, [[200; 2].as_slice(), &[429; 18]].concat());
    let m = scrape(&client.get(&gate.admin_url("/metrics"), &[]).await.text());
    assert_eq!(value(&m, "floodgate_store_circuit_open{}"), 0.0);
}

#[tokio::test]
async fn the_probe_flag_checks_health_for_container_runtimes() {
    let gate = Floodgate::start(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[[routes]]\nname = \"a\"\nrespond = { status = 200 }\n",
    )
    .await;
    let probe = |url: String| async move {
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_floodgate"))
                .args(["--probe", &url])
                .output()
                .expect("run probe")
                .status
                .code()
        })
        .await
        .expect("probe task")
    };
    assert_eq!(probe(gate.admin_url("/healthz")).await, Some(0));
    assert_eq!(probe(gate.admin_url("/nothing")).await, Some(1));
    let closed = support::free_port();
    assert_eq!(
        probe(format!("http://127.0.0.1:{closed}/healthz")).await,
        Some(1)
    );
}

#[test]
fn the_dockerfile_builds_with_the_readmes_command_and_checks_its_own_config() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dockerfile = std::fs::read_to_string(format!("{root}/Dockerfile")).expect("Dockerfile");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).expect("README");
    // Every cargo command of the image: the dependencies' layer, then
    // floodgate's, both with the README's build command.
    let builds: Vec<&str> = dockerfile
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.split("cargo ").skip(1))
        .map(|rest| {
            rest.split("&&")
                .next()
                .unwrap_or(rest)
                .trim_end_matches('\\')
                .trim()
        })
        .collect();
    assert_eq!(
        builds,
        ["build --release --locked", "build --release --locked"],
        "the image's build steps changed"
    );
    assert!(
        readme.contains("cargo build --release --locked"),
        "README must show the image's build command"
    );
    for line in dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("COPY config/"))
    {
        let file = line.split_whitespace().next().expect("a file");
        let out = Command::new(env!("CARGO_BIN_EXE_floodgate"))
            .args(["--check", "--config", &format!("{root}/config/{file}")])
            .output()
            .expect("run --check");
        assert!(
            out.status.success(),
            "the image's {file} fails --check: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        dockerfile.contains("HEALTHCHECK") && dockerfile.contains("--probe"),
        "the image checks its health with --probe"
    );
    // The build command itself, as the image runs it.
    let build = Command::new(env!("CARGO"))
        .args(["build", "--release", "--locked", "--quiet"])
        .current_dir(root)
        .status()
        .expect("run cargo");
    assert!(build.success(), "cargo build --release --locked failed");
}

/// The family a sample line belongs to: its name without labels, and
/// without a histogram's `_bucket`, `_sum` or `_count`.
fn family_of(sample: &str) -> &str {
    let name = sample.split(['{', ' ']).next().unwrap_or(sample);
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// Scrapers that ask for the Prometheus text format get it, and it passes
/// `promtool check metrics` (run when installed; `.ci/run` installs it and
/// sets `FLOODGATE_TEST_NEEDS_PROMTOOL`); others get OpenMetrics. Every
/// family has help text; the process and build series are there; the
/// upstream histogram reaches past the default upstream timeout.
#[tokio::test]
async fn metrics_come_in_both_formats_with_help_process_and_build_series() {
    let upstream = Upstream::start().await;
    let toml = Config::new()
        .admin()
        .route(Route::new("proxied").upstream(&upstream.url()))
        .toml();
    // Floodgate runs in this test's process, which started before now.
    let before_start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/x"), &[]).await.status, 200);

    let old = client
        .get(
            &gate.admin_url("/metrics"),
            &[("accept", "text/plain;version=0.0.4;q=1,*/*;q=0.1")],
        )
        .await;
    assert_eq!(
        old.header("content-type"),
        Some("text/plain; version=0.0.4; charset=utf-8")
    );
    let text = old.text();
    assert!(
        !text.contains("# EOF") && !text.contains("# UNIT"),
        "{text}"
    );
    let helped: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# HELP "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    for sample in text.lines().filter(|l| !l.starts_with('#')) {
        assert!(
            helped.contains(&family_of(sample)),
            "no help text for {sample}"
        );
    }
    let m = scrape(&text);
    assert_eq!(
        value(
            &m,
            &format!(
                "floodgate_build_info{{version={}}}",
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    assert!(value(&m, "process_open_fds{}") > 0.0);
    assert!(value(&m, "process_resident_memory_bytes{}") > 1_000_000.0);
    assert!(value(&m, "process_max_fds{}") >= value(&m, "process_open_fds{}"));
    // When the process started, not when its registry was made.
    let started = value(&m, "process_start_time_seconds{}");
    assert!(
        started > 1.7e9 && started <= before_start,
        "process_start_time_seconds {started}, floodgate started at {before_start}"
    );
    assert!(
        text.contains(r#"floodgate_upstream_seconds_bucket{le="300.0",route="proxied"} 1"#),
        "{text}"
    );

    match Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
    {
        Ok(mut promtool) => {
            use std::io::Write;
            promtool
                .stdin
                .take()
                .expect("stdin")
                .write_all(text.as_bytes())
                .expect("write to promtool");
            let out = promtool.wait_with_output().expect("promtool");
            assert!(
                out.status.success(),
                "promtool check metrics: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Err(e) => assert!(
            std::env::var_os("FLOODGATE_TEST_NEEDS_PROMTOOL").is_none(),
            "promtool is required here and cannot run: {e}"
        ),
    }

    let new = client.get(&gate.admin_url("/metrics"), &[]).await;
    assert_eq!(
        new.header("content-type"),
        Some("application/openmetrics-text; version=1.0.0; charset=utf-8")
    );
    assert!(new.text().ends_with("# EOF\n"));
}

/// `--probe` without a URL reads the configuration file (`--config` or
/// `FLOODGATE_CONFIG`): `/healthz` on its admin listener (an unspecified
/// address probed on loopback), or a connection to `listen` when it has no
/// admin listener; a file it cannot read says why.
#[tokio::test]
async fn the_probe_without_a_url_follows_the_configuration() {
    let gate = Floodgate::start(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n[[routes]]\nname = \"a\"\nrespond = { status = 200 }\n",
    )
    .await;
    let admin = gate.admin.expect("admin listener").port();
    let proxy = gate.addr.port();
    let closed = support::free_port();
    let dir = support::temp_dir("probe");
    let probe = |server: String, by_env: bool| {
        let file = dir.join(format!("probe-{}.toml", support::free_port()));
        async move {
            // The rest of the file is not read: not even a valid route.
            std::fs::write(
                &file,
                format!("[server]\n{server}\n[[routes]]\nbroken = 1\n"),
            )
            .expect("write");
            tokio::task::spawn_blocking(move || {
                let mut probe = Command::new(env!("CARGO_BIN_EXE_floodgate"));
                probe.arg("--probe");
                if by_env {
                    probe.env("FLOODGATE_CONFIG", &file);
                } else {
                    probe.arg("--config").arg(&file);
                }
                let out = probe.output().expect("run probe");
                (
                    out.status.code(),
                    String::from_utf8_lossy(&out.stderr).into_owned(),
                )
            })
            .await
            .expect("probe task")
        }
    };
    let healthy = (Some(0), String::new());
    assert_eq!(
        probe(
            format!("listen = \"0.0.0.0:{closed}\"\nadmin_listen = \"0.0.0.0:{admin}\""),
            true
        )
        .await,
        healthy
    );
    assert_eq!(
        probe(format!("listen = \"0.0.0.0:{proxy}\""), false).await,
        healthy
    );
    let (code, said) = probe(
        format!("listen = \"0.0.0.0:{proxy}\"\nadmin_listen = \"127.0.0.1:{closed}\""),
        false,
    )
    .await;
    assert_eq!(code, Some(1));
    assert!(
        said.contains(&format!("127.0.0.1:{closed}/healthz")),
        "{said}"
    );
    let (code, said) = probe(format!("listen = \"127.0.0.1:{closed}\""), false).await;
    assert_eq!(code, Some(1));
    assert!(said.contains("no admin_listen"), "{said}");
    let (code, said) = probe("listen = 8080".to_owned(), false).await;
    assert_eq!(code, Some(1));
    assert!(
        said.contains("cannot tell where to probe") && said.contains(":2:10"),
        "{said}"
    );
}

/// Instances sharing a store announce the rules they count by: one that
/// runs other limits for the same route is noticed (a warning, and
/// `floodgate_store_rule_sets` above 1); instances whose files differ only
/// elsewhere are not.
#[tokio::test]
async fn instances_with_different_limits_on_one_store_are_noticed() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rule-sets");
    let with = |limit: u64, extra: &str| {
        let mut config = Config::new().admin().redis(&redis.url, &prefix);
        if !extra.is_empty() {
            config = config.server(extra);
        }
        config
            .route(
                Route::new("api")
                    .respond("status = 200")
                    .limit("fixed_window", limit, "1h"),
            )
            .toml()
    };
    let client = TestClient::http1();
    let sets = |gate: &Floodgate| {
        let url = gate.admin_url("/metrics");
        let client = client.clone();
        async move {
            let text = client.get(&url, &[]).await.text();
            value(&scrape(&text), "floodgate_store_rule_sets{}")
        }
    };
    let first = Floodgate::start(&with(100, "")).await;
    // The same limits, another listener setting: one rule set.
    let same = Floodgate::start(&with(100, r#"drain_delay = "1s""#)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = sets(&same).await;
        if now == 1.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the same rules counted as {now} sets"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let other = Floodgate::start(&with(7, "")).await;
    while sets(&other).await != 2.0 {
        assert!(
            Instant::now() < deadline,
            "other limits on the same route were not noticed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for gate in [first, same, other] {
        gate.stop().await.expect("stop");
    }
}
