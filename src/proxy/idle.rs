//! A timer for "nothing moved for this long": the idle timeouts of request
//! bodies, upstream bodies, client writes and upgraded connections.
//!
//! The timer costs nothing while data flows. It is armed only when the
//! thing it watches answers `Pending`, and re-armed (one clock read) only
//! if something moved since it was last armed; the sleep is allocated the
//! first time it is needed, so a body that arrives whole never has one.

use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// Fires when what it watches has been pending for `timeout` without
/// moving.
#[derive(Debug)]
pub struct IdleTimer {
    timeout: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    /// Something moved since the sleep was last set.
    moved: bool,
}

impl IdleTimer {
    /// A timer for `timeout` of stillness.
    pub fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            sleep: None,
            moved: false,
        }
    }

    /// The stillness it allows.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// What it watches made progress.
    pub fn moved(&mut self) {
        self.moved = true;
    }

    /// What it watches is pending: whether it has now been still for the
    /// whole timeout. When not, the task is woken when it would be.
    pub fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let sleep = match &mut self.sleep {
            Some(sleep) => {
                if self.moved {
                    sleep.as_mut().reset(Instant::now() + self.timeout);
                }
                sleep
            }
            None => self
                .sleep
                .insert(Box::pin(tokio::time::sleep(self.timeout))),
        };
        self.moved = false;
        sleep.as_mut().poll(cx).is_ready()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Poll;

    #[tokio::test(start_paused = true)]
    async fn fires_only_after_a_whole_timeout_without_movement() {
        let mut timer = IdleTimer::new(Duration::from_secs(10));
        async fn poll(timer: &mut IdleTimer) -> bool {
            std::future::poll_fn(|cx| Poll::Ready(timer.expired(cx))).await
        }
        assert!(!poll(&mut timer).await);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!poll(&mut timer).await);
        timer.moved();
        tokio::time::advance(Duration::from_secs(2)).await;
        // Moved 2 s ago: the count restarted.
        assert!(!poll(&mut timer).await);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!poll(&mut timer).await);
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(poll(&mut timer).await);
    }
}
