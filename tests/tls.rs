//! Redis over TLS: a redis-server with a test CA and certificates made here
//! with openssl; floodgate trusts the CA it is given, presents a client
//! certificate when Redis demands one, and refuses a server it cannot trust.

mod support;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::certs::certificates;
use support::config::{Config, Route};
use support::redis::unique_prefix;
use support::{Floodgate, TestClient, free_port};

struct TlsRedis {
    child: Child,
    port: u16,
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn tls_redis(dir: &Path, clients_must_authenticate: bool) -> TlsRedis {
    let port = free_port();
    let child = Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ])
        .args([
            "--tls-cert-file",
            "server.crt",
            "--tls-key-file",
            "server.key",
            "--tls-ca-cert-file",
            "ca.crt",
        ])
        .args([
            "--tls-auth-clients",
            if clients_must_authenticate {
                "yes"
            } else {
                "no"
            },
        ])
        .args(["--save", "", "--appendonly", "no"])
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server with TLS");
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "TLS redis-server did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    TlsRedis { child, port }
}

fn config(dir: &Path, port: u16, tls: &str) -> String {
    let mut config = Config::new()
        .admin()
        .redis(&format!("rediss://127.0.0.1:{port}"), &unique_prefix("tls"))
        .store(r#"timeout = "500ms""#)
        .store(r#"on_error = "deny""#);
    for line in tls.lines().filter(|l| !l.trim().is_empty()) {
        config = config.store(&line.replace("{dir}", &dir.display().to_string()));
    }
    config
        .route(
            Route::new("api")
                .respond("status = 200")
                .limit("sliding_log", 2, "1h"),
        )
        .toml()
}

async fn statuses(gate: &Floodgate, n: usize) -> Vec<u16> {
    let client = TestClient::http1();
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(client.get(&gate.url("/"), &[]).await.status.as_u16());
    }
    out
}

#[tokio::test]
async fn floodgate_limits_through_rediss_with_the_ca_it_is_given() {
    let dir = certificates();
    let redis = tls_redis(&dir, false).await;
    let ca = format!("tls_ca_file = \"{}/ca.crt\"", dir.display());
    let gate = Floodgate::start(&config(&dir, redis.port, &ca)).await;
    assert_eq!(statuses(&gate, 3).await, [200, 200, 429]);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn floodgate_presents_its_client_certificate_when_redis_requires_one() {
    let dir = certificates();
    let redis = tls_redis(&dir, true).await;
    let with_cert = format!(
        "tls_ca_file = \"{d}/ca.crt\"\ntls_cert_file = \"{d}/client.crt\"\ntls_key_file = \"{d}/client.key\"",
        d = dir.display()
    );
    let gate = Floodgate::start(&config(&dir, redis.port, &with_cert)).await;
    assert_eq!(statuses(&gate, 3).await, [200, 200, 429]);
    // Without it, Redis refuses the handshake: a configuration error, so
    // floodgate does not start (on_error is for a store that went away).
    let ca_only = format!("tls_ca_file = \"{}/ca.crt\"", dir.display());
    let refused = Floodgate::start_refused(&config(&dir, redis.port, &ca_only)).await;
    assert!(refused.contains("tls_cert_file"), "{refused}");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_server_signed_by_an_untrusted_ca_is_refused() {
    let dir = certificates();
    let redis = tls_redis(&dir, false).await;
    for trust in [
        format!("tls_ca_file = \"{}/stranger.crt\"", dir.display()),
        // The system's roots do not include the test CA either.
        String::new(),
    ] {
        // A certificate refused is a configuration error, not an outage:
        // floodgate does not start, and says which settings to check.
        let refused = Floodgate::start_refused(&config(&dir, redis.port, &trust)).await;
        assert!(
            refused.contains("TLS") && refused.contains("tls_ca_file"),
            "{trust:?}: {refused}"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
