//! Denials in the log, at `info` under the target `floodgate::denials`:
//! the first denial of a route and client is logged at once, the ones that
//! follow within `denial_log_interval` are folded into one later line with
//! their count, and at most [`LINES_PER_SECOND`] lines a second are written
//! over all, so a flood of denials (from one client or from many) never
//! floods the log. What no line can show (more clients than the table
//! holds, more lines than the second allows) is counted in one summary
//! line. Every denial is counted in `floodgate_requests_total` either way.
//!
//! The table holds at most [`MAX_CLIENTS`] route and client pairs, each
//! forgotten once its interval passed and its folded count was logged.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::Mutex;
use std::time::Duration;

use crate::client::ClientId;

/// Route and client pairs remembered at once.
const MAX_CLIENTS: usize = 4_096;

/// Lines written a second at most, summaries included.
const LINES_PER_SECOND: u32 = 20;

/// Which denials were logged, and which were folded since.
#[derive(Debug)]
pub struct DenialLog {
    every_ms: u64,
    hasher: std::collections::hash_map::RandomState,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// By a hash of route and client.
    pairs: HashMap<u64, Pair>,
    /// The second (ms / 1000) `lines` counts in.
    second: u64,
    lines: u32,
    /// Denials no line has shown yet.
    unshown: u64,
}

#[derive(Debug)]
struct Pair {
    route: Box<str>,
    client: String,
    /// When this pair's last line was written (ms).
    logged_ms: u64,
    /// Denials since that line.
    folded: u64,
}

impl State {
    /// Whether another line fits in the second `now_ms` is in; counts it.
    fn line(&mut self, now_ms: u64) -> bool {
        let second = now_ms / 1_000;
        if second != self.second {
            self.second = second;
            self.lines = 0;
        }
        if self.lines >= LINES_PER_SECOND {
            return false;
        }
        self.lines += 1;
        true
    }
}

impl DenialLog {
    /// A log of denials, one line per route and client per `every`.
    pub fn new(every: Duration) -> Self {
        Self {
            every_ms: u64::try_from(every.as_millis()).unwrap_or(u64::MAX).max(1),
            hasher: std::collections::hash_map::RandomState::new(),
            state: Mutex::new(State::default()),
        }
    }

    /// Notes that `client` was denied on `route` at `now_ms` by a limit of
    /// `limit` units (the one with the longest wait): logged now
    /// when this pair's interval has passed, folded otherwise.
    pub fn denied(&self, route: &str, client: &ClientId, limit: u64, now_ms: u64) {
        if !tracing::enabled!(target: "floodgate::denials", tracing::Level::INFO) {
            return;
        }
        let mut hasher = self.hasher.build_hasher();
        route.hash(&mut hasher);
        client.hash(&mut hasher);
        let key = hasher.finish();
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let state = &mut *state;
        if let Some(pair) = state.pairs.get_mut(&key) {
            if now_ms.saturating_sub(pair.logged_ms) < self.every_ms {
                pair.folded += 1;
                return;
            }
            // The interval passed before the sweep saw it.
            let folded = std::mem::take(&mut pair.folded);
            pair.logged_ms = now_ms;
            let (route, client) = (pair.route.clone(), pair.client.clone());
            if state.line(now_ms) {
                line(&route, &client, limit, folded);
            } else {
                state.unshown += folded + 1;
            }
            return;
        }
        if state.pairs.len() >= MAX_CLIENTS || !state.line(now_ms) {
            state.unshown += 1;
            return;
        }
        let client = client.to_string();
        line(route, &client, limit, 0);
        state.pairs.insert(
            key,
            Pair {
                route: route.into(),
                client,
                logged_ms: now_ms,
                folded: 0,
            },
        );
    }

    /// Writes the folded counts of pairs whose interval has passed and
    /// forgets them, then what no line showed (every second).
    pub fn sweep(&self, now_ms: u64) {
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let state = &mut *state;
        let every = self.every_ms;
        let mut due: Vec<(Box<str>, String, u64)> = Vec::new();
        state.pairs.retain(|_, pair| {
            if now_ms.saturating_sub(pair.logged_ms) < every {
                return true;
            }
            if pair.folded > 0 {
                due.push((
                    std::mem::take(&mut pair.route),
                    std::mem::take(&mut pair.client),
                    pair.folded,
                ));
            }
            false
        });
        for (route, client, folded) in due {
            if state.line(now_ms) {
                tracing::info!(
                    target: "floodgate::denials",
                    route = %route,
                    client = %client,
                    folded,
                    "rate limit: {folded} more requests denied in the last {}s",
                    every.div_ceil(1_000)
                );
            } else {
                state.unshown += folded;
            }
        }
        if state.unshown > 0 && state.line(now_ms) {
            let unshown = std::mem::take(&mut state.unshown);
            tracing::info!(
                target: "floodgate::denials",
                folded = unshown,
                "rate limit: {unshown} more requests denied than the log shows one by one (floodgate_requests_total counts each)"
            );
        }
    }
}

fn line(route: &str, client: &str, limit: u64, folded: u64) {
    tracing::info!(
        target: "floodgate::denials",
        route,
        client,
        limit,
        folded,
        "rate limit: request denied (429)"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(n: u8) -> ClientId {
        ClientId::Addr(std::net::IpAddr::from([10, 0, 0, n]))
    }

    #[test]
    fn a_second_holds_at_most_its_lines_and_a_denial_nobody_logs_is_not_kept() {
        let log = DenialLog::new(Duration::from_secs(10));
        let mut state = State::default();
        for ms in 0..100 {
            assert_eq!(state.line(ms), ms < u64::from(LINES_PER_SECOND));
        }
        assert!(state.line(1_000), "a new second has room again");
        // Without a subscriber nothing is enabled: nothing is remembered.
        log.denied("api", &client(1), 5, 0);
        assert!(
            log.state
                .lock()
                .map(|s| s.pairs.is_empty())
                .unwrap_or(false)
        );
    }
}
