//! The algorithms as pure Rust: state, the time `now` in milliseconds and a
//! cost in, a verdict out. No clock, no I/O.
//!
//! Deciding is two steps so that several limits can decide all or nothing:
//! [`State::check`] answers whether `cost` units fit at `now` (it may tidy the
//! state, e.g. forget expired entries, but never consumes), and
//! [`State::consume`] takes the units once every limit said yes. The Lua
//! scripts in `lua/` follow the same steps and are tested against this code.
//!
//! Each algorithm has a module of its own beside its script (`lua/<name>.lua`):
//! its state for one client, how that state counts (a [`Counter`]: check,
//! consume, settle, grant, expiry, kept totals) and its [`Properties`],
//! what the rest of floodgate asks of it. This module makes [`State`], the
//! state of any algorithm, and its dispatch to each one, from the one list
//! of algorithms (`each_algorithm!` in [`crate::limit`]).

use super::{Algorithm, Limit, Verdict};

mod settle;

use settle::bucket_gives_back;

/// What an algorithm is, as the rest of floodgate asks it: how it counts,
/// and so what may be done with its counts. Each algorithm's module gives
/// its own answers ([`Algorithm::properties`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Properties {
    /// Refills continuously up to a burst rather than counting in windows:
    /// it takes a `burst`, its capacity is that burst, and it has no window
    /// end (for a lease's slice to expire at, or for what remains to hold
    /// until).
    pub has_burst: bool,
    /// Can be decided from slices of the store's budget taken ahead
    /// (`lease = { … }`; see [`super::leases`]).
    pub can_lease: bool,
    /// Can be given units back now by an operator (a credit,
    /// [`super::Adjustment::Credit`]).
    pub can_be_credited: bool,
    /// Keeps each window's total until the window after it ends, so closed
    /// windows can be exported ([`super::Kept`], [`Counter::window_totals`]).
    pub keeps_window_totals: bool,
    /// Can count in windows by the calendar (`window = "month"`; see
    /// [`super::calendar`]).
    pub follows_calendar: bool,
    /// Its limit (or burst) × window is held below 2^50 when configured:
    /// it counts in unit-milliseconds (weights, scaled tokens, arrival
    /// times), which stay exact in Lua's numbers only below 2^53, or keeps
    /// an entry per unit (the sliding log). The fixed window counts whole
    /// units in one number and is not held to it.
    pub bounded_by_unit_ms: bool,
    /// Tells when a request that does not fit now would (a theoretical
    /// arrival time): it can hold a request until then (`delay`).
    pub tells_arrival: bool,
}

impl Algorithm {
    /// Refills continuously up to a burst (see [`Properties::has_burst`]).
    pub const fn has_burst(self) -> bool {
        self.properties().has_burst
    }

    /// Can be leased (see [`Properties::can_lease`]).
    pub const fn can_lease(self) -> bool {
        self.properties().can_lease
    }

    /// Can be credited (see [`Properties::can_be_credited`]).
    pub const fn can_be_credited(self) -> bool {
        self.properties().can_be_credited
    }

    /// Keeps closed windows' totals (see [`Properties::keeps_window_totals`]).
    pub const fn keeps_window_totals(self) -> bool {
        self.properties().keeps_window_totals
    }

    /// Can count by the calendar (see [`Properties::follows_calendar`]).
    pub const fn follows_calendar(self) -> bool {
        self.properties().follows_calendar
    }
}

/// How one algorithm's state for one client counts: what each
/// algorithm's module gives for its state. What has a default holds for
/// most algorithms; a module says otherwise where its algorithm differs.
pub trait Counter: Default {
    /// Whether `cost` units fit at `now`, and the verdict if they are
    /// taken (see [`State::check`]).
    fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict;

    /// Takes `cost` units at `now` (see [`State::consume`]).
    fn consume(&mut self, limit: &Limit, now: u64, cost: u64);

    /// Gives back `back` of the `reserved` units taken at `at`, at `now`,
    /// where they still count (see [`State::settle`]).
    fn give_back(&mut self, limit: &Limit, now_at: (u64, u64), reserved: u64, back: u64);

    /// Takes `units` at `now` whether or not they fit: units an answer
    /// reported beyond its reservation. By default they are consumed.
    fn charge_over(&mut self, limit: &Limit, now: u64, units: u64) {
        self.consume(limit, now, units);
    }

    /// An operator's grant of `units` at `now`. By default, what a
    /// reservation of `units` taken now and settled to nothing would give
    /// back.
    fn grant(&mut self, limit: &Limit, now: u64, units: u64) {
        if units > 0 {
            self.give_back(limit, (now, now), units, units);
        }
    }

    /// Units an operator granted past the limit still in force at `now`.
    /// By default none: a credit comes back as units given back.
    fn granted(&self, _limit: &Limit, _now: u64) -> u64 {
        0
    }

    /// When this state holds nothing that matters any more.
    fn expires_at(&self, limit: &Limit) -> u64;

    /// The windows' totals kept for export, for an algorithm that keeps
    /// them ([`Properties::keeps_window_totals`]); by default none.
    fn window_totals(&self, _limit: &Limit) -> Option<WindowTotals> {
        None
    }
}

/// What a state that keeps its windows' totals holds, each as `(start,
/// end, units)`: the window it counts, and the last closed one that
/// counted anything (`(0, 0, 0)` for none).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowTotals {
    /// The counted window.
    pub counted: (u64, u64, u64),
    /// The last closed window.
    pub closed: (u64, u64, u64),
}

/// [`State`], its algorithm's modules, and the dispatch from one to the
/// other, from the list of algorithms.
macro_rules! states {
    ($($(#[$doc:meta])* $variant:ident = $name:ident,)*) => {
        $(mod $name;)*

        impl Algorithm {
            /// What this algorithm is: its module's answers.
            pub const fn properties(self) -> &'static Properties {
                match self {
                    $(Algorithm::$variant => &$name::PROPERTIES,)*
                }
            }
        }

        /// One limit's counting state for one client: its algorithm's own.
        #[derive(Debug, Clone, PartialEq, Eq)]
        pub enum State {
            $($(#[$doc])* $variant($name::State),)*
        }

        impl State {
            /// Fresh state: nothing consumed.
            pub fn new(algorithm: Algorithm) -> Self {
                match algorithm {
                    $(Algorithm::$variant => Self::$variant(Default::default()),)*
                }
            }

            /// Whether `cost` units fit at `now`, and the verdict if they
            /// are taken.
            ///
            /// Time never runs backwards inside a state: a `now` before
            /// the window a window state counts in (the clock stepped
            /// back) is read as that window's start, and the others
            /// already decide at the later of `now` and the latest time
            /// they hold, or grow only stricter when `now` is earlier (see
            /// `lua/prelude.lua`).
            pub fn check(&mut self, limit: &Limit, now: u64, cost: u64) -> Verdict {
                match self {
                    $(Self::$variant(s) => s.check(limit, now, cost),)*
                }
            }

            /// Takes `cost` units at `now`; call only after
            /// [`State::check`] allowed at the same `now`.
            pub fn consume(&mut self, limit: &Limit, now: u64, cost: u64) {
                match self {
                    $(Self::$variant(s) => s.consume(limit, now, cost),)*
                }
            }

            /// Gives back `back` of `reserved` units taken at `at` (see
            /// [`State::settle`]).
            fn give_back(&mut self, limit: &Limit, now_at: (u64, u64), reserved: u64, back: u64) {
                match self {
                    $(Self::$variant(s) => s.give_back(limit, now_at, reserved, back),)*
                }
            }

            /// Takes `units` at `now` whether or not they fit (see
            /// [`Counter::charge_over`]).
            fn charge_over(&mut self, limit: &Limit, now: u64, units: u64) {
                match self {
                    $(Self::$variant(s) => s.charge_over(limit, now, units),)*
                }
            }

            /// An operator's grant of `units` at `now`: a fixed window
            /// admits that many more in its current window, past its
            /// number, until the window ends; the other algorithms get
            /// back what a reservation of `units` taken now and settled to
            /// nothing would give back.
            pub fn grant(&mut self, limit: &Limit, now: u64, units: u64) {
                match self {
                    $(Self::$variant(s) => s.grant(limit, now, units),)*
                }
            }

            /// Units an operator granted past the limit still in force at
            /// `now`: a fixed window's, while its window is current; the
            /// others take a credit as units given back, so hold none
            /// apart.
            pub fn granted(&self, limit: &Limit, now: u64) -> u64 {
                match self {
                    $(Self::$variant(s) => s.granted(limit, now),)*
                }
            }

            /// When this state holds nothing that matters any more.
            pub fn expires_at(&self, limit: &Limit) -> u64 {
                match self {
                    $(Self::$variant(s) => s.expires_at(limit),)*
                }
            }

            /// The windows' totals it keeps for export, if its algorithm
            /// keeps them.
            pub fn window_totals(&self, limit: &Limit) -> Option<WindowTotals> {
                match self {
                    $(Self::$variant(s) => s.window_totals(limit),)*
                }
            }
        }
    };
}

super::each_algorithm!(states);

#[cfg(test)]
pub(super) mod tests;
