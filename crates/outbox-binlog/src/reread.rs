//! Rows settled past the stored position, which the next session reads again. The position
//! is stored every second or so, and rows are settled all the while: a session that breaks
//! (its dump connection cut, the server restarted) leaves the next one to read from the
//! stored position, through rows the engine has delivered already. Handed out again, each
//! went out twice, and a key's earlier event could follow a later one still with the engine
//! (1, 2, 1). The next session settles each such row unsent instead.
//!
//! Rows are known by their outbox row id (of any type) and event id together
//! ([`RowIdentity`]): the reading's ordinals start again with every session, a table's ids
//! alone could be reused (a table emptied and its counter reset), and so could event ids.
//! A BLACKHOLE row has no row id: two such
//! rows with one event id, both within a second of a break, are one event to the relay, as
//! they are to a consumer that drops duplicates by event id.
//!
//! Pure state: the reader tells it what was settled, stored and read.

use std::collections::HashSet;

use crate::{at_or_after, BinlogPosition};

/// Which event a row read from the log is, the same in every session that reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RowIdentity {
    /// The outbox row's id ([`RowIdentity::row_key`]; none in the BLACKHOLE form).
    pub(crate) row: Option<u64>,
    pub(crate) event_id: Option<uuid::Uuid>,
}

impl RowIdentity {
    /// The identity of a row with an id or an event id; `None` for one with neither (an
    /// undecodable BLACKHOLE row), which is handed out again if read again.
    pub(crate) fn of(row: Option<u64>, event_id: Option<uuid::Uuid>) -> Option<RowIdentity> {
        (row.is_some() || event_id.is_some()).then_some(RowIdentity { row, event_id })
    }

    /// A row id as the log writes it (an integer, a UUID's text), as a key: a hash of its
    /// text, the same in every session (SipHash with the standard library's fixed keys).
    pub(crate) fn row_key(id: &str) -> u64 {
        use std::hash::{Hash, Hasher};
        #[allow(deprecated)]
        let mut hasher = std::hash::SipHasher::new();
        id.hash(&mut hasher);
        hasher.finish()
    }
}

/// The settled rows a later session may read again.
#[derive(Debug, Default)]
pub(crate) struct SettledUnstored {
    /// Settled rows of the session reading, by ordinal: kept until a stored position is
    /// past them (cut at every store, so about a second's worth).
    reading: Vec<(u64, RowIdentity)>,
    /// Settled rows of ended sessions that the session reading has not read again yet.
    ended: HashSet<RowIdentity>,
    /// Where the last ended session had read to: every row in `ended` lies before it, so a
    /// position stored at or past it lets go of them all.
    ended_read_to: Option<BinlogPosition>,
}

impl SettledUnstored {
    /// At most this many rows of ended sessions are kept: past that, a row read again goes
    /// out again, as at-least-once allows.
    const MOST: usize = 262_144;

    /// Row `ordinal` of the session reading is settled. Past [`Self::MOST`] (a row that
    /// long unsettled holds the stored position back), it goes out again if read again.
    pub(crate) fn settled(&mut self, ordinal: u64, identity: Option<RowIdentity>) {
        if let Some(identity) = identity {
            if self.reading.len() < Self::MOST {
                self.reading.push((ordinal, identity));
            }
        }
    }

    /// A row of an ended session is settled (the engine finished it after the break): the
    /// session reading may read it again, unless a stored position has passed every ended
    /// session's reading.
    pub(crate) fn settled_late(&mut self, identity: Option<RowIdentity>) {
        if let (Some(identity), Some(_)) = (identity, &self.ended_read_to) {
            self.keep_ended(identity);
        }
    }

    /// The session reading stored `stored`, behind which lie its rows below ordinal `below`.
    /// (A position that is not this server's file, kept after a GTID state, cuts nothing.)
    pub(crate) fn stored(&mut self, below: u64, stored: &BinlogPosition) {
        if stored.file.is_empty() {
            return;
        }
        self.reading.retain(|(ordinal, _)| *ordinal >= below);
        if let Some(read_to) = &self.ended_read_to {
            if at_or_after(stored, read_to) {
                self.ended.clear();
                self.ended_read_to = None;
            }
        }
    }

    /// The session reading ended, having read to `read_to`: its settled rows not yet behind
    /// a stored position wait for the next session.
    pub(crate) fn session_ended(&mut self, read_to: BinlogPosition) {
        for (_, identity) in std::mem::take(&mut self.reading) {
            self.keep_ended(identity);
        }
        // The furthest any ended session read: an earlier one may have read further than a
        // later one that broke soon after it began, and its rows are kept till then.
        match &self.ended_read_to {
            Some(further) if !at_or_after(&read_to, further) => {}
            _ => self.ended_read_to = Some(read_to),
        }
    }

    /// Row `ordinal` of the session reading is `identity`: whether an ended session settled
    /// it (then it is settled in this one, unsent).
    pub(crate) fn read_again(&mut self, ordinal: u64, identity: Option<RowIdentity>) -> bool {
        let Some(identity) = identity else {
            return false;
        };
        if self.ended.is_empty() || !self.ended.remove(&identity) {
            return false;
        }
        self.reading.push((ordinal, identity));
        true
    }

    fn keep_ended(&mut self, identity: RowIdentity) {
        if self.ended.len() < Self::MOST {
            self.ended.insert(identity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: u64) -> Option<RowIdentity> {
        RowIdentity::of(Some(id), Some(uuid::Uuid::from_u128(id as u128)))
    }

    fn at(file: u32, offset: u64) -> BinlogPosition {
        BinlogPosition {
            file: format!("bin.{file:06}"),
            offset,
            gtid: None,
        }
    }

    /// Rows 1 and 2 settled, the position stored behind row 1 only, then the session
    /// breaks: the next one reads both again and settles them unsent, once each.
    #[test]
    fn rows_settled_past_the_stored_position_are_settled_unsent_when_read_again() {
        let mut settled = SettledUnstored::default();
        settled.settled(1, row(1));
        settled.settled(2, row(2));
        settled.stored(2, &at(1, 100));
        settled.session_ended(at(1, 300));
        assert!(!settled.read_again(1, row(1)), "behind the stored position");
        assert!(settled.read_again(1, row(2)));
        assert!(!settled.read_again(2, row(3)), "never settled");
        assert!(!settled.read_again(3, row(2)), "once");
    }

    /// Read again and settled unsent, a row is settled in the new session too: a second
    /// break before a store still knows it.
    #[test]
    fn a_row_read_again_survives_a_second_break() {
        let mut settled = SettledUnstored::default();
        settled.settled(5, row(1));
        settled.session_ended(at(1, 300));
        assert!(settled.read_again(1, row(1)));
        settled.session_ended(at(1, 200));
        assert!(settled.read_again(1, row(1)));
    }

    /// A row of an ended session that the engine settles after the break is settled
    /// unsent when the next session reaches it.
    #[test]
    fn a_settle_arriving_after_the_break_counts() {
        let mut settled = SettledUnstored::default();
        settled.session_ended(at(1, 300));
        settled.settled_late(row(7));
        assert!(settled.read_again(4, row(7)));
    }

    /// An event id alone does not make two rows one: a table whose counter was reset
    /// reuses row ids, and a writer may reuse event ids.
    #[test]
    fn rows_are_known_by_row_id_and_event_id_together() {
        let mut settled = SettledUnstored::default();
        let id = uuid::Uuid::from_u128(9);
        settled.settled(1, RowIdentity::of(Some(1), Some(id)));
        settled.session_ended(at(1, 300));
        assert!(!settled.read_again(1, RowIdentity::of(Some(2), Some(id))));
        assert!(!settled.read_again(1, RowIdentity::of(Some(1), None)));
        assert!(settled.read_again(1, RowIdentity::of(Some(1), Some(id))));
        assert_eq!(RowIdentity::of(None, None), None);
    }

    /// A session that broke soon after it began read less far than the one before it: the
    /// earlier one's rows are kept until a store passes where it read to.
    #[test]
    fn ended_sessions_rows_are_kept_until_a_store_passes_the_furthest_reading() {
        let mut settled = SettledUnstored::default();
        settled.settled(9, row(9));
        settled.session_ended(at(1, 1000));
        settled.session_ended(at(1, 300));
        settled.stored(1, &at(1, 350));
        assert!(settled.read_again(1, row(9)), "read to 1000, stored 350");
    }

    /// A settle of an ended session after a store passed every ended reading is of a row no
    /// session reads again: nothing is kept for it.
    #[test]
    fn a_late_settle_after_the_ended_readings_are_passed_keeps_nothing() {
        let mut settled = SettledUnstored::default();
        settled.session_ended(at(1, 300));
        settled.stored(1, &at(1, 400));
        settled.settled_late(row(4));
        assert!(settled.ended.is_empty());
    }

    /// Once the session reading stores a position at or past where the ended sessions
    /// had read, none of their rows comes again: they are let go of.
    #[test]
    fn a_store_past_the_ended_sessions_reading_lets_go_of_their_rows() {
        let mut settled = SettledUnstored::default();
        settled.settled(1, row(1));
        settled.settled(2, row(2));
        settled.session_ended(at(1, 300));
        settled.stored(1, &at(1, 200));
        assert_eq!(settled.ended.len(), 2, "not past 300");
        settled.stored(1, &at(2, 4));
        assert!(settled.ended.is_empty(), "a later log");
        assert!(!settled.read_again(9, row(2)));
    }

    /// A store cuts the session's own settled rows behind it, whatever order they
    /// settled in.
    #[test]
    fn a_store_cuts_the_sessions_rows_behind_it_only() {
        let mut settled = SettledUnstored::default();
        settled.settled(3, row(3));
        settled.settled(1, row(1));
        settled.settled(2, row(2));
        settled.stored(3, &at(1, 100));
        assert_eq!(settled.reading, [(3, row(3).unwrap())]);
    }
}
