//! Verification keys from the files a route names: an HMAC secret, a PEM
//! public key (SubjectPublicKeyInfo, read with just enough DER), or a JWK
//! Set.

use base64::Engine as _;
use ring::signature::RsaPublicKeyComponents;
use serde::Deserialize;

use super::{Algorithm, Key};

/// An HMAC key from a secret.
pub fn hmac_key(secret: &[u8]) -> Key {
    Key::Hmac(ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret))
}

/// The key of a PEM `PUBLIC KEY` (SubjectPublicKeyInfo) for `algorithm`.
pub fn pem_key(pem: &[u8], algorithm: Algorithm) -> Result<Key, String> {
    use rustls_pki_types::SubjectPublicKeyInfoDer;
    use rustls_pki_types::pem::PemObject as _;
    let spki = SubjectPublicKeyInfoDer::from_pem_slice(pem)
        .map_err(|e| format!("no PEM PUBLIC KEY in it ({e})"))?;
    let (oid, key) = spki_parts(spki.as_ref()).ok_or("its PUBLIC KEY is not valid DER")?;
    match algorithm {
        Algorithm::Rs256 if oid == RSA_ENCRYPTION => {
            let mut seq = Der::new(Der::new(key).take(0x30).ok_or("bad RSA key")?);
            let n = seq.take(0x02).ok_or("bad RSA modulus")?;
            let e = seq.take(0x02).ok_or("bad RSA exponent")?;
            Ok(Key::Rsa(RsaPublicKeyComponents {
                n: strip_zeros(n).to_vec(),
                e: strip_zeros(e).to_vec(),
            }))
        }
        Algorithm::Es256 if oid == EC_PUBLIC_KEY => {
            if key.len() != 65 || key[0] != 4 {
                return Err("its EC key is not an uncompressed P-256 point".into());
            }
            Ok(Key::Ec(key.to_vec()))
        }
        Algorithm::Hs256 => Err("HS256 takes secret_file, not a public key".into()),
        _ => Err(format!("its key is not a {} key", algorithm.name())),
    }
}

#[derive(Deserialize)]
struct Jwks {
    keys: Vec<Jwk>,
}

#[derive(Deserialize)]
struct Jwk {
    kty: String,
    #[serde(default)]
    kid: Option<String>,
    #[serde(default)]
    alg: Option<String>,
    #[serde(default, rename = "use")]
    usage: Option<String>,
    #[serde(default)]
    n: Option<String>,
    #[serde(default)]
    e: Option<String>,
    #[serde(default)]
    crv: Option<String>,
    #[serde(default)]
    x: Option<String>,
    #[serde(default)]
    y: Option<String>,
    #[serde(default)]
    k: Option<String>,
}

/// The keys of a JWK Set (RFC 7517) usable with `algorithm`: keys of
/// another type, another `alg` or another `use` than `sig` are left out.
pub fn jwks_keys(json: &[u8], algorithm: Algorithm) -> Result<Vec<(Option<String>, Key)>, String> {
    let set: Jwks =
        serde_json::from_slice(json).map_err(|e| format!("it is not a JWK Set: {e}"))?;
    let field = |v: &Option<String>, name: &str| -> Result<Vec<u8>, String> {
        let text = v.as_deref().ok_or(format!("a key lacks \"{name}\""))?;
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text.trim_end_matches('='))
            .map_err(|_| format!("a key's \"{name}\" is not base64url"))
    };
    let mut keys = Vec::new();
    for jwk in &set.keys {
        if jwk.alg.as_deref().is_some_and(|a| a != algorithm.name())
            || jwk.usage.as_deref().is_some_and(|u| u != "sig")
        {
            continue;
        }
        let key = match (algorithm, jwk.kty.as_str()) {
            (Algorithm::Rs256, "RSA") => Key::Rsa(RsaPublicKeyComponents {
                n: strip_zeros(&field(&jwk.n, "n")?).to_vec(),
                e: strip_zeros(&field(&jwk.e, "e")?).to_vec(),
            }),
            (Algorithm::Es256, "EC") if jwk.crv.as_deref() == Some("P-256") => {
                let (x, y) = (field(&jwk.x, "x")?, field(&jwk.y, "y")?);
                if x.len() != 32 || y.len() != 32 {
                    return Err("a P-256 key's x and y must be 32 bytes each".into());
                }
                let mut point = Vec::with_capacity(65);
                point.push(4);
                point.extend_from_slice(&x);
                point.extend_from_slice(&y);
                Key::Ec(point)
            }
            (Algorithm::Hs256, "oct") => hmac_key(&field(&jwk.k, "k")?),
            _ => continue,
        };
        keys.push((jwk.kid.clone(), key));
    }
    if keys.is_empty() {
        return Err(format!("it holds no {} signing key", algorithm.name()));
    }
    Ok(keys)
}

const RSA_ENCRYPTION: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
const EC_PUBLIC_KEY: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
const P256: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];

/// The algorithm OID and the key bits of a SubjectPublicKeyInfo; an EC key
/// must be on P-256.
fn spki_parts(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let mut spki = Der::new(Der::new(der).take(0x30)?);
    let mut algorithm = Der::new(spki.take(0x30)?);
    let oid = algorithm.take(0x06)?;
    if oid == EC_PUBLIC_KEY && algorithm.take(0x06)? != P256 {
        return None;
    }
    let bits = spki.take(0x03)?;
    // No unused bits in a key.
    let (&0, key) = bits.split_first()? else {
        return None;
    };
    Some((oid, key))
}

fn strip_zeros(mut n: &[u8]) -> &[u8] {
    while let [0, rest @ ..] = n {
        n = rest;
    }
    n
}

/// Just enough DER to read a public key: definite lengths, one-byte tags.
struct Der<'a>(&'a [u8]);

impl<'a> Der<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        Self(bytes)
    }

    /// The contents of the next element, which must have `tag`.
    fn take(&mut self, tag: u8) -> Option<&'a [u8]> {
        let (&t, rest) = self.0.split_first()?;
        if t != tag {
            return None;
        }
        let (&first, mut rest) = rest.split_first()?;
        let len = if first < 0x80 {
            usize::from(first)
        } else {
            let count = usize::from(first & 0x7f);
            if count == 0 || count > 4 {
                return None;
            }
            let (bytes, after) = rest.split_at_checked(count)?;
            rest = after;
            bytes.iter().fold(0usize, |n, &b| (n << 8) | usize::from(b))
        };
        let (contents, after) = rest.split_at_checked(len)?;
        self.0 = after;
        Some(contents)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_are_read_in_both_forms() {
        let long = [0x04, 0x81, 0x03, 1, 2, 3];
        assert_eq!(Der::new(&long).take(0x04), Some(&[1u8, 2, 3][..]));
        assert_eq!(Der::new(&[0x04, 0x05, 1]).take(0x04), None);
        assert_eq!(Der::new(&[0x05, 0x00]).take(0x04), None);
    }
}
