//! Deletes of delivered rows as group commits, for both captures: one delete at a time,
//! spaced, each taking every ack queued until it starts.
//!
//! A fast sink confirms many small batches (one per key's lane), and a delete each would
//! cost a statement and a commit per batch, which the application's commits then queue
//! behind. A key's next event goes out when this one is published, so the spacing holds no
//! key back; it delays the stream's confirmation and the engine's count of events in flight
//! (`max_in_flight`) by up to [`DELETE_SPACING`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use crate::store::StoreResult;
use crate::StoreError;

/// The least time between the starts of two deletes of delivered rows: at most 20 a
/// second, however many small batches the sink confirms. Each delete is three round trips
/// for the relay: at 10,000 events/s a spacing of 20 ms made them a tenth of its CPU
/// (BENCHMARKS.md, "Fewer, cheaper deletes").
pub const DELETE_SPACING: Duration = Duration::from_millis(50);

/// Acks enough for a delete to start without waiting for [`DELETE_SPACING`]: grouping them
/// has done its work, and a drain should not wait with that many events counted in flight.
/// Lower for a small `max_in_flight` ([`delete_group_enough`]).
pub const DELETE_GROUP_ENOUGH: usize = 1_000;

/// The acks that start a delete at once for an engine holding at most `max_in_flight`
/// events: [`DELETE_GROUP_ENOUGH`], or half the limit where that is less. Acked events
/// count as in flight until their delete; an engine at its limit claims nothing more, and
/// would otherwise relay at most `max_in_flight` events per spacing.
pub fn delete_group_enough(max_in_flight: usize) -> usize {
    (max_in_flight / 2).clamp(1, DELETE_GROUP_ENOUGH)
}

/// How long a group delete of `queued` acks waits before it starts, the last one having
/// started at `last_delete`: what is left of [`DELETE_SPACING`], unless `enough` acks wait
/// ([`delete_group_enough`]). Acks that arrive meanwhile join it. On tokio's clock, which
/// the wait sleeps on.
fn delete_wait(last_delete: Option<Instant>, queued: usize, enough: usize) -> Option<Duration> {
    last_delete
        .and_then(|at| DELETE_SPACING.checked_sub(at.elapsed()))
        .filter(|_| queued < enough)
}

/// One statement shared by the acks it carries: its outcome, once run, for each of them.
#[derive(Default)]
struct SharedOutcome(std::sync::OnceLock<StoreResult<()>>);

impl SharedOutcome {
    /// Records the statement's outcome (the first one recorded stands).
    fn set(&self, result: &StoreResult<()>) {
        let _ = self
            .0
            .set(result.as_ref().map(|_| ()).map_err(StoreError::duplicate));
    }

    /// The outcome, once the statement ran.
    fn get(&self) -> Option<StoreResult<()>> {
        let outcome = self.0.get()?;
        Some(outcome.as_ref().map(|_| ()).map_err(StoreError::duplicate))
    }
}

/// The acks waiting for the next delete, and each caller's share of them.
struct OpenGroup<A> {
    acks: Vec<A>,
    /// Each caller's acks: where they start in `acks`, and the outcome it waits for.
    callers: Vec<(usize, Arc<SharedOutcome>)>,
}

/// While a group's delete runs: if it is dropped unfinished (its ack cancelled), the acks
/// it carried, which wait for its outcome, get an error to retry on, not the outcome of a
/// later delete that did not carry them.
struct OutcomeOnCancel<'a>(&'a [(usize, Arc<SharedOutcome>)]);

impl Drop for OutcomeOnCancel<'_> {
    fn drop(&mut self) {
        // Outcomes set already stand (the first one set does).
        for (_, outcome) in self.0 {
            outcome.set(&Err(StoreError::new(
                crate::StoreErrorKind::Conflict,
                "the delete of delivered rows carrying this ack was cancelled before it finished",
            )));
        }
    }
}

/// A capture's deletes of delivered rows, run as group commits (see the module's docs). `A` is
/// what the capture queues per acked event (its id, and whatever its delete needs).
///
/// Contract: [`ack`](Self::ack) returns once a delete that carried its acks has run, with
/// that delete's outcome; each ack is carried by exactly one delete; deletes never overlap,
/// and one that runs a statement starts no sooner than [`DELETE_SPACING`] after the last
/// one that did, unless [`delete_group_enough`] acks wait.
pub struct GroupDeletes<A> {
    open: Mutex<OpenGroup<A>>,
    /// Held by the group whose turn it is, while it waits and runs: when the last delete
    /// that ran a statement started.
    turn: tokio::sync::Mutex<Option<Instant>>,
    enough: usize,
}

impl<A> GroupDeletes<A> {
    /// Deletes for an engine holding at most `max_in_flight` events.
    pub fn new(max_in_flight: usize) -> Self {
        GroupDeletes {
            open: Mutex::new(OpenGroup {
                acks: Vec::new(),
                callers: Vec::new(),
            }),
            turn: tokio::sync::Mutex::new(None),
            enough: delete_group_enough(max_in_flight),
        }
    }

    /// Queues `acks` and returns the outcome of the delete that carries them. When their
    /// group's turn comes, `needs_statement` says whether the group's acks have rows to
    /// delete (a group with none neither waits nor counts toward the spacing), and `delete`
    /// runs it with every ack queued by then. `acks` and `needs_statement` run under this
    /// type's own lock: neither may take a lock held by a caller of `ack`.
    ///
    /// Cancelled (dropped) while its group waits, the acks stay queued for the next turn;
    /// cancelled while the delete runs, every ack the delete carried gets a retryable
    /// error, and the engine acks them again.
    ///
    /// A delete the database refuses for one of its rows ([`crate::StoreErrorKind::RowRefused`]:
    /// a foreign key to a delivered row) is run again for each caller's acks apart, so that
    /// only the caller whose row it is gets the refusal: shared, it failed every ack the
    /// group carried, each then split and retried by the engine as if refused itself.
    pub async fn ack<D>(
        &self,
        acks: impl IntoIterator<Item = A>,
        needs_statement: impl FnOnce(&[A]) -> bool,
        delete: impl Fn(Vec<A>) -> D,
    ) -> StoreResult<()>
    where
        A: Clone,
        D: std::future::Future<Output = StoreResult<()>>,
    {
        let outcome = Arc::new(SharedOutcome::default());
        {
            let mut open = self.lock_open();
            let start = open.acks.len();
            open.acks.extend(acks);
            open.callers.push((start, outcome.clone()));
        }
        let mut last_delete = self.turn.lock().await;
        if let Some(done) = outcome.get() {
            // An earlier ack's turn carried these.
            return done;
        }
        let (spaced, queued) = {
            let open = self.lock_open();
            (needs_statement(&open.acks), open.acks.len())
        };
        if spaced {
            if let Some(wait) = delete_wait(*last_delete, queued, self.enough) {
                tokio::time::sleep(wait).await;
            }
            *last_delete = Some(Instant::now());
        }
        // Close the group (later acks open the next one) and run it.
        let OpenGroup { acks, callers } = std::mem::replace(
            &mut *self.lock_open(),
            OpenGroup {
                acks: Vec::new(),
                callers: Vec::new(),
            },
        );
        let _pending = OutcomeOnCancel(&callers);
        let apart = (callers.len() > 1).then(|| acks.clone());
        let result = delete(acks).await;
        match (&result, apart) {
            (Err(e), Some(acks)) if e.kind() == crate::StoreErrorKind::RowRefused => {
                let ends = callers.iter().skip(1).map(|(start, _)| *start);
                for ((start, caller), end) in callers.iter().zip(ends.chain([acks.len()])) {
                    caller.set(&delete(acks[*start..end].to_vec()).await);
                }
            }
            _ => {
                for (_, caller) in &callers {
                    caller.set(&result);
                }
            }
        }
        outcome.get().unwrap_or(result)
    }

    fn lock_open(&self) -> std::sync::MutexGuard<'_, OpenGroup<A>> {
        // The lock guards no await, and no code that can panic but the caller's `acks` and
        // `needs_statement`, after which the queue is still whole.
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[cfg(test)]
    fn queued(&self) -> usize {
        self.lock_open().acks.len()
    }

    /// Whether a group has its turn and has taken its acks (its delete runs).
    #[cfg(test)]
    fn running_with_none_queued(&self) -> bool {
        self.turn.try_lock().is_err() && self.queued() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_waits_out_the_spacing_unless_it_is_the_first_or_enough_acks_wait() {
        let enough = DELETE_GROUP_ENOUGH;
        assert_eq!(
            delete_wait(None, 1, enough),
            None,
            "the first starts at once"
        );
        let just_now = Some(Instant::now());
        let wait = delete_wait(just_now, 1, enough).expect("a wait right after the last delete");
        assert!(wait <= DELETE_SPACING && wait > Duration::ZERO);
        assert_eq!(
            delete_wait(just_now, enough, enough),
            None,
            "enough grouped"
        );
        let long_ago = Instant::now().checked_sub(DELETE_SPACING * 2);
        assert_eq!(
            delete_wait(long_ago, 1, enough),
            None,
            "the spacing has passed"
        );
    }

    /// An engine that may hold 200 events waited out the spacing with all 200 acked: it
    /// relayed at most 200 events per spacing, however fast its sink.
    #[test]
    fn a_small_in_flight_limit_starts_its_deletes_at_half_of_it() {
        assert_eq!(delete_group_enough(10_000), DELETE_GROUP_ENOUGH);
        assert_eq!(delete_group_enough(200), 100);
        assert_eq!(delete_group_enough(1), 1, "never zero");
        let just_now = Some(Instant::now());
        assert_eq!(delete_wait(just_now, 100, delete_group_enough(200)), None);
        assert!(delete_wait(just_now, 99, delete_group_enough(200)).is_some());
    }

    /// The delete failed once: every ack it carried returns that failure, its fix said
    /// once (each used to wrap the first's report, fix and all, and add the fix again).
    #[test]
    fn every_ack_a_shared_statement_carried_gets_its_failure_with_the_fix_said_once() {
        let outcome = SharedOutcome::default();
        assert!(outcome.get().is_none(), "not run yet");
        let failure = StoreError::new(crate::StoreErrorKind::MissingSchema, "no table outbox")
            .with_source(std::io::Error::other(
                "server said so (mysql://relay:secret@db.internal/app)",
            ));
        outcome.set(&Err(failure));
        for _ in 0..2 {
            let again = outcome.get().unwrap().unwrap_err();
            assert_eq!(again.kind(), crate::StoreErrorKind::MissingSchema);
            let report = again.report();
            assert_eq!(report.matches("(fix:").count(), 1, "{report}");
            assert!(
                report.contains("no table outbox: server said so"),
                "{report}"
            );
        }
        let done = SharedOutcome::default();
        done.set(&Ok(()));
        assert!(done.get().unwrap().is_ok());
    }

    /// Deletes recorded by the acks each carried; the first one waits for `gate`.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<Vec<u32>>>);

    impl Recorded {
        async fn delete(
            &self,
            acks: Vec<u32>,
            gate: Option<tokio::sync::oneshot::Receiver<()>>,
            fails: bool,
        ) -> StoreResult<()> {
            if let Some(gate) = gate {
                let _ = gate.await;
            }
            self.0.lock().unwrap().push(acks);
            if fails {
                Err(StoreError::new(
                    crate::StoreErrorKind::Connection,
                    "connection reset",
                ))
            } else {
                Ok(())
            }
        }

        fn groups(&self) -> Vec<Vec<u32>> {
            self.0.lock().unwrap().clone()
        }
    }

    /// Acks `ack` on a task of its own, its delete recorded once `gate` opens (without one,
    /// at once).
    fn spawn_ack(
        deletes: &Arc<GroupDeletes<u32>>,
        recorded: &Arc<Recorded>,
        ack: u32,
        gate: Option<tokio::sync::oneshot::Receiver<()>>,
        fails: bool,
    ) -> tokio::task::JoinHandle<StoreResult<()>> {
        let (deletes, recorded) = (deletes.clone(), recorded.clone());
        let gate = Mutex::new(gate);
        tokio::spawn(async move {
            deletes
                .ack(
                    [ack],
                    |_| true,
                    |acks| recorded.delete(acks, gate.lock().unwrap().take(), fails),
                )
                .await
        })
    }

    /// Yields until `ready`, failing (not hanging) if it never comes.
    async fn until(ready: impl Fn() -> bool) {
        for _ in 0..1_000 {
            if ready() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the awaited state never came");
    }

    /// Ack 1, whose delete waits until `later` (each acked by a task of its own, their
    /// deletes failing if `later_fail`) are all queued behind it. Returns the later acks'
    /// outcomes, and the deletes and the record for more. At most 6 events in flight: 3
    /// acks queued are enough to start a delete at once.
    async fn acks_behind_a_running_delete(
        later: &[u32],
        later_fail: bool,
    ) -> (Vec<StoreResult<()>>, Arc<GroupDeletes<u32>>, Arc<Recorded>) {
        let deletes = Arc::new(GroupDeletes::new(6));
        let recorded = Arc::new(Recorded::default());
        let ack = |ack, gate, fails| spawn_ack(&deletes, &recorded, ack, gate, fails);
        let (open_gate, gate) = tokio::sync::oneshot::channel();
        let first = ack(1, Some(gate), false);
        until(|| deletes.running_with_none_queued()).await;
        let later: Vec<_> = later.iter().map(|id| ack(*id, None, later_fail)).collect();
        until(|| deletes.queued() == later.len()).await;
        open_gate.send(()).unwrap();
        first.await.unwrap().unwrap();
        let mut outcomes = Vec::new();
        for ack in later {
            outcomes.push(ack.await.unwrap());
        }
        (outcomes, deletes, recorded)
    }

    /// Three acks while a delete runs: the first to get the turn takes all three in one
    /// delete, at once (three are enough for this engine's limit), and the other two return
    /// its outcome without a statement of their own.
    #[tokio::test(start_paused = true)]
    async fn acks_queued_while_a_delete_runs_share_the_next_one() {
        let started = Instant::now();
        let (outcomes, _, recorded) = acks_behind_a_running_delete(&[2, 3, 4], false).await;
        assert!(outcomes.iter().all(|o| o.is_ok()));
        assert_eq!(recorded.groups(), vec![vec![1], vec![2, 3, 4]]);
        assert_eq!(started.elapsed(), Duration::ZERO, "enough acks: no spacing");
    }

    /// A failed delete's outcome reaches every ack it carried, and the next ack opens a
    /// new group with a delete of its own.
    #[tokio::test(start_paused = true)]
    async fn every_ack_of_a_failed_delete_fails_and_the_next_ack_runs_its_own() {
        let (outcomes, deletes, recorded) = acks_behind_a_running_delete(&[2, 3], true).await;
        for outcome in outcomes {
            let failure = outcome.unwrap_err();
            assert_eq!(failure.kind(), crate::StoreErrorKind::Connection);
        }
        deletes
            .ack([5], |_| true, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        assert_eq!(recorded.groups(), vec![vec![1], vec![2, 3], vec![5]]);
    }

    /// A group's delete refused for one row (a foreign key to it): it failed every ack the
    /// group carried, and each, split by the engine down to single rows, retried as if its
    /// own row were refused. Each caller's acks are deleted apart instead: only the one
    /// whose row it is gets the refusal.
    #[tokio::test(start_paused = true)]
    async fn a_delete_refused_for_one_row_fails_only_the_ack_that_carried_it() {
        let deletes = Arc::new(GroupDeletes::new(6));
        let recorded = Arc::new(Recorded::default());
        let refuse_3 = |recorded: Arc<Recorded>| {
            move |acks: Vec<u32>| {
                let recorded = recorded.clone();
                async move {
                    let refused = acks.contains(&3);
                    recorded.delete(acks, None, false).await?;
                    match refused {
                        true => Err(StoreError::new(
                            crate::StoreErrorKind::RowRefused,
                            "violates foreign key constraint",
                        )),
                        false => Ok(()),
                    }
                }
            }
        };
        let (open_gate, gate) = tokio::sync::oneshot::channel();
        let first = spawn_ack(&deletes, &recorded, 1, Some(gate), false);
        until(|| deletes.running_with_none_queued()).await;
        let later: Vec<_> = [vec![2], vec![3], vec![4, 5]]
            .into_iter()
            .map(|acks| {
                let (deletes, delete) = (deletes.clone(), refuse_3(recorded.clone()));
                tokio::spawn(async move { deletes.ack(acks, |_| true, delete).await })
            })
            .collect();
        until(|| deletes.queued() == 4).await;
        open_gate.send(()).unwrap();
        first.await.unwrap().unwrap();
        let mut outcomes = Vec::new();
        for ack in later {
            outcomes.push(ack.await.unwrap().map_err(|e| e.kind()));
        }
        assert_eq!(
            outcomes,
            [Ok(()), Err(crate::StoreErrorKind::RowRefused), Ok(())]
        );
        assert_eq!(
            recorded.groups(),
            vec![vec![1], vec![2, 3, 4, 5], vec![2], vec![3], vec![4, 5]]
        );
    }

    /// The ack that ran a group's delete is cancelled (its task aborted) while the delete
    /// runs: the other ack that delete carried gets an error to retry on. It used to get the
    /// outcome of the next group's delete, which did not carry it (an empty one: `Ok`).
    #[tokio::test(start_paused = true)]
    async fn the_acks_of_a_cancelled_delete_get_an_error_to_retry_on() {
        let deletes = Arc::new(GroupDeletes::new(10_000));
        let recorded = Arc::new(Recorded::default());
        deletes
            .ack([0], |_| true, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        // Ack 1 waits out the spacing after ack 0's delete; ack 2 joins its group meanwhile.
        let (_never_opened, gate) = tokio::sync::oneshot::channel::<()>();
        let runner = spawn_ack(&deletes, &recorded, 1, Some(gate), false);
        until(|| deletes.queued() == 1 && deletes.turn.try_lock().is_err()).await;
        let carried = spawn_ack(&deletes, &recorded, 2, None, false);
        until(|| deletes.queued() == 2).await;
        // The paused clock moves on once every task waits: ack 1's group starts its delete.
        tokio::time::sleep(DELETE_SPACING).await;
        until(|| deletes.running_with_none_queued()).await;
        runner.abort();
        let failure = carried.await.unwrap().unwrap_err();
        assert!(failure.is_retryable(), "{}", failure.report());
        assert!(
            failure.report().contains("cancelled"),
            "{}",
            failure.report()
        );
        deletes
            .ack([3], |_| true, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        assert_eq!(recorded.groups(), vec![vec![0], vec![3]]);
    }

    /// Deletes that run a statement are spaced; a group with nothing to delete (`outbox_emit`
    /// events, the table-less binlog form) neither waits nor moves the spacing.
    #[tokio::test(start_paused = true)]
    async fn only_groups_with_rows_wait_out_the_spacing() {
        let deletes = GroupDeletes::new(10_000);
        let recorded = Recorded::default();
        let started = Instant::now();
        deletes
            .ack([1], |_| true, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::ZERO,
            "the first starts at once"
        );
        tokio::time::advance(Duration::from_millis(30)).await;
        deletes
            .ack([2], |_| false, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        assert_eq!(
            started.elapsed(),
            Duration::from_millis(30),
            "nothing to delete: no wait"
        );
        deletes
            .ack([3], |_| true, |acks| recorded.delete(acks, None, false))
            .await
            .unwrap();
        assert_eq!(
            started.elapsed(),
            DELETE_SPACING,
            "spaced from the last delete that ran a statement, not from the empty group's"
        );
        assert_eq!(recorded.groups(), vec![vec![1], vec![2], vec![3]]);
    }
}
