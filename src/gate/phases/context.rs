//! What the phases know of one request beside its head and body (its
//! [`Context`], passed from phase to phase, and the [`Found`] route), and
//! the log phase: a refusal counted and made into its answer, and every
//! answer watched until it has gone out (its access log line written
//! then, its concurrency slot held until then, a metered answer's report
//! read on the way).

use http::Response;

use crate::access_log::{Line, Record};
use crate::concurrency::Slot;
use crate::gate::by_answer::ByAnswer;
use crate::gate::drain::Abandon;
use crate::gate::hooks::{AnswerEnd, Metered};
use crate::gate::metering::Reservation;
use crate::gate::shared::Shared;
use crate::proxy::{Body, Peer};
use crate::refusal::Refusal;
use crate::routes::Route;
use crate::usage::Unreported;

/// What the phases know of one request beside its head and body.
pub(super) struct Context<'a> {
    pub(super) shared: &'a Shared,
    pub(super) peer: &'a Peer,
    /// Answers go out as gRPC statuses.
    pub(super) grpc: bool,
    /// The access log's record, when the log is on (boxed: every
    /// request's future carries the field, and the record is large).
    pub(super) log: Option<Box<Record>>,
    /// The concurrency slot, once the answer is ready to go out.
    pub(super) slot: Option<Slot>,
    /// On a metered route, the admitted request's reservation until it is
    /// settled (boxed: every request's future carries the field).
    pub(super) reservation: Option<Box<Reservation>>,
    /// On a route that counts by the answer, the admitted request's units
    /// until the answer says which limits keep them.
    pub(super) by_answer: Option<Box<ByAnswer>>,
    /// On a route whose limits hold requests (`delay`), the request's
    /// place among the held, from before the decision until its wait ends
    /// (boxed: every request's future carries the field).
    pub(super) place: Option<Box<crate::gate::held::Place<'a>>>,
}

/// The route a request is on.
pub(super) struct Found<'r> {
    /// Its position in the table (and in the side tables).
    pub(super) index: usize,
    pub(super) route: &'r Route,
}

// === impl Context ===

impl<'a> Context<'a> {
    /// A request's context from `peer`, its access log record begun (when
    /// the log is on) with the request line and the body's size if known.
    pub(super) fn new(
        shared: &'a Shared,
        peer: &'a Peer,
        grpc: bool,
        method: &http::Method,
        uri: &http::Uri,
        version: http::Version,
        bytes_in: Option<u64>,
    ) -> Self {
        Self {
            shared,
            peer,
            grpc,
            log: shared
                .access_log
                .as_ref()
                .map(|_| Box::new(Record::begin(method, uri, version, peer.addr, bytes_in))),
            slot: None,
            reservation: None,
            by_answer: None,
            place: None,
        }
    }
}

impl Context<'_> {
    /// A refusal counted and made into its answer. A reservation made
    /// for the request stands.
    pub(super) fn refused(&mut self, refusal: Refusal) -> Response<Body> {
        self.shared.metrics.refused(&refusal);
        if let Some(reservation) = self.reservation.take() {
            reservation.stood(if refusal.fault() == crate::refusal::Fault::Upstream {
                Unreported::UpstreamFailed
            } else {
                Unreported::ClientLeft
            });
        }
        if self.grpc {
            refusal.into_grpc_response()
        } else {
            refusal.into_response()
        }
    }

    /// Where the answer is one floodgate made itself (a refusal) on a
    /// route that counts by the answer, what the decision took settled by
    /// it: the task giving back the units of the limits it does not count,
    /// for the caller to await before the answer goes out (so the client's
    /// next request meets the limit as it stands, as after an upstream's
    /// answer).
    pub(super) fn settle_by_answer(
        &mut self,
        response: &Response<Body>,
    ) -> Option<tokio::task::JoinHandle<()>> {
        let answer = (response.status().as_u16(), response.headers());
        self.by_answer.take()?.settle_apart(
            answer,
            &self.shared.limiter,
            &self.shared.settlements,
            &self.shared.metrics,
        )
    }

    /// The answer with its hooks: on a metered route whose answer reports
    /// in its body, read for the report on the way (first, so the log line
    /// has the units); the access log line written once it has gone out;
    /// the slot held until then.
    pub(super) fn logged(mut self, mut response: Response<Body>) -> Response<Body> {
        let mut record = self.log.take();
        if let Some(r) = record.as_mut() {
            r.status(response.status().as_u16());
        }
        let slot = self.slot.take();
        let log = self.shared.access_log.as_ref();
        let reservation = self.reservation.take();
        let limiter = &self.shared.limiter;
        let settlements = &self.shared.settlements;
        let meter = reservation.map(|r| {
            let event_stream = crate::proxy::is_event_stream(response.headers());
            let abandon = Abandon::new(r.settings.abandoned, &r.metering, &r.tally, settlements);
            let (meter, unasked) = r.meter(
                limiter,
                settlements,
                event_stream,
                response.status().as_u16(),
            );
            if unasked.is_some() {
                // The client receives fewer bytes than the upstream sent.
                response.headers_mut().remove(http::header::CONTENT_LENGTH);
            }
            Metered {
                meter,
                unasked,
                abandon,
            }
        });
        let hooks = AnswerEnd::of(meter, Line::of(record, log), slot);
        response.body_mut().watch(hooks);
        response
    }
}
