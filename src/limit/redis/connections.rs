//! The pool: redis-rs multiplexed connections to one Redis (or the primary
//! the Sentinels name), made and retired without a ping per checkout. A
//! cluster's primaries each have their own connection (see `cluster`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, ServerErrorKind};

use crate::limit::StoreError;

/// How long a cluster decision waits before it asks again after
/// `TRYAGAIN`, `CLUSTERDOWN` or `MASTERDOWN`: (at least, at most), in
/// milliseconds. Each wait is random between 2 ms and a ceiling of a
/// quarter of the timeout (at least 10 ms, at most 1 s), so a decision
/// caught by a slot moving or a replica being promoted asks several times
/// within its timeout and is decided soon after the cluster can.
pub(super) fn cluster_retry_waits(timeout: Duration) -> (u64, u64) {
    let quarter = u64::try_from(timeout.as_millis() / 4).unwrap_or(u64::MAX);
    (2, quarter.clamp(10, 1000))
}

/// Makes pooled connections, without deadpool-redis's per-checkout `PING`.
pub(super) enum Lanes {
    /// Multiplexed connections to one Redis.
    Single(deadpool_redis::Manager),
    /// Connections to the primary that the Sentinels name at connect time;
    /// after a failover the old connection fails and is replaced.
    Sentinel(
        tokio::sync::Mutex<redis::sentinel::SentinelClient>,
        AsyncConnectionConfig,
    ),
}

/// A connection; cheap to clone, and clones share the connection (commands
/// from many tasks are pipelined).
pub(super) type Conn = MultiplexedConnection;

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

    /// Notes `error`; one that [`retires`] the connection retires it.
    pub(super) fn failed(&self, error: RedisError) -> StoreError {
        if retires(&error) {
            self.broken.store(true, Ordering::Relaxed);
        }
        StoreError::Backend(error.to_string())
    }
}

/// Whether the connection `error` came on should be replaced: a
/// connection-level error, or `READONLY` (the node was demoted, the primary
/// is elsewhere now).
pub(super) fn retires(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_connection_dropped()
        || error.is_unrecoverable_error()
        || error.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly)
}

impl managed::Manager for Lanes {
    type Type = Lane;
    type Error = RedisError;

    async fn create(&self) -> Result<Lane, RedisError> {
        let conn = match self {
            Self::Single(manager) => managed::Manager::create(manager).await?,
            Self::Sentinel(sentinels, config) => {
                let primary = sentinels.lock().await.async_get_client().await?;
                primary
                    .get_multiplexed_async_connection_with_config(config)
                    .await?
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
