//! `[routes.usage]`, as the configuration describes it: plain data that
//! `config` fills in.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;

/// Most bytes of a request body read before the decision, for a
/// reservation named in it; a larger body reserves `max_reserve`.
pub const READ_FIRST: u64 = 64 * 1024;

/// Where an answer reports the units it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Response header fields, read before the head goes out.
    Header,
    /// Trailer fields (HTTP/2, gRPC), read when the body ends.
    Trailer,
    /// Numbers at paths of a JSON response body, read as it streams past.
    Json,
    /// Numbers at paths of the JSON in a `text/event-stream` answer's
    /// events: the last event that carries every field.
    Sse,
    /// `Sse` for an answer whose `Content-Type` is `text/event-stream`,
    /// else `Json`: one route for an API's streamed and whole answers.
    JsonOrSse,
}

/// Every `report` of `[routes.usage]` by name.
pub const SOURCES: [(&str, Source); 5] = [
    ("header", Source::Header),
    ("trailer", Source::Trailer),
    ("json", Source::Json),
    ("sse", Source::Sse),
    ("json_or_sse", Source::JsonOrSse),
];

/// A place in JSON, parsed once at load: keys separated by dots
/// (`usage.output_tokens`); a segment of digits also names an array index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonPath(Box<[Segment]>);

/// One segment of a [`JsonPath`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    key: Box<[u8]>,
    index: Option<u64>,
}

impl JsonPath {
    /// The path `text` names, or `None` when a segment is empty.
    pub fn parse(text: &str) -> Option<Self> {
        text.split('.')
            .map(|s| {
                (!s.is_empty()).then(|| Segment {
                    key: s.as_bytes().into(),
                    index: s.parse().ok(),
                })
            })
            .collect::<Option<Box<[Segment]>>>()
            .map(Self)
    }

    /// Its segments, outermost first.
    pub fn segments(&self) -> &[Segment] {
        &self.0
    }
}

impl Segment {
    /// Whether an object's value under `key` is at this segment.
    pub fn is_key(&self, key: &[u8]) -> bool {
        *self.key == *key
    }

    /// Whether an array's value at `index` is at this segment.
    pub fn is_index(&self, index: u64) -> bool {
        self.index == Some(index)
    }
}

/// Where the reported fields are read, parsed at load: one per weight.
#[derive(Debug, Clone, PartialEq)]
pub enum Fields {
    /// Header or trailer names (`header`, `trailer`).
    Headers(Box<[HeaderName]>),
    /// JSON paths (`json`, `sse`).
    Json(Arc<[JsonPath]>),
}

/// A route whose cost is what its upstream reports: reserved before
/// forwarding, settled when the answer says.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Units reserved when the request names none.
    pub reserve: u64,
    /// A request header naming the units it may use at most.
    pub reserve_header: Option<HeaderName>,
    /// A JSON path in the request body naming the units it may use at most
    /// (`max_tokens`), or several tried in order (the first the body
    /// names counts); the body's first [`READ_FIRST`] bytes are read
    /// before the decision.
    pub reserve_json: Option<Arc<[JsonPath]>>,
    /// What the request names counts this many units each (the weight of
    /// the reported field it bounds).
    pub reserve_weight: f64,
    /// Units added to what the request names (the part it cannot name,
    /// such as input units).
    pub reserve_add: u64,
    /// Units added for each KiB of the request body (or its part: a
    /// prompt's tokens grow with its size); 0: none.
    pub reserve_per_kib: u64,
    /// Most units one request may reserve; what the request names is cut
    /// to it.
    pub max_reserve: u64,
    /// Where the answer reports its units.
    pub source: Source,
    /// Where the reported fields are read.
    pub fields: Fields,
    /// Each field's number counts this many units; the units are their
    /// sum, rounded up.
    pub weights: Box<[f64]>,
    /// A streaming request's JSON body gets `stream_options.include_usage`
    /// set, so that an OpenAI-compatible upstream reports a stream's usage
    /// (read before the decision, as for `reserve_json`).
    pub stream_include_usage: bool,
    /// Answers of these statuses that report nothing are settled to this
    /// charge instead of standing at their reservation (providers do not
    /// bill a failed request).
    pub failed: Option<FailedAnswers>,
    /// What becomes of an answer whose client leaves before its report.
    pub abandoned: Abandoned,
}

/// What becomes of an answer whose body reports its usage when its client
/// leaves before the report (`abandoned`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Abandoned {
    /// Closed at once: the reservation stands as the charge.
    Close,
    /// Read on without the client, within the bounds, and settled to what
    /// it reports; at the bounds, closed and charged the reservation.
    Drain(Drain),
}

/// The bounds of reading an abandoned answer on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drain {
    /// Longest an answer is read after its client left (`drain_time`).
    pub time: Duration,
    /// Most bytes of it read after its client left (`drain_bytes`).
    pub bytes: u64,
    /// Most answers of the route read on at once, per instance
    /// (`max_draining`); past it, an abandoned answer is closed at once.
    pub at_once: usize,
}

impl Drain {
    /// `drain_time`'s default.
    pub const TIME: Duration = Duration::from_secs(30);
    /// `drain_bytes`' default: 1 MiB.
    pub const BYTES: u64 = 1 << 20;
    /// `max_draining`'s default.
    pub const AT_ONCE: usize = 128;
}

impl Settings {
    /// The least one request with a body reserves (see
    /// [`super::reservation`]): naming nothing, `reserve`; naming 0 units
    /// (a header or `reserve_json`), `reserve_add`; plus `reserve_per_kib`
    /// for its first KiB; at most `max_reserve`. A route's clients with
    /// less remaining than this are refused whatever they ask.
    pub fn least_reservation(&self) -> u64 {
        let named = self.reserve_header.is_some() || self.reserve_json.is_some();
        let base = if named {
            self.reserve.min(self.reserve_add)
        } else {
            self.reserve
        };
        base.saturating_add(self.reserve_per_kib)
            .min(self.max_reserve)
    }
}

/// `failed = { statuses = [400, 429, 500], charge = 0 }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedAnswers {
    /// The statuses.
    pub statuses: Box<[u16]>,
    /// What such an answer is charged.
    pub charge: u64,
}
