//! Reading a file into the serde model so that one run reports every
//! problem: all syntax errors, then every unknown key and every value of
//! the wrong type, each at its own line and column.
//!
//! serde stops at the first error, so the document is parsed once into
//! toml's spanned tree, and the model is read from it repeatedly: after
//! each error the entry it names is taken out of the tree (the key, the
//! value of the wrong type, or the table that lacks a required key) and
//! reading starts again. What is left is a valid model of the rest of the
//! file, which the validator then checks as usual. A problem that only
//! follows from an entry already taken out (a table now lacking the key
//! whose value was wrong) is not reported twice: see [`Removed`].

use std::ops::Range;

use serde::Deserialize as _;
use toml::Spanned;
use toml::de::{DeArray, DeTable, DeValue};

use super::{FileModel, Validator};

/// At most this many entries are taken out before giving up on a file.
const MAX_REMOVALS: usize = 200;

/// Entries taken out of the document: each one's span, the spans of the
/// tables and arrays that held it, innermost first (a `[table]`'s span is
/// its header; the document's is last), and its key.
#[derive(Debug, Default)]
pub(super) struct Removed(Vec<Taken>);

impl Removed {
    /// Whether serde's "missing field `x`" at `span` only says that `x`
    /// was taken out of the table at `span`.
    fn explains_missing(&self, message: &str, span: &Range<usize>) -> bool {
        let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
        else {
            return false;
        };
        self.0
            .iter()
            .any(|(_, holders, key)| key.as_deref() == Some(field) && holders.first() == Some(span))
    }

    /// Whether a problem at `span` is a consequence of an entry already
    /// reported and taken out: it is about a table or array that held one.
    pub(super) fn explains(&self, span: &Range<usize>) -> bool {
        self.0.iter().any(|(gone, holders, _)| {
            holders.contains(span)
                || (span.start <= gone.start && gone.end <= span.end && span != gone)
        })
    }
}

impl Validator<'_> {
    /// The file's model with every entry serde refused taken out, each
    /// refusal reported; `None` when even that is impossible (a syntax
    /// error, or the file's own top level is wrong).
    pub(super) fn model(&mut self) -> Option<(FileModel, Removed)> {
        let (root, syntax) = DeTable::parse_recoverable(self.text);
        if !syntax.is_empty() {
            for e in syntax {
                self.problem(e.span().unwrap_or(0..0), e.message().trim_end().to_owned());
            }
            return None;
        }
        let span = root.span();
        let mut table = root.into_inner();
        let mut removed = Removed::default();
        for _ in 0..MAX_REMOVALS {
            let de = toml::de::Deserializer::from(Spanned::new(span.clone(), table.clone()));
            let e = match FileModel::deserialize(de) {
                Ok(model) => return Some((model, removed)),
                Err(e) => e,
            };
            let at = e.span().unwrap_or(0..0);
            let message = e.message().trim_end();
            let explained = removed.explains_missing(message, &at);
            let taken = remove_at(&mut table, &at);
            if !explained {
                let key = taken.as_ref().and_then(|(_, _, key)| key.as_deref());
                self.problem(at.clone(), super::problems::in_plain_words(message, key));
            }
            match taken {
                Some((gone, mut holders, key)) => {
                    holders.push(span.clone());
                    removed.0.push((gone, holders, key));
                }
                None => return None,
            }
        }
        None
    }
}

/// What was taken out: its span, the spans of what held it, its key.
type Taken = (Range<usize>, Vec<Range<usize>>, Option<String>);

/// Takes out of `table` the innermost entry at `at`: the key or value it
/// points into, or the table (or array element) whose span it is. Returns
/// the span of what was taken out and the spans of what held it.
fn remove_at(table: &mut DeTable<'_>, at: &Range<usize>) -> Option<Taken> {
    // Deeper first: a `[table]`'s own span is only its header, so the
    // entries under it are searched whatever its span.
    for (_, value) in table.iter_mut() {
        let holder = value.span();
        if let Some((gone, mut holders, key)) = remove_in(value, at) {
            holders.push(holder);
            return Some((gone, holders, key));
        }
    }
    let key = table
        .iter()
        .find(|(k, v)| contains(&k.span(), at) || contains(&v.span(), at))
        .map(|(k, _)| k.clone())?;
    let value = table.remove(&key)?;
    let (k, v) = (key.span(), value.span());
    Some((
        k.start.min(v.start)..k.end.max(v.end),
        Vec::new(),
        Some(key.get_ref().to_string()),
    ))
}

/// [`remove_at`] inside a value: a table's entry or an array's element.
fn remove_in(value: &mut Spanned<DeValue<'_>>, at: &Range<usize>) -> Option<Taken> {
    match value.get_mut() {
        DeValue::Table(table) => remove_at(table, at),
        DeValue::Array(array) => {
            for item in array.as_mut() {
                let holder = item.span();
                if let Some((gone, mut holders, key)) = remove_in(item, at) {
                    holders.push(holder);
                    return Some((gone, holders, key));
                }
            }
            let index = array.iter().position(|item| contains(&item.span(), at))?;
            let gone = array[index].span();
            let items = std::mem::replace(array, DeArray::new());
            *array = items
                .into_iter()
                .enumerate()
                .filter_map(|(i, item)| (i != index).then_some(item))
                .collect();
            Some((gone, Vec::new(), None))
        }
        _ => None,
    }
}

/// `outer` holds all of `inner` (an empty `inner` at its start counts).
fn contains(outer: &Range<usize>, inner: &Range<usize>) -> bool {
    outer.start <= inner.start && inner.end <= outer.end && outer.start < outer.end
}
