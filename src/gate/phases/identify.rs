//! The identify phase: whether the client is exempt, who it is, which
//! limits it falls under (an override's, its plan's or the route's own)
//! and whose count each of them is.

use std::sync::Arc;

use http::StatusCode;

use super::{Context, Found, Limits};
use crate::client::{ClientId, KeyFacts, client_address, is_in};
use crate::concurrency::Per;
use crate::gate::rules::Rules;
use crate::keys::{KeyFrom, Outcome, Record};
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
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        headers: &mut http::HeaderMap,
        (matched_path, key): (&str, Option<&Arc<Record>>),
    ) -> Result<Identity<'r>, Refusal> {
        let route = found.route;
        let exempt = is_exempt(rules, found, headers, self.peer.addr.ip());
        let facts = key.map(|r| KeyFacts {
            identity: &r.identity,
            attributes: r.attributes.as_slice(),
        });
        let facts = facts.as_ref();
        let per_client = rules
            .live(found.index)
            .and_then(|l| l.capacity.as_ref())
            .is_some_and(|c| c.settings().per == Per::Client);
        let limited = route.limited();
        let client = if !exempt && (limited || per_client) {
            Some(route.client.identify_forwarded(
                headers,
                matched_path,
                self.peer.addr.ip(),
                &rules.trusted_proxies,
                facts,
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
                        (matched_path, self.peer.addr.ip(), &rules.trusted_proxies),
                        key.and_then(|r| r.plan.as_deref()),
                        &self.shared.plan_table,
                    ),
                    _ => None,
                };
                chosen = plan;
                let policy = route.policy_for(client, headers, plan);
                let keys = self.keys(rules, policy, client, headers, (matched_path, facts))?;
                let policy = if policy.varies_by_request() {
                    Limits::ForRequest(Box::new(policy.for_request(
                        headers,
                        crate::clock::now_ms(),
                        facts,
                    )))
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

    /// The verify phase, then the identify phase.
    pub(super) async fn verified<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        headers: &mut http::HeaderMap,
        matched_path: &str,
    ) -> Result<Identity<'r>, Refusal> {
        let key = self.verify(rules, found, headers).await?;
        self.identify(rules, found, headers, (matched_path, key.as_ref()))
    }

    /// The verify phase, before identify: on a route that verifies keys
    /// (and a request that is not exempt), the record of the API key the
    /// request carries, or the refusal it gets.
    pub(super) async fn verify(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        headers: &http::HeaderMap,
    ) -> Result<Option<Arc<Record>>, Refusal> {
        match &found.route.api_key {
            Some(from) if !is_exempt(rules, found, headers, self.peer.addr.ip()) => {
                self.verify_key(rules, found, from, headers).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    /// The record of the API key the request carries, read as `from`
    /// says, or the refusal it gets: a missing, unknown or expired key
    /// 401, a disabled one 403, and an unknown key from an address that
    /// sent too many this minute 429 without asking the store (its valid
    /// keys still pass). Nothing is counted before.
    async fn verify_key(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        from: &KeyFrom,
        headers: &http::HeaderMap,
    ) -> Result<Arc<Record>, Refusal> {
        let answers = found.route.answers;
        let Some(registry) = &self.shared.keys else {
            // `[keys]` is read at start only; a reload cannot add it.
            return Err(key_refusal(Outcome::Unknown, from).answered_as(answers));
        };
        let Some(key) = crate::keys::read_key(headers, from) else {
            registry.count(Outcome::Missing);
            if let Some(log) = &mut self.log {
                log.key(Outcome::Missing.name(), None);
            }
            return Err(key_refusal(Outcome::Missing, from).answered_as(answers));
        };
        let address = || client_address(headers, self.peer.addr.ip(), &rules.trusted_proxies);
        let now_ms = crate::clock::now_ms();
        let mut wait = None;
        let verified = match registry.verify(key) {
            // Not in this instance's copy: perhaps made elsewhere a moment
            // ago, and the store is asked; unless the address has spent
            // its failure budget this minute (a valid key is never held
            // to it).
            Err(Outcome::Unknown) => {
                wait = registry.failures().and_then(|f| f.spent(address(), now_ms));
                match wait {
                    Some(_) => Err(Outcome::TooManyFailures),
                    None => Box::pin(registry.ask(key)).await,
                }
            }
            known => known,
        };
        registry.count(verified.as_ref().err().copied().unwrap_or(Outcome::Valid));
        if let Some(log) = &mut self.log {
            match &verified {
                Ok(record) => log.key(Outcome::Valid.name(), Some(&record.id)),
                Err(outcome) => log.key(outcome.name(), None),
            }
        }
        verified.map_err(|outcome| {
            if let (Outcome::Unknown, Some(failures)) = (outcome, registry.failures()) {
                failures.count(address(), now_ms);
            }
            match (outcome, wait) {
                (Outcome::Unavailable, _) => Refusal::store(1000).answered_as(answers),
                (_, Some(wait_ms)) => key_refusal(outcome, from)
                    .retry_after(wait_ms)
                    .answered_as(answers),
                _ => key_refusal(outcome, from).answered_as(answers),
            }
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
        (matched_path, facts): (&str, Option<&KeyFacts<'_>>),
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
                        facts,
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

/// What a request whose key was not verified is answered.
fn key_refusal(outcome: Outcome, from: &KeyFrom) -> Refusal {
    let (status, detail) = match outcome {
        Outcome::Missing => (
            StatusCode::UNAUTHORIZED,
            match from {
                KeyFrom::Bearer => {
                    "this API needs an API key: send it as Authorization: Bearer <key>".to_owned()
                }
                KeyFrom::Header(name) => {
                    format!("this API needs an API key: send it in the {name} header")
                }
            },
        ),
        Outcome::Disabled => (StatusCode::FORBIDDEN, "the API key is disabled".to_owned()),
        Outcome::Expired => (StatusCode::UNAUTHORIZED, "the API key expired".to_owned()),
        Outcome::TooManyFailures => (
            StatusCode::TOO_MANY_REQUESTS,
            "too many unknown API keys from this address; retry when the minute ends".to_owned(),
        ),
        Outcome::Unknown | Outcome::Valid | Outcome::Unavailable => (
            StatusCode::UNAUTHORIZED,
            "the API key is not known".to_owned(),
        ),
    };
    let code = match outcome {
        Outcome::TooManyFailures => "rate_limit_exceeded",
        _ => "invalid_api_key",
    };
    Refusal::credential(status, detail, code)
}

/// Whether the route lets the request pass unlimited: its address is in
/// `exempt`, or it carries one of `exempt_keys`.
fn is_exempt(
    rules: &Rules,
    found: &Found<'_>,
    headers: &http::HeaderMap,
    peer: std::net::IpAddr,
) -> bool {
    let route = found.route;
    (!route.exempt.is_empty()
        && is_in(
            client_address(headers, peer, &rules.trusted_proxies),
            &route.exempt,
        ))
        || route.exempt_keys.iter().any(|keys| keys.exempts(headers))
}
