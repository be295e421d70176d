//! Leases for hot keys: eight floodgate processes share one global budget
//! in a real Redis, each spending slices of it taken ahead. Counted from
//! the upstream's own log of when each request arrived, a window never
//! admits more than its limit, and at most the stated bound less; the store
//! is called about once per slice instead of once per request.

mod support;

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::redis::{
    TestRedis, command_stats, decision_calls, reset_command_stats, unique_prefix,
};
use support::{FloodgateProcess, free_port, temp_dir};
use tokio::net::TcpListener;

/// The windows of these tests: 10 000 per 10 s.
const LIMIT: u64 = 10_000;
const WINDOW_MS: u64 = 10_000;

/// Most of the load tests run at once: each runs eight instances and
/// offers 3 000 requests a second, which two at once leave room for on a
/// small machine.
static AT_ONCE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(2);

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// An upstream that notes when each request reached it (ms, the system
/// clock, which is also the clock of the Redis on this machine).
struct Ledger {
    url: String,
    arrivals: Arc<Mutex<Vec<u64>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Ledger {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&arrivals);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                tokio::spawn(async move {
                    let service = service_fn(move |_req: Request<Incoming>| {
                        log.lock().expect("ledger").push(now_ms());
                        async {
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            url,
            arrivals,
            task,
        }
    }

    fn arrivals(&self) -> Vec<u64> {
        let mut out = self.arrivals.lock().expect("ledger").clone();
        out.sort_unstable();
        out
    }
}

impl Drop for Ledger {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One floodgate process of a test, with its admin listener.
struct Instance {
    process: FloodgateProcess,
    admin: u16,
}

impl Instance {
    /// A counter or gauge of this instance's `/metrics`, summed over its
    /// series.
    async fn metric(&self, name: &str) -> f64 {
        let text = reqwest_like_get(self.admin, "/metrics").await;
        text.lines()
            .filter(|l| l.starts_with(name) && !l.starts_with('#'))
            .filter(|l| l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

/// A GET on loopback `port`, its body as text.
async fn reqwest_like_get(port: u16, path: &str) -> String {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the admin listener");
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    let answer = sender
        .send_request(
            Request::get(path)
                .header("host", "127.0.0.1")
                .body(Empty::<Bytes>::new())
                .expect("request"),
        )
        .await
        .expect("an answer");
    let body = answer.into_body().collect().await.expect("a body");
    String::from_utf8_lossy(&body.to_bytes()).into_owned()
}

/// `n` floodgate processes sharing `redis`, the route's one limit written
/// as `limit`, forwarding to `ledger`.
async fn instances(
    test: &str,
    n: usize,
    redis: &TestRedis,
    ledger: &Ledger,
    limit: &str,
) -> Vec<Instance> {
    let config = Config::new()
        .redis(&redis.url, &unique_prefix(test))
        .admin()
        .route(Route::new("api").upstream(&ledger.url).limits(limit))
        .write(test);
    let dir = temp_dir(&format!("{test}-logs"));
    let mut out = Vec::new();
    for i in 0..n {
        let (port, admin) = (free_port(), free_port());
        let process = FloodgateProcess::spawn_logging(
            &config,
            port,
            &[("RUST_LOG", "floodgate=info")],
            &[
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--admin-listen",
                &format!("127.0.0.1:{admin}"),
            ],
            &dir.join(format!("instance-{i}.log")),
        )
        .await;
        out.push(Instance { process, admin });
    }
    // Each answers once (its decision code loaded) before counting starts.
    for instance in &out {
        let status = get_status(instance.process.port).await;
        assert!(
            status.is_some(),
            "instance on {} answers",
            instance.process.port
        );
    }
    out
}

async fn get_status(port: u16) -> Option<u16> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(connection);
    let answer = sender
        .send_request(
            Request::get("/")
                .header("host", "api")
                .body(Empty::<Bytes>::new())
                .ok()?,
        )
        .await
        .ok()?;
    Some(answer.status().as_u16())
}

/// What one instance's share of the load got: answers by status.
#[derive(Debug, Default, Clone, Copy)]
struct Got {
    ok: u64,
    refused: u64,
    other: u64,
}

/// Offers `rates[i]` requests a second to instance `i` until `until_ms`,
/// on four keep-alive connections each, paced; a connection that fails
/// (an instance killed) ends its share.
async fn offer(ports: &[u16], rates: &[u64], until_ms: u64) -> Vec<Got> {
    const CONNECTIONS: u64 = 4;
    let mut tasks = Vec::new();
    for (&port, &rate) in ports.iter().zip(rates) {
        for _ in 0..CONNECTIONS {
            let period = Duration::from_micros(1_000_000 * CONNECTIONS / rate.max(1));
            tasks.push(tokio::spawn(async move {
                let mut got = Got::default();
                let Ok(stream) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    return got;
                };
                let Ok((mut sender, connection)) =
                    hyper::client::conn::http1::handshake(TokioIo::new(stream)).await
                else {
                    return got;
                };
                tokio::spawn(connection);
                let mut tick = tokio::time::interval(period);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                while now_ms() < until_ms {
                    tick.tick().await;
                    let request = Request::get("/")
                        .header("host", "api")
                        .body(Empty::<Bytes>::new())
                        .expect("request");
                    match sender.send_request(request).await {
                        Ok(answer) => match answer.status().as_u16() {
                            200 => got.ok += 1,
                            429 => got.refused += 1,
                            _ => got.other += 1,
                        },
                        Err(_) => break,
                    }
                }
                got
            }));
        }
    }
    let mut per_instance = vec![Got::default(); ports.len()];
    for (i, task) in tasks.into_iter().enumerate() {
        let got = task.await.expect("a load task");
        let total = &mut per_instance[i / CONNECTIONS as usize];
        total.ok += got.ok;
        total.refused += got.refused;
        total.other += got.other;
    }
    per_instance
}

/// Waits, if need be, for a window's first half, and says when that is:
/// the load's first window is then long enough to be spent early. (A
/// window the load reaches only near its end is not spent, and what it
/// admits in its last milliseconds reaches the upstream in the next one:
/// in the upstream's log, not in the store's.)
async fn start_in_a_windows_first_half() -> u64 {
    let into = now_ms() % WINDOW_MS;
    if into >= WINDOW_MS / 2 {
        tokio::time::sleep(Duration::from_millis(WINDOW_MS - into + 20)).await;
    }
    now_ms()
}

/// Arrivals per fixed window, for the windows wholly inside `[from, to)`.
fn per_window(arrivals: &[u64], from: u64, to: u64) -> Vec<(u64, u64)> {
    let first = from.div_ceil(WINDOW_MS);
    let last = to / WINDOW_MS;
    (first..last)
        .map(|w| {
            let (start, end) = (w * WINDOW_MS, (w + 1) * WINDOW_MS);
            let n = arrivals.iter().filter(|&&t| t >= start && t < end).count() as u64;
            (start, n)
        })
        .collect()
}

/// The lower bound on what a window admits, as the README states it: the
/// limit less what the instances' last slices of the window left unspent
/// (each at most `share` of what remained, an eighth by default, sized to
/// a quarter second of its traffic: far less here).
const WINDOW_FLOOR: u64 = LIMIT * 95 / 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_instances_share_one_global_fixed_window_exactly_with_few_store_calls() {
    let _slot = AT_ONCE.acquire().await.expect("a slot");
    let redis = TestRedis::start_private().await;
    let ledger = Ledger::start().await;
    let gates = instances(
        "lease-fixed",
        8,
        &redis,
        &ledger,
        r#"{ algorithm = "fixed_window", limit = 10000, window = "10s", key = { from = "global" }, lease = {} }"#,
    )
    .await;
    let ports: Vec<u16> = gates.iter().map(|g| g.process.port).collect();
    let mut conn = redis.connection().await;
    reset_command_stats(&mut conn).await;
    // About 3× the limit, over five whole windows.
    let from = start_in_a_windows_first_half().await;
    let until = (from / WINDOW_MS + 6) * WINDOW_MS + 200;
    let got = offer(&ports, &[375; 8], until).await;
    let calls = decision_calls(&command_stats(&mut conn).await);
    let arrivals = ledger.arrivals();
    let windows = per_window(&arrivals, from, until);
    let admitted: u64 = got.iter().map(|g| g.ok).sum();
    let lost: f64 = {
        let mut sum = 0.0;
        for g in &gates {
            sum += g.metric("floodgate_lease_lost_units_total").await;
        }
        sum
    };
    println!("windows (start ms, admitted): {windows:?}");
    for l in reqwest_like_get(gates[0].admin, "/metrics").await.lines() {
        if (l.contains("decision_seconds_count") || l.contains("listening")) && !l.starts_with('#')
        {
            println!("{l}");
        }
    }
    for name in [
        "floodgate_lease_slices_total",
        "floodgate_lease_short_total",
        "floodgate_lease_returns_total",
        "floodgate_lease_admitted_total",
        "floodgate_lease_taken_units_total",
        "floodgate_lease_returned_units_total",
        "floodgate_redis_calls_total",
    ] {
        let mut sum = 0.0;
        for g in &gates {
            sum += g.metric(name).await;
        }
        println!("{name}: {sum}");
    }
    println!(
        "admitted {admitted}, refused {}, store calls {calls} ({:.4} a request admitted), units lost {lost}",
        got.iter().map(|g| g.refused).sum::<u64>(),
        calls as f64 / admitted as f64
    );
    assert!(windows.len() >= 5, "five whole windows: {windows:?}");
    assert_eq!(
        got.iter().map(|g| g.other).sum::<u64>(),
        0,
        "only 200 and 429: {got:?}"
    );
    assert_eq!(
        arrivals.len() as u64 - 8,
        admitted,
        "the upstream saw what was admitted (and the 8 first requests)"
    );
    for &(start, n) in &windows {
        assert!(n <= LIMIT, "window at {start} admitted {n}, over {LIMIT}");
        assert!(
            n >= WINDOW_FLOOR,
            "window at {start} admitted {n}, under {WINDOW_FLOOR}"
        );
    }
    assert!(
        calls * 50 <= admitted,
        "{calls} store calls for {admitted} requests admitted: more than 1 in 50"
    );
}
