//! Envoy's rate limit service on the decision listener:
//! `ShouldRateLimit`, answered from floodgate's limits.
//!
//! **The mapping.** Each descriptor of a request is on the first route
//! whose `descriptor` has its domain and entries (see
//! [`crate::routes::Descriptor`]); the values of the entries the route does
//! not fix are whose count it is, and its limits are the route's (a limit
//! keyed `global` counts every descriptor of the route together). Each
//! descriptor counts its `hits_addend`, else the request's, else the
//! route's `cost`. A descriptor on no route, or on a route without limits,
//! is `OK` and counts nothing.
//!
//! **All or nothing.** Every limit of every descriptor is decided in one
//! charge: the request passes when all allow, and then all are consumed;
//! refused, nothing is consumed anywhere (envoyproxy/ratelimit counts the
//! hits in the descriptors that allowed). Descriptors on `shadow` routes
//! are a charge of their own, which counts and never refuses. Descriptors
//! that count different numbers of hits cannot be one charge, so such a
//! request is refused as invalid rather than decided in parts.
//!
//! **The answer**: the overall code; per descriptor, its code (over limit
//! when its own limits could not take its hits), its most constrained
//! limit, what remains in it and when more comes (read after the decision
//! when the request counts more than one limit: one more store call), and
//! the `RateLimit` fields (and `Retry-After` when over) as headers for
//! Envoy to add to its answer. A store that cannot decide answers as
//! `on_error` says: `allow` and `local` answer as any request's decision
//! would; `deny` answers gRPC `UNAVAILABLE` (counted among refusals as
//! the proxy listener's 503 is), and Envoy's own `failure_mode_deny`
//! then chooses. The ruling is recorded as the proxy listener's is
//! (`phases::ruling`).

use std::borrow::Cow;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::Context;
use super::ruling::{Ruling, Whose};
use crate::client::ClientId;
use crate::envoy::{self, RateLimitRequest, RateLimitResponse, code};
use crate::gate::rules::Rules;
use crate::gate::shared::Shared;
use crate::limit::{Answer, Charge, CountKey, Decision, Limit, Verdict};
use crate::metrics::Outcome;
use crate::proxy::{Body, Peer};
use crate::response;
use crate::routes::{KeySource, LimitTerms, Policy, Route};

/// gRPC's status codes used here.
const INVALID_ARGUMENT: u8 = 3;
const UNAVAILABLE: u8 = 14;
const UNIMPLEMENTED: u8 = 12;

/// One descriptor on a route with limits.
struct Matched<'r> {
    /// Its place in the request (and the response's statuses).
    at: usize,
    index: usize,
    route: &'r Route,
    policy: Cow<'r, Policy>,
    client: ClientId,
    hits: u64,
}

/// A request's descriptors as its routes see them.
struct Descriptors<'r> {
    /// Those on routes whose limits (or chosen plan's) count them.
    limited: Vec<Matched<'r>>,
    /// The routes of those whose limits are none: allowed, counted nowhere.
    unlimited: Vec<usize>,
}

/// Answers one call on the decision listener that speaks gRPC: the rate
/// limit service's `ShouldRateLimit`, or `UNIMPLEMENTED`.
pub async fn answer(shared: &Shared, peer: &Peer, request: Request<Incoming>) -> Response<Body> {
    if request.uri().path() != envoy::SHOULD_RATE_LIMIT {
        return response::grpc_status(
            UNIMPLEMENTED,
            "floodgate serves envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
        );
    }
    let mut cx = Context::new(
        shared,
        peer,
        true,
        request.method(),
        request.uri(),
        request.version(),
        None,
    );
    let timeout = shared.rules.load().client_timeouts.body;
    let body = http_body_util::Limited::new(request.into_body(), envoy::MAX_REQUEST + 5);
    let read = match tokio::time::timeout(timeout, body.collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(_)) => {
            return cx.logged(response::grpc_status(
                INVALID_ARGUMENT,
                "the request message is larger than 64 KiB, or broke off",
            ));
        }
        Err(_) => {
            return cx.logged(response::grpc_status(
                INVALID_ARGUMENT,
                "the request message did not arrive within client_body_timeout",
            ));
        }
    };
    let response = match envoy::decode_request(&read) {
        Ok(request) => cx.should_rate_limit(&request).await,
        Err(e) => response::grpc_status(INVALID_ARGUMENT, &e.to_string()),
    };
    cx.logged(response)
}

impl Context<'_> {
    /// The decision for `request`'s descriptors, as Envoy reads it.
    async fn should_rate_limit(&mut self, request: &RateLimitRequest) -> Response<Body> {
        let rules = self.shared.rules.load_full();
        let mut statuses = vec![ok_status(); request.descriptors.len()];
        let Descriptors { limited, unlimited } = match matched(&rules, request) {
            Ok(descriptors) => descriptors,
            Err(message) => return response::grpc_status(INVALID_ARGUMENT, message),
        };
        for index in unlimited {
            if let Some(live) = rules.live(index) {
                live.metrics.count(Outcome::Allowed);
            }
        }
        // Shadow routes count and never refuse: decided on their own, so
        // that a shadow limit never refuses the others' descriptors.
        let (enforced, shadowed): (Vec<_>, Vec<_>) =
            limited.into_iter().partition(|m| !m.route.shadow);
        let mut over = false;
        let mut fields = HeaderMap::new();
        for (group, shadow) in [(enforced, false), (shadowed, true)] {
            let Some(first) = group.first() else {
                continue;
            };
            let ruling = self
                .decide_group(&rules, &group, shadow, &mut statuses)
                .await;
            let denied = matches!(ruling, Ruling::Denied { .. });
            if let Ruling::StoreDown(Some(refusal)) = &ruling {
                self.shared.metrics.refused(refusal);
                return response::grpc_status(
                    UNAVAILABLE,
                    "the rate limit store cannot decide and on_error is \"deny\"",
                );
            }
            // The fields a client of the proxy listener would get, for
            // Envoy to add to its answer: the enforced descriptors', else
            // the shadow ones'.
            if let Some((decision, combined)) = ruling.decided() {
                over |= denied;
                if fields.is_empty() {
                    response::annotate(&mut fields, first.route, combined, decision);
                    if denied {
                        fields.insert(
                            http::header::RETRY_AFTER,
                            response::retry_after(decision.retry_after_ms),
                        );
                    }
                }
            }
        }
        grpc_ok(&RateLimitResponse {
            overall_code: if over { code::OVER_LIMIT } else { code::OK },
            statuses,
            response_headers_to_add: fields
                .iter()
                .filter_map(|(name, value)| {
                    Some(envoy::HeaderValue {
                        key: name.as_str().to_owned(),
                        value: value.to_str().ok()?.to_owned(),
                    })
                })
                .collect(),
        })
    }

    /// Decides `group` (descriptors on routes that are all `shadow`, or
    /// none) as one charge, records the ruling and writes each
    /// descriptor's status.
    async fn decide_group<'g>(
        &mut self,
        rules: &Rules,
        group: &'g [Matched<'_>],
        shadow: bool,
        statuses: &mut [envoy::DescriptorStatus],
    ) -> Ruling<Cow<'g, Policy>> {
        let Some(first) = group.first() else {
            return Ruling::Unlimited;
        };
        // Each descriptor's limits, placed one after another in the charge.
        let mut owns = Vec::with_capacity(group.len());
        let mut keys: Vec<CountKey> = Vec::new();
        for m in group {
            owns.push(keys.len()..keys.len() + m.policy.limits.len());
            // A descriptor route names every limit's count, as the
            // descriptor's values or the whole route (config checks it).
            keys.extend(m.policy.counting().into_iter().flatten().map(|c| {
                let id = match c.key {
                    KeySource::Rule(_) => ClientId::Global,
                    KeySource::Client => m.client.clone(),
                };
                CountKey::new(&c.scope, &c.entry, c.index, id)
            }));
        }
        // One descriptor's limits are its route's policy as it is; several
        // descriptors' are put together, each limit with its terms.
        let combined: Cow<'_, Policy> = match group {
            [one] => Cow::Borrowed(one.policy.as_ref()),
            _ => {
                let mut limits: Vec<Limit> = Vec::new();
                let mut terms = Vec::new();
                for m in group {
                    limits.extend_from_slice(&m.policy.limits);
                    terms.extend(m.policy.terms.iter().cloned());
                }
                Cow::Owned(Policy::with_terms(limits, terms))
            }
        };
        let charge = Charge::new(
            &first.route.name,
            &first.client,
            &combined.limits,
            &keys,
            first.hits,
        );
        let answer = match self.shared.limiter.decide_at_once(charge) {
            Some(answer) => answer,
            None => self.shared.limiter.decide(charge).await,
        };
        let verdicts = match &answer {
            Answer::Decided(decision) => self.verdicts(charge, decision).await,
            Answer::Unavailable { .. } => None,
        };
        let ruling = Ruling::of(answer, (shadow, crate::routes::Answers::Problem), combined);
        self.record_group(rules, group, &owns, &ruling);
        if let Some((decision, combined)) = ruling.decided() {
            write_statuses(
                group,
                &owns,
                combined,
                decision,
                verdicts.as_deref(),
                statuses,
            );
        }
        ruling
    }

    /// A group's ruling recorded: on each descriptor's route, its denial
    /// logged for the descriptor whose limit refused, and the call in the
    /// access log as the first descriptor's route and client.
    fn record_group(
        &mut self,
        rules: &Rules,
        group: &[Matched<'_>],
        owns: &[std::ops::Range<usize>],
        ruling: &Ruling<Cow<'_, Policy>>,
    ) {
        let Some(first) = group.first() else {
            return;
        };
        let refusing = ruling
            .decided()
            .filter(|(d, _)| !d.allowed)
            .and_then(|(d, _)| {
                group
                    .iter()
                    .zip(owns)
                    .find(|(_, own)| own.contains(&d.limit))
            })
            .map_or(first, |(m, _)| m);
        if let Some(r) = self.log.as_mut() {
            r.route(&first.route.name);
        }
        let whose = Whose {
            counted: group.iter().map(|m| (m.index, &m.client)),
            denied: (&refusing.route.name, &refusing.client),
            logged: &first.client,
        };
        self.record(rules, ruling, whose);
    }

    /// Each limit's standing after `decision`: the decision itself when
    /// it is of one limit, else read from the store (consuming nothing);
    /// `None` when that read fails.
    async fn verdicts(&self, charge: Charge<'_>, decision: &Decision) -> Option<Vec<Verdict>> {
        if charge.limits.len() == 1 {
            return Some(vec![Verdict {
                allowed: decision.allowed,
                remaining: decision.remaining,
                next_ms: decision.next_ms,
                retry_after_ms: decision.retry_after_ms,
            }]);
        }
        let held = self.shared.limiter.standing(charge).await.ok()?;
        Some(held.into_iter().map(|s| s.verdict).collect())
    }
}

/// The route descriptor `d` of `request` is on, if any.
fn on_route<'r>(
    rules: &'r Rules,
    request: &RateLimitRequest,
    d: &envoy::RateLimitDescriptor,
) -> Option<(usize, &'r Arc<Route>)> {
    let entries = d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
    rules.routes.for_descriptor(&request.domain, entries)
}

/// The request's descriptors on routes: with whose count each is, its
/// limits and its hits where any limit counts it; or why the request
/// cannot be one charge.
fn matched<'r>(
    rules: &'r Rules,
    request: &RateLimitRequest,
) -> Result<Descriptors<'r>, &'static str> {
    let mut matched: Vec<Matched<'r>> = Vec::new();
    let mut unlimited = Vec::new();
    for (at, d) in request.descriptors.iter().enumerate() {
        let Some((index, route)) = on_route(rules, request, d) else {
            continue;
        };
        let Some(descriptor) = &route.descriptor else {
            continue;
        };
        let entries = || d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str()));
        let client = descriptor.client(entries(), route.client.max_len);
        // The plan the descriptor names, else the selection's default.
        let plan = rules.routes.plan_selection.as_ref().and_then(|selection| {
            descriptor
                .plan(entries())
                .and_then(|name| selection.names.iter().position(|n| **n == *name))
                .or(selection.default)
        });
        let chosen = route.policy_for(&client, &HeaderMap::new(), plan);
        if chosen.limits.is_empty() {
            unlimited.push(index);
            continue;
        }
        let hits = d
            .hits_addend
            .as_ref()
            .map(|h| h.value)
            .filter(|&h| h > 0)
            .or((request.hits_addend > 0).then_some(u64::from(request.hits_addend)))
            .unwrap_or(route.cost);
        if matched.first().is_some_and(|m| m.hits != hits) {
            return Err(
                "descriptors counting different hits_addend cannot be decided all or nothing; send them in separate requests",
            );
        }
        let policy = if chosen.varies_by_request() {
            Cow::Owned(chosen.for_request(&HeaderMap::new(), crate::clock::now_ms(), None))
        } else {
            Cow::Borrowed(chosen)
        };
        matched.push(Matched {
            at,
            index,
            route: route.as_ref(),
            policy,
            client,
            hits,
        });
    }
    Ok(Descriptors {
        limited: matched,
        unlimited,
    })
}

/// Each descriptor of `group` (its limits at `owns` in `combined`) its
/// status after `decision`.
fn write_statuses(
    group: &[Matched<'_>],
    owns: &[std::ops::Range<usize>],
    combined: &Policy,
    decision: &Decision,
    verdicts: Option<&[Verdict]>,
    statuses: &mut [envoy::DescriptorStatus],
) {
    for (m, own) in group.iter().zip(owns) {
        if let Some(slot) = statuses.get_mut(m.at) {
            *slot = status(
                &combined.limits[own.clone()],
                &combined.terms[own.clone()],
                verdicts.map(|v| &v[own.clone()]),
                decision,
                own.clone(),
                m.hits,
            );
        }
    }
}

/// A descriptor's status: over limit when its own limits could not take
/// its `hits`; its most constrained limit, what remains in it and when
/// more comes. Without `verdicts` (the store could not be read after the
/// decision), what the decision says of the limit it reported.
fn status(
    limits: &[Limit],
    terms: &[LimitTerms],
    verdicts: Option<&[Verdict]>,
    decision: &Decision,
    own: std::ops::Range<usize>,
    hits: u64,
) -> envoy::DescriptorStatus {
    let (at, remaining, next_ms) = match verdicts {
        Some(verdicts) => verdicts
            .iter()
            .enumerate()
            .min_by_key(|(_, v)| v.remaining)
            .map_or((0, 0, 0), |(i, v)| (i, v.remaining, v.next_ms)),
        None if own.contains(&decision.limit) => (
            decision.limit - own.start,
            decision.remaining,
            decision.next_ms,
        ),
        None => (0, 0, 0),
    };
    let over = !decision.allowed
        && match verdicts {
            Some(verdicts) => verdicts.iter().any(|v| v.remaining < hits),
            None => own.contains(&decision.limit),
        };
    let limit = limits.get(at);
    envoy::DescriptorStatus {
        code: if over { code::OVER_LIMIT } else { code::OK },
        current_limit: limit.map(|l| envoy::RateLimit {
            requests_per_unit: u32::try_from(l.limit).unwrap_or(u32::MAX),
            unit: envoy::unit_of(l.window_ms),
            name: terms.get(at).map(|t| t.name.clone()).unwrap_or_default(),
        }),
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(envoy::Duration {
            seconds: i64::try_from(next_ms / 1000).unwrap_or(i64::MAX),
            nanos: i32::try_from(next_ms % 1000 * 1_000_000).unwrap_or(0),
        }),
    }
}

/// A descriptor that nothing limits.
fn ok_status() -> envoy::DescriptorStatus {
    envoy::DescriptorStatus {
        code: code::OK,
        ..Default::default()
    }
}

/// `message` as a unary call's answer: the message, then `grpc-status: 0`.
fn grpc_ok(message: &RateLimitResponse) -> Response<Body> {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    let bytes: Bytes = envoy::encode_response(message);
    let mut answer = Response::new(Body::trailed(bytes, trailers));
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    answer
}
