//! The files a configuration names that are read anew on their own, when
//! they change, without reading the configuration again: the client →
//! plan table (put in force in place) and the keys file (reconciled into
//! the registry).
//!
//! Each is read only once its contents read the same twice, a moment
//! apart (a file being written in place is not taken half-written). One
//! with a problem is refused whole, every problem at its line and column,
//! and what it had put in force stays; the refusal counts as a failed
//! reload. A file that is gone is a warning naming it, and what it had
//! put in force stays until it is back. A plan table that lists no client
//! is a warning too, and applies (every client on the default plan); a
//! keys file that lists no key, see [`crate::keys::KeysFile::keys`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::config;
use crate::keys::KeysFile;

/// How long a changed file must stay the same before it is read.
const SETTLE: Duration = Duration::from_millis(200);

/// What reading a file anew found.
#[derive(Debug)]
pub(super) enum FileRead {
    /// The plan table read anew (for the gate to put in force when the
    /// rules in force read their plans from this file), or why the file
    /// was refused.
    PlanTable(PathBuf, Result<config::PlanTable, String>),
    /// The keys file as it lists its keys now, or why it was refused.
    Keys(Result<Arc<KeysFile>, String>),
}

/// A file's contents as last read, and whether it is gone.
struct Seen {
    path: PathBuf,
    /// What was last read (`None`: nothing yet, or it was gone).
    last: Option<Vec<u8>>,
    /// It was found gone (and said so).
    gone: bool,
}

impl Seen {
    fn new(path: PathBuf) -> Self {
        let last = std::fs::read(&path).ok();
        Self {
            path,
            last,
            gone: false,
        }
    }

    /// The file's contents when they changed since last read and read
    /// the same twice; `None` when not. A file gone (twice, a moment
    /// apart: not the moment of a replace) is said once, at WARN, with
    /// `stays`: what stays in force meanwhile.
    fn changed(&mut self, what: &str, stays: &str) -> Option<Vec<u8>> {
        let now = std::fs::read(&self.path).ok();
        let Some(now) = now else {
            if !self.gone {
                std::thread::sleep(SETTLE);
                if !self.path.exists() {
                    tracing::warn!(path = %self.path.display(), "{what} is gone; {stays} until it is back");
                    self.gone = true;
                    self.last = None;
                }
            }
            return None;
        };
        if self.gone {
            tracing::info!(path = %self.path.display(), "{what} is back");
            self.gone = false;
        }
        if self.last.as_ref() == Some(&now) {
            return None;
        }
        std::thread::sleep(SETTLE);
        if std::fs::read(&self.path).ok().as_ref() != Some(&now) {
            return None;
        }
        self.last = Some(now.clone());
        Some(now)
    }
}

/// A client → plan table file, read anew when it changes.
pub(super) struct TableWatch {
    file: config::PlanTableFile,
    seen: Seen,
}

impl TableWatch {
    /// Watches `file` from its contents now (a table as read with the
    /// configuration that lists no client is said at WARN).
    pub(super) fn new(file: config::PlanTableFile) -> Self {
        if file.read.is_empty() {
            warn_empty_table(&file.path);
        }
        let seen = Seen::new(file.path.clone());
        Self { file, seen }
    }

    /// Reads the table again when its file changed, whole; `None` when it
    /// did not change.
    pub(super) fn check(&mut self) -> Option<FileRead> {
        let config::PlanTableFile { path, names, .. } = &self.file;
        self.seen
            .changed("plan table", "the table in force stays")?;
        let read = match config::load_plan_table(path, names) {
            Ok(table) => {
                if table.is_empty() {
                    warn_empty_table(path);
                } else {
                    tracing::info!(path = %path.display(), clients = table.len(), "plan table reloaded");
                }
                Ok(table)
            }
            Err(error) => Err(error.to_string()),
        };
        Some(FileRead::PlanTable(path.clone(), read))
    }
}

fn warn_empty_table(path: &Path) {
    tracing::warn!(
        path = %path.display(),
        "plan table lists no client: every client is on the default plan"
    );
}

/// The keys file and the plans its keys may name.
pub(super) struct KeysWatch {
    names: Vec<Arc<str>>,
    seen: Seen,
}

impl KeysWatch {
    /// The keys file `running` reads, if it names one, and the plans its
    /// keys may name.
    pub(super) fn file_of(running: &config::Config) -> Option<(PathBuf, Vec<Arc<str>>)> {
        let file = running.keys_file.as_ref()?;
        Some((file.path.clone(), running.plan_names()))
    }

    /// Watches the keys file `path` from its contents now.
    pub(super) fn new((path, names): (PathBuf, Vec<Arc<str>>)) -> Self {
        Self {
            names,
            seen: Seen::new(path),
        }
    }

    /// Reads the file again when it changed; `None` when it did not.
    pub(super) fn check(&mut self) -> Option<FileRead> {
        let bytes = self
            .seen
            .changed("keys file", "the keys it listed stay in the registry")?;
        let path = &self.seen.path;
        let read = match String::from_utf8(bytes) {
            Ok(text) => config::parse_keys_file(path, &text, &self.names)
                .map(Arc::new)
                .map_err(|e| e.to_string()),
            Err(_) => Err(format!("{}: not UTF-8 text", path.display())),
        };
        Some(FileRead::Keys(read))
    }
}
