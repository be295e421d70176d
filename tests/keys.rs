//! The key registry beyond the store matrix: a flood of made-up keys from
//! many addresses costs the store a bounded few calls and grows nothing;
//! the memory store's registry survives a restart in its state file (and
//! a broken one stops floodgate); a rotated key's predecessor stays valid
//! for the grace and then expires; each outcome's answer on a route that
//! answers with problem documents and to a gRPC client.

mod support;

use std::time::{Duration, Instant};

use support::config::{Config, Route};
use support::redis::{TestRedis, command_calls, unique_prefix};
use support::{Answer, Floodgate, TestClient, temp_dir, text_body};

/// The admin token.
const TOKEN: &str = "0123456789abcdef0123456789abcdef";

fn tokens(dir: &std::path::Path) -> String {
    let path = dir.join("admin-token");
    std::fs::write(&path, format!("{TOKEN}\n")).expect("write the token");
    format!(r#"admin_token_file = "{}""#, path.display())
}

/// A configuration on the memory store with an admin listener, the
/// token of `tokens(dir)`, and the registry kept in `dir/keys.json`.
fn on_memory(dir: &std::path::Path) -> Config {
    Config::new().admin().server(&tokens(dir)).tables(&format!(
        "[keys]\nstate_file = {:?}\n",
        dir.join("keys.json").display().to_string()
    ))
}

/// A route whose clients are their keys' identities, 100 an hour each.
fn api() -> Route {
    Route::new("api")
        .respond("status = 200")
        .line(r#"api_key = { from = "header", name = "X-Api-Key" }"#)
        .client(r#"from = "key""#)
        .limits(r#"{ algorithm = "fixed_window", limit = 100, window = "1h" }"#)
}

async fn admin(gate: &Floodgate, method: &str, path: &str, body: &str) -> Answer {
    let request = http::Request::builder()
        .method(method)
        .uri(gate.admin_url(path))
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("content-type", "application/json")
        .body(text_body(body))
        .expect("a request");
    TestClient::http1().send(request).await
}

/// Makes a key for `identity`: the key and its id.
async fn make(gate: &Floodgate, body: &str) -> (String, String) {
    let made = admin(gate, "POST", "/keys", body).await;
    assert_eq!(made.status, 201, "{}", made.text());
    let json = made.json();
    (
        json["key"].as_str().expect("a key").to_owned(),
        json["record"]["id"].as_str().expect("an id").to_owned(),
    )
}

async fn metric(gate: &Floodgate, name: &str, labels: &[&str]) -> f64 {
    let page = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    support::load::metric_where(&page, name, labels)
}

/// 10 made-up keys from each of 300 addresses (through a trusted front
/// proxy's `X-Forwarded-For`), 200 at a time: their statuses.
async fn flood(gate: &Floodgate, http: &TestClient) -> Vec<http::StatusCode> {
    let mut sent = Vec::new();
    let mut statuses = Vec::new();
    for address in 0..300u32 {
        let forwarded = format!("10.{}.{}.7", address / 250, address % 250);
        for n in 0..10 {
            let made_up = format!("sk-made-up-{address}-{n}");
            let url = gate.url("/");
            let http = http.clone();
            let forwarded = forwarded.clone();
            sent.push(tokio::spawn(async move {
                http.get(
                    &url,
                    &[("x-api-key", &made_up), ("x-forwarded-for", &forwarded)],
                )
                .await
                .status
            }));
        }
        if sent.len() >= 200 {
            for task in sent.drain(..) {
                statuses.push(task.await.expect("a request"));
            }
        }
    }
    for task in sent {
        statuses.push(task.await.expect("a request"));
    }
    statuses
}

/// 300 addresses (through a trusted front proxy's `X-Forwarded-For`)
/// each send 10 made-up keys: every one refused (401; 429 where a few
/// addresses share a slot of the budget), each counted once, at most
/// once asked of the store and never more than 50 asks a second in all,
/// none kept; the real key still admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_made_up_keys_costs_the_store_a_bounded_few_calls_and_keeps_nothing() {
    let redis = TestRedis::start_private().await;
    let dir = temp_dir("keys-flood");
    let toml = Config::new()
        .redis(&redis.url, &unique_prefix("keys-flood"))
        .admin()
        .server(&tokens(&dir))
        .server(r#"trusted_proxies = ["127.0.0.1/32"]"#)
        .tables("[keys]\n")
        .route(api())
        .toml();
    let gate = Floodgate::start(&toml).await;
    let (key, _) = make(&gate, r#"{"identity": "real", "reason": "a customer"}"#).await;
    let conn = redis.connection().await;
    let info = || async {
        let mut conn = conn.clone();
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut conn)
            .await
            .expect("INFO");
        info
    };
    let asks_before = command_calls(&info().await, "hget");
    let start = Instant::now();
    let http = TestClient::http1();
    let statuses = flood(&gate, &http).await;
    // Refused: unknown (401), or unchecked (429) where addresses share
    // one of the budget's hashed slots and spend its 20 together.
    assert!(
        statuses.iter().all(|s| *s == 401 || *s == 429),
        "{statuses:?}"
    );
    assert!(statuses.iter().filter(|s| **s == 401).count() >= 2_900);
    let took = start.elapsed();
    let asks = command_calls(&info().await, "hget") - asks_before;
    // At most 50 a second, each address within its budget (20 a minute).
    let bound = (took.as_secs_f64().ceil() + 1.0) as u64 * 50;
    eprintln!("3000 made-up keys in {took:?}: the store asked {asks} times (bound {bound})");
    assert!(asks > 0 && asks <= bound, "{asks} asks in {took:?}");
    assert_eq!(
        metric(&gate, "floodgate_keys", &[]).await,
        1.0,
        "nothing kept"
    );
    let lookups = |outcome: &'static str| {
        let label = format!("outcome=\"{outcome}\"");
        let gate = &gate;
        async move { metric(gate, "floodgate_key_lookups_total", &[&label]).await }
    };
    let refused = lookups("unknown").await + lookups("too_many_failures").await;
    assert_eq!(refused, 3000.0, "each counted once");
    let real = http.get(&gate.url("/"), &[("x-api-key", &key)]).await;
    assert_eq!(real.status, 200);
    let counted = metric(&gate, "floodgate_key_store_asks_total", &[]).await;
    assert_eq!(counted, asks as f64, "every ask counted");
    assert_eq!(
        metric(&gate, "floodgate_key_store_asks_found_total", &[]).await,
        0.0
    );
}

/// The memory store's registry is the instance's own, in its state file:
/// a key made before a restart is valid after it, and its audit kept; a
/// state file that cannot be read stops floodgate, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_stores_registry_survives_a_restart_in_its_state_file() {
    let dir = temp_dir("keys-state");
    let state = dir.join("keys.json");
    let toml = on_memory(&dir).route(api()).toml();
    let gate = Floodgate::start(&toml).await;
    let (key, id) = make(&gate, r#"{"identity": "kim", "reason": "signed up"}"#).await;
    let http = TestClient::http1();
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", &key)])
            .await
            .status,
        200
    );
    gate.stop().await.expect("a clean stop");
    let written = std::fs::read_to_string(&state).expect("the state file");
    assert!(
        !written.contains(&key),
        "the key is never written in the clear"
    );

    let again = Floodgate::start(&toml).await;
    assert_eq!(
        http.get(&again.url("/"), &[("x-api-key", &key)])
            .await
            .status,
        200
    );
    let read = admin(&again, "GET", &format!("/keys/{id}"), "").await;
    assert_eq!(read.json()["identity"], "kim");
    let audit = admin(&again, "GET", "/audit?identity=kim", "").await;
    assert_eq!(audit.json()["entries"][0]["action"], "create");
    again.stop().await.expect("a clean stop");

    std::fs::write(&state, "{ not json").expect("break the file");
    let refused = Floodgate::start_refused(&toml).await;
    assert!(
        refused.contains(&state.display().to_string()),
        "the refusal names the state file: {refused}"
    );
}

/// A rotated key's successor works at once; the old key stays valid for
/// the grace, then is refused as expired (401).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_stays_valid_for_its_grace_then_expires() {
    let dir = temp_dir("keys-rotate");
    let toml = on_memory(&dir).route(api()).toml();
    let gate = Floodgate::start(&toml).await;
    let (old, id) = make(
        &gate,
        r#"{"identity": "lee", "attributes": {"org": "acme"}, "reason": "signed up"}"#,
    )
    .await;
    let unstated = admin(
        &gate,
        "POST",
        &format!("/keys/{id}/rotate"),
        r#"{"reason": "leaked in a log"}"#,
    )
    .await;
    assert_eq!(
        unstated.status,
        422,
        "the grace is stated: {}",
        unstated.text()
    );
    let rotated = admin(
        &gate,
        "POST",
        &format!("/keys/{id}/rotate"),
        r#"{"grace": "2s", "reason": "leaked in a log"}"#,
    )
    .await;
    assert_eq!(rotated.status, 201, "{}", rotated.text());
    let json = rotated.json();
    let new = json["key"].as_str().expect("a new key").to_owned();
    assert_eq!(json["record"]["identity"], "lee");
    assert_eq!(json["record"]["attributes"]["org"], "acme");
    let grace_end = json["old"]["expires_ms"]
        .as_u64()
        .expect("the old key expires");
    let http = TestClient::http1();
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", &new)])
            .await
            .status,
        200
    );
    let now_ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    };
    let during = http.get(&gate.url("/"), &[("x-api-key", &old)]).await;
    if now_ms() < grace_end {
        assert_eq!(during.status, 200, "within the grace");
    }
    tokio::time::sleep(Duration::from_millis(
        grace_end.saturating_sub(now_ms()) + 50,
    ))
    .await;
    let after = http.get(&gate.url("/"), &[("x-api-key", &old)]).await;
    assert_eq!(after.problem(), (401, "the API key expired".to_owned()));
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", &new)])
            .await
            .status,
        200
    );
    let keys = admin(&gate, "GET", "/identities/lee/keys", "").await;
    assert_eq!(keys.json()["keys"].as_array().map(Vec::len), Some(2));
}

/// On a route answering with problem documents: no key 401 naming the
/// header, a disabled key 403, an expired one 401; to a gRPC client, the
/// same refusals as gRPC statuses (UNAUTHENTICATED, PERMISSION_DENIED);
/// an address past its budget of unknown keys 429, its valid key
/// admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_outcome_has_its_own_answer() {
    let dir = temp_dir("keys-answers");
    let toml = on_memory(&dir).route(api()).toml();
    let gate = Floodgate::start(&toml).await;
    let (off, _) = make(
        &gate,
        r#"{"identity": "off", "enabled": false, "reason": "test"}"#,
    )
    .await;
    let (old, _) = make(
        &gate,
        r#"{"identity": "old", "expires_ms": 1000, "reason": "test"}"#,
    )
    .await;
    let http = TestClient::http1();
    let missing = http.get(&gate.url("/"), &[]).await;
    assert_eq!(
        missing.problem(),
        (
            401,
            "this API needs an API key: send it in the x-api-key header".to_owned()
        )
    );
    let disabled = http.get(&gate.url("/"), &[("x-api-key", &off)]).await;
    assert_eq!(
        disabled.problem(),
        (403, "the API key is disabled".to_owned())
    );
    let expired = http.get(&gate.url("/"), &[("x-api-key", &old)]).await;
    assert_eq!(expired.problem(), (401, "the API key expired".to_owned()));
    let grpc = TestClient::h2c();
    let minute = || now_ms() / 60_000;
    let first_minute = minute();
    for (key, status) in [("sk-nope", "16"), (off.as_str(), "7")] {
        let request = http::Request::post(gate.url("/pkg.Service/Call"))
            .header("content-type", "application/grpc")
            .header("x-api-key", key)
            .body(text_body(""))
            .expect("a request");
        let answer = grpc.send(request).await;
        assert_eq!(answer.header("grpc-status"), Some(status), "{key}");
    }
    // The address's budget: 20 unknown keys a minute (the gRPC one was
    // the first); past it refused unchecked (429), its valid keys still
    // admitted.
    let (on, _) = make(&gate, r#"{"identity": "on", "reason": "test"}"#).await;
    let mut statuses = Vec::new();
    for n in 0..22 {
        let made_up = format!("sk-guess-{n}");
        let answer = http.get(&gate.url("/"), &[("x-api-key", &made_up)]).await;
        statuses.push(answer.status.as_u16());
        if answer.status == 429 {
            assert!(answer.header("retry-after").is_some());
        }
    }
    if minute() == first_minute {
        assert_eq!(statuses[..19], [401; 19], "{statuses:?}");
        assert_eq!(statuses[19..], [429; 3], "{statuses:?}");
    } else {
        // The budget's minute turned meanwhile: counted afresh from then.
        let unchecked = statuses.iter().skip_while(|s| **s == 401).count();
        assert!(
            statuses.iter().rev().take(unchecked).all(|s| *s == 429),
            "{statuses:?}"
        );
    }
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", &on)]).await.status,
        200
    );
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// UTC midnight of `date`, in ms.
fn midnight(date: jiff::civil::Date) -> u64 {
    let zoned = date
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .expect("midnight");
    zoned.timestamp().as_millisecond() as u64
}

/// `r` and `t` of the answer's `RateLimit` field.
fn fields(answer: &Answer) -> (u64, u64) {
    let field = answer.header("ratelimit").unwrap_or_default();
    let part = |name: &str| {
        field
            .split(';')
            .find_map(|p| p.strip_prefix(name)?.parse().ok())
            .unwrap_or(u64::MAX)
    };
    (part("r="), part("t="))
}

/// A month quota from each key's billing day, an attribute in the
/// registry: a key whose day is tomorrow's has its window end at that
/// midnight (the day after when tomorrow is the 1st), and one without the
/// attribute, or with one that is no day of the month, at the first of
/// next month.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_months_anchor_is_read_from_the_keys_attribute() {
    let dir = temp_dir("keys-anchor");
    let toml = on_memory(&dir)
        .route(
            Route::new("calls")
                .respond("status = 200")
                .line(r#"api_key = { from = "header", name = "X-Api-Key" }"#)
                .client(r#"from = "key""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 10000, window = "month", anchor = { key = "billing_day", default = 1 } }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let today = jiff::Timestamp::now()
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .date();
    let tomorrow = today.tomorrow().expect("tomorrow");
    let next_month = today
        .first_of_month()
        .checked_add(jiff::Span::new().months(1))
        .expect("next month");
    let anchored_end = if tomorrow.day() == 1 {
        tomorrow.tomorrow().expect("the day after")
    } else {
        tomorrow
    };
    let day = anchored_end.day();
    let cases = [
        (format!(r#"{{"billing_day": "{day}"}}"#), anchored_end),
        ("{}".to_owned(), next_month),
        (r#"{"billing_day": "45"}"#.to_owned(), next_month),
    ];
    let http = TestClient::http1();
    for (i, (attributes, end)) in cases.into_iter().enumerate() {
        let body =
            format!(r#"{{"identity": "c{i}", "attributes": {attributes}, "reason": "test"}}"#);
        let (key, _) = make(&gate, &body).await;
        let before = now_ms();
        let answer = http.get(&gate.url("/"), &[("x-api-key", &key)]).await;
        let after = now_ms();
        assert_eq!(answer.status, 200, "{attributes}");
        let (r, t) = fields(&answer);
        assert_eq!(r, 9_999, "{attributes}");
        let end = midnight(end);
        let seconds = |at: u64| end.saturating_sub(at).div_ceil(1000);
        assert!(
            (seconds(after)..=seconds(before)).contains(&t),
            "{attributes}: t={t}, end in {}s",
            seconds(before)
        );
    }
}

/// An operator's credit to a client named by its key is audited under the
/// key's identity, with the admin token's name; the access log names the
/// key by its id and each request's verification.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_credit_is_audited_under_the_keys_identity() {
    let dir = temp_dir("keys-credit");
    let log = dir.join("access.log");
    std::fs::write(
        dir.join("admin-tokens"),
        format!("dana {TOKEN}\nerin erin-0123456789abcdef0123\n"),
    )
    .expect("write the tokens");
    let toml = Config::new()
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("admin-tokens").display()
        ))
        .access_log(&[&format!("path = {:?}", log.display().to_string())])
        .tables(&format!(
            "[keys]\nstate_file = {:?}\n",
            dir.join("keys.json").display().to_string()
        ))
        .route(api())
        .toml();
    let gate = Floodgate::start(&toml).await;
    let (key, id) = make(&gate, r#"{"identity": "max", "reason": "signed up"}"#).await;
    let http = TestClient::http1();
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", &key)])
            .await
            .status,
        200
    );
    assert_eq!(
        http.get(&gate.url("/"), &[("x-api-key", "nope")])
            .await
            .status,
        401
    );
    let credit = format!(
        r#"{{"route": "api", "client": {{"headers": {{"x-api-key": "{key}"}}}}, "units": 1, "reason": "ticket 7"}}"#
    );
    let credited = admin(&gate, "POST", "/clients/credit", &credit).await;
    assert_eq!(credited.status, 200, "{}", credited.text());
    let audit = admin(&gate, "GET", "/audit?identity=max", "").await;
    let entries = audit.json()["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let seen: Vec<(&str, &str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap_or(""),
                e["operator"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("credit", "dana", "ticket 7"),
            ("create", "dana", "signed up")
        ]
    );
    assert!(!audit.text().contains(&key), "never the key itself");
    let start = Instant::now();
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.lines().count() >= 2 || start.elapsed() > Duration::from_secs(5) {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let lines: Vec<serde_json::Value> = lines
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert_eq!(lines[0]["key"], "valid", "{:?}", lines[0]);
    assert_eq!(lines[0]["key_id"], id.as_str());
    assert_eq!(lines[1]["key"], "unknown", "{:?}", lines[1]);
    assert!(lines[1].get("key_id").is_none());
}

/// An instance that starts while the store does not answer cannot tell a
/// key from a made-up one: it answers 503 (the store's fault, which
/// clients retry), not 401; once the store answers, it reads the registry
/// and the key is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_while_the_store_is_down_answers_503_until_it_reads_the_registry() {
    let redis = TestRedis::start_process().await;
    let dir = temp_dir("keys-down");
    let toml = Config::new()
        .redis(&redis.url, &unique_prefix("keys-down"))
        .store(r#"timeout = "200ms""#)
        .admin()
        .server(&tokens(&dir))
        .tables("[keys]\n")
        .route(api())
        .toml();
    let first = Floodgate::start(&toml).await;
    let (key, _) = make(&first, r#"{"identity": "nia", "reason": "signed up"}"#).await;
    first.stop().await.expect("a clean stop");
    redis.pause();
    let second = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let answer = http.get(&second.url("/"), &[("x-api-key", &key)]).await;
    let made_up = http
        .get(&second.url("/"), &[("x-api-key", "sk-made-up")])
        .await;
    redis.resume();
    assert_eq!(answer.status, 503, "{}", answer.text());
    assert!(answer.header("retry-after").is_some());
    assert_eq!(made_up.status, 503, "a made-up key cannot be told either");
    let start = Instant::now();
    loop {
        let answer = http.get(&second.url("/"), &[("x-api-key", &key)]).await;
        if answer.status == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "still {} after the store came back",
            answer.status
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        http.get(&second.url("/"), &[("x-api-key", "sk-made-up")])
            .await
            .status,
        401
    );
}

/// Keys a customer already holds, imported through one instance's admin
/// API by value and by SHA-256 (the registry never sees the second in
/// the clear), are admitted on the other; importing one twice is a
/// conflict; one revoked on the first is refused (401) on the second
/// within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imported_keys_work_everywhere_and_a_revoked_one_stops_within_a_second() {
    use sha2::Digest as _;
    let redis = TestRedis::start().await;
    let dir = temp_dir("keys-import");
    let toml = Config::new()
        .redis(&redis.url, &unique_prefix("keys-import"))
        .admin()
        .server(&tokens(&dir))
        .tables("[keys]\n")
        .route(api())
        .toml();
    let (a, b) = (Floodgate::start(&toml).await, Floodgate::start(&toml).await);
    let by_value = admin(
        &a,
        "POST",
        "/keys/import",
        r#"{"key": "legacy-key-0001", "identity": "old", "reason": "migrated"}"#,
    )
    .await;
    assert_eq!(by_value.status, 201, "{}", by_value.text());
    let sha: String = sha2::Sha256::digest(b"legacy key 0002")
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let by_digest = admin(
        &a,
        "POST",
        "/keys/import",
        &format!(r#"{{"sha256": "{sha}", "identity": "older", "reason": "migrated"}}"#),
    )
    .await;
    assert_eq!(by_digest.status, 201, "{}", by_digest.text());
    let again = admin(
        &a,
        "POST",
        "/keys/import",
        r#"{"key": "legacy-key-0001", "identity": "other", "reason": "twice"}"#,
    )
    .await;
    assert_eq!(again.status, 409, "{}", again.text());
    let http = TestClient::http1();
    for key in ["legacy-key-0001", "legacy key 0002"] {
        let answer = http.get(&b.url("/"), &[("x-api-key", key)]).await;
        assert_eq!(answer.status, 200, "{key}: {}", answer.text());
    }
    let id = by_value.json()["id"].as_str().expect("an id").to_owned();
    let revoked = admin(&a, "DELETE", &format!("/keys/{id}?reason=left%20us"), "").await;
    assert_eq!(revoked.status, 200, "{}", revoked.text());
    let start = Instant::now();
    loop {
        let answer = http
            .get(&b.url("/"), &[("x-api-key", "legacy-key-0001")])
            .await;
        if answer.status == 401 {
            break;
        }
        assert_eq!(answer.status, 200);
        assert!(start.elapsed() < Duration::from_secs(5), "still admitted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "revoked after {took:?}");
    assert_eq!(
        admin(&b, "GET", &format!("/keys/{id}"), "").await.status,
        404
    );
}
