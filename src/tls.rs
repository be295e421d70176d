//! TLS on the proxy listener: a certificate chain and key from PEM files,
//! optionally a CA that client certificates must chain to (mTLS), made into
//! the rustls configuration new connections are accepted with.
//!
//! TLS 1.2 and 1.3 only, ALPN `h2` then `http/1.1`. The files are read when
//! the configuration is loaded, so `--check` and a reload refuse a missing,
//! malformed or mismatched certificate or key with the file's name, and a
//! reload that changes them gives new connections the new certificate while
//! open ones keep theirs.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

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
