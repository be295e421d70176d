//! Untrusted input never panics: random request paths through normalisation
//! and random headers and peers through client identification. The case
//! count comes from `FLOODGATE_FUZZ_CASES` (default 20 000 each, a few
//! seconds); `bench/fuzz.sh` runs millions for a bounded time.

use std::net::IpAddr;

use floodgate::client::{ClientId, ClientRule, MissingHeader, Part, client_address};
use floodgate::routes::{EscapedSlashes, request_paths};
use http::header::HeaderName;
use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;
use proptest::prelude::*;

fn cases() -> u32 {
    std::env::var("FLOODGATE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000)
}

/// Paths made of the characters that matter to normalisation, and raw bytes.
fn path() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "/", "//", ".", "..", "%", "%2", "%2F", "%2f", "%5C", "%2E", "%2e%2E", "%41", "%zz", "\\",
        "a", "login", "~", "%00", "%FF", "?", "é",
    ]);
    prop_oneof![
        prop::collection::vec(pieces, 0..24).prop_map(|p| format!("/{}", p.concat())),
        ".{0,64}".prop_map(|s| s),
    ]
}

fn ip() -> impl Strategy<Value = IpAddr> {
    prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u8; 16]>().prop_map(IpAddr::from),
        any::<u32>().prop_map(|v| IpAddr::from(std::net::Ipv4Addr::from(v).to_ipv6_mapped())),
    ]
}

fn forwarded_entry() -> impl Strategy<Value = String> {
    prop_oneof![
        ip().prop_map(|ip| ip.to_string()),
        (ip(), any::<u16>()).prop_map(|(ip, port)| std::net::SocketAddr::new(ip, port).to_string()),
        "[ -~]{0,40}",
    ]
}

fn headers() -> impl Strategy<Value = HeaderMap> {
    (
        prop::collection::vec(prop::collection::vec(forwarded_entry(), 0..5), 0..3),
        prop::option::of(prop::collection::vec(any::<u8>(), 0..64)),
    )
        .prop_map(|(xff, key)| {
            let mut h = HeaderMap::new();
            for list in xff {
                if let Ok(v) = HeaderValue::from_str(&list.join(", ")) {
                    h.append("x-forwarded-for", v);
                }
            }
            if let Some(v) = key.and_then(|k| HeaderValue::from_bytes(&k).ok()) {
                h.insert("x-api-key", v);
            }
            h
        })
}

fn nets() -> impl Strategy<Value = Vec<IpNet>> {
    prop::collection::vec(
        (ip(), 0u8..=128).prop_map(|(ip, len)| {
            let len = if ip.is_ipv4() { len.min(32) } else { len };
            IpNet::new(ip, len)
                .map(|n| n.trunc())
                .unwrap_or_else(|_| IpNet::from(ip))
        }),
        0..4,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn path_normalisation_never_panics_and_is_stable(p in path()) {
        for escaped in [EscapedSlashes::Reject, EscapedSlashes::Decode, EscapedSlashes::Keep] {
            let Ok((forward, matched)) = request_paths(&p, escaped) else {
                continue;
            };
            for normal in [forward.as_ref(), matched.as_ref()] {
                prop_assert!(normal.starts_with('/'), "{:?} -> {:?}", p, normal);
                prop_assert!(!normal.contains("//"), "{:?} -> {:?}", p, normal);
                prop_assert!(!normal.contains("/./") && !normal.contains("/../"), "{:?} -> {:?}", p, normal);
            }
            // What is matched is what is forwarded, ;parameters aside.
            if !forward.contains(';') {
                prop_assert_eq!(forward.as_ref(), matched.as_ref());
            }
            // Normalising again changes nothing.
            let (again_forward, again_matched) = request_paths(&forward, escaped).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(again_forward.as_ref(), forward.as_ref());
            prop_assert_eq!(again_matched.as_ref(), matched.as_ref());
            if escaped != EscapedSlashes::Keep {
                for normal in [forward.as_ref(), matched.as_ref()] {
                    let upper = normal.to_ascii_uppercase();
                    prop_assert!(!normal.contains('\\') && !upper.contains("%2F") && !upper.contains("%5C"));
                }
            }
        }
    }

    #[test]
    fn client_identification_never_panics_and_never_invents_an_address(
        h in headers(), peer in ip(), trusted in nets(), prefix in 1u8..=128,
    ) {
        let found = client_address(&h, peer, &trusted);
        let listed = h
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .any(|v| v.contains(&found.to_string()) || v.contains(&format!("{found:?}")));
        prop_assert!(found == peer.to_canonical() || listed || trusted.iter().any(|n| n.contains(&found)),
            "{} came from nowhere", found);
        let parts = vec![
            Part::Header(HeaderName::from_static("x-api-key")),
            Part::ForwardedFor,
            Part::RemoteAddr,
        ];
        for missing in [MissingHeader::Fallback, MissingHeader::Reject] {
            let rule = ClientRule { parts: parts.clone(), missing, ipv6_prefix: prefix, ..ClientRule::remote_addr() };
            if let Ok(ClientId::Composite(ids)) = rule.identify(&h, "/", peer, &trusted) {
                prop_assert_eq!(ids.len(), 3);
            }
        }
    }
}
