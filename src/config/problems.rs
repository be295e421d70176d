//! What is wrong with a file: problems located by line and column.

use std::fmt;
use std::path::PathBuf;

/// One problem in a configuration file, located by line and column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file it was found in.
    pub path: PathBuf,
    /// 1-based line.
    pub line: usize,
    /// 1-based column (in characters).
    pub column: usize,
    /// What is wrong and what to do about it.
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}: {}",
            self.path.display(),
            self.line,
            self.column,
            self.message
        )
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read at all.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is not a valid configuration.
    #[error("{}", list(.0))]
    Invalid(Vec<Problem>),
}

fn list(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// 1-based line and column (in characters) of byte `offset` in `text`.
pub(super) fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Where each line of a text starts: the line and column of many
/// offsets, each found without reading the text from its start (a keys
/// file names every key's place).
pub(super) struct Lines<'t> {
    text: &'t str,
    /// The byte offset of each line's start, the first line's (0) first.
    starts: Vec<usize>,
}

impl<'t> Lines<'t> {
    /// `text`'s lines.
    pub(super) fn new(text: &'t str) -> Self {
        let starts = std::iter::once(0)
            .chain(text.match_indices('\n').map(|(i, _)| i + 1))
            .collect();
        Self { text, starts }
    }

    /// The 1-based line and column (in characters) of byte `offset`, as
    /// [`line_column`] says.
    pub(super) fn at(&self, offset: usize) -> (usize, usize) {
        let offset = offset.min(self.text.len());
        let line = self.starts.partition_point(|&start| start <= offset);
        let start = self.starts.get(line.wrapping_sub(1)).copied().unwrap_or(0);
        let column = self
            .text
            .get(start..offset)
            .map_or(0, |s| s.chars().count())
            + 1;
        (line, column)
    }
}

/// The known name closest to `word`, when it is close enough to be the
/// one meant: at most one edit for short names, two for longer ones.
pub(super) fn closest<'a>(word: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let most = if word.chars().count() <= 4 { 1 } else { 2 };
    known
        .into_iter()
        .map(|name| (edits(word, name), name))
        .filter(|&(d, _)| d <= most)
        .min_by_key(|&(d, _)| d)
        .map(|(_, name)| name)
}

/// Levenshtein distance, in characters, ignoring case.
fn edits(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.to_lowercase().chars().collect();
    let b: Vec<char> = b.to_lowercase().chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

/// A message of the TOML reader in the operator's words: `key` is the key
/// whose entry it is about, when known.
pub(super) fn in_plain_words(message: &str, key: Option<&str>) -> String {
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let (field, rest) = rest.split_once('`').unwrap_or((rest, ""));
        let known: Vec<&str> = rest.split('`').skip(1).step_by(2).collect();
        let hint = match closest(field, known.iter().copied()) {
            Some("routes") => " (routes are [[routes]] tables); did you mean `routes`?".to_owned(),
            Some(near) => format!("; did you mean `{near}`?"),
            None if known.is_empty() => String::new(),
            None => format!("; the keys here are {}", known.join(", ")),
        };
        return format!("unknown key `{field}`{hint}");
    }
    if let Some(rest) = message.strip_prefix("invalid type: ") {
        let (found, expected) = rest.split_once(", expected ").unwrap_or((rest, ""));
        let what = key.map_or_else(|| "this value".to_owned(), |k| format!("`{k}`"));
        let want = match expected {
            "i64" | "u64" | "u32" | "usize" | "i32" => "a whole number",
            "a boolean" => "true or false",
            "a string" => "a string in quotes",
            "a sequence" => "a list in brackets",
            e if e.starts_with("struct") || e.contains("map") || e.contains("table") => {
                "a table in braces"
            }
            other => other,
        };
        let found = match (
            found.strip_prefix("integer `"),
            found.strip_prefix("string "),
        ) {
            (Some(n), _) => format!("the number {}", n.trim_end_matches('`')),
            (_, Some(text)) => format!("the string {text}"),
            _ => found.replace('`', ""),
        };
        let like = match (want, found.strip_prefix("the string ")) {
            ("a whole number", Some(text))
                if text.trim_matches('"').trim().parse::<i64>().is_ok() =>
            {
                format!(
                    ", like {}, not the string {text}",
                    text.trim_matches('"').trim()
                )
            }
            ("a list in brackets", Some(text)) => format!(", like [{text}], not the string {text}"),
            ("true or false", Some(text)) => {
                format!(", like {}, not the string {text}", text.trim_matches('"'))
            }
            (_, _) => format!(", not {found}"),
        };
        return format!("{what} must be {want}{like}");
    }
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.split('`').next())
    {
        return format!("`{field}` is required here");
    }
    message.to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_misses_are_suggested_and_far_ones_are_not() {
        let keys = ["listen", "admin_listen", "drain_delay", "routes"];
        assert_eq!(closest("admin_listn", keys), Some("admin_listen"));
        assert_eq!(closest("route", keys), Some("routes"));
        assert_eq!(closest("Listen", keys), Some("listen"));
        assert_eq!(closest("timeout", keys), None);
    }

    #[test]
    fn serde_messages_are_said_in_the_operators_words() {
        assert_eq!(
            in_plain_words("invalid type: string \"20\", expected i64", Some("limit")),
            "`limit` must be a whole number, like 20, not the string \"20\""
        );
        assert_eq!(
            in_plain_words(
                "invalid type: string \"POST\", expected a sequence",
                Some("methods")
            ),
            "`methods` must be a list in brackets, like [\"POST\"], not the string \"POST\""
        );
        assert_eq!(
            in_plain_words(
                "unknown field `admin_listn`, expected one of `listen`, `admin_listen`",
                None
            ),
            "unknown key `admin_listn`; did you mean `admin_listen`?"
        );
        assert!(
            in_plain_words(
                "unknown field `zzz`, expected one of `listen`, `admin_listen`",
                None
            )
            .ends_with("the keys here are listen, admin_listen")
        );
    }

    #[test]
    fn line_and_column_count_from_one() {
        let text = "a = 1\nbb = 2\n  ccé = 3";
        assert_eq!(line_column(text, 0), (1, 1));
        let lines = Lines::new(text);
        for offset in (0..=text.len() + 2).filter(|&o| o > text.len() || text.is_char_boundary(o)) {
            assert_eq!(lines.at(offset), line_column(text, offset), "at {offset}");
        }
        assert_eq!(line_column(text, 6), (2, 1));
        assert_eq!(line_column(text, 9), (2, 4));
        assert_eq!(line_column(text, text.find('=').map_or(0, |_| 19)), (3, 6));
    }
}
