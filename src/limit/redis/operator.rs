//! What operators do to one client's counts beyond settlements: forget
//! them (each key deleted where it lives), and tell every instance, as a
//! settlement that gives units back does, so remembered denials end.

use super::RedisStore;
use super::keys::Key;
use crate::limit::{Charge, StoreError};

impl RedisStore {
    /// Deletes the keys of `charge`'s limits (only the one at `which`, when
    /// given) for its client, and publishes their hash tags on the
    /// channel instances listen to for units given back.
    pub async fn reset(&self, charge: &Charge<'_>, which: Option<usize>) -> Result<(), StoreError> {
        let channel = format!("{}:given-back", self.key_prefix);
        for (i, limit) in charge.limits.iter().enumerate() {
            if which.is_some_and(|w| w != i) {
                continue;
            }
            let (tag, index) = match charge.keys.get(i) {
                Some(k) if charge.keys.len() == charge.limits.len() => {
                    (self.hash_tag(&k.scope, &k.client), k.index)
                }
                _ => (self.hash_tag(charge.route, charge.client), i),
            };
            let key = Key {
                tag: &tag,
                index,
                limit,
            };
            let mut pipe = redis::pipe();
            pipe.cmd("DEL")
                .arg(key)
                .ignore()
                .cmd("PUBLISH")
                .arg(&channel)
                .arg(&tag)
                .ignore();
            // The tag hashes to the key's slot.
            let () = self.query_at(&tag, &pipe).await?;
        }
        Ok(())
    }
}
