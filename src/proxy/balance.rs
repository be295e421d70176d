//! An upstream's endpoints: which one takes a request, and which are left
//! alone for a while because they keep failing.
//!
//! Choice is by the power of two choices on requests in flight (two
//! endpoints drawn, the less busy one taken; on a tie, the one not chosen
//! last, so that a lightly loaded pair alternates rather than drifting by
//! chance), or round robin. Health is passive and, when configured, active.
//! Passive: an endpoint whose connections fail (refused, timed out)
//! `eject_after` times in a row is ejected for `eject_for`, doubled at each
//! ejection in a row up to [`MAX_EJECTION`]; when that passes it takes
//! requests again, and one more failure ejects it at once while a success
//! clears its record. Active ([`super::discovery`]): an endpoint failing its
//! health check `unhealthy_after` times in a row is left out until it
//! passes `healthy_after` in a row. Neither ever empties the set: with
//! every endpoint left out, requests go to the one whose ejection ends
//! first.
//!
//! The endpoints of a DNS name are its addresses, re-resolved on an
//! interval ([`super::discovery`]); the set in force is swapped whole, and
//! an address that stays keeps its record. The state lives with the
//! compiled configuration, so a reload starts every endpoint afresh.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use http::uri::Authority;

use super::pool::PoolSlot;
use super::settings::{Balance, Check, Endpoint, Upstream};

/// Longest an endpoint stays ejected.
pub const MAX_EJECTION: Duration = Duration::from_secs(300);

/// What kind of failure an endpoint had, as its metrics count them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection: refused, unreachable, TLS or HTTP handshake failed.
    Connect,
    /// Connecting or the response head took too long.
    Timeout,
    /// The connection broke or the upstream spoke HTTP wrongly.
    Protocol,
}

impl Failure {
    /// Every kind, in exposition order.
    pub const ALL: [Failure; 3] = [Failure::Connect, Failure::Timeout, Failure::Protocol];

    /// The label value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Protocol => "protocol",
        }
    }
}

/// An upstream: its endpoints and what is known of their health.
#[derive(Debug)]
pub struct Group {
    /// As metrics and logs name it: the `[upstreams.NAME]`, or the URL a
    /// route gave.
    pub name: Box<str>,
    /// The endpoints as configured.
    pub(super) sources: Vec<Source>,
    /// The endpoints in force: the configured ones, with each DNS name
    /// replaced by its addresses once resolved.
    members: ArcSwap<Vec<Arc<Member>>>,
    balance: Balance,
    eject_after: u32,
    eject_for: Duration,
    /// How often DNS names are resolved again.
    pub(super) resolve_every: Duration,
    /// The active health check, if any.
    pub(super) check: Option<Check>,
    turn: AtomicUsize,
    /// The endpoint chosen last.
    last: AtomicUsize,
}

/// One endpoint in force, with its health and counts.
#[derive(Debug)]
pub struct Member {
    /// How to reach it.
    pub endpoint: Endpoint,
    /// The configured endpoint it comes from (index into the sources).
    pub(super) source: usize,
    /// The address connected to, as metrics label it (`host:port` until a
    /// DNS name is first resolved).
    pub(super) address: Box<str>,
    /// Its connection pool, remembered after the first request so later
    /// ones skip the lookup.
    pool: PoolSlot,
    health: Health,
}

#[derive(Debug, Default)]
struct Health {
    in_flight: AtomicUsize,
    failures: AtomicU32,
    ejections: AtomicU32,
    /// Milliseconds (of [`crate::clock::now_ms`]) until which it is
    /// ejected; 0 when it is not.
    ejected_until: AtomicU64,
    /// Failing its active health check.
    check_down: AtomicBool,
    /// Checks in a row with the same result as the last one.
    check_streak: AtomicU32,
    requests: AtomicU64,
    errors: [AtomicU64; 3],
    ejected_total: AtomicU64,
}

/// What an endpoint's metrics show.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    /// Requests sent to it (a retry counts on the endpoint it went to).
    pub requests: u64,
    /// Failures by [`Failure`] kind.
    pub errors: [u64; 3],
    /// Times it was ejected.
    pub ejections: u64,
    /// Requests on it now.
    pub in_flight: u64,
    /// Neither ejected nor failing its health check.
    pub healthy: bool,
}

/// A request in flight on an endpoint, counted until dropped.
#[derive(Debug)]
pub struct InFlight<'a>(&'a Health);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One endpoint as configured.
#[derive(Debug)]
pub struct Source {
    /// The endpoint as configured; its host may be a DNS name.
    pub endpoint: Endpoint,
    /// The DNS name and port to resolve; `None` for an IP address.
    pub(super) name: Option<(Box<str>, u16)>,
    /// The last lookup failed (so that only a change is logged).
    pub(super) failing: AtomicBool,
}

// === impl Source ===

impl Source {
    /// A configured endpoint, to be resolved if its host is a name.
    pub fn new(endpoint: Endpoint) -> Self {
        let host = endpoint.authority.host().trim_matches(['[', ']']);
        let name = host.parse::<IpAddr>().is_err().then(|| {
            (
                host.into(),
                endpoint
                    .authority
                    .port_u16()
                    .unwrap_or(endpoint.default_port()),
            )
        });
        Self {
            endpoint,
            name,
            failing: AtomicBool::new(false),
        }
    }

    /// The endpoint as configured, in force until its name is resolved
    /// (each new connection then resolves it).
    pub(super) fn unresolved(&self, index: usize) -> Member {
        let address = self.endpoint.authority.as_str().into();
        Member::new(self.endpoint.clone(), index, address)
    }

    pub(super) fn lookup_failed(&self, upstream: &str, error: &str) {
        if !self.failing.swap(true, Ordering::Relaxed) {
            let host = self.name.as_ref().map_or("", |(h, _)| h);
            tracing::warn!(
                upstream,
                host,
                error,
                "cannot resolve the upstream's DNS name; keeping the addresses last found"
            );
        }
    }

    /// The endpoint at `address`, for a resolved name: connected there,
    /// while `Host`, TLS's server name and the logs keep the name.
    pub(super) fn at(&self, index: usize, address: SocketAddr) -> Option<Member> {
        let authority = Authority::try_from(address.to_string()).ok()?;
        let endpoint = Endpoint {
            target: format!("{} ({address})", self.endpoint.target).into(),
            pool_key: format!("{} @{address}", self.endpoint.pool_key).into(),
            authority,
            ..self.endpoint.clone()
        };
        Some(Member::new(endpoint, index, address.to_string().into()))
    }
}

// === impl Member ===

impl Member {
    /// `endpoint`, from configured endpoint `source`, connected at `address`.
    pub(super) fn new(endpoint: Endpoint, source: usize, address: Box<str>) -> Self {
        Self {
            endpoint,
            source,
            address,
            pool: PoolSlot::default(),
            health: Health::default(),
        }
    }

    /// Counts a request sent to it, in flight until the guard drops.
    pub fn begin(&self) -> InFlight<'_> {
        let h = &self.health;
        h.requests.fetch_add(1, Ordering::Relaxed);
        h.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(h)
    }

    /// Counts a failure of `kind`.
    pub fn count(&self, kind: Failure) {
        self.health.errors[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Where its connection pool is remembered.
    pub fn pool(&self) -> &PoolSlot {
        &self.pool
    }

    /// The address it is connected at, as metrics label it.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Its counts and state now.
    pub fn stats(&self) -> Stats {
        let h = &self.health;
        Stats {
            requests: h.requests.load(Ordering::Relaxed),
            errors: std::array::from_fn(|i| h.errors[i].load(Ordering::Relaxed)),
            ejections: h.ejected_total.load(Ordering::Relaxed),
            in_flight: h.in_flight.load(Ordering::Relaxed) as u64,
            healthy: self.usable(crate::clock::now_ms()),
        }
    }

    fn usable(&self, now: u64) -> bool {
        self.health.ejected_until.load(Ordering::Relaxed) <= now
            && !self.health.check_down.load(Ordering::Relaxed)
    }
}

// === impl Group ===

impl Group {
    /// The live side of `upstream`: each endpoint in force as configured
    /// until a DNS name among them is resolved.
    pub fn new(upstream: &Upstream) -> Self {
        let sources: Vec<Source> = upstream
            .endpoints
            .iter()
            .map(|e| Source::new(e.clone()))
            .collect();
        let members = sources
            .iter()
            .enumerate()
            .map(|(i, s)| Arc::new(s.unresolved(i)))
            .collect();
        Self {
            name: upstream.name.clone(),
            sources,
            members: ArcSwap::from_pointee(members),
            balance: upstream.balance,
            eject_after: upstream.eject_after.max(1),
            eject_for: upstream.eject_for,
            resolve_every: upstream.resolve_every,
            check: upstream.check.clone(),
            turn: AtomicUsize::new(0),
            last: AtomicUsize::new(usize::MAX),
        }
    }

    /// The endpoints as configured.
    pub fn sources(&self) -> impl Iterator<Item = &Endpoint> {
        self.sources.iter().map(|s| &s.endpoint)
    }

    /// The endpoint as configured that `member` comes from, as metrics
    /// label it.
    pub fn configured(&self, member: &Member) -> &str {
        self.sources
            .get(member.source)
            .map_or("", |s| &*s.endpoint.target)
    }

    /// The endpoints in force now; a request keeps the set it began with.
    pub fn members(&self) -> Arc<Vec<Arc<Member>>> {
        self.members.load_full()
    }

    /// Puts `members` in force.
    pub(super) fn replace(&self, members: Vec<Arc<Member>>) {
        self.members.store(Arc::new(members));
    }

    /// Which of `members` to try next, other than `avoid` if there is
    /// another. `members` is never empty.
    pub fn pick(&self, members: &[Arc<Member>], avoid: Option<usize>) -> usize {
        let n = members.len();
        if n <= 1 {
            return 0;
        }
        let now = crate::clock::now_ms();
        let candidates: Vec<usize> = (0..n)
            .filter(|&i| Some(i) != avoid && members[i].usable(now))
            .collect();
        if candidates.is_empty() {
            // None usable (or the one left is to be avoided): the one whose
            // ejection ends first, preferring not `avoid`.
            return (0..n)
                .min_by_key(|&i| {
                    (
                        Some(i) == avoid,
                        members[i].health.ejected_until.load(Ordering::Relaxed),
                    )
                })
                .unwrap_or(0);
        }
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        match (self.balance, candidates.len()) {
            (_, 1) => candidates[0],
            (Balance::RoundRobin, c) => candidates[turn % c],
            (Balance::LeastInFlight, c) => {
                // Two distinct draws from a scrambled counter.
                let r = turn.wrapping_mul(0x9E37_79B9_7F4A_7C15_u64 as usize);
                let a = candidates[(r >> 7) % c];
                let b = candidates[((r >> 7) % c + 1 + (r >> 29) % (c - 1)) % c];
                let load = |i: usize| members[i].health.in_flight.load(Ordering::Relaxed);
                let chosen = match load(a).cmp(&load(b)) {
                    std::cmp::Ordering::Less => a,
                    std::cmp::Ordering::Greater => b,
                    std::cmp::Ordering::Equal if self.last.load(Ordering::Relaxed) == a => b,
                    std::cmp::Ordering::Equal => a,
                };
                self.last.store(chosen, Ordering::Relaxed);
                chosen
            }
        }
    }

    /// `member` answered: its record is cleared.
    pub fn succeeded(&self, member: &Member) {
        let h = &member.health;
        if h.failures.load(Ordering::Relaxed) != 0 || h.ejections.load(Ordering::Relaxed) != 0 {
            h.failures.store(0, Ordering::Relaxed);
            h.ejections.store(0, Ordering::Relaxed);
            h.ejected_until.store(0, Ordering::Relaxed);
            tracing::info!(
                upstream = %self.name,
                endpoint = %member.endpoint.target,
                "upstream endpoint answers again"
            );
        }
    }

    /// A connection to `member` failed or timed out.
    pub fn failed(&self, member: &Member) {
        let h = &member.health;
        let failures = h.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if failures < self.eject_after {
            return;
        }
        let now = crate::clock::now_ms();
        if h.ejected_until.load(Ordering::Relaxed) > now {
            return;
        }
        let ejections = h.ejections.fetch_add(1, Ordering::Relaxed);
        h.ejected_total.fetch_add(1, Ordering::Relaxed);
        let interval = self
            .eject_for
            .saturating_mul(1 << ejections.min(16))
            .min(MAX_EJECTION);
        let until = now.saturating_add(u64::try_from(interval.as_millis()).unwrap_or(u64::MAX));
        h.ejected_until.store(until, Ordering::Relaxed);
        tracing::warn!(
            upstream = %self.name,
            endpoint = %member.endpoint.target,
            failures,
            ejected_for = ?interval,
            "upstream endpoint ejected"
        );
    }

    /// Records the result of `member`'s health check under `check`.
    pub(super) fn checked(&self, member: &Member, check: &Check, passed: bool) {
        let h = &member.health;
        let down = h.check_down.load(Ordering::Relaxed);
        // The streak counts results that differ from the state held.
        let streak = if passed == down {
            h.check_streak.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            h.check_streak.store(0, Ordering::Relaxed);
            return;
        };
        let needed = if down {
            check.healthy_after
        } else {
            check.unhealthy_after
        };
        if streak >= needed {
            h.check_streak.store(0, Ordering::Relaxed);
            h.check_down.store(!passed, Ordering::Relaxed);
            if passed {
                tracing::info!(
                    upstream = %self.name,
                    endpoint = %member.endpoint.target,
                    "upstream endpoint passes its health check again"
                );
            } else {
                tracing::warn!(
                    upstream = %self.name,
                    endpoint = %member.endpoint.target,
                    checks = streak,
                    "upstream endpoint fails its health check; left out until it passes"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The group of a configuration's only route, over three endpoints.
    fn group(balance: &str) -> Arc<Group> {
        let text = format!(
            r#"
[server]
listen = "127.0.0.1:0"

[upstreams.three]
endpoints = ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]
balance = "{balance}"
eject_after = 2
eject_for = "10s"

[[routes]]
name = "all"
upstream = "three"
"#
        );
        let config = crate::config::parse(std::path::Path::new("t.toml"), &text)
            .unwrap_or_else(|e| panic!("{e}"));
        match config.upstreams.first() {
            Some(upstream) => Arc::new(Group::new(upstream)),
            None => panic!("no upstream"),
        }
    }

    fn picks(g: &Group, n: usize) -> Vec<usize> {
        let members = g.members();
        (0..n).map(|_| g.pick(&members, None)).collect()
    }

    /// Endpoint `i` of `g`'s set in force.
    fn member(g: &Group, i: usize) -> Arc<Member> {
        Arc::clone(&g.members()[i])
    }

    #[test]
    fn idle_endpoints_take_turns_and_busy_ones_are_passed_over() {
        let g = group("least_in_flight");
        let chosen = picks(&g, 300);
        for i in 0..3 {
            let n = chosen.iter().filter(|&&c| c == i).count();
            assert!((60..=140).contains(&n), "endpoint {i} took {n} of 300");
        }
        // Two draws among three: an endpoint busier than both others is
        // never taken.
        let busy = member(&g, 0);
        let _busy: Vec<_> = (0..5).map(|_| busy.begin()).collect();
        assert!(picks(&g, 100).iter().all(|&c| c != 0));
        let rr = group("round_robin");
        assert_eq!(picks(&rr, 6), [0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn an_endpoint_failing_in_a_row_is_ejected_for_a_doubling_time_and_a_success_clears_it() {
        let g = group("round_robin");
        g.failed(&member(&g, 1));
        assert!(picks(&g, 9).contains(&1), "one failure does not eject");
        g.failed(&member(&g, 1));
        assert!(!picks(&g, 9).contains(&1), "two in a row do");
        let until = |i: usize| member(&g, i).health.ejected_until.load(Ordering::Relaxed);
        let first = until(1) - crate::clock::now_ms();
        assert!((9_000..=10_000).contains(&first), "{first} ms");
        // Its ejection over (made so here), one more failure ejects it again
        // for twice as long.
        member(&g, 1)
            .health
            .ejected_until
            .store(1, Ordering::Relaxed);
        g.failed(&member(&g, 1));
        let second = until(1) - crate::clock::now_ms();
        assert!((19_000..=20_000).contains(&second), "{second} ms");
        g.succeeded(&member(&g, 1));
        assert_eq!(until(1), 0);
        assert!(picks(&g, 9).contains(&1));
        g.failed(&member(&g, 1));
        assert!(picks(&g, 9).contains(&1), "the record started afresh");
    }

    #[test]
    fn with_every_endpoint_ejected_the_one_back_soonest_is_used() {
        let g = group("least_in_flight");
        for i in 0..3 {
            g.failed(&member(&g, i));
            g.failed(&member(&g, i));
        }
        member(&g, 0)
            .health
            .ejected_until
            .store(5, Ordering::Relaxed);
        // Ejection 0 "ended" at 5 ms since the epoch: it is usable again.
        assert!(picks(&g, 5).iter().all(|&c| c == 0));
        // All ejected: the one whose ejection ends first is used.
        let now = crate::clock::now_ms();
        for (i, ends) in [(0, now + 3_000), (1, now + 2_000), (2, now + 1_000)] {
            member(&g, i)
                .health
                .ejected_until
                .store(ends, Ordering::Relaxed);
        }
        assert!(picks(&g, 5).iter().all(|&c| c == 2));
        // Avoiding it (a retry), the next soonest.
        assert_eq!(g.pick(&g.members(), Some(2)), 1);
    }
}
