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

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::memory::event_bytes;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, LeaseExtension, LeaseHolder, OnChange, Problem,
    RetryLater, StoreFuture, StoreResult,
};
use outbox_core::{
    Backoff, Event, NewEvent, NodeId, OutboxStore, Payload, SequenceId, StoreError, StoreErrorKind,
};
use outbox_store_postgres::{PgStore, Tables};
use tokio::sync::{mpsc, watch};
use tokio_postgres::types::ToSql;

use crate::ack::Acknowledgements;
use crate::assemble::Output;
use crate::budget::{Charge, MemoryBudget};
use crate::burst::{commit_age, read_burst, BurstEnd, BurstPace, ChargedOutput, READ_BURST};
use crate::client::{WalConfig, WalError, WalStream};
use crate::event::{EventPosition, EventSource, Undecodable, WalEvent};
use crate::lsn::Lsn;
use crate::schema::{CaptureStatements, CaptureTables};
use crate::table::SourceTable;

mod checks;
mod columns;
mod mark;
mod reader;
mod state;

use checks::publication_problems;
pub use checks::{decoding_problems, forget_adoption, slot_status, verify_capture, SlotStatus};
use columns::{unstorable, DeadColumns, EventColumns};
use outbox_core::capture::{self, Followed, Holdings, Sessions, SettleWatch, StreamEvent};
use reader::Reader;
use state::*;

/// The WAL position in the first column of the first row, as the statements return one
/// (`(lsn - '0/0'::pg_lsn)::int8`). `None`: no row, or no position in it.
fn first_position(rows: &[tokio_postgres::Row]) -> Option<Lsn> {
    let at: i64 = rows.first()?.try_get(0).ok()?;
    Some(Lsn(at.max(0) as u64))
}

/// The parameters of the guard that fences every write a session's events make:
/// [`CaptureStatements::hold_slot_writes`], then [`CaptureStatements::owns_slot`], first in
/// the write's transaction. A session that lost the slot writes nothing.
struct SlotGuard<'a> {
    slot: [&'a (dyn ToSql + Sync); 1],
    owner: [&'a (dyn ToSql + Sync); 2],
}

impl<'a> SlotGuard<'a> {
    /// The guard of writes made for the session named `session_name` (its
    /// `application_name`) while it holds `slot`.
    fn new(slot: &'a String, session_name: &'a String) -> Self {
        Self {
            slot: [slot],
            owner: [slot, session_name],
        }
    }

    /// The guard's two statements, in the order they run.
    fn steps<'s>(&'s self, sql: &'s CaptureStatements) -> [outbox_store_postgres::Step<'s>; 2] {
        [
            (sql.hold_slot_writes.as_str(), &self.slot),
            (sql.owns_slot.as_str(), &self.owner),
        ]
    }
}

/// Metric names of WAL capture.
pub mod metric {
    /// WAL the slot keeps on the server's disk (bytes from its restart position).
    pub const SLOT_RETAINED_BYTES: &str = "outbox_wal_slot_retained_bytes";
    /// WAL written since the slot's confirmed position (bytes).
    pub const SLOT_LAG_BYTES: &str = "outbox_wal_slot_lag_bytes";
    /// Transactions since the slot's catalog_xmin: what it holds back of the server's
    /// vacuum (and, on PostgreSQL 15, of index page recycling).
    pub const SLOT_XMIN_AGE: &str = "outbox_wal_slot_catalog_xmin_age";
    /// Bytes of events capture holds: read ahead of the engine and in flight
    /// ([`crate::budget`]).
    pub const MEMORY_HELD: &str = "outbox_wal_memory_held_bytes";
    /// The most bytes of events capture held at once since it started.
    pub const MEMORY_PEAK: &str = "outbox_wal_memory_peak_bytes";
    /// Seconds the oldest transaction held has gone without progress (none of its events
    /// read or settled), once past [`outbox_core::capture::SETTLE_PATIENCE`]; 0 otherwise.
    pub const SETTLE_STALL_SECONDS: &str = "outbox_wal_settle_stall_seconds";
    /// 1 while this relay streams from the slot, 0 as a standby or while reconnecting.
    pub const STREAMING: &str = "outbox_wal_streaming";
    /// Outbox messages not relayed because they were written non-transactionally (sent
    /// whether or not their writer committed): each is also a WARN line naming the fix.
    pub const SKIPPED_MESSAGES: &str = "outbox_wal_messages_skipped_total";
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
    /// The engine's `max_in_flight`: acked events count in it until their delete, so a
    /// delete starts at once when half of it waits ([`capture::delete_group_enough`]).
    pub max_in_flight: usize,
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

struct Inner {
    main: PgStore,
    parked: PgStore,
    tables: CaptureTables,
    sql: CaptureStatements,
    slot: String,
    publication: outbox_core::ident::Ident,
    /// The captured table.
    source: SourceTable,
    drain: bool,
    state: Mutex<State>,
    /// Serializes "is this key parked?" with parking and with un-parking, so a key is never
    /// let through while a parked event of it remains.
    parking: tokio::sync::Mutex<()>,
    /// Deletes of delivered rows, as group commits; see [`Inner::ack_stream`]. Each ack
    /// queues its id and when it was acked.
    deletes: capture::GroupDeletes<(SequenceId, std::time::Instant)>,
    outputs: tokio::sync::Mutex<mpsc::Receiver<Item>>,
    /// The number of the session that streams now, 0 while none does ([`LiveSession`]).
    live: Arc<LiveSession>,
    confirm: watch::Sender<state::Confirmable>,
    status: watch::Receiver<CaptureStatus>,
    on_change: Arc<Mutex<Option<OnChange>>>,
    close: watch::Sender<bool>,
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
    dead_letters: Arc<CaptureDeadLetters>,
    /// The bytes of events held, read ahead and in flight.
    memory: Arc<MemoryBudget>,
    /// Why the slot is confirmed no further, told by [`WalStore`]'s ping (so `/readyz`).
    confirm_stall: Arc<Mutex<Option<String>>>,
    /// Whether the oldest transaction held moves, looked at by the ping and the metrics:
    /// by the session reading it (a new one reads it again, from nothing settled).
    settle_watch: Mutex<SettleWatch<(String, crate::ack::Front)>>,
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
        let source = options.wal.source.clone();
        let tables = capture_tables(main.tables(), &options.publication, Some(source.clone()));
        let parked = main.with_tables(Tables {
            outbox: tables.parked.clone(),
            ..main.tables().clone()
        });
        let sql = CaptureStatements::new(&tables);
        // Items carry bursts of up to `READ_BURST` outputs: the channel holds about
        // `read_ahead` outputs, not that many bursts, so memory stays bounded.
        let (tx, rx) = mpsc::channel((options.wal.read_ahead / READ_BURST).max(2));
        let (confirm, confirm_rx) = watch::channel(state::Confirmable::default());
        let (status_tx, status) = watch::channel(CaptureStatus::Starting);
        let (close, close_rx) = watch::channel(false);
        let on_change: Arc<Mutex<Option<OnChange>>> = Arc::default();
        let dead_letters = Arc::new(CaptureDeadLetters {
            labels: options.labels.clone(),
            count: Default::default(),
        });
        let memory = MemoryBudget::new(options.wal.memory_budget);
        let live = Arc::new(LiveSession::default());
        let confirm_stall = Arc::new(Mutex::new(None));
        let told = Arc::new(ToldServer::default());
        let reader = Reader {
            live: live.clone(),
            memory: memory.clone(),
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
            sessions: reader::Sessions::new(),
            confirm_stall: confirm_stall.clone(),
            told: told.clone(),
        };
        // Its logs stay in the caller's span (an outbox's, among several).
        let stopped = reader.status.clone();
        let handle = tokio::spawn(tracing::Instrument::in_current_span(capture::run_reader(
            "WAL",
            reader.run(),
            move |reason| drop(stopped.send_replace(CaptureStatus::Failed(reason))),
        )));
        WalStore {
            inner: Arc::new(Inner {
                main,
                parked,
                tables,
                sql,
                slot: options.wal.slot.clone(),
                publication: options.publication.clone(),
                source,
                drain: options.drain,
                state: Mutex::new(State {
                    told,
                    ..State::new()
                }),
                parking: tokio::sync::Mutex::new(()),
                deletes: capture::GroupDeletes::new(options.max_in_flight),
                outputs: tokio::sync::Mutex::new(rx),
                live,
                confirm,
                status,
                on_change,
                close,
                reader: Mutex::new(Some(handle)),
                dead_letters,
                memory,
                confirm_stall,
                settle_watch: Mutex::new(SettleWatch::new(capture::SETTLE_PATIENCE)),
            }),
        }
    }

    /// How long the oldest transaction held may go without progress before `/readyz` says
    /// the capture is stalled: [`capture::SETTLE_PATIENCE`] unless a test shortens it.
    pub fn set_settle_patience(&self, patience: Duration) {
        *lock_watch(&self.inner.settle_watch) = SettleWatch::new(patience);
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
        lock(&self.inner.state).holdings.parked_keys.len()
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

    /// What keeps a drain that reached its end from vouching for the table: rows of it the
    /// slot's stream will never bring (its slot made again by hand while no relay ran, not
    /// adopted yet), or a confirm mark that cannot be kept, without which such a slot is
    /// told late (only by those rows, once the slot's `catalog_xmin` passed them). `check`
    /// names the same problems. Empty: the drain may call itself clean.
    pub async fn drain_problems(&self) -> Vec<Problem> {
        let inner = &self.inner;
        // Rows of delivered events that showed late (`sweep_late_rows`) would pass for
        // stranded once the slot's catalog_xmin is past them: swept now, while that helps.
        loop {
            let left = {
                let mut state = lock(&inner.state);
                state.late_rows_swept = None;
                state.late_rows.len()
            };
            if left == 0 {
                break;
            }
            // A whole pass over them (each sweep takes a bounded number, and puts back
            // those still not visible).
            for _ in 0..left.div_ceil(LATE_ROWS_PER_SWEEP) {
                lock(&inner.state).late_rows_swept = None;
                inner.sweep_late_rows().await;
            }
            if lock(&inner.state).late_rows.len() >= left {
                break;
            }
        }
        match checks::stranded(&inner.main, &inner.sql, &inner.tables, &inner.slot).await {
            Ok(problems) => problems,
            Err(e) => vec![Problem::degraded(
                format!(
                    "cannot tell whether rows of {} wait that the replication slot {:?} will \
                     not bring: {}",
                    inner.tables.source.name,
                    inner.slot,
                    e.report()
                ),
                "run the drain again once the database answers",
            )],
        }
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

/// The tables of capturing `source` (`None`: the native outbox of `tables`), with `tables`
/// keeping parked events and dead letters.
pub fn capture_tables(
    tables: &Tables,
    publication: &outbox_core::ident::Ident,
    source: Option<SourceTable>,
) -> CaptureTables {
    CaptureTables::with_source(
        source.unwrap_or_else(|| SourceTable::native(tables.outbox.clone())),
        tables.outbox.clone(),
        tables.dead_letters.clone(),
        publication.clone(),
    )
}

impl capture::HoldsEvents<HeldWal, Park> for Inner {
    fn with_holdings<R>(&self, f: impl FnOnce(&mut Holdings<HeldWal, Park>) -> R) -> R {
        f(&mut lock(&self.state).holdings)
    }
}

/// The most bytes of events one park transaction carries: PostgreSQL refuses a message
/// past 1 GiB (and drops the connection), and a budget of `wal_memory_mib` past that, its
/// events all parked at once behind a sink's outage, made one statement that failed every
/// claim for good.
const PARK_STATEMENT_BYTES: usize = 64 * 1024 * 1024;

/// The fewest stream outputs a claim accepts (when as many wait): see [`WalStore::claim`].
const MIN_OUTPUTS_PER_CLAIM: usize = 1024;

/// How many keys one [`Inner::flush_parks`] sets aside before it leaves the rest queued
/// for the next call.
const REFUSED_KEYS_PER_FLUSH: usize = 16;

/// Whether a park statement's failure is the database refusing it (a trigger, a constraint,
/// a value no check foresaw, a grant revoked or a row security policy on the parked table),
/// which holds back the refused event's key only, rather than a lost connection or a
/// conflict, retried whole. A refused privilege stopped the relay: restarted by its
/// supervisor, it sent the same events again and stopped again, the slot never moving.
fn refused_park(e: &StoreError) -> bool {
    matches!(
        e.kind(),
        StoreErrorKind::RowRefused | StoreErrorKind::Query | StoreErrorKind::Privilege
    )
}

/// What one park statement did.
enum Flushed {
    /// Wrote this many parks; whether parks it left for the next statement.
    Wrote(u64, bool),
    /// The database refused the statement of `tried` parks, queued again; of one, its key
    /// was set aside for a while.
    Refused { tried: usize },
}

/// How many of the first parks, whose events cost `sizes` bytes, one statement of at most
/// `room` bytes carries: at least one.
fn parks_that_fit(sizes: impl Iterator<Item = usize>, room: usize) -> usize {
    let mut total = 0usize;
    let mut fit = 0;
    for size in sizes {
        total = total.saturating_add(size);
        if fit > 0 && total > room {
            break;
        }
        fit += 1;
    }
    fit
}

fn lock(state: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    // A panic while holding it would be a bug; its data is still the best there is.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

type FrontWatch = SettleWatch<(String, crate::ack::Front)>;

fn lock_watch(watch: &Mutex<FrontWatch>) -> std::sync::MutexGuard<'_, FrontWatch> {
    watch.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    /// Looks whether the oldest transaction held moved since the last look; sets the
    /// stall gauge, logs a stall once, and returns what `/readyz` says of it. A held event
    /// never settled (a bug, or a sink that never answers past its timeout) stops the
    /// slot's confirmation for good while later events flow, and only this tells.
    fn settle_stall(&self) -> Option<String> {
        let streaming = *self.status.borrow() == CaptureStatus::Streaming;
        let front = {
            let state = lock(&self.state);
            // An ended session settles nothing more (its events come again in the next, or
            // in another relay's), and a refused park is a stall `/readyz` names already.
            let watched =
                streaming && !state.followed.ended && state.holdings.refused_parks.is_empty();
            (state.acks.front())
                .filter(|_| watched)
                .map(|front| (state.owner.clone(), front))
        };
        let at = front.as_ref().map(|(_, front)| *front);
        let stalled = lock_watch(&self.settle_watch).look(front, std::time::Instant::now());
        let seconds = stalled.map_or(0.0, |s| s.still.as_secs_f64());
        ::metrics::gauge!(metric::SETTLE_STALL_SECONDS).set(seconds);
        let (stalled, front) = stalled.zip(at)?;
        let front = format!(
            "commit {}, {} of its {} event(s) read settled{}",
            front.commit_lsn,
            front.settled,
            front.handed_out,
            if front.committed {
                ""
            } else {
                ", its commit not read yet"
            },
        );
        Some(stalled.report(
            "WAL",
            &front,
            "the slot is confirmed no further, and the server keeps its WAL",
        ))
    }

    /// Tells the reader what may be confirmed now.
    fn publish_confirmable(&self, state: &mut State) {
        let confirmable = state.confirmable();
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
        state.settle(ids);
        self.publish_confirmable(state);
    }

    /// [`State::accept_outputs`], then tells the reader what may be confirmed: once per
    /// burst, not per output (the position only moves forward).
    fn accept_outputs(
        &self,
        state: &mut State,
        out: &mut Vec<Claimed>,
        limit: usize,
        budget: usize,
    ) -> usize {
        let accepted = state.accept_outputs(out, limit, budget);
        self.publish_confirmable(state);
        accepted
    }

    /// Writes `to_park` to the parked table (and deletes their outbox rows), then settles
    /// them: in transactions of at most [`PARK_STATEMENT_BYTES`] of events, one after the
    /// other, in stream order; parks that must wait ([`Holdings::take_parks`]) stay in
    /// `to_park`. Call it holding `parking`.
    ///
    /// A statement the database refuses (not a lost connection or a conflict: a trigger,
    /// a constraint, a value no check foresaw) is tried again halved, down to the one park
    /// refused, which holds back its own key only ([`Holdings::refused_parks`]) while the
    /// rest are written in whole statements again: one event's park failed every claim
    /// before, and no key moved. A call sets aside at most [`REFUSED_KEYS_PER_FLUSH`]
    /// keys, leaving the rest queued for the next: a database refusing every park
    /// (read-only, out of disk) costs each claim a bounded number of statements, and each
    /// key's wait doubles, to a minute.
    async fn flush_parks(&self) -> StoreResult<u64> {
        // One instant for the call: a key set aside in it stays aside until it returns.
        let now = Instant::now();
        let mut parked = 0;
        let mut limit = usize::MAX;
        let mut refused_keys = 0;
        loop {
            match self.flush_park_statement(limit, now).await {
                Ok(Flushed::Wrote(n, more)) => {
                    parked += n;
                    if !more {
                        return Ok(parked);
                    }
                }
                Ok(Flushed::Refused { tried: 1 }) => {
                    refused_keys += 1;
                    if refused_keys >= REFUSED_KEYS_PER_FLUSH {
                        return Ok(parked);
                    }
                    limit = usize::MAX;
                }
                Ok(Flushed::Refused { tried }) => limit = tried / 2,
                Err(e) => return Err(e),
            }
        }
    }

    /// One transaction of [`Inner::flush_parks`], of at most `limit` parks; keys refused
    /// until after `now` are set aside.
    async fn flush_park_statement(&self, limit: usize, now: Instant) -> StoreResult<Flushed> {
        let (parks, columns, dead, dead_keys, largest_parked, rows, parked, owner, session, more) = {
            let mut state = lock(&self.state);
            let (owner, session) = (state.owner.clone(), state.followed.session);
            let parks = state.holdings.take_parks();
            let (mut parks, refused) = state.holdings.set_aside_refused_parks(parks, now);
            let held = &state.holdings.held;
            let fit = parks_that_fit(
                parks.iter().map(|park| match held.get(&park.id) {
                    Some(Held::Stream(held)) => match &held.body {
                        Body::Event(event) => event_bytes(event),
                        // Dead-lettered with its raw text.
                        Body::Undecodable(u) => outbox_core::memory::EVENT_OVERHEAD + u.raw.len(),
                    },
                    _ => 0,
                }),
                PARK_STATEMENT_BYTES,
            )
            .min(limit);
            let mut rest = parks.split_off(fit);
            let more = !rest.is_empty();
            rest.extend(refused);
            // Ahead of any queued since: later events of their keys wait for them.
            state.holdings.requeue_parks(rest);
            let mut columns = EventColumns::default();
            // An undecodable event has nothing to park: the polling claim could not read
            // it back. Behind a waiting key (released while its head retries) it is
            // dead-lettered in the same transaction, as the engine would have.
            let mut dead = DeadColumns::default();
            // The keys of events dead-lettered instead of parked: nothing of theirs reaches
            // the parked table, so no settle of a parked row would let them flow again.
            let mut dead_keys = Vec::new();
            let mut largest_parked = 0;
            let mut rows = Vec::new();
            // Each parked event's stream id with its event id, for the debug log.
            let mut parked = Vec::new();
            for park in &parks {
                if let Some(Held::Stream(held)) = state.holdings.held.get(&park.id) {
                    match &held.body {
                        Body::Event(event) => match unstorable(event) {
                            // The parked copy is what would be delivered: it cannot be one
                            // that differs, so the event goes to the dead letters instead.
                            Some(what) => {
                                dead.push_event(park.id, event, what);
                                dead_keys.push(held.key().to_string());
                            }
                            None => {
                                largest_parked = largest_parked.max(event_bytes(event));
                                columns.push(event);
                                columns.parking.push(park);
                                parked.push(format!("{}={}", park.id, event.event_id));
                            }
                        },
                        Body::Undecodable(u) => dead.push(park.id, held.position, u),
                    }
                    rows.extend(held.row);
                }
            }
            (
                parks,
                columns,
                dead,
                dead_keys,
                largest_parked,
                rows,
                parked,
                owner,
                session,
                more,
            )
        };
        if parks.is_empty() {
            return Ok(Flushed::Wrote(0, false));
        }
        let p = &columns.parking;
        let mut park = columns.params(&[], &[&p.delays, &p.not_before, &p.attempts, &p.errors]);
        let (row_ids, row_xids) = OutboxRow::params(&rows);
        park.push(&row_ids);
        park.push(&row_xids);
        let dead_letter = dead.params();
        let mut steps: Vec<(&str, &[&(dyn ToSql + Sync)])> = Vec::new();
        if !dead.ids.is_empty() {
            steps.push((&self.sql.dead_letter, &dead_letter));
        }
        let guard = SlotGuard::new(&self.slot, &owner);
        // The parks and the rows' delete last, reporting the rows not found and the parks
        // skipped.
        let result = self
            .main
            .transaction_if_then_query(
                "park",
                &guard.steps(&self.sql),
                &steps,
                Some((&self.sql.park_and_delete, &park)),
            )
            .await;
        let result = match result {
            // The rows not found, and the event ids whose park was skipped.
            Ok(Some((_, answer))) => undeleted_ids("park", &answer).and_then(|undeleted| {
                Ok((undeleted, array_column::<uuid::Uuid>("park", &answer, 1)?))
            }),
            Ok(None) => {
                lock(&self.state).fenced_out(session, parks.iter().map(|p| p.id));
                return Ok(Flushed::Wrote(0, false));
            }
            Err(e) => Err(e),
        };
        if result.is_ok() && !dead.ids.is_empty() {
            // Their keys checked: a key with no other event parked flows again, instead of
            // each later event of it being parked behind nothing (and, unstorable as a NUL
            // key is, dead-lettered unsent).
            if let Err(e) = self.unpark_keys_locked(dead_keys.clone()).await {
                tracing::debug!(error = %e.report(), "checking dead-lettered events' keys for parked rows; again with the next claim");
                lock(&self.state).holdings.recheck.extend(dead_keys);
            }
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
            Ok((undeleted, skipped)) => {
                tracing::debug!(?parked, "parked");
                state.largest_parked = state.largest_parked.max(largest_parked);
                let n = parks.len() as u64;
                // Written, whether or not the park found their rows: a key refused before
                // is refused no longer.
                (state.holdings).parked_after_refusal(parks.iter().map(|p| p.id));
                // A parked event whose outbox row the park did not find (its commit is in
                // the WAL but not visible yet, waiting on a synchronous standby) stays
                // unsettled, the slot short of it, until the row is deleted as a delivered
                // event's is: settled now, that row would outlive its event, and be
                // relayed again by any later adoption.
                let (mut waiting, mut done): (Vec<_>, Vec<_>) = parks.into_iter().partition(|p| {
                    state
                        .held_row(p.id)
                        .is_some_and(|row| undeleted.contains(&row.id))
                });
                // A park skipped (its event id parked before) whose row is not visible yet:
                // an event sent again after a session ended whose earlier park could not
                // delete its row either. The parked copy stands for it: it settles now, its
                // row looked for later (`sweep_late_rows`). An event whose row is gone
                // although visible is parked all the same: the application may have deleted
                // the row in its own transaction (Debezium's pattern), and a parked copy
                // delivered twice is a duplicate, where one not parked would be lost.
                let now = std::time::Instant::now();
                let (reparked, still): (Vec<_>, Vec<_>) = waiting.into_iter().partition(|p| {
                    matches!(state.holdings.held.get(&p.id), Some(Held::Stream(held)) if matches!(&held.body, Body::Event(e) if skipped.contains(&e.event_id)))
                });
                waiting = still;
                for park in reparked {
                    if let Some(row) = state.held_row(park.id) {
                        state.late_rows.push((row, now));
                    }
                    done.push(park);
                }
                if !waiting.is_empty() {
                    tracing::info!(
                        events = waiting.len(),
                        "parked events whose outbox rows are not visible yet (their commits \
                         wait, as on a synchronous standby): their rows are deleted once they are"
                    );
                    state.undeleted.extend(waiting.iter().map(|p| (p.id, now)));
                }
                self.settle(&mut state, done.into_iter().map(|p| p.id));
                Ok(Flushed::Wrote(n, more))
            }
            Err(e) if refused_park(&e) && parks.len() > 1 => {
                let tried = parks.len();
                tracing::debug!(parks = tried, error = %e.report(), "a park statement refused: tried again halved");
                state.requeue_parks(session, parks);
                Ok(Flushed::Refused { tried })
            }
            Err(e) if refused_park(&e) => {
                let refused = parks.first().and_then(|park| {
                    let (key, wait) = state.holdings.refuse_park(park.id, Instant::now())?;
                    let event_id = match state.holdings.held.get(&park.id) {
                        Some(Held::Stream(held)) => held.event_id(),
                        _ => None,
                    };
                    Some((key, wait, event_id))
                });
                tracing::error!(
                    key = refused.as_ref().map(|(key, _, _)| key.as_str()),
                    event_id = ?refused.as_ref().and_then(|(_, _, id)| *id),
                    again_in = ?refused.as_ref().map(|(_, wait, _)| wait),
                    error = %e.report(),
                    "the database refused to park this event: its key waits (its later events \
                     behind it) while the other keys flow, and the park is tried again later; \
                     fix what the error names (a trigger, a constraint or a column changed on \
                     the parked table, or a grant `migrate --capture wal --print` lists)"
                );
                state.requeue_parks(session, parks);
                match refused {
                    Some(_) => Ok(Flushed::Refused { tried: 1 }),
                    None => Err(e),
                }
            }
            Err(e) => {
                // Kept, in order, ahead of anything parked since: the next claim tries again.
                state.requeue_parks(session, parks);
                Err(e)
            }
        }
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
        // A key holding NUL cannot be in the parked table (a park refuses it, see
        // `unstorable`), nor travel as a text parameter: it is asked about only in memory.
        let storable: Vec<&String> = keys.iter().filter(|k| !k.contains('\0')).collect();
        let rows = self
            .main
            .query_rows("parked keys", &self.sql.still_parked, &[&storable])
            .await?;
        let still: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
        lock(&self.state).holdings.unpark(keys, &still);
        Ok(())
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
        // Until a release commits, its rows stay locked by this node and do not hold back
        // later rows of their keys in a parked claim meanwhile: the engine's lanes send such
        // rows back (see `Lanes::releasing`).
        let unpark = unpark.then_some(|keys| self.unpark_keys(keys));
        capture::settle_parked(
            self,
            items,
            id,
            |rows| statement(&self.parked, rows),
            unpark,
        )
        .await
    }

    /// Parks held stream events (retries, and releases behind a parked key): `parks` picks
    /// them under `parking`, so no claim runs in between, then every queued park is written.
    async fn park_stream(&self, parks: impl FnOnce(&mut State) -> Vec<Park>) -> StoreResult<u64> {
        let _parking = self.parking.lock().await;
        let queued = {
            let mut state = lock(&self.state);
            let parks = parks(&mut state);
            state.holdings.queue_parks(parks)
        };
        self.flush_parks().await?;
        Ok(capture::parks_done(queued, &lock(&self.state).followed))
    }

    /// Acks held stream events: their outbox rows are deleted, then their positions settle.
    ///
    /// Deletes are group commits ([`capture::GroupDeletes`]): one at a time, spaced, each
    /// taking every ack queued until it starts. An ack returns once the delete that carried
    /// its rows has, with that delete's outcome. A group of `outbox_emit` events alone runs
    /// no statement, so it neither waits nor counts toward the spacing.
    async fn ack_stream(&self, ids: Vec<SequenceId>) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let acked = ids.len() as u64;
        let now = std::time::Instant::now();
        let sessions = lock(&self.state).holdings.sessions_of(&ids);
        self.deletes
            .ack(
                ids.iter().map(|id| (*id, now)),
                |queued| self.any_has_a_row(queued),
                |events| self.delete_delivered(events),
            )
            .await?;
        Ok(self.settle_copies(&ids, &sessions, acked))
    }

    /// [`State::settle_copies`] as the ack of `ids` returns `acked` to the engine.
    fn settle_copies(&self, ids: &[SequenceId], sessions: &[u64], acked: u64) -> u64 {
        let mut state = lock(&self.state);
        if state.settle_copies(ids, sessions) {
            self.publish_confirmable(&mut state);
        }
        acked
    }

    /// Whether a queued ack has an outbox row to delete (an `outbox_emit` event has none,
    /// and settles without a statement).
    fn any_has_a_row(&self, queued: &[(SequenceId, std::time::Instant)]) -> bool {
        let state = lock(&self.state);
        queued.iter().any(
            |(id, _)| matches!(state.holdings.held.get(id), Some(Held::Stream(held)) if held.row.is_some()),
        )
    }

    /// Deletes the outbox rows of delivered stream events and settles the events. The
    /// stream can carry a transaction a moment before other sessions see its rows (its
    /// commit record is in the WAL before it is visible), so a row the delete does not find
    /// while its transaction is not visible yet is tried again with the next claims, its
    /// event unsettled (the slot waits for it), for up to [`UNDELETED_PATIENCE`], then
    /// swept (`sweep_late_rows`). A row missing although its transaction is visible was
    /// deleted already (adopted, deleted by the application in its own transaction, or its
    /// event sent again after a reconnect): its event settles at once.
    async fn delete_delivered(
        &self,
        events: Vec<(SequenceId, std::time::Instant)>,
    ) -> StoreResult<()> {
        let rows: Vec<OutboxRow> = {
            let state = lock(&self.state);
            events
                .iter()
                .filter_map(|(id, _)| state.held_row(*id))
                .collect()
        };
        let undeleted: HashSet<SequenceId> = if rows.is_empty() {
            HashSet::new()
        } else {
            // In a transaction of its own: its commit is made durable before the slot
            // confirms past these events (see `PgStore::transaction`).
            let (ids, xids) = OutboxRow::params(&rows);
            let delete: &[&(dyn ToSql + Sync)] = &[&ids, &xids];
            let (_, answer) = self
                .main
                .transaction_then_query("ack", &[], Some((&self.sql.delete_delivered, delete)))
                .await?;
            undeleted_ids("ack", &answer)?
        };
        let mut state = lock(&self.state);
        let now = std::time::Instant::now();
        let mut late = Vec::new();
        let (done, wait): (Vec<_>, Vec<_>) = events.into_iter().partition(|(id, since)| {
            let Some(row) = state
                .held_row(*id)
                .filter(|row| undeleted.contains(&row.id))
            else {
                return true;
            };
            let settle = since.elapsed() >= UNDELETED_PATIENCE;
            if settle {
                late.push((row, now));
            }
            settle
        });
        state.late_rows.extend(late);
        state.undeleted.extend(wait);
        self.settle(&mut state, done.into_iter().map(|(id, _)| id));
        Ok(())
    }

    /// Deletes the outbox rows of settled events that were not found within
    /// `UNDELETED_PATIENCE` (`State::late_rows`), at most every `LATE_ROWS_SWEEP`, each
    /// looked for up to `LATE_ROW_PATIENCE` while its commit does not show.
    /// A failure waits for the next sweep.
    async fn sweep_late_rows(&self) {
        let late = {
            let mut state = lock(&self.state);
            let due = state
                .late_rows_swept
                .is_none_or(|at| at.elapsed() >= LATE_ROWS_SWEEP);
            if state.late_rows.is_empty() || !due {
                return;
            }
            state.late_rows_swept = Some(std::time::Instant::now());
            // A bounded number a sweep, in turn: after a reconnect every event sent again
            // may come here, and one statement of them all could outgrow its time bound.
            let take = state.late_rows.len().min(LATE_ROWS_PER_SWEEP);
            state.late_rows.drain(..take).collect::<Vec<_>>()
        };
        let rows: Vec<OutboxRow> = late.iter().map(|(row, _)| *row).collect();
        let (ids, xids) = OutboxRow::params(&rows);
        let delete: &[&(dyn ToSql + Sync)] = &[&ids, &xids];
        // Every row here was not visible yet when last looked for: the delete names those
        // still not visible, and is done with the rest (deleted now, or gone already).
        let swept = self
            .main
            .transaction_then_query("late rows", &[], Some((&self.sql.delete_delivered, delete)))
            .await
            .and_then(|(_, answer)| undeleted_ids("late rows", &answer));
        let missing = match swept {
            Ok(missing) => missing,
            Err(e) => {
                tracing::debug!(error = %e.report(), "deleting late outbox rows; again at the next sweep");
                let keep = late
                    .into_iter()
                    .filter(|(_, since)| since.elapsed() < LATE_ROW_PATIENCE);
                lock(&self.state).late_rows.extend(keep);
                return;
            }
        };
        let showed = rows.len() - missing.len();
        if showed > 0 {
            tracing::info!(
                rows = showed,
                "outbox rows of settled events whose commits showed late (they waited, as on a \
                 synchronous standby) are deleted"
            );
        }
        let (keep, given_up): (Vec<_>, Vec<_>) = late
            .into_iter()
            .filter(|(row, _)| missing.contains(&row.id))
            .partition(|(_, since)| since.elapsed() < LATE_ROW_PATIENCE);
        if !given_up.is_empty() {
            tracing::debug!(
                rows = given_up.len(),
                "outbox rows of settled events whose commits did not show within the patience: \
                 looked for no more"
            );
        }
        // Behind those not swept yet: each sweep takes the next ones.
        lock(&self.state).late_rows.extend(keep);
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
        let (owner, session) = {
            let state = lock(&self.state);
            for entry in entries {
                let Some(Held::Stream(held)) = state.holdings.held.get(&entry.sequence_id) else {
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
            (state.owner.clone(), state.followed.session)
        };
        let dead = columns.params(&[&sequence_ids], &[&attempts, &errors]);
        let guard = SlotGuard::new(&self.slot, &owner);
        let (row_ids, row_xids) = OutboxRow::params(&rows);
        let delete: &[&(dyn ToSql + Sync)] = &[&row_ids, &row_xids];
        let written = self
            .main
            .transaction_if_then_query(
                "dead-letter",
                &guard.steps(&self.sql),
                &[(&self.sql.dead_letter, &dead)],
                Some((&self.sql.delete_delivered, delete)),
            )
            .await?;
        let Some((_, answer)) = written else {
            if !lock(&self.state).fenced_out(session, sequence_ids) {
                // A new session of this relay holds the slot now: written under its owner,
                // the engine's next try goes through.
                return Err(StoreError::new(
                    StoreErrorKind::Conflict,
                    "dead-lettering: the replication session changed while it was written",
                ));
            }
            return Ok(0);
        };
        let undeleted = undeleted_ids("dead-letter", &answer)?;
        let moved = sequence_ids.len() as u64;
        let mut state = lock(&self.state);
        // As a park's (see `flush_parks`): a row not visible yet is deleted once it is.
        let (waiting, done): (Vec<_>, Vec<_>) = sequence_ids.into_iter().partition(|id| {
            state
                .held_row(*id)
                .is_some_and(|row| undeleted.contains(&row.id))
        });
        let now = std::time::Instant::now();
        state
            .undeleted
            .extend(waiting.into_iter().map(|id| (id, now)));
        self.settle(&mut state, done);
        Ok(moved)
    }

    async fn claim(&self, request: ClaimRequest) -> StoreResult<Vec<Claimed>> {
        let status =
            capture::status_for_claim(&self.status, &CaptureStatus::Starting, self.drain).await;
        // Claims fail while the stream is down, so that `/readyz` and the logs say why; they
        // are retried like a lost connection, but the fix is the one the reason names.
        if let CaptureStatus::Failed(reason) | CaptureStatus::Reconnecting(reason) = &status {
            // Under `parking`, as every other follow: a park in flight is of one session.
            let _parking = self.parking.lock().await;
            self.follow_live_session(&mut *self.outputs.lock().await);
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
        self.sweep_late_rows().await;
        let _parking = self.parking.lock().await;
        // Parks that failed last time go first: later events of their keys wait for them.
        self.flush_parks().await?;
        let mut out = Vec::new();
        let mut outputs = self.outputs.lock().await;
        // Nothing of a session that ended is handed out (see `State::end_session`): a
        // standby, or a relay whose session broke, claims nothing.
        if !self.follow_live_session(&mut outputs) {
            return Ok(out);
        }
        drop(outputs);
        let has_parked = !lock(&self.state).holdings.parked_keys.is_empty();
        if status == CaptureStatus::Streaming && has_parked {
            self.claim_parked(&request, &mut out).await?;
        }
        let parked = out.len();
        let mut outputs = self.outputs.lock().await;
        // Again before anything of the stream is handed out: the session may have ended
        // while this claim waited (on the parked table, on the outputs' lock), and an
        // ex-holder would publish what the slot's new holder publishes too.
        let following = self.follow_live_session(&mut outputs);
        if following {
            lock(&self.state).redeliver_into(&mut out, request.limit);
        }
        let redelivered = out.len();
        // Outputs that are no event (keepalives, commits) cost a claim little, but count
        // against its budget: at a limit of one (the first claim, or events as large as
        // the memory budget) four a claim fell behind a busy server's keepalives, and the
        // next event waited behind them for good.
        let (limit, budget) = (
            request.limit,
            (request.limit * 4).max(MIN_OUTPUTS_PER_CLAIM),
        );
        let mut received = 0;
        if following {
            loop {
                received +=
                    self.accept_outputs(&mut lock(&self.state), &mut out, limit, budget - received);
                if out.len() >= limit || received >= budget {
                    break;
                }
                match outputs.try_recv() {
                    Ok(item) => lock(&self.state).accept(item),
                    Err(_) => break,
                }
                // The session may end meanwhile: what it still sends is dropped.
                if !self.follow_live_session(&mut outputs) {
                    break;
                }
            }
        }
        if following && self.drain && received == 0 && out.is_empty() && !lock(&self.state).drained
        {
            // Nothing yet, and the marker not reached: wait a little for the stream rather
            // than let the engine conclude that the drain is over.
            if let Ok(Some(item)) =
                tokio::time::timeout(Duration::from_secs(1), outputs.recv()).await
            {
                lock(&self.state).accept(item);
                if self.follow_live_session(&mut outputs) {
                    self.accept_outputs(&mut lock(&self.state), &mut out, limit, budget);
                }
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
                session = lock(&self.state).followed.session,
                ids = ?out.iter().map(Claimed::sequence_id).collect::<Vec<_>>(),
                parked,
                redelivered = redelivered - parked,
                from_stream = out.len() - redelivered,
                outputs = received,
                oldest_ms,
                "claimed"
            );
        }
        let unpark = |keys| self.unpark_keys_locked(keys);
        capture::after_claim(self, unpark, || self.flush_parks()).await;
        Ok(out)
    }

    /// Claims rows of the parked table into `out`, within the memory budget
    /// ([`capture::claim_parked`]).
    async fn claim_parked(
        &self,
        request: &ClaimRequest,
        out: &mut Vec<Claimed>,
    ) -> StoreResult<()> {
        let (none_out, largest) = {
            let state = lock(&self.state);
            (state.holdings.no_parked_row_out(), state.largest_parked)
        };
        let rows =
            capture::claim_parked_sized(&self.parked, &self.memory, request, none_out, largest)
                .await?;
        tracing::debug!(claimed = ?capture::describe_claimed(&rows), "claimed parked rows");
        let not_held = lock(&self.state).holdings.hold_parked(rows, out);
        capture::release_not_held(&self.parked, &request.node, not_held).await;
        Ok(())
    }

    /// Whether claims may hand out events of the session they follow: it is the one that
    /// streams now, and no write found the slot with another session. When not, the
    /// session is ended ([`State::end_session`]) and what it left queued is dropped, up to
    /// the next session's announcement (then followed, when it is the live one): its
    /// events come again from the slot. (Left queued, they also filled the channel while
    /// claims failed, and the reader, blocked on announcing the new session, never set the
    /// status that lets claims through.)
    fn follow_live_session(&self, outputs: &mut mpsc::Receiver<Item>) -> bool {
        lock(&self.state).follow(self.live.get(), || outputs.try_recv().ok())
    }

    async fn backlog(&self) -> StoreResult<Backlog> {
        let mut backlog = self.parked.backlog().await?;
        self.report_slot().await;
        ::metrics::gauge!(metric::MEMORY_HELD).set(self.memory.held() as f64);
        ::metrics::gauge!(metric::MEMORY_PEAK).set(self.memory.peak() as f64);
        self.settle_stall();
        let state = lock(&self.state);
        state.holdings.add_stream_backlog(&mut backlog);
        if self.drain && !state.drained {
            // Events the stream has not handed over yet, of an age unknown: the drain must
            // not take them for events that arrived after it began (all younger than the
            // run).
            backlog.pending += 1;
            backlog.oldest_pending_age = None;
        }
        Ok(backlog)
    }

    /// Sets the slot gauges (errors only logged: metrics must not stop the relay).
    async fn report_slot(&self) {
        let streaming = *self.status.borrow() == CaptureStatus::Streaming;
        ::metrics::gauge!(metric::STREAMING).set(if streaming { 1.0 } else { 0.0 });
        match slot_status(&self.main, &self.slot).await {
            Ok(status) => {
                // A slot dropped or invalidated holds no WAL and no catalog rows back, and
                // its lag is unknown: the gauges say so, not their last values.
                let status = status.unwrap_or_default();
                let retained = status.retained_bytes.map_or(0.0, |b| b as f64);
                ::metrics::gauge!(metric::SLOT_RETAINED_BYTES).set(retained);
                let lag = status.lag_bytes.map_or(f64::NAN, |b| b as f64);
                ::metrics::gauge!(metric::SLOT_LAG_BYTES).set(lag);
                let age = status.catalog_xmin_age.map_or(0.0, |a| a as f64);
                ::metrics::gauge!(metric::SLOT_XMIN_AGE).set(age);
            }
            Err(e) => tracing::debug!(error = %e.report(), "cannot read the slot's position"),
        }
    }
}

/// The ids a `delete_delivered` statement did not find, from its `answer`.
fn undeleted_ids(
    context: &'static str,
    answer: &[tokio_postgres::Row],
) -> StoreResult<HashSet<SequenceId>> {
    array_column(context, answer, 0)
}

/// Column `i` of a statement's one row, an array, as a set (empty without a row).
fn array_column<T>(
    context: &'static str,
    answer: &[tokio_postgres::Row],
    i: usize,
) -> StoreResult<HashSet<T>>
where
    T: std::hash::Hash + Eq + for<'a> tokio_postgres::types::FromSql<'a>,
{
    let values: Vec<T> = answer
        .first()
        .map(|row| row.try_get(i))
        .transpose()
        .map_err(|e| {
            StoreError::new(StoreErrorKind::Query, format!("{context}: column {i}")).with_source(e)
        })?
        .unwrap_or_default();
    Ok(values.into_iter().collect())
}

/// How often the rows not found within [`UNDELETED_PATIENCE`] are looked for again, and for
/// how long (see `Inner::sweep_late_rows`).
const LATE_ROWS_SWEEP: Duration = Duration::from_secs(5);
const LATE_ROW_PATIENCE: Duration = Duration::from_secs(3600);
const LATE_ROWS_PER_SWEEP: usize = 10_000;

/// How long a delivered event's outbox row is looked for (see `Inner::delete_delivered`).
pub const UNDELETED_PATIENCE: Duration = Duration::from_secs(5);

/// An idle slot keeping more WAL than this makes `check` warn, and so does an active one
/// whose confirmed position is this far behind.
pub const SLOT_RETAINED_WARNING: i64 = 256 * 1024 * 1024;

/// An idle slot whose catalog_xmin is this many transactions old makes `check` warn: a
/// relay keeps it within seconds of the present.
pub const SLOT_XMIN_AGE_WARNING: i64 = 1_000_000;

impl OutboxStore for WalStore {
    fn describe(&self) -> String {
        format!(
            "postgres {} (WAL capture, slot {})",
            self.inner.main.tables().outbox,
            self.inner.slot
        )
    }

    /// The stream hands out what comes, in commit order (parked rows are the polling
    /// store's, which are claimed apart).
    fn leaves_out_crowded_keys(&self) -> bool {
        false
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let inner = self.inner.clone();
        async move { inner.claim(request).await }.boxed()
    }

    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let node = holder.node;
        let inner = self.inner.clone();
        async move {
            let (acked, stream) = inner
                .settle_parked(
                    ids,
                    |id| *id,
                    |p, ids| p.ack(LeaseHolder::unfenced(node), ids),
                    true,
                )
                .await?;
            Ok(acked + inner.ack_stream(stream).await?)
        }
        .boxed()
    }

    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        let node = holder.node;
        let inner = self.inner.clone();
        async move {
            let (recorded, stream) = inner
                .settle_parked(
                    retries,
                    |r| r.sequence_id,
                    |p, rs| p.retry_later(LeaseHolder::unfenced(node), rs),
                    false,
                )
                .await?;
            if stream.is_empty() {
                return Ok(recorded);
            }
            // A retry of an earlier session's event is forgotten (its attempts and delay with
            // it): the session that streams now reads it again, in order with its key's
            // events. Counted as recorded: the engine is done with it, and would otherwise
            // take it for a lease lost.
            let forgotten = std::sync::atomic::AtomicU64::new(0);
            let retries = |state: &mut State| {
                let n = stream.len();
                let kept = state.forget_earlier_sessions(stream, |r| r.sequence_id);
                let gone = (n - kept.len()) as u64;
                forgotten.store(gone, std::sync::atomic::Ordering::Relaxed);
                kept.into_iter()
                    .map(|retry| Park {
                        attempts: retry.attempts,
                        error: Some(retry.error),
                        delay: retry.delay,
                        ..Park::behind_its_key(retry.sequence_id)
                    })
                    .collect()
            };
            let parked = inner.park_stream(retries).await?;
            Ok(recorded + parked + forgotten.load(std::sync::atomic::Ordering::Relaxed))
        }
        .boxed()
    }

    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        let node = holder.node;
        let inner = self.inner.clone();
        async move {
            let (moved, stream) = inner
                .settle_parked(
                    entries,
                    |e| e.sequence_id,
                    |p, es| p.dead_letter(LeaseHolder::unfenced(node), es),
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
            if let Err(e) = inner.park_stream(|state| state.released(stream)).await {
                tracing::warn!(error = %e.report(), "parking released events failed; trying again with the next claim");
            }
            Ok(released + n)
        }
        .boxed()
    }

    /// Only the parked table leases rows: the stream's are held in memory. (A stream
    /// event's id among `held` only keeps a parked row of that id leased.)
    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        self.inner.parked.release_unheld(node, held)
    }

    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let parked = &inner.parked;
            capture::extend_leases(&*inner, parked, extension, |id| id).await
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

    /// The database answers, the slot is confirmed as its settled events allow (a relay
    /// whose confirmations stopped holds the server's WAL while it delivers on), and it
    /// parks what must wait.
    fn lock_holders(&self) -> Option<StoreFuture<outbox_core::store::LockHolders>> {
        self.inner.main.lock_holders()
    }

    fn ping(&self) -> StoreFuture<()> {
        let inner = self.inner.clone();
        async move {
            inner.main.ping().await?;
            let settle_stall = inner.settle_stall();
            let stall = inner
                .confirm_stall
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone()
                .or_else(|| lock(&inner.state).holdings.refused_parks_stall())
                .or(settle_stall);
            match stall {
                Some(why) => Err(StoreError::new(StoreErrorKind::Query, why)),
                None => Ok(()),
            }
        }
        .boxed()
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

    /// The SQL sessions' (the replication session gives way by its own rules).
    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        self.inner.main.give_way_to_shutdown()
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

    /// Parks are cut into statements that fit, in order; one larger than a statement goes
    /// alone (PostgreSQL takes a value up to 1 GiB).
    #[test]
    fn parks_are_cut_into_statements_of_at_most_the_statements_bytes() {
        let mib = 1024 * 1024;
        assert_eq!(parks_that_fit([10, 20, 30].into_iter(), 60), 3);
        assert_eq!(parks_that_fit([10, 20, 31].into_iter(), 60), 2);
        assert_eq!(
            parks_that_fit([70, 1].into_iter(), 60),
            1,
            "one too large goes alone"
        );
        assert_eq!(parks_that_fit(std::iter::empty(), 60), 0);
        // A sink's outage with 1 MiB events and a budget of 2 GiB: 64 a statement.
        let outage = std::iter::repeat_n(mib, 2048);
        assert_eq!(parks_that_fit(outage, PARK_STATEMENT_BYTES), 64);
    }
}
