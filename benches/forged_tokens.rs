//! What a flood of forged ES256 tokens from one address costs floodgate,
//! against as many plain denials (a valid token past its limit), with the
//! failed-credential budget (`failures_per_minute`, default 20) and
//! without it (0). Floodgate's release binary runs as its own process and
//! its CPU (user + system, from `/proc/PID/stat`) is read around each
//! flood, so the client's work is not counted. Run with
//! `cargo bench --bench forged_tokens`; it prints a markdown table.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use ring::rand::{SecureRandom, SystemRandom};
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};

/// Requests per flood.
const N: usize = 20_000;

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// Clock ticks of user and system CPU process `pid` has used.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    ticks(11) + ticks(12)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(0)
}

/// Sends `tokens` one after another to `url`; floodgate's CPU for them, in
/// microseconds per request, and how many were answered `status`.
async fn flood(url: &str, pid: u32, tokens: &[String], status: u16) -> (f64, usize) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Empty<Bytes>>();
    let before = cpu_ticks(pid);
    let mut matched = 0;
    for token in tokens {
        let request = hyper::Request::get(url)
            .header("authorization", format!("Bearer {token}"))
            .body(Empty::new())
            .expect("request");
        let answer = client.request(request).await.expect("answer");
        matched += usize::from(answer.status().as_u16() == status);
        let _ = answer.into_body().collect().await;
    }
    let ticks = cpu_ticks(pid) - before;
    let per_tick = 1e6 / clock_ticks_per_second();
    (ticks as f64 * per_tick / tokens.len() as f64, matched)
}

/// Clock ticks per second (`getconf CLK_TCK`).
fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Tokens expire in 2100: never during a run.
const EXP: u64 = 4_102_444_800;

/// A fresh P-256 signing key.
fn signing_key(rng: &SystemRandom) -> EcdsaKeyPair {
    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, rng)
        .expect("ec key");
    EcdsaKeyPair::from_pkcs8(
        &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        pkcs8.as_ref(),
        rng,
    )
    .expect("ec pair")
}

/// Writes `key`'s public half as `dir/jwks.json`, kid `k1`.
fn write_jwks(dir: &Path, key: &EcdsaKeyPair) {
    let point = key.public_key().as_ref();
    std::fs::write(
        dir.join("jwks.json"),
        format!(
            r#"{{"keys":[{{"kty":"EC","crv":"P-256","kid":"k1","alg":"ES256","x":"{}","y":"{}"}}]}}"#,
            b64(&point[1..33]),
            b64(&point[33..65])
        ),
    )
    .expect("write jwks");
}

/// Writes floodgate's config on `port`: routes `budget` (20 failed
/// credentials a minute per address) and `unlimited` (no such budget),
/// each keyed by the `sub` of an ES256 token checked against the JWKS in
/// `dir`, 2 an hour.
fn write_config(dir: &Path, port: u16) -> PathBuf {
    let route = |name: &str, budget: u32| {
        format!(
            "[[routes]]\nname = \"{name}\"\nmatch = {{ path_prefix = \"/{name}\" }}\nrespond = {{ status = 200 }}\n\
             client = {{ from = \"jwt\", claim = \"sub\", algorithm = \"ES256\", jwks_file = \"{}\", missing = \"reject\", failures_per_minute = {budget} }}\n\
             limits = [{{ algorithm = \"fixed_window\", limit = 2, window = \"1h\" }}]\n",
            dir.join("jwks.json").display()
        )
    };
    let config = dir.join("floodgate.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\ndrain_delay = \"0s\"\n{}{}",
            route("budget", 20),
            route("unlimited", 0)
        ),
    )
    .expect("write config");
    config
}

/// Starts floodgate with `config` and waits (5 s at most) until `port`
/// accepts connections.
fn start_floodgate(config: &Path, port: u16) -> Child {
    let child = Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("--config")
        .arg(config)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start floodgate");
    for _ in 0..200 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    child
}

/// A genuine token for `sub`, signed with `key`.
fn signed(key: &EcdsaKeyPair, rng: &SystemRandom, sub: &str) -> String {
    let input = format!(
        "{}.{}",
        b64(br#"{"alg":"ES256","kid":"k1"}"#),
        b64(format!(r#"{{"sub":"{sub}","exp":{EXP}}}"#).as_bytes())
    );
    let sig = key.sign(rng, input.as_bytes()).expect("sign");
    format!("{input}.{}", b64(sig.as_ref()))
}

/// A token for `mallory-{i}` whose signature is random bytes.
fn forged(rng: &SystemRandom, i: usize) -> String {
    let input = format!(
        "{}.{}",
        b64(br#"{"alg":"ES256","kid":"k1"}"#),
        b64(format!(r#"{{"sub":"mallory-{i}","exp":{EXP}}}"#).as_bytes())
    );
    let mut sig = [0u8; 64];
    rng.fill(&mut sig).expect("random");
    format!("{input}.{}", b64(&sig))
}

/// The three floods against floodgate on `port` (process `pid`): each
/// row's name, floodgate's CPU µs per request, and how many were answered
/// as expected.
fn floods(
    port: u16,
    pid: u32,
    key: &EcdsaKeyPair,
    rng: &SystemRandom,
) -> [(&'static str, f64, usize); 3] {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let base = format!("http://127.0.0.1:{port}");
        let dave = vec![signed(key, rng, "dave"); N + 2];
        let (plain, denied) = flood(&format!("{base}/budget"), pid, &dave, 429).await;
        let tokens: Vec<String> = (0..N).map(|i| forged(rng, i)).collect();
        let (budget, refused) = flood(&format!("{base}/budget"), pid, &tokens, 429).await;
        let tokens: Vec<String> = (0..N).map(|i| forged(rng, N + i)).collect();
        let (unlimited, checked) = flood(&format!("{base}/unlimited"), pid, &tokens, 401).await;
        [
            (
                "plain denials (a valid token past its limit)",
                plain,
                denied,
            ),
            ("forged tokens, failures_per_minute = 20", budget, refused),
            ("forged tokens, failures_per_minute = 0", unlimited, checked),
        ]
    })
}

fn main() {
    let rng = SystemRandom::new();
    let key = signing_key(&rng);
    let dir = std::env::temp_dir().join(format!("floodgate-forged-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    write_jwks(&dir, &key);
    let port = free_port();
    let mut child = start_floodgate(&write_config(&dir, port), port);
    let rows = floods(port, child.id(), &key, &rng);
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    println!("| {N} requests from one address | floodgate CPU µs/request | answered 429 or 401 |");
    println!("|---|---:|---:|");
    for (what, us, answered) in rows {
        println!("| {what} | {us:.1} | {answered} |");
    }
}
