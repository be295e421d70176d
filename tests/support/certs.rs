//! Certificates for the TLS tests, made with openssl in a fresh directory:
//! a CA, certificates it signs, and a stranger CA nobody trusts.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn openssl(dir: &Path, args: &[&str]) {
    let ok = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "openssl {args:?} failed");
}

/// A CA named `name`, and a certificate it signed for `cn` with `ext`.
pub fn issue(dir: &Path, ca: &str, cn: &str, ext: &str) {
    std::fs::write(dir.join(format!("{cn}.ext")), ext).expect("write ext");
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{cn}.key"),
            "-out",
            &format!("{cn}.csr"),
            "-subj",
            &format!("/CN={cn}"),
        ],
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &format!("{cn}.csr"),
            "-CA",
            &format!("{ca}.crt"),
            "-CAkey",
            &format!("{ca}.key"),
            "-CAcreateserial",
            "-out",
            &format!("{cn}.crt"),
            "-days",
            "2",
            "-extfile",
            &format!("{cn}.ext"),
        ],
    );
}

pub fn new_ca(dir: &Path, name: &str) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.crt"),
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
        ],
    );
}

/// Certificates: the CA floodgate is given, a server certificate for
/// 127.0.0.1 it signed, a client certificate it signed, and a stranger CA.
pub fn certificates() -> PathBuf {
    let dir = super::temp_dir("tls");
    new_ca(&dir, "ca");
    new_ca(&dir, "stranger");
    issue(
        &dir,
        "ca",
        "server",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    issue(&dir, "ca", "client", "extendedKeyUsage=clientAuth\n");
    dir
}
