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
//! connection as soon as a command on it fails for a connection reason.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use prometheus_client::metrics::counter::Counter;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, ClientTlsConfig, Cmd, ErrorKind, IntoConnectionInfo, RedisError,
    RedisFuture, RedisWrite, Script, ServerErrorKind, TlsCertificates, ToRedisArgs, Value,
};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};

use super::settings::{Endpoint, Tls};
use super::{Charge, Decision, Limit, Store, StoreError, Verdict};
use crate::client::ClientId;

/// The decision code shared by the script and the function library:
/// prelude, one file per algorithm, then `decide`.
macro_rules! decision_code {
    () => {
        concat!(
            include_str!("../../lua/prelude.lua"),
            include_str!("../../lua/fixed_window.lua"),
            include_str!("../../lua/sliding_log.lua"),
            include_str!("../../lua/sliding_window.lua"),
            include_str!("../../lua/token_bucket.lua"),
            include_str!("../../lua/gcra.lua"),
            include_str!("../../lua/decide.lua"),
        )
    };
}

/// The decision as a plain script, for `EVALSHA` (Redis before 7).
pub const SCRIPT: &str = concat!(decision_code!(), include_str!("../../lua/script.lua"));

/// The decision as a function library, for `FCALL` (Redis 7 and later),
/// without its first line and `FUNCTION_NAME` (see [`Library`]).
const LIBRARY_BODY: &str = concat!(decision_code!(), include_str!("../../lua/library.lua"));

/// The function library as Redis is given it, named after a hash of its
/// code so that floodgate versions sharing a Redis never replace each
/// other's.
#[derive(Debug)]
struct Library {
    /// `FUNCTION LOAD`'s argument.
    code: String,
    /// What `FCALL` names.
    function: String,
}

impl Library {
    fn new() -> Self {
        let digest = Sha256::digest(LIBRARY_BODY.as_bytes());
        let mut id = String::with_capacity(16);
        for b in &digest[..8] {
            let _ = write!(id, "{b:02x}");
        }
        let function = format!("floodgate_decide_{id}");
        let code = format!(
            "#!lua name=floodgate_{id}\nlocal FUNCTION_NAME = '{function}'\n{LIBRARY_BODY}"
        );
        Self { code, function }
    }
}

/// Whether the Redis behind a store runs functions: not known yet, yes
/// (decisions use `FCALL`), or no (they use `EVALSHA`).
const FUNCTIONS_UNKNOWN: u8 = 0;
const FUNCTIONS_YES: u8 = 1;
const FUNCTIONS_NO: u8 = 2;

/// Multiplexed connections in the pool; each carries many calls at once.
const CONNECTIONS: usize = 4;

/// Calls in flight at once to one Redis. Decisions that arrive while all
/// are in flight wait, and go together in the next call.
const IN_FLIGHT: usize = 2;

/// Most decisions in one call.
const MAX_BATCH: usize = 32;

/// Header values up to this length made of safe characters appear in keys
/// as they are; anything else is hashed.
const MAX_PLAIN_CLIENT: usize = 64;

/// Counts limits in Redis, shared by every floodgate instance using it.
pub struct RedisStore {
    link: Arc<Link>,
    /// Where decisions wait for a call to one Redis (not a cluster); set by
    /// the first decision, which starts the tasks that send the calls.
    queue: ArcSwapOption<mpsc::UnboundedSender<Pending>>,
    key_prefix: String,
}

/// What a store shares with the tasks that send its calls: the connections
/// and the decision code.
struct Link {
    pool: managed::Pool<Lanes>,
    /// Cached handles on pooled connections, used round-robin.
    lanes: Box<[ArcSwapOption<Lane>]>,
    next_lane: AtomicUsize,
    script: Script,
    library: Library,
    /// One of `FUNCTIONS_*`.
    functions: AtomicU8,
    /// Redis Cluster: every call carries one decision, whose keys share a
    /// slot.
    cluster: bool,
    timeout: Duration,
    /// Counts the calls sent (`floodgate_redis_calls_total`).
    calls: Counter,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("key_prefix", &self.key_prefix)
            .field("timeout", &self.link.timeout)
            .field("cluster", &self.link.cluster)
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
        )
    }

    /// A store for `endpoint`: one Redis or a Redis Cluster, over TLS with
    /// `tls` for `rediss://`, counting the calls it sends in `calls`.
    /// Connects lazily.
    pub fn connect(
        endpoint: &Endpoint,
        tls: &Tls,
        key_prefix: &str,
        timeout: Duration,
        calls: Counter,
    ) -> Result<Self, StoreError> {
        let connect_timeout = timeout.max(Duration::from_millis(500));
        let invalid = |e: RedisError| StoreError::Backend(format!("invalid Redis settings: {e}"));
        let certificates = || TlsCertificates {
            client_tls: tls.client.as_ref().map(|(cert, key)| ClientTlsConfig {
                client_cert: cert.clone(),
                client_key: key.clone(),
            }),
            root_cert: tls.ca.clone(),
        };
        let custom_tls = tls.ca.is_some() || tls.client.is_some();
        let lanes = match endpoint {
            Endpoint::Single(url) => {
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(None);
                let info = if custom_tls {
                    redis::Client::build_with_tls(url.as_str(), certificates())
                        .map_err(invalid)?
                        .get_connection_info()
                        .clone()
                } else {
                    url.as_str().into_connection_info().map_err(invalid)?
                };
                Lanes::Single(
                    deadpool_redis::Manager::new_with_config(info, config).map_err(invalid)?,
                )
            }
            Endpoint::Cluster(urls) => {
                let (min_wait, max_wait) = cluster_retry_waits(timeout);
                let mut builder =
                    redis::cluster::ClusterClient::builder(urls.iter().map(String::as_str))
                        .connection_timeout(connect_timeout)
                        .min_retry_wait(min_wait)
                        .max_retry_wait(max_wait);
                if custom_tls {
                    builder = builder.certs(certificates());
                }
                Lanes::Cluster(builder.build().map_err(invalid)?)
            }
            Endpoint::Sentinel { urls, master } => {
                let nodes = redis::sentinel::SentinelNodeConnectionInfo::default();
                let client = redis::sentinel::SentinelClient::build(
                    urls.iter().map(String::as_str).collect(),
                    master.as_str(),
                    Some(nodes),
                    redis::sentinel::SentinelServerType::Master,
                )
                .map_err(invalid)?;
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(connect_timeout))
                    .set_response_timeout(None);
                Lanes::Sentinel(tokio::sync::Mutex::new(client), config)
            }
        };
        let cluster = matches!(lanes, Lanes::Cluster(_));
        let pool = managed::Pool::builder(lanes)
            .max_size(CONNECTIONS)
            .runtime(deadpool::Runtime::Tokio1)
            .build()
            .map_err(|e| StoreError::Backend(format!("cannot build the Redis pool: {e}")))?;
        Ok(Self {
            link: Arc::new(Link {
                pool,
                lanes: (0..CONNECTIONS).map(|_| ArcSwapOption::empty()).collect(),
                next_lane: AtomicUsize::new(0),
                script: Script::new(SCRIPT),
                library: Library::new(),
                functions: AtomicU8::new(FUNCTIONS_UNKNOWN),
                cluster,
                timeout,
                calls,
            }),
            queue: ArcSwapOption::empty(),
            key_prefix: key_prefix.to_owned(),
        })
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
    }

    /// Gives Redis the decision code (the function library, or the script
    /// where Redis has no functions) so the first decision needs no retry.
    pub async fn load_script(&self) -> Result<(), StoreError> {
        let link = &*self.link;
        let work = async {
            let lane = link.lane().await?;
            let mut conn = lane.conn.clone();
            let loaded = link.load_code(&mut conn).await;
            loaded.map_err(|e| lane.failed(e))
        };
        tokio::time::timeout(link.timeout.max(Duration::from_secs(1)), work)
            .await
            .map_err(|_| StoreError::Timeout(link.timeout))?
    }

    /// Decides `charge`. `now` (milliseconds) replaces Redis `TIME`: tests
    /// only, never in production.
    ///
    /// On one Redis, the decision waits in a queue for a free call (at most
    /// `IN_FLIGHT` are in flight): at low load it goes at once, alone;
    /// under load, the decisions that arrived during the calls in flight go
    /// together in one call. On a cluster, each decision is its own call.
    pub async fn decide_at(
        &self,
        charge: Charge<'_>,
        now: Option<u64>,
    ) -> Result<Decision, StoreError> {
        let timeout = self.link.timeout;
        let tag = self.hash_tag(charge.route, charge.client);
        if self.link.cluster {
            let ask = Ask {
                tag: &tag,
                limits: charge.limits,
                cost: charge.cost,
                now,
            };
            let work = async {
                // Sized up front, so that building it allocates twice
                // rather than once per doubling of its buffers: a key and
                // about 40 bytes of limits per limit, six more arguments.
                let n = charge.limits.len();
                let mut command = Cmd::with_capacity(6 + n, 64 + n * (tag.len() + 72));
                let reply = self.link.call(&mut command, std::iter::once(ask)).await?;
                decision_from_reply(&reply, charge.limits.len())
            };
            return tokio::time::timeout(timeout, work)
                .await
                .map_err(|_| StoreError::Timeout(timeout))?;
        }
        let (reply, decided) = oneshot::channel();
        self.enqueue(Pending {
            tag,
            limits: Limits::new(charge.limits),
            cost: charge.cost,
            now,
            reply,
        })?;
        match tokio::time::timeout(timeout, decided).await {
            Ok(Ok(decided)) => decided,
            Ok(Err(_)) => Err(StoreError::Backend(
                "the task sending calls to Redis stopped".to_owned(),
            )),
            Err(_) => Err(StoreError::Timeout(timeout)),
        }
    }

    /// Decides `charges` in one call, in order, each at its own `now` or at
    /// Redis `TIME`: what the shared calls of a loaded instance do, with the
    /// call's make-up fixed, for tests and benchmarks. Each decision sees
    /// the ones before it, as if each had been its own call. On a cluster
    /// the charges must share one route and client (one slot).
    pub async fn decide_together_at(
        &self,
        charges: &[(Charge<'_>, Option<u64>)],
    ) -> Result<Vec<Decision>, StoreError> {
        let tags: Vec<String> = charges
            .iter()
            .map(|(charge, _)| self.hash_tag(charge.route, charge.client))
            .collect();
        let asks = charges.iter().zip(&tags).map(|((charge, now), tag)| Ask {
            tag,
            limits: charge.limits,
            cost: charge.cost,
            now: *now,
        });
        let work = async {
            let reply = self.link.call(&mut Cmd::new(), asks).await?;
            let limits = charges.iter().map(|(charge, _)| charge.limits.len());
            let mut rest = verdict_values(&reply, limits.clone().sum())?;
            Ok(limits.map(|n| next_decision(&mut rest, n)).collect())
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

    /// `{prefix}:{route:client}`: the braces make one hash tag per route and
    /// client, so Redis Cluster keeps all of a decision's keys in one slot.
    pub fn hash_tag(&self, route: &str, client: &ClientId) -> String {
        let mut tag = String::with_capacity(self.key_prefix.len() + route.len() + 80);
        tag.push_str(&self.key_prefix);
        tag.push_str(":{");
        tag.push_str(route);
        tag.push(':');
        write_client(&mut tag, client);
        tag.push('}');
        tag
    }
}

/// How long the cluster client waits before it asks again after
/// `TRYAGAIN`, `CLUSTERDOWN` or `MASTERDOWN`, or when no node holds a slot:
/// (at least, at most), in milliseconds. redis-rs waits 1.28 s at least by
/// default, more than a decision's whole `timeout`, so a decision caught by
/// a slot moving or a replica being promoted would always end in `on_error`
/// however soon the cluster was whole again. Here each wait is random
/// between 2 ms and a ceiling that doubles from 20 ms up to a quarter of
/// the timeout, so a decision asks several times within its timeout and is
/// decided soon after the cluster can.
fn cluster_retry_waits(timeout: Duration) -> (u64, u64) {
    let quarter = u64::try_from(timeout.as_millis() / 4).unwrap_or(u64::MAX);
    (2, quarter.clamp(10, 1000))
}

impl Store for RedisStore {
    async fn decide(&self, charge: Charge<'_>) -> Result<Decision, StoreError> {
        self.decide_at(charge, None).await
    }
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

    /// Loads the function library, or the script where Redis refuses
    /// functions (before Redis 7, or an ACL without `FUNCTION`); remembers
    /// which, for the commands that follow.
    async fn load_code(&self, conn: &mut Conn) -> Result<(), RedisError> {
        if self.functions.load(Ordering::Relaxed) != FUNCTIONS_NO {
            let loaded = redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(&self.library.code)
                .query_async::<Value>(conn)
                .await;
            match loaded {
                Ok(_) => {
                    self.functions.store(FUNCTIONS_YES, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if refuses_functions(&e) => {
                    tracing::info!(
                        error = %e,
                        "Redis does not take function libraries; deciding with EVALSHA"
                    );
                    self.functions.store(FUNCTIONS_NO, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        self.script.load_async(conn).await.map(drop)
    }

    /// Builds in `command`: `FCALL <function> <number of keys> <keys…>`, then
    /// per decision `<now> <cost> "<algorithm> <limit> <window> <burst>…"`;
    /// or `EVALSHA <sha> …` with the same arguments where Redis has no
    /// functions.
    fn command<'a>(&self, command: &mut Cmd, asks: impl Iterator<Item = Ask<'a>> + Clone) {
        command.clear();
        if self.functions.load(Ordering::Relaxed) == FUNCTIONS_NO {
            command.arg("EVALSHA").arg(self.script.get_hash());
        } else {
            command.arg("FCALL").arg(self.library.function.as_str());
        }
        command.arg(asks.clone().map(|a| a.limits.len()).sum::<usize>());
        for ask in asks.clone() {
            for (index, limit) in ask.limits.iter().enumerate() {
                command.arg(Key {
                    tag: ask.tag,
                    index,
                    limit,
                });
            }
        }
        for ask in asks {
            match ask.now {
                Some(now) => command.arg(now),
                None => command.arg(""),
            };
            command.arg(ask.cost).arg(Spec(ask.limits));
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
        // Boxed: the pool's future holds a whole connection attempt and is
        // needed only when a lane is missing or broken.
        let pooled = Box::pin(self.pool.get()).await.map_err(|e| match e {
            managed::PoolError::Backend(e) => StoreError::Backend(format!("cannot connect: {e}")),
            other => StoreError::Backend(format!("connection pool: {other}")),
        })?;
        // The pooled object goes straight back; the clone shares its connection.
        let lane = Arc::new(pooled.clone_handle());
        slot.store(Some(Arc::clone(&lane)));
        Ok(lane)
    }
}

// === calls of several decisions ===

/// One decision as a call carries it.
#[derive(Clone, Copy)]
struct Ask<'a> {
    /// The hash tag of its keys.
    tag: &'a str,
    limits: &'a [Limit],
    cost: u64,
    /// Replaces Redis `TIME` (tests only).
    now: Option<u64>,
}

/// A decision waiting for a call, and where its answer goes.
struct Pending {
    tag: String,
    limits: Limits,
    cost: u64,
    now: Option<u64>,
    reply: oneshot::Sender<Result<Decision, StoreError>>,
}

impl Pending {
    fn ask(&self) -> Ask<'_> {
        Ask {
            tag: &self.tag,
            limits: self.limits.as_slice(),
            cost: self.cost,
            now: self.now,
        }
    }
}

/// A route's limits, owned while the decision waits: most routes have one,
/// which needs no allocation.
enum Limits {
    One(Limit),
    Many(Box<[Limit]>),
}

impl Limits {
    fn new(limits: &[Limit]) -> Self {
        match limits {
            [one] => Self::One(*one),
            many => Self::Many(many.into()),
        }
    }

    fn as_slice(&self) -> &[Limit] {
        match self {
            Self::One(one) => std::slice::from_ref(one),
            Self::Many(many) => many,
        }
    }
}

/// One of the tasks that send a store's calls: takes every decision waiting
/// (up to [`MAX_BATCH`]), sends them in one call, hands each its answer,
/// and starts over. Ends when the store is dropped.
async fn send_calls(
    link: Arc<Link>,
    waiting: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Pending>>>,
) {
    let mut batch: Vec<Pending> = Vec::with_capacity(MAX_BATCH);
    let mut command = Cmd::new();
    loop {
        // One task at a time waits for decisions; the others are in flight.
        if waiting.lock().await.recv_many(&mut batch, MAX_BATCH).await == 0 {
            return;
        }
        // A decision whose request gave up (timed out, or the client left)
        // is not sent: nothing would see its answer.
        batch.retain(|p| !p.reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        let asks = batch.iter().map(Pending::ask);
        let sent = tokio::time::timeout(link.timeout, link.call(&mut command, asks));
        let answer = match sent.await {
            Ok(reply) => reply,
            Err(_) => Err(StoreError::Timeout(link.timeout)),
        };
        deliver(&mut batch, answer);
    }
}

/// Hands each decision of `batch` its part of `answer`, in order, and
/// empties `batch`.
fn deliver(batch: &mut Vec<Pending>, answer: Result<Value, StoreError>) {
    let limits = batch.iter().map(|p| p.limits.as_slice().len()).sum();
    let failed = match answer.as_ref().map(|reply| verdict_values(reply, limits)) {
        Ok(Ok(values)) => {
            let mut rest = values;
            for pending in batch.drain(..) {
                let decision = next_decision(&mut rest, pending.limits.as_slice().len());
                let _ = pending.reply.send(Ok(decision));
            }
            return;
        }
        Ok(Err(e)) => e,
        Err(e) => e.clone(),
    };
    for pending in batch.drain(..) {
        let _ = pending.reply.send(Err(failed.clone()));
    }
}

/// A route's limits as the Lua code reads them: `<algorithm> <limit>
/// <window_ms> <burst>` for each, separated by spaces. A route sends the
/// same text with every decision, so Redis parses it once.
struct Spec<'a>(&'a [Limit]);

impl ToRedisArgs for Spec<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut spec = out.writer_for_next_arg();
        let mut digits = [0u8; 20];
        // Writing into the command's buffer cannot fail.
        for (i, limit) in self.0.iter().enumerate() {
            if i > 0 {
                let _ = spec.write_all(b" ");
            }
            let _ = spec.write_all(limit.algorithm.name().as_bytes());
            for n in [limit.limit, limit.window_ms, limit.burst] {
                let _ = spec.write_all(b" ");
                let _ = spec.write_all(decimal(n, &mut digits));
            }
        }
    }
}

/// A key: `{tag}:{index}:{algorithm}:{window_ms}`, written straight into
/// the command, without a buffer of its own.
struct Key<'a> {
    tag: &'a str,
    index: usize,
    limit: &'a Limit,
}

impl ToRedisArgs for Key<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut key = out.writer_for_next_arg();
        let mut digits = [0u8; 20];
        // Writing into the command's buffer cannot fail.
        let _ = key.write_all(self.tag.as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(decimal(self.index as u64, &mut digits));
        let _ = key.write_all(b":");
        let _ = key.write_all(self.limit.algorithm.name().as_bytes());
        let _ = key.write_all(b":");
        let _ = key.write_all(decimal(self.limit.window_ms, &mut digits));
    }
}

/// `n` in decimal, written at the end of `digits`.
fn decimal(n: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &digits[at..]
}

/// Whether `FUNCTION LOAD` failed because this Redis does not take function
/// libraries at all (no such command before Redis 7, or an ACL without it),
/// rather than for a passing reason (`READONLY` mid-failover, `LOADING`).
fn refuses_functions(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            detail_mentions(e, &["unknown command", "unknown subcommand"])
        }
        _ => false,
    }
}

/// Whether a server error's text contains one of `phrases` (lower case),
/// in any case.
fn detail_mentions(e: &RedisError, phrases: &[&str]) -> bool {
    e.detail().is_some_and(|d| {
        let d = d.to_ascii_lowercase();
        phrases.iter().any(|p| d.contains(p))
    })
}

/// Whether a decision failed only because Redis lacks the code it names:
/// the script (`NOSCRIPT`), the function, or `FCALL` itself.
fn code_missing(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoScript) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            detail_mentions(e, &["function not found", "unknown command"])
        }
        _ => false,
    }
}

/// Writes a client id so that it cannot break the hash tag or the key's
/// structure, and two different ids never write the same text: addresses as
/// `a:<ip>`, short header values of safe characters as `h:<value>`, any
/// other header value as `s:<sha-256 hex>` (fixed length, whatever its size;
/// a value kept only as its digest writes the same), and composite ids as
/// `c:<part>|<part>…`.
pub fn write_client(out: &mut String, client: &ClientId) {
    match client {
        ClientId::Addr(IpAddr::V4(ip)) => {
            // The common case, written without the formatting machinery:
            // the same text as `Display`.
            out.push_str("a:");
            for (i, octet) in ip.octets().into_iter().enumerate() {
                if i > 0 {
                    out.push('.');
                }
                if octet >= 100 {
                    out.push(char::from(b'0' + octet / 100));
                }
                if octet >= 10 {
                    out.push(char::from(b'0' + octet / 10 % 10));
                }
                out.push(char::from(b'0' + octet % 10));
            }
        }
        ClientId::Addr(ip) => {
            let _ = write!(out, "a:{ip}");
        }
        ClientId::Header(bytes) => {
            let plain = bytes.len() <= MAX_PLAIN_CLIENT
                && bytes.iter().all(|&b| {
                    b.is_ascii_alphanumeric()
                        || matches!(b, b'-' | b'.' | b'_' | b'~' | b'+' | b'/' | b'=' | b'@')
                });
            if plain {
                out.push_str("h:");
                out.extend(bytes.iter().map(|&b| char::from(b)));
            } else {
                write_digest(out, &Sha256::digest(bytes).into());
            }
        }
        // The same text as the long value it stands for would write.
        ClientId::Digest(digest) => write_digest(out, digest),
        // One bucket for the whole route.
        ClientId::Global => out.push('g'),
        ClientId::Composite(parts) => {
            // No part's text contains '|', so the joined text is unambiguous.
            out.push_str("c:");
            for (i, part) in parts.iter().enumerate() {
                if i > 0 {
                    out.push('|');
                }
                write_client(out, part);
            }
        }
    }
}

/// `s:` and a SHA-256 in hex.
fn write_digest(out: &mut String, digest: &[u8; 32]) {
    out.push_str("s:");
    for b in digest {
        let _ = write!(out, "{b:02x}");
    }
}

/// The verdicts in the reply to a call: four integers per limit (allowed,
/// remaining, next_ms, retry_after_ms), `limits` limits in all, read from
/// the array as it came; anything else is an error.
fn verdict_values(reply: &Value, limits: usize) -> Result<&[Value], StoreError> {
    let values = match reply {
        Value::Array(values) if values.len() == limits * 4 => values,
        Value::Array(values) => {
            return Err(StoreError::Backend(format!(
                "the decision script answered {} values for {limits} limits",
                values.len()
            )));
        }
        other => {
            return Err(StoreError::Backend(format!(
                "the decision script answered {other:?}, not integers"
            )));
        }
    };
    if let Some(other) = values.iter().find(|v| !matches!(v, Value::Int(_))) {
        return Err(StoreError::Backend(format!(
            "the decision script answered {other:?} among its integers"
        )));
    }
    Ok(values)
}

/// One decision from its verdicts (already checked to be integers, four per
/// limit).
fn decision_from_values(values: &[Value]) -> Decision {
    let int = |v: &Value| match v {
        Value::Int(n) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    };
    Decision::combine(values.chunks_exact(4).map(|v| Verdict {
        allowed: matches!(v[0], Value::Int(1)),
        remaining: int(&v[1]),
        next_ms: int(&v[2]),
        retry_after_ms: int(&v[3]),
    }))
}

/// The next decision of a call's verdicts, of `limits` limits, taken off
/// the front of `rest` (already checked to hold four integers per limit of
/// every decision).
fn next_decision(rest: &mut &[Value], limits: usize) -> Decision {
    let (mine, others) = rest.split_at((limits * 4).min(rest.len()));
    *rest = others;
    decision_from_values(mine)
}

/// The decision in the reply to a call that carried only it.
fn decision_from_reply(reply: &Value, limits: usize) -> Result<Decision, StoreError> {
    verdict_values(reply, limits).map(decision_from_values)
}

// === the pool ===

/// Makes pooled connections, without deadpool-redis's per-checkout `PING`.
enum Lanes {
    /// Multiplexed connections to one Redis.
    Single(deadpool_redis::Manager),
    /// Cluster connections, which route each command to its slot's primary
    /// and follow `MOVED`/`ASK` redirections themselves.
    Cluster(redis::cluster::ClusterClient),
    /// Connections to the primary that the Sentinels name at connect time;
    /// after a failover the old connection fails and is replaced.
    Sentinel(
        tokio::sync::Mutex<redis::sentinel::SentinelClient>,
        AsyncConnectionConfig,
    ),
}

/// A connection to one Redis or to a cluster; cheap to clone, and clones
/// share the connection (commands from many tasks are pipelined).
#[derive(Clone)]
enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// One pooled connection and whether a command on it failed for a
/// connection reason.
struct Lane {
    conn: Conn,
    broken: Arc<AtomicBool>,
}

impl Lane {
    fn clone_handle(&self) -> Lane {
        Lane {
            conn: self.conn.clone(),
            broken: Arc::clone(&self.broken),
        }
    }

    /// Notes `error`; a connection-level one retires this connection, and so
    /// does `READONLY`: the node was demoted, the primary is elsewhere now.
    fn failed(&self, error: RedisError) -> StoreError {
        if error.is_io_error()
            || error.is_connection_dropped()
            || error.is_unrecoverable_error()
            || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        {
            self.broken.store(true, Ordering::Relaxed);
        }
        StoreError::Backend(error.to_string())
    }
}

impl managed::Manager for Lanes {
    type Type = Lane;
    type Error = RedisError;

    async fn create(&self) -> Result<Lane, RedisError> {
        let conn = match self {
            Self::Single(manager) => Conn::Single(managed::Manager::create(manager).await?),
            Self::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
            Self::Sentinel(sentinels, config) => {
                let primary = sentinels.lock().await.async_get_client().await?;
                Conn::Single(
                    primary
                        .get_multiplexed_async_connection_with_config(config)
                        .await?,
                )
            }
        };
        Ok(Lane {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
        })
    }

    async fn recycle(&self, lane: &mut Lane, _: &Metrics) -> RecycleResult<RedisError> {
        if lane.broken.load(Ordering::Relaxed) {
            return Err(RecycleError::message("connection failed; replacing it"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;

    #[test]
    fn cluster_retries_wait_a_quarter_of_the_timeout_at_most() {
        let waits = |ms| cluster_retry_waits(Duration::from_millis(ms));
        assert_eq!(waits(50), (2, 12));
        assert_eq!(waits(300), (2, 75));
        assert_eq!(waits(20), (2, 10));
        assert_eq!(waits(60_000), (2, 1000));
    }

    #[test]
    fn the_scripts_reply_is_read_as_four_integers_per_limit() {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&n| Value::Int(n)).collect());
        let d = decision_from_reply(&ints(&[1, 5, 1000, 0]), 1).expect("one limit");
        assert!(d.allowed);
        assert_eq!((d.remaining, d.next_ms, d.retry_after_ms), (5, 1000, 0));
        let d = decision_from_reply(&ints(&[1, 9, 500, 0, 0, -3, 60000, 1 << 50]), 2)
            .expect("two limits");
        assert!(!d.allowed);
        assert_eq!((d.limit, d.remaining, d.retry_after_ms), (1, 0, 1 << 50));
        for bad in [
            ints(&[1, 5, 1000]),
            ints(&[1, 5, 1000, 0, 1]),
            Value::Array(vec![
                Value::Int(1),
                Value::Nil,
                Value::Int(1000),
                Value::Int(0),
            ]),
            Value::Int(1),
            Value::BulkString(b"1 5 1000 0".to_vec()),
        ] {
            assert!(decision_from_reply(&bad, 1).is_err(), "{bad:?}");
        }
    }

    fn written(client: &ClientId) -> String {
        let mut s = String::new();
        write_client(&mut s, client);
        s
    }

    #[test]
    fn addresses_and_plain_header_values_are_readable_in_keys() {
        assert_eq!(
            written(&ClientId::Addr([192, 0, 2, 1].into())),
            "a:192.0.2.1"
        );
        let key = ClientId::header("key-123");
        assert_eq!(written(&key), "h:key-123");
    }

    #[test]
    fn calls_carry_keys_first_then_now_cost_and_limits_per_decision() {
        let store =
            RedisStore::new("redis://127.0.0.1:1", "p", Duration::from_secs(1)).expect("store");
        let one = [Limit::new(Algorithm::Gcra, 5, 1_000).with_burst(7)];
        let two = [
            Limit::new(Algorithm::FixedWindow, 3, 60_000),
            Limit::new(Algorithm::SlidingLog, 10, 2_500),
        ];
        let asks = [
            Ask {
                tag: "t1",
                limits: &one,
                cost: 1,
                now: None,
            },
            Ask {
                tag: "t2",
                limits: &two,
                cost: 4,
                now: Some(1_700_000_000_123),
            },
        ];
        let mut command = Cmd::new();
        store.link.command(&mut command, asks.iter().copied());
        let args: Vec<String> = command
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not a plain argument>".to_owned(),
            })
            .collect();
        assert_eq!(
            args[2..],
            [
                "3",
                "t1:0:gcra:1000",
                "t2:0:fixed_window:60000",
                "t2:1:sliding_log:2500",
                "",
                "1",
                "gcra 5 1000 7",
                "1700000000123",
                "4",
                "fixed_window 3 60000 3 sliding_log 10 2500 10",
            ]
        );
    }

    #[test]
    fn decimals_are_written_as_display_writes_them() {
        for n in [0, 1, 9, 10, 99, 100, 60_000, 1 << 50, u64::MAX] {
            let mut digits = [0u8; 20];
            assert_eq!(decimal(n, &mut digits), n.to_string().as_bytes());
        }
    }

    #[test]
    fn ipv4_addresses_are_written_as_display_writes_them() {
        // Every octet value in every position, without 2^32 cases.
        for octet in 0..=255u8 {
            for ip in [
                [octet, 0, 9, 255],
                [10, octet, 100, 1],
                [99, 199, octet, 0],
                [255, 1, 10, octet],
            ] {
                let ip = std::net::Ipv4Addr::from(ip);
                assert_eq!(written(&ClientId::Addr(ip.into())), format!("a:{ip}"));
            }
        }
    }

    #[test]
    fn header_values_that_look_like_addresses_do_not_share_their_bucket() {
        let header = ClientId::header("192.0.2.1");
        assert_ne!(
            written(&header),
            written(&ClientId::Addr([192, 0, 2, 1].into()))
        );
    }

    #[test]
    fn braces_colons_and_long_values_are_hashed_to_a_fixed_length() {
        for raw in ["a}b", "{x}", "a:b", &"k".repeat(65)] {
            let w = written(&ClientId::header(raw));
            assert!(w.starts_with("s:"), "{raw}: {w}");
            assert_eq!(w.len(), 2 + 64);
            assert!(!w.contains(['{', '}']));
        }
    }
}
