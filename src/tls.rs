//! TLS on both sides, as rustls configuration. On the proxy listener: a
//! certificate chain and key from PEM files, optionally a CA that client
//! certificates must chain to (mTLS), made into the configuration new
//! connections are accepted with. To `https://` upstreams: the system's
//! roots or the upstream's own `ca_file`, the name the upstream's
//! certificate must carry, ALPN for its protocol, and optionally a client
//! certificate.
//!
//! TLS 1.2 and 1.3 only, ALPN `h2` then `http/1.1`. The files are read when
//! the configuration is loaded, so `--check` and a reload refuse a missing,
//! malformed or mismatched certificate or key with the file's name, and a
//! reload that changes them gives new connections the new certificate while
//! open ones keep theirs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use std::sync::OnceLock;

use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::proxy::settings::{Protocol, UpstreamTls, UpstreamTlsFiles};

/// Where the listener's certificate, key and client CA are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerTls {
    /// The certificate chain, leaf first (PEM).
    pub cert_file: PathBuf,
    /// The leaf's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// When set, clients must present a certificate that chains to one of
    /// these (PEM).
    pub client_ca_file: Option<PathBuf>,
}

/// Why the files could not be made into a TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no PEM object of the kind wanted.
    #[error("{} holds no {what} in PEM form", path.display())]
    NoPem {
        /// The file.
        path: PathBuf,
        /// What was looked for.
        what: &'static str,
    },
    /// rustls refused the certificate and key (for instance, the key is not
    /// the certificate's).
    #[error("{} and {} do not make a usable certificate: {reason}", cert.display(), key.display())]
    Certificate {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        reason: String,
    },
    /// The upstream's CA file's certificates cannot verify servers.
    #[error("{} cannot verify upstream certificates: {reason}", path.display())]
    UpstreamCa {
        /// The file.
        path: PathBuf,
        /// rustls's reason.
        reason: String,
    },
    /// The name upstream certificates are checked against is not a DNS name
    /// or an IP address.
    #[error("{name:?} is not a DNS name or IP address to check a certificate against")]
    ServerName {
        /// The name.
        name: String,
    },
    /// The client CA file's certificates cannot verify clients.
    #[error("{} cannot verify client certificates: {reason}", path.display())]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// rustls's reason.
        reason: String,
    },
}

/// The ALPN protocols offered, in order of preference.
pub const ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

impl ListenerTls {
    /// Reads the files and builds the configuration connections are
    /// accepted with.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let certs = certificates(&self.cert_file)?;
        let key_pem = read(&self.key_file)?;
        let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoPem {
            path: self.key_file.clone(),
            what: "private key",
        })?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| self.certificate_error(e.to_string()))?;
        let builder = match &self.client_ca_file {
            None => builder.with_no_client_auth(),
            Some(path) => {
                let mut roots = rustls::RootCertStore::empty();
                for ca in certificates(path)? {
                    roots.add(ca).map_err(|e| TlsError::ClientCa {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| TlsError::ClientCa {
                            path: path.clone(),
                            reason: e.to_string(),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| self.certificate_error(e.to_string()))?;
        config.alpn_protocols = ALPN.iter().map(|p| p.to_vec()).collect();
        Ok(Arc::new(config))
    }

    /// The files a change of which should reload the configuration.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        [
            Some(&self.cert_file),
            Some(&self.key_file),
            self.client_ca_file.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(PathBuf::as_path)
    }

    fn certificate_error(&self, reason: String) -> TlsError {
        TlsError::Certificate {
            cert: self.cert_file.clone(),
            key: self.key_file.clone(),
            reason,
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Every certificate in the PEM file at `path`; at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|_| TlsError::NoPem {
            path: path.to_owned(),
            what: "certificate",
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            path: path.to_owned(),
            what: "certificate",
        });
    }
    Ok(certs)
}

// Built here, where certificates are read, rather than beside the type:
// the settings module stays plain data.
impl UpstreamTls {
    /// Reads `files` and builds TLS to an upstream called `server_name`
    /// that speaks `protocol`.
    pub fn new(
        files: UpstreamTlsFiles,
        server_name: &str,
        protocol: Protocol,
    ) -> Result<Self, TlsError> {
        let name = ServerName::try_from(server_name.trim_matches(['[', ']']).to_owned()).map_err(
            |_| TlsError::ServerName {
                name: server_name.to_owned(),
            },
        )?;
        let alpn: &[&[u8]] = match protocol {
            Protocol::Auto => &ALPN,
            Protocol::H2 => &[b"h2"],
            Protocol::Http1 | Protocol::H2c => &[b"http/1.1"],
        };
        let base = files.client_config()?;
        let with_alpn = |protocols: &[&[u8]]| {
            let mut config = base.clone();
            config.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
            Arc::new(config)
        };
        Ok(Self {
            server_name: name,
            config: with_alpn(alpn),
            http1_config: with_alpn(&[b"http/1.1"]),
            files,
        })
    }
}

impl UpstreamTlsFiles {
    /// The rustls client configuration, without ALPN.
    fn client_config(&self) -> Result<ClientConfig, TlsError> {
        let roots = match &self.ca_file {
            None => Arc::clone(system_roots()),
            Some(path) => {
                let mut roots = RootCertStore::empty();
                for ca in certificates(path)? {
                    roots.add(ca).map_err(|e| TlsError::UpstreamCa {
                        path: path.clone(),
                        reason: e.to_string(),
                    })?;
                }
                Arc::new(roots)
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])
            .map_err(|e| TlsError::UpstreamCa {
                path: self.ca_file.clone().unwrap_or_default(),
                reason: e.to_string(),
            })?
            .with_root_certificates(roots);
        match (&self.cert_file, &self.key_file) {
            (Some(cert_file), Some(key_file)) => {
                let certs = certificates(cert_file)?;
                let key_pem = read(key_file)?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|_| TlsError::NoPem {
                    path: key_file.clone(),
                    what: "private key",
                })?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| TlsError::Certificate {
                        cert: cert_file.clone(),
                        key: key_file.clone(),
                        reason: e.to_string(),
                    })
            }
            // The configuration refuses one without the other.
            _ => Ok(builder.with_no_client_auth()),
        }
    }
}

/// The system's trusted roots, read once. Certificates that cannot be
/// parsed are skipped; with none at all, upstream certificates verify only
/// against an upstream's own `ca_file`.
fn system_roots() -> &'static Arc<RootCertStore> {
    static ROOTS: OnceLock<Arc<RootCertStore>> = OnceLock::new();
    ROOTS.get_or_init(|| {
        let found = rustls_native_certs::load_native_certs();
        for e in &found.errors {
            tracing::warn!(error = %e, "a system root certificate could not be read");
        }
        let mut roots = RootCertStore::empty();
        let (added, _ignored) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            tracing::warn!(
                "no system root certificates found; https upstreams need their own ca_file"
            );
        }
        Arc::new(roots)
    })
}
