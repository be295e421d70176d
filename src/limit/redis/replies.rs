//! Reading a call's verdicts back: four integers per limit and the time it
//! was decided at, per decision, packed into one string.

use redis::Value;

use crate::limit::{Decision, Limit, Standing, StoreError, Verdict};

/// Bytes of one packed integer.
const INT: usize = 8;
/// Bytes of one limit's verdict: allowed, remaining, next_ms,
/// retry_after_ms.
const VERDICT: usize = 4 * INT;

/// The verdicts in the reply to a call: one string of signed 64-bit
/// little-endian integers, four per limit (allowed, remaining, next_ms,
/// retry_after_ms) and one per decision (when it was decided), `limits`
/// limits of `decisions` decisions in all; anything else is an error.
///
/// One string rather than an array of integers: redis-rs reads each array
/// element as a value of its own, which cost more than anything else
/// floodgate does with a reply.
pub(super) fn verdict_values(
    reply: &Value,
    limits: usize,
    decisions: usize,
) -> Result<&[u8], StoreError> {
    match reply {
        Value::BulkString(bytes) if bytes.len() == limits * VERDICT + decisions * INT => Ok(bytes),
        Value::BulkString(bytes) => Err(StoreError::Backend(format!(
            "the decision code answered {} bytes for {limits} limits",
            bytes.len()
        ))),
        other => Err(StoreError::Backend(format!(
            "the decision code answered {other:?}, not its packed verdicts"
        ))),
    }
}

/// One decision on `limits` from its packed verdicts and time (already
/// checked to hold whole verdicts).
pub(super) fn decision_from_values(values: &[u8], limits: &[Limit]) -> Decision {
    let (verdicts, at) = values.split_at(values.len().saturating_sub(INT));
    let int = |at: &[u8]| {
        let mut bytes = [0u8; INT];
        bytes.copy_from_slice(&at[..INT]);
        i64::from_le_bytes(bytes)
    };
    let whole = |at: &[u8]| u64::try_from(int(at)).unwrap_or(0);
    let kinds = limits.iter().map(|l| l.counts_requests);
    // An allowed verdict (1) waits for nothing, and a settlement's fourth
    // integer is the units granted in force, not a wait; one admitted and
    // held (2, a limit with a delay) waits its fourth.
    let verdicts = verdicts.chunks_exact(VERDICT).map(|v| {
        let code = int(v);
        Verdict {
            allowed: code != 0,
            remaining: whole(&v[INT..]),
            next_ms: whole(&v[2 * INT..]),
            retry_after_ms: if code == 1 { 0 } else { whole(&v[3 * INT..]) },
        }
    });
    let mut decision = Decision::combine_kinds(kinds.zip(verdicts));
    if at.len() == INT {
        decision.at_ms = whole(at);
    }
    decision
}

/// The next decision of a call's verdicts, on `limits`, taken off the
/// front of `rest` (already checked to hold the verdicts of every
/// decision).
pub(super) fn next_decision(rest: &mut &[u8], limits: &[Limit]) -> Decision {
    let (mine, others) = rest.split_at((limits.len() * VERDICT + INT).min(rest.len()));
    *rest = others;
    decision_from_values(mine, limits)
}

/// What each limit holds, from the reply to a call that carried one read
/// (a settlement of nothing) on `limits` limits: a settlement's verdicts
/// carry the units granted in force where a decision's carry its wait.
pub(super) fn standing_from_reply(
    reply: &Value,
    limits: usize,
) -> Result<Vec<Standing>, StoreError> {
    let values = verdict_values(reply, limits, 1)?;
    let int = |at: &[u8]| {
        let mut bytes = [0u8; INT];
        bytes.copy_from_slice(&at[..INT]);
        u64::try_from(i64::from_le_bytes(bytes)).unwrap_or(0)
    };
    Ok(values[..limits * VERDICT]
        .chunks_exact(VERDICT)
        .map(|v| Standing {
            verdict: Verdict {
                allowed: int(v) == 1,
                remaining: int(&v[INT..]),
                next_ms: int(&v[2 * INT..]),
                retry_after_ms: 0,
            },
            granted: int(&v[3 * INT..]),
        })
        .collect())
}

/// The decision on `limits` in the reply to a call that carried only it.
pub(super) fn decision_from_reply(reply: &Value, limits: &[Limit]) -> Result<Decision, StoreError> {
    verdict_values(reply, limits.len(), 1).map(|values| decision_from_values(values, limits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_codes_reply_is_read_as_four_packed_integers_per_limit_and_the_time() {
        let packed = |v: &[i64]| {
            Value::BulkString(v.iter().flat_map(|n| n.to_le_bytes()).collect::<Vec<u8>>())
        };
        let one = [Limit::new(crate::limit::Algorithm::FixedWindow, 10, 1000)];
        let two = [
            one[0],
            Limit {
                counts_requests: true,
                ..one[0]
            },
        ];
        let d = decision_from_reply(&packed(&[1, 5, 1000, 0, 1_700_000_000_123]), &one)
            .expect("one limit");
        assert!(d.allowed);
        assert_eq!((d.remaining, d.next_ms, d.retry_after_ms), (5, 1000, 0));
        assert_eq!(d.at_ms, 1_700_000_000_123);
        let d = decision_from_reply(&packed(&[1, 9, 500, 0, 0, -3, 60000, 1 << 50, 7]), &two)
            .expect("two limits");
        assert!(!d.allowed);
        assert_eq!((d.limit, d.remaining, d.retry_after_ms), (1, 0, 1 << 50));
        // The limit of the other kind (units, beside requests) is read too.
        assert_eq!(
            d.other.map(|o| (o.limit, o.remaining, o.next_ms)),
            Some((0, 9, 500))
        );
        assert_eq!(d.at_ms, 7);
        // Admitted and held (2): the fourth is the wait.
        let d = decision_from_reply(&packed(&[2, 0, 100, 300, 7]), &one).expect("held");
        assert_eq!((d.allowed, d.held_ms()), (true, 300));
        for bad in [
            packed(&[1, 5, 1000, 0]),
            packed(&[1, 5, 1000, 0, 1, 2]),
            Value::BulkString(vec![1; 31]),
            Value::Array(vec![
                Value::Int(1),
                Value::Int(5),
                Value::Int(1000),
                Value::Int(0),
            ]),
            Value::Int(1),
            Value::Nil,
        ] {
            assert!(decision_from_reply(&bad, &one).is_err(), "{bad:?}");
        }
    }
}
