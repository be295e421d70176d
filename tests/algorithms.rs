//! Every algorithm, both stores: the Lua scripts on a real Redis against
//! their pure Rust twins, decision by decision, on random traces; and each
//! algorithm's published behaviour as table tests run on both.

mod support;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use floodgate::client::ClientId;
use floodgate::limit::algorithms::State;
use floodgate::limit::memory::MemoryStore;
use floodgate::limit::penalty::Penalty;
use floodgate::limit::redis::RedisStore;
use floodgate::limit::{Algorithm, Charge, Decision, Limit, Settlement};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use support::redis::{TestRedis, unique_prefix};

const ALL: [Algorithm; Algorithm::ALL.len()] = Algorithm::ALL;

/// Both stores, asked the same questions at the same times.
struct Both {
    redis: RedisStore,
    memory: MemoryStore,
    route: Arc<str>,
}

impl Both {
    fn new(redis: &TestRedis, test: &str) -> Self {
        Self {
            redis: RedisStore::new(&redis.url, &unique_prefix(test), Duration::from_secs(2))
                .expect("store"),
            memory: MemoryStore::new(),
            route: "r".into(),
        }
    }

    /// Decides in both stores and insists they agree.
    async fn decide(&self, limits: &[Limit], cost: u64, now: u64) -> Decision {
        let client = ClientId::Addr([10, 0, 0, 1].into());
        let charge = Charge {
            route: &self.route,
            client: &client,
            limits,
            keys: &[],
            cost,
            settle: None,
        };
        let lua = self
            .redis
            .decide_at(charge, Some(now))
            .await
            .expect("redis decision");
        let rust = self.memory.decide_at(charge, now);
        assert_eq!(
            lua, rust,
            "Lua and Rust disagree at {now} (cost {cost}, {limits:?})"
        );
        lua
    }
}

fn seed() -> u64 {
    std::env::var("FLOODGATE_PROPTEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        })
}

fn runner(seed: u64, cases: u32) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

/// A random limit of `algorithm`: small limits and windows from 1 ms to 10 s,
/// including rates below one per second and limits that don't divide windows.
fn limit_of(algorithm: Algorithm) -> impl Strategy<Value = Limit> {
    (
        1u64..=12,
        prop::sample::select(vec![1u64, 7, 250, 1_000, 3_000, 10_000]),
        1u64..=24,
        prop::option::weighted(
            0.3,
            (1u64..=5_000, 1_000u64..=3_000, 1u64..=20_000, 0u64..=30_000),
        ),
        prop::option::weighted(0.5, (1u64..=12, 0u64..=7)),
    )
        .prop_map(move |(limit, window, burst, penalty, delay)| {
            let mut l = Limit::new(algorithm, limit, window);
            if algorithm.has_burst() {
                l = l.with_burst(burst);
            }
            // A GCRA holds requests past its burst half the time, for
            // quarters of its window up to three windows and odd ms beside.
            if algorithm == Algorithm::Gcra {
                l.delay_ms = delay.map_or(0, |(quarters, ms)| window * quarters / 4 + ms);
            }
            // Now and then a penalty, growing or not, forgotten soon or late.
            l.penalty = penalty.map(|(duration_ms, factor_permille, extra, forget_ms)| Penalty {
                duration_ms,
                factor_permille,
                max_ms: duration_ms + extra,
                forget_ms,
            });
            l
        })
}

/// A step of a trace: time since the previous step (negative where the
/// clock stepped back), cost, client, whether it goes to Redis in one
/// call with the steps before it, and whether it settles the client's
/// oldest open reservation instead of deciding (with the units used).
type Step = (i64, u64, u8, bool, Option<u64>);

/// A trace: (time step 0..=2×window, or now and then a step back of up to
/// a window, as an NTP step or a failover to a replica whose clock is
/// behind makes; cost 0..=capacity and now and then one that never fits;
/// client 0..3; and one call with the previous step, mostly).
fn trace(limits: Vec<Limit>) -> impl Strategy<Value = (Vec<Limit>, u64, Vec<Step>)> {
    let window = limits.iter().map(|l| l.window_ms).max().unwrap_or(1);
    let capacity = limits.iter().map(Limit::capacity).min().unwrap_or(1);
    (
        Just(limits),
        1_700_000_000_000u64..1_700_100_000_000,
        prop::collection::vec(
            (
                prop_oneof![
                    9 => 0..=2 * window as i64,
                    1 => -(window as i64)..0,
                ],
                prop_oneof![
                    9 => 0..=capacity.min(6),
                    1 => capacity + 1..=capacity + 3,
                ],
                0u8..3,
                prop::bool::weighted(0.7),
                prop::option::weighted(0.3, 0..=capacity.min(6) + 4),
            ),
            1..48,
        ),
    )
}

/// The steps cut into Redis calls: each call a run of steps that go
/// together, at most 12.
fn calls(steps: &[Step]) -> Vec<&[Step]> {
    let mut calls = Vec::new();
    let mut start = 0;
    for i in 1..=steps.len() {
        if i == steps.len() || !steps[i].3 || i - start == 12 {
            calls.push(&steps[start..i]);
            start = i;
        }
    }
    calls
}

/// Runs random traces through Lua on Redis and through the Rust twin; every
/// decision must agree in every field. The trace goes to Redis in calls of
/// one decision and in shared calls of several, as a loaded instance sends
/// them, where one call may decide one client many times. Some steps
/// settle an admitted reservation of an earlier call to fewer or more
/// units, late or early, and must agree too.
fn lua_agrees_with_rust(name: &str, limits: impl Strategy<Value = Vec<Limit>>) {
    let seed = seed();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let redis = rt.block_on(TestRedis::start());
    let result = runner(seed, 160).run(&traces(limits), |(limits, start, steps)| {
        rt.block_on(both_agree_on_the_trace(
            &redis, name, &limits, start, &steps,
        ))
    });
    if let Err(e) = result {
        panic!("{name}: {e}\nreproduce with FLOODGATE_PROPTEST_SEED={seed}");
    }
}

/// Traces of `limits`. A window by the calendar is generated with
/// boundaries from 0: they are moved to lie around the trace's start.
fn traces(
    limits: impl Strategy<Value = Vec<Limit>>,
) -> impl Strategy<Value = (Vec<Limit>, u64, Vec<Step>)> {
    limits
        .prop_flat_map(trace)
        .prop_map(|(mut limits, start, steps)| {
            for limit in &mut limits {
                if let Some(b) = &mut limit.bounds {
                    let shift = start - b[1];
                    *b = b.map(|t| t + shift);
                }
            }
            (limits, start, steps)
        })
}

/// Per client, the reservations admitted and not settled yet.
type Open = [VecDeque<Settlement>; 3];

/// One trace from `start` through both stores, call by call: Redis
/// decides each call, the Rust twin each of its steps, and they agree.
async fn both_agree_on_the_trace(
    redis: &TestRedis,
    name: &str,
    limits: &[Limit],
    start: u64,
    steps: &[Step],
) -> Result<(), TestCaseError> {
    let both = Both::new(redis, name);
    let mut now = start;
    let mut i = 0;
    let mut open = Open::default();
    for call in calls(steps) {
        let clients: Vec<ClientId> = call
            .iter()
            .map(|&(_, _, client, _, _)| ClientId::Addr([10, 0, 0, client].into()))
            .collect();
        let charges = charges_of(call, &clients, &both.route, limits, &mut now, &mut open);
        let lua = redis_decides(&both, &charges).await;
        prop_assert_eq!(lua.len(), charges.len());
        for ((lua, (charge, at)), step) in lua.into_iter().zip(&charges).zip(call) {
            let now = at.unwrap_or_default();
            let rust = both.memory.decide_at(*charge, now);
            if lua.allowed && charge.settle.is_none() {
                open[usize::from(step.2)].push_back(Settlement {
                    at_ms: lua.at_ms,
                    reserved: charge.cost,
                    local: false,
                    kind: floodgate::limit::Settled::Reservation,
                });
            }
            prop_assert_eq!(
                lua,
                rust,
                "step {} at +{} ms, cost {}, client {:?}, in a call of {}",
                i,
                now as i64 - start as i64,
                charge.cost,
                charge.client,
                charges.len()
            );
            i += 1;
        }
    }
    Ok(())
}

/// The charges of one call's steps, each at its time (moving `now` on): a
/// decision, or for a step that settles, the client's oldest open
/// reservation settled to the units it used.
fn charges_of<'a>(
    call: &[Step],
    clients: &'a [ClientId],
    route: &'a Arc<str>,
    limits: &'a [Limit],
    now: &mut u64,
    open: &mut Open,
) -> Vec<(Charge<'a>, Option<u64>)> {
    let mut charges = Vec::with_capacity(call.len());
    for (&(dt, cost, client, _, used), id) in call.iter().zip(clients) {
        *now = now.saturating_add_signed(dt);
        let settle = used.and_then(|_| open[usize::from(client)].pop_front());
        let charge = Charge {
            route,
            client: id,
            limits,
            keys: &[],
            cost: match settle {
                Some(_) => used.unwrap_or(cost),
                None => cost,
            },
            settle,
        };
        charges.push((charge, Some(*now)));
    }
    charges
}

/// Redis's decisions of one call: alone, or several in one round trip.
async fn redis_decides(both: &Both, charges: &[(Charge<'_>, Option<u64>)]) -> Vec<Decision> {
    if let [(charge, now)] = charges[..] {
        vec![
            both.redis
                .decide_at(charge, now)
                .await
                .expect("redis decision"),
        ]
    } else {
        both.redis
            .decide_together_at(charges)
            .await
            .expect("redis decisions")
    }
}

#[test]
fn fixed_window_lua_agrees_with_rust() {
    lua_agrees_with_rust(
        "fixed_window",
        limit_of(Algorithm::FixedWindow).prop_map(|l| vec![l]),
    );
}

/// Fixed windows by the calendar: windows of uneven lengths between four
/// boundaries (as months and DST days are), and times before and past them.
#[test]
fn calendar_fixed_window_lua_agrees_with_rust() {
    let calendar =
        (1u64..=12, 1u64..=3_000, 1u64..=3_000, 1u64..=3_000).prop_map(|(limit, a, b, c)| {
            let mut l = Limit::new(Algorithm::FixedWindow, limit, a.max(b).max(c));
            l.bounds = Some([0, a, a + b, a + b + c]);
            vec![l]
        });
    lua_agrees_with_rust("calendar_window", calendar);
}

#[test]
fn sliding_log_lua_agrees_with_rust() {
    lua_agrees_with_rust(
        "sliding_log",
        limit_of(Algorithm::SlidingLog).prop_map(|l| vec![l]),
    );
}

#[test]
fn sliding_window_lua_agrees_with_rust() {
    lua_agrees_with_rust(
        "sliding_window",
        limit_of(Algorithm::SlidingWindow).prop_map(|l| vec![l]),
    );
}

#[test]
fn token_bucket_lua_agrees_with_rust() {
    lua_agrees_with_rust(
        "token_bucket",
        limit_of(Algorithm::TokenBucket).prop_map(|l| vec![l]),
    );
}

#[test]
fn gcra_lua_agrees_with_rust() {
    lua_agrees_with_rust("gcra", limit_of(Algorithm::Gcra).prop_map(|l| vec![l]));
}

#[test]
fn mixed_limits_on_one_route_agree_and_decide_all_or_nothing() {
    let limits = ALL.map(limit_of);
    lua_agrees_with_rust("mixed", limits.prop_map(|l| l.to_vec()));
}

/// A denied client that waits exactly the reported retry-after is
/// admitted (held the whole delay, under a GCRA with one), and not a
/// millisecond earlier; a request admitted and held is told exactly when
/// it would have gone at once.
#[test]
fn waiting_exactly_the_retry_after_is_enough_and_necessary() {
    let seed = seed();
    let strategy = prop::sample::select(ALL.to_vec())
        .prop_flat_map(limit_of)
        .prop_flat_map(|l| trace(vec![l]));
    let result = runner(seed, 2_000).run(&strategy, |(limits, start, steps)| {
        let limit = limits[0];
        let mut state = State::new(limit.algorithm);
        let mut now = start;
        for &(dt, cost, _, _, _) in &steps {
            now = now.saturating_add_signed(dt);
            if cost > limit.capacity() {
                // Never fits, however long it waits.
                continue;
            }
            let verdict = state.check(&limit, now, cost);
            let at_once = |v: floodgate::limit::Verdict| v.allowed && v.retry_after_ms == 0;
            if at_once(verdict) {
                state.consume(&limit, now, cost);
                continue;
            }
            prop_assert!(verdict.retry_after_ms > 0);
            if verdict.allowed {
                prop_assert!(limit.delay_ms > 0, "held by a limit without a delay");
                prop_assert!(
                    verdict.retry_after_ms <= limit.delay_ms,
                    "held past the delay"
                );
            }
            // Held: when it would have gone at once. Refused: when it
            // would be admitted, held the whole delay if the limit has one.
            let admitted = |v: floodgate::limit::Verdict| match verdict.allowed {
                true => at_once(v),
                false => v.allowed,
            };
            let mut early = state.clone();
            let at = now + verdict.retry_after_ms;
            prop_assert!(
                !admitted(early.check(&limit, at - 1, cost)),
                "admitted before retry-after"
            );
            let mut waited = state.clone();
            let then = waited.check(&limit, at, cost);
            prop_assert!(
                admitted(then),
                "not admitted at retry-after {}",
                verdict.retry_after_ms
            );
            if !verdict.allowed && limit.delay_ms > 0 && then.retry_after_ms > 0 {
                prop_assert_eq!(then.retry_after_ms, limit.delay_ms, "held the whole delay");
            }
            if verdict.allowed {
                state.consume(&limit, now, cost);
            }
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}\nreproduce with FLOODGATE_PROPTEST_SEED={seed}");
    }
}

// === published behaviour, on both stores ===

const T0: u64 = 1_700_000_000_000; // a multiple of every window below

#[tokio::test]
async fn gcra_follows_the_redis_rate_sequence() {
    let redis = TestRedis::start().await;
    let both = Both::new(&redis, "gcra-seq");
    let l = [Limit::new(Algorithm::Gcra, 10, 1_000)];
    // `t` is the time until the next unit is added (one emission interval
    // of 100 ms), whether or not units remain.
    let d = both.decide(&l, 1, T0).await;
    assert_eq!((d.allowed, d.remaining, d.next_ms), (true, 9, 100));
    let d = both.decide(&l, 2, T0).await;
    assert_eq!((d.allowed, d.remaining, d.next_ms), (true, 7, 100));
    let d = both.decide(&l, 7, T0).await;
    assert_eq!((d.allowed, d.remaining, d.next_ms), (true, 0, 100));
    let d = both.decide(&l, 1, T0).await;
    assert_eq!(
        (d.allowed, d.remaining, d.retry_after_ms, d.next_ms),
        (false, 0, 100, 100)
    );
    // One emission interval later exactly one more unit fits.
    assert!(both.decide(&l, 1, T0 + 100).await.allowed);
    assert!(!both.decide(&l, 1, T0 + 100).await.allowed);
}

#[tokio::test]
async fn gcra_keeps_an_interval_that_does_not_divide_the_window_exact() {
    let redis = TestRedis::start().await;
    let both = Both::new(&redis, "gcra-third");
    // 3 per second, burst 1: one every 333⅓ ms after the last admission.
    // From 0 the next is due at 333⅓, so 333 is early and 334 admitted; from
    // 334 the next is due at 667⅓. Rounding never admits a client early.
    let l = [Limit::new(Algorithm::Gcra, 3, 1_000).with_burst(1)];
    assert!(both.decide(&l, 1, T0).await.allowed);
    for (t, allowed) in [
        (333, false),
        (334, true),
        (667, false),
        (668, true),
        (1_001, false),
        (1_002, true),
    ] {
        assert_eq!(
            both.decide(&l, 1, T0 + t).await.allowed,
            allowed,
            "at +{t} ms"
        );
    }
}

#[tokio::test]
async fn token_bucket_refills_continuously_at_exact_instants() {
    let redis = TestRedis::start().await;
    let both = Both::new(&redis, "tb");
    // 10 tokens per second (one per 100 ms), capacity 5.
    let l = [Limit::new(Algorithm::TokenBucket, 10, 1_000).with_burst(5)];
    for remaining in (0..5).rev() {
        let d = both.decide(&l, 1, T0).await;
        assert_eq!((d.allowed, d.remaining), (true, remaining));
    }
    let d = both.decide(&l, 1, T0 + 50).await;
    assert_eq!((d.allowed, d.retry_after_ms), (false, 50));
    assert!(!both.decide(&l, 1, T0 + 99).await.allowed);
    let d = both.decide(&l, 1, T0 + 100).await;
    assert_eq!(
        (d.allowed, d.remaining),
        (true, 0),
        "one token at exactly 100 ms"
    );
    // 250 ms later: 2.5 tokens, so cost 2 fits and leaves the half token.
    let d = both.decide(&l, 2, T0 + 350).await;
    assert_eq!((d.allowed, d.remaining, d.next_ms), (true, 0, 50));
    // A long pause refills to capacity, never beyond.
    let d = both.decide(&l, 1, T0 + 60_000).await;
    assert_eq!((d.allowed, d.remaining), (true, 4));
}

#[tokio::test]
async fn rates_below_one_per_second_and_sub_second_windows_work() {
    let redis = TestRedis::start().await;
    for algorithm in ALL {
        let both = Both::new(&redis, "slow");
        let slow = [Limit::new(algorithm, 1, 10_000)];
        assert!(both.decide(&slow, 1, T0).await.allowed, "{algorithm:?}");
        let d = both.decide(&slow, 1, T0 + 5_000).await;
        assert!(!d.allowed, "{algorithm:?}");
        assert!(
            d.retry_after_ms > 0 && d.retry_after_ms <= 15_000,
            "{algorithm:?}: {d:?}"
        );
        let fast = [Limit::new(algorithm, 2, 250)];
        let both = Both::new(&redis, "fast");
        assert!(both.decide(&fast, 1, T0).await.allowed, "{algorithm:?}");
        assert!(both.decide(&fast, 1, T0).await.allowed, "{algorithm:?}");
        assert!(
            !both.decide(&fast, 1, T0 + 10).await.allowed,
            "{algorithm:?}"
        );
        assert!(
            both.decide(&fast, 1, T0 + 500).await.allowed,
            "{algorithm:?}"
        );
    }
}

#[tokio::test]
async fn fixed_window_edge_burst_is_twice_the_limit_and_sliding_log_has_none() {
    let redis = TestRedis::start().await;
    let mut admitted = Vec::new();
    for algorithm in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
    ] {
        let both = Both::new(&redis, "edge");
        let l = [Limit::new(algorithm, 5, 1_000)];
        let mut n = 0;
        for now in [T0 + 999; 5].into_iter().chain([T0 + 1_000; 5]) {
            n += usize::from(both.decide(&l, 1, now).await.allowed);
        }
        admitted.push(n);
    }
    assert_eq!(
        admitted,
        [10, 5, 5],
        "fixed, log, sliding window across one boundary"
    );
}

/// Redis `TIME` stepping back 1 ms across a window boundary (an NTP step,
/// a failover to a replica whose clock is behind) reopens no window.
#[tokio::test]
async fn a_clock_stepping_back_across_a_boundary_admits_no_more_than_the_limit() {
    let redis = TestRedis::start().await;
    for algorithm in ALL {
        let both = Both::new(&redis, "step-back");
        let l = [Limit::new(algorithm, 5, 1_000)];
        let mut admitted = 0;
        for now in [T0 + 1_000; 5].into_iter().chain([T0 + 999; 5]) {
            admitted += usize::from(both.decide(&l, 1, now).await.allowed);
        }
        assert_eq!(admitted, 5, "{algorithm:?}");
    }
}

#[tokio::test]
async fn sliding_window_weights_the_previous_window_by_its_overlap() {
    let redis = TestRedis::start().await;
    let both = Both::new(&redis, "sw");
    let l = [Limit::new(Algorithm::SlidingWindow, 10, 1_000)];
    for _ in 0..8 {
        assert!(both.decide(&l, 1, T0 + 500).await.allowed);
    }
    // 250 ms into the next window, 75% of the previous 8 still count: 6.
    // So 4 more fit: remaining after one is 3.
    let d = both.decide(&l, 1, T0 + 1_250).await;
    assert_eq!((d.allowed, d.remaining), (true, 3));
    for _ in 0..3 {
        assert!(both.decide(&l, 1, T0 + 1_250).await.allowed);
    }
    let d = both.decide(&l, 1, T0 + 1_250).await;
    assert!(!d.allowed);
    // 8 × (1000 − e)/1000 + 4 + 1 ≤ 10 needs e ≥ 375: 125 ms from now.
    assert_eq!(d.retry_after_ms, 125);
    assert!(!both.decide(&l, 1, T0 + 1_374).await.allowed);
    assert!(both.decide(&l, 1, T0 + 1_375).await.allowed);
}

#[tokio::test]
async fn cost_larger_than_one_is_counted_in_every_algorithm() {
    let redis = TestRedis::start().await;
    for algorithm in ALL {
        let both = Both::new(&redis, "cost");
        let l = [Limit::new(algorithm, 10, 60_000)];
        let d = both.decide(&l, 4, T0).await;
        assert_eq!((d.allowed, d.remaining), (true, 6), "{algorithm:?}");
        assert_eq!(both.decide(&l, 4, T0).await.remaining, 2, "{algorithm:?}");
        let d = both.decide(&l, 4, T0).await;
        assert_eq!(
            (d.allowed, d.remaining),
            (false, 2),
            "{algorithm:?}: a denial takes nothing"
        );
        assert!(both.decide(&l, 2, T0).await.allowed, "{algorithm:?}");
    }
}

/// An operator's grant, in Lua and in Rust alike: a fixed window (by the
/// clock or the calendar) admits the granted units past its number until
/// its window ends, and no longer; a bucket or a sliding window gets back
/// what a reservation settled to nothing would give back.
#[tokio::test]
async fn a_grant_admits_as_many_more_in_lua_and_rust() {
    let redis = TestRedis::start().await;
    let client = ClientId::Addr([10, 0, 0, 1].into());
    let t0 = 1_700_000_000_000u64;
    let mut calendar = Limit::new(Algorithm::FixedWindow, 5, 1_000);
    calendar.bounds = Some([t0 - 1_000, t0, t0 + 1_700, t0 + 2_500]);
    for (i, limit) in [
        Limit::new(Algorithm::FixedWindow, 5, 10_000),
        calendar,
        Limit::new(Algorithm::SlidingWindow, 5, 10_000),
        Limit::new(Algorithm::TokenBucket, 5, 10_000),
        Limit::new(Algorithm::Gcra, 5, 10_000),
    ]
    .into_iter()
    .enumerate()
    {
        let limits = [limit];
        let route: Arc<str> = format!("grant-{i}").into();
        let both = Both {
            redis: RedisStore::new(&redis.url, &unique_prefix("grant"), Duration::from_secs(2))
                .expect("store"),
            memory: MemoryStore::new(),
            route,
        };
        let start = t0 - t0 % 10_000 + 1;
        let start = if limit.bounds.is_some() {
            t0 + 1
        } else {
            start
        };
        for k in 0..5 {
            assert!(
                both.decide(&limits, 1, start + k).await.allowed,
                "{limit:?}"
            );
        }
        assert!(!both.decide(&limits, 1, start + 5).await.allowed);
        let grant = Charge {
            route: &both.route,
            client: &client,
            limits: &limits,
            keys: &[],
            cost: 0,
            settle: Some(Settlement {
                at_ms: start + 6,
                reserved: 3,
                local: false,
                kind: floodgate::limit::Settled::Grant,
            }),
        };
        let lua = both
            .redis
            .decide_at(grant, Some(start + 6))
            .await
            .expect("grant");
        let rust = both.memory.decide_at(grant, start + 6);
        assert_eq!(lua, rust, "{limit:?}");
        let mut admitted = 0;
        for k in 0..5 {
            admitted += u64::from(both.decide(&limits, 1, start + 7 + k).await.allowed);
        }
        // A fixed window past its number (its 5 and the 3 granted); the
        // others get back 3 of what they took.
        assert_eq!(admitted, 3, "{limit:?}");
        if limit.algorithm == Algorithm::FixedWindow {
            // The next window: the grant is gone, the number is whole.
            let next = limit.bounds.map_or(start - 1 + 10_000, |b| b[2]);
            let mut admitted = 0;
            for k in 0..7 {
                admitted += u64::from(both.decide(&limits, 1, next + k).await.allowed);
            }
            assert_eq!(admitted, 5, "{limit:?}");
        }
    }
}

/// What an algorithm that keeps its windows' totals exports, the same from
/// both stores: the current window and, by the calendar, the closed one.
#[tokio::test]
async fn both_stores_export_the_same_window_totals() {
    let redis = TestRedis::start().await;
    for algorithm in ALL.into_iter().filter(|a| a.keeps_window_totals()) {
        let mut limit = Limit::new(algorithm, 100, 60_000);
        limit.bounds = Some([0, 60_000, 120_000, 180_000]);
        let limits = [limit];
        let both = Both::new(&redis, "kept");
        both.decide(&limits, 3, 60_001).await;
        both.decide(&limits, 4, 60_002).await;
        both.decide(&limits, 2, 120_001).await;
        let key =
            |k: &floodgate::limit::Kept| (k.client.clone(), k.start, k.end, k.units, k.closed);
        let mut lua: Vec<_> = both
            .redis
            .kept("r", 0, &limit, 120_002)
            .await
            .expect("redis kept")
            .iter()
            .map(key)
            .collect();
        let mut rust: Vec<_> = both
            .memory
            .kept("r", 0, None, &limit, 120_002)
            .iter()
            .map(key)
            .collect();
        lua.sort();
        rust.sort();
        assert_eq!(lua.len(), 2, "{algorithm:?}: {lua:?}");
        assert_eq!(lua, rust, "{algorithm:?}");
    }
}
