//! Conversions between Rust time and the integers stores bind: milliseconds of a duration,
//! microseconds since the Unix epoch.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A duration in whole milliseconds, saturating.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Microseconds since the Unix epoch (negative before it).
pub fn micros(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

/// The time `micros` microseconds after the Unix epoch.
pub fn from_micros(micros: i64) -> SystemTime {
    if micros >= 0 {
        UNIX_EPOCH + Duration::from_micros(micros as u64)
    } else {
        UNIX_EPOCH - Duration::from_micros(micros.unsigned_abs())
    }
}

/// The first microsecond RFC 3339 can write: `0001-01-01T00:00:00Z`.
pub const RFC3339_FIRST_MICROS: i64 = -62_135_596_800_000_000;
/// The last microsecond RFC 3339 can write: `9999-12-31T23:59:59.999999Z`.
pub const RFC3339_LAST_MICROS: i64 = 253_402_300_799_999_999;

/// Why a `created_at` cannot be carried, or `None` when it can: any time RFC 3339 writes
/// (years 1 to 9999, before the Unix epoch too). Beyond that range a time is not one an
/// application meant (`'infinity'`, a stray integer), and sinks could not write it.
pub fn created_at_problem(micros_since_epoch: i64) -> Option<String> {
    if (RFC3339_FIRST_MICROS..=RFC3339_LAST_MICROS).contains(&micros_since_epoch) {
        return None;
    }
    let what = match micros_since_epoch {
        i64::MAX => "infinity".to_string(),
        i64::MIN => "-infinity".to_string(),
        m => format!("{m} microseconds from the Unix epoch"),
    };
    Some(format!(
        "created_at is {what}, outside the years 1 to 9999 that an event can carry; \
         set created_at to the event's real time in the dead letters, then `outbox-relay dead retry`"
    ))
}

/// `t` as RFC 3339 in UTC with microseconds (`1969-07-20T20:17:40.000000Z`), on both sides
/// of the Unix epoch; an error for times outside years 1 to 9999.
pub fn rfc3339_micros(t: SystemTime) -> Result<String, String> {
    Rfc3339Micros::of(t).map(|text| text.as_str().to_owned())
}

/// `t` as RFC 3339 in UTC with milliseconds (`1969-07-20T20:17:40.000Z`), for people and
/// the console, whatever the time: one outside years 1 to 9999 (a row's own `created_at`
/// can be anything) as its microseconds from the Unix epoch. `humantime`'s formatter panics
/// on times before 1970, which the relay carries.
pub fn display_time(t: SystemTime) -> String {
    match Rfc3339Micros::of(t) {
        Ok(text) => format!("{}Z", &text.as_str()[..23]),
        Err(_) => format!("{} microseconds from the Unix epoch", micros(t)),
    }
}

/// A time as RFC 3339 in UTC with microseconds, in a fixed buffer: sinks write one per
/// event, and formatting through `format!` cost more than the rest of a JSON line's fields.
#[derive(Clone, Copy)]
pub struct Rfc3339Micros([u8; 27]);

impl Rfc3339Micros {
    /// `t`, or why it cannot be written (outside years 1 to 9999).
    pub fn of(t: SystemTime) -> Result<Self, String> {
        let m = micros(t);
        if let Some(problem) = created_at_problem(m) {
            return Err(problem);
        }
        let (secs, micro) = (m.div_euclid(1_000_000), m.rem_euclid(1_000_000));
        let (days, second_of_day) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let (year, month, day) = civil_date(days);
        let mut text = *b"0000-00-00T00:00:00.000000Z";
        for (at, width, value) in [
            (0, 4, year),
            (5, 2, month),
            (8, 2, day),
            (11, 2, second_of_day / 3600),
            (14, 2, second_of_day / 60 % 60),
            (17, 2, second_of_day % 60),
            (20, 6, micro),
        ] {
            let mut value = value;
            for digit in text[at..at + width].iter_mut().rev() {
                *digit = b'0' + (value % 10) as u8;
                value /= 10;
            }
        }
        Ok(Rfc3339Micros(text))
    }

    pub fn as_str(&self) -> &str {
        // Only ASCII digits and separators are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl serde::Serialize for Rfc3339Micros {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// The proleptic Gregorian date `days` after 1970-01-01. Counts in 400-year cycles of
/// 146,097 days whose years start on 1 March, so the leap day ends each year.
fn civil_date(days: i64) -> (i64, i64, i64) {
    const CYCLE: i64 = 146_097;
    // Days from 0000-03-01 to 1970-01-01.
    let shifted = days + 719_468;
    let cycle = shifted.div_euclid(CYCLE);
    let day_of_cycle = shifted.rem_euclid(CYCLE);
    // Years into the cycle: remove the leap days of 4-, 100- and 400-year periods.
    let year_of_cycle = (day_of_cycle - day_of_cycle / 1460 + day_of_cycle / 36_524
        - day_of_cycle / (CYCLE - 1))
        / 365;
    let day_of_year =
        day_of_cycle - (365 * year_of_cycle + year_of_cycle / 4 - year_of_cycle / 100);
    // Months from March, of 31/30 days alternating in a 153-day, 5-month pattern.
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = cycle * 400 + year_of_cycle + i64::from(month <= 2);
    (year, month, day)
}

/// A timestamp's ISO text (`2026-11-23 12:38:36.123456+00`, offsets as `+05:30` or
/// `-03:00:15`, years past 9999, ` BC`), or with `utc_without_offset` also one without an
/// offset (PostgreSQL's `timestamp without time zone`, MySQL's `DATETIME`), read as UTC. Every event of a captured table
/// has a timestamp, so this allocates nothing unless it fails.
pub fn parse_timestamp(text: &str, utc_without_offset: bool) -> Result<SystemTime, String> {
    timestamp_micros(text.as_bytes(), utc_without_offset)
        .map(from_micros)
        .ok_or_else(|| format!("{text:?} is not an ISO timestamp with time zone"))
}

/// [`parse_timestamp`]'s reading, left to right over the bytes: a captured table's rows
/// carry one per event, and searching and splitting the text cost a tenth of a row's
/// decoding.
fn timestamp_micros(text: &[u8], utc_without_offset: bool) -> Option<i64> {
    let (text, bc) = match text.strip_suffix(b" BC") {
        Some(rest) => (rest, true),
        None => (text, false),
    };
    let mut at = Cursor(text);
    let year = at.digits(1, 7)?;
    at.skip(b'-')?;
    let month = at.digits(1, 2)?;
    at.skip(b'-')?;
    let day = at.digits(1, 2)?;
    at.skip(b' ')?;
    let h = at.digits(2, 2)?;
    at.skip(b':')?;
    let m = at.digits(2, 2)?;
    at.skip(b':')?;
    let s = at.digits(2, 2)?;
    // 24:00:00 is valid PostgreSQL input and output.
    if h > 24 || m > 59 || s > 60 {
        return None;
    }
    let micros_fraction = match at.skip(b'.') {
        None => 0,
        Some(()) => {
            // `.5` is 500,000 microseconds.
            let before = at.0.len();
            let digits = at.digits(0, 6)?;
            digits * 10_i64.pow(6 - (before - at.0.len()) as u32)
        }
    };
    let offset_seconds = match at.0.first() {
        None if utc_without_offset => 0,
        Some(&sign @ (b'+' | b'-')) => {
            at.0 = &at.0[1..];
            let mut seconds = 0;
            for unit in [3600, 60, 1] {
                let part = at.digits(2, 2)?;
                if part > 59 {
                    return None;
                }
                seconds += part * unit;
                if unit == 1 || at.skip(b':').is_none() {
                    break;
                }
            }
            if sign == b'-' {
                -seconds
            } else {
                seconds
            }
        }
        _ => return None,
    };
    if !at.0.is_empty()
        || !(1..=12).contains(&month)
        || !(1..=days_in_month(year, month, bc)).contains(&day)
    {
        return None;
    }
    // Year 1 BC is year 0 of the proleptic Gregorian calendar.
    let year = if bc { 1 - year } else { year };
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + h * 3600 + m * 60 + s - offset_seconds;
    seconds
        .checked_mul(1_000_000)
        .and_then(|us| us.checked_add(micros_fraction))
}

/// What is left of a timestamp's text.
struct Cursor<'a>(&'a [u8]);

impl Cursor<'_> {
    fn skip(&mut self, byte: u8) -> Option<()> {
        self.0 = self.0.strip_prefix(&[byte])?;
        Some(())
    }

    /// A run of `min..=max` ASCII digits (all the digits there are), as a number.
    fn digits(&mut self, min: usize, max: usize) -> Option<i64> {
        let len = self.0.iter().take_while(|b| b.is_ascii_digit()).count();
        if len < min || len > max {
            return None;
        }
        let (digits, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(digits.iter().fold(0, |n, d| n * 10 + i64::from(d - b'0')))
    }
}

fn days_in_month(year: i64, month: i64, bc: bool) -> i64 {
    let year = if bc { 1 - year } else { year };
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year.rem_euclid(400);
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn micros_round_trip_on_both_sides_of_the_epoch() {
        for m in [-1_500_000i64, 0, 1_700_000_000_123_456] {
            assert_eq!(micros(from_micros(m)), m);
        }
        assert_eq!(millis(Duration::from_secs(2)), 2000);
    }

    #[test]
    fn a_time_is_displayed_on_both_sides_of_the_epoch_and_outside_rfc3339s_years() {
        assert_eq!(
            display_time(from_micros(-1_500_000)),
            "1969-12-31T23:59:58.500Z"
        );
        assert_eq!(
            display_time(from_micros(1_700_000_000_123_456)),
            "2023-11-14T22:13:20.123Z"
        );
        assert_eq!(
            display_time(from_micros(RFC3339_LAST_MICROS + 1)),
            "253402300800000000 microseconds from the Unix epoch"
        );
    }

    #[test]
    fn rfc3339_writes_years_1_to_9999_on_both_sides_of_the_epoch() {
        let cases = [
            (RFC3339_FIRST_MICROS, "0001-01-01T00:00:00.000000Z"),
            (-14_182_940_000_000, "1969-07-20T20:17:40.000000Z"),
            (-1, "1969-12-31T23:59:59.999999Z"),
            (0, "1970-01-01T00:00:00.000000Z"),
            (951_782_400_000_000, "2000-02-29T00:00:00.000000Z"),
            (1_700_000_000_123_456, "2023-11-14T22:13:20.123456Z"),
            (RFC3339_LAST_MICROS, "9999-12-31T23:59:59.999999Z"),
        ];
        for (m, text) in cases {
            assert_eq!(rfc3339_micros(from_micros(m)).as_deref(), Ok(text), "{m}");
        }
        // Agrees with humantime wherever humantime can write a time (from 1970).
        for m in (0..RFC3339_LAST_MICROS).step_by(7_777_777_777_777) {
            let ours = rfc3339_micros(from_micros(m)).unwrap();
            let theirs = humantime::format_rfc3339_micros(from_micros(m)).to_string();
            assert_eq!(ours, theirs, "{m}");
        }
    }

    /// The parser before it read bytes left to right: the new one must agree with it on
    /// every text, valid or not.
    fn reference_parse(text: &str, utc_without_offset: bool) -> Result<SystemTime, String> {
        let bad = || format!("{text:?} is not an ISO timestamp with time zone");
        let (text_ad, bc) = match text.strip_suffix(" BC") {
            Some(rest) => (rest, true),
            None => (text, false),
        };
        let (date, rest) = text_ad.split_once(' ').ok_or_else(bad)?;
        let mut date_parts = date.splitn(3, '-');
        let mut number = |max_len: usize| -> Result<i64, String> {
            let part = date_parts.next().ok_or_else(bad)?;
            if part.is_empty() || part.len() > max_len || !part.bytes().all(|b| b.is_ascii_digit())
            {
                return Err(bad());
            }
            part.parse().map_err(|_| bad())
        };
        let year = number(7)?;
        let month = number(2)?;
        let day = number(2)?;
        // The offset starts at the first sign after the time.
        let (time, offset) = match rest.find(['+', '-']) {
            Some(sign_at) => rest.split_at(sign_at),
            None if utc_without_offset => (rest, ""),
            None => return Err(bad()),
        };
        let (hms, fraction) = match time.split_once('.') {
            Some((hms, fraction)) => (hms, fraction),
            None => (time, ""),
        };
        let field = |s: &str, max: i64| -> Result<i64, String> {
            if s.len() != 2 || !s.bytes().all(|b| b.is_ascii_digit()) {
                return Err(bad());
            }
            let v: i64 = s.parse().map_err(|_| bad())?;
            if v > max {
                return Err(bad());
            }
            Ok(v)
        };
        let mut hms = hms.split(':');
        let (Some(h), Some(m), Some(s), None) = (hms.next(), hms.next(), hms.next(), hms.next())
        else {
            return Err(bad());
        };
        // 24:00:00 is valid PostgreSQL input and output.
        let (h, m, s) = (field(h, 24)?, field(m, 59)?, field(s, 60)?);
        if fraction.len() > 6 || !fraction.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let micros_fraction: i64 = if fraction.is_empty() {
            0
        } else {
            // `.5` is 500,000 microseconds.
            let digits: i64 = fraction.parse().map_err(|_| bad())?;
            digits * 10_i64.pow(6 - fraction.len() as u32)
        };
        let offset_seconds = match offset.split_at_checked(1) {
            None => 0,
            Some((sign, offset)) => {
                let mut seconds = 0;
                for (i, part) in offset.split(':').enumerate() {
                    let unit = [3600, 60, 1].get(i).ok_or_else(bad)?;
                    seconds += field(part, 59)? * unit;
                }
                if sign == "-" {
                    -seconds
                } else {
                    seconds
                }
            }
        };
        if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month, bc) {
            return Err(bad());
        }
        // Year 1 BC is year 0 of the proleptic Gregorian calendar.
        let year = if bc { 1 - year } else { year };
        let days = days_from_civil(year, month, day);
        let seconds = days * 86_400 + h * 3600 + m * 60 + s - offset_seconds;
        let micros = seconds
            .checked_mul(1_000_000)
            .and_then(|us| us.checked_add(micros_fraction))
            .ok_or_else(bad)?;
        Ok(from_micros(micros))
    }

    #[test]
    fn the_byte_reader_agrees_with_the_splitting_reader_on_every_text() {
        let seeds = [
            "2026-11-23 12:38:36.123456+00",
            "2026-11-23 12:38:36+05:30",
            "1969-12-31 23:59:59.5-03:00:15",
            "0001-01-01 00:00:00+00 BC",
            "2024-02-29 24:00:00.000001+00",
            "12345-06-07 08:09:60.1+14",
            "2026-1-2 03:04:05",
            "2026-11-23 12:38:36.",
        ];
        let alphabet = b"0123456789-:. +BCx9";
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = |bound: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % bound as u64) as usize
        };
        let mut checked = 0;
        for seed in seeds {
            for _ in 0..4000 {
                let mut text = seed.as_bytes().to_vec();
                for _ in 0..=next(3) {
                    let at = next(text.len() + 1);
                    match next(3) {
                        0 if at < text.len() => text[at] = alphabet[next(alphabet.len())],
                        1 if at < text.len() => {
                            text.remove(at);
                        }
                        _ => text.insert(at, alphabet[next(alphabet.len())]),
                    }
                }
                let text = String::from_utf8(text).expect("ASCII");
                for utc in [false, true] {
                    assert_eq!(
                        parse_timestamp(&text, utc),
                        reference_parse(&text, utc),
                        "{text:?} (utc_without_offset {utc})"
                    );
                    checked += 1;
                }
            }
            for utc in [false, true] {
                assert_eq!(
                    parse_timestamp(seed, utc),
                    reference_parse(seed, utc),
                    "{seed}"
                );
            }
        }
        assert!(checked > 60_000);
        assert!(parse_timestamp(seeds[0], false).is_ok());
    }

    #[test]
    fn times_rfc3339_cannot_write_are_refused_with_the_fix() {
        for m in [
            RFC3339_LAST_MICROS + 1,
            RFC3339_FIRST_MICROS - 1,
            i64::MAX,
            i64::MIN,
        ] {
            let err = rfc3339_micros(from_micros(m)).unwrap_err();
            assert!(err.contains("outside the years 1 to 9999"), "{err}");
            assert!(err.contains("dead retry"), "{err}");
        }
        assert!(created_at_problem(i64::MAX).unwrap().contains("infinity"));
    }
}

/// Durations written with units (`500ms`, `2s`, `5m`, `7d`), for settings:
/// `#[serde(with = "outbox_core::time::duration_text")]`.
pub mod duration_text {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    /// A bare number (an environment variable `LEASE=10` arrives as one) is refused for its
    /// missing unit, not for its type.
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Written {
        Text(String),
        Number(f64),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = match Written::deserialize(d)? {
            Written::Text(text) => text,
            Written::Number(n) => n.to_string(),
        };
        parse(&text).map_err(serde::de::Error::custom)
    }

    /// The longest duration a setting takes. Longer ones are typing errors, and added to a
    /// clock, or counted in milliseconds by a database, they would overflow.
    pub const MAX: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

    pub fn parse(text: &str) -> Result<Duration, String> {
        let d = humantime::parse_duration(text.trim()).map_err(|e| {
            format!("invalid duration {text:?} ({e}); write it with a unit, e.g. 500ms, 2s, 5m")
        })?;
        if d > MAX {
            return Err(format!(
                "duration {text:?} is longer than any setting takes: write one of at most 100 \
                 years (36500d)"
            ));
        }
        Ok(d)
    }
}
