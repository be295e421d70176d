//! Who is asking: a request and its peer address become a [`ClientId`].
//!
//! The id decides which bucket a request counts against, so a client must not
//! be able to choose it freely: `X-Forwarded-For` is believed only when the
//! TCP peer is a trusted proxy, and only its rightmost untrusted entry counts.
//!
//! Nor may a client make floodgate hold what it sends: an id is an owned
//! copy of the header value it came from (never a slice of the request's
//! read buffer, which would keep the whole request head alive as long as the
//! client's state), at most `max_client_id` bytes long; a longer value is
//! refused or kept as its SHA-256, as the operator chooses. And what is
//! counted is what the upstream reads: an identifying header sent twice, or
//! as a comma list, is refused, or cut down to the one value counted before
//! it is forwarded ([`ClientRule::single_values`]).

use http::header::HeaderName;

mod address;
mod failures;
mod id;
mod identify;
mod known;

pub use address::{client_address, is_in};
pub use failures::Failures;
pub use id::{ClientId, sha256, sha256_from_hex};
pub use known::{Known, Written};

pub(crate) use id::{hex, keyed_digest, process_key};

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// How a route identifies its clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientRule {
    /// What the id is made of; several parts make a composite id.
    pub parts: Vec<Part>,
    /// What to do when a header part is absent.
    pub missing: MissingHeader,
    /// IPv6 addresses count by this prefix (`64`: one bucket per /64, since
    /// one host commonly owns a whole /64); 128 keeps whole addresses.
    pub ipv6_prefix: u8,
    /// What to do when an identifying header comes more than once, or as a
    /// comma-separated list.
    pub repeated: Repeated,
    /// The longest header value used as an id as it is, in bytes.
    pub max_len: usize,
    /// What to do with a longer one.
    pub too_long: TooLong,
    /// On a route that rejects requests without a valid bearer token: how
    /// many failed credentials each address may send a minute before its
    /// unknown tokens are refused without a signature check.
    pub failures: Option<std::sync::Arc<Failures>>,
}

/// What a rule does when its header comes in several lines or as a list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repeated {
    /// Answer 400: the upstream might read another value than the one
    /// counted.
    Reject,
    /// Count the first value, and forward only that one.
    First,
    /// Count the last value, and forward only that one.
    Last,
}

impl Repeated {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, Repeated); 3] = [
        ("reject", Repeated::Reject),
        ("first", Repeated::First),
        ("last", Repeated::Last),
    ];
}

/// What a rule does with a header value longer than its `max_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TooLong {
    /// Answer 400.
    Reject,
    /// Count it by its SHA-256, which is as long as any other id.
    Hash,
}

impl TooLong {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, TooLong); 2] =
        [("reject", TooLong::Reject), ("hash", TooLong::Hash)];
}

/// The default longest client id, in bytes.
pub const DEFAULT_MAX_CLIENT_ID: usize = 256;

/// One part of a client id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The TCP peer's address.
    RemoteAddr,
    /// The rightmost `X-Forwarded-For` address that is not a trusted proxy,
    /// believed only when the peer itself is trusted.
    ForwardedFor,
    /// A request header's value, such as an API key (names are
    /// case-insensitive).
    Header(HeaderName),
    /// A parameter of the route's path template (`/users/{id}/orders`):
    /// the request path's segment at `index` (counted after the leading
    /// `/`).
    PathParam {
        /// The parameter's name, as the template gives it.
        name: Box<str>,
        /// Its segment's position.
        index: usize,
        /// Compare without case (the route matches paths without case).
        fold_case: bool,
    },
    /// A claim of the request's bearer token, once its signature and
    /// lifetime are verified.
    Claim(std::sync::Arc<crate::jwt::ClaimRule>),
    /// Nobody in particular: every request of the route counts in one
    /// bucket, across all instances.
    Global,
    /// What the key registry says of the request's verified API key: its
    /// identity (the customer), or one of its attributes by name (`org`),
    /// which nothing the client sends can change.
    Key(Option<Box<str>>),
}

/// What the key registry says of a request's verified API key, for the
/// rules that key on it.
#[derive(Debug, Clone, Copy)]
pub struct KeyFacts<'a> {
    /// The customer the key belongs to.
    pub identity: &'a str,
    /// Its attributes, sorted by name.
    pub attributes: &'a [(Box<str>, Box<str>)],
}

impl<'a> KeyFacts<'a> {
    /// The value `part` names: the identity (`None`) or an attribute.
    pub fn value(&self, attribute: Option<&str>) -> Option<&'a str> {
        match attribute {
            None => Some(self.identity),
            Some(name) => self
                .attributes
                .binary_search_by(|(n, _)| (**n).cmp(name))
                .ok()
                .map(|i| &*self.attributes[i].1),
        }
    }
}

/// What a rule does when a header part is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingHeader {
    /// Use the client's address in its place.
    Fallback,
    /// Answer 400.
    Reject,
}

impl MissingHeader {
    /// Every choice with its name in configuration files.
    pub const NAMES: [(&'static str, MissingHeader); 2] = [
        ("fallback", MissingHeader::Fallback),
        ("reject", MissingHeader::Reject),
    ];
}

/// Why no client id could be derived.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// The route identifies clients by a header that the request lacks.
    #[error("this route requires the {0} header")]
    MissingHeader(HeaderName),
    /// The identifying header came in several lines or as a list.
    #[error("the {0} header must hold exactly one value, in one line")]
    Repeated(HeaderName),
    /// The identifying header's value is longer than the rule allows.
    #[error("the {0} header is longer than {1} bytes")]
    TooLong(HeaderName, usize),
    /// The route keys clients by a token claim, and the request's bearer
    /// token is missing, invalid or lacks the claim.
    #[error("this route requires a valid bearer token: {0}")]
    Token(crate::jwt::TokenError),
    /// The address sent more failed credentials this minute than the
    /// route checks; its unknown tokens are refused unchecked for this
    /// many milliseconds.
    #[error("too many failed credentials from this address; retry when the minute ends")]
    TooManyFailures(u64),
    /// The route keys by the verified API key's registry record, and the
    /// key has no such attribute.
    #[error("the API key has no attribute {0:?}, which this route counts by")]
    NoAttribute(Box<str>),
    /// The rule keys by the verified API key, and none was verified (a
    /// route without `api_key`, or an exempt request).
    #[error("this route counts by the verified API key, and the request has none")]
    NoKey,
}

impl ClientRule {
    /// Counts by the TCP peer's address.
    pub fn remote_addr() -> Self {
        Self {
            parts: vec![Part::RemoteAddr],
            missing: MissingHeader::Fallback,
            ipv6_prefix: 128,
            repeated: Repeated::Reject,
            max_len: DEFAULT_MAX_CLIENT_ID,
            too_long: TooLong::Reject,
            failures: None,
        }
    }

    /// The rule as operators read it: `remote_addr`, `header X-Org`,
    /// `jwt sub`, `path id`, `global`, parts joined with ` + `.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = self
            .parts
            .iter()
            .map(|p| match p {
                Part::RemoteAddr => "remote_addr".to_owned(),
                Part::ForwardedFor => "forwarded_for".to_owned(),
                Part::Header(name) => format!("header {name}"),
                Part::PathParam { name, .. } => format!("path {name}"),
                Part::Claim(rule) => format!("jwt {}", rule.claim),
                Part::Global => "global".to_owned(),
                Part::Key(None) => "key".to_owned(),
                Part::Key(Some(name)) => format!("key {name}"),
            })
            .collect();
        parts.join(" + ")
    }
}
