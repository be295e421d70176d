//! Each node's circuit breaker: whether it lets a decision through, how
//! it hears how the decision went, the probe that closes it again (one a
//! request makes, or one the recovery tick makes while no request comes),
//! and the gauges and log line of each opening and closing.

use std::sync::Arc;

use super::{Guarded, Limiter};
use crate::clock::now_ms;
use crate::limit::backend::StoreNode;
use crate::limit::breaker::{Change, Pass, Probe};
use crate::limit::{Backend, Charge, Decision, StoreError};
use crate::metrics::NodeLabel;

impl Limiter {
    /// While the breaker around Redis is open and its cooldown has passed,
    /// asks Redis without waiting for a request: connects, loads the
    /// decision code, and closes the breaker if that works. An instance
    /// that a load balancer took out of service while Redis was down (its
    /// `/readyz` answers 503) gets no requests to probe with, and would
    /// otherwise never come back; one that does get requests limits them
    /// again as soon as Redis answers, instead of after a request's probe.
    ///
    /// Each node's breaker is probed on its own. On a cluster, the slot
    /// table is also read again while any primary is considered down (or
    /// none is known), so decisions follow a promoted replica.
    pub async fn recover(&self) {
        if let Self::Redis(shared) = self {
            shared.recover().await;
        }
    }
}

impl<B: Backend> Guarded<B> {
    /// Probes each node whose breaker is open and whose cooldown has
    /// passed (see [`Limiter::recover`]).
    pub(super) async fn recover(&self) {
        let nodes = self.store.nodes();
        if nodes.is_empty() || nodes.iter().any(|n| n.breaker().is_open()) {
            self.store.refresh_nodes();
        }
        for node in nodes {
            if !node.breaker().is_open() {
                continue;
            }
            let Pass::Probe(probe) = node.breaker().pass(now_ms()) else {
                continue;
            };
            let result = self.store.probe(&node).await;
            self.probed(&node, probe, result.as_ref().err());
        }
    }

    /// Whether any node's breaker is closed (see [`Limiter::ready`]).
    pub(super) fn ready(&self) -> bool {
        self.store.nodes().iter().any(|n| !n.breaker().is_open())
    }

    /// Each node's address, whether its breaker is open, and since when
    /// (see [`Limiter::nodes`]).
    pub(super) fn nodes(&self) -> Vec<(String, bool, Option<u64>)> {
        self.store
            .nodes()
            .iter()
            .map(|n| {
                let breaker = n.breaker();
                (n.addr().to_owned(), breaker.is_open(), breaker.changed_at())
            })
            .collect()
    }

    /// Whether some but not all nodes' breakers are open (see
    /// [`Limiter::degraded`]).
    pub(super) fn degraded(&self) -> bool {
        let nodes = self.store.nodes();
        let open = nodes.iter().filter(|n| n.breaker().is_open()).count();
        open > 0 && open < nodes.len()
    }

    /// Brings the per-node breaker gauges up to date: one series per node
    /// the store decides on now.
    pub(super) fn refresh_gauges(&self) {
        let family = &self.metrics.node_circuit_open;
        family.clear();
        for node in self.store.nodes() {
            family
                .get_or_create(&NodeLabel {
                    node: node.addr().to_owned(),
                })
                .set(i64::from(node.breaker().is_open()));
        }
    }

    /// Asks the store at `target` if its node's breaker lets the decision
    /// through, and tells the breaker how it went.
    pub(super) async fn through_breaker(
        &self,
        target: B::Target,
        charge: Charge<'_>,
        now: u64,
    ) -> Result<Decision, StoreError> {
        let node = Arc::clone(B::node_of(&target));
        match node.breaker().pass(now) {
            Pass::Closed => {
                let result = self.store.decide_on(target, charge).await;
                let change = match &result {
                    Ok(_) => node.breaker().success(),
                    Err(_) => node.breaker().failure(now_ms()),
                };
                if change == Change::Opened {
                    self.store.reconnect_node(&node);
                }
                self.log_change(&node, change, result.as_ref().err());
                result
            }
            Pass::Probe(probe) => {
                let result = self.store.decide_on(target, charge).await;
                self.probed(&node, probe, result.as_ref().err());
                result
            }
            Pass::Open => Err(StoreError::CircuitOpen),
        }
    }

    /// Ends `probe` with its `error`, if any. The breaker opens again on a
    /// failed probe, and the store's connections are retired (as when the
    /// breaker first opened): they may be ones Redis will never answer, and
    /// the next probe must not wait on them.
    pub(super) fn probed(&self, node: &B::Node, probe: Probe<'_>, error: Option<&StoreError>) {
        let change = probe.finish(error.is_none(), now_ms());
        match error {
            Some(error) => {
                self.store.reconnect_node(node);
                self.note_refusal(error);
            }
            None => self.accepted(),
        }
        self.log_change(node, change, error);
    }

    /// Updates the gauges and logs one line when `node`'s breaker opened or
    /// closed.
    pub(super) fn log_change(&self, node: &B::Node, change: Change, error: Option<&StoreError>) {
        if change == Change::None {
            return;
        }
        let open = change == Change::Opened;
        let nodes = self.store.nodes();
        let down = nodes.iter().all(|n| n.breaker().is_open());
        self.metrics.circuit_open.set(i64::from(down));
        self.metrics
            .node_circuit_open
            .get_or_create(&NodeLabel {
                node: node.addr().to_owned(),
            })
            .set(i64::from(open));
        if !self.store.is_cluster() {
            if open {
                tracing::warn!(
                    error = %error.map_or_else(String::new, ToString::to_string),
                    on_error = %self.on_error,
                    "rate limit store is down; circuit open, on_error applies"
                );
            } else {
                tracing::info!("rate limit store answers again; circuit closed");
            }
            return;
        }
        let open_nodes = nodes.iter().filter(|n| n.breaker().is_open()).count();
        if open {
            tracing::warn!(
                node = %node.addr(),
                error = %error.map_or_else(String::new, ToString::to_string),
                on_error = %self.on_error,
                nodes_down = open_nodes,
                nodes = nodes.len(),
                "Redis Cluster primary is down; circuit open, on_error applies to its slots"
            );
        } else {
            tracing::info!(
                node = %node.addr(),
                nodes_down = open_nodes,
                nodes = nodes.len(),
                "Redis Cluster primary answers again; circuit closed"
            );
        }
    }
}
