//! What every connection shares: the rules in force, the limiter, the
//! forwarder, the metrics and the access log; built from a configuration,
//! reloaded in place.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use arc_swap::ArcSwap;

use super::reloads::ReloadedFile;
use super::rules::{Rules, start_upstreams};
use crate::access_log::{AccessLog, Ids};
use crate::client::ClientId;
use crate::config::Config;
use crate::in_flight;
use crate::limit::Limiter;
use crate::limit::settings::OnError;
use crate::metrics::history::{self, History};
use crate::metrics::{Metrics, Outcome};
use crate::proxy::Forwarder;

/// Why serving could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store could not be set up.
    #[error("cannot set up the rate limit store: {0}")]
    Store(crate::limit::StoreError),
    /// The access log could not be opened.
    #[error(transparent)]
    AccessLog(#[from] crate::access_log::OpenError),
    /// The key registry could not be read.
    #[error(transparent)]
    Keys(#[from] crate::keys::StartError),
}

impl From<crate::limit::StoreError> for StartError {
    fn from(error: crate::limit::StoreError) -> Self {
        // Not a `source`: the message already holds the store's, and a
        // chain would print it twice.
        Self::Store(error)
    }
}

/// What keys are digested with in the registry when the store has no
/// `id_secret`: the registry still holds no key in the clear.
const KEY_DIGEST_SECRET: &[u8] = b"floodgate key registry digest, v1";

/// Everything a request needs, shared by all connections.
#[derive(Debug)]
pub struct Shared {
    pub(super) rules: ArcSwap<Rules>,
    /// The client → plan table in force, beside the rules (empty when
    /// plans come from no table): a reload puts the one read with its
    /// configuration in force, a change of the table's file alone a new
    /// read of it.
    pub(super) plan_table: ArcSwap<crate::routes::PlanTable>,
    /// TLS for new connections on the proxy listener, if configured; a
    /// reload swaps it, and open connections keep the one they began with.
    tls: arc_swap::ArcSwapOption<rustls::ServerConfig>,
    pub(super) limiter: Arc<Limiter>,
    pub(super) forwarder: Forwarder,
    pub(super) metrics: Metrics,
    /// When a shadow denial was last logged (ms): at most one line a second.
    shadow_logged: AtomicU64,
    /// Which denials were logged and which folded since.
    pub(super) denials: super::denials::DenialLog,
    /// The digest of the rules in force that decide counts in the store
    /// (`Config::rules_digest`), announced to the other instances.
    rules_digest: arc_swap::ArcSwap<String>,
    /// How many rule sets the store named at the last announcement.
    rule_sets: std::sync::atomic::AtomicUsize,
    /// The access log, if on.
    pub(super) access_log: Option<Arc<AccessLog>>,
    /// How client ids are shown.
    ids: Arc<Ids>,
    /// A stop was asked for: `/readyz` says so while the listener drains.
    draining: AtomicBool,
    /// Each route's outcomes over the last 15 minutes, for the dashboard.
    history: History,
    /// How the reloads of each file went.
    pub(super) reloads: std::sync::Mutex<super::reloads::Reloads>,
    /// Usage settlements running in tasks of their own.
    pub(super) settlements: Arc<in_flight::Count>,
    /// Requests held until their limits fit, and their bounds.
    pub(super) holds: super::held::Holds,
    /// The key registry, when `[keys]` is on.
    pub(super) keys: Option<Arc<crate::keys::Keys>>,
}

/// What `/readyz` answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Readiness {
    /// Serving, the store answering.
    Ready,
    /// Serving while the store is down: `on_error` allows or counts locally.
    StoreDown,
    /// Not serving usefully: the store is down and `on_error = "deny"`
    /// refuses every limited request.
    Refusing,
    /// Stopping: the listener closes after `drain_delay`.
    Draining,
    /// The store answers but refuses floodgate's settings (a password
    /// changed on the server, a permission taken away): a configuration
    /// error, unready whatever `on_error` says.
    Refused,
}

impl Readiness {
    /// Whether load balancers should send this instance traffic.
    pub fn ready(self) -> bool {
        matches!(self, Self::Ready | Self::StoreDown)
    }
}

impl Shared {
    /// The state for serving `config`: its metrics, its store behind the
    /// limiter, its access log, its upstreams started.
    pub async fn start(config: &Config) -> Result<Self, StartError> {
        let metrics = Metrics::new();
        metrics.config_loaded(&config.digest);
        let limiter = Limiter::new(
            &config.store,
            config.server.max_client_entries,
            metrics.store(),
        )
        .await?;
        let id_secret = match &config.store {
            crate::limit::settings::Store::Redis(redis) => redis.id_secret.as_ref(),
            crate::limit::settings::Store::Memory => None,
        };
        let ids = Arc::new(Ids::new(config.client_ids, id_secret.map(|s| &s.0[..])));
        let access_log = match &config.access_log {
            Some(settings) => Some(AccessLog::start(
                settings.clone(),
                Arc::clone(&ids),
                metrics.access_log_dropped.clone(),
                metrics.access_log_suppressed.clone(),
            )?),
            None => None,
        };
        let limiter = Arc::new(limiter);
        let keys = match &config.keys {
            Some(settings) => {
                let secret = id_secret.map_or(KEY_DIGEST_SECRET, |s| &s.0[..]);
                let keys = crate::keys::Keys::start(settings.clone(), Arc::clone(&limiter), secret)
                    .await?;
                metrics.show_keys(crate::keys::metrics::Shown(Arc::clone(&keys)));
                // Before the first request, so that the file's keys work
                // from the start; a reconcile the store does not let
                // finish is tried again every second.
                if let Some(file) = &config.keys_file
                    && let Err(e) = keys.reconcile(file).await
                {
                    tracing::warn!(
                        path = %file.path.display(),
                        error = %e,
                        "the keys file could not be reconciled into the registry yet; trying again every second"
                    );
                }
                Some(keys)
            }
            None => None,
        };
        let upstreams = start_upstreams(config).await;
        let holds = super::held::Holds::new(
            config.server.max_held,
            config.server.max_held_per_client,
            &metrics,
        );
        Ok(Self {
            rules: ArcSwap::from_pointee(Rules::new(config, upstreams, &metrics, None)),
            plan_table: ArcSwap::new(plan_table_read(config)),
            tls: arc_swap::ArcSwapOption::new(
                config.server.tls.as_ref().map(|(_, c)| Arc::clone(c)),
            ),
            limiter,
            forwarder: Forwarder::new(metrics.timeouts().clone()),
            metrics,
            shadow_logged: AtomicU64::new(0),
            denials: super::denials::DenialLog::new(config.server.denial_log_interval),
            rules_digest: arc_swap::ArcSwap::from_pointee(config.rules_digest()),
            rule_sets: std::sync::atomic::AtomicUsize::new(1),
            access_log,
            ids,
            draining: AtomicBool::new(false),
            history: History::default(),
            reloads: std::sync::Mutex::default(),
            settlements: Arc::default(),
            holds,
            keys,
        })
    }

    /// The key registry, when `[keys]` is on.
    pub fn keys(&self) -> Option<&Arc<crate::keys::Keys>> {
        self.keys.as_ref()
    }

    /// Requests holding a place among the held now (waiting, or about
    /// to be decided on a route whose limits hold).
    pub fn held(&self) -> usize {
        self.holds.taken()
    }

    /// The usage settlements still running, which a stop waits for.
    pub fn settlements(&self) -> &in_flight::Count {
        &self.settlements
    }

    /// The rules in force.
    pub fn rules(&self) -> arc_swap::Guard<Arc<Rules>> {
        self.rules.load()
    }

    /// TLS for a connection accepted now, if the listener has it.
    pub fn tls(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.tls.load_full()
    }

    /// Evicts expired in-process state and brings the history up to date
    /// (every second).
    pub fn sweep(&self) {
        self.limiter.sweep();
        self.denials.sweep(crate::clock::now_ms());
        self.forwarder.sweep();
        let rules = self.rules();
        self.history
            .record(crate::clock::now_ms(), &history_counts(&rules));
    }

    /// The dashboard's history as JSON (see [`History::json`]).
    pub fn history_json(&self) -> String {
        let rules = self.rules();
        self.history.json(
            crate::clock::now_ms(),
            &history_counts(&rules),
            crate::access_log::json_string,
        )
    }

    /// Each node of the store: address, breaker open, since when (see
    /// [`Limiter::nodes`]).
    pub fn store_nodes(&self) -> Vec<(String, bool, Option<u64>)> {
        self.limiter.nodes()
    }

    /// Tells the instances sharing the store which rules this one counts
    /// by, and notices when they do not all count by the same: each would
    /// enforce its own limits on the same keys. A warning when that starts
    /// (and whenever the number of rule sets changes), a line when it
    /// ends, and `floodgate_store_rule_sets` meanwhile.
    pub async fn announce_rules(&self) {
        let digest = self.rules_digest.load_full();
        let Some(sets) = self.limiter.announce_rules(&digest).await else {
            return;
        };
        self.metrics
            .store_rule_sets
            .set(i64::try_from(sets).unwrap_or(i64::MAX));
        let before = self.rule_sets.swap(sets, Ordering::Relaxed);
        if sets > 1 && sets != before {
            tracing::warn!(
                rule_sets = sets,
                ours = %digest,
                "instances sharing the rate limit store run different limits (rule sets differ); each enforces its own on the same keys until their files agree"
            );
        } else if sets <= 1 && before > 1 {
            tracing::info!(ours = %digest, "instances sharing the rate limit store run the same limits again");
        }
    }

    /// Gives back, for ever, what slices of leased limits leave when they
    /// are up.
    pub async fn keep_leases(&self) {
        self.limiter.keep_leases().await;
    }

    /// Gives back every slice of a leased limit this instance holds (at a
    /// stop).
    pub async fn return_leases(&self) {
        self.limiter.return_leases().await;
    }

    /// Asks a store considered down whether it answers again.
    pub async fn recover(&self) {
        self.limiter.recover().await;
    }

    /// Whether the instance should get traffic, and why not. A store that
    /// is down makes it unready only where `on_error = "deny"` refuses
    /// everything limited: with `allow` or `local` it still serves, and
    /// taking every replica out of service at once (they share the store)
    /// would turn a fail-open policy into an outage.
    pub fn readiness(&self) -> Readiness {
        if self.draining.load(Ordering::Relaxed) {
            Readiness::Draining
        } else if self.limiter.refused().is_some() {
            Readiness::Refused
        } else if self.limiter.ready() {
            Readiness::Ready
        } else if self.limiter.refuses_when_down() {
            Readiness::Refusing
        } else {
            Readiness::StoreDown
        }
    }

    /// The shared store: its kind, whether it answers, its `on_error`.
    pub fn store(&self) -> (&'static str, bool, OnError) {
        (
            self.limiter.kind(),
            self.limiter.ready(),
            self.limiter.on_error(),
        )
    }

    /// Why the store refuses floodgate's settings, while it does.
    pub fn store_refused(&self) -> Option<String> {
        self.limiter.refused()
    }

    /// Whether some but not all of a Redis Cluster's primaries are
    /// considered down (their slots get `on_error`).
    pub fn store_degraded(&self) -> bool {
        self.limiter.degraded()
    }

    /// How client ids are shown to operators.
    pub fn ids(&self) -> &Ids {
        &self.ids
    }

    /// A stop was asked for: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Brings gauges that are read rather than counted up to date.
    pub fn refresh_gauges(&self) {
        self.metrics
            .circuit_open
            .set(i64::from(!self.limiter.ready()));
        self.limiter.refresh_gauges();
    }

    /// The client → plan table in force.
    pub fn plan_table(&self) -> arc_swap::Guard<Arc<crate::routes::PlanTable>> {
        self.plan_table.load()
    }

    /// The metrics, as exposed on `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A client → plan table was replaced: denials remembered under the
    /// plans clients were on may no longer hold.
    pub fn plans_changed(&self) {
        self.limiter.rules_changed();
    }

    /// Applies a newly loaded configuration: its upstreams are started,
    /// then its rules go live; parts that cannot change while running are
    /// reported and keep their old values.
    pub async fn reload(&self, running: &Config, new: Config) {
        if running.store != new.store
            && let Err(refused @ crate::limit::StoreError::Refused(_)) =
                Limiter::check(&new.store).await
        {
            // The new store is not applied until a restart either way, but
            // a restart with it would refuse to start: say so now.
            self.refuse_reload(&format!("{}: [store]: {refused}", new.path.display()));
            return;
        }
        if self.keys.is_none() && new.keys.is_some() {
            // Its routes would verify keys against a registry that is not
            // running: every key would be refused.
            self.refuse_reload(&format!(
                "{}: [keys] was added; the key registry starts with floodgate: restart floodgate to apply it",
                new.path.display()
            ));
            return;
        }
        let upstreams = start_upstreams(&new).await;
        for what in running.differences_needing_restart(&new) {
            tracing::warn!(
                setting = what,
                "{what} changed but cannot be applied while running; restart floodgate to apply it"
            );
        }
        let rules = Rules::new(&new, upstreams, &self.metrics, Some(&self.rules.load()));
        // The table names its plans by name: for a moment between these
        // two, a request looks its plan up among the other rules' plans,
        // and a name they do not have is no plan (never another one).
        self.plan_table.store(plan_table_read(&new));
        self.rules.store(Arc::new(rules));
        self.tls
            .store(new.server.tls.as_ref().map(|(_, c)| Arc::clone(c)));
        self.limiter.rules_changed();
        // Slices of the old rules' leased limits go back: a limit that
        // changed leases anew, one that is gone holds nothing.
        self.limiter.return_leases().await;
        self.rules_digest.store(Arc::new(new.rules_digest()));
        self.metrics.reloaded(true, &new.digest);
        self.reloaded(ReloadedFile::Config, None);
        tracing::info!(
            path = %new.path.display(),
            routes = new.routes.len(),
            digest = %new.digest,
            "configuration reloaded"
        );
        if let Some(file) = &new.keys_file {
            self.reconcile_keys(file).await;
        }
    }

    /// Records a reload that was refused; the old rules stay.
    pub fn reload_refused(&self, error: &crate::config::LoadError) {
        self.refuse_reload(&error.to_string());
    }

    fn refuse_reload(&self, problem: &str) {
        self.metrics.reloaded(false, "");
        self.reloaded(ReloadedFile::Config, Some(problem.to_owned()));
        for line in problem.lines() {
            tracing::error!("{line}");
        }
        tracing::error!("configuration not reloaded; the previous rules stay in force");
    }

    /// Logs a shadow denial, at most once a second at info (the rest at debug).
    pub(super) fn log_shadow(&self, route: &str, client: &ClientId) {
        if crate::clock::once_a_second(&self.shadow_logged, crate::clock::now_ms()) {
            tracing::info!(
                route,
                %client,
                "shadow: would have denied (further ones this second at debug)"
            );
        } else {
            tracing::debug!(route, %client, "shadow: would have denied");
        }
    }
}

/// The client → plan table as read with `config` (empty when its plans
/// come from no table).
fn plan_table_read(config: &Config) -> Arc<crate::routes::PlanTable> {
    config
        .plan_table()
        .map_or_else(Arc::default, |file| file.read)
}

/// Each route's counters as the history takes them, in the rules' order:
/// allowed (exempt clients included), denied, shadow-denied, store errors,
/// refused by a concurrency cap, upstream 5xx.
fn history_counts(rules: &Rules) -> Vec<(&str, history::Counts)> {
    rules
        .routes
        .iter()
        .zip(&rules.live)
        .map(|(route, live)| {
            let (metrics, capacity) = (&live.metrics, &live.capacity);
            let n = metrics.counts();
            let counts = [
                n[Outcome::Allowed as usize] + n[Outcome::Exempt as usize],
                n[Outcome::Denied as usize],
                n[Outcome::ShadowDenied as usize],
                n[Outcome::StoreError as usize],
                capacity.as_ref().map_or(0, |c| c.refused() as u64),
                metrics.upstream_5xx(),
            ];
            (&*route.name, counts)
        })
        .collect()
}
