//! Whether a route's rules count by what the key registry says of the
//! request's key (`from = "key"`): such a route must verify the key first.

use super::{KeySource, Override, Policy};
use crate::client::{ClientRule, Part};

fn rule_uses_key(rule: &ClientRule) -> bool {
    rule.parts.iter().any(|p| matches!(p, Part::Key(_)))
}

fn policy_uses_key(policy: &Policy) -> bool {
    policy
        .counting()
        .into_iter()
        .flatten()
        .any(|c| match &c.key {
            KeySource::Client => false,
            KeySource::Rule(rule) => rule_uses_key(rule),
        })
        || policy.calendars_use_key()
}

/// Whether the route's client, or a limit of its own, of a plan or of an
/// override, keys on the verified API key.
pub fn uses_key(
    client: Option<&ClientRule>,
    policy: &Policy,
    plans: &[Option<Policy>],
    overrides: &[Override],
) -> bool {
    client.is_some_and(rule_uses_key)
        || policy_uses_key(policy)
        || plans.iter().flatten().any(policy_uses_key)
        || overrides.iter().any(|o| policy_uses_key(&o.policy))
}
