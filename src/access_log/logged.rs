//! What watches an answer go out: it writes its request's line once the
//! answer has gone out whole, or when it is dropped before that (the
//! client went away), holds the request's concurrency slot until then,
//! and on a metered route shows the answer to its usage meter on the way
//! (one watcher for all three, in one box, so an answer pays for one
//! allocation, and an answer with none of them for none).

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Frame;

use super::{AccessLog, Record};
use crate::response::Watcher;
use crate::usage::Meter;

/// The watcher for an answer: `record`'s line in `log` if the log wants
/// it, `slot` held until the answer is done with, and the answer shown to
/// `meter` as it goes out (every frame, then its end, before the line is
/// written, so the line has the units). None when there is nothing to do.
pub fn watcher(
    record: Option<Box<Record>>,
    log: Option<&Arc<AccessLog>>,
    slot: Option<crate::concurrency::Slot>,
    meter: Option<Box<Meter>>,
) -> Option<Box<dyn Watcher>> {
    let line = match (record, log) {
        (Some(record), Some(log)) if log.wanted(record.outcome, record.client.as_ref()) => {
            Some((record, Arc::clone(log)))
        }
        _ => None,
    };
    if line.is_none() && slot.is_none() && meter.is_none() {
        return None;
    }
    Some(Box::new(Tail {
        line,
        _slot: slot,
        meter,
    }))
}

/// What an answer's body does beside being sent.
struct Tail {
    line: Option<(Box<Record>, Arc<AccessLog>)>,
    /// The request's concurrency slot, held for its drop: given back when
    /// the body is done with (dropped).
    _slot: Option<crate::concurrency::Slot>,
    /// Reads the answer for the units it reports, on a metered route.
    meter: Option<Box<Meter>>,
}

impl Tail {
    fn finish(&mut self, complete: bool) {
        if let Some((record, log)) = self.line.take() {
            let line = record.line(&log, complete);
            log.send(line);
        }
    }
}

impl Watcher for Tail {
    fn sent(&mut self, frame: &Frame<Bytes>) {
        if let (Some((record, _)), Some(data)) = (self.line.as_mut(), frame.data_ref()) {
            record.bytes_out += data.len() as u64;
        }
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.frame(frame);
        }
    }

    fn ended(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.ended();
        }
        self.finish(true);
    }

    fn broke(&mut self) {
        if let Some(meter) = self.meter.as_deref_mut() {
            meter.broke();
        }
        self.finish(false);
    }

    fn left(&mut self) {
        // A meter dropped before the end says the client left.
        self.finish(false);
    }
}
