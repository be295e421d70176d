//! Reading every message already sent before refusing from memory.
//!
//! Redis writes a settlement's message to every subscriber's socket before
//! it answers the settlement, so once an operator's credit has returned,
//! the message is already in this instance's subscription socket; but the
//! listener may not have read it yet when the next request finds a
//! remembered denial of its keys. So a denial is refused from memory only
//! after a round of this barrier: each subscription sends PING and reads up
//! to its PONG, which Redis sends after every message queued before it on
//! that socket, noting each; then the denial is looked up again.
//!
//! Rounds are shared. A request asks for a round by raising the number
//! asked, and each subscription's listener answers the latest number it
//! sees with one PING: a PING sent before the request asked never answers
//! it, and however many requests ask meanwhile, each subscription sends one
//! PING per round trip.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

/// The rounds asked of this instance's subscriptions, and how far each
/// has answered.
#[derive(Debug)]
pub struct Barrier {
    /// The last round asked for.
    asked: watch::Sender<u64>,
    /// Changed whenever a subscription answers a round or ends.
    answers: watch::Sender<()>,
    /// The last round each live subscription answered.
    subscriptions: Mutex<Vec<Arc<AtomicU64>>>,
    /// Messages are read only in barrier rounds (a test's slow listener).
    held: AtomicBool,
    /// PINGs sent for rounds (`floodgate_store_given_back_barrier_pings_total`).
    pings: Counter,
}

impl Default for Barrier {
    fn default() -> Self {
        Self::new(Counter::default())
    }
}

impl Barrier {
    /// No subscription yet; counts the PINGs rounds cost in `pings`.
    pub fn new(pings: Counter) -> Self {
        Self {
            asked: watch::Sender::new(0),
            answers: watch::Sender::new(()),
            subscriptions: Mutex::new(Vec::new()),
            held: AtomicBool::new(false),
            pings,
        }
    }

    /// Waits, at most `within`, until every subscription has read every
    /// message sent to it before this call; whether that happened.
    pub async fn passed(&self, within: Duration) -> bool {
        let mut answers = self.answers.subscribe();
        let mut round = 0;
        self.asked.send_modify(|asked| {
            *asked += 1;
            round = *asked;
        });
        let answered = async {
            while !self.answered(round) {
                if answers.changed().await.is_err() {
                    return false;
                }
            }
            true
        };
        tokio::time::timeout(within, answered)
            .await
            .unwrap_or(false)
    }

    /// Whether every live subscription answered `round`. One that ended
    /// meanwhile is not waited for: its store no longer listens, and no
    /// denial holds until it listens again.
    fn answered(&self, round: u64) -> bool {
        let subscriptions = self
            .subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        subscriptions
            .iter()
            .all(|s| s.load(Ordering::SeqCst) >= round)
    }

    /// A subscription that answers rounds from now on, until dropped.
    pub fn subscription(&self) -> Subscription<'_> {
        let answered = Arc::new(AtomicU64::new(0));
        self.subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::clone(&answered));
        let mut rounds = self.asked.subscribe();
        if *rounds.borrow() > 0 {
            // Rounds asked before it are waiting for it too.
            rounds.mark_changed();
        }
        Subscription {
            barrier: self,
            rounds,
            answered,
        }
    }

    /// Hold messages: the listeners read them only in barrier rounds. Only
    /// for tests, which make a listener slow this way.
    #[doc(hidden)]
    pub fn hold_messages(&self) {
        self.held.store(true, Ordering::SeqCst);
    }
}

/// One subscription's part in the rounds.
#[derive(Debug)]
pub struct Subscription<'b> {
    barrier: &'b Barrier,
    rounds: watch::Receiver<u64>,
    answered: Arc<AtomicU64>,
}

impl Subscription<'_> {
    /// The latest round asked, once one is asked that this subscription
    /// has not answered; the caller PINGs for it (counted here).
    pub async fn asked(&mut self) -> u64 {
        if self.rounds.changed().await.is_err() {
            // The barrier is gone with its store: no round comes.
            std::future::pending::<()>().await;
        }
        self.barrier.pings.inc();
        *self.rounds.borrow_and_update()
    }

    /// Every message sent before `round` was asked has been read.
    pub fn answer(&self, round: u64) {
        self.answered.store(round, Ordering::SeqCst);
        self.barrier.answers.send_modify(|()| {});
    }

    /// Whether messages are read only in rounds (see
    /// [`Barrier::hold_messages`]).
    pub fn holds_messages(&self) -> bool {
        self.barrier.held.load(Ordering::SeqCst)
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        self.barrier
            .subscriptions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|s| !Arc::ptr_eq(s, &self.answered));
        self.barrier.answers.send_modify(|()| {});
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::poll;

    const LONG: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn many_askers_share_one_round_that_waits_for_every_subscription() {
        let pings = Counter::default();
        let barrier = Barrier::new(pings.clone());
        let mut first = barrier.subscription();
        let mut second = barrier.subscription();
        let mut askers: Vec<_> = (0..10).map(|_| Box::pin(barrier.passed(LONG))).collect();
        for asker in &mut askers {
            assert!(poll!(asker.as_mut()).is_pending());
        }
        let round = first.asked().await;
        first.answer(round);
        for asker in &mut askers {
            assert!(
                poll!(asker.as_mut()).is_pending(),
                "the second has not answered"
            );
        }
        let round = second.asked().await;
        second.answer(round);
        for asker in askers {
            assert!(asker.await, "every asker passed");
        }
        assert_eq!(pings.get(), 2, "one PING per subscription");
    }

    #[tokio::test]
    async fn an_answer_to_an_earlier_round_does_not_pass_a_later_one() {
        let barrier = Barrier::default();
        let mut only = barrier.subscription();
        let mut asking = Box::pin(barrier.passed(LONG));
        assert!(poll!(asking.as_mut()).is_pending());
        let round = only.asked().await;
        only.answer(round - 1);
        assert!(poll!(asking.as_mut()).is_pending());
        only.answer(round);
        assert!(asking.await);
    }

    #[tokio::test]
    async fn a_round_no_subscription_answers_fails_when_its_time_is_up() {
        let barrier = Barrier::default();
        let _deaf = barrier.subscription();
        assert!(!barrier.passed(Duration::from_millis(10)).await);
    }

    #[tokio::test]
    async fn a_subscription_that_ends_is_not_waited_for() {
        let barrier = Barrier::default();
        let ending = barrier.subscription();
        let mut asking = Box::pin(barrier.passed(LONG));
        assert!(poll!(asking.as_mut()).is_pending());
        drop(ending);
        assert!(asking.await);
    }

    #[tokio::test]
    async fn a_subscription_made_after_a_round_was_asked_answers_it() {
        let barrier = Barrier::default();
        let mut early = barrier.subscription();
        let mut asking = Box::pin(barrier.passed(LONG));
        assert!(poll!(asking.as_mut()).is_pending());
        let mut late = barrier.subscription();
        let round = early.asked().await;
        early.answer(round);
        assert!(
            poll!(asking.as_mut()).is_pending(),
            "the late one has not answered"
        );
        let round = late.asked().await;
        late.answer(round);
        assert!(asking.await);
    }
}
