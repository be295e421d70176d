//! Who is asking and which route: a client cannot choose its own bucket,
//! reach a limited path through an unlimited route, or break key
//! construction; bad requests are refused before any limit is consulted.

mod support;

use std::collections::HashSet;
use std::time::Duration;

use floodgate::client::ClientId;
use floodgate::limit::redis::write_client;
use http::HeaderValue;
use proptest::prelude::*;
use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, TestClient, Upstream, first_answer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn limited(extra_server: &str, route: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
{extra_server}

[[routes]]
name = "api"
respond = {{ status = 200, body = "ok" }}
{route}
limits = [{{ algorithm = "sliding_log", limit = 2, window = "60s" }}]
"#
    )
}

/// Sends requests until one is denied; returns how many passed.
async fn admitted(gate: &Floodgate, headers: &[(&str, &str)]) -> usize {
    let client = TestClient::http1();
    let mut n = 0;
    while client.get(&gate.url("/"), headers).await.status == 200 {
        n += 1;
        assert!(n < 100, "never denied");
    }
    n
}

#[tokio::test]
async fn an_untrusted_peer_cannot_leave_its_bucket_by_forging_forwarded_for() {
    // 127.0.0.1 is not trusted: whatever it forwards, it is one client.
    let gate = Floodgate::start(&limited(
        r#"trusted_proxies = ["10.0.0.0/8"]"#,
        r#"client = { from = "forwarded_for" }"#,
    ))
    .await;
    let client = TestClient::http1();
    let mut statuses = Vec::new();
    for i in 0..6 {
        let forged = format!("198.51.100.{i}, 10.0.0.{i}");
        statuses.push(
            client
                .get(&gate.url("/"), &[("x-forwarded-for", &forged)])
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 429, 429, 429, 429]);
}

#[tokio::test]
async fn through_trusted_hops_the_real_client_is_counted() {
    // The peer (127.0.0.1) is a trusted proxy, as is 10.0.0.0/8 behind it.
    let gate = Floodgate::start(&limited(
        r#"trusted_proxies = ["127.0.0.1", "10.0.0.0/8"]"#,
        r#"client = { from = "forwarded_for" }"#,
    ))
    .await;
    // One hop: the client is the last entry.
    assert_eq!(
        admitted(&gate, &[("x-forwarded-for", "203.0.113.1")]).await,
        2
    );
    // Two hops: a trusted 10.x proxy in between; the client is behind it,
    // whatever it claimed further left.
    assert_eq!(
        admitted(
            &gate,
            &[("x-forwarded-for", "1.1.1.1, 203.0.113.2, 10.1.2.3")]
        )
        .await,
        2
    );
    assert_eq!(
        TestClient::http1()
            .get(
                &gate.url("/"),
                &[("x-forwarded-for", "9.9.9.9, 203.0.113.2, 10.9.9.9")]
            )
            .await
            .status,
        429,
        "the same client through another trusted proxy is still the same client"
    );
}

#[tokio::test]
async fn garbage_appended_by_a_trusted_proxy_creates_no_new_buckets() {
    let gate = Floodgate::start(&limited(
        r#"trusted_proxies = ["127.0.0.1"]"#,
        r#"client = { from = "forwarded_for" }"#,
    ))
    .await;
    let client = TestClient::http1();
    let mut statuses = Vec::new();
    for junk in [
        "nonsense",
        "999.1.1.1",
        "",
        "unknown",
        "1.2.3.4.5",
        "_hidden",
    ] {
        statuses.push(
            client
                .get(&gate.url("/"), &[("x-forwarded-for", junk)])
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(
        statuses,
        [200, 200, 429, 429, 429, 429],
        "junk fell back to the proxy's one bucket"
    );
}

#[tokio::test]
async fn header_ids_ignore_name_case_and_composite_ids_split_by_both_parts() {
    let gate = Floodgate::start(&limited(
        "",
        r#"client = { from = "composite", parts = ["header:X-Tenant", "remote_addr"] }"#,
    ))
    .await;
    assert_eq!(admitted(&gate, &[("x-tenant", "acme")]).await, 2);
    assert_eq!(
        admitted(&gate, &[("X-TENANT", "acme")]).await,
        0,
        "same tenant, other case"
    );
    assert_eq!(
        admitted(&gate, &[("x-tenant", "globex")]).await,
        2,
        "another tenant"
    );
}

#[tokio::test]
async fn exempt_networks_bypass_limits_and_are_counted() {
    // Exempt clients need not even send the header everyone else must.
    let gate = Floodgate::start(&limited(
        r#"exempt = ["127.0.0.0/8"]"#,
        r#"client = { from = "header", name = "X-Key", missing = "reject" }"#,
    ))
    .await;
    let client = TestClient::http1();
    for _ in 0..10 {
        let a = client.get(&gate.url("/"), &[]).await;
        assert_eq!(a.status, 200);
        assert!(
            a.header("ratelimit").is_none(),
            "exempt requests are not counted"
        );
    }
    let other = Floodgate::start(&limited("", r#"exempt = ["192.0.2.0/24"]"#)).await;
    assert_eq!(
        admitted(&other, &[]).await,
        2,
        "only the listed networks are exempt"
    );
}

#[tokio::test]
async fn path_tricks_all_meet_the_limited_route() {
    let toml = r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "login"
match = { path_prefix = "/login" }
respond = { status = 200, body = "login" }
limits = [{ algorithm = "sliding_log", limit = 1, window = "60s" }]

[[routes]]
name = "rest"
match = { path_prefix = "/" }
respond = { status = 200, body = "rest" }
"#;
    let gate = Floodgate::start(toml).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/login"), &[]).await.status, 200);
    for trick in [
        "/login",
        "//login",
        "///login/",
        "/./login",
        "/api/../login",
        "/api/%2e%2e/login",
        "/%6Cogin",
        "/%6c%6F%67%69%6e",
        "/login/",
        "/login?x=1",
        "/login;jsessionid=1",
        "/x/..;/login",
        "/a/b/c/../../../login",
    ] {
        let a = client.get(&gate.url(trick), &[]).await;
        assert_eq!(a.status, 429, "{trick} dodged the login limit");
    }
    // Encoded slashes and backslashes, which upstreams read differently,
    // are refused by default (`escaped_slashes`).
    for refused in ["/login%2Fadmin", "/login%5cadmin", "/x/..%2Flogin"] {
        let a = client.get(&gate.url(refused), &[]).await;
        assert_eq!(a.status, 400, "{refused}");
    }
    for other in ["/loginx", "/log/in", "/%4cogin2"] {
        let a = client.get(&gate.url(other), &[]).await;
        assert_eq!(
            (a.status.as_u16(), a.text().as_str()),
            (200, "rest"),
            "{other}"
        );
    }
}

#[tokio::test]
async fn hosts_match_without_case_and_ignore_the_port_unless_named() {
    let toml = r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "api"
match = { host = "api.example.com" }
respond = { status = 200, body = "api" }

[[routes]]
name = "rest"
respond = { status = 200, body = "rest" }
"#;
    let gate = Floodgate::start(toml).await;
    let client = TestClient::http1();
    for (host, body) in [
        ("api.example.com", "api"),
        ("API.Example.COM", "api"),
        ("api.example.com:8443", "api"),
        ("www.example.com", "rest"),
    ] {
        assert_eq!(
            client.get(&gate.url("/"), &[("host", host)]).await.text(),
            body,
            "{host}"
        );
    }
}

/// Sends raw bytes and returns the status line of the answer.
async fn raw(gate: &Floodgate, bytes: &[u8], pause: Duration) -> String {
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    s.write_all(bytes).await.expect("write");
    tokio::time::sleep(pause).await;
    let mut buf = vec![0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer, not silence")
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n])
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

#[tokio::test]
async fn malformed_and_oversized_requests_get_the_right_4xx() {
    let gate = Floodgate::start(
        "[server]\nlisten = \"127.0.0.1:0\"\nheader_read_timeout = \"300ms\"\n\
         [[routes]]\nname = \"a\"\nrespond = { status = 200 }\n",
    )
    .await;
    let mut many = b"GET / HTTP/1.1\r\nHost: x\r\n".to_vec();
    for i in 0..150 {
        many.extend(format!("X-H{i}: v\r\n").bytes());
    }
    many.extend(b"\r\n");
    assert_eq!(
        raw(&gate, &many, Duration::ZERO).await,
        "HTTP/1.1 431 Request Header Fields Too Large"
    );

    let mut big = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    big.extend(vec![b'a'; 100_000]);
    big.extend(b"\r\n\r\n");
    assert_eq!(
        raw(&gate, &big, Duration::ZERO).await,
        "HTTP/1.1 431 Request Header Fields Too Large"
    );

    let long = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(10_000));
    assert_eq!(
        raw(&gate, long.as_bytes(), Duration::ZERO).await,
        "HTTP/1.1 414 URI Too Long"
    );

    let slow = b"GET / HTTP/1.1\r\nHost: x\r\n";
    assert_eq!(
        raw(&gate, slow, Duration::from_millis(600)).await,
        "HTTP/1.1 408 Request Timeout"
    );

    for bad in [
        &b"\x01\x02garbage\r\n\r\n"[..],
        b"GET /a%zz HTTP/1.1\r\nHost: x\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    ] {
        assert_eq!(
            raw(&gate, bad, Duration::ZERO).await,
            "HTTP/1.1 400 Bad Request",
            "{bad:?}"
        );
    }
    assert_eq!(
        raw(
            &gate,
            b"CONNECT evil.com:443 HTTP/1.1\r\nHost: evil.com:443\r\n\r\n",
            Duration::ZERO
        )
        .await,
        "HTTP/1.1 405 Method Not Allowed"
    );
    // After all that, floodgate still serves.
    assert_eq!(
        TestClient::http1().get(&gate.url("/"), &[]).await.status,
        200
    );
}

/// One route to `upstream`, with a 300 ms `header_read_timeout`.
fn head_timeout_config(upstream: &Upstream) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nheader_read_timeout = \"300ms\"\n\
         [[routes]]\nname = \"a\"\nupstream = \"{}\"\n",
        upstream.url()
    )
}

#[tokio::test]
async fn the_head_timeout_ends_once_the_first_head_has_arrived() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&head_timeout_config(&upstream)).await;
    // The upstream answers well after the head timeout would have fired.
    assert_eq!(
        raw(
            &gate,
            b"GET /slow?ms=900 HTTP/1.1\r\nHost: x\r\n\r\n",
            Duration::ZERO
        )
        .await,
        "HTTP/1.1 200 OK"
    );
}

/// A keep-alive connection to `gate` that has had one request answered.
async fn served_once(gate: &Floodgate) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    assert_eq!(
        ask(&mut s, b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n").await,
        "HTTP/1.1 200 OK"
    );
    s
}

/// Sends `head` on a keep-alive connection and returns the answer's status
/// line.
async fn ask(s: &mut tokio::net::TcpStream, head: &[u8]) -> String {
    s.write_all(head).await.expect("write");
    status_line(s).await
}

/// Reads one answer's status line from a keep-alive connection.
async fn status_line(s: &mut tokio::net::TcpStream) -> String {
    first_answer(s)
        .await
        .lines()
        .next()
        .unwrap_or("")
        .to_owned()
}

/// Waits for floodgate to close `s`, and says how long that took.
async fn closed_after(s: &mut tokio::net::TcpStream) -> Duration {
    let start = std::time::Instant::now();
    let mut buf = vec![0u8; 4096];
    let read = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("the connection was left open");
    assert!(matches!(read, Ok(0)), "{read:?}");
    start.elapsed()
}

#[tokio::test]
async fn keep_alive_connections_close_once_idle_for_the_head_timeout() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&head_timeout_config(&upstream)).await;
    let mut s = served_once(&gate).await;
    // Idle for less than the timeout: still open.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(
        ask(&mut s, b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n").await,
        "HTTP/1.1 200 OK"
    );
    // A request that takes three timeouts is answered, on a connection that
    // has served requests before.
    assert_eq!(
        ask(&mut s, b"GET /slow?ms=900 HTTP/1.1\r\nHost: x\r\n\r\n").await,
        "HTTP/1.1 200 OK"
    );
    // Then idle: closed, but not before the timeout.
    let idle = closed_after(&mut s).await;
    assert!(idle >= Duration::from_millis(250), "closed after {idle:?}");

    // A connection dribbling its second head is closed too.
    let mut s = served_once(&gate).await;
    s.write_all(b"GET /two HTTP/1.1\r\nHo")
        .await
        .expect("write");
    closed_after(&mut s).await;
}

fn key_text(client: &ClientId) -> String {
    let mut s = String::new();
    write_client(&mut s, client, &floodgate::limit::redis::IdKey::new(None));
    s
}

/// Any bytes a header value may hold.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        prop::collection::vec(
            prop::sample::select(b"{}:|a1 \t./-_=+@~\x80\xff".to_vec()),
            0..80
        ),
    ]
    .prop_filter_map("not a header value", |bytes| {
        HeaderValue::from_bytes(&bytes).ok()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn no_header_value_breaks_the_hash_tag_or_grows_the_key(value in header_value()) {
        let text = key_text(&ClientId::header(value));
        prop_assert!(!text.contains('{') && !text.contains('}'), "{}", text);
        prop_assert!(text.len() <= 2 + 64, "{} bytes", text.len());
        prop_assert!(text.is_ascii());
    }

    #[test]
    fn different_clients_never_share_a_key(a in header_value(), b in header_value(), ip in any::<[u8; 4]>()) {
        let ids = [
            ClientId::header(&a),
            ClientId::header(&b),
            ClientId::Addr(ip.into()),
            ClientId::Composite(vec![ClientId::header(&a), ClientId::Addr(ip.into())].into()),
            ClientId::Composite(vec![ClientId::header(&b), ClientId::Addr(ip.into())].into()),
        ];
        let mut seen = HashSet::new();
        for id in &ids {
            let unique_ids = ids.iter().filter(|other| *other == id).count();
            let text = key_text(id);
            if seen.insert(text.clone()) {
                continue;
            }
            prop_assert!(unique_ids > 1, "{:?} shares the key {} with another client", id, text);
        }
    }
}

#[tokio::test]
async fn hostile_client_ids_get_their_own_buckets_in_redis() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("hostile");
    let toml = Config::new()
        .server(r#"on_long_client_id = "hash""#)
        .redis(&redis.url, &prefix)
        .route(
            Route::new("api")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key""#)
                .limit("sliding_log", 1, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let long = "k".repeat(8_000);
    let hostile = [
        "}",
        "{",
        "}{",
        ":",
        "a:b}",
        "{api:a:127.0.0.1}",
        "127.0.0.1",
        long.as_str(),
        "x y\tz",
    ];
    for value in hostile {
        assert_eq!(
            client.get(&gate.url("/"), &[("x-key", value)]).await.status,
            200,
            "{value:.20}"
        );
    }
    for value in hostile {
        assert_eq!(
            client.get(&gate.url("/"), &[("x-key", value)]).await.status,
            429,
            "{value:.20}"
        );
    }
    let keys = redis.keys(&format!("{prefix}:*")).await;
    assert_eq!(keys.len(), hostile.len(), "{keys:?}");
    for key in &keys {
        assert!(key.len() < 150, "{key}");
        let tag = &key[key.find('{').expect("hash tag")..];
        assert_eq!(tag.matches('{').count(), 1, "{key}");
        assert_eq!(tag.matches('}').count(), 1, "{key}");
    }
}

// === client ids in the store ===

/// floodgate counting `x-api-key` clients in `redis` under `prefix`, with
/// `id_secret` if given, an admin listener, and ids shown hashed.
fn keyed_in_redis(redis: &TestRedis, prefix: &str, id_secret: Option<&str>) -> String {
    let mut config = Config::new()
        .admin()
        .redis(&redis.url, prefix)
        .access_log(&[r#"format = "off""#, r#"client_id = "hash""#]);
    if let Some(secret) = id_secret {
        config = config.store(&format!("id_secret = \"{secret}\""));
    }
    config
        .route(
            Route::new("users-api")
                .respond("status = 200")
                .client(r#"from = "header", name = "x-api-key""#)
                .limit("fixed_window", 100, "1h"),
        )
        .toml()
}

/// Whoever can read the store cannot read an API key from it, and two
/// instances sharing an id secret name a client alike on `/clients/top`.
#[tokio::test]
async fn api_keys_are_not_stored_in_clear_and_instances_name_a_client_alike() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("ids-in-keys");
    let secret = "a shared secret of the instances";
    let toml = keyed_in_redis(&redis, &prefix, Some(secret));
    let (a, b) = (Floodgate::start(&toml).await, Floodgate::start(&toml).await);
    let client = TestClient::http1();
    for gate in [&a, &b] {
        for _ in 0..3 {
            let answer = client.get(&gate.url("/"), &[("x-api-key", "bob")]).await;
            assert_eq!(answer.status, 200);
        }
    }
    // Both counted in one bucket: six of a hundred.
    let answer = client.get(&a.url("/"), &[("x-api-key", "bob")]).await;
    assert!(
        answer.header("ratelimit").unwrap_or("").contains("r=93"),
        "{:?}",
        answer.headers
    );
    let keys = redis.keys(&format!("{prefix}*")).await;
    assert!(keys.len() >= 2, "{keys:?}");
    for key in &keys {
        assert!(!key.contains("bob"), "the API key is readable in {key}");
    }
    let mut conn = redis.connection().await;
    for key in keys.iter().filter(|k| !k.ends_with("id-secret-marker")) {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut conn)
            .await
            .expect("type");
        let dump: String = match kind.as_str() {
            "string" => redis::cmd("GET")
                .arg(key)
                .query_async(&mut conn)
                .await
                .expect("get"),
            "hash" => format!(
                "{:?}",
                redis::cmd("HGETALL")
                    .arg(key)
                    .query_async::<Vec<String>>(&mut conn)
                    .await
                    .expect("hgetall")
            ),
            _ => String::new(),
        };
        assert!(!dump.contains("bob"), "the API key is in {key}'s value");
    }
    let name = |json: serde_json::Value| json["routes"][0]["clients"][0]["client"].clone();
    let top_a = client.get(&a.admin_url("/clients/top"), &[]).await.json();
    let top_b = client.get(&b.admin_url("/clients/top"), &[]).await.json();
    assert!(name(top_a.clone()).is_string(), "{top_a}");
    assert_ne!(name(top_a.clone()), "bob");
    assert_eq!(name(top_a), name(top_b));
}

/// An instance whose id secret differs from the one the store's other
/// instances use would count every client apart: it refuses to start,
/// naming the setting.
#[tokio::test]
async fn an_instance_with_another_id_secret_refuses_to_start() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("ids-mismatch");
    let first = Floodgate::start(&keyed_in_redis(
        &redis,
        &prefix,
        Some("the first secret, long enough"),
    ))
    .await;
    let answer = TestClient::http1()
        .get(&first.url("/"), &[("x-api-key", "bob")])
        .await;
    assert_eq!(answer.status, 200);
    for other in [Some("another secret, long enough too"), None] {
        let e = Floodgate::start_refused(&keyed_in_redis(&redis, &prefix, other)).await;
        assert!(e.contains("id_secret"), "{e}");
    }
    first.stop().await.expect("stop");
}
