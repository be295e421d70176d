//! One request's phases, in order:
//!
//! head → route → admit body → identify → reserve → decide → hold (a
//! limit's delay) → forward (or the route's own answer) → annotate → log.
//!
//! Each phase is a function of its own: head, route, admit body and
//! reserve here; identify in `phases/identify.rs`, decide in
//! `phases/decide.rs`, forward in `phases/forward.rs`, and the log in
//! `phases/context.rs` with the [`Context`] in which what the phases
//! learn of the request travels. A phase that ends the request early
//! returns the [`Refusal`] that answers it; the decide phase's ruling
//! (`phases/ruling.rs`) is rendered by `answer`, a denial as the 429;
//! every answer goes out with its end hooks where it has any (a usage
//! meter, the access log's line, the request's concurrency slot held
//! until the answer is sent; see `gate::hooks`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::request::Parts;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::metering::{self, ClientBody};
use super::rules::Rules;
use super::shared::Shared;
use crate::concurrency::{Capacity, Per, Slot};
use crate::limit::Decision;
use crate::proxy::{Body, ClientSide, Peer};
use crate::refusal::Refusal;
use crate::response;
use crate::routes::{Action, RequestFacts, Route, request_paths};

mod context;
mod decide;
mod decision;
mod forward;
mod identify;
pub mod operator;
mod rls;
mod ruling;
mod standing;

use context::{Context, Found};
use decide::Limits;
pub use decision::decide;
use forward::Exchange;
use identify::Identity;
use ruling::Ruling;

/// Longest request target (path and query) accepted; past it 414.
const MAX_URI_BYTES: usize = 8 * 1024;

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
    if let Some(settled) = cx.settle_by_answer(&response) {
        // A give-back that failed is logged where it failed.
        let _ = settled.await;
    }
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
    let who = cx
        .verified(&rules, &found, &mut head.headers, &matched_path)
        .await?;
    // A route without a cap awaits nothing here.
    let slot = match rules.live(found.index).and_then(|l| l.capacity.as_ref()) {
        Some(capacity) => reserve(capacity, &found, &who).await?,
        None => None,
    };
    // Boxed, as the rare path: every request's future would carry it.
    let (body, read) = match read_first(found.route) {
        Some(usage) => {
            let (forwarder, client_side) = (&cx.shared.forwarder, client_side(&rules, found.route));
            Box::pin(metering::read_first(
                forwarder,
                client_side,
                usage,
                body,
                &mut head.headers,
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
        Ruling::Allowed { decision, limits } | Ruling::ShadowDenied { decision, limits } => {
            Some((decision, limits))
        }
        Ruling::Unlimited | Ruling::StoreDown(None) => None,
        Ruling::Denied { decision, limits } => {
            *out = Some(cx.too_many_requests(found.route, &limits, &decision));
            return Ok(());
        }
        Ruling::StoreDown(Some(refusal)) => return Err(refusal),
    };
    // Held until it fits (boxed, as the rare path); the place goes once
    // the wait is over, or at once when there was none. A route in shadow
    // mode holds nothing, as it refuses nothing.
    let wait = allowed.as_ref().map_or(0, |(d, _)| d.held_ms());
    if wait > 0 && !found.route.shadow {
        Box::pin(cx.held(wait)).await;
    }
    cx.place = None;
    let response = match &found.route.action {
        Action::Respond(r) => out.insert(response::respond(r)),
        // Boxed, as the rare path.
        Action::Standing(names) => out
            .insert(Box::pin(cx.standing(&rules, names, &mut head.headers, &matched_path)).await?),
        Action::Decide => return Err(decided_elsewhere(found.route)),
        Action::Upstream(upstream) => {
            let exchange = Exchange::to(
                upstream,
                found.route,
                forward_path,
                &head.uri,
                slot.as_ref(),
            )?;
            cx.forward(&rules, &found, exchange, &mut head, body, hold, out)
                .await?
        }
    };
    let settled = match cx.settling_from_head(response) {
        Some(settling) => settling.await,
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

// === read first ===

/// What a metered route's usage is read from first, when it is named in
/// the request's body (its JSON reservation, or a stream asked to
/// include its usage): the body is read before the decide phase.
fn read_first(route: &Route) -> Option<&crate::usage::settings::Settings> {
    route
        .usage
        .as_deref()
        .filter(|u| u.reserve_json.is_some() || u.stream_include_usage)
}

/// The client side's limits of a request on `route`: the rules' timeouts,
/// and the route's largest body.
fn client_side(rules: &Rules, route: &Route) -> ClientSide {
    ClientSide {
        max_body: route.max_request_body,
        ..rules.client_timeouts
    }
}

// === impl Context ===

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

    // --- settle ---

    /// What the answer's head settles (boxed, as the rare path): on a
    /// metered route whose upstream reports its units there, the
    /// reservation settled to the report, and the decision to annotate
    /// `response` with instead; on a route that counts by the answer, the
    /// units of the limits it does not count given back.
    fn settling_from_head(
        &mut self,
        response: &Response<Body>,
    ) -> Option<Pin<Box<impl Future<Output = Option<Decision>>>>> {
        let reservation = self.reservation.take_if(|r| r.reported_in_head());
        let by_answer = self.by_answer.take();
        if reservation.is_none() && by_answer.is_none() {
            return None;
        }
        let (limiter, metrics) = (&self.shared.limiter, &self.shared.metrics);
        let (status, headers) = (response.status().as_u16(), response.headers());
        Some(Box::pin(async move {
            if let Some(by_answer) = by_answer {
                by_answer.settle((status, headers), limiter, metrics).await;
            }
            match reservation {
                Some(reservation) => reservation.settle_from_head(status, limiter, headers).await,
                None => None,
            }
        }))
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
    /// request). It measured 4 304 before the phases moved into files of
    /// their own, and 4 296 after.
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
