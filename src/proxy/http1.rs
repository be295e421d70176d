//! HTTP/1.1 to an upstream, on a connection the request's own task drives.
//!
//! A proxied request is written and its answer read by the task that serves
//! the client, with no second task, channel or dispatcher in between: the
//! request head is written from one reused buffer, the response head parsed
//! with httparse straight into the header map the client will be sent, and
//! the response body read as the client's side asks for it. The connection
//! stays with the response body until that ends; then it goes back to its
//! pool (see [`super::pool`]) if it can carry another request.
//!
//! What is handled, as RFC 9112 asks of a client: request bodies of known
//! length or sent chunked; interim 1xx answers skipped; response bodies
//! framed by `Content-Length`, by chunked coding (decoded; trailers dropped)
//! or by the connection's close; no body for `HEAD`, 204 and 304; a
//! connection that saw `Connection: close`, an HTTP/1.0 answer without
//! keep-alive, an answer that came before its request was sent whole, or any
//! error, is never reused.

use std::io;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response, StatusCode, Version, request};
use hyper::body::{Body, Incoming, SizeHint};
use tokio::io::{AsyncRead, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use super::{Rewrite, is_hop_by_hop};

/// Most header fields accepted in an upstream's response head.
const MAX_HEADERS: usize = 100;
/// Largest response head accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The read buffer's size when a new one is needed.
const READ_SIZE: usize = 16 * 1024;
/// Room below which a new read buffer is made before reading.
const MIN_READ: usize = 2 * 1024;
/// Longest chunk-size line (with extensions) accepted in a chunked body.
const MAX_CHUNK_LINE: usize = 4 * 1024;

/// Why an exchange with the upstream failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing the connection failed.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The upstream closed the connection before its answer was complete.
    #[error("the upstream closed the connection before its answer was complete")]
    Closed,
    /// The upstream's answer is not HTTP/1.1 that floodgate can relay.
    #[error("the upstream's answer is malformed: {0}")]
    Malformed(&'static str),
    /// The deadline passed before the answer's head arrived.
    #[error("the upstream did not answer in time")]
    TimedOut,
    /// The client's request body failed while it was being sent.
    #[error("the request body broke off: {0}")]
    RequestBody(hyper::Error),
}

/// One keep-alive connection to an upstream.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    /// Bytes read from the upstream and not yet used.
    read: BytesMut,
    /// The request head being written; kept for the next one.
    head: Vec<u8>,
    /// The deadline of the request on this connection: one timer per
    /// connection, moved on for each request. Moving a registered timer
    /// later is one atomic exchange; a new timer per request was an
    /// insertion into the runtime's timer wheel and a removal after.
    timer: Option<Pin<Box<Sleep>>>,
    /// The field names of this connection's last answer.
    names: Names,
    /// Whether the request in `head` may be sent again, and if so whether
    /// it is a `HEAD`: it has no body and its method is idempotent.
    replay: Option<bool>,
}

/// Most field names a connection remembers.
const REMEMBERED_NAMES: usize = 32;

/// The field names of a connection's last answer, by position, each with
/// the bytes it was parsed from. An upstream sends the same names in the
/// same order answer after answer, so a name is mostly taken from here
/// after one comparison of bytes, instead of being parsed again (and, for
/// a name that is not a standard one, copied into an allocation of its
/// own).
#[derive(Debug, Default)]
struct Names(Vec<(Box<[u8]>, HeaderName)>);

impl Names {
    /// The name of the field at position `at` of a head, spelt `raw`.
    fn get(&mut self, at: usize, raw: &[u8]) -> Result<HeaderName, Error> {
        if let Some((seen, name)) = self.0.get(at)
            && **seen == *raw
        {
            return Ok(name.clone());
        }
        let name =
            HeaderName::from_bytes(raw).map_err(|_| Error::Malformed("invalid header name"))?;
        let remembered = (Box::from(raw), name.clone());
        if let Some(slot) = self.0.get_mut(at) {
            *slot = remembered;
        } else if at == self.0.len() && at < REMEMBERED_NAMES {
            self.0.push(remembered);
        }
        Ok(name)
    }
}

/// The answer to a request, and whether its connection may carry another
/// once the body has been read.
pub struct Answer {
    /// The response head.
    pub head: http::response::Parts,
    /// The response body, still to be read from the connection.
    pub body: Framing,
    /// The connection can take another request after this body: the answer
    /// allows it and the request went out whole.
    pub reusable: bool,
}

impl Connection {
    /// A connection over `stream`.
    pub fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            read: BytesMut::new(),
            head: Vec::with_capacity(1024),
            timer: None,
            names: Names::default(),
            replay: None,
        }
    }

    /// Whether the upstream has closed (or written out of turn on) this idle
    /// connection. Costs no system call unless the socket reported an
    /// event since it was last read.
    pub fn is_closed(&self) -> bool {
        if !self.read.is_empty() {
            return true;
        }
        let mut probe = [0u8; 1];
        !matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Sends the request with head `request` (origin-form target) and
    /// `body`, its header section changed by `rewrite`, and reads the
    /// answer's head into the request's header map, taken and emptied,
    /// unless `deadline` comes first. The body is left on the connection,
    /// to be read with [`Framing::poll_next`]; after [`Error::TimedOut`]
    /// the connection must be dropped.
    pub async fn send(
        &mut self,
        request: &mut request::Parts,
        body: Incoming,
        rewrite: &Rewrite<'_>,
        deadline: Instant,
    ) -> Result<Answer, Error> {
        let mut timer = self.timer_until(deadline);
        let answer = until(&mut timer, self.exchange(request, body, rewrite)).await;
        self.timer = Some(timer);
        answer
    }

    /// Whether the request this connection failed on with `error` may be
    /// sent again on another connection: it has no body, its method is
    /// idempotent, and no byte of an answer came back. That is how the
    /// race every keep-alive client meets looks: the upstream closed the
    /// idle connection just as the request reached it.
    pub fn may_resend(&self, error: &Error) -> bool {
        self.replay.is_some()
            && self.read.is_empty()
            && matches!(error, Error::Closed | Error::Io(_))
    }

    /// Sends the request `failed` could not deliver (see
    /// [`Connection::may_resend`]) on this connection, as it was written
    /// for `failed`, and reads the answer's head, unless `deadline` comes
    /// first.
    pub async fn resend(
        &mut self,
        failed: &mut Connection,
        deadline: Instant,
    ) -> Result<Answer, Error> {
        let head_only = failed.replay.take().unwrap_or(false);
        std::mem::swap(&mut self.head, &mut failed.head);
        self.replay = Some(head_only);
        let mut timer = self.timer_until(deadline);
        let mut fields = HeaderMap::new();
        let answer = until(&mut timer, self.bodiless(head_only, &mut fields)).await;
        self.timer = Some(timer);
        answer
    }

    /// This connection's timer, set for `deadline`.
    fn timer_until(&mut self, deadline: Instant) -> Pin<Box<Sleep>> {
        match self.timer.take() {
            Some(mut timer) => {
                timer.as_mut().reset(deadline);
                timer
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        }
    }

    /// [`Connection::send`] without the deadline.
    async fn exchange(
        &mut self,
        request: &mut request::Parts,
        body: Incoming,
        rewrite: &Rewrite<'_>,
    ) -> Result<Answer, Error> {
        let head_only = request.method == Method::HEAD;
        let framing = self.write_head(request, &body, rewrite);
        // The request's header map takes the answer's fields (parse_head
        // empties it first). hyper hands each response's map back as the
        // next request's, so one map serves a client connection for its
        // whole life, never reallocated.
        let mut fields = std::mem::take(&mut request.headers);

        let idempotent = matches!(
            request.method,
            Method::GET
                | Method::HEAD
                | Method::OPTIONS
                | Method::TRACE
                | Method::PUT
                | Method::DELETE
        );
        self.replay = (framing == RequestFraming::None && idempotent).then_some(head_only);

        let mut sent_whole = true;
        let answer = if framing == RequestFraming::None {
            self.bodiless(head_only, &mut fields).await?
        } else {
            // The upstream may answer before it has read the whole body
            // (with 413, say): read while writing.
            let (mut reader, mut writer) = self.stream.split();
            let mut sending = std::pin::pin!(send_body(&mut writer, &self.head, body, framing));
            let mut reading = std::pin::pin!(read_head(
                &mut reader,
                &mut self.read,
                head_only,
                &mut fields,
                &mut self.names,
            ));
            let mut sent = false;
            let mut send_failed = None;
            std::future::poll_fn(|cx| {
                if !sent
                    && send_failed.is_none()
                    && let Poll::Ready(result) = sending.as_mut().poll(cx)
                {
                    match result {
                        Ok(()) => sent = true,
                        // The client is gone: no one is left to answer.
                        Err(e @ Error::RequestBody(_)) => return Poll::Ready(Err(e)),
                        // The upstream may have answered and closed (413,
                        // say) before the write failed: read on.
                        Err(e) => send_failed = Some(e),
                    }
                }
                match ready!(reading.as_mut().poll(cx)) {
                    Ok(answer) => {
                        sent_whole = sent;
                        Poll::Ready(Ok(answer))
                    }
                    Err(e) => Poll::Ready(Err(send_failed.take().unwrap_or(e))),
                }
            })
            .await?
        };
        let mut answer = answer;
        answer.reusable &= sent_whole;
        Ok(answer)
    }

    /// Writes the request in `self.head`, which has no body, and reads the
    /// answer's head.
    async fn bodiless(&mut self, head_only: bool, fields: &mut HeaderMap) -> Result<Answer, Error> {
        self.stream.write_all(&self.head).await?;
        read_head(
            &mut self.stream,
            &mut self.read,
            head_only,
            fields,
            &mut self.names,
        )
        .await
    }

    /// Writes the request head into `self.head`, with the framing its body
    /// needs.
    fn write_head(
        &mut self,
        parts: &http::request::Parts,
        body: &Incoming,
        rewrite: &Rewrite<'_>,
    ) -> RequestFraming {
        let head = &mut self.head;
        head.clear();
        head.extend_from_slice(parts.method.as_str().as_bytes());
        head.push(b' ');
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        head.extend_from_slice(target.as_bytes());
        head.extend_from_slice(b" HTTP/1.1\r\n");
        let mut has_length = false;
        let mut field = |name: &str, value: &HeaderValue| {
            head.extend_from_slice(name.as_bytes());
            head.extend_from_slice(b": ");
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        };
        for (name, value) in &parts.headers {
            if rewrite.keeps(name) {
                has_length |= *name == CONTENT_LENGTH;
                field(name.as_str(), value);
            }
        }
        for (name, value) in rewrite.added() {
            field(name, value);
        }
        let framing = if has_length {
            RequestFraming::Length
        } else if body.is_end_stream() {
            // Methods that define a meaning for content say it is empty.
            if matches!(parts.method, Method::POST | Method::PUT | Method::PATCH) {
                head.extend_from_slice(b"content-length: 0\r\n");
            }
            RequestFraming::None
        } else {
            head.extend_from_slice(b"transfer-encoding: chunked\r\n");
            RequestFraming::Chunked
        };
        head.extend_from_slice(b"\r\n");
        if framing == RequestFraming::Length && body.is_end_stream() {
            return RequestFraming::None;
        }
        framing
    }
}

/// How a request's body goes on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestFraming {
    /// No body.
    None,
    /// As many bytes as its `Content-Length` says (hyper has checked it
    /// against what the client sends).
    Length,
    /// Chunked: the client did not say how long it is.
    Chunked,
}

/// Writes `head`, then `body` framed as `framing`.
async fn send_body(
    writer: &mut tokio::net::tcp::WriteHalf<'_>,
    head: &[u8],
    mut body: Incoming,
    framing: RequestFraming,
) -> Result<(), Error> {
    writer.write_all(head).await?;
    while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
        let frame = frame.map_err(Error::RequestBody)?;
        let Ok(data) = frame.into_data() else {
            // Trailers are not passed on.
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if framing == RequestFraming::Chunked {
            let size = format!("{:x}\r\n", data.len());
            writer.write_all(size.as_bytes()).await?;
            writer.write_all(&data).await?;
            writer.write_all(b"\r\n").await?;
        } else {
            writer.write_all(&data).await?;
        }
    }
    if framing == RequestFraming::Chunked {
        writer.write_all(b"0\r\n\r\n").await?;
    }
    Ok(())
}

/// `work`'s outcome, or [`Error::TimedOut`] if `timer` fires first.
async fn until<T>(
    timer: &mut Pin<Box<Sleep>>,
    work: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(outcome) = work.as_mut().poll(cx) {
            return Poll::Ready(outcome);
        }
        ready!(timer.as_mut().poll(cx));
        Poll::Ready(Err(Error::TimedOut))
    })
    .await
}

/// Reads one final response head (skipping 1xx answers) from `reader` into
/// `buf`, its fields into `fields`; returns it with how its body is framed
/// and whether the connection may be kept.
async fn read_head<R: AsyncRead + Unpin>(
    reader: &mut R,
    buf: &mut BytesMut,
    head_only: bool,
    fields: &mut HeaderMap,
    names: &mut Names,
) -> Result<Answer, Error> {
    loop {
        if let Some(parsed) = parse_head(buf, head_only, fields, names)? {
            return Ok(parsed);
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Err(Error::Malformed("response head too large"));
        }
        if read_more(reader, buf).await? == 0 {
            return Err(Error::Closed);
        }
    }
}

/// Reads what the socket has into `buf`; 0 at the end of the stream.
async fn read_more<R: AsyncRead + Unpin>(reader: &mut R, buf: &mut BytesMut) -> io::Result<usize> {
    std::future::poll_fn(|cx| poll_read_more(Pin::new(&mut *reader), cx, buf)).await
}

fn poll_read_more<R: AsyncRead>(
    reader: Pin<&mut R>,
    cx: &mut Context<'_>,
    buf: &mut BytesMut,
) -> Poll<io::Result<usize>> {
    // A buffer serves many small answers before a new one is needed.
    if buf.capacity() - buf.len() < MIN_READ {
        buf.reserve(READ_SIZE);
    }
    let spare = buf.spare_capacity_mut();
    let mut read = ReadBuf::uninit(spare);
    ready!(reader.poll_read(cx, &mut read))?;
    let n = read.filled().len();
    // SAFETY: `poll_read` initialised the first `n` bytes of the spare
    // capacity.
    unsafe { buf.set_len(buf.len() + n) };
    Poll::Ready(Ok(n))
}

/// Parses a final response head at the start of `buf`, consuming it (and
/// any 1xx heads before it); `None` if more bytes are needed. The head's
/// fields go into `fields` (an empty map whose room is reused), which the
/// answer then takes; their names are looked up in `names` first.
fn parse_head(
    buf: &mut BytesMut,
    head_only: bool,
    fields: &mut HeaderMap,
    names: &mut Names,
) -> Result<Option<Answer>, Error> {
    loop {
        // Where each field's name and value are in the head: the head is
        // split off the buffer before the fields become header values that
        // share its bytes.
        let mut spans = [const { MaybeUninit::<[u32; 4]>::uninit() }; MAX_HEADERS];
        let (len, code, minor, count) = {
            let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_HEADERS];
            let mut response = httparse::Response::new(&mut []);
            let parsed = httparse::ParserConfig::default().parse_response_with_uninit_headers(
                &mut response,
                buf,
                &mut fields,
            );
            let len = match parsed {
                Ok(httparse::Status::Complete(len)) => len,
                Ok(httparse::Status::Partial) => return Ok(None),
                Err(httparse::Error::TooManyHeaders) => {
                    return Err(Error::Malformed("too many header fields"));
                }
                Err(_) => return Err(Error::Malformed("not an HTTP/1 response head")),
            };
            if len > MAX_HEAD_BYTES {
                return Err(Error::Malformed("response head too large"));
            }
            let base = buf.as_ptr() as usize;
            let at = |part: &[u8]| (part.as_ptr() as usize - base) as u32;
            for (span, field) in spans.iter_mut().zip(response.headers.iter()) {
                let (name, value) = (at(field.name.as_bytes()), at(field.value));
                span.write([
                    name,
                    name + field.name.len() as u32,
                    value,
                    value + field.value.len() as u32,
                ]);
            }
            (
                len,
                response.code.unwrap_or(0),
                response.version,
                response.headers.len(),
            )
        };
        let status =
            StatusCode::from_u16(code).map_err(|_| Error::Malformed("invalid status code"))?;
        if status.is_informational() {
            if status == StatusCode::SWITCHING_PROTOCOLS {
                return Err(Error::Malformed("protocol upgrades are not relayed"));
            }
            buf.advance(len);
            continue;
        }
        let version = if minor == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        let head = buf.split_to(len).freeze();
        // Room for the two RateLimit fields floodgate adds.
        let mut headers = std::mem::take(fields);
        headers.clear();
        headers
            .try_reserve(count + 2)
            .map_err(|_| Error::Malformed("too many header fields"))?;
        let mut keep_alive = version == Version::HTTP_11;
        let mut length: Option<u64> = None;
        let mut chunked = false;
        let mut coded = false;
        // Fields the answer's `Connection` names (rare), dropped with the
        // standard hop-by-hop ones, which never enter the map.
        let mut named: Vec<HeaderName> = Vec::new();
        for (at, span) in spans[..count].iter().enumerate() {
            // SAFETY: the loop above wrote the first `count` spans, one per
            // parsed field.
            let [n0, n1, v0, v1] = unsafe { span.assume_init() };
            let name = names.get(at, &head[n0 as usize..n1 as usize])?;
            // SAFETY: httparse accepted these bytes as a field value (tab,
            // space, visible ASCII and obs-text), which are exactly the bytes
            // a HeaderValue may hold.
            let value = unsafe {
                HeaderValue::from_maybe_shared_unchecked(head.slice(v0 as usize..v1 as usize))
            };
            if name == CONTENT_LENGTH {
                let n = parse_length(value.as_bytes())
                    .ok_or(Error::Malformed("invalid Content-Length"))?;
                if length.is_some_and(|l| l != n) {
                    return Err(Error::Malformed("conflicting Content-Length"));
                }
                length = Some(n);
            } else if name == TRANSFER_ENCODING {
                coded = true;
                chunked = last_coding_is_chunked(value.as_bytes());
            } else if name == CONNECTION {
                for token in value.as_bytes().split(|&b| b == b',') {
                    let token = token.trim_ascii();
                    if token.eq_ignore_ascii_case(b"close") {
                        keep_alive = false;
                    } else if token.eq_ignore_ascii_case(b"keep-alive") {
                        keep_alive |= version == Version::HTTP_10;
                    } else if let Ok(other) = HeaderName::from_bytes(token) {
                        named.push(other);
                    }
                }
            }
            if !is_hop_by_hop(name.as_str()) {
                headers.append(name, value);
            }
        }
        for name in &named {
            headers.remove(name);
        }
        let framing = if head_only
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            Framing::Length(0)
        } else if coded {
            if length.is_some() {
                // Both: the coding wins (RFC 9112 §6.3), but such an answer
                // may be an attempt at smuggling; the connection ends with it.
                keep_alive = false;
                headers.remove(CONTENT_LENGTH);
            }
            if chunked {
                Framing::Chunked(Chunked::Size)
            } else {
                keep_alive = false;
                Framing::UntilClose
            }
        } else if let Some(n) = length {
            Framing::Length(n)
        } else {
            keep_alive = false;
            Framing::UntilClose
        };
        let mut parts = Response::new(()).into_parts().0;
        parts.status = status;
        parts.version = version;
        parts.headers = headers;
        return Ok(Some(Answer {
            head: parts,
            body: framing,
            reusable: keep_alive,
        }));
    }
}

fn parse_length(value: &[u8]) -> Option<u64> {
    let digits = value.trim_ascii();
    if digits.is_empty() || digits.len() > 19 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

fn last_coding_is_chunked(value: &[u8]) -> bool {
    value
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|last| last.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// How the rest of a response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked coding, at this point.
    Chunked(Chunked),
    /// Everything until the upstream closes.
    UntilClose,
}

/// Where a chunked body's reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunked {
    /// Before a chunk-size line.
    Size,
    /// In a chunk's data, with this much left.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// In the trailer section after the last chunk.
    Trailers,
    /// Read to the end.
    Done,
}

impl Framing {
    /// Whether nothing is left to read.
    pub fn is_done(self) -> bool {
        matches!(self, Self::Length(0) | Self::Chunked(Chunked::Done))
    }

    /// Polls the next piece of body from `conn`: data, or `None` at the end.
    pub fn poll_next(
        &mut self,
        conn: &mut Connection,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Error>>> {
        loop {
            match *self {
                Self::Length(0) => return Poll::Ready(None),
                Self::Length(left) => {
                    if conn.read.is_empty() && ready!(conn.poll_fill(cx))? == 0 {
                        return Poll::Ready(Some(Err(Error::Closed)));
                    }
                    let n = usize::try_from(left)
                        .unwrap_or(usize::MAX)
                        .min(conn.read.len());
                    *self = Self::Length(left - n as u64);
                    return Poll::Ready(Some(Ok(conn.read.split_to(n).freeze())));
                }
                Self::UntilClose => {
                    if conn.read.is_empty() && ready!(conn.poll_fill(cx))? == 0 {
                        *self = Self::Length(0);
                        return Poll::Ready(None);
                    }
                    return Poll::Ready(Some(Ok(conn.read.split().freeze())));
                }
                Self::Chunked(state) => match chunked_step(state, &mut conn.read)? {
                    Step::Next(next, data) => {
                        *self = Self::Chunked(next);
                        if let Some(data) = data {
                            return Poll::Ready(Some(Ok(data)));
                        }
                        if next == Chunked::Done {
                            return Poll::Ready(None);
                        }
                    }
                    Step::NeedMore => {
                        if ready!(conn.poll_fill(cx))? == 0 {
                            return Poll::Ready(Some(Err(Error::Closed)));
                        }
                    }
                },
            }
        }
    }
}

impl Connection {
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        poll_read_more(Pin::new(&mut self.stream), cx, &mut self.read)
    }
}

enum Step {
    Next(Chunked, Option<Bytes>),
    NeedMore,
}

/// One step of decoding a chunked body from `buf`.
fn chunked_step(state: Chunked, buf: &mut BytesMut) -> Result<Step, Error> {
    match state {
        Chunked::Size => {
            let Some(end) = find_line(buf) else {
                return if buf.len() > MAX_CHUNK_LINE {
                    Err(Error::Malformed("chunk size line too long"))
                } else {
                    Ok(Step::NeedMore)
                };
            };
            let line = &buf[..end];
            let digits = line
                .split(|&b| b == b';')
                .next()
                .unwrap_or(&[])
                .trim_ascii();
            if digits.is_empty() || digits.len() > 15 {
                return Err(Error::Malformed("invalid chunk size"));
            }
            let mut size = 0u64;
            for &d in digits {
                let v = (d as char)
                    .to_digit(16)
                    .ok_or(Error::Malformed("invalid chunk size"))?;
                size = size * 16 + u64::from(v);
            }
            buf.advance(end + 2);
            Ok(Step::Next(
                if size == 0 {
                    Chunked::Trailers
                } else {
                    Chunked::Data(size)
                },
                None,
            ))
        }
        Chunked::Data(left) => {
            if buf.is_empty() {
                return Ok(Step::NeedMore);
            }
            let n = usize::try_from(left).unwrap_or(usize::MAX).min(buf.len());
            let data = buf.split_to(n).freeze();
            let next = if n as u64 == left {
                Chunked::DataEnd
            } else {
                Chunked::Data(left - n as u64)
            };
            Ok(Step::Next(next, Some(data)))
        }
        Chunked::DataEnd => {
            if buf.len() < 2 {
                return Ok(Step::NeedMore);
            }
            if &buf[..2] != b"\r\n" {
                return Err(Error::Malformed("chunk data not followed by CRLF"));
            }
            buf.advance(2);
            Ok(Step::Next(Chunked::Size, None))
        }
        Chunked::Trailers => {
            let Some(end) = find_line(buf) else {
                return if buf.len() > MAX_HEAD_BYTES {
                    Err(Error::Malformed("trailer section too large"))
                } else {
                    Ok(Step::NeedMore)
                };
            };
            buf.advance(end + 2);
            Ok(Step::Next(
                if end == 0 {
                    Chunked::Done
                } else {
                    Chunked::Trailers
                },
                None,
            ))
        }
        Chunked::Done => Ok(Step::Next(Chunked::Done, None)),
    }
}

/// Where the first CRLF in `buf` starts.
fn find_line(buf: &[u8]) -> Option<usize> {
    buf.windows(2).position(|w| w == b"\r\n")
}

/// The size hint for a body framed as `framing`.
pub fn size_hint(framing: Framing) -> SizeHint {
    match framing {
        Framing::Length(n) => SizeHint::with_exact(n),
        _ => SizeHint::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `parse_head` with a new map and no remembered names.
    fn parse_fresh(buf: &mut BytesMut, head_only: bool) -> Result<Option<Answer>, Error> {
        parse_head(buf, head_only, &mut HeaderMap::new(), &mut Names::default())
    }

    fn decode(wire: &[u8]) -> Result<Vec<u8>, Error> {
        let mut buf = BytesMut::from(wire);
        let mut state = Chunked::Size;
        let mut out = Vec::new();
        loop {
            match chunked_step(state, &mut buf)? {
                Step::Next(next, data) => {
                    if let Some(d) = data {
                        out.extend_from_slice(&d);
                    }
                    state = next;
                    if state == Chunked::Done {
                        return Ok(out);
                    }
                }
                Step::NeedMore => return Err(Error::Closed),
            }
        }
    }

    #[test]
    fn chunked_bodies_are_decoded_and_trailers_dropped() {
        assert_eq!(
            decode(b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\nx-t: 1\r\n\r\n").ok(),
            Some(b"hello, world".to_vec())
        );
        assert!(decode(b"zz\r\n").is_err());
        assert!(decode(b"5\r\nhelloXX0\r\n\r\n").is_err());
        assert!(matches!(decode(b"5\r\nhel"), Err(Error::Closed)));
    }

    #[test]
    fn remembered_names_follow_each_answer() {
        let mut names = Names::default();
        let mut fields = HeaderMap::new();
        let mut parse = |wire: &[u8]| {
            let mut buf = BytesMut::from(wire);
            let answer = parse_head(&mut buf, false, &mut fields, &mut names)
                .ok()
                .flatten()
                .expect("a head");
            let seen: Vec<(String, String)> = answer
                .head
                .headers
                .iter()
                .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v.as_bytes()).into()))
                .collect();
            (seen, answer.body)
        };
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect()
        };
        let first = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Request-Id: a\r\n\r\n";
        let expected = pairs(&[("content-length", "2"), ("x-request-id", "a")]);
        assert_eq!(parse(first), (expected.clone(), Framing::Length(2)));
        // The same names again, then other names (and another spelling) in
        // the same places, then fewer and more fields.
        assert_eq!(parse(first), (expected, Framing::Length(2)));
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nX-Other: b\r\ncontent-LENGTH: 0\r\nX-Request-Id: c\r\n\r\n"),
            (
                pairs(&[
                    ("x-other", "b"),
                    ("content-length", "0"),
                    ("x-request-id", "c")
                ]),
                Framing::Length(0)
            )
        );
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\nX-Other: d\r\n\r\n"),
            (pairs(&[("x-other", "d")]), Framing::UntilClose)
        );
        let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
        for i in 0..REMEMBERED_NAMES + 5 {
            many.extend(format!("x-f{i}: {i}\r\n").bytes());
        }
        many.extend(b"content-length: 0\r\n\r\n");
        for _ in 0..2 {
            let (seen, body) = parse(&many);
            assert_eq!(seen.len(), REMEMBERED_NAMES + 6);
            let last = REMEMBERED_NAMES + 4;
            assert_eq!(seen[last], (format!("x-f{last}"), last.to_string()));
            assert_eq!(body, Framing::Length(0));
        }
    }

    #[test]
    fn response_heads_say_how_their_bodies_end() {
        let parse = |wire: &[u8], head_only| {
            let mut buf = BytesMut::from(wire);
            parse_fresh(&mut buf, head_only).map(|p| p.map(|a| (a.head.status, a.body, a.reusable)))
        };
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc", false).ok(),
            Some(Some((StatusCode::OK, Framing::Length(3), true)))
        );
        assert_eq!(
            parse(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
                false
            )
            .ok(),
            Some(Some((StatusCode::NO_CONTENT, Framing::Length(0), true)))
        );
        assert_eq!(
            parse(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
                false
            )
            .ok(),
            Some(Some((
                StatusCode::OK,
                Framing::Chunked(Chunked::Size),
                true
            )))
        );
        assert_eq!(
            parse(
                b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 3\r\n\r\n",
                false
            )
            .ok(),
            Some(Some((StatusCode::OK, Framing::Length(3), false)))
        );
        assert_eq!(
            parse(b"HTTP/1.0 200 OK\r\n\r\n", false).ok(),
            Some(Some((StatusCode::OK, Framing::UntilClose, false)))
        );
        assert_eq!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n", true).ok(),
            Some(Some((StatusCode::OK, Framing::Length(0), true)))
        );
        assert!(
            parse(
                b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                false
            )
            .is_err()
        );
        assert!(parse(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", false).is_err());
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\ncontent-le", false),
            Ok(None)
        ));

        let with_fields = |n: usize| {
            let mut wire = b"HTTP/1.1 200 OK\r\n".to_vec();
            for i in 0..n {
                wire.extend(format!("x-field-{i}: value {i}\r\n").bytes());
            }
            wire.extend(b"content-length: 0\r\n\r\n");
            BytesMut::from(&wire[..])
        };
        let mut most = with_fields(MAX_HEADERS - 1);
        let Answer { head, .. } = parse_fresh(&mut most, false)
            .ok()
            .flatten()
            .expect("a head of 100 fields");
        assert_eq!(head.headers.len(), MAX_HEADERS);
        assert_eq!(
            head.headers.get("x-field-98").map(HeaderValue::as_bytes),
            Some(&b"value 98"[..])
        );
        assert!(most.is_empty(), "the head was consumed");
        assert!(parse_fresh(&mut with_fields(MAX_HEADERS), false).is_err());

        let mut hops = BytesMut::from(
            &b"HTTP/1.1 200 OK\r\nconnection: x-secret, keep-alive\r\nx-secret: 1\r\n\
               keep-alive: timeout=5\r\ntransfer-encoding: chunked\r\nx-kept: 1\r\n\r\n"[..],
        );
        let Answer {
            head,
            body: framing,
            reusable: keep_alive,
        } = parse_fresh(&mut hops, false)
            .ok()
            .flatten()
            .expect("a head");
        let names: Vec<&str> = head.headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["x-kept"]);
        assert_eq!(framing, Framing::Chunked(Chunked::Size));
        assert!(keep_alive);
    }
}
