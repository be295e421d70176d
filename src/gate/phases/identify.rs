//! The identify phase: whether the client is exempt, who it is, which
//! limits it falls under (an override's, its plan's or the route's own)
//! and whose count each of them is.

use super::{Context, Found, Limits};
use crate::client::{ClientId, client_address, is_in};
use crate::concurrency::Per;
use crate::gate::rules::Rules;
use crate::limit::CountKey;
use crate::refusal::Refusal;
use crate::routes::{KeySource, Policy};

/// Who the request is from, as far as the limits care.
pub(super) struct Identity<'r> {
    /// The route's `exempt` or `exempt_keys` let it pass unlimited.
    pub(super) exempt: bool,
    /// The client id, when the limits or a per-client cap need one.
    pub(super) client: Option<ClientId>,
    /// The limits the request falls under (an override's, its plan's or
    /// the route's own, numbers carried by its token in place), when the
    /// route limits it.
    pub(super) policy: Option<Limits<'r>>,
    /// Whose count each of those limits is, when not every limit counts
    /// the client on the route (see [`Policy::counting`]).
    pub(super) keys: Vec<CountKey>,
    /// The plan read for the request, by its index, when the route refers
    /// to plans.
    pub(super) plan: Option<usize>,
}

impl Context<'_> {
    /// Whether the client is exempt, its id when anything counts per
    /// client, the limits it falls under and whose count each is. Exempt
    /// clients skip identification too: a health checker need not send
    /// the API key header that limits everyone else.
    pub(super) fn identify<'r>(
        &self,
        rules: &Rules,
        found: &Found<'r>,
        headers: &mut http::HeaderMap,
        matched_path: &str,
    ) -> Result<Identity<'r>, Refusal> {
        let route = found.route;
        let exempt = (!route.exempt.is_empty()
            && is_in(
                client_address(headers, self.peer.addr.ip(), &rules.trusted_proxies),
                &route.exempt,
            ))
            || route.exempt_keys.iter().any(|keys| keys.exempts(headers));
        let per_client = rules
            .capacity
            .get(found.index)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.settings().per == Per::Client);
        let limited = route.limited();
        let client = if !exempt && (limited || per_client) {
            Some(route.client.identify_forwarded(
                headers,
                matched_path,
                self.peer.addr.ip(),
                &rules.trusted_proxies,
            )?)
        } else {
            None
        };
        let mut chosen = None;
        let (policy, keys) = match &client {
            Some(client) if limited => {
                let plan = match &rules.routes.plan_selection {
                    Some(selection) if !route.plans.is_empty() => selection.plan(
                        headers,
                        matched_path,
                        self.peer.addr.ip(),
                        &rules.trusted_proxies,
                    ),
                    _ => None,
                };
                chosen = plan;
                let policy = route.policy_for(client, headers, plan);
                let keys = self.keys(rules, policy, client, headers, matched_path)?;
                let policy = if policy.varies_by_request() {
                    Limits::ForRequest(Box::new(
                        policy.for_request(headers, crate::clock::now_ms()),
                    ))
                } else {
                    Limits::Compiled(policy)
                };
                (Some(policy), keys)
            }
            _ => (None, Vec::new()),
        };
        Ok(Identity {
            exempt,
            client,
            policy,
            keys,
            plan: chosen,
        })
    }

    /// Whose count each of `policy`'s limits is, when not every one counts
    /// `client` on the route: the identity each limit names, derived from
    /// the request as the route's client is (a header it names missing or
    /// repeated is refused the same way).
    fn keys(
        &self,
        rules: &Rules,
        policy: &Policy,
        client: &ClientId,
        headers: &mut http::HeaderMap,
        matched_path: &str,
    ) -> Result<Vec<CountKey>, Refusal> {
        policy
            .counting()
            .into_iter()
            .flatten()
            .map(|counting| {
                let id = match &counting.key {
                    KeySource::Client => client.clone(),
                    KeySource::Rule(rule) => rule.identify_forwarded(
                        headers,
                        matched_path,
                        self.peer.addr.ip(),
                        &rules.trusted_proxies,
                    )?,
                };
                Ok(CountKey::new(
                    &counting.scope,
                    &counting.entry,
                    counting.index,
                    id,
                ))
            })
            .collect()
    }
}
