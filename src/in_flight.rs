//! Counts of work in flight that a stop waits for: open connections, and
//! usage settlements still running after their answers went out.

use std::pin::pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// How many of something are in flight; each is counted until its
/// [`Counted`] guard is dropped.
#[derive(Debug, Default)]
pub struct Count {
    live: AtomicUsize,
    /// Woken when the last one has ended.
    none_left: Notify,
}

impl Count {
    /// Counts one more until the returned guard is dropped.
    pub fn begin(self: &Arc<Self>) -> Counted {
        self.live.fetch_add(1, Ordering::SeqCst);
        Counted(Arc::clone(self))
    }

    /// How many are in flight now.
    pub fn count(&self) -> usize {
        self.live.load(Ordering::SeqCst)
    }

    /// Completes once none is in flight.
    pub async fn finished(&self) {
        loop {
            let mut wake = pin!(self.none_left.notified());
            wake.as_mut().enable();
            if self.count() == 0 {
                return;
            }
            wake.await;
        }
    }
}

/// One thing in flight, counted until dropped.
#[derive(Debug)]
pub struct Counted(Arc<Count>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.none_left.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn finishes_when_the_last_one_ends() {
        let in_flight = Arc::new(Count::default());
        in_flight.finished().await;
        let (a, b) = (in_flight.begin(), in_flight.begin());
        assert_eq!(in_flight.count(), 2);
        let waiting = tokio::spawn({
            let in_flight = Arc::clone(&in_flight);
            async move { in_flight.finished().await }
        });
        drop(a);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "one is still in flight");
        drop(b);
        waiting.await.expect("finished");
        assert_eq!(in_flight.count(), 0);
    }
}
