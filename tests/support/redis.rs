//! A Redis for tests, found in this order: `REDIS_URL` if set; else a
//! container through testcontainers when a Docker daemon answers and has
//! the `redis:7.2` image (nothing is pulled: a host without a registry
//! would fail at once); else a `redis-server` from `PATH`, started on a
//! free port and killed on drop.
//! Tests never talk to a Redis they did not start or were not given, and
//! each uses its own key prefix so they can share one.

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use testcontainers_modules::redis::Redis;
use testcontainers_modules::testcontainers::runners::AsyncRunner;
use testcontainers_modules::testcontainers::{ContainerAsync, ImageExt};

use super::free_port;

pub struct TestRedis {
    pub url: String,
    origin: Origin,
}

enum Origin {
    Given,
    Container(Box<ContainerAsync<Redis>>),
    Process { child: Child, port: u16 },
}

impl TestRedis {
    /// The Redis this test run should use.
    pub async fn start() -> Self {
        if let Ok(url) = std::env::var("REDIS_URL") {
            return Self {
                url,
                origin: Origin::Given,
            };
        }
        Self::start_private().await
    }

    /// A Redis of this test's own (container or process), for tests that
    /// read server-wide statistics; `REDIS_URL` only when neither is possible.
    pub async fn start_private() -> Self {
        // CI's container job runs the store tests through testcontainers
        // and says so: then a Redis of another origin is a failure.
        let container_wanted =
            std::env::var("FLOODGATE_TEST_REDIS_FROM").as_deref() == Ok("container");
        assert!(
            !container_wanted || docker_has_redis(),
            "FLOODGATE_TEST_REDIS_FROM=container, but no Docker daemon answers with the {IMAGE} image"
        );
        if docker_has_redis() {
            let container = Redis::default()
                .with_tag("7.2")
                .start()
                .await
                .expect("start a Redis container");
            let port = container
                .get_host_port_ipv4(6379)
                .await
                .expect("container port");
            let url = format!("redis://127.0.0.1:{port}");
            wait_until_ready(&url).await;
            return Self {
                url,
                origin: Origin::Container(Box::new(container)),
            };
        }
        if which_redis_server() {
            return Self::spawn_on_a_free_port(&[]).await;
        }
        match std::env::var("REDIS_URL") {
            Ok(url) => Self {
                url,
                origin: Origin::Given,
            },
            Err(_) => panic!(
                "no Redis for the tests: set REDIS_URL, start a Docker daemon, or install redis-server"
            ),
        }
    }

    /// A `redis-server` process of this test's own, for tests that kill,
    /// pause or restart it.
    pub async fn start_process() -> Self {
        assert!(
            which_redis_server(),
            "this test stops and restarts Redis: it needs redis-server on PATH"
        );
        Self::spawn_on_a_free_port(&[]).await
    }

    /// A `redis-server` process of this test's own, started with `extra`
    /// configuration arguments.
    pub async fn start_process_with(extra: &[&str]) -> Self {
        assert!(
            which_redis_server(),
            "this test configures Redis itself: it needs redis-server on PATH"
        );
        Self::spawn_on_a_free_port(extra).await
    }

    /// A `redis-server` on a free port; on another if a process took that
    /// one before Redis could bind it.
    async fn spawn_on_a_free_port(extra: &[&str]) -> Self {
        for _ in 0..5 {
            if let Some(redis) = Self::try_spawn(free_port(), extra).await {
                return redis;
            }
        }
        panic!("redis-server found no free port in 5 tries");
    }

    async fn spawn(port: u16, extra: &[&str]) -> Self {
        Self::try_spawn(port, extra)
            .await
            .unwrap_or_else(|| panic!("redis-server could not listen on port {port}"))
    }

    /// Starts `redis-server` on `port` and waits until it answers there as
    /// itself (by process id), so a test never talks to another process's
    /// Redis; `None` if it exited (the port was taken).
    async fn try_spawn(port: u16, extra: &[&str]) -> Option<Self> {
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        if !answers_as_itself(&mut child, port).await {
            return None;
        }
        Some(Self {
            url: format!("redis://127.0.0.1:{port}"),
            origin: Origin::Process { child, port },
        })
    }

    /// The address this Redis listens on.
    pub async fn addr(&self) -> std::net::SocketAddr {
        let authority = self.authority();
        let host_port = authority.rsplit('@').next().unwrap_or(authority);
        tokio::net::lookup_host(host_port)
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .unwrap_or_else(|| panic!("cannot resolve {host_port} of {}", self.url))
    }

    /// This Redis's URL with `addr` in place of its host and port (its
    /// user, password and database kept), for a relay in between.
    pub fn url_via(&self, addr: std::net::SocketAddr) -> String {
        let authority = self.authority();
        let host_port = authority.rsplit('@').next().unwrap_or(authority);
        let user = &authority[..authority.len() - host_port.len()];
        self.url.replacen(authority, &format!("{user}{addr}"), 1)
    }

    /// What follows `redis://` up to the path.
    fn authority(&self) -> &str {
        let rest = self
            .url
            .split_once("://")
            .map_or(self.url.as_str(), |(_, rest)| rest);
        rest.split('/').next().unwrap_or(rest)
    }

    /// A connection for inspecting what floodgate wrote.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("redis url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to test redis")
    }

    /// The keys matching `pattern` (`KEYS`: tests only).
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        redis::cmd("KEYS")
            .arg(pattern)
            .query_async(&mut self.connection().await)
            .await
            .expect("keys")
    }

    /// The units logged in each sliding-log key matching `pattern` (one
    /// member per unit), in ascending order.
    pub async fn logged_each(&self, pattern: &str) -> Vec<u64> {
        let mut conn = self.connection().await;
        let mut out = Vec::new();
        for key in self.keys(pattern).await {
            let n: u64 = redis::cmd("ZCARD")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .expect("ZCARD");
            out.push(n);
        }
        out.sort_unstable();
        out
    }

    /// The units logged in all sliding-log keys matching `pattern`.
    pub async fn logged(&self, pattern: &str) -> u64 {
        self.logged_each(pattern).await.iter().sum()
    }

    /// Stops this Redis for good (SIGKILL).
    pub fn kill(&mut self) {
        if let Origin::Process { child, .. } = &mut self.origin {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts a fresh, empty Redis on the same port after [`kill`].
    pub async fn restart(&mut self) {
        if let Origin::Process { port, .. } = self.origin {
            self.kill();
            *self = Self::spawn(port, &[]).await;
        }
    }

    /// Freezes this Redis (SIGSTOP): connections stay open, nothing answers.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// Thaws it (SIGCONT).
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    fn signal(&self, which: &str) {
        let pid = self.pid().expect("a redis-server process of the harness");
        let ok = Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill {which} {pid} failed");
    }

    /// The redis-server process id, when the harness started one.
    pub fn pid(&self) -> Option<u32> {
        match &self.origin {
            Origin::Process { child, .. } => Some(child.id()),
            _ => None,
        }
    }
}

impl Drop for TestRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A key prefix no other test uses.
pub fn unique_prefix(test: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("t-{test}-{}-{n}-{nanos}", std::process::id())
}

fn which_redis_server() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The image the container tests run.
const IMAGE: &str = "redis:7.2";

/// Whether a Docker daemon answers and holds [`IMAGE`], asked once per
/// test binary.
fn docker_has_redis() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        docker_answers()
            && Command::new("docker")
                .args(["image", "inspect", IMAGE])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    })
}

fn docker_answers() -> bool {
    let socket_present = std::env::var_os("DOCKER_HOST").is_some()
        || std::os::unix::net::UnixStream::connect("/var/run/docker.sock").is_ok();
    socket_present
        && Command::new("docker")
            .args(["info", "--format", "{{.ID}}"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

async fn wait_until_ready(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = redis::Client::open(url).expect("redis url");
    loop {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
            if pong.is_ok() {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "Redis at {url} did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the `redis-server` `child` answers on `port` as itself (by
/// process id), so a test never talks to another process's Redis; false
/// if it exited first (another process had taken one of its ports).
pub async fn answers_as_itself(child: &mut Child, port: u16) -> bool {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("redis url");
    let itself = format!("process_id:{}\r", child.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut conn) = client.get_multiplexed_async_connection().await {
            let info: redis::RedisResult<String> = redis::cmd("INFO")
                .arg("server")
                .query_async(&mut conn)
                .await;
            if info.is_ok_and(|info| info.contains(&itself)) {
                return true;
            }
        }
        if child.try_wait().expect("poll redis-server").is_some() {
            return false;
        }
        assert!(
            Instant::now() < deadline,
            "redis-server on port {port} did not become ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Calls of `command` so far, from `INFO commandstats` text.
pub fn command_calls(info: &str, command: &str) -> u64 {
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Decision commands in `INFO commandstats`: `FCALL` where Redis runs
/// functions, `EVALSHA` where it does not.
pub fn decision_calls(info: &str) -> u64 {
    command_calls(info, "fcall") + command_calls(info, "evalsha")
}

/// Whether this Redis runs function libraries (Redis 7 and later).
pub async fn has_functions(conn: &mut redis::aio::MultiplexedConnection) -> bool {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .expect("INFO server");
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .and_then(|v| v.split('.').next())
        .and_then(|major| major.trim().parse::<u32>().ok())
        .is_some_and(|major| major >= 7)
}

/// Zeroes `INFO commandstats`.
pub async fn reset_command_stats(conn: &mut redis::aio::MultiplexedConnection) {
    let _: () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(conn)
        .await
        .expect("CONFIG RESETSTAT");
}

/// The `INFO commandstats` text.
pub async fn command_stats(conn: &mut redis::aio::MultiplexedConnection) -> String {
    redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("INFO commandstats")
}
