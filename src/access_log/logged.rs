//! The access log's part in an answer's end: the request's line, written
//! once the answer has gone out whole, or when it is dropped before that
//! (the client went away), with the bytes that went out counted on the
//! way. The answer's other hooks (its concurrency slot, a usage meter) are
//! their owners'; gate holds them beside this one (`gate::hooks`).

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Frame;

use super::{AccessLog, Record};

/// A request's line in the access log, until it is written.
pub struct Line {
    record: Box<Record>,
    log: Arc<AccessLog>,
}

impl Line {
    /// `record`'s line in `log`, if the log wants it; None when it does
    /// not (or there is no log).
    pub fn of(record: Option<Box<Record>>, log: Option<&Arc<AccessLog>>) -> Option<Self> {
        match (record, log) {
            (Some(record), Some(log)) if log.wanted(record.outcome, record.client.as_ref()) => {
                Some(Self {
                    record,
                    log: Arc::clone(log),
                })
            }
            _ => None,
        }
    }

    /// A frame of the answer went out.
    pub fn sent(&mut self, frame: &Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.record.bytes_out += data.len() as u64;
        }
    }

    /// Writes the line: the answer went out whole (`complete`), or not.
    pub fn write(self, complete: bool) {
        let line = self.record.line(&self.log, complete);
        self.log.send(line);
    }
}
