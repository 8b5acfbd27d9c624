//! The subcommands.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use outbox_cluster::{Coordinator, Partitions};
use outbox_core::redact::redact_url;
use outbox_core::{NewEvent, NodeId, Ownership, Publisher};
use outbox_engine::{DrainEnd, Summary};
use outbox_publishers::{RouteConfig, SinkConfig};

use crate::cli::{MigrateArgs, SendArgs};
use crate::config::{Config, RunParts};
use crate::store::{AnyStore, StoreSettings};

/// A failure only the operator's configuration can fix: the binary exits 2 for it.
#[derive(Debug)]
pub struct ConfigError(pub String);

impl std::fmt::Display for ConfigError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ConfigError {}

/// A store error as the binary reports it: exit 2 when only the configuration can fix it.
pub(crate) fn failure(message: String, e: &outbox_core::StoreError) -> anyhow::Error {
    // A schema older or newer than the relay runs on is fixed by `migrate` or an upgrade,
    // never by retrying: exit 2 too.
    if matches!(
        e.kind(),
        outbox_core::StoreErrorKind::Config | outbox_core::StoreErrorKind::SchemaVersion
    ) {
        anyhow::Error::new(ConfigError(message))
    } else {
        anyhow::anyhow!(message)
    }
}

pub(crate) fn default_node_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "relay".into());
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}", &suffix[..8])
}

fn install_metrics() -> anyhow::Result<PrometheusHandle> {
    let latency = [
        0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let sizes = [
        1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0,
    ];
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(
            Matcher::Full(outbox_engine::metrics::COMMIT_TO_CONFIRM.into()),
            &latency,
        )?
        .set_buckets_for_metric(Matcher::Suffix("_batch_size".into()), &sizes)?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(crate::outboxes::OutboxLabel(recorder))
        .map_err(|e| anyhow::anyhow!("installing the metrics recorder: {e}"))?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut ticker = tokio::time::interval(Duration::from_secs(5));
        loop {
            ticker.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}

/// Resolves on SIGTERM or SIGINT.
pub(crate) async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; only Ctrl-C stops the relay");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
    }
}

/// Opens the store and makes sure its tables exist (creating them when allowed). With
/// `wait`, transient failures (the database is down or restarting) are retried until they
/// pass; problems only an operator can fix fail at once, with the fix.
pub(crate) async fn ready_store(
    config: &Config,
    settings: StoreSettings,
    create: bool,
    wait: bool,
) -> anyhow::Result<AnyStore> {
    let mut store = AnyStore::open(settings)?;
    store.keep_legacy_slot().await;
    let problems = retry_transient("checking the database", wait, || {
        prepare_store(&store, create)
    })
    .await
    .map_err(|e| {
        let message = format!(
            "cannot use {}: {}",
            redact_url(&config.database.database_url),
            e.report()
        );
        failure(message, &e)
    })?;
    let mut fatal = Vec::new();
    for p in problems {
        if p.is_degraded() {
            tracing::warn!(problem = %p.what, fix = %p.fix, "continuing despite a problem");
        } else {
            fatal.push(format!("{} (fix: {})", p.what, p.fix));
        }
    }
    if !fatal.is_empty() {
        bail!("the database is not ready:\n  - {}", fatal.join("\n  - "));
    }
    Ok(store)
}

/// Runs `op`; with `wait`, transient failures (the database is down, restarting, or killed
/// our connection) are retried with backoff until they pass. Other failures return at once.
async fn retry_transient<T, F, Fut>(
    what: &str,
    wait: bool,
    mut op: F,
) -> Result<T, outbox_core::StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, outbox_core::StoreError>>,
{
    let mut backoff = outbox_core::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) if wait && e.is_retryable() => {
                let retry_in = backoff.next_delay();
                tracing::warn!(error = %e.report(), ?retry_in, "{what}: waiting for the database");
                tokio::time::sleep(retry_in).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn prepare_store(
    store: &AnyStore,
    create: bool,
) -> Result<Vec<outbox_core::store::Problem>, outbox_core::StoreError> {
    let outbox = store.outbox();
    outbox.ping().await?;
    if create || store.creates_tables_implicitly() {
        store.migrate().await?;
    }
    for (verdict, line) in store.schema_versions().await? {
        // Only a schema newer than this relay is news at every start.
        if matches!(
            verdict,
            outbox_core::migration::Verdict::NewerReadable { .. }
        ) {
            tracing::info!("{line}");
        } else {
            tracing::debug!("{line}");
        }
    }
    store.verify().await
}

async fn publisher(
    sinks: &std::collections::BTreeMap<String, SinkConfig>,
    routes: &[RouteConfig],
    layout: outbox_layout::LayoutKind,
) -> anyhow::Result<Arc<dyn Publisher>> {
    outbox_publishers::build_router(sinks, routes, layout.default_target())
        .await
        .map_err(|e| {
            let message = redact_url(&e.report());
            if e.kind().is_config() {
                anyhow::Error::new(ConfigError(message))
            } else {
                anyhow::anyhow!(message)
            }
        })
}

pub async fn run(config: Config, drain: bool) -> anyhow::Result<ExitCode> {
    let metrics = install_metrics()?;
    relay_outbox(config, drain, metrics, Place::Alone, shutdown_signal()).await?;
    Ok(ExitCode::SUCCESS)
}

/// `run` with `[[outboxes]]`: see `outboxes::run`.
pub async fn run_outboxes(
    config: Config,
    outboxes: Vec<crate::config::NamedOutbox>,
    drain: bool,
) -> anyhow::Result<ExitCode> {
    let metrics = install_metrics()?;
    crate::outboxes::run(config, outboxes, drain, metrics).await
}

/// Where an outbox runs.
pub(crate) enum Place {
    /// The process's only outbox: its own HTTP server (`http_addr`) and shutdown backstop.
    Alone,
    /// One of `[[outboxes]]`: its endpoints in its `slot` of the shared server (none when
    /// HTTP is off); the process keeps the one backstop.
    Among(Option<Arc<crate::http::OutboxSlot>>),
}

/// Where an outbox's HTTP endpoints are served.
enum Endpoints {
    /// A server of its own, at `http_addr`.
    Own(std::net::SocketAddr),
    /// Its slot on the shared server of `[[outboxes]]`.
    Shared(Arc<crate::http::OutboxSlot>),
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
    stop: impl std::future::Future<Output = ()> + Send,
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
    } = config.resolve(node.clone(), drain)?;
    // Where this outbox's endpoints go: a server of its own only when alone.
    let endpoints = match place {
        Place::Alone => http_addr.map(Endpoints::Own),
        Place::Among(slot) => slot.map(Endpoints::Shared),
    };
    let ready = ready_store(&config, store, config.database.auto_migrate, !drain);
    let Some(store) = unless_stopped(&mut stop, ready).await else {
        return stopped_while_starting(drain, None).await;
    };
    let store = store?;
    let capture = match &store {
        AnyStore::PostgresWal(pg, capture) => {
            let labels = engine.shared.labels.clone();
            Some(start_capture(&config, pg, capture, &node, drain, labels))
        }
        _ => None,
    };
    let outbox: Arc<dyn outbox_core::OutboxStore> = match &capture {
        Some(wal) => Arc::new(wal.clone()),
        None => store.outbox(),
    };
    let Some(sink) = unless_stopped(
        &mut stop,
        publisher(&sinks, &routes, config.database.layout),
    )
    .await
    else {
        return stopped_while_starting(drain, capture.as_ref()).await;
    };
    let sink = sink?;
    let otel = crate::otel::Otel::from_env(
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
        "outbox-relay starting"
    );
    let console = endpoints.is_some().then(|| {
        Arc::new(crate::admin::Console {
            store: store.clone(),
            describe: outbox.describe(),
            node: node.0.clone(),
            settings: crate::admin::redacted_settings(&config),
            token: admin_token,
            metrics: metrics.clone(),
            history: Default::default(),
            figures: crate::admin::StoreFigures::new(engine.backlog_interval),
            outbox: match &endpoints {
                Some(Endpoints::Shared(slot)) => Some(slot.name.clone()),
                _ => None,
            },
        })
    });
    let probes = crate::http::Probes {
        store: outbox.clone(),
        publisher: sink.clone(),
        health: health.clone(),
    };
    let http = match (console, endpoints) {
        (Some(console), Some(Endpoints::Shared(slot))) => {
            slot.fill(crate::http::Served {
                probes,
                console: crate::admin::routes(
                    console.clone(),
                    &format!("/outboxes/{}/", slot.name),
                ),
                runtime: tokio::runtime::Handle::current(),
            });
            Some(tokio::spawn(crate::admin::keep_history(console)))
        }
        (Some(console), Some(Endpoints::Own(addr))) => {
            let (bound, task) = crate::http::serve(
                addr,
                probes,
                metrics,
                console,
                crate::http::AllowedHosts::new(allowed_hosts),
            )
            .await?;
            tracing::info!(
                addr = %bound,
                "HTTP endpoints: /healthz /readyz /metrics /api/v1/ and the dashboard at /"
            );
            Some(task)
        }
        _ => None,
    };
    // Ordered PostgreSQL nodes keep partition leases; SQLite is single-node, and unordered
    // nodes share every row through SKIP LOCKED.
    let partitions = match (store.partition_registry(), engine.ordered) {
        (Some(registry), true) => {
            let count = retry_transient("reading the partition count", !drain, || {
                registry.partition_count()
            });
            let Some(count) = unless_stopped(&mut stop, count).await else {
                return stopped_while_starting(drain, capture.as_ref()).await;
            };
            let count = count
                .map_err(|e| anyhow::anyhow!("cannot read the partitions table: {}", e.report()))?;
            if count == 0 {
                bail!("the partitions table is empty: run `outbox-relay migrate`");
            }
            Some(Partitions {
                registry,
                ownership: Ownership::new(count),
            })
        }
        _ => None,
    };
    engine.shared.ownership = partitions.as_ref().map(|p| p.ownership.clone());
    if let Some(ownership) = &engine.shared.ownership {
        health.watch_ownership(ownership.clone());
    }
    let registered = retry_transient("registering in the nodes table", !drain, || {
        Coordinator::start(store.registry(), partitions.clone(), cluster.clone())
    });
    let Some(coordinator) = unless_stopped(&mut stop, registered).await else {
        return stopped_while_starting(drain, capture.as_ref()).await;
    };
    let coordinator = coordinator.map_err(|e| {
        let message = format!("cannot register in the nodes table: {}", e.report());
        failure(message, &e)
    })?;

    let monitor = tokio::spawn(tracing::Instrument::in_current_span(
        crate::http::watch_health(health),
    ));
    let displaced = coordinator.displaced();
    let shutdown_timeout = engine.settings.shutdown_timeout;
    let stopping_since = Arc::new(std::sync::OnceLock::new());
    let stop = {
        let stopping_since = stopping_since.clone();
        async move {
            tokio::select! {
                () = stop => {}
                () = displaced => {}
            }
            let _ = stopping_since.set(tokio::time::Instant::now());
            if backstop {
                shutdown_backstop(shutdown_timeout);
            }
        }
    };
    let mut result = outbox_engine::run(outbox, sink, engine, stop).await;
    if let (Ok(summary), Some(wal)) = (&mut result, &capture) {
        // Rows the slot's first run could not adopt as events were dead-lettered outside the
        // engine: a drain must not call itself clean over them.
        summary.dead_lettered += wal.dead_lettered_by_capture();
    }
    let displaced = coordinator.is_displaced();
    // The engine has released its rows; now the partitions and the node row go, by the same
    // deadline as the rest of the shutdown.
    let deadline = match stopping_since.get() {
        Some(since) => *since + shutdown_timeout,
        None => tokio::time::Instant::now() + shutdown_timeout,
    };
    coordinator.stop(deadline).await;
    if let Some(wal) = capture {
        // The last confirmation goes to the server before the slot is let go.
        wal.close(
            deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .max(Duration::from_secs(1)),
        )
        .await;
    }
    if let Some(otel) = otel {
        // The spans of the shutdown's settles are in the queue: send them, within what is
        // left of the shutdown's budget (at least a second, at most five).
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        otel.shutdown(left.clamp(Duration::from_secs(1), Duration::from_secs(5)))
            .await;
    }
    monitor.abort();
    if let Some(http) = http {
        http.abort();
    }
    let summary = result.map_err(|e| anyhow::anyhow!("relay stopped: {}", e.report()))?;
    if displaced {
        return Err(anyhow::Error::new(ConfigError(
            "relay stopped: another process started with the same node id took over this node's \
             row in the nodes table; give every relay process its own --node-id \
             (OUTBOX_RELAY_NODE_ID), or leave it unset for a generated one"
                .into(),
        )));
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

/// `work`, unless `stop` resolves first (`None`, logged): start-up steps that wait for a
/// database or a broker give way to a shutdown.
async fn unless_stopped<T>(
    stop: &mut (impl std::future::Future<Output = ()> + Unpin),
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        value = work => Some(value),
        () = stop => {
            tracing::info!("stopped while starting: nothing was relayed yet");
            None
        }
    }
}

/// A stop before the relay started: the WAL capture, if started, lets go of its slot; a
/// drain that never began is no success.
async fn stopped_while_starting(
    drain: bool,
    capture: Option<&outbox_wal::WalStore>,
) -> anyhow::Result<()> {
    if let Some(wal) = capture {
        wal.close(Duration::from_secs(1)).await;
    }
    if drain {
        bail!("drain incomplete: stopped before it began, nothing was relayed");
    }
    Ok(())
}

/// Starts the replication reader of `--capture wal`.
fn start_capture(
    config: &Config,
    pg: &outbox_store_postgres::PgStore,
    capture: &crate::store::Capture,
    node: &NodeId,
    drain: bool,
    labels: Arc<outbox_core::metric_labels::DestinationLabels>,
) -> outbox_wal::WalStore {
    let (table, columns) = capture.source_table(pg);
    let mut wal = outbox_wal::WalConfig::new(
        config.database.database_url.clone(),
        capture.slot.clone(),
        capture.publication.as_str(),
        table,
    );
    wal.columns = columns;
    // Beside a mapped table, the native outbox is captured too: `dead retry` and `send`
    // write there.
    wal.native_outbox = capture.source.is_some().then(|| pg.tables().outbox.clone());
    // The emit function writes for the native outbox, whatever table is captured.
    wal.message_prefix = outbox_wal::emit_prefix(&pg.tables().outbox);
    wal.application_name = format!("outbox-relay {node}");
    wal.read_ahead = config.engine.max_in_flight.max(1024);
    wal.memory_budget = config.wal.memory_budget();
    outbox_wal::WalStore::start(
        pg.clone(),
        outbox_wal::WalStoreOptions {
            wal,
            publication: capture.publication.clone(),
            drain,
            labels,
        },
    )
}

/// `health`: asks the running relay's HTTP server for /healthz (or /readyz): exit 0 on 200,
/// 1 otherwise, printing what it answered. A wildcard listen address is asked on loopback.
pub async fn health(config: Config, ready: bool) -> anyhow::Result<ExitCode> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Some(mut addr) = config.http.socket_addr()? else {
        return Err(anyhow::Error::new(ConfigError(
            "health asks the relay's HTTP server, which is off (http_addr is empty): set \
             http_addr, or check the process some other way"
                .into(),
        )));
    };
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let path = if ready { "/readyz" } else { "/healthz" };
    let ask = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&response).into_owned())
    };
    let response = match tokio::time::timeout(Duration::from_secs(5), ask).await {
        Ok(Ok(response)) => response,
        Ok(Err(e)) => {
            bail!("http://{addr}{path}: {e} (is the relay running, with http_addr {addr}?)")
        }
        Err(_) => bail!("http://{addr}{path}: no answer within 5s"),
    };
    let status = response.split_whitespace().nth(1).unwrap_or_default();
    let body = response.split("\r\n\r\n").nth(1).unwrap_or_default().trim();
    if status == "200" {
        println!("{body}");
        Ok(ExitCode::SUCCESS)
    } else {
        bail!("http://{addr}{path} answered {status}: {body}")
    }
}

/// `drop-slot`: drops the replication slot of `--capture wal`.
pub async fn drop_slot(config: Config) -> anyhow::Result<ExitCode> {
    let mut store = AnyStore::open(config.store_settings()?)?;
    store.keep_legacy_slot().await;
    let AnyStore::PostgresWal(pg, capture) = &store else {
        return Err(anyhow::Error::new(ConfigError(
            "drop-slot drops the replication slot of WAL capture: add --capture wal (with \
             --slot if it is not the default)"
                .into(),
        )));
    };
    let wal = outbox_wal::WalConfig::new(
        config.database.database_url.clone(),
        capture.slot.clone(),
        capture.publication.as_str(),
        pg.tables().outbox.clone(),
    );
    // What it held back, said once it is gone (read before: a dropped slot shows nothing).
    let held = outbox_wal::slot_status(pg, &capture.slot)
        .await
        .ok()
        .flatten()
        .map(|s| s.holds_back());
    // Forgotten first: should the drop then fail, the worst is a slot that adopts the
    // table's rows once more (duplicates), never one that skips them.
    if let Err(e) = outbox_wal::forget_adoption(pg, &capture.publication, &capture.slot).await {
        bail!(
            "cannot forget that the slot {} adopted the outbox's rows, so it is not dropped: {}",
            capture.slot,
            e.report()
        );
    }
    match outbox_wal::drop_slot(&wal).await {
        Ok(true) => match held {
            Some(held) => println!(
                "dropped the replication slot {}, which held back {held}",
                capture.slot
            ),
            None => println!("dropped the replication slot {}", capture.slot),
        },
        Ok(false) => println!("there is no replication slot {}", capture.slot),
        Err(e) => bail!("cannot drop the replication slot {}: {e}", capture.slot),
    }
    Ok(ExitCode::SUCCESS)
}

/// How long past `shutdown_timeout` the process may linger (a thread blocked in a driver,
/// say) before it is ended anyway.
const SHUTDOWN_BACKSTOP_GRACE: Duration = Duration::from_secs(2);

/// Every step of the shutdown is bounded by `shutdown_timeout`; should something block a
/// thread regardless, this ends the process (exit 1) shortly after, saying so.
pub(crate) fn shutdown_backstop(shutdown_timeout: Duration) {
    let spawned = std::thread::Builder::new()
        .name("shutdown-backstop".into())
        .spawn(move || {
            std::thread::sleep(shutdown_timeout + SHUTDOWN_BACKSTOP_GRACE);
            tracing::error!(
                shutdown_timeout = ?shutdown_timeout,
                "shutdown did not finish in time; exiting anyway (rows still leased come back when their leases run out)"
            );
            eprintln!("error: shutdown did not finish within {shutdown_timeout:?}; exiting anyway");
            std::process::exit(1);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start the shutdown backstop");
    }
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
    } else {
        String::new()
    };
    match &summary.drain {
        Some(DrainEnd::Clean { arrived }) if summary.dead_lettered == 0 => {
            if *arrived > 0 {
                tracing::info!(
                    events = arrived,
                    "drained; events inserted during the drain are left for the next run"
                );
            }
            Ok(())
        }
        Some(DrainEnd::Clean { .. }) => {
            bail!("drain incomplete: {dead}the rest was delivered{last_error}")
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
        None => bail!("drain incomplete: {dead}the drain did not finish{last_error}"),
    }
}

pub async fn migrate(config: Config, args: MigrateArgs) -> anyhow::Result<ExitCode> {
    let mut store = AnyStore::open(config.store_settings()?)?;
    store.keep_legacy_slot().await;
    if args.print {
        outbox_core::ident::Ident::new(&args.role, "role name")
            .map_err(|e| anyhow::Error::new(ConfigError(format!("--role: {}", e.report()))))?;
        println!("{}", store.printable_ddl(&args.role).await);
        return Ok(ExitCode::SUCCESS);
    }
    store
        .migrate()
        .await
        .map_err(|e| failure(format!("migration failed: {}", e.report()), &e))?;
    println!("migrated: {}", store.outbox().describe());
    // What a migration cannot do itself (a server setting, a role attribute) is said now,
    // not at the first `run`. The migration did apply, so this is no failure; and it is
    // checked as the role that migrated, which may not be the one the relay runs as.
    match store.verify().await {
        Ok(problems) if problems.is_empty() => {}
        Ok(problems) => {
            let blocked = problems.iter().any(|p| !p.is_degraded());
            let verdict = if blocked {
                "not ready to run yet"
            } else {
                "ready to run"
            };
            println!("{verdict}; what `check` finds, as this role:");
            print_problems(&problems);
        }
        Err(e) => println!("could not check the result (run `check`): {}", e.report()),
    }
    Ok(ExitCode::SUCCESS)
}

/// Each problem `verify` found, with its fix, as `check` and `migrate` print them.
fn print_problems(problems: &[outbox_core::store::Problem]) {
    for p in problems {
        let label = if p.fails_check() {
            "problem"
        } else {
            "warning"
        };
        println!("{label}: {}\n    fix: {}", p.what, p.fix);
    }
}

pub async fn check(config: Config) -> anyhow::Result<ExitCode> {
    let mut failed = false;
    // The HTTP settings (the admin token among them) are checked as `run` checks them.
    config.http.listen()?;
    println!("ok: configuration is valid ({config:?})");
    let mut store = AnyStore::open(config.store_settings()?)?;
    store.keep_legacy_slot().await;
    let outbox = store.outbox();
    match outbox.ping().await {
        Ok(()) => println!(
            "ok: connected to {}",
            redact_url(&config.database.database_url)
        ),
        Err(e) => {
            println!(
                "problem: cannot connect to {}: {}",
                redact_url(&config.database.database_url),
                e.report()
            );
            return Ok(ExitCode::FAILURE);
        }
    }
    match store.schema_versions().await {
        Ok(lines) => lines.iter().for_each(|(_, l)| println!("ok: {l}")),
        Err(e) => {
            failed = true;
            println!("problem: {}", e.report());
        }
    }
    match store.verify().await {
        Ok(problems) if problems.is_empty() => println!("ok: tables, trigger and privileges"),
        Ok(problems) => {
            failed |= problems.iter().any(|p| p.fails_check());
            print_problems(&problems);
        }
        Err(e) => {
            failed = true;
            println!("problem: {}", e.report());
        }
    }
    let (sinks, routes) = config.sink_setup();
    match publisher(&sinks, &routes, config.database.layout).await {
        Ok(sink) => match sink.health().await {
            Ok(()) => println!("ok: sink {} is reachable", sink.describe()),
            Err(e) => {
                failed = true;
                println!("problem: sink {}: {}", sink.describe(), e.report());
            }
        },
        Err(e) => {
            failed = true;
            println!("problem: {e:#}");
        }
    }
    Ok(if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

pub async fn send(config: Config, args: SendArgs) -> anyhow::Result<ExitCode> {
    if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&args.payload) {
        bail!(
            "the payload is not valid JSON ({e}); quote text as JSON, e.g. '\"hello\"', or send an object like '{{\"id\": 1}}'"
        );
    }
    let store = ready_store(&config, config.store_settings()?, false, false).await?;
    let event = NewEvent {
        event_id: args.event_id,
        destination: args.destination,
        partition_key: args.key,
        event_type: args.event_type,
        payload: Some(args.payload),
        headers: args.headers.into_iter().collect(),
        mutation_id: args.mutation_id,
    };
    let ids = store
        .outbox()
        .insert(vec![event])
        .await
        .map_err(|e| anyhow::anyhow!("insert failed: {}", e.report()))?;
    println!("inserted event with sequence_id {}", ids[0]);
    Ok(ExitCode::SUCCESS)
}

/// The backlog in total and per destination, as `stats` and the admin API show it: with WAL
/// capture, what waits in the parked table is pending too (dead letters counted once).
pub(crate) async fn backlog_report(
    store: &AnyStore,
) -> Result<
    (
        outbox_core::store::Backlog,
        Vec<outbox_core::store::DestinationStats>,
    ),
    outbox_core::StoreError,
> {
    let mut backlog = store.outbox().backlog().await?;
    let mut destinations = store.operations().destination_stats().await?;
    if let AnyStore::PostgresWal(pg, capture) = store {
        for parked in capture.parked_stats(pg).await? {
            match destinations
                .iter_mut()
                .find(|d| d.destination == parked.destination)
            {
                Some(d) => {
                    d.pending += parked.pending;
                    d.retrying += parked.retrying;
                    d.oldest_pending_age = d.oldest_pending_age.max(parked.oldest_pending_age);
                }
                None => {
                    destinations.push(outbox_core::store::DestinationStats { dead: 0, ..parked })
                }
            }
        }
        backlog.pending = destinations.iter().map(|d| d.pending).sum();
        backlog.retrying = destinations.iter().map(|d| d.retrying).sum();
        backlog.oldest_pending_age = destinations
            .iter()
            .filter_map(|d| d.oldest_pending_age)
            .max();
    }
    Ok((backlog, destinations))
}

/// `stats`: backlog, live nodes and partition owners.
pub async fn stats(config: Config, json: bool) -> anyhow::Result<ExitCode> {
    let store = ready_store(&config, config.store_settings()?, false, false).await?;
    let report = |e: outbox_core::StoreError| anyhow::anyhow!(e.report());
    let (backlog, destinations) = backlog_report(&store).await.map_err(report)?;
    let mut slot = None;
    if let AnyStore::PostgresWal(pg, capture) = &store {
        let status = outbox_wal::slot_status(pg, &capture.slot)
            .await
            .map_err(report)?;
        slot = Some((capture.slot.clone(), status));
    }
    let nodes = store.registry().live_nodes().await.map_err(report)?;
    let partitions = match store.partition_registry() {
        Some(r) => r.partitions().await.map_err(report)?,
        None => Vec::new(),
    };
    let now = std::time::SystemTime::now();
    let owned_by = |id: &str| -> Vec<i32> {
        partitions
            .iter()
            .filter(|p| p.owner.as_deref() == Some(id) && p.lease_until.is_some_and(|t| t > now))
            .map(|p| p.partition)
            .collect()
    };
    let unowned: Vec<i32> = partitions
        .iter()
        .filter(|p| p.owner.is_none() || p.lease_until.is_none_or(|t| t <= now))
        .map(|p| p.partition)
        .collect();
    if json {
        let value = serde_json::json!({
            "outbox": store.outbox().describe(),
            "backlog": {
                "pending": backlog.pending,
                "retrying": backlog.retrying,
                "dead": backlog.dead,
                "oldest_pending_age_seconds": backlog.oldest_pending_age.map(|d| d.as_secs_f64()),
            },
            "destinations": destinations.iter().map(|d| serde_json::json!({
                "destination": d.destination,
                "pending": d.pending,
                "retrying": d.retrying,
                "dead": d.dead,
                "oldest_pending_age_seconds": d.oldest_pending_age.map(|a| a.as_secs_f64()),
            })).collect::<Vec<_>>(),
            "nodes": nodes.iter().map(|n| serde_json::json!({
                "id": n.id,
                "expiry": humantime::format_rfc3339_millis(n.expiry).to_string(),
                "partitions": owned_by(&n.id),
            })).collect::<Vec<_>>(),
            "partitions": partitions.len(),
            "unowned_partitions": unowned,
            "slot": slot.as_ref().map(|(name, status)| serde_json::json!({
                "name": name,
                "exists": status.is_some(),
                "active": status.as_ref().map(|s| s.active),
                "wal_status": status.as_ref().and_then(|s| s.wal_status.clone()),
                "retained_bytes": status.as_ref().and_then(|s| s.retained_bytes),
                "lag_bytes": status.as_ref().and_then(|s| s.lag_bytes),
            })),
        });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    let age = backlog
        .oldest_pending_age
        .map(|d| {
            format!(
                ", oldest {}",
                humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
            )
        })
        .unwrap_or_default();
    println!(
        "{}: {} pending{age}, {} retrying, {} dead",
        store.outbox().describe(),
        backlog.pending,
        backlog.retrying,
        backlog.dead
    );
    if !destinations.is_empty() {
        println!(
            "  {:<32} {:>9} {:>9} {:>7}  oldest pending",
            "destination", "pending", "retrying", "dead"
        );
        for d in &destinations {
            let oldest = d
                .oldest_pending_age
                .map(|a| humantime::format_duration(Duration::from_secs(a.as_secs())).to_string())
                .unwrap_or_else(|| "-".into());
            println!(
                "  {:<32} {:>9} {:>9} {:>7}  {oldest}",
                // Untrusted text: no forged row, no escape sequence to the terminal.
                outbox_core::redact::escape_controls(&d.destination),
                d.pending,
                d.retrying,
                d.dead
            );
        }
    }
    if let Some((name, status)) = &slot {
        let mib = |b: Option<i64>| b.map_or("-".into(), |b| format!("{} MiB", b / (1024 * 1024)));
        match status {
            Some(s) => println!(
                "replication slot {name}: {}, wal_status {}, retains {}, lag {}",
                if s.active {
                    "streaming"
                } else {
                    "no relay streams from it"
                },
                s.wal_status.as_deref().unwrap_or("-"),
                mib(s.retained_bytes),
                mib(s.lag_bytes)
            ),
            None => println!(
                "replication slot {name}: not created yet (the relay's first run creates it)"
            ),
        }
    }
    println!("nodes ({} live):", nodes.len());
    for n in &nodes {
        let left = n.expiry.duration_since(now).unwrap_or_default();
        let owned = owned_by(&n.id);
        let owned_text = if partitions.is_empty() {
            String::new()
        } else {
            format!("  partitions {} ({})", ranges(&owned), owned.len())
        };
        println!(
            "  {}  heartbeat due within {}{owned_text}",
            outbox_core::redact::escape_controls(&n.id),
            humantime::format_duration(Duration::from_secs(left.as_secs()))
        );
    }
    if !partitions.is_empty() {
        println!(
            "unowned partitions: {}",
            if unowned.is_empty() {
                "none".to_string()
            } else {
                ranges(&unowned)
            }
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `0-3,7,9-10` for a sorted list.
fn ranges(values: &[i32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < values.len() {
        let start = values[i];
        let mut end = start;
        while i + 1 < values.len() && values[i + 1] == end + 1 {
            i += 1;
            end = values[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    if out.is_empty() {
        "none".into()
    } else {
        out.join(",")
    }
}
