//! Scale out: floodgate on a real three-primary Redis Cluster, limits exact
//! for every algorithm with clients spread over every slot, through the
//! loss of a primary, and through a slot moving between primaries.

mod support;

use std::time::{Duration, Instant};

use floodgate::limit::Algorithm;
use support::cluster::TestCluster;
use support::config::{Config, Route};
use support::redis::unique_prefix;
use support::{Floodgate, TestClient};

/// floodgate on the cluster at `urls`, without routes.
fn store(urls: &[String], prefix: &str, on_error: &str, timeout: &str) -> Config {
    Config::new()
        .redis_cluster(urls, prefix)
        .store(&format!(r#"timeout = "{timeout}""#))
        .store(&format!(r#"on_error = "{on_error}""#))
}

/// A route on `/{name}` that answers 200 itself and counts clients by
/// `X-Client`, `limit` an hour.
fn route(name: &str, algorithm: &str, limit: u64) -> Route {
    Route::new(name)
        .matching(&format!(r#"path_prefix = "/{name}""#))
        .respond("status = 200")
        .client(r#"from = "header", name = "X-Client""#)
        .limit(algorithm, limit, "1h")
}

fn config(urls: &[String], prefix: &str, on_error: &str, limit: u64) -> String {
    let mut config = store(urls, prefix, on_error, "1s");
    for (algorithm, _) in Algorithm::NAMES {
        config = config.route(route(algorithm, algorithm, limit));
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
    for (algorithm, _) in Algorithm::NAMES {
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
        // Probe clients of their own, spread over the slots as the
        // clients measured next are: every primary must decide again.
        let mut answered = true;
        for i in 0..24 {
            for gate in &gates {
                let probe = http
                    .get(
                        &gate.url("/token_bucket"),
                        &[("x-client", &format!("probe-{i}"))],
                    )
                    .await;
                answered &= probe.status != 503;
            }
        }
        if answered {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "floodgate never resumed after failover"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (algorithm, _) in Algorithm::NAMES {
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

/// One answer seen by the load: when its request was sent (from the
/// load's start), its client, its status, and how long it took.
#[derive(Debug, Clone, Copy)]
struct Seen {
    sent: Duration,
    client: usize,
    status: u16,
    took: Duration,
}

/// A steady load of about 300 requests a second over `clients`, spread over
/// both instances, until `stop`.
struct Load {
    started: Instant,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Seen>>>,
}

impl Load {
    fn start(gates: &[Floodgate], path: &str, clients: &[String]) -> Self {
        let started = Instant::now();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let http = TestClient::http1();
        let urls: Vec<String> = gates.iter().map(|g| g.url(path)).collect();
        // 20 senders, each pausing 60 ms between requests.
        let tasks = (0..20)
            .map(|sender| {
                let (http, urls, stop) = (http.clone(), urls.clone(), stop.clone());
                let clients = clients.to_vec();
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut n = sender;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let client = n % clients.len();
                        let sent = Instant::now();
                        let status = http
                            .get(&urls[n % urls.len()], &[("x-client", &clients[client])])
                            .await
                            .status
                            .as_u16();
                        seen.push(Seen {
                            sent: sent - started,
                            client,
                            status,
                            took: sent.elapsed(),
                        });
                        n += 20;
                        tokio::time::sleep(Duration::from_millis(60)).await;
                    }
                    seen
                })
            })
            .collect();
        Self {
            started,
            stop,
            tasks,
        }
    }

    /// Time since the load started.
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    async fn stop(self) -> Vec<Seen> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.expect("load task"));
        }
        all.sort_by_key(|s| s.sent);
        all
    }
}

/// floodgate on the cluster at `urls` with `on_error = "deny"` and a 500 ms
/// timeout (long enough that a healthy primary's decision delayed by a
/// starved machine stays a decision, short enough that the lost node's
/// breaker opens within the first second): `/load` never limits (every decided answer is a 200, every
/// `on_error` answer a 503), `/exact` admits 3 an hour per client.
fn failover_config(urls: &[String], prefix: &str) -> String {
    store(urls, prefix, "deny", "500ms")
        .admin()
        .route(route("load", "gcra", 1_000_000))
        .route(route("exact", "sliding_log", 3))
        .toml()
}

/// The primary (by port) that holds each client's `/load` keys, found in
/// the nodes themselves.
fn owners(cluster: &TestCluster, prefix: &str, clients: &[String]) -> Vec<u16> {
    let mut owner = vec![0u16; clients.len()];
    for port in cluster.primaries() {
        for key in cluster.keys(port, &format!("{prefix}:{{load:*")) {
            if let Some(i) = clients.iter().position(|c| {
                let mut tag = String::from(":");
                floodgate::limit::redis::write_client(
                    &mut tag,
                    &floodgate::client::ClientId::header(c),
                    &floodgate::limit::redis::IdKey::new(None),
                );
                key.contains(&format!("{tag}}}"))
            }) {
                owner[i] = port;
            }
        }
    }
    assert!(
        owner.iter().all(|&p| p != 0),
        "every client's keys on a primary: {owner:?}"
    );
    owner
}

/// The share of `seen` that was decided (not answered by `on_error`).
fn decided_share(seen: &[&Seen]) -> f64 {
    let decided = seen.iter().filter(|s| s.status != 503).count();
    decided as f64 / seen.len().max(1) as f64
}

/// Checks what clients see around a lost primary: `lost_at` is when it
/// stopped answering, `back_at` when it (or its promoted replica) served
/// again. Clients on the other primaries are decided at least 99.5 % of
/// the time throughout; clients on the lost one get `on_error` within a
/// few of their requests, the later ones at once (the node's breaker is
/// open), and are decided again within 1 s of `back_at`.
fn check_failover(seen: &[Seen], owner: &[u16], victim: u16, lost_at: Duration, back_at: Duration) {
    for s in seen {
        assert!([200, 503].contains(&s.status), "unexpected answer {s:?}");
    }
    let healthy: Vec<&Seen> = seen.iter().filter(|s| owner[s.client] != victim).collect();
    let lost: Vec<&Seen> = seen.iter().filter(|s| owner[s.client] == victim).collect();
    assert!(
        healthy.len() > 500 && lost.len() > 100,
        "load too thin: {} and {}",
        healthy.len(),
        lost.len()
    );
    let share = decided_share(&healthy);
    eprintln!(
        "healthy primaries: {:.2} % of {} decided",
        share * 100.0,
        healthy.len()
    );
    assert!(
        share >= 0.995,
        "healthy primaries' clients decided only {:.2} %",
        share * 100.0
    );

    // The lost node's clients: on_error within a few of their requests.
    let after_fault: Vec<&&Seen> = lost.iter().filter(|s| s.sent >= lost_at).collect();
    let first_refused = after_fault
        .iter()
        .position(|s| s.status == 503)
        .expect("the lost node's clients got on_error");
    assert!(
        first_refused <= 3,
        "on_error only after {first_refused} decisions"
    );
    // Once its breaker is open they are answered at once, not after the
    // timeout each.
    let mut waits: Vec<Duration> = after_fault
        .iter()
        .filter(|s| s.sent >= lost_at + Duration::from_millis(1_500) && s.sent < back_at)
        .map(|s| s.took)
        .collect();
    waits.sort();
    let median = waits[waits.len() / 2];
    eprintln!(
        "lost node, later answers: median {median:?} of {}",
        waits.len()
    );
    assert!(
        median < Duration::from_millis(50),
        "answers for the lost node's slots waited {median:?} (median): its breaker never opened"
    );
    // Decided again within 1 s of the node serving.
    let first_decided = after_fault
        .iter()
        .find(|s| s.sent >= back_at && s.status != 503)
        .expect("the lost node's clients were decided again");
    eprintln!(
        "lost node: decided again {:?} after it served",
        first_decided.sent - back_at
    );
    let late = after_fault
        .iter()
        .filter(|s| s.sent >= back_at + Duration::from_secs(1) && s.status == 503)
        .count();
    assert!(
        first_decided.sent < back_at + Duration::from_secs(1) && late == 0,
        "the lost node's clients got on_error after it served again: first decided at +{:?}, {} refused later",
        first_decided.sent - back_at,
        late
    );
}

/// Limits are exact afterwards: fresh clients on every primary get 3 each.
async fn limits_are_exact(gates: &[Floodgate], tag: &str) {
    let fresh: Vec<String> = (0..24).map(|i| format!("{tag}-{i}")).collect();
    let counts = admitted(gates, "/exact", &fresh, 5).await;
    assert!(
        counts.iter().all(|&n| n == 3),
        "after the fault: {counts:?}"
    );
}

/// A cluster whose primaries keep serving while one is lost, two floodgate
/// instances on it (`failover_config`), 60 clients decided once each, and
/// the primary that holds the first client's keys: the one a test loses.
struct Scene {
    cluster: TestCluster,
    gates: [Floodgate; 2],
    clients: Vec<String>,
    owner: Vec<u16>,
    victim: u16,
    /// The primaries before the fault (a frozen node answers no redis-cli).
    primaries: Vec<u16>,
}

impl Scene {
    async fn start(node_timeout: Duration, tag: &str) -> Self {
        let cluster = TestCluster::start_partial(node_timeout).await;
        let prefix = unique_prefix(tag);
        let toml = failover_config(&cluster.urls(), &prefix);
        let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
        let clients: Vec<String> = (0..60).map(|i| format!("{tag}-{i}")).collect();
        let once = admitted(&gates, "/load", &clients, 1).await;
        assert!(once.iter().all(|&n| n == 1), "{once:?}");
        let owner = owners(&cluster, &prefix, &clients);
        let victim = owner[0];
        let primaries = cluster.primaries();
        Self {
            cluster,
            gates,
            clients,
            owner,
            victim,
            primaries,
        }
    }

    /// The load, started a second before the test's fault.
    async fn load(&self) -> Load {
        let load = Load::start(&self.gates, "/load", &self.clients);
        tokio::time::sleep(Duration::from_secs(1)).await;
        load
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_primary_costs_only_its_own_slots() {
    // Peers wait 15 s before they declare a node failed, so a 5 s freeze
    // is not failed over: the node comes back as it was.
    let scene = Scene::start(Duration::from_secs(15), "frozen").await;
    let (gates, victim) = (&scene.gates, scene.victim);
    let load = scene.load().await;
    let lost_at = load.now();
    scene.cluster.freeze(victim);
    tokio::time::sleep(Duration::from_secs(2)).await;
    // While frozen: that node's breaker is open and the others' closed, the
    // store is degraded, and the instance stays ready (with `deny`, it is
    // unready only when every primary is down).
    let http = TestClient::http1();
    let metrics = http.get(&gates[0].admin_url("/metrics"), &[]).await.text();
    for &port in &scene.primaries {
        let open = u8::from(port == victim);
        assert!(
            metrics.contains(&format!(
                "floodgate_redis_node_circuit_open{{node=\"127.0.0.1:{port}\"}} {open}"
            )),
            "{metrics}"
        );
    }
    assert!(
        metrics.contains("floodgate_store_circuit_open 0"),
        "{metrics}"
    );
    let status = http
        .get(&gates[0].admin_url("/status.json"), &[])
        .await
        .json();
    assert_eq!(status["store"]["degraded"], true, "{status}");
    assert_eq!(status["readiness"], "ready", "{status}");
    assert_eq!(
        http.get(&gates[0].admin_url("/readyz"), &[]).await.status,
        200
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    scene.cluster.thaw(victim);
    let back_at = load.now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = load.stop().await;

    check_failover(&seen, &scene.owner, victim, lost_at, back_at);
    limits_are_exact(gates, "frozen-after").await;
    let status = http
        .get(&gates[0].admin_url("/status.json"), &[])
        .await
        .json();
    assert_eq!(status["store"]["degraded"], false, "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_primary_costs_only_its_own_slots_until_its_replica_serves() {
    // Peers declare a node failed after 1 s, so its replica takes over soon.
    let mut scene = Scene::start(Duration::from_secs(1), "killed").await;
    let victim = scene.victim;
    let load = scene.load().await;
    let lost_at = load.now();
    scene.cluster.kill(victim);
    // The replica serves once it calls itself a primary.
    let deadline = Instant::now() + Duration::from_secs(30);
    let back_at = loop {
        let now = scene.cluster.primaries();
        if now.len() == 3 && now.iter().any(|p| !scene.primaries.contains(p)) {
            break load.now();
        }
        assert!(Instant::now() < deadline, "no replica was promoted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let seen = load.stop().await;

    check_failover(&seen, &scene.owner, victim, lost_at, back_at);
    scene.cluster.wait_until_healthy().await;
    limits_are_exact(&scene.gates, "killed-after").await;
}
