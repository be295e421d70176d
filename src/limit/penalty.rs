//! Penalties that outlast a window (`penalty = { … }` on a limit): a
//! client the limit refuses stays refused for the penalty's time, longer
//! each time it offends again before its offences are forgotten.
//!
//! An offence is a request the limit itself refuses (not one refused
//! while the penalty runs, so hammering does not lengthen it). The `n`th
//! offence in a row serves `duration × factor^(n−1)`, at most `max`; the
//! count of offences is forgotten `forget` after the last one (or when the
//! penalty ends, if later). While it runs, the limit refuses every request
//! of the client with the wait to its end, before its own count is read.
//! The store keeps the penalty beside the limit's count (in Redis, under
//! the count's key and `:p`, in the same slot), so every instance sees it,
//! and an instance that was told remembers the refusal until the end
//! without asking the store again.

use super::Verdict;

/// A limit's penalty terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Penalty {
    /// The first offence's penalty.
    pub duration_ms: u64,
    /// Each offence in a row serves this much longer than the one before,
    /// in thousandths (1 000: the same each time).
    pub factor_permille: u64,
    /// The longest penalty.
    pub max_ms: u64,
    /// Offences are forgotten this long after the last one.
    pub forget_ms: u64,
}

impl Penalty {
    /// As operators read it: `10s, ×2 to 4h, forgotten after 1d`.
    pub fn describe(&self) -> String {
        let mut out = crate::clock::written(self.duration_ms);
        if self.factor_permille != 1_000 {
            let factor = self.factor_permille as f64 / 1000.0;
            out.push_str(&format!(
                ", ×{factor} to {}",
                crate::clock::written(self.max_ms)
            ));
        }
        out.push_str(&format!(
            ", forgotten after {}",
            crate::clock::written(self.forget_ms)
        ));
        out
    }

    /// The penalty of the `offence`th offence in a row (the first is 1).
    pub fn serves(&self, offence: u64) -> u64 {
        let mut d = self.duration_ms.min(self.max_ms);
        for _ in 1..offence {
            d = (d.saturating_mul(self.factor_permille) / 1000).min(self.max_ms);
            if d == self.max_ms {
                break;
            }
        }
        d
    }
}

/// A client's penalty under one limit, as the memory store keeps it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sentence {
    /// When the penalty ends (ms); past it, none runs.
    pub until: u64,
    /// Offences in a row so far.
    pub offences: u64,
    /// When the offences are forgotten.
    pub remembered_until: u64,
}

impl Sentence {
    /// The wait until the penalty running at `now` ends, if one does.
    pub fn running(&self, now: u64) -> Option<u64> {
        (self.until > now).then(|| self.until - now)
    }

    /// An offence at `now` under `penalty`: the penalty it serves.
    pub fn offend(&mut self, penalty: &Penalty, now: u64) -> u64 {
        let offences = if self.remembered_until > now {
            self.offences + 1
        } else {
            1
        };
        let serves = penalty.serves(offences);
        *self = Self {
            until: now + serves,
            offences,
            remembered_until: now + serves.max(penalty.forget_ms),
        };
        serves
    }
}

/// A penalty in force, as the store lists it for operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Served {
    /// The scope counted in: a route's name, or `@` and a budget's.
    pub scope: String,
    /// The limit's place among its scope's limits.
    pub index: usize,
    /// The client, as the store writes it in keys (`a:<address>`, or `k:`
    /// and a keyed digest of a value).
    pub client: String,
    /// Milliseconds until it ends.
    pub ends_in_ms: u64,
    /// Offences in a row.
    pub offences: u64,
}

/// The verdict of a limit whose penalty runs for `wait` more
/// milliseconds: refused, nothing remaining, until then.
pub fn refused_for(wait: u64) -> Verdict {
    Verdict {
        allowed: false,
        remaining: 0,
        next_ms: wait,
        retry_after_ms: wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOUBLING: Penalty = Penalty {
        duration_ms: 1_000,
        factor_permille: 2_000,
        max_ms: 5_000,
        forget_ms: 60_000,
    };

    #[test]
    fn each_offence_in_a_row_serves_longer_up_to_the_ceiling() {
        let served: Vec<u64> = (1..=5).map(|n| DOUBLING.serves(n)).collect();
        assert_eq!(served, [1_000, 2_000, 4_000, 5_000, 5_000]);
        let flat = Penalty {
            factor_permille: 1_000,
            ..DOUBLING
        };
        assert_eq!(flat.serves(9), 1_000);
    }

    #[test]
    fn offences_are_forgotten_after_the_quiet_time() {
        let mut s = Sentence::default();
        assert_eq!(s.running(0), None);
        assert_eq!(s.offend(&DOUBLING, 10_000), 1_000);
        assert_eq!(s.running(10_500), Some(500));
        assert_eq!(s.running(11_000), None);
        assert_eq!(s.offend(&DOUBLING, 20_000), 2_000);
        // Forgotten a minute after the last offence: the next is a first.
        assert_eq!(s.offend(&DOUBLING, 20_000 + 60_000), 1_000);
    }
}
