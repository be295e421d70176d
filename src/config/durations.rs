//! Durations (`"250ms"`, `"60s"`, `"1h"`) and sizes (`"10MiB"`) as the file
//! writes them.

use std::time::Duration;

use toml::Spanned;

use super::Validator;

impl Validator<'_> {
    pub(super) fn duration(&mut self, value: &Spanned<String>, what: &str) -> Option<Duration> {
        match parse_duration(value.get_ref()) {
            Ok(d) if d.is_zero() => {
                self.problem(value.span(), format!("{what} must be greater than zero"));
                None
            }
            Ok(d) => Some(d),
            Err(message) => {
                self.problem(value.span(), format!("{what}: {message}"));
                None
            }
        }
    }

    /// A size in bytes: `"512KiB"`, `"10MB"`, `"1GiB"`.
    pub(super) fn size(&mut self, value: &Spanned<String>, what: &str) -> Option<u64> {
        match parse_size(value.get_ref()) {
            Ok(n) => Some(n),
            Err(message) => {
                self.problem(value.span(), format!("{what}: {message}"));
                None
            }
        }
    }

    pub(super) fn optional_duration(
        &mut self,
        value: Option<&Spanned<String>>,
        what: &str,
        default: Duration,
    ) -> Option<Duration> {
        match value {
            Some(value) => self.duration(value, what),
            None => Some(default),
        }
    }
}

/// Parses `"250ms"`, `"1s"`, `"5m"`, `"1h"`, `"1d"`: a whole number and a unit.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let hint =
        "write a whole number and a unit: \"250ms\", \"1s\", \"60s\", \"5m\", \"1h\", \"1d\"";
    if number.is_empty() {
        return Err(format!("{s:?} is not a duration; {hint}"));
    }
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is too large"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => return Err(format!("{s:?} has no unit; {hint}")),
        _ => return Err(format!("{s:?} has an unknown unit {unit:?}; {hint}")),
    };
    let ms = n
        .checked_mul(unit_ms)
        .filter(|ms| *ms <= 365 * 86_400_000)
        .ok_or_else(|| format!("{s:?} is longer than a year"))?;
    Ok(Duration::from_millis(ms))
}

/// Parses a size: a whole number of bytes and a unit, `B`, `KB`, `MB`,
/// `GB` (powers of 1000) or `KiB`, `MiB`, `GiB` (powers of 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let digits = s.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = s.split_at(digits);
    let hint = "write a whole number and a unit: \"512KiB\", \"10MB\", \"1GiB\"";
    if number.is_empty() {
        return Err(format!("{s:?} is not a size; {hint}"));
    }
    let n: u64 = number.parse().map_err(|_| format!("{s:?} is too large"))?;
    let unit: u64 = match unit {
        "B" => 1,
        "KB" | "kB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "" => return Err(format!("{s:?} has no unit; {hint}")),
        _ => return Err(format!("{s:?} has an unknown unit {unit:?}; {hint}")),
    };
    match n.checked_mul(unit) {
        Some(0) => Err(format!("{s:?} must be more than nothing")),
        Some(bytes) => Ok(bytes),
        None => Err(format!("{s:?} is too large")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_a_number_and_a_unit() {
        assert_eq!(parse_size("512KiB"), Ok(512 * 1024));
        assert_eq!(parse_size("10MB"), Ok(10_000_000));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("100B"), Ok(100));
        for bad in ["", "10", "MB", "10mb", "0B", "99999999999GiB", "1.5MB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn durations_take_a_number_and_a_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("60s"), Ok(Duration::from_secs(60)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        for bad in [
            "",
            "s",
            "10",
            "1.5s",
            "10 s",
            "-1s",
            "1w",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
