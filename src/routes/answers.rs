//! In what shape a route's own answers go out (`answers`), and what each
//! limit's denial says on a route that answers as OpenAI does
//! (`deny_code`).

use crate::limit::Limit;

/// The shape of the answers floodgate makes itself on a route: a denial
/// by its limits and a refusal while the store is out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Answers {
    /// RFC 9457 problem documents (`application/problem+json`).
    #[default]
    Problem,
    /// OpenAI's error object, `{"error": {"message", "type", "param",
    /// "code"}}`, which OpenAI's SDKs read into their exceptions.
    OpenAi,
}

impl Answers {
    /// Every shape with its name in configuration files.
    pub const NAMES: [(&'static str, Answers); 2] =
        [("problem", Answers::Problem), ("openai", Answers::OpenAi)];
}

/// What a denial by one limit tells an OpenAI client: wait, or stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DenyCode {
    /// A rate: the limit is back after a short wait (`rate_limit_exceeded`,
    /// type `requests` or `tokens`), which SDKs retry.
    RateLimitExceeded,
    /// A quota: spent until its period ends (`insufficient_quota`), which
    /// SDKs do not retry.
    InsufficientQuota,
}

/// A day, in milliseconds.
const DAY_MS: u64 = 86_400_000;

impl DenyCode {
    /// Every code with its name in configuration files.
    pub const NAMES: [(&'static str, DenyCode); 2] = [
        ("rate_limit_exceeded", DenyCode::RateLimitExceeded),
        ("insufficient_quota", DenyCode::InsufficientQuota),
    ];

    /// Its name, as OpenAI writes it.
    pub fn name(self) -> &'static str {
        match self {
            Self::RateLimitExceeded => "rate_limit_exceeded",
            Self::InsufficientQuota => "insufficient_quota",
        }
    }

    /// The code of a limit that names none: a window by the calendar of a
    /// day or longer is a quota (spent until the period turns), any other
    /// window a rate (back in part as the window slides or refills).
    pub fn of(limit: &Limit) -> Self {
        if limit.bounds.is_some() && limit.window_ms >= DAY_MS {
            Self::InsufficientQuota
        } else {
            Self::RateLimitExceeded
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Algorithm;

    #[test]
    fn calendar_days_and_longer_are_quotas_and_rolling_windows_rates() {
        let day = Limit::new(Algorithm::SlidingLog, 5, DAY_MS);
        assert_eq!(DenyCode::of(&day), DenyCode::RateLimitExceeded);
        let mut month = Limit::new(Algorithm::FixedWindow, 5, 30 * DAY_MS);
        month.bounds = Some([0, 1, 30 * DAY_MS, 60 * DAY_MS]);
        assert_eq!(DenyCode::of(&month), DenyCode::InsufficientQuota);
        let mut hour = Limit::new(Algorithm::FixedWindow, 5, 3_600_000);
        hour.bounds = Some([0, 1, 3_600_000, 7_200_000]);
        assert_eq!(DenyCode::of(&hour), DenyCode::RateLimitExceeded);
    }
}
