//! One table of the promises that touch the store, each scenario run on
//! the memory store, one Redis and a three-primary Cluster: a refused
//! request takes nothing, budgets and plans count once, usage is settled
//! exactly, calendar windows turn at their boundaries and are exported,
//! leases stay exact, clients read their standing, operators' credits,
//! debits and resets end remembered denials, and front proxies' and
//! Envoy's questions are decided as the proxy's own requests are.
//!
//! A scenario is written once, in [`matrix::SCENARIOS`], and runs on all
//! three stores: each store's test runs the whole table (the Cluster and
//! the Redis started once) and names every scenario that failed.
//! Scenarios that use two instances get one on the memory store, whose
//! counts are the process's own.

mod matrix;
mod support;

use matrix::{Bed, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_holds_on_the_memory_store() {
    matrix::run_all(Bed::start(Store::Memory).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_holds_on_one_redis() {
    matrix::run_all(Bed::start(Store::Redis).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_scenario_holds_on_a_cluster() {
    matrix::run_all(Bed::start(Store::Cluster).await).await;
}
