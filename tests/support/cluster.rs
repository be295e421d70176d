//! A real Redis Cluster for tests: six `redis-server` processes in cluster
//! mode on free ports (three primaries, three replicas), joined with
//! `redis-cli --cluster create`, all killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::redis::answers_as_itself;
use super::{free_port, temp_dir};

pub struct TestCluster {
    nodes: Vec<(u16, Option<Child>)>,
    dir: PathBuf,
}

impl TestCluster {
    /// Starts and joins a cluster whose nodes declare a peer failed after
    /// 5 s without an answer: no failover unless a test kills a node and
    /// waits, however slow the machine.
    pub async fn start() -> Self {
        Self::start_with(Duration::from_secs(5)).await
    }

    /// Starts and joins the cluster, with `node_timeout` as the nodes'
    /// `cluster-node-timeout`; waits until it serves every slot.
    pub async fn start_with(node_timeout: Duration) -> Self {
        Self::start_nodes(node_timeout, true).await
    }

    /// Starts and joins a cluster whose primaries keep serving their own
    /// slots while another primary is down (`cluster-require-full-coverage
    /// no`, as docs/deployment.md advises), with `node_timeout` as above.
    pub async fn start_partial(node_timeout: Duration) -> Self {
        Self::start_nodes(node_timeout, false).await
    }

    async fn start_nodes(node_timeout: Duration, full_coverage: bool) -> Self {
        let dir = temp_dir("cluster");
        let mut nodes = Vec::new();
        for _ in 0..6 {
            let (port, child) = start_node(&dir, node_timeout, full_coverage).await;
            nodes.push((port, Some(child)));
        }
        let cluster = Self { nodes, dir };
        let addresses: Vec<String> = cluster
            .nodes
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("redis-cli --cluster create");
        assert!(created.success(), "redis-cli --cluster create failed");
        cluster.wait_until_healthy().await;
        cluster
    }

    /// Seed URLs for floodgate's `urls`.
    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|(p, _)| format!("redis://127.0.0.1:{p}"))
            .collect()
    }

    /// `redis-cli -p port args…`, its output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, args)
    }

    async fn wait_for(&self, port: u16, ready: impl Fn(&str) -> bool, args: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ready(&self.cli(port, args)) {
            assert!(
                Instant::now() < deadline,
                "node {port} never got ready for {args:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the live nodes agree the cluster serves every slot.
    pub async fn wait_until_healthy(&self) {
        for &(port, ref child) in &self.nodes {
            if child.is_some() {
                self.wait_for(
                    port,
                    |out| out.contains("cluster_state:ok"),
                    &["CLUSTER", "INFO"],
                )
                .await;
            }
        }
    }

    /// Ports of the live primaries.
    pub fn primaries(&self) -> Vec<u16> {
        self.nodes
            .iter()
            .filter(|(_, child)| child.is_some())
            .map(|&(port, _)| port)
            .filter(|&port| self.cli(port, &["ROLE"]).starts_with("master"))
            .collect()
    }

    /// Keys on the node at `port`.
    pub fn keys_on(&self, port: u16) -> usize {
        self.cli(port, &["DBSIZE"]).trim().parse().unwrap_or(0)
    }

    /// The node id of the node at `port`.
    pub fn node_id(&self, port: u16) -> String {
        self.cli(port, &["CLUSTER", "MYID"]).trim().to_owned()
    }

    /// The keys on the node at `port` that match `pattern`.
    pub fn keys(&self, port: u16, pattern: &str) -> Vec<String> {
        self.cli(port, &["KEYS", pattern])
            .lines()
            .filter(|line| !line.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The port of the primary serving each key's slot, as `CLUSTER NODES`
    /// on a live primary tells.
    pub fn primaries_of(&self, keys: &[String]) -> Vec<u16> {
        let table: Vec<(u16, Vec<(u16, u16)>)> = self
            .cli(self.primaries()[0], &["CLUSTER", "NODES"])
            .lines()
            .map(|line| line.split(' ').collect::<Vec<_>>())
            .filter(|f| f.len() > 8 && f[2].contains("master") && !f[2].contains("fail"))
            .filter_map(|f| {
                let port = f[1]
                    .split(['@', ','])
                    .next()?
                    .rsplit(':')
                    .next()?
                    .parse()
                    .ok()?;
                let ranges = f[8..]
                    .iter()
                    .filter_map(|range| {
                        let (from, to) = range.split_once('-').unwrap_or((range, range));
                        Some((from.parse().ok()?, to.parse().ok()?))
                    })
                    .collect();
                Some((port, ranges))
            })
            .collect();
        keys.iter()
            .map(|key| {
                let slot = slot_of(key);
                table
                    .iter()
                    .find(|(_, ranges)| ranges.iter().any(|&(a, b)| (a..=b).contains(&slot)))
                    .map(|&(port, _)| port)
                    .unwrap_or_else(|| panic!("no primary serves slot {slot} of {key}"))
            })
            .collect()
    }

    /// The port of the live replica of the primary at `port`.
    pub fn replica_of(&self, port: u16) -> u16 {
        self.nodes
            .iter()
            .filter(|(p, child)| child.is_some() && *p != port)
            .map(|&(p, _)| p)
            .find(|&p| {
                let role = self.cli(p, &["ROLE"]);
                let mut lines = role.lines();
                lines.next() == Some("slave") && lines.nth(1) == Some(port.to_string().as_str())
            })
            .unwrap_or_else(|| panic!("no replica of the primary at {port}"))
    }

    /// SIGSTOPs the node at `port`: it keeps its connections and answers
    /// nothing, as a node on a stalled host does.
    pub fn freeze(&self, port: u16) {
        self.signal(port, "-STOP");
    }

    /// SIGCONTs the node at `port`.
    pub fn thaw(&self, port: u16) {
        self.signal(port, "-CONT");
    }

    fn signal(&self, port: u16, which: &str) {
        let pid = self
            .nodes
            .iter()
            .find(|(p, _)| *p == port)
            .and_then(|(_, child)| child.as_ref())
            .map(Child::id)
            .expect("a live node at that port");
        let sent = Command::new("kill")
            .args([which, &pid.to_string()])
            .status()
            .expect("kill");
        assert!(sent.success(), "kill {which} {pid}");
    }

    /// SIGKILLs the node at `port`.
    pub fn kill(&mut self, port: u16) {
        for (p, child) in &mut self.nodes {
            if *p == port
                && let Some(mut c) = child.take()
            {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// The cluster slot of `key`: CRC16 (XMODEM) of its hash tag, or of the
/// whole key when it has none, modulo 16384.
pub fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|&b| b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    let mut crc: u16 = 0;
    for &b in hashed {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// `redis-cli -p port args…`, its output.
fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .expect("redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Starts one cluster node in `dir` and returns its port once the node
/// answers there as itself (by process id). Another process may take a
/// free port before the node binds it, and the node then exits: it is
/// started again on other ports.
async fn start_node(dir: &Path, node_timeout: Duration, full_coverage: bool) -> (u16, Child) {
    for _ in 0..5 {
        let port = free_port();
        // The bus port is chosen too: by default it is the port plus 10000,
        // which may be taken, or above 65535 (the node exits).
        let bus_port = free_port();
        let mut child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--cluster-enabled", "yes"])
            .args(["--cluster-port", &bus_port.to_string()])
            .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
            .args([
                "--cluster-node-timeout",
                &node_timeout.as_millis().to_string(),
            ])
            // Fail over whatever the replica's data age: a test may kill a
            // primary moments after the replicas first synced.
            .args(["--cluster-replica-validity-factor", "0"])
            .args([
                "--cluster-require-full-coverage",
                if full_coverage { "yes" } else { "no" },
            ])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (cluster mode)");
        if answers_as_itself(&mut child, port).await {
            return (port, child);
        }
    }
    panic!("no cluster node started in 5 tries on free ports");
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        for (_, child) in &mut self.nodes {
            if let Some(c) = child {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
