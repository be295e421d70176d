//! The Redis store against a real Redis: the scripts' arithmetic at every
//! boundary, atomicity under concurrency across instances, Redis's clock,
//! script reloading, at most one command per decision (decisions made together
//! share one), and `on_error`.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate::client::ClientId;
use floodgate::limit::redis::RedisStore;
use floodgate::limit::{Algorithm, Charge, Decision, Limit, Settlement};
use support::config::{Config, Route};
use support::redis::{
    TestRedis, command_calls, command_stats, decision_calls, has_functions, reset_command_stats,
    unique_prefix,
};
use support::{Floodgate, TestClient, Upstream};

fn redis_config(url: &str, prefix: &str, upstream: &str, limits: &str, on_error: &str) -> String {
    Config::new()
        .admin()
        .redis(url, prefix)
        .store(&format!(r#"on_error = "{on_error}""#))
        .route(
            Route::new("api")
                .upstream(upstream)
                .client(r#"from = "header", name = "X-Client""#)
                .limits(limits),
        )
        .toml()
}

/// `floodgate_redis_calls_total` from the admin listener's `/metrics`.
async fn redis_calls_metric(client: &TestClient, gate: &Floodgate) -> u64 {
    let text = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    text.lines()
        .find_map(|l| l.strip_prefix("floodgate_redis_calls_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no floodgate_redis_calls_total in:\n{text}"))
}

fn limit(algorithm: Algorithm, limit: u64, window_ms: u64) -> Limit {
    Limit::new(algorithm, limit, window_ms)
}

/// The hash tag of route `r` and client `client` (a header value), as the
/// store writes it: `{r:k:<digest>}`.
fn tag(client: &str) -> String {
    let mut tag = String::from("{r:");
    floodgate::limit::redis::write_client(
        &mut tag,
        &ClientId::header(client),
        &floodgate::limit::redis::IdKey::new(None),
    );
    tag.push('}');
    tag
}

fn store(redis: &TestRedis, prefix: &str) -> RedisStore {
    RedisStore::new(&redis.url, prefix, Duration::from_secs(2)).expect("store")
}

async fn decide(
    store: &RedisStore,
    client: &str,
    limits: &[Limit],
    cost: u64,
    now: u64,
) -> Decision {
    let route: Arc<str> = "r".into();
    let client = ClientId::header(client);
    store
        .decide_at(
            Charge {
                route: &route,
                client: &client,
                limits,
                keys: &[],
                cost,
                settle: None,
            },
            Some(now),
        )
        .await
        .expect("decision")
}

#[tokio::test]
async fn fourth_request_is_denied_through_the_proxy_for_both_algorithms() {
    let redis = TestRedis::start().await;
    for algorithm in ["fixed_window", "sliding_log"] {
        let upstream = Upstream::start().await;
        let prefix = unique_prefix("fourth");
        let limits = format!("{{ algorithm = \"{algorithm}\", limit = 3, window = \"60s\" }}");
        let gate = Floodgate::start(&redis_config(
            &redis.url,
            &prefix,
            &upstream.url(),
            &limits,
            "deny",
        ))
        .await;
        let client = TestClient::http1();
        for remaining in ["2", "1", "0"] {
            let a = client.get(&gate.url("/x"), &[("x-client", "alice")]).await;
            assert_eq!(a.status, 200, "{algorithm}");
            let rl = a.header("ratelimit").unwrap_or_default();
            assert!(rl.starts_with(&format!("\"api\";r={remaining};")), "{rl}");
        }
        let denied = client.get(&gate.url("/x"), &[("x-client", "alice")]).await;
        assert_eq!(denied.status, 429, "{algorithm}");
        assert!(denied.header("retry-after").is_some());
        assert_eq!(
            client
                .get(&gate.url("/x"), &[("x-client", "bob")])
                .await
                .status,
            200
        );
        assert_eq!(upstream.hits(), 4, "{algorithm}");
    }
}

#[tokio::test]
async fn two_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = TestRedis::start().await;
    let algorithms = [
        "fixed_window",
        "sliding_log",
        "sliding_window",
        "token_bucket",
        "gcra",
    ];
    for algorithm in algorithms {
        let upstream = Upstream::start().await;
        let prefix = unique_prefix("two");
        // An hour's window: no refill or slide can add a unit during the burst.
        let limits = format!("{{ algorithm = \"{algorithm}\", limit = 100, window = \"1h\" }}");
        let config = redis_config(&redis.url, &prefix, &upstream.url(), &limits, "deny");
        let gates = [
            Floodgate::start(&config).await,
            Floodgate::start(&config).await,
        ];
        let client = TestClient::http1();
        let tasks: Vec<_> = (0..300)
            .map(|i| {
                let url = gates[i % 2].url("/x");
                let client = client.clone();
                tokio::spawn(async move { client.get(&url, &[("x-client", "one")]).await.status })
            })
            .collect();
        let mut counts = [0usize; 2];
        for t in tasks {
            match t.await.expect("task").as_u16() {
                200 => counts[0] += 1,
                429 => counts[1] += 1,
                other => panic!("unexpected status {other}"),
            }
        }
        assert_eq!(counts, [100, 200], "{algorithm}");
        assert_eq!(upstream.hits(), 100, "{algorithm}");
    }
}

#[tokio::test]
async fn sliding_log_counts_every_request_in_the_same_millisecond() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("same-ms");
    let store = Arc::new(store(&redis, &prefix));
    let limits = [limit(Algorithm::SlidingLog, 50, 60_000)];
    let now = 1_700_000_000_000;
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let store = Arc::clone(&store);
            tokio::spawn(async move { decide(&store, "c", &limits, 1, now).await.allowed })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.expect("task"));
    }
    assert_eq!(admitted, 50);
    let mut conn = redis.connection().await;
    let key = format!("{prefix}:{}:0:sliding_log:60000", tag("c"));
    let members: usize = redis::cmd("ZCARD")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("zcard");
    assert_eq!(members, 50);
}

/// Every key expires: no later than its window plus the scripts' one-second
/// expiry slack.
async fn assert_ttl_at_most_window_plus_slack(
    conn: &mut redis::aio::MultiplexedConnection,
    key: &str,
    window_ms: i64,
) {
    let ttl: i64 = redis::cmd("PTTL")
        .arg(key)
        .query_async(conn)
        .await
        .expect("pttl");
    assert!(
        ttl > 0 && ttl <= window_ms + 1_000,
        "TTL {ttl} of {key}: the window plus the expiry slack at most"
    );
}

#[tokio::test]
async fn fixed_window_script_boundaries_are_exact() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("fw");
    let store = store(&redis, &prefix);
    let limits = [limit(Algorithm::FixedWindow, 3, 1_000)];
    let t = 1_700_000_000_000; // a window boundary
    // `t` is the time to the window's end, with units left or not.
    let d = decide(&store, "c", &limits, 1, t + 100).await;
    assert_eq!(
        (d.allowed, d.remaining, d.next_ms, d.retry_after_ms),
        (true, 2, 900, 0)
    );
    let d = decide(&store, "c", &limits, 2, t + 200).await;
    assert_eq!(
        (d.allowed, d.remaining, d.next_ms),
        (true, 0, 800),
        "last unit admitted"
    );
    let d = decide(&store, "c", &limits, 1, t + 999).await;
    assert_eq!(
        (d.allowed, d.remaining, d.next_ms, d.retry_after_ms),
        (false, 0, 1, 1)
    );
    let d = decide(&store, "c", &limits, 1, t + 1_000).await;
    assert_eq!(
        (d.allowed, d.remaining, d.next_ms),
        (true, 2, 1_000),
        "new window"
    );

    let mut conn = redis.connection().await;
    let key = format!("{prefix}:{}:0:fixed_window:1000", tag("c"));
    assert_ttl_at_most_window_plus_slack(&mut conn, &key, 1_000).await;
}

#[tokio::test]
async fn sliding_log_script_boundaries_are_exact() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("sl");
    let store = store(&redis, &prefix);
    let limits = [limit(Algorithm::SlidingLog, 3, 1_000)];
    let t = 1_700_000_000_000;
    assert!(decide(&store, "c", &limits, 1, t + 100).await.allowed);
    assert!(decide(&store, "c", &limits, 1, t + 400).await.allowed);
    let d = decide(&store, "c", &limits, 1, t + 700).await;
    assert_eq!((d.allowed, d.remaining, d.next_ms), (true, 0, 400));
    let d = decide(&store, "c", &limits, 1, t + 800).await;
    assert_eq!(
        (d.allowed, d.remaining, d.next_ms, d.retry_after_ms),
        (false, 0, 300, 300)
    );
    // Cost 2 must wait for the two oldest entries.
    let d = decide(&store, "c", &limits, 2, t + 800).await;
    assert_eq!((d.allowed, d.retry_after_ms), (false, 600));
    assert!(!decide(&store, "c", &limits, 1, t + 1_099).await.allowed);
    let d = decide(&store, "c", &limits, 1, t + 1_100).await;
    assert_eq!(
        (d.allowed, d.remaining),
        (true, 0),
        "oldest left at exactly +1000"
    );

    let mut conn = redis.connection().await;
    let key = format!("{prefix}:{}:0:sliding_log:1000", tag("c"));
    assert_ttl_at_most_window_plus_slack(&mut conn, &key, 1_000).await;
}

#[tokio::test]
async fn a_denial_by_one_limit_writes_nothing_to_the_others() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("all-or-nothing");
    let store = store(&redis, &prefix);
    let limits = [
        limit(Algorithm::SlidingLog, 10, 60_000),
        limit(Algorithm::FixedWindow, 1, 60_000),
    ];
    let t = 1_700_000_040_000;
    assert!(decide(&store, "c", &limits, 1, t).await.allowed);
    for i in 1..=5 {
        let d = decide(&store, "c", &limits, 1, t + i).await;
        assert!(!d.allowed);
        assert_eq!(d.limit, 1, "the fixed window denied");
    }
    let mut conn = redis.connection().await;
    let log = format!("{prefix}:{}:0:sliding_log:60000", tag("c"));
    let members: usize = redis::cmd("ZCARD")
        .arg(&log)
        .query_async(&mut conn)
        .await
        .expect("zcard");
    assert_eq!(members, 1, "denied requests were logged");
    // A client that never got in leaves no key at all.
    let fresh = [limit(Algorithm::FixedWindow, 1, 60_000)];
    assert!(decide(&store, "d", &fresh, 1, t).await.allowed);
    assert!(!decide(&store, "d", &fresh, 1, t).await.allowed);
    let keys = redis.keys(&format!("{prefix}:*")).await;
    assert_eq!(keys.len(), 3, "{keys:?}");
    for key in keys {
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("pttl");
        assert!(ttl > 0, "{key} has no TTL");
    }
}

#[tokio::test]
async fn redis_time_decides_unless_a_test_passes_now() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("clock");
    let store = store(&redis, &prefix);
    let limits = [limit(Algorithm::SlidingLog, 1, 60_000)];
    // A caller whose clock says 1970 fills the log...
    assert!(decide(&store, "c", &limits, 1, 1_000).await.allowed);
    assert!(!decide(&store, "c", &limits, 1, 1_001).await.allowed);
    // ...but production decisions pass no time: Redis's clock is now, and
    // the 1970 entry is decades outside the window.
    let route: Arc<str> = "r".into();
    let client = ClientId::header("c");
    let charge = Charge {
        route: &route,
        client: &client,
        limits: &limits,
        keys: &[],
        cost: 1,
        settle: None,
    };
    assert!(
        store
            .decide_at(charge, None)
            .await
            .expect("decision")
            .allowed
    );
    // And the entry it wrote carries Redis's time.
    let mut conn = redis.connection().await;
    let (secs, _): (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn)
        .await
        .expect("time");
    let key = format!("{prefix}:{}:0:sliding_log:60000", tag("c"));
    let newest: Vec<(String, f64)> = redis::cmd("ZRANGE")
        .arg(&key)
        .arg(-1)
        .arg(-1)
        .arg("WITHSCORES")
        .query_async(&mut conn)
        .await
        .expect("zrange");
    let score = newest.first().map_or(0.0, |(_, s)| *s) as u64;
    assert!(
        score.abs_diff(secs * 1000) < 5_000,
        "score {score} vs Redis time {secs}s"
    );

    let fixed = [limit(Algorithm::FixedWindow, 1, 10_000)];
    let before: (u64, u64) = redis::cmd("TIME")
        .query_async(&mut conn)
        .await
        .expect("time");
    let charge = Charge {
        limits: &fixed,
        ..charge
    };
    let d = store.decide_at(charge, None).await.expect("decision");
    let redis_ms = before.0 * 1000 + before.1 / 1000;
    let expected_reset = 10_000 - redis_ms % 10_000;
    assert!(
        d.next_ms <= expected_reset && expected_reset - d.next_ms < 1_000,
        "reset {} vs {expected_reset} by Redis's clock",
        d.next_ms
    );
}

#[tokio::test]
async fn function_and_script_flush_mid_run_are_recovered_from() {
    let redis = TestRedis::start().await;
    let mut conn = redis.connection().await;
    let functions = has_functions(&mut conn).await;
    for (n, flush) in ["FUNCTION", "SCRIPT"].into_iter().enumerate() {
        if flush == "FUNCTION" && !functions {
            continue;
        }
        let prefix = unique_prefix("flush");
        let store = store(&redis, &prefix);
        let limits = [limit(Algorithm::FixedWindow, 3, 60_000)];
        let t = 1_700_000_040_000 + n as u64 * 60_000;
        assert!(decide(&store, "c", &limits, 1, t).await.allowed);
        let _: () = redis::cmd(flush)
            .arg("FLUSH")
            .query_async(&mut conn)
            .await
            .expect("flush");
        let d = decide(&store, "c", &limits, 1, t + 1).await;
        assert_eq!((d.allowed, d.remaining), (true, 1), "after {flush} FLUSH");
        assert!(decide(&store, "c", &limits, 1, t + 2).await.allowed);
        assert!(!decide(&store, "c", &limits, 1, t + 3).await.allowed);
    }
}

/// A call that floodgate would never send (an algorithm the code does not
/// know, or keys that do not match the limits) is refused whole: not even
/// the well-formed requests before the bad one are decided.
#[tokio::test]
async fn a_malformed_call_decides_nothing() {
    let redis = TestRedis::start().await;
    let mut conn = redis.connection().await;
    let prefix = unique_prefix("malformed");
    let first = format!("{prefix}:{{r:a}}:0:fixed_window:60000");
    let second = format!("{prefix}:{{r:b}}:0:fixed_window:60000");
    let script = redis::Script::new(floodgate::limit::redis::SCRIPT);
    let calls: [(&[&str], &[&str], &str); 3] = [
        (
            &[&first, &second],
            &[
                "",
                "1",
                "fixed_window 3 60000 3 0",
                "",
                "1",
                "leaky 3 60000 3 0",
            ],
            "unknown algorithm leaky",
        ),
        (
            &[&first],
            &[
                "",
                "1",
                "fixed_window 3 60000 3 0",
                "",
                "1",
                "fixed_window 3 60000 3 0",
            ],
            "1 keys for 2 limits",
        ),
        (
            &[&first, &second],
            &["", "1", "fixed_window 3 60000 3 0"],
            "2 keys for 1 limits",
        ),
    ];
    for (keys, args, expected) in calls {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let error = invocation
            .invoke_async::<redis::Value>(&mut conn)
            .await
            .expect_err("a malformed call must fail");
        assert!(error.to_string().contains(expected), "{error}");
        let exists: u64 = redis::cmd("EXISTS")
            .arg(&first)
            .arg(&second)
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        assert_eq!(exists, 0, "a malformed call wrote a key: {expected}");
    }
}

/// A Redis without functions (before Redis 7, or with `FCALL` and
/// `FUNCTION` renamed away, as here) gets the same decisions through
/// `EVALSHA`, one call each.
#[tokio::test]
async fn redis_without_functions_decides_through_evalsha() {
    let redis = TestRedis::start_process_with(&[
        "--rename-command",
        "FCALL",
        "",
        "--rename-command",
        "FUNCTION",
        "",
    ])
    .await;
    let prefix = unique_prefix("nofunctions");
    let early = store(&redis, &prefix);
    early.load_script().await.expect("load the script");
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    let limits = [limit(Algorithm::Gcra, 3, 60_000)];
    let t = 1_700_000_100_000;
    for expected in [true, true, true, false] {
        assert_eq!(decide(&early, "c", &limits, 1, t).await.allowed, expected);
    }
    let info = command_stats(&mut conn).await;
    assert_eq!(command_calls(&info, "evalsha"), 4, "{info}");
    assert_eq!(command_calls(&info, "script|load"), 0, "{info}");
    // A settlement goes the same way: a reservation of 1 settled to 0
    // gives its unit back, and one more request fits.
    let (route, client): (Arc<str>, _) = ("r".into(), ClientId::header("c"));
    let settled = early
        .decide_at(
            Charge {
                route: &route,
                client: &client,
                limits: &limits,
                keys: &[],
                cost: 0,
                settle: Some(Settlement {
                    at_ms: t,
                    reserved: 1,
                    local: false,
                    kind: floodgate::limit::Settled::Reservation,
                }),
            },
            Some(t),
        )
        .await
        .expect("a settlement");
    assert_eq!((settled.allowed, settled.remaining), (true, 1));
    assert!(decide(&early, "c", &limits, 1, t).await.allowed);
    assert!(!decide(&early, "c", &limits, 1, t).await.allowed);
    let info = command_stats(&mut conn).await;
    assert_eq!(command_calls(&info, "evalsha"), 4 + 3, "{info}");
    // Every algorithm is in the script, each under a limit of 3.
    for algorithm in Algorithm::ALL {
        let limits = [limit(algorithm, 3, 60_000)];
        let client = format!("every-{}", algorithm.name());
        for expected in [true, true, true, false] {
            let decided = decide(&early, &client, &limits, 1, t).await;
            assert_eq!(decided.allowed, expected, "{algorithm:?}");
        }
    }
    reset_command_stats(&mut conn).await;

    // A store that never loaded anything finds out on its first decision.
    let late = store(&redis, &unique_prefix("late"));
    assert!(decide(&late, "c", &limits, 1, t).await.allowed);
    assert!(decide(&late, "c", &limits, 1, t).await.allowed);
    let info = command_stats(&mut conn).await;
    assert_eq!(command_calls(&info, "evalsha"), 2, "{info}");
}

#[tokio::test]
async fn each_decision_runs_once_in_at_most_one_command_and_nothing_else() {
    let redis = TestRedis::start_private().await;
    let upstream = Upstream::start().await;
    let prefix = unique_prefix("commandstats");
    let limits = "{ algorithm = \"sliding_log\", limit = 1000, window = \"60s\" }, \
                  { algorithm = \"fixed_window\", limit = 1000, window = \"1s\" }";
    let gate = Floodgate::start(&redis_config(
        &redis.url,
        &prefix,
        &upstream.url(),
        limits,
        "deny",
    ))
    .await;
    let client = TestClient::http1();
    // Let startup (script load) finish, then count from zero.
    assert_eq!(
        client
            .get(&gate.url("/x"), &[("x-client", "warm")])
            .await
            .status,
        200
    );
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    let calls_before = redis_calls_metric(&client, &gate).await;
    const N: u64 = 200;
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let client = client.clone();
            let url = gate.url("/x");
            tokio::spawn(async move {
                client
                    .get(&url, &[("x-client", &format!("c{i}"))])
                    .await
                    .status
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("task"), 200);
    }
    let info: String = command_stats(&mut conn).await;
    // At most one command per decision: decisions made at the same time
    // may share one.
    let calls = decision_calls(&info);
    assert!((1..=N).contains(&calls), "{calls} calls for {N}:\n{info}");
    if has_functions(&mut conn).await {
        assert_eq!(command_calls(&info, "fcall"), calls, "{info}");
    }
    // Each call asks Redis's clock once, whatever it carries.
    assert_eq!(command_calls(&info, "time"), calls, "{info}");
    // floodgate counts the calls it sends, as Redis does.
    assert_eq!(
        redis_calls_metric(&client, &gate).await - calls_before,
        calls,
        "{info}"
    );
    // Commands a script runs count too: the fixed window reads its key with
    // one GET and writes it with one SET inside the script, and no two
    // decisions share a client here, so any GET or SET floodgate sent on its
    // own would show as more than N.
    assert_eq!(command_calls(&info, "get"), N, "{info}");
    assert_eq!(command_calls(&info, "set"), N, "{info}");
    // 200 concurrent decisions were pipelined over a handful of connections,
    // not one connection each (the other client is this test's own).
    let clients: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .expect("client list");
    let floodgate_connections = clients.lines().count() - 1;
    assert!(
        (1..=4).contains(&floodgate_connections),
        "{floodgate_connections} connections:\n{clients}"
    );
}

/// Decisions made at the same moment go to Redis together, and each is
/// still decided exactly as if it had been alone: 64 concurrent decisions
/// against one client's limit of 50 admit exactly 50, in fewer calls than
/// decisions; next to them, other clients' decisions with two limits each
/// and their own `now` get what one-at-a-time decisions give.
#[tokio::test(flavor = "current_thread")]
async fn concurrent_decisions_share_calls_and_stay_exact() {
    let redis = TestRedis::start_private().await;
    let shared = Arc::new(store(&redis, &unique_prefix("shared")));
    shared.load_script().await.expect("load the code");
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    let t = 1_700_000_400_000;
    let one = [limit(Algorithm::FixedWindow, 50, 60_000)];
    let two = [
        limit(Algorithm::SlidingLog, 4, 10_000),
        limit(Algorithm::Gcra, 6, 60_000).with_burst(6),
    ];
    // Spawned together on this one thread, so all wait for Redis at once.
    let mut tasks = tokio::task::JoinSet::new();
    const N: u64 = 64;
    for _ in 0..N {
        let store = Arc::clone(&shared);
        tasks.spawn(async move { ("flood", 0, decide(&store, "flood", &one, 1, t).await) });
    }
    for i in 0..12u64 {
        let store = Arc::clone(&shared);
        let client = ["a", "b"][(i % 2) as usize];
        // Each decision carries its own `now`, a millisecond apart.
        tasks.spawn(async move { (client, i, decide(&store, client, &two, 1, t + i).await) });
    }
    let mut flood_allowed = 0;
    let mut others = Vec::new();
    while let Some(done) = tasks.join_next().await {
        let (client, i, decision) = done.expect("task");
        if client == "flood" {
            flood_allowed += u64::from(decision.allowed);
        } else {
            others.push((client, i, decision));
        }
    }
    assert_eq!(flood_allowed, 50);
    let info = command_stats(&mut conn).await;
    let calls = decision_calls(&info);
    assert!(calls < N, "{calls} calls for {} decisions:\n{info}", N + 12);
    // A call reads the flooding client's key once, however many of its
    // decisions it carries; the 12 others read one key each (the sliding
    // log reads none).
    let reads = command_calls(&info, "get");
    assert!(
        reads <= calls + 12,
        "{reads} reads in {calls} calls:\n{info}"
    );

    // The same decisions for a and b, one at a time, in a fresh prefix.
    others.sort_by_key(|&(_, i, _)| i);
    let alone = store(&redis, &unique_prefix("alone"));
    for (client, i, decision) in others {
        let expected = decide(&alone, client, &two, 1, t + i).await;
        assert_eq!(decision, expected, "{client} decision {i}");
    }
}

/// One call carrying several decisions of one client reads that client's
/// key once and writes it once, and leaves the same state and answers as
/// the same decisions sent one call each.
#[tokio::test]
async fn a_call_reads_and_writes_each_key_once() {
    let redis = TestRedis::start_private().await;
    let prefix = unique_prefix("together");
    let together = store(&redis, &prefix);
    together.load_script().await.expect("load the code");
    let mut conn = redis.connection().await;
    let t = 1_700_000_500_000;
    let window = [limit(Algorithm::FixedWindow, 4, 60_000)];
    let bucket = [limit(Algorithm::Gcra, 6, 60_000).with_burst(2)];
    let route: Arc<str> = "r".into();
    let (a, b) = (ClientId::header("a"), ClientId::header("b"));
    // a, b, a, a, b, a, a, b, a: six of a against 4 per minute, three of b
    // against a burst of 2, each a millisecond after the one before.
    let order = [&a, &b, &a, &a, &b, &a, &a, &b, &a];
    let charges: Vec<_> = order
        .iter()
        .enumerate()
        .map(|(i, &client)| {
            let limits: &[Limit] = if client == &a { &window } else { &bucket };
            let charge = Charge {
                route: &route,
                client,
                limits,
                keys: &[],
                cost: 1,
                settle: None,
            };
            (charge, Some(t + i as u64))
        })
        .collect();
    reset_command_stats(&mut conn).await;
    let decisions = together
        .decide_together_at(&charges)
        .await
        .expect("decisions");
    let info = command_stats(&mut conn).await;
    assert_eq!(decision_calls(&info), 1, "{info}");
    assert_eq!(command_calls(&info, "get"), 2, "{info}");
    assert_eq!(command_calls(&info, "set"), 2, "{info}");
    let allowed: Vec<bool> = decisions.iter().map(|d| d.allowed).collect();
    assert_eq!(
        allowed,
        [true, true, true, true, true, true, false, false, false],
        "{decisions:?}"
    );

    // The same decisions, one call each, under another prefix.
    let alone_prefix = unique_prefix("one_by_one");
    let alone = store(&redis, &alone_prefix);
    for (i, (charge, now)) in charges.iter().enumerate() {
        let expected = alone.decide_at(*charge, *now).await.expect("decision");
        assert_eq!(decisions[i], expected, "decision {i}");
    }
    for key in [
        format!("{}:0:fixed_window:60000", tag("a")),
        format!("{}:0:gcra:60000", tag("b")),
    ] {
        let mut stored = Vec::new();
        for prefix in [&prefix, &alone_prefix] {
            let key = format!("{prefix}:{key}");
            let value: Option<String> = redis::cmd("GET")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("GET");
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("PTTL");
            stored.push((value.unwrap_or_else(|| panic!("{key} is missing")), ttl));
        }
        assert_eq!(stored[0].0, stored[1].0, "{key}");
        // Both TTLs were set from the same `now`, moments apart in Redis's
        // clock.
        assert!(
            stored[0].1 > 0 && stored[0].1.abs_diff(stored[1].1) < 1_000,
            "{key}: {stored:?}"
        );
    }
}

/// A call whose verdicts take more than one pack of the decision code
/// (it packs 256 integers at a time; here 40 decisions of two limits, 320
/// integers) is read back whole and in order: the same answers as the
/// same decisions sent one call each.
#[tokio::test]
async fn a_call_with_more_verdicts_than_one_pack_is_read_whole() {
    let redis = TestRedis::start_private().await;
    let together = store(&redis, &unique_prefix("many"));
    let alone = store(&redis, &unique_prefix("many_alone"));
    together.load_script().await.expect("load the code");
    let t = 1_700_000_600_000;
    let limits = [
        limit(Algorithm::FixedWindow, 30, 60_000),
        limit(Algorithm::SlidingLog, 25, 60_000),
    ];
    let route: Arc<str> = "r".into();
    let client = ClientId::header("many");
    let charges: Vec<_> = (0..40u64)
        .map(|i| {
            let charge = Charge {
                route: &route,
                client: &client,
                limits: &limits,
                keys: &[],
                cost: 1,
                settle: None,
            };
            (charge, Some(t + i))
        })
        .collect();
    let decisions = together
        .decide_together_at(&charges)
        .await
        .expect("decisions");
    assert_eq!(decisions.len(), 40);
    for (i, d) in decisions.iter().enumerate() {
        assert_eq!(d.allowed, i < 25, "decision {i}: {d:?}");
        let left = if i < 25 { 24 - i as u64 } else { 0 };
        assert_eq!(d.remaining, left, "decision {i}: {d:?}");
    }
    for (i, (charge, now)) in charges.iter().enumerate() {
        let expected = alone.decide_at(*charge, *now).await.expect("decision");
        assert_eq!(decisions[i], expected, "decision {i}");
    }
}

#[tokio::test]
async fn store_down_follows_on_error_within_the_timeout() {
    let mut redis = TestRedis::start_process().await;
    let upstream = Upstream::start().await;
    let limits = "{ algorithm = \"fixed_window\", limit = 100, window = \"60s\" }";
    // The outage is real here, so a short timeout: 200 ms.
    let short = |toml: String| toml.replace(r#"timeout = "1s""#, r#"timeout = "200ms""#);
    let allow = Floodgate::start(&short(redis_config(
        &redis.url,
        &unique_prefix("allow"),
        &upstream.url(),
        limits,
        "allow",
    )))
    .await;
    let deny = Floodgate::start(&short(redis_config(
        &redis.url,
        &unique_prefix("deny"),
        &upstream.url(),
        limits,
        "deny",
    )))
    .await;
    let client = TestClient::http1();
    assert_eq!(client.get(&allow.url("/x"), &[]).await.status, 200);
    assert_eq!(client.get(&deny.url("/x"), &[]).await.status, 200);
    redis.kill();
    // Store timeout is 200 ms; a generous margin keeps slow CI machines green.
    let budget = Duration::from_millis(200 + 800);
    for _ in 0..5 {
        let started = Instant::now();
        let a = client.get(&allow.url("/x"), &[]).await;
        assert_eq!(a.status, 200, "on_error = allow forwards");
        assert!(
            a.header("ratelimit").is_none(),
            "no decision, no RateLimit header"
        );
        assert!(
            started.elapsed() < budget,
            "allow took {:?}",
            started.elapsed()
        );

        let started = Instant::now();
        let d = client.get(&deny.url("/x"), &[]).await;
        assert_eq!(d.status, 503, "on_error = deny answers 503");
        assert_eq!(d.header("retry-after"), Some("1"));
        assert!(
            started.elapsed() < budget,
            "deny took {:?}",
            started.elapsed()
        );
    }
    assert_eq!(upstream.hits(), 2 + 5);
}

#[tokio::test]
async fn floodgate_starts_while_redis_is_down_and_limits_once_it_is_up() {
    let mut redis = TestRedis::start_process().await;
    redis.kill();
    let upstream = Upstream::start().await;
    let limits = "{ algorithm = \"fixed_window\", limit = 2, window = \"60s\" }";
    let gate = Floodgate::start(&redis_config(
        &redis.url,
        &unique_prefix("late"),
        &upstream.url(),
        limits,
        "deny",
    ))
    .await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/x"), &[]).await.status, 503);
    redis.restart().await;
    // The circuit breaker lets a probe through within its cooldown.
    let deadline = Instant::now() + Duration::from_secs(5);
    while client
        .get(&gate.url("/x"), &[("x-client", "probe")])
        .await
        .status
        != 200
    {
        assert!(
            Instant::now() < deadline,
            "limiting did not resume once Redis was up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let me = [("x-client", "me")];
    assert_eq!(client.get(&gate.url("/x"), &me).await.status, 200);
    assert_eq!(client.get(&gate.url("/x"), &me).await.status, 200);
    assert_eq!(client.get(&gate.url("/x"), &me).await.status, 429);
}

/// A key that holds something other than the script's numbers (a hash an
/// older floodgate wrote, or text someone SET by hand) reads as empty and is
/// overwritten by the next admission, instead of failing every decision on
/// that key until it expires.
#[tokio::test]
async fn a_key_of_another_shape_reads_as_empty_and_is_replaced() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("shape");
    let store = store(&redis, &prefix);
    let mut conn = redis.connection().await;
    let t = 1_700_000_000_000;
    for (algorithm, client) in [
        (Algorithm::FixedWindow, "hash"),
        (Algorithm::Gcra, "text"),
        (Algorithm::TokenBucket, "hash"),
        (Algorithm::SlidingWindow, "text"),
    ] {
        let limits = [limit(algorithm, 2, 60_000)];
        let key = format!("{prefix}:{}:0:{}:60000", tag(client), algorithm.name());
        if client == "hash" {
            let _: () = redis::cmd("HSET")
                .arg(&key)
                .arg("c")
                .arg(99)
                .query_async(&mut conn)
                .await
                .expect("hset");
        } else {
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg("not numbers")
                .query_async(&mut conn)
                .await
                .expect("set");
        }
        let first = decide(&store, client, &limits, 1, t).await;
        assert!(first.allowed, "{algorithm:?} over a {client} key");
        assert_eq!(first.remaining, 1, "{algorithm:?}");
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("type");
        assert_eq!(kind, "string", "{algorithm:?}");
        assert!(decide(&store, client, &limits, 1, t).await.allowed);
        assert!(
            !decide(&store, client, &limits, 1, t).await.allowed,
            "{algorithm:?}"
        );
        let _: () = redis::cmd("DEL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("del");
    }
}

/// A message already in the subscription that the listener has not read
/// (messages held: read only in barrier rounds) is read and noted by a
/// barrier round before it returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_round_reads_a_message_the_listener_has_not_read_yet() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("barrier");
    let store = store(&redis, &prefix);
    assert!(store.listening_within(Duration::from_secs(5)).await);
    let given_back = store.given_back();
    given_back.barrier().hold_messages();
    // A first round: from its end on, the listener reads only in rounds.
    assert!(given_back.caught_up(Duration::from_secs(5)).await);
    let before = given_back.mark();
    let mut conn = redis.connection().await;
    let subscribers: u64 = redis::cmd("PUBLISH")
        .arg(format!("{prefix}:given-back"))
        .arg("some-tag")
        .query_async(&mut conn)
        .await
        .expect("PUBLISH");
    assert_eq!(subscribers, 1, "the store listens");
    assert_eq!(given_back.mark(), before, "the message waits unread");
    assert!(given_back.caught_up(Duration::from_secs(5)).await);
    assert!(
        given_back.mark() > before,
        "the round read the message before it returned"
    );
}
