//! What this node's own work says about its health: for each kind of operation, when it last
//! succeeded, since when it has been failing (and why), and since when an attempt has been
//! waiting for an answer. The engine and the cluster coordinator write it as they go; `/readyz`,
//! the metrics and the relay's watchdog read it. A database that stops answering (no error,
//! no reset) shows up here as an attempt that waits too long, well before its operation
//! timeout turns it into an error.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use crate::Ownership;

/// How long an attempt may wait for the database before it counts as trouble. Statements
/// take milliseconds (a claim over a large unanalyzed backlog, under a second); the store
/// gives up on an operation after 30 s, so this is what notices a blackholed connection.
pub const DEFAULT_STALL: Duration = Duration::from_secs(10);

/// The operations watched.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Check {
    /// The engine's claims.
    Claim,
    /// Acks, retries, dead-letters and releases.
    Settle,
    /// The node's heartbeat in the nodes table.
    Heartbeat,
    /// Renewing and taking partition leases.
    Leases,
    /// The backlog query behind the backlog gauges.
    Backlog,
    /// Publishing: failing while every publish fails (none of a batch's events confirmed),
    /// a trouble once that has lasted [`PUBLISH_GRACE`].
    Publish,
}

/// How long every publish may fail before it counts as trouble: a broker's restart or a
/// retried hiccup is not, a stream deleted or a permission revoked is, however the sink's
/// own health check (a connection, a ping) answers.
pub const PUBLISH_GRACE: Duration = Duration::from_secs(30);

impl Check {
    pub const ALL: [Check; 6] = [
        Check::Claim,
        Check::Settle,
        Check::Heartbeat,
        Check::Leases,
        Check::Backlog,
        Check::Publish,
    ];

    /// How long a failure lasts before it counts as trouble.
    fn grace(self) -> Duration {
        match self {
            Check::Publish => PUBLISH_GRACE,
            _ => Duration::ZERO,
        }
    }

    /// How recent its last failure must be for a failing streak to count: publishes are
    /// tried again only after their backoff (at most `retry.max_delay`, 5 minutes by
    /// default), and a streak no retry has continued for longer says nothing of now (its
    /// last event dead-lettered, nothing left to retry).
    fn recent(self) -> Option<Duration> {
        match self {
            Check::Publish => Some(PUBLISH_GRACE + crate::retry::DEFAULT_MAX_DELAY),
            _ => None,
        }
    }

    /// Whether it says anything of the relay's work. The backlog query feeds gauges only:
    /// counting millions of rows after an outage takes longer than the stall bound (and can
    /// reach the statement timeout) while the relay drains them fine, and /readyz went red
    /// on every node exactly then. Its last success stays a gauge.
    fn is_work(self) -> bool {
        self != Check::Backlog
    }

    pub fn name(self) -> &'static str {
        match self {
            Check::Claim => "claim",
            Check::Settle => "settle",
            Check::Heartbeat => "heartbeat",
            Check::Leases => "partition leases",
            Check::Backlog => "backlog",
            Check::Publish => "publish",
        }
    }
}

#[derive(Default)]
struct CheckState {
    last_success: Option<SystemTime>,
    /// Since when, and the latest error.
    failing: Option<(Instant, String)>,
    /// When it last failed (for [`Check::recent`]).
    last_failed: Option<Instant>,
    /// Attempts waiting for an answer, by attempt number: when each started.
    waiting: BTreeMap<u64, Instant>,
    /// Work retried by its owner that has not succeeded since it first failed
    /// ([`Failing`]), by number: since when, and its latest error.
    retried: BTreeMap<u64, (Instant, String)>,
}

impl CheckState {
    /// The oldest failure still unmended: the check's last verdict, or a piece of work
    /// retried since it first failed, whatever other attempts succeeded meanwhile.
    fn failure(&self) -> Option<&(Instant, String)> {
        let retried = self.retried.values().min_by_key(|(since, _)| *since);
        match (&self.failing, retried) {
            (Some(last), Some(retried)) if retried.0 < last.0 => Some(retried),
            (last, retried) => last.as_ref().or(retried),
        }
    }
}

#[derive(Default)]
struct State {
    checks: BTreeMap<Check, CheckState>,
    next_attempt: u64,
    /// Partitions the fair assignment gives this node (ordered cluster only).
    assigned: Option<usize>,
}

/// Shared by the engine, the coordinator and the HTTP endpoints of one node.
#[derive(Default)]
pub struct Health {
    state: Mutex<State>,
    ownership: OnceLock<Arc<Ownership>>,
}

/// One attempt of a watched operation; dropping it without a verdict (a cancelled future)
/// only stops the wait from counting.
pub struct Attempt {
    health: Arc<Health>,
    check: Check,
    id: u64,
}

impl Attempt {
    pub fn succeeded(self) {
        let mut state = self.health.state();
        let check = state.checks.entry(self.check).or_default();
        check.last_success = Some(SystemTime::now());
        check.failing = None;
    }

    /// Records the failure; returns `true` if the check was not failing already (the first
    /// failure of a streak, worth a log line of its own).
    pub fn failed(self, error: impl Into<String>) -> bool {
        let mut state = self.health.state();
        let check = state.checks.entry(self.check).or_default();
        let first = check.failing.is_none();
        let since = check.failing.take().map_or_else(Instant::now, |(s, _)| s);
        check.failing = Some((since, error.into()));
        first
    }
}

/// A piece of work its owner retries until it succeeds (one settle statement): its check
/// counts as failing from the first [`Failing::failed`] until this is dropped, however
/// other attempts of the check go meanwhile. One row's ack refused for good, beside a
/// stream of other rows acked, turned `/readyz` red and green by turns.
pub struct Failing {
    health: Arc<Health>,
    check: Check,
    id: u64,
}

impl Failing {
    pub fn failed(&self, error: &str) {
        let mut state = self.health.state();
        let check = state.checks.entry(self.check).or_default();
        let entry = check
            .retried
            .entry(self.id)
            .or_insert_with(|| (Instant::now(), String::new()));
        entry.1 = error.to_string();
    }
}

impl Drop for Failing {
    fn drop(&mut self) {
        let mut state = self.health.state();
        if let Some(check) = state.checks.get_mut(&self.check) {
            check.retried.remove(&self.id);
        }
    }
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let mut state = self.health.state();
        if let Some(check) = state.checks.get_mut(&self.check) {
            check.waiting.remove(&self.id);
        }
    }
}

/// One thing wrong, as `/readyz` and the watchdog word it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trouble {
    /// What it concerns: a [`Check`] name, or `partitions`.
    pub what: &'static str,
    /// What is wrong, for an operator.
    pub detail: String,
    /// How long it has lasted, as far as is known (zero when unknown).
    pub lasting: Duration,
}

impl std::fmt::Display for Trouble {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.what, self.detail)
    }
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("troubles", &self.troubles(Instant::now(), Duration::MAX))
            .finish()
    }
}

impl Health {
    pub fn new() -> Arc<Self> {
        Arc::new(Health::default())
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An attempt of `check` starts now.
    pub fn begin(self: &Arc<Self>, check: Check) -> Attempt {
        let mut state = self.state();
        state.next_attempt += 1;
        let id = state.next_attempt;
        state
            .checks
            .entry(check)
            .or_default()
            .waiting
            .insert(id, Instant::now());
        Attempt {
            health: self.clone(),
            check,
            id,
        }
    }

    /// A piece of work of `check` that its owner will retry until it succeeds; it fails
    /// `check` from its first [`Failing::failed`] until dropped.
    pub fn failing(self: &Arc<Self>, check: Check) -> Failing {
        let mut state = self.state();
        state.next_attempt += 1;
        Failing {
            health: self.clone(),
            check,
            id: state.next_attempt,
        }
    }

    /// A verdict on `check` with no attempt to watch for an answer (a publish, which its
    /// own timeout bounds): a success, or the failure's report.
    pub fn record(&self, check: Check, verdict: Result<(), String>) {
        let mut state = self.state();
        let check = state.checks.entry(check).or_default();
        match verdict {
            Ok(()) => {
                check.last_success = Some(SystemTime::now());
                check.failing = None;
            }
            Err(error) => {
                let since = check.failing.take().map_or_else(Instant::now, |(s, _)| s);
                check.failing = Some((since, error));
                check.last_failed = Some(Instant::now());
            }
        }
    }

    /// `check` has been failing since `since` (a streak its caller keeps: the engine's per
    /// send group), the latest error `error`.
    pub fn record_failing_since(&self, check: Check, since: Instant, error: String) {
        let mut state = self.state();
        let check = state.checks.entry(check).or_default();
        check.failing = Some((since, error));
        check.last_failed = Some(Instant::now());
    }

    /// Forgets `check`'s failure without a success to show for it: the operation is not
    /// tried any more (a node with nothing to claim).
    pub fn clear_failure(&self, check: Check) {
        if let Some(check) = self.state().checks.get_mut(&check) {
            check.failing = None;
        }
    }

    /// When `check` last succeeded (wall clock, for a timestamp gauge).
    pub fn last_success(&self, check: Check) -> Option<SystemTime> {
        self.state().checks.get(&check).and_then(|c| c.last_success)
    }

    /// The partitions this node holds, to compare with its assignment.
    pub fn watch_ownership(&self, ownership: Arc<Ownership>) {
        let _ = self.ownership.set(ownership);
    }

    /// Set by the coordinator after each assignment.
    pub fn set_assigned(&self, partitions: usize) {
        self.state().assigned = Some(partitions);
    }

    /// Partitions this node may publish right now: held, and valid by its own clock.
    pub fn owned_partitions(&self, now: Instant) -> Option<usize> {
        self.ownership.get().map(|o| o.publishable(now).0.len())
    }

    /// Everything wrong right now: failing checks, attempts without an answer for longer than
    /// `stall`, and partitions assigned to this node that it does not hold.
    pub fn troubles(&self, now: Instant, stall: Duration) -> Vec<Trouble> {
        let mut out = Vec::new();
        let assigned;
        {
            let state = self.state();
            assigned = state.assigned;
            for (check, c) in state.checks.iter().filter(|(check, _)| check.is_work()) {
                if let Some((since, error)) = c.failure() {
                    let lasting = now.saturating_duration_since(*since);
                    if lasting < check.grace() {
                        continue;
                    }
                    let stale = check
                        .recent()
                        .zip(c.last_failed)
                        .is_some_and(|(recent, at)| now.saturating_duration_since(at) > recent);
                    if stale {
                        continue;
                    }
                    out.push(Trouble {
                        what: check.name(),
                        detail: format!("failing for {}s: {error}", lasting.as_secs()),
                        lasting,
                    });
                } else if let Some(oldest) = c.waiting.values().min() {
                    let waited = now.saturating_duration_since(*oldest);
                    if waited >= stall {
                        out.push(Trouble {
                            what: check.name(),
                            // A lock another session holds waits as silently as a
                            // network path that went dead: a DBA's `LOCK TABLE` was
                            // reported as the network alone.
                            detail: format!(
                                "no answer from the database for {}s: a statement waits for a \
                                 lock another session holds, or the connection may be \
                                 blackholed (see the relay's sessions in pg_stat_activity or \
                                 SHOW PROCESSLIST, then the network path to the database)",
                                waited.as_secs()
                            ),
                            lasting: waited,
                        });
                    }
                }
            }
        }
        if let (Some(assigned), Some(owned)) = (assigned, self.owned_partitions(now)) {
            if assigned > 0 && owned == 0 {
                out.push(Trouble {
                    what: "partitions",
                    detail: format!(
                        "holds none of the {assigned} partitions assigned to it, so it publishes nothing"
                    ),
                    lasting: Duration::ZERO,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every publish failing is trouble once it has lasted the grace, whatever the sink's
    /// own health check says (it reaches the broker), until a publish succeeds.
    #[test]
    fn publishes_that_all_fail_are_trouble_after_the_grace_until_one_succeeds() {
        let health = Health::new();
        let stall = Duration::from_secs(10);
        health.record(Check::Publish, Err("stream not found".into()));
        assert!(health.troubles(Instant::now(), stall).is_empty());
        health.record(Check::Publish, Err("stream not found".into()));
        let later = Instant::now() + PUBLISH_GRACE;
        let troubles = health.troubles(later, stall);
        assert_eq!(troubles.len(), 1, "{troubles:?}");
        assert_eq!(troubles[0].what, "publish");
        assert!(troubles[0].detail.contains("stream not found"));
        health.record(Check::Publish, Ok(()));
        assert!(health.troubles(later, stall).is_empty());
        assert!(health.last_success(Check::Publish).is_some());
        // A streak nothing continued (a retried hiccup, nothing left to retry) says nothing
        // of now: an idle relay is not kept red by one old failure.
        health.record(Check::Publish, Err("timed out".into()));
        let idle = Instant::now() + PUBLISH_GRACE * 2 + crate::retry::DEFAULT_MAX_DELAY;
        assert!(health.troubles(idle, stall).is_empty());
    }

    /// A slow or failing backlog count is no trouble: it feeds gauges, and a large backlog
    /// being drained is when it is slow.
    #[test]
    fn a_cleared_failure_is_no_trouble_and_no_success() {
        let health = Health::new();
        assert!(health.begin(Check::Claim).failed("connection reset"));
        health.clear_failure(Check::Claim);
        assert!(health
            .troubles(Instant::now(), Duration::from_secs(10))
            .is_empty());
        assert!(health.last_success(Check::Claim).is_none());
    }

    #[test]
    fn the_backlog_query_is_never_trouble() {
        let health = Health::new();
        let stall = Duration::from_secs(10);
        let _waiting = health.begin(Check::Backlog);
        assert!(health.begin(Check::Backlog).failed("statement timeout"));
        assert!(health
            .troubles(Instant::now() + stall * 10, stall)
            .is_empty());
    }

    #[test]
    fn a_failure_is_reported_until_the_next_success() {
        let health = Health::new();
        assert!(health.begin(Check::Leases).failed("permission denied"));
        assert!(!health.begin(Check::Leases).failed("permission denied"));
        let troubles = health.troubles(Instant::now(), Duration::from_secs(10));
        assert_eq!(troubles.len(), 1);
        assert!(troubles[0].detail.contains("permission denied"));
        health.begin(Check::Leases).succeeded();
        assert!(health
            .troubles(Instant::now(), Duration::from_secs(10))
            .is_empty());
        assert!(health.last_success(Check::Leases).is_some());
    }

    /// One settle retried for good (a row a foreign key refuses) beside others that
    /// succeed: the check stays failing, named by the retried one's error, until it ends.
    #[test]
    fn retried_work_keeps_its_check_failing_whatever_else_succeeds() {
        let health = Health::new();
        let stall = Duration::from_secs(10);
        let retried = health.failing(Check::Settle);
        assert!(health.troubles(Instant::now(), stall).is_empty());
        retried.failed("ack of row 7: violates foreign key constraint");
        health
            .begin(Check::Settle)
            .failed("ack of row 7: violates foreign key constraint");
        health.begin(Check::Settle).succeeded();
        let troubles = health.troubles(Instant::now(), stall);
        assert_eq!(troubles.len(), 1, "{troubles:?}");
        assert!(troubles[0].detail.contains("row 7"), "{troubles:?}");
        // A later failure of other work does not hide since when this one has failed.
        health.begin(Check::Settle).failed("ack: connection reset");
        let later = Instant::now() + Duration::from_secs(3);
        assert!(health.troubles(later, stall)[0].detail.contains("row 7"));
        health.begin(Check::Settle).succeeded();
        drop(retried);
        assert!(health.troubles(Instant::now(), stall).is_empty());
    }

    #[test]
    fn an_attempt_without_an_answer_counts_once_it_waited_past_the_stall_bound() {
        let health = Health::new();
        let attempt = health.begin(Check::Claim);
        let stall = Duration::from_secs(10);
        assert!(health.troubles(Instant::now(), stall).is_empty());
        let later = Instant::now() + stall;
        let trouble = &health.troubles(later, stall)[0];
        assert_eq!(trouble.what, "claim");
        // A lock wait is as silent as a dead network path: both are named.
        assert!(
            trouble.detail.contains("lock another session holds")
                && trouble.detail.contains("blackholed"),
            "{}",
            trouble.detail
        );
        drop(attempt);
        assert!(health.troubles(later, stall).is_empty());
    }

    #[test]
    fn holding_none_of_the_assigned_partitions_is_trouble() {
        let health = Health::new();
        let ownership = Ownership::new(4);
        health.watch_ownership(ownership.clone());
        health.set_assigned(0);
        assert!(health
            .troubles(Instant::now(), Duration::from_secs(1))
            .is_empty());
        health.set_assigned(4);
        assert_eq!(
            health.troubles(Instant::now(), Duration::from_secs(1))[0].what,
            "partitions"
        );
        ownership.grant(1, 1, Instant::now() + Duration::from_secs(5));
        assert!(health
            .troubles(Instant::now(), Duration::from_secs(1))
            .is_empty());
    }
}
