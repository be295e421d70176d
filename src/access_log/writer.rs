//! The writer thread: lines from the queue to standard error or the file,
//! reopened on `SIGUSR1`.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;

use super::{OpenError, REOPEN};

#[derive(Debug)]
pub(super) enum Sink {
    Stderr,
    File(PathBuf, std::io::BufWriter<std::fs::File>),
}

impl Sink {
    pub(super) fn open(path: Option<&Path>) -> Result<Self, OpenError> {
        let Some(path) = path else {
            return Ok(Self::Stderr);
        };
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map(|file| Self::File(path.to_owned(), std::io::BufWriter::new(file)))
            .map_err(|source| OpenError {
                path: path.to_owned(),
                source,
            })
    }

    fn write(&mut self, line: &str) {
        let written = match self {
            Self::Stderr => {
                let mut err = std::io::stderr().lock();
                err.write_all(line.as_bytes())
                    .and_then(|()| err.write_all(b"\n"))
            }
            Self::File(_, file) => file
                .write_all(line.as_bytes())
                .and_then(|()| file.write_all(b"\n")),
        };
        if let Err(e) = written {
            tracing::warn!(error = %e, "cannot write the access log");
        }
    }

    fn flush(&mut self) {
        if let Self::File(_, file) = self {
            let _ = file.flush();
        }
    }

    /// The file opened again at its path (after logrotate moved it).
    fn reopened(self) -> Self {
        match self {
            Self::File(path, mut old) => {
                let _ = old.flush();
                match Self::open(Some(&path)) {
                    Ok(new) => {
                        tracing::info!(path = %path.display(), "access log reopened");
                        new
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "keeping the access log open as it was");
                        Self::File(path, old)
                    }
                }
            }
            Self::Stderr => Self::Stderr,
        }
    }
}

/// Writes what arrives until every sender is gone, flushing whenever the
/// queue runs dry.
pub(super) fn write_lines(queue: &Receiver<String>, mut sink: Sink) {
    while let Ok(first) = queue.recv() {
        if REOPEN.swap(false, Ordering::Relaxed) {
            sink = sink.reopened();
        }
        sink.write(&first);
        while let Ok(line) = queue.try_recv() {
            sink.write(&line);
        }
        sink.flush();
    }
    sink.flush();
}
