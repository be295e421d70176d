//! Limits that count by the answer (`count_when`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Bed;
use crate::support::TestClient;
use crate::support::config::Route;

/// Each user's logins the upstream answered, failed and not.
pub(super) type Seen = Arc<Mutex<HashMap<String, (u64, u64)>>>;

/// A login upstream: 200 for `X-Password: right`, else 401; notes each
/// user's answers as each request arrives, and answers 300 ms later when
/// the request carries `X-Slow`.
pub(super) async fn login_upstream() -> (String, Seen) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = Seen::default();
    let noted = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let noted = Arc::clone(&noted);
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                        let header = |name: &str| {
                            req.headers()
                                .get(name)
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or_default()
                                .to_owned()
                        };
                        let right = header("x-password") == "right";
                        let slow = !header("x-slow").is_empty();
                        let mut seen = noted.lock().expect("seen");
                        let counts = seen.entry(header("x-user")).or_default();
                        if right {
                            counts.0 += 1;
                        } else {
                            counts.1 += 1;
                        }
                        async move {
                            if slow {
                                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                            }
                            http::Response::builder()
                                .status(if right { 200 } else { 401 })
                                .body(http_body_util::Full::new(bytes::Bytes::from_static(b"")))
                        }
                    });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (url, seen)
}

/// A login route of 5 failed logins per user in 10 minutes, counting only
/// the answers 401: 1 000 good logins of one user through either instance
/// all pass; a guesser is stopped after exactly 5 failures across both
/// instances, and stays refused when its next guess would succeed (the
/// limit counts the failures it already has), while the other user goes
/// on.
pub async fn only_the_answers_named_are_counted(bed: &Bed) {
    let (upstream, seen) = login_upstream().await;
    let route = Route::new("login")
        .upstream(&upstream)
        .client(r#"from = "header", name = "X-User", missing = "reject""#)
        .limits(r#"{ algorithm = "sliding_log", limit = 5, window = "10m", count_when = { status = [401] } }"#);
    let toml = bed.config("matrix-answers").route(route).toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    let login = |i: usize, user: &'static str, password: &'static str| {
        let url = gates.url(i, "/login");
        let http = &http;
        async move {
            http.get(&url, &[("x-user", user), ("x-password", password)])
                .await
                .status
                .as_u16()
        }
    };
    for i in 0..1000 {
        assert_eq!(login(i, "ann", "right").await, 200, "ann's login {i}");
    }
    let mut guesses = Vec::new();
    for i in 0..8 {
        guesses.push(login(i, "mal", "guess").await);
    }
    assert_eq!(guesses, [401, 401, 401, 401, 401, 429, 429, 429]);
    assert_eq!(login(0, "mal", "right").await, 429);
    assert_eq!(login(1, "mal", "right").await, 429);
    assert_eq!(login(1, "ann", "right").await, 200);
    a_guess_whose_client_left_counts_once(&gates, &seen).await;
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen.get("ann"), Some(&(1001, 0)));
    assert_eq!(
        seen.get("mal"),
        Some(&(0, 5)),
        "the upstream saw mal's five guesses alone"
    );
    assert_eq!(
        seen.get("eve"),
        Some(&(0, 5)),
        "eve's left guess and four more"
    );
}

/// Eve's guess reaches the upstream and she leaves before its answer: it
/// counts, once, so four more failures are all she gets.
async fn a_guess_whose_client_left_counts_once(gates: &super::Gates, seen: &Seen) {
    let url = gates.url(0, "/login");
    let left = tokio::spawn(async move {
        let headers = [("x-user", "eve"), ("x-password", "guess"), ("x-slow", "1")];
        TestClient::http1().get(&url, &headers).await
    });
    let arrived = || seen.lock().expect("seen").get("eve").copied();
    for _ in 0..400 {
        if arrived().is_some() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    }
    assert_eq!(arrived(), Some((0, 1)), "the guess reached the upstream");
    left.abort();
    let http = TestClient::http1();
    let mut statuses = Vec::new();
    for i in 1..=5 {
        let headers = [("x-user", "eve"), ("x-password", "guess")];
        statuses.push(
            http.get(&gates.url(i, "/login"), &headers)
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(statuses, [401, 401, 401, 401, 429]);
}

/// The answers floodgate makes itself count as the limits say, as an
/// upstream's do: a route whose upstream is down (`502`) and one whose
/// upstream answers too late (`504`), each with a limit of one counting
/// only `401` and a limit of three counting `5xx`. Each of a client's
/// first three requests, across both instances, gets floodgate's own
/// answer: the `401` limit gave its unit back before it went out (else
/// the second would be refused), the `5xx` limit kept it, so the fourth
/// is refused by it.
pub async fn floodgates_own_502_and_504_count_as_the_limits_say(bed: &Bed) {
    let late = crate::support::Upstream::start().await;
    let down = format!("http://127.0.0.1:{}", crate::support::free_port());
    let limits = |route: Route| {
        route
            .client(r#"from = "header", name = "X-User", missing = "reject""#)
            .limits(r#"{ algorithm = "sliding_log", limit = 1, window = "10m", count_when = { status = [401] } }"#)
            .limits(r#"{ algorithm = "sliding_log", limit = 3, window = "1h", count_when = { status = ["5xx"] } }"#)
    };
    let toml = bed
        .config("matrix-own-answers")
        .route(limits(
            Route::new("down")
                .upstream(&down)
                .matching(r#"path_prefix = "/down""#),
        ))
        .route(limits(
            Route::new("late")
                .upstream(&late.url())
                .matching(r#"path_prefix = "/slow""#)
                .line(r#"upstream_timeout = "200ms""#),
        ))
        .toml();
    let gates = bed.instances(&toml).await;
    let http = TestClient::http1();
    for (path, own) in [("/down", 502), ("/slow?ms=2000", 504)] {
        let mut statuses = Vec::new();
        for i in 0..4 {
            let answer = http.get(&gates.url(i, path), &[("x-user", "ann")]).await;
            statuses.push(answer.status.as_u16());
        }
        assert_eq!(statuses, [own, own, own, 429], "{path}");
    }
}
