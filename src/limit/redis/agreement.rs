//! What the instances sharing one store tell each other beside their
//! counts: the id secret they digest client ids with (a marker every
//! instance checks, so that one with another secret refuses to count apart
//! from the others) and the limits they count by (a digest each announces,
//! so that disagreement is noticed). Both live under the key prefix, each
//! in one key read and written with one pipelined call.

use std::time::Duration;

use redis::FromRedisValue;

use super::connections::store_error;
use super::{RedisStore, no_primary, slot_of};
use crate::limit::StoreError;

/// How long the id secret marker outlives the last start or probe that
/// found it.
const MARKER_TTL_SECS: u64 = 30 * 24 * 3600;

/// How long an announced rules digest counts as in use.
const ANNOUNCED_MS: u64 = 30_000;

impl RedisStore {
    /// Writes this instance's id secret marker where none is, and checks
    /// the one that is: an instance digesting client ids with another
    /// secret would count every client apart from the others.
    pub(super) async fn check_marker(&self) -> Result<(), StoreError> {
        let key = format!("{}.id-secret-marker", self.key_prefix);
        let ours = self.id_key.marker();
        let mut pipe = redis::pipe();
        pipe.cmd("SET")
            .arg(&key)
            .arg(&ours)
            .arg("NX")
            .arg("EX")
            .arg(MARKER_TTL_SECS)
            .ignore()
            .cmd("EXPIRE")
            .arg(&key)
            .arg(MARKER_TTL_SECS)
            .ignore()
            .cmd("GET")
            .arg(&key);
        let (found,): (Option<String>,) = self.query_at(&key, &pipe).await?;
        match found {
            Some(theirs) if theirs != ours => Err(StoreError::Refused(format!(
                "the instances already counting under key_prefix {:?} digest client ids with another secret; give every instance sharing this store the same [store] id_secret (or id_secret_file), or another key_prefix",
                self.key_prefix
            ))),
            _ => Ok(()),
        }
    }

    /// Announces that this instance counts by the rules `digest` (see
    /// `Config::rules_digest`) and returns every digest announced in the
    /// last 30 s, this one included: a sorted set, each member scored by
    /// when it was last announced, the key kept a minute past the last
    /// announcement.
    pub async fn announce_rules(&self, digest: &str) -> Result<Vec<String>, StoreError> {
        let key = format!("{}.rule-sets", self.key_prefix);
        let now = crate::clock::now_ms();
        let mut pipe = redis::pipe();
        pipe.cmd("ZADD")
            .arg(&key)
            .arg(now)
            .arg(digest)
            .ignore()
            .cmd("ZREMRANGEBYSCORE")
            .arg(&key)
            .arg("-inf")
            .arg(now.saturating_sub(ANNOUNCED_MS))
            .ignore()
            .cmd("PEXPIRE")
            .arg(&key)
            .arg(2 * ANNOUNCED_MS)
            .ignore()
            .cmd("ZRANGE")
            .arg(&key)
            .arg(0)
            .arg(-1);
        let (digests,): (Vec<String>,) = self.query_at(&key, &pipe).await?;
        Ok(digests)
    }

    /// Sends `pipe`, whose keys are all `key`, where `key` lives (the one
    /// Redis, or the cluster primary of its slot), within the store's
    /// timeout (at least a second: these calls are off the request path).
    pub(super) async fn query_at<T: FromRedisValue>(
        &self,
        key: &str,
        pipe: &redis::Pipeline,
    ) -> Result<T, StoreError> {
        let limit = self.link.timeout.max(Duration::from_secs(1));
        let work = async {
            match &self.link.cluster {
                Some(cluster) => {
                    let node = cluster.node(slot_of(key)).ok_or_else(no_primary)?;
                    let mut conn = node
                        .connection(&cluster.config)
                        .await
                        .map_err(|e| store_error(&e, &node.addr))?;
                    pipe.query_async(&mut conn)
                        .await
                        .map_err(|e| store_error(&e, &node.addr))
                }
                None => {
                    let lane = self.link.lane().await?;
                    let mut conn = lane.conn.clone();
                    pipe.query_async(&mut conn)
                        .await
                        .map_err(|e| lane.failed(e))
                }
            }
        };
        tokio::time::timeout(limit, work)
            .await
            .map_err(|_| StoreError::Timeout(limit))?
    }
}
