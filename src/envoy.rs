//! Envoy's rate limit service protocol, as data: the messages of
//! `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit` with the
//! field numbers Envoy publishes (`envoy/service/ratelimit/v3/rls.proto`,
//! `envoy/extensions/common/ratelimit/v3/ratelimit.proto`,
//! `envoy/config/core/v3/base.proto`), and gRPC's length-prefixed framing
//! of one message. Only the fields floodgate reads or writes are declared:
//! protobuf skips the others on the way in, and what is never written is
//! never sent. What the messages mean for floodgate's limits is the gate's
//! (`gate::phases::rls`).

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

/// The one method floodgate serves, as its HTTP/2 path.
pub const SHOULD_RATE_LIMIT: &str = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit";

/// Most bytes one request message may have: a descriptor set is small,
/// and what a peer sends is bounded whatever it sends.
pub const MAX_REQUEST: usize = 64 * 1024;

/// `RateLimitRequest`: the descriptors of one request in `domain`.
#[derive(Clone, PartialEq, Message)]
pub struct RateLimitRequest {
    #[prost(string, tag = "1")]
    pub domain: String,
    #[prost(message, repeated, tag = "2")]
    pub descriptors: Vec<RateLimitDescriptor>,
    /// Units each descriptor counts (0: one), unless it says its own.
    #[prost(uint32, tag = "3")]
    pub hits_addend: u32,
}

/// `RateLimitDescriptor`: entries (key, value) in order, and the units
/// this descriptor alone counts.
#[derive(Clone, PartialEq, Message)]
pub struct RateLimitDescriptor {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
    /// A limit the client asks for instead of the configured one.
    #[prost(message, optional, tag = "2")]
    pub limit: Option<RateLimitOverride>,
    /// `google.protobuf.UInt64Value`.
    #[prost(message, optional, tag = "3")]
    pub hits_addend: Option<UInt64Value>,
}

/// `RateLimitDescriptor.Entry`.
#[derive(Clone, PartialEq, Message)]
pub struct Entry {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `RateLimitDescriptor.RateLimitOverride`.
#[derive(Clone, PartialEq, Message)]
pub struct RateLimitOverride {
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    #[prost(int32, tag = "2")]
    pub unit: i32,
}

/// `google.protobuf.UInt64Value`.
#[derive(Clone, PartialEq, Message)]
pub struct UInt64Value {
    #[prost(uint64, tag = "1")]
    pub value: u64,
}

/// `RateLimitResponse`.
#[derive(Clone, PartialEq, Message)]
pub struct RateLimitResponse {
    #[prost(int32, tag = "1")]
    pub overall_code: i32,
    #[prost(message, repeated, tag = "2")]
    pub statuses: Vec<DescriptorStatus>,
    /// Added by Envoy to the answer the client gets.
    #[prost(message, repeated, tag = "3")]
    pub response_headers_to_add: Vec<HeaderValue>,
}

/// `RateLimitResponse.DescriptorStatus`: one descriptor's verdict.
#[derive(Clone, PartialEq, Message)]
pub struct DescriptorStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(message, optional, tag = "2")]
    pub current_limit: Option<RateLimit>,
    #[prost(uint32, tag = "3")]
    pub limit_remaining: u32,
    #[prost(message, optional, tag = "4")]
    pub duration_until_reset: Option<Duration>,
}

/// `RateLimitResponse.RateLimit`: the limit a status reports.
#[derive(Clone, PartialEq, Message)]
pub struct RateLimit {
    #[prost(uint32, tag = "1")]
    pub requests_per_unit: u32,
    #[prost(int32, tag = "2")]
    pub unit: i32,
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `google.protobuf.Duration`.
#[derive(Clone, PartialEq, Message)]
pub struct Duration {
    #[prost(int64, tag = "1")]
    pub seconds: i64,
    #[prost(int32, tag = "2")]
    pub nanos: i32,
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
}

/// `RateLimitResponse.Code`.
pub mod code {
    /// Within every limit.
    pub const OK: i32 = 1;
    /// Over a limit.
    pub const OVER_LIMIT: i32 = 2;
}

/// `RateLimitResponse.RateLimit.Unit`: a window of exactly one of these,
/// else `UNKNOWN` (floodgate's windows are any length).
pub fn unit_of(window_ms: u64) -> i32 {
    match window_ms {
        1_000 => 1,
        60_000 => 2,
        3_600_000 => 3,
        86_400_000 => 4,
        _ => 0,
    }
}

/// Why a request message could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtocolError {
    /// Not one whole gRPC message.
    #[error("the request is not one length-prefixed gRPC message")]
    Framing,
    /// Compressed, which floodgate does not ask for.
    #[error("the request message is compressed; send it uncompressed")]
    Compressed,
    /// Larger than [`MAX_REQUEST`].
    #[error("the request message is larger than 64 KiB")]
    TooLarge,
    /// Not a `RateLimitRequest`.
    #[error("the request message is not a RateLimitRequest: {0}")]
    Decode(String),
}

/// The one message of a unary call's request body.
pub fn decode_request(body: &[u8]) -> Result<RateLimitRequest, ProtocolError> {
    let [flag, a, b, c, d, message @ ..] = body else {
        return Err(ProtocolError::Framing);
    };
    if *flag != 0 {
        return Err(ProtocolError::Compressed);
    }
    let length = u32::from_be_bytes([*a, *b, *c, *d]) as usize;
    if length > MAX_REQUEST {
        return Err(ProtocolError::TooLarge);
    }
    if message.len() != length {
        return Err(ProtocolError::Framing);
    }
    RateLimitRequest::decode(message).map_err(|e| ProtocolError::Decode(e.to_string()))
}

/// `response` as one length-prefixed gRPC message.
pub fn encode_response(response: &RateLimitResponse) -> Bytes {
    let length = response.encoded_len();
    let mut out = BytesMut::with_capacity(5 + length);
    out.put_u8(0);
    out.put_u32(u32::try_from(length).unwrap_or(u32::MAX));
    // Into a buffer with the room reserved: encoding cannot run short.
    let _ = response.encode(&mut out);
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(message: &impl Message) -> Vec<u8> {
        let bytes = message.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
        out
    }

    #[test]
    fn a_request_reads_back_as_sent() {
        let request = RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![Entry {
                    key: "user".into(),
                    value: "ann".into(),
                }],
                limit: None,
                hits_addend: Some(UInt64Value { value: 3 }),
            }],
            hits_addend: 2,
        };
        assert_eq!(decode_request(&framed(&request)), Ok(request));
    }

    #[test]
    fn what_is_not_one_whole_message_is_refused() {
        let whole = framed(&RateLimitRequest::default());
        assert_eq!(decode_request(&whole[..3]), Err(ProtocolError::Framing));
        let mut longer = framed(&RateLimitRequest {
            domain: "d".into(),
            ..Default::default()
        });
        longer.push(0);
        assert_eq!(decode_request(&longer), Err(ProtocolError::Framing));
        let mut compressed = whole.clone();
        compressed[0] = 1;
        assert_eq!(decode_request(&compressed), Err(ProtocolError::Compressed));
        let huge = [0, 0, 1, 0, 1];
        assert_eq!(decode_request(&huge), Err(ProtocolError::TooLarge));
        let garbage = [0, 0, 0, 0, 2, 0xff, 0xff];
        assert!(matches!(
            decode_request(&garbage),
            Err(ProtocolError::Decode(_))
        ));
    }

    #[test]
    fn a_response_is_framed_with_its_length() {
        let response = RateLimitResponse {
            overall_code: code::OVER_LIMIT,
            ..Default::default()
        };
        let bytes = encode_response(&response);
        assert_eq!(bytes[0], 0);
        let length = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        assert_eq!(length, bytes.len() - 5);
        assert_eq!(
            RateLimitResponse::decode(&bytes[5..]).expect("decodes"),
            response
        );
    }
}
