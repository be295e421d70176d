//! Forwarding: what the upstream sees, what the client gets back, and how
//! upstream trouble is reported.

mod support;

use std::time::Duration;

use http::Request;
use support::{Floodgate, Generated, TestClient, Upstream, empty, first_answer, text_body};

fn proxy_config(upstream: &str) -> String {
    format!(
        r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "slow"
match = {{ path_prefix = "/slow" }}
upstream = "{upstream}"
upstream_timeout = "300ms"

[[routes]]
name = "all"
match = {{ path_prefix = "/" }}
upstream = "{upstream}"
"#
    )
}

#[tokio::test]
async fn upstream_sees_the_request_with_forwarding_headers_and_without_hop_by_hop_ones() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let client = TestClient::http1();
    let request = Request::post(gate.url("/v1/items/42?sort=desc&tag=a%20b"))
        .header("host", "api.example.com")
        .header("x-request-id", "abc")
        .header("x-forwarded-for", "203.0.113.5")
        .header("connection", "keep-alive, x-hop-secret")
        .header("x-hop-secret", "do not forward")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic Zm9vOmJhcg==")
        .header("te", "deflate, trailers")
        .header("upgrade", "websocket")
        .body(text_body("hello upstream"))
        .expect("request");
    let a = client.send(request).await;
    assert_eq!(a.status, 200);
    let echo = a.json();
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["uri"], "/v1/items/42?sort=desc&tag=a%20b");
    assert_eq!(echo["body"], "hello upstream");
    assert_eq!(a.echoed_header("x-request-id").as_deref(), Some("abc"));
    assert_eq!(a.echoed_header("host"), Some(upstream.addr.to_string()));
    // The client is no trusted proxy: its own X-Forwarded-For is not
    // passed on (tests/forwarding.rs has the trusted case).
    assert_eq!(
        a.echoed_header("x-forwarded-for").as_deref(),
        Some("127.0.0.1")
    );
    assert_eq!(
        a.echoed_header("x-forwarded-proto").as_deref(),
        Some("http")
    );
    assert_eq!(
        a.echoed_header("x-forwarded-host").as_deref(),
        Some("api.example.com")
    );
    for hop in [
        "x-hop-secret",
        "keep-alive",
        "proxy-authorization",
        "upgrade",
    ] {
        assert_eq!(a.echoed_header(hop), None, "{hop} reached the upstream");
    }
    // Of `TE`, only `trailers` goes on: gRPC servers need it, and it says
    // no more than that the client takes trailers, which floodgate passes.
    assert_eq!(a.echoed_header("te").as_deref(), Some("trailers"));
    assert_eq!(a.echoed_header("connection"), None);
}

#[tokio::test]
async fn client_does_not_see_the_upstreams_hop_by_hop_headers() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let a = TestClient::http1().get(&gate.url("/hop"), &[]).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-upstream-kept"), Some("1"));
    assert_eq!(a.header("x-upstream-secret"), None);
    assert_eq!(a.header("keep-alive"), None);
}

#[tokio::test]
async fn h2c_with_prior_knowledge_is_proxied_to_an_http1_upstream() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let a = TestClient::h2c().get(&gate.url("/over/h2?x=1"), &[]).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["uri"], "/over/h2?x=1");
    assert_eq!(
        a.echoed_header("x-forwarded-host"),
        Some(gate.addr.to_string())
    );
}

/// A connection whose first bytes were already sent by hand: the first
/// `skip` bytes the client writes are taken as written without being sent.
struct AlreadySent {
    stream: tokio::net::TcpStream,
    skip: usize,
}

impl tokio::io::AsyncRead for AlreadySent {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for AlreadySent {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.skip > 0 {
            let n = self.skip.min(buf.len());
            self.skip -= n;
            return std::task::Poll::Ready(Ok(n));
        }
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[tokio::test]
async fn first_bytes_sent_in_pieces_are_read_as_the_protocol_they_turn_out_to_be() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;

    // HTTP/1 that begins like HTTP/2's preface ("P…") and pauses there.
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    s.write_all(b"P").await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    s.write_all(b"OST /in/pieces HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n")
        .await
        .expect("write");
    let answer = first_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains(r#""method":"POST""#), "{answer}");

    // HTTP/2 whose preface arrives in two pieces.
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let mut stream = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    stream.write_all(&PREFACE[..9]).await.expect("write");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let io = hyper_util::rt::TokioIo::new(AlreadySent { stream, skip: 9 });
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(connection);
    let request = Request::get(gate.url("/h2/in/pieces"))
        .body(empty())
        .expect("request");
    let response = tokio::time::timeout(Duration::from_secs(5), sender.send_request(request))
        .await
        .expect("an answer")
        .expect("HTTP/2 response");
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), http::Version::HTTP_2);
}

#[tokio::test]
async fn refused_upstream_is_502_and_slow_upstream_is_504() {
    // A port that was just free: nothing listens there.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let gate = Floodgate::start(&proxy_config(&dead)).await;
    let a = TestClient::http1().get(&gate.url("/anything"), &[]).await;
    assert_eq!(a.problem(), (502, "the upstream is unreachable".into()));

    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let client = TestClient::http1();
    let timed_out = |path: &'static str| {
        let (client, url) = (&client, gate.url(path));
        async move {
            let started = std::time::Instant::now();
            let a = client.get(&url, &[]).await;
            assert_eq!(
                a.problem(),
                (504, "the upstream did not answer in time".into())
            );
            assert!(
                started.elapsed() < Duration::from_millis(2500),
                "504 came late"
            );
        }
    };
    // On a new connection; then on a pooled one whose last request had a
    // deadline before this one's; then on one whose last request (another
    // route, 30 s) had a deadline after it.
    timed_out("/slow?ms=3000").await;
    assert_eq!(client.get(&gate.url("/slow?ms=10"), &[]).await.status, 200);
    assert_eq!(upstream.connections(), 2);
    timed_out("/slow?ms=3000").await;
    assert_eq!(upstream.connections(), 2, "the pooled connection was used");
    assert_eq!(client.get(&gate.url("/anything"), &[]).await.status, 200);
    assert_eq!(upstream.connections(), 3);
    timed_out("/slow?ms=3000").await;
    assert_eq!(upstream.connections(), 3, "the pooled connection was used");
    assert_eq!(client.get(&gate.url("/slow?ms=10"), &[]).await.status, 200);
}

/// floodgate's own 502s and 504s are counted as refusals by fault, never as
/// the upstream's answers.
#[tokio::test]
async fn floodgates_own_502_and_504_are_counted_as_refusals_not_upstream_answers() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let dead = format!("http://{}", closed.local_addr().expect("addr"));
    drop(closed);
    let upstream = Upstream::start().await;
    let toml = format!(
        "{}\n[[routes]]\nname = \"dead\"\nmatch = {{ path_prefix = \"/dead\" }}\nupstream = \"{dead}\"\n",
        proxy_config(&upstream.url())
            .replace("[server]\n", "[server]\nadmin_listen = \"127.0.0.1:0\"\n")
            .replace(
                "name = \"all\"\nmatch = { path_prefix = \"/\" }",
                "name = \"all\"\nmatch = { path_prefix = \"/status\" }"
            )
    );
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/dead"), &[]).await.status, 502);
    assert_eq!(
        client.get(&gate.url("/slow?ms=1000"), &[]).await.status,
        504
    );
    assert_eq!(client.get(&gate.url("/slow?ms=1"), &[]).await.status, 200);
    assert_eq!(
        client.get(&gate.url("/status?code=502"), &[]).await.status,
        502
    );
    assert_eq!(client.get(&gate.url("/nowhere"), &[]).await.status, 404);
    let metrics = client.get(&gate.admin_url("/metrics"), &[]).await.text();
    for (series, want) in [
        (
            "floodgate_refusals_total{status=\"502\",fault=\"upstream\"}",
            1,
        ),
        (
            "floodgate_refusals_total{status=\"504\",fault=\"upstream\"}",
            1,
        ),
        (
            "floodgate_refusals_total{status=\"404\",fault=\"client\"}",
            1,
        ),
        (
            "floodgate_upstream_responses_total{route=\"all\",class=\"5xx\"}",
            1,
        ),
        (
            "floodgate_upstream_responses_total{route=\"slow\",class=\"5xx\"}",
            0,
        ),
        (
            "floodgate_upstream_responses_total{route=\"slow\",class=\"2xx\"}",
            1,
        ),
        (
            "floodgate_upstream_responses_total{route=\"dead\",class=\"5xx\"}",
            0,
        ),
    ] {
        let got = metrics
            .lines()
            .find_map(|l| l.strip_prefix(series))
            .and_then(|v| v.trim().parse::<u64>().ok());
        assert_eq!(got, Some(want), "{series}\n{metrics}");
    }
}

#[tokio::test]
async fn no_matching_route_is_404() {
    let toml = r#"
[server]
listen = "127.0.0.1:0"

[[routes]]
name = "only"
match = { path = "/only", methods = ["GET"] }
respond = { status = 200 }
"#;
    let gate = Floodgate::start(toml).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/only"), &[]).await.status, 200);
    let a = client.get(&gate.url("/other"), &[]).await;
    assert_eq!(a.problem(), (404, "no route matches this request".into()));
    let post = Request::post(gate.url("/only"))
        .body(empty())
        .expect("request");
    assert_eq!(client.send(post).await.status, 404);
}

/// Peak resident memory of this test process, from /proc.
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn hundred_megabyte_upload_and_download_stream_with_bounded_memory() {
    const SIZE: u64 = 100 * 1024 * 1024;
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let client = TestClient::http1();
    let before = peak_rss_kib();

    let upload = Request::post(gate.url("/upload"))
        .body(http_body_util::Either::Right(Generated::new(SIZE)))
        .expect("request");
    let a = client.send(upload).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.text(), SIZE.to_string());

    // Read the download as it streams, counting, never holding it whole.
    let response =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http::<http_body_util::Empty<bytes::Bytes>>()
            .get(
                gate.url(&format!("/download?bytes={SIZE}"))
                    .parse()
                    .expect("uri"),
            )
            .await
            .expect("download");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut received = 0u64;
    use http_body_util::BodyExt as _;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("download frame");
        received += frame.data_ref().map_or(0, |d| d.len() as u64);
    }
    assert_eq!(received, SIZE);

    let growth_mib = peak_rss_kib().saturating_sub(before) / 1024;
    assert!(
        growth_mib < 40,
        "peak memory grew by {growth_mib} MiB while streaming 100 MiB each way"
    );
}

/// floodgate keeps one upstream connection for sequential requests, returns
/// it after bodies of every shape (empty, streamed, HEAD, 204), and never
/// reuses a connection whose response was abandoned half-read or that the
/// upstream closed.
#[tokio::test]
async fn upstream_connections_are_reused_only_when_clean() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let client = TestClient::http1();
    for i in 0..20 {
        let answer = client.get(&gate.url(&format!("/seq/{i}")), &[]).await;
        assert_eq!(answer.status, 200);
    }
    let download = client.get(&gate.url("/download?bytes=300000"), &[]).await;
    assert_eq!(download.body.len(), 300_000);
    let no_content = client.get(&gate.url("/status?code=204"), &[]).await;
    assert_eq!(no_content.status, 204);
    let head = client
        .send(
            Request::head(gate.url("/seq/head"))
                .body(empty())
                .expect("request"),
        )
        .await;
    assert_eq!(head.status, 200);
    assert_eq!(client.get(&gate.url("/seq/after"), &[]).await.status, 200);
    assert_eq!(
        upstream.connections(),
        1,
        "sequential requests shared one connection"
    );

    // A client that walks away from a large download: its upstream
    // connection still has body bytes in flight and must not be reused.
    let walker = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>();
    let response = walker
        .get(gate.url("/download?bytes=50000000").parse().expect("uri"))
        .await
        .expect("download starts");
    let mut body = response.into_body();
    let first = http_body_util::BodyExt::frame(&mut body).await;
    assert!(matches!(first, Some(Ok(_))), "the download began");
    drop(body);
    drop(walker);
    let next = tokio::time::timeout(
        Duration::from_secs(5),
        client.get(&gate.url("/seq/next"), &[]),
    )
    .await
    .expect("a request after an abandoned download is answered");
    assert_eq!(next.status, 200);
    assert_eq!(
        upstream.connections(),
        2,
        "the abandoned connection was not reused"
    );

    // An upstream that closes after answering: the next request opens a new
    // connection instead of failing on the closed one.
    assert_eq!(client.get(&gate.url("/close"), &[]).await.status, 200);
    assert_eq!(
        client.get(&gate.url("/seq/reopened"), &[]).await.status,
        200
    );
    assert_eq!(upstream.connections(), 3);
}

/// An upstream that answers each request head it reads with the next of
/// `answers`, byte for byte, and closes the connection after any answer
/// marked to close. Counts the connections it accepted.
struct ScriptedUpstream {
    addr: std::net::SocketAddr,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl ScriptedUpstream {
    async fn start(answers: Vec<(&'static [u8], bool)>) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let connections = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let accepted = std::sync::Arc::clone(&connections);
        let answers = std::sync::Arc::new(std::sync::Mutex::new(answers.into_iter()));
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let answers = std::sync::Arc::clone(&answers);
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        // One request head; a body is read past, never kept.
                        while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                            let keep = seen.len().saturating_sub(3);
                            seen.drain(..keep);
                            match stream.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => seen.extend_from_slice(&buf[..n]),
                            }
                        }
                        seen.clear();
                        let next = answers.lock().expect("answers").next();
                        let Some((answer, close)) = next else { return };
                        if stream.write_all(answer).await.is_err() || close {
                            return;
                        }
                    }
                });
            }
        });
        Self {
            addr,
            connections,
            task,
        }
    }

    fn connections(&self) -> usize {
        self.connections.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test]
async fn upstream_answers_of_every_framing_reach_the_client_whole() {
    let upstream = ScriptedUpstream::start(vec![
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n\
              5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\n",
            false,
        ),
        (
            b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>\r\n\r\n\
              HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-final: 1\r\n\r\nfinal",
            false,
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", false),
        (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the upstream closes",
            true,
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nafter", false),
    ])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let client = TestClient::http1();

    let chunked = client.get(&gate.url("/chunked"), &[]).await;
    assert_eq!(chunked.status, 200);
    assert_eq!(chunked.text(), "hello world");
    assert_eq!(chunked.header("x-trailer"), None);

    let after_hints = client.get(&gate.url("/hints"), &[]).await;
    assert_eq!(after_hints.status, 200);
    assert_eq!(after_hints.text(), "final");
    assert_eq!(after_hints.header("x-final"), Some("1"));

    let empty = client.get(&gate.url("/empty"), &[]).await;
    assert_eq!(empty.status, 200);
    assert_eq!(empty.text(), "");
    assert_eq!(upstream.connections(), 1, "three answers on one connection");

    let until_close = client.get(&gate.url("/until-close"), &[]).await;
    assert_eq!(until_close.status, 200);
    assert_eq!(until_close.text(), "until the upstream closes");

    let after = client.get(&gate.url("/after"), &[]).await;
    assert_eq!(after.text(), "after");
    assert_eq!(
        upstream.connections(),
        2,
        "a connection whose body ended with it is not reused"
    );
}

#[tokio::test]
async fn malformed_upstream_answers_are_502() {
    let upstream = ScriptedUpstream::start(vec![
        (b"this is not HTTP\r\n\r\n", true),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\nxx",
            true,
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", false),
    ])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/garbage"), &[]).await.status, 502);
    assert_eq!(client.get(&gate.url("/two-lengths"), &[]).await.status, 502);
    // The head was fine, so the 200 may already be on its way when the body
    // breaks off; either way the answer must not pass for complete.
    let short = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Empty<bytes::Bytes>>()
        .get(gate.url("/short").parse().expect("uri"))
        .await;
    if let Ok(short) = short {
        assert_eq!(short.status(), 200);
        let body = http_body_util::BodyExt::collect(short.into_body()).await;
        assert!(body.is_err(), "a body cut short was passed off as whole");
    }
    // And floodgate goes on serving.
    let ok = client.get(&gate.url("/ok"), &[]).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.text(), "ok");
}

#[tokio::test]
async fn request_bodies_of_unknown_length_are_sent_chunked() {
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let mut sender = support::http1_connection(gate.addr).await;
    for chunks in [300u64, 1, 0] {
        let request = Request::post(gate.url("/upload"))
            .body(Generated::without_length(chunks * 1024))
            .expect("request");
        let response = sender.send_request(request).await.expect("response");
        assert_eq!(response.status(), 200);
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .expect("body")
            .to_bytes();
        assert_eq!(body, (chunks * 1024).to_string());
        sender.ready().await.expect("connection reusable");
    }
    // The upstream saw the framing floodgate chose.
    let echo = TestClient::http1()
        .send(
            Request::post(gate.url("/echo"))
                .body(text_body("known"))
                .expect("request"),
        )
        .await;
    assert_eq!(echo.echoed_header("content-length"), Some("5".to_owned()));
    assert_eq!(echo.echoed_header("transfer-encoding"), None);
}

#[tokio::test]
async fn an_answer_before_the_upload_ends_is_relayed_even_if_the_upstream_then_closes() {
    let upstream = ScriptedUpstream::start(vec![(
        b"HTTP/1.1 413 Content Too Large\r\nconnection: close\r\ncontent-length: 8\r\n\r\ntoo big!",
        true,
    )])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let upload = Request::post(gate.url("/upload"))
        .body(http_body_util::Either::Right(Generated::new(
            64 * 1024 * 1024,
        )))
        .expect("request");
    let answer = tokio::time::timeout(Duration::from_secs(10), TestClient::http1().send(upload))
        .await
        .expect("the answer arrives");
    assert_eq!(answer.status, 413);
    assert_eq!(answer.text(), "too big!");
}

#[tokio::test]
async fn an_answer_before_the_upload_ends_is_relayed_and_its_connection_dropped() {
    let upstream = ScriptedUpstream::start(vec![
        (
            b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 8\r\n\r\ntoo big!",
            false,
        ),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nnext!", false),
    ])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let client = TestClient::http1();
    // Far more than the socket buffers hold, so the upstream's answer comes
    // while floodgate is still sending.
    let upload = Request::post(gate.url("/upload"))
        .body(http_body_util::Either::Right(Generated::new(
            64 * 1024 * 1024,
        )))
        .expect("request");
    let answer = tokio::time::timeout(Duration::from_secs(10), client.send(upload))
        .await
        .expect("the early answer arrives while the upload is still going");
    assert_eq!(answer.status, 413);
    assert_eq!(answer.text(), "too big!");
    let next = client.get(&gate.url("/next"), &[]).await;
    assert_eq!(next.text(), "next!");
    assert_eq!(
        upstream.connections(),
        2,
        "the connection with an unsent body was not reused"
    );
}

#[tokio::test]
async fn a_pooled_connection_the_upstream_closed_while_idle_is_not_used() {
    // Answers that say nothing of closing, from an upstream that closes
    // each connection right after answering.
    let upstream = ScriptedUpstream::start(vec![
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond", true),
    ])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/first"), &[]).await.text(), "first");
    // The upstream's close reaches floodgate while the connection is idle.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = client.get(&gate.url("/second"), &[]).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.text(), "second");
    assert_eq!(upstream.connections(), 2);
}

#[tokio::test]
async fn a_connection_closed_before_an_answer_is_retried_once_and_only_if_safe() {
    // Connections that close on a request without answering it: the race
    // between a keep-alive upstream closing an idle connection and a
    // request arriving on it, made to happen every time. Answers are taken
    // in the order requests reach the upstream, whatever their connection.
    let upstream = ScriptedUpstream::start(vec![
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfirst", false),
        (b"", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nagain", false),
        (b"", true),
        (b"", true),
        (
            b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nrenewed",
            false,
        ),
        (b"", true),
        (b"", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nafter", false),
        (b"", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", false),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nlast", false),
    ])
    .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/first"), &[]).await.text(), "first");
    // A GET on the pooled connection goes again, on a new one.
    let again = client.get(&gate.url("/again"), &[]).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.text(), "again");
    assert_eq!(upstream.connections(), 2);
    // A POST with a body is never sent twice.
    let post = client
        .send(
            Request::post(gate.url("/post"))
                .body(text_body("once"))
                .expect("request"),
        )
        .await;
    assert_eq!(post.status, 502);
    assert_eq!(upstream.connections(), 2, "the POST was not sent again");
    // A GET whose new connection broke before any answer goes once more,
    // as one on a reused connection does.
    let renewed = client.get(&gate.url("/new"), &[]).await;
    assert_eq!(renewed.status, 200);
    assert_eq!(renewed.text(), "renewed");
    assert_eq!(upstream.connections(), 4);
    // Once more, and no more: a GET failing twice is a 502.
    let twice = client.get(&gate.url("/twice"), &[]).await;
    assert_eq!(twice.status, 502);
    assert_eq!(upstream.connections(), 5, "the GET was sent at most twice");
    assert_eq!(client.get(&gate.url("/after"), &[]).await.text(), "after");
    assert_eq!(upstream.connections(), 6);
    // A HEAD goes again as a HEAD: its answer has no body to wait for.
    let head = tokio::time::timeout(
        Duration::from_secs(5),
        client.send(
            Request::head(gate.url("/head"))
                .body(empty())
                .expect("request"),
        ),
    )
    .await
    .expect("the HEAD is answered at once");
    assert_eq!(head.status, 200);
    assert_eq!(head.text(), "");
    assert_eq!(upstream.connections(), 7);
    // The connection the HEAD went on again is reused, in step.
    assert_eq!(client.get(&gate.url("/last"), &[]).await.text(), "last");
    assert_eq!(upstream.connections(), 7);
}

/// An upstream answer whose body breaks before its first byte (a chunk
/// size that is not hexadecimal, or that overflows) is floodgate's `502`,
/// and the client's connection goes on: a second request on it is
/// answered. One that breaks after its first chunk has its head and that
/// chunk relayed, then is cut.
#[tokio::test]
async fn an_answer_broken_before_its_first_byte_is_a_502_and_the_connection_goes_on() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream =
        ScriptedUpstream::start(vec![
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", true),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nsecond", false),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nffffffffffffffffff\r\nhello\r\n",
            true,
        ),
        (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n",
            true,
        ),
    ])
        .await;
    let gate = Floodgate::start(&proxy_config(&format!("http://{}", upstream.addr))).await;
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    // Two requests pipelined on one connection.
    s.write_all(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut answers = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&answers).contains("second") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("answers, not silence")
            .expect("read");
        assert!(
            n > 0,
            "connection closed after: {}",
            String::from_utf8_lossy(&answers)
        );
        answers.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answers);
    assert!(text.starts_with("HTTP/1.1 502 "), "{text}");
    assert!(
        text.contains("broke off before any of it was sent"),
        "{text}"
    );
    assert!(text.contains("HTTP/1.1 200 OK"), "{text}");
    // A chunk size that overflows: the same.
    let client = TestClient::http1();
    assert_eq!(client.get(&gate.url("/overflow"), &[]).await.status, 502);
    // A good chunk first: head and chunk relayed, then cut.
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    s.write_all(b"GET /late HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let mut late = Vec::new();
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("an answer, then a close")
            .unwrap_or(0);
        if n == 0 {
            break;
        }
        late.extend_from_slice(&buf[..n]);
    }
    let late = String::from_utf8_lossy(&late);
    assert!(late.starts_with("HTTP/1.1 200 OK"), "{late}");
    assert!(late.contains("hello"), "{late}");
    assert!(
        !late.ends_with("0\r\n\r\n"),
        "a cut body must not look complete: {late}"
    );
}

/// An answer whose body stays silent past `upstream_body_timeout` before
/// its first byte is floodgate's `504`: nothing of it had gone out.
#[tokio::test]
async fn an_answer_silent_before_its_first_byte_is_a_504() {
    let upstream = ScriptedUpstream::start(vec![(
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        false,
    )])
    .await;
    let toml = proxy_config(&format!("http://{}", upstream.addr)).replace(
        "listen = \"127.0.0.1:0\"",
        "listen = \"127.0.0.1:0\"\nupstream_body_timeout = \"300ms\"",
    );
    let gate = Floodgate::start(&toml).await;
    let answer = TestClient::http1().get(&gate.url("/stalled"), &[]).await;
    assert_eq!(answer.status, 504);
    assert!(
        answer.text().contains("stalled before any of it was sent"),
        "{}",
        answer.text()
    );
}

#[tokio::test]
async fn a_malformed_request_body_is_the_clients_fault() {
    use tokio::io::AsyncWriteExt;
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&proxy_config(&upstream.url())).await;
    let mut s = tokio::net::TcpStream::connect(gate.addr)
        .await
        .expect("connect");
    // A chunk, then a chunk size that is not hexadecimal.
    s.write_all(
        b"POST /upload HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\nzz\r\n\r\n",
    )
    .await
    .expect("write");
    let answer = first_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
}
