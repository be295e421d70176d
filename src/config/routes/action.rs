//! What a route does with the requests it takes: forward them to an
//! upstream (and which path prefix it strips first), answer them itself,
//! answer the caller's standing on other routes, or only be decided for
//! front proxies.

use std::ops::Range;
use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use super::{RouteModel, Validator};
use crate::config::upstreams::{Defaults, NamedUpstreams};
use crate::routes::{Action, Match, Respond};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RespondModel {
    status: Spanned<i64>,
    #[serde(default)]
    body: String,
    content_type: Option<Spanned<String>>,
}

impl Validator<'_> {
    /// The route's one action: `upstream`, `respond` or `standing` (none
    /// of them: only decided, where something decides it).
    pub(super) fn action(
        &mut self,
        m: &RouteModel,
        span: Range<usize>,
        (upstreams, defaults): (&NamedUpstreams, Defaults),
    ) -> Option<Action> {
        let name = m.name.get_ref();
        let timeout = self.optional_duration(
            m.upstream_timeout.as_ref(),
            "upstream_timeout",
            defaults.timeout,
        );
        match (&m.upstream, &m.respond, &m.standing) {
            (Some(u), None, None) => self
                .route_upstream(u, upstreams, defaults, timeout?)
                .map(Action::Upstream),
            (None, Some(r), None) => {
                if let Some(t) = &m.upstream_timeout {
                    self.problem(t.span(), "upstream_timeout has no meaning with respond");
                }
                self.respond(r).map(Action::Respond)
            }
            (None, None, Some(list)) => self.standing(list),
            // Front proxies ask the decision listener about it; the proxy
            // listener has nothing to do with it.
            (None, None, None) if defaults.decisions || m.descriptor.is_some() => {
                Some(Action::Decide)
            }
            (None, None, None) => {
                self.problem(
                    span,
                    format!(
                        "route {name:?} needs upstream = \"http://host:port\" or respond = {{ status = 200 }} (or, to be only decided for front proxies, [server] decision_listen)"
                    ),
                );
                None
            }
            (u, r, st) => {
                let given = [
                    ("upstream", u.as_ref().map(Spanned::span)),
                    ("respond", r.as_ref().map(Spanned::span)),
                    ("standing", st.as_ref().map(Spanned::span)),
                ];
                self.more_than_one_action(name, span, given);
                None
            }
        }
    }

    /// `standing`: the routes whose standing the caller reads.
    fn standing(&mut self, list: &Spanned<Vec<Spanned<String>>>) -> Option<Action> {
        if list.get_ref().is_empty() {
            self.problem(
                list.span(),
                "standing lists the routes whose standing the caller reads; name at least one",
            );
            return None;
        }
        Some(Action::Standing(
            list.get_ref()
                .iter()
                .map(|n| Arc::from(n.get_ref().as_str()))
                .collect(),
        ))
    }

    /// Two or three of `upstream`, `respond` and `standing`, reported at
    /// the first given.
    fn more_than_one_action(
        &mut self,
        name: &str,
        span: Range<usize>,
        given: [(&'static str, Option<Range<usize>>); 3],
    ) {
        let given: Vec<(&str, Range<usize>)> = given
            .into_iter()
            .filter_map(|(key, at)| Some((key, at?)))
            .collect();
        let names: Vec<&str> = given.iter().map(|(key, _)| *key).collect();
        let which = match names[..] {
            [a, b] => format!("both {a} and {b}"),
            _ => "upstream, respond and standing".to_owned(),
        };
        let at = given.first().map_or(span, |(_, at)| at.clone());
        self.problem(at, format!("route {name:?} has {which}; keep one"));
    }

    /// A route's `strip_prefix`: a path of whole segments (`/api`), on a
    /// route that forwards, which its `path_prefix` (if any) begins with,
    /// so that it applies to every request the route matches.
    pub(super) fn strip_prefix(
        &mut self,
        m: &RouteModel,
        matcher: Option<&Match>,
    ) -> Option<Option<Box<str>>> {
        let Some(prefix) = &m.strip_prefix else {
            return Some(None);
        };
        let text = prefix.get_ref();
        if !text.starts_with('/') || text.len() < 2 || text.ends_with('/') || text.contains("//") {
            self.problem(
                prefix.span(),
                format!("strip_prefix {text:?} must be a path of whole segments, like \"/api\" or \"/api/v1\" (starting with '/', not ending with one)"),
            );
            return None;
        }
        if m.upstream.is_none() {
            self.problem(
                prefix.span(),
                "strip_prefix applies only to a route with an upstream",
            );
            return None;
        }
        if let Some(path_prefix) = matcher.and_then(|m| m.path_prefix.as_deref()) {
            let covered = path_prefix
                .get(..text.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(text))
                && matches!(path_prefix.as_bytes().get(text.len()), None | Some(b'/'));
            if !covered {
                self.problem(
                    prefix.span(),
                    format!("strip_prefix {text:?} is not where the route's path_prefix {path_prefix:?} begins, so some requests would keep it; use a prefix of the path_prefix"),
                );
                return None;
            }
        }
        Some(Some(text.as_str().into()))
    }

    fn respond(&mut self, r: &Spanned<RespondModel>) -> Option<Respond> {
        let m = r.get_ref();
        let status = match u16::try_from(*m.status.get_ref())
            .ok()
            .and_then(|s| http::StatusCode::from_u16(s).ok())
        {
            Some(s) => Some(s),
            None => {
                self.problem(
                    m.status.span(),
                    "status must be an HTTP status code from 100 to 999",
                );
                None
            }
        };
        let content_type = self.content_type(m.content_type.as_ref(), "content_type");
        Some(Respond {
            status: status?,
            body: bytes::Bytes::from(m.body.clone()),
            content_type: content_type?,
        })
    }
}
