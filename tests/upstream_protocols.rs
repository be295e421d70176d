//! Upstreams over TLS and HTTP/2: `https://` verified against an upstream's
//! own CA with the name it is asked for, a certificate failure that is a 502
//! saying why, a client certificate presented to an upstream that asks,
//! HTTP/2 chosen by ALPN or spoken by prior knowledge (`h2c`) with every
//! request on one connection. The upstreams are hyper servers behind
//! rustls, with certificates made by openssl in the test.

mod support;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, Version};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use support::certs::{certificates, issue};
use support::config::{Config, Route};
use support::{Floodgate, FloodgateProcess, TestClient};

/// How an upstream under test listens.
#[derive(Clone, Copy)]
enum Listening {
    /// TLS with the certificate `name` from the test's directory, offering
    /// `alpn`, asking for a client certificate signed by `ca.crt` if
    /// `client_auth`.
    Tls {
        name: &'static str,
        alpn: &'static [&'static [u8]],
        client_auth: bool,
    },
    /// HTTP/2 without TLS, by prior knowledge.
    H2c,
}

/// What an upstream saw of one request.
#[derive(Debug, Clone)]
struct Seen {
    version: Version,
    /// The SNI the client sent.
    sni: Option<String>,
    client_certificate: bool,
    authority: Option<String>,
}

/// An upstream that answers every request `ok` and remembers how it came.
struct ProtocolUpstream {
    port: u16,
    connections: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for ProtocolUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn server_tls(dir: &Path, name: &str, alpn: &[&[u8]], client_auth: bool) -> rustls::ServerConfig {
    let certs = CertificateDer::pem_file_iter(dir.join(format!("{name}.crt")))
        .expect("cert")
        .collect::<Result<Vec<_>, _>>()
        .expect("certs");
    let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).expect("key");
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .expect("versions");
    let builder = if client_auth {
        let mut roots = rustls::RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(dir.join("ca.crt")).expect("ca") {
            roots.add(ca.expect("ca")).expect("add ca");
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .expect("verifier");
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut config = builder.with_single_cert(certs, key).expect("server cert");
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    config
}

impl ProtocolUpstream {
    async fn start(dir: &Path, listening: Listening) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let tls = match listening {
            Listening::Tls {
                name,
                alpn,
                client_auth,
            } => Some(tokio_rustls::TlsAcceptor::from(Arc::new(server_tls(
                dir,
                name,
                alpn,
                client_auth,
            )))),
            Listening::H2c => None,
        };
        let (accepted, record) = (Arc::clone(&connections), Arc::clone(&seen));
        let task = tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                let tls = tls.clone();
                let record = Arc::clone(&record);
                tokio::spawn(async move {
                    match tls {
                        None => serve(TokioIo::new(tcp), true, None, false, record).await,
                        Some(acceptor) => {
                            let Ok(stream) = acceptor.accept(tcp).await else {
                                return;
                            };
                            let (_, connection) = stream.get_ref();
                            let h2 = connection.alpn_protocol() == Some(b"h2");
                            let sni = connection.server_name().map(str::to_owned);
                            let certificate = connection.peer_certificates().is_some();
                            serve(TokioIo::new(stream), h2, sni, certificate, record).await;
                        }
                    }
                });
            }
        });
        Self {
            port,
            connections,
            seen,
            task,
        }
    }

    /// An upstream behind TLS with the certificate `name`.
    async fn tls(
        dir: &Path,
        name: &'static str,
        alpn: &'static [&'static [u8]],
        client_auth: bool,
    ) -> Self {
        Self::start(
            dir,
            Listening::Tls {
                name,
                alpn,
                client_auth,
            },
        )
        .await
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }
}

async fn serve<I>(
    io: TokioIo<I>,
    h2: bool,
    sni: Option<String>,
    client_certificate: bool,
    record: Arc<Mutex<Vec<Seen>>>,
) where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |request: Request<Incoming>| {
        record.lock().expect("seen").push(Seen {
            version: request.version(),
            sni: sni.clone(),
            client_certificate,
            authority: request
                .uri()
                .authority()
                .map(|a| a.to_string())
                .or_else(|| {
                    request
                        .headers()
                        .get("host")
                        .and_then(|h| h.to_str().ok())
                        .map(str::to_owned)
                }),
        });
        async { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("ok")))) }
    });
    if h2 {
        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .serve_connection(io, service)
            .await;
    } else {
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    }
}

const HTTP1_ONLY: &[&[u8]] = &[b"http/1.1"];
const H2_AND_HTTP1: &[&[u8]] = &[b"h2", b"http/1.1"];

#[tokio::test]
async fn an_https_upstream_is_verified_against_its_ca_file_and_named_by_sni() {
    let dir = certificates();
    let upstream = ProtocolUpstream::tls(&dir, "server", HTTP1_ONLY, false).await;
    let d = dir.display();
    let toml = Config::new()
        .upstream(
            "secure",
            &[
                &format!(r#"url = "https://127.0.0.1:{}""#, upstream.port),
                &format!(r#"ca_file = "{d}/ca.crt""#),
                r#"server_name = "localhost""#,
            ],
        )
        .route(Route::new("all").upstream("secure"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    for _ in 0..3 {
        let answer = client.get(&gate.url("/x"), &[]).await;
        assert_eq!(answer.status, 200, "{}", answer.text());
        assert_eq!(answer.text(), "ok");
    }
    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    for s in &seen {
        assert_eq!(s.version, Version::HTTP_11);
        assert_eq!(s.sni.as_deref(), Some("localhost"));
        assert!(!s.client_certificate);
    }
    assert_eq!(
        upstream.connections.load(Ordering::SeqCst),
        1,
        "TLS connections are kept and reused"
    );
}

#[tokio::test]
async fn an_upstream_certificate_no_trusted_ca_signed_is_a_502_whose_log_says_why() {
    let dir = certificates();
    issue(
        &dir,
        "stranger",
        "impostor",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    let upstream = ProtocolUpstream::tls(&dir, "impostor", HTTP1_ONLY, false).await;
    let port = support::free_port();
    let d = dir.display();
    let config = Config::new()
        .listen_on(port)
        .upstream(
            "secure",
            &[
                &format!(r#"url = "https://127.0.0.1:{}""#, upstream.port),
                &format!(r#"ca_file = "{d}/ca.crt""#),
            ],
        )
        .route(Route::new("all").upstream("secure"))
        .write("upstream-cert");
    let log = dir.join("floodgate.log");
    let gate = FloodgateProcess::spawn_limited(&config, port, 4096, 4096, Some(&log)).await;
    let answer = TestClient::http1().get(&gate.url("/x"), &[]).await;
    let (status, detail) = answer.problem();
    assert_eq!(status, 502);
    assert_eq!(detail, "the upstream is unreachable");
    assert!(upstream.seen().is_empty(), "no request crossed");
    drop(gate);
    let log = std::fs::read_to_string(&log).expect("log");
    assert!(
        log.lines().any(|l| l.contains("upstream unreachable")
            && l.contains("TLS handshake failed")
            && l.contains("UnknownIssuer")),
        "{log}"
    );
}

#[tokio::test]
async fn a_client_certificate_is_presented_to_an_upstream_that_asks_for_one() {
    let dir = certificates();
    let upstream = ProtocolUpstream::tls(&dir, "server", HTTP1_ONLY, true).await;
    let d = dir.display();
    let url = format!(r#"url = "https://127.0.0.1:{}""#, upstream.port);
    let ca = format!(r#"ca_file = "{d}/ca.crt""#);
    let toml = Config::new()
        .upstream(
            "with_cert",
            &[
                &url,
                &ca,
                &format!(r#"cert_file = "{d}/client.crt""#),
                &format!(r#"key_file = "{d}/client.key""#),
            ],
        )
        .upstream("without_cert", &[&url, &ca])
        .route(
            Route::new("with")
                .matching(r#"path_prefix = "/with/""#)
                .upstream("with_cert"),
        )
        .route(Route::new("without").upstream("without_cert"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    let client = TestClient::http1();
    let with = client.get(&gate.url("/with/x"), &[]).await;
    assert_eq!(with.status, 200, "{}", with.text());
    let without = client.get(&gate.url("/without"), &[]).await;
    assert_eq!(without.status, 502);
    let seen = upstream.seen();
    assert_eq!(seen.len(), 1, "only the request with a certificate crossed");
    assert!(seen[0].client_certificate);
}

#[tokio::test]
async fn http2_upstreams_by_alpn_and_by_prior_knowledge_share_one_connection() {
    let dir = certificates();
    let over_tls = ProtocolUpstream::tls(&dir, "server", H2_AND_HTTP1, false).await;
    let cleartext = ProtocolUpstream::start(&dir, Listening::H2c).await;
    let d = dir.display();
    let toml = Config::new()
        .upstream(
            "tls",
            &[
                &format!(r#"url = "https://localhost:{}""#, over_tls.port),
                &format!(r#"ca_file = "{d}/ca.crt""#),
            ],
        )
        .upstream(
            "cleartext",
            &[
                &format!(r#"url = "http://127.0.0.1:{}""#, cleartext.port),
                r#"protocol = "h2c""#,
            ],
        )
        .route(
            Route::new("tls")
                .matching(r#"path_prefix = "/tls/""#)
                .upstream("tls"),
        )
        .route(Route::new("cleartext").upstream("cleartext"))
        .toml();
    let gate = Floodgate::start(&toml).await;
    // HTTP/1.1 and HTTP/2 clients alike, many requests at once.
    for client in [TestClient::http1(), TestClient::h2c()] {
        let mut calls = tokio::task::JoinSet::new();
        for i in 0..20 {
            let client = client.clone();
            let url = gate.url(&format!("/{}/{i}", if i % 2 == 0 { "tls" } else { "x" }));
            calls.spawn(async move { client.get(&url, &[]).await });
        }
        while let Some(answer) = calls.join_next().await {
            let answer = answer.expect("call");
            assert_eq!(answer.status, 200, "{}", answer.text());
        }
    }
    for (upstream, authority) in [
        (&over_tls, format!("localhost:{}", over_tls.port)),
        (&cleartext, format!("127.0.0.1:{}", cleartext.port)),
    ] {
        let seen = upstream.seen();
        assert_eq!(seen.len(), 20);
        assert!(
            seen.iter().all(|s| s.version == Version::HTTP_2),
            "{seen:?}"
        );
        assert!(
            seen.iter()
                .all(|s| s.authority.as_deref() == Some(&authority)),
            "{seen:?}"
        );
        assert_eq!(upstream.connections.load(Ordering::SeqCst), 1);
    }
}
