//! Every phase of an exchange has a timeout of its own, fires at its
//! configured time, and is counted on the side whose fault it is: the
//! client's head (408) and body (408, never the upstream's 504), a client
//! that stops reading (cut off, its upstream exchange dropped), the
//! upstream's connect (502), response head (504) and body (cut off).

mod support;

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::config::{Config, Route};
use support::{Floodgate, TestClient, Upstream, first_answer};

/// The value of the series `name{labels}` on `/metrics`, 0 if absent.
async fn metric(gate: &Floodgate, series: &str) -> f64 {
    let text = TestClient::http1()
        .get(&gate.admin_url("/metrics"), &[])
        .await
        .text();
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Waits up to `within` for `series` to reach `value`; how long it took.
async fn until_metric(gate: &Floodgate, series: &str, value: f64, within: Duration) -> Duration {
    let began = Instant::now();
    loop {
        if metric(gate, series).await >= value {
            return began.elapsed();
        }
        assert!(
            began.elapsed() < within,
            "{series} did not reach {value} within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// floodgate with an admin listener and `server` lines, forwarding
/// everything to `upstream`.
async fn start(upstream: &str, server: &[&str]) -> Floodgate {
    let mut config = Config::new().admin();
    for line in server {
        config = config.server(line);
    }
    Floodgate::start(&config.route(Route::new("all").upstream(upstream)).toml()).await
}

fn timeouts(phase: &str) -> String {
    format!("floodgate_timeouts_total{{phase=\"{phase}\"}}")
}

#[tokio::test]
async fn a_trickling_request_body_is_the_clients_408_not_the_upstreams_504() {
    let upstream = Upstream::start().await;
    // The upstream's deadline is shorter than the client's: it must not
    // start until the body has been sent.
    let gate = start(
        &upstream.url(),
        &[
            r#"client_body_timeout = "1s""#,
            r#"upstream_timeout = "300ms""#,
        ],
    )
    .await;

    // A slow but steady upload outlasts upstream_timeout and passes.
    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-length: 4\r\n\r\n")
        .await
        .expect("write");
    for byte in [b"a", b"b", b"c", b"d"] {
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.write_all(byte).await.expect("write");
    }
    let answer = first_answer(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.ends_with("\r\n\r\n4"), "{answer}");

    // One that stops is cut after client_body_timeout with 408.
    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n0123456789")
        .await
        .expect("write");
    let began = Instant::now();
    let answer = first_answer(&mut s).await;
    let took = began.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("client_body_timeout"), "{answer}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "408 after {took:?}, not about 1 s"
    );
    assert_eq!(metric(&gate, &timeouts("client_body")).await, 1.0);
    assert_eq!(
        metric(
            &gate,
            "floodgate_refusals_total{status=\"408\",fault=\"client\"}"
        )
        .await,
        1.0
    );
    assert_eq!(metric(&gate, &timeouts("upstream_head")).await, 0.0);
    assert_eq!(
        metric(
            &gate,
            "floodgate_refusals_total{status=\"504\",fault=\"upstream\"}"
        )
        .await,
        0.0
    );
}

#[tokio::test]
async fn a_silent_client_head_is_408_after_header_read_timeout() {
    let upstream = Upstream::start().await;
    let gate = start(&upstream.url(), &[r#"header_read_timeout = "1s""#]).await;
    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("write");
    let began = Instant::now();
    let answer = first_answer(&mut s).await;
    let took = began.elapsed();
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(metric(&gate, &timeouts("client_head")).await, 1.0);
    assert_eq!(upstream.hits(), 0);
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_and_its_upstream_exchange_dropped() {
    let upstream = Upstream::start().await;
    let gate = start(&upstream.url(), &[r#"client_write_timeout = "1s""#]).await;
    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"GET /download?bytes=500000000 HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    // Read nothing: the socket buffers fill, then floodgate's writes wait.
    let took = until_metric(
        &gate,
        &timeouts("client_write"),
        1.0,
        Duration::from_secs(10),
    )
    .await;
    assert!(took >= Duration::from_millis(900), "cut after {took:?}");
    // What was buffered arrives, then the end: far less than was asked.
    let mut received = 0usize;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => received += n,
            Err(_) => panic!("the connection was not closed"),
        }
    }
    assert!(received < 100_000_000, "{received} bytes arrived");
    // The upstream connection went with it: a new request needs a new one.
    let before = upstream.connections();
    let next = TestClient::http1().get(&gate.url("/after"), &[]).await;
    assert_eq!(next.status, 200);
    assert_eq!(upstream.connections(), before + 1);
    assert_eq!(metric(&gate, "floodgate_open_connections").await, 0.0);
}

#[tokio::test]
async fn an_upstream_that_accepts_no_connection_is_a_502_after_the_connect_timeout() {
    // A listener whose backlog is full: the kernel drops further SYNs, so a
    // connect hangs instead of being refused.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let full = socket.listen(0).expect("listen");
    let addr = full.local_addr().expect("addr");
    let mut queued = Vec::new();
    for _ in 0..8 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(addr)).await
        {
            queued.push(s);
        }
    }
    let gate = start(
        &format!("http://{addr}"),
        &[
            r#"upstream_connect_timeout = "500ms""#,
            r#"upstream_timeout = "10s""#,
        ],
    )
    .await;
    let began = Instant::now();
    let answer = TestClient::http1().get(&gate.url("/x"), &[]).await;
    let took = began.elapsed();
    let (status, detail) = answer.problem();
    assert_eq!(
        (status, detail.as_str()),
        (502, "the upstream is unreachable")
    );
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(3),
        "502 after {took:?}, not about 500 ms"
    );
    assert_eq!(metric(&gate, &timeouts("upstream_connect")).await, 1.0);
    drop(queued);
}

#[tokio::test]
async fn a_late_response_head_is_504_and_a_stalled_body_is_cut() {
    // Raw upstream: `/late` answers nothing; anything else sends a head and
    // 10 of its 100 body bytes, then stalls.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if !head.starts_with(b"GET /late ") {
                    let _ = s
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
                        .await;
                }
                tokio::time::sleep(Duration::from_secs(30)).await;
            });
        }
    });
    let gate = start(
        &format!("http://{addr}"),
        &[
            r#"upstream_timeout = "700ms""#,
            r#"upstream_body_timeout = "1s""#,
        ],
    )
    .await;
    let client = TestClient::http1();

    let began = Instant::now();
    let late = client.get(&gate.url("/late"), &[]).await;
    let took = began.elapsed();
    assert_eq!(late.problem().0, 504);
    assert!(
        took >= Duration::from_millis(650) && took < Duration::from_secs(3),
        "{took:?}"
    );
    assert_eq!(metric(&gate, &timeouts("upstream_head")).await, 1.0);

    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"GET /stalls HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("write");
    let began = Instant::now();
    let mut received = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the stalled answer was not cut"),
        }
    }
    let took = began.elapsed();
    let text = String::from_utf8_lossy(&received);
    assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    assert!(
        text.ends_with("0123456789"),
        "the answer was cut after what came: {text}"
    );
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(metric(&gate, &timeouts("upstream_body")).await, 1.0);
    task.abort();
}

/// A small upload that trickles in (one byte every half second) holds no
/// upstream connection while it is read, and is cut with `408` once it is
/// slower on average than `client_body_min_rate` after
/// `client_body_min_rate_after`; the upstream never sees it.
#[tokio::test]
async fn a_trickling_small_upload_holds_no_upstream_connection_and_is_cut_at_the_minimum_rate() {
    let upstream = Upstream::start().await;
    let gate = start(
        &upstream.url(),
        &[
            r#"client_body_timeout = "30s""#,
            r#"client_body_min_rate = "100B""#,
            r#"client_body_min_rate_after = "2s""#,
        ],
    )
    .await;
    let mut s = TcpStream::connect(gate.addr).await.expect("connect");
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\ncontent-length: 100\r\n\r\n")
        .await
        .expect("write");
    let mut answer = Vec::new();
    let mut buf = [0u8; 4096];
    for _ in 0..60 {
        assert_eq!(
            upstream.connections(),
            0,
            "an upstream connection was taken for a body still being read"
        );
        if s.write_all(b"x").await.is_err() {
            break;
        }
        match tokio::time::timeout(Duration::from_millis(500), s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => {
                answer.extend_from_slice(&buf[..n]);
                break;
            }
            Ok(_) => break,
            Err(_) => {}
        }
    }
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408 "), "{answer}");
    assert!(answer.contains("client_body_min_rate"), "{answer}");
    assert_eq!(upstream.connections(), 0);
    assert_eq!(upstream.hits(), 0);
    assert_eq!(metric(&gate, &timeouts("client_body")).await, 1.0);

    // A small upload that comes at once is read whole, then forwarded.
    let answer = TestClient::http1()
        .send(
            hyper::Request::post(gate.url("/upload"))
                .body(support::text_body("all of it"))
                .expect("request"),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(upstream.hits(), 1);
}

/// A body that sends one byte and then nothing: an upload left unfinished.
struct Unfinished(bool);

impl hyper::body::Body for Unfinished {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        if self.0 {
            return std::task::Poll::Pending;
        }
        self.0 = true;
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(
            bytes::Bytes::from_static(b"x"),
        ))))
    }
}

/// One HTTP/2 connection opening many unfinished uploads gets no more of
/// them in flight than `http2_max_concurrent_streams`, so it never holds
/// more upstream connections than that.
#[tokio::test]
async fn one_http2_connection_holds_no_more_upstream_connections_than_its_stream_cap() {
    let upstream = Upstream::start().await;
    let gate = start(
        &upstream.url(),
        &[
            "http2_max_concurrent_streams = 10",
            r#"request_buffer = "1KiB""#,
        ],
    )
    .await;
    let tcp = TcpStream::connect(gate.addr).await.expect("connect");
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(connection);
    let mut uploads = Vec::new();
    for i in 0..30 {
        let mut sender = sender.clone();
        let request = hyper::Request::post(format!("http://{}/upload/{i}", gate.addr))
            .header("content-length", "65536")
            .body(Unfinished(false))
            .expect("request");
        uploads.push(tokio::spawn(
            async move { sender.send_request(request).await },
        ));
    }
    // The streams the cap allows reach the upstream...
    let began = Instant::now();
    while upstream.connections() < 10 {
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "only {} uploads reached the upstream",
            upstream.connections()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...and no more, however long the rest wait.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(upstream.connections(), 10);
    for upload in uploads {
        upload.abort();
    }
}
