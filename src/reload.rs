//! When to reload: on SIGHUP (the `reload` notification) and, unless
//! `reload_on_change = false`, when the contents of the configuration file,
//! or of the listener's certificate, key or client CA files, change: a
//! renewed certificate is served to new connections without a signal.
//!
//! The file is compared by contents once a second rather than watched with
//! inotify: that also sees the symlink swaps Kubernetes uses for mounted
//! ConfigMaps, which file-event watchers commonly miss, for the cost of one
//! small read a second.

use std::path::{Path, PathBuf};
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
    let mut watched = files(&running);
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
                watched = files(&new);
                last_seen = contents(&watched);
                crate::gate::start_upstreams(&new).await;
                shared.reload(&running, new);
            }
            Err(e) => shared.reload_refused(&e),
        }
    }
}

/// The files whose contents decide `config`: the file itself, the
/// listener's TLS files, the upstreams' CA and client certificates, and
/// the keys JWT clients are verified with.
fn files(config: &Config) -> Vec<PathBuf> {
    let mut files = vec![config.path.clone()];
    if let Some((tls, _)) = &config.server.tls {
        files.extend(tls.files().map(Path::to_path_buf));
    }
    for route in config.routes.iter() {
        for part in &route.client.parts {
            if let crate::client::Part::Claim(rule) = part {
                files.extend(rule.source.clone());
            }
        }
        if let crate::routes::Action::Upstream(upstream) = &route.action {
            for endpoint in upstream.group.sources() {
                if let Some(tls) = &endpoint.tls {
                    files.extend(tls.files().map(Path::to_path_buf));
                }
            }
        }
    }
    files.sort();
    files.dedup();
    files
}

fn contents(files: &[PathBuf]) -> Vec<Option<Vec<u8>>> {
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}
