//! The access log: one line per request, written when its answer has gone
//! out (or the client went away): who asked, on which route, what the limits
//! decided, where it went and what it cost.
//!
//! The data path never writes: a line is formatted and handed to a writer
//! thread through a bounded queue; when the queue is full (the disk is
//! slower than the traffic) the line is dropped and counted, never waited
//! for. Lines for allowed requests can be sampled. Denied ones are always
//! logged, but at most `denied_per_client` a second per client (clients
//! share 4 096 slots by a hash of their id, so memory is fixed however many
//! there are) and 1 000 a second in all: a flood of denials cannot flood
//! the disk. `SIGUSR1` reopens the file, for logrotate.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use prometheus_client::metrics::counter::Counter;
use sha2::{Digest as _, Sha256};

use crate::client::{ClientId, hex, keyed_digest, process_key};
use crate::metrics::Outcome;

mod logged;
mod record;
pub mod settings;
mod writer;

pub use logged::Line;
pub use record::{Record, json_string};
pub use settings::{FORMATS, Format, Settings, ShowId};
use writer::{Sink, write_lines};

/// Lines waiting for the writer; past this they are dropped.
const QUEUE: usize = 16_384;
/// Slots that denied clients share for the per-client cap.
const SLOTS: usize = 4_096;
/// Most denial lines a second, all clients together.
const DENIED_PER_SECOND: u64 = 1_000;
/// Longest path written; a longer one is cut and marked with `…`.
const MAX_PATH: usize = 1_024;

/// Why the access log cannot start.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot open the access log {path}: {source}; check that its folder exists and floodgate may write there"
)]
pub struct OpenError {
    path: PathBuf,
    source: std::io::Error,
}

/// How client ids appear to operators: in the access log and on
/// `/clients/top` (`[access_log] client_id`, which applies even while the
/// log itself is off).
#[derive(Debug)]
pub struct Ids {
    mode: ShowId,
    key: [u8; 32],
}

impl Ids {
    /// Ids shown as `mode` says, digests keyed as [`digest_key`] says
    /// (with the store's `id_secret`, when there is one: instances sharing
    /// it name a client alike).
    pub fn new(mode: ShowId, id_secret: Option<&[u8]>) -> Self {
        Self {
            mode,
            key: digest_key(id_secret),
        }
    }

    /// How `client` appears (`None` with `client_id = "none"`).
    pub fn show(&self, client: &ClientId) -> Option<String> {
        match self.mode {
            ShowId::Hidden => None,
            ShowId::Raw => Some(raw(client)),
            ShowId::Hash => Some(keyed_digest(&self.key, raw(client).as_bytes())),
        }
    }
}

/// The access log in force.
#[derive(Debug)]
pub struct AccessLog {
    settings: Settings,
    ids: Arc<Ids>,
    lines: SyncSender<String>,
    /// Per slot: the second (since the epoch) and the denial lines in it.
    slots: Box<[AtomicU64]>,
    /// The same for all denials.
    all_denied: AtomicU64,
    sampled: AtomicU64,
    /// Lines not written because the queue was full.
    dropped: Counter,
    /// Denial lines not written because of the caps.
    suppressed: Counter,
}

/// Asks the writer to reopen its file before the next line (`SIGUSR1`).
pub fn reopen() {
    REOPEN.store(true, Ordering::Relaxed);
}

static REOPEN: AtomicBool = AtomicBool::new(false);

// === impl AccessLog ===

impl AccessLog {
    /// Opens the log as `settings` say and starts its writer thread; lines
    /// dropped for a full queue and denial lines held back by the caps are
    /// counted into `dropped` and `suppressed`.
    pub fn start(
        settings: Settings,
        ids: Arc<Ids>,
        dropped: Counter,
        suppressed: Counter,
    ) -> Result<Arc<Self>, OpenError> {
        let sink = Sink::open(settings.path.as_deref())?;
        let (lines, queue) = std::sync::mpsc::sync_channel(QUEUE);
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || write_lines(&queue, sink))
            .map_err(|source| OpenError {
                path: settings.path.clone().unwrap_or_else(|| "stderr".into()),
                source,
            })?;
        Ok(Arc::new(Self {
            slots: (0..SLOTS).map(|_| AtomicU64::new(0)).collect(),
            all_denied: AtomicU64::new(0),
            sampled: AtomicU64::new(0),
            ids,
            dropped,
            suppressed,
            lines,
            settings,
        }))
    }

    /// Whether a request with this outcome gets a line (sampling for
    /// allowed ones, the caps for denied ones).
    fn wanted(&self, outcome: Option<Outcome>, client: Option<&ClientId>) -> bool {
        match outcome {
            Some(Outcome::Denied) => self.denial_allowed(client),
            Some(Outcome::Allowed) | None if self.settings.sample_allowed < 1.0 => {
                let n = self.sampled.fetch_add(1, Ordering::Relaxed);
                // A scrambled counter: evenly spread, no lock, no RNG.
                let r = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 11;
                (r as f64) < self.settings.sample_allowed * (1u64 << 53) as f64
            }
            _ => true,
        }
    }

    fn denial_allowed(&self, client: Option<&ClientId>) -> bool {
        let second = now_secs();
        let slot = client.map_or(0, |c| {
            use std::hash::BuildHasher;
            static SEED: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
            let seed = SEED.get_or_init(std::collections::hash_map::RandomState::new);
            (seed.hash_one(c) as usize) % SLOTS
        });
        let allowed = take(&self.slots[slot], second, self.settings.denied_per_client)
            && take(&self.all_denied, second, DENIED_PER_SECOND);
        if !allowed {
            self.suppressed.inc();
        }
        allowed
    }

    fn send(&self, line: String) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) =
            self.lines.try_send(line)
        {
            self.dropped.inc();
        }
    }
}

/// Counts one more in `cell` (the second in its high 40 bits, the count in
/// its low 24) if fewer than `cap` were counted this second.
fn take(cell: &AtomicU64, second: u64, cap: u64) -> bool {
    let mut current = cell.load(Ordering::Relaxed);
    loop {
        let (at, count) = (current >> 24, current & 0xFF_FFFF);
        let next = if at == second {
            if count >= cap {
                return false;
            }
            current + 1
        } else {
            (second << 24) | 1
        };
        match cell.compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return true,
            Err(seen) => current = seen,
        }
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The key of client digests: `FLOODGATE_ACCESS_LOG_KEY` (the same on every
/// instance gives the same digests everywhere), else one derived from the
/// store's `id_secret` (shared by the instances sharing the store, and
/// apart from the key of the store's own digests), else the process's own.
fn digest_key(id_secret: Option<&[u8]>) -> [u8; 32] {
    if let Ok(key) = std::env::var("FLOODGATE_ACCESS_LOG_KEY")
        && !key.is_empty()
    {
        return Sha256::digest(key.as_bytes()).into();
    }
    if let Some(secret) = id_secret {
        return Sha256::new()
            .chain_update(b"floodgate: client ids as operators see them\0")
            .chain_update(secret)
            .finalize()
            .into();
    }
    *process_key()
}

/// A client id as sent: an address, a header's value (lossy UTF-8), parts
/// joined with `+`.
fn raw(client: &ClientId) -> String {
    match client {
        ClientId::Addr(ip) => ip.to_string(),
        ClientId::Header(value) => String::from_utf8_lossy(value).into_owned(),
        ClientId::Digest(d) => hex(&d[..]),
        ClientId::Global => "global".to_owned(),
        ClientId::Composite(parts) => parts.iter().map(raw).collect::<Vec<_>>().join("+"),
    }
}
