//! Failover under a flood: two floodgate instances on a three-primary Redis
//! Cluster, a route limited per user, per org and globally (each limit's
//! key in its own slot) and a route with a leased global limit, while the
//! primary holding the leased key and some users' and orgs' keys is
//! SIGKILLed and its replica promoted. Counted from the upstream's own log,
//! no key admits more than its limit in any window, before, during or after
//! the failover, except in the window of the kill by the units the lost
//! primary acknowledged and its replica never received: measured in what
//! the replica held before it was promoted.

mod support;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use floodgate::client::ClientId;
use floodgate::limit::redis::{IdKey, write_client};
use support::cluster::TestCluster;
use support::config::{Config, Route};
use support::load::{Ledger, metric_in, metric_where, now_ms};
use support::redis::unique_prefix;
use support::{Floodgate, TestClient};

/// Every limit's window: fixed, aligned to multiples of it.
const WINDOW_MS: u64 = 3_000;
const USER_LIMIT: u64 = 12;
const ORG_LIMIT: u64 = 30;
const GLOBAL_LIMIT: u64 = 100;
const LEASED_LIMIT: u64 = 300;

/// Users in each org. The last org's users send 20 requests a second each
/// and run out of their own limit first; the first org's run out of the
/// org's; then the global limit runs out, about halfway through a window.
const ORG_SIZES: [usize; 4] = [7, 4, 3, 2];

/// Requests a second to the leased route, over four senders: twice its
/// limit.
const LEASED_RATE: u64 = 200;

/// Whose count a limit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Key {
    User(usize),
    Org(usize),
    Global,
    Leased,
}

impl Key {
    fn limit(self) -> u64 {
        match self {
            Key::User(_) => USER_LIMIT,
            Key::Org(_) => ORG_LIMIT,
            Key::Global => GLOBAL_LIMIT,
            Key::Leased => LEASED_LIMIT,
        }
    }
}

/// What the test's keys are called: floodgate's key prefix, and a salt in
/// the routes' and clients' names, which places their keys in slots (the
/// prefix lies outside the hash tag).
#[derive(Debug, Clone)]
struct Names {
    prefix: String,
    salt: u32,
}

impl Names {
    fn team(&self) -> String {
        format!("team-{}", self.salt)
    }

    fn leased(&self) -> String {
        format!("leased-{}", self.salt)
    }

    fn user(&self, u: usize) -> String {
        format!("user-{u}-{}", self.salt)
    }

    fn org(&self, o: usize) -> String {
        format!("org-{o}-{}", self.salt)
    }

    /// The Redis key floodgate counts `key` under.
    fn key(&self, key: Key) -> String {
        let (route, client, index) = match key {
            Key::User(u) => (self.team(), ClientId::header(self.user(u)), 0),
            Key::Org(o) => (self.team(), ClientId::header(self.org(o)), 1),
            Key::Global => (self.team(), ClientId::Global, 2),
            Key::Leased => (self.leased(), ClientId::Global, 0),
        };
        let mut tag = format!("{}:{{{route}:", self.prefix);
        write_client(&mut tag, &client, &IdKey::new(None));
        format!("{tag}}}:{index}:fixed_window:{WINDOW_MS}")
    }
}

/// Each user's org and requests a second.
fn users() -> Vec<(usize, u64)> {
    let last = ORG_SIZES.len() - 1;
    ORG_SIZES
        .iter()
        .enumerate()
        .flat_map(|(org, &n)| std::iter::repeat_n((org, if org == last { 20 } else { 5 }), n))
        .collect()
}

/// Every key of the test.
fn keys() -> Vec<Key> {
    let mut keys: Vec<Key> = (0..users().len()).map(Key::User).collect();
    keys.extend((0..ORG_SIZES.len()).map(Key::Org));
    keys.extend([Key::Global, Key::Leased]);
    keys
}

fn config(urls: &[String], names: &Names, upstream: &str) -> String {
    let limit = |limit: u64, key: &str| {
        format!(r#"{{ algorithm = "fixed_window", limit = {limit}, window = "3s", key = {key} }}"#)
    };
    let team = Route::new(&names.team())
        .matching(r#"path_prefix = "/team""#)
        .upstream(upstream)
        .limits(&limit(
            USER_LIMIT,
            r#"{ from = "header", name = "X-User", missing = "reject" }"#,
        ))
        .limits(&limit(
            ORG_LIMIT,
            r#"{ from = "header", name = "X-Org", missing = "reject" }"#,
        ))
        .limits(&limit(GLOBAL_LIMIT, r#"{ from = "global" }"#));
    let leased = Route::new(&names.leased())
        .matching(r#"path_prefix = "/leased""#)
        .upstream(upstream)
        .limits(&format!(
            r#"{{ algorithm = "fixed_window", limit = {LEASED_LIMIT}, window = "3s", key = {{ from = "global" }}, lease = {{}} }}"#
        ));
    Config::new()
        .redis_cluster(urls, &names.prefix)
        .store(r#"on_error = "deny""#)
        .admin()
        .route(team)
        .route(leased)
        .toml()
}

/// Names under which the primary holding the leased key (the one the test
/// kills) also holds at least two users' keys and one to three orgs' but
/// not the team's global key; with the primary of every key.
fn placed(cluster: &TestCluster) -> (Names, HashMap<Key, u16>) {
    let prefix = unique_prefix("failover");
    for salt in 0..1_000 {
        let names = Names {
            prefix: prefix.clone(),
            salt,
        };
        let keys_named: Vec<String> = keys().iter().map(|&k| names.key(k)).collect();
        let owner: HashMap<Key, u16> = keys()
            .into_iter()
            .zip(cluster.primaries_of(&keys_named))
            .collect();
        let victim = owner[&Key::Leased];
        let on_victim =
            |f: fn(&Key) -> bool| owner.iter().filter(|&(k, &p)| f(k) && p == victim).count();
        let users = on_victim(|k| matches!(k, Key::User(_)));
        let orgs = on_victim(|k| matches!(k, Key::Org(_)));
        if owner[&Key::Global] != victim && users >= 2 && (1..ORG_SIZES.len()).contains(&orgs) {
            return (names, owner);
        }
    }
    panic!("no names placed the keys as the test needs");
}

/// One request of the flood, as the load saw it.
#[derive(Debug, Clone, Copy)]
struct Sent {
    id: u64,
    /// The user, or `None` on the leased route.
    user: Option<usize>,
    sent: u64,
    status: u16,
}

/// Paced senders, one per user and four on the leased route, alternating
/// between the instances on kept-alive connections, until `until` (ms).
struct Flood {
    until: Arc<AtomicU64>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Sent>>>,
}

impl Flood {
    fn start(gates: &[Floodgate], names: &Names) -> Self {
        let until = Arc::new(AtomicU64::new(u64::MAX));
        let http = TestClient::http1();
        let mut senders: Vec<(Option<usize>, u64)> = users()
            .iter()
            .enumerate()
            .map(|(u, &(_, rate))| (Some(u), rate))
            .collect();
        senders.extend([(None, LEASED_RATE / 4); 4]);
        let tasks = senders
            .into_iter()
            .enumerate()
            .map(|(task, (user, rate))| {
                let path = if user.is_some() { "/team" } else { "/leased" };
                let urls: Vec<String> = gates.iter().map(|g| g.url(path)).collect();
                let (http, until) = (http.clone(), Arc::clone(&until));
                let who = user.map(|u| (u, names.user(u), names.org(users()[u].0)));
                tokio::spawn(send(http, urls, task as u64, who, rate, until))
            })
            .collect();
        Self { until, tasks }
    }

    /// Stops at `until` (ms) and returns every request's answer.
    async fn stop_at(self, until: u64) -> Vec<Sent> {
        self.until.store(until, Ordering::Relaxed);
        let mut all = Vec::new();
        for task in self.tasks {
            all.extend(task.await.expect("a sender"));
        }
        all
    }
}

/// One sender: `rate` requests a second for a user (its number, name and
/// org's name), or on the leased route.
async fn send(
    http: TestClient,
    urls: Vec<String>,
    task: u64,
    who: Option<(usize, String, String)>,
    rate: u64,
    until: Arc<AtomicU64>,
) -> Vec<Sent> {
    let mut tick = tokio::time::interval(Duration::from_millis(1_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seen = Vec::new();
    for n in 0u64.. {
        tick.tick().await;
        let sent = now_ms();
        if sent >= until.load(Ordering::Relaxed) {
            break;
        }
        let id = task << 32 | n;
        let (id_text, sent_text) = (id.to_string(), sent.to_string());
        let mut headers = vec![("x-id", id_text.as_str()), ("x-sent", sent_text.as_str())];
        if let Some((_, user, org)) = &who {
            headers.extend([("x-user", user.as_str()), ("x-org", org.as_str())]);
        }
        let url = &urls[(task + n) as usize % urls.len()];
        let status = http.get(url, &headers).await.status.as_u16();
        seen.push(Sent {
            id,
            user: who.as_ref().map(|w| w.0),
            sent,
            status,
        });
    }
    seen
}

/// An admitted request: the keys it counted in, when it was sent and when
/// it reached the upstream (floodgate decided it in between).
struct Admitted {
    keys: Vec<Key>,
    sent: u64,
    at: u64,
}

/// The admitted requests: each answered 200 and seen by the upstream, and
/// the upstream saw no other.
fn admitted(seen: &[Sent], ledger: &Ledger) -> Vec<Admitted> {
    let arrived: HashMap<u64, u64> = ledger.arrivals().iter().map(|a| (a.id, a.at)).collect();
    let users = users();
    let mut out = Vec::new();
    for s in seen {
        assert!(
            [200, 429, 503].contains(&s.status),
            "only decisions and on_error answers: {s:?}"
        );
        let at = arrived.get(&s.id).copied();
        assert_eq!(
            s.status == 200,
            at.is_some(),
            "admitted exactly when the upstream saw it: {s:?}"
        );
        let (Some(at), 200) = (at, s.status) else {
            continue;
        };
        let keys = match s.user {
            Some(u) => vec![Key::User(u), Key::Org(users[u].0), Key::Global],
            None => vec![Key::Leased],
        };
        out.push(Admitted {
            keys,
            sent: s.sent,
            at,
        });
    }
    assert_eq!(
        out.len(),
        arrived.len(),
        "the upstream saw only admitted requests"
    );
    out
}

/// Admissions of one key in one window: `certain` were decided in it for
/// sure (sent and arrived in it), `possible` may have been (decided across
/// one of its edges).
#[derive(Debug, Default, Clone, Copy)]
struct Count {
    certain: u64,
    possible: u64,
}

/// Per key and window index, the admissions.
fn per_window(admitted: &[Admitted]) -> BTreeMap<(Key, u64), Count> {
    let mut out: BTreeMap<(Key, u64), Count> = BTreeMap::new();
    for a in admitted {
        let (first, last) = (a.sent / WINDOW_MS, a.at / WINDOW_MS);
        for &key in &a.keys {
            for w in first..=last {
                out.entry((key, w)).or_default().possible += 1;
            }
            if first == last {
                out.entry((key, first)).or_default().certain += 1;
            }
        }
    }
    out
}

/// What the replica at `port` holds for `keys` in the window starting at
/// `start` (a fixed window's key reads "start count"), read as a replica.
async fn held(port: u16, keys: &[(Key, String)], start: u64) -> HashMap<Key, u64> {
    let mut conn = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .expect("replica url")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to the replica");
    let () = redis::cmd("READONLY")
        .query_async(&mut conn)
        .await
        .expect("READONLY");
    let mut out = HashMap::new();
    for (key, name) in keys {
        let value: Option<String> = redis::cmd("GET")
            .arg(name)
            .query_async(&mut conn)
            .await
            .expect("GET on the replica");
        let count = value.and_then(|v| {
            let mut numbers = v.split(' ').map(str::parse::<u64>);
            let (Some(Ok(s)), Some(Ok(c))) = (numbers.next(), numbers.next()) else {
                return None;
            };
            (s == start).then_some(c)
        });
        out.insert(*key, count.unwrap_or(0));
    }
    out
}

/// What the instances counted on the leased route so far, by their
/// metrics: units their slices took from the store, requests they decided
/// from slices, and requests they admitted.
#[derive(Debug, Clone, Copy)]
struct Leased {
    taken: u64,
    from_slices: u64,
    admitted: u64,
}

impl Leased {
    async fn read(http: &TestClient, gates: &[Floodgate], names: &Names) -> Self {
        let route = format!(r#"route="{}""#, names.leased());
        let (mut taken, mut from_slices, mut admitted) = (0.0, 0.0, 0.0);
        for gate in gates {
            let text = http.get(&gate.admin_url("/metrics"), &[]).await.text();
            taken += metric_in(&text, "floodgate_lease_taken_units_total");
            from_slices += metric_in(&text, "floodgate_lease_admitted_total");
            admitted += metric_where(
                &text,
                "floodgate_requests_total",
                &[&route, r#"outcome="allowed""#],
            );
        }
        Self {
            taken: taken as u64,
            from_slices: from_slices as u64,
            admitted: admitted as u64,
        }
    }

    /// The units the store acknowledged since `before`, at most: what
    /// slices took, and the requests decided by the store one by one (a
    /// window near its end), which are those admitted but not from a
    /// slice. (A request counted in one metric before `before` and in the
    /// other after it can only add one.)
    fn acknowledged_since(self, before: Self) -> u64 {
        let per_request =
            (self.admitted - before.admitted).saturating_sub(self.from_slices - before.from_slices);
        self.taken - before.taken + per_request
    }
}

async fn sleep_until(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms.saturating_sub(now_ms()))).await;
}

/// The kill and what the replica held: `held` per key of the lost primary
/// in the kill's window, and the units the store acknowledged on the
/// leased key in that window before the kill, at most, by the instances'
/// metrics.
struct Fault {
    window: u64,
    killed_at: u64,
    promoted_at: u64,
    held: HashMap<Key, u64>,
    leased_acknowledged: u64,
}

impl Fault {
    /// Per key of the lost primary, the units it acknowledged in the kill's
    /// window that its replica did not hold: what it acknowledged (on the
    /// leased key by the instances' metrics, on the others the requests
    /// admitted, sent before the kill and arrived in the window) less what
    /// the replica held.
    fn lost(&self, admitted: &[Admitted]) -> BTreeMap<Key, u64> {
        let start = self.window * WINDOW_MS;
        self.held
            .iter()
            .map(|(&key, &held)| {
                let acknowledged = match key {
                    Key::Leased => self.leased_acknowledged,
                    _ => admitted
                        .iter()
                        .filter(|a| a.keys.contains(&key) && a.sent < self.killed_at && a.at >= start)
                        .count() as u64,
                };
                println!("{key:?}: {acknowledged} acknowledged in the kill's window, {held} on the replica");
                (key, acknowledged.saturating_sub(held))
            })
            .collect()
    }

    /// Where window `w` lies: before the kill, after the promotion, or
    /// during the failover.
    fn phase(&self, w: u64) -> &'static str {
        if (w + 1) * WINDOW_MS <= self.killed_at {
            "before"
        } else if w * WINDOW_MS >= self.promoted_at {
            "after"
        } else {
            "during"
        }
    }
}

/// Every key floodgate wrote is one of the test's, on the primary it was
/// placed on (so what is read on the replica is what floodgate counted).
fn assert_placed(cluster: &TestCluster, names: &Names, owner: &HashMap<Key, u16>) {
    let known: HashMap<String, Key> = keys().into_iter().map(|k| (names.key(k), k)).collect();
    let mut found = 0;
    for port in cluster.primaries() {
        for name in cluster.keys(port, &format!("{}:*", names.prefix)) {
            let key = known
                .get(&name)
                .unwrap_or_else(|| panic!("a key the test does not know: {name}"));
            assert_eq!(owner[key], port, "{key:?} on another primary");
            found += 1;
        }
    }
    assert!(found > known.len() / 2, "only {found} of the keys written");
}

/// Kills the lost primary 300 ms into a window at least two whole windows
/// after `from` (no limit runs out that early: every key is being
/// counted), then reads what its replica holds before the replica is
/// promoted, and waits for the promotion.
async fn kill(
    cluster: &mut TestCluster,
    gates: &[Floodgate],
    names: &Names,
    owner: &HashMap<Key, u16>,
    from: u64,
) -> Fault {
    let http = TestClient::http1();
    let victim = owner[&Key::Leased];
    let replica = cluster.replica_of(victim);
    sleep_until(from + WINDOW_MS).await;
    assert_placed(cluster, names, owner);
    // What the instances counted on the leased route before the window
    // starts: read too late on a busy machine, the next window is the
    // kill's.
    let mut start = (from / WINDOW_MS + 3) * WINDOW_MS;
    let before = loop {
        sleep_until(start - 200).await;
        let read = Leased::read(&http, gates, names).await;
        if now_ms() < start {
            break read;
        }
        start += WINDOW_MS;
    };
    sleep_until(start + 300).await;
    cluster.kill(victim);
    let killed_at = now_ms();
    // Replies the primary sent before it died reach the instances within
    // the store's timeout (1 s), and what it replicated the replica.
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    let leased_acknowledged = Leased::read(&http, gates, names)
        .await
        .acknowledged_since(before);
    let on_victim: Vec<(Key, String)> = keys()
        .into_iter()
        .filter(|k| owner[k] == victim)
        .map(|k| (k, names.key(k)))
        .collect();
    let held = held(replica, &on_victim, start).await;
    assert!(
        cluster.cli(replica, &["ROLE"]).starts_with("slave"),
        "the replica was promoted before what it held was read: the cluster's node timeout is too short"
    );
    let deadline = now_ms() + 60_000;
    while !cluster.cli(replica, &["ROLE"]).starts_with("master") {
        assert!(now_ms() < deadline, "the replica was never promoted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Fault {
        window: start / WINDOW_MS,
        killed_at,
        promoted_at: now_ms(),
        held,
        leased_acknowledged,
    }
}

/// No key admitted past its limit in any window, but in the kill's window
/// by what its primary lost; prints each window's admissions.
fn assert_windows(counts: &BTreeMap<(Key, u64), Count>, fault: &Fault, lost: &BTreeMap<Key, u64>) {
    for (&(key, w), count) in counts {
        let lost = if w == fault.window {
            lost.get(&key).copied().unwrap_or(0)
        } else {
            0
        };
        let allowed = key.limit() + lost;
        assert!(
            count.certain <= allowed,
            "{key:?} admitted {} in the window at {} ({}), over its limit {} and the {lost} units lost",
            count.certain,
            w * WINDOW_MS,
            fault.phase(w),
            key.limit()
        );
    }
    let windows: std::collections::BTreeSet<u64> = counts.keys().map(|&(_, w)| w).collect();
    for w in windows {
        let most = |kind: fn(&Key) -> bool| {
            counts
                .iter()
                .filter(|&(&(k, cw), _)| cw == w && kind(&k))
                .map(|(_, c)| c.certain)
                .max()
                .unwrap_or(0)
        };
        println!(
            "window {w} ({}): most a user {} of {USER_LIMIT}, an org {} of {ORG_LIMIT}, global {} of {GLOBAL_LIMIT}, leased {} of {LEASED_LIMIT}",
            fault.phase(w),
            most(|k| matches!(k, Key::User(_))),
            most(|k| matches!(k, Key::Org(_))),
            most(|k| *k == Key::Global),
            most(|k| *k == Key::Leased),
        );
    }
}

/// The flood reached every kind of limit in some window (or the test
/// would show nothing), and each key of the lost primary admitted again
/// once its replica served.
fn assert_pushed_and_resumed(
    counts: &BTreeMap<(Key, u64), Count>,
    admitted: &[Admitted],
    fault: &Fault,
) {
    for kind in [Key::User(0), Key::Org(0), Key::Global, Key::Leased] {
        let same = |k: &Key| std::mem::discriminant(k) == std::mem::discriminant(&kind);
        assert!(
            counts
                .iter()
                .any(|(&(k, _), c)| same(&k) && c.possible >= k.limit()),
            "no {kind:?}-like key ever reached its limit: {counts:?}"
        );
    }
    for &key in fault.held.keys() {
        assert!(
            admitted
                .iter()
                .any(|a| a.keys.contains(&key) && a.sent > fault.promoted_at),
            "{key:?} was never admitted again after its replica was promoted"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_killed_under_a_flood_lets_no_key_past_its_limit_but_by_what_it_lost() {
    // Peers declare a node failed after 3 s: time to read what the
    // replica holds before it is promoted, on a busy machine too.
    let mut cluster = TestCluster::start_with(Duration::from_secs(3)).await;
    let (names, owner) = placed(&cluster);
    let ledger = Ledger::start().await;
    let toml = config(&cluster.urls(), &names, &ledger.url);
    let gates = [Floodgate::start(&toml).await, Floodgate::start(&toml).await];
    let from = now_ms();
    let flood = Flood::start(&gates, &names);
    let fault = kill(&mut cluster, &gates, &names, &owner, from).await;
    println!(
        "killed {} ms into window {}; replica promoted {} ms after the kill",
        fault.killed_at - fault.window * WINDOW_MS,
        fault.window,
        fault.promoted_at - fault.killed_at
    );
    // Three whole windows after the one the replica was promoted in.
    let seen = flood
        .stop_at((fault.promoted_at / WINDOW_MS + 4) * WINDOW_MS)
        .await;
    let admitted = admitted(&seen, &ledger);
    let refused = |status| seen.iter().filter(|s| s.status == status).count();
    println!(
        "{} requests: {} admitted, {} refused, {} answered by on_error",
        seen.len(),
        admitted.len(),
        refused(429),
        refused(503)
    );
    let lost = fault.lost(&admitted);
    println!("units lost at the failover: {lost:?}");
    let counts = per_window(&admitted);
    assert_windows(&counts, &fault, &lost);
    assert_pushed_and_resumed(&counts, &admitted, &fault);
}
