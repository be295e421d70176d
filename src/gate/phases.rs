//! One request's phases, in order:
//!
//! head → route → admit body → identify → reserve → decide → forward (or
//! the route's own answer) → annotate → log.
//!
//! Each phase is a function of its own (identify, the longest, in
//! `phases/identify.rs`); what they learn of the request travels in one
//! [`Context`]. A phase that ends the request early returns
//! the [`Refusal`] (or, for a denial, the 429) that answers it; every
//! answer goes out watched by the access log's watcher where there is
//! anything to watch for, which also holds the request's concurrency slot
//! until the answer is sent.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::metering::{ClientBody, Reservation, read_first};
use super::rules::Rules;
use super::shared::Shared;
use crate::access_log::{Record, watcher};
use crate::client::ClientId;
use crate::concurrency::{Capacity, Per, Slot};
use crate::limit::{Answer, Charge, Decision};
use crate::metrics::Outcome;
use crate::proxy::request_body::RequestBody;
use crate::proxy::{Body, ClientSide, Peer};
use crate::refusal::Refusal;
use crate::response;
use crate::routes::{Action, Policy, RequestFacts, Route, Upstream, request_paths};
use crate::usage::{BodyRead, Unreported};

mod decision;
mod identify;
pub mod operator;
mod rls;
mod standing;

pub use decision::decide;
use identify::Identity;

/// Longest request target (path and query) accepted; past it 414.
const MAX_URI_BYTES: usize = 8 * 1024;

/// What the phases know of one request beside its head and body.
struct Context<'a> {
    shared: &'a Shared,
    peer: &'a Peer,
    /// Answers go out as gRPC statuses.
    grpc: bool,
    /// The access log's record, when the log is on (boxed: every
    /// request's future carries the field, and the record is large).
    log: Option<Box<Record>>,
    /// The concurrency slot, once the answer is ready to go out.
    slot: Option<Slot>,
    /// On a metered route, the admitted request's reservation until it is
    /// settled (boxed: every request's future carries the field).
    reservation: Option<Box<Reservation>>,
}

/// The route a request is on.
struct Found<'r> {
    /// Its position in the table (and in the side tables).
    index: usize,
    route: &'r Route,
}

/// Where an allowed request goes, and the slot it holds on the way.
struct Exchange<'a> {
    upstream: &'a Upstream,
    /// The path and query sent upstream.
    target: PathAndQuery,
    slot: Option<&'a Slot>,
}

/// The limits a request falls under: as compiled with the rules (the
/// route's, its plan's or an override's), or made for this request (the
/// numbers its token carries). A pointer either way: the decide phase's
/// results are moved between its steps, and a policy is large.
enum Limits<'r> {
    Compiled(&'r Policy),
    ForRequest(Box<Policy>),
}

impl std::ops::Deref for Limits<'_> {
    type Target = Policy;

    fn deref(&self) -> &Policy {
        match self {
            Self::Compiled(policy) => policy,
            Self::ForRequest(policy) => policy,
        }
    }
}

/// What the decide phase concluded for a request that goes on.
type Allowed<'r> = Option<(Decision, Limits<'r>)>;

/// The decide phase's end: `Ok(Ok)` with what the request goes on with,
/// `Ok(Err)` with the denial that answers it (boxed: the phase's result
/// is moved between its steps, and an answer is large), or the refusal (a
/// malformed reservation, a store down that `on_error` closes on).
type Decided<'r> = Result<Result<Allowed<'r>, Box<Response<Body>>>, Refusal>;

/// The store's answer concluded: the decision to annotate the answer
/// with (none when the store was unavailable), or the denial.
type Concluded = Result<Result<Option<Decision>, Box<Response<Body>>>, Refusal>;

/// The decide phase as far as it goes without waiting: done, or a
/// question for the shared store (whose count, under which policy, for how
/// many units).
enum Deciding<'r, 'w> {
    Done(Decided<'r>),
    Ask {
        client: &'w ClientId,
        keys: &'w [crate::limit::CountKey],
        policy: Limits<'r>,
        cost: u64,
    },
}

/// A concluded decision with the `policy` it was made under, for the
/// answer's `RateLimit` fields.
fn with_policy(concluded: Concluded, policy: Limits<'_>) -> Decided<'_> {
    match concluded {
        Ok(Ok(decision)) => Ok(Ok(decision.map(|d| (d, policy)))),
        Ok(Err(denial)) => Ok(Err(denial)),
        Err(refusal) => Err(refusal),
    }
}

/// What a request on `route` asks of the store for `client`: `cost` units
/// from every limit of `policy`, counted as `keys` say.
fn charge<'c>(
    route: &'c Route,
    client: &'c ClientId,
    policy: &'c Policy,
    keys: &'c [crate::limit::CountKey],
    cost: u64,
) -> Charge<'c> {
    Charge {
        route: &route.name,
        client,
        limits: &policy.limits,
        keys,
        cost,
        settle: None,
    }
}

/// A client connection as the request phases see it: what every request
/// needs, the client, and a mark kept on it while a request is in flight.
/// The server's connections are one; the phases take them whole, so that
/// a request's future is the service's own, not one more layer inside it.
pub trait Connection: Send + Sync + 'static {
    /// Kept while a request is in flight.
    type Busy<'a>: Send
    where
        Self: 'a;
    /// What every request needs.
    fn shared(&self) -> &Shared;
    /// The client at the other end.
    fn peer(&self) -> &Peer;
    /// Marks a request in flight until the mark is dropped.
    fn begin(&self) -> Self::Busy<'_>;
}

/// One request on `connection`: every phase in order, then the log. Every
/// answer floodgate makes itself is counted by status and fault. An
/// upgraded connection's tunnel holds the connection until it ends.
pub async fn handle<C: Connection>(
    connection: Arc<C>,
    request: Request<Incoming>,
) -> Result<Response<Body>, std::convert::Infallible> {
    let _busy = connection.begin();
    let (shared, peer) = (connection.shared(), connection.peer());
    let grpc = response::is_grpc(request.headers());
    let bytes_in = hyper::body::Body::size_hint(request.body()).exact();
    let mut cx = Context::new(
        shared,
        peer,
        grpc,
        request.method(),
        request.uri(),
        request.version(),
        bytes_in,
    );
    let hold = || Arc::clone(&connection);
    // The answer is made once, here, and lent to the phases that add to
    // it: moved out through each layer on its way back, it was copied at
    // every one.
    let mut out = None;
    let refused = answer(&mut cx, request, hold, &mut out).await.err();
    let response = match (refused, out) {
        (None, Some(response)) => response,
        (Some(refusal), _) => cx.refused(refusal),
        // Not made: `answer` fills `out` whenever it returns `Ok`.
        (None, None) => cx.refused(Refusal::upstream(
            StatusCode::BAD_GATEWAY,
            "no answer was made for the request",
        )),
    };
    Ok(cx.logged(response))
}

/// The phases from head to annotate: the answer, written into `out`, or
/// what floodgate answers instead.
async fn answer<H: Send + 'static>(
    cx: &mut Context<'_>,
    request: Request<Incoming>,
    hold: impl FnOnce() -> H,
    out: &mut Option<Response<Body>>,
) -> Result<(), Refusal> {
    // Taken apart once: the head is lent, not moved, on its way upstream.
    let (mut head, body) = request.into_parts();
    let host = check_head(&head)?;
    let rules = cx.shared.rules.load_full();
    let (forward_path, matched_path) = request_paths(head.uri.path(), rules.escaped_slashes)?;
    let found = cx.route(&rules, &head, host, &matched_path)?;
    if let Action::Decide = found.route.action {
        return Err(decided_elsewhere(found.route));
    }
    admit_body(found.route, &body)?;
    let who = cx.identify(&rules, &found, &mut head.headers, &matched_path)?;
    // A route without a cap awaits nothing here.
    let slot = match rules.capacity.get(found.index).and_then(Option::as_ref) {
        Some(capacity) => reserve(capacity, &found, &who).await?,
        None => None,
    };
    // Boxed, as the rare path: every request's future would carry it.
    let (body, read) = match found
        .route
        .usage
        .as_ref()
        .filter(|u| u.reserve_json.is_some() || u.stream_include_usage)
    {
        Some(usage) => {
            let client_side = ClientSide {
                max_body: found.route.max_request_body,
                ..rules.client_timeouts
            };
            let headers = &mut head.headers;
            Box::pin(read_first(
                &cx.shared.forwarder,
                client_side,
                usage,
                body,
                headers,
            ))
            .await?
        }
        None => (ClientBody::Arrived(body), None),
    };
    // The memory store decides at once, without a future; the shared
    // store's is boxed, as the rare path for every request's future. (In a
    // block of its own: the identity is gone before forwarding.)
    let decided = {
        let mut who = who;
        cx.decided(&rules, &found, &mut who, &head.headers, read)
            .await
    };
    let allowed = match decided? {
        Ok(allowed) => allowed,
        Err(denial) => {
            *out = Some(*denial);
            return Ok(());
        }
    };
    let response = match &found.route.action {
        Action::Respond(r) => out.insert(response::respond(r)),
        // Boxed, as the rare path.
        Action::Standing(names) => out
            .insert(Box::pin(cx.standing(&rules, names, &mut head.headers, &matched_path)).await?),
        Action::Decide => return Err(decided_elsewhere(found.route)),
        Action::Upstream(upstream) => {
            let forward_path = match found.route.stripped(&forward_path) {
                Some(rest) => Cow::Owned(rest.to_owned()),
                None => forward_path,
            };
            let target = forwarded_target(forward_path, &head.uri)?;
            let exchange = Exchange {
                upstream,
                target,
                slot: slot.as_ref(),
            };
            cx.forward(&rules, &found, exchange, &mut head, body, hold, out)
                .await?
        }
    };
    let settled = match cx.reservation.take_if(|r| r.reported_in_head()) {
        Some(reservation) => {
            let limiter = &cx.shared.limiter;
            // Boxed, as the rare path.
            let status = response.status().as_u16();
            Box::pin(reservation.settle_from_head(status, limiter, response.headers())).await
        }
        None => None,
    };
    if let Some((d, policy)) = &allowed {
        let d = settled.as_ref().unwrap_or(d);
        response::annotate(response.headers_mut(), found.route, policy, d);
    }
    // The answer's body holds the slot until it is sent (an upgraded
    // connection's tunnel holds a clone); refusals and denials drop it
    // when this returns.
    cx.slot = slot;
    Ok(())
}

// === head ===

/// The head has one meaning and a target of bounded length; its host.
fn check_head(head: &Parts) -> Result<Option<&str>, Refusal> {
    if head
        .uri
        .path_and_query()
        .is_some_and(|pq| pq.as_str().len() > MAX_URI_BYTES)
    {
        return Err(Refusal::client(
            StatusCode::URI_TOO_LONG,
            "the request target is longer than 8 KiB",
        ));
    }
    Ok(crate::head::check(head)?)
}

/// A route only decided for front proxies, reached on the proxy
/// listener: 404, nothing counted.
fn decided_elsewhere(route: &Route) -> Refusal {
    Refusal::client(
        StatusCode::NOT_FOUND,
        format!(
            "route \"{}\" is only decided for front proxies, on the decision listener",
            route.name
        ),
    )
}

// === admit body ===

/// A body declared larger than the route forwards is refused before
/// anything else is spent on it; one that grows too large on the way is
/// cut (`proxy::request_body`).
fn admit_body(route: &Route, body: &Incoming) -> Result<(), Refusal> {
    if let (Action::Upstream(_), Some(max)) = (&route.action, route.max_request_body)
        && hyper::body::Body::size_hint(body).lower() > max
    {
        return Err(Refusal::client(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is larger than this route's max_request_body of {max} bytes"),
        ));
    }
    Ok(())
}

// === reserve ===

/// Room in flight, taken before the rate is decided so that a request
/// refused for it costs no rate units; a request the rate refuses drops
/// its slot on the way out.
async fn reserve(
    capacity: &Arc<Capacity>,
    found: &Found<'_>,
    who: &Identity<'_>,
) -> Result<Option<Slot>, Refusal> {
    let per_client = capacity.settings().per == Per::Client;
    if per_client && who.client.is_none() {
        return Ok(None);
    }
    match capacity.acquire(who.client.as_ref()).await {
        Ok(slot) => Ok(Some(slot)),
        Err(reason) => {
            let route = found.route;
            let whose = if per_client {
                "this client on route"
            } else {
                "route"
            };
            let detail = format!(
                "{whose} \"{}\" has as many requests in flight as it allows ({}); retry shortly",
                route.name,
                capacity.limit()
            );
            tracing::debug!(route = %route.name, reason = reason.name(), "concurrency cap full");
            Err(Refusal::capacity(capacity.settings().status, detail))
        }
    }
}

/// The path and query sent upstream: the request's own when its path was
/// already normal, else the normalised path with the original query.
fn forwarded_target(forward_path: Cow<'_, str>, uri: &http::Uri) -> Result<PathAndQuery, Refusal> {
    let target = match (forward_path, uri.path_and_query()) {
        (Cow::Borrowed(_), Some(pq)) => Some(pq.clone()),
        (path, pq) => {
            let text = match pq.and_then(PathAndQuery::query) {
                Some(q) => format!("{path}?{q}"),
                None => path.into_owned(),
            };
            PathAndQuery::try_from(text).ok()
        }
    };
    target.ok_or_else(|| {
        Refusal::client(
            StatusCode::BAD_REQUEST,
            "the request path cannot be forwarded",
        )
    })
}

// === impl Context ===

impl<'a> Context<'a> {
    /// A request's context from `peer`, its access log record begun (when
    /// the log is on) with the request line and the body's size if known.
    fn new(
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
        }
    }
}

impl Context<'_> {
    // --- route ---

    /// The route the request is on: 404 when none matches.
    fn route<'r>(
        &mut self,
        rules: &'r Rules,
        head: &Parts,
        host: Option<&str>,
        matched_path: &str,
    ) -> Result<Found<'r>, Refusal> {
        let facts = RequestFacts {
            method: &head.method,
            host,
            path: matched_path,
            headers: &head.headers,
        };
        let Some((index, route)) = rules.routes.find(&facts) else {
            self.shared.metrics.no_route.inc();
            return Err(Refusal::client(
                StatusCode::NOT_FOUND,
                "no route matches this request",
            ));
        };
        // `post` is not `POST` to floodgate, but is to many servers: it is
        // served only on a route that compares methods without case.
        if !route.matcher.ignore_case
            && let Some(standard) = crate::head::miscased_standard(&head.method)
        {
            return Err(crate::head::HeadError::MethodCase(standard).into());
        }
        if let Some(r) = self.log.as_mut() {
            r.route(&route.name);
        }
        Ok(Found { index, route })
    }

    // --- decide ---

    /// The rate decision, counted and logged, as far as it goes at once:
    /// done (see [`Decided`]), or a question for the shared store (the
    /// request's policy and cost), which [`Context::ask`] puts.
    fn decide<'r, 'w>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        who: &'w mut Identity<'r>,
        headers: &http::HeaderMap,
        read: Option<BodyRead>,
    ) -> Deciding<'r, 'w> {
        let route = found.route;
        if who.exempt {
            return Deciding::Done(Ok(Ok(self.unlimited(rules, found, Outcome::Exempt))));
        }
        let policy = who.policy.take().filter(|p| !p.limits.is_empty());
        let (Some(client), Some(policy)) = (&who.client, policy) else {
            return Deciding::Done(Ok(Ok(self.unlimited(rules, found, Outcome::Allowed))));
        };
        let cost = match &route.usage {
            None => route.cost,
            Some(usage) => match crate::usage::reservation(usage, headers, read) {
                Ok(cost) => cost,
                Err(message) => {
                    return Deciding::Done(Err(Refusal::client(StatusCode::BAD_REQUEST, message)));
                }
            },
        };
        let charge = charge(route, client, &policy, &who.keys, cost);
        match self.shared.limiter.decide_at_once(charge) {
            Some(answer) => {
                let concluded = self.concluded(rules, found, &policy, charge, answer);
                Deciding::Done(with_policy(concluded, policy))
            }
            None => Deciding::Ask {
                client,
                keys: &who.keys,
                policy,
                cost,
            },
        }
    }

    /// The decide phase whole: at once, or with the shared store's answer
    /// (boxed, as the rare path for every request's future).
    async fn decided<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        who: &mut Identity<'r>,
        headers: &http::HeaderMap,
        read: Option<BodyRead>,
    ) -> Decided<'r> {
        match self.decide(rules, found, who, headers, read) {
            Deciding::Done(decided) => decided,
            Deciding::Ask {
                client,
                keys,
                policy,
                cost,
            } => Box::pin(self.ask(rules, found, client, keys, policy, cost)).await,
        }
    }

    /// The shared store's answer to the question [`Context::decide`] left,
    /// concluded.
    async fn ask<'r>(
        &mut self,
        rules: &Rules,
        found: &Found<'r>,
        client: &ClientId,
        keys: &[crate::limit::CountKey],
        policy: Limits<'r>,
        cost: u64,
    ) -> Decided<'r> {
        let charge = charge(found.route, client, &policy, keys, cost);
        let answer = self.shared.limiter.decide(charge).await;
        let concluded = self.concluded(rules, found, &policy, charge, answer);
        with_policy(concluded, policy)
    }

    /// The store's `answer` to `charge` under `policy`, counted and
    /// logged: `Ok` with the decision to annotate the answer with (none
    /// when the store was unavailable), or `Err` with the denial that
    /// answers the request.
    fn concluded(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        policy: &Policy,
        charge: Charge<'_>,
        answer: Answer,
    ) -> Concluded {
        let route = found.route;
        let counts = &rules.metrics[found.index];
        let client = charge.client;
        self.log_decision(rules, found, client, policy, &answer);
        match answer {
            Answer::Decided(d) if d.allowed => {
                counts.count(Outcome::Allowed);
                self.reserved(rules, found, &charge, &d);
                Ok(Ok(Some(d)))
            }
            Answer::Decided(d) if route.shadow => {
                counts.count(Outcome::ShadowDenied);
                self.shared.log_shadow(&route.name, client);
                Ok(Ok(Some(d)))
            }
            Answer::Decided(d) => {
                counts.count(Outcome::Denied);
                let quota = policy.limits.get(d.limit).map_or(0, |l| l.limit);
                self.shared
                    .denials
                    .denied(&route.name, client, quota, crate::clock::now_ms());
                Ok(Err(Box::new(if self.grpc {
                    response::grpc_too_many_requests(route, policy, &d)
                } else {
                    response::too_many_requests(route, policy, &d)
                })))
            }
            Answer::Unavailable {
                deny,
                retry_after_ms,
            } => {
                counts.count(Outcome::StoreError);
                if deny && !route.shadow {
                    return Err(Refusal::store(retry_after_ms));
                }
                Ok(Ok(None))
            }
        }
    }

    /// On a metered route, keeps the reservation `charge` took when `d`
    /// admitted it, for the answer to settle.
    fn reserved(&mut self, rules: &Rules, found: &Found<'_>, charge: &Charge<'_>, d: &Decision) {
        let (Some(usage), Some(Some(metering))) =
            (&found.route.usage, rules.metering.get(found.index))
        else {
            return;
        };
        let reservation = Reservation::new(usage, metering, charge, d);
        if let Some(r) = self.log.as_mut() {
            r.units(&reservation.tally);
        }
        self.reservation = Some(Box::new(reservation));
    }

    /// Counts and logs a request its route does not limit.
    fn unlimited<'r>(&mut self, rules: &Rules, found: &Found<'r>, outcome: Outcome) -> Allowed<'r> {
        rules.metrics[found.index].count(outcome);
        if let Some(r) = self.log.as_mut() {
            r.decided(outcome, None, None);
        }
        None
    }

    /// The decision into the access log's record and the route's top
    /// clients.
    fn log_decision(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        client: &ClientId,
        policy: &Policy,
        answer: &Answer,
    ) {
        if let Some(r) = self.log.as_mut() {
            let (outcome, limit) = match answer {
                Answer::Decided(d) => (
                    if d.allowed {
                        Outcome::Allowed
                    } else if found.route.shadow {
                        Outcome::ShadowDenied
                    } else {
                        Outcome::Denied
                    },
                    policy
                        .names
                        .get(d.limit)
                        .map(|name| (name.as_str(), d.remaining)),
                ),
                Answer::Unavailable { .. } => (Outcome::StoreError, None),
            };
            r.decided(outcome, Some(client), limit);
        }
        if let Answer::Decided(d) = answer {
            rules.count_top(found.index, client, !d.allowed);
        }
    }

    // --- forward ---

    /// The upstream's answer, timed, counted and logged, written into
    /// `out` and lent back. Only the upstream's own answers count as
    /// upstream responses; floodgate's 502 and 504 are refusals.
    #[allow(clippy::too_many_arguments)]
    async fn forward<'o, H: Send + 'static>(
        &mut self,
        rules: &Rules,
        found: &Found<'_>,
        Exchange {
            upstream,
            target,
            slot,
        }: Exchange<'_>,
        head: &mut Parts,
        body: ClientBody,
        hold: impl FnOnce() -> H,
        out: &'o mut Option<Response<Body>>,
    ) -> Result<&'o mut Response<Body>, Refusal> {
        let Some(group) = rules.upstreams.get(upstream.index) else {
            return Err(Refusal::upstream(
                StatusCode::BAD_GATEWAY,
                "the route's upstream is not configured",
            ));
        };
        if !self.peer.trusted {
            for name in &rules.strip_untrusted_headers {
                head.headers.remove(name);
            }
        }
        let hold = {
            let slot = slot.cloned();
            move || (hold(), slot)
        };
        let client_side = ClientSide {
            max_body: found.route.max_request_body,
            ..rules.client_timeouts
        };
        let body = match body {
            ClientBody::Arrived(body) => RequestBody::new(body, &client_side),
            ClientBody::Read(body, sent) => (body, sent),
        };
        let started = Instant::now();
        let (response, member) = self
            .shared
            .forwarder
            .forward(
                group,
                upstream.timeout,
                head,
                body,
                target,
                self.peer,
                started,
                client_side,
                hold,
                out,
            )
            .await?;
        let took = started.elapsed();
        if let Some(slot) = slot {
            slot.sample(took);
        }
        rules.metrics[found.index].upstream(response.status().as_u16(), took);
        if let Some(r) = self.log.as_mut() {
            r.upstream(&member.endpoint.target, took);
        }
        Ok(response)
    }

    // --- log ---

    /// A refusal counted and made into its answer. A reservation made
    /// for the request stands.
    fn refused(&mut self, refusal: Refusal) -> Response<Body> {
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

    /// The answer, watched so that its access log line is written once it
    /// has gone out and its slot held until then; on a metered route whose
    /// answer reports in its body, read for the report on the way.
    fn logged(mut self, mut response: Response<Body>) -> Response<Body> {
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
            r.meter(
                limiter,
                settlements,
                event_stream,
                response.status().as_u16(),
            )
        });
        response.body_mut().watch(watcher(record, log, slot, meter));
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection for the size of a request's future.
    struct Sized;

    impl Connection for Sized {
        type Busy<'a> = ();
        fn shared(&self) -> &Shared {
            unimplemented!("never called: only the future's size is read")
        }
        fn peer(&self) -> &Peer {
            unimplemented!("never called: only the future's size is read")
        }
        fn begin(&self) {}
    }

    /// The size of what `f` returns, without calling it.
    fn returned<F, R>(_: &F) -> usize
    where
        F: Fn(Arc<Sized>, Request<Incoming>) -> R,
    {
        std::mem::size_of::<R>()
    }

    /// Every request's future is this state, built and moved as a whole:
    /// the rare paths (a Redis decision, connecting, a retry, reading a
    /// body first, the readout) are boxed out of it. It was 7 160 bytes
    /// before the memory store decided without a future of its own, and
    /// 4 456 before the access log's record and the decide phase's results
    /// (a request's own policy, a denial) were held by pointer (3 864).
    /// The answer and the upstream's exchange each have a place of their
    /// own in it since, written once rather than moved out through every
    /// layer (4 264: 400 bytes more state, 420 instructions fewer a
    /// request).
    #[test]
    fn a_request_future_stays_small() {
        const MOST: usize = 4_352;
        let size = returned(&|c: Arc<Sized>, r: Request<Incoming>| handle(c, r));
        assert!(
            size <= MOST,
            "a request's future is {size} bytes, more than {MOST}: box the path that grew it"
        );
    }
}
