//! What an answer's end is told to: each part that waits for the answer
//! to go out is a field of [`AnswerEnd`], owned by gate, which is where the
//! answer, its slot, its meter and its log line meet (their owners sit
//! below `response` and do not know one another). A part that comes next
//! is a field more; the answer still pays one box for all of them, and an
//! answer with none of them nothing.

use bytes::Bytes;
use hyper::body::Frame;

use super::drain::{self, Abandon, Draining};
use crate::access_log::Line;
use crate::concurrency::Slot;
use crate::response::{Rest, Watcher};
use crate::usage::Meter;
use crate::usage::settings::Drain;
use crate::usage::unasked::UnaskedUsage;

/// What reads a metered answer's body for its report.
pub(super) struct Metered {
    /// Reads the body for the units it reports.
    pub(super) meter: Box<Meter>,
    /// Takes the usage event the client did not ask for out of the body.
    pub(super) unasked: Option<Box<UnaskedUsage>>,
    /// What is done when the client leaves before the report.
    pub(super) abandon: Abandon,
}

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
    /// With the meter: what is done when the client leaves before the
    /// report.
    abandon: Option<Abandon>,
}

impl AnswerEnd {
    /// The hooks for an answer; None when there is nothing to watch for.
    pub(super) fn of(
        metered: Option<Metered>,
        line: Option<Line>,
        slot: Option<Slot>,
    ) -> Option<Box<dyn Watcher>> {
        if metered.is_none() && line.is_none() && slot.is_none() {
            return None;
        }
        let (meter, unasked, abandon) = match metered {
            Some(m) => (Some(m.meter), m.unasked, Some(m.abandon)),
            None => (None, None, None),
        };
        Some(Box::new(Self {
            line,
            _slot: slot,
            meter,
            unasked,
            abandon,
        }))
    }

    /// The meter and what is done if its report is abandoned, while the
    /// report is still to come.
    fn awaiting(&mut self) -> Option<(&mut Meter, &mut Abandon)> {
        match (self.meter.as_deref_mut(), self.abandon.as_mut()) {
            (Some(meter), Some(abandon)) if meter.awaits_report() => Some((meter, abandon)),
            _ => None,
        }
    }

    /// Reads the answer its client left on, within the route's bounds,
    /// holding `place` among the route's answers read on; then settles
    /// (or lets the reservation stand) and writes the line with what
    /// became of it.
    async fn read_on(mut self: Box<Self>, mut rest: Rest, bounds: Drain, place: Draining) {
        if let Some((meter, abandon)) = self.awaiting() {
            let outcome = drain::read_on(meter, &mut rest, bounds).await;
            abandon.counted(outcome);
            // Settled (or standing) now, so that the line has the units;
            // the settlement is counted before the place is given up, so
            // that a stop waiting for both never sees none in between.
            meter.stopped();
        }
        drop(rest);
        self.write_line(false);
        drop(place);
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
        if let Some((_, abandon)) = self.awaiting() {
            abandon.closed();
        }
        // The meter, dropped before the body's end, settles by itself.
        self.write_line(false);
    }

    fn wants_rest(&mut self) -> bool {
        let Some((_, abandon)) = self.awaiting() else {
            return false;
        };
        abandon.read_on()
    }

    fn rest(mut self: Box<Self>, rest: Rest) {
        let reading = self.abandon.as_mut().and_then(Abandon::reading);
        let (Some((bounds, place)), Ok(runtime)) = (reading, tokio::runtime::Handle::try_current())
        else {
            self.left();
            return;
        };
        runtime.spawn(self.read_on(rest, bounds, place));
    }
}
