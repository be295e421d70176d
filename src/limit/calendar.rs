//! Windows by the calendar: a quota per day, week, month or year (or per
//! clock minute or hour) in an IANA time zone, a month starting on a
//! client's billing day.
//!
//! A calendar window is a fixed window whose boundaries are instants this
//! module computes: local midnight (or the start of the local minute or
//! hour) in the zone, so a day across a DST change lasts 23 or 25 hours,
//! and a month anchored on day `a` starts on day `a`, or on the month's
//! last day when it has fewer (anchor 31: 30 April, 28 or 29 February).
//!
//! The store's clock stays the one clock: floodgate computes, by its own
//! clock, the window it is in and the windows on either side ([`Bounds`]:
//! four boundaries), and the store places its own time among them. Two
//! instances whose clocks disagree at a boundary count into the same
//! window, the one the store's time falls in.

use jiff::civil::{Date, Weekday};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ZonedDateTime};

/// Four boundaries, milliseconds since the epoch, `b[0] < b[1] < b[2] <
/// b[3]`: the window before the current one starts at `b[0]`, the current
/// one at `b[1]`, the next at `b[2]`, the one after at `b[3]`.
pub type Bounds = [u64; 4];

/// The calendar unit a window spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Minute,
    Hour,
    Day,
    Week,
    Month,
    Year,
}

impl Unit {
    /// Every unit with its name in configuration files.
    pub const NAMES: [(&'static str, Unit); 6] = [
        ("minute", Unit::Minute),
        ("hour", Unit::Hour),
        ("day", Unit::Day),
        ("week", Unit::Week),
        ("month", Unit::Month),
        ("year", Unit::Year),
    ];

    /// The unit a configuration file names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, u)| u)
    }

    /// Its name in configuration files.
    pub fn name(self) -> &'static str {
        Self::NAMES
            .iter()
            .find(|(_, u)| *u == self)
            .map_or("", |(n, _)| n)
    }

    /// A length standing for the unit where one number is needed (the
    /// name of its key, the in-process tables): its usual length in
    /// milliseconds. Never used to count: the boundaries are.
    pub fn nominal_ms(self) -> u64 {
        match self {
            Self::Minute => 60_000,
            Self::Hour => 3_600_000,
            Self::Day => 86_400_000,
            Self::Week => 7 * 86_400_000,
            // The Gregorian year's average, and its twelfth.
            Self::Month => 2_629_746_000,
            Self::Year => 31_556_952_000,
        }
    }
}

/// How one limit's windows follow the calendar.
#[derive(Debug, Clone, PartialEq)]
pub struct Calendar {
    pub unit: Unit,
    /// The zone whose clock and dates the windows follow.
    pub zone: TimeZone,
    /// The first day of a week (`week`).
    pub week_starts: Weekday,
}

impl Calendar {
    /// A calendar of `unit` in UTC, weeks starting on Monday.
    pub fn utc(unit: Unit) -> Self {
        Self {
            unit,
            zone: TimeZone::UTC,
            week_starts: Weekday::Monday,
        }
    }

    /// The boundaries around `now_ms` (see [`Bounds`]) for a month starting
    /// on day `anchor` (1 to 31; ignored by other units). `None` only for a
    /// time outside what the calendar can represent.
    pub fn bounds(&self, now_ms: u64, anchor: u8) -> Option<Bounds> {
        let now = Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
        let current = self.start_of(now, anchor)?;
        let before = self.start_of(
            current
                .checked_sub(jiff::SignedDuration::from_millis(1))
                .ok()?,
            anchor,
        )?;
        let next = self.after(current, anchor)?;
        let after = self.after(next, anchor)?;
        let ms = |t: Timestamp| u64::try_from(t.as_millisecond()).ok();
        Some([ms(before)?, ms(current)?, ms(next)?, ms(after)?])
    }

    /// The start of the window `t` falls in.
    fn start_of(&self, t: Timestamp, anchor: u8) -> Option<Timestamp> {
        let local = t.to_zoned_datetime(self.zone.clone());
        let date = local.date();
        let day = match self.unit {
            Unit::Minute | Unit::Hour => return Some(self.clock_start(&local)),
            Unit::Day => date,
            Unit::Week => {
                let since = (date.weekday().to_monday_zero_offset()
                    - self.week_starts.to_monday_zero_offset())
                .rem_euclid(7);
                date.checked_sub(jiff::Span::new().days(i64::from(since)))
                    .ok()?
            }
            Unit::Month => {
                let this = anchored(date.year(), date.month(), anchor)?;
                if date >= this {
                    this
                } else {
                    let (y, m) = month_before(date.year(), date.month());
                    anchored(y, m, anchor)?
                }
            }
            Unit::Year => Date::new(date.year(), 1, 1).ok()?,
        };
        midnight(day, &self.zone)
    }

    /// The start of the window after the one starting at `start`.
    fn after(&self, start: Timestamp, anchor: u8) -> Option<Timestamp> {
        let local = start.to_zoned_datetime(self.zone.clone());
        let date = local.date();
        let day = match self.unit {
            Unit::Minute => return start.checked_add(jiff::SignedDuration::from_mins(1)).ok(),
            Unit::Hour => return start.checked_add(jiff::SignedDuration::from_hours(1)).ok(),
            Unit::Day => date.tomorrow().ok()?,
            Unit::Week => date.checked_add(jiff::Span::new().days(7)).ok()?,
            Unit::Month => {
                let (y, m) = if date.month() == 12 {
                    (date.year().checked_add(1)?, 1)
                } else {
                    (date.year(), date.month() + 1)
                };
                anchored(y, m, anchor)?
            }
            Unit::Year => Date::new(date.year().checked_add(1)?, 1, 1).ok()?,
        };
        midnight(day, &self.zone)
    }

    /// The start of the local minute or hour `local` is in: the instant
    /// less the local minutes' and seconds' part, so a zone whose offset
    /// is not whole hours still has its hours on its own clock.
    fn clock_start(&self, local: &ZonedDateTime) -> Timestamp {
        let within_minute = i64::from(local.second()) * 1000 + i64::from(local.millisecond());
        let within = match self.unit {
            Unit::Hour => i64::from(local.minute()) * 60_000 + within_minute,
            _ => within_minute,
        };
        let ms = local.timestamp().as_millisecond() - within;
        Timestamp::from_millisecond(ms).unwrap_or(local.timestamp())
    }
}

/// The boundaries a calendar last computed for each anchor day, so that a
/// request in the same window reuses them: the time zone arithmetic runs
/// once per window and anchor, not once per request.
#[derive(Debug, Default)]
pub struct Remembered {
    /// By anchor day (0 unused); `[0; 4]` until first computed.
    last: [std::sync::Mutex<Bounds>; 32],
}

impl Remembered {
    /// `calendar`'s boundaries around `now_ms` for `anchor`: the ones
    /// remembered while `now_ms` is in their current window, else computed
    /// (and remembered).
    pub fn bounds(&self, calendar: &Calendar, now_ms: u64, anchor: u8) -> Option<Bounds> {
        let slot = self.last.get(usize::from(anchor))?;
        let held = *slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held[1] <= now_ms && now_ms < held[2] {
            return Some(held);
        }
        let bounds = calendar.bounds(now_ms, anchor)?;
        *slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = bounds;
        Some(bounds)
    }
}

/// Day `anchor` of month `m` of year `y`, or the month's last day when it
/// has fewer days.
fn anchored(y: i16, m: i8, anchor: u8) -> Option<Date> {
    let first = Date::new(y, m, 1).ok()?;
    let day = i8::try_from(anchor.clamp(1, 31))
        .ok()?
        .min(first.days_in_month());
    Date::new(y, m, day).ok()
}

fn month_before(y: i16, m: i8) -> (i16, i8) {
    if m == 1 { (y - 1, 12) } else { (y, m - 1) }
}

/// The first instant of `day` in `zone`: local midnight, or the first
/// moment after it where midnight does not exist (a DST change at 00:00).
fn midnight(day: Date, zone: &TimeZone) -> Option<Timestamp> {
    Some(
        day.to_zoned_datetime(zone.clone())
            .ok()?
            .start_of_day()
            .ok()?
            .timestamp(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> u64 {
        let t: Timestamp = text.parse().expect("a timestamp");
        u64::try_from(t.as_millisecond()).expect("after the epoch")
    }

    fn text(ms: u64) -> String {
        Timestamp::from_millisecond(ms as i64)
            .expect("ms")
            .to_string()
    }

    fn calendar(unit: Unit, zone: &str) -> Calendar {
        Calendar {
            unit,
            zone: TimeZone::get(zone).expect("a zone"),
            week_starts: Weekday::Monday,
        }
    }

    /// The boundaries around `now` as UTC timestamps.
    fn bounds(c: &Calendar, now: &str, anchor: u8) -> [String; 4] {
        c.bounds(at(now), anchor).expect("bounds").map(text)
    }

    #[test]
    fn a_day_across_dst_lasts_23_or_25_hours_in_berlin_and_new_york() {
        // Berlin: 29 March 2026, 02:00 CET -> 03:00 CEST; 25 October, back.
        let berlin = calendar(Unit::Day, "Europe/Berlin");
        assert_eq!(
            bounds(&berlin, "2026-03-29T12:00:00Z", 1),
            [
                "2026-03-27T23:00:00Z",
                "2026-03-28T23:00:00Z",
                "2026-03-29T22:00:00Z",
                "2026-03-30T22:00:00Z"
            ]
        );
        let b = berlin.bounds(at("2026-03-29T12:00:00Z"), 1).expect("b");
        assert_eq!(b[2] - b[1], 23 * 3_600_000);
        let b = berlin.bounds(at("2026-10-25T12:00:00Z"), 1).expect("b");
        assert_eq!(b[2] - b[1], 25 * 3_600_000);
        // New York: 8 March 2026 springs forward, 1 November falls back.
        let new_york = calendar(Unit::Day, "America/New_York");
        let b = new_york.bounds(at("2026-03-08T17:00:00Z"), 1).expect("b");
        assert_eq!(text(b[1]), "2026-03-08T05:00:00Z");
        assert_eq!(b[2] - b[1], 23 * 3_600_000);
        let b = new_york.bounds(at("2026-11-01T17:00:00Z"), 1).expect("b");
        assert_eq!(text(b[1]), "2026-11-01T04:00:00Z");
        assert_eq!(b[2] - b[1], 25 * 3_600_000);
        // The hour before the fall back is still 31 October's.
        let b = new_york.bounds(at("2026-11-01T03:30:00Z"), 1).expect("b");
        assert_eq!(text(b[1]), "2026-10-31T04:00:00Z");
    }

    #[test]
    fn hours_follow_the_local_clock_across_dst_and_odd_offsets() {
        // Berlin's repeated hour (02:00-03:00 twice on 25 October) is two
        // windows of one hour each.
        let berlin = calendar(Unit::Hour, "Europe/Berlin");
        assert_eq!(
            bounds(&berlin, "2026-10-25T00:30:00Z", 1)[1..3],
            ["2026-10-25T00:00:00Z", "2026-10-25T01:00:00Z"]
        );
        assert_eq!(
            bounds(&berlin, "2026-10-25T01:30:00Z", 1)[1..3],
            ["2026-10-25T01:00:00Z", "2026-10-25T02:00:00Z"]
        );
        // Kolkata is 5:30 ahead: its hours start at :30 UTC.
        let kolkata = calendar(Unit::Hour, "Asia/Kolkata");
        assert_eq!(
            bounds(&kolkata, "2026-06-01T10:00:00Z", 1)[1..3],
            ["2026-06-01T09:30:00Z", "2026-06-01T10:30:00Z"]
        );
        let minute = Calendar::utc(Unit::Minute);
        assert_eq!(
            bounds(&minute, "2026-06-01T10:00:59.999Z", 1),
            [
                "2026-06-01T09:59:00Z",
                "2026-06-01T10:00:00Z",
                "2026-06-01T10:01:00Z",
                "2026-06-01T10:02:00Z"
            ]
        );
    }

    #[test]
    fn months_start_on_the_anchor_or_the_last_day_of_shorter_months() {
        let month = Calendar::utc(Unit::Month);
        // Anchor 31 in April (30 days): the window starts on the 30th.
        assert_eq!(
            bounds(&month, "2026-04-30T10:00:00Z", 31),
            [
                "2026-03-31T00:00:00Z",
                "2026-04-30T00:00:00Z",
                "2026-05-31T00:00:00Z",
                "2026-06-30T00:00:00Z"
            ]
        );
        // On the 29th it is still March's window (from 31 March).
        assert_eq!(
            bounds(&month, "2026-04-29T23:59:59Z", 31)[1],
            "2026-03-31T00:00:00Z"
        );
        // February: the 28th, or the 29th in a leap year.
        assert_eq!(
            bounds(&month, "2026-02-28T00:00:00Z", 31)[1..3],
            ["2026-02-28T00:00:00Z", "2026-03-31T00:00:00Z"]
        );
        assert_eq!(
            bounds(&month, "2028-02-28T12:00:00Z", 31)[1..3],
            ["2028-01-31T00:00:00Z", "2028-02-29T00:00:00Z"]
        );
        assert_eq!(
            bounds(&month, "2028-02-29T12:00:00Z", 30)[1..3],
            ["2028-02-29T00:00:00Z", "2028-03-30T00:00:00Z"]
        );
        // Anchor 15 across the year's end; anchor 1, the calendar month.
        assert_eq!(
            bounds(&month, "2026-01-10T00:00:00Z", 15)[1..3],
            ["2025-12-15T00:00:00Z", "2026-01-15T00:00:00Z"]
        );
        assert_eq!(
            bounds(&month, "2026-12-31T23:59:59Z", 1)[1..4],
            [
                "2026-12-01T00:00:00Z",
                "2027-01-01T00:00:00Z",
                "2027-02-01T00:00:00Z"
            ]
        );
    }

    #[test]
    fn months_and_years_start_at_local_midnight_in_their_zone() {
        let month = calendar(Unit::Month, "America/New_York");
        assert_eq!(
            bounds(&month, "2026-11-15T00:00:00Z", 1)[1..3],
            ["2026-11-01T04:00:00Z", "2026-12-01T05:00:00Z"]
        );
        let year = calendar(Unit::Year, "Europe/Berlin");
        assert_eq!(
            bounds(&year, "2028-02-29T12:00:00Z", 1),
            [
                "2026-12-31T23:00:00Z",
                "2027-12-31T23:00:00Z",
                "2028-12-31T23:00:00Z",
                "2029-12-31T23:00:00Z"
            ]
        );
    }

    #[test]
    fn remembered_boundaries_are_the_computed_ones_and_move_with_the_window() {
        let month = calendar(Unit::Month, "Europe/Berlin");
        let remembered = Remembered::default();
        for now in [
            "2026-03-29T12:00:00Z",
            "2026-03-30T12:00:00Z",
            "2026-04-15T00:00:00Z",
            "2026-04-14T21:59:59Z",
            "2026-12-31T23:30:00Z",
        ] {
            for anchor in [1, 15, 31] {
                assert_eq!(
                    remembered.bounds(&month, at(now), anchor),
                    month.bounds(at(now), anchor),
                    "{now} anchor {anchor}"
                );
            }
        }
        assert_eq!(
            remembered.bounds(&month, at("2026-03-29T12:00:00Z"), 32),
            None
        );
    }

    #[test]
    fn weeks_start_on_the_configured_day() {
        // 3 December 2026 is a Thursday.
        let monday = Calendar::utc(Unit::Week);
        assert_eq!(
            bounds(&monday, "2026-12-03T10:00:00Z", 1)[1..3],
            ["2026-11-30T00:00:00Z", "2026-12-07T00:00:00Z"]
        );
        let sunday = Calendar {
            week_starts: Weekday::Sunday,
            ..Calendar::utc(Unit::Week)
        };
        assert_eq!(
            bounds(&sunday, "2026-12-03T10:00:00Z", 1)[1..3],
            ["2026-11-29T00:00:00Z", "2026-12-06T00:00:00Z"]
        );
        // On the first day itself, the window starts that day.
        assert_eq!(
            bounds(&sunday, "2026-11-29T00:00:00Z", 1)[1],
            "2026-11-29T00:00:00Z"
        );
        // A week across Berlin's fall back lasts 169 hours.
        let berlin = calendar(Unit::Week, "Europe/Berlin");
        let b = berlin.bounds(at("2026-10-22T12:00:00Z"), 1).expect("b");
        assert_eq!(b[2] - b[1], 169 * 3_600_000);
    }
}
