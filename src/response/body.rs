//! The body of every answer floodgate sends, the upstream's streamed or
//! floodgate's own whole, and the hooks that watch it go out.

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

/// Body of every response floodgate sends: the upstream's (`U`, as the
/// proxy streams it), or floodgate's own, whole; and, on the few answers
/// that have any, the hooks that watch it go out (the access log's line,
/// the request's concurrency slot, a usage meter). One type of floodgate's
/// own for every answer: one poll and one end check a frame, the
/// upstream's error as it is, and the hooks set in place, not by a wrapper
/// that moves the answer again.
pub struct Body<U> {
    kind: Kind<U>,
    /// None on most answers (no access log, no cap, not metered): every
    /// frame polled straight through.
    hooks: Hooks,
    /// Seen at its end, or empty when the hooks were set: dropped then,
    /// the answer went out whole.
    at_end: bool,
}

/// The hooks an answer's end is told to, in the order they were given:
/// each part that waits for the answer (the access log's line, the
/// request's concurrency slot, a usage meter, and whatever comes next) is
/// a hook of its own, and none holds another. No hook costs nothing, one
/// costs its own box, several one allocation more for the list.
#[derive(Default)]
pub struct Hooks(List);

#[derive(Default)]
enum List {
    #[default]
    None,
    One(Box<dyn Watcher>),
    Many(Box<[Box<dyn Watcher>]>),
}

impl Hooks {
    /// The hooks of `each` that are there, told in this order.
    pub fn of<const N: usize>(each: [Option<Box<dyn Watcher>>; N]) -> Self {
        let there = each.iter().flatten().count();
        let mut each = each.into_iter().flatten();
        Self(match (there, each.next()) {
            (_, None) => List::None,
            (1, Some(one)) => List::One(one),
            (_, Some(first)) => {
                let mut all = Vec::with_capacity(there);
                all.push(first);
                all.extend(each);
                List::Many(all.into_boxed_slice())
            }
        })
    }

    fn is_empty(&self) -> bool {
        matches!(self.0, List::None)
    }

    /// Tells every hook, in order.
    fn tell(&mut self, mut what: impl FnMut(&mut dyn Watcher)) {
        match &mut self.0 {
            List::None => {}
            List::One(hook) => what(hook.as_mut()),
            List::Many(hooks) => hooks.iter_mut().for_each(|h| what(h.as_mut())),
        }
    }
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
    /// A frame went out.
    fn sent(&mut self, frame: &Frame<Bytes>);
    /// The body went out whole (told again when it is then dropped).
    fn ended(&mut self);
    /// The body broke off on the way.
    fn broke(&mut self);
    /// The body was dropped before its end: the client went away.
    fn left(&mut self);
}

impl<U: std::fmt::Debug> std::fmt::Debug for Body<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut out = f.debug_struct("Body");
        match &self.kind {
            Kind::Streamed(body) => out.field("streamed", body),
            Kind::Whole(bytes) => out.field("whole", bytes),
            Kind::Trailed(bytes, trailers) => out.field("whole", bytes).field("trailers", trailers),
        };
        out.field("watched", &!self.hooks.is_empty()).finish()
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
            hooks: Hooks::default(),
            at_end: false,
        }
    }
}

impl<U: hyper::body::Body<Data = Bytes> + Unpin> Body<U> {
    /// Has `hooks` watch this body go out.
    pub fn watch(&mut self, hooks: Hooks) {
        // An empty body may never be polled: dropped, it went out whole.
        self.at_end = self.kind.is_end_stream();
        self.hooks = hooks;
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
        let polled = match &mut this.kind {
            Kind::Streamed(body) => std::pin::Pin::new(body).poll_frame(cx),
            Kind::Whole(bytes) => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            Kind::Trailed(bytes, trailers) => Poll::Ready(match bytes.take() {
                Some(b) => Some(Ok(Frame::data(b))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        };
        if this.hooks.is_empty() {
            return polled;
        }
        let ended = match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                this.hooks.tell(|h| h.sent(frame));
                this.kind.is_end_stream()
            }
            Poll::Ready(None) => true,
            Poll::Ready(Some(Err(_))) => {
                this.hooks.tell(|h| h.broke());
                false
            }
            Poll::Pending => false,
        };
        if ended {
            this.at_end = true;
            this.hooks.tell(|h| h.ended());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.kind.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Streamed(body) => body.size_hint(),
            Kind::Whole(bytes) | Kind::Trailed(bytes, _) => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

impl<U> Drop for Body<U> {
    fn drop(&mut self) {
        if self.at_end {
            self.hooks.tell(|h| h.ended());
        } else {
            self.hooks.tell(|h| h.left());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::{Arc, Mutex};

    use http_body_util::BodyExt;

    /// Writes down what it is told, under its name.
    struct Notes(&'static str, Arc<Mutex<Vec<String>>>);

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
            if let Ok(mut notes) = self.1.lock() {
                notes.push(match self.0 {
                    "" => what,
                    name => format!("{name} {what}"),
                });
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
        U: hyper::body::Body<Data = Bytes> + Unpin,
        F: AsyncFnOnce(&mut Body<U>),
    {
        let notes = Arc::new(Mutex::new(Vec::new()));
        body.watch(Hooks::of([Some(Box::new(Notes("", Arc::clone(&notes))))]));
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
    #[test]
    fn every_hook_hears_the_answer_in_the_order_given_and_none_through_another() {
        let notes = Arc::new(Mutex::new(Vec::new()));
        let hook =
            |name| -> Option<Box<dyn Watcher>> { Some(Box::new(Notes(name, Arc::clone(&notes)))) };
        let mut body = Body::<http_body_util::Empty<Bytes>>::whole("hi");
        body.watch(Hooks::of([hook("meter"), None, hook("line"), hook("slot")]));
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime for the test")
            .block_on(async {
                let _ = body.frame().await;
            });
        drop(body);
        let heard = notes.lock().map(|n| n.clone()).unwrap_or_default();
        assert_eq!(
            heard,
            [
                "meter sent 2",
                "line sent 2",
                "slot sent 2",
                "meter ended",
                "line ended",
                "slot ended",
                "meter ended",
                "line ended",
                "slot ended",
            ]
        );
        // No hook given: nothing to tell, and nothing allocated for it.
        assert!(Hooks::of([None, None]).is_empty());
    }
}
