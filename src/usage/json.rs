//! Numbers at given paths of a JSON text, read as it streams past: the
//! scanner holds the path it is at (bounded depth, bounded key length) and
//! the number it is reading, never the text. Several JSON texts one after
//! another (newline-delimited JSON) are read in turn; a path seen again
//! keeps its last number.
//!
//! It is a reader, not a validator: it follows the structure well enough
//! to know every value's path, and stops (finding nothing more) at
//! anything it cannot follow. Keys are compared as their bytes appear;
//! a key written with escapes does not match.

use std::sync::Arc;

use super::settings::{JsonPath, Segment};

/// Deepest nesting followed; past it the scanner stops.
const MAX_DEPTH: usize = 64;
/// Longest key compared; a longer key matches no path.
const MAX_KEY: usize = 128;
/// Longest number read; a longer one is not a number of ours.
const MAX_NUMBER: usize = 40;

/// Where the scanner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before a value (or, inside an array, its end).
    Value,
    /// After a value: a comma, a container's end, or (at the top) another
    /// text.
    After,
    /// Inside an object, before a key or its end.
    Key,
    /// After a key, before its colon.
    Colon,
    /// Inside a string; `key` when it is an object's key.
    Text { key: bool, escaped: bool },
    /// Inside a number.
    Number,
    /// Inside `true`, `false` or `null`.
    Word,
    /// Something it cannot follow: it reads nothing more.
    Stopped,
}

/// One open container.
#[derive(Debug)]
enum Level {
    /// An object, with the key of the value being read; `None` when the
    /// key was too long or escaped to compare.
    Object(Option<Vec<u8>>),
    /// An array, with the index of the value being read.
    Array(u64),
}

/// Reads the numbers at `paths` out of a JSON text fed in pieces.
#[derive(Debug)]
pub struct Scanner {
    /// Each wanted path.
    paths: Arc<[JsonPath]>,
    /// The last number found at each path.
    found: Vec<Option<f64>>,
    levels: Vec<Level>,
    state: State,
    number: Vec<u8>,
}

impl Scanner {
    /// A scanner for the numbers at `paths`.
    pub fn new(paths: Arc<[JsonPath]>) -> Self {
        Self {
            found: vec![None; paths.len()],
            paths,
            levels: Vec::new(),
            state: State::Value,
            number: Vec::new(),
        }
    }

    /// Reads the next piece of the text.
    pub fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.state == State::Stopped {
                return;
            }
            self.step(b);
        }
    }

    /// The numbers found, one per path in order, once the text has ended;
    /// `None` where a path held no number.
    pub fn finish(&mut self) -> &[Option<f64>] {
        if self.state == State::Number {
            self.number_ended();
        }
        &self.found
    }

    /// Forgets everything read, keeping the paths: ready for another text.
    pub fn reset(&mut self) {
        self.found.iter_mut().for_each(|f| *f = None);
        self.levels.clear();
        self.state = State::Value;
        self.number.clear();
    }

    fn step(&mut self, b: u8) {
        match self.state {
            State::Value => self.value(b),
            State::After => self.after(b),
            State::Key => match b {
                b'"' => {
                    if let Some(Level::Object(key)) = self.levels.last_mut() {
                        *key = Some(Vec::new());
                    }
                    self.state = State::Text {
                        key: true,
                        escaped: false,
                    };
                }
                b'}' => self.close(),
                _ if b.is_ascii_whitespace() => {}
                _ => self.state = State::Stopped,
            },
            State::Colon => match b {
                b':' => self.state = State::Value,
                _ if b.is_ascii_whitespace() => {}
                _ => self.state = State::Stopped,
            },
            State::Text { key, escaped } => self.text(b, key, escaped),
            State::Number => {
                if b.is_ascii_digit() || matches!(b, b'-' | b'+' | b'.' | b'e' | b'E') {
                    if self.number.len() <= MAX_NUMBER {
                        self.number.push(b);
                    }
                } else {
                    self.number_ended();
                    self.after(b);
                }
            }
            State::Word => {
                if !b.is_ascii_alphabetic() {
                    self.state = State::After;
                    self.after(b);
                }
            }
            State::Stopped => {}
        }
    }

    fn value(&mut self, b: u8) {
        match b {
            b'{' => self.open(Level::Object(None), State::Key),
            b'[' => self.open(Level::Array(0), State::Value),
            b'"' => {
                self.state = State::Text {
                    key: false,
                    escaped: false,
                }
            }
            b'-' | b'0'..=b'9' => {
                self.number.clear();
                self.number.push(b);
                self.state = State::Number;
            }
            b't' | b'f' | b'n' => self.state = State::Word,
            b']' if matches!(self.levels.last(), Some(Level::Array(_))) => self.close(),
            _ if b.is_ascii_whitespace() => {}
            _ => self.state = State::Stopped,
        }
    }

    fn after(&mut self, b: u8) {
        match (b, self.levels.last_mut()) {
            (b',', Some(Level::Object(_))) => self.state = State::Key,
            (b',', Some(Level::Array(index))) => {
                *index += 1;
                self.state = State::Value;
            }
            (b'}', Some(Level::Object(_))) | (b']', Some(Level::Array(_))) => self.close(),
            _ if b.is_ascii_whitespace() => self.state = State::After,
            // Another text after a whole one.
            (_, None) => self.value(b),
            _ => self.state = State::Stopped,
        }
    }

    fn text(&mut self, b: u8, key: bool, escaped: bool) {
        let mut escaped_now = false;
        match (b, escaped) {
            (b'"', false) => {
                self.state = if key { State::Colon } else { State::After };
                return;
            }
            (b'\\', false) => {
                escaped_now = true;
                if key {
                    self.forget_key();
                }
            }
            _ => {
                if key && let Some(Level::Object(Some(k))) = self.levels.last_mut() {
                    if k.len() < MAX_KEY {
                        k.push(b);
                    } else {
                        self.forget_key();
                    }
                }
            }
        }
        self.state = State::Text {
            key,
            escaped: escaped_now,
        };
    }

    fn forget_key(&mut self) {
        if let Some(Level::Object(key)) = self.levels.last_mut() {
            *key = None;
        }
    }

    fn open(&mut self, level: Level, state: State) {
        if self.levels.len() >= MAX_DEPTH {
            self.state = State::Stopped;
            return;
        }
        self.levels.push(level);
        self.state = state;
    }

    fn close(&mut self) {
        self.levels.pop();
        self.state = State::After;
    }

    /// A number ended: kept for every path it is at.
    fn number_ended(&mut self) {
        self.state = State::After;
        let value = std::str::from_utf8(&self.number)
            .ok()
            .filter(|_| self.number.len() <= MAX_NUMBER)
            .and_then(|s| s.parse::<f64>().ok());
        for (path, found) in self.paths.iter().zip(&mut self.found) {
            if at_path(&self.levels, path.segments()) {
                *found = value;
            }
        }
    }
}

/// Whether the open `levels` are the path `path`.
fn at_path(levels: &[Level], path: &[Segment]) -> bool {
    levels.len() == path.len()
        && levels.iter().zip(path).all(|(level, segment)| match level {
            Level::Object(Some(key)) => segment.is_key(key),
            Level::Object(None) => false,
            Level::Array(index) => segment.is_index(*index),
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The paths `texts` name.
    pub(crate) fn paths(texts: &[&str]) -> Arc<[JsonPath]> {
        texts
            .iter()
            .map(|t| JsonPath::parse(t).expect("a path"))
            .collect()
    }

    fn scan(pieces: &[&str], texts: &[&str]) -> Vec<Option<f64>> {
        let mut s = Scanner::new(paths(texts));
        for p in pieces {
            s.feed(p.as_bytes());
        }
        s.finish().to_vec()
    }

    #[test]
    fn numbers_are_found_at_their_paths_however_the_text_is_cut() {
        let text = r#"{"id":"x","usage":{"input_tokens":12,"output_tokens":340,"nested":{"output_tokens":9}},"choices":[{"n":1},{"n":2.5}],"done":true,"none":null}"#;
        let paths = [
            "usage.input_tokens",
            "usage.output_tokens",
            "choices.1.n",
            "id",
            "missing",
        ];
        let want = vec![Some(12.0), Some(340.0), Some(2.5), None, None];
        assert_eq!(scan(&[text], &paths), want);
        // Cut at every byte.
        for cut in 0..text.len() {
            assert_eq!(
                scan(&[&text[..cut], &text[cut..]], &paths),
                want,
                "cut at {cut}"
            );
        }
        let one_by_one: Vec<&str> = (0..text.len()).map(|i| &text[i..i + 1]).collect();
        assert_eq!(scan(&one_by_one, &paths), want);
    }

    #[test]
    fn strings_that_look_like_structure_are_strings() {
        let text = r#"{"a":"}{\"usage\":{\"n\":5}","usage":{"n" : 7 }, "b": ["]", "\\"]}"#;
        assert_eq!(scan(&[text], &["usage.n"]), vec![Some(7.0)]);
    }

    #[test]
    fn a_later_text_or_a_repeated_key_keeps_the_last_number() {
        assert_eq!(
            scan(&["{\"n\":1}\n{\"n\":2}\n{\"m\":3}"], &["n"]),
            vec![Some(2.0)]
        );
        assert_eq!(scan(&["{\"n\":1,\"n\":4}"], &["n"]), vec![Some(4.0)]);
        // A number outside any object is at no key's path.
        assert_eq!(scan(&["7"], &["n"]), vec![None]);
        assert!(JsonPath::parse("").is_none() && JsonPath::parse("a..b").is_none());
    }

    #[test]
    fn broken_or_hostile_text_finds_nothing_past_the_break_and_holds_little() {
        assert_eq!(scan(&["{\"n\" 1}"], &["n"]), vec![None]);
        assert_eq!(scan(&["{\"n\":1} }{\"n\":2}"], &["n"]), vec![Some(1.0)]);
        // Deep nesting stops the scanner instead of growing it.
        let deep = "[".repeat(100_000);
        let mut s = Scanner::new(paths(&["n"]));
        s.feed(deep.as_bytes());
        assert!(s.levels.len() <= MAX_DEPTH);
        // A huge key or number is not kept whole.
        let mut s = Scanner::new(paths(&["n"]));
        s.feed(b"{\"");
        s.feed("k".repeat(1_000_000).as_bytes());
        s.feed(b"\":1, \"n\": ");
        s.feed("9".repeat(1_000_000).as_bytes());
        s.feed(b"}");
        assert_eq!(s.finish(), &[None]);
        assert!(s.number.capacity() < 1_000);
        // An escaped key does not match.
        assert_eq!(scan(&["{\"\\u006e\":1}"], &["n"]), vec![None]);
    }
}
