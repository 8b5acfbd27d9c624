//! Many outboxes in one process (`[[outboxes]]`).
//!
//! Each outbox runs on a tokio runtime of its own, on threads of its own: a database that
//! hangs a driver call, or a sink that keeps an outbox busy, holds up only that outbox's
//! threads. The runtime's threads carry the outbox's name (`recorder::label_thread`), for
//! the `outbox` label of every metric recorded on them. The one HTTP server
//! (`http::serve_outboxes`) hands each outbox's requests to its runtime for the same reason.

use std::process::ExitCode;
use std::sync::Arc;

use metrics_exporter_prometheus::PrometheusHandle;

use crate::config::{Config, NamedOutbox};
use crate::error::{config_error, is_config_error};
use crate::http::OutboxSlot;
use crate::recorder::label_thread;
use crate::relay::{relay_outbox, Place};

/// `run` with `[[outboxes]]`: every outbox on its own runtime, one HTTP server for all.
///
/// SIGTERM or SIGINT stops them all. Without `--drain`, an outbox that stops by itself (a
/// fatal error, or its node row taken over) stops the others too, and the process exits
/// with its error: a process that relays only some of its outboxes would look alive while
/// the rest waits. With `--drain`, each outbox drains on its own, and the process exits 0
/// only when every one of them did.
pub async fn run(
    config: Config,
    outboxes: Vec<NamedOutbox>,
    drain: bool,
    metrics: PrometheusHandle,
) -> anyhow::Result<ExitCode> {
    let (http_addr, token) = config.http.listen()?;
    let hosts = crate::http::AllowedHosts::new(config.http.allowed_host_names()?);
    // One backstop for the process, by the longest shutdown_timeout of its outboxes.
    let shutdown_timeout = outboxes
        .iter()
        .map(|o| o.config.engine.shutdown_timeout)
        .max()
        .unwrap_or_default();
    let node = config
        .relay
        .node_id
        .clone()
        .unwrap_or_else(crate::relay::default_node_id);
    let slots: Vec<Arc<OutboxSlot>> = outboxes
        .iter()
        .map(|o| OutboxSlot::new(o.name.clone()))
        .collect();
    let http = match http_addr {
        Some(addr) => {
            let (bound, task) =
                crate::http::serve_outboxes(addr, slots.clone(), metrics.clone(), token, hosts)
                    .await?;
            tracing::info!(
                addr = %bound,
                outboxes = %slots.iter().map(|s| s.name.as_str()).collect::<Vec<_>>().join(","),
                "HTTP endpoints: /healthz /readyz /metrics, and each outbox's dashboard and /api/v1/ under /outboxes/NAME/"
            );
            Some(task)
        }
        None => None,
    };
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut running = Vec::new();
    for (outbox, slot) in outboxes.into_iter().zip(slots) {
        let name = outbox.name.clone();
        let slot = http_addr.is_some().then_some(slot);
        let ended = start(
            outbox,
            node.clone(),
            drain,
            metrics.clone(),
            slot,
            stopping.clone(),
        )?;
        running.push((name, ended));
    }
    let mut results: Vec<(String, anyhow::Result<()>)> = Vec::new();
    let mut pending: futures::stream::FuturesUnordered<_> = running
        .into_iter()
        .map(|(name, ended)| async move {
            let result = ended
                .await
                .unwrap_or_else(|_| Err(anyhow::anyhow!("its thread ended without a result")));
            (name, result)
        })
        .collect();
    let stop_all = || {
        let _ = stop.send(true);
        crate::shutdown::backstop(shutdown_timeout);
    };
    let signal = crate::shutdown::signal();
    tokio::pin!(signal);
    use futures::StreamExt;
    loop {
        tokio::select! {
            () = &mut signal, if !*stop.borrow() => stop_all(),
            next = pending.next() => {
                let Some((name, result)) = next else { break };
                if !drain && !*stop.borrow() {
                    match &result {
                        Ok(()) => tracing::error!(outbox = %name, "outbox stopped by itself; stopping the others"),
                        Err(e) => tracing::error!(outbox = %name, error = %format!("{e:#}"), "outbox failed; stopping the others"),
                    }
                    stop_all();
                }
                results.push((name, result));
            }
        }
    }
    if let Some(http) = http {
        http.abort();
    }
    let failures: Vec<(String, anyhow::Error)> = results
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|e| (name, e)))
        .collect();
    if failures.is_empty() {
        Ok(ExitCode::SUCCESS)
    } else {
        Err(failed(failures))
    }
}

/// The failures of several outboxes as one error, each named: a configuration error (exit
/// 2) if any of them is one.
pub fn failed(failures: Vec<(String, anyhow::Error)>) -> anyhow::Error {
    let config = failures.iter().any(|(_, e)| is_config_error(e));
    let message = failures
        .iter()
        .map(|(name, e)| format!("outbox {name}: {e:#}"))
        .collect::<Vec<_>>()
        .join("\n");
    if config {
        config_error(message)
    } else {
        anyhow::anyhow!(message)
    }
}

/// Starts one outbox on a runtime of its own; the receiver gets its result.
fn start(
    outbox: NamedOutbox,
    node: String,
    drain: bool,
    metrics: PrometheusHandle,
    slot: Option<Arc<OutboxSlot>>,
    mut stopping: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::sync::oneshot::Receiver<anyhow::Result<()>>> {
    let NamedOutbox { name, mut config } = outbox;
    config.relay.node_id = Some(node);
    let label: Arc<str> = Arc::from(name.as_str());
    let (done, ended) = tokio::sync::oneshot::channel();
    let thread_label = label.clone();
    std::thread::Builder::new()
        .name(format!("outbox-{name}"))
        .spawn(move || {
            let worker_label = thread_label.clone();
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(config.relay.worker_threads)
                .thread_name(format!("outbox-{name}"))
                .on_thread_start(move || label_thread(worker_label.clone()))
                .enable_all()
                .build();
            let runtime = match runtime {
                Ok(runtime) => runtime,
                Err(e) => {
                    let _ = done.send(Err(anyhow::anyhow!("cannot start its runtime: {e}")));
                    return;
                }
            };
            label_thread(thread_label);
            let stop = async move {
                let _ = stopping.wait_for(|stop| *stop).await;
            };
            let span = tracing::info_span!("outbox", outbox = %name);
            let place = Place::Among(slot);
            let result = crate::block_on_a_worker(
                &runtime,
                tracing::Instrument::instrument(
                    relay_outbox(config, drain, metrics, place, stop),
                    span,
                ),
            )
            .and_then(|outcome| outcome);
            // The result first: a blocking task that outlives the relay (a file sink's
            // write, a SQLite call) must not hold it up.
            let _ = done.send(result);
            runtime.shutdown_timeout(std::time::Duration::from_secs(1));
        })
        .map_err(|e| anyhow::anyhow!("cannot start a thread for outbox {label}: {e}"))?;
    Ok(ended)
}
