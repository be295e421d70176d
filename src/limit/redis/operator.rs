//! What clients and operators ask of one client's counts beyond
//! decisions: read them without consuming (a settlement of nothing), and
//! forget them (each key deleted where it lives), telling every instance,
//! as a settlement that gives units back does, so remembered denials end.

use redis::Cmd;

use super::batch::Ask;
use super::keys::{Key, PenaltyOf};
use super::replies::standing_from_reply;
use super::{RedisStore, Target};
use crate::limit::{Charge, StoreError};

impl RedisStore {
    /// What each of `charge`'s limits holds now, in one call to `target`
    /// (see [`Self::target`]; a charge whose keys lie in several cluster
    /// slots is read part by part), consuming nothing: a settlement of
    /// nothing to nothing, which the code runs as a read.
    pub async fn peek_on(
        &self,
        target: Target,
        charge: Charge<'_>,
    ) -> Result<Vec<crate::limit::Standing>, StoreError> {
        let Target { node, tags } = target;
        let ask = Ask {
            tags: tags.borrow(),
            limits: charge.limits,
            cost: 0,
            settle: Some(crate::limit::Settlement {
                at_ms: 0,
                reserved: 0,
                local: false,
                kind: crate::limit::Settled::Reservation,
            }),
            now: None,
        };
        let work = async {
            let reply = match &self.link.cluster {
                Some(cluster) => {
                    self.link
                        .cluster_call(cluster, node, std::iter::once(ask))
                        .await?
                }
                None => {
                    self.link
                        .call(&mut Cmd::new(), std::iter::once(ask))
                        .await?
                }
            };
            standing_from_reply(&reply, charge.limits.len())
        };
        tokio::time::timeout(self.link.timeout, work)
            .await
            .map_err(|_| StoreError::Timeout(self.link.timeout))?
    }

    /// Deletes the keys of `charge`'s limits (only the one at `which`, when
    /// given) for its client and their penalties, or the penalties alone,
    /// and publishes their hash tags on the channel instances listen to
    /// for units given back (a remembered denial ends with them).
    pub async fn reset(
        &self,
        charge: &Charge<'_>,
        which: Option<usize>,
        what: crate::limit::Forget,
    ) -> Result<(), StoreError> {
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
            if what == crate::limit::Forget::All {
                pipe.cmd("DEL").arg(&key).ignore();
            }
            pipe.cmd("DEL")
                .arg(PenaltyOf(&key))
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
