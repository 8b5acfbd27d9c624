//! /healthz, /readyz and /metrics, with the admin API and the dashboard (`admin.rs`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_core::health::{Check, DEFAULT_STALL};
use outbox_core::{Health, OutboxStore, Publisher};

#[derive(Clone)]
struct AppState {
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    metrics: PrometheusHandle,
    health: Arc<Health>,
}

/// Binds `addr` and serves until the returned task is aborted. Returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    metrics: PrometheusHandle,
    health: Arc<Health>,
    console: Arc<crate::admin::Console>,
) -> anyhow::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("cannot listen on {addr}: choose another --http-addr (127.0.0.1:0 picks a free port, an empty value turns it off)")
    })?;
    let bound = listener.local_addr()?;
    let app = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(AppState {
            store,
            publisher,
            metrics,
            health,
        })
        .merge(crate::admin::routes(console.clone()));
    let task = tokio::spawn(async move {
        tokio::select! {
            served = axum::serve(listener, app) => {
                if let Err(e) = served {
                    tracing::error!(error = %e, "HTTP server failed");
                }
            }
            () = crate::admin::keep_history(console) => {}
        }
    });
    Ok((bound, task))
}

async fn readyz(State(state): State<AppState>) -> (StatusCode, String) {
    let limit = Duration::from_secs(3);
    let db = match tokio::time::timeout(limit, state.store.ping()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!("database: {}", e.report())),
        Err(_) => Err("database: no answer within 3s".into()),
    };
    let sink = match tokio::time::timeout(limit, state.publisher.health()).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(format!(
            "sink {}: {}",
            state.publisher.describe(),
            e.report()
        )),
        Err(_) => Err(format!(
            "sink {}: no answer within 3s",
            state.publisher.describe()
        )),
    };
    // What the node's own work says: a ping can pass while claims, settles or lease renewals
    // fail (a revoked privilege) or hang.
    let troubles = state
        .health
        .troubles(std::time::Instant::now(), DEFAULT_STALL)
        .into_iter()
        .map(|t| t.to_string());
    let reasons: Vec<String> = [db.err(), sink.err()]
        .into_iter()
        .flatten()
        .chain(troubles)
        .collect();
    if reasons.is_empty() {
        (StatusCode::OK, "ready\n".into())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {}\n", reasons.join("; ")),
        )
    }
}

/// Gauges computed at scrape time, so they are true even while the tasks that would update
/// them wait on a database that does not answer.
fn refresh_health_gauges(health: &Health) {
    let now = std::time::Instant::now();
    for check in Check::ALL {
        if let Some(at) = health.last_success(check) {
            let unix = at
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64();
            metrics::gauge!(outbox_engine::metrics::LAST_SUCCESS, "check" => check.name())
                .set(unix);
        }
    }
    if let Some(owned) = health.owned_partitions(now) {
        metrics::gauge!(outbox_cluster::OWNED_PARTITIONS).set(owned as f64);
    }
    metrics::gauge!(outbox_engine::metrics::TROUBLES)
        .set(health.troubles(now, DEFAULT_STALL).len() as f64);
}

async fn metrics_text(State(state): State<AppState>) -> String {
    refresh_health_gauges(&state.health);
    state.metrics.render()
}

/// How long a problem lasts before it is logged at error level: transient failures (a
/// deadlock, a restart) are retried and logged as warnings, and only what persists is news.
const REPORT_AFTER: Duration = Duration::from_secs(5);

/// Logs every problem `/readyz` would report once it has lasted [`REPORT_AFTER`] (error
/// level, with what to do), and again when it clears. Runs until aborted.
pub async fn watch_health(health: Arc<Health>) {
    let mut first_seen: std::collections::HashMap<&'static str, (std::time::Instant, bool)> =
        std::collections::HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    loop {
        ticker.tick().await;
        let now = std::time::Instant::now();
        let troubles = health.troubles(now, DEFAULT_STALL);
        for t in &troubles {
            let (since, logged) = first_seen
                .entry(t.what)
                .or_insert((now.checked_sub(t.lasting).unwrap_or(now), false));
            if !*logged && now.saturating_duration_since(*since) >= REPORT_AFTER {
                *logged = true;
                tracing::error!(check = t.what, problem = %t.detail, "relay unhealthy: /readyz reports 503 until this clears");
            }
        }
        first_seen.retain(|what, (_, logged)| {
            let still = troubles.iter().any(|t| t.what == *what);
            if !still && *logged {
                tracing::info!(check = *what, "recovered");
            }
            still
        });
    }
}
