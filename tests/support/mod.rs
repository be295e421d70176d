//! The integration-test harness: a real upstream HTTP server that echoes what
//! it received, floodgate itself started in process on port 0, and a client.
#![allow(dead_code)] // each test binary uses its own part of the harness

pub mod certs;
pub mod cluster;
pub mod config;
pub mod front;
pub mod load;
pub mod peers;
pub mod redis;
pub mod relay;
pub mod sentinel;
pub mod tokens;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Sends floodgate's log lines (info and up) to the output of the test
/// that caused them, which the test runner shows when that test fails:
/// why a store call failed, when the breaker opened.
fn show_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("floodgate=info"))
        .with_writer(|| Shown)
        .with_ansi(false)
        .try_init();
}

/// The audit lines (target `floodgate::audit`) that in-process instances
/// of this test binary wrote so far, for a test to find its own.
pub fn audit_lines() -> Vec<String> {
    AUDIT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Every audit line of this test binary's in-process instances.
static AUDIT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// A log line's way out: to the output of the test that caused it (as
/// `with_test_writer` does), an audit line kept in `AUDIT` besides.
struct Shown;

impl std::io::Write for Shown {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let line = String::from_utf8_lossy(buf);
        if line.contains("floodgate::audit") {
            AUDIT
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(line.trim_end().to_owned());
        }
        print!("{line}");
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

// === the upstream ===

/// A real HTTP/1.1 upstream on loopback. Every path echoes the request as
/// JSON, except:
/// - `/slow?ms=N` waits N ms first;
/// - `/download?bytes=N` streams N bytes;
/// - `/upload` reads the body as it streams and answers its length;
/// - `/hop` answers with hop-by-hop headers that must not reach the client;
/// - `/status?code=N` answers with status N;
/// - `/units?n=N` reports N units used in `X-Units-Used`;
/// - `/close` answers with `Connection: close` and closes the connection.
pub struct Upstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    connections: Arc<AtomicUsize>,
    seen: Arc<std::sync::Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

/// A request as the upstream received it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    /// The request target, as sent.
    pub target: String,
    pub headers: HeaderMap,
    /// When the upstream received it.
    pub at: std::time::Instant,
}

impl Upstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind upstream");
        let addr = listener.local_addr().expect("upstream addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let counter = Arc::clone(&hits);
        let accepted = Arc::clone(&connections);
        let record = Arc::clone(&seen);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::SeqCst);
                let counter = Arc::clone(&counter);
                let record = Arc::clone(&record);
                tokio::spawn(async move {
                    let service = service_fn(move |req: Request<Incoming>| {
                        counter.fetch_add(1, Ordering::SeqCst);
                        // The first requests only: load tests send millions.
                        if let Ok(mut seen) = record.lock()
                            && seen.len() < 10_000
                        {
                            seen.push(Seen {
                                method: req.method().to_string(),
                                target: req.uri().to_string(),
                                headers: req.headers().clone(),
                                at: std::time::Instant::now(),
                            });
                        }
                        upstream_answer(req)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            hits,
            connections,
            seen,
            task,
        }
    }

    /// The requests received so far (the first 10 000), in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// `http://127.0.0.1:port`
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests the upstream has received.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// TCP connections the upstream has accepted.
    pub fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type UpstreamBody = http_body_util::Either<Full<Bytes>, Generated>;

fn query_number(req: &Request<Incoming>, key: &str) -> u64 {
    req.uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

async fn upstream_answer(req: Request<Incoming>) -> Result<Response<UpstreamBody>, Infallible> {
    let full = |s: String| http_body_util::Either::Left(Full::new(Bytes::from(s)));
    match req.uri().path() {
        "/download" => {
            let n = query_number(&req, "bytes");
            return Ok(Response::new(http_body_util::Either::Right(
                Generated::new(n),
            )));
        }
        "/upload" => {
            let mut body = req.into_body();
            let mut n = 0u64;
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.map(|f| f.into_data()) {
                    n += data.map_or(0, |d| d.len() as u64);
                }
            }
            return Ok(Response::new(full(n.to_string())));
        }
        "/hop" => {
            return Ok(Response::builder()
                .header("connection", "x-upstream-secret")
                .header("x-upstream-secret", "1")
                .header("keep-alive", "timeout=5")
                .header("x-upstream-kept", "1")
                .body(full("hop".into()))
                .expect("response"));
        }
        "/close" => {
            return Ok(Response::builder()
                .header("connection", "close")
                .body(full("closing".into()))
                .expect("response"));
        }
        "/units" => {
            let n = query_number(&req, "n");
            return Ok(Response::builder()
                .header("x-units-used", n)
                .body(full("used".into()))
                .expect("response"));
        }
        "/status" => {
            let code = u16::try_from(query_number(&req, "code")).unwrap_or(200);
            let mut response = Response::new(full(format!("status {code}")));
            *response.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
            return Ok(response);
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_millis(query_number(&req, "ms"))).await;
        }
        _ => {}
    }
    let method = req.method().to_string();
    let uri = req.uri().to_string();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let echo = serde_json::json!({
        "method": method,
        "uri": uri,
        "headers": headers,
        "body": String::from_utf8_lossy(&body),
    });
    Ok(Response::new(full(echo.to_string())))
}

/// A body of `n` bytes made 64 KiB at a time, never held whole; with its
/// length declared (`Content-Length`) or not (sent chunked).
pub struct Generated {
    left: u64,
    chunk: Bytes,
    declared: bool,
}

impl Generated {
    pub fn new(n: u64) -> Self {
        Self {
            left: n,
            chunk: Bytes::from(vec![b'x'; 64 * 1024]),
            declared: true,
        }
    }

    /// The same, declaring no length.
    pub fn without_length(n: u64) -> Self {
        Self {
            declared: false,
            ..Self::new(n)
        }
    }
}

/// A body sent in the pieces a channel hands it, ending when the sender
/// goes: an upstream that answers in its own time.
pub struct Chunks(pub tokio::sync::mpsc::Receiver<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

impl Body for Generated {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        let n = self.left.min(self.chunk.len() as u64) as usize;
        self.left -= n as u64;
        Poll::Ready(Some(Ok(Frame::data(self.chunk.slice(..n)))))
    }

    fn size_hint(&self) -> SizeHint {
        if self.declared {
            SizeHint::with_exact(self.left)
        } else {
            SizeHint::default()
        }
    }

    fn is_end_stream(&self) -> bool {
        self.left == 0
    }
}

// === floodgate in process ===

/// A floodgate serving a TOML configuration on 127.0.0.1:port.
pub struct Floodgate {
    pub addr: SocketAddr,
    /// The admin listener, when the configuration has `admin_listen`.
    pub admin: Option<SocketAddr>,
    /// The decision listener, when the configuration has `decision_listen`.
    pub decisions: Option<SocketAddr>,
    /// Notify to reload, as SIGHUP does.
    pub reload: Arc<tokio::sync::Notify>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), floodgate::ServeError>>>,
}

impl Floodgate {
    /// Starts floodgate with `toml` (its `[server] listen`, and
    /// `admin_listen` if present, are replaced by free loopback ports).
    /// Panics with the config errors when it is invalid.
    pub async fn start(toml: &str) -> Self {
        let config = floodgate::config::parse(Path::new("test.toml"), toml)
            .unwrap_or_else(|e| panic!("test config is invalid:\n{e}"));
        Self::serve(config).await
    }

    /// Starts floodgate with the configuration file at `path`, which it
    /// reloads when the file changes or [`Floodgate::reload`] is notified.
    pub async fn start_file(path: &Path) -> Self {
        let config = floodgate::config::load(path)
            .unwrap_or_else(|e| panic!("test config is invalid:\n{e}"));
        Self::serve(config).await
    }

    /// Tries to start floodgate with `toml` (valid), expecting it to
    /// refuse: the reason it gives.
    pub async fn start_refused(toml: &str) -> String {
        let config = floodgate::config::parse(Path::new("test.toml"), toml)
            .unwrap_or_else(|e| panic!("test config is invalid:\n{e}"));
        let listeners = floodgate::Listeners {
            proxy: TcpListener::bind("127.0.0.1:0").await.expect("bind"),
            admin: None,
            decisions: None,
        };
        let run = floodgate::run(
            config,
            listeners,
            std::future::pending(),
            Arc::new(tokio::sync::Notify::new()),
        );
        match tokio::time::timeout(Duration::from_secs(30), run).await {
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(())) => panic!("floodgate started and stopped"),
            Err(_) => panic!("floodgate started instead of refusing"),
        }
    }

    async fn serve(config: floodgate::config::Config) -> Self {
        show_logs();
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind floodgate");
        let addr = listener.local_addr().expect("floodgate addr");
        let admin = match config.server.admin_listen {
            Some(_) => Some(TcpListener::bind("127.0.0.1:0").await.expect("bind admin")),
            None => None,
        };
        let admin_addr = admin.as_ref().map(|l| l.local_addr().expect("admin addr"));
        let decisions = match config.server.decision_listen {
            Some(_) => Some(
                TcpListener::bind("127.0.0.1:0")
                    .await
                    .expect("bind decisions"),
            ),
            None => None,
        };
        let decisions_addr = decisions
            .as_ref()
            .map(|l| l.local_addr().expect("decisions addr"));
        let listeners = floodgate::Listeners {
            proxy: listener,
            admin,
            decisions,
        };
        let reload = Arc::new(tokio::sync::Notify::new());
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(floodgate::run(
            config,
            listeners,
            async {
                let _ = stopped.await;
            },
            Arc::clone(&reload),
        ));
        Self {
            addr,
            admin: admin_addr,
            decisions: decisions_addr,
            reload,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// `http://admin-address/path`
    pub fn admin_url(&self, path: &str) -> String {
        format!(
            "http://{}{}",
            self.admin.expect("admin_listen is configured"),
            path
        )
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Asks floodgate to stop and waits until it has.
    pub async fn stop(mut self) -> Result<(), floodgate::ServeError> {
        self.begin_stop();
        self.join().await
    }

    /// Asks floodgate to stop without waiting.
    pub fn begin_stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Waits until floodgate has stopped.
    pub async fn join(&mut self) -> Result<(), floodgate::ServeError> {
        match self.task.take() {
            Some(task) => task.await.expect("floodgate task panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for Floodgate {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

// === the client ===

pub type ClientBody = http_body_util::Either<Full<Bytes>, Generated>;

/// A pooled HTTP/1.1 client (or HTTP/2 with prior knowledge).
#[derive(Clone)]
pub struct TestClient {
    inner: Client<HttpConnector, ClientBody>,
}

/// A whole response, read.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The echoed request header `name`, as the upstream saw it.
    pub fn echoed_header(&self, name: &str) -> Option<String> {
        let json = self.json();
        json["headers"].as_array()?.iter().find_map(|pair| {
            (pair[0].as_str()? == name).then(|| pair[1].as_str().map(str::to_owned))?
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The status and detail of one of floodgate's own answers, which must
    /// be an RFC 9457 problem document whose status is the answer's.
    pub fn problem(&self) -> (u16, String) {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}",
            self.text()
        );
        let json = self.json();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert_eq!(json["type"], "about:blank", "{json}");
        let detail = json["detail"]
            .as_str()
            .unwrap_or_else(|| panic!("no detail: {json}"));
        (self.status.as_u16(), detail.to_owned())
    }
}

impl TestClient {
    pub fn http1() -> Self {
        Self {
            inner: Client::builder(TokioExecutor::new()).build_http(),
        }
    }

    pub fn h2c() -> Self {
        Self {
            inner: Client::builder(TokioExecutor::new())
                .http2_only(true)
                .build_http(),
        }
    }

    /// Sends `request` and reads the whole answer.
    pub async fn send(&self, request: Request<ClientBody>) -> Answer {
        let response = self.inner.request(request).await.expect("request failed");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("read body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    /// GET `url`, or why no answer came.
    pub async fn try_get(&self, url: &str) -> Result<StatusCode, String> {
        let request = Request::get(url).body(empty()).map_err(|e| e.to_string())?;
        let response = tokio::time::timeout(Duration::from_secs(5), self.inner.request(request))
            .await
            .map_err(|_| "no answer within 5 s".to_owned())?
            .map_err(|e| e.to_string())?;
        Ok(response.status())
    }

    /// GET `url` with extra headers.
    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Answer {
        let mut builder = Request::get(url);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        self.send(builder.body(empty()).expect("request")).await
    }
}

/// One HTTP/1.1 connection to `addr`, for requests whose bodies the
/// pooled client's single body type does not cover.
pub async fn http1_connection<B>(addr: SocketAddr) -> hyper::client::conn::http1::SendRequest<B>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(connection);
    sender
}

/// What one read of a raw connection brings back, within 5 s.
pub async fn first_answer(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer, not silence")
        .expect("read");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

pub fn empty() -> ClientBody {
    http_body_util::Either::Left(Full::new(Bytes::new()))
}

pub fn text_body(s: &str) -> ClientBody {
    http_body_util::Either::Left(Full::new(Bytes::from(s.to_owned())))
}

// === floodgate as a separate process ===

/// The real `floodgate` binary, started on a configuration file.
pub struct FloodgateProcess {
    child: std::process::Child,
    pub port: u16,
}

impl FloodgateProcess {
    /// Starts the binary on `config` and waits until `port` answers.
    pub async fn spawn(config: &Path, port: u16) -> Self {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"));
        command.stderr(std::process::Stdio::null());
        Self::start(command, config, port).await
    }

    /// The same, started with a soft limit of 1 024 open files and a hard
    /// limit of `files`, as many systems start services.
    pub async fn spawn_with_open_files(config: &Path, port: u16, files: u64) -> Self {
        Self::spawn_limited(config, port, 1_024.min(files), files, None).await
    }

    /// The same with `soft` and `hard` limits on open files, its log (at
    /// info) written to `log` if given.
    pub async fn spawn_limited(
        config: &Path,
        port: u16,
        soft: u64,
        hard: u64,
        log: Option<&Path>,
    ) -> Self {
        let redirect = log.map_or_else(
            || " 2>/dev/null".to_owned(),
            |l| format!(" 2>'{}'", l.display()),
        );
        let mut command = std::process::Command::new("sh");
        command.args([
            "-c",
            &format!("ulimit -Sn {soft} && ulimit -Hn {hard} && exec \"$0\" \"$@\"{redirect}"),
            env!("CARGO_BIN_EXE_floodgate"),
        ]);
        Self::start(command, config, port).await
    }

    /// The same with `env` set, `args` added and its log written to `log`.
    pub async fn spawn_logging(
        config: &Path,
        port: u16,
        env: &[(&str, &str)],
        args: &[&str],
        log: &Path,
    ) -> Self {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"));
        command
            .envs(env.iter().copied())
            .args(args)
            .stderr(std::fs::File::create(log).expect("create the log file"));
        Self::start(command, config, port).await
    }

    /// The same, pinned to one CPU with `taskset`.
    pub async fn spawn_on_one_cpu(config: &Path, port: u16) -> Self {
        let mut command = std::process::Command::new("taskset");
        command
            .args(["-c", "0", env!("CARGO_BIN_EXE_floodgate")])
            .stderr(std::process::Stdio::null());
        Self::start(command, config, port).await
    }

    async fn start(mut command: std::process::Command, config: &Path, port: u16) -> Self {
        let child = command
            .arg("--config")
            .arg(config)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start floodgate");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "floodgate did not start listening"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Self { child, port }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal such as `-HUP` or `-TERM`.
    pub fn signal(&self, which: &str) {
        let ok = std::process::Command::new("kill")
            .args([which, &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {which} failed");
    }

    /// Waits for the process to exit and returns its exit code.
    pub async fn exit_code(&mut self) -> Option<i32> {
        let deadline = std::time::Instant::now() + Duration::from_secs(15);
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status.code();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "floodgate did not exit"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for FloodgateProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port that was free a moment ago and that no other caller in this
/// test process got, for servers a test starts as separate processes.
///
/// It is taken from below the kernel's ephemeral range
/// (`ip_local_port_range`): the ports of outgoing connections, and of
/// listeners bound to port 0, come from that range, so a test opening
/// thousands of connections cannot take the port between this check and
/// the server's bind.
pub fn free_port() -> u16 {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32_768);
    let (low, high) = (10_000u16, ephemeral_low.max(10_001));
    let span = u32::from(high - low);
    // Each test process starts at its own place in the range.
    let seed = std::process::id().wrapping_mul(2_654_435_761)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let start = seed % span;
    for i in 0..span {
        let port = low + u16::try_from((start + i * 7_919) % span).unwrap_or(0);
        if given.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            given.insert(port);
            return port;
        }
    }
    panic!("no free port below the ephemeral range");
}

/// A fresh temporary directory for a test's files.
pub fn temp_dir(test: &str) -> std::path::PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "floodgate-{test}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}
