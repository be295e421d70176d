//! The penalties in force, for operators: the keys of every limit's
//! penalty (`<key>:p`, see `penalized` in `lua/decide.lua`) found with
//! `SCAN` on every node and read with their values.

use redis::Value;

use super::RedisStore;
use super::export::glob_escaped;
use crate::limit::StoreError;
use crate::limit::penalty::Served;

impl RedisStore {
    /// Every penalty in force at `now`.
    pub async fn penalties(&self, now: u64) -> Result<Vec<Served>, StoreError> {
        let pattern = format!("{}:{{*}}:*:p", glob_escaped(&self.key_prefix));
        let head = format!("{}:{{", self.key_prefix);
        let found = self.scan(&pattern).await?;
        Ok(found
            .iter()
            .filter_map(|(key, value)| served(key.strip_prefix(&head)?, value, now))
            .collect())
    }
}

/// The penalty under `key` (`scope:client}:index:algorithm:window:p`,
/// after the prefix and the brace), if it runs at `now`.
fn served(key: &str, value: &Value, now: u64) -> Option<Served> {
    let Value::BulkString(bytes) = value else {
        return None;
    };
    let text = std::str::from_utf8(bytes).ok()?;
    let mut numbers = text.split(' ').filter_map(|n| n.parse::<u64>().ok());
    let (until, offences) = (numbers.next()?, numbers.next()?);
    let (tag, rest) = key.rsplit_once("}:")?;
    let (scope, client) = tag.split_once(':')?;
    let index = rest.split(':').next()?.parse().ok()?;
    (until > now).then(|| Served {
        scope: scope.to_owned(),
        index,
        client: client.to_owned(),
        ends_in_ms: until - now,
        offences,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_penalty_key_names_its_scope_client_and_limit() {
        let value = Value::BulkString(b"5000 2 90000".to_vec());
        let got = served("login:a:10.0.0.7}:0:sliding_log:600000:p", &value, 1000);
        assert_eq!(
            got,
            Some(Served {
                scope: "login".into(),
                index: 0,
                client: "a:10.0.0.7".into(),
                ends_in_ms: 4000,
                offences: 2,
            })
        );
        assert_eq!(
            served("login:a:10.0.0.7}:0:sliding_log:600000:p", &value, 5000),
            None
        );
    }
}
