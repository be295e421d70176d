//! What a decision gets while the store cannot make it, as `on_error`
//! says: let the request through, refuse it (503 with `Retry-After`), or
//! count it in this instance's memory, each limit divided by the expected
//! number of instances.

use std::time::Instant;

use super::{Answer, Guarded};
use crate::clock::now_ms;
use crate::limit::settings::OnError;
use crate::limit::{Backend, Charge, Decision, Limit, StoreError};
use crate::metrics::StoreKind;

/// `Retry-After` for a 503 while the store is down.
const STORE_RETRY_AFTER_MS: u64 = 1_000;

impl<B: Backend> Guarded<B> {
    /// The answer `on_error` gives `charge`, which the store could not
    /// decide for `error`.
    pub(super) fn fallback(&self, charge: Charge<'_>, error: &StoreError) -> Answer {
        self.note_refusal(error);
        let now = now_ms();
        if !matches!(error, StoreError::CircuitOpen | StoreError::Refused(_))
            && crate::clock::once_a_second(&self.last_logged, now)
        {
            tracing::warn!(%error, on_error = %self.on_error, "rate limit store failed");
        }
        match self.on_error {
            OnError::Allow => Answer::Unavailable {
                deny: false,
                retry_after_ms: 0,
            },
            OnError::Deny => Answer::Unavailable {
                deny: true,
                retry_after_ms: STORE_RETRY_AFTER_MS,
            },
            OnError::Local => {
                let started = Instant::now();
                let decision = Decision {
                    local: true,
                    ..self.decide_locally(charge, now)
                };
                self.metrics.decided(StoreKind::Local, started.elapsed());
                Answer::Decided(decision)
            }
        }
    }

    /// The same rules in this instance's memory, each limit divided by the
    /// expected number of instances.
    pub(super) fn decide_locally(&self, charge: Charge<'_>, now: u64) -> Decision {
        if self.local_instances <= 1 {
            return self.local.decide_at(charge, now);
        }
        let scale = |n: u64| (n / self.local_instances).max(charge.cost).max(1);
        let scaled: Vec<Limit> = charge
            .limits
            .iter()
            .map(|l| Limit {
                limit: scale(l.limit),
                burst: scale(l.burst),
                ..*l
            })
            .collect();
        self.local.decide_at(
            Charge {
                limits: &scaled,
                ..charge
            },
            now,
        )
    }
}
