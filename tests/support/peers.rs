//! Real protocol peers written in Python: a gRPC server and client
//! (grpcio), a WebSocket server and client (websockets) and the official
//! OpenAI SDK as a client (openai), from `tests/peers/`. `test.sh`
//! installs the libraries.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/peers")
        .join(name)
}

/// A peer server, stopped when dropped.
pub struct PeerServer {
    child: Child,
    /// Closed on drop, which tells the server to stop.
    stdin: Option<ChildStdin>,
    pub port: u16,
}

impl PeerServer {
    /// Starts `script server` and reads the port it prints.
    pub fn start(name: &str) -> Self {
        let mut child = Command::new("python3")
            .arg(script(name))
            .arg("server")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("python3 {name}: {e}"));
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout");
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read the port");
        let port = line.trim().parse().unwrap_or_else(|_| {
            panic!("{name} printed {line:?}, not a port (is its Python library installed? .ci/run installs it)")
        });
        Self { child, stdin, port }
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `script args…` as a client and returns the JSON lines it printed.
pub async fn client(name: &str, args: &[String]) -> Vec<serde_json::Value> {
    let mut command = tokio::process::Command::new("python3");
    command.arg(script(name)).args(args);
    let output = command.output().await.expect("run the peer client");
    assert!(
        output.status.success(),
        "{name} {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{name} printed {line:?}: {e}"))
        })
        .collect()
}

/// Calls of Envoy's rate limit service on the domain `edge`, as the
/// descriptor tests write them.
pub mod edge {
    use serde_json::{Value, json};

    /// A descriptor of one entry: `user` = `name`.
    pub fn user(name: &str) -> Value {
        json!({ "entries": [["user", name]] })
    }

    /// A descriptor fixed to `generic_key=api`, then `org` = `name`.
    pub fn org(name: &str) -> Value {
        json!({ "entries": [["generic_key", "api"], ["org", name]] })
    }

    /// A call of one hit with `descriptors`.
    pub fn call(descriptors: &[Value]) -> Value {
        json!({ "domain": "edge", "descriptors": descriptors })
    }
}
