//! Envoy's rate limit service protocol on the decision listener, asked by
//! a gRPC client built from Envoy's own definitions (Python grpcio with
//! the xds-protos package's stubs, `tests/peers/rls_peer.py`), counting in
//! a real Redis: descriptors decided all or nothing against a model, each
//! descriptor's status with its limit and what remains, `hits_addend`, the
//! fields Envoy adds to its answer, and only listed peers answered.

mod support;

use serde_json::{Value, json};

use support::Floodgate;
use support::config::{Config, Route};
use support::peers::client;
use support::peers::edge::{call, org, user};
use support::redis::{TestRedis, unique_prefix};

/// A user's limit (3 an hour, per `user` value), an organisation's
/// (5 an hour, per `org` value, on descriptors fixed to `generic_key=api`)
/// and the whole domain's (100 an hour, all `generic_key=all` together):
/// exact sliding logs, so a model can follow every count.
fn rls(redis: &TestRedis, prefix: &str, peers: &str) -> Config {
    Config::new()
        .redis(&redis.url, prefix)
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(&format!("decision_peers = [{peers}]"))
        .route(
            Route::new("per-user")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["user"] }"#)
                .limit("sliding_log", 3, "1h"),
        )
        .route(
            Route::new("per-org")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["generic_key=api", "org"] }"#)
                .limit("sliding_log", 5, "1h"),
        )
        .route(
            Route::new("everyone")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["generic_key=all"] }"#)
                .limit("sliding_log", 100, "1h"),
        )
}

async fn ask(gate: &Floodgate, calls: &[Value]) -> Vec<Value> {
    let target = gate.decisions.expect("decision listener").to_string();
    client(
        "rls_peer.py",
        &[target, serde_json::to_string(calls).expect("json")],
    )
    .await
}

/// Each call's overall code.
fn codes(answers: &[Value]) -> Vec<&str> {
    answers
        .iter()
        .map(|a| a["code"].as_str().unwrap_or("?"))
        .collect()
}

/// A descriptor's status as the model expects it.
fn status(answer: &Value, i: usize) -> (String, u64, String) {
    let s = &answer["statuses"][i];
    (
        s["code"].as_str().unwrap_or_default().to_owned(),
        s["remaining"].as_u64().unwrap_or_default(),
        s["limit"]["name"].as_str().unwrap_or_default().to_owned(),
    )
}

fn st(code: &str, remaining: u64, name: &str) -> (String, u64, String) {
    (code.to_owned(), remaining, name.to_owned())
}

#[tokio::test]
async fn descriptors_are_decided_all_or_nothing_with_each_ones_status() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls");
    let gate = Floodgate::start(&rls(&redis, &prefix, r#""127.0.0.1/32""#).toml()).await;
    let answers = ask(
        &gate,
        &[
            // ann's three, then a fourth her limit refuses: the
            // organisation's count is not touched by it.
            call(&[user("ann"), org("acme")]),
            call(&[user("ann"), org("acme")]),
            call(&[user("ann"), org("acme")]),
            call(&[user("ann"), org("acme")]),
            // Two hits for bob: acme reaches its five.
            json!({ "domain": "edge", "hits_addend": 2, "descriptors": [user("bob"), org("acme")] }),
            // acme is full: cid's own limit is untouched.
            call(&[user("cid"), org("acme")]),
            // A descriptor no route decides, beside one that is.
            call(&[json!({ "entries": [["path", "/x"]] }), user("dan")]),
        ],
    )
    .await;
    assert_eq!(
        codes(&answers),
        ["OK", "OK", "OK", "OVER_LIMIT", "OK", "OVER_LIMIT", "OK"],
        "{answers:#?}"
    );
    let expected = [
        [st("OK", 2, "per-user"), st("OK", 4, "per-org")],
        [st("OK", 1, "per-user"), st("OK", 3, "per-org")],
        [st("OK", 0, "per-user"), st("OK", 2, "per-org")],
        [st("OVER_LIMIT", 0, "per-user"), st("OK", 2, "per-org")],
        [st("OK", 1, "per-user"), st("OK", 0, "per-org")],
        [st("OK", 3, "per-user"), st("OVER_LIMIT", 0, "per-org")],
    ];
    for (n, want) in expected.iter().enumerate() {
        for (i, w) in want.iter().enumerate() {
            assert_eq!(&status(&answers[n], i), w, "call {n}, descriptor {i}");
        }
    }
    // The limit each status reports, as Envoy's units say it.
    assert_eq!(answers[0]["statuses"][0]["limit"]["unit"], "HOUR");
    assert_eq!(answers[0]["statuses"][0]["limit"]["requests_per_unit"], 3);
    let reset = answers[3]["statuses"][0]["reset_s"].as_f64().unwrap_or(0.0);
    assert!((3_500.0..=3_600.0).contains(&reset), "reset {reset}");
    // The descriptor nothing decides is OK with no limit; the other counts.
    assert_eq!(
        answers[6]["statuses"][0],
        json!({ "code": "OK", "remaining": 0 })
    );
    assert_eq!(status(&answers[6], 1), st("OK", 2, "per-user"));
    // The fields a client of the proxy listener would get, for Envoy to
    // add: the most constrained limit, and Retry-After when over.
    let headers = &answers[3]["headers"];
    assert_eq!(headers["ratelimit"], "\"per-user\";r=0;t=3600", "{headers}");
    let retry: u64 = headers["retry-after"]
        .as_str()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    assert!((3_590..=3_600).contains(&retry), "Retry-After {retry}");
    assert!(answers[0]["headers"].get("retry-after").is_none());
    // Redis holds what the model admitted, and nothing of the refusals.
    let count = |route: &str| format!("{prefix}:{{{route}:*}}:0:sliding_log:*");
    let mut users = redis.logged_each(&count("per-user")).await;
    users.sort_unstable();
    assert_eq!(users, [1, 2, 3], "dan 1, bob 2, ann 3; cid nothing");
    assert_eq!(redis.logged_each(&count("per-org")).await, [5]);
}

#[tokio::test]
async fn a_global_descriptor_counts_everyone_and_bad_calls_are_refused_by_name() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls-global");
    let gate = Floodgate::start(&rls(&redis, &prefix, r#""127.0.0.1/32""#).toml()).await;
    let everyone = json!({ "entries": [["generic_key", "all"]] });
    let answers = ask(
        &gate,
        &[
            json!({ "domain": "edge", "hits_addend": 60, "descriptors": [everyone] }),
            json!({ "domain": "edge", "descriptors": [{ "entries": [["generic_key", "all"]], "hits_addend": 40 }] }),
            json!({ "domain": "edge", "descriptors": [everyone] }),
            // Descriptors counting different hits cannot be one charge.
            json!({ "domain": "edge", "descriptors": [
                { "entries": [["user", "eve"]], "hits_addend": 1 },
                { "entries": [["generic_key", "api"], ["org", "x"]], "hits_addend": 2 }
            ] }),
            // Another domain's descriptors are nobody's here.
            json!({ "domain": "other", "descriptors": [user("eve")] }),
        ],
    )
    .await;
    assert_eq!(status(&answers[0], 0), st("OK", 40, "everyone"));
    assert_eq!(status(&answers[1], 0), st("OK", 0, "everyone"));
    assert_eq!(answers[2]["code"], "OVER_LIMIT");
    assert_eq!(answers[3]["error"], "INVALID_ARGUMENT", "{:?}", answers[3]);
    assert!(
        answers[3]["message"]
            .as_str()
            .is_some_and(|m| m.contains("hits_addend")),
        "{:?}",
        answers[3]
    );
    assert_eq!(answers[4]["code"], "OK");
    assert_eq!(
        answers[4]["statuses"][0],
        json!({ "code": "OK", "remaining": 0 })
    );
    let everyone_key = format!("{prefix}:{{everyone:g}}:0:sliding_log:*");
    assert_eq!(redis.logged_each(&everyone_key).await, [100]);
    assert!(
        redis
            .keys(&format!("{prefix}:{{per-user:*"))
            .await
            .is_empty(),
        "the refused call counted nothing"
    );
}

#[tokio::test]
async fn only_listed_peers_may_spend_clients_limits_with_descriptors() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls-peers");
    // The test's client connects from 127.0.0.1, which is not listed.
    let gate = Floodgate::start(&rls(&redis, &prefix, r#""127.0.0.2/32""#).toml()).await;
    let answers = ask(&gate, &[call(&[user("ann")])]).await;
    assert_eq!(answers[0]["error"], "PERMISSION_DENIED", "{answers:?}");
    assert!(redis.keys(&format!("{prefix}:*")).await.is_empty());
}

#[tokio::test]
async fn a_configuration_written_for_envoyproxy_ratelimit_translates_and_decides() {
    let dir = support::temp_dir("envoy-yaml");
    let yaml = dir.join("ratelimit.yaml");
    std::fs::write(
        &yaml,
        "domain: edge\n\
         descriptors:\n\
         \x20 - key: generic_key\n\
         \x20   descriptors:\n\
         \x20     - key: user\n\
         \x20       rate_limit: { unit: hour, requests_per_unit: 1 }\n\
         \x20 - key: generic_key\n\
         \x20   value: api\n\
         \x20   rate_limit: { unit: hour, requests_per_unit: 2 }\n",
    )
    .expect("write yaml");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("--from-envoy-ratelimit")
        .arg(&yaml)
        .output()
        .expect("run floodgate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let routes = String::from_utf8_lossy(&out.stdout).into_owned();
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls-yaml");
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .toml()
        + &routes;
    let gate = Floodgate::start(&toml).await;
    let api = json!({ "entries": [["generic_key", "api"]] });
    let ann = json!({ "entries": [["generic_key", "web"], ["user", "ann"]] });
    let answers = ask(
        &gate,
        &[
            call(std::slice::from_ref(&api)),
            call(std::slice::from_ref(&api)),
            call(&[api]),
            call(std::slice::from_ref(&ann)),
            call(&[ann]),
        ],
    )
    .await;
    assert_eq!(
        codes(&answers),
        ["OK", "OK", "OVER_LIMIT", "OK", "OVER_LIMIT"],
        "{routes}"
    );
    // What it cannot express the same way is refused by name.
    std::fs::write(
        &yaml,
        "domain: edge\ndescriptors:\n  - key: path\n    value: /api/*\n    rate_limit: { unit: minute, requests_per_unit: 1 }\n",
    )
    .expect("write yaml");
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("--from-envoy-ratelimit")
        .arg(&yaml)
        .output()
        .expect("run floodgate");
    assert_eq!(refused.status.code(), Some(1));
    assert!(refused.stdout.is_empty());
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains("descriptors[0].value: a value matching by prefix"),
        "{said}"
    );
}

#[tokio::test]
async fn a_shadow_descriptor_counts_and_never_refuses_the_others() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls-shadow");
    let toml = rls(&redis, &prefix, r#""127.0.0.1/32""#)
        .route(
            Route::new("trial")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["trial"] }"#)
                .line("shadow = true")
                .limit("sliding_log", 1, "1h"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let trial = json!({ "entries": [["trial", "x"]] });
    let answers = ask(
        &gate,
        &[
            call(&[user("zed"), trial.clone()]),
            call(&[user("zed"), trial]),
        ],
    )
    .await;
    assert_eq!(answers[0]["code"], "OK");
    assert_eq!(answers[1]["code"], "OK", "a shadow limit never refuses");
    assert_eq!(status(&answers[1], 0), st("OK", 1, "per-user"));
    assert_eq!(status(&answers[1], 1), st("OVER_LIMIT", 0, "trial"));
    // The enforced descriptor counted both; the shadow one its first.
    let count = |route: &str| format!("{prefix}:{{{route}:*}}:0:sliding_log:*");
    assert_eq!(redis.logged_each(&count("per-user")).await, [2]);
    assert_eq!(redis.logged_each(&count("trial")).await, [1]);
}

#[tokio::test]
async fn a_descriptor_entry_chooses_the_plan_whose_limits_apply() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("rls-plans");
    let toml = rls(&redis, &prefix, r#""127.0.0.1/32""#)
        .route(
            Route::new("tiered")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["account", "tier"], plan = "tier" }"#)
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(
            "[plan_selection]\nby = { from = \"header\", name = \"X-Plan\" }\ndefault = \"free\"\n\n\
             [plans.free]\nlimits = [{ algorithm = \"sliding_log\", limit = 2, window = \"1h\" }]\n\n\
             [plans.pro]\nlimits = [{ algorithm = \"sliding_log\", limit = 5, window = \"1h\" }]\n",
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let on = |account: &str, tier: &str| {
        call(&[json!({ "entries": [["account", account], ["tier", tier]] })])
    };
    let mut calls = Vec::new();
    calls.extend((0..3).map(|_| on("a1", "free")));
    calls.extend((0..6).map(|_| on("a2", "pro")));
    // A plan the selection does not know: its default, free.
    calls.extend((0..3).map(|_| on("a3", "gold")));
    let answers = ask(&gate, &calls).await;
    assert_eq!(
        codes(&answers),
        [
            "OK",
            "OK",
            "OVER_LIMIT", // free: 2
            "OK",
            "OK",
            "OK",
            "OK",
            "OK",
            "OVER_LIMIT", // pro: 5
            "OK",
            "OK",
            "OVER_LIMIT", // the default
        ],
        "{answers:#?}"
    );
    let remaining: Vec<u64> = answers
        .iter()
        .map(|a| a["statuses"][0]["remaining"].as_u64().unwrap_or(99))
        .collect();
    assert_eq!(remaining, [1, 0, 0, 4, 3, 2, 1, 0, 0, 1, 0, 0]);
    // Counted per account, not per account and tier.
    let count = format!("{prefix}:{{tiered:*}}:0:sliding_log:*");
    let mut each = redis.logged_each(&count).await;
    each.sort_unstable();
    assert_eq!(each, [2, 2, 5]);
}

/// A store that was right and went away, with `on_error = "deny"`: Envoy
/// is answered UNAVAILABLE (what its `failure_mode_deny` acts on), and
/// each such answer is counted with floodgate's own refusals, as the
/// proxy listener's 503 is: status 503, the store's fault.
#[tokio::test]
async fn a_store_outage_with_on_error_deny_answers_unavailable_and_counts_each_refusal() {
    // A redis-server process of this test's own, to kill.
    let mut redis = TestRedis::start_process().await;
    let prefix = unique_prefix("rls-outage");
    let config = rls(&redis, &prefix, r#""127.0.0.1/32""#)
        .store(r#"on_error = "deny""#)
        .admin();
    let gate = Floodgate::start(&config.toml()).await;
    let before = ask(&gate, &[call(&[user("ann")])]).await;
    assert_eq!(codes(&before), ["OK"], "{before:?}");

    redis.kill();
    let during = ask(&gate, &[call(&[user("ann")]), call(&[user("bob")])]).await;
    let errors: Vec<&str> = during
        .iter()
        .map(|a| a["error"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(errors, ["UNAVAILABLE", "UNAVAILABLE"], "{during:?}");

    let metrics = support::TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    assert!(
        metrics.contains("floodgate_refusals_total{status=\"503\",fault=\"store\"} 2"),
        "{metrics}"
    );
}
