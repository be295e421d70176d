//! The body every answer goes out through: it writes its request's line
//! once the answer has gone out whole, or when it is dropped before that
//! (the client went away), holds the request's concurrency slot until
//! then, and on a metered route shows the answer to its usage meter on the
//! way (one wrapper for all three, so an answer pays for one layer).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use super::{AccessLog, Record};
use crate::usage::Meter;

/// A response body that writes its request's line once it has gone out
/// whole, or when dropped before that (the client went away).
///
/// What it does beside the body (the line, the slot, the meter) is one
/// optional box, built once: an answer with none of them (no access log,
/// no cap, not metered) is its body and a null pointer, polled straight
/// through.
pub struct Logged<B: hyper::body::Body> {
    inner: B,
    tail: Option<Box<Tail>>,
}

/// What a [`Logged`] body does beside being sent.
struct Tail {
    line: Option<(Record, Arc<AccessLog>)>,
    /// The request's concurrency slot, given back when the body is done
    /// with (dropped).
    slot: Option<crate::concurrency::Slot>,
    /// Reads the answer for the units it reports, on a metered route.
    meter: Option<Box<Meter>>,
}

impl<B: hyper::body::Body + std::fmt::Debug> std::fmt::Debug for Logged<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tail = self.tail.as_deref();
        f.debug_struct("Logged")
            .field("inner", &self.inner)
            .field("line", &tail.and_then(|t| t.line.as_ref()))
            .field("slot", &tail.and_then(|t| t.slot.as_ref()))
            .field("metered", &tail.is_some_and(|t| t.meter.is_some()))
            .finish()
    }
}

impl<B: hyper::body::Body> Logged<B> {
    /// `inner`, logged as `record` in `log` if the log wants its line,
    /// holding `slot` until the body is done with, and shown to `meter` as
    /// it goes out: every frame, then its end (before the line is written,
    /// so the line has the units).
    pub fn new(
        inner: B,
        record: Option<Record>,
        log: Option<&Arc<AccessLog>>,
        slot: Option<crate::concurrency::Slot>,
        meter: Option<Box<Meter>>,
    ) -> Self {
        let line = match (record, log) {
            (Some(record), Some(log)) if log.wanted(record.outcome, record.client.as_ref()) => {
                Some((record, Arc::clone(log)))
            }
            _ => None,
        };
        let tail = (line.is_some() || slot.is_some() || meter.is_some())
            .then(|| Box::new(Tail { line, slot, meter }));
        Self { inner, tail }
    }
}

impl Tail {
    /// A frame went out.
    fn sent(&mut self, frame: &Frame<Bytes>) {
        if let (Some((record, _)), Some(data)) = (self.line.as_mut(), frame.data_ref()) {
            record.bytes_out += data.len() as u64;
        }
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.frame(frame);
        }
    }

    /// The answer went out whole.
    fn ended(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.ended();
        }
        self.finish(true);
    }

    /// The answer broke off on the way.
    fn broke(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.broke();
        }
        self.finish(false);
    }

    fn finish(&mut self, complete: bool) {
        if let Some((record, log)) = self.line.take() {
            let line = record.line(&log, complete);
            log.send(line);
        }
    }
}

impl<B: hyper::body::Body<Data = Bytes> + Unpin> hyper::body::Body for Logged<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let Some(tail) = this.tail.as_deref_mut() else {
            return polled;
        };
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                tail.sent(frame);
                if this.inner.is_end_stream() {
                    tail.ended();
                }
            }
            Poll::Ready(None) => tail.ended(),
            Poll::Ready(Some(Err(_))) => tail.broke(),
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

impl<B: hyper::body::Body> Drop for Logged<B> {
    fn drop(&mut self) {
        let Some(tail) = self.tail.as_deref_mut() else {
            return;
        };
        // An empty body may never be polled: its line is complete. (A meter
        // dropped before the end says the client left.)
        if self.inner.is_end_stream() {
            tail.ended();
        } else {
            tail.finish(false);
        }
    }
}
