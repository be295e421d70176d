//! The key registry: keys made through one instance's admin API are
//! verified on every instance before anything is counted; their plan and
//! organisation come from the registry, not from the client; changes
//! reach every instance within a second; every change is audited in the
//! store with the token's name.

use std::time::{Duration, Instant};

use super::{Bed, Gates, Store};
use crate::support::config::{Config, Route};
use crate::support::{Answer, TestClient, temp_dir, text_body};

/// The admin token file's named tokens.
const ALICE_TOKEN: &str = "alice-0123456789abcdef0123456789";

/// A route selling a chat API: the key read as OpenAI's SDK sends it, the
/// plan and the organisation from the key's record; free 2 an hour, pro
/// 5, an organisation 6 whatever its members' plans.
pub fn registry_config(bed: &Bed, scenario: &str) -> Config {
    registry_config_with(bed, scenario, "")
}

/// [`registry_config`] with `keys_lines` added to `[keys]`.
pub fn registry_config_with(bed: &Bed, scenario: &str, keys_lines: &str) -> Config {
    let dir = temp_dir(scenario);
    let tokens = dir.join("admin-tokens");
    std::fs::write(
        &tokens,
        format!("alice {ALICE_TOKEN}\nbob bob-0123456789abcdef0123456789\n"),
    )
    .expect("write the tokens");
    let state = match bed.store {
        Store::Memory => format!(
            "state_file = {:?}\n",
            dir.join("keys.json").display().to_string()
        ),
        _ => String::new(),
    };
    bed.config(scenario)
        .admin()
        .server(&format!(r#"admin_token_file = "{}""#, tokens.display()))
        .route(
            Route::new("chat")
                .respond("status = 200")
                .line(r#"api_key = { from = "bearer" }"#)
                .line(r#"answers = "openai""#)
                .client(r#"from = "key""#)
                .line(r#"budgets = ["calls", "orgs"]"#)
                .line(r#"plans = ["free", "pro"]"#),
        )
        .tables(&format!(
            r#"[keys]
prefix = "sk-test-"
{state}{keys_lines}
[budgets.calls]
limits = [{{ algorithm = "sliding_log", limit = 2, window = "1h" }}]

[budgets.orgs]
limits = [{{ algorithm = "sliding_log", limit = 6, window = "1h", key = {{ from = "key", name = "org" }} }}]

[plan_selection]
by = {{ from = "key" }}
default = "free"

[plans.free]

[plans.pro.budgets.calls]
limits = [{{ algorithm = "sliding_log", limit = 5, window = "1h" }}]"#
        ))
}

/// An admin request to instance `i` as alice.
pub async fn admin(gates: &Gates, i: usize, method: &str, path: &str, body: &str) -> Answer {
    let request = http::Request::builder()
        .method(method)
        .uri(gates.admin_url(i, path))
        .header("authorization", format!("Bearer {ALICE_TOKEN}"))
        .header("content-type", "application/json")
        .body(text_body(body))
        .expect("a request");
    TestClient::http1().send(request).await
}

/// Makes a key through instance `i`: the key and its id.
pub async fn make_key(gates: &Gates, i: usize, body: &str) -> (String, String) {
    let made = admin(gates, i, "POST", "/keys", body).await;
    assert_eq!(made.status, 201, "{}", made.text());
    let json = made.json();
    let key = json["key"].as_str().expect("the key").to_owned();
    let id = json["record"]["id"].as_str().expect("its id").to_owned();
    assert!(key.starts_with("sk-test-") && key.len() == 8 + 32, "{key}");
    (key, id)
}

pub async fn chat(gates: &Gates, i: usize, headers: &[(&str, &str)]) -> Answer {
    TestClient::http1()
        .get(&gates.url(i, "/v1/chat"), headers)
        .await
}

/// Keys made on one instance work on the other; a missing, unknown or
/// made-up key is refused (401, OpenAI's `invalid_api_key`) before
/// anything counts; the plan and the organisation are the record's, and
/// nothing the client sends changes them; a disabled key is refused (403)
/// and a re-enabled one admitted on the other instance within a second;
/// a plan change keeps the usage; every change is in the audit, named by
/// the token that made it.
pub async fn keys_are_verified_before_anything_is_counted(bed: &Bed) {
    let toml = registry_config(bed, "matrix-registry").toml();
    let gates = bed.instances(&toml).await;
    let (gina, gina_id) = make_key(
        &gates,
        0,
        r#"{"identity": "gina", "plan": "pro", "attributes": {"org": "acme"}, "reason": "signed up"}"#,
    )
    .await;
    let (hal, hal_id) = make_key(
        &gates,
        0,
        r#"{"identity": "hal", "attributes": {"org": "acme"}, "reason": "signed up"}"#,
    )
    .await;
    let (ian, ian_id) = make_key(
        &gates,
        1,
        r#"{"identity": "ian", "attributes": {"org": "zeta"}, "reason": "signed up"}"#,
    )
    .await;
    let bearer = |key: &str| format!("Bearer {key}");
    refused_before_anything_counts(&gates).await;
    // Hal (free): 2 of the budget, the organisation's 6 has 4 left.
    let (hal_bearer, gina_bearer) = (bearer(&hal), bearer(&gina));
    plan_and_organisation_from_the_record(&gates, &hal_bearer, &gina_bearer).await;
    let ian_bearer = bearer(&ian);
    changes_reach_every_instance(&gates, &ian_bearer, &ian_id).await;

    // An unknown plan is refused; so is a change without a reason.
    let unknown = admin(
        &gates,
        0,
        "PATCH",
        &format!("/keys/{gina_id}"),
        r#"{"plan": "gold", "reason": "x"}"#,
    )
    .await;
    assert_eq!(unknown.status, 422, "{}", unknown.text());
    let no_reason = admin(
        &gates,
        0,
        "PATCH",
        &format!("/keys/{hal_id}"),
        r#"{"enabled": false}"#,
    )
    .await;
    assert_eq!(no_reason.status, 422);
    audited_with_the_tokens_name(&gates, &ian).await;
}

/// A made-up key, and none, refused (401, OpenAI's `invalid_api_key`),
/// however many times: nothing counted for them.
async fn refused_before_anything_counts(gates: &Gates) {
    for i in 0..6 {
        let made_up = chat(gates, i, &[("authorization", "Bearer sk-test-madeup")]).await;
        assert_eq!(made_up.status, 401, "{}", made_up.text());
        assert_eq!(made_up.json()["error"]["code"], "invalid_api_key");
        let missing = chat(gates, i, &[]).await;
        assert_eq!(missing.status, 401);
    }
}

/// Hal (free) has 2 of the budget, leaving his organisation 4; Gina (pro,
/// same organisation) 4 of her 5 before the organisation is spent,
/// whatever organisation her client claims.
async fn plan_and_organisation_from_the_record(gates: &Gates, hal_bearer: &str, gina_bearer: &str) {
    for i in 0..2 {
        let answer = chat(gates, i, &[("authorization", hal_bearer)]).await;
        assert_eq!(answer.status, 200, "hal {i}: {}", answer.text());
    }
    assert_eq!(
        chat(gates, 0, &[("authorization", hal_bearer)])
            .await
            .status,
        429
    );
    let claims = [
        ("authorization", gina_bearer),
        ("openai-organization", "zeta"),
    ];
    for i in 0..4 {
        assert_eq!(chat(gates, i, &claims).await.status, 200, "gina {i}");
    }
    let refused = chat(gates, 1, &claims).await;
    assert_eq!(refused.status, 429);
    assert_eq!(
        super::fields(&refused).0,
        "orgs",
        "the organisation's limit"
    );
}

/// Ian (free, another organisation) has 2, then is refused by his plan;
/// moved to pro on one instance he is admitted on the other within a
/// second, his 2 still counted; disabled on one, refused (403) on the
/// other within a second.
async fn changes_reach_every_instance(gates: &Gates, ian_bearer: &str, ian_id: &str) {
    for i in 0..2 {
        assert_eq!(
            chat(gates, i, &[("authorization", ian_bearer)])
                .await
                .status,
            200
        );
    }
    assert_eq!(
        chat(gates, 1, &[("authorization", ian_bearer)])
            .await
            .status,
        429
    );
    // Moved to pro on instance 1: admitted on instance 0 within a second,
    // his 2 still counted: 3 more of pro's 5, then refused.
    let moved = admin(
        gates,
        1,
        "PATCH",
        &format!("/keys/{ian_id}"),
        r#"{"plan": "pro", "reason": "upgraded"}"#,
    )
    .await;
    assert_eq!(moved.status, 200, "{}", moved.text());
    assert_eq!(moved.json()["plan"], "pro");
    let took = until(gates, 0, ian_bearer, 200).await;
    assert!(
        took < Duration::from_secs(1),
        "the plan changed after {took:?}"
    );
    for i in 0..2 {
        assert_eq!(
            chat(gates, i, &[("authorization", ian_bearer)])
                .await
                .status,
            200
        );
    }
    assert_eq!(
        chat(gates, 0, &[("authorization", ian_bearer)])
            .await
            .status,
        429,
        "5 in all"
    );

    // Disabled on instance 0: refused (403) on instance 1 within a second.
    let disabled = admin(
        gates,
        0,
        "PATCH",
        &format!("/keys/{ian_id}"),
        r#"{"enabled": false, "reason": "unpaid invoice"}"#,
    )
    .await;
    assert_eq!(disabled.status, 200, "{}", disabled.text());
    let took = until(gates, 1, ian_bearer, 403).await;
    assert!(took < Duration::from_secs(1), "disabled after {took:?}");
    assert_eq!(
        chat(gates, 1, &[("authorization", ian_bearer)])
            .await
            .json()["error"]["code"],
        "invalid_api_key"
    );
}

/// The audit, read on the other instance, names alice and the reasons,
/// newest first, with the record before and after; never the key.
async fn audited_with_the_tokens_name(gates: &Gates, ian: &str) {
    let audit = admin(gates, 1, "GET", "/audit?identity=ian", "").await;
    assert_eq!(audit.status, 200, "{}", audit.text());
    let entries = audit.json()["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let actions: Vec<(&str, &str, &str)> = entries
        .iter()
        .map(|e| {
            (
                e["action"].as_str().unwrap_or(""),
                e["operator"].as_str().unwrap_or(""),
                e["reason"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        actions,
        [
            ("update", "alice", "unpaid invoice"),
            ("update", "alice", "upgraded"),
            ("create", "alice", "signed up")
        ],
        "newest first"
    );
    assert!(
        entries[1]["before"]
            .as_str()
            .unwrap_or("")
            .contains("\"identity\":\"ian\"")
    );
    assert!(
        entries[1]["after"]
            .as_str()
            .unwrap_or("")
            .contains("\"plan\":\"pro\"")
    );
    assert!(
        !audit.text().contains(ian),
        "the audit never holds a key in the clear"
    );
}

/// How long until instance `i` answers `key`'s request with `status`
/// (asked every 20 ms, up to 5 s).
async fn until(gates: &Gates, i: usize, bearer: &str, status: u16) -> Duration {
    let start = Instant::now();
    loop {
        let answer = chat(gates, i, &[("authorization", bearer)]).await;
        if answer.status == status {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "instance {i} still answers {} ({})",
            answer.status,
            answer.text()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
