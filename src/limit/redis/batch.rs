//! Decisions queued and sent together: one call decides one or more
//! requests, each all or nothing.

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use redis::{Cmd, RedisWrite, ToRedisArgs, Value};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::limit::{Decision, Limit, Settled, Settlement, StoreError};

use super::code::FUNCTIONS_NO;
use super::keys::Key;
use super::replies::{next_decision, verdict_values};
use super::{Link, MAX_BATCH};

/// The hash tags of a decision's keys: one for all (a route's client),
/// or one per limit with the limit's place in its scope.
#[derive(Clone, Copy)]
pub(super) enum Tags<'a> {
    One(&'a str),
    Each(&'a [(String, usize)]),
}

impl<'a> Tags<'a> {
    /// The tag and index of the key of the limit at `position`.
    pub(super) fn get(self, position: usize) -> (&'a str, usize) {
        match self {
            Self::One(tag) => (tag, position),
            Self::Each(each) => each
                .get(position)
                .map_or(("", position), |(tag, index)| (tag.as_str(), *index)),
        }
    }
}

/// [`Tags`], owned while a decision waits.
#[derive(Debug, Clone)]
pub(super) enum OwnedTags {
    One(String),
    Each(Box<[(String, usize)]>),
}

impl OwnedTags {
    pub(super) fn borrow(&self) -> Tags<'_> {
        match self {
            Self::One(tag) => Tags::One(tag),
            Self::Each(each) => Tags::Each(each),
        }
    }

    /// The first key's tag: where a cluster sends the decision.
    pub(super) fn first(&self) -> &str {
        match self {
            Self::One(tag) => tag,
            Self::Each(each) => each.first().map_or("", |(tag, _)| tag),
        }
    }
}

/// One decision as a call carries it.
#[derive(Clone, Copy)]
pub(super) struct Ask<'a> {
    /// The hash tags of its keys.
    pub(super) tags: Tags<'a>,
    pub(super) limits: &'a [Limit],
    pub(super) cost: u64,
    /// Settles a reservation instead of deciding.
    pub(super) settle: Option<Settlement>,
    /// Replaces Redis `TIME` (tests only).
    pub(super) now: Option<u64>,
}

/// A decision waiting for a call, and where its answer goes.
pub(super) struct Pending {
    pub(super) tags: OwnedTags,
    pub(super) limits: Limits,
    pub(super) cost: u64,
    pub(super) settle: Option<Settlement>,
    pub(super) now: Option<u64>,
    /// When the request stops waiting: the store's timeout after it was
    /// queued. The call that carries it ends by then.
    pub(super) deadline: Instant,
    pub(super) reply: oneshot::Sender<Result<Decision, StoreError>>,
}

impl Pending {
    pub(super) fn ask(&self) -> Ask<'_> {
        Ask {
            tags: self.tags.borrow(),
            limits: self.limits.as_slice(),
            cost: self.cost,
            settle: self.settle,
            now: self.now,
        }
    }
}

/// A route's limits, owned while the decision waits: most routes have one,
/// which needs no allocation.
pub(super) enum Limits {
    One(Limit),
    Many(Box<[Limit]>),
}

impl Limits {
    pub(super) fn new(limits: &[Limit]) -> Self {
        match limits {
            [one] => Self::One(*one),
            many => Self::Many(many.into()),
        }
    }

    pub(super) fn as_slice(&self) -> &[Limit] {
        match self {
            Self::One(one) => std::slice::from_ref(one),
            Self::Many(many) => many,
        }
    }
}

/// One of the tasks that send a store's calls: takes every decision waiting
/// (up to [`MAX_BATCH`]), sends them in one call, hands each its answer,
/// and starts over. Ends when the store is dropped.
///
/// A decision is never answered later than its deadline: one whose
/// deadline passed while it waited for a task is answered with a timeout
/// at once, and a call is given up at the earliest deadline it carries.
/// That is the only timer a decision costs: one per call, not one per
/// request.
pub(super) async fn send_calls(
    link: Arc<Link>,
    waiting: Arc<tokio::sync::Mutex<mpsc::UnboundedReceiver<Pending>>>,
) {
    let mut batch: Vec<Pending> = Vec::with_capacity(MAX_BATCH);
    let mut command = Cmd::new();
    loop {
        // One task at a time waits for decisions; the others are in flight.
        if waiting.lock().await.recv_many(&mut batch, MAX_BATCH).await == 0 {
            return;
        }
        // A decision whose request gave up (the client left) is not sent:
        // nothing would see its answer. One that waited past its deadline
        // is answered with a timeout.
        let now = Instant::now();
        for late in batch.extract_if(.., |p| p.reply.is_closed() || p.deadline <= now) {
            let _ = late.reply.send(Err(StoreError::Timeout(link.timeout)));
        }
        let Some(deadline) = batch.iter().map(|p| p.deadline).min() else {
            continue;
        };
        let asks = batch.iter().map(Pending::ask);
        let sent = tokio::time::timeout_at(deadline, link.call(&mut command, asks));
        let answer = match sent.await {
            Ok(reply) => reply,
            Err(_) => Err(StoreError::Timeout(link.timeout)),
        };
        deliver(&mut batch, answer);
    }
}

/// Hands each decision of `batch` its part of `answer`, in order, and
/// empties `batch`.
pub(super) fn deliver(batch: &mut Vec<Pending>, answer: Result<Value, StoreError>) {
    let limits = batch.iter().map(|p| p.limits.as_slice().len()).sum();
    let failed = match answer
        .as_ref()
        .map(|reply| verdict_values(reply, limits, batch.len()))
    {
        Ok(Ok(values)) => {
            let mut rest = values;
            for pending in batch.drain(..) {
                let decision = next_decision(&mut rest, pending.limits.as_slice());
                let _ = pending.reply.send(Ok(decision));
            }
            return;
        }
        Ok(Err(e)) => e,
        Err(e) => e.clone(),
    };
    for pending in batch.drain(..) {
        let _ = pending.reply.send(Err(failed.clone()));
    }
}

/// A route's limits as the Lua code reads them: `<algorithm> <limit>
/// <window_ms> <burst> <per request>` for each (the last 1 when the limit
/// counts each request as one unit, else 0, followed by
/// `p<duration>,<factor per mille>,<max>,<forget>` for a limit with a
/// penalty, then `d<delay ms>` for a limit with a delay), separated by
/// spaces; a window
/// by the calendar is its four boundaries, `<b0>,<b1>,<b2>,<b3>`, in place
/// of `<window_ms>`. A route sends the same text with every decision (a
/// calendar route, the same within a window), so Redis parses it once.
pub(super) struct Spec<'a>(&'a [Limit]);

impl ToRedisArgs for Spec<'_> {
    fn write_redis_args<W: ?Sized + RedisWrite>(&self, out: &mut W) {
        let mut spec = out.writer_for_next_arg();
        let mut digits = itoa::Buffer::new();
        // Writing into the command's buffer cannot fail.
        for (i, limit) in self.0.iter().enumerate() {
            if i > 0 {
                let _ = spec.write_all(b" ");
            }
            let _ = spec.write_all(limit.algorithm.name().as_bytes());
            let _ = spec.write_all(b" ");
            let _ = spec.write_all(digits.format(limit.limit).as_bytes());
            let _ = spec.write_all(b" ");
            match &limit.bounds {
                None => {
                    let _ = spec.write_all(digits.format(limit.window_ms).as_bytes());
                }
                Some(bounds) => {
                    for (i, b) in bounds.iter().enumerate() {
                        if i > 0 {
                            let _ = spec.write_all(b",");
                        }
                        let _ = spec.write_all(digits.format(*b).as_bytes());
                    }
                }
            }
            let _ = spec.write_all(b" ");
            let _ = spec.write_all(digits.format(limit.burst).as_bytes());
            let _ = spec.write_all(if limit.counts_requests { b" 1" } else { b" 0" });
            if let Some(p) = &limit.penalty {
                let parts = [p.duration_ms, p.factor_permille, p.max_ms, p.forget_ms];
                for (i, n) in parts.into_iter().enumerate() {
                    let _ = spec.write_all(if i == 0 { b"p" } else { b"," });
                    let _ = spec.write_all(digits.format(n).as_bytes());
                }
            }
            if limit.delay_ms > 0 {
                let _ = spec.write_all(b"d");
                let _ = spec.write_all(digits.format(limit.delay_ms).as_bytes());
            }
        }
    }
}

impl Link {
    /// Builds in `command`: `FCALL <function> <number of keys> <keys…>`, then
    /// per decision `<now> <cost> "<algorithm> <limit> <window> <burst>…"`
    /// (a settlement's cost is `"<used> <at> <reserved>"`, a refused
    /// part's `"r <at> <reserved>"`, a grant's `"g <units>"`);
    /// or `EVALSHA <sha> …` with the same arguments where Redis has no
    /// functions.
    pub(super) fn command<'a>(
        &self,
        command: &mut Cmd,
        asks: impl Iterator<Item = Ask<'a>> + Clone,
    ) {
        command.clear();
        if self.functions.load(Ordering::Relaxed) == FUNCTIONS_NO {
            command.arg("EVALSHA").arg(self.script.get_hash());
        } else {
            command.arg("FCALL").arg(self.library.function.as_str());
        }
        command.arg(asks.clone().map(|a| a.limits.len()).sum::<usize>());
        for ask in asks.clone() {
            for (position, limit) in ask.limits.iter().enumerate() {
                let (tag, index) = ask.tags.get(position);
                command.arg(Key { tag, index, limit });
            }
        }
        for ask in asks {
            match ask.now {
                Some(now) => command.arg(now),
                None => command.arg(""),
            };
            match ask.settle {
                None => command.arg(ask.cost),
                Some(s) if s.kind == Settled::Grant => command.arg(format!("g {}", s.reserved)),
                Some(s) if s.kind == Settled::GiveBack => {
                    command.arg(format!("r {} {}", s.at_ms, s.reserved))
                }
                Some(s) => command.arg(format!("{} {} {}", ask.cost, s.at_ms, s.reserved)),
            };
            command.arg(Spec(ask.limits));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;
    use crate::limit::redis::RedisStore;
    use std::time::Duration;

    #[test]
    fn calls_carry_keys_first_then_now_cost_and_limits_per_decision() {
        let store =
            RedisStore::new("redis://127.0.0.1:1", "p", Duration::from_secs(1)).expect("store");
        let one = [Limit::new(Algorithm::Gcra, 5, 1_000).with_burst(7)];
        let two = [
            Limit::new(Algorithm::FixedWindow, 3, 60_000),
            Limit::new(Algorithm::SlidingLog, 10, 2_500).counting_requests(),
        ];
        let asks = [
            Ask {
                tags: Tags::One("t1"),
                limits: &one,
                cost: 1,
                settle: None,
                now: None,
            },
            Ask {
                tags: Tags::One("t2"),
                limits: &two,
                cost: 4,
                settle: None,
                now: Some(1_700_000_000_123),
            },
            Ask {
                tags: Tags::One("t1"),
                limits: &one,
                cost: 3,
                settle: Some(Settlement {
                    at_ms: 1_700_000_000_000,
                    reserved: 7,
                    local: false,
                    kind: crate::limit::Settled::Reservation,
                }),
                now: None,
            },
        ];
        let mut command = Cmd::new();
        store.link.command(&mut command, asks.iter().copied());
        let args: Vec<String> = command
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                _ => "<not a plain argument>".to_owned(),
            })
            .collect();
        assert_eq!(
            args[2..],
            [
                "4",
                "t1:0:gcra:1000",
                "t2:0:fixed_window:60000",
                "t2:1:sliding_log:2500",
                "t1:0:gcra:1000",
                "",
                "1",
                "gcra 5 1000 7 0",
                "1700000000123",
                "4",
                "fixed_window 3 60000 3 0 sliding_log 10 2500 10 1",
                "",
                "3 1700000000000 7",
                "gcra 5 1000 7 0",
            ]
        );
    }
}
