//! Listening for units given back: every settlement that gives units back
//! publishes, in the same atomic call, the hash tags of the keys it gave
//! them to on `{key_prefix}:given-back` (`lua/decide.lua`, `given_back`).
//! Each instance subscribes to that channel on one connection of its own
//! and notes each tag in its [`GivenBack`], which ends the remembered
//! denials of those keys (see `limit::deny_cache`).
//!
//! The subscription is to the one Redis, the primary the Sentinels name,
//! or any node of a cluster (a cluster's messages reach every node). It is
//! pinged every second: a connection that broke, or that no longer
//! answers, is replaced, and until it is no denial is remembered (the
//! messages meanwhile may be lost).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::StreamExt as _;
use redis::ConnectionInfo;
use redis::aio::{PubSubSink, PubSubStream};

use super::RedisStore;
use super::cluster::Cluster;
use super::connections::store_error;
use crate::limit::Charge;
use crate::limit::deny_cache::GivenBack;

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

/// Where to subscribe.
pub(super) enum Source {
    /// The one Redis.
    Single(ConnectionInfo),
    /// The primary the Sentinels name.
    Sentinel(redis::sentinel::SentinelClient),
    /// Any node of a cluster.
    Cluster(Arc<Cluster>),
}

/// The listening task, stopped when the store that started it is dropped.
pub(super) struct Listener {
    task: tokio::task::AbortHandle,
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

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
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
    let heard = (given_back, Arc::clone(&accepted));
    let task = runtime.spawn(run(source, channel, heard, timeout));
    Some(Listener {
        task: task.abort_handle(),
        accepted,
    })
}

async fn run(
    mut source: Source,
    channel: String,
    (given_back, accepted): (Arc<GivenBack>, Arc<AtomicBool>),
    timeout: Duration,
) {
    let mut failing = false;
    loop {
        match tokio::time::timeout(timeout, subscribe(&mut source, &channel)).await {
            Ok(Ok((sink, stream))) => {
                given_back.listening();
                if failing {
                    tracing::info!(%channel, "listening for units given back again");
                }
                failing = false;
                let why = hear(sink, stream, &given_back, timeout).await;
                given_back.deaf();
                tracing::debug!(%channel, why, "stopped listening for units given back");
            }
            Ok(Err(e)) if !accepted.load(Ordering::Relaxed) => {
                // Said once the store has accepted floodgate: a refusal
                // is the start's to report (see `Listener::store_accepted`).
                given_back.deaf();
                tracing::debug!(%channel, error = %e, "cannot listen for units given back yet");
            }
            Ok(Err(e)) => {
                given_back.deaf();
                if !failing {
                    tracing::warn!(
                        %channel,
                        error = %e,
                        "cannot listen for units given back; denials are not remembered until this works (each refused request asks the store); a Redis user needs permission to subscribe to the channel (ACL SETUSER … &{channel})"
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
    let infos = match source {
        Source::Single(info) => vec![info.clone()],
        Source::Sentinel(sentinels) => {
            let client = sentinels
                .async_get_client()
                .await
                .map_err(|e| store_error(&e, "sentinels").to_string())?;
            vec![client.get_connection_info().clone()]
        }
        Source::Cluster(cluster) => cluster.any_node(),
    };
    let mut last = "no node is known".to_owned();
    for info in infos {
        let attempt = async {
            let (mut sink, stream) = redis::Client::open(info)?.get_async_pubsub().await?.split();
            sink.subscribe(channel).await?;
            Ok::<_, redis::RedisError>((sink, stream))
        };
        match attempt.await {
            Ok(subscribed) => return Ok(subscribed),
            Err(e) => last = store_error(&e, "").to_string(),
        }
    }
    Err(last)
}

/// Notes every message until the subscription breaks or a ping goes
/// unanswered; says which.
async fn hear(
    mut sink: PubSubSink,
    mut stream: PubSubStream,
    given_back: &GivenBack,
    timeout: Duration,
) -> &'static str {
    let mut ping = tokio::time::interval(PING_EVERY);
    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            message = stream.next() => match message {
                Some(message) => given_back.note(message.get_payload_bytes()),
                None => return "the connection closed",
            },
            _ = ping.tick() => {
                let answered = tokio::time::timeout(timeout, sink.ping::<redis::Value>()).await;
                if !matches!(answered, Ok(Ok(_))) {
                    return "a ping went unanswered";
                }
            }
        }
    }
}
