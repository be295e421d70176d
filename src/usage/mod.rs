//! How many units a request used, on a route whose cost is what its
//! upstream reports: what the request may reserve before it is forwarded
//! ([`reservation`]), and what the answer reports, read from its header
//! fields ([`from_headers`]), or as its body streams past ([`Meter`]:
//! trailers, a JSON body, an event stream's last event). gate charges the
//! reservation with the decision and settles it to the report.

mod abandonment;
pub mod json;
pub mod settings;
pub mod sse;
pub mod unasked;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

use bytes::Bytes;
use http::HeaderMap;
use hyper::body::Frame;

pub use abandonment::Abandonment;
use json::Scanner;
use settings::{Fields, Settings, Source};
use sse::Events;

/// Largest number of units a report may carry; larger is malformed.
pub const MAX_UNITS: u64 = 1 << 53;

/// Why a request's reservation stands as its charge: nothing was reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unreported {
    /// The answer did not carry every field, or not as a number.
    Missing,
    /// The upstream failed: no answer, or its body broke off.
    UpstreamFailed,
    /// The client went away (or failed its own request: a body too slow or
    /// too large) before the answer's end.
    ClientLeft,
    /// The report was read but the store could not take the settlement.
    StoreFailed,
    /// The answer's status is one of `failed.statuses` and it reported
    /// nothing: settled to `failed.charge`, not left at its reservation.
    FailedAnswer,
}

impl Unreported {
    /// Every reason, in declaration order.
    pub const ALL: [Unreported; 5] = [
        Self::Missing,
        Self::UpstreamFailed,
        Self::ClientLeft,
        Self::StoreFailed,
        Self::FailedAnswer,
    ];

    /// What happened, in words, for the log line.
    pub fn explained(self) -> &'static str {
        match self {
            Self::Missing => "the answer did not report every usage field as a number",
            Self::UpstreamFailed => "the upstream's answer failed or broke off before its report",
            Self::ClientLeft => "the client left before the answer reported its usage",
            Self::StoreFailed => "the store could not take the settlement",
            Self::FailedAnswer => {
                "a failed answer reported no usage and was settled to the route's failed charge"
            }
        }
    }

    /// The reason as metrics and logs name it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::UpstreamFailed => "upstream_failed",
            Self::ClientLeft => "client_left",
            Self::StoreFailed => "store_failed",
            Self::FailedAnswer => "failed_answer",
        }
    }
}

/// What a request body read before the decision says of its reservation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BodyRead {
    /// The number at the `reserve_json` path, if there was one.
    pub named: Option<f64>,
    /// The body was read whole (a larger one was not: what it names past
    /// the bytes read, the upstream may act on).
    pub whole: bool,
    /// Bytes read.
    pub len: u64,
    /// floodgate asked the upstream to report the stream's usage
    /// (`stream_include_usage`); the client did not.
    pub usage_unasked: bool,
}

/// The number at the first of `settings`' `reserve_json` paths that the
/// body `read` so far names (`max_completion_tokens`, else `max_tokens`);
/// at a path given twice, the last (as most JSON readers take a key given
/// twice).
pub fn named_in_json<'a>(
    settings: &Settings,
    read: impl Iterator<Item = &'a Bytes>,
) -> Option<f64> {
    let mut scanner = Scanner::new(Arc::clone(settings.reserve_json.as_ref()?));
    for bytes in read {
        scanner.feed(bytes);
    }
    scanner.finish().iter().copied().flatten().next()
}

/// A streaming request's JSON `body` (`"stream": true` at its top) with
/// `stream_options.include_usage` set, when it is not already: `None` when
/// nothing is to change (not JSON, not an object, not streaming, already
/// asking). Without `stream_options`, the member is added at the start of
/// the object, and everything else is sent byte for byte; with other
/// `stream_options`, the object is written again.
pub fn asking_for_usage(body: &[u8]) -> Option<Bytes> {
    let parsed: serde_json::Value = serde_json::from_slice(body).ok()?;
    let object = parsed.as_object()?;
    if object.get("stream").and_then(serde_json::Value::as_bool) != Some(true) {
        return None;
    }
    match object.get("stream_options") {
        None => {
            let open = body.iter().position(|&b| b == b'{')?;
            let mut out = Vec::with_capacity(body.len() + 40);
            out.extend_from_slice(&body[..=open]);
            out.extend_from_slice(br#""stream_options":{"include_usage":true},"#);
            out.extend_from_slice(&body[open + 1..]);
            Some(Bytes::from(out))
        }
        Some(options) => {
            if options
                .get("include_usage")
                .and_then(serde_json::Value::as_bool)
                == Some(true)
            {
                return None;
            }
            let mut parsed = parsed;
            let options = parsed.get_mut("stream_options")?;
            match options.as_object_mut() {
                Some(map) => {
                    map.insert("include_usage".to_owned(), serde_json::Value::Bool(true));
                }
                None => *options = serde_json::json!({ "include_usage": true }),
            }
            serde_json::to_vec(&parsed).ok().map(Bytes::from)
        }
    }
}

/// What the request reserves: the number its `reserve_header` names, else
/// the number at its body's `reserve_json` path (times `reserve_weight`,
/// plus `reserve_add`, either way), else `reserve`; plus
/// `reserve_per_kib` for each KiB of its body (a prompt's tokens grow
/// with it); at most `max_reserve`. A body too large to read first reserves `max_reserve`.
/// A header that is not a whole number is the client's error.
pub fn reservation(
    settings: &Settings,
    headers: &HeaderMap,
    body: Option<BodyRead>,
) -> Result<u64, String> {
    let header = settings
        .reserve_header
        .as_ref()
        .and_then(|name| headers.get(name).map(|value| (name, value)));
    let named = match (header, body) {
        (Some((name, value)), _) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| format!("the {name} header must be a whole number of units"))?
                as f64,
        ),
        (None, Some(BodyRead { whole: false, .. })) => return Ok(settings.max_reserve),
        (None, Some(BodyRead { named, .. })) => named.filter(|n| n.is_finite() && *n >= 0.0),
        (None, None) => None,
    };
    let base = match named {
        Some(n) => ((n * settings.reserve_weight).ceil().min(MAX_UNITS as f64) as u64)
            .saturating_add(settings.reserve_add),
        None => settings.reserve,
    };
    if settings.reserve_per_kib == 0 {
        return Ok(base.min(settings.max_reserve));
    }
    // The body's size: its declared length (the codec holds the body to
    // it), else what was read of a body read whole; unknown, the most.
    let size = headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
        .or(body.filter(|b| b.whole).map(|b| b.len));
    Ok(match size {
        Some(size) => base
            .saturating_add(settings.reserve_per_kib.saturating_mul(size.div_ceil(1024)))
            .min(settings.max_reserve),
        None => settings.max_reserve,
    })
}

/// The units `values` report, one per field in order: each times its
/// weight, summed and rounded up; `None` if any is missing, negative or
/// past [`MAX_UNITS`].
pub fn units(settings: &Settings, values: impl IntoIterator<Item = Option<f64>>) -> Option<u64> {
    let mut sum = 0f64;
    let mut count = 0;
    for (weight, value) in settings.weights.iter().zip(values) {
        let value = value.filter(|v| v.is_finite() && *v >= 0.0)?;
        sum += value * weight;
        count += 1;
    }
    let units = sum.ceil();
    (count == settings.weights.len() && units <= MAX_UNITS as f64).then_some(units as u64)
}

/// The units reported in `headers` (response headers or trailers); `None`
/// when the fields are not header fields.
pub fn from_headers(settings: &Settings, headers: &HeaderMap) -> Option<u64> {
    let Fields::Headers(names) = &settings.fields else {
        return None;
    };
    units(
        settings,
        names.iter().map(|name| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.trim().parse::<f64>().ok())
        }),
    )
}

/// One request's units as the access log shows them: what it reserved and,
/// once known, what its answer reported.
#[derive(Debug)]
pub struct Tally {
    reserved: u64,
    /// Reported units plus one; 0 while none are.
    reported: AtomicU64,
    /// What became of the answer when its client left before its report:
    /// an [`Abandonment`]'s position plus one; 0 when it did not.
    abandoned: AtomicU8,
}

impl Tally {
    /// A tally of `reserved` units, nothing reported yet.
    pub fn new(reserved: u64) -> Self {
        Self {
            reserved,
            reported: AtomicU64::new(0),
            abandoned: AtomicU8::new(0),
        }
    }

    /// What became of the answer, if its client left before its report.
    pub fn abandoned(&self) -> Option<Abandonment> {
        let at = self.abandoned.load(Ordering::Relaxed);
        Abandonment::ALL
            .get(usize::from(at).checked_sub(1)?)
            .copied()
    }

    /// Records what became of an answer its client left.
    pub fn abandon(&self, outcome: Abandonment) {
        self.abandoned.store(outcome as u8 + 1, Ordering::Relaxed);
    }

    /// Units reserved.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Units reported, if they were.
    pub fn reported(&self) -> Option<u64> {
        self.reported.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Records the units reported.
    pub fn report(&self, units: u64) {
        self.reported.store(units + 1, Ordering::Relaxed);
    }
}

/// What is done with a report: called once, with the units or why there
/// are none.
pub type OnReport = Box<dyn FnOnce(Result<u64, Unreported>) + Send + Sync>;

/// Reads one metered answer for the units it reports, as the body goes
/// out: its hook on the answer's body (gate's `AnswerEnd`) shows it every
/// frame, then the end. Its report goes to `done`
/// once: the units when the body ended with them; why not when it ended
/// without them, broke off, or was dropped before its end.
pub struct Meter {
    settings: Arc<Settings>,
    reading: Reading,
    tally: Arc<Tally>,
    done: Option<OnReport>,
}

enum Reading {
    Trailer,
    Json(Scanner),
    Sse(Events),
}

impl Meter {
    /// A meter for the units `settings` says the body reports (trailers, a
    /// JSON body or an event stream; with `json_or_sse`, an event stream
    /// when `event_stream`, the answer's `Content-Type` says so); they also
    /// go into `tally`.
    pub fn new(
        settings: Arc<Settings>,
        tally: Arc<Tally>,
        done: OnReport,
        event_stream: bool,
    ) -> Self {
        let reading = match (&settings.fields, settings.source) {
            (Fields::Json(paths), Source::Sse) => Reading::Sse(Events::new(Arc::clone(paths))),
            (Fields::Json(paths), Source::JsonOrSse) if event_stream => {
                Reading::Sse(Events::new(Arc::clone(paths)))
            }
            (Fields::Json(paths), _) => Reading::Json(Scanner::new(Arc::clone(paths))),
            (Fields::Headers(_), _) => Reading::Trailer,
        };
        Self {
            reading,
            settings,
            tally,
            done: Some(done),
        }
    }

    /// A frame of the body went out.
    pub fn frame(&mut self, frame: &Frame<Bytes>) {
        match (&mut self.reading, frame.data_ref(), frame.trailers_ref()) {
            (Reading::Json(scanner), Some(data), _) => scanner.feed(data),
            (Reading::Sse(events), Some(data), _) => events.feed(data),
            (Reading::Trailer, _, Some(trailers)) => {
                if let Some(units) = from_headers(&self.settings, trailers) {
                    self.finish(Ok(units));
                }
            }
            _ => {}
        }
    }

    /// The body ended whole: what it reported.
    pub fn ended(&mut self) {
        let units = match &mut self.reading {
            Reading::Json(scanner) => units(&self.settings, scanner.finish().iter().copied()),
            Reading::Sse(events) => events
                .finish()
                .and_then(|found| units(&self.settings, found.iter().map(|&v| Some(v)))),
            Reading::Trailer => None,
        };
        self.finish(units.ok_or(Unreported::Missing));
    }

    /// Whether the answer's report is still to come: dropped now, the
    /// meter would settle nothing (`client_left`). An event stream that
    /// said `[DONE]` has said all it will.
    pub fn awaits_report(&self) -> bool {
        self.done.is_some()
            && match &self.reading {
                Reading::Sse(events) => events.final_report().is_none() && !events.said_done(),
                _ => true,
            }
    }

    /// The upstream's body broke off.
    pub fn broke(&mut self) {
        self.finish(Err(Unreported::UpstreamFailed));
    }

    fn finish(&mut self, report: Result<u64, Unreported>) {
        if let Some(done) = self.done.take() {
            if let Ok(units) = report {
                self.tally.report(units);
            }
            done(report);
        }
    }
}

impl Meter {
    /// The answer is read no further before its end: the client left (or
    /// the answer was read on after it left, to its final report or to a
    /// bound). A stream whose report went out followed by `[DONE]` owes
    /// its settlement whatever the client does next (the OpenAI SDK
    /// closes the answer at `[DONE]`, often before the stream's own end);
    /// only a client that leaves before that is `client_left`, charged its
    /// reservation. A stream that said `[DONE]` without a report is
    /// `missing`, as if it had ended there.
    pub fn stopped(&mut self) {
        let report = match &self.reading {
            Reading::Sse(events) => match events.final_report() {
                Some(found) => {
                    units(&self.settings, found.iter().map(|&v| Some(v))).ok_or(Unreported::Missing)
                }
                None if events.said_done() => Err(Unreported::Missing),
                None => Err(Unreported::ClientLeft),
            },
            _ => Err(Unreported::ClientLeft),
        };
        self.finish(report);
    }
}

impl Drop for Meter {
    /// The answer was dropped before its end: see [`Meter::stopped`].
    fn drop(&mut self) {
        self.stopped();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use json::tests::paths;

    /// Header fields `names`, weighing `weights`.
    fn settings(names: &[&'static str], weights: &[f64]) -> Settings {
        Settings {
            reserve: 100,
            reserve_header: Some(http::HeaderName::from_static("x-max-units")),
            reserve_json: Some(paths(&["max_tokens"])),
            reserve_weight: 1.0,
            reserve_add: 10,
            max_reserve: 500,
            source: Source::Header,
            fields: Fields::Headers(
                names
                    .iter()
                    .map(|n| http::HeaderName::from_static(n))
                    .collect(),
            ),
            weights: weights.into(),
            failed: None,
            reserve_per_kib: 0,
            stream_include_usage: false,
            abandoned: settings::Abandoned::Close,
        }
    }

    #[test]
    fn a_reservation_is_what_the_request_names_plus_the_addition_within_the_cap() {
        let s = settings(&["x-used"], &[1.0]);
        let mut headers = HeaderMap::new();
        assert_eq!(reservation(&s, &headers, None), Ok(100));
        let body = |text: &str, whole| BodyRead {
            len: text.len() as u64,
            named: named_in_json(&s, std::iter::once(&Bytes::from(text.to_owned()))),
            whole,
            usage_unasked: false,
        };
        let asked = r#"{"model":"m","max_tokens":40,"n":{"max_tokens":900}}"#;
        assert_eq!(reservation(&s, &headers, Some(body(asked, true))), Ok(50));
        // A body too large to read whole could name more past what was read.
        assert_eq!(reservation(&s, &headers, Some(body(asked, false))), Ok(500));
        // A body naming nothing, or not as a number, reserves the default.
        let unnamed = r#"{"model":"m","max_tokens":"40"}"#;
        assert_eq!(
            reservation(&s, &headers, Some(body(unnamed, true))),
            Ok(100)
        );
        // Named twice: the last, as the upstream's reader takes it.
        let twice = r#"{"max_tokens":1,"max_tokens":300}"#;
        assert_eq!(reservation(&s, &headers, Some(body(twice, true))), Ok(310));
        headers.insert("x-max-units", "40".parse().expect("value"));
        assert_eq!(reservation(&s, &headers, None), Ok(50));
        headers.insert("x-max-units", "4000".parse().expect("value"));
        assert_eq!(reservation(&s, &headers, None), Ok(500));
        headers.insert("x-max-units", "-1".parse().expect("value"));
        assert!(reservation(&s, &headers, None).is_err());
        // Named units weighed as the field they bound.
        let s = Settings {
            reserve_weight: 2.5,
            ..s
        };
        headers.insert("x-max-units", "7".parse().expect("value"));
        assert_eq!(reservation(&s, &headers, None), Ok(28));
    }

    #[test]
    fn a_streaming_request_is_asked_to_report_its_usage() {
        let asked = |text: &str| {
            asking_for_usage(text.as_bytes()).map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        assert_eq!(
            asked(r#" {"model":"m","stream":true,"max_tokens":1.50e2}"#).as_deref(),
            Some(
                r#" {"stream_options":{"include_usage":true},"model":"m","stream":true,"max_tokens":1.50e2}"#
            )
        );
        let merged = asked(r#"{"stream":true,"stream_options":{"other":1}}"#).unwrap_or_default();
        let merged: serde_json::Value = serde_json::from_str(&merged).unwrap_or_default();
        assert_eq!(
            merged["stream_options"],
            serde_json::json!({"other": 1, "include_usage": true})
        );
        for unchanged in [
            r#"{"stream":false}"#,
            r#"{"model":"m"}"#,
            r#"{"stream":true,"stream_options":{"include_usage":true}}"#,
            r#"[{"stream":true}]"#,
            r#"{"stream":true"#,
        ] {
            assert_eq!(asked(unchanged), None, "{unchanged}");
        }
    }

    #[test]
    fn a_reservation_grows_with_the_size_of_the_body() {
        let s = Settings {
            reserve_per_kib: 250,
            ..settings(&["x-used"], &[1.0])
        };
        let mut headers = HeaderMap::new();
        // Unknown size (no length, not read whole): the most.
        assert_eq!(reservation(&s, &headers, None), Ok(500));
        headers.insert("content-length", "100".parse().expect("value"));
        assert_eq!(reservation(&s, &headers, None), Ok(100 + 250));
        headers.insert("content-length", "1025".parse().expect("value"));
        assert_eq!(reservation(&s, &headers, None), Ok(500), "capped");
        // A body read whole, without a declared length: its bytes.
        headers.remove("content-length");
        let read = BodyRead {
            named: Some(20.0),
            whole: true,
            len: 10,
            usage_unasked: false,
        };
        assert_eq!(reservation(&s, &headers, Some(read)), Ok(20 + 10 + 250));
    }

    #[test]
    fn the_least_reservation_is_what_the_smallest_request_with_a_body_reserves() {
        let s = Settings {
            reserve_per_kib: 250,
            ..settings(&["x-used"], &[1.0])
        };
        let mut headers = HeaderMap::new();
        headers.insert("content-length", "1".parse().expect("value"));
        // Naming nothing reserves `reserve`; naming 0 only what it adds.
        assert_eq!(reservation(&s, &headers, None), Ok(100 + 250));
        headers.insert("x-max-units", "0".parse().expect("value"));
        let least = reservation(&s, &headers, None).expect("a reservation");
        assert_eq!(least, 10 + 250);
        assert_eq!(s.least_reservation(), least);
    }

    #[test]
    fn the_first_of_several_reserve_paths_the_body_names_counts() {
        let s = Settings {
            reserve_json: Some(paths(&["max_completion_tokens", "max_tokens"])),
            ..settings(&["x-used"], &[1.0])
        };
        let named = |text: &str| named_in_json(&s, std::iter::once(&Bytes::from(text.to_owned())));
        assert_eq!(
            named(r#"{"max_tokens":70,"max_completion_tokens":40}"#),
            Some(40.0)
        );
        assert_eq!(named(r#"{"max_tokens":70}"#), Some(70.0));
        assert_eq!(named(r#"{"max_completion_tokens":40}"#), Some(40.0));
        assert_eq!(named(r#"{"n":1}"#), None);
    }

    #[test]
    fn units_are_every_field_weighted_summed_and_rounded_up() {
        let s = settings(&["x-in", "x-out"], &[1.0, 3.0]);
        let mut headers = HeaderMap::new();
        headers.insert("x-in", "10".parse().expect("value"));
        assert_eq!(from_headers(&s, &headers), None);
        headers.insert("x-out", "2.1".parse().expect("value"));
        assert_eq!(from_headers(&s, &headers), Some(17));
        headers.insert("x-out", "-2".parse().expect("value"));
        assert_eq!(from_headers(&s, &headers), None);
        headers.insert("x-out", "1e300".parse().expect("value"));
        assert_eq!(from_headers(&s, &headers), None);
    }
}
