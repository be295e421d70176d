//! Reading a call's verdicts back: four integers per limit, per decision.

use redis::Value;

use crate::limit::{Decision, StoreError, Verdict};

/// The verdicts in the reply to a call: four integers per limit (allowed,
/// remaining, next_ms, retry_after_ms), `limits` limits in all, read from
/// the array as it came; anything else is an error.
pub(super) fn verdict_values(reply: &Value, limits: usize) -> Result<&[Value], StoreError> {
    let values = match reply {
        Value::Array(values) if values.len() == limits * 4 => values,
        Value::Array(values) => {
            return Err(StoreError::Backend(format!(
                "the decision script answered {} values for {limits} limits",
                values.len()
            )));
        }
        other => {
            return Err(StoreError::Backend(format!(
                "the decision script answered {other:?}, not integers"
            )));
        }
    };
    if let Some(other) = values.iter().find(|v| !matches!(v, Value::Int(_))) {
        return Err(StoreError::Backend(format!(
            "the decision script answered {other:?} among its integers"
        )));
    }
    Ok(values)
}

/// One decision from its verdicts (already checked to be integers, four per
/// limit).
pub(super) fn decision_from_values(values: &[Value]) -> Decision {
    let int = |v: &Value| match v {
        Value::Int(n) => u64::try_from(*n).unwrap_or(0),
        _ => 0,
    };
    Decision::combine(values.chunks_exact(4).map(|v| Verdict {
        allowed: matches!(v[0], Value::Int(1)),
        remaining: int(&v[1]),
        next_ms: int(&v[2]),
        retry_after_ms: int(&v[3]),
    }))
}

/// The next decision of a call's verdicts, of `limits` limits, taken off
/// the front of `rest` (already checked to hold four integers per limit of
/// every decision).
pub(super) fn next_decision(rest: &mut &[Value], limits: usize) -> Decision {
    let (mine, others) = rest.split_at((limits * 4).min(rest.len()));
    *rest = others;
    decision_from_values(mine)
}

/// The decision in the reply to a call that carried only it.
pub(super) fn decision_from_reply(reply: &Value, limits: usize) -> Result<Decision, StoreError> {
    verdict_values(reply, limits).map(decision_from_values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scripts_reply_is_read_as_four_integers_per_limit() {
        let ints = |v: &[i64]| Value::Array(v.iter().map(|&n| Value::Int(n)).collect());
        let d = decision_from_reply(&ints(&[1, 5, 1000, 0]), 1).expect("one limit");
        assert!(d.allowed);
        assert_eq!((d.remaining, d.next_ms, d.retry_after_ms), (5, 1000, 0));
        let d = decision_from_reply(&ints(&[1, 9, 500, 0, 0, -3, 60000, 1 << 50]), 2)
            .expect("two limits");
        assert!(!d.allowed);
        assert_eq!((d.limit, d.remaining, d.retry_after_ms), (1, 0, 1 << 50));
        for bad in [
            ints(&[1, 5, 1000]),
            ints(&[1, 5, 1000, 0, 1]),
            Value::Array(vec![
                Value::Int(1),
                Value::Nil,
                Value::Int(1000),
                Value::Int(0),
            ]),
            Value::Int(1),
            Value::BulkString(b"1 5 1000 0".to_vec()),
        ] {
            assert!(decision_from_reply(&bad, 1).is_err(), "{bad:?}");
        }
    }
}
