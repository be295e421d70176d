//! `[store]`: where limits are counted, and what happens when it fails.

use serde::Deserialize;
use toml::Spanned;

use std::ops::Range;
use std::path::PathBuf;

use super::{
    DEFAULT_STORE_TIMEOUT, Endpoint, OnError, RedisSettings, Store, Tls, Validator, valid_name,
};
use crate::limit::settings::IdSecret;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct StoreModel {
    backend: Option<Spanned<String>>,
    url: Option<Spanned<String>>,
    urls: Option<Spanned<Vec<String>>>,
    key_prefix: Option<Spanned<String>>,
    timeout: Option<Spanned<String>>,
    on_error: Option<Spanned<String>>,
    local_instances: Option<Spanned<i64>>,
    tls_ca_file: Option<Spanned<String>>,
    tls_cert_file: Option<Spanned<String>>,
    tls_key_file: Option<Spanned<String>>,
    master_name: Option<Spanned<String>>,
    password_file: Option<Spanned<String>>,
    id_secret: Option<Spanned<String>>,
    id_secret_file: Option<Spanned<String>>,
}

impl Validator<'_> {
    pub(super) fn store(&mut self, model: Option<&Spanned<StoreModel>>) -> Option<Store> {
        let Some(model) = model else {
            return Some(Store::Memory);
        };
        let m = model.get_ref();
        let backend = m
            .backend
            .as_ref()
            .map_or("memory", |b| b.get_ref().as_str());
        let backend_span = m
            .backend
            .as_ref()
            .map_or_else(|| model.span(), Spanned::span);
        let key_prefix = self.key_prefix(m.key_prefix.as_ref());
        let timeout = self.optional_duration(m.timeout.as_ref(), "timeout", DEFAULT_STORE_TIMEOUT);
        let on_error = self.choice(m.on_error.as_ref(), "on_error", &OnError::NAMES);
        let local_instances = self.local_instances(m.local_instances.as_ref(), on_error);
        match backend {
            "memory" => {
                self.keys_of_redis(m);
                Some(Store::Memory)
            }
            "redis" | "redis_cluster" | "redis_sentinel" => {
                self.keys_of_other_backends(m, backend);
                let password = self.password_file(m.password_file.as_ref());
                let given = password.as_ref().and_then(|p| p.as_deref());
                let endpoint = self.redis_endpoint(m, backend, backend_span, given);
                let tls = self.tls(m);
                if endpoint.as_ref().is_some_and(|e| !e.uses_tls())
                    && let Some(key) = [&m.tls_ca_file, &m.tls_cert_file, &m.tls_key_file]
                        .into_iter()
                        .flatten()
                        .next()
                {
                    self.problem(key.span(), "TLS files apply only to rediss:// URLs");
                }
                password?;
                let id_secret = self.id_secret(m);
                Some(Store::Redis(RedisSettings {
                    id_secret: id_secret?,
                    endpoint: endpoint?,
                    key_prefix: key_prefix?,
                    timeout: timeout?,
                    on_error: on_error?,
                    local_instances: local_instances?,
                    tls: tls?,
                }))
            }
            other => {
                self.problem(
                    backend_span,
                    format!(
                        "backend {other:?} is not one of \"memory\", \"redis\", \"redis_cluster\", \"redis_sentinel\""
                    ),
                );
                None
            }
        }
    }

    /// `key_prefix`: what the store's keys start with ("floodgate").
    fn key_prefix(&mut self, prefix: Option<&Spanned<String>>) -> Option<String> {
        match prefix {
            Some(p) if !valid_name(p.get_ref()) => {
                self.problem(
                    p.span(),
                    "key_prefix may use only letters, digits, '_', '-' and '.' (1 to 64 of them)",
                );
                None
            }
            Some(p) => Some(p.get_ref().clone()),
            None => Some("floodgate".to_owned()),
        }
    }

    /// `local_instances`: how many instances share the limits while the
    /// store is away, with `on_error = "local"` (1 when not given).
    fn local_instances(
        &mut self,
        count: Option<&Spanned<i64>>,
        on_error: Option<OnError>,
    ) -> Option<u64> {
        match count {
            None => Some(1),
            Some(n) if (1..=10_000).contains(n.get_ref()) => {
                if on_error != Some(OnError::Local) {
                    self.problem(
                        n.span(),
                        "local_instances is only used with on_error = \"local\"",
                    );
                }
                Some(*n.get_ref() as u64)
            }
            Some(n) => {
                self.problem(
                    n.span(),
                    "local_instances must be a whole number from 1 to 10000",
                );
                None
            }
        }
    }

    /// The keys only Redis reads, given to the memory backend.
    fn keys_of_redis(&mut self, m: &StoreModel) {
        for (key, present) in [
            ("url", m.url.as_ref().map(Spanned::span)),
            ("urls", m.urls.as_ref().map(Spanned::span)),
            ("password_file", m.password_file.as_ref().map(Spanned::span)),
            ("id_secret", m.id_secret.as_ref().map(Spanned::span)),
            (
                "id_secret_file",
                m.id_secret_file.as_ref().map(Spanned::span),
            ),
        ] {
            if let Some(span) = present {
                self.problem(
                    span,
                    format!("{key} has no meaning for backend \"memory\"; remove it or set backend = \"redis\""),
                );
            }
        }
    }

    /// `url` where `urls` is read (or the other way round), and
    /// `master_name` without Sentinel.
    fn keys_of_other_backends(&mut self, m: &StoreModel, backend: &str) {
        let (wanted, unwanted) = if backend == "redis" {
            ("url", m.urls.as_ref().map(Spanned::span))
        } else {
            ("urls", m.url.as_ref().map(Spanned::span))
        };
        if let Some(span) = unwanted {
            self.problem(
                span,
                format!("backend {backend:?} takes {wanted}, not this key"),
            );
        }
        if backend != "redis_sentinel"
            && let Some(name) = &m.master_name
        {
            self.problem(
                name.span(),
                "master_name is only used with backend = \"redis_sentinel\"",
            );
        }
    }

    /// Where a Redis backend is reached: one URL, a cluster's, or
    /// Sentinel's with the monitored group.
    fn redis_endpoint(
        &mut self,
        m: &StoreModel,
        backend: &str,
        backend_span: Range<usize>,
        password: Option<&str>,
    ) -> Option<Endpoint> {
        let example = if backend == "redis" {
            "url = \"redis://host:6379/0\""
        } else {
            "urls = [\"redis://10.0.0.1:7000\", \"redis://10.0.0.2:7000\"]"
        };
        let urls = match &m.urls {
            Some(list) if backend != "redis" && !list.get_ref().is_empty() => {
                let urls: Vec<Option<String>> = list
                    .get_ref()
                    .iter()
                    .map(|u| self.redis_url(u, list.span(), password))
                    .collect();
                urls.into_iter().collect::<Option<Vec<_>>>()
            }
            _ => None,
        };
        match (backend, &m.url, urls) {
            ("redis", Some(u), _) => self
                .redis_url(u.get_ref(), u.span(), password)
                .map(Endpoint::Single),
            ("redis_cluster", _, Some(urls)) => Some(Endpoint::Cluster(urls)),
            ("redis_sentinel", _, Some(urls)) => match &m.master_name {
                Some(name) if !name.get_ref().is_empty() => Some(Endpoint::Sentinel {
                    urls,
                    master: name.get_ref().clone(),
                }),
                _ => {
                    self.problem(
                        backend_span,
                        "backend \"redis_sentinel\" needs master_name = \"mymaster\" (the monitored group)",
                    );
                    None
                }
            },
            _ => {
                self.problem(backend_span, format!("backend {backend:?} needs {example}"));
                None
            }
        }
    }

    /// One Redis URL, `${NAME}` expanded and the password put in.
    fn redis_url(
        &mut self,
        url: &str,
        span: Range<usize>,
        password: Option<&str>,
    ) -> Option<String> {
        let url = match expand_env(url) {
            Ok(url) => url,
            Err(problem) => {
                self.problem(span, problem);
                return None;
            }
        };
        if !(url.starts_with("redis://") || url.starts_with("rediss://")) {
            self.problem(
                span,
                format!("{url:?} must start with redis:// or rediss://"),
            );
            return None;
        }
        match password {
            Some(password) => match with_password(&url, password) {
                Ok(url) => Some(url),
                Err(problem) => {
                    self.problem(span, problem);
                    None
                }
            },
            None => Some(url),
        }
    }

    /// The secret client ids are digested with: `id_secret` (with
    /// `${NAME}` expanded) or the first line of `id_secret_file`, at least
    /// 16 bytes.
    fn id_secret(&mut self, m: &StoreModel) -> Option<Option<IdSecret>> {
        let (text, span) = match (&m.id_secret, &m.id_secret_file) {
            (None, None) => return Some(None),
            (Some(_), Some(file)) => {
                self.problem(
                    file.span(),
                    "id_secret and id_secret_file both give the secret; keep one",
                );
                return None;
            }
            (Some(secret), None) => match expand_env(secret.get_ref()) {
                Ok(text) => (text, secret.span()),
                Err(problem) => {
                    self.problem(secret.span(), problem);
                    return None;
                }
            },
            (None, Some(file)) => (self.first_line(file, "id_secret_file")?, file.span()),
        };
        if text.len() < 16 {
            self.problem(
                span,
                "the id secret must be at least 16 bytes (32 random ones are best: openssl rand -hex 32)",
            );
            return None;
        }
        Some(Some(IdSecret(text.into_bytes().into_boxed_slice())))
    }

    /// The password in `password_file` (its first line), if one is named:
    /// `Some(None)` when none is, `None` when the file is a problem.
    fn password_file(&mut self, file: Option<&Spanned<String>>) -> Option<Option<String>> {
        match file {
            None => Some(None),
            Some(file) => self.first_line(file, "password_file").map(Some),
        }
    }

    /// The first line of the file `file` names (relative to the
    /// configuration file), without its line end: a secret kept out of the
    /// configuration, as a mounted Kubernetes Secret holds it.
    /// The first line of `file` (configuration key `key`), which must not
    /// be empty.
    pub(super) fn first_line(&mut self, file: &Spanned<String>, key: &str) -> Option<String> {
        let resolved = self.resolve(file);
        match std::fs::read_to_string(&resolved) {
            Ok(text) => match text.lines().next().map(str::trim_end) {
                Some(line) if !line.is_empty() => Some(line.to_owned()),
                _ => {
                    self.problem(
                        file.span(),
                        format!("{key} {} is empty", resolved.display()),
                    );
                    None
                }
            },
            Err(e) => {
                self.problem(
                    file.span(),
                    format!("cannot read {key} {}: {e}", resolved.display()),
                );
                None
            }
        }
    }

    pub(super) fn tls(&mut self, m: &StoreModel) -> Option<Tls> {
        let read = |v: &mut Self, file: &Option<Spanned<String>>, key: &str| match file {
            None => Some(None),
            Some(path) => {
                let resolved = v.path.parent().map_or_else(
                    || PathBuf::from(path.get_ref()),
                    |dir| dir.join(path.get_ref()),
                );
                match std::fs::read(&resolved) {
                    Ok(bytes) if bytes.starts_with(b"-----BEGIN") => Some(Some(bytes)),
                    Ok(_) => {
                        v.problem(
                            path.span(),
                            format!("{key} {:?} is not a PEM file", path.get_ref()),
                        );
                        None
                    }
                    Err(e) => {
                        v.problem(
                            path.span(),
                            format!("cannot read {key} {}: {e}", resolved.display()),
                        );
                        None
                    }
                }
            }
        };
        let ca = read(self, &m.tls_ca_file, "tls_ca_file");
        let cert = read(self, &m.tls_cert_file, "tls_cert_file");
        let key = read(self, &m.tls_key_file, "tls_key_file");
        let client = match (cert?, key?) {
            (Some(cert), Some(key)) => Some((cert, key)),
            (None, None) => None,
            _ => {
                let span = m
                    .tls_cert_file
                    .as_ref()
                    .or(m.tls_key_file.as_ref())
                    .map_or(0..0, Spanned::span);
                self.problem(span, "tls_cert_file and tls_key_file go together");
                return None;
            }
        };
        Some(Tls { ca: ca?, client })
    }
}

/// `text` with each `${NAME}` replaced by the environment variable `NAME`,
/// so that a secret (a Redis password in a URL) need not be in the file.
/// The value goes in as it is: a password with `@`, `:` or `/` in it must
/// be percent-encoded where it is set, or given in `password_file`.
fn expand_env(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(
                "\"${\" without a closing \"}\": write ${NAME} for the environment variable NAME"
                    .to_owned(),
            );
        };
        let name = &after[..end];
        if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Err(format!(
                "${{{name}}} is not an environment variable's name (letters, digits and '_')"
            ));
        }
        match std::env::var(name) {
            Ok(value) => out.push_str(&value),
            Err(_) => {
                return Err(format!(
                    "the environment variable {name} (named as ${{{name}}}) is not set"
                ));
            }
        }
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// `url` with `password` (percent-encoded) as its password, after the user
/// name if it has one.
fn with_password(url: &str, password: &str) -> Result<String, String> {
    let (scheme, rest) = url.split_once("://").unwrap_or(("redis", url));
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let (user, host) = match rest[..authority_end].rsplit_once('@') {
        Some((userinfo, _)) if userinfo.contains(':') => {
            return Err(
                "this URL has a password and password_file gives another: keep one".to_owned(),
            );
        }
        Some((user, _)) => (user, &rest[user.len() + 1..]),
        None => ("", rest),
    };
    let mut encoded = String::with_capacity(password.len());
    for byte in password.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~".contains(&byte) {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    Ok(format!("{scheme}://{user}:{encoded}@{host}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_goes_after_the_user_percent_encoded() {
        assert_eq!(
            with_password("redis://10.0.0.1:6379/2", "p@ss:w/rd").as_deref(),
            Ok("redis://:p%40ss%3Aw%2Frd@10.0.0.1:6379/2")
        );
        assert_eq!(
            with_password("rediss://app@redis.internal", "s3cret").as_deref(),
            Ok("rediss://app:s3cret@redis.internal")
        );
        assert!(with_password("redis://app:old@h", "new").is_err());
    }

    #[test]
    fn environment_variables_are_expanded_and_unset_ones_named() {
        let path = std::env::var("PATH").unwrap_or_default();
        assert_eq!(expand_env("a${PATH}b"), Ok(format!("a{path}b")));
        assert_eq!(expand_env("no variables"), Ok("no variables".to_owned()));
        let unset = expand_env("redis://:${FLOODGATE_TEST_SURELY_UNSET}@h").unwrap_err();
        assert!(unset.contains("FLOODGATE_TEST_SURELY_UNSET"), "{unset}");
        assert!(expand_env("${a-b}").is_err());
        assert!(expand_env("${OPEN").is_err());
    }
}
