//! Limits as API products are sold, against a real floodgate and a real
//! Redis (one, and a three-primary Cluster): a key per limit (a user's
//! limit inside an organisation's inside a global one; a per-key limit
//! beside a per-address one), all of a request's limits decided all or
//! nothing; plans defined once and chosen by a verified claim, a trusted
//! header or a client → plan table replaced under load; a limit's number
//! carried by a claim, clamped to its ceiling; and budgets several routes
//! draw from.

mod support;

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use support::cluster::TestCluster;
use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::tokens::hs256 as token;
use support::{Answer, Floodgate, TestClient, temp_dir};
use tokio::task::JoinHandle;

/// A route on `/users` counting users by `X-User` (`user` an hour), their
/// organisation by `X-Org` (`org` an hour) and everyone together
/// (`global` an hour), each a sliding log, so counts are exact at any
/// moment and read from Redis as the number of logged units.
fn nested(user: u64, org: u64, global: u64) -> Route {
    Route::new("users")
        .matching(r#"path_prefix = "/users""#)
        .client(r#"from = "header", name = "X-User", missing = "reject""#)
        .limits(&format!(
            r#"{{ algorithm = "sliding_log", limit = {user}, window = "1h" }}"#
        ))
        .limits(&format!(
            r#"{{ algorithm = "sliding_log", limit = {org}, window = "1h", key = {{ from = "header", name = "X-Org", missing = "reject" }} }}"#
        ))
        .limits(&format!(
            r#"{{ algorithm = "sliding_log", limit = {global}, window = "1h", key = {{ from = "global" }} }}"#
        ))
}

async fn ask(http: &TestClient, url: &str, user: &str, org: &str) -> u16 {
    http.get(url, &[("x-user", user), ("x-org", org)])
        .await
        .status
        .as_u16()
}

#[tokio::test]
async fn a_request_refused_by_the_user_limit_leaves_the_org_and_global_counts_unchanged() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("nested");
    let gate = Floodgate::start(
        &Config::new()
            .redis(&redis.url, &prefix)
            .route(nested(10, 30, 100))
            .toml(),
    )
    .await;
    let http = TestClient::http1();
    let url = gate.url("/users/x");
    for i in 0..10 {
        assert_eq!(ask(&http, &url, "ann", "acme").await, 200, "request {i}");
    }
    let refused = http
        .get(&url, &[("x-user", "ann"), ("x-org", "acme")])
        .await;
    assert_eq!(refused.status.as_u16(), 429);
    assert_eq!(
        refused.header("ratelimit"),
        Some("\"users.1\";r=0;t=3600"),
        "the user limit refused it"
    );
    // The refused request took nothing from the organisation or the whole
    // API: ten units each, as many as the user's.
    let user = format!("{prefix}:{{users:*}}:0:sliding_log:*");
    let org = format!("{prefix}:{{users:*}}:1:sliding_log:*");
    let global = format!("{prefix}:{{users:g}}:2:sliding_log:*");
    assert_eq!(redis.logged_each(&user).await, [10]);
    assert_eq!(redis.logged_each(&org).await, [10]);
    assert_eq!(redis.logged_each(&global).await, [10]);
    // Another user of the organisation counts in its count and the global.
    assert_eq!(ask(&http, &url, "bob", "acme").await, 200);
    assert_eq!(redis.logged_each(&user).await, [1, 10]);
    assert_eq!(redis.logged_each(&org).await, [11]);
    assert_eq!(redis.logged_each(&global).await, [11]);
    // No key holds a client's value: users and organisations are digests.
    for key in redis.keys(&format!("{prefix}:*")).await {
        assert!(
            !key.contains("ann") && !key.contains("acme"),
            "{key} names a client"
        );
    }
}

/// 20 users of 2 organisations, 10 requests each, all at once, spread over
/// `gates`: how many were admitted.
async fn flood(gates: &[Floodgate]) -> usize {
    let http = TestClient::http1();
    let mut tasks = Vec::new();
    for user in 0..20 {
        for n in 0..10 {
            let url = gates[(user + n) % gates.len()].url("/users/x");
            let http = http.clone();
            tasks.push(tokio::spawn(async move {
                let org = if user % 2 == 0 { "even" } else { "odd" };
                match ask(&http, &url, &format!("user-{user}"), org).await {
                    200 => 1,
                    429 => 0,
                    other => panic!("unexpected status {other}"),
                }
            }));
        }
    }
    let mut admitted = 0;
    for task in tasks {
        admitted += task.await.expect("request task");
    }
    admitted
}

/// User 5, organisation 30, global 50: whatever the order, an exact
/// all-or-nothing decision admits exactly 50 (each organisation's users
/// could take 50, each organisation 30, so only the global limit binds);
/// counting a refused request in any other limit admits fewer.
const MODEL_ADMITS: usize = 50;

#[tokio::test]
async fn parallel_users_of_two_orgs_through_two_instances_admit_what_an_exact_model_admits() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("nested-flood");
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .store(r#"timeout = "2s""#)
        .route(nested(5, 30, 50))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let admitted = flood(&gates).await;
    assert_eq!(admitted, MODEL_ADMITS);
    let users = redis
        .logged_each(&format!("{prefix}:{{users:*}}:0:sliding_log:*"))
        .await;
    let orgs = redis
        .logged_each(&format!("{prefix}:{{users:*}}:1:sliding_log:*"))
        .await;
    let global = redis
        .logged_each(&format!("{prefix}:{{users:g}}:2:sliding_log:*"))
        .await;
    assert!(users.iter().all(|&n| n <= 5), "users {users:?}");
    assert!(orgs.iter().all(|&n| n <= 30), "orgs {orgs:?}");
    assert_eq!(users.iter().sum::<u64>(), 50);
    assert_eq!(orgs.iter().sum::<u64>(), 50);
    assert_eq!(global, [50]);
}

#[tokio::test]
async fn in_memory_parallel_users_of_two_orgs_admit_what_an_exact_model_admits() {
    let gate = Floodgate::start(&Config::new().route(nested(5, 30, 50)).toml()).await;
    assert_eq!(flood(std::slice::from_ref(&gate)).await, MODEL_ADMITS);
    // Every limit full where the model says: the global refuses anyone.
    let http = TestClient::http1();
    assert_eq!(
        ask(&http, &gate.url("/users/x"), "new", "new-org").await,
        429
    );
}

#[tokio::test]
async fn a_denial_of_one_user_is_not_remembered_for_another_behind_the_same_address() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("nat");
    let gate = Floodgate::start(
        &Config::new()
            .redis(&redis.url, &prefix)
            .route(
                Route::new("nat")
                    .limits(
                        r#"{ algorithm = "sliding_log", limit = 2, window = "1h", key = { from = "header", name = "X-User", missing = "reject" } }"#,
                    )
                    .limit("sliding_log", 100, "1h"),
            )
            .toml(),
    )
    .await;
    let http = TestClient::http1();
    let url = gate.url("/");
    let status = |user: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move { http.get(&url, &[("x-user", user)]).await.status.as_u16() }
    };
    assert_eq!((status("ann").await, status("ann").await), (200, 200));
    // Refused, and refused again from this instance's memory of it.
    assert_eq!((status("ann").await, status("ann").await), (429, 429));
    // The route's client (the address) is the same; the user is not.
    assert_eq!(status("bob").await, 200);
}

/// The units logged in every key matching `pattern` on the cluster's
/// primaries.
fn cluster_counts(cluster: &TestCluster, pattern: &str) -> Vec<u64> {
    let mut out = Vec::new();
    for port in cluster.primaries() {
        for key in cluster.keys(port, pattern) {
            let n = cluster.cli(port, &["ZCARD", &key]);
            out.push(
                n.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("ZCARD {key}: {n}")),
            );
        }
    }
    out.sort_unstable();
    out
}

/// `floodgate_store_given_back_total` of one instance.
async fn given_back(gate: &Floodgate) -> u64 {
    let text = reqwest_text(&gate.admin_url("/metrics")).await;
    text.lines()
        .find_map(|l| l.strip_prefix("floodgate_store_given_back_total "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no floodgate_store_given_back_total in:\n{text}"))
}

async fn reqwest_text(url: &str) -> String {
    TestClient::http1().get(url, &[]).await.text()
}

#[tokio::test]
async fn on_a_cluster_keys_in_other_slots_are_given_back_and_no_limit_is_exceeded() {
    let cluster = TestCluster::start().await;
    let prefix = unique_prefix("nested-cluster");
    let toml = Config::new()
        .admin()
        .redis_cluster(&cluster.urls(), &prefix)
        .store(r#"timeout = "2s""#)
        .route(nested(5, 30, 50))
        .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let admitted = flood(&gates).await;
    let back = given_back(&gates[0]).await + given_back(&gates[1]).await;
    let false_refusals = MODEL_ADMITS - admitted.min(MODEL_ADMITS);
    println!(
        "cluster: {admitted} admitted of the model's {MODEL_ADMITS}; {false_refusals} false refusals; {back} units given back"
    );
    assert!(admitted <= MODEL_ADMITS, "{admitted} admitted");
    // A unit left unused at the end is one a refused request held and
    // gave back: never more false refusals than parts given back.
    assert!(
        admitted as u64 + back >= MODEL_ADMITS as u64,
        "{admitted} admitted with only {back} given back"
    );
    // Every count holds exactly what was admitted: whatever was taken for
    // a refused request was given back.
    let users = cluster_counts(&cluster, &format!("{prefix}:{{users:*}}:0:sliding_log:*"));
    let orgs = cluster_counts(&cluster, &format!("{prefix}:{{users:*}}:1:sliding_log:*"));
    let global = cluster_counts(&cluster, &format!("{prefix}:{{users:g}}:2:sliding_log:*"));
    assert!(users.iter().all(|&n| n <= 5), "users {users:?}");
    assert!(orgs.iter().all(|&n| n <= 30), "orgs {orgs:?}");
    assert_eq!(users.iter().sum::<u64>(), admitted as u64);
    assert_eq!(orgs.iter().sum::<u64>(), admitted as u64);
    assert_eq!(global, [admitted as u64]);
    // One request at a time, new users of new organisations take what a
    // false refusal left of the global limit, then are refused by it;
    // whatever was taken for the refused one in other slots is given back.
    let http = TestClient::http1();
    let url = gates[0].url("/users/x");
    let mut extra = 0;
    loop {
        match ask(
            &http,
            &url,
            &format!("late-{extra}"),
            &format!("org-{extra}"),
        )
        .await
        {
            200 => extra += 1,
            429 => break,
            other => panic!("unexpected status {other}"),
        }
        assert!(extra <= MODEL_ADMITS, "the global limit never refused");
    }
    assert_eq!(admitted + extra, MODEL_ADMITS);
    let users_now = cluster_counts(&cluster, &format!("{prefix}:{{users:*}}:0:sliding_log:*"));
    let orgs_now = cluster_counts(&cluster, &format!("{prefix}:{{users:*}}:1:sliding_log:*"));
    let global_now = cluster_counts(&cluster, &format!("{prefix}:{{users:g}}:2:sliding_log:*"));
    assert_eq!(users_now.iter().sum::<u64>(), MODEL_ADMITS as u64);
    assert_eq!(orgs_now.iter().sum::<u64>(), MODEL_ADMITS as u64);
    assert_eq!(global_now, [MODEL_ADMITS as u64]);
}

// === a refused request's parts, whatever each limit counts ===

/// Route `sl{n}` on `/sl{n}/`, costing 2 units: 200 an hour for everyone,
/// 14 an hour per `X-Org`, and 3 requests an hour per `X-User` (a limit
/// counting requests: each takes one, whatever the cost). Each a sliding
/// log.
fn costly_with_a_requests_limit(n: usize) -> Route {
    Route::new(&format!("sl{n}"))
        .matching(&format!(r#"path_prefix = "/sl{n}/""#))
        .client(r#"from = "header", name = "X-User", missing = "reject""#)
        .line("cost = 2")
        .limits(r#"{ algorithm = "sliding_log", limit = 200, window = "1h", key = { from = "global" } }"#)
        .limits(r#"{ algorithm = "sliding_log", limit = 14, window = "1h", key = { from = "header", name = "X-Org", missing = "reject" } }"#)
        .limits(r#"{ algorithm = "sliding_log", limit = 3, window = "1h", counts = "requests" }"#)
}

/// Routes `sl0`…`sl19`: each repetition of the sequence below on keys of
/// its own.
const REPEATS: usize = 20;

fn costly_routes(config: Config) -> Config {
    (0..REPEATS).fold(config.admin(), |c, n| {
        c.route(costly_with_a_requests_limit(n))
    })
}

/// Users u0 and u1 of org A, three requests each, then ann of org A once:
/// org A is full (14 units). Ann of org A three more times is refused by
/// the org's limit; ann of org B is then admitted: nothing of hers
/// refused was kept, in any limit. Run on route `sl{n}` through `gates`
/// in turn; the answers, in order.
async fn refused_parts_sequence(gates: &[Floodgate], n: usize) -> Vec<u16> {
    let http = TestClient::http1();
    let mut asks: Vec<(&str, &str)> = vec![];
    for user in ["u0", "u1"] {
        asks.extend([(user, "A"); 3]);
    }
    asks.extend([("ann", "A"); 4]);
    asks.push(("ann", "B"));
    let mut answers = Vec::new();
    for (i, (user, org)) in asks.into_iter().enumerate() {
        let url = gates[i % gates.len()].url(&format!("/sl{n}/x"));
        answers.push(ask(&http, &url, user, org).await);
    }
    answers
}

const SEQUENCE_ANSWERS: [u16; 11] = [200, 200, 200, 200, 200, 200, 200, 429, 429, 429, 200];

async fn a_refused_requests_parts_are_all_given_back(gates: &[Floodgate]) {
    for n in 0..REPEATS {
        let answers = refused_parts_sequence(gates, n).await;
        assert_eq!(answers, SEQUENCE_ANSWERS, "repetition {n}");
    }
}

#[tokio::test]
async fn in_memory_a_refused_request_keeps_nothing_of_a_limit_counting_requests() {
    let gate = Floodgate::start(&costly_routes(Config::new()).toml()).await;
    a_refused_requests_parts_are_all_given_back(std::slice::from_ref(&gate)).await;
}

#[tokio::test]
async fn on_one_redis_a_refused_request_keeps_nothing_of_a_limit_counting_requests() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("refused-parts");
    let toml = costly_routes(Config::new().redis(&redis.url, &prefix)).toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    a_refused_requests_parts_are_all_given_back(&gates).await;
    for n in 0..REPEATS {
        // Ann's requests: the one admitted before and the one after.
        let users = redis
            .logged_each(&format!("{prefix}:{{sl{n}:*}}:2:sliding_log:*"))
            .await;
        assert_eq!(users, [2, 3, 3], "sl{n}");
    }
    assert_eq!(given_back(&gates[0]).await + given_back(&gates[1]).await, 0);
}

/// The cluster slot of `key`.
fn slot(cluster: &TestCluster, key: &str) -> u64 {
    let port = cluster.primaries()[0];
    let answer = cluster.cli(port, &["CLUSTER", "KEYSLOT", key]);
    answer
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("CLUSTER KEYSLOT {key}: {answer}"))
}

/// The key matching `pattern` on the cluster holding `units` entries.
fn key_holding(cluster: &TestCluster, pattern: &str, units: u64) -> String {
    let mut found = Vec::new();
    for port in cluster.primaries() {
        for key in cluster.keys(port, pattern) {
            let n = cluster.cli(port, &["ZCARD", &key]);
            if n.trim().parse::<u64>().ok() == Some(units) {
                return key;
            }
            found.push(format!("{key}: {}", n.trim()));
        }
    }
    panic!("no key matching {pattern} holds {units}: {found:?}")
}

#[tokio::test]
async fn on_a_cluster_a_refused_request_keeps_nothing_of_a_limit_counting_requests() {
    let cluster = TestCluster::start().await;
    let prefix = unique_prefix("refused-parts-cluster");
    let toml = costly_routes(
        Config::new()
            .redis_cluster(&cluster.urls(), &prefix)
            .store(r#"timeout = "2s""#),
    )
    .toml();
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let mut expected_back = 0;
    for n in 0..REPEATS {
        let before = given_back(&gates[0]).await + given_back(&gates[1]).await;
        let answers = refused_parts_sequence(&gates, n).await;
        assert_eq!(answers, SEQUENCE_ANSWERS, "repetition {n}");
        // What each limit holds: every admitted request's units (2 each)
        // in the global and org counts, one per admitted request in the
        // user's.
        let count = |index: usize, client: &str| {
            format!("{prefix}:{{sl{n}:{client}}}:{index}:sliding_log:*")
        };
        assert_eq!(cluster_counts(&cluster, &count(0, "g")), [16], "sl{n}");
        assert_eq!(cluster_counts(&cluster, &count(1, "*")), [2, 14], "sl{n}");
        assert_eq!(cluster_counts(&cluster, &count(2, "*")), [2, 3, 3], "sl{n}");
        // Each refused request took the parts in slots before the org's
        // (parts are taken in slot order) and gave back what each took:
        // 2 units of the global limit, 1 of the user's (it counts
        // requests). A refusal remembered by an instance asks nothing.
        let org = slot(&cluster, &key_holding(&cluster, &count(1, "*"), 14));
        let ann = slot(&cluster, &key_holding(&cluster, &count(2, "*"), 2));
        let global = slot(&cluster, &key_holding(&cluster, &count(0, "g"), 16));
        let per_refusal = 2 * u64::from(global < org) + u64::from(ann < org);
        let back = given_back(&gates[0]).await + given_back(&gates[1]).await - before;
        assert!(
            (0..=3).any(|k| back == k * per_refusal) && (per_refusal == 0 || back > 0),
            "sl{n}: {back} units given back, {per_refusal} per refused request asked of the store"
        );
        expected_back += back;
    }
    println!("cluster: {expected_back} units given back over {REPEATS} repetitions");
}

#[tokio::test]
async fn a_per_key_limit_beside_a_per_address_limit_refuses_made_up_keys() {
    let gate = Floodgate::start(
        &Config::new()
            .route(
                Route::new("keys")
                    .client(r#"from = "header", name = "X-Api-Key""#)
                    .limit("sliding_log", 100, "1h")
                    .limits(
                        r#"{ algorithm = "sliding_log", limit = 20, window = "1h", key = { from = "remote_addr" } }"#,
                    ),
            )
            .toml(),
    )
    .await;
    let http = TestClient::http1();
    let mut statuses = Vec::new();
    for i in 0..30 {
        let a = http
            .get(&gate.url("/"), &[("x-api-key", &format!("made-up-{i}"))])
            .await;
        statuses.push(a.status.as_u16());
    }
    assert_eq!(statuses.iter().filter(|&&s| s == 200).count(), 20);
    assert!(statuses[20..].iter().all(|&s| s == 429), "{statuses:?}");
}

// === plans ===

/// Sends requests with `headers` until one is refused (at most 50): how
/// many were admitted, and the first answer.
async fn admitted_until_refused(
    http: &TestClient,
    url: &str,
    headers: &[(&str, &str)],
) -> (usize, Answer) {
    let first = http.get(url, headers).await;
    let mut admitted = usize::from(first.status == 200);
    if first.status == 200 {
        for _ in 0..50 {
            if http.get(url, headers).await.status != 200 {
                return (admitted, first);
            }
            admitted += 1;
        }
    }
    (admitted, first)
}

#[tokio::test]
async fn plans_by_a_verified_claim_with_a_claim_carried_limit_clamped_to_its_ceiling() {
    let dir = temp_dir("plans-claim");
    let secret = b"a plan secret of at least thirty-two bytes".to_vec();
    let jwt = support::tokens::hs256_client(&dir, &secret);
    let toml = Config::new()
        .route(
            Route::new("chat")
                .client(&jwt)
                .limit("sliding_log", 1, "1h")
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(&format!(
            r#"[plan_selection]
by = {{ from = "jwt", claim = "plan", algorithm = "HS256", secret_file = "{}" }}

[plans.free]
limits = [{{ algorithm = "sliding_log", limit = 2, window = "1h" }}]

[plans.pro]
limits = [{{ algorithm = "sliding_log", window = "1h", limit_from = {{ claim = "rpm", default = 3, max = 10 }} }}]"#,
            dir.join("secret").display()
        ))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let url = gate.url("/chat");
    let cases = [
        (r#""sub":"f1","plan":"free""#, 2, "\"chat\";q=2;w=3600"),
        (
            r#""sub":"p1","plan":"pro","rpm":50"#,
            10,
            "\"chat\";q=10;w=3600",
        ),
        (
            r#""sub":"p2","plan":"pro","rpm":4"#,
            4,
            "\"chat\";q=4;w=3600",
        ),
        (r#""sub":"p3","plan":"pro""#, 3, "\"chat\";q=3;w=3600"),
        (r#""sub":"n1""#, 1, "\"chat\";q=1;w=3600"),
        (
            r#""sub":"e1","plan":"enterprise""#,
            1,
            "\"chat\";q=1;w=3600",
        ),
    ];
    for (claims, want, policy) in cases {
        let bearer = format!("Bearer {}", token(&secret, claims));
        let (admitted, first) =
            admitted_until_refused(&http, &url, &[("authorization", &bearer)]).await;
        assert_eq!(admitted, want, "{claims}");
        assert_eq!(first.header("ratelimit-policy"), Some(policy), "{claims}");
    }
    // A token signed with another secret names no plan and no client.
    let forged = format!(
        "Bearer {}",
        token(
            b"another secret, also thirty-two bytes long",
            r#""sub":"x","plan":"pro","rpm":10"#
        )
    );
    assert_eq!(
        http.get(&url, &[("authorization", &forged)]).await.status,
        401
    );
}

fn header_plans(trusted: &str) -> String {
    Config::new()
        .server(&format!(r#"trusted_proxies = ["{trusted}"]"#))
        .route(
            Route::new("api")
                .client(r#"from = "header", name = "X-Api-Key""#)
                .limit("sliding_log", 1, "1h")
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(
            r#"[plan_selection]
by = { from = "header", name = "X-Plan" }
default = "free"

[plans.free]
limits = [{ algorithm = "sliding_log", limit = 2, window = "1h" }]

[plans.pro]
limits = [{ algorithm = "sliding_log", limit = 5, window = "1h" }]"#,
        )
        .toml()
}

#[tokio::test]
async fn a_plan_header_counts_only_from_a_trusted_proxy() {
    let http = TestClient::http1();
    let trusted = Floodgate::start(&header_plans("127.0.0.1/32")).await;
    let untrusted = Floodgate::start(&header_plans("10.0.0.0/8")).await;
    for (gate, pro, want) in [(&trusted, "k1", 5), (&untrusted, "k1", 2)] {
        let headers = [("x-api-key", pro), ("x-plan", "pro")];
        let (admitted, _) = admitted_until_refused(&http, &gate.url("/"), &headers).await;
        assert_eq!(admitted, want);
    }
    // Without the header, the default plan.
    let (admitted, _) =
        admitted_until_refused(&http, &trusted.url("/"), &[("x-api-key", "k2")]).await;
    assert_eq!(admitted, 2);
}

/// A table of 100 000 clients, all on `plan`.
fn table(plan: &str) -> String {
    let mut out = String::with_capacity(100_000 * 20);
    out.push_str("# client plan\n");
    for i in 0..100_000 {
        out.push_str(&format!("key-{i} {plan}\n"));
    }
    out
}

/// The `RateLimit-Policy` of a client on plan free.
const FREE: &str = "\"api\";q=900000;w=3600";
/// The `RateLimit-Policy` of a client on plan pro.
const PRO: &str = "\"api\";q=800000;w=3600";

/// Route `api` whose clients' plans come from the table at `path`.
fn plans_from_a_table(path: &Path) -> String {
    Config::new()
        .route(
            Route::new("api")
                .client(r#"from = "header", name = "X-Api-Key""#)
                .limit("sliding_log", 7, "1h")
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(&format!(
            r#"[plan_selection]
by = {{ from = "header", name = "X-Api-Key" }}
table = "{}"

[plans.free]
limits = [{{ algorithm = "fixed_window", limit = 900000, window = "1h" }}]

[plans.pro]
limits = [{{ algorithm = "fixed_window", limit = 800000, window = "1h" }}]"#,
            path.display()
        ))
        .toml()
}

/// What a load task saw: each answer's status and `RateLimit-Policy`.
type Policies = Vec<(u16, Option<String>)>;

/// Six clients asking as keys spread over the table until `stop`; each
/// task returns every answer's status and `RateLimit-Policy`.
fn load_across_the_table(
    http: &TestClient,
    gate: &Floodgate,
    stop: &Arc<AtomicBool>,
) -> Vec<JoinHandle<Policies>> {
    (0..6u32)
        .map(|task| {
            let (http, url, stop) = (http.clone(), gate.url("/"), stop.clone());
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut i = task;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let key = format!("key-{}", (i * 7_919) % 100_000);
                    let a = http.get(&url, &[("x-api-key", &key)]).await;
                    seen.push((
                        a.status.as_u16(),
                        a.header("ratelimit-policy").map(str::to_owned),
                    ));
                    i += 1;
                }
                seen
            })
        })
        .collect()
}

/// Waits (30 s at most) until the table's last key is decided by the plan
/// whose policy is `want`.
async fn until_in_force(http: &TestClient, gate: &Floodgate, want: &str) {
    let url = gate.url("/");
    let started = Instant::now();
    loop {
        let a = http.get(&url, &[("x-api-key", "key-99999")]).await;
        if a.header("ratelimit-policy") == Some(want) {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the table never put {want} in force"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Puts `text` at `path`: replaced whole (written aside, then renamed over
/// it) or rewritten in place, in pieces, as an editor or a script may.
fn replace_table(path: &Path, text: &str, whole: bool) {
    if whole {
        let aside = path.with_extension("txt.new");
        std::fs::write(&aside, text).expect("write table");
        std::fs::rename(&aside, path).expect("rename table");
    } else {
        use std::io::Write as _;
        let mut file = std::fs::File::create(path).expect("truncate table");
        for piece in text.as_bytes().chunks(64 * 1024) {
            file.write_all(piece).expect("write piece");
            file.flush().expect("flush");
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

#[tokio::test]
async fn a_client_plan_table_replaced_under_load_decides_every_request_by_a_whole_table() {
    let dir = temp_dir("plan-table");
    let path = dir.join("plans.txt");
    std::fs::write(&path, table("free")).expect("write table");
    let gate = Floodgate::start(&plans_from_a_table(&path)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let http = TestClient::http1();
    let load = load_across_the_table(&http, &gate, &stop);
    until_in_force(&http, &gate, FREE).await;
    for round in 0..4 {
        let (text, want) = if round % 2 == 0 {
            (table("pro"), PRO)
        } else {
            (table("free"), FREE)
        };
        replace_table(&path, &text, round < 2);
        until_in_force(&http, &gate, want).await;
    }
    // A table naming an unknown plan is refused; the one in force stays.
    std::fs::write(&path, "key-1 platinum\n").expect("write bad table");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    until_in_force(&http, &gate, FREE).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut answers = 0;
    for task in load {
        for (status, policy) in task.await.expect("load task") {
            answers += 1;
            assert_eq!(status, 200);
            let policy = policy.unwrap_or_default();
            assert!(
                policy == FREE || policy == PRO,
                "a request decided without a whole table: {policy}"
            );
        }
    }
    assert!(answers > 100, "only {answers} answers under load");
}

// === budgets ===

/// An upstream that reports `?units=N` in an `X-Units` header: its URL.
async fn reporting_upstream() -> String {
    use http_body_util::Full;
    use hyper::body::{Bytes, Incoming};
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = service_fn(|req: hyper::Request<Incoming>| async move {
                    let units = req
                        .uri()
                        .query()
                        .and_then(|q| q.strip_prefix("units="))
                        .unwrap_or("0")
                        .to_owned();
                    hyper::Response::builder()
                        .header("x-units", units)
                        .body(Full::new(Bytes::from_static(b"done")))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    url
}

#[tokio::test]
async fn two_routes_draw_on_one_budget_with_their_own_costs_and_usage() {
    let redis = TestRedis::start().await;
    let prefix = unique_prefix("budget");
    let upstream = reporting_upstream().await;
    let toml = Config::new()
        .redis(&redis.url, &prefix)
        .route(
            Route::new("chat")
                .matching(r#"path_prefix = "/chat""#)
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line(r#"budgets = ["tokens"]"#),
        )
        .route(
            Route::new("images")
                .matching(r#"path_prefix = "/images""#)
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line("cost = 5")
                .line(r#"budgets = ["tokens"]"#),
        )
        .route(
            Route::new("metered")
                .upstream(&upstream)
                .matching(r#"path_prefix = "/metered""#)
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line(r#"usage = { reserve = 20, report = "header", units = { "x-units" = 1 } }"#)
                .line(r#"budgets = ["tokens"]"#),
        )
        .tables(
            r#"[budgets.tokens]
limits = [{ algorithm = "sliding_log", limit = 1000, window = "1h" }]"#,
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    let key = [("x-api-key", "team-a")];
    for _ in 0..7 {
        assert_eq!(http.get(&gate.url("/chat"), &key).await.status, 200);
    }
    for _ in 0..3 {
        assert_eq!(http.get(&gate.url("/images"), &key).await.status, 200);
    }
    // The upstream reports 12 units on each of two answers (reserved 20).
    for _ in 0..2 {
        let a = http.get(&gate.url("/metered?units=12"), &key).await;
        assert_eq!(a.status, 200);
    }
    let spent = 7 + 3 * 5 + 2 * 12;
    let budget = redis
        .logged_each(&format!("{prefix}:{{@tokens:*}}:0:sliding_log:*"))
        .await;
    assert_eq!(budget, [spent]);
    let a = http.get(&gate.url("/chat"), &key).await;
    assert_eq!(
        a.header("ratelimit"),
        Some(format!("\"tokens\";r={};t=3600", 1000 - spent - 1).as_str())
    );
    // No key holds a route's name: the budget's count is the routes'.
    for k in redis.keys(&format!("{prefix}:*")).await {
        assert!(k.contains("{@tokens:"), "{k}");
    }
}

/// On a route with `answers = "openai"`, a plan's limit carries its own
/// `deny_code`: the free plan's hour is named a quota, the pro plan's
/// hour (no code, a rolling window) is a rate.
#[tokio::test]
async fn a_plans_limit_answers_with_its_own_deny_code() {
    let toml = Config::new()
        .server(r#"trusted_proxies = ["127.0.0.1/32"]"#)
        .route(
            Route::new("api")
                .client(r#"from = "header", name = "X-Api-Key""#)
                .limit("sliding_log", 1, "1h")
                .line(r#"plans = ["free", "pro"]"#)
                .line(r#"answers = "openai""#),
        )
        .tables(
            r#"[plan_selection]
by = { from = "header", name = "X-Plan" }
default = "free"

[plans.free]
limits = [{ algorithm = "sliding_log", limit = 2, window = "1h", deny_code = "insufficient_quota" }]

[plans.pro]
limits = [{ algorithm = "sliding_log", limit = 3, window = "1h" }]"#,
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let http = TestClient::http1();
    for (plan, want, code) in [
        ("free", 2, "insufficient_quota"),
        ("pro", 3, "rate_limit_exceeded"),
    ] {
        let headers = [("x-api-key", plan), ("x-plan", plan)];
        for _ in 0..want {
            assert_eq!(
                http.get(&gate.url("/"), &headers).await.status,
                200,
                "{plan}"
            );
        }
        let refused = http.get(&gate.url("/"), &headers).await;
        assert_eq!(refused.status, 429, "{plan}");
        let body: serde_json::Value = serde_json::from_str(&refused.text()).unwrap_or_default();
        assert_eq!(body["error"]["code"], code, "{plan}: {body}");
        assert!(body["error"]["param"].is_null(), "{plan}: {body}");
        assert!(refused.header("retry-after").is_some(), "{plan}");
    }
}
