//! Whose address a request is: the peer's, or what trusted proxies say.

use std::net::{IpAddr, SocketAddr};

use http::{HeaderMap, HeaderValue};
use ipnet::IpNet;

use super::X_FORWARDED_FOR;

/// Whether `ip` is one of `nets`.
pub fn is_in(ip: IpAddr, nets: &[IpNet]) -> bool {
    nets.iter().any(|net| net.contains(&ip))
}

/// The address of whoever is really asking: the TCP peer, unless the peer is
/// a trusted proxy, in which case `X-Forwarded-For` is walked from the right,
/// past trusted proxies, to the first address that is not one. Anything
/// unparsable on the way ends the walk at the last trusted hop, so garbage
/// never becomes a bucket of its own.
pub fn client_address(headers: &HeaderMap, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    let peer = peer.to_canonical();
    if !is_in(peer, trusted) {
        return peer;
    }
    let mut last_trusted = peer;
    let values: Vec<&HeaderValue> = headers.get_all(&X_FORWARDED_FOR).iter().collect();
    for value in values.iter().rev() {
        let Ok(text) = value.to_str() else {
            return last_trusted;
        };
        for entry in text.rsplit(',') {
            let Some(ip) = parse_forwarded_addr(entry.trim()) else {
                return last_trusted;
            };
            if !is_in(ip, trusted) {
                return ip;
            }
            last_trusted = ip;
        }
    }
    last_trusted
}

/// An address as proxies write it: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1`
/// or `[2001:db8::1]:443`.
fn parse_forwarded_addr(s: &str) -> Option<IpAddr> {
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Some(ip.to_canonical());
    }
    s.parse::<SocketAddr>().ok().map(|a| a.ip().to_canonical())
}
