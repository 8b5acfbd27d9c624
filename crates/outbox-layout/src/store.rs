//! The mapped-table store, written once: [`MappedStore`] over a database part, [`MappedDb`],
//! implemented for PostgreSQL (`outbox-store-postgres`) and MySQL/MariaDB
//! (`outbox-store-mysql`).
//!
//! # Active relay
//! One relay per table is active at a time: it holds a session-level lock on a dedicated
//! connection ([`MappedDb::take_lock`]), and standby relays claim nothing until that lock is
//! gone; they try again every [`LEADER_RETRY`]. On taking over, the new active relay forgets
//! its memory and reaps every row the table shows as held (counting the attempt where the
//! table counts them, so a poison event that kills relays ends dead); while active it reaps
//! rows whose lease expired every half lease. See ARCHITECTURE.md, "Mapped layouts".
//!
//! A relay that runs ([`MappedStore::keep_active`]) follows the lock with an
//! [`Ownership`] of one partition, the whole table, at the epoch of each take: its engine
//! claims, publishes and settles only while the lock is held at that epoch. The lock's
//! session can end under a running relay (a killed backend, a server restart, a cut
//! network) and a standby take the table over; the relay then drops what it holds instead
//! of publishing it beside the new active relay, and its late settles write nothing.
//!
//! # Memory
//! What the table has no column for (attempts, the next attempt time, a lease, handles for
//! UUID ids) is kept in [`Memory`]. A retry blocks its key in memory only once the table has
//! recorded it, so a table-side `available_at` is never later than the memory block.
//!
//! Every statement comes from the layout's [`Sql`]; values are bound through [`Params`].

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::future::BoxFuture;
use futures::FutureExt;
use outbox_core::health::Check;
use outbox_core::store::{
    Backlog, ClaimRequest, Claimed, Crowded, DeadLetter, DeadQuery, DeadRecord, DeadRetried,
    DeadSelector, DestinationStats, EventRecord, EventState, Heartbeat, Heartbeated, Incarnation,
    LeaseExtension, LeaseHolder, LockHolders, NodeRecord, NodeRegistry, OnChange, Operations,
    Problem, Registration, ReplayPage, ReplaySelector, RetryLater, StoreFuture, StoreResult,
};
use outbox_core::time::{from_micros, micros, millis};
use outbox_core::{
    Fence, Health, NewEvent, NodeId, OutboxStore, Ownership, SequenceId, StoreError, StoreErrorKind,
};
use uuid::Uuid;

use crate::memory::{decode, derived_event_id, Memory, RawRow, RowId};
use crate::params::Params;
use crate::sql::{Failure, Sql};
use crate::{DeadState, Dialect, IdType, KeyFallback, Mapping};

/// How often a standby relay tries to become the active one.
pub const LEADER_RETRY: Duration = Duration::from_secs(1);

/// How often [`MappedStore::keep_active`] checks the lock (and reaps, and a standby tries).
pub const ACTIVE_CHECK_EVERY: Duration = Duration::from_millis(500);

/// How long one successful check vouches for the lock: past it, unchecked (a stalled
/// process, a database that does not answer), the engine publishes nothing.
pub const ACTIVE_VOUCHED_FOR: Duration = Duration::from_secs(3);

/// What [`MappedDb::open`] builds: the database part and the table it runs.
pub struct Opened<D> {
    pub db: D,
    pub mapping: Mapping,
    /// The layout's name, for logs and fixes.
    pub layout: String,
    /// Where the table has no attempt limit of its own.
    pub max_attempts: u32,
}

/// A claim for [`MappedDb::claim`].
pub struct Claim {
    /// Claimable rows that are not blocked, over alias `o`.
    pub condition: String,
    /// The condition's values; the claim's own placeholders number on from them
    /// ([`Params::after`]).
    pub params: Params,
    pub limit: i64,
    /// The node and lease (ms) to mark the rows with; `None` when the table has nothing to
    /// mark (the active relay then excludes the ids it holds in `condition`).
    pub mark: Option<(String, i64)>,
}

/// The database part of a mapped store: what differs between PostgreSQL and MySQL.
///
/// # Contract
/// - **Statements** come from the [`Sql`] builder and values from [`Params`] in the same
///   dialect; the part binds the values in order (arrays as the driver's arrays on
///   PostgreSQL, named `:pn` values on MySQL) and maps every driver error to a
///   [`StoreErrorKind`] by the server's error code, never its text, naming `context`.
/// - **[`execute_each`](MappedDb::execute_each)** runs one statement once per parameter set
///   in one transaction and returns the rows affected in total: all or nothing.
/// - **[`claim`](MappedDb::claim)** selects up to `limit` rows matching the condition in
///   publish order, skipping rows other transactions hold locked, and (with `mark`) marks
///   them as [`Sql::claim_set`] says, in one transaction: no row is returned that another
///   claim also returned while the mark lives. Rows come back in `select_list` order of
///   columns and publish order of rows.
/// - **The lock** is the active-relay lock: session-level, on a dedicated connection that
///   only the lock uses, named after the table (server-wide names include the database), so
///   it dies with that connection. [`take_lock`](MappedDb::take_lock) never waits for it:
///   `None` means another session holds it. [`lock_alive`](MappedDb::lock_alive) says
///   whether the session still holds it; it runs at most every
///   [`LOCK_CHECK_INTERVAL`](MappedDb::LOCK_CHECK_INTERVAL).
/// - **Rows** decode in [`raw_row`](MappedDb::raw_row) to plain values; a column that cannot
///   be read is a [`StoreErrorKind::SchemaMismatch`] naming it. [`int`](MappedDb::int) and
///   [`text`](MappedDb::text) read the statements' other (already cast) columns.
///
/// Methods return futures that are `Send`: the store runs them inside `'static` futures.
pub trait MappedDb: Send + Sync + Sized + 'static {
    type Options;
    /// A row as the driver returns it.
    type Row: Send + Sync;
    /// The session holding the active-relay lock.
    type Lock: Send;
    const DIALECT: Dialect;
    /// Shown by `describe` ("postgres", "mysql").
    const NAME: &'static str;
    /// How often the lock's session is checked: at every claim where the check is free, less
    /// often where it is a round trip.
    const LOCK_CHECK_INTERVAL: Duration;

    /// Builds the connection pool (no connection is opened until first use).
    fn open(options: Self::Options) -> StoreResult<Opened<Self>>;

    fn take_lock(
        &self,
        mapping: &Mapping,
    ) -> impl Future<Output = StoreResult<Option<Self::Lock>>> + Send;

    fn lock_alive(&self, lock: &mut Self::Lock) -> impl Future<Output = bool> + Send;

    /// The lock, taken from the session that holds it by ending that session, for a caller
    /// that knows the holder is stale ([`MappedStore::take_over`]) while `entitled` says so
    /// (asked right before the session is ended). `Err` names what stops it (a role that
    /// cannot end another's session). By default the plain [`take_lock`](MappedDb::take_lock).
    fn take_lock_from_stale(
        &self,
        mapping: &Mapping,
        entitled: &(dyn Fn() -> bool + Sync),
    ) -> impl Future<Output = StoreResult<Option<Self::Lock>>> + Send {
        let _ = entitled;
        self.take_lock(mapping)
    }

    fn query(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> impl Future<Output = StoreResult<Vec<Self::Row>>> + Send;

    /// Runs a statement; the rows it affected.
    fn execute(
        &self,
        context: &'static str,
        statement: String,
        params: Params,
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    fn execute_each(
        &self,
        context: &'static str,
        statement: String,
        rows: Vec<Params>,
    ) -> impl Future<Output = StoreResult<u64>> + Send;

    fn claim(
        &self,
        sql: &Sql,
        claim: Claim,
    ) -> impl Future<Output = StoreResult<Vec<Self::Row>>> + Send;

    /// Inserts one row with [`Sql::insert`], converting each text value to its column's
    /// type; the new row's integer id (0 for UUID ids).
    fn insert(
        &self,
        statement: String,
        values: Vec<Option<String>>,
    ) -> impl Future<Output = StoreResult<SequenceId>> + Send;

    fn raw_row(row: &Self::Row, mapping: &Mapping) -> StoreResult<RawRow>;
    /// The row's id, or why it cannot be read back as the mapping's id type (a value of
    /// the row: a UUID in another form). Such a row is set aside by the claim, where any
    /// other [`MappedDb::raw_row`] failure fails it.
    fn row_id(_row: &Self::Row, _mapping: &Mapping) -> StoreResult<()> {
        Ok(())
    }
    fn int(row: &Self::Row, index: usize) -> Option<i64>;
    fn text(row: &Self::Row, index: usize) -> Option<String>;

    fn ping(&self) -> impl Future<Output = StoreResult<()>> + Send;

    /// Refuses a database the relay cannot run on at all (`check` and `run` stop on it).
    fn refuse_unusable(&self) -> impl Future<Output = StoreResult<()>> + Send {
        async { Ok(()) }
    }

    /// `check`'s problems beyond the mapped columns (privileges, triggers, side tables).
    fn verify_access(
        &self,
        sql: &Sql,
        layout: &str,
    ) -> impl Future<Output = StoreResult<Vec<Problem>>> + Send;

    /// What `migrate` creates; `None` when there is nothing.
    fn ddl(&self, sql: &Sql) -> Option<String>;
    fn grants(&self, sql: &Sql, layout: &str, role: &str) -> String;
    fn migrate(&self, sql: &Sql) -> impl Future<Output = StoreResult<()>> + Send;
    /// Runs arbitrary SQL, several statements allowed (for tests and tools).
    fn batch_execute(&self, sql: &str) -> impl Future<Output = StoreResult<()>> + Send;

    /// The nodes table of layouts that have one; without it one active relay per table is
    /// the whole of the coordination, and nodes are not listed.
    fn nodes(&self) -> Option<&dyn NodeRegistry>;

    /// The table's change signal, where the database has one (see [`OutboxStore::subscribe`]).
    fn subscribe(&self, _on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// See [`OutboxStore::give_way_to_shutdown`].
    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// See [`OutboxStore::lock_holders`]; `mapping` is the table the relay works on.
    fn lock_holders(&self, _mapping: &Mapping) -> Option<StoreFuture<LockHolders>> {
        None
    }

    fn set_waiting(&self, _waiting: bool) {}
}

struct Leader<L> {
    lock: Option<L>,
    /// Counts the takes of the lock: the fence epoch of the engine's work under each.
    epoch: i64,
    last_try: Option<Instant>,
    last_check: Option<Instant>,
    last_reap: Option<Instant>,
}

impl<L> Leader<L> {
    /// Whether a standby (or a relay whose lock went) may try to take the lock now.
    fn take_due(&self) -> bool {
        self.lock.is_none() && self.last_try.is_none_or(|t| t.elapsed() >= LEADER_RETRY)
    }
}

struct Inner<D: MappedDb> {
    db: D,
    sql: Sql,
    layout: String,
    default_max_attempts: i64,
    memory: Mutex<Memory>,
    /// Locked before `leader` by whoever takes both (one order, no deadlock).
    leader: tokio::sync::Mutex<Leader<D::Lock>>,
    /// Shared by the fenced claims and settles while they check their take and write; a
    /// takeover holds it alone. Without it, a claim checked at one take could mark its rows
    /// after the lock was lost, taken again and reaped: they stayed leased to this relay,
    /// which had dropped them with the old take, and their key's later rows went first.
    takeover_gate: tokio::sync::RwLock<()>,
    /// The epoch of the lock held, 0 while none is: read by the fenced writes without
    /// waiting for `leader`, which a check or a reap holds through its statements.
    active_epoch: AtomicI64,
    /// The most characters of an error `last_error` takes ([`ERROR_CHARS`] until the
    /// column's own bound is read, at each takeover).
    error_chars: AtomicUsize,
}

/// The most characters of an error written to `last_error`, whatever the column holds: a
/// sink's error can quote a long answer, and a `text` column of MySQL holds 65,535 bytes.
pub const ERROR_CHARS: usize = 8_000;

/// How long the key of a row whose id cannot be read waits before the row is read again
/// (and its error said again).
pub const UNREADABLE_ROW_WAIT: Duration = Duration::from_secs(60);

/// A store over a mapped table. Cheap to clone.
pub struct MappedStore<D: MappedDb> {
    inner: Arc<Inner<D>>,
}

impl<D: MappedDb> Clone for MappedStore<D> {
    fn clone(&self) -> Self {
        MappedStore {
            inner: self.inner.clone(),
        }
    }
}

impl<D: MappedDb> MappedStore<D> {
    /// Validates the mapping and builds the pool. No connection is opened until first use.
    pub fn new(options: D::Options) -> StoreResult<Self> {
        let opened = D::open(options)?;
        Ok(MappedStore {
            inner: Arc::new(Inner {
                sql: Sql::new(opened.mapping, D::DIALECT)?,
                db: opened.db,
                layout: opened.layout,
                default_max_attempts: opened.max_attempts as i64,
                memory: Mutex::new(Memory::default()),
                leader: tokio::sync::Mutex::new(Leader {
                    lock: None,
                    epoch: 0,
                    last_try: None,
                    last_check: None,
                    last_reap: None,
                }),
                takeover_gate: tokio::sync::RwLock::new(()),
                active_epoch: AtomicI64::new(0),
                error_chars: AtomicUsize::new(ERROR_CHARS),
            }),
        })
    }

    /// The claimed rows whose ids the relay can read back, in claim order. A row whose id
    /// it cannot (a UUID kept in another form) could be neither marked, acked nor
    /// dead-lettered: it is set aside with an error naming the fix, and its key waits
    /// [`UNREADABLE_ROW_WAIT`] (then it is read again), so that its later rows do not go
    /// out before it while every other key flows.
    fn readable(&self, rows: Vec<D::Row>) -> StoreResult<Vec<RawRow>> {
        let m = &self.inner.sql.mapping;
        let mut set_aside: HashSet<String> = HashSet::new();
        let mut raw = Vec::with_capacity(rows.len());
        for row in &rows {
            // The key as `decode` derives it; a row-keyed table's own id is its key.
            let key = || {
                D::text(row, 3).or_else(|| match m.key_fallback {
                    KeyFallback::Destination => D::text(row, 2),
                    KeyFallback::Row => None,
                })
            };
            if let Err(e) = D::row_id(row, m) {
                tracing::error!(error = %e, "a claimed row is set aside");
                set_aside.extend(key());
            } else if !key().is_some_and(|k| set_aside.contains(&k)) {
                raw.push(D::raw_row(row, m)?);
            }
        }
        if !set_aside.is_empty() {
            self.memory()
                .waiting(set_aside.into_iter().map(|key| (key, UNREADABLE_ROW_WAIT)));
        }
        Ok(raw)
    }

    pub fn sql(&self) -> &Sql {
        &self.inner.sql
    }

    pub fn db(&self) -> &D {
        &self.inner.db
    }

    /// Gives up being the table's active relay (its lock's session is closed, which frees
    /// the lock for another relay); the next claim tries to become it again. For a store
    /// whose claims another lock already decides (binlog capture's parked table, claimed
    /// only by the binary log's reader): the reader that loses its seat steps down here too.
    pub async fn step_down(&self) {
        let mut leader = self.inner.leader.lock().await;
        if leader.lock.is_some() {
            self.let_go(&mut leader);
            tracing::info!(table = %self.table_name(), "no longer the table's active relay");
        }
        leader.last_try = None;
    }

    /// Becomes the table's active relay now, ending the session of a stale holder: for a
    /// store whose claims another lock already decides (binlog capture's parked table), when
    /// this relay took that lock from a holder it fenced. A holder paused past its lease
    /// keeps its session, and the server ends an idle one only after `wait_timeout` (8
    /// hours by default): until then nobody would claim the table. `entitled` says whether
    /// this relay still holds that other lock (a relay paused past it must end nobody's
    /// session). Returns whether it is the active relay now.
    pub async fn take_over(
        &self,
        lease: Duration,
        entitled: &(dyn Fn() -> bool + Sync),
    ) -> StoreResult<bool> {
        let inner = &self.inner;
        if inner.active_epoch.load(Ordering::Acquire) != 0 {
            return Ok(true);
        }
        let _alone = inner.takeover_gate.write().await;
        let mut leader = inner.leader.lock().await;
        if leader.lock.is_some() {
            return Ok(true);
        }
        leader.last_try = Some(Instant::now());
        let taken = inner
            .db
            .take_lock_from_stale(&inner.sql.mapping, entitled)
            .await?;
        let Some(lock) = taken else {
            return Ok(false);
        };
        let reaped = self.become_active(&mut leader, lock, lease).await?;
        tracing::info!(layout = %inner.layout, table = %self.table_name(), reaped, "this relay took over as the table's active relay");
        Ok(true)
    }

    /// Whether this layout keeps a seed's own table (for `check`).
    pub fn seed(&self) -> Option<crate::Seed> {
        self.inner.sql.mapping.seed
    }

    /// What `migrate` creates; `None` when there is nothing (a custom mapping on MySQL).
    pub fn ddl(&self) -> Option<String> {
        self.inner.db.ddl(&self.inner.sql)
    }

    /// The relay's least privileges at run time, as SQL.
    pub fn grants(&self, role: &str) -> String {
        self.inner
            .db
            .grants(&self.inner.sql, &self.inner.layout, role)
    }

    pub async fn migrate(&self) -> StoreResult<()> {
        self.inner.db.migrate(&self.inner.sql).await
    }

    /// Runs arbitrary SQL, several statements allowed (for tests and tools).
    pub async fn batch_execute(&self, sql: &str) -> StoreResult<()> {
        self.inner.db.batch_execute(sql).await
    }

    /// True when this process is the table's active relay (for tests and `stats`).
    pub async fn is_active(&self) -> bool {
        let mut leader = self.inner.leader.lock().await;
        match leader.lock.as_mut() {
            Some(lock) => self.inner.db.lock_alive(lock).await,
            None => false,
        }
    }

    fn table_name(&self) -> String {
        let m = &self.inner.sql.mapping;
        match &m.schema {
            Some(s) => format!("{s}.{}", m.table),
            None => m.table.clone(),
        }
    }

    fn params(&self) -> Params {
        Params::new(D::DIALECT)
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        // Memory's methods do not panic, so the lock is never poisoned.
        self.inner
            .memory
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Database ids for engine handles: the integer ids themselves, or the UUIDs memory holds.
    fn row_ids(&self, handles: &[SequenceId]) -> Vec<RowId> {
        match self.inner.sql.mapping.id_type {
            IdType::Integer => handles.iter().map(|h| RowId::Integer(*h)).collect(),
            IdType::Uuid => {
                let memory = self.memory();
                handles
                    .iter()
                    .filter_map(|h| memory.uuid(*h).map(RowId::Uuid))
                    .collect()
            }
        }
    }

    fn unsupported(&self, what: &str) -> StoreError {
        StoreError::new(
            StoreErrorKind::Config,
            format!("the {} layout {what}", self.inner.layout),
        )
    }

    /// Keeps `ownership` (one partition: the table) in step with the active-relay lock, every
    /// [`ACTIVE_CHECK_EVERY`], for as long as it runs: granted at the epoch of each take of
    /// the lock, renewed by each check that finds it held, removed once it is gone. A lock
    /// taken again (lost and retaken between two checks) is first removed, and granted at
    /// its new epoch once the engine holds nothing of the old one: the takeover returned
    /// those rows to pending. With this running, claims take no lock themselves. Each
    /// round is an attempt of `health`'s [`Check::Leases`]: a lock that cannot be checked or
    /// taken over shows on `/readyz`.
    pub async fn keep_active(
        self,
        ownership: Arc<Ownership>,
        lease: Duration,
        health: Arc<Health>,
    ) {
        // The generation of the last removal: a take is granted only once the engine has
        // acted on it (dropped the old take's work), or it would go on with that work under
        // the new epoch, its rows reaped and claimed again.
        let mut removed_at: Option<u64> = None;
        let remove = |ownership: &Ownership, removed_at: &mut Option<u64>| {
            if !ownership.held().is_empty() {
                ownership.remove(0);
                *removed_at = Some(ownership.generation());
            }
        };
        loop {
            let attempt = health.begin(Check::Leases);
            let checked_at = Instant::now();
            let mut leader = self.inner.leader.lock().await;
            let checked = if self.check_held(&mut leader).await {
                Ok(true)
            } else {
                // Known gone: nothing more is published, whatever a take brings.
                remove(&ownership, &mut removed_at);
                let taken;
                (leader, taken) = self.take_if_due(leader, lease).await;
                taken
            };
            // The renewal is vouched for by the check, not held up by the reap after it. A
            // lock taken again is granted once the engine holds nothing of the old take.
            if matches!(checked, Ok(true)) {
                let (epoch, valid_until) = (leader.epoch, checked_at + ACTIVE_VOUCHED_FOR);
                match ownership.held().first() {
                    Some(&(_, held)) if held == epoch => ownership.renewed(0, valid_until),
                    Some(_) => remove(&ownership, &mut removed_at),
                    None if ownership.is_busy(0) => {}
                    None if removed_at.is_some_and(|g| !ownership.engine_has_seen(g)) => {}
                    None => {
                        ownership.grant(0, epoch, valid_until);
                        removed_at = None;
                    }
                }
            }
            // A standby's round between two tries says nothing: recorded as a success, a
            // standby whose tries fail showed ready and not ready in turn.
            let between_tries =
                matches!(checked, Ok(false)) && leader.last_try.is_some_and(|t| t < checked_at);
            let reaped = match checked {
                Ok(true) => self.reap_expired_if_due(&mut leader, lease).await,
                other => other.map(|_| ()),
            };
            drop(leader);
            match reaped {
                Ok(()) if between_tries => drop(attempt),
                Ok(()) => attempt.succeeded(),
                Err(e) => {
                    if attempt.failed(e.report()) {
                        tracing::warn!(layout = %self.inner.layout, error = %e.report(), "cannot check, take or reap the table's active-relay lock; publishing pauses once the last check no longer vouches for it");
                    }
                }
            }
            tokio::time::sleep(ACTIVE_CHECK_EVERY).await;
        }
    }

    /// Lets a write fenced with `fence` run, holding off a takeover until it ends: unfenced
    /// (no ownership follows the lock), or the lock is held at the fence's epoch. `None`
    /// refuses it: a write of an earlier take would touch rows the new take reaped, which
    /// it (or another relay) may hold now where the table does not say who holds them.
    async fn fenced_write(
        &self,
        fence: Option<&Fence>,
    ) -> Option<tokio::sync::RwLockReadGuard<'_, ()>> {
        let gate = self.inner.takeover_gate.read().await;
        let Some(fence) = fence else {
            return Some(gate);
        };
        let active = self.inner.active_epoch.load(Ordering::Acquire);
        (active != 0 && fence.epochs == [active]).then_some(gate)
    }

    /// Records `lock` as held, at a new epoch.
    fn hold(&self, leader: &mut Leader<D::Lock>, lock: D::Lock) {
        leader.lock = Some(lock);
        leader.epoch += 1;
        leader.last_check = Some(Instant::now());
        self.inner
            .active_epoch
            .store(leader.epoch, Ordering::Release);
    }

    /// Records the lock as gone (its session closes with it).
    fn let_go(&self, leader: &mut Leader<D::Lock>) {
        leader.lock = None;
        self.inner.active_epoch.store(0, Ordering::Release);
    }

    /// Becomes (or stays) the active relay; false when another relay is active. Reaps rows
    /// whose lease expired every half lease.
    async fn ensure_active(&self, lease: Duration) -> StoreResult<bool> {
        let mut leader = self.inner.leader.lock().await;
        if !self.check_held(&mut leader).await {
            let taken;
            (leader, taken) = self.take_if_due(leader, lease).await;
            if !taken? {
                return Ok(false);
            }
        }
        self.reap_expired_if_due(&mut leader, lease).await?;
        Ok(true)
    }

    /// Checks the lock held, when a check is due. Whether it is held.
    async fn check_held(&self, leader: &mut Leader<D::Lock>) -> bool {
        let check_due = leader
            .last_check
            .is_none_or(|t| t.elapsed() >= D::LOCK_CHECK_INTERVAL);
        if let (Some(lock), true) = (leader.lock.as_mut(), check_due) {
            let alive = self.inner.db.lock_alive(lock).await;
            leader.last_check = Some(Instant::now());
            if !alive {
                tracing::warn!(layout = %self.inner.layout, "lost the connection holding the active-relay lock; claiming stops until it is taken again");
                self.let_go(leader);
            }
        }
        leader.lock.is_some()
    }

    /// Tries to take the lock (a standby, or a relay whose lock went), once per
    /// [`LEADER_RETRY`]; a take is the takeover. Alone: the fenced claims and settles of
    /// the last take end first (`takeover_gate`), so none marks or settles a row after the
    /// reap. `leader` is let go while they end. Whether this relay is the active one now.
    async fn take_if_due<'a>(
        &'a self,
        leader: tokio::sync::MutexGuard<'a, Leader<D::Lock>>,
        lease: Duration,
    ) -> (
        tokio::sync::MutexGuard<'a, Leader<D::Lock>>,
        StoreResult<bool>,
    ) {
        if !leader.take_due() {
            let active = leader.lock.is_some();
            return (leader, Ok(active));
        }
        drop(leader);
        let alone = self.inner.takeover_gate.write().await;
        let mut leader = self.inner.leader.lock().await;
        // Taken meanwhile (`take_over`), or tried.
        if !leader.take_due() {
            let active = leader.lock.is_some();
            return (leader, Ok(active));
        }
        let taken = self.take(&mut leader, lease).await;
        drop(alone);
        (leader, taken)
    }

    /// Takes the lock if it is free, and takes the table over: the rows its last holder
    /// left in flight return to pending. Whether it was taken.
    async fn take(&self, leader: &mut Leader<D::Lock>, lease: Duration) -> StoreResult<bool> {
        let inner = &self.inner;
        leader.last_try = Some(Instant::now());
        let Some(lock) = inner.db.take_lock(&inner.sql.mapping).await? else {
            return Ok(false);
        };
        let reaped = self.become_active(leader, lock, lease).await?;
        tracing::info!(layout = %inner.layout, table = %self.table_name(), reaped, "this relay is now the table's active relay");
        Ok(true)
    }

    /// Holds `lock` (just taken) and takes the table over: the rows its last holder left in
    /// flight return to pending (how many, returned), and the keys waiting to retry are read.
    /// A takeover cut short is let go whole, to be taken again from the start: kept, its
    /// predecessor's rows stayed in flight for good (a table with no time to reap them by),
    /// and keys waiting to retry went unblocked.
    async fn become_active(
        &self,
        leader: &mut Leader<D::Lock>,
        lock: D::Lock,
        lease: Duration,
    ) -> StoreResult<u64> {
        self.hold(leader, lock);
        self.memory().take_over();
        let taken_over = async {
            let reaped = self.reap(true, lease).await?;
            self.load_waiting_keys().await?;
            Ok::<_, StoreError>(reaped)
        }
        .await;
        if taken_over.is_err() {
            self.let_go(leader);
        }
        let reaped = taken_over?;
        self.read_error_bound().await;
        leader.last_reap = Some(Instant::now());
        Ok(reaped)
    }

    /// Returns rows whose lease ran out to pending, every half lease.
    async fn reap_expired_if_due(
        &self,
        leader: &mut Leader<D::Lock>,
        lease: Duration,
    ) -> StoreResult<()> {
        if leader.last_reap.is_some_and(|t| t.elapsed() < lease / 2) {
            return Ok(());
        }
        // Marked once done: a reap that fails is tried again at the next look, so that its
        // failure lasts (and shows) until one succeeds.
        let reaped = self.reap(false, lease).await?;
        leader.last_reap = Some(Instant::now());
        if reaped > 0 {
            tracing::warn!(layout = %self.inner.layout, reaped, "returned rows with expired leases to pending");
        }
        Ok(())
    }

    /// Reads how much of an error `last_error` holds. An error longer than a custom
    /// mapping's `varchar(255)` was refused (strict MySQL, PostgreSQL), and the retry or dead
    /// letter with it, every time: the rows stayed leased, their keys stuck.
    async fn read_error_bound(&self) {
        let sql = &self.inner.sql;
        let Some(column) = &sql.mapping.last_error else {
            return;
        };
        let mut p = self.params();
        let statement = sql.column_length_query(column, &mut p);
        match self
            .inner
            .db
            .query("read last_error's length", statement, p)
            .await
        {
            Ok(rows) => {
                let bound = |i| {
                    rows.first()
                        .and_then(|r| D::int(r, i))
                        .and_then(|n| usize::try_from(n).ok())
                };
                // A character takes up to 4 bytes.
                let chars = [bound(0), bound(1).map(|bytes| bytes / 4), Some(ERROR_CHARS)]
                    .into_iter()
                    .flatten()
                    .min()
                    .unwrap_or(ERROR_CHARS)
                    .max(1);
                self.inner
                    .error_chars
                    .store(chars, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot read last_error's length; errors are cut to {ERROR_CHARS} characters")
            }
        }
    }

    /// An error as `last_error` holds it.
    fn fitted_error<'a>(&self, error: &'a str) -> &'a str {
        let chars = self
            .inner
            .error_chars
            .load(std::sync::atomic::Ordering::Relaxed);
        outbox_core::redact::first_chars(error, chars)
    }

    /// Returns rows held by a gone relay (`all`, at takeover) or whose lease expired to
    /// pending, or marks them dead on their last attempt.
    /// Blocks the keys the table shows waiting to retry ([`Memory::waiting`]).
    async fn load_waiting_keys(&self) -> StoreResult<()> {
        let Some(statement) = self.inner.sql.waiting_keys() else {
            return Ok(());
        };
        let rows = self
            .inner
            .db
            .query("waiting keys", statement, self.params())
            .await?;
        let keys = rows.iter().filter_map(|r| {
            let left = u64::try_from(D::int(r, 1)?).unwrap_or(0);
            Some((D::text(r, 0)?, Duration::from_millis(left)))
        });
        self.memory().waiting(keys);
        Ok(())
    }

    async fn reap(&self, all: bool, lease: Duration) -> StoreResult<u64> {
        let sql = &self.inner.sql;
        let mut total = 0;
        for to_dead in [true, false] {
            let mut p = self.params();
            let (max, all, lease) = (
                p.int(self.inner.default_max_attempts),
                p.bool(all),
                p.int(millis(lease)),
            );
            if let Some(statement) = sql.reap(to_dead, &max, &all, &lease) {
                total += self.inner.db.execute("reap", statement, p).await?;
            }
        }
        Ok(total)
    }

    /// Runs a statement over the held rows `handles` name: `statement` gets the ids'
    /// membership test (after the id column) and their parameters; none known, nothing runs.
    async fn on_rows(
        &self,
        context: &'static str,
        handles: &[SequenceId],
        statement: impl FnOnce(&str, &mut Params) -> Option<String>,
    ) -> StoreResult<Option<u64>> {
        let ids = self.row_ids(handles);
        let mut p = self.params();
        let membership = p.in_ids(&ids, self.inner.sql.mapping.id_type);
        match statement(&membership, &mut p) {
            Some(_) if ids.is_empty() => Ok(Some(0)),
            Some(s) => self.inner.db.execute(context, s, p).await.map(Some),
            None => Ok(None),
        }
    }

    /// One execution per row, all in one transaction: `statement` binds the row's values and
    /// returns the statement (the same text for every row). `None` when the layout records
    /// nothing in the table (memory alone keeps it); rows the table no longer has are skipped.
    async fn statement_per_row<T>(
        &self,
        context: &'static str,
        rows: &[T],
        handle: impl Fn(&T) -> SequenceId,
        statement: impl Fn(&T, &RowId, &mut Params) -> Option<String>,
    ) -> StoreResult<Option<u64>> {
        let mut text = None;
        let mut bound = Vec::new();
        for row in rows {
            let Some(id) = self.row_ids(&[handle(row)]).pop() else {
                continue;
            };
            let mut p = self.params();
            text = statement(row, &id, &mut p);
            bound.push(p);
        }
        match text {
            Some(text) => self
                .inner
                .db
                .execute_each(context, text, bound)
                .await
                .map(Some),
            None => Ok(None),
        }
    }

    async fn first_int(
        &self,
        context: &'static str,
        statement: String,
        p: Params,
    ) -> StoreResult<u64> {
        let rows = self.inner.db.query(context, statement, p).await?;
        Ok(rows.first().and_then(|r| D::int(r, 0)).unwrap_or(0).max(0) as u64)
    }

    /// Ids of up to `limit` rows matching `condition`, in id order.
    async fn pick(&self, condition: &str, mut p: Params, limit: u32) -> StoreResult<Vec<RowId>> {
        let sql = &self.inner.sql;
        let statement = sql.pick(condition, &p.int(limit as i64));
        let rows = self.inner.db.query("select rows", statement, p).await?;
        Ok(rows
            .iter()
            .filter_map(|r| D::text(r, 0))
            .filter_map(|t| match sql.mapping.id_type {
                IdType::Integer => t.parse().ok().map(RowId::Integer),
                IdType::Uuid => Uuid::parse_str(&t).ok().map(RowId::Uuid),
            })
            .collect())
    }

    /// A dead-row selector as a condition over alias `o`, with its parameters.
    fn selector(&self, selector: &DeadSelector) -> StoreResult<(String, Params)> {
        let sql = &self.inner.sql;
        let mut p = self.params();
        let condition = match selector {
            DeadSelector::Ids(ids) => {
                if sql.mapping.id_type != IdType::Integer {
                    return Err(self.unsupported(
                        "has UUID row ids: select dead events with --destination or --all",
                    ));
                }
                let ids: Vec<RowId> = ids.iter().map(|i| RowId::Integer(*i)).collect();
                format!("{} {}", sql.id_column(), p.in_ids(&ids, IdType::Integer))
            }
            DeadSelector::Destination(d) => sql.destination_is(&p.text(d.clone())),
            DeadSelector::All => "1 = 1".into(),
        };
        Ok((condition, p))
    }

    /// Dead rows matching a selector's condition.
    fn dead_where(&self, condition: &str) -> String {
        format!("({}) AND {condition}", self.inner.sql.dead())
    }

    /// The delivered rows `selector` chooses.
    fn replay_condition(&self, selector: ReplaySelector) -> StoreResult<(String, Params)> {
        let sql = &self.inner.sql;
        if sql.delivered().is_none() {
            return Err(self.unsupported("deletes delivered rows: there is nothing to replay"));
        }
        if sql.created_at().is_none() {
            return Err(
                self.unsupported("has no creation time column: replay cannot select by time")
            );
        }
        if sql.mapping.id_type != IdType::Integer {
            return Err(self.unsupported("has UUID row ids: replay it with SQL, e.g. UPDATE ... SET status = 'PENDING' WHERE created_at >= ..."));
        }
        let mut p = self.params();
        let (since, until) = (p.int(micros(selector.since)), p.int(micros(selector.until)));
        let mut condition = sql
            .delivered_between(&since, &until)
            .expect("checked above");
        if let Some(d) = selector.destination {
            condition = format!("{condition} AND {}", sql.destination_is(&p.text(d)));
        }
        Ok((condition, p))
    }

    /// `prune`'s condition (delivered or dead rows older than `before`) and its parameters.
    fn prune_condition(&self, dead: bool, before: SystemTime) -> Option<(String, Params)> {
        let sql = &self.inner.sql;
        let mut p = self.params();
        let before = p.int(micros(before));
        let condition = if dead {
            sql.dead_before(&before)
        } else {
            sql.delivered_before(&before)
        }?;
        Some((condition, p))
    }

    async fn prune(&self, dead: bool, before: SystemTime, batch: u32) -> StoreResult<u64> {
        let Some((condition, p)) = self.prune_condition(dead, before) else {
            return Ok(0);
        };
        let ids = self.pick(&condition, p, batch).await?;
        if ids.is_empty() {
            return Ok(0);
        }
        // Checked again by the delete: a row made pending since the pick stays.
        let Some(condition) = self.prune_condition(dead, before) else {
            return Ok(0);
        };
        self.delete_picked("delete", &ids, condition).await
    }

    /// Deletes those of the picked `ids` that `condition` (made afresh: its parameters are
    /// the statement's) still selects, and the side-table records of the rows gone; how many
    /// were deleted. A row changed since its pick (made pending again) stays.
    async fn delete_picked(
        &self,
        context: &'static str,
        ids: &[RowId],
        (condition, mut p): (String, Params),
    ) -> StoreResult<u64> {
        let sql = &self.inner.sql;
        let statement = sql.delete_matching(&p.in_ids(ids, sql.mapping.id_type), &condition);
        let n = self.inner.db.execute(context, statement, p).await?;
        if sql.mapping.dead_state() == DeadState::SideTable {
            // Records of rows still dead and now deleted; a retried row's went with its retry.
            let mut p = self.params();
            let gone = sql.delete_dead_records_of_missing(&p.in_ids(ids, sql.mapping.id_type));
            self.inner.db.execute(context, gone, p).await?;
        }
        Ok(n)
    }

    async fn insert_events(&self, events: Vec<NewEvent>) -> StoreResult<Vec<SequenceId>> {
        let m = &self.inner.sql.mapping;
        let mut ids = Vec::with_capacity(events.len());
        for event in events {
            let event_id = event.event_id.unwrap_or_else(Uuid::new_v4);
            let mut columns: Vec<&str> = vec![&m.destination, &m.payload];
            let mut values = vec![Some(event.destination.clone()), event.payload.clone()];
            let optional = [
                (&m.key, event.partition_key.clone()),
                (&m.event_type, Some(event.event_type.clone())),
                (
                    &m.headers,
                    Some(serde_json::to_string(&event.headers).unwrap_or_else(|_| "{}".into())),
                ),
                (
                    &m.mutation_id,
                    Some(event.mutation_id.unwrap_or_else(|| event_id.to_string())),
                ),
                (&m.event_id, Some(event_id.to_string())),
            ];
            for (column, value) in optional {
                // A column mapped twice (the MySQL seed's `type`) is written once.
                if let Some(c) = column.as_deref().filter(|c| *c != m.destination) {
                    columns.push(c);
                    values.push(value);
                }
            }
            let statement = self.inner.sql.insert(&columns);
            ids.push(self.inner.db.insert(statement, values).await?);
        }
        Ok(ids)
    }

    async fn verify(&self) -> StoreResult<Vec<Problem>> {
        let (db, sql, layout) = (&self.inner.db, &self.inner.sql, &self.inner.layout);
        db.refuse_unusable().await?;
        let m = &sql.mapping;
        let fix = if m.seed.is_some() {
            format!(
                "run `outbox-relay migrate --layout {layout}` (or apply `outbox-relay migrate --layout {layout} --print`)"
            )
        } else {
            "check the [mapping] section of the configuration against the table".to_string()
        };
        let mut p = self.params();
        let statement = sql.columns_query(&mut p);
        let types: HashMap<String, String> = db
            .query("verify", statement, p)
            .await?
            .iter()
            .filter_map(|r| Some((D::text(r, 0)?, D::text(r, 1).unwrap_or_default())))
            .collect();
        let present: HashSet<String> = types.keys().cloned().collect();
        let table = self.table_name();
        if present.is_empty() {
            return Ok(vec![Problem::blocking(
                format!("table {table} does not exist (or the relay's role cannot see it)"),
                fix,
            )]);
        }
        let mut problems: Vec<Problem> = Vec::new();
        // The nodes table this relay names (a later `nodes_table` than `migrate` made): `run`
        // failed on it while `check` said ok.
        if let Some(nodes) = db.nodes() {
            if let Err(e) = nodes.live_nodes().await {
                if e.kind() == StoreErrorKind::MissingSchema {
                    problems.push(Problem::blocking(
                        format!("the nodes table: {}", outbox_core::error::report(&e)),
                        fix.clone(),
                    ));
                }
            }
        }
        problems.extend(
            m.columns()
                .into_iter()
                .filter(|column| !present.contains(*column))
                .map(|column| {
                    Problem::blocking(
                        format!(
                        "table {table} has no column {column:?}, which the {layout} layout maps"
                    ),
                        fix.clone(),
                    )
                }),
        );
        problems.extend(
            crate::column_types::problems(m, D::DIALECT, &types)
                .into_iter()
                .map(|what| Problem::blocking(format!("table {table}: {what}"), fix.clone())),
        );
        if let Some(column) = m.event_id.as_deref().filter(|c| present.contains(*c)) {
            let mut p = self.params();
            let statement = sql.unique_column_query(column, &mut p);
            let unique = db.query("verify", statement, p).await?;
            if unique.first().and_then(|r| D::int(r, 0)) == Some(0) {
                // A risk, not a fault: most applications' ids are unique without one.
                problems.push(Problem::advisory(
                    format!(
                        "table {table}: no unique index holds the event id column {column:?} \
                         alone: two rows with one event id go out as one event to every sink \
                         that drops duplicates by id (JetStream, SQS FIFO, a consumer's \
                         dedupe), and the later one is lost"
                    ),
                    format!(
                        "CREATE UNIQUE INDEX … ON {} ({})",
                        sql.table(),
                        sql.quote(column)
                    ),
                ));
            }
        }
        problems.extend(db.verify_access(sql, layout).await?);
        Ok(problems)
    }
}

/// Binds a failed row's values for [`Sql::retry`] and [`Sql::dead_letter`].
fn failure(p: &mut Params, id: &RowId, node: &NodeId, attempts: u32, error: &str) -> Failure {
    Failure {
        id: p.id(id),
        node: p.text(node.0.clone()),
        attempts: p.int(i64::from(attempts)),
        error: p.text(error.to_string()),
    }
}

impl<D: MappedDb> OutboxStore for MappedStore<D> {
    fn describe(&self) -> String {
        format!(
            "{} {} ({} layout)",
            D::NAME,
            self.table_name(),
            self.inner.layout
        )
    }

    fn leaves_out_crowded_keys(&self) -> bool {
        self.inner.sql.leaves_out_crowded_keys()
    }

    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>> {
        let store = self.clone();
        async move {
            // Fenced: the lock is kept by `keep_active`, and the claim runs only at the
            // epoch it was granted, holding off a takeover until its rows are marked. (Not
            // holding `leader`: a slow claim then kept the keeper from renewing, and the
            // engine dropped all its work.)
            let _fenced = match &request.fence {
                Some(fence) => match store.fenced_write(Some(fence)).await {
                    Some(gate) => Some(gate),
                    None => return Ok(Vec::new()),
                },
                None if store.ensure_active(request.lease).await? => None,
                None => return Ok(Vec::new()),
            };
            let sql = &store.inner.sql;
            let (blocked, held) = {
                let mut memory = store.memory();
                (memory.blocked_keys(&request.node.0), memory.held())
            };
            let mut params = store.params();
            let mut condition = sql.claimable();
            if !blocked.is_empty() {
                let not_blocked = params.not_in_texts(&sql.key_expr(), blocked);
                condition = format!("{condition} AND {not_blocked}");
            }
            let Crowded { keys, window } = request.crowded.clone();
            let window_end = match (keys.is_empty(), sql.window_end(window)) {
                (false, Some(query)) => {
                    let rows = store.inner.db.query("claim", query, store.params()).await?;
                    Some(rows.first().and_then(|row| D::int(row, 0)).unwrap_or(0))
                }
                _ => None,
            };
            if let Some(end) = window_end {
                // A NULL key is never crowded (NOT IN would leave its row out).
                let expr = format!("coalesce({}, '')", sql.key_expr());
                let uncrowded = params.not_in_texts(&expr, keys);
                let id = sql.id_column();
                condition = format!("{condition} AND {uncrowded} AND {id} <= {end}");
            }
            let marks = sql.mapping.marks_claims();
            if !marks && !held.is_empty() {
                let held =
                    params.not_in_ids(&sql.id_column(), &store.row_ids(&held), sql.mapping.id_type);
                condition = format!("{condition} AND {held}");
            }
            let claim = Claim {
                condition,
                params,
                limit: request.limit as i64,
                mark: marks.then(|| (request.node.0.clone(), millis(request.lease))),
            };
            let rows = store.inner.db.claim(sql, claim).await?;
            let raw = store.readable(rows)?;
            let mut memory = store.memory();
            Ok(raw
                .into_iter()
                .map(|raw| {
                    decode(
                        &sql.mapping,
                        raw,
                        &mut memory,
                        &request.node.0,
                        request.lease,
                    )
                })
                .collect())
        }
        .boxed()
    }

    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let Some(_fenced) = store.fenced_write(holder.fence.as_deref()).await else {
                return Ok(0);
            };
            let node = holder.node;
            let count = ids.len();
            let n = store
                .on_rows("ack", &ids, |ids, p| {
                    Some(store.inner.sql.ack(ids, count, &p.text(node.0)))
                })
                .await?
                .unwrap_or(0);
            store.memory().settled(&ids, true);
            Ok(n)
        }
        .boxed()
    }

    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let Some(_fenced) = store.fenced_write(holder.fence.as_deref()).await else {
                return Ok(0);
            };
            let node = holder.node;
            let sql = &store.inner.sql;
            let n = store
                .statement_per_row(
                    "retry",
                    &retries,
                    |r| r.sequence_id,
                    |r, id, p| {
                        let failure =
                            failure(p, id, &node, r.attempts, store.fitted_error(&r.error));
                        sql.retry(&failure, &p.int(millis(r.delay)))
                    },
                )
                .await?
                // Nothing to record in the table: memory holds the attempt and the backoff.
                .unwrap_or(retries.len() as u64);
            // After the table recorded it: the key unblocks here no sooner than there.
            store.memory().retried(&retries);
            Ok(n)
        }
        .boxed()
    }

    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let Some(_fenced) = store.fenced_write(holder.fence.as_deref()).await else {
                return Ok(0);
            };
            let node = holder.node;
            let sql = &store.inner.sql;
            let n = store
                .statement_per_row(
                    "dead-letter",
                    &entries,
                    |e| e.sequence_id,
                    |e, id, p| {
                        let error = store.fitted_error(&e.error);
                        Some(sql.dead_letter(&failure(p, id, &node, e.attempts, error)))
                    },
                )
                .await?
                .unwrap_or(0);
            let handles: Vec<SequenceId> = entries.iter().map(|e| e.sequence_id).collect();
            store.memory().settled(&handles, true);
            Ok(n)
        }
        .boxed()
    }

    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            // Not active: the rows are another relay's to hold now (the takeover returned
            // them to pending), or will be at its takeover.
            if store.inner.active_epoch.load(Ordering::Acquire) == 0 {
                store.memory().settled(&ids, false);
                return Ok(ids.len() as u64);
            }
            let n = store
                .on_rows("release", &ids, |ids, p| {
                    store.inner.sql.release(ids, &p.text(node.0))
                })
                .await?
                // Nothing to undo in the table: the row leaves memory only.
                .unwrap_or(ids.len() as u64);
            store.memory().settled(&ids, false);
            Ok(n)
        }
        .boxed()
    }

    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            // Only the active relay: a standby's release would take rows from under the
            // active one where the table does not say who holds a row. No takeover runs
            // through the statement.
            let _alone_with_this_take = store.inner.takeover_gate.read().await;
            if store.inner.active_epoch.load(Ordering::Acquire) == 0 {
                return Ok(0);
            }
            let sql = &store.inner.sql;
            let mut p = store.params();
            let node_param = p.text(node.0);
            let held = store.row_ids(&held);
            // An empty list leaves the condition out (`NOT IN (NULL)` matches no row).
            let not_held = (!held.is_empty())
                .then(|| p.not_in_ids(&sql.id_column(), &held, sql.mapping.id_type));
            let Some(statement) = sql.release_unheld(not_held.as_deref(), &node_param) else {
                return Ok(0);
            };
            store.inner.db.execute("release unheld", statement, p).await
        }
        .boxed()
    }

    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64> {
        let LeaseExtension { node, ids, lease } = extension;
        let store = self.clone();
        async move {
            store.memory().extend(&ids, lease);
            Ok(store
                .on_rows("extend leases", &ids, |ids, p| {
                    let (node, lease) = (p.text(node.0), p.int(millis(lease)));
                    store.inner.sql.extend(ids, &node, &lease)
                })
                .await?
                .unwrap_or(ids.len() as u64))
        }
        .boxed()
    }

    fn backlog(&self) -> StoreFuture<Backlog> {
        let store = self.clone();
        async move {
            let statement = store.inner.sql.stats(false);
            let rows = store
                .inner
                .db
                .query("backlog", statement, store.params())
                .await?;
            let row = rows.first().ok_or_else(|| {
                StoreError::new(StoreErrorKind::Query, "backlog: no row returned")
            })?;
            let n = |i| D::int(row, i).unwrap_or(0).max(0) as u64;
            Ok(Backlog {
                pending: n(0),
                retrying: n(1),
                dead: n(2),
                oldest_pending_age: D::int(row, 3)
                    .map(|ms| Duration::from_millis(ms.max(0) as u64)),
            })
        }
        .boxed()
    }

    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>> {
        let store = self.clone();
        async move { store.insert_events(events).await }.boxed()
    }

    fn ping(&self) -> StoreFuture<()> {
        let store = self.clone();
        async move { store.inner.db.ping().await }.boxed()
    }

    fn verify(&self) -> StoreFuture<Vec<Problem>> {
        let store = self.clone();
        async move { store.verify().await }.boxed()
    }

    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>> {
        self.inner.db.subscribe(on_change)
    }

    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        self.inner.db.give_way_to_shutdown()
    }

    fn lock_holders(&self) -> Option<StoreFuture<LockHolders>> {
        self.inner.db.lock_holders(&self.inner.sql.mapping)
    }

    fn set_waiting(&self, waiting: bool) {
        self.inner.db.set_waiting(waiting);
    }
}

/// Layouts without a nodes table keep no membership: one active relay holds the table's lock.
impl<D: MappedDb> NodeRegistry for MappedStore<D> {
    fn register(&self, node: NodeId, ttl: Duration) -> StoreFuture<Registration> {
        match self.inner.db.nodes() {
            Some(nodes) => nodes.register(node, ttl),
            None => futures::future::ready(Ok(Registration::Registered(Incarnation(0)))).boxed(),
        }
    }

    fn heartbeat(&self, beat: Heartbeat) -> StoreFuture<Heartbeated> {
        match self.inner.db.nodes() {
            Some(nodes) => nodes.heartbeat(beat),
            None => futures::future::ready(Ok(Heartbeated::Pushed(beat.last))).boxed(),
        }
    }

    fn remove_expired(&self) -> StoreFuture<u64> {
        match self.inner.db.nodes() {
            Some(nodes) => nodes.remove_expired(),
            None => futures::future::ready(Ok(0)).boxed(),
        }
    }

    fn deregister(&self, node: NodeId, last: Incarnation) -> StoreFuture<()> {
        match self.inner.db.nodes() {
            Some(nodes) => nodes.deregister(node, last),
            None => futures::future::ready(Ok(())).boxed(),
        }
    }

    fn live_nodes(&self) -> StoreFuture<Vec<NodeRecord>> {
        match self.inner.db.nodes() {
            Some(nodes) => nodes.live_nodes(),
            None => futures::future::ready(Ok(Vec::new())).boxed(),
        }
    }
}

/// Dead letters one `dead purge` statement deletes: a purge of them all goes in batches,
/// so that no statement holds the hot table's locks on every dead row at once.
const PURGE_BATCH: u32 = 1000;

impl<D: MappedDb> Operations for MappedStore<D> {
    fn destination_stats(&self) -> StoreFuture<Vec<DestinationStats>> {
        let store = self.clone();
        async move {
            let statement = store.inner.sql.stats(true);
            let rows = store
                .inner
                .db
                .query("stats", statement, store.params())
                .await?;
            Ok(rows
                .iter()
                .map(|r| {
                    let n = |i| D::int(r, i).unwrap_or(0).max(0) as u64;
                    DestinationStats {
                        destination: D::text(r, 0).unwrap_or_default(),
                        pending: n(1),
                        retrying: n(2),
                        dead: n(3),
                        oldest_pending_age: D::int(r, 4)
                            .map(|ms| Duration::from_millis(ms.max(0) as u64)),
                    }
                })
                .collect())
        }
        .boxed()
    }

    fn dead_list(&self, query: DeadQuery) -> StoreFuture<Vec<DeadRecord>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let mut p = store.params();
            let mut filter = String::new();
            if let Some(d) = query.destination {
                filter.push_str(&format!(" AND {}", sql.destination_is(&p.text(d))));
            }
            if let Some(t) = query.event_type {
                filter.push_str(&format!(" AND {}", sql.event_type_is(&p.text(t))));
            }
            if query.after > 0 {
                if sql.mapping.id_type != IdType::Integer {
                    return Err(store.unsupported(
                        "has UUID row ids: a page of dead letters cannot continue after an id; ask for a larger limit",
                    ));
                }
                filter.push_str(&format!(" AND {} > {}", sql.id_column(), p.int(query.after)));
            }
            let statement = sql.dead_list(&filter, &p.int(query.limit as i64));
            let rows = store.inner.db.query("dead list", statement, p).await?;
            Ok(rows
                .iter()
                .map(|r| {
                    let id = D::text(r, 0).unwrap_or_default();
                    DeadRecord {
                        sequence_id: id.parse().unwrap_or(0),
                        event_id: D::text(r, 1)
                            .and_then(|t| Uuid::parse_str(&t).ok())
                            .unwrap_or_else(|| derived_event_id(&sql.mapping, &id)),
                        destination: D::text(r, 2).unwrap_or_default(),
                        event_type: D::text(r, 3).unwrap_or_default(),
                        attempts: D::int(r, 4).unwrap_or(0).max(0) as u32,
                        last_error: D::text(r, 5).unwrap_or_else(|| {
                            "(this layout has no column for the error: see the relay's log)".into()
                        }),
                        dead_at: D::int(r, 6).map_or(UNIX_EPOCH, from_micros),
                    }
                })
                .collect())
        }
        .boxed()
    }

    fn event(&self, id: SequenceId) -> StoreFuture<Option<EventRecord>> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            // Sequence ids are the rows' own integer ids; UUID rows have none to look up.
            if sql.mapping.id_type != IdType::Integer {
                return Ok(None);
            }
            let mut p = store.params();
            let condition = format!(
                "{} {}",
                sql.id_column(),
                p.in_ids(&[RowId::Integer(id)], IdType::Integer)
            );
            let rows = store
                .inner
                .db
                .query("event", sql.event(&condition), p)
                .await?;
            let Some(row) = rows.first() else {
                return Ok(None);
            };
            let raw = D::raw_row(row, &sql.mapping)?;
            let n = sql.claim_order_column();
            let state = match D::int(row, n) {
                Some(2) => EventState::Dead,
                Some(1) => EventState::Delivered,
                _ => EventState::Pending,
            };
            let dead = state == EventState::Dead;
            let destination = raw.destination.clone().unwrap_or_default();
            Ok(Some(EventRecord {
                sequence_id: id,
                event_id: raw
                    .event_id
                    .as_deref()
                    .and_then(|t| Uuid::parse_str(t).ok())
                    .unwrap_or_else(|| derived_event_id(&sql.mapping, &id.to_string())),
                event_type: raw
                    .event_type
                    .clone()
                    .unwrap_or_else(|| destination.clone()),
                destination,
                ordering_key: raw.key.clone(),
                payload: raw
                    .payload
                    .as_deref()
                    .map(|b| String::from_utf8_lossy(b).into_owned()),
                headers: raw.headers.clone(),
                state,
                attempts: D::int(row, n + 1).or(raw.attempts).unwrap_or(0).max(0) as u32,
                last_error: D::text(row, n + 2),
                created_at: raw.created_micros.map(from_micros),
                dead_at: if dead {
                    D::int(row, n + 3).map(from_micros)
                } else {
                    None
                },
            }))
        }
        .boxed()
    }

    /// Dead rows are made pending where they are (or their records forgotten): none is
    /// ever left.
    fn dead_retry(&self, selector: DeadSelector) -> StoreFuture<DeadRetried> {
        let store = self.clone();
        let moved = async move {
            let (condition, p) = store.selector(&selector)?;
            let sql = &store.inner.sql;
            if let Some(statement) = sql.dead_retry(&condition) {
                return store.inner.db.execute("dead retry", statement, p).await;
            }
            // The side table: the rows are left as they were, so forgetting their records
            // makes them pending again.
            let ids = store
                .pick(&store.dead_where(&condition), p, u32::MAX)
                .await?;
            if ids.is_empty() {
                return Ok(0);
            }
            let mut p = store.params();
            let statement = sql.delete_dead_records(&p.in_ids(&ids, sql.mapping.id_type));
            store.inner.db.execute("dead retry", statement, p).await
        };
        async move {
            Ok(DeadRetried {
                moved: moved.await?,
                left: 0,
            })
        }
        .boxed()
    }

    fn dead_purge(&self, selector: DeadSelector) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let mut purged = 0;
            loop {
                let (condition, p) = store.selector(&selector)?;
                let ids = store
                    .pick(&store.dead_where(&condition), p, PURGE_BATCH)
                    .await?;
                if ids.is_empty() {
                    return Ok(purged);
                }
                // Checked again by the delete: a row `dead retry` made pending since the
                // pick stays (it was deleted, though the retry said it would go out again).
                let (condition, p) = store.selector(&selector)?;
                let still_dead = (store.dead_where(&condition), p);
                let n = store.delete_picked("dead purge", &ids, still_dead).await?;
                purged += n;
                // A delete that took none of the rows picked (a trigger or a policy keeps
                // them) would pick them again for good.
                if ids.len() < PURGE_BATCH as usize || n == 0 {
                    return Ok(purged);
                }
            }
        }
        .boxed()
    }

    fn count_replayable(&self, selector: ReplaySelector) -> StoreFuture<u64> {
        let store = self.clone();
        async move {
            let (condition, p) = store.replay_condition(selector)?;
            let statement = store.inner.sql.count(&condition);
            store.first_int("replay", statement, p).await
        }
        .boxed()
    }

    fn replay_batch(&self, page: ReplayPage) -> StoreFuture<(u64, SequenceId)> {
        let store = self.clone();
        async move {
            let sql = &store.inner.sql;
            let (condition, mut p) = store.replay_condition(page.selector.clone())?;
            let condition = format!(
                "{condition} AND {} > {}",
                sql.id_column(),
                p.int(page.after)
            );
            let ids = store.pick(&condition, p, page.size).await?;
            let last = ids
                .iter()
                .filter_map(RowId::integer)
                .max()
                .unwrap_or(page.after);
            if ids.is_empty() {
                return Ok((0, page.after));
            }
            // Checked again by the update: a row pruned or changed since the pick is left.
            let (condition, mut p) = store.replay_condition(page.selector)?;
            let membership = p.in_ids(&ids, IdType::Integer);
            let statement = sql.update(
                &sql.replay_set(),
                &format!("{} {membership} AND {condition}", sql.id_column()),
            );
            let n = store.inner.db.execute("replay", statement, p).await?;
            Ok((n, last))
        }
        .boxed()
    }

    fn count_prunable(
        &self,
        delivered_before: Option<SystemTime>,
        dead_before: Option<SystemTime>,
    ) -> StoreFuture<(u64, u64)> {
        let store = self.clone();
        async move {
            let mut counts = [0, 0];
            for (count, dead, before) in [(0, false, delivered_before), (1, true, dead_before)] {
                if let Some((condition, p)) = before.and_then(|b| store.prune_condition(dead, b)) {
                    let statement = store.inner.sql.count(&condition);
                    counts[count] = store.first_int("prune", statement, p).await?;
                }
            }
            Ok((counts[0], counts[1]))
        }
        .boxed()
    }

    fn prune_delivered(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        let store = self.clone();
        async move { store.prune(false, before, batch).await }.boxed()
    }

    fn prune_dead(&self, before: SystemTime, batch: u32) -> StoreFuture<u64> {
        let store = self.clone();
        async move { store.prune(true, before, batch).await }.boxed()
    }
}
