//! What a token says before it is proven: the request's one bearer
//! token, its three parts, the algorithm and key its header names, and the
//! claims of its payload. Nothing here is trusted until [`super::ClaimRule`]
//! has checked the signature.

use base64::Engine as _;
use http::HeaderMap;
use http::header::AUTHORIZATION;
use serde::Deserialize;

use super::{Algorithm, MAX_TOKEN, TokenError};

/// A token header's fields that floodgate reads.
#[derive(Deserialize)]
struct Header<'a> {
    alg: &'a str,
    #[serde(default)]
    kid: Option<String>,
    /// Extensions the verifier must understand or refuse the token.
    #[serde(default)]
    crit: Option<serde::de::IgnoredAny>,
}

/// One base64url part of a token, decoded (no padding).
pub(super) fn base64url(text: &[u8]) -> Result<Vec<u8>, TokenError> {
    base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|_| TokenError::Malformed)
}

/// The `kid` of a token header that names `algorithm` and no critical
/// extension.
pub(super) fn accepted_header(
    head: &[u8],
    algorithm: Algorithm,
) -> Result<Option<String>, TokenError> {
    let header_json = base64url(head)?;
    let header: Header<'_> =
        serde_json::from_slice(&header_json).map_err(|_| TokenError::Malformed)?;
    if header.alg != algorithm.name() {
        return Err(TokenError::Algorithm);
    }
    if header.crit.is_some() {
        return Err(TokenError::Critical);
    }
    Ok(header.kid)
}

/// A token's claims, as its payload's JSON object.
pub(super) type Claims = serde_json::Map<String, serde_json::Value>;

/// The token of the request's one `Authorization: Bearer` header, at most
/// [`MAX_TOKEN`] bytes.
pub(super) fn bearer_token(headers: &HeaderMap) -> Result<&[u8], TokenError> {
    let mut values = headers.get_all(AUTHORIZATION).iter();
    let value = values.next().ok_or(TokenError::Missing)?;
    if values.next().is_some() {
        return Err(TokenError::Repeated);
    }
    let value = value.as_bytes();
    let token = match value.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => value[7..].trim_ascii(),
        _ => return Err(TokenError::Missing),
    };
    if token.len() > MAX_TOKEN {
        return Err(TokenError::Malformed);
    }
    Ok(token)
}

/// A token's three base64url parts, still encoded.
pub(super) struct TokenParts<'a> {
    pub(super) head: &'a [u8],
    pub(super) body: &'a [u8],
    pub(super) signature: &'a [u8],
    /// `head.body`: what the signature signs.
    pub(super) signed: &'a [u8],
}

impl<'a> TokenParts<'a> {
    /// Exactly three parts, separated by dots.
    pub(super) fn split(token: &'a [u8]) -> Result<Self, TokenError> {
        let mut parts = token.splitn(3, |&b| b == b'.');
        let (Some(head), Some(body), Some(signature)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(TokenError::Malformed);
        };
        if signature.contains(&b'.') {
            return Err(TokenError::Malformed);
        }
        Ok(Self {
            head,
            body,
            signature,
            signed: &token[..head.len() + 1 + body.len()],
        })
    }
}

/// The SHA-256 a verified token is remembered by.
pub(super) fn token_digest(token: &[u8]) -> Result<[u8; 32], TokenError> {
    ring::digest::digest(&ring::digest::SHA256, token)
        .as_ref()
        .try_into()
        .map_err(|_| TokenError::Malformed)
}

/// The claims of a token's payload.
pub(super) fn payload(body: &[u8]) -> Result<Claims, TokenError> {
    let payload = base64url(body)?;
    serde_json::from_slice(&payload).map_err(|_| TokenError::Malformed)
}

/// `exp` (required) and `nbf` (if present), in whole seconds.
pub(super) fn lifetime_claims(claims: &Claims) -> Result<(u64, Option<u64>), TokenError> {
    let seconds = |v: &serde_json::Value| v.as_f64().map(|n| n.max(0.0) as u64);
    let exp = claims
        .get("exp")
        .and_then(seconds)
        .ok_or(TokenError::Expired)?;
    let nbf = match claims.get("nbf") {
        None => None,
        Some(v) => Some(seconds(v).ok_or(TokenError::NotYet)?),
    };
    Ok((exp, nbf))
}
