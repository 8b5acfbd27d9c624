//! The outbox store contract.
//!
//! # Row lifecycle
//! A row is **pending** from its commit until it is acked or dead-lettered. A pending row is
//! **claimable** when all of these hold:
//! - its `available_at` has passed (scheduled delivery and retry backoff);
//! - it carries no live lease (`locked_until` is empty or in the past);
//! - no earlier pending row of the same ordering key is *blocking* it: waiting to retry
//!   (`available_at` in the future after a failed attempt) or leased by another node.
//!   Rows leased by the claiming node itself do not block it: that node's engine already
//!   holds them in order (or, after a claim whose answer was lost, releases them first:
//!   [`OutboxStore::release_unheld`]).
//!
//! [`OutboxStore::claim`] leases up to `limit` claimable rows to one node in a single
//! statement, oldest `sequence_id` first, leaving out every row of the request's
//! [`Crowded`] keys, and never hands the same row to two nodes while a
//! lease lives. Every later operation names the node: a store applies it only to rows that
//! node still leases, so a node whose lease expired (and whose rows another node took) cannot
//! ack, retry or dead-letter them. Such a refusal is not an error: the returned count is
//! smaller, and the rows will be delivered again (at least once, never lost).
//!
//! Rolled-back inserts are never visible, so never claimed. A crash at any point leaves rows
//! leased until `locked_until`, after which they are claimable again: publish-then-crash
//! means redelivery, never loss.
//!
//! All methods return `'static` futures, so the engine can run many at once; each is one
//! statement (or one transaction) per call, whatever the number of rows.

use std::fmt::Display;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;

use crate::error::{StoreError, StoreErrorKind};
use crate::event::{Event, NewEvent, NodeId, SequenceId};
use crate::partition::Fence;

pub type StoreResult<T> = Result<T, StoreError>;

/// What every store method returns: a `'static` future (see the module docs), boxed so the
/// traits stay object safe.
pub type StoreFuture<T> = BoxFuture<'static, StoreResult<T>>;

/// A request to lease claimable rows to a node.
#[derive(Clone, Debug)]
pub struct ClaimRequest {
    pub node: NodeId,
    pub limit: usize,
    pub lease: Duration,
    /// Claim only rows of these partitions. Within them, leases of other nodes do not count:
    /// partition ownership (with its fencing epochs) has replaced them. `None`: every
    /// partition, with row leases deciding (a single node).
    pub fence: Option<Arc<Fence>>,
    /// Per-key order (the default). `false` claims any ready rows, whatever their key
    /// (`--ordering none`).
    pub ordered: bool,
    /// Rows to leave out, of keys the node already holds its share of (so that one slow
    /// key or receiver cannot fill it: [`Crowded`]).
    pub crowded: Crowded,
}

/// Ordering keys whose rows a claim leaves out, every row of them, whatever else holds:
/// the node already holds its share of them. Leaving a key out costs the claim a walk past
/// its rows, so such a claim goes no further than the last of the first `window` claimable
/// rows in publish order: a key's backlog of millions would otherwise be walked by every
/// claim, and a key whose backlog fills the whole window still holds the others back.
/// Stores that cannot bound the walk leave no key out: WAL and binlog capture, which read
/// one stream in commit order (their parked retries are claimed from a table, and do),
/// and mapped tables published in another order than their integer id's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Crowded {
    pub keys: Vec<String>,
    /// Pending rows a claim with `keys` looks through, from the oldest.
    pub window: usize,
}

impl Crowded {
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

impl ClaimRequest {
    /// An ordered claim over every partition.
    pub fn new(node: NodeId, limit: usize, lease: Duration) -> Self {
        ClaimRequest {
            node,
            limit,
            lease,
            fence: None,
            ordered: true,
            crowded: Crowded::default(),
        }
    }
}

/// Who settles leased rows: the node that holds their leases and, in an ordered cluster,
/// the fence of the partitions it holds (`None`: row leases alone decide).
#[derive(Clone, Debug)]
pub struct LeaseHolder {
    pub node: NodeId,
    pub fence: Option<Arc<Fence>>,
}

impl LeaseHolder {
    /// A holder whose row leases alone decide (a single node, or a store without partitions).
    pub fn unfenced(node: NodeId) -> Self {
        LeaseHolder { node, fence: None }
    }
}

/// A request to push the leases `node` holds on `ids` to `now + lease`.
#[derive(Clone, Debug)]
pub struct LeaseExtension {
    pub node: NodeId,
    pub ids: Vec<SequenceId>,
    pub lease: Duration,
}

/// One claimed row. Its event is shared, not copied, by the lane that queues it and the
/// publish that sends it.
#[derive(Clone, Debug)]
pub enum Claimed {
    Event(Arc<Event>),
    /// A row the store could not decode. It is leased like any other and must be
    /// dead-lettered with `reason`; it never stops the relay.
    Undecodable {
        sequence_id: SequenceId,
        ordering_key: String,
        destination: String,
        attempts: u32,
        reason: String,
    },
}

impl Claimed {
    pub fn sequence_id(&self) -> SequenceId {
        match self {
            Claimed::Event(e) => e.sequence_id,
            Claimed::Undecodable { sequence_id, .. } => *sequence_id,
        }
    }

    pub fn ordering_key(&self) -> &str {
        match self {
            Claimed::Event(e) => e.ordering_key(),
            Claimed::Undecodable { ordering_key, .. } => ordering_key,
        }
    }
}

/// An error's text as stores keep it (`last_error`): each NUL shown as `\0`. PostgreSQL's
/// text holds no NUL, and a sink's error can quote whatever bytes a broker or receiver
/// answered: a park or dead letter carrying one failed, was retried ahead of everything
/// else, and stopped every key.
pub fn storable_error(error: String) -> String {
    if error.contains('\0') {
        error.replace('\0', "\\0")
    } else {
        error
    }
}

/// A failed attempt to record: the row is released, its `attempts` and `last_error` set,
/// and it becomes claimable again after `delay`.
#[derive(Clone, Debug)]
pub struct RetryLater {
    pub sequence_id: SequenceId,
    /// Attempts so far, including the one that failed.
    pub attempts: u32,
    /// Holds no NUL ([`storable_error`]).
    pub error: String,
    pub delay: Duration,
}

/// A row to move to the dead letters, whole, with its attempts and last error.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    pub sequence_id: SequenceId,
    pub attempts: u32,
    /// Holds no NUL ([`storable_error`]).
    pub error: String,
}

/// Counts for metrics and `stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Backlog {
    /// Pending rows (not yet delivered nor dead).
    pub pending: u64,
    /// Pending rows that failed at least once.
    pub retrying: u64,
    /// Dead-lettered rows.
    pub dead: u64,
    /// Age of the oldest pending row.
    pub oldest_pending_age: Option<Duration>,
}

/// How much a [`Problem`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    /// The relay cannot work correctly: `run` refuses to start, `check` fails.
    Blocking,
    /// The relay works at a cost the problem names (polling only, rows sent to the dead
    /// letters, a slower claim): `run` warns and starts, `check` fails.
    Degraded,
    /// A risk the relay cannot remove itself and many servers run with (a privilege only a
    /// superuser may change): `run` warns and starts, `check` prints it as a warning and
    /// passes.
    Advisory,
}

/// One finding of [`OutboxStore::verify`]: what is wrong, how to fix it, and whether the
/// relay can run with it. Made only by [`Problem::blocking`], [`Problem::degraded`] and
/// [`Problem::advisory`], so
/// callers decide by [`Problem::severity`], never by the text.
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub what: String,
    pub fix: String,
    severity: Severity,
}

/// `what (fix: fix)`, as a log line or an error message says a problem.
impl Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (fix: {})", self.what, self.fix)
    }
}

impl Problem {
    /// A problem the relay cannot run with.
    pub fn blocking(what: impl Into<String>, fix: impl Into<String>) -> Self {
        Problem {
            what: what.into(),
            fix: fix.into(),
            severity: Severity::Blocking,
        }
    }

    /// A problem the relay can run with, at some cost `what` names. `what` says so to the
    /// reader too.
    pub fn degraded(what: impl Into<String>, fix: impl Into<String>) -> Self {
        Problem {
            what: format!("{} (the relay runs with this)", what.into()),
            fix: fix.into(),
            severity: Severity::Degraded,
        }
    }

    /// A risk to know of, which the relay cannot remove ([`Severity::Advisory`]).
    pub fn advisory(what: impl Into<String>, fix: impl Into<String>) -> Self {
        Problem {
            what: what.into(),
            fix: fix.into(),
            severity: Severity::Advisory,
        }
    }

    /// Column `column` of `table`, which every claim reads, is missing: claims fail.
    pub fn missing_column(column: &str, table: impl Display, fix: impl Into<String>) -> Self {
        Problem::blocking(
            format!("column {column} of {table} is missing: the relay reads it in every claim"),
            fix,
        )
    }

    /// Column `column` of `table` allows NULL where the relay needs a value: only the rows
    /// with NULL there fail, to the dead letters.
    pub fn nullable_column(column: &str, table: impl Display, fix: impl Into<String>) -> Self {
        Problem::degraded(
            format!("column {column} of {table} allows NULL: rows with NULL there cannot be published and go to the dead letters"),
            fix,
        )
    }

    pub fn severity(&self) -> Severity {
        self.severity
    }

    /// Whether `run` may start despite this problem.
    pub fn is_degraded(&self) -> bool {
        self.severity != Severity::Blocking
    }

    /// Whether `check` fails on it.
    pub fn fails_check(&self) -> bool {
        self.severity != Severity::Advisory
    }
}

/// Called when new rows may have been committed.
pub type OnChange = Arc<dyn Fn() + Send + Sync>;

/// What [`OutboxStore::lock_holders`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LockHolders {
    /// One line per session holding a lock the relay waits for; a line may instead say why
    /// the holders cannot be named (a privilege or a plugin the server lacks).
    pub sessions: Vec<String>,
    /// How an operator ends one of them, in the database's own words
    /// (`SELECT pg_terminate_backend(<pid>)`, `KILL <id>`).
    pub end_one: &'static str,
}

/// Where outbox rows live. See the module docs for the contract.
pub trait OutboxStore: Send + Sync + 'static {
    /// A short description for logs, e.g. `postgres public.outbox` (never with secrets).
    fn describe(&self) -> String;

    /// Leases up to `limit` claimable rows to `node`, ordered by `sequence_id`.
    fn claim(&self, request: ClaimRequest) -> StoreFuture<Vec<Claimed>>;

    /// Whether claims leave out the rows of [`ClaimRequest::crowded`] keys, looking no
    /// further than its window. A capture's stream cannot skip ahead (its claims hand out
    /// what comes, in order), nor can a mapped table in an order of its own: the engine
    /// then asks nothing of the kind, and does not pace its claims for the window's sake.
    /// Default: `true`.
    fn leaves_out_crowded_keys(&self) -> bool {
        true
    }

    /// Marks rows delivered: deletes them, or (when the store retains delivered rows) sets
    /// `delivered_at`. Only rows still leased by `holder.node` and, with a fence, of
    /// partitions it still holds at those epochs; returns how many were acked.
    fn ack(&self, holder: LeaseHolder, ids: Vec<SequenceId>) -> StoreFuture<u64>;

    /// Records failed attempts and releases the rows until their delay has passed (fenced
    /// like [`OutboxStore::ack`]).
    fn retry_later(&self, holder: LeaseHolder, retries: Vec<RetryLater>) -> StoreFuture<u64>;

    /// Moves rows to the dead letters in one transaction (fenced like [`OutboxStore::ack`]).
    fn dead_letter(&self, holder: LeaseHolder, entries: Vec<DeadLetter>) -> StoreFuture<u64>;

    /// Returns leased rows to claimable at once, without counting an attempt
    /// (graceful shutdown, or later rows of a key whose earlier row must retry).
    fn release(&self, node: NodeId, ids: Vec<SequenceId>) -> StoreFuture<u64>;

    /// Returns every row leased to `node` that is not in `held` to claimable at once,
    /// without counting an attempt; returns how many.
    ///
    /// The engine calls it before claiming again after a claim that failed: such a claim
    /// may have committed its leases and lost only its answer. Those rows are leased to the
    /// node, which does not hold them, and a node's own leases do not block its claims (see
    /// the module docs): left leased, a later row of their key would be claimed and published
    /// before them. Also called once at start, for the leases of an earlier process that ran
    /// under the same node id. `held` is everything the engine holds, settles in flight
    /// included, so no row it still works on changes hands.
    ///
    /// A claim that commits after the node gave up on it (an answer delayed past the
    /// statement timeout) is not covered: its rows wait for their lease to run out.
    fn release_unheld(&self, node: NodeId, held: Vec<SequenceId>) -> StoreFuture<u64>;

    /// Pushes the lease of `extension.ids`, still held by its node, to `now + lease`.
    fn extend_leases(&self, extension: LeaseExtension) -> StoreFuture<u64>;

    /// Backlog counts for metrics.
    fn backlog(&self) -> StoreFuture<Backlog>;

    /// Inserts events the way an application does (used by `outbox-relay send` and tests).
    fn insert(&self, events: Vec<NewEvent>) -> StoreFuture<Vec<SequenceId>>;

    /// Checks connectivity with the cheapest possible statement.
    fn ping(&self) -> StoreFuture<()>;

    /// Verifies tables, trigger and privileges; every problem comes with its fix.
    fn verify(&self) -> StoreFuture<Vec<Problem>>;

    /// A task that calls `on_change` whenever rows may have been committed (PostgreSQL
    /// NOTIFY, SQLite's data version), and once after each reconnect, for as long as it is
    /// polled. `None` when the store cannot tell, and the engine relies on polling.
    fn subscribe(&self, on_change: OnChange) -> Option<BoxFuture<'static, ()>>;

    /// The sessions holding locks that this relay's statements wait for, one line each
    /// (its session id, user, state, and how long its transaction has run), for `/readyz`
    /// to name while a claim or settle is stuck: a DBA's `LOCK TABLE` or a session left
    /// idle in a transaction looked exactly like a dead network. `None` (the default) where
    /// the store cannot tell.
    fn lock_holders(&self) -> Option<StoreFuture<LockHolders>> {
        None
    }

    /// A task that lets the database's own shutdown go ahead, for as long as it is polled
    /// (the engine runs it while it runs). PostgreSQL's smart shutdown refuses new
    /// connections, then waits for every client session to end: the PostgreSQL store closes
    /// its sessions while the server refuses new ones, and reconnects once it takes them
    /// again. `None` (the default) where the database waits for no client.
    fn give_way_to_shutdown(&self) -> Option<BoxFuture<'static, ()>> {
        None
    }

    /// The engine is waiting for new rows (`true`: nothing held, its last claim came back
    /// empty) or busy (`false`). A store whose wake-up is gated on it (PostgreSQL with
    /// `wakeup = "gated"`) has writers notify only while the relay waits, and otherwise wakes
    /// the engine itself at short intervals. Default: ignored.
    fn set_waiting(&self, _waiting: bool) {}
}

/// A live node as recorded in the nodes table.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeRecord {
    pub id: String,
    pub expiry: SystemTime,
}

/// The expiry a process last wrote to its row in the nodes table, exactly as the store keeps
/// it (opaque: microseconds or milliseconds since the Unix epoch, by store). The table has
/// no column for an incarnation, so the expiry serves as one: two processes heartbeating
/// under the same id overwrite each other's value, and the next conditioned heartbeat of
/// either one finds a value it did not write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Incarnation(pub i64);

/// A conditioned heartbeat: push `node`'s expiry to `now + ttl` if its row still shows
/// `last`, the expiry this process wrote.
#[derive(Clone, Debug)]
pub struct Heartbeat {
    pub node: NodeId,
    pub last: Incarnation,
    pub ttl: Duration,
}

/// What [`NodeRegistry::heartbeat`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Heartbeated {
    /// The row showed `last` (or was gone): it now shows this expiry.
    Pushed(Incarnation),
    /// The row shows another expiry and was left as it is: the expiry it shows, where the
    /// store could read it. Another process heartbeats under this id, or the database went
    /// back to an earlier state of its own (restored, or failed over to a lagging replica):
    /// the caller tells the two apart by the expiries it wrote.
    RowShows(Option<Incarnation>),
}

impl Heartbeated {
    /// The expiry written, if the heartbeat landed.
    pub fn pushed(self) -> Option<Incarnation> {
        match self {
            Heartbeated::Pushed(i) => Some(i),
            Heartbeated::RowShows(_) => None,
        }
    }
}

/// What [`NodeRegistry::register`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registration {
    /// The row is this process's, written with this expiry.
    Registered(Incarnation),
    /// A row with this id has not expired: another live process, or one that died without
    /// deregistering. Its current expiry, to tell the two apart: a live process moves it.
    Taken(Incarnation),
}

/// A node's row as a store that reads it before writing sees it (in the same transaction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRow {
    pub expiry: Incarnation,
    /// The expiry has not passed.
    pub live: bool,
}

impl NodeRow {
    /// Whether [`NodeRegistry::register`] may write the row: it is absent or expired.
    pub fn may_register(row: Option<NodeRow>) -> bool {
        !row.is_some_and(|r| r.live)
    }

    /// Whether [`NodeRegistry::heartbeat`] may write the row: it still shows `last`, or it
    /// is gone (expired and removed by another node).
    pub fn may_heartbeat(row: Option<NodeRow>, last: Incarnation) -> bool {
        row.is_none_or(|r| r.expiry == last)
    }
}

/// Membership in the nodes table (`id`, `expiry`), as the Ably connector keeps it.
///
/// A node id belongs to one process at a time. [`NodeRegistry::register`] takes the row only
/// when it is absent or expired, and [`NodeRegistry::heartbeat`] and
/// [`NodeRegistry::deregister`] apply only while the row still shows the expiry this process
/// last wrote, so a second process started with the same id is refused at start (or, if it
/// took the row while this one was stalled, this one learns it at its next heartbeat).
pub trait NodeRegistry: Send + Sync + 'static {
    /// Inserts this node's row with `expiry = now + ttl` if it is absent, or takes it over if
    /// its expiry has passed; otherwise leaves it and reports its expiry.
    fn register(&self, node: NodeId, ttl: Duration) -> StoreFuture<Registration>;

    /// Pushes the node's expiry to `now + ttl` if its row still shows `last`, or inserts it
    /// again if it is gone (expired and removed by another node). Returns the new expiry, or
    /// the one the row shows when it is not `last`; the row is then left as it is.
    fn heartbeat(&self, beat: Heartbeat) -> StoreFuture<Heartbeated>;

    /// Deletes rows whose expiry has passed; returns how many.
    fn remove_expired(&self) -> StoreFuture<u64>;

    /// Deletes this node's row (graceful shutdown) if it still shows `last`.
    fn deregister(&self, node: NodeId, last: Incarnation) -> StoreFuture<()>;

    /// The nodes whose expiry has not passed.
    fn live_nodes(&self) -> StoreFuture<Vec<NodeRecord>>;
}

/// A partition's lease as stored.
#[derive(Clone, Debug, PartialEq)]
pub struct PartitionRecord {
    pub partition: i32,
    pub owner: Option<String>,
    pub epoch: i64,
    pub lease_until: Option<SystemTime>,
}

/// How long a store operation waits for an answer before it fails, retryably, as a lost
/// connection. A database behind a dead network can leave a connection open that never
/// answers; nothing the relay runs takes this long on a live database.
pub const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

/// The error of a store operation that had no answer within `within`: retryable, as a lost
/// connection (the stores' bounds on their operations all say it so).
pub fn no_answer(context: &str, within: Duration) -> StoreError {
    StoreError::new(
        StoreErrorKind::Connection,
        format!(
            "{context}: no answer from the database within {within:?}; the connection is \
             presumed lost"
        ),
    )
    .with_hint(NO_ANSWER_HINT)
}

/// The fix for an operation the relay gave up waiting for: the client cannot tell a dead
/// network from a statement that runs that long, and the connection's hint named only the
/// first (a slow claim was sent to check the host and port).
const NO_ANSWER_HINT: &str = "check that the database is running and reachable; if it is, \
    the statement ran that long: see the database's running statements (pg_stat_activity, \
    SHOW PROCESSLIST) for it and for what it waits on (the relay retries meanwhile)";

/// How a node takes an outbox's events. Every node of one outbox takes them the same way
/// (see [`PartitionRegistry::claim_mode_peers`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ClaimMode {
    /// `--ordering none`: any ready row, under row leases.
    Unordered,
    /// `--capture wal`: every row read from the WAL.
    Capture,
    /// Per-key order through partition leases: claims that lease no row.
    Ordered,
    /// A way this relay does not know, written by a newer one: ranked above every other, so
    /// that an older node yields to it rather than relay beside it. (Read as ordered, it was
    /// taken for this node's own way by an ordered node, which went on beside it.)
    Newer,
}

impl ClaimMode {
    /// The name the nodes table keeps.
    pub fn as_str(self) -> &'static str {
        match self {
            ClaimMode::Unordered => "unordered",
            ClaimMode::Capture => "capture",
            ClaimMode::Ordered => "ordered",
            ClaimMode::Newer => "newer",
        }
    }

    /// A mode as the nodes table keeps it; `None` (no mode written: a node from before
    /// modes, which says only whose partitions it takes) is ordered, and a name this relay
    /// does not know is [`ClaimMode::Newer`].
    pub fn from_stored(stored: Option<&str>) -> Self {
        match stored {
            Some("unordered") => ClaimMode::Unordered,
            Some("capture") => ClaimMode::Capture,
            Some("ordered") | None => ClaimMode::Ordered,
            Some(_) => ClaimMode::Newer,
        }
    }

    /// As the relay's messages name it, with the setting that chooses it.
    pub fn described(self) -> &'static str {
        match self {
            ClaimMode::Unordered => "unordered (--ordering none)",
            ClaimMode::Capture => "WAL capture (--capture wal)",
            ClaimMode::Ordered => "ordered (polling, --ordering key)",
            ClaimMode::Newer => {
                "a way this relay does not know (a newer relay's: upgrade this one)"
            }
        }
    }
}

/// How one node takes an outbox's events: its [`ClaimMode`], and for an ordered node the
/// partition count it splits keys by (read from the partitions table at its start).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Way {
    pub mode: ClaimMode,
    /// `None` for an unordered or capture node, and for a node from before counts were
    /// written (schema version 8).
    pub partitions: Option<u32>,
}

/// Partition leases with fencing epochs, in the same database as the outbox.
///
/// A lease is taken only when the partition is free, its lease expired, or the taker holds
/// it already (an acquire whose answer was lost: the node does not know it, and would idle
/// the partition until the lease ran out), and taking it increments the epoch; renewing and
/// releasing apply only to the holder at its epoch.
pub trait PartitionRegistry: Send + Sync + 'static {
    /// Writes `protocol`, and that it takes this outbox's partitions, into `node`'s row of
    /// the nodes table, and returns the other live nodes whose protocol is below `oldest` (a
    /// row without one is protocol 1), with theirs.
    fn nodes_behind(
        &self,
        node: NodeId,
        protocol: u32,
        oldest: u32,
    ) -> StoreFuture<Vec<(String, u32)>>;

    /// The live nodes that share this outbox's partitions: those that announced this
    /// outbox's partitions in [`PartitionRegistry::nodes_behind`], and those whose row does
    /// not say (relays from before it). Nodes that take no partitions (unordered, WAL
    /// capture) and nodes of another outbox sharing the nodes table are left out: counted,
    /// their share would stay unowned.
    fn partition_peers(&self) -> StoreFuture<Vec<String>>;

    /// The outbox's partition count (fixed when it was migrated).
    fn partition_count(&self) -> StoreFuture<u32>;

    /// The other live nodes that take this outbox's events another way than `way`, with
    /// theirs: another mode, or, both ordered, another known partition count. The ways must
    /// not meet: an ordered claim leases no row, so an unordered node claims the rows an
    /// ordered one holds; a capture node reads every row from the WAL while a polling node
    /// claims them; either way most events go out twice. Ordered nodes that split keys by
    /// two counts share keys, and send their events twice and out of order. With
    /// `announce`, first writes `way` into `node`'s row; the list is read as it was before
    /// that write. An ordered node from before the modes were written (it says only whose
    /// partitions it takes) is listed as ordered, its count unknown.
    fn claim_mode_peers(
        &self,
        node: NodeId,
        way: Way,
        announce: bool,
    ) -> StoreFuture<Vec<(String, Way)>>;

    /// Takes the free or expired ones of `partitions`, and those `node` holds already;
    /// returns those taken with their new epochs.
    fn acquire(
        &self,
        node: NodeId,
        partitions: Vec<i32>,
        ttl: Duration,
    ) -> StoreFuture<Vec<(i32, i64)>>;

    /// Extends the leases `node` still holds at these epochs; returns the partitions renewed.
    fn renew(&self, node: NodeId, held: Vec<(i32, i64)>, ttl: Duration) -> StoreFuture<Vec<i32>>;

    /// Gives partitions up (after their work is settled).
    fn release_partitions(&self, node: NodeId, partitions: Vec<i32>) -> StoreFuture<u64>;

    /// Every partition's lease.
    fn partitions(&self) -> StoreFuture<Vec<PartitionRecord>>;
}

/// Backlog of one destination, for `stats`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DestinationStats {
    pub destination: String,
    pub pending: u64,
    pub retrying: u64,
    pub dead: u64,
    pub oldest_pending_age: Option<Duration>,
}

/// A dead-lettered event, for `dead list`.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadRecord {
    pub sequence_id: SequenceId,
    pub event_id: crate::event::EventId,
    pub destination: String,
    pub event_type: String,
    pub attempts: u32,
    pub last_error: String,
    pub dead_at: SystemTime,
}

/// Which dead letters [`Operations::dead_list`] returns: those matching every filter given,
/// in `sequence_id` order, starting after `after`, at most `limit` of them. A page ends at
/// its last row's `sequence_id`; passing it as the next query's `after` gives the next page
/// (the admin API's `after=`), and an empty page means there are no more.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadQuery {
    pub destination: Option<String>,
    pub event_type: Option<String>,
    /// Only rows with a larger `sequence_id` ([`SequenceId::MIN`], the default: from the
    /// start). Ids can be negative: WAL capture's table-less events draw theirs from near
    /// the smallest, and an application may insert any. With 0 as the start, their dead
    /// letters were never listed, while the drain that made them said to list them.
    pub after: SequenceId,
    pub limit: u32,
}

impl Default for DeadQuery {
    fn default() -> Self {
        DeadQuery {
            destination: None,
            event_type: None,
            after: SequenceId::MIN,
            limit: 0,
        }
    }
}

/// Where an event is in its lifecycle (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventState {
    /// Not yet delivered nor dead (waiting, leased, or waiting to retry: see `attempts`).
    Pending,
    /// Delivered and retained (`--retain-delivered`).
    Delivered,
    /// In the dead letters.
    Dead,
}

impl EventState {
    pub fn name(self) -> &'static str {
        match self {
            EventState::Pending => "pending",
            EventState::Delivered => "delivered",
            EventState::Dead => "dead",
        }
    }
}

/// One event with its payload, for the admin API's `GET /api/v1/events/{id}`.
#[derive(Clone, Debug, PartialEq)]
pub struct EventRecord {
    pub sequence_id: SequenceId,
    pub event_id: crate::event::EventId,
    pub destination: String,
    pub event_type: String,
    pub ordering_key: Option<String>,
    /// The payload as the row holds it (JSON text, kept verbatim; bytes shown lossily).
    pub payload: Option<String>,
    /// The headers as the row holds them (a JSON object's text), if the layout has them.
    pub headers: Option<String>,
    pub state: EventState,
    /// Failed attempts so far (of the dead letter: those that led to it).
    pub attempts: u32,
    /// The last failure, if any and if the layout keeps it.
    pub last_error: Option<String>,
    pub created_at: Option<SystemTime>,
    /// When it was dead-lettered (dead events, where the layout records it).
    pub dead_at: Option<SystemTime>,
}

/// Which retained delivered events `replay` publishes again: those created in
/// `[since, until)`, of `destination` when one is given.
#[derive(Clone, Debug)]
pub struct ReplaySelector {
    pub since: SystemTime,
    pub until: SystemTime,
    pub destination: Option<String>,
}

/// One page of a replay: up to `size` events chosen by `selector`, after `after`.
#[derive(Clone, Debug)]
pub struct ReplayPage {
    pub selector: ReplaySelector,
    pub after: SequenceId,
    pub size: u32,
}

/// Which dead letters an operator command touches.
#[derive(Clone, Debug, PartialEq)]
pub enum DeadSelector {
    Ids(Vec<SequenceId>),
    Destination(String),
    All,
}

/// What [`Operations::dead_retry`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeadRetried {
    /// Dead letters moved back into the outbox.
    pub moved: u64,
    /// Dead letters the selector chose that were left dead: the outbox holds their event id
    /// (or sequence id) already.
    pub left: u64,
}

/// Operator commands. Bulk changes go in bounded batches (the callers loop), so no statement
/// holds locks on many rows for long.
pub trait Operations: Send + Sync + 'static {
    fn destination_stats(&self) -> StoreFuture<Vec<DestinationStats>>;

    /// The dead letters `query` selects, oldest `sequence_id` first (see [`DeadQuery`]).
    fn dead_list(&self, query: DeadQuery) -> StoreFuture<Vec<DeadRecord>>;

    /// The event with this `sequence_id`, wherever it is: pending, delivered and retained,
    /// or dead. `None` when there is no such row (acked and deleted, purged, never
    /// existed). A store whose rows have no integer ids answers `None`, never another row.
    fn event(&self, id: SequenceId) -> StoreFuture<Option<EventRecord>>;

    /// Moves dead letters back into the outbox, under their old sequence ids, with attempts
    /// reset: the relay publishes them again. A dead letter whose event id (or sequence id)
    /// a row of the outbox has already (the application wrote the event again) is left dead
    /// and counted in [`DeadRetried::left`]; it keeps none of the others back.
    fn dead_retry(&self, selector: DeadSelector) -> StoreFuture<DeadRetried>;

    fn dead_purge(&self, selector: DeadSelector) -> StoreFuture<u64>;

    /// The retained delivered events `selector` chooses: how many there are.
    fn count_replayable(&self, selector: ReplaySelector) -> StoreFuture<u64>;

    /// Marks up to `page.size` of them pending again, in sequence order after `page.after`;
    /// returns how many and the last sequence id it chose (the next page's `after`, and
    /// `page.after` itself once none is left). A page can choose rows and change none (they
    /// went meanwhile): the rows after it are still to do.
    fn replay_batch(&self, page: ReplayPage) -> StoreFuture<(u64, SequenceId)>;

    /// Delivered (retained) rows older than `delivered_before`, and dead letters older than
    /// `dead_before`: how many there are.
    fn count_prunable(
        &self,
        delivered_before: Option<SystemTime>,
        dead_before: Option<SystemTime>,
    ) -> StoreFuture<(u64, u64)>;

    /// Deletes up to `batch` delivered rows older than `before`; returns how many.
    fn prune_delivered(&self, before: SystemTime, batch: u32) -> StoreFuture<u64>;

    /// Deletes up to `batch` dead letters older than `before`; returns how many.
    fn prune_dead(&self, before: SystemTime, batch: u32) -> StoreFuture<u64>;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A statement that runs past the bound looks like a dead network to the client: the
    /// hint names both, where the connection's named only the host and port.
    #[test]
    fn an_operation_given_up_on_names_a_long_statement_too() {
        let e = no_answer("claim", Duration::from_secs(30));
        assert!(e.is_retryable());
        assert!(e.hint().contains("SHOW PROCESSLIST"), "{}", e.hint());
        assert!(e.to_string().contains("within 30s"), "{e}");
    }

    /// A way a newer relay writes is ranked above every known one, so an older node yields
    /// to it: read as ordered, an ordered node took it for its own way and went on beside
    /// it. No way written is a node from before the ways: ordered.
    #[test]
    fn a_way_this_relay_does_not_know_ranks_above_its_own() {
        assert_eq!(ClaimMode::from_stored(Some("sharded")), ClaimMode::Newer);
        assert_eq!(ClaimMode::from_stored(None), ClaimMode::Ordered);
        for known in [ClaimMode::Unordered, ClaimMode::Capture, ClaimMode::Ordered] {
            assert_eq!(ClaimMode::from_stored(Some(known.as_str())), known);
            assert!(ClaimMode::Newer > known);
        }
    }
}
