//! What happened, counted for the admin listener's `/metrics`.
//!
//! A prometheus-client registry holds every metric; the data path never looks
//! a metric up by label: each route's handles are resolved once when rules
//! are loaded, so counting is an atomic add. Labels are route names,
//! outcomes, status classes and store kinds: never client ids, so the number
//! of series is bounded by the configuration. A reload that removes a route
//! removes its series too, so `/metrics` lists only routes in force.
//!
//! [`history`] keeps what the dashboard draws: each route's outcomes in
//! 5-second buckets over the last 15 minutes, taken from these counters.

use std::sync::{Arc, Mutex};

use prometheus_client::collector::Collector;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use families::{
    AccessLogFamilies, Collectors, ConfigFamilies, DigestLabel, Histograms, KindLabel,
    RefusalLabel, RequestFamilies, ResultLabel, RouteClass, RouteLabel, RouteOutcome,
    StoreFamilies, StoreLabel, TableFamilies, TableLabel, UpstreamFamilies,
};

mod families;
mod histogram;
pub mod history;
mod kinds;
mod leases;
mod process;
mod route;
mod shown;
mod store;
mod text;
mod usage;

pub use families::{HeldBound, HeldEnd, NodeLabel};
pub use kinds::{CountedRefusal, Outcome, Phase, StoreErrorKind, StoreKind, Timeouts};
pub use leases::{LeaseFamilies, LeaseMetrics};
pub use route::RouteMetrics;
use shown::Shown;
pub use store::{StoreMetrics, TableMetrics};
use text::text_format;
pub use usage::UsageMetrics;

/// Every metric floodgate exposes.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteOutcome, Counter>,
    count_when: Family<families::RouteCounted, Counter>,
    penalized: Family<RouteLabel, Counter>,
    upstream_responses: Family<RouteClass, Counter>,
    upstream_seconds: Histograms<RouteLabel>,
    decision_seconds: Histograms<StoreLabel>,
    store_errors: Family<KindLabel, Counter>,
    reloads: Family<ResultLabel, Counter>,
    config_info: Family<DigestLabel, Gauge>,
    last_reload_successful: Gauge,
    last_reload_success: Gauge<f64, std::sync::atomic::AtomicU64>,
    client_entries: Family<TableLabel, Gauge>,
    client_entries_full: Family<TableLabel, Counter>,
    refusals: Family<RefusalLabel, Counter>,
    timeouts: Timeouts,
    /// The upstream endpoints' series, shown by the proxy's collector.
    endpoints: Arc<Shown>,
    /// The concurrency caps' series, shown by their own collector.
    capacities: Arc<Shown>,
    keys: Arc<Shown>,
    config_digest: Mutex<String>,
    /// The route names of the rules last bound: the series to remove when
    /// a reload drops one of them.
    bound_routes: Mutex<Vec<String>>,
    /// Requests that matched no route.
    pub no_route: Counter,
    /// Connections open on the proxy listener.
    pub open_connections: Gauge,
    /// 1 while the shared store's circuit breaker is open.
    pub circuit_open: Gauge,
    /// 1 while the breaker of one Redis node is open, by node.
    pub node_circuit_open: Family<NodeLabel, Gauge>,
    /// Calls sent to Redis to decide requests.
    pub redis_calls: Counter,
    /// Units of refused requests given back in other cluster slots.
    pub given_back: Counter,
    /// Messages heard from the store: units given back (any instance).
    pub given_back_heard: Counter,
    /// 1 while this instance listens for units given back.
    pub listening: Gauge,
    /// PINGs sent so every message of units given back already sent is
    /// read before a refusal from memory.
    pub given_back_barrier_pings: Counter,
    /// Distinct rule sets the instances sharing the store ran lately.
    pub store_rule_sets: Gauge,
    /// Access log lines dropped because the writer fell behind.
    pub access_log_dropped: Counter,
    /// Access log lines for denials held back by the caps.
    pub access_log_suppressed: Counter,
    usage: usage::Families,
    leases: LeaseFamilies,
    held: families::HeldFamilies,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered: each group of families
    /// registers itself, in exposition order.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = RequestFamilies::register(&mut registry);
        let store = StoreFamilies::register(&mut registry);
        let upstream = UpstreamFamilies::register(&mut registry);
        let open_connections = families::register_open_connections(&mut registry);
        let held = families::HeldFamilies::register(&mut registry);
        let config = ConfigFamilies::register(&mut registry);
        let tables = TableFamilies::register(&mut registry);
        let refusals = families::register_refusals(&mut registry);
        let timeouts = families::register_timeouts(&mut registry);
        let access_log = AccessLogFamilies::register(&mut registry);
        let usage = usage::Families::default();
        usage.register(&mut registry);
        let shown = Collectors::register(&mut registry);
        families::register_build_info(&mut registry);
        Self {
            registry,
            requests: requests.requests,
            count_when: requests.count_when,
            penalized: requests.penalized,
            upstream_responses: upstream.upstream_responses,
            upstream_seconds: upstream.upstream_seconds,
            decision_seconds: store.decision_seconds,
            store_errors: store.store_errors,
            reloads: config.reloads,
            config_info: config.config_info,
            last_reload_successful: config.last_reload_successful,
            last_reload_success: config.last_reload_success,
            client_entries: tables.client_entries,
            client_entries_full: tables.client_entries_full,
            refusals,
            timeouts,
            endpoints: shown.endpoints,
            capacities: shown.capacities,
            keys: shown.keys,
            config_digest: Mutex::new(String::new()),
            bound_routes: Mutex::new(Vec::new()),
            no_route: requests.no_route,
            open_connections,
            circuit_open: store.circuit_open,
            node_circuit_open: store.node_circuit_open,
            redis_calls: store.redis_calls,
            given_back: store.given_back,
            given_back_heard: store.given_back_heard,
            listening: store.listening,
            given_back_barrier_pings: store.given_back_barrier_pings,
            store_rule_sets: store.store_rule_sets,
            access_log_dropped: access_log.dropped,
            access_log_suppressed: access_log.suppressed,
            usage,
            leases: store.leases,
            held,
        }
    }

    /// Shows the upstream endpoints of the rules in force through
    /// `collector`, in place of the previous rules' one.
    pub fn show_endpoints(&self, collector: impl Collector) {
        self.endpoints.show(collector);
    }

    /// Shows the concurrency caps of the rules in force through
    /// `collector`, in place of the previous rules' one.
    pub fn show_capacities(&self, collector: impl Collector) {
        self.capacities.show(collector);
    }

    /// Shows the key registry through `collector`.
    pub fn show_keys(&self, collector: impl Collector) {
        self.keys.show(collector);
    }

    /// The held requests' handles: how many wait now, how holds ended,
    /// and requests that found a bound full.
    pub fn held(&self) -> (Gauge, Family<HeldEnd, Counter>, Family<HeldBound, Counter>) {
        (
            self.held.holding.clone(),
            self.held.ended.clone(),
            self.held.full.clone(),
        )
    }

    /// Counts an answer floodgate made itself. Statuses are floodgate's own
    /// few, so the series stay bounded.
    pub fn refused(&self, refusal: &impl CountedRefusal) {
        self.refusals
            .get_or_create(&RefusalLabel {
                status: refusal.status_label().to_owned(),
                fault: refusal.fault_label().to_owned(),
            })
            .inc();
    }

    /// The timeout counters.
    pub fn timeouts(&self) -> &Timeouts {
        &self.timeouts
    }

    /// Counts a reload and, when it applied, the digest now in force.
    pub fn reloaded(&self, applied: bool, digest: &str) {
        let result = if applied { "success" } else { "failure" };
        self.reloads
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
        if applied {
            self.config_loaded(digest);
        } else {
            self.last_reload_successful.set(0);
        }
    }

    /// Counts a reload of a file the configuration names, read on its own
    /// (a plan table, the keys file): `applied` or refused, and whether
    /// every file's last read applied (`floodgate_config_last_reload_successful`).
    pub fn file_reloaded(&self, applied: bool, all_applied: bool) {
        let result = if applied { "success" } else { "failure" };
        self.reloads
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
        self.last_reload_successful.set(i64::from(all_applied));
        if applied && all_applied {
            self.last_reload_success
                .set(crate::clock::now_ms() as f64 / 1000.0);
        }
    }

    /// The digest of the configuration in force.
    pub fn config_digest(&self) -> String {
        self.config_digest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Marks `digest` as the configuration in force, applied now.
    pub fn config_loaded(&self, digest: &str) {
        self.last_reload_successful.set(1);
        self.last_reload_success
            .set(crate::clock::now_ms() as f64 / 1000.0);
        let mut current = self
            .config_digest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !current.is_empty() {
            self.config_info.remove(&DigestLabel {
                digest: current.clone(),
            });
        }
        self.config_info
            .get_or_create(&DigestLabel {
                digest: digest.into(),
            })
            .set(1);
        *current = digest.to_owned();
    }

    /// The OpenMetrics text exposition of everything.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "cannot encode metrics");
        }
        out
    }

    /// The same in the Prometheus text format 0.0.4, for scrapers that ask
    /// for it.
    pub fn render_text(&self) -> String {
        text_format(&self.render())
    }
}
