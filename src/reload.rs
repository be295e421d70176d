//! When to reload: on SIGHUP (the `reload` notification) and, unless
//! `reload_on_change = false`, when the contents of the configuration file,
//! or of the listener's certificate, key or client CA files, change: a
//! renewed certificate is served to new connections without a signal.
//!
//! The file is compared by contents once a second rather than watched with
//! inotify: that also sees the symlink swaps Kubernetes uses for mounted
//! ConfigMaps, which file-event watchers commonly miss, for the cost of one
//! small read a second.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use crate::config::{self, Config};
use crate::gate::Shared;

/// How often the file is compared.
const POLL: Duration = Duration::from_secs(1);

/// Reloads `running.path` into `shared` whenever asked or changed, forever.
pub async fn watch(shared: Arc<Shared>, running: Config, reload: Arc<Notify>) {
    let path = running.path.clone();
    let mut watched = running.files();
    let mut last_seen = contents(&watched);
    let mut tick = tokio::time::interval(POLL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let asked = tokio::select! {
            () = reload.notified() => true,
            _ = tick.tick() => false,
        };
        if !asked && !running.server.reload_on_change {
            continue;
        }
        let now = contents(&watched);
        if !asked && (now.iter().any(Option::is_none) || now == last_seen) {
            continue;
        }
        if asked {
            tracing::info!(path = %path.display(), "reload requested");
        } else {
            tracing::info!(path = %path.display(), "configuration or certificate files changed");
        }
        last_seen = now;
        match config::load(&path) {
            Ok(new) => {
                // The new file may name other certificate files.
                watched = new.files();
                last_seen = contents(&watched);
                shared.reload(&running, new).await;
            }
            Err(e) => shared.reload_refused(&e),
        }
    }
}

fn contents(files: &[PathBuf]) -> Vec<Option<Vec<u8>>> {
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}
