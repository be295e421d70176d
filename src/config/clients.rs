//! A route's `client = { … }`: who a request counts as.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::client::{ClientRule, Failures, MissingHeader, Part, Repeated, TooLong};
use crate::jwt::{self, ClaimRule};
use crate::routes::Template;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ClientModel {
    from: Option<Spanned<String>>,
    name: Option<Spanned<String>>,
    missing: Option<Spanned<String>>,
    parts: Option<Spanned<Vec<Spanned<String>>>>,
    ipv6_prefix: Option<Spanned<i64>>,
    repeated: Option<Spanned<String>>,
    // from = "jwt" (or a "jwt:<claim>" part)
    claim: Option<Spanned<String>>,
    algorithm: Option<Spanned<String>>,
    secret_file: Option<Spanned<String>>,
    key_file: Option<Spanned<String>>,
    jwks_file: Option<Spanned<String>>,
    issuer: Option<Spanned<String>>,
    audience: Option<Spanned<String>>,
    leeway: Option<Spanned<String>>,
    failures_per_minute: Option<Spanned<i64>>,
}

impl ClientModel {
    /// Whether this names the whole route (`from = "global"`), when it
    /// names a source at all.
    pub(super) fn names_global(&self) -> Option<bool> {
        self.from.as_ref().map(|f| f.get_ref() == "global")
    }
}

/// Failed credentials an address may send a minute on a route that
/// rejects requests without a valid token, by default.
const DEFAULT_FAILURES_PER_MINUTE: usize = 20;

/// Clock skew tolerated on a token's `exp` and `nbf` by default.
const DEFAULT_LEEWAY: Duration = Duration::from_secs(30);

/// Where a route's client rule may read: the route's path template.
pub(super) struct Context<'a> {
    pub template: Option<&'a Template>,
    pub ignore_case: bool,
    pub long_ids: (usize, TooLong),
}

impl Validator<'_> {
    pub(super) fn client(
        &mut self,
        model: Option<&Spanned<ClientModel>>,
        cx: &Context<'_>,
    ) -> Option<ClientRule> {
        let (max_len, too_long) = cx.long_ids;
        let Some(model) = model else {
            return Some(ClientRule {
                max_len,
                too_long,
                ..ClientRule::remote_addr()
            });
        };
        let m = model.get_ref();
        let from = m
            .from
            .as_ref()
            .map_or("remote_addr", |f| f.get_ref().as_str());
        let from_span = m.from.as_ref().map_or_else(|| model.span(), Spanned::span);
        let missing = self.choice(m.missing.as_ref(), "missing", &MissingHeader::NAMES);
        let ipv6_prefix = match &m.ipv6_prefix {
            None => Some(128),
            Some(p) => match u8::try_from(*p.get_ref()) {
                Ok(bits @ 1..=128) => Some(bits),
                _ => {
                    self.problem(
                        p.span(),
                        "ipv6_prefix must be a prefix length from 1 to 128",
                    );
                    None
                }
            },
        };
        let misplaced = |v: &mut Self, key: &str, span: Option<Range<usize>>, wanted: &str| {
            if let Some(span) = span {
                v.problem(span, format!("{key} is only used with {wanted}"));
            }
        };
        if !matches!(from, "header" | "path") {
            misplaced(
                self,
                "name",
                m.name.as_ref().map(Spanned::span),
                "from = \"header\" or from = \"path\"",
            );
        }
        if from != "composite" {
            misplaced(
                self,
                "parts",
                m.parts.as_ref().map(Spanned::span),
                "from = \"composite\"",
            );
        }
        let uses_jwt = from == "jwt"
            || m.parts
                .as_ref()
                .is_some_and(|p| p.get_ref().iter().any(|p| p.get_ref().starts_with("jwt:")));
        if !uses_jwt {
            for (key, span) in [
                ("claim", m.claim.as_ref().map(Spanned::span)),
                ("algorithm", m.algorithm.as_ref().map(Spanned::span)),
                ("secret_file", m.secret_file.as_ref().map(Spanned::span)),
                ("key_file", m.key_file.as_ref().map(Spanned::span)),
                ("jwks_file", m.jwks_file.as_ref().map(Spanned::span)),
                ("issuer", m.issuer.as_ref().map(Spanned::span)),
                ("audience", m.audience.as_ref().map(Spanned::span)),
                ("leeway", m.leeway.as_ref().map(Spanned::span)),
            ] {
                misplaced(self, key, span, "from = \"jwt\" or a \"jwt:<claim>\" part");
            }
        }
        let parts = match from {
            "remote_addr" => Some(vec![Part::RemoteAddr]),
            "forwarded_for" => Some(vec![Part::ForwardedFor]),
            "global" => Some(vec![Part::Global]),
            "header" => match &m.name {
                Some(name) => self.header_name(name).map(|h| vec![Part::Header(h)]),
                None => {
                    self.problem(
                        from_span,
                        "from = \"header\" needs name = \"X-Api-Key\" (the header to read)",
                    );
                    None
                }
            },
            "path" => match &m.name {
                Some(name) => self.path_param(name, cx).map(|p| vec![p]),
                None => {
                    self.problem(
                        from_span,
                        "from = \"path\" needs name = \"id\", a {id} segment of the route's match path",
                    );
                    None
                }
            },
            "jwt" => match &m.claim {
                Some(claim) => self
                    .claim_rule(m, claim.get_ref(), from_span.clone())
                    .map(|r| vec![Part::Claim(r)]),
                None => {
                    self.problem(
                        from_span,
                        "from = \"jwt\" needs claim = \"sub\" (the verified claim to count by)",
                    );
                    None
                }
            },
            "composite" => match &m.parts {
                Some(list) if !list.get_ref().is_empty() => {
                    let parts: Vec<Option<Part>> =
                        list.get_ref().iter().map(|p| self.part(p, m, cx)).collect();
                    parts.into_iter().collect()
                }
                Some(list) => {
                    self.problem(list.span(), "parts needs at least one entry");
                    None
                }
                None => {
                    self.problem(
                        from_span,
                        "from = \"composite\" needs parts, e.g. [\"header:X-Api-Key\", \"remote_addr\"]",
                    );
                    None
                }
            },
            other => {
                self.problem(
                    from_span,
                    format!(
                        "from {other:?} is not one of \"remote_addr\", \"header\", \"forwarded_for\", \"path\", \"jwt\", \"global\", \"composite\""
                    ),
                );
                None
            }
        };
        let repeated = self.choice(m.repeated.as_ref(), "repeated", &Repeated::NAMES);
        let parts = parts?;
        if !parts
            .iter()
            .any(|p| matches!(p, Part::Header(_) | Part::Claim(_)))
        {
            misplaced(
                self,
                "missing",
                m.missing.as_ref().map(Spanned::span),
                "a header or jwt part",
            );
        }
        if !parts.iter().any(|p| matches!(p, Part::Header(_))) {
            misplaced(
                self,
                "repeated",
                m.repeated.as_ref().map(Spanned::span),
                "a header part",
            );
        }
        let missing = missing?;
        let checks_tokens =
            missing == MissingHeader::Reject && parts.iter().any(|p| matches!(p, Part::Claim(_)));
        if !checks_tokens {
            misplaced(
                self,
                "failures_per_minute",
                m.failures_per_minute.as_ref().map(Spanned::span),
                "a jwt part and missing = \"reject\"",
            );
        }
        let failures = self.bounded(
            m.failures_per_minute.as_ref(),
            DEFAULT_FAILURES_PER_MINUTE,
            0..=1_000_000,
            "failures_per_minute must be a whole number from 0 (no limit) to 1000000",
        )?;
        Some(ClientRule {
            parts,
            missing,
            ipv6_prefix: ipv6_prefix?,
            repeated: repeated?,
            max_len,
            too_long,
            failures: (checks_tokens && failures > 0)
                .then(|| Arc::new(Failures::new(u32::try_from(failures).unwrap_or(u32::MAX)))),
        })
    }

    pub(super) fn header_name(&mut self, name: &Spanned<String>) -> Option<HeaderName> {
        match HeaderName::from_bytes(name.get_ref().as_bytes()) {
            Ok(header) => Some(header),
            Err(_) => {
                self.problem(
                    name.span(),
                    format!("{:?} is not a valid header name", name.get_ref()),
                );
                None
            }
        }
    }

    fn path_param(&mut self, name: &Spanned<String>, cx: &Context<'_>) -> Option<Part> {
        let index = cx.template.and_then(|t| t.index_of(name.get_ref()));
        match index {
            Some(index) => Some(Part::PathParam {
                name: name.get_ref().as_str().into(),
                index,
                fold_case: cx.ignore_case,
            }),
            None => {
                self.problem(
                    name.span(),
                    format!(
                        "path parameter {:?} is not a {{{}}} segment of this route's match path (e.g. path = \"/users/{{{}}}/orders\")",
                        name.get_ref(),
                        name.get_ref(),
                        name.get_ref()
                    ),
                );
                None
            }
        }
    }

    fn part(&mut self, part: &Spanned<String>, m: &ClientModel, cx: &Context<'_>) -> Option<Part> {
        let text = part.get_ref().as_str();
        let named = |prefix: &str| {
            text.strip_prefix(prefix)
                .map(|name| Spanned::new(part.span(), name.to_owned()))
        };
        match text {
            "remote_addr" => return Some(Part::RemoteAddr),
            "forwarded_for" => return Some(Part::ForwardedFor),
            _ => {}
        }
        if let Some(name) = named("header:") {
            return self.header_name(&name).map(Part::Header);
        }
        if let Some(name) = named("path:") {
            return self.path_param(&name, cx);
        }
        if let Some(claim) = named("jwt:") {
            return self
                .claim_rule(m, claim.get_ref(), part.span())
                .map(Part::Claim);
        }
        self.problem(
            part.span(),
            format!(
                "part {text:?} is not one of \"remote_addr\", \"forwarded_for\", \"header:<name>\", \"path:<param>\", \"jwt:<claim>\""
            ),
        );
        None
    }

    /// The verification settings of `m` for `claim`.
    fn claim_rule(
        &mut self,
        m: &ClientModel,
        claim: &str,
        span: Range<usize>,
    ) -> Option<Arc<ClaimRule>> {
        if claim.is_empty() {
            self.problem(span.clone(), "the claim's name is empty");
        }
        let Some(algorithm) = &m.algorithm else {
            self.problem(
                span,
                "a jwt client needs algorithm = \"HS256\", \"RS256\" or \"ES256\" (tokens signed otherwise are refused)",
            );
            return None;
        };
        let algorithm = self.choice(Some(algorithm), "algorithm", &jwt::Algorithm::NAMES)?;
        let sources = [&m.secret_file, &m.key_file, &m.jwks_file];
        let given = sources.iter().filter(|s| s.is_some()).count();
        if given != 1 {
            self.problem(
                span,
                "a jwt client needs exactly one of secret_file (HS256), key_file (a PEM public key) or jwks_file (a JWK Set)",
            );
            return None;
        }
        let read = |v: &mut Self, file: &Spanned<String>, key: &str| -> Option<Vec<u8>> {
            let path = v.resolve(file);
            match std::fs::read(&path) {
                Ok(bytes) => Some(bytes),
                Err(e) => {
                    v.problem(
                        file.span(),
                        format!("cannot read {key} {}: {e}", path.display()),
                    );
                    None
                }
            }
        };
        let source = [&m.secret_file, &m.key_file, &m.jwks_file]
            .into_iter()
            .flatten()
            .next()
            .map(|f| self.resolve(f));
        let keys = if let Some(file) = &m.secret_file {
            if algorithm != jwt::Algorithm::Hs256 {
                self.problem(
                    file.span(),
                    "secret_file is for HS256; RS256 and ES256 verify with key_file or jwks_file",
                );
                return None;
            }
            let secret = read(self, file, "secret_file")?;
            let secret = secret.trim_ascii_end();
            if secret.len() < 32 {
                self.problem(
                    file.span(),
                    "an HS256 secret must be at least 32 bytes (RFC 7518 §3.2)",
                );
                return None;
            }
            vec![(None, jwt::hmac_key(secret))]
        } else if let Some(file) = &m.key_file {
            let pem = read(self, file, "key_file")?;
            match jwt::pem_key(&pem, algorithm) {
                Ok(key) => vec![(None, key)],
                Err(e) => {
                    self.problem(file.span(), format!("key_file: {e}"));
                    return None;
                }
            }
        } else if let Some(file) = &m.jwks_file {
            let json = read(self, file, "jwks_file")?;
            match jwt::jwks_keys(&json, algorithm) {
                Ok(keys) => keys,
                Err(e) => {
                    self.problem(file.span(), format!("jwks_file: {e}"));
                    return None;
                }
            }
        } else {
            return None;
        };
        let leeway = match &m.leeway {
            None => Some(DEFAULT_LEEWAY),
            Some(l) => match super::parse_duration(l.get_ref()) {
                Ok(d) if d <= Duration::from_secs(600) => Some(d),
                Ok(_) => {
                    self.problem(l.span(), "leeway is at most 10m");
                    None
                }
                Err(e) => {
                    self.problem(l.span(), format!("leeway: {e}"));
                    None
                }
            },
        };
        Some(Arc::new(ClaimRule {
            claim: claim.into(),
            algorithm,
            keys,
            issuer: m.issuer.as_ref().map(|i| i.get_ref().clone()),
            audience: m.audience.as_ref().map(|a| a.get_ref().clone()),
            leeway: leeway?,
            source,
            verified: jwt::Verified::default(),
        }))
    }
}
