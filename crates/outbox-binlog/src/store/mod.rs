//! Binlog capture as an [`OutboxStore`]: the engine claims, acks, retries and dead-letters
//! rows read from the binary log exactly as it does rows of a polled table, so the sinks,
//! routes, retries, dead letters, metrics and shutdown are the polling relay's.
//!
//! # Where each row is until it is settled
//! - **In the log.** The reader task runs the [`Capture`] and hands its rows over a bounded
//!   channel, each charged to the memory budget (which bounds what is read ahead and in
//!   flight, in bytes, whatever the transaction's size). Claims take them in commit order.
//! - **Held.** A handed-out row is remembered by its id (the outbox row's `sequence_id`;
//!   a BLACKHOLE row's session and ordinal) until the engine settles it.
//! - **Parked.** A row that must wait (its retry's backoff, an `available_at` in the future,
//!   or an earlier row of its key that waits) is written to the parked table
//!   (`<outbox>_parked`, the native layout's columns) and its outbox row deleted, in one
//!   transaction fenced on the seat's epoch; then it counts as settled. Every later row of
//!   a parked key is parked behind it, in commit order, until the key has nothing parked
//!   left. Parked rows are claimed, retried and dead-lettered by the polling store over the
//!   parked table; only the active reader claims them. Their engine ids are negative.
//! - **Settled.** Delivered (its outbox row deleted, in the table form), parked, or
//!   dead-lettered (a parked row with `dead_at`). The reader stores the position the settled
//!   rows allow ([`crate::Positions`]), never past an unsettled row: a crash at any point
//!   means reading again from there, never loss.
//!
//! # One active reader
//! The seat ([`crate::seat`]) lets one relay read; the others wait as standbys, trying
//! every second, and go on from the stored position once the seat is free or its lease
//! lapsed. A relay that lost the seat hands out nothing more of what it read, and its
//! parks are refused by the fence.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures::future::BoxFuture;
use futures::FutureExt;
use mysql_async::prelude::Queryable;
use mysql_async::{OptsBuilder, Pool, Value};
use outbox_core::memory::{event_bytes, MemoryBudget, EVENT_OVERHEAD};
use outbox_core::redact::first_chars;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, DeadLetter, LeaseExtension, LeaseHolder, OnChange, Problem,
    RetryLater, StoreFuture, StoreResult,
};
use outbox_core::StoreErrorKind;
use outbox_core::{Event, NewEvent, NodeId, OutboxStore, Payload, SequenceId, StoreError};
use outbox_layout::Mapping;
use tokio::sync::{mpsc, watch};

use crate::reread::SettledUnstored;
use crate::seat::SeatConfig;
use crate::{at_or_after, current_position, opts, BinlogConfig, BinlogError, Capture, Output};
use crate::{BinlogPosition, Started};

pub mod event;
mod sql;
pub use sql::ADOPTED_DEAD;
mod state;

use event::{decode, missing_column, needed_columns, Captured};
use outbox_core::capture::{Sessions, SettleWatch};
use sql::{Statements, PARK_PARAMS};
use state::*;

/// Metric names of binlog capture.
pub mod metric {
    /// 1 while this relay reads the binary log, 0 as a standby or while reconnecting.
    pub const READING: &str = "outbox_binlog_reading";
    /// Seconds the reader reads behind the server: from when the server logged the last
    /// transaction read (its events' timestamp) to now; 0 once it has read all the server
    /// wrote (a heartbeat with nothing read and not handed out, or the log's end reached).
    pub const LAG_SECONDS: &str = "outbox_binlog_lag_seconds";
    /// Bytes of binary log written past what the reader has read (every table's); as a
    /// standby or while reconnecting, past the stored position.
    pub const LAG_BYTES: &str = "outbox_binlog_lag_bytes";
    /// Bytes of events capture holds: read ahead of the engine and in flight.
    pub const MEMORY_HELD: &str = "outbox_binlog_memory_held_bytes";
    /// Seconds the oldest transaction held has gone without progress (none of its rows
    /// read or settled), once past [`outbox_core::capture::SETTLE_PATIENCE`]; 0 otherwise.
    pub const SETTLE_STALL_SECONDS: &str = "outbox_binlog_settle_stall_seconds";
}

/// How binlog capture runs.
#[derive(Clone)]
pub struct BinlogStoreOptions {
    pub binlog: BinlogConfig,
    /// The outbox table's layout: the native table's ([`Mapping::native_mysql`]) or a mapped
    /// one's, whose column names its rows are read by and whose `on_success` settles them.
    pub mapping: Mapping,
    pub seat: SeatConfig,
    /// The parked table (`db.table` or `table`).
    pub parked_table: String,
    /// What to do when the stored position's log was purged, said with the refusal.
    pub recovery: String,
    /// The BLACKHOLE form: rows are in the log only (nothing to delete or adopt), and a
    /// transaction's rows are handed out once its commit is read.
    pub blackhole: bool,
    /// `run --drain`: relay what was committed before start-up, then report nothing left.
    pub drain: bool,
    /// Bytes of events held at once, read ahead and in flight.
    pub memory_budget: usize,
    /// The engine's `max_in_flight`: acked events count in it until their delete, so a
    /// delete starts at once when half of it waits
    /// ([`outbox_core::capture::delete_group_enough`]).
    pub max_in_flight: usize,
    /// The polling store over the parked table.
    pub parked: Arc<dyn OutboxStore>,
    /// The store over the outbox table (inserts, pings).
    pub main: Arc<dyn OutboxStore>,
    /// Called when this relay stops reading (the seat lost, the stream broken): the parked
    /// table's store lets go of what makes it the table's claimer, so that the relay that
    /// reads now can claim the parked rows.
    pub on_reading_stopped: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Called when this relay starts reading: the parked table's store takes the claimer's
    /// lock, ending the session of a holder that lost the seat (a relay paused past its
    /// lease keeps that session, and the lock, until the server's `wait_timeout`, 8 hours by
    /// default, and nobody would claim the parked rows). It runs beside the stream, and asks
    /// the [`StillReading`] it is given before it ends anyone's session.
    pub on_reading_started: Option<Arc<dyn Fn(StillReading) + Send + Sync>>,
}

/// Whether this relay still reads the binary log: its session not over, its seat's lease
/// renewed in time (a relay paused past it may have been replaced).
pub type StillReading = Arc<dyn Fn() -> bool + Send + Sync>;

/// Where the reader stands, for claims and `/readyz`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CaptureStatus {
    Starting,
    Reading,
    /// Another relay reads the log.
    Standby {
        holder: String,
    },
    /// The stream broke, or cannot start yet: tried again every second.
    Reconnecting(String),
    /// The reader task stopped on a bug: nothing is read until a restart.
    Failed(String),
}

struct Inner {
    pool: Pool,
    sql: Statements,
    outbox: String,
    /// The outbox's name in the positions table (the fence's key).
    seat_key: String,
    parked: Arc<dyn OutboxStore>,
    main: Arc<dyn OutboxStore>,
    blackhole: bool,
    drain: bool,
    state: Mutex<State>,
    /// Serializes "is this key parked?" with parking and with un-parking, so a key is never
    /// let through while a parked row of it remains.
    parking: tokio::sync::Mutex<()>,
    /// Deletes of delivered rows, as group commits ([`Inner::ack_stream`]).
    deletes: outbox_core::capture::GroupDeletes<SequenceId>,
    /// When the parked keys were last read ([`Inner::look_for_retried_dead_letters`]).
    parked_keys_read: Mutex<std::time::Instant>,
    /// Whether the parked table has its index of waiting keys, once read
    /// ([`Inner::keys_indexed`]).
    keys_indexed: std::sync::OnceLock<bool>,
    /// The role may not set `binlog_row_image` for its session ([`Inner::log_keys_only`]).
    full_images_only: std::sync::atomic::AtomicBool,
    outputs: tokio::sync::Mutex<mpsc::Receiver<Item>>,
    /// Settled ordinals for the reader, by session.
    settled: mpsc::UnboundedSender<Vec<SettledRow>>,
    live: Arc<LiveSession>,
    /// When the seat's lease was last renewed, and for how long it holds.
    renewed: Arc<Renewal>,
    status: watch::Receiver<CaptureStatus>,
    on_change: Arc<Mutex<Option<OnChange>>>,
    close: watch::Sender<bool>,
    reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
    memory: Arc<MemoryBudget>,
    /// The oldest transaction the reading session holds, as the reader last saw it.
    front: Arc<Mutex<Option<ReadFront>>>,
    /// Whether it moves, looked at by the ping and the metrics.
    settle_watch: Mutex<SettleWatch<ReadFront>>,
}

/// The oldest transaction held, by the session reading it (a new one reads it again, from
/// nothing settled).
type ReadFront = (u64, crate::Front);

/// The outbox read from the binary log. Cheap to clone.
#[derive(Clone)]
pub struct BinlogStore {
    inner: Arc<Inner>,
}

impl outbox_core::capture::HoldsEvents<Streamed, Park> for Inner {
    fn with_holdings<R>(
        &self,
        f: impl FnOnce(&mut outbox_core::capture::Holdings<Streamed, Park>) -> R,
    ) -> R {
        f(&mut lock(&self.state).holdings)
    }
}

fn lock<T>(state: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding it would be a bug; its data is still the best there is.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

/// How often claims read the parked table's keys again ([`Inner::look_for_retried_dead_letters`]).
const PARKED_KEYS_REFRESH: Duration = Duration::from_secs(5);

/// Whether the server refused a park for a reason of its own (a trigger's `SIGNAL`, a
/// constraint, a grant revoked on the parked table): not a lost connection, a conflict or
/// a missing table. A revoked grant stopped the relay, and a supervisor's restarts read the
/// same rows again and stopped again, the position never stored; it now holds back the
/// refused rows' keys, as any refusal.
fn refused_statement(e: &mysql_async::Error) -> bool {
    matches!(e, mysql_async::Error::Server(_))
        && matches!(
            outbox_store_mysql::classify(e),
            StoreErrorKind::RowRefused | StoreErrorKind::Query | StoreErrorKind::Privilege
        )
}

fn store_error(context: &str, e: mysql_async::Error) -> StoreError {
    StoreError::new(
        outbox_store_mysql::classify(&e),
        format!("binlog capture: {context}: {e}"),
    )
}

/// The store's own connections (parks, deletes, the parked keys), with the MySQL store's
/// session settings, run anew after each reset the pool does between uses, and its pool's
/// handling of idle connections.
pub fn pool_opts(url: &str) -> Result<mysql_async::Opts, BinlogError> {
    let pool = outbox_store_mysql::pool_opts(STORE_CONNECTIONS)
        .map_err(|e| BinlogError::Config(e.to_string()))?;
    Ok(
        outbox_store_mysql::session_settings(OptsBuilder::from_opts(opts(url)?))
            .pool_opts(pool)
            .into(),
    )
}

/// Room left in a packet for a park statement's text and its protocol's framing.
const PARK_STATEMENT_SLACK: usize = 16 * 1024;

/// The bytes of `values` in a prepared statement's packet, near enough: each value's own and
/// its length's (or a number's 8).
fn values_bytes(values: &[Value]) -> usize {
    values
        .iter()
        .map(|value| match value {
            Value::Bytes(bytes) => bytes.len() + 9,
            _ => 12,
        })
        .sum()
}

/// `parks` cut into statements of at most 1,000 rows (14 values a row: far under the 65,535
/// placeholders a statement may have) and, but for a row alone, `room` bytes of values and
/// of text (`text_per_row` a row).
fn park_statements<'a>(
    parks: &[&'a ParkRow],
    room: usize,
    text_per_row: usize,
) -> Vec<Vec<&'a ParkRow>> {
    let mut statements: Vec<Vec<&ParkRow>> = Vec::new();
    let mut bytes = 0;
    for park in parks {
        let size = values_bytes(&park.params);
        match statements.last_mut() {
            Some(last)
                if last.len() < 1_000
                    && bytes + size <= room
                    && (last.len() + 1) * text_per_row <= room =>
            {
                last.push(park);
                bytes += size;
            }
            _ => {
                statements.push(vec![park]);
                bytes = size;
            }
        }
    }
    statements
}

/// What the server answers a statement past its `max_allowed_packet`
/// (ER_NET_PACKET_TOO_LARGE), said before sending it: a refused value
/// ([`outbox_store_mysql::refuses_a_value`]), so the park is dead-lettered without it.
fn packet_too_large(bytes: usize, packet: Option<u64>) -> mysql_async::Error {
    mysql_async::Error::Server(mysql_async::ServerError {
        code: 1153,
        state: "08S01".into(),
        message: format!(
            "the row takes {bytes} bytes, more than the server's max_allowed_packet ({}): \
             raise it (SET GLOBAL max_allowed_packet, and in the server's configuration) to \
             park rows this large",
            packet.map_or("unknown".to_string(), |p| p.to_string())
        ),
    })
}

/// The store's connections at most: parks, deletes and unparks run one at a time each.
const STORE_CONNECTIONS: usize = 10;

impl BinlogStore {
    /// Starts the reader task (it takes the seat, or waits as a standby).
    pub fn start(options: BinlogStoreOptions) -> Result<Self, BinlogError> {
        let pool = Pool::new(pool_opts(&options.binlog.url)?);
        let outbox = format!("{}.{}", options.binlog.database, options.binlog.table);
        let sql = Statements::new(
            &options.mapping,
            &options.parked_table,
            &options.seat.positions,
        )?;
        let (tx, rx) = mpsc::channel(READ_AHEAD);
        let (settled_tx, settled_rx) = mpsc::unbounded_channel();
        let (status_tx, status) = watch::channel(CaptureStatus::Starting);
        let (close, close_rx) = watch::channel(false);
        let on_change: Arc<Mutex<Option<OnChange>>> = Arc::default();
        let memory = MemoryBudget::new(options.memory_budget);
        let live = Arc::new(LiveSession::default());
        let renewed = Arc::new(Renewal::new(options.seat.lease));
        let front = Arc::new(Mutex::new(None));
        let reader = Reader {
            front: front.clone(),
            renewed: renewed.clone(),
            binlog: options.binlog.clone(),
            seat: options.seat.clone(),
            mapping: options.mapping.clone(),
            needed: needed_columns(&options.mapping, options.blackhole),
            columns_checked: None,
            adoption: if options.blackhole {
                Vec::new()
            } else {
                sql.adoption()
            },
            pool: pool.clone(),
            sql: sql.clone(),
            drain: options.drain,
            on_reading_stopped: options.on_reading_stopped.clone(),
            on_reading_started: options.on_reading_started.clone(),
            hold_to_commit: options.blackhole,
            recovery: options.recovery.clone(),
            last_problem: None,
            tx,
            settled: settled_rx,
            unstored: SettledUnstored::default(),
            silence: SilenceWindow::new(),
            live: live.clone(),
            status: status_tx,
            close: close_rx,
            on_change: on_change.clone(),
            memory: memory.clone(),
            session: 0,
            lag_measured: None,
        };
        let stopped = reader.status.clone();
        let handle = tokio::spawn(tracing::Instrument::in_current_span(
            outbox_core::capture::run_reader("binlog", reader.run(), move |reason| {
                drop(stopped.send_replace(CaptureStatus::Failed(reason)))
            }),
        ));
        Ok(BinlogStore {
            inner: Arc::new(Inner {
                pool,
                sql,
                outbox,
                seat_key: options.seat.outbox.clone(),
                parked: options.parked,
                main: options.main,
                blackhole: options.blackhole,
                drain: options.drain,
                state: Mutex::new(State::new(options.blackhole).reading(live.clone())),
                parking: tokio::sync::Mutex::new(()),
                deletes: outbox_core::capture::GroupDeletes::new(options.max_in_flight),
                full_images_only: Default::default(),
                parked_keys_read: Mutex::new(std::time::Instant::now()),
                keys_indexed: std::sync::OnceLock::new(),
                outputs: tokio::sync::Mutex::new(rx),
                settled: settled_tx,
                live,
                renewed,
                status,
                on_change,
                close,
                reader: Mutex::new(Some(handle)),
                memory,
                front,
                settle_watch: Mutex::new(SettleWatch::new(outbox_core::capture::SETTLE_PATIENCE)),
            }),
        })
    }

    /// How long the oldest transaction held may go without progress before `/readyz` says
    /// the capture is stalled: [`outbox_core::capture::SETTLE_PATIENCE`] unless a test
    /// shortens it.
    pub fn set_settle_patience(&self, patience: Duration) {
        *lock(&self.inner.settle_watch) = SettleWatch::new(patience);
    }

    pub fn status(&self) -> CaptureStatus {
        self.inner.status.borrow().clone()
    }

    /// Waits until the reader reads (or `timeout` passes).
    pub async fn wait_reading(&self, timeout: Duration) -> CaptureStatus {
        let mut status = self.inner.status.clone();
        let _ =
            tokio::time::timeout(timeout, status.wait_for(|s| *s == CaptureStatus::Reading)).await;
        self.status()
    }

    /// The most bytes of events held at once so far (read ahead and in flight), against
    /// the memory budget.
    pub fn memory_peak(&self) -> usize {
        self.inner.memory.peak()
    }

    /// Undecodable rows this capture dead-lettered itself, outside the engine's count (see
    /// `State::dead_by_capture`), counted once written.
    pub fn dead_lettered_by_capture(&self) -> u64 {
        lock(&self.inner.state).dead_by_capture
    }

    /// How many keys have rows waiting in the parked table (or about to be written there).
    pub fn parked_keys(&self) -> usize {
        lock(&self.inner.state).holdings.parked_keys.len()
    }

    /// Stores the position the settled rows allow and gives the seat up (within `wait`),
    /// which lets a standby take over at once. Call it after the engine stopped.
    pub async fn close(&self, wait: Duration) {
        let _ = self.inner.close.send(true);
        let handle = self.inner.reader.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = handle {
            if tokio::time::timeout(wait, handle).await.is_err() {
                tracing::warn!(
                    "the binlog reader did not stop in time; a standby takes over once the \
                     seat's lease lapses, and what was not stored is read again"
                );
            }
        }
    }
}

/// The reader stores its position at least this often (and every third of the seat's
/// lease): what a session settled past the stored position is kept for the next one to
/// settle unsent (`SettledUnstored`), about this long's worth of rows, and read again.
const STORE_AT_MOST_EVERY: Duration = Duration::from_secs(1);

/// Items the channel holds: the memory budget bounds the bytes, this the count of small
/// ones.
const READ_AHEAD: usize = 4096;

impl Inner {
    /// Settles held stream rows and passes their ordinals to the reader.
    fn settle(&self, state: &mut State, ids: impl IntoIterator<Item = SequenceId>) {
        state.settle(ids);
        self.pass_settled(state);
    }

    /// Tells the reader of the rows settled since it was last told, so that it stores the
    /// position they allow (claims settle copies unsent too, [`State::accept_outputs`]).
    fn pass_settled(&self, state: &mut State) {
        if !state.settled.is_empty() {
            let _ = self.settled.send(std::mem::take(&mut state.settled));
        }
    }

    /// Writes `to_park` to the parked table (and deletes their outbox rows) in one
    /// transaction fenced on the seat, then settles them; parks that must wait stay queued.
    /// Call it holding `parking`.
    ///
    /// A row the parked table refuses (a payload nested deeper than the server's JSON
    /// allows, a mapped table's longer mutation id) would fail every try, and every claim
    /// with it, since parks go first. When the batch is refused, the parks are written one
    /// by one, in order, and a refused one is dead-lettered in a form the table stores
    /// ([`unparkable_values`]). A park refused alone for any other reason (a trigger, a
    /// constraint no check foresees) holds back its own key only: set aside, a second and
    /// then twice as long each time ([`outbox_core::capture::Holdings::refused_parks`]),
    /// its later events queued behind it.
    async fn flush_parks(&self) -> StoreResult<u64> {
        let now = Instant::now();
        let (parks, values, epoch) = {
            let mut state = lock(&self.state);
            let parks = state.holdings.take_parks();
            let (parks, refused) = state.holdings.set_aside_refused_parks(parks, now);
            state.holdings.requeue_parks(refused);
            let values: Vec<ParkRow> = parks
                .iter()
                .map(|park| match state.holdings.held.get(&park.id) {
                    Some(Held::Stream(s)) => {
                        let mut params = Vec::with_capacity(PARK_PARAMS);
                        park_values(park, &s.body, &mut params);
                        let copied = match (&s.body, s.row) {
                            (Body::Undecodable(u), Some(row)) => Some(CopiedDeadLetter {
                                row,
                                error: fitted_error(park.error.as_deref().unwrap_or(&u.reason))
                                    .to_string(),
                            }),
                            _ => None,
                        };
                        ParkRow {
                            params,
                            row: s.row,
                            copied,
                            payload_from_table: false,
                        }
                    }
                    _ => ParkRow {
                        params: Vec::new(),
                        row: None,
                        copied: None,
                        payload_from_table: false,
                    },
                })
                .collect();
            (parks, values, state.epoch)
        };
        if parks.is_empty() {
            return Ok(0);
        }
        let mut written = HashSet::new();
        let mut dead_instead = Vec::new();
        let outcome = match self.write_parks(&values, epoch).await {
            Ok(fenced_in) => {
                if fenced_in {
                    written.extend(parks.iter().map(|p| p.id));
                }
                Ok(fenced_in)
            }
            Err(e) if outbox_store_mysql::refuses_a_value(&e) || refused_statement(&e) => {
                let written = &mut written;
                self.write_parks_one_by_one(&parks, values, epoch, now, written, &mut dead_instead)
                    .await
            }
            Err(e) => Err(store_error("parking rows", e)),
        };
        let mut state = lock(&self.state);
        let (parks, unwritten): (Vec<Park>, Vec<Park>) =
            parks.into_iter().partition(|p| written.contains(&p.id));
        if tracing::enabled!(tracing::Level::DEBUG) && !parks.is_empty() {
            // Each parked row's stream id with its event id, for a soak's forensics.
            let parked: Vec<String> = parks
                .iter()
                .map(|p| match state.holdings.held.get(&p.id) {
                    Some(Held::Stream(s)) => match &s.body {
                        Body::Event(e) => format!("{}={}", p.id, e.event_id),
                        Body::Undecodable(_) => p.id.to_string(),
                    },
                    _ => p.id.to_string(),
                })
                .collect();
            tracing::debug!(?parked, "parked");
        }
        let n = parks.len() as u64;
        state.dead_by_capture += parks
            .iter()
            .filter(|p| p.dead_by_capture || (dead_instead.contains(&p.id) && !p.dead))
            .count() as u64;
        // A dead letter's key waited for its write only: nothing of it waits in the parked
        // table for it (`still_parked` counts no dead rows), so the key is checked again.
        let dead_keys: Vec<String> = parks
            .iter()
            .filter(|p| p.dead || dead_instead.contains(&p.id))
            .filter_map(|p| match state.holdings.held.get(&p.id) {
                Some(Held::Stream(s)) => Some(s.key.clone()),
                _ => None,
            })
            .collect();
        state.holdings.recheck.extend(dead_keys);
        state
            .holdings
            .parked_after_refusal(parks.iter().map(|p| p.id));
        self.settle(&mut state, parks.into_iter().map(|p| p.id));
        match outcome {
            Ok(true) => {
                // Those of keys refused: queued behind the park refused.
                state.requeue_parks(epoch, unwritten);
                Ok(n)
            }
            Ok(false) => {
                state.fenced_out(epoch, unwritten.into_iter().map(|p| p.id));
                Ok(n)
            }
            Err(e) => {
                // Kept, in order, ahead of anything queued since: the next claim tries again.
                state.requeue_parks(epoch, unwritten);
                Err(e)
            }
        }
    }

    /// The parks of a refused batch, each in a transaction of its own and in order; one the
    /// table refuses is written as a dead letter it stores, and one refused for another
    /// reason sets its key aside, with its later parks. Adds to `written` the parks written,
    /// and lists in `dead_instead` those dead-lettered instead.
    async fn write_parks_one_by_one(
        &self,
        parks: &[Park],
        values: Vec<ParkRow>,
        epoch: i64,
        now: Instant,
        written: &mut HashSet<SequenceId>,
        dead_instead: &mut Vec<SequenceId>,
    ) -> StoreResult<bool> {
        for (park, value) in parks.iter().zip(values) {
            let refused_key = |state: &State| match state.holdings.held.get(&park.id) {
                Some(Held::Stream(s)) => (state.holdings.refused_parks.get(&s.key))
                    .is_some_and(|refused| refused.until > now),
                _ => false,
            };
            if refused_key(&lock(&self.state)) {
                continue;
            }
            let refused = match self.write_parks(std::slice::from_ref(&value), epoch).await {
                Ok(true) => None,
                Ok(false) => return Ok(false),
                Err(e) if outbox_store_mysql::refuses_a_value(&e) => Some(e),
                Err(e) if refused_statement(&e) => {
                    let refused = (lock(&self.state).holdings).refuse_park(park.id, Instant::now());
                    tracing::error!(
                        row = park.id,
                        key = refused.as_ref().map(|(key, _)| key.as_str()),
                        again_in = ?refused.as_ref().map(|(_, wait)| wait),
                        error = %e,
                        "the database refused to park this row: its key waits (its later \
                         rows behind it) while the other keys flow, and the park is tried \
                         again later; fix what the error names (a trigger, a constraint or \
                         a column changed on the parked table, or a grant `migrate --capture \
                         binlog --print` lists)"
                    );
                    let key = refused.map(|(key, _)| key);
                    match key {
                        Some(_) => continue,
                        None => return Err(store_error("parking rows", e)),
                    }
                }
                Err(e) => return Err(store_error("parking rows", e)),
            };
            let refused = match refused {
                Some(e) if outbox_store_mysql::too_large_for_the_server(&e) => {
                    match self.park_payload_from_table(park, &value, epoch).await? {
                        Some(true) => None,
                        Some(false) => return Ok(false),
                        None => Some(e),
                    }
                }
                other => other,
            };
            if let Some(refused) = refused {
                let reason = match refused {
                    mysql_async::Error::Server(e) => e.message,
                    other => other.to_string(),
                };
                // The dead letter as the table stores it; failing that (refused again), with
                // nothing of the row but its ids and the refusal.
                let mut dead_written = false;
                for bare in [false, true] {
                    let dead = {
                        let state = lock(&self.state);
                        let mut params = Vec::with_capacity(PARK_PARAMS);
                        if let Some(Held::Stream(s)) = state.holdings.held.get(&park.id) {
                            unparkable_values(park, &s.body, &reason, bare, &mut params);
                        }
                        ParkRow {
                            params,
                            row: value.row,
                            copied: None,
                            payload_from_table: false,
                        }
                    };
                    match self.write_parks(std::slice::from_ref(&dead), epoch).await {
                        Ok(true) => {
                            dead_written = true;
                            break;
                        }
                        Ok(false) => return Ok(false),
                        Err(e) if !bare && outbox_store_mysql::refuses_a_value(&e) => continue,
                        Err(e) => {
                            return Err(store_error(
                                "dead-lettering a row the parked table refused",
                                e,
                            ))
                        }
                    }
                }
                if dead_written {
                    tracing::warn!(row = park.id, %reason, "the parked table refused a row that had to wait: it was dead-lettered in a form the table stores (its last_error says what was kept)");
                    dead_instead.push(park.id);
                }
            }
            written.insert(park.id);
        }
        Ok(true)
    }

    /// Parks a row too large to send with its payload copied by the server from its outbox
    /// row: `Some(written)` (`false`: the seat has another epoch), `None` where it cannot
    /// (no outbox row, an undecodable row, or refused even so), to be dead-lettered.
    async fn park_payload_from_table(
        &self,
        park: &Park,
        value: &ParkRow,
        epoch: i64,
    ) -> StoreResult<Option<bool>> {
        let copied = match lock(&self.state).holdings.held.get(&park.id) {
            Some(Held::Stream(s)) => value.payload_from_table(&s.body),
            _ => None,
        };
        let Some(copied) = copied else {
            return Ok(None);
        };
        match self.write_parks(std::slice::from_ref(&copied), epoch).await {
            Ok(written) => Ok(Some(written)),
            // Whatever the server refuses of the copy (a payload the parked table's JSON
            // column takes only as bound text: a binary column's bytes), the dead letter
            // goes instead, as for a copied dead letter.
            Err(e @ mysql_async::Error::Server(_)) => {
                tracing::debug!(error = %e, "a park copied from the table was refused");
                Ok(None)
            }
            Err(e) => Err(store_error("parking rows", e)),
        }
    }

    /// The park's transaction; `false` when the seat has another epoch (nothing written).
    async fn write_parks(&self, parks: &[ParkRow], epoch: i64) -> Result<bool, mysql_async::Error> {
        let mut conn = self.pool.get_conn().await?;
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await?;
        // The seat's epoch, and the session's max_allowed_packet the statements are sized by.
        let seat: Option<(i64, u64)> = tx
            .exec_first(self.sql.seat_epoch(), (&self.seat_key,))
            .await?;
        let Some((_, packet)) = seat.filter(|(seated, _)| *seated == epoch) else {
            tx.rollback().await?;
            return Ok(false);
        };
        // An undecodable row's dead letter is copied from its table row where that is
        // still there; the values its image gave are the fallback, also where the server
        // refuses the copy (bytes the row's character set cannot convert): a savepoint
        // keeps that refusal from failing the whole park, again at every try.
        let mut copied = Vec::new();
        for park in parks {
            if let Some(dead) = &park.copied {
                tx.query_drop("SAVEPOINT outbox_relay_copy").await?;
                let statement = self.sql.dead_letter_copied();
                match tx.exec_drop(statement, (&dead.error, dead.row)).await {
                    Ok(()) if tx.affected_rows() == 1 => copied.push(dead.row),
                    Ok(()) => {}
                    Err(mysql_async::Error::Server(refused)) => {
                        tracing::warn!(row = dead.row, error = %refused.message, "the undecodable row cannot be copied from the table into its dead letter; it is dead-lettered with what its log image gave");
                        tx.query_drop("ROLLBACK TO SAVEPOINT outbox_relay_copy")
                            .await?;
                    }
                    Err(other) => return Err(other),
                }
            }
        }
        // A park whose row is no longer held (settled meanwhile) has nothing to write.
        let (from_table, written): (Vec<&ParkRow>, Vec<&ParkRow>) = parks
            .iter()
            .filter(|p| !p.params.is_empty())
            .filter(|p| !p.copied.as_ref().is_some_and(|d| copied.contains(&d.row)))
            .partition(|p| p.payload_from_table);
        // Statements past the server's max_allowed_packet are cut off mid-send (the server
        // closes the connection: a broken pipe, as a network failure), so they are sized
        // first: a row alone past it is refused as the server would refuse it.
        let room = usize::try_from(packet)
            .unwrap_or(usize::MAX)
            .saturating_sub(PARK_STATEMENT_SLACK);
        let packet = Some(packet);
        for park in from_table {
            // Its other values (headers) may be past the limit too.
            if values_bytes(&park.params) > room {
                return Err(packet_too_large(values_bytes(&park.params), packet));
            }
            tx.exec_drop(self.sql.park_copied(), park.params.clone())
                .await?;
            if tx.affected_rows() == 0 {
                // Parked already (an earlier try committed, its answer lost: the key is on
                // the duplicate event id), or the outbox row is gone, with nothing to copy.
                let parked: Option<u64> = tx
                    .exec_first(self.sql.parked_event(), (park.params[0].clone(),))
                    .await?;
                if parked.is_none() {
                    return Err(packet_too_large(values_bytes(&park.params), packet));
                }
            }
        }
        // Its text goes in a packet of its own (the statement's preparation), one row's
        // placeholders more for each row.
        let text_per_row = sql::PARK_TEXT_PER_ROW;
        for chunk in park_statements(&written, room, text_per_row) {
            let params: Vec<Value> = chunk
                .iter()
                .flat_map(|p| p.params.iter().cloned())
                .collect();
            if chunk.len() == 1 && values_bytes(&params) > room {
                return Err(packet_too_large(values_bytes(&params), packet));
            }
            debug_assert_eq!(params.len(), chunk.len() * PARK_PARAMS);
            tx.exec_drop(self.sql.park(chunk.len()), params).await?;
        }
        let rows: Vec<i64> = parks.iter().filter_map(|p| p.row).collect();
        if !rows.is_empty() {
            tx.query_drop(self.sql.settle_rows(&rows)).await?;
        }
        tx.commit().await?;
        Ok(true)
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

    async fn unpark_keys_locked(&self, keys: Vec<String>) -> StoreResult<()> {
        let fail = |e: mysql_async::Error| store_error("reading the parked keys", e);
        let mut conn = self.pool.get_conn().await.map_err(fail)?;
        let indexed = self.keys_indexed(&mut conn).await;
        let still = crate::parked::still_parked(&mut conn, self.sql.parked_table(), indexed, &keys)
            .await
            .map_err(fail)?;
        lock(&self.state).unpark(keys, &still);
        Ok(())
    }

    /// Whether the parked table has its index of waiting keys, read once (a table made
    /// before it has none until `migrate`: the keys are then read by a scan, and the relay
    /// says so once). Unknown while it cannot be read: the scan is right either way.
    async fn keys_indexed(&self, conn: &mut mysql_async::Conn) -> bool {
        if let Some(indexed) = self.keys_indexed.get() {
            return *indexed;
        }
        let parked = self.sql.parked_table();
        match crate::parked::keys_indexed(conn, parked).await {
            Ok(indexed) => {
                if !indexed {
                    tracing::warn!(table = parked, "the parked table has no index of its waiting keys: every settle of parked rows reads the whole table (run `outbox-relay migrate --capture binlog`, then restart the relay)");
                }
                *self.keys_indexed.get_or_init(|| indexed)
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the parked table's indexes; reading its keys by a scan");
                false
            }
        }
    }

    /// Settles the parked rows among `items` with the polling store's `statement` (their
    /// ids back to the parked table's); with `unpark` they left the table and their keys
    /// may flow again. Returns how many it settled, and the held stream rows among `items`.
    async fn settle_parked<T>(
        &self,
        items: Vec<T>,
        id: fn(&T) -> SequenceId,
        to_parked: fn(T) -> T,
        statement: impl FnOnce(Arc<dyn OutboxStore>, Vec<T>) -> StoreFuture<u64>,
        unpark: bool,
    ) -> StoreResult<(u64, Vec<T>)> {
        let to_statement = |rows: Vec<T>| {
            statement(
                self.parked.clone(),
                rows.into_iter().map(to_parked).collect(),
            )
        };
        let unpark = unpark.then_some(|keys| self.unpark_keys(keys));
        outbox_core::capture::settle_parked(self, items, id, to_statement, unpark).await
    }

    /// Parks held stream rows (retries, releases, dead letters): `parks` are queued under
    /// `parking`, so no claim runs in between, then every queued park is written.
    async fn park_stream(&self, parks: Vec<Park>) -> StoreResult<u64> {
        let _parking = self.parking.lock().await;
        let queued = lock(&self.state).queue_parks(parks);
        self.flush_parks().await?;
        Ok(outbox_core::capture::parks_done(
            queued,
            &lock(&self.state).followed,
        ))
    }

    /// Acks held stream rows: their outbox rows are deleted (table form), then they settle.
    ///
    /// Deletes are group commits ([`outbox_core::capture::GroupDeletes`]): one at a time,
    /// spaced, each taking every ack queued until it starts. An ack returns once the delete
    /// that carried its rows has, with that delete's outcome. The table-less form deletes
    /// nothing, so it neither waits nor counts toward the spacing.
    async fn ack_stream(&self, ids: Vec<SequenceId>) -> StoreResult<u64> {
        if ids.is_empty() {
            return Ok(0);
        }
        let acked = ids.len() as u64;
        let sessions = lock(&self.state).holdings.sessions_of(&ids);
        self.deletes
            .ack(
                ids.iter().copied(),
                |_| !self.blackhole,
                |group| self.delete_delivered(group),
            )
            .await?;
        Ok(self.settle_copies(&ids, &sessions, acked))
    }

    /// As an engine call about `ids` (which began when their held rows were of `sessions`)
    /// returns `n`, settles the copies a newer session handed out meanwhile, which the
    /// engine dropped ([`outbox_core::capture::Holdings::copies_the_engine_dropped`]).
    fn settle_copies(&self, ids: &[SequenceId], sessions: &[u64], n: u64) -> u64 {
        let mut state = lock(&self.state);
        let current = state.followed.session;
        let copies = state
            .holdings
            .copies_the_engine_dropped(ids, sessions, current);
        self.settle(&mut state, copies);
        n
    }

    /// Deletes the outbox rows of delivered stream rows (table form), then settles them. A
    /// row the log carries is committed, or prepared and about to be (the log is written
    /// before the engine commits): the delete's lock waits for it.
    async fn delete_delivered(&self, ids: Vec<SequenceId>) -> StoreResult<()> {
        let rows: Vec<i64> = {
            let state = lock(&self.state);
            ids.iter()
                .filter_map(|id| match state.holdings.held.get(id) {
                    Some(Held::Stream(s)) => s.row,
                    _ => None,
                })
                .collect()
        };
        if !rows.is_empty() {
            let fail = |e: mysql_async::Error| store_error("deleting delivered rows", e);
            let mut conn = self.pool.get_conn().await.map_err(fail)?;
            self.log_keys_only(&mut conn).await;
            conn.query_drop(self.sql.settle_rows(&rows))
                .await
                .map_err(fail)?;
        }
        self.settle(&mut lock(&self.state), ids);
        Ok(())
    }

    /// Asks the server to log only the key of each row the next statements delete or mark
    /// (`binlog_row_image = MINIMAL`, for this session). With the server's FULL images,
    /// every delivered row's payload went to the log a second time, for the server to write
    /// and for this reader to read back and pass over. A role that may not set it (MySQL
    /// 8 can restrict session variables) keeps the server's setting, said once.
    ///
    /// Deletes only: a layout that marks its delivered rows keeps the server's images, which
    /// another reader of the log may want whole.
    async fn log_keys_only(&self, conn: &mut mysql_async::Conn) {
        let refused = &self.full_images_only;
        if !self.sql.deletes_delivered() || refused.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        match conn
            .query_drop("SET SESSION binlog_row_image = 'MINIMAL'")
            .await
        {
            Ok(()) => {}
            // ER_SPECIFIC_ACCESS_DENIED_ERROR: not this role's to set, for good.
            Err(mysql_async::Error::Server(e)) if e.code == 1227 => {
                refused.store(true, std::sync::atomic::Ordering::Relaxed);
                tracing::info!(error = %e.message, "deletes of delivered rows log their full rows: this role may not set binlog_row_image for its session");
            }
            // Anything else is the connection's, which the delete then reports.
            Err(_) => {}
        }
    }

    /// Every [`PARKED_KEYS_REFRESH`], the keys with rows waiting in the parked table, read
    /// again: `dead retry` (another process) puts dead letters back there, which this
    /// relay's claims would otherwise not look for until its next session, and later rows
    /// of their keys then wait behind them. Call it holding `parking`.
    async fn look_for_retried_dead_letters(&self) -> StoreResult<()> {
        {
            let mut last = lock(&self.parked_keys_read);
            if last.elapsed() < PARKED_KEYS_REFRESH {
                return Ok(());
            }
            *last = std::time::Instant::now();
        }
        // A failure here holds nothing up: the stream goes on, and the next look is due in
        // the same time.
        let keys = match read_parked_keys(&self.pool, &self.sql).await {
            Ok(keys) => keys,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the parked table's keys; trying again in 5 s");
                return Ok(());
            }
        };
        let mut state = lock(&self.state);
        let new: Vec<&String> = keys
            .iter()
            .filter(|key| !state.holdings.waits(key))
            .collect();
        if !new.is_empty() {
            tracing::info!(keys = ?new, "rows put back in the parked table (dead retry): later rows of their keys wait behind them");
        }
        state.holdings.parked_keys.extend(keys);
        Ok(())
    }

    async fn claim(&self, request: ClaimRequest) -> StoreResult<Vec<Claimed>> {
        let status = outbox_core::capture::status_for_claim(
            &self.status,
            &CaptureStatus::Starting,
            self.drain,
        )
        .await;
        if let CaptureStatus::Reconnecting(reason) | CaptureStatus::Failed(reason) = &status {
            // Under `parking`, as every other follow: a park in flight is of one session.
            let _parking = self.parking.lock().await;
            self.follow_live_session(&mut *self.outputs.lock().await);
            return Err(StoreError::new(
                StoreErrorKind::Connection,
                format!("binlog capture: {reason}"),
            )
            .with_hint(
                "binlog capture cannot read until the cause above is fixed (the relay keeps \
                 trying); `outbox-relay check --capture binlog` lists what it finds",
            ));
        }
        let _parking = self.parking.lock().await;
        // Parks that failed last time go first: later rows of their keys wait for them.
        self.flush_parks().await?;
        let mut out = Vec::new();
        let mut outputs = self.outputs.lock().await;
        if !self.follow_live_session(&mut outputs) {
            return Ok(out);
        }
        drop(outputs);
        if status == CaptureStatus::Reading {
            self.look_for_retried_dead_letters().await?;
        }
        let has_parked = !lock(&self.state).holdings.parked_keys.is_empty();
        if status == CaptureStatus::Reading && has_parked {
            self.claim_parked(&request, &mut out).await?;
        }
        let limit = request.limit;
        let mut outputs = self.outputs.lock().await;
        let mut following;
        loop {
            // Again before anything is handed out: the lease may have lapsed, or the
            // session ended, while this claim waited (on the parked table, a dead letter
            // put back): an ex-reader would hand out rows the new one delivers too.
            following = self.follow_live_session(&mut outputs);
            if !following {
                break;
            }
            lock(&self.state).accept_outputs(&mut out, limit);
            if out.len() >= limit {
                break;
            }
            match outputs.try_recv() {
                Ok(item) => lock(&self.state).accept(item),
                Err(_) => break,
            }
        }
        if following && self.drain && out.is_empty() && !lock(&self.state).drained() {
            // Nothing yet, and the start-up position not reached: wait a little for the
            // log rather than let the engine conclude that the drain is over.
            if let Ok(Some(item)) =
                tokio::time::timeout(Duration::from_secs(1), outputs.recv()).await
            {
                lock(&self.state).accept(item);
                if self.follow_live_session(&mut outputs) {
                    lock(&self.state).accept_outputs(&mut out, limit);
                }
            }
        }
        drop(outputs);
        self.pass_settled(&mut lock(&self.state));
        let unpark = |keys| self.unpark_keys_locked(keys);
        outbox_core::capture::after_claim(self, unpark, || self.flush_parks()).await;
        Ok(out)
    }

    /// Claims rows of the parked table into `out`, within the memory budget
    /// ([`outbox_core::capture::claim_parked`]), each under its engine id ([`parked_id`]).
    async fn claim_parked(
        &self,
        request: &ClaimRequest,
        out: &mut Vec<Claimed>,
    ) -> StoreResult<()> {
        let none_out = lock(&self.state).holdings.no_parked_row_out();
        let rows = outbox_core::capture::claim_parked(
            self.parked.as_ref(),
            &self.memory,
            request,
            none_out,
        )
        .await?;
        tracing::debug!(claimed = ?outbox_core::capture::describe_claimed(&rows), "claimed parked rows");
        let rows = rows
            .into_iter()
            .map(|(row, memory)| (with_parked_id(row), memory))
            .collect();
        let not_held = lock(&self.state).holdings.hold_parked(rows, out);
        let not_held = not_held.into_iter().map(state::parked_row).collect();
        outbox_core::capture::release_not_held(self.parked.as_ref(), &request.node, not_held).await;
        Ok(())
    }

    /// Whether claims may hand out rows of the session they follow (see [`State::follow`]).
    /// Not while the seat's lease has run out without a renewal: a relay resumed after a
    /// pause (SIGSTOP, a frozen VM, a store held up past the lease) may have been replaced
    /// meanwhile, and its claims can run before its reader finds out. That alone does not
    /// end the session: a reader that renews the seat goes on with it, and one that finds
    /// the seat taken ends it (the epoch fences its writes meanwhile).
    fn follow_live_session(&self, outputs: &mut mpsc::Receiver<Item>) -> bool {
        if self.renewed.lapsed() {
            return false;
        }
        lock(&self.state).follow(self.live.get(), || outputs.try_recv().ok())
    }

    /// Looks whether the oldest transaction held moved since the last look; sets the
    /// stall gauge, logs a stall once, and returns what `/readyz` says of it. A row handed
    /// out and never settled (a bug, or a sink that never answers past its timeout) stops
    /// the stored position for good while later rows flow, and only this tells.
    fn settle_stall(&self) -> Option<String> {
        // A refused park is a stall `/readyz` names already.
        let front = *lock(&self.front);
        let refused = !lock(&self.state).holdings.refused_parks.is_empty();
        let front = front.filter(|_| !refused);
        let stalled = lock(&self.settle_watch).look(front, std::time::Instant::now());
        let seconds = stalled.map_or(0.0, |s| s.still.as_secs_f64());
        ::metrics::gauge!(metric::SETTLE_STALL_SECONDS).set(seconds);
        let (stalled, (_, front)) = stalled.zip(front)?;
        let described = format!(
            "{} of its {} row(s) read unsettled{}{}",
            front.unsettled,
            front.read,
            front
                .first
                .map_or(String::new(), |id| format!(", the first row {id}")),
            if front.committed {
                ""
            } else {
                ", its commit not read yet"
            },
        );
        Some(stalled.report(
            "binlog",
            &described,
            "the stored position moves no further, and the server may purge the binary \
             logs past it",
        ))
    }

    async fn backlog(&self) -> StoreResult<Backlog> {
        let mut backlog = self.parked.backlog().await?;
        // The rows still in the outbox table: held and queued ones, but also any the log
        // never brings (written with `sql_log_bin = 0`), which waited for good while the
        // backlog and its age said nothing was pending. A BLACKHOLE outbox keeps none.
        let table = match self.blackhole {
            true => Backlog::default(),
            false => self.main.backlog().await?,
        };
        let reading = *self.status.borrow() == CaptureStatus::Reading;
        ::metrics::gauge!(metric::READING).set(if reading { 1.0 } else { 0.0 });
        ::metrics::gauge!(metric::MEMORY_HELD).set(self.memory.held() as f64);
        self.settle_stall();
        let state = lock(&self.state);
        let mut stream = Backlog::default();
        state.holdings.add_stream_backlog(&mut stream);
        // Rows read and not handed out yet: queued, or (a BLACKHOLE outbox) held until their
        // transaction's commit is read.
        stream.pending += (state.unaccepted.len() + state.uncommitted.len()) as u64;
        // Held rows are in the table until delivered: the larger count, not the sum.
        backlog.pending += stream.pending.max(table.pending);
        backlog.oldest_pending_age = [
            backlog.oldest_pending_age,
            stream.oldest_pending_age,
            table.oldest_pending_age,
        ]
        .into_iter()
        .flatten()
        .max();
        if self.drain && !state.drained() {
            // Rows the log has not handed over yet, of an age unknown: the drain must not
            // take them for rows that arrived after it began (all younger than the run).
            backlog.pending += 1;
            backlog.oldest_pending_age = None;
        }
        Ok(backlog)
    }

    fn describe(&self) -> String {
        format!(
            "mysql {} (binlog capture{})",
            self.outbox,
            if self.blackhole { ", BLACKHOLE" } else { "" }
        )
    }
}

/// The values of one park ([`sql::Statements::park`]).
/// `text` cut to what the parked table's `varchar` columns hold.
fn fitted(text: &str) -> &str {
    first_chars(text, event::PARKED_TEXT_CHARS)
}

/// A claimed row of the parked table under its engine id ([`parked_id`]).
fn with_parked_id(row: Claimed) -> Claimed {
    match row {
        Claimed::Event(event) => Claimed::Event(Arc::new(Event {
            sequence_id: parked_id(event.sequence_id),
            ..(*event).clone()
        })),
        Claimed::Undecodable {
            sequence_id,
            ordering_key,
            destination,
            attempts,
            reason,
        } => Claimed::Undecodable {
            sequence_id: parked_id(sequence_id),
            ordering_key,
            destination,
            attempts,
            reason,
        },
    }
}

/// One park's values ([`PARK_PARAMS`] of them), and the outbox row it deletes (the table
/// form's).
struct ParkRow {
    params: Vec<Value>,
    row: Option<i64>,
    /// For an undecodable row of the table: its dead letter, copied from the table.
    copied: Option<CopiedDeadLetter>,
    /// The payload is copied from the outbox row `row` by the server
    /// ([`Statements::park_copied`](sql::Statements::park_copied)), `params` holding the
    /// rest: a row too large to send.
    payload_from_table: bool,
}

impl ParkRow {
    /// This park with its payload copied by the server from the outbox row, if it has one
    /// (the table form's) and decoded (an event's payload is at [`PAYLOAD_PARAM`]).
    fn payload_from_table(&self, body: &Body) -> Option<ParkRow> {
        let (Body::Event(_), Some(row)) = (body, self.row) else {
            return None;
        };
        let mut params = self.params.clone();
        params.remove(PAYLOAD_PARAM);
        params.push(Value::from(row));
        Some(ParkRow {
            params,
            row: self.row,
            copied: None,
            payload_from_table: true,
        })
    }
}

/// Where a park's payload is among its values ([`park_values`]).
const PAYLOAD_PARAM: usize = 4;

/// An undecodable row's dead letter, copied from its outbox row `row` with `error`
/// ([`Statements::dead_letter_copied`](sql::Statements::dead_letter_copied)).
struct CopiedDeadLetter {
    row: i64,
    error: String,
}

/// A row the parked table refused as it is, as a dead letter it stores: the payload as a
/// JSON string of its text (never nested, whatever the server's JSON allows), the mutation
/// id cut to the column's length, and the refusal as its error. `bare`: with no payload,
/// headers or mutation id at all, the form for a row refused even so.
fn unparkable_values(park: &Park, body: &Body, refusal: &str, bare: bool, params: &mut Vec<Value>) {
    let kept = match bare {
        false => format!(
            "its payload kept as a JSON string of its text and a mutation id longer than {} \
             characters cut",
            event::PARKED_TEXT_CHARS
        ),
        true => "without its payload, headers and mutation id, which the table refused even \
                 as text"
            .to_string(),
    };
    let error = format!(
        "it had to wait in the parked table{}, which refused it ({refusal}): dead-lettered \
         instead, {kept}",
        park.error
            .as_deref()
            .map(|e| format!(" after: {e}"))
            .unwrap_or_default(),
    );
    let dead = Park {
        id: park.id,
        attempts: park.attempts,
        error: Some(error),
        delay: Duration::ZERO,
        not_before: None,
        dead: true,
        dead_by_capture: park.dead_by_capture,
    };
    match body {
        Body::Event(e) => {
            let payload = match &e.payload {
                Payload::Null => Payload::Null,
                _ if bare => Payload::Null,
                other => {
                    let text = String::from_utf8_lossy(other.as_bytes());
                    serde_json::value::to_raw_value(&text).map_or(Payload::Null, Payload::Json)
                }
            };
            let event = Event {
                destination: fitted(&e.destination).to_string(),
                partition_key: e.partition_key.as_deref().map(|k| fitted(k).to_string()),
                event_type: fitted(&e.event_type).to_string(),
                mutation_id: e
                    .mutation_id
                    .as_deref()
                    .filter(|_| !bare)
                    .map(|m| fitted(m).to_string()),
                headers: if bare {
                    Default::default()
                } else {
                    e.headers.clone()
                },
                payload,
                ..(**e).clone()
            };
            park_values(&dead, &Body::Event(Arc::new(event)), params);
        }
        Body::Undecodable(_) => park_values(&dead, body, params),
    }
}

fn park_values(park: &Park, body: &Body, params: &mut Vec<Value>) {
    let text = |s: &str| Value::from(s);
    let opt = |s: Option<&str>| s.map_or(Value::NULL, Value::from);
    let created = |at: SystemTime| {
        outbox_core::time::rfc3339_micros(at)
            .ok()
            .map(|t| t.trim_end_matches('Z').replacen('T', " ", 1))
    };
    match body {
        Body::Event(e) => {
            let payload = match &e.payload {
                Payload::Null => Value::NULL,
                other => Value::from(other.as_bytes().to_vec()),
            };
            let headers = serde_json::to_string(&e.headers).unwrap_or_else(|_| "{}".into());
            params.extend([
                text(&e.event_id.to_string()),
                text(&e.destination),
                opt(e.partition_key.as_deref()),
                text(&e.event_type),
                payload,
                text(&headers),
                opt(e.mutation_id.as_deref()),
                Value::from(e.rejected),
                created(e.created_at).map_or(Value::NULL, Value::from),
            ]);
        }
        // Its destination and key may be what made it undecodable (too long to park).
        // Marked, so that a retry finds it undecodable again instead of publishing an
        // empty event under its id (a BLACKHOLE row is nowhere else to read it from).
        Body::Undecodable(u) => params.extend([
            text(&u.event_id.unwrap_or_else(uuid::Uuid::new_v4).to_string()),
            text(fitted(u.destination.as_deref().unwrap_or(""))),
            opt(u.partition_key.as_deref().map(fitted)),
            text(outbox_core::event::UNDECODABLE_TYPE),
            Value::NULL,
            text(&undecodable_marker(&u.reason)),
            Value::NULL,
            Value::from(false),
            created(SystemTime::now()).map_or(Value::NULL, Value::from),
        ]),
    }
    params.extend([
        Value::from(u64::try_from(park.delay.as_micros()).unwrap_or(u64::MAX)),
        opt(park.not_before.and_then(created).as_deref()),
        Value::from(park.attempts),
        opt(park.error.as_deref().map(fitted_error)),
        Value::from(park.dead),
    ]);
}

/// The headers of an undecodable event's dead letter: [`outbox_core::event::UNDECODABLE`]
/// with the reason (cut to what a JSON column comfortably holds).
fn undecodable_marker(reason: &str) -> String {
    let marker =
        std::collections::BTreeMap::from([(outbox_core::event::UNDECODABLE, fitted_error(reason))]);
    serde_json::to_string(&marker).unwrap_or_else(|_| "{}".into())
}

/// The characters of an error the parked table's `last_error` (`text`: 65,535 bytes) holds
/// whatever they are (4 bytes each at most).
const PARKED_ERROR_CHARS: usize = 16_000;

/// An error cut to what `last_error` holds (the engine's reports are not bounded).
fn fitted_error(error: &str) -> &str {
    first_chars(error, PARKED_ERROR_CHARS)
}

impl OutboxStore for BinlogStore {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    /// The stream hands out what comes, in commit order.
    fn leaves_out_crowded_keys(&self) -> bool {
        false
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let inner = self.inner.clone();
        async move { inner.claim(request).await }.boxed()
    }

    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (acked, stream) = inner
                .settle_parked(
                    ids,
                    |id| *id,
                    parked_row,
                    |p, ids| p.ack(LeaseHolder::unfenced(holder.node), ids),
                    true,
                )
                .await?;
            Ok(acked + inner.ack_stream(stream).await?)
        }
        .boxed()
    }

    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (recorded, stream) = inner
                .settle_parked(
                    retries,
                    |r| r.sequence_id,
                    |r| RetryLater {
                        sequence_id: parked_row(r.sequence_id),
                        ..r
                    },
                    |p, rs| p.retry_later(LeaseHolder::unfenced(holder.node), rs),
                    false,
                )
                .await?;
            let parks = stream
                .into_iter()
                .map(|retry| Park {
                    attempts: retry.attempts,
                    error: Some(retry.error),
                    delay: retry.delay,
                    ..Park::behind_its_key(retry.sequence_id)
                })
                .collect();
            Ok(recorded + inner.park_stream(parks).await?)
        }
        .boxed()
    }

    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            // Its parks may be written (and settled) by another call's flush first.
            let ids: Vec<SequenceId> = entries.iter().map(|e| e.sequence_id).collect();
            let sessions = lock(&inner.state).holdings.sessions_of(&ids);
            let (moved, stream) = inner
                .settle_parked(
                    entries,
                    |e| e.sequence_id,
                    |e| DeadLetter {
                        sequence_id: parked_row(e.sequence_id),
                        ..e
                    },
                    |p, es| p.dead_letter(LeaseHolder::unfenced(holder.node), es),
                    true,
                )
                .await?;
            let parks = stream
                .into_iter()
                .map(|entry| Park {
                    attempts: entry.attempts,
                    error: Some(entry.error),
                    dead: true,
                    ..Park::behind_its_key(entry.sequence_id)
                })
                .collect();
            let n = moved + inner.park_stream(parks).await?;
            Ok(inner.settle_copies(&ids, &sessions, n))
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let (released, stream) = inner
                .settle_parked(ids, |id| *id, parked_row, |p, ids| p.release(node, ids), false)
                .await?;
            // The engine releases what waits behind a retrying head of its key, and what it
            // holds when it stops: parked, behind their keys, in commit order.
            let n = stream.len() as u64;
            let parks = stream.into_iter().map(Park::behind_its_key).collect();
            if let Err(e) = inner.park_stream(parks).await {
                tracing::warn!(error = %e.report(), "parking released rows failed; trying again with the next claim");
            }
            Ok(released + n)
        }
        .boxed()
    }

    /// Only the parked table leases rows: the stream's are held in memory.
    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        self.inner
            .parked
            .release_unheld(node, parked_rows_among(&held))
    }

    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        let inner = self.inner.clone();
        async move {
            let parked = inner.parked.as_ref();
            outbox_core::capture::extend_leases(&*inner, parked, extension, parked_row).await
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

    /// The database answers, and it parks what must wait.
    fn ping(&self) -> StoreFuture<()> {
        let inner = self.inner.clone();
        async move {
            inner.main.ping().await?;
            let settle_stall = inner.settle_stall();
            match (lock(&inner.state).holdings.refused_parks_stall()).or(settle_stall) {
                Some(why) => Err(StoreError::new(StoreErrorKind::Query, why)),
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        let inner = self.inner.clone();
        async move {
            // A BLACKHOLE outbox has none of the polling store's columns to check.
            let mut problems = if inner.blackhole {
                Vec::new()
            } else {
                inner.main.verify().await?
            };
            problems.extend(inner.parked.verify().await?);
            Ok(problems)
        }
        .boxed()
    }

    fn lock_holders(&self) -> Option<StoreFuture<outbox_core::store::LockHolders>> {
        self.inner.main.lock_holders()
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        if let Ok(mut slot) = self.inner.on_change.lock() {
            *slot = Some(on_change);
        }
        // The reader calls it; nothing to run here.
        Some(futures::future::pending().boxed())
    }
}

impl std::fmt::Debug for BinlogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BinlogStore")
            .field("outbox", &self.inner.outbox)
            .finish()
    }
}

/// The transaction the reader reads, while claims hold its rows until its commit
/// ([`State::hold_to_commit`]). Its rows are freed only once its commit is read, so the
/// reader reads on without waiting for room, until its rows alone are more than the memory
/// budget: then they go out as read (`Item::Overflowed`). Rolled back, such a transaction's
/// rows may have been delivered; held whole, it would have had no bound.
#[derive(Debug, Default)]
struct HeldTransaction {
    /// A row of it was read: its end is not read yet.
    open: bool,
    /// The bytes its rows hold in the memory budget.
    bytes: usize,
    overflowed: bool,
}

impl HeldTransaction {
    fn row(&mut self, bytes: usize) {
        self.open = true;
        self.bytes += bytes;
    }

    /// Its end was read; returns whether its rows went out as read.
    fn ended(&mut self) -> bool {
        std::mem::take(self).overflowed
    }

    /// Whether the reader waits for room in the memory budget before reading on.
    fn waits_for_room(&self, hold_to_commit: bool) -> bool {
        !(hold_to_commit && self.open && !self.overflowed)
    }

    /// Whether its rows go out as read from now on: they are more than `limit` bytes.
    fn overflows(&mut self, hold_to_commit: bool, limit: usize) -> bool {
        let overflows = hold_to_commit && self.open && !self.overflowed && self.bytes > limit;
        self.overflowed |= overflows;
        overflows
    }
}

/// Whether `tx`'s channel holds nothing but the place one reserved permit takes.
fn held_nothing_but<T>(tx: &mpsc::Sender<T>) -> bool {
    tx.capacity() + 1 == tx.max_capacity()
}

/// When the seat's lease was last renewed (by taking the seat or storing the position).
struct Renewal {
    start: std::time::Instant,
    lease: Duration,
    /// Milliseconds from `start` to the last renewal.
    at: std::sync::atomic::AtomicU64,
}

impl Renewal {
    fn new(lease: Duration) -> Self {
        Renewal {
            start: std::time::Instant::now(),
            lease,
            at: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Renewed a moment before `since` (the write's start: the lease runs from there).
    fn renewed(&self, since: std::time::Instant) {
        let ms = since.duration_since(self.start).as_millis() as u64;
        self.at.store(ms, std::sync::atomic::Ordering::SeqCst);
    }

    fn lapsed(&self) -> bool {
        self.lapsed_at(std::time::Instant::now())
    }

    /// Whether at `now` the lease has run out since the last renewal.
    fn lapsed_at(&self, now: std::time::Instant) -> bool {
        let at = Duration::from_millis(self.at.load(std::sync::atomic::Ordering::SeqCst));
        now.saturating_duration_since(self.start) > at + self.lease
    }
}

/// The reader task: takes the seat (or waits as a standby), reads, and stores the position
/// the settled rows allow.
struct Reader {
    /// The oldest transaction this reader holds, for the stall watch ([`Inner::settle_stall`]).
    front: Arc<Mutex<Option<ReadFront>>>,
    renewed: Arc<Renewal>,
    binlog: BinlogConfig,
    seat: SeatConfig,
    /// The outbox table's layout: what its rows are read by.
    mapping: Mapping,
    /// The table's columns its rows are read by ([`needed_columns`]), and the last
    /// description of the table found to have them all (a row's columns are shared until
    /// the reader describes the table again, after an ALTER TABLE).
    needed: Vec<String>,
    columns_checked: Option<Arc<Vec<String>>>,
    adoption: Vec<String>,
    pool: Pool,
    sql: Statements,
    drain: bool,
    /// BLACKHOLE on MySQL: a transaction's rows are handed out at its commit
    /// ([`State::hold_to_commit`]).
    hold_to_commit: bool,
    on_reading_stopped: Option<Arc<dyn Fn() + Send + Sync>>,
    on_reading_started: Option<Arc<dyn Fn(StillReading) + Send + Sync>>,
    recovery: String,
    /// The last reason reading stopped or could not start: logged once, not every second.
    last_problem: Option<String>,
    tx: mpsc::Sender<Item>,
    settled: mpsc::UnboundedReceiver<Vec<SettledRow>>,
    /// Settled rows a later session may read again, to settle unsent.
    unstored: SettledUnstored,
    live: Arc<LiveSession>,
    status: watch::Sender<CaptureStatus>,
    close: watch::Receiver<bool>,
    on_change: Arc<Mutex<Option<OnChange>>>,
    memory: Arc<MemoryBudget>,
    session: u64,
    /// When the lag in bytes was last measured, reading or not ([`Reader::lag_due`]).
    lag_measured: Option<std::time::Instant>,
    silence: SilenceWindow,
}

/// How long a session waits with nothing from the server before it takes the connection for
/// dead. An event arrives whole or not at all: one larger than a slow link carries in
/// [`BINLOG_SILENCE`](crate::BINLOG_SILENCE) broke every session at the same place, for
/// good. A session broken in silence where the one before broke waits twice as long (at
/// most [`SilenceWindow::LONGEST`]); one broken in silence elsewhere starts it over.
#[derive(Debug, PartialEq)]
struct SilenceWindow {
    wait: Duration,
    /// Where the last session broken in silence had read to.
    broke_at: Option<BinlogPosition>,
}

impl SilenceWindow {
    const LONGEST: Duration = Duration::from_secs(600);

    fn new() -> Self {
        SilenceWindow {
            wait: crate::BINLOG_SILENCE,
            broke_at: None,
        }
    }

    /// A session ended in silence having read to `read_to`.
    fn broke_in_silence(&mut self, read_to: BinlogPosition) {
        if self.broke_at.as_ref() == Some(&read_to) {
            self.wait = (self.wait * 2).min(Self::LONGEST);
        } else {
            self.wait = crate::BINLOG_SILENCE;
        }
        self.broke_at = Some(read_to);
    }
}

/// How a session of reading ended.
enum Ended {
    Closed,
    Broken(String),
}

/// What the reader does next.
enum Step {
    Close,
    Settled(Option<Vec<SettledRow>>),
    Store,
    Send(Result<mpsc::OwnedPermit<Item>, mpsc::error::SendError<()>>),
    Read(Result<Option<Output>, BinlogError>),
}

impl Reader {
    async fn run(mut self) {
        // `--drain` stops at the position current at start-up.
        let mut drain_until = None;
        loop {
            if *self.close.borrow() {
                return;
            }
            if self.drain && drain_until.is_none() {
                match current_position(&self.binlog.url).await {
                    Ok(position) => drain_until = Some(position),
                    Err(e) => {
                        self.wait_after(CaptureStatus::Reconnecting(e.to_string()))
                            .await;
                        continue;
                    }
                }
            }
            match Capture::start(&self.binlog, &self.seat, &self.adoption).await {
                Ok(Started::Held { holder }) => {
                    self.wait_after(CaptureStatus::Standby { holder }).await;
                }
                Ok(Started::Active(mut capture)) => {
                    capture.set_silence(self.silence.wait);
                    self.renewed.renewed(capture.lease_from());
                    // Seated from here, not from the session's announcement (after the
                    // parked keys are read): the callback asks at once, and a "no" left the
                    // parked table's lock with a paused ex-reader for its wait_timeout.
                    let seated = Arc::new(std::sync::atomic::AtomicBool::new(true));
                    if let Some(started) = &self.on_reading_started {
                        let (seated, renewed) = (seated.clone(), self.renewed.clone());
                        started(Arc::new(move || {
                            seated.load(std::sync::atomic::Ordering::SeqCst) && !renewed.lapsed()
                        }));
                    }
                    let ended = self.read(*capture, drain_until.as_ref()).await;
                    // An ended session settles nothing more: nothing of it to watch.
                    *lock(&self.front) = None;
                    seated.store(false, std::sync::atomic::Ordering::SeqCst);
                    self.live.set(0);
                    if let Some(stopped) = &self.on_reading_stopped {
                        stopped();
                    }
                    match ended {
                        Ended::Closed => return,
                        Ended::Broken(reason) => self.stopped(reason).await,
                    }
                }
                Err(e) => self.stopped(self.reason(&e)).await,
            }
        }
    }

    /// Why reading stopped, with what to do where the log is purged.
    fn reason(&self, e: &BinlogError) -> String {
        match e {
            BinlogError::Purged { .. }
            | BinlogError::OtherServer { .. }
            | BinlogError::TableAltered { .. }
            | BinlogError::StatementLogged { .. }
            | BinlogError::Incident { .. }
            | BinlogError::CompressedEvent { .. } => {
                format!("{e}; {}", self.recovery)
            }
            other => other.to_string(),
        }
    }

    /// Reading stopped (or could not start) for `reason`: said once while it lasts, and
    /// tried again every second.
    async fn stopped(&mut self, reason: String) {
        if self.last_problem.as_ref() != Some(&reason) {
            tracing::warn!(%reason, "binlog capture is not reading; trying again every second");
            self.last_problem = Some(reason.clone());
        }
        self.wait_after(CaptureStatus::Reconnecting(reason)).await;
    }

    /// Sets `status`, then waits a second (or until closed).
    async fn wait_after(&mut self, status: CaptureStatus) {
        if let CaptureStatus::Standby { holder } = &status {
            if !matches!(&*self.status.borrow(), CaptureStatus::Standby { .. }) {
                if self.drain {
                    // Its count of rows left, at the end, would not say why.
                    tracing::warn!(%holder, "waiting as a standby: another relay reads this outbox's binary log, so this drain delivers nothing unless that relay stops; stop it to drain here, or leave the draining to it");
                } else {
                    tracing::info!(%holder, "waiting as a standby: another relay reads the binary log");
                }
            }
        }
        self.status.send_replace(status);
        self.measure_stored_lag().await;
        let _ = tokio::time::timeout(Duration::from_secs(1), self.close.wait_for(|c| *c)).await;
    }

    /// Not reading (a standby, or reconnecting): the bytes of log past the stored position,
    /// every [`LAG_MEASURED`], so `lag_bytes` keeps rising while nothing is read (a purged
    /// position, an altered table) instead of keeping the last session's value.
    async fn measure_stored_lag(&mut self) {
        if !self.lag_due() {
            return;
        }
        let stored =
            crate::stored_position(&self.seat.url, &self.seat.positions, &self.seat.outbox).await;
        let behind = match stored {
            Ok(Some(stored)) => crate::bytes_behind(&self.binlog.url, &stored.position).await,
            Ok(None) => return,
            Err(e) => Err(e),
        };
        match behind {
            Ok(bytes) => ::metrics::gauge!(metric::LAG_BYTES).set(bytes as f64),
            Err(e) => tracing::debug!(error = %e, "cannot measure the stored position's lag"),
        }
    }

    /// Whether the lag in bytes is to be measured now (every [`LAG_MEASURED`]: the log's end
    /// takes a connection and `SHOW BINARY LOGS`); if so, it counts as measured.
    fn lag_due(&mut self) -> bool {
        if self
            .lag_measured
            .is_some_and(|at| at.elapsed() < LAG_MEASURED)
        {
            return false;
        }
        self.lag_measured = Some(std::time::Instant::now());
        true
    }

    fn wake(&self) {
        let on_change = self.on_change.lock().ok().and_then(|o| o.clone());
        if let Some(on_change) = on_change {
            on_change();
        }
    }

    /// One session: announces it, then reads until closed or broken.
    async fn read(&mut self, mut capture: Capture, drain_until: Option<&BinlogPosition>) -> Ended {
        let parked_keys = match self.parked_keys().await {
            Ok(keys) => keys,
            Err(e) => return Ended::Broken(e.to_string()),
        };
        self.session += 1;
        self.live.set(self.session);
        // MariaDB leaves a rolled-back BLACKHOLE row out of its log: its rows are handed out
        // as read, within the memory budget, however large their transaction.
        let hold_to_commit = self.hold_to_commit && !capture.mariadb();
        let announced = self
            .tx
            .send(Item::Session {
                session: self.session,
                epoch: capture.epoch(),
                parked_keys,
                adopted_dead: capture.adopted_dead(),
                hold_to_commit,
            })
            .await;
        if announced.is_err() {
            return Ended::Closed;
        }
        self.status.send_replace(CaptureStatus::Reading);
        self.last_problem = None;
        tracing::info!(
            session = self.session,
            from = %format!("{}:{}", capture.read_to().file, capture.read_to().offset),
            "reading the binary log"
        );
        // A drain looks at where the log is read to this often, too.
        let store_every = match drain_until {
            Some(_) => (self.seat.lease / 3).min(Duration::from_millis(250)),
            None => (self.seat.lease / 3).min(STORE_AT_MOST_EVERY),
        };
        let mut next_store = tokio::time::Instant::now() + store_every;
        let mut pending: Option<Item> = None;
        let mut transaction = HeldTransaction::default();
        let mut drained = drain_until.is_none();
        loop {
            if pending.is_none() && transaction.overflows(hold_to_commit, self.memory.limit()) {
                tracing::warn!(
                    at = %format!("{}:{}", capture.read_to().file, capture.read_to().offset),
                    "a transaction's rows of the BLACKHOLE outbox are more than the memory \
                     budget (`memory_mib`): they go out as read instead of at its commit, and \
                     were it rolled back, they may have been delivered"
                );
                pending = Some(Item::Overflowed);
            }
            let step = tokio::select! {
                biased;
                _ = self.close.wait_for(|c| *c) => Step::Close,
                settled = self.settled.recv() => Step::Settled(settled),
                _ = tokio::time::sleep_until(next_store) => Step::Store,
                permit = self.tx.clone().reserve_owned(), if pending.is_some() => Step::Send(permit),
                output = async {
                    if transaction.waits_for_room(hold_to_commit) {
                        self.memory.has_room().await;
                    }
                    capture.next().await
                }, if pending.is_none() => Step::Read(output),
            };
            match step {
                Step::Close => {
                    while let Ok(rows) = self.settled.try_recv() {
                        self.settle(&mut capture, rows);
                    }
                    if let Err(e) = capture.leave().await {
                        tracing::warn!(error = %e, "storing the position at shutdown failed: what was settled since the last store is read again");
                    }
                    return Ended::Closed;
                }
                Step::Settled(None) => return Ended::Closed,
                Step::Settled(Some(rows)) => self.settle(&mut capture, rows),
                Step::Store => {
                    next_store = tokio::time::Instant::now() + store_every;
                    *lock(&self.front) = capture.front().map(|front| (self.session, front));
                    let storing = std::time::Instant::now();
                    let behind = capture.behind_storable();
                    match capture.store().await {
                        Ok(stored) => self.unstored.stored(behind, &stored),
                        Err(e) => {
                            return self.broken(&capture, format!("storing the position: {e}"))
                        }
                    }
                    self.renewed.renewed(storing);
                    let behind = match self.lag_due() {
                        true => {
                            let behind =
                                crate::bytes_behind(&self.binlog.url, &capture.read_to()).await;
                            match &behind {
                                Ok(bytes) => {
                                    ::metrics::gauge!(metric::LAG_BYTES).set(*bytes as f64)
                                }
                                Err(e) => {
                                    tracing::debug!(error = %e, "cannot read the binary log's end")
                                }
                            }
                            behind.ok()
                        }
                        false => None,
                    };
                    let caught_up = behind == Some(0) || (capture.caught_up() && pending.is_none());
                    set_lag_seconds(&capture, caught_up);
                }
                Step::Send(Err(_)) => return Ended::Closed,
                Step::Send(Ok(permit)) => {
                    // Claims drain the channel when woken: wake them when it held nothing
                    // before this item (the permit itself takes one place).
                    let was_empty = held_nothing_but(&self.tx);
                    if let Some(item) = pending.take() {
                        permit.send(item);
                    }
                    if was_empty {
                        self.wake();
                    }
                }
                Step::Read(Err(e)) => {
                    if let BinlogError::Silent(waited) = &e {
                        self.silence.broke_in_silence(capture.read_to());
                        if self.silence.wait > *waited {
                            tracing::info!(waited = ?waited, next = ?self.silence.wait, "the binlog session went silent where the last one did (a large event over a slow link?): the next waits longer");
                        }
                    }
                    let reason = self.reason(&e);
                    return self.broken(&capture, reason);
                }
                Step::Read(Ok(None)) => {
                    return self.broken(&capture, "the server ended the binlog stream".into())
                }
                Step::Read(Ok(Some(output))) => {
                    pending = Some(match output {
                        Output::Row(row) => {
                            if let Some(missing) = self.lacks_a_needed_column(&row.columns) {
                                // Read as NULL, the row went out without its payload or
                                // key, or was taken for delivered; it waits, unread.
                                return self.broken(&capture, missing);
                            }
                            transaction.row(0);
                            let Some(captured) = decode(&row, &self.mapping) else {
                                // Inserted delivered (or dead) already: no event, nothing
                                // to wait for.
                                settle_in(&mut capture, row.ordinal());
                                continue;
                            };
                            if self.unstored.read_again(row.ordinal(), captured.identity) {
                                // Settled by an earlier session: settled unsent.
                                settle_in(&mut capture, row.ordinal());
                                continue;
                            }
                            set_lag_seconds(&capture, false);
                            let memory = self.memory.charge(captured_bytes(&captured));
                            transaction.row(memory.bytes());
                            Item::Row {
                                ordinal: row.ordinal(),
                                captured: Box::new(captured),
                                memory,
                            }
                        }
                        Output::Committed { next, rows, .. } => {
                            tracing::debug!(rows, next = %format!("{}:{}", next.file, next.offset), "read a transaction");
                            transaction.ended();
                            Item::Committed
                        }
                        Output::RolledBack { rows, .. } => {
                            if transaction.ended() {
                                tracing::error!(
                                    rows,
                                    "a transaction of the BLACKHOLE outbox larger than the \
                                     memory budget rolled back: its rows went out as read, and \
                                     may have been delivered"
                                );
                            } else if rows > 0 && !hold_to_commit {
                                tracing::error!(
                                    rows,
                                    "the server logged outbox rows of a transaction that rolled \
                                     back, which MariaDB is not known to do: they were handed \
                                     out as read and may have been delivered; tell the relay's \
                                     maintainers the server's version"
                                );
                            }
                            Item::RolledBack
                        }
                    });
                }
            }
            if !drained && pending.is_none() {
                if let Some(until) = drain_until {
                    // Read up to it, and everything read handed out: a transaction's rows
                    // held behind a savepoint go out after its end was read, and the drain
                    // ended with them still in the reader.
                    if at_or_after(&capture.read_to(), until) && !capture.handing_out() {
                        drained = true;
                        pending = Some(Item::Drained);
                    }
                }
            }
        }
    }

    /// Passes settled rows on: those of the session reading to its capture, those of an
    /// ended one to what the session settles unsent when it reads them again.
    fn settle(&mut self, capture: &mut Capture, rows: Vec<SettledRow>) {
        for row in rows {
            if row.session == self.session {
                settle_in(capture, row.ordinal);
                self.unstored.settled(row.ordinal, row.identity);
            } else {
                self.unstored.settled_late(row.identity);
            }
        }
    }

    /// Why rows of a table described with `columns` cannot be read: it lacks a column
    /// they are read by (renamed or dropped while the relay ran). Checked once per
    /// description.
    fn lacks_a_needed_column(&mut self, columns: &Arc<Vec<String>>) -> Option<String> {
        if self
            .columns_checked
            .as_ref()
            .is_some_and(|checked| Arc::ptr_eq(checked, columns))
        {
            return None;
        }
        if let Some(missing) = missing_column(&self.needed, columns) {
            return Some(format!(
                "the outbox table {}.{} has no column {missing} now, which the relay reads \
                 its rows by (renamed or dropped by an ALTER TABLE while the relay ran): \
                 rename it back, or map the new name (layout = \"custom\" and its \
                 [mapping]) and restart; the row waits, and nothing after it is read",
                self.binlog.database, self.binlog.table
            ));
        }
        self.columns_checked = Some(columns.clone());
        None
    }

    /// The session broke for `reason`: what it settled past the stored position waits for
    /// the next one.
    fn broken(&mut self, capture: &Capture, reason: String) -> Ended {
        self.unstored.session_ended(capture.read_to());
        Ended::Broken(reason)
    }

    async fn parked_keys(&self) -> Result<Vec<String>, mysql_async::Error> {
        read_parked_keys(&self.pool, &self.sql).await
    }
}

/// Every key with a row waiting in the parked table.
async fn read_parked_keys(
    pool: &Pool,
    sql: &Statements,
) -> Result<Vec<String>, mysql_async::Error> {
    pool.get_conn().await?.query(sql.parked_keys()).await
}

/// Settles row `ordinal` of the session reading in its capture.
fn settle_in(capture: &mut Capture, ordinal: u64) {
    if let Err(e) = capture.settle(ordinal) {
        tracing::error!(error = %e, "binlog acknowledgement out of step (a bug): the position stays where it is");
    }
}

/// How often the lag in bytes is measured: by the reader, and by a relay that does not read.
const LAG_MEASURED: Duration = Duration::from_secs(5);

/// Sets [`metric::LAG_SECONDS`]: 0 once `caught_up`, else the age of what was read last.
fn set_lag_seconds(capture: &Capture, caught_up: bool) {
    let behind = match (caught_up, capture.logged_at()) {
        (true, _) => Duration::ZERO,
        (false, Some(at)) => at.elapsed().unwrap_or_default(),
        (false, None) => return,
    };
    ::metrics::gauge!(metric::LAG_SECONDS).set(behind.as_secs_f64());
}

fn captured_bytes(captured: &Captured) -> usize {
    match &captured.event {
        Ok(event) => event_bytes(event),
        Err(u) => EVENT_OVERHEAD + u.reason.len(),
    }
}

#[cfg(test)]
mod tests {
    /// A MySQL BLACKHOLE transaction is read through without waiting for room in the memory
    /// budget, its rows freed only at its commit, until its rows alone are more than the
    /// budget: then they go out as read (once), and the reader waits for room again.
    #[test]
    fn a_held_transaction_larger_than_the_memory_budget_goes_out_as_read() {
        let mut transaction = super::HeldTransaction::default();
        assert!(transaction.waits_for_room(true));
        transaction.row(600);
        assert!(!transaction.waits_for_room(true));
        assert!(transaction.waits_for_room(false), "rows handed out as read");
        assert!(!transaction.overflows(true, 1000));
        transaction.row(600);
        assert!(!transaction.overflows(false, 1000));
        assert!(transaction.overflows(true, 1000));
        assert!(!transaction.overflows(true, 1000), "once");
        assert!(transaction.waits_for_room(true));
        assert!(transaction.ended());
        transaction.row(2000);
        assert!(!transaction.waits_for_room(true));
        assert!(!transaction.ended(), "a transaction held whole");
    }

    use super::*;

    #[test]
    fn a_session_silent_where_the_last_one_was_waits_twice_as_long() {
        let at = |offset| BinlogPosition::at("log.000001", offset);
        let mut silence = SilenceWindow::new();
        silence.broke_in_silence(at(100));
        assert_eq!(
            silence.wait,
            crate::BINLOG_SILENCE,
            "once: a dead connection"
        );
        silence.broke_in_silence(at(100));
        assert_eq!(silence.wait, crate::BINLOG_SILENCE * 2);
        silence.broke_in_silence(at(100));
        assert_eq!(silence.wait, crate::BINLOG_SILENCE * 4);
        silence.broke_in_silence(at(200));
        assert_eq!(silence.wait, crate::BINLOG_SILENCE, "elsewhere: over");
        for _ in 0..20 {
            silence.broke_in_silence(at(200));
        }
        assert_eq!(silence.wait, SilenceWindow::LONGEST);
    }

    fn park_of(bytes: usize) -> ParkRow {
        ParkRow {
            params: vec![Value::Bytes(vec![b'x'; bytes])],
            row: None,
            copied: None,
            payload_from_table: false,
        }
    }

    /// Parks go in statements whose values, and whose text, fit the packet; a row too large
    /// alone is a statement of its own (refused before it is sent).
    #[test]
    fn parks_are_cut_into_statements_that_fit_the_packet() {
        let parks: Vec<ParkRow> = [100, 100, 100, 1_000, 50].map(park_of).into();
        let parks: Vec<&ParkRow> = parks.iter().collect();
        let sizes = |statements: Vec<Vec<&ParkRow>>| -> Vec<usize> {
            statements.iter().map(Vec::len).collect()
        };
        assert_eq!(sizes(park_statements(&parks, 10_000, 10)), [5]);
        // 109 bytes a value: two rows fit in 250.
        assert_eq!(sizes(park_statements(&parks, 250, 10)), [2, 1, 1, 1]);
        // The text: 3 rows of 100 bytes' text in 300 (their values 10 bytes each).
        let small: Vec<ParkRow> = [1; 5].map(park_of).into();
        let small: Vec<&ParkRow> = small.iter().collect();
        assert_eq!(sizes(park_statements(&small, 300, 100)), [3, 2]);
    }

    /// The engine's error reports are not bounded, and `last_error` is a `text` (65,535
    /// bytes): a longer one was refused on every try, the park with it.
    #[test]
    fn an_error_is_cut_to_what_last_error_holds_on_a_character_boundary() {
        let long = "é".repeat(PARKED_ERROR_CHARS + 10);
        let cut = fitted_error(&long);
        assert_eq!(cut.chars().count(), PARKED_ERROR_CHARS);
        assert!(cut.len() <= 65_535);
        assert_eq!(fitted_error("short"), "short");
    }

    /// The reader wakes the claims only when its item lands in an empty channel (a wake per
    /// item cost a fifth of a drain's CPU); the permit it holds must not hide that.
    #[tokio::test]
    async fn the_reader_wakes_claims_when_its_item_lands_in_an_empty_channel() {
        let (tx, mut rx) = mpsc::channel::<u8>(4);
        let permit = tx.clone().reserve_owned().await.unwrap();
        assert!(held_nothing_but(&tx));
        permit.send(1);
        let permit = tx.clone().reserve_owned().await.unwrap();
        assert!(!held_nothing_but(&tx), "one item waits");
        permit.send(2);
        rx.recv().await;
        rx.recv().await;
        let _permit = tx.clone().reserve_owned().await.unwrap();
        assert!(held_nothing_but(&tx));
    }

    /// A relay resumed after a pause longer than its lease hands out nothing until its
    /// reader renews (or finds the seat taken).
    #[test]
    fn a_lease_without_a_renewal_for_longer_than_itself_has_lapsed() {
        let renewal = Renewal::new(Duration::from_secs(10));
        let at = |s: u64| renewal.start + Duration::from_secs(s);
        assert!(!renewal.lapsed_at(at(5)));
        assert!(renewal.lapsed_at(at(11)), "paused past the lease");
        renewal.renewed(at(8));
        assert!(!renewal.lapsed_at(at(11)));
        assert!(renewal.lapsed_at(at(19)));
    }
}
