//! When to reload: on SIGHUP (the `reload` notification) and, unless
//! `reload_on_change = false`, when the contents of the configuration file,
//! or of the listener's certificate, key or client CA files, change: a
//! renewed certificate is served to new connections without a signal.
//!
//! The file is compared by contents once a second rather than watched with
//! inotify: that also sees the symlink swaps Kubernetes uses for mounted
//! ConfigMaps, which file-event watchers commonly miss, for the cost of one
//! small read a second. The client → plan table and the keys file are
//! compared the same way and read anew on their own ([`files`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use tokio::sync::{Notify, mpsc};

use crate::config::{self, Config, LoadError};
use crate::gate::{ReloadedFile, Shared};
use files::{FileRead, KeysWatch, TableWatch};

mod files;

/// How often the file is compared.
const POLL: Duration = Duration::from_secs(1);

/// Reloads `running.path` into `shared` whenever asked or changed, until
/// dropped.
///
/// Files are read on a thread of the watcher's own, never on a runtime
/// worker: a slow disk or a network mount delays the next reload, not the
/// requests those workers serve. The configuration it reads comes back here
/// to be applied.
pub async fn watch(shared: Arc<Shared>, running: Config, reload: Arc<Notify>, baseline: Baseline) {
    let (ask, asked) = std::sync::mpsc::channel();
    let (send, mut loaded) = mpsc::channel(1);
    let (tell, mut files) = mpsc::channel(4);
    let reader = Reader {
        files: tell,
        path: running.path.clone(),
        watched: baseline.files,
        digest: running.digest.clone(),
        on_change: running.server.reload_on_change,
        overrides: running.overrides,
        table_file: running.plan_table(),
        table: None,
        keys: None,
        keys_file: KeysWatch::file_of(&running),
    };
    let spawned = std::thread::Builder::new()
        .name("floodgate-reload".to_owned())
        .spawn(move || reader.run(baseline.contents, &asked, &send));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the reload thread: the configuration will not be reloaded");
        return;
    }
    loop {
        tokio::select! {
            // A file read before the configuration is applied first: the
            // configuration read after it reads it as it is now.
            biased;
            () = reload.notified() => {
                if ask.send(()).is_err() {
                    return;
                }
            }
            Some(read) = files.recv() => match read {
                FileRead::PlanTable(path, Ok(table)) => shared.plan_table_read(&path, table),
                FileRead::PlanTable(_, Err(e)) => {
                    shared.file_reloaded(ReloadedFile::PlanTable, Some(&e));
                }
                FileRead::Keys(Ok(file)) => shared.keys_file_reloaded(&file).await,
                FileRead::Keys(Err(e)) => shared.file_reloaded(ReloadedFile::KeysFile, Some(&e)),
            },
            new = loaded.recv() => match new {
                Some(Ok(new)) => shared.reload(&running, new).await,
                Some(Err(e)) => shared.reload_refused(&e),
                None => return,
            },
        }
    }
}

/// The files a configuration was loaded from, as they were when serving
/// began: the watcher's first comparison is against these, so a change made
/// while floodgate was starting is not taken for the starting point.
#[derive(Debug)]
pub struct Baseline {
    files: Vec<PathBuf>,
    contents: Vec<Option<Vec<u8>>>,
}

impl Baseline {
    /// Reads `running`'s files now (call it as soon as serving begins).
    pub fn of(running: &Config) -> Self {
        let files = running.files();
        let contents = contents(&files);
        Self { files, contents }
    }
}

/// The reload thread's state: what it reads and what it last saw.
struct Reader {
    path: PathBuf,
    watched: Vec<PathBuf>,
    /// The digest of the configuration file in force when watching began.
    digest: String,
    on_change: bool,
    /// Listener addresses from the command line, applied to each load.
    overrides: config::Overrides,
    /// The client → plan table file in force at the start, until the
    /// thread reads it.
    table_file: Option<config::PlanTableFile>,
    /// The client → plan table file, watched on its own.
    table: Option<TableWatch>,
    /// The keys file in force at the start and the plans its keys may
    /// name, until the thread reads it.
    keys_file: Option<files::KeysFileRead>,
    /// The keys file, watched on its own.
    keys: Option<KeysWatch>,
    /// Told what a plan table or keys file read anew found.
    files: mpsc::Sender<FileRead>,
}

impl Reader {
    /// Reads and loads the file when asked (`asked`) or, once a second,
    /// when it or a file it names changed since `last_seen` (the files as
    /// serving began); sends each load's result. Ends when the watcher is
    /// dropped.
    fn run(
        mut self,
        mut last_seen: Vec<Option<Vec<u8>>>,
        asked: &Receiver<()>,
        loaded: &mpsc::Sender<Result<Config, LoadError>>,
    ) {
        self.table = self.table_file.take().map(TableWatch::new);
        self.keys = self.keys_file.take().map(KeysWatch::new);
        // The file may have changed between its load and the baseline: if
        // it is not the text in force, the first comparison says changed.
        if let Some(i) = self.watched.iter().position(|f| *f == self.path) {
            let in_force = last_seen[i]
                .as_deref()
                .is_some_and(|text| config::digest(&String::from_utf8_lossy(text)) == self.digest);
            if !in_force {
                last_seen[i] = None;
            }
        }
        loop {
            let asked = match asked.recv_timeout(POLL) {
                Ok(()) => true,
                Err(RecvTimeoutError::Timeout) => false,
                Err(RecvTimeoutError::Disconnected) => return,
            };
            if !asked && !self.on_change {
                continue;
            }
            let read = [
                self.table.as_mut().and_then(TableWatch::check),
                self.keys.as_mut().and_then(KeysWatch::check),
            ];
            for read in read.into_iter().flatten() {
                if self.files.blocking_send(read).is_err() {
                    return;
                }
            }
            let now = contents(&self.watched);
            // A file missing now (mid-replace) is looked at again next time.
            if !asked && (now.iter().any(Option::is_none) || now == last_seen) {
                continue;
            }
            if asked {
                tracing::info!(path = %self.path.display(), "reload requested");
            } else {
                tracing::info!(path = %self.path.display(), "configuration or certificate files changed");
            }
            last_seen = now;
            let new = config::load(&self.path).map(|new| self.overrides.apply(new));
            if let Ok(new) = &new {
                // The new file may name other certificate files, another
                // plan table, other plans for the keys file's keys.
                self.watched = new.files();
                last_seen = contents(&self.watched);
                self.table = new.plan_table().map(TableWatch::new);
                self.keys = KeysWatch::file_of(new).map(KeysWatch::new);
            }
            if loaded.blocking_send(new).is_err() {
                return;
            }
        }
    }
}

fn contents(files: &[PathBuf]) -> Vec<Option<Vec<u8>>> {
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}
