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

    /// The contents last read, as text.
    fn text(&self) -> Option<&str> {
        std::str::from_utf8(self.last.as_deref()?).ok()
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
    ///
    /// The file may have changed since the configuration read it: if it
    /// holds another table now, the first check reads it.
    pub(super) fn new(file: config::PlanTableFile) -> Self {
        if file.read.is_empty() {
            warn_empty_table(&file.path);
        }
        let mut seen = Seen::new(file.path.clone());
        let now = seen
            .text()
            .map(|text| config::PlanTable::parse(text, &file.names));
        if !matches!(now, Some(Ok(table)) if table == *file.read) {
            seen.last = None;
        }
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

/// The keys file a configuration names, the plans its keys may name, and
/// the file as the configuration read it.
pub(super) type KeysFileRead = (PathBuf, Vec<Arc<str>>, Arc<KeysFile>);

/// The keys file and the plans its keys may name.
pub(super) struct KeysWatch {
    names: Vec<Arc<str>>,
    seen: Seen,
}

impl KeysWatch {
    /// The keys file `running` reads, if it names one, and the plans its
    /// keys may name.
    pub(super) fn file_of(running: &config::Config) -> Option<KeysFileRead> {
        let file = running.keys_file.as_ref()?;
        Some((file.path.clone(), running.plan_names(), Arc::clone(file)))
    }

    /// Watches the keys file `path` from its contents now. The file may
    /// have changed since the configuration read it (`read`): if it lists
    /// other keys now, the first check reads it.
    pub(super) fn new((path, names, read): KeysFileRead) -> Self {
        let mut seen = Seen::new(path);
        let now = seen
            .text()
            .map(|text| config::parse_keys_file(&seen.path, text, &names));
        if !matches!(now, Some(Ok(file)) if file == *read) {
            seen.last = None;
        }
        Self { names, seen }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of its own for `test`.
    fn dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("floodgate-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a test directory");
        dir
    }

    fn plans() -> Vec<Arc<str>> {
        vec!["free".into(), "pro".into()]
    }

    /// A table changed between the configuration's read and the watch's
    /// start is read at the first check; one that did not change is not.
    #[test]
    fn a_table_changed_since_the_configuration_read_it_is_read_at_once() {
        let path = dir("table-watch").join("plans.txt");
        std::fs::write(&path, "c1 pro\n").expect("write the table");
        let watch = |as_read: &str| {
            let read = config::PlanTable::parse(as_read, &plans()).expect("a table");
            TableWatch::new(config::PlanTableFile {
                path: path.clone(),
                names: plans(),
                read: Arc::new(read),
            })
        };
        match watch("c1 free\n").check() {
            Some(FileRead::PlanTable(read_at, Ok(table))) => {
                assert_eq!(read_at, path);
                let c1 = crate::client::ClientId::header("c1");
                assert_eq!(table.plan_of(&c1), Some("pro"));
            }
            other => panic!("the changed table was not read: {other:?}"),
        }
        assert!(watch("c1 pro\n").check().is_none());
    }

    /// The same for the keys file.
    #[test]
    fn a_keys_file_changed_since_the_configuration_read_it_is_read_at_once() {
        let path = dir("keys-watch").join("keys.toml");
        let listing = |identity: &str| {
            format!(
                "[[key]]\nsha256 = \"{}\"\nidentity = \"{identity}\"\n",
                "ab".repeat(32)
            )
        };
        std::fs::write(&path, listing("now")).expect("write the keys file");
        let watch = |identity: &str| {
            let read =
                config::parse_keys_file(&path, &listing(identity), &plans()).expect("a keys file");
            KeysWatch::new((path.clone(), plans(), Arc::new(read)))
        };
        match watch("before").check() {
            Some(FileRead::Keys(Ok(file))) => {
                let listed = file.keys.as_deref().unwrap_or_default();
                assert_eq!(listed.len(), 1);
                assert_eq!(listed[0].spec.identity, "now");
            }
            other => panic!("the changed keys file was not read: {other:?}"),
        }
        assert!(watch("now").check().is_none());
    }
}
