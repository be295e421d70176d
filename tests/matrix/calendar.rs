//! Calendar windows and the export of closed ones.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::{Bed, Gates, fields, reporting_upstream};
use crate::support::TestClient;
use crate::support::config::Route;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whole seconds from `from` (ms) to `to` (ms), rounded up, as `t` and
/// `Retry-After` are.
fn seconds_between(from: u64, to: u64) -> u64 {
    to.saturating_sub(from).div_ceil(1000)
}

/// Three requests a UTC calendar day per key: `t` is the seconds to
/// midnight, and the fourth is refused on every instance until then.
pub async fn a_day_quota_counts_to_midnight_on_every_instance(bed: &Bed) {
    let toml = bed
        .config("matrix-day")
        .route(
            Route::new("daily")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 3, window = "day", time_zone = "UTC" }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let key = [("x-key", "day-client")];
    let before = now_ms();
    let midnight = before - before % 86_400_000 + 86_400_000;
    let mut answers = Vec::new();
    for i in 0..5 {
        answers.push(http.get(&gates.url(i, "/"), &key).await);
    }
    let after = now_ms();
    if after >= midnight - 5_000 {
        return; // a day's last seconds: the boundary is another scenario's
    }
    let (least, most) = (
        seconds_between(after, midnight),
        seconds_between(before, midnight),
    );
    for (i, answer) in answers.iter().enumerate() {
        let (_, r, t) = fields(answer);
        let status = if i < 3 { 200 } else { 429 };
        assert_eq!(answer.status, status, "request {i}");
        assert_eq!(r, 2u64.saturating_sub(i as u64), "request {i}");
        assert!(
            (least..=most).contains(&t),
            "request {i}: t={t}, want {least}..={most}"
        );
    }
    let wait: u64 = answers[4]
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    assert!((least..=most).contains(&wait), "Retry-After {wait}");
}

/// Waits, if need be, until early in a calendar minute; the minute's end.
async fn early_in_a_minute(latest_second: u64) -> u64 {
    let second = now_ms() % 60_000;
    if !(1_000..=latest_second * 1_000).contains(&second) {
        tokio::time::sleep(Duration::from_millis(61_000 - second)).await;
    }
    let now = now_ms();
    now - now % 60_000 + 60_000
}

/// Five requests a calendar minute from one client through both
/// instances: the five are admitted with `r` counting down, the sixth is
/// refused on both, and once the minute has turned both admit again,
/// counting from the limit.
pub async fn a_minute_quota_resets_at_its_boundary(bed: &Bed) {
    let toml = bed
        .config("matrix-minute")
        .route(
            Route::new("quota")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 5, window = "minute", time_zone = "Europe/Berlin" }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    for attempt in 0..3 {
        let end = early_in_a_minute(40).await;
        let key = format!("client-{attempt}");
        let headers = [("x-key", key.as_str())];
        let mut statuses = Vec::new();
        for i in 0..7 {
            let answer = http.get(&gates.url(i, "/"), &headers).await;
            statuses.push((answer.status.as_u16(), fields(&answer).1));
        }
        if now_ms() + 1_000 >= end {
            continue; // straddled the minute's end on a slow machine
        }
        let want = [
            (200, 4),
            (200, 3),
            (200, 2),
            (200, 1),
            (200, 0),
            (429, 0),
            (429, 0),
        ];
        assert_eq!(statuses, want);
        tokio::time::sleep(Duration::from_millis(end + 100 - now_ms())).await;
        let first = http.get(&gates.url(1, "/"), &headers).await;
        assert_eq!((first.status.as_u16(), fields(&first).1), (200, 4));
        let second = http.get(&gates.url(0, "/"), &headers).await;
        assert_eq!((second.status.as_u16(), fields(&second).1), (200, 3));
        return;
    }
    panic!("three rounds straddled a minute's end");
}

/// A client's id as keys and exports write it (no `id_secret`).
fn export_id(key: &str) -> String {
    let mut id = String::new();
    floodgate::limit::redis::write_client(
        &mut id,
        &floodgate::client::ClientId::header(key),
        &floodgate::limit::redis::IdKey::new(None),
    );
    id
}

/// Each client's metered requests in one minute: the units the upstream
/// reports for each (c1's last reports more than it reserved).
const SCRIPT: [(&str, &[u64]); 4] = [
    ("c0", &[3, 7]),
    ("c1", &[1, 1, 1, 15]),
    ("c2", &[9]),
    ("c3", &[2, 2, 2, 2, 2]),
];

/// Sends `SCRIPT` through the instances in turn, each client under its
/// key for `attempt`.
async fn send_the_script(http: &TestClient, gates: &Gates, attempt: usize) {
    let mut n = 0;
    for (client, units) in SCRIPT {
        for u in units {
            let answer = http
                .get(
                    &gates.url(n, &format!("/?units={u}")),
                    &[("x-key", &format!("{client}-{attempt}"))],
                )
                .await;
            assert_eq!(answer.status, 200);
            n += 1;
        }
    }
}

/// Metered clients counted per calendar minute, through the instances:
/// once the minute has turned (two of them back in the next), the closed
/// minute's export has one line per client holding exactly the units the
/// upstream reported for it, and the heaviest client of the new minute
/// is listed.
pub async fn the_export_of_closed_windows_equals_the_settled_units(bed: &Bed) {
    let upstream = reporting_upstream().await;
    let toml = bed
        .config("matrix-export")
        .admin()
        .route(
            Route::new("api")
                .upstream(&upstream)
                .client(r#"from = "header", name = "X-Key""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 100000, window = "minute" }"#)
                .line(r#"usage = { reserve = 10, report = "header", units = { "x-units" = 1 } }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    for attempt in 0..3 {
        let end = early_in_a_minute(35).await;
        let window_start = end - 60_000;
        send_the_script(&http, &gates, attempt).await;
        if now_ms() >= end - 1_000 {
            continue;
        }
        tokio::time::sleep(Duration::from_millis(end + 100 - now_ms())).await;
        let key = |client: &str| format!("{client}-{attempt}");
        for (client, u) in [("c0", 4), ("c1", 6)] {
            let answer = http
                .get(
                    &gates.url(1, &format!("/?units={u}")),
                    &[("x-key", &key(client))],
                )
                .await;
            assert_eq!(answer.status, 200);
        }
        the_closed_minute_holds_each_clients_units(&http, &gates, window_start, attempt).await;
        let top = http
            .get(
                &gates.admin_url(1, "/usage/top?route=api&limit=api&n=1"),
                &[],
            )
            .await;
        let top: serde_json::Value = serde_json::from_str(&top.text()).expect("json");
        let clients = top["clients"].as_array().expect("clients");
        assert_eq!(clients.len(), 1, "{top}");
        assert_eq!(clients[0]["client"], export_id(&key("c1")).as_str());
        assert_eq!(clients[0]["units"], 6);
        return;
    }
    panic!("three rounds straddled a minute's end");
}

/// The closed minute starting at `window_start` is exported with one line
/// per client of `attempt`, holding exactly the units reported for it.
async fn the_closed_minute_holds_each_clients_units(
    http: &TestClient,
    gates: &Gates,
    window_start: u64,
    attempt: usize,
) {
    let closed = http
        .get(
            &gates.admin_url(0, "/usage/closed?route=api&limit=api"),
            &[],
        )
        .await;
    assert_eq!(closed.status, 200, "{}", closed.text());
    assert_eq!(closed.header("content-type"), Some("application/x-ndjson"));
    let lines: Vec<serde_json::Value> = closed
        .text()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .filter(|l: &serde_json::Value| l["window_start"] == window_start)
        .collect();
    for (client, units) in SCRIPT {
        let id = export_id(&format!("{client}-{attempt}"));
        let mine: Vec<&serde_json::Value> = lines
            .iter()
            .filter(|l| l["client"] == id.as_str())
            .collect();
        assert_eq!(mine.len(), 1, "{client}: {lines:?}");
        assert_eq!(mine[0]["units"], units.iter().sum::<u64>(), "{client}");
        assert_eq!(mine[0]["window_end"], window_start + 60_000);
        assert_eq!(mine[0]["scope"], "api");
    }
}
