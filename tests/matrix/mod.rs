//! The store matrix: the stores a scenario runs on, the bed each store
//! gives it (a store configuration under a prefix of the scenario's own,
//! and its instances), and the table of scenarios.

mod answers;
mod calendar;
mod front;
mod keys;
mod keys_file;
mod operators;
mod penalties;
mod registry;
mod usage;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::support::cluster::TestCluster;
use crate::support::config::Config;
use crate::support::redis::{TestRedis, unique_prefix};
use crate::support::{Answer, Floodgate, TestClient};

/// A store the scenarios run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Store {
    Memory,
    Redis,
    Cluster,
}

/// A store started for the table, and what each scenario builds on it.
pub struct Bed {
    pub store: Store,
    redis: Option<TestRedis>,
    cluster: Option<TestCluster>,
}

impl Bed {
    pub async fn start(store: Store) -> Self {
        let (redis, cluster) = match store {
            Store::Memory => (None, None),
            Store::Redis => (Some(TestRedis::start().await), None),
            Store::Cluster => (None, Some(TestCluster::start().await)),
        };
        Self {
            store,
            redis,
            cluster,
        }
    }

    /// A configuration on this store, its keys under a prefix of
    /// `scenario`'s own.
    pub fn config(&self, scenario: &str) -> Config {
        let prefix = unique_prefix(scenario);
        match (&self.redis, &self.cluster) {
            (Some(redis), _) => Config::new().redis(&redis.url, &prefix),
            (_, Some(cluster)) => Config::new().redis_cluster(&cluster.urls(), &prefix),
            _ => Config::new(),
        }
    }

    /// Instances serving `toml`: two sharing the store, or one on the
    /// memory store (whose counts are its own), asked in turn.
    pub async fn instances(&self, toml: &str) -> Gates {
        let n = if self.store == Store::Memory { 1 } else { 2 };
        let mut gates = Vec::new();
        for _ in 0..n {
            gates.push(Floodgate::start(toml).await);
        }
        Gates(gates)
    }
}

/// A scenario's instances; instance `i` is the `i % n`-th of them.
pub struct Gates(Vec<Floodgate>);

impl Gates {
    pub fn get(&self, i: usize) -> &Floodgate {
        &self.0[i % self.0.len()]
    }

    /// How many instances there are.
    pub fn count(&self) -> usize {
        self.0.len()
    }

    pub fn url(&self, i: usize, path: &str) -> String {
        self.get(i).url(path)
    }

    pub fn admin_url(&self, i: usize, path: &str) -> String {
        self.get(i).admin_url(path)
    }
}

type Scenario = fn(Arc<Bed>) -> Pin<Box<dyn Future<Output = ()> + Send>>;

/// A table of scenarios: a name and the async function it runs.
macro_rules! scenarios {
    ($($name:literal => $scenario:path,)*) => {
        &[$(($name, |bed| Box::pin(async move { $scenario(&bed).await })),)*]
    };
}

/// Every scenario, by name: each runs on every store.
pub const SCENARIOS: &[(&str, Scenario)] = scenarios! {
    "key per limit: a refused request takes nothing" => keys::a_refused_request_takes_nothing_from_the_other_limits,
    "key per limit: a refused request reports both kinds" => keys::a_refused_request_reports_both_kinds_as_they_stand,
    "budgets: routes draw on one with their own costs" => keys::routes_draw_on_one_budget_with_their_own_costs,
    "plans: a plan gives a budget its number" => keys::a_plan_gives_a_budget_its_number_and_the_count_carries_over,
    "usage: reported units are settled" => usage::reported_units_are_settled_across_instances,
    "leases: a leased global limit is exact" => usage::a_leased_global_limit_admits_exactly_its_limit,
    "calendar: a day quota counts to midnight" => calendar::a_day_quota_counts_to_midnight_on_every_instance,
    "calendar: a minute quota turns at its boundary" => calendar::a_minute_quota_resets_at_its_boundary,
    "export: closed windows hold the settled units" => calendar::the_export_of_closed_windows_equals_the_settled_units,
    "readout: a client reads its standing" => operators::a_client_reads_its_standing_for_nothing,
    "operators: credit, debit and reset" => operators::credit_debit_and_reset_change_the_next_decision_everywhere,
    "front proxies: decisions and settlements" => front::a_front_proxys_reservation_is_settled_by_name,
    "Envoy: descriptors all or nothing" => front::envoys_descriptors_are_decided_all_or_nothing,
    "count_when: only the answers named count" => answers::only_the_answers_named_are_counted,
    "count_when: floodgate's own 502 and 504 count as the limits say" => answers::floodgates_own_502_and_504_count_as_the_limits_say,
    "penalty: outlasts the window, doubles, lifted" => penalties::a_penalty_outlasts_the_window_and_doubles_for_a_repeat_offender,
    "key registry: verified before anything counts" => registry::keys_are_verified_before_anything_is_counted,
    "key registry: the keys file is reconciled everywhere" => keys_file::the_keys_file_is_reconciled_on_every_instance,
    "key registry: a large keys file is reconciled whole" => keys_file::a_large_keys_file_is_reconciled_whole,
};

/// Runs every scenario on `bed` (or those `FLOODGATE_SCENARIO` names), all at once (each under keys of its own,
/// so two calendar scenarios wait for one minute's end together), each to
/// its end whatever the others did, and fails naming those that failed.
pub async fn run_all(bed: Bed) {
    let bed = Arc::new(bed);
    // `FLOODGATE_SCENARIO=text` runs only the scenarios whose name has it.
    let only = std::env::var("FLOODGATE_SCENARIO").unwrap_or_default();
    let running: Vec<_> = SCENARIOS
        .iter()
        .filter(|(name, _)| name.contains(&only))
        .map(|(name, scenario)| (*name, tokio::spawn(scenario(Arc::clone(&bed)))))
        .collect();
    let mut failed = Vec::new();
    for (name, task) in running {
        let outcome = task.await;
        let verdict = if outcome.is_ok() { "ok" } else { "FAILED" };
        println!("{:?} store: {name}: {verdict}", bed.store);
        if outcome.is_err() {
            failed.push(name);
        }
    }
    assert!(
        failed.is_empty(),
        "on the {:?} store: {failed:?} failed",
        bed.store
    );
}

/// POSTs `body` (JSON) to `url` with `headers`.
pub async fn post(url: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut request = http::Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(crate::support::text_body(body))
        .expect("a request");
    TestClient::http1().send(request).await
}

/// `r` and `t` of a `RateLimit` field, with its policy's name.
pub fn fields(answer: &Answer) -> (String, u64, u64) {
    let field = answer.header("ratelimit").unwrap_or_default();
    let part = |name: &str| {
        field
            .split(';')
            .find_map(|p| p.strip_prefix(name)?.parse().ok())
            .unwrap_or(u64::MAX)
    };
    let policy = field
        .split(';')
        .next()
        .unwrap_or_default()
        .trim_matches('"');
    (policy.to_owned(), part("r="), part("t="))
}

/// An upstream that reports the units its query asks for (`?units=N`,
/// else 1) in `x-units`: its URL.
pub async fn reporting_upstream() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let units = req
                            .uri()
                            .query()
                            .and_then(|q| q.split('&').find_map(|p| p.strip_prefix("units=")))
                            .unwrap_or("1")
                            .to_owned();
                        http::Response::builder()
                            .header("x-units", units)
                            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"ok")))
                    },
                );
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}
