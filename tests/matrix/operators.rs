//! What clients and operators read and change: a client's standing, and
//! operators' credits, debits and resets.

use super::{Bed, Gates, fields, post};
use crate::support::config::Route;
use crate::support::{Answer, TestClient, temp_dir};

/// The `remaining` of each limit in one route's standing.
fn remaining(route: &serde_json::Value) -> Vec<u64> {
    route["limits"]
        .as_array()
        .map(|limits| {
            limits
                .iter()
                .filter_map(|l| l["remaining"].as_u64())
                .collect()
        })
        .unwrap_or_default()
}

fn json(answer: &Answer) -> serde_json::Value {
    assert_eq!(answer.status, 200, "{}", answer.text());
    serde_json::from_str(&answer.text()).expect("a JSON answer")
}

/// A client reads its standing on `/rate_limit` (10 a day, 4 an hour):
/// after three requests, 7 and 1 are left; reading again, as often as it
/// likes, costs nothing, and the next request counts from there.
pub async fn a_client_reads_its_standing_for_nothing(bed: &Bed) {
    let toml = bed
        .config("matrix-standing")
        .route(
            Route::new("rate_limit")
                .matching(r#"path = "/rate_limit""#)
                .standing(&["chat"]),
        )
        .route(
            Route::new("chat")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key", missing = "reject""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 10, window = "day" }"#)
                .limits(r#"{ algorithm = "sliding_log", limit = 4, window = "1h" }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let key = [("x-key", "alice")];
    for i in 0..3 {
        assert_eq!(http.get(&gates.url(i, "/chat"), &key).await.status, 200);
    }
    for i in 0..4 {
        let standing = json(&http.get(&gates.url(i, "/rate_limit"), &key).await);
        let route = &standing["routes"][0];
        assert_eq!(route["route"], "chat");
        assert_eq!(remaining(route), [7, 1], "reading {i}");
    }
    let next = http.get(&gates.url(1, "/chat"), &key).await;
    assert_eq!((next.status.as_u16(), fields(&next).1), (200, 0));
    let other = json(
        &http
            .get(&gates.url(0, "/rate_limit"), &[("x-key", "bob")])
            .await,
    );
    assert_eq!(
        remaining(&other["routes"][0]),
        [10, 4],
        "bob's own standing"
    );
}

/// The bearer token operators present on the admin listener.
pub(super) const TOKEN: &str = "0123456789abcdef0123456789abcdef";

const ALICE: &str = r#""route": "chat", "client": { "headers": { "x-key": "alice" } }"#;

/// An operator's change on instance `i`: the standing before and after.
pub(super) async fn change(gates: &Gates, i: usize, action: &str, body: &str) -> serde_json::Value {
    let bearer = format!("Bearer {TOKEN}");
    let headers = [("authorization", bearer.as_str()), ("x-operator", "dana")];
    let answer = post(
        &gates.admin_url(i, &format!("/clients/{action}")),
        &headers,
        body,
    )
    .await;
    json(&answer)
}

/// Alice (10 a day, 6 an hour) spends her hour through both instances,
/// and both refuse her (remembering it). A credit of 3 in the hour
/// through one instance admits exactly 3 more, on the other at once; a
/// debit takes the day's last unit; a reset makes her whole on both; a
/// credit on the day's fixed window grants past its number.
pub async fn credit_debit_and_reset_change_the_next_decision_everywhere(bed: &Bed) {
    let dir = temp_dir("matrix-operators");
    std::fs::write(dir.join("admin-token"), format!("{TOKEN}\n")).expect("write the token");
    let toml = bed
        .config("matrix-operators")
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("admin-token").display()
        ))
        .route(
            Route::new("chat")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Key", missing = "reject""#)
                .limits(r#"{ algorithm = "fixed_window", limit = 10, window = "day" }"#)
                .limits(r#"{ algorithm = "sliding_window", limit = 6, window = "1h" }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let ask = async |i: usize| http.get(&gates.url(i, "/"), &[("x-key", "alice")]).await;
    for i in 0..6 {
        assert_eq!(ask(i).await.status, 200, "request {i}");
    }
    assert_eq!(ask(0).await.status, 429);
    assert_eq!(ask(1).await.status, 429);
    let credit = format!(r#"{{ {ALICE}, "limit": "chat.2", "units": 3, "reason": "ticket 42" }}"#);
    let credited = change(&gates, 0, "credit", &credit).await;
    assert_eq!(remaining(&credited["before"]), [4, 0]);
    assert_eq!(remaining(&credited["after"]), [4, 3]);
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for i in 0..6 {
            out.push(ask(1 - i % 2).await.status.as_u16());
        }
        out
    };
    assert_eq!(
        statuses,
        [200, 200, 200, 429, 429, 429],
        "a credit of 3, at once on the other instance"
    );
    let debit = format!(r#"{{ {ALICE}, "limit": "chat.1", "units": 1, "reason": "abuse" }}"#);
    let debited = change(&gates, 1, "debit", &debit).await;
    assert_eq!(remaining(&debited["after"]), [0, 0]);
    assert_eq!(ask(0).await.status, 429);
    let reset = format!(r#"{{ {ALICE}, "reason": "new contract" }}"#);
    change(&gates, 0, "reset", &reset).await;
    let first = ask(1).await;
    assert_eq!((first.status.as_u16(), fields(&first).1), (200, 5));
    let second = ask(0).await;
    assert_eq!((second.status.as_u16(), fields(&second).1), (200, 4));
    let grant = format!(r#"{{ {ALICE}, "limit": "chat.1", "units": 5, "reason": "goodwill" }}"#);
    let granted = change(&gates, 1, "credit", &grant).await;
    assert_eq!(remaining(&granted["before"]), [8, 4]);
    assert_eq!(remaining(&granted["after"]), [13, 4]);
    let _ = std::fs::remove_dir_all(dir);
}
