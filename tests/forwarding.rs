//! The forwarding headers tell the upstream the truth: a trusted proxy's
//! `X-Forwarded-For`, `-Proto` and `-Host` are passed on (the chain with the
//! proxy appended), anyone else's are replaced by what floodgate saw itself;
//! `preserve_host` forwards the client's `Host`; `forwarded` and `via` add
//! RFC 7239 `Forwarded` and `Via` for upstreams that read them.

mod support;

use support::config::{Config, Route};
use support::{Floodgate, TestClient, Upstream};

/// What the upstream saw of a GET carrying the usual forwarding headers,
/// sent through floodgate whose `trusted_proxies` are `trusted`.
async fn seen_through(
    trusted: &str,
    proto: &str,
) -> (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
) {
    let upstream = Upstream::start().await;
    let toml = Config::new()
        .server(&format!("trusted_proxies = [{trusted}]"))
        .route(Route::new("all").upstream(&upstream.url()))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let answer = TestClient::http1()
        .get(
            &gate.url("/x"),
            &[
                ("host", "api.example.com"),
                ("x-forwarded-for", "203.0.113.5"),
                ("x-forwarded-proto", proto),
                ("x-forwarded-host", "public.example.com"),
            ],
        )
        .await;
    assert_eq!(answer.status, 200);
    (
        answer.echoed_header("x-forwarded-for"),
        answer.echoed_header("x-forwarded-proto"),
        answer.echoed_header("x-forwarded-host"),
        answer.echoed_header("host"),
    )
}

#[tokio::test]
async fn a_trusted_balancers_forwarding_headers_are_passed_on() {
    let (xff, proto, host, _) = seen_through(r#""127.0.0.1/32""#, "https").await;
    assert_eq!(xff.as_deref(), Some("203.0.113.5, 127.0.0.1"));
    assert_eq!(proto.as_deref(), Some("https"));
    assert_eq!(host.as_deref(), Some("public.example.com"));
}

#[tokio::test]
async fn an_untrusted_clients_forwarding_headers_never_reach_the_upstream() {
    let (xff, proto, host, _) = seen_through(r#""10.0.0.0/8""#, "https").await;
    assert_eq!(xff.as_deref(), Some("127.0.0.1"));
    assert_eq!(proto.as_deref(), Some("http"));
    assert_eq!(host.as_deref(), Some("api.example.com"));
}

#[tokio::test]
async fn a_trusted_proxys_proto_is_believed_only_when_it_is_http_or_https() {
    let (_, proto, _, _) = seen_through(r#""127.0.0.1/32""#, "javascript").await;
    assert_eq!(proto.as_deref(), Some("http"));
}

#[tokio::test]
async fn preserve_host_forwards_the_clients_host() {
    let upstream = Upstream::start().await;
    let toml = Config::new()
        .upstream(
            "keeps",
            &[
                &format!(r#"url = "{}""#, upstream.url()),
                "preserve_host = true",
            ],
        )
        .route(
            Route::new("keeps")
                .matching(r#"path_prefix = "/keeps""#)
                .upstream("keeps"),
        )
        .route(Route::new("rest").upstream(&upstream.url()))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let kept = client
        .get(&gate.url("/keeps/x"), &[("host", "api.example.com")])
        .await;
    assert_eq!(
        kept.echoed_header("host").as_deref(),
        Some("api.example.com")
    );
    let replaced = client
        .get(&gate.url("/rest"), &[("host", "api.example.com")])
        .await;
    assert_eq!(
        replaced.echoed_header("host"),
        Some(upstream.addr.to_string())
    );
    assert_eq!(
        replaced.echoed_header("x-forwarded-host").as_deref(),
        Some("api.example.com")
    );
}

/// Every value of `name` the upstream saw on its last request.
fn last_seen(upstream: &Upstream, name: &str) -> Vec<String> {
    let seen = upstream.seen();
    let last = seen.last().expect("the upstream saw a request");
    last.headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().expect("text").to_owned())
        .collect()
}

/// Through a floodgate trusting `trusted`, with an upstream that asks for
/// `Forwarded` and `Via` on `/tells` and one that does not elsewhere.
async fn gate_telling(upstream: &Upstream, trusted: &str) -> Floodgate {
    let toml = Config::new()
        .server(&format!("trusted_proxies = [{trusted}]"))
        .upstream(
            "tells",
            &[
                &format!(r#"url = "{}""#, upstream.url()),
                "forwarded = true",
                "via = true",
            ],
        )
        .route(
            Route::new("tells")
                .matching(r#"path_prefix = "/tells""#)
                .upstream("tells"),
        )
        .route(Route::new("rest").upstream(&upstream.url()))
        .toml();
    Floodgate::start(&toml).await
}

const CLIENT_SAYS: [(&str, &str); 3] = [
    ("host", "api.example.com"),
    ("forwarded", "for=203.0.113.5;proto=https"),
    ("via", "1.1 corp-proxy"),
];

#[tokio::test]
async fn forwarded_and_via_are_added_where_asked_and_an_untrusted_forwarded_is_dropped() {
    let upstream = Upstream::start().await;
    let gate = gate_telling(&upstream, r#""10.0.0.0/8""#).await;
    let client = TestClient::http1();

    let answer = client.get(&gate.url("/tells/x"), &CLIENT_SAYS).await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        last_seen(&upstream, "forwarded"),
        [r#"for=127.0.0.1;proto=http;host="api.example.com""#]
    );
    assert_eq!(
        last_seen(&upstream, "via"),
        ["1.1 corp-proxy", "1.1 floodgate"]
    );
    assert_eq!(answer.header("via"), Some("1.1 floodgate"));

    // Off by default; an untrusted client's Forwarded is dropped all the
    // same, while Via (a list of hops, not a claim) passes.
    let answer = client.get(&gate.url("/other"), &CLIENT_SAYS).await;
    assert_eq!(answer.status, 200);
    assert!(last_seen(&upstream, "forwarded").is_empty());
    assert_eq!(last_seen(&upstream, "via"), ["1.1 corp-proxy"]);
    assert_eq!(answer.header("via"), None);
}

#[tokio::test]
async fn a_trusted_proxys_forwarded_elements_stay_ahead_of_floodgates() {
    let upstream = Upstream::start().await;
    let gate = gate_telling(&upstream, r#""127.0.0.1/32""#).await;
    let client = TestClient::http1();
    client.get(&gate.url("/tells/x"), &CLIENT_SAYS).await;
    assert_eq!(
        last_seen(&upstream, "forwarded"),
        [
            "for=203.0.113.5;proto=https",
            r#"for=127.0.0.1;proto=http;host="api.example.com""#
        ]
    );
    client.get(&gate.url("/other"), &CLIENT_SAYS).await;
    assert_eq!(
        last_seen(&upstream, "forwarded"),
        ["for=203.0.113.5;proto=https"]
    );
}

/// Every header a framework may read as who the client is, with the value
/// a client would forge.
const CLAIMS: [(&str, &str); 8] = [
    ("x-forwarded-port", "8443"),
    ("x-forwarded-prefix", "/evil"),
    ("x-forwarded-server", "evil"),
    ("x-forwarded-ssl", "on"),
    ("x-real-ip", "203.0.113.9"),
    ("true-client-ip", "203.0.113.9"),
    ("x-client-ip", "203.0.113.9"),
    ("x-user-id", "admin"),
];

/// What a recording upstream received of a GET carrying [`CLAIMS`], sent
/// through floodgate trusting `trusted`, which strips `X-User-Id` from
/// untrusted peers as the operator asks.
async fn claims_seen_through(trusted: &str) -> http::HeaderMap {
    let upstream = Upstream::start().await;
    let toml = Config::new()
        .server(&format!("trusted_proxies = [{trusted}]"))
        .server(r#"strip_untrusted_headers = ["X-User-Id"]"#)
        .route(Route::new("all").upstream(&upstream.url()))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let answer = TestClient::http1().get(&gate.url("/x"), &CLAIMS).await;
    assert_eq!(answer.status, 200);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1);
    seen[0].headers.clone()
}

#[tokio::test]
async fn an_untrusted_clients_claims_about_itself_never_reach_the_upstream() {
    let headers = claims_seen_through(r#""10.0.0.0/8""#).await;
    for (name, _) in CLAIMS {
        assert!(
            headers.get(name).is_none(),
            "{name} reached the upstream from an untrusted peer: {headers:?}"
        );
    }
    // Floodgate's own account is there.
    assert_eq!(
        headers.get("x-forwarded-for").and_then(|v| v.to_str().ok()),
        Some("127.0.0.1")
    );
    assert!(headers.get("x-forwarded-proto").is_some());
}

#[tokio::test]
async fn a_trusted_proxys_claims_about_the_client_are_passed_on() {
    let headers = claims_seen_through(r#""127.0.0.1/32""#).await;
    for (name, value) in CLAIMS {
        assert_eq!(
            headers.get(name).and_then(|v| v.to_str().ok()),
            Some(value),
            "{name} from a trusted proxy: {headers:?}"
        );
    }
}

/// `strip_prefix` takes a leading path off before forwarding, at a
/// segment boundary, keeping the query; the limit still counts the path
/// as the client sent it.
#[tokio::test]
async fn strip_prefix_forwards_the_rest_of_the_path() {
    let upstream = Upstream::start().await;
    let toml = Config::new()
        .route(
            Route::new("api")
                .matching(r#"path_prefix = "/api""#)
                .upstream(&upstream.url())
                .line(r#"strip_prefix = "/api""#)
                .limit("fixed_window", 100, "1h"),
        )
        .route(Route::new("rest").upstream(&upstream.url()))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    for (sent, seen) in [
        ("/api/v1/x", "/v1/x"),
        ("/api/v1/x?page=2&q=a%20b", "/v1/x?page=2&q=a%20b"),
        ("/api", "/"),
        ("/api/", "/"),
        ("/api?x=1", "/?x=1"),
        ("/apiary/v1", "/apiary/v1"),
        ("/other/api/v1", "/other/api/v1"),
    ] {
        let answer = client.get(&gate.url(sent), &[]).await;
        assert_eq!(answer.status, 200, "{sent}");
        assert_eq!(answer.json()["uri"], seen, "{sent}");
    }
}

/// A `strip_prefix` that some of the route's requests would not start
/// with is refused at load.
#[test]
fn a_strip_prefix_the_route_does_not_begin_with_is_refused() {
    let toml = Config::new()
        .route(
            Route::new("api")
                .matching(r#"path_prefix = "/api""#)
                .upstream("http://127.0.0.1:9")
                .line(r#"strip_prefix = "/v1""#),
        )
        .toml();
    let e = floodgate::config::parse(std::path::Path::new("t.toml"), &toml)
        .expect_err("refused")
        .to_string();
    assert!(e.contains("strip_prefix \"/v1\""), "{e}");
}
