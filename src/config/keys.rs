//! `[keys]`, the key registry, and a route's `api_key`: where the route
//! reads the key a client sends.

use std::ops::Range;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use super::{Store, Validator};
use crate::keys::{KeyFrom, Settings};

/// `[keys]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct KeysModel {
    prefix: Option<Spanned<String>>,
    state_file: Option<Spanned<String>>,
    file: Option<Spanned<String>>,
    sync_every: Option<Spanned<String>>,
    failures_per_minute: Option<Spanned<i64>>,
}

/// A route's `api_key = { from = "bearer" }` or `{ from = "header", name
/// = "X-Api-Key" }`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ApiKeyModel {
    from: Spanned<String>,
    name: Option<Spanned<String>>,
}

/// The longest key prefix.
const MAX_PREFIX: usize = 32;

/// The longest time between two looks at the store's changes: changes
/// must reach every instance within a second.
const MAX_SYNC_EVERY: Duration = Duration::from_secs(1);

impl Validator<'_> {
    /// `[keys]`, with the store the registry lives in.
    pub(super) fn keys(
        &mut self,
        model: &Spanned<KeysModel>,
        store: Option<&Store>,
    ) -> Option<Settings> {
        let m = model.get_ref();
        let defaults = Settings::default();
        let prefix = match &m.prefix {
            Some(p)
                if p.get_ref().len() > MAX_PREFIX
                    || !p
                        .get_ref()
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)) =>
            {
                self.problem(
                    p.span(),
                    format!(
                        "prefix: at most {MAX_PREFIX} letters, digits, '-', '_' or '.' (keys are sent in headers)"
                    ),
                );
                None
            }
            Some(p) => Some(p.get_ref().clone()),
            None => Some(defaults.prefix.clone()),
        };
        let sync_every =
            self.optional_duration(m.sync_every.as_ref(), "sync_every", defaults.sync_every);
        if let (Some(every), Some(span)) = (sync_every, m.sync_every.as_ref().map(Spanned::span))
            && (every > MAX_SYNC_EVERY || every < Duration::from_millis(10))
        {
            self.problem(
                span,
                "sync_every: from 10ms to 1s, so that changes reach every instance within a second",
            );
        }
        let state_file = m.state_file.as_ref().map(|f| self.resolve(f));
        match (store, &m.state_file) {
            (Some(Store::Memory), None) => self.problem(
                model.span(),
                "with the memory store, [keys] needs state_file = \"/var/lib/floodgate/keys.json\": the instance's keys are kept there, so that they survive a restart",
            ),
            (Some(Store::Redis(_)), Some(f)) => self.problem(
                f.span(),
                "state_file keeps the memory store's registry; with Redis the keys live in the store",
            ),
            _ => {}
        }
        let failures_per_minute = match &m.failures_per_minute {
            None => Some(defaults.failures_per_minute),
            Some(n) => match u32::try_from(*n.get_ref()) {
                Ok(n) if n <= 1_000_000 => Some(n),
                _ => {
                    self.problem(
                        n.span(),
                        "failures_per_minute must be a whole number from 0 (no limit) to 1000000",
                    );
                    None
                }
            },
        };
        Some(Settings {
            failures_per_minute: failures_per_minute?,
            prefix: prefix?,
            state_file,
            file: m.file.as_ref().map(|f| self.resolve(f)),
            sync_every: sync_every?,
        })
    }

    /// The keys file `[keys] file` names, read whole (its plans among
    /// `plans`): `Some(None)` when none is named, `None` when it cannot be
    /// read or has a problem (reported at `file`, with the file's own
    /// line and column).
    pub(super) fn keys_file(
        &mut self,
        model: &Spanned<KeysModel>,
        plans: &[std::sync::Arc<str>],
    ) -> Option<Option<std::sync::Arc<crate::keys::KeysFile>>> {
        let Some(file) = &model.get_ref().file else {
            return Some(None);
        };
        match super::load_keys_file(&self.resolve(file), plans) {
            Ok(read) => Some(Some(std::sync::Arc::new(read))),
            Err(e) => {
                self.problem(file.span(), format!("file: {e}"));
                None
            }
        }
    }

    /// A route's `api_key`; `has_registry` says whether `[keys]` is given.
    pub(super) fn api_key(
        &mut self,
        model: &Spanned<ApiKeyModel>,
        has_registry: bool,
    ) -> Option<KeyFrom> {
        let m = model.get_ref();
        if !has_registry {
            self.problem(
                model.span(),
                "api_key verifies keys against the key registry: add a [keys] table",
            );
        }
        let from = match (m.from.get_ref().as_str(), &m.name) {
            ("bearer", None) => Some(KeyFrom::Bearer),
            ("bearer", Some(name)) => {
                self.problem(
                    name.span(),
                    "from = \"bearer\" reads Authorization; name applies to from = \"header\"",
                );
                None
            }
            ("header", Some(name)) => self.header_name(name).map(KeyFrom::Header),
            ("header", None) => {
                self.problem(
                    m.from.span(),
                    "from = \"header\" needs name = \"X-Api-Key\" (the header, or gRPC metadata, to read)",
                );
                None
            }
            (other, _) => {
                self.problem(
                    m.from.span(),
                    format!("from {other:?} is not one of \"bearer\", \"header\""),
                );
                None
            }
        };
        from.filter(|_| has_registry)
    }

    /// A route that counts by its key's identity or attributes without
    /// `api_key`: refused at `span`.
    pub(super) fn key_parts_need_api_key(
        &mut self,
        uses_key: bool,
        has_api_key: bool,
        span: Range<usize>,
    ) {
        if uses_key && !has_api_key {
            self.problem(
                span,
                "this route counts by the API key's registry record (from = \"key\", or plans chosen by the key): give it api_key = { from = \"bearer\" } (or a header) so that the key is verified first",
            );
        }
    }
}
