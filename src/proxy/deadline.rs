//! The deadline for an upstream's response head, on one timer per client
//! connection.
//!
//! A timer made for each request registers itself in tokio's timer wheel
//! when first polled and takes itself out when dropped: two locked wheel
//! operations a request. A connection's requests instead lend one timer in
//! turn: setting it to a later deadline than it holds is a compare-and-swap
//! (tokio moves the entry in the wheel only when it fires), and it leaves
//! the wheel when the connection closes. While the connection idles, the
//! timer may fire once with nobody waiting; that wakes the connection's task
//! for nothing, once. HTTP/2 requests in flight together each need a timer:
//! those that find it lent make their own, as every request did before.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

use tokio::time::{Instant, Sleep};

/// A connection's timer for its requests' upstream deadlines.
#[derive(Debug, Default)]
pub struct HeadTimer(Mutex<Option<Pin<Box<Sleep>>>>);

impl HeadTimer {
    /// The connection's timer set to `deadline`, or a timer of its own if
    /// another request of the connection has it.
    pub(super) fn lend(&self, deadline: Instant) -> Lent<'_> {
        let kept = match self.0.try_lock() {
            Ok(mut kept) => kept.take(),
            Err(_) => None,
        };
        let sleep = match kept {
            Some(mut sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        Lent {
            owner: self,
            sleep: Some(sleep),
        }
    }
}

/// A timer lent to one request; back to its connection when dropped.
#[derive(Debug)]
pub(super) struct Lent<'a> {
    owner: &'a HeadTimer,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl Lent<'_> {
    /// Sets the deadline again.
    pub(super) fn reset(&mut self, deadline: Instant) {
        if let Some(sleep) = self.sleep.as_mut() {
            sleep.as_mut().reset(deadline);
        }
    }
}

impl Future for Lent<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let mut kept = self.owner.0.lock().unwrap_or_else(PoisonError::into_inner);
        if kept.is_none() {
            *kept = self.sleep.take();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn a_lent_timer_fires_at_its_deadline_and_goes_back_to_its_connection() {
        let timer = HeadTimer::default();
        let start = Instant::now();
        {
            let lent = timer.lend(start + Duration::from_secs(5));
            lent.await;
        }
        assert_eq!(Instant::now() - start, Duration::from_secs(5));
        assert!(timer.0.lock().unwrap().is_some(), "the timer went back");

        // Lent again, later: it fires at the new deadline.
        let again = Instant::now();
        let mut lent = timer.lend(again + Duration::from_secs(10));
        // While lent, a second request (HTTP/2) gets a timer of its own.
        let other = timer.lend(again + Duration::from_secs(1));
        other.await;
        assert_eq!(Instant::now() - again, Duration::from_secs(1));
        lent.reset(again + Duration::from_secs(3));
        (&mut lent).await;
        assert_eq!(Instant::now() - again, Duration::from_secs(3));
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_moved_later_does_not_fire_early() {
        let timer = HeadTimer::default();
        let start = Instant::now();
        drop(timer.lend(start + Duration::from_secs(1)));
        let lent = timer.lend(start + Duration::from_secs(30));
        let woke = tokio::time::timeout(Duration::from_secs(29), lent).await;
        assert!(woke.is_err(), "the timer kept its first, earlier deadline");
    }
}
