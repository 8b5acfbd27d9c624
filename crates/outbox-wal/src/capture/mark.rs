//! The confirm mark: per slot, a WAL position recorded in `<outbox>_confirm_marks` that no
//! relay confirms the slot past before it has raised the mark. The slot's own confirmed
//! position then never passes the mark, unless something other than a relay moved it: the
//! slot was dropped and made again by hand (PostgreSQL 15 gives a slot no identity to tell
//! the two apart), or advanced by hand with `pg_replication_slot_advance`. Either way its
//! stream skips rows still in the table, and its adoption record does not stand for it: a
//! session start that finds the slot past its mark adopts again.
//!
//! Pure state, decided here and applied by the reader: what may be confirmed now, and when
//! the mark must be raised first. A raise records the position about to be confirmed, so a
//! slot advanced by hand past anything the relay has settled is told too; while events flow
//! the mark is raised at most once a second.

use std::time::{Duration, Instant};

use crate::lsn::Lsn;

/// The confirm mark of the slot a reader streams from, as this process knows it.
#[derive(Debug, Default)]
pub(super) struct ConfirmMark {
    /// The mark as last read or raised: nothing is confirmed past it. `None`: none read yet
    /// (a slot no relay of this version confirmed), so nothing new is confirmed until the
    /// first raise.
    recorded: Option<Lsn>,
    /// The session has adopted its slot's rows (or found them adopted, and the slot not
    /// moved), after which the mark may be raised: a raise before could lift the mark past
    /// a slot moved by hand whose rows no adoption has moved yet.
    checked: bool,
    /// The mark cannot be kept (its table or the privilege on it is missing): the slot is
    /// confirmed as if there were none, and a slot made again by hand is told only by its
    /// `catalog_xmin` (the reader's stranded rows). Tried again at each session start.
    off: bool,
    /// The end of the last transaction with events read: while the mark is short of it, the
    /// mark is raised every second. Past it the confirmable position moves only with
    /// keepalives (other databases' writes, and each raise's own), which would otherwise
    /// raise it every second for good.
    events_through: Lsn,
    /// When a raise was last tried: at most one every [`ConfirmMark::EVERY`].
    last_try: Option<Instant>,
    /// Raises failed in a row.
    failures: u32,
    /// That the mark cannot be kept was said: once a process.
    off_said: bool,
    /// The mark as this process knew it recorded (read, or raised and committed durably)
    /// when the session started: one read lower since was rolled back with the server's
    /// WAL ([`ConfirmMark::checked`]).
    known_at_start: Option<Lsn>,
    /// The highest raise of this session so far.
    raised_since_start: Option<Lsn>,
}

impl ConfirmMark {
    /// The least time between two raises: confirmations wait for the next one at most this
    /// long while events flow.
    pub(super) const EVERY: Duration = Duration::from_secs(1);
    /// How far keepalives alone (no events read) move the confirmable position past the
    /// mark before it is raised: the server keeps that much more WAL for the slot, and an
    /// idle database gets no writes from the relay.
    pub(super) const KEEPALIVE_SLACK: u64 = 16 * 1024 * 1024;
    /// Failed raises in a row after which the relay warns: its confirmations are held at
    /// the mark meanwhile.
    pub(super) const FAILURES_SAID: u32 = 10;

    /// A session starts: no raise until it has adopted (or found its rows adopted); a mark
    /// that could not be kept is tried again.
    pub(super) fn session_started(&mut self) {
        self.checked = false;
        self.off = false;
        self.known_at_start = self.recorded;
        self.raised_since_start = None;
    }

    /// The session's rows are adopted, and the mark read is `recorded` (or none): raises
    /// may follow. Whether the mark went back: it reads lower than this process knew it
    /// when the session started, which no relay does (raises only raise it, and commit
    /// durably). The server's WAL was rolled back past the raise (a disk snapshot or a
    /// backup restored on the same timeline), even where the server has written past what
    /// was read from it since, which the history's check at the session's start misses.
    /// The mark is then taken as read.
    pub(super) fn checked(&mut self, recorded: Option<Lsn>) -> bool {
        let went_back = matches!(
            (recorded, self.known_at_start),
            (Some(read), Some(known)) if read < known
        );
        self.recorded = match went_back {
            true => recorded.max(self.raised_since_start),
            false => self.recorded.max(recorded),
        };
        self.checked = true;
        went_back
    }

    /// Transactions with events were read, the last ending at `through`.
    pub(super) fn events_read(&mut self, through: Lsn) {
        self.events_through = self.events_through.max(through);
    }

    /// What of `wanted` may be confirmed now.
    pub(super) fn confirmable(&self, wanted: Lsn) -> Lsn {
        match self.off {
            true => wanted,
            false => wanted.min(self.recorded.unwrap_or(Lsn(0))),
        }
    }

    /// Whether to raise the mark to `wanted` before confirming it: it is past the mark, the
    /// session has adopted, and a raise is due (or `now_or_never`: the session's last
    /// confirmation, before it closes).
    pub(super) fn raise_due(&self, wanted: Lsn, now: Instant, now_or_never: bool) -> bool {
        let mark = self.recorded.unwrap_or(Lsn(0));
        if self.off || !self.checked || wanted <= mark {
            return false;
        }
        if now_or_never {
            return true;
        }
        let waited = self.last_try.is_none_or(|at| now - at >= Self::EVERY);
        waited && (mark < self.events_through || wanted.0 - mark.0 >= Self::KEEPALIVE_SLACK)
    }

    /// A raise is tried now.
    pub(super) fn trying(&mut self, now: Instant) {
        self.last_try = Some(now);
    }

    /// The mark is `up_to` now.
    pub(super) fn raised(&mut self, up_to: Lsn) {
        self.recorded = self.recorded.max(Some(up_to));
        self.raised_since_start = self.raised_since_start.max(Some(up_to));
        self.failures = 0;
    }

    /// A raise failed: how many have in a row (said once they reach
    /// [`ConfirmMark::FAILURES_SAID`], and told by `/readyz` from then on).
    pub(super) fn failed(&mut self) -> u32 {
        self.failures += 1;
        self.failures
    }

    /// The mark cannot be kept: confirm without it until the next session start. Whether
    /// to say so (the first time in this process).
    pub(super) fn turn_off(&mut self) -> bool {
        self.off = true;
        !std::mem::replace(&mut self.off_said, true)
    }

    pub(super) fn is_off(&self) -> bool {
        self.off
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adopted_at(mark: u64) -> ConfirmMark {
        let mut state = ConfirmMark::default();
        state.session_started();
        state.checked(Some(Lsn(mark)));
        state
    }

    #[test]
    fn nothing_is_confirmed_past_the_mark_and_no_raise_comes_before_the_adoption() {
        let now = Instant::now();
        let mut mark = ConfirmMark::default();
        mark.session_started();
        mark.events_read(Lsn(10_000));
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(0), "no mark read yet");
        assert!(
            !mark.raise_due(Lsn(500), now, true),
            "no raise before the session has adopted its slot's rows"
        );
        mark.checked(Some(Lsn(300)));
        assert_eq!(mark.confirmable(Lsn(200)), Lsn(200));
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(300), "held at the mark");
        assert!(!mark.raise_due(Lsn(300), now, false), "not past the mark");
        assert!(mark.raise_due(Lsn(500), now, false));
        mark.trying(now);
        mark.raised(Lsn(500));
        assert_eq!(mark.confirmable(Lsn(500)), Lsn(500));
    }

    /// A session that breaks mid-adoption leaves the next one's check to read the mark the
    /// moved slot is past: the session's raises wait for its own adoption.
    #[test]
    fn a_new_session_raises_nothing_until_it_has_adopted() {
        let now = Instant::now();
        let mut mark = adopted_at(100);
        mark.events_read(Lsn(10_000));
        mark.session_started();
        assert!(!mark.raise_due(Lsn(900), now, true));
        assert_eq!(mark.confirmable(Lsn(900)), Lsn(100));
    }

    #[test]
    fn a_raise_is_tried_at_most_once_a_second_except_for_a_sessions_last_confirmation() {
        let start = Instant::now();
        let mut mark = adopted_at(100);
        mark.events_read(Lsn(10_000));
        mark.trying(start);
        mark.raised(Lsn(200));
        mark.events_read(Lsn(10_000));
        let soon = start + Duration::from_millis(300);
        assert!(!mark.raise_due(Lsn(250), soon, false));
        assert!(
            mark.raise_due(Lsn(250), soon, true),
            "the last confirmation"
        );
        assert!(mark.raise_due(Lsn(250), start + ConfirmMark::EVERY, false));
    }

    /// Each raise writes WAL past the mark it records, and a keepalive then moves the
    /// confirmable position past it: raised for that, an idle database would get a write
    /// every second for good.
    #[test]
    fn keepalives_alone_raise_the_mark_only_once_far_past_it() {
        let start = Instant::now();
        let later = start + ConfirmMark::EVERY * 5;
        let mut mark = adopted_at(1000);
        mark.events_read(Lsn(900));
        mark.trying(start);
        assert!(
            !mark.raise_due(Lsn(1000 + 200), later, false),
            "the raise's own WAL"
        );
        let far = Lsn(1000 + ConfirmMark::KEEPALIVE_SLACK);
        assert!(
            mark.raise_due(far, later, false),
            "other databases' writes, at length"
        );
        mark.events_read(Lsn(1100));
        assert!(
            mark.raise_due(Lsn(1000 + 200), later, false),
            "events were read"
        );
    }

    /// An event settled after the last raise (its row's commit showed late, a retry parked
    /// it): the mark is short of its transaction, and is raised again once it settles.
    /// Before, a raise forgot that events had been read, and the slot stayed at the mark.
    #[test]
    fn events_settled_after_a_raise_raise_it_again() {
        let start = Instant::now();
        let mut mark = adopted_at(100);
        mark.events_read(Lsn(500));
        mark.trying(start);
        mark.raised(Lsn(200));
        let later = start + ConfirmMark::EVERY * 6;
        assert!(mark.raise_due(Lsn(520), later, false));
        mark.trying(later);
        mark.raised(Lsn(520));
        let after = later + ConfirmMark::EVERY;
        assert!(
            !mark.raise_due(Lsn(600), after, false),
            "keepalives only, from here"
        );
    }

    #[test]
    fn failed_raises_leave_the_mark_wait_their_turn_and_are_said_after_ten() {
        let start = Instant::now();
        let mut mark = adopted_at(100);
        mark.events_read(Lsn(10_000));
        mark.trying(start);
        assert_eq!(mark.confirmable(Lsn(250)), Lsn(100));
        assert!(!mark.raise_due(Lsn(250), start, false));
        let failures: Vec<u32> = (0..12).map(|_| mark.failed()).collect();
        assert_eq!(failures, (1..=12).collect::<Vec<u32>>());
        mark.raised(Lsn(250));
        assert!(
            !(0..9).any(|_| mark.failed() >= ConfirmMark::FAILURES_SAID),
            "counted again from a success"
        );
    }

    #[test]
    fn a_mark_that_cannot_be_kept_holds_nothing_back_until_the_next_session() {
        let mut mark = adopted_at(100);
        mark.turn_off();
        assert_eq!(mark.confirmable(Lsn(700)), Lsn(700));
        assert!(!mark.raise_due(Lsn(700), Instant::now(), true));
        mark.session_started();
        assert!(!mark.is_off(), "tried again");
        assert_eq!(mark.confirmable(Lsn(700)), Lsn(100));
    }

    /// A mark read lower than this process raised it: the server's WAL was rolled back
    /// (restored to a disk snapshot), which a crash never does. A session's own raise
    /// before its check (its adoption's) is no such thing.
    #[test]
    fn a_mark_read_lower_than_raised_before_says_the_wal_was_rolled_back() {
        let mut mark = adopted_at(300);
        mark.raised(Lsn(900));
        mark.session_started();
        assert!(!mark.checked(Some(Lsn(900))), "a crash");
        mark.session_started();
        mark.raised(Lsn(1000));
        assert!(
            !mark.checked(Some(Lsn(900))),
            "read before the adoption's raise"
        );
        mark.session_started();
        assert!(mark.checked(Some(Lsn(300))), "a snapshot restored");
        assert_eq!(mark.confirmable(Lsn(2000)), Lsn(300), "taken as read");
        mark.session_started();
        mark.raised(Lsn(400));
        assert!(mark.checked(Some(Lsn(200))));
        assert_eq!(
            mark.confirmable(Lsn(2000)),
            Lsn(400),
            "with the session's raise"
        );
        mark.session_started();
        assert!(!mark.checked(None), "no mark row: nothing to compare");
    }

    /// A raise read back lower than the mark (another relay's, racing) never lowers it.
    #[test]
    fn the_mark_only_rises() {
        let mut mark = adopted_at(400);
        mark.raised(Lsn(300));
        mark.checked(Some(Lsn(200)));
        assert_eq!(mark.confirmable(Lsn(1000)), Lsn(400));
    }
}
