//! `/clients/top` on the admin listener: under a load from two clients, the
//! heavier is first, with its allowed and denied counts exact; ids appear
//! as the access log shows them; memory stays fixed under many clients;
//! clients decided through Envoy's rate limit service are counted as the
//! proxy listener's are.

mod support;

use support::config::{Config, Route};
use support::peers::client;
use support::{Floodgate, TestClient};

fn limited(client_id: &str) -> String {
    Config::new()
        .admin()
        .access_log(&[
            r#"format = "off""#,
            &format!(r#"client_id = "{client_id}""#),
        ])
        .route(
            Route::new("open")
                .matching(r#"path_prefix = "/open""#)
                .respond("status = 200"),
        )
        .route(
            Route::new("api")
                .respond("status = 200")
                .client(r#"from = "header", name = "x-client""#)
                .limit("fixed_window", 10, "1h"),
        )
        .toml()
}

async fn top(gate: &Floodgate, query: &str) -> serde_json::Value {
    let answer = TestClient::http1()
        .get(&gate.admin_url(&format!("/clients/top{query}")), &[])
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("content-type"), Some("application/json"));
    serde_json::from_str(&answer.text()).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heaviest_client_comes_first_with_exact_counts() {
    let gate = Floodgate::start(&limited("raw")).await;
    let client = TestClient::http1();
    let mut runs = tokio::task::JoinSet::new();
    for (who, times) in [("heavy", 60), ("light", 6)] {
        let (client, url) = (client.clone(), gate.url("/x"));
        runs.spawn(async move {
            for _ in 0..times {
                client.get(&url, &[("x-client", who)]).await;
            }
        });
    }
    while runs.join_next().await.is_some() {}

    let json = top(&gate, "").await;
    assert_eq!(json["window_seconds"], 60);
    let routes = json["routes"].as_array().expect("routes");
    assert_eq!(routes.len(), 1, "only limited routes: {json}");
    assert_eq!(routes[0]["route"], "api");
    let clients = routes[0]["clients"].as_array().expect("clients");
    let row = |i: usize, key: &str| clients[i][key].clone();
    assert_eq!(clients.len(), 2, "{json}");
    assert_eq!(row(0, "client"), "heavy");
    assert_eq!(
        (
            row(0, "requests"),
            row(0, "allowed"),
            row(0, "denied"),
            row(0, "over")
        ),
        (60.into(), 10.into(), 50.into(), 0.into())
    );
    assert_eq!(row(1, "client"), "light");
    assert_eq!((row(1, "allowed"), row(1, "denied")), (6.into(), 0.into()));

    let one = top(&gate, "?n=1").await;
    assert_eq!(
        one["routes"][0]["clients"].as_array().map(Vec::len),
        Some(1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_are_hashed_by_default_and_memory_stays_fixed_under_many_clients() {
    let gate = Floodgate::start(&limited("hash")).await;
    let client = TestClient::http1();
    for i in 0..1_500 {
        client
            .get(&gate.url("/x"), &[("x-client", &format!("sk_client_{i}"))])
            .await;
        if i % 10 == 0 {
            client
                .get(&gate.url("/x"), &[("x-client", "sk_heavy_secret")])
                .await;
        }
    }
    let json = top(&gate, "?n=5").await;
    let text = json.to_string();
    assert!(!text.contains("sk_"), "an id in clear: {text}");
    let route = &json["routes"][0];
    // At most 64 clients a ten-second slot, six slots a minute.
    let tracked = route["tracked"].as_u64().expect("tracked");
    assert!(tracked <= 6 * 64, "{tracked}");
    let clients = route["clients"].as_array().expect("clients");
    assert_eq!(clients.len(), 5);
    assert_eq!(clients[0]["requests"], 150, "{json}");
    assert_eq!(
        (clients[0]["allowed"].clone(), clients[0]["denied"].clone()),
        (10.into(), 140.into())
    );
    let shown = clients[0]["client"].as_str().expect("a string");
    assert!(
        shown.len() == 16 && shown.bytes().all(|b| b.is_ascii_hexdigit()),
        "{shown}"
    );
}

/// A route Envoy's rate limit service decides, three an hour per `user`
/// value, with the admin listener that shows its top clients.
fn decided_by_envoy() -> String {
    Config::new()
        .admin()
        .access_log(&[r#"format = "off""#, r#"client_id = "raw""#])
        .server(r#"decision_listen = "127.0.0.1:0""#)
        .server(r#"decision_peers = ["127.0.0.1/32"]"#)
        .route(
            Route::new("per-user")
                .decided_only()
                .line(r#"descriptor = { domain = "edge", entries = ["user"] }"#)
                .limit("fixed_window", 3, "1h"),
        )
        .toml()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_refused_through_envoys_rate_limit_service_is_among_the_top() {
    let gate = Floodgate::start(&decided_by_envoy()).await;
    let call = serde_json::json!({
        "domain": "edge",
        "descriptors": [{ "entries": [["user", "ann"]] }],
    });
    let target = gate.decisions.expect("decision listener").to_string();
    let calls = serde_json::to_string(&vec![call; 5]).expect("json");
    let answers = client("rls_peer.py", &[target, calls]).await;
    let codes: Vec<_> = answers.iter().map(|a| a["code"].clone()).collect();
    assert_eq!(
        codes,
        ["OK", "OK", "OK", "OVER_LIMIT", "OVER_LIMIT"],
        "{answers:#?}"
    );

    let json = top(&gate, "").await;
    let routes = json["routes"].as_array().expect("routes");
    assert_eq!(routes.len(), 1, "{json}");
    assert_eq!(routes[0]["route"], "per-user");
    let clients = routes[0]["clients"].as_array().expect("clients");
    assert_eq!(clients.len(), 1, "{json}");
    assert_eq!(clients[0]["client"], "ann");
    assert_eq!(
        (
            clients[0]["requests"].clone(),
            clients[0]["allowed"].clone(),
            clients[0]["denied"].clone()
        ),
        (5.into(), 3.into(), 2.into())
    );
}
