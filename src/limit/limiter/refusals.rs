//! Whether the store refuses floodgate's settings (a password changed on
//! the server, a permission taken away): remembered from the call or
//! probe it refused until one succeeds, read by `/readyz`, logged at error
//! level at most once a second.

use std::sync::atomic::Ordering;

use super::Guarded;
use crate::clock::now_ms;
use crate::limit::{Backend, StoreError};

impl<B: Backend> Guarded<B> {
    /// Why the store refuses floodgate's settings, while it does.
    pub(super) fn refusal(&self) -> Option<String> {
        if !self.is_refused.load(Ordering::Relaxed) {
            return None;
        }
        self.refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// A call succeeded: the store no longer refuses floodgate (a check of
    /// one flag on the common path).
    pub(super) fn accepted(&self) {
        if self.is_refused.load(Ordering::Relaxed) {
            *self
                .refused
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
            self.is_refused.store(false, Ordering::Relaxed);
            tracing::info!("rate limit store accepts floodgate's settings again");
        }
    }

    /// Remembers a refusal, which makes `/readyz` fail whatever `on_error`
    /// says, and logs it at error level at most once a second: each retry
    /// of the breaker's probe that the store refuses is seen.
    pub(super) fn note_refusal(&self, error: &StoreError) {
        let StoreError::Refused(why) = error else {
            return;
        };
        *self
            .refused
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why.clone());
        self.is_refused.store(true, Ordering::Relaxed);
        if crate::clock::once_a_second(&self.refusal_logged, now_ms()) {
            tracing::error!(
                error = %why,
                on_error = %self.on_error,
                "the rate limit store refuses floodgate's settings; limits are not counted in it until this is fixed (/readyz fails meanwhile)"
            );
        }
    }
}
