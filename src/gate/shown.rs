//! How the limits a request may fall under look to operators on
//! `/status.json`: whose count each limit is, the budget it belongs to,
//! the number a claim carries, the budgets with the routes that draw from
//! them, and how plans are chosen. The admin listener writes these
//! without learning how rules are compiled.

use crate::access_log::json_string;
pub use crate::routes::Policy;

/// A policy's limits in `/status.json`: each with whose count it is
/// (`client`: the route's; else the identity it names) and the budget it
/// belongs to, if any.
pub fn policy_json(out: &mut String, policy: &crate::routes::Policy) {
    use std::fmt::Write;
    out.push('[');
    for (j, (limit, terms)) in policy.limits.iter().zip(policy.terms.iter()).enumerate() {
        if j > 0 {
            out.push(',');
        }
        limit_named(out, policy, j, &terms.name);
        out.push_str(",\"limit_from\":");
        match &terms.claimed {
            Some(c) => {
                out.push_str("{\"claim\":");
                json_string(out, &c.rule.claim);
                let _ = write!(out, ",\"default\":{},\"max\":{}}}", c.default, c.ceiling);
            }
            None => out.push_str("null"),
        }
        out.push_str(",\"calendar\":");
        match &terms.calendar {
            Some(c) => json_string(out, &c.describe()),
            None => out.push_str("null"),
        }
        let _ = write!(
            out,
            ",\"counts\":\"{}\",\"algorithm\":\"{}\",\"limit\":{},\"window_seconds\":{},\"burst\":{}}}",
            if limit.counts_requests {
                "requests"
            } else {
                "units"
            },
            limit.algorithm.name(),
            limit.limit,
            limit.window_ms as f64 / 1000.0,
            limit.burst
        );
    }
    out.push(']');
}

/// The budgets in `/status.json`: each by name with the routes that draw
/// from it.
pub fn budgets_json(out: &mut String, table: &crate::routes::Table) {
    let budgets = table.budgets();
    out.push('{');
    for (i, (budget, routes)) in budgets.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(out, budget);
        out.push_str(":{\"routes\":");
        names_json(out, routes.iter().copied());
        out.push('}');
    }
    out.push('}');
}

/// The plans in `/status.json`: how a request's plan is chosen, the
/// default, and each plan with the routes that refer to it.
pub fn plans_json(
    out: &mut String,
    table: &crate::routes::Table,
    in_force: &crate::routes::PlanTable,
) {
    use crate::routes::PlanSource;
    use std::fmt::Write;
    let Some(selection) = &table.plan_selection else {
        out.push_str("null");
        return;
    };
    out.push_str("{\"by\":");
    json_string(out, &selection.by.describe(in_force));
    if let PlanSource::Table { .. } = &selection.by {
        let _ = write!(out, ",\"table_clients\":{}", in_force.len());
    }
    out.push_str(",\"default\":");
    match selection.default.and_then(|d| selection.names.get(d)) {
        Some(name) => json_string(out, name),
        None => out.push_str("null"),
    }
    out.push_str(",\"plans\":{");
    for (i, name) in selection.names.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(out, name);
        out.push_str(":{\"routes\":");
        names_json(out, table.on_plan(i));
        out.push('}');
    }
    out.push_str("}}");
}

fn names_json<'a>(out: &mut String, names: impl Iterator<Item = &'a str>) {
    out.push('[');
    for (i, name) in names.enumerate() {
        if i > 0 {
            out.push(',');
        }
        json_string(out, name);
    }
    out.push(']');
}

/// A limit's object opened with what names it: `{"policy":…,"key":…,
/// "budget":…,"count_when":…,"penalty":…,"delay_ms":…` (its policy
/// name, whose count it is, its budget, the answers it counts or `null`
/// for every request, its penalty or `null`, how long it holds a request
/// past its burst or `null`), for
/// `/status.json`, the readout and the operators' answers alike.
pub fn limit_named(out: &mut String, policy: &crate::routes::Policy, j: usize, name: &str) {
    out.push_str("{\"policy\":");
    json_string(out, name);
    let counting = policy.counting_of(j);
    out.push_str(",\"key\":");
    json_string(out, counting.map_or("client", |c| &c.shown));
    out.push_str(",\"budget\":");
    match counting.and_then(|c| c.budget.as_deref()) {
        Some(budget) => json_string(out, budget),
        None => out.push_str("null"),
    }
    out.push_str(",\"count_when\":");
    match policy.terms.get(j).and_then(|t| t.count_when.as_ref()) {
        Some(c) => json_string(out, &c.describe()),
        None => out.push_str("null"),
    }
    out.push_str(",\"penalty\":");
    match policy.limits.get(j).and_then(|l| l.penalty.as_ref()) {
        Some(p) => json_string(out, &p.describe()),
        None => out.push_str("null"),
    }
    out.push_str(",\"delay_ms\":");
    match policy.limits.get(j).map(|l| l.delay_ms) {
        Some(ms) if ms > 0 => out.push_str(itoa::Buffer::new().format(ms)),
        _ => out.push_str("null"),
    }
}
