//! Questions from other proxies: a front proxy's decisions and
//! settlements on the decision listener, and Envoy's rate limit service.

use serde_json::json;

use super::Bed;
use crate::support::config::Route;
use crate::support::front::{Raw, about_chat};
use crate::support::peers::client;
use crate::support::peers::edge::{call, org, user};

fn remaining(answer: &Raw) -> Option<u64> {
    answer
        .header("ratelimit")?
        .split(';')
        .find_map(|p| p.strip_prefix("r=")?.parse().ok())
}

/// A metered route only decided (1 000 units an hour per address, each
/// question reserving what it names): a reservation named back with the
/// units used is settled in its keys through either instance, and the
/// next decision on the other counts from there; a settlement without a
/// report is refused and the reservation stands.
pub async fn a_front_proxys_reservation_is_settled_by_name(bed: &Bed) {
    let toml = bed
        .config("matrix-decisions")
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .route(
            Route::new("chat")
                .decided_only()
                .matching(r#"path_prefix = "/chat""#)
                .limit("fixed_window", 1_000, "1h")
                .line(r#"usage = { reserve = 100, reserve_header = "x-max-units", max_reserve = 500, report = "header", units = { "x-units-used" = 1 } }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let port = |i: usize| gates.get(i).decisions.expect("a decision listener").port();
    let admitted = about_chat(port(0), &[("X-Max-Units", "300")]).await;
    assert_eq!(
        (admitted.status, remaining(&admitted)),
        (200, Some(700)),
        "{admitted:?}"
    );
    let token = admitted
        .header("floodgate-reservation")
        .unwrap_or_else(|| panic!("no reservation on {admitted:?}"))
        .to_owned();
    let settled = about_chat(
        port(1),
        &[("Floodgate-Settle", &token), ("X-Units-Used", "120")],
    )
    .await;
    assert_eq!(
        (settled.status, remaining(&settled)),
        (200, Some(880)),
        "{settled:?}"
    );
    let next = about_chat(port(0), &[("X-Max-Units", "1")]).await;
    assert_eq!(remaining(&next), Some(879), "{next:?}");
    let held = about_chat(port(1), &[("X-Max-Units", "200")]).await;
    let token = held
        .header("floodgate-reservation")
        .unwrap_or_default()
        .to_owned();
    let unreported = about_chat(port(0), &[("Floodgate-Settle", &token)]).await;
    assert_eq!(unreported.status, 422, "{unreported:?}");
    let after = about_chat(port(1), &[("X-Max-Units", "1")]).await;
    assert_eq!(remaining(&after), Some(678), "{after:?}");
    let most = about_chat(port(0), &[("X-Max-Units", "500")]).await;
    assert_eq!(
        (most.status, remaining(&most)),
        (200, Some(178)),
        "{most:?}"
    );
    let refused = about_chat(port(1), &[("X-Max-Units", "500")]).await;
    assert_eq!(refused.status, 429, "{refused:?}");
}

/// Envoy's rate limit service: a user's limit (3 an hour) and an
/// organisation's (5), decided all or nothing with each descriptor's
/// status, across both instances: a call one descriptor refuses takes
/// nothing from the other.
pub async fn envoys_descriptors_are_decided_all_or_nothing(bed: &Bed) {
    let toml = bed
        .config("matrix-rls")
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .route(
            Route::new("per-user")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["user"] }"#)
                .limit("sliding_log", 3, "1h"),
        )
        .route(
            Route::new("per-org")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["generic_key=api", "org"] }"#)
                .limit("sliding_log", 5, "1h"),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let calls = [
        vec![
            call(&[user("ann"), org("acme")]),
            call(&[user("ann"), org("acme")]),
        ],
        vec![
            call(&[user("ann"), org("acme")]),
            call(&[user("ann"), org("acme")]),
        ],
        vec![
            json!({ "domain": "edge", "hits_addend": 2, "descriptors": [user("bob"), org("acme")] }),
            call(&[user("cid"), org("acme")]),
        ],
    ];
    let mut answers = Vec::new();
    for (i, batch) in calls.iter().enumerate() {
        let target = gates
            .get(i)
            .decisions
            .expect("a decision listener")
            .to_string();
        answers.extend(
            client(
                "rls_peer.py",
                &[target, serde_json::to_string(batch).expect("json")],
            )
            .await,
        );
    }
    let seen: Vec<(String, u64, u64)> = answers
        .iter()
        .map(|a| {
            let r = |i: usize| a["statuses"][i]["remaining"].as_u64().unwrap_or(u64::MAX);
            (a["code"].as_str().unwrap_or("?").to_owned(), r(0), r(1))
        })
        .collect();
    let want = [
        ("OK", 2, 4),
        ("OK", 1, 3),
        ("OK", 0, 2),
        ("OVER_LIMIT", 0, 2),
        ("OK", 1, 0),
        ("OVER_LIMIT", 3, 0),
    ];
    let want: Vec<(String, u64, u64)> = want
        .iter()
        .map(|(c, a, b)| ((*c).to_owned(), *a, *b))
        .collect();
    assert_eq!(seen, want, "{answers:#?}");
}
