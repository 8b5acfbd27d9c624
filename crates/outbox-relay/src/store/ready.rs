//! A store made ready to run on: reachable, its schema current, its problems said.

use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use outbox_core::health::{Check, Health};
use outbox_core::redact::redact_url;

use super::{AnyStore, StoreSettings};
use crate::error::failure;

/// Opens the store and makes sure its tables exist (creating them when allowed). With
/// `wait`, transient failures (the database is down or restarting) are retried until they
/// pass; problems only an operator can fix fail at once, with the fix.
pub async fn ready_store(
    database_url: &str,
    settings: StoreSettings,
    create: bool,
    wait: bool,
) -> anyhow::Result<AnyStore> {
    let mut store = AnyStore::open(settings)?;
    // Decided once the database answers: a guess made while it was down could start a
    // second slot beside the one a relay started meanwhile streams from.
    let legacy =
        retry_transient("checking the database", wait, || store.legacy_slot_in_use()).await;
    // Not known, nothing is guessed: the store could not be used anyway.
    let keep = legacy.map_err(|e| {
        let message = format!("cannot use {}: {}", redact_url(database_url), e.report());
        failure(message, &e)
    })?;
    store.use_legacy_slot(keep);
    let (problems, unmigrated) = retry_transient("checking the database", wait, || {
        prepare_store(&store, create)
    })
    .await
    .map_err(|e| {
        let message = format!("cannot use {}: {}", redact_url(database_url), e.report());
        failure(message, &e)
    })?;
    let mut fatal = Vec::new();
    for p in problems {
        if p.is_degraded() {
            tracing::warn!(problem = %p.what, fix = %p.fix, "continuing despite a problem");
        } else {
            fatal.push(p.to_string());
        }
    }
    if !fatal.is_empty() {
        // One line: the error is printed with its control characters escaped, and line
        // breaks came out as a literal `\n`.
        let message = format!("the database is not ready: {}", fatal.join("; "));
        // Never migrated: `migrate` is the fix, not a restart (exit 2, as for a schema
        // older than the relay; systemd does not restart on it).
        if unmigrated {
            return Err(crate::error::config_error(message));
        }
        bail!(message);
    }
    Ok(store)
}

/// Runs `op`; with `wait`, transient failures (the database is down, restarting, or killed
/// our connection) are retried with backoff until they pass. Other failures return at once.
pub async fn retry_transient<T, F, Fut>(
    what: &str,
    wait: bool,
    op: F,
) -> Result<T, outbox_core::StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, outbox_core::StoreError>>,
{
    retry_transient_telling(what, wait, None, op).await
}

/// [`retry_transient`] that fails `health`'s `check` while it retries (a start whose
/// `/readyz` already answers: it said ready while nothing was relayed, the start looping on
/// a read-only role or a connection limit).
pub async fn retry_transient_telling<T, F, Fut>(
    what: &str,
    wait: bool,
    health: Option<(&Arc<Health>, Check)>,
    mut op: F,
) -> Result<T, outbox_core::StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, outbox_core::StoreError>>,
{
    let mut backoff = outbox_core::Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    let failing = health.map(|(health, check)| health.failing(check));
    loop {
        match op().await {
            Ok(value) => return Ok(value),
            Err(e) if wait && e.is_retryable() => {
                let retry_in = backoff.next_delay();
                let report = e.report();
                if let Some(failing) = &failing {
                    failing.failed(&format!("{what}: {report}"));
                }
                tracing::warn!(error = %report, ?retry_in, "{what}: waiting for the database");
                tokio::time::sleep(retry_in).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The store's problems, and whether a part of its schema was never migrated.
async fn prepare_store(
    store: &AnyStore,
    create: bool,
) -> Result<(Vec<outbox_core::store::Problem>, bool), outbox_core::StoreError> {
    let outbox = store.outbox();
    outbox.ping().await?;
    if create || store.creates_tables_implicitly() {
        store.migrate().await?;
    }
    let mut unmigrated = false;
    for (verdict, line) in store.schema_versions().await? {
        unmigrated |= verdict == outbox_core::migration::Verdict::Missing;
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
    Ok((store.verify().await?, unmigrated))
}
