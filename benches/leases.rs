//! What a hot key costs the Redis primary that holds it, with and without
//! leases: eight floodgate processes (this build's release binary) share
//! one global fixed window of 10 000 per 10 s, offered about 3 000
//! requests a second, first deciding every request in the store, then
//! leasing. For each: requests admitted, decision calls (`INFO
//! commandstats`), the CPU the redis-server process used (user + system,
//! from /proc) and the time Redis itself counts in its decision commands,
//! per admitted request. Then, from those measurements, what one primary
//! would need for 100 instances admitting 1 M requests a second on one key.
//!
//! `cargo bench --bench leases` (`LEASE_BENCH_SECONDS`, default 20, per
//! mode). Needs `redis-server` on PATH.

#[path = "../tests/support/mod.rs"]
mod harness;

use std::time::Duration;

use harness::load::{Ledger, instances, now_ms, offer};
use harness::redis::{TestRedis, command_stats, decision_calls, reset_command_stats};

/// A global fixed window of 10 000 per 10 s, leased or not.
fn limit(leased: bool) -> String {
    let lease = if leased { ", lease = {}" } else { "" };
    format!(
        r#"{{ algorithm = "fixed_window", limit = 10000, window = "10s", key = {{ from = "global" }}{lease} }}"#
    )
}

/// User + system CPU of process `pid` so far, in µs.
fn cpu_us(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // The fields after the command's closing parenthesis; utime and stime
    // are the 14th and 15th of the line, in clock ticks (100 a second).
    let Some(rest) = stat.rsplit(')').next() else {
        return 0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    ticks * 10_000
}

/// Microseconds Redis counted in decision commands, from `INFO
/// commandstats`.
fn command_us(info: &str) -> u64 {
    ["fcall", "evalsha"]
        .iter()
        .filter_map(|c| {
            let line = info
                .lines()
                .find(|l| l.starts_with(&format!("cmdstat_{c}:")))?;
            let usec = line.split(',').find_map(|f| f.strip_prefix("usec="))?;
            usec.parse::<u64>().ok()
        })
        .sum()
}

struct Measured {
    admitted: u64,
    calls: u64,
    redis_cpu_us: u64,
    command_us: u64,
}

async fn measure(leased: bool, seconds: u64) -> Option<Measured> {
    let redis = TestRedis::start_process().await;
    let pid = redis.pid()?;
    let ledger = Ledger::start().await;
    let mut first_ms = 0;
    let test = if leased {
        "bench-leased"
    } else {
        "bench-per-request"
    };
    let gates = instances(test, 8, &redis, &ledger, &limit(leased), &[], &mut first_ms).await;
    let ports: Vec<u16> = gates.iter().map(|g| g.process.port).collect();
    let mut conn = redis.connection().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    reset_command_stats(&mut conn).await;
    let cpu_before = cpu_us(pid);
    let got = offer(&ports, &[375; 8], now_ms() + seconds * 1_000).await;
    let redis_cpu_us = cpu_us(pid) - cpu_before;
    let info = command_stats(&mut conn).await;
    Some(Measured {
        admitted: got.iter().map(|g| g.ok).sum(),
        calls: decision_calls(&info),
        redis_cpu_us,
        command_us: command_us(&info),
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let seconds: u64 = std::env::var("LEASE_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    println!(
        "8 instances, one global fixed window of 10 000 per 10 s, about 3 000 requests a second offered, {seconds} s each"
    );
    println!(
        "| mode | admitted | decision calls | calls per admitted | Redis CPU per admitted (µs) | in its commands (µs) | per call (µs) |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut per_call = [0.0f64; 2];
    let mut per_admitted = [0.0f64; 2];
    for (i, leased) in [false, true].into_iter().enumerate() {
        let Some(m) = measure(leased, seconds).await else {
            eprintln!("no redis-server process to measure");
            return;
        };
        let admitted = m.admitted.max(1) as f64;
        per_call[i] = m.redis_cpu_us as f64 / m.calls.max(1) as f64;
        per_admitted[i] = m.redis_cpu_us as f64 / admitted;
        println!(
            "| {} | {} | {} | {:.4} | {:.2} | {:.2} | {:.1} |",
            if leased { "leased" } else { "per request" },
            m.admitted,
            m.calls,
            m.calls as f64 / admitted,
            m.redis_cpu_us as f64 / admitted,
            m.command_us as f64 / admitted,
            per_call[i]
        );
    }
    // 100 instances, 10 000 admitted a second each, on one key: per
    // request, each admitted request costs the primary what it did above
    // (heavier traffic batches more decisions a call, which the CPU
    // measured per decision in bench/RESULTS.md bounds); leased, each
    // instance takes a slice of a quarter second of its traffic (2 500
    // units), four a second, each a call of the cost measured above.
    let decisions = 1_000_000.0;
    let slices = 100.0 * 10_000.0 / 2_500.0;
    println!(
        "\n100 instances admitting 1 M requests a second on one key: per request, {:.2} CPU seconds a second on the primary ({decisions} decisions at the cost per admitted request measured); leased, {slices} slices a second, {:.4} CPU seconds a second",
        decisions * per_admitted[0] / 1e6,
        slices * per_call[1] / 1e6
    );
}
