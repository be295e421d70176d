//! The access log's hook on an answer: it writes its request's line once
//! the answer has gone out whole, or when it is dropped before that (the
//! client went away), counting the bytes that went out on the way. The
//! answer's other hooks (its concurrency slot, a usage meter) are their
//! owners'; gate gives them to the body beside this one, the meter first,
//! so the line has the units.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Frame;

use super::{AccessLog, Record};
use crate::response::Watcher;

/// The hook that writes `record`'s line in `log`, if the log wants it;
/// None when it does not (or there is no log).
pub fn watcher(
    record: Option<Box<Record>>,
    log: Option<&Arc<AccessLog>>,
) -> Option<Box<dyn Watcher>> {
    match (record, log) {
        (Some(record), Some(log)) if log.wanted(record.outcome, record.client.as_ref()) => {
            Some(Box::new(Line(Some((record, Arc::clone(log))))))
        }
        _ => None,
    }
}

/// A request's line, until it is written.
struct Line(Option<(Box<Record>, Arc<AccessLog>)>);

impl Line {
    fn finish(&mut self, complete: bool) {
        if let Some((record, log)) = self.0.take() {
            let line = record.line(&log, complete);
            log.send(line);
        }
    }
}

impl Watcher for Line {
    fn sent(&mut self, frame: &Frame<Bytes>) {
        if let (Some((record, _)), Some(data)) = (self.0.as_mut(), frame.data_ref()) {
            record.bytes_out += data.len() as u64;
        }
    }

    fn ended(&mut self) {
        self.finish(true);
    }

    fn broke(&mut self) {
        self.finish(false);
    }

    fn left(&mut self) {
        self.finish(false);
    }
}
