//! Limits the way API owners think of them, against a real floodgate and a
//! real Redis: tiers and per-client overrides, clients keyed by a verified
//! JWT claim, a path parameter or nothing at all (a global limit), API-key
//! exemptions, the deny answer and header modes, and the rate-limit fields
//! as draft-ietf-httpapi-ratelimit-headers-10 defines them.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _, RsaKeyPair};
use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Answer, Floodgate, TestClient, Upstream, temp_dir};

/// A route named `name` for the paths under `prefix`, forwarding to `upstream`.
fn on(name: &str, prefix: &str, upstream: &Upstream) -> Route {
    Route::new(name)
        .upstream(&upstream.url())
        .matching(&format!(r#"path_prefix = "{prefix}""#))
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Claims for `sub`, valid for an hour from now (or expired an hour ago).
fn claims(sub: &str, expired: bool) -> String {
    let exp = if expired { now() - 3600 } else { now() + 3600 };
    format!(r#"{{"sub":"{sub}","exp":{exp},"iss":"https://idp.example","aud":"orders"}}"#)
}

/// A JWT with `header` and `claims`, signed by `sign` over the JWS input.
fn token(header: &str, claims: &str, sign: impl FnOnce(&[u8]) -> Vec<u8>) -> String {
    let input = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
    let sig = sign(input.as_bytes());
    format!("{input}.{}", b64(&sig))
}

fn hs256(secret: &[u8]) -> impl FnOnce(&[u8]) -> Vec<u8> {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    move |input| ring::hmac::sign(&key, input).as_ref().to_vec()
}

async fn bearer(client: &TestClient, url: &str, token: &str) -> Answer {
    client
        .get(url, &[("authorization", &format!("Bearer {token}"))])
        .await
}

/// An RSA key pair made by openssl: the PKCS#1 private key (DER) and the
/// PEM public key's path.
fn rsa_key(dir: &Path) -> (Vec<u8>, std::path::PathBuf) {
    let der = dir.join("rsa.der");
    let pkcs1 = dir.join("rsa.pkcs1.der");
    let public = dir.join("rsa.pub.pem");
    let run = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .output()
            .expect("run openssl");
        assert!(out.status.success(), "{args:?}: {out:?}");
    };
    run(&[
        "genpkey",
        "-algorithm",
        "RSA",
        "-pkeyopt",
        "rsa_keygen_bits:2048",
        "-outform",
        "DER",
        "-out",
        der.to_str().unwrap_or_default(),
    ]);
    run(&[
        "pkey",
        "-inform",
        "DER",
        "-in",
        der.to_str().unwrap_or_default(),
        "-pubout",
        "-out",
        public.to_str().unwrap_or_default(),
    ]);
    run(&[
        "pkey",
        "-inform",
        "DER",
        "-in",
        der.to_str().unwrap_or_default(),
        "-traditional",
        "-outform",
        "DER",
        "-out",
        pkcs1.to_str().unwrap_or_default(),
    ]);
    (std::fs::read(&pkcs1).expect("read key"), public)
}

/// A new P-256 key pair, its public key written to `dir/jwks.json` as a
/// JWK Set under `kid` "k1".
fn ec_key(dir: &Path, rng: &SystemRandom) -> EcdsaKeyPair {
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, rng)
        .expect("ec key");
    let ec = EcdsaKeyPair::from_pkcs8(
        &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        pkcs8.as_ref(),
        rng,
    )
    .expect("ec pair");
    let point = ec.public_key().as_ref();
    let jwks = format!(
        r#"{{"keys":[{{"kty":"EC","crv":"P-256","kid":"k1","alg":"ES256","use":"sig","x":"{}","y":"{}"}}]}}"#,
        b64(&point[1..33]),
        b64(&point[33..65])
    );
    std::fs::write(dir.join("jwks.json"), jwks).expect("write jwks");
    ec
}

/// A Redis, an upstream for the routes, and a configuration counting in
/// that Redis under a fresh prefix named for `test`.
async fn setup(test: &str) -> (TestRedis, Upstream, Config) {
    let redis = TestRedis::start().await;
    let upstream = Upstream::start().await;
    let config = Config::new().redis(&redis.url, &unique_prefix(test));
    (redis, upstream, config)
}

#[tokio::test]
async fn a_free_and_a_paid_tier_share_one_path() {
    let (_redis, upstream, config) = setup("tiers").await;
    let key = r#"client = { from = "header", name = "X-Api-Key", missing = "reject" }"#;
    let toml = config
        // The plan header is set by the authenticating gateway in front.
        .route(
            Route::new("search-paid")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/search", headers = { "X-Plan" = "paid" }"#)
                .line(key)
                .limit("sliding_log", 5, "60s"),
        )
        .route(
            on("search-free", "/search", &upstream)
                .line(key)
                .limit("sliding_log", 2, "60s")
                // One partner's key is worth more, named by its SHA-256 so
                // the file does not hold it.
                .line(&format!(
                    r#"overrides = [{{ clients = ["sha256:{}"], limits = [{{ algorithm = "sliding_log", limit = 4, window = "60s" }}] }}, {{ headers = {{ "X-Trial" = {{ regex = "^2026-" }} }}, limits = [{{ algorithm = "sliding_log", limit = 3, window = "60s" }}] }}]"#,
                    hex_sha256(b"partner-key")
                )),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/search?q=x");
    let admitted = |headers: Vec<(&'static str, &'static str)>| {
        let client = client.clone();
        let url = url.clone();
        async move {
            let mut n = 0;
            for _ in 0..8 {
                let a = client.get(&url, &headers).await;
                match a.status.as_u16() {
                    200 => n += 1,
                    429 => {}
                    other => panic!("{other}: {}", a.text()),
                }
            }
            n
        }
    };
    assert_eq!(admitted(vec![("x-api-key", "free-1")]).await, 2);
    assert_eq!(
        admitted(vec![("x-api-key", "paid-1"), ("x-plan", "paid")]).await,
        5
    );
    assert_eq!(admitted(vec![("x-api-key", "partner-key")]).await, 4);
    assert_eq!(
        admitted(vec![("x-api-key", "trial-1"), ("x-trial", "2026-12")]).await,
        3
    );
    // Each tier tells its clients their own quota.
    let a = client
        .get(&url, &[("x-api-key", "paid-2"), ("x-plan", "paid")])
        .await;
    assert_eq!(
        a.header("ratelimit-policy"),
        Some("\"search-paid\";q=5;w=60")
    );
    let a = client.get(&url, &[("x-api-key", "partner-key")]).await;
    assert_eq!(
        a.header("ratelimit-policy"),
        Some("\"search-free\";q=4;w=60")
    );
    // A plan header sent twice matches no tier's value.
    let request = http::Request::get(&url)
        .header("x-api-key", "dup-1")
        .header("x-plan", "paid")
        .header("x-plan", "paid")
        .body(support::empty())
        .expect("request");
    let a = client.send(request).await;
    assert_eq!(
        a.header("ratelimit-policy"),
        Some("\"search-free\";q=2;w=60")
    );
}

fn hex_sha256(value: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, value)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The shared secret the HS256 route verifies with.
const JWT_SECRET: &[u8] = b"a-shared-secret-of-at-least-32-bytes!";

/// Signs tokens with the keys each JWT route was given: the HS256 secret,
/// the RSA key pair and the EC key published in the JWKS file.
struct Signers {
    rsa: RsaKeyPair,
    ec: EcdsaKeyPair,
    rng: SystemRandom,
}

impl Signers {
    /// Writes the secret, the RSA public key and the JWKS into `dir`, and
    /// returns the signers with the RSA public key's path.
    fn write_keys(dir: &Path) -> (Self, std::path::PathBuf) {
        std::fs::write(dir.join("secret"), JWT_SECRET).expect("write secret");
        let (rsa_der, rsa_pub) = rsa_key(dir);
        let rng = SystemRandom::new();
        let ec = ec_key(dir, &rng);
        let rsa = RsaKeyPair::from_der(&rsa_der).expect("rsa pair");
        (Self { rsa, ec, rng }, rsa_pub)
    }

    fn hs256(&self, claims: &str) -> String {
        token(r#"{"alg":"HS256"}"#, claims, hs256(JWT_SECRET))
    }

    fn rs256(&self, claims: &str) -> String {
        token(r#"{"alg":"RS256","typ":"JWT"}"#, claims, |input| {
            let mut sig = vec![0; self.rsa.public().modulus_len()];
            self.rsa
                .sign(&signature::RSA_PKCS1_SHA256, &self.rng, input, &mut sig)
                .expect("rsa sign");
            sig
        })
    }

    fn es256(&self, claims: &str) -> String {
        token(r#"{"alg":"ES256","kid":"k1"}"#, claims, |input| {
            self.ec
                .sign(&self.rng, input)
                .expect("ec sign")
                .as_ref()
                .to_vec()
        })
    }
}

/// Routes `/hs`, `/rs` and `/es`, each keyed by the `sub` of a token
/// verified with one algorithm, 2 requests a minute.
fn jwt_routes(config: Config, upstream: &Upstream, dir: &Path, rsa_pub: &Path) -> String {
    let jwt = |alg: &str, key: &str| {
        format!(
            r#"client = {{ from = "jwt", claim = "sub", algorithm = "{alg}", {key}, issuer = "https://idp.example", audience = "orders", missing = "reject" }}"#
        )
    };
    config
        .route(
            on("hs", "/hs", upstream)
                .line(&jwt(
                    "HS256",
                    &format!("secret_file = \"{}\"", dir.join("secret").display()),
                ))
                .limit("sliding_log", 2, "60s"),
        )
        .route(
            on("rs", "/rs", upstream)
                .line(&jwt(
                    "RS256",
                    &format!("key_file = \"{}\"", rsa_pub.display()),
                ))
                .limit("sliding_log", 2, "60s"),
        )
        .route(
            on("es", "/es", upstream)
                .line(&jwt(
                    "ES256",
                    &format!("jwks_file = \"{}\"", dir.join("jwks.json").display()),
                ))
                .limit("sliding_log", 2, "60s"),
        )
        .toml()
}

/// Valid tokens: each subject has its own two requests, whatever else the
/// token or the connection carries; an expired token is refused before it
/// is counted.
async fn each_subject_has_its_own_budget(gate: &Floodgate, client: &TestClient, keys: &Signers) {
    for (path, make) in [
        ("/hs", Signers::hs256 as fn(&Signers, &str) -> String),
        ("/rs", Signers::rs256),
        ("/es", Signers::es256),
    ] {
        let url = gate.url(path);
        for sub in ["alice", "bob"] {
            let statuses: Vec<u16> = {
                let mut out = Vec::new();
                for _ in 0..3 {
                    out.push(
                        bearer(client, &url, &make(keys, &claims(sub, false)))
                            .await
                            .status
                            .as_u16(),
                    );
                }
                out
            };
            assert_eq!(statuses, [200, 200, 429], "{path} {sub}");
        }
        // Expired: refused before it is counted.
        let a = bearer(client, &url, &make(keys, &claims("carol", true))).await;
        assert_eq!(a.problem().0, 401, "{path}");
        assert!(a.problem().1.contains("expired"), "{}", a.text());
    }
}

/// Wrong algorithm: an HS256 token "signed" with the RSA public key as its
/// secret (the classic confusion), and an unsigned one.
async fn tokens_of_another_algorithm_are_refused(
    gate: &Floodgate,
    client: &TestClient,
    rsa_pub: &Path,
) {
    let public_pem = std::fs::read(rsa_pub).expect("read public key");
    let confused = token(
        r#"{"alg":"HS256"}"#,
        &claims("mallory", false),
        hs256(&public_pem),
    );
    let a = bearer(client, &gate.url("/rs"), &confused).await;
    assert_eq!(a.problem().0, 401);
    assert!(a.problem().1.contains("algorithm"), "{}", a.text());
    let unsigned = format!(
        "{}.{}.",
        b64(br#"{"alg":"none"}"#),
        b64(claims("mallory", false).as_bytes())
    );
    assert_eq!(
        bearer(client, &gate.url("/hs"), &unsigned).await.status,
        401
    );
}

/// Forged: alice's claims re-signed with another secret, and a valid token
/// whose subject was edited after signing.
async fn forged_and_edited_tokens_are_refused(
    gate: &Floodgate,
    client: &TestClient,
    keys: &Signers,
) {
    let forged = token(
        r#"{"alg":"HS256"}"#,
        &claims("alice", false),
        hs256(b"not-the-secret-not-the-secret-not-it"),
    );
    let a = bearer(client, &gate.url("/hs"), &forged).await;
    assert_eq!(a.problem().0, 401);
    assert!(a.problem().1.contains("signature"), "{}", a.text());
    let genuine = keys.es256(&claims("dave", false));
    let mut parts: Vec<&str> = genuine.split('.').collect();
    let edited = b64(claims("eve", false).as_bytes());
    parts[1] = &edited;
    assert_eq!(
        bearer(client, &gate.url("/es"), &parts.join("."))
            .await
            .status,
        401
    );
}

#[tokio::test]
async fn clients_are_counted_by_a_verified_jwt_claim() {
    let (_redis, upstream, config) = setup("jwt").await;
    let dir = temp_dir("jwt-claims");
    let (keys, rsa_pub) = Signers::write_keys(&dir);
    let gate = Floodgate::start(&jwt_routes(config, &upstream, &dir, &rsa_pub)).await;
    let client = TestClient::http1();

    each_subject_has_its_own_budget(&gate, &client, &keys).await;
    tokens_of_another_algorithm_are_refused(&gate, &client, &rsa_pub).await;
    forged_and_edited_tokens_are_refused(&gate, &client, &keys).await;
    // No token at all.
    assert_eq!(client.get(&gate.url("/rs"), &[]).await.status, 401);
    assert_eq!(
        upstream.hits(),
        12,
        "only verified tokens reached the upstream"
    );
}

#[tokio::test]
async fn a_path_parameter_keys_the_limit() {
    let (_redis, upstream, config) = setup("path-param").await;
    let toml = config
        .route(
            Route::new("orders")
                .upstream(&upstream.url())
                .matching(r#"path = "/users/{id}/orders", methods = ["GET"]"#)
                .client(r#"from = "path", name = "id""#)
                .limit("fixed_window", 2, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let status = |path: &'static str| {
        let client = client.clone();
        let url = gate.url(path);
        async move { client.get(&url, &[]).await.status.as_u16() }
    };
    assert_eq!(status("/users/42/orders").await, 200);
    // The same user by another spelling of the same path.
    assert_eq!(status("/users/42/orders/").await, 200);
    assert_eq!(status("/users//42/./orders").await, 429);
    // Another user has a bucket of its own.
    assert_eq!(status("/users/7/orders").await, 200);
    // Paths the template does not match are not on the route.
    assert_eq!(status("/users/42/orders/1").await, 404);
    assert_eq!(status("/users/42").await, 404);
    assert_eq!(upstream.hits(), 3);
}

#[tokio::test]
async fn a_global_limit_is_shared_by_every_client_and_instance() {
    let redis = TestRedis::start().await;
    let upstream = Upstream::start().await;
    let prefix = unique_prefix("global");
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(
            Route::new("export")
                .upstream(&upstream.url())
                .client(r#"from = "global""#)
                .limit("sliding_log", 6, "60s"),
        )
        .toml();
    let one = Floodgate::start(&toml).await;
    let two = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let mut admitted = 0;
    for i in 0..12 {
        let gate = if i % 2 == 0 { &one } else { &two };
        let key = format!("client-{i}");
        let a = client
            .get(&gate.url("/export"), &[("x-api-key", &key)])
            .await;
        if a.status == 200 {
            admitted += 1;
        } else {
            assert_eq!(a.status, 429);
        }
    }
    assert_eq!(admitted, 6);
    assert_eq!(upstream.hits(), 6);
    // One bucket, named for nobody: not the peer's address, which every
    // request here shares.
    let keys = redis.keys(&format!("{prefix}:*")).await;
    assert_eq!(keys, [format!("{prefix}:{{export:g}}:0:sliding_log:60000")]);
}

#[tokio::test]
async fn api_keys_exempt_their_holders_and_nobody_else() {
    let (_redis, upstream, config) = setup("exempt-keys").await;
    let toml = config
        .server(&format!(
            r#"exempt_keys = {{ "X-Monitor-Key" = ["sha256:{}"] }}"#,
            hex_sha256(b"monitor-secret")
        ))
        .route(
            Route::new("api")
                .upstream(&upstream.url())
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line(r#"exempt_keys = { "X-Api-Key" = ["internal-batch-key"] }"#)
                .limit("sliding_log", 1, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    for headers in [
        vec![("x-api-key", "internal-batch-key")],
        vec![("x-monitor-key", "monitor-secret")],
    ] {
        for _ in 0..5 {
            let a = client.get(&url, &headers).await;
            assert_eq!(a.status, 200, "{headers:?}");
            assert!(
                a.header("ratelimit").is_none(),
                "exempt requests are not counted"
            );
        }
    }
    // A wrong key, or the right one twice, exempts nobody.
    assert_eq!(
        client.get(&url, &[("x-api-key", "guess")]).await.status,
        200
    );
    assert_eq!(
        client.get(&url, &[("x-api-key", "guess")]).await.status,
        429
    );
    let a = client
        .get(&url, &[("x-api-key", "guess"), ("x-monitor-key", "wrong")])
        .await;
    assert_eq!(a.status, 429);
    let request = http::Request::get(&url)
        .header("x-monitor-key", "monitor-secret")
        .header("x-monitor-key", "monitor-secret")
        .header("x-api-key", "guess")
        .body(support::empty())
        .expect("request");
    assert_eq!(client.send(request).await.status, 429);
}

#[tokio::test]
async fn the_deny_answer_and_every_header_mode() {
    let (_redis, upstream, mut config) = setup("deny-answer").await;
    for mode in ["ietf", "x-ratelimit", "both", "none"] {
        config = config.route(
            on(mode, &format!("/{mode}"), &upstream)
                .line(&format!(r#"rate_limit_headers = "{mode}""#))
                .line(
                    r#"deny = { status = 503, body = "{\"error\":\"slow down\"}", content_type = "application/json", headers = { "X-Reason" = "quota", "Cache-Control" = "no-store" } }"#,
                )
                .limit("sliding_log", 2, "60s"),
        );
    }
    let gate = Floodgate::start(&config.toml()).await;
    let client = TestClient::http1();
    for mode in ["ietf", "x-ratelimit", "both", "none"] {
        let url = gate.url(&format!("/{mode}"));
        let first = client.get(&url, &[]).await;
        assert_eq!(first.status, 200);
        let second = client.get(&url, &[]).await;
        let denied = client.get(&url, &[]).await;
        assert_eq!(denied.status, 503, "{mode}");
        assert_eq!(denied.text(), r#"{"error":"slow down"}"#);
        assert_eq!(denied.header("content-type"), Some("application/json"));
        assert_eq!(denied.header("x-reason"), Some("quota"));
        assert_eq!(denied.header("cache-control"), Some("no-store"));
        let retry: u64 = denied
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{mode}: Retry-After is always sent"));
        assert!((59..=60).contains(&retry), "{mode}: {retry}");
        let ietf = matches!(mode, "ietf" | "both");
        let x = matches!(mode, "x-ratelimit" | "both");
        for a in [&first, &second, &denied] {
            assert_eq!(a.header("ratelimit-policy").is_some(), ietf, "{mode}");
            assert_eq!(a.header("ratelimit").is_some(), ietf, "{mode}");
            assert_eq!(a.header("x-ratelimit-limit").is_some(), x, "{mode}");
        }
        if ietf {
            // t: until the oldest counted request (this one) leaves.
            assert_eq!(
                first.header("ratelimit"),
                Some(format!("\"{mode}\";r=1;t=60").as_str())
            );
            assert_eq!(
                denied.header("ratelimit"),
                Some(format!("\"{mode}\";r=0;t={retry}").as_str())
            );
        }
        if x {
            assert_eq!(first.header("x-ratelimit-limit"), Some("2"));
            assert_eq!(first.header("x-ratelimit-remaining"), Some("1"));
            assert_eq!(first.header("x-ratelimit-reset"), Some("60"));
            assert_eq!(denied.header("x-ratelimit-remaining"), Some("0"));
            assert_eq!(
                denied.header("x-ratelimit-reset"),
                Some(retry.to_string().as_str())
            );
        }
    }
}

#[tokio::test]
async fn a_deny_body_can_say_how_long_to_wait() {
    let (_redis, upstream, config) = setup("deny-wait").await;
    let gate = Floodgate::start(
        &config
            .route(
                on("wait", "/wait", &upstream)
                    .line(
                        r#"deny = { body = "{\"error\":{\"message\":\"Rate limit reached. Try again in {retry_after}s.\",\"type\":\"requests\"}}", content_type = "application/json" }"#,
                    )
                    .limit("sliding_log", 1, "1h"),
            )
            .toml(),
    )
    .await;
    let client = TestClient::http1();
    let url = gate.url("/wait");
    assert_eq!(client.get(&url, &[]).await.status, 200);
    let denied = client.get(&url, &[]).await;
    assert_eq!(denied.status, 429);
    let retry = denied.header("retry-after").unwrap_or_default().to_owned();
    assert!(
        retry.parse::<u64>().is_ok_and(|s| (1..=3600).contains(&s)),
        "{retry}"
    );
    let body = denied.json();
    assert_eq!(
        body["error"]["message"],
        format!("Rate limit reached. Try again in {retry}s.")
    );
}

/// `(r, t)` of a `RateLimit` value `"name";r=R;t=T`.
fn fields(a: &Answer) -> (u64, u64) {
    let value = a.header("ratelimit").unwrap_or_default();
    let number = |key: &str| {
        value
            .split(';')
            .find_map(|p| p.strip_prefix(key))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {value:?}"))
    };
    (number("r="), number("t="))
}

/// For every algorithm a route of 2 per 3 s and one of 10 per minute under
/// `/minute/`; a token bucket with a burst of 5; and routes costing 5 units
/// under `/five/`.
fn draft_10_routes(mut config: Config, upstream: &Upstream, algorithms: &[&str]) -> Config {
    for &algorithm in algorithms {
        config = config
            .route(on(algorithm, &format!("/{algorithm}"), upstream).limit(algorithm, 2, "3s"))
            .route(
                Route::new(&format!("{algorithm}-minute"))
                    .upstream(&upstream.url())
                    .matching(&format!(r#"path_prefix = "/minute/{algorithm}""#))
                    .limit(algorithm, 10, "60s"),
            );
    }
    config = config.route(
        on("burst", "/burst", upstream)
            .limits(r#"{ algorithm = "token_bucket", limit = 2, window = "60s", burst = 5 }"#),
    );
    for algorithm in ["token_bucket", "gcra", "sliding_log"] {
        config = config.route(
            Route::new(&format!("{algorithm}-five"))
                .upstream(&upstream.url())
                .matching(&format!(r#"path_prefix = "/five/{algorithm}""#))
                .line("cost = 5")
                .limit(algorithm, 10, "60s"),
        );
    }
    config
}

/// Seconds until the next unit is made available (draft -10's t) at 10 per
/// minute after `counted` requests, computed by hand. The window algorithms
/// depend on where in the aligned minute the request falls, read from this
/// machine's clock (the one Redis reads too).
fn t_by_hand_for_ten_a_minute(algorithm: &str, counted: u64) -> u64 {
    let minute = 60_000u64;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let to_end = minute - now % minute;
    let ms = match algorithm {
        // Until the window ends.
        "fixed_window" => to_end,
        // Until the oldest counted request leaves: sent just now.
        "sliding_log" => minute,
        // Nothing from the previous window: the count falls by a unit
        // once the next window has slid 1/counted of the way.
        "sliding_window" => to_end + (minute - (counted - 1) * minute / counted),
        // One unit is added every 6 s.
        _ => 6_000,
    };
    ms.div_ceil(1_000)
}

/// Units remaining: r counts down and t is still the time until the next
/// unit is made available (draft -10).
async fn r_counts_down_and_t_is_the_next_units_time(
    gate: &Floodgate,
    client: &TestClient,
    algorithms: &[&str],
) {
    for &algorithm in algorithms {
        let url = gate.url(&format!("/minute/{algorithm}"));
        for i in 0..5 {
            let a = client.get(&url, &[]).await;
            assert_eq!(a.status, 200);
            let (r, t) = fields(&a);
            assert_eq!(r, 9 - i, "{algorithm}");
            let want = t_by_hand_for_ten_a_minute(algorithm, i + 1);
            assert!(
                t.abs_diff(want) <= 1,
                "{algorithm}: after {} of 10, t={t}, by hand {want}",
                i + 1
            );
        }
    }
}

/// Requests of 5 units: t is the next unit's time whatever the cost, and a
/// denial's Retry-After is this request's own wait: longer than t for the
/// bucket algorithms (5 units at one every 6 s), equal to it for the log
/// (all 10 units leave together).
async fn a_costly_denial_waits_for_its_own_units(gate: &Floodgate, client: &TestClient) {
    for (algorithm, t, retry) in [
        ("token_bucket", 6, 30),
        ("gcra", 6, 30),
        ("sliding_log", 60, 60),
    ] {
        let url = gate.url(&format!("/five/{algorithm}"));
        let first = client.get(&url, &[]).await;
        assert_eq!(
            (first.status.as_u16(), fields(&first)),
            (200, (5, t)),
            "{algorithm}"
        );
        let second = client.get(&url, &[]).await;
        assert_eq!(
            (second.status.as_u16(), fields(&second)),
            (200, (0, t)),
            "{algorithm}"
        );
        let denied = client.get(&url, &[]).await;
        assert_eq!(
            (denied.status.as_u16(), fields(&denied)),
            (429, (0, t)),
            "{algorithm}"
        );
        let wait: u64 = denied
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_default();
        assert!(
            wait.abs_diff(retry) <= 1 && wait >= t,
            "{algorithm}: Retry-After {wait}, by hand {retry}, t {t}"
        );
    }
}

/// The rate algorithms free one unit every 6 s: at 0 remaining that is the
/// wait, not the 60 s to a full bucket.
async fn an_empty_bucket_waits_for_one_unit(gate: &Floodgate, client: &TestClient) {
    for algorithm in ["token_bucket", "gcra"] {
        let url = gate.url(&format!("/minute/{algorithm}"));
        for _ in 0..4 {
            client.get(&url, &[]).await;
        }
        let last = client.get(&url, &[]).await;
        assert_eq!(last.status, 200);
        assert_eq!(fields(&last), (0, 6), "{algorithm}");
        let denied = client.get(&url, &[]).await;
        assert_eq!(denied.status, 429);
        assert_eq!(fields(&denied), (0, 6), "{algorithm}");
        assert_eq!(denied.header("retry-after"), Some("6"), "{algorithm}");
    }
}

/// Every algorithm, 2 per 3 s: r counts down, t is the wait for the next
/// unit; a 429's Retry-After equals its t (one unit); a client that sleeps
/// exactly Retry-After is admitted.
async fn sleeping_retry_after_is_enough(
    gate: &Floodgate,
    client: &TestClient,
    algorithms: &[&str],
) {
    for &algorithm in algorithms {
        let url = gate.url(&format!("/{algorithm}"));
        let first = client.get(&url, &[]).await;
        let (r, t) = fields(&first);
        assert_eq!((first.status.as_u16(), r), (200, 1), "{algorithm}");
        assert!((1..=6).contains(&t), "{algorithm}: t={t} with a unit left");
        let second = client.get(&url, &[]).await;
        let (r, t) = fields(&second);
        assert_eq!((second.status.as_u16(), r), (200, 0), "{algorithm}");
        assert!((1..=6).contains(&t), "{algorithm}: t={t}");
        let denied = client.get(&url, &[]).await;
        assert_eq!(denied.status, 429, "{algorithm}");
        let retry: u64 = denied
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .unwrap_or_default();
        let (r, t) = fields(&denied);
        assert_eq!(r, 0, "{algorithm}");
        assert_eq!(retry, t, "{algorithm}: Retry-After equals t");
        assert!(retry >= 1, "{algorithm}");
        tokio::time::sleep(Duration::from_secs(retry)).await;
        let again = client.get(&url, &[]).await;
        assert_eq!(again.status, 200, "{algorithm}: admitted after Retry-After");
    }
}

#[tokio::test]
async fn ratelimit_fields_follow_draft_10_for_every_algorithm() {
    let (_redis, upstream, config) = setup("draft-10").await;
    let algorithms = floodgate::limit::Algorithm::NAMES.map(|(name, _)| name);
    let gate = Floodgate::start(&draft_10_routes(config, &upstream, &algorithms).toml()).await;
    let client = TestClient::http1();

    r_counts_down_and_t_is_the_next_units_time(&gate, &client, &algorithms).await;
    a_costly_denial_waits_for_its_own_units(&gate, &client).await;
    an_empty_bucket_waits_for_one_unit(&gate, &client).await;
    sleeping_retry_after_is_enough(&gate, &client, &algorithms).await;

    // With a burst above the limit, q advertises the burst and r never
    // exceeds it.
    let a = client.get(&gate.url("/burst"), &[]).await;
    assert_eq!(a.header("ratelimit-policy"), Some("\"burst\";q=5;w=60"));
    // The next token comes in 60 s / 2.
    assert_eq!(fields(&a), (4, 30));
}

#[tokio::test]
async fn shadow_routes_claim_no_denial() {
    let (_redis, upstream, config) = setup("shadow-fields").await;
    let toml = config
        .route(
            Route::new("search")
                .upstream(&upstream.url())
                .line("shadow = true")
                .line(r#"rate_limit_headers = "both""#)
                .limit("sliding_log", 1, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let first = client.get(&gate.url("/search"), &[]).await;
    assert_eq!(first.header("ratelimit"), Some("\"search\";r=0;t=60"));
    for _ in 0..3 {
        let a = client.get(&gate.url("/search"), &[]).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("ratelimit-policy"), Some("\"search\";q=1;w=60"));
        assert!(a.header("ratelimit").is_none(), "{:?}", a.headers);
        assert!(a.header("x-ratelimit-remaining").is_none());
        assert!(a.header("retry-after").is_none());
    }
    assert_eq!(upstream.hits(), 4);
}

#[tokio::test]
async fn a_rotated_jwt_key_applies_without_a_restart() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("jwt-rotation");
    let old = b"the-first-secret-of-at-least-32-bytes";
    let new = b"the-second-secret-of-at-least-32-byte";
    let secret = dir.join("secret");
    std::fs::write(&secret, old).expect("write secret");
    let path = dir.join("config.toml");
    let toml = Config::new()
        .route(
            Route::new("api")
                .upstream(&upstream.url())
                .line(&format!(
                    r#"client = {{ from = "jwt", claim = "sub", algorithm = "HS256", secret_file = "{}", missing = "reject" }}"#,
                    secret.display()
                ))
                .limit("sliding_log", 100, "60s"),
        )
        .toml();
    std::fs::write(&path, toml).expect("write config");
    let gate = Floodgate::start_file(&path).await;
    let client = TestClient::http1();
    let url = gate.url("/api");
    let signed_by = |key: &[u8]| token(r#"{"alg":"HS256"}"#, &claims("alice", false), hs256(key));
    assert_eq!(bearer(&client, &url, &signed_by(old)).await.status, 200);
    assert_eq!(bearer(&client, &url, &signed_by(new)).await.status, 401);
    std::fs::write(&secret, new).expect("rotate secret");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while bearer(&client, &url, &signed_by(new)).await.status != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the new key never applied"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(bearer(&client, &url, &signed_by(old)).await.status, 401);
}

#[tokio::test]
async fn composite_keys_take_any_number_of_parts_including_one() {
    let (_redis, upstream, config) = setup("composite-parts").await;
    let toml = config
        .route(
            on("one-part", "/one", &upstream)
                .client(r#"from = "composite", parts = ["header:X-Tenant"], missing = "reject""#)
                .limit("fixed_window", 1, "60s"),
        )
        .route(
            Route::new("three-parts")
                .upstream(&upstream.url())
                .matching(r#"path = "/shops/{shop}/cart""#)
                .client(r#"from = "composite", parts = ["header:X-Tenant", "path:shop", "remote_addr"]"#)
                .limit("fixed_window", 1, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let get = |path: &'static str, tenant: &'static str| {
        let client = client.clone();
        let url = gate.url(path);
        async move {
            client
                .get(&url, &[("x-tenant", tenant)])
                .await
                .status
                .as_u16()
        }
    };
    assert_eq!(get("/one", "a").await, 200);
    assert_eq!(get("/one", "a").await, 429);
    assert_eq!(get("/one", "b").await, 200);
    assert_eq!(client.get(&gate.url("/one"), &[]).await.status, 400);
    assert_eq!(get("/shops/1/cart", "a").await, 200);
    assert_eq!(get("/shops/1/cart", "a").await, 429);
    // Another shop, or another tenant, is another bucket.
    assert_eq!(get("/shops/2/cart", "a").await, 200);
    assert_eq!(get("/shops/1/cart", "b").await, 200);
}

/// The answers to `n` requests carrying the tokens `make` gives, one after
/// another on one connection.
async fn flood(
    client: &TestClient,
    url: &str,
    n: usize,
    make: impl Fn(usize) -> String,
) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(n);
    for i in 0..n {
        answers.push(bearer(client, url, &make(i)).await);
    }
    answers
}

/// A flood of forged ES256 tokens from one address is refused without a
/// signature check past `failures_per_minute` failures (so it costs about
/// what as many plain denials cost: `cargo bench --bench forged_tokens`
/// measures the CPU), while a client whose token was verified is still served. A token
/// with a `crit` extension floodgate does not understand is refused.
#[tokio::test]
async fn forged_tokens_are_limited_per_address_before_they_cost_a_check() {
    let upstream = Upstream::start().await;
    let dir = temp_dir("forged-tokens");
    let rng = SystemRandom::new();
    let ec = ec_key(&dir, &rng);
    let port = support::free_port();
    let config = Config::new()
        .listen_on(port)
        .route(
            on("api", "/", &upstream)
                .line(&format!(
                    r#"client = {{ from = "jwt", claim = "sub", algorithm = "ES256", jwks_file = "{}", missing = "reject", failures_per_minute = 20 }}"#,
                    dir.join("jwks.json").display()
                ))
                .limit("fixed_window", 2, "1h"),
        )
        .write("forged-tokens");
    let gate = support::FloodgateProcess::spawn(&config, port).await;
    let url = gate.url("/orders");
    let client = TestClient::http1();
    let es256 = |header: &str, claims: &str| {
        token(header, claims, |input| {
            ec.sign(&rng, input).expect("ec sign").as_ref().to_vec()
        })
    };
    let claims_of = |sub: &str| format!(r#"{{"sub":"{sub}","exp":{}}}"#, now() + 3600);
    let header = r#"{"alg":"ES256","kid":"k1"}"#;

    // The failure budget counts per minute of the clock: start early in
    // one, so the failures below all fall in it even on a slow machine.
    let second = now() % 60;
    if second > 20 {
        tokio::time::sleep(Duration::from_secs(61 - second)).await;
    }

    // A critical extension floodgate does not understand: refused.
    let crit = es256(
        r#"{"alg":"ES256","kid":"k1","crit":["exp-ext"],"exp-ext":1}"#,
        &claims_of("carol"),
    );
    assert_eq!(bearer(&client, &url, &crit).await.status, 401);

    // Erin's token is verified before the flood.
    let erin = es256(header, &claims_of("erin"));
    assert_eq!(bearer(&client, &url, &erin).await.status, 200);

    // Plain denials: Dave's own token, past his limit of 2.
    let dave = es256(header, &claims_of("dave"));
    for _ in 0..2 {
        assert_eq!(bearer(&client, &url, &dave).await.status, 200);
    }
    let denied = flood(&client, &url, 2_000, |_| dave.clone()).await;
    assert!(denied.iter().all(|a| a.status == 429));

    // Forged: each token new, its signature random. The budget had one
    // failure already (the crit token); 19 more are checked and refused,
    // the rest refused unchecked with Retry-After until the minute ends.
    let forged_token = |i: usize| {
        let input = format!(
            "{}.{}",
            b64(header.as_bytes()),
            b64(claims_of(&format!("mallory-{i}")).as_bytes())
        );
        let mut sig = [0u8; 64];
        ring::rand::SecureRandom::fill(&rng, &mut sig).expect("random");
        format!("{input}.{}", b64(&sig))
    };
    let refused = flood(&client, &url, 2_000, forged_token).await;
    let unauthorized = refused.iter().take_while(|a| a.status == 401).count();
    assert_eq!(unauthorized, 19, "checked before the budget was spent");
    for answer in &refused[19..] {
        assert_eq!(answer.status, 429);
        let wait: u64 = answer
            .header("retry-after")
            .and_then(|v| v.parse().ok())
            .expect("Retry-After");
        assert!((1..=60).contains(&wait), "Retry-After {wait}");
    }

    // Erin, whose token was verified, is still served.
    assert_eq!(bearer(&client, &url, &erin).await.status, 200);
    // A new genuine token from the same address waits for the minute.
    let frank = es256(header, &claims_of("frank"));
    assert_eq!(bearer(&client, &url, &frank).await.status, 429);
    let _ = std::fs::remove_dir_all(dir);
}
