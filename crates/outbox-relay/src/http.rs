//! /healthz, /readyz and /metrics.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use outbox_core::{OutboxStore, Publisher};

#[derive(Clone)]
struct AppState {
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    metrics: PrometheusHandle,
}

/// Binds `addr` and serves until the returned task is aborted. Returns the bound address
/// (useful with port 0).
pub async fn serve(
    addr: SocketAddr,
    store: Arc<dyn OutboxStore>,
    publisher: Arc<dyn Publisher>,
    metrics: PrometheusHandle,
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
        });
    let task = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP server failed");
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
    match (db, sink) {
        (Ok(()), Ok(())) => (StatusCode::OK, "ready\n".into()),
        (db, sink) => {
            let reasons: Vec<String> = [db.err(), sink.err()].into_iter().flatten().collect();
            (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {}\n", reasons.join("; ")),
            )
        }
    }
}

async fn metrics_text(State(state): State<AppState>) -> String {
    state.metrics.render()
}
