//! The standing readout: a route (`standing = ["chat", …]`) that answers
//! the caller's own standing on the routes it names, as GitHub's
//! `/rate_limit` does, instead of forwarding: for each route, the plan the
//! caller is on and every limit that applies to it (its number, what
//! remains, when more comes back, its window), consuming nothing. The
//! caller is identified on each named route exactly as a request there
//! would be (its key header, its token, its address), so it reads only its
//! own counts; one store read per named route.

use std::fmt::Write as _;
use std::sync::Arc;

use http::header::{CACHE_CONTROL, CONTENT_TYPE};
use http::{HeaderValue, Response};

use super::identify::Identity;
use super::{Context, Found};
use crate::access_log::json_string;
use crate::gate::rules::Rules;
use crate::limit::{Charge, Standing};
use crate::proxy::Body;
use crate::refusal::Refusal;
use crate::routes::{Policy, Route};

impl Context<'_> {
    /// The caller's standing on the routes `names` (in that order), as a
    /// JSON answer; a caller that cannot be identified on one of them is
    /// refused as a request there would be.
    pub(super) async fn standing(
        &mut self,
        rules: &Rules,
        names: &[Arc<str>],
        headers: &mut http::HeaderMap,
        matched_path: &str,
    ) -> Result<Response<Body>, Refusal> {
        let mut out = String::from("{\"routes\":[");
        for (n, name) in names.iter().enumerate() {
            let Some((index, route)) = rules
                .routes
                .iter()
                .enumerate()
                .find(|(_, r)| r.name == *name)
            else {
                continue;
            };
            let found = Found {
                index,
                route: route.as_ref(),
            };
            let key = self.verify(rules, &found, headers).await?;
            let who = self.identify(rules, &found, headers, (matched_path, key.as_ref()))?;
            if n > 0 {
                out.push(',');
            }
            let verdicts = if who.exempt {
                Vec::new()
            } else {
                read_standing(self.shared, &route.name, &who)
                    .await
                    .map_err(|_| Refusal::store(1_000))?
            };
            match &who.policy {
                Some(policy) => route_json(&mut out, route, &who, rules, policy, &verdicts),
                None => route_json(&mut out, route, &who, rules, &Policy::default(), &[]),
            }
        }
        out.push_str("]}");
        let mut response = Response::new(Body::whole(out));
        let headers = response.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
        Ok(response)
    }
}

/// What each limit `who` falls under on route `route` holds now, read
/// from the store without consuming (none when the route does not limit
/// it).
pub(super) async fn read_standing(
    shared: &crate::gate::shared::Shared,
    route: &Arc<str>,
    who: &Identity<'_>,
) -> Result<Vec<Standing>, crate::limit::StoreError> {
    let (Some(client), Some(policy)) = (&who.client, &who.policy) else {
        return Ok(Vec::new());
    };
    let charge = Charge::new(route, client, &policy.limits, &who.keys, 0);
    shared.limiter.standing(charge).await
}

/// One route's standing: whether the caller is exempt there, its plan, and
/// each limit of `policy` with what `held` says it holds.
pub(super) fn route_json(
    out: &mut String,
    route: &Route,
    who: &Identity<'_>,
    rules: &Rules,
    policy: &Policy,
    held: &[Standing],
) {
    out.push_str("{\"route\":");
    json_string(out, &route.name);
    let _ = write!(out, ",\"exempt\":{}", who.exempt);
    out.push_str(",\"plan\":");
    let plan = who.plan.and_then(|p| {
        let selection = rules.routes.plan_selection.as_ref()?;
        selection.names.get(p).cloned()
    });
    match plan {
        Some(plan) => json_string(out, &plan),
        None => out.push_str("null"),
    }
    out.push_str(",\"limits\":[");
    if !who.exempt {
        // The least a request takes of a limit counting units: its
        // smallest reservation on a metered route, else its cost.
        let least = route
            .usage
            .as_ref()
            .map_or(route.cost, |u| u.least_reservation());
        limits_json(out, policy, held, least);
    }
    out.push_str("]}");
}

/// Each limit of `policy` with what `held` says it holds: its number
/// (`limit`), what an operator granted past it that is in force
/// (`granted`), what is taken (`used`: the two less what remains), what
/// remains, and the least one request takes of it (`smallest_reservation`: 1
/// for a limit counting requests, else `least`), so that a client with
/// less remaining than that sees why it is refused.
fn limits_json(out: &mut String, policy: &crate::routes::Policy, held: &[Standing], least: u64) {
    for (i, (limit, held)) in policy.limits.iter().zip(held).enumerate() {
        let verdict = &held.verdict;
        let in_force = limit.capacity().saturating_add(held.granted);
        if i > 0 {
            out.push(',');
        }
        let name = policy.name(i).unwrap_or("");
        crate::gate::shown::limit_named(out, policy, i, name);
        let _ = write!(
            out,
            ",\"counts\":\"{}\",\"limit\":{},\"granted\":{},\"used\":{},\"remaining\":{},\"smallest_reservation\":{},\"reset_seconds\":{},\"window_seconds\":{}",
            if limit.counts_requests {
                "requests"
            } else {
                "units"
            },
            limit.capacity(),
            held.granted,
            in_force.saturating_sub(verdict.remaining),
            verdict.remaining,
            if limit.counts_requests { 1 } else { least },
            verdict.next_ms.div_ceil(1000),
            limit.window_now_ms().div_ceil(1000),
        );
        match limit.bounds {
            Some(b) => {
                let _ = write!(out, ",\"window_ends_at\":{}}}", b[2] / 1000);
            }
            None => out.push('}'),
        }
    }
}
