//! A call to a cluster's primary, and the answers that send it elsewhere:
//! `MOVED` moves the slot in the table and asks the new owner; `ASK` asks
//! the importing node once, after `ASKING`; `TRYAGAIN`, `CLUSTERDOWN` and
//! `MASTERDOWN` ask again after a short wait; all within the decision's
//! deadline, which the caller holds.

use std::sync::Arc;
use std::time::Duration;

use redis::{Cmd, ErrorKind, RedisError, ServerErrorKind, Value};

use super::Link;
use super::batch::Ask;
use super::cluster::{Cluster, Node};
use super::code::code_missing;
use super::connections::{cluster_retry_waits, retires, store_error};
use crate::limit::StoreError;

/// Redirections followed for one call, at most: a slot that keeps moving
/// is a cluster being rebuilt, better left to `on_error`.
const REDIRECTIONS: u32 = 5;

impl Link {
    /// Sends one call deciding `asks` (whose keys share one slot) to
    /// `node`, the slot's primary as the table names it, and returns
    /// Redis's reply, following `MOVED` and `ASK` and asking again after
    /// `TRYAGAIN`, `CLUSTERDOWN` or `MASTERDOWN`; the caller bounds it with
    /// the decision's timeout.
    pub(super) async fn cluster_call<'a>(
        &self,
        cluster: &Arc<Cluster>,
        mut node: Arc<Node>,
        asks: impl Iterator<Item = Ask<'a>> + Clone,
    ) -> Result<Value, StoreError> {
        let Some(first) = asks.clone().next() else {
            return Err(StoreError::Backend("a call without decisions".to_owned()));
        };
        let mut command = sized_for(&first);
        self.command(&mut command, asks.clone());
        let (least, most) = cluster_retry_waits(self.timeout);
        let (mut asking, mut loaded, mut redirected) = (false, false, 0);
        loop {
            let mut conn = match node.connection(&cluster.config).await {
                Ok(conn) => conn,
                Err(e) => {
                    cluster.refresh_soon();
                    return Err(store_error(&e, &format!("{}: cannot connect", node.addr)));
                }
            };
            self.calls.inc();
            let sent = if std::mem::take(&mut asking) {
                let mut pipe = redis::pipe();
                pipe.cmd("ASKING").ignore().add_command(command.clone());
                pipe.query_async::<(Value,)>(&mut conn).await.map(|(v,)| v)
            } else {
                command.query_async::<Value>(&mut conn).await
            };
            let e = match sent {
                Ok(reply) => return Ok(reply),
                Err(e) => e,
            };
            if code_missing(&e) && !loaded {
                // This primary lacks the code (a fresh replica promoted, a
                // restart): give it the code, ask again.
                loaded = true;
                self.load_code(&mut conn)
                    .await
                    .map_err(|e| failed(cluster, &node, e))?;
                self.command(&mut command, asks.clone());
                continue;
            }
            match next_after(cluster, &e) {
                Next::Wait => {
                    tokio::time::sleep(Duration::from_millis(jitter(least, most))).await;
                }
                Next::Redirect { to: Some(to), ask } if redirected < REDIRECTIONS => {
                    redirected += 1;
                    asking = ask;
                    if !asking {
                        cluster.refresh_soon();
                    }
                    node = to;
                }
                Next::Redirect { .. } | Next::Fail => return Err(failed(cluster, &node, e)),
            }
        }
    }
}

/// A command buffer sized up front for a call whose first decision is
/// `first`, so that building it allocates twice rather than once per
/// doubling of its buffers: a key and about 40 bytes of limits per limit,
/// six more arguments.
fn sized_for(first: &Ask<'_>) -> Cmd {
    let n = first.limits.len();
    Cmd::with_capacity(6 + n, 64 + n * (first.tags.get(0).0.len() + 72))
}

/// What a call does after Redis answered it with an error.
enum Next {
    /// Asks the same node again after a short wait: a slot is moving or a
    /// replica is being promoted.
    Wait,
    /// Asks the node a redirection names (`None`: one not known, or not
    /// reachable), after `ASKING` when `ask`.
    Redirect { to: Option<Arc<Node>>, ask: bool },
    /// Gives up with the error.
    Fail,
}

/// What to do after `error`: a redirection updates the slot table as it
/// says, and a cluster that is down has its table read again soon.
fn next_after(cluster: &Arc<Cluster>, error: &RedisError) -> Next {
    match error.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => Next::Redirect {
            to: error
                .redirect_node()
                .and_then(|(addr, slot)| cluster.moved(slot, addr)),
            ask: false,
        },
        ErrorKind::Server(ServerErrorKind::Ask) => Next::Redirect {
            to: error
                .redirect_node()
                .and_then(|(addr, _)| cluster.asked(addr)),
            ask: true,
        },
        ErrorKind::Server(ServerErrorKind::TryAgain) => Next::Wait,
        ErrorKind::Server(ServerErrorKind::ClusterDown | ServerErrorKind::MasterDown) => {
            cluster.refresh_soon();
            Next::Wait
        }
        _ => Next::Fail,
    }
}

/// `error` from `node`, as the decision's error; a connection that
/// [`retires`] is dropped and the slot table read again soon.
fn failed(cluster: &Arc<Cluster>, node: &Node, error: RedisError) -> StoreError {
    if retires(&error) {
        node.retire();
        cluster.refresh_soon();
    }
    store_error(&error, &node.addr)
}

/// A number of milliseconds drawn between `least` and `most`.
fn jitter(least: u64, most: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let draw = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    least + draw % (most.saturating_sub(least) + 1)
}
