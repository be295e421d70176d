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
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;

use histogram::Histogram;

mod histogram;
pub mod history;
mod kinds;
mod leases;
mod process;
mod shown;
mod text;
mod usage;

pub use kinds::{Outcome, Phase, StoreErrorKind, StoreKind, Timeouts};
pub use leases::{LeaseFamilies, LeaseMetrics};
use process::Process;
use shown::Shown;
use text::text_format;
pub use usage::UsageMetrics;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteOutcome {
    route: String,
    outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteClass {
    route: String,
    class: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StoreLabel {
    store: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabel {
    status: String,
    fault: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TableLabel {
    table: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// A Redis node's address: one series per primary, so bounded by the
/// cluster's size.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    /// `host:port`, or the endpoint of a Redis that is not a cluster.
    pub node: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DigestLabel {
    digest: String,
}

fn latency_histogram() -> Histogram {
    // 50 µs to about 1.6 s.
    Histogram::new(exponential_buckets(0.000_05, 2.0, 16))
}

fn upstream_histogram() -> Histogram {
    // 1 ms to 300 s: past any upstream_timeout short of five minutes (the
    // default is 30 s), so a slow answer lands in a bucket of its own.
    Histogram::new([
        0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
        120.0, 300.0,
    ])
}

/// Every metric floodgate exposes.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<RouteOutcome, Counter>,
    upstream_responses: Family<RouteClass, Counter>,
    upstream_seconds: Family<RouteLabel, Histogram, fn() -> Histogram>,
    decision_seconds: Family<StoreLabel, Histogram, fn() -> Histogram>,
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
    /// Parts of refused requests given back in other cluster slots.
    pub given_back: Counter,
    /// Messages heard from the store: units given back (any instance).
    pub given_back_heard: Counter,
    /// 1 while this instance listens for units given back.
    pub listening: Gauge,
    /// Distinct rule sets the instances sharing the store ran lately.
    pub store_rule_sets: Gauge,
    /// Access log lines dropped because the writer fell behind.
    pub access_log_dropped: Counter,
    /// Access log lines for denials held back by the caps.
    pub access_log_suppressed: Counter,
    usage: usage::Families,
    leases: LeaseFamilies,
}

/// One route's metric handles, resolved once per load.
#[derive(Debug, Clone)]
pub struct RouteMetrics {
    outcomes: [Counter; 5],
    upstream_classes: [Counter; 5],
    upstream_seconds: Histogram,
}

/// The store's metric handles.
#[derive(Debug, Clone)]
pub struct StoreMetrics {
    decision_seconds: [Histogram; 4],
    errors: [Counter; 4],
    /// 1 while the circuit breaker is open (every node's, on a cluster).
    pub circuit_open: Gauge,
    /// 1 while the breaker of one Redis node is open, by node.
    pub node_circuit_open: Family<NodeLabel, Gauge>,
    /// Calls sent to Redis to decide requests; one carries one or more
    /// decisions.
    pub redis_calls: Counter,
    /// Parts of refused requests given back in other cluster slots.
    pub given_back: Counter,
    /// Messages heard from the store: units given back (any instance).
    pub given_back_heard: Counter,
    /// 1 while this instance listens for units given back.
    pub listening: Gauge,
    /// The in-process tables: the memory store, the local fallback, the
    /// remembered denials.
    pub tables: [TableMetrics; 3],
    /// The leased limits' series.
    pub leases: LeaseFamilies,
}

/// One in-process table's size and the clients it had no room for.
#[derive(Debug, Clone, Default)]
pub struct TableMetrics {
    /// Entries held, as of the last sweep.
    pub entries: Gauge,
    /// New clients that found the table full.
    pub full: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// A registry with every metric registered.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::default();
        registry.register(
            "floodgate_requests",
            "Requests by route and outcome (allowed, denied, shadow_denied, exempt, store_error)",
            requests.clone(),
        );
        let no_route = Counter::default();
        registry.register(
            "floodgate_requests_no_route",
            "Requests that matched no route (answered 404)",
            no_route.clone(),
        );
        let decision_seconds: Family<StoreLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "floodgate_decision_seconds",
            "Time to decide a request's limits, by store (memory, redis, local, cache)",
            decision_seconds.clone(),
        );
        let store_errors = Family::default();
        registry.register(
            "floodgate_store_errors",
            "Store decisions that failed, by kind (timeout, backend, circuit_open, refused: the store refuses floodgate's settings)",
            store_errors.clone(),
        );
        let store_rule_sets = Gauge::default();
        registry.register(
            "floodgate_store_rule_sets",
            "Distinct sets of limits (digests of the routes' names, costs and limits) the instances sharing the store announced in the last 30 s; above 1, instances enforce different limits on the same keys",
            store_rule_sets.clone(),
        );
        let circuit_open = Gauge::default();
        registry.register(
            "floodgate_store_circuit_open",
            "1 while the circuit breaker around the shared store is open",
            circuit_open.clone(),
        );
        let node_circuit_open = Family::default();
        registry.register(
            "floodgate_redis_node_circuit_open",
            "1 while the circuit breaker of one Redis node (a cluster primary, or the one Redis) is open, by node",
            node_circuit_open.clone(),
        );
        let redis_calls = Counter::default();
        registry.register(
            "floodgate_redis_calls",
            "Calls sent to Redis to decide requests; under load one call carries several decisions",
            redis_calls.clone(),
        );
        let given_back = Counter::default();
        registry.register(
            "floodgate_store_given_back",
            "Units a request held in one Redis Cluster slot and gave back because a limit in another slot refused it (a limit keyed by another identity, or a budget, hashed elsewhere); each is a moment where a concurrent request could have been refused for units later given back",
            given_back.clone(),
        );
        let leases = LeaseFamilies::register(&mut registry);
        let given_back_heard = Counter::default();
        registry.register(
            "floodgate_store_given_back_heard",
            "Messages from the shared store that a settlement (on any instance) gave units back to a key; each ends this instance's remembered denials of that key",
            given_back_heard.clone(),
        );
        let listening = Gauge::default();
        registry.register(
            "floodgate_store_listening",
            "1 while this instance listens to the shared store for units given back; while 0, no denial is remembered (each refused request asks the store)",
            listening.clone(),
        );
        let upstream_responses = Family::default();
        registry.register(
            "floodgate_upstream_responses",
            "The upstream's own answers by route and status class (1xx to 5xx); floodgate's 502, 504 and 4xx answers are in floodgate_refusals",
            upstream_responses.clone(),
        );
        let upstream_seconds: Family<RouteLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(upstream_histogram);
        registry.register(
            "floodgate_upstream_seconds",
            "Time until the upstream's response head, by route",
            upstream_seconds.clone(),
        );
        let open_connections = Gauge::default();
        registry.register(
            "floodgate_open_connections",
            "Client connections open on the proxy listener",
            open_connections.clone(),
        );
        let reloads = Family::default();
        registry.register(
            "floodgate_config_reloads",
            "Configuration reloads by result (success, failure)",
            reloads.clone(),
        );
        let config_info = Family::default();
        registry.register(
            "floodgate_config_info",
            "The configuration in force, by the first 16 hex digits of its SHA-256",
            config_info.clone(),
        );
        let last_reload_successful = Gauge::default();
        registry.register(
            "floodgate_config_last_reload_successful",
            "1 while the configuration file last read (at start or on a reload) was applied; 0 while the file on disk was refused and older rules run",
            last_reload_successful.clone(),
        );
        let last_reload_success = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "floodgate_config_last_reload_success_timestamp_seconds",
            "When a configuration was last applied (at start or on a reload), in seconds since the Unix epoch",
            last_reload_success.clone(),
        );
        let client_entries = Family::default();
        registry.register(
            "floodgate_client_entries",
            "(route, client) entries held in this instance's memory, by table (memory, local, denials), as of the last sweep (every second)",
            client_entries.clone(),
        );
        let client_entries_full = Family::default();
        registry.register(
            "floodgate_client_entries_full",
            "New clients that found their table full (max_client_entries): counted in their route's shared overflow bucket (memory, local), or their denial not remembered (denials)",
            client_entries_full.clone(),
        );
        let refusals = Family::default();
        registry.register(
            "floodgate_refusals",
            "Answers floodgate made itself instead of the upstream's, by status and fault (client: 4xx; upstream: 502, 504; store: 503); 429 denials are in floodgate_requests_total",
            refusals.clone(),
        );
        let timeout_family: Family<PhaseLabel, Counter> = Family::default();
        registry.register(
            "floodgate_timeouts",
            "Timeouts that fired, by phase: client_head (408), client_body (408), client_write (connection cut), upstream_connect (502), upstream_head (504), upstream_body (answer cut), upgrade_idle (tunnel closed)",
            timeout_family.clone(),
        );
        let timeouts = Timeouts {
            counters: Phase::ALL.map(|phase| {
                timeout_family
                    .get_or_create(&PhaseLabel {
                        phase: phase.name(),
                    })
                    .clone()
            }),
        };
        for result in ["success", "failure"] {
            let _ = reloads.get_or_create(&ResultLabel {
                result: result.into(),
            });
        }
        let access_log_dropped = Counter::default();
        registry.register(
            "floodgate_access_log_dropped",
            "Access log lines dropped because the writer fell behind the traffic",
            access_log_dropped.clone(),
        );
        let access_log_suppressed = Counter::default();
        registry.register(
            "floodgate_access_log_suppressed",
            "Access log lines for denials held back by the per-client and overall caps",
            access_log_suppressed.clone(),
        );
        let usage = usage::Families::default();
        usage.register(&mut registry);
        let endpoints = Arc::new(Shown::default());
        registry.register_collector(Box::new(Arc::clone(&endpoints)));
        let capacities = Arc::new(Shown::default());
        registry.register_collector(Box::new(Arc::clone(&capacities)));
        registry.register_collector(Box::new(Process::new()));
        let build_info = Family::<VersionLabel, Gauge>::default();
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        registry.register(
            "floodgate_build_info",
            "1, labelled with the version of floodgate that runs",
            build_info,
        );
        Self {
            registry,
            requests,
            upstream_responses,
            upstream_seconds,
            decision_seconds,
            store_errors,
            reloads,
            config_info,
            last_reload_successful,
            last_reload_success,
            client_entries,
            client_entries_full,
            refusals,
            timeouts,
            endpoints,
            capacities,
            config_digest: Mutex::new(String::new()),
            bound_routes: Mutex::new(Vec::new()),
            no_route,
            open_connections,
            circuit_open,
            store_rule_sets,
            node_circuit_open,
            redis_calls,
            given_back,
            given_back_heard,
            listening,
            access_log_dropped,
            access_log_suppressed,
            usage,
            leases,
        }
    }

    /// Resolves the handles of every route named in `routes`, in their
    /// order, and removes the series of routes the previous rules had and
    /// these do not. (A request still in flight on a removed route counts
    /// into handles that are no longer exported.)
    pub fn bind<'a>(&self, routes: impl IntoIterator<Item = &'a str>) -> Vec<RouteMetrics> {
        let names: Vec<String> = routes.into_iter().map(str::to_owned).collect();
        let mut bound = self
            .bound_routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in bound.iter().filter(|name| !names.contains(name)) {
            self.remove_route(gone);
        }
        *bound = names.clone();
        drop(bound);
        names
            .into_iter()
            .map(|name| {
                let outcome = |o: Outcome| {
                    self.requests
                        .get_or_create(&RouteOutcome {
                            route: name.clone(),
                            outcome: o.name().into(),
                        })
                        .clone()
                };
                let class = |c: usize| {
                    self.upstream_responses
                        .get_or_create(&RouteClass {
                            route: name.clone(),
                            class: format!("{c}xx"),
                        })
                        .clone()
                };
                RouteMetrics {
                    outcomes: Outcome::ALL.map(outcome),
                    upstream_classes: [1, 2, 3, 4, 5].map(class),
                    upstream_seconds: self
                        .upstream_seconds
                        .get_or_create(&RouteLabel {
                            route: name.clone(),
                        })
                        .clone(),
                }
            })
            .collect()
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

    /// Removes every series labelled with route `name`.
    /// The usage handles of metered route `route` (bound by
    /// [`Self::bind`]'s caller for the routes that meter; removed with the
    /// route's other series).
    pub fn bind_usage(&self, route: &str) -> UsageMetrics {
        self.usage.bind(route)
    }

    fn remove_route(&self, name: &str) {
        self.usage.remove(name);
        for outcome in Outcome::ALL {
            self.requests.remove(&RouteOutcome {
                route: name.to_owned(),
                outcome: outcome.name().into(),
            });
        }
        for class in 1..=5 {
            self.upstream_responses.remove(&RouteClass {
                route: name.to_owned(),
                class: format!("{class}xx"),
            });
        }
        self.upstream_seconds.remove(&RouteLabel {
            route: name.to_owned(),
        });
    }

    /// The store's handles.
    pub fn store(&self) -> StoreMetrics {
        let histogram = |store: &str| {
            self.decision_seconds
                .get_or_create(&StoreLabel {
                    store: store.into(),
                })
                .clone()
        };
        let counter = |kind: &str| {
            self.store_errors
                .get_or_create(&KindLabel { kind: kind.into() })
                .clone()
        };
        StoreMetrics {
            decision_seconds: [
                histogram("memory"),
                histogram("redis"),
                histogram("local"),
                histogram("cache"),
            ],
            errors: [
                counter("timeout"),
                counter("backend"),
                counter("circuit_open"),
                counter("refused"),
            ],
            circuit_open: self.circuit_open.clone(),
            node_circuit_open: self.node_circuit_open.clone(),
            redis_calls: self.redis_calls.clone(),
            given_back: self.given_back.clone(),
            given_back_heard: self.given_back_heard.clone(),
            listening: self.listening.clone(),
            leases: self.leases.clone(),
            tables: ["memory", "local", "denials"].map(|table| {
                let label = TableLabel {
                    table: table.into(),
                };
                TableMetrics {
                    entries: self.client_entries.get_or_create(&label).clone(),
                    full: self.client_entries_full.get_or_create(&label).clone(),
                }
            }),
        }
    }

    /// Counts an answer floodgate made itself. Statuses are floodgate's own
    /// few, so the series stay bounded.
    pub fn refused(&self, refusal: &crate::refusal::Refusal) {
        self.refusals
            .get_or_create(&RefusalLabel {
                status: refusal.status().as_str().to_owned(),
                fault: refusal.fault().name().to_owned(),
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

impl RouteMetrics {
    /// The requests counted so far, by [`Outcome`] (in [`Outcome::ALL`]'s
    /// order).
    pub fn counts(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.outcomes[i].get())
    }

    /// Counts one request's outcome.
    pub fn count(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].inc();
    }

    /// Answers of 500 and above from the upstream so far.
    pub fn upstream_5xx(&self) -> u64 {
        self.upstream_classes[4].get()
    }

    /// Records an upstream's own answer (floodgate's refusals are counted
    /// apart).
    pub fn upstream(&self, status: u16, took: Duration) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.upstream_classes[class].inc();
        self.upstream_seconds.observe(took);
    }
}

impl StoreMetrics {
    /// Records how long a decision by `kind` took.
    pub fn decided(&self, kind: StoreKind, took: Duration) {
        self.decision_seconds[kind as usize].observe(took);
    }

    /// Counts a failed decision.
    pub fn failed(&self, kind: StoreErrorKind) {
        self.errors[kind as usize].inc();
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}
