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
pub struct Logged<B: hyper::body::Body> {
    inner: B,
    line: Option<(Box<Record>, Arc<AccessLog>)>,
    /// The request's concurrency slot, given back when the body is done
    /// with (dropped).
    slot: Option<crate::concurrency::Slot>,
    /// Reads the answer for the units it reports, on a metered route.
    meter: Option<Box<Meter>>,
}

impl<B: hyper::body::Body + std::fmt::Debug> std::fmt::Debug for Logged<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Logged")
            .field("inner", &self.inner)
            .field("line", &self.line)
            .field("slot", &self.slot)
            .field("metered", &self.meter.is_some())
            .finish()
    }
}

impl<B: hyper::body::Body> Logged<B> {
    /// `inner`, logged as `record` in `log` if the log wants its line.
    pub fn new(inner: B, record: Option<Record>, log: Option<&Arc<AccessLog>>) -> Self {
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
            meter: None,
        }
    }

    /// Shows the answer to `meter` as it goes out: every frame, then its
    /// end (before the line is written, so the line has the units).
    pub fn metering(mut self, meter: Option<Box<Meter>>) -> Self {
        self.meter = meter;
        self
    }

    /// Holds `slot` until the body is done with.
    pub fn holding(mut self, slot: Option<crate::concurrency::Slot>) -> Self {
        self.slot = slot;
        self
    }

    /// The answer went out whole.
    fn ended(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.ended();
        }
        self.finish(true);
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
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some((record, _)), Some(data)) = (this.line.as_mut(), frame.data_ref()) {
                    record.bytes_out += data.len() as u64;
                }
                if let Some(meter) = this.meter.as_deref_mut() {
                    meter.frame(frame);
                }
                if this.inner.is_end_stream() {
                    this.ended();
                }
            }
            Poll::Ready(None) => this.ended(),
            Poll::Ready(Some(Err(_))) => {
                if let Some(meter) = this.meter.as_deref_mut() {
                    meter.broke();
                }
                this.finish(false);
            }
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
        // An empty body may never be polled: its line is complete. (A meter
        // dropped before the end says the client left.)
        if self.inner.is_end_stream() {
            self.ended();
        } else {
            self.finish(false);
        }
    }
}
