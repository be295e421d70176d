//! What operators and clients ask of the counts beyond decisions: a
//! client's standing read without consuming, an operator's adjustment of
//! one client's counts, and every client's window of a limit for export.

use super::{Guarded, Limiter, remembered_as};
use crate::clock::now_ms;
use crate::limit::backend::StoreNode as _;
use crate::limit::{Backend, Charge, Forget, Limit, Settled, StoreError};

impl Limiter {
    /// What each of `charge`'s limits holds now, consuming nothing: for
    /// a client's readout of its standing. The shared store is read (in
    /// one call, or one per cluster slot its keys lie in); while it cannot
    /// be, the error.
    pub async fn standing(
        &self,
        charge: Charge<'_>,
    ) -> Result<Vec<crate::limit::Standing>, StoreError> {
        match self {
            Self::Memory(memory) => Ok(memory.0.peek_at(charge, now_ms())),
            Self::Redis(shared) => shared.standing(charge).await,
        }
    }

    /// Applies an operator's `adjustment` to `charge`'s limits (only the
    /// one at `which`, when given) for its client, where they are counted,
    /// and ends the denials remembered for them on every instance. Limits
    /// that count requests are adjusted as the others are.
    pub async fn adjust(
        &self,
        charge: Charge<'_>,
        which: Option<usize>,
        adjustment: crate::limit::Adjustment,
    ) -> Result<(), StoreError> {
        let now = now_ms();
        let limits: Vec<Limit> = charge
            .limits
            .iter()
            .map(|l| Limit {
                counts_requests: false,
                ..*l
            })
            .collect();
        let charge = Charge {
            limits: &limits,
            ..charge
        };
        let shared = match self {
            Self::Memory(memory) => {
                memory.0.adjust_at(charge, which, adjustment, now);
                return Ok(());
            }
            Self::Redis(shared) => shared,
        };
        shared.denials.forget(charge.route, &remembered_as(&charge));
        let (reserved, used, kind) = match adjustment {
            crate::limit::Adjustment::Reset => {
                return shared.store.reset(&charge, which, Forget::All).await;
            }
            crate::limit::Adjustment::Lift => {
                return shared.store.reset(&charge, which, Forget::Penalty).await;
            }
            crate::limit::Adjustment::Credit(units) => (units, 0, Settled::Grant),
            crate::limit::Adjustment::Debit(units) => (0, units, Settled::Reservation),
        };
        // A settlement of the chosen limits, each keyed as it is counted.
        let chosen: Vec<usize> = (0..limits.len())
            .filter(|i| which.is_none_or(|w| w == *i))
            .collect();
        let keys: Vec<crate::limit::CountKey> = chosen
            .iter()
            .map(|&i| match charge.keys.get(i) {
                Some(k) if charge.keys.len() == limits.len() => k.clone(),
                _ => crate::limit::CountKey::new(
                    charge.route,
                    charge.route,
                    i,
                    charge.client.clone(),
                ),
            })
            .collect();
        let picked: Vec<Limit> = chosen.iter().map(|&i| limits[i]).collect();
        let settlement = Charge {
            limits: &picked,
            keys: &keys,
            cost: used,
            settle: Some(crate::limit::Settlement {
                at_ms: now,
                reserved,
                local: false,
                kind,
            }),
            ..charge
        };
        shared.ask_store(settlement, now).await.map(|_| ())
    }

    /// Every penalty in force now, as the store keeps them.
    pub async fn penalties(&self) -> Result<Vec<crate::limit::penalty::Served>, StoreError> {
        let now = now_ms();
        match self {
            Self::Memory(memory) => Ok(memory.0.penalties_at(now)),
            Self::Redis(shared) => shared.store.penalties(now).await,
        }
    }

    /// Every client's fixed window of limit `index` of `scope` (read as
    /// entry `entry` in memory when the limit is keyed on its own), as the
    /// store keeps it now: for export and for the heaviest clients.
    pub async fn kept(
        &self,
        scope: &str,
        index: usize,
        entry: Option<&str>,
        limit: &Limit,
    ) -> Result<Vec<crate::limit::Kept>, StoreError> {
        let now = now_ms();
        match self {
            Self::Memory(memory) => Ok(memory.0.kept(scope, index, entry, limit, now)),
            Self::Redis(shared) => shared.store.kept(scope, index, limit, now).await,
        }
    }
}

impl<B: Backend> Guarded<B> {
    /// What each of `charge`'s limits holds in the store (see
    /// [`Limiter::standing`]).
    async fn standing(
        &self,
        charge: Charge<'_>,
    ) -> Result<Vec<crate::limit::Standing>, StoreError> {
        let Some(parts) = self.store.parts(&charge) else {
            let target = self.store.target(&charge)?;
            if B::node_of(&target).breaker().is_open() {
                return Err(StoreError::CircuitOpen);
            }
            return self.store.peek_on(target, charge).await;
        };
        let mut verdicts = vec![crate::limit::Standing::default(); charge.limits.len()];
        for (positions, target) in parts {
            let target = target?;
            if B::node_of(&target).breaker().is_open() {
                return Err(StoreError::CircuitOpen);
            }
            let limits: Vec<Limit> = positions.iter().map(|&i| charge.limits[i]).collect();
            let keys: Vec<crate::limit::CountKey> =
                positions.iter().map(|&i| charge.keys[i].clone()).collect();
            let part = Charge {
                limits: &limits,
                keys: &keys,
                ..charge
            };
            let read = self.store.peek_on(target, part).await?;
            for (&i, standing) in positions.iter().zip(read) {
                verdicts[i] = standing;
            }
        }
        Ok(verdicts)
    }
}
