//! The validator: one run over a file, which reads each section and keeps
//! every problem found, each at its line and column, so that all of them
//! are reported at once; and the checks every section shares (a number in
//! a range, one of some names, an address, networks).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::Path;

use ipnet::IpNet;
use toml::Spanned;

use super::document::Removed;
use super::problems::{Problem, closest, line_column};

/// One run over a file: what it is, and every problem found in it so far.
pub(super) struct Validator<'a> {
    pub(super) path: &'a Path,
    pub(super) text: &'a str,
    pub(super) problems: Vec<Problem>,
    /// The upstreams routes name, in the order first named: what
    /// [`crate::routes::Upstream::index`] counts in.
    pub(super) upstreams: Vec<crate::proxy::settings::Upstream>,
    /// Each upstream's place in `upstreams`, by the URL or name routes
    /// give: routes that give the same one share it.
    pub(super) upstream_index: HashMap<String, usize>,
    /// Entries taken out of the file because serde refused them (already
    /// reported).
    pub(super) removed: Removed,
}

impl Validator<'_> {
    pub(super) fn problem(&mut self, span: Range<usize>, message: impl Into<String>) {
        // A table that lacks what was taken out of it is not a second fault.
        if self.removed.explains(&span) {
            return;
        }
        let (line, column) = line_column(self.text, span.start);
        let problem = Problem {
            path: self.path.to_owned(),
            line,
            column,
            message: message.into(),
        };
        // The same problem found twice (a table read again) is said once.
        if !self.problems.contains(&problem) {
            self.problems.push(problem);
        }
    }

    /// The problems found, in the order of the file.
    pub(super) fn sorted_problems(&mut self) -> Vec<Problem> {
        let mut problems = std::mem::take(&mut self.problems);
        problems.sort_by_key(|p| (p.line, p.column));
        problems
    }

    /// A whole number in `range`, or `default` when `value` is absent.
    pub(super) fn bounded(
        &mut self,
        value: Option<&Spanned<i64>>,
        default: usize,
        range: std::ops::RangeInclusive<usize>,
        message: &str,
    ) -> Option<usize> {
        let Some(value) = value else {
            return Some(default);
        };
        match usize::try_from(*value.get_ref()) {
            Ok(n) if range.contains(&n) => Some(n),
            _ => {
                self.problem(value.span(), message);
                None
            }
        }
    }

    /// One of `choices` by name (the first when `value` is absent).
    pub(super) fn choice<T: Copy>(
        &mut self,
        value: Option<&Spanned<String>>,
        key: &str,
        choices: &[(&str, T)],
    ) -> Option<T> {
        let Some(value) = value else {
            return choices.first().map(|&(_, c)| c);
        };
        let found = choices
            .iter()
            .find(|(name, _)| *name == value.get_ref().as_str());
        if found.is_none() {
            let names: Vec<String> = choices.iter().map(|(n, _)| format!("{n:?}")).collect();
            let hint = closest(value.get_ref(), choices.iter().map(|&(n, _)| n))
                .map(|near| format!("; did you mean {near:?}?"))
                .unwrap_or_default();
            self.problem(
                value.span(),
                format!(
                    "{key} {:?} is not one of {}{hint}",
                    value.get_ref(),
                    names.join(", ")
                ),
            );
        }
        found.map(|&(_, c)| c)
    }

    pub(super) fn socket_addr(
        &mut self,
        value: &Spanned<String>,
        what: &str,
    ) -> Option<SocketAddr> {
        match value.get_ref().parse() {
            Ok(addr) => Some(addr),
            Err(_) => {
                self.problem(
                    value.span(),
                    format!(
                        "{what} {:?} is not an address and port such as \"0.0.0.0:8080\"",
                        value.get_ref()
                    ),
                );
                None
            }
        }
    }

    pub(super) fn networks(&mut self, list: &[Spanned<String>], key: &str) -> Vec<IpNet> {
        let mut nets = Vec::new();
        for cidr in list {
            match super::parse_cidr(cidr.get_ref()) {
                Some(net) => nets.push(net),
                None => self.problem(
                    cidr.span(),
                    format!(
                        "{key} entry {:?} is not an address or CIDR such as \"10.0.0.0/8\"",
                        cidr.get_ref()
                    ),
                ),
            }
        }
        nets
    }
}
