//! Bearer tokens for tests: HS256 JWTs signed with a secret the test
//! writes beside its configuration.

use base64::Engine as _;

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

/// An HS256 token signed with `secret` carrying `claims` (JSON members
/// beside `exp`, an hour from now).
pub fn hs256(secret: &[u8], claims: &str) -> String {
    let exp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        + 3600;
    let body = format!("{{{claims},\"exp\":{exp}}}");
    let input = format!(
        "{}.{}",
        b64(br#"{"alg":"HS256","typ":"JWT"}"#),
        b64(body.as_bytes())
    );
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let sig = ring::hmac::sign(&key, input.as_bytes());
    format!("{input}.{}", b64(sig.as_ref()))
}

/// Writes `secret` as `dir/secret` and returns a route `client` that
/// reads the verified `sub` claim of HS256 tokens signed with it (the
/// inside of `client = { … }`), refusing requests without one.
pub fn hs256_client(dir: &std::path::Path, secret: &[u8]) -> String {
    std::fs::write(dir.join("secret"), secret).expect("write secret");
    format!(
        r#"from = "jwt", claim = "sub", algorithm = "HS256", secret_file = "{}", missing = "reject""#,
        dir.join("secret").display()
    )
}
