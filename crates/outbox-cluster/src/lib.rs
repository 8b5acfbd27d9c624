//! Cluster coordination through the database.
//!
//! Every node registers in the nodes table and heartbeats by pushing its expiry forward;
//! live nodes delete expired rows. In ordered mode each node also keeps partition leases:
//! it computes the fair assignment from the live nodes ([`assign`]), renews the leases it
//! holds, hands over partitions assigned elsewhere once its engine has settled their work,
//! and takes the free or expired leases of partitions assigned to it. Every takeover bumps
//! the partition's fencing epoch, and the engine settles rows only under the epoch it
//! holds. See ARCHITECTURE.md for the protocol.
//!
//! A node id belongs to one process at a time: [`Coordinator::start`] refuses an id that
//! another live process heartbeats under, and a running node that finds its row rewritten by
//! another process drops its partitions and reports itself [displaced](Coordinator::displaced).

pub mod assign;
pub mod settings;

pub use settings::{ClusterSettings, DEFAULT_HEARTBEAT_INTERVAL, DEFAULT_HEARTBEAT_TIMEOUT};

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outbox_core::health::Check;
use outbox_core::migration::{CLUSTER_PROTOCOL, OLDEST_PEER_PROTOCOL};
use outbox_core::store::{
    ClaimMode, Heartbeat, Heartbeated, Incarnation, NodeRegistry, PartitionRegistry, Registration,
    Way,
};
use outbox_core::{Health, NodeId, Ownership, StoreError, StoreErrorKind};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub const CLUSTER_NODES: &str = "outbox_cluster_nodes";
pub const OWNED_PARTITIONS: &str = "outbox_owned_partitions";
pub const REBALANCES: &str = "outbox_partition_changes_total";
/// The outbox's partition count (ordered mode).
pub const PARTITIONS: &str = "outbox_partitions";
/// Partitions no node holds a valid lease on, as the partitions table says (ordered mode).
pub const UNOWNED_PARTITIONS: &str = "outbox_unowned_partitions";

#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub node: NodeId,
    /// What the operator set.
    pub settings: ClusterSettings,
    /// Where heartbeats and lease keeping report success, failure and waits.
    pub health: Arc<Health>,
}

/// Partition leases to keep, with the state the engine reads.
#[derive(Clone)]
pub struct Partitions {
    pub registry: Arc<dyn PartitionRegistry>,
    pub ownership: Arc<Ownership>,
}

/// This node's membership (and partition leases); [`Coordinator::stop`] ends them.
pub struct Coordinator {
    registry: Arc<dyn NodeRegistry>,
    partitions: Option<Partitions>,
    node: NodeId,
    stop: watch::Sender<bool>,
    /// The expiry this process last wrote; `None` once another process took the row.
    incarnation: watch::Receiver<Option<Incarnation>>,
    /// Why this node must stop, once it must (see [`Coordinator::halted`]).
    halt: watch::Receiver<Option<Halt>>,
    task: JoinHandle<()>,
}

impl Coordinator {
    /// Registers the node (failing if the database refuses), then keeps membership and
    /// leases in the background.
    ///
    /// If the node's row has not expired, it belongs to another live process or to one that
    /// died without deregistering (kill -9): this watches the row until its expiry moves (a
    /// live process: refused, [`StoreErrorKind::Config`]) or passes (taken over), so a
    /// restart under the same id waits at most the heartbeat timeout.
    pub async fn start(
        registry: Arc<dyn NodeRegistry>,
        partitions: Option<Partitions>,
        config: ClusterConfig,
    ) -> Result<Self, StoreError> {
        let claims = partitions.map_or(Claims::Elsewhere, Claims::Partitions);
        Self::start_claiming(registry, claims, config).await
    }

    /// [`Coordinator::start`] for a node that takes the outbox's events as `claims` says.
    /// Refused ([`StoreErrorKind::Config`]) where live nodes take them another way: two ways
    /// on one outbox send most events twice.
    pub async fn start_claiming(
        registry: Arc<dyn NodeRegistry>,
        claims: Claims,
        config: ClusterConfig,
    ) -> Result<Self, StoreError> {
        let modes = claims.modes();
        if let Some((modes_registry, way)) = &modes {
            wait_out_other_mode(&*registry, &**modes_registry, *way, &config).await?;
        }
        let partitions = match claims {
            Claims::Partitions(partitions) => Some(partitions),
            Claims::Unordered(_) | Claims::Capture(_) | Claims::Elsewhere => None,
        };
        let incarnation = register(&*registry, &config).await?;
        if let Some((modes_registry, way)) = &modes {
            let met = announce_then_look(&**modes_registry, *way, &config.node).await;
            if !matches!(&met, Ok(peers) if peers.is_empty()) {
                let _ = registry.deregister(config.node.clone(), incarnation).await;
                let peers = met?;
                return Err(StoreError::new(
                    StoreErrorKind::Config,
                    claim_modes_meet(*way, &peers, "refused (the nodes started together)"),
                ));
            }
        }
        tracing::info!(node = %config.node, "registered in the nodes table");
        metrics::describe_gauge!(CLUSTER_NODES, "Live nodes in the nodes table.");
        metrics::describe_gauge!(
            OWNED_PARTITIONS,
            "Partitions this node holds and may publish: leased, and the lease still valid by its own clock."
        );
        metrics::describe_counter!(
            REBALANCES,
            "Partition leases acquired, released or lost by this node."
        );
        metrics::describe_gauge!(
            PARTITIONS,
            "Partitions of the outbox (ordered mode); every one should have an owner."
        );
        metrics::describe_gauge!(
            UNOWNED_PARTITIONS,
            "Partitions without a valid lease in the partitions table (no owner, or the lease ran out): \
             their events wait until a node takes them. Brief during a hand-over; lasting, no node can take them."
        );
        let (stop, stopped) = watch::channel(false);
        let (written, incarnation_rx) = watch::channel(Some(incarnation));
        let (halt, halt_rx) = watch::channel(None);
        let task = tokio::spawn(tracing::Instrument::in_current_span(run(
            registry.clone(),
            partitions.clone(),
            config.clone(),
            stopped,
            (written, Arc::new(halt)),
            modes,
        )));
        Ok(Coordinator {
            registry,
            partitions,
            node: config.node,
            stop,
            incarnation: incarnation_rx,
            halt: halt_rx,
            task,
        })
    }

    /// Resolves once another process has heartbeated under this node's id: the coordinator
    /// has dropped every partition, and the relay must stop (the other process may hold the
    /// same partitions under the same name, so nothing this one settles is fenced off).
    pub fn displaced(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut incarnation = self.incarnation.clone();
        async move {
            if incarnation.wait_for(Option::is_none).await.is_err() {
                // The coordinator stopped without being displaced.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Whether another process took this node's row (see [`Coordinator::displaced`]).
    pub fn is_displaced(&self) -> bool {
        self.incarnation.borrow().is_none()
    }

    /// Resolves once the node must stop ([`Halt`]):
    /// - the partitions table no longer holds the count the node started with. Nodes hash
    ///   keys modulo that count, so a node that went on beside nodes started after the
    ///   change would share keys with them, publishing events twice and out of order, while
    ///   partitions past its count went unowned. A restart of every node takes the new count.
    /// - this unordered node relays the outbox beside ordered nodes (see
    ///   [`PartitionRegistry::claim_mode_peers`]); the ordered nodes go on.
    pub fn halted(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut halt = self.halt.clone();
        async move {
            if halt.wait_for(Option::is_some).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Why the node must stop, once it must (see [`Coordinator::halted`]).
    pub fn halt_reason(&self) -> Option<Halt> {
        self.halt.borrow().clone()
    }

    /// Stops heartbeating, gives up every partition the engine no longer holds rows of (call
    /// it after the engine stopped and released its rows) and removes this node's row. A displaced node touches neither:
    /// both are the other process's now. Returns by `deadline` whatever the database does:
    /// what it could not give up expires by itself.
    pub async fn stop(self, deadline: tokio::time::Instant) {
        let _ = self.stop.send(true);
        // A round stuck on a database that does not answer is abandoned, not waited for.
        let mut task = self.task;
        if tokio::time::timeout(Duration::from_secs(1), &mut task)
            .await
            .is_err()
        {
            task.abort();
        }
        let Some(incarnation) = *self.incarnation.borrow() else {
            tracing::warn!(node = %self.node, "left the nodes table and partitions to the process that took over this node id");
            return;
        };
        let limit = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(Duration::from_secs(5));
        if let Some(p) = &self.partitions {
            // A partition with a publish the engine gave up waiting for (shutdown timeout)
            // is left to expire: the broker may still take that publish, and the next owner
            // must not publish the key's later events before it.
            let (held, unsettled): (Vec<i32>, Vec<i32>) = p
                .ownership
                .held()
                .into_iter()
                .map(|(p, _)| p)
                .partition(|partition| !p.ownership.is_busy(*partition));
            if !unsettled.is_empty() {
                tracing::warn!(partitions = ?unsettled, "partitions with unconfirmed publishes are left to expire");
            }
            if !held.is_empty() {
                match tokio::time::timeout(
                    limit,
                    p.registry.release_partitions(self.node.clone(), held),
                )
                .await
                {
                    Ok(Ok(n)) => tracing::info!(partitions = n, "released partition leases"),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e.report(), "could not release partitions; their leases expire by themselves")
                    }
                    Err(_) => tracing::warn!(
                        "releasing partitions had no answer before the shutdown deadline; their leases expire by themselves"
                    ),
                }
            }
        }
        let limit = deadline
            .saturating_duration_since(tokio::time::Instant::now())
            .min(Duration::from_secs(5));
        match tokio::time::timeout(
            limit,
            self.registry.deregister(self.node.clone(), incarnation),
        )
        .await
        {
            Ok(Ok(())) => tracing::info!(node = %self.node, "deregistered"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e.report(), "could not deregister; the row expires by itself")
            }
            Err(_) => tracing::warn!(
                "deregistering had no answer before the shutdown deadline; the row expires by itself"
            ),
        }
    }
}

/// Takes the node's row, waiting out a predecessor that died without deregistering; refuses
/// an id whose row another live process keeps moving.
async fn register(
    registry: &dyn NodeRegistry,
    config: &ClusterConfig,
) -> Result<Incarnation, StoreError> {
    let node = &config.node;
    let mut first_seen = None;
    loop {
        let standing = match registry
            .register(node.clone(), config.settings.heartbeat_timeout)
            .await
        {
            Ok(Registration::Registered(incarnation)) => return Ok(incarnation),
            Ok(Registration::Taken(standing)) => standing,
            // Another process wrote the row while this statement ran (two started under one
            // id at once): look again, and the row it wrote decides as above.
            Err(e) if e.kind() == StoreErrorKind::Conflict => {
                tracing::debug!(error = %e.report(), "the node's row changed during registration; looking again");
                tokio::time::sleep(config.settings.heartbeat_interval / 4).await;
                continue;
            }
            Err(e) => return Err(e),
        };
        match first_seen {
            None => {
                tracing::warn!(
                    node = %node,
                    "node id is registered by another process, or by one that died without \
                     deregistering: waiting for its heartbeat to move (refused) or expire (taken over)"
                );
                first_seen = Some(standing);
            }
            Some(seen) if seen != standing => {
                return Err(StoreError::new(
                    StoreErrorKind::Config,
                    format!(
                        "another live process is running as node {node} (it keeps heartbeating in the nodes table); \
                         give every relay process its own --node-id (OUTBOX_RELAY_NODE_ID), or leave it unset for a generated one"
                    ),
                ));
            }
            Some(_) => {}
        }
        // A live process beats every heartbeat interval; look a few times per interval.
        tokio::time::sleep(config.settings.heartbeat_interval / 4).await;
    }
}

/// Says in the node's row how it claims the outbox's rows, then lists the live nodes that
/// claim them in another mode, in a statement of its own: of two nodes of the two kinds
/// starting together, at least one then sees the other (its look runs after the other's
/// announcement committed, or the other's look after its own). The look before the
/// registration ([`wait_out_other_mode`]) saw neither, and both relayed, most events twice.
/// (Ordered nodes of another partition count are waited for in the rounds: [`balance`].)
async fn announce_then_look(
    modes: &dyn PartitionRegistry,
    way: Way,
    node: &NodeId,
) -> Result<Vec<(String, Way)>, StoreError> {
    modes.claim_mode_peers(node.clone(), way, true).await?;
    Ok(other_modes(
        way,
        modes.claim_mode_peers(node.clone(), way, false).await?,
    ))
}

/// Of the nodes `claim_mode_peers` lists, those of another mode than `way`'s.
fn other_modes(way: Way, peers: Vec<(String, Way)>) -> Vec<(String, Way)> {
    peers
        .into_iter()
        .filter(|(_, theirs)| theirs.mode != way.mode)
        .collect()
}

/// Returns once no live node claims the outbox's rows the other way from this one
/// (`unordered` or not), and refuses ([`StoreErrorKind::Config`]) if one does. A node that
/// died without deregistering (kill -9) keeps its row until its expiry, so a node found is
/// watched as [`register`] watches a node id: its heartbeat moving refuses, its row expiring
/// lets this node start. A switch of modes after a crash then needs no second start.
async fn wait_out_other_mode(
    registry: &dyn NodeRegistry,
    modes: &dyn PartitionRegistry,
    way: Way,
    config: &ClusterConfig,
) -> Result<(), StoreError> {
    let mut first_seen: Option<BTreeMap<String, std::time::SystemTime>> = None;
    loop {
        let peers = other_modes(
            way,
            modes
                .claim_mode_peers(config.node.clone(), way, false)
                .await?,
        );
        if peers.is_empty() {
            return Ok(());
        }
        let expiries: BTreeMap<String, std::time::SystemTime> = registry
            .live_nodes()
            .await?
            .into_iter()
            .filter(|n| peers.iter().any(|(id, _)| *id == n.id))
            .map(|n| (n.id, n.expiry))
            .collect();
        match &first_seen {
            None => {
                tracing::warn!(
                    "{}",
                    claim_modes_meet(
                        way,
                        &peers,
                        "waiting for their heartbeats to move (refused) or their rows to \
                         expire (they died)"
                    )
                );
                first_seen = Some(expiries);
            }
            Some(seen) => {
                let alive: Vec<(String, Way)> = peers
                    .iter()
                    .filter(|(id, _)| {
                        let now = expiries.get(id);
                        seen.get(id)
                            .is_some_and(|was| now.is_some_and(|now| now != was))
                    })
                    .cloned()
                    .collect();
                if !alive.is_empty() {
                    return Err(StoreError::new(
                        StoreErrorKind::Config,
                        claim_modes_meet(way, &alive, "refused"),
                    ));
                }
                // Nodes that appeared since are watched from now.
                let mut seen = seen.clone();
                for (id, expiry) in expiries {
                    seen.entry(id).or_insert(expiry);
                }
                first_seen = Some(seen);
            }
        }
        // A live node beats every heartbeat interval; look a few times per interval.
        tokio::time::sleep(config.settings.heartbeat_interval / 4).await;
    }
}

/// The background task: a round of heartbeat and lease keeping every heartbeat interval
/// (sooner while a hand-over waits for the engine), until stopped or displaced.
async fn run(
    registry: Arc<dyn NodeRegistry>,
    partitions: Option<Partitions>,
    config: ClusterConfig,
    mut stopped: watch::Receiver<bool>,
    (written, halt): (
        watch::Sender<Option<Incarnation>>,
        Arc<watch::Sender<Option<Halt>>>,
    ),
    modes: Option<(Arc<dyn PartitionRegistry>, Way)>,
) {
    let first = *written.borrow();
    let mut keeper = Keeper {
        registry,
        partitions,
        config,
        wrote: Wrote::starting_with(first),
        written,
        halt,
        modes,
        meeting: Vec::new(),
        other_counts: Vec::new(),
        counted: None,
        counting: None,
        unanswered: false,
    };
    loop {
        let Membership::Held(live) = keeper.heartbeat().await else {
            return;
        };
        keeper.check_claim_modes().await;
        let handing_over = keeper.keep_partitions(live).await;
        tokio::select! {
            _ = tokio::time::sleep(keeper.pause(handing_over)) => {}
            _ = stopped.changed() => return,
        }
    }
}

/// The background task's state between rounds, with one method per step of a round.
struct Keeper {
    registry: Arc<dyn NodeRegistry>,
    partitions: Option<Partitions>,
    config: ClusterConfig,
    /// The expiry this process last wrote; `None` once another process took the row.
    written: watch::Sender<Option<Incarnation>>,
    /// The expiries it wrote before, to know its own row rolled back.
    wrote: Wrote,
    /// Why the node must stop, once it must.
    halt: Arc<watch::Sender<Option<Halt>>>,
    /// Where nodes taking the outbox's events different ways could meet: the registry, and
    /// this node's way.
    modes: Option<(Arc<dyn PartitionRegistry>, Way)>,
    /// The nodes taking the events in another mode that this node last said it relays
    /// beside.
    meeting: Vec<(String, Way)>,
    /// The ordered nodes splitting keys by another partition count, found by the round's
    /// look: this node takes no partition while they live ([`balance`]).
    other_counts: Vec<(String, Way)>,
    /// When the partitions table was last counted for the gauges, and the count running.
    counted: Option<Instant>,
    counting: Option<JoinHandle<()>>,
    /// The last heartbeat failed without an answer: it may have written the row all the same.
    unanswered: bool,
}

/// Whether this process still holds its node's row after a heartbeat.
enum Membership {
    /// It does; the live node ids, if they could be listed.
    Held(Option<Vec<String>>),
    /// Another process took the row over: every partition is dropped, and the task ends.
    Lost,
}

impl Keeper {
    /// Heartbeats, and acts on another process found heartbeating under this node's id.
    async fn heartbeat(&mut self) -> Membership {
        let Some(last) = *self.written.borrow() else {
            return Membership::Lost;
        };
        match beat(&*self.registry, &self.config, last).await {
            Beat::Live(incarnation, live) => {
                self.unanswered = false;
                self.wrote.push(incarnation);
                self.written.send_replace(Some(incarnation));
                Membership::Held(live)
            }
            Beat::Failed => {
                self.unanswered = true;
                Membership::Held(None)
            }
            Beat::Displaced(Some(shown)) if self.wrote.contains(shown) => {
                // A database restored from a backup or snapshot, or failed over to a replica
                // that lagged, shows an expiry this process wrote before: no other process
                // is in sight. Before, the relay stopped as if one were.
                tracing::warn!(
                    node = %self.config.node,
                    "the nodes table shows an earlier heartbeat of this process's (the database \
                     went back to an earlier state: restored, or failed over to a replica that \
                     lagged); heartbeating on from it"
                );
                self.written.send_replace(Some(shown));
                Membership::Held(None)
            }
            Beat::Displaced(_) if self.unanswered => {
                self.adopt_unanswered_write().await;
                Membership::Held(None)
            }
            Beat::Displaced(_) => {
                self.drop_everything();
                Membership::Lost
            }
        }
    }

    /// The expiry we do not recognise is most likely the one our unanswered heartbeat
    /// wrote (a connection lost after the commit). Take it as ours once: a second process
    /// under this id moves it again before our next beat, and that beat, answered, finds
    /// it so.
    async fn adopt_unanswered_write(&mut self) {
        self.unanswered = false;
        let config = &self.config;
        match self
            .registry
            .register(config.node.clone(), config.settings.heartbeat_timeout)
            .await
        {
            Ok(Registration::Taken(current) | Registration::Registered(current)) => {
                tracing::info!(node = %config.node, "the last heartbeat's answer was lost; its write is taken as this process's");
                self.wrote.push(current);
                self.written.send_replace(Some(current));
            }
            Err(e) => {
                self.unanswered = true;
                tracing::warn!(error = %e.report(), "heartbeat failed");
            }
        }
    }

    /// Another process heartbeats as this node: nothing this one settles is fenced off from
    /// it, so every partition goes at once.
    fn drop_everything(&mut self) {
        tracing::error!(
            node = %self.config.node,
            "another process is heartbeating as this node (the same --node-id): \
             dropping every partition and stopping; give every relay process its own --node-id"
        );
        if let Some(p) = &self.partitions {
            for (partition, _) in p.ownership.held() {
                p.ownership.remove(partition);
            }
        }
        self.written.send_replace(None);
    }

    /// Announces how this node takes the outbox's events and looks for nodes that take them
    /// another way: a node that finds one whose way ranks above its own (ordered, then
    /// capture, then unordered) stops; one that finds only lower ones says so, once per
    /// change, while they stop. A failed look waits for the next round.
    /// Ordered nodes of another partition count are kept for the round's lease keeping
    /// ([`balance`]). A failed look waits for the next round, and keeps the last one's.
    async fn check_claim_modes(&mut self) {
        let Some((registry, way)) = &self.modes else {
            return;
        };
        let node = self.config.node.clone();
        let looked = match registry.claim_mode_peers(node, *way, true).await {
            Ok(peers) => peers,
            Err(e) => {
                tracing::debug!(error = %e.report(), "could not list the nodes taking the events another way");
                return;
            }
        };
        let (peers, other_counts): (Vec<_>, Vec<_>) = looked
            .into_iter()
            .partition(|(_, theirs)| theirs.mode != way.mode);
        self.other_counts = other_counts;
        if peers.iter().any(|(_, theirs)| theirs.mode > way.mode) {
            halt_once(
                &self.halt,
                Halt::configuration(claim_modes_meet(*way, &peers, "stopping (exit 2)")),
            );
        } else if !peers.is_empty() && peers != self.meeting {
            tracing::error!(
                "{}",
                claim_modes_meet(*way, &peers, "going on: they stop at their next heartbeat")
            );
        }
        self.meeting = peers;
    }

    /// One round of lease keeping among the `live` nodes (none: they could not be listed,
    /// so the leases wait for the next round). Returns whether a hand-over is still waiting.
    async fn keep_partitions(&mut self, live: Option<Vec<String>>) -> bool {
        let Some(p) = &self.partitions else {
            return false;
        };
        let Some(live) = live else {
            // The heartbeat was answered but the live nodes could not be listed: nothing is
            // rebalanced without them, but the leases held are still renewed. Skipped, they
            // ran out by the node's own clock after a few failed listings, and its
            // partitions stopped publishing for no reason. (Not after a failed heartbeat:
            // the node's row may be expiring, and others then want its partitions.)
            if !self.unanswered {
                let attempt = self.config.health.begin(Check::Leases);
                match renew_leases(p, &self.config).await {
                    Ok(()) => attempt.succeeded(),
                    Err(e) => {
                        attempt.failed(e.report());
                    }
                }
            }
            return false;
        };
        // The count the node started with, which its claims and lanes hash keys by.
        let count = p.ownership.count();
        if !self.other_counts.is_empty() && self.behind_the_table(p, count).await {
            return false;
        }
        let handing_over = balance(p, &self.config, count, &live, &self.other_counts).await;
        self.count_unowned(count);
        handing_over
    }

    /// Whether this node, splitting keys by `count`, is the one behind the partitions
    /// table, asked when a node of another count is live: then it halts now. Which of the
    /// two is behind, only the table says; the round's count for the gauges finds it too,
    /// but this node had first told its log that it waits for the other to stop.
    async fn behind_the_table(&self, p: &Partitions, count: u32) -> bool {
        let Ok(partitions) = p.registry.partitions().await else {
            return false;
        };
        let numbers: Vec<i32> = partitions.iter().map(|p| p.partition).collect();
        match partitions_changed(count, &numbers) {
            Some(reason) => {
                halt_once(&self.halt, Halt::runtime(reason));
                true
            }
            None => false,
        }
    }

    /// Counts the partitions no node holds, for the gauges: once per heartbeat interval, not
    /// on every quick look of a hand-over, and never in the heartbeat's way (renewals and the
    /// notice of a lost lease must not wait for a slow database to answer a count); a stop
    /// does not wait for it.
    fn count_unowned(&mut self, count: u32) {
        let Some(p) = &self.partitions else {
            return;
        };
        let interval = self.config.settings.heartbeat_interval;
        let idle = self.counting.as_ref().is_none_or(|c| c.is_finished());
        if idle && self.counted.is_none_or(|at| at.elapsed() >= interval) {
            self.counted = Some(Instant::now());
            let p = p.clone();
            let halt = self.halt.clone();
            self.counting = Some(tokio::spawn(async move {
                count_unowned(&p, count, interval, &halt).await
            }));
        }
    }

    /// The wait before the next round: while a hand-over waits for the engine, look again
    /// soon.
    fn pause(&self, handing_over: bool) -> Duration {
        let interval = self.config.settings.heartbeat_interval;
        if handing_over {
            Duration::from_millis(100).min(interval)
        } else {
            interval
        }
    }
}

enum Beat {
    /// The new expiry, and the live node ids if they could be listed.
    Live(Incarnation, Option<Vec<String>>),
    Failed,
    /// The row shows an expiry other than the last one written (the one it shows, if read).
    Displaced(Option<Incarnation>),
}

/// The expiries a process wrote to its row: the latest day's at the default interval. A
/// database rolled back further shows an expiry long past; the relay stops as displaced, and
/// restarted, takes the expired row over at registration.
struct Wrote(VecDeque<Incarnation>);

impl Wrote {
    const KEPT: usize = 43_200;

    fn starting_with(first: Option<Incarnation>) -> Self {
        Wrote(first.into_iter().collect())
    }

    fn push(&mut self, expiry: Incarnation) {
        if self.0.back() == Some(&expiry) {
            return;
        }
        if self.0.len() == Self::KEPT {
            self.0.pop_front();
        }
        self.0.push_back(expiry);
    }

    fn contains(&self, expiry: Incarnation) -> bool {
        self.0.contains(&expiry)
    }
}

/// Heartbeats, removes expired nodes, and lists the live node ids.
async fn beat(registry: &dyn NodeRegistry, config: &ClusterConfig, last: Incarnation) -> Beat {
    let attempt = config.health.begin(Check::Heartbeat);
    let incarnation = match registry
        .heartbeat(Heartbeat {
            node: config.node.clone(),
            last,
            ttl: config.settings.heartbeat_timeout,
        })
        .await
    {
        Ok(Heartbeated::Pushed(incarnation)) => {
            attempt.succeeded();
            incarnation
        }
        Ok(Heartbeated::RowShows(shown)) => return Beat::Displaced(shown),
        Err(e) => {
            tracing::warn!(error = %e.report(), "heartbeat failed");
            attempt.failed(e.report());
            return Beat::Failed;
        }
    };
    match registry.remove_expired().await {
        Ok(0) => {}
        Ok(n) => tracing::info!(nodes = n, "removed expired nodes"),
        Err(e) => tracing::warn!(error = %e.report(), "could not remove expired nodes"),
    }
    match registry.live_nodes().await {
        Ok(nodes) => {
            metrics::gauge!(CLUSTER_NODES).set(nodes.len() as f64);
            let mut ids: Vec<String> = nodes.into_iter().map(|n| n.id).collect();
            if !ids.contains(&config.node.0) {
                ids.push(config.node.0.clone());
            }
            ids.sort();
            Beat::Live(incarnation, Some(ids))
        }
        Err(e) => {
            tracing::warn!(error = %e.report(), "could not list nodes");
            Beat::Live(incarnation, None)
        }
    }
}

/// The owned-partitions gauge: what the node may publish now, not what it last took, so
/// that leases it cannot renew drop out of the count when they run out by its own clock.
fn show_owned(p: &Partitions) {
    let owned = p.ownership.publishable(Instant::now()).0.len();
    metrics::gauge!(OWNED_PARTITIONS).set(owned as f64);
}

/// One round of lease keeping, reported to the health as one attempt. Returns whether a
/// hand-over is still waiting.
async fn balance(
    p: &Partitions,
    config: &ClusterConfig,
    count: u32,
    live: &[String],
    other_counts: &[(String, Way)],
) -> bool {
    let attempt = config.health.begin(Check::Leases);
    let why = match other_counts_to_wait_for(count, other_counts) {
        Some(why) => Some(why),
        None => older_nodes_to_wait_for(p, config).await,
    };
    if let Some(why) = why {
        // The leases it holds are not renewed: they lapse, by its own clock first.
        if attempt.failed(why.clone()) {
            tracing::warn!("{why}");
        }
        show_owned(p);
        return false;
    }
    let peers: Vec<String> = match p.registry.partition_peers().await {
        Ok(peers) => live
            .iter()
            .filter(|id| **id == config.node.0 || peers.contains(id))
            .cloned()
            .collect(),
        // Counting every live node instead handed partitions to relays that take none
        // (another outbox's, an unordered one): they lay unserved until given back. As
        // when the live nodes cannot be listed, the leases held are renewed, and nothing
        // moves.
        Err(e) => {
            tracing::warn!(error = %e.report(), "could not list the nodes sharing the partitions; renewing the leases held, moving none");
            match renew_leases(p, config).await {
                Ok(()) => attempt.succeeded(),
                Err(e) => {
                    attempt.failed(e.report());
                }
            }
            show_owned(p);
            return false;
        }
    };
    let (waiting, failure) = keep_leases(p, config, count, &peers).await;
    match failure {
        None => attempt.succeeded(),
        Some(e) => {
            // Said once per streak at error level when only an operator can fix it.
            if attempt.failed(e.report()) && !e.is_retryable() {
                tracing::error!(error = %e.report(), "cannot keep partition leases: this node publishes nothing until this is fixed");
            }
        }
    }
    show_owned(p);
    waiting
}

/// Why this node, splitting keys by `count` partitions, takes no partition now: live
/// ordered nodes that split them by another count. They read the partitions table before
/// it changed, and stop at their next heartbeat round, once they see it so
/// ([`partitions_changed`]); a node taking partitions beside them shared keys with them,
/// and sent events twice and out of order. (A node that is itself behind the table stops
/// in this round's count.) Its leases are not renewed meanwhile: they lapse.
fn other_counts_to_wait_for(count: u32, other_counts: &[(String, Way)]) -> Option<String> {
    if other_counts.is_empty() {
        return None;
    }
    let nodes: Vec<String> = other_counts
        .iter()
        .map(|(id, way)| match way.partitions {
            Some(theirs) => format!("{id} ({theirs} partitions)"),
            None => id.clone(),
        })
        .collect();
    Some(format!(
        "waiting for nodes that split keys by another partition count to stop before taking \
         partitions: {}; this node splits them by {count}, as the partitions table holds. \
         They stop at their next heartbeat, having seen the table change; one that does not \
         is stuck: stop it",
        nodes.join(", ")
    ))
}

/// Why this node takes no partition now: live nodes of a cluster protocol older than it
/// shares partitions with ([`OLDEST_PEER_PROTOCOL`]), which must be gone first. Announces
/// this node's protocol on the way. A failure to ask is logged and does not hold the node
/// (a database too old to answer is refused at start).
async fn older_nodes_to_wait_for(p: &Partitions, config: &ClusterConfig) -> Option<String> {
    match p
        .registry
        .nodes_behind(config.node.clone(), CLUSTER_PROTOCOL, OLDEST_PEER_PROTOCOL)
        .await
    {
        Ok(behind) if behind.is_empty() => None,
        Ok(behind) => {
            let nodes: Vec<String> = behind
                .iter()
                .map(|(id, protocol)| format!("{id} (protocol {protocol})"))
                .collect();
            Some(format!(
                "waiting for nodes of an older cluster protocol to leave before taking \
                 partitions: {}; this relay speaks protocol {CLUSTER_PROTOCOL} and shares \
                 partitions with protocol {OLDEST_PEER_PROTOCOL} or later (upgrade or stop \
                 those nodes: README, Upgrading)",
                nodes.join(", ")
            ))
        }
        Err(e) => {
            tracing::warn!(error = %e.report(), "could not read the nodes' cluster protocols");
            None
        }
    }
}

/// Sets the partition gauges from the partitions table: every node reports the whole
/// outbox's count, so the gauges do not depend on scraping every node. A lease counts as
/// valid until its expiry by this node's clock, as `stats` counts it. Waits at most `within`,
/// so that a slow answer does not hold back the next heartbeat. A table that no longer holds
/// partitions 0 to `count` less one halts the node ([`Coordinator::halted`]).
async fn count_unowned(
    p: &Partitions,
    count: u32,
    within: Duration,
    halt: &watch::Sender<Option<Halt>>,
) {
    metrics::gauge!(PARTITIONS).set(f64::from(count));
    match tokio::time::timeout(within, p.registry.partitions()).await {
        Ok(Ok(partitions)) => {
            let numbers: Vec<i32> = partitions.iter().map(|p| p.partition).collect();
            if let Some(reason) = partitions_changed(count, &numbers) {
                halt_once(halt, Halt::runtime(reason));
            }
            let now = std::time::SystemTime::now();
            // Those without a row (none, since migrate writes them all) count as unowned.
            let held = partitions
                .iter()
                .filter(|p| p.owner.is_some() && p.lease_until.is_some_and(|t| t > now))
                .count();
            let unowned = (count as usize).saturating_sub(held);
            metrics::gauge!(UNOWNED_PARTITIONS).set(unowned as f64);
        }
        // The gauge keeps its last value; a failing database shows in the health checks and
        // in the heartbeat's last success.
        Ok(Err(e)) => {
            tracing::debug!(error = %e.report(), "could not list partitions for the gauges")
        }
        Err(_) => tracing::debug!("no answer listing partitions for the gauges"),
    }
}

/// Why a node must stop, and whether the configuration is to blame (exit 2: a restart
/// alone will not do) or a restart of the node is the fix (exit 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Halt {
    pub reason: String,
    pub configuration: bool,
}

impl Halt {
    fn runtime(reason: String) -> Self {
        Halt {
            reason,
            configuration: false,
        }
    }

    fn configuration(reason: String) -> Self {
        Halt {
            reason,
            configuration: true,
        }
    }
}

/// Halts the node with `halt`, said once, unless it is halting already.
fn halt_once(sender: &watch::Sender<Option<Halt>>, halt: Halt) {
    if sender.borrow().is_none() {
        tracing::error!("{}", halt.reason);
        sender.send_replace(Some(halt));
    }
}

/// How a node takes the outbox's events, where nodes taking them different ways could meet
/// (the native PostgreSQL outbox: ordered claims lease no row, and WAL capture reads every
/// row).
pub enum Claims {
    /// Ordered: the partitions it leases.
    Partitions(Partitions),
    /// Unordered (`--ordering none`): every ready row, under row leases.
    Unordered(Arc<dyn PartitionRegistry>),
    /// WAL capture: every row, from the WAL.
    Capture(Arc<dyn PartitionRegistry>),
    /// Where the ways cannot meet (binlog capture, SQLite, mapped tables, whose one active
    /// relay holds the table's lock): nothing to check.
    Elsewhere,
}

impl Claims {
    /// The registry to look for the other ways' nodes in, and this node's way.
    fn modes(&self) -> Option<(Arc<dyn PartitionRegistry>, Way)> {
        let way = |mode, partitions| Way { mode, partitions };
        match self {
            Claims::Partitions(p) => Some((
                p.registry.clone(),
                way(ClaimMode::Ordered, Some(p.ownership.count())),
            )),
            Claims::Unordered(registry) => {
                Some((registry.clone(), way(ClaimMode::Unordered, None)))
            }
            Claims::Capture(registry) => Some((registry.clone(), way(ClaimMode::Capture, None))),
            Claims::Elsewhere => None,
        }
    }
}

/// What is wrong when this node, taking the outbox's events as `mine`, finds `peers`
/// taking them another way, and what it does (`outcome`).
fn claim_modes_meet(mine: Way, peers: &[(String, Way)], outcome: &str) -> String {
    let mine = mine.mode;
    let theirs: Vec<String> = peers
        .iter()
        .map(|(id, way)| format!("{id}, {}", way.mode.described()))
        .collect();
    format!(
        "this {} node would relay the outbox beside node(s) that take its events another way \
         ({}): each way takes rows the other takes (an ordered claim leases no row, and WAL \
         capture reads every row), so most events would go out twice; {outcome}. Run every \
         node of one outbox the same way: stop the nodes of one way before starting the other",
        mine.described(),
        theirs.join("; ")
    )
}

/// What is wrong when the partitions table, whose rows are `numbers` (in order), no longer
/// holds the `count` partitions, 0 to `count` less one, that this node started with.
fn partitions_changed(count: u32, numbers: &[i32]) -> Option<String> {
    let unchanged = numbers.len() == count as usize
        && numbers
            .iter()
            .zip(0..)
            .all(|(number, expected)| *number == expected);
    if unchanged {
        return None;
    }
    let now = match (numbers.first(), numbers.last()) {
        (Some(first), Some(last)) => {
            let missing: Vec<String> = (0..*last)
                .filter(|n| numbers.binary_search(n).is_err())
                .map(|n| n.to_string())
                .collect();
            let missing = match missing.is_empty() {
                true => String::new(),
                false => format!(", lacking {}", missing.join(", ")),
            };
            format!(
                "{} rows, numbered {first} to {last}{missing}",
                numbers.len()
            )
        }
        _ => "no rows".to_string(),
    };
    Some(format!(
        "the partitions table changed under the running relay: it now holds {now}, where this \
         node started with {count} partitions (0 to {}). Nodes split keys by the count they \
         started with, so a node going on beside nodes started after the change would share \
         keys with them, publishing events twice and out of order; stopping this node (exit 1). \
         Restart every node once the table holds the partitions wanted, numbered from 0 \
         with none missing: each reads the count again at its start. Change the count only \
         with every node stopped",
        count.saturating_sub(1)
    ))
}

/// Renews, hands over and takes leases. Returns whether a hand-over is still waiting, and the
/// first failure of the round.
/// How long this node counts a lease of `ttl` as its own: a quarter less, counted from
/// before the statement that took or renewed it.
fn lease_valid_for(ttl: Duration) -> Duration {
    ttl.mul_f64(0.75)
}

/// Renews the leases held; those the database no longer gives this node are removed.
async fn renew_leases(p: &Partitions, config: &ClusterConfig) -> Result<(), StoreError> {
    let ttl = config.settings.heartbeat_timeout;
    let started = Instant::now();
    let held = p.ownership.held();
    if held.is_empty() {
        return Ok(());
    }
    match p
        .registry
        .renew(config.node.clone(), held.clone(), ttl)
        .await
    {
        Ok(renewed) => {
            let renewed: BTreeSet<i32> = renewed.into_iter().collect();
            for (partition, epoch) in held {
                if renewed.contains(&partition) {
                    p.ownership
                        .renewed(partition, started + lease_valid_for(ttl));
                } else {
                    tracing::warn!(
                        partition,
                        epoch,
                        "lost partition lease: it ran out or another node took it"
                    );
                    metrics::counter!(REBALANCES, "change" => "lost").increment(1);
                    p.ownership.remove(partition);
                }
            }
            Ok(())
        }
        Err(e) => {
            tracing::warn!(error = %e.report(), "could not renew partition leases; publishing stops when they run out");
            Err(e)
        }
    }
}

async fn keep_leases(
    p: &Partitions,
    config: &ClusterConfig,
    count: u32,
    live: &[String],
) -> (bool, Option<StoreError>) {
    let mut failure = None;
    let ttl = config.settings.heartbeat_timeout;
    let valid_for = lease_valid_for(ttl);
    let node = &config.node;

    if let Err(e) = renew_leases(p, config).await {
        return (false, Some(e));
    }

    let assignment = assign::assign(count, live);
    let mine: BTreeSet<i32> = assignment
        .get(&node.0)
        .map(|v| v.iter().copied().collect())
        .unwrap_or_default();
    config.health.set_assigned(mine.len());
    let held: BTreeSet<i32> = p.ownership.held().into_iter().map(|(p, _)| p).collect();

    // Hand over what is assigned elsewhere, once the engine has settled its rows.
    let mut drained = Vec::new();
    let mut waiting = false;
    for &partition in held.difference(&mine) {
        p.ownership.revoke(partition);
        if p.ownership.is_busy(partition) {
            waiting = true;
        } else {
            drained.push(partition);
        }
    }
    for &partition in held.intersection(&mine) {
        p.ownership.keep(partition);
    }
    if !drained.is_empty() {
        match p
            .registry
            .release_partitions(node.clone(), drained.clone())
            .await
        {
            Ok(_) => {
                for partition in &drained {
                    p.ownership.remove(*partition);
                }
                metrics::counter!(REBALANCES, "change" => "released")
                    .increment(drained.len() as u64);
                tracing::info!(partitions = ?drained, "handed partitions over");
            }
            Err(e) => {
                tracing::warn!(error = %e.report(), "could not release partitions");
                failure = failure.or(Some(e));
            }
        }
    }

    // Take what is assigned here and free (or expired).
    let wanted: Vec<i32> = mine.difference(&held).copied().collect();
    if !wanted.is_empty() {
        let started = Instant::now();
        match p.registry.acquire(node.clone(), wanted, ttl).await {
            Ok(taken) if !taken.is_empty() => {
                for (partition, epoch) in &taken {
                    p.ownership.grant(*partition, *epoch, started + valid_for);
                }
                metrics::counter!(REBALANCES, "change" => "acquired").increment(taken.len() as u64);
                tracing::info!(partitions = ?taken.iter().map(|(p, _)| p).collect::<Vec<_>>(), "acquired partitions");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e.report(), "could not acquire partitions");
                failure = failure.or(Some(e));
            }
        }
    }
    (waiting, failure)
}

#[cfg(test)]
mod tests {
    use super::partitions_changed;

    #[test]
    fn a_partitions_table_holding_the_count_the_node_started_with_is_unchanged() {
        assert_eq!(partitions_changed(4, &[0, 1, 2, 3]), None);
    }

    #[test]
    fn partitions_added_removed_or_renumbered_under_a_running_node_halt_it() {
        let added = partitions_changed(4, &[0, 1, 2, 3, 4, 5]).unwrap();
        assert!(
            added.contains("it now holds 6 rows, numbered 0 to 5"),
            "{added}"
        );
        assert!(
            added.contains("started with 4 partitions (0 to 3)"),
            "{added}"
        );
        assert!(partitions_changed(4, &[0, 1, 2]).is_some());
        let renumbered = partitions_changed(4, &[0, 1, 2, 5]).unwrap();
        assert!(
            renumbered.contains("numbered 0 to 5, lacking 3, 4"),
            "{renumbered}"
        );
        let emptied = partitions_changed(4, &[]).unwrap();
        assert!(emptied.contains("it now holds no rows"), "{emptied}");
    }
}
