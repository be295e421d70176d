//! The one wall clock that limits, endpoint ejections, concurrency and the
//! admin pages share: milliseconds since the Unix epoch. (Redis decisions
//! use Redis `TIME` instead, so that instances agree; this clock serves
//! what one instance decides alone.)

/// Milliseconds since the Unix epoch by this machine's clock.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
