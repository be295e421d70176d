//! A route's answer to one request: each limit's [`Verdict`], combined
//! into the route's [`Decision`] (all must allow; the most constrained is
//! reported; an admitted request held by a limit's delay waits for the
//! longest).

/// One limit's answer to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Verdict {
    /// The request fits.
    pub allowed: bool,
    /// Units left after this request (before it, when denied).
    pub remaining: u64,
    /// Milliseconds until at least one more unit is made available,
    /// whether or not units remain and whatever this request's cost
    /// (`RateLimit`'s `t` per draft-ietf-httpapi-ratelimit-headers-10): a
    /// fixed window's end, the oldest logged unit leaving, the weighted
    /// count falling by a unit, the next token added (0 while a bucket is
    /// full).
    pub next_ms: u64,
    /// Milliseconds until this request would fit. When allowed, 0, or
    /// for a limit with a delay ([`super::Limit::delay_ms`]) that admitted the
    /// request past its burst, how long the request is held before it
    /// goes: its unit is taken now, and it fits then.
    pub retry_after_ms: u64,
}

/// What one limit holds for a client, read without consuming: for the
/// standing readout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Standing {
    /// What a request of nothing would be told now.
    pub verdict: Verdict,
    /// Units an operator granted past the limit that are still in force
    /// (a fixed window's credits, until its window ends); 0 for the
    /// algorithms a credit refills instead.
    pub granted: u64,
}

/// A route's answer to one request: its limits' verdicts combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Decision {
    /// Every limit allowed the request (and it was consumed from all).
    pub allowed: bool,
    /// Units left in the most constrained limit.
    pub remaining: u64,
    /// Milliseconds until that limit makes at least one more unit
    /// available (`t`; see [`Verdict::next_ms`]).
    pub next_ms: u64,
    /// Milliseconds until every denying limit would allow. When allowed,
    /// how long the request is held before it goes: the longest wait of
    /// its limits with a delay (see [`Verdict::retry_after_ms`]), else 0.
    pub retry_after_ms: u64,
    /// Index in the route's limits of the limit reported in headers: the
    /// most constrained when allowed, the longest wait when denied.
    pub limit: usize,
    /// When the store decided (ms, the store's clock): what a settlement of
    /// this decision's reservation names (see [`Settlement`]).
    pub at_ms: u64,
    /// Decided in this instance's memory while the shared store was down
    /// (`on_error = "local"`): its settlement goes there too.
    pub local: bool,
    /// The most constrained limit of the kind `limit` is not (limits that
    /// count requests, limits that count the route's units), when the
    /// route has both: see [`Self::combine_kinds`].
    pub other: Option<Brief>,
}

/// One limit's standing in a [`Decision`], for fields that report each
/// kind of limit on its own (`rate_limit_headers = "openai"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Brief {
    /// Index in the route's limits.
    pub limit: u16,
    /// Units left in it.
    pub remaining: u64,
    /// Milliseconds until it makes at least one more unit available.
    pub next_ms: u64,
}

impl Decision {
    /// Combines per-limit verdicts, in the route's limit order.
    pub fn combine(verdicts: impl IntoIterator<Item = Verdict>) -> Self {
        Self::combine_kinds(verdicts.into_iter().map(|v| (false, v)))
    }

    /// Combines per-limit verdicts, in the route's limit order, each with
    /// whether its limit counts requests (`counts = "requests"`) rather
    /// than the route's units: the most constrained of all is reported,
    /// and the most constrained of the other kind too ([`Self::other`]).
    pub fn combine_kinds(verdicts: impl IntoIterator<Item = (bool, Verdict)>) -> Self {
        Self::combine_at(
            verdicts
                .into_iter()
                .enumerate()
                .map(|(i, (counts_requests, v))| (i, counts_requests, v)),
        )
    }

    /// As [`Self::combine_kinds`], each verdict with its limit's index in
    /// the route's limits, for verdicts that come from different places
    /// (slices in hand and the store), in index order.
    pub fn combine_at(verdicts: impl IntoIterator<Item = (usize, bool, Verdict)>) -> Self {
        let mut out: Option<Decision> = None;
        // The most constrained of each kind: (index, verdict).
        let mut kinds: [Option<(usize, Verdict)>; 2] = [None, None];
        let mut winner_kind = false;
        // The longest wait of the limits that admitted with one.
        let mut wait = 0;
        for (i, counts_requests, v) in verdicts {
            if v.allowed {
                wait = wait.max(v.retry_after_ms);
            }
            let kind = &mut kinds[usize::from(counts_requests)];
            if kind.is_none_or(|(_, best)| v.constrains_more_than(&best)) {
                *kind = Some((i, v));
            }
            let candidate = Decision {
                allowed: v.allowed,
                remaining: v.remaining,
                next_ms: v.next_ms,
                retry_after_ms: v.retry_after_ms,
                limit: i,
                at_ms: 0,
                local: false,
                other: None,
            };
            out = Some(match out {
                None => {
                    winner_kind = counts_requests;
                    candidate
                }
                Some(best) => {
                    let best_verdict = Verdict {
                        allowed: best.allowed,
                        remaining: best.remaining,
                        next_ms: best.next_ms,
                        retry_after_ms: best.retry_after_ms,
                    };
                    if v.constrains_more_than(&best_verdict) {
                        winner_kind = counts_requests;
                        Decision {
                            allowed: best.allowed && v.allowed,
                            ..candidate
                        }
                    } else {
                        Decision {
                            allowed: best.allowed && v.allowed,
                            ..best
                        }
                    }
                }
            });
        }
        let mut decision = out.unwrap_or(Decision {
            allowed: true,
            ..Decision::default()
        });
        if decision.allowed {
            decision.retry_after_ms = wait;
        }
        decision.other = kinds[usize::from(!winner_kind)].map(|(i, v)| Brief {
            limit: u16::try_from(i).unwrap_or(u16::MAX),
            remaining: v.remaining,
            next_ms: v.next_ms,
        });
        decision
    }
}

impl Decision {
    /// How long an admitted request is held before it goes (a limit
    /// with a delay admitted it past its burst); 0 for a denial.
    pub fn held_ms(&self) -> u64 {
        if self.allowed { self.retry_after_ms } else { 0 }
    }
}

impl Verdict {
    /// Whether this verdict is to be reported rather than `best`: a denial
    /// over an allowance, the longer wait of two denials, the fewer units
    /// left (then the longer wait for more) of two allowances.
    fn constrains_more_than(&self, best: &Verdict) -> bool {
        match (best.allowed, self.allowed) {
            (true, false) => true,
            (false, true) => false,
            (false, false) => self.retry_after_ms > best.retry_after_ms,
            (true, true) => {
                self.remaining < best.remaining
                    || (self.remaining == best.remaining && self.next_ms > best.next_ms)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(remaining: u64, next_ms: u64) -> Verdict {
        Verdict {
            allowed: true,
            remaining,
            next_ms,
            retry_after_ms: 0,
        }
    }

    fn denied(retry_after_ms: u64) -> Verdict {
        Verdict {
            allowed: false,
            remaining: 0,
            next_ms: retry_after_ms,
            retry_after_ms,
        }
    }

    #[test]
    fn most_constrained_limit_is_reported_when_all_allow() {
        let d = Decision::combine([allowed(10, 1000), allowed(2, 500), allowed(2, 900)]);
        assert!(d.allowed);
        assert_eq!((d.limit, d.remaining, d.next_ms), (2, 2, 900));
    }

    #[test]
    fn longest_wait_is_reported_when_any_denies() {
        let d = Decision::combine([allowed(0, 1000), denied(300), denied(700), allowed(5, 5)]);
        assert!(!d.allowed);
        assert_eq!((d.limit, d.retry_after_ms), (2, 700));
    }

    #[test]
    fn the_most_constrained_limit_of_the_other_kind_is_reported_too() {
        // Units: 2 left (most constrained); requests: 7 and 3 left.
        let d = Decision::combine_kinds([
            (false, allowed(2, 900)),
            (true, allowed(7, 100)),
            (true, allowed(3, 400)),
        ]);
        assert_eq!((d.limit, d.remaining), (0, 2));
        let other = d.other.expect("the requests' limit");
        assert_eq!((other.limit, other.remaining, other.next_ms), (2, 3, 400));
        // A requests' limit denies: it is reported, the units' beside it.
        let d = Decision::combine_kinds([(false, allowed(2, 900)), (true, denied(300))]);
        assert!(!d.allowed);
        assert_eq!(d.limit, 1);
        assert_eq!(d.other.map(|o| (o.limit, o.remaining)), Some((0, 2)));
        // One kind only: nothing beside.
        assert_eq!(
            Decision::combine([allowed(1, 1), allowed(2, 2)]).other,
            None
        );
    }

    #[test]
    fn an_admitted_request_waits_for_the_longest_of_its_limits_waits() {
        let held = |remaining, wait| Verdict {
            retry_after_ms: wait,
            ..allowed(remaining, 100)
        };
        let d = Decision::combine([allowed(5, 100), held(0, 300), held(0, 700), allowed(1, 9)]);
        assert!(d.allowed);
        assert_eq!(d.held_ms(), 700);
        // The most constrained is still the one reported in headers.
        assert_eq!(d.limit, 1);
        // A denial holds nothing and tells its own wait.
        let d = Decision::combine([held(0, 700), denied(300)]);
        assert_eq!((d.allowed, d.held_ms(), d.retry_after_ms), (false, 0, 300));
    }

    #[test]
    fn no_limits_allow() {
        assert!(Decision::combine([]).allowed);
    }
}
