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
        let ipv6_prefix = self.ipv6_prefix(m.ipv6_prefix.as_ref());
        self.keys_of_other_sources(m, from);
        let parts = self.client_parts(m, from, from_span, cx);
        let repeated = self.choice(m.repeated.as_ref(), "repeated", &Repeated::NAMES);
        let parts = parts?;
        self.keys_of_absent_parts(m, &parts);
        let missing = missing?;
        let checks_tokens =
            missing == MissingHeader::Reject && parts.iter().any(|p| matches!(p, Part::Claim(_)));
        if !checks_tokens {
            self.only_with(
                "failures_per_minute",
                m.failures_per_minute.as_ref(),
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

    /// `ipv6_prefix`: how much of an IPv6 address names a client (all
    /// 128 bits when not given).
    fn ipv6_prefix(&mut self, prefix: Option<&Spanned<i64>>) -> Option<u8> {
        let Some(p) = prefix else {
            return Some(128);
        };
        match u8::try_from(*p.get_ref()) {
            Ok(bits @ 1..=128) => Some(bits),
            _ => {
                self.problem(
                    p.span(),
                    "ipv6_prefix must be a prefix length from 1 to 128",
                );
                None
            }
        }
    }

    /// A key given that only another source reads is a problem at it.
    fn only_with<T>(&mut self, key: &str, given: Option<&Spanned<T>>, wanted: &str) {
        if let Some(given) = given {
            self.problem(given.span(), format!("{key} is only used with {wanted}"));
        }
    }

    /// The keys of sources other than `from` (and its parts) that are given.
    fn keys_of_other_sources(&mut self, m: &ClientModel, from: &str) {
        if !matches!(from, "header" | "path" | "key") {
            self.only_with(
                "name",
                m.name.as_ref(),
                "from = \"header\", from = \"path\" or from = \"key\"",
            );
        }
        if from != "composite" {
            self.only_with("parts", m.parts.as_ref(), "from = \"composite\"");
        }
        let uses_jwt = from == "jwt"
            || m.parts
                .as_ref()
                .is_some_and(|p| p.get_ref().iter().any(|p| p.get_ref().starts_with("jwt:")));
        if !uses_jwt {
            for (key, given) in [
                ("claim", &m.claim),
                ("algorithm", &m.algorithm),
                ("secret_file", &m.secret_file),
                ("key_file", &m.key_file),
                ("jwks_file", &m.jwks_file),
                ("issuer", &m.issuer),
                ("audience", &m.audience),
                ("leeway", &m.leeway),
            ] {
                self.only_with(
                    key,
                    given.as_ref(),
                    "from = \"jwt\" or a \"jwt:<claim>\" part",
                );
            }
        }
    }

    /// `missing` and `repeated` given where no part reads a header (or a
    /// token) they could apply to.
    fn keys_of_absent_parts(&mut self, m: &ClientModel, parts: &[Part]) {
        if !parts
            .iter()
            .any(|p| matches!(p, Part::Header(_) | Part::Claim(_)))
        {
            self.only_with("missing", m.missing.as_ref(), "a header or jwt part");
        }
        if !parts.iter().any(|p| matches!(p, Part::Header(_))) {
            self.only_with("repeated", m.repeated.as_ref(), "a header part");
        }
    }

    /// What a client id is made of, read from `from` and the keys it needs.
    fn client_parts(
        &mut self,
        m: &ClientModel,
        from: &str,
        from_span: Range<usize>,
        cx: &Context<'_>,
    ) -> Option<Vec<Part>> {
        match from {
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
            "composite" => self.composite_parts(m, from_span, cx),
            "key" => Some(vec![Part::Key(
                m.name.as_ref().map(|n| n.get_ref().as_str().into()),
            )]),
            other => {
                self.problem(
                    from_span,
                    format!(
                        "from {other:?} is not one of \"remote_addr\", \"header\", \"forwarded_for\", \"path\", \"jwt\", \"key\", \"global\", \"composite\""
                    ),
                );
                None
            }
        }
    }

    /// `from = "composite"`: each of `parts`, in order.
    fn composite_parts(
        &mut self,
        m: &ClientModel,
        from_span: Range<usize>,
        cx: &Context<'_>,
    ) -> Option<Vec<Part>> {
        match &m.parts {
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
        }
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
            "key" => return Some(Part::Key(None)),
            _ => {}
        }
        if let Some(name) = named("key:") {
            return Some(Part::Key(Some(name.get_ref().as_str().into())));
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
                "part {text:?} is not one of \"remote_addr\", \"forwarded_for\", \"header:<name>\", \"path:<param>\", \"jwt:<claim>\", \"key\", \"key:<attribute>\""
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
        let source = sources
            .into_iter()
            .flatten()
            .next()
            .map(|f| self.resolve(f));
        let keys = self.verification_keys(m, algorithm)?;
        let leeway = self.leeway(m.leeway.as_ref());
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

    /// The keys tokens are verified with, from the one file given.
    fn verification_keys(
        &mut self,
        m: &ClientModel,
        algorithm: jwt::Algorithm,
    ) -> Option<Vec<(Option<String>, jwt::Key)>> {
        if let Some(file) = &m.secret_file {
            if algorithm != jwt::Algorithm::Hs256 {
                self.problem(
                    file.span(),
                    "secret_file is for HS256; RS256 and ES256 verify with key_file or jwks_file",
                );
                return None;
            }
            let secret = self.key_file_bytes(file, "secret_file")?;
            let secret = secret.trim_ascii_end();
            if secret.len() < 32 {
                self.problem(
                    file.span(),
                    "an HS256 secret must be at least 32 bytes (RFC 7518 §3.2)",
                );
                return None;
            }
            Some(vec![(None, jwt::hmac_key(secret))])
        } else if let Some(file) = &m.key_file {
            let pem = self.key_file_bytes(file, "key_file")?;
            match jwt::pem_key(&pem, algorithm) {
                Ok(key) => Some(vec![(None, key)]),
                Err(e) => {
                    self.problem(file.span(), format!("key_file: {e}"));
                    None
                }
            }
        } else if let Some(file) = &m.jwks_file {
            let json = self.key_file_bytes(file, "jwks_file")?;
            match jwt::jwks_keys(&json, algorithm) {
                Ok(keys) => Some(keys),
                Err(e) => {
                    self.problem(file.span(), format!("jwks_file: {e}"));
                    None
                }
            }
        } else {
            None
        }
    }

    /// The contents of a key file named by `key`.
    fn key_file_bytes(&mut self, file: &Spanned<String>, key: &str) -> Option<Vec<u8>> {
        let path = self.resolve(file);
        match std::fs::read(&path) {
            Ok(bytes) => Some(bytes),
            Err(e) => {
                self.problem(
                    file.span(),
                    format!("cannot read {key} {}: {e}", path.display()),
                );
                None
            }
        }
    }

    /// `leeway`: the clock skew tolerated on `exp` and `nbf`.
    fn leeway(&mut self, leeway: Option<&Spanned<String>>) -> Option<Duration> {
        let Some(l) = leeway else {
            return Some(DEFAULT_LEEWAY);
        };
        match super::parse_duration(l.get_ref()) {
            Ok(d) if d <= Duration::from_secs(600) => Some(d),
            Ok(_) => {
                self.problem(l.span(), "leeway is at most 10m");
                None
            }
            Err(e) => {
                self.problem(l.span(), format!("leeway: {e}"));
                None
            }
        }
    }
}
