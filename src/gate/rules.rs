//! The part of a configuration that a reload swaps: the compiled rule
//! table, and the live side tables built beside it, keyed by route or
//! upstream index.

use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;

use crate::client::ClientId;
use crate::concurrency::Capacity;
use crate::concurrency::metrics::Capacities;
use crate::config::Config;
use crate::metrics::{Metrics, RouteMetrics};
use crate::proxy::ClientSide;
use crate::proxy::balance::Group;
use crate::proxy::metrics::Endpoints;
use crate::routes::{EscapedSlashes, Table};
use crate::top::RouteTop;

use super::metering::Metering;

/// The rules in force: what the file says, and the live state each route
/// and upstream needs.
#[derive(Debug)]
pub struct Rules {
    /// Routes, first match wins.
    pub routes: Table,
    /// The upstreams' endpoints with their health and connection pools,
    /// by upstream index (a route's [`crate::routes::Upstream::index`]).
    pub upstreams: Vec<Arc<Group>>,
    /// Peers whose `X-Forwarded-For` is believed.
    pub trusted_proxies: Vec<IpNet>,
    /// Peers of the decision listener whose `X-Original-*` and
    /// `X-Forwarded-*` describe the request to decide.
    pub decision_peers: Vec<IpNet>,
    /// Headers removed from the requests of other peers before they are
    /// forwarded (`strip_untrusted_headers`).
    pub strip_untrusted_headers: Vec<http::HeaderName>,
    /// What `%2F`, `%5C` and `\` in a request path do.
    pub escaped_slashes: EscapedSlashes,
    /// How long a client's request body and an upgraded connection may idle.
    pub client_timeouts: ClientSide,
    /// How long a client may leave its answer unread.
    pub client_write_timeout: Duration,
    /// What each route has live beside its compiled rules, in the
    /// table's order.
    pub live: Vec<Live>,
}

/// One route's live state beside its compiled rules.
#[derive(Debug)]
pub struct Live {
    /// Its metric handles.
    pub metrics: RouteMetrics,
    /// Its heaviest clients; counted only when the admin listener (which
    /// shows them) is configured.
    pub top: Option<RouteTop>,
    /// Its concurrency cap (`None`: uncapped). A reload keeps a route's
    /// cap, and what it counts, when its name and settings are unchanged.
    pub capacity: Option<Arc<Capacity>>,
    /// Its usage counters (`None`: its cost is fixed).
    pub metering: Option<Arc<Metering>>,
}

impl Rules {
    /// The rules of `config`, forwarding to `upstreams` (from
    /// [`start_upstreams`]), counting into `metrics`, keeping the
    /// concurrency caps of `previous` rules that did not change. The
    /// metrics show these rules' endpoints and caps from now on.
    pub fn new(
        config: &Config,
        upstreams: Vec<Arc<Group>>,
        metrics: &Metrics,
        previous: Option<&Rules>,
    ) -> Self {
        metrics.show_endpoints(Endpoints::new(upstreams.clone()));
        let capacity = capacities(config, previous);
        metrics.show_capacities(Capacities::new(
            config
                .routes
                .iter()
                .zip(&capacity)
                .filter_map(|(r, c)| Some((Arc::clone(&r.name), Arc::clone(c.as_ref()?))))
                .collect(),
        ));
        let shows_top = config.server.admin_listen.is_some();
        let live = config
            .routes
            .iter()
            .zip(metrics.bind(config.routes.iter().map(|r| &*r.name)))
            .zip(capacity)
            .map(|((r, route_metrics), capacity)| Live {
                metrics: route_metrics,
                top: shows_top.then(RouteTop::default),
                capacity,
                metering: r
                    .usage
                    .as_ref()
                    .map(|_| Arc::new(Metering::new(metrics.bind_usage(&r.name)))),
            })
            .collect();
        Self {
            live,
            upstreams,
            routes: config.routes.clone(),
            trusted_proxies: config.server.trusted_proxies.clone(),
            decision_peers: config.server.decision_peers.clone(),
            strip_untrusted_headers: config.server.strip_untrusted_headers.clone(),
            escaped_slashes: config.server.escaped_slashes,
            client_timeouts: ClientSide {
                body: config.server.client_body_timeout,
                buffer: config.server.request_buffer,
                min_rate: config.server.client_body_min_rate,
                min_rate_after: config.server.client_body_min_rate_after,
                upgraded: config.server.upgrade_idle_timeout,
                max_body: None,
            },
            client_write_timeout: config.server.client_write_timeout,
        }
    }

    /// Counts a decided request of `client` on the route at `index` among
    /// the route's top clients (when the admin listener shows them): every
    /// way in that decides (the proxy listener, the decision listener,
    /// Envoy's rate limit service) counts through here alike.
    /// Route `index`'s live state.
    #[inline]
    pub fn live(&self, index: usize) -> Option<&Live> {
        self.live.get(index)
    }

    #[inline]
    pub fn count_top(&self, index: usize, client: &ClientId, denied: bool) {
        if let Some(route_top) = self.live.get(index).and_then(|l| l.top.as_ref()) {
            route_top.count(client, denied, crate::clock::now_ms() / 1000);
        }
    }
}

/// Each route's concurrency caps: `previous`'s where the route's name and
/// settings are unchanged, else new ones.
fn capacities(config: &Config, previous: Option<&Rules>) -> Vec<Option<Arc<Capacity>>> {
    config
        .routes
        .iter()
        .map(|route| {
            let settings = route.concurrency.as_ref()?;
            let kept = previous.and_then(|p| {
                p.routes
                    .iter()
                    .zip(&p.live)
                    .find(|(r, l)| {
                        r.name == route.name
                            && l.capacity
                                .as_ref()
                                .is_some_and(|c| c.settings() == settings)
                    })
                    .and_then(|(_, l)| l.capacity.clone())
            });
            Some(kept.unwrap_or_else(|| {
                Arc::new(Capacity::new(
                    settings.clone(),
                    config.server.max_client_entries,
                ))
            }))
        })
        .collect()
}

/// The live upstreams of `config`, by upstream index: their DNS names
/// resolved (all at once), and the tasks started that resolve them again
/// and check their endpoints; each task ends when its upstream is dropped
/// by a reload. Called before the rules go live.
pub async fn start_upstreams(config: &Config) -> Vec<Arc<Group>> {
    let groups: Vec<Arc<Group>> = config
        .upstreams
        .iter()
        .map(|u| Arc::new(Group::new(u)))
        .collect();
    let mut starting = tokio::task::JoinSet::new();
    for group in &groups {
        let group = Arc::clone(group);
        starting.spawn(async move { group.start().await });
    }
    while starting.join_next().await.is_some() {}
    groups
}
