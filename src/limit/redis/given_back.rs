//! Listening for units given back: every settlement that gives units back
//! publishes, in the same atomic call, the hash tags of the keys it gave
//! them to on `{key_prefix}:given-back` (`lua/decide.lua`, `given_back`).
//! Each instance subscribes to that channel on one connection of its own
//! and notes each tag in its [`GivenBack`], which ends the remembered
//! denials of those keys (see `limit::deny_cache`).
//!
//! The subscription is to the one Redis, the primary the Sentinels name,
//! or every primary of a cluster (see [`every_primary`]). It is pinged
//! every second: a connection that broke, or that no longer answers, is
//! replaced, and until it is no denial is remembered (the messages
//! meanwhile may be lost).
//!
//! Each subscription also answers the rounds of its store's barrier
//! (`limit::deny_cache::barrier`): it sends PING and notes every message
//! read before the PONG, which Redis sends after every message already
//! queued on the connection. The client library's reader hands messages
//! on, in the order they arrived, before it completes the PING's answer,
//! so once the PONG is in, those messages wait in the stream and are read
//! without waiting.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::{FutureExt as _, StreamExt as _};
use redis::ConnectionInfo;
use redis::aio::{PubSubSink, PubSubStream};

use super::RedisStore;
use super::cluster::Cluster;
use super::connections::store_error;
use super::slot::slot_of;
use crate::limit::Charge;
use crate::limit::deny_cache::{GivenBack, Subscription};

impl RedisStore {
    /// Where units were given back lately, as the store tells this
    /// instance (see `limit::deny_cache`).
    pub fn given_back(&self) -> &GivenBack {
        &self.given_back
    }

    /// Waits until this store listens for units given back, at most
    /// `limit`: a started instance then remembers its first denials.
    /// Whether it listens.
    pub async fn listening_within(&self, limit: Duration) -> bool {
        let until = tokio::time::Instant::now() + limit;
        while !self.given_back.is_listening() {
            if self.listener.is_none() || tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// The [`GivenBack`] buckets of `charge`'s keys' hash tags.
    pub fn tag_buckets(&self, charge: &Charge<'_>) -> Box<[u16]> {
        if charge.keys.is_empty() {
            let tag = self.hash_tag(charge.route, charge.client);
            return Box::new([GivenBack::bucket(tag.as_bytes())]);
        }
        charge
            .keys
            .iter()
            .map(|k| GivenBack::bucket(self.hash_tag(&k.scope, &k.client).as_bytes()))
            .collect()
    }
}

/// How often the subscription is pinged.
const PING_EVERY: Duration = Duration::from_secs(1);

/// How often a cluster's slot table is looked at for primaries to
/// subscribe to (an in-process read, no store call).
const FOLLOW_EVERY: Duration = Duration::from_millis(100);

/// Where to subscribe.
pub(super) enum Source {
    /// The one Redis.
    Single(ConnectionInfo),
    /// The primary the Sentinels name.
    Sentinel(redis::sentinel::SentinelClient),
    /// Every primary of a cluster.
    Cluster(Arc<Cluster>),
}

/// A task, stopped when this is dropped.
struct Task(tokio::task::AbortHandle);

impl Drop for Task {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The listening task, stopped when the store that started it is dropped.
pub(super) struct Listener {
    _task: Task,
    /// Set once the store has accepted floodgate's settings (see
    /// [`Self::store_accepted`]).
    accepted: Arc<AtomicBool>,
}

impl Listener {
    /// The store accepted floodgate's settings: from now on, a failure to
    /// listen is this listener's own to report. Before, a store that
    /// refuses floodgate (a wrong password, a user without permission)
    /// is reported by the start's own check, naming what to fix, and the
    /// listener's complaint would only come first and point elsewhere.
    pub(super) fn store_accepted(&self) {
        self.accepted.store(true, Ordering::Relaxed);
    }
}

/// What one subscription hears for: the store's only one (the one Redis,
/// the Sentinels' primary), or one primary's of a cluster's.
#[derive(Clone)]
enum Role {
    Only,
    /// The primary at `addr`; `live` while subscribed there.
    Primary {
        cluster: Arc<Cluster>,
        addr: String,
        live: Arc<AtomicBool>,
    },
}

/// Starts listening on `channel` from `source`, noting each message in
/// `given_back`, on the current Tokio runtime (`None` outside one: then
/// nothing is noted and no denial is remembered). `timeout` bounds a
/// connection attempt and a ping.
pub(super) fn listen(
    source: Source,
    channel: String,
    given_back: Arc<GivenBack>,
    timeout: Duration,
) -> Option<Listener> {
    let runtime = tokio::runtime::Handle::try_current().ok()?;
    let accepted = Arc::new(AtomicBool::new(false));
    let heard = Heard {
        channel,
        given_back,
        accepted: Arc::clone(&accepted),
        timeout,
    };
    let task = match source {
        Source::Cluster(cluster) => runtime.spawn(every_primary(cluster, heard)),
        source => runtime.spawn(async move { keep_subscribed(source, &heard, &Role::Only).await }),
    };
    Some(Listener {
        _task: Task(task.abort_handle()),
        accepted,
    })
}

/// What every subscription of one store shares.
#[derive(Clone)]
struct Heard {
    channel: String,
    given_back: Arc<GivenBack>,
    accepted: Arc<AtomicBool>,
    timeout: Duration,
}

/// A cluster's messages, heard where they are published: a settlement
/// publishes on the primary that runs it, and the cluster bus carries the
/// message to the other nodes only some tens of milliseconds later, longer
/// than an operator's next request takes. So each instance subscribes on
/// every primary of the current slot table, following it as it changes,
/// and hears each message from the node that ran the settlement, in the
/// same moment as that settlement's own answer (and again, later, from
/// the others). Redis 7's sharded `SPUBLISH` would keep a message on its
/// shard, but a shard channel must hash to the publishing key's slot, so
/// an instance would need a channel per slot; and an operator's answer
/// waiting until it is heard would prove only that this instance heard it.
/// Denials are remembered only while every primary's subscription lives.
async fn every_primary(cluster: Arc<Cluster>, heard: Heard) {
    let mut subscribed: HashMap<String, (Task, Arc<AtomicBool>)> = HashMap::new();
    loop {
        let primaries = cluster.primaries();
        subscribed.retain(|addr, _| primaries.iter().any(|(a, _)| a == addr));
        for (addr, info) in primaries {
            subscribed.entry(addr).or_insert_with_key(|addr| {
                let live = Arc::new(AtomicBool::new(false));
                let role = Role::Primary {
                    cluster: Arc::clone(&cluster),
                    addr: addr.clone(),
                    live: Arc::clone(&live),
                };
                let heard = heard.clone();
                let task = tokio::spawn(async move {
                    keep_subscribed(Source::Single(info), &heard, &role).await;
                });
                (Task(task.abort_handle()), live)
            });
        }
        let all_live =
            || !subscribed.is_empty() && subscribed.values().all(|(_, l)| l.load(Ordering::SeqCst));
        if all_live() && !heard.given_back.is_listening() {
            heard.given_back.listening();
        }
        // A subscription that ended meanwhile may have missed messages.
        if !all_live() {
            heard.given_back.deaf();
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
    }
}

/// Subscribes to the channel from `source` and hears it, again after
/// every break.
async fn keep_subscribed(mut source: Source, heard: &Heard, role: &Role) {
    let (channel, given_back) = (&heard.channel, &*heard.given_back);
    let mut failing = false;
    loop {
        match tokio::time::timeout(heard.timeout, subscribe(&mut source, channel)).await {
            Ok(Ok((sink, stream))) => {
                // Answering rounds before listening: a round waits for it.
                let mut rounds = given_back.barrier().subscription();
                match role {
                    Role::Only => given_back.listening(),
                    Role::Primary { live, .. } => live.store(true, Ordering::SeqCst),
                }
                if failing {
                    tracing::info!(%channel, "listening for units given back again");
                }
                failing = false;
                let why = hear((sink, stream), &mut rounds, heard, role).await;
                if let Role::Primary { live, .. } = role {
                    live.store(false, Ordering::SeqCst);
                }
                given_back.deaf();
                // Deaf first: a round no longer waits for it, and the
                // denials it would pass no longer hold.
                drop(rounds);
                tracing::debug!(%channel, why, "stopped listening for units given back");
            }
            Ok(Err(e)) if !heard.accepted.load(Ordering::Relaxed) => {
                // Said once the store has accepted floodgate: a refusal
                // is the start's to report (see `Listener::store_accepted`).
                given_back.deaf();
                tracing::debug!(%channel, error = %e, "cannot listen for units given back yet");
            }
            Ok(Err(e)) => {
                given_back.deaf();
                // Only a refusal of permission is the operator's to grant;
                // a node that is down or failing over is retried.
                if !failing && (e.contains("NOPERM") || e.to_lowercase().contains("permission")) {
                    tracing::warn!(
                        %channel,
                        error = %e,
                        "cannot listen for units given back; denials are not remembered until this works (each refused request asks the store); a Redis user needs permission to subscribe to the channel (ACL SETUSER … &{channel})"
                    );
                } else if !failing {
                    tracing::warn!(
                        %channel,
                        error = %e,
                        "cannot listen for units given back on a node that does not answer (down, or failing over); denials are not remembered until it does (each refused request asks the store); retried every second"
                    );
                }
                failing = true;
            }
            Err(_) => {
                given_back.deaf();
                failing = true;
            }
        }
        tokio::time::sleep(PING_EVERY).await;
    }
}

/// A subscription to `channel` on a node `source` names.
async fn subscribe(
    source: &mut Source,
    channel: &str,
) -> Result<(PubSubSink, PubSubStream), String> {
    let info = match source {
        Source::Single(info) => info.clone(),
        Source::Sentinel(sentinels) => {
            let client = sentinels
                .async_get_client()
                .await
                .map_err(|e| store_error(&e, "sentinels").to_string())?;
            client.get_connection_info().clone()
        }
        Source::Cluster(_) => return Err("a cluster is heard on each primary".to_owned()),
    };
    let attempt = async {
        let (mut sink, stream) = redis::Client::open(info)?.get_async_pubsub().await?.split();
        sink.subscribe(channel).await?;
        Ok::<_, redis::RedisError>((sink, stream))
    };
    attempt.await.map_err(|e| store_error(&e, "").to_string())
}

/// Notes every message until the subscription breaks or a ping goes
/// unanswered; says which. Answers each barrier round asked in `rounds`.
/// A cluster's primary hears every message of the cluster, its own at
/// once and the others' over the cluster bus: all are noted, and counted
/// as heard only from the primary owning the tag's slot, so each is
/// counted once.
async fn hear(
    (mut sink, mut stream): (PubSubSink, PubSubStream),
    rounds: &mut Subscription<'_>,
    heard: &Heard,
    role: &Role,
) -> &'static str {
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = stream.next(), if !rounds.holds_messages() => match message {
                Some(message) => note(&heard.given_back, message.get_payload_bytes(), role),
                None => return "the connection closed",
            },
            _ = ping.tick() => {
                if !pinged(&mut sink, heard.timeout).await {
                    return "a ping went unanswered";
                }
            }
            round = rounds.asked() => {
                match read_through_pong(&mut sink, &mut stream, heard, role).await {
                    Ok(true) => rounds.answer(round),
                    Ok(false) => {}
                    Err(why) => return why,
                }
            }
        }
    }
}

/// Sends PING and notes every message that arrived before its PONG (a
/// barrier round); whether the PONG came within the store's timeout. A
/// later one is not an end: the requests waiting ask the store meanwhile,
/// and the next round or ping tells whether the connection lives. An
/// error ends the subscription; says why.
async fn read_through_pong(
    sink: &mut PubSubSink,
    stream: &mut PubSubStream,
    heard: &Heard,
    role: &Role,
) -> Result<bool, &'static str> {
    match tokio::time::timeout(heard.timeout, sink.ping::<redis::Value>()).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return Err("a ping failed"),
        Err(_) => return Ok(false),
    }
    // Every message before the PONG is in the stream now.
    while let Some(message) = stream.next().now_or_never() {
        let Some(message) = message else {
            return Err("the connection closed");
        };
        note(&heard.given_back, message.get_payload_bytes(), role);
    }
    Ok(true)
}

/// Whether the subscription answers a PING within `timeout`.
async fn pinged(sink: &mut PubSubSink, timeout: Duration) -> bool {
    let answered = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
    matches!(answered, Ok(Ok(_)))
}

/// Notes units given back under `tag`, heard in `role`.
fn note(given_back: &GivenBack, tag: &[u8], role: &Role) {
    match role {
        Role::Primary { cluster, addr, .. }
            if !std::str::from_utf8(tag).is_ok_and(|t| cluster.owns(addr, slot_of(t))) =>
        {
            given_back.note_again(tag);
        }
        _ => given_back.note(tag),
    }
}
