//! Penalties that outlast a limit's window.

use std::time::{Duration, Instant};

use super::answers::login_upstream;
use super::operators::{TOKEN, change};
use super::{Bed, Gates};
use crate::support::config::Route;
use crate::support::load::metric_where;
use crate::support::{Answer, TestClient, temp_dir};

/// A login of `user` with `password` through instance `i`.
async fn login(gates: &Gates, i: usize, user: &str, password: &str) -> Answer {
    TestClient::http1()
        .get(
            &gates.url(i, "/login"),
            &[("x-user", user), ("x-password", password)],
        )
        .await
}

/// Instance `i` lists one penalty in force: mal's second, under the
/// login limit, a few seconds left, under a digest of his key.
async fn one_penalty_is_listed(gates: &Gates, i: usize) {
    let listed = penalties(gates, i).await;
    let [one] = &listed[..] else {
        panic!("one penalty in force: {listed:?}");
    };
    assert_eq!(
        (&one["route"], &one["limit"], &one["offences"]),
        (&"login".into(), &"login".into(), &2.into()),
        "{one}"
    );
    let left = one["ends_in_seconds"].as_u64().unwrap_or(0);
    assert!((1..=20).contains(&left), "{one}");
    assert!(
        one["client"].as_str().is_some_and(|c| c.starts_with("k:")),
        "a keyed digest, not the value: {one}"
    );
}

/// The lift wrote one audit line: the operator who asked (the admin
/// token's name: a one-line token file's is `admin`), on whose behalf
/// (their `X-Operator`) and the peer they asked from, the action, the route, the reason, the client by a
/// digest of its key (never the key), and its standing before and after.
fn lift_is_audited(reason: &str) {
    let lines: Vec<String> = crate::support::audit_lines()
        .into_iter()
        .filter(|l| l.contains(reason))
        .collect();
    let [line] = &lines[..] else {
        panic!("one audit line for the lift: {lines:#?}");
    };
    for field in [
        "operator=admin",
        "on_behalf=dana",
        "peer=127.0.0.1",
        "action=lift",
        "route=login",
        "x-user=sha256:",
        "before=",
        "after=",
    ] {
        assert!(line.contains(field), "{field} in the audit line: {line}");
    }
    assert!(
        !line.contains("x-user=mal"),
        "the client's key in the audit line: {line}"
    );
}

/// The penalties in force, as instance `i`'s admin listener lists them.
async fn penalties(gates: &Gates, i: usize) -> Vec<serde_json::Value> {
    let answer = TestClient::http1()
        .get(&gates.admin_url(i, "/penalties"), &[])
        .await;
    assert_eq!(answer.status, 200, "{}", answer.text());
    let listed: serde_json::Value = serde_json::from_str(&answer.text()).expect("JSON");
    listed["penalties"].as_array().cloned().unwrap_or_default()
}

/// `Retry-After` in seconds.
fn retry_after(answer: &Answer) -> u64 {
    answer
        .header("retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// 5 failed logins per 2 s per user, counting only the answers 401, with
/// a penalty of 10 s, doubling for a repeat offender: mal's sixth guess
/// starts the penalty (`Retry-After: 10`), on both instances; 2.5 s on,
/// his failures have left the window but he is still refused, the right
/// password too; once the penalty is over he logs in. Five more failures
/// and the sixth starts a penalty of 20 s, listed for operators (his
/// second offence, under a digest of his key); an operator lifts it on
/// one instance, and the other admits him at once. The upstream saw exactly
/// his ten failures and two logins.
pub async fn a_penalty_outlasts_the_window_and_doubles_for_a_repeat_offender(bed: &Bed) {
    let (upstream, seen) = login_upstream().await;
    let dir = temp_dir("matrix-penalties");
    std::fs::write(dir.join("admin-token"), format!("{TOKEN}\n")).expect("write the token");
    let route = Route::new("login")
        .upstream(&upstream)
        .client(r#"from = "header", name = "X-User", missing = "reject""#)
        .limits(r#"{ algorithm = "sliding_log", limit = 5, window = "2s", count_when = { status = [401] }, penalty = { duration = "10s", factor = 2, forget = "1m" } }"#);
    let toml = bed
        .config("matrix-penalties")
        .admin()
        .server(&format!(
            r#"admin_token_file = "{}""#,
            dir.join("admin-token").display()
        ))
        .route(route)
        .toml();
    let gates = bed.instances(&toml).await;
    let offend = async || {
        for i in 0..5 {
            assert_eq!(
                login(&gates, i, "mal", "guess").await.status,
                401,
                "guess {i}"
            );
        }
        let sixth = login(&gates, 5, "mal", "guess").await;
        let at = Instant::now();
        assert_eq!(sixth.status, 429);
        (retry_after(&sixth), at)
    };
    let (penalty, started) = offend().await;
    assert_eq!(penalty, 10, "the first penalty");
    let other = login(&gates, 6, "mal", "right").await;
    assert_eq!(other.status, 429, "the other instance knows the penalty");
    assert!((1..=10).contains(&retry_after(&other)));
    tokio::time::sleep(Duration::from_millis(2_500).saturating_sub(started.elapsed())).await;
    let later = login(&gates, 7, "mal", "right").await;
    assert_eq!(later.status, 429, "the window passed; the penalty did not");
    let waited = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    assert!(retry_after(&later) >= 10_000u64.saturating_sub(waited).div_ceil(1000));
    tokio::time::sleep(Duration::from_millis(10_200).saturating_sub(started.elapsed())).await;
    assert_eq!(login(&gates, 8, "mal", "right").await.status, 200, "served");
    let (penalty, started) = offend().await;
    assert_eq!(penalty, 20, "a repeat offender's penalty doubles");
    // The lift is tried once his failures have left the window, so that
    // the limit itself would admit him.
    tokio::time::sleep(Duration::from_millis(2_200).saturating_sub(started.elapsed())).await;
    assert_eq!(login(&gates, 1, "mal", "right").await.status, 429);
    one_penalty_is_listed(&gates, 1).await;
    // The reason names this bed, so that its audit line is told apart
    // from another store's in this test binary.
    let reason = format!("a locked-out user called ({:?})", bed.store);
    let lift = format!(
        r#"{{ "route": "login", "client": {{ "headers": {{ "x-user": "mal" }} }}, "reason": "{reason}" }}"#
    );
    change(&gates, 0, "lift", &lift).await;
    lift_is_audited(&reason);
    assert_eq!(
        login(&gates, 1, "mal", "right").await.status,
        200,
        "lifted on one instance, admitted on the other"
    );
    assert!(
        penalties(&gates, 0).await.is_empty(),
        "none in force once lifted"
    );
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.get("mal"), Some(&(2, 10)));
    // Five refusals under the penalty's limit, each counted where it was
    // answered: the two offences, and three while a penalty ran.
    let mut counted = 0.0;
    for i in 0..gates.count() {
        let text = TestClient::http1()
            .get(&gates.admin_url(i, "/metrics"), &[])
            .await
            .text();
        counted += metric_where(
            &text,
            "floodgate_penalty_refusals_total",
            &[r#"route="login""#],
        );
    }
    assert_eq!(counted, 5.0);
    let _ = std::fs::remove_dir_all(dir);
}
