//! What a route counts: its own limits, the plans and budgets it draws
//! on, its overrides, and its `[routes.usage]`, whose reservations must
//! fit them all.

use std::ops::Range;

use toml::Spanned;

use super::{RouteModel, Validator};
use crate::client::ClientRule;
use crate::config::clients;
use crate::config::plans::{Catalog, Draws};
use crate::config::usage::UsageModel;
use crate::limit::Limit;
use crate::routes::Policy;

impl Validator<'_> {
    /// A route's limits: its own and each plan's (with the budgets it
    /// draws from), and its overrides'; a metered route's reservations
    /// must fit them all.
    pub(super) fn route_limits(
        &mut self,
        m: &RouteModel,
        (name, client, cx): (&str, Option<&ClientRule>, &clients::Context<'_>),
        cost: u64,
        usage: Option<&Option<std::sync::Arc<crate::usage::settings::Settings>>>,
        catalog: &Catalog<'_>,
    ) -> Option<(Policy, Vec<Option<Policy>>, Vec<crate::routes::Override>)> {
        let draws = Draws {
            budgets: m.budgets.as_ref(),
            plans: m.plans.as_ref(),
        };
        let policies =
            self.route_policies(name, m.limits.as_ref(), cost, client, cx, &draws, catalog);
        let budgets_only = Draws {
            budgets: m.budgets.as_ref(),
            plans: None,
        };
        let override_policies: Vec<Option<Policy>> = m
            .overrides
            .iter()
            .map(|o| {
                self.route_policies(
                    name,
                    Some(o.get_ref().limits()),
                    cost,
                    client,
                    cx,
                    &budgets_only,
                    catalog,
                )
                .map(|(p, _)| p)
            })
            .collect();
        let overrides = self.overrides(&m.overrides, client, override_policies);
        if let (Some(Some(u)), Some((policy, plans)), Some(overrides), Some(model)) =
            (usage, &policies, &overrides, &m.usage)
        {
            let all = plans.iter().flatten().chain(std::iter::once(policy));
            self.reservations_fit(u, model.span(), all, overrides);
        }
        if let Some(first) = m.overrides.first()
            && m.limits.as_ref().is_none_or(|l| l.get_ref().is_empty())
        {
            self.problem(
                first.span(),
                "overrides change a route's limits, and this route has none; give it limits",
            );
        }
        let (policy, plans) = policies?;
        Some((policy, plans, overrides?))
    }

    /// A metered request costs up to its largest reservation: that must
    /// fit every limit of the route and of its overrides.
    fn reservations_fit<'p>(
        &mut self,
        usage: &crate::usage::settings::Settings,
        span: Range<usize>,
        policies: impl Iterator<Item = &'p crate::routes::Policy>,
        overrides: &[crate::routes::Override],
    ) {
        let capacities = policies
            .flat_map(|p| p.limits.iter())
            .chain(overrides.iter().flat_map(|o| o.policy.limits.iter()))
            .filter(|l| !l.counts_requests)
            .map(Limit::capacity);
        if let Some(least) = capacities.min()
            && usage.max_reserve > least
        {
            self.problem(
                span,
                format!(
                    "usage may reserve {} units (max_reserve, or reserve), more than a limit of this route allows at once ({least}), so such a request could never pass; lower max_reserve or raise the limit",
                    usage.max_reserve
                ),
            );
        }
    }

    /// A route's `[routes.usage]`, where it can have a meaning: the route
    /// forwards, is limited, and has no fixed `cost`.
    pub(super) fn route_usage(
        &mut self,
        m: &RouteModel,
        usage: &Spanned<UsageModel>,
    ) -> Option<std::sync::Arc<crate::usage::settings::Settings>> {
        let settings = self.usage(usage)?;
        let problem = if m.cost.is_some() {
            Some("a route with usage takes its cost from its upstream's reports; remove cost")
        } else if m.respond.is_some() {
            Some("usage is reported by an upstream, and this route answers itself; remove usage")
        } else if m.limits.as_ref().is_none_or(|l| l.get_ref().is_empty())
            && m.budgets.as_ref().is_none_or(|b| b.get_ref().is_empty())
            && m.plans.as_ref().is_none_or(|p| p.get_ref().is_empty())
        {
            Some(
                "usage is counted against limits, and this route has none; give it limits or budgets",
            )
        } else {
            None
        };
        match problem {
            Some(message) => {
                self.problem(usage.span(), message);
                None
            }
            None => Some(settings),
        }
    }
}
