//! Where a decision goes: its keys' hash tags (route or budget and client,
//! so that a route's keys for one client share a Cluster slot), and the one
//! Redis or the cluster primary holding them; for a decision whose keys lie
//! in several slots, its parts, one per slot.

use std::sync::Arc;

use super::batch::OwnedTags;
use super::cluster::Node;
use super::keys::write_client;
use super::slot::slot_of;
use super::{RedisStore, no_primary};
use crate::client::ClientId;
use crate::limit::{Charge, StoreError};

/// Part of a decision whose keys lie in several cluster slots: the
/// positions of its limits in the charge, and where they go (or why no
/// primary is known for their slot).
pub type Part = crate::limit::backend::Part<Target>;

/// Where one decision goes: its keys' hash tag and the node holding them.
#[derive(Debug, Clone)]
pub struct Target {
    /// The one Redis, or the cluster primary holding the tags' slot: whose
    /// breaker the decision passes.
    pub node: Arc<Node>,
    pub(super) tags: OwnedTags,
}

impl RedisStore {
    /// Where the decision `charge` goes: its keys' hash tags, and the one
    /// Redis or the cluster primary holding their slot (a charge whose
    /// keys lie in several slots goes in parts: see [`Self::slot_groups`];
    /// given one anyway, it goes to its first key's). An error while the
    /// cluster's slot table names no primary for it (not read yet, or the
    /// slot is not served); a read of the table follows.
    pub fn target(&self, charge: &Charge<'_>) -> Result<Target, StoreError> {
        let tags = if charge.keys.is_empty() {
            OwnedTags::One(self.hash_tag(charge.route, charge.client))
        } else {
            OwnedTags::Each(
                charge
                    .keys
                    .iter()
                    .map(|k| (self.hash_tag(&k.scope, &k.client), k.index))
                    .collect(),
            )
        };
        let node = match &self.link.cluster {
            None => Arc::clone(&self.single),
            Some(cluster) => match cluster.node(slot_of(tags.first())) {
                Some(node) => node,
                None => {
                    cluster.refresh_soon();
                    return Err(no_primary());
                }
            },
        };
        Ok(Target { node, tags })
    }

    /// On a cluster, `charge`'s limits grouped by the slot of their keys,
    /// in slot order, each group's positions with where it goes (or why
    /// no primary is known for it): what one call each can decide. `None`
    /// when one call decides it all: one Redis, a charge keyed by its
    /// route and client alone, or keys that all share a slot. Each key's
    /// hash tag is made once.
    pub fn parts(&self, charge: &Charge<'_>) -> Option<Vec<Part>> {
        let cluster = self.link.cluster.as_ref()?;
        if charge.keys.is_empty() || charge.keys.len() != charge.limits.len() {
            return None;
        }
        let mut tagged: Vec<(u16, usize, String)> = charge
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| {
                let tag = self.hash_tag(&k.scope, &k.client);
                (slot_of(&tag), i, tag)
            })
            .collect();
        tagged.sort_unstable_by_key(|&(slot, i, _)| (slot, i));
        if tagged.first().map(|t| t.0) == tagged.last().map(|t| t.0) {
            return None;
        }
        // Per slot: the positions, and each key's tag and place.
        type Slotted = (u16, Vec<usize>, Vec<(String, usize)>);
        let mut parts: Vec<Slotted> = Vec::new();
        for (slot, i, tag) in tagged {
            let index = charge.keys[i].index;
            match parts.last_mut() {
                Some((last, positions, tags)) if *last == slot => {
                    positions.push(i);
                    tags.push((tag, index));
                }
                _ => parts.push((slot, vec![i], vec![(tag, index)])),
            }
        }
        Some(
            parts
                .into_iter()
                .map(|(slot, positions, tags)| {
                    let target = match cluster.node(slot) {
                        Some(node) => Ok(Target {
                            node,
                            tags: OwnedTags::Each(tags.into()),
                        }),
                        None => {
                            cluster.refresh_soon();
                            Err(no_primary())
                        }
                    };
                    (positions, target)
                })
                .collect(),
        )
    }

    /// `{prefix}:{route:client}`: the braces make one hash tag per route and
    /// client, so Redis Cluster keeps all of a decision's keys in one slot.
    pub fn hash_tag(&self, route: &str, client: &ClientId) -> String {
        let mut tag = String::with_capacity(self.key_prefix.len() + route.len() + 80);
        tag.push_str(&self.key_prefix);
        tag.push_str(":{");
        tag.push_str(route);
        tag.push(':');
        write_client(&mut tag, client, &self.id_key);
        tag.push('}');
        tag
    }
}
