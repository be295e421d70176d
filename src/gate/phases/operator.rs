//! What an operator asks of one client's counts, on the admin listener:
//! its standing on a route, and resetting, crediting or debiting it. The
//! client is named as it would present itself (the headers it sends, the
//! address it comes from) and identified on the route exactly as its
//! requests are, so the operator never needs to know how keys are built.

use std::net::{IpAddr, SocketAddr};

use super::{Context, Found};
use crate::gate::rules::Rules;
use crate::gate::shared::Shared;
use crate::limit::Charge;
pub use crate::limit::{Adjustment, Kept};
use crate::proxy::Peer;
use crate::routes::{Policy, Route};

/// One operator request.
#[derive(Debug)]
pub struct Operation {
    /// The route whose counts are meant.
    pub route: String,
    /// The headers the client sends (its key, its token).
    pub headers: http::HeaderMap,
    /// The address the client comes from.
    pub address: IpAddr,
    /// One limit, by its policy name (`chat.2`); all of the route's
    /// limits when `None`.
    pub limit: Option<String>,
    /// What to do; `None` reads the standing only.
    pub adjustment: Option<Adjustment>,
}

/// Why an operation was not done.
#[derive(Debug)]
pub enum OperationError {
    /// Nothing the operator can act on: no such route, no such limit, a
    /// client the route would refuse, a credit a sliding log cannot take.
    Invalid(String),
    /// The store could not be read or written.
    Store(String),
}

/// The client's standing on the route (as the readout writes one route)
/// before the operation, and after it when it changed something.
pub async fn operate(
    shared: &Shared,
    op: &Operation,
) -> Result<(String, Option<String>), OperationError> {
    let rules = shared.rules.load_full();
    let (index, route) = route_named(&rules, &op.route)?;
    let peer = Peer::new(SocketAddr::new(op.address, 0), false, false);
    let mut cx = Context {
        shared,
        peer: &peer,
        grpc: false,
        log: None,
        slot: None,
        reservation: None,
        by_answer: None,
        place: None,
    };
    let found = Found { index, route };
    let mut headers = op.headers.clone();
    let key = cx.verify(&rules, &found, &headers).await;
    let who = key
        .and_then(|key| cx.identify(&rules, &found, &mut headers, ("/", key.as_ref())))
        .map_err(|refusal| {
            OperationError::Invalid(format!(
                "route {:?} would refuse this client: {}",
                op.route,
                refusal.detail()
            ))
        })?;
    let (Some(client), Some(policy)) = (&who.client, &who.policy) else {
        return Err(OperationError::Invalid(format!(
            "route {:?} does not limit this client",
            op.route
        )));
    };
    let which = limit_named(op, policy)?;
    match op.adjustment {
        Some(Adjustment::Credit(_)) => creditable(policy, which)?,
        Some(Adjustment::Lift) => penalized(policy, which)?,
        _ => {}
    }
    let charge = Charge::new(&route.name, client, &policy.limits, &who.keys, 0);
    let standing = || async {
        let verdicts = super::standing::read_standing(shared, &route.name, &who)
            .await
            .map_err(|e| OperationError::Store(e.to_string()))?;
        let mut out = String::new();
        super::standing::route_json(&mut out, route, &who, &rules, policy, &verdicts);
        Ok::<_, OperationError>(out)
    };
    let before = standing().await?;
    let Some(adjustment) = op.adjustment else {
        return Ok((before, None));
    };
    shared
        .limiter
        .adjust(charge, which, adjustment)
        .await
        .map_err(|e| OperationError::Store(e.to_string()))?;
    let after = standing().await?;
    Ok((before, Some(after)))
}

/// The route called `name`, with its position in the rules.
fn route_named<'r>(rules: &'r Rules, name: &str) -> Result<(usize, &'r Route), OperationError> {
    rules
        .routes
        .iter()
        .enumerate()
        .find(|(_, r)| *r.name == *name)
        .map(|(index, route)| (index, route.as_ref()))
        .ok_or_else(|| OperationError::Invalid(format!("no route is called {name:?}")))
}

/// The position in `policy` of the limit `op` names; `None` when it
/// names none (all of them are meant).
fn limit_named(op: &Operation, policy: &Policy) -> Result<Option<usize>, OperationError> {
    let Some(name) = &op.limit else {
        return Ok(None);
    };
    let position = policy
        .terms
        .iter()
        .position(|t| t.name == *name)
        .ok_or_else(|| {
            let names: Vec<&str> = policy.terms.iter().map(|t| t.name.as_str()).collect();
            OperationError::Invalid(format!(
                "route {:?} has no limit called {name:?} for this client; it has {}",
                op.route,
                names.join(", ")
            ))
        })?;
    Ok(Some(position))
}

/// Whether the limits of `policy` meant (`which`, or all) can take a
/// credit, as each one's algorithm says (a sliding log cannot).
fn creditable(policy: &Policy, which: Option<usize>) -> Result<(), OperationError> {
    let refusing = policy
        .limits
        .iter()
        .enumerate()
        .find(|(i, l)| which.is_none_or(|w| w == *i) && !l.algorithm.can_be_credited());
    if let Some((_, limit)) = refusing {
        return Err(OperationError::Invalid(format!(
            "a {} keeps each unit at the time it was admitted and cannot be credited; reset it, or name another limit",
            limit.algorithm.name()
        )));
    }
    Ok(())
}

/// Whether a limit of `policy` meant (`which`, or all) has a penalty to
/// lift.
fn penalized(policy: &Policy, which: Option<usize>) -> Result<(), OperationError> {
    let any = policy
        .limits
        .iter()
        .enumerate()
        .any(|(i, l)| which.is_none_or(|w| w == i) && l.penalty.is_some());
    if any {
        return Ok(());
    }
    Err(OperationError::Invalid(
        "no limit meant has a penalty to lift; name a limit with penalty = { … }".to_owned(),
    ))
}

/// Every penalty in force, as JSON: `{"penalties":[{"route","limit",
/// "scope","client","ends_in_seconds","offences"}]}`, each under the
/// first route (in file order) with the limit it was served under.
pub async fn penalties(shared: &Shared) -> Result<String, OperationError> {
    use crate::access_log::json_string;
    let served = shared
        .limiter
        .penalties()
        .await
        .map_err(|e| OperationError::Store(e.to_string()))?;
    let rules = shared.rules.load_full();
    let mut out = String::from("{\"penalties\":[");
    for (n, s) in served.iter().enumerate() {
        if n > 0 {
            out.push(',');
        }
        let (route, limit) = served_under(&rules, &s.scope, s.index).unwrap_or(("", ""));
        out.push_str("{\"route\":");
        json_string(&mut out, route);
        out.push_str(",\"limit\":");
        json_string(&mut out, limit);
        out.push_str(",\"scope\":");
        json_string(&mut out, &s.scope);
        out.push_str(",\"client\":");
        json_string(&mut out, &s.client);
        let seconds = s.ends_in_ms.div_ceil(1000);
        out.push_str(&format!(
            ",\"ends_in_seconds\":{seconds},\"offences\":{}}}",
            s.offences
        ));
    }
    out.push_str("]}");
    Ok(out)
}

/// The route and the limit's name that count limit `index` of `scope`.
fn served_under<'r>(rules: &'r Rules, scope: &str, index: usize) -> Option<(&'r str, &'r str)> {
    rules.routes.iter().find_map(|route| {
        let policies = std::iter::once(&route.policy)
            .chain(route.plans.iter().flatten())
            .chain(route.overrides.iter().map(|o| &o.policy));
        policies
            .flat_map(|p| p.terms.iter().enumerate())
            .find_map(|(i, t)| {
                let (s, at) = t
                    .counting
                    .as_ref()
                    .map_or((&*route.name, i), |c| (&*c.scope, c.index));
                (s == scope && at == index).then_some((&*route.name, t.name.as_str()))
            })
    })
}

/// Every client's window of the fixed-window limit called `limit` (its
/// policy name) on route `route`, as the store keeps it: the scope it
/// counts in (the route, or `@` and a budget) and the windows.
pub async fn kept(
    shared: &Shared,
    route: &str,
    limit: &str,
) -> Result<(String, Vec<crate::limit::Kept>), OperationError> {
    let rules = shared.rules.load_full();
    let Some(found) = rules.routes.iter().find(|r| *r.name == *route) else {
        return Err(OperationError::Invalid(format!(
            "no route is called {route:?}"
        )));
    };
    let policies = std::iter::once(&found.policy)
        .chain(found.plans.iter().flatten())
        .chain(found.overrides.iter().map(|o| &o.policy));
    let Some((policy, i)) = policies
        .filter_map(|p| Some((p, p.terms.iter().position(|t| t.name == limit)?)))
        .next()
    else {
        return Err(OperationError::Invalid(format!(
            "route {route:?} has no limit called {limit:?}"
        )));
    };
    let counted = policy.limits[i];
    if !counted.algorithm.keeps_window_totals() {
        return Err(OperationError::Invalid(format!(
            "limit {limit:?} is a {}; totals per window are kept for fixed windows (by the calendar or not)",
            counted.algorithm.name()
        )));
    }
    let (scope, index, entry) = match policy.counting_of(i) {
        Some(c) => (c.scope.to_string(), c.index, Some(c.entry.to_string())),
        None => (found.name.to_string(), i, None),
    };
    let windows = shared
        .limiter
        .kept(&scope, index, entry.as_deref(), &counted)
        .await
        .map_err(|e| OperationError::Store(e.to_string()))?;
    Ok((scope, windows))
}
