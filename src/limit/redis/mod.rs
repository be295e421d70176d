//! The Redis store: every instance counts in one Redis, at most one command
//! per decision.
//!
//! The Lua files in `lua/` are joined into a function library and decisions
//! are sent with `FCALL` (Redis 7 and later: the algorithms are loaded once,
//! when the library is, which costs Redis about a fifth less CPU per
//! decision than a script). Where Redis refuses functions, the same code runs
//! as a script with `EVALSHA`. Either is loaded again when Redis answers that
//! it lacks it (a restart, `FUNCTION FLUSH`, `SCRIPT FLUSH`). Time comes from
//! Redis `TIME` inside the code, so instances with skewed clocks agree.
//!
//! Calls: one `FCALL` decides one or more requests, one after another, each
//! all or nothing, in one atomic run of the code. On one Redis, decisions
//! queue for a few tasks that send the calls (at most `IN_FLIGHT` in
//! flight): a decision that finds a task free goes at once, alone; decisions
//! that arrive while every task waits for Redis go together in the next
//! call. Redis then pays a call's fixed cost (the command, `TIME`, the reply)
//! once for all of them, which is what makes it keep up under load. A Redis
//! Cluster gets one call per decision, since one call's keys must share a
//! slot.
//!
//! Connections: a deadpool pool of redis-rs multiplexed connections. The
//! store keeps a handle on a few of them and sends every call on one of
//! those, round-robin, so calls in flight are pipelined on a few TCP
//! connections; the pool is asked only for a missing or broken one.
//! deadpool-redis pings every connection it hands out; this store's pool does
//! not (that would be a second command per checkout) and instead retires a
//! connection as soon as a command on it fails for a connection reason. A
//! cluster's primaries are not pooled: each has one connection and its own
//! circuit breaker, and floodgate routes each decision to its slot's
//! primary itself.
//!
//! The module answers one question per file: [`endpoint`] (reaching
//! `[store]`'s endpoint: each URL's settings, the pool or the cluster,
//! where to listen), [`keys`] (what a decision's keys are called),
//! [`targets`] (where a decision goes: its hash tags and the node holding
//! them, or its parts when its keys lie in several cluster slots),
//! [`agreement`] (do the instances sharing the store agree: the id secret
//! they digest client ids with, the limits they count by), [`code`] (the
//! Lua code and getting it loaded), [`batch`] (decisions queued and sent
//! together), [`replies`] (reading the verdicts back), [`connections`]
//! (the pool), [`cluster`] (a cluster's slots and primaries), [`slot`]
//! (which slot a key lies in), [`redirections`] (a call to a cluster's
//! primary, sent on where the cluster says), [`given_back`] (hearing of
//! units given back, which ends remembered denials), [`operator`] (a
//! client's counts read without consuming, or deleted), [`export`]
//! (every client's window of a limit, for export) and [`backend`] (the
//! store as the limiter's [`crate::limit::Backend`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use deadpool::managed;
use prometheus_client::metrics::counter::Counter;
use redis::{Cmd, Script, Value};
use tokio::sync::{mpsc, oneshot};

use super::deny_cache::GivenBack;
use super::settings::{Endpoint, Tls};
use super::{Charge, Decision, StoreError};

mod agreement;
mod backend;
mod batch;
mod cluster;
mod code;
mod connections;
mod endpoint;
mod export;
mod given_back;
mod keys;
mod operator;
mod penalties;
mod redirections;
mod registry;
mod replies;
mod slot;
mod targets;

use batch::{Ask, Limits, Pending, send_calls};
use cluster::Cluster;
pub use cluster::Node;
pub use code::SCRIPT;
use code::{Library, code_missing};
use connections::{Lane, Lanes, retires, store_error};
pub use keys::IdKey;
#[doc(hidden)] // how tests find a client's keys in Redis
pub use keys::write_client;
use replies::{decision_from_reply, next_decision, verdict_values};
use slot::slot_of;
pub use targets::{Part, Target};

/// Multiplexed connections in the pool; each carries many calls at once.
const CONNECTIONS: usize = 4;

/// Calls in flight at once to one Redis. Decisions that arrive while all
/// are in flight wait, and go together in the next call.
const IN_FLIGHT: usize = 2;

/// Most decisions in one call.
const MAX_BATCH: usize = 32;

/// Counts limits in Redis, shared by every floodgate instance using it.
pub struct RedisStore {
    link: Arc<Link>,
    /// Where decisions wait for a call to one Redis (not a cluster); set by
    /// the first decision, which starts the tasks that send the calls.
    queue: ArcSwapOption<mpsc::UnboundedSender<Pending>>,
    key_prefix: String,
    /// The key client ids are digested with in keys.
    id_key: IdKey,
    /// The breaker of a store that is not a cluster (a cluster's primaries
    /// each have their own).
    single: Arc<Node>,
    /// Where units were given back lately, as the store tells.
    given_back: Arc<GivenBack>,
    /// Listens for units given back while the store lives.
    listener: Option<given_back::Listener>,
}

/// What a store shares with the tasks that send its calls: the connections
/// and the decision code.
struct Link {
    /// Connections to one Redis (not a cluster).
    pool: Option<managed::Pool<Lanes>>,
    /// Cached handles on pooled connections, used round-robin.
    lanes: Box<[ArcSwapOption<Lane>]>,
    next_lane: AtomicUsize,
    script: Script,
    library: Library,
    /// One of `FUNCTIONS_*`.
    functions: AtomicU8,
    /// Redis Cluster: every call carries one decision, whose keys share a
    /// slot, to that slot's primary.
    cluster: Option<Arc<Cluster>>,
    timeout: Duration,
    /// Counts the calls sent (`floodgate_redis_calls_total`).
    calls: Counter,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.link.timeout)
            .field("cluster", &self.link.cluster.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// A store for one Redis at `url`; connects lazily, so it starts even
    /// while Redis is down.
    pub fn new(url: &str, key_prefix: &str, timeout: Duration) -> Result<Self, StoreError> {
        let endpoint = Endpoint::Single(url.to_owned());
        Self::connect(
            &endpoint,
            &Tls::default(),
            key_prefix,
            timeout,
            Counter::default(),
            GivenBack::default(),
        )
    }

    /// This store with client ids digested with `secret` in keys (see
    /// [`write_client`]) instead of the default key.
    pub fn with_id_secret(mut self, secret: Option<&[u8]>) -> Self {
        self.id_key = IdKey::new(secret);
        self
    }

    /// Retires every connection this store sends on; the next call opens a
    /// new one. A Redis whose host vanished, or a network that drops its
    /// packets, leaves connections open that will never answer and that
    /// TCP gives up on only after many minutes; a new connection reaches
    /// whatever answers at the address now (a restarted Redis, the new
    /// primary behind a managed endpoint's name or the Sentinels, a
    /// cluster's current topology). Calls in flight end by their timeout.
    pub fn reconnect(&self) {
        for slot in &self.link.lanes {
            if let Some(lane) = slot.swap(None) {
                // The pool discards the connection instead of handing it out.
                lane.broken.store(true, Ordering::Relaxed);
            }
        }
        if let Some(cluster) = &self.link.cluster {
            for node in cluster.nodes() {
                node.retire();
            }
        }
    }

    /// Retires the connections that decisions for `node` use: its own on
    /// a cluster, the store's otherwise.
    pub fn reconnect_node(&self, node: &Node) {
        match &self.link.cluster {
            Some(cluster) => {
                node.retire();
                cluster.refresh_soon();
            }
            None => self.reconnect(),
        }
    }

    /// Gives Redis the decision code (the function library, or the script
    /// where Redis has no functions) so the first decision needs no retry.
    /// On a cluster: reads the slot table, then gives every primary the
    /// code; fails if the table cannot be read or any primary fails.
    pub async fn load_script(&self) -> Result<(), StoreError> {
        let checked = self.load_and_check().await;
        if let (Ok(()), Some(listener)) = (&checked, &self.listener) {
            listener.store_accepted();
        }
        checked
    }

    async fn load_and_check(&self) -> Result<(), StoreError> {
        let link = &*self.link;
        let limit = link.timeout.max(Duration::from_secs(1));
        if let Some(cluster) = &link.cluster {
            tokio::time::timeout(limit, cluster.refresh())
                .await
                .map_err(|_| StoreError::Timeout(limit))?
                .map_err(|e| match e {
                    StoreError::Backend(e) => {
                        StoreError::Backend(format!("cannot read the cluster's slots: {e}"))
                    }
                    refused => refused,
                })?;
            for node in cluster.nodes() {
                self.load_on(&node).await?;
            }
            return self.check_marker().await;
        }
        let work = async {
            let lane = link.lane().await?;
            let mut conn = lane.conn.clone();
            let loaded = link.load_code(&mut conn).await;
            loaded.map_err(|e| lane.failed(e))
        };
        tokio::time::timeout(limit, work)
            .await
            .map_err(|_| StoreError::Timeout(link.timeout))??;
        self.check_marker().await
    }

    /// Asks `node` whether it answers again, for its breaker's probe: gives
    /// it the decision code (a cluster also reads its slot table again).
    pub async fn probe(&self, node: &Node) -> Result<(), StoreError> {
        match &self.link.cluster {
            Some(cluster) => {
                cluster.refresh_soon();
                self.load_on(node).await
            }
            None => self.load_script().await,
        }
    }

    /// Gives one cluster primary the decision code.
    async fn load_on(&self, node: &Node) -> Result<(), StoreError> {
        let Some(cluster) = &self.link.cluster else {
            return Err(StoreError::Backend(
                "only a cluster's primaries are loaded one by one".to_owned(),
            ));
        };
        let limit = self.link.timeout.max(Duration::from_secs(1));
        let work = async {
            let mut conn = node.connection(&cluster.config).await?;
            self.link.load_code(&mut conn).await
        };
        match tokio::time::timeout(limit, work).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                if retires(&e) {
                    node.retire();
                }
                Err(store_error(&e, &node.addr))
            }
            Err(_) => {
                node.retire();
                Err(StoreError::Timeout(limit))
            }
        }
    }

    /// Every node decisions go to: the one Redis, or the cluster's
    /// primaries as its slot table last named them.
    pub fn nodes(&self) -> Vec<Arc<Node>> {
        match &self.link.cluster {
            Some(cluster) => cluster.nodes(),
            None => vec![Arc::clone(&self.single)],
        }
    }

    /// One decision's deadline.
    pub fn timeout(&self) -> Duration {
        self.link.timeout
    }

    /// Whether this store is a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.link.cluster.is_some()
    }

    /// Reads a cluster's slot table again soon, in the background.
    pub fn refresh_slots(&self) {
        if let Some(cluster) = &self.link.cluster {
            cluster.refresh_soon();
        }
    }

    /// Decides `charge`. `now` (milliseconds) replaces Redis `TIME`: tests
    /// only, never in production.
    ///
    /// On one Redis, the decision waits in a queue for a free call (at most
    /// `IN_FLIGHT` are in flight): at low load it goes at once, alone;
    /// under load, the decisions that arrived during the calls in flight go
    /// together in one call. On a cluster, each decision is its own call.
    #[doc(hidden)] // an explicit `now` is for tests and benchmarks
    pub async fn decide_at(
        &self,
        charge: Charge<'_>,
        now: Option<u64>,
    ) -> Result<Decision, StoreError> {
        let target = self.target(&charge)?;
        self.decide_on(target, charge, now).await
    }

    /// Decides `charge` at `target` (see [`Self::target`]), as
    /// [`Self::decide_at`] does.
    pub async fn decide_on(
        &self,
        target: Target,
        charge: Charge<'_>,
        now: Option<u64>,
    ) -> Result<Decision, StoreError> {
        let timeout = self.link.timeout;
        let Target { node, tags } = target;
        if let Some(cluster) = &self.link.cluster {
            let ask = Ask {
                tags: tags.borrow(),
                limits: charge.limits,
                cost: charge.cost,
                settle: charge.settle,
                now,
            };
            let work = async {
                let reply = self
                    .link
                    .cluster_call(cluster, node, std::iter::once(ask))
                    .await?;
                decision_from_reply(&reply, charge.limits)
            };
            return tokio::time::timeout(timeout, work)
                .await
                .map_err(|_| StoreError::Timeout(timeout))?;
        }
        // No timer of its own: the tasks that send calls answer it by its
        // deadline (see `send_calls`).
        let (reply, decided) = oneshot::channel();
        self.enqueue(Pending {
            tags,
            limits: Limits::new(charge.limits),
            cost: charge.cost,
            settle: charge.settle,
            now,
            deadline: tokio::time::Instant::now() + timeout,
            reply,
        })?;
        decided.await.unwrap_or_else(|_| {
            Err(StoreError::Backend(
                "the task sending calls to Redis stopped".to_owned(),
            ))
        })
    }

    /// Decides `charges` in one call, in order, each at its own `now` or at
    /// Redis `TIME`: what the shared calls of a loaded instance do, with the
    /// call's make-up fixed, for tests and benchmarks. Each decision sees
    /// the ones before it, as if each had been its own call. On a cluster
    /// the charges must share one route and client (one slot).
    #[doc(hidden)] // for tests and benchmarks
    pub async fn decide_together_at(
        &self,
        charges: &[(Charge<'_>, Option<u64>)],
    ) -> Result<Vec<Decision>, StoreError> {
        let tags: Vec<String> = charges
            .iter()
            .map(|(charge, _)| self.hash_tag(charge.route, charge.client))
            .collect();
        let asks = charges.iter().zip(&tags).map(|((charge, now), tag)| Ask {
            tags: batch::Tags::One(tag),
            limits: charge.limits,
            cost: charge.cost,
            settle: charge.settle,
            now: *now,
        });
        let work = async {
            let reply = match &self.link.cluster {
                Some(cluster) => {
                    let slot = tags.first().map_or(0, |tag| slot_of(tag));
                    let node = cluster.node(slot).ok_or_else(no_primary)?;
                    self.link.cluster_call(cluster, node, asks).await?
                }
                None => self.link.call(&mut Cmd::new(), asks).await?,
            };
            let limits = charges.iter().map(|(charge, _)| charge.limits);
            let total = limits.clone().map(<[_]>::len).sum();
            let mut rest = verdict_values(&reply, total, charges.len())?;
            Ok(limits.map(|l| next_decision(&mut rest, l)).collect())
        };
        tokio::time::timeout(self.link.timeout, work)
            .await
            .map_err(|_| StoreError::Timeout(self.link.timeout))?
    }

    /// Queues `pending` for the tasks that send calls, starting them first
    /// if there are none yet (or they ended with the runtime they ran on).
    fn enqueue(&self, pending: Pending) -> Result<(), StoreError> {
        let pending = match self.queue.load().as_deref() {
            Some(queue) => match queue.send(pending) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::SendError(pending)) => pending,
            },
            None => pending,
        };
        let (queue, waiting) = mpsc::unbounded_channel();
        let waiting = Arc::new(tokio::sync::Mutex::new(waiting));
        for _ in 0..IN_FLIGHT {
            tokio::spawn(send_calls(Arc::clone(&self.link), Arc::clone(&waiting)));
        }
        queue.send(pending).map_err(|_| {
            StoreError::Backend("cannot start the tasks that send calls to Redis".to_owned())
        })?;
        self.queue.store(Some(Arc::new(queue)));
        Ok(())
    }
}

/// A cluster slot no primary is known for.
fn no_primary() -> StoreError {
    StoreError::Backend("no Redis Cluster primary is known for this slot".to_owned())
}

impl Link {
    /// Sends one call deciding `asks`, in order, and returns Redis's reply.
    /// `command` is a buffer to build the call in.
    async fn call<'a>(
        &self,
        command: &mut Cmd,
        asks: impl Iterator<Item = Ask<'a>> + Clone,
    ) -> Result<Value, StoreError> {
        let lane = self.lane().await?;
        let mut conn = lane.conn.clone();
        self.command(command, asks.clone());
        self.calls.inc();
        match command.query_async(&mut conn).await {
            Ok(reply) => Ok(reply),
            Err(e) if code_missing(&e) => {
                // Redis lost the code (a restart, FUNCTION or SCRIPT FLUSH)
                // or never runs functions: give it the code, ask again.
                // Boxed, as a rare path, to keep the common future small.
                Box::pin(async {
                    self.load_code(&mut conn)
                        .await
                        .map_err(|e| lane.failed(e))?;
                    self.command(command, asks);
                    self.calls.inc();
                    command
                        .query_async(&mut conn)
                        .await
                        .map_err(|e| lane.failed(e))
                })
                .await
            }
            Err(e) => Err(lane.failed(e)),
        }
    }

    /// A connection to send on: one of a few cached multiplexed handles,
    /// replaced from the pool when missing or broken.
    async fn lane(&self) -> Result<Arc<Lane>, StoreError> {
        let slot = &self.lanes[self.next_lane.fetch_add(1, Ordering::Relaxed) % self.lanes.len()];
        if let Some(lane) = slot.load_full()
            && !lane.broken.load(Ordering::Relaxed)
        {
            return Ok(lane);
        }
        let Some(pool) = &self.pool else {
            return Err(StoreError::Backend(
                "a cluster's calls go to its primaries".to_owned(),
            ));
        };
        // Boxed: the pool's future holds a whole connection attempt and is
        // needed only when a lane is missing or broken.
        let pooled = Box::pin(pool.get()).await.map_err(|e| match e {
            managed::PoolError::Backend(e) => store_error(&e, "cannot connect"),
            other => StoreError::Backend(format!("connection pool: {other}")),
        })?;
        // The pooled object goes straight back; the clone shares its connection.
        let lane = Arc::new(pooled.clone_handle());
        slot.store(Some(Arc::clone(&lane)));
        Ok(lane)
    }
}
