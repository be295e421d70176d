//! A client flooding far past its limit: denials are remembered until their
//! retry-after, so the flood costs Redis one call per retry-after period,
//! and a remembered denial never outlives what Redis would have said.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::client::ClientId;
use floodgate::config::{Endpoint, OnError, RedisSettings, Store};
use floodgate::limit::{Algorithm, Answer, Charge, Limit, Limiter};
use floodgate::metrics::Metrics;
use support::config::{Config, Route};
use support::redis::{
    TestRedis, command_stats, decision_calls, reset_command_stats, unique_prefix,
};
use support::{Floodgate, TestClient};

#[tokio::test]
async fn a_flooding_client_costs_one_redis_call_per_retry_after_period() {
    let redis = TestRedis::start_private().await;
    let toml = Config::new()
        .redis(&redis.url, &unique_prefix("flood"))
        .route(
            Route::new("api")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Client""#)
                .limit("sliding_log", 3, "1h"),
        )
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let client = TestClient::http1();
    // Let both finish loading the script, then count from zero.
    assert_eq!(
        client
            .get(&gates[0].url("/"), &[("x-client", "warm")])
            .await
            .status,
        200
    );
    assert_eq!(
        client
            .get(&gates[1].url("/"), &[("x-client", "warm")])
            .await
            .status,
        200
    );
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    let mut statuses = [0usize; 2];
    for i in 0..400 {
        let a = client
            .get(&gates[i % 2].url("/"), &[("x-client", "flood")])
            .await;
        statuses[usize::from(a.status == 429)] += 1;
        if a.status == 429 {
            assert!(a.header("retry-after").is_some() && a.header("ratelimit").is_some());
        }
    }
    assert_eq!(statuses, [3, 397]);
    let info: String = command_stats(&mut conn).await;
    // 3 admissions, then one denial per instance; the other 395 denials came
    // from the instances' memory of those denials.
    assert_eq!(decision_calls(&info), 3 + 2, "{info}");
}

fn limiter_config(redis: &TestRedis, prefix: &str) -> Store {
    Store::Redis(RedisSettings {
        endpoint: Endpoint::Single(redis.url.clone()),
        key_prefix: prefix.to_owned(),
        timeout: Duration::from_secs(1),
        on_error: OnError::Deny,
        local_instances: 1,
        tls: Default::default(),
        id_secret: None,
    })
}

/// For each algorithm, in real time: deny, wait until just past the
/// retry-after Redis gave, and be admitted; a remembered denial in between
/// costs no Redis call.
#[tokio::test]
async fn a_remembered_denial_never_outlives_the_one_redis_gave() {
    let redis = TestRedis::start_private().await;
    let metrics = Metrics::new();
    let limiter = Limiter::new(
        &limiter_config(&redis, &unique_prefix("cache-exact")),
        floodgate::config::DEFAULT_MAX_CLIENT_ENTRIES,
        metrics.store(),
    )
    .await
    .expect("limiter");
    let route: Arc<str> = "r".into();
    let mut conn = redis.connection().await;
    for (i, limit) in [
        Limit::new(Algorithm::FixedWindow, 3, 400),
        Limit::new(Algorithm::SlidingLog, 3, 400),
        Limit::new(Algorithm::SlidingWindow, 3, 400),
        Limit::new(Algorithm::TokenBucket, 3, 400).with_burst(3),
        Limit::new(Algorithm::Gcra, 3, 400).with_burst(3),
    ]
    .into_iter()
    .enumerate()
    {
        let client = ClientId::Addr([10, 9, 9, i as u8].into());
        let limits = [limit];
        let charge = Charge {
            route: &route,
            client: &client,
            limits: &limits,
            keys: &[],
            cost: 1,
            settle: None,
        };
        let (mut round, mut attempts) = (0, 0);
        while round < 3 {
            // Use up the limit, then get denied.
            let (denied_at, retry) = loop {
                let sent = Instant::now();
                match limiter.decide(charge).await {
                    Answer::Decided(d) if d.allowed => continue,
                    Answer::Decided(d) => break (sent, d.retry_after_ms),
                    other => panic!("{limit:?}: {other:?}"),
                }
            };
            assert!(retry > 0);
            attempts += 1;
            assert!(
                attempts <= 30,
                "{limit:?}: no denial far enough from its end"
            );
            if retry < 100 {
                // Denied just before a window ends: its middle is too close
                // to its end to be hit reliably on a busy machine. Let it
                // pass and deny again.
                tokio::time::sleep_until((denied_at + Duration::from_millis(retry + 5)).into())
                    .await;
                continue;
            }
            round += 1;
            let before: String = command_stats(&mut conn).await;
            // Halfway: still denied, from memory.
            tokio::time::sleep_until((denied_at + Duration::from_millis(retry / 2)).into()).await;
            match limiter.decide(charge).await {
                Answer::Decided(d) => assert!(
                    !d.allowed,
                    "{limit:?} round {round}: admitted before retry-after"
                ),
                other => panic!("{other:?}"),
            }
            let after: String = command_stats(&mut conn).await;
            assert_eq!(
                decision_calls(&after),
                decision_calls(&before),
                "{limit:?}: the remembered denial asked Redis"
            );
            // Just past the retry-after: Redis would admit, and so must we.
            tokio::time::sleep_until((denied_at + Duration::from_millis(retry + 5)).into()).await;
            match limiter.decide(charge).await {
                Answer::Decided(d) => assert!(
                    d.allowed,
                    "{limit:?} round {round}: denied after the retry-after of {retry} ms"
                ),
                other => panic!("{other:?}"),
            }
        }
    }
}
