//! What capture knows between awaits, and the rules that move it: events handed out and
//! held until settled, the keys with parked events, the parks to write, and the slot
//! position that may be confirmed. No I/O here: `Inner` runs the statements and then tells
//! the state what they did.

use super::*;
use std::collections::HashMap;

use outbox_core::id_hash::BuildIdHasher;

/// A map keyed by stream position, hashed as sequence ids are (`outbox_core::id_hash`):
/// every settled event passes through two of them.
type PositionMap<V> = HashMap<EventPosition, V, BuildIdHasher>;

/// What the reader hands to claims, in stream order.
pub(super) enum Item {
    /// A new session: the slot's confirmed position it starts from, and the keys with
    /// parked events (loaded before any event of the session is handed out).
    Session {
        session: u64,
        start: Lsn,
        parked_keys: Vec<String>,
        /// The largest row of the parked table, in bytes of text (0: none).
        largest_parked: usize,
        /// The session's `application_name`, by which writes check it still holds the slot.
        owner: String,
        /// Events the slot's adoption moved to the parked table that its stream carries too.
        adopted_copies: AdoptedCopies,
        /// The server's history the session reads ([`Confirmable::history`]).
        history: u64,
    },
    /// `--drain`: the position of the marker written at start-up.
    DrainUntil(Lsn),
    /// The outputs the stream had ready, in order: one hand-over (and one wake-up of the
    /// engine) per burst rather than per event.
    Outputs(Vec<ChargedOutput>),
}

pub(super) use outbox_core::capture::LiveSession;

/// What the settled events allow the slot to be confirmed up to, and of which of the
/// server's histories (a count the reader moves on when IDENTIFY_SYSTEM's system or
/// timeline changes, [`crate::History`]). The reader confirms only its own history's: a
/// position of another is another transaction, and confirmed at a promoted standby whose
/// slot is behind it, it skipped the new primary's transactions up to it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Confirmable {
    pub(super) history: u64,
    pub(super) up_to: Lsn,
}

impl Confirmable {
    /// What a session reading `history` may confirm (nothing, of another history).
    pub(super) fn within(self, history: u64) -> Lsn {
        match self.history == history {
            true => self.up_to,
            false => Lsn::default(),
        }
    }
}

/// The events an adoption moved to the parked table that the slot's stream carries too:
/// rows committed after the slot's start and before the adoption, which found them in the
/// table. Their parked copies go out; a stream copy found here is settled unsent, as a
/// delivered event is (its row deleted, if another row took its id since: the same id is
/// the same event). Before, a stream copy whose parked copy had already
/// gone out was delivered again: every row written between a slot made by hand and the
/// first session went out twice. Only ids parked by the adoption itself count (an event
/// whose row its own transaction deleted, never in the table, is not among them), and only
/// stream transactions committed before `until`, the server's WAL position when the ids
/// were read; past it, the set is let go.
#[derive(Debug, Default)]
pub(super) struct AdoptedCopies {
    ids: HashSet<uuid::Uuid>,
    until: Lsn,
}

impl AdoptedCopies {
    /// At most this many ids are kept (about 10 MB): beyond, a stream copy may go out
    /// twice, as it did before, which at-least-once allows.
    pub(super) const MOST: i64 = 262_144;

    pub(super) fn new(ids: impl IntoIterator<Item = uuid::Uuid>, until: Lsn) -> Self {
        AdoptedCopies {
            ids: ids.into_iter().collect(),
            until,
        }
    }

    /// Whether event `id`, of the transaction committed at `commit`, has an adopted copy in
    /// the parked table. The first event past `until` lets the set go: no later one can be
    /// among them.
    fn adopted(&mut self, id: &uuid::Uuid, commit: Lsn) -> bool {
        if self.ids.is_empty() {
            return false;
        }
        if commit >= self.until {
            *self = AdoptedCopies::default();
            return false;
        }
        self.ids.contains(id)
    }
}

pub(super) type Body = outbox_core::capture::Body<Undecodable>;
pub(super) type Held = outbox_core::capture::Held<HeldWal>;

pub(super) struct HeldWal {
    pub(super) session: u64,
    pub(super) position: EventPosition,
    /// The outbox row to delete once settled (table form).
    pub(super) row: Option<OutboxRow>,
    pub(super) body: Body,
    /// Its bytes in the memory budget, given back when it is let go of.
    pub(super) _memory: Charge,
}

impl HeldWal {
    /// The event's id, if it decoded that far.
    pub(super) fn event_id(&self) -> Option<uuid::Uuid> {
        match &self.body {
            Body::Event(event) => Some(event.event_id),
            Body::Undecodable(u) => u.event_id,
        }
    }
}

/// An outbox row a stream event was read from, and the transaction that wrote it: a row
/// the delete does not find is gone already if its transaction is visible, and not visible
/// yet otherwise (see `Inner::delete_delivered`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct OutboxRow {
    pub(super) id: SequenceId,
    pub(super) xid: u32,
}

impl OutboxRow {
    /// `rows` as the two arrays the delete statements take: the row ids and their
    /// transactions' ids.
    pub(super) fn params(rows: &[OutboxRow]) -> (Vec<SequenceId>, Vec<i64>) {
        rows.iter().map(|row| (row.id, i64::from(row.xid))).unzip()
    }
}

/// An event to park and how.
pub(super) struct Park {
    pub(super) id: SequenceId,
    pub(super) attempts: u32,
    pub(super) error: Option<String>,
    pub(super) delay: Duration,
    pub(super) not_before: Option<SystemTime>,
}

impl Park {
    /// An event that waits for its key, with nothing against it.
    pub(super) fn behind_its_key(id: SequenceId) -> Self {
        Park {
            id,
            attempts: 0,
            error: None,
            delay: Duration::ZERO,
            not_before: None,
        }
    }
}

impl capture::StreamEvent for HeldWal {
    type Place = EventPosition;

    fn key(&self) -> &str {
        match &self.body {
            Body::Event(event) => event.ordering_key(),
            Body::Undecodable(undecodable) => undecodable.ordering_key(),
        }
    }

    fn place(&self) -> EventPosition {
        self.position
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

    /// The later error, and the longer of the waits and attempt counts.
    fn absorb(&mut self, later: Self) {
        self.attempts = self.attempts.max(later.attempts);
        self.error = later.error.or(self.error.take());
        self.delay = self.delay.max(later.delay);
        self.not_before = self.not_before.max(later.not_before);
    }
}

pub(super) struct State {
    /// The session followed ([`State::end_session`] ends it: a write also ends it when it
    /// finds the slot streaming to another session).
    pub(super) followed: Followed,
    /// The current session's `application_name` ([`CaptureStatements::owns_slot`]).
    pub(super) owner: String,
    pub(super) acks: Acknowledgements,
    /// Events held, parked keys and the parks to write (the rules both captures share).
    pub(super) holdings: Holdings<HeldWal, Park>,
    /// Held stream events the engine released: handed out again by the next claim.
    pub(super) redeliver: VecDeque<SequenceId>,
    /// Delivered stream events whose outbox row was not found yet, and since when.
    pub(super) undeleted: Vec<(SequenceId, std::time::Instant)>,
    /// Outbox rows of settled events that were still not found after `UNDELETED_PATIENCE`,
    /// and since when: looked for now and then, so that a commit that waited long (on a
    /// synchronous standby that was away) leaves no row behind once it shows.
    pub(super) late_rows: Vec<(OutboxRow, std::time::Instant)>,
    /// When `late_rows` were last looked for.
    pub(super) late_rows_swept: Option<std::time::Instant>,
    pub(super) drain_until: Option<Lsn>,
    /// Outputs received from the reader and not yet accepted by a claim (a claim stops
    /// at its limit, possibly within a burst).
    pub(super) unaccepted: VecDeque<ChargedOutput>,
    /// `--drain`: everything committed before the marker has been handed out.
    pub(super) drained: bool,
    /// An upper bound of the memory one row of the parked table takes: read at each
    /// session's start, raised by each park. Parked claims are sized by it, not by the
    /// stream's events, which say nothing of rows parked before a restart.
    pub(super) largest_parked: usize,
    pub(super) derived_ids: DerivedIds,
    pub(super) adopted_copies: AdoptedCopies,
    /// Where the events settled since the slot's confirmed position are: a new session
    /// reads them again, and each is settled unsent. Sent again, a key's earlier event went
    /// out after a later one still with the engine (and every such event twice).
    pub(super) settled: SettledPositions,
    /// What the server was last told the slot may be confirmed up to (the reader sets it):
    /// the settled positions keep what lies past it.
    pub(super) told: Arc<ToldServer>,
    /// The server's history the current session reads ([`Confirmable`]).
    pub(super) history: u64,
    /// The first session of [`State::history`]: events held from earlier sessions are of
    /// another history, and their settles say nothing of this one's positions.
    pub(super) history_began: u64,
    /// Every event committed before this was settled, of this history: read again by a
    /// later session, it is settled unsent. The slot's confirmed position reaches the
    /// server's disk only at its checkpoints, so a server that crashed (or was stopped
    /// `immediate`) streams again from behind what it was told, through events the
    /// settled positions let go of once it was told: a key's settled event then went out
    /// again after a later one still with the engine.
    pub(super) done_below: Lsn,
}

/// The position the reader last told the server the slot may be confirmed up to (its last
/// status update; at a session's start, the slot's own). Behind what the settled events
/// allow by the confirm mark's raises (a second apart, or held while a raise fails) and the
/// status updates' interval.
#[derive(Debug, Default)]
pub(super) struct ToldServer(std::sync::atomic::AtomicU64);

impl ToldServer {
    /// Never lower within one history: a new session's stream reports the slot's start,
    /// which after a server's crash lies behind what the server was told, and may do so
    /// before the claims accept the session (then `done_below`, capped by it, covered
    /// nothing, and settled events read again went out again, after later ones of their key).
    pub(super) fn set(&self, lsn: Lsn) {
        self.0
            .fetch_max(lsn.0, std::sync::atomic::Ordering::Relaxed);
    }

    /// The server's history changed: what the last one was told says nothing of this one.
    pub(super) fn reset(&self) {
        self.0.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    fn get(&self) -> Lsn {
        Lsn(self.0.load(std::sync::atomic::Ordering::Relaxed))
    }
}

/// Which events are settled (delivered, parked or dead-lettered) that a new session may
/// read again, by position and event id: a session reading one again settles it unsent. The
/// id must match as well: a server that took over on a new timeline (a promoted standby
/// whose slot survived) writes other transactions at positions an earlier server used.
#[derive(Debug, Default)]
pub(super) struct SettledPositions {
    settled: PositionMap<Option<uuid::Uuid>>,
    /// Settles recorded since the map was last cut.
    since_cut: usize,
    /// What the server had been told at the last cut ([`ToldServer`]): the next cut lets
    /// go of what lies before it. A cut's lag gives the server time to take the status
    /// update in, so what a break may still send again is kept, and the map stays small (a
    /// map of every settle since the session began cost the relay 13% more CPU per event
    /// at 10,000/s, its inserts missing the cache). Cut by what the session could confirm
    /// instead, the map let go of events the slot was not yet confirmed past (the confirm
    /// mark is raised a second apart), and a session broken then sent a key's settled
    /// event again after a later one still with the engine.
    cut_below: Lsn,
}

impl SettledPositions {
    /// At most this many are kept: past that, an event read again goes out again, as
    /// at-least-once allows.
    const MOST: usize = 262_144;
    /// Settles between two cuts, at least; and at least half as many as the map holds,
    /// since a cut walks the whole map: a drain at 200,000 events a second keeps a second
    /// of them or more until the server is told, and cut every 4,096 settles, walking them
    /// took 5% of the relay's CPU.
    const CUT_EVERY: usize = 4_096;

    /// Event `id` at `position` is settled; the server has been told the slot may be
    /// confirmed up to `told`.
    fn record(&mut self, position: EventPosition, id: Option<uuid::Uuid>, told: Lsn) {
        self.since_cut += 1;
        if self.since_cut >= Self::CUT_EVERY.max(self.settled.len() / 2) {
            let below = self.cut_below;
            self.settled.retain(|p, _| p.commit_lsn >= below);
            self.cut_below = told;
            self.since_cut = 0;
        }
        if self.settled.len() < Self::MOST {
            self.settled.insert(position, id);
        }
    }

    /// A session starts streaming at `start`: nothing committed before it comes again.
    fn start_at(&mut self, start: Lsn) {
        self.settled.retain(|p, _| p.commit_lsn >= start);
    }

    fn contains(&self, position: &EventPosition, id: Option<uuid::Uuid>) -> bool {
        self.settled.get(position) == Some(&id)
    }
}

/// Ids for events without one of their own (a mapped table without a sequence column, an
/// `outbox_emit` message), by position: the same event sent again by a new session keeps
/// its id while it is held, as a row's sequence id does, and no two events share one.
/// (Derived from the position, they did: a commit's position plus an ordinal of a large
/// transaction reached the next commit's.) Drawn upwards, in stream order, each session
/// from `DERIVED_IDS + microseconds since 1970 × 1024` or above what the last drew: no other
/// session of the slot, in this process or another, drew those ids (a session draws fewer
/// than 1,024 a microsecond), which matters since they outlive the process as dead letters'
/// keys (`ON CONFLICT (sequence_id)` dropped a dead letter that met an id drawn before).
/// Far below every row's id, even a mapped table's own negative ones, and below the ids
/// drawn downwards from `-(microseconds × 1024)` before 0.2 (about -1.8 × 10^18).
///
/// Upwards because the engine's lanes take a key's lower id for its earlier event: a
/// release racing a claim (a sink's `NotSent`) sends back a claimed event only past a
/// *lower* released id of its key, so ids drawn downwards let a key's later event overtake
/// its released earlier ones.
pub(super) struct DerivedIds {
    by_position: PositionMap<SequenceId>,
    drawn: SequenceId,
}

/// Where derived ids start: about -9.2 × 10^18, with room for 1,024 ids a microsecond
/// until the year 2255.
const DERIVED_IDS: SequenceId = SequenceId::MIN + 1;

impl Default for DerivedIds {
    fn default() -> Self {
        DerivedIds {
            by_position: PositionMap::default(),
            drawn: DERIVED_IDS,
        }
    }
}

impl DerivedIds {
    /// A session starts at `now`: ids are drawn above its start's.
    fn start_session(&mut self, now: SystemTime) {
        let micros = now
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
        self.drawn = self
            .drawn
            .max(DERIVED_IDS.saturating_add(micros.saturating_mul(1024)));
    }

    fn id(&mut self, position: EventPosition) -> SequenceId {
        *self.by_position.entry(position).or_insert_with(|| {
            self.drawn = self.drawn.saturating_add(1);
            self.drawn
        })
    }

    /// Forgets the id drawn at `position` if it is `id`: another history's event at that
    /// position may hold one of its own.
    fn forget(&mut self, position: &EventPosition, id: SequenceId) {
        if self.by_position.get(position) == Some(&id) {
            self.by_position.remove(position);
        }
    }

    /// Forgets the ids of events no longer held (dropped unhanded, fenced out).
    fn keep_held(&mut self, held: impl Fn(SequenceId) -> bool) {
        self.by_position.retain(|_, id| held(*id));
    }
}

/// The engine's id of an event, and its outbox row.
pub(super) fn event_id_of(
    source: EventSource,
    position: EventPosition,
    derived: &mut DerivedIds,
) -> (SequenceId, Option<OutboxRow>) {
    match source {
        EventSource::Table {
            sequence_id: Some(id),
        } => (
            id,
            Some(OutboxRow {
                id,
                xid: position.xid,
            }),
        ),
        // Not in the native table; a row without an id cannot be deleted either.
        EventSource::Table { sequence_id: None } | EventSource::Message { .. } => {
            (derived.id(position), None)
        }
    }
}

pub(super) fn claimed_of(id: SequenceId, held: &HeldWal) -> Claimed {
    match &held.body {
        Body::Event(event) => Claimed::Event(event.clone()),
        Body::Undecodable(u) => Claimed::Undecodable {
            sequence_id: id,
            ordering_key: held.key().to_string(),
            destination: u.destination.clone().unwrap_or_default(),
            attempts: 0,
            reason: u.reason.clone(),
        },
    }
}

impl State {
    pub(super) fn new() -> State {
        State {
            followed: Followed::before_any_session(),
            owner: String::new(),
            acks: Acknowledgements::new(Lsn::default()),
            holdings: Holdings::default(),
            redeliver: VecDeque::new(),
            undeleted: Vec::new(),
            late_rows: Vec::new(),
            late_rows_swept: None,
            drain_until: None,
            unaccepted: VecDeque::new(),
            drained: false,
            largest_parked: 0,
            derived_ids: DerivedIds::default(),
            adopted_copies: AdoptedCopies::default(),
            settled: SettledPositions::default(),
            told: Arc::default(),
            history: 0,
            history_began: 0,
            done_below: Lsn::default(),
        }
    }

    /// What the slot may be confirmed up to now, of the current history.
    pub(super) fn confirmable(&mut self) -> Confirmable {
        Confirmable {
            history: self.history,
            up_to: self.acks.confirmable(),
        }
    }

    /// The outbox row of held stream event `id`, if it has one (an `outbox_emit` message,
    /// or a mapped row without an id, has none).
    pub(super) fn held_row(&self, id: SequenceId) -> Option<OutboxRow> {
        match self.holdings.held.get(&id) {
            Some(Held::Stream(held)) => held.row,
            _ => None,
        }
    }

    /// Whether the session followed is `live` and may hand out events
    /// ([`capture::follow`]).
    pub(super) fn follow(&mut self, live: u64, next: impl FnMut() -> Option<Item>) -> bool {
        capture::follow(self, live, next)
    }

    /// Forgets the held events that wait to be handed out again or to be parked.
    fn forget_unhanded(&mut self) {
        for id in self.redeliver.drain(..) {
            self.holdings.held.remove(&id);
        }
        self.holdings.forget_queued_parks();
    }

    /// Queues released stream events to be handed out again, all of them in stream order:
    /// two releases can reach the capture in either order (a key's later event, a claim's
    /// copy sent back by the engine's lanes, ahead of its earlier ones), and the lanes take
    /// a key's events in the order a claim hands them out.
    pub(super) fn redeliver_later(&mut self, ids: impl IntoIterator<Item = SequenceId>) {
        self.redeliver.extend(ids);
        let held = &self.holdings.held;
        self.redeliver
            .make_contiguous()
            .sort_by_key(|id| match held.get(id) {
                Some(Held::Stream(event)) => Some(event.position),
                _ => None,
            });
    }

    /// Stream events the engine released: an earlier session's are forgotten
    /// ([`State::forget_earlier_sessions`]), those of a key that waits behind parked events
    /// are returned to be parked, and the rest are handed out again by the next claims.
    pub(super) fn released(&mut self, ids: Vec<SequenceId>) -> Vec<Park> {
        let ids = self.forget_earlier_sessions(ids, |id| *id);
        let (behind, free): (Vec<SequenceId>, Vec<SequenceId>) =
            ids.into_iter()
                .partition(|id| match self.holdings.held.get(id) {
                    Some(Held::Stream(held)) => self.holdings.waits(held.key()),
                    _ => false,
                });
        tracing::debug!(?behind, ?free, "released stream events");
        self.redeliver_later(free);
        behind.into_iter().map(Park::behind_its_key).collect()
    }

    /// Of `items` (released or retried stream events, by `id`), forgets those an earlier
    /// session than the one claims follow read, as that session's start forgot those
    /// released before it: the session that streams now reads them again, in order with
    /// their keys' other events. Handed out again or parked from here, one released after a
    /// new session began went out ahead of an earlier event of its key released before
    /// (and read again). Returns the rest.
    pub(super) fn forget_earlier_sessions<T>(
        &mut self,
        items: Vec<T>,
        id: impl Fn(&T) -> SequenceId,
    ) -> Vec<T> {
        let session = self.followed.session;
        let (earlier, rest): (Vec<T>, Vec<T>) = items.into_iter().partition(|item| {
            matches!(self.holdings.held.get(&id(item)), Some(Held::Stream(held)) if held.session < session)
        });
        for item in earlier {
            let id = id(&item);
            if let Some(held) = self.holdings.remove_stream(id) {
                self.derived_ids.forget(&held.position, id);
            }
        }
        rest
    }

    /// Hands out released stream events again, into `out` up to `limit` (those of a key
    /// that has parked events since are queued to park behind it).
    pub(super) fn redeliver_into(&mut self, out: &mut Vec<Claimed>, limit: usize) {
        while out.len() < limit && !self.followed.ended {
            let Some(id) = self.redeliver.pop_front() else {
                break;
            };
            let Some(Held::Stream(held)) = self.holdings.held.get(&id) else {
                continue;
            };
            if self.holdings.waits(held.key()) {
                self.holdings.to_park.push(Park::behind_its_key(id));
            } else {
                out.push(claimed_of(id, held));
            }
        }
    }

    /// Settles held stream events of the current session and forgets them.
    pub(super) fn settle(&mut self, ids: impl IntoIterator<Item = SequenceId>) {
        for id in ids {
            if let Some(held) = self.holdings.remove_stream(id) {
                self.derived_ids.forget(&held.position, id);
                let position = held.position;
                if held.session == self.followed.session {
                    if let Err(e) = self.acks.settle(held.position) {
                        tracing::error!(error = %e, "WAL acknowledgement out of step (a bug): the slot stays where it is");
                    }
                }
                // An event of another history (a promoted standby's) is no news of this
                // one's: another event, with the same derived id, may stand at its position.
                if held.session >= self.history_began {
                    self.settled
                        .record(position, held.event_id(), self.told.get());
                }
            }
        }
    }

    /// Settles the copies of an ending engine call's events that a newer session handed out
    /// while it ran ([`Holdings::copies_the_engine_dropped`]), but for one whose row is not
    /// visible yet: a claim's retry deletes that row, and settles whatever copy holds it.
    /// Whether it settled any.
    pub(super) fn settle_copies(&mut self, ids: &[SequenceId], sessions: &[u64]) -> bool {
        let copies = self
            .holdings
            .copies_the_engine_dropped(ids, sessions, self.followed.session);
        if copies.is_empty() {
            return false;
        }
        let waiting: HashSet<SequenceId> = self.undeleted.iter().map(|(id, _)| *id).collect();
        self.settle(copies.into_iter().filter(|id| !waiting.contains(id)));
        true
    }

    /// Accepts outputs received and not yet accepted, until `out` holds `limit` events or
    /// `budget` outputs were accepted; returns how many were.
    pub(super) fn accept_outputs(
        &mut self,
        out: &mut Vec<Claimed>,
        limit: usize,
        budget: usize,
    ) -> usize {
        let mut accepted = 0;
        while out.len() < limit && accepted < budget && !self.followed.ended {
            let Some(charged) = self.unaccepted.pop_front() else {
                break;
            };
            accepted += 1;
            self.accept_output(charged, out);
        }
        accepted
    }

    pub(super) fn accept_output(&mut self, charged: ChargedOutput, out: &mut Vec<Claimed>) {
        let ChargedOutput { output, memory } = charged;
        if self.drained {
            return;
        }
        match &output {
            Output::Skipped { lsn, reason } => {
                tracing::warn!(%lsn, reason, "outbox message not relayed");
                ::metrics::counter!(metric::SKIPPED_MESSAGES).increment(1);
            }
            // The drain marker arrives as one.
            Output::Idle { wal_end } => {
                if self.drain_until.is_some_and(|until| *wal_end >= until) {
                    self.drained = true;
                }
            }
            Output::Event { .. } | Output::Committed { .. } => {}
        }
        self.acks.observe(&output);
        if let Output::Event { position, event } = output {
            self.hand_out(position, event, memory, out);
        }
    }

    /// The engine's id of an event read at `position` ([`event_id_of`]), and its outbox row:
    /// the row's id, unless a held event that is another one (another event id, or another
    /// position for events without one), or a parked row of another event, has it. Ids are taken again when a promoted standby
    /// had not received the sequence's last advance, or after `TRUNCATE … RESTART
    /// IDENTITY`; sharing one, the engine would take the second event for the first one's
    /// lease renewed, and the first one's ack would settle the second unsent. The second
    /// draws an id, and keeps its row to delete.
    fn engine_id_of(
        &mut self,
        source: EventSource,
        position: EventPosition,
        event_id: Option<uuid::Uuid>,
    ) -> (SequenceId, Option<OutboxRow>) {
        let (id, row) = event_id_of(source, position, &mut self.derived_ids);
        if row.is_none() {
            // Drawn for its position: no other event has it.
            return (id, row);
        }
        // Read again, an event that drew an id of its own keeps it while it is held.
        if !self.derived_ids.by_position.is_empty() {
            if let Some(&drawn) = self.derived_ids.by_position.get(&position) {
                if matches!(self.holdings.held.get(&drawn), Some(Held::Stream(held)) if held.event_id() == event_id)
                {
                    return (drawn, row);
                }
            }
        }
        let another = match self.holdings.held.get(&id) {
            Some(Held::Stream(held)) => match (held.event_id(), event_id) {
                (Some(held), Some(read)) => held != read,
                _ => held.position != position,
            },
            // A row adopted under its own id (by a relay before 0.2) is its stream copy; one
            // that did not decode cannot be told to be, and the event goes out (a duplicate
            // at worst).
            Some(Held::Parked {
                event_id: parked, ..
            }) => parked.is_none() || event_id != *parked,
            _ => false,
        };
        match another {
            true => (self.derived_ids.id(position), row),
            false => (id, row),
        }
    }

    pub(super) fn hand_out(
        &mut self,
        position: EventPosition,
        event: Result<WalEvent, Box<Undecodable>>,
        memory: Charge,
        out: &mut Vec<Claimed>,
    ) {
        // Settled already, read again by a new session: settled now, unsent.
        let id = match &event {
            Ok(event) => Some(event.event.event_id),
            Err(undecodable) => undecodable.event_id,
        };
        if position.commit_lsn < self.done_below || self.settled.contains(&position, id) {
            if let Err(e) = self.acks.settle(position) {
                tracing::error!(error = %e, "WAL acknowledgement out of step (a bug)");
            }
            return;
        }
        let (id, row, body) = match event {
            Ok(event) => {
                let (id, row) =
                    self.engine_id_of(event.source, position, Some(event.event.event_id));
                if matches!(self.holdings.held.get(&id), Some(Held::Parked { .. })) {
                    // Adopted into the parked table under its own id (as earlier relays
                    // adopted rows), and committed after the slot's start: the parked
                    // copy is being delivered; this one is settled. Rows adopted since draw
                    // new ids: their stream copies are found by event id (next).
                    if let Err(e) = self.acks.settle(position) {
                        tracing::error!(error = %e, "WAL acknowledgement out of step (a bug)");
                    }
                    return;
                }
                let adopted = (self.adopted_copies).adopted(&event.event_id, position.commit_lsn);
                let not_before = event.available_at.filter(|at| *at > SystemTime::now());
                let core = Arc::new(event.into_core(id));
                let key = core.ordering_key();
                if adopted {
                    // Its parked copy goes out instead: held, never handed out, and settled
                    // as a delivered event is, by the next claim's delete of its row (gone
                    // already, moved by the adoption, unless another row took its id).
                    self.undeleted.push((id, std::time::Instant::now()));
                } else if not_before.is_some() || self.holdings.waits(key) {
                    let park = Park {
                        not_before,
                        ..Park::behind_its_key(id)
                    };
                    self.holdings.park_behind(key, park);
                } else {
                    out.push(Claimed::Event(core.clone()));
                }
                (id, row, Body::Event(core))
            }
            Err(undecodable) => {
                let (id, row) =
                    self.engine_id_of(undecodable.source, position, undecodable.event_id);
                out.push(Claimed::Undecodable {
                    sequence_id: id,
                    ordering_key: undecodable.ordering_key().to_string(),
                    destination: undecodable.destination.clone().unwrap_or_default(),
                    attempts: 0,
                    reason: undecodable.reason.clone(),
                });
                (id, row, Body::Undecodable(undecodable))
            }
        };
        let held = HeldWal {
            session: self.followed.session,
            position,
            row,
            body,
            _memory: memory,
        };
        self.holdings.held.insert(id, Held::Stream(Box::new(held)));
    }

    /// A park or dead letter written for `session` failed its fence: the slot streams to
    /// another session. While claims still follow `session`, that session is over
    /// ([`State::leave_to_slot_holder`]). If they follow a newer session of this relay by now
    /// (a claim waiting out a reconnection follows one without `parking`), the writes were
    /// the earlier session's, and the new one is sent their events again: it goes on.
    /// Whether the writes were the current session's.
    pub(super) fn fenced_out(
        &mut self,
        session: u64,
        ids: impl IntoIterator<Item = SequenceId>,
    ) -> bool {
        if self.followed.session != session {
            return false;
        }
        self.leave_to_slot_holder(ids);
        true
    }

    /// Parks of `session` that failed: queued again, ahead of any queued since, while claims
    /// follow that session; dropped once they follow a newer one, which forgot the earlier
    /// session's queue and is sent their events again.
    pub(super) fn requeue_parks(&mut self, session: u64, parks: Vec<Park>) {
        if self.followed.session != session {
            return;
        }
        self.holdings.requeue_parks(parks);
    }

    /// Forgets stream events this relay may no longer write for: the slot streams to another
    /// session (a relay that took over while this one was paused past its session's end),
    /// which is sent them again from the slot's confirmed position, before which they lie.
    /// The session is over with it ([`State::end_session`]).
    pub(super) fn leave_to_slot_holder(&mut self, ids: impl IntoIterator<Item = SequenceId>) {
        let ids = self.holdings.leave_to_other_reader(ids);
        tracing::warn!(
            ?ids,
            "the replication slot streams to another session now: these events are left to it, \
             unwritten (it is sent them again), and nothing more of this session is handed out"
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
    /// out (read ahead, released, queued to park) is dropped, to come again from the slot
    /// in whichever session streams next, this relay's or another's.
    ///
    /// Handing it out would break the order of a key: another relay may hold the slot now,
    /// and an earlier event of the key may be among what this relay had to leave to it
    /// ([`State::leave_to_slot_holder`]). This relay would then publish the later event
    /// before the new holder publishes the earlier one.
    fn end_session(&mut self) {
        self.followed.ended = true;
        self.unaccepted.clear();
        self.forget_unhanded();
        // What it forgot comes again before the drain's end, in the next session.
        self.drained = false;
    }

    /// One reader item, in stream order; events to hand out go to `out`.
    fn accept(&mut self, item: Item) {
        match item {
            Item::Session {
                session,
                start,
                parked_keys,
                largest_parked,
                owner,
                adopted_copies,
                history,
            } => {
                if history == self.history {
                    // No further than the server was told: the confirm mark, raised a
                    // second apart, is below what was confirmable, and a disk snapshot
                    // restored after the last raise writes new transactions past the mark.
                    // Settled events past it are found by position and event id.
                    let told = self.told.get();
                    self.done_below = (self.done_below).max(self.acks.confirmable().min(told));
                } else {
                    // Positions of another history are other transactions: an event still
                    // held from the last would share its id with one of this history's at
                    // its position (the engine taking the new one for a renewed lease).
                    self.history = history;
                    self.history_began = session;
                    self.done_below = Lsn::default();
                    self.settled = SettledPositions::default();
                    self.derived_ids.by_position.clear();
                }
                self.adopted_copies = adopted_copies;
                // What a row costs in memory beyond its text, as a claimed event's charge.
                self.largest_parked = largest_parked + outbox_core::memory::EVENT_OVERHEAD;
                self.followed.start(session);
                self.owner = owner;
                self.acks = Acknowledgements::new(start);
                self.settled.start_at(start);
                // Released or unparked events of the old session come again in this one.
                self.forget_unhanded();
                self.holdings.load_parked_keys(parked_keys);
                let held = &self.holdings.held;
                self.derived_ids.keep_held(|id| held.contains_key(&id));
                self.derived_ids.start_session(SystemTime::now());
                // Each session reads to the drain's end again, and says so: what an earlier
                // one left unsettled comes again in this one, before the end.
                self.drained = false;
            }
            Item::DrainUntil(lsn) => self.drain_until = Some(lsn),
            // What an ended session read is sent again by the next.
            Item::Outputs(_) if self.followed.ended => {}
            Item::Outputs(outputs) => self.unaccepted.extend(outputs),
        }
    }

    fn announces(item: &Item) -> bool {
        matches!(item, Item::Session { .. })
    }
}

/// The settle and confirm rules, one interleaving each: what claims, acks, parks and a new
/// session do to what is held and to the position the slot may be confirmed at.
#[cfg(test)]
mod tests {
    use super::*;

    const START: Lsn = Lsn(100);

    /// Event `id` of key `key`, the `ordinal`th of the transaction committing at `commit`.
    fn event(id: SequenceId, key: &str, commit: u64, ordinal: u64) -> Output {
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
        Output::Event {
            position: EventPosition {
                commit_lsn: Lsn(commit),
                ordinal,
                xid: 0,
            },
            event: Ok(WalEvent {
                event,
                available_at: None,
                source: EventSource::Table {
                    sequence_id: Some(id),
                },
            }),
        }
    }

    fn committed(commit: u64, events: u64) -> Output {
        Output::Committed {
            commit_lsn: Lsn(commit),
            end_lsn: Lsn(commit + 10),
            events,
            commit_time: SystemTime::UNIX_EPOCH,
        }
    }

    fn session(n: u64, parked_keys: &[&str]) -> Item {
        session_with(n, parked_keys, AdoptedCopies::default())
    }

    /// Session `n` on a server of the `history`th history (0: the first).
    fn session_of_history(n: u64, history: u64) -> Item {
        session_on(n, &[], AdoptedCopies::default(), history)
    }

    fn session_with(n: u64, parked_keys: &[&str], adopted_copies: AdoptedCopies) -> Item {
        session_on(n, parked_keys, adopted_copies, 0)
    }

    fn session_on(
        n: u64,
        parked_keys: &[&str],
        adopted_copies: AdoptedCopies,
        history: u64,
    ) -> Item {
        Item::Session {
            session: n,
            start: START,
            parked_keys: parked_keys.iter().map(|k| k.to_string()).collect(),
            largest_parked: 0,
            owner: format!("session {n}"),
            adopted_copies,
            history,
        }
    }

    /// What a claim hands the engine of `outputs`, by id.
    fn claim(state: &mut State, outputs: Vec<Output>) -> Vec<SequenceId> {
        claim_charged(state, outputs, &MemoryBudget::new(usize::MAX))
    }

    /// `outputs` as the reader hands them over, each charged to `memory`.
    fn charged(outputs: Vec<Output>, memory: &Arc<MemoryBudget>) -> Vec<ChargedOutput> {
        outputs
            .into_iter()
            .map(|output| ChargedOutput {
                memory: memory.charge(crate::budget::output_bytes(&output)),
                output,
            })
            .collect()
    }

    /// [`claim`], charging each output to `memory`.
    fn claim_charged(
        state: &mut State,
        outputs: Vec<Output>,
        memory: &Arc<MemoryBudget>,
    ) -> Vec<SequenceId> {
        state.accept(Item::Outputs(charged(outputs, memory)));
        let mut out = Vec::new();
        state.accept_outputs(&mut out, 100, 1_000);
        out.iter().map(Claimed::sequence_id).collect()
    }

    /// Two transactions: event 1 (key a) committing at 200, event 2 (key b) at 300.
    /// One single-event transaction per `(id, key, commit lsn)`.
    fn transactions(events: &[(SequenceId, &str, u64)]) -> Vec<Output> {
        events
            .iter()
            .flat_map(|&(id, key, lsn)| [event(id, key, lsn, 0), committed(lsn, 1)])
            .collect()
    }

    fn two_transactions() -> Vec<Output> {
        transactions(&[(1, "a", 200), (2, "b", 300)])
    }

    /// An event with no id of its own (a mapped table without a sequence column, or an
    /// `outbox_emit` message) of key `key`, the `ordinal`th of the transaction committing
    /// at `commit`.
    fn idless(key: &str, commit: u64, ordinal: u64, message_at: Option<u64>) -> Output {
        let mut output = event(0, key, commit, ordinal);
        if let Output::Event {
            event: Ok(event), ..
        } = &mut output
        {
            event.source = match message_at {
                Some(lsn) => EventSource::Message { lsn: Lsn(lsn) },
                None => EventSource::Table { sequence_id: None },
            };
        }
        output
    }

    /// A stream copy of an event the adoption parked (event 1, committed before the
    /// adoption's ids were read at 250) is not handed out, nor parked: it waits for the
    /// next claim's delete, as a delivered event does, and then settles. Event 2 goes out;
    /// past 250 the set is let go, so a later event with an adopted id (which cannot be
    /// the adopted one) goes out too.
    #[test]
    fn stream_copies_of_adopted_events_are_settled_unsent_until_the_adoptions_position() {
        let mut state = State::new();
        let adopted = [1, 3].map(|id| uuid::Uuid::from_u128(id as u128));
        state.accept(session_with(1, &[], AdoptedCopies::new(adopted, Lsn(250))));
        let outputs = transactions(&[(1, "a", 200), (2, "b", 210), (3, "c", 300)]);
        assert_eq!(claim(&mut state, outputs), [2, 3]);
        assert!(state.holdings.take_parks().is_empty());
        let waiting: Vec<SequenceId> = state.undeleted.iter().map(|(id, _)| *id).collect();
        assert_eq!(waiting, [1], "to be settled as delivered");
        assert!(state.adopted_copies.ids.is_empty(), "let go past 250");
        state.settle([1, 2]);
        assert_eq!(state.acks.confirmable(), Lsn(220));
    }

    /// Ids derived from the commit position plus the ordinal met when a large transaction
    /// committed just before another (its 40th event and the next one's first shared an
    /// id), or before a message of a later one: the second replaced the first among the
    /// held events, whose position then never settled, and the slot stopped for good.
    #[test]
    fn events_without_ids_of_their_own_never_share_one() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let mut outputs: Vec<Output> = (0..60).map(|n| idless("a", 1000, n, None)).collect();
        outputs.push(committed(1000, 60));
        outputs.push(idless("b", 1040, 0, None));
        outputs.push(committed(1040, 1));
        outputs.push(idless("c", 1100, 0, Some(1050)));
        outputs.push(committed(1100, 1));
        let handed = claim(&mut state, outputs);
        assert_eq!(handed.len(), 62);
        let distinct: HashSet<SequenceId> = handed.iter().copied().collect();
        assert_eq!(distinct.len(), 62, "ids handed out twice: {handed:?}");
        state.settle(handed);
        assert_eq!(state.acks.confirmable(), Lsn(1110));
    }

    /// A dead letter's key is the event's engine id: drawn from -1 in each process, a
    /// restarted relay's ids met its predecessor's, and `ON CONFLICT (sequence_id)` dropped
    /// the dead letter. Each session draws below its start's time, and below the last.
    #[test]
    fn derived_ids_of_later_sessions_and_processes_are_new() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut first = DerivedIds::default();
        first.start_session(start);
        let a: Vec<_> = (0..1000).map(|n| first.id(position(n))).collect();
        // Another process, a second later; and this one's next session, its clock behind.
        let mut second = DerivedIds::default();
        second.start_session(start + Duration::from_secs(1));
        let b: Vec<_> = (0..1000).map(|n| second.id(position(n))).collect();
        first.start_session(start - Duration::from_secs(60));
        let c: Vec<_> = (1000..2000).map(|n| first.id(position(n))).collect();
        let all: HashSet<SequenceId> = a.iter().chain(&b).chain(&c).copied().collect();
        assert_eq!(all.len(), 3000);
        // Below the ids drawn downwards before (from -(microseconds × 1024)).
        let before = -1_800_000_000_000_000 * 1024 / 1_000;
        assert!(all.iter().all(|id| *id < before), "{:?}", &a[..3]);
    }

    /// The engine's lanes take a key's lower id for its earlier event (a release racing a
    /// claim sends back only what is above a released id): drawn downwards, a key's later
    /// `outbox_emit` message overtook its earlier ones given back by the sink (`NotSent`).
    #[test]
    fn derived_ids_rise_in_stream_order_across_sessions() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut ids = DerivedIds::default();
        ids.start_session(start);
        let mut drawn: Vec<_> = (0..100).map(|n| ids.id(position(n))).collect();
        // The next session, its clock behind, then ahead.
        ids.start_session(start - Duration::from_secs(60));
        drawn.extend((100..200).map(|n| ids.id(position(n))));
        ids.start_session(start + Duration::from_secs(60));
        drawn.extend((200..300).map(|n| ids.id(position(n))));
        assert!(drawn.windows(2).all(|w| w[0] < w[1]), "{:?}", &drawn[..3]);
        assert_eq!(ids.id(position(5)), drawn[5], "an event held keeps its id");
    }

    /// Two releases reached the capture in the other order (the key's later event, sent
    /// back by the lanes, first): handed out so, the later one went out first.
    #[test]
    fn released_events_are_handed_out_again_in_stream_order() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let handed = claim(
            &mut state,
            vec![
                idless("k", 200, 0, Some(200)),
                idless("k", 200, 1, Some(201)),
                idless("k", 200, 2, Some(202)),
                committed(200, 3),
            ],
        );
        assert_eq!(handed.len(), 3);
        assert!(handed.windows(2).all(|w| w[0] < w[1]), "{handed:?}");
        state.redeliver_later([handed[2]]);
        state.redeliver_later([handed[0], handed[1]]);
        let mut out = Vec::new();
        state.redeliver_into(&mut out, 100);
        let again: Vec<SequenceId> = out.iter().map(Claimed::sequence_id).collect();
        assert_eq!(again, handed);
    }

    fn position(n: u64) -> EventPosition {
        EventPosition {
            commit_lsn: Lsn(1000 + n),
            ordinal: 0,
            xid: 0,
        }
    }

    /// The drain's end reached, then the session broke with event 2 released and not yet
    /// handed out again: the next session sends it again from the slot, and it was dropped
    /// (the drain's end was a latch), so `--drain` reported clean with it undelivered. Each
    /// session reads to the drain's end again, and hands out what comes before it.
    #[test]
    fn a_new_session_is_not_drained_until_it_reaches_the_drains_end_itself() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        state.accept(Item::DrainUntil(Lsn(400)));
        let mut outputs = two_transactions();
        outputs.push(Output::Idle { wal_end: Lsn(400) });
        assert_eq!(claim(&mut state, outputs), [1, 2]);
        assert!(state.drained);
        state.settle([1]);
        state.redeliver.push_back(2);
        state.accept(session(2, &[]));
        assert!(!state.drained, "event 2 comes again");
        assert_eq!(claim(&mut state, transactions(&[(2, "b", 300)])), [2]);
        assert!(claim(&mut state, vec![Output::Idle { wal_end: Lsn(400) }]).is_empty());
        assert!(state.drained);
        state.end_session();
        assert!(!state.drained, "what it forgot comes again");
    }

    /// An event settled in one session, the slot not yet confirmed past it, is read again
    /// by the next session: it went out again, after the later event of its key that the
    /// engine still held (the sink saw 1, 2, 1). It is settled unsent, and the slot may be
    /// confirmed past it; the later event, still unsettled, goes as before.
    #[test]
    fn an_event_settled_before_a_new_session_is_settled_unsent_when_read_again() {
        let (mut state, both) = event_1_settled_with_2_held();
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, both()), [2]);
        assert_eq!(state.acks.confirmable(), Lsn(210));
        // A third session, the slot still behind: the same.
        state.accept(session(3, &[]));
        assert_eq!(claim(&mut state, both()), [2]);
        state.settle([2]);
        assert_eq!(state.acks.confirmable(), Lsn(310));
        assert!(state.holdings.held.is_empty());
        // Another event at a settled event's position (a promoted standby's new timeline
        // writes other transactions where the old server wrote these): it goes out.
        state.accept(session_of_history(4, 1));
        assert_eq!(claim(&mut state, transactions(&[(7, "k", 200)])), [7]);
    }

    /// Hands out `n` single-event transactions, each of a key of its own, ids from `first`
    /// and positions from 1,000; returns their ids.
    fn hand_out_events_of_other_keys(
        state: &mut State,
        n: usize,
        first: SequenceId,
    ) -> Vec<SequenceId> {
        let keys: Vec<String> = (0..n).map(|i| format!("o{i}")).collect();
        let events: Vec<(SequenceId, &str, u64)> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| (first + i as SequenceId, key.as_str(), 1_000 + 10 * i as u64))
            .collect();
        let memory = MemoryBudget::new(usize::MAX);
        state.accept(Item::Outputs(charged(transactions(&events), &memory)));
        let mut handed = Vec::new();
        loop {
            let mut out = Vec::new();
            state.accept_outputs(&mut out, 1_000, 10_000);
            if out.is_empty() {
                return handed;
            }
            handed.extend(out.iter().map(Claimed::sequence_id));
        }
    }

    #[test]
    fn a_settled_event_is_remembered_until_the_server_was_told_past_it() {
        // Event 1 of key k is settled and 2 is still with the engine when more than two
        // cuts' worth of other keys' events settle, the server told nothing meanwhile (the
        // confirm mark not raised yet). A session broken then reads 1 again: settled
        // unsent, not sent after 2. (Cut by what the session could confirm, it was sent.)
        let (mut state, both) = event_1_settled_with_2_held();
        let n = 2 * SettledPositions::CUT_EVERY + 1;
        let handed = hand_out_events_of_other_keys(&mut state, n, 10);
        assert_eq!(handed.len(), n);
        state.settle(handed);
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, both()), [2], "1 settled unsent");
    }

    /// Event 1 of key k is settled, the server told past it, and the settled positions let
    /// go of it; 2 is still with the engine. The server crashes: the slot's confirmed
    /// position reached its disk only at the last checkpoint, before 1, and the next
    /// session reads 1 again. Sent, it went out after 2.
    #[test]
    fn an_event_read_again_after_a_servers_crash_brought_its_slot_back_is_settled_unsent() {
        let (mut state, both) = event_1_settled_and_let_go_of_with_2_held();
        assert!(!state
            .settled
            .settled
            .keys()
            .any(|p| p.commit_lsn == Lsn(200)));
        // The slot back at START (100), behind what the server was told; the new session's
        // stream reports its start before the claims accept the session, as the reader's
        // first tick may.
        state.told.set(START);
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, both()), [2], "1 settled unsent");
    }

    /// The same, on a server of another history (a promoted standby, whose slot is behind):
    /// positions there are other transactions, and nothing read is taken for settled. Nor
    /// does the reader confirm what the last history's events allowed.
    #[test]
    fn events_read_on_another_history_are_not_taken_for_settled_ones() {
        let (mut state, _) = event_1_settled_and_let_go_of_with_2_held();
        let before = state.confirmable();
        assert!(before.within(0) > START);
        state.accept(session_of_history(2, 1));
        assert_eq!(claim(&mut state, transactions(&[(3, "k", 200)])), [3]);
        assert_eq!(before.within(1), Lsn::default(), "not of this history");
        assert!(state.confirmable() > before, "this history's come first");
    }

    /// A message of the last history still with the engine, and another history's at its
    /// very position: one id for both, and the engine took the new one for a renewed lease
    /// of the old, never sending it.
    #[test]
    fn a_message_of_another_history_at_a_held_ones_position_has_an_id_of_its_own() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let message = || vec![idless("k", 200, 0, Some(190)), committed(200, 1)];
        let held = claim(&mut state, message());
        state.accept(session_of_history(2, 1));
        let other = claim(&mut state, message());
        assert_eq!((held.len(), other.len()), (1, 1));
        assert_ne!(held, other);
    }

    /// A message of the last history settles after another history began, and another
    /// message of this one stands at its very position, with the same (derived) event id:
    /// the settle is no news of this history's, and the new message goes out when a new
    /// session reads it again. (Recorded as settled, it was settled unsent.)
    #[test]
    fn a_settle_of_another_historys_event_settles_nothing_of_this_one() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let message = || vec![idless("k", 200, 0, Some(190)), committed(200, 1)];
        let old = claim(&mut state, message());
        state.accept(session_of_history(2, 1));
        state.settle(old);
        state.accept(session_of_history(3, 1));
        assert_eq!(
            claim(&mut state, message()).len(),
            1,
            "sent, not settled unsent"
        );
    }

    /// Gives the event `output` carries the event id `n`.
    fn with_event_id(output: &mut Output, n: u128) {
        if let Output::Event {
            event: Ok(event), ..
        } = output
        {
            event.event.event_id = uuid::Uuid::from_u128(n);
        }
    }

    /// A row id still held for one event, taken by another event (a promoted standby that
    /// had not received the sequence's last advance, or `TRUNCATE … RESTART IDENTITY` while
    /// the first was with the sink): the second gets an engine id of its own, keeping its
    /// row's, so that the first one's ack neither settles it nor lets the slot pass it.
    #[test]
    fn an_event_whose_row_id_a_held_event_of_another_has_gets_an_id_of_its_own() {
        for (history, commit) in [(1, 150), (0, 300)] {
            let mut state = State::new();
            state.accept(session_of_history(1, 0));
            assert_eq!(claim(&mut state, transactions(&[(34, "a", 200)])), [34]);
            if history != 0 {
                state.accept(session_of_history(2, history));
            }
            let mut reused = transactions(&[(34, "b", commit)]);
            with_event_id(&mut reused[0], 99);
            let handed = claim(&mut state, reused);
            assert_eq!(handed.len(), 1);
            assert_ne!(handed[0], 34, "history {history}");
            assert_eq!(state.held_row(handed[0]).map(|row| row.id), Some(34));
            state.settle([34]);
            let confirmable = state.confirmable().within(state.history);
            assert!(
                confirmable <= Lsn(commit),
                "history {history}: {confirmable:?}"
            );
            state.settle(handed);
            assert!(state.confirmable().within(state.history) > Lsn(commit));
        }
    }

    /// Event 1 of key k given back unsent (a sink's `NotSent`), then a new session, then
    /// event 2 given back (its release waited behind a claim): 2 went out first, then 1 as
    /// the new session read it again. An earlier session's event released is forgotten,
    /// and the new session hands both out in order.
    #[test]
    fn an_event_released_after_a_new_session_began_waits_for_its_reading_again() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let both = || transactions(&[(1, "k", 200), (2, "k", 300)]);
        assert_eq!(claim(&mut state, both()), [1, 2]);
        assert!(state.released(vec![1]).is_empty());
        state.accept(session(2, &[]));
        assert!(state.released(vec![2]).is_empty());
        // A claim: released events first, then the stream.
        let mut out = Vec::new();
        state.redeliver_into(&mut out, 100);
        state.accept(Item::Outputs(charged(
            both(),
            &MemoryBudget::new(usize::MAX),
        )));
        state.accept_outputs(&mut out, 100, 1_000);
        let handed: Vec<SequenceId> = out.iter().map(Claimed::sequence_id).collect();
        assert_eq!(handed, [1, 2]);
    }

    /// An event that drew an id of its own (its row id a held event of another had) and is
    /// read again by a new session after that other one settled: it keeps the id it was
    /// handed out with, so that the engine takes it for a copy of what it holds.
    #[test]
    fn an_event_read_again_keeps_the_id_of_its_own_it_drew() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, transactions(&[(34, "a", 200)])), [34]);
        let reused = || {
            let mut reused = transactions(&[(34, "b", 300)]);
            with_event_id(&mut reused[0], 99);
            reused
        };
        let handed = claim(&mut state, reused());
        assert_ne!(handed, [34]);
        state.settle([34]);
        state.accept(session(2, &[]));
        assert_eq!(claim(&mut state, reused()), handed);
    }

    /// Events settled past what the server was told (the confirm mark is raised a second
    /// apart), then the WAL rolled back past the last raise (a disk snapshot taken after
    /// it): a new event at a position the relay had settled is handed out. Everything
    /// before what the server was told is settled unsent, and past it, events settled by
    /// position and event id.
    #[test]
    fn a_new_event_past_what_the_server_was_told_is_not_taken_for_settled() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let both = || transactions(&[(1, "k", 200), (2, "k", 300)]);
        assert_eq!(claim(&mut state, both()), [1, 2]);
        state.settle([1]);
        state.told.set(state.acks.confirmable());
        state.settle([2]);
        state.accept(session(2, &[]));
        let mut other = transactions(&[(3, "k", 300)]);
        with_event_id(&mut other[0], 99);
        assert_eq!(claim(&mut state, other), [3]);
        assert!(claim(&mut state, both()).is_empty(), "both settled unsent");
    }

    /// A message of an earlier history settled after another history's message at its
    /// position was handed out: the later one keeps its id, so that reading it again (a
    /// session break) is taken for what it is, a copy of an event the engine holds.
    #[test]
    fn a_settled_message_of_an_earlier_history_leaves_the_id_at_its_position_alone() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let message = |n| {
            let mut message = vec![idless("k", 200, 0, Some(190)), committed(200, 1)];
            with_event_id(&mut message[0], n);
            message
        };
        let held = claim(&mut state, message(1));
        state.accept(session_of_history(2, 1));
        let other = claim(&mut state, message(2));
        state.settle(held);
        state.accept(session_of_history(3, 1));
        assert_eq!(claim(&mut state, message(2)), other);
    }

    /// Events 1 and 2 of key k handed out (the outputs that carry them, again), 1 settled
    /// and the server told past it, and the settled positions let go of it; 2 still held.
    fn event_1_settled_and_let_go_of_with_2_held() -> (State, fn() -> Vec<Output>) {
        let (mut state, both) = event_1_settled_with_2_held();
        tell_the_server_past_many_other_settles(&mut state);
        (state, both)
    }

    /// Events 1 (commit 200) and 2 (commit 300) of key k handed out in session 1 (the
    /// outputs that carry them, again), and 1 settled.
    fn event_1_settled_with_2_held() -> (State, fn() -> Vec<Output>) {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let both = || transactions(&[(1, "k", 200), (2, "k", 300)]);
        assert_eq!(claim(&mut state, both()), [1, 2]);
        state.settle([1]);
        (state, both)
    }

    /// Settles events of other keys, telling the server what may be confirmed after each,
    /// until the settled positions let go of what came before.
    fn tell_the_server_past_many_other_settles(state: &mut State) {
        state.told.set(state.acks.confirmable());
        let handed = hand_out_events_of_other_keys(state, 2 * SettledPositions::CUT_EVERY + 1, 10);
        for id in handed {
            state.settle([id]);
            state.told.set(state.acks.confirmable());
        }
    }

    #[test]
    fn settled_positions_are_let_go_once_the_server_was_told_past_them() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let handed = hand_out_events_of_other_keys(&mut state, 5 * SettledPositions::CUT_EVERY, 1);
        // Told as the slot is confirmed: past every event settled so far.
        for id in handed {
            state.settle([id]);
            state.told.set(state.acks.confirmable());
        }
        assert!(
            state.settled.settled.len() <= 2 * SettledPositions::CUT_EVERY,
            "{} kept",
            state.settled.settled.len()
        );
    }

    #[test]
    fn the_slot_is_never_confirmed_past_an_unsettled_event() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
        state.settle([2]);
        assert_eq!(state.acks.confirmable(), START, "event 1 is unsettled");
        state.settle([1]);
        assert_eq!(state.acks.confirmable(), Lsn(310));
        assert!(state.holdings.held.is_empty());
    }

    #[test]
    fn a_key_with_parked_events_has_its_later_ones_parked_behind() {
        let mut state = State::new();
        state.accept(session(1, &["a"]));
        assert_eq!(claim(&mut state, two_transactions()), [2], "b only");
        let parks: Vec<SequenceId> = state.holdings.take_parks().iter().map(|p| p.id).collect();
        assert_eq!(parks, [1]);
    }

    /// An event that did not decode is handed out to be dead-lettered even while its key
    /// waits behind parked events (it cannot be parked: the parked table holds events), and
    /// its position settles with its dead letter. Released behind the key as nothing, it
    /// once settled with no dead letter at all.
    #[test]
    fn an_undecodable_event_of_a_waiting_key_is_handed_out_to_be_dead_lettered() {
        let mut state = State::new();
        state.accept(session(1, &["a"]));
        let undecodable = Output::Event {
            position: EventPosition {
                commit_lsn: Lsn(200),
                ordinal: 0,
                xid: 0,
            },
            event: Err(Box::new(Undecodable {
                reason: "not the documented JSON object".into(),
                source: EventSource::Table {
                    sequence_id: Some(1),
                },
                event_id: None,
                destination: Some("orders".into()),
                partition_key: Some("a".into()),
                raw: "{".into(),
            })),
        };
        state.accept(Item::Outputs(charged(
            vec![undecodable, committed(200, 1)],
            &MemoryBudget::new(usize::MAX),
        )));
        let mut out = Vec::new();
        state.accept_outputs(&mut out, 100, 1_000);
        assert!(
            matches!(out.as_slice(), [Claimed::Undecodable { sequence_id: 1, ordering_key, .. }] if ordering_key == "a"),
            "{out:?}"
        );
        assert!(state.holdings.take_parks().is_empty(), "not parked");
        state.settle([1]);
        assert_eq!(state.acks.confirmable(), Lsn(210));
    }

    /// An event due later (`available_at` ahead) is parked with its time, not handed out,
    /// and keys behind it wait; another key goes out.
    #[test]
    fn an_event_due_later_is_parked_with_its_time() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let due = SystemTime::now() + Duration::from_secs(3600);
        let mut outputs = transactions(&[(1, "a", 200), (2, "a", 300), (3, "b", 400)]);
        if let Output::Event {
            event: Ok(event), ..
        } = &mut outputs[0]
        {
            event.available_at = Some(due);
        }
        assert_eq!(claim(&mut state, outputs), [3], "b only");
        let parks = state.holdings.take_parks();
        let parked: Vec<(SequenceId, Option<SystemTime>)> =
            parks.iter().map(|p| (p.id, p.not_before)).collect();
        assert_eq!(parked, [(1, Some(due)), (2, None)]);
    }

    #[test]
    fn a_key_whose_park_was_refused_waits_its_turn_while_other_keys_are_parked() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let outputs = transactions(&[(1, "a", 200), (2, "b", 300), (3, "a", 400)]);
        assert_eq!(claim(&mut state, outputs), [1, 2, 3]);
        state
            .holdings
            .queue_parks([1, 2, 3].map(Park::behind_its_key));
        let now = std::time::Instant::now();
        let parks = state.holdings.take_parks();
        let refused = state.holdings.refuse_park(parks[0].id, now);
        assert_eq!(refused, Some(("a".to_string(), Duration::from_secs(1))));
        let ids = |parks: &[Park]| parks.iter().map(|p| p.id).collect::<Vec<_>>();
        let (now_parks, aside) = state.holdings.set_aside_refused_parks(parks, now);
        assert_eq!(ids(&now_parks), [2], "b is parked");
        assert_eq!(
            ids(&aside),
            [1, 3],
            "a's later event waits behind the refused one"
        );
        let later = now + Duration::from_secs(1);
        let (now_parks, aside) = state.holdings.set_aside_refused_parks(aside, later);
        assert_eq!(ids(&now_parks), [1, 3], "tried again once its time came");
        assert!(aside.is_empty());
        // Refused again: twice as long.
        let refused = state.holdings.refuse_park(1, later);
        assert_eq!(refused, Some(("a".to_string(), Duration::from_secs(2))));
        let (now_parks, _) = state.holdings.set_aside_refused_parks(now_parks, later);
        assert!(now_parks.is_empty());
        // Parked at last: its next refusal waits a second again.
        state.holdings.parked_after_refusal([1]);
        assert!(state.holdings.refused_parks.is_empty());
    }

    #[test]
    fn a_release_waits_to_be_parked_while_an_earlier_event_of_its_key_is_with_the_engine() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        let outputs = transactions(&[(1, "a", 200), (2, "a", 300)]);
        assert_eq!(claim(&mut state, outputs), [1, 2]);
        // 2 is released behind 1, which the engine still has: 1 may come back as a retry,
        // and must then be parked first.
        state.holdings.queue_parks([Park::behind_its_key(2)]);
        assert!(state.holdings.take_parks().is_empty());
        state.holdings.queue_parks([Park::behind_its_key(1)]);
        let parks: Vec<SequenceId> = state.holdings.take_parks().iter().map(|p| p.id).collect();
        assert_eq!(parks, [1, 2], "commit order");
    }

    #[test]
    fn an_ack_racing_a_new_sessions_re_handout_of_its_event_leaves_nothing_held() {
        // The engine acks event 1 of session 1 while session 2 sends it again: whichever
        // comes first, the slot moves past it and nothing stays held.
        for ack_first in [false, true] {
            let mut state = State::new();
            state.accept(session(1, &[]));
            assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
            state.accept(session(2, &[]));
            if ack_first {
                // The old session's entries go; their positions are not the new session's
                // yet. Read again, they are settled unsent.
                state.settle([1, 2]);
                assert_eq!(state.acks.confirmable(), START);
                assert!(
                    claim(&mut state, two_transactions()).is_empty(),
                    "sent again"
                );
                assert_eq!(state.acks.confirmable(), Lsn(310));
            } else {
                assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
            }
            state.settle([1, 2]);
            assert_eq!(state.acks.confirmable(), Lsn(310), "ack first: {ack_first}");
            assert!(state.holdings.held.is_empty(), "ack first: {ack_first}");
            // The engine's second settle of the same ids finds nothing, and harms nothing.
            state.settle([1, 2]);
            assert_eq!(state.acks.confirmable(), Lsn(310));
        }
    }

    /// The steps of [`interleavings_of_an_ack_and_new_sessions_copies`].
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Step {
        /// The engine's ack of event 1 leads a group commit that deletes the rows of 1 and
        /// of 2 (whose ack joined it), settles them, and returns.
        GroupDelete,
        /// The ack of 2 returns.
        FollowerReturns,
        /// The replication session breaks, and session `n` starts from the slot.
        NewSession(u64),
        /// A claim takes what session `n` sends again: both events.
        ClaimAgain(u64),
        /// A claim's retry finds row 2, which was not visible at the group's delete, deletes
        /// it and settles its event.
        RetryRow,
    }

    /// Every order of `steps` that keeps the order of each of `chains`.
    fn orders(steps: &[Step], chains: &[&[Step]]) -> Vec<Vec<Step>> {
        fn extend(
            left: &[Step],
            chains: &[&[Step]],
            order: &mut Vec<Step>,
            out: &mut Vec<Vec<Step>>,
        ) {
            if left.is_empty() {
                out.push(order.clone());
            }
            for (i, step) in left.iter().enumerate() {
                let after_its_predecessors = chains.iter().all(|chain| {
                    chain
                        .iter()
                        .position(|s| s == step)
                        .is_none_or(|at| chain[..at].iter().all(|before| order.contains(before)))
                });
                if after_its_predecessors {
                    let mut rest = left.to_vec();
                    rest.remove(i);
                    order.push(*step);
                    extend(&rest, chains, order, out);
                    order.pop();
                }
            }
        }
        let mut out = Vec::new();
        extend(steps, chains, &mut Vec::new(), &mut out);
        out
    }

    /// The engine acks events 1 and 2 in one group commit while sessions 2 and 3 send both
    /// again, in every order the code allows, with row 2 visible at the delete or not (then
    /// a claim's retry deletes it later). The engine is modelled as it behaves: it drops a
    /// copy of an event it holds (to it, an expired lease renewed), forgets an event as the
    /// ack's call returns, and delivers and acks a copy it takes. In every order nothing
    /// stays held and the slot moves past both. Before, a copy handed out after the group's
    /// delete settled the follower's event, and before the follower's call returned, was
    /// held, dropped by the engine, never settled, and the slot stopped for good.
    #[test]
    fn interleavings_of_an_ack_and_new_sessions_copies() {
        use Step::*;
        let sessions: &[Step] = &[NewSession(2), ClaimAgain(2), NewSession(3), ClaimAgain(3)];
        let mut runs = 0;
        for row_visible in [true, false] {
            let mut steps = vec![GroupDelete, FollowerReturns];
            steps.extend(sessions);
            let mut chains: Vec<&[Step]> = vec![sessions, &[GroupDelete, FollowerReturns]];
            if !row_visible {
                steps.push(RetryRow);
                chains.push(&[GroupDelete, RetryRow]);
            }
            for order in orders(&steps, &chains) {
                runs += 1;
                let mut state = State::new();
                state.accept(session(1, &[]));
                let mut with_engine: HashSet<SequenceId> =
                    claim(&mut state, two_transactions()).into_iter().collect();
                let (began_1, began_2) = (
                    state.holdings.sessions_of(&[1]),
                    state.holdings.sessions_of(&[2]),
                );
                let mut taken_again = Vec::new();
                for step in &order {
                    match *step {
                        GroupDelete => {
                            if row_visible {
                                state.settle([1, 2]);
                            } else {
                                state.settle([1]);
                                state.undeleted.push((2, std::time::Instant::now()));
                            }
                            state.settle_copies(&[1], &began_1);
                            with_engine.remove(&1);
                        }
                        FollowerReturns => {
                            state.settle_copies(&[2], &began_2);
                            with_engine.remove(&2);
                        }
                        NewSession(n) => state.accept(session(n, &[])),
                        ClaimAgain(_) => {
                            // An event settled before is settled unsent; the others go.
                            let sent = claim(&mut state, two_transactions());
                            assert!(sent.iter().all(|id| [1, 2].contains(id)), "{order:?}");
                            taken_again
                                .extend(sent.into_iter().filter(|id| with_engine.insert(*id)));
                        }
                        RetryRow => {
                            let waiting: Vec<_> =
                                state.undeleted.drain(..).map(|(id, _)| id).collect();
                            state.settle(waiting);
                        }
                    }
                }
                // The engine delivers what it took again and acks it.
                for id in taken_again {
                    let began = state.holdings.sessions_of(&[id]);
                    state.settle([id]);
                    state.settle_copies(&[id], &began);
                }
                let held: Vec<_> = state.holdings.held.keys().collect();
                assert!(
                    held.is_empty(),
                    "{order:?}, row visible: {row_visible}: {held:?} held"
                );
                assert_eq!(state.acks.confirmable(), Lsn(310), "{order:?}");
            }
        }
        assert_eq!(runs, 15 + 70, "every order");
    }

    #[test]
    fn a_new_session_drops_the_old_ones_parks_and_redeliveries() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
        state.redeliver.push_back(1);
        state.holdings.queue_parks([Park::behind_its_key(2)]);
        state.accept(session(2, &[]));
        assert!(state.redeliver.is_empty() && state.holdings.to_park.is_empty());
        assert!(
            state.holdings.held.is_empty(),
            "the new session sends them again"
        );
        assert_eq!(state.owner, "session 2");
    }

    #[test]
    fn every_way_of_letting_go_of_an_event_gives_its_memory_back() {
        let memory = MemoryBudget::new(usize::MAX);
        let mut state = State::new();
        state.accept(session(1, &[]));
        let three = transactions(&[(1, "a", 200), (2, "b", 300), (3, "c", 400)]);
        assert_eq!(claim_charged(&mut state, three, &memory), [1, 2, 3]);
        let each = memory.held() / 3;
        assert!(each > 0);
        state.settle([1]);
        assert_eq!(memory.held(), 2 * each, "settled");
        state.redeliver.push_back(3);
        state.accept(session(2, &[]));
        assert_eq!(memory.held(), each, "the new session sends it again");
        // Event 1, settled, is read again and settled unsent; event 2's entry of session 1
        // is replaced by the new one.
        assert_eq!(claim_charged(&mut state, two_transactions(), &memory), [2]);
        assert_eq!(memory.held(), each);
        let third = transactions(&[(3, "c", 400)]);
        assert_eq!(claim_charged(&mut state, third, &memory), [3]);
        assert_eq!(memory.held(), 2 * each);
        // Read, not yet accepted by a claim, when the session ends.
        let unaccepted = vec![event(4, "d", 500, 0), committed(500, 1)];
        state.accept(Item::Outputs(charged(unaccepted, &memory)));
        assert_eq!(memory.held(), 3 * each);
        state.leave_to_slot_holder([3]);
        assert_eq!(
            memory.held(),
            each,
            "left to the slot's new holder, with what the session had not handed out"
        );
        state.settle([2]);
        assert_eq!(memory.held(), 0);
    }

    #[test]
    fn the_stream_copy_of_an_adopted_row_being_delivered_settles_at_once() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        state.holdings.held.insert(
            1,
            Held::Parked {
                key: "a".into(),
                event_id: Some(uuid::Uuid::from_u128(1)),
                _memory: Charge::none(),
            },
        );
        assert!(claim(&mut state, vec![event(1, "a", 200, 0), committed(200, 1)]).is_empty());
        assert_eq!(state.acks.confirmable(), Lsn(210));
    }

    /// A parked row being delivered whose id a stream event of another has (ids taken
    /// again after `TRUNCATE … RESTART IDENTITY`): the stream event is no copy of it, and
    /// goes out under an id of its own, where before it was settled unsent.
    #[test]
    fn a_stream_event_whose_id_a_parked_row_of_another_event_has_goes_out() {
        // A parked row that did not decode cannot be told to be the same event: the stream
        // event goes out too (a duplicate at worst, where settled unsent it could be lost).
        for parked in [Some(uuid::Uuid::from_u128(77)), None] {
            let mut state = State::new();
            state.accept(session(1, &[]));
            state.holdings.held.insert(
                1,
                Held::Parked {
                    key: "a".into(),
                    event_id: parked,
                    _memory: Charge::none(),
                },
            );
            let handed = claim(&mut state, vec![event(1, "a", 200, 0), committed(200, 1)]);
            assert_eq!(handed.len(), 1, "{parked:?}");
            assert_ne!(handed[0], 1);
            assert_eq!(state.held_row(handed[0]).map(|row| row.id), Some(1));
            assert!(state.acks.confirmable() < Lsn(200));
        }
    }

    /// The million-event soak's inversions: a relay's session broke at a PostgreSQL
    /// restart, and another relay took the slot. The first relay, a standby now, still
    /// handed out what its old session had read: event 1 of key `a` went to be parked and
    /// was left to the new holder (the park found the slot streaming to another session),
    /// key `a` was let through again, and event 2 of `a` went out, ahead of event 1.
    #[test]
    fn a_session_that_left_an_event_to_the_slots_new_holder_hands_out_nothing_more() {
        let mut state = State::new();
        state.accept(session(1, &["a"]));
        let read = transactions(&[(1, "a", 200), (2, "a", 300), (3, "b", 400)]);
        state.accept(Item::Outputs(charged(read, &MemoryBudget::new(usize::MAX))));
        let mut out = Vec::new();
        state.accept_outputs(&mut out, 1, 1);
        assert!(out.is_empty(), "1 waits behind its parked key");
        let parks: Vec<SequenceId> = state.holdings.take_parks().iter().map(|p| p.id).collect();
        assert_eq!(parks, [1]);
        state.leave_to_slot_holder(parks);
        // The parked table has nothing of `a` any more: the key is let through.
        state.holdings.unpark(vec!["a".into()], &HashSet::new());
        state.accept_outputs(&mut out, 100, 1_000);
        state.redeliver.push_back(3);
        state.redeliver_into(&mut out, 100);
        assert!(
            out.is_empty(),
            "handed out after the session ended: {out:?}"
        );
        assert!(state.holdings.held.is_empty());
        // The live session is another relay's: nothing this relay reads is handed out.
        let mut queued = VecDeque::from([Item::Outputs(Vec::new())]);
        assert!(!state.follow(0, || queued.pop_front()));
        assert_eq!(state.acks.confirmable(), START, "confirmed past nothing");
    }

    /// A claim races the reader: the session ends (the reader sets no live session) while
    /// outputs it read are still queued, before the next session's announcement.
    #[test]
    fn a_claim_racing_a_session_end_drops_what_that_session_read_until_the_next_announcement() {
        let mut state = State::new();
        let memory = MemoryBudget::new(usize::MAX);
        let mut queued = VecDeque::from([
            session(1, &[]),
            Item::Outputs(charged(two_transactions(), &memory)),
        ]);
        assert!(
            state.follow(1, || queued.pop_front()),
            "session 1 announced, live"
        );
        // The claim takes the outputs, and the session ends before it accepts them.
        state.accept(queued.pop_front().unwrap());
        assert!(!state.follow(0, || queued.pop_front()));
        let mut out = Vec::new();
        assert_eq!(state.accept_outputs(&mut out, 100, 1_000), 0);
        assert!(out.is_empty() && state.unaccepted.is_empty());
        assert_eq!(memory.held(), 0, "dropped outputs give their memory back");
        // Session 2 is announced (and live) with what it reads behind it: handed out.
        queued.extend([
            session(2, &[]),
            Item::Outputs(charged(two_transactions(), &memory)),
        ]);
        assert!(state.follow(2, || queued.pop_front()));
        state.accept(queued.pop_front().unwrap());
        state.accept_outputs(&mut out, 100, 1_000);
        let ids: Vec<SequenceId> = out.iter().map(Claimed::sequence_id).collect();
        assert_eq!(ids, [1, 2]);
        // An announcement of a session already over is passed by, with what it read.
        queued.extend([
            session(3, &[]),
            Item::Outputs(charged(two_transactions(), &memory)),
            session(4, &[]),
        ]);
        assert!(state.follow(4, || queued.pop_front()));
        assert_eq!(state.followed.session, 4);
        assert!(state.unaccepted.is_empty(), "session 3's outputs dropped");
    }

    /// A park or dead letter of session 1, in flight while a claim (waiting out the
    /// reconnection, without `parking`) followed session 2, fails its fence: it ended
    /// session 2, and nothing more was handed out until a restart. It ends only its own.
    #[test]
    fn a_fence_failure_of_an_earlier_session_leaves_the_new_one_streaming() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
        state.accept(session(2, &[]));
        assert!(
            !state.fenced_out(1, [1]),
            "session 1's write, under session 2"
        );
        assert!(!state.followed.ended, "session 2 goes on");
        assert_eq!(
            claim(&mut state, two_transactions()),
            [1, 2],
            "session 2 hands its events out"
        );
        state.requeue_parks(1, vec![Park::behind_its_key(1)]);
        assert!(
            state.holdings.to_park.is_empty(),
            "not queued into session 2"
        );
        assert!(state.fenced_out(2, [1, 2]), "session 2's own ends it");
        assert!(state.followed.ended);
    }

    #[test]
    fn a_slot_taken_over_leaves_its_events_to_the_new_holder() {
        let mut state = State::new();
        state.accept(session(1, &[]));
        assert_eq!(claim(&mut state, two_transactions()), [1, 2]);
        state.leave_to_slot_holder([1, 2]);
        assert!(state.holdings.held.is_empty());
        assert_eq!(state.acks.confirmable(), START, "confirmed past nothing");
    }
}
