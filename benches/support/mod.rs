//! What the benches share: a Redis to measure against.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A Redis for a bench run: `REDIS_URL` if set, else a `redis-server` from
/// PATH on a free port, stopped when this is dropped.
pub struct BenchRedis {
    pub url: String,
    child: Option<Child>,
}

impl BenchRedis {
    /// `None` when there is neither `REDIS_URL` nor a `redis-server` to start.
    pub fn start() -> Option<Self> {
        if let Ok(url) = std::env::var("REDIS_URL") {
            return Some(Self { url, child: None });
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .ok()?
            .port();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .ok()?;
        std::thread::sleep(Duration::from_millis(300));
        Some(Self {
            url: format!("redis://127.0.0.1:{port}"),
            child: Some(child),
        })
    }
}

impl Drop for BenchRedis {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
