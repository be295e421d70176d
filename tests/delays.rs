//! Delay instead of refuse: a `gcra` limit with a `delay` admits its
//! burst at once, holds the next requests until they fit and refuses
//! those past the delay. Side by side with nginx's `limit_req burst=20
//! delay=8` on the same schedule, the same across two instances on one
//! Redis, and letting go of every held request whose client leaves, within
//! the instance's bound.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::config::{Config, Route};
use support::front::FrontProxy;
use support::redis::TestRedis;
use support::{Floodgate, Upstream};

/// One test at a time: each measures time or memory, which the other's
/// load would disturb.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Bursts sent at once: when (ms after the first) and how many. Every
/// request of a burst is admitted at once, held or refused, by
/// arrival order, as worked out from the limit below (10 a second, 9 at
/// once, held up to 1.2 s, so nginx's `burst=20 delay=8`), with at least
/// 50 ms between a request's arrival time and a boundary.
const SCHEDULE: [(u64, usize); 5] = [(0, 25), (1_650, 6), (2_450, 10), (4_800, 12), (5_500, 1)];

/// Per burst: admitted at once, held, refused.
const EXPECTED: [(usize, usize, usize); 5] =
    [(9, 12, 4), (4, 2, 0), (6, 4, 0), (9, 3, 0), (1, 0, 0)];

/// The limit in floodgate's words.
const LIMIT: &str =
    r#"{ algorithm = "gcra", limit = 10, window = "1s", burst = 9, delay = "1200ms" }"#;

/// The limit in nginx's words, as `ngx_http_limit_req_module` keeps it:
/// requests in thousandths, the rate in thousandths a second.
const RATE: i64 = 10_000;
const BURST: i64 = 20_000;
const DELAY: i64 = 8_000;

/// A request as sent and answered: its id, its status, when it was sent
/// (ms since the Unix epoch), and for an admitted one when the upstream
/// received it (ms since the Unix epoch) and how long after it was sent.
struct Measured {
    id: String,
    status: u16,
    sent: f64,
    reached: Option<f64>,
}

impl Measured {
    /// How long after it was sent the upstream received it (ms).
    fn delay(&self) -> Option<f64> {
        self.reached.map(|at| at - self.sent)
    }
}

/// What a proxy decided of one request, by its own account: when (ms
/// since the Unix epoch, by its clock), how long it held it (ms), and
/// whether it refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Said {
    at: i64,
    wait: i64,
    refused: bool,
}

/// Now, in ms since the Unix epoch.
fn unix_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
        * 1000.0
}

/// `SCHEDULE` sent to `proxies` (request `i` of a burst to proxy `i`
/// modulo their number), each request with an id in its query, which the
/// upstream and the proxies' logs record: every burst's requests measured.
async fn run(proxies: &[SocketAddr], upstream: &Upstream, tag: &str) -> Vec<Vec<Measured>> {
    let most = SCHEDULE.iter().map(|&(_, n)| n).max().unwrap_or(0);
    let mut senders = Vec::new();
    for i in 0..most {
        senders.push(support::http1_connection::<Empty<Bytes>>(proxies[i % proxies.len()]).await);
    }
    // Every connection, and the proxy's way to its store and upstream,
    // warmed before the first burst: a cold start is not a delay.
    for sender in &mut senders {
        for _ in 0..3 {
            let request = Request::get("/warm")
                .header("host", "delays.test")
                .body(Empty::new())
                .expect("request");
            sender.ready().await.expect("connection ready");
            let answer = sender.send_request(request).await.expect("warm");
            assert_eq!(answer.status(), StatusCode::OK, "warming up");
            let _ = answer.into_body().collect().await;
        }
    }
    let start = Instant::now() + Duration::from_millis(100);
    let mut bursts = Vec::new();
    for (b, &(at, n)) in SCHEDULE.iter().enumerate() {
        tokio::time::sleep_until((start + Duration::from_millis(at)).into()).await;
        let mut sent = Vec::new();
        for (i, sender) in senders.iter_mut().take(n).enumerate() {
            let id = format!("{tag}-{b}-{i}");
            let request = Request::get(format!("/limited?probe={id}"))
                .header("host", "delays.test")
                .body(Empty::new())
                .expect("request");
            sender.ready().await.expect("connection ready");
            let (when, sent_at) = (Instant::now(), unix_ms());
            let answer = sender.send_request(request);
            sent.push(tokio::spawn(async move {
                let response = answer.await.expect("an answer");
                let status = response.status().as_u16();
                let _ = response.into_body().collect().await;
                (id, when, sent_at, status)
            }));
        }
        bursts.push(sent);
    }
    let mut out = Vec::new();
    for sent in bursts {
        let mut measured = Vec::new();
        for task in sent {
            let (id, when, sent, status) = task.await.expect("request task");
            let reached = (status == 200).then(|| {
                let probe = format!("probe={id}");
                let seen = upstream.seen();
                let at = seen
                    .iter()
                    .find(|s| s.target.ends_with(&probe))
                    .map(|s| s.at)
                    .unwrap_or_else(|| panic!("{id} was admitted and never reached the upstream"));
                sent + at.duration_since(when).as_secs_f64() * 1000.0
            });
            measured.push(Measured {
                id,
                status,
                sent,
                reached,
            });
        }
        out.push(measured);
    }
    out
}

/// Per burst, as the proxy decided (`said`): admitted at once, held,
/// refused; and each request's answer is the one it decided.
fn classes(run: &[Vec<Measured>], said: &HashMap<String, Said>) -> Vec<(usize, usize, usize)> {
    run.iter()
        .map(|burst| {
            let mut counts = (0, 0, 0);
            for m in burst {
                let s = said
                    .get(&m.id)
                    .unwrap_or_else(|| panic!("{} not in the proxy's log", m.id));
                assert_eq!(m.status, if s.refused { 429 } else { 200 }, "{}", m.id);
                match (s.refused, s.wait > 0) {
                    (true, _) => counts.2 += 1,
                    (false, true) => counts.1 += 1,
                    (false, false) => counts.0 += 1,
                }
            }
            counts
        })
        .collect()
}

/// Each burst's held requests' delays as measured (from sending to the
/// upstream), shortest first.
fn held_delays(run: &[Vec<Measured>], said: &HashMap<String, Said>) -> Vec<Vec<f64>> {
    run.iter()
        .map(|burst| {
            let mut delays: Vec<f64> = burst
                .iter()
                .filter(|m| said.get(&m.id).is_some_and(|s| s.wait > 0))
                .filter_map(Measured::delay)
                .collect();
            delays.sort_by(f64::total_cmp);
            delays
        })
        .collect()
}

/// Held request by held request, in each burst's order of delay, how much
/// longer `a` held than `b` (ms); and the largest and the median of how
/// far apart they are.
fn differences(a: &[Vec<f64>], b: &[Vec<f64>]) -> (Vec<f64>, f64, f64) {
    let each: Vec<f64> = a
        .iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| p - q))
        .collect();
    let mut apart: Vec<f64> = each.iter().map(|d| d.abs()).collect();
    apart.sort_by(f64::total_cmp);
    let largest = apart.last().copied().unwrap_or(0.0);
    let median = apart.get(apart.len() / 2).copied().unwrap_or(0.0);
    (each, largest, median)
}

/// The request id in `text` (after `probe=`, up to a space), if it is
/// one of `tag`'s.
fn probe<'a>(text: &'a str, tag: &str) -> Option<&'a str> {
    let id = text.split("probe=").nth(1)?.split(' ').next()?;
    id.starts_with(&format!("{tag}-")).then_some(id)
}

/// A number nginx writes with three decimals (`9.990`), in thousandths.
fn thousandths(text: &str) -> Option<i64> {
    let (whole, part) = text.split_once('.')?;
    Some(whole.parse::<i64>().ok()? * 1000 + part.parse::<i64>().ok()?)
}

/// What nginx decided of `tag`'s requests: when each began (its access
/// log: the time less the request's time, on its cached ms clock), and
/// for those it held or refused, the excess its error log gives, from
/// which it held `(excess - delay) * 1000 / rate` ms
/// (`ngx_http_limit_req_account`). Once its access log has `count` lines
/// of them (it writes one after its answer, waited for up to 5 s).
async fn nginx_said(nginx: &FrontProxy, tag: &str, count: usize) -> HashMap<String, Said> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let access = loop {
        let access = nginx.access_log();
        let lines = access.lines().filter(|l| probe(l, tag).is_some()).count();
        if lines >= count || Instant::now() > deadline {
            break access;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let error = nginx.log();
    let mut said = HashMap::new();
    for line in access.lines() {
        let mut fields = line.split(' ');
        let (Some(msec), Some(took), Some(uri)) = (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let (Some(id), Some(end), Some(took)) =
            (probe(uri, tag), thousandths(msec), thousandths(took))
        else {
            continue;
        };
        let at = end - took;
        said.insert(
            id.to_owned(),
            Said {
                at,
                wait: 0,
                refused: false,
            },
        );
    }
    for line in error.lines() {
        let excess = line
            .split("excess: ")
            .nth(1)
            .map(|r| r.split([',', ' ']).next());
        let (Some(id), Some(Some(excess))) = (probe(line, tag), excess) else {
            continue;
        };
        let (Some(s), Some(excess)) = (said.get_mut(id), thousandths(excess)) else {
            continue;
        };
        if line.contains("delaying request") {
            s.wait = (excess - DELAY) * 1000 / RATE;
        } else if line.contains("limiting requests") {
            s.refused = true;
        }
    }
    said
}

/// What floodgate decided of `tag`'s requests, by its access logs
/// (`decided_at_ms`: the store's clock; `held_ms`), once they have
/// `count` lines of them (waiting up to 5 s for the writers).
async fn floodgate_said(logs: &[&Path], tag: &str, count: usize) -> HashMap<String, Said> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut said = HashMap::new();
        for log in logs {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            for line in text.lines() {
                let Ok(line) = serde_json::from_str::<serde_json::Value>(line) else {
                    continue;
                };
                let (Some(id), Some(at)) = (
                    line["path"].as_str().and_then(|p| probe(p, tag)),
                    line["decided_at_ms"].as_i64(),
                ) else {
                    continue;
                };
                let s = Said {
                    at,
                    wait: line["held_ms"].as_i64().unwrap_or(0),
                    refused: line["status"] == 429,
                };
                said.insert(id.to_owned(), s);
            }
        }
        if said.len() >= count || Instant::now() > deadline {
            return said;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// nginx's `limit_req` (`ngx_http_limit_req_lookup` and `_account`, one
/// zone, 1.22) replayed on the instants in `said`, in the order decided
/// (within a millisecond: admitted before refused, shorter holds first):
/// per request, what a proxy said and what nginx would say at its
/// instant. A new client's first request finds no excess; the excess
/// drains at the rate, by whole milliseconds, and grows by one request
/// per admitted one; past the burst the request is refused and nothing
/// changes; past the delay it is held `(excess - delay) * 1000 / rate` ms.
fn as_nginx_would(said: &HashMap<String, Said>) -> Vec<(Said, Said)> {
    let mut order: Vec<Said> = said.values().copied().collect();
    order.sort_by_key(|s| (s.at, s.refused, s.wait));
    // The excess and when it was last counted: in order, `s.at` is never
    // before it.
    let mut kept: Option<(i64, i64)> = None;
    order
        .into_iter()
        .map(|s| {
            let excess = match kept {
                None => 0,
                Some((excess, last)) => (excess - RATE * (s.at - last) / 1000 + 1000).max(0),
            };
            let refused = excess > BURST;
            if !refused {
                kept = Some((excess, s.at));
            }
            let wait = if excess > DELAY && !refused {
                (excess - DELAY) * 1000 / RATE
            } else {
                0
            };
            (
                s,
                Said {
                    at: s.at,
                    wait,
                    refused,
                },
            )
        })
        .collect()
}

/// The largest difference between what a proxy said and what nginx would
/// at the same instants (ms), and the requests that differ.
fn apart_from_nginx(said: &HashMap<String, Said>) -> (i64, Vec<(Said, Said)>) {
    let replayed = as_nginx_would(said);
    let differ: Vec<(Said, Said)> = replayed.into_iter().filter(|(a, b)| a != b).collect();
    let most = differ
        .iter()
        .map(|(a, b)| {
            if a.refused == b.refused {
                (a.wait - b.wait).abs()
            } else {
                i64::MAX
            }
        })
        .max()
        .unwrap_or(0);
    (most, differ)
}

/// How much later than it fit (at + wait) each held request (or with
/// `held` false, each admitted at once) reached the upstream (ms): the
/// timer's wake-up and the forwarding, or the forwarding alone.
fn late(run: &[Vec<Measured>], said: &HashMap<String, Said>, held: bool) -> Vec<f64> {
    let mut late: Vec<f64> = run
        .iter()
        .flatten()
        .filter_map(|m| {
            let s = said.get(&m.id).filter(|s| (s.wait > 0) == held)?;
            Some(m.reached? - (s.at + s.wait) as f64)
        })
        .collect();
    late.sort_by(f64::total_cmp);
    late
}

fn floodgate_config(upstream: &Upstream, redis: &TestRedis, prefix: &str, log: &Path) -> String {
    Config::new()
        .redis(&redis.url, prefix)
        .access_log(&[&format!("path = {:?}", log.display().to_string())])
        .route(
            Route::new("limited")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/limited""#)
                .limits(LIMIT),
        )
        .route(
            Route::new("warm")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/warm""#)
                .limits(r#"{ algorithm = "gcra", limit = 1000, window = "1s", key = { from = "global" } }"#),
        )
        .toml()
}

/// The same schedule through nginx (`limit_req rate=10r/s burst=20
/// delay=8`) and through floodgate on Redis (`burst = 9, delay =
/// "1200ms"`): each burst's requests admitted at once, held or refused
/// as the limit says, by each proxy's own account (nginx's logs,
/// floodgate's access log), and each request held as long as nginx holds
/// a request decided at the same instant: to the millisecond for
/// floodgate, whose log gives the store's instant; within one for nginx
/// itself, whose log gives when a request began on a clock a fraction of
/// a millisecond off the one it decides by. Then through two floodgates
/// on one Redis, a burst's requests split between them: the same as
/// through one. Delays as measured (sending to the upstream) are shown
/// beside, and floodgate let no held request go before it fit; how late
/// after it each reached the upstream is the machine's (a timer's
/// wake-up and the forwarding), not a decision, so it is shown, not held
/// to a deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_goes_at_once_the_next_wait_as_nginx_holds_them_and_two_instances_agree() {
    let _alone = ALONE.lock().await;
    let upstream = Upstream::start().await;
    let redis = TestRedis::start().await;
    let dir = support::temp_dir("delays");
    let total: usize = SCHEDULE.iter().map(|&(_, n)| n).sum();
    let nginx = FrontProxy::nginx_limit_req(upstream.addr, "10r/s", "burst=20 delay=8").await;
    let nginx_addr: SocketAddr = ([127, 0, 0, 1], nginx.port).into();
    let through_nginx = run(&[nginx_addr], &upstream, "nginx").await;
    let by_nginx = nginx_said(&nginx, "nginx", total).await;
    assert_eq!(
        classes(&through_nginx, &by_nginx),
        EXPECTED,
        "nginx:\n{}",
        nginx.log()
    );
    let (most, differ) = apart_from_nginx(&by_nginx);
    assert!(
        most <= 1,
        "nginx's own holds against its arithmetic: {differ:?}"
    );

    let prefix = support::redis::unique_prefix("delays");
    let one_log = dir.join("one.log");
    let one = Floodgate::start(&floodgate_config(
        &upstream,
        &redis,
        &format!("{prefix}-one"),
        &one_log,
    ))
    .await;
    let through_one = run(&[one.addr], &upstream, "one").await;
    let by_one = floodgate_said(&[&one_log], "one", total).await;
    assert_eq!(classes(&through_one, &by_one), EXPECTED, "floodgate");
    let (most, differ) = apart_from_nginx(&by_one);
    assert_eq!(
        most, 0,
        "floodgate's holds against nginx's at the same instants: {differ:?}"
    );
    let early = late(&through_one, &by_one, true);
    assert!(
        early.first().is_none_or(|&ms| ms >= 0.0),
        "a held request reached the upstream before it fit: {early:.1?}"
    );
    eprintln!(
        "held requests reached the upstream after they fit (ms): floodgate {early:.1?}; nginx {:.1?}",
        late(&through_nginx, &by_nginx, true)
    );
    eprintln!(
        "admitted at once, reached the upstream after decided (ms): floodgate {:.1?}; nginx {:.1?}",
        late(&through_one, &by_one, false),
        late(&through_nginx, &by_nginx, false)
    );
    let (one_delays, nginx_delays) = (
        held_delays(&through_one, &by_one),
        held_delays(&through_nginx, &by_nginx),
    );
    let (each, largest, median) = differences(&one_delays, &nginx_delays);
    eprintln!(
        "measured, held by floodgate − by nginx (ms): {each:.1?}; largest {largest:.1}, median {median:.1}"
    );

    let union = format!("{prefix}-union");
    let (a_log, b_log) = (dir.join("a.log"), dir.join("b.log"));
    let a = Floodgate::start(&floodgate_config(&upstream, &redis, &union, &a_log)).await;
    let b = Floodgate::start(&floodgate_config(&upstream, &redis, &union, &b_log)).await;
    let through_two = run(&[a.addr, b.addr], &upstream, "two").await;
    let by_two = floodgate_said(&[&a_log, &b_log], "two", total).await;
    assert_eq!(classes(&through_two, &by_two), EXPECTED, "two floodgates");
    let (most, differ) = apart_from_nginx(&by_two);
    assert_eq!(
        most, 0,
        "two floodgates' holds against nginx's at the same instants: {differ:?}"
    );
    let early = late(&through_two, &by_two, true);
    assert!(
        early.first().is_none_or(|&ms| ms >= 0.0),
        "a held request reached the upstream before it fit: {early:.1?}"
    );
    let (each, largest, median) = differences(&held_delays(&through_two, &by_two), &one_delays);
    eprintln!(
        "measured, held by two instances − by one (ms): {each:.1?}; largest {largest:.1}, median {median:.1}"
    );
}

// === held requests whose clients leave ===

/// Requests held at once in each wave: the instance's bound.
const HELD: usize = 10_000;

/// HTTP/2 connections a wave's clients share (at most 1 000 streams each).
const CONNECTIONS: usize = 20;

/// How long a client's second request is held: longer than a wave takes
/// to send, so that every one is still held when the clients leave.
const HOLD: Duration = Duration::from_secs(15);

/// A budget that `/prime` (answered by floodgate itself) and `/held`
/// (forwarded) draw from: a client's request to `/prime` goes at once,
/// and its request to `/held` after it is held `HOLD`. Nothing but held
/// requests is ever forwarded, and the upstream records nothing else.
const HOLDING: &str = r#"[budgets.holding]
limits = [{ algorithm = "gcra", limit = 1, window = "15s", burst = 1, delay = "30s" }]"#;

/// The most process `pid`'s resident memory reached since the last read,
/// sampled every 10 ms.
struct Peak {
    pid: u32,
    most: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
}

impl Peak {
    fn watch(pid: u32) -> Self {
        let (most, stop) = (
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let (m, s) = (Arc::clone(&most), Arc::clone(&stop));
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                m.fetch_max(resident_kib(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        });
        Self { pid, most, stop }
    }

    /// The peak since the last call (KiB), starting over.
    fn take(&self) -> u64 {
        self.most.swap(resident_kib(self.pid), Ordering::Relaxed)
    }
}

impl Drop for Peak {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// `VmRSS` of process `pid`, in KiB.
fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A floodgate as these tests reach it: where it serves, and its
/// `/metrics`.
struct Gate {
    addr: SocketAddr,
    metrics: String,
}

impl From<&Floodgate> for Gate {
    fn from(floodgate: &Floodgate) -> Self {
        Self {
            addr: floodgate.addr,
            metrics: floodgate.admin_url("/metrics"),
        }
    }
}

/// A metric of `floodgate`'s `/metrics`, summed over the series with
/// `labels`.
async fn metric(floodgate: &Gate, name: &str, labels: &[&str]) -> f64 {
    let page = support::TestClient::http1()
        .get(&floodgate.metrics, &[])
        .await
        .text();
    support::load::metric_where(&page, name, labels)
}

/// Polls `name` until it is `want`, for at most `within`: how long it
/// took, or `None`.
async fn reaches(floodgate: &Gate, name: &str, want: f64, within: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < within {
        if metric(floodgate, name, &[]).await == want {
            return Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// A client's side of an HTTP/2 connection.
type H2Sender = hyper::client::conn::http2::SendRequest<Empty<Bytes>>;

/// One GET of `path` as client `client`.
fn as_client(path: &str, client: usize) -> Request<Empty<Bytes>> {
    Request::get(format!("http://held.test{path}"))
        .header("x-client", format!("c{client}"))
        .body(Empty::new())
        .expect("request")
}

/// What a wave left: the upstream's requests when its clients left, and
/// when the last of its holds would have ended.
struct Wave {
    hits_when_left: usize,
    last_hold_ends: Instant,
}

/// `CONNECTIONS` HTTP/2 connections to `addr`, and a second handle on
/// each one's socket, to close it under its client.
async fn connections(addr: SocketAddr) -> (Vec<H2Sender>, Vec<std::net::TcpStream>) {
    let mut senders = Vec::new();
    let mut sockets = Vec::new();
    for _ in 0..CONNECTIONS {
        let socket = std::net::TcpStream::connect(addr).expect("connect");
        socket.set_nonblocking(true).expect("non-blocking");
        // Another handle on the socket, to close it under the client.
        sockets.push(socket.try_clone().expect("a second handle"));
        let stream = tokio::net::TcpStream::from_std(socket).expect("tokio stream");
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
            .await
            .expect("h2 handshake");
        senders.push(sender);
        tokio::spawn(connection);
    }
    (senders, sockets)
}

/// One request beyond the instance's bound, of a client with one held
/// already: decided without a delay instead, it does not fit at once,
/// and is refused with 429 and Retry-After, counted as the bound full.
async fn beyond_the_bound(floodgate: &Gate, sender: &mut H2Sender, client: usize) {
    let full = r#"bound="instance""#;
    let before = metric(floodgate, "floodgate_held_full_total", &[full]).await;
    let beyond = sender
        .send_request(as_client("/held", client))
        .await
        .expect("an answer");
    assert_eq!(beyond.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(beyond.headers().contains_key("retry-after"));
    assert_eq!(
        metric(floodgate, "floodgate_held_full_total", &[full]).await,
        before + 1.0
    );
}

/// `HELD` clients from `first`, on `CONNECTIONS` HTTP/2 connections:
/// each sends a request that goes at once and then one that is held;
/// once all are held, one more beyond the bound is refused with 429, and
/// then every client leaves (its connection closed): the held count is
/// back to 0 within a second.
async fn wave(floodgate: &Gate, upstream: &Upstream, first: usize) -> Wave {
    let started = Instant::now();
    let (mut senders, sockets) = connections(floodgate.addr).await;
    let firsts = Arc::new(tokio::sync::Semaphore::new(500));
    let mut clients = tokio::task::JoinSet::new();
    for client in first..first + HELD {
        let mut sender = senders[client % CONNECTIONS].clone();
        let firsts = Arc::clone(&firsts);
        clients.spawn(async move {
            let permit = firsts.acquire_owned().await.expect("semaphore");
            let at_once = sender
                .send_request(as_client("/prime", client))
                .await
                .expect("an answer");
            assert_eq!(
                at_once.status(),
                StatusCode::OK,
                "client {client}'s first request"
            );
            let _ = at_once.into_body().collect().await;
            let held = sender.send_request(as_client("/held", client));
            drop(permit);
            // Ends only when the connection is closed under it.
            let _ = held.await;
        });
    }
    let all_held = reaches(
        floodgate,
        "floodgate_held_requests",
        HELD as f64,
        Duration::from_secs(60),
    )
    .await;
    let last_hold_ends = Instant::now() + HOLD;
    let took = started.elapsed();
    assert!(
        all_held.is_some() && took < HOLD,
        "{HELD} requests held at once: {} held after {took:?}",
        metric(floodgate, "floodgate_held_requests", &[]).await
    );
    eprintln!("{HELD} clients' requests held {took:?} after the wave began");
    beyond_the_bound(floodgate, &mut senders[0], first).await;
    // Every client leaves: the connections close under the held requests.
    let hits_when_left = upstream.hits();
    for socket in &sockets {
        socket
            .shutdown(std::net::Shutdown::Both)
            .expect("close the connection");
    }
    let let_go = reaches(
        floodgate,
        "floodgate_held_requests",
        0.0,
        Duration::from_secs(1),
    )
    .await;
    assert!(
        let_go.is_some(),
        "held requests still counted a second after their clients left: {}",
        metric(floodgate, "floodgate_held_requests", &[]).await
    );
    eprintln!(
        "held count back to 0 {:?} after the clients left",
        let_go.unwrap_or_default()
    );
    drop(senders);
    while clients.join_next().await.is_some() {}
    Wave {
        hits_when_left,
        last_hold_ends,
    }
}

/// Waves of 10 000 held requests whose clients then leave: each time the
/// held count is back to 0 within a second, nothing they asked reaches
/// the upstream (watched until their holds would have ended), and the
/// instance's bound refuses one more with 429; and the second and third
/// waves take floodgate no more memory than the first did at its peak,
/// but for its allocator's settling.
/// floodgate runs as a process of its own, so that its memory is told
/// apart from its clients', with one allocator arena
/// (`MALLOC_ARENA_MAX=1`): with one per thread, each keeps its own peak,
/// and which thread serves a wave moves the process's by several percent
/// whatever the requests leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_held_requests_are_let_go_when_their_clients_leave() {
    let _alone = ALONE.lock().await;
    let upstream = Upstream::start().await;
    let redis = TestRedis::start().await;
    let (port, admin) = (support::free_port(), support::free_port());
    let config = Config::new()
        .listen_on(port)
        .admin_on(admin)
        .redis(&redis.url, &support::redis::unique_prefix("held"))
        .server(&format!("max_held = {HELD}"))
        .server("max_held_per_client = 2")
        .server("http2_max_concurrent_streams = 1000")
        .route(
            Route::new("prime")
                .matching(r#"path_prefix = "/prime""#)
                .client(r#"from = "header", name = "X-Client""#)
                .line(r#"budgets = ["holding"]"#),
        )
        .route(
            Route::new("held")
                .upstream(&upstream.url())
                .matching(r#"path_prefix = "/held""#)
                .client(r#"from = "header", name = "X-Client""#)
                .line(r#"budgets = ["holding"]"#),
        )
        .tables(HOLDING)
        .write("held-waves");
    let log = config.with_file_name("floodgate.log");
    let process = support::FloodgateProcess::spawn_logging(
        &config,
        port,
        &[("MALLOC_ARENA_MAX", "1")],
        &[],
        &log,
    )
    .await;
    let floodgate = Gate {
        addr: ([127, 0, 0, 1], port).into(),
        metrics: format!("http://127.0.0.1:{admin}/metrics"),
    };
    let peak = Peak::watch(process.pid());
    peak.take();
    let before = resident_kib(process.pid());
    let mut peaks = Vec::new();
    let mut last_hold_ends = Instant::now();
    for w in 0..WAVES {
        let wave = wave(&floodgate, &upstream, w * HELD).await;
        peaks.push(peak.take());
        // Nothing held reached the upstream.
        assert_eq!(wave.hits_when_left, 0, "wave {w}");
        last_hold_ends = wave.last_hold_ends;
    }
    eprintln!(
        "floodgate's resident memory: {before} KiB before, at its peak in each wave {peaks:?} KiB"
    );
    // Nor once the holds would have ended.
    tokio::time::sleep_until((last_hold_ends + Duration::from_millis(500)).into()).await;
    assert_eq!(
        upstream.hits(),
        0,
        "a held request went on after its client left"
    );
    assert_eq!(
        metric(&floodgate, "floodgate_held_total", &[r#"ended="went""#]).await,
        0.0
    );
    assert_eq!(
        metric(&floodgate, "floodgate_held_total", &[r#"ended="left""#]).await,
        (WAVES * HELD) as f64
    );
    // A wave takes floodgate about 67 MB (unoptimised). Its allocator
    // settles in the second: 0.6 to 1.4 % of that above the first's peak,
    // and no further in six waves (each within 0.5 % of the second), while
    // floodgate's held places are back to none after each (above). What
    // held requests left behind would add up wave on wave: 70 bytes each
    // passes the 3 % by the third.
    let first = peaks[0];
    let slack = first.saturating_sub(before) * 3 / 100;
    assert!(
        peaks.iter().all(|&p| p <= first + slack),
        "a later wave grew floodgate's memory past the first's peak: {peaks:?} KiB (+ {slack} KiB)"
    );
}

/// Waves of held requests, one after the other.
const WAVES: usize = 3;

/// A client holding `max_held_per_client` requests: its next one that
/// would be held is decided without the delay and refused (429, counted
/// as the client's bound full), while another client's is still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_at_its_bound_is_refused_what_would_be_held_while_others_wait() {
    let _alone = ALONE.lock().await;
    let config = Config::new()
        .admin()
        .server("max_held_per_client = 1")
        .route(
            Route::new("held")
                .matching(r#"path_prefix = "/held""#)
                .client(r#"from = "header", name = "X-Client""#)
                .limits(
                    r#"{ algorithm = "gcra", limit = 1, window = "2s", burst = 1, delay = "10s" }"#,
                ),
        )
        .toml();
    let floodgate = Floodgate::start(&config).await;
    let floodgate = Gate::from(&floodgate);
    let (mut senders, _sockets) = connections(floodgate.addr).await;
    let mut send = |client: usize| senders[0].send_request(as_client("/held", client));
    assert_eq!(send(1).await.expect("an answer").status(), StatusCode::OK);
    let held = tokio::spawn(send(1));
    let one_held = reaches(
        &floodgate,
        "floodgate_held_requests",
        1.0,
        Duration::from_secs(5),
    );
    assert!(one_held.await.is_some(), "client 1's second request held");
    let refused = send(1).await.expect("an answer");
    assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
    let full = metric(
        &floodgate,
        "floodgate_held_full_total",
        &[r#"bound="client""#],
    )
    .await;
    assert_eq!(full, 1.0);
    // Another client's second request is held beside the first's.
    assert_eq!(send(2).await.expect("an answer").status(), StatusCode::OK);
    let other = tokio::spawn(send(2));
    assert!(
        reaches(
            &floodgate,
            "floodgate_held_requests",
            2.0,
            Duration::from_secs(5)
        )
        .await
        .is_some()
    );
    for answer in [held, other] {
        let answer = answer.await.expect("task").expect("an answer");
        assert_eq!(answer.status(), StatusCode::OK, "held, then admitted");
    }
    assert_eq!(
        metric(&floodgate, "floodgate_held_total", &[r#"ended="went""#]).await,
        2.0
    );
}
