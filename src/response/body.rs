//! The body of every answer floodgate sends, the upstream's streamed or
//! floodgate's own whole, and what watches it go out.

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

/// Body of every response floodgate sends: the upstream's (`U`, as the
/// proxy streams it), or floodgate's own, whole; and, on the few answers
/// that have one, what watches it go out (gate's hooks on an answer's end:
/// a usage meter, the access log's line, the request's concurrency slot). One type of floodgate's own
/// for every answer: one poll and one end check a frame, the upstream's
/// error as it is, and the watcher set in place, not by a wrapper that
/// moves the answer again.
pub struct Body<U> {
    kind: Kind<U>,
    /// None on most answers (no access log, no cap, not metered): a null
    /// pointer, and every frame polled straight through.
    watcher: Option<Box<dyn Watcher>>,
    /// Seen at its end, or empty when the watcher was set: dropped then,
    /// the answer went out whole.
    at_end: bool,
    /// Makes the upstream's body the [`Rest`] a watcher may read on once
    /// the client left (set with the watcher, where `U` is known to be
    /// sendable).
    rest_of: Option<fn(U) -> Rest>,
}

/// The rest of an upstream's body its client left, for a watcher to read
/// on (see [`Watcher::wants_rest`]).
pub type Rest = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Any error of an upstream's body, as [`Rest`] carries it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `body` as a [`Rest`].
fn rest_of<U>(body: U) -> Rest
where
    U: hyper::body::Body<Data = Bytes> + Send + 'static,
    U::Error: Into<BoxError>,
{
    use http_body_util::BodyExt as _;
    body.map_err(Into::into).boxed_unsync()
}

enum Kind<U> {
    /// The upstream's answer, streamed.
    Streamed(U),
    /// Floodgate's own, whole: `None` once sent (or when empty).
    Whole(Option<Bytes>),
    /// Floodgate's own, whole, then trailers (a gRPC answer's status):
    /// each `None` once sent.
    Trailed(Option<Bytes>, Option<Box<http::HeaderMap>>),
}

impl<U: hyper::body::Body<Data = Bytes> + Unpin> Kind<U> {
    fn poll_frame(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, U::Error>>> {
        use std::task::Poll;
        match self {
            Self::Streamed(body) => std::pin::Pin::new(body).poll_frame(cx),
            Self::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Self::Trailed(bytes, trailers) => Poll::Ready(match bytes.take() {
                Some(b) => Some(Ok(Frame::data(b))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        }
    }

    /// `frame` as `watcher` edits it; trailers wait for what the watcher
    /// holds back, which goes out first (the trailers next, from here).
    fn held_before(
        &mut self,
        watcher: &mut dyn Watcher,
        frame: Frame<Bytes>,
    ) -> Option<Frame<Bytes>> {
        if !frame.is_trailers() {
            return watcher.edit(frame);
        }
        let Some(rest) = watcher.held() else {
            return watcher.edit(frame);
        };
        if let Ok(trailers) = frame.into_trailers() {
            *self = Self::Trailed(None, Some(Box::new(trailers)));
        }
        Some(Frame::data(rest))
    }
}

impl<U: hyper::body::Body> Kind<U> {
    fn is_end_stream(&self) -> bool {
        match self {
            Self::Streamed(body) => body.is_end_stream(),
            Self::Whole(bytes) => bytes.is_none(),
            Self::Trailed(bytes, trailers) => bytes.is_none() && trailers.is_none(),
        }
    }
}

/// What watches an answer's body go out, told of every frame and of how
/// the body ended.
pub trait Watcher: Send {
    /// A frame came from the body: what goes out instead (`None`: nothing
    /// now, the watcher holds it back). As it came, unless the watcher
    /// edits the body (see [`Watcher::edits`]).
    fn edit(&mut self, frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        Some(frame)
    }
    /// What the watcher still holds back when the body ends (or before its
    /// trailers): it goes out then.
    fn held(&mut self) -> Option<Bytes> {
        None
    }
    /// Whether the watcher may change what goes out (the body's length is
    /// then not known in advance).
    fn edits(&self) -> bool {
        false
    }
    /// A frame went out.
    fn sent(&mut self, frame: &Frame<Bytes>);
    /// The body went out whole (told again when it is then dropped).
    fn ended(&mut self);
    /// The body broke off on the way.
    fn broke(&mut self);
    /// The body was dropped before its end: the client went away.
    fn left(&mut self);
    /// The client went away before the end of the upstream's body: whether
    /// the watcher reads the rest of it on (told then with
    /// [`Watcher::rest`], instead of [`Watcher::left`]).
    fn wants_rest(&mut self) -> bool {
        false
    }
    /// The rest of the upstream's body the client left, for a watcher that
    /// wants it: the watcher owns both from here.
    fn rest(mut self: Box<Self>, _rest: Rest) {
        self.left();
    }
}

impl<U: std::fmt::Debug> std::fmt::Debug for Body<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Body");
        match &self.kind {
            Kind::Streamed(body) => out.field("streamed", body),
            Kind::Whole(bytes) => out.field("whole", bytes),
            Kind::Trailed(bytes, trailers) => out.field("whole", bytes).field("trailers", trailers),
        };
        out.field("watched", &self.watcher.is_some()).finish()
    }
}

impl<U> Body<U> {
    /// The upstream's `body`, streamed.
    pub fn streamed(body: U) -> Self {
        Self::of(Kind::Streamed(body))
    }

    /// A whole body of `bytes`.
    pub fn whole(bytes: impl Into<Bytes>) -> Self {
        let bytes: Bytes = bytes.into();
        Self::of(Kind::Whole((!bytes.is_empty()).then_some(bytes)))
    }

    /// A whole body of `bytes`, then `trailers`.
    pub fn trailed(bytes: Bytes, trailers: http::HeaderMap) -> Self {
        Self::of(Kind::Trailed(
            (!bytes.is_empty()).then_some(bytes),
            Some(Box::new(trailers)),
        ))
    }

    /// No body.
    pub fn empty() -> Self {
        Self::of(Kind::Whole(None))
    }

    fn of(kind: Kind<U>) -> Self {
        Self {
            kind,
            watcher: None,
            at_end: false,
            rest_of: None,
        }
    }
}

impl<U: hyper::body::Body<Data = Bytes> + Unpin> Body<U> {
    /// Has `watcher` (if any) watch this body go out.
    pub fn watch(&mut self, watcher: Option<Box<dyn Watcher>>)
    where
        U: Send + 'static,
        U::Error: Into<BoxError>,
    {
        // An empty body may never be polled: dropped, it went out whole.
        self.at_end = self.kind.is_end_stream();
        self.watcher = watcher;
        self.rest_of = Some(rest_of::<U>);
    }
}

impl<U: hyper::body::Body<Data = Bytes> + Unpin> hyper::body::Body for Body<U> {
    type Data = Bytes;
    type Error = U::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, U::Error>>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            let polled = this.kind.poll_frame(cx);
            let Some(watcher) = this.watcher.as_deref_mut() else {
                return polled;
            };
            let polled = match polled {
                Poll::Ready(Some(Ok(frame))) => match this.kind.held_before(watcher, frame) {
                    Some(frame) => Poll::Ready(Some(Ok(frame))),
                    // Held back whole: the next frame may go out.
                    None => continue,
                },
                Poll::Ready(None) => match watcher.held() {
                    Some(rest) => {
                        this.kind = Kind::Whole(None);
                        Poll::Ready(Some(Ok(Frame::data(rest))))
                    }
                    None => Poll::Ready(None),
                },
                other => other,
            };
            let ended = match &polled {
                Poll::Ready(Some(Ok(frame))) => {
                    watcher.sent(frame);
                    this.kind.is_end_stream()
                }
                Poll::Ready(None) => true,
                Poll::Ready(Some(Err(_))) => {
                    watcher.broke();
                    false
                }
                Poll::Pending => false,
            };
            if ended {
                this.at_end = true;
                watcher.ended();
            }
            return polled;
        }
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // Edited, the body is no longer than the upstream's.
            Kind::Streamed(body) if self.watcher.as_deref().is_some_and(|w| w.edits()) => {
                let mut hint = SizeHint::new();
                if let Some(upper) = body.size_hint().upper() {
                    hint.set_upper(upper);
                }
                hint
            }
            Kind::Streamed(body) => body.size_hint(),
            Kind::Whole(bytes) | Kind::Trailed(bytes, _) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

impl<U> Drop for Body<U> {
    fn drop(&mut self) {
        let Some(mut watcher) = self.watcher.take() else {
            return;
        };
        if self.at_end {
            watcher.ended();
            return;
        }
        if let (Some(rest_of), Kind::Streamed(_)) = (self.rest_of, &self.kind)
            && watcher.wants_rest()
            && let Kind::Streamed(body) = std::mem::replace(&mut self.kind, Kind::Whole(None))
        {
            watcher.rest(rest_of(body));
            return;
        }
        watcher.left();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;

    /// Writes down what it is told.
    struct Notes(Arc<Mutex<Vec<String>>>);

    impl Watcher for Notes {
        fn sent(&mut self, frame: &Frame<Bytes>) {
            let len = frame.data_ref().map_or(0, Bytes::len);
            self.note(format!("sent {len}"));
        }
        fn ended(&mut self) {
            self.note("ended".into());
        }
        fn broke(&mut self) {
            self.note("broke".into());
        }
        fn left(&mut self) {
            self.note("left".into());
        }
    }

    impl Notes {
        fn note(&self, what: String) {
            if let Ok(mut notes) = self.0.lock() {
                notes.push(what);
            }
        }
    }

    /// A streamed body of one frame, then an error.
    struct Breaking(bool);

    impl hyper::body::Body for Breaking {
        type Data = Bytes;
        type Error = &'static str;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            let first = std::mem::replace(&mut self.0, false);
            std::task::Poll::Ready(Some(if first {
                Ok(Frame::data(Bytes::from_static(b"abc")))
            } else {
                Err("broken")
            }))
        }
    }

    /// What a watcher of `body` was told, once `go` had done with it.
    fn told<U, F>(mut body: Body<U>, go: F) -> Vec<String>
    where
        U: hyper::body::Body<Data = Bytes> + Unpin + Send + 'static,
        U::Error: Into<BoxError>,
        F: AsyncFnOnce(&mut Body<U>),
    {
        let notes = Arc::new(Mutex::new(Vec::new()));
        body.watch(Some(Box::new(Notes(Arc::clone(&notes)))));
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime for the test")
            .block_on(go(&mut body));
        drop(body);
        notes.lock().map(|n| n.clone()).unwrap_or_default()
    }

    #[test]
    fn a_watcher_hears_how_each_answer_ended() {
        type Own = Body<http_body_util::Empty<Bytes>>;
        // Sent whole: the end is heard as it goes, and again when dropped.
        let sent = told(Own::whole("hello"), async |b| {
            let _ = b.frame().await;
        });
        assert_eq!(sent, ["sent 5", "ended", "ended"]);
        // Nothing to send, never polled: it went out whole.
        assert_eq!(told(Own::empty(), async |_| {}), ["ended"]);
        // Dropped before its end: the client went away.
        assert_eq!(told(Own::whole("hello"), async |_| {}), ["left"]);
        // The upstream's body broke off, then was dropped.
        let broke = told(Body::streamed(Breaking(true)), async |b| {
            while let Some(Ok(_)) = b.frame().await {}
        });
        assert_eq!(broke, ["sent 3", "broke", "left"]);
    }

    /// A streamed body of frames `b"1"` to `b"3"`.
    struct Three(u8);

    impl hyper::body::Body for Three {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0 += 1;
            std::task::Poll::Ready(
                (self.0 <= 3).then(|| Ok(Frame::data(Bytes::from(self.0.to_string())))),
            )
        }
    }

    /// Wants the rest of a body its client left, and keeps it.
    struct Keeps(Arc<Mutex<Option<Rest>>>);

    impl Watcher for Keeps {
        fn sent(&mut self, _: &Frame<Bytes>) {}
        fn ended(&mut self) {}
        fn broke(&mut self) {}
        fn left(&mut self) {}
        fn wants_rest(&mut self) -> bool {
            true
        }
        fn rest(self: Box<Self>, rest: Rest) {
            if let Ok(mut kept) = self.0.lock() {
                *kept = Some(rest);
            }
        }
    }

    #[test]
    fn a_watcher_that_wants_the_rest_of_a_body_its_client_left_reads_it_on() {
        let kept = Arc::new(Mutex::new(None));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime for the test");
        let mut body = Body::streamed(Three(0));
        body.watch(Some(Box::new(Keeps(Arc::clone(&kept)))));
        let first = runtime.block_on(body.frame());
        assert_eq!(
            first.and_then(|f| f.ok()?.into_data().ok()),
            Some(Bytes::from("1"))
        );
        drop(body);
        let rest = kept.lock().ok().and_then(|mut k| k.take());
        let rest = rest.expect("the rest handed over");
        let read = runtime.block_on(rest.collect()).expect("read on");
        assert_eq!(read.to_bytes(), "23");
    }
}
