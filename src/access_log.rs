//! The access log: one line per request, written when its answer has gone
//! out (or the client went away): who asked, on which route, what the limits
//! decided, where it went and what it cost.
//!
//! The data path never writes: a line is formatted and handed to a writer
//! thread through a bounded queue; when the queue is full (the disk is
//! slower than the traffic) the line is dropped and counted, never waited
//! for. Lines for allowed requests can be sampled. Denied ones are always
//! logged, but at most `denied_per_client` a second per client (clients
//! share 4 096 slots by a hash of their id, so memory is fixed however many
//! there are) and 1 000 a second in all: a flood of denials cannot flood
//! the disk. `SIGUSR1` reopens the file, for logrotate.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Method, Version};
use hyper::body::{Body as _, Frame, SizeHint};
use prometheus_client::metrics::counter::Counter;
use sha2::{Digest as _, Sha256};

use crate::client::{ClientId, hex, keyed_digest, process_key};
use crate::metrics::Outcome;
use crate::response::Body;

/// Lines waiting for the writer; past this they are dropped.
const QUEUE: usize = 16_384;
/// Slots that denied clients share for the per-client cap.
const SLOTS: usize = 4_096;
/// Most denial lines a second, all clients together.
const DENIED_PER_SECOND: u64 = 1_000;
/// Longest path written; a longer one is cut and marked with `…`.
const MAX_PATH: usize = 1_024;

/// How lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// One JSON object per line.
    Json,
    /// `key=value` text after a combined-log-like head.
    Text,
}

/// Every `format` of `[access_log]` by name: `off` is no log at all.
pub const FORMATS: [(&str, Option<Format>); 3] = [
    ("json", Some(Format::Json)),
    ("text", Some(Format::Text)),
    ("off", None),
];

/// How a client's id appears.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShowId {
    /// As sent (an API key in clear).
    Raw,
    /// A keyed digest: 16 hex digits of SHA-256 over a key and the id.
    Hash,
    /// Not at all.
    Hidden,
}

impl ShowId {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, ShowId); 3] = [
        ("hash", ShowId::Hash),
        ("raw", ShowId::Raw),
        ("none", ShowId::Hidden),
    ];
}

/// `[access_log]`, when it is on.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// How lines are written.
    pub format: Format,
    /// The file; standard error when `None`.
    pub path: Option<PathBuf>,
    /// The share of allowed requests logged, 0 to 1.
    pub sample_allowed: f64,
    /// Most denial lines a second for one client.
    pub denied_per_client: u64,
}

/// Why the access log cannot start.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot open the access log {path}: {source}; check that its folder exists and floodgate may write there"
)]
pub struct OpenError {
    path: PathBuf,
    source: std::io::Error,
}

/// How client ids appear to operators: in the access log and on
/// `/clients/top` (`[access_log] client_id`, which applies even while the
/// log itself is off).
#[derive(Debug)]
pub struct Ids {
    mode: ShowId,
    key: [u8; 32],
}

impl Ids {
    /// Ids shown as `mode` says, digests keyed as [`digest_key`] says.
    pub fn new(mode: ShowId) -> Self {
        Self {
            mode,
            key: digest_key(),
        }
    }

    /// How `client` appears (`None` with `client_id = "none"`).
    pub fn show(&self, client: &ClientId) -> Option<String> {
        match self.mode {
            ShowId::Hidden => None,
            ShowId::Raw => Some(raw(client)),
            ShowId::Hash => Some(keyed_digest(&self.key, raw(client).as_bytes())),
        }
    }
}

/// The access log in force.
#[derive(Debug)]
pub struct AccessLog {
    settings: Settings,
    ids: Arc<Ids>,
    lines: SyncSender<String>,
    /// Per slot: the second (since the epoch) and the denial lines in it.
    slots: Box<[AtomicU64]>,
    /// The same for all denials.
    all_denied: AtomicU64,
    sampled: AtomicU64,
    /// Lines not written because the queue was full.
    dropped: Counter,
    /// Denial lines not written because of the caps.
    suppressed: Counter,
}

/// Asks the writer to reopen its file before the next line (`SIGUSR1`).
pub fn reopen() {
    REOPEN.store(true, Ordering::Relaxed);
}

static REOPEN: AtomicBool = AtomicBool::new(false);

// === impl AccessLog ===

impl AccessLog {
    /// Opens the log as `settings` say and starts its writer thread; lines
    /// dropped for a full queue and denial lines held back by the caps are
    /// counted into `dropped` and `suppressed`.
    pub fn start(
        settings: Settings,
        ids: Arc<Ids>,
        dropped: Counter,
        suppressed: Counter,
    ) -> Result<Arc<Self>, OpenError> {
        let sink = Sink::open(settings.path.as_deref())?;
        let (lines, queue) = std::sync::mpsc::sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || write_lines(&queue, sink))
            .map_err(|source| OpenError {
                path: settings.path.clone().unwrap_or_else(|| "stderr".into()),
                source,
            })?;
        Ok(Arc::new(Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            all_denied: AtomicU64::new(0),
            sampled: AtomicU64::new(0),
            ids,
            dropped,
            suppressed,
            lines,
            settings,
        }))
    }

    /// Whether a request with this outcome gets a line (sampling for
    /// allowed ones, the caps for denied ones).
    fn wanted(&self, outcome: Option<Outcome>, client: Option<&ClientId>) -> bool {
        match outcome {
            Some(Outcome::Denied) => self.denial_allowed(client),
            Some(Outcome::Allowed) | None if self.settings.sample_allowed < 1.0 => {
                let n = self.sampled.fetch_add(1, Ordering::Relaxed);
                // A scrambled counter: evenly spread, no lock, no RNG.
                let r = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
                (r as f64) < self.settings.sample_allowed * (1u64 << 53) as f64
            }
            _ => true,
        }
    }

    fn denial_allowed(&self, client: Option<&ClientId>) -> bool {
        let second = now_secs();
        let slot = client.map_or(0, |c| {
            use std::hash::BuildHasher;
            static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
            let seed = SEED.get_or_init(std::collections::hash_map::RandomState::new);
            (seed.hash_one(c) as usize) % SLOTS
        });
        let allowed = take(&self.slots[slot], second, self.settings.denied_per_client)
            && take(&self.all_denied, second, DENIED_PER_SECOND);
        if !allowed {
            self.suppressed.inc();
        }
        allowed
    }

    fn send(&self, line: String) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.lines.try_send(line)
        {
            self.dropped.inc();
        }
    }
}

/// Counts one more in `cell` (the second in its high 40 bits, the count in
/// its low 24) if fewer than `cap` were counted this second.
fn take(cell: &AtomicU64, second: u64, cap: u64) -> bool {
    let mut current = cell.load(Ordering::Relaxed);
    loop {
        let (at, count) = (current >> 24, current & 0xFF_FFFF);
        let next = if at == second {
            if count >= cap {
                return false;
            }
            current + 1
        } else {
            (second << 24) | 1
        };
        match cell.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(seen) => current = seen,
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The key of client digests: `FLOODGATE_ACCESS_LOG_KEY` (the same on every
/// instance gives the same digests everywhere), else the process's own.
fn digest_key() -> [u8; 32] {
    if let Ok(key) = std::env::var("FLOODGATE_ACCESS_LOG_KEY")
        && !key.is_empty()
    {
        return Sha256::digest(key.as_bytes()).into();
    }
    *process_key()
}

/// A client id as sent: an address, a header's value (lossy UTF-8), parts
/// joined with `+`.
fn raw(client: &ClientId) -> String {
    match client {
        ClientId::Addr(ip) => ip.to_string(),
        ClientId::Header(value) => String::from_utf8_lossy(value).into_owned(),
        ClientId::Digest(d) => hex(&d[..]),
        ClientId::Global => "global".to_owned(),
        ClientId::Composite(parts) => parts.iter().map(raw).collect::<Vec<_>>().join("+"),
    }
}

// === One request's line ===

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
    outcome: Option<Outcome>,
    limit: Option<String>,
    remaining: Option<u64>,
    client: Option<ClientId>,
    upstream: Option<Box<str>>,
    upstream_ms: Option<f64>,
    status: u16,
    bytes_out: u64,
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
            client: None,
            upstream: None,
            upstream_ms: None,
            status: 0,
            bytes_out: 0,
        }
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

    /// The upstream endpoint that answered, and how long its head took.
    pub fn upstream(&mut self, endpoint: &str, took: std::time::Duration) {
        self.upstream = Some(endpoint.into());
        self.upstream_ms = Some(took.as_secs_f64() * 1000.0);
    }

    /// The answer's status.
    pub fn status(&mut self, status: u16) {
        self.status = status;
    }

    fn line(&self, log: &AccessLog, complete: bool) -> String {
        let took_ms = self.started.elapsed().as_secs_f64() * 1000.0;
        let time = rfc3339(self.time);
        let decision = self.outcome.map_or("-", Outcome::name);
        let client = self.client.as_ref().and_then(|c| log.ids.show(c));
        let version = match self.version {
            Version::HTTP_10 => "HTTP/1.0",
            Version::HTTP_2 => "HTTP/2",
            _ => "HTTP/1.1",
        };
        let mut out = String::with_capacity(256);
        match log.settings.format {
            Format::Json => {
                out.push('{');
                field(&mut out, "time", &time, true);
                field(&mut out, "peer", &self.peer.to_string(), false);
                field(&mut out, "method", self.method.as_str(), false);
                field(&mut out, "path", &self.path, false);
                field(&mut out, "protocol", version, false);
                number(&mut out, "status", self.status);
                field(
                    &mut out,
                    "route",
                    self.route.as_deref().unwrap_or(""),
                    false,
                );
                field(&mut out, "decision", decision, false);
                if let Some(limit) = &self.limit {
                    field(&mut out, "limit", limit, false);
                }
                if let Some(remaining) = self.remaining {
                    number(&mut out, "remaining", remaining);
                }
                if let Some(client) = &client {
                    field(&mut out, "client", client, false);
                }
                if let Some(upstream) = &self.upstream {
                    field(&mut out, "upstream", upstream, false);
                }
                if let Some(ms) = self.upstream_ms {
                    let _ = write!(out, ",\"upstream_ms\":{ms:.3}");
                }
                if let Some(bytes) = self.bytes_in {
                    number(&mut out, "bytes_in", bytes);
                }
                number(&mut out, "bytes_out", self.bytes_out);
                let _ = write!(out, ",\"ms\":{took_ms:.3}");
                if !complete {
                    out.push_str(",\"complete\":false");
                }
                out.push('}');
            }
            Format::Text => {
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
                if let Some(upstream) = &self.upstream {
                    let _ = write!(out, " upstream={}", escaped(upstream));
                }
                if let Some(ms) = self.upstream_ms {
                    let _ = write!(out, " upstream_ms={ms:.3}");
                }
                if let Some(bytes) = self.bytes_in {
                    let _ = write!(out, " bytes_in={bytes}");
                }
                let _ = write!(out, " ms={took_ms:.3}");
                if !complete {
                    out.push_str(" incomplete");
                }
            }
        }
        out
    }
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

// === The body that writes the line at its end ===

/// A response body that writes its request's line once it has gone out
/// whole, or when dropped before that (the client went away).
#[derive(Debug)]
pub struct Logged {
    inner: Body,
    line: Option<(Box<Record>, Arc<AccessLog>)>,
    /// The request's concurrency slot, given back when the body is done
    /// with (dropped).
    slot: Option<crate::concurrency::Slot>,
}

impl Logged {
    /// `inner`, logged as `record` in `log` if the log wants its line.
    pub fn new(inner: Body, record: Option<Record>, log: Option<&Arc<AccessLog>>) -> Self {
        let line = match (record, log) {
            (Some(record), Some(log)) if log.wanted(record.outcome, record.client.as_ref()) => {
                Some((Box::new(record), Arc::clone(log)))
            }
            _ => None,
        };
        Self {
            inner,
            line,
            slot: None,
        }
    }

    /// Holds `slot` until the body is done with.
    pub fn holding(mut self, slot: Option<crate::concurrency::Slot>) -> Self {
        self.slot = slot;
        self
    }

    fn finish(&mut self, complete: bool) {
        if let Some((record, log)) = self.line.take() {
            let line = record.line(&log, complete);
            log.send(line);
        }
    }
}

impl hyper::body::Body for Logged {
    type Data = Bytes;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some((record, _)), Some(data)) = (this.line.as_mut(), frame.data_ref()) {
                    record.bytes_out += data.len() as u64;
                }
                if this.inner.is_end_stream() {
                    this.finish(true);
                }
            }
            Poll::Ready(None) => this.finish(true),
            Poll::Ready(Some(Err(_))) => this.finish(false),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        // An empty body may never be polled: its line is complete.
        let complete = self.inner.is_end_stream();
        self.finish(complete);
    }
}

// === The writer ===

#[derive(Debug)]
enum Sink {
    Stderr,
    File(PathBuf, std::io::BufWriter<std::fs::File>),
}

impl Sink {
    fn open(path: Option<&Path>) -> Result<Self, OpenError> {
        let Some(path) = path else {
            return Ok(Self::Stderr);
        };
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map(|file| Self::File(path.to_owned(), std::io::BufWriter::new(file)))
            .map_err(|source| OpenError {
                path: path.to_owned(),
                source,
            })
    }

    fn write(&mut self, line: &str) {
        let written = match self {
            Self::Stderr => {
                let mut err = std::io::stderr().lock();
                err.write_all(line.as_bytes())
                    .and_then(|()| err.write_all(b"\n"))
            }
            Self::File(_, file) => file
                .write_all(line.as_bytes())
                .and_then(|()| file.write_all(b"\n")),
        };
        if let Err(e) = written {
            tracing::warn!(error = %e, "cannot write the access log");
        }
    }

    fn flush(&mut self) {
        if let Self::File(_, file) = self {
            let _ = file.flush();
        }
    }

    /// The file opened again at its path (after logrotate moved it).
    fn reopened(self) -> Self {
        match self {
            Self::File(path, mut old) => {
                let _ = old.flush();
                match Self::open(Some(&path)) {
                    Ok(new) => {
                        tracing::info!(path = %path.display(), "access log reopened");
                        new
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "keeping the access log open as it was");
                        Self::File(path, old)
                    }
                }
            }
            Self::Stderr => Self::Stderr,
        }
    }
}

/// Writes what arrives until every sender is gone, flushing whenever the
/// queue runs dry.
fn write_lines(queue: &Receiver<String>, mut sink: Sink) {
    while let Ok(first) = queue.recv() {
        if REOPEN.swap(false, Ordering::Relaxed) {
            sink = sink.reopened();
        }
        sink.write(&first);
        while let Ok(line) = queue.try_recv() {
            sink.write(&line);
        }
        sink.flush();
    }
    sink.flush();
}
