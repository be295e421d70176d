//! Answers whose client leaves before their usage report: closed at once,
//! the reservation standing (`abandoned = "close"`), or read on without
//! the client within the route's bounds and settled to what they report
//! (`"drain"`).
//!
//! What a client can make floodgate hold stays bounded. Each answer read
//! on stops at `drain_time` or `drain_bytes`, whichever comes first, and
//! holds no byte of what it reads (the meter reads a stream in fixed
//! memory); at most `max_draining` answers of a route are read on at once
//! per instance, and a client leaving past that is closed at once (`full`)
//! like under `"close"`. A request read on keeps its concurrency slot
//! until then, since its upstream is still at work on it, and a stop
//! waits for it as for any settlement.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::BodyExt as _;

use super::metering::Metering;
use crate::in_flight;
use crate::response::Rest;
use crate::usage::settings::{Abandoned, Drain};
use crate::usage::{Abandonment, Meter, Tally};

/// What is done when the client of one metered answer leaves before its
/// report, and what was.
pub(super) struct Abandon {
    choice: Abandoned,
    metering: Arc<Metering>,
    tally: Arc<Tally>,
    settlements: Arc<in_flight::Count>,
    /// Counted once: what became of the answer.
    decided: bool,
    /// Once the answer is to be read on: within what bounds, and its place
    /// among the route's answers read on.
    reading: Option<(Drain, Draining)>,
}

/// A place among the answers of a route read on at once, held until the
/// reading ends; a stop waits for it.
pub(super) struct Draining {
    metering: Arc<Metering>,
    _counted: in_flight::Counted,
}

impl Drop for Draining {
    fn drop(&mut self) {
        self.metering.draining.fetch_sub(1, Ordering::AcqRel);
    }
}

// === impl Abandon ===

impl Abandon {
    /// The route's `choice` for an answer tallied in `tally`.
    pub(super) fn new(
        choice: Abandoned,
        metering: &Arc<Metering>,
        tally: &Arc<Tally>,
        settlements: &Arc<in_flight::Count>,
    ) -> Self {
        Self {
            choice,
            metering: Arc::clone(metering),
            tally: Arc::clone(tally),
            settlements: Arc::clone(settlements),
            decided: false,
            reading: None,
        }
    }

    /// The client left before the report: whether the answer is read on
    /// (a place among the route's answers read on taken: see
    /// [`Self::reading`]), or closed at once (`closed`, or `full`),
    /// counted.
    pub(super) fn read_on(&mut self) -> bool {
        let Abandoned::Drain(bounds) = self.choice else {
            self.counted(Abandonment::Closed);
            return false;
        };
        let taken = self
            .metering
            .draining
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < bounds.at_once).then_some(n + 1)
            });
        if taken.is_err() {
            self.counted(Abandonment::Full);
            return false;
        }
        let place = Draining {
            metering: Arc::clone(&self.metering),
            _counted: self.settlements.begin(),
        };
        self.reading = Some((bounds, place));
        true
    }

    /// The bounds and the place [`Self::read_on`] took, once.
    pub(super) fn reading(&mut self) -> Option<(Drain, Draining)> {
        self.reading.take()
    }

    /// The client left before the report and the answer was not read on:
    /// closed at once, unless already counted otherwise.
    pub(super) fn closed(&mut self) {
        self.counted(Abandonment::Closed);
    }

    /// Counts `outcome` and puts it on the request's log line, once.
    pub(super) fn counted(&mut self, outcome: Abandonment) {
        if std::mem::replace(&mut self.decided, true) {
            return;
        }
        self.metering.metrics.abandoned(outcome);
        self.tally.abandon(outcome);
    }
}

/// Reads `rest`, the answer its client left, into `meter` within
/// `bounds`, until the meter has the answer's report (or the answer said
/// it is over), the answer ends or breaks off, or a bound is reached.
/// The meter is told how the answer ended; at a bound it is not, and its
/// drop leaves the reservation standing.
pub(super) async fn read_on(meter: &mut Meter, rest: &mut Rest, bounds: Drain) -> Abandonment {
    let reading = async {
        let mut read = 0u64;
        loop {
            match rest.frame().await {
                None => {
                    meter.ended();
                    return Abandonment::Drained;
                }
                Some(Err(_)) => {
                    meter.broke();
                    return Abandonment::Broke;
                }
                Some(Ok(frame)) => {
                    read += frame.data_ref().map_or(0, |d| d.len() as u64);
                    meter.frame(&frame);
                    if !meter.awaits_report() {
                        return Abandonment::Drained;
                    }
                    if read >= bounds.bytes {
                        return Abandonment::Bound;
                    }
                }
            }
        }
    };
    tokio::time::timeout(bounds.time, reading)
        .await
        .unwrap_or(Abandonment::Bound)
}
