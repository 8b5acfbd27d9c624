//! Whether the oldest transaction a capture holds is moving. A capture's position (the WAL
//! slot's confirmation, the stored binlog position) passes a transaction only once each of
//! its events is settled. An event handed out and never settled, by a bug or a sink that
//! never answers, stops the position for good while everything after it flows: the server
//! keeps its WAL or binary logs, and nothing else tells. [`SettleWatch`] tells, from the
//! progress of the oldest transaction held, sampled whenever `/readyz` or the metrics look.

use std::time::{Duration, Instant};

/// How long the oldest transaction held may go without any progress (an event of it
/// settled, or more of it read) before its capture says it is stalled: longer than a
/// publish's timeout and its park, and than a slow sink's turn for a lane head among
/// thousands of keys, so that a healthy relay never says it.
pub const SETTLE_PATIENCE: Duration = Duration::from_secs(300);

/// The progress of the oldest transaction held, watched: `P` is what changes when it moves
/// (its position, how many events were read and settled), `None` when nothing is held.
#[derive(Debug)]
pub struct SettleWatch<P> {
    patience: Duration,
    /// The oldest transaction's progress when last seen, and since when it has not changed.
    front: Option<(P, Instant)>,
    /// Whether the stall now in force was told ([`Stalled::first`]).
    told: bool,
}

/// The oldest transaction held has not moved for `still`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stalled {
    pub still: Duration,
    /// Whether this is the first look that found this stall (log it once).
    pub first: bool,
}

impl Stalled {
    /// What `/readyz` says of the stall of `capture` ("WAL", "binlog"), logged as an error
    /// at its first look: `front` describes the transaction, `held_back` what it stops.
    pub fn report(&self, capture: &str, front: &str, held_back: &str) -> String {
        let what = format!(
            "the oldest transaction {capture} capture holds ({front}) has not moved for {} s: \
             {held_back}, while later events flow; restart the relay (what it holds is read \
             again) and report it with the relay's log",
            self.still.as_secs()
        );
        if self.first {
            tracing::error!(stall = %what, "{capture} capture stalled");
        }
        what
    }
}

impl<P: PartialEq> SettleWatch<P> {
    /// A watch that calls a transaction stalled after `patience` without progress
    /// ([`SETTLE_PATIENCE`] but in tests).
    pub fn new(patience: Duration) -> Self {
        SettleWatch {
            patience,
            front: None,
            told: false,
        }
    }

    /// Looks at `front`, the oldest transaction's progress now (`None`: nothing held), at
    /// `now`; returns the stall once it has not moved for the patience. Looks may be far
    /// apart: a transaction is stalled only if two looks at least the patience apart found
    /// the same progress (progress only grows, so an unchanged one never moved between).
    pub fn look(&mut self, front: Option<P>, now: Instant) -> Option<Stalled> {
        let Some(front) = front else {
            self.front = None;
            self.told = false;
            return None;
        };
        match &self.front {
            Some((seen, since)) if *seen == front => {
                let still = now.saturating_duration_since(*since);
                if still < self.patience {
                    return None;
                }
                let first = !self.told;
                self.told = true;
                Some(Stalled { still, first })
            }
            _ => {
                self.front = Some((front, now));
                self.told = false;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PATIENCE: Duration = Duration::from_secs(300);

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// (position, settled): what the WAL's front reports, in small.
    type Front = (u64, u32);

    #[test]
    fn a_front_that_does_not_move_for_the_patience_is_stalled_and_told_once() {
        let start = Instant::now();
        let mut watch = SettleWatch::<Front>::new(PATIENCE);
        assert_eq!(watch.look(Some((10, 0)), start), None);
        assert_eq!(watch.look(Some((10, 0)), start + secs(299)), None);
        assert_eq!(
            watch.look(Some((10, 0)), start + secs(300)),
            Some(Stalled {
                still: secs(300),
                first: true
            })
        );
        assert_eq!(
            watch.look(Some((10, 0)), start + secs(400)),
            Some(Stalled {
                still: secs(400),
                first: false
            })
        );
    }

    #[test]
    fn any_progress_of_the_front_starts_the_patience_again() {
        let start = Instant::now();
        let mut watch = SettleWatch::<Front>::new(PATIENCE);
        watch.look(Some((10, 0)), start);
        assert_eq!(
            watch.look(Some((10, 1)), start + secs(299)),
            None,
            "one settled"
        );
        assert_eq!(watch.look(Some((10, 1)), start + secs(500)), None);
        assert!(watch.look(Some((10, 1)), start + secs(599)).is_some());
        assert_eq!(
            watch.look(Some((20, 0)), start + secs(600)),
            None,
            "the next transaction is the front"
        );
    }

    /// A stall that ended and a later one: each is told once.
    #[test]
    fn a_second_stall_is_told_again() {
        let start = Instant::now();
        let mut watch = SettleWatch::<Front>::new(PATIENCE);
        watch.look(Some((10, 0)), start);
        assert!(watch.look(Some((10, 0)), start + secs(300)).unwrap().first);
        watch.look(Some((10, 1)), start + secs(301));
        let again = watch.look(Some((10, 1)), start + secs(601)).unwrap();
        assert!(again.first);
    }

    /// Nothing held between two looks: the next front is watched from its own first look,
    /// even if it has the same progress as the old one (a new session reading the same
    /// transaction again).
    #[test]
    fn nothing_held_forgets_the_front() {
        let start = Instant::now();
        let mut watch = SettleWatch::<Front>::new(PATIENCE);
        watch.look(Some((10, 0)), start);
        assert_eq!(watch.look(None, start + secs(200)), None);
        assert_eq!(watch.look(Some((10, 0)), start + secs(300)), None);
        assert!(watch.look(Some((10, 0)), start + secs(600)).is_some());
    }

    /// A clock read out of order (looks from two tasks) never underflows.
    #[test]
    fn an_earlier_now_is_no_stall() {
        let start = Instant::now() + secs(10);
        let mut watch = SettleWatch::<Front>::new(PATIENCE);
        watch.look(Some((10, 0)), start);
        assert_eq!(watch.look(Some((10, 0)), start - secs(5)), None);
    }
}
