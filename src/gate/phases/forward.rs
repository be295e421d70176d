//! The forward phase: where an allowed request goes (its upstream, the
//! path and query it is sent as, the slot it holds on the way), the head
//! it goes with (fields an untrusted peer may not send removed), and the
//! upstream's answer timed, counted and logged.

use std::borrow::Cow;
use std::time::Instant;

use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Response, StatusCode};

use super::{Context, Found};
use crate::concurrency::Slot;
use crate::gate::metering::ClientBody;
use crate::gate::rules::Rules;
use crate::proxy::Body;
use crate::proxy::request_body::RequestBody;
use crate::refusal::Refusal;
use crate::routes::{Route, Upstream};

/// Where an allowed request goes, and the slot it holds on the way.
pub(super) struct Exchange<'a> {
    upstream: &'a Upstream,
    /// The path and query sent upstream.
    target: PathAndQuery,
    slot: Option<&'a Slot>,
}

impl<'a> Exchange<'a> {
    /// Where a request on `route` goes: to `upstream`, as the path it
    /// asked for (less the prefix the route strips) with its own query.
    pub(super) fn to(
        upstream: &'a Upstream,
        route: &Route,
        forward_path: Cow<'_, str>,
        uri: &http::Uri,
        slot: Option<&'a Slot>,
    ) -> Result<Self, Refusal> {
        let forward_path = match route.stripped(&forward_path) {
            Some(rest) => Cow::Owned(rest.to_owned()),
            None => forward_path,
        };
        Ok(Self {
            upstream,
            target: forwarded_target(forward_path, uri)?,
            slot,
        })
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

impl Context<'_> {
    /// The upstream's answer, timed, counted and logged, written into
    /// `out` and lent back. Only the upstream's own answers count as
    /// upstream responses; floodgate's 502 and 504 are refusals.
    #[expect(
        clippy::too_many_arguments,
        reason = "the exchange's parts, each lent by the phase that made it"
    )]
    pub(super) async fn forward<'o, H: Send + 'static>(
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
        let client_side = super::client_side(rules, found.route);
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
        if let Some(live) = rules.live(found.index) {
            live.metrics.upstream(response.status().as_u16(), took);
        }
        if let Some(r) = self.log.as_mut() {
            r.upstream(&member.endpoint.target, took);
        }
        Ok(response)
    }
}
