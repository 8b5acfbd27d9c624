//! Which WAL position may be confirmed to the slot.
//!
//! The slot's confirmed position is a promise to the server: "everything committed before
//! this is done; never send it again". So it may pass a transaction only once every event
//! of that transaction is *settled*: confirmed by the sink, or durably recorded as retrying
//! or dead by the caller. And it may pass it only at the transaction's `end_lsn` (a slot
//! confirmed at the commit record itself sends the transaction again).
//!
//! [`Acknowledgements`] keeps one small record per transaction in flight (a count of handed
//! out events and a bit per settled one, not the events), in commit order. Events settle in
//! any order, each once: a second settle of one position is refused, so that a caller's slip
//! cannot count it for a sibling never settled and confirm past that one;
//! the confirmable position is the `end_lsn` of the last transaction of the settled prefix,
//! or a later idle keepalive position when nothing after it is in flight. The caller hands
//! [`Acknowledgements::confirmable`] to [`crate::WalStream::confirm`]; nothing is confirmed
//! on its own.
//!
//! A transaction is confirmed whole: after a crash, a transaction that was partly delivered
//! is sent again, whole, and its delivered events are duplicates with the same event ids
//! (and the same [`EventPosition`]s, which lets a caller that remembers positions skip them).
//!
//! One `Acknowledgements` serves one replication session: a new session starts again from
//! the slot's confirmed position, and settles of the old session's events are refused.

use std::collections::VecDeque;

use crate::assemble::Output;
use crate::event::EventPosition;
use crate::lsn::Lsn;

/// A settle that does not match what was handed out: a caller bug, or an event of an
/// earlier session.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AckError {
    #[error("no transaction at {0} is in flight in this session")]
    UnknownTransaction(Lsn),
    #[error(
        "the transaction at {commit_lsn} had {handed_out} events handed out; its event \
         {ordinal} was settled, which is not one of them"
    )]
    NotHandedOut {
        commit_lsn: Lsn,
        ordinal: u64,
        handed_out: u64,
    },
    #[error("the event {ordinal} of the transaction at {commit_lsn} was settled twice")]
    SettledTwice { commit_lsn: Lsn, ordinal: u64 },
}

/// Which events of one transaction are settled, by ordinal (handed out densely from 0): a
/// word inline for the first 64, the common case, and more words only past them.
#[derive(Debug, Default)]
struct SettledOrdinals {
    first: u64,
    more: Vec<u64>,
}

impl SettledOrdinals {
    /// Marks `ordinal` settled; false when it already was.
    fn insert(&mut self, ordinal: u64) -> bool {
        let bit = 1u64 << (ordinal % 64);
        let word = match ordinal / 64 {
            0 => &mut self.first,
            n => {
                let i = usize::try_from(n - 1).unwrap_or(usize::MAX);
                if self.more.len() <= i {
                    self.more.resize(i + 1, 0);
                }
                &mut self.more[i]
            }
        };
        let fresh = *word & bit == 0;
        *word |= bit;
        fresh
    }
}

#[derive(Debug)]
struct InFlight {
    commit_lsn: Lsn,
    /// Set by the Commit.
    end_lsn: Option<Lsn>,
    handed_out: u64,
    settled: u64,
    settled_ordinals: SettledOrdinals,
    /// An idle keepalive position seen after this transaction's commit, before the next.
    idle_after: Option<Lsn>,
}

impl InFlight {
    fn done(&self) -> bool {
        self.end_lsn.is_some() && self.settled == self.handed_out
    }
}

/// How far the oldest transaction not passed yet got ([`Acknowledgements::front`]): it
/// changes whenever the transaction moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Front {
    pub commit_lsn: Lsn,
    /// Its Commit was read.
    pub committed: bool,
    pub handed_out: u64,
    pub settled: u64,
}

/// The settled prefix of one replication session's stream.
#[derive(Debug)]
pub struct Acknowledgements {
    confirmable: Lsn,
    in_flight: VecDeque<InFlight>,
}

impl Acknowledgements {
    /// `start`: the slot's confirmed position when the session began.
    pub fn new(start: Lsn) -> Self {
        Acknowledgements {
            confirmable: start,
            in_flight: VecDeque::new(),
        }
    }

    /// Records what the assembler handed out; call it for every [`Output`], in order.
    pub fn observe(&mut self, output: &Output) {
        match output {
            Output::Event { position, .. } => self.transaction(position.commit_lsn).handed_out += 1,
            Output::Committed {
                commit_lsn,
                end_lsn,
                ..
            } => self.transaction(*commit_lsn).end_lsn = Some(*end_lsn),
            Output::Idle { wal_end } => match self.in_flight.back_mut() {
                Some(last) => {
                    last.idle_after = Some(last.idle_after.unwrap_or_default().max(*wal_end))
                }
                None => self.confirmable = self.confirmable.max(*wal_end),
            },
            Output::Skipped { .. } => {}
        }
    }

    /// One event is settled: the sink confirmed it, or it is durably recorded as retrying
    /// or dead.
    pub fn settle(&mut self, position: EventPosition) -> Result<(), AckError> {
        let i = self
            .in_flight
            .binary_search_by_key(&position.commit_lsn, |t| t.commit_lsn)
            .map_err(|_| AckError::UnknownTransaction(position.commit_lsn))?;
        let transaction = &mut self.in_flight[i];
        if position.ordinal >= transaction.handed_out {
            return Err(AckError::NotHandedOut {
                commit_lsn: transaction.commit_lsn,
                ordinal: position.ordinal,
                handed_out: transaction.handed_out,
            });
        }
        if !transaction.settled_ordinals.insert(position.ordinal) {
            return Err(AckError::SettledTwice {
                commit_lsn: transaction.commit_lsn,
                ordinal: position.ordinal,
            });
        }
        transaction.settled += 1;
        Ok(())
    }

    /// The highest position that may be confirmed now. Monotonic.
    pub fn confirmable(&mut self) -> Lsn {
        while self.in_flight.front().is_some_and(InFlight::done) {
            if let Some(done) = self.in_flight.pop_front() {
                let end = done.end_lsn.unwrap_or_default();
                self.confirmable = self
                    .confirmable
                    .max(end)
                    .max(done.idle_after.unwrap_or_default());
            }
        }
        self.confirmable
    }

    /// The oldest transaction not passed yet, as far as it got: what a stall watch looks at
    /// (`outbox_core::capture::SettleWatch`). `None` when every transaction is done.
    pub fn front(&self) -> Option<Front> {
        (self.in_flight.iter().find(|t| !t.done())).map(|t| Front {
            commit_lsn: t.commit_lsn,
            committed: t.end_lsn.is_some(),
            handed_out: t.handed_out,
            settled: t.settled,
        })
    }

    /// Transactions with events handed out and not all settled, or not yet committed.
    pub fn transactions_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// The record of the transaction at `commit_lsn`: the last one, or a new one after it
    /// (transactions arrive in commit order).
    fn transaction(&mut self, commit_lsn: Lsn) -> &mut InFlight {
        if self
            .in_flight
            .back()
            .is_none_or(|t| t.commit_lsn != commit_lsn)
        {
            self.in_flight.push_back(InFlight {
                commit_lsn,
                end_lsn: None,
                handed_out: 0,
                settled: 0,
                settled_ordinals: SettledOrdinals::default(),
                idle_after: None,
            });
        }
        let last = self.in_flight.len() - 1;
        &mut self.in_flight[last]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::SystemTime;

    fn event(commit: u64, ordinal: u64) -> (Output, EventPosition) {
        let position = EventPosition {
            commit_lsn: Lsn(commit),
            ordinal,
            xid: 0,
        };
        (
            Output::Event {
                position,
                event: Err(Box::new(crate::event::Undecodable {
                    reason: String::new(),
                    source: crate::event::EventSource::Table { sequence_id: None },
                    event_id: None,
                    destination: None,
                    partition_key: None,
                    raw: String::new(),
                })),
            },
            position,
        )
    }

    fn committed(commit: u64, end: u64, events: u64) -> Output {
        Output::Committed {
            commit_lsn: Lsn(commit),
            end_lsn: Lsn(end),
            events,
            commit_time: SystemTime::UNIX_EPOCH,
        }
    }

    /// The front is the oldest transaction not done, and it changes as it moves: a stall
    /// watch sees any event read or settled.
    #[test]
    fn the_front_is_the_oldest_transaction_not_done_and_moves_with_it() {
        let mut acks = Acknowledgements::new(Lsn(0));
        assert_eq!(acks.front(), None);
        let (first, first_at) = event(100, 0);
        acks.observe(&first);
        let front = |settled, committed| {
            Some(Front {
                commit_lsn: Lsn(100),
                committed,
                handed_out: 1,
                settled,
            })
        };
        assert_eq!(acks.front(), front(0, false));
        acks.observe(&committed(100, 110, 1));
        assert_eq!(acks.front(), front(0, true));
        let (second, _) = event(200, 0);
        acks.observe(&second);
        acks.settle(first_at).unwrap();
        assert_eq!(
            acks.front().map(|f| f.commit_lsn),
            Some(Lsn(200)),
            "a done transaction is no front, popped or not"
        );
    }

    #[test]
    fn confirms_the_settled_prefix_at_end_lsns() {
        let mut acks = Acknowledgements::new(Lsn(10));
        let (a0, p_a0) = event(100, 0);
        let (a1, p_a1) = event(100, 1);
        let (b0, p_b0) = event(200, 0);
        for output in [&a0, &a1, &committed(100, 110, 2), &b0] {
            acks.observe(output);
        }
        assert_eq!(acks.confirmable(), Lsn(10));
        // B settles first: A still holds the position.
        acks.settle(p_b0).unwrap();
        acks.settle(p_a1).unwrap();
        assert_eq!(acks.confirmable(), Lsn(10));
        acks.settle(p_a0).unwrap();
        assert_eq!(acks.confirmable(), Lsn(110));
        // B is settled but not committed yet: its events could still be coming.
        assert_eq!(acks.transactions_in_flight(), 1);
        acks.observe(&committed(200, 210, 1));
        assert_eq!(acks.confirmable(), Lsn(210));
        assert_eq!(acks.transactions_in_flight(), 0);
        assert_eq!(
            acks.settle(p_a0),
            Err(AckError::UnknownTransaction(Lsn(100)))
        );
    }

    #[test]
    fn idle_positions_count_once_everything_before_them_is_settled() {
        let mut acks = Acknowledgements::new(Lsn(10));
        acks.observe(&Output::Idle { wal_end: Lsn(50) });
        assert_eq!(acks.confirmable(), Lsn(50));
        let (a0, p_a0) = event(100, 0);
        acks.observe(&a0);
        acks.observe(&committed(100, 110, 1));
        acks.observe(&Output::Idle { wal_end: Lsn(500) });
        assert_eq!(acks.confirmable(), Lsn(50));
        acks.settle(p_a0).unwrap();
        assert_eq!(acks.confirmable(), Lsn(500));
        // A transaction without events confirms at once.
        acks.observe(&committed(600, 620, 0));
        assert_eq!(acks.confirmable(), Lsn(620));
    }

    #[test]
    fn settling_an_event_not_handed_out_is_refused() {
        let mut acks = Acknowledgements::new(Lsn::ZERO);
        let (a0, _) = event(100, 0);
        acks.observe(&a0);
        let (_, p_a1) = event(100, 1);
        assert_eq!(
            acks.settle(p_a1),
            Err(AckError::NotHandedOut {
                commit_lsn: Lsn(100),
                ordinal: 1,
                handed_out: 1
            })
        );
    }

    /// A second settle of one event does not stand in for its sibling: counted, it made the
    /// transaction done and confirmed the slot past an event nothing had delivered.
    #[test]
    fn an_event_settled_twice_does_not_settle_its_sibling() {
        let mut acks = Acknowledgements::new(Lsn(10));
        let (a0, p_a0) = event(100, 0);
        let (a1, p_a1) = event(100, 1);
        for output in [&a0, &a1, &committed(100, 110, 2)] {
            acks.observe(output);
        }
        acks.settle(p_a0).unwrap();
        assert_eq!(
            acks.settle(p_a0),
            Err(AckError::SettledTwice {
                commit_lsn: Lsn(100),
                ordinal: 0
            })
        );
        assert_eq!(
            acks.confirmable(),
            Lsn(10),
            "confirmed past an unsettled event"
        );
        acks.settle(p_a1).unwrap();
        assert_eq!(acks.confirmable(), Lsn(110));
    }

    /// Past the inline word: a large transaction's events settle in any order, each once.
    #[test]
    fn a_large_transactions_events_settle_each_once_in_any_order() {
        let mut acks = Acknowledgements::new(Lsn(10));
        let positions: Vec<EventPosition> = (0..200)
            .map(|ordinal| {
                let (output, position) = event(100, ordinal);
                acks.observe(&output);
                position
            })
            .collect();
        acks.observe(&committed(100, 110, 200));
        for position in positions.iter().rev() {
            acks.settle(*position).unwrap();
            assert!(acks.settle(*position).is_err());
        }
        assert_eq!(acks.confirmable(), Lsn(110));
    }
}
