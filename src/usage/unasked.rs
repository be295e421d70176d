//! The usage event of a stream whose client did not ask for it: floodgate
//! asked the upstream to report the stream's usage (`stream_include_usage`)
//! to settle it, and takes that one event out of what the client
//! receives; every other byte goes out as the upstream sent it. An
//! OpenAI-style stream reports its usage in an event of its own, its
//! `choices` empty and its `usage` an object: that event is the one taken
//! out, its blank line with it. An event that reports usage beside choices
//! is the client's content, and stays.
//!
//! Each event is held until its blank line (a client acts on an event only
//! then), at most [`MAX_HELD`] bytes: a longer event is no usage event,
//! and goes out as it comes. Memory is bounded whatever the upstream
//! sends.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde::de::IgnoredAny;

/// Most bytes of one event held back; a usage event is a few hundred.
pub const MAX_HELD: usize = 64 * 1024;

/// Takes the usage event out of an event stream fed in pieces.
#[derive(Debug)]
pub struct UnaskedUsage {
    /// The current event's bytes from its start, not yet sent.
    held: BytesMut,
    /// The current event is past [`MAX_HELD`]: it goes out as it comes.
    passing: bool,
    /// The current line has no bytes yet (a line end now is a blank line).
    line_empty: bool,
    /// The last byte was a carriage return ending a line with bytes: a
    /// line feed next is part of the same line end.
    after_cr: bool,
    /// A blank line ended at a carriage return: the event ends after a
    /// line feed that may come next, or before any other byte.
    ending: bool,
}

impl Default for UnaskedUsage {
    fn default() -> Self {
        Self::new()
    }
}

/// What goes out of one piece: nothing, a slice of it, or its kept parts
/// copied together.
#[derive(Default)]
struct Out {
    one: Option<Bytes>,
    more: Option<BytesMut>,
}

impl Out {
    fn push(&mut self, bytes: Bytes) {
        if bytes.is_empty() {
            return;
        }
        if let Some(more) = self.more.as_mut() {
            more.extend_from_slice(&bytes);
            return;
        }
        match self.one.take() {
            None => self.one = Some(bytes),
            Some(first) => {
                let mut more = BytesMut::with_capacity(first.len() + bytes.len());
                more.extend_from_slice(&first);
                more.extend_from_slice(&bytes);
                self.more = Some(more);
            }
        }
    }

    fn bytes(self) -> Option<Bytes> {
        self.more.map(BytesMut::freeze).or(self.one)
    }
}

impl UnaskedUsage {
    /// A stream at its start.
    pub fn new() -> Self {
        Self {
            held: BytesMut::new(),
            passing: false,
            line_empty: true,
            after_cr: false,
            ending: false,
        }
    }

    /// The next piece of the upstream's stream: what goes out now (`None`:
    /// nothing yet).
    pub fn edit(&mut self, data: Bytes) -> Option<Bytes> {
        let mut out = Out::default();
        let mut start = 0;
        let mut i = 0;
        while let Some(&b) = data.get(i) {
            if std::mem::take(&mut self.ending) {
                let end = if b == b'\n' { i + 1 } else { i };
                self.event_ended(data.slice(start..end), &mut out);
                start = end;
                if b == b'\n' {
                    i += 1;
                    continue;
                }
            }
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                i += 1;
                continue;
            }
            match b {
                b'\n' | b'\r' => {
                    if !self.line_empty {
                        self.after_cr = b == b'\r';
                    } else if b == b'\r' {
                        self.ending = true;
                    } else {
                        self.event_ended(data.slice(start..=i), &mut out);
                        start = i + 1;
                    }
                    self.line_empty = true;
                }
                _ => self.line_empty = false,
            }
            i += 1;
        }
        let rest = data.slice(start..);
        if self.passing {
            out.push(rest);
        } else {
            self.held.extend_from_slice(&rest);
            if self.held.len() > MAX_HELD {
                self.passing = true;
                out.push(self.held.split().freeze());
            }
        }
        out.bytes()
    }

    /// The stream ended: what is still held (an event it ended inside,
    /// which goes out as it came), if anything.
    pub fn held(&mut self) -> Option<Bytes> {
        let mut out = Out::default();
        if std::mem::take(&mut self.ending) {
            self.event_ended(Bytes::new(), &mut out);
        }
        out.push(self.held.split().freeze());
        out.bytes()
    }

    /// The current event ended with `last`, its bytes not held yet.
    fn event_ended(&mut self, last: Bytes, out: &mut Out) {
        if std::mem::take(&mut self.passing) {
            out.push(last);
            return;
        }
        if self.held.is_empty() {
            if !is_usage_event(&last) {
                out.push(last);
            }
            return;
        }
        self.held.extend_from_slice(&last);
        let event = self.held.split().freeze();
        if !is_usage_event(&event) {
            out.push(event);
        }
    }
}

/// What of an event's JSON data tells a usage event.
#[derive(Deserialize)]
struct Probe {
    choices: Option<Vec<IgnoredAny>>,
    usage: Option<IgnoredAny>,
}

/// Whether `event` (its lines and blank line) is a usage event: its data
/// is JSON whose `choices` is empty and whose `usage` is not null.
fn is_usage_event(event: &[u8]) -> bool {
    const USAGE: &[u8] = b"usage";
    if !event.windows(USAGE.len()).any(|w| w == USAGE) {
        return false;
    }
    let data = data_of(event);
    serde_json::from_slice::<Probe>(&data)
        .is_ok_and(|p| p.choices.is_some_and(|c| c.is_empty()) && p.usage.is_some())
}

/// An event's data: its `data` lines' values joined with line feeds.
fn data_of(event: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    let mut first = true;
    for line in event.split(|&b| b == b'\n' || b == b'\r') {
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => (&line[..colon], &line[colon + 1..]),
            None => (line, &[][..]),
        };
        if field != b"data" {
            continue;
        }
        if !std::mem::take(&mut first) {
            data.push(b'\n');
        }
        data.extend_from_slice(value.strip_prefix(b" ").unwrap_or(value));
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &str = "data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"total_tokens\":3}}";

    fn content(n: usize) -> String {
        format!(
            "data: {{\"id\":\"c\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{n}\"}}}}],\"usage\":null}}"
        )
    }

    /// A stream with line ends `eol`: the client's events and, between
    /// them and `[DONE]`, the usage event.
    fn stream(eol: &str) -> (String, String) {
        let mut wanted = String::from(": keep-alive");
        wanted.push_str(eol);
        wanted.push_str(eol);
        for n in 0..3 {
            wanted.push_str(&content(n));
            wanted.push_str(eol);
            wanted.push_str(eol);
        }
        let mut upstream = wanted.clone();
        upstream.push_str(USAGE);
        upstream.push_str(eol);
        upstream.push_str(eol);
        for text in [&mut wanted, &mut upstream] {
            text.push_str("data: [DONE]");
            text.push_str(eol);
            text.push_str(eol);
        }
        (upstream, wanted)
    }

    fn through(pieces: &[&[u8]]) -> Vec<u8> {
        let mut unasked = UnaskedUsage::new();
        let mut out = Vec::new();
        for piece in pieces {
            if let Some(b) = unasked.edit(Bytes::copy_from_slice(piece)) {
                out.extend_from_slice(&b);
            }
        }
        if let Some(b) = unasked.held() {
            out.extend_from_slice(&b);
        }
        out
    }

    #[test]
    fn only_the_usage_event_is_taken_out_however_the_stream_is_cut() {
        for eol in ["\n", "\r\n", "\r"] {
            let (upstream, wanted) = stream(eol);
            let bytes = upstream.as_bytes();
            assert_eq!(through(&[bytes]), wanted.as_bytes(), "{eol:?}");
            for cut in 0..=bytes.len() {
                let got = through(&[&bytes[..cut], &bytes[cut..]]);
                assert_eq!(got, wanted.as_bytes(), "{eol:?} cut at {cut}");
            }
            let one_by_one: Vec<&[u8]> = (0..bytes.len()).map(|i| &bytes[i..i + 1]).collect();
            assert_eq!(through(&one_by_one), wanted.as_bytes(), "{eol:?}");
        }
    }

    #[test]
    fn usage_beside_choices_or_an_unended_event_goes_out_as_it_came() {
        let beside = "data: {\"choices\":[{\"index\":0}],\"usage\":{\"total_tokens\":3}}\n\n";
        assert_eq!(through(&[beside.as_bytes()]), beside.as_bytes());
        let unended = format!("{USAGE}\n");
        assert_eq!(through(&[unended.as_bytes()]), unended.as_bytes());
        let null = "data: {\"choices\":[],\"usage\":null}\n\n";
        assert_eq!(through(&[null.as_bytes()]), null.as_bytes());
    }

    #[test]
    fn a_long_event_goes_out_as_it_comes_and_memory_stays_bounded() {
        let mut unasked = UnaskedUsage::new();
        let piece = Bytes::from(vec![b'x'; 16 * 1024]);
        let mut out = 0;
        for _ in 0..100 {
            out += unasked.edit(piece.clone()).map_or(0, |b| b.len());
            assert!(unasked.held.len() <= MAX_HELD + piece.len());
        }
        out += unasked.held().map_or(0, |b| b.len());
        assert_eq!(out, 100 * piece.len());
    }
}
