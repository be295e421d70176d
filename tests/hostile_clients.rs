//! What a hostile client cannot do: grow floodgate's memory with ids of its
//! choosing, or get a request counted on one route while the upstream acts
//! on another. Every attempt runs against a real floodgate and a real
//! upstream that records what reached it; the memory tests run the real
//! binary and read its resident memory from /proc.

mod support;

use std::time::Duration;

use support::config::{Config, Route};
use support::redis::{TestRedis, unique_prefix};
use support::{Floodgate, FloodgateProcess, Seen, TestClient, Upstream, free_port};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// === bounded memory ===

/// floodgate's resident memory in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// A metric's value from a Prometheus text exposition.
fn metric(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name_and_labels)?.trim().parse().ok())
}

/// Sends `count` requests on `path`, each with the headers `make(i)` gives,
/// eight at a time; returns how many got each status.
async fn send_many(
    client: &TestClient,
    url: &str,
    count: usize,
    make: impl Fn(usize) -> Vec<(String, String)>,
) -> std::collections::BTreeMap<u16, usize> {
    let mut statuses = std::collections::BTreeMap::new();
    for chunk in (0..count).collect::<Vec<_>>().chunks(8) {
        let answers = together(chunk.iter().map(|&i| {
            let client = client.clone();
            let url = url.to_owned();
            let headers = make(i);
            async move {
                let pairs: Vec<(&str, &str)> = headers
                    .iter()
                    .map(|(k, v)| (k.as_str(), v.as_str()))
                    .collect();
                client.get(&url, &pairs).await.status.as_u16()
            }
        }))
        .await;
        for status in answers {
            *statuses.entry(status).or_default() += 1;
        }
    }
    statuses
}

/// Runs futures together and collects their outputs in order.
async fn together<F>(futures: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.expect("request task"));
    }
    out
}

/// One request an hour per `X-Api-Key`, long ids hashed, at most 1 000
/// clients remembered; on `store`'s Redis when given, else in memory.
fn one_a_client_capped_at_1000_clients(
    port: u16,
    admin: u16,
    store: Option<&(&TestRedis, String)>,
) -> Config {
    let config = Config::new()
        .listen_on(port)
        .admin_on(admin)
        .server("on_long_client_id = \"hash\"")
        .server("max_client_entries = 1000")
        .route(
            Route::new("api")
                .client(r#"from = "header", name = "X-Api-Key""#)
                .limit("gcra", 1, "1h"),
        );
    match store {
        // A decision, not on_error: on a machine whose cores are busy a
        // Redis answer can take longer than the usual 200 ms, and
        // `on_error = "allow"` would then admit an id a second time.
        Some((redis, prefix)) => config.redis(&redis.url, prefix).store(r#"timeout = "5s""#),
        None => config,
    }
}

/// The admin's metrics show `table` holding between 1 and 1 000 clients,
/// and at least 2 000 ids that found it full.
async fn the_client_table_stopped_at_its_cap(client: &TestClient, admin: u16, table: &str) {
    let metrics = client
        .get(&format!("http://127.0.0.1:{admin}/metrics"), &[])
        .await
        .text();
    let entries = metric(
        &metrics,
        &format!("floodgate_client_entries{{table=\"{table}\"}}"),
    );
    let full = metric(
        &metrics,
        &format!("floodgate_client_entries_full_total{{table=\"{table}\"}}"),
    );
    assert!(
        entries.is_some_and(|n| (1.0..=1_000.0).contains(&n)),
        "{entries:?}\n{metrics}"
    );
    assert!(full.is_some_and(|n| n >= 2_000.0), "{full:?}\n{metrics}");
}

/// 2 000 unique 60 kB ids, then 2 000 unique 16-byte ids each beside a
/// 50 kB header, each id denied once so that denials are remembered too:
/// floodgate's resident memory grows by less than 16 MB, and its tables stop
/// at `max_client_entries`.
async fn hostile_ids_leave_memory_flat(store: Option<(&TestRedis, String)>) {
    let port = free_port();
    let admin = free_port();
    let path =
        one_a_client_capped_at_1000_clients(port, admin, store.as_ref()).write("hostile-memory");
    let gate = FloodgateProcess::spawn(&path, port).await;
    let pid = gate.pid();
    let client = TestClient::http1();
    let url = gate.url("/");
    let long_id = |i: usize| format!("{i:08}{}", "k".repeat(60_000 - 8));
    let side = "s".repeat(50_000);

    // Warm up buffers and allocator arenas with the same shapes of request.
    send_many(&client, &url, 200, |i| {
        vec![("x-api-key".into(), long_id(1_000_000 + i))]
    })
    .await;
    send_many(&client, &url, 200, |i| {
        vec![
            ("x-api-key".into(), format!("warm-{i:011}")),
            ("x-side".into(), side.clone()),
        ]
    })
    .await;
    let before = rss_kib(pid);

    for round in 0..2 {
        let statuses = send_many(&client, &url, 2_000, |i| {
            vec![("x-api-key".into(), long_id(i))]
        })
        .await;
        assert_eq!(statuses.values().sum::<usize>(), 2_000, "{statuses:?}");
        if round == 1 {
            assert!(
                !statuses.contains_key(&200),
                "each id was admitted once: {statuses:?}"
            );
        }
    }
    for round in 0..2 {
        let statuses = send_many(&client, &url, 2_000, |i| {
            vec![
                ("x-api-key".into(), format!("id-{i:013}")),
                ("x-side".into(), side.clone()),
            ]
        })
        .await;
        if round == 1 {
            assert!(
                !statuses.contains_key(&200),
                "each id was admitted once: {statuses:?}"
            );
        }
    }
    let after = rss_kib(pid);
    println!("floodgate's resident memory: {before} KiB before, {after} KiB after");
    assert!(
        after.saturating_sub(before) < 16 * 1024,
        "resident memory grew from {before} KiB to {after} KiB"
    );

    // The cap and its metric: past 1 000 entries new ids shared a bucket.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let table = if store.is_some() { "denials" } else { "memory" };
    the_client_table_stopped_at_its_cap(&client, admin, table).await;
}

#[tokio::test]
async fn unique_client_ids_do_not_grow_the_memory_store() {
    hostile_ids_leave_memory_flat(None).await;
}

#[tokio::test]
async fn unique_client_ids_do_not_grow_the_redis_stores_remembered_denials() {
    let redis = TestRedis::start().await;
    hostile_ids_leave_memory_flat(Some((&redis, unique_prefix("hostile-memory")))).await;
}

#[tokio::test]
async fn client_ids_past_max_client_id_are_refused_by_default() {
    let up = Upstream::start().await;
    let toml = Config::new()
        .route(
            Route::new("api")
                .upstream(&up.url())
                .client(r#"from = "header", name = "X-Api-Key""#)
                .limit("sliding_log", 3, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let at_cap = "k".repeat(256);
    let past = "k".repeat(257);
    let a = client.get(&gate.url("/"), &[("x-api-key", &at_cap)]).await;
    assert_eq!(a.status, 200);
    let a = client.get(&gate.url("/"), &[("x-api-key", &past)]).await;
    assert_eq!(a.status, 400);
    assert!(a.text().contains("longer than 256 bytes"), "{}", a.text());
    assert_eq!(up.hits(), 1);
}

// === one meaning for a request ===

/// Sends one raw HTTP/1.1 request on its own connection and returns the
/// status code of the answer.
async fn raw_status(gate: &Floodgate, request: &str) -> u16 {
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    s.write_all(request.as_bytes()).await.expect("write");
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .expect("an answer, not silence")
        .expect("read");
    let text = String::from_utf8_lossy(&buf[..n]);
    text.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"))
}

/// The path as the laxest upstream reads it: `%2F`, `%5C` and `\` as `/`
/// (unless `slashes_kept`: an upstream that keeps them, as the operator
/// says with `escaped_slashes = "keep"`), `;parameters` dropped, case
/// folded, dot segments resolved.
fn lax_path(target: &str, slashes_kept: bool) -> String {
    let path = target.split('?').next().unwrap_or_default();
    let decoded = if slashes_kept {
        path.to_ascii_lowercase()
    } else {
        path.replace("%2F", "/")
            .replace("%2f", "/")
            .replace("%5C", "/")
            .replace("%5c", "/")
            .replace('\\', "/")
            .to_ascii_lowercase()
    };
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment.split(';').next().unwrap_or_default() {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    format!("/{}", segments.join("/"))
}

/// Under the `/search` prefix, read laxly.
fn reaches_search(seen: &Seen, slashes_kept: bool) -> bool {
    let path = lax_path(&seen.target, slashes_kept);
    path == "/search" || path.starts_with("/search/")
}

/// A gate with `/search` (prefix), `/login` (exact) and POST `/orders`
/// limited to 3 a minute, and everything else unlimited, all forwarded to
/// `up`; `server` and `search` add lines to `[server]` and the search route.
async fn gate_with_limits(up: &Upstream, server: &[&str], search_match: &str) -> Floodgate {
    let mut config = Config::new()
        .route(
            Route::new("search")
                .upstream(&up.url())
                .matching(search_match)
                .limit("sliding_log", 3, "60s"),
        )
        .route(
            Route::new("login")
                .upstream(&up.url())
                .matching(r#"path = "/login""#)
                .limit("sliding_log", 3, "60s"),
        )
        .route(
            Route::new("orders")
                .upstream(&up.url())
                .matching(r#"path_prefix = "/orders", methods = ["POST"]"#)
                .limit("sliding_log", 3, "60s"),
        )
        .route(
            Route::new("rest")
                .upstream(&up.url())
                .matching(r#"path_prefix = "/""#),
        );
    for line in server {
        config = config.server(line);
    }
    Floodgate::start(&config.toml()).await
}

/// Sends `request_line`'s request six times; returns the statuses.
async fn six_times(gate: &Floodgate, method: &str, target: &str) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..6 {
        let request =
            format!("{method} {target} HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n");
        statuses.push(raw_status(gate, &request).await);
    }
    statuses
}

#[tokio::test]
async fn no_path_spelling_gets_more_than_the_limit_to_a_limited_upstream_path() {
    let tricks = [
        "/search/q%2F..%2F..%2F",
        "/search/q%5C..%5C..%5C",
        "/search/q\\..\\..\\",
        "/public%2F..%2Fsearch",
        "/public\\..\\search",
        "/search;v=1",
        "/public/..;/search",
        "/SEARCH/q",
    ];
    for escaped in ["reject", "decode", "keep"] {
        let setting = format!("escaped_slashes = \"{escaped}\"");
        for trick in tricks {
            let up = Upstream::start().await;
            let gate = gate_with_limits(
                &up,
                &[&setting],
                r#"path_prefix = "/search", ignore_case = true"#,
            )
            .await;
            let statuses = six_times(&gate, "GET", trick).await;
            let seen = up.seen();
            let kept = escaped == "keep";
            let on_search = seen.iter().filter(|s| reaches_search(s, kept)).count();
            assert!(
                on_search <= 3,
                "{escaped}: {trick} reached /search {on_search} times: {statuses:?} {seen:?}"
            );
            // What reached the upstream is the path that was counted.
            for s in &seen {
                let counted_on_search = on_search > 0;
                assert_eq!(
                    reaches_search(s, kept),
                    counted_on_search,
                    "{escaped}: {trick} -> {}",
                    s.target
                );
            }
            if escaped == "reject" && (trick.contains('%') || trick.contains('\\')) {
                assert_eq!(statuses, [400; 6], "{trick}");
            }
        }
    }
}

#[tokio::test]
async fn escaped_slashes_are_forwarded_as_they_were_matched() {
    // decode: the upstream gets the decoded, normalised path that matched.
    let up = Upstream::start().await;
    let gate = gate_with_limits(
        &up,
        &["escaped_slashes = \"decode\""],
        r#"path_prefix = "/search""#,
    )
    .await;
    assert_eq!(
        six_times(&gate, "GET", "/public%2F..%2Fsearch").await,
        [200, 200, 200, 429, 429, 429]
    );
    assert!(
        up.seen().iter().all(|s| s.target == "/search"),
        "{:?}",
        up.seen()
    );
    // keep: `%2F` is a plain character on both sides.
    let up = Upstream::start().await;
    let gate = gate_with_limits(
        &up,
        &["escaped_slashes = \"keep\""],
        r#"path_prefix = "/search""#,
    )
    .await;
    assert_eq!(
        six_times(&gate, "GET", "/search/a%2fb").await,
        [200, 200, 200, 429, 429, 429]
    );
    assert!(
        up.seen().iter().all(|s| s.target == "/search/a%2Fb"),
        "{:?}",
        up.seen()
    );
}

#[tokio::test]
async fn case_and_parameters_of_a_path_meet_the_route_that_ignores_them() {
    // Without ignore_case, /SEARCH is another path, as it is to most servers.
    let up = Upstream::start().await;
    let gate = gate_with_limits(&up, &[], r#"path_prefix = "/search""#).await;
    assert_eq!(six_times(&gate, "GET", "/SEARCH/q").await, [200; 6]);
    assert_eq!(
        six_times(&gate, "GET", "/search;v=1").await,
        [200, 200, 200, 429, 429, 429]
    );
    let up = Upstream::start().await;
    let gate = gate_with_limits(&up, &[], r#"path_prefix = "/search", ignore_case = true"#).await;
    assert_eq!(
        six_times(&gate, "GET", "/SEARCH/q").await,
        [200, 200, 200, 429, 429, 429]
    );
}

#[tokio::test]
async fn trailing_slash_and_dot_variants_meet_an_exact_route() {
    for variant in ["/login/", "/login/.", "/login;x=1", "/LOGIN"] {
        let up = Upstream::start().await;
        let gate = gate_with_limits(&up, &[], r#"path_prefix = "/search""#).await;
        let statuses = six_times(&gate, "GET", variant).await;
        let on_login = up
            .seen()
            .iter()
            .filter(|s| lax_path(&s.target, false) == "/login")
            .count();
        if variant == "/LOGIN" {
            // A case-sensitive route: /LOGIN is not /login, and is forwarded as sent.
            assert!(
                up.seen().iter().all(|s| s.target == "/LOGIN"),
                "{:?}",
                up.seen()
            );
            continue;
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429, 429], "{variant}");
        assert_eq!(on_login, 3, "{variant}");
    }
}

#[tokio::test]
async fn miscased_methods_are_refused_unless_the_route_ignores_case() {
    let up = Upstream::start().await;
    let gate = gate_with_limits(&up, &[], r#"path_prefix = "/search""#).await;
    for method in ["post", "PoSt", "Post"] {
        assert_eq!(
            six_times(&gate, method, "/orders").await,
            [400; 6],
            "{method}"
        );
    }
    // Other methods, and other spellings of non-standard ones, pass.
    assert_eq!(six_times(&gate, "PURGE", "/x").await, [200; 6]);
    assert_eq!(six_times(&gate, "purge", "/x").await, [200; 6]);
    assert!(
        up.seen()
            .iter()
            .all(|s| s.method.eq_ignore_ascii_case("purge")),
        "{:?}",
        up.seen()
    );

    // A route that ignores case counts every spelling on the one limit.
    let toml = Config::new()
        .route(
            Route::new("orders")
                .upstream(&up.url())
                .matching(r#"path_prefix = "/orders", methods = ["POST"], ignore_case = true"#)
                .limit("sliding_log", 3, "60s"),
        )
        .toml();
    let gate = Floodgate::start(&toml).await;
    let mut statuses = Vec::new();
    for method in ["POST", "post", "PoSt", "POST", "post", "pOST"] {
        let request = format!("{method} /orders HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n");
        statuses.push(raw_status(&gate, &request).await);
    }
    assert_eq!(statuses, [200, 200, 200, 429, 429, 429]);
}

/// A gate limiting `X-Api-Key` clients to 3 a minute with `repeated` as
/// given (absent: the default).
async fn keyed_gate(up: &Upstream, repeated: Option<&str>) -> Floodgate {
    let client = match repeated {
        Some(r) => format!(r#"from = "header", name = "X-Api-Key", repeated = "{r}""#),
        None => r#"from = "header", name = "X-Api-Key""#.to_owned(),
    };
    let toml = Config::new()
        .route(
            Route::new("api")
                .upstream(&up.url())
                .client(&client)
                .limit("sliding_log", 3, "60s"),
        )
        .toml();
    Floodgate::start(&toml).await
}

#[tokio::test]
async fn a_client_header_counts_one_value_and_forwards_that_value_alone() {
    let attempts = |i: usize| {
        [
            format!("X-Api-Key: victim\r\nX-Api-Key: throwaway-{i}\r\n"),
            format!("X-Api-Key: throwaway-{i}\r\nX-Api-Key: victim\r\n"),
            format!("X-Api-Key: victim, throwaway-{i}\r\n"),
            format!("X-Api-Key: throwaway-{i}, victim\r\n"),
        ]
    };
    for repeated in [None, Some("reject"), Some("first"), Some("last")] {
        for shape in 0..4 {
            let up = Upstream::start().await;
            let gate = keyed_gate(&up, repeated).await;
            let mut statuses = Vec::new();
            for i in 0..6 {
                let headers = &attempts(i)[shape];
                let request =
                    format!("GET / HTTP/1.1\r\nHost: a\r\n{headers}Connection: close\r\n\r\n");
                statuses.push(raw_status(&gate, &request).await);
            }
            let seen = up.seen();
            // Each forwarded request carries exactly one value: the one counted.
            for s in &seen {
                let values: Vec<_> = s.headers.get_all("x-api-key").iter().collect();
                assert_eq!(values.len(), 1, "{repeated:?} {shape}: {values:?}");
                assert!(!values[0].as_bytes().contains(&b','), "{values:?}");
            }
            let as_victim = seen
                .iter()
                .filter(|s| s.headers.get("x-api-key").is_some_and(|v| v == "victim"))
                .count();
            assert!(
                as_victim <= 3,
                "{repeated:?} {shape}: victim reached {as_victim} times"
            );
            // Shapes 0 and 2 send the victim's key first, 1 and 3 last.
            let victim_chosen = match repeated {
                None | Some("reject") => {
                    assert_eq!(statuses, [400; 6], "{shape}");
                    assert!(seen.is_empty(), "{shape}: {seen:?}");
                    continue;
                }
                Some("first") => shape % 2 == 0,
                _ => shape % 2 == 1,
            };
            for (i, s) in seen.iter().enumerate() {
                let want = if victim_chosen {
                    "victim".to_owned()
                } else {
                    format!("throwaway-{i}")
                };
                assert_eq!(
                    s.headers.get("x-api-key").map(|v| v.as_bytes()),
                    Some(want.as_bytes()),
                    "{repeated:?} {shape}"
                );
            }
            // Counted as the victim: three, then denied; counted as a fresh
            // throwaway key each time: all admitted.
            let want: &[u16] = if victim_chosen {
                &[200, 200, 200, 429, 429, 429]
            } else {
                &[200; 6]
            };
            assert_eq!(statuses, want, "{repeated:?} {shape}");
        }
    }
}

#[tokio::test]
async fn hosts_that_are_missing_repeated_or_malformed_are_refused() {
    let up = Upstream::start().await;
    let gate = gate_with_limits(&up, &[], r#"path_prefix = "/search""#).await;
    for (request, want) in [
        ("GET / HTTP/1.1\r\n\r\n", 400),
        ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
        ("GET / HTTP/1.1\r\nHost: a b\r\n\r\n", 400),
        ("GET / HTTP/1.1\r\nHost: a/b\r\n\r\n", 400),
        ("GET / HTTP/1.1\r\nHost: user@a\r\n\r\n", 400),
        ("GET http://user:pw@a/ HTTP/1.1\r\nHost: a\r\n\r\n", 400),
        ("CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", 405),
        ("GET / HTTP/1.1\r\nHost: api.example.com:8080\r\n\r\n", 200),
        ("GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n", 200),
        ("GET / HTTP/1.0\r\n\r\n", 200),
        ("GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n", 200),
    ] {
        assert_eq!(raw_status(&gate, request).await, want, "{request:?}");
    }
    // The four well-formed ones, each with the host it named.
    let forwarded_hosts: Vec<Option<String>> = up
        .seen()
        .iter()
        .map(|s| {
            s.headers
                .get("x-forwarded-host")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        })
        .collect();
    assert_eq!(
        forwarded_hosts,
        [
            Some("api.example.com:8080".to_owned()),
            Some("[::1]:8080".to_owned()),
            None,
            Some("a".to_owned()),
        ]
    );
}
