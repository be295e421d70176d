//! A route's `match = { … }`: which requests it takes, by path (or path
//! template), methods, host and headers, each checked in the form requests
//! are matched in.

use std::collections::BTreeMap;

use serde::Deserialize;
use toml::Spanned;

use super::Validator;
use crate::routes::{HostMatch, Match, Template};

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct MatchModel {
    path_prefix: Option<Spanned<String>>,
    path: Option<Spanned<String>>,
    methods: Option<Spanned<Vec<Spanned<String>>>>,
    host: Option<Spanned<String>>,
    #[serde(default)]
    ignore_case: bool,
    #[serde(default)]
    headers: BTreeMap<Spanned<String>, Spanned<toml::Value>>,
}

/// A matcher's `path_prefix`, `path` and template (with whether it is a
/// prefix): a template replaces the other two.
type Paths = (Option<String>, Option<String>, Option<(Template, bool)>);

impl Validator<'_> {
    pub(super) fn matcher(&mut self, model: Option<&Spanned<MatchModel>>) -> Option<Match> {
        let default = MatchModel::default();
        let m = model.map_or(&default, Spanned::get_ref);
        let paths = self.match_paths(m);
        let headers = self.header_conditions(&m.headers);
        let methods = self.match_methods(m.methods.as_ref());
        let host = self.match_host(m.host.as_ref());
        let (path_prefix, path, template) = paths?;
        Some(Match {
            path_prefix,
            path,
            template,
            headers: headers?,
            methods: methods?,
            host: host?,
            ignore_case: m.ignore_case,
        })
    }

    /// `path_prefix` or `path`, in normal form; a path with `{param}`
    /// segments is a template, matched segment by segment instead.
    fn match_paths(&mut self, m: &MatchModel) -> Option<Paths> {
        let mut ok = true;
        let path_prefix = match &m.path_prefix {
            Some(p) => {
                let r = self.match_path(p, "path_prefix");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        let path = match &m.path {
            Some(p) => {
                let r = self.match_path(p, "path");
                ok &= r.is_some();
                r
            }
            None => None,
        };
        if let (Some(_), Some(p)) = (&m.path_prefix, &m.path) {
            self.problem(p.span(), "match has both path and path_prefix; keep one");
            ok = false;
        }
        let mut template = None;
        for (text, spanned, prefix) in [
            (&path, &m.path, false),
            (&path_prefix, &m.path_prefix, true),
        ] {
            let (Some(text), Some(spanned)) = (text, spanned) else {
                continue;
            };
            match Template::parse(text) {
                Ok(None) => {}
                Ok(Some(t)) => template = Some((t, prefix)),
                Err(e) => {
                    self.problem(spanned.span(), e);
                    ok = false;
                }
            }
        }
        let (path, path_prefix) = match &template {
            Some(_) => (None, None),
            None => (path, path_prefix),
        };
        ok.then_some((path_prefix, path, template))
    }

    /// One path as requests are matched: starting with '/', without
    /// `;parameters`, normalised (a template aside).
    fn match_path(&mut self, p: &Spanned<String>, key: &str) -> Option<String> {
        let s = p.get_ref();
        if !s.starts_with('/') {
            self.problem(p.span(), format!("{key} must start with '/'"));
            return None;
        }
        if s.contains(';') {
            self.problem(
                p.span(),
                format!(
                    "{key} {s:?} has ';': requests are matched without their ;parameters, so write the path without them"
                ),
            );
            return None;
        }
        let normal = crate::routes::normalize_path(s);
        if normal != *s && !s.contains('{') {
            self.problem(
                p.span(),
                format!(
                    "{key} {s:?} is not in normal form (requests are matched after normalising); write {normal:?}"
                ),
            );
            return None;
        }
        Some(s.clone())
    }

    /// `methods`, sorted and each once (empty: every method).
    fn match_methods(
        &mut self,
        list: Option<&Spanned<Vec<Spanned<String>>>>,
    ) -> Option<Vec<http::Method>> {
        let mut ok = true;
        let mut methods = Vec::new();
        if let Some(list) = list {
            if list.get_ref().is_empty() {
                self.problem(
                    list.span(),
                    "methods is empty, so the route would match nothing; remove the key to match every method",
                );
                ok = false;
            }
            for method in list.get_ref() {
                match http::Method::from_bytes(method.get_ref().to_ascii_uppercase().as_bytes()) {
                    Ok(parsed) => methods.push(parsed),
                    Err(_) => {
                        self.problem(
                            method.span(),
                            format!("{:?} is not an HTTP method", method.get_ref()),
                        );
                        ok = false;
                    }
                }
            }
        }
        methods.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        methods.dedup();
        ok.then_some(methods)
    }

    /// `host`: a host name, with a port or without.
    fn match_host(&mut self, host: Option<&Spanned<String>>) -> Option<Option<HostMatch>> {
        let Some(h) = host else {
            return Some(None);
        };
        match HostMatch::parse(h.get_ref()) {
            Some(host) => Some(Some(host)),
            None => {
                self.problem(
                    h.span(),
                    format!("host {:?} is not a host name such as \"api.example.com\" or \"api.example.com:8080\"", h.get_ref()),
                );
                None
            }
        }
    }
}
