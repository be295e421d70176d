//! Reading every client's fixed window of one limit, for export and for
//! an operator's list of the heaviest clients: the keys of the limit are
//! found with `SCAN` on every node (the one Redis, or each cluster
//! primary) and read with one pipelined `GET` per page. A window by the
//! calendar is kept past its end ("start count granted end"), and the last
//! closed one of a client that came back since at "<key>:closed:<start>"
//! ("end count"): see `lua/fixed_window.lua`.

use redis::Value;

use super::connections::store_error;
use super::{RedisStore, no_primary};
use crate::limit::{Kept, Limit, StoreError};

/// Keys read per page.
const PAGE: usize = 500;

impl RedisStore {
    /// Every client's fixed window of limit `index` of `scope`, as kept
    /// at `now`.
    pub async fn kept(
        &self,
        scope: &str,
        index: usize,
        limit: &Limit,
        now: u64,
    ) -> Result<Vec<Kept>, StoreError> {
        let head = format!("{}:{{{}:", self.key_prefix, glob_escaped(scope));
        let tail = format!("}}:{index}:{}:{}", limit.algorithm.name(), limit.window_ms);
        let pattern = format!("{head}*{tail}*");
        let prefix_len = self.key_prefix.len() + 2 + scope.len() + 1;
        let found = self.scan(&pattern).await?;
        Ok(found
            .iter()
            .filter_map(|(key, value)| read_kept(key, value, prefix_len, &tail, limit, now))
            .collect())
    }

    /// Every key matching `pattern` on every node (the one Redis, or each
    /// cluster primary), with its value, read a page at a time.
    pub(super) async fn scan(&self, pattern: &str) -> Result<Vec<(String, Value)>, StoreError> {
        let mut conns = Vec::new();
        match &self.link.cluster {
            Some(cluster) => {
                for node in cluster.nodes() {
                    let conn = node
                        .connection(&cluster.config)
                        .await
                        .map_err(|e| store_error(&e, &node.addr))?;
                    conns.push(conn);
                }
                if conns.is_empty() {
                    return Err(no_primary());
                }
            }
            None => conns.push(self.link.lane().await?.conn.clone()),
        }
        let limit_ms = self.link.timeout.max(std::time::Duration::from_secs(5));
        let mut out = Vec::new();
        for mut conn in conns {
            let mut cursor: u64 = 0;
            loop {
                let mut scan = redis::cmd("SCAN");
                scan.arg(cursor)
                    .arg("MATCH")
                    .arg(pattern)
                    .arg("COUNT")
                    .arg(PAGE);
                let page = scan.query_async::<(u64, Vec<String>)>(&mut conn);
                let (next, keys) = tokio::time::timeout(limit_ms, page)
                    .await
                    .map_err(|_| StoreError::Timeout(limit_ms))?
                    .map_err(|e| store_error(&e, "SCAN"))?;
                if !keys.is_empty() {
                    let mut pipe = redis::pipe();
                    for key in &keys {
                        pipe.cmd("GET").arg(key);
                    }
                    let values: Vec<Value> =
                        tokio::time::timeout(limit_ms, pipe.query_async(&mut conn))
                            .await
                            .map_err(|_| StoreError::Timeout(limit_ms))?
                            .map_err(|e| store_error(&e, "GET"))?;
                    out.extend(keys.into_iter().zip(values));
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(out)
    }
}

/// One key's window, or `None` for a key that is not one of the limit's
/// or holds nothing counted.
fn read_kept(
    key: &str,
    value: &Value,
    prefix_len: usize,
    tail: &str,
    limit: &Limit,
    now: u64,
) -> Option<Kept> {
    let text = match value {
        Value::BulkString(bytes) => std::str::from_utf8(bytes).ok()?,
        _ => return None,
    };
    let at = key.rfind(tail)?;
    let client = key.get(prefix_len..at)?.to_owned();
    let rest = &key[at + tail.len()..];
    let numbers: Vec<u64> = text.split(' ').filter_map(|n| n.parse().ok()).collect();
    let kept = if let Some(start) = rest.strip_prefix(":closed:") {
        // "end count": a closed window of a client that came back since.
        let [end, units] = numbers[..] else {
            return None;
        };
        Kept {
            client,
            start: start.parse().ok()?,
            end,
            units,
            closed: true,
        }
    } else if rest.is_empty() {
        let (start, units) = (*numbers.first()?, *numbers.get(1)?);
        let end = numbers.get(3).copied().unwrap_or(start + limit.window_ms);
        Kept {
            client,
            start,
            end,
            units,
            closed: end <= now,
        }
    } else {
        return None;
    };
    (kept.units > 0).then_some(kept)
}

/// `text` with the characters `SCAN`'s patterns give a meaning escaped.
pub(super) fn glob_escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
