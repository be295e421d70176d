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
        store_error(&error, "")
    }
}

/// `error` as a [`StoreError`], `context` (an address, what was being
/// done) before it: [`StoreError::Refused`] when Redis answered and
/// refused floodgate's settings, [`StoreError::Backend`] otherwise.
pub(super) fn store_error(error: &RedisError, context: &str) -> StoreError {
    let context = if context.is_empty() {
        String::new()
    } else {
        format!("{context}: ")
    };
    match refusal(error) {
        // A parser's complaint about bytes that were never Redis's says
        // nothing the fix does not.
        Some(fix) if error.kind() == ErrorKind::Parse => {
            StoreError::Refused(format!("{context}the reply is not Redis's; {fix}"))
        }
        Some(fix) => StoreError::Refused(format!("{context}{error}; {fix}")),
        None => StoreError::Backend(format!("{context}{error}")),
    }
}

/// What the operator must fix when `error` shows that the store answered
/// and refused floodgate's settings (a password, a user, a database, a
/// permission, a certificate), or that what answers is not Redis; `None`
/// for an error that a store which is down or slow gives. A refusal is a
/// configuration error: no amount of waiting fixes it, and counting
/// nothing meanwhile would turn every limit off.
pub(super) fn refusal(error: &RedisError) -> Option<&'static str> {
    let text = error.to_string();
    match error.kind() {
        ErrorKind::AuthenticationFailed => Some(
            "Redis refused the user name or password: check them in [store] url (redis://USER:PASSWORD@host) or password_file",
        ),
        ErrorKind::Server(ServerErrorKind::NoPerm) => Some(
            "the Redis user lacks a permission floodgate needs (FUNCTION LOAD, FCALL, SCRIPT LOAD, EVALSHA, the keys under key_prefix, and the channel key_prefix:given-back to publish and subscribe): grant them with ACL SETUSER, or name another user in [store] url",
        ),
        ErrorKind::MasterNameNotFoundBySentinel => {
            Some("the Sentinels know no primary by the name in [store] master")
        }
        ErrorKind::Parse => Some(
            "what answers at [store] url does not speak the Redis protocol: check the address and port",
        ),
        // Without a password Redis refuses the first command, and one as
        // long as the decision code with "unauthenticated bulk length".
        _ if error.code() == Some("NOAUTH")
            || text.contains("NOAUTH")
            || text.contains("unauthenticated") =>
        {
            Some(
                "Redis requires a password and none was given: put it in [store] url (redis://:PASSWORD@host) or password_file",
            )
        }
        _ if text.contains("WRONGPASS") => Some(
            "Redis refused the user name or password: check them in [store] url (redis://USER:PASSWORD@host) or password_file",
        ),
        _ if text.contains("switch database") => Some(
            "Redis has no database by the number in [store] url (its path, /0 to /15 unless Redis sets `databases`)",
        ),
        _ if error.is_io_error()
            && (text.contains("invalid peer certificate")
                || text.contains("received fatal alert")) =>
        {
            Some(
                "the TLS handshake with Redis failed: check the rediss:// address's host name and [store] tls_ca_file, tls_cert_file and tls_key_file",
            )
        }
        _ => None,
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
