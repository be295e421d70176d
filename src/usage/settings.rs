//! `[routes.usage]`, as the configuration describes it: plain data that
//! `config` fills in.

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
}

/// Every `report` of `[routes.usage]` by name.
pub const SOURCES: [(&str, Source); 4] = [
    ("header", Source::Header),
    ("trailer", Source::Trailer),
    ("json", Source::Json),
    ("sse", Source::Sse),
];

/// One reported field and its weight.
#[derive(Debug, Clone, PartialEq)]
pub struct Field {
    /// A header or trailer name, or a JSON path (`usage.output_tokens`;
    /// a segment of digits also indexes an array).
    pub name: String,
    /// The field's number counts this many units each.
    pub weight: f64,
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
    /// (`max_tokens`); the body's first [`READ_FIRST`] bytes are read
    /// before the decision.
    pub reserve_json: Option<String>,
    /// What the request names counts this many units each (the weight of
    /// the reported field it bounds).
    pub reserve_weight: f64,
    /// Units added to what the request names (the part it cannot name,
    /// such as input units).
    pub reserve_add: u64,
    /// Most units one request may reserve; what the request names is cut
    /// to it.
    pub max_reserve: u64,
    /// Where the answer reports its units.
    pub source: Source,
    /// The reported fields, summed with their weights (rounded up).
    pub fields: Vec<Field>,
}
