//! One meaning for a path: the request's path normalised once, matched and
//! forwarded alike, so that no spelling of a limited path reaches the
//! upstream past its route (see [`request_paths`]).

use std::borrow::Cow;

/// What `%2F`, `%5C` and `\` in a request path do. Upstreams disagree on
/// them (some decode `%2F` into a separator before routing, Windows servers
/// read `\` as one), so a path holding them could be counted on one route
/// and served on another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EscapedSlashes {
    /// Answer 400 (the default): no upstream can read them differently.
    #[default]
    Reject,
    /// Read all three as `/`, normalise, and forward the result.
    Decode,
    /// Keep them as sent, as ordinary characters of a segment, for
    /// matching and forwarding alike: for upstreams known to do the same.
    Keep,
}

impl EscapedSlashes {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, EscapedSlashes); 3] = [
        ("reject", EscapedSlashes::Reject),
        ("decode", EscapedSlashes::Decode),
        ("keep", EscapedSlashes::Keep),
    ];
}

/// Why a request path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// A `%` not followed by two hex digits.
    #[error("malformed percent-encoding in the request path")]
    BadEscape,
    /// Not an absolute path (`*`, or no leading `/`).
    #[error("the request path must start with '/'")]
    NotAbsolute,
    /// `%2F`, `%5C` or `\` under [`EscapedSlashes::Reject`].
    #[error("encoded slashes and backslashes (%2F, %5C, \\) are not accepted in the request path")]
    EscapedSlash,
}

/// Normalises a path as configuration files write it: percent-encoded
/// unreserved characters decoded, dot-segments removed, repeated slashes
/// collapsed. Returns the input borrowed when it is already normal.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    match normalize(path, false) {
        Ok(p) => p,
        Err(_) => Cow::Borrowed(path),
    }
}

/// The forwarded path and the matched path of a request.
///
/// The forwarded path is the request's path normalised: percent-encoded
/// unreserved characters decoded (other escapes get upper-case hex),
/// dot-segments removed (RFC 3986 §5.2.4; a dot-segment with parameters,
/// `..;x`, counts as one, as servlet containers read it), repeated slashes
/// collapsed, and `%2F`, `%5C` and `\` refused, decoded to `/` or kept as
/// `escaped` says. The matched path is the same path with each segment's
/// `;parameters` left out, as servlet containers and Spring route it, so
/// `/search;v=1` meets the `/search` route. Both are borrowed from the
/// input when there is nothing to change.
pub fn request_paths(
    path: &str,
    escaped: EscapedSlashes,
) -> Result<(Cow<'_, str>, Cow<'_, str>), PathError> {
    if !path.starts_with('/') {
        return Err(PathError::NotAbsolute);
    }
    // One scan for the common, clean path: nothing to normalise, and no
    // escape or backslash to refuse.
    if !needs_work(path, true) {
        return Ok((Cow::Borrowed(path), without_parameters(path)));
    }
    if escaped == EscapedSlashes::Reject && has_escaped_slash(path) {
        return Err(PathError::EscapedSlash);
    }
    let forward = normalize(path, escaped == EscapedSlashes::Decode)?;
    let matched = match &forward {
        Cow::Borrowed(p) => without_parameters(p),
        Cow::Owned(p) => Cow::Owned(without_parameters(p).into_owned()),
    };
    Ok((forward, matched))
}

/// Whether `path` holds `\`, `%2F` or `%5C` (either case).
fn has_escaped_slash(path: &str) -> bool {
    let b = path.as_bytes();
    b.iter().enumerate().any(|(i, &c)| match c {
        b'\\' => true,
        b'%' => matches!(
            b.get(i + 1..i + 3),
            Some([b'2', b'f' | b'F'] | [b'5', b'c' | b'C'])
        ),
        _ => false,
    })
}

/// `path` with each segment's `;parameters` left out (`/a;x/b;y` is
/// `/a/b`); segments that were only parameters are left out too.
fn without_parameters(path: &str) -> Cow<'_, str> {
    if !path.as_bytes().contains(&b';') {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    for segment in path.split('/').skip(1) {
        let bare = segment.split(';').next().unwrap_or_default();
        if !bare.is_empty() {
            out.push('/');
            out.push_str(bare);
        }
    }
    if out.is_empty() || path.ends_with('/') {
        out.push('/');
    }
    Cow::Owned(out)
}

/// Whether `path` has anything [`normalize`] changes: an escape, a
/// backslash (when `separators`), `//`, or a `.` or `..` segment (with or
/// without parameters). One pass, as this runs on every request.
fn needs_work(path: &str, separators: bool) -> bool {
    let b = path.as_bytes();
    b.iter().enumerate().any(|(i, &c)| match c {
        b'%' => true,
        b'\\' => separators,
        b'/' => matches!(
            &b[i + 1..],
            [b'/', ..]
                | [b'.']
                | [b'.', b'/' | b';', ..]
                | [b'.', b'.']
                | [b'.', b'.', b'/' | b';', ..]
        ),
        _ => false,
    })
}

/// A segment's name without its parameters: `..;x` is a `..` segment.
fn dot_segment(segment: &str) -> Option<&str> {
    match segment.split(';').next() {
        Some(bare @ ("." | "..")) => Some(bare),
        _ => None,
    }
}

fn normalize(path: &str, separators: bool) -> Result<Cow<'_, str>, PathError> {
    if !needs_work(path, separators) {
        return Ok(Cow::Borrowed(path));
    }
    let decoded = decode_unreserved(path, separators)?;
    let last = decoded.rsplit('/').next().unwrap_or_default();
    let trailing_slash = decoded.ends_with('/') || dot_segment(last).is_some();
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match (segment, dot_segment(segment)) {
            ("", _) | (_, Some(".")) => {}
            (_, Some(_)) => {
                segments.pop();
            }
            (s, None) => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() || trailing_slash {
        out.push('/');
    }
    Ok(Cow::Owned(out))
}

fn decode_unreserved(path: &str, separators: bool) -> Result<String, PathError> {
    let b = path.as_bytes();
    let mut out: Vec<u8> = Vec::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'%' {
            let hi = b
                .get(i + 1)
                .and_then(|c| hex(*c))
                .ok_or(PathError::BadEscape)?;
            let lo = b
                .get(i + 2)
                .and_then(|c| hex(*c))
                .ok_or(PathError::BadEscape)?;
            let byte = hi << 4 | lo;
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
                out.push(byte);
            } else if separators && matches!(byte, b'/' | b'\\') {
                out.push(b'/');
            } else {
                out.extend([b'%', HEX[usize::from(hi)], HEX[usize::from(lo)]]);
            }
            i += 3;
        } else {
            out.push(if separators && c == b'\\' { b'/' } else { c });
            i += 1;
        }
    }
    // Only ASCII was decoded or replaced, so the bytes are still UTF-8.
    Ok(String::from_utf8_lossy(&out).into_owned())
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

fn hex(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::routes::segment_prefix;

    fn paths(path: &str, escaped: EscapedSlashes) -> (String, String) {
        match request_paths(path, escaped) {
            Ok((forward, matched)) => (forward.into_owned(), matched.into_owned()),
            Err(e) => panic!("{path:?}: {e}"),
        }
    }

    #[test]
    fn path_tricks_all_normalise_to_the_same_matched_and_forwarded_path() {
        for trick in [
            "/login",
            "//login",
            "/./login",
            "/api/../login",
            "/%6Cogin",
            "/%6cogin",
            "/a/b/../../login",
            "/../login",
            "/login/.",
            "/api/..;/login",
            "/api/..;x=1/login",
            "/.;/login",
            "/%2e%2e/login",
        ] {
            let (forward, matched) = paths(trick, EscapedSlashes::Reject);
            assert_eq!(matched.trim_end_matches('/'), "/login", "{trick:?}");
            assert_eq!(forward, matched, "{trick:?} is forwarded as matched");
        }
    }

    #[test]
    fn escaped_slashes_are_refused_by_default() {
        for path in [
            "/search/q%2F..%2F..%2F",
            "/search/q%5c..",
            "/search/q\\..\\..\\",
            "/a%2fb",
        ] {
            assert_eq!(
                request_paths(path, EscapedSlashes::Reject).err(),
                Some(PathError::EscapedSlash),
                "{path:?}"
            );
        }
    }

    #[test]
    fn decoded_escaped_slashes_are_forwarded_as_matched() {
        for (sent, want) in [
            ("/search/q%2F..%2F..%2F", "/"),
            ("/search/q%5C..%5C..%5C", "/"),
            ("/search/q\\..\\..\\", "/"),
            ("/public%2F..%2Fsearch", "/search"),
            ("/login%2fadmin", "/login/admin"),
        ] {
            let (forward, matched) = paths(sent, EscapedSlashes::Decode);
            assert_eq!(
                (forward.as_str(), matched.as_str()),
                (want, want),
                "{sent:?}"
            );
        }
    }

    #[test]
    fn kept_escaped_slashes_are_ordinary_characters_on_both_sides() {
        for sent in ["/search/q%2F..%2F..%2F", "/search/q\\..\\..\\"] {
            let (forward, matched) = paths(sent, EscapedSlashes::Keep);
            assert_eq!(forward, sent);
            assert_eq!(matched, sent);
            assert!(segment_prefix("/search", &matched, false));
        }
        assert_eq!(paths("/a%2fb", EscapedSlashes::Keep).0, "/a%2Fb");
    }

    #[test]
    fn parameters_are_left_out_of_the_matched_path_only() {
        for (sent, forward, matched) in [
            ("/search;v=1", "/search;v=1", "/search"),
            ("/search;v=1/q;x", "/search;v=1/q;x", "/search/q"),
            ("/;x/search", "/;x/search", "/search"),
            ("/search;v=1/", "/search;v=1/", "/search/"),
            ("/public/..;/search", "/search", "/search"),
        ] {
            let got = paths(sent, EscapedSlashes::Reject);
            assert_eq!(
                (got.0.as_str(), got.1.as_str()),
                (forward, matched),
                "{sent:?}"
            );
        }
    }

    #[test]
    fn malformed_escapes_and_relative_paths_are_refused() {
        let refused = |p| request_paths(p, EscapedSlashes::Decode).err();
        assert_eq!(refused("/a%zz"), Some(PathError::BadEscape));
        assert_eq!(refused("/a%4"), Some(PathError::BadEscape));
        assert_eq!(refused("*"), Some(PathError::NotAbsolute));
    }

    #[test]
    fn needs_work_spots_exactly_what_normalising_changes() {
        // The plain definition, checked against the one-pass scan on every
        // path of up to six characters from the alphabet that matters.
        let reference = |path: &str, separators: bool| {
            path.contains('%')
                || (separators && path.contains('\\'))
                || path.contains("//")
                || path.contains("/./")
                || path.contains("/../")
                || path.contains("/.;")
                || path.contains("/..;")
                || path.ends_with("/.")
                || path.ends_with("/..")
        };
        let alphabet = ['/', '.', 'a', '%', '\\', ';'];
        let mut paths = vec![String::new()];
        let mut checked = 0;
        for _ in 0..6 {
            paths = paths
                .iter()
                .flat_map(|p| alphabet.iter().map(move |c| format!("{p}{c}")))
                .collect();
            for path in &paths {
                for separators in [false, true] {
                    assert_eq!(
                        needs_work(path, separators),
                        reference(path, separators),
                        "{path:?} separators={separators}"
                    );
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 2 * (6 + 36 + 216 + 1296 + 7776 + 46656));
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize_path("/api/v1/users"), Cow::Borrowed(_)));
        let (forward, matched) =
            request_paths("/api/v1/users", EscapedSlashes::Reject).unwrap_or_default();
        assert!(matches!(
            (forward, matched),
            (Cow::Borrowed(_), Cow::Borrowed(_))
        ));
    }
}
