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
use crate::limit::{Charge, Verdict};
use crate::proxy::Body;
use crate::refusal::Refusal;
use crate::routes::Policy;

impl Context<'_> {
    /// The caller's standing on the routes `names` (in that order), as a
    /// JSON answer; a caller that cannot be identified on one of them is
    /// refused as a request there would be.
    pub(super) async fn standing(
        &self,
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
            let who = self.identify(rules, &found, headers, matched_path)?;
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
                Some(policy) => route_json(&mut out, name, &who, rules, policy, &verdicts),
                None => route_json(&mut out, name, &who, rules, &Policy::default(), &[]),
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
) -> Result<Vec<Verdict>, crate::limit::StoreError> {
    let (Some(client), Some(policy)) = (&who.client, &who.policy) else {
        return Ok(Vec::new());
    };
    let charge = Charge::new(route, client, &policy.limits, &who.keys, 0);
    shared.limiter.standing(charge).await
}

/// One route's standing: whether the caller is exempt there, its plan, and
/// each limit of `policy` with what `verdicts` say it holds.
pub(super) fn route_json(
    out: &mut String,
    name: &str,
    who: &Identity<'_>,
    rules: &Rules,
    policy: &Policy,
    verdicts: &[Verdict],
) {
    out.push_str("{\"route\":");
    json_string(out, name);
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
        limits_json(out, policy, verdicts);
    }
    out.push_str("]}");
}

/// Each limit of `policy` with what `verdicts` say it holds.
fn limits_json(out: &mut String, policy: &crate::routes::Policy, verdicts: &[Verdict]) {
    for (i, (limit, verdict)) in policy.limits.iter().zip(verdicts).enumerate() {
        if i > 0 {
            out.push(',');
        }
        let name = policy.names.get(i).map_or("", String::as_str);
        crate::gate::shown::limit_named(out, policy, i, name);
        let _ = write!(
            out,
            ",\"counts\":\"{}\",\"limit\":{},\"remaining\":{},\"reset_seconds\":{},\"window_seconds\":{}",
            if limit.counts_requests {
                "requests"
            } else {
                "units"
            },
            limit.capacity(),
            verdict.remaining,
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
