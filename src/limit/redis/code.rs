//! The decision code: the Lua files joined into a function library (or a
//! script where Redis has no functions), and getting it loaded.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use redis::{ErrorKind, RedisError, ServerErrorKind, Value};
use sha2::{Digest, Sha256};

use super::Link;
use super::connections::Conn;

/// The decision code shared by the script and the function library:
/// prelude, one file per algorithm (each followed by the line that puts
/// it among the `loaders`), then `decide`; the algorithms from the one
/// list of them (`each_algorithm!`).
macro_rules! lua_code {
    ($($(#[$doc:meta])* $variant:ident = $name:ident,)*) => {
        concat!(
            include_str!("../../../lua/prelude.lua"),
            $(
                include_str!(concat!("../../../lua/", stringify!($name), ".lua")),
                "loaders.", stringify!($name), " = ", stringify!($name), "\n",
            )*
            include_str!("../../../lua/decide.lua"),
        )
    };
}

/// The function library's loading of every algorithm, once, when Redis
/// loads the library (`loaded`, see decide.lua), from the list of
/// algorithms: Redis lets no global (not even `pairs`) be read then.
macro_rules! library_loads {
    ($($(#[$doc:meta])* $variant:ident = $name:ident,)*) => {
        concat!(
            "loaded = {}\n",
            $("loaded.", stringify!($name), " = {", stringify!($name), "()}\n",)*
        )
    };
}

macro_rules! decision_code {
    () => {
        crate::limit::each_algorithm!(lua_code)
    };
}

/// The decision as a plain script, for `EVALSHA` (Redis before 7).
pub const SCRIPT: &str = concat!(decision_code!(), include_str!("../../../lua/script.lua"));

/// The decision as a function library, for `FCALL` (Redis 7 and later),
/// without its first line and `FUNCTION_NAME` (see [`Library`]).
pub(super) const LIBRARY_BODY: &str = concat!(
    decision_code!(),
    crate::limit::each_algorithm!(library_loads),
    include_str!("../../../lua/library.lua")
);

/// The function library as Redis is given it, named after a hash of its
/// code so that floodgate versions sharing a Redis never replace each
/// other's.
#[derive(Debug)]
pub(super) struct Library {
    /// `FUNCTION LOAD`'s argument.
    pub(super) code: String,
    /// What `FCALL` names.
    pub(super) function: String,
}

impl Library {
    pub(super) fn new() -> Self {
        let digest = Sha256::digest(LIBRARY_BODY.as_bytes());
        let mut id = String::with_capacity(16);
        for b in &digest[..8] {
            let _ = write!(id, "{b:02x}");
        }
        let function = format!("floodgate_decide_{id}");
        let code = format!(
            "#!lua name=floodgate_{id}\nlocal FUNCTION_NAME = '{function}'\n{LIBRARY_BODY}"
        );
        Self { code, function }
    }
}

/// Whether the Redis behind a store runs functions: not known yet, yes
/// (decisions use `FCALL`), or no (they use `EVALSHA`).
pub(super) const FUNCTIONS_UNKNOWN: u8 = 0;
pub(super) const FUNCTIONS_YES: u8 = 1;
pub(super) const FUNCTIONS_NO: u8 = 2;

impl Link {
    /// Loads the function library, or the script where Redis refuses
    /// functions (before Redis 7, or an ACL without `FUNCTION`); remembers
    /// which, for the commands that follow.
    pub(super) async fn load_code(&self, conn: &mut Conn) -> Result<(), RedisError> {
        if self.functions.load(Ordering::Relaxed) != FUNCTIONS_NO {
            let loaded = redis::cmd("FUNCTION")
                .arg("LOAD")
                .arg("REPLACE")
                .arg(&self.library.code)
                .query_async::<Value>(conn)
                .await;
            match loaded {
                Ok(_) => {
                    self.functions.store(FUNCTIONS_YES, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) if refuses_functions(&e) => {
                    tracing::info!(
                        error = %e,
                        "Redis does not take function libraries; deciding with EVALSHA"
                    );
                    self.functions.store(FUNCTIONS_NO, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        self.script.load_async(conn).await.map(drop)
    }
}

/// Whether `FUNCTION LOAD` failed because this Redis does not take function
/// libraries at all (no such command before Redis 7, or an ACL without it),
/// rather than for a passing reason (`READONLY` mid-failover, `LOADING`).
pub(super) fn refuses_functions(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            detail_mentions(e, &["unknown command", "unknown subcommand"])
        }
        _ => false,
    }
}

/// Whether a server error's text contains one of `phrases` (lower case),
/// in any case.
pub(super) fn detail_mentions(e: &RedisError, phrases: &[&str]) -> bool {
    e.detail().is_some_and(|d| {
        let d = d.to_ascii_lowercase();
        phrases.iter().any(|p| d.contains(p))
    })
}

/// Whether a decision failed only because Redis lacks the code it names:
/// the script (`NOSCRIPT`), the function, or `FCALL` itself.
pub(super) fn code_missing(e: &RedisError) -> bool {
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::NoScript) => true,
        ErrorKind::Server(ServerErrorKind::ResponseError) => {
            detail_mentions(e, &["function not found", "unknown command"])
        }
        _ => false,
    }
}
