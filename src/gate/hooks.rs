//! The hooks an answer's end is told to, besides the access log's line
//! (`access_log::watcher`): the request's concurrency slot and a usage
//! meter. Each is a hook of its own on the answer's body
//! (`response::Hooks`), none holding another; they are told here because
//! gate is where the answer, its slot and its meter meet (the owners sit
//! below `response` in the house and do not import it).

use bytes::Bytes;
use hyper::body::Frame;

use crate::concurrency::Slot;
use crate::response::Watcher;
use crate::usage::Meter;

/// A concurrency slot is held until the answer is done with: given back
/// when the body drops it, whatever it was told.
impl Watcher for Slot {
    fn sent(&mut self, _: &Frame<Bytes>) {}
    fn ended(&mut self) {}
    fn broke(&mut self) {}
    fn left(&mut self) {}
}

/// A usage meter reads every frame of the answer for the units it
/// reports. Dropped before the end, it settles as "the client left" by
/// itself.
impl Watcher for Meter {
    fn sent(&mut self, frame: &Frame<Bytes>) {
        self.frame(frame);
    }

    fn ended(&mut self) {
        Meter::ended(self);
    }

    fn broke(&mut self) {
        Meter::broke(self);
    }

    fn left(&mut self) {}
}
