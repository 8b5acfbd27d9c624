//! Which binary log position may be stored, given which rows are settled. The server keeps
//! no slot for a binlog reader: the relay stores its own position, and the rule is the WAL
//! slot's. The position moves to the end of the longest run of transactions, from the
//! oldest, whose every row is settled (delivered, parked or dead-lettered). It never moves
//! past an unsettled row, whatever order the rows settle in. A crash then means reading
//! again from the stored position: redelivery, never loss. Pure state: the reader tells it
//! what the stream carried, the store what it settled.

use std::collections::{HashSet, VecDeque};

use crate::BinlogPosition;
#[cfg(doc)]
use crate::Output;

/// A transaction read: its rows not settled yet, and where the log goes on after it (once
/// its commit was read).
#[derive(Debug, Default)]
struct Transaction {
    unsettled: HashSet<u64>,
    next: Option<BinlogPosition>,
    /// Its first row's id.
    first: Option<u64>,
    /// Rows read of it so far.
    read: u64,
}

/// How far the oldest transaction not behind the storable position got
/// ([`Positions::front`]): it changes whenever the transaction moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Front {
    /// Its first row's id (`None`: none read yet).
    pub first: Option<u64>,
    pub read: u64,
    pub unsettled: usize,
    /// Its commit was read.
    pub committed: bool,
}

/// The positions of what was read, and the one that may be stored.
#[derive(Debug)]
pub struct Positions {
    /// Transactions not yet behind the storable position, oldest first; the last one is
    /// still being read while its `next` is `None`.
    open: VecDeque<Transaction>,
    storable: BinlogPosition,
    /// One past the last row id read.
    next_row: u64,
}

/// A row was settled that was never read, or twice: a bug in the caller.
#[derive(Debug, thiserror::Error)]
#[error("row {0} settled but not held (settled twice, or never read)")]
pub struct UnknownRow(pub u64);

impl Positions {
    /// Reading starts at `start`, which may be stored as it is.
    pub fn new(start: BinlogPosition) -> Self {
        Positions {
            open: VecDeque::new(),
            storable: start,
            next_row: 0,
        }
    }

    /// The stream carried row `id` (its `sequence_id`) of the transaction being read.
    pub fn row(&mut self, id: u64) {
        if self.open.back().is_none_or(|t| t.next.is_some()) {
            self.open.push_back(Transaction::default());
        }
        if let Some(current) = self.open.back_mut() {
            current.unsettled.insert(id);
            current.first.get_or_insert(id);
            current.read += 1;
        }
        self.next_row = self.next_row.max(id + 1);
    }

    /// The stream carried the commit of the transaction being read ([`Output::Committed`]):
    /// the log goes on at `next`.
    pub fn committed(&mut self, next: &BinlogPosition) {
        match self.open.back_mut() {
            Some(current) if current.next.is_none() => current.next = Some(next.clone()),
            // A commit with no row read: nothing to wait for.
            _ => self.open.push_back(Transaction {
                next: Some(next.clone()),
                ..Transaction::default()
            }),
        }
        self.advance();
    }

    /// The stream carried the rollback of the transaction being read
    /// ([`Output::RolledBack`]): its rows never happened, and the log goes on at `next`.
    pub fn rolled_back(&mut self, next: &BinlogPosition) {
        if let Some(current) = self.open.back_mut().filter(|t| t.next.is_none()) {
            current.unsettled.clear();
        }
        self.committed(next);
    }

    /// The row `id` is settled.
    pub fn settle(&mut self, id: u64) -> Result<(), UnknownRow> {
        let transaction = self
            .open
            .iter_mut()
            .find(|t| t.unsettled.contains(&id))
            .ok_or(UnknownRow(id))?;
        transaction.unsettled.remove(&id);
        self.advance();
        Ok(())
    }

    /// The reader has read, past every transaction above, to the end of another table's
    /// transaction at `boundary`: with nothing of the outbox open, the position may move
    /// there (a quiet outbox on a busy server would otherwise keep an old position, which the
    /// server purges in time, and read a long stretch again at every start).
    pub fn passed(&mut self, boundary: &BinlogPosition) {
        if self.open.is_empty() && crate::at_or_after(boundary, &self.storable) {
            self.storable = boundary.clone();
        }
    }

    /// The oldest transaction not behind the storable position, as far as it got: what a
    /// stall watch looks at (`outbox_core::capture::SettleWatch`). `None` when nothing is
    /// open.
    pub fn front(&self) -> Option<Front> {
        self.open.front().map(|t| Front {
            first: t.first,
            read: t.read,
            unsettled: t.unsettled.len(),
            committed: t.next.is_some(),
        })
    }

    /// Where a new reader may start without losing an unsettled row.
    pub fn storable(&self) -> &BinlogPosition {
        &self.storable
    }

    /// The rows (by id, counting up as read) below this one are behind
    /// [`storable`](Self::storable): a reader started there reads none of them.
    pub fn behind_storable(&self) -> u64 {
        self.open
            .iter()
            .find_map(|t| t.first)
            .unwrap_or(self.next_row)
    }

    /// Moves past every settled, committed transaction at the front.
    fn advance(&mut self) {
        while let Some(front) = self.open.front() {
            match &front.next {
                Some(next) if front.unsettled.is_empty() => {
                    self.storable = next.clone();
                    self.open.pop_front();
                }
                _ => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(offset: u64) -> BinlogPosition {
        BinlogPosition {
            file: "bin.000001".into(),
            offset,
            gtid: None,
        }
    }

    /// Rows 1 and 2 in the transaction ending at 200, row 3 in the one ending at 300.
    fn two_transactions() -> Positions {
        let mut positions = Positions::new(at(4));
        positions.row(1);
        positions.row(2);
        positions.committed(&at(200));
        positions.row(3);
        positions.committed(&at(300));
        positions
    }

    /// The front is the oldest transaction not passed, and it changes as it moves: a stall
    /// watch sees any row read or settled.
    #[test]
    fn the_front_is_the_oldest_transaction_not_passed_and_moves_with_it() {
        let mut positions = Positions::new(at(4));
        assert_eq!(positions.front(), None);
        positions.row(1);
        let front = |read, unsettled, committed| {
            Some(Front {
                first: Some(1),
                read,
                unsettled,
                committed,
            })
        };
        assert_eq!(positions.front(), front(1, 1, false));
        positions.row(2);
        positions.settle(1).unwrap();
        assert_eq!(positions.front(), front(2, 1, false));
        positions.committed(&at(200));
        assert_eq!(positions.front(), front(2, 1, true));
        positions.row(3);
        positions.settle(2).unwrap();
        assert_eq!(positions.front().and_then(|f| f.first), Some(3));
    }

    #[test]
    fn the_position_never_passes_an_unsettled_row_whatever_order_rows_settle_in() {
        let mut positions = two_transactions();
        positions.settle(3).unwrap();
        positions.settle(1).unwrap();
        assert_eq!(
            positions.storable(),
            &at(4),
            "row 2 holds both transactions back"
        );
        positions.settle(2).unwrap();
        assert_eq!(positions.storable(), &at(300), "everything read is settled");
    }

    #[test]
    fn the_rows_behind_the_storable_position_are_those_of_the_transactions_passed() {
        let mut positions = two_transactions();
        assert_eq!(positions.behind_storable(), 1, "none passed");
        positions.settle(1).unwrap();
        positions.settle(2).unwrap();
        assert_eq!(
            positions.behind_storable(),
            3,
            "the first transaction passed"
        );
        positions.settle(3).unwrap();
        assert_eq!(positions.behind_storable(), 4, "everything read");
        positions.row(4);
        assert_eq!(
            positions.behind_storable(),
            4,
            "row 4's transaction is open"
        );
    }

    #[test]
    fn a_rolled_back_transactions_rows_hold_nothing_back() {
        let mut positions = Positions::new(at(4));
        positions.row(1);
        positions.committed(&at(100));
        positions.row(2);
        positions.rolled_back(&at(200));
        assert_eq!(positions.storable(), &at(4), "row 1 is not settled");
        assert!(positions.settle(2).is_err(), "row 2 never happened");
        positions.settle(1).unwrap();
        assert_eq!(positions.storable(), &at(200));
    }

    #[test]
    fn a_transaction_still_being_read_holds_its_position_back() {
        let mut positions = Positions::new(at(4));
        positions.row(1);
        positions.settle(1).unwrap();
        assert_eq!(positions.storable(), &at(4), "its commit is not read yet");
        positions.committed(&at(150));
        assert_eq!(positions.storable(), &at(150));
    }

    #[test]
    fn other_tables_transactions_move_the_position_only_while_nothing_is_open() {
        let mut positions = Positions::new(at(4));
        positions.passed(&at(50));
        assert_eq!(positions.storable(), &at(50), "nothing of the outbox read");
        positions.row(1);
        positions.passed(&at(80));
        assert_eq!(positions.storable(), &at(50), "row 1's transaction is open");
        positions.committed(&at(100));
        positions.passed(&at(120));
        assert_eq!(positions.storable(), &at(50), "row 1 is unsettled");
        positions.settle(1).unwrap();
        assert_eq!(positions.storable(), &at(100));
        positions.passed(&at(120));
        assert_eq!(positions.storable(), &at(120));
        positions.passed(&at(90));
        assert_eq!(positions.storable(), &at(120), "never back");
    }

    #[test]
    fn a_settle_of_a_row_not_held_is_refused_and_moves_nothing() {
        let mut positions = two_transactions();
        assert!(positions.settle(9).is_err());
        positions.settle(1).unwrap();
        assert!(positions.settle(1).is_err(), "settled twice");
        assert_eq!(positions.storable(), &at(4));
    }

    #[test]
    fn the_stored_position_follows_a_rotated_log() {
        let mut positions = Positions::new(at(4));
        positions.row(1);
        let rotated = BinlogPosition {
            file: "bin.000002".into(),
            offset: 380,
            gtid: None,
        };
        positions.committed(&rotated);
        positions.settle(1).unwrap();
        assert_eq!(positions.storable(), &rotated);
    }
}
