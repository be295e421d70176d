//! What keying clients by a JWT claim costs per request: verifying a token
//! afresh (signature, claims) against finding it among those already
//! verified, for each algorithm. Run with `cargo bench --bench jwt`; it
//! prints a markdown table of CPU nanoseconds per token on one thread.

use std::time::{Duration, Instant};

use base64::Engine as _;
use floodgate::jwt::{Algorithm, ClaimRule, Key, Verified, hmac_key};
use http::{HeaderMap, HeaderValue};
use ring::rand::SystemRandom;
use ring::signature::{self, EcdsaKeyPair, KeyPair as _};

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn rule(algorithm: Algorithm, key: Key) -> ClaimRule {
    ClaimRule {
        claim: "sub".into(),
        algorithm,
        keys: vec![(None, key)],
        issuer: None,
        audience: None,
        leeway: Duration::from_secs(30),
        source: None,
        verified: Verified::default(),
    }
}

/// `n` tokens for different subjects, each signed by `sign`.
fn tokens(alg: &str, n: usize, sign: impl Fn(&[u8]) -> Vec<u8>) -> Vec<HeaderMap> {
    (0..n)
        .map(|i| {
            let claims = format!(
                r#"{{"sub":"user-{i}","exp":4102444800,"iss":"https://idp.example","aud":"api","scope":"orders:read orders:write"}}"#
            );
            let input = format!("{}.{}", b64(format!(r#"{{"alg":"{alg}","typ":"JWT"}}"#).as_bytes()), b64(claims.as_bytes()));
            let token = format!("{input}.{}", b64(&sign(input.as_bytes())));
            let mut headers = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_str(&format!("Bearer {token}")) {
                headers.insert(http::header::AUTHORIZATION, v);
            }
            headers
        })
        .collect()
}

/// Nanoseconds per `claim` over `rounds` passes through `tokens`; the first
/// pass is timed alone (every token verified afresh), the rest together
/// (every token remembered).
fn measure(rule: &ClaimRule, tokens: &[HeaderMap], rounds: usize) -> (f64, f64) {
    let now = 1_800_000_000;
    let started = Instant::now();
    for t in tokens {
        assert!(rule.claim_at(t, now).is_ok());
    }
    let fresh = started.elapsed().as_nanos() as f64 / tokens.len() as f64;
    let started = Instant::now();
    for _ in 0..rounds {
        for t in tokens {
            std::hint::black_box(rule.claim_at(t, now).ok());
        }
    }
    let known = started.elapsed().as_nanos() as f64 / (tokens.len() * rounds) as f64;
    (fresh, known)
}

fn main() {
    let rng = SystemRandom::new();
    println!("| algorithm | verified afresh, ns/token | already verified, ns/token |");
    println!("|---|---:|---:|");

    let secret = b"a-shared-secret-of-at-least-32-bytes!";
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let hs = tokens("HS256", 2_000, |input| {
        ring::hmac::sign(&key, input).as_ref().to_vec()
    });
    let (fresh, known) = measure(&rule(Algorithm::Hs256, hmac_key(secret)), &hs, 50);
    println!("| HS256 | {fresh:.0} | {known:.0} |");

    let pkcs8 = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_FIXED_SIGNING, &rng);
    let Ok(pkcs8) = pkcs8 else {
        return;
    };
    let Ok(pair) = EcdsaKeyPair::from_pkcs8(
        &signature::ECDSA_P256_SHA256_FIXED_SIGNING,
        pkcs8.as_ref(),
        &rng,
    ) else {
        return;
    };
    let es = tokens("ES256", 2_000, |input| {
        pair.sign(&rng, input)
            .map(|s| s.as_ref().to_vec())
            .unwrap_or_default()
    });
    let point = pair.public_key().as_ref().to_vec();
    let (fresh, known) = measure(&rule(Algorithm::Es256, Key::Ec(point)), &es, 50);
    println!("| ES256 | {fresh:.0} | {known:.0} |");
}
