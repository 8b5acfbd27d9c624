//! What binlog capture knows between awaits, and the rules that move it: rows handed out
//! and held until settled, the keys with parked rows, the parks to write, and the rows
//! whose settling the reader is told of (it stores the position they allow). No I/O here:
//! the store runs the statements and then tells the state what they did.
//!
//! What is held and parked, and the parks' order, follow the rules WAL capture shares
//! (`outbox_core::capture`), over the binary log's places: a row's place is its session and
//! its ordinal in that session's reading.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use outbox_core::capture::{self, Followed, Holdings, Sessions};
use outbox_core::memory::Charge;
use outbox_core::{Claimed, Event, SequenceId};

use super::event::{Captured, Undecodable};
use crate::reread::RowIdentity;

/// What the reader hands to claims, in log order.
pub(super) enum Item {
    /// The reader took the seat at `epoch` and reads as session `session`; `parked_keys`
    /// have rows in the parked table (loaded before any row of the session is handed out).
    Session {
        session: u64,
        epoch: i64,
        parked_keys: Vec<String>,
        /// Rows the session's start adopted as dead letters, which the run counts.
        adopted_dead: u64,
        /// The session's rows are handed out at their transaction's commit
        /// ([`State::hold_to_commit`]).
        hold_to_commit: bool,
    },
    /// A row inserted by the transaction being read, the `ordinal`th of the session.
    Row {
        ordinal: u64,
        captured: Box<Captured>,
        memory: Charge,
    },
    /// The transaction being read committed.
    Committed,
    /// The transaction being read was rolled back: its rows never happened (a BLACKHOLE
    /// outbox on MySQL).
    RolledBack,
    /// The transaction being read holds more rows than the memory budget: those held go
    /// out now, and the rest as they are read.
    Overflowed,
    /// `--drain`: the log is read up to the position current at start-up.
    Drained,
}

pub(super) use outbox_core::capture::LiveSession;

pub(super) type Body = outbox_core::capture::Body<Undecodable>;
pub(super) type Held = outbox_core::capture::Held<Streamed>;

/// A row read from the log and handed out.
pub(super) struct Streamed {
    pub(super) session: u64,
    pub(super) ordinal: u64,
    /// Its place in log order: the session and ordinal of its first reading while held. A
    /// row read again by a later session keeps it: places of two sessions compare by
    /// session, and a later row of its key that the earlier session read, still held,
    /// keeps that session's place.
    place: (u64, u64),
    /// The outbox row to delete once settled (table form).
    pub(super) row: Option<i64>,
    /// Which event it is, for a session that reads it again after a break.
    pub(super) identity: Option<RowIdentity>,
    pub(super) key: String,
    pub(super) body: Body,
    pub(super) _memory: Charge,
}

/// A held stream row to write to the parked table, and how.
#[derive(Debug)]
pub(super) struct Park {
    pub(super) id: SequenceId,
    pub(super) attempts: u32,
    pub(super) error: Option<String>,
    pub(super) delay: Duration,
    pub(super) not_before: Option<SystemTime>,
    /// Written as a dead letter: the engine gave it up, or it is undecodable behind a
    /// waiting key.
    pub(super) dead: bool,
    /// Dead-lettered by the capture itself (an undecodable row), which the engine never
    /// counted: once written, it counts in `State::dead_by_capture`.
    pub(super) dead_by_capture: bool,
}

impl Park {
    /// A row that waits for its key, with nothing against it.
    pub(super) fn behind_its_key(id: SequenceId) -> Self {
        Park {
            id,
            attempts: 0,
            error: None,
            delay: Duration::ZERO,
            not_before: None,
            dead: false,
            dead_by_capture: false,
        }
    }
}

/// A settled stream row: the session that handed it out, its ordinal there, and which event
/// it is.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct SettledRow {
    pub(super) session: u64,
    pub(super) ordinal: u64,
    pub(super) identity: Option<RowIdentity>,
}

/// Where the engine's ids of parked rows start: far above any outbox row's `sequence_id` and
/// any BLACKHOLE row's [`stream_id`], so they never meet, and rising with the parked table's
/// ids (the engine's lanes compare ids of one key).
const PARKED_IDS: SequenceId = 1 << 60;

/// The engine's id of a parked row (`sequence_id` in the parked table).
pub(super) fn parked_id(parked_sequence_id: SequenceId) -> SequenceId {
    PARKED_IDS + parked_sequence_id
}

/// The parked table's `sequence_id` of a parked row's engine id.
pub(super) fn parked_row(id: SequenceId) -> SequenceId {
    id - PARKED_IDS
}

/// The parked table's `sequence_id`s of the parked rows among the engine's ids `ids`.
pub(super) fn parked_rows_among(ids: &[SequenceId]) -> Vec<SequenceId> {
    ids.iter()
        .filter(|&&id| id >= PARKED_IDS)
        .map(|&id| parked_row(id))
        .collect()
}

/// The id of a stream row with no `sequence_id` (BLACKHOLE): its session and ordinal. The
/// session counts up with every start of a read (a refusal retried each second starts
/// 86,400 a day), so it wraps below 2^19 (six days of those): past 2^20 the ids reached the
/// parked rows' (`PARKED_IDS`), and one held entry could take another's place. A row of
/// 2^19 sessions ago is no longer held.
pub(super) fn stream_id(session: u64, ordinal: u64) -> SequenceId {
    const SESSIONS: u64 = 1 << 19;
    (((session % SESSIONS) << 40) | (ordinal & ((1 << 40) - 1))) as SequenceId
}

impl capture::StreamEvent for Streamed {
    type Place = (u64, u64);

    fn key(&self) -> &str {
        &self.key
    }

    fn place(&self) -> (u64, u64) {
        self.place
    }

    fn written_at(&self) -> Option<SystemTime> {
        self.body.written_at()
    }

    fn session(&self) -> u64 {
        self.session
    }
}

impl capture::QueuedPark for Park {
    fn id(&self) -> SequenceId {
        self.id
    }

    /// The later error, the longer of the waits and attempt counts, and a dead letter if
    /// either is one.
    fn absorb(&mut self, later: Self) {
        self.attempts = self.attempts.max(later.attempts);
        self.error = later.error.or(self.error.take());
        self.delay = self.delay.max(later.delay);
        self.not_before = self.not_before.max(later.not_before);
        self.dead |= later.dead;
        self.dead_by_capture &= later.dead_by_capture || !later.dead;
    }
}

pub(super) struct State {
    /// The session followed ([`State::end_session`] ends it).
    pub(super) followed: Followed,
    /// The seat's epoch of the session: parked-table writes are fenced on it.
    pub(super) epoch: i64,
    /// Rows are handed out only once their transaction's commit is read: a BLACKHOLE table
    /// on MySQL, whose rolled-back rows reach the log too. MariaDB never logs them (a BLACKHOLE
    /// row rolled back is left out of the log), so there rows are handed out as read, and the
    /// memory budget bounds a large transaction as it does the table form's. Set by each
    /// session.
    pub(super) hold_to_commit: bool,
    /// The transaction being read, while `hold_to_commit`.
    pub(super) uncommitted: Vec<(u64, Box<Captured>, Charge)>,
    /// The transaction being read overflowed the memory budget: its rows are handed out as
    /// read ([`Item::Overflowed`]).
    pub(super) overflowed: bool,
    /// Items received from the reader, not yet taken by a claim (a claim stops at its
    /// limit).
    pub(super) unaccepted: VecDeque<Item>,
    /// Rows held, parked keys and the parks to write (the rules both captures share).
    pub(super) holdings: Holdings<Streamed, Park>,
    /// Settled stream rows, for the reader: it stores the position those of its session
    /// allow, and settles unsent those of ended sessions that it reads again.
    pub(super) settled: Vec<SettledRow>,
    /// Rows settled while the reader read a later session than theirs (after a break), by
    /// the session it read then: it settles unsent what it reads of them once it is told,
    /// but a copy that session read before that waits for a claim, and is settled unsent
    /// then. (Handed out, it went out after later rows of its key still with the engine.)
    /// A later session is told before it reads: its announcement lets them go. Few: the
    /// rows in flight at a break; at most [`State::SETTLED_EARLIER_MOST`].
    settled_earlier: HashMap<RowIdentity, u64>,
    /// The places of held rows let go of unsettled (their parks fenced out, or queued when
    /// their session ended), until a session reads them again: a later row of their key
    /// still held keeps its first reading's place, and the copy read again, taking a new
    /// one, was parked after it. At most [`State::SETTLED_EARLIER_MOST`].
    forgotten_places: HashMap<RowIdentity, (u64, u64)>,
    /// The ids of held rows that drew one of their own (their row id a held row of another
    /// event had), by identity: read again, such a row keeps it.
    own_ids: HashMap<RowIdentity, SequenceId>,
    /// The session the reader reads now (0 between sessions), which it sets before it
    /// announces one: claims learn of a new session only when they take its announcement.
    reading: Arc<LiveSession>,
    /// `--drain`: every row committed before start-up has been handed out.
    drained: bool,
    /// Undecodable rows the capture parked dead itself (behind a parked key, or let go of
    /// by the engine), written: the engine never counted them, and a drain adds them to its
    /// dead letters.
    pub(super) dead_by_capture: u64,
}

impl State {
    /// Past this many rows settled across a break, they are forgotten: a copy read again
    /// then goes out again, as at-least-once allows.
    const SETTLED_EARLIER_MOST: usize = 65_536;

    pub(super) fn new(hold_to_commit: bool) -> State {
        State {
            followed: Followed::before_any_session(),
            epoch: 0,
            hold_to_commit,
            uncommitted: Vec::new(),
            overflowed: false,
            unaccepted: VecDeque::new(),
            holdings: Holdings::default(),
            settled: Vec::new(),
            settled_earlier: HashMap::new(),
            forgotten_places: HashMap::new(),
            own_ids: HashMap::new(),
            reading: Arc::default(),
            drained: false,
            dead_by_capture: 0,
        }
    }

    /// Remembers the places of the held rows `ids`, about to be let go of unsettled
    /// ([`State::forgotten_places`]).
    fn remember_places(&mut self, ids: &[SequenceId]) {
        if self.forgotten_places.len() >= Self::SETTLED_EARLIER_MOST {
            // A copy read again then takes a new place, as before.
            self.forgotten_places.clear();
        }
        for id in ids {
            if let Some(Held::Stream(row)) = self.holdings.held.get(id) {
                if let Some(identity) = row.identity {
                    self.forgotten_places.entry(identity).or_insert(row.place);
                }
            }
        }
    }

    /// The state of a store whose reader reads session `live`.
    pub(super) fn reading(self, live: Arc<LiveSession>) -> State {
        State {
            reading: live,
            ..self
        }
    }

    pub(super) fn drained(&self) -> bool {
        self.drained
    }

    /// Whether the session followed is `live` and may hand out rows
    /// ([`capture::follow`]).
    pub(super) fn follow(&mut self, live: u64, next: impl FnMut() -> Option<Item>) -> bool {
        capture::follow(self, live, next)
    }

    /// Takes received items until `out` holds `limit` rows; returns how many it took.
    pub(super) fn accept_outputs(&mut self, out: &mut Vec<Claimed>, limit: usize) -> usize {
        let mut taken = 0;
        while out.len() < limit && !self.followed.ended {
            let Some(item) = self.unaccepted.pop_front() else {
                break;
            };
            taken += 1;
            match item {
                Item::Row {
                    ordinal,
                    captured,
                    memory,
                } if self.hold_to_commit && !self.overflowed => {
                    self.uncommitted.push((ordinal, captured, memory))
                }
                Item::Row {
                    ordinal,
                    captured,
                    memory,
                } => self.hand_out(ordinal, captured, memory, out),
                Item::Committed | Item::Overflowed => {
                    for (ordinal, captured, memory) in std::mem::take(&mut self.uncommitted) {
                        self.hand_out(ordinal, captured, memory, out);
                    }
                    self.overflowed = matches!(item, Item::Overflowed);
                }
                Item::RolledBack => {
                    self.uncommitted.clear();
                    self.overflowed = false;
                }
                Item::Drained => self.drained = true,
                Item::Session { .. } => {}
            }
        }
        taken
    }

    /// The engine's id of a row read as the session's `ordinal`th: its row id (a BLACKHOLE
    /// row's: one drawn from its place), unless a held row of another event has that id (ids
    /// taken again: `TRUNCATE`, a failover to a server whose counter is behind). Then it
    /// draws one of its own, keeping its row id to delete: sharing it, the engine took this
    /// row for the first one's lease renewed, and the first one's ack settled it unsent.
    /// Read again while held, such a row keeps the id it drew.
    fn engine_id_of(
        &mut self,
        row: Option<SequenceId>,
        identity: Option<RowIdentity>,
        ordinal: u64,
    ) -> SequenceId {
        let id = row.unwrap_or_else(|| stream_id(self.followed.session, ordinal));
        if let Some(identity) = identity.filter(|_| !self.own_ids.is_empty()) {
            if let Some(&own) = self.own_ids.get(&identity) {
                if self.holdings.held.contains_key(&own) {
                    return own;
                }
                // Let go of unsettled (fenced out): drawn again if it must be.
                self.own_ids.remove(&identity);
            }
        }
        let event_of = |identity: Option<RowIdentity>| identity.and_then(|i| i.event_id);
        // A held row that did not decode has no event id: a row read with one is another
        // event (taken for the same, the engine dropped it as a lease renewal, and the held
        // row's dead letter parked it).
        let another = match self.holdings.held.get(&id) {
            Some(Held::Stream(held)) => event_of(held.identity) != event_of(identity),
            _ => false,
        };
        match (another, identity) {
            (true, Some(identity)) => {
                let own = stream_id(self.followed.session, ordinal);
                self.own_ids.insert(identity, own);
                own
            }
            _ => id,
        }
    }

    fn hand_out(
        &mut self,
        ordinal: u64,
        captured: Box<Captured>,
        memory: Charge,
        out: &mut Vec<Claimed>,
    ) {
        let Captured {
            row,
            not_before,
            event,
            identity,
        } = *captured;
        let id = self.engine_id_of(row, identity, ordinal);
        // Settled while the reader read this session or a later one (it may have moved on
        // while this claim held the state): the copy is of a row settled before it.
        let read_by_this_session = |i: &RowIdentity| {
            self.settled_earlier
                .get(i)
                .is_some_and(|read_by| *read_by >= self.followed.session)
        };
        if let Some(identity) = identity.filter(read_by_this_session) {
            if !self.holdings.held.contains_key(&id) {
                self.settled_earlier.remove(&identity);
                self.settled.push(SettledRow {
                    session: self.followed.session,
                    ordinal,
                    identity: Some(identity),
                });
                return;
            }
        }
        let (key, body) = match event {
            Ok(event) => {
                let key = event.ordering_key().to_string();
                let event = Arc::new(Event {
                    sequence_id: id,
                    ..event
                });
                if not_before.is_some() || self.holdings.waits(&key) {
                    let park = Park {
                        not_before,
                        ..Park::behind_its_key(id)
                    };
                    self.holdings.park_behind(&key, park);
                } else {
                    out.push(Claimed::Event(event.clone()));
                }
                (key, Body::Event(event))
            }
            Err(undecodable) => {
                let key = undecodable.ordering_key().to_string();
                if self.holdings.waits(&key) {
                    // Nothing to park that a claim could read back: dead-lettered in the
                    // park's transaction, as the engine would have.
                    self.holdings.to_park.push(Park {
                        error: Some(undecodable.reason.clone()),
                        dead: true,
                        dead_by_capture: true,
                        ..Park::behind_its_key(id)
                    });
                } else {
                    out.push(Claimed::Undecodable {
                        sequence_id: id,
                        ordering_key: key.clone(),
                        destination: undecodable.destination.clone().unwrap_or_default(),
                        attempts: 0,
                        reason: undecodable.reason.clone(),
                    });
                }
                (key, Body::Undecodable(undecodable))
            }
        };
        let forgotten = identity.and_then(|identity| self.forgotten_places.remove(&identity));
        let place = match self.holdings.held.get(&id) {
            Some(Held::Stream(first)) => first.place,
            _ => forgotten.unwrap_or((self.followed.session, ordinal)),
        };
        self.holdings.held.insert(
            id,
            Held::Stream(Box::new(Streamed {
                session: self.followed.session,
                ordinal,
                place,
                row,
                identity,
                key,
                body,
                _memory: memory,
            })),
        );
    }

    /// Settles held stream rows and forgets them, passing each on to the reader.
    pub(super) fn settle(&mut self, ids: impl IntoIterator<Item = SequenceId>) {
        for id in ids {
            if let Some(s) = self.holdings.remove_stream(id) {
                if let Some(identity) = s.identity {
                    if self.own_ids.get(&identity) == Some(&id) {
                        self.own_ids.remove(&identity);
                    }
                }
                let reading = self.reading.get();
                if reading > s.session {
                    if self.settled_earlier.len() >= Self::SETTLED_EARLIER_MOST {
                        self.settled_earlier.clear();
                    }
                    if let Some(identity) = s.identity {
                        self.settled_earlier.insert(identity, reading);
                    }
                }
                self.settled.push(SettledRow {
                    session: s.session,
                    ordinal: s.ordinal,
                    identity: s.identity,
                });
            }
        }
    }

    /// Queues held stream rows for the next park statement (each once). An undecodable row
    /// has nothing a claim could read back: it is parked dead, with its reason, however the
    /// engine let go of it (a release too). Returns how many are queued
    /// ([`Holdings::queue_parks`](outbox_core::capture::Holdings::queue_parks)).
    pub(super) fn queue_parks(&mut self, parks: impl IntoIterator<Item = Park>) -> usize {
        let parks: Vec<Park> = parks
            .into_iter()
            .map(|park| match self.holdings.held.get(&park.id) {
                Some(Held::Stream(s)) => match &s.body {
                    Body::Undecodable(u) => Park {
                        // The engine's own dead letters it has counted already.
                        dead_by_capture: !park.dead,
                        dead: true,
                        error: park.error.or_else(|| Some(u.reason.clone())),
                        ..park
                    },
                    Body::Event(_) => park,
                },
                _ => park,
            })
            .collect();
        self.holdings.queue_parks(parks)
    }

    /// The keys among `keys` with nothing parked left (none `still` in the parked table,
    /// none waiting to be parked) flow from the log again.
    pub(super) fn unpark(&mut self, keys: Vec<String>, still: &HashSet<String>) {
        let free = self.holdings.unpark(keys, still);
        if !free.is_empty() {
            tracing::debug!(keys = ?free, "keys with nothing parked left flow from the log again");
        }
    }

    /// Parks written at the seat's `epoch` failed their fence: another reader holds the
    /// seat. While claims still follow the session of that epoch, it is over
    /// ([`State::leave_to_seat_holder`]). If they follow a newer session of this relay by
    /// now (a claim waiting out a reconnection follows one without `parking`), the parks
    /// were the earlier session's, and the new one reads their rows again: it goes on.
    pub(super) fn fenced_out(&mut self, epoch: i64, ids: impl IntoIterator<Item = SequenceId>) {
        if self.epoch == epoch {
            self.leave_to_seat_holder(ids);
        }
    }

    /// Parks written at `epoch` that failed: queued again, ahead of any queued since, while
    /// claims follow that session; dropped once they follow a newer one, which forgot the
    /// earlier session's queue and reads their rows again.
    pub(super) fn requeue_parks(&mut self, epoch: i64, parks: Vec<Park>) {
        if self.epoch != epoch {
            return;
        }
        self.holdings.requeue_parks(parks);
    }

    /// Forgets stream rows this relay may no longer write for (another relay took the
    /// seat: it reads them again from the stored position), and ends the session.
    pub(super) fn leave_to_seat_holder(&mut self, ids: impl IntoIterator<Item = SequenceId>) {
        let ids: Vec<SequenceId> = ids.into_iter().collect();
        self.remember_places(&ids);
        let ids = self.holdings.leave_to_other_reader(ids);
        tracing::warn!(
            ?ids,
            "another relay has taken over reading the binary log: these rows are left to it \
             (it reads them again), and nothing more of this session is handed out"
        );
        self.end_session();
    }
}

impl capture::Sessions for State {
    type Item = Item;

    fn followed(&self) -> &Followed {
        &self.followed
    }

    /// The session is over: nothing more of it is handed out, and what it left not handed
    /// out (read ahead, queued to park) is dropped, to be read again by whichever session
    /// reads next, this relay's or another's, from the stored position (which it never
    /// passed). Handing it out could put a later row of a key ahead of an earlier one the
    /// next reader delivers.
    fn end_session(&mut self) {
        self.followed.ended = true;
        // What was queued is forgotten with it, and read again by the next session, which
        // reaches the drain's end itself.
        self.drained = false;
        self.unaccepted.clear();
        self.uncommitted.clear();
        self.overflowed = false;
        let queued: Vec<SequenceId> = self.holdings.to_park.iter().map(|p| p.id).collect();
        self.remember_places(&queued);
        self.holdings.forget_queued_parks();
    }

    /// One reader item, in log order.
    fn accept(&mut self, item: Item) {
        match item {
            Item::Session {
                session,
                epoch,
                parked_keys,
                adopted_dead,
                hold_to_commit,
            } => {
                self.dead_by_capture += adopted_dead;
                self.end_session();
                self.hold_to_commit = hold_to_commit;
                self.followed.start(session);
                // Each session reads to the drain's end again, and says so: what an earlier
                // one left unsettled comes again in this one.
                self.drained = false;
                self.epoch = epoch;
                // Settled rows not yet passed on stay: the reader settles those of ended
                // sessions late (what it reads of them again is settled unsent).
                self.settled_earlier
                    .retain(|_, read_by| *read_by >= session);
                self.holdings.load_parked_keys(parked_keys);
            }
            _ if self.followed.ended => {}
            other => self.unaccepted.push_back(other),
        }
    }

    fn announces(item: &Item) -> bool {
        matches!(item, Item::Session { .. })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_core::Payload;

    /// Row `id` of key `key`, the `ordinal`th read.
    fn row(id: i64, key: &str, ordinal: u64) -> Item {
        let event = Event {
            partition_key: Some(key.into()),
            ..Event::new(
                0,
                uuid::Uuid::from_u128(id as u128),
                "orders",
                "T",
                Payload::Null,
            )
        };
        Item::Row {
            ordinal,
            captured: Box::new(Captured {
                row: Some(id),
                not_before: None,
                identity: RowIdentity::of(
                    Some(RowIdentity::row_key(&id.to_string())),
                    Some(event.event_id),
                ),
                event: Ok(event),
            }),
            memory: Charge::none(),
        }
    }

    /// Row `id` of key `key`, the first read, whose payload is not JSON.
    fn undecodable_row(id: i64, key: &str) -> Item {
        Item::Row {
            ordinal: 1,
            captured: Box::new(Captured {
                row: Some(id),
                not_before: None,
                event: Err(Box::new(Undecodable {
                    reason: "payload is not JSON".into(),
                    event_id: None,
                    destination: Some(key.into()),
                    partition_key: None,
                })),
                identity: None,
            }),
            memory: Charge::none(),
        }
    }

    /// The ordinals passed to the reader as settled in `session`.
    fn settled(state: &State, session: u64) -> Vec<u64> {
        state
            .settled
            .iter()
            .filter(|s| s.session == session)
            .map(|s| s.ordinal)
            .collect()
    }

    fn session(n: u64, parked_keys: &[&str]) -> Item {
        Item::Session {
            session: n,
            epoch: n as i64,
            parked_keys: parked_keys.iter().map(|k| k.to_string()).collect(),
            adopted_dead: 0,
            hold_to_commit: false,
        }
    }

    /// One committed transaction per `(id, key)`, ordinals from 1.
    fn transactions(rows: &[(i64, &str)]) -> Vec<Item> {
        rows.iter()
            .enumerate()
            .flat_map(|(i, &(id, key))| [row(id, key, i as u64 + 1), Item::Committed])
            .collect()
    }

    /// What a claim hands out of `items`, by id.
    fn claim(state: &mut State, items: Vec<Item>) -> Vec<SequenceId> {
        for item in items {
            state.accept(item);
        }
        let mut out = Vec::new();
        state.accept_outputs(&mut out, 100);
        out.iter().map(Claimed::sequence_id).collect()
    }

    fn parked(parks: &[Park]) -> Vec<SequenceId> {
        parks.iter().map(|p| p.id).collect()
    }

    /// The drain's end reached in one session, then the stream broke: the next session
    /// reads from the stored position again, which may be before rows the first left
    /// unsettled, and the drain is over only once that session reaches the end too.
    #[test]
    fn a_new_session_is_not_drained_until_it_reaches_the_drains_end_itself() {
        let mut state = State::new(false);
        claim(&mut state, vec![session(1, &[]), Item::Drained]);
        assert!(state.drained());
        claim(&mut state, vec![session(2, &[])]);
        assert!(
            !state.drained(),
            "drained before the new session read to the end"
        );
        claim(&mut state, vec![Item::Drained]);
        assert!(state.drained());
    }

    /// A session that ends (its reader broke, or lost the seat) forgets its queued rows:
    /// the drain's end it had reached no longer says everything was handed out.
    #[test]
    fn an_ended_session_is_not_drained() {
        let mut state = State::new(false);
        claim(&mut state, vec![session(1, &[]), Item::Drained]);
        assert!(state.drained());
        state.leave_to_seat_holder([]);
        assert!(!state.drained(), "the rows it forgot are read again");
    }

    #[test]
    fn settled_rows_of_the_session_are_passed_to_the_reader_whatever_their_order() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(
            claim(&mut state, transactions(&[(1, "a"), (2, "b")])),
            [1, 2]
        );
        state.settle([2, 1]);
        assert_eq!(settled(&state, 1), [2, 1]);
        assert!(state.holdings.held.is_empty());
        state.settle([1]);
        assert_eq!(settled(&state, 1), [2, 1], "settled twice: once");
        assert_eq!(
            state.settled[0].identity,
            RowIdentity::of(
                Some(RowIdentity::row_key("2")),
                Some(uuid::Uuid::from_u128(2))
            ),
            "which event it is, for a session that reads it again"
        );
    }

    /// A row id a held row of another event has, taken again (`TRUNCATE`, which starts
    /// the ids again, while the first was with the sink): the second row gets an engine id
    /// of its own, keeping its row's to delete, so that the first one's ack does not settle
    /// it unsent (the engine took it for the first one's lease renewed).
    #[test]
    fn a_row_whose_id_a_held_row_of_another_event_has_gets_an_id_of_its_own() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, vec![row(34, "a", 1)]), [34]);
        let handed = claim(&mut state, vec![row_of_event_99(34, "b", 2)]);
        assert_eq!(handed.len(), 1);
        assert_ne!(handed[0], 34);
        state.settle([34]);
        assert_eq!(settled(&state, 1), [1], "the first row only");
        match state.holdings.held.get(&handed[0]) {
            Some(Held::Stream(second)) => assert_eq!(second.row, Some(34)),
            _ => panic!("the second row is not held"),
        }
        // Read again by a new session, it keeps that id: the engine takes it for a copy.
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, vec![row_of_event_99(34, "b", 1)]), handed);
    }

    /// The same, the held row one that did not decode (no event id): the row read with its
    /// id is another event all the same.
    #[test]
    fn a_row_whose_id_a_held_undecodable_row_has_gets_an_id_of_its_own() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, vec![undecodable_row(5, "a")]), [5]);
        let handed = claim(&mut state, vec![row(5, "b", 2)]);
        assert_eq!(handed.len(), 1);
        assert_ne!(handed[0], 5);
        assert!(matches!(state.holdings.held.get(&5), Some(Held::Stream(_))));
        assert!(matches!(
            state.holdings.held.get(&handed[0]),
            Some(Held::Stream(_))
        ));
    }

    /// Row `id` of key `key`, the `ordinal`th read, of event 99.
    fn row_of_event_99(id: i64, key: &str, ordinal: u64) -> Item {
        let mut item = row(id, key, ordinal);
        if let Item::Row { captured, .. } = &mut item {
            let other = uuid::Uuid::from_u128(99);
            captured.identity = captured.identity.map(|i| RowIdentity {
                event_id: Some(other),
                ..i
            });
            if let Ok(event) = &mut captured.event {
                event.event_id = other;
            }
        }
        item
    }

    /// A row read again by a new session while its key waits is queued to park behind it,
    /// while the engine still has the first session's copy; the engine then gives that
    /// copy up. Its dead letter was dropped (the id was queued already), so the row was
    /// parked as pending, to be sent again, while the engine counted a dead letter.
    #[test]
    fn a_dead_letter_of_a_row_queued_to_park_already_is_written_dead() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, transactions(&[(1, "a")])), [1]);
        state.accept(session(2, &["a"]));
        assert!(claim(&mut state, transactions(&[(1, "a")])).is_empty());
        assert_eq!(
            state.queue_parks([Park {
                dead: true,
                attempts: 5,
                error: Some("gave up".into()),
                ..Park::behind_its_key(1)
            }]),
            1
        );
        let parks = state.holdings.take_parks();
        assert_eq!(parked(&parks), [1]);
        assert!(parks[0].dead && !parks[0].dead_by_capture, "{:?}", parks[0]);
        assert_eq!(parks[0].attempts, 5);
        assert_eq!(parks[0].error.as_deref(), Some("gave up"));
    }

    #[test]
    fn a_key_with_parked_rows_has_its_later_ones_parked_behind() {
        let mut state = State::new(false);
        state.accept(session(1, &["a"]));
        assert_eq!(claim(&mut state, transactions(&[(1, "a"), (2, "b")])), [2]);
        assert_eq!(parked(&state.holdings.take_parks()), [1]);
    }

    #[test]
    fn a_release_waits_to_be_parked_while_an_earlier_row_of_its_key_is_with_the_engine() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(
            claim(&mut state, transactions(&[(1, "a"), (2, "a")])),
            [1, 2]
        );
        // 2 is released behind 1, which the engine still has: 1 may come back as a retry,
        // and must then be parked first.
        state.queue_parks([Park::behind_its_key(2)]);
        assert!(state.holdings.take_parks().is_empty());
        state.queue_parks([Park::behind_its_key(1)]);
        assert_eq!(parked(&state.holdings.take_parks()), [1, 2], "log order");
    }

    #[test]
    fn a_blackhole_transaction_is_handed_out_at_its_commit_and_never_when_rolled_back() {
        let mut state = State::new(false);
        state.accept(Item::Session {
            session: 1,
            epoch: 1,
            parked_keys: Vec::new(),
            adopted_dead: 0,
            hold_to_commit: true,
        });
        // A BLACKHOLE row has no sequence_id.
        let blackhole = |ordinal| match row(0, "a", ordinal) {
            Item::Row {
                ordinal,
                mut captured,
                memory,
            } => {
                captured.row = None;
                Item::Row {
                    ordinal,
                    captured,
                    memory,
                }
            }
            other => other,
        };
        assert!(claim(&mut state, vec![blackhole(1), blackhole(2)]).is_empty());
        assert_eq!(
            claim(&mut state, vec![Item::Committed]),
            [stream_id(1, 1), stream_id(1, 2)]
        );
        assert!(claim(&mut state, vec![blackhole(3), Item::RolledBack]).is_empty());
        assert!(state.uncommitted.is_empty());
        assert!(claim(&mut state, vec![Item::Committed]).is_empty());
        // A transaction larger than the memory budget: its rows held go out when the reader
        // says so, the rest as read, and the next transaction is held again.
        assert!(claim(&mut state, vec![blackhole(4)]).is_empty());
        assert_eq!(
            claim(&mut state, vec![Item::Overflowed, blackhole(5)]),
            [stream_id(1, 4), stream_id(1, 5)]
        );
        assert!(claim(&mut state, vec![Item::Committed, blackhole(6)]).is_empty());
        assert_eq!(claim(&mut state, vec![Item::Committed]), [stream_id(1, 6)]);
    }

    #[test]
    fn a_row_due_later_is_parked_and_its_key_waits_behind_it() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        let mut later = row(1, "a", 1);
        if let Item::Row { captured, .. } = &mut later {
            captured.not_before = Some(SystemTime::now() + Duration::from_secs(60));
        }
        let items = vec![later, Item::Committed, row(2, "a", 2), Item::Committed];
        assert!(claim(&mut state, items).is_empty());
        let parks = state.holdings.take_parks();
        assert_eq!(parked(&parks), [1, 2]);
        assert!(parks[0].not_before.is_some() && parks[1].not_before.is_none());
    }

    /// The one park is a dead letter with the row's reason, which the capture itself
    /// counts once written (the engine never saw it).
    fn assert_dead_lettered_by_the_capture(parks: &[Park]) {
        assert!(parks[0].dead && parks[0].error.as_deref() == Some("payload is not JSON"));
        assert!(
            parks[0].dead_by_capture,
            "the drain's summary counts it once written"
        );
    }

    #[test]
    fn an_undecodable_row_behind_a_parked_key_is_dead_lettered_by_the_park() {
        let mut state = State::new(false);
        state.accept(session(1, &["a"]));
        let bad = undecodable_row(7, "a");
        assert!(claim(&mut state, vec![bad, Item::Committed]).is_empty());
        assert_dead_lettered_by_the_capture(&state.holdings.take_parks());
    }

    #[test]
    fn an_undecodable_row_the_engine_releases_is_parked_dead_with_its_reason() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        let bad = undecodable_row(7, "a");
        assert_eq!(claim(&mut state, vec![bad, Item::Committed]), [7]);
        state.queue_parks([Park::behind_its_key(7)]);
        assert_dead_lettered_by_the_capture(&state.holdings.take_parks());
    }

    #[test]
    fn an_undecodable_row_the_engine_dead_letters_is_counted_by_the_engine_alone() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        let bad = undecodable_row(7, "a");
        assert_eq!(claim(&mut state, vec![bad, Item::Committed]), [7]);
        state.queue_parks([Park {
            dead: true,
            error: Some("the engine's reason".into()),
            ..Park::behind_its_key(7)
        }]);
        let parks = state.holdings.take_parks();
        assert!(parks[0].dead && !parks[0].dead_by_capture);
    }

    #[test]
    fn a_new_session_drops_what_the_old_one_queued_and_settles_rows_as_their_sessions() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(
            claim(&mut state, transactions(&[(1, "a"), (2, "b")])),
            [1, 2]
        );
        state.queue_parks([Park::behind_its_key(2)]);
        state.accept(row(3, "c", 3));
        state.reading.set(2);
        state.accept(session(2, &[]));
        assert!(state.holdings.to_park.is_empty() && state.unaccepted.is_empty());
        assert!(
            !state.holdings.held.contains_key(&2),
            "read again by the new session"
        );
        // Row 1 of session 1 is settled by the engine: it is passed on as session 1's (the
        // reader settles it unsent if session 2 reads it again).
        state.settle([1]);
        assert_eq!(settled(&state, 1), [1]);
        assert!(settled(&state, 2).is_empty());
        // Row 1 comes again in session 2, read before the reader was told: settled
        // unsent, its ordinal in session 2.
        assert!(claim(&mut state, transactions(&[(1, "a")])).is_empty());
        assert_eq!(settled(&state, 2), [1], "its ordinal in session 2");
    }

    /// A claim races the reader: the session ends (the reader sets no live session) while
    /// rows it read are still queued, before the next session's announcement.
    #[test]
    fn a_claim_racing_a_session_end_drops_what_that_session_read_until_the_next_announcement() {
        let mut state = State::new(false);
        let mut queued: VecDeque<Item> = VecDeque::from([session(1, &[])]);
        queued.extend(transactions(&[(1, "a"), (2, "b")]));
        assert!(state.follow(1, || queued.pop_front()));
        // The session ends before the claim takes what it read.
        assert!(!state.follow(0, || queued.pop_front()));
        let mut out = Vec::new();
        assert_eq!(state.accept_outputs(&mut out, 100), 0);
        assert!(out.is_empty() && state.unaccepted.is_empty());
        queued.push_back(session(2, &[]));
        queued.extend(transactions(&[(1, "a")]));
        assert!(state.follow(2, || queued.pop_front()));
        while let Some(item) = queued.pop_front() {
            state.accept(item);
        }
        state.accept_outputs(&mut out, 100);
        assert_eq!(
            out.iter().map(Claimed::sequence_id).collect::<Vec<_>>(),
            [1]
        );
    }

    /// Parks of session 1, in flight while a claim (waiting out the reconnection, without
    /// `parking`) followed session 2, fail their fence: they ended session 2, and nothing
    /// more was handed out until a restart. They end only their own.
    #[test]
    fn a_fence_failure_of_an_earlier_session_leaves_the_new_one_reading() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, transactions(&[(1, "a")])), [1]);
        state.accept(session(2, &[]));
        state.fenced_out(1, [1]);
        assert!(!state.followed.ended, "session 2 goes on");
        assert_eq!(claim(&mut state, transactions(&[(1, "a")])), [1]);
        state.requeue_parks(1, vec![Park::behind_its_key(1)]);
        assert!(
            state.holdings.to_park.is_empty(),
            "not queued into session 2"
        );
        state.fenced_out(2, [1]);
        assert!(state.followed.ended, "session 2's own ends it");
    }

    /// Rows 10 and 11 of a key are handed out; the stream breaks, and the next session reads
    /// 10 again (the stored position is before both) while 11 is still with the engine.
    /// Then 10 is retried and 11 released behind it: 10 must be parked first. Its place
    /// was its new reading's, (2, 1), which sorted after 11's (1, 2): 11 was parked, and
    /// delivered, before 10.
    #[test]
    fn a_row_read_again_by_a_new_session_keeps_its_place_before_later_rows_of_its_key() {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(
            claim(&mut state, transactions(&[(10, "k"), (11, "k")])),
            [10, 11]
        );
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, transactions(&[(10, "k")])), [10]);
        state.queue_parks([Park::behind_its_key(11)]);
        assert!(
            state.holdings.take_parks().is_empty(),
            "11 waits for 10, which the engine still has"
        );
        state.queue_parks([Park::behind_its_key(10)]);
        assert_eq!(parked(&state.holdings.take_parks()), [10, 11], "log order");
    }

    /// Row 10's park (its retry) is fenced out by the seat's new epoch while 11 of its key is
    /// still with the engine; the next session reads both again. 10's copy took a new place,
    /// after 11's first reading's, and 11 was parked (and delivered) first.
    #[test]
    fn a_row_whose_park_was_fenced_out_keeps_its_place_before_later_rows_of_its_key() {
        let mut state = rows_10_and_11_handed_out();
        state.queue_parks([Park::behind_its_key(10)]);
        assert_eq!(parked(&state.holdings.take_parks()), [10]);
        state.fenced_out(state.epoch, [10]);
        let mut items = vec![session(2, &[])];
        items.extend(transactions(&[(10, "k"), (11, "k")]));
        assert!(claim(&mut state, items).is_empty(), "both wait behind k");
        assert_eq!(parked(&state.holdings.take_parks()), [10, 11]);
    }

    /// Session 1 has handed out rows 10 and 11 of key k.
    fn rows_10_and_11_handed_out() -> State {
        let mut state = State::new(false);
        state.accept(session(1, &[]));
        assert_eq!(
            claim(&mut state, transactions(&[(10, "k"), (11, "k")])),
            [10, 11]
        );
        state
    }

    /// Row 10 of key k is with the engine, 11 behind it, when the session breaks; the new
    /// one reads both again, and 10 is confirmed before a claim takes the copies: the copy
    /// of 10 is settled unsent (handed out, it went out after 11), the copy of 11 handed
    /// out.
    #[test]
    fn a_copy_read_before_its_row_was_settled_is_settled_unsent() {
        let mut state = rows_10_and_11_handed_out();
        // The reader reads session 2 (no claim has taken its announcement yet) when the
        // engine confirms 10.
        state.reading.set(2);
        state.settle([10]);
        let mut items = vec![session(2, &[])];
        items.extend(transactions(&[(10, "k"), (11, "k")]));
        assert_eq!(claim(&mut state, items), [11], "10 settled unsent");
        assert_eq!(
            settled(&state, 2),
            [1],
            "the copy's ordinal passed to the reader"
        );
        assert!(!state.holdings.held.contains_key(&10));
        // A later session's reader is told before it reads: the state lets go of 10 at its
        // announcement (a row read again then is the reader's to settle).
        state.reading.set(3);
        let mut items = vec![session(3, &[])];
        items.extend(transactions(&[(10, "k")]));
        assert_eq!(claim(&mut state, items), [10]);
        // The copy's notice, not yet passed when session 3 was announced in the same claim,
        // still reaches the reader: dropped, the reader never learnt that 10 was settled, and
        // handed it out again behind 11.
        assert_eq!(settled(&state, 2), [1]);
    }

    /// As above, the reader moved on to session 3 when 10 was confirmed, while claims still
    /// followed session 2 (a claim held the state): session 2's copy is settled unsent too.
    #[test]
    fn a_copy_of_a_session_the_reader_left_is_settled_unsent_too() {
        let mut state = rows_10_and_11_handed_out();
        state.reading.set(2);
        state.accept(session(2, &[]));
        for item in transactions(&[(10, "k"), (11, "k")]) {
            state.accept(item);
        }
        state.reading.set(3);
        state.settle([10]);
        let mut out = Vec::new();
        state.accept_outputs(&mut out, 100);
        let handed: Vec<SequenceId> = out.iter().map(Claimed::sequence_id).collect();
        assert_eq!(handed, [11], "10 settled unsent");
    }

    #[test]
    fn a_seat_taken_over_leaves_its_rows_to_the_new_holder() {
        let mut state = State::new(false);
        state.accept(session(1, &["a"]));
        assert!(claim(&mut state, transactions(&[(1, "a")])).is_empty());
        let parks = state.holdings.take_parks();
        state.leave_to_seat_holder(parked(&parks));
        assert!(state.holdings.held.is_empty() && state.followed.ended);
        // The parked table has nothing of `a`: the key is let through, but this session
        // hands out nothing more.
        state.unpark(vec!["a".into()], &HashSet::new());
        assert!(claim(&mut state, transactions(&[(2, "a")])).is_empty());
        assert!(state.settled.is_empty());
    }

    #[test]
    fn ids_of_parked_and_blackhole_rows_never_meet_those_of_table_rows() {
        assert!(parked_id(5) > stream_id(1 << 19, 1 << 39) && parked_id(5) < parked_id(6));
        // However many sessions a relay has started.
        for session in [(1 << 19) - 1, 1 << 20, (1 << 23) + 3, u64::MAX] {
            let id = stream_id(session, (1 << 40) - 1);
            assert!(id > 0 && id < parked_id(0), "session {session}: {id}");
        }
        assert_eq!(parked_row(parked_id(5)), 5);
        assert_ne!(stream_id(1, 5), stream_id(2, 5));
        assert!(stream_id(1, 1) > 0);
    }
}
