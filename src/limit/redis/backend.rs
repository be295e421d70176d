//! The Redis store as the limiter's [`Backend`]: each method hands back
//! the store's own call (or future), unwrapped.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{Node, Part, RedisStore, Target};
use crate::limit::backend::{Backend, StoreNode};
use crate::limit::breaker::Breaker;
use crate::limit::deny_cache::GivenBack;
use crate::limit::{Charge, Decision, Kept, Limit, StoreError};

impl StoreNode for Node {
    fn addr(&self) -> &str {
        &self.addr
    }

    fn breaker(&self) -> &Breaker {
        &self.breaker
    }
}

impl Backend for RedisStore {
    type Node = Node;
    type Target = Target;

    fn nodes(&self) -> Vec<Arc<Node>> {
        RedisStore::nodes(self)
    }

    fn node_of(target: &Target) -> &Arc<Node> {
        &target.node
    }

    fn is_cluster(&self) -> bool {
        RedisStore::is_cluster(self)
    }

    fn refresh_nodes(&self) {
        self.refresh_slots();
    }

    fn target(&self, charge: &Charge<'_>) -> Result<Target, StoreError> {
        RedisStore::target(self, charge)
    }

    fn parts(&self, charge: &Charge<'_>) -> Option<Vec<Part>> {
        RedisStore::parts(self, charge)
    }

    fn decide_on(
        &self,
        target: Target,
        charge: Charge<'_>,
    ) -> impl Future<Output = Result<Decision, StoreError>> + Send {
        RedisStore::decide_on(self, target, charge, None)
    }

    fn peek_on(
        &self,
        target: Target,
        charge: Charge<'_>,
    ) -> impl Future<Output = Result<Vec<crate::limit::Standing>, StoreError>> + Send {
        RedisStore::peek_on(self, target, charge)
    }

    fn reset(
        &self,
        charge: &Charge<'_>,
        which: Option<usize>,
        what: crate::limit::Forget,
    ) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::reset(self, charge, which, what)
    }

    fn penalties(
        &self,
        now: u64,
    ) -> impl Future<Output = Result<Vec<crate::limit::penalty::Served>, StoreError>> + Send {
        RedisStore::penalties(self, now)
    }

    fn kept(
        &self,
        scope: &str,
        index: usize,
        limit: &Limit,
        now: u64,
    ) -> impl Future<Output = Result<Vec<Kept>, StoreError>> + Send {
        RedisStore::kept(self, scope, index, limit, now)
    }

    fn announce_rules(
        &self,
        digest: &str,
    ) -> impl Future<Output = Result<Vec<String>, StoreError>> + Send {
        RedisStore::announce_rules(self, digest)
    }

    fn probe(&self, node: &Node) -> impl Future<Output = Result<(), StoreError>> + Send {
        RedisStore::probe(self, node)
    }

    fn reconnect_node(&self, node: &Node) {
        RedisStore::reconnect_node(self, node);
    }

    fn timeout(&self) -> Duration {
        RedisStore::timeout(self)
    }

    fn given_back(&self) -> &GivenBack {
        RedisStore::given_back(self)
    }

    fn tag_buckets(&self, charge: &Charge<'_>) -> Box<[u16]> {
        RedisStore::tag_buckets(self, charge)
    }
}
