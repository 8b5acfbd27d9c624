//! One outbox from start to stop: [`start`] brings up its store, capture, sink, endpoints
//! and cluster membership, the engine relays ([`Running::relay`]), and [`Running::stop`]
//! lets go of the rest by the shutdown's one deadline.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::bail;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_binlog::BinlogStore;
use outbox_cluster::{Claims, Coordinator, Halt, Partitions};
use outbox_core::redact::redact_url;
use outbox_core::store::{PartitionRegistry, StoreResult};
use outbox_core::{NodeId, OutboxStore, Ownership, Publisher};
use outbox_engine::{DrainEnd, EngineConfig, Summary};
use outbox_publishers::{RouteConfig, SinkConfig};
use outbox_wal::WalStore;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::admin::Console;
use crate::config::{Config, RunParts};
use crate::error::{config_error, failure};
use crate::http::{OutboxSlot, Probes};
use crate::otel::Otel;
use crate::store::{ready_store, retry_transient_telling, AnyStore, BinlogRun, CaptureRun};
use outbox_core::health::{Check, Health};

/// Where an outbox runs.
pub(crate) enum Place {
    /// The process's only outbox: its own HTTP server (`http_addr`) and shutdown backstop.
    Alone,
    /// One of `[[outboxes]]`: its endpoints in its `slot` of the shared server (none when
    /// HTTP is off); the process keeps the one backstop.
    Among(Option<Arc<OutboxSlot>>),
}

/// Where an outbox's HTTP endpoints are served.
enum Endpoints {
    /// A server of its own, at `http_addr`.
    Own(std::net::SocketAddr),
    /// Its slot on the shared server of `[[outboxes]]`.
    Shared(Arc<OutboxSlot>),
}

/// A node id for a relay given none: the host's name, and a random suffix that keeps two
/// processes on one host apart. The name comes from uname(2): the packaged unit's
/// `ProcSubset=pid` hides `/proc/sys`, where every node was then named `relay-…`.
pub(crate) fn default_node_id() -> String {
    let host = rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .trim()
        .to_string();
    // A node id fits 64 characters (the MySQL stores' column): the host's name is cut to
    // leave room for the suffix.
    let host: String = match host
        .chars()
        .take(crate::config::MAX_NODE_ID_CHARS - 9)
        .collect::<String>()
    {
        cut if cut.is_empty() => "relay".into(),
        cut => cut,
    };
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}", &suffix[..8])
}

/// One outbox from start to stop: its store, capture, sinks, cluster membership and engine,
/// until `stop` resolves (or, with `drain`, until nothing deliverable is left). Its HTTP
/// endpoints are a server of its own (`http_addr`), or its `slot` on the shared server of
/// `[[outboxes]]`.
pub(crate) async fn relay_outbox(
    mut config: Config,
    drain: bool,
    metrics: PrometheusHandle,
    place: Place,
    stop: impl Future<Output = ()> + Send,
) -> anyhow::Result<()> {
    let backstop = matches!(place, Place::Alone);
    // Heeded from the start: a relay still waiting for its database stops on SIGTERM too.
    let mut stop = Box::pin(stop);
    // Chosen before the store opens: its sessions carry it in their application_name.
    let node = NodeId(
        config
            .relay
            .node_id
            .get_or_insert_with(default_node_id)
            .clone(),
    );
    let parts = config.resolve(node.clone(), drain)?;
    // Kept out here: a stop while starting must let go of a capture's slot.
    let mut capture = None;
    let starting = start(&config, parts, node, drain, metrics, place, &mut capture);
    let Some(running) = unless_stopped(&mut stop, starting).await else {
        return stopped_while_starting(drain, capture.as_ref()).await;
    };
    let running = running?;
    let (result, deadline) = running.relay(stop, backstop).await;
    let ended = running.stop(deadline).await;
    let summary = result.map_err(|e| anyhow::anyhow!("relay stopped: {}", e.report()))?;
    match ended {
        Ended::Displaced => {
            return Err(config_error(
                "relay stopped: another process started with the same node id took over this \
                 node's row in the nodes table; give every relay process its own --node-id \
                 (OUTBOX_RELAY_NODE_ID), or leave it unset for a generated one"
                    .into(),
            ))
        }
        Ended::Halted(halt) if halt.configuration => {
            return Err(config_error(format!("relay stopped: {}", halt.reason)))
        }
        // Exit 1: a service manager's restart is the fix (it reads the new count).
        Ended::Halted(halt) => bail!("relay stopped: {}", halt.reason),
        Ended::Stopped => {}
    }
    tracing::info!(
        published = summary.published,
        retried = summary.retried,
        dead_lettered = summary.dead_lettered,
        "outbox-relay stopped"
    );
    if drain {
        drain_verdict(&summary)?;
    }
    Ok(())
}

/// An outbox that has started: what its engine relays with, and what it holds besides.
pub(crate) struct Running {
    engine: EngineConfig,
    outbox: Arc<dyn OutboxStore>,
    sink: Arc<dyn Publisher>,
    coordinator: Coordinator,
    capture: Option<StartedCapture>,
    otel: Option<Otel>,
    /// Logs what the health checks find.
    monitor: JoinHandle<()>,
    /// Follows a mapped table's active-relay lock ([`AnyStore::keep_active`]).
    active_keeper: Option<JoinHandle<()>>,
    /// The HTTP server of its own, or the console's history on the shared one.
    http: Option<JoinHandle<()>>,
}

/// Brings up one outbox. The steps that wait for the database retry transient failures
/// (unless draining); [`relay_outbox`] gives the whole way to a stop. The capture, once
/// started, is also left in `started_capture`.
async fn start(
    config: &Config,
    parts: RunParts,
    node: NodeId,
    drain: bool,
    metrics: PrometheusHandle,
    place: Place,
    started_capture: &mut Option<StartedCapture>,
) -> anyhow::Result<Running> {
    let RunParts {
        store,
        mut engine,
        cluster,
        sinks,
        routes,
        http_addr,
        admin_token,
        allowed_hosts,
        health,
    } = parts;
    // Where this outbox's endpoints go: a server of its own only when alone.
    let endpoints = match place {
        Place::Alone => http_addr.map(Endpoints::Own),
        Place::Among(slot) => slot.map(Endpoints::Shared),
    };
    let database_url = &config.database.database_url;
    let store = ready_store(database_url, store, config.database.auto_migrate, !drain).await?;
    let capture = match &store {
        AnyStore::PostgresWal(pg, capture) => Some(StartedCapture::Wal(capture.start(
            pg,
            CaptureRun {
                database_url: database_url.clone(),
                node: node.clone(),
                read_ahead: config.engine.max_in_flight.max(1024),
                memory_budget: config.wal.memory_budget(),
                max_in_flight: config.engine.max_in_flight,
                drain,
                labels: engine.shared.labels.clone(),
            },
        ))),
        AnyStore::MySqlBinlog(main, capture) => {
            let mib = (config.database.binlog_memory_mib).unwrap_or(outbox_wal::DEFAULT_MEMORY_MIB);
            let run = BinlogRun {
                node: node.clone(),
                memory_budget: usize::try_from(mib.saturating_mul(1024 * 1024))
                    .unwrap_or(usize::MAX),
                max_in_flight: config.engine.max_in_flight,
                drain,
            };
            let started = capture.start(main, run).await.map_err(|e| {
                let message = format!("cannot start binlog capture: {}", e.report());
                failure(message, &e)
            })?;
            Some(StartedCapture::Binlog(started))
        }
        _ => None,
    };
    started_capture.clone_from(&capture);
    let outbox: Arc<dyn OutboxStore> = match &capture {
        Some(capture) => capture.outbox(),
        None => store.outbox(),
    };
    let sink = build_sink(&sinks, &routes, config.database.layout).await?;
    let otel = Otel::from_env(
        &node.0,
        &config.database.layout_tables().outbox_table,
        engine.settings.batch_size,
    )
    .map_err(anyhow::Error::new)?;
    engine.shared.telemetry = otel.as_ref().map(|o| o.telemetry());
    tracing::info!(
        node = %node,
        store = %outbox.describe(),
        sink = %sink.describe(),
        mode = config.wake_description(),
        poll_interval = ?config.engine.poll_interval,
        drain,
        // The runtime's own count, not the setting's: what runs the relay.
        worker_threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "outbox-relay starting"
    );
    // What /readyz looks at, and the health watcher too (with or without an HTTP server).
    let probes = Probes::new(outbox.clone(), sink.clone(), health.clone());
    let http = match endpoints {
        Some(endpoints) => {
            let console = Arc::new(Console {
                store: store.clone(),
                describe: outbox.describe(),
                node: node.0.clone(),
                settings: crate::admin::redacted_settings(config),
                token: admin_token,
                metrics: metrics.clone(),
                history: Default::default(),
                figures: crate::admin::StoreFigures::new(engine.settings.backlog_interval),
                outbox: endpoints.outbox_name(),
                replay: Default::default(),
            });
            Some(
                endpoints
                    .serve(console, probes.clone(), metrics, allowed_hosts)
                    .await?,
            )
        }
        None => None,
    };
    // Ordered PostgreSQL nodes keep partition leases; SQLite is single-node, and unordered
    // nodes share every row through SKIP LOCKED.
    let partitions = match (store.partition_registry(), engine.ordered) {
        (Some(registry), true) => Some(partitions(registry, drain, &health).await?),
        _ => None,
    };
    engine.shared.ownership = partitions.as_ref().map(|p| p.ownership.clone());
    if let Some(ownership) = &engine.shared.ownership {
        health.watch_ownership(ownership.clone());
    }
    // One active relay per mapped table: the engine follows its lock as one partition, so
    // that a relay whose lock's session ended publishes nothing beside the one that took
    // the table over. Not for a drain: it takes the lock with its claims, and ends on what
    // they find (behind another active relay, on its patience).
    // Started once the node is registered: a start that fails before leaves no task
    // holding the table's lock.
    let active_keeper = match (&engine.shared.ownership, drain) {
        (None, false) => {
            let ownership = Ownership::new(1);
            store
                .keep_active(ownership.clone(), engine.settings.lease, health.clone())
                .inspect(|_| engine.shared.ownership = Some(ownership))
        }
        _ => None,
    };
    let told = Some((&health, Check::Heartbeat));
    // The native PostgreSQL outbox, where nodes can take its events three ways: each node
    // is checked against the others' ways.
    let claims = || match (&partitions, &store) {
        (Some(partitions), _) => Claims::Partitions(partitions.clone()),
        (None, AnyStore::Postgres(pg)) => Claims::Unordered(Arc::new(pg.clone())),
        (None, AnyStore::PostgresWal(pg, _)) => Claims::Capture(Arc::new(pg.clone())),
        (None, _) => Claims::Elsewhere,
    };
    let coordinator =
        retry_transient_telling("registering in the nodes table", !drain, told, || {
            Coordinator::start_claiming(store.registry(), claims(), cluster.clone())
        })
        .await
        .map_err(|e| {
            let message = format!("cannot register in the nodes table: {}", e.report());
            failure(message, &e)
        })?;
    let active_keeper =
        active_keeper.map(|keeper| tokio::spawn(tracing::Instrument::in_current_span(keeper)));
    let monitor = tokio::spawn(tracing::Instrument::in_current_span(
        crate::http::watch_health(probes),
    ));
    Ok(Running {
        engine,
        outbox,
        sink,
        coordinator,
        capture,
        otel,
        monitor,
        active_keeper,
        http,
    })
}

impl Running {
    /// Relays until `stop` resolves or another process takes over this node's row (with a
    /// drain: until nothing deliverable is left). Returns the engine's result, and when the
    /// shutdown that follows must be over.
    async fn relay(
        &self,
        stop: impl Future<Output = ()> + Send,
        backstop: bool,
    ) -> (StoreResult<Summary>, Instant) {
        let displaced = self.coordinator.displaced();
        let halted = self.coordinator.halted();
        let shutdown_timeout = self.engine.settings.shutdown_timeout;
        let stopping_since = Arc::new(OnceLock::new());
        let stop = {
            let stopping_since = stopping_since.clone();
            async move {
                tokio::select! {
                    () = stop => {}
                    () = displaced => {}
                    () = halted => {}
                }
                let _ = stopping_since.set(Instant::now());
                if backstop {
                    crate::shutdown::backstop(shutdown_timeout);
                }
            }
        };
        let engine = self.engine.clone();
        let mut result =
            outbox_engine::run(self.outbox.clone(), self.sink.clone(), engine, stop).await;
        // Rows the capture dead-lettered outside the engine (the slot's first run could not
        // adopt them as events, or the binlog capture parked undecodable rows dead): a drain
        // must not call itself clean over them.
        if let (Ok(summary), Some(capture)) = (&mut result, &self.capture) {
            summary.dead_lettered += match capture {
                StartedCapture::Wal(wal) => wal.dead_lettered_by_capture(),
                StartedCapture::Binlog(binlog) => binlog.dead_lettered_by_capture(),
            };
            // A standby's drain read nothing of the stream: its count of rows left would say
            // only "leased by another node".
            if let Some(DrainEnd::Left(_)) = &summary.drain {
                let standby = match capture {
                    StartedCapture::Wal(wal) => (wal.status()
                        == outbox_wal::CaptureStatus::Standby)
                        .then(|| "another relay streams from this outbox's slot".to_string()),
                    StartedCapture::Binlog(binlog) => match binlog.status() {
                        outbox_binlog::CaptureStatus::Standby { holder } => Some(format!(
                            "another relay ({holder}) reads this outbox's binary log"
                        )),
                        _ => None,
                    },
                };
                if let Some(standby) = standby {
                    summary.drain = Some(DrainEnd::Unvouched(format!(
                        "{standby}, so this drain read none of it; stop that relay to drain \
                         here, or leave the draining to it"
                    )));
                }
            }
            // Nor over rows of the table the slot's stream will never bring.
            if let (Some(DrainEnd::Clean { .. }), StartedCapture::Wal(wal)) =
                (&summary.drain, capture)
            {
                let problems = wal.drain_problems().await;
                if !problems.is_empty() {
                    let why = problems
                        .iter()
                        .map(outbox_core::store::Problem::to_string)
                        .collect::<Vec<_>>()
                        .join("; ");
                    summary.drain = Some(DrainEnd::Unvouched(why));
                }
            }
        }
        // A drain that ended by itself has its whole budget still to come.
        let since = stopping_since.get().copied().unwrap_or_else(Instant::now);
        (result, since + shutdown_timeout)
    }

    /// Once the engine has released its rows: lets go of the partitions, the node row, the
    /// slot and the queued spans by `deadline`, and stops serving. Says why the coordinator
    /// ended the run, if it did.
    async fn stop(self, deadline: Instant) -> Ended {
        let ended = match (
            self.coordinator.is_displaced(),
            self.coordinator.halt_reason(),
        ) {
            (true, _) => Ended::Displaced,
            (false, Some(reason)) => Ended::Halted(reason),
            (false, None) => Ended::Stopped,
        };
        self.coordinator.stop(deadline).await;
        if let Some(capture) = self.capture {
            // The last confirmation (or stored position) goes to the server before the slot
            // (or seat) is let go.
            capture
                .close(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_secs(1)),
                )
                .await;
        }
        if let Some(otel) = self.otel {
            // The spans of the shutdown's settles are in the queue: send them, within what is
            // left of the shutdown's budget (at least a second, at most five).
            let left = deadline.saturating_duration_since(Instant::now());
            otel.shutdown(left.clamp(Duration::from_secs(1), Duration::from_secs(5)))
                .await;
        }
        self.monitor.abort();
        if let Some(keeper) = self.active_keeper {
            keeper.abort();
        }
        if let Some(http) = self.http {
            http.abort();
        }
        ended
    }
}

/// How a run ended, as far as the node's membership goes.
enum Ended {
    /// Stopped as asked (a signal, a drain done, the engine's own error).
    Stopped,
    /// Another process took over this node's row (exit 2).
    Displaced,
    /// The node had to stop ([`Coordinator::halted`]): exit 2 if the configuration is to
    /// blame, else 1.
    Halted(Halt),
}

impl Endpoints {
    /// The outbox's name on the shared server (its console reads only its own series).
    fn outbox_name(&self) -> Option<String> {
        match self {
            Endpoints::Shared(slot) => Some(slot.name.clone()),
            Endpoints::Own(_) => None,
        }
    }

    /// Serves the probes and the console: the task that serves them, or that keeps the
    /// console's history when the shared server serves them.
    async fn serve(
        self,
        console: Arc<Console>,
        probes: Probes,
        metrics: PrometheusHandle,
        allowed_hosts: Vec<String>,
    ) -> anyhow::Result<JoinHandle<()>> {
        match self {
            Endpoints::Shared(slot) => {
                slot.fill(crate::http::Served {
                    probes,
                    console: crate::admin::routes(
                        console.clone(),
                        &format!("/outboxes/{}/", slot.name),
                    ),
                    runtime: tokio::runtime::Handle::current(),
                });
                Ok(tokio::spawn(crate::admin::keep_history(console)))
            }
            Endpoints::Own(addr) => {
                let hosts = crate::http::AllowedHosts::new(allowed_hosts);
                let (bound, task) =
                    crate::http::serve(addr, probes, metrics, console, hosts).await?;
                tracing::info!(
                    addr = %bound,
                    "HTTP endpoints: /healthz /readyz /metrics /api/v1/ and the dashboard at /"
                );
                Ok(task)
            }
        }
    }
}

/// The partitions an ordered node leases, as many as the partitions table holds.
async fn partitions(
    registry: Arc<dyn PartitionRegistry>,
    drain: bool,
    health: &Arc<Health>,
) -> anyhow::Result<Partitions> {
    let told = Some((health, Check::Leases));
    let count = retry_transient_telling("reading the partition count", !drain, told, || {
        registry.partition_count()
    })
    .await
    .map_err(|e| match e.kind() {
        outbox_core::StoreErrorKind::Config => config_error(e.report()),
        _ => anyhow::anyhow!("cannot read the partitions table: {}", e.report()),
    })?;
    if count == 0 {
        bail!("the partitions table is empty: run `outbox-relay migrate`");
    }
    Ok(Partitions {
        registry,
        ownership: Ownership::new(count),
    })
}

/// The configured sinks behind the router; errors only the configuration can fix exit 2.
pub(crate) async fn build_sink(
    sinks: &BTreeMap<String, SinkConfig>,
    routes: &[RouteConfig],
    layout: outbox_layout::LayoutKind,
) -> anyhow::Result<Arc<dyn Publisher>> {
    outbox_publishers::build_router(sinks, routes, layout.default_target())
        .await
        .map_err(|e| {
            let message = redact_url(&e.report());
            if e.kind().is_config() {
                config_error(message)
            } else {
                anyhow::anyhow!(message)
            }
        })
}

/// `work`, unless `stop` resolves first (`None`, logged): start-up steps that wait for a
/// database or a broker give way to a shutdown.
async fn unless_stopped<T>(
    stop: &mut (impl Future<Output = ()> + Unpin),
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        value = work => Some(value),
        () = stop => {
            tracing::info!("stopped while starting: nothing was relayed yet");
            None
        }
    }
}

/// A capture's store, once started: the engine claims from it, and the stop closes it.
#[derive(Clone)]
pub(crate) enum StartedCapture {
    Wal(WalStore),
    Binlog(BinlogStore),
}

impl StartedCapture {
    fn outbox(&self) -> Arc<dyn OutboxStore> {
        match self {
            StartedCapture::Wal(wal) => Arc::new(wal.clone()),
            StartedCapture::Binlog(binlog) => Arc::new(binlog.clone()),
        }
    }

    async fn close(&self, wait: Duration) {
        match self {
            StartedCapture::Wal(wal) => wal.close(wait).await,
            StartedCapture::Binlog(binlog) => binlog.close(wait).await,
        }
    }
}

/// A stop before the relay started: a capture, if started, lets go of its slot or seat; a
/// drain that never began is no success.
async fn stopped_while_starting(
    drain: bool,
    capture: Option<&StartedCapture>,
) -> anyhow::Result<()> {
    if let Some(capture) = capture {
        capture.close(Duration::from_secs(1)).await;
    }
    if drain {
        bail!("drain incomplete: stopped before it began, nothing was relayed");
    }
    Ok(())
}

/// `run --drain`'s exit: success only when nothing it could have delivered is left.
///
/// - exit 0: every pending event was delivered (events inserted after the drain began may be
///   left for the next run) and none was dead-lettered;
/// - exit 1: events were dead-lettered, or are left waiting to retry, or stayed pending
///   past the drain's patience (leased by a node that is still alive, or scheduled for
///   later), or the backlog could not be read.
fn drain_verdict(summary: &Summary) -> anyhow::Result<()> {
    let last_error = summary
        .last_failure
        .as_deref()
        .map(|e| format!("; last error: {e}"))
        .unwrap_or_default();
    let dead = if summary.dead_lettered > 0 {
        format!(
            "{} events were dead-lettered (see `outbox-relay dead list`); ",
            summary.dead_lettered
        )
    } else if summary.dead_letters_unconfirmed > 0 {
        format!(
            "{} dead letters were written with no confirmation (the database's answer was \
             lost, or another node's fence refused them; see `outbox-relay dead list`); ",
            summary.dead_letters_unconfirmed
        )
    } else {
        String::new()
    };
    let none_dead = summary.dead_lettered == 0 && summary.dead_letters_unconfirmed == 0;
    match &summary.drain {
        Some(DrainEnd::Clean { arrived }) if none_dead => {
            if *arrived > 0 {
                tracing::info!(
                    events = arrived,
                    "drained; events inserted during the drain are left for the next run"
                );
            }
            Ok(())
        }
        Some(DrainEnd::Clean { .. }) => {
            // With nothing published, "the rest was delivered" said so of nothing.
            let rest = match summary.published {
                0 => "nothing else was left",
                _ => "the rest was delivered",
            };
            bail!("drain incomplete: {dead}{rest}{last_error}")
        }
        Some(DrainEnd::Left(left)) => {
            let waiting = left.pending - left.retrying;
            bail!(
                "drain incomplete: {dead}{} events left undelivered: {} waiting to retry after \
                 failing, {waiting} more pending (behind a failed event of their key, leased by \
                 another node, or scheduled for later){last_error}; see `outbox-relay stats`, \
                 fix the cause and run the drain again",
                left.pending,
                left.retrying
            )
        }
        Some(DrainEnd::Unknown(e)) => {
            bail!("drain incomplete: {dead}cannot tell what is left in the outbox: {e}")
        }
        Some(DrainEnd::Unvouched(why)) => bail!("drain incomplete: {dead}{why}"),
        None => bail!("drain incomplete: {dead}the drain did not finish{last_error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dead letters the store wrote fewer of than asked (a lost answer, or a fence) may be
    /// dead: the drain does not vouch for the outbox.
    #[test]
    fn a_drain_with_unconfirmed_dead_letters_is_incomplete() {
        let clean = Summary {
            drain: Some(DrainEnd::Clean { arrived: 0 }),
            ..Summary::default()
        };
        assert!(drain_verdict(&clean).is_ok());
        let unconfirmed = Summary {
            dead_letters_unconfirmed: 1,
            ..clean
        };
        let said = drain_verdict(&unconfirmed).unwrap_err().to_string();
        assert!(said.contains("with no confirmation"), "{said}");
    }
}
