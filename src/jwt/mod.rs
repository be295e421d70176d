//! Client ids from a verified JSON Web Token claim (RFC 7519).
//!
//! A route with `client = { from = "jwt", claim = "sub", … }` counts each
//! request under a claim of its `Authorization: Bearer` token, but only once
//! the token is proven: its signature checks out against a key from the
//! configuration with the one algorithm the route pins (so `alg: none` or
//! an HS256 token signed with an RSA public key as the secret never pass),
//! `exp` and `nbf` hold (with a small leeway for clock skew), and `iss` and
//! `aud` are the configured ones when the route names them. An unverified
//! claim is never read: it would let a client choose its own bucket.
//!
//! Signatures are checked with `ring`, the crypto library rustls already
//! brings: HMAC-SHA256 (compared in constant time), RSASSA-PKCS1-v1_5 with
//! SHA-256 (keys of 2048 to 8192 bits), ECDSA P-256 with SHA-256.
//!
//! The keys are read from the files a route names in [`keys`].

use std::collections::HashMap;
use std::time::Duration;

use http::HeaderMap;
use ring::signature::{self, RsaPublicKeyComponents, UnparsedPublicKey};

/// The longest token read, in bytes: anything longer is refused unread.
pub const MAX_TOKEN: usize = 8 * 1024;

/// A signature algorithm a route accepts (exactly one per route).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// HMAC with SHA-256, a shared secret.
    Hs256,
    /// RSASSA-PKCS1-v1_5 with SHA-256, an RSA public key.
    Rs256,
    /// ECDSA on P-256 with SHA-256, an EC public key.
    Es256,
}

impl Algorithm {
    /// Every algorithm with its JOSE name.
    pub const NAMES: [(&'static str, Algorithm); 3] = [
        ("HS256", Algorithm::Hs256),
        ("RS256", Algorithm::Rs256),
        ("ES256", Algorithm::Es256),
    ];

    /// The JOSE name (`alg`).
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize].0
    }
}

/// One verification key.
#[derive(Clone)]
pub enum Key {
    /// An HMAC secret.
    Hmac(ring::hmac::Key),
    /// An RSA public key's modulus and exponent (big-endian).
    Rsa(RsaPublicKeyComponents<Vec<u8>>),
    /// A P-256 public key as an uncompressed point (`04 ‖ x ‖ y`).
    Ec(Vec<u8>),
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret itself.
        f.write_str(match self {
            Self::Hmac(_) => "Hmac(…)",
            Self::Rsa(_) => "Rsa(…)",
            Self::Ec(_) => "Ec(…)",
        })
    }
}

/// How a route reads a client id from a token.
#[derive(Debug)]
pub struct ClaimRule {
    /// The claim counted (`sub`, `client_id`, …).
    pub claim: Box<str>,
    /// The one algorithm accepted.
    pub algorithm: Algorithm,
    /// Keys to try, each with its `kid` when it has one.
    pub keys: Vec<(Option<String>, Key)>,
    /// Required `iss`, if any.
    pub issuer: Option<String>,
    /// Required `aud` (one of the token's audiences), if any.
    pub audience: Option<String>,
    /// Clock skew tolerated on `exp` and `nbf`.
    pub leeway: Duration,
    /// The file the keys were read from, watched for changes like the
    /// configuration itself.
    pub source: Option<std::path::PathBuf>,
    /// Tokens already verified.
    pub verified: Verified,
}

/// Most tokens remembered as verified per rule; when full, they are all
/// forgotten (and verified again on their next use).
const VERIFIED_CAP: usize = 4096;

/// Tokens this rule has verified, by their SHA-256, with their claim and
/// lifetime: a client sends the same token with every request, and an
/// ES256 or RS256 signature costs far more to check than a request costs
/// to proxy. Only a token whose signature, algorithm, issuer and audience
/// passed is remembered; its lifetime is checked again on every use. A
/// reload builds new rules, so rotated keys start afresh. Bounded: at most
/// [`VERIFIED_CAP`] entries of a digest, a claim (at most the token's
/// length) and two times.
#[derive(Default)]
pub struct Verified(std::sync::Mutex<HashMap<[u8; 32], Remembered>>);

struct Remembered {
    claim: Box<[u8]>,
    exp: u64,
    nbf: Option<u64>,
}

impl std::fmt::Debug for Verified {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = self.0.lock().map_or(0, |m| m.len());
        write!(f, "Verified({len} tokens)")
    }
}

impl PartialEq for ClaimRule {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for ClaimRule {}

/// Why a token gave no client id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// No `Authorization: Bearer` header.
    #[error("no bearer token")]
    Missing,
    /// The header came more than once.
    #[error("more than one Authorization header")]
    Repeated,
    /// Not three base64url parts of JSON, or too long.
    #[error("the token is malformed")]
    Malformed,
    /// `alg` is not the route's algorithm.
    #[error("the token's algorithm is not the one accepted")]
    Algorithm,
    /// No configured key verifies the signature.
    #[error("the token's signature is invalid")]
    Signature,
    /// `exp` has passed (or is missing).
    #[error("the token has expired")]
    Expired,
    /// `nbf` is still ahead.
    #[error("the token is not valid yet")]
    NotYet,
    /// `iss` or `aud` is not the configured one.
    #[error("the token was issued by or for someone else")]
    Audience,
    /// The claim is absent, or not a string or a number.
    #[error("the token lacks the claim this route counts by")]
    Claim,
    /// The header lists critical extensions (`crit`, RFC 7515 §4.1.11),
    /// none of which floodgate understands.
    #[error("the token names critical extensions that are not understood")]
    Critical,
    /// Not checked: the caller's budget for checks was spent.
    #[error("the token was not checked")]
    Unchecked,
}

impl ClaimRule {
    /// A rule reading `claim` from tokens this rule verifies: the same
    /// algorithm, keys, issuer, audience and leeway, its own memory of
    /// verified tokens.
    pub fn for_claim(&self, claim: &str) -> Self {
        Self {
            claim: claim.into(),
            algorithm: self.algorithm,
            keys: self.keys.clone(),
            issuer: self.issuer.clone(),
            audience: self.audience.clone(),
            leeway: self.leeway,
            source: self.source.clone(),
            verified: Verified::default(),
        }
    }

    /// The verified claim of the request's bearer token.
    pub fn claim(&self, headers: &HeaderMap) -> Result<Vec<u8>, TokenError> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        self.claim_at(headers, now)
    }

    /// The claim of the request's verified token read as a whole number
    /// (a per-key limit, a billing day); `None` for a token that is
    /// missing or invalid, lacks the claim, or carries something else.
    pub fn claimed_number<T: std::str::FromStr>(&self, headers: &HeaderMap) -> Option<T> {
        let value = self.claim(headers).ok()?;
        std::str::from_utf8(&value).ok()?.trim().parse().ok()
    }

    /// [`ClaimRule::claim`] at `now`, in seconds since the Unix epoch.
    pub fn claim_at(&self, headers: &HeaderMap, now: u64) -> Result<Vec<u8>, TokenError> {
        self.claim_if(headers, now, || true)
    }

    /// [`ClaimRule::claim_at`], asking `may_check` before a token not
    /// already remembered as valid has its signature checked: when it says
    /// no, the token is refused unchecked ([`TokenError::Unchecked`]).
    pub fn claim_if(
        &self,
        headers: &HeaderMap,
        now: u64,
        may_check: impl FnOnce() -> bool,
    ) -> Result<Vec<u8>, TokenError> {
        let token = bearer_token(headers)?;
        let parts = TokenParts::split(token)?;
        let digest = token_digest(token)?;
        if let Some(known) = self.remembered(&digest, now) {
            return known;
        }
        let kid = accepted_header(parts.head, self.algorithm)?;
        if !may_check() {
            return Err(TokenError::Unchecked);
        }
        let signature = base64url(parts.signature)?;
        if !self.signed_by_a_key(kid.as_deref(), parts.signed, &signature) {
            return Err(TokenError::Signature);
        }
        let claims = payload(parts.body)?;
        let (exp, nbf) = lifetime_claims(&claims)?;
        self.issued_by_and_for(&claims)?;
        let claim = self.counted_claim(&claims)?;
        // Remembered once proven, whatever its lifetime says now: an
        // expired token stays refused by the check below and on every use.
        self.remember(digest, &claim, exp, nbf);
        self.lifetime(exp, nbf, now)?;
        Ok(claim)
    }

    /// The claim of a token verified before, if it is remembered, as long
    /// as its lifetime still holds at `now`.
    fn remembered(&self, digest: &[u8; 32], now: u64) -> Option<Result<Vec<u8>, TokenError>> {
        let verified = self.verified.0.lock().ok()?;
        let known = verified.get(digest)?;
        Some(
            self.lifetime(known.exp, known.nbf, now)
                .map(|()| known.claim.to_vec()),
        )
    }

    /// `iss` and `aud` are the configured ones, where the rule names them.
    fn issued_by_and_for(&self, claims: &Claims) -> Result<(), TokenError> {
        if let Some(issuer) = &self.issuer
            && claims.get("iss").and_then(serde_json::Value::as_str) != Some(issuer)
        {
            return Err(TokenError::Audience);
        }
        if let Some(audience) = &self.audience {
            let ok = match claims.get("aud") {
                Some(serde_json::Value::String(a)) => a == audience,
                Some(serde_json::Value::Array(list)) => {
                    list.iter().any(|a| a.as_str() == Some(audience))
                }
                _ => false,
            };
            if !ok {
                return Err(TokenError::Audience);
            }
        }
        Ok(())
    }

    /// The value of the claim this rule counts by: a non-empty string or
    /// a number.
    fn counted_claim(&self, claims: &Claims) -> Result<Vec<u8>, TokenError> {
        match claims.get(&*self.claim) {
            Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(s.as_bytes().to_vec()),
            Some(serde_json::Value::Number(n)) => Ok(n.to_string().into_bytes()),
            _ => Err(TokenError::Claim),
        }
    }

    /// Remembers a proven token's claim and lifetime; a full memory is
    /// forgotten whole first.
    fn remember(&self, digest: [u8; 32], claim: &[u8], exp: u64, nbf: Option<u64>) {
        if let Ok(mut verified) = self.verified.0.lock() {
            if verified.len() >= VERIFIED_CAP {
                verified.clear();
            }
            verified.insert(
                digest,
                Remembered {
                    claim: claim.into(),
                    exp,
                    nbf,
                },
            );
        }
    }

    /// `exp` has not passed and `nbf` has, at `now`, within the leeway.
    fn lifetime(&self, exp: u64, nbf: Option<u64>, now: u64) -> Result<(), TokenError> {
        let leeway = self.leeway.as_secs();
        if exp.saturating_add(leeway) <= now {
            return Err(TokenError::Expired);
        }
        if nbf.is_some_and(|nbf| nbf > now.saturating_add(leeway)) {
            return Err(TokenError::NotYet);
        }
        Ok(())
    }

    /// Whether a key (the one named `kid` when the token names one the
    /// configuration knows, else any) signed `signed`.
    fn signed_by_a_key(&self, kid: Option<&str>, signed: &[u8], signature: &[u8]) -> bool {
        let named = kid.is_some() && self.keys.iter().any(|(k, _)| k.as_deref() == kid);
        self.keys
            .iter()
            .filter(|(k, _)| !named || k.as_deref() == kid)
            .any(|(_, key)| match key {
                Key::Hmac(key) => ring::hmac::verify(key, signed, signature).is_ok(),
                Key::Rsa(key) => key
                    .verify(&signature::RSA_PKCS1_2048_8192_SHA256, signed, signature)
                    .is_ok(),
                Key::Ec(point) => {
                    UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_FIXED, point)
                        .verify(signed, signature)
                        .is_ok()
                }
            })
    }
}

mod keys;
mod token;

pub use keys::{hmac_key, jwks_keys, pem_key};
use token::{
    Claims, TokenParts, accepted_header, base64url, bearer_token, lifetime_claims, payload,
    token_digest,
};

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;
    use http::HeaderValue;
    use http::header::AUTHORIZATION;

    fn b64(bytes: &[u8]) -> String {
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    }

    fn hs256(secret: &[u8], header: &str, claims: &str) -> String {
        let signed = format!("{}.{}", b64(header.as_bytes()), b64(claims.as_bytes()));
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
        let tag = ring::hmac::sign(&key, signed.as_bytes());
        format!("{signed}.{}", b64(tag.as_ref()))
    }

    fn rule() -> ClaimRule {
        ClaimRule {
            claim: "sub".into(),
            algorithm: Algorithm::Hs256,
            keys: vec![(None, hmac_key(b"s3cret"))],
            issuer: Some("idp".into()),
            audience: Some("api".into()),
            leeway: Duration::from_secs(30),
            source: None,
            verified: Verified::default(),
        }
    }

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Ok(v) = HeaderValue::from_str(&format!("Bearer {token}")) {
            h.insert(AUTHORIZATION, v);
        }
        h
    }

    const NOW: u64 = 1_800_000_000;

    #[test]
    fn a_token_with_critical_extensions_is_refused() {
        let r = rule();
        let good = r#"{"sub":"alice","exp":1800000100,"iss":"idp","aud":"api"}"#;
        let crit = hs256(
            b"s3cret",
            r#"{"alg":"HS256","crit":["exp-ext"],"exp-ext":1}"#,
            good,
        );
        assert_eq!(r.claim_at(&bearer(&crit), NOW), Err(TokenError::Critical));
    }

    #[test]
    fn only_tokens_not_yet_known_are_held_back_when_checks_are_refused() {
        let r = rule();
        let h = r#"{"alg":"HS256"}"#;
        let known = hs256(
            b"s3cret",
            h,
            r#"{"sub":"a","exp":1800000100,"iss":"idp","aud":"api"}"#,
        );
        let new = hs256(
            b"s3cret",
            h,
            r#"{"sub":"b","exp":1800000100,"iss":"idp","aud":"api"}"#,
        );
        assert_eq!(r.claim_at(&bearer(&known), NOW), Ok(b"a".to_vec()));
        assert_eq!(
            r.claim_if(&bearer(&known), NOW, || false),
            Ok(b"a".to_vec())
        );
        assert_eq!(
            r.claim_if(&bearer(&new), NOW, || false),
            Err(TokenError::Unchecked)
        );
        assert_eq!(r.claim_if(&bearer(&new), NOW, || true), Ok(b"b".to_vec()));
    }

    #[test]
    fn a_valid_token_gives_its_claim_and_every_fault_is_named() {
        let r = rule();
        let h = r#"{"alg":"HS256","typ":"JWT"}"#;
        let good = r#"{"sub":"alice","exp":1800000100,"iss":"idp","aud":["x","api"]}"#;
        assert_eq!(
            r.claim_at(&bearer(&hs256(b"s3cret", h, good)), NOW),
            Ok(b"alice".to_vec())
        );
        let cases = [
            (hs256(b"other", h, good), TokenError::Signature),
            (
                hs256(b"s3cret", r#"{"alg":"none"}"#, good),
                TokenError::Algorithm,
            ),
            (
                hs256(
                    b"s3cret",
                    h,
                    r#"{"sub":"a","exp":1799999900,"iss":"idp","aud":"api"}"#,
                ),
                TokenError::Expired,
            ),
            (
                hs256(b"s3cret", h, r#"{"sub":"a","iss":"idp","aud":"api"}"#),
                TokenError::Expired,
            ),
            (
                hs256(
                    b"s3cret",
                    h,
                    r#"{"sub":"a","exp":1800000100,"nbf":1800000100,"iss":"idp","aud":"api"}"#,
                ),
                TokenError::NotYet,
            ),
            (
                hs256(
                    b"s3cret",
                    h,
                    r#"{"sub":"a","exp":1800000100,"iss":"evil","aud":"api"}"#,
                ),
                TokenError::Audience,
            ),
            (
                hs256(
                    b"s3cret",
                    h,
                    r#"{"exp":1800000100,"iss":"idp","aud":"api"}"#,
                ),
                TokenError::Claim,
            ),
            ("a.b".to_owned(), TokenError::Malformed),
        ];
        for (token, want) in cases {
            assert_eq!(r.claim_at(&bearer(&token), NOW), Err(want), "{token}");
        }
        // Within the leeway, an expired token still counts.
        let late = r#"{"sub":"bob","exp":1799999990,"iss":"idp","aud":"api"}"#;
        assert_eq!(
            r.claim_at(&bearer(&hs256(b"s3cret", h, late)), NOW),
            Ok(b"bob".to_vec())
        );
        assert_eq!(r.claim_at(&HeaderMap::new(), NOW), Err(TokenError::Missing));
    }

    #[test]
    fn a_remembered_token_still_expires_and_forged_ones_are_not_remembered() {
        let r = rule();
        let h = r#"{"alg":"HS256"}"#;
        let token = hs256(
            b"s3cret",
            h,
            r#"{"sub":"alice","exp":1800000100,"iss":"idp","aud":"api"}"#,
        );
        assert_eq!(r.claim_at(&bearer(&token), NOW), Ok(b"alice".to_vec()));
        assert_eq!(r.claim_at(&bearer(&token), NOW + 1), Ok(b"alice".to_vec()));
        let remembered = |r: &ClaimRule| r.verified.0.lock().map_or(0, |m| m.len());
        assert_eq!(remembered(&r), 1);
        // Past exp and the leeway, the remembered token is refused too.
        assert_eq!(
            r.claim_at(&bearer(&token), 1_800_000_131),
            Err(TokenError::Expired)
        );
        let forged = hs256(
            b"other",
            h,
            r#"{"sub":"bob","exp":1800000100,"iss":"idp","aud":"api"}"#,
        );
        assert_eq!(
            r.claim_at(&bearer(&forged), NOW),
            Err(TokenError::Signature)
        );
        assert_eq!(remembered(&r), 1);
    }

    #[test]
    fn algorithm_names_follow_the_declaration_order() {
        for (i, (name, algorithm)) in Algorithm::NAMES.into_iter().enumerate() {
            assert_eq!((algorithm as usize, algorithm.name()), (i, name));
        }
    }
}
