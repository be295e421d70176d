//! floodgate beside the proxy an operator already runs: its decision
//! listener asked by real nginx (`auth_request`) and real Caddy
//! (`forward_auth`) in front of a real upstream, counting in a real Redis.
//! Limits hold end to end, the decision's `RateLimit` fields and
//! `Retry-After` reach the client, the client is the address the front
//! proxy saw, and what a client or an unlisted peer says of the original
//! request is not believed.

mod support;

use std::net::IpAddr;

use support::config::{Config, Route};
use support::front::{FrontProxy, Raw, about_chat, get_from};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient, Upstream};

const CLIENT_A: [u8; 4] = [127, 0, 0, 3];
const CLIENT_B: [u8; 4] = [127, 0, 0, 4];
/// Not in `decision_peers`.
const STRANGER: [u8; 4] = [127, 0, 0, 2];

fn ip(octets: [u8; 4]) -> IpAddr {
    IpAddr::from(octets)
}

/// A decision listener believing 127.0.0.1 (where the front proxies
/// connect from); `/api` decided only (3 an hour per client address, an
/// exact sliding log), `/health` unlimited.
fn decisions(redis: &TestRedis, prefix: &str, limit: u64) -> Config {
    Config::new()
        .redis(&redis.url, prefix)
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .admin()
        .route(
            Route::new("api")
                .decided_only()
                .matching(r#"path_prefix = "/api""#)
                .limit("sliding_log", limit, "1h"),
        )
        .route(
            Route::new("health")
                .decided_only()
                .matching(r#"path_prefix = "/health""#),
        )
}

/// What a client that spoofs the original request and its address sends:
/// neither may change what is decided.
const SPOOFED: &[(&str, &str)] = &[
    ("X-Forwarded-For", "198.51.100.1"),
    ("X-Original-URI", "/health"),
    ("X-Forwarded-Uri", "/health"),
    ("X-Original-Method", "OPTIONS"),
];

/// Four requests each from two addresses through `port`: three admitted
/// with the decision's fields, the fourth the 429 with `Retry-After`.
async fn two_clients_through(port: u16, proxy: &FrontProxy) -> Vec<Raw> {
    let mut answers = Vec::new();
    for client in [CLIENT_A, CLIENT_B] {
        for i in 0..4u64 {
            let answer = get_from(ip(client), port, &format!("/api/chat?n={i}"), SPOOFED).await;
            let expected = if i < 3 { 200 } else { 429 };
            assert_eq!(
                answer.status,
                expected,
                "request {i} from {client:?}: {answer:?}\n{}",
                proxy.log()
            );
            let ratelimit = answer
                .header("ratelimit")
                .unwrap_or_else(|| panic!("no RateLimit on {answer:?}"));
            assert!(
                ratelimit.starts_with(&format!("\"api\";r={};t=", 2u64.saturating_sub(i))),
                "request {i}: RateLimit {ratelimit:?}"
            );
            assert_eq!(
                answer.header("ratelimit-policy"),
                Some("\"api\";q=3;w=3600"),
                "request {i}"
            );
            if i == 3 {
                let retry: u64 = answer
                    .header("retry-after")
                    .and_then(|r| r.parse().ok())
                    .unwrap_or_else(|| panic!("no Retry-After on {answer:?}"));
                assert!((3_590..=3_600).contains(&retry), "Retry-After {retry}");
            }
            answers.push(answer);
        }
    }
    answers
}

/// The upstream saw the admitted requests and nothing else, as sent.
fn upstream_saw_the_admitted(upstream: &Upstream) {
    let seen = upstream.seen();
    let targets: Vec<&str> = seen.iter().map(|s| s.target.as_str()).collect();
    assert_eq!(
        targets,
        [
            "/api/chat?n=0",
            "/api/chat?n=1",
            "/api/chat?n=2",
            "/api/chat?n=0",
            "/api/chat?n=1",
            "/api/chat?n=2"
        ]
    );
    assert!(seen.iter().all(|s| s.method == "GET"));
}

#[tokio::test]
async fn nginx_auth_request_limits_each_address_it_saw_and_passes_the_fields_on() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("nginx-decisions");
    let gate = Floodgate::start(&decisions(&redis, &prefix, 3).toml()).await;
    let upstream = Upstream::start().await;
    let decision = gate.decisions.expect("decision listener");
    let nginx = FrontProxy::nginx(&[decision], upstream.addr).await;
    two_clients_through(nginx.port, &nginx).await;
    upstream_saw_the_admitted(&upstream);
    // Counted per address nginx saw, not per the spoofed X-Forwarded-For:
    // two keys of three units.
    let keys = format!("{prefix}:{{api:*}}:0:sliding_log:*");
    assert_eq!(redis.logged_each(&keys).await, [3, 3]);
    // An unlimited route passes with nothing counted and no fields.
    let health = get_from(ip(CLIENT_A), nginx.port, "/health", &[]).await;
    assert_eq!(health.status, 200, "{health:?}");
    assert_eq!(health.header("ratelimit"), None, "{health:?}");
    assert_eq!(upstream.hits(), 7);
}

#[tokio::test]
async fn caddy_forward_auth_limits_each_address_it_saw_and_passes_floodgates_429_on() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("caddy-decisions");
    let gate = Floodgate::start(&decisions(&redis, &prefix, 3).toml()).await;
    let upstream = Upstream::start().await;
    let decision = gate.decisions.expect("decision listener");
    let caddy = FrontProxy::caddy(decision, upstream.addr).await;
    let answers = two_clients_through(caddy.port, &caddy).await;
    // Caddy hands floodgate's own refusal to the client: its problem body.
    let refused = &answers[3];
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json")
    );
    assert!(refused.body.contains("\"status\":429"), "{}", refused.body);
    upstream_saw_the_admitted(&upstream);
    let keys = format!("{prefix}:{{api:*}}:0:sliding_log:*");
    assert_eq!(redis.logged_each(&keys).await, [3, 3]);
}

#[tokio::test]
async fn a_peer_not_listed_is_decided_as_itself_and_a_listed_one_cannot_be_ambiguous() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("stranger");
    let gate = Floodgate::start(&decisions(&redis, &prefix, 3).toml()).await;
    let decision = gate.decisions.expect("decision listener").port();
    // From an address not in decision_peers: the request line and the
    // connection's address are decided; the forwarded fields are not read.
    for i in 0..4u64 {
        let answer = get_from(ip(STRANGER), decision, "/api/x", SPOOFED).await;
        assert_eq!(answer.status, if i < 3 { 200 } else { 429 }, "{answer:?}");
    }
    let keys = format!("{prefix}:{{api:*}}:0:sliding_log:*");
    assert_eq!(redis.logged_each(&keys).await, [3]);
    // Counted as its own address, not the X-Forwarded-For it sent: another
    // unlisted peer sending the same has a count of its own.
    let other = get_from(ip([127, 0, 0, 6]), decision, "/api/x", SPOOFED).await;
    assert_eq!(other.status, 200, "{other:?}");
    assert_eq!(redis.logged_each(&keys).await, [1, 3]);
    // A listed peer passing both names of the target: refused, nothing
    // counted.
    let ambiguous = get_from(
        ip([127, 0, 0, 1]),
        decision,
        "/_floodgate",
        &[
            ("X-Original-URI", "/health"),
            ("X-Forwarded-Uri", "/api/x"),
            ("X-Forwarded-For", "203.0.113.5"),
        ],
    )
    .await;
    assert_eq!(ambiguous.status, 400, "{ambiguous:?}");
    assert!(ambiguous.body.contains("both"), "{}", ambiguous.body);
    // A listed peer that says nothing of the client: refused.
    let anonymous = get_from(
        ip([127, 0, 0, 1]),
        decision,
        "/_floodgate",
        &[("X-Original-URI", "/api/x")],
    )
    .await;
    assert_eq!(anonymous.status, 400, "{anonymous:?}");
    // Described properly, the same client is decided on /api by its address.
    let described = get_from(
        ip([127, 0, 0, 1]),
        decision,
        "/_floodgate",
        &[
            ("X-Original-URI", "/api/y"),
            ("X-Forwarded-For", "203.0.113.5"),
        ],
    )
    .await;
    assert_eq!(described.status, 200, "{described:?}");
    assert_eq!(redis.logged_each(&keys).await, [1, 1, 3]);
    // The proxy listener does not serve a route that is only decided:
    // 404, nothing counted.
    let http = TestClient::http1();
    let direct = http.get(&gate.url("/api/x"), &[]).await;
    assert_eq!(direct.status.as_u16(), 404);
    assert_eq!(redis.logged_each(&keys).await, [1, 1, 3]);
}

#[tokio::test]
async fn two_decision_instances_behind_nginx_share_one_count_exactly() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("two-deciders");
    let config = decisions(&redis, &prefix, 10).toml();
    let (one, two) = (
        Floodgate::start(&config).await,
        Floodgate::start(&config).await,
    );
    let upstream = Upstream::start().await;
    let nginx = FrontProxy::nginx(
        &[
            one.decisions.expect("decisions"),
            two.decisions.expect("decisions"),
        ],
        upstream.addr,
    )
    .await;
    // 30 requests from one address, ten at a time.
    let mut statuses = Vec::new();
    for _ in 0..3 {
        let round: Vec<_> = (0..10)
            .map(|i| {
                let port = nginx.port;
                tokio::spawn(async move {
                    get_from(ip(CLIENT_A), port, &format!("/api/x?i={i}"), &[])
                        .await
                        .status
                })
            })
            .collect();
        for task in round {
            statuses.push(task.await.expect("request"));
        }
    }
    let admitted = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(
        (admitted, refused),
        (10, 20),
        "{statuses:?}\n{}",
        nginx.log()
    );
    assert_eq!(upstream.hits(), 10);
    // Both instances decided: nginx spreads its questions over them.
    let http = TestClient::http1();
    for gate in [&one, &two] {
        let metrics = http.get(&gate.admin_url("/metrics"), &[]).await.text();
        let decided: f64 = metrics
            .lines()
            .filter(|l| l.starts_with("floodgate_requests_total{") && l.contains("route=\"api\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(decided >= 5.0, "an instance decided {decided} of 30");
    }
}

/// A metered route only decided: each request reserves what it names in
/// `X-Max-Units` (100 when it names none), and its answer reports what
/// it used in `X-Units-Used`; 1 000 units an hour per address.
fn metered(redis: &TestRedis, prefix: &str) -> Config {
    Config::new()
        .redis(&redis.url, prefix)
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .route(
            Route::new("chat")
                .decided_only()
                .matching(r#"path_prefix = "/chat""#)
                .limit("fixed_window", 1_000, "1h")
                .line(r#"usage = { reserve = 100, reserve_header = "x-max-units", max_reserve = 500, report = "header", units = { "x-units-used" = 1 } }"#),
        )
}

#[tokio::test]
async fn a_reservation_named_back_with_the_units_used_is_settled_in_its_keys() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("settle");
    let gate = Floodgate::start(&metered(&redis, &prefix).toml()).await;
    let decision = gate.decisions.expect("decision listener").port();
    // Admitted with 300 reserved: its reservation, to name back.
    let admitted = about_chat(decision, &[("X-Max-Units", "300")]).await;
    assert_eq!(admitted.status, 200, "{admitted:?}");
    assert!(
        admitted
            .header("ratelimit")
            .is_some_and(|r| r.contains("r=700")),
        "{admitted:?}"
    );
    let token = admitted
        .header("floodgate-reservation")
        .unwrap_or_else(|| panic!("no reservation on {admitted:?}"))
        .to_owned();
    assert!(
        token.starts_with("chat:") && token.ends_with(":300"),
        "{token}"
    );
    // The answer used 120: settled, 180 given back.
    let settled = about_chat(
        decision,
        &[("Floodgate-Settle", &token), ("X-Units-Used", "120")],
    )
    .await;
    assert_eq!(settled.status, 200, "{settled:?}");
    assert!(
        settled
            .header("ratelimit")
            .is_some_and(|r| r.contains("r=880")),
        "{settled:?}"
    );
    // Another decision sees the settled count.
    let next = about_chat(decision, &[("X-Max-Units", "1")]).await;
    assert!(
        next.header("ratelimit")
            .is_some_and(|r| r.contains("r=879")),
        "{next:?}"
    );
    // A settlement without the report: refused, the reservation stands.
    let held = about_chat(decision, &[("X-Max-Units", "200")]).await;
    let token = held
        .header("floodgate-reservation")
        .unwrap_or_default()
        .to_owned();
    let unreported = about_chat(decision, &[("Floodgate-Settle", &token)]).await;
    assert_eq!(unreported.status, 422, "{unreported:?}");
    let after = about_chat(decision, &[("X-Max-Units", "1")]).await;
    assert!(
        after
            .header("ratelimit")
            .is_some_and(|r| r.contains("r=678")),
        "{after:?}"
    );
    // Only a listed peer may settle; a token that is not one is a 400.
    let stranger = get_from(
        ip(STRANGER),
        decision,
        "/chat",
        &[("Floodgate-Settle", &token), ("X-Units-Used", "0")],
    )
    .await;
    assert_eq!(stranger.status, 403, "{stranger:?}");
    let forged = about_chat(
        decision,
        &[("Floodgate-Settle", "chat:x:1"), ("X-Units-Used", "0")],
    )
    .await;
    assert_eq!(forged.status, 400, "{forged:?}");
    let elsewhere = about_chat(
        decision,
        &[("Floodgate-Settle", "other:1:1"), ("X-Units-Used", "0")],
    )
    .await;
    assert_eq!(elsewhere.status, 409, "{elsewhere:?}");
    let final_count = about_chat(decision, &[("X-Max-Units", "1")]).await;
    assert!(
        final_count
            .header("ratelimit")
            .is_some_and(|r| r.contains("r=677")),
        "nothing given back by the refused settlements: {final_count:?}"
    );
}

#[tokio::test]
async fn nginx_names_each_reservation_back_with_the_units_its_upstream_reported() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("nginx-settle");
    let config = metered(&redis, &prefix)
        .route(
            Route::new("units")
                .decided_only()
                .matching(r#"path_prefix = "/units""#)
                .limit("fixed_window", 1_000, "1h")
                .line(r#"usage = { reserve = 300, report = "header", units = { "x-units-used" = 1 } }"#),
        )
        .toml();
    let gate = Floodgate::start(&config).await;
    let upstream = Upstream::start().await;
    let nginx =
        FrontProxy::nginx_settling(&[gate.decisions.expect("decisions")], upstream.addr).await;
    // Each request reserves 300 and its answer reports 120: after three
    // settled, the fourth sees 1 000 - 3 x 120 - 300 remaining.
    let mut last = None;
    for i in 0..4 {
        let answer = get_from(ip(CLIENT_A), nginx.port, "/units?n=120", &[]).await;
        assert_eq!(
            answer.status,
            200,
            "request {i}: {answer:?}\n{}",
            nginx.log()
        );
        last = answer.header("ratelimit").map(str::to_owned);
        // The settlement follows the answer: wait for it to land (each
        // settles 180 back) before the next request is decided.
        let settled_to = 1_000 - 120 * (i + 1);
        let mut seen = 0;
        for _ in 0..200 {
            let probe = about_units(&gate).await;
            seen = probe;
            if probe == settled_to {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        assert_eq!(seen, settled_to, "request {i} settled\n{}", nginx.log());
    }
    assert_eq!(
        last.as_deref().map(|r| r.contains("r=340")),
        Some(true),
        "{last:?}"
    );
}

/// What the `units` route has left for the client 127.0.0.3, read as a
/// decision of nothing would: a settlement of 0 units named on a
/// reservation of 0 (consuming and giving back nothing).
async fn about_units(gate: &Floodgate) -> u64 {
    let decision = gate.decisions.expect("decisions").port();
    let answer = get_from(
        ip([127, 0, 0, 1]),
        decision,
        "/_floodgate",
        &[
            ("X-Original-URI", "/units"),
            ("X-Forwarded-For", "127.0.0.3"),
            ("Floodgate-Settle", "units:0:0"),
            ("X-Units-Used", "0"),
        ],
    )
    .await;
    answer
        .header("ratelimit")
        .and_then(|r| r.split("r=").nth(1))
        .and_then(|r| r.split(';').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no remaining in {answer:?}"))
}
