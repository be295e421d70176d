//! Scale out: floodgate on a real three-primary Redis Cluster, limits exact
//! for every algorithm with clients spread over every slot, and through the
//! loss of a primary.

mod support;

use std::time::{Duration, Instant};

use support::cluster::TestCluster;
use support::redis::unique_prefix;
use support::{Floodgate, TestClient};

const ALGORITHMS: [&str; 5] = [
    "fixed_window",
    "sliding_log",
    "sliding_window",
    "token_bucket",
    "gcra",
];

fn config(urls: &[String], prefix: &str, on_error: &str, limit: u64) -> String {
    let urls = urls
        .iter()
        .map(|u| format!("\"{u}\""))
        .collect::<Vec<_>>()
        .join(", ");
    let mut toml = format!(
        r#"
[server]
listen = "127.0.0.1:0"

[store]
backend = "redis_cluster"
urls = [{urls}]
key_prefix = "{prefix}"
timeout = "300ms"
on_error = "{on_error}"
"#
    );
    for algorithm in ALGORITHMS {
        toml.push_str(&format!(
            r#"
[[routes]]
name = "{algorithm}"
match = {{ path_prefix = "/{algorithm}" }}
respond = {{ status = 200 }}
client = {{ from = "header", name = "X-Client" }}
limits = [{{ algorithm = "{algorithm}", limit = {limit}, window = "1h" }}]
"#
        ));
    }
    toml
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
    let mut cluster = TestCluster::start().await;
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
