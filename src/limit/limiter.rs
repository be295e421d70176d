//! The limiter a server asks: the configured store, the circuit breaker
//! around a shared one, and the `on_error` policy.
//!
//! Beside the decision itself, each question has its file: [`breakers`]
//! (each node's breaker, and probing it closed), [`refusals`] (whether the
//! store refuses floodgate's settings), [`on_error`] (what a decision gets
//! while the store cannot make it), [`spread`] (a decision over several
//! cluster slots), [`leased`] (limits decided from leased slices) and
//! [`operations`] (standing, adjustments and export).
//!
//! All of that is [`Guarded`], over any [`Backend`]: the Redis store in the
//! product, a fake in the tests.

use std::sync::atomic::AtomicU64;
use std::time::Instant;

use super::deny_cache::{DenyCache, GivenBack};
use super::leases::Leases;
use super::memory::MemoryStore;
use super::redis::RedisStore;
use super::settings::{OnError, Store as StoreConfig};
use super::{Backend, Charge, Decision, StoreError};
use crate::client::ClientId;
use crate::clock::now_ms;
use crate::metrics::{StoreErrorKind, StoreKind, StoreMetrics};

mod breakers;
mod leased;
mod on_error;
mod operations;
mod refusals;
mod spread;
#[cfg(test)]
mod tests;

const ONE_SECOND: std::time::Duration = std::time::Duration::from_secs(1);

/// The store a server counts with, chosen by `[store]`.
#[derive(Debug)]
pub enum Limiter {
    /// In-process counting.
    Memory(Box<(MemoryStore, StoreMetrics)>),
    /// Shared counting in Redis, behind a circuit breaker.
    Redis(Box<Guarded>),
}

/// A store shared by every instance, guarded: the circuit breakers, the
/// remembered denials, the `on_error` fallback and the leased slices
/// around its [`Backend`]. Each of its nodes (the one Redis, or each
/// primary of a cluster) has its own circuit breaker, so a lost cluster
/// node costs only the decisions for its slots.
#[derive(Debug)]
pub struct Guarded<B: Backend = RedisStore> {
    store: B,
    on_error: OnError,
    /// Per-instance counting while Redis is unavailable (`on_error = "local"`).
    local: MemoryStore,
    /// Local limits are divided by this (`local_instances`).
    local_instances: u64,
    /// When a store error was last logged (ms), to log at most once a second.
    last_logged: AtomicU64,
    metrics: StoreMetrics,
    /// Denials in force, answered without asking Redis again.
    denials: DenyCache,
    /// Why the store refuses floodgate's settings, while it does (a
    /// password changed on the server, a permission taken away): set by a
    /// refused call or probe, cleared by the next one that succeeds.
    refused: std::sync::Mutex<Option<String>>,
    /// Whether `refused` holds a reason, read on every decision.
    is_refused: std::sync::atomic::AtomicBool,
    /// When a refusal was last logged (ms), to log at most once a second.
    refusal_logged: AtomicU64,
    /// Slices of leased limits' budgets this instance holds.
    leases: Leases,
}

/// What the limiter says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// A store decided (the shared one, or the local fallback).
    Decided(Decision),
    /// The store could not decide and `on_error` says what to do: deny (503
    /// with `Retry-After`) or let the request through.
    Unavailable {
        /// `on_error = "deny"`.
        deny: bool,
        /// What to tell a denied client.
        retry_after_ms: u64,
    },
}

impl Limiter {
    /// Sets up the store `config` names. A Redis that is down at startup is
    /// logged, not fatal: the breaker starts open and `on_error` applies
    /// until Redis answers. A Redis that answers and refuses floodgate's
    /// settings (a wrong password or user, an unknown database, a missing
    /// permission, a certificate, something that is not Redis) is an error:
    /// [`StoreError::Refused`], naming the setting to fix.
    ///
    /// Each in-process table (the memory store, the local fallback, the
    /// remembered denials) holds at most `max_entries` (route, client)
    /// entries.
    pub async fn new(
        config: &StoreConfig,
        max_entries: usize,
        metrics: StoreMetrics,
    ) -> Result<Self, StoreError> {
        let settings = match config {
            StoreConfig::Memory => {
                let memory = metrics.tables[0].clone();
                let store = MemoryStore::with_capacity(max_entries, memory);
                return Ok(Self::Memory(Box::new((store, metrics))));
            }
            StoreConfig::Redis(settings) => settings,
        };
        let store = redis_store(
            settings,
            metrics.redis_calls.clone(),
            GivenBack::new(
                metrics.given_back_heard.clone(),
                metrics.listening.clone(),
                metrics.given_back_barrier_pings.clone(),
            ),
        )?;
        match store.load_script().await {
            Err(refused @ StoreError::Refused(_)) => return Err(refused),
            Ok(()) => {
                // Denials are remembered only while listening: wait for
                // it a little, so the first floods are remembered too.
                let listening = store
                    .listening_within(settings.timeout.max(ONE_SECOND))
                    .await;
                tracing::info!(
                    redis = %settings.endpoint,
                    key_prefix = %settings.key_prefix,
                    listening,
                    "Redis store ready"
                );
            }
            Err(e) => {
                for node in store.nodes() {
                    node.breaker.open_now(now_ms());
                }
                metrics.circuit_open.set(1);
                tracing::warn!(
                    redis = %settings.endpoint,
                    error = %e,
                    on_error = %settings.on_error,
                    "cannot reach Redis; starting anyway, on_error applies until it answers"
                );
            }
        }
        Ok(Self::Redis(Box::new(Guarded::new(
            store,
            (settings.on_error, settings.local_instances),
            max_entries,
            metrics,
        ))))
    }

    /// Connects to the store `config` names and gives it the decision
    /// code, as a start does, then lets it go: whether the store answers
    /// and accepts floodgate's settings, for `--check --connect` and for a
    /// reload that changes `[store]`. The memory store always does.
    pub async fn check(config: &StoreConfig) -> Result<(), StoreError> {
        let StoreConfig::Redis(settings) = config else {
            return Ok(());
        };
        redis_store(
            settings,
            prometheus_client::metrics::counter::Counter::default(),
            GivenBack::default(),
        )?
        .load_script()
        .await
    }

    /// Announces the rules digest this instance counts by, and returns
    /// how many different ones the instances sharing the store announced
    /// lately (`None` for the memory store, or when the store did not
    /// answer).
    pub async fn announce_rules(&self, digest: &str) -> Option<usize> {
        match self {
            Self::Memory(..) => None,
            Self::Redis(guarded) => guarded.announce_rules(digest).await,
        }
    }

    /// Decides one request.
    pub async fn decide(&self, charge: Charge<'_>) -> Answer {
        match self {
            Self::Memory(memory) => in_memory(memory, charge),
            Self::Redis(guarded) => guarded.decide(charge).await,
        }
    }

    /// Decides one request without waiting, where that needs no store
    /// call: always with the memory store; `None` means ask
    /// [`Limiter::decide`], whose future is large and best kept out of
    /// every request's (boxed by the caller, on the shared store's path).
    pub fn decide_at_once(&self, charge: Charge<'_>) -> Option<Answer> {
        match self {
            Self::Memory(memory) => Some(in_memory(memory, charge)),
            Self::Redis(_) => None,
        }
    }

    /// Settles a reservation (`charge.settle` is set) where it was
    /// decided: the shared store, through its breaker, or this instance's
    /// memory when the decision was local. An error leaves the reservation
    /// as the charge; nothing falls back (`on_error` is for decisions).
    pub async fn settle(&self, charge: Charge<'_>) -> Result<Decision, StoreError> {
        match self {
            Self::Memory(memory) => Ok(memory.0.decide_at(charge, now_ms())),
            Self::Redis(guarded) => guarded.settle(charge).await,
        }
    }

    /// Which store decides: `"memory"` or `"redis"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Memory(..) => "memory",
            Self::Redis(..) => "redis",
        }
    }

    /// The `on_error` policy (`allow` for the memory store, which does not
    /// fail).
    pub fn on_error(&self) -> OnError {
        match self {
            Self::Memory(..) => OnError::Allow,
            Self::Redis(guarded) => guarded.on_error,
        }
    }

    /// Whether requests are refused (503) while the store is down:
    /// `on_error = "deny"`.
    pub fn refuses_when_down(&self) -> bool {
        match self {
            Self::Memory(..) => false,
            Self::Redis(guarded) => guarded.on_error == OnError::Deny,
        }
    }

    /// False while the shared store is considered down: the one Redis's
    /// breaker is open, or on a cluster every primary's is (or no primary
    /// is known yet).
    pub fn ready(&self) -> bool {
        match self {
            Self::Memory(..) => true,
            Self::Redis(guarded) => guarded.ready(),
        }
    }

    /// Why the shared store refuses floodgate's settings, while it does
    /// (see [`StoreError::Refused`]); `None` when it does not.
    pub fn refused(&self) -> Option<String> {
        match self {
            Self::Memory(..) => None,
            Self::Redis(guarded) => guarded.refusal(),
        }
    }

    /// Each node the store decides on now (the one Redis, or each primary
    /// of a cluster): its address, whether its breaker is open, and since
    /// when (ms; `None`: closed since floodgate started). Empty for the
    /// memory store, which has no breaker.
    pub fn nodes(&self) -> Vec<(String, bool, Option<u64>)> {
        match self {
            Self::Memory(..) => Vec::new(),
            Self::Redis(guarded) => guarded.nodes(),
        }
    }

    /// True while some but not all of a cluster's primaries are considered
    /// down: the decisions for their slots get `on_error`, the others are
    /// decided.
    pub fn degraded(&self) -> bool {
        match self {
            Self::Memory(..) => false,
            Self::Redis(guarded) => guarded.degraded(),
        }
    }

    /// Brings the per-node breaker gauges up to date: one series per node
    /// the store decides on now.
    pub fn refresh_gauges(&self) {
        if let Self::Redis(guarded) = self {
            guarded.refresh_gauges();
        }
    }

    /// Evicts expired in-process state.
    pub fn sweep(&self) {
        let now = now_ms();
        match self {
            Self::Memory(memory) => {
                let (store, _) = &**memory;
                store.sweep(now);
            }
            Self::Redis(guarded) => guarded.sweep(now),
        }
    }

    /// Forgets remembered denials: the rules they were made under changed.
    /// Slices of leased limits are given back by the next
    /// [`Limiter::return_leases`].
    pub fn rules_changed(&self) {
        if let Self::Redis(guarded) = self {
            guarded.denials.clear();
        }
    }

    /// Gives back what leased limits' slices leave when they are up, for
    /// ever (returns at once with the memory store, which leases nothing).
    pub async fn keep_leases(&self) {
        if let Self::Redis(guarded) = self {
            guarded.keep_leases().await;
        }
    }

    /// Gives back every slice this instance holds now: the rules changed
    /// (a slice of a limit that is gone would be held to its end), or
    /// floodgate stops.
    pub async fn return_leases(&self) {
        if let Self::Redis(guarded) = self {
            guarded.return_lapsed(true).await;
        }
    }
}

/// Who a denial of `charge` is remembered for: its client, or, when its
/// limits count other identities too (an organisation, an address, the
/// whole API), all of them together, since a denial by one user's limit
/// says nothing of another user sharing the route's client (an address).
fn remembered_as<'c>(charge: &Charge<'c>) -> std::borrow::Cow<'c, ClientId> {
    if charge.keys.is_empty() {
        return std::borrow::Cow::Borrowed(charge.client);
    }
    std::borrow::Cow::Owned(ClientId::Composite(
        charge.keys.iter().map(|k| k.client.clone()).collect(),
    ))
}

/// The Redis store `settings` describe, counting its calls in `calls` and
/// noting units given back in `given_back`; connects lazily.
fn redis_store(
    settings: &super::settings::RedisSettings,
    calls: prometheus_client::metrics::counter::Counter,
    given_back: GivenBack,
) -> Result<RedisStore, StoreError> {
    Ok(RedisStore::connect(
        &settings.endpoint,
        &settings.tls,
        &settings.key_prefix,
        settings.timeout,
        calls,
        given_back,
    )?
    .with_id_secret(settings.id_secret.as_ref().map(|s| &s.0[..])))
}

/// The memory store's decision, timed. One wall-clock read is both the
/// decision's time and its start (two reads a decision, not three: this
/// runs on every request); a clock stepped back meanwhile times it as 0.
fn in_memory(memory: &(MemoryStore, StoreMetrics), charge: Charge<'_>) -> Answer {
    let (store, metrics) = memory;
    let started = std::time::SystemTime::now();
    let decision = store.decide_at(charge, crate::clock::ms_at(started));
    metrics.decided(StoreKind::Memory, started.elapsed().unwrap_or_default());
    Answer::Decided(decision)
}

impl<B: Backend> Guarded<B> {
    /// The store behind the guards, for what they do not guard (the key
    /// registry's records, the audit).
    pub(crate) fn store(&self) -> &B {
        &self.store
    }

    /// The orchestration over `store`: what `on_error` says and how many
    /// instances share the store (`local_instances`), with in-process
    /// tables of at most `max_entries` entries.
    fn new(
        store: B,
        (on_error, local_instances): (OnError, u64),
        max_entries: usize,
        metrics: StoreMetrics,
    ) -> Self {
        let [_, local, denials] = metrics.tables.clone();
        Self {
            store,
            on_error,
            local: MemoryStore::with_capacity(max_entries, local),
            local_instances,
            last_logged: AtomicU64::new(0),
            leases: Leases::new(max_entries, metrics.leases.clone()),
            metrics,
            denials: DenyCache::with_capacity(max_entries, denials),
            refused: std::sync::Mutex::new(None),
            is_refused: std::sync::atomic::AtomicBool::new(false),
            refusal_logged: AtomicU64::new(0),
        }
    }

    /// Settles `charge` where it was decided (see [`Limiter::settle`]).
    async fn settle(&self, charge: Charge<'_>) -> Result<Decision, StoreError> {
        let now = now_ms();
        if charge.settle.is_some_and(|s| s.local) {
            return Ok(self.decide_locally(charge, now));
        }
        let settled = self.ask_store(charge, now).await;
        if settled.is_ok() && charge.settle.is_some_and(|s| s.reserved > charge.cost) {
            // Units came back: a remembered denial may not hold.
            self.denials.forget(charge.route, &remembered_as(&charge));
        }
        settled
    }

    /// How many rules digests the instances sharing the store announced
    /// lately, this one's `digest` announced (see
    /// [`Limiter::announce_rules`]).
    async fn announce_rules(&self, digest: &str) -> Option<usize> {
        self.store
            .announce_rules(digest)
            .await
            .ok()
            .map(|d| d.len())
    }

    /// Evicts expired in-process state at `now` (ms).
    fn sweep(&self, now: u64) {
        self.local.sweep(now);
        self.denials.sweep(Instant::now());
        self.leases.refresh_gauges();
    }

    async fn decide(&self, charge: Charge<'_>) -> Answer {
        if charge.limits.iter().any(|l| l.lease.is_some()) {
            return Box::pin(self.decide_leased(charge)).await;
        }
        self.decide_plain(charge).await
    }

    /// Decides `charge` in the store (or by a remembered denial, or by
    /// `on_error`).
    async fn decide_plain(&self, charge: Charge<'_>) -> Answer {
        let started = Instant::now();
        let remembered = remembered_as(&charge);
        let whose = (charge.route, &*remembered, charge.limits);
        let given_back = self.store.given_back();
        // Only a remembered denial waits for the barrier: an admitted
        // request costs the lookup alone.
        if self
            .denials
            .get(whose, charge.cost, started, given_back)
            .is_some()
            && let Some(denial) = self.still_denied(whose, charge.cost).await
        {
            self.metrics.decided(StoreKind::Cache, started.elapsed());
            return Answer::Decided(denial);
        }
        let mark = given_back.mark();
        let now = now_ms();
        match self.ask_store(charge, now).await {
            Ok(decision) => {
                self.accepted();
                self.metrics.decided(StoreKind::Redis, started.elapsed());
                self.denials
                    .insert(whose, charge.cost, (started, mark), decision, || {
                        self.store.tag_buckets(&charge)
                    });
                Answer::Decided(decision)
            }
            Err(e) => {
                self.metrics.failed(match e {
                    StoreError::Timeout(_) => StoreErrorKind::Timeout,
                    StoreError::Backend(_) => StoreErrorKind::Backend,
                    StoreError::CircuitOpen => StoreErrorKind::CircuitOpen,
                    StoreError::Refused(_) => StoreErrorKind::Refused,
                });
                self.fallback(charge, &e)
            }
        }
    }

    /// The denial remembered for a request of `cost` units by `whose`,
    /// once every message the store sent this instance before now has
    /// been read (one may end the denial; see `deny_cache::barrier`).
    /// `None` when none holds then, or when that cannot be made sure
    /// within the store's timeout: the store then decides, exactly.
    async fn still_denied(
        &self,
        whose: (&std::sync::Arc<str>, &ClientId, &[super::Limit]),
        cost: u64,
    ) -> Option<Decision> {
        let given_back = self.store.given_back();
        if !given_back.caught_up(self.store.timeout()).await {
            return None;
        }
        self.denials.get(whose, cost, Instant::now(), given_back)
    }

    /// Asks the store to decide (or settle) `charge`: in one call, or on a
    /// cluster where its keys lie in several slots, in one call per slot
    /// (see [`spread`]).
    async fn ask_store(&self, charge: Charge<'_>, now: u64) -> Result<Decision, StoreError> {
        if let Some(parts) = self.store.parts(&charge) {
            return Box::pin(self.decide_spread(charge, parts, now)).await;
        }
        let target = self.store.target(&charge)?;
        self.through_breaker(target, charge, now).await
    }
}
