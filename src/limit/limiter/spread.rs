//! A decision whose keys lie in several Redis Cluster slots: a user's, an
//! organisation's and the whole API's count hash to different slots, often
//! on different primaries, and one call can only touch one slot.
//!
//! The parts are taken one slot after another, in slot order, each in one
//! atomic call that consumes from its limits only if all of them allow.
//! When a part refuses (or its primary cannot answer), the parts already
//! taken are given back, settled to nothing where the units still count,
//! so a refused request consumes nothing anywhere and no limit ever counts
//! past its number. What this costs, and all it costs, is that between a
//! part being taken and given back, a concurrent request may find those
//! units held and be refused although, decided at another moment, it
//! would have fitted: a false refusal, never an admission past a limit.
//! A single Redis or a Sentinel group decides every key in one call and
//! has none.

use super::Guarded;
use crate::limit::backend::Part as SlotPart;
use crate::limit::backend::StoreNode as _;
use crate::limit::{
    Backend, Brief, Charge, CountKey, Decision, Limit, Settlement, StoreError, Verdict,
};

/// The limits of one slot: their positions in the charge, their own
/// copies, for a charge of their own, and where they go (kept to give
/// them back there).
struct Part<T> {
    positions: Vec<usize>,
    limits: Vec<Limit>,
    keys: Vec<CountKey>,
    target: T,
}

impl<T> Part<T> {
    fn of(charge: &Charge<'_>, positions: Vec<usize>, target: T) -> Self {
        Self {
            limits: positions.iter().map(|&i| charge.limits[i]).collect(),
            keys: positions.iter().map(|&i| charge.keys[i].clone()).collect(),
            positions,
            target,
        }
    }

    fn charge<'a>(&'a self, whole: &Charge<'a>) -> Charge<'a> {
        Charge {
            limits: &self.limits,
            keys: &self.keys,
            ..*whole
        }
    }
}

impl<B: Backend> Guarded<B> {
    /// Decides (or settles) `charge` in `parts` (positions of its limits
    /// and where they go, one part per slot, in slot order; see
    /// [`Backend::parts`]).
    pub(super) async fn decide_spread(
        &self,
        charge: Charge<'_>,
        parts: Vec<SlotPart<B::Target>>,
        now: u64,
    ) -> Result<Decision, StoreError> {
        let mut taken: Vec<(Part<B::Target>, Decision)> = Vec::with_capacity(parts.len());
        let mut failed = None;
        let mut parts = parts.into_iter();
        while let Some((positions, target)) = parts.next() {
            let result = match target {
                Ok(target) => {
                    let part = Part::of(&charge, positions, target);
                    let decided = self
                        .through_breaker(part.target.clone(), part.charge(&charge), now)
                        .await;
                    decided.map(|d| (part, d))
                }
                Err(e) => Err(e),
            };
            match result {
                Ok((part, d)) if d.allowed || charge.settle.is_some() => taken.push((part, d)),
                Ok((part, refused)) => {
                    self.give_back(&charge, &mut taken, now).await;
                    taken.push((part, refused));
                    self.read_the_rest(&charge, parts, &mut taken).await;
                    return Ok(combined(&taken, charge.limits));
                }
                // A settlement goes on with the other parts: each is owed.
                Err(e) if charge.settle.is_some() => failed = Some(e),
                Err(e) => {
                    self.give_back(&charge, &mut taken, now).await;
                    return Err(e);
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(combined(&taken, charge.limits)),
        }
    }

    /// Gives back the parts `taken` of a refused `charge`: each limit
    /// gets back what it took, the cost or, for a limit that counts
    /// requests, one ([`Settlement::refused`]). A part that cannot be
    /// given back (its primary went away meanwhile) stays consumed:
    /// counted too much, never too little. The units given back are
    /// counted per part: the most any of its limits took. Each part given
    /// back then reports what it holds, nothing taken.
    async fn give_back(
        &self,
        charge: &Charge<'_>,
        taken: &mut [(Part<B::Target>, Decision)],
        now: u64,
    ) {
        for (part, decision) in taken {
            let back = Charge {
                cost: 0,
                settle: Some(Settlement {
                    at_ms: decision.at_ms,
                    reserved: charge.cost,
                    local: false,
                    kind: crate::limit::Settled::GiveBack,
                }),
                ..part.charge(charge)
            };
            match self.through_breaker(part.target.clone(), back, now).await {
                Ok(held) => {
                    let took = part.limits.iter().map(|l| l.cost_of(charge.cost)).max();
                    self.metrics.given_back.inc_by(took.unwrap_or(0));
                    *decision = held;
                }
                Err(error) => {
                    if crate::clock::once_a_second(&self.last_logged, now) {
                        tracing::warn!(%error, route = %charge.route, "cannot give back the units a refused request held in another Redis Cluster slot; they stay counted until their window passes");
                    }
                }
            }
        }
    }
}

impl<B: Backend> Guarded<B> {
    /// After a refusal, the parts of `charge` not asked (`rest`): what each
    /// holds, read without taking, so that a refused request reports every
    /// limit as the store holds it (both kinds of OpenAI's fields among
    /// them). A part that cannot be read is left out.
    async fn read_the_rest(
        &self,
        charge: &Charge<'_>,
        rest: impl Iterator<Item = SlotPart<B::Target>>,
        taken: &mut Vec<(Part<B::Target>, Decision)>,
    ) {
        for (positions, target) in rest {
            let Ok(target) = target else {
                continue;
            };
            if B::node_of(&target).breaker().is_open() {
                continue;
            }
            let part = Part::of(charge, positions, target);
            let Ok(held) = self
                .store
                .peek_on(part.target.clone(), part.charge(charge))
                .await
            else {
                continue;
            };
            let verdicts = part.limits.iter().zip(held).map(|(l, s)| {
                let verdict = Verdict {
                    allowed: true,
                    retry_after_ms: 0,
                    ..s.verdict
                };
                (l.counts_requests, verdict)
            });
            let read = Decision::combine_kinds(verdicts);
            taken.push((part, read));
        }
    }
}

/// The parts' decisions as one: allowed when every part allowed, naming
/// the most constrained limit (or the longest wait) by its position in the
/// whole charge, and the most constrained of the other kind of `limits`
/// (see [`Decision::combine_kinds`]), at the first part's time.
fn combined<T>(parts: &[(Part<T>, Decision)], limits: &[Limit]) -> Decision {
    let verdicts = parts.iter().map(|(_, d)| Verdict {
        allowed: d.allowed,
        remaining: d.remaining,
        next_ms: d.next_ms,
        retry_after_ms: d.retry_after_ms,
    });
    let mut decision = Decision::combine(verdicts);
    if let Some((part, d)) = parts.get(decision.limit) {
        decision.limit = part.positions.get(d.limit).copied().unwrap_or(0);
    }
    let counts_requests = |at: u16| {
        limits
            .get(usize::from(at))
            .is_some_and(|l| l.counts_requests)
    };
    let winner = limits
        .get(decision.limit)
        .is_some_and(|l| l.counts_requests);
    let global = |part: &Part<T>, at: u16| {
        let at = part.positions.get(usize::from(at)).copied().unwrap_or(0);
        u16::try_from(at).unwrap_or(u16::MAX)
    };
    decision.other = parts
        .iter()
        .flat_map(|(part, d)| {
            let main = Brief {
                limit: global(part, u16::try_from(d.limit).unwrap_or(u16::MAX)),
                remaining: d.remaining,
                next_ms: d.next_ms,
            };
            let other = d.other.map(|o| Brief {
                limit: global(part, o.limit),
                ..o
            });
            [Some(main), other]
        })
        .flatten()
        .filter(|b| counts_requests(b.limit) != winner)
        .min_by_key(|b| (b.remaining, std::cmp::Reverse(b.next_ms)));
    decision.at_ms = parts.first().map_or(0, |(_, d)| d.at_ms);
    decision
}
