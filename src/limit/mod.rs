//! Whether a request is allowed: limits, decisions and the stores that count.
//!
//! A route has one or more [`Limit`]s; a request is allowed only when all of
//! them allow it, and a denied request consumes nothing from any of them. The
//! pure algorithms live in [`algorithms`]; [`memory`] runs them in process and
//! [`redis`] runs their Lua twins atomically in Redis.

/// Every counting algorithm, in one list: its [`Algorithm`] variant (with
/// what it means) and its name, which is also its name in configuration
/// files, its module in [`algorithms`] (its state for one client and how
/// that state counts) and its script `lua/<name>.lua`. `each_algorithm!(m)`
/// hands the list to the macro `m`: the [`Algorithm`] enum, the state of
/// every algorithm with its dispatch, and the Lua code Redis runs are each
/// made from it. A new algorithm is a line here, its two files, its docs
/// and its tests.
macro_rules! each_algorithm {
    ($then:ident) => {
        $then! {
            /// At most `limit` in each window aligned to multiples of `window`.
            FixedWindow = fixed_window,
            /// At most `limit` in any trailing `window`, exactly.
            SlidingLog = sliding_log,
            /// The current window's count plus the previous window's,
            /// weighted by how much of it the trailing window still overlaps.
            SlidingWindow = sliding_window,
            /// Refills `limit` tokens per `window` continuously, up to `burst`.
            TokenBucket = token_bucket,
            /// Generic cell rate: one unit per `window / limit`, bursts up to
            /// `burst`.
            Gcra = gcra,
        }
    };
}
pub(crate) use each_algorithm;

/// The [`Algorithm`] enum, from [`each_algorithm`]'s list.
macro_rules! algorithm_enum {
    ($($(#[$doc:meta])* $variant:ident = $name:ident,)*) => {
        /// A counting algorithm (see `CONFIG.md` for each one's meaning).
        /// Each has a module of its own in [`algorithms`], beside its Lua
        /// script, and says there what it is ([`Algorithm::properties`]: a
        /// burst, leases, credits, the calendar).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Algorithm {
            $($(#[$doc])* $variant,)*
        }

        impl Algorithm {
            /// Every algorithm.
            pub const ALL: [Algorithm; [$(stringify!($name)),*].len()] =
                [$(Algorithm::$variant),*];

            /// Every algorithm with its name in configuration files.
            pub const NAMES: [(&'static str, Algorithm); Self::ALL.len()] =
                [$((stringify!($name), Algorithm::$variant)),*];
        }
    };
}
each_algorithm!(algorithm_enum);

pub mod algorithms;
pub mod backend;
pub mod breaker;
pub mod calendar;
mod decision;
pub mod deny_cache;
pub mod leases;
mod limiter;
pub mod memory;
pub mod penalty;
pub mod redis;
pub mod registry;
pub mod settings;
mod shards;

pub use backend::Backend;
pub use decision::{Brief, Decision, Standing, Verdict};
pub use limiter::{Answer, Limiter};

use std::sync::Arc;

use crate::client::ClientId;

impl Algorithm {
    /// The name used in configuration files.
    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize].0
    }
}

/// "At most `limit` units per `window`", counted by `algorithm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limit {
    /// How units are counted.
    pub algorithm: Algorithm,
    /// Units allowed per window.
    pub limit: u64,
    /// The window, in milliseconds.
    pub window_ms: u64,
    /// Most units available at once (`token_bucket`, `gcra`); equals
    /// `limit` for the window algorithms.
    pub burst: u64,
    /// Counts each request as one unit, whatever the route's `cost` or
    /// `usage` (`counts = "requests"`): requests a minute beside tokens a
    /// minute on one metered route. Settlements leave it as decided.
    pub counts_requests: bool,
    /// A `fixed_window` by the calendar: the boundaries around this
    /// request's time (see [`calendar`]), set per request; `window_ms` is
    /// then the calendar unit's usual length, naming the window only.
    pub bounds: Option<calendar::Bounds>,
    /// Decided from slices of the store's budget taken ahead, on a shared
    /// store (`lease = { … }`; see [`leases`]).
    pub lease: Option<leases::Terms>,
    /// A client it refuses stays refused this long (`penalty = { … }`;
    /// see [`penalty`]).
    pub penalty: Option<penalty::Penalty>,
    /// A request past the burst is admitted and held this long at most
    /// (ms) until it fits, instead of refused (`delay = "1s"`, `gcra`
    /// only); 0 refuses it. See [`Verdict::retry_after_ms`].
    pub delay_ms: u64,
}

impl Limit {
    /// `limit` units per `window_ms`, with a burst of `limit`.
    pub const fn new(algorithm: Algorithm, limit: u64, window_ms: u64) -> Self {
        Self {
            algorithm,
            limit,
            window_ms,
            burst: limit,
            counts_requests: false,
            bounds: None,
            lease: None,
            penalty: None,
            delay_ms: 0,
        }
    }

    /// The current window's length: `window_ms`, or by the calendar, the
    /// window between the boundaries the request is in.
    pub fn window_now_ms(&self) -> u64 {
        self.bounds.map_or(self.window_ms, |b| b[2] - b[1])
    }

    /// The window `t` falls in: its start and length. Windows are aligned
    /// to multiples of `window_ms`, or, by the calendar, lie between the
    /// [`Self::bounds`]; past the last boundary they go on with the length
    /// of the last window, and before the first with that of the first (a
    /// store clock that far from floodgate's is not expected).
    pub fn span(&self, t: u64) -> (u64, u64) {
        let Some(b) = &self.bounds else {
            return (t - t % self.window_ms, self.window_ms);
        };
        if t >= b[3] {
            let len = (b[3] - b[2]).max(1);
            return (t - (t - b[3]) % len, len);
        }
        for i in (0..3).rev() {
            if t >= b[i] {
                return (b[i], b[i + 1] - b[i]);
            }
        }
        let len = (b[1] - b[0]).max(1);
        let back = (b[0] - t).div_ceil(len) * len;
        (b[0].saturating_sub(back), len)
    }

    /// The same limit counting each request as one unit.
    pub fn counting_requests(self) -> Self {
        Self {
            counts_requests: true,
            ..self
        }
    }

    /// The units a request of `cost` takes from this limit.
    pub fn cost_of(&self, cost: u64) -> u64 {
        if self.counts_requests { 1 } else { cost }
    }

    /// The same limit with another burst.
    pub fn with_burst(self, burst: u64) -> Self {
        Self { burst, ..self }
    }

    /// Most units one request may cost and still be admissible.
    pub fn capacity(&self) -> u64 {
        if self.algorithm.has_burst() {
            self.burst
        } else {
            self.limit
        }
    }
}

/// One client's fixed window as the store keeps it, for export: the
/// client's id as keys write it (see [`redis::write_client`]), the
/// window's start and end (ms), the units counted in it, and whether it
/// has closed (its total is final).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Kept {
    pub client: String,
    pub start: u64,
    pub end: u64,
    pub units: u64,
    pub closed: bool,
}

/// What an operator does to one client's counts (on the admin listener).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Adjustment {
    /// Forget the counts (and a penalty): the limit is whole again.
    Reset,
    /// End a penalty (`penalty = { … }`) and forget the offences; the
    /// counts stay.
    Lift,
    /// Give back this many units in the current window (where a limit
    /// counts: a fixed or sliding window's count, a bucket's tokens).
    Credit(u64),
    /// Take this many units now, even past the limit.
    Debit(u64),
}

/// What a reset forgets of a client's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forget {
    /// Its count and its penalty.
    All,
    /// Its penalty alone.
    Penalty,
}

/// What one request asks of a store: `cost` units from every limit of a
/// route, for one client.
#[derive(Debug, Clone, Copy)]
pub struct Charge<'a> {
    /// The route's name (part of every key).
    pub route: &'a Arc<str>,
    /// The client (part of every key).
    pub client: &'a ClientId,
    /// The route's limits; all must allow.
    pub limits: &'a [Limit],
    /// Whose count each limit is, one per limit, when not every limit
    /// counts `client` on `route` at its own position (a limit keyed by
    /// another identity, the whole API, a budget shared by routes); empty
    /// otherwise, the common case.
    pub keys: &'a [CountKey],
    /// Units this request consumes; for a settlement, the units the
    /// answer reported.
    pub cost: u64,
    /// `None` to decide; `Some` to settle an earlier reservation to `cost`
    /// units instead (see [`Settlement`]).
    pub settle: Option<Settlement>,
}

impl<'a> Charge<'a> {
    /// A charge to decide: `cost` units from every limit of `limits`, for
    /// `client` on `route`, counted as `keys` say.
    pub fn new(
        route: &'a Arc<str>,
        client: &'a ClientId,
        limits: &'a [Limit],
        keys: &'a [CountKey],
        cost: u64,
    ) -> Self {
        Self {
            route,
            client,
            limits,
            keys,
            cost,
            settle: None,
        }
    }
}

/// Whose count one limit is: a scope (a route's name, or a budget's,
/// which routes share), the id counted in it, and the limit's place among
/// the scope's limits. Two limits count together exactly when their keys,
/// algorithms and windows are equal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CountKey {
    /// A route's name, or `@` and a budget's name.
    pub scope: Arc<str>,
    /// `scope`, `index`, algorithm and window in one name, for the
    /// in-process tables (what a Redis key names).
    pub entry: Arc<str>,
    /// The id counted: the route's client, another identity, or
    /// [`ClientId::Global`].
    pub client: ClientId,
    /// The limit's place among its scope's limits.
    pub index: usize,
}

impl CountKey {
    /// The key of limit `index` of `scope`, counting `client`.
    pub fn new(scope: &Arc<str>, entry: &Arc<str>, index: usize, client: ClientId) -> Self {
        Self {
            scope: Arc::clone(scope),
            entry: Arc::clone(entry),
            client,
            index,
        }
    }
}

/// A reservation being settled: a decision at `at_ms` took `reserved`
/// units, and the answer reported what it really used (the charge's
/// `cost`). The store takes the difference atomically in the same keys
/// (units beyond the reservation charged now, unused ones given back where
/// they still count; [`algorithms::State::settle`]) and answers, as an
/// allowed decision, what every limit holds afterwards. A settlement never
/// denies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// When the reservation was decided ([`Decision::at_ms`]).
    pub at_ms: u64,
    /// Units it took.
    pub reserved: u64,
    /// It was decided locally ([`Decision::local`]).
    pub local: bool,
    /// What is settled: a reservation (to the charge's `cost`), an
    /// operator's grant, or the part of a refused request given back.
    pub kind: Settled,
}

/// What a [`Settlement`] settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// A reservation, to what the answer reported (the charge's `cost`).
    Reservation,
    /// Not a reservation but an operator's grant of `reserved` units in
    /// the current window ([`Adjustment::Credit`]): a fixed window admits
    /// that many more until it ends, past its number; the other
    /// algorithms get them back as a settlement to nothing at `at_ms`
    /// would give them ([`algorithms::State::grant`]).
    Grant,
    /// Not a reservation but the part of a refused request taken before
    /// another part refused it, given back whole: every limit gets back
    /// what the decision took from it, `reserved` units, or one for a
    /// limit that counts requests (which a settlement otherwise leaves as
    /// decided). The charge's `cost` is 0.
    GiveBack,
}

/// Why a store could not decide.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer within its deadline.
    #[error("the store did not answer within {0:?}")]
    Timeout(std::time::Duration),
    /// The store answered with an error or could not be reached.
    #[error("store error: {0}")]
    Backend(String),
    /// The circuit breaker is open: the store was not asked.
    #[error("the store is considered down (circuit open)")]
    CircuitOpen,
    /// The store answered and refused floodgate's settings (a password, a
    /// user, a database, a permission, a certificate), or what answered is
    /// not the store: a configuration error, which waiting does not fix.
    /// The message says what to change.
    #[error("the store refuses floodgate's settings: {0}")]
    Refused(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithm_names_follow_the_declaration_order() {
        for (i, (name, algorithm)) in Algorithm::NAMES.into_iter().enumerate() {
            assert_eq!(algorithm as usize, i);
            assert_eq!(algorithm.name(), name);
            assert_eq!(Algorithm::ALL[i], algorithm);
        }
    }
}
