//! A Redis Cluster as floodgate routes it: the slot table read with
//! `CLUSTER SLOTS`, and per primary one multiplexed connection and one
//! circuit breaker, so that a lost or frozen primary costs only its own
//! slots.
//!
//! redis-rs's cluster client holds every command while it rebuilds its view
//! of the cluster (a node stopped answering, a slot moved), so one frozen
//! primary used to stall the decisions bound for all of them, and one
//! breaker for the whole cluster refused them too. Here a decision goes to
//! its slot's primary on that node's own connection, and is sent on where
//! the cluster says (see [`super::redirections`]). The table is read
//! again in the background, never holding a decision: after a redirection,
//! after a node fails, and on every recovery tick while some node's breaker
//! is open, so decisions follow a promoted replica soon after it serves.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ConnectionAddr, ConnectionInfo, RedisError, Value};

use super::connections::store_error;
use super::slot::SLOTS;
use crate::clock::now_ms;
use crate::limit::StoreError;
use crate::limit::breaker::{self, Breaker};

/// No primary is known for the slot.
const NOBODY: u16 = u16::MAX;

/// Reads of the slot table start at most this often (ms), however many
/// decisions ask for one.
const REFRESH_EVERY_MS: u64 = 100;

/// Where decisions go: one Redis (or the primary the Sentinels name), or
/// one primary of a cluster. Each has its own circuit breaker.
#[derive(Debug)]
pub struct Node {
    /// `host:port` as the cluster names the node, or the store's endpoint
    /// for one Redis: the label of its breaker's metric and log lines.
    pub addr: String,
    /// Opens on this node's own failures in a row.
    pub breaker: Breaker,
    /// How to connect (cluster nodes only; one Redis uses the store's pool).
    info: Option<ConnectionInfo>,
    conn: ArcSwapOption<MultiplexedConnection>,
    connecting: tokio::sync::Mutex<()>,
}

impl Node {
    /// The one node of a store that is not a cluster.
    pub(super) fn single(name: String) -> Self {
        Self::new(name, None)
    }

    fn new(addr: String, info: Option<ConnectionInfo>) -> Self {
        Self {
            addr,
            breaker: Breaker::new(breaker::DEFAULT_THRESHOLD, breaker::DEFAULT_COOLDOWN_MS),
            info,
            conn: ArcSwapOption::empty(),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// This node's connection, made on first use (one attempt at a time).
    pub(super) async fn connection(
        &self,
        config: &AsyncConnectionConfig,
    ) -> Result<MultiplexedConnection, RedisError> {
        if let Some(conn) = self.conn.load_full() {
            return Ok((*conn).clone());
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(conn) = self.conn.load_full() {
            return Ok((*conn).clone());
        }
        let Some(info) = self.info.clone() else {
            return Err(RedisError::from((
                redis::ErrorKind::Client,
                "not a cluster node",
            )));
        };
        let conn = redis::Client::open(info)?
            .get_multiplexed_async_connection_with_config(config)
            .await?;
        self.conn.store(Some(Arc::new(conn.clone())));
        Ok(conn)
    }

    /// Drops this node's connection; the next decision makes a new one. A
    /// frozen node's connection holds every command sent on it, to run them
    /// all when the node wakes: better forgotten.
    pub(super) fn retire(&self) {
        self.conn.store(None);
    }
}

/// Which primary holds each slot.
struct Table {
    /// Index into `nodes` per slot, or `NOBODY`.
    owner: Box<[u16]>,
    nodes: Vec<Arc<Node>>,
}

impl Table {
    fn empty() -> Self {
        Self {
            owner: vec![NOBODY; SLOTS].into_boxed_slice(),
            nodes: Vec::new(),
        }
    }

    fn node(&self, slot: u16) -> Option<&Arc<Node>> {
        let at = *self.owner.get(usize::from(slot))?;
        self.nodes.get(usize::from(at))
    }
}

/// A cluster's slot table and its primaries.
pub(super) struct Cluster {
    /// The seed nodes, as configured: where the table is read when no
    /// known node answers.
    seeds: Vec<ConnectionInfo>,
    pub(super) config: AsyncConnectionConfig,
    table: ArcSwap<Table>,
    /// Every primary of the current table, by address: a node keeps its
    /// breaker and connection when a new table still names it.
    known: Mutex<HashMap<String, Arc<Node>>>,
    refreshing: AtomicBool,
    last_refresh: AtomicU64,
    /// How long one read of the table may take from one node.
    ask_timeout: Duration,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("nodes", &self.nodes().len())
            .finish_non_exhaustive()
    }
}

impl Cluster {
    pub(super) fn new(
        seeds: Vec<ConnectionInfo>,
        config: AsyncConnectionConfig,
        ask_timeout: Duration,
    ) -> Self {
        Self {
            seeds,
            config,
            table: ArcSwap::from_pointee(Table::empty()),
            known: Mutex::new(HashMap::new()),
            refreshing: AtomicBool::new(false),
            last_refresh: AtomicU64::new(0),
            ask_timeout,
        }
    }

    /// The primary holding `slot`, if the table names one.
    pub(super) fn node(&self, slot: u16) -> Option<Arc<Node>> {
        self.table.load().node(slot).cloned()
    }

    /// The primaries of the current table.
    pub(super) fn nodes(&self) -> Vec<Arc<Node>> {
        self.table.load().nodes.clone()
    }

    /// Each primary of the current table by address, with how to reach
    /// it (a subscription on every primary: see `super::given_back`).
    pub(super) fn primaries(&self) -> Vec<(String, ConnectionInfo)> {
        self.nodes()
            .iter()
            .filter_map(|n| Some((n.addr.clone(), self.info_for(&n.addr)?)))
            .collect()
    }

    /// Whether the current table names `addr` as the owner of `slot`.
    pub(super) fn owns(&self, addr: &str, slot: u16) -> bool {
        self.node(slot).is_some_and(|n| n.addr == addr)
    }

    /// The node at `addr` (`host:port`): a known one, or a new one.
    fn node_at(&self, addr: &str) -> Option<Arc<Node>> {
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(node) = known.get(addr) {
            return Some(Arc::clone(node));
        }
        let info = self.info_for(addr)?;
        let node = Arc::new(Node::new(addr.to_owned(), Some(info)));
        known.insert(addr.to_owned(), Arc::clone(&node));
        Some(node)
    }

    /// How to reach `addr` (`host:port`): the first seed's settings (TLS,
    /// credentials, protocol) with that address.
    fn info_for(&self, addr: &str) -> Option<ConnectionInfo> {
        let (host, port) = addr.rsplit_once(':')?;
        let port: u16 = port.parse().ok()?;
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let template = self.seeds.first()?;
        let addr = match template.addr() {
            ConnectionAddr::TcpTls {
                insecure,
                tls_params,
                ..
            } => ConnectionAddr::TcpTls {
                host,
                port,
                insecure: *insecure,
                tls_params: tls_params.clone(),
            },
            _ => ConnectionAddr::Tcp(host, port),
        };
        Some(template.clone().set_addr(addr))
    }

    /// `MOVED slot addr`: the slot's owner is `addr` now. Moves it in the
    /// table at once (the decisions that follow go there) and returns the
    /// node; a full read of the table follows in the background.
    pub(super) fn moved(&self, slot: u16, addr: &str) -> Option<Arc<Node>> {
        let node = self.node_at(addr)?;
        let table = self.table.load();
        let mut nodes = table.nodes.clone();
        let at = match nodes.iter().position(|n| Arc::ptr_eq(n, &node)) {
            Some(at) => at,
            None => {
                nodes.push(Arc::clone(&node));
                nodes.len() - 1
            }
        };
        let mut owner = table.owner.clone();
        if let (Some(entry), Ok(at)) = (owner.get_mut(usize::from(slot)), u16::try_from(at)) {
            *entry = at;
        }
        self.table.store(Arc::new(Table { owner, nodes }));
        Some(node)
    }

    /// The node named by an `ASK` redirection.
    pub(super) fn asked(&self, addr: &str) -> Option<Arc<Node>> {
        self.node_at(addr)
    }

    /// Reads the slot table again in the background, unless a read is
    /// under way or one started less than `REFRESH_EVERY_MS` ago.
    pub(super) fn refresh_soon(self: &Arc<Self>) {
        let now = now_ms();
        let last = self.last_refresh.load(Ordering::Relaxed);
        if now.saturating_sub(last) < REFRESH_EVERY_MS
            || self.refreshing.swap(true, Ordering::AcqRel)
        {
            return;
        }
        self.last_refresh.store(now, Ordering::Relaxed);
        let cluster = Arc::clone(self);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.refreshing.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(async move {
            let _ = cluster.refresh().await;
            cluster.refreshing.store(false, Ordering::Release);
        });
    }

    /// Reads the slot table from the first node that answers: primaries
    /// whose breaker is closed first, then the others, then the seeds.
    pub(super) async fn refresh(&self) -> Result<(), StoreError> {
        let mut asked: Vec<Arc<Node>> = self.nodes();
        asked.sort_by_key(|n| n.breaker.is_open());
        let seeds = self
            .seeds
            .iter()
            .map(|info| Arc::new(Node::new(info.addr().to_string(), Some(info.clone()))));
        let mut last_error = StoreError::Backend("no seed node".to_owned());
        for node in asked.into_iter().chain(seeds) {
            let read = async {
                let mut conn = node.connection(&self.config).await?;
                redis::cmd("CLUSTER")
                    .arg("SLOTS")
                    .query_async::<Value>(&mut conn)
                    .await
            };
            let reply = match tokio::time::timeout(self.ask_timeout, read).await {
                Ok(Ok(reply)) => reply,
                Ok(Err(e)) => {
                    last_error = store_error(&e, &node.addr);
                    continue;
                }
                Err(_) => {
                    last_error = StoreError::Backend(format!(
                        "{}: no answer in {:?}",
                        node.addr, self.ask_timeout
                    ));
                    continue;
                }
            };
            let host = match node.info.as_ref().map(ConnectionInfo::addr) {
                Some(ConnectionAddr::Tcp(host, _) | ConnectionAddr::TcpTls { host, .. }) => {
                    host.clone()
                }
                _ => String::new(),
            };
            match slot_ranges(&reply, &host) {
                Ok(ranges) if !ranges.is_empty() => {
                    self.install(&ranges);
                    return Ok(());
                }
                Ok(_) => {
                    last_error = StoreError::Backend(format!("{}: no slot is served", node.addr));
                }
                Err(e) => last_error = StoreError::Backend(format!("{}: {e}", node.addr)),
            }
        }
        Err(last_error)
    }

    /// Makes `ranges` (first slot, last slot, primary's `host:port`) the
    /// table; nodes it no longer names are forgotten.
    fn install(&self, ranges: &[(u16, u16, String)]) {
        let mut owner = vec![NOBODY; SLOTS].into_boxed_slice();
        let mut nodes: Vec<Arc<Node>> = Vec::new();
        for (first, last, addr) in ranges {
            let Some(node) = self.node_at(addr) else {
                continue;
            };
            let at = match nodes.iter().position(|n| Arc::ptr_eq(n, &node)) {
                Some(at) => at,
                None => {
                    nodes.push(node);
                    nodes.len() - 1
                }
            };
            let Ok(at) = u16::try_from(at) else {
                continue;
            };
            for slot in *first..=*last {
                if let Some(entry) = owner.get_mut(usize::from(slot)) {
                    *entry = at;
                }
            }
        }
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        known.retain(|addr, _| nodes.iter().any(|n| &n.addr == addr));
        drop(known);
        self.table.store(Arc::new(Table { owner, nodes }));
    }
}

/// The primaries' slot ranges in a `CLUSTER SLOTS` reply: (first, last,
/// `host:port`). A primary that gives no host (an empty one, or `?`) is at
/// `asked_host`, the host of the node that answered.
fn slot_ranges(reply: &Value, asked_host: &str) -> Result<Vec<(u16, u16, String)>, String> {
    let Value::Array(entries) = reply else {
        return Err(format!("CLUSTER SLOTS answered {reply:?}"));
    };
    let int = |v: &Value| match v {
        Value::Int(n) => u16::try_from(*n).ok().filter(|&n| usize::from(n) < SLOTS),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let mut ranges = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(fields) = entry else {
            return Err(format!("a CLUSTER SLOTS entry is {entry:?}"));
        };
        let (Some(first), Some(last), Some(Value::Array(primary))) = (
            fields.first().and_then(int),
            fields.get(1).and_then(int),
            fields.get(2),
        ) else {
            return Err(format!("a CLUSTER SLOTS entry is {fields:?}"));
        };
        let (Some(host), Some(Value::Int(port))) = (primary.first().and_then(text), primary.get(1))
        else {
            return Err(format!("a CLUSTER SLOTS primary is {primary:?}"));
        };
        let host = if host.is_empty() || host == "?" {
            asked_host.to_owned()
        } else {
            host
        };
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        ranges.push((first.min(last), last.max(first), addr));
    }
    Ok(ranges)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slots_reply_names_each_ranges_primary() {
        let s = |t: &str| Value::BulkString(t.as_bytes().to_vec());
        let reply = Value::Array(vec![
            Value::Array(vec![
                Value::Int(0),
                Value::Int(5460),
                Value::Array(vec![s("10.0.0.1"), Value::Int(7000), s("id1")]),
                Value::Array(vec![s("10.0.0.4"), Value::Int(7003), s("id4")]),
            ]),
            Value::Array(vec![
                Value::Int(5461),
                Value::Int(16383),
                Value::Array(vec![s(""), Value::Int(7001), s("id2")]),
            ]),
        ]);
        assert_eq!(
            slot_ranges(&reply, "10.0.0.9").expect("ranges"),
            [
                (0, 5460, "10.0.0.1:7000".to_owned()),
                (5461, 16383, "10.0.0.9:7001".to_owned())
            ]
        );
        for bad in [
            Value::Nil,
            Value::Array(vec![Value::Int(1)]),
            Value::Array(vec![Value::Array(vec![
                Value::Int(0),
                Value::Int(99_999),
                Value::Array(vec![s("h"), Value::Int(1)]),
            ])]),
        ] {
            assert!(slot_ranges(&bad, "h").is_err(), "{bad:?}");
        }
    }
}
