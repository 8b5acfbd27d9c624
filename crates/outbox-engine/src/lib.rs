//! The relay engine: claim → publish → confirm → ack.
//!
//! [`run`] drives one node. It claims batches of rows from an [`OutboxStore`], puts them
//! into per-key [`lanes`], hands lane heads to the [`Publisher`] (many keys at once, one
//! event per key), and settles each outcome with one statement per batch: ack what the sink
//! confirmed, record a retry (releasing the rest of that key's lane), or dead-letter.
//!
//! Wake-ups: a claim runs at start, on each store notification (NOTIFY, SQLite data
//! version), on the poll ticker (the safety poll, or the only trigger in fixed-rate mode),
//! when a retry comes due, and at once while the last claim came back full (a backlog), so
//! a backlog drains without sleeping. Notifications arriving while a claim runs coalesce
//! into one follow-up claim.

pub mod lanes;
pub mod metrics;
mod scheduler;
pub mod settings;
mod streaks;

pub use settings::{
    EngineSettings, DEFAULT_BATCH_SIZE, DEFAULT_LEASE, DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_POLL_INTERVAL, DEFAULT_PUBLISH_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT,
};

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use outbox_core::health::{Check, PUBLISH_GRACE};
use outbox_core::store::{
    storable_error, Backlog, ClaimRequest, Crowded, DeadLetter, LeaseExtension, LeaseHolder,
    RetryLater, StoreFuture, StoreResult,
};
use outbox_core::trace::{SettleKind, Span};
use outbox_core::{
    Backoff, Event, Fence, Health, NodeId, OutboxStore, Ownership, PublishError, PublishErrorKind,
    Publisher, RetryDecision, SequenceId, StoreError, StoreErrorKind, Telemetry,
};
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::Instrument;

use crate::lanes::{Handout, LaneKey, Lanes, UndecodableHead};
use crate::scheduler::{Claim, ClaimScheduler};
use crate::streaks::Attempt;
use outbox_core::metric_labels::DestinationLabels;

/// How much of the shutdown timeout is kept for the clean-up after the wait for in-flight
/// publishes (a quarter of it, at most this), so an unreachable broker or database cannot
/// stretch the shutdown past the timeout.
pub const SHUTDOWN_CLEANUP_RESERVE: Duration = Duration::from_secs(5);
/// How long a drain waits, by default, for pending rows it cannot claim yet (leased by a node
/// that died, or in partitions another node still holds) before it reports them as left.
pub const DEFAULT_DRAIN_PATIENCE: Duration = Duration::from_secs(40);

/// How the engine learns that rows arrived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeMode {
    /// Store notifications plus a safety poll every `poll_interval`.
    Notify,
    /// Poll every `poll_interval` only (the seeds' ADBC_POLL_FIXED_RATE).
    FixedRate,
}

/// One run of the engine: the operator's [`EngineSettings`], what the binary decides for this
/// run, and the live objects the engine shares with the rest of the process.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// What the operator set.
    pub settings: EngineSettings,
    pub node: NodeId,
    pub wake: WakeMode,
    /// Deliver what is deliverable now, then return.
    pub drain: bool,
    /// With `drain`: how long to wait for pending rows that no claim returns yet (another
    /// node's leases or partitions run out) before reporting them as left.
    pub drain_patience: Duration,
    /// Per-key order (the default); `false` publishes any ready rows (`--ordering none`).
    pub ordered: bool,
    /// What the engine reports to and reads from while it runs.
    pub shared: Shared,
}

/// The live objects an engine shares with the rest of the process.
#[derive(Clone, Debug, Default)]
pub struct Shared {
    /// Where claims and settles report success, failure and waits that last too long.
    pub health: Arc<Health>,
    /// The partitions this node holds, kept by the cluster coordinator. `None`: a single
    /// node that claims every partition.
    pub ownership: Option<Arc<Ownership>>,
    /// Where claims, publishes and settles are reported as spans. `None` (the default): no
    /// timestamp is taken and nothing is collected.
    pub telemetry: Option<Arc<dyn Telemetry>>,
    /// The outbox's destination label guard, shared with whatever else counts its events
    /// (WAL capture's adoption).
    pub labels: Arc<DestinationLabels>,
}

impl EngineConfig {
    pub fn new(node: NodeId) -> Self {
        EngineConfig {
            settings: EngineSettings::default(),
            node,
            wake: WakeMode::Notify,
            drain: false,
            drain_patience: DEFAULT_DRAIN_PATIENCE,
            ordered: true,
            shared: Shared::default(),
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    pub published: u64,
    pub retried: u64,
    pub dead_lettered: u64,
    /// Dead letters the store wrote fewer of than asked: refused by another node's fence,
    /// or written by an attempt whose answer was lost (the retry then found nothing to
    /// write). A drain cannot vouch that these were not dead-lettered.
    pub dead_letters_unconfirmed: u64,
    /// The last publish failure (retried or dead-lettered), for the drain's report.
    pub last_failure: Option<String>,
    /// Publishes and settle statements still unfinished when the shutdown timeout ran out.
    pub abandoned: usize,
    /// With `drain`: how it ended (`None` without `drain`).
    pub drain: Option<DrainEnd>,
}

/// How a drain ended: what the outbox still held.
#[derive(Clone, Debug, PartialEq)]
pub enum DrainEnd {
    /// Nothing is pending but rows inserted after the drain began (`arrived`), which are left
    /// for the next run.
    Clean { arrived: u64 },
    /// Rows are left undelivered: waiting to retry (and the rows of their keys behind them),
    /// or pending rows no claim returned within the drain's patience (leased by a node that
    /// is still alive, in partitions another node holds, or scheduled for later).
    Left(Backlog),
    /// The backlog could not be read, so the drain cannot vouch for anything.
    Unknown(String),
    /// Nothing is left that the engine could claim, but the store's source cannot vouch for
    /// the table (a capture's stream that will never bring rows still in it, or cannot tell
    /// whether it would): why, and the fix. Set by the caller, which asks the capture.
    Unvouched(String),
}

/// A finished settle statement.
enum Settled {
    Acked(Vec<Acked>, StoreResult<u64>),
    Retried(SettledRows<RetryLater>),
    DeadLettered(SettledRows<DeadLetter>),
    Released(Vec<SequenceId>, StoreResult<u64>),
    Extended(StoreResult<u64>),
}

/// The rows a retry or dead-letter statement settled (each beside its lane), and how it
/// went.
struct SettledRows<T> {
    lanes: Vec<SettledLane>,
    rows: Vec<T>,
    result: StoreResult<u64>,
}

impl<T> SettledRows<T> {
    /// The second half of the rows and their lanes, split off ([`refused_a_row`]).
    fn split_off_half(&mut self) -> (Vec<SettledLane>, Vec<T>) {
        let mid = self.rows.len() / 2;
        (self.lanes.split_off(mid), self.rows.split_off(mid))
    }
}

/// What a settle statement covers, for [`persist`].
#[derive(Clone, Copy, Debug)]
enum Covers {
    /// One row, named in the log lines of its retries.
    Row(SequenceId),
    /// Several: a refusal of one of them ([`StoreErrorKind::RowRefused`]) ends the attempt,
    /// and the engine settles the halves apart ([`refused_a_row`]).
    Rows,
    /// Rows never split (a release, retried whole).
    Whole,
}

impl Covers {
    fn of(ids: &[SequenceId]) -> Covers {
        match ids {
            [id] => Covers::Row(*id),
            _ => Covers::Rows,
        }
    }
}

/// A settle of several rows that the database refused for one row's sake (a foreign key
/// from an application's table to an outbox row, a trigger): tried again whole, it held
/// every other row of its batch, of every key, for as long as the row stayed refused. Its
/// halves are settled apart instead, down to the one row, which alone waits, retried.
fn refused_a_row(rows: usize, result: &StoreResult<u64>) -> bool {
    rows > 1 && matches!(result, Err(e) if e.kind() == StoreErrorKind::RowRefused)
}

/// The lane of a settled row, and its destination (its metrics' label).
struct SettledLane {
    key: LaneKey,
    destination: String,
}

struct Acked {
    sequence_id: SequenceId,
    destination: String,
}

/// A batch the sink answered, with one outcome per event (when it keeps its contract).
struct Published {
    batch: Vec<Arc<Event>>,
    /// Its send group ([`Engine::split_by_send_group`]), for `/readyz`'s streaks.
    group: u64,
    outcomes: Vec<outbox_core::Outcome>,
}

/// Ownership as the engine last acted on it and last reported it.
struct OwnershipSeen {
    /// The generation acted on, and when a lease next runs out by our clock.
    generation: u64,
    next_expiry: Option<std::time::Instant>,
    /// The busy partitions last reported, with the generation they were reported at.
    reported_busy: std::collections::BTreeSet<i32>,
    reported_generation: u64,
    /// No partition was publishable when last acted on (a standby, a node the table's
    /// lock or every lease was lost by): its publishes' failures are not reported.
    holds_none: bool,
}

impl Default for OwnershipSeen {
    fn default() -> Self {
        OwnershipSeen {
            generation: u64::MAX,
            next_expiry: None,
            reported_busy: std::collections::BTreeSet::new(),
            reported_generation: u64::MAX,
            holds_none: false,
        }
    }
}

/// Retries a store write until it succeeds or fails for good. Settling must not be dropped:
/// a row whose ack is lost would be published again, one whose retry is lost could reorder.
/// A privilege the database refuses is retried too: the relay exited on it, and a
/// supervisor's restarts published the pending events again at every start (the grants
/// `run` checks at start do not cover a trigger or a policy a DBA adds on the outbox);
/// retried, nothing goes out twice, `/readyz` says why, and a grant given back mends it.
/// A drain (`outlast_refusals` false) ends on it instead, as a cron job must, and on a row
/// the database refuses (a foreign key to it) once it is the statement's only row.
///
/// While it retries, `/readyz` says so ([`Health::failing`]), whatever other settles
/// succeed meanwhile: one row refused for good, beside a stream of others acked, turned
/// `/readyz` red and green by turns.
async fn persist<F>(
    health: Arc<Health>,
    what: &'static str,
    covers: Covers,
    outlast_refusals: bool,
    mut op: F,
) -> StoreResult<u64>
where
    F: FnMut() -> StoreFuture<u64>,
{
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
    let mut failing = None;
    loop {
        let attempt = health.begin(Check::Settle);
        let result = op().await;
        match &result {
            Ok(_) => attempt.succeeded(),
            Err(e) => {
                let error = match covers {
                    Covers::Row(id) => format!("{what} of row {id}: {}", e.report()),
                    _ => format!("{what}: {}", e.report()),
                };
                failing
                    .get_or_insert_with(|| health.failing(Check::Settle))
                    .failed(&error);
                attempt.failed(error);
            }
        }
        match result {
            Ok(n) => return Ok(n),
            Err(e) if matches!(covers, Covers::Rows) && e.kind() == StoreErrorKind::RowRefused => {
                return Err(e)
            }
            Err(e)
                if match e.kind() {
                    StoreErrorKind::Privilege | StoreErrorKind::RowRefused => outlast_refusals,
                    _ => e.is_retryable(),
                } =>
            {
                let retry_in = backoff.next_delay();
                ::metrics::counter!(metrics::STORE_ERRORS, "operation" => what).increment(1);
                let row = match covers {
                    Covers::Row(id) => Some(id),
                    _ => None,
                };
                tracing::warn!(operation = what, row, error = %e.report(), ?retry_in, "store write failed; retrying");
                tokio::time::sleep(retry_in).await;
            }
            Err(e) => {
                return Err(match covers {
                    Covers::Row(id) => e.about(format_args!("row {id}")),
                    _ => e,
                })
            }
        }
    }
}

struct Engine {
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    config: EngineConfig,
    lanes: Lanes,
    labels: Arc<DestinationLabels>,
    publishing: FuturesUnordered<BoxFuture<'static, Published>>,
    settling: FuturesUnordered<BoxFuture<'static, Settled>>,
    summary: Summary,
    claims: ClaimScheduler,
    next_retry: Option<Instant>,
    phase: Phase,
    /// A lease extension is running.
    extending: bool,
    /// Send groups whose publishes keep failing, for `/readyz`.
    publish_streaks: streaks::PublishStreaks,
    /// Health checks of send groups with one event failing alone, ended since the last
    /// batch came back: the group, when the check started, and whether it failed.
    probe_verdicts: Arc<std::sync::Mutex<Vec<(u64, std::time::Instant, bool)>>>,
    /// The keys the last claim left out ([`Lanes::crowded_keys`]): once a settle leaves one
    /// below its share, another claim is wanted to take its rows (the claim that left them
    /// out came back short, and would otherwise wait for the poll).
    crowded_keys: Vec<String>,
    /// When a claim that left keys out last came back empty: such a claim walks its whole
    /// window, so the next waits for the poll or a crowded key thinning, not for every
    /// wake-up (under a stream of commits, one after another).
    crowded_claim_found_nothing: Option<Instant>,
    /// The store may lease rows to this node that its lanes do not hold: a claim failed
    /// (it may have committed and lost only its answer), or the node just started (an
    /// earlier process under its id). The next claim first gives them back
    /// ([`OutboxStore::release_unheld`]): a node's own leases do not block its claims, and
    /// a later row of their key would go out before them.
    unheld_leases_possible: bool,
    /// Ownership as last acted on, and as last reported to the coordinator.
    ownership_seen: OwnershipSeen,
    /// The waiting state last told to the store (for its gated wake-up).
    reported_waiting: bool,
    drain: DrainProgress,
    /// A settle that failed for good: the run ends with it once the settles still in
    /// flight have finished (or the shutdown's deadline passed). Returned at once, it
    /// dropped them: rows of other batches, published, stayed in the table to go out again.
    failed: Option<StoreError>,
}

/// Where the engine's run is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Claiming, dispatching and settling.
    Relaying,
    /// The shutdown signal came (or a drain gave up): no more claims or dispatches.
    Stopping {
        /// Until when in-flight publishes and settles are waited for (the deadline less the
        /// clean-up reserve).
        settle_by: Instant,
        /// When the whole shutdown must be over.
        deadline: Instant,
    },
}

impl Phase {
    fn is_stopping(self) -> bool {
        matches!(self, Phase::Stopping { .. })
    }

    /// Until when in-flight work is waited for, once stopping.
    fn settle_by(self) -> Option<Instant> {
        match self {
            Phase::Relaying => None,
            Phase::Stopping { settle_by, .. } => Some(settle_by),
        }
    }
}

/// What a drain keeps track of to decide when it is done (unused without one).
struct DrainProgress {
    /// When the run began: a drain leaves rows inserted after this to the next run.
    began: Instant,
    /// The claim count when the backlog was last checked.
    checked_at_claim: u64,
    /// Since when rows that no claim returns have been waited for.
    waiting_since: Option<Instant>,
    /// Since when every claim has failed: a drain gives up after its patience.
    claims_failing_since: Option<Instant>,
}

impl DrainProgress {
    fn new() -> Self {
        DrainProgress {
            began: Instant::now(),
            checked_at_claim: 0,
            waiting_since: None,
            claims_failing_since: None,
        }
    }
}

/// The part of `shutdown_timeout` kept for the clean-up after in-flight publishes.
pub fn shutdown_cleanup_reserve(shutdown_timeout: Duration) -> Duration {
    (shutdown_timeout / 4).min(SHUTDOWN_CLEANUP_RESERVE)
}

/// One of the store's settles that a fence guards: ack, retry later, dead-letter.
type FencedSettle<T> = fn(&dyn OutboxStore, LeaseHolder, T) -> StoreFuture<u64>;

impl Engine {
    /// The fence settles carry: the held partitions at their epochs.
    fn settle_fence(&self) -> Option<Arc<Fence>> {
        self.config
            .shared
            .ownership
            .as_ref()
            .map(|o| Arc::new(o.settle_fence()))
    }

    fn spawn_settle(&mut self, settle: BoxFuture<'static, Settled>) {
        self.settling.push(settle);
    }

    /// Persists a fenced settle of `rows` (ack, retry, dead-letter) in the background, retried
    /// while the database is away (see [`persist`]); `settled` makes the loop's event of it.
    fn spawn_fenced_settle<T: Clone + Send + Sync + 'static>(
        &mut self,
        what: &'static str,
        (kind, covers, count): (SettleKind, Covers, usize),
        rows: T,
        op: FencedSettle<T>,
        settled: impl FnOnce(StoreResult<u64>) -> Settled + Send + 'static,
    ) {
        let store = self.store.clone();
        let holder = LeaseHolder {
            node: self.config.node.clone(),
            fence: self.settle_fence(),
        };
        let health = self.config.shared.health.clone();
        let telemetry = self.config.shared.telemetry.clone();
        let outlast_refusals = !self.config.drain;
        self.spawn_settle(
            async move {
                let start = telemetry.as_ref().map(|_| SystemTime::now());
                let result = persist(health, what, covers, outlast_refusals, || {
                    op(&*store, holder.clone(), rows.clone())
                })
                .await;
                if let (Some(telemetry), Some(start)) = (telemetry, start) {
                    telemetry.settled(Span::since(start), kind, count, result.as_ref().copied());
                }
                settled(result)
            }
            .boxed(),
        );
    }

    fn release(&mut self, ids: Vec<SequenceId>) {
        if ids.is_empty() {
            return;
        }
        self.lanes.releasing(&ids);
        let store = self.store.clone();
        let node = self.config.node.clone();
        let health = self.config.shared.health.clone();
        let outlast_refusals = !self.config.drain;
        self.spawn_settle(
            async move {
                let result = persist(health, "release", Covers::Whole, outlast_refusals, || {
                    store.release(node.clone(), ids.clone())
                })
                .await;
                Settled::Released(ids, result)
            }
            .boxed(),
        );
    }

    /// Hands out every ready lane head: events to the publisher, undecodable rows to the
    /// dead letters.
    fn dispatch(&mut self) {
        loop {
            let handout = self.lanes.take_ready(
                self.config.settings.batch_size,
                self.publisher.max_events_per_key(),
            );
            if handout.is_empty() {
                return;
            }
            let Handout {
                publish: batch,
                undecodable: rows,
            } = handout;
            let mut undecodable_lanes = Vec::new();
            let mut undecodable = Vec::new();
            for UndecodableHead {
                sequence_id,
                lane,
                destination,
                attempts,
                reason,
            } in rows
            {
                tracing::error!(sequence_id, %destination, %reason, "undecodable row; dead-lettering it");
                undecodable_lanes.push(SettledLane {
                    key: lane,
                    destination,
                });
                undecodable.push(DeadLetter {
                    sequence_id,
                    attempts,
                    error: storable_error(format!("undecodable row: {reason}")),
                });
            }
            self.dead_letter(undecodable_lanes, undecodable);
            for (group, batch) in self.split_by_send_group(batch) {
                self.publish(group, batch);
            }
        }
    }

    /// `batch` as one batch per send group of the publisher, with the group, each in the
    /// order of `batch` ([`outbox_core::Publisher::send_group`]): a batch's outcomes come
    /// back together, so a slow sink would hold every other sink's events sent beside it.
    fn split_by_send_group(&self, batch: Vec<Arc<Event>>) -> Vec<(u64, Vec<Arc<Event>>)> {
        if !self.publisher.has_send_groups() {
            return vec![(0, batch)];
        }
        // Few groups to a batch: a list beats a map. A lane's run (consecutive, one key)
        // goes whole to its first event's group: batches in flight never share a key.
        let mut groups: Vec<(u64, Vec<Arc<Event>>)> = Vec::new();
        let mut last: Option<(Arc<Event>, u64)> = None;
        for event in batch {
            let group = match &last {
                Some((previous, group)) if previous.ordering_key() == event.ordering_key() => {
                    *group
                }
                _ => self.publisher.send_group(&event),
            };
            last = Some((event.clone(), group));
            match groups.iter_mut().find(|(g, _)| *g == group) {
                Some((_, events)) => events.push(event),
                None => groups.push((group, vec![event])),
            }
        }
        groups
    }

    /// Tells `/readyz` of the oldest send group still failing, once the streaks no retry
    /// continued within the grace and the longest backoff are forgotten.
    fn report_publish_streaks(&mut self) {
        let windows = self.streak_windows();
        let health = &self.config.shared.health;
        match self
            .publish_streaks
            .oldest(std::time::Instant::now(), windows)
        {
            Some((since, error)) => health.record_failing_since(Check::Publish, since, error),
            None => health.clear_failure(Check::Publish),
        }
    }

    /// How long a failing streak says something of now: for `/readyz`, the grace and the
    /// longest backoff; for what a failure spends (`streaks::attempt`), also the longest
    /// wait in an outage again and a publish's timeout, since a retry comes back that long
    /// after the failure before it.
    fn streak_windows(&self) -> (Duration, Duration) {
        let settings = &self.config.settings;
        let recent = PUBLISH_GRACE + settings.retry.max_delay;
        (
            recent,
            recent + settings.retry.max_delay + settings.publish_timeout,
        )
    }

    /// Hands `batch` to the publisher, its outcomes awaited with the others in flight.
    fn publish(&mut self, group: u64, batch: Vec<Arc<Event>>) {
        if batch.is_empty() {
            return;
        }
        ::metrics::histogram!(metrics::PUBLISH_BATCH).record(batch.len() as f64);
        let lease_lost = self.lease_lost(&batch);
        let telemetry = self.config.shared.telemetry.clone().map(|t| {
            // The publisher names each event's system and destination for the spans.
            (t, self.publisher.clone(), SystemTime::now())
        });
        let publish = self.publisher.publish(batch.clone());
        let timeout = self.config.settings.publish_timeout;
        self.publishing.push(
            async move {
                let n = batch.len();
                let failed = |reason: String| {
                    (0..n)
                        .map(|_| Err(PublishError::new(PublishErrorKind::Timeout, reason.clone())))
                        .collect()
                };
                let outcomes = tokio::select! {
                    outcomes = tokio::time::timeout(timeout, publish) => match outcomes {
                        Ok(outcomes) => outcomes,
                        Err(_) => failed(format!("no confirmation within {timeout:?}")),
                    },
                    () = lease_lost => failed(
                        "no confirmation before this node's partition lease ran out".into(),
                    ),
                };
                if let Some((telemetry, publisher, start)) = telemetry {
                    telemetry.published(Span::since(start), &*publisher, &batch, &outcomes);
                }
                Published {
                    batch,
                    group,
                    outcomes,
                }
            }
            .boxed(),
        );
    }

    /// Resolves when this node may no longer wait for the sink to confirm `batch`: a
    /// partition of it was lost, or its lease ran out by the node's own clock and was not
    /// renewed. A confirmation after that could follow the new owner's publishes of the same
    /// keys. Pending forever without partition ownership.
    fn lease_lost(&self, batch: &[Arc<Event>]) -> BoxFuture<'static, ()> {
        let Some(ownership) = self.config.shared.ownership.clone() else {
            return futures::future::pending().boxed();
        };
        let partitions: std::collections::BTreeSet<i32> = batch
            .iter()
            .map(|e| outbox_core::partition_of(e.ordering_key(), ownership.count()))
            .collect();
        async move {
            // Renewals move the deadline on; look again each time it comes.
            while let Some(deadline) = ownership.publish_deadline(&partitions) {
                if std::time::Instant::now() >= deadline {
                    break;
                }
                tokio::time::sleep_until(Instant::from_std(deadline)).await;
            }
        }
        .boxed()
    }

    fn dead_letter(&mut self, lanes: Vec<SettledLane>, rows: Vec<DeadLetter>) {
        if rows.is_empty() {
            return;
        }
        let ids: Vec<SequenceId> = rows.iter().map(|r| r.sequence_id).collect();
        self.spawn_fenced_settle(
            "dead-letter",
            (SettleKind::DeadLetter, Covers::of(&ids), rows.len()),
            rows.clone(),
            |store, holder, rows| store.dead_letter(holder, rows),
            |result| {
                Settled::DeadLettered(SettledRows {
                    lanes,
                    rows,
                    result,
                })
            },
        );
    }

    fn on_published(&mut self, published: Published) {
        let Published {
            batch,
            group,
            mut outcomes,
        } = published;
        if outcomes.len() != batch.len() {
            tracing::error!(
                sink = %self.publisher.describe(),
                events = batch.len(),
                outcomes = outcomes.len(),
                "sink broke its contract (one outcome per event); retrying the batch"
            );
            outcomes = batch
                .iter()
                .map(|_| {
                    Err(PublishError::new(
                        PublishErrorKind::BrokerFailure,
                        "sink returned the wrong number of outcomes",
                    ))
                })
                .collect();
        }
        let now = SystemTime::now();
        let mut acked = Vec::new();
        let mut retries = Vec::new();
        let mut retry_lanes = Vec::new();
        let mut dead_lanes = Vec::new();
        let mut dead = Vec::new();
        let mut release = Vec::new();
        let mut first_failure: Option<(String, usize)> = None;
        // Whether the destination is down, judged once for the batch (`streaks::attempt`).
        for (group, started, down) in std::mem::take(
            &mut *self
                .probe_verdicts
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        ) {
            self.publish_streaks.probed(group, started, down);
        }
        let batch_confirmed = outcomes.iter().any(Result::is_ok);
        let (judged_at, (_, recent)) = (std::time::Instant::now(), self.streak_windows());
        // The failures that say the destination is down, for the streak's evidence.
        let mut failed_as_down = Vec::new();
        let mut first_down_retry: Option<Duration> = None;
        let mut outage: Option<Duration> = None;
        let mut first_dead: Option<(SequenceId, String, String, String)> = None;
        // A lane's run is consecutive in the batch. Its confirmed prefix is acked; its first
        // failure is retried or dead-lettered as a lane head; the rest of the run is not
        // counted (released, or handed out again), whatever the sink said of it.
        let mut failed_lane: Option<LaneKey> = None;
        // Looked up once per batch: the recorder's registry hashes the name on each lookup.
        let commit_to_confirm = ::metrics::histogram!(metrics::COMMIT_TO_CONFIRM);
        for (event, outcome) in batch.iter().zip(outcomes) {
            let lane = match self.lanes.lane_of_held(event.sequence_id) {
                Some(lane) => lane,
                None => self.lanes.lane_of(event.sequence_id, event.ordering_key()),
            };
            if failed_lane.as_ref() == Some(&lane) {
                continue;
            }
            failed_lane = None;
            match outcome {
                Ok(()) => {
                    acked.push(Acked {
                        sequence_id: event.sequence_id,
                        destination: event.destination.clone(),
                    });
                    if let Ok(latency) = now.duration_since(event.created_at) {
                        commit_to_confirm.record(latency.as_secs_f64());
                    }
                    self.lanes.confirmed(&lane, 1);
                }
                Err(error) => {
                    failed_lane = Some(lane.clone());
                    if error.kind() == PublishErrorKind::NotSent {
                        // Held back behind a failure of its key in the batch (under
                        // `--ordering none` that is another lane's), or not started in time
                        // by the sink: this row simply goes out again.
                        release.extend(self.lanes.give_back(&lane));
                        continue;
                    }
                    let report = error.report();
                    self.summary.last_failure = Some(report.clone());
                    let retry = &self.config.settings.retry;
                    let spent = self.publish_streaks.attempt(
                        group,
                        (batch_confirmed, error.kind(), event.attempts),
                        judged_at,
                        recent,
                    );
                    let attempts = spent.attempts_after(event.attempts);
                    let decision = match spent {
                        Attempt::InOutage { lasted } => {
                            outage = Some(lasted);
                            let wait = retry.wait_in_outage(attempts, lasted, &error);
                            RetryDecision::RetryAfter(wait)
                        }
                        Attempt::Counted => {
                            let limit = event
                                .max_attempts
                                .unwrap_or_else(|| retry.max_attempts_for(&event.event_type));
                            retry.decide_with_limit(limit, attempts, &error)
                        }
                    };
                    match decision {
                        RetryDecision::RetryAfter(delay) => {
                            match &mut first_failure {
                                Some((_, n)) => *n += 1,
                                None => {
                                    first_failure =
                                        Some((format!("{}: {report}", event.destination), 1))
                                }
                            }
                            if error.kind().is_the_destinations_condition() {
                                failed_as_down.push(event.sequence_id);
                                first_down_retry.get_or_insert(delay);
                            }
                            let due = Instant::now() + delay;
                            self.next_retry = Some(self.next_retry.map_or(due, |d| d.min(due)));
                            release.extend(self.lanes.block(&lane));
                            retry_lanes.push(SettledLane {
                                key: lane,
                                destination: event.destination.clone(),
                            });
                            retries.push(RetryLater {
                                sequence_id: event.sequence_id,
                                attempts,
                                error: storable_error(report),
                                delay,
                            });
                        }
                        RetryDecision::DeadLetter => {
                            // One error line per batch (below), each event at debug: a sink
                            // refusing everything at 5,000 events/s wrote 5,000 lines a second.
                            tracing::debug!(
                                sequence_id = event.sequence_id,
                                event_id = %event.event_id,
                                destination = %event.destination,
                                attempts,
                                error = %report,
                                "event cannot be delivered; dead-lettering it"
                            );
                            if first_dead.is_none() {
                                first_dead = Some((
                                    event.sequence_id,
                                    event.event_id.to_string(),
                                    event.destination.clone(),
                                    report.clone(),
                                ));
                            }
                            dead_lanes.push(SettledLane {
                                key: lane,
                                destination: event.destination.clone(),
                            });
                            dead.push(DeadLetter {
                                sequence_id: event.sequence_id,
                                attempts,
                                error: storable_error(report),
                            });
                        }
                    }
                }
            }
        }
        // What /readyz says of publishing, per send group (`streaks`): an event of the
        // batch's group confirmed ends its streak; failures to retry carry it on.
        let streak_error = first_failure.as_ref().map(|(error, _)| {
            format!(
                "no event confirmed by the sink {} to {error}",
                self.publisher.describe()
            )
        });
        if !self.ownership_seen.holds_none {
            self.publish_streaks.batch(
                group,
                !acked.is_empty(),
                (streak_error, &failed_as_down),
                std::time::Instant::now(),
            );
            if let (Some(lone), Some(retry_in)) = (failed_as_down.first(), first_down_retry) {
                if self.publish_streaks.wants_probe(group) {
                    if let Some(event) = batch.iter().find(|e| e.sequence_id == *lone) {
                        self.probe_destination(group, event, retry_in);
                    }
                }
            }
        }
        if !acked.is_empty() {
            self.config.shared.health.record(Check::Publish, Ok(()));
        }
        // With no streak, the success above (or none at all) is the whole verdict.
        if !self.publish_streaks.is_empty() {
            self.report_publish_streaks();
        }
        match (first_failure, outage) {
            (Some((error, count)), Some(lasted)) => tracing::warn!(
                events = count,
                %error,
                sink = %self.publisher.describe(),
                down_for = ?lasted,
                "publish failed while the sink has confirmed nothing since an earlier failure; \
                 retrying, spending none of the events' attempts until it confirms one"
            ),
            (Some((error, count)), None) => {
                tracing::warn!(events = count, %error, sink = %self.publisher.describe(), "publish failed; will retry with backoff")
            }
            (None, _) => {}
        }
        if let Some((sequence_id, event_id, destination, error)) = first_dead {
            tracing::error!(
                events = dead.len(),
                sequence_id,
                %event_id,
                %destination,
                %error,
                "events cannot be delivered; dead-lettering them (the first of them named; \
                 `outbox-relay dead list` shows each)"
            );
        }
        self.ack(acked);
        self.retry_later(retry_lanes, retries);
        self.dead_letter(dead_lanes, dead);
        self.release(release);
    }

    /// Checks the health of the destination of `event`, failing alone in `group`, for the
    /// judgement of what its retry's failure spends (`streaks::wants_probe`): just before
    /// that retry, due in `retry_in`. Checked right after the failure, a receiver that the
    /// event itself knocks over (a payload that crashes it) was still restarting, the check
    /// failed, and the event was spared for good; before the retry, a receiver that came
    /// back passes, and the failure counts. A check that does not answer within a
    /// publish's timeout failed; one that panics says nothing against the destination.
    fn probe_destination(&self, group: u64, event: &Event, retry_in: Duration) {
        let check = self.publisher.health_of(event);
        let timeout = self.config.settings.publish_timeout;
        let verdicts = self.probe_verdicts.clone();
        tokio::spawn(
            async move {
                tokio::time::sleep(retry_in.mul_f64(0.9)).await;
                let started = std::time::Instant::now();
                let result = std::panic::AssertUnwindSafe(tokio::time::timeout(timeout, check))
                    .catch_unwind()
                    .await;
                let down = match result {
                    Ok(Ok(Ok(()))) | Err(_) => false,
                    Ok(Ok(Err(_)) | Err(_)) => true,
                };
                tracing::debug!(
                    group,
                    down,
                    "checked a destination one event keeps failing at"
                );
                verdicts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push((group, started, down));
            }
            .in_current_span(),
        );
    }

    fn ack(&mut self, acked: Vec<Acked>) {
        if acked.is_empty() {
            return;
        }
        let ids: Vec<SequenceId> = acked.iter().map(|a| a.sequence_id).collect();
        self.spawn_fenced_settle(
            "ack",
            (SettleKind::Ack, Covers::of(&ids), ids.len()),
            ids,
            |store, holder, ids| store.ack(holder, ids),
            |result| Settled::Acked(acked, result),
        );
    }

    fn retry_later(&mut self, lanes: Vec<SettledLane>, retries: Vec<RetryLater>) {
        if retries.is_empty() {
            return;
        }
        let ids: Vec<SequenceId> = retries.iter().map(|r| r.sequence_id).collect();
        // A retry statement releases its rows: a claim may take them again (once due)
        // before this reports back.
        self.lanes.releasing(&ids);
        self.spawn_retry(lanes, retries);
    }

    /// The retry statement of rows already marked releasing (a split one's halves are not
    /// marked again: each release counts its statements).
    fn spawn_retry(&mut self, lanes: Vec<SettledLane>, retries: Vec<RetryLater>) {
        let ids: Vec<SequenceId> = retries.iter().map(|r| r.sequence_id).collect();
        self.spawn_fenced_settle(
            "retry",
            (SettleKind::Retry, Covers::of(&ids), retries.len()),
            retries.clone(),
            |store, holder, retries| store.retry_later(holder, retries),
            |result| {
                Settled::Retried(SettledRows {
                    lanes,
                    rows: retries,
                    result,
                })
            },
        );
    }

    fn fenced(&self, what: &str, expected: usize, done: u64) {
        if (done as usize) < expected {
            let missing = expected - done as usize;
            ::metrics::counter!(metrics::FENCED).increment(missing as u64);
            tracing::warn!(
                operation = what,
                rows = missing,
                "rows were no longer this node's to settle (a lease or partition lost), or were \
                 gone (deleted, or replaced under their ids: a TRUNCATE, a restarted sequence); \
                 those still in the table are delivered again"
            );
        }
    }

    fn on_settled(&mut self, settled: Settled) -> StoreResult<()> {
        if matches!(settled, Settled::Extended(_)) {
            self.extending = false;
        } else if self.crowd_thinned() {
            // The rows of a key no longer crowded wait in the table.
            self.crowded_claim_found_nothing = None;
            self.claims.want();
        } else if self.config.drain {
            // Something changed: look once more before deciding the drain is done.
            self.claims.want();
        }
        match settled {
            Settled::Acked(mut acked, result) if refused_a_row(acked.len(), &result) => {
                tracing::debug!(
                    rows = acked.len(),
                    "a row of the ack was refused; acking its halves apart"
                );
                let back = acked.split_off(acked.len() / 2);
                self.ack(acked);
                self.ack(back);
            }
            Settled::Retried(mut settled) if refused_a_row(settled.rows.len(), &settled.result) => {
                let (lanes, rows) = settled.split_off_half();
                self.spawn_retry(settled.lanes, settled.rows);
                self.spawn_retry(lanes, rows);
            }
            Settled::DeadLettered(mut settled)
                if refused_a_row(settled.rows.len(), &settled.result) =>
            {
                let (lanes, rows) = settled.split_off_half();
                self.dead_letter(settled.lanes, settled.rows);
                self.dead_letter(lanes, rows);
            }
            Settled::Acked(acked, result) => {
                let n = result?;
                self.fenced("ack", acked.len(), n);
                // A batch's events mostly share a destination: one count per run of them.
                for run in acked.chunk_by(|a, b| a.destination == b.destination) {
                    ::metrics::counter!(metrics::PUBLISHED, "destination" => self.labels.label(&run[0].destination))
                        .increment(run.len() as u64);
                }
                self.summary.published += acked.len() as u64;
                let ids: Vec<SequenceId> = acked.iter().map(|a| a.sequence_id).collect();
                self.lanes.forget(&ids);
            }
            Settled::Retried(SettledRows {
                lanes,
                rows,
                result,
            }) => {
                let ids: Vec<SequenceId> = rows.iter().map(|r| r.sequence_id).collect();
                let n = result?;
                self.fenced("retry", ids.len(), n);
                for lane in &lanes {
                    self.lanes.retry_recorded(&lane.key, self.claims.started);
                    ::metrics::counter!(metrics::RETRIED, "destination" => self.labels.label(&lane.destination))
                        .increment(1);
                }
                self.summary.retried += ids.len() as u64;
                self.lanes.forget_released(&ids, self.claims.started);
            }
            Settled::DeadLettered(SettledRows {
                lanes,
                rows,
                result,
            }) => {
                let ids: Vec<SequenceId> = rows.iter().map(|r| r.sequence_id).collect();
                let n = result?;
                self.fenced("dead-letter", ids.len(), n);
                if (n as usize) < ids.len() {
                    self.summary.dead_letters_unconfirmed += (ids.len() - n as usize) as u64;
                    // The fence refused some (which, the count does not say): those heads are
                    // still pending in the table. Handing out the rows behind them would put
                    // them ahead of their head, claimed again later: each lane is given back,
                    // head first, to be claimed again in order (a head that was written is
                    // dead, and its release changes nothing).
                    let mut back = Vec::new();
                    for lane in &lanes {
                        back.extend(self.lanes.give_back(&lane.key));
                    }
                    self.release(back);
                } else {
                    let mut lost = Vec::new();
                    for lane in &lanes {
                        lost.extend(self.lanes.advance(&lane.key));
                        ::metrics::counter!(metrics::DEAD_LETTERED, "destination" => self.labels.label(&lane.destination))
                            .increment(1);
                    }
                    self.summary.dead_lettered += ids.len() as u64;
                    self.lanes.forget(&ids);
                    self.release(lost);
                }
            }
            Settled::Released(ids, result) => {
                result?;
                self.lanes.forget_released(&ids, self.claims.started);
            }
            Settled::Extended(result) => {
                if let Err(e) = result {
                    tracing::warn!(error = %e.report(), "could not extend leases");
                }
            }
        }
        ::metrics::gauge!(metrics::IN_FLIGHT).set(self.lanes.held() as f64);
        Ok(())
    }
}

/// The claim step and the loop's bookkeeping, beside `dispatch`, `on_published` and
/// `on_settled` above.
impl Engine {
    /// A key the last claim left out holds less than its share now.
    fn crowd_thinned(&self) -> bool {
        let share = self.config.settings.key_share();
        self.crowded_keys
            .iter()
            .any(|key| self.lanes.lane_rows(key) < share)
    }

    /// No publish and no settle is in flight.
    fn nothing_pending(&self) -> bool {
        self.publishing.is_empty() && self.settling.is_empty()
    }

    /// Nothing in flight and no row held: the engine has no work of its own left.
    fn idle(&self) -> bool {
        self.nothing_pending() && self.lanes.held() == 0
    }

    /// Acts on a changed ownership, or on a lease that ran out by our clock: the work of
    /// partitions this node may no longer publish goes back, unpublished.
    fn follow_ownership(&mut self) {
        let Some(ownership) = self.config.shared.ownership.clone() else {
            return;
        };
        let now = std::time::Instant::now();
        let seen = &mut self.ownership_seen;
        if ownership.generation() != seen.generation || seen.next_expiry.is_some_and(|t| now >= t) {
            seen.generation = ownership.generation();
            let (publishable, next) = ownership.publishable(now);
            seen.next_expiry = next;
            seen.holds_none = publishable.is_empty();
            let dropped = self.lanes.keep_only_partitions(&publishable);
            self.release(dropped);
            // A standby that failed to publish before it lost its partitions (paused past
            // its lease, its sink timing out meanwhile) said so on `/readyz` for minutes,
            // with nothing of its own to publish.
            if self.ownership_seen.holds_none && !self.publish_streaks.is_empty() {
                self.publish_streaks.clear();
                self.config.shared.health.clear_failure(Check::Publish);
            }
        }
    }

    /// Tells the coordinator which partitions still have rows here, with the generation
    /// acted on: it releases a revoked partition only on a report that postdates the
    /// revocation.
    fn report_busy_partitions(&mut self) {
        let Some(ownership) = &self.config.shared.ownership else {
            return;
        };
        let busy = self.lanes.busy_partitions();
        let seen = &mut self.ownership_seen;
        if busy != seen.reported_busy || seen.generation != seen.reported_generation {
            ownership.set_busy(busy.clone(), seen.generation);
            seen.reported_busy = busy;
            seen.reported_generation = seen.generation;
        }
    }

    /// Tells the store whether the engine waits for rows (nothing held, no backlog), for
    /// its gated wake-up. A claim in flight does not count, so the claim a gated store asks
    /// for after taking its lock does not flip this back.
    fn report_waiting(&mut self) {
        let waiting = self.idle() && !self.claims.backlog && !self.phase.is_stopping();
        if waiting != self.reported_waiting {
            self.store.set_waiting(waiting);
            self.reported_waiting = waiting;
        }
    }

    /// Starts a claim if one is due and there is room for more rows: half a batch, unless
    /// nothing is held. A claim for a handful of rows while thousands are in flight costs a
    /// round trip, and the sink a batch, for little.
    fn start_claim(&mut self) {
        let settings = &self.config.settings;
        let held = self.lanes.held();
        // Rows by count, and by what they cost in memory: 1 MiB events counted only by
        // number held 10,000 MiB behind a slow sink, an OOM kill that claimed them again.
        let row_bytes = self.lanes.last_claims_largest();
        let fit = settings.rows_that_fit(self.lanes.held_bytes(), row_bytes);
        let capacity = settings.max_in_flight.saturating_sub(held).min(fit);
        // Half of what a claim could take with nothing held: of a batch, or of the rows
        // that fit the memory budget (large rows would otherwise wait for every held one).
        let whole = settings
            .batch_size
            .min(settings.max_in_flight)
            .min(settings.rows_that_fit(0, row_bytes));
        let worth_a_claim = (whole / 2).max(1);
        if (held > 0 && capacity < worth_a_claim) || !self.claims.due(capacity) {
            return;
        }
        let fence = self
            .config
            .shared
            .ownership
            .as_ref()
            .map(|o| Arc::new(o.claim_fence(std::time::Instant::now())));
        // Holding no partition, there is nothing to claim until the coordinator grants one
        // (it wakes us). A claim that failed before says nothing of now: a node given no
        // partitions (more nodes than partitions) claimed never again, its old failure
        // shown on /readyz for good.
        if fence.as_ref().is_some_and(|f| f.partitions.is_empty()) {
            self.config.shared.health.clear_failure(Check::Claim);
            return;
        }
        let limit = capacity.min(self.config.settings.batch_size);
        let crowded = if self.store.leaves_out_crowded_keys() {
            Crowded {
                keys: self.lanes.crowded_keys(settings.key_share()),
                // Past the rows the node may hold, as many again.
                window: settings.max_in_flight.saturating_mul(2),
            }
        } else {
            // The pause below is for a claim that walked its window: a claim that cannot
            // leave keys out came back empty because nothing was there.
            Crowded::default()
        };
        let poll = settings.poll_interval;
        if !crowded.keys.is_empty()
            && self
                .crowded_claim_found_nothing
                .is_some_and(|at| at.elapsed() < poll)
        {
            return;
        }
        self.crowded_keys.clone_from(&crowded.keys);
        let claimed_under = fence.clone();
        let release_unheld = self.unheld_leases_possible.then(|| {
            self.store
                .release_unheld(self.config.node.clone(), self.lanes.held_ids())
        });
        let store = self.store.clone();
        let request = ClaimRequest {
            node: self.config.node.clone(),
            limit,
            lease: self.config.settings.lease,
            fence,
            ordered: self.config.ordered,
            crowded,
        };
        // Claimed after the release: both in the claim's slot, so no other claim runs
        // between them.
        let claim = async move {
            if let Some(release) = release_unheld {
                let released = release.await?;
                if released > 0 {
                    tracing::warn!(
                        rows = released,
                        "gave back rows leased to this node that it did not hold (a claim whose answer was lost, or an earlier process under this node id)"
                    );
                }
            }
            store.claim(request).await
        };
        let attempt = self.config.shared.health.begin(Check::Claim);
        let claim_no = self.claims.started + 1;
        let telemetry = self
            .config
            .shared
            .telemetry
            .clone()
            .map(|t| (t, SystemTime::now()));
        self.claims.start(
            async move {
                let result = claim.await;
                if let Some((telemetry, start)) = telemetry {
                    telemetry.claimed(Span::since(start), result.as_ref().map(Vec::len));
                }
                match &result {
                    Ok(_) => attempt.succeeded(),
                    Err(e) => {
                        attempt.failed(e.report());
                    }
                }
                Claim {
                    number: claim_no,
                    limit,
                    fence: claimed_under,
                    result,
                }
            }
            .boxed(),
        );
    }

    /// `rows` of a claim fenced with `fence`, split into those of partitions still held at
    /// the claim's epochs and the ids of the others ([`outbox_core::Ownership::gone_from`]):
    /// those go back unpublished. Published, they went out after what the partition's owner
    /// meanwhile published of their keys.
    fn claimed_under_a_gone_epoch(
        &self,
        fence: Option<&outbox_core::partition::Fence>,
        rows: Vec<outbox_core::Claimed>,
    ) -> (Vec<outbox_core::Claimed>, Vec<SequenceId>) {
        let (Some(fence), Some(ownership)) = (fence, self.config.shared.ownership.as_ref()) else {
            return (rows, Vec::new());
        };
        // One look at the partitions; each row's (a hash of its key) only when one went.
        let gone = ownership.gone_from(fence);
        if gone.is_empty() {
            return (rows, Vec::new());
        }
        let count = ownership.count();
        let (kept, stale): (Vec<outbox_core::Claimed>, Vec<outbox_core::Claimed>) = rows
            .into_iter()
            .partition(|row| !gone.contains(&outbox_core::partition_of(row.ordering_key(), count)));
        if !stale.is_empty() {
            tracing::debug!(
                rows = stale.len(),
                "claimed rows of a partition taken again at a later epoch meanwhile: released"
            );
        }
        (
            kept,
            stale
                .iter()
                .map(outbox_core::Claimed::sequence_id)
                .collect(),
        )
    }

    /// A claim came back: its rows join their lanes (or go back, if their key is blocked).
    fn on_claimed(&mut self, claim: Claim) -> StoreResult<()> {
        let Claim {
            number: claim_no,
            limit,
            fence,
            result,
        } = claim;
        self.unheld_leases_possible = result.is_err();
        match result {
            Ok(rows) => {
                ::metrics::histogram!(metrics::CLAIM_BATCH).record(rows.len() as f64);
                self.claims.succeeded(rows.len(), limit);
                self.crowded_claim_found_nothing =
                    (rows.is_empty() && !self.crowded_keys.is_empty()).then(Instant::now);
                self.drain.claims_failing_since = None;
                let (rows, stale) = self.claimed_under_a_gone_epoch(fence.as_deref(), rows);
                let mut release = self.lanes.accept(claim_no, rows);
                release.extend(stale);
                self.lanes.expire_blocks(claim_no);
                // The claim may carry rows of partitions revoked or lost while it ran: check
                // again before anything is dispatched.
                self.ownership_seen.generation = u64::MAX;
                self.release(release);
                if self.phase.is_stopping() {
                    let unstarted = self.lanes.take_unstarted();
                    self.release(unstarted);
                }
                ::metrics::gauge!(metrics::IN_FLIGHT).set(self.lanes.held() as f64);
                Ok(())
            }
            Err(e) if e.is_retryable() => {
                let retry_in = self.claims.failed();
                ::metrics::counter!(metrics::STORE_ERRORS, "operation" => "claim").increment(1);
                tracing::warn!(error = %e.report(), ?retry_in, "claim failed");
                let since = *self
                    .drain
                    .claims_failing_since
                    .get_or_insert_with(Instant::now);
                // Decided here, on a claim that failed, never on a pause in claiming (full
                // lanes, no partitions): a drain is a job someone waits on, so it ends rather
                // than hang where a long-running relay keeps trying. It stops as on a signal,
                // settling what is in flight.
                if self.config.drain
                    && !self.phase.is_stopping()
                    && since.elapsed() >= self.config.drain_patience
                {
                    let failed_for = since.elapsed();
                    tracing::warn!(?failed_for, patience = ?self.config.drain_patience, "drain: every claim failed for longer than the drain's patience; stopping");
                    self.summary.drain = Some(DrainEnd::Unknown(format!(
                        "every claim failed for {failed_for:.1?}; the last: {}",
                        e.report()
                    )));
                    self.begin_shutdown();
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Keeps this node's row leases alive while their rows are in its lanes or in flight.
    fn extend_leases(&mut self) {
        self.extending = true;
        let ids = self.lanes.held_ids();
        let store = self.store.clone();
        let node = self.config.node.clone();
        let lease = self.config.settings.lease;
        let attempt = self.config.shared.health.begin(Check::Settle);
        self.spawn_settle(
            async move {
                let result = store
                    .extend_leases(LeaseExtension { node, ids, lease })
                    .await;
                if let Err(e) = &result {
                    attempt.failed(format!("extend leases: {}", e.report()));
                } else {
                    attempt.succeeded();
                }
                Settled::Extended(result)
            }
            .boxed(),
        );
    }

    /// A settle failed for good: no more claims or dispatches, and the run ends with the
    /// (first) error once the settles in flight are done.
    fn settle_failed(&mut self, error: StoreError) {
        tracing::debug!(error = %error.report(), "a settle failed for good; finishing the settles in flight");
        self.failed.get_or_insert(error);
        if !self.phase.is_stopping() {
            self.begin_shutdown();
        }
    }

    /// The shutdown signal: no more claims or dispatches; rows not handed out go back.
    fn begin_shutdown(&mut self) {
        let now = Instant::now();
        let timeout = self.config.settings.shutdown_timeout;
        tracing::info!(shutdown_timeout = ?timeout, "shutting down: settling in-flight events");
        self.phase = Phase::Stopping {
            settle_by: now + timeout - shutdown_cleanup_reserve(timeout),
            deadline: now + timeout,
        };
        let unstarted = self.lanes.take_unstarted();
        self.release(unstarted);
    }

    /// The wait for in-flight work ran out: what is unfinished comes back after its lease.
    fn abandon_unfinished(&mut self) {
        self.summary.abandoned = self.publishing.len() + self.settling.len();
        tracing::warn!(
            publishes = self.publishing.len(),
            settle_statements = self.settling.len(),
            rows = self.lanes.held(),
            "shutdown timeout reached with publishes or settles unfinished (broker or \
             database not answering); their rows are delivered again once their leases run out"
        );
    }

    /// With a drain, once nothing more is claimed: whether what is still pending lets the
    /// drain end (and how, in `summary.drain`). Checked once per claim.
    async fn drain_finished(&mut self) -> bool {
        if !self.config.drain
            || !self.claims.settled_empty()
            || !self.idle()
            || self.drain.checked_at_claim == self.claims.started
        {
            return false;
        }
        self.drain.checked_at_claim = self.claims.started;
        let waited = self.drain.waiting_since.map(|t| t.elapsed());
        let out_of_patience = waited.is_some_and(|w| w >= self.config.drain_patience);
        match drain_check(self.store.clone(), self.drain.began.elapsed()).await {
            DrainCheck::Done(end) => {
                self.summary.drain = Some(end);
                return true;
            }
            DrainCheck::Wait(left) if out_of_patience => {
                self.summary.drain = Some(DrainEnd::Left(left));
                return true;
            }
            DrainCheck::Failed(e) if out_of_patience => {
                self.summary.drain = Some(DrainEnd::Unknown(e));
                return true;
            }
            DrainCheck::Wait(left) => {
                if waited.is_none() {
                    tracing::info!(
                        pending = left.pending,
                        patience = ?self.config.drain_patience,
                        "drain: pending events that no claim returns yet (leased by another \
                         node or one that died, in another node's partitions, or scheduled \
                         for later); waiting for them"
                    );
                }
            }
            DrainCheck::Failed(e) => {
                tracing::warn!(error = %e, "drain: cannot tell what is left; trying again");
            }
        }
        self.drain.waiting_since.get_or_insert_with(Instant::now);
        false
    }
}

/// Runs the relay until `shutdown` resolves (or, with `drain`, until nothing deliverable is
/// left). Returns an error only for a store failure that retrying cannot fix (missing
/// tables, privileges); the error says how to fix it.
pub async fn run(
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    config: EngineConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<Summary, StoreError> {
    metrics::describe();
    let wake = Arc::new(Notify::new());
    let listener = match config.wake {
        WakeMode::Notify => {
            let wake = wake.clone();
            store
                .subscribe(Arc::new(move || wake.notify_one()))
                .map(|subscription| tokio::spawn(subscription.in_current_span()))
        }
        WakeMode::FixedRate => None,
    };
    let give_way = store
        .give_way_to_shutdown()
        .map(|task| tokio::spawn(task.in_current_span()));
    if let Some(ownership) = &config.shared.ownership {
        let wake = wake.clone();
        ownership.on_change(move || wake.notify_one());
    }
    let backlog_reporter = tokio::spawn(
        report_backlog(
            store.clone(),
            config.settings.backlog_interval,
            config.shared.health.clone(),
        )
        .in_current_span(),
    );
    let lanes = Lanes::new(
        config.ordered,
        config.shared.ownership.as_ref().map(|o| o.count()),
    );
    let mut engine = Engine {
        store,
        publisher,
        labels: config.shared.labels.clone(),
        config,
        lanes,
        publishing: FuturesUnordered::new(),
        settling: FuturesUnordered::new(),
        summary: Summary::default(),
        claims: ClaimScheduler::default(),
        next_retry: None,
        phase: Phase::Relaying,
        extending: false,
        publish_streaks: streaks::PublishStreaks::default(),
        probe_verdicts: Arc::default(),
        crowded_keys: Vec::new(),
        crowded_claim_found_nothing: None,
        unheld_leases_possible: true,
        ownership_seen: OwnershipSeen::default(),
        reported_waiting: false,
        drain: DrainProgress::new(),
        failed: None,
    };
    let result = event_loop(&mut engine, wake, shutdown).await;
    for task in [listener, give_way].into_iter().flatten() {
        task.abort();
    }
    backlog_reporter.abort();
    // Everything from here on ends by the shutdown deadline: a database or broker that does
    // not answer costs the rest of the shutdown budget, never more.
    let deadline = match engine.phase {
        Phase::Stopping { deadline, .. } => deadline,
        Phase::Relaying => Instant::now() + engine.config.settings.shutdown_timeout,
    };
    // What is still leased and was never handed out goes back at once rather than after
    // the lease; what was handed out keeps its lease (its publish may yet land).
    let leftover = engine.lanes.take_unstarted();
    if !leftover.is_empty() {
        let rows = leftover.len();
        let release = engine.store.release(engine.config.node.clone(), leftover);
        match tokio::time::timeout_at(deadline, release).await {
            Ok(Ok(n)) => tracing::info!(rows = n, "released leases"),
            Ok(Err(e)) => {
                tracing::warn!(rows, error = %e.report(), "could not release leases; the rows come back when their leases run out")
            }
            Err(_) => tracing::warn!(
                rows,
                "the database did not answer the release before the shutdown deadline; the rows come back when their leases run out"
            ),
        }
    }
    if result.is_ok() && engine.config.drain && engine.summary.drain.is_none() {
        // Stopped by a signal mid-drain: say what is left, without waiting for anything.
        let running_for = engine.drain.began.elapsed();
        engine.summary.drain = Some(
            match tokio::time::timeout_at(deadline, drain_check(engine.store.clone(), running_for))
                .await
            {
                Ok(DrainCheck::Done(end)) => end,
                Ok(DrainCheck::Wait(backlog)) => DrainEnd::Left(backlog),
                Ok(DrainCheck::Failed(e)) => DrainEnd::Unknown(e),
                Err(_) => DrainEnd::Unknown(
                    "the backlog query had no answer before the shutdown deadline".into(),
                ),
            },
        );
    }
    if tokio::time::timeout_at(deadline, engine.publisher.close())
        .await
        .is_err()
    {
        tracing::warn!(
            sink = %engine.publisher.describe(),
            "the sink did not close before the shutdown deadline (broker unreachable?); \
             anything it had not confirmed is delivered again from the outbox"
        );
    }
    result.map(|()| engine.summary)
}

enum DrainCheck {
    Done(DrainEnd),
    /// Pending rows that no claim returned: another node's leases or partitions, or rows
    /// scheduled for later.
    Wait(Backlog),
    Failed(String),
}

/// What the outbox holds once a drain found nothing more to claim. `running_for`: rows
/// younger than this were inserted during the drain.
async fn drain_check(store: Arc<dyn OutboxStore>, running_for: Duration) -> DrainCheck {
    let backlog = match store.backlog().await {
        Ok(b) => b,
        Err(e) => return DrainCheck::Failed(format!("cannot read the backlog: {}", e.report())),
    };
    if backlog.pending == 0 {
        DrainCheck::Done(DrainEnd::Clean { arrived: 0 })
    } else if backlog
        .oldest_pending_age
        .is_some_and(|age| age < running_for)
    {
        // Every row left arrived during the drain, those that failed too: the next run's.
        DrainCheck::Done(DrainEnd::Clean {
            arrived: backlog.pending,
        })
    } else if backlog.retrying > 0 {
        // Failed events: a drain does not wait out their backoff.
        DrainCheck::Done(DrainEnd::Left(backlog))
    } else {
        DrainCheck::Wait(backlog)
    }
}

/// The engine's loop: each turn starts what may start (dispatch, a claim), reports what
/// changed, then waits for the next event; each arm of the `select!` is one call.
async fn event_loop(
    engine: &mut Engine,
    wake: Arc<Notify>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), StoreError> {
    tokio::pin!(shutdown);
    let mut poll = tokio::time::interval(engine.config.settings.poll_interval);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut extend = tokio::time::interval(engine.config.settings.lease / 3);
    extend.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    extend.reset();
    loop {
        engine.follow_ownership();
        if !engine.phase.is_stopping() {
            engine.dispatch();
            engine.start_claim();
        }
        engine.report_busy_partitions();
        engine.report_waiting();
        if engine.phase.is_stopping() && engine.claims.running.is_none() && engine.nothing_pending()
        {
            return engine.failed.take().map_or(Ok(()), Err);
        }
        if engine.failed.is_none() && engine.drain_finished().await {
            return Ok(());
        }
        let settle_by = engine.phase.settle_by();
        let retry_due = engine.next_retry;
        let backing_off = engine.claims.backing_off_until();
        let may_extend = !engine.extending && engine.lanes.held() > 0;
        tokio::select! {
            () = &mut shutdown, if settle_by.is_none() => engine.begin_shutdown(),
            () = tokio::time::sleep_until(settle_by.unwrap_or_else(Instant::now)), if settle_by.is_some() => {
                engine.abandon_unfinished();
                return engine.failed.take().map_or(Ok(()), Err);
            }
            claim = engine.claims.finished(), if engine.claims.running.is_some() => {
                engine.on_claimed(claim)?;
            }
            Some(published) = engine.publishing.next() => engine.on_published(published),
            Some(settled) = engine.settling.next() => {
                if let Err(e) = engine.on_settled(settled) {
                    engine.settle_failed(e);
                }
            }
            () = wake.notified() => engine.claims.want(),
            _ = poll.tick() => {
                engine.claims.want();
                // A streak whose events were dead-lettered ends without a batch to say so.
                if !engine.publish_streaks.is_empty() {
                    engine.report_publish_streaks();
                }
            }
            () = tokio::time::sleep_until(retry_due.unwrap_or_else(Instant::now)), if retry_due.is_some() && !engine.config.drain => {
                engine.next_retry = None;
                engine.claims.want();
            }
            () = tokio::time::sleep_until(backing_off.unwrap_or_else(Instant::now)), if backing_off.is_some() => {}
            _ = extend.tick(), if may_extend => engine.extend_leases(),
        }
    }
}

async fn report_backlog(store: Arc<dyn OutboxStore>, every: Duration, health: Arc<Health>) {
    let mut ticker = tokio::time::interval(every);
    loop {
        ticker.tick().await;
        let attempt = health.begin(Check::Backlog);
        match store.backlog().await {
            Ok(b) => {
                attempt.succeeded();
                ::metrics::gauge!(metrics::BACKLOG).set(b.pending as f64);
                ::metrics::gauge!(metrics::RETRYING).set(b.retrying as f64);
                ::metrics::gauge!(metrics::DEAD).set(b.dead as f64);
                ::metrics::gauge!(metrics::OLDEST_AGE)
                    .set(b.oldest_pending_age.map_or(0.0, |a| a.as_secs_f64()));
            }
            Err(e) => {
                // The gauges keep their last values; the failure shows in /readyz and in
                // outbox_last_success_timestamp_seconds{check="backlog"}.
                tracing::debug!(error = %e.report(), "backlog query failed");
                attempt.failed(e.report());
            }
        }
    }
}
