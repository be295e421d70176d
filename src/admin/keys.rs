//! The key registry on the admin listener, every request behind an admin
//! token (the token's name is the operator the audit records):
//!
//! - `POST /keys`: makes a key (`{"identity", "plan"?, "attributes"?,
//!   "enabled"?, "expires_ms"?, "name"?, "reason"}`); the answer (201)
//!   holds the key, shown this once, and its record;
//! - `POST /keys/import`: the same for a key the customer already holds,
//!   given as `"key"` or as its `"sha256"`;
//! - `GET /keys/{id}`: a key's record; `PATCH /keys/{id}`: changes its
//!   identity, plan, attributes, enabled, expiry or name (`null` clears
//!   plan, expiry and name); `DELETE /keys/{id}`: revokes it (the reason
//!   in the body, or `?reason=` without one);
//! - `POST /keys/{id}/rotate` (`{"grace": "1h", "reason"}`, the grace
//!   required: `"0s"` ends the old key at once): a new key for the same
//!   identity, plan and attributes, the old one valid for the grace more;
//! - `GET /identities/{identity}/keys`: an identity's keys;
//! - `GET /audit?identity=…&limit=100`: the newest audit entries.
//!
//! Every change needs a `reason`, and is applied on this instance at once
//! and on every other within a second. The keys file's keys are the
//! file's: updating, rotating or revoking one, or importing a key the
//! file lists, is refused (409, naming the file): edit the file and
//! reload.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use serde::Deserialize;

use super::reply::{json_answer, problem};
use crate::gate::Shared;
use crate::keys::manage::{Given, ManageError, Patch, Spec, Who};
use crate::keys::{Keys, Record, Source};

/// The largest body read.
const MAX_BODY: usize = 64 * 1024;

/// The most audit entries one answer holds.
const MAX_AUDIT: usize = 1_000;

/// Whether `path` is the registry's or the audit's.
pub(super) fn is_keys(path: &str) -> bool {
    path == "/keys"
        || path.starts_with("/keys/")
        || path == "/audit"
        || (path.starts_with("/identities/") && path.ends_with("/keys"))
}

/// `POST /keys` and `/keys/import`: what a new key is.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Asked {
    key: Option<String>,
    sha256: Option<String>,
    reason: Option<String>,
    identity: String,
    plan: Option<String>,
    #[serde(default)]
    attributes: std::collections::BTreeMap<String, String>,
    enabled: Option<bool>,
    expires_ms: Option<u64>,
    name: Option<String>,
}

/// `PATCH /keys/{id}`: a [`Patch`] and the reason.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchAsked {
    reason: Option<String>,
    identity: Option<String>,
    #[serde(default, deserialize_with = "crate::keys::manage::maybe_null")]
    plan: Option<Option<String>>,
    attributes: Option<std::collections::BTreeMap<String, String>>,
    enabled: Option<bool>,
    #[serde(default, deserialize_with = "crate::keys::manage::maybe_null")]
    expires_ms: Option<Option<u64>>,
    #[serde(default, deserialize_with = "crate::keys::manage::maybe_null")]
    name: Option<Option<String>>,
}

/// `DELETE /keys/{id}` and `POST /keys/{id}/rotate`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonAsked {
    reason: Option<String>,
    grace: Option<String>,
}

/// Answers one request of the registry's or the audit's.
pub(super) async fn answer(
    shared: &Shared,
    request: Request<Incoming>,
    token_file: Option<&Path>,
) -> Response<Full<Bytes>> {
    let operator = match super::tokens::operator(request.headers(), token_file) {
        Ok(name) => name,
        Err(refused) => return *refused,
    };
    let (method, uri) = (request.method().clone(), request.uri().clone());
    if uri.path() == "/audit" {
        return audit(shared, uri.query().unwrap_or("")).await;
    }
    let Some(keys) = shared.keys() else {
        return problem(
            StatusCode::NOT_FOUND,
            "the key registry is off: add a [keys] table",
        );
    };
    let body = match Limited::new(request.into_body(), MAX_BODY).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => {
            return problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the body is over 64 KiB, or broke off",
            );
        }
    };
    let path = uri.path();
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let result = match (&method, parts.as_slice()) {
        (&Method::POST, ["keys"]) => make(shared, keys, &body, &operator, false).await,
        (&Method::POST, ["keys", "import"]) => make(shared, keys, &body, &operator, true).await,
        (&Method::GET, ["keys", id]) => keys
            .get(id)
            .map(|r| shown(&r))
            .ok_or_else(|| ManageError::NotFound((*id).to_owned()))
            .map(|b| (StatusCode::OK, b)),
        (&Method::PATCH, ["keys", id]) => update(shared, keys, id, &body, &operator).await,
        (&Method::DELETE, ["keys", id]) => revoke(keys, id, (&body, uri.query()), &operator).await,
        (&Method::POST, ["keys", id, "rotate"]) => rotate(keys, id, &body, &operator).await,
        (&Method::GET, ["identities", identity, "keys"]) => {
            let identity = super::operations::percent_decoded(identity);
            let found: Vec<serde_json::Value> = keys
                .of_identity(&identity)
                .iter()
                .map(|r| serde_json::to_value(&**r).unwrap_or_default())
                .collect();
            Ok((
                StatusCode::OK,
                serde_json::json!({ "identity": identity, "keys": found }).to_string(),
            ))
        }
        _ => {
            return problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "the registry answers POST /keys, POST /keys/import, GET, PATCH or DELETE /keys/{id}, POST /keys/{id}/rotate and GET /identities/{identity}/keys",
            );
        }
    };
    match result {
        Ok((status, body)) => {
            let mut response = json_answer(body);
            *response.status_mut() = status;
            response
        }
        Err(e) => refused(&e),
    }
}

fn refused(e: &ManageError) -> Response<Full<Bytes>> {
    let status = match e {
        ManageError::NotFound(_) => StatusCode::NOT_FOUND,
        ManageError::Exists(_)
        | ManageError::Busy
        | ManageError::FileOwned { .. }
        | ManageError::Listed(_) => StatusCode::CONFLICT,
        ManageError::Invalid(_) => StatusCode::UNPROCESSABLE_ENTITY,
        ManageError::Store(_) | ManageError::File(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    problem(status, &e.to_string())
}

fn shown(record: &Record) -> String {
    serde_json::to_string(record).unwrap_or_default()
}

fn read<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ManageError> {
    serde_json::from_slice(body)
        .map_err(|e| ManageError::Invalid(format!("the body is not one floodgate reads: {e}")))
}

/// Who makes a change: the token's operator, and the reason given
/// (required, trimmed).
fn who<'a>(operator: &'a str, given: Option<&'a str>) -> Result<Who<'a>, ManageError> {
    match given.map(str::trim) {
        Some(reason) if !reason.is_empty() => Ok(Who { operator, reason }),
        _ => Err(ManageError::Invalid(
            "a change needs a \"reason\", which the audit records".to_owned(),
        )),
    }
}

/// A plan name the rules know, or none.
fn known_plan(shared: &Shared, plan: Option<&str>) -> Result<(), ManageError> {
    let Some(plan) = plan else {
        return Ok(());
    };
    let names = shared.plan_names();
    if names.iter().any(|n| &**n == plan) {
        return Ok(());
    }
    Err(ManageError::Invalid(format!(
        "no plan is called {plan:?}; the plans are {}",
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    )))
}

async fn make(
    shared: &Shared,
    keys: &Keys,
    body: &[u8],
    operator: &str,
    import: bool,
) -> Result<(StatusCode, String), ManageError> {
    let asked: Asked = read(body)?;
    let who = who(operator, asked.reason.as_deref())?;
    known_plan(shared, asked.plan.as_deref())?;
    let spec = Spec {
        identity: asked.identity,
        plan: asked.plan,
        attributes: asked.attributes,
        enabled: asked.enabled,
        expires_ms: asked.expires_ms,
        name: asked.name,
    };
    if !import {
        if asked.key.is_some() || asked.sha256.is_some() {
            return Err(ManageError::Invalid(
                "POST /keys makes a key; to bring an existing one, POST /keys/import".to_owned(),
            ));
        }
        let made = keys.create(spec, who).await?;
        let body = serde_json::json!({ "key": made.key, "record": &*made.record });
        return Ok((StatusCode::CREATED, body.to_string()));
    }
    let given = match (asked.key, asked.sha256) {
        (Some(key), None) if !key.is_empty() => Given::Key(key),
        (None, Some(hex)) => Given::Sha256(
            crate::keys::registry::from_hex(&hex)
                .ok_or_else(|| ManageError::Invalid("sha256 must be 64 hex digits".to_owned()))?,
        ),
        _ => {
            return Err(ManageError::Invalid(
                "an import gives the key as \"key\" or as its \"sha256\", one of them".to_owned(),
            ));
        }
    };
    let record = keys.import(&given, spec, Source::Api, who).await?;
    Ok((StatusCode::CREATED, shown(&record)))
}

async fn update(
    shared: &Shared,
    keys: &Keys,
    id: &str,
    body: &[u8],
    operator: &str,
) -> Result<(StatusCode, String), ManageError> {
    let asked: PatchAsked = read(body)?;
    let who = who(operator, asked.reason.as_deref())?;
    if let Some(plan) = &asked.plan {
        known_plan(shared, plan.as_deref())?;
    }
    let patch = Patch {
        identity: asked.identity,
        plan: asked.plan,
        attributes: asked.attributes,
        enabled: asked.enabled,
        expires_ms: asked.expires_ms,
        name: asked.name,
    };
    let record = keys.update(id, &patch, who).await?;
    Ok((StatusCode::OK, shown(&record)))
}

/// `DELETE /keys/{id}`: the reason in the body (`{"reason": …}`) or, with
/// no body, in the query (`?reason=…`).
async fn revoke(
    keys: &Keys,
    id: &str,
    (body, query): (&[u8], Option<&str>),
    operator: &str,
) -> Result<(StatusCode, String), ManageError> {
    let asked: ReasonAsked = if body.is_empty() {
        ReasonAsked {
            reason: query
                .unwrap_or("")
                .split('&')
                .find_map(|p| p.strip_prefix("reason="))
                .map(super::operations::percent_decoded),
            grace: None,
        }
    } else {
        read(body)?
    };
    let who = who(operator, asked.reason.as_deref())?;
    let record = keys.revoke(id, who).await?;
    Ok((
        StatusCode::OK,
        serde_json::json!({ "revoked": &*record }).to_string(),
    ))
}

async fn rotate(
    keys: &Keys,
    id: &str,
    body: &[u8],
    operator: &str,
) -> Result<(StatusCode, String), ManageError> {
    let asked: ReasonAsked = read(body)?;
    let who = who(operator, asked.reason.as_deref())?;
    // Stated, not assumed: a rotation that ends the old key at once
    // says so ("0s").
    let grace = match asked.grace.as_deref() {
        None => {
            return Err(ManageError::Invalid(
                "a rotation states how long the old key stays valid: \"grace\": \"1h\" (or \"0s\": at once)".to_owned(),
            ));
        }
        Some(g) => crate::config::parse_duration(g)
            .map_err(|e| ManageError::Invalid(format!("grace: {e}")))?,
    };
    let grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX);
    let (made, old): (crate::keys::manage::Made, Arc<Record>) =
        keys.rotate(id, grace_ms, who).await?;
    let body = serde_json::json!({
        "key": made.key,
        "record": &*made.record,
        "old": &*old,
    });
    Ok((StatusCode::CREATED, body.to_string()))
}

/// `GET /audit?identity=…&limit=…`.
async fn audit(shared: &Shared, query: &str) -> Response<Full<Bytes>> {
    let mut identity = None;
    let mut limit = 100;
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("identity", v)) => identity = Some(super::operations::percent_decoded(v)),
            Some(("limit", v)) => limit = v.parse().unwrap_or(limit).clamp(1, MAX_AUDIT),
            _ => {}
        }
    }
    match shared.audit_entries(identity.as_deref(), limit).await {
        Ok(Some(entries)) => json_answer(serde_json::json!({ "entries": entries }).to_string()),
        Ok(None) => problem(
            StatusCode::NOT_FOUND,
            "no audit is kept: the memory store keeps one with a [keys] registry only",
        ),
        Err(e) => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            &format!("the audit could not be read: {e}"),
        ),
    }
}
