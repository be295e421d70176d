//! Compares the algorithms: in-process decision cost, Redis CPU per
//! decision, Redis memory per key, and decisions per second through one
//! floodgate Redis store. Run with `cargo bench --bench algorithms`; it starts
//! its own `redis-server` on a free port (or uses `REDIS_URL`) and prints a
//! markdown table.

use std::sync::Arc;
use std::time::{Duration, Instant};

mod support;

use floodgate::client::ClientId;
use floodgate::limit::memory::MemoryStore;
use floodgate::limit::redis::RedisStore;
use floodgate::limit::{Algorithm, Charge, Limit};

const CLIENTS: u32 = 10_000;
const LIMIT: u64 = 100;

fn client(i: u32) -> ClientId {
    ClientId::Addr(std::net::Ipv4Addr::from(0x0a00_0000 + i).into())
}

fn memory_ns_per_decision(limit: Limit) -> f64 {
    let store = MemoryStore::new();
    let route: Arc<str> = "bench".into();
    let limits = [limit];
    let clients: Vec<ClientId> = (0..1_000).map(client).collect();
    let n = 1_000_000u64;
    let started = Instant::now();
    for i in 0..n {
        let charge = Charge {
            route: &route,
            client: &clients[(i % 1_000) as usize],
            limits: &limits,
            keys: &[],
            cost: 1,
            settle: None,
        };
        std::hint::black_box(store.decide_at(charge, 1_700_000_000_000 + i / 100));
    }
    started.elapsed().as_nanos() as f64 / n as f64
}

async fn redis_info(conn: &mut redis::aio::MultiplexedConnection) -> String {
    redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap_or_default()
}

/// Microseconds Redis spent in decision commands (`FCALL`, or `EVALSHA` on
/// a Redis without functions). One command may carry several decisions.
fn usec_in_calls(info: &str) -> f64 {
    info.lines()
        .find(|l| l.starts_with("cmdstat_fcall:") || l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split(',').find_map(|kv| kv.strip_prefix("usec=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or(f64::NAN)
}

struct Row {
    algorithm: &'static str,
    memory_ns: f64,
    redis_us: f64,
    per_second: f64,
    key_bytes: i64,
}

async fn redis_row(url: &str, limit: Limit, memory_ns: f64) -> Row {
    let prefix = format!("bench-{}", limit.algorithm.name());
    let store = Arc::new(RedisStore::new(url, &prefix, Duration::from_secs(2)).expect("store"));
    store.load_script().await.expect("load script");
    let mut conn = stats_connection(url).await;
    let (total, per_second) = decide_under_load(&store, limit).await;
    let redis_us = usec_in_calls(&redis_info(&mut conn).await) / total as f64;
    let key_bytes = key_bytes_fully_used(&store, &mut conn, limit).await;
    Row {
        algorithm: limit.algorithm.name(),
        memory_ns,
        redis_us,
        per_second,
        key_bytes,
    }
}

/// A connection of its own to read Redis's statistics, reset first.
async fn stats_connection(url: &str) -> redis::aio::MultiplexedConnection {
    let mut conn = redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect");
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(&mut conn)
        .await
        .expect("resetstat");
    conn
}

/// 64 concurrent callers over 10k clients for two seconds: the decisions
/// made, and how many a second.
async fn decide_under_load(store: &Arc<RedisStore>, limit: Limit) -> (u64, f64) {
    let deadline = Instant::now() + Duration::from_secs(2);
    let tasks: Vec<_> = (0..64u32)
        .map(|t| {
            let store = Arc::clone(store);
            tokio::spawn(async move {
                let route: Arc<str> = "bench".into();
                let limits = [limit];
                let mut done = 0u64;
                let mut i = t;
                while Instant::now() < deadline {
                    let id = client(i % CLIENTS);
                    let charge = Charge {
                        route: &route,
                        client: &id,
                        limits: &limits,
                        keys: &[],
                        cost: 1,
                        settle: None,
                    };
                    if store.decide_at(charge, None).await.is_ok() {
                        done += 1;
                    }
                    i += 64;
                }
                done
            })
        })
        .collect();
    let started = Instant::now();
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap_or(0);
    }
    (total, total as f64 / started.elapsed().as_secs_f64())
}

/// Memory of one client's key with the limit fully used.
async fn key_bytes_fully_used(
    store: &RedisStore,
    conn: &mut redis::aio::MultiplexedConnection,
    limit: Limit,
) -> i64 {
    let route: Arc<str> = "bench".into();
    let id = ClientId::header("memory-probe");
    let limits = [limit];
    for _ in 0..LIMIT {
        let charge = Charge {
            route: &route,
            client: &id,
            limits: &limits,
            keys: &[],
            cost: 1,
            settle: None,
        };
        let _ = store.decide_at(charge, None).await;
    }
    let key = format!(
        "{}:0:{}:{}",
        store.hash_tag(&route, &id),
        limit.algorithm.name(),
        limit.window_ms
    );
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&key)
        .query_async(conn)
        .await
        .unwrap_or(-1)
}

fn main() {
    let redis = support::BenchRedis::start()
        .expect("redis-server on PATH (apt-get install redis-server), or set REDIS_URL");
    let url = redis.url.clone();
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let mut rows = Vec::new();
    for algorithm in Algorithm::ALL {
        let limit = Limit::new(algorithm, LIMIT, 60_000);
        let memory_ns = memory_ns_per_decision(limit);
        rows.push(runtime.block_on(redis_row(&url, limit, memory_ns)));
    }
    println!(
        "| algorithm | memory store, ns/decision | Redis CPU, µs/decision | decisions/s via Redis (64 in flight) | Redis memory per key at {LIMIT} used |"
    );
    println!("|---|---:|---:|---:|---:|");
    for r in rows {
        println!(
            "| `{}` | {:.0} | {:.2} | {:.0} | {} B |",
            r.algorithm, r.memory_ns, r.redis_us, r.per_second, r.key_bytes
        );
    }
}
