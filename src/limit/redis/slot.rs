//! Which Redis Cluster slot a key lies in: CRC16 of its hash tag, as
//! Redis computes it.

/// Hash slots in a Redis Cluster.
pub(super) const SLOTS: usize = 16_384;

/// The cluster slot of a key whose hash tag is `tag` (`…{route:client}`):
/// CRC16 (XMODEM) of what the first braces hold, as Redis computes it.
pub(super) fn slot_of(tag: &str) -> u16 {
    let bytes = tag.as_bytes();
    let hashed = bytes
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|&b| b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    let crc = hashed.iter().fold(0u16, |crc, &b| {
        (crc << 8) ^ CRC16[usize::from((crc >> 8) as u8 ^ b)]
    });
    crc % SLOTS as u16
}

/// CRC16-XMODEM (polynomial 0x1021) by byte.
const CRC16: [u16; 256] = {
    let mut table = [0u16; 256];
    let mut i = 0;
    while i < 256 {
        let mut crc = (i as u16) << 8;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
            bit += 1;
        }
        table[i] = crc;
        i += 1;
    }
    table
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_computed_as_redis_computes_them() {
        // Each from Redis's `CLUSTER KEYSLOT`.
        for (key, slot) in [
            ("foo", 12182),
            ("bar", 5061),
            ("123456789", 12739),
            // Empty braces: the whole key is hashed.
            ("foo{}{bar}", 8363),
            // The first `{` and the first `}` after it.
            ("foo{{bar}}zap", 4015),
            // No closing brace: the whole key.
            ("a{b", 13340),
            ("t:{api:h:c-7}", 14804),
        ] {
            assert_eq!(slot_of(key), slot, "{key}");
        }
        assert_eq!(slot_of("p:{user1000}.following"), slot_of("user1000"));
    }
}
