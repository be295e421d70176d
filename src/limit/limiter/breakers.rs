//! Each node's circuit breaker: whether it lets a decision through, how
//! it hears how the decision went, the probe that closes it again (one a
//! request makes, or one the recovery tick makes while no request comes),
//! and the gauges and log line of each opening and closing.

use std::sync::Arc;

use super::{Limiter, Shared};
use crate::clock::now_ms;
use crate::limit::breaker::{Change, Pass, Probe};
use crate::limit::redis::{Node, Target};
use crate::limit::{Charge, Decision, StoreError};
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
        let Self::Redis(shared) = self else {
            return;
        };
        let nodes = shared.store.nodes();
        if nodes.is_empty() || nodes.iter().any(|n| n.breaker.is_open()) {
            shared.store.refresh_slots();
        }
        for node in nodes {
            if !node.breaker.is_open() {
                continue;
            }
            let Pass::Probe(probe) = node.breaker.pass(now_ms()) else {
                continue;
            };
            let result = shared.store.probe(&node).await;
            shared.probed(&node, probe, result.as_ref().err());
        }
    }
}

impl Shared {
    /// Asks the store at `target` if its node's breaker lets the decision
    /// through, and tells the breaker how it went.
    pub(super) async fn through_breaker(
        &self,
        target: Target,
        charge: Charge<'_>,
        now: u64,
    ) -> Result<Decision, StoreError> {
        let node = Arc::clone(&target.node);
        match node.breaker.pass(now) {
            Pass::Closed => {
                let result = self.store.decide_on(target, charge, None).await;
                let change = match &result {
                    Ok(_) => node.breaker.success(),
                    Err(_) => node.breaker.failure(now_ms()),
                };
                if change == Change::Opened {
                    self.store.reconnect_node(&node);
                }
                self.log_change(&node, change, result.as_ref().err());
                result
            }
            Pass::Probe(probe) => {
                let result = self.store.decide_on(target, charge, None).await;
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
    pub(super) fn probed(&self, node: &Node, probe: Probe<'_>, error: Option<&StoreError>) {
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
    pub(super) fn log_change(&self, node: &Node, change: Change, error: Option<&StoreError>) {
        if change == Change::None {
            return;
        }
        let open = change == Change::Opened;
        let nodes = self.store.nodes();
        let down = nodes.iter().all(|n| n.breaker.is_open());
        self.metrics.circuit_open.set(i64::from(down));
        self.metrics
            .node_circuit_open
            .get_or_create(&NodeLabel {
                node: node.addr.clone(),
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
        let open_nodes = nodes.iter().filter(|n| n.breaker.is_open()).count();
        if open {
            tracing::warn!(
                node = %node.addr,
                error = %error.map_or_else(String::new, ToString::to_string),
                on_error = %self.on_error,
                nodes_down = open_nodes,
                nodes = nodes.len(),
                "Redis Cluster primary is down; circuit open, on_error applies to its slots"
            );
        } else {
            tracing::info!(
                node = %node.addr,
                nodes_down = open_nodes,
                nodes = nodes.len(),
                "Redis Cluster primary answers again; circuit closed"
            );
        }
    }
}
