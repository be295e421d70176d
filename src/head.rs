//! Whether a request head has one meaning: a method spelled as RFC 9110
//! spells it, one well-formed host, no CONNECT.
//!
//! floodgate counts a request by what it reads in the head, and the upstream
//! acts on what it reads there. Where the two could read it differently (two
//! `Host` lines, `post` that a case-insensitive server takes for `POST`), the
//! request is refused before it is counted or forwarded.

use std::net::Ipv6Addr;

use http::request::Parts;
use http::{HeaderValue, Method, StatusCode, Version};

/// Why a request head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeadError {
    /// An HTTP/1.1 request without `Host`.
    #[error("an HTTP/1.1 request needs a Host header")]
    MissingHost,
    /// More than one `Host` line.
    #[error("the Host header must be sent once")]
    RepeatedHost,
    /// A `Host` that is no host.
    #[error("the Host header is not a host name or address, with an optional port")]
    BadHost,
    /// `user@` in an absolute-form request target.
    #[error("the request target must not carry user information")]
    Userinfo,
    /// CONNECT: floodgate is no tunnel.
    #[error("CONNECT is not served here")]
    Connect,
    /// `post`, `Get`: a standard method spelled in another case.
    #[error("methods are case-sensitive; send {0}")]
    MethodCase(&'static str),
}

impl HeadError {
    /// The status a client gets for it.
    pub fn status(self) -> StatusCode {
        match self {
            Self::Connect => StatusCode::METHOD_NOT_ALLOWED,
            _ => StatusCode::BAD_REQUEST,
        }
    }
}

/// The methods RFC 9110 and RFC 5789 define.
const STANDARD: [&str; 9] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
];

/// The standard method `method` spells in another case, if it does
/// (`post` → `POST`); `None` for standard spellings and other methods.
pub fn miscased_standard(method: &Method) -> Option<&'static str> {
    let text = method.as_str();
    // Standard spellings are all upper case: the common case ends here.
    if !text.bytes().any(|b| b.is_ascii_lowercase()) {
        return None;
    }
    STANDARD
        .into_iter()
        .find(|standard| *standard != text && standard.eq_ignore_ascii_case(text))
}

/// Checks the head and returns the host the request names: the target's
/// authority (absolute form, or HTTP/2's `:authority`), else `Host`.
pub fn check(head: &Parts) -> Result<Option<&str>, HeadError> {
    if head.method == Method::CONNECT {
        return Err(HeadError::Connect);
    }
    let mut hosts = head.headers.get_all(http::header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(HeadError::RepeatedHost);
    }
    if let Some(value) = host
        && !is_host(value)
    {
        return Err(HeadError::BadHost);
    }
    if let Some(authority) = head.uri.authority() {
        if authority.as_str().contains('@') {
            return Err(HeadError::Userinfo);
        }
        return Ok(Some(authority.as_str()));
    }
    match host {
        // `is_host` let only ASCII through: UTF-8 checked by words.
        Some(value) => Ok(std::str::from_utf8(value.as_bytes()).ok()),
        None if head.version == Version::HTTP_11 => Err(HeadError::MissingHost),
        None => Ok(None),
    }
}

/// The bytes a host name (or an IPv4 address) is made of: letters,
/// digits, `-`, `.` and `_`. A table: one load a byte, on every request.
const NAME_BYTE: [bool; 256] = {
    let mut table = [false; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        table[b] = c.is_ascii_alphanumeric() || c == b'-' || c == b'.' || c == b'_';
        b += 1;
    }
    table
};

/// `name`, `name:port`, `v4:port` or `[v6]:port`, nothing else. Read byte
/// by byte: this runs on every request.
fn is_host(value: &HeaderValue) -> bool {
    let bytes = value.as_bytes();
    let (name_ok, port) = if let Some(rest) = bytes.strip_prefix(b"[") {
        let Some(close) = rest.iter().position(|&b| b == b']') else {
            return false;
        };
        let v6 = std::str::from_utf8(&rest[..close])
            .ok()
            .and_then(|t| t.parse::<Ipv6Addr>().ok());
        match &rest[close + 1..] {
            [] => (v6.is_some(), None),
            [b':', port @ ..] => (v6.is_some(), Some(port)),
            _ => return false,
        }
    } else {
        let (name, port) = match bytes.iter().position(|&b| b == b':') {
            Some(colon) => (&bytes[..colon], Some(&bytes[colon + 1..])),
            None => (bytes, None),
        };
        let name_ok = !name.is_empty() && name.iter().all(|&b| NAME_BYTE[usize::from(b)]);
        (name_ok, port)
    };
    name_ok
        && port.is_none_or(|p| {
            (1..=5).contains(&p.len())
                && p.iter().all(u8::is_ascii_digit)
                && p.iter().fold(0u32, |n, &d| n * 10 + u32::from(d - b'0')) <= 65_535
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(method: &str, target: &str, version: Version, hosts: &[&str]) -> Parts {
        let mut builder = http::Request::builder()
            .method(method)
            .uri(target)
            .version(version);
        for h in hosts {
            builder = builder.header(http::header::HOST, *h);
        }
        builder
            .body(())
            .unwrap_or_else(|e| panic!("test request: {e}"))
            .into_parts()
            .0
    }

    #[test]
    fn one_well_formed_host_is_required_in_http_1_1() {
        let h11 = Version::HTTP_11;
        assert_eq!(
            check(&head("GET", "/", h11, &["api.example.com"])),
            Ok(Some("api.example.com"))
        );
        assert_eq!(
            check(&head("GET", "/", h11, &["[::1]:8080"])),
            Ok(Some("[::1]:8080"))
        );
        assert_eq!(
            check(&head("GET", "/", h11, &[])),
            Err(HeadError::MissingHost)
        );
        assert_eq!(check(&head("GET", "/", Version::HTTP_10, &[])), Ok(None));
        assert_eq!(
            check(&head("GET", "/", h11, &["a.example", "b.example"])),
            Err(HeadError::RepeatedHost)
        );
        for bad in [
            "a b", "a/b", "user@a", "a:port", "", "a:99999", "a,b", "a:", "[::1", "[x]:1", "a:1:2",
        ] {
            assert_eq!(
                check(&head("GET", "/", h11, &[bad])),
                Err(HeadError::BadHost),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn absolute_targets_name_the_host_without_userinfo() {
        let h11 = Version::HTTP_11;
        assert_eq!(
            check(&head(
                "GET",
                "http://api.example.com/x",
                h11,
                &["api.example.com"]
            )),
            Ok(Some("api.example.com"))
        );
        assert_eq!(
            check(&head(
                "GET",
                "http://user@api.example.com/x",
                h11,
                &["api.example.com"]
            )),
            Err(HeadError::Userinfo)
        );
    }

    #[test]
    fn connect_is_refused() {
        let connect = head(
            "CONNECT",
            "api.example.com:443",
            Version::HTTP_11,
            &["api.example.com:443"],
        );
        assert_eq!(check(&connect), Err(HeadError::Connect));
        assert_eq!(HeadError::Connect.status(), StatusCode::METHOD_NOT_ALLOWED);
    }

    #[test]
    fn only_other_spellings_of_standard_methods_are_miscased() {
        let m = |s: &str| Method::from_bytes(s.as_bytes()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(miscased_standard(&m("post")), Some("POST"));
        assert_eq!(miscased_standard(&m("PoSt")), Some("POST"));
        assert_eq!(miscased_standard(&m("get")), Some("GET"));
        assert_eq!(miscased_standard(&m("POST")), None);
        assert_eq!(miscased_standard(&m("PURGE")), None);
        assert_eq!(miscased_standard(&m("purge")), None);
    }
}
