//! The tasks that run beside the listeners while floodgate serves: the
//! in-process sweep, the store's recovery (with the rules announced to the
//! other instances), the leases kept, the configuration watched for
//! reloads, and the admin listener. Started together before the first
//! connection is accepted; stopped in order once the connections are done:
//! the lease keeper first, so that the slices this instance holds go back
//! to the store within the grace, then the rest.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::gate::Shared;
use crate::reload::Baseline;

/// The background tasks, each by what it does.
pub(super) struct Background {
    /// Evicts expired in-process state.
    sweeper: JoinHandle<()>,
    /// Checks a store that is down; announces the rules counted by.
    recoverer: JoinHandle<()>,
    /// Keeps the slices of leased limits this instance holds.
    lease_keeper: JoinHandle<()>,
    /// Reloads the rules on SIGHUP and when the file changes.
    watcher: JoinHandle<()>,
    /// The admin listener, when one is configured.
    admin: Option<JoinHandle<()>>,
    /// Follows the key registry's changes in the store.
    key_follower: Option<JoinHandle<()>>,
}

impl Background {
    /// Starts every task for `shared`, serving `config`: reloads when
    /// `reload` is notified (from `baseline`), and the admin listener on
    /// `admin`.
    pub(super) fn start(
        shared: &Arc<Shared>,
        config: &Config,
        reload: Arc<Notify>,
        baseline: Baseline,
        admin: Option<TcpListener>,
    ) -> Self {
        let sweeper = tokio::spawn(sweep(Arc::clone(shared)));
        let key_follower = shared
            .keys()
            .map(|keys| tokio::spawn(Arc::clone(keys).follow()));
        let recoverer = tokio::spawn(recover(Arc::clone(shared)));
        let lease_keeper = {
            let shared = Arc::clone(shared);
            tokio::spawn(async move { shared.keep_leases().await })
        };
        let watcher = tokio::spawn(crate::reload::watch(
            Arc::clone(shared),
            config.clone(),
            reload,
            baseline,
        ));
        let admin = admin.map(|listener| {
            tokio::spawn(crate::admin::serve(
                listener,
                Arc::clone(shared),
                config.server.header_read_timeout,
                config.server.admin_token_file.clone(),
            ))
        });
        Self {
            sweeper,
            recoverer,
            lease_keeper,
            watcher,
            admin,
            key_follower,
        }
    }

    /// Stops the tasks in order: the lease keeper, then the slices of
    /// leased limits this instance holds given back to the store for the
    /// other instances to spend (by `grace_over`, or within a second),
    /// then the rest.
    pub(super) async fn stop(self, shared: &Shared, grace_over: tokio::time::Instant) {
        self.lease_keeper.abort();
        if tokio::time::timeout_at(
            grace_over.max(tokio::time::Instant::now() + Duration::from_secs(1)),
            shared.return_leases(),
        )
        .await
        .is_err()
        {
            tracing::warn!(
                "grace period over; slices of leased limits not given back stay counted until their windows end"
            );
        }
        self.sweeper.abort();
        self.recoverer.abort();
        self.watcher.abort();
        if let Some(admin) = self.admin {
            admin.abort();
        }
        if let Some(follower) = self.key_follower {
            follower.abort();
        }
    }
}

/// Evicts expired in-process state every second.
async fn sweep(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        shared.sweep();
    }
}

/// Checks a store that is considered down twice a second, so that it is
/// used again as soon as it answers, with or without requests; and every
/// 10 s (first at start) tells the other instances sharing it which rules
/// this one counts by.
async fn recover(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for n in 0u64.. {
        tick.tick().await;
        shared.recover().await;
        if n % 20 == 0 {
            shared.announce_rules().await;
        }
    }
}
