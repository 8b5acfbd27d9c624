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
}
