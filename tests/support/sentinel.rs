//! A Sentinel-monitored Redis for tests: a primary, one replica and three
//! Sentinels (quorum 2) on free ports, all killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, temp_dir};

pub const MASTER: &str = "floodgate-test";

pub struct TestSentinels {
    pub primary: u16,
    sentinels: Vec<u16>,
    children: Vec<(u16, Child)>,
    dir: PathBuf,
}

fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

async fn wait_for(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(40);
    while !ready() {
        assert!(Instant::now() < deadline, "{what} never happened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts `redis-server` with `args` in `dir`, quiet.
fn spawn_in(dir: &Path, args: Vec<String>) -> Child {
    Command::new("redis-server")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server")
}

/// A throwaway Redis node on `port`: loopback only, nothing saved.
fn node_args(port: u16) -> Vec<String> {
    vec![
        "--port".to_owned(),
        port.to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--save".into(),
        String::new(),
        "--appendonly".into(),
        "no".into(),
    ]
}

/// Writes the config of a Sentinel on `port` watching `primary` (quorum 2,
/// quick to call it down) and returns its path.
fn write_sentinel_config(dir: &Path, port: u16, primary: u16) -> PathBuf {
    let file = dir.join(format!("sentinel-{port}.conf"));
    std::fs::write(
        &file,
        format!(
            "port {port}\nbind 127.0.0.1\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n\
             sentinel down-after-milliseconds {MASTER} 1000\n\
             sentinel failover-timeout {MASTER} 3000\n"
        ),
    )
    .expect("write sentinel config");
    file
}

impl TestSentinels {
    pub async fn start() -> Self {
        let dir = temp_dir("sentinel");
        // Five distinct ports (free_port never repeats one).
        let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
        let (primary, replica) = (ports[0], ports[1]);
        let mut children = Vec::new();
        children.push((primary, spawn_in(&dir, node_args(primary))));
        let mut replica_args = node_args(replica);
        replica_args.extend([
            "--replicaof".into(),
            "127.0.0.1".into(),
            primary.to_string(),
        ]);
        children.push((replica, spawn_in(&dir, replica_args)));
        let mut sentinels = Vec::new();
        for &port in &ports[2..] {
            let file = write_sentinel_config(&dir, port, primary);
            children.push((
                port,
                spawn_in(&dir, vec![file.display().to_string(), "--sentinel".into()]),
            ));
            sentinels.push(port);
        }
        let group = Self {
            primary,
            sentinels,
            children,
            dir,
        };
        group.wait_until_settled(replica).await;
        group
    }

    /// Waits until the replica follows the primary and every Sentinel knows
    /// the replica and the other two Sentinels, so a failover can happen.
    async fn wait_until_settled(&self, replica: u16) {
        wait_for("replication", || {
            cli(replica, &["INFO", "replication"]).contains("master_link_status:up")
        })
        .await;
        for &s in &self.sentinels {
            wait_for("sentinels finding each other and the replica", || {
                let info = cli(s, &["SENTINEL", "MASTER", MASTER]);
                let lines: Vec<&str> = info.lines().collect();
                let field = |name: &str| {
                    lines
                        .iter()
                        .position(|l| *l == name)
                        .and_then(|i| lines.get(i + 1))
                        .and_then(|v| v.parse::<u32>().ok())
                        .unwrap_or(0)
                };
                field("num-slaves") >= 1 && field("num-other-sentinels") >= 2
            })
            .await;
        }
    }

    /// Sentinel URLs for floodgate's `urls`.
    pub fn urls(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|p| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// The port the Sentinels name as primary now.
    pub fn current_primary(&self) -> Option<u16> {
        let out = cli(
            self.sentinels[0],
            &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER],
        );
        out.lines().nth(1).and_then(|p| p.trim().parse().ok())
    }

    /// SIGKILLs the primary and waits until the Sentinels promoted another.
    pub async fn kill_primary(&mut self) -> u16 {
        let old = self.primary;
        if let Some(i) = self.children.iter().position(|(p, _)| *p == old) {
            let (_, mut child) = self.children.remove(i);
            let _ = child.kill();
            let _ = child.wait();
        }
        old
    }

    /// Waits until the Sentinels name a new primary that says it is one.
    pub async fn wait_for_new_primary(&mut self, old: u16) {
        wait_for("failover", || {
            self.current_primary()
                .is_some_and(|p| p != old && cli(p, &["ROLE"]).starts_with("master"))
        })
        .await;
        self.primary = self.current_primary().unwrap_or(old);
    }
}

impl Drop for TestSentinels {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
