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
//! before it draws an id, and keeps it until it has committed or aborted. So with `seq`, the
//! sequence's last value, read *before* `writers`, the sessions holding that lock: once
//! none of `writers` holds it any more, every id up to `seq` is committed (and visible to a
//! new snapshot) or never will be. A claim taken after that and scanning from `start` has
//! seen everything up to `seq`.
//!
//! The floor comes back down when rows below it become claimable again: rows released or
//! retried by this node (to their lowest id), another fence (to zero), and once a second (to
//! zero) for rows no claim can see coming: rows an operator moves back (`dead retry`,
//! `replay`) and rows scheduled for later by the application. It never passes a row waiting
//! to retry (it would block its key's later rows until due, then be passed over).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use outbox_core::{Fence, SequenceId};

/// How often the floor goes back to zero, so that rows moved back by an operator or
/// scheduled by the application are found.
const FULL_SCAN_EVERY: Duration = Duration::from_secs(1);

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
}

struct Floor {
    start: SequenceId,
    /// The fence `start` was found under.
    fence: Option<(Vec<i32>, Vec<i64>)>,
    /// A sequence value waiting for the sessions that could still insert below it.
    candidate: Option<(SequenceId, Vec<String>)>,
    /// Counts the times the floor came down; a claim whose plan saw another count may not
    /// raise it past the lowered value.
    lowered: u64,
    full_scan_at: Instant,
}

impl Default for Floor {
    fn default() -> Self {
        Floor {
            start: 0,
            fence: None,
            candidate: None,
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

/// What a claim scans: from `start`, leaving out `held` (only the held rows at or above it).
pub struct ClaimPlan {
    pub start: SequenceId,
    pub held: Vec<SequenceId>,
    lowered: u64,
}

/// What the database said around one claim, in the order it was read.
pub struct Observation<'a> {
    /// The sequence's last value, read before `writers`.
    pub sequence: SequenceId,
    /// Sessions holding the outbox's insert lock (virtual transaction ids).
    pub writers: Vec<String>,
    /// The ids the claim returned (read after `writers`).
    pub claimed: &'a [SequenceId],
    /// Whether the claim returned as many rows as it asked for.
    pub full: bool,
    /// The lowest pending row waiting to retry or retried (read after the claim).
    pub lowest_retry: Option<SequenceId>,
    /// Whether every partition of the fence was still held, lease unbroken, after the claim.
    pub fence_held: bool,
}

impl OwnedClaims {
    /// Where `node`'s next claim starts, and the held rows it must leave out.
    /// Without `use_floor`, the claim scans from the start.
    pub fn plan(&self, node: &str, fence: &Fence, use_floor: bool) -> ClaimPlan {
        let mut nodes = self.nodes.lock().expect("owned claims lock");
        let claims = nodes.entry(node.to_string()).or_default();
        let floor = &mut claims.floor;
        if !use_floor {
            floor.lower_to(0);
        }
        let same_fence = floor
            .fence
            .as_ref()
            .is_some_and(|(p, e)| *p == fence.partitions && *e == fence.epochs);
        if !same_fence {
            floor.fence = Some((fence.partitions.clone(), fence.epochs.clone()));
            floor.candidate = None;
            floor.lower_to(0);
        }
        if floor.full_scan_at.elapsed() >= FULL_SCAN_EVERY {
            floor.full_scan_at = Instant::now();
            floor.lower_to(0);
        }
        let start = floor.start;
        ClaimPlan {
            start,
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
        seen: Option<Observation>,
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
            // Up to here, every claimable row is now held.
            let covered = match seen.claimed.iter().max() {
                Some(&last) if seen.full => last.min(sequence),
                _ => sequence,
            };
            next = next.max(covered.saturating_add(1));
        }
        if let Some(retry) = seen.lowest_retry {
            next = next.min(retry);
        }
        if floor.lowered != plan.lowered {
            next = next.min(floor.start);
        }
        floor.start = next;
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
            lowest_retry: None,
            fence_held: true,
        }
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
        assert_eq!(c.plan("a", &fence(), true).start, 0);
        // 3/7 still there (with a newcomer): still no move.
        let plan = c.plan("a", &fence(), true);
        c.claimed("a", &plan, &[], Some(seen(12, &["3/7", "4/1"], &[], false)));
        assert_eq!(c.plan("a", &fence(), true).start, 0);
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

        // A row waiting to retry caps the floor.
        let plan = c.plan("a", &fence(), true);
        let mut s = seen(80, &[], &[], false);
        s.lowest_retry = Some(7);
        c.claimed("a", &plan, &[], Some(s));
        assert_eq!(c.plan("a", &fence(), true).start, 7);

        // A partition lease that lapsed during the claim: no move.
        let plan = c.plan("a", &fence(), true);
        let mut s = seen(90, &[], &[], false);
        s.fence_held = false;
        c.claimed("a", &plan, &[], Some(s));
        assert_eq!(c.plan("a", &fence(), true).start, 7);

        let other = Fence {
            epochs: vec![1, 2, 1, 1],
            ..fence()
        };
        assert_eq!(c.plan("a", &other, true).start, 0);
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
