//! Wake-ups: LISTEN on a dedicated connection, and the gated wake-up's advisory lock.

use std::sync::Arc;
use std::time::Duration;

use outbox_core::store::{OnChange, StoreResult};
use outbox_core::{StoreError, StoreErrorKind};
use tokio_postgres::AsyncMessage;

use crate::error::db_error;
use crate::Inner;

/// How long a LISTEN session ended by the server's refusal of new connections waits for it
/// to take them again before it tries anyway.
const REFUSED_PATIENCE: Duration = Duration::from_secs(30);

/// LISTENs on a dedicated connection and calls `on_change` for every notification, and once
/// after each (re)connect to catch what was missed. Reconnects with backoff, forever.
pub(crate) async fn listen_forever(inner: Arc<Inner>, on_change: OnChange) {
    let channel = inner.tables.notify_channel.as_str().to_string();
    listen_forever_on(inner, channel, on_change).await
}

/// [`listen_forever`] on a given channel (a validated identifier).
async fn listen_forever_on(inner: Arc<Inner>, channel: String, on_change: OnChange) {
    let mut backoff = outbox_core::Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    let mut refused = inner.refused.subscribe();
    loop {
        // Once the server refuses new connections the session ends, for a smart shutdown
        // waits for it (see `shutdown_watch`); the next one starts once the server takes
        // connections again (or a while later, should nothing say so).
        let opened = std::time::Instant::now();
        let listened = tokio::select! {
            listened = listen_once(&inner, &channel, &on_change) => Some(listened),
            _ = refused.wait_for(|since| since.is_some_and(|at| at > opened)) => None,
        };
        let listened = match listened {
            Some(listened) => listened,
            None => {
                let back = refused.wait_for(|since| since.is_none());
                let _ = tokio::time::timeout(REFUSED_PATIENCE, back).await;
                Ok(())
            }
        };
        if let Err(e) = listened {
            if inner.refused.borrow().is_some() {
                // A server shutting down refuses it: said once (`shutdown_watch`).
                tracing::debug!(error = %e.report(), "LISTEN connection refused");
            } else {
                tracing::warn!(error = %e.report(), "LISTEN connection lost; the safety poll covers the gap");
            }
        } else {
            backoff.reset();
        }
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

async fn listen_once(inner: &Inner, channel: &str, on_change: &OnChange) -> StoreResult<()> {
    let (client, mut connection) = inner
        .config
        .connect(inner.tls.clone())
        .await
        .map_err(|e| db_error("listen", e))?;
    let notify = on_change.clone();
    let driver = async move {
        loop {
            match futures::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(_))) => notify(),
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(db_error("listen", e)),
                None => {
                    return Err(StoreError::new(
                        StoreErrorKind::Connection,
                        "listen: connection closed",
                    ))
                }
            }
        }
    };
    let driver = tokio::spawn(tracing::Instrument::in_current_span(driver));
    crate::hold_waiting_session(&client, &inner.config).await;
    let listen = format!("LISTEN \"{channel}\"");
    if let Err(e) = client.batch_execute(&listen).await {
        driver.abort();
        return Err(db_error("listen", e));
    }
    tracing::debug!(%channel, "listening for notifications");
    on_change();
    let mut driver = driver;
    if inner.tables.gated_wakeup {
        let result = gate(inner, &client, &mut driver, on_change).await;
        driver.abort();
        return result;
    }
    let result = driver.await.unwrap_or_else(|e| {
        Err(StoreError::new(
            StoreErrorKind::Connection,
            format!("listen task failed: {e}"),
        ))
    });
    drop(client);
    result
}

/// How often a relay at work looks for rows while writers are in their transactions (the
/// gated wake-up cannot wait for it yet).
const GATE_RETRY: std::time::Duration = std::time::Duration::from_millis(5);

/// How often a waiting relay tries for the gate while another relay holds it. It is not
/// woken for these tries: it claims at its `poll_interval`, and on the NOTIFYs the holder's
/// writers send to every listener.
const GATE_HELD_ELSEWHERE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Tries for the gate; when that fails, tells who holds it: writers mid-transaction (their
/// shared locks admit a shared lock, taken and dropped at once) or another relay (its
/// exclusive lock admits none). One round trip: `CASE` evaluates its branches in order.
const GATE_TRY: &str = "SELECT CASE
    WHEN pg_try_advisory_lock(hashtext($1)) THEN 'taken'
    WHEN pg_try_advisory_lock_shared(hashtext($1)) AND pg_advisory_unlock_shared(hashtext($1))
         THEN 'writers'
    ELSE 'relay' END";

/// The gated wake-up: while the engine waits, hold the advisory lock writers test (so they
/// notify); while it works, release it (so they do not, and their commits stay cheap). A
/// waiting engine that cannot take the lock because a writer is mid-transaction is woken
/// every few milliseconds instead, until it can; one that cannot because another relay holds
/// it (a cluster) is left to its poll interval. Returns the connection's end.
async fn gate(
    inner: &Inner,
    client: &tokio_postgres::Client,
    driver: &mut tokio::task::JoinHandle<StoreResult<()>>,
    on_change: &OnChange,
) -> StoreResult<()> {
    let key = inner.tables.wakeup_key();
    let mut waiting = inner.waiting.subscribe();
    let mut holding = false;
    let mut held_elsewhere = false;
    loop {
        let want = *waiting.borrow_and_update();
        if want && !holding {
            let row = client
                .query_one(GATE_TRY, &[&key])
                .await
                .map_err(|e| db_error("wake-up gate", e))?;
            let state: &str = row.get(0);
            holding = state == "taken";
            held_elsewhere = state == "relay";
            // Look again: rows committed before the lock was held notified nobody, and
            // writers mid-transaction will not notify either. Under another relay's gate,
            // its writers notify every listener, this one included.
            if !held_elsewhere {
                on_change();
            }
        } else if !want && holding {
            client
                .query_one("SELECT pg_advisory_unlock(hashtext($1))", &[&key])
                .await
                .map_err(|e| db_error("wake-up gate", e))?;
            holding = false;
        }
        let retry = want && !holding;
        let pause = if held_elsewhere {
            GATE_HELD_ELSEWHERE_RETRY
        } else {
            GATE_RETRY
        };
        tokio::select! {
            ended = &mut *driver => {
                return ended.unwrap_or_else(|e| {
                    Err(StoreError::new(
                        StoreErrorKind::Connection,
                        format!("listen task failed: {e}"),
                    ))
                });
            }
            changed = waiting.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
            () = tokio::time::sleep(pause), if retry => {}
        }
    }
}
