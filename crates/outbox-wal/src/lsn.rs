//! WAL positions.

use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log (PostgreSQL's `pg_lsn`): a byte offset, written `X/Y`
/// with both halves in hexadecimal. `Lsn::ZERO` is PostgreSQL's "invalid" position.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    pub const ZERO: Lsn = Lsn(0);
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

/// Text that is not a `pg_lsn`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a WAL position: expected two hexadecimal halves as in 16/B374D848")]
pub struct ParseLsnError(pub String);

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || ParseLsnError(text.to_string());
        let (high, low) = text.split_once('/').ok_or_else(bad)?;
        let half = |s: &str| {
            if s.is_empty() || s.len() > 8 {
                return Err(bad());
            }
            u32::from_str_radix(s, 16).map_err(|_| bad())
        };
        Ok(Lsn((u64::from(half(high)?) << 32) | u64::from(half(low)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_round_trips_and_rejects_garbage() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn, Lsn(0x16_B374_D848));
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert_eq!("0/0".parse::<Lsn>().unwrap(), Lsn::ZERO);
        for bad in ["", "16", "/1", "1/", "G/1", "1/123456789", "1/2/3"] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad}");
        }
    }
}
