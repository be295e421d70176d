//! One request's way through floodgate, as named phases, with the rules a
//! reload swaps and the state every request shares.
//!
//! - [`phases`]: head → route → admit body → identify → reserve → decide →
//!   forward (or the route's own answer) → annotate → log, each a function
//!   of its own, passing one request context;
//! - [`rules`]: [`Rules`], the compiled rule table with the live side
//!   tables built beside it (upstream endpoints and their pools' slots,
//!   concurrency caps, top-client sketches, metric handles), keyed by route
//!   or upstream index;
//! - [`shared`]: [`Shared`], what every connection shares (the rules in
//!   force, the limiter, the forwarder, metrics, the access log), built
//!   from a configuration and reloaded in place;
//! - `hooks`: what an answer's end is told to (a usage meter, the access
//!   log's line, the concurrency slot held until then), each its owner's
//!   part, held together by gate in one box;
//! - `by_answer`: limits that count by the answer (`count_when`), the
//!   units of an answer they do not count given back;
//! - `held`: requests held until their limits fit (a limit's `delay`),
//!   their places bounded per instance and per client;
//! - `drain`: answers whose client leaves before their usage report,
//!   closed at once or read on within bounds and settled;
//! - `denials`: denials in the log, one line per route and client per
//!   interval with the count folded into it, and a bounded number a second;
//! - [`metering`]: routes whose cost is what their upstream reports: the
//!   reservation charged with the decision, settled to the report;
//! - [`shown`]: the limits, budgets and plans as `/status.json` shows
//!   them to operators;
//! - `audit`: operators' actions recorded in the store's audit trail;
//! - `reloads`: how each file a reload reads last went (the
//!   configuration, the plan table, the keys file), and the keys file's
//!   reconcile when it is read anew.

mod audit;
mod by_answer;
mod denials;
mod drain;
mod held;
mod hooks;
pub mod metering;
mod phases;
mod reloads;
pub mod rules;
pub mod shared;
pub mod shown;

pub use audit::{AuditEntry, AuditError};
pub use phases::operator::{Adjustment, Kept, Operation, OperationError, kept, operate, penalties};
pub use phases::{Connection, decide, handle};
pub use reloads::{LastReload, ReloadedFile};
pub use rules::{Rules, start_upstreams};
pub use shared::{Readiness, Shared, StartError};
