//! Load across several floodgate processes: an upstream that notes when
//! each request arrived and from which instance, the processes sharing one
//! Redis, and paced load on keep-alive connections.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Empty, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

use super::config::{Config, Route};
use super::redis::{TestRedis, unique_prefix};
use super::{FloodgateProcess, free_port, temp_dir};

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One request the upstream saw: when it arrived, when the load sent it
/// (ms, the system clock, which is also the clock of the Redis on this
/// machine), the instance the load sent it to (`u8::MAX`: not sent by
/// the load), and the load's number for it (`X-Id`; `u64::MAX`: none).
/// floodgate decided it between `sent` and `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Arrival {
    pub at: u64,
    pub sent: u64,
    pub from: u8,
    pub id: u64,
}

/// An upstream that notes each request that reached it.
pub struct Ledger {
    pub url: String,
    arrivals: Arc<Mutex<Vec<Arrival>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Ledger {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&arrivals);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let at = now_ms();
                        let header = |name: &str| {
                            req.headers()
                                .get(name)
                                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                        };
                        let from = header("x-instance")
                            .and_then(|i| u8::try_from(i).ok())
                            .unwrap_or(u8::MAX);
                        let sent = header("x-sent").unwrap_or(at);
                        let id = header("x-id").unwrap_or(u64::MAX);
                        log.lock()
                            .expect("ledger")
                            .push(Arrival { at, sent, from, id });
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

    /// The requests that arrived, in the order they arrived.
    pub fn arrivals(&self) -> Vec<Arrival> {
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
pub struct Instance {
    pub process: FloodgateProcess,
    pub admin: u16,
}

impl Instance {
    /// A counter or gauge of this instance's `/metrics`, summed over its
    /// series.
    pub async fn metric(&self, name: &str) -> f64 {
        let Some(text) = admin_get(self.admin, "/metrics").await else {
            return 0.0;
        };
        metric_in(&text, name)
    }
}

/// A counter or gauge of a `/metrics` page, summed over its series.
pub fn metric_in(text: &str, name: &str) -> f64 {
    metric_where(text, name, &[])
}

/// A counter or gauge of a `/metrics` page, summed over its series whose
/// labels include each of `labels` (written `key="value"`).
pub fn metric_where(text: &str, name: &str, labels: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter(|l| l[name.len()..].starts_with(['{', ' ']))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A GET on loopback `port` on a connection of its own; `None` if
/// nothing answers (an instance killed).
async fn get(port: u16, path: &str, host: &str) -> Option<Response<Incoming>> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(connection);
    let request = Request::get(path)
        .header("host", host)
        .body(Empty::<Bytes>::new())
        .ok()?;
    sender.send_request(request).await.ok()
}

/// An admin listener's answer to a GET of `path`, as text.
pub async fn admin_get(port: u16, path: &str) -> Option<String> {
    use http_body_util::BodyExt;
    let body = get(port, path, "127.0.0.1")
        .await?
        .into_body()
        .collect()
        .await
        .ok()?;
    Some(String::from_utf8_lossy(&body.to_bytes()).into_owned())
}

/// `n` floodgate processes sharing `redis` (with `store` lines added to
/// `[store]`), the route's one limit written as `limit`, forwarding to
/// `ledger`; `first_ms` is when their first requests were sent.
pub async fn instances(
    test: &str,
    n: usize,
    redis: &TestRedis,
    ledger: &Ledger,
    limit: &str,
    store: &[&str],
    first_ms: &mut u64,
) -> Vec<Instance> {
    let mut config = Config::new()
        .redis(&redis.url, &unique_prefix(test))
        .admin()
        .route(Route::new("api").upstream(&ledger.url).limits(limit));
    for line in store {
        config = config.store(line);
    }
    let config = config.write(test);
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
    *first_ms = now_ms();
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

/// The status of a GET of `/` on the route.
pub async fn get_status(port: u16) -> Option<u16> {
    Some(get(port, "/", "api").await?.status().as_u16())
}

/// What one instance's share of the load got: answers by status, and
/// when each refused request was sent and answered (ms): floodgate refused
/// it in between.
#[derive(Debug, Default, Clone)]
pub struct Got {
    pub ok: u64,
    pub refused: u64,
    pub other: u64,
    pub refusals: Vec<(u64, u64)>,
}

impl Got {
    /// Requests the load sent and had answered.
    pub fn offered(&self) -> u64 {
        self.ok + self.refused + self.other
    }
}

/// Offers `rates[i]` requests a second to instance `i` until `until_ms`,
/// on four keep-alive connections each, paced; a connection that fails
/// (an instance killed) ends its share.
pub async fn offer(ports: &[u16], rates: &[u64], until_ms: u64) -> Vec<Got> {
    const CONNECTIONS: u64 = 4;
    let mut tasks = Vec::new();
    for (i, (&port, &rate)) in ports.iter().zip(rates).enumerate() {
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
                    let sent = now_ms();
                    let request = Request::get("/")
                        .header("host", "api")
                        .header("x-instance", i.to_string())
                        .header("x-sent", sent.to_string())
                        .body(Empty::<Bytes>::new())
                        .expect("request");
                    match sender.send_request(request).await {
                        Ok(answer) => match answer.status().as_u16() {
                            200 => got.ok += 1,
                            429 => {
                                got.refused += 1;
                                got.refusals.push((sent, now_ms()));
                            }
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
        total.refusals.extend(got.refusals);
    }
    per_instance
}
