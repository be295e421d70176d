//! TLS on the proxy listener: certificates made here with openssl, a real
//! rustls client, hyper speaking HTTP/2 or HTTP/1.1 as ALPN decided, a
//! certificate renewed under load, client certificates (mTLS), and `--check`
//! naming a bad file.

mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use support::certs::{certificates, issue};
use support::config::{Config, Route};
use support::{Floodgate, Upstream};

/// What one request over a new TLS connection brought back.
struct TlsAnswer {
    status: StatusCode,
    version: Version,
    body: Bytes,
    /// The leaf certificate the server presented.
    leaf: Vec<u8>,
}

/// A rustls client trusting `dir/ca.crt`, offering `alpn`, presenting
/// `client` (a certificate and key name in `dir`) if given.
fn client_config(dir: &Path, alpn: &[&[u8]], client: Option<&str>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(dir.join("ca.crt")).expect("ca.crt") {
        roots.add(ca.expect("ca")).expect("add ca");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots);
    let mut config = match client {
        None => builder.with_no_client_auth(),
        Some(name) => {
            let certs = CertificateDer::pem_file_iter(dir.join(format!("{name}.crt")))
                .expect("client cert")
                .collect::<Result<Vec<_>, _>>()
                .expect("client certs");
            let key = PrivateKeyDer::from_pem_file(dir.join(format!("{name}.key"))).expect("key");
            builder
                .with_client_auth_cert(certs, key)
                .expect("client auth")
        }
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(config)
}

/// GET `path` on a new TLS connection to `gate`.
async fn get(
    gate: &Floodgate,
    config: Arc<rustls::ClientConfig>,
    path: &str,
) -> Result<TlsAnswer, String> {
    let tcp = tokio::net::TcpStream::connect(gate.addr)
        .await
        .map_err(|e| e.to_string())?;
    let name = ServerName::try_from("localhost").map_err(|e| e.to_string())?;
    let tls = tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let request = Request::get(format!("https://localhost{path}"))
        .body(Empty::<Bytes>::new())
        .map_err(|e| e.to_string())?;
    let response = if h2 {
        let (mut send, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        send.send_request(request)
            .await
            .map_err(|e| e.to_string())?
    } else {
        let (mut send, connection) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(connection);
        let mut request = request;
        request.headers_mut().insert(
            http::header::HOST,
            http::HeaderValue::from_static("localhost"),
        );
        send.send_request(request)
            .await
            .map_err(|e| e.to_string())?
    };
    let (parts, body) = response.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(TlsAnswer {
        status: parts.status,
        version: parts.version,
        body,
        leaf,
    })
}

/// A configuration serving TLS with `dir/cert_name.crt` and `.key`,
/// forwarding everything to `upstream`, plus `extra` lines in `[server.tls]`.
fn tls_config(dir: &Path, cert_name: &str, upstream: &str, extra: &str) -> Config {
    let d = dir.display();
    Config::new()
        .server(&format!(
            "tls = {{ cert_file = \"{d}/{cert_name}.crt\", key_file = \"{d}/{cert_name}.key\"{extra} }}"
        ))
        .route(Route::new("all").upstream(upstream))
}

#[tokio::test]
async fn the_tls_listener_speaks_h2_and_http_1_1_as_alpn_decides() {
    let dir = certificates();
    let upstream = Upstream::start().await;
    let gate = Floodgate::start(&tls_config(&dir, "server", &upstream.url(), "").toml()).await;
    for (alpn, version) in [
        (&b"h2"[..], Version::HTTP_2),
        (&b"http/1.1"[..], Version::HTTP_11),
    ] {
        let answer = get(&gate, client_config(&dir, &[alpn], None), "/x")
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!((answer.status, answer.version), (StatusCode::OK, version));
        let echo: serde_json::Value = serde_json::from_slice(&answer.body).expect("echo");
        let proto = echo["headers"]
            .as_array()
            .and_then(|h| h.iter().find(|p| p[0] == "x-forwarded-proto"))
            .map(|p| p[1].clone());
        assert_eq!(proto, Some("https".into()), "{echo}");
    }
    // A plain-text request on the TLS port is no request.
    let plain = support::TestClient::http1();
    let refused = plain.try_get(&gate.url("/x")).await;
    assert!(
        refused.is_err(),
        "plain HTTP was served on the TLS listener"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_renewed_certificate_is_served_under_load_without_a_failed_request() {
    let dir = certificates();
    issue(
        &dir,
        "ca",
        "renewed",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    // The files floodgate reads, which the renewal replaces.
    for ext in ["crt", "key"] {
        std::fs::copy(
            dir.join(format!("server.{ext}")),
            dir.join(format!("live.{ext}")),
        )
        .expect("copy");
    }
    let upstream = Upstream::start().await;
    let path = tls_config(&dir, "live", &upstream.url(), "").write("tls-renewal");
    let gate = Floodgate::start_file(&path).await;
    let config = client_config(&dir, &[b"h2", b"http/1.1"], None);
    let old_leaf = get(&gate, Arc::clone(&config), "/")
        .await
        .expect("first")
        .leaf;

    let renew = {
        let dir = dir.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(700)).await;
            // Each file replaced whole, as certificate tools do.
            for ext in ["key", "crt"] {
                let staged = dir.join(format!("staged.{ext}"));
                std::fs::copy(dir.join(format!("renewed.{ext}")), &staged).expect("stage");
                std::fs::rename(&staged, dir.join(format!("live.{ext}"))).expect("rename");
            }
        })
    };
    let mut leaves = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while tokio::time::Instant::now() < deadline {
        let answer = get(&gate, Arc::clone(&config), "/")
            .await
            .unwrap_or_else(|e| panic!("a request failed during the renewal: {e}"));
        assert_eq!(answer.status, StatusCode::OK);
        let renewed = answer.leaf != old_leaf;
        leaves.push(renewed);
        if leaves.iter().rev().take(20).filter(|r| **r).count() == 20 {
            break;
        }
    }
    renew.await.expect("renewal");
    assert!(
        leaves.iter().any(|r| !r),
        "the old certificate was never seen"
    );
    assert!(
        leaves.iter().rev().take(20).all(|r| *r),
        "the renewed certificate was not served: {} requests",
        leaves.len()
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn with_a_client_ca_only_clients_with_its_certificates_are_served() {
    let dir = certificates();
    let upstream = Upstream::start().await;
    let ca = format!(", client_ca_file = \"{}/ca.crt\"", dir.display());
    let gate = Floodgate::start(&tls_config(&dir, "server", &upstream.url(), &ca).toml()).await;
    let with_cert = get(&gate, client_config(&dir, &[b"h2"], Some("client")), "/")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(with_cert.status, StatusCode::OK);
    let without = get(&gate, client_config(&dir, &[b"h2"], None), "/").await;
    assert!(without.is_err(), "served a client without a certificate");
    assert_eq!(upstream.hits(), 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// `floodgate --check` on `config`: exit code and what it printed.
fn check(config: &Path) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .args(["--check", "--config"])
        .arg(config)
        .output()
        .expect("run --check");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn check_names_a_missing_or_mismatched_certificate_file() {
    let dir = certificates();
    let write = |name: &str, cert: &str, key: &str| -> PathBuf {
        let path = dir.join(name);
        let toml = Config::new()
            .server(&format!(
                "tls = {{ cert_file = \"{cert}\", key_file = \"{key}\" }}"
            ))
            .route(Route::new("all"))
            .toml();
        std::fs::write(&path, toml).expect("write config");
        path
    };
    let good = write("good.toml", "server.crt", "server.key");
    assert_eq!(check(&good).0, Some(0), "{}", check(&good).1);
    let (code, said) = check(&write("mismatched.toml", "server.crt", "client.key"));
    assert_eq!(code, Some(1));
    assert!(
        said.contains("mismatched.toml:")
            && said.contains("server.crt")
            && said.contains("client.key"),
        "{said}"
    );
    let (code, said) = check(&write("missing.toml", "nowhere.crt", "server.key"));
    assert_eq!(code, Some(1));
    assert!(said.contains("nowhere.crt"), "{said}");
    let (code, said) = check(&write("not-pem.toml", "server.ext", "server.key"));
    assert_eq!(code, Some(1));
    assert!(
        said.contains("server.ext") && said.contains("no certificate"),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
