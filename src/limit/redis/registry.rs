//! The key registry's part of the store: the records of customers' keys
//! every instance shares, a log of their changes each instance follows,
//! and the audit trail of registry changes and operators' actions.
//!
//! What a record says is the `keys` module's; here a record is an opaque
//! JSON string under its key's keyed digest (hex). Every key shares one
//! hash tag, so on a Cluster they live in one slot and a change (the
//! record, the change's sequence number, its log entry and its audit
//! entry) is one atomic script run:
//!
//! - `<prefix>:{registry}:records`: a hash, digest → record;
//! - `<prefix>:{registry}:seq`: the last change's sequence number;
//! - `<prefix>:{registry}:log`: a stream of changes, entry id `<seq>-0`,
//!   fields `digest` and `record` (empty: removed), trimmed to about
//!   [`LOG_KEPT`] entries; an instance that fell further behind reads the
//!   records whole;
//! - `<prefix>:{registry}:audit`: a stream of audit entries (`at`,
//!   `operator`, `action`, `identity`, `key`, `reason`, `before`, `after`),
//!   trimmed to about [`AUDIT_KEPT`].

use redis::Value;

use super::RedisStore;
use crate::limit::StoreError;
use crate::limit::registry::{AUDIT_KEPT, AuditEntry, Change, Snapshot, Write, Written};

/// Changes kept in the log for instances catching up.
const LOG_KEPT: u64 = 10_000;

/// Changes read at once while catching up.
const PAGE: usize = 1_000;

/// One change, atomically: checks what the record holds against what the
/// writer expects, writes or removes it, and logs and audits the change.
/// Returns `{outcome, current}`: 1 written (current: the record before),
/// 0 refused (current: the record as it is).
const WRITE: &str = r"
local old = redis.call('HGET', KEYS[1], ARGV[1])
local expect = ARGV[3]
if expect == '<absent>' then
  if old then return {0, old} end
elseif expect ~= '<any>' then
  if not old or old ~= expect then return {0, old or ''} end
end
if ARGV[2] == '' then
  if not old then return {0, ''} end
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
local seq = redis.call('INCR', KEYS[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[9], seq .. '-0', 'digest', ARGV[1], 'record', ARGV[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[10], '*', 'at', now, 'operator', ARGV[4],
  'action', ARGV[5], 'identity', ARGV[6], 'key', ARGV[7], 'reason', ARGV[8],
  'before', old or '', 'after', ARGV[2])
return {1, old or ''}
";

impl RedisStore {
    fn registry_key(&self, part: &str) -> String {
        format!("{}:{{registry}}:{part}", self.key_prefix)
    }

    /// Every record with the sequence number of the last change they
    /// include, read at once.
    pub async fn registry_snapshot(&self) -> Result<Snapshot, StoreError> {
        let records = self.registry_key("records");
        let mut pipe = redis::pipe();
        pipe.atomic()
            .cmd("HGETALL")
            .arg(&records)
            .cmd("GET")
            .arg(self.registry_key("seq"));
        let (records, seq): (Vec<(String, String)>, Option<u64>) =
            self.query_at(&records, &pipe).await?;
        Ok(Snapshot {
            seq: seq.unwrap_or(0),
            records,
        })
    }

    /// The record under `digest`, as the store holds it now.
    pub async fn registry_get(&self, digest: &str) -> Result<Option<String>, StoreError> {
        let records = self.registry_key("records");
        let mut pipe = redis::pipe();
        pipe.cmd("HGET").arg(&records).arg(digest);
        let (record,): (Option<String>,) = self.query_at(&records, &pipe).await?;
        Ok(record)
    }

    /// The changes after `seq`, oldest first, and the last change's
    /// number; `None` when they cannot be told from the log (it was
    /// trimmed past `seq`, or the registry started over): read a snapshot.
    pub async fn registry_changes(&self, seq: u64) -> Result<Option<Vec<Change>>, StoreError> {
        let log = self.registry_key("log");
        let mut pipe = redis::pipe();
        pipe.cmd("GET")
            .arg(self.registry_key("seq"))
            .cmd("XRANGE")
            .arg(&log)
            .arg(format!("({seq}-0"))
            .arg("+")
            .arg("COUNT")
            .arg(PAGE);
        let (last, entries): (Option<u64>, Value) = self.query_at(&log, &pipe).await?;
        let last = last.unwrap_or(0);
        if last < seq {
            return Ok(None);
        }
        let changes = read_changes(&entries);
        match changes.first() {
            Some(first) if first.seq != seq + 1 => Ok(None),
            None if last > seq => Ok(None),
            _ => Ok(Some(changes)),
        }
    }

    /// Writes (or removes, for an empty record) the record under `write`'s
    /// digest when it holds what `write` expects, logging and auditing the
    /// change in the same step.
    pub async fn registry_write(&self, write: &Write<'_>) -> Result<Written, StoreError> {
        let records = self.registry_key("records");
        let mut pipe = redis::pipe();
        pipe.cmd("EVAL")
            .arg(WRITE)
            .arg(4)
            .arg(&records)
            .arg(self.registry_key("seq"))
            .arg(self.registry_key("log"))
            .arg(self.registry_key("audit"))
            .arg(write.digest)
            .arg(write.record.unwrap_or(""))
            .arg(write.expect.as_arg())
            .arg(write.audit.operator)
            .arg(write.audit.action)
            .arg(write.audit.identity)
            .arg(write.audit.key)
            .arg(write.audit.reason)
            .arg(LOG_KEPT)
            .arg(AUDIT_KEPT);
        let ((outcome, current),): ((i64, String),) = self.query_at(&records, &pipe).await?;
        let current = (!current.is_empty()).then_some(current);
        Ok(if outcome == 1 {
            Written::Done { before: current }
        } else {
            Written::Refused { current }
        })
    }

    /// Adds an operator's action (not a registry change) to the audit.
    pub async fn audit_append(&self, entry: &AuditEntry) -> Result<(), StoreError> {
        let audit = self.registry_key("audit");
        let mut pipe = redis::pipe();
        pipe.cmd("XADD")
            .arg(&audit)
            .arg("MAXLEN")
            .arg("~")
            .arg(AUDIT_KEPT)
            .arg("*")
            .arg("at")
            .arg(entry.at_ms)
            .arg("operator")
            .arg(&entry.operator)
            .arg("action")
            .arg(&entry.action)
            .arg("identity")
            .arg(&entry.identity)
            .arg("key")
            .arg(&entry.key)
            .arg("reason")
            .arg(&entry.reason)
            .arg("before")
            .arg(&entry.before)
            .arg("after")
            .arg(&entry.after)
            .ignore();
        self.query_at(&audit, &pipe).await
    }

    /// The newest audit entries first, at most `count`, scanning at most
    /// `scan` of them for those `keep` accepts.
    pub async fn audit_read(
        &self,
        count: usize,
        scan: usize,
        keep: &(dyn Fn(&AuditEntry) -> bool + Sync),
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let audit = self.registry_key("audit");
        let mut out = Vec::new();
        let mut end = "+".to_owned();
        let mut scanned = 0;
        while out.len() < count && scanned < scan {
            let mut pipe = redis::pipe();
            pipe.cmd("XREVRANGE")
                .arg(&audit)
                .arg(&end)
                .arg("-")
                .arg("COUNT")
                .arg(PAGE);
            let (page,): (Value,) = self.query_at(&audit, &pipe).await?;
            let entries = stream_entries(&page);
            let Some((last_id, _)) = entries.last() else {
                break;
            };
            end = format!("({last_id}");
            scanned += entries.len();
            for (_, fields) in &entries {
                let entry = audit_entry(fields);
                if keep(&entry) && out.len() < count {
                    out.push(entry);
                }
            }
            if entries.len() < PAGE {
                break;
            }
        }
        Ok(out)
    }
}

/// A stream's entries as (id, fields).
fn stream_entries(value: &Value) -> Vec<(String, Vec<(String, String)>)> {
    let Value::Array(entries) = value else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|entry| {
            let Value::Array(parts) = entry else {
                return None;
            };
            let [id, Value::Array(fields)] = parts.as_slice() else {
                return None;
            };
            let id: String = redis::from_redis_value_ref(id).ok()?;
            let fields = fields
                .chunks(2)
                .filter_map(|pair| {
                    let [name, value] = pair else { return None };
                    Some((
                        redis::from_redis_value_ref(name).ok()?,
                        redis::from_redis_value_ref(value).ok()?,
                    ))
                })
                .collect();
            Some((id, fields))
        })
        .collect()
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map_or("", |(_, v)| v.as_str())
}

fn read_changes(entries: &Value) -> Vec<Change> {
    stream_entries(entries)
        .into_iter()
        .filter_map(|(id, fields)| {
            let seq = id.split('-').next()?.parse().ok()?;
            let record = field(&fields, "record");
            Some(Change {
                seq,
                digest: field(&fields, "digest").to_owned(),
                record: (!record.is_empty()).then(|| record.to_owned()),
            })
        })
        .collect()
}

fn audit_entry(fields: &[(String, String)]) -> AuditEntry {
    AuditEntry {
        at_ms: field(fields, "at").parse().unwrap_or(0),
        operator: field(fields, "operator").to_owned(),
        action: field(fields, "action").to_owned(),
        identity: field(fields, "identity").to_owned(),
        key: field(fields, "key").to_owned(),
        reason: field(fields, "reason").to_owned(),
        before: field(fields, "before").to_owned(),
        after: field(fields, "after").to_owned(),
    }
}
