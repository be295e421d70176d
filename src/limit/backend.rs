//! What a shared store does for the limiter: decide a charge (or settle
//! one) on the node holding its keys, read or reset counts, and tell the
//! limiter what its breakers, deny cache and `on_error` fallback need to
//! know (its nodes, how to probe one, where units were given back).
//!
//! The limiter's orchestration runs over any [`Backend`]: the Redis store
//! in the product, a fake in its tests. Methods that wait return
//! `impl Future` (static dispatch): each backend's own future, with no
//! box or extra layer around it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::breaker::Breaker;
use super::deny_cache::GivenBack;
use super::{Charge, Decision, Kept, Limit, StoreError};

/// One node of a shared store (the one Redis, or a cluster's primary):
/// what its breaker guards.
pub trait StoreNode: Send + Sync {
    /// The node's address: the label of its breaker's metric and log lines.
    fn addr(&self) -> &str;

    /// Opens on this node's own failures in a row.
    fn breaker(&self) -> &Breaker;
}

/// Part of a decision whose keys lie on several nodes: the positions of
/// its limits in the charge, and where they go (or why nothing is known
/// to hold them).
pub type Part<T> = (Vec<usize>, Result<T, StoreError>);

/// A store several instances share, decided on node by node.
///
/// Every call that waits answers by the store's [`Self::timeout`]: an
/// answer that would come later is [`StoreError::Timeout`].
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// One node, with its breaker.
    type Node: StoreNode + std::fmt::Debug + 'static;
    /// Where one decision goes: the node holding its keys, and how to
    /// name them there.
    type Target: Clone + Send + Sync;

    /// Every node decisions go to now.
    fn nodes(&self) -> Vec<Arc<Self::Node>>;

    /// The node `target` lies on.
    fn node_of(target: &Self::Target) -> &Arc<Self::Node>;

    /// Whether decisions are spread over several nodes by their keys (a
    /// cluster): log lines then name the node.
    fn is_cluster(&self) -> bool;

    /// Learns again which node holds which keys, in the background (a
    /// cluster's slot table); nothing for a store of one node.
    fn refresh_nodes(&self);

    /// Where `charge` goes; an error while no node is known to hold its
    /// keys.
    fn target(&self, charge: &Charge<'_>) -> Result<Self::Target, StoreError>;

    /// `charge`'s limits grouped by the node holding their keys, when they
    /// lie on several; `None` when one call decides it all.
    fn parts(&self, charge: &Charge<'_>) -> Option<Vec<Part<Self::Target>>>;

    /// Decides (or settles) `charge` at `target`, all or nothing.
    fn decide_on(
        &self,
        target: Self::Target,
        charge: Charge<'_>,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send;

    /// What each of `charge`'s limits holds at `target`, consuming nothing.
    fn peek_on(
        &self,
        target: Self::Target,
        charge: Charge<'_>,
    ) -> impl Future<Output = Result<Vec<crate::limit::Standing>, StoreError>> + Send;

    /// Forgets `charge`'s counts and penalties, or its penalties alone
    /// (only limit `which`, when given).
    fn reset(
        &self,
        charge: &Charge<'_>,
        which: Option<usize>,
        what: crate::limit::Forget,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Every penalty in force at `now`.
    fn penalties(
        &self,
        now: u64,
    ) -> impl Future<Output = Result<Vec<crate::limit::penalty::Served>, StoreError>> + Send;

    /// Every client's fixed window of limit `index` of `scope` at `now`.
    fn kept(
        &self,
        scope: &str,
        index: usize,
        limit: &Limit,
        now: u64,
    ) -> impl Future<Output = Result<Vec<Kept>, StoreError>> + Send;

    /// Announces the rules digest this instance counts by; the digests
    /// the instances sharing the store announced lately.
    fn announce_rules(
        &self,
        digest: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send;

    /// Asks `node` whether it answers again, for its breaker's probe.
    fn probe(&self, node: &Self::Node) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Drops the connections to `node`: its breaker opened, and they may
    /// be ones it will never answer on.
    fn reconnect_node(&self, node: &Self::Node);

    /// One decision's deadline.
    fn timeout(&self) -> Duration;

    /// Where units were given back lately, as the store tells this
    /// instance (see [`super::deny_cache`]).
    fn given_back(&self) -> &GivenBack;

    /// The [`GivenBack`] buckets of `charge`'s keys.
    fn tag_buckets(&self, charge: &Charge<'_>) -> Box<[u16]>;
}
