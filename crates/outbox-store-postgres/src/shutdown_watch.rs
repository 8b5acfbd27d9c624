//! Giving way to PostgreSQL's smart shutdown. A smart shutdown (`pg_ctl stop -m smart`,
//! `SIGTERM` to the postmaster) refuses new connections, then waits for every client
//! session to end on its own: nothing tells a session that the server waits for it, so a
//! relay's pooled connections and its LISTEN session held the shutdown for good.
//!
//! A probe connection, now and then, is the only thing that tells: the server refuses it
//! (SQLSTATE 57P03, "cannot connect now") while the relay's own sessions are still open.
//! The store then lets go of every session opened before the refusal: idle pooled
//! connections at once, each one in use at its next use (or within a second), the LISTEN
//! session, and the session holding a mapped table's active-relay lock. Nothing is lost by
//! it: the relay's work fails as it does while the database is away, and resumes once the
//! server takes connections again. Sessions opened after the refusal are kept, so a probe
//! that reached another server than the pool's (a URL of several hosts, a proxy) costs one
//! reconnect, never a stall. Walsenders do not hold a smart shutdown until its last phase,
//! where a fast shutdown's rules apply (see `outbox-wal`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::error::SqlState;

use crate::Inner;

/// How often the probe connects while the server takes connections: a smart shutdown
/// finishes about this long after the other clients have gone. One short connection each
/// time, per outbox, which a server with `log_connections = on` logs.
const PROBE_EVERY: Duration = Duration::from_secs(5);

/// How often it connects while the server refuses: the relay reconnects about this long
/// after the server is back.
const PROBE_WHILE_REFUSED: Duration = Duration::from_secs(1);

/// A probe that gets no answer within this long says nothing either way.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long the pool may take to open a connection (its create timeout). A pooled
/// connection is stamped when its handshake ended, and one begun before the refusal (which
/// the server lets finish) may end after it: the pool lets go of those stamped up to this
/// long after the refusal too (after a wrong refusal, a reconnect or two more).
pub(crate) const POOL_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Since when the server refuses new connections (the first refused probe of a run of
/// them); `None` while it takes them.
pub(crate) type RefusedSince = Option<Instant>;

/// Whether a session whose opening began at `opened` predates the server's refusal, and
/// must let go.
pub(crate) fn older_than_the_refusal(
    refused: &tokio::sync::watch::Sender<RefusedSince>,
    opened: Instant,
) -> bool {
    refused.borrow().is_some_and(|since| opened < since)
}

/// [`older_than_the_refusal`] for a pooled connection stamped `created` when its handshake
/// ended ([`POOL_CONNECT_TIMEOUT`]).
pub(crate) fn pooled_before_the_refusal(
    refused: &tokio::sync::watch::Sender<RefusedSince>,
    created: Instant,
) -> bool {
    let began = created.checked_sub(POOL_CONNECT_TIMEOUT).unwrap_or(created);
    older_than_the_refusal(refused, began)
}

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

/// Probes the server for as long as it is polled, and keeps `inner.refused` (which the pool,
/// the LISTEN session and a mapped table's lock follow) up to date.
pub(crate) async fn watch(inner: Arc<Inner>) {
    let mut runs = RefusalRuns::default();
    loop {
        let refused = inner.refused.borrow().is_some();
        tokio::time::sleep(if refused {
            PROBE_WHILE_REFUSED
        } else {
            PROBE_EVERY
        })
        .await;
        let probe = probe(&inner).await;
        let now_refused = runs.after(&probe, Instant::now());
        match publish(&inner.refused, now_refused) {
            Some(Turn::Refusing) => tracing::warn!(
                "PostgreSQL refuses new connections (a smart shutdown, or a restart): the relay \
                 closes its own sessions, so that a shutdown waiting for them can finish, and \
                 reconnects once the server takes connections again"
            ),
            Some(Turn::Accepting) => {
                tracing::info!("PostgreSQL takes connections again; the relay reconnects")
            }
            None => {}
        }
        if probe == Probe::Refused {
            // Idle ones now; each one in use at its next use (the pool's hook), or here
            // within a second.
            for pool in [&inner.pool, &inner.coordination] {
                pool.retain(|_, metrics| {
                    !pooled_before_the_refusal(&inner.refused, metrics.created)
                });
            }
        }
    }
}

/// Where the server turned: what the log tells once per refusal, not again for a new run
/// of refusals within it.
#[derive(Debug, PartialEq)]
enum Turn {
    Refusing,
    Accepting,
}

/// Sets the refusal the store follows to `now`, waking its followers (the LISTEN session,
/// a mapped table's lock) only where it changed, and says whether the server turned.
fn publish(refused: &tokio::sync::watch::Sender<RefusedSince>, now: RefusedSince) -> Option<Turn> {
    let mut turn = None;
    refused.send_if_modified(|since| {
        let before = std::mem::replace(since, now);
        turn = match (before.is_some(), now.is_some()) {
            (false, true) => Some(Turn::Refusing),
            (true, false) => Some(Turn::Accepting),
            _ => None,
        };
        before != now
    });
    turn
}

/// The refusal the store follows, from one probe's verdict to the next. A run of refusals
/// keeps the instant of its first, so that sessions opened during the run are kept; a probe
/// that said nothing breaks the run, and the next refusal starts a new one: the server may
/// have taken connections meanwhile, and the sessions opened then must let go too.
#[derive(Debug, Default)]
struct RefusalRuns {
    since: RefusedSince,
    broken: bool,
}

impl RefusalRuns {
    /// Since when the server refuses, after `probe` at `now`.
    fn after(&mut self, probe: &Probe, now: Instant) -> RefusedSince {
        match probe {
            Probe::Refused => {
                if std::mem::take(&mut self.broken) || self.since.is_none() {
                    self.since = Some(now);
                }
            }
            Probe::Accepted => *self = RefusalRuns::default(),
            Probe::Unknown => self.broken = self.since.is_some(),
        }
        self.since
    }
}

async fn probe(inner: &Inner) -> Probe {
    let connecting = inner.config.connect(inner.tls.clone());
    match tokio::time::timeout(PROBE_TIMEOUT, connecting).await {
        Ok(Ok((client, connection))) => {
            // Without its client the connection says goodbye (Terminate) and ends, rather
            // than leave the server a reset socket to log.
            drop(client);
            let _ = tokio::time::timeout(Duration::from_secs(1), connection).await;
            Probe::Accepted
        }
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
    fn followers_wake_when_the_refusal_changes_and_the_log_when_the_server_turns() {
        let refused = tokio::sync::watch::channel(None).0;
        let mut follower = refused.subscribe();
        let mut woken = || {
            let changed = follower.has_changed().unwrap();
            follower.mark_unchanged();
            changed
        };
        let first = Instant::now();
        let second = first + Duration::from_secs(1);
        assert_eq!(publish(&refused, None), None, "the server took it before");
        assert!(!woken());
        assert_eq!(publish(&refused, Some(first)), Some(Turn::Refusing));
        assert!(woken());
        assert_eq!(publish(&refused, Some(first)), None, "the same run");
        assert!(!woken());
        assert_eq!(
            publish(&refused, Some(second)),
            None,
            "a new run, the same refusal"
        );
        assert!(woken(), "sessions opened between the runs must let go");
        assert_eq!(publish(&refused, None), Some(Turn::Accepting));
        assert!(woken());
    }

    #[test]
    fn a_pooled_connection_whose_handshake_may_have_begun_before_the_refusal_lets_go() {
        let refused = tokio::sync::watch::channel(None).0;
        let since = Instant::now();
        let at = |after: u64| since + Duration::from_secs(after);
        assert!(!pooled_before_the_refusal(&refused, at(0)), "no refusal");
        refused.send_replace(Some(since));
        assert!(pooled_before_the_refusal(&refused, since));
        assert!(
            pooled_before_the_refusal(&refused, at(5)),
            "begun before it"
        );
        assert!(
            !pooled_before_the_refusal(&refused, at(11)),
            "begun after it"
        );
        assert!(
            !older_than_the_refusal(&refused, at(5)),
            "a session stamped at its start"
        );
    }

    #[test]
    fn a_run_of_refusals_keeps_its_first_instant() {
        let mut runs = RefusalRuns::default();
        let start = Instant::now();
        let at = |after: u64| start + Duration::from_secs(after);
        assert_eq!(runs.after(&Probe::Accepted, at(0)), None);
        assert_eq!(runs.after(&Probe::Unknown, at(5)), None, "says nothing");
        assert_eq!(runs.after(&Probe::Refused, at(10)), Some(at(10)));
        assert_eq!(runs.after(&Probe::Refused, at(11)), Some(at(10)));
        assert_eq!(runs.after(&Probe::Accepted, at(12)), None);
        assert_eq!(
            runs.after(&Probe::Refused, at(17)),
            Some(at(17)),
            "a new run"
        );
    }

    #[test]
    fn race_a_refusal_after_a_probe_that_said_nothing_starts_a_new_run() {
        // The server may have taken connections between the two refusals (a restart whose
        // probe timed out): sessions opened then predate the second refusal and must go.
        let mut runs = RefusalRuns::default();
        let start = Instant::now();
        let at = |after: u64| start + Duration::from_secs(after);
        assert_eq!(runs.after(&Probe::Refused, at(0)), Some(at(0)));
        assert_eq!(
            runs.after(&Probe::Unknown, at(1)),
            Some(at(0)),
            "still refused meanwhile"
        );
        assert_eq!(runs.after(&Probe::Refused, at(11)), Some(at(11)));
        assert_eq!(
            runs.after(&Probe::Refused, at(12)),
            Some(at(11)),
            "one new run"
        );
        assert_eq!(runs.after(&Probe::Unknown, at(13)), Some(at(11)));
        assert_eq!(runs.after(&Probe::Accepted, at(14)), None);
        assert_eq!(runs.after(&Probe::Refused, at(15)), Some(at(15)));
    }

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
