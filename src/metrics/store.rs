//! The rate limit store's handles: how long its decisions take and how
//! they fail, its breakers and calls, its in-process tables and its leased
//! limits, resolved once for the limiter.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::families::{KindLabel, NodeLabel, StoreLabel, TableLabel};
use super::histogram::Histogram;
use super::{LeaseFamilies, Metrics, StoreErrorKind, StoreKind};

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
    /// Units of refused requests given back in other cluster slots.
    pub given_back: Counter,
    /// Messages heard from the store: units given back (any instance).
    pub given_back_heard: Counter,
    /// 1 while this instance listens for units given back.
    pub listening: Gauge,
    /// PINGs sent on the subscriptions for units given back so that every
    /// message already sent is read before a refusal from memory.
    pub given_back_barrier_pings: Counter,
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

// === impl Metrics ===

impl Metrics {
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
            given_back_barrier_pings: self.given_back_barrier_pings.clone(),
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
}

// === impl StoreMetrics ===

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
