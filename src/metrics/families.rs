//! Every family floodgate registers, grouped by the part of floodgate
//! whose events it counts. Each group registers itself with its help text
//! and hands back its handles; [`super::Metrics::new`] lists the groups in
//! exposition order.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::registry::Registry;

use super::histogram::Histogram;
use super::kinds::{Phase, Timeouts};
use super::leases::LeaseFamilies;
use super::process::Process;
use super::shown::Shown;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteOutcome {
    pub(super) route: String,
    pub(super) outcome: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteClass {
    pub(super) route: String,
    pub(super) class: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteLabel {
    pub(super) route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct StoreLabel {
    pub(super) store: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RefusalLabel {
    pub(super) status: String,
    pub(super) fault: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabel {
    phase: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct TableLabel {
    pub(super) table: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct KindLabel {
    pub(super) kind: String,
}

/// A Redis node's address: one series per primary, so bounded by the
/// cluster's size.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct NodeLabel {
    /// `host:port`, or the endpoint of a Redis that is not a cluster.
    pub node: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct ResultLabel {
    pub(super) result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct DigestLabel {
    pub(super) digest: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabel {
    version: &'static str,
}

/// A family of histograms, each made with its family's buckets.
pub(super) type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

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

/// The gate's requests: by route and outcome, and those no route matched.
pub(super) struct RequestFamilies {
    pub(super) requests: Family<RouteOutcome, Counter>,
    pub(super) no_route: Counter,
    pub(super) count_when: Family<RouteCounted, Counter>,
    pub(super) penalized: Family<RouteLabel, Counter>,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(super) struct RouteCounted {
    pub(super) route: String,
    pub(super) counted: &'static str,
}

impl RequestFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
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
        let count_when = Family::default();
        registry.register(
            "floodgate_count_when_answers",
            "Answers meeting limits that count by the answer (count_when), one per such limit, by route and whether the limit counted it (yes) or gave the request's units back (no)",
            count_when.clone(),
        );
        let penalized = Family::default();
        registry.register(
            "floodgate_penalty_refusals",
            "Requests refused by a limit with a penalty, by route: the offence that starts a penalty and every refusal while it runs",
            penalized.clone(),
        );
        Self {
            requests,
            no_route,
            count_when,
            penalized,
        }
    }
}

/// The rate limit store's: how long decisions took and how they failed,
/// its breakers, its calls, the units given back, the leased limits.
pub(super) struct StoreFamilies {
    pub(super) decision_seconds: Histograms<StoreLabel>,
    pub(super) store_errors: Family<KindLabel, Counter>,
    pub(super) store_rule_sets: Gauge,
    pub(super) circuit_open: Gauge,
    pub(super) node_circuit_open: Family<NodeLabel, Gauge>,
    pub(super) redis_calls: Counter,
    pub(super) given_back: Counter,
    pub(super) leases: LeaseFamilies,
    pub(super) given_back_heard: Counter,
    pub(super) listening: Gauge,
    pub(super) given_back_barrier_pings: Counter,
}

impl StoreFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let decision_seconds: Histograms<StoreLabel> =
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
        let (circuit_open, node_circuit_open) = Self::register_breakers(registry);
        let redis_calls = Counter::default();
        registry.register(
            "floodgate_redis_calls",
            "Calls sent to Redis to decide requests; under load one call carries several decisions",
            redis_calls.clone(),
        );
        let given_back = Counter::default();
        registry.register(
            "floodgate_store_given_back",
            "Units a request held in one Redis Cluster slot and gave back because a limit in another slot refused it (a limit keyed by another identity, or a budget, hashed elsewhere), per slot the most any of its limits took: the cost, or one for a limit counting requests; each is a moment where a concurrent request could have been refused for units later given back",
            given_back.clone(),
        );
        let leases = LeaseFamilies::register(registry);
        let (given_back_heard, listening, given_back_barrier_pings) =
            Self::register_given_back_heard(registry);
        Self {
            decision_seconds,
            store_errors,
            store_rule_sets,
            circuit_open,
            node_circuit_open,
            redis_calls,
            given_back,
            leases,
            given_back_heard,
            listening,
            given_back_barrier_pings,
        }
    }

    /// The shared store's breaker, and each Redis node's.
    fn register_breakers(registry: &mut Registry) -> (Gauge, Family<NodeLabel, Gauge>) {
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
        (circuit_open, node_circuit_open)
    }

    /// What this instance hears of units given back, whether it listens,
    /// and what reading every message before a refusal from memory costs.
    fn register_given_back_heard(registry: &mut Registry) -> (Counter, Gauge, Counter) {
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
        let barrier_pings = Counter::default();
        registry.register(
            "floodgate_store_given_back_barrier_pings",
            "PINGs sent on the subscriptions for units given back so that every message already sent is read before a request is refused from a remembered denial; requests arriving together share one, so at most about one per subscription per round trip to Redis",
            barrier_pings.clone(),
        );
        (given_back_heard, listening, barrier_pings)
    }
}

/// The upstreams': their own answers by class, and how long the heads
/// took.
pub(super) struct UpstreamFamilies {
    pub(super) upstream_responses: Family<RouteClass, Counter>,
    pub(super) upstream_seconds: Histograms<RouteLabel>,
}

impl UpstreamFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let upstream_responses = Family::default();
        registry.register(
            "floodgate_upstream_responses",
            "The upstream's own answers by route and status class (1xx to 5xx); floodgate's 502, 504 and 4xx answers are in floodgate_refusals",
            upstream_responses.clone(),
        );
        let upstream_seconds: Histograms<RouteLabel> =
            Family::new_with_constructor(upstream_histogram);
        registry.register(
            "floodgate_upstream_seconds",
            "Time until the upstream's response head, by route",
            upstream_seconds.clone(),
        );
        Self {
            upstream_responses,
            upstream_seconds,
        }
    }
}

/// The proxy listener's open connections.
pub(super) fn register_open_connections(registry: &mut Registry) -> Gauge {
    let open_connections = Gauge::default();
    registry.register(
        "floodgate_open_connections",
        "Client connections open on the proxy listener",
        open_connections.clone(),
    );
    open_connections
}

/// Requests held until their limits fit (a limit's `delay`): how many
/// wait now, how their holds ended, and how many found a bound full.
#[derive(Debug)]
pub(super) struct HeldFamilies {
    pub(super) holding: Gauge,
    pub(super) ended: Family<HeldEnd, Counter>,
    pub(super) full: Family<HeldBound, Counter>,
}

/// How a hold ended: `went` (forwarded once it fit) or `left` (its
/// client left first, and nothing went upstream).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeldEnd {
    /// `went` or `left`.
    pub ended: &'static str,
}

/// The bound a request found full: `instance` or `client`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HeldBound {
    /// `instance` or `client`.
    pub bound: &'static str,
}

impl HeldFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let holding = Gauge::default();
        registry.register(
            "floodgate_held_requests",
            "Requests held now until their limits fit (a limit's delay), on this instance",
            holding.clone(),
        );
        let ended = Family::default();
        registry.register(
            "floodgate_held",
            "Holds ended: went (forwarded once the request fit) or left (the client left while held; nothing went upstream)",
            ended.clone(),
        );
        let full = Family::default();
        registry.register(
            "floodgate_held_full",
            "Requests that found max_held (bound=instance) or max_held_per_client (bound=client) reached and were decided without a delay",
            full.clone(),
        );
        Self {
            holding,
            ended,
            full,
        }
    }
}

/// The configuration's: reloads by result, and the one in force.
pub(super) struct ConfigFamilies {
    pub(super) reloads: Family<ResultLabel, Counter>,
    pub(super) config_info: Family<DigestLabel, Gauge>,
    pub(super) last_reload_successful: Gauge,
    pub(super) last_reload_success: Gauge<f64, AtomicU64>,
}

impl ConfigFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let reloads = Family::default();
        registry.register(
            "floodgate_config_reloads",
            "Configuration reloads by result (success, failure)",
            reloads.clone(),
        );
        // Both results are shown from the start, at zero.
        for result in ["success", "failure"] {
            let _ = reloads.get_or_create(&ResultLabel {
                result: result.into(),
            });
        }
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
        let last_reload_success = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "floodgate_config_last_reload_success_timestamp_seconds",
            "When a configuration was last applied (at start or on a reload), in seconds since the Unix epoch",
            last_reload_success.clone(),
        );
        Self {
            reloads,
            config_info,
            last_reload_successful,
            last_reload_success,
        }
    }
}

/// The in-process tables': entries held, and new clients they had no room
/// for.
pub(super) struct TableFamilies {
    pub(super) client_entries: Family<TableLabel, Gauge>,
    pub(super) client_entries_full: Family<TableLabel, Counter>,
}

impl TableFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
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
        Self {
            client_entries,
            client_entries_full,
        }
    }
}

/// The answers floodgate made itself, by status and fault.
pub(super) fn register_refusals(registry: &mut Registry) -> Family<RefusalLabel, Counter> {
    let refusals = Family::default();
    registry.register(
        "floodgate_refusals",
        "Answers floodgate made itself instead of the upstream's, by status and fault (client: 4xx; upstream: 502, 504; store: 503); 429 denials are in floodgate_requests_total",
        refusals.clone(),
    );
    refusals
}

/// The timeouts that fired, by phase, each phase's counter resolved once.
pub(super) fn register_timeouts(registry: &mut Registry) -> Timeouts {
    let timeout_family: Family<PhaseLabel, Counter> = Family::default();
    registry.register(
        "floodgate_timeouts",
        "Timeouts that fired, by phase: client_head (408), client_body (408), client_write (connection cut), upstream_connect (502), upstream_head (504), upstream_body (answer cut), upgrade_idle (tunnel closed)",
        timeout_family.clone(),
    );
    Timeouts {
        counters: Phase::ALL.map(|phase| {
            timeout_family
                .get_or_create(&PhaseLabel {
                    phase: phase.name(),
                })
                .clone()
        }),
    }
}

/// The access log's lines that were not written.
pub(super) struct AccessLogFamilies {
    pub(super) dropped: Counter,
    pub(super) suppressed: Counter,
}

impl AccessLogFamilies {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let dropped = Counter::default();
        registry.register(
            "floodgate_access_log_dropped",
            "Access log lines dropped because the writer fell behind the traffic",
            dropped.clone(),
        );
        let suppressed = Counter::default();
        registry.register(
            "floodgate_access_log_suppressed",
            "Access log lines for denials held back by the per-client and overall caps",
            suppressed.clone(),
        );
        Self {
            dropped,
            suppressed,
        }
    }
}

/// The series read from live state at each scrape: the upstream
/// endpoints' and the concurrency caps' (shown by their owners), and the
/// process's own.
pub(super) struct Collectors {
    pub(super) endpoints: Arc<Shown>,
    pub(super) capacities: Arc<Shown>,
    pub(super) keys: Arc<Shown>,
}

impl Collectors {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let endpoints = Arc::new(Shown::default());
        registry.register_collector(Box::new(Arc::clone(&endpoints)));
        let capacities = Arc::new(Shown::default());
        registry.register_collector(Box::new(Arc::clone(&capacities)));
        let keys = Arc::new(Shown::default());
        registry.register_collector(Box::new(Arc::clone(&keys)));
        registry.register_collector(Box::new(Process::new()));
        Self {
            endpoints,
            capacities,
            keys,
        }
    }
}

/// The version of floodgate that runs.
pub(super) fn register_build_info(registry: &mut Registry) {
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
}
