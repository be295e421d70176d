//! Per-client limits on a route (`overrides`), and clients exempt by an
//! API key (`exempt_keys`).

use std::collections::BTreeMap;

use toml::Spanned;

use super::{LimitModel, Validator};
use crate::client::{ClientRule, Known, Part, Written, sha256};
use crate::routes::{ClientSet, KeyExemption, Override, Policy};

/// `overrides = [{ clients = [...], headers = {...}, limits = [...] }]`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct OverrideModel {
    clients: Option<Spanned<Vec<Spanned<String>>>>,
    #[serde(default)]
    headers: BTreeMap<Spanned<String>, Spanned<toml::Value>>,
    limits: Spanned<Vec<Spanned<LimitModel>>>,
}

/// `exempt_keys = { "X-Internal-Key" = ["k1", "sha256:<hex>"] }`.
pub(super) type ExemptKeysModel = BTreeMap<Spanned<String>, Spanned<Vec<Spanned<String>>>>;

impl OverrideModel {
    /// Its limits, as written.
    pub(super) fn limits(&self) -> &Spanned<Vec<Spanned<LimitModel>>> {
        &self.limits
    }
}

impl Validator<'_> {
    /// A route's overrides; `client` is how the route identifies clients,
    /// which says what a `clients` entry is. `policies` are their limits,
    /// compiled (`None` where they have problems, already reported).
    pub(super) fn overrides(
        &mut self,
        models: &[Spanned<OverrideModel>],
        client: Option<&ClientRule>,
        policies: Vec<Option<Policy>>,
    ) -> Option<Vec<Override>> {
        let mut out = Vec::with_capacity(models.len());
        let mut ok = true;
        for (model, policy) in models.iter().zip(policies) {
            let m = model.get_ref();
            let clients = match &m.clients {
                None => Some(None),
                Some(list) => self.client_set(list, client).map(Some),
            };
            let headers = self.header_conditions(&m.headers);
            if m.clients.is_none() && m.headers.is_empty() {
                self.problem(
                    model.span(),
                    "an override needs clients = [...] or headers = {...} (whom it applies to)",
                );
                ok = false;
                continue;
            }
            match (clients, headers, policy) {
                (Some(clients), Some(headers), Some(policy)) if !policy.limits.is_empty() => out
                    .push(Override {
                        clients,
                        headers,
                        policy,
                    }),
                _ => ok = false,
            }
        }
        ok.then_some(out)
    }

    fn client_set(
        &mut self,
        list: &Spanned<Vec<Spanned<String>>>,
        client: Option<&ClientRule>,
    ) -> Option<ClientSet> {
        let rule = client?;
        let by_address = match rule.parts.as_slice() {
            [Part::RemoteAddr | Part::ForwardedFor] => true,
            [Part::Header(_) | Part::PathParam { .. } | Part::Claim(_)] => false,
            _ => {
                self.problem(
                    list.span(),
                    "override clients need a route whose client is one address, header, path parameter or claim (not composite or global)",
                );
                return None;
            }
        };
        let mut set = ClientSet::default();
        let mut ok = true;
        for entry in list.get_ref() {
            let text = entry.get_ref();
            if by_address {
                match super::parse_cidr(text) {
                    Some(net) => set.nets.push(net),
                    None => {
                        self.problem(
                            entry.span(),
                            format!("{text:?} is not an address or CIDR (this route counts clients by address)"),
                        );
                        ok = false;
                    }
                }
                continue;
            }
            match Written::read(text) {
                Some(Written::Value(v)) if v.len() > rule.max_len => {
                    // Such an id is counted by its SHA-256.
                    set.values.insert(Written::Digest(sha256(&v)), ());
                }
                Some(written) => set.values.insert(written, ()),
                None => {
                    self.problem(entry.span(), Written::BAD_DIGEST);
                    ok = false;
                }
            }
        }
        ok.then_some(set)
    }

    /// `exempt_keys`, by header.
    pub(super) fn exempt_keys(&mut self, model: &ExemptKeysModel) -> Vec<KeyExemption> {
        let mut out = Vec::with_capacity(model.len());
        for (name, values) in model {
            let Some(header) = self.header_name(name) else {
                continue;
            };
            let mut keys = Known::default();
            for value in values.get_ref() {
                match Written::read(value.get_ref()) {
                    Some(Written::Value(v)) if v.is_empty() => {
                        self.problem(value.span(), "an exempt key is not empty");
                    }
                    Some(written) => keys.insert(written, ()),
                    None => self.problem(value.span(), Written::BAD_DIGEST),
                }
            }
            if keys.is_empty() {
                self.problem(values.span(), "exempt_keys lists no key for this header");
                continue;
            }
            out.push(KeyExemption { header, keys });
        }
        out
    }
}
