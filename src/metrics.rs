//! What happened, counted for the admin listener's `/metrics`.
//!
//! A prometheus-client registry holds every metric; the data path never looks
//! a metric up by label: each route's handles are resolved once when rules
//! are loaded, so counting is an atomic add. Labels are route names,
//! outcomes, status classes and store kinds: never client ids, so the number
//! of series is bounded by the configuration. A reload that removes a route
//! removes its series too, so `/metrics` lists only routes in force.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::proxy::balance::{Failure, Group};
use crate::routes::Table;

/// What happened to a request on a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The limits allowed it (or the route has none).
    Allowed,
    /// The limits denied it: 429.
    Denied,
    /// The limits would have denied it, but the route is in shadow mode.
    ShadowDenied,
    /// The client is exempt from the route's limits.
    Exempt,
    /// The store could not decide; `on_error` applied.
    StoreError,
}

impl Outcome {
    /// Every outcome, in exposition order.
    pub const ALL: [Outcome; 5] = [
        Outcome::Allowed,
        Outcome::Denied,
        Outcome::ShadowDenied,
        Outcome::Exempt,
        Outcome::StoreError,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Denied => "denied",
            Self::ShadowDenied => "shadow_denied",
            Self::Exempt => "exempt",
            Self::StoreError => "store_error",
        }
    }
}

/// Which store answered a decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    /// The in-process store (`backend = "memory"`).
    Memory,
    /// Redis.
    Redis,
    /// The in-process fallback while Redis is down (`on_error = "local"`).
    Local,
    /// A denial remembered until its retry-after (no Redis call).
    Cache,
}

/// Why a store decision failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreErrorKind {
    /// No answer within `timeout`.
    Timeout,
    /// An error from Redis or the connection.
    Backend,
    /// Not asked: the circuit breaker is open.
    CircuitOpen,
}

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

/// The phases of an exchange that have a timeout of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The client's request head (`header_read_timeout`).
    ClientHead,
    /// The client's request body (`client_body_timeout`).
    ClientBody,
    /// The client reading floodgate's answer (`client_write_timeout`).
    ClientWrite,
    /// A new upstream connection (`upstream_connect_timeout`).
    UpstreamConnect,
    /// The upstream's response head (`upstream_timeout`).
    UpstreamHead,
    /// The upstream's response body (`upstream_body_timeout`).
    UpstreamBody,
    /// An upgraded connection (`upgrade_idle_timeout`).
    UpgradeIdle,
}

impl Phase {
    /// Every phase, in exposition order.
    pub const ALL: [Phase; 7] = [
        Phase::ClientHead,
        Phase::ClientBody,
        Phase::ClientWrite,
        Phase::UpstreamConnect,
        Phase::UpstreamHead,
        Phase::UpstreamBody,
        Phase::UpgradeIdle,
    ];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::ClientHead => "client_head",
            Self::ClientBody => "client_body",
            Self::ClientWrite => "client_write",
            Self::UpstreamConnect => "upstream_connect",
            Self::UpstreamHead => "upstream_head",
            Self::UpstreamBody => "upstream_body",
            Self::UpgradeIdle => "upgrade_idle",
        }
    }
}

/// The timeout counters, one per phase, resolved once.
#[derive(Debug, Clone)]
pub struct Timeouts {
    counters: [Counter; 7],
}

impl Timeouts {
    /// Counts a timeout in `phase`.
    pub fn count(&self, phase: Phase) {
        self.counter(phase).inc();
    }

    /// The counter of `phase`, to keep where the timeout fires.
    pub fn counter(&self, phase: Phase) -> &Counter {
        &self.counters[phase as usize]
    }
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
    client_entries: Family<TableLabel, Gauge>,
    client_entries_full: Family<TableLabel, Counter>,
    refusals: Family<RefusalLabel, Counter>,
    timeouts: Timeouts,
    endpoints: Arc<Endpoints>,
    capacities: Arc<Capacities>,
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
    /// Access log lines dropped because the writer fell behind.
    pub access_log_dropped: Counter,
    /// Access log lines for denials held back by the caps.
    pub access_log_suppressed: Counter,
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
    errors: [Counter; 3],
    /// 1 while the circuit breaker is open (every node's, on a cluster).
    pub circuit_open: Gauge,
    /// 1 while the breaker of one Redis node is open, by node.
    pub node_circuit_open: Family<NodeLabel, Gauge>,
    /// Calls sent to Redis to decide requests; one carries one or more
    /// decisions.
    pub redis_calls: Counter,
    /// The in-process tables: the memory store, the local fallback, the
    /// remembered denials.
    pub tables: [TableMetrics; 3],
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
            "Store decisions that failed, by kind (timeout, backend, circuit_open)",
            store_errors.clone(),
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
        let upstream_responses = Family::default();
        registry.register(
            "floodgate_upstream_responses",
            "Upstream responses by route and status class (1xx to 5xx; 502 and 504 are floodgate's own)",
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
        let endpoints = Arc::new(Endpoints::default());
        registry.register_collector(Box::new(Arc::clone(&endpoints)));
        let capacities = Arc::new(Capacities::default());
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
            node_circuit_open,
            redis_calls,
            access_log_dropped,
            access_log_suppressed,
        }
    }

    /// Resolves every route's handles, in table order, and removes the
    /// series of routes the previous rules had and these do not. (A request
    /// still in flight on a removed route counts into handles that are no
    /// longer exported.)
    pub fn bind(&self, routes: &Table) -> Vec<RouteMetrics> {
        let names: Vec<String> = routes.iter().map(|r| r.name.to_string()).collect();
        let mut bound = self
            .bound_routes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for gone in bound.iter().filter(|name| !names.contains(name)) {
            self.remove_route(gone);
        }
        *bound = names;
        drop(bound);
        routes
            .iter()
            .map(|route| {
                let name = route.name.to_string();
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

    /// Exports the endpoints of `upstreams` (those of the rules in force)
    /// in place of the previous rules' ones.
    pub fn bind_upstreams(&self, upstreams: Vec<Arc<Group>>) {
        self.endpoints.groups.store(Arc::new(upstreams));
    }

    /// Exports the concurrency caps of the rules in force, by route.
    pub fn bind_capacity(&self, caps: Vec<(Arc<str>, Arc<crate::concurrency::Capacity>)>) {
        self.capacities.caps.store(Arc::new(caps));
    }

    /// Removes every series labelled with route `name`.
    fn remove_route(&self, name: &str) {
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
            ],
            circuit_open: self.circuit_open.clone(),
            node_circuit_open: self.node_circuit_open.clone(),
            redis_calls: self.redis_calls.clone(),
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
        }
    }

    /// The digest of the configuration in force.
    pub fn config_digest(&self) -> String {
        self.config_digest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Marks `digest` as the configuration in force.
    pub fn config_loaded(&self, digest: &str) {
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

    /// Records an upstream answer (or floodgate's 400/502/504 in its place).
    pub fn upstream(&self, status: u16, took: Duration) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.upstream_classes[class].inc();
        self.upstream_seconds.observe(took.as_secs_f64());
    }
}

impl StoreMetrics {
    /// Records how long a decision by `kind` took.
    pub fn decided(&self, kind: StoreKind, took: Duration) {
        self.decision_seconds[kind as usize].observe(took.as_secs_f64());
    }

    /// Counts a failed decision.
    pub fn failed(&self, kind: StoreErrorKind) {
        self.errors[kind as usize].inc();
    }
}

/// The Prometheus text format 0.0.4 of an OpenMetrics exposition: a
/// counter's `HELP` and `TYPE` name its samples (`…_total`), and there is
/// no `UNIT` or `EOF` line.
fn text_format(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut help: Option<&str> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            if let Some(pending) = help.replace(rest) {
                out.push_str("# HELP ");
                out.push_str(pending);
                out.push('\n');
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let (name, kind) = match kind {
                "counter" => (format!("{name}_total"), "counter"),
                "gauge" | "histogram" | "summary" => (name.to_owned(), kind),
                _ => (name.to_owned(), "untyped"),
            };
            if let Some(text) = help.take() {
                let text = text.split_once(' ').map_or("", |(_, t)| t);
                out.push_str(&format!("# HELP {name} {text}\n"));
            }
            out.push_str(&format!("# TYPE {name} {kind}\n"));
            continue;
        }
        if let Some(pending) = help.take() {
            out.push_str("# HELP ");
            out.push_str(pending);
            out.push('\n');
        }
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

// === The process ===

/// The standard `process_*` metrics, read from `/proc` at each scrape.
#[derive(Debug)]
struct Process {
    /// When it started, in seconds since the Unix epoch.
    started: f64,
}

impl Process {
    fn new() -> Self {
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        Self { started }
    }
}

/// Clock ticks per second in `/proc/self/stat` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        // utime and stime are the 14th and 15th fields; the 2nd, the
        // command, is in parentheses and may hold spaces.
        let cpu = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                let after = stat.rsplit_once(')')?.1;
                let fields: Vec<&str> = after.split_whitespace().collect();
                let ticks = |i: usize| fields.get(i)?.parse::<u64>().ok();
                Some((ticks(11)? + ticks(12)?) as f64 / TICKS_PER_SECOND)
            });
        if let Some(cpu) = cpu {
            let family = encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent by the process, in seconds.",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(family)?;
        }
        let resident = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|status| {
                let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
                let kib = line.split_whitespace().nth(1)?.parse::<i64>().ok()?;
                Some(kib * 1024)
            });
        if let Some(bytes) = resident {
            let family = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory of the process, in bytes.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(bytes).encode(family)?;
        }
        if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
            let family = encoder.encode_descriptor(
                "process_open_fds",
                "File descriptors the process holds open.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(fds.count()).unwrap_or(i64::MAX)).encode(family)?;
        }
        if let Some(max) = rustix::process::getrlimit(rustix::process::Resource::Nofile).current {
            let family = encoder.encode_descriptor(
                "process_max_fds",
                "Most file descriptors the process may open.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(i64::try_from(max).unwrap_or(i64::MAX)).encode(family)?;
        }
        let family = encoder.encode_descriptor(
            "process_start_time_seconds",
            "When the process started, in seconds since the Unix epoch.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(self.started).encode(family)?;
        Ok(())
    }
}

// === Concurrency caps ===

/// The routes' concurrency series, read from the caps in force at each
/// scrape.
#[derive(Debug, Default)]
struct Capacities {
    caps: ArcSwap<Vec<(Arc<str>, Arc<crate::concurrency::Capacity>)>>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    route: String,
    reason: &'static str,
}

impl Collector for Capacities {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        use crate::concurrency::Capacity;
        let caps = self.caps.load();
        type Read = fn(&Capacity) -> usize;
        let gauges: [(&str, &str, Read); 3] = [
            (
                "floodgate_concurrency_in_flight",
                "Requests in flight on each route with a concurrency cap (all its clients together for per-client caps).",
                Capacity::in_flight,
            ),
            (
                "floodgate_concurrency_waiting",
                "Requests waiting in each route's concurrency queue.",
                Capacity::waiting,
            ),
            (
                "floodgate_concurrency_limit",
                "Each route's concurrency cap now (an adaptive cap moves; per-client caps are per client).",
                Capacity::limit,
            ),
        ];
        for (name, help, read) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (route, cap) in caps.iter() {
                let label = RouteLabel {
                    route: route.to_string(),
                };
                ConstGauge::new(i64::try_from(read(cap)).unwrap_or(i64::MAX))
                    .encode(family.encode_family(&label)?)?;
            }
        }
        let mut family = encoder.encode_descriptor(
            "floodgate_concurrency_refusals",
            "Requests refused by each route's concurrency cap, by reason (full: no slot and no room in the queue; queue_timeout: waited the whole queue_timeout).",
            None,
            MetricType::Counter,
        )?;
        for (route, cap) in caps.iter() {
            for reason in crate::concurrency::Refused::ALL {
                let label = ReasonLabel {
                    route: route.to_string(),
                    reason: reason.name(),
                };
                ConstCounter::new(cap.refusals(reason) as u64)
                    .encode(family.encode_family(&label)?)?;
            }
        }
        Ok(())
    }
}

// === Upstream endpoints ===

/// The upstream endpoints' series, read from the endpoints in force at each
/// scrape: the addresses of a DNS name come and go, and so do their series,
/// so their number stays that of the endpoints in force.
#[derive(Debug, Default)]
struct Endpoints {
    groups: ArcSwap<Vec<Arc<Group>>>,
}

/// A metric's name, help and value, read from an endpoint's stats.
type Series<T> = (
    &'static str,
    &'static str,
    fn(&crate::proxy::balance::Stats) -> T,
);

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndpointLabel {
    upstream: String,
    endpoint: String,
    address: String,
}

impl Collector for Endpoints {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let groups = self.groups.load();
        let mut rows = Vec::new();
        for group in groups.iter() {
            for member in group.members().iter() {
                let label = EndpointLabel {
                    upstream: group.name.to_string(),
                    endpoint: group.configured(member).to_owned(),
                    address: member.address().to_owned(),
                };
                rows.push((label, member.stats()));
            }
        }
        let counters: [Series<u64>; 2] = [
            (
                "floodgate_upstream_endpoint_requests",
                "Requests sent to each upstream endpoint (a retry counts where it went).",
                |s| s.requests,
            ),
            (
                "floodgate_upstream_endpoint_ejections",
                "Times each upstream endpoint was ejected after failing in a row.",
                |s| s.ejections,
            ),
        ];
        for (name, help, value) in counters {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (label, stats) in &rows {
                ConstCounter::new(value(stats)).encode(family.encode_family(label)?)?;
            }
        }
        {
            let mut family = encoder.encode_descriptor(
                "floodgate_upstream_endpoint_errors",
                "Failures of each upstream endpoint by kind (connect, timeout, protocol).",
                None,
                MetricType::Counter,
            )?;
            for (label, stats) in &rows {
                for kind in Failure::ALL {
                    let labels = (
                        label.clone(),
                        KindLabel {
                            kind: kind.name().into(),
                        },
                    );
                    ConstCounter::new(stats.errors[kind as usize])
                        .encode(family.encode_family(&labels)?)?;
                }
            }
        }
        let gauges: [Series<i64>; 2] = [
            (
                "floodgate_upstream_endpoint_in_flight",
                "Requests in flight on each upstream endpoint.",
                |s| i64::try_from(s.in_flight).unwrap_or(i64::MAX),
            ),
            (
                "floodgate_upstream_endpoint_healthy",
                "1 while an upstream endpoint takes requests (not ejected, not failing its health check).",
                |s| i64::from(s.healthy),
            ),
        ];
        for (name, help, value) in gauges {
            let mut family = encoder.encode_descriptor(name, help, None, MetricType::Gauge)?;
            for (label, stats) in &rows {
                ConstGauge::new(value(stats)).encode(family.encode_family(label)?)?;
            }
        }
        Ok(())
    }
}
