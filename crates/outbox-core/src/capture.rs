//! What a change-stream capture (WAL's, binlog's) holds between its stream and the engine,
//! and the rules both follow: events handed out are held until the engine settles them, a
//! key with parked events has its later ones parked behind them, and parks are written in
//! stream order per key. Pure state: each capture's own `State` wraps [`Holdings`] with its
//! stream's rules (what the WAL slot may be confirmed at, which binlog positions may be
//! stored), and its store runs the statements and then tells the state what they did.
//!
//! The engine's lanes send back a claimed row only past a *lower* id of its key still being
//! released (`Lanes::accept`), so a capture's ids rise in stream order per key: a WAL
//! message's and a BLACKHOLE row's are drawn upwards as they are read, a parked row's rise
//! with the parked table's. A table row's is its insert-order `sequence_id`, which is commit
//! order for a key's events unless two transactions wrote the key at once; and a key whose
//! events come both as table rows and as `outbox_emit` messages has ids of two ranges
//! (messages' far below rows'), so a message may overtake a row of its key given back
//! unsent while the message was being claimed. Releases come
//! behind a retry (which parks its row, so the key waits), when stopping, and when a sink
//! gives a key's head back unsent (`NotSent`): then a claim racing the release may hand out
//! a later event of the key, which the lanes send back, and the released events come out
//! again in stream order. A released stream event of a waiting key is parked, not handed
//! out again, and a key hands out stream events again only once none of its parked rows is
//! pending, released ones included.

mod deletes;
mod stall;

pub use deletes::{delete_group_enough, GroupDeletes, DELETE_GROUP_ENOUGH, DELETE_SPACING};
pub use stall::{SettleWatch, Stalled, SETTLE_PATIENCE};

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::id_hash::IdMap;
use crate::memory::{event_bytes, Charge, MemoryBudget, EVENT_OVERHEAD};
use crate::store::{Backlog, ClaimRequest, StoreResult};
use crate::{Claimed, Event, OutboxStore, SequenceId};

/// What a parked row is taken to cost before any event was seen: a large one, so that a
/// relay whose first work is a backlog of 1 MiB events adopted into the parked table claims
/// a budget's worth of them, not a batch (1,000 MiB). Small events lift the limit from the
/// second claim on.
const UNSEEN_EVENT_BYTES: usize = 1024 * 1024;

/// A stream event held by a capture: the key it is ordered by, and its place in the stream.
pub trait StreamEvent {
    /// Where the event stands in the stream (WAL: commit position and ordinal; binlog:
    /// session and ordinal of its first reading). Parks of one key are written in this
    /// order, so places must compare in commit order across sessions too: an event read
    /// again by a later session, while its first reading is still held, keeps that
    /// reading's place.
    type Place: Ord + Copy;

    fn key(&self) -> &str;

    fn place(&self) -> Self::Place;

    /// When the application wrote it, if it decoded.
    fn written_at(&self) -> Option<SystemTime>;

    /// The stream session that read it (sessions count up from 1).
    fn session(&self) -> u64;
}

/// A held stream event queued to be parked, by its engine id.
pub trait QueuedPark {
    fn id(&self) -> SequenceId;
    /// A later outcome for the same event, queued while this one waits to be written (a
    /// copy read again queued behind its key, then the engine's own retry or dead letter
    /// of it): the one park written carries both, so that neither is lost.
    fn absorb(&mut self, later: Self);
}

/// A held event's content: an event, or a row that did not decode (with its capture's
/// account of why).
pub enum Body<U> {
    Event(Arc<Event>),
    Undecodable(Box<U>),
}

impl<U> Body<U> {
    /// When the application wrote it, if it decoded.
    pub fn written_at(&self) -> Option<SystemTime> {
        match self {
            Body::Event(e) => Some(e.created_at),
            Body::Undecodable(_) => None,
        }
    }
}

pub enum Held<S> {
    /// An event read from the stream.
    Stream(Box<S>),
    /// A row of the parked table, by its key, and its event's id (none for a row that did
    /// not decode): a stream event with its id is its copy only if it is that event.
    Parked {
        key: String,
        event_id: Option<uuid::Uuid>,
        _memory: Charge,
    },
}

/// What the engine settles, by where it is.
pub struct Split<T> {
    /// Rows of the parked table, with their keys in `keys`.
    pub parked: Vec<T>,
    pub keys: Vec<String>,
    /// Held stream events.
    pub stream: Vec<T>,
}

/// The number of the session that streams now, 0 while none does. The reader sets it
/// before it announces a session, and back to 0 the moment the session ends, so claims stop
/// handing out its events then, not when they next see an announcement.
#[derive(Default)]
pub struct LiveSession(AtomicU64);

impl LiveSession {
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    pub fn set(&self, session: u64) {
        self.0.store(session, Ordering::SeqCst);
    }
}

/// What a capture holds: events out with the engine or queued to park, rows of the parked
/// table out with the engine, and the keys that wait behind parked events.
pub struct Holdings<S, P> {
    /// By engine id: every stream event and parked row not yet settled.
    pub held: IdMap<Held<S>>,
    /// Keys with events in the parked table or queued to park: their later events are
    /// parked behind them, never handed out ahead.
    pub parked_keys: HashSet<String>,
    /// Keys to check against the parked table at the next claim.
    pub recheck: Vec<String>,
    /// Held stream events to park; written by the next park statement.
    pub to_park: Vec<P>,
    /// Keys whose park the database refused when written alone: their events wait (later
    /// ones of the key behind them) while the other keys' parks are written. One event's
    /// park refused for a reason no check foresaw (a trigger, a constraint) failed every
    /// claim before, and no key moved.
    pub refused_parks: HashMap<String, RefusedPark>,
}

/// A key's park the database refused: tried again after `until`, each refusal doubling
/// the wait ([`REFUSED_PARK_FIRST_WAIT`] to [`REFUSED_PARK_LONGEST_WAIT`]), so that a
/// database refusing every park is not sent one per key per second.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefusedPark {
    pub until: Instant,
    pub wait: Duration,
}

pub const REFUSED_PARK_FIRST_WAIT: Duration = Duration::from_secs(1);
pub const REFUSED_PARK_LONGEST_WAIT: Duration = Duration::from_secs(60);

impl<S, P> Default for Holdings<S, P> {
    fn default() -> Self {
        Holdings {
            held: IdMap::default(),
            parked_keys: HashSet::new(),
            recheck: Vec::new(),
            to_park: Vec::new(),
            refused_parks: HashMap::new(),
        }
    }
}

impl<S: StreamEvent, P: QueuedPark> Holdings<S, P> {
    /// A session starts with the keys the parked table has. Parks this process made while
    /// it started may be missing from them: those keys are kept, and checked against the
    /// table at the next claim ([`Holdings::recheck`]).
    pub fn load_parked_keys(&mut self, loaded: Vec<String>) {
        let loaded: HashSet<String> = loaded.into_iter().collect();
        self.recheck = self.parked_keys.difference(&loaded).cloned().collect();
        self.parked_keys.extend(loaded);
    }

    /// Whether `key` has parked events, so that its next one must be parked behind them.
    pub fn waits(&self, key: &str) -> bool {
        self.parked_keys.contains(key)
    }

    /// Queues a held event to park behind the other events of its `key`.
    pub fn park_behind(&mut self, key: &str, park: P) {
        mark_waiting(&mut self.parked_keys, key);
        self.to_park.push(park);
    }

    /// Queues held stream events for the next park statement, each once; an id held no
    /// more is passed by. Returns how many of `parks` are queued (those queued already
    /// included): what a retry or dead letter of them reports as done.
    pub fn queue_parks(&mut self, parks: impl IntoIterator<Item = P>) -> usize {
        let mut queued = 0;
        for park in parks {
            let Some(Held::Stream(event)) = self.held.get(&park.id()) else {
                continue;
            };
            queued += 1;
            match self.to_park.iter_mut().find(|p| p.id() == park.id()) {
                Some(queued) => queued.absorb(park),
                None => {
                    mark_waiting(&mut self.parked_keys, event.key());
                    self.to_park.push(park);
                }
            }
        }
        queued
    }

    /// The parks to write now, in stream order; those that must wait stay queued.
    ///
    /// Parked rows are claimed in parking order, so per key it must be stream order: an
    /// event the engine still has (in a lane or publishing) may yet come back to be parked,
    /// as a retry or a release, and every later event of its key waits for it. (Released
    /// and retried events would otherwise be parked after later events of their key that
    /// the stream handed over meanwhile, and be delivered after them.)
    pub fn take_parks(&mut self) -> Vec<P> {
        // Every claim asks: most find nothing to park, and must not pay a pass over what is
        // held.
        if self.to_park.is_empty() {
            return Vec::new();
        }
        let mut to_park = std::mem::take(&mut self.to_park);
        let place = |id: SequenceId| match self.held.get(&id) {
            Some(Held::Stream(event)) => Some(event.place()),
            _ => None,
        };
        to_park.sort_by_key(|p| place(p.id()));
        let parking: HashSet<SequenceId> = to_park.iter().map(P::id).collect();
        // Per key, the first place of an event still with the engine.
        let mut out: HashMap<&str, S::Place> = HashMap::new();
        for (id, held) in &self.held {
            if let Held::Stream(event) = held {
                if !parking.contains(id) {
                    let at = event.place();
                    out.entry(event.key())
                        .and_modify(|first| *first = (*first).min(at))
                        .or_insert(at);
                }
            }
        }
        let (parks, waiting): (Vec<P>, Vec<P>) =
            to_park
                .into_iter()
                .partition(|park| match self.held.get(&park.id()) {
                    Some(Held::Stream(event)) => out
                        .get(event.key())
                        .is_none_or(|first| *first > event.place()),
                    _ => true,
                });
        self.to_park = waiting;
        parks
    }

    /// `parks` split into those to write now and those of keys refused until after `now`
    /// ([`Holdings::refused_parks`]), to stay queued. A key whose time came is tried again
    /// (and refused again, if it is, by a statement of its own).
    pub fn set_aside_refused_parks(&mut self, parks: Vec<P>, now: Instant) -> (Vec<P>, Vec<P>) {
        if self.refused_parks.is_empty() {
            return (parks, Vec::new());
        }
        let (held, refused) = (&self.held, &self.refused_parks);
        parks
            .into_iter()
            .partition(|park| match held.get(&park.id()) {
                Some(Held::Stream(event)) => refused
                    .get(event.key())
                    .is_none_or(|refused| refused.until <= now),
                _ => true,
            })
    }

    /// Sets the key of the park of `id` (refused, written alone) aside from `now`, for
    /// twice as long as the last time it was (the first time, a second); returns the key
    /// and how long, or nothing when the event is not held (nothing to set aside).
    pub fn refuse_park(&mut self, id: SequenceId, now: Instant) -> Option<(String, Duration)> {
        let Some(Held::Stream(event)) = self.held.get(&id) else {
            return None;
        };
        let key = event.key().to_string();
        let wait = match self.refused_parks.get(&key) {
            Some(last) => (last.wait * 2).min(REFUSED_PARK_LONGEST_WAIT),
            None => REFUSED_PARK_FIRST_WAIT,
        };
        let until = now + wait;
        self.refused_parks
            .insert(key.clone(), RefusedPark { until, wait });
        Some((key, wait))
    }

    /// While parks are refused, what `/readyz` says: those keys stall.
    pub fn refused_parks_stall(&self) -> Option<String> {
        if self.refused_parks.is_empty() {
            return None;
        }
        let mut keys: Vec<&String> = self.refused_parks.keys().collect();
        keys.sort();
        let named: Vec<String> = keys.iter().take(3).map(|key| format!("{key:?}")).collect();
        Some(format!(
            "the database refuses to park events of {} key(s) ({}{}): they wait, the other \
             keys flow; the relay's log names the error (a trigger, a constraint or a column \
             changed on the parked table)",
            keys.len(),
            named.join(", "),
            if keys.len() > 3 { ", …" } else { "" }
        ))
    }

    /// Forgets the refusals of the keys of `parked` (ids of held events just parked).
    pub fn parked_after_refusal(&mut self, parked: impl IntoIterator<Item = SequenceId>) {
        if self.refused_parks.is_empty() {
            return;
        }
        for id in parked {
            if let Some(Held::Stream(event)) = self.held.get(&id) {
                self.refused_parks.remove(event.key());
            }
        }
    }

    /// Queues `parks` again, whose write failed, ahead of any queued since: later events of
    /// their keys wait for them.
    pub fn requeue_parks(&mut self, parks: Vec<P>) {
        let later = std::mem::replace(&mut self.to_park, parks);
        self.to_park.extend(later);
    }

    /// Forgets the events queued to park (the session that read them is over: they come
    /// again from the stream).
    pub fn forget_queued_parks(&mut self) {
        for park in std::mem::take(&mut self.to_park) {
            self.held.remove(&park.id());
        }
    }

    /// The keys among `keys` with nothing parked left (none `still` in the parked table,
    /// none queued to park) flow from the stream again; returns them.
    pub fn unpark(&mut self, keys: Vec<String>, still: &HashSet<String>) -> Vec<String> {
        let waiting: HashSet<&str> = self
            .to_park
            .iter()
            .filter_map(|p| match self.held.get(&p.id()) {
                Some(Held::Stream(event)) => Some(event.key()),
                _ => None,
            })
            .collect();
        let free: Vec<String> = keys
            .into_iter()
            .filter(|key| !still.contains(key) && !waiting.contains(key.as_str()))
            .collect();
        for key in &free {
            self.parked_keys.remove(key);
        }
        free
    }

    /// Splits what the engine settles into rows of the parked table (with their keys) and
    /// held stream events; what is held no more is left out.
    pub fn split<T>(&self, items: Vec<T>, id: fn(&T) -> SequenceId) -> Split<T> {
        let mut split = Split {
            parked: Vec::new(),
            keys: Vec::new(),
            stream: Vec::new(),
        };
        for item in items {
            match self.held.get(&id(&item)) {
                Some(Held::Parked { key, .. }) => {
                    split.keys.push(key.clone());
                    split.parked.push(item);
                }
                Some(Held::Stream(_)) => split.stream.push(item),
                None => {}
            }
        }
        split
    }

    /// The session of each of `ids`' held stream events (0: none held), as an engine call
    /// that ends them begins: see [`Holdings::copies_the_engine_dropped`].
    pub fn sessions_of(&self, ids: &[SequenceId]) -> Vec<u64> {
        ids.iter()
            .map(|id| match self.held.get(id) {
                Some(Held::Stream(event)) => event.session(),
                _ => 0,
            })
            .collect()
    }

    /// Among `ids`, the ids of an engine call (an ack, a dead letter) that began when their
    /// held events were of `sessions` ([`Holdings::sessions_of`]) and returns now, those
    /// held by a newer session: copies a new session handed out while the call ran. The
    /// engine holds an event until the call that ends it returns, and drops a copy handed
    /// out meanwhile (to it, an expired lease renewed), so nothing would ever end the copy:
    /// the call settles it as it returns, being done with the event. Whatever settled the
    /// event first (another ack's group commit, a claim's retry of a row not yet visible, a
    /// park another call wrote), the copy is never left held, holding the stream's position
    /// back for good.
    ///
    /// `current` is the session streaming now: most calls begin and end within one, and
    /// then nothing newer can hold their events.
    pub fn copies_the_engine_dropped(
        &self,
        ids: &[SequenceId],
        sessions: &[u64],
        current: u64,
    ) -> Vec<SequenceId> {
        if sessions.iter().all(|began| *began >= current) {
            return Vec::new();
        }
        // A copy queued to park is settled by its park: settled now, its park would be
        // skipped, and a dead letter queued for it (waiting behind its key) never written.
        ids.iter()
            .zip(sessions)
            .filter(|(id, began)| {
                matches!(self.held.get(id), Some(Held::Stream(event)) if event.session() > **began)
            })
            .map(|(id, _)| *id)
            .filter(|id| !self.to_park.iter().any(|park| park.id() == *id))
            .collect()
    }

    /// A held stream event let go of (settled, or left to another reader), if held.
    pub fn remove_stream(&mut self, id: SequenceId) -> Option<Box<S>> {
        match self.held.remove(&id)? {
            Held::Stream(event) => Some(event),
            parked => {
                self.held.insert(id, parked);
                None
            }
        }
    }

    /// Forgets held stream events this capture may no longer write for: another reader
    /// holds the stream now, and reads them again. The caller ends its session.
    pub fn leave_to_other_reader(
        &mut self,
        ids: impl IntoIterator<Item = SequenceId>,
    ) -> Vec<SequenceId> {
        let ids: Vec<SequenceId> = ids.into_iter().collect();
        for id in &ids {
            self.remove_stream(*id);
        }
        ids
    }

    /// Adds the held stream events to the parked table's `backlog`: pending, and the
    /// oldest of them that decoded by when it was written.
    pub fn add_stream_backlog(&self, backlog: &mut Backlog) {
        let mut oldest: Option<SystemTime> = None;
        for held in self.held.values() {
            if let Held::Stream(event) = held {
                backlog.pending += 1;
                if let Some(at) = event.written_at() {
                    oldest = Some(oldest.map_or(at, |o| o.min(at)));
                }
            }
        }
        if let Some(age) = oldest.and_then(|o| o.elapsed().ok()) {
            backlog.oldest_pending_age =
                Some(backlog.oldest_pending_age.map_or(age, |a| a.max(age)));
        }
    }

    /// Forgets parked rows before the statement that settles them (or records their retry):
    /// once it commits, a claim may take a row again, and the entry that claim makes must
    /// not be forgotten after it (the engine's settle of it would then be ignored, leaving
    /// the row locked, and later rows of its key claimable ahead of it). [`Holdings::restore`]
    /// gives them back if the statement fails: the rows are still this node's then, so no
    /// claim took them meanwhile.
    pub fn take(&mut self, ids: &[SequenceId]) -> Vec<(SequenceId, Held<S>)> {
        ids.iter()
            .filter_map(|id| self.held.remove(id).map(|held| (*id, held)))
            .collect()
    }

    pub fn restore(&mut self, taken: Vec<(SequenceId, Held<S>)>) {
        for (id, held) in taken {
            self.held.entry(id).or_insert(held);
        }
    }

    /// Whether no row of the parked table is out with the engine ([`claim_parked`]).
    pub fn no_parked_row_out(&self) -> bool {
        !self
            .held
            .values()
            .any(|held| matches!(held, Held::Parked { .. }))
    }

    /// Holds claimed parked rows (by their engine id) until settled, and hands them out.
    /// Returns the ids of rows not handed out, for the caller to release: a held stream event
    /// has the id (ids are taken again after `TRUNCATE … RESTART IDENTITY`, and an early
    /// relay adopted rows under their own ids). Held in its place, the row replaced the event:
    /// the engine took the row for the event's lease renewed, the event's ack then deleted
    /// the row undelivered, and the event, held no more, was never settled (its stream
    /// position stuck for good). The row waits until the event is settled.
    #[must_use = "rows not handed out stay leased until released"]
    pub fn hold_parked(
        &mut self,
        rows: Vec<(Claimed, Charge)>,
        out: &mut Vec<Claimed>,
    ) -> Vec<SequenceId> {
        let mut not_held = Vec::new();
        for (row, memory) in rows {
            if matches!(self.held.get(&row.sequence_id()), Some(Held::Stream(_))) {
                not_held.push(row.sequence_id());
                continue;
            }
            let key = row.ordering_key().to_string();
            let event_id = match &row {
                Claimed::Event(event) => Some(event.event_id),
                Claimed::Undecodable { .. } => None,
            };
            self.held.insert(
                row.sequence_id(),
                Held::Parked {
                    key,
                    event_id,
                    _memory: memory,
                },
            );
            out.push(row);
        }
        not_held
    }
}

/// Releases the parked rows [`Holdings::hold_parked`] did not hand out, so that a later claim
/// takes them once their id is free; if the release fails, their lease runs out instead.
pub async fn release_not_held(
    parked: &dyn OutboxStore,
    node: &crate::NodeId,
    not_held: Vec<SequenceId>,
) {
    if not_held.is_empty() {
        return;
    }
    tracing::debug!(ids = ?not_held, "parked rows wait: a held stream event has their ids");
    if let Err(e) = parked.release(node.clone(), not_held).await {
        tracing::warn!(error = %e.report(), "releasing parked rows failed: they are claimed again once their lease runs out");
    }
}

/// Marks `key` as waiting behind parked events (allocating only when it was not).
fn mark_waiting(parked_keys: &mut HashSet<String>, key: &str) {
    if !parked_keys.contains(key) {
        parked_keys.insert(key.to_string());
    }
}

/// Claimed parked rows as a log line names them: a parked row's id is new, its event id the
/// stream's.
pub fn describe_claimed(rows: &[(Claimed, Charge)]) -> Vec<String> {
    rows.iter()
        .map(|(row, _)| match row {
            Claimed::Event(e) => format!("{}={}", e.sequence_id, e.event_id),
            other => other.sequence_id().to_string(),
        })
        .collect()
}

/// Claims rows of the parked table, through the polling store over it: as many as the memory
/// left holds at the size of the largest event seen (or of a large one before any was),
/// reserved before the query so that the reader does not fill the room meanwhile. One at
/// least while `none_out` (no parked row is out with the engine), so that a busy stream that
/// keeps the budget full never starves the parked rows, and one row larger than the whole
/// budget still goes. Each row comes with its charge.
pub async fn claim_parked(
    parked: &dyn OutboxStore,
    memory: &Arc<MemoryBudget>,
    request: &ClaimRequest,
    none_out: bool,
) -> StoreResult<Vec<(Claimed, Charge)>> {
    let per_row = match memory.largest_event() {
        0 => UNSEEN_EVENT_BYTES,
        largest => largest.max(EVENT_OVERHEAD),
    };
    claim_parked_sized(parked, memory, request, none_out, per_row).await
}

/// [`claim_parked`] with the memory of the largest parked row known (`per_row`): a capture
/// that knows it sizes its claims by it, not by the events it streamed, which say nothing
/// of rows parked before a restart (small events streamed, large ones parked).
pub async fn claim_parked_sized(
    parked: &dyn OutboxStore,
    memory: &Arc<MemoryBudget>,
    request: &ClaimRequest,
    none_out: bool,
    per_row: usize,
) -> StoreResult<Vec<(Claimed, Charge)>> {
    let per_row = per_row.max(EVENT_OVERHEAD);
    let fits = request.limit.min(memory.room() / per_row);
    let limit = if fits == 0 && none_out { 1 } else { fits };
    if limit == 0 {
        return Ok(Vec::new());
    }
    let mut reservation = memory.reserve(limit * per_row);
    let rows = parked
        .claim(ClaimRequest {
            fence: None,
            limit,
            ..request.clone()
        })
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let charge = match &row {
                Claimed::Event(event) => reservation.take(event_bytes(event), memory),
                Claimed::Undecodable { .. } => Charge::none(),
            };
            (row, charge)
        })
        .collect())
}

/// The session a capture's claims follow, and whether it has ended: from its end (the reader
/// saw it end, or a write found the stream with another reader) to the next session's
/// announcement nothing is handed out, and what arrives is dropped.
pub struct Followed {
    pub session: u64,
    pub ended: bool,
}

impl Followed {
    /// Nothing is handed out before the first session's announcement.
    pub fn before_any_session() -> Self {
        Followed {
            session: 0,
            ended: true,
        }
    }

    /// Whether this is the `live` session, not ended.
    pub fn follows(&self, live: u64) -> bool {
        !self.ended && self.session == live
    }

    /// Session `session` is announced: its events may be handed out.
    pub fn start(&mut self, session: u64) {
        self.session = session;
        self.ended = false;
    }
}

/// A capture whose state holds [`Holdings`] behind a lock of its own.
pub trait HoldsEvents<S, P> {
    /// Runs `f` on the holdings, under the state's lock (never held across an await).
    fn with_holdings<R>(&self, f: impl FnOnce(&mut Holdings<S, P>) -> R) -> R;
}

/// Settles the rows of the parked table among `items` with `statement` (the polling store's
/// own, over the parked table). They are forgotten before it runs: once it commits, a claim
/// may take a row again, and the entry that claim makes must not be forgotten after it (the
/// engine's settle of it would then be ignored, leaving the row locked and later rows of its
/// key claimable ahead of it). If it fails they are held again: still this node's rows, so no
/// claim took them meanwhile.
///
/// `unpark`, given when the rows leave the parked table (an ack, a dead letter), lets their
/// keys flow from the stream again once none has rows parked. Its failure does not fail the
/// settle, which has committed: the engine would retry it, find the rows gone and count them
/// as lost to another node. The keys are checked again at the next claim instead.
///
/// Returns how many parked rows `statement` settled, and the held stream events among the
/// items, for the caller to settle its own way.
pub async fn settle_parked<S, P, T, F, U>(
    capture: &impl HoldsEvents<S, P>,
    items: Vec<T>,
    id: fn(&T) -> SequenceId,
    statement: impl FnOnce(Vec<T>) -> F,
    unpark: Option<impl FnOnce(Vec<String>) -> U>,
) -> StoreResult<(u64, Vec<T>)>
where
    S: StreamEvent,
    P: QueuedPark,
    F: std::future::Future<Output = StoreResult<u64>>,
    U: std::future::Future<Output = StoreResult<()>>,
{
    let Split {
        parked,
        keys,
        stream,
    } = capture.with_holdings(|h| h.split(items, id));
    if parked.is_empty() {
        return Ok((0, stream));
    }
    let ids: Vec<SequenceId> = parked.iter().map(id).collect();
    let taken = capture.with_holdings(|h| h.take(&ids));
    let settled = match statement(parked).await {
        Ok(settled) => settled,
        Err(e) => {
            capture.with_holdings(|h| h.restore(taken));
            return Err(e);
        }
    };
    if let Some(unpark) = unpark {
        if let Err(e) = unpark(keys.clone()).await {
            tracing::debug!(error = %e.report(), "checking the settled rows' keys for parked rows; again with the next claim");
            capture.with_holdings(|h| h.recheck.extend(keys));
        }
    }
    Ok((settled, stream))
}

/// What follows every claim: the keys whose check failed ([`Holdings::recheck`]) are checked
/// again with `unpark` (called holding the capture's parking lock), and the parks queued
/// meanwhile written with `flush_parks`. A failure of either waits for the next claim: the
/// claim's events are out already.
pub async fn after_claim<S, P, U, F>(
    capture: &impl HoldsEvents<S, P>,
    unpark: impl FnOnce(Vec<String>) -> U,
    flush_parks: impl FnOnce() -> F,
) where
    S: StreamEvent,
    P: QueuedPark,
    U: std::future::Future<Output = StoreResult<()>>,
    F: std::future::Future<Output = StoreResult<u64>>,
{
    let recheck = capture.with_holdings(|h| std::mem::take(&mut h.recheck));
    if !recheck.is_empty() {
        if let Err(e) = unpark(recheck.clone()).await {
            capture.with_holdings(|h| h.recheck = recheck);
            tracing::debug!(error = %e.report(), "checking parked keys; again with the next claim");
        }
    }
    if let Err(e) = flush_parks().await {
        tracing::warn!(error = %e.report(), "parking failed; trying again with the next claim");
    }
}

/// Runs a capture's reader task, and what a panic in it (a bug) said, if it panicked: the
/// store then says its reader stopped, where every claim would otherwise find nothing,
/// silently, for good.
pub async fn panic_of(task: impl std::future::Future<Output = ()>) -> Option<String> {
    use futures::FutureExt;
    let panic = std::panic::AssertUnwindSafe(task)
        .catch_unwind()
        .await
        .err()?;
    Some(
        panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into()),
    )
}

/// Runs the reader task of the `capture` named, and if it panics (a bug) logs why and
/// hands `failed` the status text every claim then reports.
pub async fn run_reader(
    capture: &str,
    task: impl std::future::Future<Output = ()>,
    failed: impl FnOnce(String),
) {
    if let Some(said) = panic_of(task).await {
        let reason = format!(
            "the {capture} reader stopped on a bug ({said}): nothing more is read until the \
             relay is restarted, which reads on from the last stored position (please report it)"
        );
        tracing::error!(%reason, "{capture} capture stopped");
        failed(reason);
    }
}

/// How long a drain's claim waits for the capture's first session to start.
pub const DRAIN_START_PATIENCE: Duration = Duration::from_secs(10);

/// The capture's status for a claim: for a drain's, once it is no longer `starting` (or
/// [`DRAIN_START_PATIENCE`] has passed). Before the first session nothing is claimed, the
/// parked table's rows neither, and a drain whose only rows left had failed before (a retry
/// that is due) would end at once, reporting them left.
pub async fn status_for_claim<S: Clone + PartialEq>(
    status: &tokio::sync::watch::Receiver<S>,
    starting: &S,
    drain: bool,
) -> S {
    if !drain {
        return status.borrow().clone();
    }
    let mut status = status.clone();
    let _ = tokio::time::timeout(DRAIN_START_PATIENCE, status.wait_for(|s| s != starting)).await;
    let now = status.borrow().clone();
    now
}

/// What a retry or dead letter of stream events reports as done, `queued` of them queued to
/// park and the parks then flushed: each is written, or waits behind an earlier event of
/// its key still with the engine (and is written once that one is). None if the flush
/// ended the session (fenced out): the stream's new holder sends them again.
pub fn parks_done(queued: usize, followed: &Followed) -> u64 {
    if followed.ended {
        0
    } else {
        queued as u64
    }
}

/// Extends the leases of the parked rows among `extension`'s ids (by the parked table's
/// ids, `to_parked` of the engine's), through the polling store over the parked table. Stream
/// events have no lease: nobody else takes them while this capture's reader holds the stream.
/// Returns how many were extended, stream events counted.
pub async fn extend_leases<S: StreamEvent, P: QueuedPark>(
    capture: &impl HoldsEvents<S, P>,
    parked: &dyn OutboxStore,
    extension: crate::store::LeaseExtension,
    to_parked: fn(SequenceId) -> SequenceId,
) -> StoreResult<u64> {
    let crate::store::LeaseExtension { node, ids, lease } = extension;
    let split = capture.with_holdings(|h| h.split(ids, |id| *id));
    let mut extended = split.stream.len() as u64;
    if !split.parked.is_empty() {
        let ids = split.parked.into_iter().map(to_parked).collect();
        extended += parked
            .extend_leases(crate::store::LeaseExtension { node, ids, lease })
            .await?;
    }
    Ok(extended)
}

/// The state of a capture whose reader announces sessions: what claims need to follow the
/// session that streams now ([`follow`]).
pub trait Sessions {
    type Item;

    /// The session this state follows.
    fn followed(&self) -> &Followed;

    /// Nothing more of the session is handed out, and what it left not handed out is dropped
    /// (it comes again from the stream, to whichever session streams next).
    fn end_session(&mut self);

    /// One reader item, in stream order.
    fn accept(&mut self, item: Self::Item);

    /// Whether `item` announces a session.
    fn announces(item: &Self::Item) -> bool;
}

/// Whether the session `state` follows is `live` (the one streaming now) and may hand out
/// events. When not, it is ended, and the items `next` gives are accepted (what the ended
/// session sent is dropped) up to a session's announcement, which is followed in turn when
/// it is the live one.
pub fn follow<T: Sessions>(
    state: &mut T,
    live: u64,
    mut next: impl FnMut() -> Option<T::Item>,
) -> bool {
    loop {
        if state.followed().follows(live) {
            return true;
        }
        state.end_session();
        let mut announced = false;
        while let Some(item) = next() {
            announced = T::announces(&item);
            state.accept(item);
            if announced {
                break;
            }
        }
        if !announced {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A held event: its key and its place in the stream.
    struct Read {
        key: &'static str,
        place: u64,
        session: u64,
    }

    impl StreamEvent for Read {
        type Place = u64;

        fn key(&self) -> &str {
            self.key
        }

        fn written_at(&self) -> Option<SystemTime> {
            None
        }

        fn place(&self) -> u64 {
            self.place
        }

        fn session(&self) -> u64 {
            self.session
        }
    }

    impl QueuedPark for SequenceId {
        fn id(&self) -> SequenceId {
            *self
        }

        fn absorb(&mut self, _later: Self) {}
    }

    /// Events `(id, key)`, held in that stream order.
    fn holding(events: &[(SequenceId, &'static str)]) -> Holdings<Read, SequenceId> {
        let mut holdings = Holdings::default();
        for (place, &(id, key)) in events.iter().enumerate() {
            let read = Read {
                key,
                place: place as u64,
                session: 1,
            };
            holdings.held.insert(id, Held::Stream(Box::new(read)));
        }
        holdings
    }

    /// A call that began on session 1's events finds, as it returns, which of its ids a
    /// newer session holds now: settled meanwhile and sent again (2), settled before it began and sent again (3), or
    /// still the one it began with (1).
    #[test]
    fn copies_are_the_ids_a_newer_session_holds_as_the_call_returns() {
        let mut holdings = holding(&[(1, "a"), (2, "b")]);
        let began = holdings.sessions_of(&[1, 2, 3]);
        assert_eq!(began, [1, 1, 0]);
        holdings.remove_stream(2);
        let copy = |session| {
            Box::new(Read {
                key: "b",
                place: 7,
                session,
            })
        };
        holdings.held.insert(2, Held::Stream(copy(2)));
        holdings.held.insert(3, Held::Stream(copy(2)));
        assert_eq!(
            holdings.copies_the_engine_dropped(&[1, 2, 3], &began, 2),
            [2, 3]
        );
        holdings.queue_parks([3]);
        assert_eq!(
            holdings.copies_the_engine_dropped(&[1, 2, 3], &began, 2),
            [2],
            "a copy queued to park is settled by its park"
        );
        assert!(
            holdings.copies_the_engine_dropped(&[1], &[2], 2).is_empty(),
            "began in the current session"
        );
    }

    #[test]
    fn parks_are_written_in_stream_order_whatever_order_they_were_queued_in() {
        let mut holdings = holding(&[(1, "a"), (2, "b"), (3, "a")]);
        holdings.queue_parks([3, 2, 1]);
        assert_eq!(holdings.take_parks(), [1, 2, 3]);
        assert!(holdings.to_park.is_empty());
    }

    #[test]
    fn a_release_waits_to_be_parked_while_an_earlier_event_of_its_key_is_with_the_engine() {
        let mut holdings = holding(&[(1, "a"), (2, "a"), (3, "b")]);
        // 2 is released behind 1, which the engine still has: 1 may come back as a retry,
        // and must then be parked first. Key b's park does not wait for key a.
        holdings.queue_parks([2, 3]);
        assert_eq!(holdings.take_parks(), [3]);
        assert_eq!(holdings.to_park, [2]);
        holdings.queue_parks([1]);
        assert_eq!(holdings.take_parks(), [1, 2]);
    }

    #[test]
    fn a_park_is_queued_once_and_only_while_its_event_is_held() {
        let mut holdings = holding(&[(1, "a")]);
        holdings.queue_parks([1, 1, 9]);
        assert_eq!(holdings.to_park, [1]);
        assert!(holdings.waits("a"));
    }

    #[test]
    fn a_key_is_let_through_only_with_nothing_parked_or_queued_to_park() {
        let mut holdings = holding(&[(1, "a"), (2, "b")]);
        holdings.load_parked_keys(vec!["a".into(), "b".into(), "c".into()]);
        holdings.queue_parks([1]);
        let still: HashSet<String> = ["b".to_string()].into();
        let mut freed = holdings.unpark(vec!["a".into(), "b".into(), "c".into()], &still);
        freed.sort();
        assert_eq!(freed, ["c"], "a is queued to park, b is still in the table");
        assert!(holdings.waits("a") && holdings.waits("b") && !holdings.waits("c"));
    }

    #[test]
    fn a_session_start_rechecks_the_keys_this_process_parked_meanwhile() {
        let mut holdings = holding(&[(1, "a")]);
        holdings.park_behind("a", 1);
        holdings.load_parked_keys(vec!["b".into()]);
        assert_eq!(holdings.recheck, ["a"]);
        assert!(holdings.waits("a") && holdings.waits("b"));
    }

    #[test]
    fn a_split_separates_parked_rows_from_stream_events_and_drops_what_is_not_held() {
        let mut holdings = holding(&[(1, "a")]);
        holdings.held.insert(
            7,
            Held::Parked {
                key: "p".into(),
                event_id: None,
                _memory: Charge::none(),
            },
        );
        let split = holdings.split(vec![1, 7, 9], |id| *id);
        assert_eq!(
            (split.parked, split.keys, split.stream),
            (vec![7], vec!["p".to_string()], vec![1])
        );
    }

    /// A parked row whose id a held stream event has (taken again after a sequence reset)
    /// is not handed out: held in the event's place, the event's ack deleted the row
    /// undelivered and the event was never settled.
    #[test]
    fn a_parked_row_with_a_held_stream_events_id_waits_for_it() {
        let mut holdings = holding(&[(34, "a")]);
        let row = |id| {
            let event = Event::new(id, uuid::Uuid::new_v4(), "d", "t", crate::Payload::Null);
            (Claimed::Event(Arc::new(event)), Charge::none())
        };
        let mut out = Vec::new();
        let not_held = holdings.hold_parked(vec![row(34), row(35)], &mut out);
        assert_eq!(not_held, [34]);
        assert_eq!(
            out.iter().map(Claimed::sequence_id).collect::<Vec<_>>(),
            [35]
        );
        assert!(matches!(holdings.held.get(&34), Some(Held::Stream(_))));
        assert!(matches!(holdings.held.get(&35), Some(Held::Parked { .. })));
    }

    #[test]
    fn a_parked_row_taken_for_its_statement_comes_back_if_the_statement_fails() {
        let mut holdings = holding(&[]);
        holdings.held.insert(
            7,
            Held::Parked {
                key: "p".into(),
                event_id: None,
                _memory: Charge::none(),
            },
        );
        let taken = holdings.take(&[7]);
        assert!(holdings.held.is_empty());
        holdings.restore(taken);
        assert!(
            holdings.remove_stream(7).is_none(),
            "a parked row is no stream event"
        );
        assert!(holdings.held.contains_key(&7));
    }

    #[test]
    fn forgetting_queued_parks_forgets_their_events() {
        let mut holdings = holding(&[(1, "a"), (2, "b")]);
        holdings.queue_parks([1]);
        holdings.forget_queued_parks();
        assert!(holdings.to_park.is_empty());
        assert_eq!(holdings.held.keys().copied().collect::<Vec<_>>(), [2]);
    }

    impl HoldsEvents<Read, SequenceId> for std::sync::Mutex<Holdings<Read, SequenceId>> {
        fn with_holdings<R>(&self, f: impl FnOnce(&mut Holdings<Read, SequenceId>) -> R) -> R {
            f(&mut self.lock().unwrap())
        }
    }

    #[test]
    fn a_parked_settle_forgets_its_rows_before_the_statement_and_holds_them_again_if_it_fails() {
        let mut holdings = holding(&[(1, "a")]);
        for (id, key) in [(7, "p"), (8, "q")] {
            let parked = Held::Parked {
                key: key.into(),
                event_id: None,
                _memory: Charge::none(),
            };
            holdings.held.insert(id, parked);
        }
        let capture = std::sync::Mutex::new(holdings);
        let down = || crate::StoreError::new(crate::StoreErrorKind::Connection, "down");
        let failed = futures::executor::block_on(settle_parked(
            &capture,
            vec![1, 7, 8],
            |id| *id,
            |rows| {
                assert_eq!(rows, [7, 8]);
                let forgotten = !capture.lock().unwrap().held.contains_key(&7);
                assert!(forgotten, "forgotten before the statement");
                async { Err(down()) }
            },
            Some(|_: Vec<String>| async { panic!("no unpark after a failed settle") }),
        ));
        assert!(failed.is_err());
        assert!(capture.lock().unwrap().held.contains_key(&7), "held again");
        // The settle commits and the check of its keys fails: the settle stands (the engine
        // would retry it, find the rows gone and count them lost), and the keys are checked
        // again at the next claim.
        let done = futures::executor::block_on(settle_parked(
            &capture,
            vec![1, 7, 8],
            |id| *id,
            |rows| async move { Ok(rows.len() as u64) },
            Some(|keys: Vec<String>| {
                assert_eq!(keys, ["p", "q"]);
                async { Err(down()) }
            }),
        ))
        .unwrap();
        assert_eq!(done, (2, vec![1]));
        let held = capture.lock().unwrap();
        assert!(!held.held.contains_key(&7) && !held.held.contains_key(&8));
        assert!(
            held.held.contains_key(&1),
            "the stream event is the caller's"
        );
        assert_eq!(held.recheck, ["p", "q"], "checked again at the next claim");
    }

    #[test]
    fn after_a_claim_keys_whose_check_fails_are_kept_for_the_next_and_the_parks_are_written() {
        let mut holdings = holding(&[(1, "a")]);
        holdings.recheck = vec!["p".into()];
        let capture = std::sync::Mutex::new(holdings);
        let flushed = std::cell::Cell::new(0);
        let down = || crate::StoreError::new(crate::StoreErrorKind::Connection, "down");
        futures::executor::block_on(after_claim(
            &capture,
            |keys| {
                assert_eq!(keys, ["p"]);
                async { Err(down()) }
            },
            || {
                flushed.set(flushed.get() + 1);
                async { Ok(0) }
            },
        ));
        assert_eq!(
            capture.lock().unwrap().recheck,
            ["p"],
            "checked again next time"
        );
        assert_eq!(flushed.get(), 1, "the parks are written even so");
        futures::executor::block_on(after_claim(
            &capture,
            |_| async { Ok(()) },
            || async { Ok(0) },
        ));
        assert!(capture.lock().unwrap().recheck.is_empty());
    }

    #[tokio::test]
    async fn a_reader_task_that_panics_says_what_it_said() {
        assert_eq!(panic_of(async {}).await, None);
        let said = panic_of(async { panic!("boom {}", 7) }).await;
        assert_eq!(said.as_deref(), Some("boom 7"));
        let said = panic_of(async { panic!("static") }).await;
        assert_eq!(said.as_deref(), Some("static"));
    }

    /// Sessions announced by number; any other item is an event of the last one announced.
    struct Follower {
        followed: Followed,
        accepted: Vec<u64>,
    }

    impl Sessions for Follower {
        type Item = Option<u64>;

        fn followed(&self) -> &Followed {
            &self.followed
        }

        fn end_session(&mut self) {
            self.followed.ended = true;
        }

        fn accept(&mut self, item: Option<u64>) {
            match item {
                Some(session) => self.followed.start(session),
                None if self.followed.ended => {}
                None => self.accepted.push(self.followed.session),
            }
        }

        fn announces(item: &Option<u64>) -> bool {
            item.is_some()
        }
    }

    #[test]
    fn following_passes_by_what_ended_sessions_sent_up_to_the_live_ones_announcement() {
        let mut follower = Follower {
            followed: Followed::before_any_session(),
            accepted: Vec::new(),
        };
        follower.followed.start(1);
        assert!(follow(&mut follower, 1, || None), "session 1 is live");
        let mut queued = std::collections::VecDeque::from([None, Some(2), None, Some(3)]);
        assert!(follow(&mut follower, 3, || queued.pop_front()));
        assert_eq!(follower.followed.session, 3);
        assert!(follower.accepted.is_empty(), "{:?}", follower.accepted);
        assert!(
            !follow(&mut follower, 4, || None),
            "session 4 not announced yet"
        );
    }
}
