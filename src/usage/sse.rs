//! The numbers a `text/event-stream` answer reports: each event's `data`
//! lines are read as JSON as they stream past (no event is held), and the
//! last event whose data carries every wanted path is the report. Events
//! whose data is not JSON (`[DONE]`) carry nothing. An event the stream
//! ends inside, without its blank line, is not an event (as browsers read
//! event streams).

use std::sync::Arc;

use super::json::Scanner;
use super::settings::JsonPath;

/// Longest field name compared; a longer one is a field we ignore.
const MAX_FIELD: usize = 16;

/// Where the reader is in a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// Reading the field name.
    Field,
    /// In a `data` field's value; `first` before its first byte (one space
    /// after the colon is not part of the value).
    Data { first: bool },
    /// In a line that is not data.
    Skip,
}

/// Reads the events of an event stream fed in pieces.
#[derive(Debug)]
pub struct Events {
    scanner: Scanner,
    line: Line,
    field: Vec<u8>,
    /// The event being read has data.
    has_data: bool,
    /// The last byte was a carriage return (a following line feed is part
    /// of the same line end).
    after_cr: bool,
    /// The numbers of the last event that carried every path.
    last: Option<Vec<f64>>,
    /// The first bytes of the event's data, and how many it has: enough
    /// to tell `[DONE]`.
    head: Vec<u8>,
    data_len: usize,
    /// A `[DONE]` event followed the last report: the stream's report is
    /// final (OpenAI-style streams end with it).
    done: bool,
    /// A `[DONE]` event was seen, report or not: the stream said it is
    /// over.
    said_done: bool,
}

/// The data of the event that ends an OpenAI-style stream.
const DONE: &[u8] = b"[DONE]";

impl Events {
    /// A reader for the numbers at `paths`.
    pub fn new(paths: Arc<[JsonPath]>) -> Self {
        Self {
            scanner: Scanner::new(paths),
            line: Line::Field,
            field: Vec::new(),
            has_data: false,
            after_cr: false,
            last: None,
            head: Vec::with_capacity(DONE.len()),
            data_len: 0,
            done: false,
            said_done: false,
        }
    }

    /// Reads the next piece of the stream.
    pub fn feed(&mut self, bytes: &[u8]) {
        let mut rest = bytes;
        while let Some((&b, tail)) = rest.split_first() {
            if std::mem::take(&mut self.after_cr) && b == b'\n' {
                rest = tail;
                continue;
            }
            match self.line {
                Line::Data { first } => {
                    // The value runs to the line's end: hand it over whole.
                    let value = if first && b == b' ' { tail } else { rest };
                    let end = value
                        .iter()
                        .position(|&c| c == b'\n' || c == b'\r')
                        .unwrap_or(value.len());
                    self.scanner.feed(&value[..end]);
                    self.data_len += end;
                    let room = DONE.len().saturating_sub(self.head.len());
                    self.head.extend_from_slice(&value[..end.min(room)]);
                    self.line = Line::Data { first: false };
                    rest = &value[end..];
                    if let Some((&eol, tail)) = rest.split_first() {
                        self.line_ended(eol);
                        rest = tail;
                    }
                    continue;
                }
                Line::Field => match b {
                    b'\n' | b'\r' => self.line_ended(b),
                    b':' => {
                        self.line = if self.field == b"data" {
                            self.has_data = true;
                            Line::Data { first: true }
                        } else {
                            Line::Skip
                        };
                    }
                    _ if self.field.len() < MAX_FIELD => self.field.push(b),
                    _ => self.line = Line::Skip,
                },
                Line::Skip => {
                    if b == b'\n' || b == b'\r' {
                        self.line_ended(b);
                    }
                }
            }
            rest = tail;
        }
    }

    /// The numbers of the last event that carried every path, once the
    /// stream has ended.
    pub fn finish(&self) -> Option<&[f64]> {
        self.last.as_deref()
    }

    /// The report, when a `[DONE]` event followed it: the stream said it
    /// is over, so the report is final even if the stream is cut before
    /// its end (the OpenAI SDK closes the answer at `[DONE]`).
    pub fn final_report(&self) -> Option<&[f64]> {
        self.last.as_deref().filter(|_| self.done)
    }

    /// Whether the stream sent `[DONE]`: it said it is over, whatever it
    /// reported.
    pub fn said_done(&self) -> bool {
        self.said_done
    }

    fn line_ended(&mut self, eol: u8) {
        self.after_cr = eol == b'\r';
        match self.line {
            // A blank line ends the event.
            Line::Field if self.field.is_empty() => self.event_ended(),
            // `data` alone is a data line with an empty value.
            Line::Field if self.field == b"data" => {
                self.has_data = true;
                self.scanner.feed(b"\n");
            }
            // Data lines are joined with line feeds.
            Line::Data { .. } => self.scanner.feed(b"\n"),
            _ => {}
        }
        self.field.clear();
        self.line = Line::Field;
    }

    fn event_ended(&mut self) {
        if std::mem::take(&mut self.has_data) {
            let found = self.scanner.finish();
            if found.iter().all(Option::is_some) {
                self.last = Some(found.iter().flatten().copied().collect());
                self.done = false;
            } else if self.data_len == DONE.len() && self.head == DONE {
                self.done = self.last.is_some();
                self.said_done = true;
            }
        }
        self.head.clear();
        self.data_len = 0;
        self.scanner.reset();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "event: message\ndata: {\"delta\":\"Hel\"}\n\n: a comment\r\ndata: {\"delta\":\"lo\",\r\ndata:  \"usage\":{\"in\":7,\"out\":2}}\r\n\r\ndata: {\"usage\":{\"in\":7,\"out\":5}}\n\ndata: [DONE]\n\n";

    fn read(pieces: &[&[u8]]) -> Option<Vec<f64>> {
        let mut events = Events::new(crate::usage::json::tests::paths(&["usage.in", "usage.out"]));
        for p in pieces {
            events.feed(p);
        }
        events.finish().map(<[f64]>::to_vec)
    }

    #[test]
    fn the_last_event_carrying_every_path_is_the_report_however_the_stream_is_cut() {
        let bytes = STREAM.as_bytes();
        let want = Some(vec![7.0, 5.0]);
        assert_eq!(read(&[bytes]), want);
        for cut in 0..bytes.len() {
            assert_eq!(read(&[&bytes[..cut], &bytes[cut..]]), want, "cut at {cut}");
        }
        let one_by_one: Vec<&[u8]> = (0..bytes.len()).map(|i| &bytes[i..i + 1]).collect();
        assert_eq!(read(&one_by_one), want);
    }

    #[test]
    fn an_event_without_every_path_or_without_its_end_reports_nothing() {
        assert_eq!(read(&[b"data: {\"usage\":{\"in\":7}}\n\n"]), None);
        assert_eq!(read(&[b"data: {\"usage\":{\"in\":7,\"out\":1}}\n"]), None);
        // Data split over lines joins with a line feed, which JSON allows.
        assert_eq!(
            read(&[b"data: {\"usage\":\ndata: {\"in\":1,\"out\":2}}\n\n"]),
            Some(vec![1.0, 2.0])
        );
        // A field that only looks like data is not data.
        assert_eq!(
            read(&[b"datum: {\"usage\":{\"in\":1,\"out\":2}}\n\n"]),
            None
        );
    }

    #[test]
    fn a_report_followed_by_done_is_final_before_the_stream_ends() {
        let paths = || crate::usage::json::tests::paths(&["usage.in", "usage.out"]);
        let mut events = Events::new(paths());
        events.feed(b"data: {\"usage\":{\"in\":7,\"out\":5}}\n\n");
        assert_eq!(events.final_report(), None, "no [DONE] yet");
        events.feed(b"data: [DO");
        assert_eq!(events.final_report(), None, "[DONE] not ended");
        events.feed(b"NE]\r\n\r\n");
        assert_eq!(events.final_report(), Some(&[7.0, 5.0][..]));
        // A later report is not final until another [DONE].
        events.feed(b"data: {\"usage\":{\"in\":8,\"out\":5}}\n\n");
        assert_eq!(events.final_report(), None);
        // [DONE] before any report finalises nothing; neither does
        // "[DONE]" inside longer data.
        let mut early = Events::new(paths());
        early.feed(b"data: [DONE]\n\ndata: {\"usage\":{\"in\":1,\"out\":1}}\n\n");
        assert_eq!(early.final_report(), None);
        let mut longer = Events::new(paths());
        longer.feed(b"data: {\"usage\":{\"in\":1,\"out\":1}}\n\ndata: [DONE]!\n\n");
        assert_eq!(longer.final_report(), None);
    }
}
