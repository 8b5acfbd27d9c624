//! Giving way to PostgreSQL's smart shutdown. A smart shutdown (`pg_ctl stop -m smart`,
//! `SIGTERM` to the postmaster) refuses new connections, then waits for every client
//! session to end on its own: nothing tells a session that the server waits for it, so a
//! relay's pooled connections and its LISTEN session held the shutdown for good.
//!
//! A probe connection, now and then, is the only thing that tells: the server refuses it
//! (SQLSTATE 57P03, "cannot connect now") while the relay's own sessions are still open.
//! The store then lets its sessions go: idle pooled connections are closed, each one in use
//! is closed as it is handed back, the LISTEN session ends and the active-relay lock of a
//! mapped table is let go. Nothing is lost by it: the relay's work fails as it does while
//! the database is away, and resumes once the server takes connections again (the probe
//! says when). Walsenders do not hold a smart shutdown until its last phase, where a fast
//! shutdown's rules apply (see `outbox-wal`).

use std::sync::Arc;
use std::time::Duration;

use tokio_postgres::error::SqlState;

use crate::Inner;

/// How often the probe connects while the server takes connections: a smart shutdown
/// finishes about this long after the relay's last other client has gone. One short
/// connection each time, which a server with `log_connections = on` logs.
pub const PROBE_EVERY: Duration = Duration::from_secs(5);

/// How often it connects while the server refuses: the relay reconnects about this long
/// after the server is back.
const PROBE_WHILE_REFUSED: Duration = Duration::from_secs(1);

/// A probe that gets no answer within this long says nothing either way.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// What a probe connection found.
#[derive(Debug, PartialEq)]
enum Probe {
    /// The server took the connection.
    Accepted,
    /// It refused it for now (shutting down, or starting up).
    Refused,
    /// Anything else (unreachable, too many connections, no answer): says nothing about a
    /// shutdown, and the store's own operations report it.
    Unknown,
}

/// Probes the server for as long as it is polled, and keeps `inner.refused` (which the pool
/// and the LISTEN session follow) up to date.
pub(crate) async fn watch(inner: Arc<Inner>) {
    loop {
        let refused = *inner.refused.borrow();
        tokio::time::sleep(if refused {
            PROBE_WHILE_REFUSED
        } else {
            PROBE_EVERY
        })
        .await;
        match probe(&inner).await {
            Probe::Refused => {
                if !inner.refused.send_replace(true) {
                    tracing::warn!(
                        "PostgreSQL refuses new connections (a smart shutdown, or a restart): \
                         the relay closes its own sessions, so that a shutdown waiting for them \
                         can finish, and reconnects once the server takes connections again"
                    );
                }
                // Idle ones now; each one in use as it is handed back (the pool's hook).
                inner.pool.retain(|_, _| false);
            }
            Probe::Accepted => {
                if inner.refused.send_replace(false) {
                    tracing::info!("PostgreSQL takes connections again; the relay reconnects");
                }
            }
            Probe::Unknown => {}
        }
    }
}

async fn probe(inner: &Inner) -> Probe {
    let connecting = inner.config.connect(inner.tls.clone());
    match tokio::time::timeout(PROBE_TIMEOUT, connecting).await {
        // Dropping both ends the session at once.
        Ok(Ok((_client, _connection))) => Probe::Accepted,
        Ok(Err(e)) => outcome(e.code()),
        Err(_) => Probe::Unknown,
    }
}

/// What a probe's failure with SQLSTATE `code` says.
fn outcome(code: Option<&SqlState>) -> Probe {
    match code {
        Some(code) if *code == SqlState::CANNOT_CONNECT_NOW => Probe::Refused,
        _ => Probe::Unknown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_cannot_connect_now_is_a_refusal() {
        assert_eq!(outcome(Some(&SqlState::CANNOT_CONNECT_NOW)), Probe::Refused);
        for other in [
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::INVALID_PASSWORD,
            SqlState::ADMIN_SHUTDOWN,
        ] {
            assert_eq!(outcome(Some(&other)), Probe::Unknown, "{other:?}");
        }
        assert_eq!(outcome(None), Probe::Unknown);
    }
}
