//! Forwarding an allowed request to its upstream and streaming the answer back.
//!
//! Bodies stream both ways (nothing is buffered whole), hop-by-hop headers are
//! dropped in both directions, and the upstream learns who asked through
//! `X-Forwarded-For`, `X-Forwarded-Proto` and `X-Forwarded-Host` (and, where
//! an upstream asks for them, RFC 7239 `Forwarded` and `Via`).

use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use http::header::{CONNECTION, HOST, VIA};
use http::uri::PathAndQuery;
use http::{Response, StatusCode, Version, request};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;

use crate::metrics::{Phase, Timeouts};
use crate::refusal::Refusal;
use crate::response;

pub mod balance;
pub mod connect;
mod deadline;
pub mod discovery;
pub mod headers;
mod idle;
pub mod metrics;
pub mod outgoing;
pub mod pool;
pub mod request_body;
pub mod response_body;
pub mod settings;
pub mod upgrade;

pub use deadline::HeadTimer;
pub use headers::Peer;
pub use idle::IdleTimer;

/// Body of every answer: the upstream's as it streams, or floodgate's own.
pub type Body = response::Body<UpstreamBody>;

use balance::{Failure, Group, Member};
use headers::{UPGRADE_OPTION, strip_hop_by_hop, upstream_headers, via};
use outgoing::Head;
use pool::{Exchange, Pools, SendError};
use request_body::{ClientBodyError, RequestBody, Sent};
use response_body::{UpstreamBody, UpstreamBodyError};
use settings::Endpoint;

/// What an upgrade the client asked for needs when the upstream accepts
/// it: the client's side, the upstream's sender, and the idle timeout.
type Upgraded = (
    Option<OnUpgrade>,
    Option<hyper::client::conn::http1::SendRequest<RequestBody>>,
    Duration,
);

/// The client side's limits of one forwarded exchange.
#[derive(Debug, Clone, Copy)]
pub struct ClientSide {
    /// A request body that sends nothing for this long is the client's 408.
    pub body: Duration,
    /// Request bodies up to this many bytes are read whole before an
    /// upstream connection is taken; 0: every body streams.
    pub buffer: u64,
    /// The slowest a request body may arrive on average, in bytes a second,
    /// once `min_rate_after` has passed (0: no minimum): the client's 408.
    pub min_rate: u64,
    /// How long a request body may arrive at any rate.
    pub min_rate_after: Duration,
    /// A request body larger than this many bytes is the client's 413.
    pub max_body: Option<u64>,
    /// An upgraded connection on which neither side sends anything for this
    /// long is closed.
    pub upgraded: Duration,
}

/// Sends requests to upstreams over pooled connections.
#[derive(Debug)]
pub struct Forwarder {
    pools: Pools,
    timeouts: Timeouts,
}

impl Forwarder {
    /// A forwarder with no connections yet, counting the timeouts that
    /// fire into `timeouts`.
    pub fn new(timeouts: Timeouts) -> Self {
        Self {
            pools: Pools::default(),
            timeouts,
        }
    }

    /// Closes idle connections that have outlived their keep-alive time.
    pub fn sweep(&self) {
        self.pools.sweep();
    }

    /// Forwards the request with head `request` and `body` to an endpoint
    /// of `group` as `path_and_query`, waiting `timeout` for the response
    /// head, on behalf of `peer`; `now` is when forwarding began
    /// (the upstream's deadlines run from it). The head's header map is
    /// taken for the upstream's request. Upstream trouble is a 502 or 504
    /// refusal; a request body that breaks off is the client's 400, one
    /// that stalls the client's 408. An upgrade the upstream accepts is
    /// spliced on a task that holds what `hold` gives until it ends. The
    /// response is written into `out` (once, where the request's caller
    /// keeps it, rather than moved out through every layer on its way
    /// back) and comes back lent, with the endpoint that answered.
    #[expect(
        clippy::too_many_arguments,
        reason = "a forward's inputs come from different layers: the route, the client, the clock and the connection"
    )]
    pub async fn forward<'o, H: Send + 'static>(
        &self,
        group: &Group,
        timeout: Duration,
        request: &mut request::Parts,
        (mut body, sent): (RequestBody, Option<Arc<Sent>>),
        path_and_query: PathAndQuery,
        peer: &Peer,
        now: Instant,
        timeouts: ClientSide,
        hold: impl FnOnce() -> H,
        out: &'o mut Option<Response<Body>>,
    ) -> Result<(&'o mut Response<Body>, Arc<Member>), Refusal> {
        let upgrade = request.version == Version::HTTP_11 && upgrade::requested(&request.headers);
        // The endpoints in force when the request began, through its retry.
        let members = group.members();
        let mut chosen = group.pick(&members, None);
        let mut member = &*members[chosen];
        let (mut head, on_client_upgrade) =
            outgoing(request, &member.endpoint, peer, upgrade, path_and_query);
        // A small body is read whole before an upstream connection is
        // taken: a slow upload holds no upstream connection.
        if timeouts.buffer > 0
            && sent.is_some() // the body has anything to send
            && let Err(e) = body.read_ahead(timeouts.buffer).await
        {
            return Err(self.client_body_refusal(&e, None));
        }
        // A request none of which was written, or a bodiless idempotent one
        // whose connection broke before any answer, goes once more (to
        // another endpoint when there is one); it is still one request
        // against the route's limits.
        let mut tries = 0;
        // Where the exchange is written, once: moved back out of the send
        // and the deadline, it was copied at each.
        let mut exchanged = None;
        loop {
            let endpoint = &member.endpoint;
            let _in_flight = member.begin();
            let pool = self.pools.get_in(member.pool(), endpoint);
            // Pinned here, in this future, rather than moved into the
            // deadline's: a send is large, and every move is a copy.
            let send = pin!(pool.send(endpoint, head, body, upgrade, now, &mut exchanged));
            let failure =
                match by_deadline(send, &peer.head_timer, timeout, now, sent.as_deref()).await {
                    Some(Ok(())) => {
                        group.succeeded(member);
                        break;
                    }
                    Some(Err(failure)) => failure,
                    None => {
                        member.count(Failure::Timeout);
                        group.failed(member);
                        return Err(self.refusal(endpoint, timeout, SendError::TimedOut));
                    }
                };
            count_failure(group, member, &failure.error);
            // Once more (once), to another endpoint when there is one; a
            // request whose connection broke goes once more even to the
            // same one.
            let broke = matches!(failure.error, SendError::Failed(_)) && !failure.elsewhere_only;
            match failure.unsent {
                Some(unsent) if tries == 0 && (members.len() > 1 || broke) => {
                    tries += 1;
                    chosen = group.pick(&members, Some(chosen));
                    member = &*members[chosen];
                    (head, body) = *unsent;
                    once_more(
                        &failure.error,
                        endpoint,
                        &member.endpoint,
                        &mut head.headers,
                    );
                }
                _ => return Err(self.refusal(endpoint, timeout, failure.error)),
            }
        }
        // Written by every send that succeeds.
        let Some(Exchange {
            mut response,
            release,
            switched: sender,
        }) = exchanged
        else {
            return Err(Refusal::upstream(
                StatusCode::BAD_GATEWAY,
                "the upstream failed to answer",
            ));
        };
        let endpoint = &member.endpoint;
        let upgraded = (on_client_upgrade, sender, timeouts.upgraded);
        self.answer_head(&mut response, endpoint, upgraded, hold)?;
        let body_timeouts = self.timeouts.counter(Phase::UpstreamBody).clone();
        let (parts, body) = response.into_parts();
        let mut body = UpstreamBody::new(body, endpoint.body_timeout, release, body_timeouts);
        if reads_first(&request.method, &parts)
            && let Err(e) = body.read_first().await
        {
            return Err(first_bytes_refusal(member, &e));
        }
        let response = out.insert(Response::from_parts(parts, Body::streamed(body)));
        Ok((response, Arc::clone(&members[chosen])))
    }

    /// The upstream's answer head on its way back from `endpoint`:
    /// hop-by-hop fields dropped, `Via` added where the upstream asks for
    /// it, and a switch of protocols spliced with what `upgraded` holds
    /// (the client's side, the upstream's sender, the idle timeout).
    fn answer_head<H: Send + 'static>(
        &self,
        response: &mut Response<Incoming>,
        endpoint: &Endpoint,
        (on_client_upgrade, sender, idle): Upgraded,
        hold: impl FnOnce() -> H,
    ) -> Result<(), Refusal> {
        let switched = response.status() == StatusCode::SWITCHING_PROTOCOLS;
        strip_hop_by_hop(response.headers_mut(), switched);
        if endpoint.forwarding.via {
            let entry = via(response.version()).clone();
            response.headers_mut().append(VIA, entry);
        }
        if switched {
            self.switch(response, endpoint, on_client_upgrade, sender, idle, hold)?;
        }
        Ok(())
    }

    /// An upstream's `101` for the client's upgrade: the answer says
    /// `Connection: upgrade`, and the two upgraded connections are spliced
    /// on a task that holds what `hold` gives until it ends. A `101` nobody
    /// asked for is a `502`.
    fn switch<H: Send + 'static>(
        &self,
        response: &mut Response<Incoming>,
        endpoint: &Endpoint,
        on_client_upgrade: Option<OnUpgrade>,
        sender: Option<hyper::client::conn::http1::SendRequest<RequestBody>>,
        idle: Duration,
        hold: impl FnOnce() -> H,
    ) -> Result<(), Refusal> {
        let Some(client) = on_client_upgrade else {
            tracing::warn!(upstream = %endpoint.target, "upstream switched protocols unasked");
            return Err(Refusal::upstream(
                StatusCode::BAD_GATEWAY,
                "the upstream switched protocols unasked",
            ));
        };
        response
            .headers_mut()
            .insert(CONNECTION, UPGRADE_OPTION.clone());
        let on_upstream_upgrade = hyper::upgrade::on(response);
        upgrade::splice(
            client,
            on_upstream_upgrade,
            sender,
            idle,
            self.timeouts.counter(Phase::UpgradeIdle).clone(),
            hold(),
        );
        Ok(())
    }

    /// The client's fault, not the upstream's: its body stalled, arrived too
    /// slowly, was too large or malformed, or it went away while sending
    /// it (while being forwarded to `upstream`, or read ahead of that).
    /// Reads up to `limit` bytes of `body` ahead, before anything is
    /// decided about the request (a reservation named in it); the client's
    /// faults come back as its refusals, counted as when forwarding.
    pub async fn read_first(&self, body: &mut RequestBody, limit: u64) -> Result<(), Refusal> {
        body.read_ahead(limit)
            .await
            .map_err(|e| self.client_body_refusal(&e, None))
    }

    fn client_body_refusal(&self, error: &ClientBodyError, upstream: Option<&Endpoint>) -> Refusal {
        let forwarding_to = upstream.map_or("", |u| &u.target);
        match error {
            ClientBodyError::TimedOut(after) => {
                self.timeouts.count(Phase::ClientBody);
                tracing::info!(
                    fault = "client",
                    ?after,
                    forwarding_to,
                    "the client stopped sending its request body (408)"
                );
                Refusal::client(
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body stopped arriving within client_body_timeout",
                )
            }
            ClientBodyError::TooSlow(rate) => {
                self.timeouts.count(Phase::ClientBody);
                tracing::info!(
                    fault = "client",
                    rate,
                    forwarding_to,
                    "the client sent its request body too slowly (408)"
                );
                Refusal::client(
                    StatusCode::REQUEST_TIMEOUT,
                    format!(
                        "the request body arrived slower than client_body_min_rate ({rate} bytes a second)"
                    ),
                )
            }
            ClientBodyError::TooLarge(max) => Refusal::client(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the request body is larger than this route's max_request_body of {max} bytes"
                ),
            ),
            ClientBodyError::Broken(e) => {
                tracing::debug!(forwarding_to, error = %e, "the request body broke off");
                Refusal::client(
                    StatusCode::BAD_REQUEST,
                    "the request body is malformed or incomplete",
                )
            }
        }
    }

    /// The refusal for a failed exchange, logged with its reason.
    fn refusal(&self, upstream: &Endpoint, timeout: Duration, error: SendError) -> Refusal {
        match &error {
            SendError::Connect(e) => {
                if matches!(e, connect::ConnectError::TimedOut(_)) {
                    self.timeouts.count(Phase::UpstreamConnect);
                }
                tracing::warn!(upstream = %upstream.target, error = %e, "upstream unreachable");
                Refusal::upstream(StatusCode::BAD_GATEWAY, "the upstream is unreachable")
            }
            SendError::TimedOut => {
                self.timeouts.count(Phase::UpstreamHead);
                tracing::warn!(
                    upstream = %upstream.target,
                    ?timeout,
                    "upstream timed out"
                );
                Refusal::upstream(
                    StatusCode::GATEWAY_TIMEOUT,
                    "the upstream did not answer in time",
                )
            }
            SendError::NoUpgrade => {
                tracing::warn!(upstream = %upstream.target, error = %error, "upgrade refused");
                Refusal::upstream(
                    StatusCode::BAD_GATEWAY,
                    "the upstream cannot carry this upgrade",
                )
            }
            SendError::Failed(e) => match client_body_error(e) {
                Some(body) => self.client_body_refusal(body, Some(upstream)),
                None => {
                    tracing::warn!(upstream = %upstream.target, error = %e, "upstream failed");
                    Refusal::upstream(StatusCode::BAD_GATEWAY, "the upstream failed to answer")
                }
            },
        }
    }
}

/// Whether an answer's body is read up to its first bytes before its head
/// goes out, so that a body broken from its start is a `502` rather than a
/// connection cut with nothing sent (a gRPC call gets `UNAVAILABLE`): any
/// answer with a body, except a switch of protocols and an event stream,
/// whose head a client wants at once however long its first event takes.
fn reads_first(method: &http::Method, head: &http::response::Parts) -> bool {
    let status = head.status;
    *method != http::Method::HEAD
        && !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
        && !is_event_stream(&head.headers)
}

/// Whether an answer is a `text/event-stream`, by its `Content-Type` (the
/// media type compared without case, its parameters aside).
pub fn is_event_stream(headers: &http::HeaderMap) -> bool {
    // On the bytes: this runs on every answer, and the text is ASCII.
    const TYPE: &[u8] = b"text/event-stream";
    headers.get(http::header::CONTENT_TYPE).is_some_and(|v| {
        let value = v.as_bytes().trim_ascii_start();
        let media = value.split(|&b| b == b';').next().unwrap_or_default();
        media.trim_ascii_end().eq_ignore_ascii_case(TYPE)
    })
}

/// `send`'s outcome, unless the upstream's response head is later than
/// `timeout` after the request was sent whole (after `began` for a request
/// without a body, after the body's end for one with: a slow upload is not
/// the upstream's delay). Timed on `timer`, the client connection's.
async fn by_deadline<F: Future>(
    mut send: Pin<&mut F>,
    timer: &HeadTimer,
    timeout: Duration,
    began: Instant,
    sent: Option<&Sent>,
) -> Option<F::Output> {
    let began = tokio::time::Instant::from_std(began);
    let mut deadline = timer.lend(began + timeout);
    loop {
        let answered = std::future::poll_fn(|cx| {
            if let Poll::Ready(out) = send.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            Pin::new(&mut deadline).poll(cx).map(|()| None)
        })
        .await;
        if answered.is_some() {
            return answered;
        }
        let later = match sent.map(Sent::at) {
            // Still uploading: the request body's idle timeout watches.
            Some(None) => tokio::time::Instant::now() + timeout,
            Some(Some(at)) if began + at + timeout > tokio::time::Instant::now() => {
                began + at + timeout
            }
            _ => return None,
        };
        deadline.reset(later);
    }
}

/// The request's head as it goes to `endpoint` as `target` (its header
/// map taken from `request`), and the client's side of the upgrade it
/// asks for, if it does.
fn outgoing(
    request: &mut request::Parts,
    endpoint: &Endpoint,
    peer: &Peer,
    upgrade: bool,
    target: PathAndQuery,
) -> (Head, Option<OnUpgrade>) {
    let headers = upstream_headers(request, endpoint, peer, upgrade);
    let on_client_upgrade = if upgrade {
        request.extensions.remove::<OnUpgrade>()
    } else {
        None
    };
    let head = Head {
        method: request.method.clone(),
        target,
        headers,
    };
    (head, on_client_upgrade)
}

/// A request that failed on `from` with `error` before any answer, going
/// once more to `to`: logged, and with `to`'s `Host` unless `to` keeps the
/// client's.
fn once_more(error: &SendError, from: &Endpoint, to: &Endpoint, headers: &mut http::HeaderMap) {
    tracing::debug!(
        endpoint = %from.target,
        %error,
        "upstream endpoint failed before answering; sending the request once more"
    );
    if !to.preserve_host {
        headers.insert(HOST, to.host_header.clone());
    }
}

/// A failed try counted against its endpoint: what it says of the
/// endpoint's health (a request body's own fault says nothing).
fn count_failure(group: &Group, member: &Member, error: &SendError) {
    match error {
        SendError::Connect(e) => {
            member.count(if matches!(e, connect::ConnectError::TimedOut(_)) {
                Failure::Timeout
            } else {
                Failure::Connect
            });
            group.failed(member);
        }
        SendError::Failed(e) if client_body_error(e).is_none() => {
            member.count(Failure::Protocol);
        }
        SendError::NoUpgrade => member.count(Failure::Protocol),
        SendError::Failed(_) | SendError::TimedOut => {}
    }
}

/// An answer whose body failed before any of it went out: counted against
/// its endpoint, and answered by floodgate instead (`504` for a stall,
/// `502` for a break).
fn first_bytes_refusal(member: &Member, error: &UpstreamBodyError) -> Refusal {
    let upstream = &member.endpoint.target;
    tracing::warn!(%upstream, %error, "the upstream's answer failed before any of it was sent");
    match error {
        UpstreamBodyError::TimedOut(_) => {
            member.count(Failure::Timeout);
            Refusal::upstream(
                StatusCode::GATEWAY_TIMEOUT,
                "the upstream's answer stalled before any of it was sent",
            )
        }
        UpstreamBodyError::Broken(_) => {
            member.count(Failure::Protocol);
            Refusal::upstream(
                StatusCode::BAD_GATEWAY,
                "the upstream's answer broke off before any of it was sent",
            )
        }
    }
}

/// The request body's own error, if that is what failed the exchange.
fn client_body_error(error: &hyper::Error) -> Option<&ClientBodyError> {
    let mut cause = std::error::Error::source(error);
    while let Some(e) = cause {
        if let Some(found) = e.downcast_ref::<ClientBodyError>() {
            return Some(found);
        }
        cause = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_stream_is_told_by_its_media_type_alone() {
        let with = |value: &'static str| {
            let mut headers = http::HeaderMap::new();
            headers.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(value),
            );
            is_event_stream(&headers)
        };
        for yes in [
            "text/event-stream",
            "Text/Event-Stream",
            " text/event-stream ",
            "text/event-stream; charset=utf-8",
            "text/event-stream ;charset=utf-8",
        ] {
            assert!(with(yes), "{yes}");
        }
        for no in [
            "text/plain",
            "text/event-streams",
            "text/event",
            "application/json; x=text/event-stream",
            "",
        ] {
            assert!(!with(no), "{no}");
        }
        assert!(!is_event_stream(&http::HeaderMap::new()));
    }
}
