//! Scale out: floodgate on a real three-primary Redis Cluster, limits exact
//! for every algorithm with clients spread over every slot, through the
//! loss of a primary, and through a slot moving between primaries.

mod support;

use std::time::{Duration, Instant};

use support::cluster::TestCluster;
use support::config::{Config, Route};
use support::redis::unique_prefix;
use support::{Floodgate, TestClient};

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "gcra",
];

/// floodgate on the cluster at `urls`, without routes.
fn store(urls: &[String], prefix: &str, on_error: &str, timeout: &str) -> Config {
    Config::new()
        .redis_cluster(urls, prefix)
        .store(&format!(r#"timeout = "{timeout}""#))
        .store(&format!(r#"on_error = "{on_error}""#))
}

fn config(urls: &[String], prefix: &str, on_error: &str, limit: u64) -> String {
    let mut config = store(urls, prefix, on_error, "300ms");
    for algorithm in ALGORITHMS {
        config = config.route(
            Route::new(algorithm)
                .matching(&format!(r#"path_prefix = "/{algorithm}""#))
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Client""#)
                .limit(algorithm, limit, "1h"),
        );
    }
    config.toml()
}

/// Sends `per_client` requests for each client, alternating between the
/// instances, and returns how many each client got admitted.
async fn admitted(
    gates: &[Floodgate],
    path: &str,
    clients: &[String],
    per_client: usize,
) -> Vec<usize> {
    let http = TestClient::http1();
    let tasks: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(i, client)| {
            let urls: Vec<String> = gates.iter().map(|g| g.url(path)).collect();
            let http = http.clone();
            let client = client.clone();
            tokio::spawn(async move {
                let mut ok = 0;
                for n in 0..per_client {
                    let a = http
                        .get(&urls[(i + n) % urls.len()], &[("x-client", &client)])
                        .await;
                    match a.status.as_u16() {
                        200 => ok += 1,
                        429 => {}
                        other => panic!("{client}: unexpected status {other}"),
                    }
                }
                ok
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("client task"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_algorithm_limits_exactly_with_clients_on_every_primary() {
    let cluster = TestCluster::start().await;
    let prefix = unique_prefix("cluster");
    let toml = config(&cluster.urls(), &prefix, "deny", 3);
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    // 48 clients: their hash tags spread over all three primaries' slots.
    let clients: Vec<String> = (0..48).map(|i| format!("client-{i}")).collect();
    for algorithm in ALGORITHMS {
        let counts = admitted(&gates, &format!("/{algorithm}"), &clients, 5).await;
        assert!(counts.iter().all(|&n| n == 3), "{algorithm}: {counts:?}");
    }
    let primaries = cluster.primaries();
    assert_eq!(primaries.len(), 3);
    for port in primaries {
        assert!(cluster.keys_on(port) > 0, "no keys on primary {port}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_is_replaced_and_limits_are_exact_again() {
    // Peers declare a node failed after 1 s, so the replica takes over soon.
    let mut cluster = TestCluster::start_with(Duration::from_secs(1)).await;
    let prefix = unique_prefix("failover");
    let toml = config(&cluster.urls(), &prefix, "deny", 3);
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let before: Vec<String> = (0..24).map(|i| format!("before-{i}")).collect();
    assert!(
        admitted(&gates, "/gcra", &before, 4)
            .await
            .iter()
            .all(|&n| n == 3)
    );

    let victim = cluster.primaries()[0];
    cluster.kill(victim);
    // During the gap every request is answered: decided, or 503 per on_error.
    let http = TestClient::http1();
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut gap = Vec::new();
    loop {
        for (i, gate) in gates.iter().enumerate() {
            let client = format!("gap-{}", gap.len() % 24);
            let status = http
                .get(&gate.url("/fixed_window"), &[("x-client", &client)])
                .await
                .status
                .as_u16();
            assert!([200, 429, 503].contains(&status), "instance {i}: {status}");
            gap.push(status);
        }
        if cluster.primaries().len() == 3 {
            break;
        }
        assert!(Instant::now() < deadline, "no replica was promoted");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    cluster.wait_until_healthy().await;
    // Once the promoted replica serves, floodgate limits exactly again, by
    // itself, on fresh clients spread over every slot.
    let after: Vec<String> = (0..24).map(|i| format!("after-{i}")).collect();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let probe = http
            .get(&gates[0].url("/token_bucket"), &[("x-client", "probe")])
            .await;
        let probe2 = http
            .get(&gates[1].url("/token_bucket"), &[("x-client", "probe")])
            .await;
        if probe.status != 503 && probe2.status != 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "floodgate never resumed after failover"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for algorithm in ALGORITHMS {
        let counts = admitted(&gates, &format!("/{algorithm}"), &after, 5).await;
        assert!(
            counts.iter().all(|&n| n == 3),
            "{algorithm} after failover: {counts:?}"
        );
    }
}

/// `errorstat_TRYAGAIN` of the node at `port`: how many times it answered
/// `TRYAGAIN`.
fn tryagain_answers(cluster: &TestCluster, port: u16) -> u64 {
    cluster
        .cli(port, &["INFO", "errorstats"])
        .lines()
        .find_map(|line| line.strip_prefix("errorstat_TRYAGAIN:count="))
        .map_or(0, |n| n.trim().parse().expect("a TRYAGAIN count"))
}

/// A slot moving between primaries, as `redis-cli --cluster reshard` moves
/// them, while a decision for it is asked. Halfway, with one of the
/// decision's two keys on each node, Redis answers `TRYAGAIN`. floodgate
/// asks again soon enough to decide within its timeout once the slot has
/// moved, and the counts move with the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decision_caught_by_a_moving_slot_is_decided_once_the_slot_has_moved() {
    let cluster = TestCluster::start().await;
    let prefix = unique_prefix("reshard");
    let toml = store(&cluster.urls(), &prefix, "deny", "1s")
        .route(
            Route::new("two_limits")
                .matching(r#"path_prefix = "/""#)
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Client""#)
                .limit("fixed_window", 3, "1h")
                .limit("gcra", 3, "1h"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let url = gate.url("/");
    let ask = || {
        let (http, url) = (http.clone(), url.clone());
        async move { http.get(&url, &[("x-client", "mover")]).await.status }
    };
    assert_eq!(ask().await, 200);

    let pattern = format!("{prefix}:*");
    let (source, keys) = cluster
        .primaries()
        .into_iter()
        .map(|port| (port, cluster.keys(port, &pattern)))
        .find(|(_, keys)| !keys.is_empty())
        .expect("the client's keys on one primary");
    assert_eq!(keys.len(), 2, "one key per limit: {keys:?}");
    let target = cluster
        .primaries()
        .into_iter()
        .find(|&port| port != source)
        .expect("a second primary");
    let slot = cluster.cli(source, &["CLUSTER", "KEYSLOT", &keys[0]]);
    let slot = slot.trim();
    let (source_id, target_id) = (cluster.node_id(source), cluster.node_id(target));
    let ok = |port: u16, args: &[&str]| {
        let out = cluster.cli(port, args);
        assert_eq!(out.trim(), "OK", "{args:?} on {port}");
    };
    let target_port = target.to_string();
    let migrate = |key: &str| {
        ok(
            source,
            &["MIGRATE", "127.0.0.1", &target_port, key, "0", "5000"],
        )
    };
    ok(
        target,
        &["CLUSTER", "SETSLOT", slot, "IMPORTING", &source_id],
    );
    ok(
        source,
        &["CLUSTER", "SETSLOT", slot, "MIGRATING", &target_id],
    );
    migrate(&keys[0]);

    // Halfway: the decision is refused with TRYAGAIN until the slot moves.
    let refused = tryagain_answers(&cluster, source);
    let caught = tokio::spawn(ask());
    let deadline = Instant::now() + Duration::from_secs(5);
    while tryagain_answers(&cluster, source) == refused {
        assert!(
            Instant::now() < deadline,
            "the decision never reached the moving slot"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    migrate(&keys[1]);
    for port in [target, source] {
        ok(port, &["CLUSTER", "SETSLOT", slot, "NODE", &target_id]);
    }
    assert_eq!(
        caught.await.expect("the caught request"),
        200,
        "the decision caught by the move was not decided within the timeout"
    );

    // The counts moved with the keys: one more admitted, then denied.
    assert_eq!(ask().await, 200);
    assert_eq!(ask().await, 429);
    assert_eq!(cluster.keys(target, &pattern).len(), 2);
    assert!(cluster.keys(source, &pattern).is_empty());
}
