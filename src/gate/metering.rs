//! Routes whose cost is what their upstream reports: the reservation is
//! the decision's cost, and once the answer reports its units the
//! difference is settled in the same keys. A header report is settled
//! before the answer's head goes out (its `RateLimit` fields show the
//! settled charge); a trailer, JSON or event-stream report when the body
//! ends, in a task of its own (the fields show the reservation). When
//! nothing is reported the reservation stands, counted by reason and
//! logged at most once every ten seconds per route. A stop waits for the
//! settlements in flight (counted in [`Shared`]'s [`in_flight::Count`]),
//! so that a deploy does not leave its last requests charged their whole
//! reservation.
//!
//! [`Shared`]: super::Shared

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use http::HeaderMap;
use hyper::body::Incoming;

use crate::client::ClientId;
use crate::clock::now_ms;
use crate::in_flight;
use crate::limit::{Charge, CountKey, Decision, Limit, Limiter, Settlement};
use crate::metrics::UsageMetrics;
use crate::proxy::request_body::{RequestBody, Sent};
use crate::proxy::{ClientSide, Forwarder};
use crate::refusal::Refusal;
use crate::usage::settings::{READ_FIRST, Settings, Source};
use crate::usage::unasked::UnaskedUsage;
use crate::usage::{BodyRead, Meter, OnReport, Tally, Unreported, from_headers, named_in_json};

/// The request's body: as it arrived, or with its first bytes read for a
/// reservation named in it.
pub(super) enum ClientBody {
    Arrived(Incoming),
    Read(RequestBody, Option<Arc<Sent>>),
}

/// On a route whose reservation may be named in the request's JSON body
/// (`usage`), the body's first bytes, read before the decision under the
/// client's limits `client` (its faults meanwhile are its refusals), and
/// what they name.
///
/// With `stream_include_usage`, a streaming request read whole is asked to
/// report its usage (see [`crate::usage::asking_for_usage`]), and its
/// `Content-Length` in `headers` follows; the answer's usage event is then
/// taken out of what the client receives (see [`Reservation::meter`]).
pub(super) async fn read_first(
    forwarder: &Forwarder,
    client: ClientSide,
    usage: &Settings,
    body: Incoming,
    headers: &mut HeaderMap,
) -> Result<(ClientBody, Option<BodyRead>), Refusal> {
    let (mut read, sent) = RequestBody::new(body, &client);
    forwarder.read_first(&mut read, READ_FIRST).await?;
    let mut usage_unasked = false;
    if usage.stream_include_usage && read.read_whole() {
        let whole: Vec<u8> = read.read().flat_map(|b| b.iter().copied()).collect();
        if let Some(asking) = crate::usage::asking_for_usage(&whole) {
            let length = http::HeaderValue::from(asking.len());
            usage_unasked = read.replace_read(asking);
            if usage_unasked && headers.contains_key(http::header::CONTENT_LENGTH) {
                headers.insert(http::header::CONTENT_LENGTH, length);
            }
        }
    }
    let named = BodyRead {
        len: read.read().map(|b| b.len() as u64).sum(),
        named: named_in_json(usage, read.read()),
        whole: read.read_whole(),
        usage_unasked,
    };
    Ok((ClientBody::Read(read, sent), Some(named)))
}

/// How often a route logs that reservations stood.
const LOG_EVERY_MS: u64 = 10_000;

/// A metered route's live side: its counters and when it last logged.
#[derive(Debug)]
pub struct Metering {
    pub metrics: UsageMetrics,
    last_logged: AtomicU64,
    /// Answers of the route read on after their client left.
    pub(super) draining: AtomicUsize,
}

impl Metering {
    /// The side of a route counting into `metrics`.
    pub fn new(metrics: UsageMetrics) -> Self {
        Self {
            metrics,
            last_logged: AtomicU64::new(0),
            draining: AtomicUsize::new(0),
        }
    }
}

/// One admitted request's reservation, until it is settled or stands.
pub(super) struct Reservation {
    pub(super) settings: Arc<Settings>,
    pub(super) tally: Arc<Tally>,
    pub(super) metering: Arc<Metering>,
    settlement: Settlement,
    route: Arc<str>,
    client: ClientId,
    limits: Box<[Limit]>,
    keys: Box<[CountKey]>,
    /// The answer's status, once known.
    status: u16,
    /// floodgate asked the upstream for the stream's usage, the client
    /// did not: the usage event is read, then taken out of the answer.
    pub(super) usage_unasked: bool,
}

impl Reservation {
    /// The reservation `charge` took when `decision` admitted it.
    pub(super) fn new(
        settings: &Arc<Settings>,
        metering: &Arc<Metering>,
        charge: &Charge<'_>,
        decision: &Decision,
    ) -> Self {
        metering.metrics.reserved.inc_by(charge.cost);
        Self::resumed(settings, metering, charge, decision.at_ms, decision.local)
    }

    /// The reservation of `charge` decided at `at_ms` (in this instance's
    /// memory when `local`), not counted as reserved again: what
    /// [`Self::new`] makes, and what a front proxy names back for its
    /// settlement (see [`Self::token`]), its request identified again.
    pub(super) fn resumed(
        settings: &Arc<Settings>,
        metering: &Arc<Metering>,
        charge: &Charge<'_>,
        at_ms: u64,
        local: bool,
    ) -> Self {
        Self {
            settings: Arc::clone(settings),
            tally: Arc::new(Tally::new(charge.cost)),
            metering: Arc::clone(metering),
            settlement: Settlement {
                at_ms,
                reserved: charge.cost,
                local,
                kind: crate::limit::Settled::Reservation,
            },
            route: Arc::clone(charge.route),
            client: charge.client.clone(),
            limits: charge.limits.into(),
            keys: charge.keys.into(),
            status: 0,
            usage_unasked: false,
        }
    }

    /// How a front proxy names this reservation back to floodgate to have
    /// it settled: `ROUTE:AT_MS:RESERVED`, and `:local` when it was
    /// decided in this instance's memory while the store was down.
    pub(super) fn token(&self) -> String {
        let local = if self.settlement.local { ":local" } else { "" };
        format!(
            "{}:{}:{}{local}",
            self.route, self.settlement.at_ms, self.settlement.reserved
        )
    }

    /// Whether the answer reports its units in its head.
    pub(super) fn reported_in_head(&self) -> bool {
        self.settings.source == Source::Header
    }

    /// Settles to the units the answer's head `headers` (of an answer of
    /// `status`) reports: the
    /// settled decision for its `RateLimit` fields, or `None` when the
    /// reservation stands.
    pub(super) async fn settle_from_head(
        mut self,
        status: u16,
        limiter: &Limiter,
        headers: &HeaderMap,
    ) -> Option<Decision> {
        self.status = status;
        let report = from_headers(&self.settings, headers).ok_or(Unreported::Missing);
        if let Ok(units) = report {
            self.tally.report(units);
        }
        self.settle(limiter, report).await
    }

    /// The meter that reads the answer's body for the units it reports as
    /// it goes out; settled in a task of its own when it ends (or standing
    /// when it breaks off or the client leaves). With it, on an event
    /// stream whose usage the client did not ask for, what takes the
    /// usage event out of the answer.
    /// `event_stream`: the answer is a `text/event-stream` (what a
    /// `json_or_sse` report reads); `status`: the answer's.
    pub(super) fn meter(
        mut self,
        limiter: &Arc<Limiter>,
        settlements: &Arc<in_flight::Count>,
        event_stream: bool,
        status: u16,
    ) -> (Box<Meter>, Option<Box<UnaskedUsage>>) {
        self.status = status;
        let unasked = (self.usage_unasked && event_stream).then(Box::default);
        let (settings, tally) = (Arc::clone(&self.settings), Arc::clone(&self.tally));
        let limiter = Arc::clone(limiter);
        let settlements = Arc::clone(settlements);
        let done: OnReport = Box::new(move |report| {
            // Bodies end (or are dropped) on the runtime that serves them.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let counted = settlements.begin();
                    runtime.spawn(async move {
                        self.settle(&limiter, report).await;
                        drop(counted);
                    });
                }
                Err(_) => self.stood(Unreported::StoreFailed),
            }
        });
        (
            Box::new(Meter::new(settings, tally, done, event_stream)),
            unasked,
        )
    }

    /// Settles the reservation to `report`'s units: the settled decision,
    /// or `None` when the reservation stands.
    pub(super) async fn settle(
        self,
        limiter: &Limiter,
        report: Result<u64, Unreported>,
    ) -> Option<Decision> {
        let metrics = &self.metering.metrics;
        let units = match (report, &self.settings.failed) {
            (Ok(units), _) => {
                metrics.reported.inc_by(units);
                units
            }
            (Err(Unreported::Missing), Some(failed)) if failed.statuses.contains(&self.status) => {
                // Settled, not standing: counted, not warned about.
                metrics.unreported(Unreported::FailedAnswer);
                failed.charge
            }
            (Err(why), _) => {
                self.stood(why);
                return None;
            }
        };
        let reserved = self.settlement.reserved;
        if units < reserved {
            metrics.refunded.inc_by(reserved - units);
        } else {
            metrics.charged_over.inc_by(units - reserved);
        }
        let charge = Charge {
            route: &self.route,
            client: &self.client,
            limits: &self.limits,
            keys: &self.keys,
            cost: units,
            settle: Some(self.settlement),
        };
        match limiter.settle(charge).await {
            Ok(decision) => Some(decision),
            Err(e) => {
                self.stood_because(Unreported::StoreFailed, &e.to_string());
                None
            }
        }
    }

    /// Nothing was settled: the reservation is the charge.
    pub(super) fn stood(&self, why: Unreported) {
        self.stood_because(why, why.explained());
    }

    fn stood_because(&self, why: Unreported, error: &str) {
        let metering = &self.metering;
        metering.metrics.unreported(why);
        let now = now_ms();
        let last = metering.last_logged.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= LOG_EVERY_MS
            && metering
                .last_logged
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                route = %self.route,
                reason = why.name(),
                reserved = self.settlement.reserved,
                error,
                "usage not settled: the reservation stands as the charge"
            );
        }
    }
}

/// A reservation as a front proxy names it back (see
/// [`Reservation::token`]).
pub(super) struct Token {
    pub(super) route: Box<str>,
    pub(super) at_ms: u64,
    pub(super) reserved: u64,
    pub(super) local: bool,
}

impl Token {
    /// `ROUTE:AT_MS:RESERVED`, and `:local` (see `Reservation::token`).
    pub(super) fn parse(text: &str) -> Option<Self> {
        let mut parts = text.split(':');
        let route = parts.next().filter(|r| !r.is_empty())?;
        let at_ms = parts.next()?.parse().ok()?;
        let reserved = parts.next()?.parse().ok()?;
        let local = match parts.next() {
            None => false,
            Some("local") => true,
            Some(_) => return None,
        };
        parts.next().is_none().then(|| Self {
            route: route.into(),
            at_ms,
            reserved,
            local,
        })
    }
}
