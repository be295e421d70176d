//! Who an operator is: the admin token file names its tokens. A file of
//! one line holds one token, named `admin`; otherwise each line is `<name>
//! <token>` (`#` starts a comment), and the name is what the audit records
//! as the operator. The file is read again on every request that needs a
//! token, so tokens are added and rotated without a restart.

use std::path::Path;

use bytes::Bytes;
use http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use http::{HeaderMap, HeaderValue, Response, StatusCode};
use http_body_util::Full;
use sha2::{Digest, Sha256};

use super::reply::problem;

/// The name of the token of a one-line file.
const ONE_TOKEN: &str = "admin";

/// The shortest token accepted from the file.
const MIN_TOKEN: usize = 16;

/// The name of the token `headers` carry, or the answer refusing them:
/// no file configured 403, no token 401, a token not in the file 403, a
/// file that cannot be read 503.
pub(super) fn operator(
    headers: &HeaderMap,
    token_file: Option<&Path>,
) -> Result<String, Box<Response<Full<Bytes>>>> {
    let Some(file) = token_file else {
        return Err(Box::new(problem(
            StatusCode::FORBIDDEN,
            "changes are off: set [server] admin_token_file to allow them",
        )));
    };
    let Some(given) = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
    else {
        let mut refused = problem(
            StatusCode::UNAUTHORIZED,
            "this needs Authorization: Bearer <an admin token>",
        );
        refused
            .headers_mut()
            .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        return Err(Box::new(refused));
    };
    let tokens = std::fs::read_to_string(file)
        .ok()
        .map(|text| named_tokens(&text))
        .filter(|tokens| !tokens.is_empty());
    let Some(tokens) = tokens else {
        return Err(Box::new(problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "the admin token file cannot be read, or names no token; nothing that needs a token is allowed until it can",
        )));
    };
    let given = Sha256::digest(given.trim().as_bytes());
    // Every token compared, each as a digest, in time that does not depend
    // on where they differ.
    let mut found = None;
    for (name, token) in &tokens {
        let theirs = Sha256::digest(token.as_bytes());
        let differ = given
            .iter()
            .zip(theirs.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y));
        if differ == 0 && found.is_none() {
            found = Some(name.clone());
        }
    }
    found.ok_or_else(|| {
        Box::new(problem(
            StatusCode::FORBIDDEN,
            "that is not one of the admin tokens",
        ))
    })
}

/// The file's tokens with their names: one line alone is the `admin`
/// token; else each `<name> <token>` line. Tokens shorter than 16
/// characters are left out.
fn named_tokens(text: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .filter(|l| !l.is_empty())
        .collect();
    let pairs = match lines.as_slice() {
        [one] if one.split_whitespace().count() == 1 => {
            vec![(ONE_TOKEN.to_owned(), (*one).to_owned())]
        }
        _ => lines
            .iter()
            .filter_map(|l| {
                let mut words = l.split_whitespace();
                match (words.next(), words.next(), words.next()) {
                    (Some(name), Some(token), None) => Some((name.to_owned(), token.to_owned())),
                    _ => None,
                }
            })
            .collect(),
    };
    pairs
        .into_iter()
        .filter(|(_, token)| token.len() >= MIN_TOKEN)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_is_the_admin_token_and_named_lines_name_theirs() {
        assert_eq!(
            named_tokens("0123456789abcdef0123\n"),
            [("admin".to_owned(), "0123456789abcdef0123".to_owned())]
        );
        let named = named_tokens(
            "# operators\nalice 0123456789abcdef-alice\nbob 0123456789abcdef-bob # on call\nshort 123\n",
        );
        let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["alice", "bob"]);
    }
}
