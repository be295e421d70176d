//! Limits as API products are sold: whose count a limit is (a limit's
//! `key`), budgets several routes draw from (`[budgets.NAME]`), plans
//! defined once (`[plans.NAME]`, chosen by `[plan_selection]`), and limits
//! whose number a verified token claim carries (`limit_from`).
//!
//! A budget's and a plan's limits are compiled for each route that uses
//! them, in that route's context (its client, its path parameters), so a
//! budget limit without a `key` counts the drawing route's client. A
//! budget's keys hold the budget's name, not the route's: every route that
//! draws from it counts in the same keys.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Deserialize;
use toml::Spanned;

use super::clients::{ClientModel, Context};
use super::limits::{ClaimLimitModel, LimitModel};
use super::{LoadError, Problem, Validator};
use crate::client::{ClientRule, Part as IdPart};
use crate::jwt::ClaimRule;
use crate::routes::{
    ClaimedLimit, Counting, KeySource, LimitTerms, PlanSelection, PlanSource, PlanTable, Policy,
};

/// `[budgets.NAME]`: limits several routes draw from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct BudgetModel {
    limits: Spanned<Vec<Spanned<LimitModel>>>,
}

/// `[plans.NAME]`: the limits of one plan, on every route that refers
/// to it, and the plan's own numbers for budgets (`[plans.NAME.budgets.B]`).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanModel {
    limits: Option<Spanned<Vec<Spanned<LimitModel>>>>,
    #[serde(default)]
    budgets: BTreeMap<Spanned<String>, Spanned<BudgetModel>>,
}

/// `[plan_selection]`: how a request's plan is chosen.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PlanSelectionModel {
    by: Spanned<ClientModel>,
    table: Option<Spanned<String>>,
    default: Option<Spanned<String>>,
}

/// Limits of one scope in a policy: the scope (a route's name, or `@` and
/// a budget's), the budget it is if any, and the limits as written.
type Part<'m> = (
    Arc<str>,
    Option<Arc<str>>,
    &'m Spanned<Vec<Spanned<LimitModel>>>,
);

/// The file's budgets, plans and plan selection, read once, for the
/// routes to compile what they use.
pub(super) struct Catalog<'m> {
    budgets: &'m BTreeMap<Spanned<String>, Spanned<BudgetModel>>,
    plans: &'m BTreeMap<Spanned<String>, Spanned<PlanModel>>,
    /// The compiled selection (`None` without plans, or when it has
    /// problems).
    pub(super) selection: Option<PlanSelection>,
}

/// What a route draws on beyond its own limits.
pub(super) struct Draws<'a> {
    /// The budgets it draws from, by name.
    pub(super) budgets: Option<&'a Spanned<Vec<Spanned<String>>>>,
    /// The plans it refers to, by name.
    pub(super) plans: Option<&'a Spanned<Vec<Spanned<String>>>>,
}

impl Validator<'_> {
    /// Reads the budgets, the plans and how plans are chosen.
    pub(super) fn catalog<'m>(
        &mut self,
        budgets: &'m BTreeMap<Spanned<String>, Spanned<BudgetModel>>,
        plans: &'m BTreeMap<Spanned<String>, Spanned<PlanModel>>,
        selection: Option<&Spanned<PlanSelectionModel>>,
    ) -> Catalog<'m> {
        for name in budgets.keys().chain(plans.keys()) {
            if !super::valid_name(name.get_ref()) {
                self.problem(
                    name.span(),
                    format!(
                        "{:?} may use only letters, digits, '_', '-' and '.' (1 to 64 of them)",
                        name.get_ref()
                    ),
                );
            }
        }
        for plan in plans.values() {
            for name in plan.get_ref().budgets.keys() {
                if !budgets.keys().any(|b| b.get_ref() == name.get_ref()) {
                    self.problem(
                        name.span(),
                        format!(
                            "no budget is called {:?}{}",
                            name.get_ref(),
                            known(name.get_ref(), budgets.keys())
                        ),
                    );
                }
            }
        }
        let names: Vec<Arc<str>> = plans.keys().map(|n| n.get_ref().as_str().into()).collect();
        let selection = match (selection, plans.is_empty()) {
            (Some(s), true) => {
                self.problem(
                    s.span(),
                    "[plan_selection] chooses among plans, and none is defined; add [plans.NAME] tables or remove it",
                );
                None
            }
            (None, false) => {
                if let Some((first, _)) = plans.iter().next() {
                    self.problem(
                        first.span(),
                        "plans are chosen by [plan_selection] (by = a jwt claim, a trusted header or a client table), which is missing",
                    );
                }
                None
            }
            (None, true) => None,
            (Some(s), false) => self.plan_selection(s, names),
        };
        Catalog {
            budgets,
            plans,
            selection,
        }
    }

    fn plan_selection(
        &mut self,
        model: &Spanned<PlanSelectionModel>,
        names: Vec<Arc<str>>,
    ) -> Option<PlanSelection> {
        let m = model.get_ref();
        let no_route = Context {
            template: None,
            ignore_case: false,
            long_ids: (
                crate::client::DEFAULT_MAX_CLIENT_ID,
                crate::client::TooLong::Hash,
            ),
        };
        let rule = self.client(Some(&m.by), &no_route)?;
        let default = match &m.default {
            None => Some(None),
            Some(d) => match names.iter().position(|n| **n == *d.get_ref()) {
                Some(i) => Some(Some(i)),
                None => {
                    self.problem(
                        d.span(),
                        format!(
                            "no plan is called {:?}; the plans are {}",
                            d.get_ref(),
                            names.join(", ")
                        ),
                    );
                    None
                }
            },
        };
        let by = match (&m.table, rule.parts.as_slice()) {
            (Some(table), _) => {
                let path = self.resolve(table);
                let read = load_plan_table(&path, &names);
                match read {
                    Ok(read) => Some(PlanSource::Table {
                        client: Box::new(rule),
                        path,
                        read: Arc::new(read),
                    }),
                    Err(e) => {
                        self.problem(table.span(), format!("table: {e}"));
                        None
                    }
                }
            }
            (None, [IdPart::Claim(claim)]) => Some(PlanSource::Claim(Arc::clone(claim))),
            (None, [IdPart::Key(None)]) => Some(PlanSource::Key),
            (None, [IdPart::Header(name)]) => Some(PlanSource::Header(name.clone())),
            (None, _) => {
                self.problem(
                    m.by.span(),
                    "without a table, by names where the plan's name is read: a jwt claim (by = { from = \"jwt\", claim = \"plan\", … }) or a header set by a trusted proxy (by = { from = \"header\", name = \"X-Plan\" })",
                );
                None
            }
        };
        Some(PlanSelection {
            names,
            by: by?,
            default: default?,
        })
    }

    /// A route's policies: its own limits and each plan it refers to,
    /// with the budgets it draws from after each. `None` when something
    /// is wrong (reported).
    #[expect(clippy::too_many_arguments, reason = "one route's context, read once")]
    pub(super) fn route_policies(
        &mut self,
        route: &str,
        own: Option<&Spanned<Vec<Spanned<LimitModel>>>>,
        cost: u64,
        client: Option<&ClientRule>,
        cx: &Context<'_>,
        draws: &Draws<'_>,
        catalog: &Catalog<'_>,
    ) -> Option<(Policy, Vec<Option<Policy>>)> {
        let jwt = self.token_rule(client, catalog);
        let drawn = self.drawn_budgets(draws.budgets, catalog);
        let budgets = drawn.clone().unwrap_or_default();
        let scope: Arc<str> = route.into();
        // A plan may give a budget its own numbers: the same keys, counted
        // by the plan's limits.
        let build = |v: &mut Self,
                     items: Option<&Spanned<Vec<Spanned<LimitModel>>>>,
                     plan: Option<&PlanModel>| {
            let mut parts = Vec::new();
            if let Some(items) = items {
                parts.push((Arc::clone(&scope), None, items));
            }
            for (name, model) in &budgets {
                let own = plan.and_then(|p| {
                    p.budgets
                        .iter()
                        .find(|(n, _)| n.get_ref().as_str() == &**name)
                        .map(|(_, b)| b)
                });
                parts.push((
                    format!("@{name}").into(),
                    Some(Arc::clone(name)),
                    &own.unwrap_or(model).get_ref().limits,
                ));
            }
            v.policy(route, &parts, cost, cx, jwt.as_deref())
        };
        let policy = build(self, own, None);
        let mut plans = vec![None; catalog.plans.len()];
        let mut ok = true;
        for name in draws.plans.map_or(&[][..], |p| p.get_ref().as_slice()) {
            match catalog
                .plans
                .iter()
                .position(|(n, _)| n.get_ref() == name.get_ref())
            {
                Some(i) => {
                    let plan = catalog.plans.values().nth(i).map(Spanned::get_ref);
                    let model = plan.and_then(|p| p.limits.as_ref());
                    match build(self, model, plan) {
                        Some(p) => plans[i] = Some(p),
                        None => ok = false,
                    }
                }
                None => {
                    self.problem(
                        name.span(),
                        format!(
                            "no plan is called {:?}{}",
                            name.get_ref(),
                            known(name.get_ref(), catalog.plans.keys())
                        ),
                    );
                    ok = false;
                }
            }
        }
        if draws.plans.is_some() && catalog.selection.is_none() && !catalog.plans.is_empty() {
            ok = false;
        }
        let policy = policy?;
        // A route that refers to no plan has none to choose from: the
        // plan is then never read for its requests.
        if plans.iter().all(Option::is_none) {
            plans.clear();
        }
        (ok && drawn.is_some()).then_some((policy, plans))
    }

    /// The budgets a route names, each once.
    fn drawn_budgets<'m>(
        &mut self,
        names: Option<&Spanned<Vec<Spanned<String>>>>,
        catalog: &Catalog<'m>,
    ) -> Option<Vec<(Arc<str>, &'m Spanned<BudgetModel>)>> {
        let mut out: Vec<(Arc<str>, &'m Spanned<BudgetModel>)> = Vec::new();
        let mut ok = true;
        for name in names.map_or(&[][..], |n| n.get_ref().as_slice()) {
            let text = name.get_ref();
            if out.iter().any(|(n, _)| **n == **text) {
                self.problem(name.span(), format!("budget {text:?} is named twice"));
                ok = false;
                continue;
            }
            match catalog.budgets.iter().find(|(n, _)| n.get_ref() == text) {
                Some((_, model)) => out.push((text.as_str().into(), model)),
                None => {
                    self.problem(
                        name.span(),
                        format!(
                            "no budget is called {text:?}{}",
                            known(text, catalog.budgets.keys())
                        ),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(out)
    }

    /// The verification a route's claim-carried limits use: the route
    /// client's token rule, else the plan selection's.
    fn token_rule(
        &self,
        client: Option<&ClientRule>,
        catalog: &Catalog<'_>,
    ) -> Option<Arc<ClaimRule>> {
        let from_client = client.and_then(|c| {
            c.parts.iter().find_map(|p| match p {
                IdPart::Claim(rule) => Some(Arc::clone(rule)),
                _ => None,
            })
        });
        from_client.or_else(|| match catalog.selection.as_ref().map(|s| &s.by) {
            Some(PlanSource::Claim(rule)) => Some(Arc::clone(rule)),
            _ => None,
        })
    }

    /// One policy from parts (a scope, the budget it is if any, its
    /// limits), in order; limits named as a route's are (`route`, or
    /// `route.N`), a budget's by the budget's name.
    fn policy(
        &mut self,
        route: &str,
        parts: &[Part<'_>],
        cost: u64,
        cx: &Context<'_>,
        jwt: Option<&ClaimRule>,
    ) -> Option<Policy> {
        let mut limits = Vec::new();
        let mut terms = Vec::new();
        let mut ok = true;
        for (scope, budget, items) in parts {
            let Some(own) = self.limits(Some(items), cost) else {
                ok = false;
                continue;
            };
            let label = budget.as_deref().unwrap_or(route);
            let count = own.len();
            for (i, (limit, item)) in own.into_iter().zip(items.get_ref()).enumerate() {
                let name = if count == 1 {
                    label.to_owned()
                } else {
                    format!("{label}.{}", i + 1)
                };
                let Some(t) =
                    self.limit_terms(item.get_ref(), &limit, name, (scope, budget, i), cx, jwt)
                else {
                    ok = false;
                    continue;
                };
                terms.push(t);
                limits.push(limit);
            }
        }
        if !ok {
            return None;
        }
        // A policy whose every limit counts the route's client at its own
        // place needs no key per limit; one that counts by the answer keeps
        // them, to give back what the answer does not count.
        if terms.iter().enumerate().all(|(position, t)| {
            t.count_when.is_none()
                && t.counting
                    .as_ref()
                    .is_some_and(|c| c.is_plain(route, position))
        }) {
            for t in &mut terms {
                t.counting = None;
            }
        }
        Some(Policy::with_terms(limits, terms))
    }

    /// One limit's terms: `name`, whose count it is (limit `i` of
    /// `scope`, of `budget` if any), and what its keys say of its number,
    /// windows, denials and the answers it counts.
    fn limit_terms(
        &mut self,
        m: &LimitModel,
        limit: &crate::limit::Limit,
        name: String,
        (scope, budget, i): (&Arc<str>, &Option<Arc<str>>, usize),
        cx: &Context<'_>,
        jwt: Option<&ClaimRule>,
    ) -> Option<LimitTerms> {
        let key = match &m.key {
            None => Some((KeySource::Client, "client".to_owned())),
            Some(k) => self.client(Some(k), cx).map(|rule| {
                let shown = rule.describe();
                (KeySource::Rule(Box::new(rule)), shown)
            }),
        };
        let claimed = match &m.limit_from {
            None => Some(None),
            Some(from) => self.claimed_limit(from, jwt).map(|c| Some(Arc::new(c))),
        };
        let calendar = self
            .calendar_of(&m.calendar(), jwt)
            .map(|c| c.map(Arc::new));
        let code = match &m.deny_code {
            None => Some(None),
            Some(c) => self
                .choice(Some(c), "deny_code", &crate::routes::DenyCode::NAMES)
                .map(Some),
        };
        let count_when = match &m.count_when {
            None => Some(None),
            Some(c) => self
                .count_when(c, limit.lease.is_some())
                .map(|c| Some(Arc::new(c))),
        };
        let (key, shown) = key?;
        let counting = Counting {
            scope: Arc::clone(scope),
            // As a Redis key names it: the same limit of the scope under
            // another plan counts on when it counts alike.
            entry: format!("{scope}#{i}:{}:{}", limit.algorithm.name(), limit.window_ms).into(),
            index: i,
            key,
            shown: shown.into(),
            budget: budget.clone(),
        };
        Some(LimitTerms {
            name,
            counting: Some(counting),
            claimed: claimed?,
            calendar: calendar?,
            code: code?,
            count_when: count_when?,
        })
    }

    fn claimed_limit(
        &mut self,
        from: &Spanned<ClaimLimitModel>,
        jwt: Option<&ClaimRule>,
    ) -> Option<ClaimedLimit> {
        let m = from.get_ref();
        let Some(jwt) = jwt else {
            self.problem(
                from.span(),
                "limit_from reads a verified token claim: give the route a jwt client (client = { from = \"jwt\", … }) or choose plans by a jwt claim ([plan_selection] by = { from = \"jwt\", … })",
            );
            return None;
        };
        let default = self.count(&m.default, "default");
        let ceiling = self.count(&m.max, "max");
        if m.claim.get_ref().is_empty() {
            self.problem(m.claim.span(), "the claim's name is empty");
            return None;
        }
        let (default, ceiling) = (default?, ceiling?);
        if default > ceiling {
            self.problem(
                m.default.span(),
                format!("default {default} is above max {ceiling}; a token without the claim would get more than any token may claim"),
            );
            return None;
        }
        Some(ClaimedLimit {
            rule: Arc::new(jwt.for_claim(m.claim.get_ref())),
            default,
            ceiling,
        })
    }

    /// Plans and budgets that no route uses are refused: limits written
    /// for nothing are a mistake (a route's name misspelt, a line lost).
    pub(super) fn unused(&mut self, catalog: &Catalog<'_>, used: &[(bool, Range<usize>, String)]) {
        let is_used = |budget: bool, name: &str| {
            used.iter()
                .any(|(b, _, n)| *b == budget && n.as_str() == name)
        };
        for name in catalog.budgets.keys() {
            if !is_used(true, name.get_ref()) {
                self.problem(
                    name.span(),
                    format!(
                        "no route draws from budget {:?}; add budgets = [{:?}] to the routes that share it, or remove it",
                        name.get_ref(),
                        name.get_ref()
                    ),
                );
            }
        }
        for name in catalog.plans.keys() {
            if !is_used(false, name.get_ref()) {
                self.problem(
                    name.span(),
                    format!(
                        "no route refers to plan {:?}; add plans = [{:?}] to the routes it applies to, or remove it",
                        name.get_ref(),
                        name.get_ref()
                    ),
                );
            }
        }
    }
}

/// What is defined instead of `word`: the closest name first, when one
/// is close; "(none is defined)" when nothing is.
fn known<'a>(word: &str, names: impl Iterator<Item = &'a Spanned<String>>) -> String {
    let all: Vec<&str> = names.map(|n| n.get_ref().as_str()).collect();
    if all.is_empty() {
        return " (none is defined)".to_owned();
    }
    match super::problems::closest(word, all.iter().copied()) {
        Some(near) => format!("; did you mean {near:?}? (defined: {})", all.join(", ")),
        None => format!("; defined: {}", all.join(", ")),
    }
}

/// Reads a client → plan table from `path`, for plans `names`: the whole
/// file, or an error naming each line that is wrong. A table is used only
/// once read whole.
pub fn load_plan_table(path: &std::path::Path, names: &[Arc<str>]) -> Result<PlanTable, LoadError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: path.to_owned(),
        source,
    })?;
    PlanTable::parse(&text, names).map_err(|lines| {
        LoadError::Invalid(
            lines
                .into_iter()
                .map(|(line, message)| Problem {
                    path: path.to_owned(),
                    line,
                    column: 1,
                    message,
                })
                .collect(),
        )
    })
}

/// Where a configuration's client → plan table is read, the plans it may
/// name, and the table as read with the configuration.
#[derive(Debug, Clone)]
pub struct PlanTableFile {
    /// The table's file.
    pub path: PathBuf,
    /// The plans its lines may name.
    pub names: Vec<Arc<str>>,
    /// The table as read with the configuration.
    pub read: Arc<PlanTable>,
}
