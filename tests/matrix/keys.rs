//! A key per limit, budgets and plans.

use super::{Bed, fields};
use crate::support::TestClient;
use crate::support::config::Route;

/// A user's limit (3 an hour) inside an organisation's (5) inside
/// everyone's (9), exact sliding logs.
fn nested() -> Route {
    Route::new("users")
        .respond("status = 200")
        .client(r#"from = "header", name = "X-User", missing = "reject""#)
        .limits(r#"{ algorithm = "sliding_log", limit = 3, window = "1h" }"#)
        .limits(r#"{ algorithm = "sliding_log", limit = 5, window = "1h", key = { from = "header", name = "X-Org", missing = "reject" } }"#)
        .limits(r#"{ algorithm = "sliding_log", limit = 9, window = "1h", key = { from = "global" } }"#)
}

/// A refused request takes nothing from any of its limits, whichever
/// refused it, through either instance: ann's fourth is refused by her
/// own limit and leaves her organisation two; bob takes them; cid of the
/// same organisation is refused by it, his own limit untouched, and
/// counts in another organisation at once; everyone's nine are exactly
/// the nine admitted (the two refused took none of them).
pub async fn a_refused_request_takes_nothing_from_the_other_limits(bed: &Bed) {
    let toml = bed.config("matrix-keys").route(nested()).toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    // Each request, and what it answers: status, the most constrained
    // limit and its remaining.
    let script = [
        ("ann", "acme", 200, "users.1", 2),
        ("ann", "acme", 200, "users.1", 1),
        ("ann", "acme", 200, "users.1", 0),
        ("ann", "acme", 429, "users.1", 0),
        ("bob", "acme", 200, "users.2", 1),
        ("bob", "acme", 200, "users.2", 0),
        ("cid", "acme", 429, "users.2", 0),
        ("cid", "zeta", 200, "users.1", 2),
        ("cid", "zeta", 200, "users.1", 1),
        ("cid", "zeta", 200, "users.1", 0),
        ("dan", "zeta", 200, "users.3", 0),
        ("eve", "yarn", 429, "users.3", 0),
    ];
    for (i, (user, org, status, policy, r)) in script.into_iter().enumerate() {
        let answer = http
            .get(&gates.url(i, "/"), &[("x-user", user), ("x-org", org)])
            .await;
        let (got_policy, got_r, _) = fields(&answer);
        assert_eq!(
            (answer.status.as_u16(), got_policy.as_str(), got_r),
            (status, policy, r),
            "request {i} ({user} of {org})"
        );
    }
}

/// `chat` (cost 1) and `images` (cost 5) draw on one budget of 1 000 an
/// hour per key; each answer tells the budget's remaining.
pub async fn routes_draw_on_one_budget_with_their_own_costs(bed: &Bed) {
    let toml = bed
        .config("matrix-budget")
        .route(
            Route::new("chat")
                .respond("status = 200")
                .matching(r#"path_prefix = "/chat""#)
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line(r#"budgets = ["tokens"]"#),
        )
        .route(
            Route::new("images")
                .respond("status = 200")
                .matching(r#"path_prefix = "/images""#)
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line("cost = 5")
                .line(r#"budgets = ["tokens"]"#),
        )
        .tables(
            r#"[budgets.tokens]
limits = [{ algorithm = "sliding_log", limit = 40, window = "1h" }]"#,
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let key = [("x-api-key", "team-a")];
    let mut left = 40;
    for i in 0..14 {
        let (path, cost) = if i % 2 == 0 {
            ("/chat", 1)
        } else {
            ("/images", 5)
        };
        let answer = http.get(&gates.url(i, path), &key).await;
        if cost <= left {
            left -= cost;
            assert_eq!(answer.status, 200, "request {i}");
            assert_eq!(
                fields(&answer),
                ("tokens".to_owned(), left, 3600),
                "request {i}"
            );
        } else {
            assert_eq!(answer.status, 429, "request {i}: {left} left, cost {cost}");
        }
    }
    assert_eq!(left, 3, "the model spent the budget to its last 3");
    // Another key has its own whole budget.
    let other = http
        .get(&gates.url(1, "/images"), &[("x-api-key", "team-b")])
        .await;
    assert_eq!(fields(&other), ("tokens".to_owned(), 35, 3600));
}

/// A plan's budget: 10 an hour on free, 30 on pro; the count carries over
/// when a client moves to pro.
pub async fn a_plan_gives_a_budget_its_number_and_the_count_carries_over(bed: &Bed) {
    let toml = bed
        .config("matrix-plans")
        .server(r#"trusted_proxies = ["127.0.0.1/32"]"#)
        .route(
            Route::new("api")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-Api-Key""#)
                .line(r#"budgets = ["calls"]"#)
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(
            r#"[budgets.calls]
limits = [{ algorithm = "sliding_log", limit = 10, window = "1h" }]

[plan_selection]
by = { from = "header", name = "X-Plan" }
default = "free"

[plans.free]

[plans.pro.budgets.calls]
limits = [{ algorithm = "sliding_log", limit = 30, window = "1h" }]"#,
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let mut statuses = Vec::new();
    for (i, plan) in ["free"; 12].into_iter().chain(["pro"; 22]).enumerate() {
        let answer = http
            .get(
                &gates.url(i, "/"),
                &[("x-api-key", "tenant"), ("x-plan", plan)],
            )
            .await;
        statuses.push(answer.status.as_u16());
        if i == 12 {
            assert_eq!(answer.status, 200, "the first on pro");
            assert_eq!(fields(&answer), ("calls".to_owned(), 19, 3600));
            assert_eq!(
                answer.header("ratelimit-policy"),
                Some("\"calls\";q=30;w=3600")
            );
        }
    }
    let admitted =
        |range: std::ops::Range<usize>| statuses[range].iter().filter(|s| **s == 200).count();
    assert_eq!(admitted(0..12), 10, "free: {statuses:?}");
    assert_eq!(
        admitted(12..34),
        20,
        "pro, the count carried over: {statuses:?}"
    );
}

/// A refused request reports both kinds of limit as the store holds them,
/// whichever part of a Cluster refused it and whichever was asked first:
/// 10 units an hour per user (cost 5) and 100 requests an hour for
/// everyone, in OpenAI's fields. Ann's third request is refused by her
/// units and reports the requests still left (98, nothing taken); Bob
/// then takes the 99th.
pub async fn a_refused_request_reports_both_kinds_as_they_stand(bed: &Bed) {
    let toml = bed
        .config("matrix-kinds")
        .route(
            Route::new("kinds")
                .respond("status = 200")
                .client(r#"from = "header", name = "X-User", missing = "reject""#)
                .line("cost = 5")
                .line(r#"rate_limit_headers = "openai""#)
                .limits(r#"{ algorithm = "sliding_log", limit = 10, window = "1h" }"#)
                .limits(r#"{ algorithm = "sliding_log", limit = 100, window = "1h", counts = "requests", key = { from = "global" } }"#),
        )
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let field = |answer: &crate::support::Answer, name: &str| {
        answer.header(name).unwrap_or("absent").to_owned()
    };
    let script = [
        ("ann", 200, "5", "99"),
        ("ann", 200, "0", "98"),
        ("ann", 429, "0", "98"),
        ("bob", 200, "5", "97"),
    ];
    for (i, (user, status, tokens, requests)) in script.into_iter().enumerate() {
        let answer = http.get(&gates.url(i, "/"), &[("x-user", user)]).await;
        let got = (
            answer.status.as_u16(),
            field(&answer, "x-ratelimit-remaining-tokens"),
            field(&answer, "x-ratelimit-remaining-requests"),
        );
        assert_eq!(
            got,
            (status, tokens.to_owned(), requests.to_owned()),
            "request {i} ({user})"
        );
    }
}
