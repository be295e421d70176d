//! One request's line: what is known of the request, and the line written
//! from it in JSON or text.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use http::{Method, Version};

use super::{AccessLog, Format, MAX_PATH};
use crate::client::ClientId;
use crate::metrics::Outcome;

/// What is known of a request by the time its answer starts; the rest
/// (bytes sent, the end) is added as the body goes out.
#[derive(Debug)]
pub struct Record {
    started: Instant,
    time: SystemTime,
    method: Method,
    path: String,
    version: Version,
    peer: SocketAddr,
    bytes_in: Option<u64>,
    route: Option<Arc<str>>,
    pub(super) outcome: Option<Outcome>,
    limit: Option<String>,
    remaining: Option<u64>,
    /// When the store decided (ms since the Unix epoch, its clock).
    decided_at_ms: Option<u64>,
    pub(super) client: Option<ClientId>,
    upstream: Option<Box<str>>,
    upstream_ms: Option<f64>,
    /// How long a limit's delay held the request before it went.
    held_ms: Option<u64>,
    /// What verifying its API key found, and the key's id when valid.
    key: Option<(&'static str, Option<Box<str>>)>,
    status: u16,
    pub(super) bytes_out: u64,
    /// The units reserved and reported, on a metered route.
    units: Option<Arc<crate::usage::Tally>>,
}

impl Record {
    /// A request from `peer` for `uri`, with a body of `bytes_in` bytes if
    /// declared.
    pub fn begin(
        method: &Method,
        uri: &http::Uri,
        version: Version,
        peer: SocketAddr,
        bytes_in: Option<u64>,
    ) -> Self {
        let full = uri
            .path_and_query()
            .map_or_else(|| uri.path(), |pq| pq.as_str());
        let path = if full.len() > MAX_PATH {
            let mut cut = MAX_PATH;
            while !full.is_char_boundary(cut) {
                cut -= 1;
            }
            format!("{}…", &full[..cut])
        } else {
            full.to_owned()
        };
        Self {
            started: Instant::now(),
            time: SystemTime::now(),
            method: method.clone(),
            path,
            version,
            peer,
            bytes_in,
            route: None,
            outcome: None,
            limit: None,
            remaining: None,
            decided_at_ms: None,
            client: None,
            upstream: None,
            upstream_ms: None,
            held_ms: None,
            key: None,
            status: 0,
            bytes_out: 0,
            units: None,
        }
    }

    /// The request's units, on a route metered by its upstream's reports:
    /// the line shows what it reserved and what its answer reported.
    pub fn units(&mut self, tally: &Arc<crate::usage::Tally>) {
        self.units = Some(Arc::clone(tally));
    }

    /// The route that matched.
    pub fn route(&mut self, name: &Arc<str>) {
        self.route = Some(Arc::clone(name));
    }

    /// What the limits decided, for `client`; the limit that decided (its
    /// policy name) and the units it has left, when there was a decision.
    pub fn decided(
        &mut self,
        outcome: Outcome,
        client: Option<&ClientId>,
        limit: Option<(&str, u64)>,
    ) {
        self.outcome = Some(outcome);
        self.client = client.cloned();
        if let Some((name, remaining)) = limit {
            self.limit = Some(name.to_owned());
            self.remaining = Some(remaining);
        }
    }

    /// When the store decided, by its clock (ms since the Unix epoch):
    /// with `held_ms`, the instant the request fits, comparable across
    /// instances and with the store's own record.
    pub fn decided_at(&mut self, at_ms: u64) {
        self.decided_at_ms = Some(at_ms);
    }

    /// The upstream endpoint that answered, and how long its head took.
    pub fn upstream(&mut self, endpoint: &str, took: std::time::Duration) {
        self.upstream = Some(endpoint.into());
        self.upstream_ms = Some(took.as_secs_f64() * 1000.0);
    }

    /// The request was held `ms` until its limits fit (a limit's
    /// `delay`) before it went on.
    pub fn held(&mut self, ms: u64) {
        self.held_ms = Some(ms);
    }

    /// What verifying the request's API key found (`valid`, `missing`,
    /// `unknown`, …), and the key's public id when it is valid.
    pub fn key(&mut self, outcome: &'static str, id: Option<&str>) {
        self.key = Some((outcome, id.map(Into::into)));
    }

    /// The answer's status.
    pub fn status(&mut self, status: u16) {
        self.status = status;
    }

    pub(super) fn line(&self, log: &AccessLog, complete: bool) -> String {
        let shown = Shown {
            took_ms: self.started.elapsed().as_secs_f64() * 1000.0,
            time: rfc3339(self.time),
            decision: self.outcome.map_or("-", Outcome::name),
            client: self.client.as_ref().and_then(|c| log.ids.show(c)),
            version: match self.version {
                Version::HTTP_10 => "HTTP/1.0",
                Version::HTTP_2 => "HTTP/2",
                _ => "HTTP/1.1",
            },
            complete,
        };
        let mut out = String::with_capacity(256);
        match log.settings.format {
            Format::Json => self.json_line(&mut out, &shown),
            Format::Text => self.text_line(&mut out, &shown),
        }
        out
    }

    /// The line as one JSON object.
    fn json_line(&self, out: &mut String, shown: &Shown) {
        let Shown {
            took_ms,
            time,
            decision,
            client,
            version,
            complete,
        } = shown;
        out.push('{');
        field(out, "time", time, true);
        field(out, "peer", &self.peer.to_string(), false);
        field(out, "method", self.method.as_str(), false);
        field(out, "path", &self.path, false);
        field(out, "protocol", version, false);
        number(out, "status", self.status);
        field(out, "route", self.route.as_deref().unwrap_or(""), false);
        field(out, "decision", decision, false);
        if let Some(limit) = &self.limit {
            field(out, "limit", limit, false);
        }
        if let Some(remaining) = self.remaining {
            number(out, "remaining", remaining);
        }
        if let Some(at) = self.decided_at_ms {
            number(out, "decided_at_ms", at);
        }
        if let Some(client) = client {
            field(out, "client", client, false);
        }
        if let Some(ms) = self.held_ms {
            number(out, "held_ms", ms);
        }
        if let Some((outcome, id)) = &self.key {
            field(out, "key", outcome, false);
            if let Some(id) = id {
                field(out, "key_id", id, false);
            }
        }
        if let Some(upstream) = &self.upstream {
            field(out, "upstream", upstream, false);
        }
        if let Some(ms) = self.upstream_ms {
            let _ = write!(out, ",\"upstream_ms\":{ms:.3}");
        }
        if let Some(bytes) = self.bytes_in {
            number(out, "bytes_in", bytes);
        }
        number(out, "bytes_out", self.bytes_out);
        if let Some(tally) = &self.units {
            number(out, "units_reserved", tally.reserved());
            if let Some(units) = tally.reported() {
                number(out, "units_reported", units);
            }
            if let Some(outcome) = tally.abandoned() {
                field(out, "abandoned", outcome.name(), false);
            }
        }
        let _ = write!(out, ",\"ms\":{took_ms:.3}");
        if !complete {
            out.push_str(",\"complete\":false");
        }
        out.push('}');
    }

    /// The line as combined-log-like text, then `key=value` fields.
    fn text_line(&self, out: &mut String, shown: &Shown) {
        let Shown {
            took_ms,
            time,
            decision,
            client,
            version,
            complete,
        } = shown;
        let _ = write!(
            out,
            "{} {} {} \"{} {} {}\" {} {}",
            time,
            self.peer,
            client.as_deref().unwrap_or("-"),
            self.method,
            escaped(&self.path),
            version,
            self.status,
            self.bytes_out,
        );
        let _ = write!(
            out,
            " route={} decision={decision}",
            self.route.as_deref().unwrap_or("-")
        );
        if let Some(limit) = &self.limit {
            let _ = write!(out, " limit={limit}");
        }
        if let Some(remaining) = self.remaining {
            let _ = write!(out, " remaining={remaining}");
        }
        if let Some(at) = self.decided_at_ms {
            let _ = write!(out, " decided_at_ms={at}");
        }
        if let Some(ms) = self.held_ms {
            let _ = write!(out, " held_ms={ms}");
        }
        if let Some((outcome, id)) = &self.key {
            let _ = write!(out, " key={outcome}");
            if let Some(id) = id {
                let _ = write!(out, " key_id={id}");
            }
        }
        if let Some(upstream) = &self.upstream {
            let _ = write!(out, " upstream={}", escaped(upstream));
        }
        if let Some(ms) = self.upstream_ms {
            let _ = write!(out, " upstream_ms={ms:.3}");
        }
        if let Some(bytes) = self.bytes_in {
            let _ = write!(out, " bytes_in={bytes}");
        }
        if let Some(tally) = &self.units {
            let _ = write!(out, " units_reserved={}", tally.reserved());
            if let Some(units) = tally.reported() {
                let _ = write!(out, " units_reported={units}");
            }
            if let Some(outcome) = tally.abandoned() {
                let _ = write!(out, " abandoned={}", outcome.name());
            }
        }
        let _ = write!(out, " ms={took_ms:.3}");
        if !complete {
            out.push_str(" incomplete");
        }
    }
}

/// What a line shows beside the record's own fields, worked out once for
/// either format.
struct Shown {
    took_ms: f64,
    time: String,
    decision: &'static str,
    client: Option<String>,
    version: &'static str,
    complete: bool,
}

fn field(out: &mut String, name: &str, value: &str, first: bool) {
    if !first {
        out.push(',');
    }
    out.push('"');
    out.push_str(name);
    out.push_str("\":");
    json_string(out, value);
}

/// `value` as a JSON string.
pub fn json_string(out: &mut String, value: &str) {
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn number(out: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = write!(out, ",\"{name}\":{value}");
}

/// `value` with quotes, backslashes, spaces and control characters escaped,
/// so a client cannot forge a line or a field.
fn escaped(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for c in value.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() || c == ' ' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// `time` as RFC 3339 in UTC, to the millisecond.
fn rfc3339(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (days, rest) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rest / 3_600,
        rest % 3_600 / 60,
        rest % 60,
        since.subsec_millis()
    )
}
