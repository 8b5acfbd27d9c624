//! WAL capture as an [`OutboxStore`]: the engine claims, acks, retries and dead-letters
//! events read from the replication slot exactly as it does rows of the polled table, so the
//! sinks, routes, retries, dead letters, metrics and shutdown are the polling relay's.
//!
//! # Where each event is until it is settled
//! - **In the stream.** The reader task runs the replication session and hands the
//!   assembler's outputs over a bounded channel (its capacity bounds memory whatever the
//!   transaction size). Claims take events from it in commit order.
//! - **Held.** A handed-out event is remembered (by its id) until the engine settles it.
//!   Its id is the row's `sequence_id` (table form) or minus the message's WAL position
//!   (table-less form): both stay the same when a new session sends the event again.
//! - **Parked.** An event that must wait (its retry's backoff, an `available_at` in the
//!   future, or an earlier event of its key that waits) is written to `<outbox>_parked`,
//!   outside the publication, and then counts as settled: the slot moves on, and no key
//!   waits for another. Every later event of a parked key is parked behind it, in commit
//!   order (the parked table draws ids in parking order), until the key has nothing parked
//!   left. Parked rows are claimed, retried and dead-lettered by the polling store's own
//!   statements; only the active consumer claims them.
//! - **Settled.** Confirmed by the sink (its outbox row deleted, in the table form), parked,
//!   or dead-lettered. The slot's confirmed position moves to the end of the settled,
//!   committed prefix ([`Acknowledgements`]), and never past an unsettled event: a crash
//!   at any point means redelivery from the slot, never loss.
//!
//! # One active consumer
//! A slot streams to one session at a time. A relay that finds the slot held waits as a
//! standby, trying again every second, and continues from the slot's confirmed position
//! once the holder is gone (PostgreSQL frees the slot when its session dies).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, OnChange, Problem, RetryLater, StoreFuture,
    StoreResult,
};
use outbox_core::{
    Backoff, Event, Fence, NewEvent, NodeId, OutboxStore, Payload, SequenceId, StoreError,
    StoreErrorKind,
};
use outbox_store_postgres::{PgStore, Tables};
use tokio::sync::{mpsc, watch};
use tokio_postgres::types::ToSql;

use crate::ack::Acknowledgements;
use crate::assemble::Output;
use crate::burst::{commit_age, read_burst, BurstEnd, READ_BURST};
use crate::client::{WalConfig, WalError, WalStream};
use crate::event::{EventPosition, EventSource, Undecodable, WalEvent};
use crate::lsn::Lsn;
use crate::schema::{CaptureStatements, CaptureTables};

/// Metric names of WAL capture.
pub mod metric {
    /// WAL the slot keeps on the server's disk (bytes from its restart position).
    pub const SLOT_RETAINED_BYTES: &str = "outbox_wal_slot_retained_bytes";
    /// WAL written since the slot's confirmed position (bytes).
    pub const SLOT_LAG_BYTES: &str = "outbox_wal_slot_lag_bytes";
    /// 1 while this relay streams from the slot, 0 as a standby or while reconnecting.
    pub const STREAMING: &str = "outbox_wal_streaming";
}

/// How WAL capture runs.
#[derive(Clone, Debug)]
pub struct WalStoreOptions {
    pub wal: WalConfig,
    pub publication: outbox_core::ident::Ident,
    /// `run --drain`: relay what committed before start-up, then report nothing left.
    pub drain: bool,
    /// The outbox's destination label guard (the engine's), for the adoption's dead
    /// letters.
    pub labels: Arc<outbox_core::metric_labels::DestinationLabels>,
}

/// Where the replication session stands, for claims and `/readyz`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    Starting,
    Streaming,
    /// Another relay holds the slot.
    Standby,
    /// The session broke; a new one is being started.
    Reconnecting(String),
    /// The session cannot start until an operator acts (a lost or missing slot, a missing
    /// publication, a privilege): claims fail with this message.
    Failed(String),
}

/// What the reader hands to claims, in stream order.
enum Item {
    /// A new session: the slot's confirmed position it starts from, and the keys with
    /// parked events (loaded before any event of the session is handed out).
    Session {
        session: u64,
        start: Lsn,
        parked_keys: Vec<String>,
        /// The session's `application_name`, by which writes check it still holds the slot.
        owner: String,
    },
    /// `--drain`: the position of the marker written at start-up.
    DrainUntil(Lsn),
    /// The outputs the stream had ready, in order: one hand-over (and one wake-up of the
    /// engine) per burst rather than per event.
    Outputs(Vec<Output>),
}

enum Body {
    Event(Arc<Event>),
    Undecodable(Box<Undecodable>),
}

struct HeldWal {
    session: u64,
    position: EventPosition,
    /// The outbox row to delete once settled (table form).
    row: Option<SequenceId>,
    key: String,
    body: Body,
}

enum Held {
    Wal(Box<HeldWal>),
    /// A row of the parked table, by its key.
    Parked(String),
}

/// An event to park and how.
struct Park {
    id: SequenceId,
    attempts: u32,
    error: Option<String>,
    delay: Duration,
    not_before: Option<SystemTime>,
}

impl Park {
    /// An event that waits for its key, with nothing against it.
    fn behind_its_key(id: SequenceId) -> Self {
        Park {
            id,
            attempts: 0,
            error: None,
            delay: Duration::ZERO,
            not_before: None,
        }
    }
}

/// What the engine settles, by where it is.
struct Split<T> {
    parked: Vec<T>,
    keys: Vec<String>,
    stream: Vec<T>,
}

/// One delete of delivered rows, shared by the acks it carries.
#[derive(Default)]
struct AckRound {
    outcome: std::sync::OnceLock<AckOutcome>,
}

/// A delete's outcome, as each ack it carried returns it.
enum AckOutcome {
    Deleted,
    Failed {
        kind: StoreErrorKind,
        report: String,
        hint: &'static str,
    },
}

impl AckOutcome {
    fn of(result: &StoreResult<()>) -> Self {
        match result {
            Ok(()) => AckOutcome::Deleted,
            Err(e) => AckOutcome::Failed {
                kind: e.kind(),
                report: e.report(),
                hint: e.hint(),
            },
        }
    }

    fn to_result(&self) -> StoreResult<()> {
        match self {
            AckOutcome::Deleted => Ok(()),
            AckOutcome::Failed { kind, report, hint } => {
                Err(StoreError::new(*kind, report.clone()).with_hint(hint))
            }
        }
    }
}

struct State {
    session: u64,
    /// The current session's `application_name` ([`CaptureStatements::owns_slot`]).
    owner: String,
    acks: Acknowledgements,
    held: HashMap<SequenceId, Held>,
    /// Held stream events the engine released: handed out again by the next claim.
    redeliver: VecDeque<SequenceId>,
    /// Keys with events in the parked table or in `to_park`.
    parked_keys: HashSet<String>,
    /// Keys to check against the parked table at the next claim.
    recheck: Vec<String>,
    /// Delivered stream events whose outbox row was not found yet, and since when.
    undeleted: Vec<(SequenceId, std::time::Instant)>,
    /// Held stream events to park; written by the next park statement.
    to_park: Vec<Park>,
    drain_until: Option<Lsn>,
    /// Outputs received from the reader and not yet accepted by a claim (a claim stops
    /// at its limit, possibly within a burst).
    unaccepted: VecDeque<Output>,
    /// Delivered stream events waiting for the next delete, and the round they belong to.
    ack_queue: Vec<(SequenceId, std::time::Instant)>,
    ack_round: Arc<AckRound>,
    /// `--drain`: everything committed before the marker has been handed out.
    drained: bool,
}

struct Inner {
    main: PgStore,
    parked: PgStore,
    sql: CaptureStatements,
    slot: String,
    publication: outbox_core::ident::Ident,
    /// The captured table and its column names.
    source: (outbox_core::ident::TableName, crate::table::ColumnNames),
    drain: bool,
    state: Mutex<State>,
    /// Serializes "is this key parked?" with parking and with un-parking, so a key is never
    /// let through while a parked event of it remains.
    parking: tokio::sync::Mutex<()>,
    /// Deletes of delivered rows run one at a time; see [`Inner::ack_stream`].
    /// It holds when the last delete of outbox rows started.
    deleting: tokio::sync::Mutex<Option<std::time::Instant>>,
    outputs: tokio::sync::Mutex<mpsc::Receiver<Item>>,
    confirm: watch::Sender<Lsn>,
    status: watch::Receiver<CaptureStatus>,
    on_change: Arc<Mutex<Option<OnChange>>>,
    close: watch::Sender<bool>,
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
    dead_letters: Arc<CaptureDeadLetters>,
}

/// Dead letters that capture writes itself, not the engine: rows the adoption cannot read
/// as events, and undecodable events behind a waiting key. Counted in the engine's metric,
/// and for `run --drain`'s verdict.
struct CaptureDeadLetters {
    labels: Arc<outbox_core::metric_labels::DestinationLabels>,
    count: std::sync::atomic::AtomicU64,
}

impl CaptureDeadLetters {
    fn add(&self, destination: &str, n: u64) {
        ::metrics::counter!(
            outbox_core::metric_labels::DEAD_LETTERED,
            "destination" => self.labels.label(destination)
        )
        .increment(n);
        self.count.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The outbox read from the WAL. Cheap to clone.
#[derive(Clone)]
pub struct WalStore {
    inner: Arc<Inner>,
}

impl WalStore {
    /// Starts the replication reader (it creates the slot on first use) over `main`, the
    /// native PostgreSQL store of the outbox, whose pool serves every statement.
    pub fn start(main: PgStore, options: WalStoreOptions) -> Self {
        let source = (
            options.wal.outbox_table.clone(),
            options.wal.columns.clone(),
        );
        let tables = capture_tables(main.tables(), &options.publication, Some(source.clone()));
        let parked = main.with_tables(Tables {
            outbox: tables.parked.clone(),
            ..main.tables().clone()
        });
        let sql = CaptureStatements::new(&tables);
        // Items carry bursts of up to `READ_BURST` outputs: the channel holds about
        // `read_ahead` outputs, not that many bursts, so memory stays bounded.
        let (tx, rx) = mpsc::channel((options.wal.read_ahead / READ_BURST).max(2));
        let (confirm, confirm_rx) = watch::channel(Lsn::default());
        let (status_tx, status) = watch::channel(CaptureStatus::Starting);
        let (close, close_rx) = watch::channel(false);
        let on_change: Arc<Mutex<Option<OnChange>>> = Arc::default();
        let dead_letters = Arc::new(CaptureDeadLetters {
            labels: options.labels.clone(),
            count: Default::default(),
        });
        let reader = Reader {
            session_name: String::new(),
            tables: tables.clone(),
            publication: options.publication.clone(),
            dead_letters: dead_letters.clone(),
            config: options.wal.clone(),
            main: main.clone(),
            sql: sql.clone(),
            drain: options.drain,
            tx,
            confirm: confirm_rx,
            close: close_rx,
            status: status_tx,
            on_change: on_change.clone(),
        };
        // Its logs stay in the caller's span (an outbox's, among several).
        let handle = tokio::spawn(tracing::Instrument::in_current_span(reader.run()));
        WalStore {
            inner: Arc::new(Inner {
                main,
                parked,
                sql,
                slot: options.wal.slot.clone(),
                publication: options.publication.clone(),
                source,
                drain: options.drain,
                state: Mutex::new(State {
                    session: 0,
                    owner: String::new(),
                    acks: Acknowledgements::new(Lsn::default()),
                    held: HashMap::new(),
                    redeliver: VecDeque::new(),
                    parked_keys: HashSet::new(),
                    recheck: Vec::new(),
                    undeleted: Vec::new(),
                    to_park: Vec::new(),
                    drain_until: None,
                    unaccepted: VecDeque::new(),
                    ack_queue: Vec::new(),
                    ack_round: Arc::default(),
                    drained: false,
                }),
                parking: tokio::sync::Mutex::new(()),
                deleting: tokio::sync::Mutex::new(None),
                outputs: tokio::sync::Mutex::new(rx),
                confirm,
                status,
                on_change,
                close,
                reader: Mutex::new(Some(handle)),
                dead_letters,
            }),
        }
    }

    pub fn status(&self) -> CaptureStatus {
        self.inner.status.borrow().clone()
    }

    /// Waits until the session streams (or cannot start, or `timeout` passes).
    pub async fn wait_streaming(&self, timeout: Duration) -> CaptureStatus {
        let mut status = self.inner.status.clone();
        let _ = tokio::time::timeout(
            timeout,
            status.wait_for(|s| matches!(s, CaptureStatus::Streaming | CaptureStatus::Failed(_))),
        )
        .await;
        self.status()
    }

    /// How many keys have events waiting in the parked table (or about to be written
    /// there): while a key has one, its new events from the stream are parked behind it.
    pub fn parked_keys(&self) -> usize {
        lock(&self.inner.state).parked_keys.len()
    }

    /// How many events capture moved to the dead letters itself, because they could not be
    /// read as events: rows found when adopting the table, and undecodable events behind a
    /// waiting key (they are no engine dead letters: `run --drain` counts them itself).
    pub fn dead_lettered_by_capture(&self) -> u64 {
        self.inner
            .dead_letters
            .count
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Ends the session after reporting the last confirmed position (within `wait`), which
    /// frees the slot for a standby. Call it after the engine stopped.
    pub async fn close(&self, wait: Duration) {
        let _ = self.inner.close.send(true);
        let handle = self.inner.reader.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = handle {
            if tokio::time::timeout(wait, handle).await.is_err() {
                tracing::warn!(
                    "the replication session did not end in time; the slot is freed when the \
                     process exits, and what was not confirmed is sent again"
                );
            }
        }
    }
}

/// The parked table and its neighbours, from the outbox's tables.
/// The tables of capturing `source` (a table and its column names; `None`: the native
/// outbox of `tables`), with `tables` keeping parked events and dead letters.
pub fn capture_tables(
    tables: &Tables,
    publication: &outbox_core::ident::Ident,
    source: Option<(outbox_core::ident::TableName, crate::table::ColumnNames)>,
) -> CaptureTables {
    let (source, columns) =
        source.unwrap_or_else(|| (tables.outbox.clone(), crate::table::ColumnNames::native()));
    CaptureTables::with_source(
        source,
        columns,
        tables.outbox.clone(),
        tables.dead_letters.clone(),
        publication.clone(),
    )
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // A panic while holding it would be a bug; its data is still the best there is.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// Tells the reader what may be confirmed now.
    fn publish_confirmable(&self, state: &mut State) {
        let confirmable = state.acks.confirmable();
        self.confirm.send_if_modified(|current| {
            let moved = confirmable > *current;
            if moved {
                *current = confirmable;
            }
            moved
        });
    }

    /// Settles held stream events of the current session and forgets them.
    fn settle(&self, state: &mut State, ids: impl IntoIterator<Item = SequenceId>) {
        for id in ids {
            if let Some(Held::Wal(held)) = state.held.remove(&id) {
                if held.session == state.session {
                    if let Err(e) = state.acks.settle(held.position) {
                        tracing::error!(error = %e, "WAL acknowledgement out of step (a bug): the slot stays where it is");
                    }
                }
            }
        }
        self.publish_confirmable(state);
    }

    /// One reader item, in stream order; events to hand out go to `out`.
    fn accept(&self, state: &mut State, item: Item) {
        match item {
            Item::Session {
                session,
                start,
                parked_keys,
                owner,
            } => {
                state.session = session;
                state.owner = owner;
                state.acks = Acknowledgements::new(start);
                // Released or unparked events of the old session come again in this one.
                let old: Vec<SequenceId> = state
                    .redeliver
                    .drain(..)
                    .chain(state.to_park.drain(..).map(|p| p.id))
                    .collect();
                for id in old {
                    state.held.remove(&id);
                }
                // The loaded keys may predate parks this process made while the session
                // started: keep ours too, and check those against the table at the next claim.
                let loaded: HashSet<String> = parked_keys.into_iter().collect();
                state.recheck = state.parked_keys.difference(&loaded).cloned().collect();
                state.parked_keys.extend(loaded);
            }
            Item::DrainUntil(lsn) => state.drain_until = Some(lsn),
            Item::Outputs(outputs) => state.unaccepted.extend(outputs),
        }
    }

    /// Accepts outputs received and not yet accepted, until `out` holds `limit` events or
    /// `budget` outputs were accepted; returns how many were.
    fn accept_outputs(
        &self,
        state: &mut State,
        out: &mut Vec<Claimed>,
        limit: usize,
        budget: usize,
    ) -> usize {
        let mut accepted = 0;
        while out.len() < limit && accepted < budget {
            let Some(output) = state.unaccepted.pop_front() else {
                break;
            };
            accepted += 1;
            self.accept_output(state, output, out);
        }
        // Once per burst, not per output: the position only moves forward.
        self.publish_confirmable(state);
        accepted
    }

    fn accept_output(&self, state: &mut State, output: Output, out: &mut Vec<Claimed>) {
        if state.drained {
            return;
        }
        match &output {
            Output::Skipped { lsn, reason } => {
                tracing::warn!(%lsn, reason, "outbox message not relayed");
            }
            // The drain marker arrives as one.
            Output::Idle { wal_end } => {
                if state.drain_until.is_some_and(|until| *wal_end >= until) {
                    state.drained = true;
                }
            }
            Output::Event { .. } | Output::Committed { .. } => {}
        }
        state.acks.observe(&output);
        if let Output::Event { position, event } = output {
            self.hand_out(state, position, event, out);
        }
    }

    fn hand_out(
        &self,
        state: &mut State,
        position: EventPosition,
        event: Result<WalEvent, Box<Undecodable>>,
        out: &mut Vec<Claimed>,
    ) {
        let (id, row, key, body) = match event {
            Ok(event) => {
                let (id, row) = event_id_of(event.source, position);
                if matches!(state.held.get(&id), Some(Held::Parked(_))) {
                    // Adopted into the parked table when the slot was created, and committed
                    // after it: the parked copy is being delivered; this one is settled.
                    if let Err(e) = state.acks.settle(position) {
                        tracing::error!(error = %e, "WAL acknowledgement out of step (a bug)");
                    }
                    return;
                }
                let key = event.ordering_key().to_string();
                let not_before = event.available_at.filter(|at| *at > SystemTime::now());
                let core = Arc::new(event.into_core(id));
                if not_before.is_some() || state.parked_keys.contains(&key) {
                    state.parked_keys.insert(key.clone());
                    state.to_park.push(Park {
                        not_before,
                        ..Park::behind_its_key(id)
                    });
                } else {
                    out.push(Claimed::Event(core.clone()));
                }
                (id, row, key, Body::Event(core))
            }
            Err(undecodable) => {
                let (id, row) = event_id_of(undecodable.source, position);
                let destination = undecodable.destination.clone().unwrap_or_default();
                let key = undecodable
                    .partition_key
                    .clone()
                    .unwrap_or_else(|| destination.clone());
                out.push(Claimed::Undecodable {
                    sequence_id: id,
                    ordering_key: key.clone(),
                    destination,
                    attempts: 0,
                    reason: undecodable.reason.clone(),
                });
                (id, row, key, Body::Undecodable(undecodable))
            }
        };
        let held = HeldWal {
            session: state.session,
            position,
            row,
            key,
            body,
        };
        state.held.insert(id, Held::Wal(Box::new(held)));
    }

    /// Writes `to_park` to the parked table (and deletes their outbox rows) in one
    /// transaction, then settles them; parks that must wait ([`parking_order`]) stay in
    /// `to_park`. Call it holding `parking`.
    async fn flush_parks(&self) -> StoreResult<u64> {
        let (parks, columns, dead, rows) = {
            let mut state = lock(&self.state);
            let to_park = std::mem::take(&mut state.to_park);
            let (parks, waiting) = parking_order(&state, to_park);
            state.to_park = waiting;
            let mut columns = EventColumns::default();
            // An undecodable event has nothing to park: the polling claim could not read
            // it back. Behind a waiting key (released while its head retries) it is
            // dead-lettered in the same transaction, as the engine would have.
            let mut dead = DeadColumns::default();
            let mut rows = Vec::new();
            for park in &parks {
                if let Some(Held::Wal(held)) = state.held.get(&park.id) {
                    match &held.body {
                        Body::Event(event) => match unstorable(event) {
                            // The parked copy is what would be delivered: it cannot be one
                            // that differs, so the event goes to the dead letters instead.
                            Some(what) => dead.push_event(park.id, event, what),
                            None => {
                                columns.push(event);
                                columns.parking.push(park);
                            }
                        },
                        Body::Undecodable(u) => dead.push(park.id, held.position, u),
                    }
                    rows.extend(held.row);
                }
            }
            (parks, columns, dead, rows)
        };
        if parks.is_empty() {
            return Ok(0);
        }
        let p = &columns.parking;
        let park = columns.params(&[], &[&p.delays, &p.not_before, &p.attempts, &p.errors]);
        let dead_letter = dead.params();
        let delete: &[&(dyn ToSql + Sync)] = &[&rows];
        let mut steps: Vec<(&str, &[&(dyn ToSql + Sync)])> =
            vec![(&self.sql.park, &park), (&self.sql.delete_rows, delete)];
        if !dead.ids.is_empty() {
            steps.push((&self.sql.dead_letter, &dead_letter));
        }
        let owner = lock(&self.state).owner.clone();
        let guard: &[&(dyn ToSql + Sync)] = &[&self.slot, &owner];
        let result = self
            .main
            .transaction_if("park", (&self.sql.owns_slot, guard), &steps)
            .await;
        let result = match result {
            Ok(Some(counts)) => Ok(counts),
            Ok(None) => {
                self.leave_to_slot_holder(parks.iter().map(|p| p.id));
                return Ok(0);
            }
            Err(e) => Err(e),
        };
        if result.is_ok() && !dead.ids.is_empty() {
            tracing::warn!(
                ids = ?dead.ids,
                "events that could not be parked (undecodable, or holding what PostgreSQL cannot store) were dead-lettered: `outbox-relay dead list` shows them with the reason"
            );
            for destination in &dead.columns.destinations {
                self.dead_letters.add(destination, 1);
            }
        }
        let mut state = lock(&self.state);
        match result {
            Ok(_) => {
                tracing::debug!(ids = ?parks.iter().map(|p| p.id).collect::<Vec<_>>(), "parked");
                let n = parks.len() as u64;
                self.settle(&mut state, parks.into_iter().map(|p| p.id));
                Ok(n)
            }
            Err(e) => {
                // Kept, in order, ahead of anything parked since: the next claim tries again.
                let later = std::mem::replace(&mut state.to_park, parks);
                state.to_park.extend(later);
                Err(e)
            }
        }
    }

    /// Forgets stream events this relay may no longer write for: the slot streams to another
    /// session (a relay that took over while this one was paused past its session's end),
    /// which is sent them again from the slot's confirmed position, before which they lie.
    fn leave_to_slot_holder(&self, ids: impl IntoIterator<Item = SequenceId>) {
        let mut state = lock(&self.state);
        let ids: Vec<SequenceId> = ids.into_iter().collect();
        for id in &ids {
            state.held.remove(id);
        }
        tracing::warn!(
            ?ids,
            "the replication slot streams to another session now: these events are left to it, \
             unwritten (it is sent them again)"
        );
    }

    /// After parked rows were settled: the keys among `keys` with nothing parked left are
    /// let through again.
    async fn unpark_keys(&self, keys: Vec<String>) -> StoreResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let _parking = self.parking.lock().await;
        self.unpark_keys_locked(keys).await
    }

    /// [`Inner::unpark_keys`] for a caller that holds `parking`.
    async fn unpark_keys_locked(&self, keys: Vec<String>) -> StoreResult<()> {
        let rows = self
            .main
            .query_rows("parked keys", &self.sql.still_parked, &[&keys])
            .await?;
        let still: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
        let mut state = lock(&self.state);
        let waiting: HashSet<String> = state
            .to_park
            .iter()
            .filter_map(|p| match state.held.get(&p.id) {
                Some(Held::Wal(held)) => Some(held.key.clone()),
                _ => None,
            })
            .collect();
        for key in keys {
            if !still.contains(&key) && !waiting.contains(&key) {
                state.parked_keys.remove(&key);
            }
        }
        Ok(())
    }

    /// Splits what the engine settles into rows of the parked table (with their keys) and
    /// held stream events; what is held no more is left out.
    fn split<T>(&self, items: Vec<T>, id: fn(&T) -> SequenceId) -> Split<T> {
        let state = lock(&self.state);
        let mut split = Split {
            parked: Vec::new(),
            keys: Vec::new(),
            stream: Vec::new(),
        };
        for item in items {
            match state.held.get(&id(&item)) {
                Some(Held::Parked(key)) => {
                    split.keys.push(key.clone());
                    split.parked.push(item);
                }
                Some(Held::Wal(_)) => split.stream.push(item),
                None => {}
            }
        }
        split
    }

    /// Settles the rows of the parked table among `items` with the polling store's own
    /// `statement`; with `unpark` they left the table and their keys may flow again, without
    /// it they go back to it (a retry or a release). Returns how many rows it settled and the
    /// held stream events among `items`, for the caller to settle.
    async fn settle_parked<T>(
        &self,
        items: Vec<T>,
        id: fn(&T) -> SequenceId,
        statement: impl FnOnce(&PgStore, Vec<T>) -> StoreFuture<u64>,
        unpark: bool,
    ) -> StoreResult<(u64, Vec<T>)> {
        let Split {
            parked: items,
            keys,
            stream,
        } = self.split(items, id);
        if items.is_empty() {
            return Ok((0, stream));
        }
        let ids: Vec<SequenceId> = items.iter().map(id).collect();
        // Forgotten before the statement: once it commits a claim may take a row again, and
        // the entry that claim makes must not be forgotten after it.
        // Until a release commits, its rows stay locked by this node and do not hold back
        // later rows of their keys in a parked claim meanwhile: the engine's lanes send
        // such rows back (see `Lanes::releasing`).
        let taken = self.take(&ids);
        let result = statement(&self.parked, items).await;
        let settled = match result {
            Ok(n) => n,
            Err(e) => {
                // Still this node's rows: no claim took them meanwhile.
                self.restore(taken);
                return Err(e);
            }
        };
        if unpark {
            self.unpark_keys(keys).await?;
        }
        Ok((settled, stream))
    }

    /// Parks held stream events (retries, and releases behind a parked key): `parks` picks
    /// them under `parking`, so no claim runs in between, then every queued park is written.
    async fn park_stream(&self, parks: impl FnOnce(&mut State) -> Vec<Park>) -> StoreResult<u64> {
        let _parking = self.parking.lock().await;
        let parks = parks(&mut lock(&self.state));
        self.queue_parks(parks);
        self.flush_parks().await
    }

    /// Queues held stream events for the next park statement (each once).
    fn queue_parks(&self, parks: impl IntoIterator<Item = Park>) {
        let mut state = lock(&self.state);
        for park in parks {
            let key = match state.held.get(&park.id) {
                Some(Held::Wal(held)) => held.key.clone(),
                _ => continue,
            };
            if state.to_park.iter().all(|p| p.id != park.id) {
                state.parked_keys.insert(key);
                state.to_park.push(park);
            }
        }
    }

    /// Acks held stream events: their outbox rows are deleted, then their positions settle.
    ///
    /// A fast sink confirms many small batches at once, and one delete transaction each
    /// would cost a commit (and a WAL flush) per batch, which the writers' commits then
    /// queue behind. So deletes run one at a time, at most one per [`DELETE_SPACING`] unless
    /// [`DELETE_GROUP_ENOUGH`] acks already wait, and each takes every ack queued until it
    /// starts (a group commit): an ack returns once the delete that carried its rows has,
    /// with that delete's outcome. A key's next event goes out when this one is published,
    /// so the wait does not hold keys back; it delays the slot's confirmation and the
    /// engine's count of events in flight (`max_in_flight`) by up to the spacing.
    async fn ack_stream(&self, ids: Vec<SequenceId>) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let acked = ids.len() as u64;
        let now = std::time::Instant::now();
        let round = {
            let mut state = lock(&self.state);
            state.ack_queue.extend(ids.into_iter().map(|id| (id, now)));
            state.ack_round.clone()
        };
        let mut last_delete = self.deleting.lock().await;
        if let Some(outcome) = round.outcome.get() {
            return outcome.to_result().map(|()| acked);
        }
        // This round is still open. Acks queued while it waits its turn join it; a round of
        // `outbox_emit` events alone runs no statement, so it neither waits nor counts.
        let (has_rows, queued) = self.queued_acks();
        if has_rows {
            let wait = last_delete.and_then(|at| DELETE_SPACING.checked_sub(at.elapsed()));
            if let Some(wait) = wait.filter(|_| queued < DELETE_GROUP_ENOUGH) {
                tokio::time::sleep(wait).await;
            }
            *last_delete = Some(std::time::Instant::now());
        }
        // Close it (later acks open the next one) and run it.
        let events = {
            let mut state = lock(&self.state);
            state.ack_round = Arc::default();
            std::mem::take(&mut state.ack_queue)
        };
        let result = self.delete_delivered(events).await;
        let _ = round.outcome.set(AckOutcome::of(&result));
        result.map(|()| acked)
    }

    /// Whether a queued ack has an outbox row to delete (an `outbox_emit` event has none,
    /// and settles without a statement), and how many acks are queued.
    fn queued_acks(&self) -> (bool, usize) {
        let state = lock(&self.state);
        let has_rows = state.ack_queue.iter().any(
            |(id, _)| matches!(state.held.get(id), Some(Held::Wal(held)) if held.row.is_some()),
        );
        (has_rows, state.ack_queue.len())
    }

    /// Deletes the outbox rows of delivered stream events and settles the events. The
    /// stream can carry a transaction a moment before other sessions see its rows (its
    /// commit record is in the WAL before it is visible), so a row the delete does not find
    /// is tried again with the next claims, its event unsettled (the slot waits for it), for
    /// up to [`UNDELETED_PATIENCE`]; a row still missing then was deleted already (the
    /// event was sent again after a reconnect).
    async fn delete_delivered(
        &self,
        events: Vec<(SequenceId, std::time::Instant)>,
    ) -> StoreResult<()> {
        let rows: Vec<SequenceId> = {
            let state = lock(&self.state);
            events
                .iter()
                .filter_map(|(id, _)| match state.held.get(id) {
                    Some(Held::Wal(held)) => held.row,
                    _ => None,
                })
                .collect()
        };
        let deleted: HashSet<SequenceId> = if rows.is_empty() {
            HashSet::new()
        } else {
            // In a transaction of its own: its commit is made durable before the slot
            // confirms past these events (see `PgStore::transaction`).
            let delete: &[&(dyn ToSql + Sync)] = &[&rows];
            self.main
                .transaction_then_query("ack", &[], Some((&self.sql.delete_delivered, delete)))
                .await?
                .1
                .iter()
                .map(|r| r.get(0))
                .collect()
        };
        let mut state = lock(&self.state);
        let (done, wait): (Vec<_>, Vec<_>) = events.into_iter().partition(|(id, since)| {
            let row = match state.held.get(id) {
                Some(Held::Wal(held)) => held.row,
                _ => None,
            };
            row.is_none_or(|row| deleted.contains(&row)) || since.elapsed() >= UNDELETED_PATIENCE
        });
        state.undeleted.extend(wait);
        self.settle(&mut state, done.into_iter().map(|(id, _)| id));
        Ok(())
    }

    /// Writes held stream events to the dead letters (and deletes their outbox rows) in one
    /// transaction, then settles them.
    async fn dead_letter_stream(&self, entries: Vec<DeadLetter>) -> StoreResult<u64> {
        if entries.is_empty() {
            return Ok(0);
        }
        let mut columns = EventColumns::default();
        let mut sequence_ids = Vec::new();
        let mut attempts = Vec::new();
        let mut errors = Vec::new();
        let mut rows = Vec::new();
        {
            let state = lock(&self.state);
            for entry in entries {
                let Some(Held::Wal(held)) = state.held.get(&entry.sequence_id) else {
                    continue;
                };
                match &held.body {
                    Body::Event(event) => columns.push(event),
                    Body::Undecodable(u) => columns.push_undecodable(u, held.position),
                }
                sequence_ids.push(entry.sequence_id);
                attempts.push(i32::try_from(entry.attempts).unwrap_or(i32::MAX));
                errors.push(entry.error);
                rows.extend(held.row);
            }
        }
        let dead = columns.params(&[&sequence_ids], &[&attempts, &errors]);
        let owner = lock(&self.state).owner.clone();
        let guard: &[&(dyn ToSql + Sync)] = &[&self.slot, &owner];
        let delete: &[&(dyn ToSql + Sync)] = &[&rows];
        let written = self
            .main
            .transaction_if(
                "dead-letter",
                (&self.sql.owns_slot, guard),
                &[
                    (&self.sql.dead_letter, &dead),
                    (&self.sql.delete_rows, delete),
                ],
            )
            .await?;
        if written.is_none() {
            self.leave_to_slot_holder(sequence_ids);
            return Ok(0);
        }
        let moved = sequence_ids.len() as u64;
        self.settle(&mut lock(&self.state), sequence_ids);
        Ok(moved)
    }

    /// Forgets parked rows before the statement that releases them (or records their
    /// retry): once it commits, a claim may take a row again, and the entry that claim
    /// makes must not be forgotten after it (the engine's settle of it would then be
    /// ignored, leaving the row locked, and later rows of its key claimable ahead of it).
    /// [`Inner::restore`] gives them back if the statement fails: the rows are still this
    /// node's then, so no claim took them meanwhile.
    fn take(&self, ids: &[SequenceId]) -> Vec<(SequenceId, Held)> {
        let mut state = lock(&self.state);
        ids.iter()
            .filter_map(|id| state.held.remove(id).map(|held| (*id, held)))
            .collect()
    }

    fn restore(&self, taken: Vec<(SequenceId, Held)>) {
        let mut state = lock(&self.state);
        for (id, held) in taken {
            state.held.entry(id).or_insert(held);
        }
    }

    async fn claim(&self, request: ClaimRequest) -> StoreResult<Vec<Claimed>> {
        let status = self.status.borrow().clone();
        // Claims fail while the stream is down, so that `/readyz` and the logs say why; they
        // are retried like a lost connection, but the fix is the one the reason names.
        if let CaptureStatus::Failed(reason) | CaptureStatus::Reconnecting(reason) = &status {
            self.discard_broken_session().await;
            return Err(StoreError::new(
                StoreErrorKind::Connection,
                format!("WAL capture: {reason}"),
            )
            .with_hint(
                "WAL capture cannot stream until the cause above is fixed (the relay keeps \
                 trying); `outbox-relay check --capture wal` lists what it finds",
            ));
        }
        let undeleted = std::mem::take(&mut lock(&self.state).undeleted);
        if !undeleted.is_empty() {
            if let Err(e) = self.delete_delivered(undeleted.clone()).await {
                lock(&self.state).undeleted.extend(undeleted);
                return Err(e);
            }
        }
        let _parking = self.parking.lock().await;
        // Parks that failed last time go first: later events of their keys wait for them.
        self.flush_parks().await?;
        let mut out = Vec::new();
        let has_parked = !lock(&self.state).parked_keys.is_empty();
        if status == CaptureStatus::Streaming && has_parked {
            let rows = self.parked.claim(ClaimRequest {
                fence: None,
                ..request.clone()
            });
            let rows = rows.await?;
            tracing::debug!(
                claimed = ?rows.iter().map(Claimed::sequence_id).collect::<Vec<_>>(),
                "claimed parked rows"
            );
            let mut state = lock(&self.state);
            for row in rows {
                state.held.insert(
                    row.sequence_id(),
                    Held::Parked(row.ordering_key().to_string()),
                );
                out.push(row);
            }
        }
        let parked = out.len();
        {
            let mut state = lock(&self.state);
            while out.len() < request.limit {
                let Some(id) = state.redeliver.pop_front() else {
                    break;
                };
                let Some(Held::Wal(held)) = state.held.get(&id) else {
                    continue;
                };
                if state.parked_keys.contains(&held.key) {
                    state.to_park.push(Park::behind_its_key(id));
                } else {
                    out.push(claimed_of(id, held));
                }
            }
        }
        let redelivered = out.len();
        let mut outputs = self.outputs.lock().await;
        let (limit, budget) = (request.limit, request.limit * 4);
        let mut received = 0;
        loop {
            received +=
                self.accept_outputs(&mut lock(&self.state), &mut out, limit, budget - received);
            if out.len() >= limit || received >= budget {
                break;
            }
            match outputs.try_recv() {
                Ok(item) => self.accept(&mut lock(&self.state), item),
                Err(_) => break,
            }
        }
        if self.drain && received == 0 && out.is_empty() && !lock(&self.state).drained {
            // Nothing yet, and the marker not reached: wait a little for the stream rather
            // than let the engine conclude that the drain is over.
            if let Ok(Some(item)) =
                tokio::time::timeout(Duration::from_secs(1), outputs.recv()).await
            {
                let mut state = lock(&self.state);
                self.accept(&mut state, item);
                self.accept_outputs(&mut state, &mut out, limit, budget);
            }
        }
        drop(outputs);
        if !out.is_empty() && tracing::enabled!(tracing::Level::TRACE) {
            // How long the stream took to bring them: from the writer's clock to the claim.
            let oldest_ms = out[redelivered..]
                .iter()
                .filter_map(|row| match row {
                    Claimed::Event(e) => SystemTime::now().duration_since(e.created_at).ok(),
                    Claimed::Undecodable { .. } => None,
                })
                .max()
                .map(|age| age.as_secs_f64() * 1000.0);
            tracing::trace!(
                parked,
                redelivered = redelivered - parked,
                from_stream = out.len() - redelivered,
                outputs = received,
                oldest_ms,
                "claimed"
            );
        }
        let recheck = std::mem::take(&mut lock(&self.state).recheck);
        if !recheck.is_empty() {
            if let Err(e) = self.unpark_keys_locked(recheck.clone()).await {
                lock(&self.state).recheck = recheck;
                tracing::debug!(error = %e.report(), "checking parked keys; again with the next claim");
            }
        }
        if let Err(e) = self.flush_parks().await {
            tracing::warn!(error = %e.report(), "parking events failed; trying again with the next claim");
        }
        Ok(out)
    }

    /// While no session streams, drops what the broken one left unclaimed, up to the next
    /// session's announcement: its events come again from the slot in that session. (Left
    /// queued, they filled the channel while claims failed, and the reader, blocked on
    /// announcing the new session, never set the status that lets claims through.)
    async fn discard_broken_session(&self) {
        let mut outputs = self.outputs.lock().await;
        let mut state = lock(&self.state);
        state.unaccepted.clear();
        while let Ok(item) = outputs.try_recv() {
            match item {
                Item::Outputs(_) => {}
                Item::Session { .. } => {
                    self.accept(&mut state, item);
                    break;
                }
                Item::DrainUntil(_) => self.accept(&mut state, item),
            }
        }
    }

    async fn backlog(&self) -> StoreResult<Backlog> {
        let mut backlog = self.parked.backlog().await?;
        self.report_slot().await;
        let state = lock(&self.state);
        let mut oldest: Option<SystemTime> = None;
        let mut stream_events = 0u64;
        for held in state.held.values() {
            if let Held::Wal(held) = held {
                stream_events += 1;
                if let Body::Event(e) = &held.body {
                    oldest = Some(oldest.map_or(e.created_at, |o| o.min(e.created_at)));
                }
            }
        }
        backlog.pending += stream_events;
        if let Some(age) = oldest.and_then(|o| o.elapsed().ok()) {
            backlog.oldest_pending_age =
                Some(backlog.oldest_pending_age.map_or(age, |a| a.max(age)));
        }
        if self.drain && !state.drained {
            // Events the stream has not handed over yet.
            backlog.pending += 1;
        }
        Ok(backlog)
    }

    /// Sets the slot gauges (errors only logged: metrics must not stop the relay).
    async fn report_slot(&self) {
        let streaming = *self.status.borrow() == CaptureStatus::Streaming;
        ::metrics::gauge!(metric::STREAMING).set(if streaming { 1.0 } else { 0.0 });
        match slot_status(&self.main, &self.slot).await {
            Ok(status) => {
                let status = status.unwrap_or_default();
                if let Some(retained) = status.retained_bytes {
                    ::metrics::gauge!(metric::SLOT_RETAINED_BYTES).set(retained as f64);
                }
                if let Some(lag) = status.lag_bytes {
                    ::metrics::gauge!(metric::SLOT_LAG_BYTES).set(lag as f64);
                }
            }
            Err(e) => tracing::debug!(error = %e.report(), "cannot read the slot's position"),
        }
    }
}

/// What keeps WAL capture from working on this database, each with its fix, besides what
/// the polling store finds: `check` and `run` call it before any session starts.
pub async fn verify_capture(
    main: &PgStore,
    publication: &outbox_core::ident::Ident,
    slot: &str,
    source: Option<(outbox_core::ident::TableName, crate::table::ColumnNames)>,
) -> StoreResult<Vec<Problem>> {
    // `migrate --capture wal` installs the trigger that notifies nobody, and `main` expects
    // that one (its tables say `poll_wakeup`).
    let mut problems = main.verify().await?;
    let tables = capture_tables(main.tables(), publication, source);
    let sql = CaptureStatements::new(&tables);
    let level: String = main.query_rows("wal_level", &sql.wal_level, &[]).await?[0].get(0);
    if level != "logical" {
        problems.push(Problem::blocking(
            format!("the server runs with wal_level = {level}; WAL capture needs logical"),
            "set wal_level = logical in postgresql.conf and restart PostgreSQL (or use --capture poll)",
        ));
    }
    // Checked for the role connected now: in `migrate`, that may not be the relay's.
    let role = main.query_rows("role", &sql.replication_role, &[]).await?;
    if let Some(row) = role.first().filter(|r| !r.get::<_, bool>(0)) {
        let name: String = row.get(1);
        problems.push(Problem::blocking(
            format!("the role {name:?} may not replicate (no REPLICATION attribute)"),
            format!(
                "as a superuser: ALTER ROLE \"{}\" REPLICATION (for the role the relay runs as)",
                name.replace('"', "\"\"")
            ),
        ));
    }
    problems.extend(publication_problems(main, &sql, &tables, publication).await?);
    let parked = main.with_tables(Tables {
        outbox: tables.parked.clone(),
        ..main.tables().clone()
    });
    if let Err(e) = parked.backlog().await {
        problems.push(Problem::blocking(
            format!(
                "the parked table {} cannot be read: {}",
                tables.parked,
                e.report()
            ),
            "run `outbox-relay migrate --capture wal`",
        ));
    }
    if let Err(e) = main.query_rows("adopted", &sql.adopted, &[&slot]).await {
        problems.push(Problem::blocking(
            format!(
                "the table {} cannot be read: {} (the relay records there that a slot's \
                 session adopted the rows that predate the slot)",
                tables.adopted,
                e.report()
            ),
            "run `outbox-relay migrate --capture wal` (a relay of an earlier version made the \
             other tables; migrate adds what is missing)",
        ));
    }
    let status = slot_status(main, slot).await?;
    let capacity = &main
        .query_rows("replication capacity", &sql.replication_capacity, &[])
        .await?[0];
    let (slots, max_slots, senders, max_senders): (i64, i64, i64, i64) = (
        capacity.get(0),
        capacity.get(1),
        capacity.get(2),
        capacity.get(3),
    );
    if status.is_none() && slots >= max_slots {
        problems.push(Problem::blocking(
            format!("the replication slot {slot:?} does not exist yet, and the server's slots are all taken (max_replication_slots = {max_slots}): the relay cannot create it"),
            "raise max_replication_slots in postgresql.conf and restart PostgreSQL, or drop a slot that is no longer used (SELECT slot_name, active FROM pg_replication_slots; then SELECT pg_drop_replication_slot('<name>'))",
        ));
    }
    // Degraded, not blocking: a sender is often busy only for a while (a base backup, a
    // replica reconnecting), and the relay's session retries until one is free.
    if !status.as_ref().is_some_and(|s| s.active) && senders >= max_senders {
        problems.push(Problem::degraded(
            format!("the server's WAL senders are all busy (max_wal_senders = {max_senders}): the relay cannot start a replication session until one is free"),
            "raise max_wal_senders in postgresql.conf and restart PostgreSQL, or stop a replication client that is no longer needed (SELECT application_name, client_addr FROM pg_stat_replication)",
        ));
    }
    if let Some(status) = status {
        let wal_status = status.wal_status.as_deref();
        if let Some((cause, fix)) =
            crate::client::unusable_slot(slot, status.plugin.as_deref(), status.in_this_database)
        {
            problems.push(Problem::blocking(
                format!("the replication slot {slot:?} cannot be used: {cause}"),
                fix,
            ));
        } else if wal_status == Some("lost") {
            problems.push(Problem::blocking(
                format!("the replication slot {slot:?} is invalidated (wal_status = lost): the WAL it needed was removed"),
                "events written while it fell behind cannot be read from the WAL: recover them from the application, then `outbox-relay drop-slot` and run the relay again",
            ));
        } else if wal_status == Some("unreserved") {
            problems.push(Problem::degraded(
                format!("the replication slot {slot:?} is about to lose WAL it needs (wal_status = unreserved)"),
                "start the relay now, or raise max_slot_wal_keep_size",
            ));
        } else if let Some(retained) = status
            .retained_bytes
            .filter(|r| !status.active && *r > SLOT_RETAINED_WARNING)
        {
            problems.push(Problem::degraded(
                format!(
                    "no relay streams from the replication slot {slot:?}, which keeps {} MiB of WAL on the server's disk, growing with every write",
                    retained / (1024 * 1024)
                ),
                "start the relay, or drop the slot (`outbox-relay drop-slot`) if WAL capture is no longer used; bound it with max_slot_wal_keep_size",
            ));
        }
    }
    Ok(problems)
}

/// What keeps the publication from carrying every INSERT of the captured table, whole:
/// missing, not covering the table, not publishing INSERTs, a row filter, a column list.
/// Each makes pgoutput leave rows out of the stream while the slot moves past them.
async fn publication_problems(
    main: &PgStore,
    sql: &CaptureStatements,
    tables: &CaptureTables,
    publication: &outbox_core::ident::Ident,
) -> StoreResult<Vec<Problem>> {
    let name = publication.as_str();
    let rows = main
        .query_rows("publication", &sql.publication, &[&name])
        .await?;
    let table = &tables.source;
    let set_table = format!(
        "ALTER PUBLICATION {} SET TABLE {}; ALTER PUBLICATION {} SET (publish = 'insert')",
        publication.quoted(),
        table.quoted(),
        publication.quoted()
    );
    let Some(row) = rows.first() else {
        return Ok(vec![Problem::blocking(
            format!("the publication {name:?} does not exist or does not cover {table}"),
            "run `outbox-relay migrate --capture wal` (or apply `migrate --capture wal --print`)",
        )]);
    };
    let (inserts, filter, left_out): (bool, Option<String>, Vec<String>) =
        (row.get(0), row.get(1), row.get(2));
    let mut problems = Vec::new();
    let drift = "rows written meanwhile are not in the stream: once it is fixed, the relay's \
                 next session moves the rows still in the table to the parked table";
    if !inserts {
        problems.push(Problem::blocking(
            format!("the publication {name:?} publishes no INSERTs of {table}: {drift}"),
            set_table.clone(),
        ));
    }
    if let Some(filter) = filter {
        problems.push(Problem::blocking(
            format!("the publication {name:?} has a row filter on {table} (WHERE {filter}): rows it filters out are never relayed; {drift}"),
            set_table.clone(),
        ));
    }
    if !left_out.is_empty() {
        problems.push(Problem::blocking(
            format!(
                "the publication {name:?} has a column list that leaves out {} of {table}: events would be read without them; {drift}",
                left_out.join(", ")
            ),
            set_table,
        ));
    }
    Ok(problems)
}

/// Forgets that `slot` adopted the outbox's rows, once the slot is dropped: a slot made
/// again by that name starts after rows its predecessor never brought, and must adopt them.
pub async fn forget_adoption(
    main: &PgStore,
    publication: &outbox_core::ident::Ident,
    slot: &str,
) -> StoreResult<()> {
    let sql = CaptureStatements::new(&capture_tables(main.tables(), publication, None));
    match main
        .query_rows("forget adoption", &sql.forget_adoption, &[&slot])
        .await
    {
        // A database migrated by an earlier version: nothing recorded, nothing to forget.
        Err(e) if e.kind() == StoreErrorKind::MissingSchema => Ok(()),
        result => result.map(drop),
    }
}

/// The slot as `pg_replication_slots` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotStatus {
    /// A session streams from it.
    pub active: bool,
    /// `reserved`, `extended`, `unreserved` (about to lose WAL it needs) or `lost`.
    pub wal_status: Option<String>,
    /// WAL it keeps on the server's disk, in bytes (`None` on a standby server).
    pub retained_bytes: Option<i64>,
    /// WAL written since its confirmed position, in bytes.
    pub lag_bytes: Option<i64>,
    /// Its output plugin (`None` for a physical slot).
    pub plugin: Option<String>,
    /// It is a slot of the database the relay connects to.
    pub in_this_database: bool,
}

/// The slot named `slot`, if it exists.
pub async fn slot_status(main: &PgStore, slot: &str) -> StoreResult<Option<SlotStatus>> {
    let sql = CaptureStatements::slot_query();
    let rows = main.query_rows("slot", sql, &[&slot]).await?;
    Ok(rows.first().map(|row| SlotStatus {
        active: row.get(0),
        wal_status: row.get(1),
        retained_bytes: row.get(2),
        lag_bytes: row.get(3),
        plugin: row.get(4),
        in_this_database: row.get(5),
    }))
}

/// Splits `to_park` into the parks to write now, in commit order, and those that wait.
/// Parked rows are claimed in parking order, so per key it must be commit order: an event
/// the engine still has (in a lane or publishing) may yet come back to be parked, as a retry
/// or a release, and every later event of its key waits for it. (Released and retried
/// events would otherwise be parked after later events of their key that the stream handed
/// over meanwhile, and be delivered after them.)
fn parking_order(state: &State, mut to_park: Vec<Park>) -> (Vec<Park>, Vec<Park>) {
    if to_park.is_empty() {
        return (to_park, Vec::new());
    }
    let position = |id: &SequenceId| match state.held.get(id) {
        Some(Held::Wal(held)) => Some(held.position),
        _ => None,
    };
    to_park.sort_by_key(|p| position(&p.id));
    let parking: HashSet<SequenceId> = to_park.iter().map(|p| p.id).collect();
    // Per key, the first position of an event still with the engine.
    let mut out: HashMap<&str, EventPosition> = HashMap::new();
    for (id, held) in &state.held {
        if let Held::Wal(held) = held {
            if !parking.contains(id) {
                out.entry(held.key.as_str())
                    .and_modify(|first| *first = (*first).min(held.position))
                    .or_insert(held.position);
            }
        }
    }
    to_park
        .into_iter()
        .partition(|park| match state.held.get(&park.id) {
            Some(Held::Wal(held)) => out
                .get(held.key.as_str())
                .is_none_or(|first| *first > held.position),
            _ => true,
        })
}

/// The least time between the starts of two deletes of delivered rows (see
/// `Inner::ack_stream`): at most 50 a second, however many small batches the sink confirms.
/// (A row not yet visible to the delete is looked for again with the next claim.)
const DELETE_SPACING: Duration = Duration::from_millis(20);

/// Acks enough for a delete to start without waiting for [`DELETE_SPACING`]: grouping them
/// has done its work, and a drain should not wait with that many events counted in flight.
const DELETE_GROUP_ENOUGH: usize = 1_000;

/// How long a delivered event's outbox row is looked for (see `Inner::delete_delivered`).
pub const UNDELETED_PATIENCE: Duration = Duration::from_secs(5);

/// An idle slot keeping more WAL than this makes `check` warn.
pub const SLOT_RETAINED_WARNING: i64 = 256 * 1024 * 1024;

/// The engine's id of an event, and its outbox row.
fn event_id_of(source: EventSource, position: EventPosition) -> (SequenceId, Option<SequenceId>) {
    match source {
        EventSource::Table {
            sequence_id: Some(id),
        } => (id, Some(id)),
        // Not in the native table; a row without an id cannot be deleted either.
        EventSource::Table { sequence_id: None } => (
            -(position.commit_lsn.0 as i64) - position.ordinal as i64,
            None,
        ),
        EventSource::Message { lsn } => (-(lsn.0 as i64), None),
    }
}

fn claimed_of(id: SequenceId, held: &HeldWal) -> Claimed {
    match &held.body {
        Body::Event(event) => Claimed::Event(event.clone()),
        Body::Undecodable(u) => Claimed::Undecodable {
            sequence_id: id,
            ordering_key: held.key.clone(),
            destination: u.destination.clone().unwrap_or_default(),
            attempts: 0,
            reason: u.reason.clone(),
        },
    }
}

/// Undecodable events as the parameters of the dead-letter statement, with no attempt
/// made.
#[derive(Default)]
struct DeadColumns {
    ids: Vec<SequenceId>,
    columns: EventColumns,
    attempts: Vec<i32>,
    errors: Vec<String>,
}

impl DeadColumns {
    fn push(&mut self, id: SequenceId, position: EventPosition, u: &Undecodable) {
        self.ids.push(id);
        self.columns.push_undecodable(u, position);
        self.attempts.push(0);
        self.errors.push(u.reason.clone());
    }

    /// An event that cannot be parked as it is, because of `what`.
    fn push_event(&mut self, id: SequenceId, event: &Event, what: &str) {
        self.ids.push(id);
        self.columns.push(event);
        self.attempts.push(0);
        self.errors.push(format!(
            "{what}, which PostgreSQL cannot store: it could not wait in the parked table, so it \
             was dead-lettered, NULs shown as \\0 in text and a payload or headers holding \\u0000 \
             kept as their JSON text in a string"
        ));
    }

    fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        self.columns
            .params(&[&self.ids], &[&self.attempts, &self.errors])
    }
}

/// Events as the array parameters of the park and dead-letter statements.
#[derive(Default)]
struct EventColumns {
    event_ids: Vec<uuid::Uuid>,
    destinations: Vec<String>,
    keys: Vec<Option<String>>,
    types: Vec<String>,
    payloads: Vec<Option<String>>,
    headers: Vec<String>,
    mutations: Vec<Option<String>>,
    created: Vec<SystemTime>,
    parking: ParkColumns,
}

#[derive(Default)]
struct ParkColumns {
    delays: Vec<i64>,
    not_before: Vec<Option<SystemTime>>,
    attempts: Vec<i32>,
    errors: Vec<Option<String>>,
}

impl ParkColumns {
    fn push(&mut self, park: &Park) {
        self.delays
            .push(i64::try_from(park.delay.as_millis()).unwrap_or(i64::MAX));
        self.not_before.push(park.not_before);
        self.attempts
            .push(i32::try_from(park.attempts).unwrap_or(i32::MAX));
        self.errors.push(park.error.clone());
    }
}

impl EventColumns {
    /// A statement's parameters: `before`, the event columns in the order the park and
    /// dead-letter statements both take them, then `after`.
    fn params<'a>(
        &'a self,
        before: &[&'a (dyn ToSql + Sync)],
        after: &[&'a (dyn ToSql + Sync)],
    ) -> Vec<&'a (dyn ToSql + Sync)> {
        let columns: [&'a (dyn ToSql + Sync); 8] = [
            &self.event_ids,
            &self.destinations,
            &self.keys,
            &self.types,
            &self.payloads,
            &self.headers,
            &self.mutations,
            &self.created,
        ];
        [before, &columns, after].concat()
    }

    /// An event's columns, made storable: what PostgreSQL refuses ([`unstorable`]) is made
    /// visible instead (only dead letters get such an event; parks check first).
    fn push(&mut self, event: &Event) {
        self.event_ids.push(event.event_id);
        self.destinations.push(visible_nul(&event.destination));
        self.keys
            .push(event.partition_key.as_deref().map(visible_nul));
        self.types.push(visible_nul(&event.event_type));
        self.payloads
            .push(payload_json(&event.payload).map(|p| storable_json(&p)));
        let headers = serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into());
        self.headers.push(storable_json(&headers));
        self.mutations
            .push(event.mutation_id.as_deref().map(visible_nul));
        self.created.push(event.created_at);
    }

    fn push_undecodable(&mut self, u: &Undecodable, position: EventPosition) {
        self.event_ids
            .push(u.event_id.unwrap_or_else(|| position.derived_event_id()));
        self.destinations
            .push(visible_nul(u.destination.as_deref().unwrap_or_default()));
        self.keys.push(u.partition_key.as_deref().map(visible_nul));
        self.types.push("(undecodable)".into());
        // A message's bytes as (lossy) text: NULs shown, as jsonb stores no \u0000.
        self.payloads
            .push(serde_json::to_string(&visible_nul(&u.raw)).ok());
        self.headers.push("{}".into());
        self.mutations.push(None);
        self.created.push(SystemTime::now());
    }
}

/// What of `event` PostgreSQL cannot store as it is: a NUL byte in a text column, or
/// `\u0000` in JSON (jsonb refuses it).
fn unstorable(event: &Event) -> Option<&'static str> {
    let text = [
        Some(event.destination.as_str()),
        event.partition_key.as_deref(),
        Some(event.event_type.as_str()),
        event.mutation_id.as_deref(),
    ];
    if text.into_iter().flatten().any(|t| t.contains('\0')) {
        return Some("a NUL byte in its destination, key, type or mutation id");
    }
    if payload_json(&event.payload).is_some_and(|p| holds_nul_escape(&p)) {
        return Some("\\u0000 in its payload");
    }
    let headers = serde_json::to_string(&event.headers).unwrap_or_default();
    holds_nul_escape(&headers).then_some("\\u0000 in its headers")
}

/// `text` with each NUL shown as `\0`.
fn visible_nul(text: &str) -> String {
    text.replace('\0', "\\0")
}

/// JSON text jsonb accepts: as it is, or (holding `\u0000`) as a JSON string of itself.
fn storable_json(json: &str) -> String {
    if holds_nul_escape(json) {
        serde_json::to_string(json).unwrap_or_else(|_| "null".into())
    } else {
        json.to_string()
    }
}

/// Whether JSON text holds the escape `\u0000` (an escaped backslash followed by `u0000`
/// is no such escape).
fn holds_nul_escape(json: &str) -> bool {
    let bytes = json.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' {
            if bytes[i + 1..].starts_with(b"u0000") {
                return true;
            }
            // Skip the escaped character (a backslash among them).
            i += 2;
        } else {
            i += 1;
        }
    }
    false
}

/// A payload as JSON text for a jsonb column (bytes as a JSON string).
fn payload_json(payload: &Payload) -> Option<String> {
    match payload {
        Payload::Null => None,
        Payload::Json(raw) => Some(raw.get().to_string()),
        Payload::Bytes(bytes) => serde_json::to_string(&String::from_utf8_lossy(bytes)).ok(),
    }
}

impl OutboxStore for WalStore {
    fn describe(&self) -> String {
        format!(
            "postgres {} (WAL capture, slot {})",
            self.inner.main.tables().outbox,
            self.inner.slot
        )
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let inner = self.inner.clone();
        async move { inner.claim(request).await }.boxed()
    }

    fn ack(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        ids: Vec<SequenceId>,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (acked, stream) = inner
                .settle_parked(ids, |id| *id, |p, ids| p.ack(node, None, ids), true)
                .await?;
            Ok(acked + inner.ack_stream(stream).await?)
        }
        .boxed()
    }

    fn retry_later(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        retries: Vec<RetryLater>,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (recorded, stream) = inner
                .settle_parked(
                    retries,
                    |r| r.sequence_id,
                    |p, rs| p.retry_later(node, None, rs),
                    false,
                )
                .await?;
            if stream.is_empty() {
                return Ok(recorded);
            }
            let retries = |_: &mut State| {
                stream
                    .into_iter()
                    .map(|retry| Park {
                        attempts: retry.attempts,
                        error: Some(retry.error),
                        delay: retry.delay,
                        ..Park::behind_its_key(retry.sequence_id)
                    })
                    .collect()
            };
            Ok(recorded + inner.park_stream(retries).await?)
        }
        .boxed()
    }

    fn dead_letter(
        &self,
        node: NodeId,
        _fence: Option<Arc<Fence>>,
        entries: Vec<DeadLetter>,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (moved, stream) = inner
                .settle_parked(
                    entries,
                    |e| e.sequence_id,
                    |p, es| p.dead_letter(node, None, es),
                    true,
                )
                .await?;
            Ok(moved + inner.dead_letter_stream(stream).await?)
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (released, stream) = inner
                .settle_parked(ids, |id| *id, |p, ids| p.release(node, ids), false)
                .await?;
            if stream.is_empty() {
                return Ok(released);
            }
            let n = stream.len() as u64;
            // Behind a parked key they are parked; otherwise the next claim hands them out.
            let behind = |state: &mut State| {
                let (behind, free): (Vec<SequenceId>, Vec<SequenceId>) =
                    stream.into_iter().partition(|id| match state.held.get(id) {
                        Some(Held::Wal(held)) => state.parked_keys.contains(&held.key),
                        _ => false,
                    });
                tracing::debug!(?behind, ?free, "released stream events");
                state.redeliver.extend(free);
                behind.into_iter().map(Park::behind_its_key).collect()
            };
            if let Err(e) = inner.park_stream(behind).await {
                tracing::warn!(error = %e.report(), "parking released events failed; trying again with the next claim");
            }
            Ok(released + n)
        }
        .boxed()
    }

    fn extend_leases(
        &self,
        node: NodeId,
        ids: Vec<SequenceId>,
        lease: Duration,
    ) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            // Stream events have no lease: nobody else can take them while the slot is ours.
            let split = inner.split(ids, |id| *id);
            let mut extended = split.stream.len() as u64;
            if !split.parked.is_empty() {
                extended += inner
                    .parked
                    .extend_leases(node, split.parked, lease)
                    .await?;
            }
            Ok(extended)
        }
        .boxed()
    }

    fn backlog(&self) -> StoreFuture<Backlog> {
        let inner = self.inner.clone();
        async move { inner.backlog().await }.boxed()
    }

    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>> {
        self.inner.main.insert(events)
    }

    fn ping(&self) -> StoreFuture<()> {
        self.inner.main.ping()
    }

    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        let inner = self.inner.clone();
        async move {
            let source = Some(inner.source.clone());
            verify_capture(&inner.main, &inner.publication, &inner.slot, source).await
        }
        .boxed()
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        if let Ok(mut slot) = self.inner.on_change.lock() {
            *slot = Some(on_change);
        }
        // The reader calls it; nothing to run here.
        Some(futures::future::pending().boxed())
    }
}

/// The replication session's task: starts sessions (waiting as a standby while another
/// relay holds the slot), forwards outputs to claims and confirmations to the server.
struct Reader {
    config: WalConfig,
    /// The current session's `application_name`: the configured one and a token of its own.
    session_name: String,
    tables: CaptureTables,
    publication: outbox_core::ident::Ident,
    main: PgStore,
    sql: CaptureStatements,
    drain: bool,
    tx: mpsc::Sender<Item>,
    confirm: watch::Receiver<Lsn>,
    close: watch::Receiver<bool>,
    status: watch::Sender<CaptureStatus>,
    on_change: Arc<Mutex<Option<OnChange>>>,
    dead_letters: Arc<CaptureDeadLetters>,
}

/// How a session ended.
enum SessionEnd {
    Closed,
    Broken(String),
    /// It cannot go on until an operator acts (the reason says how).
    Failed(String),
}

impl Reader {
    async fn run(mut self) {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        let mut session = 0;
        let mut streamed = false;
        let mut marker_written = false;
        loop {
            if *self.close.borrow() {
                return;
            }
            let mut config = self.config.clone();
            config.create_slot = !streamed;
            self.session_name = session_name(&self.config.application_name);
            config.application_name = self.session_name.clone();
            let started = tokio::select! {
                started = WalStream::start(&config) => started,
                _ = self.close.changed() => return,
            };
            let wait = match started {
                Ok(mut stream) => {
                    streamed = true;
                    backoff.reset();
                    session += 1;
                    let end = self.stream(&mut stream, session, &mut marker_written).await;
                    match end {
                        SessionEnd::Closed => {
                            stream.confirm(*self.confirm.borrow());
                            if let Err(e) = stream.stop(Duration::from_secs(5)).await {
                                tracing::debug!(error = %e, "closing the replication session");
                            }
                            return;
                        }
                        SessionEnd::Broken(reason) => {
                            tracing::warn!(error = %reason, "the replication session broke; starting a new one from the slot's confirmed position");
                            self.set_status(CaptureStatus::Reconnecting(reason));
                            backoff.next_delay()
                        }
                        SessionEnd::Failed(reason) => self.failed(reason, &mut backoff),
                    }
                }
                Err(e) if e.is_slot_in_use() => {
                    if *self.status.borrow() != CaptureStatus::Standby {
                        tracing::info!(slot = %config.slot, "another relay streams from the slot; waiting as a standby");
                    }
                    self.set_status(CaptureStatus::Standby);
                    Duration::from_secs(1)
                }
                Err(e) if e.is_retryable() => {
                    let reason = describe(&e);
                    tracing::warn!(error = %reason, "cannot start the replication session; retrying");
                    self.set_status(CaptureStatus::Reconnecting(reason));
                    backoff.next_delay()
                }
                Err(e) => self.failed(describe(&e), &mut backoff),
            };
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                _ = self.close.changed() => return,
            }
        }
    }

    /// Capture cannot go on until an operator acts: said once (not at every retry), and
    /// by claims and `/readyz` meanwhile. The delay before trying again.
    fn failed(&self, reason: String, backoff: &mut Backoff) -> Duration {
        if *self.status.borrow() != CaptureStatus::Failed(reason.clone()) {
            tracing::error!(error = %reason, "WAL capture cannot start; retrying until fixed");
        }
        self.set_status(CaptureStatus::Failed(reason));
        backoff.next_delay()
    }

    /// Whether the publication carries every INSERT of the table, whole. While it does not,
    /// no session streams (its keepalives would move the slot past the rows left out), and
    /// the slot's adoption is forgotten: the next session, once it is fixed, moves the rows
    /// still in the table (those left out among them) to the parked table.
    async fn publication_drift(&self) -> Option<SessionEnd> {
        let problems = match publication_problems(
            &self.main,
            &self.sql,
            &self.tables,
            &self.publication,
        )
        .await
        {
            Ok(problems) => problems,
            Err(e) => {
                return Some(SessionEnd::Broken(format!(
                    "reading the publication: {}",
                    e.report()
                )))
            }
        };
        if problems.is_empty() {
            return None;
        }
        let slot = &self.config.slot;
        if let Err(e) = self
            .main
            .query_rows("forget adoption", &self.sql.forget_adoption, &[slot])
            .await
        {
            return Some(SessionEnd::Broken(format!(
                "the publication is wrong, and the slot's adoption cannot be forgotten: {}",
                e.report()
            )));
        }
        let said: Vec<String> = problems
            .iter()
            .map(|p| format!("{} (fix: {})", p.what, p.fix))
            .collect();
        Some(SessionEnd::Failed(said.join("; ")))
    }

    fn set_status(&self, status: CaptureStatus) {
        ::metrics::gauge!(metric::STREAMING).set(if status == CaptureStatus::Streaming {
            1.0
        } else {
            0.0
        });
        self.status.send_replace(status);
    }

    fn notify(&self) {
        let on_change = self.on_change.lock().ok().and_then(|o| o.clone());
        if let Some(on_change) = on_change {
            on_change();
        }
    }

    async fn send(&self, item: Item) -> bool {
        let sent = self.tx.send(item).await.is_ok();
        self.notify();
        sent
    }

    /// Counts the rows a mapped table's adoption dead-lettered (`destination, count`): in
    /// `outbox_events_dead_lettered_total`, as the engine counts its own, and for
    /// `run --drain`'s summary.
    fn count_adoption_dead_letters(&self, dead_by_destination: &[tokio_postgres::Row]) {
        let mut dead = 0;
        for row in dead_by_destination {
            // `destination` is the dead-letter table's (NOT NULL), `count(*)` a bigint.
            let (destination, n): (String, i64) = (row.get(0), row.get(1));
            let n = n.max(0) as u64;
            self.dead_letters.add(&destination, n);
            dead += n;
        }
        if dead > 0 {
            tracing::warn!(
                rows = dead,
                "rows of the outbox table that could not be read as events (an id that is no \
                 UUID, a payload that is no JSON) were moved to the dead letters with the \
                 reason: `outbox-relay dead list` shows them"
            );
        }
    }

    /// Moves the rows that predate the slot to the parked table, unless the slot's adoption
    /// is recorded as done: its stream does not carry them. Run at every session start, by
    /// whichever relay streams (and so holds the slot: no other adopts meanwhile), until it
    /// has committed once; the record is written in the same transaction as the move, so a
    /// crash leaves either both or neither. A slot made by hand, or by a relay that died
    /// before adopting, is adopted by the next session.
    async fn adopt(&self) -> StoreResult<()> {
        let slot = &self.config.slot;
        let adopted = self
            .main
            .query_rows("adopted", &self.sql.adopted, &[slot])
            .await?;
        if adopted.first().is_some_and(|row| row.get::<_, bool>(0)) {
            return Ok(());
        }
        let no_params = &[] as &[&(dyn ToSql + Sync)];
        let record: &[&(dyn ToSql + Sync)] = &[slot];
        let adoption = &self.sql.adopt;
        let steps: Vec<_> = adoption
            .steps
            .iter()
            .map(|sql| (sql.as_str(), no_params))
            .chain([(self.sql.record_adoption.as_str(), record)])
            .collect();
        let dead_letters = adoption.dead_letters.as_deref().map(|sql| (sql, no_params));
        let (_, dead_by_destination) = self
            .main
            .transaction_then_query("adopt", &steps, dead_letters)
            .await?;
        tracing::info!(
            %slot,
            "the slot's rows are adopted: pending rows of the outbox table, which its stream \
             does not carry, were moved to the parked table to be relayed first"
        );
        self.count_adoption_dead_letters(&dead_by_destination);
        Ok(())
    }

    /// One session: announce it, then forward until it breaks or the store closes.
    async fn stream(
        &mut self,
        stream: &mut WalStream,
        session: u64,
        marker_written: &mut bool,
    ) -> SessionEnd {
        if let Some(end) = self.publication_drift().await {
            return end;
        }
        if let Err(e) = self.adopt().await {
            return SessionEnd::Broken(format!(
                "moving the rows that predate the slot to the parked table: {}",
                e.report()
            ));
        }
        let parked_keys = match self
            .main
            .query_rows("parked keys", &self.sql.parked_keys, &[])
            .await
        {
            Ok(rows) => rows.iter().map(|r| r.get(0)).collect(),
            Err(e) => {
                return SessionEnd::Broken(format!("reading the parked keys: {}", e.report()))
            }
        };
        let start = stream.slot().confirmed_flush;
        tracing::info!(slot = %self.config.slot, %start, created = stream.slot().created, "streaming from the replication slot");
        if !self
            .send(Item::Session {
                session,
                start,
                parked_keys,
                owner: self.session_name.clone(),
            })
            .await
        {
            return SessionEnd::Closed;
        }
        self.set_status(CaptureStatus::Streaming);
        if self.drain && !*marker_written {
            match self
                .main
                .query_rows("drain marker", &self.sql.drain_marker, &[])
                .await
            {
                Ok(rows) => {
                    let lsn: String = rows[0].get(0);
                    match lsn.parse::<Lsn>() {
                        Ok(lsn) => {
                            *marker_written = true;
                            if !self.send(Item::DrainUntil(lsn)).await {
                                return SessionEnd::Closed;
                            }
                        }
                        Err(e) => {
                            return SessionEnd::Broken(format!("the drain marker's position: {e}"))
                        }
                    }
                }
                Err(e) => {
                    return SessionEnd::Broken(format!("writing the drain marker: {}", e.report()))
                }
            }
        }
        let mut liveness = SqlLiveness::new();
        loop {
            let permit = tokio::select! {
                biased;
                _ = self.close.changed() => return SessionEnd::Closed,
                changed = self.confirm.changed() => {
                    if changed.is_err() {
                        return SessionEnd::Closed;
                    }
                    stream.confirm(*self.confirm.borrow_and_update());
                    continue;
                }
                _ = liveness.tick() => {
                    if let Some(reason) = liveness.check(&self.main).await {
                        return SessionEnd::Broken(reason);
                    }
                    if liveness.publication_due() {
                        if let Some(end) = self.publication_drift().await {
                            return end;
                        }
                    }
                    continue;
                }
                permit = self.tx.reserve() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return SessionEnd::Closed,
                },
            };
            let next = tokio::select! {
                biased;
                _ = self.close.changed() => return SessionEnd::Closed,
                changed = self.confirm.changed() => {
                    if changed.is_err() {
                        return SessionEnd::Closed;
                    }
                    stream.confirm(*self.confirm.borrow_and_update());
                    continue;
                }
                _ = liveness.tick() => {
                    if let Some(reason) = liveness.check(&self.main).await {
                        return SessionEnd::Broken(reason);
                    }
                    if liveness.publication_due() {
                        if let Some(end) = self.publication_drift().await {
                            return end;
                        }
                    }
                    continue;
                }
                next = stream.next() => next,
            };
            let first = match next {
                Ok(Some(output)) => output,
                Ok(None) => return SessionEnd::Broken("the server ended the stream".into()),
                Err(e) => return SessionEnd::Broken(describe(&e)),
            };
            let (burst, end) = read_burst(stream, first).await;
            if tracing::enabled!(tracing::Level::TRACE) {
                // With the claim's `oldest_ms`: whether events reach the relay late, or wait
                // in it.
                if let Some(age) = commit_age(&burst) {
                    let age_ms = age.as_secs_f64() * 1000.0;
                    tracing::trace!(outputs = burst.len(), first_commit_age_ms = age_ms, "read");
                }
            }
            permit.send(Item::Outputs(burst));
            self.notify();
            match end {
                BurstEnd::More => {}
                BurstEnd::Ended => return SessionEnd::Broken("the server ended the stream".into()),
                BurstEnd::Failed(e) => return SessionEnd::Broken(describe(&e)),
            }
        }
    }
}

/// `base` and a token no other session has (an `application_name`: at most 63 bytes).
fn session_name(base: &str) -> String {
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut base = base.to_string();
    while base.len() > 63 - 1 - 12 {
        base.pop();
    }
    format!("{base} {}", &token[..12])
}

/// Whether the database still answers over SQL, asked every [`SqlLiveness::EVERY`] while
/// a session streams.
///
/// A relay that cannot write to the database cannot settle what it holds, so it cannot
/// confirm the slot up to the end of the WAL sent. PostgreSQL's fast shutdown ends the SQL
/// sessions first, then waits for every walsender's client to confirm the end of the WAL
/// before it completes: a relay that kept its replication session then would hold the
/// shutdown (and a restart, a failover) for as long as it runs. So when the SQL side fails
/// [`SqlLiveness::FAILURES`] times in a row, the session is let go. Nothing is lost: the
/// slot stays where it was confirmed, and the events come again, with the same ids, in the
/// next session.
///
/// Every [`SqlLiveness::PUBLICATION_EVERY`] answered ping, the publication is checked too
/// ([`Reader::publication_drift`]).
struct SqlLiveness {
    ticks: tokio::time::Interval,
    failures: u32,
    answered: u32,
}

impl SqlLiveness {
    const EVERY: Duration = Duration::from_secs(1);
    /// Two, so that one lost connection the pool replaces costs no session.
    const FAILURES: u32 = 2;
    /// A ping that takes longer counts as failed (a server that no longer answers).
    const PATIENCE: Duration = Duration::from_secs(3);
    const PUBLICATION_EVERY: u32 = 5;

    fn new() -> Self {
        let mut ticks =
            tokio::time::interval_at(tokio::time::Instant::now() + Self::EVERY, Self::EVERY);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        SqlLiveness {
            ticks,
            failures: 0,
            answered: 0,
        }
    }

    /// After an answered ping: whether it is the publication's turn.
    fn publication_due(&mut self) -> bool {
        self.answered += 1;
        self.answered.is_multiple_of(Self::PUBLICATION_EVERY)
    }

    async fn tick(&mut self) {
        self.ticks.tick().await;
    }

    /// Pings the database; the reason to let the session go, once it has failed enough.
    async fn check(&mut self, main: &PgStore) -> Option<String> {
        let failure = match tokio::time::timeout(Self::PATIENCE, main.ping()).await {
            Ok(Ok(())) => {
                self.failures = 0;
                return None;
            }
            Ok(Err(e)) => e.report(),
            Err(_) => format!("no answer within {:?}", Self::PATIENCE),
        };
        self.failures += 1;
        tracing::debug!(error = %failure, failures = self.failures, "the database did not answer over SQL");
        (self.failures >= Self::FAILURES).then(|| {
            format!(
                "the database does not answer over SQL ({failure}), so nothing the relay holds \
                 can be settled: the replication session is let go, so that a server shutting \
                 down does not wait for it (its events come again from the slot)"
            )
        })
    }
}

/// A replication error with the fix where one is known.
fn describe(error: &WalError) -> String {
    let text = error.to_string();
    if text.contains("SQLSTATE 42501") || text.contains("must be superuser or replication role") {
        format!("{text}: grant the relay's role REPLICATION (ALTER ROLE <role> REPLICATION)")
    } else if text.contains("wal_level") {
        format!("{text}: set wal_level = logical and restart PostgreSQL")
    } else if text.contains("SQLSTATE 53400") || text.contains("replication slots are in use") {
        format!("{text}: raise max_replication_slots and restart PostgreSQL, or drop a slot no longer used (pg_replication_slots)")
    } else if text.contains("publication") && text.contains("does not exist") {
        // Decoding reads the publication as it was at each change's position: one dropped
        // and made again after the slot's position is missing for the WAL in between, for
        // good. (A publication missing today is refused before streaming, with its own fix.)
        format!(
            "{text}: the publication was dropped and made again after the slot's position, and \
             PostgreSQL cannot decode the WAL written in between; run `outbox-relay drop-slot`, \
             then start the relay: the new slot's first session moves the rows still in the table \
             to the parked table (outbox_emit events written in between are not in any table)"
        )
    } else if text.contains("max_wal_senders") {
        format!("{text}: raise max_wal_senders and restart PostgreSQL, or stop a replication client no longer needed (pg_stat_replication)")
    } else {
        text
    }
}

impl std::fmt::Debug for WalStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalStore")
            .field("slot", &self.inner.slot)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_unescaped_u0000_is_the_escape_jsonb_refuses() {
        assert!(holds_nul_escape(r#"{"a":"\u0000"}"#));
        assert!(
            holds_nul_escape(r#"["x\\\u0000"]"#),
            "an escaped backslash, then the escape"
        );
        assert!(
            !holds_nul_escape(r#"{"a":"\\u0000"}"#),
            "a backslash, then text"
        );
        assert!(!holds_nul_escape(r#"{"a":"\u0001"}"#));
        assert!(!holds_nul_escape(r#"{"a":"ends with a backslash\"#));
    }

    #[test]
    fn json_jsonb_refuses_is_kept_as_a_string_of_itself() {
        let json = r#"{"a":"\u0000"}"#;
        let stored = storable_json(json);
        assert!(!holds_nul_escape(&stored), "{stored}");
        let back: String = serde_json::from_str(&stored).unwrap();
        assert_eq!(back, json, "the text is kept whole");
        assert_eq!(storable_json(r#"{"a":1}"#), r#"{"a":1}"#);
    }

    #[test]
    fn an_event_with_a_nul_anywhere_cannot_be_parked() {
        let event = |destination: &str, payload: &str| {
            let payload = serde_json::value::RawValue::from_string(payload.into()).unwrap();
            Event::new(
                1,
                uuid::Uuid::nil(),
                destination,
                "T",
                Payload::Json(payload),
            )
        };
        assert_eq!(unstorable(&event("orders", "{}")), None);
        assert!(unstorable(&event("ord\0ers", "{}")).is_some());
        assert!(unstorable(&event("orders", r#"{"a":"\u0000"}"#)).is_some());
    }
}
