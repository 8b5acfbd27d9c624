//! The confirm mark: per slot, a WAL position recorded in `<outbox>_confirm_marks` that no
//! relay confirms the slot past before it has raised the mark. The slot's own confirmed
//! position then never passes the mark, unless something other than a relay moved it: the
//! slot was dropped and made again by hand (PostgreSQL 15 gives a slot no identity to tell
//! the two apart), or advanced by hand with `pg_replication_slot_advance`. Either way its
//! stream skips rows still in the table, and its adoption record does not stand for it: a
//! session start that finds the slot past its mark adopts again.
//!
//! Pure state, decided here and applied by the reader: what may be confirmed now, and when
//! the mark must be raised first. A raise writes the server's WAL position at that moment,
//! past everything the relay was sent, so one raise a second covers a stream at any rate.

use std::time::{Duration, Instant};

use crate::lsn::Lsn;

/// The confirm mark of the slot a reader streams from, as this process knows it.
#[derive(Debug, Default)]
pub(super) struct ConfirmMark {
    /// The mark as last read or raised: nothing is confirmed past it. `None`: none read yet
    /// (a slot no relay of this version confirmed), so nothing new is confirmed until the
    /// first raise.
    recorded: Option<Lsn>,
    /// The session's adoption check has run, after which the mark may be raised: a raise
    /// before it could lift the mark past a slot made again by hand, which the check must
    /// see confirmed past its (older) mark.
    checked: bool,
    /// The mark cannot be kept (its table or the privilege on it is missing): the slot is
    /// confirmed as if there were none, and a slot made again by hand is told only by its
    /// `catalog_xmin` ([`super::reader`]'s stranded rows).
    off: bool,
    /// When a raise was last tried: at most one every [`ConfirmMark::EVERY`].
    last_try: Option<Instant>,
}

impl ConfirmMark {
    /// The least time between two raises: confirmations wait for the next one at most this
    /// long, and the database gets one small write a second while the WAL moves.
    pub(super) const EVERY: Duration = Duration::from_secs(1);

    /// A session starts: no raise until its adoption check has run.
    pub(super) fn session_started(&mut self) {
        self.checked = false;
    }

    /// The session's adoption check has run and read `recorded` (or nothing); raises may
    /// follow.
    pub(super) fn checked(&mut self, recorded: Option<Lsn>) {
        self.recorded = self.recorded.max(recorded);
        self.checked = true;
    }

    /// What of `wanted` may be confirmed now.
    pub(super) fn confirmable(&self, wanted: Lsn) -> Lsn {
        match self.off {
            true => wanted,
            false => wanted.min(self.recorded.unwrap_or(Lsn(0))),
        }
    }

    /// Whether to raise the mark before confirming `wanted`: it is past the mark, the
    /// session's check has run, and the last try was long enough ago (or `now_or_never`:
    /// the session's last confirmation, before it closes).
    pub(super) fn raise_due(&self, wanted: Lsn, now: Instant, now_or_never: bool) -> bool {
        !self.off
            && self.checked
            && self.recorded.is_none_or(|mark| wanted > mark)
            && (now_or_never || self.last_try.is_none_or(|at| now - at >= Self::EVERY))
    }

    /// A raise is tried now.
    pub(super) fn trying(&mut self, now: Instant) {
        self.last_try = Some(now);
    }

    /// The mark is `up_to` now.
    pub(super) fn raised(&mut self, up_to: Lsn) {
        self.recorded = self.recorded.max(Some(up_to));
    }

    /// The mark cannot be kept: confirm without it from now on.
    pub(super) fn turn_off(&mut self) {
        self.off = true;
    }

    pub(super) fn is_off(&self) -> bool {
        self.off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_is_confirmed_past_the_mark_and_the_first_raise_waits_for_the_check() {
        let now = Instant::now();
        let mut mark = ConfirmMark::default();
        mark.session_started();
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(0), "no mark read yet");
        assert!(
            !mark.raise_due(Lsn(500), now, true),
            "no raise before the session's adoption check has read the mark"
        );
        mark.checked(Some(Lsn(300)));
        assert_eq!(mark.confirmable(Lsn(200)), Lsn(200));
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(300), "held at the mark");
        assert!(!mark.raise_due(Lsn(300), now, false), "not past the mark");
        assert!(mark.raise_due(Lsn(500), now, false));
        mark.trying(now);
        mark.raised(Lsn(900));
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(500));
    }

    #[test]
    fn a_raise_is_tried_at_most_once_a_second_except_for_a_sessions_last_confirmation() {
        let start = Instant::now();
        let mut mark = ConfirmMark::default();
        mark.checked(Some(Lsn(100)));
        mark.trying(start);
        mark.raised(Lsn(200));
        let soon = start + Duration::from_millis(300);
        assert!(!mark.raise_due(Lsn(250), soon, false));
        assert!(
            mark.raise_due(Lsn(250), soon, true),
            "the last confirmation"
        );
        assert!(mark.raise_due(Lsn(250), start + ConfirmMark::EVERY, false));
    }

    #[test]
    fn a_failed_raise_leaves_the_mark_and_waits_its_turn() {
        let start = Instant::now();
        let mut mark = ConfirmMark::default();
        mark.checked(Some(Lsn(100)));
        mark.trying(start);
        assert_eq!(mark.confirmable(Lsn(250)), Lsn(100));
        assert!(!mark.raise_due(Lsn(250), start, false));
    }

    #[test]
    fn a_mark_that_cannot_be_kept_holds_nothing_back() {
        let mut mark = ConfirmMark::default();
        mark.turn_off();
        assert_eq!(mark.confirmable(Lsn(700)), Lsn(700));
        assert!(!mark.raise_due(Lsn(700), Instant::now(), true));
    }

    /// A raise read back lower than the mark (another relay's, racing) never lowers it.
    #[test]
    fn the_mark_only_rises() {
        let mut mark = ConfirmMark::default();
        mark.checked(Some(Lsn(400)));
        mark.raised(Lsn(300));
        mark.checked(Some(Lsn(200)));
        assert_eq!(mark.confirmable(Lsn(1000)), Lsn(400));
    }
}
