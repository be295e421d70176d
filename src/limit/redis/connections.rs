//! The pool: redis-rs multiplexed (or cluster) connections, made and
//! retired without a ping per checkout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{
    AsyncConnectionConfig, Cmd, ErrorKind, RedisError, RedisFuture, ServerErrorKind, Value,
};

use crate::limit::StoreError;

/// How long the cluster client waits before it asks again after
/// `TRYAGAIN`, `CLUSTERDOWN` or `MASTERDOWN`, or when no node holds a slot:
/// (at least, at most), in milliseconds. redis-rs waits 1.28 s at least by
/// default, more than a decision's whole `timeout`, so a decision caught by
/// a slot moving or a replica being promoted would always end in `on_error`
/// however soon the cluster was whole again. Here each wait is random
/// between 2 ms and a ceiling that doubles from 20 ms up to a quarter of
/// the timeout, so a decision asks several times within its timeout and is
/// decided soon after the cluster can.
pub(super) fn cluster_retry_waits(timeout: Duration) -> (u64, u64) {
    let quarter = u64::try_from(timeout.as_millis() / 4).unwrap_or(u64::MAX);
    (2, quarter.clamp(10, 1000))
}

/// Makes pooled connections, without deadpool-redis's per-checkout `PING`.
pub(super) enum Lanes {
    /// Multiplexed connections to one Redis.
    Single(deadpool_redis::Manager),
    /// Cluster connections, which route each command to its slot's primary
    /// and follow `MOVED`/`ASK` redirections themselves.
    Cluster(redis::cluster::ClusterClient),
    /// Connections to the primary that the Sentinels name at connect time;
    /// after a failover the old connection fails and is replaced.
    Sentinel(
        tokio::sync::Mutex<redis::sentinel::SentinelClient>,
        AsyncConnectionConfig,
    ),
}

/// A connection to one Redis or to a cluster; cheap to clone, and clones
/// share the connection (commands from many tasks are pipelined).
#[derive(Clone)]
pub(super) enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Self::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// One pooled connection and whether a command on it failed for a
/// connection reason.
pub(super) struct Lane {
    pub(super) conn: Conn,
    pub(super) broken: Arc<AtomicBool>,
}

impl Lane {
    pub(super) fn clone_handle(&self) -> Lane {
        Lane {
            conn: self.conn.clone(),
            broken: Arc::clone(&self.broken),
        }
    }

    /// Notes `error`; a connection-level one retires this connection, and so
    /// does `READONLY`: the node was demoted, the primary is elsewhere now.
    pub(super) fn failed(&self, error: RedisError) -> StoreError {
        if error.is_io_error()
            || error.is_connection_dropped()
            || error.is_unrecoverable_error()
            || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
        {
            self.broken.store(true, Ordering::Relaxed);
        }
        StoreError::Backend(error.to_string())
    }
}

impl managed::Manager for Lanes {
    type Type = Lane;
    type Error = RedisError;

    async fn create(&self) -> Result<Lane, RedisError> {
        let conn = match self {
            Self::Single(manager) => Conn::Single(managed::Manager::create(manager).await?),
            Self::Cluster(client) => Conn::Cluster(client.get_async_connection().await?),
            Self::Sentinel(sentinels, config) => {
                let primary = sentinels.lock().await.async_get_client().await?;
                Conn::Single(
                    primary
                        .get_multiplexed_async_connection_with_config(config)
                        .await?,
                )
            }
        };
        Ok(Lane {
            conn,
            broken: Arc::new(AtomicBool::new(false)),
        })
    }

    async fn recycle(&self, lane: &mut Lane, _: &Metrics) -> RecycleResult<RedisError> {
        if lane.broken.load(Ordering::Relaxed) {
            return Err(RecycleError::message("connection failed; replacing it"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_retries_wait_a_quarter_of_the_timeout_at_most() {
        let waits = |ms| cluster_retry_waits(Duration::from_millis(ms));
        assert_eq!(waits(50), (2, 12));
        assert_eq!(waits(300), (2, 75));
        assert_eq!(waits(20), (2, 10));
        assert_eq!(waits(60_000), (2, 1000));
    }
}
