//! Quotas by the calendar: fixed windows whose boundaries are calendar
//! instants (a month from a client's billing day), a client's readout and
//! operators' changes, counted in a real Redis (and a Redis Cluster) by two
//! floodgate instances. A minute's boundary and the export of closed
//! windows are scenarios of the store matrix (`tests/matrix/calendar.rs`),
//! run on every store.

mod support;

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::tokens::hs256 as token;
use support::{Answer, Floodgate, TestClient, temp_dir};

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `r` and `t` of a `RateLimit` field.
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

/// Whole seconds from `from` (ms) to `to` (ms), rounded up, as `t` and
/// `Retry-After` are.
fn seconds_between(from: u64, to: u64) -> u64 {
    to.saturating_sub(from).div_ceil(1000)
}

/// UTC midnight of `date`, in ms.
fn midnight(date: jiff::civil::Date) -> u64 {
    let zoned = date
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .expect("midnight");
    zoned.timestamp().as_millisecond() as u64
}

/// A month quota from each client's billing day, read from a verified
/// claim: a client whose day is tomorrow's (the day after, when tomorrow
/// is the 1st) has its window end at that midnight, and one without the
/// claim at the first of next month; `w` is each window's real length.
#[tokio::test]
async fn a_months_anchor_is_read_from_a_verified_claim() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("quota-anchor");
    let dir = temp_dir("quota-anchor");
    let secret = b"a billing secret of at least thirty-two bytes".to_vec();
    let jwt = support::tokens::hs256_client(&dir, &secret);
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(
            Route::new("calls")
                .respond("status = 200")
                .client(&jwt)
                .limits(r#"{ algorithm = "fixed_window", limit = 10000, window = "month", anchor = { claim = "billing_day", default = 1 } }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let today = jiff::Timestamp::now()
        .to_zoned_datetime(jiff::tz::TimeZone::UTC)
        .date();
    let tomorrow = today.tomorrow().expect("tomorrow");
    let next_month = today
        .first_of_month()
        .checked_add(jiff::Span::new().months(1))
        .expect("next month");
    // An anchor whose window ends tomorrow, or, when tomorrow is the 1st
    // (where the default ends too), the day after: never the default's end.
    let anchored_end = if tomorrow.day() == 1 {
        tomorrow.tomorrow().expect("the day after")
    } else {
        tomorrow
    };
    let day = anchored_end.day();
    assert_ne!(
        anchored_end, next_month,
        "the anchored case would be the default's"
    );
    let cases = [
        (
            format!(r#""sub":"anchored","billing_day":{day}"#),
            anchored_end,
            anchored_end
                .checked_sub(jiff::Span::new().months(1))
                .expect("a month back"),
        ),
        (
            r#""sub":"calendar""#.to_owned(),
            next_month,
            today.first_of_month(),
        ),
        // Not a day of the month: the default.
        (
            r#""sub":"odd","billing_day":45"#.to_owned(),
            next_month,
            today.first_of_month(),
        ),
    ];
    for (claims, end, start) in cases {
        let bearer = format!("Bearer {}", token(&secret, &claims));
        let before = now_ms();
        let answer = http
            .get(&gate.url("/"), &[("authorization", &bearer)])
            .await;
        let after = now_ms();
        assert_eq!(answer.status, 200, "{claims}");
        let (r, t) = fields(&answer);
        assert_eq!(r, 9_999, "{claims}");
        let (end, start) = (midnight(end), midnight(start));
        assert!(
            (seconds_between(after, end)..=seconds_between(before, end)).contains(&t),
            "{claims}: t={t}"
        );
        let policy = format!("\"calls\";q=10000;w={}", (end - start) / 1000);
        assert_eq!(
            answer.header("ratelimit-policy"),
            Some(policy.as_str()),
            "{claims}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Every key under `prefix`: its value (a string's, or a sorted set's
/// members) and its time to live.
async fn store_state(redis: &TestRedis, prefix: &str) -> Vec<(String, String, i64)> {
    let mut conn = redis.connection().await;
    let mut keys = redis.keys(&format!("{prefix}:*")).await;
    keys.sort();
    let mut out = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("type");
        let value = match kind.as_str() {
            "string" => redis::cmd("GET")
                .arg(&key)
                .query_async::<String>(&mut conn)
                .await
                .expect("get"),
            "zset" => redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .query_async::<Vec<String>>(&mut conn)
                .await
                .expect("zrange")
                .join(" "),
            other => other.to_owned(),
        };
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("pttl");
        out.push((key, value, ttl));
    }
    out
}

/// The readout: a route that answers the caller's standing on another
/// route, under the caller's own key, consuming nothing (every key keeps
/// its value, and no time to live is renewed), and matching the next
/// decision exactly.
#[tokio::test]
async fn a_client_reads_its_own_standing_and_it_costs_nothing() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("standing");
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(
            Route::new("rate_limit")
                .matching(r#"path = "/rate_limit""#)
                .standing(&["chat"]),
        )
        .route(
            Route::new("chat")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key", missing = "reject""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 10, window = "day" }"#)
                .limits(r#"{ algorithm = "sliding_log", limit = 4, window = "1h" }"#),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let read = |key: &'static str| {
        let (http, url) = (http.clone(), gate.url("/rate_limit"));
        async move {
            let answer = http.get(&url, &[("x-key", key)]).await;
            assert_eq!(answer.status, 200, "{}", answer.text());
            assert_eq!(answer.header("cache-control"), Some("no-store"));
            let json: serde_json::Value =
                serde_json::from_str(&answer.text()).expect("a JSON readout");
            json
        }
    };
    let remaining = |json: &serde_json::Value| -> Vec<u64> {
        json["routes"][0]["limits"]
            .as_array()
            .expect("limits")
            .iter()
            .map(|l| l["remaining"].as_u64().expect("remaining"))
            .collect()
    };
    for _ in 0..3 {
        let answer = http.get(&gate.url("/chat"), &[("x-key", "alice")]).await;
        assert_eq!(answer.status, 200);
    }
    let before = store_state(&redis, &prefix).await;
    let standing = read("alice").await;
    let after = store_state(&redis, &prefix).await;
    assert_eq!(before.len(), after.len(), "{before:?} {after:?}");
    for ((key, value, ttl), (key2, value2, ttl2)) in before.iter().zip(&after) {
        assert_eq!((key, value), (key2, value2), "the readout changed a key");
        assert!(ttl2 <= ttl, "the readout renewed {key}'s time to live");
    }
    let route = &standing["routes"][0];
    assert_eq!(route["route"], "chat");
    assert_eq!(route["plan"], serde_json::Value::Null);
    assert_eq!(remaining(&standing), [7, 1]);
    let day = &route["limits"][0];
    assert_eq!(
        (day["limit"].as_u64(), day["counts"].as_str()),
        (Some(10), Some("units"))
    );
    assert!(day["window_ends_at"].as_u64().is_some(), "{day}");
    assert_eq!(route["limits"][1]["window_seconds"], 3600);
    // Another key reads its own standing, whole; one without a key is
    // refused, as on the route itself.
    assert_eq!(remaining(&read("bob").await), [10, 4]);
    let anonymous = http.get(&gate.url("/rate_limit"), &[]).await;
    let on_the_route = http.get(&gate.url("/chat"), &[]).await;
    assert_eq!(anonymous.status, 400, "{}", anonymous.text());
    assert_eq!(anonymous.text(), on_the_route.text());
    // The next request is decided as the readout said: one left in the
    // hour, none after it.
    let next = http.get(&gate.url("/chat"), &[("x-key", "alice")]).await;
    assert_eq!(next.status, 200);
    assert_eq!(fields(&next).0, 0);
    assert_eq!(remaining(&read("alice").await), [6, 0]);
    let refused = http.get(&gate.url("/chat"), &[("x-key", "alice")]).await;
    assert_eq!(refused.status, 429);
    assert_eq!(remaining(&read("alice").await), [6, 0]);
}

/// POSTs `body` (JSON) to `url` with `headers`.
async fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(support::text_body(body)).expect("a request");
    TestClient::http1().send(request).await
}

/// The `remaining` of each limit in one route's standing.
fn standing_remaining(route: &serde_json::Value) -> Vec<u64> {
    standing_field(route, "remaining")
}

/// The field `name` of each limit in one route's standing.
fn standing_field(route: &serde_json::Value, name: &str) -> Vec<u64> {
    route["limits"]
        .as_array()
        .map(|limits| limits.iter().filter_map(|l| l[name].as_u64()).collect())
        .unwrap_or_default()
}

/// The bearer token operators present on the admin listener.
const OPERATOR_TOKEN: &str = "0123456789abcdef0123456789abcdef";

/// The client an operator changes: alice on route `chat`.
const ALICE: &str = r#""route": "chat", "client": { "headers": { "x-key": "alice" } }"#;

/// Route `chat`: 10 a day and 6 an hour per `X-Key`, a key required.
fn chat() -> Route {
    Route::new("chat")
        .respond("status = 200")
        .client(r#"from = "header", name = "X-Key", missing = "reject""#)
        .limits(r#"{ algorithm = "fixed_window", limit = 10, window = "day" }"#)
        .limits(r#"{ algorithm = "sliding_window", limit = 6, window = "1h" }"#)
}

/// A credit of 3 units to alice's hour, with its reason.
fn credit_of_three() -> String {
    format!(r#"{{ {ALICE}, "limit": "chat.2", "units": 3, "reason": "ticket 42" }}"#)
}

/// Two floodgate processes on one Redis, each with an admin listener that
/// takes changes from operators holding the token in `dir`, logging to a
/// file of its own.
struct Operated {
    gates: Vec<(support::FloodgateProcess, u16)>,
    logs: Vec<PathBuf>,
    http: TestClient,
}

impl Operated {
    async fn start(redis: &TestRedis, prefix: &str, dir: &Path) -> Self {
        let mut gates = Vec::new();
        let mut logs = Vec::new();
        for i in 0..2 {
            let (port, admin) = (support::free_port(), support::free_port());
            let path = Config::new()
                .redis(&redis.url, prefix)
                .listen_on(port)
                .admin_on(admin)
                .server(&format!(
                    r#"admin_token_file = "{}""#,
                    dir.join("admin-token").display()
                ))
                .route(chat())
                .write(&format!("operators-{i}"));
            let log = path.with_file_name("stderr.log");
            let process =
                support::FloodgateProcess::spawn_logging(&path, port, &[], &[], &log).await;
            gates.push((process, admin));
            logs.push(log);
        }
        let http = TestClient::http1();
        Self { gates, logs, http }
    }

    /// Alice's request to route `chat` on instance `gate`.
    async fn ask(&self, gate: usize) -> Answer {
        let url = self.gates[gate].0.url("/chat");
        self.http.get(&url, &[("x-key", "alice")]).await
    }

    /// The URL of `path` on instance `gate`'s admin listener.
    fn admin(&self, gate: usize, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.gates[gate].1)
    }
}

/// The hour's 6 are spent, 3 on each instance: both refuse (and remember
/// it).
async fn spend_the_hour(instances: &Operated) {
    for i in 0..6 {
        assert_eq!(instances.ask(i % 2).await.status, 200, "request {i}");
    }
    assert_eq!(instances.ask(0).await.status, 429);
    assert_eq!(instances.ask(1).await.status, 429);
}

/// A change without the token is 401, with another 403, without a reason
/// 400.
async fn a_change_needs_the_token_and_a_reason(instances: &Operated, authorized: &[(&str, &str)]) {
    let change = credit_of_three();
    let no_token = post(&instances.admin(0, "/clients/credit"), &[], &change).await;
    assert_eq!(no_token.status, 401, "{}", no_token.text());
    assert_eq!(no_token.header("www-authenticate"), Some("Bearer"));
    let wrong = post(
        &instances.admin(0, "/clients/credit"),
        &[("authorization", "Bearer not-the-token-at-all-no")],
        &change,
    )
    .await;
    assert_eq!(wrong.status, 403, "{}", wrong.text());
    let unreasoned = post(
        &instances.admin(0, "/clients/credit"),
        authorized,
        &format!(r#"{{ {ALICE}, "units": 3 }}"#),
    )
    .await;
    assert_eq!(unreasoned.status, 400, "{}", unreasoned.text());
}

/// Reading needs no token, and changes nothing.
async fn reading_needs_no_token_and_changes_nothing(instances: &Operated) {
    let read = post(
        &instances.admin(1, "/clients/standing"),
        &[],
        &format!("{{ {ALICE} }}"),
    )
    .await;
    assert_eq!(read.status, 200, "{}", read.text());
    let standing: serde_json::Value = serde_json::from_str(&read.text()).expect("json");
    assert_eq!(standing_remaining(&standing), [4, 0]);
}

/// Credit 3 in the hour: the other instance admits at once, exactly 3.
async fn a_credit_admits_exactly_its_units_on_the_other_instance(
    instances: &Operated,
    authorized: &[(&str, &str)],
) {
    let credited = post(
        &instances.admin(0, "/clients/credit"),
        authorized,
        &credit_of_three(),
    )
    .await;
    assert_eq!(credited.status, 200, "{}", credited.text());
    let both: serde_json::Value = serde_json::from_str(&credited.text()).expect("json");
    assert_eq!(standing_remaining(&both["before"]), [4, 0]);
    assert_eq!(standing_remaining(&both["after"]), [4, 3]);
    let mut admitted = 0;
    for i in 0..6 {
        let answer = instances.ask(1 - i % 2).await;
        if answer.status == 200 {
            admitted += 1;
        } else {
            assert_eq!(answer.status, 429);
        }
    }
    assert_eq!(admitted, 3, "a credit of 3 admitted {admitted}");
}

/// Debit 1 of the day's 1 left: none left on either instance.
async fn a_debit_takes_the_days_last_unit(instances: &Operated, authorized: &[(&str, &str)]) {
    let debited = post(
        &instances.admin(1, "/clients/debit"),
        authorized,
        &format!(r#"{{ {ALICE}, "limit": "chat.1", "units": 1, "reason": "abuse" }}"#),
    )
    .await;
    assert_eq!(debited.status, 200, "{}", debited.text());
    let both: serde_json::Value = serde_json::from_str(&debited.text()).expect("json");
    assert_eq!(standing_remaining(&both["after"]), [0, 0]);
}

/// A reset of every limit: whole again on both.
async fn a_reset_makes_the_client_whole_on_both(instances: &Operated, authorized: &[(&str, &str)]) {
    let reset = post(
        &instances.admin(0, "/clients/reset"),
        authorized,
        &format!(r#"{{ {ALICE}, "reason": "new contract" }}"#),
    )
    .await;
    assert_eq!(reset.status, 200, "{}", reset.text());
    let first = instances.ask(1).await;
    assert_eq!((first.status.as_u16(), fields(&first).0), (200, 5));
    let second = instances.ask(0).await;
    assert_eq!((second.status.as_u16(), fields(&second).0), (200, 4));
}

/// On the fixed window a credit is a grant past the number: 8 left of
/// 10, 5 granted, 13 left; the readout shows the number, the grant in
/// force and what is used (the two less what remains), as the model of
/// the two limits says: 2 used of the day's 10 + 5, 2 of the hour's 6,
/// and each request takes at least one unit.
async fn a_credit_on_a_fixed_window_grants_past_the_limit(
    instances: &Operated,
    authorized: &[(&str, &str)],
) {
    let granted = post(
        &instances.admin(1, "/clients/credit"),
        authorized,
        &format!(r#"{{ {ALICE}, "limit": "chat.1", "units": 5, "reason": "goodwill" }}"#),
    )
    .await;
    assert_eq!(granted.status, 200, "{}", granted.text());
    let both: serde_json::Value = serde_json::from_str(&granted.text()).expect("json");
    assert_eq!(standing_remaining(&both["before"]), [8, 4]);
    assert_eq!(standing_remaining(&both["after"]), [13, 4]);
    for (when, granted) in [("before", [0, 0]), ("after", [5, 0])] {
        let standing = &both[when];
        assert_eq!(standing_field(standing, "limit"), [10, 6], "{when}");
        assert_eq!(standing_field(standing, "granted"), granted, "{when}");
        assert_eq!(standing_field(standing, "used"), [2, 2], "{when}");
        assert_eq!(
            standing_field(standing, "smallest_reservation"),
            [1, 1],
            "{when}"
        );
    }
}

/// A client the route would refuse, or a limit it does not have,
/// cannot be changed.
async fn an_unknown_client_or_limit_cannot_be_changed(
    instances: &Operated,
    authorized: &[(&str, &str)],
) {
    let nobody = post(
        &instances.admin(0, "/clients/reset"),
        authorized,
        r#"{ "route": "chat", "reason": "r" }"#,
    )
    .await;
    assert_eq!(nobody.status, 422, "{}", nobody.text());
    let unknown = post(
        &instances.admin(0, "/clients/reset"),
        authorized,
        &format!(r#"{{ {ALICE}, "limit": "chat.9", "reason": "r" }}"#),
    )
    .await;
    assert_eq!(unknown.status, 422, "{}", unknown.text());
}

/// The audit lines: who, what, why, before and after; never the key.
fn each_change_is_audited_without_the_key(logs: &[PathBuf]) {
    let audit: Vec<String> = logs
        .iter()
        .flat_map(|log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| {
                    l.contains("floodgate::audit") || l.contains("changed a client's counts")
                })
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    assert_eq!(audit.len(), 4, "{audit:#?}");
    for (line, (action, reason)) in audit
        .iter()
        .zip([("credit", "ticket 42"), ("reset", "new contract")])
    {
        assert!(line.contains(action) && line.contains(reason), "{line}");
    }
    assert!(
        audit
            .iter()
            .any(|l| l.contains("debit") && l.contains("abuse"))
    );
    for line in &audit {
        assert!(
            line.contains("dana") && line.contains("before") && line.contains("after"),
            "{line}"
        );
        assert!(
            !line.contains("alice"),
            "the client's key is in the audit log: {line}"
        );
    }
}

/// Where no token file is configured, changes are off.
async fn changes_are_off_without_a_token_file(
    redis: &TestRedis,
    prefix: &str,
    authorized: &[(&str, &str)],
) {
    let admin_port = support::free_port();
    let port = support::free_port();
    let path = Config::new()
        .redis(&redis.url, prefix)
        .listen_on(port)
        .admin_on(admin_port)
        .route(chat())
        .write("operators-off");
    let _off = support::FloodgateProcess::spawn(&path, port).await;
    let off = post(
        &format!("http://127.0.0.1:{admin_port}/clients/reset"),
        authorized,
        &format!(r#"{{ {ALICE}, "reason": "r" }}"#),
    )
    .await;
    assert_eq!(off.status, 403, "{}", off.text());
}

/// Operators on the admin listener: a change without the token is 401,
/// with another 403, and refused where no token file is configured;
/// reading a client's standing needs none. A credit, a debit and a reset
/// change the next decision exactly on both instances (a denial the other
/// instance remembered included), and each change writes an audit line
/// with its reason and the standing before and after, without the
/// client's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_credit_debit_and_reset_a_client_on_both_instances() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("operators");
    let dir = temp_dir("operators");
    std::fs::write(dir.join("admin-token"), format!("{OPERATOR_TOKEN}\n")).expect("write token");
    let instances = Operated::start(&redis, &prefix, &dir).await;
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let authorized = [("authorization", bearer.as_str()), ("x-operator", "dana")];

    spend_the_hour(&instances).await;
    a_change_needs_the_token_and_a_reason(&instances, &authorized).await;
    reading_needs_no_token_and_changes_nothing(&instances).await;
    a_credit_admits_exactly_its_units_on_the_other_instance(&instances, &authorized).await;
    a_debit_takes_the_days_last_unit(&instances, &authorized).await;
    a_reset_makes_the_client_whole_on_both(&instances, &authorized).await;
    a_credit_on_a_fixed_window_grants_past_the_limit(&instances, &authorized).await;
    an_unknown_client_or_limit_cannot_be_changed(&instances, &authorized).await;
    each_change_is_audited_without_the_key(&instances.logs);
    changes_are_off_without_a_token_file(&redis, &prefix, &authorized).await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Route `spent` on `/spent`: 5 an hour per `X-Key`.
fn five_an_hour() -> Route {
    Route::new("spent")
        .matching(r#"path_prefix = "/spent""#)
        .client(r#"from = "header", name = "X-Key", missing = "reject""#)
        .limits(r#"{ algorithm = "sliding_window", limit = 5, window = "1h" }"#)
}

/// What an operator does through the second instance.
#[derive(Clone, Copy, Debug)]
enum Change {
    Credit3,
    Reset,
}

/// Two instances on `store` with admin listeners taking changes; key
/// `k{n}` spends its hour, both refuse it (the second refusal on each from
/// memory), the operator changes its counts through the second instance,
/// and then requests alternate between the instances over kept-alive
/// connections: each admitted while the change left units, none refused
/// by a denial remembered from before it. 50 tries, a key each.
async fn a_change_ends_remembered_denials_on_both_instances(store: Config, change: Change) {
    let dir = temp_dir("operator-denials");
    std::fs::write(dir.join("admin-token"), format!("{OPERATOR_TOKEN}\n")).expect("write token");
    let toml = store
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("admin-token").display()
        ))
        .route(five_an_hour())
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let bearer = format!("Bearer {OPERATOR_TOKEN}");
    let authorized = [("authorization", bearer.as_str())];
    let http = TestClient::http1();
    // After the change: i1 i2 i1 i1 i2 i1, as many admitted as it left.
    let (order, expected): (&[usize], &[u16]) = match change {
        Change::Credit3 => (&[0, 1, 0, 0, 1], &[200, 200, 200, 429, 429]),
        Change::Reset => (&[0, 1, 0, 0, 1, 0], &[200, 200, 200, 200, 200, 429]),
    };
    for n in 0..50 {
        let key = format!("k{n}");
        let ask = |gate: usize| {
            let (http, url, key) = (http.clone(), gates[gate].url("/spent"), key.clone());
            async move { http.get(&url, &[("x-key", &key)]).await.status.as_u16() }
        };
        for i in 0..5 {
            assert_eq!(ask(i % 2).await, 200, "try {n}: request {i}");
        }
        for gate in [0, 1, 0, 1] {
            assert_eq!(ask(gate).await, 429, "try {n}: spent on instance {gate}");
        }
        let client =
            format!(r#""route": "spent", "client": {{ "headers": {{ "x-key": "{key}" }} }}"#);
        let (path, body) = match change {
            Change::Credit3 => (
                "/clients/credit",
                format!(r#"{{ {client}, "limit": "spent", "units": 3, "reason": "ticket" }}"#),
            ),
            Change::Reset => (
                "/clients/reset",
                format!(r#"{{ {client}, "reason": "contract" }}"#),
            ),
        };
        let changed = post(&gates[1].admin_url(path), &authorized, &body).await;
        assert_eq!(changed.status, 200, "try {n}: {}", changed.text());
        let mut answers = Vec::new();
        for &gate in order {
            answers.push(ask(gate).await);
        }
        assert_eq!(
            answers, expected,
            "try {n}: {change:?} through instance 2, then {order:?}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_or_reset_ends_remembered_denials_on_both_instances_on_one_redis() {
    let redis = TestRedis::start().await;
    for change in [Change::Credit3, Change::Reset] {
        let prefix = unique_prefix("operator-denials");
        a_change_ends_remembered_denials_on_both_instances(
            Config::new().redis(&redis.url, &prefix),
            change,
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credit_or_reset_ends_remembered_denials_on_both_instances_on_a_cluster() {
    let cluster = support::cluster::TestCluster::start().await;
    for change in [Change::Credit3, Change::Reset] {
        let prefix = unique_prefix("operator-denials-cluster");
        a_change_ends_remembered_denials_on_both_instances(
            Config::new().redis_cluster(&cluster.urls(), &prefix),
            change,
        )
        .await;
    }
}
