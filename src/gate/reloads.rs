//! How reloads went, for each file a configuration reads anew on its own:
//! the configuration itself, the client → plan table and the keys file.
//! A file refused keeps what it had put in force, and counts as a failed
//! reload (`floodgate_config_reloads_total{result="failure"}`,
//! `floodgate_config_last_reload_successful` 0, `/status.json`'s
//! `reload`) until that file is read cleanly again: the gauge is 1 only
//! when every file's last read applied.

use std::sync::Arc;

use super::Shared;

/// How the last reload went.
#[derive(Debug, Clone)]
pub struct LastReload {
    /// When it was tried (ms since the epoch).
    pub at_ms: u64,
    /// Why files were refused (each still refused, one per line); `None`:
    /// every file applied.
    pub problem: Option<String>,
}

/// A file a reload reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReloadedFile {
    /// The configuration file (which reads the other two with it).
    Config,
    /// The client → plan table (`[plan_selection] table`).
    PlanTable,
    /// The keys file (`[keys] file`).
    KeysFile,
}

/// Each file's last refusal, and when a reload was last tried.
#[derive(Debug, Default)]
pub(super) struct Reloads {
    /// When the last reload of any file was tried; `None`: none yet.
    at_ms: Option<u64>,
    /// Why each file (in [`ReloadedFile`]'s order) was last refused, while
    /// it stays refused.
    refused: [Option<String>; 3],
}

impl Reloads {
    /// How the reloads stand: the problems of every file refused now.
    fn last(&self) -> Option<LastReload> {
        let problems: Vec<&str> = self.refused.iter().flatten().map(String::as_str).collect();
        Some(LastReload {
            at_ms: self.at_ms?,
            problem: (!problems.is_empty()).then(|| problems.join("\n")),
        })
    }
}

impl Shared {
    /// How the last reload went, with every file still refused; `None`
    /// when there was none.
    pub fn last_reload(&self) -> Option<LastReload> {
        self.reloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .last()
    }

    /// Records that `file` was read anew: applied (`problem` `None`) or
    /// refused. The configuration read cleanly means its plan table and
    /// keys file were read cleanly with it. True when every file's last
    /// read applied.
    pub(super) fn reloaded(&self, file: ReloadedFile, problem: Option<String>) -> bool {
        let mut reloads = self
            .reloads
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        reloads.at_ms = Some(crate::clock::now_ms());
        if file == ReloadedFile::Config && problem.is_none() {
            reloads.refused = Default::default();
        }
        reloads.refused[file as usize] = problem;
        reloads.refused.iter().all(Option::is_none)
    }

    /// A plan table or keys file read anew on its own: applied (counted
    /// as a reload) or refused (a failed reload; what it had put in force
    /// stays).
    pub fn file_reloaded(&self, file: ReloadedFile, problem: Option<&str>) {
        let applied = problem.is_none();
        let clean = self.reloaded(file, problem.map(str::to_owned));
        self.metrics.file_reloaded(applied, clean);
        if let Some(problem) = problem {
            for line in problem.lines() {
                tracing::error!("{line}");
            }
            match file {
                ReloadedFile::PlanTable => {
                    tracing::error!("plan table refused; the table in force stays");
                }
                ReloadedFile::KeysFile => {
                    if let Some(keys) = &self.keys
                        && let Some(path) = &keys.settings().file
                    {
                        keys.file_refused(path, problem);
                    }
                    tracing::error!(
                        "keys file refused; the registry stays as the last file that applied left it"
                    );
                }
                ReloadedFile::Config => {}
            }
        }
    }

    /// The keys file was read anew: reconciled into the registry.
    pub async fn keys_file_reloaded(&self, file: &Arc<crate::keys::KeysFile>) {
        self.file_reloaded(ReloadedFile::KeysFile, None);
        self.reconcile_keys(file).await;
    }

    /// The client → plan table at `path` was read anew: it is put in
    /// force when the rules in force read their plans from that file (a
    /// reload that was refused may have left the watch on another one).
    pub fn plan_table_read(&self, path: &std::path::Path, table: crate::routes::PlanTable) {
        let rules = self.rules();
        let in_force = rules.routes.plan_selection.as_ref().is_some_and(
            |s| matches!(&s.by, crate::routes::PlanSource::Table { path: p, .. } if p == path),
        );
        if !in_force {
            tracing::warn!(
                path = %path.display(),
                "plan table read, but the rules in force read plans from no such table: not applied"
            );
            return;
        }
        self.plan_table.store(Arc::new(table));
        self.plans_changed();
        self.file_reloaded(ReloadedFile::PlanTable, None);
    }

    /// Reconciles the keys file `file` into the registry (when the
    /// registry is on and `file` is the one it was started with: another
    /// file needs a restart). A reconcile the store did not let finish is
    /// tried again by the registry's own task; it is no refusal of the
    /// file.
    pub async fn reconcile_keys(&self, file: &Arc<crate::keys::KeysFile>) {
        let Some(keys) = &self.keys else {
            return;
        };
        if keys.settings().file.as_deref() != Some(file.path.as_path()) {
            return;
        }
        if let Err(e) = keys.reconcile(file).await {
            tracing::warn!(
                path = %file.path.display(),
                error = %e,
                "the keys file could not be reconciled into the registry yet; trying again every second"
            );
        }
    }
}
