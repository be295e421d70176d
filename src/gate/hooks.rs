//! What an answer's end is told to: each part that waits for the answer
//! to go out is a field of [`AnswerEnd`], owned by gate, which is where the
//! answer, its slot, its meter and its log line meet (their owners sit
//! below `response` and do not know one another). A part that comes next
//! is a field more; the answer still pays one box for all of them, and an
//! answer with none of them nothing.

use bytes::Bytes;
use hyper::body::Frame;

use crate::access_log::Line;
use crate::concurrency::Slot;
use crate::response::Watcher;
use crate::usage::Meter;
use crate::usage::unasked::UnaskedUsage;

/// An answer's end hooks, told in order: the usage meter first (so the
/// log line has the units), then the access log's line. Dropped in field
/// order: the line (written by then), the slot (given back), the meter
/// (which settles by itself if the body never ended: see `Meter`'s drop),
/// as when the access log held all three.
pub(super) struct AnswerEnd {
    /// Written once the answer has gone out, or the client left.
    line: Option<Line>,
    /// The request's concurrency slot, held until the body is done with.
    _slot: Option<Slot>,
    /// Reads the answer for the units it reports, on a metered route.
    meter: Option<Box<Meter>>,
    /// Takes the usage event the client did not ask for out of the answer
    /// (the meter reads it first).
    unasked: Option<Box<UnaskedUsage>>,
}

impl AnswerEnd {
    /// The hooks for an answer; None when there is nothing to watch for.
    pub(super) fn of(
        meter: Option<(Box<Meter>, Option<Box<UnaskedUsage>>)>,
        line: Option<Line>,
        slot: Option<Slot>,
    ) -> Option<Box<dyn Watcher>> {
        if meter.is_none() && line.is_none() && slot.is_none() {
            return None;
        }
        let (meter, unasked) = meter.map_or((None, None), |(m, u)| (Some(m), u));
        Some(Box::new(Self {
            line,
            _slot: slot,
            meter,
            unasked,
        }))
    }

    fn write_line(&mut self, complete: bool) {
        if let Some(line) = self.line.take() {
            line.write(complete);
        }
    }
}

impl Watcher for AnswerEnd {
    fn edit(&mut self, frame: Frame<Bytes>) -> Option<Frame<Bytes>> {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.frame(&frame);
        }
        let Some(unasked) = self.unasked.as_deref_mut() else {
            return Some(frame);
        };
        match frame.into_data() {
            Ok(data) => unasked.edit(data).map(Frame::data),
            Err(frame) => Some(frame),
        }
    }

    fn held(&mut self) -> Option<Bytes> {
        self.unasked.as_deref_mut().and_then(UnaskedUsage::held)
    }

    fn edits(&self) -> bool {
        self.unasked.is_some()
    }

    fn sent(&mut self, frame: &Frame<Bytes>) {
        if let Some(line) = self.line.as_mut() {
            line.sent(frame);
        }
    }

    fn ended(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.ended();
        }
        self.write_line(true);
    }

    fn broke(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.broke();
        }
        self.write_line(false);
    }

    fn left(&mut self) {
        // The meter, dropped before the body's end, settles by itself.
        self.write_line(false);
    }
}
