//! The rows each node holds from owned-partition claims (which lease nothing in the table:
//! the next claim leaves them out), and the scan floor that lets a claim skip the part of
//! the pending index it has already been through.
//!
//! # The scan floor
//! A claim walks the pending index in id order from `start`. Below `start`, every row is
//! held by the node, in a partition it does not hold, or gone for good; so the walk skips
//! the held rows and the index entries of deleted rows that made every claim slower as a
//! drain went on.
//!
//! The floor may only pass rows that can never become claimable later without the node
//! knowing. The hard case is an insert in progress: it has drawn its id from the sequence,
//! but no snapshot shows it yet. Two earlier designs trusted snapshots and reordered keys.
//! This one asks the lock manager: an insert takes its `RowExclusiveLock` on the table
//! before it draws an id from the column default, and an application that draws the id
//! itself first (`SELECT nextval(..)`, as Hibernate and jOOQ do) holds the sequence's
//! `RowExclusiveLock` from that moment; both are kept until the transaction ends. So with
//! `seq`, the sequence's last value, read *before* `writers`, the sessions holding either
//! lock: once none of `writers` holds it any more, every id up to `seq` is committed (and
//! visible to a new snapshot) or never will be. A claim taken after that and scanning from
//! `start` has seen everything up to `seq`. This needs a sequence that hands out ids one at
//! a time (INCREMENT 1, CACHE 1): a session that caches ids, or an application that draws a
//! block of them (Hibernate's pooled optimiser), inserts them later holding no lock in
//! between, so the store checks both at run time and otherwise scans from the start.
//!
//! Rows not available yet (scheduled by the application, or waiting to retry) may be passed:
//! before each claim the store reads when the first of them in the node's partitions comes
//! due, and the floor is good only until then (`ClaimPlan::due`, checked by the claim
//! statement itself against the database's clock). A claim past that time returns nothing,
//! and the store claims again from zero, so a row coming due is claimed before the rows of
//! its key that it holds back.
//!
//! The floor also comes back down when rows below it become claimable again: rows released
//! or retried by this node (to their lowest id), another fence (to zero), and once a second
//! (to zero) for rows no claim can see coming: rows an operator moves back (`dead retry`,
//! `replay`).
//!
//! # When the floor is read
//! The floor costs four statements besides each claim (pipelined with it), and reading the
//! lock manager's view takes every lock-manager partition lock for a moment, which writers
//! taking their locks wait for. It pays when a walk from zero would pass many rows: while a
//! backlog drains (the last claim came back full) or while many rows are held. A node whose
//! last claim came back below its limit, holding few rows, is caught up: its next claim
//! scans from zero, one statement, as claims do while the floor is unusable. At 1,000 events
//! a second, the floor's statements on every claim cost writers about a fifth of their
//! commit rate and the relay its lead on the baseline's tail (BENCHMARKS.md, "The tail").

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use outbox_core::{Fence, SequenceId, StoreError};

/// How often the floor goes back to zero, so that rows moved back by an operator are found.
const FULL_SCAN_EVERY: Duration = Duration::from_secs(1);

/// Held rows past which claims read the floor even when caught up: a walk from zero would
/// pass them all.
const FLOOR_WORTH_HELD: usize = 1000;

/// How long claims go without the floor after a reason not to use it, before trying again
/// (a GRANT or an ALTER SEQUENCE then takes effect without a restart).
const FLOOR_RECHECK: Duration = Duration::from_secs(60);

/// Whether claims may use the scan floor. A transient error costs one claim its floor; a
/// reason that lasts (a missing privilege, index or sequence property) turns it off for
/// [`FLOOR_RECHECK`], said once per reason, and the floor comes back when it is gone.
pub struct FloorHealth {
    off: Mutex<Option<FloorOff>>,
    recheck: Duration,
}

impl Default for FloorHealth {
    fn default() -> Self {
        FloorHealth {
            off: Mutex::new(None),
            recheck: FLOOR_RECHECK,
        }
    }
}

struct FloorOff {
    until: Instant,
    reason: String,
}

impl FloorHealth {
    pub fn usable(&self) -> bool {
        let off = self.off.lock().expect("floor health lock");
        off.as_ref().is_none_or(|o| o.until <= Instant::now())
    }

    /// A floor statement failed.
    pub fn failed(&self, e: StoreError) {
        if e.is_retryable() {
            tracing::debug!(error = %e, "scan floor skipped for one claim");
        } else {
            self.unusable(format!(
                "{e}; to fix, grant the relay's role SELECT on the outbox's sequence \
                 (see `outbox-relay migrate --print`)"
            ));
        }
    }

    /// Claims scan from the start for a while, after saying why (once per reason).
    pub fn unusable(&self, reason: String) {
        let mut off = self.off.lock().expect("floor health lock");
        if off.as_ref().is_none_or(|o| o.reason != reason) {
            tracing::warn!(
                %reason,
                "claims scan the pending rows from the start (correct, but slower with a large \
                 backlog); checked again every {}s",
                self.recheck.as_secs()
            );
        }
        *off = Some(FloorOff {
            until: Instant::now() + self.recheck,
            reason,
        });
    }

    /// A claim used the floor.
    pub fn in_use(&self) {
        let mut off = self.off.lock().expect("floor health lock");
        if off.take().is_some() {
            tracing::info!("claims use the scan floor again");
        }
    }
}

/// What `floor_sequence` says about the outbox's sequence and the scheduled index.
pub struct SequenceCheck {
    has_sequence: bool,
    cache: Option<i64>,
    increment: Option<i64>,
    scheduled_index: bool,
}

impl SequenceCheck {
    pub fn from_row(row: &tokio_postgres::Row) -> Self {
        SequenceCheck {
            has_sequence: row.get(1),
            cache: row.get(2),
            increment: row.get(3),
            scheduled_index: row.get(4),
        }
    }

    /// Why the floor cannot vouch for ids on this table, with the fix.
    pub fn problem(&self) -> Option<String> {
        if !self.has_sequence {
            return Some(
                "the outbox's sequence_id has no sequence of its own (serial or identity), so \
                 the relay cannot tell when every id below a value has committed"
                    .into(),
            );
        }
        if self.cache != Some(1) || self.increment != Some(1) {
            return Some(format!(
                "the outbox's sequence hands out ids ahead (CACHE {}, INCREMENT BY {}), so a \
                 session can insert an id drawn earlier after later ids commit; where the \
                 application allows it, ALTER SEQUENCE .. CACHE 1 INCREMENT BY 1",
                self.cache.unwrap_or(0),
                self.increment.unwrap_or(0)
            ));
        }
        if !self.scheduled_index {
            return Some(
                "the outbox's scheduled index is missing; run `outbox-relay migrate`".into(),
            );
        }
        None
    }
}

/// Held rows and the scan floor per node (a process runs one node; tests run several on one
/// store).
#[derive(Default)]
pub struct OwnedClaims {
    nodes: Mutex<HashMap<String, NodeClaims>>,
}

#[derive(Default)]
struct NodeClaims {
    held: HashSet<SequenceId>,
    floor: Floor,
    /// The last claim came back below its limit (see "When the floor is read").
    caught_up: bool,
}

struct Floor {
    start: SequenceId,
    /// The fence `start` was found under.
    fence: Option<(Vec<i32>, Vec<i64>)>,
    /// A sequence value waiting for the sessions that could still insert below it.
    candidate: Option<(SequenceId, Vec<String>)>,
    /// When the first row `start` passed that was not available yet comes due
    /// (microseconds since the epoch, the database's clock); `None`: no such row.
    due: Option<i64>,
    /// Counts the times the floor came down; a claim whose plan saw another count may not
    /// raise it past the lowered value.
    lowered: u64,
    full_scan_at: Instant,
}

/// Where a claim that scans from the start starts: below every id. Ids are the sequence's,
/// from 1, unless the application inserts its own: a row given a negative id was never
/// claimed while the scan began at zero, and its key's later rows went out before it.
pub(crate) const FROM_THE_START: SequenceId = SequenceId::MIN;

impl Default for Floor {
    fn default() -> Self {
        Floor {
            start: FROM_THE_START,
            fence: None,
            candidate: None,
            due: None,
            lowered: 0,
            full_scan_at: Instant::now(),
        }
    }
}

impl Floor {
    fn lower_to(&mut self, id: SequenceId) {
        self.start = self.start.min(id);
        self.lowered += 1;
    }
}

/// What a claim scans: from `start`, leaving out `held` (only the held rows at or above it),
/// and only while the database's clock is before `due`.
pub struct ClaimPlan {
    pub start: SequenceId,
    pub held: Vec<SequenceId>,
    pub due: Option<i64>,
    lowered: u64,
}

/// What the database said around one claim, in the order it was read.
pub struct Observation<'a> {
    /// The sequence's last value, read before `writers`.
    pub sequence: SequenceId,
    /// Sessions holding the outbox's insert lock or the sequence's (virtual transaction ids).
    pub writers: Vec<String>,
    /// When the first row of the node's partitions not available yet comes due (read after
    /// `writers`, before the claim).
    pub next_due: Option<i64>,
    /// The ids the claim returned (read after `writers`).
    pub claimed: &'a [SequenceId],
    /// Whether the claim returned as many rows as it asked for.
    pub full: bool,
    /// Whether every partition of the fence was still held, lease unbroken, after the claim.
    pub fence_held: bool,
}

impl OwnedClaims {
    /// Whether `node`'s next claim should read the floor: it drains a backlog, or holds
    /// enough rows that a walk from zero would be long (see "When the floor is read").
    pub fn wants_floor(&self, node: &str) -> bool {
        let nodes = self.nodes.lock().expect("owned claims lock");
        nodes
            .get(node)
            .is_none_or(|c| !c.caught_up || c.held.len() >= FLOOR_WORTH_HELD)
    }

    /// Records whether `node`'s claim came back with as many rows as it asked for.
    pub fn claim_returned(&self, node: &str, full: bool) {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        nodes.entry(node.to_string()).or_default().caught_up = !full;
    }

    /// Where `node`'s next claim starts, and the held rows it must leave out.
    /// Without `use_floor`, the claim scans from the start.
    pub fn plan(&self, node: &str, fence: &Fence, use_floor: bool) -> ClaimPlan {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        let claims = nodes.entry(node.to_string()).or_default();
        let floor = &mut claims.floor;
        if !use_floor {
            floor.lower_to(FROM_THE_START);
        }
        let same_fence = floor
            .fence
            .as_ref()
            .is_some_and(|(p, e)| *p == fence.partitions && *e == fence.epochs);
        if !same_fence {
            floor.fence = Some((fence.partitions.clone(), fence.epochs.clone()));
            floor.candidate = None;
            floor.lower_to(FROM_THE_START);
        }
        if floor.full_scan_at.elapsed() >= FULL_SCAN_EVERY {
            floor.full_scan_at = Instant::now();
            floor.lower_to(FROM_THE_START);
        }
        let start = floor.start;
        ClaimPlan {
            start,
            due: floor.due,
            held: claims
                .held
                .iter()
                .copied()
                .filter(|id| *id >= start)
                .collect(),
            lowered: floor.lowered,
        }
    }

    /// Records a claim's rows; with `seen`, moves the floor up as far as it allows.
    pub fn claimed(
        &self,
        node: &str,
        plan: &ClaimPlan,
        ids: &[SequenceId],
        seen: Option<Observation<'_>>,
    ) {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        let claims = nodes.entry(node.to_string()).or_default();
        claims.held.extend(ids.iter().copied());
        let Some(seen) = seen else {
            return;
        };
        let floor = &mut claims.floor;
        let complete_up_to = if seen.writers.is_empty() {
            floor.candidate = None;
            Some(seen.sequence)
        } else {
            match floor.candidate.take() {
                Some((sequence, writers)) if !writers.iter().any(|w| seen.writers.contains(w)) => {
                    floor.candidate = Some((seen.sequence, seen.writers));
                    Some(sequence)
                }
                Some(waiting) => {
                    floor.candidate = Some(waiting);
                    None
                }
                None => {
                    floor.candidate = Some((seen.sequence, seen.writers));
                    None
                }
            }
        };
        let mut next = plan.start;
        if let (Some(sequence), true) = (complete_up_to, seen.fence_held) {
            // Up to here, every claimable row is now held, and every row not available yet
            // was counted in `next_due`.
            let covered = match seen.claimed.iter().max() {
                Some(&last) if seen.full => last.min(sequence),
                _ => sequence,
            };
            next = next.max(covered.saturating_add(1));
        }
        if floor.lowered != plan.lowered {
            next = next.min(floor.start);
        }
        floor.start = next;
        // Rows an earlier claim passed that are still not available were read again into
        // `next_due`; rows that came due since made this claim's statement return nothing.
        floor.due = seen.next_due;
    }

    /// A claim above the start found the floor's due time passed: the next one starts at
    /// the start.
    pub fn due_passed(&self, node: &str) {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        if let Some(claims) = nodes.get_mut(node) {
            claims.floor.lower_to(FROM_THE_START);
        }
    }

    /// Rows that settled or were released; returns those `node` held from owned claims.
    /// Rows that go back to pending (`pending_again`) bring the floor down to them.
    pub fn forget(&self, node: &str, ids: &[SequenceId], pending_again: bool) -> Vec<SequenceId> {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        let Some(claims) = nodes.get_mut(node) else {
            return Vec::new();
        };
        let forgotten: Vec<SequenceId> = ids
            .iter()
            .copied()
            .filter(|id| claims.held.remove(id))
            .collect();
        if pending_again {
            if let Some(&lowest) = ids.iter().min() {
                claims.floor.lower_to(lowest);
            }
        }
        forgotten
    }

    /// Forgets every row `node` holds from owned claims but `held` (what its engine
    /// holds); returns how many, which are claimable again.
    pub fn forget_all_but(&self, node: &str, held: &[SequenceId]) -> u64 {
        let held: HashSet<SequenceId> = held.iter().copied().collect();
        let unheld: Vec<SequenceId> = {
            let nodes = self.nodes.lock().expect("owned claims lock");
            let Some(claims) = nodes.get(node) else {
                return 0;
            };
            claims
                .held
                .iter()
                .copied()
                .filter(|id| !held.contains(id))
                .collect()
        };
        self.forget(node, &unheld, true).len() as u64
    }

    /// Whether `node` holds `id` from an owned claim.
    pub fn holds(&self, node: &str, id: SequenceId) -> bool {
        let nodes = self.nodes.lock().expect("owned claims lock");
        nodes.get(node).is_some_and(|c| c.held.contains(&id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence() -> Fence {
        Fence {
            count: 4,
            partitions: vec![0, 1, 2, 3],
            epochs: vec![1, 1, 1, 1],
        }
    }

    #[test]
    fn a_caught_up_node_claims_without_the_floor_until_a_claim_comes_back_full() {
        let owned = OwnedClaims::default();
        // Nothing known yet: a start-up may face a backlog.
        assert!(owned.wants_floor("n"));
        owned.claim_returned("n", false);
        assert!(
            !owned.wants_floor("n"),
            "caught up: one statement per claim"
        );
        let plan = owned.plan("n", &fence(), owned.wants_floor("n"));
        assert_eq!(
            plan.start, FROM_THE_START,
            "without the floor the claim scans from the start"
        );
        owned.claim_returned("n", true);
        assert!(owned.wants_floor("n"), "a full claim: a backlog to drain");
        assert!(owned.wants_floor("other"), "per node");
    }

    #[test]
    fn many_held_rows_bring_the_floor_back_while_claims_come_back_short() {
        let owned = OwnedClaims::default();
        owned.claim_returned("n", false);
        let plan = owned.plan("n", &fence(), false);
        let ids: Vec<SequenceId> = (1..FLOOR_WORTH_HELD as i64).collect();
        owned.claimed("n", &plan, &ids, None);
        assert!(!owned.wants_floor("n"));
        owned.claimed("n", &plan, &[FLOOR_WORTH_HELD as i64], None);
        assert!(
            owned.wants_floor("n"),
            "a walk from zero would pass every held row"
        );
        owned.forget("n", &[1], false);
        assert!(!owned.wants_floor("n"));
    }

    fn seen<'a>(
        sequence: i64,
        writers: &[&str],
        claimed: &'a [i64],
        full: bool,
    ) -> Observation<'a> {
        Observation {
            sequence,
            writers: writers.iter().map(|w| w.to_string()).collect(),
            claimed,
            full,
            next_due: None,
            fence_held: true,
        }
    }

    #[test]
    fn a_transient_error_costs_one_claim_and_a_lasting_reason_is_checked_again() {
        use outbox_core::StoreErrorKind;
        let health = FloorHealth::default();
        health.failed(StoreError::new(
            StoreErrorKind::Connection,
            "connection reset",
        ));
        assert!(health.usable(), "a transient error keeps the floor");
        health.failed(StoreError::new(
            StoreErrorKind::Privilege,
            "permission denied for sequence",
        ));
        assert!(!health.usable(), "a missing privilege turns it off");
        health.in_use();
        assert!(health.usable());

        let soon = FloorHealth {
            recheck: Duration::ZERO,
            ..FloorHealth::default()
        };
        soon.unusable("CACHE 20".into());
        assert!(
            soon.usable(),
            "tried again once the recheck time has passed"
        );
    }

    #[test]
    fn held_rows_are_kept_per_node_until_forgotten() {
        let c = OwnedClaims::default();
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[5, 9], None);
        c.claimed("b", &plan, &[7], None);
        assert!(c.holds("a", 5) && !c.holds("a", 7));
        assert_eq!(c.forget("a", &[5, 7], false), [5]);
        assert_eq!(c.plan("a", &fence(), true).held, [9]);
    }

    #[test]
    fn the_floor_waits_for_the_writers_seen_with_the_sequence() {
        let c = OwnedClaims::default();
        // Sequence at 10 while writer 3/7 may still be inserting below it: no move.
        let plan = c.plan("a", &fence(), true);
        c.claimed(
            "a",
            &plan,
            &[1, 2],
            Some(seen(10, &["3/7"], &[1, 2], false)),
        );
        assert_eq!(c.plan("a", &fence(), true).start, FROM_THE_START);
        // 3/7 still there (with a newcomer): still no move.
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[], Some(seen(12, &["3/7", "4/1"], &[], false)));
        assert_eq!(c.plan("a", &fence(), true).start, FROM_THE_START);
        // 3/7 has ended: everything up to 10 was visible to this claim.
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[3], Some(seen(14, &["4/1"], &[3], false)));
        let next = c.plan("a", &fence(), true);
        assert_eq!(next.start, 11);
        assert!(
            next.held.is_empty(),
            "held rows below the floor are not sent"
        );
    }

    #[test]
    fn a_full_claim_covers_only_up_to_its_last_row() {
        let c = OwnedClaims::default();
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[4, 5], Some(seen(100, &[], &[4, 5], true)));
        assert_eq!(c.plan("a", &fence(), true).start, 6);
    }

    #[test]
    fn retries_releases_and_new_fences_bring_the_floor_down() {
        let c = OwnedClaims::default();
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[4, 5], Some(seen(50, &[], &[4, 5], false)));
        assert_eq!(c.plan("a", &fence(), true).start, 51);
        c.forget("a", &[5], true);
        assert_eq!(c.plan("a", &fence(), true).start, 5);

        // A partition lease that lapsed during the claim: no move.
        let plan = c.plan("a", &fence(), true);
        let mut s = seen(90, &[], &[], false);
        s.fence_held = false;
        c.claimed("a", &plan, &[], Some(s));
        assert_eq!(c.plan("a", &fence(), true).start, 5);

        // A claim that found the floor's due time passed: back to zero.
        c.due_passed("a");
        assert_eq!(c.plan("a", &fence(), true).start, FROM_THE_START);

        let other = Fence {
            epochs: vec![1, 2, 1, 1],
            ..fence()
        };
        assert_eq!(c.plan("a", &other, true).start, FROM_THE_START);
    }

    #[test]
    fn rows_not_available_yet_are_passed_only_until_the_first_comes_due() {
        let c = OwnedClaims::default();
        // A row waiting an hour to retry no longer caps the floor: the floor passes it and
        // carries its due time, for the claim statement to check.
        let plan = c.plan("a", &fence(), true);
        let mut s = seen(80, &[], &[], false);
        s.next_due = Some(3_600_000_000);
        c.claimed("a", &plan, &[], Some(s));
        let plan = c.plan("a", &fence(), true);
        assert_eq!((plan.start, plan.due), (81, Some(3_600_000_000)));
        // The next claim reads the due times again: the row was claimed or came due.
        c.claimed("a", &plan, &[], Some(seen(85, &[], &[], false)));
        assert_eq!(c.plan("a", &fence(), true).due, None);
    }

    #[test]
    fn a_release_during_a_claim_is_not_overwritten() {
        let c = OwnedClaims::default();
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[2], Some(seen(20, &[], &[2], false)));
        let plan = c.plan("a", &fence(), true);
        assert_eq!(plan.start, 21);
        c.forget("a", &[2], true);
        c.claimed("a", &plan, &[], Some(seen(40, &[], &[], false)));
        assert_eq!(c.plan("a", &fence(), true).start, 2);
    }
}
