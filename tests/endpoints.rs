//! An upstream with several endpoints: requests are shared between them, an
//! endpoint that dies costs no request (what was never sent goes to the
//! other; GETs it dropped in flight go again), it is ejected, and it comes
//! back into rotation once it answers again.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use support::config::{Config, Route};
use support::{Floodgate, TestClient};
use tokio::task::{JoinHandle, JoinSet};

/// An upstream that answers its name (after 300 ms on `/slow`), and that
/// can be killed with every connection it holds, and started again on the
/// same port.
struct Endpoint {
    name: &'static str,
    port: u16,
    hits: Arc<AtomicUsize>,
    task: Option<JoinHandle<()>>,
}

impl Endpoint {
    async fn start(name: &'static str, port: u16) -> Self {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&hits);
        let task = tokio::spawn(async move {
            // Connections live in this task's set: aborting it closes them.
            let mut connections = JoinSet::new();
            loop {
                tokio::select! {
                    accepted = listener.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        let counter = Arc::clone(&counter);
                        connections.spawn(async move {
                            let service = service_fn(move |request: Request<Incoming>| {
                                counter.fetch_add(1, Ordering::SeqCst);
                                async move {
                                    if request.uri().path() == "/slow" {
                                        tokio::time::sleep(Duration::from_millis(300)).await;
                                    }
                                    Ok::<_, std::convert::Infallible>(Response::new(Full::new(
                                        Bytes::from_static(name.as_bytes()),
                                    )))
                                }
                            });
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(TokioIo::new(stream), service)
                                .await;
                        });
                    }
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                }
            }
        });
        Self {
            name,
            port,
            hits,
            task: Some(task),
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Kills it, and every connection it holds.
    async fn kill(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// `count` GETs of `path`, `at_once` at a time; every answer's status and
/// body.
async fn requests(
    gate: &Floodgate,
    path: &str,
    count: usize,
    at_once: usize,
) -> Vec<(u16, String)> {
    let client = TestClient::http1();
    let mut answers = Vec::with_capacity(count);
    let mut running = JoinSet::new();
    for i in 0..count {
        if running.len() == at_once
            && let Some(done) = running.join_next().await
        {
            answers.push(done.expect("request"));
        }
        let client = client.clone();
        let url = gate.url(&format!("{path}?i={i}"));
        running.spawn(async move {
            let answer = client.get(&url, &[]).await;
            (answer.status.as_u16(), answer.text())
        });
    }
    while let Some(done) = running.join_next().await {
        answers.push(done.expect("request"));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_share_the_load_and_one_that_dies_costs_no_request() {
    let a = Endpoint::start("a", 0).await;
    let mut b = Endpoint::start("b", 0).await;
    let toml = Config::new()
        .upstream(
            "pair",
            &[
                &format!(r#"endpoints = ["{}", "{}"]"#, a.url(), b.url()),
                r#"eject_for = "1s""#,
            ],
        )
        .route(Route::new("all").upstream("pair"))
        .toml();
    let gate = Floodgate::start(&toml).await;

    let answers = requests(&gate, "/x", 400, 16).await;
    assert!(
        answers.iter().all(|(status, _)| *status == 200),
        "{answers:?}"
    );
    let (on_a, on_b) = (a.hits(), b.hits());
    assert_eq!(on_a + on_b, 400);
    assert!(
        (180..=220).contains(&on_a),
        "a took {on_a} of 400, b {on_b}: not within 10 % of even"
    );

    // Slow GETs in flight on both when b dies: none is lost.
    let slow = tokio::spawn({
        let url = gate.url("/slow");
        async move {
            let client = TestClient::http1();
            let mut calls = JoinSet::new();
            for _ in 0..4 {
                let (client, url) = (client.clone(), url.clone());
                calls.spawn(async move { client.get(&url, &[]).await.status.as_u16() });
            }
            let mut statuses = Vec::new();
            while let Some(s) = calls.join_next().await {
                statuses.push(s.expect("call"));
            }
            statuses
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.kill().await;
    let after = requests(&gate, "/y", 200, 8).await;
    assert!(
        after
            .iter()
            .all(|(status, body)| *status == 200 && body == "a"),
        "a request failed or reached the dead endpoint: {:?}",
        after.iter().find(|(s, b)| *s != 200 || b != "a")
    );
    assert_eq!(slow.await.expect("slow calls"), [200, 200, 200, 200]);

    // Back on its port, it is tried again once its ejection ends.
    let b_again = Endpoint::start(b.name, b.port).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let later = requests(&gate, "/z", 100, 4).await;
    assert!(later.iter().all(|(status, _)| *status == 200), "{later:?}");
    assert!(
        b_again.hits() >= 20,
        "the restarted endpoint took {} of 100",
        b_again.hits()
    );
}
