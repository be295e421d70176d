//! The one wall clock that limits, endpoint ejections, concurrency and the
//! admin pages share: milliseconds since the Unix epoch. (Redis decisions
//! use Redis `TIME` instead, so that instances agree; this clock serves
//! what one instance decides alone.)

/// Milliseconds since the Unix epoch by this machine's clock.
pub fn now_ms() -> u64 {
    ms_at(std::time::SystemTime::now())
}

/// Milliseconds since the Unix epoch at `time` (0 before it), for a caller
/// that keeps the reading for something else too.
pub fn ms_at(time: std::time::SystemTime) -> u64 {
    time.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Whether a second has passed since `last` (ms) at `now` (ms), taking the
/// turn if so: how a line that could repeat on every request is written at
/// most once a second, whatever the number of threads asking.
pub fn once_a_second(last: &std::sync::atomic::AtomicU64, now: u64) -> bool {
    use std::sync::atomic::Ordering;
    let seen = last.load(Ordering::Relaxed);
    now.saturating_sub(seen) >= 1_000
        && last
            .compare_exchange(seen, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}

/// A duration as a configuration writes it: `250ms`, `10s`, `15m`, `4h`,
/// `1d`, in the largest unit that divides it.
pub fn written(ms: u64) -> String {
    for (unit, size) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= size && ms.is_multiple_of(size) {
            return format!("{}{unit}", ms / size);
        }
    }
    format!("{ms}ms")
}
